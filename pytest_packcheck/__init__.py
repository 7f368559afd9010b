"""packcheck: does padding-free packing train the same model?

Import-light on purpose: the pytest plugin is loaded in every pytest run of an environment that has packcheck.
"""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed distribution's metadata on first use (importlib.metadata costs tens of
    milliseconds at import: ``packcheck lookup`` and the plugin's load do without it); "0.0.0" in a source tree that
    was never installed."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from importlib.metadata import version

        value = version("packcheck")
    except Exception:  # noqa: BLE001 - running from a source tree without installation
        value = "0.0.0"
    globals()["__version__"] = value
    return value
