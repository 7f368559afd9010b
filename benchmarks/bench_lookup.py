"""Benchmark: `packcheck lookup` from a fresh process against its floor, in the same run (issue 47: at most 0.1 s,
and under 1 ms per answer once loaded).

    python benchmarks/bench_lookup.py [--repeat N]

The floor: a fresh python that imports json and packaging (what any lookup needs). Each figure is the median of N
runs, the two commands alternated. The first lookup builds the atlas's split index in a fresh cache (its cost is
printed apart); the runs after it read the index. Also times 100 answers in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _run(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="Runs of each command (default 9).")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PACKCHECK_CACHE_DIR": cache}
        lookup = [sys.executable, "-m", "pytest_packcheck.cli", "lookup", "llama", "sdpa", "4.53.1"]
        floor = [sys.executable, "-c", "import json, packaging.version"]
        first = _run(lookup, env)
        looks, floors = [], []
        for _ in range(ns.repeat):
            looks.append(_run(lookup, env))
            floors.append(_run(floor, env))
        os.environ["PACKCHECK_CACHE_DIR"] = cache
        from pytest_packcheck.support import lookup as answer

        answer("llama", "sdpa", "4.53.1")
        t0 = time.perf_counter()
        for _ in range(100):
            answer("qwen2", "sdpa", "4.56.2")
        per_answer = (time.perf_counter() - t0) / 100
    load = os.getloadavg()[0]
    lk, fl = statistics.median(looks), statistics.median(floors)
    print(f"first lookup (builds the index): {first:.3f} s")
    print(f"lookup {lk:.3f} s (min {min(looks):.3f}, max {max(looks):.3f}); floor {fl:.3f} s; ratio {lk / fl:.1f}x; "
          f"in one process {per_answer * 1000:.2f} ms per answer; load {load:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
