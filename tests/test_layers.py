"""The layers of pytest_packcheck hold (.importlinter: each layer imports only from those below it, imports inside
functions included), and the check can fail: an upward import, two parts of one layer that import each other and a
module no layer names are each refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / ".importlinter"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports --config .importlinter`` on the package under ``root`` (found first on PYTHONPATH), no cache."""
    exe = Path(sys.executable).parent / "lint-imports"
    command = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}  # no line of the report wrapped
    return subprocess.run([*command, "--config", ".importlinter", "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_layers_contract_holds():
    run = _lint_imports(REPO)
    assert run.returncode == 0 and "KEPT" in run.stdout, run.stdout + run.stderr


def _copy(tmp_path: Path) -> Path:
    """The package's sources and the contract, copied under ``tmp_path``."""
    shutil.copytree(REPO / "pytest_packcheck", tmp_path / "pytest_packcheck",
                    ignore=shutil.ignore_patterns("__pycache__", "_atlas", "_audit"))
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    return tmp_path


@pytest.mark.parametrize(("module", "planted", "said"), [
    # a results module (low) reaching into the runner (high), inside a function: an import the layers forbid
    ("results/metrics.py", "\n\ndef _planted():\n    from ..run import runner\n\n    return runner\n",
     "pytest_packcheck.results.metrics -> pytest_packcheck.run.runner"),
    # the guard and the atlas share a layer as independent parts
    ("guard/result.py", "\n\ndef _planted():\n    from ..atlas import plan\n\n    return releases\n",
     "pytest_packcheck.guard.result -> pytest_packcheck.atlas.plan"),
    # a new top-level module no layer names
    ("unplaced.py", '"""A module no layer names."""\n', "pytest_packcheck.unplaced"),
], ids=["upward", "siblings", "unplaced"])
def test_a_planted_break_of_the_layers_is_reported(tmp_path, module, planted, said):
    root = _copy(tmp_path)
    target = root / "pytest_packcheck" / module
    target.write_text((target.read_text() if target.exists() else "") + planted)
    run = _lint_imports(root)
    assert run.returncode != 0 and "BROKEN" in run.stdout + run.stderr and said in run.stdout, run.stdout + run.stderr
