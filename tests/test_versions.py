"""The version axis: parsing, environments layered over this torch, running the plugin in them, the matrix.

The tests marked ``slow`` build real environments with other transformers versions from the package index
(run them with ``PACKCHECK_RUN_SLOW=1 python -m pytest tests -m slow``); one real multi-version audit runs in
``.ci/run`` (``test_real_audit_sdpa_before_and_after_packed_masks``), and one old-release varlen reference
(``test_real_reference_on_4_44_2_runs_that_release_flash_path``).
"""

from __future__ import annotations

import json
import os
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results.schema import read_results
from pytest_packcheck.versions import envs


def test_axes_multiply_and_combinations_are_kept():
    combos = envs.parse_versions(["transformers==4.51.3,5.24.0", "trl==0.19.1,1.16.0"], "--versions")
    assert [c.label for c in combos] == [
        "transformers==4.51.3+trl==0.19.1", "transformers==4.51.3+trl==1.16.0",
        "transformers==5.24.0+trl==0.19.1", "transformers==5.24.0+trl==1.16.0",
    ]
    assert [c.requirements for c in envs.parse_versions(["transformers>=4.54, <5"], "x")] == [("transformers>=4.54,<5",)]
    pairs = envs.parse_versions(["transformers==4.51.3 & trl==0.17.0", "transformers==5.24.0 & trl==1.16.0"], "x")
    assert [c.requirements for c in pairs] == [("transformers==4.51.3", "trl==0.17.0"), ("transformers==5.24.0", "trl==1.16.0")]


@pytest.mark.parametrize(("value", "expected"), [
    ("transformers", "Unparsable version specifier 'transformers'"),
    ("torch==2.5.1", "bound to this machine's hardware"),
    ("transfromers==4.51.3", "Did you mean 'transformers'?"),
    ("transformers==4.5x", "Unparsable version specifier 'transformers==4.5x'"),
    ("transformers=4.51", "Unparsable item '=4.51'"),
    ("transformers==4.51.3,,5.24.0", "Empty item"),
    ("transformers==4.51.3,5.24.0 & trl==1.16.0", "a combination takes one version per library"),
    ("transformers==4.51.3 & transformers==5.24.0", "names a library twice"),
])
def test_bad_version_specifiers_are_one_line_usage_errors(value, expected):
    with pytest.raises(PackcheckUsageError) as exc:
        envs.parse_versions([value], "--packcheck-versions")
    message = str(exc.value)
    assert expected in message and "--packcheck-versions" in message and "\n" not in message


def test_same_library_on_two_axes_is_refused():
    with pytest.raises(PackcheckUsageError, match="given twice"):
        envs.parse_versions(["transformers==4.51.3", "transformers==5.24.0"], "--versions")


def test_env_key_follows_the_exact_requirement_set():
    a, b = envs.parse_versions(["transformers==4.51.3,5.24.0"], "x")
    again = envs.parse_versions(["transformers==4.51.3"], "another source")[0]
    assert a is not again and envs.env_key(again) == envs.env_key(a) != envs.env_key(b)
    # the same label from another requirement string: the label does not make the key, the requirements do
    spaced = envs.VersionCombo(("transformers >=4.51.3",))
    assert spaced.label == envs.VersionCombo(("transformers>=4.51.3",)).label
    assert envs.env_key(spaced) != envs.env_key(envs.VersionCombo(("transformers>=4.51.3",)))
    pair = envs.parse_versions(["transformers==4.51.3 & trl==0.17.0"], "x")[0]
    assert envs.env_key(pair) not in (envs.env_key(a), envs.env_key(b))
    assert envs.env_key(a).startswith("transformers-4.51.3-")


def test_hardware_bound_packages_are_linked_not_installed():
    names = {envs.canonical(d.metadata["Name"]) for d in envs._hardware_dists()}
    assert "torch" in names
    base = envs._base_requirements(envs.parse_versions(["trl==1.16.0"], "x")[0])
    assert not any(envs.is_hardware_bound(r.split("=")[0].split(">")[0].split("<")[0]) for r in base)
    assert f"transformers=={metadata.version('transformers')}" in base  # an axis over trl alone keeps transformers
    assert "sympy" in " ".join(base)  # torch's own pure-Python dependencies are installed, torch is not


def _fake_dist(site: Path, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *[f"Requires-Dist: {r}" for r in requires]]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_a_library_that_needs_another_torch_is_named(tmp_path):
    """Planted: a library in the environment requires a torch the linked one does not satisfy."""
    _fake_dist(tmp_path, "needs_new_torch", "1.0", ["torch>=99.0"])
    with pytest.raises(envs.EnvError) as exc:
        envs._check_hardware_requirements(tmp_path)
    assert "needs_new_torch 1.0 needs torch>=99.0" in str(exc.value) and "never installs another" in str(exc.value)
    ok = tmp_path / "ok"
    _fake_dist(ok, "fine", "1.0", ["torch>=2.0", "numpy"])
    envs._check_hardware_requirements(ok)  # no error


def test_uv_reason_is_one_line():
    out = ("  × No solution found when resolving dependencies:\n  ╰─▶ Because trl==1.16.0 depends on transformers>=4.56.2 and you "
           "require transformers==4.51.3, we can conclude that your requirements are unsatisfiable.\n")
    reason = envs._uv_reason(out)
    assert reason.startswith("Because trl==1.16.0 depends on transformers>=4.56.2") and "\n" not in reason


def test_gpu_per_xdist_worker():
    from pytest_packcheck.run.process import gpu_for_worker

    assert gpu_for_worker("gw0", ["0", "1"]) == "0" and gpu_for_worker("gw3", ["0", "1"]) == "1"
    assert gpu_for_worker("gw1", ["4", "6", "7"]) == "6"
    assert gpu_for_worker("gw1", ["0"]) is None and gpu_for_worker("gw1", []) is None
    assert gpu_for_worker("master", ["0", "1"]) is None


def _cell(label, env, status, backend="sdpa", check="isolation", versions=None):
    return {"cell_id": f"{label}-{backend}-{check}-float32@{env}", "model": {"label": label, "model_type": label, "model_class": "X"},
            "backend": backend, "check": check, "dtype": "float32", "status": status, "metrics": {"max_change": 0.28 if status == "fail" else 0.0},
            "message": "leak" if status == "fail" else "ok", "tolerances": {"isolation_atol": 1e-5},
            "env": {"label": env, "requirements": [env], "versions": versions or {"transformers": env.split("==")[1]},
                    "environment": {"torch": "2.13.0+cpu"}, "env_created": False, "env_seconds": 0.05, "run_seconds": 9.0,
                    "log": "logs/x.log"}}


def _doc(cells):
    from pytest_packcheck.results.schema import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "environment": {"torch": "2.13.0+cpu", "transformers": "5.24.0", "device": "cpu"},
            "settings": {"backends": ["sdpa"], "checks": ["isolation"], "versions": []}, "command": "x", "cells": cells}


def test_matrix_has_one_column_per_version_environment():
    from pytest_packcheck.report import render_markdown

    doc = _doc([_cell("llama", "transformers==5.24.0", "pass"), _cell("llama", "transformers==4.51.3", "fail")])
    md = render_markdown(doc)
    header = next(line for line in md.splitlines() if line.startswith("| model") and "transformers" in line)
    assert header.index("transformers 4.51.3") < header.index("transformers 5.24.0")  # ordered by version
    row = next(line for line in md.splitlines() if line.startswith("| llama ") and "sdpa" in line)
    assert "❌" in row and "✅" in row
    assert "## Version environments" in md and "cached in 0.1 s" in md
    from pytest_packcheck.report.formats import render_details

    assert "**float32, transformers 4.51.3**" in render_details(doc)


def test_a_versions_runs_terminal_header_labels_the_controllers_versions():
    """A --packcheck-versions run: the terminal's first line showed the controller's versions unlabelled ("torch ...,
    trl 1.16.0") though the cells ran with others; it is labelled as the controller's, as the Markdown is. A run
    without version environments keeps the plain line."""
    from pytest_packcheck.report import render_markdown
    from pytest_packcheck.report.formats import render_terminal

    doc = _doc([_cell("llama", "transformers==5.24.0", "pass")])
    first = render_terminal(doc, [])[0]
    assert first.startswith("Controller (each version environment ran its own cells") and "transformers 5.24.0" in first
    assert "Controller (each version environment ran its own cells" in render_markdown(doc)
    plain = dict(doc, cells=[{**doc["cells"][0], "env": None, "cell_id": "llama-sdpa-isolation-float32"}])
    assert render_terminal(plain, [])[0].startswith("torch 2.13.0+cpu, transformers 5.24.0")


def test_training_modes_table_gives_each_mode_its_number():
    """A column per way of training packed: Trainer (with the use_cache=False number when only that is right),
    the grad-accum num_items_in_batch, SFT default / padding_free / each strategy; wrapped is shown, not judged;
    a strategy the TRL version lacks is dropped from the table."""
    from pytest_packcheck.report import render_markdown

    env = "transformers==4.56.2"
    trainer = _cell("llama", env, "fail", check="trainer")
    trainer["metrics"] = {"as_configured": {"max_loss_delta": 0.05}, "use_cache_false": {"max_loss_delta": 1e-7},
                          "grad_accum": {"packed": {"num_items_in_batch": [55, 55], "expected": 51}}}
    strategies = _cell("llama", env, "fail", check="sft_strategies")
    strategies["message"] = "bfd: 3-step training, packed vs padded loss diverge at step 1 (6.2 vs 6.0) (trl 0.21.0)"
    strategies["metrics"] = {"strategies": {
        "bfd": {"available": True, "steps": {"max_loss_delta": 0.2}},
        "bfd_split": {"available": False, "reason": "ValueError"},
        "wrapped": {"available": True, "steps": {"max_loss_delta": 6e-3}}}}
    free = _cell("llama", env, "pass", check="sft_padding_free")
    free["metrics"] = {"steps": {"max_loss_delta": 4.8e-7}}
    md = render_markdown(_doc([trainer, strategies, free]))
    section = md.split("## Training modes")[1].split("## ")[0]
    header = next(line for line in section.splitlines() if line.startswith("| model"))
    assert "SFT bfd " in header and "SFT wrapped" in header and "SFT bfd_split" not in header and "SFT ffd" not in header
    row = next(line for line in section.splitlines() if line.startswith("| llama"))
    assert "❌ 5.0e-02; use_cache=False 1.0e-07" in row and "❌ 55 of 51" in row
    assert "✅ 4.8e-07" in row and "❌ 2.0e-01" in row and "ℹ️ 6.0e-03 (by design)" in row


def test_gate_compares_cells_of_the_same_environment():
    from pytest_packcheck.analysis.gate import compare, regressions

    base = _doc([_cell("llama", "transformers==4.51.3", "fail"), _cell("llama", "transformers==5.24.0", "pass")])
    same = compare(base, base)
    assert same == []
    worse = _doc([_cell("llama", "transformers==4.51.3", "fail"), _cell("llama", "transformers==5.24.0", "fail")])
    bad = regressions(compare(base, worse))
    assert [c.key[4] for c in bad] == ["transformers==5.24.0"]


def test_environment_that_cannot_be_made_becomes_error_cells(pytester):
    """An unsatisfiable combination is an error cell per cell, with uv's reason; the run and the matrix survive."""
    pytester.makeconftest("""
import pytest_packcheck.versions.envs as envs

def refuse(combo, log=None):
    raise envs.EnvError(" ".join(combo.requirements) + ": not installable: Because trl>=1.16.0 depends on transformers>=4.56.2 ...")

envs.ensure_env = refuse
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--packcheck-models=arch:llama", "--packcheck-attn=sdpa",
                                           "--packcheck-checks=isolation", "--packcheck-versions=transformers==4.51.3 & trl==1.16.0",
                                           f"--packcheck-report-dir={pytester.path / 'out'}")
    result.assert_outcomes(failed=1)
    doc = read_results(pytester.path / "out" / "packcheck-matrix.json")
    (cell,) = doc["cells"]
    assert cell["cell_id"] == "llama-sdpa-isolation-float32@transformers==4.51.3+trl==1.16.0"
    assert cell["status"] == "error" and "not installable: Because trl>=1.16.0" in cell["message"]


# ----------------------------------------------------------------------------------------------------------------
# Real environments (the package index is reachable; torch is never downloaded)


@pytest.fixture(scope="module")
def version_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("packcheck-cache")


def _audit(pytester, monkeypatch, cache, versions: str, models: str, attn: str, checks: str) -> dict:
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(cache))
    torch_before = metadata.distribution("torch").version
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--packcheck-models={models}", f"--packcheck-attn={attn}",
                       f"--packcheck-checks={checks}", f"--packcheck-versions={versions}",
                       f"--packcheck-report-dir={pytester.path / 'out'}")
    assert metadata.distribution("torch").version == torch_before
    doc = read_results(pytester.path / "out" / "packcheck-matrix.json")
    return {c["cell_id"]: c for c in doc["cells"]}


def test_real_audit_sdpa_before_and_after_packed_masks(pytester, monkeypatch, version_cache):
    """eager and sdpa on a packed row: transformers 4.51.3 has no packed mask (before 4.53.1) -> examples attend
    across boundaries; the installed 5.x -> pass (the checks run with use_cache=False). Each environment
    reuses this torch: no torch is installed into it."""
    current = metadata.version("transformers")
    cells = _audit(pytester, monkeypatch, version_cache, f"transformers==4.51.3,{current}", "arch:llama", "eager,sdpa",
                   "isolation,logits_parity")
    for backend in ("eager", "sdpa"):
        old = cells[f"llama-{backend}-isolation-float32@transformers==4.51.3"]
        new = cells[f"llama-{backend}-isolation-float32@transformers=={current}"]
        assert old["status"] == "fail" and old["metrics"]["max_change"] > 1e-2, old["message"]
        assert new["status"] == "pass" and new["metrics"]["max_change"] < 1e-5, new["message"]
        assert old["env"]["versions"]["transformers"] == "4.51.3"
        assert old["env"]["environment"]["torch"] == metadata.distribution("torch").version
        assert old["diagnosis"]["cause"] == "leak" and "no-packed-mask-before-4.54" in old["diagnosis"]["known_faults"]
        assert old["diagnosis"]["remedy"].startswith("upgrade transformers to >= 4.53.1")
        assert new["diagnosis"] is None
        assert cells[f"llama-{backend}-logits_parity-float32@transformers==4.51.3"]["status"] == "fail"
        assert cells[f"llama-{backend}-logits_parity-float32@transformers=={current}"]["status"] == "pass"
    md = (pytester.path / "out" / "packcheck-matrix.md").read_text()
    assert "transformers 4.51.3" in md and f"transformers {current}" in md


@pytest.mark.slow
def test_real_integer_labels_raise_inside_the_collator_on_4_56_2(pytester, monkeypatch, version_cache):
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==4.56.2", "arch:llama", "sdpa", "collate")
    cell = cells["llama-collate-float32@transformers==4.56.2"]
    assert cell["status"] == "fail" and "TypeError" in cell["metrics"]["integer_labels"]
    assert "[labels contract]" in cell["message"]
    assert cell["diagnosis"]["cause"] == "labels_contract"
    assert "flattening-collator-integer-labels" in cell["diagnosis"]["known_faults"]


@pytest.mark.slow
def test_real_all_ones_mask_overrides_boundaries_on_every_version(pytester, monkeypatch, version_cache):
    """sdpa + an all-ones attention_mask -> leak on every version; without the mask -> pass from 4.54 on."""
    versions = ["4.51.3", "4.56.2", "5.14.1", metadata.version("transformers")]
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==" + ",".join(versions), "arch:llama", "sdpa",
                   "isolation,mask_trap")
    for v in versions:
        trap = cells[f"llama-sdpa-mask_trap-float32@transformers=={v}"]
        assert trap["status"] == "fail" and trap["metrics"]["max_abs_diff_with_mask"] > 1e-2, (v, trap["message"])
        if v != "4.51.3":  # there the row leaks without the mask too: no mask to blame
            assert "attention-mask-overrides-packing" in trap["diagnosis"]["known_faults"], v
        isolation = cells[f"llama-sdpa-isolation-float32@transformers=={v}"]["status"]
        assert isolation == ("fail" if v == "4.51.3" else "pass"), v


@pytest.mark.slow
def test_real_roberta_positions_and_leak_are_told_apart(pytester, monkeypatch, version_cache):
    """xlm-roberta decoder on 5.14.1: the collator restarts positions at 0 (no position_ids_start) -> logits
    differ by ~0.4; from padding_idx + 1 they differ by ~2e-3 on sdpa only: a leak that position_ids_start does
    not fix (boundaries never reach attention), while the varlen path matches exactly on 5.24."""
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==5.14.1,5.24.0", "arch:xlm-roberta",
                   "sdpa,packcheck_flash_ref", "isolation,logits_parity")
    old = cells["xlm-roberta-sdpa-logits_parity-float32@transformers==5.14.1"]["metrics"]
    assert old["max_abs_diff_solo"] > 0.1 and old["max_abs_diff_zero_based_positions"] > 0.1
    assert 1e-4 < old["max_abs_diff_start_based_positions"] < 1e-1
    diagnosis = cells["xlm-roberta-sdpa-logits_parity-float32@transformers==5.14.1"]["diagnosis"]
    assert diagnosis["cause"] == "leak"  # the part that stays (isolation moves on sdpa)
    assert [f["cause"] for f in diagnosis["findings"]] == ["wrong_positions"]  # the part position_ids_start fixes
    assert "roberta-positions-without-position_ids_start" in diagnosis["known_faults"]
    assert ">= 5.15.0" in diagnosis["findings"][0]["remedy"]
    new_sdpa = cells["xlm-roberta-sdpa-logits_parity-float32@transformers==5.24.0"]
    assert new_sdpa["status"] == "fail" and 1e-4 < new_sdpa["metrics"]["max_abs_diff_solo"] < 1e-1
    assert cells["xlm-roberta-packcheck_flash_ref-logits_parity-float32@transformers==5.24.0"]["status"] == "pass"


def test_cached_environment_follows_the_running_packcheck(tmp_path, monkeypatch):
    """A cached environment made by another checkout is re-pointed at the packcheck that runs now."""
    overlay = tmp_path / "packcheck-overlay"
    overlay.mkdir()
    (overlay / "pytest_packcheck").symlink_to(tmp_path)
    envs._relink_package(overlay)
    assert Path(os.readlink(overlay / "pytest_packcheck")) == envs._package_root()


@pytest.mark.slow
def test_real_trainer_on_4_56_2_normalisation_and_cache(pytester, monkeypatch, version_cache):
    """transformers 4.56.2's Trainer: the packed run as configured keeps use_cache=True (the cache trap: right
    only with use_cache=False, against packcheck's hand-written reference), and Trainer's own padded run divides
    by the label count before the shift (28/31 of the reference loss: a finding, not the packed run's fault);
    5.24 (TrainingArguments.use_cache=False, shifted count) -> pass."""
    current = metadata.version("transformers")
    cells = _audit(pytester, monkeypatch, version_cache, f"transformers==4.56.2,{current}", "arch:llama", "sdpa", "trainer")
    old = cells["llama-sdpa-trainer-float32@transformers==4.56.2"]
    assert old["status"] == "fail" and "correct only with use_cache=False" in old["message"], old["message"]
    assert old["metrics"]["use_cache_false"]["max_loss_delta"] < 1e-5 < old["metrics"]["as_configured"]["max_loss_delta"]
    assert abs(old["metrics"]["padded_trainer"]["loss_ratio"] - 28 / 31) < 1e-3
    assert old["metrics"]["grad_accum"]["packed"]["num_items_in_batch"] == [51, 51]
    assert old["metrics"]["grad_accum"]["padded"]["num_items_in_batch"] == [57, 57]  # unshifted count
    assert old["diagnosis"]["cause"] == "cache_trap" and "trainer-keeps-config-use_cache" in old["diagnosis"]["known_faults"]
    assert "padded_normalisation" in [f["cause"] for f in old["diagnosis"]["findings"]]
    assert "trainer-num-items-before-shift" in old["diagnosis"]["known_faults"]
    assert cells[f"llama-sdpa-trainer-float32@transformers=={current}"]["status"] == "pass"


@pytest.mark.slow
def test_real_trl_0_21_padding_free_without_position_ids_on_sdpa(pytester, monkeypatch, version_cache):
    """SFTTrainer(packing=True), defaults otherwise, sdpa: trl 0.21 (transformers 4.56.2) turns padding_free on
    for bfd packing but builds its collator with return_position_ids=use_flash_attention, so the rows reach sdpa
    with an all-ones attention_mask and no position_ids -> fail, cause mask_override, remedy flash_attention_2 or
    TRL >= 0.23.1; the same with padding_free=True and no packing."""
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==4.56.2 & trl==0.21.0", "arch:llama", "sdpa",
                   "sft,sft_padding_free,sft_strategies")
    strategies = cells["llama-sdpa-sft_strategies-float32@transformers==4.56.2+trl==0.21.0"]
    assert strategies["status"] == "fail" and "bfd: the packed batch carries no position_ids" in strategies["message"]
    assert strategies["diagnosis"]["cause"] == "mask_override"
    assert strategies["diagnosis"]["known_faults"] == ["trl-padding-free-position-ids-only-with-flash"]
    for check in ("sft", "sft_padding_free"):
        old = cells[f"llama-sdpa-{check}-float32@transformers==4.56.2+trl==0.21.0"]
        assert old["status"] == "fail" and "no position_ids" in old["message"] and "trl 0.21.0" in old["message"], old["message"]
        assert old["metrics"]["effective"]["padding_free"] is True and old["metrics"]["effective"]["return_position_ids"] is False
        assert "return_position_ids=False (TRL builds it as use_flash_attention)" in old["message"]
        assert old["env"]["versions"]["trl"] == "0.21.0" and old["diagnosis"]["cause"] == "mask_override"
        assert old["diagnosis"]["known_faults"] == ["trl-padding-free-position-ids-only-with-flash"]
        assert old["diagnosis"]["remedy"].startswith("TRL 0.21.0 sends position_ids with padding_free only to flash_attention_2")


@pytest.mark.slow
def test_real_trl_0_17_on_4_51_3_packing_and_padding_free(pytester, monkeypatch, version_cache):
    """transformers 4.51.3 + trl 0.17, sdpa, SFTConfig(padding_free=True) without packing: TRL flattens each batch
    into one row with position_ids, but 4.51.3's sdpa builds no packed mask from them -> the examples attend to
    each other and the loss diverges from the padded run at step 1; the report says why (backend + version).
    trl 0.17 has no packing_strategy (unsupported, named) and its pack_dataset only wraps."""
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==4.51.3 & trl==0.17.0", "arch:llama", "sdpa",
                   "isolation,sft,sft_padding_free,sft_strategies,packing_content")
    env = "@transformers==4.51.3+trl==0.17.0"
    free = cells[f"llama-sdpa-sft_padding_free-float32{env}"]
    assert free["status"] == "fail" and "padding-free: 3-step training" in free["message"], free["message"]
    assert free["metrics"]["effective"]["padding_free"] is True and free["metrics"]["examples_in_row"] == 6
    assert free["metrics"]["loss_delta"] > 1e-3 and free["metrics"]["steps"]["first_diverging_step"] == 1
    assert free["diagnosis"]["cause"] == "leak" and "no-packed-mask-before-4.54" in free["diagnosis"]["known_faults"]
    assert free["diagnosis"]["remedy"].startswith("upgrade transformers to >= 4.53.1")
    assert cells[f"llama-sdpa-isolation-float32{env}"]["status"] == "fail"
    packed = cells[f"llama-sdpa-sft-float32{env}"]  # packing=True alone: no padding_free before 0.21
    assert packed["status"] == "fail" and packed["metrics"]["effective"]["padding_free"] is False
    assert "trl-packing-without-padding-free" in packed["diagnosis"]["known_faults"]
    assert packed["diagnosis"]["remedy"].startswith("set padding_free=True")
    strategies = cells[f"llama-sdpa-sft_strategies-float32{env}"]
    assert strategies["status"] == "unsupported" and "not available in trl 0.17.0" in strategies["message"]
    content = cells[f"llama-packing_content-float32{env}"]["metrics"]["strategies"]
    assert [s for s, v in content.items() if v["available"]] == ["wrapped"]


@pytest.mark.slow
def test_real_trl_bfd_truncated_tails_0_27_and_0_28(pytester, monkeypatch, version_cache):
    """pack_dataset(strategy='bfd') of two examples of 13 and 11 tokens into rows of 10: trl 0.26 drops the
    overflow (two rows); 0.27 and 0.28 pack the two cut-off tails into a third row [11, 12, 13 | 111] -> a
    packing-content failure on those versions, with the known fault and an upgrade remedy."""
    cells = _audit(pytester, monkeypatch, version_cache, "trl==0.26.0,0.27.0,0.28.0", "arch:llama", "sdpa", "packing_content")
    ok = cells["llama-packing_content-float32@trl==0.26.0"]
    assert ok["status"] == "pass" and ok["metrics"]["strategies"]["bfd"]["probes"]["tails"]["rows"] == 2, ok["message"]
    for v in ("0.27.0", "0.28.0"):
        cell = cells[f"llama-packing_content-float32@trl=={v}"]
        tails = cell["metrics"]["strategies"]["bfd"]["probes"]["tails"]
        assert cell["status"] == "fail" and tails["rows"] == 3 and tails["tail_starts"] == 2 and tails["lost"] == 0, cell["message"]
        assert "tails probe [13, 11] into 10: 2 segments start inside an example" in cell["message"]
        assert cell["diagnosis"]["cause"] == "packing_content"
        assert "trl-bfd-packs-truncated-tails" in cell["diagnosis"]["known_faults"]
        assert cell["diagnosis"]["remedy"].startswith("upgrade TRL to >= 0.29")


def test_collate_cell_shows_its_numbers_in_the_details():
    """The details table backs a contract check's verdict with the items that held of those checked."""
    from pytest_packcheck.report import key_number

    cell = _cell("llama", "transformers==5.24.0", "fail", backend=None, check="collate")
    cell["metrics"] = {"items": {"position_ids": {"status": "fail"}, "labels": {"status": "pass"},
                                 "integer_labels": {"status": "fail"}}}
    assert key_number(cell) == "1/3 items"
    cell["metrics"]["items"]["integer_labels"]["status"] = "pass"
    assert key_number(cell) == "2/3 items"


def test_training_modes_rows_name_their_dtype_when_there_are_several():
    from pytest_packcheck.report import render_markdown

    cells = []
    for dtype, delta in (("bfloat16", 8.6e-5), ("float16", 5.2e-6)):
        cell = _cell("llama", "transformers==5.24.0", "pass", check="sft_padding_free")
        cell["dtype"], cell["cell_id"] = dtype, cell["cell_id"].replace("float32", dtype)
        cell["metrics"] = {"steps": {"max_loss_delta": delta}}
        cells.append(cell)
    section = render_markdown(_doc(cells)).split("## Training modes")[1].split("## ")[0]
    assert "| dtype " in next(line for line in section.splitlines() if line.startswith("| model"))
    assert any("bfloat16" in line and "8.6e-05" in line for line in section.splitlines())
    assert any("float16" in line and "5.2e-06" in line and "bfloat16" not in line for line in section.splitlines())


def test_controller_never_initialises_cuda_before_forking(tmp_path, monkeypatch):
    """The audit's controller forks a child per model; a child of a process that initialised CUDA cannot use it.
    The environment record reads the GPU's name from nvidia-smi (a stand-in script here), never through torch;
    and a controller that has initialised CUDA anyway runs its cells in-process, with a warning, instead of
    forking children that would all fail."""
    import types
    import warnings

    import torch

    from pytest_packcheck.results.environment import environment
    from pytest_packcheck.run.session import PackcheckSession

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "NVIDIA H200"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def no_init(*args, **kwargs):
        raise AssertionError("CUDA initialised in the controller")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_init)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_init)
    assert environment("cuda:0")["device_name"] == "NVIDIA H200"
    # mixed GPUs: nvidia-smi counts in PCI order, CUDA fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID
    smi.write_text('#!/bin/sh\necho "NVIDIA H200"\necho "NVIDIA A10"\n')
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "mixed GPUs" in environment("cuda:1")["device_name"]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert environment("cuda:1")["device_name"] == "NVIDIA A10"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert environment("cuda:0")["device_name"] == "NVIDIA A10"

    def fresh(device="cuda"):
        state = PackcheckSession.__new__(PackcheckSession)
        state.settings = types.SimpleNamespace(device=device)
        return state

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not fresh()._cuda_initialised_here()  # the forked probe finds no bad-fork flag
    # planted: the controller poisoned fork without initialising CUDA (what is_available() did before the NVML
    # check): only the forked probe can tell
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fresh()
        assert state._cuda_initialised_here() and state._cuda_initialised_here()
    assert len([w for w in caught if "forked children cannot use CUDA" in str(w.message)]) == 1
    # a probe child that raises must exit, never return into pytest as a second controller
    parent = os.getpid()

    def broken():
        raise RuntimeError("driver query failed")

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", broken)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert fresh()._cuda_initialised_here()  # exit code 2: treated as unusable
    assert os.getpid() == parent
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert fresh()._cuda_initialised_here()
    assert not fresh("cpu")._cuda_initialised_here()
    # the device check in the controller asks through NVML, which does not poison fork
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1")
    from pytest_packcheck.run.process import check_inputs

    settings = types.SimpleNamespace(device="cuda", report_dir=str(tmp_path / "r"), baseline=None)
    check_inputs(types.SimpleNamespace(), settings).release(force=True)  # no workerinput: the controller


# ----------------------------------------------------------------------------------------------------------------
# The varlen reference on transformers 4.44 .. 4.55.0 (flash-attn's functions as module globals)


def _old_flash_path(monkeypatch, cache, version: str) -> dict:
    """tests/data/old_flash_path.py run with the python of the transformers ``version`` environment."""
    import subprocess

    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(cache))
    env = envs.ensure_env(envs.parse_versions([f"transformers=={version}"], "test")[0])
    script = Path(__file__).parent / "data" / "old_flash_path.py"
    proc = subprocess.run([str(env.python), str(script)], capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _assert_reference_and_planted_fault(result: dict, version: str) -> None:
    assert result["transformers"] == version and result["mode"] == "module_globals"
    ref, planted = result["reference"], result["planted"]
    # the model really ran transformers' flash_attention_2 path of that release, on packcheck's kernels
    assert ref["config_attn"] == "flash_attention_2"
    assert ref["isolation"]["status"] == "pass" and ref["isolation"]["metrics"]["max_change"] < 1e-6
    assert ref["logits_parity"]["status"] == "pass" and ref["logits_parity"]["metrics"]["max_abs_diff_solo"] < 1e-5
    backend = ref["backend"]["metrics"]
    assert ref["backend"]["status"] == "pass", ref["backend"]
    assert backend["effective"] == "packcheck_flash_ref" and backend["calls"] == {"packcheck_flash_ref": 2}
    assert (backend["varlen_kernel_calls"], backend["dense_kernel_calls"]) == (2, 0)
    assert result["restored"] is True, result["flash_attn_varlen_func_after"]
    # planted: the flash path drops position_ids -> one dense call over the packed row; caught three ways
    assert planted["isolation"]["status"] == "fail" and planted["isolation"]["cause"] == "leak"
    assert planted["isolation"]["metrics"]["max_change"] > 1e-2
    assert planted["logits_parity"]["status"] == "fail" and planted["logits_parity"]["metrics"]["max_abs_diff_solo"] > 1e-2
    assert planted["backend"]["status"] == "fail" and planted["backend"]["cause"] == "dense_kernel"
    assert (planted["backend"]["metrics"]["varlen_kernel_calls"], planted["backend"]["metrics"]["dense_kernel_calls"]) == (0, 2)


def test_real_reference_on_4_44_2_runs_that_release_flash_path(pytester, monkeypatch, version_cache):
    """transformers 4.44.2 (the first release whose flash path reads packed position_ids, flash-attn functions as
    module globals, a FlashAttention2 class per model): the varlen reference runs the model as flash_attention_2
    with packcheck's kernels. llama's flash class passes position_ids -> varlen kernel per layer, exact;
    gpt_neox's does not -> one dense kernel call over the packed row: a leak, as on a GPU with flash-attn. And a
    planted llama flash path that drops position_ids is caught (isolation, parity, backend)."""
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==4.44.2", "arch:llama,arch:gpt_neox",
                   "packcheck_flash_ref", "isolation,logits_parity,backend")
    env = "@transformers==4.44.2"
    for check in ("isolation", "logits_parity", "backend"):
        cell = cells[f"llama-packcheck_flash_ref-{check}-float32{env}"]
        assert cell["status"] == "pass", cell["message"]
    assert cells[f"llama-packcheck_flash_ref-backend-float32{env}"]["metrics"]["varlen_kernel_calls"] == 2
    leak = cells[f"gpt_neox-packcheck_flash_ref-isolation-float32{env}"]
    assert leak["status"] == "fail" and leak["metrics"]["max_change"] > 1e-2, leak["message"]
    assert leak["diagnosis"]["cause"] == "leak"
    dense = cells[f"gpt_neox-packcheck_flash_ref-backend-float32{env}"]
    assert dense["status"] == "fail" and dense["metrics"]["dense_kernel_calls"] == 2 and dense["metrics"]["varlen_kernel_calls"] == 0
    md = (pytester.path / "out" / "packcheck-matrix.md").read_text()
    assert "varlen reference (CPU, not FA2)" in md
    _assert_reference_and_planted_fault(_old_flash_path(monkeypatch, version_cache, "4.44.2"), "4.44.2")


@pytest.mark.slow
@pytest.mark.parametrize("version", ["4.46.3", "4.48.3", "4.50.3", "4.52.4", "4.54.1", "4.55.0"])
def test_real_reference_and_planted_fault_on_each_module_globals_release(monkeypatch, version_cache, version):
    """Every layout of the module-globals flash path: per-model FlashAttention2 classes (4.46), the first
    AttentionInterface as a dict (4.48, 4.50), the NPU-aware imports (4.52), the kernel cache in _flash_fn ...
    (4.54, 4.55.0)."""
    _assert_reference_and_planted_fault(_old_flash_path(monkeypatch, version_cache, version), version)


def test_an_environment_the_index_cannot_resolve_retries_with_the_documented_override_and_records_it(tmp_path, monkeypatch):
    """transformers 5.25.0 requires kernels>=0.19.1, which this machine's index lacks (the atlas's newest minor was
    "not installable"). audit/env_overrides.toml's entry applies to it: the environment is first made as the release
    asks, and only after uv fails is the override added; the environment's record names it with the reason and uv's
    first answer. A release the entry does not cover fails as before, and one that resolves gets no override."""
    import stat
    import sys as _sys

    from pytest_packcheck.versions import envs

    fake = tmp_path / "uv"
    fake.write_text(f"#!{_sys.executable}\n" + textwrap.dedent('''
        import os, pathlib, sys, sysconfig
        args = sys.argv[1:]
        if args[0] == "venv":
            env = pathlib.Path(args[-1])
            pathlib.Path(sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})["purelib"]).mkdir(parents=True)
            (env / "bin").mkdir(exist_ok=True)
            sys.exit(0)
        overrides = pathlib.Path(args[args.index("--override") + 1]).read_text()
        with open(os.environ["FAKE_UV_LOG"], "a") as log:
            log.write(("override" if "kernels==0.17.2" in overrides else "plain") + "\\n")
        if "transformers==5.25.0" in args and "kernels==0.17.2" not in overrides:
            sys.stderr.write("  x No solution found when resolving dependencies:\\n  Because only kernels<=0.17.2 is available "
                             "and transformers==5.25.0 depends on kernels>=0.19.1, we can conclude ...\\n")
            sys.exit(1)
        if "transformers==9.0.0" in args:
            sys.stderr.write("  x No solution found: transformers==9.0.0 is not on the index\\n")
            sys.exit(1)
        sys.exit(0)
        '''))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(envs, "_uv", lambda: str(fake))
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_UV_LOG", str(tmp_path / "uv.log"))
    env = envs.ensure_env(envs.VersionCombo(("transformers==5.25.0",)))
    assert (tmp_path / "uv.log").read_text().split() == ["plain", "override"]
    [used] = env.info["overrides"]
    assert used["requirement"] == "kernels==0.17.2" and used["applies_to"] == "transformers>=5.25.0"
    assert "kernels>=0.19.1" in used["without"] and "index has kernels 0.17.2" in used["reason"]
    assert "kernels==0.17.2" in (env.path / "packcheck-overrides.txt").read_text()
    (tmp_path / "uv.log").unlink()
    assert "overrides" not in envs.ensure_env(envs.VersionCombo(("transformers==5.24.0",))).info
    assert (tmp_path / "uv.log").read_text().split() == ["plain"]
    with pytest.raises(envs.EnvError, match="transformers==9.0.0: not installable: .*not on the index"):
        envs.ensure_env(envs.VersionCombo(("transformers==9.0.0",)))
    assert envs.applicable_overrides(envs.VersionCombo(("transformers==5.24.0",))) == []
    bad = tmp_path / "bad.toml"
    bad.write_text('[[override]]\nrequirement = "kernels=="\napplies_to = "transformers>=5.25"\nreason = "x"\n')
    with pytest.raises(envs.EnvError, match="bad.toml: override 1: .*fix the file"):
        envs.applicable_overrides(envs.VersionCombo(("transformers==5.25.0",)), bad)


def test_an_always_override_is_in_the_first_resolution_and_in_the_key_of_that_release_only(tmp_path, monkeypatch):
    """transformers 5.4.0 resolves (huggingface_hub 1.33.0), but every config of 15 architectures then raises "expected
    int, got bool" (hub 1.9.0 on refuses a bool for its int-annotated fields). audit/env_overrides.toml's
    ``when = "always"`` entry pins hub below 1.9 from the first resolution: one uv call, the pin in its overrides
    file, the record naming it; the key of 5.4.0 changes (its old environment is not reused), no other release's.
    Planted: the same release with the file's entry removed resolves without the pin. A bad ``when`` is one line."""
    import stat
    import sys as _sys

    from pytest_packcheck.versions import envs

    fake = tmp_path / "uv"
    fake.write_text(f"#!{_sys.executable}\n" + textwrap.dedent('''
        import os, pathlib, sys, sysconfig
        args = sys.argv[1:]
        if args[0] == "venv":
            env = pathlib.Path(args[-1])
            pathlib.Path(sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})["purelib"]).mkdir(parents=True)
            (env / "bin").mkdir(exist_ok=True)
            sys.exit(0)
        overrides = pathlib.Path(args[args.index("--override") + 1]).read_text()
        with open(os.environ["FAKE_UV_LOG"], "a") as log:
            log.write(("pinned" if "huggingface-hub>=1.5.0,<1.9" in overrides else "plain") + "\\n")
        sys.exit(0)
        '''))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(envs, "_uv", lambda: str(fake))
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_UV_LOG", str(tmp_path / "uv.log"))
    combo = envs.VersionCombo(("transformers==5.4.0",))
    [entry] = envs.applicable_overrides(combo)
    assert entry["when"] == "always" and "expected int, got bool" not in entry["reason"] and "1.9.0" in entry["reason"]
    key = envs.env_key(combo)
    env = envs.ensure_env(combo)
    assert (tmp_path / "uv.log").read_text().split() == ["pinned"]
    [used] = env.info["overrides"]
    assert used["requirement"] == "huggingface-hub>=1.5.0,<1.9" and used["when"] == "always"
    assert "huggingface-hub>=1.5.0,<1.9" in (env.path / "packcheck-overrides.txt").read_text()
    assert envs.applicable_overrides(envs.VersionCombo(("transformers==5.5.4",))) == []
    # planted: the file without the entry: the plain resolution, another key, no record
    empty = tmp_path / "none.toml"
    empty.write_text("")
    monkeypatch.setattr(envs, "applicable_overrides", lambda c, path=None, _f=envs.applicable_overrides: _f(c, empty))
    assert envs.env_key(combo) != key
    (tmp_path / "uv.log").unlink()
    assert "overrides" not in envs.ensure_env(combo).info
    assert (tmp_path / "uv.log").read_text().split() == ["plain"]
    monkeypatch.undo()
    bad = tmp_path / "bad.toml"
    bad.write_text('[[override]]\nrequirement = "x<1"\napplies_to = "transformers==5.4.0"\nreason = "r"\nwhen = "often"\n')
    with pytest.raises(envs.EnvError, match="bad.toml: override 1: when = 'often' is not one of unresolvable, always"):
        envs.applicable_overrides(combo, bad)


@pytest.mark.slow
def test_real_dbrx_on_4_57_6_gets_a_verdict_not_a_shrink_gap(pytester, monkeypatch, version_cache):
    """Issue 41: transformers 4.57's DbrxConfig cannot read back its own to_dict() (each sub-config's dict carries every
    PretrainedConfig key, which DbrxAttentionConfig refuses), so the shrink failed and the atlas had a shrink_limit
    gap. Measured on 4.57.6 (2026-12-06): the shrink passes the sub-configs their own keys and the cell has a verdict
    (sdpa: fail, leak 2.16e-01), with the note."""
    cells = _audit(pytester, monkeypatch, version_cache, "transformers==4.57.6", "arch:dbrx", "sdpa", "isolation")
    cell = cells["dbrx-sdpa-isolation-float32@transformers==4.57.6"]
    assert cell["status"] in ("pass", "fail") and cell.get("cause") != "shrink_limit", cell["message"]
    assert any("cannot read back its own to_dict()" in n for n in cell["model"].get("config_notes", [])), cell["model"]
