"""Verdicts of the report, format-neutral: a matrix cell's headline, a check's mark by its role, the counts.

A matrix cell's headline is decided by the checks whose registry role is ``correctness`` only: ✅ means every
one of them that ran passed, and the ones that could not run are named ("not checked"; those an interrupted run
never reached, "not run (interrupted)", apart: :data:`VERDICTS`). A hazard that showed is
🔶 "hazard shown", a failed stack contract item 🔷 "stack finding" (:func:`check_mark`), and the headline counts
matrix cells by verdict (:func:`matrix_counts`), never checks. Pure: cells in, records and words out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..checks.registry import SPECS
from ..results import STATUSES, SYMBOLS

LEGEND = {
    "pass": "pass: measured within tolerance",
    "fail": "fail: a measured number is out of tolerance (the cause names what it shows)",
    "fallback": "fallback: the requested attention backend is not what ran",
    "unsupported": "unsupported: the stack refuses this combination with an explicit error",
    "skipped": "not checked: this environment lacks something (reason given); never a pass",
    "error": "error: crashed (exception, or the signal that killed the isolated child, given), or a probe was inconclusive",
    "timeout": "timeout: no result within --packcheck-timeout (the hung child was killed)",
    "oom": "oom: out of memory (memory figures given)",
    "not_run": "not run (interrupted): the run stopped before this check (Ctrl-C, -x); --packcheck-resume runs it; never a pass",
}
#: The verdicts a report names, worst first: :data:`results.STATUSES`, with an interrupted run's unrun checks
#: (``metrics.not_run``, run.session) apart from "not checked" (the environment lacks something).
VERDICTS = tuple(k for s in STATUSES for k in ((s, "not_run") if s == "skipped" else (s,)))
#: Each verdict's mark and word (``skipped`` -> "not checked", ``not_run`` -> "not run (interrupted)").
VERDICT_SYMBOLS = {**SYMBOLS, "not_run": SYMBOLS["skipped"]}
VERDICT_WORDS = {**{s: s for s in STATUSES}, "skipped": "not checked", "not_run": "not run (interrupted)"}
#: What a hazard's or finding's own mark means (:data:`ROLE_MARKS`).
ROLE_LEGEND = {
    "hazard": "a hazard probe showed the hazard (usage outside the standard contract): said once per stack, never a model failure",
    "finding": "a contract item of the library stack failed (the same for every model on it): never a model failure",
}
#: Marks of a hazard or finding that did not pass (registry roles): never a model's red ❌.
ROLE_MARKS = {"hazard": ("🔶", "hazard shown"), "finding": ("🔷", "stack finding")}


def not_run(cell: dict[str, Any]) -> bool:
    """The check never ran: an interrupted run reached it no more (run.session marks it ``metrics.not_run``)."""
    return cell["status"] == "skipped" and bool((cell.get("metrics") or {}).get("not_run"))


def verdict_key(h: dict[str, Any]) -> str:
    """The key of :data:`VERDICTS` a matrix cell's :func:`headline` counts under: its status, or ``not_run`` for a
    cell an interrupted run left unfinished (its text "not run: N of M checks (interrupted)")."""
    return "not_run" if h["status"] == "skipped" and h.get("not_run") else h["status"]


def rank(status: str) -> int:
    """Position of a status in :data:`results.STATUSES` (worst first)."""
    return STATUSES.index(status)


def cell_status(statuses: list[str]) -> str:
    """Worst verdict of a group, ignoring skipped checks unless all are skipped."""
    ran = [s for s in statuses if s != "skipped"]
    if not ran:
        return "skipped"
    return min(ran, key=rank)


def role_of(cell: dict[str, Any]) -> str:
    """The cell's role: the registry's for a check it knows (a results file of an earlier packcheck may record
    another: ``trainer_padded`` / ``sft_padded`` were correctness checks before they became hazards), else as
    recorded in the cell, else ``correctness`` (an unknown check from a newer packcheck)."""
    return SPECS[cell["check"]].role if cell["check"] in SPECS else (cell.get("role") or "correctness")


def cause_label(cause: str) -> str:
    """A cause code in words (``cache_trap`` -> ``cache trap``)."""
    return cause.replace("_", " ")


def numerics_only(h: dict[str, Any]) -> bool:
    """A failing :func:`headline` whose every cause is ``kernel_numerics``: boundaries kept, the differences within
    float rounding or 10x the tolerance, so only the tolerance fails it. The answer words it as that, never as "do
    not pack" (the verdict stays a fail)."""
    return h["status"] == "fail" and bool(h["causes"]) and all(c == "kernel_numerics" for c in h["causes"])


def env_label(cell: dict[str, Any]) -> str | None:
    """The version environment a cell ran in (its ``--packcheck-versions`` label), None for this one."""
    return (cell.get("env") or {}).get("label")


#: The mark's label of a hazard probe that failed with the row wrong without the hazard too (:func:`hazard_shows`).
HAZARD_UNMEASURED = "hazard not measured (row wrong without it)"


def hazard_shows(cell: dict[str, Any]) -> bool:
    """A failed hazard probe showed its hazard: it failed with one of its own causes (:attr:`CheckSpec.shown_by`:
    the cache or the mask made the difference) or after measuring the standard packed row right
    (``metrics.standard_row_right``, the variants'). False for one that failed with the row wrong without the
    hazard too (opt / sdpa: "wrong with and without use_cache", 2.71e-02 both ways): that is the model's own fault,
    never "hazard shown"."""
    own = (cell.get("diagnosis") or {}).get("cause") or cell.get("cause")
    spec = SPECS.get(cell["check"])
    return (own in spec.shown_by if spec is not None else False) or (cell.get("metrics") or {}).get("standard_row_right") is True


def check_mark(cell: dict[str, Any]) -> tuple[str, str, str]:
    """(symbol, text label, css class) of one check's verdict, by its role: a correctness check shows its
    status (✅ pass, ❌ fail, …); a hazard or finding whose probe showed something (fail / fallback) shows
    🔶 "hazard shown" or 🔷 "stack finding" and the class ``hazard`` / ``finding`` (never the red ``fail``)."""
    status, role = cell["status"], role_of(cell)
    if role == "hazard" and status in ("fail", "fallback") and not hazard_shows(cell):
        # the packed row is wrong without the hazard too: the model's own fault, in its correctness verdict
        return SYMBOLS["skipped"], HAZARD_UNMEASURED, "hazard-unmeasured"
    if role in ROLE_MARKS and status in ("fail", "fallback"):
        sym, label = ROLE_MARKS[role]
        return sym, label, role
    if role in ROLE_MARKS and status in ("error", "timeout", "oom"):
        return SYMBOLS[status], f"{role} {status}", f"{role}-{status}"
    key = "not_run" if not_run(cell) else status
    return VERDICT_SYMBOLS[key], VERDICT_WORDS[key], key


def check_order(check: str) -> int:
    """Which check speaks first among equals (a headline's causes, the CSV's key check): the isolation probe, then
    the registry's order (the number that says most first); an unknown check last."""
    order = {name: i for i, name in enumerate(["isolation", *(s for s in SPECS if s != "isolation")])}
    return order.get(check, len(order))


def headline(group: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict of one matrix cell (one model, backend, dtype and environment) from its correctness checks
    only: ``status`` (the worst that ran; "skipped" when none ran), ``causes`` (the diagnosed causes of the
    correctness checks that did not pass, worst first), ``not_checked`` (correctness checks skipped, with their
    reasons) and ``cells`` (the correctness cells). A group with no correctness check (only hazards or findings
    were asked for) is judged on nothing: "skipped" with ``no_correctness`` True, unless one of its checks could not
    run the model (refused, crashed, timed out, out of memory), which it then shows. A hazard shown there is said in
    the hazards section and never makes the cell ❌ (trial 14, 140: `--packcheck-checks cache_trap,mask_trap` put
    gpt2 under "Do not pack")."""
    judged = [c for c in group if role_of(c) == "correctness"]
    if not judged:
        judged = [c for c in group if c["status"] in ("unsupported", "error", "timeout", "oom")]
        if not judged and all(c["status"] == "skipped" for c in group):
            judged = list(group)  # nothing could run here (a kernel this machine lacks): said as "not checked"
        elif not judged:
            return {"status": "skipped", "causes": [], "not_checked": {}, "cells": [], "bad": [], "not_run": [],
                    "not_exercised": [], "no_correctness": True}
    # a measured failure outranks a probe that could not judge (trial 15, 241: opt / sdpa in bfloat16, its backend
    # check failing with leak, read 💥 "refused / crashed" because isolation and causality were inconclusive)
    measured = [c for c in judged if not _inconclusive(c)]
    status = cell_status([c["status"] for c in judged])
    if status == "error" and any(c["status"] in ("fail", "fallback") for c in measured):
        status = cell_status([c["status"] for c in measured])
    # checks an interrupted run never reached (run.session: metrics.not_run): the cell is not a pass on the rest
    unrun = [c["check"] for c in judged if not_run(c)]
    if unrun and status == "pass":
        status = "skipped"
    # worst first (an inconclusive probe after a measured failure); among equals :func:`check_order`
    bad = sorted((c for c in judged if c["status"] not in ("pass", "skipped")),
                 key=lambda c: (rank("unsupported") if _inconclusive(c) and status != "error" else rank(c["status"]),
                                check_order(c["check"]), c["check"]))
    causes = list(dict.fromkeys((c.get("diagnosis") or {}).get("cause") or c.get("cause") or c["status"] for c in bad))
    not_checked = {c["check"]: c["message"] for c in judged if c["status"] == "skipped" and not not_run(c)}
    # mechanisms the probe row never reached (checks.mechanisms.mechanism_findings): a pass says nothing of them
    not_exercised = list(dict.fromkeys(
        f.get("mechanism") or str(f.get("evidence", "")).removeprefix("not exercised: ").split(":")[0]
        for c in judged for f in c.get("findings") or [] if f.get("cause") == "mechanism_not_exercised"))
    return {"status": status, "causes": causes, "not_checked": not_checked, "cells": judged, "bad": bad,
            "not_run": unrun, "not_exercised": not_exercised}


def _inconclusive(cell: dict[str, Any]) -> bool:
    """An error cell whose probe could not judge (cause ``probe_inconclusive``): nothing refused or crashed."""
    return cell["status"] == "error" and ((cell.get("diagnosis") or {}).get("cause") or cell.get("cause")) == "probe_inconclusive"


def unread_overrides(cells: list[dict[str, Any]], label: str | None = None) -> list[str]:
    """The notes of the overrides that a model's config has no key for ("override rope_thta=10000 is not a key of
    LlamaConfig ...": :func:`pytest_packcheck.model.configs.apply_overrides`), sorted, over ``cells`` (those of model
    ``label`` when given): the mark beside a ✅, the answer's and the details' note (trial 16, 227)."""
    return sorted({n for c in cells if label is None or c["model"].get("label") == label
                   for n in (c.get("model") or {}).get("config_notes") or [] if n.startswith("override ")})


def pass_qualifier(h: dict[str, Any]) -> str:
    """What a passing matrix cell's ✅ does not cover, from its :func:`headline`: the correctness checks that could
    not run ("not checked: cross_backend") and the mechanisms the probe row never exercised ("sliding window 4096 >=
    longest example 13: not exercised") and the user's overrides the config has no key for ("override rope_thta:
    not a config key": set as a new attribute the model may never read, so the ✅ is of the default config;
    :func:`pytest_packcheck.model.configs.apply_overrides`, trial 16, 227), joined by "; "; "" when the pass covers
    everything. The one wording the matrix cell, the answer and the terminal summary use."""
    parts = [f"not checked: {', '.join(h['not_checked'])}"] if h.get("not_checked") else []
    parts += [f"{m}: not exercised" for m in h.get("not_exercised") or []]
    parts += [f"{key}: not a config key" for key in dict.fromkeys(n.split("=", 1)[0] for n in unread_overrides(h.get("cells") or []))]
    return "; ".join(parts)


def coverage(cells: list[dict[str, Any]]) -> str:
    """What every ✅ of the run covers, said once: "" when each passing matrix cell had every correctness check of
    the registry planned for its backend (the default suite's, plus any opt-in one that ran), else "The ✅ cells
    cover the correctness checks run here: isolation only; not run: logits_parity, ... (...)." (the ones left out
    by --packcheck-checks, an audit's checks, or -k / -m deselection); "" too when no matrix cell passed (no ✅ to
    qualify). A check the cell's backend does not plan (cross_backend on eager: :attr:`CheckSpec.skip_backends`)
    is not missing. Passing cells that lack different checks (a ``merge`` of runs with different checks) are
    named per group: one sentence for all would claim checks some ✅ never ran."""
    from ..checks.registry import REGISTRY

    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)
    passing = {k: g for k, g in groups.items() if k[1] and any(role_of(c) == "correctness" for c in g)
               and headline(g)["status"] == "pass"}
    present = {c["check"] for c in cells if c.get("backend") and role_of(c) == "correctness"}
    if not passing or not present:
        return ""  # no ✅ cell: nothing for the sentence to qualify

    ran_by = {k: frozenset(c["check"] for c in g if role_of(c) == "correctness") for k, g in passing.items()}
    # compared without the checks some backend does not plan (cross_backend: not on eager), which differ by design
    by_backend = {s.name for s in REGISTRY if s.skip_backends}
    kind_of = {k: ran - by_backend for k, ran in ran_by.items()}
    order = {s.name: i for i, s in enumerate(REGISTRY)}
    why = "(left out by --packcheck-checks, the audit's checks, or -k / -m)"
    if len(set(kind_of.values())) > 1:
        parts = []
        for kind in sorted(set(kind_of.values()), key=lambda r: (len(r), sorted(r))):
            where = [f"{k[0]} / {k[1]}" for k in passing if kind_of[k] == kind]
            ran = frozenset().union(*(ran_by[k] for k in passing if kind_of[k] == kind))
            shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
            checks = sorted(ran, key=lambda n: order.get(n, len(order)))
            parts.append(f"{shown}: {', '.join(checks)}{' only' if len(checks) == 1 else ''}")
        return (f"The ✅ cells do not all cover the same correctness checks (results of runs with different checks "
                f"merged) {why}: {'; '.join(parts)}.")
    ran_set = frozenset().union(*ran_by.values())
    backends = {k[1] for k in passing}
    planned = [s.name for s in REGISTRY if s.role == "correctness" and s.level == "backend"
               and (s.suite == "default" or s.name in present) and not backends <= set(s.skip_backends)]
    missing = [name for name in planned if name not in ran_set]
    if not missing:
        return ""
    ran = [name for name in planned if name in ran_set] + sorted(ran_set - set(planned))
    return (f"The ✅ cells cover the correctness checks run here: {', '.join(ran)}{' only' if len(ran) == 1 else ''}; "
            f"not run: {', '.join(missing)} {why}.")


def changed_tolerances(cells: list[dict[str, Any]]) -> str:
    """"Tolerances not packcheck's defaults (a ✅ or ❌ is judged against them): float32.logits_atol = 1e+300
    (default 0.0001)." for every tolerance the cells were judged with that differs from the shipped one of their
    dtype (:func:`~pytest_packcheck.config.tolerances.default_tolerances`), said once in the counts line; "" when
    all are the defaults. A tolerance of 1e300 made logits_parity pass whatever it measured, and only the table at
    the report's end said so (trial 14, 178)."""
    from ..config.tolerances import default_tolerances

    defaults = default_tolerances()
    changed: dict[str, str] = {}
    for c in cells:
        own, shipped = c.get("tolerances") or {}, defaults.get(c.get("dtype"), {})
        for key, value in own.items() if isinstance(own, dict) else ():
            if key in shipped and isinstance(value, int | float) and value != shipped[key]:
                changed.setdefault(f"{c['dtype']}.{key}", f"{c['dtype']}.{key} = {value:g} (default {shipped[key]:g})")
    if not changed:
        return ""
    return (f"Tolerances not packcheck's defaults (every verdict is judged against them): "
            f"{', '.join(changed[k] for k in sorted(changed))}.")


def checks_that_passed(cells: list[dict[str, Any]], label: str, dtype: str, backend: str | None = None) -> list[str]:
    """The correctness checks that passed for model ``label`` in ``dtype`` (on ``backend``, else on any), in the
    registry's order: what a ✅ of a run that left checks out rests on (the answer's per-model line, the CSV note)."""
    from ..checks.registry import REGISTRY

    order = {s.name: i for i, s in enumerate(REGISTRY)}
    return sorted({c["check"] for c in cells if c["model"].get("label") == label and c.get("dtype") == dtype
                   and c.get("backend") and (backend is None or c["backend"] == backend)
                   and role_of(c) == "correctness" and c.get("status") == "pass"},
                  key=lambda n: order.get(n, len(order)))


def checked_only(cells: list[dict[str, Any]], h: dict[str, Any], label: str, dtype: str, backend: str, partial: bool) -> str:
    """"checked: isolation only" for a passing cell (its :func:`headline` ``h``) of a run that left correctness
    checks out (``partial``: :func:`coverage` is not empty), else "": the one wording of the CSV note and the HTML
    cell (trial 16, 145: the CSV read "pass" with an empty note; trial 18, 205: the HTML a bare ✅)."""
    if not partial or h["status"] != "pass":
        return ""
    ran = checks_that_passed(cells, label, dtype, backend)
    return f"checked: {', '.join(ran)} only" if ran else ""


def headline_text(h: dict[str, Any], marks: list[str] | None = None) -> str:
    """A matrix cell's text from its :func:`headline`: symbol, cause (or "not checked"), what a pass does not cover
    (:func:`pass_qualifier`), and the ⚑ marks of a model that departs from its stack's hazard pattern."""
    status = h["status"]
    if status == "pass":
        qualifier = pass_qualifier(h)
        text = SYMBOLS["pass"] + (f" ({qualifier})" if qualifier else "")
    elif status == "skipped" and h.get("not_run"):
        n = len(h["cells"])
        text = f"{SYMBOLS['skipped']} not run: {len(h['not_run'])} of {n} checks (interrupted)"
    elif status == "skipped" and h.get("no_correctness"):
        text = f"{SYMBOLS['skipped']} not judged (no correctness check ran)"
    elif status == "skipped":
        text = f"{SYMBOLS['skipped']} not checked"
    elif status in ("unsupported", "error", "timeout", "oom"):
        named = {"unsupported": "refused", "error": "crash", "timeout": "timeout", "oom": "out of memory"}[status]
        causes = [c for c in h["causes"] if c not in ("crash", "hang", "out_of_memory", status)]
        text = f"{SYMBOLS[status]} {', '.join(cause_label(c) for c in causes) or named}"
    else:
        text = f"{SYMBOLS[status]} {', '.join(cause_label(c) for c in h['causes'])}"
    return text + "".join(f" ⚑ {m}" for m in marks or [])


def hazard_rows(cells: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per (hazard, environment, dtype, backend): ``shown`` (the models that show it), ``measured`` (the models it
    was measured on) and ``causes`` (Counter), from every hazard check of the registry (role ``hazard``) and the
    logits_parity probe of two packed rows (``batch_rows``). Measured: a hazard probe that passed, or failed with
    one of its own causes (:attr:`CheckSpec.shown_by`) or after measuring the standard packed row right
    (``metrics.standard_row_right``, the variants': cu_seq_lens without position_ids leaking on sdpa is the hazard
    showing); one that failed for a parity cause with the row wrong without the hazard too is the model's own fault
    (in its correctness verdict), and a refused / crashed / skipped probe measured nothing: neither is counted.
    ``cells``: the probes that showed it (their diagnosis carries the remedy). The one computation behind the
    hazards table and the count of :func:`matrix_counts`."""
    out: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"shown": [], "measured": [], "causes": Counter(), "cells": []})
    for c in cells:
        key_rest = (env_label(c), c["dtype"], c["backend"])
        own = (c.get("diagnosis") or {}).get("cause") or c.get("cause")
        if role_of(c) == "hazard" and (c["status"] == "pass" or (c["status"] == "fail" and hazard_shows(c))):
            row = out[(c["check"], *key_rest)]
            row["measured"].append(c["model"]["label"])
            if c["status"] == "fail":
                row["shown"].append(c["model"]["label"])
                row["causes"][own] += 1
                row["cells"].append(c)
        if c["check"] == "logits_parity" and c["status"] == "pass" and isinstance((c.get("metrics") or {}).get("max_abs_diff_two_rows"), float):
            row = out[("batch_rows", *key_rest)]
            row["measured"].append(c["model"]["label"])
            if any(f.get("cause") == "batch_rows" for f in c.get("findings") or []):
                row["shown"].append(c["model"]["label"])
                row["causes"]["batch_rows"] += 1
                row["cells"].append(c)
    return out


def hazard_names() -> tuple[str, ...]:
    """The hazards the report can list, in order: every hazard check of the registry, then ``batch_rows`` (the
    logits_parity probe of two packed rows)."""
    from ..checks.registry import REGISTRY

    return (*(s.name for s in REGISTRY if s.role == "hazard"), "batch_rows")


def matrix_counts(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline counts by role: ``cells`` (matrix cells, i.e. model x backend x dtype x environment groups
    with a correctness check, counted by their headline verdict), ``models`` (verdict -> the models with a cell
    of that verdict), ``hazards`` (hazard probes that showed the hazard / hazard probes that measured, summed
    over :func:`hazard_rows`: the numbers of the hazards table),
    ``findings`` (finding checks that failed / ran, and failed contract items) and ``checks`` (every check run,
    by its :func:`check_mark` label, worst first: a hazard or finding probe that showed something counts as
    "hazard shown" / "stack finding", never as "fail"; a skipped check as "not checked")."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)
    verdicts: Counter = Counter()
    models_by: dict[str, set[str]] = defaultdict(set)
    for (label, *_), group in groups.items():
        if not any(role_of(c) == "correctness" for c in group):
            continue
        key = verdict_key(headline(group))
        verdicts[key] += 1
        models_by[key].add(label)
    rows = hazard_rows(cells)
    hazards = rows.values()
    findings_all = [c for c in cells if role_of(c) == "finding" and c["status"] != "skipped"]
    # a finding check that errored (the model did not build: weights_mismatch) measured no contract item (trial 10, 32)
    measured = ("pass", "fail", "fallback")
    finding_cells = [c for c in findings_all if c["status"] in measured]
    items = [it for c in finding_cells for it in (((c.get("metrics") or {}).get("items")) or {}).values() if isinstance(it, dict)]
    return {"cells": verdicts, "models": {k: sorted(v) for k, v in models_by.items()},
            "hazards": (sum(len(r["shown"]) for r in hazards), sum(len(r["measured"]) for r in hazards)),
            # hazard rows of a probe inside another check (batch_rows: logits_parity's two packed rows)
            "hazards_inside": sorted({key[0] for key, row in rows.items() if row["measured"]
                                      and (key[0] not in SPECS or SPECS[key[0]].role != "hazard")}),
            "findings": (sum(c["status"] in ("fail", "fallback") for c in finding_cells), len(finding_cells),
                         sum(it.get("status") == "fail" for it in items)),
            "findings_not_measured": Counter(c["status"] for c in findings_all if c["status"] not in measured),
            # worst first, correctness before the hazards / findings of the same status (a Counter keeps that order)
            "checks": Counter(check_mark(c)[1] for c in sorted(cells, key=lambda c: (rank(c["status"]), role_of(c) != "correctness")))}


def counts_line(cells: list[dict[str, Any]], symbols: bool = True, covered: str | None = None) -> str:
    """One line of the counts by role (Markdown with symbols, or plain for the terminal): matrix cells by
    verdict and the models they fall on, then hazards shown, stack findings, and the checks run. ``covered``:
    :func:`coverage` of ``cells`` when the caller has it (:attr:`Report.coverage`)."""
    n = matrix_counts(cells)

    def sym(key: str) -> str:
        return f"{VERDICT_SYMBOLS[key]} " if symbols else ""
    total = sum(n["cells"].values())

    def models(status: str) -> str:
        ms = n["models"].get(status, [])
        if status in ("pass", "skipped", "not_run") or not ms:
            return ""
        return f" ({len(ms)} {'model' if len(ms) == 1 else 'models'}: {', '.join(ms[:8])}{' …' if len(ms) > 8 else ''})"

    axes = "model x backend" + (" x dtype" if len({c["dtype"] for c in cells}) > 1 else "")
    verdicts = ", ".join(f"{sym(s)}{VERDICT_WORDS[s]} {n['cells'][s]}{models(s)}" for s in reversed(VERDICTS) if n["cells"][s])
    text = (f"Matrix cells ({axes}, judged by the correctness checks): {verdicts} (of {total})." if total else
            "Matrix cells: none judged (no correctness check ran).")
    covered = coverage(cells) if covered is None else covered
    if covered:
        text += " " + covered
    changed = changed_tolerances(cells)
    if changed:
        text += " " + changed
    shown, measured = n["hazards"]
    if measured:
        # a probe inside another check (batch_rows: logits_parity's two packed rows) is counted here and in the
        # hazards table, not among the hazard checks of "Checks run" (trial 16, 44): say so where it is
        inside = n["hazards_inside"]
        within = (f"; {', '.join(cause_label(h) for h in inside)}: a probe inside another check, counted here, not under "
                  "\"Checks run\"") if inside else ""
        text += (f" Hazards: {ROLE_MARKS['hazard'][0] + ' ' if symbols else ''}{shown} of {measured} hazard probes showed "
                 f"one (never a model failure{within}).")
    failed, ran, items = n["findings"]
    unmeasured = n["findings_not_measured"]
    if unmeasured:
        unmeasured_text = (f"{sum(unmeasured.values())} finding check(s) measured nothing ("
                           + ", ".join(f"{k} {s}" for s, k in unmeasured.items()) + ")")
    if ran:
        text += (f" Stack findings: {ROLE_MARKS['finding'][0] + ' ' if symbols else ''}{items} contract items failed in "
                 f"{failed} of {ran} finding checks (facts of the library stack)"
                 + (f"; {unmeasured_text}." if unmeasured else "."))
    elif unmeasured:
        text += f" Stack findings: none measured: {unmeasured_text}."
    checks = n["checks"]
    text += " Checks run: " + ", ".join(f"{label} {k}" for label, k in checks.items()) + f" (of {len(cells)})."
    return text


def model_mark(label: str, by_group: dict[tuple, list[dict[str, Any]]]) -> str:
    """A model's mark with its text label (details summary, HTML): the worst headline of its matrix cells (groups
    with a correctness check); hazards and findings never make it red: a model with only those is ✅ with
    "🔶 hazards" / "🔷 stack findings" beside it."""
    groups = [g for (m, _, _, _), g in by_group.items() if m == label]
    judged = [verdict_key(headline(g)) for g in groups if any(role_of(c) == "correctness" for c in g)]
    worst = cell_status(["skipped" if k == "not_run" else k for k in judged]) if judged else "skipped"
    # an interrupted run left one of its cells: never ✅ beside it (trial 16, 140: "✅ pass gpt2", its sdpa not run)
    worst = "not_run" if worst in ("skipped", "pass") and "not_run" in judged else worst
    text = f"{VERDICT_SYMBOLS[worst]} {VERDICT_WORDS[worst]}"
    extra = [ROLE_MARKS[r][0] + " " + ("hazards" if r == "hazard" else "stack findings") for r in ROLE_MARKS
             if any(role_of(c) == r and c["status"] in ("fail", "fallback") and (r != "hazard" or hazard_shows(c))
                    for g in groups for c in g)]
    return text + ("" if not extra else " (" + ", ".join(extra) + ")")


def closing_sentence(cells: list[dict[str, Any]], fail_on_failure: bool) -> tuple[str, int]:
    """(``packcheck audit``'s closing sentence, the number of correctness checks that did not pass). The sentence
    states the correctness checks pytest's closing line counts as "failed" (one item per check: a fail, a fallback,
    an error, a timeout or out of memory; an unsupported or skipped check is pytest's "skipped"), the matrix cells
    that fail (❌, a fallback) and the models they fall on, the cells with no verdict, and the exit status with its
    reason: 0 because a written matrix is the audit's result, unless ``--fail-on-failure``, which exits 1 when any
    correctness check did not pass, a crash or an error included (trial of issue 42: a run whose every cell errored,
    nothing judged, exited 0 under it)."""
    n = matrix_counts(cells)
    total = sum(n["cells"].values())
    failing_keys = [k for k in n["cells"] if k in ("fail", "fallback")]
    failing = sum(n["cells"][k] for k in failing_keys)
    no_verdict = sum(v for k, v in n["cells"].items() if k not in ("pass", "fail", "fallback"))
    models = sorted({m for k in failing_keys for m in n["models"].get(k, [])})
    correctness = [c for c in cells if role_of(c) == "correctness" and c["status"] not in ("skipped", "unsupported")]
    failed = sum(c["status"] != "pass" for c in correctness)
    rest = f"; {no_verdict} cell{'s' if no_verdict != 1 else ''} got no verdict (not checked, refused or crashed)" if no_verdict else ""
    if fail_on_failure and failed:
        status = "exit 1 (--fail-on-failure)."
    elif failed:
        status = ("exit 0: the matrix was written, which is the audit's result; add --fail-on-failure to exit 1 when a "
                  "correctness check does not pass (CI).")
    else:
        status = "exit 0."
    if not failing:
        return (f"packcheck audit: no matrix cell fails ({n['cells'].get('pass', 0)} of {total} pass{rest}; {failed} of "
                f"{len(correctness)} correctness checks run did not pass); {status}"), failed
    named = ", ".join(models[:8]) + (" …" if len(models) > 8 else "")
    text = (f"packcheck audit: {failed} of {len(correctness)} correctness checks run did not pass (pytest's \"failed\" "
            f"items, one per check), and {failing} of {total} matrix cells fail, on {len(models)} "
            f"model{'s' if len(models) != 1 else ''} ({named}){rest}; {status}")
    return text, failed
