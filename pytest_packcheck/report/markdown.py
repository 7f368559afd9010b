"""The Markdown support matrix (``packcheck-matrix.md``): the header with the versions and the command that
reproduces the run, the counts, the answer per model, the stack's hazards and findings (once each), the matrix
(rows = models, columns = backends or version environments), remedies, legend, tolerances, environment. Pure:
a :class:`model.Report` in, text out."""

from __future__ import annotations

from collections import Counter

from ..checks.registry import REGISTRY, ROLES
from ..results.environment import environment_recorded
from .model import (
    NOT_RECORDED,
    Report,
    banners,
    env_header,
    env_value,
    environment_line,
    environment_role,
)
from .sections import (
    answer_section,
    environments_section,
    findings_section,
    hazards_section,
    not_checked_section,
    training_section,
    weights_line,
    what_to_do,
)
from .text import escape_md
from .verdicts import LEGEND, ROLE_LEGEND, ROLE_MARKS, VERDICT_SYMBOLS, VERDICTS, check_mark, counts_line, headline_text

#: A matrix cell no results file holds (a merge of runs over different models or backends: trial 15, 73, the cell
#: was blank, with nothing saying it was never measured).
NOT_MEASURED = "— not measured"


def render(rep: Report) -> str:
    """The support matrix: the answer (per model), the stack's hazards and findings (once each), the matrix
    (rows = models, columns = backends; headline from the correctness checks), remedies, legend, then where the
    per-model details are."""
    from .text import github_table

    doc, cells, settings, lay = rep.doc, rep.cells, rep.settings, rep.layout
    env = doc["environment"]
    labels = rep.labels  # the torch varlen column relabelled when a stand-in ran
    models, backends, dtypes, checks, envs = lay.models, lay.backends, lay.dtypes, lay.checks, lay.envs
    versioned = lay.versioned
    marks = rep.marks
    bench = doc.get("bench")

    lines = [f"# packcheck support matrix{' — ' + escape_md(settings['audit']) if settings.get('audit') else ''}", ""]
    lines += [
        (((f"{environment_role(versioned)} with packcheck {env_value(env, 'packcheck')} on {escape_md(env.get('device_name'))} ({env.get('device')}): "
           f"{environment_line(env)}, CUDA {env.get('cuda') or 'none (CPU build)'}, Python {env_value(env, 'python')}. ")
          if environment_recorded(env) else f"{escape_md(NOT_RECORDED[0].upper() + NOT_RECORDED[1:])}. ")
        + f"Weights: {weights_line(settings, cells)}; dtypes: {', '.join(dtypes)}."
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
    for _, text in banners(doc):
        lines += [f"**⚠️ {escape_md(text)}.**", ""]
    totals = Counter(check_mark(c)[2] for c in cells)
    lines.append(counts_line(cells, covered=rep.coverage))
    lines.append("")
    gate = rep.gate
    if gate is not None:  # audit --gate: the result beside the matrix it was read from
        n = gate.get("regressions", 0)
        lines += [f"**Gate: {'❌' if n else '✅'} {n} regression(s), {gate.get('changed', 0)} changed cell(s)**, "
                  f"{escape_md(str(gate.get('candidate')))} (candidate) against {escape_md(str(gate.get('baseline')))} (baseline)"
                  + (f": {escape_md(', '.join(map(str, gate.get('cells') or [])))}" if gate.get("cells") else "") + ".", ""]
    if not versioned:
        lines += answer_section(rep)
    lines += hazards_section(rep)
    lines += findings_section(rep)
    if versioned:
        lines += environments_section(rep)
    for dtype in dtypes:
        lines += [f"## Matrix ({dtype})", ""]
        if versioned:
            # one column per library-version environment, one row per model and backend
            headers = ["model", "backend"] + [env_header(e, cells) for e in envs]
            rows = []
            for label in models:
                for b in backends:
                    if not any(rep.headlines.get((label, b, dtype, e)) for e in envs):
                        continue
                    row = [escape_md(label), labels.get(b, b)]
                    for e in envs:
                        h = rep.headlines.get((label, b, dtype, e))
                        row.append(headline_text(h, marks.get((label, e, dtype, b))) if h else NOT_MEASURED)
                    rows.append(row)
            lines.append(github_table(rows, headers=headers))
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
                h = rep.headlines.get((label, b, dtype, None))
                row.append(headline_text(h, marks.get((label, None, dtype, b))) if h else NOT_MEASURED)
            if bench:
                from .bench import bench_cell

                row.append(bench_cell([r for r in bench["results"] if r["model"]["label"] == label], cells))
            rows.append(row)
        lines.append(github_table(rows, headers=headers))
        lines.append("")
    lines += not_checked_section(rep)
    lines += training_section(rep)
    if bench:
        from .bench import bench_section

        lines += bench_section(bench, cells)
    lines += what_to_do(rep)
    lines += ["## Legend", ""]
    lines += [f"- {VERDICT_SYMBOLS[s]} {LEGEND[s]}" for s in VERDICTS if totals[s]]
    lines += [f"- {sym} {label}: {ROLE_LEGEND[role]}" for role, (sym, label) in ROLE_MARKS.items() if totals[role]]
    lines += [
        "- A matrix cell's verdict comes from its correctness checks only; the cause after ❌ is what they measured.",
        "  \"(not checked: …)\" names correctness checks that could not run there: the ✅ covers the others only;",
        "  \"(…: not exercised)\" a mechanism (sliding window, top-k selection, ...) the probe row is too short for.",
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
        lines.append(github_table([[d] + [tol[d].get(k, "") for k in keys] for d in sorted(tol)], headers=["dtype", *keys]))
        lines.append("")
    from ..versions.libraries import header_libraries

    # a library the run did not have is "not installed", as the header says it, never "None" (trial 19 readme run)
    libs = {lib.key for lib in header_libraries()}
    shown = {k: ("not installed" if k in libs else "none") if v is None else v for k, v in env.items()}
    lines += ["## Environment", "", github_table([[k, escape_md(v)] for k, v in shown.items()], headers=["", "value"]), ""]
    return "\n".join(lines)

