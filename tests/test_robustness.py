"""Adversarial inputs a new user tries (issue 15): each ends in one line naming the value, its source and the
fix (exit 2), or in the right result; never in a traceback, a lost report or a stale one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck.errors import PackcheckUsageError

BAD_CONFIGS = {
    "invalid_json": ('{"model_type": "llama",\n', "is not valid JSON"),
    "json_array": ("[1, 2]\n", "holds a JSON list, not an object"),
    "binary": (bytes(range(128, 256)), "is not text (binary content)"),
    "zero_heads": ('{"model_type": "llama", "num_attention_heads": 0}\n', "ZeroDivisionError"),
}


def _cli(args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, env=env, timeout=timeout)


def _bad_model(tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind
    folder.mkdir()
    content = BAD_CONFIGS[kind][0]
    (folder / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def _one_error_line(stderr: str, prefix: str) -> str:
    assert "Traceback" not in stderr and "INTERNALERROR" not in stderr, stderr[-2000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("kind", sorted(BAD_CONFIGS))
def test_bad_config_json_is_a_usage_error_naming_the_file(tmp_path, kind):
    from pytest_packcheck.models import resolve_model
    from pytest_packcheck.specs import parse_model_spec

    folder = _bad_model(tmp_path, kind)
    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec(str(folder), "--packcheck-models"), "--packcheck-models")
    message = str(info.value)
    assert BAD_CONFIGS[kind][1] in message and str(folder) in message and "(from --packcheck-models)" in message
    assert "\n" not in message


def test_bad_config_json_through_audit_plugin_and_bench(tmp_path, pytester):
    folder = _bad_model(tmp_path, "invalid_json")
    proc = _cli(["audit", "--models", str(folder), "-n", "0"], tmp_path)
    assert proc.returncode == 2
    assert "is not valid JSON" in _one_error_line(proc.stderr, "ERROR:")
    result = pytester.runpytest_subprocess(f"--packcheck-models={folder}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "is not valid JSON" in _one_error_line(str(result.stderr), "ERROR:")
    proc = _cli(["bench", "--model", str(_bad_model(tmp_path, "zero_heads")), "-o", str(tmp_path / "b")], tmp_path)
    assert proc.returncode == 2
    assert "ZeroDivisionError" in _one_error_line(proc.stderr, "packcheck bench: error:")
    assert not (tmp_path / "b" / "bench.json").exists()


def test_bench_on_a_model_the_backend_cannot_build_is_refused_before_measuring(tmp_path):
    proc = _cli(["bench", "--model", "arch:mamba", "--steps", "1", "--batch-size", "2", "-o", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr, "packcheck bench: error:")
    assert "Model 'arch:mamba' (from --model) cannot be built with --attn sdpa" in line and "try --attn eager" in line
    assert not (tmp_path / "out" / "bench.json").exists()


def test_missing_local_folder_that_looks_like_a_hub_id_is_no_such_folder(tmp_path, monkeypatch):
    from pytest_packcheck.specs import parse_model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for raw in ("models/llama", "./llama", "data/models/llama"):
        with pytest.raises(PackcheckUsageError, match=f"No such folder '{raw}' \\(from --packcheck-models\\)"):
            parse_model_spec(raw, "--packcheck-models")
    assert parse_model_spec("meta-llama/Llama-3.2-1B", "x").kind == "hub"  # a Hub ID stays one


def _cell(cell_id="llama-sdpa-isolation-float32", **over):
    cell = {"cell_id": cell_id, "model": {"label": "llama", "spec": "arch:llama"}, "backend": "sdpa", "check": "isolation",
            "dtype": "float32", "status": "pass", "metrics": {"max_change": 0.0}, "message": "ok", "tolerances": {}}
    return {**cell, **over}


def _doc(cells, **env):
    return {"schema_version": 1, "environment": {"transformers": "5.24.0", **env},
            "settings": {"models": ["arch:llama"], "backends": ["sdpa"], "checks": ["isolation"], "dtypes": ["float32"]},
            "cells": cells}


@pytest.mark.parametrize("bad, message", [
    ({"status": "weird"}, "unknown status 'weird' (expected one of error, timeout"),
    ({"metrics": None}, '"metrics": null (expected a JSON object)'),
    ({"message": 3}, '"message": 3 (expected a string)'),
])
def test_gate_on_a_corrupt_cell_is_exit_2_not_a_regression(tmp_path, bad, message):
    good, corrupt = tmp_path / "good.json", tmp_path / "corrupt.json"
    good.write_text(json.dumps(_doc([_cell()])))
    corrupt.write_text(json.dumps(_doc([_cell(**bad)])))
    for args in (["--baseline", str(good), "--candidate", str(corrupt)], ["--baseline", str(corrupt), "--candidate", str(good)]):
        proc = _cli(["gate", *args], tmp_path)
        assert proc.returncode == 2
        line = _one_error_line(proc.stderr, "packcheck gate: error:")
        assert f"Results file {corrupt} is corrupt: cell 'llama-sdpa-isolation-float32' has" in line and message in line


def test_journal_lines_of_the_wrong_shape_are_skipped_with_a_warning(tmp_path):
    from pytest_packcheck.isolation import Journal

    journal = Journal(tmp_path / "j.jsonl", "fp")
    journal.reset()
    journal.append(json.dumps(_cell("good")))
    with open(journal.path, "a") as fh:
        fh.writelines(json.dumps(entry) + "\n" for entry in ([1, 2], {"fingerprint": "fp", "cell": "x"}, {"fingerprint": "fp", "cell": {"cell_id": "partial", "status": "pass"}},
                      {"fingerprint": "fp", "cell": _cell("nullmetrics", metrics=None)}, {"fingerprint": "fp"}))
    with pytest.warns(UserWarning, match="skipped 5 line\\(s\\) that are not journal entries"):
        assert list(journal.load()) == ["good"]


def test_resume_from_a_journal_of_the_wrong_shape_writes_a_current_matrix(pytester):
    args = ("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "--packcheck-checks=isolation", "-p", "no:cacheprovider")
    assert pytester.runpytest_subprocess(*args).ret == 0
    out = pytester.path / "reports"
    journal = out / "packcheck-journal.jsonl"
    fp = json.loads(journal.read_text().splitlines()[0])["fingerprint"]
    journal.write_text(json.dumps({"fingerprint": fp, "cell": _cell(status="bogus", metrics=None)}) + "\n")
    stale = json.loads((out / "packcheck-matrix.json").read_text())
    (out / "packcheck-matrix.json").write_text(json.dumps({**stale, "command": "STALE"}))
    result = pytester.runpytest_subprocess(*args, "--packcheck-resume")
    assert result.ret == 0, str(result.stdout)
    assert "Traceback" not in str(result.stdout) + str(result.stderr)
    result.stderr.fnmatch_lines(["*skipped 1 line(s) that are not journal entries*unknown status 'bogus'*"])
    doc = json.loads((out / "packcheck-matrix.json").read_text())
    assert doc["command"] != "STALE" and [c["status"] for c in doc["cells"]] == ["pass"]


def test_a_matrix_that_cannot_be_written_removes_the_stale_one(tmp_path):
    from types import SimpleNamespace

    from pytest_packcheck.session import PackcheckSession

    (tmp_path / "packcheck-matrix.md").write_text("old")
    (tmp_path / "packcheck-matrix.json").write_text("{}")
    state = SimpleNamespace(settings=SimpleNamespace(report_dir=str(tmp_path)))
    line = PackcheckSession.discard_stale_matrix(state, ValueError("boom"))
    assert "ValueError: boom" in line and "were removed" in line and "--packcheck-resume" in line
    assert not (tmp_path / "packcheck-matrix.md").exists() and not (tmp_path / "packcheck-matrix.json").exists()
