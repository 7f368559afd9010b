"""Benchmark: the default audit's CPU time against its floor, from one run (issue 47: at most 2x the floor).

    python benchmarks/bench_audit.py [--backends eager,sdpa] [--audit-only | --floor-only] [--profile FILE]
                                     [--repeat N] [-- extra audit arguments, e.g. -n 0]

The floor (``--floor-only`` runs it alone, in this process): what the audit cannot do without, built by packcheck's
own code (audit/default.toml's models through resolve_model, the shrink and build_model; the workbench's examples
and packed row through its collator), in one process that imports torch and transformers once: for each
(model, backend) pair, on one intra-op thread as the audit's cell children run, one packed forward + backward, each example alone forward + backward, one right-padded
forward and one packed forward with the first example perturbed. A model packcheck cannot build here costs its
failed build in both.

The audit: ``packcheck audit -q --packcheck-attn <backends>`` in a child process, right after the floor (also a
child process), each measured as the children's user + system CPU seconds (``resource.RUSAGE_CHILDREN``: every
forked cell child included) and wall seconds. Prints both and the ratio audit / floor; ``--repeat N`` runs N
rounds of floor then audit, one line each, then the medians (the machine is shared: each round says its load).
``--profile FILE`` runs the audit under cProfile in this process (``-n 0``: no workers) and writes the stats.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from suite_timing import load_average, repeated


def floor(backends: tuple[str, ...]) -> int:
    """Run the floor in this process; returns the number of (model, backend) pairs that ran."""
    import torch

    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.reference import alone_batch
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.config.audits import load_audit
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model import batches as B
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import text_config

    torch.set_num_threads(1)  # as each of the audit's cell children runs (run/sandbox.py): no idle threads spinning
    audit = load_audit("default")
    tolerances, _ = load_tolerances(None, None, "default")
    pairs = 0
    for spec_text in audit.models:
        resolved = resolve_model(parse_model_spec(spec_text, "floor"), "floor")
        for backend in backends:
            try:
                ensure_registered(backend)
                model = build_model(resolved, backend, "float32")
            except Exception as exc:  # noqa: BLE001 - the audit pays the same failed build
                print(f"  {spec_text} {backend}: no model ({type(exc).__name__})", file=sys.stderr)
                continue
            wb = Workbench(model=model, config=text_config(model.config), backend=backend, dtype="float32",
                           tol=tolerances["float32"])
            try:
                packed = wb.packed()
                wb.forward(packed, grad=True).loss.backward()
                for example in wb.examples:
                    alone = alone_batch(example, wb.start)
                    wb.forward({**alone, "labels": alone["input_ids"]}, grad=True).loss.backward()
                model.zero_grad(set_to_none=True)
                wb.forward(B.padded_batch(wb.examples, wb.pad_id, start=wb.start))
                perturbed = dict(packed, input_ids=packed["input_ids"].clone())
                n = len(wb.examples[0])
                perturbed["input_ids"][0, :n] = (perturbed["input_ids"][0, :n] + 1) % int(wb.config.vocab_size)
                wb.forward(perturbed)
            except Exception as exc:  # noqa: BLE001 - a model that cannot run the row: its cells say so in the audit
                print(f"  {spec_text} {backend}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
            pairs += 1
            del model, wb
    return pairs


def _child(argv: list[str]) -> tuple[float, float, str]:
    """(CPU seconds of the child and its descendants, wall seconds, its standard output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(argv, check=False, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        sys.exit(f"{' '.join(argv)} exited {out.returncode}:\n{(out.stdout + out.stderr)[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="eager,sdpa")
    parser.add_argument("--floor-only", action="store_true", help="run the floor in this process and stop")
    parser.add_argument("--audit-only", action="store_true", help="time the audit alone")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile the audit in this process (-n 0) into FILE")
    parser.add_argument("--report-dir", type=Path, default=None, help="keep the audit's reports here")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of floor then audit (default 1); medians after")
    parser.add_argument("audit_args", nargs="*", help="more arguments for packcheck audit (after --), e.g. -- -n 0")
    ns = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backends = tuple(b.strip() for b in ns.backends.split(",") if b.strip())
    if ns.floor_only:
        print(f"floor: {floor(backends)} (model, backend) pairs")
        return 0
    out = ns.report_dir or Path(tempfile.mkdtemp(prefix="bench-audit-"))
    audit = [sys.executable, "-m", "pytest_packcheck.cli", "audit", "-q", "--packcheck-attn", ",".join(backends),
             "--packcheck-report-dir", str(out), *ns.audit_args]
    if ns.profile:
        import cProfile

        from pytest_packcheck.cli import main as cli_main

        cProfile.runctx("cli_main(audit[3:] + ['-n', '0'])", globals(), {"cli_main": cli_main, "audit": audit},
                        str(ns.profile))
        print(f"profile written to {ns.profile}")
        return 0
    load, cores = load_average()
    print(f"{cores} cores, load {load:.2f} before the run")
    walls: dict[str, float] = {}
    pairs: list[str] = []

    def timed(name: str, argv: list[str]) -> Callable[[], float]:
        def measure() -> float:
            cpu, walls[name], text = _child(argv)
            if name == "floor":
                pairs[:] = [text.splitlines()[-1]]
            return cpu
        return measure

    def line(run: dict[str, float]) -> str:
        text = []
        if "floor" in run:
            text.append(f"floor: {pairs[0]}: {run['floor']:.1f} s CPU, {walls['floor']:.1f} s wall")
        text.append(f"packcheck audit -q --packcheck-attn {','.join(backends)}{''.join(' ' + a for a in ns.audit_args)}: "
                    f"{run['audit']:.1f} s CPU, {walls['audit']:.1f} s wall (reports in {out})")
        if "floor" in run:
            text.append(f"audit / floor: {run['audit'] / run['floor']:.2f}x CPU, {walls['audit'] / walls['floor']:.2f}x "
                        f"wall; load {load_average()[0]:.2f} after")
        return "\n".join(text)

    measures = {} if ns.audit_only else {"floor": timed("floor", [sys.executable, __file__, "--floor-only",
                                                                   "--backends", ns.backends])}
    measures["audit"] = timed("audit", audit)
    median = repeated(ns.repeat, measures, line)
    if ns.repeat > 1 and not ns.audit_only:
        print(f"median of {ns.repeat}: floor {median['floor']:.1f} s CPU, audit {median['audit']:.1f} s CPU, "
              f"{median['audit'] / median['floor']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
