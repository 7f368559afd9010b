"""The report formats, described once: one record per file a run writes (name, file, renderer). The file lists
elsewhere (``write_reports``, the session's checks and clean-up) are derived from :data:`FORMATS`. Adding a format
is 3 files: its renderer module (``render(rep: Report) -> str``), one :class:`ReportFormat` record in :data:`FORMATS`
here, and a test in tests/test_report_formats.py that reads the file back and catches a planted fault. It is written
beside the others, not committed under reports/ unless tools/rerender.py's ``MATRIX_FILES`` names it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import csvfile, details, html, jsonfile, markdown, terminal
from .model import Report, build_report


@dataclass(frozen=True)
class ReportFormat:
    """A file of the report set. ``name``: a short name; ``file``: its name in the report folder; ``render``:
    :class:`model.Report` -> the file's text (pure, deterministic); ``last``: renamed into place after every
    other file of the set (the JSON, which ``gate``, ``merge`` and ``--packcheck-resume`` read: it is never newer
    than its siblings)."""

    name: str
    file: str
    render: Callable[[Report], str]
    last: bool = False


#: The files of one report set, in the order their paths are listed (the terminal's "matrix written" lines).
FORMATS: tuple[ReportFormat, ...] = (
    ReportFormat("markdown", "packcheck-matrix.md", markdown.render),
    ReportFormat("json", "packcheck-matrix.json", jsonfile.render, last=True),
    ReportFormat("html", "packcheck-matrix.html", html.render),
    ReportFormat("details", "packcheck-details.md", details.render),
    ReportFormat("csv", "packcheck-matrix.csv", csvfile.render),
)
#: Their file names.
REPORT_FILES: tuple[str, ...] = tuple(f.file for f in FORMATS)


def write_reports(out: Any, doc: dict[str, Any], flag: str = "--packcheck-report-dir") -> list[str]:
    """Write every file of :data:`FORMATS` into the folder ``out`` (atomically, scrubbed), rendered from one
    :class:`model.Report` of ``doc``; returns their paths in :data:`FORMATS` order. Written as one set
    (:func:`results.write_set`): every text is rendered first, the old files are removed, then the new ones are
    renamed in, the ``last`` one (the JSON) last, so a kill leaves the old set or part of the new one, never this
    run's JSON beside the previous run's Markdown, details or HTML.

    Raises:
        PackcheckUsageError: the folder cannot be written (a full disk is named as such).
    """
    from ..results import write_set

    rep = build_report(doc)
    files = [(Path(out) / f.file, f.render(rep)) for f in FORMATS]
    write_set([pair for pair, f in sorted(zip(files, FORMATS, strict=True), key=lambda x: x[1].last)], flag)
    return [str(p) for p, _ in files]


#: The folder beside the report set where version-environment runs keep their logs (``versions.envs.run_in_env``).
LOGS_DIR = "logs"


def remove_unreferenced_logs(out: Any, doc: dict[str, Any]) -> list[str]:
    """Remove the ``*.log`` files of ``out/logs/`` that no cell of ``doc`` names (``cell["env"]["log"]``): a
    previous run's version-environment logs must not stand beside a matrix that has no such environment. The
    folder goes too when it is left empty. Returns the removed paths (the caller says so in one line); a file
    that cannot be removed is left (the matrix is already written).
    """
    folder = Path(out) / LOGS_DIR
    if not folder.is_dir():
        return []
    kept = {(c.get("env") or {}).get("log") for c in doc.get("cells", [])}
    gone = []
    for log in sorted(folder.glob("*.log")):
        if log.is_file() and f"{LOGS_DIR}/{log.name}" not in kept:
            try:
                log.unlink()
                gone.append(str(log))
            except OSError:
                pass
    try:
        folder.rmdir()  # only when empty
    except OSError:
        pass
    return gone


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
    """pytest's terminal summary of a results document, then ``paths`` (:mod:`.terminal`; not a file of the set)."""
    return terminal.render(build_report(doc), paths)
