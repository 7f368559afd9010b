"""The first-batch guard (pytest_packcheck.guard): the issue's cases on tiny random models, CPU."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import make_bench

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.guard import RESULT_FILE, PackcheckCallback, PackedBatchMismatch, verify_packed_batch


class AllOnesMask:
    """A collator wrapper that keeps an all-ones attention_mask beside the packed row (the mask trap)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features, *args, **kwargs):
        batch = self.collator(features, *args, **kwargs)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def _sft_trainer(bench, out_dir, callbacks=None, **overrides):
    """TRL's SFTTrainer(packing=True) on six short texts, one packed row per step, SGD, as configured by default."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from pytest_packcheck.sft import SENTENCES, offline_tokenizer
    from pytest_packcheck.training import TRAIN_RECIPE

    args = SFTConfig(output_dir=str(out_dir), packing=True, max_length=512, per_device_train_batch_size=1, max_steps=1,
                     report_to=[], save_strategy="no", use_cpu=True, bf16=False, fp16=False, disable_tqdm=True,
                     **{**TRAIN_RECIPE, **overrides})
    return SFTTrainer(model=bench.model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in SENTENCES]),
                      processing_class=offline_tokenizer(int(bench.config.vocab_size)), callbacks=callbacks)


def _trainer(bench, out_dir, collator, callback=None):
    """transformers' Trainer on the bench's three examples in one packed row, one SGD step."""
    from transformers import Trainer, TrainingArguments

    from pytest_packcheck.training import TRAIN_RECIPE

    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=3, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False, **TRAIN_RECIPE)
    trainer = Trainer(model=bench.model, args=args, train_dataset=[{"input_ids": e} for e in bench.examples],
                      data_collator=collator)
    if callback is not None:
        trainer.add_callback(callback)
    return trainer


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sft_packing_passes_and_first_step_is_bit_identical(tolerances, tmp_path):
    pytest.importorskip("trl")
    from pytest_packcheck.training import train_and_restore

    bench = make_bench("llama", "sdpa", tolerances)
    callback = PackcheckCallback()
    with_cb = train_and_restore(bench.model, lambda: _sft_trainer(bench, tmp_path, callbacks=[callback]))
    without = train_and_restore(bench.model, lambda: _sft_trainer(bench, tmp_path))
    result = callback.result
    assert result is not None and result.verdict == "pass", result.line()
    assert len(result.lengths) == 6 and result.max_logprob_diff <= result.tolerance["logits_atol"]
    assert result.run["fused_lm_head"] and result.run["use_cache"] is False and result.attention["calls"] == {"sdpa": 2}
    assert result.forwards == 1 + 6  # the packed row plus one forward per example
    # the trainer's first step: the same loss and the same parameters, bit for bit
    assert with_cb[0] == without[0] and with_cb[1] == without[1]
    assert all(torch.equal(with_cb[2][n], without[2][n]) for n in without[2])
    written = json.loads((tmp_path / RESULT_FILE).read_text())
    assert written["verdict"] == "pass" and written["dtype"] == "float32"


def test_sft_mask_collator_raises_before_the_first_step(tolerances, tmp_path):
    pytest.importorskip("trl")
    bench = make_bench("llama", "sdpa", tolerances)
    before = _params(bench.model)
    trainer = _sft_trainer(bench, tmp_path)
    trainer.add_callback(PackcheckCallback())
    trainer.data_collator = AllOnesMask(trainer.data_collator)
    with pytest.raises(PackedBatchMismatch, match="mask_override") as info:
        trainer.train()
    result = info.value.result
    assert result.cause == "mask_override" and "attention_mask" in result.remedy
    assert result.probes["without_attention_mask"] <= result.tolerance["logits_atol"] < result.max_logprob_diff
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in bench.model.named_parameters())


def test_hand_written_loop_reports_the_cache_trap(tolerances):
    bench = make_bench("llama", "sdpa", tolerances)
    assert bench.model.config.use_cache is True  # the config default a hand-written loop runs with
    bench.model.train()
    result = verify_packed_batch(bench.model, bench.packed())
    assert bench.model.training  # modes restored
    assert result.verdict == "fail" and result.cause == "cache_trap", result.line()
    assert "use_cache=False" in result.remedy and result.probes["use_cache_false"] <= result.tolerance["logits_atol"]
    fixed = verify_packed_batch(bench.model, bench.packed(), use_cache=False)
    assert fixed.verdict == "pass" and fixed.forwards == 4


def test_opt_sdpa_raises_leak(tolerances, tmp_path):
    bench = make_bench("opt", "sdpa", tolerances)
    collator = bench.collator_factory(return_position_ids=True)
    with pytest.raises(PackedBatchMismatch) as info:
        _trainer(bench, tmp_path, collator, PackcheckCallback()).train()
    result = info.value.result
    assert result.cause == "leak", result.line()
    assert result.attention["boundaries_missing"] == 2 and "flash" in result.remedy
    assert json.loads((tmp_path / RESULT_FILE).read_text())["cause"] == "leak"


def test_policies_warn_and_disable(tolerances, tmp_path):
    from pytest_packcheck.guard import PackcheckGuardWarning

    bench = make_bench("llama", "sdpa", tolerances)
    flat = bench.collator_factory(return_position_ids=True)
    reference = _trainer(bench, tmp_path / "ref", flat)
    reference.train()
    expected = _params(bench.model)
    bench.model.load_state_dict(make_bench("llama", "sdpa", tolerances).model.state_dict())
    # disable: the mask is dropped from packed rows, and the step is the one without the mask
    callback = PackcheckCallback(on_mismatch="disable", verbose=False)
    _trainer(bench, tmp_path / "disable", AllOnesMask(flat), callback).train()
    assert callback.result.cause == "mask_override" and "attention_mask dropped" in callback.fallback
    assert all(torch.allclose(p, expected[n], atol=1e-6) for n, p in bench.model.named_parameters())
    # warn: training goes on with the mask
    callback = PackcheckCallback(on_mismatch="warn", verbose=False)
    with pytest.warns(PackcheckGuardWarning, match="mask_override"):
        _trainer(bench, tmp_path / "warn", AllOnesMask(flat), callback).train()


def test_disable_falls_back_to_padding_on_a_leak(tolerances, tmp_path):
    bench = make_bench("opt", "sdpa", tolerances)
    callback = PackcheckCallback(on_mismatch="disable", verbose=False)
    trainer = _trainer(bench, tmp_path, bench.collator_factory(return_position_ids=True), callback)
    trainer.train()
    assert callback.result.cause == "leak" and callback.fallback.startswith("packing off")
    assert callback.result.probes["padded"] <= callback.result.tolerance["logits_atol"]
    assert trainer.state.global_step == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: bf16 on the flash path")
def test_bf16_cuda_uses_the_bf16_tolerance(tolerances):
    from pytest_packcheck.backends import TORCH_VARLEN_BACKEND, backend_availability, register_reference_backend
    from pytest_packcheck.models import build_model, resolve_model
    from pytest_packcheck.specs import parse_model_spec

    backend = "flash_attention_2" if backend_availability("flash_attention_2", "cuda").available else TORCH_VARLEN_BACKEND
    if not backend_availability(backend, "cuda").available:
        pytest.skip(f"no flash backend runs here: {backend_availability(backend, 'cuda').reason}")
    register_reference_backend()
    model = build_model(resolve_model(parse_model_spec("arch:llama", "test"), "test"), backend, "bfloat16", device="cuda")
    from pytest_packcheck.checks import Workbench

    bench = Workbench(model=model, config=model.config, backend=backend, dtype="bfloat16", tol=tolerances["bfloat16"],
                      device="cuda")
    result = verify_packed_batch(model, bench.packed(flash_kwargs=True), use_cache=False)
    assert result.dtype == "bfloat16" and result.tolerance["logits_atol"] == tolerances["bfloat16"]["logits_atol"]
    assert result.verdict == "pass", result.line()


@pytest.mark.parametrize(("batch", "message"), [
    ([1, 2, 3], "batch is a list, expected a dict"),
    ({"labels": torch.zeros(1, 4)}, "batch has no 'input_ids' (keys: labels)"),
    ({"input_ids": torch.zeros(4, dtype=torch.long)}, "is (4,), expected a tensor of shape (1, total_tokens)"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "position_ids": torch.zeros(2, 4, dtype=torch.long)},
     "has shape (2, 4): a packed row has shape (1, total_tokens)"),
    ({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, "neither position_ids nor cu_seq_lens_q"),
])
def test_bad_input_is_one_clear_line(llama_sdpa, batch, message):
    with pytest.raises(PackcheckUsageError) as info:
        verify_packed_batch(llama_sdpa.model, batch)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_policy_and_broken_contract(llama_sdpa):
    with pytest.raises(PackcheckUsageError, match="on_mismatch='stop'"):
        PackcheckCallback(on_mismatch="stop")
    batch = llama_sdpa.packed()
    batch["labels"] = batch["labels"][:, :-1]
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.cause == "collator_contract" and result.forwards == 0 and "labels has shape" in result.evidence


@functools.cache
def _llama_row():
    """A tiny llama (sdpa, use_cache=False as a Trainer sets it) and one packed row of three examples."""
    from pytest_packcheck.checks import Workbench
    from pytest_packcheck.models import build_model, resolve_model
    from pytest_packcheck.specs import parse_model_spec

    model = build_model(resolve_model(parse_model_spec("arch:llama", "test"), "test"), "sdpa", "float32")
    model.config.use_cache = False
    return model, Workbench(model=model, config=model.config, backend="sdpa", dtype="float32", tol={}).packed()


def test_fixture_plain(packcheck_verify):
    assert packcheck_verify(*_llama_row()).verdict == "pass"
    model, row = _llama_row()
    with pytest.raises(PackedBatchMismatch, match="cache_trap"):
        packcheck_verify(model, row, use_cache=True)


@pytest.mark.parametrize("packcheck_verify", [pytest.param({"model": lambda: _llama_row()[0], "batch": lambda: _llama_row()[1]},
                                                           id="llama-sdpa")], indirect=True)
def test_fixture_parametrized(packcheck_verify):
    assert packcheck_verify.verdict == "pass" and packcheck_verify.lengths == [11, 7, 13]
