"""Rendering: results document in, Markdown / HTML / terminal text out. Pure and deterministic.

A matrix cell's headline is decided by the checks whose registry role is ``correctness`` only: ✅ means every
one of them that ran passed, and the ones that could not run are named ("not checked"). Hazards and stack
findings are counted once per environment and backend above the matrix; a model that departs from its stack's
pattern is marked (⚑) on its own cell.
Marks follow the roles everywhere (issue 23.6): a hazard that showed is 🔶 "hazard shown", a failed stack
contract item 🔷 "stack finding" (:func:`check_mark`), and the headline counts matrix cells by verdict
(:func:`matrix_counts`), never checks.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from .checks.registry import CAUSES, REGISTRY, ROLES, SPECS
from .markdown import escape_md, plain
from .results import STATUSES, SYMBOLS

LEGEND = {
    "pass": "pass: measured within tolerance",
    "fail": "fail: a measured number is out of tolerance (the cause names what it shows)",
    "fallback": "fallback: the requested attention backend is not what ran",
    "unsupported": "unsupported: the stack refuses this combination with an explicit error",
    "skipped": "not checked: this environment lacks something (reason given); never a pass",
    "error": "error: crashed (exception, or the signal that killed the isolated child, given), or a probe was inconclusive",
    "timeout": "timeout: no result within --packcheck-timeout (the hung child was killed)",
    "oom": "oom: out of memory (memory figures given)",
}
#: What a hazard's or finding's own mark means (:data:`ROLE_MARKS`).
ROLE_LEGEND = {
    "hazard": "a hazard probe showed the hazard (usage outside the standard contract): said once per stack, never a model failure",
    "finding": "a contract item of the library stack failed (the same for every model on it): never a model failure",
}
#: The key number of each check (metrics key, label), from the registry.
KEY_METRIC = {s.name: s.key_metric for s in REGISTRY if s.key_metric}


def _v(env: dict[str, Any], key: str) -> str:
    return str(env.get(key) or "not installed")


def _rank(status: str) -> int:
    return STATUSES.index(status)


def cell_status(statuses: list[str]) -> str:
    """Worst verdict of a group, ignoring skipped checks unless all are skipped."""
    ran = [s for s in statuses if s != "skipped"]
    if not ran:
        return "skipped"
    return min(ran, key=_rank)


def _fmt_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1e}"
    return str(value)


def _key_number(cell: dict[str, Any]) -> str:
    spec = SPECS.get(cell["check"])
    return spec.key_number(cell.get("metrics", {})) if spec else ""


def _role(cell: dict[str, Any]) -> str:
    return cell.get("role") or (SPECS[cell["check"]].role if cell["check"] in SPECS else "correctness")


def _cause_label(cause: str) -> str:
    return cause.replace("_", " ")


#: Marks of a hazard or finding that did not pass (registry roles, issue 23.6): never a model's red ❌.
ROLE_MARKS = {"hazard": ("🔶", "hazard shown"), "finding": ("🔷", "stack finding")}


def check_mark(cell: dict[str, Any]) -> tuple[str, str, str]:
    """(symbol, text label, css class) of one check's verdict, by its role: a correctness check shows its
    status (✅ pass, ❌ fail, …); a hazard or finding whose probe showed something (fail / fallback) shows
    🔶 "hazard shown" or 🔷 "stack finding" and the class ``hazard`` / ``finding`` (never the red ``fail``)."""
    status, role = cell["status"], _role(cell)
    if role in ROLE_MARKS and status in ("fail", "fallback"):
        sym, label = ROLE_MARKS[role]
        return sym, label, role
    if role in ROLE_MARKS and status in ("error", "timeout", "oom"):
        return SYMBOLS[status], f"{role} {status}", f"{role}-{status}"
    return SYMBOLS[status], "not checked" if status == "skipped" else status, status


def matrix_counts(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline counts by role: ``cells`` (matrix cells, i.e. model x backend x dtype x environment groups
    with a correctness check, counted by their headline verdict), ``models`` (verdict -> the models with a cell
    of that verdict), ``hazards`` (hazard probes that showed the hazard / hazard probes that measured),
    ``findings`` (finding checks that failed / ran, and failed contract items) and ``checks`` (every check run,
    by status)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)
    verdicts: Counter = Counter()
    models_by: dict[str, set[str]] = defaultdict(set)
    for (label, *_), group in groups.items():
        if not any(_role(c) == "correctness" for c in group):
            continue
        status = headline(group)["status"]
        verdicts[status] += 1
        models_by[status].add(label)
    hazard_cells = [c for c in cells if _role(c) == "hazard" and c["status"] not in ("skipped",)]
    finding_cells = [c for c in cells if _role(c) == "finding" and c["status"] not in ("skipped",)]
    items = [it for c in finding_cells for it in (((c.get("metrics") or {}).get("items")) or {}).values() if isinstance(it, dict)]
    return {"cells": verdicts, "models": {k: sorted(v) for k, v in models_by.items()},
            "hazards": (sum(c["status"] in ("fail", "fallback") for c in hazard_cells), len(hazard_cells)),
            "findings": (sum(c["status"] in ("fail", "fallback") for c in finding_cells), len(finding_cells),
                         sum(it.get("status") == "fail" for it in items)),
            "checks": Counter(c["status"] for c in cells)}


def counts_line(cells: list[dict[str, Any]], symbols: bool = True) -> str:
    """One line of the counts by role (Markdown with symbols, or plain for the terminal): matrix cells by
    verdict and the models they fall on, then hazards shown, stack findings, and the checks run."""
    n = matrix_counts(cells)

    def sym(status: str) -> str:
        return f"{SYMBOLS[status]} " if symbols else ""
    total = sum(n["cells"].values())

    def models(status: str) -> str:
        ms = n["models"].get(status, [])
        if status in ("pass", "skipped") or not ms:
            return ""
        return f" ({len(ms)} {'model' if len(ms) == 1 else 'models'}: {', '.join(ms[:8])}{' …' if len(ms) > 8 else ''})"

    axes = "model x backend" + (" x dtype" if len({c["dtype"] for c in cells}) > 1 else "")
    verdicts = ", ".join(f"{sym(s)}{s if s != 'skipped' else 'not checked'} {n['cells'][s]}{models(s)}"
                         for s in reversed(STATUSES) if n["cells"][s])
    text = f"Matrix cells ({axes}, judged by the correctness checks): {verdicts} (of {total})."
    shown, measured = n["hazards"]
    if measured:
        text += f" Hazards: {ROLE_MARKS['hazard'][0] + ' ' if symbols else ''}{shown} of {measured} hazard probes showed one (never a model failure)."
    failed, ran, items = n["findings"]
    if ran:
        text += (f" Stack findings: {ROLE_MARKS['finding'][0] + ' ' if symbols else ''}{items} contract items failed in "
                 f"{failed} of {ran} finding checks (facts of the library stack).")
    checks = n["checks"]
    text += " Checks run: " + ", ".join(f"{s} {checks[s]}" for s in STATUSES if checks[s]) + f" (of {len(cells)})."
    return text


def headline(group: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict of one matrix cell (one model, backend, dtype and environment) from its correctness checks
    only: ``status`` (the worst that ran; "skipped" when none ran), ``causes`` (the diagnosed causes of the
    correctness checks that did not pass, worst first), ``not_checked`` (correctness checks skipped, with their
    reasons) and ``cells`` (the correctness cells). A group with no correctness check (only hazards were
    asked for) takes every check."""
    judged = [c for c in group if _role(c) == "correctness"] or list(group)
    status = cell_status([c["status"] for c in judged])
    # worst first; among equals the isolation probe, then the registry's order (the number that says most first)
    order = {name: i for i, name in enumerate(["isolation", *(s for s in SPECS if s != "isolation")])}
    bad = sorted((c for c in judged if c["status"] not in ("pass", "skipped")),
                 key=lambda c: (_rank(c["status"]), order.get(c["check"], len(order)), c["check"]))
    causes = list(dict.fromkeys((c.get("diagnosis") or {}).get("cause") or c.get("cause") or c["status"] for c in bad))
    not_checked = {c["check"]: c["message"] for c in judged if c["status"] == "skipped"}
    return {"status": status, "causes": causes, "not_checked": not_checked, "cells": judged, "bad": bad}


def _headline_text(group: list[dict[str, Any]], marks: list[str] | None = None) -> str:
    """A matrix cell: symbol, cause (or "not checked"), the correctness checks that could not run, and the ⚑ marks
    of a model that departs from its stack's hazard pattern."""
    h = headline(group)
    status = h["status"]
    if status == "pass":
        text = SYMBOLS["pass"] + (f" (not checked: {', '.join(h['not_checked'])})" if h["not_checked"] else "")
    elif status == "skipped":
        text = f"{SYMBOLS['skipped']} not checked"
    elif status in ("unsupported", "error", "timeout", "oom"):
        named = {"unsupported": "refused", "error": "crash", "timeout": "timeout", "oom": "out of memory"}[status]
        causes = [c for c in h["causes"] if c not in ("crash", "hang", "out_of_memory", status)]
        text = f"{SYMBOLS[status]} {', '.join(_cause_label(c) for c in causes) or named}"
    else:
        text = f"{SYMBOLS[status]} {', '.join(_cause_label(c) for c in h['causes'])}"
    return text + "".join(f" ⚑ {m}" for m in marks or [])


# ------------------------------------------------------------------------------------------------------------
# stack hazards and findings: counted once per environment, dtype and backend


def _hazard_rows(cells: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per (hazard, environment, dtype, backend): the models that show it and the models measured, from the
    hazard checks' verdicts and the logits_parity probe of two packed rows (batch_rows)."""
    out: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"shown": [], "measured": [], "causes": Counter()})
    for c in cells:
        key_rest = (env_label(c), c["dtype"], c["backend"])
        own = (c.get("diagnosis") or {}).get("cause") or c.get("cause")
        if _role(c) == "hazard" and (c["status"] == "pass" or (c["status"] == "fail" and own in ("cache_trap", "mask_override"))):
            # a hazard probe on a row that is wrong without the hazard too measures the model's own fault, already in
            # its correctness verdict: not counted here
            row = out[(c["check"], *key_rest)]
            row["measured"].append(c["model"]["label"])
            if c["status"] == "fail":
                row["shown"].append(c["model"]["label"])
                row["causes"][(c.get("diagnosis") or {}).get("cause") or c.get("cause")] += 1
        if c["check"] == "logits_parity" and c["status"] == "pass" and isinstance((c.get("metrics") or {}).get("max_abs_diff_two_rows"), float):
            row = out[("batch_rows", *key_rest)]
            row["measured"].append(c["model"]["label"])
            if any(f.get("cause") == "batch_rows" for f in c.get("findings") or []):
                row["shown"].append(c["model"]["label"])
                row["causes"]["batch_rows"] += 1
    return out


def model_mark(label: str, by_group: dict[tuple, list[dict[str, Any]]]) -> str:
    """A model's mark with its text label (details summary, HTML): the worst headline of its matrix cells (groups
    with a correctness check); hazards and findings never make it red: a model with only those is ✅ with
    "🔶 hazards" / "🔷 stack findings" beside it."""
    groups = [g for (m, _, _, _), g in by_group.items() if m == label]
    judged = [headline(g)["status"] for g in groups if any(_role(c) == "correctness" for c in g)]
    worst = cell_status(judged) if judged else "skipped"
    text = f"{SYMBOLS[worst]} {'not checked' if worst == 'skipped' else worst}"
    extra = [ROLE_MARKS[r][0] + " " + ("hazards" if r == "hazard" else "stack findings") for r in ROLE_MARKS
             if any(_role(c) == r and c["status"] in ("fail", "fallback") for g in groups for c in g)]
    return text + ("" if not extra else " (" + ", ".join(extra) + ")")


def departures(cells: list[dict[str, Any]]) -> dict[tuple, list[str]]:
    """⚑ marks: per (model, environment, dtype, backend), the hazards where this model departs from the pattern of
    the other models on its stack (shown where most are not, or the reverse). Needs at least three models."""
    marks: dict[tuple, list[str]] = defaultdict(list)
    for (hazard, env, dtype, backend), row in _hazard_rows(cells).items():
        n, k = len(row["measured"]), len(row["shown"])
        if n < 3 or k in (0, n):
            continue
        majority_shows = k * 2 > n
        for model in row["measured"]:
            if (model in row["shown"]) != majority_shows:
                marks[(model, env, dtype, backend)].append(("no " if majority_shows else "") + _cause_label(hazard))
    return marks


_HAZARD_TITLES = {
    "cache_trap": "cache trap: the packed row called with use_cache as configured (a hand-written loop)",
    "mask_trap": "mask trap: an all-ones attention_mask beside the packed row",
    "batch_rows": "two packed rows per batch without cu_seq_lens",
}


def _hazards_section(cells: list[dict[str, Any]], backends: list[str], labels: dict[str, str], envs: list[str | None]) -> list[str]:
    """One table per environment and dtype: a row per hazard, a column per backend, "shown / measured" models;
    the remedy once per hazard."""
    from tabulate import tabulate

    from .analysis.diagnose import remedy

    rows = _hazard_rows(cells)
    if not rows:
        return []
    lines = ["## Stack hazards (usage outside the standard contract; never a model failure)", "",
             ("Each number is models showing the hazard / models measured, on that backend. Measured: models whose packed "
              "row is right without the hazard (a model already wrong without it is counted under its own verdict; "
              "refused or crashed models are left out). The ✅ cells above hold "
              "under the standard contract: use_cache=False (transformers' Trainer >= 5.0 and TRL set it), no "
              "attention_mask beside the packed row, one packed row per micro-batch or cu_seq_lens_q/k with it."), ""]
    for e in envs:
        for dtype in sorted({k[2] for k in rows if k[1] == e}):
            table = []
            for hazard in ("cache_trap", "mask_trap", "batch_rows"):
                entries = [rows.get((hazard, e, dtype, b)) for b in backends]
                if not any(entries):
                    continue
                table.append([_HAZARD_TITLES[hazard]] + [f"{len(r['shown'])}/{len(r['measured'])}" if r else "—" for r in entries])
            if table:
                where = f" ({_env_header(e, cells)})" if e else ""
                lines += [f"{dtype}{escape_md(where)}:", "",
                          tabulate(table, headers=["hazard", *[labels.get(b, b) for b in backends]], tablefmt="github"), ""]
    env_doc: dict[str, Any] = {}
    for hazard in ("cache_trap", "mask_trap", "batch_rows"):
        shown = [r for k, r in rows.items() if k[0] == hazard and r["shown"]]
        if shown:
            cause = next(iter(shown[0]["causes"])) or hazard
            lines.append(f"- {_HAZARD_TITLES[hazard].split(':')[0]}: {escape_md(remedy(cause, {'backend': 'sdpa', 'check': hazard, 'metrics': {}}, env_doc))}.")
    return lines + [""]


def _findings_section(cells: list[dict[str, Any]], envs: list[str | None]) -> list[str]:
    """The library stack's facts (checks whose role is ``finding``), once per environment: per contract item,
    the models it holds on and fails on, with the evidence; models that depart are named."""
    lines: list[str] = []
    for e in envs:
        for spec in [s for s in REGISTRY if s.role == "finding"]:
            group = [c for c in cells if c["check"] == spec.name and env_label(c) == e]
            if not group:
                continue
            where = f" ({_env_header(e, cells)})" if e else ""
            ran = [c for c in group if c["status"] not in ("skipped",)]
            if not ran:
                lines.append(f"- **{spec.name}**{escape_md(where)}: not checked: {escape_md(group[0]['message'])}")
                continue
            items: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
            for c in ran:
                its = (c.get("metrics") or {}).get("items")
                if isinstance(its, dict):
                    for name, it in its.items():
                        items[name][f"{it['status']}: {it['evidence']}"].append(c["model"]["label"])
                else:
                    items["verdict"][f"{c['status']}: {c['message']}"].append(c["model"]["label"])
            parts = []
            for name, outcomes in items.items():
                for text, models in sorted(outcomes.items(), key=lambda kv: -len(kv[1])):
                    status, _, evidence = text.partition(": ")
                    who = f"{len(models)}/{len(ran)} models" + ("" if len(models) * 2 > len(ran) else f" ({', '.join(models[:6])})")
                    sym = ROLE_MARKS["finding"][0] if status == "fail" else SYMBOLS.get(status, "")
                    parts.append(f"  - {sym} {name}: {escape_md(_cut(evidence, 220))} — {who}")
            title = {"collate": "transformers' DataCollatorWithFlattening", "collate_trl": "TRL's padding-free collator",
                     "packing_content": "TRL's pack_dataset"}.get(spec.name, spec.name)
            lines.append(f"- **{title}** (`{spec.name}`){escape_md(where)}:")
            lines += parts
    if not lines:
        return []
    return ["## Stack findings (facts of the library stack, not of a model)", "",
            "Each contract item is checked on its own; the count is the models it was measured on.", "", *lines, ""]


def _not_checked_section(cells: list[dict[str, Any]], backends: list[str], labels: dict[str, str]) -> list[str]:
    """What could not be looked at, once per backend and reason: never a pass."""
    by: dict[tuple[str, str], set[str]] = defaultdict(set)
    for c in cells:
        if c["status"] == "skipped" and _role(c) == "correctness":
            by[(labels.get(c["backend"], c["backend"]) if c["backend"] else "(model level)", f"{c['check']}: {c['message']}"
                if len({x['check'] for x in cells if x['backend'] == c['backend'] and x['status'] == 'skipped'
                        and x['model']['label'] == c['model']['label']}) < 3 else c["message"])].add(c["model"]["label"])
    if not by:
        return []
    lines = ["## Not checked", ""]
    for (backend, why), models in sorted(by.items()):
        lines.append(f"- {escape_md(backend)}, {len(models)} models: {escape_md(_cut(why, 200))}")
    return lines + [""]


def _models_are(models: dict[str, Any], settings: dict[str, Any]) -> str:
    """What the models are, in one sentence: transformers' default configs shrunk with random weights (``arch:``
    specs), or the checkpoints named."""
    kinds = Counter(m.get("kind") or ("arch" if str(m.get("spec", "")).startswith("arch:") else "other") for m in models.values())
    weights = settings.get("weights") or "random"
    if kinds and set(kinds) == {"arch"}:
        return (f"The models are transformers' own default configs (`arch:<model_type>`, the config class's defaults, "
                f"overrides in braces), shrunk to a tiny size (a few layers, small hidden size), with {weights} weights: "
                "the verdicts are about the architecture's code path on this stack, not about a trained checkpoint.")
    return (f"The models: {kinds.get('arch', 0)} transformers default configs (shrunk, {weights} weights) and "
            f"{sum(v for k, v in kinds.items() if k != 'arch')} named checkpoints or folders; weights: {weights}.")


def _trainer_note(cells: list[dict[str, Any]]) -> list[str]:
    """What the answer does not cover when no trainer check ran, and the one command that does."""
    if any(c["check"] in ("trainer", "sft") for c in cells):
        return []
    return [("**Not run here: transformers' Trainer and TRL's SFTTrainer themselves** (the `trainer` / `sft` checks: a "
             "few optimizer steps packed vs padded, gradient accumulation's num_items_in_batch, TRL's packer). The verdicts "
             "below are of the model fed the packed row as the Trainer feeds it (restarting position_ids, no "
             "attention_mask, use_cache=False). To measure the trainers on this stack: `packcheck audit --audit training` "
             "(TRL for the SFT checks: `pip install -c constraints/cpu.txt -e '.[trl]'`)."), ""]


def _at_a_glance(models: dict[str, Any], by_group: dict[tuple, list[dict]], backends: list[str], dtype: str,
                 labels: dict[str, str], gpu_only: list[str]) -> list[str]:
    """The "Do not pack" list (model, backends, cause with its number, remedy), then "Safe" in one line per group
    of backends (the models safe on exactly those), then the backends that ran nothing here, named once."""
    bad, safe_by = [], defaultdict(list)
    for label in models:
        failing: dict[str, list[str]] = defaultdict(list)
        first: dict[str, dict[str, Any]] = {}
        safe = []
        for b in backends:
            group = by_group.get((label, b, dtype, None), [])
            if not group or b in gpu_only:
                continue
            h = headline(group)
            if h["status"] in ("fail", "fallback"):
                key = ", ".join(_cause_label(c) for c in h["causes"])
                failing[key].append(labels.get(b, b))
                first.setdefault(key, h["bad"][0])
            elif h["status"] == "pass":
                safe.append(labels.get(b, b) + (f" ({', '.join(h['not_checked'])} not checked)" if h["not_checked"] else ""))
        for cause, where in failing.items():
            c = first[cause]
            fix = (c.get("diagnosis") or {}).get("remedy") or ""
            bad.append(f"- **{escape_md(label)}** on {', '.join(where)}: {cause} ({c['check']} {_key_number(c)})"
                       + (f"; remedy: {escape_md(fix)}" if fix else "") + ".")
        if safe:
            safe_by[tuple(safe)].append(label)
    lines = ["### Do not pack", ""] + (bad or ["- none: no model failed a correctness check here."]) + [""]
    lines += ["### Safe (every correctness check that ran passed; the ones that could not run are named)", ""]
    lines += [f"- on {', '.join(where)}: {', '.join(escape_md(m) for m in ms)}"
              for where, ms in sorted(safe_by.items(), key=lambda kv: (-len(kv[0]), kv[0]))] or ["- none"]
    lines.append("")
    if gpu_only:
        lines += [f"Not run on this machine (every model): {', '.join(labels.get(b, b) for b in gpu_only)}; see \"Not checked\".", ""]
    return lines


def _answer_section(models: dict[str, Any], by_group: dict[tuple, list[dict]], backends: list[str], dtypes: list[str],
                    labels: dict[str, str], marks: dict[tuple, list[str]], cells: list[dict[str, Any]] | None = None,
                    settings: dict[str, Any] | None = None) -> list[str]:
    """The answer: what the models are, what was not run (the trainers), per dtype the "Do not pack" list and
    the "Safe" groups, then one line per model: safe backends, do-not-pack backends with the cause and its
    number, and what was not checked (backends that ran nothing for any model are named once above)."""
    cells = cells or [c for g in by_group.values() for c in g]
    # backends where no model ran anything (a CUDA kernel on a CPU machine): named once, not on every model's line
    gpu_only = [b for b in backends if all(headline(g)["status"] == "skipped" for k, g in by_group.items() if k[1] == b)
                and any(k[1] == b for k in by_group)]
    lines = ["## The answer", "", _models_are(models, settings or {}), "", *_trainer_note(cells),
             ("Per model: where padding-free packing trains it the same as padding (fed as transformers' Trainer and "
              "TRL feed it: restarting position_ids, no attention_mask, use_cache=False), where it does not and why, "
              "and where packcheck could not look. Numbers: Δ is the largest absolute difference of logits (or loss, "
              "in nats) against the reference, rel a relative error; tolerances at the end. \"varlen reference (CPU, "
              "not FA2)\" is packcheck_flash_ref: transformers' flash-attention preparation code with an exact "
              "per-segment kernel on CPU, a stand-in for the flash path, not FlashAttention-2 itself."), ""]
    for dtype in dtypes:
        if len(dtypes) > 1:
            lines += [f"{dtype}:", ""]
        lines += _at_a_glance(models, by_group, backends, dtype, labels, gpu_only)
        lines += ["### Every model", ""]
        for label in models:
            safe, partial, bad, refused, unchecked = [], [], defaultdict(list), [], []
            for b in backends:
                group = by_group.get((label, b, dtype, None), [])
                if not group or b in gpu_only:
                    continue
                h = headline(group)
                name = labels.get(b, b)
                if h["status"] == "pass":
                    if h["not_checked"]:
                        partial.append(f"{name} ({', '.join(h['not_checked'])} not checked, see below)")
                    else:
                        safe.append(name)
                elif h["status"] == "skipped":
                    unchecked.append(name)
                elif h["status"] in ("fail", "fallback"):
                    first = h["bad"][0]
                    number = _key_number(first)
                    key = ", ".join(_cause_label(c) for c in h["causes"])
                    bad[key].append((name, f"{first['check']} {number}".strip()))
                else:
                    first = (h["bad"] or h["cells"])[0]
                    refused.append(f"{name} ({' '.join(_headline_text(group).split(' ')[1:])}: "
                                   f"{escape_md(_cut(' '.join(first['message'].split()), 90))})")
            parts = []
            if bad:
                for cause, where in bad.items():
                    desc = CAUSES.get(cause.replace(" ", "_"), "")
                    parts.append(f"**do not pack** on {', '.join(w for w, _ in where)} with this stack ({cause}"
                                 + (f": {desc}" if desc else "") + f"; {where[0][1]})")
            if safe:
                parts.append(f"safe on {', '.join(safe)}")
            if partial:
                parts.append(f"safe on {'; '.join(partial)}")
            if refused:
                parts.append(f"refused / crashed on {', '.join(refused)}")
            if unchecked:
                parts.append(f"not checked on {', '.join(unchecked)}")
            flagged = sorted({m for b in backends for m in marks.get((label, None, dtype, b), [])})
            if flagged:
                parts.append(f"⚑ departs from its stack: {', '.join(flagged)}")
            lines.append(f"- **{escape_md(label)}**: " + "; ".join(parts) + ".")
        lines.append("")
    return lines


@dataclass(frozen=True)
class Layout:
    """The shape of a matrix, read once from a results document for every renderer (Markdown, details, HTML):
    ``models`` (label -> model record, first-seen order), ``backends`` (the settings' order, else sorted),
    ``dtypes``, ``checks`` (the settings' order, else the registry's), ``envs`` (version environments by version,
    None first for this environment) and ``by_group`` ((model, backend, dtype, env) -> its cells)."""

    models: dict[str, dict[str, Any]]
    backends: list[str]
    dtypes: list[str]
    checks: list[str]
    envs: list[str | None]
    by_group: dict[tuple, list[dict[str, Any]]]

    @property
    def versioned(self) -> bool:
        return self.envs != [None]


def layout(doc: dict[str, Any]) -> Layout:
    cells = doc["cells"]
    settings = doc.get("settings", {})
    models: dict[str, dict[str, Any]] = {}
    by_group: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        models.setdefault(c["model"]["label"], c["model"])
        by_group[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)
    backends = [b for b in settings.get("backends", []) if any(c["backend"] == b for c in cells)] or sorted(
        {c["backend"] for c in cells if c["backend"]})
    checks = [c for c in settings.get("checks", []) if any(x["check"] == c for x in cells)] or list(dict.fromkeys(
        s.name for s in REGISTRY if any(x["check"] == s.name for x in cells)))
    envs = sorted({env_label(c) for c in cells}, key=lambda e: (e is not None, _env_sort_key(e, cells)))
    return Layout(models, backends, sorted({c["dtype"] for c in cells}), checks, envs, by_group)


def render_markdown(doc: dict[str, Any]) -> str:
    """The support matrix: the answer (per model), the stack's hazards and findings (once each), the matrix
    (rows = models, columns = backends; headline from the correctness checks), remedies, legend, then the
    per-model details (every check's verdict and number) in collapsible blocks."""
    from tabulate import tabulate

    from .backends import backend_labels

    cells = doc["cells"]
    env = doc["environment"]
    labels = backend_labels(env)  # the torch varlen column relabelled when a stand-in ran
    settings = doc.get("settings", {})
    lay = layout(doc)
    models, backends, dtypes, checks, envs, by_group = lay.models, lay.backends, lay.dtypes, lay.checks, lay.envs, lay.by_group
    versioned = lay.versioned
    marks = departures(cells)
    bench = doc.get("bench")

    lines = [f"# packcheck support matrix{' — ' + escape_md(settings['audit']) if settings.get('audit') else ''}", ""]
    lines += [
        (f"{'Controller (each column below ran in its own version environment over its torch)' if versioned else 'Measured'} with packcheck {_v(env, 'packcheck')} on {escape_md(env.get('device_name'))} ({env.get('device')}): "
        f"torch {_v(env, 'torch')}, transformers {_v(env, 'transformers')}, trl {_v(env, 'trl')}, "
        f"flash-attn {_v(env, 'flash_attn')}, CUDA {env.get('cuda') or 'none (CPU build)'}, Python {_v(env, 'python')}. "
        f"Weights: {_weights_line(settings, cells)}; dtypes: {', '.join(dtypes)}."
        + (" Remote code: allowed by --packcheck-trust-remote-code (model repositories' own Python code ran)."
           if settings.get("trust_remote_code") else "")
        + (" **Rehearsal: the torch varlen backend ran through a CPU stand-in kernel (PACKCHECK_TORCH_VARLEN_STAND_IN=1), "
           "not PyTorch's FlashAttention-2 kernel; its cells test packcheck's plumbing, not the kernel.**"
           if env.get("torch_varlen_kernel") == "stand-in" else "")),
        "",
        "Reproduce:",
        "",
        "```",
        doc.get("command", ""),
        "```",
        "",
    ]
    if doc.get("incomplete"):
        inc = doc["incomplete"]
        lines += [f"**⚠️ Incomplete: {escape_md(inc['reason'])} after {inc['cells']} cells; {escape_md(inc.get('resume', ''))}.**", ""]
    totals = Counter(check_mark(c)[2] for c in cells)
    lines.append(counts_line(cells))
    lines.append("")
    gate = doc.get("gate")
    if isinstance(gate, dict):  # audit --gate: the result beside the matrix it was read from
        n = gate.get("regressions", 0)
        lines += [f"**Gate: {'❌' if n else '✅'} {n} regression(s), {gate.get('changed', 0)} changed cell(s)**, "
                  f"{escape_md(str(gate.get('candidate')))} (candidate) against {escape_md(str(gate.get('baseline')))} (baseline)"
                  + (f": {escape_md(', '.join(map(str, gate.get('cells') or [])))}" if gate.get("cells") else "") + ".", ""]
    if not versioned:
        lines += _answer_section(models, by_group, backends, dtypes, labels, marks, cells, settings)
    lines += _hazards_section(cells, backends, labels, envs)
    lines += _findings_section(cells, envs)
    if versioned:
        lines += _environments_section(cells, envs)
    for dtype in dtypes:
        lines += [f"## Matrix ({dtype})", ""]
        if versioned:
            # one column per library-version environment, one row per model and backend
            headers = ["model", "backend"] + [_env_header(e, cells) for e in envs]
            rows = []
            for label in models:
                for b in backends:
                    if not any(by_group.get((label, b, dtype, e)) for e in envs):
                        continue
                    row = [escape_md(label), labels.get(b, b)]
                    for e in envs:
                        group = by_group.get((label, b, dtype, e), [])
                        row.append(_headline_text(group, marks.get((label, e, dtype, b))) if group else "")
                    rows.append(row)
            lines.append(tabulate(rows, headers=headers, tablefmt="github"))
            lines.append("")
            continue
        headers = ["model", "model_type / class"] + [labels.get(b, b) for b in backends]
        if bench:
            headers.append("speedup / memory")
        rows = []
        for label, info in models.items():
            rev = f" @{info['revision'][:10]}" if info.get("revision") else ""
            row = [escape_md(label) + escape_md(rev), f"{escape_md(info['model_type'])} / {escape_md(info['model_class'])}"]
            for b in backends:
                group = by_group.get((label, b, dtype, None), [])
                row.append(_headline_text(group, marks.get((label, None, dtype, b))) if group else "")
            if bench:
                from .run.throughput import bench_cell

                row.append(bench_cell([r for r in bench["results"] if r["model"]["label"] == label], cells))
            rows.append(row)
        lines.append(tabulate(rows, headers=headers, tablefmt="github"))
        lines.append("")
    lines += _not_checked_section(cells, backends, labels)
    lines += _training_section(by_group, models, backends, dtypes, envs, cells, labels)
    if bench:
        from .run.throughput import bench_section

        lines += bench_section(bench, cells)
    lines += _what_to_do(doc)
    lines += ["## Legend", ""]
    lines += [f"- {SYMBOLS[s]} {LEGEND[s]}" for s in STATUSES if totals[s]]
    lines += [f"- {sym} {label}: {ROLE_LEGEND[role]}" for role, (sym, label) in ROLE_MARKS.items() if totals[role]]
    lines += [
        "- A matrix cell's verdict comes from its correctness checks only; the cause after ❌ is what they measured.",
        "  \"(not checked: …)\" names correctness checks that could not run there: the ✅ covers the others only.",
        "- Δ: largest absolute difference (logits, or loss in nats) against the reference; rel: relative error.",
        *([("- ⚑ marks a model that departs from its stack's hazard pattern (\"⚑ no cache trap\": most models on this "
            "backend show it, this one does not).")] if marks else []),
        ("- packcheck_flash_ref is packcheck's CPU varlen reference: transformers' own flash-attention preparation code "
        "with an exact per-segment kernel. It is not FlashAttention-2."),
        "",
        "Roles:",
        "",
        *[f"- **{r}**: {t}" for r, t in ROLES.items()],
        "",
        "Checks:",
        "",
        *[f"- `{s.name}` ({s.role}, per {s.level}{', training' if s.training else ''}): {s.summary}" for s in REGISTRY if s.name in checks],
        "",
    ]
    lines += ["## Details", "", ("Every check's verdict, the number it rests on, and each non-pass message with its cause and "
                                 "remedy, per model: `packcheck-details.md` beside this file."), ""]
    tol = {c["dtype"]: c.get("tolerances", {}) for c in cells}
    if tol:
        keys = sorted({k for t in tol.values() for k in t})
        lines += ["## Tolerances", "", f"Source: {escape_md(settings.get('tolerance_source', ''))}", ""]
        lines.append(tabulate([[d] + [tol[d].get(k, "") for k in keys] for d in sorted(tol)], headers=["dtype", *keys], tablefmt="github"))
        lines.append("")
    lines += ["## Environment", "", tabulate([[k, escape_md(v)] for k, v in env.items()], headers=["", "value"], tablefmt="github"), ""]
    return "\n".join(lines)


def _weights_line(settings: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """The header's weights: the --packcheck-weights mode, and under ``pretrained`` the models whose cells ran
    random weights instead (an arch: spec has no checkpoint; each cell's ``model.weights``, from
    :func:`models.loaded_weights`)."""
    mode = settings.get("weights")
    random = sorted({c["model"]["label"] for c in cells if c["model"].get("weights") == "random"})
    if mode != "pretrained" or not random:
        return str(mode)
    ran = sorted({c["model"]["label"] for c in cells if c["model"].get("weights") == "pretrained"})
    if not ran:
        return "random (pretrained was asked for, but every model is an arch: spec, which has no checkpoint)"
    return (f"pretrained for {', '.join(escape_md(m) for m in ran)}; random (shrunk, an arch: spec has no checkpoint) for "
            f"{', '.join(escape_md(m) for m in random)}")


def write_reports(out: Any, doc: dict[str, Any], flag: str = "--packcheck-report-dir") -> list[str]:
    """Write ``packcheck-matrix.json``, ``.md``, ``.html`` and ``packcheck-details.md`` into the folder ``out`` (atomically, scrubbed);
    returns their paths. Written as one set (:func:`results.write_set`): a kill leaves the old four or part of
    the new four, never a mix.

    Raises:
        PackcheckUsageError: the folder cannot be written (a full disk is named as such).
    """
    import json
    from pathlib import Path

    from .html import render_html
    from .results import write_set

    out = Path(out)
    paths = [out / "packcheck-matrix.md", out / "packcheck-matrix.json", out / "packcheck-matrix.html", out / "packcheck-details.md"]
    # one set (results.write_set): rendered first, the old four removed, then renamed in, the JSON last, so a kill
    # never leaves this run's JSON beside the previous run's Markdown, details or HTML
    write_set([(paths[0], render_markdown(doc)), (paths[2], render_html(doc)), (paths[3], render_details(doc)),
               (paths[1], json.dumps(doc, indent=1, sort_keys=False) + "\n")], flag)
    return [str(p) for p in paths]


def render_details(doc: dict[str, Any]) -> str:
    """``packcheck-details.md``: per model, in a collapsible block, every check's verdict and key number per
    backend, then each check that did not pass with its message, cause and remedy."""
    from .backends import backend_labels

    lay = layout(doc)
    lines = _details(list(lay.models), lay.by_group, lay.backends, lay.dtypes, lay.envs, lay.checks,
                     backend_labels(doc["environment"]), doc["cells"])
    if doc.get("incomplete"):
        inc = doc["incomplete"]
        lines[1:1] = ["", f"**⚠️ Incomplete: {escape_md(inc['reason'])} after {inc['cells']} cells; {escape_md(inc.get('resume', ''))}.**"]
    return "\n".join(lines)


def _details(models: list[str], by_group: dict[tuple, list[dict]], backends: list[str], dtypes: list[str],
             envs: list[str | None], checks: list[str], labels: dict[str, str], cells: list[dict[str, Any]]) -> list[str]:
    from tabulate import tabulate

    lines = ["# packcheck details", "", "Every check's verdict and the number it rests on, per model (click to open).", "",
             ("Marks follow the checks' roles: ✅ pass and ❌ fail are correctness checks (they decide the model's mark); "
              f"{ROLE_MARKS['hazard'][0]} {ROLE_MARKS['hazard'][1]} is a hazard probe that showed its hazard and "
              f"{ROLE_MARKS['finding'][0]} {ROLE_MARKS['finding'][1]} a failed contract item of the library stack: "
              "neither is a failure of the model."), ""]
    for label in models:
        blocks = []
        for dtype in dtypes:
            for e in envs:
                rows, notes = [], []
                for b in [None, *backends]:
                    group = {c["check"]: c for c in by_group.get((label, b, dtype, e), [])}
                    if not group or all(c["status"] == "skipped" for c in group.values()):
                        continue  # listed under "Not checked"
                    row = [labels.get(b, b) if b else "(model level)"]
                    for chk in checks:
                        c = group.get(chk)
                        if c:
                            sym, word, _ = check_mark(c)
                            row.append(f"{sym} {word if word not in ('pass', 'fail') or _role(c) != 'correctness' else ''} "
                                       f"{_key_number(c)}".replace("  ", " ").strip())
                        else:
                            row.append("")
                        if c and c["status"] not in ("pass", "skipped"):
                            d = c.get("diagnosis") or {}
                            cause = f" — cause: {d['cause']}; remedy: {d['remedy']}" if d.get("cause") and d.get("remedy") else ""
                            notes.append(f"- {labels.get(b, b) if b else 'model level'} / {chk} ({_role(c)}), {check_mark(c)[1]}: "
                                         f"{escape_md(_cut(c['message'], 400))}{escape_md(cause)}")
                    rows.append(row)
                if rows:
                    where = f", {_env_header(e, cells)}" if e else ""
                    headers = ["backend"] + [f"{chk} ({SPECS[chk].role})" if chk in SPECS and SPECS[chk].role != "correctness" else chk
                                             for chk in checks]
                    blocks += [f"**{dtype}{escape_md(where)}**", "", tabulate(rows, headers=headers, tablefmt="github"), "", *notes, ""]
        if blocks:
            lines += ["<details>", f"<summary>{model_mark(label, by_group)} {escape_md(label)}</summary>", "", *blocks,
                      "</details>", ""]
    return lines


#: Columns of the training-modes table: (header, check, how to read the cell's metrics).
TRAINING_MODES = (
    ("Trainer + flattening", "trainer", "trainer"),
    ("Trainer grad accum", "trainer", "grad_accum"),
    ("Trainer padded", "trainer_padded", "padded"),
    ("SFT packing (default)", "sft", "steps"),
    ("SFT padded", "sft_padded", "padded"),
    ("SFT padding_free, no packing", "sft_padding_free", "steps"),
    ("SFT bfd", "sft_strategies", "bfd"),
    ("SFT bfd_split", "sft_strategies", "bfd_split"),
    ("SFT ffd", "sft_strategies", "ffd"),
    ("SFT wrapped", "sft_strategies", "wrapped"),
)


def _training_entry(cell: dict[str, Any], read: str) -> str:
    """One training-mode cell: verdict symbol and the number behind it (max per-step loss delta vs padded)."""
    m = cell.get("metrics", {})
    sym = SYMBOLS[cell["status"]]
    if cell["status"] in ("skipped", "unsupported", "error", "timeout", "oom"):
        return sym
    if read == "trainer":
        a, b = m.get("as_configured") or {}, m.get("use_cache_false") or {}
        text = f"{sym} {_fmt_metric(a.get('max_loss_delta'))}"
        padded = m.get("padded_trainer") or {}
        if padded.get("normalisation"):
            text += f" (Trainer's padded run: loss x{padded['loss_ratio']:.3f})"
        elif cell["status"] != "pass" and isinstance(b.get("max_loss_delta"), float) and b["max_loss_delta"] < a.get("max_loss_delta", 0):
            text += f"; use_cache=False {_fmt_metric(b['max_loss_delta'])}"
        return text
    if read == "grad_accum":
        ga = (m.get("grad_accum") or {}).get("packed") or {}
        seen = sorted({n for n in ga.get("num_items_in_batch", []) if n is not None})
        if not ga:
            return ""
        if not seen:
            return "not passed"
        ok = seen == [ga["expected"]]
        return f"{'✅' if ok else '❌'} {'/'.join(map(str, seen))} of {ga['expected']}"
    if read == "padded":  # the trainer's own padded run vs the hand-written reference
        text = f"{sym} {_fmt_metric(m.get('max_loss_delta'))}"
        return text + (f" (loss x{m['loss_ratio']:.3f})" if m.get("normalisation") else "")
    if read == "steps":
        delta = (m.get("steps") or {}).get("max_loss_delta", m.get("loss_delta"))
        return f"{sym} {_fmt_metric(delta)}" if delta is not None else f"{sym} (batch contract, see the notes)"
    entry = (m.get("strategies") or {}).get(read)
    if not entry:
        return ""
    if not entry.get("available"):
        return "n/a"
    delta = _fmt_metric((entry.get("steps") or {}).get("max_loss_delta"))
    if read == "wrapped":
        return f"ℹ️ {delta} (by design)"
    bad = any(p.startswith(f"{read}:") for p in cell["message"].split("; ")) and cell["status"] == "fail"
    return f"{'❌' if bad else '✅'} {delta}"


def _training_section(by_group: dict[tuple, list[dict]], models: dict[str, Any], backends: list[str], dtypes: list[str],
                      envs: list[str | None], cells: list[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """The training-modes table (when the audit ran trainer / sft checks): one column per way of training
    packed, each with its verdict and the max per-step loss delta against the padded run."""
    from tabulate import tabulate

    present = {c["check"] for c in cells}
    modes = [(h, chk, read) for h, chk, read in TRAINING_MODES if chk in present]
    if not modes:
        return []
    rows = []
    for dtype in dtypes:
        for label in models:
            for b in backends:
                for e in envs:
                    group = {c["check"]: c for c in by_group.get((label, b, dtype, e), [])}
                    entries = [_training_entry(group[chk], read) if chk in group else "" for _, chk, read in modes]
                    if any(entries):
                        rows.append([escape_md(label), labels.get(b, b)] + ([dtype] if len(dtypes) > 1 else [])
                                    + ([escape_md(_env_header(e, cells))] if e else []) + entries)
    if not rows:
        return []
    keep = [i for i in range(len(modes)) if any(r[-len(modes) + i] not in ("", "n/a") for r in rows)]
    fixed = len(rows[0]) - len(modes)
    rows = [r[:fixed] + [r[fixed + i] for i in keep] for r in rows]
    headers = (["model", "backend"] + (["dtype"] if len(dtypes) > 1 else []) + (["versions"] if any(e for e in envs) else [])
               + [modes[i][0] for i in keep])
    return ["## Training modes", "",
            ("Each column trains the same examples one way, packed, against the padded run: the number is the largest "
             "per-step loss difference over the steps (grad accum: the num_items_in_batch Trainer passed, of the label "
             "tokens after the shift). Wrapped packing joins examples by design (TRL's documentation) and is shown, "
             "not judged."), "",
            tabulate(rows, headers=headers, tablefmt="github"), ""]


def env_label(cell: dict[str, Any]) -> str | None:
    """The version environment a cell ran in (its ``--packcheck-versions`` label), None for this one."""
    return (cell.get("env") or {}).get("label")


def _env_versions(label: str | None, cells: list[dict[str, Any]]) -> dict[str, str]:
    for c in cells:
        if env_label(c) == label and (c.get("env") or {}).get("versions"):
            return c["env"]["versions"]
    return {}


def _env_sort_key(label: str | None, cells: list[dict[str, Any]]) -> tuple:
    from packaging.version import InvalidVersion, Version

    out = []
    for name, version in sorted(_env_versions(label, cells).items()):
        try:
            out.append((name, Version(version)))
        except InvalidVersion:
            out.append((name, Version("0")))
    return (tuple(out), label or "")


def _env_header(label: str | None, cells: list[dict[str, Any]]) -> str:
    """Column title: the resolved versions of what the label asked for, e.g. ``transformers 4.51.3``."""
    if label is None:
        return "this environment"
    versions = _env_versions(label, cells)
    asked = [r.split("=")[0].split("<")[0].split(">")[0].split("~")[0].split("!")[0] for r in label.split("+")]
    parts = [f"{n} {versions[n]}" if n in versions else r for n, r in zip(asked, label.split("+"), strict=True)]
    return ", ".join(parts)


def _environments_section(cells: list[dict[str, Any]], envs: list[str | None]) -> list[str]:
    """One row per version environment: what was asked, what was resolved, and how long it took to make."""
    from tabulate import tabulate

    rows = []
    for e in envs:
        info = next(((c.get("env") or {}) for c in cells if env_label(c) == e), {})
        if e is None:
            continue
        child = info.get("environment") or {}
        versions = ", ".join(f"{k} {v}" for k, v in sorted((info.get("versions") or {}).items())) or "not made"
        made = info.get("env_created")
        made_text = "—" if made is None else f"{'made' if made else 'cached'} in {info.get('env_seconds', 0):.1f} s"
        rows.append([escape_md(e), escape_md(versions), escape_md(child.get("torch") or "—"), made_text,
                     f"{info.get('run_seconds') or 0:.1f} s", escape_md(info.get("log") or "")])
    return ["## Version environments", "",
            ("Each column of the matrix ran in its own uv environment over this machine's torch (never reinstalled); "
             "the versions are what the requirement resolved to. Logs are written beside the report (logs/), with "
             "secrets scrubbed; they are not part of the committed reports."), "",
            tabulate(rows, headers=["requested", "resolved", "torch", "environment", "run", "log"], tablefmt="github"), ""]


def _what_to_do(doc: dict[str, Any]) -> list[str]:
    """The remedies, one line per cause and remedy, with the cells they apply to and the known faults."""
    from .analysis.diagnose import CAUSES, load_known_faults
    from .backends import backend_labels

    labels = backend_labels(doc.get("environment", {}))

    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for c in doc["cells"]:
        if _role(c) == "hazard":
            continue  # remedied once in the stack hazards section
        d = c.get("diagnosis") or {}
        if d.get("cause"):
            by[(d["cause"], d["remedy"])].append(c)
        for f in d.get("findings", []):
            by[(f["cause"], f["remedy"])].append(c)
    if not by:
        return []
    faults = {f.id: f for f in load_known_faults()}
    lines = ["## What to do", "",
             ("Each cause is the code its check returned with the numbers behind it (isolation, logits, loss, position "
              "probes, attention calls); it explains the verdict and never changes it. Hazards are remedied above."), ""]
    for (cause, fix), cells in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        groups = sorted({" / ".join(x for x in (c["model"]["label"], labels.get(c["backend"], c["backend"])) if x)
                         + (f" @ {env_label(c)}" if env_label(c) else "") for c in cells})
        shown = ", ".join(groups[:6]) + (f" and {len(groups) - 6} more" if len(groups) > 6 else "")
        known = sorted({k for c in cells for k in (c.get("diagnosis") or {}).get("known_faults", [])
                        if faults.get(k) and faults[k].cause == cause})
        known_text = f" Known: {', '.join(known)}." if known else ""
        count = (f"{len(cells)} {'check' if len(cells) == 1 else 'checks'} in {len(groups)} "
                 f"{'model / backend' if len(groups) == 1 else 'models / backends'}")
        lines.append(f"- **{escape_md(cause)}** ({escape_md(CAUSES.get(cause, ''))}; {count}: {escape_md(shown)}): "
                     f"{escape_md(fix)}.{known_text}")
    lines.append("")
    if doc.get("known_faults_not_seen"):
        lines += ["Known faults whose window includes cells that passed (the window may be wrong, or the fault fixed):", ""]
        for fid, cells in doc["known_faults_not_seen"].items():
            lines.append(f"- {escape_md(fid)}: {len(cells)} cells passed, e.g. {escape_md(', '.join(cells[:3]))}")
        lines.append("")
    used = sorted({k for c in doc["cells"] for k in (c.get("diagnosis") or {}).get("known_faults", [])})
    if used:
        lines += ["Known faults seen (audit/known_faults.toml):", ""]
        for fid in used:
            f = faults.get(fid)
            if f:
                fixed = f"fixed in {f.library} {f.fixed_in}" if f.fixed_in else "not fixed in any version measured"
                up = f" ({escape_md(f.upstream)})" if f.upstream else ""
                lines.append(f"- {escape_md(fid)}{up}: {escape_md(f.summary)}; {f.library} {escape_md(f.versions)}; {fixed}.")
        lines.append("")
    return lines


def _cut(text: str, n: int) -> str:
    """``text`` in at most ``n`` characters, cut at a word boundary (never mid-word) with "…"."""
    if len(text) <= n:
        return text
    head = text[: n - 1]
    space = head.rfind(" ")
    return (head[:space] if space > n // 2 else head).rstrip(" ,;:") + "…"


def render_terminal(doc: dict[str, Any], paths: list[str]) -> list[str]:
    """Lines for pytest's terminal summary (plain text, no Markdown): versions, totals, one line per model and
    backend with its headline verdict and cause, then the stack hazards once each."""
    cells = doc["cells"]
    lines = [
        (f"transformers {_v(doc['environment'], 'transformers')}, torch {_v(doc['environment'], 'torch')}, "
        f"trl {_v(doc['environment'], 'trl')}, device {doc['environment'].get('device')}"),
        counts_line(cells, symbols=False),
        "(pytest counts one item per check: hazards and findings are its xfailed items, never failures.)",
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        where = c["dtype"] + (f" @ {env_label(c)}" if env_label(c) else "")
        groups[(c["model"]["label"], c["backend"] or "(model level)", where)].append(c)
    marks = departures(cells)
    # passes once per backend (the models named), not-checked once per backend and reason (with the count, the
    # reason whole), every other verdict on its own line with its cause and remedy
    passed: dict[tuple[str, str], list[str]] = defaultdict(list)
    unchecked: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for (label, backend, where), group in sorted(groups.items()):
        if backend == "(model level)" and all(_role(c) != "correctness" for c in group):
            continue  # stack findings: summarised below
        h = headline(group)
        text = plain(_headline_text(group, marks.get((label, env_label(group[0]), group[0]["dtype"], group[0]["backend"]))))
        if h["status"] == "pass" and text == SYMBOLS["pass"]:
            passed[(backend, where)].append(label)
            continue
        if h["status"] == "skipped":
            why = " ".join(str((h["cells"] or group)[0]["message"]).split())
            unchecked[(backend, where, why)].append(label)
            continue
        reason = ""
        if h["status"] in ("error", "timeout", "oom", "unsupported") and h["cells"]:
            reason = ": " + _cut(plain((h["bad"] or h["cells"])[0]["message"]), 110)
        fix = ((h["bad"][0].get("diagnosis") or {}).get("remedy") if h["bad"] and h["status"] in ("fail", "fallback") else None)
        lines.append(f"  {h['status']:11s} {label} / {backend} / {where}: {text[2:].strip() or h['status']}{reason}"
                     + (f" — remedy: {_cut(plain(fix), 140)}" if fix else ""))
    for (backend, where), models in sorted(passed.items()):
        lines.append(f"  pass        {backend} / {where}: {len(models)} {'model' if len(models) == 1 else 'models'} "
                     f"({_cut(', '.join(models), 160)})")
    for (backend, where, why), models in sorted(unchecked.items()):
        lines.append(f"  not checked {backend} / {where}, {len(models)} {'model' if len(models) == 1 else 'models'}: {plain(why)}")
    for (hazard, env, dtype, backend), row in sorted(_hazard_rows(cells).items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        if row["shown"]:
            lines.append(f"  hazard      {_cause_label(hazard)} on {backend} / {dtype}{f' @ {env}' if env else ''}: "
                         f"{len(row['shown'])}/{len(row['measured'])} models")
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    measured: Counter = Counter()
    for c in cells:
        if _role(c) == "finding" and c["status"] in ("pass", "fail"):
            measured[c["check"]] += 1
            for name, it in ((c.get("metrics") or {}).get("items") or {"verdict": {"status": c["status"], "evidence": c["message"]}}).items():
                if it.get("status") == "fail":
                    found[(c["check"], f"{name}: {it['evidence']}")].append(c["model"]["label"])
    for (check, text), models in sorted(found.items()):
        lines.append(f"  finding     {check} {_cut(plain(text), 110)} ({len(models)}/{measured[check]} models)")
    lines += [f"matrix written: {p}" for p in paths]
    return lines
