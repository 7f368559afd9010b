"""``packcheck-matrix.csv``: the matrix for spreadsheets, one row per matrix cell (model x backend x dtype x
version environment; model-level checks are stack findings, not cells). Pure: a :class:`model.Report` in, text
out (the stdlib ``csv`` writer: RFC 4180 quoting, ``\\r\\n`` line ends)."""

from __future__ import annotations

import csv
import io

from .model import Report
from .numbers import key_number
from .verdicts import check_order

#: The columns, in order. ``versions``: the cell's ``--packcheck-versions`` label ("" for this environment);
#: ``verdict``: the headline status (results.STATUSES); ``cause``: the headline's cause codes, worst first;
#: ``check`` and ``key number``: the check the verdict rests on (the first failing correctness check, else the
#: first that ran, :func:`verdicts.check_order`: isolation first) and its number as the Markdown writes it.
COLUMNS = ("model", "backend", "dtype", "versions", "verdict", "cause", "check", "key number")


def rows(rep: Report) -> list[dict[str, str]]:
    """The matrix cells in the Markdown's order (dtype, model, backend, version environment)."""
    lay = rep.layout
    out = []
    for dtype in lay.dtypes:
        for model in lay.models:
            for backend in lay.backends:
                for env in lay.envs:
                    h = rep.headlines.get((model, backend, dtype, env))
                    if not h:
                        continue
                    ran = sorted((c for c in h["cells"] if c["status"] != "skipped"), key=lambda c: (check_order(c["check"]), c["check"]))
                    # a cell an interrupted run did not finish rests on no number (its checks are "not run")
                    first = None if h.get("not_run") and h["status"] == "skipped" else (h["bad"] or ran or [None])[0]
                    out.append({"model": model, "backend": backend, "dtype": dtype, "versions": env or "",
                                "verdict": h["status"], "cause": ", ".join(h["causes"]) if h["status"] != "pass" else "",
                                "check": first["check"] if first else "", "key number": key_number(first) if first else ""})
    return out


def render(rep: Report) -> str:
    """The CSV text: a header row (:data:`COLUMNS`), then :func:`rows`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows(rep))
    return buf.getvalue()
