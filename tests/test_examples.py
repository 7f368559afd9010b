"""The runnable examples (examples/guard_trainer.py, examples/guard_sft.py) and the GitHub Action (action.yml), run
as a user runs them: each example in its own process, clean and with a planted fault the guard must catch; the
action's bash steps as written, with ``${{ inputs.X }}`` substituted and GITHUB_STEP_SUMMARY a temporary file."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck.results.schema import read_results

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------------
# The examples

#: Put on PYTHONPATH for a faulty run: every batch the Trainer (and TRL's SFTTrainer, a subclass) hands the model
#: gets a fault after its collator, chosen by $PACKCHECK_EXAMPLE_FAULT. The examples themselves are left unchanged.
PLANT_FAULT = '''
import os

_FAULT = os.environ.get("PACKCHECK_EXAMPLE_FAULT")
if _FAULT:
    import torch
    from transformers import Trainer

    _prepare_inputs = Trainer._prepare_inputs

    def _faulty_prepare_inputs(self, inputs):
        inputs = _prepare_inputs(self, inputs)
        if _FAULT == "mask":  # a collator that keeps an all-ones attention_mask beside the packed row
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        elif _FAULT == "cache":  # use_cache=True on the training forward (a KV cache built over the packed row)
            inputs["use_cache"] = True
        elif _FAULT == "no_position_ids":  # position_ids dropped: only cu_seq_lens_q, which sdpa never reads, mark examples
            del inputs["position_ids"]
        else:
            raise ValueError(f"unknown PACKCHECK_EXAMPLE_FAULT {_FAULT!r}")
        return inputs

    Trainer._prepare_inputs = _faulty_prepare_inputs
'''

EXAMPLES = ["guard_trainer.py", "guard_sft.py"]
#: (example, fault, the cause the guard must name). Not every fault fits both: the SFT run (TRL's default gradient
#: checkpointing and fused LM head) trains without the cache whatever use_cache says, so the guard rightly passes it
#: there; the Trainer example's collator returns no cu_seq_lens_q, so without position_ids its batch is not packed.
FAULTS = [("guard_trainer.py", "mask", "mask_override"), ("guard_trainer.py", "cache", "cache_trap"),
          ("guard_sft.py", "mask", "mask_override"), ("guard_sft.py", "no_position_ids", "leak")]


def _run_example(name: str, tmp_path: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """``python examples/<name> --output-dir <tmp>/out`` from a scratch directory, offline; with ``fault``, the
    planting sitecustomize on PYTHONPATH."""
    path = [str(REPO)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PACKCHECK_EXAMPLE_FAULT", None)
    if fault:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(PLANT_FAULT)
        path.insert(0, str(site))
        env["PACKCHECK_EXAMPLE_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, str(REPO / "examples" / name), "--output-dir", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300)


def _guard_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("packcheck guard: ")]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_trains_and_prints_the_guards_pass(name, tmp_path):
    if name == "guard_sft.py":
        pytest.importorskip("trl")
    proc = _run_example(name, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _guard_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("packcheck guard: PASS on "), proc.stderr[-3000:]
    assert "trained 3 steps; guard verdict: pass" in proc.stdout
    written = json.loads((tmp_path / "out" / "packcheck-guard.json").read_text())
    assert written["verdict"] == "pass" and len(written["lengths"]) >= 2  # really packed: examples judged, not skipped


@pytest.mark.parametrize(("name", "fault", "cause"), FAULTS)
def test_example_with_a_planted_fault_stops_before_the_first_step(name, fault, cause, tmp_path):
    """The test can fail: the same example, a fault planted after its collator, and the guard says FAIL with the
    fault's cause; the example exits 1 before any optimizer step."""
    if name == "guard_sft.py":
        pytest.importorskip("trl")
    proc = _run_example(name, tmp_path, fault)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _guard_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("packcheck guard: FAIL on "), proc.stderr[-3000:]
    assert f"; cause {cause}: " in lines[0], lines[0]
    assert f"stopped before the first optimizer step: cause {cause}" in proc.stderr
    assert "trained" not in proc.stdout
    written = json.loads((tmp_path / "out" / "packcheck-guard.json").read_text())
    assert written["verdict"] == "fail" and written["cause"] == cause


# ----------------------------------------------------------------------------------------------------------------
# The GitHub Action

_INPUT = re.compile(r"\$\{\{\s*inputs\.([A-Za-z0-9_-]+)\s*\}\}")


def _action() -> dict:
    import yaml

    return yaml.safe_load((REPO / "action.yml").read_text())


def _run_action(tmp_path: Path, inputs: dict[str, str], env: dict[str, str] | None = None) -> dict:
    """Run action.yml's bash steps in order, as a runner does: ``${{ inputs.X }}`` replaced by the given value or
    the input's default (an undeclared input fails the test), ``bash --noprofile --norc -eo pipefail`` (GitHub's
    ``shell: bash``), GITHUB_ACTION_PATH this checkout, GITHUB_STEP_SUMMARY / GITHUB_OUTPUT temporary files; the
    first failing step ends the run. The ``uses:`` steps (setup-python, upload-artifact) are not run."""
    action = _action()
    declared = {name: str(spec.get("default", "")) for name, spec in action["inputs"].items()}
    assert set(inputs) <= set(declared), set(inputs) - set(declared)
    values = {**declared, **inputs}

    def render(text: str) -> str:
        return _INPUT.sub(lambda m: values[m.group(1)], str(text))

    summary, output = tmp_path / "summary.md", tmp_path / "github_output"
    summary.write_text("")
    output.write_text("")
    base = {**os.environ, **(env or {}), "GITHUB_ACTION_PATH": str(REPO), "GITHUB_STEP_SUMMARY": str(summary),
            "GITHUB_OUTPUT": str(output), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    steps = [s for s in action["runs"]["steps"] if "run" in s]
    assert [s.get("shell") for s in steps] == ["bash"] * len(steps) and not any("if" in s for s in steps)
    procs = []
    for i, step in enumerate(steps):
        script = tmp_path / f"step{i}.sh"
        script.write_text(render(step["run"]))
        step_env = {**base, **{k: render(v) for k, v in (step.get("env") or {}).items()}}
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=tmp_path, env=step_env,
                              capture_output=True, text=True, check=False, timeout=600)
        procs.append(proc)
        if proc.returncode:
            break
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return {"procs": procs, "code": procs[-1].returncode, "summary": summary.read_text(), "outputs": outputs,
            "stdout": "".join(p.stdout for p in procs)}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """A real results file: llama's sdpa isolation cell, audited here (a few seconds), saved as a baseline."""
    root = tmp_path_factory.mktemp("action")
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama", "--packcheck-attn",
                           "sdpa", "--packcheck-checks", "isolation", "-n", "0", "-q", "--save-baseline"], cwd=root,
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "reports" / "baseline.json"


def _regressed(baseline: Path, tmp_path: Path) -> Path:
    """The baseline with a planted regression: llama's sdpa isolation now leaks."""
    doc = copy.deepcopy(read_results(baseline))
    cell = next(c for c in doc["cells"] if c["cell_id"] == "llama-sdpa-isolation-float32")
    cell["status"], cell["message"] = "fail", "leak across boundaries: 3.1e-01"
    cell["metrics"]["max_change"] = 0.31  # a fail's number (an isolation fail within tolerance is a corrupt file)
    path = tmp_path / "candidate.json"
    path.write_text(json.dumps(doc))
    return path


def test_action_names_only_declared_inputs_and_its_own_steps():
    """Every ``${{ inputs.X }}`` in action.yml is a declared input (a typo would be an empty string on GitHub), every
    declared input is used, and the outputs read the gate step's."""
    action = _action()
    text = (REPO / "action.yml").read_text()
    used = set(_INPUT.findall(text)) | set(re.findall(r"\binputs\.([A-Za-z0-9_-]+)\s*!=", text))
    assert used == set(action["inputs"]), used ^ set(action["inputs"])
    ids = {s.get("id") for s in action["runs"]["steps"]}
    for output in action["outputs"].values():
        assert re.fullmatch(r"\$\{\{ steps\.([a-z-]+)\.outputs\.[a-z-]+ \}\}", output["value"]).group(1) in ids


def test_action_passes_an_unchanged_candidate_and_writes_the_summary(baseline, tmp_path):
    run = _run_action(tmp_path, {"baseline": str(baseline), "candidate": str(baseline), "install": "false"})
    assert run["code"] == 0 and len(run["procs"]) == 2, run["stdout"][-3000:] + run["procs"][-1].stderr[-3000:]
    assert "install: false, using " in run["procs"][0].stdout
    assert "packcheck gate: 0 regression(s), 0 changed cell(s)" in run["stdout"]
    assert run["summary"].startswith("### packcheck gate: no regression, 0 changed cell(s)"), run["summary"]
    assert run["outputs"] == {"exit-code": "0", "regressions": "0"}


def test_action_fails_the_step_on_a_planted_regression_unless_allowed(baseline, tmp_path):
    candidate = _regressed(baseline, tmp_path)
    run = _run_action(tmp_path, {"baseline": str(baseline), "candidate": str(candidate), "install": "false"})
    assert run["code"] == 1, run["stdout"][-3000:] + run["procs"][-1].stderr[-3000:]
    assert "REGRESSION" in run["stdout"] and "::error title=packcheck gate::1 regression(s)" in run["stdout"]
    summary = run["summary"]
    assert summary.startswith("### packcheck gate: 1 regression(s), 1 changed cell(s)"), summary
    assert "| llama " in summary and "| isolation " in summary and "**REGRESSION" in summary
    assert run["outputs"] == {"exit-code": "1", "regressions": "1"}
    # the allow input: one CELL=REASON a line, blank lines and surrounding spaces ignored
    allow = "\n  llama-sdpa=accepted for this test  \n\n"
    run = _run_action(tmp_path, {"baseline": str(baseline), "candidate": str(candidate), "install": "false", "allow": allow})
    assert run["code"] == 0 and "allowed: accepted for this test" in run["stdout"], run["stdout"][-3000:]
    assert run["summary"].startswith("### packcheck gate: no regression, 1 changed cell(s)"), run["summary"]


def test_action_says_in_the_summary_why_nothing_was_compared(baseline, tmp_path):
    missing = tmp_path / "missing.json"
    run = _run_action(tmp_path, {"baseline": str(baseline), "candidate": str(missing), "install": "false"})
    assert run["code"] == 2 and run["outputs"] == {"exit-code": "2", "regressions": ""}
    assert run["summary"].startswith("### packcheck gate: not compared (exit 2)") and f"{missing}" in run["summary"], run["summary"]
    run = _run_action(tmp_path, {"install": "false"})
    assert run["code"] == 2 and "set the action's baseline input" in run["summary"], run["summary"]


@pytest.mark.parametrize("bad_version", ["4.57.1", "5.24.0"])
def test_action_audits_two_versions_and_gates_them(tmp_path, bad_version):
    """The versions input: audit both version environments (stand-ins, offline: tests/test_robustness.py's) and
    gate the second against the first. A leak the upgrade brings fails the step; one it removes does not."""
    from test_robustness import FAKE_ENVS

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAKE_ENVS)
    env = {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}", "PACKCHECK_FAKE_ENVS": "1", "PACKCHECK_FAKE_BAD": bad_version,
           "PACKCHECK_CHECKS": "isolation"}
    inputs = {"versions": "transformers==4.57.1,5.24.0", "install": "false", "report-dir": "gate-out"}
    run = _run_action(tmp_path, inputs, env)
    assert "Traceback" not in run["procs"][-1].stderr, run["procs"][-1].stderr[-3000:]
    assert (tmp_path / "gate-out" / "packcheck-matrix.json").exists()
    assert "transformers 4.57.1 → 5.24.0" in run["summary"] and "| opt " in run["summary"], run["summary"]
    if bad_version == "4.57.1":
        assert run["code"] == 0 and run["outputs"] == {"exit-code": "0", "regressions": "0"}, run["stdout"][-3000:]
        assert run["summary"].startswith("### packcheck gate: no regression, 1 changed cell(s)")
    else:
        assert run["code"] == 1 and run["outputs"] == {"exit-code": "1", "regressions": "1"}, run["stdout"][-3000:]
        assert run["summary"].startswith("### packcheck gate: 1 regression(s), 1 changed cell(s)")
