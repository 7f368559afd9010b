"""Rendering: results document in, Markdown / terminal text out. Pure and deterministic."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from .results import STATUSES, SYMBOLS

# The number that backs each check's verdict in the detail tables.
KEY_METRIC = {
    "position_ids": ("max_change", "Δ"),
    "isolation": ("max_change", "Δ"),
    "logits_parity": ("max_abs_diff_solo", "Δ"),
    "loss_parity": ("loss_delta", "Δ"),
    "grad_parity": ("grad_rel_err", "rel"),
    "cache_trap": ("max_abs_diff_default", "Δ"),
    "mask_trap": ("max_abs_diff_with_mask", "Δ"),
    "trainer": ("max_loss_delta", "loss Δ"),
    "sft": ("loss_delta", "loss Δ"),
    "sft_padding_free": ("loss_delta", "loss Δ"),
}
LEGEND = {
    "pass": "pass: measured within tolerance",
    "fail": "fail: a measured number is out of tolerance (footnote gives it)",
    "fallback": "fallback: the requested attention backend is not what ran",
    "unsupported": "unsupported: the stack refuses this combination with an explicit error",
    "skipped": "skipped: this environment lacks something (reason given)",
    "error": "error: crashed (exception, or the signal that killed the isolated child, given)",
    "timeout": "timeout: no result within --packcheck-timeout (the hung child was killed)",
    "oom": "oom: out of memory (memory figures given)",
}


def escape_md(text: Any) -> str:
    """Escape model-provided text for a Markdown table cell: no pipes, HTML, links or line breaks."""
    s = " ".join(str(text).split())
    s = s.replace("\\", "\\\\")
    s = re.sub(r"([|<>\[\]`*_])", r"\\\1", s)
    return s


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
    m = cell.get("metrics", {})
    if cell["check"] == "backend" and "calls" in m:
        on = sum(m["calls"].values())
        text = f"{on}/{m.get('expected_calls', '?')} calls"
        if "dense_kernel_calls" in m and (m.get("varlen_kernel_calls") or m["dense_kernel_calls"]):
            # a flash-family backend: which kernel ran (results written before dense calls were counted: neither)
            text += f", varlen {m.get('varlen_kernel_calls', 0)} / dense {m['dense_kernel_calls']}"
        return text
    if cell["check"] == "sft_strategies" and isinstance(m.get("strategies"), dict):
        deltas = [(v.get("steps") or {}).get("max_loss_delta") for k, v in m["strategies"].items() if k != "wrapped" and v.get("available")]
        deltas = [d for d in deltas if isinstance(d, float)]
        return f"loss Δ {_fmt_metric(max(deltas))}" if deltas else ""
    if cell["check"] == "collate" and "position_ids_mismatches" in m:
        text = f"{m['position_ids_mismatches']} pos / {m.get('unmasked_boundaries', 0)} label errs"
        return text + (" (int labels raise)" if str(m.get("integer_labels", "")).startswith("TypeError") else "")
    if cell["check"] == "packing_content" and isinstance(m.get("strategies"), dict):
        ran = {k: v for k, v in m["strategies"].items() if v.get("available")}
        tails = sum(v["tail_starts"] for k, v in ran.items() if k in ("bfd", "ffd"))
        return f"{tails} bfd tails, {sum(v['duplicated'] for v in ran.values())} dup" if ran else ""
    key = KEY_METRIC.get(cell["check"])
    if key and key[0] in m:
        return f"{key[1]} {_fmt_metric(m[key[0]])}"
    return ""


def render_markdown(doc: dict[str, Any]) -> str:
    """The support matrix: rows = models, columns = backends (plus the model-level collate check), then per-model
    detail tables with the number behind every verdict, footnotes, legend, tolerances and environment."""
    from tabulate import tabulate

    from .backends import backend_labels

    cells = doc["cells"]
    env = doc["environment"]
    labels = backend_labels(env)  # the torch varlen column relabelled when a stand-in ran
    settings = doc.get("settings", {})
    models: dict[str, dict[str, Any]] = {}
    for c in cells:
        models.setdefault(c["model"]["label"], c["model"])
    backends = [b for b in settings.get("backends", []) if any(c["backend"] == b for c in cells)] or sorted(
        {c["backend"] for c in cells if c["backend"]}
    )
    dtypes = sorted({c["dtype"] for c in cells})
    checks = [c for c in settings.get("checks", []) if any(x["check"] == c for x in cells)]
    envs = sorted({env_label(c) for c in cells}, key=lambda e: (e is not None, _env_sort_key(e, cells)))
    versioned = envs != [None]
    by_group: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        by_group[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)

    # the per-model checks (no backend) share one column / row: named after them
    model_level = " + ".join(sorted({c["check"] for c in cells if c["backend"] is None}, key=lambda x: x != "collate")) or "collate"
    footnotes: list[str] = []
    bench = doc.get("bench")

    def note(text: str) -> str:
        footnotes.append(text)
        return f"[^{len(footnotes)}]"

    lines = [f"# packcheck support matrix{' — ' + escape_md(settings['audit']) if settings.get('audit') else ''}", ""]
    lines += [
        (f"{'Controller (each column below ran in its own version environment over its torch)' if versioned else 'Measured'} with packcheck {_v(env, 'packcheck')} on {escape_md(env.get('device_name'))} ({env.get('device')}): "
        f"torch {_v(env, 'torch')}, transformers {_v(env, 'transformers')}, trl {_v(env, 'trl')}, "
        f"flash-attn {_v(env, 'flash_attn')}, CUDA {env.get('cuda') or 'none (CPU build)'}, Python {_v(env, 'python')}. "
        f"Weights: {settings.get('weights')}; dtypes: {', '.join(dtypes)}."
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
    totals = defaultdict(int)
    for c in cells:
        totals[c["status"]] += 1
    lines.append("Cells: " + ", ".join(f"{SYMBOLS[s]} {s} {totals[s]}" for s in STATUSES if totals[s]) + f" (of {len(cells)}).")
    lines.append("")
    if versioned:
        lines += _environments_section(cells, envs)
    for dtype in dtypes:
        lines += [f"## Matrix ({dtype})", ""]
        if versioned:
            # one column per library-version environment, one row per model and backend
            headers = ["model", "backend"] + [_env_header(e, cells) for e in envs]
            rows = []
            for label in models:
                for b in [None, *backends]:
                    if not any(by_group.get((label, b, dtype, e)) for e in envs):
                        continue
                    row = [escape_md(label), labels.get(b, b) if b else model_level]
                    for e in envs:
                        group = by_group.get((label, b, dtype, e), [])
                        row.append(_summary_cell(group, note) if group else "")
                    rows.append(row)
            lines.append(tabulate(rows, headers=headers, tablefmt="github"))
            lines.append("")
            continue
        has_model_level = any(c["backend"] is None and c["dtype"] == dtype for c in cells)
        headers = ["model", "model_type / class"] + ([model_level] if has_model_level else []) + [labels.get(b, b) for b in backends]
        if bench:
            headers.append("speedup / memory")
        rows = []
        for label, info in models.items():
            rev = f" @{info['revision'][:10]}" if info.get("revision") else ""
            row = [escape_md(label) + escape_md(rev), f"{escape_md(info['model_type'])} / {escape_md(info['model_class'])}"]
            if has_model_level:
                coll = by_group.get((label, None, dtype, None), [])
                row.append(_summary_cell(coll, note) if coll else "")
            for b in backends:
                group = by_group.get((label, b, dtype, None), [])
                row.append(_summary_cell(group, note) if group else "")
            if bench:
                row.append(_bench_cell([r for r in bench["results"] if r["model"]["label"] == label], cells))
            rows.append(row)
        lines.append(tabulate(rows, headers=headers, tablefmt="github"))
        lines.append("")
    lines += _training_section(by_group, models, backends, dtypes, envs, cells, labels)
    if bench:
        lines += _bench_section(bench, cells)
    lines += _what_to_do(doc)
    lines += ["## Legend", ""]
    lines += [f"- {SYMBOLS[s]} {LEGEND[s]}" for s in STATUSES]
    lines += [
        "- Each cell summarises the checks of that model and backend; the detail tables below give every check's",
        "  verdict with the number it rests on. packcheck_flash_ref is packcheck's CPU varlen reference: transformers'",
        "  own flash-attention preparation code with an exact per-segment kernel. It is not FlashAttention-2.",
        "",
        "## Details",
        "",
    ]
    for dtype in dtypes:
        for label in models:
            for e in envs:
                headers = ["backend"] + checks
                rows = []
                for b in [None, *backends]:
                    group = {c["check"]: c for c in by_group.get((label, b, dtype, e), [])}
                    if not group:
                        continue
                    row = [labels.get(b, b) if b else "(model level)"]
                    for chk in checks:
                        c = group.get(chk)
                        row.append(f"{SYMBOLS[c['status']]} {_key_number(c)}".strip() if c else "")
                    rows.append(row)
                if rows:
                    where = f", {escape_md(_env_header(e, cells))}" if e else ""
                    lines += [f"### {escape_md(label)} ({dtype}{where})", "", tabulate(rows, headers=headers, tablefmt="github"), ""]
    tol = {c["dtype"]: c.get("tolerances", {}) for c in cells}
    if tol:
        keys = sorted({k for t in tol.values() for k in t})
        lines += ["## Tolerances", "", f"Source: {escape_md(settings.get('tolerance_source', ''))}", ""]
        lines.append(tabulate([[d] + [tol[d].get(k, "") for k in keys] for d in sorted(tol)], headers=["dtype", *keys], tablefmt="github"))
        lines.append("")
    lines += ["## Environment", "", tabulate([[k, escape_md(v)] for k, v in env.items()], headers=["", "value"], tablefmt="github"), ""]
    if footnotes:
        lines += ["## Notes", ""]
        lines += [f"[^{i}]: {t}" for i, t in enumerate(footnotes, 1)]
        lines.append("")
    return "\n".join(lines)


#: Checks that bear on what bench computes (a packed row, use_cache=False, no attention_mask): cache_trap and
#: mask_trap judge other ways of calling the model, the collate and training checks other code.
_BENCH_RELEVANT_CHECKS = ("position_ids", "isolation", "logits_parity", "loss_parity", "grad_parity", "backend")


def _packing_fails(cells: list[dict[str, Any]], r: dict[str, Any]) -> list[str]:
    """The checks that failed (or fell back) for the benched model, backend and dtype among
    :data:`_BENCH_RELEVANT_CHECKS`: a speedup there is the speed of a wrong result. Errors (inconclusive) are
    not counted."""
    return sorted({c["check"] for c in cells if c["model"]["label"] == r["model"]["label"]
                   and c["backend"] == r.get("attn_implementation") and c["dtype"] == r.get("dtype")
                   and c["check"] in _BENCH_RELEVANT_CHECKS and c["status"] in ("fail", "fallback")})


def _bench_cell(results: list[dict[str, Any]], cells: list[dict[str, Any]]) -> str:
    """The matrix's "speedup / memory" entry of one model: per profile, packed/padded useful tokens/s and the
    peak-memory reduction (n/a on CPU); marked when the audit found packing wrong on the benched backend."""
    parts = []
    for r in results:
        if "error" in r:
            parts.append(f"{r['profile']}: not measured")
            continue
        mem = f"−{r['memory_reduction'] * 100:.0f} % mem" if r.get("memory_reduction") is not None else "mem n/a"
        parts.append(f"{r['profile']} {r['speedup']:.2f}x / {mem}")
    wrong = _packing_fails(cells, results[0]) if results else []
    return "; ".join(parts) + (f" ⚠ packing wrong on {results[0]['attn_implementation']}" if wrong else "")


def _bench_section(bench: dict[str, Any], cells: list[dict[str, Any]]) -> list[str]:
    """What packing buys (``packcheck audit --bench``): one row per model and profile, with its backend."""
    from tabulate import tabulate

    from .bench import BENCH_HEADERS, BENCH_NOTE, bench_caveats, bench_row

    rows, failed, wrong = [], [], {}
    for r in bench["results"]:
        if "error" in r:
            failed.append(f"- {escape_md(r['model']['label'])} / {r['profile']}: {escape_md(r['error'])}")
            continue
        fails = _packing_fails(cells, r)
        if fails:
            wrong[(r["model"]["label"], r["attn_implementation"])] = fails
        rows.append([escape_md(r["model"]["label"]) + (" ⚠" if fails else ""), r["attn_implementation"], r["dtype"], *bench_row(r)])
    lines = ["## Packing payoff (packcheck bench)", "",
             (f"{bench['steps']} measured steps per mode on {bench['device']}, same examples padded and packed. "
              + ("CPU run: a smoke test of the machinery, not a speed claim. " if not str(bench["device"]).startswith("cuda") else "")
              + BENCH_NOTE), ""]
    if rows:
        lines += [tabulate(rows, headers=["model", "backend", "dtype", *BENCH_HEADERS], tablefmt="github"), ""]
        lines += [f"- ⚠ {escape_md(label)} on {backend}: the audit found packing wrong there ({', '.join(checks)}): "
                  "this speedup is the speed of a different computation." for (label, backend), checks in wrong.items()]
        lines += [*bench_caveats([r for r in bench["results"] if "error" not in r]), ""]
    if failed:
        lines += ["Not measured:", "", *failed, ""]
    return lines


#: Columns of the training-modes table: (header, check, how to read the cell's metrics).
TRAINING_MODES = (
    ("Trainer + flattening", "trainer", "trainer"),
    ("Trainer grad accum", "trainer", "grad_accum"),
    ("SFT packing (default)", "sft", "steps"),
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
        if "normalisation" in m:
            text += f" (padded/packed loss {m['padded_over_packed_loss']:.3f})"
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


def _cause_suffix(cell: dict[str, Any]) -> str:
    d = cell.get("diagnosis") or {}
    parts = []
    if d.get("cause"):
        parts.append(f"cause: {d['cause']}")
    parts += [f"also: {f['cause']}" for f in d.get("findings", [])]
    if d.get("known_faults"):
        parts.append("known: " + ", ".join(d["known_faults"]))
    return f" [{'; '.join(parts)}]" if parts else ""


def _what_to_do(doc: dict[str, Any]) -> list[str]:
    """The remedies, one line per cause and remedy, with the cells they apply to and the known faults."""
    from .diagnose import CAUSES, load_known_faults

    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for c in doc["cells"]:
        d = c.get("diagnosis") or {}
        if d.get("cause"):
            by[(d["cause"], d["remedy"])].append(c)
        for f in d.get("findings", []):
            by[(f["cause"], f["remedy"])].append(c)
    if not by:
        return []
    faults = {f.id: f for f in load_known_faults()}
    lines = ["## What to do", "",
             ("Each cause is read from what the cell's group measured (isolation, logits, loss, position, cache and mask "
              "probes, attention calls); it explains the verdict and never changes it."), ""]
    for (cause, fix), cells in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        groups = sorted({"-".join(x for x in (c["model"]["label"], c["backend"]) if x) + (f"@{env_label(c)}" if env_label(c) else "") for c in cells})
        shown = ", ".join(groups[:6]) + (f" and {len(groups) - 6} more" if len(groups) > 6 else "")
        known = sorted({k for c in cells for k in (c.get("diagnosis") or {}).get("known_faults", [])
                        if faults.get(k) and faults[k].cause == cause})
        known_text = f" Known: {', '.join(known)}." if known else ""
        count = (f"{len(cells)} {'cell' if len(cells) == 1 else 'cells'} in {len(groups)} "
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


def _summary_cell(group: list[dict[str, Any]], note: Any) -> str:
    """Worst verdict, the checks that did not pass, and one footnote holding their messages. A group whose
    checks all failed the same way (a model that did not build) gets one message, not one per check."""
    status = cell_status([c["status"] for c in group])
    bad = [c for c in sorted(group, key=lambda c: (_rank(c["status"]), c["check"])) if c["status"] != "pass"]
    if not bad:
        found = [c for c in group if (c.get("diagnosis") or {}).get("findings")]
        if found:
            text = "; ".join(f"{c['check']}: {f['cause']}: {f['evidence']}" for c in found for f in c["diagnosis"]["findings"])
            return f"{SYMBOLS[status]} (finding){note(escape_md(text))}"
        return SYMBOLS[status]
    ran_bad = [c for c in bad if c["status"] != "skipped"]
    ran = [c for c in group if c["status"] != "skipped"]
    if not ran and len({c["message"] for c in group}) == 1:  # the whole backend skipped for one reason
        return f"{SYMBOLS['skipped']} skipped{note(escape_md(group[0]['message']))}"
    if ran_bad and len(ran_bad) == len(ran) and len({c["message"] for c in ran_bad}) == 1:
        # every check that ran failed the same way (the model did not build): one message
        skipped = [c for c in bad if c["status"] == "skipped"]
        extra = " " + " ".join(f"({c['check']} skipped{note(escape_md(c['check'] + ': ' + c['message']))})" for c in skipped) if skipped else ""
        return f"{SYMBOLS[status]} {status}{note(escape_md(ran_bad[0]['message'] + _cause_suffix(ran_bad[0])))}{extra}"
    names = ", ".join(c["check"] + (" (skipped)" if c["status"] == "skipped" else "") for c in bad)
    text = "; ".join(f"{c['check']} {c['status']}: {c['message']}{_cause_suffix(c)}" for c in bad)
    return f"{SYMBOLS[status]} {names}{note(escape_md(text))}"


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def render_terminal(doc: dict[str, Any], paths: list[str]) -> list[str]:
    """Lines for pytest's terminal summary: totals, one line per model and backend that is not all-pass."""
    cells = doc["cells"]
    totals = defaultdict(int)
    for c in cells:
        totals[c["status"]] += 1
    lines = [
        (f"transformers {_v(doc['environment'], 'transformers')}, torch {_v(doc['environment'], 'torch')}, "
        f"trl {_v(doc['environment'], 'trl')}, device {doc['environment'].get('device')}"),
        "cells: " + ", ".join(f"{s} {totals[s]}" for s in STATUSES if totals[s]) + f" (total {len(cells)})",
    ]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        where = c["dtype"] + (f" @ {env_label(c)}" if env_label(c) else "")
        groups[(c["model"]["label"], c["backend"] or "(model level)", where)].append(c)
    for (label, backend, dtype), group in sorted(groups.items()):
        status = cell_status([c["status"] for c in group])
        bad = [f"{c['check']}={c['status']}" for c in group if c["status"] not in ("pass", "skipped")]
        if len({c["message"] for c in group}) == 1 and len(bad) == len(group):
            bad = [f"{status} ({_cut(group[0]['message'], 90)})"]
        if bad or status == "skipped":
            reason = ", ".join(bad) if bad else _cut(group[0]["message"], 80)
            lines.append(f"  {status:11s} {label} / {backend} / {dtype}: {reason}")
        else:
            lines.append(f"  {status:11s} {label} / {backend} / {dtype}")
    lines += [f"matrix written: {p}" for p in paths]
    return lines
