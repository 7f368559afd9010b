"""benchmarks/suite_timing.py, the code the suite benchmarks share: rounds in order, medians, and each script's
lines as they were printed before the move (the figures stubbed, nothing audited)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Load benchmarks/<name>.py as the scripts run (their folder first on sys.path), the load average fixed."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr("os.getloadavg", lambda: (3.14159, 1.0, 1.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)

    def load(name):
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    yield load
    sys.modules.pop("suite_timing", None)


def test_repeated_runs_each_measure_in_order_per_round_and_returns_medians(bench, capsys):
    timing = bench("suite_timing")
    calls, figures = [], iter([5.0, 1.0, 7.0, 3.0, 6.0, 2.0])

    def measure(name):
        def run():
            calls.append(name)
            return next(figures)
        return run

    median = timing.repeated(3, {"audit": measure("audit"), "floor": measure("floor")},
                             lambda run: f"{run['audit']:.0f}/{run['floor']:.0f}")
    assert calls == ["audit", "floor"] * 3
    assert capsys.readouterr().out.splitlines() == ["5/1", "7/3", "6/2"]
    assert median == {"audit": 6.0, "floor": 2.0}


def test_suite_definition_reads_the_audit_table(bench):
    timing = bench("suite_timing")
    rl = timing.suite_definition("rl")
    assert rl["models"] and rl["backends"] and rl["checks"]


#: (script, its lines for the stubbed figures 12.34, 5.01, 13.5, 4.9, 11.0, 6.2, ... in call order, --repeat 3): what
#: the scripts printed before the move (compared once against the scripts of d71541d, run with the same stubs)
EXPECTED = {
    "bench_rl": ["audit --audit rl 12.3 s wall; floor 5.0 s", "audit --audit rl 13.5 s wall; floor 4.9 s",
                 "audit --audit rl 11.0 s wall; floor 6.2 s",
                 "median: audit 12.3 s, floor 5.0 s, ratio 2.46x (target: audit <= 180 s on 2 quiet cores)"],
    "bench_stack": [
        "audit --audit stack 12.3 s wall; checks floor 5.0 s; compute floor 113.5 s; load 3.1 on 2 cores",
        "audit --audit stack 4.9 s wall; checks floor 11.0 s; compute floor 106.2 s; load 3.1 on 2 cores",
        "audit --audit stack 12.3 s wall; checks floor 5.0 s; compute floor 113.5 s; load 3.1 on 2 cores",
        ("median: audit 12.3 s, checks floor 5.0 s (ratio 2.46x), compute floor 113.5 s (ratio 0.11x; target: audit "
         "<= 300 s on 2 quiet cores)")],
    "bench_encoders": ["audit --audit encoders 12.3 s wall; floor 5.0 s; load average 3.1 on 2 cores",
                       "audit --audit encoders 13.5 s wall; floor 4.9 s; load average 3.1 on 2 cores",
                       "audit --audit encoders 11.0 s wall; floor 6.2 s; load average 3.1 on 2 cores",
                       "median: audit 12.3 s, floor 5.0 s, ratio 2.46x (target: audit <= 180 s on 2 quiet cores)"],
    "bench_multimodal": [
        "audit --audit multimodal 12.3 s wall; floor 5.0 s; load average 3.1 on 2 cores",
        "audit --audit multimodal 13.5 s wall; floor 4.9 s; load average 3.1 on 2 cores",
        "audit --audit multimodal 11.0 s wall; floor 6.2 s; load average 3.1 on 2 cores",
        "median: audit 12.3 s, floor 5.0 s, ratio 2.46x (target: audit <= 180 s on 2 quiet cores)"],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_each_suite_benchmark_prints_its_lines_as_before(bench, capsys, monkeypatch, script):
    module = bench(script)
    figures = iter([12.34, 5.01, 13.5, 4.9, 11.0, 6.2] * 3)
    suites = []

    def audit_seconds(suite):
        suites.append(suite)
        return next(figures)

    monkeypatch.setattr(module, "audit_seconds", audit_seconds)
    monkeypatch.setattr(module, "floor_seconds", lambda compute=False: next(figures) + (100 if compute else 0))
    monkeypatch.setattr(sys, "argv", [script, "--repeat", "3"])
    assert module.main() == 0
    assert capsys.readouterr().out.splitlines() == EXPECTED[script]
    assert suites == [script.removeprefix("bench_")] * 3
