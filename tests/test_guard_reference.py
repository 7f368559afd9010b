"""The guard's per-example reference as right-padded batches and its fallback to each example alone (issue 47), and
the counts the trainer divides by: the tests that tools/guard_mutants.py runs against its mutants of those branches
(issue 41: tests that catch a broken checker). Tiny random models, CPU."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_bench

from pytest_packcheck.guard import PackcheckCallback, PackedBatchMismatch, verify_packed_batch
from pytest_packcheck.model import batches as B


def _row(bench, lengths):
    return B.packed_batch(B.make_examples(bench.model.config, lengths), start=bench.start)


def _padded_number(reference: str) -> float:
    """The number the padded batches gave, from probes['reference'] ("one at a time (the padded batches gave 7.5e-05:
    not a clean pass)")."""
    found = re.search(r"the padded batches gave ([0-9.e+-]+)", reference)
    assert found, reference
    return float(found.group(1))


def test_padded_reference_runs_a_continuation_chunk_at_its_own_positions(tolerances):
    """gpt2 (learned absolute positions): a continuation chunk (the second example from position 30) in one padded
    batch with the others must be run at its own positions, as the one-at-a-time truth runs it; from position 0 its
    log-probs move by ~1e-1 and the guard would spend the one-at-a-time fallback on every such row."""
    from pytest_packcheck.guard.batch import _targets, parse_row
    from pytest_packcheck.guard.forward import _reference, _solo

    bench = make_bench("gpt2", "sdpa", tolerances)
    model = bench.model.eval()
    batch = _row(bench, (12, 11, 10))
    batch["position_ids"][0, 12:23] += 30
    row = parse_row(batch, model.config)
    assert row.continued == {12: 30}
    _, targets = _targets(row)
    truth_forwards, padded_forwards = [0], [0]
    with torch.no_grad():
        truth, which = _solo(model, row, targets, False, truth_forwards)
        padded, which_padded = _reference(model, row, targets, False, padded_forwards)
    assert which == which_padded == [0, 1, 2] and (truth_forwards[0], padded_forwards[0]) == (3, 1)
    worst = max(float((a - b).abs().max()) for a, b in zip(truth, padded, strict=True))
    assert worst <= 2e-6, worst
    result = verify_packed_batch(model, batch, use_cache=False)
    assert result.verdict == "pass" and result.probes["reference"].startswith("right-padded batches"), result.line()


def test_a_padded_reference_past_half_the_tolerance_is_not_trusted(tolerances):
    """Planted: the packed row's logits scaled by (1 + e), the padded batches' by (1 + e / 2), each example alone
    untouched, e set so that the packed row is off the truth by ~1.5x the float32 tolerance. The padded batches then
    sit within the tolerance but past half of it: they must not pass the row (half the tolerance is the margin for
    the padded batch's own GEMM-shape noise); the truth fails it."""
    bench = make_bench("llama", "sdpa", tolerances)
    model = bench.model
    forward = model.forward
    batch = _row(bench, (12, 11, 10))  # one padded group: 3 x 12 <= 1.25 x 33 tokens
    total = batch["input_ids"].shape[1]
    scale = {"packed": 0.0, "padded": 0.0}

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        rows, length = out.logits.shape[:2]
        e = scale["padded"] if rows > 1 else scale["packed"] if length == total else 0.0
        out.logits = out.logits * (1 + e)
        return out

    model.forward = scaled
    scale["packed"] = 1e-2
    calibrate = verify_packed_batch(model, batch, use_cache=False)  # the truth's number at e = 1e-2
    atol = calibrate.tolerance["logits_atol"]
    e = 1e-2 * 1.5 * atol / calibrate.max_logprob_diff
    scale.update(packed=e, padded=e / 2)
    result = verify_packed_batch(model, batch, use_cache=False)
    gave = _padded_number(result.probes["reference"])
    assert atol / 2 < gave <= atol, result.probes["reference"]  # the planted band: within the tolerance, past half
    assert result.verdict == "fail" and atol < result.max_logprob_diff < 2 * atol, result.line()


def test_a_contract_item_is_judged_on_each_example_alone(llama_sdpa):
    """A row whose only fault is a contract item that moves no number (num_items_in_batch 5 beside the row's own 28
    scored label tokens: the padded batches agree with the packed row) fails on the contract; its numbers are the
    one-at-a-time truth's, never the padded batches' (which only ever pass a clean row)."""
    llama_sdpa.model.config.use_cache = False
    batch = {**llama_sdpa.packed(), "num_items_in_batch": 5}
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert "num_items_in_batch 5 is below this row's own 28" in result.evidence, result.line()
    assert result.probes["reference"].startswith("one at a time (the padded batches gave"), result.probes["reference"]
    assert result.max_logprob_diff <= result.tolerance["logits_atol"], result.line()


def test_a_reduced_precision_row_is_judged_on_each_example_alone(tolerances):
    """bf16 weights: a padded batch's GEMM shape moves bf16 log-probs by a rounding level, so a reduced-precision
    row is never passed on the padded batches."""
    bench = make_bench("llama", "sdpa", tolerances)
    model = bench.model.to(torch.bfloat16)
    result = verify_packed_batch(model, bench.packed(), use_cache=False)
    assert result.dtype == "bfloat16" and result.probes["reference"] == "one at a time (bfloat16 compute)", result.line()


def test_a_model_that_refuses_a_padded_batch_is_judged_on_each_example_alone(llama_sdpa):
    """Planted: a forward that raises on any batch of more than one row. The padded reference is a shortcut, never a
    verdict: the row is judged one example at a time and passes."""
    model = llama_sdpa.model
    model.config.use_cache = False
    forward = model.forward

    def one_row_only(*args, **kwargs):
        if kwargs["input_ids"].shape[0] > 1:
            raise RuntimeError("planted: one row at a time")
        return forward(*args, **kwargs)

    model.forward = one_row_only
    result = verify_packed_batch(model, llama_sdpa.packed())
    assert result.verdict == "pass", result.line()
    assert result.probes["reference"] == "one at a time (the padded batch raised RuntimeError)", result.probes["reference"]


def test_zero_difference_beside_a_contract_item_names_the_contract_alone(llama_sdpa):
    """At tolerance 0 a difference of exactly 0.0 is within it: a row whose only fault is a contract item that moves
    no log-prob (labels not -100 at the example starts) names that item alone; the probes that look for a second
    cause run only above the tolerance (a model whose logits ignore the context: UnigramLM)."""
    from faults import UnigramLM

    model = UnigramLM(llama_sdpa.model.config)
    batch = llama_sdpa.packed()
    batch["labels"] = batch["input_ids"].clone()
    result = verify_packed_batch(model, batch, tolerances={"float32": {"logits_atol": 0.0, "loss_atol": 0.0}})
    assert result.max_logprob_diff == 0.0, result.line()
    assert result.causes == ["collator_contract"] and not result.also, result.line()


def test_accumulation_window_count_split_over_processes_is_a_note(tolerances, tmp_path, monkeypatch):
    """Where the Trainer may divide num_items_in_batch (several processes or GPUs), a window count off the sum of its
    micro-batches is a note, never a failure (planted: the count of the first micro-batch only, the division faked)."""
    from transformers import Trainer, TrainingArguments

    from pytest_packcheck.checks.training import TRAIN_RECIPE
    from pytest_packcheck.guard import batch as guard_batch

    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False
    real = Trainer._get_num_items_in_batch
    monkeypatch.setattr(Trainer, "_get_num_items_in_batch", lambda self, batches, device: real(self, batches[:1], device))
    monkeypatch.setattr(guard_batch, "_count_may_be_divided", lambda: True)
    callback = PackcheckCallback()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             max_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, **TRAIN_RECIPE)
    trainer = Trainer(model=bench.model, args=args, train_dataset=[{"input_ids": e} for e in bench.examples] * 2,
                      data_collator=bench.collator_factory(return_position_ids=True), callbacks=[callback])
    try:
        trainer.train()
    except PackedBatchMismatch as exc:  # the failure the note replaces: shown with its line
        pytest.fail(exc.result.line())
    result = callback.result
    assert result.verdict == "pass" and trainer.state.global_step == 1, result.line()
    assert any("unless the Trainer divided it over processes" in n for n in result.notes), result.notes
