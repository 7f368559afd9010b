"""``packcheck gate``: compare a candidate results JSON with a baseline cell by cell; exit 1 if a cell got worse.

Also the gate of ``packcheck audit --versions A,B --gate`` (:func:`gate_environments` before the audit,
:func:`gate_versions` after it) and ``--bisect`` of each regression.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUMMARY_HELP = ("For the gate: append GitHub job-summary Markdown to FILE (e.g. \"$GITHUB_STEP_SUMMARY\"): a row per "
                "changed cell with model, backend, versions, verdict before / after, number, cause, known fault, remedy.")


def configure(gate: argparse.ArgumentParser) -> None:
    gate.add_argument("--baseline", required=True, help="Baseline results JSON (e.g. reports/baseline.json).")
    gate.add_argument("--candidate", help="Candidate results JSON (e.g. from the upgraded stack; default: the "
                                          "--baseline file, for --baseline-env / --candidate-env on one file).")
    gate.add_argument("--baseline-env", metavar="LABEL", help="Compare only the cells of this version environment of "
                      "the baseline file (its label, e.g. transformers==5.24.0, or a unique part of it such as 5.24.0).")
    gate.add_argument("--candidate-env", metavar="LABEL", help="The same for the candidate file.")
    gate.add_argument("--allow", action="append", default=[], metavar="CELL=REASON",
                      help="Accept a regression of a cell id or id prefix (e.g. 'opt-sdpa=known OPT leak'); repeatable.")
    gate.add_argument("--bisect", action="store_true",
                      help="Bisect each regression it prints: the transformers or trl release between the two stacks "
                           "that broke the cell (one version environment per probe; needs the package index).")
    gate.add_argument("--bisect-output-dir", default="reports/bisect", help="Where --bisect writes its JSON (default reports/bisect).")
    gate.add_argument("--summary", metavar="FILE", default=None, help=SUMMARY_HELP)


def run(ns: argparse.Namespace) -> int:
    """``packcheck gate``: exit 0 with no regression, 1 with one (after the table is printed).

    Raises:
        PackcheckUsageError: a bad --allow, neither --candidate nor both --baseline-env / --candidate-env, a
            results file that cannot be read, an environment label that names no environment, no baseline cell in
            the candidate's selection (nothing would be compared).
    """
    from ..analysis.gate import probe_summary, refuse_empty_baseline, select_env
    from ..errors import PackcheckUsageError
    from ..results import load_document

    allow = parse_allow(ns.allow)
    if ns.candidate is None and not (ns.baseline_env and ns.candidate_env):
        raise PackcheckUsageError("packcheck gate needs --candidate FILE, or --baseline-env and --candidate-env to "
                                  "compare two version environments of the --baseline file.")
    if ns.summary:
        probe_summary(ns.summary)  # before anything is compared: a failure after the table hid a regression's exit 1
    baseline = load_document(ns.baseline, "--baseline")
    refuse_empty_baseline(baseline, ns.baseline, "--baseline")
    candidate = load_document(ns.candidate, "--candidate") if ns.candidate else baseline
    if ns.baseline_env:
        baseline = select_env(baseline, ns.baseline_env, "--baseline-env")
    if ns.candidate_env:
        candidate = select_env(candidate, ns.candidate_env, "--candidate-env")
    return run_gate(baseline, candidate, allow, "packcheck gate", ns.bisect_output_dir if ns.bisect else None, ns.summary)


def parse_allow(items: list[str]) -> dict[str, str]:
    """``--allow CELL=REASON`` items as ``{cell: reason}``, secrets scrubbed (:func:`errors.scrub_secrets`).

    Raises:
        PackcheckUsageError: an item without ``=``, a cell or a reason.
    """
    from ..errors import PackcheckUsageError, scrub_secrets

    allow = {}
    for item in items:
        cell, sep, reason = scrub_secrets(item).partition("=")  # a pasted token reaches the table and --summary
        if not sep or not cell or not reason:
            raise PackcheckUsageError(f"--allow '{scrub_secrets(item)}' needs CELL=REASON, e.g. --allow 'opt-sdpa=known OPT leak'.")
        allow[cell] = reason
    return allow


def run_gate(baseline: dict, candidate: dict, allow: dict[str, str], prog: str, bisect_dir: str | None = None,
             summary: str | None = None) -> int:
    """Print the changed cells (a rich table on a terminal, plain text otherwise), append the job summary to
    ``summary`` when given, bisect each regression when ``bisect_dir`` is given, and return 1 on a regression.

    Raises:
        PackcheckUsageError: a cell held twice with two verdicts; the summary file cannot be written.
    """
    from ..analysis.gate import (
        allowed_reason,
        compare,
        compared,
        missing_note,
        probe_settings_note,
        regressions,
        render_changes,
        render_summary,
        stack,
        write_summary,
    )
    from ..report.verdicts import not_run

    changes = compare(baseline, candidate, allow)
    ids = {c["cell_id"] for c in baseline["cells"]} | {c["cell_id"] for c in candidate["cells"]}
    for key in allow:
        if not any(allowed_reason(i, {key: "x"}) for i in ids):
            # a prefix is whole '-'-separated parts (trial 15, 202: 'llama-sdpa-logits' for logits_parity): name them
            near = sorted(i for i in ids if i.startswith(key))[:3]
            hint = (f"; a prefix is whole '-'-separated parts of a cell id: {', '.join(near)} "
                    f"{'starts' if len(near) == 1 else 'start'} with it" if near else "")
            print(f"{prog}: warning: --allow '{key}' matches no cell of either file{hint}", file=sys.stderr)
    differ = probe_settings_note(baseline, candidate, prog)
    if differ:
        print(differ, file=sys.stderr)
    gone = missing_note(changes, prog)
    if gone:
        print(gone, file=sys.stderr)
    changes = compared(changes)  # the uncompared are said once above, never counted or listed as changed
    counted = [c for c in regressions(changes) if c.candidate is None or (c.after is not None and not_run(c.after))]
    if candidate.get("incomplete") and counted:  # said only where a missing / not-run cell is counted (trial 10, 45)
        print(f"{prog}: warning: the candidate run was incomplete ({candidate['incomplete']['reason']}); "
              f"{len(counted)} of its missing or not-run cells count as regressions (they passed in the baseline)",
              file=sys.stderr)
    if sys.stdout.isatty():
        _print_changes_rich(changes, stack(baseline), stack(candidate))
    else:
        print(render_changes(changes, stack(baseline), stack(candidate), markdown=False))
    bad = regressions(changes)
    if summary:
        write_summary(summary, render_summary(changes, stack(baseline), stack(candidate)))
    print(f"\n{prog}: {len(bad)} regression(s), {len(changes)} changed cell(s)")
    if bisect_dir and bad:
        _gate_bisect(bad, baseline, candidate, bisect_dir)
    return 1 if bad else 0


def gate_environments(ns: argparse.Namespace) -> tuple[str, str]:
    """The two version environments ``audit --gate`` compares (baseline first, as given), before the audit runs.

    Raises:
        PackcheckUsageError: --versions does not name exactly two environments, or --bench / --save-baseline too.
    """
    from ..config.options import OPT_VERSIONS, OPTIONS
    from ..errors import PackcheckUsageError
    from ..versions.envs import parse_versions

    values = getattr(ns, next(opt.dest for opt in OPTIONS if opt.flag == OPT_VERSIONS)) or []
    combos = parse_versions(values, "--versions") if values else []
    if len(combos) != 2:
        raise PackcheckUsageError(
            f"--gate compares two version environments, and --versions names {len(combos)}"
            f"{' (' + ', '.join(c.label for c in combos) + ')' if combos else ''}: write e.g. "
            "--versions 'transformers==5.24.0,5.25.0' --gate (the first is the baseline).")
    if ns.bench or ns.save_baseline:
        raise PackcheckUsageError("--gate compares two version environments; run --bench / --save-baseline without it.")
    return combos[0].label, combos[1].label


def gate_versions(out: Path, allow: dict[str, str], summary: str | None = None) -> int:
    """``audit --versions A,B --gate``: gate environment B against A in the matrix just written."""
    from ..analysis.gate import select_env
    from ..errors import PackcheckUsageError
    from ..results import load_document

    try:
        doc = load_document(out / "packcheck-matrix.json")
        labels = doc["settings"].get("versions") or []
        if len(labels) != 2:
            raise PackcheckUsageError(f"the matrix in {out} holds {len(labels)} version environments, not two.")
        baseline, candidate = (select_env(doc, label, "--versions") for label in labels)
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    print(f"\npackcheck gate: {labels[1]} (candidate) against {labels[0]} (baseline)")
    try:
        code = run_gate(baseline, candidate, allow, "packcheck gate", summary=summary)
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    _gate_into_report(out, doc, baseline, candidate, allow, labels)
    return code


def _gate_into_report(out: Path, doc: dict, baseline: dict, candidate: dict, allow: dict[str, str], labels: list[str]) -> None:
    """Record the gate's result in the matrix files (the HTML shows it): ``doc["gate"]`` with the two
    environments, the counts and each regression's cell id, then the four files written again as a set."""
    from ..analysis.gate import compare, compared, regressions
    from ..report.formats import write_reports

    changes = compared(compare(baseline, candidate, allow))
    bad = regressions(changes)
    doc["gate"] = {"baseline": labels[0], "candidate": labels[1], "changed": len(changes), "regressions": len(bad),
                   "cells": ["-".join(str(x) for x in ch.key[:4] if x) for ch in bad]}
    write_reports(out, doc)


def _gate_bisect(bad: list, baseline: dict, candidate: dict, output_dir: str) -> None:
    """Bisect each regression of a gate run between the baseline's and the candidate's library versions."""
    from ..analysis.bisect import bisect_cell, gate_sides, render_text
    from ..analysis.gate import _key
    from ..errors import PackcheckUsageError

    base_cells = {_key(c): c for c in baseline["cells"]}
    cand_cells = {_key(c): c for c in candidate["cells"]}
    for change in bad:
        b, c = base_cells.get(change.key), cand_cells.get(change.key)
        cell_id = (c or b)["cell_id"].partition("@")[0]
        if b is None or c is None:
            print(f"packcheck gate --bisect: {cell_id}: not bisected (the cell is missing on one side)")
            continue
        sides, why = gate_sides(b, c, baseline.get("environment", {}), candidate.get("environment", {}))
        if sides is None:
            print(f"packcheck gate --bisect: {cell_id}: not bisected ({why})")
            continue
        try:
            record = bisect_cell(cell_id, sides.spec(sides.good), sides.spec(sides.bad), model=c["model"].get("spec"),
                                 output_dir=output_dir)
        except PackcheckUsageError as exc:
            print(f"packcheck gate --bisect: {cell_id}: not bisected ({exc})")
            continue
        print(render_text(record))
        print(f"bisect written: {record['path']}")


def _print_changes_rich(changes: list, baseline_env: dict, candidate_env: dict) -> None:
    """The gate's table for a terminal (rich): the same rows as :func:`gate.render_changes`, regressions in red."""
    from rich.console import Console
    from rich.table import Table

    from ..analysis.gate import render_changes, verdict_label

    head = render_changes([], baseline_env, candidate_env).splitlines()[:2]
    console = Console()
    for line in head:
        console.print(line, highlight=False, markup=False)
    if not changes:
        console.print("No cell changed.")
        return
    table = Table("cell", "baseline", "candidate", "verdict", "detail")
    for ch in changes:
        cell = "-".join(str(x) for x in ch.key[:4] if x) + (f"@{ch.key[4]}" if ch.key[4] else "")
        verdict = verdict_label(ch)
        table.add_row(cell, ch.baseline or "—", ch.candidate or "—", verdict, ch.detail,
                      style="red" if verdict.startswith("REGRESSION") else None)
    console.print(table)
