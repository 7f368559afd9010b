"""An audit that survives: planted crashes, hangs and OOMs cost one cell each; a SIGKILLed audit resumes
without recomputing or losing a finished cell; no token or home path reaches an output file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_packcheck.results.schema import read_results
from pytest_packcheck.run.journal import Journal

pytest_plugins = ["pytester"]

# Loaded by the audit under test (pytester's conftest): plants faults into the check functions by model_type,
# and logs every check that really runs (to prove that resume recomputes nothing).
FAULTS_CONFTEST = '''
import json, os, time
import pytest_packcheck.checks.registry as R

_load = R.CheckSpec.load


def _wrap(name, fn):
    def check(bench):
        model_type = bench.config.model_type
        with open(os.environ["PACKCHECK_TEST_RUNLOG"], "a") as fh:
            fh.write(json.dumps([model_type, bench.backend, name]) + "\\n")
        if name == "isolation":
            if model_type == "gpt2":
                os.abort()
            if model_type == "gpt_neox":
                time.sleep(3600)
            if model_type == "qwen2":
                raise MemoryError("planted: cannot allocate 64 GiB")
        if model_type == "llama" and os.environ.get("PACKCHECK_TEST_SLOW"):
            time.sleep(float(os.environ["PACKCHECK_TEST_SLOW"]))
        return fn(bench)
    return check


def _planted_load(self):
    return _wrap(self.name, _load(self))


R.CheckSpec.load = _planted_load
'''

MODELS = "arch:llama,arch:opt,arch:gpt2,arch:gpt_neox,arch:qwen2"


def _cells(path: Path) -> dict[str, dict]:
    return {c["cell_id"]: c for c in read_results(path / "packcheck-matrix.json")["cells"]}


def test_crash_hang_oom_each_cost_one_cell(pytester, tmp_path, monkeypatch):
    pytester.makeconftest(FAULTS_CONFTEST)
    monkeypatch.setenv("PACKCHECK_TEST_RUNLOG", str(tmp_path / "runlog.jsonl"))
    result = pytester.runpytest_subprocess(
        f"--packcheck-models={MODELS}", "--packcheck-attn=sdpa", "--packcheck-checks=isolation,logits_parity",
        "--packcheck-timeout=8", "-p", "no:cacheprovider", f"--packcheck-report-dir={tmp_path / 'out'}")
    cells = _cells(tmp_path / "out")
    assert len(cells) == 10
    crashed = cells["gpt2-sdpa-isolation-float32"]
    assert crashed["status"] == "error" and "SIGABRT" in crashed["message"], crashed["message"]
    hung = cells["gpt_neox-sdpa-isolation-float32"]
    assert hung["status"] == "timeout" and hung["metrics"]["timeout_s"] == 8.0, hung["message"]
    oom = cells["qwen2-sdpa-isolation-float32"]
    assert oom["status"] == "oom" and oom["metrics"]["host_peak_rss_mib"] > 0 and "planted" in oom["message"]
    assert cells["opt-sdpa-isolation-float32"]["status"] == "fail"  # a real leak, measured
    # every other cell ran and is right, including the cells after each fault in the same model
    for model in ("llama", "gpt2", "gpt_neox", "qwen2"):
        assert cells[f"{model}-sdpa-logits_parity-float32"]["status"] == "pass", model
    assert cells["llama-sdpa-isolation-float32"]["status"] == "pass"
    result.stdout.fnmatch_lines(["*packcheck summary*"])


def test_sigkill_then_resume_recomputes_nothing_and_loses_nothing(pytester, tmp_path):
    pytester.makeconftest(FAULTS_CONFTEST)
    out, runlog = tmp_path / "out", tmp_path / "runlog.jsonl"
    env = {**os.environ, "PACKCHECK_TEST_RUNLOG": str(runlog), "PACKCHECK_TEST_SLOW": "0.6"}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--packcheck-models=arch:llama,arch:opt",
            "--packcheck-attn=sdpa,eager", "--packcheck-checks=isolation,logits_parity,loss_parity",
            f"--packcheck-report-dir={out}"]
    proc = subprocess.Popen(args, cwd=pytester.path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = out / "packcheck-journal.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 3):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [json.loads(line)["cell"]["cell_id"] for line in journal.read_text().splitlines()]
    assert 3 <= len(done) < 12, "the kill should land halfway"
    assert not (out / "packcheck-matrix.json").exists()
    with open(journal, "a") as fh:  # a line cut off by the kill
        fh.write('{"fingerprint": "abc", "cell": {"cell_id": "llama-sd')
    runlog.write_text("")
    resumed = subprocess.run([*args, "--packcheck-resume", "-W", "always"], cwd=pytester.path, env=env,
                             capture_output=True, text=True, timeout=300, check=False)
    assert "skipped 1 unreadable line" in resumed.stdout + resumed.stderr
    cells = _cells(out)
    assert len(cells) == 2 * 2 * 3  # nothing lost
    recomputed = {f"{m}-{b}-{c}-float32" for m, b, c in map(json.loads, runlog.read_text().splitlines())}
    assert not recomputed & set(done), "a finished cell was computed again"
    assert recomputed | set(done) == set(cells)


def test_journal_skips_cut_lines_and_other_fingerprints(tmp_path):
    def cell(cell_id):
        return json.dumps({"cell_id": cell_id, "status": "pass", "model": {"label": "m"}, "backend": "sdpa",
                           "check": "isolation", "dtype": "float32", "metrics": {"max_change": 0.0}})

    journal = Journal(tmp_path / "j.jsonl", "fp1")
    journal.reset()
    journal.append(cell("a"))
    Journal(tmp_path / "j.jsonl", "other").append(cell("b"))
    with open(tmp_path / "j.jsonl", "a") as fh:
        fh.write('{"fingerprint": "fp1", "cell": {"cell_')
    journal.append(cell("c"))  # after a cut-off line: starts on a new line
    with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
        assert list(journal.load()) == ["a", "c"]


def test_incomplete_run_is_marked_and_resume_has_a_short_flag():
    from pytest_packcheck.cli import _parser
    from pytest_packcheck.report import render_markdown

    ns = _parser().parse_args(["audit", "--resume", "--timeout", "30"])
    assert ns.packcheck_resume is True and ns.packcheck_timeout == "30"
    doc = {"environment": {}, "settings": {}, "cells": [], "incomplete": {"reason": "the run was interrupted", "cells": 17,
                                                                          "resume": "rerun the same command with --packcheck-resume"}}
    assert "Incomplete: the run was interrupted after 17 cells" in render_markdown(doc)


def test_no_token_or_home_path_in_any_output_file(pytester, tmp_path, monkeypatch):
    token = "hf_" + "Zq7" * 8
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", token)
    model_dir = Path.home() / ".cache" / "packcheck-test-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512).save_pretrained(model_dir)
    pytester.makeconftest(f'''
def pytest_configure(config):
    import warnings
    warnings.warn("token in a message: {token}")
''')
    out = tmp_path / "out"
    pytester.runpytest_subprocess(f"--packcheck-models={model_dir},arch:llama", "--packcheck-attn=sdpa",
                                  "--packcheck-checks=isolation", "-p", "no:cacheprovider", f"--packcheck-report-dir={out}")
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"packcheck-matrix.md", "packcheck-matrix.json", "packcheck-journal.jsonl"}
    for path in written:
        text = path.read_text(errors="replace")
        assert token not in text, path
        assert str(Path.home()) + "/" not in text, path
    assert "~/.cache/packcheck-test-model" in (out / "packcheck-matrix.json").read_text()


def test_a_token_typed_as_a_model_spec_is_not_echoed_to_the_terminal(monkeypatch):
    """A token pasted where a model ID belongs (a legal legacy Hub ID) used to show in every test id and in the
    usage error: both are scrubbed now, as the files already were."""
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.specs import parse_model_spec

    token = "hf_" + "Kp4" * 8
    monkeypatch.setenv("HF_TOKEN", token)
    spec = parse_model_spec(token + "{clip_qkv=8}", "--packcheck-models")
    assert spec.label == "***{clip_qkv=8}"
    assert parse_model_spec("org/llama", "t").label == "org/llama"  # nothing else is touched
    with pytest.raises(PackcheckUsageError) as info:
        parse_model_spec(token + "@", "--packcheck-models")
    assert token not in str(info.value) and "'***@'" in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--packcheck-versions=transformers==4.5x"], "Unparsable version specifier 'transformers==4.5x' (from --packcheck-versions)*"),
        (["--packcheck-versions=torch==2.5.1"], "'torch' (from --packcheck-versions) is bound to this machine's hardware*"),
        (["--packcheck-timeout=soon"], "Bad timeout 'soon' (from --packcheck-timeout)*"),
        (["--packcheck-isolation=thread"], "Unknown isolation mode 'thread' (from --packcheck-isolation)*"),
    ],
)
def test_usage_errors_of_versions_timeout_isolation(pytester, args, message):
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", *args, "-p", "no:cacheprovider")  # words only
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: " + message])


def test_gated_model_without_token_is_one_line(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    class Response:  # what huggingface_hub's error constructors read
        status_code, headers, url, request = 401, {}, "https://huggingface.co/x", None

    def gated(*args, **kwargs):
        raise hub_errors.GatedRepoError("Access to model meta-llama/Llama-3.1-8B is restricted.", response=Response())

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    with pytest.raises(PackcheckUsageError, match=r"^Model 'meta-llama/Llama-3.1-8B' \(from --packcheck-models\) is gated: .*HF_TOKEN"):
        resolve_model(parse_model_spec("meta-llama/Llama-3.1-8B", "--packcheck-models"), "--packcheck-models")


def test_resume_names_the_settings_the_journaled_cells_were_made_with(tmp_path):
    """Trial U13 (#196): a second --resume with other lengths said "changed since the previous matrix: lengths
    [11, 1, 13] -> [11, 2, 13]" of 50 cells made with the default lengths. Each journal line carries its run's
    settings; the warning compares those with this run's."""
    import json as _json
    from types import SimpleNamespace

    from conftest import planted_cell

    from pytest_packcheck.run.journal import Journal
    from pytest_packcheck.run.resume import resume_mismatch

    path = tmp_path / "packcheck-journal.jsonl"
    Journal(path, "default", {"lengths": [11, 17, 5]}).append(_json.dumps(planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0)))
    (tmp_path / "packcheck-matrix.json").write_text(_json.dumps({"settings": {"lengths": [11, 1, 13]}}))
    now = SimpleNamespace(report_dir=str(tmp_path), as_dict=lambda: {"lengths": [11, 2, 13]})
    journal = Journal(path, "other")
    assert journal.load() == {} and journal.other_cells == 1
    line = resume_mismatch(now, journal, 0, 1)
    assert "lengths [11, 17, 5] -> [11, 2, 13]" in line and "[11, 1, 13]" not in line, line


_SIGINT_AT_FORK = {"armed": False}


def _sigint_in_parent_after_fork() -> None:
    if _SIGINT_AT_FORK["armed"]:
        _SIGINT_AT_FORK["armed"] = False
        os.kill(os.getpid(), signal.SIGINT)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_sigint_in_parent_after_fork)


class _Cell:
    def __init__(self, cell_id: str) -> None:
        self.cell_id = cell_id


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs fork")
def test_a_ctrl_c_landing_during_the_fork_of_a_cell_child_stops_the_run():
    """Trial 6, #102: a SIGINT to the audit's process group that lands while ``os.fork`` runs its at-fork
    handlers was printed as an unraisable exception and lost: the run finished, exit 0, complete matrix. The
    planted handler sends SIGINT from inside the parent's at-fork callback, where it used to be swallowed."""
    from pytest_packcheck.results.schema import CellResult
    from pytest_packcheck.run.sandbox import run_isolated

    def run_cell(cell):
        return CellResult(cell_id=cell.cell_id, model={"id": "m"}, backend="sdpa", check="isolation",
                          dtype="float32", status="pass")

    seen = []
    # Ctrl-C as the audit's controller handles it (an xdist worker running this test ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _SIGINT_AT_FORK["armed"] = True
    try:
        with pytest.raises(KeyboardInterrupt):
            run_isolated([_Cell("a"), _Cell("b")], run_cell, lambda *a: None, seen.append, timeout_s=60)
    finally:
        _SIGINT_AT_FORK["armed"] = False
        restored = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
    assert restored is signal.default_int_handler, "the parent did not put its SIGINT handler back"


def _planted_cells(fault):
    """run_cell and make_failure for :func:`run_isolated` with ``fault`` planted in cell "b" (run in the child)."""
    from types import SimpleNamespace

    from pytest_packcheck.results.schema import CellResult

    def run_cell(cell):
        if cell.cell_id == "b":
            fault()
        return CellResult(cell_id=cell.cell_id, model={"id": "m"}, backend="sdpa", check="isolation",
                          dtype="float32", status="pass")

    def make_failure(cell, status, message, metrics):
        return SimpleNamespace(cell_id=cell.cell_id, status=status, message=message, metrics=metrics)

    return run_cell, make_failure


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


def _die_by(sig):
    def fault():
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)  # the child dies by the signal itself (WIFSIGNALED), no handler runs
        os.kill(os.getpid(), sig)
        time.sleep(60)
    return fault


def _send(sig):
    def fault():
        os.kill(os.getpid(), sig)  # to the busy child, as `kill <pid>` from `top` does: its handler runs
        time.sleep(60)
    return fault


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("fault, name", [
    (_send(signal.SIGTERM), "SIGTERM"), (_send(signal.SIGINT), "SIGINT"), (_send(signal.SIGHUP), "SIGHUP"),
    (_raise_keyboard_interrupt, "SIGINT"), (_die_by(signal.SIGTERM), "SIGTERM"), (_die_by(signal.SIGINT), "SIGINT"),
], ids=["kill-TERM", "kill-INT", "kill-HUP", "KeyboardInterrupt", "killed-by-TERM", "killed-by-INT"])
def test_a_cell_child_stopped_by_an_interrupt_leaves_its_cells_not_run_not_crashed(fault, name):
    """Trial 14, #123: a SIGINT / SIGTERM to the forked per-model child (the busy python process a user sees in
    `top`) was recorded as "error: crash: the isolated child crashed (exit code 70)", remedy "report it upstream".
    Now the cell it ran and the child's remaining cells are not run (interrupted), named by the signal, and are
    not journaled, so --packcheck-resume runs them."""
    from pytest_packcheck.run.sandbox import run_isolated

    run_cell, make_failure = _planted_cells(fault)
    journaled = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as the audit's controller has it
    try:
        results = run_isolated([_Cell("a"), _Cell("b"), _Cell("c")], run_cell, make_failure, journaled.append,
                               timeout_s=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert results["a"].status == "pass"
    for cell_id in ("b", "c"):
        cell = results[cell_id]
        assert cell.status == "skipped" and cell.metrics["not_run"] == "interrupted", cell
        assert cell.metrics["signal"] == name and f"stopped by {name}" in cell.message, cell.message
        assert "crash" not in cell.message.replace("not a crash", "")
    assert [r.cell_id for r in journaled] == ["a"], "an unfinished cell was journaled: a resume would not rerun it"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("fault, how", [
    (lambda: os._exit(3), "exit code 3"), (_die_by(signal.SIGKILL), "killed by SIGKILL"),
    (_die_by(signal.SIGSEGV), "killed by SIGSEGV"), (lambda: os._exit(70), "exit code 70"),
], ids=["exit-3", "SIGKILL", "SIGSEGV", "exit-70"])
def test_a_cell_child_that_really_crashes_is_still_a_crash(fault, how):
    """The other side of #123: an exit, a segfault or a SIGKILL (what the OOM killer sends) stays an error of the
    cell it ran, and a new child runs the next cell. A SIGKILL comes from outside the model (issue 42): cause killed,
    never "report it upstream", and marked so the journal does not keep it (--packcheck-resume reruns it)."""
    from pytest_packcheck.run.sandbox import run_isolated

    run_cell, make_failure = _planted_cells(fault)
    journaled = []
    results = run_isolated([_Cell("a"), _Cell("b"), _Cell("c")], run_cell, make_failure, journaled.append,
                           timeout_s=60)
    assert results["b"].status == "error" and f"({how}" in results["b"].message, results["b"].message
    if how == "killed by SIGKILL":
        assert results["b"].cause == "killed" and results["b"].metrics["not_journaled"] == "killed"
        assert "killed from outside" in results["b"].message
    else:
        assert f"crashed ({how})" in results["b"].message and getattr(results["b"], "cause", None) is None
    assert "not_run" not in results["b"].metrics
    assert results["a"].status == results["c"].status == "pass"
    assert [r.cell_id for r in journaled] == ["a", "b", "c"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_timed_out_or_crashed_cell_records_the_seconds_it_ran():
    """Trial 19, 133: cells killed by --packcheck-timeout recorded duration_s 0.0 although each ran the whole
    limit; a sum of duration_s, or a search for the slow cells, missed exactly the slow ones. Now duration_s is the
    wall time until the kill (or the crash)."""
    from pytest_packcheck.run.sandbox import run_isolated

    run_cell, make_failure = _planted_cells(lambda: time.sleep(60))
    results = run_isolated([_Cell("a"), _Cell("b")], run_cell, make_failure, lambda r: None, timeout_s=0.5)
    hung = results["b"]
    assert hung.status == "timeout" and 0.5 <= hung.duration_s < 30 and hung.duration_s == pytest.approx(hung.metrics["waited_s"], abs=0.01)
    run_cell, make_failure = _planted_cells(lambda: (time.sleep(0.3), os._exit(3)))
    crashed = run_isolated([_Cell("b")], run_cell, make_failure, lambda r: None, timeout_s=60)["b"]
    assert crashed.status == "error" and 0.3 <= crashed.duration_s < 30


def test_interrupt_signal_reads_the_exit_code_not_the_text():
    from pytest_packcheck.run.sandbox import interrupt_signal

    assert interrupt_signal(-signal.SIGTERM) is signal.SIGTERM and interrupt_signal(128 + signal.SIGINT) is signal.SIGINT
    assert interrupt_signal(-signal.SIGHUP) is signal.SIGHUP
    for code in (None, 0, 1, 70, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGABRT, 128 + signal.SIGKILL):
        assert interrupt_signal(code) is None, code


STOP_CONFTEST = '''
import json, os, signal, time
import pytest_packcheck.checks.registry as R

_load = R.CheckSpec.load


def _planted_load(self):
    fn, name = _load(self), self.name

    def check(bench):
        model_type = bench.config.model_type
        with open(os.environ["PACKCHECK_TEST_RUNLOG"], "a") as fh:
            fh.write(json.dumps([model_type, bench.backend, name]) + "\\n")
        if name == "isolation" and model_type == "gpt2" and os.environ.get("PACKCHECK_TEST_STOP"):
            os.kill(os.getpid(), signal.SIGTERM)  # `kill <pid>` of the busy child, not of the audit
            time.sleep(60)
        return fn(bench)
    return check


R.CheckSpec.load = _planted_load
'''


def test_a_killed_cell_child_is_not_run_and_resume_runs_its_cells(pytester, tmp_path):
    """#123 end to end: the audit goes on with the other model, exits as a finished run (the audit itself was not
    interrupted), its matrix says "not run (interrupted)" for the child's cells, names SIGTERM, is marked
    incomplete, and --packcheck-resume runs exactly those cells."""
    pytester.makeconftest(STOP_CONFTEST)
    out, runlog = tmp_path / "out", tmp_path / "runlog.jsonl"
    env = {**os.environ, "PACKCHECK_TEST_RUNLOG": str(runlog)}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--packcheck-models=arch:gpt2,arch:llama",
            "--packcheck-attn=sdpa", "--packcheck-checks=isolation,logits_parity", f"--packcheck-report-dir={out}"]
    first = subprocess.run(args, cwd=pytester.path, env={**env, "PACKCHECK_TEST_STOP": "1"}, capture_output=True,
                           text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stdout[-2000:]
    doc = read_results(out / "packcheck-matrix.json")
    cells = {c["cell_id"]: c for c in doc["cells"]}
    stopped = ("gpt2-sdpa-isolation-float32", "gpt2-sdpa-logits_parity-float32")
    for cell_id in stopped:
        assert cells[cell_id]["status"] == "skipped" and cells[cell_id]["metrics"]["not_run"] == "interrupted"
        assert "SIGTERM" in cells[cell_id]["message"] and "crashed" not in cells[cell_id]["message"]
    assert cells["llama-sdpa-isolation-float32"]["status"] == "pass"
    assert cells["llama-sdpa-logits_parity-float32"]["status"] == "pass"
    assert doc["incomplete"]["reason"] == "the isolated child of gpt2 was stopped by SIGTERM"
    assert doc["incomplete"]["cells"] == 2
    matrix = (out / "packcheck-matrix.md").read_text()
    assert "not run" in matrix and "💥" not in matrix and "upstream" not in matrix
    journaled = {json.loads(line)["cell"]["cell_id"] for line in (out / "packcheck-journal.jsonl").read_text().splitlines()}
    assert not journaled & set(stopped)

    runlog.write_text("")
    resumed = subprocess.run([*args, "--packcheck-resume"], cwd=pytester.path, env=env, capture_output=True,
                             text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stdout[-2000:]
    ran = {f"{m}-{b}-{c}-float32" for m, b, c in map(json.loads, runlog.read_text().splitlines())}
    assert ran == set(stopped)
    doc = read_results(out / "packcheck-matrix.json")
    assert "incomplete" not in doc
    assert {c["cell_id"]: c["status"] for c in doc["cells"]}["gpt2-sdpa-isolation-float32"] != "skipped"
