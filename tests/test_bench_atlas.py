"""benchmarks/bench_atlas.py's arithmetic (issue 47): a release's after-estimate is its committed CPU minus the
re-shrunk models' old cost (measured on the sampled release nearest in version order) plus their re-measured cost;
a release whose model was not re-measured keeps its old cost. The measurements are stubbed: nothing runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_atlas.py"


def _load(monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (2.0, 2.0, 2.0))
    spec = importlib.util.spec_from_file_location("_bench_atlas", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _support(tmp_path: Path) -> Path:
    cells = {"nemotron_h": {"eager": {v: {"verdict": "fail"} for v in ("5.14.1", "5.15.1", "5.16.1", "5.9.0")}}}
    why = "issue 47: shrunk"
    releases = [
        {"transformers": "5.9.0", "cpu_s": 1000.0, "remeasured": [{"architectures": ["nemotron_h"], "why": why, "cpu_s": 8.0}]},
        {"transformers": "5.14.1", "cpu_s": 1200.0, "remeasured": [{"architectures": ["nemotron_h"], "why": why, "cpu_s": 7.0}]},
        {"transformers": "5.15.1", "cpu_s": 400.0, "remeasured": [{"architectures": ["nemotron_h"], "why": why, "cpu_s": 7.0}]},
        {"transformers": "5.16.1", "cpu_s": 500.0},  # not re-measured: its old cost stays
        {"transformers": "4.57.6", "cpu_s": 300.0},  # no nemotron_h
        {"transformers": "5.24.0", "cpu_s": None},  # seeded: no CPU recorded, left out
    ]
    path = tmp_path / "support.json"
    path.write_text(json.dumps({"cells": cells, "releases": releases}))
    return path


def test_the_after_estimate_subtracts_the_old_cost_and_adds_the_measured_one(monkeypatch, tmp_path, capsys):
    bench = _load(monkeypatch)
    figures = {("5.14.1", "before"): 600.0, ("5.14.1", "after"): 5.0, ("5.15.1", "before"): 30.0, ("5.15.1", "after"): 5.0}

    def floor(version, models, tree):
        return {"cpu_s": figures[(version, "before" if tree == tmp_path else "after")], "wall_s": 1.0, "cells_wall_s": {}}

    monkeypatch.setattr(bench, "floor", floor)
    monkeypatch.setattr(bench, "job", lambda version, models, tree: {"cpu_s": 9.0, "wall_s": 20.0, "cells": 35})
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_atlas.py", "--before-tree", str(tmp_path), "--sample", "5.14.1,5.15.1",
                                      "--models", "nemotron_h", "--support", str(_support(tmp_path)), "--out", str(out)])
    assert bench.main() == 0
    record = json.loads(out.read_text())
    rows = {r["release"]: r for r in record["releases"]}
    # the old job: the old floor plus the harness's overhead of the new job (9 - 5 s)
    assert rows["5.14.1"]["models_old_cpu_s"] == 604.0 and rows["5.14.1"]["after_cpu_s"] == 1200.0 - 604.0 + 7.0
    assert rows["5.15.1"]["after_cpu_s"] == 400.0 - 34.0 + 7.0
    assert rows["5.9.0"]["after_cpu_s"] == 1000.0 - 604.0 + 8.0 and "of 5.14.1" in rows["5.9.0"]["how"]  # nearest sample
    # not re-measured: the committed CPU stands, no saving is claimed
    assert rows["5.16.1"]["after_cpu_s"] == 500.0 and "not re-measured" in rows["5.16.1"]["how"]
    assert rows["4.57.6"]["after_cpu_s"] == 300.0 and "5.24.0" not in rows
    assert record["slowest"]["release"] == "5.14.1" and record["slowest"]["after_cpu_s"] == 603.0
    printed = capsys.readouterr().out
    assert "load average at start: 2.0" in printed and "extrapolated" in printed and "5.24.0" in printed


def test_reuse_takes_an_earlier_runs_figures_and_measures_nothing(monkeypatch, tmp_path, capsys):
    bench = _load(monkeypatch)
    support = _support(tmp_path)
    earlier = tmp_path / "earlier.json"
    row = {"floor_before": {"cpu_s": 600.0}, "floor_after": {"cpu_s": 5.0}, "job_after": {"cpu_s": 9.0}, "load": 17.0}
    earlier.write_text(json.dumps({"measured": {"nemotron_h": {"5.14.1": row}}}))

    def measure(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(bench, "floor", measure)
    monkeypatch.setattr(bench, "job", measure)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_atlas.py", "--before-tree", str(tmp_path), "--sample", "5.14.1",
                                      "--models", "nemotron_h", "--support", str(support), "--reuse", str(earlier),
                                      "--out", str(out)])
    assert bench.main() == 0
    rows = {r["release"]: r for r in json.loads(out.read_text())["releases"]}
    assert rows["5.14.1"]["after_cpu_s"] == 1200.0 - 604.0 + 7.0 and "of 5.14.1" in rows["5.15.1"]["how"]
    # 5.15.1's whole run (400 s) is less than the old cost of the nearest sample: capped, never a negative estimate
    assert rows["5.15.1"]["after_cpu_s"] == 7.0 and "capped" in rows["5.15.1"]["how"]
    assert f"reused from {earlier}" in capsys.readouterr().out
