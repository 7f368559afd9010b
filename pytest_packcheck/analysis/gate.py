"""Baseline comparison: which cells got worse between two results documents (and merging documents).

A cell is matched by (model label, backend, check, dtype). It got worse when its verdict moved down the order
pass > skipped > unsupported > fallback > fail > error, or when it stayed red but gained a cause. A pass stays a pass
however its number moved: a pass above its tolerance is refused on load and both sides share tolerances, so "a pass
whose number grew by more than its tolerance" cannot happen (issue 41: that rule could never fire and was removed);
a number that crosses its tolerance is a pass -> fail, counted (issue 23: a cell that fails for a second
reason is a new fault). One rule for a cell held twice, in one file or across files, shared by the gate and
merge (:func:`index_cells`): the same verdict twice is one cell, an interrupted run's "not run" placeholder yields
to a measured record; two verdicts are refused. Pure functions:
documents in, rows and a verdict out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import PackcheckUsageError, scrub_secrets
from ..report.text import escape_md
from ..report.verdicts import not_run, role_of
from ..results.environment import environment_recorded
from ..results.schema import SCHEMA_VERSION, is_shard
from ..versions.libraries import library, stack_libraries

# Better first: a pass that becomes anything else is a regression; skipped -> unsupported is too.
_ORDER = ("pass", "skipped", "unsupported", "fallback", "fail", "oom", "timeout", "error")


@dataclass(frozen=True)
class Change:
    """One changed cell: its key (model, backend, check, dtype, environment label), the two verdicts (None:
    absent on that side), whether it got worse, what changed, the --allow reason, and the two cells (for the
    job summary's number, cause and remedy)."""

    key: tuple[str, str | None, str, str, str | None]
    baseline: str | None
    candidate: str | None
    worse: bool
    detail: str
    allowed: str | None = None
    before: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    after: dict[str, Any] | None = field(default=None, compare=False, repr=False)


def index_cells(cells: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any], where: str) -> dict[Any, dict[str, Any]]:
    """The cells of one side by ``key``: the one duplicate-cell rule of the gate and merge. A cell held twice
    with the same verdict (overlapping shards, a resumed run) is one cell (the later record is kept); a record
    that only says an interrupted run never reached the cell (:func:`report.verdicts.not_run`) is no verdict and
    yields to a measured record of the same cell, in either order (an interrupted shard merged with its completed
    rerun); a cell with two measured verdicts is refused, since no comparison of it could be trusted.

    Raises:
        PackcheckUsageError: a cell held twice with different verdicts (names the cell id, both verdicts and
            ``where`` it came from, e.g. "the candidate (cand.json)").
    """
    out: dict[Any, dict[str, Any]] = {}
    for cell in cells:
        k = key(cell)
        prev = out.get(k)
        if prev is not None and not_run(prev) != not_run(cell):
            if not_run(prev):
                out[k] = cell  # a measured record replaces the placeholder of an interrupted run
            continue  # else the placeholder yields: the measured record stands
        if prev is not None and prev["status"] != cell["status"]:
            raise PackcheckUsageError(
                f"Cell {cell['cell_id']} is '{prev['status']}' and '{cell['status']}' in {where}: a cell held twice with "
                "two verdicts cannot be compared or merged. Rerun that cell, or merge shards of one audit only.")
        out[k] = cell
    return out


#: Cause codes that only restate a verdict (a crash is its status): gaining one is not a new cause.
_STATUS_CAUSES = frozenset({"crash", "hang", "out_of_memory", "backend_swap"})


def cell_causes(cell: dict[str, Any]) -> set[str]:
    """Every cause code a cell holds: its check's ``cause``, its diagnosis's cause, a ``causes`` list (several
    causes of one cell: `CheckResult.causes` records `{"cause": str, "evidence": dict}`, primary first) and the causes
    of its findings; status-only codes (crash, hang) left out."""
    d = cell.get("diagnosis") or {}
    listed = [*(cell.get("causes") or []), *(d.get("causes") or [])]  # ``{"cause", "evidence"}`` records, or codes
    codes = {cell.get("cause"), d.get("cause"), *((c.get("cause") if isinstance(c, dict) else c) for c in listed),
             *((f or {}).get("cause") for f in d.get("findings") or []), *((f or {}).get("cause") for f in cell.get("findings") or [])}
    return {c for c in codes if isinstance(c, str) and c} - _STATUS_CAUSES


def _key(cell: dict[str, Any]) -> tuple[str, str | None, str, str, str | None]:
    """Cells match on model, backend, check, dtype and version environment label (None outside --versions)."""
    return (cell["model"]["label"], cell["backend"], cell["check"], cell["dtype"], (cell.get("env") or {}).get("label"))


def _cross_key(cell: dict[str, Any]) -> tuple[str, str | None, str, str, str | None]:
    """Cells of two different stacks match on model, backend, check and dtype only."""
    return (*_key(cell)[:4], None)


def env_labels(doc: dict[str, Any]) -> list[str | None]:
    """The version-environment labels of a document's cells (None: cells run in the document's own environment),
    in the order of its settings' ``versions`` (the order they were asked for), then as found."""
    found = list(dict.fromkeys((c.get("env") or {}).get("label") for c in doc["cells"]))
    order = [v for v in (doc.get("settings") or {}).get("versions") or [] if v in found]
    return order + [f for f in found if f not in order]


def select_env(doc: dict[str, Any], wanted: str, flag: str) -> dict[str, Any]:
    """The part of ``doc`` that ran in one version environment: ``wanted`` is its label
    (``transformers==5.24.0``), or a part of exactly one label (``5.24.0``). The returned document's
    ``environment`` is that environment's stack.

    Raises:
        PackcheckUsageError: no label, or several, match ``wanted``.
    """
    labels = [x for x in env_labels(doc) if x]
    chosen = [x for x in labels if x == wanted] or [x for x in labels if wanted in x]
    if len(chosen) != 1:
        have = ", ".join(labels) or "none (it was not run with --versions)"
        why = "matches no" if not chosen else f"matches {len(chosen)}"
        raise PackcheckUsageError(f"'{wanted}' (from {flag}) {why} version environment of the results file; its "
                                  f"environments: {have}. Pass one of them.")
    part = {**doc, "cells": [c for c in doc["cells"] if (c.get("env") or {}).get("label") == chosen[0]]}
    part["environment"] = stack(part)
    return part


def stack(doc: dict[str, Any]) -> dict[str, Any]:
    """The library stack a document's cells ran on: the document's environment, or, when every cell ran in the
    same version environment, that environment's own fingerprint (with ``label``)."""
    labels = env_labels(doc)
    env = dict(doc.get("environment") or {})
    if len(labels) == 1 and labels[0]:
        record = next(c["env"] for c in doc["cells"] if c.get("env"))
        child = record.get("environment") or {}
        env.update({k: v for k, v in child.items() if v is not None})
        # a library the environment's own fingerprint names as absent is absent there, whatever the controller
        # has (issue 27: the header said trl 1.16.0 where the environments had no TRL)
        # (a hardware library is linked from the controller's environment: it has the controller's, never another)
        env.update({k: None for k in _SUMMARY_LIBRARIES if k in child and child[k] is None and not library(k).hardware})
        env.update({k.replace("-", "_"): v for k, v in (record.get("versions") or {}).items()})
        env["label"] = labels[0]
    return env


def _match_with_env(baseline: dict[str, Any], candidate: dict[str, Any]) -> bool:
    """Whether cells match on their version environment too: yes when both documents hold the same
    environments (one audit run twice); no when each holds one stack (two stacks compared cell by cell).

    Raises:
        PackcheckUsageError: a document with several environments against one with others.
    """
    b, c = env_labels(baseline), env_labels(candidate)
    if set(b) == set(c):
        return True
    for name, labels in (("baseline", b), ("candidate", c)):
        if len(labels) > 1:
            raise PackcheckUsageError(
                f"The {name} holds {len(labels)} version environments ({', '.join(str(x) for x in labels)}) and the other "
                f"file other ones: pick the one to compare with --{name}-env.")
    return False


def compare(baseline: dict[str, Any], candidate: dict[str, Any], allow: dict[str, str] | None = None) -> list[Change]:
    """Cells whose verdict or key number changed. ``allow`` maps a cell id (or a prefix of one, e.g.
    ``opt-sdpa``) to the reason the regression is accepted. Documents of different stacks (two version
    environments, or two files made with different ``--versions``) match cells by model, backend, check and
    dtype; an unchanged verdict that is not a pass is never a regression, nor is a new cell of a hazard or finding
    check (:func:`report.verdicts.role_of`); a new correctness cell that is not a pass is one.

    Raises:
        PackcheckUsageError: see :func:`_match_with_env`; no baseline cell compared (:func:`_refuse_nothing_compared`);
            the two measured with different probe settings, or judged one dtype with different tolerances (a
            verdict would change with them, not the stack: the rule merge applies, :func:`_refuse_unlike_measurements`).
    """
    allow = allow or {}
    key = _key if _match_with_env(baseline, candidate) else _cross_key
    base = index_cells(baseline["cells"], key, "the baseline")
    cand = index_cells(candidate["cells"], key, "the candidate")
    _refuse_nothing_compared(base, cand, candidate)
    _refuse_unlike_measurements([baseline, candidate], ["the baseline", "the candidate"], "compare")
    changes: list[Change] = []
    for key in sorted(set(base) | set(cand), key=lambda k: tuple(str(x) for x in k)):
        b, c = base.get(key), cand.get(key)
        if c is None:
            if not _planned_in(b, candidate):
                changes.append(Change(key, b["status"], None, False, UNCOMPARED, before=b))
                continue
            # planned by the candidate's settings but not there (a crash, an interrupted run): it cannot be
            # shown to still pass, so a regression unless allowed
            reason = allowed_reason(b["cell_id"], allow)
            changes.append(Change(key, b["status"], None, b["status"] == "pass", "cell missing in candidate", reason, before=b))
            continue
        if not_run(c):
            # an interrupted candidate never reached it (trial 9, 186: fail -> not run read "better/neutral"): like a
            # missing cell, a regression where the baseline passed (it cannot be shown to still pass), never better
            was_pass = b is not None and b["status"] == "pass"
            reason = allowed_reason(c["cell_id"], allow) if was_pass else None
            changes.append(Change(key, b["status"] if b else None, c["status"], was_pass,
                                  "not run in the candidate (interrupted)", reason, before=b, after=c))
            continue
        if b is None:
            # a new model's hazard shown or stack finding is a fact of the stack, no cell that got worse (trial 10, 45:
            # adding a safe model failed the gate on its cache_trap / mask_trap / collate); a new correctness cell
            # that is not a pass is a regression
            changes.append(Change(key, None, c["status"], c["status"] != "pass" and role_of(c) == "correctness",
                                  "new cell", after=c))
            continue
        worse = _ORDER.index(c["status"]) > _ORDER.index(b["status"])
        detail = _status_detail(b, c) if b["status"] != c["status"] else ""
        causes_changed = False
        if b["status"] == c["status"] != "pass":
            old_causes, new_causes = cell_causes(b), cell_causes(c)
            gained, lost = sorted(new_causes - old_causes), sorted(old_causes - new_causes)
            if gained or lost:
                causes_changed = True
                worse = worse or bool(gained)
                detail = "; ".join(x for x in (f"gained cause {', '.join(gained)}" if gained else "",
                                              f"lost cause {', '.join(lost)}" if lost else "") if x)
        if b["status"] != c["status"] or worse or causes_changed:
            cell_id = c["cell_id"]
            reason = allowed_reason(cell_id, allow) if worse else None
            changes.append(Change(key, b["status"], c["status"], worse, detail, reason, before=b, after=c))
    return changes


def _refuse_nothing_compared(base: dict[Any, dict[str, Any]], cand: dict[Any, dict[str, Any]], candidate: dict[str, Any]) -> None:
    """Refuse a comparison in which no baseline cell is compared: none is in the candidate, and none that is missing
    there was planned by the candidate's settings (a planned cell that is missing is a regression, so compared). Such
    a gate printed "0 regression(s)" and exited 0 having judged nothing (trial 6, 30).

    Raises:
        PackcheckUsageError: one line saying nothing was compared, with the cells each side holds (:func:`_cells_held`).
    """
    if not base or any(k in cand or _planned_in(cell, candidate) for k, cell in base.items()):
        return
    raise PackcheckUsageError(
        f"Nothing compared: no baseline cell is in the candidate's selection (baseline: {_cells_held(base.values())}; "
        f"candidate: {_cells_held(cand.values())}). Run the candidate with the baseline's models, backends, checks and "
        "dtypes, or pass a baseline of the candidate's.")


def _cells_held(cells: Any) -> str:
    """What a side holds, for :func:`_refuse_nothing_compared`: the cell count, then its models, backends, checks and
    dtypes in first-seen order (``"4 cells of llama; sdpa; isolation, logits_parity; float32"``)."""
    cells = list(cells)
    if not cells:
        return "no cells"
    axes = [list(dict.fromkeys(str(get(c)) for c in cells)) for get in (
        lambda c: c["model"]["label"], lambda c: c["backend"] or "model level", lambda c: c["check"], lambda c: c["dtype"])]
    return scrub_secrets(f"{len(cells)} cell(s) of " + "; ".join(", ".join(a) for a in axes))


def _status_detail(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What a verdict change rests on: each side's cause and key number (from its metrics, the number the job
    summary shows: trial 17, 44, an edited cell's message said "moved 0.00e+00" beside Δ 5.0e-01 there), then its
    message, cut at a word, never mid-word."""
    from ..report.numbers import key_number
    from ..report.text import cut as _cut

    def one(cell: dict[str, Any]) -> str:
        causes = ", ".join(sorted(cell_causes(cell)))
        number = key_number(cell)
        head = " ".join(x for x in (causes, f"({number})" if number else "") if x)
        text = " ".join(str(cell.get("message") or "").split())
        return _cut(f"{head}: {text}" if head else text, 120) or cell["status"]

    return f"{one(before)} -> {one(after)}"


def allowed_reason(cell_id: str, allow: dict[str, str]) -> str | None:
    """The reason ``allow`` gives for a cell id or a prefix of it (``opt-sdpa``), the version environment
    (``@transformers==...``) left out or included."""
    bare = cell_id.split("@", 1)[0]
    return next((r for k, r in allow.items() if k in (cell_id, bare) or cell_id.startswith(k + "-")), None)


def _planned_in(cell: dict[str, Any], doc: dict[str, Any]) -> bool:
    """Whether the document's settings (models, backends, checks, dtypes, the shard's share of the models, and not
    the cells ``-k`` / ``-m`` deselected: ``settings.deselected``) cover this cell."""
    settings = doc.get("settings") or {}
    if cell.get("cell_id") in (settings.get("deselected") or ()):
        return False  # left out by -k / -m in that run (issue 42: counted as missing regressions)
    if not settings.get("checks"):
        return True  # no settings recorded: assume the same selection
    models = list(dict.fromkeys(settings.get("models", [])))
    if is_shard(settings.get("shard")):  # a shard plans its own models only: shard 2's file never planned shard 1's
        from ..config.options import shard_holds  # (trial 20, 161)

        models = [m for i, m in enumerate(models) if shard_holds(i, settings["shard"])]
    return (cell["check"] in settings.get("checks", []) and cell["dtype"] in settings.get("dtypes", [cell["dtype"]])
            and (cell["backend"] is None or cell["backend"] in settings.get("backends", []))
            and cell["model"].get("spec", cell["model"]["label"]) in models)


def verdict_label(ch: Change) -> str:
    """The gate's verdict on one changed cell, one rule for the terminal table, the plain table and the job summary:
    ``REGRESSION``, ``allowed: <reason>``, ``missing`` (a baseline cell the candidate lacks, whatever its role: never
    "better/neutral", since it was not measured; ``REGRESSION (missing)`` when its absence counts), ``not run``
    (the same for a cell an interrupted candidate never reached: ``REGRESSION (not run)`` where the baseline passed),
    ``new`` (a cell only the candidate holds that does not count: a pass, or a new model's hazard or finding) or
    ``better/neutral``."""
    gone = ch.candidate is None and ch.baseline is not None
    unrun = ch.after is not None and not_run(ch.after)
    suffix = " (missing)" if gone else " (not run)" if unrun else ""
    if ch.worse and not ch.allowed:
        return "REGRESSION" + suffix
    if ch.allowed:
        return f"allowed: {ch.allowed}" + suffix
    if unrun:
        return "not run"
    return "missing" if gone else "new" if ch.baseline is None else "better/neutral"


def regressions(changes: list[Change]) -> list[Change]:
    """Changes that got worse and are not allowed."""
    return [c for c in changes if c.worse and c.allowed is None]


def render_changes(changes: list[Change], baseline_env: dict[str, Any], candidate_env: dict[str, Any], markdown: bool = True) -> str:
    """A table of the changed cells, with both environments' library versions: GitHub Markdown (escaped), or
    plain text for a terminal (``markdown=False``: no Markdown escapes)."""
    from tabulate import tabulate

    from ..report.text import plain
    from ..versions.libraries import versions_line

    esc = escape_md if markdown else plain
    def versions(env: dict[str, Any]) -> str:
        return versions_line(env) + (f" (environment {env['label']})" if env.get("label") else "")

    head = [f"baseline: {versions(baseline_env)}", f"candidate: {versions(candidate_env)}", ""]
    if not changes:
        return "\n".join([*head, "No cell changed."])
    rows = [
        ["-".join(str(x) for x in ch.key[:4] if x) + (f"@{ch.key[4]}" if ch.key[4] else ""), ch.baseline or "—", ch.candidate or "—",
         esc(verdict_label(ch)),
         esc(ch.detail)]
        for ch in changes
    ]
    return "\n".join([*head, tabulate(rows, headers=["cell", "baseline", "candidate", "verdict", "detail"],
                                       tablefmt="github" if markdown else "simple")])


#: The libraries a job summary names the versions of (the stack's keys): the table's ``stack`` libraries.
_SUMMARY_LIBRARIES = tuple(lib.key for lib in stack_libraries())


def _stack_versions(baseline_env: dict[str, Any], candidate_env: dict[str, Any], changed_only: bool = False) -> str:
    """``transformers 4.57.1 → 5.24.0, trl 1.16.0``: every library either side names, once when equal (left out
    with ``changed_only``)."""
    # a side whose file records no environment is "not recorded", never "not installed" (trial 15, 32)
    unknown = [None if environment_recorded(e) else "not recorded" for e in (baseline_env, candidate_env)]
    parts = []
    for lib in _SUMMARY_LIBRARIES:
        a, b = baseline_env.get(lib) or unknown[0], candidate_env.get(lib) or unknown[1]
        if (a or b) and not (changed_only and a == b):
            parts.append(f"{lib} {a or 'not installed'}" if a == b else f"{lib} {a or 'not installed'} → {b or 'not installed'}")
    return ", ".join(parts)


def render_summary(changes: list[Change], baseline_env: dict[str, Any], candidate_env: dict[str, Any]) -> str:
    """GitHub job-summary Markdown (``$GITHUB_STEP_SUMMARY``): the result line, the two stacks, then one row per
    changed cell, regressions first: model, backend, check, dtype, versions, verdict before → after, the key
    number on each side, the cause(s), the known fault it matches (audit/known_faults.toml) and the remedy.
    Pure: changes in, text out."""
    from ..report.numbers import key_number as _key_number
    from ..report.text import github_table

    bad = regressions(changes)
    versions = _stack_versions(baseline_env, candidate_env)
    changed = _stack_versions(baseline_env, candidate_env, changed_only=True) or versions
    title = (f"### packcheck gate: {len(bad)} regression(s)" if bad else "### packcheck gate: no regression") + \
        f", {len(changes)} changed cell(s)"
    lines = [title, "", f"Stacks: {escape_md(versions)}.", ""]
    if not changes:
        return "\n".join([*lines, "No cell changed.", ""])

    def side(cell: dict[str, Any] | None) -> str:
        return _key_number(cell) if cell else ""

    def verdict(ch: Change) -> str:
        label = escape_md(verdict_label(ch))
        return f"**{label}**" if label.startswith("REGRESSION") else label

    rows = []
    for ch in sorted(changes, key=lambda c: (not (c.worse and not c.allowed), tuple(str(x) for x in c.key))):
        # the side that is not a pass says why (a fixed cell: the baseline's cause; a regression: the candidate's)
        cell = ch.after if ch.after and ch.after["status"] != "pass" else (ch.before or ch.after or {})
        d = cell.get("diagnosis") or {}
        causes = sorted(cell_causes(cell))
        number = " → ".join(x for x in (side(ch.before), side(ch.after)) if x)
        model, backend, check, dtype, env = ch.key
        rows.append([escape_md(model), escape_md(backend or "(model level)"), check, dtype, escape_md(changed if env is None else env),
                     f"{ch.baseline or '—'} → {ch.candidate or '—'}", escape_md(number), escape_md(", ".join(causes) or ch.detail or "—"),
                     escape_md(", ".join(d.get("known_faults") or []) or "—"), escape_md(d.get("remedy") or "—"), verdict(ch)])
    lines.append(github_table(rows, headers=["model", "backend", "check", "dtype", "versions", "before → after", "number", "cause",
                                         "known fault", "remedy", "gate"]))
    return "\n".join([*lines, ""])


def refuse_empty_baseline(baseline: dict[str, Any], path: str, source: str) -> None:
    """Refuse a baseline document with no cells (``"cells": []``): every candidate cell would be new, 0 regressions.

    Raises:
        PackcheckUsageError: one line naming the file and where it came from.
    """
    if not baseline.get("cells"):
        raise PackcheckUsageError(f"Baseline {path} (from {source}) holds no cells: there is nothing to compare against; "
                                  "pass the packcheck-matrix.json of an audit that ran cells.")


#: The detail of a baseline cell the candidate did not select: listed by :func:`missing_note`, never compared.
UNCOMPARED = "not in the candidate's selection"


def compared(changes: list[Change]) -> list[Change]:
    """The changes the gate judged: all but the baseline cells the candidate did not select (:data:`UNCOMPARED`, said
    once by :func:`missing_note`). A candidate holding 1 of 28 cells printed "27 changed cell(s)" and listed the
    other 27 as missing (trial 11, 51): the tables and every count read this."""
    return [c for c in changes if c.detail != UNCOMPARED]


def missing_note(changes: list[Change], prog: str) -> str | None:
    """The warning line for the baseline cells the candidate did not select (they were not compared, and never count
    as regressions), naming up to five; None when there are none."""
    gone = [c for c in changes if c.detail == UNCOMPARED]
    if not gone:
        return None
    names = ["-".join(str(x) for x in c.key[:4] if x) for c in gone]
    shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
    return (f"{prog}: warning: {len(gone)} baseline cell(s) are not in the candidate: they were not compared ({shown}); "
            "run the candidate with the baseline's models, backends, checks and dtypes to compare them")


def probe_summary(path: str, flag: str = "--summary") -> None:
    """Refuse a job-summary path that cannot be appended to, before anything is compared (its folder missing or not
    writable, or the path a folder): a failure after the table hid a regression's exit 1 behind exit 2.

    Raises:
        PackcheckUsageError: one line naming the path, the flag and the reason.
    """
    import os
    from pathlib import Path

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    why = None
    if p.is_dir():
        why = "it is a directory"
    elif p.exists():
        why = None if os.access(p, os.W_OK) else "the file is not writable"
    elif not parent.is_dir():
        # the nearest existing ancestor says why: a regular file where a folder should be is not "missing"
        above = next((a for a in (parent, *parent.parents) if a.exists() or a.is_symlink()), None)
        why = (f"{above} is a file, not a folder" if above is not None and not above.is_dir()
               else f"its folder {parent} does not exist")
    elif not os.access(parent, os.W_OK | os.X_OK):
        why = f"its folder {parent} is not writable"
    if why:
        raise PackcheckUsageError(f"Cannot write the job summary '{path}' (from {flag}): {why}. "
                                  "Pass a writable file, e.g. --summary \"$GITHUB_STEP_SUMMARY\".")


def write_summary(path: str, text: str, flag: str = "--summary") -> None:
    """Append ``text`` to ``path`` (GitHub appends each step's summary to the file it names).

    Raises:
        PackcheckUsageError: the file cannot be written (names the path, the flag and the reason).
    """
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    except OSError as exc:
        raise PackcheckUsageError(f"Cannot write the job summary '{path}' (from {flag}): {exc.strerror or exc}. "
                                  "Pass a writable file, e.g. --summary \"$GITHUB_STEP_SUMMARY\".") from None


#: Settings two runs of one audit may differ in (where its report went, which shard it was): every other
#: setting of ``settings`` makes two documents runs of different audits.
_INCIDENTAL_SETTINGS = ("shard", "report_dir")

#: Settings the gate compares across on purpose: it matches cells by model, backend, check and dtype (a cell of one
#: side only is named as such), and two stacks (``versions``) are what it exists to compare.
_SELECTION_SETTINGS = ("models", "backends", "checks", "dtypes", "versions", "audit", "tolerance_source")


def settings_differ(documents: list[dict[str, Any]], ignore: tuple[str, ...] = ()) -> list[str]:
    """The one rule for which settings make documents runs of different audits: the keys of ``settings`` (besides
    :data:`_INCIDENTAL_SETTINGS` and ``ignore``) whose value differs from the first document's, sorted. Merge names
    them (not shards of one audit); the gate warns on those that change a cell's numbers (``ignore`` =
    :data:`_SELECTION_SETTINGS`: probe lengths, sliding window, weights, device)."""
    first = documents[0].get("settings", {}) if documents else {}
    return sorted({k for doc in documents[1:] for k in set(doc.get("settings", {})) | set(first)
                   if k not in _INCIDENTAL_SETTINGS + ignore and doc.get("settings", {}).get(k) != first.get(k)})


def probe_settings_note(baseline: dict[str, Any], candidate: dict[str, Any], prog: str) -> str | None:
    """The gate's warning line when the two documents were measured with different probe settings (the
    :func:`settings_differ` rule, less the selection the gate matches across): each differing key with both
    values; None when they agree."""
    keys = settings_differ([baseline, candidate], ignore=_SELECTION_SETTINGS)
    if not keys:
        return None
    b, c = baseline.get("settings", {}), candidate.get("settings", {})
    values = scrub_secrets("; ".join(f"{k} {json.dumps(b.get(k))} vs {json.dumps(c.get(k))}" for k in keys))
    return (f"{prog}: warning: the baseline and the candidate were measured with different probe settings ({values}): "
            "a cell's numbers and verdict may differ for that reason alone, not for the stack; rerun one side with the "
            "other's settings to compare like with like")


def _tolerances_by_dtype(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tolerances a document's cells were judged with, per dtype (the first cell of each dtype)."""
    out: dict[str, dict[str, Any]] = {}
    for cell in doc.get("cells", []):
        out.setdefault(cell.get("dtype", ""), cell.get("tolerances") or {})
    return out


def _refuse_unlike_measurements(documents: list[dict[str, Any]], names: list[str], what: str = "merge") -> None:
    """The one rule for documents whose cells are not like measurements, shared by merge and the gate: refuse
    documents measured with different probe settings (:data:`config.options.PROBE_SETTINGS`: the probe lengths,
    sliding window, weights, device; compared where both files record the key), whose cells under one id are
    different measurements (trial 10, 60: a merge kept one file's numbers under the other's ``settings.lengths``),
    or whose cells of one dtype were judged with different tolerances (the merged matrix has one ``## Tolerances``
    table and one source, which would be wrong for one part).

    Raises:
        PackcheckUsageError: one line naming both files, each differing setting (or the dtype and tolerance key)
            with both values, and the flag to rerun with.
    """
    from ..config.options import PROBE_SETTINGS

    first = documents[0].get("settings") or {} if documents else {}
    for i, doc in enumerate(documents[1:], 1):
        mine = doc.get("settings") or {}
        keys = [k for k in PROBE_SETTINGS if k in first and k in mine and first[k] != mine[k]]
        if not keys:
            continue
        values = scrub_secrets(", ".join(f"{k} {json.dumps(first[k])} vs {json.dumps(mine[k])}" for k in keys))
        why = ("one cell id would hold one file's numbers under the other's settings" if what == "merge"
               else "a number or verdict that changed could be the settings' change, not the stack's")
        raise PackcheckUsageError(
            f"Cannot {what} {names[0]} and {names[i]}: they were measured with different probe settings ({values}), and "
            f"{why}. Rerun one audit with the other's {' and '.join(PROBE_SETTINGS[k] for k in keys)} and {what} again.")
    seen: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, doc in enumerate(documents):
        for dtype, tol in _tolerances_by_dtype(doc).items():
            j, before = seen.setdefault(dtype, (i, tol))
            keys = sorted(k for k in set(before) | set(tol) if before.get(k) != tol.get(k))
            if not keys:
                continue
            src = [documents[n].get("settings", {}).get("tolerance_source") or "unknown" for n in (j, i)]
            values = ", ".join(f"{k} {before.get(k, 'unset')} vs {tol.get(k, 'unset')}" for k in keys)
            why = ("one matrix shows one set of tolerances" if what == "merge"
                   else "a verdict that changed could be the tolerance's change, not the stack's")
            raise PackcheckUsageError(
                f"Cannot {what} {names[j]} and {names[i]}: their {dtype} tolerances differ ({values}; from {src[0]} vs "
                f"{src[1]}), and {why}. Rerun one audit with the other's tolerances (--packcheck-tolerances) and "
                f"{what} again.")


def merge(documents: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """Join results documents (shards of one audit). Cells keep their own environment; a cell present in
    several documents must agree, else it is an error; so must the tolerances cells of one dtype were judged
    with (``names``: what to call each document in that error, default "file 1", "file 2", ...). Backends, checks and dtypes of the settings are the union;
    documents whose settings differ otherwise (not shards of one audit) are named in ``merged_settings_differ``
    and every command is kept. Shards that recorded ``settings.shard`` but do not cover 1..count, or a document
    marked incomplete (unless another file measured every cell it did not reach, :func:`_rerun_elsewhere`), make
    the merged document ``incomplete`` (reason named).

    Raises:
        PackcheckUsageError: no documents, one cell with two different verdicts, documents measured with different
            probe settings or one dtype judged with two different tolerances (:func:`_refuse_unlike_measurements`).
    """
    if not documents:
        raise PackcheckUsageError("packcheck merge got no results files: pass at least one JSON file.")
    names = names or [f"file {i + 1}" for i in range(len(documents))]
    _refuse_unlike_measurements(documents, names)
    _refuse_other_stacks(documents, names)
    every = [{**cell, "environment": cell.get("environment", doc["environment"])} for doc in documents for cell in doc["cells"]]
    cells = index_cells(every, lambda c: c["cell_id"], "the files merged")
    first = documents[0]
    settings = dict(first.get("settings", {}))
    for key in ("backends", "checks", "dtypes"):  # the union, in first-seen order: every cell keeps its columns
        union = [x for doc in documents for x in doc.get("settings", {}).get(key, [])]
        if union:
            settings[key] = list(dict.fromkeys(union))
    sources = [s for s in dict.fromkeys(doc.get("settings", {}).get("tolerance_source") or "" for doc in documents) if s]
    if len(sources) > 1:  # equal values from two sources (or other dtypes): the Source line names every one
        settings["tolerance_source"] = "; ".join(sources)
    differ = settings_differ(documents)
    out = {**first, "schema_version": SCHEMA_VERSION, "settings": settings, "cells": [cells[k] for k in sorted(cells)]}
    benches = [doc["bench"] for doc in documents if doc.get("bench")]
    if benches:  # every file's bench results (shards bench their own models), one per model and profile
        results: dict[tuple, dict[str, Any]] = {}
        for bench in benches:
            for r in bench.get("results", []):
                results.setdefault((r["model"]["label"], r.get("profile")), r)
        out["bench"] = {**benches[0], "profiles": list(dict.fromkeys(p for b in benches for p in b.get("profiles", []))),
                        "results": list(results.values())}
    # each interrupted file says so by name with its own finished cells (not the merged count: a shard stopped after
    # 4 of its 12 cells beside a complete file read "interrupted after 13 cells")
    marks = [{**doc["incomplete"], "reason": doc["incomplete"]["reason"] + (f" ({name})" if len(documents) > 1 else ""),
              "resume": (f"rerun {name}'s own command with --packcheck-resume, then merge again" if len(documents) > 1
                         else doc["incomplete"].get("resume", ""))}
             for name, doc in zip(names, documents, strict=True) if doc.get("incomplete") and not _rerun_elsewhere(doc, cells)]
    # a file that holds no cell (an audit writes none without one: a shard emptied by hand, or cut before its first
    # cell by a kill) leaves its models out of the matrix: never silently (trial 20, 148)
    for name, doc in zip(names, documents, strict=True):
        if not doc["cells"]:
            shard = doc.get("settings", {}).get("shard")
            what = f"shard {shard[0]} of {shard[1]}" if is_shard(shard) else "it"
            marks.append({"reason": f"{name} holds no cell ({what}: its models are not in the matrix)",
                          "resume": f"rerun {name}'s own audit, then merge again"})
    shards = [doc["settings"]["shard"] for doc in documents if is_shard(doc.get("settings", {}).get("shard"))]
    settings.pop("shard", None)  # the merged matrix is no one shard
    if shards:  # shards of an audit recorded [index, count]: the merge must hold every index, else it is incomplete
        count = max(n for _, n in shards)
        missing = sorted(set(range(1, count + 1)) - {i for i, _ in shards})
        if missing:
            marks.append({"reason": f"shard {', '.join(map(str, missing))} of {count} not merged (their models have no cells)",
                          "resume": f"merge every shard's packcheck-matrix.json (1 to {count})"})
    if marks:  # one interrupted shard makes the merged matrix incomplete too
        finished = [m["cells"] for m in marks if isinstance(m.get("cells"), int)]
        out["incomplete"] = {**marks[0], "reason": "; ".join(dict.fromkeys(m["reason"] for m in marks)),
                             "resume": "; ".join(dict.fromkeys(m.get("resume", "") for m in marks if m.get("resume"))),
                             "cells": sum(finished) if finished else len(out["cells"])}
    else:
        out.pop("incomplete", None)
    if shards and not differ:  # the merged matrix reproduces as the whole audit: each shard's command without its shard
        whole = list(dict.fromkeys(_whole_audit_command(doc.get("command", "")) for doc in documents))
        if len(whole) == 1:
            out["command"] = whole[0]
    if differ:
        out["merged_settings_differ"] = differ
        commands = list(dict.fromkeys(doc.get("command", "") for doc in documents))
        out["command"] = "\n".join(commands)
    return out


def _refuse_other_stacks(documents: list[dict[str, Any]], names: list[str]) -> None:
    """Refuse to merge documents measured on different stacks (a header library's version: torch, transformers,
    trl, ... where both record it): the merged matrix names one stack in its header, and one cell id would hold one
    stack's numbers under the other's (trial 17, 69: 5.24.0 and 9.9.9 merged silently, the header the first file's).
    ``packcheck gate`` compares two stacks; ``--packcheck-versions`` measures several in one matrix.

    Raises:
        PackcheckUsageError: naming both files and each differing library with both versions.
    """
    from ..versions.libraries import header_libraries

    first = documents[0].get("environment") or {}
    for i, doc in enumerate(documents[1:], 1):
        mine = doc.get("environment") or {}
        differ = [(lib.label, first[lib.key], mine[lib.key]) for lib in header_libraries()
                  if first.get(lib.key) and mine.get(lib.key) and first[lib.key] != mine[lib.key]]
        if differ:
            values = scrub_secrets(", ".join(f"{label} {a} vs {b}" for label, a, b in differ))
            raise PackcheckUsageError(
                f"Cannot merge {names[0]} and {names[i]}: they were measured on different stacks ({values}), and the "
                "merged matrix names one stack. Compare two stacks with `packcheck gate --baseline A --candidate B`, "
                "or measure several in one matrix with --packcheck-versions.")


def _rerun_elsewhere(doc: dict[str, Any], cells: dict[str, dict[str, Any]]) -> bool:
    """Whether an interrupted document's unfinished part was measured by another file of the merge: it lists the
    cells it never reached (:func:`report.verdicts.not_run` placeholders: an interrupted run lists every planned
    cell), and each of them is measured in the merged ``cells`` (by cell id, :func:`index_cells`). Its
    "interrupted" mark then describes no cell of the merged matrix (an interrupted shard merged with its rerun)."""
    unrun = [c["cell_id"] for c in doc["cells"] if not_run(c)]
    return bool(unrun) and all(k in cells and not not_run(cells[k]) for k in unrun)


def _whole_audit_command(command: str) -> str:
    """``command`` without its ``--packcheck-shard`` and ``--packcheck-report-dir`` (``=value`` or a separate
    value): a shard's Reproduce line reran that shard's models alone (trial 7, 86; trial 8, 48: shards written to
    their own folders differ by it too), the merged matrix is every shard's, written where the audit writes."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        return command
    kept: list[str] = []
    skip = False
    dropped = ("--packcheck-shard", "--packcheck-report-dir")
    joined = tuple(f"{flag}=" for flag in dropped)
    for word in words:
        if skip:
            skip = False
        elif word in dropped:
            skip = True
        elif not word.startswith(joined):
            kept.append(word)
    return shlex.join(kept) if len(kept) < len(words) else command
