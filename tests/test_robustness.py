"""Adversarial inputs a new user tries (issue 15): each ends in one line naming the value, its source and the
fix (exit 2), or in the right result; never in a traceback, a lost report or a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results.schema import read_results

BAD_CONFIGS = {
    "invalid_json": ('{"model_type": "llama",\n', "is not valid JSON"),
    "json_array": ("[1, 2]\n", "holds a JSON list, not an object"),
    "binary": (bytes(range(128, 256)), "is not UTF-8 text (byte 0 is 0x80)"),
    "zero_heads": ('{"model_type": "llama", "num_attention_heads": 0}\n', "ZeroDivisionError"),
}


def _cli(args, cwd):
    """``packcheck ARGS`` in this process (tests/cli_inprocess.py): the words, the exit code and the reports; the
    tests about a second process (a concurrent run, a signal, a workflow's shell) start theirs below."""
    return packcheck(*args, cwd=cwd)


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
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

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
    from pytest_packcheck.model.specs import parse_model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for raw in ("models/llama", "./llama", "data/models/llama"):
        with pytest.raises(PackcheckUsageError, match=f"No such folder '{raw}' \\(from --packcheck-models\\)"):
            parse_model_spec(raw, "--packcheck-models")
    assert parse_model_spec("meta-llama/Llama-3.2-1B", "x").kind == "hub"  # a Hub ID stays one


def test_a_model_spec_that_is_a_file_is_refused_as_a_file_naming_its_folder(tmp_path, monkeypatch):
    """Trial 7, 204: `--models ./plain/config.json` (an existing file) was refused as "No such folder ...: the path does
    not exist here", which is untrue. It is now refused as a file, naming the folder to pass."""
    from pytest_packcheck.model.specs import parse_model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "llama"}')
    for raw, folder in (("./plain/config.json", "./plain"), ("plain/config.json", "plain"), ("config.json", ".")):
        if raw == "config.json":
            (tmp_path / "config.json").write_text("{}")
        with pytest.raises(PackcheckUsageError) as info:
            parse_model_spec(raw, "--packcheck-models")
        msg = str(info.value)
        assert f"Model spec '{raw}' (from --packcheck-models) is a file, not a model folder" in msg, msg
        assert f"e.g. '{folder}'" in msg and "does not exist" not in msg, msg
    assert parse_model_spec("./plain", "x").kind == "local"  # its folder is the local model


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
    for args, flag in ((["--baseline", str(good), "--candidate", str(corrupt)], "--candidate"),
                       (["--baseline", str(corrupt), "--candidate", str(good)], "--baseline")):
        proc = _cli(["gate", *args], tmp_path)
        assert proc.returncode == 2
        line = _one_error_line(proc.stderr, "packcheck gate: error:")
        assert f"Results file {corrupt} (from {flag}) is corrupt: cell 'llama-sdpa-isolation-float32' has" in line and message in line


def test_journal_lines_of_the_wrong_shape_are_skipped_with_a_warning(tmp_path):
    from pytest_packcheck.run.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", "fp")
    journal.reset()
    journal.append(json.dumps(_cell("good")))
    with open(journal.path, "a") as fh:
        fh.writelines(json.dumps(entry) + "\n" for entry in ([1, 2], {"fingerprint": "fp", "cell": "x"}, {"fingerprint": "fp", "cell": {"cell_id": "partial", "status": "pass"}},
                      {"fingerprint": "fp", "cell": _cell("nullmetrics", metrics=None)}, {"fingerprint": "fp"}))
    with pytest.warns(UserWarning, match="skipped 5 line\\(s\\) that are not journal entries"):
        assert list(journal.load()) == ["good"]


def test_a_journal_of_random_bytes_is_named_as_not_a_packcheck_journal_and_emptied(tmp_path):
    """Trial #203: random bytes were "skipped 31 unreadable line(s) (cut off by a kill?)"; now the file is named
    as not a packcheck journal, --packcheck-resume starts fresh and empties it (open_journal)."""
    import random
    import warnings
    from types import SimpleNamespace

    from pytest_packcheck.run.journal import Journal
    from pytest_packcheck.run.resume import open_journal

    path = tmp_path / "packcheck-journal.jsonl"
    path.write_bytes(random.Random(0).randbytes(2000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Journal(path, "fp").load() == {}
    text = " | ".join(str(w.message) for w in caught)
    assert f"packcheck journal {path} is not a packcheck journal: none of its" in text and "the run starts fresh" in text
    assert "unreadable" not in text and len(caught) == 1
    path.write_text(json.dumps([1, 2]) + "\n")  # JSON, but no line is a record
    with pytest.warns(UserWarning, match="is not a packcheck journal: none of its 1 line\\(s\\) is a journal record \\(first: a line is a JSON list"):
        assert Journal(path, "fp").load() == {}
    settings = SimpleNamespace(resume=True, report_dir=str(tmp_path), device="cpu", tolerances={}, as_dict=dict,
                               models=["arch:llama"], model_source="--packcheck-models")
    with pytest.warns(UserWarning, match="is not a packcheck journal"):
        journal, resumed = open_journal(SimpleNamespace(), settings)
    assert resumed == {} and path.read_text() == ""  # emptied: the cells this run journals are all it holds
    journal.append(json.dumps(_cell("good")))
    assert list(Journal(path, journal.fp).load()) == ["good"]


def test_resume_from_a_journal_of_the_wrong_shape_writes_a_current_matrix(pytester):
    args = ("--packcheck-models=arch:llama", "--packcheck-attn=sdpa", "--packcheck-checks=isolation", "-p", "no:cacheprovider")
    assert pytester.runpytest_inprocess(*args).ret == 0  # the journal's words and the matrix: in this process
    out = pytester.path / "reports"
    journal = out / "packcheck-journal.jsonl"
    fp = json.loads(journal.read_text().splitlines()[0])["fingerprint"]
    journal.write_text(json.dumps({"fingerprint": fp, "cell": _cell(status="bogus", metrics=None)}) + "\n")
    stale = read_results(out / "packcheck-matrix.json")
    (out / "packcheck-matrix.json").write_text(json.dumps({**stale, "command": "STALE"}))
    result = pytester.runpytest_inprocess(*args, "--packcheck-resume")
    assert result.ret == 0, str(result.stdout)
    assert "Traceback" not in str(result.stdout) + str(result.stderr)
    result.stdout.fnmatch_lines(["*skipped 1 line(s) that are not journal entries*unknown status 'bogus'*"])
    doc = read_results(out / "packcheck-matrix.json")
    assert doc["command"] != "STALE" and [c["status"] for c in doc["cells"]] == ["pass"]


def test_a_matrix_that_cannot_be_written_removes_the_stale_one(tmp_path):
    from types import SimpleNamespace

    from pytest_packcheck.run.session import PackcheckSession

    (tmp_path / "packcheck-matrix.md").write_text("old")
    (tmp_path / "packcheck-matrix.json").write_text("{}")
    state = SimpleNamespace(settings=SimpleNamespace(report_dir=str(tmp_path)))
    line = PackcheckSession.discard_stale_matrix(state, ValueError("boom"))
    assert "ValueError: boom" in line and "were removed" in line and "--packcheck-resume" in line
    assert not (tmp_path / "packcheck-matrix.md").exists() and not (tmp_path / "packcheck-matrix.json").exists()


# ----------------------------------------------------------------------------------------------------------------
# The upgrade gate across version environments

def _env_cell(label, version, status, backend="sdpa", check="isolation", metrics=None):
    combo = f"transformers=={version}"
    env = {"label": combo, "requirements": [combo], "versions": {"transformers": version},
           "environment": {"transformers": version, "torch": "2.13.0+cpu"}}
    if metrics is None:  # a pass rests on its check's key number (results.schema.cell_problem)
        metrics = {"max_change": 0.0} if status == "pass" and check == "isolation" else {}
    return _cell(f"{label}-{backend}-{check}-float32@{combo}", model={"label": label, "spec": f"arch:{label}"},
                 backend=backend, check=check, status=status, env=env, metrics=metrics)


def _versions_doc(cells, versions):
    doc = _doc(cells, transformers="5.24.0")
    doc["settings"]["models"] = ["arch:llama", "arch:opt"]
    doc["settings"]["versions"] = [f"transformers=={v}" for v in versions]
    return doc


def test_two_files_of_different_version_environments_match_cell_by_cell(tmp_path):
    from pytest_packcheck.analysis.gate import compare, regressions, render_changes, stack

    base = _versions_doc([_env_cell("llama", "5.24.0", "pass"), _env_cell("opt", "5.24.0", "skipped"),
                          _env_cell("opt", "5.24.0", "fail", backend="eager")], ["5.24.0"])
    cand = _versions_doc([_env_cell("llama", "5.25.0", "fail"), _env_cell("opt", "5.25.0", "skipped"),
                          _env_cell("opt", "5.25.0", "fail", backend="eager")], ["5.25.0"])
    changes = compare(base, cand)
    # skipped -> skipped and fail -> fail are unchanged: not changes, not regressions; no cell is "missing" or "new"
    assert [(c.key, c.baseline, c.candidate) for c in changes] == [(("llama", "sdpa", "isolation", "float32", None), "pass", "fail")]
    assert len(regressions(changes)) == 1
    header = render_changes(changes, stack(base), stack(cand)).splitlines()[:2]
    assert "transformers 5.24.0," in header[0] and header[0].endswith("(environment transformers==5.24.0)")
    assert "transformers 5.25.0," in header[1] and header[1].endswith("(environment transformers==5.25.0)")
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "c.json").write_text(json.dumps(cand))
    proc = _cli(["gate", "--baseline", str(tmp_path / "b.json"), "--candidate", str(tmp_path / "c.json"),
                 "--allow", "llama-sdpa-isolation-float32=accepted"], tmp_path)
    assert proc.returncode == 0 and "allowed: accepted" in proc.stdout and "transformers 5.25.0" in proc.stdout, proc.stderr
    proc = _cli(["gate", "--baseline", str(tmp_path / "b.json"), "--candidate", str(tmp_path / "c.json"),
                 "--allow", "nothing-like-this=x"], tmp_path)
    assert proc.returncode == 1 and "--allow 'nothing-like-this' matches no cell of either file" in proc.stderr
    assert "whole '-'-separated parts" not in proc.stderr  # nothing near it: nothing to name
    # a prefix that stops inside a part (trial 15, 202: 'llama-sdpa-iso' for isolation) is said so, with the cells
    proc = _cli(["gate", "--baseline", str(tmp_path / "b.json"), "--candidate", str(tmp_path / "c.json"),
                 "--allow", "llama-sdpa-iso=x"], tmp_path)
    assert ("--allow 'llama-sdpa-iso' matches no cell of either file; a prefix is whole '-'-separated parts of a cell "
            "id: llama-sdpa-isolation-float32") in proc.stderr, proc.stderr


def test_gate_between_two_environments_of_one_file(tmp_path):
    doc = _versions_doc([_env_cell("llama", "5.24.0", "pass"), _env_cell("llama", "5.25.0", "pass"),
                         _env_cell("opt", "5.24.0", "pass"), _env_cell("opt", "5.25.0", "fail"),
                         _env_cell("opt", "5.24.0", "skipped", backend="eager"), _env_cell("opt", "5.25.0", "skipped", backend="eager")],
                        ["5.24.0", "5.25.0"])
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    proc = _cli(["gate", "--baseline", str(path), "--baseline-env", "5.24.0", "--candidate-env", "transformers==5.25.0"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "1 regression(s), 1 changed cell(s)" in proc.stdout and "opt-sdpa-isolation-float32" in proc.stdout
    proc = _cli(["gate", "--baseline", str(path), "--baseline-env", "5.2", "--candidate-env", "5.25.0"], tmp_path)
    assert proc.returncode == 2 and "'5.2' (from --baseline-env) matches 2 version environment" in proc.stderr
    other = tmp_path / "one.json"
    other.write_text(json.dumps(_versions_doc([_env_cell("llama", "5.26.0", "pass")], ["5.26.0"])))
    proc = _cli(["gate", "--baseline", str(path), "--candidate", str(other)], tmp_path)
    assert proc.returncode == 2 and "pick the one to compare with --baseline-env" in proc.stderr


FAKE_ENVS = '''
import os
if os.environ.get("PACKCHECK_FAKE_ENVS"):
    import pytest_packcheck.versions.envs as envs

    def run_in_env(combo, settings, models, report_dir, threads=None):
        """Stand-in environments (no network): opt's sdpa isolation fails under the second version."""
        from pathlib import Path

        from pytest_packcheck.checks import MODEL_LEVEL_CHECKS

        version = combo.requirements[0].split("==")[1]
        cells = {}
        for spec in models:
            label = spec.removeprefix("arch:")
            for backend in settings.backends:
                for check in settings.checks:
                    b = None if check in MODEL_LEVEL_CHECKS else backend
                    cell_id = "-".join(x for x in (label, b, check, "float32") if x)
                    status = "skipped" if backend.startswith("flash") else "pass"
                    if label == "opt" and backend == "sdpa" and version == os.environ["PACKCHECK_FAKE_BAD"]:
                        status = "fail"
                    metrics = {"max_change": 0.3 if status == "fail" else 0.0, "negative_control_change": 0.3}
                    cells[cell_id] = {"cell_id": cell_id, "model": {"label": label, "spec": spec}, "backend": b,
                                      "check": check, "dtype": "float32", "status": status, "metrics": metrics, "message": status}
        env = envs.VersionEnv(combo, Path("/nonexistent"), Path("/nonexistent"), {"transformers": version}, False, 0.0)
        return envs.EnvRun(combo, cells, env, None, {"transformers": version, "torch": "2.13.0+cpu"}, None, 0.1)

    envs.run_in_env = run_in_env
    # the index's releases (one query per library, faked: no network)
    import pytest_packcheck.versions.releases as releases

    releases.release_versions = lambda name, timeout=20.0: ["4.56.2", "4.57.0", "4.57.1", "5.23.0", "5.24.0"]
'''


def _example_commands() -> list[str]:
    import yaml

    repo = Path(__file__).resolve().parents[1]
    workflow = yaml.safe_load((repo / "examples" / "packcheck-gate.yml").read_text())
    runs = [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]
    return [r for r in runs if r.lstrip().startswith("packcheck ")]


@pytest.mark.parametrize("bad_version", ["4.57.1", "5.24.0"])
def test_example_workflow_gates_two_versions_in_one_command(tmp_path, bad_version):
    """The packcheck commands of examples/packcheck-gate.yml, run as written, with stand-in version environments:
    a leak that appears in the candidate is allowed by the example's --allow (exit 0); one that disappears is no
    regression either; and an unallowed regression exits 1."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAKE_ENVS)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{repo}", "PACKCHECK_FAKE_ENVS": "1", "PACKCHECK_FAKE_BAD": bad_version,
           "PACKCHECK_CHECKS": "isolation", "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    commands = _example_commands()
    assert len(commands) == 2 and "--gate" in commands[0] and "--candidate-env" in commands[1]
    assert all('--summary "$GITHUB_STEP_SUMMARY"' in c for c in commands)
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=600)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "baseline: torch 2.13.0+cpu, transformers 4.57.1," in proc.stdout and "(environment transformers==4.57.1)" in proc.stdout
        assert "candidate: torch 2.13.0+cpu, transformers 5.24.0," in proc.stdout and "(environment transformers==5.24.0)" in proc.stdout
        if bad_version == "5.24.0":
            assert "allowed: OPT derives positions" in proc.stdout and "0 regression(s), 1 changed cell(s)" in proc.stdout
        else:
            assert "better/neutral" in proc.stdout and "0 regression(s)" in proc.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("### packcheck gate: no regression, 1 changed cell(s)") == 2  # one per step, appended
    written = read_results(tmp_path / "out" / "packcheck-matrix.json")["gate"]  # the HTML shows it
    assert written["changed"] == 1 and written["regressions"] == 0 and written["candidate"] == "transformers==5.24.0"
    assert 'id="gate"' in (tmp_path / "out" / "packcheck-matrix.html").read_text()
    assert "| opt " in summary and "| isolation " in summary and "transformers 4.57.1 → 5.24.0" in summary
    # without the --allow, the leak the upgrade brings is a regression
    if bad_version == "5.24.0":
        proc = subprocess.run(["bash", "-c", commands[1].split("--allow")[0]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, check=False, timeout=600)
        assert proc.returncode == 1 and "REGRESSION" in proc.stdout


def test_packcheck_models_variable_replaces_the_default_audit_and_is_in_the_reproduce_line(monkeypatch):
    from pytest_packcheck.cli import _parser
    from pytest_packcheck.cli.audit import _pytest_args, _reproduce_line

    ns = _parser().parse_args(["audit", "-n", "0"])
    assert "--packcheck-audit=default" in _pytest_args(ns)
    monkeypatch.setenv("PACKCHECK_MODELS", "arch:llama")
    assert not any(a.startswith("--packcheck-audit") for a in _pytest_args(ns))
    assert _reproduce_line(["audit", "-n", "0"]) == "PACKCHECK_MODELS=arch:llama packcheck audit -n 0"
    monkeypatch.delenv("PACKCHECK_MODELS")
    monkeypatch.setenv("PACKCHECK_AUDIT", "training")
    assert not any(a == "--packcheck-audit=default" for a in _pytest_args(ns))


# ----------------------------------------------------------------------------------------------------------------
# Settings -> argv, one conversion


def _every_setting_changed(tmp_path, monkeypatch):
    from pytest_packcheck.cli import _parser
    from pytest_packcheck.config.options import OPTIONS
    from pytest_packcheck.config.settings import resolve

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    # a Hub id beside the arch: specs: --packcheck-weights=pretrained with arch: specs alone is refused
    argv = ["--packcheck-models=arch:llama,arch:opt,org/tiny-llama", "--packcheck-attn=eager,sdpa", "--packcheck-checks=isolation,collate",
            "--packcheck-dtypes=float32,bfloat16", "--packcheck-weights=pretrained", "--packcheck-device=cpu",
            "--packcheck-trust-remote-code", f"--packcheck-report-dir={tmp_path / 'r'}", "--packcheck-tolerance=float32.logits_atol=0.5",
            "--packcheck-baseline=base.json", "--packcheck-shard=2/3", "--packcheck-versions=transformers==4.56.2,5.24.0",
            "--packcheck-versions=trl==0.21.0", "--packcheck-timeout=30", "--packcheck-isolation=none", "--packcheck-resume",
            "--packcheck-lengths=11,1,13", "--packcheck-sliding-window=16"]

    def settings_of(args):
        ns = _parser().parse_args(["audit", *args])
        return resolve(lambda dest: getattr(ns, dest, None), lambda key: None)

    return settings_of, settings_of(argv)


def test_every_setting_survives_the_round_trip_through_argv(tmp_path, monkeypatch):
    from dataclasses import fields

    from pytest_packcheck.versions.envs import _tolerance_toml

    settings_of, settings = _every_setting_changed(tmp_path, monkeypatch)
    tol = tmp_path / "tol.toml"
    tol.write_text(_tolerance_toml(settings.tolerances))
    again = settings_of(settings.to_args(tolerance_file=str(tol)))
    labels = {"model_source", "tolerance_source"}  # where a value came from, not the value
    for f in fields(settings):
        if f.name not in labels:
            assert getattr(again, f.name) == getattr(settings, f.name), f.name
    assert settings.tolerances["float32"]["logits_atol"] == 0.5 and settings.timeout_s == 30 and settings.sandbox == "none"
    assert settings_of(settings.reproduce_flags()).versions == settings.versions


def test_version_environment_child_keeps_timeout_and_isolation_and_has_a_limit(tmp_path, monkeypatch):
    from pytest_packcheck.versions import envs

    _, settings = _every_setting_changed(tmp_path, monkeypatch)
    combo = settings.versions[0]
    monkeypatch.setattr(envs, "ensure_env", lambda c, log=None: envs.VersionEnv(c, tmp_path / "env", Path(sys.executable), {}, False, 0.0))
    seen = {}

    def fake_run(args, **kwargs):
        seen.update(args=args, timeout=kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(args, kwargs.get("timeout"), output=b"", stderr=b"")

    monkeypatch.setattr(envs.subprocess, "run", fake_run)
    run = envs.run_in_env(combo, settings, ["arch:llama"], tmp_path / "reports")
    assert "--packcheck-timeout=30" in seen["args"] and "--packcheck-isolation=none" in seen["args"]
    assert "--packcheck-trust-remote-code" in seen["args"] and "--packcheck-weights=pretrained" in seen["args"]
    assert not any(a.startswith(("--packcheck-versions", "--packcheck-shard", "--packcheck-baseline", "--packcheck-resume"))
                   for a in seen["args"])
    # 1 model x 2 dtypes x 2 checks x 2 backends at 30 s, plus 600 s of start-up
    assert seen["timeout"] == 30 * 8 + 600
    assert run.error and "killed: no end within 840 s" in run.error


def test_cpu_allocation_failure_is_an_oom_cell_with_memory_figures():
    import torch

    from pytest_packcheck.run.runner import CellRunner

    try:
        torch.empty(2**60, dtype=torch.uint8)
    except RuntimeError as exc:
        error = exc
    result = CellRunner([], {}, device="cpu")._failed("check", error)
    assert result.status == "oom" and result.metrics["host_peak_rss_mib"] > 0 and "host_peak_rss_mib" in result.message


@pytest.mark.parametrize("value", ["nope==1.0", "transformerz==5.24.0"])
def test_unknown_library_in_versions_is_a_usage_error(tmp_path, value):
    proc = _cli(["audit", "--models", "arch:llama", "--versions", value, "-n", "0"], tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "reports" / "packcheck-matrix.json").exists()
    line = _one_error_line(proc.stderr, "ERROR:")
    assert f"Unknown library '{value.split('==')[0]}'" in line and "(from --packcheck-versions)" in line


def test_two_audits_on_one_report_folder_the_second_is_refused_naming_the_first(tmp_path):
    import time

    first = subprocess.Popen([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama,arch:opt,arch:qwen2",
                              "--packcheck-attn", "eager,sdpa", "-n", "0", "-q"], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    owner = tmp_path / "reports" / ".packcheck-run.json"
    deadline = time.time() + 120
    while time.time() < deadline and not owner.exists():
        time.sleep(0.2)
    second = _cli(["audit", "--models", "arch:gpt2", "-n", "0", "-q"], tmp_path)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 2
    line = _one_error_line(second.stderr, "ERROR:")
    assert "Report directory" in line and "is in use by another packcheck run (pid" in line and "--models arch:llama,arch:opt" in line
    doc = read_results(tmp_path / "reports" / "packcheck-matrix.json")
    assert {c["model"]["label"] for c in doc["cells"]} == {"llama", "opt", "qwen2"}  # the first run's matrix, whole
    third = _cli(["audit", "--models", "arch:gpt2", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0", "-q"], tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]  # released at the end of the first run


def _saved_tiny_llama(folder: Path, matching: bool) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=128)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    if not matching:  # a weights file of another model: no tensor name matches
        (folder / "model.safetensors").unlink()
        save_file({"transformer.h.0.attn.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("matching", [True, False])
def test_pretrained_weights_are_counted_and_a_load_that_matched_nothing_is_refused(tmp_path, tolerances, matching):
    from pytest_packcheck.analysis.diagnose import diagnose_document
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.report import render_markdown
    from pytest_packcheck.results.schema import build_document
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    folder = _saved_tiny_llama(tmp_path / "m", matching)
    resolved = resolve_model(parse_model_spec(str(folder), "--packcheck-models"), "--packcheck-models")
    runner = CellRunner([resolved], tolerances, weights="pretrained")
    (cell,) = plan_cells([resolved], ("sdpa",), ("isolation",), ("float32",))
    result = runner.run(cell)
    if matching:
        assert result.status == "pass", result.message
        assert result.metrics["weights"]["loaded"] > 0 and result.metrics["weights"]["missing"] == 0
    else:
        assert result.status == "error" and "match no tensor of LlamaForCausalLM" in result.message
        assert "random weights" in result.message
    render_markdown(diagnose_document(build_document([result], {}, {"weights": "pretrained"}, "x")))  # renders


def test_another_models_weights_in_a_local_folder_are_the_users_not_packchecks_bug(tmp_path, tolerances):
    """trial 7, 206: a folder whose weights file matches no tensor of the model its config builds is refused on
    purpose: the cell names the folder and the fix (cause weights_mismatch), never "packcheck's own code crashed ...
    report it to packcheck" (packcheck_error)."""
    from pytest_packcheck.analysis.diagnose import diagnose_document
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.results.schema import build_document
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    folder = _saved_tiny_llama(tmp_path / "m", False)
    resolved = resolve_model(parse_model_spec(str(folder), "--packcheck-models"), "--packcheck-models")
    (cell,) = plan_cells([resolved], ("sdpa",), ("isolation",), ("float32",))
    result = CellRunner([resolved], tolerances, weights="pretrained").run(cell)
    assert result.status == "error" and result.cause == "weights_mismatch", (result.cause, result.message)
    assert f"the weights files in the model folder {folder} match no tensor of LlamaForCausalLM" in result.message
    assert "--packcheck-weights=random" in result.message and "report it to packcheck" not in result.message
    (done,) = diagnose_document(build_document([result], {}, {"weights": "pretrained"}, "x"))["cells"]
    assert done["cause"] == "weights_mismatch"


def test_shrink_keeps_auto_map_for_remote_code_only():
    from transformers import LlamaConfig

    from pytest_packcheck.model.shrink import shrink_config

    config = LlamaConfig(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, name_or_path="/models/custom")
    kept = shrink_config(config, keep_auto_map=True)
    # auto_map names the classes, _name_or_path the folder their code is read from (a local remote-code model)
    assert kept.auto_map == {"AutoModelForCausalLM": "modeling_x.XForCausalLM"} and kept._name_or_path == "/models/custom"
    assert not getattr(shrink_config(config), "auto_map", None)


@pytest.mark.parametrize("args", [["lookup", "qwen2_vl", "sdpa", "5.24.0"], ["checks"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(args, tmp_path):
    """`packcheck lookup qwen2_vl sdpa 5.24.0 | head -1` (and gate's table) ended in a BrokenPipeError traceback
    (trial 4, 174 / 175): exit 141 (128 + SIGPIPE), no traceback, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-1500:]


def test_a_token_in_an_output_path_is_not_echoed_by_a_command(tmp_path, capsys):
    """`packcheck bisect ... -o out-ghp_<token>` printed "bisect written: .../out-ghp_<token>/..." in clear while every
    file was scrubbed (trial 4, 207): every command's own output is scrubbed as the files are (here atlas's
    "atlas written" line for an -o named with a token)."""
    import shutil

    from pytest_packcheck.cli import main

    token = "ghp_" + "abcdefghijklmnopqrstuvwxyz0123456789ab"
    out = tmp_path / f"out-{token}"
    out.mkdir()
    for name in ("support.json", "trl.json"):
        shutil.copy(Path(__file__).resolve().parents[1] / "reports" / "atlas" / name, out / name)
    (tmp_path / "build").mkdir()
    code = main(["atlas", "--render-only", "--build-dir", str(tmp_path / "build"), "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "atlas written:" in printed and "out-***" in printed and token not in printed, printed
    assert type(sys.stdout).__name__ != "_Scrubbed"  # restored after the command


def test_an_audit_whose_reader_goes_away_still_writes_its_matrix(tmp_path):
    """`packcheck audit ... | head -2` stopped the audit with exit 141 and an empty journal, no matrix (trial 5,
    230): the rest of the output is dropped and the run finishes as it would on a terminal."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama",
                             "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0",
                             "--packcheck-report-dir", "r"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()  # the reader takes one line, then goes away
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]
    doc = read_results(tmp_path / "r" / "packcheck-matrix.json")
    assert [c["status"] for c in doc["cells"] if c["check"] == "isolation"] == ["pass"] and "incomplete" not in doc


def test_a_journal_with_a_cut_off_line_is_warned_of_once_by_the_controller_not_by_each_worker(tmp_path):
    """Trial 19, 73: with -n 2, "skipped 3 unreadable line(s)" was printed three times (the controller and each
    xdist worker), reading like three problems. The workers read the journal without warning; the cells are the
    same."""
    import warnings
    from types import SimpleNamespace

    from pytest_packcheck.run.journal import Journal
    from pytest_packcheck.run.resume import open_journal

    settings = SimpleNamespace(resume=True, report_dir=str(tmp_path), device="cpu", tolerances={}, as_dict=dict,
                               models=["arch:llama"], model_source="--packcheck-models")
    journal, _ = open_journal(SimpleNamespace(), SimpleNamespace(**{**vars(settings), "resume": False}))
    journal.append(json.dumps(_cell("good")))
    with open(journal.path, "a") as fh:
        fh.write('{"fingerprint": "x", "cell": {"cell_id": "cut')

    def opened(config):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, resumed = open_journal(config, settings)
        return list(resumed), [str(w.message) for w in caught]

    controller, worker = opened(SimpleNamespace()), opened(SimpleNamespace(workerinput={"workerid": "gw0"}))
    assert controller[0] == worker[0] == ["good"]
    assert len(controller[1]) == 1 and "skipped 1 unreadable line" in controller[1][0] and worker[1] == []
    assert list(Journal(journal.path, journal.fp).load(warn=False)) == ["good"]


def test_a_configure_time_warning_is_one_line_in_pytests_warnings_summary_not_a_source_echo(tmp_path):
    """Trial 21, 157: a PackcheckWarning raised while the plugin configures (a misspelt $PACKCHECK_MODEL, a journal
    line cut off by a kill) was printed by Python at once, with the line of packcheck's source that raised it under
    the message ("resumed = journal.load(...)  # warned once, by the controller"), reading like a traceback. Now
    pytest's warnings summary lists it, message only, once under xdist (the workers' copies are dropped)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "packcheck-journal.jsonl").write_text('{"fingerprint": "x", "cell": {"cell_id": "cut\n')
    env = {**os.environ, "PACKCHECK_MODEL": "arch:llama", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--packcheck-models=arch:llama",
                           "--packcheck-attn=sdpa", "--packcheck-checks=isolation", f"--packcheck-report-dir={out}",
                           "--packcheck-resume", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-2000:]
    summary = text.split("warnings summary", 1)[1].split("-- Docs", 1)[0]
    assert "PackcheckWarning" not in text.split("warnings summary", 1)[0]  # nothing printed before pytest's summary
    assert summary.count("$PACKCHECK_MODEL is not one packcheck reads") == 1, summary
    assert summary.count("is not a packcheck journal: none of its 1 line(s)") == 1, summary
    assert "warnings.warn(" not in summary and "journal.load(" not in summary, summary
