"""Bad files, full disks, kills, secrets and absurd values (issue 28): each ends in one line naming the value, its
source and the fix (exit 2), or in a report set that is whole and scrubbed; never in a traceback, a stale file
beside a new one, or a token in any output."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.errors import PackcheckUsageError, PackcheckWarning
from pytest_packcheck.results.schema import read_results

REPO = Path(__file__).resolve().parents[1]
QUICK = ["--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0", "-q"]


def _cli(args, cwd, env=None, timeout=300, preexec_fn=None):
    """``packcheck ARGS``: in this process (tests/cli_inprocess.py) for the words, the exit code and the files written;
    in a fresh interpreter where the process is the point: a memory limit on it (``preexec_fn``), or secrets in its
    environment (``env``: nothing of them may leak into any output of a real run)."""
    if env is None and preexec_fn is None:
        return packcheck(*args, cwd=cwd)
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, env=env, timeout=timeout, preexec_fn=preexec_fn)


def _one_line(text: str, prefix: str) -> str:
    assert "Traceback" not in text and "INTERNALERROR" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def _cell(cell_id="llama-sdpa-isolation-float32", **over):
    cell = {"cell_id": cell_id, "model": {"label": "llama", "spec": "arch:llama", "model_type": "llama", "model_class": "LlamaForCausalLM"},
            "backend": "sdpa", "check": "isolation",
            "dtype": "float32", "status": "pass", "metrics": {"max_change": 0.0}, "message": "ok", "tolerances": {}}
    return {**cell, **over}


def _doc(cells, **top):
    return {"schema_version": 2, "environment": {"transformers": "5.24.0"}, "command": "packcheck audit",
            "settings": {"models": ["arch:llama"], "backends": ["sdpa"], "checks": ["isolation"], "dtypes": ["float32"]},
            "cells": cells, **top}


# ----------------------------------------------------------------------------------------------------------------
# Files a user hands over


@pytest.mark.parametrize("content, message", [
    (bytes(range(128, 256)) * 16, "is not UTF-8 text (byte 0 is 0x80)"),
    (json.dumps(_doc([_cell()], settings="x")).encode(), 'is corrupt: "settings" is "x" (expected a JSON object)'),
    (json.dumps(_doc([_cell()], environment=[1])).encode(), 'is corrupt: "environment" is [1] (expected a JSON object)'),
    (json.dumps(_doc([_cell()], settings={"backends": 3})).encode(), 'is corrupt: "settings"."backends" is 3 (expected a list of strings)'),
    (json.dumps(_doc([_cell()], incomplete=True)).encode(), 'is corrupt: "incomplete" is true (expected a JSON object'),
    # trial #111: a string version was reported as "has no schema_version: it was not written by packcheck"
    (json.dumps(_doc([_cell()], schema_version="2")).encode(), 'is corrupt: "schema_version" is "2" (a string, expected an integer'),
])
def test_a_bad_results_file_is_one_line_in_gate_and_merge(tmp_path, content, message):
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_bytes(content)
    good.write_text(json.dumps(_doc([_cell()])))
    for command, args, source in (("gate", ["--baseline", str(good), "--candidate", str(bad)], "--candidate"),
                                  ("merge", [str(bad), "-o", "out"], "packcheck merge's FILES")):
        proc = _cli([command, *args], tmp_path)
        assert proc.returncode == 2, proc.stderr
        line = _one_line(proc.stderr, f"packcheck {command}: error:")
        assert f"Results file {bad} (from {source}) {message}" in line  # the option it came from (issue 28)
    assert not (tmp_path / "out").exists()


def test_merge_of_one_file_given_twice_notes_it_and_counts_it_once(tmp_path):
    """`merge a.json a.json` said "merged 2 files, 4 cells": a forgotten second shard went unnoticed. The same
    file (by any path) is merged once, as a cell held twice with one verdict is one cell, and named on stderr."""
    (tmp_path / "r1").mkdir()
    one = tmp_path / "r1" / "packcheck-matrix.json"
    one.write_text(json.dumps(_doc([_cell()])))
    proc = _cli(["merge", str(one), "r1/../r1/packcheck-matrix.json", "-o", "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "merged 1 file, 1 cells into out" in proc.stdout, proc.stdout
    assert (f"packcheck merge: note: r1/../r1/packcheck-matrix.json is the same file as {one}, given twice: merged once"
            in proc.stderr), proc.stderr


def test_merge_of_files_without_cells_is_refused(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_doc([])))
    proc = _cli(["merge", "-o", "out", str(empty), str(empty)], tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert f"no cells to merge: {empty}, {empty} (packcheck merge's FILES) hold no cells" in _one_line(proc.stderr, "packcheck merge: error:")
    assert not (tmp_path / "out").exists()


def test_merge_into_an_audits_folder_removes_its_stale_journal(tmp_path):
    good, out = tmp_path / "good.json", tmp_path / "audit"
    good.write_text(json.dumps(_doc([_cell()])))
    out.mkdir()
    (out / "packcheck-journal.jsonl").write_text("{}\n")
    proc = _cli(["merge", "-o", str(out), str(good)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (out / "packcheck-journal.jsonl").exists() and (out / "packcheck-matrix.json").exists()
    assert f"removed {out / 'packcheck-journal.jsonl'}" in proc.stderr


def test_merge_of_some_shards_only_is_marked_incomplete(tmp_path):
    from pytest_packcheck.analysis.gate import merge

    settings = _doc([])["settings"]
    one = _doc([_cell()], settings={**settings, "shard": [1, 3]})
    two = _doc([_cell("gpt2-sdpa-isolation-float32")], settings={**settings, "shard": [2, 3]})
    merged = merge([one, two])
    assert merged["incomplete"]["reason"].startswith("shard 3 of 3 not merged") and "shard" not in merged["settings"]
    three = _doc([_cell("qwen2-sdpa-isolation-float32")], settings={**settings, "shard": [3, 3]})
    assert "incomplete" not in merge([one, two, three])
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    proc = _cli(["merge", "-o", "out", str(path)], tmp_path)
    assert proc.returncode == 0 and "the merged matrix is incomplete: shard 2, 3 of 3 not merged" in proc.stderr
    assert "Incomplete: shard 2, 3 of 3 not merged" in (tmp_path / "out" / "packcheck-matrix.md").read_text()


def test_merge_keeps_a_shards_incomplete_mark():
    from pytest_packcheck.analysis.gate import merge

    mark = {"reason": "the run was interrupted", "cells": 1, "resume": "rerun"}
    merged = merge([_doc([_cell()]), _doc([_cell("llama-sdpa-isolation-bfloat16", dtype="bfloat16")], incomplete=mark)],
                   ["a.json", "b.json"])
    # the interrupted file is named with its own finished cells and its own command to resume, not the merged
    # count and "rerun the same command" of a matrix that lists two commands (trial 4, 291)
    assert merged["incomplete"]["reason"] == "the run was interrupted (b.json)" and merged["incomplete"]["cells"] == 1
    assert merged["incomplete"]["resume"] == "rerun b.json's own command with --packcheck-resume, then merge again"
    assert merge([_doc([_cell()], incomplete=mark)])["incomplete"] == {**mark, "cells": 1}  # one file: as it was
    assert "incomplete" not in merge([_doc([_cell()]), _doc([_cell("llama-sdpa-isolation-bfloat16", dtype="bfloat16")])])


def test_a_device_given_as_a_file_is_refused_not_read_for_ever(tmp_path):
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.results.schema import load_document

    with pytest.raises(PackcheckUsageError, match="Results file /dev/zero is not a regular file"):
        load_document("/dev/zero")
    with pytest.raises(PackcheckUsageError, match="Tolerance file /dev/zero is not a regular file .*pass a TOML file"):
        load_tolerances("/dev/zero", None, "--packcheck-tolerances")


def test_a_report_folder_that_is_a_symlink_loop_is_one_line(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    proc = _cli(["audit", "--models", "arch:llama", "--packcheck-report-dir", str(tmp_path / "a"), *QUICK], tmp_path)
    assert proc.returncode == 2
    assert f"{tmp_path / 'a'} is a broken or looping symlink: pass a folder with --packcheck-report-dir" in \
        _one_line(proc.stdout + proc.stderr, "ERROR:")


def test_a_keyword_that_deselects_every_cell_is_a_usage_error(tmp_path):
    proc = _cli(["audit", "--models", "arch:llama", *QUICK, "--", "-k", "zzznothing"], tmp_path)
    assert proc.returncode == 2  # was 3, "internal error", with no word
    assert "the pytest arguments -k zzznothing deselected every cell" in _one_line(proc.stderr, "packcheck audit: error:")


def _old_matrix(folder):
    from pytest_packcheck.report.formats import REPORT_FILES

    folder.mkdir(exist_ok=True)
    for name in REPORT_FILES:
        (folder / name).write_text("the previous run's")
        os.utime(folder / name, (1e9, 1e9))
    return [folder / name for name in REPORT_FILES]


def test_a_run_that_checks_nothing_removes_the_previous_matrix(tmp_path):
    old = _old_matrix(tmp_path / "reports")
    proc = _cli(["audit", "--models", "arch:llama", *QUICK, "--", "-k", "zzznothing"], tmp_path)
    assert proc.returncode == 2
    assert not any(p.exists() for p in old)  # was left in place, looking current
    said = proc.stdout + proc.stderr  # the plugin removes them and says so with the summary (run.session._nothing_ran)
    assert "no packcheck cell ran (deselected by -k 'zzznothing')" in said and "the previous packcheck-matrix.md" in said
    # set aside in reports/previous/ when the run took the folder (issue 42: one set, never beside a new journal)
    assert "were set aside in" in said and "deselected every cell of the matrix" in proc.stderr
    assert all((tmp_path / "reports" / "previous" / p.name).exists() for p in old)


def test_a_run_interrupted_before_its_session_removes_the_previous_matrix(tmp_path, monkeypatch, capsys):
    import pytest as real_pytest

    from pytest_packcheck.cli import main

    old = _old_matrix(tmp_path / "reports")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PACKCHECK_REPRODUCE", "")  # run() sets it for its pytest: restored after the test
    monkeypatch.setattr(real_pytest, "main", lambda *a, **k: real_pytest.ExitCode.INTERRUPTED)  # a kill during collection
    assert main(["audit", "--models", "arch:llama", *QUICK]) == 130
    assert not any(p.exists() for p in old)
    assert "the run interrupted before it wrote a matrix: the previous" in capsys.readouterr().err


def test_merge_onto_a_file_says_it_is_a_file(tmp_path):
    good, blocker = tmp_path / "good.json", tmp_path / "taken"
    good.write_text(json.dumps(_doc([_cell()])))
    blocker.write_text("x")
    proc = _cli(["merge", str(good), "-o", str(blocker / "sub")], tmp_path)
    assert proc.returncode == 2
    assert f"{blocker} is a file, not a folder: pass a folder with -o/--output-dir" in _one_line(proc.stderr, "packcheck merge: error:")


def test_a_binary_tolerance_or_audit_file_is_one_line(tmp_path):
    blob = tmp_path / "blob.toml"
    blob.write_bytes(bytes(range(128, 256)))
    for flag, what in (("--packcheck-tolerances", "Tolerance file"), ("--audit", "Audit file")):
        proc = _cli(["audit", *(["--models", "arch:llama"] if flag != "--audit" else []), flag, str(blob), *QUICK], tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _one_line(proc.stdout + proc.stderr, "ERROR:")
        assert f"{what} {blob} is not UTF-8 text (byte 0 is 0x80)" in line


def test_a_binary_length_file_for_bench_is_a_usage_error(tmp_path):
    from pytest_packcheck.run.throughput import sample_lengths

    blob = tmp_path / "lengths.txt"
    blob.write_bytes(b"\xff\xfe12\n")
    with pytest.raises(PackcheckUsageError, match=r"Length file \(from --profile\) .* is not UTF-8 text .*one length per line"):
        sample_lengths(str(blob), 4, 2048, source="--profile")


def test_a_process_memory_limit_is_one_line_naming_the_limit(tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (400000 * 1024, resource.RLIM_INFINITY))

    for args, prefix in ((["audit", "--models", "arch:llama", *QUICK], "ERROR:"), (["bench"], "packcheck bench: error:")):
        proc = _cli(args, tmp_path, preexec_fn=limit)
        assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
        line = _one_line(proc.stdout + proc.stderr, prefix)
        assert "could not load torch/transformers (ImportError" in line and "memory limit 400000 KiB (ulimit -v 400000)" in line


def test_load_failure_message_branches(monkeypatch):
    import resource

    from pytest_packcheck.errors import load_failure_message

    assert load_failure_message(ValueError("x")) is None
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    missing = load_failure_message(ImportError("No module named 'torch'"))
    assert "could not import a library it needs" in missing and "pip install" in missing
    assert "memory limit none" in load_failure_message(MemoryError())
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (512 * 1024 * 1024, resource.RLIM_INFINITY))
    assert "ulimit -v 524288" in load_failure_message(ImportError("No module named 'torch'"))


# ----------------------------------------------------------------------------------------------------------------
# Full disks


@pytest.fixture
def small_disk(tmp_path):
    """A folder on its own tmpfs (root only) and a function that sets its size in KiB; skipped where mount is
    not allowed."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=False, capture_output=True).returncode:
        pytest.skip("mount -t tmpfs is not allowed here")

    def resize(kib):
        subprocess.run(["mount", "-o", f"remount,size={kib}k", str(folder)], check=True)

    yield folder, resize
    subprocess.run(["umount", str(folder)], check=False)


def test_a_full_disk_at_start_is_one_line_and_leaves_no_owner_file(tmp_path, small_disk):
    disk, _ = small_disk
    (disk / "filler").write_bytes(b"\0" * 64 * 1024)
    proc = _cli(["audit", "--models", "arch:llama", "--packcheck-report-dir", str(disk / "r"), *QUICK], tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc.stdout + proc.stderr, "ERROR:")
    assert "the disk is full (No space left on device" in line and "pass a folder on another disk" in line
    assert not (disk / "r" / ".packcheck-run.json").exists() and not list((disk / "r").glob(".packcheck-probe*"))


def test_a_disk_that_fills_at_the_report_write_says_so_and_resume_leaves_no_temp_file(tmp_path, small_disk):
    disk, resize = small_disk
    resize(40)  # the start-up probe (32 KiB) and the journal fit; the four reports do not
    args = ["audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "--packcheck-report-dir", str(disk), "-n", "0", "-q"]
    proc = _cli(args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "INTERNALERROR" not in out and "the disk is full" in out and "pass a writable" not in out
    assert not list(disk.glob(".*.tmp")) and not (disk / "packcheck-matrix.json").exists()
    resize(1024)
    orphan = disk / ".packcheck-matrix.json.abc123.tmp"  # what a writer killed mid-write leaves
    orphan.write_text("{")
    again = _cli([*args, "--resume"], tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert not list(disk.glob(".*.tmp")) and read_results(disk / "packcheck-matrix.json")["cells"]


def test_write_set_on_a_full_disk_keeps_the_old_set_and_no_temp_file(tmp_path, monkeypatch):
    from pytest_packcheck.report.formats import write_reports

    write_reports(tmp_path, _doc([_cell()]))
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(PackcheckUsageError, match=r"packcheck-details.md: the disk is full \(No space left on device; \d+ KiB free\)"):
        write_reports(tmp_path, _doc([_cell(status="fail", message="new")]))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old


@pytest.mark.parametrize("code, says", [(errno.EACCES, "pass a writable -o"), (errno.EIO, "check the folder, or pass another one with -o"),
                                        (errno.EDQUOT, "the disk is full")])
def test_write_failure_names_what_went_wrong(tmp_path, code, says):
    from pytest_packcheck.results import write_failure

    assert says in write_failure(tmp_path / "x.json", OSError(code, os.strerror(code)), "-o")


def test_write_failure_names_the_file_that_failed(tmp_path):
    from pytest_packcheck.results import write_failure

    lock = tmp_path / "j.jsonl.lock"
    line = write_failure(tmp_path / "j.jsonl", OSError(errno.EISDIR, "Is a directory", str(lock)))
    assert line.startswith(f"Cannot write {lock} (Is a directory)")
    temp = tmp_path / ".x.md.abc.tmp"
    assert write_failure(tmp_path / "x.md", OSError(errno.EIO, "I/O error", str(temp))).startswith(f"Cannot write {tmp_path / 'x.md'} ")


def test_a_journal_that_cannot_be_written_is_named_once_and_the_run_goes_on(tmp_path, monkeypatch):
    from pytest_packcheck.run.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", "fp")
    journal.reset()

    def full(cell_json):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "_append", full)
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(3):
            journal.append(json.dumps(_cell(f"c{i}")))
    assert len(seen) == 1 and seen[0].category is PackcheckWarning and "the disk is full" in str(seen[0].message) and "--packcheck-resume would run them again" in str(seen[0].message)
    assert journal.failed is not None


def test_a_journal_reset_on_a_read_only_folder_is_a_usage_error(tmp_path, monkeypatch):
    from pytest_packcheck.run.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", "fp")

    def refuse(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(PackcheckUsageError, match="j.jsonl \\(Read-only file system\\): pass a writable --packcheck-report-dir"):
        journal.reset()


# ----------------------------------------------------------------------------------------------------------------
# A kill while the reports are written

_KILL_AT = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    from pytest_packcheck import results
    from pytest_packcheck.report import write_reports
    where, at = sys.argv[2], int(sys.argv[3])
    real = getattr(os, where)
    calls = []
    def killing(*a, **k):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    setattr(os, where, killing)
    write_reports(Path(sys.argv[1]), json.loads(sys.stdin.read()))
""")


@pytest.mark.parametrize("where, at", [("fsync", 2), ("fsync", 4), ("replace", 1), ("replace", 2), ("replace", 3), ("replace", 4)])
def test_a_kill_while_the_reports_are_written_never_leaves_new_beside_old(tmp_path, where, at):
    from pytest_packcheck.report.formats import FORMATS, write_reports

    write_reports(tmp_path, _doc([_cell()]))
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = _doc([_cell(status="fail", message="the new run", cause=None)])
    proc = subprocess.run([sys.executable, "-c", _KILL_AT, str(tmp_path), where, str(at)], input=json.dumps(new), text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == -9, proc.stderr
    present = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".tmp")}
    stale = sorted(name for name, data in present.items() if old.get(name) == data)
    # either the whole old set, or no old file at all beside what the new run wrote
    assert stale == sorted(old) or not stale, (stale, sorted(present))
    if where == "replace":  # killed after every temp file was written: the old set is gone
        assert not stale and ("packcheck-matrix.json" not in present or len(present) == len(FORMATS))
    write_reports(tmp_path, new)  # the next write cleans up what the killed one left
    assert not list(tmp_path.glob(".*.tmp"))


# ----------------------------------------------------------------------------------------------------------------
# Secrets

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
SHAPES = ["hf_" + "ZyXwVuTsRqPoNmLkJiHgFeDcBa987654", "ghp_" + "a1" * 18, "github_pat_" + "11AB" * 10, "sk-proj-" + "x1" * 12,
          "AKIA" + "ABCDEFGHIJ234567", "xoxb-" + "1234567890-abc", "glpat-" + "Ab1" * 7, "AIza" + "B" * 35,
          # trial 14, 149 / 150: shorter or digit-free ones a user types as a stand-in were echoed
          "sk-" + "AbCdEfGhIjKlMnOpQr", "ghp_" + "AbCdEfGhIjKl", "hf_" + "AbCdEfGhIj", "sk-proj-" + "abcdefghijklmnopqrst"]


@pytest.mark.parametrize("token", SHAPES)
def test_token_shapes_are_scrubbed_wherever_they_stand(token):
    from pytest_packcheck.errors import scrub_secrets

    assert scrub_secrets(f"arch:llama{{api_token={token}}} and '{token}'") == "arch:llama{api_token=***} and '***'"


@pytest.mark.parametrize("text", ["task-specific-finetuning-model-2024", "hf-internal-testing/tiny-random-LlamaForCausalLM",
                                  "ghp_short", "AKIA123", "scikit-learn sk-learn", "rope_scaling", "hf_transfer",
                                  "hf_hub_download", "sk-learn-compatible-estimators", "HF_HUB_ENABLE_HF_TRANSFER"])
def test_ordinary_text_is_not_scrubbed(text):
    from pytest_packcheck.errors import scrub_secrets

    assert scrub_secrets(text) == text


def test_secret_named_variables_are_scrubbed_by_value_in_warnings(monkeypatch):
    from pytest_packcheck.errors import scrub_secrets

    monkeypatch.setenv("MY_SERVICE_KEY", "plainvalue42")
    monkeypatch.setenv("DB_PASSWORD", "hunter2hunter2")
    assert scrub_secrets("a plainvalue42 b hunter2hunter2") == "a *** b ***"
    assert str(PackcheckWarning("tok=plainvalue42")) == "tok=***"


def test_no_secret_reaches_the_terminal_a_report_the_journal_or_the_owner_file(tmp_path):
    secrets = {"HF_TOKEN": HF, "MY_SERVICE_KEY": "plainvalue42"}
    typed = SHAPES[0]
    for models_flag in (["--models", f'arch:llama{{api_token="{typed}"}}'], []):
        out = tmp_path / ("flag" if models_flag else "env")
        env = {**secrets, **({} if models_flag else {"PACKCHECK_MODELS": f"arch:llama{{hub_token={typed}}}"})}
        proc = _cli(["audit", *models_flag, "--packcheck-config", f"tok={HF}", "--packcheck-config", f"other={SHAPES[1]}",
                     "--packcheck-config", "k=plainvalue42", "--packcheck-report-dir", str(out),
                     "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0"], tmp_path, env=env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        outputs = {"stdout": proc.stdout, "stderr": proc.stderr,
                   **{p.name: p.read_text() for p in out.iterdir() if p.is_file() and not p.name.endswith(".lock")}}
        assert set(outputs) >= {"packcheck-matrix.json", "packcheck-matrix.md", "packcheck-matrix.html", "packcheck-details.md",
                                "packcheck-journal.jsonl", ".packcheck-run.json"}
        for name, text in outputs.items():
            for secret in (HF, typed, SHAPES[1], "plainvalue42"):
                assert secret not in text, (name, secret)
        assert "tok=***" in outputs["packcheck-matrix.md"] and "PackcheckWarning" in proc.stdout + proc.stderr
        assert "tok=***" in proc.stdout + proc.stderr  # the override warning, scrubbed on the terminal


def test_a_token_inside_a_results_file_from_elsewhere_is_not_printed_by_gate(tmp_path):
    label = f"llama{{tok={SHAPES[0]}}}"
    for name, status in (("base.json", "pass"), ("cand.json", "fail")):
        cell = _cell(f"{label}-sdpa-isolation-float32", status=status, message=f"says {SHAPES[0]}",
                     model={"label": label, "spec": "arch:llama", "model_type": "llama", "model_class": "L"})
        (tmp_path / name).write_text(json.dumps(_doc([cell])))
    proc = _cli(["gate", "--baseline", "base.json", "--candidate", "cand.json"], tmp_path)
    assert proc.returncode == 1 and "REGRESSION" in proc.stdout and "tok=***" in proc.stdout
    assert SHAPES[0] not in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# Values accepted quietly before


@pytest.mark.parametrize("override, value", [("hidden_size", "0"), ("num_hidden_layers", "-2"), ("vocab_size", str(10**9)),
                                             ("text_config.num_attention_heads", "0"), ("head_dim", "-1"),
                                             ("max_position_embeddings", "0")])
def test_an_absurd_size_is_refused_not_shrunk_away(override, value):
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list

    spec = parse_model_list([f"arch:{'qwen2_vl' if override.startswith('text_config') else 'llama'}{{{override}={value}}}"], "test")[0]
    with pytest.raises(PackcheckUsageError, match=rf"Config value {override}={value!s}.* is not a size a model can have: "
                                                  r"expected a whole number from 1 to"):
        resolve_model(spec, "test")


@pytest.mark.parametrize("spec, said", [("arch:gpt2{n_layer=0}", "n_layer=0"), ("arch:gpt2{n_embd=-3}", "n_embd=-3"),
                                        ("arch:t5{d_model=0}", None)])
def test_a_models_own_name_for_a_size_is_refused_as_the_standard_name_is(spec, said, tmp_path):
    """Trial 14, 213: `arch:gpt2{n_layer=0}` (gpt2's name for num_hidden_layers, its config's attribute_map) ran and
    passed under its label while `num_hidden_layers=0` was refused; the same in a checkpoint's config.json."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list

    if said is None:  # t5 is no causal LM: only the naming rule is checked
        from transformers import T5Config

        from pytest_packcheck.model.configs import size_name

        assert size_name(T5Config(), "d_model") == "hidden_size" and size_name(T5Config(), "dropout_rate") is None
        return
    with pytest.raises(PackcheckUsageError, match=rf"Config value {re.escape(said)} .* is not a size a model can have"):
        resolve_model(parse_model_list([spec], "test")[0], "test")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 0}))
    with pytest.raises(PackcheckUsageError, match=r"n_layer=0 \(in its config.json of model spec"):
        resolve_model(parse_model_list([str(tmp_path)], "test")[0], "test")
    assert resolve_model(parse_model_list(["arch:gpt2{n_layer=3}"], "test")[0], "test").config.n_layer == 3


def test_heads_that_do_not_divide_are_refused_not_shrunk_to_a_whole_ratio():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list

    with pytest.raises(PackcheckUsageError, match=r"num_attention_heads=32 and num_key_value_heads=3 .* do not divide"):
        resolve_model(parse_model_list(["arch:llama{num_key_value_heads=3}"], "test")[0], "test")
    assert resolve_model(parse_model_list(["arch:llama{num_key_value_heads=8}"], "test")[0], "test").config.num_key_value_heads == 8


def test_an_override_of_the_wrong_type_is_refused_naming_the_config():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list

    spec = parse_model_list(["arch:llama{intermediate_size=2.5}"], "test")[0]
    with pytest.raises(PackcheckUsageError, match=r"Config override 'intermediate_size=2.5' .* is refused by LlamaConfig "
                                                  r"\(StrictDataclassFieldValidationError: .*expected int, got float"):
        resolve_model(spec, "test")


def test_an_absurd_size_in_a_local_config_json_is_refused_and_a_real_one_resolves(tmp_path):
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list

    for vocab, ok in ((10**9, False), (32000, True)):
        folder = tmp_path / f"m{vocab}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
        spec = parse_model_list([str(folder)], "test")[0]
        if ok:
            assert resolve_model(spec, "test").model_type == "llama"
            assert resolve_model(parse_model_list(["arch:llama{hidden_size=64}"], "test")[0], "test").config.hidden_size == 64
        else:
            with pytest.raises(PackcheckUsageError, match=r"vocab_size=1000000000 \(in its config.json of model spec"):
                resolve_model(spec, "test")


def _resolve(argv, monkeypatch, env=None):
    from pytest_packcheck.cli import _parser
    from pytest_packcheck.config.options import OPTIONS
    from pytest_packcheck.config.settings import resolve

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ns = _parser().parse_args(["audit", *argv])
    return resolve(lambda dest: getattr(ns, dest, None), lambda key: None)


@pytest.mark.parametrize("argv, message", [
    (["--packcheck-attn="], "Empty value '' for --packcheck-attn (from the command line)"),
    (["--packcheck-attn= "], "Empty value ' ' for --packcheck-attn"),
    (["--packcheck-attn=,"], "Empty backend list ',' (from --packcheck-attn)"),
    (["--packcheck-checks=,"], "Empty check list ',' (from --packcheck-checks)"),
    (["--packcheck-weights="], "Empty value '' for --packcheck-weights"),
    (["--packcheck-report-dir="], "Empty value '' for --packcheck-report-dir"),
    (["--packcheck-config="], "Empty value '' for --packcheck-config (from the command line): write key=value"),
])
def test_an_empty_option_value_is_refused_not_read_as_every_one(monkeypatch, argv, message):
    with pytest.raises(PackcheckUsageError) as err:
        _resolve(["--models", "arch:llama", *argv], monkeypatch)
    assert message in str(err.value)


def test_an_empty_environment_variable_is_unset(monkeypatch):
    from pytest_packcheck.backends import DEFAULT_BACKENDS

    assert _resolve(["--models", "arch:llama"], monkeypatch, {"PACKCHECK_ATTN": ""}).backends == DEFAULT_BACKENDS


def test_pretrained_weights_with_arch_specs_refused_alone_and_explained_beside_a_checkpoint(monkeypatch):
    with pytest.raises(PackcheckUsageError, match="has no weights to load: every model is an arch: spec \\(arch:llama\\)"):
        _resolve(["--models", "arch:llama", "--packcheck-weights", "pretrained"], monkeypatch)
    with pytest.warns(PackcheckWarning, match="1 arch: spec\\(s\\) \\(arch:llama\\) have no checkpoint and run shrunk random weights"):
        assert _resolve(["--models", "arch:llama,org/model", "--packcheck-weights", "pretrained"], monkeypatch).weights == "pretrained"


def test_each_cell_says_what_weights_it_ran_and_the_header_does_not_claim_pretrained_for_arch_cells():
    from pytest_packcheck.model.resolve import loaded_weights
    from pytest_packcheck.report.sections import weights_line

    assert [loaded_weights(k, w) for k, w in (("arch", "pretrained"), ("hub", "pretrained"), ("local", "random"))] == \
        ["random", "pretrained", "random"]
    arch = _cell(model={"label": "llama", "spec": "arch:llama", "weights": "random"})
    hub = _cell("qwen-sdpa-isolation-float32", model={"label": "qwen", "spec": "org/qwen", "weights": "pretrained"})
    assert weights_line({"weights": "pretrained"}, [arch, hub]) == \
        "pretrained for qwen; random (shrunk, an arch: spec has no checkpoint) for llama"
    assert weights_line({"weights": "pretrained"}, [arch]).startswith("random (pretrained was asked for")  # CUDA's default
    assert weights_line({"weights": "random"}, [arch]) == "random"


def test_arch_cells_are_recorded_random_under_the_cuda_default(tmp_path, tolerances):
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_list
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    resolved = resolve_model(parse_model_list(["arch:llama"], "test")[0], "test")
    runner = CellRunner([resolved], tolerances, weights="pretrained")
    cell = next(c for c in plan_cells([resolved], ("sdpa",), ("isolation",), ("float32",), None))
    result = runner.run(cell)
    assert result.model["weights"] == "random" and result.status == "pass"


def test_resume_after_a_settings_change_says_what_changed(pytester):
    # pytester's runs in this process here and in the resume / maxfail / -k tests below: their words and files are the
    # subject; the Ctrl-C tests and a conftest that patches the runner keep a process of their own
    base = ("--packcheck-models=arch:llama", "--packcheck-checks=isolation", "-p", "no:cacheprovider")
    assert pytester.runpytest_inprocess(*base, "--packcheck-attn=sdpa").ret == 0
    same = pytester.runpytest_inprocess(*base, "--packcheck-attn=sdpa", "--packcheck-resume")
    assert same.ret == 0 and "of a run with other settings" not in str(same.stdout) + str(same.stderr)
    changed = pytester.runpytest_inprocess(*base, "--packcheck-attn=eager", "--packcheck-resume")
    assert changed.ret == 0
    text = " ".join((str(changed.stdout) + str(changed.stderr)).split())
    # the settings the journaled cells were made with (the journal records them), not the previous matrix's
    assert ("holds 1 finished cell(s) of a run with other settings, tolerances, library versions or model files; their settings "
            '-> these: backends ["sdpa"] -> ["eager"]: none of them is reused; 0 cell(s)') in text


def test_resume_after_a_local_model_folder_was_edited_runs_its_cells_again(pytester):
    """trial 7, 221/222: an edited local model folder (config.json, remote code) no longer matches the journal, so
    --packcheck-resume measures it again and says why; a resume that reuses cells says so in the terminal and report."""
    folder = pytester.path / "m"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    (folder / "config.json").write_text(json.dumps(config))
    base = ("--packcheck-models=./m", "--packcheck-checks=isolation", "--packcheck-attn=sdpa",
            "--packcheck-report-dir=r", "-p", "no:cacheprovider")
    assert pytester.runpytest_inprocess(*base).ret == 0
    same = pytester.runpytest_inprocess(*base, "--packcheck-resume")
    assert same.ret == 0
    said = "Resumed: 1 of 1 cells were taken from the journal of an earlier run (--packcheck-resume)"
    assert said in " ".join(str(same.stdout).split())
    assert said in (pytester.path / "r" / "packcheck-matrix.md").read_text()
    # trial 12, 61: a resumed cell is a pytest item passing from the journal, counted by pytest: no line says otherwise
    assert "came from the journal, not from pytest" not in str(same.stdout)
    assert read_results(pytester.path / "r" / "packcheck-matrix.json")["resumed"] == {"cells": 1, "of": 1}
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "hidden_act": "gelu"}))
    edited = pytester.runpytest_inprocess(*base, "--packcheck-resume")
    assert edited.ret == 0
    text = " ".join((str(edited.stdout) + str(edited.stderr)).split())
    assert ("local model folder(s) edited since (config.json, remote code *.py or weights files): ./m: none of them "
            "is reused; 0 cell(s)") in text, text
    assert "Resumed:" not in text
    assert "resumed" not in read_results(pytester.path / "r" / "packcheck-matrix.json")


def test_merge_into_a_folder_an_audit_holds_is_refused(tmp_path):
    from pytest_packcheck.run.process import hold_report_dir

    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc([_cell()])))
    out = tmp_path / "reports"
    out.mkdir()
    lock = hold_report_dir(out, "--packcheck-report-dir", command="packcheck audit --models arch:llama")
    try:
        proc = _cli(["merge", str(good), "-o", str(out)], tmp_path)
    finally:
        lock.release(force=True)
    assert proc.returncode == 2
    line = _one_line(proc.stderr, "packcheck merge: error:")
    assert f"is in use by another packcheck run (pid {os.getpid()}" in line and "packcheck audit --models arch:llama" in line
    assert "pass another -o/--output-dir" in line and not (out / "packcheck-matrix.json").exists()
    again = _cli(["merge", str(good), "-o", str(out)], tmp_path)
    assert again.returncode == 0 and (out / "packcheck-matrix.json").exists()


def test_versions_over_the_cap_are_refused_with_an_estimate():
    from pytest_packcheck.versions.envs import MAX_ENVIRONMENTS, parse_versions

    eight = ",".join(f"5.{i}.0" for i in range(8))
    trl = ",".join(f"0.{i}.0" for i in range(8))
    assert len(parse_versions([f"transformers=={eight}", f"trl=={trl}"], "test")) == MAX_ENVIRONMENTS  # 8 x 8 is taken
    with pytest.raises(PackcheckUsageError, match="65 version environments"):
        parse_versions([f"transformers=={eight}", f"trl=={trl}", "transformers==4.0.0 & trl==0.1.0"], "test")
    many = ",".join(f"5.{i}.0" for i in range(800))
    with pytest.raises(PackcheckUsageError, match=r"800 version environments \(from --packcheck-versions\) are over packcheck's "
                                                  r"cap of 64: .* about 5\.3-22\.2 h here"):
        parse_versions([f"transformers=={many}"], "--packcheck-versions")


def test_a_cell_message_carrying_a_token_is_scrubbed_on_the_terminal(pytester):
    token = SHAPES[1]
    pytester.makeconftest(f"""
        from pytest_packcheck.run import runner
        from pytest_packcheck.results import CheckResult

        def planted(self, cell):  # a check whose message echoes a token (an exception naming a spec, say)
            return CheckResult("fail", {{"max_change": 1.0}}, "the model 'arch:llama{{api_token={token}}}' leaked")

        runner.CellRunner._run = planted
    """)
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "--packcheck-checks=isolation",
                                           "--packcheck-isolation=none", "-p", "no:cacheprovider", "-rA")
    text = str(result.stdout) + str(result.stderr)
    assert result.ret == 1 and "api_token=***" in text and token not in text
    assert token not in (pytester.path / "reports" / "packcheck-matrix.md").read_text()


def test_verify_remedies_rewrites_markdown_and_json_as_one_set(tmp_path, monkeypatch):
    from pytest_packcheck import results
    from pytest_packcheck.analysis import remedies
    from pytest_packcheck.cli import audit
    from pytest_packcheck.report.formats import write_reports

    write_reports(tmp_path, _doc([_cell()]))

    def verify(doc, out, log):
        doc["remedy_checks"] = []
        return []

    monkeypatch.setattr(remedies, "verify_remedies", verify)
    seen = []
    real = results.write_set
    monkeypatch.setattr(results, "write_set", lambda files, flag="--packcheck-report-dir": (seen.append([p.name for p, _ in files]), real(files, flag)))
    audit._verify_remedies_into_report(tmp_path)
    assert seen == [["packcheck-matrix.md", "packcheck-matrix.json"]]  # one set, the JSON last
    assert (tmp_path / "packcheck-matrix.md").read_text().endswith("No failing cell made a remedy claim.\n")
    assert read_results(tmp_path / "packcheck-matrix.json")["remedy_checks"] == []


def test_bench_and_bisect_on_a_full_disk_are_refused_before_any_work(tmp_path, small_disk):
    disk, _ = small_disk
    (disk / "filler").write_bytes(b"\0" * 64 * 1024)
    for args, prefix in ((["bench", "--profile", "fixed", "-o", str(disk / "b")], "packcheck bench: error:"),
                         (["bisect", "llama-sdpa-isolation-float32", "--good", "transformers==5.23.0", "--bad",
                           "transformers==5.24.0", "-o", str(disk / "bi")], "packcheck bisect: error:")):
        proc = _cli(args, tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = _one_line(proc.stderr, prefix)
        assert "(from -o/--output-dir) is not writable:" in line and "the disk is full" in line


def test_save_baseline_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    import pytest as _pytest

    from pytest_packcheck import cli, results
    from pytest_packcheck.report.formats import write_reports

    write_reports(tmp_path, _doc([_cell()]))
    monkeypatch.setattr(_pytest, "main", lambda args, **kwargs: _pytest.ExitCode.OK)

    def full(path, text, flag="--packcheck-report-dir"):
        raise PackcheckUsageError(results.write_failure(Path(path), OSError(errno.ENOSPC, "No space left on device"), flag))

    monkeypatch.setattr(results, "atomic_write", full)
    code = cli.main(["audit", "--models", "arch:llama", "--packcheck-report-dir", str(tmp_path), "--save-baseline", "-n", "0"])
    assert code == 2 and not (tmp_path / "baseline.json").exists()
    assert "packcheck audit: error: --save-baseline: Cannot write" in capsys.readouterr().err


def _ctrl_c_during_cell(pytester, n):
    """Plant a Ctrl-C (KeyboardInterrupt) as the ``n``-th cell of the run starts (a conftest hook)."""
    pytester.makeconftest(textwrap.dedent(f"""
        import pytest
        seen = []

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(item):
            seen.append(item.nodeid)
            if len(seen) == {n}:
                raise KeyboardInterrupt
            yield
    """))


def test_an_interrupted_matrix_cell_is_not_a_pass_on_the_checks_that_finished(pytester):
    """Trial W1: interrupted 2 checks into llama / sdpa, the matrix showed ✅ for the cell (and "✅ pass 1 (of 1)")
    on the checks that happened to finish. Every correctness check of a started cell that never ran is named
    "not run" in the JSON, and the cell's headline is "not run: N of M checks", counted as not checked."""
    _ctrl_c_during_cell(pytester, 3)  # a Ctrl-C during the third cell
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "-p", "no:cacheprovider",
                                           "--packcheck-checks=position_ids,isolation,logits_parity,loss_parity,grad_parity",
                                           "--packcheck-isolation=none")  # cells one by one in this process
    assert result.ret == pytest.ExitCode.INTERRUPTED
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    by_check = {c["check"]: c for c in doc["cells"]}
    assert doc["incomplete"]["reason"] == "the run was interrupted" and doc["incomplete"]["cells"] == 2
    ran = [c for c in doc["cells"] if not c["metrics"].get("not_run")]
    assert len(ran) == 2 and all(c["status"] == "pass" for c in ran)
    unrun = [k for k, c in by_check.items() if c["metrics"].get("not_run")]
    assert len(unrun) == 3 and all(by_check[k]["status"] == "skipped" and "interrupted" in by_check[k]["message"] for k in unrun)
    md = (pytester.path / "reports" / "packcheck-matrix.md").read_text()
    assert "not run: 3 of 5 checks (interrupted)" in md
    assert "judged by the correctness checks): ⏭️ not run (interrupted) 1 (of 1)." in md
    csv = (pytester.path / "reports" / "packcheck-matrix.csv").read_text()
    assert ",pass," not in csv and ",not run (interrupted)," in csv and "not run: 3 of 5 checks (interrupted)" in csv  # as the Markdown


def test_an_interrupted_run_counts_the_matrix_cells_that_never_started(pytester):
    """Trial U5 (#78): after a Ctrl-C, a matrix cell that never started (qwen2 / sdpa) was missing: the headline
    said "(of 5)" for 6 planned, the answer named only the backend that started, and the CSV gave the interrupted
    cell "skipped" with the key number "Δ 0.0e+00". Every planned cell of the shard is in the matrix as "not run
    (interrupted)", and such a cell rests on no number."""
    _ctrl_c_during_cell(pytester, 2)  # a Ctrl-C during the second cell: eager started, sdpa never did
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=eager,sdpa", "-p", "no:cacheprovider",
                                           "--packcheck-checks=position_ids,isolation", "--packcheck-isolation=none")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    sdpa = [c for c in doc["cells"] if c["backend"] == "sdpa"]
    assert sorted(c["check"] for c in sdpa) == ["isolation", "position_ids"]
    assert all(c["status"] == "skipped" and c["metrics"].get("not_run") == "interrupted" for c in sdpa)
    md = (pytester.path / "reports" / "packcheck-matrix.md").read_text()
    assert "judged by the correctness checks): ⏭️ not run (interrupted) 2 (of 2)." in md
    assert "**llama**: not run on eager, sdpa (the run was interrupted" in md and "Not run on this machine" not in md
    rows = (pytester.path / "reports" / "packcheck-matrix.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1:] == ["llama,eager,float32,,not run (interrupted),,,,not run: 1 of 2 checks (interrupted)",
                                           "llama,sdpa,float32,,not run (interrupted),,,,not run: 2 of 2 checks (interrupted)"], rows


def test_the_ctrl_c_line_shows_no_home_directory(pytester, monkeypatch):
    """Trial 7, 50: after a Ctrl-C pytest printed "/root/.../selectors.py:415: KeyboardInterrupt" with the home
    directory, which every other terminal line writes as ~. Planted: the Ctrl-C is raised in a conftest that lies
    under $HOME."""
    _ctrl_c_during_cell(pytester, 1)
    monkeypatch.setenv("HOME", str(pytester.path))
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "-p", "no:cacheprovider",
                                           "--packcheck-checks=isolation", "--packcheck-isolation=none")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    line = next(x for x in result.stdout.lines if x.endswith(": KeyboardInterrupt"))
    assert line.startswith("~/conftest.py:"), line


def test_a_tolerance_or_audit_file_with_a_utf8_bom_is_read(tmp_path):
    """Trial #67: a leading UTF-8 BOM (Windows editors) gave "not valid TOML (Invalid statement (at line 1,
    column 1))"; the BOM is now dropped (errors.read_user_text) and the file read as written."""
    from pytest_packcheck.config.audits import load_audit
    from pytest_packcheck.config.tolerances import load_tolerances

    audit, tol = tmp_path / "a.toml", tmp_path / "t.toml"
    audit.write_bytes(b'\xef\xbb\xbf[audit]\nmodels = ["arch:llama"]\n')
    tol.write_bytes(b"\xef\xbb\xbf[float32]\nlogits_atol = 0.5\n")
    assert load_audit(str(audit)).models == ("arch:llama",)
    assert load_tolerances(str(tol), [], "--packcheck-tolerances")[0]["float32"]["logits_atol"] == 0.5


def test_an_interrupted_run_names_every_unrun_check_and_the_reason_of_a_check_that_did_not_run(pytester):
    """Trial W5 (#193): after a Ctrl-C the terminal said "not checked eager / float32, 1 model: 2/2 calls on eager,
    boundaries reached in all" (a passed check's message as the reason), the counts said "(of 40)" where pytest
    collected 50 (hazards and findings that never ran were dropped), and the "Not checked" lines named the check
    on some lines only."""
    _ctrl_c_during_cell(pytester, 2)  # a Ctrl-C during eager's second check: its first passed
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=eager,sdpa", "-p", "no:cacheprovider",
                                           "--packcheck-checks=position_ids,isolation,cache_trap", "--packcheck-isolation=none")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    assert len(doc["cells"]) == 6, sorted(c["cell_id"] for c in doc["cells"])  # the hazard cache_trap on both too
    hazards = [c for c in doc["cells"] if c["check"] == "cache_trap"]
    assert all(c["status"] == "skipped" and c["metrics"].get("not_run") == "interrupted" for c in hazards)
    assert any(c["status"] == "pass" for c in doc["cells"])  # a check that did run: its message is no reason
    unchecked = [line for line in result.outlines if line.startswith("  not run (interrupted) ")]
    assert unchecked and all("not run: the run was interrupted" in line for line in unchecked), result.outlines
    assert "(of 6)." in result.stdout.str()
    md = (pytester.path / "reports" / "packcheck-matrix.md").read_text()
    section = md[md.index("## Not run (interrupted)"):].split("\n\n")[1].splitlines()
    assert section and all(line.split(": ")[1].split(", ")[0] in ("position_ids", "isolation") for line in section), section


def test_a_run_stopped_by_maxfail_is_incomplete_with_the_unrun_cells_named(pytester):
    """`packcheck audit ... -n 0 -- -x` stopped after opt's first failure: the matrix read "fail 1 (of 1)", with no
    Incomplete banner and llama (asked for, never run) nowhere (trial 4, 298). pytest sets ``shouldfail`` for
    -x / --maxfail (xdist's controller ``shouldstop``): both mark the matrix incomplete, as a Ctrl-C does."""
    result = pytester.runpytest_inprocess("--packcheck-models=arch:opt,arch:llama", "--packcheck-attn=sdpa",
                                          "--packcheck-checks=isolation", "-p", "no:cacheprovider", "-x",
                                          "--packcheck-isolation=none")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    assert doc["incomplete"]["reason"] == "the run stopped early (stopping after 1 failures)" and doc["incomplete"]["cells"] == 1
    llama = next(c for c in doc["cells"] if c["model"]["label"] == "llama")
    assert llama["status"] == "skipped" and llama["metrics"]["not_run"] == "interrupted"
    assert "Incomplete: the run stopped early" in (pytester.path / "reports" / "packcheck-matrix.md").read_text()


def test_cells_taken_from_the_journal_after_an_interrupt_are_named_as_such(pytester):
    """Trial 4, 75: after a Ctrl-C the terminal read "pass 4 (of 18)" where pytest said "no tests ran": those cells
    finished in the forked child (journaled) but never reached pytest. The Incomplete line now says how many were
    taken from the journal, in the terminal as in the JSON."""
    _ctrl_c_during_cell(pytester, 2)  # the child ran both cells on the first item; the second is never reported
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "-p", "no:cacheprovider",
                                           "--packcheck-checks=position_ids,isolation", "--packcheck-isolation=fork")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    assert doc["incomplete"]["cells"] == 2 and doc["incomplete"]["journal"] == {"earlier": 0, "this": 1}
    result.stdout.fnmatch_lines([("Incomplete: the run was interrupted after 2 cells (1 finished in this run but never "
                                 "reached pytest: taken from the journal, so pytest's own counts leave them out); *")])
    # trial 8, 52: pytest's own last line ("no tests ran in 8.25s") is followed by the count it leaves out
    lines = result.stdout.lines
    last = max(i for i, line in enumerate(lines) if re.search(r"=+ .* in [0-9.]+s", line))
    assert any(line.startswith("packcheck: the matrix holds 2 measured cell(s); 1 of them came from the journal, "
                               "finished in this run but not reported to pytest")  # not a resume's (trial 21, 50)
               for line in lines[last + 1:]), lines[last:]


def test_incomplete_line_names_cells_of_an_earlier_run_taken_from_the_journal():
    from pytest_packcheck.report.model import incomplete_text

    inc = {"reason": "the run was interrupted", "cells": 4, "resume": "rerun", "journal": {"earlier": 4, "this": 0}}
    assert incomplete_text(inc) == ("Incomplete: the run was interrupted after 4 cells (4 finished in an earlier run "
                                    "(--packcheck-resume): taken from the journal, so pytest's own counts leave them out); rerun")
    assert incomplete_text({"reason": "r", "cells": 2, "resume": "x"}) == "Incomplete: r after 2 cells; x"


def test_a_run_that_selects_no_cell_removes_the_earlier_matrix_and_says_so(pytester):
    """Trial 4, 80: `-k nomatch` into a folder holding an earlier matrix left it in place while the owner file named
    this run and the journal was emptied (a mixed set). The earlier matrix is removed with one line, as for a run
    interrupted before any cell finished."""
    from pytest_packcheck.report.formats import FORMATS

    reports = pytester.path / "reports"
    reports.mkdir()
    for f in FORMATS:
        (reports / f.file).write_text("earlier")
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "-p", "no:cacheprovider",
                                          "--packcheck-checks=isolation", "-k", "nomatch")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    assert not any((reports / f.file).exists() for f in FORMATS)
    result.stdout.fnmatch_lines([("packcheck: no packcheck cell ran (deselected by -k 'nomatch'), so no matrix was written; "
                                 "the previous * were set aside in reports/previous so they are not taken for this "
                                 "run's; this run emptied the journal *")])
    assert all((reports / "previous" / f.file).exists() for f in FORMATS)


def test_a_traceback_entry_without_a_line_number_is_dropped_before_pytest_formats_the_interrupt():
    """Trial 8, 110: a SIGTERM that landed on an instruction without a line number (CPython 3.11+) left a
    traceback entry whose tb_lineno is None; pytest's formatter of the interrupt raised TypeError (exit 1, a
    traceback, a matrix not marked incomplete). The entry is unlinked first; a planted chain with two such
    entries keeps the others in order."""
    from types import SimpleNamespace

    from pytest_packcheck.plugin import drop_lineless_entries

    def chain(*linenos):
        head = None
        for n in reversed(linenos):
            head = SimpleNamespace(tb_lineno=n, tb_next=head)
        return head

    tb = chain(10, None, 20, None, None, 30)
    drop_lineless_entries(tb)
    got = []
    while tb is not None:
        got, tb = [*got, tb.tb_lineno], tb.tb_next
    assert got == [10, 20, 30]
    real = None
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        real = exc.__traceback__
    drop_lineless_entries(real)  # a real chain with every line number: unchanged
    assert real.tb_lineno is not None and real.tb_next is None


def test_a_second_stop_signal_while_the_first_is_handled_is_noted_not_a_traceback(pytester):
    """Trial 9, 59 / 62: `timeout` sends SIGTERM to the process and to its group, a user presses Ctrl-C twice:
    the second signal raised KeyboardInterrupt inside pytest's own interrupt handling (a traceback, exit 1, a
    matrix that named no cell). Planted: a Ctrl-C as the second cell starts, and a second SIGINT from inside
    pytest's keyboard-interrupt hook."""
    pytester.makeconftest(textwrap.dedent("""
        import os, signal
        import pytest

        seen = []

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(item):
            seen.append(item.nodeid)
            if len(seen) == 2:  # the first cell finished
                os.kill(os.getpid(), signal.SIGINT)
            yield

        @pytest.hookimpl(tryfirst=True)
        def pytest_keyboard_interrupt(excinfo):
            os.kill(os.getpid(), signal.SIGINT)  # the second signal, while the first is being handled
    """))
    # the subprocess as a terminal starts it: an ignored SIGINT (an xdist worker may hold one) is inherited through
    # exec, and the planted Ctrl-C was then ignored (the suite's only flaky test under -n 2); a Python handler is not
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "-p", "no:cacheprovider",
                                               "--packcheck-checks=isolation,logits_parity", "--packcheck-isolation=none")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()[-2000:]
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert "packcheck: already stopping" in result.stderr.str()
    doc = read_results(pytester.path / "reports" / "packcheck-matrix.json")
    assert doc["incomplete"]["reason"] == "the run was interrupted" and doc["incomplete"]["cells"] == 1


def test_a_ctrl_c_before_the_session_and_a_second_one_during_the_cleanup_leave_no_stale_matrix(tmp_path, monkeypatch, capfd):
    """Trial 9, 211: a first Ctrl-C while pytest was still loading plugins came out of `packcheck audit` as a
    traceback, and a second one 10 ms later hit the removal of the previous matrix: exit 130 beside the earlier
    run's Markdown / JSON / HTML, not marked. Planted: pytest.main raises KeyboardInterrupt, and a SIGINT arrives
    as the previous matrix is being removed."""
    import signal

    from pytest_packcheck import cli
    from pytest_packcheck.cli import audit as audit_cli
    from pytest_packcheck.report.formats import REPORT_FILES

    for name in REPORT_FILES:
        (tmp_path / name).write_text("an earlier run's\n")
        os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    real = audit_cli._discard_previous_matrix

    def second_ctrl_c(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(pytest, "main", interrupted)
    monkeypatch.setattr(audit_cli, "_discard_previous_matrix", second_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (an xdist worker ignores it)
    try:
        code = cli.main(["audit", "--models", "arch:llama", "--packcheck-report-dir", str(tmp_path), "-n", "0"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capfd.readouterr().err
    assert code == 130 and "Traceback" not in err, err
    assert not any((tmp_path / name).exists() for name in REPORT_FILES), sorted(p.name for p in tmp_path.iterdir())
    assert "already stopping" in err and "were removed so they are not taken for this run's" in err


def test_an_unknown_packcheck_variable_is_named_not_ignored(monkeypatch):
    """Trial 15, 130: PACKCHECK_MODEL (for PACKCHECK_MODELS) and PACKCHECK_FOO were ignored without a word. Every
    PACKCHECK_* name packcheck's own code reads is known (the list is checked against the source, so a new variable
    cannot be warned about), and a typo is named with the closest known one."""
    from pytest_packcheck.config.options import OPTIONS, OTHER_ENV_VARS, unknown_env_vars

    source = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "pytest_packcheck").rglob("*.py"))
    constants = {"PACKCHECK_REGISTERED", "PACKCHECK_BACKEND_ATTR", "PACKCHECK_RUNTIME"}  # names in code, not variables
    read = set(re.findall(r"PACKCHECK_[A-Z0-9_]+", source)) - constants
    assert read == {o.env for o in OPTIONS if o.env} | set(OTHER_ENV_VARS), read ^ ({o.env for o in OPTIONS if o.env} | set(OTHER_ENV_VARS))
    env = {"PACKCHECK_MODEL": "arch:llama", "PACKCHECK_MODELS": "arch:gpt2", "PACKCHECK_CACHE_DIR": "/tmp/x", "HOME": "/root"}
    assert unknown_env_vars(env) == [("PACKCHECK_MODEL", " Did you mean 'PACKCHECK_MODELS'?")]


@pytest.mark.parametrize(("argv", "env", "source"), [(["--packcheck-device", "cuda"], {}, "(from --packcheck-device)"),
                                                      ([], {"PACKCHECK_DEVICE": "cuda"}, "(from $PACKCHECK_DEVICE)")])
def test_an_unavailable_device_names_where_it_was_asked_for(argv, env, source, monkeypatch, tmp_path):
    """Trial 16, 156: PACKCHECK_DEVICE=cuda on a CPU machine was refused "(from --packcheck-device)", a flag nobody
    gave; every other option's refusal names its variable."""
    import torch

    from pytest_packcheck.run.process import _check_run_inputs

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there: nothing to refuse")
    settings = _resolve(["--models", "arch:llama", *argv], monkeypatch, env)
    with pytest.raises(PackcheckUsageError, match=re.escape(f"Device 'cuda' {source} is not available")):
        _check_run_inputs(tmp_path, settings)
