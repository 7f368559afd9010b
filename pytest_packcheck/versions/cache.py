"""Where packcheck keeps what it can rebuild: version environments (:mod:`.envs`), the atlas's split index
(:func:`pytest_packcheck.analysis.support_file.load_support_view`). Standard library only: ``packcheck lookup`` imports
it on every start."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PACKCHECK_CACHE_DIR``, else ``$XDG_CACHE_HOME/packcheck``, else ``~/.cache/packcheck`` (not created here)."""
    base = os.environ.get("PACKCHECK_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packcheck"
