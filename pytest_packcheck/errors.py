"""Exceptions and warnings packcheck raises. Import-light."""

from __future__ import annotations

import os
import re

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY)", re.IGNORECASE)


def scrub_secrets(text: str) -> str:
    """``text`` with the value of every secret-looking environment variable (HF_TOKEN,
    HUGGING_FACE_HUB_TOKEN, ...: a name with TOKEN, SECRET, PASSWORD, API_KEY or ACCESS_KEY, value of 8+
    characters) replaced by ``***``: for what reaches a terminal (test ids, error lines) as well as files."""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name) and value in text:
            text = text.replace(value, "***")
    return text


class PackcheckError(Exception):
    """Base class of packcheck's own errors."""


class PackcheckUsageError(PackcheckError):
    """Bad input from the user: a one-line message naming the value, where it came from and the fix.

    The pytest plugin turns it into ``pytest.UsageError`` and the CLI into exit code 2. The message is
    :func:`scrub_secrets`-ed: a token pasted where a model ID belongs is not echoed back.
    """

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(scrub_secrets(str(message)), *args)


class PackcheckWarning(UserWarning):
    """Base class of every warning packcheck emits, so users can filter them with one entry."""


def closest(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), or an empty string."""
    import difflib

    match = difflib.get_close_matches(value, list(choices), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""
