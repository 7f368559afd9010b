"""Text helpers shared by the renderers (the report's, bench's, gate's, the atlas's): no heavy imports, no packcheck
imports but :func:`escape_md`, defined beside the secret scrubber (:mod:`pytest_packcheck.errors`). Pure."""

from __future__ import annotations

import re
from typing import Any

from ..errors import escape_md

__all__ = ["cut", "escape_md", "fmt_metric", "github_table", "plain"]  # escape_md: the renderers' one Markdown escape


def plain(text: Any) -> str:
    """Text for a terminal: one line, no Markdown escapes."""
    return " ".join(str(text).split())


def cut(text: str, n: int) -> str:
    """``text`` in at most ``n`` characters, cut at a word boundary (never mid-word) with "…"."""
    if len(text) <= n:
        return text
    head = text[: n - 1]
    space = head.rfind(" ")
    return (head[:space] if space > n // 2 else head).rstrip(" ,;:") + "…"


def fmt_metric(value: Any) -> str:
    """A number as the report prints it: a float in two significant digits (``3.1e-02``), anything else as is."""
    if isinstance(value, float):
        return f"{value:.1e}"
    return str(value)


_BARE_PIPE = re.compile(r"(?<!\\)\|")


def github_table(rows: Any, headers: Any) -> str:
    """A GitHub Markdown table (tabulate's ``github`` format) whose headers and cells never break it: every pipe not
    already escaped (by :func:`escape_md`) is escaped, so a backend named ``paged|sdpa`` stays one column (trial 11,
    185: 4 header cells against 3). The one way every Markdown table of packcheck is written."""
    from tabulate import tabulate

    def cell(x: Any) -> Any:
        return _BARE_PIPE.sub(r"\\|", x) if isinstance(x, str) else x

    return tabulate([[cell(x) for x in row] for row in rows], headers=[cell(h) for h in headers], tablefmt="github")
