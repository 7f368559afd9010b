"""Benchmark: `packcheck audit --audit multimodal` against its floor, in the same run (issue 46: at most 3 minutes
wall on 2 quiet cores for the default set; the default audit's time does not grow, since the suite is opt in).

    python benchmarks/bench_multimodal.py [--repeat N]

The floor: the same models built (every model x backend of audit/multimodal.toml, as the audit builds them) and, on
each, one forward of the packed pixel row and one forward of each sample alone with its own pixels: the least any
packed-vs-alone comparison costs. Prints each run's wall seconds, their medians and the ratio, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def audit_seconds() -> float:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "-q", "--audit", "multimodal",
                        "--packcheck-report-dir", out], check=True, capture_output=True)
        return time.perf_counter() - t0


def floor_seconds() -> float:
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.pixels import _run, alone, mm_samples, pack
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import text_config_of
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    audit = tomllib.loads((REPO / "audit" / "multimodal.toml").read_text())["audit"]
    tol = load_tolerances(None, None, "bench")[0]["float32"]
    t0 = time.perf_counter()
    for spec in audit["models"]:
        resolved = resolve_model(parse_model_spec(spec, "bench"), "bench")
        for backend in audit["backends"]:
            ensure_registered(backend)
            try:
                model = build_model(resolved, backend, "float32")
            except ValueError:  # a backend the model refuses (Gemma 3 on the flash path) costs the floor nothing either
                continue
            wb = Workbench(model=model, config=text_config_of(model.config), backend=backend, dtype="float32", tol=tol)
            samples = mm_samples(wb)
            _run(model, pack(model, samples))
            for sample in samples:
                alone(wb, sample)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="Runs of each (default 1).")
    ns = parser.parse_args()
    audits, floors = [], []
    for _ in range(ns.repeat):
        audits.append(audit_seconds())
        floors.append(floor_seconds())
        print(f"audit --audit multimodal {audits[-1]:.1f} s wall; floor {floors[-1]:.1f} s; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    a, f = statistics.median(audits), statistics.median(floors)
    print(f"median: audit {a:.1f} s, floor {f:.1f} s, ratio {a / f:.2f}x (target: audit <= 180 s on 2 quiet cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
