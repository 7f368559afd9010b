"""The stack elements through the trainers per release (atlas/stack_axis.py, tools/stack_releases.py) and peft /
accelerate as version axes (versions/envs.py): a release whose trainer decides otherwise becomes its own run and a
named transition; a run that recorded another library version than its release is refused; a version environment
gets the stack elements' library; a cell that ran another peft than its environment pins is an error, not a
measurement of that release."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck.atlas import stack_axis as A
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.versions import envs


def _mode(settled_pf="forced", to_model=True, status="pass", grads=3e-7, **extra):
    entry = {"status": status, "decision": "accepted", "asked": {"packing": True, "padding_free": False},
             "settled": {"packing": "kept", "padding_free": settled_pf}, "position_ids_in_batch": True,
             "position_ids_to_model": to_model, "grad_rel_err": grads, "logits_max_abs_diff": grads, "loss_delta": 0.0,
             "decided_at": "trl/trainer/sft_trainer.py:916", **extra}
    if status == "fail":
        entry["cause"] = "adapter_positions"
    return entry


def _doc(modes_by_element: dict[str, dict[str, dict]], peft: str = "0.21.2") -> dict:
    cells = []
    for element, modes in modes_by_element.items():
        cells.append({"cell_id": f"llama+{element}-sdpa-stack_trainers-float32", "check": "stack_trainers", "backend": "sdpa",
                      "dtype": "float32", "stack": element, "status": "pass",
                      "metrics": {"stack": {"element": element, "peft": peft}, "modes": modes}})
    return {"cells": cells}


def test_a_release_whose_trainer_decides_otherwise_is_its_own_run_and_a_named_transition():
    axis = A.AXES["trl"]
    same = {"prompt_tuning": {"sft_packing": _mode(to_model=False, status="fail", grads=0.6,
                                                   position_ids_dropped_at="peft/peft_model.py:1673")}}
    # the planted release: SFTTrainer no longer forces padding_free for packing (it would be 'off')
    other = {"prompt_tuning": {"sft_packing": _mode(settled_pf="off", to_model=False, status="fail", grads=0.5,
                                                    decided_at="trl/trainer/sft_trainer.py:402")}}
    reduced = {"0.19.1": A.reduce_release(_doc(other)), "0.20.0": A.reduce_release(_doc(same)),
               "0.21.0": A.reduce_release(_doc({"prompt_tuning": {"sft_packing": _mode(
                   to_model=False, status="fail", grads=0.7)}}))}
    block = A.stack_block(axis, reduced, {v: {"wall_s": 30.0, "versions": {"trl": v, "peft": "0.21.2"}} for v in reduced})
    runs = block["rows"]["prompt_tuning"]["sft_packing"]
    assert [r[:2] for r in runs] == [["0.19.1", "0.19.1"], ["0.20.0", "0.21.0"]]
    assert runs[1][2]["grad_rel_err"] == 0.7  # the run's largest number, its decision unchanged
    moves = A.transitions(block)
    assert moves == [("prompt_tuning / sft_packing: 0.19.1 -> 0.20.0: settled packing kept, padding_free off -> "
                     "packing kept, padding_free forced")]
    assert block["lines"]["0.19.1"]["decided_at"] == "trl/trainer/sft_trainer.py:402"
    assert block["lines"]["0.20.0"]["position_ids_dropped_at"] == "peft/peft_model.py:1673"
    assert block["held"] == {"peft": "0.21.2"} and block["cost"]["0.21.0"]["wall_s"] == 30.0
    text = A.markdown({"axes": {"trl": block}})
    assert "| prompt_tuning | sft_packing | 0.20.0 .. 0.21.0 | accepted; packing kept; padding_free forced; " \
           "position_ids batch ✓ model ✗; fail (adapter_positions): grads 7.0e-01" in text
    assert "padding_free decided at `trl/trainer/sft_trainer.py:402`" in text and "0.19.1 -> 0.20.0" in text


def test_a_release_without_the_cell_breaks_a_run_and_a_skipped_cell_keeps_its_reason():
    axis = A.AXES["peft"]
    skipped = {"cells": [{"check": "stack_trainers", "backend": "sdpa", "stack": "dora", "status": "skipped",
                          "message": "stack element dora needs peft >= 0.9.0 (installed: 0.8.2)", "metrics": {}}]}
    rows, _ = A.reduce_release(skipped)
    assert rows == {"dora": {"*": {"status": "skipped", "why": "stack element dora needs peft >= 0.9.0 (installed: 0.8.2)"}}}
    # the release's environment path is cut from the reason: two releases failing alike are one run, not a transition
    cut = {"cells": [{**skipped["cells"][0], "message": "model build: ImportError: cannot import name 'HybridCache' from "
                      "'transformers' (~/.cache/packcheck/envs/peft-0.16.0-trl-1.16.0-f7d5dc8d78a1/lib/python3.11/site-"}]}
    assert A.reduce_release(cut)[0]["dora"]["*"]["why"] == "model build: ImportError: cannot import name 'HybridCache' from 'transformers'"
    same = A.reduce_release(_doc({"lora": {"trainer": _mode()}}))
    block = A.stack_block(axis, {"0.13.2": same, "0.14.0": same})
    assert block["rows"]["lora"]["trainer"][0][:2] == ["0.13.2", "0.14.0"]
    # a release in between where the element's cell is missing breaks the run: no run claims a release it lacks
    block = A.stack_block(axis, {"0.13.2": same, "0.14.0": A.reduce_release(skipped), "0.15.2": same})
    assert [r[:2] for r in block["rows"]["lora"]["trainer"]] == [["0.13.2", "0.13.2"], ["0.15.2", "0.15.2"]]
    assert not any(t.startswith("lora / trainer") for t in A.transitions(block))  # the same decision: no transition


def test_a_run_that_recorded_another_peft_than_its_release_is_refused():
    axis = A.AXES["peft"]
    doc = _doc({"lora": {"trainer": _mode()}}, peft="0.21.2")  # planted: the env imported this machine's peft
    with pytest.raises(PackcheckUsageError, match=r"ran peft 0\.21\.2, not 0\.17\.1"):
        A.check_stack_version(axis, "0.17.1", doc, "/b/peft/0.17.1")
    A.check_stack_version(axis, "0.21.2", doc, "/b/peft/0.21.2")  # its own release: fine
    A.check_stack_version(A.AXES["trl"], "1.16.0", doc, "/b/trl/1.16.0")  # trl is not recorded per cell: nothing to hold


def test_one_release_runs_in_its_combination_resumes_and_is_not_run_again(tmp_path):
    axis = A.AXES["accelerate"]
    combo = A.combo_of(axis, "1.12.0", installed=lambda name: {"trl": "1.16.0", "peft": "0.21.2"}[name])
    assert combo.requirements == ("accelerate==1.12.0", "trl==1.16.0", "peft==0.21.2")
    seen = []

    def ensure(c, log=None):
        seen.append(c.requirements[0])
        return envs.VersionEnv(c, Path("/tmp/env"), Path(sys.executable), {"accelerate": "1.12.0", "trl": "1.16.0"}, True, 1.5)

    def runner(args, **kw):
        assert "--packcheck-stack=cp" in args and "--packcheck-checks=stack_trainers" in args
        assert kw["env"]["PACKCHECK_ENV_LABEL"].startswith("accelerate==1.12.0+")
        out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--packcheck-report-dir=")))
        (out / "packcheck-matrix.json").write_text(json.dumps(_doc({"cp": {"trainer": _mode()}})))
        return subprocess.CompletedProcess(args, 1)

    record = A.run_release(axis, "1.12.0", tmp_path, log=lambda _s: None, runner=runner, ensure=ensure)
    assert record["cells"] == 1 and record["env_seconds"] == 1.5 and seen == ["accelerate==1.12.0"]

    def must_not_run(args, **kw):
        raise AssertionError("a done release ran again")

    assert A.run_release(axis, "1.12.0", tmp_path, log=lambda _s: None, runner=must_not_run, ensure=ensure)["cells"] == 1


# ----------------------------------------------------------------------------------------------------------------
# peft and accelerate as version axes


def test_peft_and_accelerate_are_version_axes():
    combos = envs.parse_versions(["peft==0.17.1,0.21.2", "accelerate==1.12.0"], "--packcheck-versions")
    assert [c.label for c in combos] == ["peft==0.17.1+accelerate==1.12.0", "peft==0.21.2+accelerate==1.12.0"]
    with pytest.raises(PackcheckUsageError, match="Unknown library 'pefft'"):
        envs.parse_versions(["pefft==0.17.1"], "--packcheck-versions")


def test_a_version_environment_gets_the_stack_elements_library_at_this_environments_version():
    from importlib import metadata

    from pytest_packcheck.config.options import default_of
    from pytest_packcheck.config.settings import Settings

    settings = Settings(models=("arch:llama",), model_source="test", backends=("sdpa",), checks=("isolation",),
                        dtypes=("float32",), weights="random", device="cpu", trust_remote_code=False,
                        report_dir=default_of("--packcheck-report-dir"), tolerances={}, stack=("lora", "cp", "compile"))
    assert settings.stack_libraries == ("peft", "accelerate")
    peft = metadata.version("peft")
    on_accelerate = envs.check_requirements(("isolation",), envs.VersionCombo(("accelerate==1.12.0",)), ("peft", "accelerate"))
    assert on_accelerate == (f"peft=={peft}",)  # accelerate is the axis; peft held here (before: not installed at all)
    assert envs.check_requirements(("isolation",), envs.VersionCombo(("peft==0.17.1",)), ("peft",)) == ()
    assert envs.check_requirements(("isolation",), envs.VersionCombo(("transformers==5.24.0",)), ("accelerate",)) == ()
    assert envs.check_requirements(("isolation",), envs.VersionCombo(("transformers==5.24.0",)), ("liger-kernel",)) == ()


def test_a_cell_that_ran_another_peft_than_its_environment_is_an_error_not_a_measurement(monkeypatch):
    from pytest_packcheck.run.version_cells import VersionCells

    combo = envs.VersionCombo(("peft==0.17.1",))
    child = {"cell_id": "llama+lora-sdpa-isolation-float32", "model": {"model_type": "llama"}, "backend": "sdpa",
             "check": "isolation", "dtype": "float32", "status": "pass", "stack": "lora",
             "metrics": {"max_abs_diff": 0.0, "stack": {"element": "lora", "peft": "0.21.2"}}}  # planted: not 0.17.1
    assert "ran peft 0.21.2, not peft==0.17.1" in envs.stack_version_mismatch(combo, child)
    assert envs.stack_version_mismatch(combo, {**child, "metrics": {"stack": {"peft": "0.17.1"}}}) is None
    assert envs.stack_version_mismatch(envs.VersionCombo(("accelerate==1.12.0",)), child) is None

    class Cell:
        env, base_id, cell_id, model_index, backend, check, dtype = combo.label, "b", "c", 0, "sdpa", "isolation", "float32"

    cells = VersionCells.__new__(VersionCells)
    cells.settings = type("S", (), {"versions": [combo], "weights": "random", "tolerances": {}})()
    cells.runs = {combo.label: {"label": combo.label, "requirements": list(combo.requirements), "versions": {},
                                "environment": {}, "env_created": False, "env_seconds": 0.0, "run_seconds": 0.0,
                                "log": "l", "error": None, "cells": {"b": child}}}
    result = cells.result(Cell(), [])
    assert result.status == "error" and "ran peft 0.21.2" in result.message
    cells.runs[combo.label]["cells"]["b"] = {**child, "metrics": {"stack": {"element": "lora", "peft": "0.17.1"}}}
    assert cells.result(Cell(), []).status == "pass"


def test_the_committed_stack_md_is_what_the_committed_stack_json_renders():
    atlas = Path(__file__).resolve().parents[1] / "reports" / "atlas"
    doc = json.loads((atlas / A.STACK_FILE).read_text())
    assert doc["schema_version"] == A.STACK_SCHEMA_VERSION and set(doc["axes"]) <= set(A.AXES)
    assert (atlas / "stack.md").read_text() == A.markdown(doc), "run: python tools/stack_releases.py --axis trl --render-only"
    for name, block in doc["axes"].items():
        assert block["releases"] and set(block["lines"]) == set(block["releases"]), name
        for modes in block["rows"].values():
            for runs in modes.values():  # runs cover measured releases in order, none twice
                spans = [(block["releases"].index(a), block["releases"].index(b)) for a, b, _ in runs]
                assert all(a <= b for a, b in spans) and all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(spans))


def test_the_libraries_own_deciding_line_is_read_from_the_releases_installed_file(tmp_path):
    axis = A.AXES["accelerate"]
    hook = tmp_path / "accelerate" / "big_modeling.py"
    hook.parent.mkdir()
    hook.write_text('def _attach_context_parallel_hooks(model):\n    module_kwargs["attention_mask"] = None\n'
                    '    module_kwargs["is_causal"] = True\n')
    assert A.source_lines(axis, tmp_path) == {"hook_at": "accelerate/big_modeling.py:3"}
    hook.write_text("def _attach_context_parallel_hooks(model):\n    pass\n")  # a release without that line: no key
    assert A.source_lines(axis, tmp_path) == {}
    assert A.source_lines(axis, tmp_path / "missing") == {}


def test_releases_not_measured_are_named_and_no_run_claims_them():
    same = A.reduce_release(_doc({"lora": {"trainer": _mode()}}))
    block = A.stack_block(A.AXES["trl"], {"1.4.0": same, "1.16.0": same}, missing=["1.15.0", "1.10.0"])
    assert block["missing"] == ["1.10.0", "1.15.0"]
    text = A.markdown({"axes": {"trl": block}})
    assert "Not measured yet: 1.10.0, 1.15.0" in text and "| lora | trainer | 1.4.0 .. 1.16.0 |" in text
