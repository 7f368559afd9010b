"""The atlas: releases from the index, one resumable run per release, the reduction to support.json, transitions
and their sweep to the exact patch, rendering, lookup, known-fault windows against the measured atlas, and the example
workflow's commands. Fast: planted results documents and stand-in environments, no model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_packcheck import atlas as A
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results.schema import SCHEMA_VERSION, read_results
from pytest_packcheck.support import load_support, lookup

REPO = Path(__file__).resolve().parents[1]


def _cell(model: str, backend: str, check: str, status: str, cause: str | None = None, number: float = 0.0,
          findings: list[str] | None = None) -> dict:
    key = {"isolation": "max_change", "logits_parity": "max_abs_diff_solo", "cache_trap": "max_abs_diff_default"}[check]
    return {"cell_id": f"{model}-{backend}-{check}-float32", "model": {"label": model, "model_type": model, "spec": f"arch:{model}"},
            "backend": backend, "check": check, "dtype": "float32", "status": status, "metrics": {key: number},
            "message": f"{check} {status} {number:.2e}", "cause": cause, "role": "hazard" if check == "cache_trap" else "correctness",
            "tolerances": {"isolation_atol": 1e-05, "logits_atol": 1e-04},
            "findings": [{"cause": f, "evidence": "planted"} for f in findings or []],
            "diagnosis": {"cause": cause, "findings": [], "known_faults": []}}


def _doc(version: str, cells: list[dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "packcheck_version": "0.1.0", "command": "planted",
            "environment": {"transformers": version, "torch": "2.13.0+cpu", "trl": None},
            "settings": {"models": sorted({c["model"]["spec"] for c in cells}), "backends": list(A.ATLAS_BACKENDS), "versions": []},
            "cells": cells}


def _write_release(build: Path, version: str, cells: list[dict], shard: tuple[int, int] | None = None) -> None:
    folder = A.release_dir(build, version, shard)
    folder.mkdir(parents=True)
    (folder / "packcheck-matrix.json").write_text(json.dumps(_doc(version, cells)))
    (folder / A.DONE_MARKER).write_text(json.dumps({"transformers": version, "shard": list(shard or (1, 1)), "cells": len(cells),
                                                    "wall_s": 10.0, "child_cpu_s": 9.0}))


def _planted_atlas(build: Path) -> None:
    """llama / sdpa leaks on 4.52.4 and passes on 5.24.0 (with a cache_trap hazard, which never decides);
    opt / sdpa fails on both; qwen3 exists only on 5.24.0; llama / packcheck_flash_ref passes with a finding."""
    _write_release(build, "4.52.4", [
        _cell("llama", "sdpa", "isolation", "fail", "leak", 0.28), _cell("llama", "sdpa", "logits_parity", "fail", "leak", 0.43),
        _cell("llama", "packcheck_flash_ref", "isolation", "pass"), _cell("opt", "sdpa", "isolation", "fail", "leak", 0.1)])
    _write_release(build, "5.24.0", [
        _cell("llama", "sdpa", "isolation", "pass"), _cell("llama", "sdpa", "logits_parity", "pass", number=1e-7),
        _cell("llama", "sdpa", "cache_trap", "fail", "cache_trap", 0.43),
        _cell("llama", "packcheck_flash_ref", "isolation", "pass", findings=["batch_rows"]),
        _cell("opt", "sdpa", "isolation", "fail", "wrong_positions", 0.2), _cell("qwen3", "sdpa", "isolation", "pass"),
        {**_cell("qwen3", "eager", "isolation", "error", "shrink_limit"), "metrics": {}}])


# ----------------------------------------------------------------------------------------------------------------
# releases


def test_latest_patch_of_each_minor_from_the_index_page():
    from pytest_packcheck.analysis.bisect import parse_simple_index

    names = ["4.43.4", "4.44.0", "4.44.2", "4.44.1", "4.57.0", "4.57.1", "5.0.0rc1", "5.0.0", "5.1.0"]
    page = {"files": [{"filename": f"transformers-{v}-py3-none-any.whl", "yanked": v == "4.57.1"} for v in names]}
    releases, yanked = parse_simple_index(page)
    assert yanked == ["4.57.1"]
    assert A.latest_patches(releases) == ["4.44.2", "4.57.0", "5.0.0", "5.1.0"]
    assert A.latest_patches(releases, since="4.57", until="5.0") == ["4.57.0", "5.0.0"]
    with pytest.raises(PackcheckUsageError, match="--since / --until"):
        A.latest_patches(releases, since="four")


def test_gap_order_measures_the_major_boundary_then_halves_the_widest_gap():
    planned = ["4.47.1", "4.48.3", "4.49.0", "4.50.3", "4.51.3", "4.52.4", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0"]
    order = A.gap_order(planned, ["4.47.1", "4.52.4", "4.57.6", "5.3.0"])
    assert order == ["5.0.0", "4.49.0", "4.50.3", "5.1.0", "4.48.3", "4.51.3", "5.2.0"]
    assert sorted(order, key=A.version_key) == [v for v in planned if v not in ("4.47.1", "4.52.4", "4.57.6", "5.3.0")]
    assert A.gap_order(["4.44.2", "4.45.2"], []) == ["4.44.2", "4.45.2"]  # nothing measured: the middle, oldest first


def test_release_list_is_exact_releases_with_one_line_errors():
    assert A.parse_release_list("5.24.0, 4.44.2,4.44.2", "--releases") == ["4.44.2", "5.24.0"]
    with pytest.raises(PackcheckUsageError, match=r"Release '4.44' \(from --releases\) names a minor.*4\.44\.0"):
        A.parse_release_list("4.44", "--releases")
    with pytest.raises(PackcheckUsageError, match="Release 'latest' .* is not a version"):
        A.parse_release_list("latest", "--releases")
    for text in ("4.44.2,", ",4.44.2", "4.44.2,,5.24.0", " , "):  # planted: an empty item was dropped in silence
        with pytest.raises(PackcheckUsageError, match="has an empty item"):
            A.parse_release_list(text, "--releases")
    with pytest.raises(PackcheckUsageError, match="Bad shard '3/2'"):
        A.parse_shard("3/2", "--shard")


def test_atlas_checks_are_the_deciding_checks_and_hazards_from_the_registry():
    from pytest_packcheck.checks.registry import SPECS

    checks = A.atlas_checks()
    assert {"isolation", "logits_parity", "cache_trap", "mask_trap"} <= set(checks)
    assert all(SPECS[c].role in ("correctness", "hazard") and not SPECS[c].training for c in checks)
    assert "collate" not in checks and "trainer" not in checks


# ----------------------------------------------------------------------------------------------------------------
# one release, resumable


@pytest.fixture
def stand_in_env(monkeypatch, tmp_path):
    from pytest_packcheck.versions import envs

    def ensure_env(combo, log=None):
        return envs.VersionEnv(combo, tmp_path / "env", Path(sys.executable), {"transformers": combo.requirements[0].split("==")[1]},
                               False, 0.0)

    monkeypatch.setattr(envs, "ensure_env", ensure_env)


def test_a_killed_release_resumes_from_its_journal_and_a_done_release_is_not_run_again(tmp_path, stand_in_env, monkeypatch):
    calls = []

    def killed(args, **kw):
        calls.append(args)
        report = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--packcheck-report-dir=")))
        (report / "packcheck-journal.jsonl").write_text("{}\n")  # half-way: journal, no results
        return subprocess.CompletedProcess(args, -9)

    record = A.run_release("5.24.0", tmp_path, runner=killed, log=lambda s: None)
    assert "error" in record and "exit -9" in record["error"] and not A.is_done(A.release_dir(tmp_path, "5.24.0"))

    def finishes(args, **kw):
        calls.append(args)
        assert "--packcheck-resume" in args and "--packcheck-all-architectures" in args
        assert kw["env"]["PACKCHECK_ENV_LABEL"] == "transformers==5.24.0" and "PYTHONPATH" not in kw["env"]
        assert kw["env"]["OMP_NUM_THREADS"] == "1"  # tiny models, one thread: no spinning beside another job
        report = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--packcheck-report-dir=")))
        assert (report / "packcheck-journal.jsonl").exists()  # the same folder: the journal is found
        (report / "packcheck-matrix.json").write_text(json.dumps(_doc("5.24.0", [_cell("llama", "sdpa", "isolation", "pass")])))
        return subprocess.CompletedProcess(args, 0)

    record = A.run_release("5.24.0", tmp_path, runner=finishes, log=lambda s: None)
    assert record["cells"] == 1 and A.is_done(A.release_dir(tmp_path, "5.24.0"))
    # the time of the killed part is lost: the record and the coverage table say the timing is partial
    assert record["resumed"] is True and record["resumed_cells"] == 1
    support = A.collect(tmp_path, planned=["5.24.0"])
    assert support["releases"][0]["resumed"] is True and support["releases"][0]["resumed_cells"] == 1
    row = next(ln for ln in A.render_markdown(support).splitlines() if ln.startswith("| 5.24.0 |"))
    assert row.endswith("¹ | — |"), row
    assert "¹ Resumed from an earlier, interrupted run's journal" in A.render_markdown(support)

    def threads_as_set(args, **kw):  # a thread count the user set is theirs
        assert kw["env"]["OMP_NUM_THREADS"] == "3"
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    from pytest_packcheck.atlas.release_run import run_plugin_in_env

    run_plugin_in_env(sys.executable, "transformers==5.24.0", tmp_path, [], "r", runner=threads_as_set)

    def must_not_run(args, **kw):
        raise AssertionError("a done release ran again")

    assert A.run_release("5.24.0", tmp_path, runner=must_not_run, log=lambda s: None)["cells"] == 1
    assert len(calls) == 2


def test_release_flags_shard_and_models():
    flags = A.release_flags("/r", (2, 3), ["arch:llama"])
    assert "--packcheck-shard=2/3" in flags and "--packcheck-models=arch:llama" in flags
    assert "--packcheck-all-architectures" not in flags
    assert f"--packcheck-attn={','.join(A.ATLAS_BACKENDS)}" in A.release_flags("/r")


# ----------------------------------------------------------------------------------------------------------------
# reduction, transitions, rendering


def test_reduction_verdicts_transitions_and_never_pass(tmp_path):
    _planted_atlas(tmp_path / "build")
    support = A.collect(tmp_path / "build", planned=["4.44.2", "4.52.4", "5.24.0"])
    assert support["missing"] == ["4.44.2"] and [r["transformers"] for r in support["releases"]] == ["4.52.4", "5.24.0"]
    llama = support["cells"]["llama"]["sdpa"]
    assert llama["4.52.4"]["verdict"] == "fail" and llama["4.52.4"]["causes"] == ["leak"] and llama["4.52.4"]["number"] == 0.28
    # a hazard never decides: the cache trap is recorded beside a pass
    assert llama["5.24.0"]["verdict"] == "pass" and llama["5.24.0"]["hazards"] == {"cache_trap": "cache_trap"}
    assert support["cells"]["llama"]["packcheck_flash_ref"]["5.24.0"]["findings"] == ["batch_rows"]
    keys = {(t["model_type"], t["backend"]): t for t in support["transitions"]}
    assert set(keys) == {("llama", "sdpa"), ("opt", "sdpa")}  # qwen3 appears: not a transition
    assert keys[("llama", "sdpa")]["before"]["verdict"] == "fail" and keys[("llama", "sdpa")]["after"]["verdict"] == "pass"
    md = A.render_markdown(support)
    assert "- **llama** / sdpa: ❌ leak 4.52.4; ✅ 5.24.0" in md
    assert "| llama | sdpa | 4.52.4 | 5.24.0 | ❌ leak (isolation 2.8e-01) | ✅ (isolation 0.0e+00) | not yet |" in md
    assert "- **opt** / sdpa (5.24.0): ❌ wrong positions" in md
    assert "Not measured yet: 4.44.2" in md
    # the first section: the newest release per backend, what not to pack there and why, passes with a finding
    glance = md.split("## At a glance: transformers 5.24.0")[1].split("## Legend")[0]
    assert "| sdpa | 2 | 1 | 0 |" in glance and "| eager | 0 | 0 | 1 |" in glance and "| packcheck_flash_ref | 1 | 0 | 0 |" in glance
    assert "- sdpa, wrong positions (1): opt" in glance and "leak" not in glance  # 4.52.4's leak is history, not the newest
    assert "- packcheck_flash_ref, batch rows (1): llama" in glance  # one passing: named, not "every one of"
    assert "- 5.24.0 shrink limit: 1 (architecture, backend) of 1 architectures: qwen3" in md.split("## Where packcheck itself stopped")[1]
    page = A.render_html(support)
    assert "<script" in page and "http://" not in page and "https://" not in page and "src=" not in page
    # the click text is built from the row, the column and one JSON block: the same command as reproduce_command
    data = json.loads(page.split('<script id="data" type="application/json">')[1].split("</script>")[0])
    # newest release first (issue 41: the page opened on the oldest), with the legend and a filter
    assert data["releases"] == ["5.24.0", "4.52.4"] and data["checks"] == list(A.atlas_checks())
    assert "<summary>Legend" in page and "<tr><th>leak</th>" in page and 'id="q"' in page and 'id="bk"' in page
    legend = md.split("## Legend")[1].split("## Coverage")[0]
    assert "| leak | examples attend across boundaries" in legend and "| ❌ fail |" in legend
    assert "- eager, 💥 error, shrink limit (1): qwen3" in glance  # no verdict: listed with why
    assert "packcheck audit --models arch:'+a+' --versions transformers=='+v+' --packcheck-attn='+b" in page
    assert A.reproduce_command("4.52.4", "llama", "sdpa").startswith(
        "packcheck audit --models arch:llama --versions transformers==4.52.4 --packcheck-attn=sdpa --packcheck-checks=")
    llama_row = page.split('<tr data-a="llama" data-b=sdpa>')[1].split("</tr>")[0]
    first = data["entries"][int(llama_row.split("data-i=")[1].split(">")[0])]
    assert first[0] == "pass" and "class=f" in llama_row and "class=p" in llama_row  # 5.24.0's cell first
    last = data["entries"][int(llama_row.split("data-i=")[-1].split(">")[0])]
    assert last[:4] == ["fail", ["leak"], "isolation", 0.28]


def test_a_release_counts_only_when_every_shard_is_done(tmp_path):
    build = tmp_path / "build"
    _write_release(build, "5.24.0", [_cell("llama", "sdpa", "isolation", "pass")], shard=(1, 2))
    assert A.collect(build, planned=["5.24.0"])["missing"] == ["5.24.0"]
    _write_release(build, "5.24.0", [_cell("opt", "sdpa", "isolation", "fail", "leak", 0.1)], shard=(2, 2))
    support = A.collect(build, planned=["5.24.0"])
    assert support["missing"] == [] and set(support["cells"]) == {"llama", "opt"} and support["releases"][0]["cells"] == 2


def test_a_fresh_checkout_keeps_the_committed_releases_and_adds_new_ones(tmp_path, monkeypatch):
    """The committed support.json seeds collect: with an empty (git-ignored) build folder, its releases stay in
    every output and are not measured again; a release measured here joins them; a release measured here again
    replaces its committed entries; --remeasure runs a committed release."""
    _planted_atlas(tmp_path / "old-build")
    out = tmp_path / "reports" / "atlas"
    A.write_outputs(A.collect(tmp_path / "old-build", planned=["4.52.4", "5.24.0"]), out)
    ran: list[list[str]] = []
    monkeypatch.setattr(A.command, "generate", lambda releases, build, *a, **kw: ran.append(list(releases)) or [])

    def args(releases, **kw):
        return A.AtlasArgs(releases, tmp_path / "fresh-build", out, None, 1, False, False, None, **kw)

    assert A.main(args(["4.52.4", "5.24.0", "5.25.0"]), log=lambda s: None) == 0
    assert ran == [["5.25.0"]]  # the committed releases are not measured again
    support = json.loads((out / "support.json").read_text())
    assert [r["transformers"] for r in support["releases"]] == ["4.52.4", "5.24.0"] and support["missing"] == ["5.25.0"]
    assert support["cells"]["llama"]["sdpa"]["4.52.4"]["causes"] == ["leak"]
    assert [(t["model_type"], t["last_before"]) for t in support["transitions"]] == [("llama", "4.52.4"), ("opt", "4.52.4")]
    assert "❌ leak 4.52.4; ✅ 5.24.0" in (out / "atlas.md").read_text() and "4.52.4" in (out / "atlas.html").read_text()
    # a release measured in this checkout joins the committed ones (and its transition from the newest committed)
    _write_release(tmp_path / "fresh-build", "5.25.0", [_cell("llama", "sdpa", "isolation", "fail", "leak", 0.5)])
    support = A.collect(tmp_path / "fresh-build", ["4.52.4", "5.24.0", "5.25.0"], committed=A.load_committed(out))
    assert [r["transformers"] for r in support["releases"]] == ["4.52.4", "5.24.0", "5.25.0"] and support["missing"] == []
    assert ("llama", "sdpa", "5.24.0", "5.25.0") in {(t["model_type"], t["backend"], t["last_before"], t["first_after"])
                                                    for t in support["transitions"]}
    # a committed release measured again here: its new entries replace the committed ones (none is left behind)
    _write_release(tmp_path / "fresh-build", "4.52.4", [_cell("llama", "sdpa", "isolation", "pass")])
    support = A.collect(tmp_path / "fresh-build", committed=A.load_committed(out))
    assert support["cells"]["llama"]["sdpa"]["4.52.4"]["verdict"] == "pass" and "4.52.4" not in support["cells"]["opt"]["sdpa"]
    assert [r["transformers"] for r in support["releases"]].count("4.52.4") == 1
    ran.clear()
    A.main(args(["4.52.4"], remeasure=True, no_render=True), log=lambda s: None)
    assert ran == [["4.52.4"]]


def _fake_release_run(plan: dict[str, list[dict]], calls: list):
    """A stand-in for build.run_release: writes the planted cells of the asked architectures for ``version``."""
    def run(version, build, shard=None, workers=1, log=print, runner=None, models=None):
        asked = [m.removeprefix("arch:") for m in models]
        calls.append((version, asked))
        _write_release(build, version, [c for c in plan[version] if c["model"]["model_type"] in asked])
        return {"transformers": version, "cells": 1}
    return run


def test_a_sweep_places_every_transition_of_a_gap_with_one_run_per_release_between(tmp_path, monkeypatch):
    """llama / sdpa: leak on 4.52.4, pass on 5.24.0; opt / sdpa: leak, then wrong_positions. The index has
    4.53.0 .. 4.53.2 between: three runs (each with llama and opt), not a bisect per transition, place llama's fix
    in 4.53.1 and opt's change in 4.53.2, attached to the transitions and rendered; a resumed sweep runs nothing,
    and a later gap that needs another architecture of a swept release runs only that one."""
    from pytest_packcheck.atlas import sweep

    _planted_atlas(tmp_path / "build")
    support = A.collect(tmp_path / "build")
    finals = ["4.44.2", "4.52.4", "4.53.0", "4.53.1", "4.53.2", "5.24.0", "5.25.0"]
    gaps = A.sweep_gaps(support, finals, {})
    assert [(g["last_before"], g["first_after"], g["between"], g["model_types"]) for g in gaps] == [
        ("4.52.4", "5.24.0", ["4.53.0", "4.53.1", "4.53.2"], ["llama", "opt"])]
    leak, ok = _cell("llama", "sdpa", "isolation", "fail", "leak", 0.28), _cell("llama", "sdpa", "isolation", "pass")
    opt_leak, opt_pos = _cell("opt", "sdpa", "isolation", "fail", "leak", 0.1), _cell("opt", "sdpa", "isolation", "fail", "wrong_positions", 0.2)
    plan = {"4.53.0": [leak, opt_leak, _cell("qwen3", "sdpa", "isolation", "pass")], "4.53.1": [ok, opt_leak], "4.53.2": [ok, opt_pos]}
    calls: list = []
    monkeypatch.setattr(sweep, "run_release", _fake_release_run(plan, calls))
    records = A.sweep_transitions(support, tmp_path / "build", finals, log=lambda s: None)
    assert calls == [("4.53.0", ["llama", "opt"]), ("4.53.1", ["llama", "opt"]), ("4.53.2", ["llama", "opt"])]
    by = {k.split("|")[0]: r for k, r in records.items()}
    assert (by["llama"]["outcome"], by["llama"]["first"], by["llama"]["last"]) == ("found", "4.53.1", "4.53.0")
    assert by["llama"]["summary"] == "first fixed: 4.53.1 (last as before: 4.53.0); swept 3 releases between 4.52.4 and 5.24.0"
    assert (by["opt"]["outcome"], by["opt"]["first"], by["opt"]["last"]) == ("found", "4.53.2", "4.53.1")
    assert [s["verdict"] for s in by["opt"]["probes"]] == ["fail"] * 5 and by["opt"]["probes"][3]["causes"] == ["wrong_positions"]
    attached = A.collect(tmp_path / "build", bisects=records)
    t = next(t for t in attached["transitions"] if t["model_type"] == "llama")
    assert t["bisected"]["first"] == "4.53.1" and "found: first 4.53.1, last 4.53.0" in A.render_markdown(attached)
    calls.clear()  # resumed: placed transitions are not swept again
    assert A.sweep_transitions(support, tmp_path / "build", finals, done=records, log=lambda s: None) == records and not calls
    entries, record = A.measure_between("4.53.0", ["llama", "qwen3"], tmp_path / "build" / "sweep", log=lambda s: None)
    assert calls == [("4.53.0", ["qwen3"])] and record is not None and set(entries) == {"llama", "opt", "qwen3"}
    assert entries["llama"]["sdpa"]["verdict"] == "fail" and entries["qwen3"]["sdpa"]["verdict"] == "pass"
    # --bisect-models narrows; a gap with nothing between needs no run (the first release after is the answer)
    calls.clear()
    only = A.sweep_transitions(support, tmp_path / "build", ["4.52.4", "5.24.0"], models=["opt"], log=lambda s: None)
    assert list(only) == [k for k in records if k.startswith("opt|")] and not calls
    assert (only[next(iter(only))]["first"], only[next(iter(only))]["last"]) == ("5.24.0", "4.52.4")


def test_a_sweep_that_flips_or_misses_a_release_next_to_the_boundary_places_nothing():
    """Only a clean sequence (the before side, then the after side) is "found", which lookup trusts; a flip back
    and forth is not_monotonic and a release next to the boundary without an entry is unmeasured, each saying so."""
    t = {"model_type": "llama", "backend": "sdpa", "last_before": "4.52.4", "first_after": "5.24.0",
         "before": {"verdict": "fail", "causes": ["leak"]}, "after": {"verdict": "pass", "causes": []}}
    bad, good = {"verdict": "fail", "causes": ["leak"]}, {"verdict": "pass", "causes": []}
    flip = A.place(t, [("4.52.4", bad), ("4.53.0", good), ("4.53.1", bad), ("4.53.2", good), ("5.24.0", good)])
    assert (flip["outcome"], flip["first"], flip["last"]) == ("not_monotonic", "4.53.2", "4.53.1")
    assert "not monotonic: 4.52.4 fail, 4.53.0 pass, 4.53.1 fail" in flip["summary"]
    gap = A.place(t, [("4.52.4", bad), ("4.53.0", bad), ("4.53.1", None), ("4.53.2", good), ("5.24.0", good)])
    assert (gap["outcome"], gap["first"], gap["last"]) == ("unmeasured", "4.53.2", "4.53.0")
    assert gap["summary"].endswith("not measured next to the boundary: 4.53.1")
    far = A.place(t, [("4.52.4", bad), ("4.53.0", None), ("4.53.1", bad), ("4.53.2", good), ("5.24.0", good)])
    assert far["outcome"] == "found" and far["first"] == "4.53.2"  # an unmeasured release away from the boundary


# ----------------------------------------------------------------------------------------------------------------
# lookup


@pytest.fixture
def support_file(tmp_path):
    _planted_atlas(tmp_path / "build")
    A.write_outputs(A.collect(tmp_path / "build"), tmp_path / "out")
    return tmp_path / "out" / "support.json"


def test_lookup_measured_unknown_architecture_and_a_release_between_two_measured(support_file):
    hit = lookup("llama", "sdpa", "4.52.4", path=support_file)
    assert hit.measured and hit.verdict == "fail" and hit.causes == ["leak"] and hit.number == 0.28 and hit.measured_at == "4.52.4"
    assert "transformers==4.52.4" in hit.reproduce and "leak" in str(hit)
    unknown = lookup("llamma", "sdpa", "5.24.0", path=support_file)
    assert not unknown.measured and "Did you mean 'llama'" in " ".join(unknown.notes)
    between = lookup("llama", "sdpa", "4.56.2", path=support_file)
    assert not between.measured and [(n["transformers"], n["verdict"], n["side"]) for n in between.nearest] == [
        ("4.52.4", "fail", "below"), ("5.24.0", "pass", "above")]
    assert "changes between 4.52.4 and 5.24.0" in " ".join(between.notes) and "not measured" in str(between)
    above = lookup("opt", "sdpa", "5.30.0", path=support_file)
    assert [n["transformers"] for n in above.nearest] == ["5.24.0"]
    flash = lookup("llama", "flash_attention_2", "5.24.0", "0.24.0", path=support_file)
    assert flash.measured and flash.backend == "packcheck_flash_ref" and any("no TRL axis" in n for n in flash.trl["notes"])


def test_lookup_between_two_measured_releases_uses_the_bisect_that_places_the_transition(tmp_path):
    """llama / sdpa leaks on 4.52.4 and passes on 5.24.0; a bisect found the fix in 4.53.1 (last bad 4.53.0):
    4.56.2 gets the good side's verdict "from bisect", 4.53.0 the bad side's, a release the bisect does not place
    (between its last and first: 4.53.1 here when the bisect jumped to 4.53.2) and a transition without a bisect stay
    "not measured" with both neighbours; neighbours that agree say so; an unknown architecture names the closest."""
    _planted_atlas(tmp_path / "build")
    key = "llama|sdpa|4.52.4|5.24.0"
    found = {"outcome": "found", "first": "4.53.1", "last": "4.53.0", "cell": "llama-sdpa-isolation-float32", "cause": None,
             "file": "reports/atlas/bisect/llama.json", "summary": "first fixed: 4.53.1 (last bad: 4.53.0)"}
    A.write_outputs(A.collect(tmp_path / "build", bisects={key: found}), tmp_path / "out")
    path = tmp_path / "out" / "support.json"
    after = lookup("llama", "sdpa", "4.56.2", path=path)
    assert not after.measured and after.answered and after.verdict == "pass" and after.measured_at == "5.24.0"
    assert "bisect of llama-sdpa-isolation-float32: first 4.53.1, last 4.53.0" in after.inferred_from
    assert "not measured at this release: from bisect" in str(after) and [n["transformers"] for n in after.nearest] == ["4.52.4", "5.24.0"]
    for version in ("4.53.1", "5.0.0rc1"):
        assert lookup("llama", "sdpa", version, path=path).verdict == "pass"
    before = lookup("llama", "sdpa", "4.53.0", path=path)
    assert before.verdict == "fail" and before.causes == ["leak"] and before.measured_at == "4.52.4" and before.number == 0.28
    # the bisect's first and last are not adjacent (4.53.1 yanked, say): 4.53.1 is not placed
    A.write_outputs(A.collect(tmp_path / "build", bisects={key: {**found, "first": "4.53.2"}}), tmp_path / "gap")
    gap = lookup("llama", "sdpa", "4.53.1", path=tmp_path / "gap" / "support.json")
    assert not gap.answered and gap.verdict is None and "its bisect does not place it (last 4.53.0, first 4.53.2)" in " ".join(gap.notes)
    # no bisect, or one that found no patch: not measured, both neighbours named
    A.write_outputs(A.collect(tmp_path / "build", bisects={key: {**found, "outcome": "endpoints"}}), tmp_path / "nofind")
    for folder, why in (("out", None), ("nofind", "its bisect found no patch (endpoints)")):
        answer = lookup("opt" if why is None else "llama", "sdpa", "4.56.2", path=tmp_path / folder / "support.json")
        assert not answer.answered and [(n["transformers"], n["side"]) for n in answer.nearest] == [("4.52.4", "below"), ("5.24.0", "above")]
        assert ("not bisected yet" if why is None else why) in " ".join(answer.notes)
    agree = lookup("llama", "packcheck_flash_ref", "4.56.2", path=path)
    assert not agree.answered and "both neighbours agree (pass)" in " ".join(agree.notes)
    unknown = lookup("llamma", "sdpa", "4.56.2", path=path)
    assert not unknown.answered and not unknown.nearest and "Did you mean 'llama'" in " ".join(unknown.notes)
    cli = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "lookup", "llama", "sdpa", "4.56.2", "--support-file", str(path)],
                         capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert cli.returncode == 0 and "pass" in cli.stdout.splitlines()[0] and "from bisect" in cli.stdout


def test_lookup_bad_inputs_are_one_line_errors(support_file, tmp_path):
    with pytest.raises(PackcheckUsageError, match="transformers version 'new' is not a version"):
        lookup("llama", "sdpa", "new", path=support_file)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "packcheck-atlas-support", "schema_version": 99}))
    with pytest.raises(PackcheckUsageError, match="version 99; this packcheck reads"):
        lookup("llama", "sdpa", "5.24.0", path=other)
    with pytest.raises(PackcheckUsageError, match="does not exist"):
        lookup("llama", "sdpa", "5.24.0", path=tmp_path / "missing.json")


def test_lookup_refuses_a_pass_its_own_number_contradicts(support_file, tmp_path):
    """Trial 14, 69: support.json edited to an isolation "pass" of 0.9 was answered "pass (isolation 9.0e-01)":
    the rule gate and merge apply to a results file (analysis.verdict_rules.pass_over_tolerance), against the tolerances
    the file records (or the shipped float32 ones for a file from before it recorded them); a pass with causes too."""
    doc = json.loads(support_file.read_text())
    assert doc["tolerances"]["isolation_atol"] == 1e-05  # recorded from the cells' own tolerances
    assert lookup("llama", "sdpa", "5.24.0", path=support_file).verdict == "pass"
    over = "is a pass whose isolation number 0.9 is above its tolerance isolation_atol 1e-05"
    for edit, said in ((lambda e: e.update(number=0.9), over),
                       (lambda e: e.update(causes=["leak"]), "is a pass with causes ['leak']"),
                       (lambda e: e.pop("number"), "is a pass with no isolation number"),  # trial 15, 91
                       (lambda e: e.update(number=-1.0), ".number is -1.0, not a finite number >= 0"),  # trial 17, 30
                       (lambda e: e.update(verdict="fail"), "is a fail that names no cause"),
                       # trial 15, 225: "fail [leak]" on an isolation number within its tolerance
                       (lambda e: e.update(verdict="fail", causes=["leak"]),
                        "is a fail whose isolation number 0 is within its tolerance isolation_atol 1e-05")):
        for recorded in (True, False):
            bad = json.loads(json.dumps(doc))
            edit(bad["cells"]["llama"]["sdpa"]["5.24.0"])
            if not recorded:
                del bad["tolerances"]
            path = tmp_path / f"bad-{recorded}.json"
            path.write_text(json.dumps(bad))
            with pytest.raises(PackcheckUsageError) as info:
                lookup("llama", "sdpa", "5.24.0", path=path)
            assert "cells.llama.sdpa['5.24.0']" + ("" if said.startswith(".") else " ") + said in str(info.value), str(info.value)
    loose = json.loads(json.dumps(doc))
    loose["tolerances"]["isolation_atol"] = 0.05  # measured under a looser tolerance: its pass stands
    loose["cells"]["llama"]["sdpa"]["5.24.0"]["number"] = 0.04
    (tmp_path / "loose.json").write_text(json.dumps(loose))
    assert lookup("llama", "sdpa", "5.24.0", path=tmp_path / "loose.json").verdict == "pass"


def test_lookup_names_the_measuring_date_not_the_render_date_and_a_case_slip(tmp_path):
    """Trial 14, 78: a re-render dated the file today and lookup quoted it as "packcheck atlas of <today>"; the
    answer now names the release's own measuring date (atlas-done.json's finished) and the file's render date as
    such. Trial 14, 67: `lookup LLaMA` got no suggestion (difflib is case-sensitive)."""
    _planted_atlas(tmp_path / "build")
    done = A.release_dir(tmp_path / "build", "5.24.0", None) / A.DONE_MARKER
    done.write_text(json.dumps({**json.loads(done.read_text()), "finished": "2026-11-30T12:00:00Z"}))
    A.write_outputs(A.collect(tmp_path / "build"), tmp_path / "out")
    path = tmp_path / "out" / "support.json"
    said = str(lookup("llama", "sdpa", "5.24.0", path=path))
    assert "measured at 5.24.0 (2026-11-30) on sdpa" in said and "packcheck atlas rendered " in said
    assert "measured at 4.52.4 on sdpa" in str(lookup("llama", "sdpa", "4.52.4", path=path))  # no date recorded: none said
    assert "Did you mean 'llama'?" in " ".join(lookup("LLaMA", "sdpa", "5.24.0", path=path).notes)


def test_lookup_on_the_committed_atlas_is_offline_and_light():
    """No torch / transformers import and the committed answer; its speed is measured by a script, not asserted."""
    code = textwrap.dedent("""
        import sys
        from pytest_packcheck.support import lookup
        a = lookup("llama", "sdpa", "5.24.0")
        print(a.measured, a.verdict, "torch" in sys.modules, "transformers" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    measured, verdict, torch_loaded, tf_loaded = proc.stdout.split()
    assert measured == "True" and verdict == "pass"
    assert torch_loaded == tf_loaded == "False"


def test_cli_lookup_exit_codes(support_file):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "lookup", *args, "--support-file", str(support_file)],
                              capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})

    ok = run("llama", "sdpa", "5.24.0")
    # the model path passes; the first line says whether every training path does (issue 41: a bare pass only then)
    assert ok.returncode == 0 and ok.stdout.startswith("llama / sdpa @ transformers 5.24.0: ")
    assert "model path: pass" in ok.stdout.splitlines()[0] or ok.stdout.startswith("llama / sdpa @ transformers 5.24.0: pass")
    assert run("llama", "sdpa", "4.56.2").returncode == 1
    bad = run("llama", "sdpa", "x.y")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "'x.y'" in bad.stderr


# ----------------------------------------------------------------------------------------------------------------
# known faults against the atlas


def test_every_known_fault_window_agrees_with_the_committed_atlas():
    """Each window of audit/known_faults.toml against what the atlas measured: inside the window a matching cell
    shows the cause, outside none of the fault's architectures does. A disagreement fails: correct the entry with
    the atlas as its evidence."""
    from pytest_packcheck.analysis.diagnose import load_known_faults

    support, faults = load_support(), load_known_faults()
    results = A.known_fault_agreement(support, faults)
    bad = [r for r in results if r["status"] == "disagrees"]
    assert not bad, bad
    checked = {r["id"] for r in results if r["status"] == "agrees"}
    assert {"cache-disables-packed-mask", "attention-mask-overrides-packing", "stateful-layers-mix-examples"} <= checked
    # every transformers window on an atlas check and backend is checked (on each release where a matching
    # architecture is measured): a new entry the atlas can see is never left out silently
    checkable = {f.id for f in faults if f.library == "transformers" and set(f.checks) & set(support["checks"])
                 and ("*" in f.backends or set(f.backends) & set(support["backends"]))}
    assert checked == checkable, checkable ^ checked
    assert all(r["why"] == "no matching (architecture, backend) measured" for r in results
               if r["id"] in checkable and r["status"] == "not_checkable")


def test_a_wrong_known_fault_window_disagrees_with_the_atlas(support_file):
    from pytest_packcheck.analysis.diagnose import KnownFault

    def fault(versions, archs=("*",)):
        return KnownFault("planted", "", "", "transformers", versions, archs, ("sdpa",), ("isolation",), "leak", "", "", "")

    support = load_support(support_file)
    # the leak is on 4.52.4 only: a window that ends before it, or one that claims 5.24.0, disagrees
    assert {r["release"]: r["status"] for r in A.known_fault_agreement(support, [fault("<4.53.1")])} == {
        "4.52.4": "agrees", "5.24.0": "agrees"}
    assert [r["release"] for r in A.known_fault_agreement(support, [fault(">=5.0")]) if r["status"] == "disagrees"] == ["4.52.4", "5.24.0"]
    # a named architecture that shows the cause outside the window
    wrong = A.known_fault_agreement(support, [fault(">=5.0", ("opt",))])
    assert [(r["release"], r["status"]) for r in wrong] == [("4.52.4", "disagrees"), ("5.24.0", "disagrees")]
    trl = KnownFault("t", "", "", "trl", "<0.21", ("*",), ("*",), ("sft",), "mask_override", "", "", "")
    assert A.known_fault_agreement(support, [trl])[0]["status"] == "not_checkable"


# ----------------------------------------------------------------------------------------------------------------
# the example workflow

FAKE_CHILD = '''#!{python}
"""Stand-in for a release environment's python: writes the results the atlas run would (llama leaks on sdpa
below 4.53.1, passes from it; opt is in shard 2 of 2)."""
import json, os, sys
from pathlib import Path
sys.path[:0] = [{tests!r}, {repo!r}]  # this checkout's packcheck (the real child links it through its overlay)
from test_atlas import _cell, _doc
from packaging.version import Version
args = sys.argv[1:]
report = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--packcheck-report-dir=")))
shard = next((a.split("=", 1)[1] for a in args if a.startswith("--packcheck-shard=")), "1/1")
version = os.environ["PACKCHECK_ENV_LABEL"].split("==")[1]
leak = Version(version) < Version("4.53.1")
cells = []
if shard in ("1/1", "1/2"):
    cells += [_cell("llama", "sdpa", "isolation", "fail" if leak else "pass", "leak" if leak else None, 0.28 if leak else 0.0)]
if shard in ("1/1", "2/2"):
    cells += [_cell("opt", "sdpa", "isolation", "fail", "leak", 0.1)]
report.mkdir(parents=True, exist_ok=True)
(report / "packcheck-matrix.json").write_text(json.dumps(_doc(version, cells)))
'''

SITE = '''
import os
from pathlib import Path
if os.environ.get("PACKCHECK_FAKE_ATLAS_ENV"):
    from pytest_packcheck.versions import envs
    def ensure_env(combo, log=None):
        v = combo.requirements[0].split("==")[1]
        return envs.VersionEnv(combo, Path("/nonexistent/env-" + v), Path(os.environ["PACKCHECK_FAKE_ATLAS_ENV"]),
                               {"transformers": v}, False, 0.0)
    envs.ensure_env = ensure_env
'''


def _workflow_commands() -> dict[str, list[str]]:
    import yaml

    workflow = yaml.safe_load((REPO / "examples" / "packcheck-atlas.yml").read_text())
    def packcheck_step(run: str) -> bool:  # the packcheck commands only: never the pip installs
        return run.lstrip().startswith("packcheck ") or "$(packcheck " in run

    return {name: [s["run"] for s in job["steps"] if "run" in s and packcheck_step(s["run"])]
            for name, job in workflow["jobs"].items()}, workflow


def test_example_atlas_workflow_plans_measures_shards_and_merges(tmp_path):
    """The packcheck commands of examples/packcheck-atlas.yml, as written, with the matrix expanded: the plan job
    reads the releases from a local index, each (release, shard) job measures through a stand-in environment, and
    the merge job renders reports/atlas/ with the transition and no missing release."""
    import http.server
    import threading

    commands, workflow = _workflow_commands()
    assert set(commands) == {"plan", "release", "merge"} and all(commands.values())
    index = tmp_path / "index" / "transformers"
    index.mkdir(parents=True)
    index.joinpath("index.html").write_text(json.dumps({"files": [
        {"filename": f"transformers-{v}-py3-none-any.whl"} for v in ("4.52.3", "4.52.4", "4.53.3", "5.24.0")]}))
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"), **kw)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD.format(python=sys.executable, tests=str(Path(__file__).parent), repo=str(REPO)))
    child.chmod(0o755)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "PACKCHECK_FAKE_ATLAS_ENV": str(child),
           "PACKCHECK_INDEX_URL": f"http://127.0.0.1:{server.server_address[1]}", "GITHUB_OUTPUT": str(tmp_path / "gh-output"),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    (tmp_path / "bin").mkdir()
    shim = tmp_path / "bin" / "packcheck"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m pytest_packcheck.cli \"$@\"\n")
    shim.chmod(0o755)
    for tool in ("pip", "pip3", "uv"):  # nothing here may install anything
        guard = tmp_path / "bin" / tool
        guard.write_text("#!/bin/sh\necho 'the workflow test must not install' >&2\nexit 97\n")
        guard.chmod(0o755)

    def run(command):
        assert "pip " not in command, command
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, check=False, timeout=300)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    try:
        run(commands["plan"][0])
        releases = json.loads((tmp_path / "gh-output").read_text().strip().partition("=")[2])
        assert releases == ["4.52.4", "4.53.3", "5.24.0"]
        shards = workflow["jobs"]["release"]["strategy"]["matrix"]["shard"]
        for release in releases:
            for shard in shards:
                run(commands["release"][0].replace("${{ matrix.release }}", release).replace("${{ matrix.shard }}", shard))
        assert not (work / "reports" / "atlas").exists()  # the release jobs only measure
        run(commands["merge"][0])
    finally:
        server.shutdown()
    support = json.loads((work / "reports" / "atlas" / "support.json").read_text())
    assert support["missing"] == [] and [r["transformers"] for r in support["releases"]] == releases
    assert [(t["model_type"], t["last_before"], t["first_after"]) for t in support["transitions"]] == [("llama", "4.52.4", "4.53.3")]
    assert (work / "reports" / "atlas" / "atlas.html").exists() and (work / "reports" / "atlas" / "atlas.md").exists()


def test_cli_atlas_usage_errors_exit_2_with_one_line():
    for args, needle in ((["--list-releases"], "packcheck atlas needs the package index"),(["--releases", "4.44"], "names a minor"), (["--releases", "5.24.0", "--shard", "0/2"], "Bad shard '0/2'"),
                         (["--releases", "5.24.0", "--render-only", "--no-render"], "exclude each other")):
        proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "atlas", *args], capture_output=True, text=True,
                              check=False, env={**os.environ, "PYTHONPATH": str(REPO), "PACKCHECK_INDEX_URL": "http://127.0.0.1:9"})
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr


def test_committed_atlas_is_compact_and_names_what_is_missing():
    out = REPO / "reports" / "atlas"
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert total < 10 * 1024 * 1024, total
    support = load_support(out / "support.json")
    md = (out / "atlas.md").read_text()
    coverage = md[md.index("## Coverage"):md.index("## Per architecture")]  # the TRL axis has its own line further down
    assert support["releases"] and ("Not measured yet: none." in coverage) == (not support["missing"])
    for version in support["missing"]:
        assert version in md


# ----------------------------------------------------------------------------------------------------------------
# peers' claims, read from their wheels


def _wheel(path: Path, name: str, pin: str, files: dict[str, str]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\nRequires-Dist: transformers{pin}\n")
        for n, text in files.items():
            z.writestr(n, textwrap.dedent(text))
    return path


def test_claims_are_read_from_the_wheels_and_judged_against_the_atlas(tmp_path, support_file):
    from pytest_packcheck.atlas.claims import read_wheel, render_claims

    axolotl = read_wheel(_wheel(tmp_path / "axolotl.whl", "axolotl", "==5.24.0", {
        "axolotl/monkeypatch/multipack.py": 'SUPPORTED_MULTIPACK_MODEL_TYPES = ["llama", "opt", "nemotron_h", "qwen3"]\n',
        "axolotl/utils/schemas/enums.py": 'ATTN_IMPLS_SUPPORTING_PACKING = frozenset({"flash_attention_2", "flex_attention"})\n',
        "axolotl/monkeypatch/models/nemotron_h/modeling.py": "def f(seq_idx): pass\n",
        "axolotl/monkeypatch/models/qwen3/fused_attn.py": "def fused_norm(): pass\n"}))
    assert axolotl.transformers_pin == "==5.24.0" and [c.model_type for c in axolotl.claims] == ["llama", "opt", "nemotron_h", "qwen3"]
    assert [bool(c.own_code) for c in axolotl.claims] == [False, False, True, False]  # only a patch that touches packing
    factory = read_wheel(_wheel(tmp_path / "llamafactory.whl", "llamafactory", "<=5.30", {
        "llamafactory/data/collator.py": '''
            class C:
                def __post_init__(self):
                    if self.neat_packing and self.attn_implementation == "flash_attention_2":
                        if self.model_type in ["llama", "gpt_oss"]:
                            raise ValueError("Neat packing is not supported for llama, gpt_oss models for now.")
            '''}))
    assert [(c.model_type, c.supported, c.line) for c in factory.claims] == [("llama", False, 6), ("gpt_oss", False, 6)]
    md = render_claims([axolotl, factory], load_support(support_file))
    # the planted atlas: llama passes on packcheck_flash_ref, opt is not measured there, qwen3 only on sdpa
    assert "- packs llama, `axolotl/monkeypatch/multipack.py:1`: pass isolation 0.0e+00 at 5.24.0" in md
    assert "packs nemotron_h, `axolotl/monkeypatch/multipack.py:1`: rests on the peer's own code" in md
    assert "refuses llama (Neat packing is not supported for llama, gpt_oss models for now.), `llamafactory/data/collator.py:6`: " \
           "refused, and the atlas measures it as passing on stock transformers: pass" in md
    assert "judged at 5.24.0" in md and "axolotl 1.0" in md


def test_a_claim_on_a_leaking_model_does_not_hold(tmp_path):
    from pytest_packcheck.atlas.claims import read_wheel, render_claims

    build = tmp_path / "build"
    _write_release(build, "5.24.0", [_cell("gpt_oss", "packcheck_flash_ref", "isolation", "fail", "leak", 0.31)])
    support = A.collect(build)
    peer = read_wheel(_wheel(tmp_path / "axolotl.whl", "axolotl", "==5.24.0", {
        "axolotl/monkeypatch/multipack.py": 'SUPPORTED_MULTIPACK_MODEL_TYPES = ["gpt_oss"]\n',
        "axolotl/utils/schemas/enums.py": 'ATTN_IMPLS_SUPPORTING_PACKING = frozenset({"flash_attention_2"})\n'}))
    md = render_claims([peer], support)
    assert "**Claims that do not hold** (1):" in md and "packs gpt_oss, `axolotl/monkeypatch/multipack.py:1`: fail [leak] isolation 3.1e-01" in md
    with pytest.raises(PackcheckUsageError, match="no claims reader"):
        read_wheel(_wheel(tmp_path / "other.whl", "unknownpeer", "", {}))


def test_readme_packed_mask_finding_agrees_with_the_committed_atlas():
    """The docs' version finding "eager / sdpa ... no packed mask before 4.53.1 (bisected: 4.53.0 is the last
    without)" against the atlas: llama on sdpa leaks on every measured release below 4.53.1 (4.52.4 at least) and
    passes on every one from it (4.57.6 and 5.24.0 at least)."""
    from packaging.version import Version

    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    assert "no packed mask before 4.53.1" in " ".join(docs.split())
    row = load_support()["cells"]["llama"]["sdpa"]
    after = {v: e for v, e in row.items() if Version(v) >= Version("4.53.1")}
    before = {v: e for v, e in row.items() if Version(v) < Version("4.53.1")}
    assert {"4.57.6", "5.24.0"} <= set(after) and "4.52.4" in before
    assert all(e["verdict"] == "pass" for e in after.values()), after
    # on 4.44 loss_parity crashes (the forward takes no num_items_in_batch, as the docs say): an error verdict
    # that still names the leak the other checks measured
    assert all(e["verdict"] in ("fail", "error") and "leak" in e["causes"] for e in before.values()), before


def test_a_folder_not_named_as_a_release_is_skipped_not_sorted_against_releases(tmp_path):
    """A stray folder in the build dir (``x`` beside ``4.57.6``) is not a release: collect skips it (it used to be
    sorted against the releases' versions and raise TypeError)."""
    from pytest_packcheck.atlas.collect import _release_docs

    for name in ("x", "notes", "4.57.6", "5.24.0"):
        (tmp_path / name).mkdir()
    assert _release_docs(tmp_path) == []  # no folder is finished: nothing to reduce, and no TypeError


def test_the_committed_atlas_names_mamba_kernels_as_a_missing_package():
    """26 committed entries (jamba 4.44 .. 4.57, zamba 4.46 .. 5.5) once read shrunk_crash for "Fast Mamba kernels
    are not available" (mamba-ssm / causal-conv1d missing); a one-off migration (git history:
    scripts/atlas_reclassify_refusals.py) relabelled them as a new run writes them (runner.missing_package_message)."""
    support = json.loads((REPO / "reports" / "atlas" / "support.json").read_text())
    mamba = [(a, b, v, e) for a, by in support["cells"].items() for b, row in by.items() for v, e in row.items()
             if "Fast Mamba kernels" in e.get("message", "")]
    assert mamba and all(e["verdict"] == "skipped" and "mamba-ssm / causal-conv1d" in e["message"] for *_, e in mamba), mamba


def test_a_peer_package_without_the_file_its_reader_reads_is_a_claimless_entry_with_the_reason(tmp_path, support_file):
    """An axolotl wheel without axolotl/utils/schemas/enums.py raised KeyError out of the reader (a traceback of
    packcheck claims); now the peer is listed with no claims and the file named."""
    from pytest_packcheck.atlas.claims import read_wheel, render_claims

    peer = read_wheel(_wheel(tmp_path / "axolotl.whl", "axolotl", "==5.24.0", {
        "axolotl/monkeypatch/multipack.py": 'SUPPORTED_MULTIPACK_MODEL_TYPES = ["llama"]\n'}))
    assert peer.claims == [] and peer.reason == "file axolotl/utils/schemas/enums.py not in axolotl.whl (axolotl 1.0)"
    no_literal = read_wheel(_wheel(tmp_path / "axolotl2.whl", "axolotl", "==5.24.0", {"axolotl/monkeypatch/multipack.py": "X = 1\n"}))
    assert no_literal.claims == [] and "has no SUPPORTED_MULTIPACK_MODEL_TYPES literal" in no_literal.reason
    md = render_claims([peer], load_support(support_file))
    assert "## axolotl 1.0" in md and "No claims read: file axolotl/utils/schemas/enums.py not in axolotl.whl (axolotl 1.0)." in md


def test_verl_and_unsloth_claims_from_their_packages_sdist_included(tmp_path, support_file):
    """verl: remove padding for every model on the flash path (judged, the model types its monkey patch names
    excluded), those types on verl's own forward patch (not judged); unsloth: its padding-free blocklist (refusals,
    judged) and packing for the rest on its own varlen attention (not judged). An sdist reads as its wheel."""
    import io
    import tarfile

    from pytest_packcheck.atlas.claims import claim_groups, judge, read_wheel, render_claims

    verl_files = {
        "verl/workers/config/model.py": "class C:\n    use_remove_padding: bool = True\n",
        "verl/models/transformers/monkey_patch.py": '''
            def apply_monkey_patch(model, use_remove_padding=True):
                if model.config.model_type in ["qwen3", "qwen2_vl"]:
                    Q.forward = f
                elif model.config.model_type == "glm4v":
                    G.forward = g
                if use_remove_padding:
                    flash_attention._flash_attention_forward = h
            '''}
    sdist = tmp_path / "verl-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in {"PKG-INFO": "Name: verl\nVersion: 1.0\nRequires-Dist: transformers<=5.24.0\n", **verl_files}.items():
            data = textwrap.dedent(text).encode()
            info = tarfile.TarInfo(f"verl-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    verl = read_wheel(sdist)
    assert verl.transformers_pin == "<=5.24.0" and not verl.reason
    assert [(c.model_type, c.line, bool(c.own_code)) for c in verl.claims] == [("*", 2, False), ("qwen3", 3, True), ("qwen2_vl", 3, True), ("glm4v", 5, True)]
    assert "monkey_patch.py:8 replaces transformers' _flash_attention_forward" in verl.claims[0].note
    support = load_support(support_file)
    star = judge(verl.claims[0], support, "5.24.0", frozenset({"qwen3", "qwen2_vl", "glm4v"}))
    assert star["holds"] is True and {t for t, *_ in star["answers"]} == {"llama"}  # qwen3 (sdpa only) excluded anyway
    unsloth = read_wheel(_wheel(tmp_path / "unsloth.whl", "unsloth", "<=5.24.0", {
        "unsloth/trainer.py": 'PADDING_FREE_BLOCKLIST = {"gpt_oss", "llama"}\nblocked = (\n    False\n)\n',
        "unsloth/utils/hf_packed_attention.py": "def enable_hf_packed_attention(): pass\n"}))
    assert [(c.model_type, c.supported, c.line) for c in unsloth.claims] == [("*", True, 2), ("gpt_oss", False, 1), ("llama", False, 1)]
    groups = claim_groups([judge(c, support, "5.24.0") for c in unsloth.claims])
    assert [c["claim"].model_type for c in groups["Refused, and measured safe on stock transformers"]] == ["llama"]
    assert [c["claim"].model_type for c in groups["Rest on the peer's own patch or kernel"]] == ["*"]
    md = render_claims([verl, unsloth], support)
    assert "Sdist `verl-1.0.tar.gz`" in md and "Counts: 1 hold, 0 do not hold, 0 refused but measured safe, 3 rest on the peer's own patch or kernel" in md
    assert "Counts: 0 hold, 0 do not hold, 1 refused but measured safe, 1 rest on the peer's own patch or kernel, 1 not judged." in md


def test_cli_claims_checks_the_support_file_before_downloading(tmp_path):
    """A bad --support-file is a one-line usage error before any peer is downloaded (pip is a guard that fails
    the test if it runs); no package at all is one too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_INDEX_URL": "http://127.0.0.1:9"}
    for args, needle in ((["--download", "axolotl", "--download-dir", str(tmp_path / "peers"), "--support-file", str(tmp_path / "none.json")],
                          "does not exist"), ([], "needs peer packages")):
        proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "claims", *args], capture_output=True, text=True,
                              check=False, env=env, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "peers").exists()


def test_claims_download_names_each_peers_package_and_a_failure(tmp_path, monkeypatch):
    """--download: pip download --no-deps per peer; the file it saved (or one already there) is read; a peer pip
    cannot fetch is a one-line usage error naming it. pip stands in (no index)."""
    from pytest_packcheck.cli import claims as cli

    calls = []

    def pip(args, **kw):
        calls.append(args[3:])
        peer, dest = args[-1], Path(args[args.index("--dest") + 1])
        if peer == "nope":
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found for nope\n")
        if peer == "verl":  # pip found it already there
            return subprocess.CompletedProcess(args, 0, "File was already downloaded verl-0.9.1-py3-none-any.whl\n", "")
        (dest / "ms_swift-4.6.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(args, 0, f"Saved {dest}/ms_swift-4.6.0-py3-none-any.whl\n", "")

    monkeypatch.setattr(subprocess, "run", pip)
    (tmp_path / "verl-0.9.1-py3-none-any.whl").write_bytes(b"")
    got = cli.download(["ms-swift", "verl"], tmp_path)
    assert [p.name for p in got] == ["ms_swift-4.6.0-py3-none-any.whl", "verl-0.9.1-py3-none-any.whl"]
    assert calls[0] == ["download", "--no-deps", "--dest", str(tmp_path), "ms-swift"]
    with pytest.raises(PackcheckUsageError, match="Peer 'nope' .* could not be downloaded: ERROR: No matching distribution found for nope"):
        cli.download(["nope"], tmp_path)


def test_reduction_records_every_hazard_role_of_the_registry_and_no_finding():
    """A cell's ``hazards`` come from the registry's hazard role (a variant hazard such as offset_positions is kept
    when a run includes it), not from a retyped pair; a correctness check never lands there."""
    def cell(check, status, cause=None):
        return {"model": {"model_type": "llama"}, "backend": "sdpa", "dtype": "float32", "check": check, "status": status,
                "cause": cause, "message": "", "metrics": {}}

    reduced = A.reduce_release({"cells": [cell("isolation", "pass"), cell("offset_positions", "fail", "offset_positions"),
                                          cell("mask_trap", "pass"), cell("position_ids", "pass")]})
    assert reduced["llama"]["sdpa"]["hazards"] == {"offset_positions": "offset_positions"}
    assert reduced["llama"]["sdpa"]["verdict"] == "pass"


def test_reduction_keeps_a_failing_checks_further_causes():
    """roberta on 4.49.0: logits_parity fails with causes [leak, wrong_positions]; the headline names leak, and the
    entry keeps wrong_positions among its findings (it was dropped, so the known fault
    roberta-positions-without-position_ids_start read as "not seen" inside its window)."""
    def cell(check, status, causes=()):
        return {"model": {"model_type": "roberta"}, "backend": "eager", "dtype": "float32", "check": check, "status": status,
                "cause": causes[0] if causes else None, "causes": [{"cause": c, "evidence": {}} for c in causes],
                "message": "", "metrics": {}}

    entry = A.reduce_release({"cells": [cell("isolation", "fail", ["leak"]),
                                        cell("logits_parity", "fail", ["leak", "wrong_positions"])]})["roberta"]["eager"]
    assert entry["causes"] == ["leak"] and entry["findings"] == ["wrong_positions"]
    assert A.shows(entry, "wrong_positions")


def test_an_entry_message_over_160_characters_is_cut_at_a_word_with_an_ellipsis():
    """A long failure message is stored cut at a word boundary and ended with "…" (it was cut at exactly 160
    characters mid-word / mid-sentence: "... they hold "), by the one function both atlas reductions use."""
    from pytest_packcheck.atlas import trl as T
    from pytest_packcheck.atlas.plan import MESSAGE_CHARS

    words = "the varlen path drops cu_seqlens so packed examples attend across their boundaries, and they hold "
    long = (words * 3).strip()
    cell = {"model": {"model_type": "qwen2_vl"}, "backend": "packcheck_flash_ref", "dtype": "float32",
            "check": "isolation", "status": "fail", "cause": "leak", "message": long, "metrics": {}}
    got = A.reduce_release({"cells": [cell]})["qwen2_vl"]["packcheck_flash_ref"]["message"]
    assert len(got) <= MESSAGE_CHARS and got.endswith("…")
    assert long.startswith(got[:-1]) and long[len(got) - 1] == " "  # the cut falls on a space, not inside a word
    trl_cell = dict(cell, backend="sdpa", check="sft", model={"model_type": "llama"})
    assert T.reduce_trl_release({"cells": [trl_cell]})["llama"]["sft"]["sdpa"]["message"] == got
    short = dict(cell, message="leaks   across\nexamples")
    assert A.reduce_release({"cells": [short]})["qwen2_vl"]["packcheck_flash_ref"]["message"] == "leaks across examples"


def test_atlas_refuses_a_release_the_index_does_not_have(monkeypatch, capsys):
    """``--releases 4.99.0`` is refused before any environment is built, naming the nearest releases; an
    unreachable index is a warning (the build then says what it cannot install)."""
    from pytest_packcheck.analysis import bisect
    from pytest_packcheck.cli import atlas as cli_atlas

    page = {"files": [{"filename": f"transformers-{v}-py3-none-any.whl"} for v in ("4.57.6", "5.0.0", "5.24.0")]}
    monkeypatch.setattr(bisect, "fetch_index_page", lambda library: page)
    cli_atlas._refuse_unreleased(["5.0.0", "5.24.0"])
    with pytest.raises(PackcheckUsageError, match=r"Release '4\.99\.0' \(from --releases\) is not a transformers release .* "
                                                  r"nearest are 4\.57\.6, 5\.0\.0, 5\.24\.0"):
        cli_atlas._refuse_unreleased(["5.24.0", "4.99.0"])

    def unreachable(library):
        raise PackcheckUsageError("The package index cannot be reached")

    monkeypatch.setattr(bisect, "fetch_index_page", unreachable)
    cli_atlas._refuse_unreleased(["4.99.0"])
    assert "not checked against the package index" in capsys.readouterr().err


@pytest.mark.parametrize("trl", [False, True])
def test_atlas_since_past_every_release_is_refused_naming_the_newest(monkeypatch, capsys, trl):
    """`pc atlas --since 9.0 --list-releases` printed [] with rc 0: an empty plan said nothing."""
    from pytest_packcheck.analysis import bisect
    from pytest_packcheck.cli import main

    library, versions = ("trl", ("0.19.1", "1.16.0")) if trl else ("transformers", ("4.57.6", "5.24.0"))
    newest = versions[-1]
    page = {"files": [{"filename": f"{library}-{v}-py3-none-any.whl"} for v in versions]}
    monkeypatch.setattr(bisect, "fetch_index_page", lambda lib: page)
    code = main(["atlas", *(["--trl"] if trl else []), "--since", "9.0", "--list-releases"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert f"No {library} release on the package index matches --since 9.0" in captured.err
    assert f"the newest there is {newest}" in captured.err


@pytest.mark.parametrize(("args", "needle"), [
    # --list-releases checks what a measuring run checks: --releases against the index, --shard, every --seed
    (["--releases", "99.0.0", "--list-releases"], ("Release '99.0.0' (from --releases) is not a transformers release on the "
                                                   "package index (final, not yanked): the nearest are 5.0.0, 5.24.0")),
    (["--releases", "5.24.0", "--shard", "5/2", "--list-releases"], "Bad shard '5/2' (from --shard): write I/N with 1 <= I <= N"),
    (["--seed", "{bad}", "--list-releases"], "Results file {bad} (from --seed) is not valid JSON"),
    (["--seed", "{missing}", "--list-releases"], "(from --seed) does not exist"),
    # an empty value is never "every release / model" (README)
    (["--releases", "", "--list-releases"], "Empty value '' for --releases (from the command line)"),
    (["--models", "", "--list-releases"], "Empty value '' for --models"),
    (["--bisect-models", ",", "--bisect", "--render-only"], "Empty value ',' for --bisect-models"),
    # a --bisect-models type nothing knows bisected nothing and said nothing
    (["--render-only", "--bisect", "--bisect-models", "nosuchmodel"], "Unknown model type 'nosuchmodel' (from --bisect-models)"),
    (["--render-only", "--bisect", "--bisect-models", "llama,qwen3,lama"], "Did you mean 'llama'?"),
])
def test_atlas_checks_every_flag_whatever_the_mode(monkeypatch, capsys, tmp_path, args, needle):
    from pytest_packcheck.analysis import bisect
    from pytest_packcheck.cli import main

    page = {"files": [{"filename": f"transformers-{v}-py3-none-any.whl"} for v in ("4.57.6", "5.0.0", "5.24.0")]}
    monkeypatch.setattr(bisect, "fetch_index_page", lambda library: page)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    subs = {"{bad}": str(bad), "{missing}": str(tmp_path / "missing.json")}
    args = [subs.get(a, a) for a in args]
    code = main(["atlas", *args, "-o", str(tmp_path / "out"), "--build-dir", str(tmp_path)])
    captured = capsys.readouterr()
    needle = subs.get(needle, needle).replace("{bad}", str(bad))
    assert code == 2 and needle in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.out == ""
    assert main(["atlas", "--releases", "5.24.0", "--shard", "1/2", "--list-releases"]) == 0  # a release the index has
    assert capsys.readouterr().out.strip() == '["5.24.0"]'


def test_sweep_gaps_come_cheapest_first():
    """A gap with no release between costs no run and goes first; then by releases between x architectures."""
    def t(name, lo, hi):
        return {"model_type": name, "backend": "sdpa", "last_before": lo, "first_after": hi,
                "before": {"verdict": "fail", "causes": ["leak"]}, "after": {"verdict": "pass", "causes": []}}
    support = {"transitions": [t("llama", "4.44.2", "4.45.2"), t("opt", "4.44.2", "4.45.2"), t("llama", "4.57.6", "5.0.0"),
                               t("qwen2", "5.0.0", "5.1.1")]}
    finals = ["4.44.2", "4.45.0", "4.45.1", "4.45.2", "4.57.6", "5.0.0", "5.1.0", "5.1.1"]
    assert [(g["last_before"], len(g["between"])) for g in A.sweep_gaps(support, finals, {})] == [
        ("4.57.6", 0), ("5.0.0", 1), ("4.44.2", 2)]


def test_a_gap_spanning_a_planned_release_not_yet_measured_waits_and_each_placed_gap_is_saved(tmp_path, monkeypatch):
    """While the atlas still lacks 4.53.3, the gap 4.52.4 .. 5.24.0 would be split by it: the sweep leaves that gap
    (and says which release it waits for) and sweeps the others; ``save`` gets the records after every gap, so a
    sweep killed after the first gap keeps it."""
    from pytest_packcheck.atlas import sweep

    def t(name, lo, hi):
        return {"model_type": name, "backend": "sdpa", "last_before": lo, "first_after": hi,
                "before": {"verdict": "fail", "causes": ["leak"]}, "after": {"verdict": "pass", "causes": []}}
    support = {"transitions": [t("llama", "4.52.4", "5.24.0"), t("opt", "4.44.2", "4.45.2"), t("qwen2", "4.57.6", "5.0.0")],
               "missing": ["4.53.3"]}
    finals = ["4.44.2", "4.45.0", "4.45.2", "4.52.4", "4.53.3", "4.57.6", "5.0.0", "5.24.0"]
    assert [g["last_before"] for g in A.sweep_gaps(support, finals, {})] == ["4.57.6", "4.44.2"]
    assert A.deferred_gaps(support) == [("4.52.4", "5.24.0", ["4.53.3"])]
    monkeypatch.setattr(sweep, "measure_between", lambda *a, **k: ({}, None))
    saved, lines = [], []
    done = A.sweep_transitions(support, tmp_path, finals, log=lines.append, save=lambda d: saved.append(sorted(d)))
    assert sorted(done) == ["opt|sdpa|4.44.2|4.45.2", "qwen2|sdpa|4.57.6|5.0.0"]
    assert saved == [["qwen2|sdpa|4.57.6|5.0.0"], sorted(done)]
    assert lines[0] == "atlas sweep 4.52.4 .. 5.24.0: left until 4.53.3 is measured"
    support["missing"] = []  # once measured (here: not split after all) the gap is swept
    assert [g["last_before"] for g in A.sweep_gaps(support, finals, done)] == ["4.52.4"]


@pytest.mark.parametrize("axis", ["transformers", "trl"])
def test_a_release_folder_holding_only_a_corrupt_run_record_is_an_error_in_both_axes(tmp_path, capsys, axis):
    """Trial 5 #156: a release folder whose only file is a cut-off atlas-done.json (no matrix beside it) was skipped
    by --render-only in both axes: the release neither measured nor named, exit 0. A marker that is there is read
    (atlas.release_run.is_done, the one rule of both axes): one line naming it and the fix, exit 2."""
    from pytest_packcheck.cli import main

    out = tmp_path / "out"
    if axis == "trl":
        from tests.test_atlas_trl import PLANNED, _planted

        _planted_atlas(tmp_path / "build")
        A.write_outputs(A.collect(tmp_path / "build"), out)
        build, bad, flags = tmp_path / "trl", "0.22.2", ["--trl", "--releases", ",".join(PLANNED)]
        _planted(build)
    else:
        build, bad, flags = tmp_path / "build", "4.50.3", ["--releases", "4.50.3,5.24.0"]
        _write_release(build, "5.24.0", [_cell("llama", "sdpa", "isolation", "pass")])
    marker = build / bad / A.DONE_MARKER
    marker.parent.mkdir()
    marker.write_text("{")
    code = main(["atlas", "--render-only", *flags, "--build-dir", str(build), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"Atlas run record {marker} is not valid JSON" in err and "delete it" in err, err


@pytest.mark.parametrize("content", ["{", "[1, 2]\n", b"\xff\xfe"])
def test_a_corrupt_run_record_is_one_line_naming_the_file(tmp_path, capsys, content):
    """A release folder holding a valid matrix beside a cut-off atlas-done.json ended in a JSONDecodeError
    traceback through atlas/collect.py, exit 1 (trial 5, 155): one line naming the file and the fix, exit 2."""
    from pytest_packcheck.cli import main

    _write_release(tmp_path / "build", "5.24.0", [_cell("llama", "sdpa", "isolation", "pass")])
    marker = A.release_dir(tmp_path / "build", "5.24.0") / A.DONE_MARKER
    marker.write_bytes(content if isinstance(content, bytes) else content.encode())
    code = main(["atlas", "--render-only", "--releases", "5.24.0", "--build-dir", str(tmp_path / "build"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"Atlas run record {marker} is " in err and "delete it" in err


@pytest.mark.parametrize("axis", ["transformers", "trl"])
@pytest.mark.parametrize("liar", ["results file", "run record"])
def test_a_release_folder_whose_run_records_another_version_is_refused_in_both_axes(tmp_path, capsys, axis, liar):
    """Trial 10 #94: a 5.24.0 results file copied into build/4.57.6 (its atlas-done.json saying 4.57.6) was
    rendered as 4.57.6, and `lookup` answered "measured at 4.57.6". The file carries its version
    (atlas.release_run.check_recorded_version, the one rule of both axes): one line naming the folder, the file, both
    versions and the fix, exit 2; nothing rendered."""
    from pytest_packcheck.cli import main

    out = tmp_path / "out"
    if axis == "trl":
        from tests.test_atlas_trl import PLANNED, _planted, _write
        from tests.test_atlas_trl import _cell as _trl_cell

        _planted_atlas(tmp_path / "build")
        A.write_outputs(A.collect(tmp_path / "build"), out)
        build, library, folder_version, real, flags = tmp_path / "trl", "trl", "0.22.2", "0.24.0", ["--trl", "--releases", ",".join(PLANNED)]
        _planted(build)
        _write(tmp_path / "src", real, [_trl_cell("llama", "sdpa", "sft", "pass")])
        done = {"trl": real if liar == "run record" else folder_version}
    else:
        build, library, folder_version, real, flags = tmp_path / "build", "transformers", "4.57.6", "5.24.0", ["--releases", "4.57.6,5.24.0"]
        _write_release(tmp_path / "src", real, [_cell("llama", "sdpa", "isolation", "pass")])
        done = {"transformers": real if liar == "run record" else folder_version, "shard": [1, 1], "cells": 1}
    folder = build / folder_version
    folder.mkdir(parents=True)
    doc = read_results(tmp_path / "src" / real / "packcheck-matrix.json")
    if liar == "run record":  # the file is right, the marker names another release
        doc = json.loads(json.dumps(doc).replace(f'"{real}"', f'"{folder_version}"'))
    (folder / "packcheck-matrix.json").write_text(json.dumps(doc))
    (folder / A.DONE_MARKER).write_text(json.dumps(done))
    code = main(["atlas", "--render-only", *flags, "--build-dir", str(build), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    path = folder / ("packcheck-matrix.json" if liar == "results file" else A.DONE_MARKER)
    assert f"Atlas release folder {folder} is {library} {folder_version}, but {path} records {library} {real}: " in err, err
    assert f"move the run to the release folder named {real}" in err, err


def test_claims_answer_a_pinned_release_as_lookup_does_bisect_placements_included(tmp_path):
    """Trial 10 #96: a peer pinned to 4.56.2 was judged with 4.53.3's verdict (llama, opt "do not hold") while
    `packcheck lookup` at 4.56.2 answered pass for llama (a bisect places the fix in 4.54.0) and "not measured" for
    opt (a transition not bisected). Claims answer through support.answer_at, lookup's own rule: the two agree on
    every claim, and where lookup has no answer the claim is not judged, the nearest measured releases named."""
    from pytest_packcheck.atlas.claims import judge, read_wheel, render_claims

    flash = "packcheck_flash_ref"
    build = tmp_path / "build"
    _write_release(build, "4.53.3", [_cell("llama", flash, "isolation", "fail", "wrong_positions", 0.25),
                                     _cell("opt", flash, "isolation", "fail", "wrong_positions", 0.015)])
    _write_release(build, "4.57.6", [_cell("llama", flash, "isolation", "pass"), _cell("opt", flash, "isolation", "pass")])
    found = {"outcome": "found", "first": "4.54.0", "last": "4.53.3", "cell": f"llama-{flash}-isolation-float32", "cause": None,
             "file": "reports/atlas/bisect/llama.json"}
    A.write_outputs(A.collect(build, ["4.53.3", "4.56.2", "4.57.6"], {f"llama|{flash}|4.53.3|4.57.6": found}), tmp_path / "out")
    path = tmp_path / "out" / "support.json"
    support = load_support(path)
    peer = read_wheel(_wheel(tmp_path / "axolotl.whl", "axolotl", "==4.56.2", {
        "axolotl/monkeypatch/multipack.py": 'SUPPORTED_MULTIPACK_MODEL_TYPES = ["llama", "opt"]\n',
        "axolotl/utils/schemas/enums.py": 'ATTN_IMPLS_SUPPORTING_PACKING = frozenset({"flash_attention_2"})\n'}))
    for claim in peer.claims:  # one rule: the claim's answer is lookup's
        j, answer = judge(claim, support, "4.56.2"), lookup(claim.model_type, "flash_attention_2", "4.56.2", path=path)
        assert j["holds"] == (answer.verdict == "pass" if answer.answered else None), (j, str(answer))
    md = render_claims([peer], support)
    assert "**Claims that do not hold** (0):" in md, md
    assert ("- packs llama, `axolotl/monkeypatch/multipack.py:1`: pass isolation 0.0e+00 at 4.57.6, 4.56.2 placed on its side "
            f"by the bisect of llama-{flash}-isolation-float32: first 4.54.0, last 4.53.3") in md, md
    assert ("- packs opt, `axolotl/monkeypatch/multipack.py:1`: not judged: not measured at 4.56.2 (nearest measured: 4.53.3: "
            "fail [wrong_positions]; 4.57.6: pass); the verdict changes between 4.53.3 and 4.57.6") in md, md
    # a claim on every model: the answered ones judged, the rest counted as not judged with the nearest releases
    star = judge(A.claims.Claim("verl", "*", True, (flash,), "verl/x.py", 1), support, "4.56.2")
    assert star["holds"] is True and [t for t, *_ in star["answers"]] == ["llama"], star["why"]
    assert star["why"] == ("every measured model passes (1 more not measured at 4.56.2 (the nearest measured releases are "
                           "4.53.3 and 4.57.6): not judged)")


def test_lookup_says_why_a_backend_is_refused():
    """Trial 21, 12: `lookup mamba sdpa 5.24.0` printed "unsupported" and nothing else; the reason was only in
    --json. A verdict with no cause code carries its message; a cause code is said as before."""
    from pytest_packcheck.support import Answer

    refused = Answer("mamba", "sdpa", "5.24.0", True, verdict="unsupported", message="MambaForCausalLM does not\nsupport sdpa",
                     measured_at="5.24.0", backend="sdpa")
    assert refused.summary() == "unsupported (MambaForCausalLM does not support sdpa), measured at 5.24.0 on sdpa"
    leak = Answer("opt", "sdpa", "5.24.0", True, verdict="fail", causes=["leak"], message="moved 3e-1", measured_at="5.24.0",
                  backend="sdpa", check="isolation", number=0.3)
    assert leak.summary() == "fail [leak] (isolation 3.0e-01), measured at 5.24.0 on sdpa"
    assert "does not support" in str(lookup("mamba", "sdpa", "5.24.0"))  # the committed atlas's answer


def test_at_a_glance_says_a_finding_on_every_pass_of_a_backend_once():
    """The flash path's batch_rows finding sits beside each of its 104 passes on 5.24.0: said once for the backend,
    not as 104 names; a finding on some passes names them; the newest release is the one counted."""
    from pytest_packcheck.atlas.render import at_a_glance

    def e(verdict, causes=(), findings=()):
        return {"verdict": verdict, "causes": list(causes), "findings": list(findings)}
    support = {"releases": [{"transformers": "5.9.0"}, {"transformers": "5.24.0"}], "backends": ["sdpa", "packcheck_flash_ref"],
               "cells": {"llama": {"packcheck_flash_ref": {"5.24.0": e("pass", findings=["batch_rows"])},
                                   "sdpa": {"5.24.0": e("pass", findings=["num_items_ignored"]), "5.9.0": e("fail", ["leak"])}},
                         "qwen2": {"packcheck_flash_ref": {"5.24.0": e("pass", findings=["batch_rows"])}, "sdpa": {"5.24.0": e("pass")}},
                         "opt": {"sdpa": {"5.24.0": e("fail", ["leak"])}}}}
    text = "\n".join(at_a_glance(support))
    assert "## At a glance: transformers 5.24.0" in text and "| sdpa | 2 | 1 | 0 |" in text
    assert "- packcheck_flash_ref, batch rows (every one of the 2 passing)" in text
    assert "- sdpa, num items ignored (1): llama" in text and "- sdpa, leak (1): opt" in text
    assert at_a_glance({**support, "releases": []}) == []


def test_lookup_names_findings_answers_a_swept_release_as_measured_and_an_architecture_a_release_lacks(tmp_path):
    """The atlas review (helper, 2026-12-03): lookup printed "pass" for llama on flash_attention_4 where the entry
    holds the batch_rows finding; answered "not measured" at 4.53.1, which the sweep had run; and called qwen3 on a
    measured release that has no qwen3 a coverage gap. Now the findings ride along (each explained), a release the
    sweep ran is measured there (the sweep named), and a release without the architecture says so."""
    _planted_atlas(tmp_path / "build")
    _write_release(tmp_path / "build", "4.44.2", [_cell("llama", "sdpa", "isolation", "fail", "leak", 0.3)])
    key = "llama|sdpa|4.52.4|5.24.0"
    swept = A.place({"model_type": "llama", "backend": "sdpa", "last_before": "4.52.4", "first_after": "5.24.0",
                     "before": {"verdict": "fail", "causes": ["leak"]}, "after": {"verdict": "pass", "causes": []}},
                    [("4.52.4", {"verdict": "fail", "causes": ["leak"], "check": "isolation", "number": 0.28}),
                     ("4.53.0", {"verdict": "fail", "causes": ["leak"], "check": "isolation", "number": 0.27}),
                     ("4.53.1", {"verdict": "pass", "causes": [], "check": "isolation", "number": 0.0}),
                     ("5.24.0", {"verdict": "pass", "causes": [], "check": "isolation", "number": 0.0})])
    A.write_outputs(A.collect(tmp_path / "build", bisects={key: swept}), tmp_path / "out")
    path = tmp_path / "out" / "support.json"
    flash = lookup("llama", "flash_attention_4", "5.24.0", path=path)
    assert flash.verdict == "pass" and flash.findings == ["batch_rows"]
    assert "pass (isolation 0.0e+00) with finding batch_rows, measured at 5.24.0" in str(flash)
    assert any(n.startswith("finding batch_rows: two packed rows") for n in flash.notes)
    at = lookup("llama", "sdpa", "4.53.0", path=path)
    assert at.measured and at.measured_at == "4.53.0" and at.verdict == "fail" and at.number == 0.27
    assert "measured by the atlas's sweep of 4.52.4 .. 5.24.0" in " ".join(at.notes) and "transformers==4.53.0" in at.reproduce
    placed = lookup("llama", "sdpa", "4.56.2", path=path)  # not run by the sweep: placed on the after side
    assert not placed.measured and placed.answered and placed.verdict == "pass"
    assert placed.as_dict()["answered"] is True and placed.as_dict()["measured"] is False  # --json says which
    absent = lookup("qwen3", "sdpa", "4.52.4", path=path)
    assert not absent.answered and ("qwen3 is not among the architectures of transformers 4.52.4 (that release was "
                                    "measured); the atlas measures it from 5.24.0") in absent.notes
    with pytest.raises(PackcheckUsageError, match=r"the atlas measures [a-z_, ]+, and answers .*flash_attention_2.* from "
                                                  r"packcheck_flash_ref\. Did you mean 'sdpa'"):
        lookup("llama", "sdpaa", "5.24.0", path=path)


def test_a_seeded_release_is_footnoted_in_the_coverage_table():
    """5.24.0 read "| 5.24.0 | 215 | 18360 | — | — | — |" with no word why (atlas review, U5): a release seeded from
    another run is marked ² and the footnote names the run it came from."""
    support = {"generated": "2026-12-03", "packcheck_version": "0.1.0", "torch": "2.13.0+cpu", "backends": ["sdpa"],
               "checks": ["isolation"], "missing": [], "transitions": [],
               "releases": [{"transformers": "5.24.0", "architectures": 1, "cells": 3, "wall_s": None, "cpu_s": None,
                             "source": "seeded from reports/all-architectures/packcheck-matrix.json (packcheck audit -q)"}],
               "cells": {"llama": {"sdpa": {"5.24.0": {"verdict": "pass", "causes": [], "check": "isolation", "number": 0.0}}}}}
    md = A.render_markdown(support)
    assert "| 5.24.0 | 1 | 3 | — ² | — ² | — |" in md
    assert "² Seeded (`packcheck atlas --seed`)" in md and "5.24.0 (reports/all-architectures/packcheck-matrix.json" in md


def test_a_refusal_over_three_backends_is_judged_on_each_and_names_them(tmp_path):
    """The atlas review: unsloth's "refuses gpt_oss" (eager, sdpa and the flash path) was judged on eager alone and
    listed as holding, beside LLaMA-Factory's flash-only refusal of the same model listed as measured safe, neither
    naming a backend. Each backend with a verdict is judged and named: a refusal holds where packing fails on one
    of them; where every one passes it is refused-but-safe; a flash-only claim keeps its one answer unprefixed."""
    from pytest_packcheck.atlas.claims import Claim, judge

    build = tmp_path / "build"
    _write_release(build, "5.17.0", [_cell("gpt_oss", "eager", "isolation", "fail", "leak", 0.63),
                                     {**_cell("gpt_oss", "sdpa", "isolation", "unsupported"), "metrics": {}},
                                     _cell("gpt_oss", "packcheck_flash_ref", "isolation", "pass"),
                                     _cell("llama", "eager", "isolation", "pass"), _cell("llama", "sdpa", "isolation", "pass"),
                                     _cell("llama", "packcheck_flash_ref", "isolation", "pass")])
    support = A.collect(build)
    three = ("eager", "sdpa", "packcheck_flash_ref")
    gpt = judge(Claim("unsloth", "gpt_oss", False, three, "unsloth/trainer.py", 197), support, "5.17.0")
    assert gpt["holds"] is True and [b for _, b, _ in gpt["bad"]] == ["eager"]
    assert gpt["why"].startswith("eager: fail [leak] isolation 6.3e-01 at 5.17.0; sdpa: unsupported") and \
        "packcheck_flash_ref: pass isolation 0.0e+00 at 5.17.0" in gpt["why"]
    safe = judge(Claim("unsloth", "llama", False, three, "unsloth/trainer.py", 197), support, "5.17.0")
    assert safe["holds"] is False and safe["why"].count(": pass isolation") == 3
    flash = judge(Claim("llamafactory", "gpt_oss", False, ("packcheck_flash_ref",), "c.py", 1), support, "5.17.0")
    assert flash["holds"] is False and flash["why"] == "pass isolation 0.0e+00 at 5.17.0"


def test_a_release_made_with_an_override_carries_it_to_the_coverage_table(tmp_path):
    """The release record's overrides (from the environment's record, audit/env_overrides.toml) reach support.json
    and atlas.md's coverage table (³ and the reason)."""
    build = tmp_path / "build"
    _write_release(build, "5.25.0", [_cell("llama", "sdpa", "isolation", "pass")])
    done = A.release_dir(build, "5.25.0") / A.DONE_MARKER
    override = {"requirement": "kernels==0.17.2", "applies_to": "transformers>=5.25.0", "reason": "the index has kernels 0.17.2"}
    done.write_text(json.dumps({**json.loads(done.read_text()), "overrides": [override]}))
    support = A.collect(build)
    assert support["releases"][0]["overrides"] == [override]
    md = A.render_markdown(support)
    assert "| 5.25.0 | 1 |" in md and " ³ |" in md
    assert "³ Measured in an environment with a uv override from `audit/env_overrides.toml`" in md
    assert "5.25.0: `kernels==0.17.2` (the index has kernels 0.17.2)" in md


def test_release_runs_without_pytests_logging_plugin_and_the_checks_still_read_transformers_warnings(pytester, tmp_path):
    """The atlas's runs leave pytest's logging plugin out (issue 47: its per-item handlers); what the backend check
    reads of transformers' logger comes through packcheck's own handler, so a warning is still seen without it."""
    from pytest_packcheck.atlas.release_run import run_plugin_in_env

    seen = {}

    def runner(args, **kw):
        seen["args"] = args
        return subprocess.CompletedProcess(args, 0)

    run_plugin_in_env(sys.executable, "transformers==5.24.0", tmp_path, [], "r", runner=runner)
    assert seen["args"][seen["args"].index("no:logging") - 1] == "-p"
    pytester.makepyfile("""
        import logging

        from transformers.utils import logging as hf_logging

        from pytest_packcheck.checks.workbench import capture_warnings


        def test_warning_seen():
            with capture_warnings() as logged:
                hf_logging.get_logger("transformers.models.llama").warning("falling back to eager attention")
                logging.getLogger("elsewhere").warning("not transformers")
            assert logged == ["falling back to eager attention"]
    """)
    pytester.runpytest_subprocess("-p", "no:logging", "-p", "no:cacheprovider").assert_outcomes(passed=1)
