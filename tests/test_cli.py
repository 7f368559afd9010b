"""`packcheck audit` end to end on a small audit file, and its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=cwd, capture_output=True, text=True, check=False)


def test_audit_writes_matrix_and_survives_a_broken_model(tmp_path):
    audit = tmp_path / "small.toml"
    # dbrx's default config does not build in transformers 5.24 (clip_qkv=None): an error cell, the run goes on
    audit.write_text('[audit]\nname = "small"\nmodels = ["arch:llama", "arch:dbrx"]\nbackends = ["sdpa"]\nchecks = ["isolation", "logits_parity"]\n')
    proc = _run(["audit", "--audit", str(audit), "-n", "0", "-q"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "reports" / "packcheck-matrix.json").read_text())
    status = {c["cell_id"]: c["status"] for c in doc["cells"]}
    assert status["llama-sdpa-isolation-float32"] == "pass"
    assert status["dbrx-sdpa-isolation-float32"] == "error"
    md = (tmp_path / "reports" / "packcheck-matrix.md").read_text()
    assert "packcheck support matrix — small" in md and "packcheck audit --audit" in md


def test_audit_usage_error_exit_code(tmp_path):
    proc = _run(["audit", "--models", "arch:llama", "--packcheck-attn", "nope", "-n", "0"], tmp_path)
    assert proc.returncode == 2
    assert "Unknown backend 'nope' (from --packcheck-attn)" in proc.stderr


def test_bad_worker_count_is_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "-n", "abc", "--models", "arch:llama"],
                          capture_output=True, text=True, check=False, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "packcheck audit: error: -n/--workers 'abc' must be a number of workers (0: this process) or auto."]
