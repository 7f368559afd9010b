"""Reports: a results document in, the report files out. Pure and deterministic (no torch, no transformers).

The flow: :func:`model.build_report` reads the document once into a format-neutral :class:`model.Report`
(layout, each matrix cell's headline from :mod:`.verdicts`, hazards, findings, do-not-pack, what did not run,
the environment rows, the gate); one renderer module per format turns it into text (:mod:`.markdown` with
:mod:`.sections`, :mod:`.details`, :mod:`.html`, :mod:`.jsonfile`, and :mod:`.terminal` for pytest's
summary); :data:`formats.FORMATS` lists the files and :func:`formats.write_reports` writes them as one
set. Key numbers are formatted from the check registry (:mod:`.numbers`).

The ``render_*`` functions below take a results document (they build the :class:`Report`), for the callers that
render one format.
"""

from __future__ import annotations

from typing import Any

from . import details, html, markdown, terminal
from .formats import FORMATS, REPORT_FILES, ReportFormat, write_reports
from .model import Report, build_report, departures, environment_rows, hazard_rows, layout
from .numbers import KEY_METRIC, key_number
from .text import cut, escape_md, plain
from .verdicts import cell_status, check_mark, counts_line, headline, matrix_counts

__all__ = ["FORMATS", "KEY_METRIC", "REPORT_FILES", "Report", "ReportFormat", "build_report", "cell_status", "check_mark",
           "counts_line", "cut", "departures", "environment_rows", "escape_md", "hazard_rows", "headline", "html_data",
           "key_number", "layout", "matrix_counts", "plain", "render_details", "render_html", "render_markdown",
           "render_terminal", "write_reports"]


def render_markdown(doc: dict[str, Any]) -> str:
    """``packcheck-matrix.md`` of a results document (:mod:`.markdown`)."""
    return markdown.render(build_report(doc))


def render_details(doc: dict[str, Any]) -> str:
    """``packcheck-details.md`` of a results document (:mod:`.details`)."""
    return details.render(build_report(doc))


def render_html(doc: dict[str, Any]) -> str:
    """``packcheck-matrix.html`` of a results document (:mod:`.html`)."""
    return html.render(build_report(doc))


def html_data(doc: dict[str, Any]) -> dict[str, Any]:
    """The data the HTML page embeds (:func:`html.page_data`)."""
    return html.page_data(build_report(doc))


def render_terminal(doc: dict[str, Any], paths: list[str]) -> list[str]:
    """pytest's terminal summary of a results document, then ``paths`` (:mod:`.terminal`)."""
    return terminal.render(build_report(doc), paths)
