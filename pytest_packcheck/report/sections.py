"""The Markdown matrix's sections (the answer per model, stack hazards and findings, not checked, training
modes, version environments, what to do), each a list of lines from the :class:`model.Report`. Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..checks.causes import CAUSES
from ..checks.registry import REGISTRY, SPECS
from ..results import SYMBOLS
from .model import Report, env_header
from .numbers import key_number
from .text import cut, escape_md, fmt_metric
from .verdicts import (
    ROLE_MARKS,
    cause_label,
    check_mark,
    check_order,
    checks_that_passed,
    env_label,
    hazard_names,
    headline_text,
    not_run,
    numerics_only,
    pass_qualifier,
    role_of,
    unread_overrides,
)


def hazard_title(name: str) -> str:
    """A hazard's row title: its name in words and what it probes, from its registry row (``batch_rows``, the
    logits_parity probe of two packed rows, from its cause's meaning)."""
    spec = SPECS.get(name)
    what = spec.summary if spec is not None else CAUSES[name]
    return f"{cause_label(name)}: {cut(what, 120)}"


def hazards_section(rep: Report) -> list[str]:
    """One table per environment and dtype: a row per hazard that was measured there (every hazard check of the
    registry, :func:`verdicts.hazard_names`), a column per backend, "shown / measured" models
    (:func:`verdicts.hazard_rows`, the numbers the counts line sums); the remedy once per hazard that showed."""
    from ..analysis.diagnose import remedy
    from .text import github_table

    cells, backends, envs, rows = rep.cells, rep.layout.backends, rep.layout.envs, rep.hazards
    # the batch-rows probe the lengths gave no two rows for: said, never a row that silently is not there
    unmeasured = sorted({why for c in cells if c["check"] == "logits_parity"
                         and (why := (c.get("metrics") or {}).get("two_rows_not_measured"))})
    said = [f"- {cause_label('batch_rows')}: not measured: {escape_md(why)}." for why in unmeasured]
    if not rows:
        return ["## Stack hazards (usage outside the standard contract; never a model failure)", "", *said, ""] if said else []
    lines = ["## Stack hazards (usage outside the standard contract; never a model failure)", "",
             ("Each number is models showing the hazard / models measured, on that backend. Measured: models whose packed "
              "row is right without the hazard (a model already wrong without it is counted under its own verdict; "
              "refused or crashed models are left out). The ✅ cells above hold "
              "under the standard contract: use_cache=False (transformers' Trainer >= 5.0 and TRL set it), no "
              "attention_mask beside the packed row, one packed row per micro-batch or cu_seq_lens_q/k with it."), ""]
    for e in envs:
        for dtype in sorted({k[2] for k in rows if k[1] == e}):
            table = []
            for hazard in hazard_names():
                entries = [rows.get((hazard, e, dtype, b)) for b in backends]
                if not any(entries):
                    continue
                table.append([escape_md(hazard_title(hazard))] + [f"{len(r['shown'])}/{len(r['measured'])}" if r else "—" for r in entries])
            if table:
                where = f" ({env_header(e, cells)})" if e else ""
                lines += [f"{dtype}{escape_md(where)}:", "",
                          github_table(table, headers=["hazard", *[rep.label(b) for b in backends]]), ""]
    env_doc = rep.doc.get("environment", {})
    for hazard in hazard_names():
        # the remedy of each probe that showed it (its own cause and numbers: cu_seq_lens leaking on sdpa is
        # remedied by position_ids, never "do not pack"), once per cause and remedy
        fixes: dict[tuple[str, str], None] = {}
        for k, r in rows.items():
            if k[0] == hazard:
                for c in r["cells"]:
                    cause = hazard if hazard == "batch_rows" else ((c.get("diagnosis") or {}).get("cause") or c.get("cause") or hazard)
                    fixes[(cause, remedy(cause, c, env_doc))] = None
        for cause, fix in fixes:
            what = cause_label(hazard) + (f" ({cause_label(cause)})" if len(fixes) > 1 else "")
            lines.append(f"- {what}: {escape_md(fix)}.")
    return lines + said + [""]


def findings_section(rep: Report) -> list[str]:
    """The library stack's facts (checks whose role is ``finding``), once per environment: per contract item,
    the models it holds on and fails on, with the evidence; models that depart are named."""
    cells, envs = rep.cells, rep.layout.envs
    lines: list[str] = []
    for e in envs:
        for spec in [s for s in REGISTRY if s.role == "finding"]:
            group = [c for c in cells if c["check"] == spec.name and env_label(c) == e]
            if not group:
                continue
            where = f" ({env_header(e, cells)})" if e else ""
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
                else:  # no items: the check's own verdict, or why it measured none (an error: no item was checked)
                    name = "verdict" if c["status"] in ("pass", "fail", "fallback") else "not measured"
                    items[name][f"{c['status']}: {c['message']}"].append(c["model"]["label"])
            parts = []
            # models, not cells: a model measured in two dtypes is one model (trial 18, 228: "2/2 models" for gpt2 alone)
            n_ran = len(dict.fromkeys(c["model"]["label"] for c in ran))
            for name, outcomes in items.items():
                for text, cell_models in sorted(outcomes.items(), key=lambda kv: -len(set(kv[1]))):
                    models = list(dict.fromkeys(cell_models))
                    status, _, evidence = text.partition(": ")
                    who = f"{len(models)}/{n_ran} models" + ("" if len(models) * 2 > n_ran else f" ({', '.join(models[:6])})")
                    sym = ROLE_MARKS["finding"][0] if status == "fail" else SYMBOLS.get(status, "")
                    parts.append(f"  - {sym} {name}: {escape_md(cut(evidence, 220))} — {who}")
            title = {"collate": "transformers' DataCollatorWithFlattening", "collate_trl": "TRL's padding-free collator",
                     "packing_content": "TRL's pack_dataset"}.get(spec.name, spec.name)
            lines.append(f"- **{title}** (`{spec.name}`){escape_md(where)}:")
            lines += parts
    if not lines:
        return []
    return ["## Stack findings (facts of the library stack, not of a model)", "",
            "Each contract item is checked on its own; the count is the models it was measured on.", "", *lines, ""]


def not_checked_section(rep: Report) -> list[str]:
    """What could not be looked at, never a pass: "Not checked" (the environment lacks something, the reason given),
    then "Not run (interrupted)" (the checks an interrupted run never reached, :func:`verdicts.not_run`), one line
    per backend, reason and set of checks: the models of a line lack exactly the checks it names (a model that
    finished some of them is on a line of its own, never listed as lacking what it ran)."""
    cells, labels = rep.cells, rep.labels
    # the correctness checks each matrix cell (model, backend, dtype, environment) lacks, per reason
    lacking: dict[tuple, set[str]] = defaultdict(set)
    for c in cells:
        if c["status"] == "skipped" and role_of(c) == "correctness":
            backend = labels.get(c["backend"], c["backend"]) if c["backend"] else "(model level)"
            lacking[(not_run(c), backend, c["message"], c["model"]["label"], c["dtype"], env_label(c))].add(c["check"])
    # per section, backend, reason and the checks lacked: the models (a model once, over its dtypes / environments)
    by: dict[tuple, set[str]] = defaultdict(set)
    for (unrun, backend, why, model, _, _), checks in lacking.items():
        by[(unrun, backend, why, tuple(sorted(checks, key=check_order)))].add(model)
    lines: list[str] = []
    for unrun, title in ((False, "Not checked"), (True, "Not run (interrupted)")):
        entries = sorted((k[1:], models) for k, models in by.items() if k[0] == unrun)
        if entries:
            lines += [f"## {title}", ""]
        for (backend, why, checks), models in entries:
            lines.append(f"- {escape_md(backend)}, {len(models)} {'model' if len(models) == 1 else 'models'}"
                         f"{' (' + escape_md(', '.join(sorted(models))) + ')' if unrun else ''}: "
                         f"{escape_md(', '.join(checks))}: {escape_md(cut(' '.join(str(why).split()), 200))}")
        lines += [""] if entries else []
    return lines


def models_are(models: dict[str, Any], settings: dict[str, Any]) -> str:
    """What the models are, in one sentence: transformers' default configs shrunk with random weights (``arch:``
    specs), or the checkpoints named."""
    kinds = Counter(m.get("kind") or ("arch" if str(m.get("spec", "")).startswith("arch:") else "other") for m in models.values())
    weights = settings.get("weights") or "random"
    if kinds and set(kinds) == {"arch"}:
        return (f"The models are transformers' own default configs (`arch:<model_type>`, the config class's defaults, "
                f"overrides in braces), shrunk to a tiny size (a few layers, small hidden size), with {weights} weights: "
                "the verdicts are about the architecture's code path on this stack, not about a trained checkpoint.")
    named = sum(v for k, v in kinds.items() if k != "arch")
    if not kinds.get("arch"):  # "0 transformers default configs (shrunk, pretrained weights)" read as if some ran (trial 12, 153)
        return f"The models: {named} named checkpoint(s) or folder(s), {weights} weights."
    # an arch: spec has no checkpoint: its weights are random whatever was asked (the header says so per model)
    return (f"The models: {kinds['arch']} transformers default config(s) (shrunk, random weights) and {named} named "
            f"checkpoint(s) or folder(s) ({weights} weights).")


def trainer_note(cells: list[dict[str, Any]]) -> list[str]:
    """What the answer does not cover when no trainer check ran, and the one command that does."""
    if any(c["check"] in ("trainer", "sft") for c in cells):
        return []
    return [("**Not run here: transformers' Trainer and TRL's SFTTrainer themselves** (the `trainer` / `sft` checks: a "
             "few optimizer steps packed vs padded, gradient accumulation's num_items_in_batch, TRL's packer). The verdicts "
             "below are of the model fed the packed row as the Trainer feeds it (restarting position_ids, no "
             "attention_mask, use_cache=False). To measure the trainers on this stack: `packcheck audit --audit training` "
             "(TRL for the SFT checks: `pip install -c constraints/cpu.txt -e '.[trl]'`)."), ""]


def _at_a_glance(rep: Report, dtype: str) -> list[str]:
    """The "Do not pack" list (model, backends, cause with its number, remedy), then "Safe" in one line per group
    of backends (the models safe on exactly those), then the backends that ran nothing here, named once."""
    bad, numerics, safe_by = [], [], defaultdict(list)
    for label in rep.layout.models:
        failing: dict[str, list[str]] = defaultdict(list)
        first: dict[str, dict[str, Any]] = {}
        safe = []
        for b in rep.layout.backends:
            h = rep.headlines.get((label, b, dtype, None))
            if not h or b in rep.not_run:
                continue
            if numerics_only(h):  # only the tolerance fails it: not a "do not pack"
                c = h["bad"][0]
                numerics.append(f"- **{escape_md(label)}** on {rep.label(b)} ({c['check']} {key_number(c)}): "
                                f"{escape_md((c.get('diagnosis') or {}).get('remedy') or CAUSES['kernel_numerics'])}.")
            elif h["status"] in ("fail", "fallback"):
                key = ", ".join(cause_label(c) for c in h["causes"])
                failing[key].append(rep.label(b))
                first.setdefault(key, h["bad"][0])
            elif h["status"] == "pass":
                qualifier = pass_qualifier(h)
                safe.append(rep.label(b) + (f" ({qualifier})" if qualifier else ""))
        for cause, where in failing.items():
            c = first[cause]
            fix = (c.get("diagnosis") or {}).get("remedy") or ""
            bad.append(f"- **{escape_md(label)}** on {', '.join(where)}: {cause} ({c['check']} {key_number(c)})"
                       + (f"; remedy: {escape_md(fix)}" if fix else "") + ".")
        if safe:
            safe_by[tuple(safe)].append(label)
    lines = ["### Do not pack", ""] + (bad or ["- none: no model failed a correctness check here for a packing cause."]) + [""]
    if numerics:
        lines += ["### Within numerics, failed on the tolerance only (boundaries kept: not a packing fault)", "", *numerics, ""]
    lines += [("### Safe (every correctness check that ran passed; the ones that could not run, and mechanisms the probe "
               "row never exercised, are named)"), ""]
    lines += [f"- on {', '.join(where)}: {', '.join(escape_md(m) for m in ms)}"
              for where, ms in sorted(safe_by.items(), key=lambda kv: (-len(kv[0]), kv[0]))] or ["- none"]
    lines.append("")
    if rep.not_run:
        lines += [f"Not run on this machine (every model): {', '.join(rep.label(b) for b in rep.not_run)}; see \"Not checked\".", ""]
    return lines


def _checks_only(rep: Report, label: str, dtype: str) -> str:
    """" (checked: isolation only; see the note on the ✅ cells above)" for a model's "safe on" words when the run
    left correctness checks out (:func:`~pytest_packcheck.report.verdicts.coverage` is not empty): the line a user
    copies carries the qualification the header gives once (trial 13, 158)."""
    ran = checks_that_passed(rep.cells, label, dtype)
    return f" (checked: {escape_md(', '.join(ran))} only; see the note on the ✅ cells above)" if ran else ""


def answer_section(rep: Report) -> list[str]:
    """The answer: what the models are, what was not run (the trainers), per dtype the "Do not pack" list and
    the "Safe" groups, then one line per model: safe backends, do-not-pack backends with the cause and its
    number, and what was not checked (backends that ran nothing for any model, :attr:`Report.not_run`, are named
    once above)."""
    models, backends = rep.layout.models, rep.layout.backends
    lines = ["## The answer", "", models_are(models, rep.settings), "", *trainer_note(rep.cells),
             ("Per model: where padding-free packing trains it the same as padding (fed as transformers' Trainer and "
              "TRL feed it: restarting position_ids, no attention_mask, use_cache=False), where it does not and why, "
              "and where packcheck could not look. Numbers: Δ is the largest absolute difference of logits (or loss, "
              "in nats) against the reference, rel a relative error; tolerances at the end. \"varlen reference (CPU, "
              "not FA2)\" is packcheck_flash_ref: transformers' flash-attention preparation code with an exact "
              "per-segment kernel on CPU, a stand-in for the flash path, not FlashAttention-2 itself."), ""]
    covered = rep.coverage  # once for every ✅ below, never per cell
    if covered:
        lines += [f"**{escape_md(covered)}**", ""]
    for dtype in rep.layout.dtypes:
        if len(rep.layout.dtypes) > 1:
            lines += [f"{dtype}:", ""]
        lines += _at_a_glance(rep, dtype)
        lines += ["### Every model", ""]
        for label in models:
            safe, partial, bad, refused, unchecked, unrun, numerics = [], [], defaultdict(list), [], [], [], []
            inconclusive: list[str] = []
            hazards_only: list[str] = []
            for b in backends:
                h = rep.headlines.get((label, b, dtype, None))
                if not h or b in rep.not_run:
                    continue
                name = rep.label(b)
                if h["status"] == "pass":
                    if pass_qualifier(h):
                        partial.append(f"{name} ({pass_qualifier(h)}, see below)")
                    else:
                        safe.append(name)
                elif h.get("no_correctness"):
                    hazards_only.append(name)
                elif h["status"] == "skipped" and h.get("not_run"):
                    unrun.append(name)  # an interrupted run never finished it (run.session._name_unrun_checks)
                elif h["status"] == "skipped":
                    unchecked.append(name)
                elif numerics_only(h):
                    first = h["bad"][0]
                    numerics.append((name, f"{first['check']} {key_number(first)}".strip(),
                                     (first.get("diagnosis") or {}).get("remedy") or CAUSES["kernel_numerics"]))
                elif h["status"] in ("fail", "fallback"):
                    first = h["bad"][0]
                    number = key_number(first)
                    key = ", ".join(cause_label(c) for c in h["causes"])
                    bad[key].append((name, f"{first['check']} {number}".strip()))
                elif h["status"] == "error" and h["causes"] and all(c == "probe_inconclusive" for c in h["causes"]):
                    first = h["bad"][0]  # nothing refused or crashed: the probe could not judge
                    inconclusive.append(f"{name} ({escape_md(cut(' '.join(first['message'].split()), 110))})")
                else:
                    first = (h["bad"] or h["cells"])[0]
                    refused.append(f"{name} ({' '.join(headline_text(h).split(' ')[1:])}: "
                                   f"{escape_md(cut(' '.join(first['message'].split()), 90))})")
            parts = []
            if bad:
                for cause, where in bad.items():
                    desc = CAUSES.get(cause.replace(" ", "_"), "")
                    parts.append(f"**do not pack** on {', '.join(w for w, _ in where)} with this stack ({cause}"
                                 + (f": {desc}" if desc else "") + f"; {where[0][1]})")
            for name, number, fix in numerics:
                parts.append(f"fails on the tolerance only on {name} ({number}: {escape_md(fix)})")
            only = _checks_only(rep, label, dtype) if covered and (safe or partial) else ""
            if safe:
                parts.append(f"safe on {', '.join(safe)}{only}")
            if partial:
                parts.append(f"safe on {'; '.join(partial)}{only}")
            if refused:
                parts.append(f"refused / crashed on {', '.join(refused)}")
            if inconclusive:
                parts.append(f"inconclusive on {', '.join(inconclusive)}")
            if unchecked:
                parts.append(f"not checked on {', '.join(unchecked)}")
            if hazards_only:
                parts.append(f"not judged on {', '.join(hazards_only)} (no correctness check ran; the hazards probed "
                             "are under \"Stack hazards\")")
            if unrun:
                parts.append(f"not run on {', '.join(unrun)} (the run was interrupted: --packcheck-resume runs it)")
            if not parts:  # no verdict of this model in this dtype (trial 18, 53: a merge of a float32 and a
                # bfloat16 run read "**gpt2**: ." in the bfloat16 list)
                held = any(rep.headlines.get((label, b, dtype, None)) for b in backends)
                parts.append("not run on this machine (see above)" if held else f"not measured in {dtype} (no cell of it "
                             "in the results)")
            unread = unread_overrides(rep.cells, label)
            if unread:  # the user's own override that the config has no key for (model.configs.apply_overrides)
                parts.append(f"note: {escape_md('; '.join(unread))}")
            flagged = sorted({m for b in backends for m in rep.marks.get((label, None, dtype, b), [])})
            if flagged:
                parts.append(f"⚑ departs from its stack: {', '.join(flagged)}")
            lines.append(f"- **{escape_md(label)}**: " + "; ".join(parts) + ".")
        lines.append("")
    return lines


def weights_line(settings: dict[str, Any], cells: list[dict[str, Any]]) -> str:
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


def training_entry(cell: dict[str, Any], read: str) -> str:
    """One training-mode cell: verdict symbol (by the check's role, :func:`check_mark`: a padded run that is off is
    🔶, a hazard, never ❌) and the number behind it (max per-step loss delta vs padded)."""
    m = cell.get("metrics", {})
    sym = check_mark(cell)[0]
    if cell["status"] in ("skipped", "unsupported", "error", "timeout", "oom"):
        return sym
    if read == "trainer":
        a, b = m.get("as_configured") or {}, m.get("use_cache_false") or {}
        text = f"{sym} {fmt_metric(a.get('max_loss_delta'))}"
        padded = m.get("padded_trainer") or {}
        if padded.get("normalisation"):
            text += f" (Trainer's padded run: loss x{padded['loss_ratio']:.3f})"
        elif cell["status"] != "pass" and isinstance(b.get("max_loss_delta"), float) and b["max_loss_delta"] < a.get("max_loss_delta", 0):
            text += f"; use_cache=False {fmt_metric(b['max_loss_delta'])}"
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
        text = f"{sym} {fmt_metric(m.get('max_loss_delta'))}"
        return text + (f" (loss x{m['loss_ratio']:.3f})" if m.get("normalisation") else "")
    if read == "steps":
        delta = (m.get("steps") or {}).get("max_loss_delta", m.get("loss_delta"))
        return f"{sym} {fmt_metric(delta)}" if delta is not None else f"{sym} (batch contract, see the notes)"
    entry = (m.get("strategies") or {}).get(read)
    if not entry:
        return ""
    if not entry.get("available"):
        return "n/a"
    delta = fmt_metric((entry.get("steps") or {}).get("max_loss_delta"))
    if read == "wrapped":
        return f"ℹ️ {delta} (by design)"
    bad = any(p.startswith(f"{read}:") for p in cell["message"].split("; ")) and cell["status"] == "fail"
    return f"{'❌' if bad else '✅'} {delta}"


def training_section(rep: Report) -> list[str]:
    """The training-modes table (when the audit ran trainer / sft checks): one column per way of training
    packed, each with its verdict and the max per-step loss delta against the padded run."""
    from .text import github_table

    lay, cells = rep.layout, rep.cells
    by_group, models, backends, dtypes, envs = lay.by_group, lay.models, lay.backends, lay.dtypes, lay.envs

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
                    entries = [training_entry(group[chk], read) if chk in group else "" for _, chk, read in modes]
                    if any(entries):
                        rows.append([escape_md(label), rep.label(b)] + ([dtype] if len(dtypes) > 1 else [])
                                    + ([escape_md(env_header(e, cells))] if e else []) + entries)
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
            github_table(rows, headers=headers), ""]


def environments_section(rep: Report) -> list[str]:
    """One row per version environment: what was asked, what was resolved, and how long it took to make."""
    from .text import github_table

    cells, envs = rep.cells, rep.layout.envs

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
            github_table(rows, headers=["requested", "resolved", "torch", "environment", "run", "log"]), ""]


def what_to_do(rep: Report) -> list[str]:
    """The remedies, one line per cause and remedy, with the checks (by name) and cells they apply to and the known
    faults."""
    from ..analysis.diagnose import load_known_faults
    from ..checks.causes import CAUSES

    doc, labels = rep.doc, rep.labels

    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for c in doc["cells"]:
        if role_of(c) == "hazard":
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
        # the checks by name: one cell's two checks with one cause but two remedies (two numbers) are two lines,
        # each saying which check it is about (trial 6, 33: "1 check in 1 model" twice, numbers unattributed)
        checks = escape_md(", ".join(dict.fromkeys(c["check"] for c in sorted(cells, key=lambda c: c["check"]))))
        count = (f"{len(cells)} {'check' if len(cells) == 1 else 'checks'} ({checks}) in {len(groups)} "
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

