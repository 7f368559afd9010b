"""Models' cell children side by side, all forked from one process (run/sandbox.SideBySide, issue 47): groups run at
once, a crash still costs one cell, a child forked after a parallel region of the parent does not deadlock, and
`packcheck audit -n 2` runs them so (no xdist workers) with the verdicts of `-n 0`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from pytest_packcheck.results.schema import read_results

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


class _Cell:
    def __init__(self, cell_id: str) -> None:
        self.cell_id = cell_id


def _passed(cell):
    from pytest_packcheck.results.schema import CellResult

    return CellResult(cell_id=cell.cell_id, model={"id": "m", "label": "m"}, backend="sdpa", check="isolation",
                      dtype="float32", status="pass", metrics={"max_change": 0.0})


def _failure(cell, status, message, metrics):
    return SimpleNamespace(cell_id=cell.cell_id, status=status, message=message, metrics=metrics)


def _rendezvous(folder):
    """run_cell: cell "a" writes a and waits for b, cell "b" writes b and waits for a (30 s at most): both pass only
    when their children run at the same time."""
    def run_cell(cell):
        other = {"a": "b", "b": "a"}[cell.cell_id]
        (folder / cell.cell_id).write_text("here")
        deadline = time.monotonic() + 30
        while not (folder / other).exists():
            if time.monotonic() > deadline:
                os._exit(5)
            time.sleep(0.02)
        return _passed(cell)
    return run_cell


def test_two_groups_run_at_the_same_time(tmp_path):
    from pytest_packcheck.run.sandbox import SideBySide

    journaled = []
    pool = SideBySide([("m1", [_Cell("a")]), ("m2", [_Cell("b")])], _rendezvous(tmp_path), _failure, journaled.append,
                      timeout_s=120, jobs=2)
    first, second = pool.wait_for("m1"), pool.wait_for("m2")
    assert first["a"].status == "pass" and second["b"].status == "pass", (first, second)
    assert set(first) == {"a"} and set(second) == {"b"} and sorted(r.cell_id for r in journaled) == ["a", "b"]


def test_one_at_a_time_the_rendezvous_times_out(tmp_path):
    """The planted fault of the test above: one child at a time (jobs=1), cell a waits for b alone and is killed at
    the timeout; b then finds a's file and passes."""
    from pytest_packcheck.run.sandbox import SideBySide

    pool = SideBySide([("m1", [_Cell("a")]), ("m2", [_Cell("b")])], _rendezvous(tmp_path), _failure, lambda r: None,
                      timeout_s=2, jobs=1)
    assert pool.wait_for("m1")["a"].status == "timeout"
    assert pool.wait_for("m2")["b"].status == "pass"


def test_a_crash_costs_one_cell_of_its_group_and_the_other_group_runs_on():
    from pytest_packcheck.run.sandbox import SideBySide

    def run_cell(cell):
        if cell.cell_id == "b":
            os._exit(3)
        return _passed(cell)

    journaled = []
    pool = SideBySide([("m1", [_Cell("a"), _Cell("b"), _Cell("c")]), ("m2", [_Cell("d"), _Cell("e")]), ("m3", [])],
                      run_cell, _failure, journaled.append, timeout_s=120, jobs=2)
    first = pool.wait_for("m1")
    assert first["b"].status == "error" and "crashed (exit code 3)" in first["b"].message
    assert first["a"].status == first["c"].status == "pass" and set(first) == {"a", "b", "c"}
    second = pool.wait_for("m2")
    assert {k: v.status for k, v in second.items()} == {"d": "pass", "e": "pass"}
    # the JSON each child sent is what the parent journals and reports, the same text as the decoded result's to_json
    from pytest_packcheck.run.sandbox import result_json

    for result in (first["a"], second["d"]):
        assert result._wire_json and result_json(result) == result.to_json() == _passed(_Cell(result.cell_id)).to_json()
    first["a"].message = "changed after decoding"  # the sent text is the result as decoded: the session changes none
    assert result_json(first["a"]) != first["a"].to_json()
    assert pool.wait_for("m3") == {}
    assert sorted(r.cell_id for r in journaled) == ["a", "b", "c", "d", "e"]
    with pytest.raises(KeyError):
        pool.wait_for("m4")


#: Run in a fresh interpreter (an OpenMP team must not be left in a pytest worker that forks later): the parent
#: runs a parallel matmul on two threads, then cell children side by side, twice, each doing a parallel matmul.
_AFTER_A_PARALLEL_REGION = textwrap.dedent('''
    import json, sys, torch
    from types import SimpleNamespace
    from pytest_packcheck.results.schema import CellResult
    from pytest_packcheck.run.sandbox import SideBySide

    threads = None if sys.argv[1] == "inherit" else int(sys.argv[1])
    rounds, timeout = (2, 120) if threads else (1, 6)
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    (a @ a).sum()  # the parent's OpenMP team exists from here on

    class Cell:
        def __init__(self, cell_id):
            self.cell_id = cell_id

    def run_cell(cell):
        b = torch.randn(512, 512)
        value = float((b @ b).sum()) + float(torch.randn(100000).exp().sum())
        return CellResult(cell_id=cell.cell_id, model={"id": "m"}, backend="sdpa", check="isolation",
                          dtype="float32", status="pass", metrics={"value": value, "threads": torch.get_num_threads()})

    def failure(cell, status, message, metrics):
        return SimpleNamespace(cell_id=cell.cell_id, status=status, metrics={})

    seen = []
    for r in range(rounds):
        groups = [(f"g{g}", [Cell(f"r{r}g{g}c{c}") for c in range(2)]) for g in range(2 if threads else 1)]
        pool = SideBySide(groups, run_cell, failure, lambda res: None, timeout_s=timeout, jobs=2, child_threads=threads)
        for name, _ in groups:
            seen += [(cell_id, res.status, res.metrics.get("threads")) for cell_id, res in pool.wait_for(name).items()]
    print(json.dumps(seen))
''')


def _after_parallel_region(threads: str) -> list[list]:
    proc = subprocess.run([sys.executable, "-c", _AFTER_A_PARALLEL_REGION, threads], capture_output=True, text=True,
                          timeout=400, check=False, env={**os.environ, "OMP_NUM_THREADS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_children_forked_after_a_parallel_region_of_the_parent_run_twice_on_one_thread():
    """The CI deadlock of a059345 (a child forked from a process whose OpenMP team exists waits on a futex in its first
    parallel region): with child_threads=1 every cell of two rounds of two groups side by side passes, on one thread."""
    seen = _after_parallel_region("1")
    assert len(seen) == 8 and all(status == "pass" and threads == 1 for _, status, threads in seen), seen


def test_children_that_inherit_the_parents_threads_deadlock():
    """The planted fault: the children keep the parent's two threads (child_threads None) and hang in their first
    parallel region, killed at the 6 s timeout (libgomp, torch 2.13.0+cpu)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    seen = _after_parallel_region("inherit")
    assert [status for _, status, _ in seen] == ["timeout", "timeout"], seen


def _audit_ns(*argv: str) -> argparse.Namespace:
    from pytest_packcheck.cli import audit

    parser = argparse.ArgumentParser()
    audit.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, env, expected", [
    ((), {}, True),
    (("--packcheck-device", "cuda"), {}, False),
    ((), {"PACKCHECK_DEVICE": "cuda:0"}, False),
    (("--packcheck-isolation", "none"), {}, False),
    ((), {"PACKCHECK_ISOLATION": "none"}, False),
    (("--packcheck-versions", "transformers==5.24.0,5.25.0"), {}, False),
    (("--packcheck-weights", "pretrained"), {}, False),
    ((), {"PACKCHECK_WEIGHTS": "pretrained"}, False),
    (("--packcheck-weights", "random"), {}, True),
], ids=["cpu", "cuda", "cuda-env", "isolation-none", "isolation-none-env", "versions", "pretrained", "pretrained-env",
        "random"])
def test_the_audit_runs_children_side_by_side_on_cpu_only(monkeypatch, argv, env, expected):
    from pytest_packcheck.cli.audit import _side_by_side

    for name in ("PACKCHECK_DEVICE", "PACKCHECK_ISOLATION", "PACKCHECK_VERSIONS", "PACKCHECK_MODELS", "PACKCHECK_AUDIT",
                 "PACKCHECK_WEIGHTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _side_by_side(_audit_ns(*argv)) is expected


def test_audit_n2_runs_in_one_process_with_the_verdicts_of_n0(tmp_path):
    audit = tmp_path / "small.toml"
    audit.write_text('[audit]\nname = "small"\nmodels = ["arch:llama", "arch:opt", "arch:gpt2"]\nbackends = ["sdpa"]\n'
                     'checks = ["isolation", "logits_parity"]\n')
    verdicts = {}
    for workers in ("0", "2"):
        out = tmp_path / f"n{workers}"
        proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--audit", str(audit), "-n", workers,
                               "--packcheck-report-dir", str(out)], cwd=tmp_path, capture_output=True, text=True,
                              check=False, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "workers" not in proc.stdout, proc.stdout  # xdist's "2 workers [6 items]": none started
        doc = read_results(out / "packcheck-matrix.json")
        verdicts[workers] = {c["cell_id"]: (c["status"], c.get("cause")) for c in doc["cells"]}
        journal = [json.loads(line)["cell"]["cell_id"] for line in (out / "packcheck-journal.jsonl").read_text().splitlines()]
        assert sorted(journal) == sorted(verdicts[workers])
    assert len(verdicts["2"]) == 6 and verdicts["2"] == verdicts["0"]
    assert verdicts["2"]["opt-sdpa-isolation-float32"][0] == "fail" and verdicts["2"]["llama-sdpa-isolation-float32"][0] == "pass"


@pytest.mark.parametrize("settings, model_files", [(None, None), ({"lengths": [11, 17, 5], "b": {"z": 1, "a": [2]}}, None),
                                                   ({"x": "é"}, {"/m": "abc123"})], ids=["bare", "settings", "files"])
def test_a_journal_line_is_the_sorted_json_of_the_record_with_its_tail_made_once(tmp_path, settings, model_files):
    """The journal serialises what follows the cell once per run (issue 47); each line is still exactly
    json.dumps of the whole record with sorted keys, and reads back."""
    from pytest_packcheck.run.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", "fp1", settings, model_files, shared=False)
    cells = [json.loads(_passed(_Cell(f"c{i}")).to_json()) for i in range(3)]
    for cell in cells:
        journal.append(json.dumps(cell))
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    expected = [json.dumps({"fingerprint": "fp1", "cell": cell, **({"settings": settings} if settings is not None else {}),
                            **({"model_files": model_files} if model_files else {})}, sort_keys=True) for cell in cells]
    assert lines == expected
    assert list(Journal(tmp_path / "j.jsonl", "fp1").load()) == ["c0", "c1", "c2"]
    assert not (tmp_path / "j.jsonl.lock").exists()  # one writer: no lock file per line
    journal.fp = "fp2"  # a changed fingerprint is on the next line, not the cached one
    journal.append(json.dumps(cells[0]))
    assert json.loads((tmp_path / "j.jsonl").read_text().splitlines()[-1])["fingerprint"] == "fp2"
    Journal(tmp_path / "k.jsonl", "fp1").append(json.dumps(cells[0]))  # shared (xdist workers): locked
    assert (tmp_path / "k.jsonl.lock").exists()


def test_close_kills_the_children_still_running():
    """pytest -x stops the run after a failing cell: the session's release kills the children of the next models at
    once (no 5 s join each, no orphan)."""
    from pytest_packcheck.run.sandbox import SideBySide

    def run_cell(cell):
        if cell.cell_id == "slow":
            time.sleep(120)
        return _passed(cell)

    pool = SideBySide([("m1", [_Cell("a")]), ("m2", [_Cell("slow")])], run_cell, _failure, lambda r: None,
                      timeout_s=300, jobs=2)
    assert pool.wait_for("m1")["a"].status == "pass"
    child = pool.running["m2"].proc
    assert child.is_alive()
    t0 = time.monotonic()
    pool.close(kill=True)
    assert not child.is_alive() and time.monotonic() - t0 < 4 and not pool.running


def test_an_audit_stopped_by_x_with_children_side_by_side_is_incomplete(tmp_path):
    """`packcheck audit -n 2 -- -x`: opt's failing isolation stops the run while llama's child may still run; the
    matrix is incomplete, gpt2 (never started) is not run, and the audit ends without waiting on the children."""
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:opt,arch:llama,arch:gpt2",
                           "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "2", "-q",
                           "--packcheck-report-dir", str(tmp_path / "out"), "--", "-x"], cwd=tmp_path, capture_output=True,
                          text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = read_results(tmp_path / "out" / "packcheck-matrix.json")
    assert doc["incomplete"]["reason"] == "the run stopped early (stopping after 1 failures)", doc["incomplete"]
    cells = {c["model"]["label"]: c for c in doc["cells"]}
    assert cells["opt"]["status"] == "fail"
    assert cells["gpt2"]["status"] == "skipped" and cells["gpt2"]["metrics"]["not_run"] == "interrupted"
