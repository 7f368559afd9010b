"""Cause classification, remedies and known faults: each cause from real measurements of a planted or real
fault, and each rule able to fail on a synthetic group."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_packcheck.analysis.diagnose import CAUSES, classify, diagnose_document, load_known_faults

REPO = Path(__file__).resolve().parents[1]


def _audit(models: list[str], backends: tuple[str, ...], checks: tuple[str, ...], tolerances: dict, **bench_kwargs) -> dict:
    """Run cells in this process (no plugin) and return a diagnosed document."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.results.environment import environment
    from pytest_packcheck.results.schema import build_document
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    resolved = [resolve_model(parse_model_spec(m, "test"), "test") for m in models]
    runner = CellRunner(resolved, tolerances)
    cells = [runner.run(c) for c in plan_cells(resolved, backends, checks, ("float32",))]
    return diagnose_document(build_document(cells, environment(), {"backends": list(backends), "checks": list(checks)}, "test"))


def _by_id(doc: dict) -> dict[str, dict]:
    return {c["cell_id"]: c for c in doc["cells"]}


def test_state_space_leak_is_stateful_layers(tolerances):
    """qwen3_next on the varlen reference: attention gets the boundaries (backend pass) yet examples mix in
    the linear-attention / conv layers -> stateful_layers, not a generic leak; llama on the same backend passes."""
    doc = _audit(["arch:qwen3_next", "arch:llama"], ("packcheck_flash_ref",), ("isolation", "logits_parity", "backend"), tolerances)
    cells = _by_id(doc)
    iso = cells["qwen3_next-packcheck_flash_ref-isolation-float32"]
    assert iso["status"] == "fail" and cells["qwen3_next-packcheck_flash_ref-backend-float32"]["status"] == "pass"
    assert "Qwen3NextGatedDeltaNet" in iso["metrics"]["stateful_layers"]
    assert iso["diagnosis"]["cause"] == "stateful_layers"
    assert "stateful-layers-mix-examples" in iso["diagnosis"]["known_faults"]
    assert iso["diagnosis"]["remedy"].startswith("disable packing for this architecture")
    assert cells["llama-packcheck_flash_ref-isolation-float32"]["diagnosis"] is None


def test_opt_is_a_leak_on_sdpa_and_takes_position_ids(tolerances):
    """The public report says OPT derives positions from the attention mask. On the installed transformers its
    forward takes position_ids (restarting them changes the logits) and the failure is a leak on sdpa."""
    doc = _audit(["arch:opt"], ("sdpa",), ("position_ids", "isolation", "logits_parity"), tolerances)
    cells = _by_id(doc)
    assert cells["opt-sdpa-position_ids-float32"]["status"] == "pass"
    iso = cells["opt-sdpa-isolation-float32"]
    assert iso["status"] == "fail" and iso["diagnosis"]["cause"] == "leak"
    assert "flash_attention_2 on your GPU" in iso["diagnosis"]["remedy"]


def test_positions_without_position_ids_on_the_varlen_path(tolerances):
    """Collator with return_flash_attn_kwargs=True and return_position_ids=False: boundaries reach attention,
    positions run 0..N-1 across the row. With learned absolute positions (gpt2) every example but the first
    differs -> cause wrong_positions, remedy: also return position_ids. With rotary positions (llama) the
    shift cancels inside each isolated segment (RoPE is relative): parity holds, measured."""
    from conftest import make_bench

    from pytest_packcheck import checks as C
    from pytest_packcheck.analysis.diagnose import remedy
    from pytest_packcheck.model.batches import default_collator_factory

    def no_positions(**kwargs):
        return default_collator_factory(**{**kwargs, "return_position_ids": False, "return_flash_attn_kwargs": True})

    gpt2 = make_bench("gpt2", "packcheck_flash_ref", tolerances, collator_factory=no_positions)
    logits, iso = C.check_logits_parity(gpt2), C.check_isolation(gpt2)
    assert logits.status == "fail" and "examples [1, 2]" in logits.message and logits.metrics["per_example"][0] < 1e-6
    assert logits.metrics["batch_has_position_ids"] is False and iso.status != "fail"
    cell = _cell("logits_parity", logits)
    cause, _ = classify(cell)
    assert cause == logits.cause == "wrong_positions"
    assert remedy(cause, cell, {"transformers": "5.24.0"}).startswith("also return position_ids")
    llama = make_bench("llama", "packcheck_flash_ref", tolerances, collator_factory=no_positions)
    assert C.check_logits_parity(llama).metrics["max_abs_diff_solo"] < 1e-5


def _cell(check: str, result, backend: str = "packcheck_flash_ref") -> dict:
    return {"cell_id": f"m-{backend}-{check}-float32", "model": {"label": "m", "model_type": "llama"}, "backend": backend,
            "check": check, "dtype": "float32", "status": result.status, "metrics": result.metrics, "message": result.message,
            "cause": result.cause, "evidence": result.evidence, "findings": result.findings}


def test_two_packed_rows_per_backend(tolerances):
    """Batch size 2, two examples per row, no cu_seq_lens: sdpa keeps the boundaries, the flash path (5.x
    derives them for batch size 1 only) does not; reported as a finding, the verdict stays pass."""
    doc = _audit(["arch:llama"], ("sdpa", "packcheck_flash_ref"), ("logits_parity",), tolerances)
    cells = _by_id(doc)
    sdpa, flash = cells["llama-sdpa-logits_parity-float32"], cells["llama-packcheck_flash_ref-logits_parity-float32"]
    assert sdpa["metrics"]["max_abs_diff_two_rows"] < 1e-5 and sdpa["diagnosis"] is None
    assert flash["status"] == "pass" and flash["metrics"]["max_abs_diff_two_rows"] > 1e-2
    assert [f["cause"] for f in flash["diagnosis"]["findings"]] == ["batch_rows"]
    assert "flash-path-batch-size-one-only" in flash["diagnosis"]["known_faults"]


class _ProbedBench:
    """What :func:`checks.mismatch_cause` reads, with the probes' numbers planted in the workbench cache."""

    def __init__(self, moved: float, stateful: list[str], boundaries: str, backend: str = "sdpa",
                 window: dict | None = None) -> None:
        from pytest_packcheck.config.tolerances import load_tolerances

        self.model, self.collator_factory, self.backend, self.dtype = object(), object(), backend, "float32"
        self.tol = load_tolerances(None, None, "test")[0]["float32"]
        self.lengths = [11, 7, 13]
        self.config = type("Config", (), {"sliding_window": 8 if window else None})()
        self._cache = {("leak_probe", id(self.model), id(self.collator_factory)): {
            "max_change": moved, "negative_control_change": 0.3, "stateful_layers": stateful, "attention_boundaries": boundaries}}
        if window:
            self._cache[("window", id(self.model), id(self.collator_factory))] = window


@pytest.mark.parametrize(("bench", "diff", "expected"), [
    # isolation moves far beyond tolerance: a leak
    (_ProbedBench(0.28, [], "missing"), 0.43, "leak"),
    # ... within NUMERICS_FACTOR x isolation_atol (1e-5): numerics; just above it: a leak
    (_ProbedBench(9.9e-5, [], "reached"), 3e-4, "kernel_numerics"),
    (_ProbedBench(1.01e-4, [], "reached"), 3e-4, "leak"),
    # stateful layers mix although attention kept its boundaries (or has none); with boundaries missing: a leak
    (_ProbedBench(0.2, ["MambaMixer"], "reached"), 0.3, "stateful_layers"),
    (_ProbedBench(0.2, ["MambaMixer"], "none"), 0.3, "stateful_layers"),
    (_ProbedBench(0.2, ["MambaMixer"], "missing"), 0.3, "leak"),
    # isolation holds, logits far off: positions; just over the logits tolerance: numerics
    (_ProbedBench(0.0, [], "reached"), 0.43, "wrong_positions"),
    (_ProbedBench(0.0, [], "reached"), 3e-4, "kernel_numerics"),
    (_ProbedBench(0.0, [], "reached"), 1.01e-3, "wrong_positions"),
    # parity fails only above the sliding window
    (_ProbedBench(0.0, [], "reached", window={"sliding_window": 8, "max_abs_diff_within_window": 1e-7}), 0.2, "sliding_window"),
    (_ProbedBench(0.0, [], "reached", window={"sliding_window": 8, "max_abs_diff_within_window": 2e-4}), 0.2, "wrong_positions"),
    # exactly at each bound (issue 14: a bound moved by one comparison must fail here)
    (_ProbedBench(1e-5, [], "missing"), 0.43, "wrong_positions"),  # moved == isolation_atol: isolated
    (_ProbedBench(1e-4, [], "reached"), 0.43, "kernel_numerics"),  # moved == NUMERICS_FACTOR x isolation_atol
    # ... but never numerics where an attention call lacked the packed boundaries (trial 15, 242)
    (_ProbedBench(1e-4, [], "missing"), 0.43, "leak"),
    (_ProbedBench(9.9e-5, [], "missing"), 3e-4, "leak"),
    (_ProbedBench(0.0, [], "reached"), 1e-3, "kernel_numerics"),  # diff == NUMERICS_FACTOR x logits_atol
    (_ProbedBench(0.0, [], "reached", window={"sliding_window": 8, "max_abs_diff_within_window": 1e-4}), 0.2, "sliding_window"),
    # boundaries the counter could not inspect: kept on a flash backend, not on eager / sdpa / flex
    (_ProbedBench(0.2, ["MambaMixer"], "unknown", backend="packcheck_flash_ref"), 0.3, "stateful_layers"),
    (_ProbedBench(0.2, ["MambaMixer"], "unknown", backend="sdpa"), 0.3, "leak"),
    (_ProbedBench(0.2, [], "unknown", backend="packcheck_flash_ref"), 0.3, "leak"),
])
def test_mismatch_cause_rules(bench, diff, expected):
    """Each boundary of :func:`checks.mismatch_cause` (leak vs numerics on isolation_atol, numerics vs positions on
    logits_atol, stateful only with attention boundaries kept, the window) from planted probe numbers."""
    from pytest_packcheck.checks.probes import mismatch_cause

    cause, evidence = mismatch_cause(bench, diff, bench.tol["logits_atol"])
    assert cause == expected and cause in CAUSES and evidence
    probe = bench._cache[("leak_probe", id(bench.model), id(bench.collator_factory))]
    assert evidence["isolation_moved"] == probe["max_change"] and evidence["isolation_atol"] == bench.tol["isolation_atol"]
    if cause == "stateful_layers":
        assert evidence["stateful_layers"] == probe["stateful_layers"][:3] and evidence["attention_boundaries"] == probe["attention_boundaries"]
    if cause == "wrong_positions":
        assert evidence["diff"] == diff
    alone = mismatch_cause(bench, None)[1]  # no logits diff given: a diff only as numerics against isolation_atol
    assert "diff" not in alone or (alone["tolerance"] == "isolation_atol" and alone["diff"] == probe["max_change"])


def test_mismatch_cause_zero_tolerance_rounding_is_numerics():
    """The audit shares the guard's numerics rule (registry.within_numerics): under logits_atol 0 a float32 difference
    of a few ulps, isolation holding, is kernel_numerics (was wrong_positions); a real difference is still positions."""
    from pytest_packcheck.checks.probes import mismatch_cause

    assert mismatch_cause(_ProbedBench(0.0, [], "reached"), 4.77e-7, 0.0)[0] == "kernel_numerics"
    assert mismatch_cause(_ProbedBench(0.0, [], "reached"), 1e-3, 0.0)[0] == "wrong_positions"


def test_stateful_evidence_names_at_most_three_layers():
    from pytest_packcheck.checks.probes import mismatch_cause

    bench = _ProbedBench(0.2, ["A", "B", "C", "D"], "reached")
    assert mismatch_cause(bench, 0.3, 1e-4)[1]["stateful_layers"] == ["A", "B", "C"]


def _status_cell(status: str, metrics: dict, cause: str | None = None) -> dict:
    return {"cell_id": "m-sdpa-isolation-float32", "model": {"label": "m", "model_type": "llama"}, "backend": "sdpa",
            "check": "isolation", "dtype": "float32", "status": status, "metrics": metrics, "message": "a message naming leak",
            "cause": cause, "evidence": {"moved": 0.3} if cause else {}}


@pytest.mark.parametrize(("cell", "expected"), [
    (_status_cell("fail", {}, "stateful_layers"), "stateful_layers"),  # the check's code, never the message's words
    (_status_cell("fallback", {"requested": "sdpa", "effective": "eager"}), "backend_swap"),
    (_status_cell("timeout", {"timeout_s": 5.0}), "hang"),
    (_status_cell("oom", {"host_peak_rss_mib": 900.0}), "out_of_memory"),
    (_status_cell("error", {"stage": "check", "exception": "RuntimeError: x"}), "crash"),
    (_status_cell("error", {}), None),
    (_status_cell("fail", {}), "packed_mismatch"),  # a schema-1 cell: no code
    (_status_cell("pass", {}, None), None),
])
def test_classification_reads_codes(cell, expected):
    assert classify(cell)[0] == expected


def test_diagnosis_never_changes_a_verdict(tolerances):
    import copy

    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.results.environment import environment
    from pytest_packcheck.results.schema import build_document
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    resolved = [resolve_model(parse_model_spec("arch:opt", "test"), "test")]
    runner = CellRunner(resolved, tolerances)
    cells = [runner.run(c) for c in plan_cells(resolved, ("sdpa",), ("isolation", "cache_trap"), ("float32",))]
    doc = build_document(cells, environment(), {"backends": ["sdpa"], "checks": ["isolation", "cache_trap"]}, "test")
    before = copy.deepcopy(doc)  # read before any diagnosis ran
    diagnose_document(doc)
    for b, a in zip(before["cells"], doc["cells"], strict=True):
        assert {k: v for k, v in a.items() if k != "diagnosis"} == b
    assert any(c["diagnosis"] for c in doc["cells"])


def test_known_fault_that_did_not_show_is_reported():
    from pytest_packcheck.analysis.diagnose import KnownFault

    fault = KnownFault(id="x", upstream="", summary="s", library="transformers", versions="<4.54", architectures=("*",),
                       backends=("sdpa",), checks=("isolation",), cause="leak", fixed_in="4.54", remedy="r", evidence="e")
    cell = {"cell_id": "m-sdpa-isolation-float32", "model": {"label": "m", "model_type": "llama"}, "backend": "sdpa",
            "check": "isolation", "dtype": "float32", "status": "pass", "metrics": {"max_change": 0.0}, "message": "ok",
            "env": {"label": "transformers==4.51.3", "versions": {"transformers": "4.51.3"}}}
    doc = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [cell]}, [fault])
    assert doc["known_faults_not_seen"] == {"x": ["m-sdpa-isolation-float32"]}
    cell["env"]["versions"]["transformers"] = "4.56.2"  # outside the window: nothing expected
    assert diagnose_document({"environment": {}, "cells": [cell]}, [fault])["known_faults_not_seen"] == {}


def test_known_faults_file_is_valid_and_every_entry_has_a_test():
    faults = load_known_faults()
    assert len(faults) >= 7
    for f in faults:
        path, _, name = f.evidence.partition("::")
        assert name and f"def {name}(" in (REPO / path).read_text(), f.id
        assert f.remedy and f.summary


def known_fault_name_problems(faults) -> list[str]:
    """What known faults name that packcheck's tables do not, each a fault that could never match a cell: a check
    outside the check registry, a backend outside the backend table ("*" is every backend), a library outside the
    libraries table, a cause outside checks/causes.py. The names are read from the tables, so a check, backend or
    library added to its table is known here with no edit to this file."""
    from pytest_packcheck.backends.table import BY_NAME as BACKENDS
    from pytest_packcheck.checks.registry import SPECS
    from pytest_packcheck.versions.libraries import BY_NAME as LIBRARIES

    problems = []
    for f in faults:
        problems += [f"{f.id}: unknown check {c!r}" for c in f.checks if c not in SPECS]
        problems += [f"{f.id}: unknown backend {b!r}" for b in f.backends if b != "*" and b not in BACKENDS]
        problems += [f"{f.id}: unknown library {f.library!r}"] if f.library not in LIBRARIES else []
        problems += [f"{f.id}: unknown cause {f.cause!r}"] if f.cause not in CAUSES else []
        problems += [f"{f.id}: no check named"] if not f.checks else []
    return problems


def test_known_faults_name_only_checks_backends_and_libraries_of_the_tables():
    """audit/known_faults.toml's check, backend, library and cause names are the tables' (a misspelt or renamed
    check in an entry silently never matched). Planted: a misspelt check, a backend and a library nobody
    registered are each named."""
    import dataclasses

    faults = load_known_faults()
    assert known_fault_name_problems(faults) == []
    bad = dataclasses.replace(faults[0], id="planted", checks=("isolaton",), backends=("sdpa", "sdpaa"), library="transfomers")
    assert known_fault_name_problems([bad]) == ["planted: unknown check 'isolaton'", "planted: unknown backend 'sdpaa'",
                                                "planted: unknown library 'transfomers'"]


def test_what_to_do_section_in_the_matrix(tolerances):
    from pytest_packcheck.report import render_markdown

    doc = _audit(["arch:llama"], ("sdpa",), ("logits_parity", "cache_trap"), tolerances)
    md = render_markdown(doc)
    assert "## What to do" not in md  # llama's correctness checks pass: nothing to remedy for the model
    hazards = md[md.index("## Stack hazards"):md.index("## Matrix")]
    assert "cache trap" in hazards and "set use\\_cache=False" in hazards
    doc = _audit(["arch:opt"], ("sdpa",), ("isolation", "cache_trap"), tolerances)
    section = (md := render_markdown(doc))[md.index("## What to do"):md.index("## Legend")]
    assert "**leak**" in section and "flash\\_attention\\_2 on your GPU" in section and "cache" not in section.split("Known faults")[0]


def test_hybrid_given_seq_idx_refuses_instead_of_mixing(tolerances):
    """qwen3_next with only position_ids mixes examples silently (a leak in its linear layers); given seq_idx /
    cu_seq_lens on CPU it refuses with an error about causal_conv1d: an unsupported cell, cause
    stateful_layers_refused."""
    from conftest import make_bench

    from pytest_packcheck import checks as C
    from pytest_packcheck.model.batches import default_collator_factory
    from pytest_packcheck.run.runner import _classify_exception

    def with_seq_idx(**kwargs):
        return default_collator_factory(**{**kwargs, "return_flash_attn_kwargs": True, "return_seq_idx": True})

    bench = make_bench("qwen3_next", "sdpa", tolerances, collator_factory=with_seq_idx)
    with pytest.raises(Exception) as exc:
        C.check_logits_parity(bench)
    assert "causal_conv1d" in str(exc.value)
    assert _classify_exception(exc.value) == "unsupported"
    from pytest_packcheck.run.runner import CellRunner

    result = CellRunner([], tolerances)._failed("check", exc.value)
    assert result.status == "unsupported" and result.cause == "stateful_layers_refused"
    silent = make_bench("qwen3_next", "sdpa", tolerances)
    assert C.check_isolation(silent).status == "fail"


def test_training_failures_get_the_same_cause_whichever_checks_ran(tolerances):
    """OPT leaks on sdpa. Each check measures its own cause (the isolation probe runs inside it), so trainer and
    sft say "leak" with or without isolation in the audit, never loss_normalisation."""
    pytest.importorskip("trl")
    alone = _audit(["arch:opt"], ("sdpa",), ("trainer", "sft"), tolerances)
    together = _audit(["arch:opt"], ("sdpa",), ("isolation", "trainer", "sft"), tolerances)
    for check in ("trainer", "sft"):
        a, b = _by_id(alone)[f"opt-sdpa-{check}-float32"], _by_id(together)[f"opt-sdpa-{check}-float32"]
        assert a["status"] == "fail" and a["diagnosis"]["cause"] == b["diagnosis"]["cause"] == "leak", (check, a["diagnosis"])


def test_stateful_cause_does_not_depend_on_the_checks_that_ran(tolerances):
    """lfm2-like leaks: qwen3_next's logits_parity says "stateful_layers" with isolation,logits_parity only and
    with the backend check in the audit too (before cause codes it read "leak" without the backend check)."""
    few = _audit(["arch:qwen3_next"], ("packcheck_flash_ref",), ("isolation", "logits_parity"), tolerances)
    many = _audit(["arch:qwen3_next"], ("packcheck_flash_ref",), ("isolation", "logits_parity", "backend"), tolerances)
    for doc in (few, many):
        cell = _by_id(doc)["qwen3_next-packcheck_flash_ref-logits_parity-float32"]
        assert cell["diagnosis"]["cause"] == "stateful_layers", cell["diagnosis"]


def test_sft_checks_skip_a_backend_without_backward(tolerances):
    """flex_attention has no backward on CPU: the SFT checks are skipped with that reason, like the trainer check."""
    pytest.importorskip("trl")
    doc = _audit(["arch:llama"], ("flex_attention",), ("trainer", "sft", "sft_padding_free", "sft_strategies"), tolerances)
    for cell in doc["cells"]:
        assert cell["status"] == "skipped" and "backward" in cell["message"], (cell["cell_id"], cell["message"])


def test_version_advice_comes_from_the_known_fault_windows_not_from_code():
    """A cause's remedy is its record's (by backend, check, numbers); inside a known fault's version window with a
    fix, the fault's remedy (of the one fixed last). diagnose.py holds no version literal."""
    import inspect
    import re

    from pytest_packcheck.analysis import diagnose
    from pytest_packcheck.analysis.diagnose import remedy

    cell = {"model": {"model_type": "llama"}, "backend": "sdpa", "check": "isolation", "metrics": {}}
    assert remedy("leak", cell, {"transformers": "4.51.3"}).startswith("upgrade transformers to >= 4.53.1")
    assert remedy("leak", cell, {"transformers": "5.24.0"}).startswith("do not pack on eager/sdpa/flex")
    assert remedy("leak", {**cell, "backend": "packcheck_flash_ref"}, {"transformers": "4.51.3"}) == (
        "disable packing for this architecture on this backend")
    sft = {**cell, "check": "sft"}
    assert "TRL to >= 0.23.1" in remedy("mask_override", sft, {"trl": "0.20.0"})  # both TRL windows: the later fix
    assert remedy("mask_override", sft, {"trl": "0.24.0"}).startswith("set padding_free=True in SFTConfig")
    assert remedy("mask_override", {**cell, "check": "mask_trap"}, {"trl": "0.20.0"}).startswith("do not pass attention_mask")
    content = {"model": {"model_type": "llama"}, "backend": None, "check": "packing_content", "metrics": {}}
    assert remedy("packing_content", content, {"trl": "0.27.2"}).startswith("upgrade TRL to >= 0.29.0")
    assert remedy("packing_content", content, {"trl": "1.16.0"}).startswith("truncate examples to max_length")
    assert not re.search(r"\d+\.\d+\.\d+", inspect.getsource(diagnose.remedy))


def test_no_cause_remedy_names_an_upgrade_only_known_faults_do():
    """checks/causes.py's rule: advice that depends on a library version is the remedy of a known fault (its window,
    its fixed_in), never a cause's own. padded_normalisation's own remedy said "compare with transformers >= 5.10.1"
    and reached gpt2 on 5.24.0 (trial 9 #185); completion_mask's said "upgrade TRL to >= 0.20.0" on every TRL."""
    import re

    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.versions.libraries import find_upgrade

    release = re.compile(r"(?:>=|<=|>|<)\s*\d+\.\d+")
    for code, cause in CAUSE_RECORDS.items():
        for text in (cause.remedy, *(r.shown for r in cause.when)):
            assert find_upgrade(text) is None and not release.search(text), (code, text)


def test_a_tolerance_that_hides_the_planted_leak_is_named_in_the_inconclusive_cause():
    """Trial 17, 129: a parity check's probe_inconclusive (isolation_atol raised over the planted leak) carried no
    tolerances, so its remedy read "run this model in float32" on a float32 run. Its evidence now names the raised
    tolerance, and the remedy says to lower it; with the attention calls seen without boundaries it is a leak."""
    from pytest_packcheck.checks.probes import mismatch_cause

    kept = _ProbedBench(0.0, [], "reached")
    kept.tol = {**kept.tol, "isolation_atol": 10.0}
    cause, evidence = mismatch_cause(kept, 0.43, kept.tol["logits_atol"])
    assert cause == "probe_inconclusive" and evidence["tolerances_raised"] is True
    assert evidence["raised"] == "float32.isolation_atol = 1.00e+01 (default 1.00e-05)", evidence
    missing = _ProbedBench(0.0, [], "missing")
    missing.tol = {**missing.tol, "isolation_atol": 10.0}
    assert mismatch_cause(missing, 0.43, missing.tol["logits_atol"])[0] == "leak"
