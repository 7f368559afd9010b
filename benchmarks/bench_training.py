"""Benchmark: wall time of the training checks for one tiny model and one backend.

Usage: python benchmarks/bench_training.py [model_type] [backend] [--repeat N]
Prints the seconds per training check (trainer, sft, sft_padding_free, sft_strategies, packing_content) and their
sum (issue 4's target: under 20 s together on 2 cores), median over ``--repeat`` runs after one warm-up run
(imports, tokenizer training and first-call costs are paid there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_type", nargs="?", default="llama")
    parser.add_argument("backend", nargs="?", default="sdpa")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from pytest_packcheck.backends import REFERENCE_BACKEND, register_reference_backend
    from pytest_packcheck.checks.registry import SPECS, TRAINING_CHECKS
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    if args.backend == REFERENCE_BACKEND:
        register_reference_backend()
    tol = tomllib.loads((REPO / "audit" / "tolerances.toml").read_text())["float32"]
    resolved = resolve_model(parse_model_spec(f"arch:{args.model_type}", "bench"), "bench")
    model = build_model(resolved, args.backend, "float32")
    wb = Workbench(model=model, config=model.config, backend=args.backend, dtype="float32", tol=tol)
    import datasets

    datasets.disable_progress_bars()
    checks = list(TRAINING_CHECKS)
    times: dict[str, list[float]] = {c: [] for c in checks}
    statuses: dict[str, str] = {}
    for i in range(args.repeat + 1):
        for check in checks:
            t0 = time.perf_counter()
            result = SPECS[check].load()(wb)
            if i:  # the first round is the warm-up
                times[check].append(time.perf_counter() - t0)
            statuses[check] = result.status
    total = [sum(r) for r in zip(*times.values(), strict=True)]
    for check in checks:
        print(f"{check:>18}: {statistics.median(times[check]):6.2f} s (median of {args.repeat}; {statuses[check]})")
    print(f"training checks, {args.model_type} / {args.backend}: {statistics.median(total):.2f} s median "
          f"(min {min(total):.2f}, max {max(total):.2f}) on {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
