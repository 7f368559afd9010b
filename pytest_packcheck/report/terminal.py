"""The terminal summary pytest prints after a run (plain text, no Markdown): versions, counts, one line per model
and backend with its headline verdict and cause, then the stack hazards and findings once each, then the files
written. Pure: a :class:`model.Report` in, lines out."""

from __future__ import annotations

from collections import defaultdict

from ..results import SYMBOLS
from .model import Report, banners, environment_line, environment_role
from .text import cut, plain
from .verdicts import VERDICT_WORDS, cause_label, counts_line, env_label, headline_text, not_run, role_of, verdict_key


def render(rep: Report, paths: list[str]) -> list[str]:
    """Lines for pytest's terminal summary (plain text, no Markdown): versions, totals, one line per model and
    backend with its headline verdict and cause, then the stack hazards once each, then ``paths`` (the files
    written)."""
    cells = rep.cells
    lines = [
        # a --packcheck-versions run: these are the controller's versions, not those its cells ran with
        (f"{environment_role(True)}: " if rep.layout.versioned else "")
        + f"{environment_line(rep.doc['environment'])}, device {rep.doc['environment'].get('device')}",
        *(text + "." for _, text in banners(rep.doc)),
        counts_line(cells, symbols=False, covered=rep.coverage),
        "(pytest counts one item per check: hazards and findings are its xfailed items, never failures.)",
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        where = c["dtype"] + (f" @ {env_label(c)}" if env_label(c) else "")
        groups[(c["model"]["label"], c["backend"] or "(model level)", where)].append(c)
    marks = rep.marks
    # passes once per backend (the models named), not-checked once per backend and reason (with the count, the
    # reason whole), every other verdict on its own line with its cause and remedy
    passed: dict[tuple[str, str], list[str]] = defaultdict(list)
    unchecked: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for (label, backend, where), group in sorted(groups.items()):
        if backend == "(model level)" and all(role_of(c) != "correctness" for c in group):
            continue  # stack findings: summarised below
        h = rep.headlines[(label, group[0]["backend"], group[0]["dtype"], env_label(group[0]))]
        if h.get("no_correctness"):
            continue  # only hazards / findings ran: summarised below, never a cell verdict
        text = plain(headline_text(h, marks.get((label, env_label(group[0]), group[0]["dtype"], group[0]["backend"]))))
        if h["status"] == "pass" and text == SYMBOLS["pass"]:
            passed[(backend, where)].append(label)
            continue
        if h["status"] == "skipped":
            # the reason of a check that did not run: an interrupted cell's first checks may have passed
            unrun = verdict_key(h) == "not_run"  # its reason is that of an unrun check, not of one the environment lacks
            why = " ".join(str(next(c for c in (h["cells"] or group) if c["status"] == "skipped" and not_run(c) == unrun)["message"]).split())
            unchecked[(VERDICT_WORDS[verdict_key(h)], backend, where, why)].append(label)
            continue
        reason = ""
        if h["status"] in ("error", "timeout", "oom", "unsupported") and h["cells"]:
            message = plain((h["bad"] or h["cells"])[0]["message"])
            # a message that opens with the cell's own text ("probe inconclusive: ...") says it once
            message = message.removeprefix(f"{text[2:].strip()}: ")
            reason = ": " + cut(message, 110)
        fix = ((h["bad"][0].get("diagnosis") or {}).get("remedy") if h["bad"] and h["status"] in ("fail", "fallback") else None)
        lines.append(f"  {h['status']:11s} {label} / {backend} / {where}: {text[2:].strip() or h['status']}{reason}"
                     + (f" — remedy: {cut(plain(fix), 140)}" if fix else ""))
    for (backend, where), models in sorted(passed.items()):
        lines.append(f"  pass        {backend} / {where}: {len(models)} {'model' if len(models) == 1 else 'models'} "
                     f"({cut(', '.join(models), 160)})")
    for (word, backend, where, why), models in sorted(unchecked.items()):  # "not checked", "not run (interrupted)"
        lines.append(f"  {word} {backend} / {where}, {len(models)} {'model' if len(models) == 1 else 'models'}: {plain(why)}")
    for (hazard, env, dtype, backend), row in sorted(rep.hazards.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        if row["shown"]:
            lines.append(f"  hazard      {cause_label(hazard)} on {backend} / {dtype}{f' @ {env}' if env else ''}: "
                         f"{len(row['shown'])}/{len(row['measured'])} models")
    # models, not cells: a model measured in two dtypes is one model (trial 18, 228); the failed items are the
    # report's stack findings (model.stack_findings), over the models each finding check measured
    measured: dict[str, dict[str, None]] = defaultdict(dict)
    for c in cells:
        if role_of(c) == "finding" and c["status"] in ("pass", "fail"):
            measured[c["check"]][c["model"]["label"]] = None
    for (check, text), models in sorted(rep.findings.items()):
        lines.append(f"  finding     {check} {cut(plain(text), 110)} ({len(models)}/{len(measured[check])} models)")
    lines += [f"matrix written: {p}" for p in paths]
    return lines
