"""``packcheck-matrix.csv``: the matrix for spreadsheets, one row per matrix cell (model x backend x dtype x
version environment; model-level checks are stack findings, not cells). Pure: a :class:`model.Report` in, text
out (the stdlib ``csv`` writer: RFC 4180 quoting, ``\\r\\n`` line ends)."""

from __future__ import annotations

import csv
import io

from .model import Report
from .numbers import key_number
from .text import cut
from .verdicts import (
    SYMBOLS,
    VERDICT_WORDS,
    check_order,
    checked_only,
    headline_text,
    pass_qualifier,
    verdict_key,
)

#: The columns, in order. ``versions``: the cell's ``--packcheck-versions`` label ("" for this environment);
#: ``verdict``: the headline's verdict in the words of the Markdown and HTML (:data:`verdicts.VERDICT_WORDS` of
#: :func:`verdicts.verdict_key`: "pass", "fail", ..., "not checked", "not run (interrupted)"); ``cause``: the
#: headline's cause codes, worst first;
#: ``check`` and ``key number``: the check the verdict rests on (the first failing correctness check, else the
#: first that ran, :func:`verdicts.check_order`: isolation first) and its number as the Markdown writes it;
#: ``note``: what the Markdown matrix says of the cell beyond its symbol (:func:`note`): a pass's checks not
#: checked, "not run: ... (interrupted)" for a cell an interrupted run never finished, a skipped cell's reason.
COLUMNS = ("model", "backend", "dtype", "versions", "verdict", "cause", "check", "key number", "note")


def note(h: dict, marks: list[str] | None = None) -> str:
    """The cell's text as the Markdown matrix writes it (:func:`verdicts.headline_text`), without its symbol (a
    pass: its qualifier without the parentheses), and for a cell not checked the reason its first check gives."""
    if h["status"] == "pass":
        return "; ".join([x for x in (pass_qualifier(h),) if x] + [f"⚑ {m}" for m in marks or []])
    text = headline_text(h, marks).removeprefix(SYMBOLS[h["status"]]).strip()
    if h["status"] == "skipped" and not h.get("not_run") and h.get("not_checked"):
        check, why = next(iter(h["not_checked"].items()))
        text += f": {check}: {cut(' '.join(str(why).split()), 140)}"
    return text


def rows(rep: Report) -> list[dict[str, str]]:
    """The matrix cells in the Markdown's order (dtype, model, backend, version environment)."""
    lay = rep.layout
    out = []
    partial = bool(rep.coverage)  # the run left correctness checks out: a pass names the ones it rests on
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
                                "verdict": VERDICT_WORDS[verdict_key(h)], "cause": ", ".join(h["causes"]) if h["status"] != "pass" else "",
                                "check": first["check"] if first else "", "key number": key_number(first) if first else "",
                                "note": "; ".join(x for x in (note(h, rep.marks.get((model, env, dtype, backend))),
                                                              checked_only(rep.cells, h, model, dtype, backend, partial)) if x)})
    return out


def render(rep: Report) -> str:
    """The CSV text: a header row (:data:`COLUMNS`), then :func:`rows`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows(rep))
    return buf.getvalue()
