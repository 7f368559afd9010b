"""Benchmark: `packcheck --help` and the pytest plugin's import from a fresh process, beside their floor.

Usage: python benchmarks/bench_startup.py [--repeat 7]

Each figure is the median wall time of ``--repeat`` fresh processes, interleaved with the floor so that load from
other processes hits both alike: the floor is a bare ``python -c "import pytest"`` (what any pytest run pays
before it loads a plugin). Issue 47's target: at most 0.5 s for each, and no torch / transformers import (pytest
loads every installed plugin on every run, also in projects that never use packcheck): each line says which heavy
modules the process imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

_HEAVY = ("torch", "transformers", "trl", "accelerate", "datasets", "numpy")
#: what a fresh process imported after ``{code}``: printed on stderr, the command's own output on stdout
_CHECK = ("import sys\n{code}\nprint(','.join(m for m in {heavy!r} if m in sys.modules) or 'none', file=sys.stderr)")
_HELP = ("import contextlib, io\nfrom pytest_packcheck.cli import main\n"
         "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main(['--help'])")


def _time(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    exe = shutil.which("packcheck") or sys.exit("packcheck is not on PATH: pip install -e . first")
    runs = {
        "floor: python -c 'import pytest'": [sys.executable, "-c", "import pytest"],
        "packcheck --help": [exe, "--help"],
        "import pytest_packcheck.plugin": [sys.executable, "-c", "import pytest_packcheck.plugin"],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, argv in runs.items():
            times[name].append(_time(argv))
    heavy = {name: subprocess.run([sys.executable, "-c", _CHECK.format(code=code, heavy=_HEAVY)], capture_output=True,
                                  text=True, check=True).stderr.strip().splitlines()[-1]
             for name, code in (("packcheck --help", _HELP), ("import pytest_packcheck.plugin", "import pytest_packcheck.plugin"))}
    floor = statistics.median(times["floor: python -c 'import pytest'"])
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, median of {args.repeat} fresh processes each")
    for name, ts in times.items():
        med = statistics.median(ts)
        tail = f", {med / floor:.2f}x the floor, heavy modules imported: {heavy[name]}" if name in heavy else ""
        print(f"{name:34s} {med:6.3f} s{tail}")


if __name__ == "__main__":
    main()
