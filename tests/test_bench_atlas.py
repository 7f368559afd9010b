"""benchmarks/bench_atlas.py's arithmetic (issue 47): a release's after-estimate is its committed CPU minus the
re-shrunk models' old cost (measured on the sampled release nearest in version order) plus their re-measured cost;
a release whose model was not re-measured keeps its old cost. The measurements are stubbed: nothing runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from pytest_packcheck.results.schema import read_results

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


def _whole_support(tmp_path: Path) -> Path:
    entry = {"verdict": "fail", "check": "isolation", "causes": ["leak"], "number": 0.6}
    cells = {"llama": {"eager": {"4.44.2": dict(entry), "5.25.0": dict(entry)}},
             "opt": {"sdpa": {"4.44.2": {"verdict": "pass", "check": "isolation", "causes": [], "number": 0.0}}}}
    releases = [{"transformers": "4.44.2", "architectures": 80, "cpu_s": 900.0},
                {"transformers": "4.57.6", "architectures": 120, "cpu_s": 2000.0},
                {"transformers": "5.24.0", "architectures": 200, "cpu_s": None},  # seeded: extrapolated all the same
                {"transformers": "5.25.0", "architectures": 220, "cpu_s": 300.0}]
    path = tmp_path / "support.json"
    path.write_text(json.dumps({"cells": cells, "releases": releases}))
    return path


def test_whole_measures_each_sample_before_and_after_and_extrapolates_by_architecture_count(monkeypatch, tmp_path, capsys):
    bench = _load(monkeypatch)
    before_tree = tmp_path / "before"
    cpu = {("4.44.2", "before"): 48.0, ("4.44.2", "after"): 40.0, ("5.25.0", "before"): 220.0, ("5.25.0", "after"): 198.0}
    runs = []

    def job(version, models, tree):
        side = "before" if tree == before_tree else "after"
        runs.append((version, side, models))
        return {"cpu_s": cpu[(version, side)], "wall_s": 1.0, "cells": 10, "folder": f"{version}-{side}"}

    leak = {"verdict": "fail", "check": "isolation", "causes": ["leak"], "number": 0.6}
    # opt's 4.44.2 entry planted as changed after
    made = {"4.44.2-before": {"llama": {"eager": leak}, "opt": {"sdpa": {"verdict": "pass", "check": "isolation", "causes": [], "number": 0.0}}},
            "4.44.2-after": {"llama": {"eager": leak}, "opt": {"sdpa": {"verdict": "fail", "check": "logits_parity", "causes": ["leak"]}}},
            "5.25.0-before": {"llama": {"eager": leak}}, "5.25.0-after": {"llama": {"eager": {**leak, "number": 0.7}}}}
    monkeypatch.setattr(bench, "job", job)
    monkeypatch.setattr(bench, "floor", lambda version, models, tree: {"cpu_s": 20.0 if version == "4.44.2" else 99.0, "wall_s": 1.0})
    monkeypatch.setattr(bench, "entries", lambda folder: made[folder])
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_atlas.py", "--whole", "--floor", "--before-tree", str(before_tree),
                                      "--sample", "4.44.2,5.25.0", "--support", str(_whole_support(tmp_path)), "--out", str(out)])
    assert bench.main() == 0
    assert [(v, s, m) for v, s, m in runs] == [("4.44.2", "before", None), ("4.44.2", "after", None),
                                               ("5.25.0", "before", None), ("5.25.0", "after", None)]  # whole releases
    record = json.loads(out.read_text())
    rows = {r["release"]: r for r in record["releases"]}
    assert rows["4.44.2"]["after_cpu_s"] == 40.0 and rows["4.44.2"]["how"] == "measured"
    # 4.57.6 is nearer 4.44.2 in the atlas's release order (ties: the older): its CPU per architecture x 120
    assert rows["4.57.6"]["after_cpu_s"] == 40.0 / 80 * 120 and "4.44.2's" in rows["4.57.6"]["how"]
    assert rows["5.24.0"]["before_cpu_s"] == 200.0 and rows["5.24.0"]["after_cpu_s"] == 180.0  # 5.25.0's per architecture
    assert record["slowest"] == {**rows["5.25.0"], "after_cpu_s": 198.0}
    assert record["before_h"] == round((48.0 + 60.0 + 200.0 + 220.0) / 3600, 2)
    assert record["committed_h"] == round((900 + 2000 + 300) / 3600, 2)  # printed beside, not used
    # the planted change is found, before -> after and committed -> after; a different number is only beside
    changed = record["whole"]["4.44.2"]["before_vs_after"]["changed"]
    assert changed == [{"model": "opt", "backend": "sdpa", "verdict": ["pass", "fail"], "check": ["isolation", "logits_parity"],
                        "causes": [[], ["leak"]]}]
    assert record["whole"]["4.44.2"]["committed_vs_after"]["changed"][0]["model"] == "opt"
    assert record["whole"]["5.25.0"]["before_vs_after"]["changed"] == []
    assert record["whole"]["5.25.0"]["before_vs_after"]["beside"] == [{"model": "llama", "backend": "eager", "number": [0.6, 0.7]}]
    printed = capsys.readouterr().out
    assert "load average at start: 2.0" in printed and "its floor 20.0 s" in printed and "extrapolated" in printed


def test_whole_names_a_sample_that_is_not_an_atlas_release(monkeypatch, tmp_path):
    bench = _load(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_atlas.py", "--whole", "--before-tree", str(tmp_path), "--sample", "4.99.0",
                                      "--support", str(_whole_support(tmp_path)), "--out", str(tmp_path / "o.json")])
    try:
        bench.main()
    except SystemExit as exc:
        assert "--sample 4.99.0: not a release" in str(exc) and "4.44.2" in str(exc)
    else:
        raise AssertionError("an unknown sample was measured")


def test_the_job_runs_the_measured_trees_own_command_line(monkeypatch, tmp_path):
    """``job`` runs the measured checkout's ``run_plugin_in_env`` (a change of the atlas's pytest flags is on its side
    only): a stand-in tree whose run_plugin_in_env writes what it was given is the one that ran."""
    bench = _load(monkeypatch)
    tree = tmp_path / "tree"
    files = {
        "pytest_packcheck/__init__.py": "",
        "pytest_packcheck/versions/__init__.py": "",
        "pytest_packcheck/versions/envs.py": (
            "import sys, types\n"
            "class VersionCombo(tuple):\n    pass\n"
            "def ensure_env(combo):\n    return types.SimpleNamespace(python=sys.executable)\n"),
        "pytest_packcheck/atlas/__init__.py": "",
        "pytest_packcheck/atlas/release_run.py": (
            "import json, os, subprocess\n"
            "def release_flags(folder, shard, models):\n    return ['--stand-in-flag', *(models or ['all'])]\n"
            "def reproduce_command(version):\n    return 'r'\n"
            "def run_plugin_in_env(python, label, folder, flags, reproduce, runner):\n"
            "    (folder / 'packcheck-matrix.json').write_text(json.dumps({'cells': [{'flags': flags, 'label': label, 'tree': __file__}]}))\n"
            "    return subprocess.CompletedProcess([], 0)\n"),
    }
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    record = bench.job("9.9.9", None, tree)
    cell = read_results(Path(record["folder"]) / "packcheck-matrix.json")["cells"][0]
    assert record["cells"] == 1 and cell["flags"] == ["--stand-in-flag", "all"] and cell["label"] == "transformers==9.9.9"
    assert cell["tree"].startswith(str(tree))
    record = bench.job("9.9.9", ["llama"], tree)
    assert read_results(Path(record["folder"]) / "packcheck-matrix.json")["cells"][0]["flags"][1] == "arch:llama"
