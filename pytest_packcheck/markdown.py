"""Text helpers shared by the renderers (report, bench, gate): no packcheck imports, no heavy imports."""

from __future__ import annotations

import re
from typing import Any


def escape_md(text: Any) -> str:
    """Escape model-provided text for a Markdown table cell: no pipes, HTML, links or line breaks."""
    s = " ".join(str(text).split())
    s = s.replace("\\", "\\\\")
    s = re.sub(r"([|<>\[\]`*_])", r"\\\1", s)
    return s


def plain(text: Any) -> str:
    """Text for a terminal: one line, no Markdown escapes."""
    return " ".join(str(text).split())
