"""Every decision branch of the checks, each with a planted fault that turns it (issue 14): a test here fails when
the branch is broken. Fast: one tiny llama built per module, planted models and collators from faults.py, and
planted probe numbers where the branch reads nothing else. tools/mutation.sh runs mutmut against these."""

from __future__ import annotations

import pytest
from faults import (
    DropNumItemsInBatch,
    DropNumItemsInBatchPacked,
    DropPositionIds,
    ForceCache,
    NoPositionIdsArgument,
    RunsTwice,
    ScalePackedLoss,
    SilentSwap,
    TiltPackedGradient,
    UnigramLM,
    WarnsOnForward,
    collator_label_leak,
    collator_no_reset,
    leaky_sdpa,
)
from test_diagnose import _ProbedBench

from pytest_packcheck import checks as C
from pytest_packcheck.checks import attention, collate, parity, probes, traps
from pytest_packcheck.model.batches import default_collator_factory
from pytest_packcheck.results import CheckResult


class _Said(CheckResult):
    """A CheckResult that must say why: every verdict here carries a one-line message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        assert isinstance(self.message, str) and self.message.strip(), (self.status, self.message)


@pytest.fixture(autouse=True)
def _results_say_why(monkeypatch):
    for module in (collate, parity, probes, attention, traps):  # every module that builds a model check's result
        monkeypatch.setattr(module, "CheckResult", _Said, raising=False)


@pytest.fixture(scope="module")
def _llama(tolerances):
    from conftest import make_bench

    return make_bench("llama", "sdpa", tolerances).model


@pytest.fixture
def bench(_llama, tolerances):
    """A fresh workbench (own caches, own tolerances) around the module's tiny llama on sdpa."""
    return C.Workbench(model=_llama, config=_llama.config, backend="sdpa", dtype="float32", tol=dict(tolerances["float32"]))


# ------------------------------------------------------------------------------------------------------------
# isolation: the leak threshold and the negative control


def _isolation(moved: float, control: float, **kw) -> CheckResult:
    probed = _ProbedBench(moved, [], "reached", **kw)
    probed._cache[next(iter(probed._cache))]["negative_control_change"] = control
    return C.check_isolation(probed)


def test_isolation_threshold_and_negative_control_from_planted_probe_numbers():
    tol = _ProbedBench(0, [], "reached").tol
    assert _isolation(0.0, 0.3).status == "pass"
    assert _isolation(tol["isolation_atol"], 0.3).status == "pass"  # at the tolerance: still isolated
    over = _isolation(tol["isolation_atol"] * 1.01, 0.3)
    assert over.status == "fail" and over.cause == "kernel_numerics"
    leak = _isolation(0.3, 0.3)
    assert leak.status == "fail" and leak.cause == "leak" and leak.evidence["isolation_moved"] == 0.3
    blind = _isolation(0.0, tol["leak_min"] * 0.99)
    assert blind.status == "error" and blind.cause == "probe_inconclusive"
    assert blind.evidence == {"negative_control_change": tol["leak_min"] * 0.99, "dtype": "float32", "leak_min": tol["leak_min"],
                              "isolation_atol": tol["isolation_atol"], "tolerances_raised": False}
    assert _isolation(0.0, tol["leak_min"]).status == "pass"  # exactly leak_min: conclusive


def test_a_planted_leak_below_isolation_atol_is_inconclusive_whatever_leak_min_says():
    """--packcheck-tolerance leak_min=0 isolation_atol=10: the planted leak (0.16) cannot fail the check, so the
    probe proves nothing: the cell is probe_inconclusive, never a pass."""
    probed = _ProbedBench(0.0, [], "reached")
    probed.tol = {**probed.tol, "leak_min": 0.0, "isolation_atol": 10.0}
    probed._cache[next(iter(probed._cache))]["negative_control_change"] = 0.16
    result = C.check_isolation(probed)
    assert result.status == "error" and result.cause == "probe_inconclusive", result.message
    assert "isolation_atol 1.00e+01" in result.message
    probed._cache[next(iter(probed._cache))]["negative_control_change"] = 10.5
    assert C.check_isolation(probed).status == "pass"


def test_probe_inconclusive_remedy_fits_the_cell():
    """Trial #63: a float32 cell made inconclusive by the user's tolerances was told "run this model in float32".
    Raised tolerances: the remedy names them, their values and defaults; float32 at the defaults: no float32
    advice; a bfloat16 cell at its defaults: run in float32 (Remedy(when=...) in checks/causes.py)."""
    from pytest_packcheck.analysis.diagnose import remedy
    from pytest_packcheck.config.tolerances import default_tolerances

    def fix(probed, dtype="float32"):
        probed.dtype = dtype
        result = C.check_isolation(probed)
        assert result.cause == "probe_inconclusive", result.message
        cell = {"backend": "eager", "check": "isolation", "status": result.status, "metrics": result.metrics,
                "causes": [{"cause": result.cause, "evidence": result.evidence}]}
        return remedy(result.cause, cell, {}, [])

    probed = _ProbedBench(0.0, [], "reached")
    probed.tol = {**probed.tol, "leak_min": 100.0, "isolation_atol": 10.0}
    raised = fix(probed)
    assert "float32.leak_min = 1.00e+02 (default 1.00e-03)" in raised and "float32.isolation_atol = 1.00e+01 (default 1.00e-05)" in raised
    assert "run this model in float32" not in raised
    probed = _ProbedBench(0.0, [], "reached")
    probed._cache[next(iter(probed._cache))]["negative_control_change"] = 1e-4
    plain = fix(probed)
    assert plain.startswith("already float32, with leak_min 1.0e-03") and "run this model in float32" not in plain
    probed = _ProbedBench(0.0, [], "reached")
    probed.tol = dict(default_tolerances()["bfloat16"])
    probed._cache[next(iter(probed._cache))]["negative_control_change"] = 1e-3
    assert fix(probed, "bfloat16").startswith("run this model in float32")


def test_isolation_probe_that_cannot_see_a_leak_is_inconclusive_not_a_pass(bench):
    """Planted: a model whose positions never see each other (unigram logits). Nothing moves, boundaries or not:
    the negative control fails, so isolation must not pass."""
    bench.model = UnigramLM(bench.config)
    result = C.check_isolation(bench)
    assert result.metrics["max_change"] == 0.0 and result.metrics["negative_control_change"] == 0.0
    assert result.status == "error" and result.cause == "probe_inconclusive", result.message


def test_isolation_on_the_correct_stack_and_on_planted_leaks(bench):
    ok = C.check_isolation(bench)
    assert ok.status == "pass" and ok.metrics["negative_control_change"] > bench.tol["leak_min"]
    with leaky_sdpa():
        bad = C.check_isolation(C.Workbench(model=bench.model, config=bench.config, backend="sdpa", dtype="float32", tol=bench.tol))
    assert bad.status == "fail" and bad.cause == "leak" and bad.metrics["attention_boundaries"] in ("reached", "missing")


def test_leak_probe_measures_boundaries_and_its_control(bench):
    probe = probes.leak_probe(bench)
    assert probe["max_change"] == 0.0 and probe["attention_boundaries"] == "reached" and probe["stateful_layers"] == []
    assert probe["negative_control_change"] > 1e-2
    bench.model = ForceCache(bench.model)
    assert probes.leak_probe(bench)["attention_boundaries"] == "missing"


# ------------------------------------------------------------------------------------------------------------
# position_ids


def test_position_ids_branches(bench):
    assert C.check_position_ids(bench).status == "pass"
    inner = bench.model
    bench.model = NoPositionIdsArgument(inner)
    early = C.check_position_ids(bench)
    assert early.status == "fail" and early.cause == "ignores_position_ids" and early.evidence == {"forward_takes_position_ids": False}
    bench.model = DropPositionIds(inner)
    dropped = C.check_position_ids(bench)
    assert dropped.status == "fail" and dropped.cause == "ignores_position_ids" and dropped.metrics["max_change"] == 0.0
    bench.model = inner
    bench.tol["position_min_change"] = C.check_position_ids(bench).metrics["max_change"]  # the change equals the bound
    assert C.check_position_ids(bench).status == "fail"


# ------------------------------------------------------------------------------------------------------------
# logits parity


def test_logits_parity_branches(bench):
    ok = C.check_logits_parity(bench)
    assert ok.status == "pass" and ok.cause is None and ok.metrics["max_abs_diff_solo"] <= bench.tol["logits_atol"]
    assert ok.metrics["batch_has_position_ids"] is True and ok.findings == []
    bench.tol["logits_atol"] = ok.metrics["max_abs_diff_solo"]  # at the tolerance: a pass
    assert C.check_logits_parity(bench).status == "pass"
    bench.tol["logits_atol"] = 1e-4
    bench.collator_factory = collator_no_reset
    wrong = C.check_logits_parity(bench)
    assert wrong.status == "fail" and wrong.evidence["max_abs_diff_solo"] == wrong.metrics["max_abs_diff_solo"] > 1e-3
    assert wrong.cause == "leak"  # positions not restarting: no boundary at all, the probe moves


# ------------------------------------------------------------------------------------------------------------
# loss parity: token mean, num_items_in_batch, and each cause


def test_loss_parity_needs_num_items_in_batch_passed(bench):
    """Planted: num_items_in_batch dropped on packed rows only. The token-mean loss is right, the packed
    accumulated sum is not: loss parity must fail on the grad-accum number (a check that reweights by hand would
    pass it)."""
    bench.model = DropNumItemsInBatchPacked(bench.model)
    result = C.check_loss_parity(bench)
    assert abs(result.metrics["ga_loss_packed"] - result.metrics["ga_loss_padded"]) > 10 * bench.tol["loss_atol"]
    m = result.metrics
    assert m["loss_delta"] <= bench.tol["loss_atol"] and m["ga_delta"] > 10 * bench.tol["loss_atol"]
    assert m["num_items_in_batch_packed"] == m["num_items_expected"]
    assert result.status == "fail" and result.cause == "loss_normalisation", result.message
    assert result.evidence["num_items_in_batch_packed"] == result.evidence["num_items_expected"] == m["num_items_expected"]
    # the key number is the grad-accum delta the fail rests on, not the token-mean one within tolerance (gemma4, 5.5.4)
    from pytest_packcheck.checks.registry import SPECS

    assert m["verdict_metric"] == "ga_delta" and SPECS["loss_parity"].key_number(m) == f"Δ {m['ga_delta']:.1e}"
    legacy = {k: v for k, v in m.items() if k != "verdict_metric"}  # a cell measured before it was named: the same
    assert SPECS["loss_parity"].key_number(legacy) == f"Δ {m['ga_delta']:.1e}"
    within = {**legacy, "ga_delta": legacy["atol"] / 2}  # a grad-accum delta within tolerance is never the key number
    assert SPECS["loss_parity"].key_number(within) == f"Δ {m['loss_delta']:.1e}"


def test_a_model_that_ignores_num_items_in_batch_padded_too_is_a_finding_not_a_packing_fail(bench):
    """Planted: a model whose loss never sees num_items_in_batch, packed or padded (gemma4 on 5.5.4, gemma3 on
    4.53.3: the grad-accum sum 2.0x the reference in both). Packing changes nothing, so loss_parity passes, and
    the fault is the num_items_ignored finding with both numbers and the ratio; the key number is the token-mean
    delta it passes on."""
    from pytest_packcheck.checks.registry import SPECS

    bench.model = DropNumItemsInBatch(bench.model)
    result = C.check_loss_parity(bench)
    m = result.metrics
    assert m["ga_delta"] > 10 * bench.tol["loss_atol"] and m["ga_packed_vs_padded"] <= bench.tol["loss_atol"]
    assert result.status == "pass" and result.cause is None, result.message
    [finding] = result.findings
    assert finding["cause"] == "num_items_ignored" and finding["evidence"]["ga_loss_padded"] == m["ga_loss_padded"]
    assert abs(finding["evidence"]["ga_ratio"] - m["ga_loss_padded"] / m["loss_reference"]) < 1e-12
    assert 1.5 < finding["evidence"]["ga_ratio"] < 2.5  # two micro-batch means summed
    assert "padded too, not packing" in result.message and f"{m['ga_loss_padded']:.6f}" in result.message
    assert SPECS["loss_parity"].key_number(m) == f"Δ {m['loss_delta']:.1e}"


def test_loss_parity_branches(bench):
    ok = C.check_loss_parity(bench)
    m = ok.metrics
    assert ok.status == "pass" and m["ga_delta"] <= bench.tol["loss_atol"] and abs(m["ga_loss_packed"] - m["loss_reference"]) < 1e-5
    assert m["num_items_in_batch_packed"] == m["num_items_in_batch_padded"] == m["num_items_expected"] == sum(n - 1 for n in bench.lengths)
    bench.tol["loss_atol"] = max(m["loss_delta"], m["ga_delta"])  # at the tolerance: a pass
    assert C.check_loss_parity(bench).status == "pass"
    bench.tol["loss_atol"] = 1e-5
    inner = bench.model
    bench.model = ScalePackedLoss(inner)
    scaled = C.check_loss_parity(bench)
    assert scaled.status == "fail" and scaled.cause == "loss_normalisation" and scaled.metrics["loss_delta"] > 1e-2
    bench.model = inner
    bench.collator_factory = collator_label_leak
    leak_label = C.check_loss_parity(bench)
    assert leak_label.status == "fail" and leak_label.cause == "loss_normalisation"
    assert leak_label.evidence["num_items_in_batch_packed"] == leak_label.evidence["num_items_expected"] + 1


def test_loss_parity_on_a_leak_names_the_leak(bench):
    with leaky_sdpa():
        result = C.check_loss_parity(bench)
    assert result.status == "fail" and result.cause == "leak" and result.evidence["isolation_moved"] > 1e-3


# ------------------------------------------------------------------------------------------------------------
# grad parity: relative error, cosine, and each cause


def test_grad_parity_fails_a_uniform_gradient_scale(bench):
    """Planted: the packed loss x 28/31 (logits untouched). Same direction (cosine 1), another length: the
    relative error must fail it; judged on the cosine alone it would pass."""
    bench.model = ScalePackedLoss(bench.model)
    result = C.check_grad_parity(bench)
    assert result.metrics["grad_cosine"] >= bench.tol["grad_cos_min"]
    assert abs(result.metrics["grad_rel_err"] - 3 / 31) < 1e-3
    assert result.status == "fail" and result.cause == "loss_normalisation", result.message
    assert abs(result.evidence["grad_norm_ratio"] - 28 / 31) < 1e-4


def test_grad_parity_branches(bench):
    ok = C.check_grad_parity(bench)
    assert ok.status == "pass" and ok.metrics["grad_rel_err"] < 1e-5 and 0.99999 < ok.metrics["grad_cosine"] <= 1.0  # trial 12, 2: 1.0000037
    assert ok.metrics["num_params"] == len(list(bench.model.parameters()))
    inner = bench.model
    bench.model = TiltPackedGradient(inner)
    tilted = C.check_grad_parity(bench)
    rel, cos = tilted.metrics["grad_rel_err"], tilted.metrics["grad_cosine"]
    assert cos < bench.tol["grad_cos_min"] and rel > 10 * bench.tol["grad_rel_err"]
    assert tilted.status == "fail" and tilted.cause == "wrong_positions", tilted.message
    bench.tol["grad_rel_err"] = rel / 5  # within NUMERICS_FACTOR x the tolerance: numerics
    numerics = C.check_grad_parity(bench)
    assert numerics.status == "fail" and numerics.cause == "kernel_numerics"
    # the same numbers with an attention call that lacked the packed boundaries: the examples mix, a leak, never
    # numerics (trial 15, 242: opt / sdpa in bfloat16, boundaries missing in 2 of 2 calls, read kernel_numerics)
    from pytest_packcheck.checks.probes import leak_probe

    probe = leak_probe(bench)
    kept, probe["attention_boundaries"] = probe["attention_boundaries"], "missing"
    leaked = C.check_grad_parity(bench)
    assert leaked.status == "fail" and leaked.cause == "leak" and leaked.evidence["attention_boundaries"] == "missing"
    probe["attention_boundaries"] = kept
    bench.tol["grad_rel_err"], bench.tol["grad_cos_min"] = rel, cos  # both at their bounds: a pass
    assert C.check_grad_parity(bench).status == "pass"
    bench.tol["grad_cos_min"] = 1.0  # only the cosine off
    assert C.check_grad_parity(bench).status == "fail"
    bench.model = inner
    bench.tol["grad_rel_err"], bench.tol["grad_cos_min"] = 1e-4, 0.99999
    with leaky_sdpa():
        leak = C.check_grad_parity(bench)
    assert leak.status == "fail" and leak.cause == "leak"


# ------------------------------------------------------------------------------------------------------------
# backend


def test_backend_branches(bench):
    ok = C.check_backend(bench)
    assert ok.status == "pass" and ok.metrics["boundaries_reached"] == 2 and ok.metrics["expected_calls"] == 2
    inner = bench.model
    bench.model = SilentSwap(inner)
    swap = C.check_backend(bench)
    assert swap.status == "fallback" and swap.cause == "backend_swap" and swap.evidence["calls"] == {"eager": 2}
    bench.model = RunsTwice(inner)
    twice = C.check_backend(bench)  # layers run twice (as cycles reuse them): counted from the module runs, no fault
    assert twice.status == "pass" and twice.metrics["expected_calls"] == 4 and twice.metrics["attention_module_runs"] == 4
    bench.model = ForceCache(inner)
    missing = C.check_backend(bench)
    assert missing.status == "fail" and missing.cause == "leak" and missing.evidence == {"boundaries_missing": 2, "attention_calls": 2}
    bench.model = inner
    bench.backend = "eager"  # requested eager, the model runs sdpa
    swapped = C.check_backend(bench)
    assert swapped.status == "fallback" and swapped.cause == "backend_swap" and swapped.evidence["effective"] == "sdpa"


def test_backend_fallback_warnings(bench):
    """Planted: a forward that logs an attention fallback -> fallback, backend_swap; a convolution kernel's
    fallback warning is reported beside a pass, never a backend swap."""
    inner = bench.model
    bench.model = WarnsOnForward(inner)
    warned = C.check_backend(bench)
    assert warned.status == "fallback" and warned.cause == "backend_swap"
    assert warned.evidence["warning"] == WarnsOnForward.message and warned.metrics["warnings"] == [WarnsOnForward.message]
    conv = WarnsOnForward(inner)
    conv.message = "causal_conv1d is not available, falling back to the torch implementation"
    bench.model = conv
    ok = C.check_backend(bench)
    assert ok.status == "pass" and ok.metrics["warnings"] == [] and ok.metrics["other_fallback_warnings"] == [conv.message]
    unrelated = WarnsOnForward(inner)
    unrelated.message = "sdpa attention is fine here"
    bench.model = unrelated
    assert C.check_backend(bench).status == "pass"


def test_backend_call_count_against_the_modules_that_ran(bench, monkeypatch):
    """An attention module that runs without dispatching (it computes attention inline, past the backend) makes the
    count one short of the module runs: call_count, not a leak."""
    import contextlib

    real = attention.count_attention_module_runs

    @contextlib.contextmanager
    def one_silent_run(model, calls):
        with real(model, calls) as runs:
            yield runs
        runs.append(0)

    monkeypatch.setattr(attention, "count_attention_module_runs", one_silent_run)
    fewer = C.check_backend(bench)
    assert fewer.status == "fail" and fewer.cause == "call_count"
    assert fewer.evidence == {"attention_calls": 2, "attention_module_runs": 3, "attention_modules_found": 2}


# ------------------------------------------------------------------------------------------------------------
# the traps: pass, the trap, and a row that is wrong anyway


def test_cache_trap_branches(bench):
    trap = C.check_cache_trap(bench)
    assert trap.status == "fail" and trap.cause == "cache_trap" and trap.evidence["max_abs_diff_use_cache_false"] < 1e-5
    bench.tol["logits_atol"] = trap.metrics["max_abs_diff_default"]  # the default's diff at the tolerance: a pass
    assert C.check_cache_trap(bench).status == "pass"
    bench.tol["logits_atol"] = 1e-4
    with leaky_sdpa():
        wrong = C.check_cache_trap(C.Workbench(model=bench.model, config=bench.config, backend="sdpa", dtype="float32", tol=bench.tol))
    assert wrong.status == "fail" and wrong.cause == "leak" and wrong.evidence["max_abs_diff_use_cache_false"] > 1e-3


def test_traps_at_tolerance_zero_name_the_trap_not_numerics(bench):
    """Under logits_atol 0 the rerun without the cache (without the mask) is off by float rounding only: the
    shared numerics rule (registry.fixed_by) still names the trap; a 3e-1 difference never passes as
    kernel_numerics (was: cache_trap and mask_trap both kernel_numerics, "none needed")."""
    bench.tol["logits_atol"] = 0.0
    cache, mask = C.check_cache_trap(bench), C.check_mask_trap(bench)
    assert cache.status == "fail" and cache.cause == "cache_trap", cache.message
    assert cache.evidence["max_abs_diff_default"] > 1e-2 and cache.evidence["max_abs_diff_use_cache_false"] < 1e-5
    assert mask.status == "fail" and mask.cause == "mask_override", mask.message


def test_mask_trap_branches(bench):
    trap = C.check_mask_trap(bench)
    assert trap.status == "fail" and trap.cause == "mask_override"
    bench.tol["logits_atol"] = trap.metrics["max_abs_diff_with_mask"]
    assert C.check_mask_trap(bench).status == "pass"
    bench.tol["logits_atol"] = 1e-4
    with leaky_sdpa():
        wrong = C.check_mask_trap(C.Workbench(model=bench.model, config=bench.config, backend="sdpa", dtype="float32", tol=bench.tol))
    assert wrong.status == "fail" and wrong.cause == "leak" and wrong.evidence["max_abs_diff_without_mask"] > 1e-3


# ------------------------------------------------------------------------------------------------------------
# collate: each item on its own, from planted collators


def _collator(change):
    """A DataCollatorWithFlattening whose output ``change(batch, features)`` edits (or that raises)."""

    def factory(**kwargs):
        real = default_collator_factory(**kwargs)

        def collate(features, return_tensors="pt"):
            if getattr(change, "before", False):  # a collator that refuses some inputs before collating
                change(None, features)
            batch = real(features, return_tensors=return_tensors)
            return change(batch, features) or batch

        return collate

    return factory


def _items(bench, change=None) -> tuple[CheckResult, dict[str, str]]:
    if change is not None:
        bench.collator_factory = _collator(change)
    result = C.check_collate(bench)
    return result, {k: v["status"] for k, v in result.metrics["items"].items()}


HOLDS = {"shapes": "pass", "position_ids": "pass", "labels": "pass", "cu_seq_lens": "pass", "max_length": "pass",
         "empty_example": "pass"}


def test_collate_items_on_the_correct_stack(bench):
    result, items = _items(bench)
    assert items == {**HOLDS, "integer_labels": "fail"}  # transformers 5.24: TypeError inside the collator
    assert result.status == "fail" and result.cause == "labels_contract" and result.evidence["item"] == "integer_labels"


def test_collate_reports_unmasked_labels_at_boundaries(bench):
    """Planted: labels = input_ids (no -100 at the example starts). The labels item fails on its own, with the
    collator contract's cause, whatever the integer-label item says."""
    bench.collator_factory = collator_label_leak
    result, items = _items(bench)
    assert items == {**HOLDS, "labels": "fail", "integer_labels": "fail"}
    assert result.metrics["items"]["labels"]["cause"] == "collator_contract"
    assert result.cause == "collator_contract" and result.evidence["item"] == "labels"
    assert result.findings == [{"cause": "labels_contract", "evidence": result.findings[0]["evidence"]}]


def test_collate_position_ids_items(bench):
    bench.collator_factory = collator_no_reset
    result, items = _items(bench)
    assert items == {**HOLDS, "position_ids": "fail", "integer_labels": "fail"}
    assert result.cause == "wrong_positions" and result.metrics["position_ids_mismatches"] == sum(bench.lengths[1:])

    def no_positions(batch, features):
        batch.pop("position_ids", None)

    result, items = _items(bench, no_positions)
    assert items["position_ids"] == "fail" and result.metrics["items"]["position_ids"]["cause"] == "wrong_positions"


def test_collate_shape_cu_seq_lens_and_max_length_items(bench):
    import torch

    def long_labels(batch, features):
        if all(f["input_ids"] for f in features):
            batch["labels"] = torch.cat([batch["labels"], torch.tensor([[-100]])], dim=1)

    assert _items(bench, long_labels)[1] == {**HOLDS, "shapes": "fail", "integer_labels": "fail"}

    def int64_cu(batch, features):
        batch["cu_seq_lens_k"] = batch["cu_seq_lens_k"].long()

    assert _items(bench, int64_cu)[1]["cu_seq_lens"] == "fail"

    def shifted_cu(batch, features):
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_q"] + 1

    assert _items(bench, shifted_cu)[1] == {**HOLDS, "cu_seq_lens": "fail", "integer_labels": "fail"}

    def no_cu(batch, features):
        batch.pop("cu_seq_lens_q")

    assert _items(bench, no_cu)[1]["cu_seq_lens"] == "fail"

    def tensor_max(batch, features):
        batch["max_length_q"] = torch.tensor(batch["max_length_q"])

    assert _items(bench, tensor_max)[1] == {**HOLDS, "max_length": "fail", "integer_labels": "fail"}

    def wrong_max(batch, features):
        batch["max_length_k"] = batch["max_length_k"] + 1

    assert _items(bench, wrong_max)[1]["max_length"] == "fail"


def test_collate_empty_example_and_integer_labels_items(bench):
    import torch

    def refuse_empty_and_int_labels(batch, features):
        if any(not f["input_ids"] for f in features):
            raise ValueError("empty example")
        if isinstance(features[0].get("labels"), int):
            raise ValueError("labels must be token lists")  # noqa: TRY004 - a ValueError is what the contract asks for

    refuse_empty_and_int_labels.before = True
    result, items = _items(bench, refuse_empty_and_int_labels)
    assert items == {**HOLDS, "integer_labels": "pass"} and result.status == "pass" and result.cause is None
    assert result.metrics["empty_example"].startswith("rejected")

    def accepting(**kwargs):
        real = default_collator_factory(**kwargs)

        def collate(features, return_tensors="pt"):
            if isinstance(features[0].get("labels"), int):  # accepted silently: one label per example
                return {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[1, 1]])}
            return real(features, return_tensors=return_tensors)

        return collate

    bench.collator_factory = accepting
    result, items = _items(bench)
    assert items["integer_labels"] == "fail" and result.cause == "labels_contract"
    assert result.metrics["integer_labels"].startswith("accepted silently")

    def unclear_error(batch, features):
        if isinstance(features[0].get("labels"), int):
            raise TypeError("'int' object is not subscriptable")

    unclear_error.before = True

    assert _items(bench, unclear_error)[1]["integer_labels"] == "fail"

    def clear_type_error(batch, features):
        if isinstance(features[0].get("labels"), int):
            raise TypeError("labels must be lists of token ids")

    clear_type_error.before = True

    assert _items(bench, clear_type_error)[1]["integer_labels"] == "pass"

    def keeps_zero_length(batch, features):
        if any(not f["input_ids"] for f in features):
            batch["cu_seq_lens_q"] = torch.cat([batch["cu_seq_lens_q"], batch["cu_seq_lens_q"][-1:]])

    result, items = _items(bench, keeps_zero_length)
    assert items["empty_example"] == "fail" and result.metrics["items"]["empty_example"]["cause"] == "empty_example"
    total = sum(bench.lengths)
    assert result.metrics["empty_example"] == (f"kept, not dropped: input_ids [1, {total}], labels [1, {total}], position_ids "
                                               f"[1, {total}], seq_idx [1, {total}], cu_seq_lens_q [0, 11, 18, {total}, {total}]")


def test_items_result_takes_the_first_failed_items_cause():
    items: dict = {}
    collate._item(items, "a", True, "fine")
    assert collate._items_result(dict(items), {}, "x").status == "pass"
    collate._item(items, "b", False, "off", "wrong_positions")
    collate._item(items, "c", False, "off too", "wrong_positions")
    collate._item(items, "d", False, "other", "labels_contract")
    result = collate._items_result(items, {}, "x")
    assert result.status == "fail" and result.cause == "wrong_positions" and result.evidence == {"item": "b", "detail": "off"}
    assert result.findings == [{"cause": "labels_contract", "evidence": "d: other"}]
    assert items["a"] == {"status": "pass", "evidence": "fine"} and items["b"]["cause"] == "wrong_positions"


# ------------------------------------------------------------------------------------------------------------
# the records the report, the gate and the diagnosis read: every key, and the bounds as resolved


def test_each_checks_record_keeps_its_keys_and_bounds(bench):
    t = bench.tol
    expected = {
        C.check_collate: ({"empty_example", "integer_labels", "items", "lengths", "position_ids_mismatches", "position_ids_start",
                           "shapes", "unmasked_boundaries"}, {"position_ids_start": 0, "lengths": bench.lengths}),
        C.check_position_ids: ({"max_change", "threshold"}, {"threshold": t["position_min_change"]}),
        C.check_isolation: ({"atol", "attention_boundaries", "max_change", "negative_control_change", "stateful_layers"},
                            {"atol": t["isolation_atol"], "stateful_layers": [], "attention_boundaries": "reached"}),
        C.check_loss_parity: ({"atol", "ga_delta", "ga_loss_packed", "ga_loss_padded", "ga_packed_vs_padded", "loss_delta", "loss_packed", "loss_padded",
                               "loss_reference", "num_items_expected", "num_items_in_batch_packed", "num_items_in_batch_padded",
                               "padded_delta"}, {"atol": t["loss_atol"]}),
        C.check_grad_parity: ({"cos_min", "grad_cosine", "grad_rel_err", "num_params", "rel_tol", "worst_param", "worst_param_rel_err"},
                              {"cos_min": t["grad_cos_min"], "rel_tol": t["grad_rel_err"]}),
        C.check_backend: ({"attention_module_runs", "attention_modules_found", "boundaries_missing", "boundaries_reached", "calls",
                           "dense_kernel_calls", "dispatches_per_run", "effective", "expected_calls",
                           "other_fallback_warnings", "requested", "varlen_kernel_calls", "warnings"},
                          {"requested": "sdpa", "effective": "sdpa", "calls": {"sdpa": 2}, "boundaries_missing": 0,
                           "dense_kernel_calls": 0, "varlen_kernel_calls": 0, "warnings": [], "other_fallback_warnings": []}),
        C.check_cache_trap: ({"atol", "config_use_cache", "max_abs_diff_default", "max_abs_diff_use_cache_false"},
                             {"atol": t["logits_atol"], "config_use_cache": True}),
        C.check_mask_trap: ({"atol", "max_abs_diff_with_mask", "max_abs_diff_without_mask"}, {"atol": t["logits_atol"]}),
    }
    for check, (keys, values) in expected.items():
        result = check(bench)
        assert set(result.metrics) == keys, check.__name__
        assert {k: result.metrics[k] for k in values} == values, check.__name__
    loss = C.check_loss_parity(bench).metrics
    assert abs(loss["padded_delta"] - abs(loss["loss_padded"] - loss["loss_reference"])) < 1e-12
    assert abs(loss["ga_loss_padded"] - loss["loss_reference"]) < 1e-5
    grad = C.check_grad_parity(bench).metrics
    assert grad["worst_param"] in dict(bench.model.named_parameters()) and grad["worst_param_rel_err"] < 1e-4
    collate = C.check_collate(bench).metrics
    total = sum(bench.lengths)
    assert collate["shapes"] == {k: [1, total] for k in ("input_ids", "labels", "position_ids", "seq_idx")}
    assert collate["position_ids_mismatches"] == collate["unmasked_boundaries"] == 0


@pytest.mark.parametrize("lengths, measured", [((11, 7, 13), True), ((11, 1, 13), True), ((5, 1, 5), False), ((9, 12), False)])
def test_the_batch_rows_probe_runs_for_any_lengths_that_make_two_rows_and_says_why_not_otherwise(_llama, tolerances, lengths, measured):
    """Trial 19, 72: with --packcheck-lengths 11,1,13 the two-row probe (the batch_rows hazard) was silently gone
    from the hazards table: the example order gave no two equal rows. Any three examples that make two rows are
    used now; lengths that make none are named (metrics.two_rows_not_measured), and the hazards section says so."""
    from conftest import planted_cell, planted_doc

    from pytest_packcheck.model import batches as B
    from pytest_packcheck.report import render_markdown

    wb = C.Workbench(model=_llama, config=_llama.config, backend="sdpa", dtype="float32", tol=dict(tolerances["float32"]),
                     examples=B.make_examples(_llama.config, list(lengths)))
    result = parity.check_logits_parity(wb)
    assert result.status == "pass"
    if measured:
        assert result.metrics["max_abs_diff_two_rows"] < 1e-5 and "two_rows_not_measured" not in result.metrics
        return
    why = result.metrics["two_rows_not_measured"]
    assert "max_abs_diff_two_rows" not in result.metrics and f"the example lengths {','.join(map(str, lengths))}" in why
    md = render_markdown(planted_doc([planted_cell("llama", "sdpa", "logits_parity", "pass", max_abs_diff_solo=0.0,
                                                   two_rows_not_measured=why)]))
    assert "batch rows: not measured: the example lengths" in md.replace("\\", ""), md


def test_a_stored_loss_parity_fail_that_padded_shares_is_judged_again_on_load(tmp_path):
    """Cells measured before the num_items_ignored rule (the atlas's gemma4 on 5.5.4, numbers copied from its
    results) read as today's check returns them: pass with the finding, marked re-judged, diagnosed again. A cell
    whose padded grad-accum loss is right stays the packing fail it was (the planted counter-case), and so does one
    with a second cause."""
    import json

    from pytest_packcheck.results import load_document

    metrics = {"atol": 1e-05, "ga_delta": 6.215075629098075, "ga_loss_packed": 12.456751823425293,
               "ga_loss_padded": 12.456751823425293, "loss_delta": 1.3623918793115308e-07, "loss_packed": 6.241676330566406,
               "loss_padded": 6.241676330566406, "loss_reference": 6.241676194327218, "num_items_expected": 28,
               "num_items_in_batch_packed": 28, "num_items_in_batch_padded": 28, "padded_delta": 1.3623918793115308e-07}
    evidence = {"ga_normalisation": "num_items_in_batch", "ga_normalisation_rule": "its forward has **kwargs",
                "logits_diff": 1.3e-06, "loss_delta": 1.36e-07, "num_items_expected": 28, "num_items_in_batch_packed": 28}

    def cell(name, **m):
        return {"cell_id": f"{name}-sdpa-loss_parity-float32", "model": {"label": name, "model_type": name}, "backend": "sdpa",
                "check": "loss_parity", "dtype": "float32", "status": "fail", "cause": "loss_normalisation",
                "causes": [{"cause": "loss_normalisation", "evidence": evidence}], "evidence": evidence, "findings": [],
                "message": "grad-accum sum loss packed 12.456752 vs reference 6.241676 (delta 6.22e+00)",
                "metrics": {**metrics, **m}, "diagnosis": {"cause": "loss_normalisation", "remedy": "old"}}
    two = cell("opt")
    two["causes"] = [*two["causes"], {"cause": "leak", "evidence": {}}]
    doc = {"schema_version": 2, "settings": {}, "environment": {"transformers": "5.5.4"},
           "cells": [cell("gemma4"), cell("llama", ga_loss_padded=6.2416763), two]}
    path = tmp_path / "packcheck-matrix.json"
    path.write_text(json.dumps(doc))
    gemma4, llama, opt = load_document(path)["cells"]
    assert gemma4["status"] == "pass" and gemma4["cause"] is None and gemma4["causes"] == []
    [finding] = gemma4["findings"]
    assert finding["cause"] == "num_items_ignored" and "judged again" in finding["evidence"]["rejudged"]
    assert abs(finding["evidence"]["ga_ratio"] - 1.9957) < 1e-3 and gemma4["metrics"]["ga_packed_vs_padded"] == 0.0
    assert "12.456752 = padded 12.456752" in gemma4["message"] and "2.00x the reference 6.241676" in gemma4["message"]
    assert [f["cause"] for f in gemma4["diagnosis"]["findings"]] == ["num_items_ignored"]
    assert "accepts_loss_kwargs = False" in gemma4["diagnosis"]["findings"][0]["remedy"]
    assert gemma4["evidence"] == {"ga_normalisation": "num_items_in_batch", "ga_normalisation_rule": "its forward has **kwargs"}
    assert (llama["status"], llama["cause"]) == ("fail", "loss_normalisation") and not llama["findings"]
    assert (opt["status"], opt["cause"]) == ("fail", "loss_normalisation")
