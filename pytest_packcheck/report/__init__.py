"""Reports: a results document in, the report files out. Pure and deterministic (no torch, no transformers).

The flow: :func:`model.build_report` reads the document once into a format-neutral :class:`model.Report`
(layout, each matrix cell's headline from :mod:`.verdicts`, hazards, findings, do-not-pack, what did not run,
the environment rows, the gate); one renderer module per format turns it into text (:mod:`.markdown` with
:mod:`.sections`, :mod:`.details`, :mod:`.html`, :mod:`.jsonfile`, :mod:`.csvfile`, and :mod:`.terminal` for
pytest's summary); :data:`formats.FORMATS` lists the files and :func:`formats.write_reports` writes them as one
set. Key numbers are formatted from the check registry (:mod:`.numbers`); :mod:`.text` holds the escaping that
bench, gate and the atlas use too.

The names below are loaded on first use (PEP 562): importing ``pytest_packcheck.report.text`` (as bench and gate
do) must not load the renderers, one of which reads bench's figures.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "FORMATS": "formats", "REPORT_FILES": "formats", "ReportFormat": "formats", "write_reports": "formats",
    "render_markdown": "formats", "render_details": "formats", "render_html": "formats", "html_data": "formats",
    "render_terminal": "formats",
    "Report": "model", "build_report": "model", "departures": "model", "environment_rows": "model",
    "hazard_rows": "model", "layout": "model",
    "KEY_METRIC": "numbers", "key_number": "numbers",
    "cut": "text", "escape_md": "text", "plain": "text",
    "cell_status": "verdicts", "check_mark": "verdicts", "counts_line": "verdicts", "headline": "verdicts",
    "matrix_counts": "verdicts",
}

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
