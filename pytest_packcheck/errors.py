"""Exceptions and warnings packcheck raises. Import-light."""

from __future__ import annotations


class PackcheckError(Exception):
    """Base class of packcheck's own errors."""


class PackcheckUsageError(PackcheckError):
    """Bad input from the user: a one-line message naming the value, where it came from and the fix.

    The pytest plugin turns it into ``pytest.UsageError`` and the CLI into exit code 2.
    """


class PackcheckWarning(UserWarning):
    """Base class of every warning packcheck emits, so users can filter them with one entry."""


def closest(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), or an empty string."""
    import difflib

    match = difflib.get_close_matches(value, list(choices), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""
