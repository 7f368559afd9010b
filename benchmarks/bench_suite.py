"""Benchmark: the test suite's wall time (README's test command, what ``.ci/run`` runs) beside its floor, from one run.

    python benchmarks/bench_suite.py [--workers 2] [--top 15] [-- extra pytest arguments]

The suite: ``python -m pytest tests -n <workers> -q -p no:cacheprovider`` in a child process (README's command;
``--durations=0 --durations-min=0`` added so that every test's setup, call and teardown seconds come back in its
output), timed as wall seconds. Issue 47's target: at most 6 minutes on 2 quiet cores.

The floor, measured in the same run right before the suite: what that command cannot do without on ``workers``
workers, each of which collects the whole suite and then runs its share of the tests:

- *collection*: the wall seconds of ``python -m pytest tests --collect-only -q -p no:cacheprovider`` (importing every
  test module and what they import, torch and transformers among them; every xdist worker pays it, at the same time),
- plus *calls / workers*: the sum of every test's own call seconds (the test function's body; a test that runs a
  subprocess pays that process here) from the suite's own output, divided by the workers, as if the calls were
  spread perfectly over them.

What lies above the floor is what sharing can remove: fixture setup and teardown (models and workbenches built again
and again, audits run once per test instead of once per session), xdist's scheduling and an uneven end (one long
test left on one worker while the other idles). The script prints the floor's two parts, the suite, the ratio
suite / floor, the setup + teardown seconds, and the ``--top`` files by their summed seconds (setup + call +
teardown), and the suite's CPU seconds (user + system of every process it ran, tests' subprocesses included):
on a loaded machine the wall seconds stretch with the load, the CPU seconds much less; compare runs by the CPU
seconds and the ratio when the load differs. It asserts nothing: a failing test is printed with the counts, the
figures still come.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: one line of pytest's --durations report: "12.34s call     tests/test_x.py::test_y[param]"
_DURATION = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S+?)(::\S.*)?$")
_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|error).*) in [\d.]+s")


def _run(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system of the process and every child it waited for: xdist workers, the
    tests' subprocesses) and stdout + stderr of ``argv`` run from the repository root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout + proc.stderr


def durations(output: str) -> dict[str, dict[str, float]]:
    """Seconds per phase (setup / call / teardown) per test file, summed, from ``--durations=0`` output; the key
    ``"*"`` holds the totals over every file."""
    by_file: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for line in output.splitlines():
        m = _DURATION.match(line.strip())
        if m:
            seconds, phase, path = float(m.group(1)), m.group(2), m.group(3)
            by_file[path][phase] += seconds
            by_file["*"][phase] += seconds
    return by_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="xdist workers, -n (default 2, README's command)")
    parser.add_argument("--top", type=int, default=15, help="files to list by their summed seconds (default 15)")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for both runs")
    args = parser.parse_args()
    base = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", *args.pytest_args]
    load0 = os.getloadavg()[0]
    collect_s, collect_cpu, _ = _run([*base, "--collect-only"])
    suite_s, suite_cpu, out = _run([*base, "-n", str(args.workers), "--durations=0", "--durations-min=0"])
    load1 = os.getloadavg()[0]
    phases = durations(out)
    total = phases.pop("*", {})
    calls = total.get("call", 0.0)
    floor = collect_s + calls / args.workers
    summary = next((m.group(1) for line in reversed(out.splitlines()) if (m := _SUMMARY.match(line.strip()))),
                   "no summary line: " + out[-500:])
    print(f"{os.cpu_count()} cores, load {load0:.2f} at the start, {load1:.2f} at the end; {args.workers} workers; {summary}")
    print(f"floor: collection {collect_s:6.1f} s + calls {calls:7.1f} s / {args.workers} = {floor:6.1f} s")
    print(f"suite: {suite_s:6.1f} s wall ({suite_s / 60:.2f} min; issue 47's target: at most 6 min on 2 quiet cores)")
    print(f"CPU:   suite {suite_cpu:7.1f} s (user + system, every process; / {args.workers} = {suite_cpu / args.workers:6.1f} s), "
          f"collection {collect_cpu:5.1f} s: on a shared machine the CPU seconds move less with the load than the wall")
    print(f"ratio: suite / floor = {suite_s / floor:.2f}x; setup {total.get('setup', 0.0):.1f} s + teardown "
          f"{total.get('teardown', 0.0):.1f} s summed over the tests")
    print(f"the {args.top} files with the most seconds (setup + call + teardown, summed over their tests):")
    ranked = sorted(phases.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]
    for path, ph in ranked:
        print(f"  {sum(ph.values()):7.1f} s  (setup {ph.get('setup', 0.0):6.1f}, call {ph.get('call', 0.0):6.1f})  {path}")


if __name__ == "__main__":
    main()
