"""How a ``packcheck bench`` result reads (:mod:`pytest_packcheck.run.throughput` measures it): the table row and
its caveats, the terminal line, ``packcheck bench``'s Markdown, and the audit's "speedup / memory" entry and payoff
section (``packcheck audit --bench``), marked where the audit found packing wrong on the benched backend. Pure:
results in, text out."""

from __future__ import annotations

from typing import Any

#: Headers of :func:`bench_row` rows.
BENCH_HEADERS = ["profile", "median length", "padding", "padded tok/s", "packed tok/s", "speedup", "ideal", "of ideal",
                 "peak memory saved", "loss Δ step 1", "instrumentation", "targets"]
BENCH_NOTE = ("Useful tokens are label tokens that are not padding. Tokens/s and the speedup are totals over the "
              "measured steps (as the ideal speedup is); step times are medians with their spread (min-max), the "
              "per-step speedup spread is in the JSON (speedup_per_step), peak memory per mode. The instrumentation "
              "overhead compares packed steps with and without attention-call counting, interleaved step by step on "
              "the same batches. Loss Δ step 1: packed vs padded loss on the first batch from the initial "
              "weights, a check that both modes hold the same examples and labels; it is no leak test (random "
              "weights barely attend: OPT's leak moves it by 9e-6), the audit's checks judge correctness.")


#: What a bench figure off CUDA is worth: said by the bench's Markdown, the audit's payoff section and the terminal.
SMOKE_TEST = "CPU run: a smoke test of the machinery, not a speed claim."


def smoke_test_note(device: Any) -> str:
    """:data:`SMOKE_TEST` for a bench on anything but CUDA (its figures are no speed claim), else ""."""
    return "" if str(device or "").startswith("cuda") else SMOKE_TEST


def _memory_text(r: dict[str, Any]) -> str:
    """The peak-memory reduction as the table writes it ("35.0 %"; "n/a (CPU)": not measured off CUDA)."""
    return f"{r['memory_reduction'] * 100:.1f} %" if r.get("memory_reduction") is not None else "n/a (CPU)"


def _instrumentation_text(r: dict[str, Any]) -> str:
    """The instrumentation overhead as the table writes it ("+1696.4 %" for a fraction 16.964; "—": not measured); a
    negative one (the counted run was the faster: timing noise, -76.7 % on a loaded CPU; trial 12, 119) as noise."""
    if "instrumentation_overhead" not in r:
        return "—"
    value = r["instrumentation_overhead"] * 100
    return f"{value:+.1f} %" if value >= 0 else f"none measurable ({value:+.1f} %, timing noise)"


def bench_row(r: dict[str, Any]) -> list[Any]:
    """One result as a row under :data:`BENCH_HEADERS`."""
    pad, pack = r["runs"]["padded"], r["runs"]["packed"]
    mem, inst = _memory_text(r), _instrumentation_text(r)
    return [r["profile"], r["lengths"]["median"], f"{r['padding_overhead'] * 100:.0f} %", f"{pad['useful_tokens_per_s']:.0f}",
            f"{pack['useful_tokens_per_s']:.0f}", f"{r['speedup']:.2f}x", f"{r['ideal_speedup']:.2f}x",
            f"{r['fraction_of_ideal'] * 100:.0f} %", mem, f"{r['loss_first_step_delta']:.1e}", inst,
            _targets_summary(r.get("targets") or [])]


def bench_caveats(results: list[dict[str, Any]]) -> list[str]:
    """Lines that qualify the figures: lengths clipped to max_length, a speedup above the ideal one."""
    out = []
    for r in results:
        if "error" in r:
            continue
        clipped = r["lengths"].get("clipped_to_max_length")
        if clipped:
            out.append(f"- {r['profile']}: {clipped} of {(r['steps'] + r['warmup']) * r['batch_size']} lengths were "
                       f"clipped to max_length {r['max_length']}.")
        if r["fraction_of_ideal"] > 1.05:
            out.append(f"- {r['profile']}: the measured speedup is {r['fraction_of_ideal'] * 100:.0f} % of the ideal one. "
                       "The ideal assumes cost proportional to tokens; above it, packed steps were cheaper per token "
                       "than padded ones for another reason (timing noise, above all on CPU, or a padded-only cost "
                       "such as a mask over the padding). See the per-step spread in the JSON (speedup_per_step).")
    return out


def bench_terminal_lines(r: dict[str, Any], device: Any, where: str = "") -> list[str]:
    """What ``packcheck bench`` (and ``audit --bench``, ``where`` = "bench llama / sdpa / ") prints for one measured
    profile: its figures as the Markdown's table writes them (:func:`bench_row`'s formatters: "of ideal", memory and
    instrumentation in %), the smoke-test caveat off CUDA (:func:`smoke_test_note`), then the profile's caveats of
    the Markdown (:func:`bench_caveats`), one a line."""
    note = smoke_test_note(device)
    line = (f"{where}{r['profile']}: speedup {r['speedup']:.2f}x (ideal {r['ideal_speedup']:.2f}x, {r['fraction_of_ideal'] * 100:.0f} % "
            f"of ideal), padding {r['padding_overhead'] * 100:.0f} %, peak memory saved {_memory_text(r)}, instrumentation "
            f"overhead {_instrumentation_text(r)}" + (f"; {note}" if note else ""))
    return [line, *(f"  {c[2:]}" for c in bench_caveats([r]))]


def _targets_summary(targets: list[dict[str, Any]]) -> str:
    """"3/4 met (missed: min_speedup)", "not judged" (CPU) or "—" (no target for this profile)."""
    if not targets:
        return "—"
    judged = [t for t in targets if t["met"] is not None]
    if not judged:
        return "not judged"
    missed = [t["target"] for t in judged if not t["met"]]
    return f"{len(judged) - len(missed)}/{len(judged)} met" + (f" (missed: {', '.join(missed)})" if missed else "")


def render_bench(results: list[dict[str, Any]], env: dict[str, Any], model_label: str) -> str:
    """Markdown: one row per profile, then the per-mode details."""
    from ..backends import backend_labels
    from .text import escape_md, github_table

    attn = results[0].get("attn_implementation", "") if results else ""
    lines = [f"# packcheck bench — {escape_md(model_label)}", "",
             (f"torch {env.get('torch')}, transformers {env.get('transformers')}, device {env.get('device')} "
              f"({escape_md(env.get('device_name'))}), attention {escape_md(attn)} ({escape_md(backend_labels(env).get(attn, attn))}), "
              f"dtype {results[0].get('dtype', '') if results else ''}."), ""]
    if smoke_test_note(env.get("device")):
        lines += [SMOKE_TEST, ""]
    measured = [r for r in results if "error" not in r]
    if measured:
        lines.append(github_table([bench_row(r) for r in measured], headers=BENCH_HEADERS))
        lines += ["", BENCH_NOTE, ""]
        caveats = bench_caveats(measured)
        if caveats:
            lines += [*caveats, ""]
    for r in results:
        if "error" in r:
            lines += [f"- {escape_md(r['profile'])}: not measured: {escape_md(r['error'])}", ""]
    judged = [(r["profile"], t) for r in measured for t in r.get("targets", [])]
    if judged:
        def shown(t: dict[str, Any]) -> str:
            v = t["measured"]
            if not isinstance(v, (int, float)):
                return "not measured"
            return f"{v:.2f}x" if t["target"] == "min_speedup" else f"{v * 100:.1f} %"

        def required(t: dict[str, Any]) -> str:
            op = ">=" if t["target"].startswith("min") else "<="
            return f"{op} {t['required']:.2f}x" if t["target"] == "min_speedup" else f"{op} {t['required'] * 100:.0f} %"

        verdict = {True: "met", False: "MISSED", None: "not judged (CPU)" if not str(env.get("device", "")).startswith("cuda") else "not measured"}
        lines += ["Targets (audit/bench_targets.toml):", "",
                  github_table([[p, t["label"], required(t), shown(t), verdict[t["met"]]] for p, t in judged],
                           headers=["profile", "target", "required", "measured", "verdict"]), ""]
    detail = []
    for r in measured:
        for mode, run in r["runs"].items():
            detail.append([r["profile"], mode, f"{run['step_s'] * 1000:.1f}", f"{run['step_s_spread'][0] * 1000:.1f}-{run['step_s_spread'][1] * 1000:.1f}",
                           run["tokens_per_step"], run["useful_tokens_per_step"], run["peak_memory_mib"] if run["peak_memory_mib"] is not None else "n/a"])
    lines.append(github_table(detail, headers=["profile", "mode", "step ms", "min-max ms", "tokens/step", "useful/step", "peak MiB"]))
    lines.append("")
    return "\n".join(lines)


def _packing_fails(cells: list[dict[str, Any]], r: dict[str, Any]) -> list[str]:
    """The checks that failed (or fell back) for the benched model, backend and dtype among the registry's
    checks that bear on bench (a packed row, use_cache=False, no attention_mask): a speedup there is the speed
    of a wrong result. Errors (inconclusive) are not counted."""
    from ..checks.registry import BENCH_RELEVANT_CHECKS

    return sorted({c["check"] for c in cells if c["model"]["label"] == r["model"]["label"]
                   and c["backend"] == r.get("attn_implementation") and c["dtype"] == r.get("dtype")
                   and c["check"] in BENCH_RELEVANT_CHECKS and c["status"] in ("fail", "fallback")})


def bench_cell(results: list[dict[str, Any]], cells: list[dict[str, Any]]) -> str:
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


def bench_section(bench: dict[str, Any], cells: list[dict[str, Any]]) -> list[str]:
    """What packing buys (``packcheck audit --bench``): one row per model and profile, with its backend."""
    from .text import escape_md, github_table

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
              + (f"{SMOKE_TEST} " if smoke_test_note(bench["device"]) else "")
              + BENCH_NOTE), ""]
    if rows:
        lines += [github_table(rows, headers=["model", "backend", "dtype", *BENCH_HEADERS]), ""]
        lines += [f"- ⚠ {escape_md(label)} on {backend}: the audit found packing wrong there ({', '.join(checks)}): "
                  "this speedup is the speed of a different computation." for (label, backend), checks in wrong.items()]
        lines += [*bench_caveats([r for r in bench["results"] if "error" not in r]), ""]
    if failed:
        lines += ["Not measured:", "", *failed, ""]
    return lines
