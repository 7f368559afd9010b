"""packcheck: does padding-free packing train the same model?

Import-light on purpose: the pytest plugin is loaded in every pytest run of an environment that has packcheck.
"""

from __future__ import annotations

try:
    from importlib.metadata import version as _version

    __version__ = _version("packcheck")
except Exception:  # noqa: BLE001 - running from a source tree without installation
    __version__ = "0.0.0"
