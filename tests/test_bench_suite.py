"""benchmarks/bench_suite.py's arithmetic (issue 47, the suite): pytest's --durations lines summed per file and phase,
and the floor, ratio and CPU line printed from one (stubbed) run: no suite is run here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_suite.py"

#: what ``pytest --durations=0 --durations-min=0`` prints, xdist's lines among them, and a parametrized id with spaces
DURATIONS = """\
bringing up nodes...
============================= slowest durations ==============================
12.50s call     tests/test_a.py::test_one[x y::z]
2.00s setup    tests/test_a.py::test_one[x y::z]
0.50s teardown tests/test_a.py::test_one[x y::z]
3.00s call     tests/test_b.py::test_two
1.00s setup    tests/test_b.py::TestC::test_three
4.50s call     tests/test_b.py
9.99s something else
=========== 5 passed, 1 skipped, 2 warnings in 20.01s ===========
"""


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("_bench_suite", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_bench_suite", module)
    spec.loader.exec_module(module)
    return module


def test_durations_are_summed_per_file_and_phase(monkeypatch):
    bench = _load(monkeypatch)
    by_file = bench.durations(DURATIONS)
    assert {k: dict(v) for k, v in by_file.items()} == {
        "tests/test_a.py": {"call": 12.5, "setup": 2.0, "teardown": 0.5},
        "tests/test_b.py": {"call": 7.5, "setup": 1.0},
        "*": {"call": 20.0, "setup": 3.0, "teardown": 0.5}}


def test_the_floor_is_collection_plus_calls_over_the_workers(monkeypatch, capsys):
    bench = _load(monkeypatch)
    runs = []

    def fake_run(argv):
        runs.append(argv)
        return (4.0, 6.0, "") if "--collect-only" in argv else (30.0, 50.0, DURATIONS)

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(sys, "argv", ["bench_suite.py", "--workers", "2", "--top", "1", "--", "-k", "x"])
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0))
    bench.main()
    out = capsys.readouterr().out
    assert runs[0][-3:] == ["-k", "x", "--collect-only"] and runs[1][-6:] == ["-k", "x", "-n", "2", "--durations=0",
                                                                               "--durations-min=0"]
    assert "5 passed, 1 skipped, 2 warnings" in out
    assert "floor: collection    4.0 s + calls    20.0 s / 2 =   14.0 s" in out  # 4 + 20 / 2
    assert "suite:   30.0 s wall (0.50 min" in out and "ratio: suite / floor = 2.14x; setup 3.0 s + teardown 0.5 s" in out
    assert "CPU:   suite    50.0 s" in out and "collection   6.0 s" in out
    assert "15.0 s  (setup    2.0, call   12.5)  tests/test_a.py" in out and "tests/test_b.py" not in out  # --top 1
