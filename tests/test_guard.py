"""The first-batch guard (pytest_packcheck.guard): the issue's cases on tiny random models, CPU."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

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

    from pytest_packcheck.checks.sft_setup import SENTENCES, offline_tokenizer
    from pytest_packcheck.checks.training import TRAIN_RECIPE

    args = SFTConfig(output_dir=str(out_dir), packing=True, max_length=512, per_device_train_batch_size=1, max_steps=1,
                     report_to=[], save_strategy="no", use_cpu=True, bf16=False, fp16=False, disable_tqdm=True,
                     **{**TRAIN_RECIPE, **overrides})
    return SFTTrainer(model=bench.model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in SENTENCES]),
                      processing_class=offline_tokenizer(int(bench.config.vocab_size)), callbacks=callbacks)


def _trainer(bench, out_dir, collator, callback=None):
    """transformers' Trainer on the bench's three examples in one packed row, one SGD step."""
    from transformers import Trainer, TrainingArguments

    from pytest_packcheck.checks.training import TRAIN_RECIPE

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
    from pytest_packcheck.checks.training import train_and_restore

    bench = make_bench("llama", "sdpa", tolerances)
    callback = PackcheckCallback()
    with_cb = train_and_restore(bench.model, lambda: _sft_trainer(bench, tmp_path, callbacks=[callback]))
    without = train_and_restore(bench.model, lambda: _sft_trainer(bench, tmp_path))
    result = callback.result
    assert result is not None and result.verdict == "pass", result.line()
    assert len(result.lengths) == 6 and result.max_logprob_diff <= result.tolerance["logits_atol"]
    assert result.run["fused_lm_head"] and result.run["use_cache"] is False and result.attention["calls"] == {"sdpa": 2}
    assert result.forwards == 1 + 6  # the packed row plus one forward per example: TRL's fused head runs one at a time
    assert result.probes["reference"] == "one at a time (TRL's fused LM head)"
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


@pytest.mark.parametrize("arch,backend", [("llama", "sdpa"), ("llama", "eager"), ("opt", "sdpa"), ("gpt2", "eager"),
                                          ("gemma3_text", "sdpa")])
def test_padded_reference_agrees_with_each_example_alone(tolerances, arch, backend):
    """The guard's reference as right-padded batches vs the one-at-a-time truth, on the models the guard tests use:
    measured 0 to 9.5e-07 nats (float32 GEMMs of another shape) on 3, 16 and 6 examples, far below half the float32
    tolerance (5e-05), the margin below which the guard passes a row on the padded batches alone."""
    from pytest_packcheck.guard.batch import _targets, parse_row
    from pytest_packcheck.guard.forward import _batchable, _reference, _solo
    from pytest_packcheck.model import batches as B

    bench = make_bench(arch, backend, tolerances)
    model = bench.model.eval()
    lengths = (9, 12, 16, 8, 11, 14, 10, 13, 15, 8, 12, 9, 16, 11, 10, 14)
    row = parse_row(B.packed_batch(B.make_examples(model.config, lengths), start=bench.start), model.config)
    _, targets = _targets(row)
    truth_forwards, padded_forwards = [0], [0]
    with torch.no_grad():
        truth, which = _solo(model, row, targets, False, truth_forwards)
        padded, which_padded = _reference(model, row, targets, False, padded_forwards)
    assert _batchable(model, row, False) is None and which == which_padded == list(range(16))
    assert truth_forwards[0] == 16 and padded_forwards[0] <= 3, padded_forwards
    worst = max(float((a - b).abs().max()) for a, b in zip(truth, padded, strict=True))
    assert worst <= 2e-6 < tolerances["float32"]["logits_atol"] / 2, worst


def test_a_padded_reference_that_disagrees_falls_back_to_each_example_alone(tolerances):
    """Planted: a model whose right-padded batches are off by 1e-3 (a batch of more than one row gets noise). The
    guard must not judge on them: the correct packed row still passes, on the one-at-a-time truth, and says so."""
    bench = make_bench("llama", "sdpa", tolerances)
    model = bench.model
    forward = model.forward

    def noisy(*args, **kwargs):
        out = forward(*args, **kwargs)
        if out.logits.shape[0] > 1:
            out.logits = out.logits + 1e-3 * torch.randn_like(out.logits)
        return out

    model.forward = noisy
    result = verify_packed_batch(model, bench.packed(), use_cache=False)
    assert result.verdict == "pass" and result.max_logprob_diff <= 1e-6, result.line()
    assert result.probes["reference"].startswith("one at a time (the padded batches gave"), result.probes["reference"]
    assert result.forwards == 1 + 1 + 3  # the packed row, the padded batch (13, 11, 7 tokens), then each example alone


def test_stateful_layers_keep_the_one_at_a_time_reference(tolerances):
    """lfm2's short-conv layers: no padded batches (a conv state a pad could reach), each example alone."""
    from pytest_packcheck.guard.batch import parse_row
    from pytest_packcheck.guard.forward import _batchable

    bench = make_bench("lfm2", "sdpa", tolerances)
    row = parse_row(bench.packed(), bench.model.config)
    assert _batchable(bench.model, row, False) == "stateful layers"


def test_hand_written_loop_reports_the_cache_trap(tolerances):
    bench = make_bench("llama", "sdpa", tolerances)
    assert bench.model.config.use_cache is True  # the config default a hand-written loop runs with
    bench.model.train()
    result = verify_packed_batch(bench.model, bench.packed())
    assert bench.model.training  # modes restored
    assert result.verdict == "fail" and result.cause == "cache_trap", result.line()
    assert result.causes[0] == "cache_trap", result.causes  # trial 7, 139: the list was empty on a probe's cause
    assert "use_cache=False" in result.remedy and result.probes["use_cache_false"] <= result.tolerance["logits_atol"]
    fixed = verify_packed_batch(bench.model, bench.packed(), use_cache=False)
    # the packed row, then the three examples as one right-padded batch (13, 11 and 7 tokens: 39 padded for 31 real,
    # within the 1.5x budget): 2, not 1 + 3
    assert fixed.verdict == "pass" and fixed.forwards == 2, fixed.probes["reference"]
    assert fixed.probes["reference"] == "right-padded batches: 3 examples in 1 forward"


def test_opt_sdpa_raises_leak(tolerances, tmp_path):
    bench = make_bench("opt", "sdpa", tolerances)
    collator = bench.collator_factory(return_position_ids=True)
    with pytest.raises(PackedBatchMismatch) as info:
        _trainer(bench, tmp_path, collator, PackcheckCallback()).train()
    result = info.value.result
    assert result.cause == "leak" and result.causes[0] == "leak", (result.line(), result.causes)
    assert result.attention["boundaries_missing"] == 2 and "flash" in result.remedy
    # the guard's own wording: its user has no audit cell (trial 4, 278)
    assert "reference cell" not in result.remedy and "run this guard again" in result.remedy
    assert json.loads((tmp_path / RESULT_FILE).read_text())["cause"] == "leak"


def test_the_guards_leak_remedy_names_no_audit_cell():
    """Trial 4, 278: the guard on opt gave the audit's remedy ("see its varlen reference cell, packcheck's CPU
    stand-in ..."); the guard's cell (check "guard") gets the same advice in terms of its own run."""
    from pytest_packcheck.analysis.diagnose import remedy

    guard = remedy("leak", {"backend": "sdpa", "check": "guard", "metrics": {"batch_has_position_ids": True}}, {}, faults=[])
    audit = remedy("leak", {"backend": "sdpa", "check": "isolation", "metrics": {}}, {}, faults=[])
    assert "reference cell" not in guard and "attn_implementation='flash_attention_2'" in guard and "run this guard again" in guard
    # trial 20, 125: the audit's remedy names how to measure the reference, never a cell the run may not hold
    assert "--packcheck-attn packcheck_flash_ref" in audit and "reference cell" not in audit and "packcheck lookup" in audit


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
    with pytest.warns(PackcheckGuardWarning, match="mask_override") as caught:
        _trainer(bench, tmp_path / "warn", AllOnesMask(flat), callback).train()
    # the warning names the line that ran the loop, not torch's module.py that ran the hook (trial 3, U17)
    assert [Path(w.filename).name for w in caught if w.category is PackcheckGuardWarning] == [Path(__file__).name]


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
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    backend = "flash_attention_2" if backend_availability("flash_attention_2", "cuda").available else TORCH_VARLEN_BACKEND
    if not backend_availability(backend, "cuda").available:
        pytest.skip(f"no flash backend runs here: {backend_availability(backend, 'cuda').reason}")
    register_reference_backend()
    model = build_model(resolve_model(parse_model_spec("arch:llama", "test"), "test"), backend, "bfloat16", device="cuda")
    from pytest_packcheck.checks.workbench import Workbench

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


def test_bad_policy(llama_sdpa):
    with pytest.raises(PackcheckUsageError, match="on_mismatch='stop'"):
        PackcheckCallback(on_mismatch="stop")


def _cut(key, width=20):
    def plant(b):
        b[key] = (b[key] if key in b else torch.ones_like(b["input_ids"]))[:, :width]
    return plant


def _cu_ending(offsets, both=True):
    def plant(b):
        b["cu_seq_lens_q"] = torch.tensor([0, 11, 18, 31] if not both else offsets, dtype=torch.int32)
        b["cu_seq_lens_k"] = torch.tensor(offsets, dtype=torch.int32)
    return plant


@pytest.mark.parametrize(("plant", "message"), [
    (_cut("labels"), "batch['labels'] has shape (1, 20), input_ids (1, 31)"),
    (_cut("position_ids"), "batch['position_ids'] has shape (1, 20), input_ids (1, 31)"),
    (_cut("attention_mask"), "batch['attention_mask'] has shape (1, 20), input_ids (1, 31)"),
    (_cut("labels", 40), None),  # a slice past the end keeps (1, 31): nothing wrong
    (_cu_ending([0, 11, 18, 30]), "batch['cu_seq_lens_q'] [0, 11, 18, 30] (shape (4,)) end at 30, input_ids (1, 31)"),
    (_cu_ending([0, 11, 18, 40]), "batch['cu_seq_lens_q'] [0, 11, 18, 40] (shape (4,)) end at 40, input_ids (1, 31)"),
    (_cu_ending([0, 11, 18, 30], both=False), "batch['cu_seq_lens_k'] [0, 11, 18, 30] (shape (4,)) end at 30"),
    (_cu_ending([]), "batch['cu_seq_lens_q'] [] (shape (0,)) hold no offset, input_ids (1, 31)"),
], ids=["labels", "position_ids", "attention_mask", "labels_whole", "cu_short", "cu_long", "cu_k_short", "cu_empty"])
def test_a_per_token_key_off_the_rows_length_is_a_malformed_batch(llama_sdpa, plant, message):
    """Before: labels (1, 20) beside input_ids (1, 31) was a verdict "FAIL on 1 packed examples" (the row was never
    split, so the count was false) with no numbers, and cu_seq_lens_q/k ending off the row a contract item; both
    are a batch that does not describe one row: one usage line naming the key, both shapes and the fix."""
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    plant(batch)
    if message is None:
        assert verify_packed_batch(llama_sdpa.model, batch).verdict == "pass"
        return
    with pytest.raises(PackcheckUsageError) as info:
        verify_packed_batch(llama_sdpa.model, batch)
    said = str(info.value)
    assert said.startswith("verify_packed_batch: ") and message in said and "\n" not in said, said
    assert "malformed" in said and ("to the row's length" in said or "must end at the row length 31" in said), said


@functools.cache
def _llama_row():
    """A tiny llama (sdpa, use_cache=False as a Trainer sets it) and one packed row of three examples."""
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

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


# ------------------------------------------------------------------------------------------------------------
# Inside the trainers as they really run (TRL's default SFTConfig: bf16 autocast, fused LM head, gradient
# checkpointing; Trainer(bf16=True)): the tolerance row is how the forward computes


def _qwen2():
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    return build_model(resolve_model(parse_model_spec("arch:qwen2", "test"), "test"), "sdpa", "float32")


def _trl_default(model, out_dir, trainer_class=None, callbacks=None):
    """SFTTrainer with SFTConfig(packing=True, max_steps=3, use_cpu=True), every other setting TRL's default
    (bf16=True on CPU: accelerate's bf16 autocast around model.forward; the fused LM head)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from pytest_packcheck.checks.sft_setup import SENTENCES, offline_tokenizer

    args = SFTConfig(output_dir=str(out_dir), packing=True, max_steps=3, use_cpu=True, report_to=[], save_strategy="no")
    assert args.bf16 is True  # the default this test is about
    return (trainer_class or SFTTrainer)(model=model, args=args, callbacks=callbacks,
                                         train_dataset=Dataset.from_list([{"text": t} for t in SENTENCES]),
                                         processing_class=offline_tokenizer(int(model.config.vocab_size)))


def _with_inputs(trainer_class, **extra):
    """``trainer_class`` whose ``_prepare_inputs`` adds ``extra`` to every batch (an all-ones attention_mask,
    use_cache=True): a user's override, after the collator and device placement."""

    class Overridden(trainer_class):
        def _prepare_inputs(self, inputs):
            inputs = super()._prepare_inputs(inputs)
            for key, make in extra.items():
                inputs[key] = make(inputs)
            return inputs

    return Overridden


def test_trl_default_sftconfig_passes_a_correct_model(tmp_path):
    """Before: FAIL 4.89e-04 vs the float32 tolerance 1e-04 (cause kernel_numerics, remedy "none needed"): the
    fused head's forward hook never fires, the parameters said float32. After: the bf16 row, read from the
    autocast inside the forward."""
    pytest.importorskip("trl")
    callback = PackcheckCallback()
    trainer = _trl_default(_qwen2(), tmp_path, callbacks=[callback])
    trainer.train()
    result = callback.result
    assert result.verdict == "pass", result.line()
    assert result.dtype == "bfloat16" and result.dtype_source == "autocast bfloat16 over float32 weights"
    assert result.run["fused_lm_head"] and result.run["autocast"] == "bfloat16"
    assert result.max_logprob_diff <= result.tolerance["logits_atol"] == 5e-2
    assert trainer.state.global_step == 3


def test_trl_default_all_ones_mask_is_mask_override_with_both_numbers(tmp_path):
    """Before: "leak: do not pack this model" (the without-mask rerun, bf16, was judged by the float32 row)."""
    pytest.importorskip("trl")
    from trl import SFTTrainer

    trainer_class = _with_inputs(SFTTrainer, attention_mask=lambda b: torch.ones_like(b["input_ids"]))
    trainer = _trl_default(_qwen2(), tmp_path, trainer_class, callbacks=[PackcheckCallback()])
    with pytest.raises(PackedBatchMismatch) as info:
        trainer.train()
    result = info.value.result
    assert result.cause == "mask_override" and result.dtype == "bfloat16", result.line()
    without = result.probes["without_attention_mask"]
    assert without <= result.tolerance["logits_atol"] < result.max_logprob_diff
    assert f"with the attention_mask {result.max_logprob_diff:.2e}, without it {without:.2e}" in result.evidence
    assert trainer.state.global_step == 0


def _plain_trainer(bench, out_dir, callback, trainer_class=None, **args):
    from transformers import Trainer, TrainingArguments

    from pytest_packcheck.checks.training import TRAIN_RECIPE

    targs = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=3, max_steps=1, save_strategy="no",
                              report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
                              **{**TRAIN_RECIPE, **args})
    return (trainer_class or Trainer)(model=bench.model, args=targs, callbacks=[callback],
                                      train_dataset=[{"input_ids": e} for e in bench.examples],
                                      data_collator=bench.collator_factory(return_position_ids=True))


@pytest.mark.parametrize(("args", "row", "source"), [
    ({"bf16": True}, "bfloat16", "autocast bfloat16 over float32 weights"),
    ({"fp16": False}, "float32", "float32 weights, no autocast"),
], ids=["bf16=True", "fp16=False"])
def test_plain_trainer_gets_the_row_it_computes_in(tolerances, tmp_path, args, row, source):
    bench = make_bench("llama", "sdpa", tolerances)
    callback = PackcheckCallback()
    _plain_trainer(bench, tmp_path, callback, **args).train()
    assert callback.result.verdict == "pass", callback.result.line()
    assert (callback.result.dtype, callback.result.dtype_source) == (row, source)
    assert callback.result.tolerance == {k: tolerances[row][k] for k in ("logits_atol", "loss_atol")}


def test_plain_trainer_bf16_cache_kept_is_the_cache_trap(tolerances, tmp_path):
    from transformers import Trainer

    bench = make_bench("llama", "sdpa", tolerances)
    callback = PackcheckCallback(verbose=False)
    trainer = _plain_trainer(bench, tmp_path, callback, _with_inputs(Trainer, use_cache=lambda b: True), bf16=True)
    with pytest.raises(PackedBatchMismatch, match="cache_trap"):
        trainer.train()
    result = callback.result
    assert result.dtype == "bfloat16" and result.run["use_cache"] is True
    assert result.probes["use_cache_false"] <= result.tolerance["logits_atol"] < result.max_logprob_diff


def test_dtype_row_from_bf16_weights_and_from_the_lm_head(tolerances):
    """A model loaded in bf16 gets the bf16 row without autocast; float32 weights whose LM head outputs bf16 too."""
    bench = make_bench("llama", "sdpa", tolerances)
    model = bench.model.to(torch.bfloat16)
    model.config.use_cache = False
    result = verify_packed_batch(model, bench.packed())
    assert (result.dtype, result.dtype_source) == ("bfloat16", "bfloat16 weights"), result.line()
    assert result.verdict == "pass", result.line()
    model.float()
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: out.to(torch.float16))
    try:
        result = verify_packed_batch(model, bench.packed())
    finally:
        handle.remove()
    assert (result.dtype, result.dtype_source) == ("float16", "float32 weights, LM head output float16")


def test_guard_line_lands_on_its_own_line_under_a_progress_bar(capsys):
    """tqdm (the Trainer's ProgressCallback) draws on stderr: the line is written through tqdm.write."""
    from tqdm import tqdm

    from pytest_packcheck.guard import print_line

    bar = tqdm(total=3, file=sys.stderr, mininterval=0, ascii=True)
    bar.update(1)
    print_line("packcheck guard: PASS on 3 packed examples")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    lines = [chunk.split("\r")[-1] for chunk in err.split("\n")]
    assert "packcheck guard: PASS on 3 packed examples" in lines, repr(err)


# ------------------------------------------------------------------------------------------------------------
# The batch contract: each item fails the batch with its cause and remedy; the reference comes from the
# batch's own segmentation with true positions (never from the ids being checked)


def _restart_below_first(b):
    b["position_ids"] = b["position_ids"].clone()
    b["position_ids"][0, 11:18] -= 3  # restarts at -3: below the model's first position (0), never a continuation


def _no_reset(b):
    b["position_ids"] = torch.arange(b["input_ids"].shape[1])[None]


def _cu_disagree(b):
    b["cu_seq_lens_q"] = b["cu_seq_lens_k"] = torch.tensor([0, 11, 31], dtype=torch.int32)


def _labels_unmasked(b):
    b["labels"] = b["input_ids"].clone()


def _cu_empty(b):
    b["cu_seq_lens_q"] = b["cu_seq_lens_k"] = torch.tensor([0, 11, 11, 18, 31], dtype=torch.int32)


def _cu_k(b):
    b["cu_seq_lens_k"] = torch.tensor([0, 10, 18, 31], dtype=torch.int32)


def _max_length(b):
    b["max_length_q"] = 5


@pytest.mark.parametrize(("plant", "cause", "evidence", "remedy"), [
    (_restart_below_first, "wrong_positions", "position_ids restart at -3, below 0, at token 11", "restart position_ids at 0"),
    (_no_reset, "collator_contract", "position_ids restart at tokens [0], cu_seq_lens_q start examples at [0, 11, 18]",
     "from the same segmentation"),
    (_cu_disagree, "collator_contract", "cu_seq_lens_q start examples at [0, 11]", "from the same segmentation"),
    (_labels_unmasked, "collator_contract", "labels not -100 at 2 example starts (token indices [11, 18])",
     "-100 at each example's first token"),
    (_cu_empty, "empty_example", "hold a zero-length example", "drop empty examples"),
    (_cu_k, "collator_contract", "cu_seq_lens_k [0, 10, 18, 31] differ", "must equal cu_seq_lens_q"),
    (_max_length, "collator_contract", "max_length_q 5 is below the longest example (13 tokens)", "at least the longest"),
], ids=["restart", "no_reset", "cu_disagree", "labels", "cu_empty", "cu_k", "max_length"])
def test_contract_item_fails_the_batch(llama_sdpa, plant, cause, evidence, remedy):
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    plant(batch)
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "fail" and result.cause == cause, result.line()
    assert evidence in result.evidence and remedy in result.remedy, result.line()
    assert result.causes[0] == cause


def _seq_idx(batch, starts):
    """An int32 seq_idx (1, N) whose segments start at ``starts`` (DataCollatorWithFlattening(return_seq_idx=True)'s form)."""
    seq = torch.zeros_like(batch["input_ids"], dtype=torch.int32)
    for s in starts[1:]:
        seq[0, s:] += 1
    return seq


@pytest.mark.parametrize(("starts", "says"), [
    ([0], "position_ids restart at tokens [0, 11, 18], seq_idx starts segments at [0]"),
    ([0, 11, 18, 23], "position_ids restart at tokens [0, 11, 18], seq_idx starts segments at [0, 11, 18, 23]"),
], ids=["one_segment", "one_boundary_more"])
def test_seq_idx_disagreeing_with_position_ids_fails_the_batch(llama_sdpa, starts, says):
    """Before: a seq_idx of one segment beside three position_ids restarts passed with no word (one boundary more was
    blamed on the labels only); seq_idx is compared with the position_ids restarts as cu_seq_lens_q is."""
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed()
    batch["seq_idx"] = _seq_idx(batch, starts)
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert says in result.evidence and "return_seq_idx=True" in result.remedy, result.line()


def test_seq_idx_disagreeing_with_cu_seq_lens_fails_and_agreeing_passes(llama_sdpa):
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    batch["seq_idx"] = _seq_idx(batch, [0, 11, 18])
    assert verify_packed_batch(llama_sdpa.model, batch).verdict == "pass"
    del batch["position_ids"]
    batch["seq_idx"] = _seq_idx(batch, [0, 11])
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.cause == "collator_contract", result.line()
    assert "cu_seq_lens_q start examples at [0, 11, 18], seq_idx starts segments at [0, 11]" in result.evidence


@pytest.mark.parametrize(("offsets", "says"), [
    ([0, 18, 11, 31], "cu_seq_lens_q [0, 18, 11, 31] decrease at index 2 (18 > 11)"),
    ([5, 11, 18, 31], "cu_seq_lens_q [5, 11, 18, 31] start at 5, not 0"),
], ids=["decreasing", "late_start"])
def test_malformed_cu_seq_lens_alone_names_what_is_wrong(llama_sdpa, offsets, says):
    """Before: "one example in the row: nothing to compare; cu_seq_lens_q [...] do not run non-decreasing ..." for a
    row whose only segmentation is cu_seq_lens_q declaring three examples; the evidence names the broken offset."""
    llama_sdpa.model.config.use_cache = False
    batch = {"input_ids": llama_sdpa.packed()["input_ids"], "cu_seq_lens_q": torch.tensor(offsets, dtype=torch.int32)}
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert result.evidence == says and "one example" not in result.line(), result.line()


@pytest.mark.parametrize("plant", [_no_reset], ids=["no_reset"])
def test_contract_reference_uses_true_positions(tolerances, plant):
    """gpt2 (learned absolute positions) on the varlen reference, whose attention cu_seq_lens_q keep isolated:
    position_ids that never restart. The reference runs each example from position 0 (its slice of the row's ids
    would agree with the packed row and hide the fault), so the number shows it. (A restart above 0 is a continuation
    chunk, run alone at its own positions: test_a_continuation_chunk_is_judged_by_what_the_model_computes.)"""
    from pytest_packcheck.backends import REFERENCE_BACKEND

    bench = make_bench("gpt2", REFERENCE_BACKEND, tolerances)
    bench.model.config.use_cache = False
    batch = bench.packed(flash_kwargs=True)
    plant(batch)
    result = verify_packed_batch(bench.model, batch)
    assert result.lengths == [11, 7, 13] and result.max_logprob_diff > result.tolerance["logits_atol"], result.line()


def test_one_example_row_counts_its_scored_labels(llama_sdpa):
    """position_ids arange(31) (no restart) with labels: skipped "one example", but label_tokens was 0 though the
    row scores 30 labels."""
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed()
    batch["position_ids"] = torch.arange(31)[None]
    batch["labels"] = batch["input_ids"].clone()
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "skipped" and "one example" in result.evidence and result.label_tokens == 30


def test_unmasked_labels_show_in_the_trainer_loss(llama_sdpa):
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed()
    _labels_unmasked(batch)
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.probes["trainer_label_tokens"] == result.label_tokens + 2
    assert result.loss_delta > result.tolerance["loss_atol"], result.line()


@pytest.mark.parametrize("head", ["LlamaModel", "LlamaForSequenceClassification"])
def test_a_model_without_lm_head_is_a_usage_error(llama_sdpa, head):
    """Before: FAIL crash (AttributeError: no attribute 'logits' / an IndexError on the mask), a packing FAIL under
    PackcheckCallback's on_mismatch="raise"; a model that returns no logits over the vocabulary is refused up front."""
    from types import SimpleNamespace

    import transformers

    model = getattr(transformers, head)(llama_sdpa.config)
    with pytest.raises(PackcheckUsageError, match=f"model is a {head}, which has no LM head .*pass that model") as info:
        verify_packed_batch(model.eval(), llama_sdpa.packed())
    assert "\n" not in str(info.value)
    callback = PackcheckCallback()
    callback.on_train_begin(SimpleNamespace(output_dir=None), SimpleNamespace(), None, model=model.train())
    with pytest.raises(PackcheckUsageError, match="no LM head"):
        model(**llama_sdpa.packed())


def test_inputs_embeds_beside_input_ids_is_a_usage_error(llama_sdpa):
    """`{**good, "inputs_embeds": torch.zeros(1, 31, 32)}` returned fail / crash ("You must specify exactly one of
    input_ids or inputs_embeds"): the contradictory keys are refused, named, in one line."""
    llama_sdpa.model.config.use_cache = False
    batch = {**llama_sdpa.packed(), "inputs_embeds": torch.zeros(1, 31, 32)}
    with pytest.raises(PackcheckUsageError, match=r"batch has both 'input_ids' and 'inputs_embeds'.*drop 'inputs_embeds'") as info:
        verify_packed_batch(llama_sdpa.model.eval(), batch)
    assert "\n" not in str(info.value)


def test_a_masked_lm_is_judged_on_its_logits_and_a_pooled_head_is_refused(llama_sdpa):
    """BertForMaskedLM attends both ways: it was refused as "not a causal LM"; it is now judged on what it outputs
    (issue 46 part 4), on the same batch the causal LM passes. A sequence-classification head (one pooled row per
    packed row) is still refused, naming the class."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, DataCollatorWithFlattening

    feats = [{"input_ids": list(range(1, 12))}, {"input_ids": list(range(20, 27))}, {"input_ids": list(range(40, 53))}]
    batch = DataCollatorWithFlattening()(feats)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    result = verify_packed_batch(BertForMaskedLM(config).eval(), batch)
    assert result.verdict == "pass" and result.compared == "logit", result.line()
    assert "worst logit diff" in result.line() and result.max_logprob_diff <= result.tolerance["logits_atol"]
    with pytest.raises(PackcheckUsageError, match=r"model is a BertForSequenceClassification, which has no LM head") as info:
        verify_packed_batch(BertForSequenceClassification(config).eval(), batch)
    assert "\n" not in str(info.value)
    llama_sdpa.model.config.use_cache = False
    assert verify_packed_batch(llama_sdpa.model.eval(), batch).verdict == "pass"


def test_causal_lms_under_any_name_or_wrapper_are_accepted(llama_sdpa):
    """The other side of the LM-head check: a subclass not named ...ForCausalLM keeps its lm_head, and a wrapper
    that delegates attributes (PEFT's PeftModel does, through __getattr__) shows its inner model's head."""
    llama_sdpa.model.config.use_cache = False

    class ChatModel(type(llama_sdpa.model)):
        pass

    renamed = ChatModel(llama_sdpa.config)
    renamed.load_state_dict(llama_sdpa.model.state_dict())
    renamed.config.use_cache = False

    class Delegating(torch.nn.Module):  # PeftModel's shape: forward and attributes go to the wrapped model
        def __init__(self, inner):
            super().__init__()
            self.base_model = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.base_model, name)

        def forward(self, *args, **kwargs):
            return self.base_model(*args, **kwargs)

    for model in (renamed.eval(), Delegating(llama_sdpa.model).eval()):
        assert model.get_output_embeddings() is not None
        result = verify_packed_batch(model, llama_sdpa.packed())
        assert result.verdict == "pass", result.line()


def test_int64_cu_seq_lens_is_a_verdict(llama_sdpa):
    """int64 cu_seq_lens_q: a note where the backend takes it (sdpa ignores it); a contract failure with the
    kernel's own error where it refuses it (flash-attn 2.x raises), never an exception out of the guard."""
    from faults import _Wrapper

    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_q"].long()
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "pass" and "cu_seq_lens_q dtype torch.int64" in result.line()

    class RefusesInt64(_Wrapper):
        def forward(self, **kwargs):
            cu = kwargs.get("cu_seq_lens_q")
            if cu is not None and cu.dtype != torch.int32:
                raise ValueError("cu_seqlens_q must have dtype int32")
            return self.inner(**kwargs)

    result = verify_packed_batch(RefusesInt64(llama_sdpa.model), batch)
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert "ValueError: cu_seqlens_q must have dtype int32" in result.evidence and "torch.int32" in result.remedy


# ------------------------------------------------------------------------------------------------------------
# Causes the audit knows, each planted


def test_cause_backend_swap(llama_sdpa):
    from faults import SilentSwap

    llama_sdpa.model.config.use_cache = False
    result = verify_packed_batch(SilentSwap(llama_sdpa.model), llama_sdpa.packed())
    assert result.verdict == "fallback" and result.cause == "backend_swap" and result.attention["calls"] == {"eager": 2}


def test_cause_ignores_position_ids(llama_sdpa):
    from faults import DropPositionIds

    llama_sdpa.model.config.use_cache = False
    result = verify_packed_batch(DropPositionIds(llama_sdpa.model), llama_sdpa.packed())
    assert result.cause == "ignores_position_ids", result.line()


def test_cause_leak_is_measured_by_the_isolation_probe(tolerances):
    bench = make_bench("opt", "sdpa", tolerances)
    bench.model.config.use_cache = False
    result = verify_packed_batch(bench.model, bench.packed())
    assert result.cause == "leak" and result.probes["isolation_moved"] > result.tolerance["logits_atol"], result.line()


def test_cause_leak_where_the_counted_boundaries_reach_a_kernel_that_ignores_them(llama_sdpa):
    """sdpa handed the packed mask but attending across it: the counter sees the boundaries reach every call, the
    isolation probe (change the first example) sees the others move."""
    from faults import leaky_sdpa

    llama_sdpa.model.config.use_cache = False
    with leaky_sdpa():
        result = verify_packed_batch(llama_sdpa.model, llama_sdpa.packed())
    assert result.attention["boundaries_missing"] == 0 and result.attention["boundaries_reached"] == 2
    assert result.cause == "leak" and result.probes["isolation_moved"] > result.tolerance["logits_atol"], result.line()


def test_fused_lm_head_runs_without_the_cache(tolerances):
    """TRL's fused forward sets use_cache=False itself (trl 1.16 add_fused_lm_head): no cache trap to report."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    bench = make_bench("llama", "sdpa", tolerances)
    assert bench.model.config.use_cache is True
    add_fused_lm_head(bench.model)
    result = verify_packed_batch(bench.model, {**bench.packed(), "fused_lm_head": True})
    assert result.run["fused_lm_head"] and result.run["use_cache"] is False
    assert result.verdict == "pass", result.line()


def test_leak_without_position_ids_on_sdpa_names_the_missing_key(llama_sdpa):
    """cu_seq_lens_q without position_ids on sdpa: the packed mask is built from position_ids, so the examples leak;
    the remedy is the collator's position_ids, not "do not pack this model"."""
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    batch.pop("position_ids")
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.cause == "leak" and result.remedy.startswith("return position_ids from the collator"), result.line()


def test_an_empty_example_beside_a_leak_names_both_with_their_numbers(llama_sdpa):
    """cu_seq_lens_q with a zero-length example and no position_ids on sdpa: before, only empty_example ("drop empty
    examples") was named while the 1.4e-01 log-prob diff was sdpa's leak of a cu-only row; following the remedy left
    the mismatch. Now both causes, each with its number and remedy; with position_ids the empty example stands alone."""
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed(flash_kwargs=True)
    batch.pop("position_ids")
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 11, 11, 18, 31], dtype=torch.int32)
    result = verify_packed_batch(llama_sdpa.model, batch)
    line = result.line()
    assert result.verdict == "fail" and result.causes == ["empty_example", "leak"], line
    assert result.max_logprob_diff > 1e-2 and [a["cause"] for a in result.also] == ["leak"], line
    leak = result.also[0]
    assert f"differ by {result.max_logprob_diff:.2e}" in leak["evidence"] and "moves the others by" in leak["evidence"], line
    assert leak["remedy"].startswith("return position_ids from the collator"), line
    assert "remedy: drop empty examples" in line and "; and cause leak: packed vs solo log-probs differ by" in line, line
    assert "\n" not in line
    batch = llama_sdpa.packed(flash_kwargs=True)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 11, 11, 18, 31], dtype=torch.int32)
    alone = verify_packed_batch(llama_sdpa.model, batch)
    assert alone.causes == ["empty_example"] and not alone.also, alone.line()
    assert alone.max_logprob_diff <= alone.tolerance["logits_atol"], alone.line()


def test_cause_wrong_positions_not_leak(tolerances):
    """Tiny gpt2 on the varlen reference fed cu_seq_lens_q/k without position_ids: attention isolated, learned
    absolute positions wrong."""
    from pytest_packcheck.backends import REFERENCE_BACKEND

    bench = make_bench("gpt2", REFERENCE_BACKEND, tolerances)
    bench.model.config.use_cache = False
    batch = bench.packed(flash_kwargs=True)
    batch.pop("position_ids")
    result = verify_packed_batch(bench.model, batch)
    assert result.cause == "wrong_positions", result.line()
    assert result.probes["isolation_moved"] <= result.tolerance["logits_atol"] < result.max_logprob_diff
    assert "return position_ids" in result.remedy


def test_cause_position_layout_for_mrope_fed_flat_ids(tolerances):
    from test_vlm import _bench

    bench = _bench("arch:qwen2_vl", "sdpa", tolerances)
    bench.model.config.use_cache = False
    batch = bench.packed()
    assert batch["position_ids"].ndim == 2
    result = verify_packed_batch(bench.model, batch)
    assert result.cause == "position_layout", result.line()
    assert result.probes["laid_out_position_ids"] <= result.tolerance["logits_atol"] < result.max_logprob_diff


# ------------------------------------------------------------------------------------------------------------
# The numerics band: within NUMERICS_FACTOR x the row's tolerance, boundaries kept


def _band(diff: float) -> dict:
    return {"logits_atol": diff / 3, "loss_atol": 1.0}


def test_numerics_band_bf16_autocast_passes_with_a_float32_note(llama_sdpa):
    llama_sdpa.model.config.use_cache = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = verify_packed_batch(llama_sdpa.model, llama_sdpa.packed())
        result = verify_packed_batch(llama_sdpa.model, llama_sdpa.packed(),
                                     tolerances={"bfloat16": _band(first.max_logprob_diff)}, on_mismatch="raise")
    assert result.verdict == "pass" and result.cause is None, result.line()
    assert result.probes["float32"] <= 1e-4 and "in float32 the same row agrees" in result.line()


def test_numerics_band_bf16_weights_fails_with_a_real_remedy(llama_sdpa):
    model = llama_sdpa.model.to(torch.bfloat16)
    model.config.use_cache = False
    try:
        first = verify_packed_batch(model, llama_sdpa.packed())
        assert first.max_logprob_diff > 0, first.line()
        result = verify_packed_batch(model, llama_sdpa.packed(), tolerances={"bfloat16": _band(first.max_logprob_diff)})
    finally:
        model.float()
    assert result.verdict == "fail" and result.cause == "kernel_numerics", result.line()
    assert "none needed" not in result.remedy and "float32 copy" in result.remedy


@contextlib.contextmanager
def _one_ulp_on_the_packed_row(model, total):
    """Planted rounding noise: the packed row's logits (length ``total``) one ulp up, the solo runs as they are; a
    float32 packed-vs-solo difference that does not depend on the machine's kernels (some give exactly 0)."""
    def one_ulp(module, args, out):
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if out.shape[1] == total else out

    handle = model.lm_head.register_forward_hook(one_ulp)
    try:
        yield
    finally:
        handle.remove()


def test_numerics_band_float32_fails_with_a_real_remedy(llama_sdpa):
    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed()
    with _one_ulp_on_the_packed_row(llama_sdpa.model, batch["input_ids"].shape[1]):
        first = verify_packed_batch(llama_sdpa.model, batch)
        assert first.max_logprob_diff > 0, first.line()
        result = verify_packed_batch(llama_sdpa.model, batch, tolerances={"float32": _band(first.max_logprob_diff)})
    assert result.verdict == "fail" and result.cause == "kernel_numerics", result.line()
    assert "widen logits_atol" in result.remedy and "none needed" not in result.remedy


def test_rounding_noise_under_a_zero_tolerance_is_numerics_not_positions(llama_sdpa):
    """Before: tolerance 0 on a correct float32 row gave FAIL wrong_positions ("differ by 4.77e-07 ... moves the
    others by 0.00e+00") with a position_ids remedy; a few ulps are kernel_numerics (the audit's rule, within_numerics)."""
    model, batch = llama_sdpa.model, llama_sdpa.packed()
    model.config.use_cache = False
    with _one_ulp_on_the_packed_row(model, batch["input_ids"].shape[1]):
        result = verify_packed_batch(model, batch, tolerances={"float32": {"logits_atol": 0.0, "loss_atol": 0.0}})
    assert 0 < result.max_logprob_diff < 1e-5 and result.probes["isolation_moved"] == 0.0, result.line()
    assert result.verdict == "fail" and result.cause == "kernel_numerics", result.line()
    assert "position_ids" not in result.remedy and "widen logits_atol" in result.remedy
    assert "float32 rounding" in result.evidence


def test_cache_trap_at_zero_tolerance_is_the_cache_not_a_leak(tolerances):
    """Trial g22: under logits_atol 0 the use_cache=False rerun, a few ulps off (planted one ulp), was judged against
    the raw 0 and the fixable cache trap came out as leak ("do not pack"); the rerun is judged by the audit's rule
    (registry.fixed_by: within numerics while the row as run is not)."""
    bench = make_bench("llama", "sdpa", tolerances)
    assert bench.model.config.use_cache is True
    batch = bench.packed()
    with _one_ulp_on_the_packed_row(bench.model, batch["input_ids"].shape[1]):
        result = verify_packed_batch(bench.model, batch, tolerances={"float32": {"logits_atol": 0.0, "loss_atol": 0.0}})
    assert result.verdict == "fail" and result.cause == "cache_trap", result.line()
    assert result.max_logprob_diff > 1e-2 and 0 < result.probes["use_cache_false"] < 1e-5, result.line()
    assert "use_cache=False" in result.remedy and "do not pack" not in result.remedy


def test_numerics_rule_has_a_rounding_floor():
    from pytest_packcheck.checks.registry import NUMERICS_FACTOR, rounding_level, within_numerics

    assert within_numerics(4.77e-7, 0.0, "float32", scale=4.85)  # one ulp at |log-prob| 4.85
    assert not within_numerics(1e-3, 0.0, "float32", scale=4.85)
    assert within_numerics(NUMERICS_FACTOR * 1e-4, 1e-4) and not within_numerics(NUMERICS_FACTOR * 1.1e-4, 1e-4)
    assert rounding_level("bfloat16") == 2.0 ** -7 and not within_numerics(float("nan"), 1.0)


def test_fixed_by_names_the_suspect_only_when_the_row_is_beyond_numerics():
    from pytest_packcheck.checks.registry import fixed_by

    assert fixed_by(4.77e-7, 1.31e-1, 0.0)  # rerun at rounding, row far beyond: the suspect's
    assert not fixed_by(4.77e-7, 8.9e-8, 0.0)  # both at rounding: numerics, not the suspect
    assert not fixed_by(1e-3, 1.31e-1, 0.0) and fixed_by(1e-5, 1e-1, 1e-5)
    assert not fixed_by(float("nan"), 1.0, 0.0)


# ------------------------------------------------------------------------------------------------------------
# Issue 28's guard items: nothing judged is not a pass, a non-finite number never passes, 0.0 never fails


def test_all_labels_ignored_is_nothing_judged(llama_sdpa):
    batch = llama_sdpa.packed()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    result = verify_packed_batch(llama_sdpa.model, batch)
    assert result.verdict == "skipped" and result.forwards == 0
    assert "nothing judged" in result.line() and "PASS" not in result.line()


def test_nan_weights_never_pass(tolerances):
    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False
    with torch.no_grad():
        bench.model.get_output_embeddings().weight[0, 0] = float("nan")
    result = verify_packed_batch(bench.model, bench.packed())
    assert result.verdict == "fail" and result.cause == "non_finite", result.line()
    assert "non-finite log-probs in the packed row and the examples alone" in result.evidence


def test_zero_difference_never_fails_at_zero_tolerance(llama_sdpa):
    from faults import UnigramLM

    model = UnigramLM(llama_sdpa.model.config)
    result = verify_packed_batch(model, llama_sdpa.packed(), tolerances={"float32": {"logits_atol": 0.0, "loss_atol": 0.0}})
    assert (result.max_logprob_diff, result.loss_delta) == (0.0, 0.0)
    assert result.verdict == "pass", result.line()


def test_warn_on_a_trainer_that_does_not_pack_goes_on(tolerances, tmp_path):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from pytest_packcheck.checks.sft_setup import offline_tokenizer
    from pytest_packcheck.checks.training import TRAIN_RECIPE

    bench = make_bench("llama", "sdpa", tolerances)
    tok = offline_tokenizer(int(bench.config.vocab_size))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False, **TRAIN_RECIPE)
    data = [{"input_ids": e} for e in bench.examples]
    for policy in ("warn", "raise"):
        callback = PackcheckCallback(on_mismatch=policy)
        trainer = Trainer(model=bench.model, args=args, train_dataset=data, callbacks=[callback],
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
        from pytest_packcheck.guard import PackcheckGuardWarning

        with pytest.warns(PackcheckGuardWarning, match="not packed: nothing to check"):
            trainer.train()
        assert callback.result.verdict == "skipped" and trainer.state.global_step == 1, policy
        assert (callback.result.dtype, callback.result.dtype_source) == ("float32", "float32 weights")
    # bf16 autocast on (SFTConfig's default): the compute dtype is named as the packed path names it (trial 4, 148:
    # "float32 weights" while the trainer ran under bf16 autocast)
    bf16 = TrainingArguments(**{**args.to_dict(), "bf16": True, "output_dir": str(tmp_path / "bf16")})
    callback = PackcheckCallback(on_mismatch="warn")
    trainer = Trainer(model=bench.model, args=bf16, train_dataset=data, callbacks=[callback],
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    with pytest.warns(PackcheckGuardWarning, match="not packed: nothing to check"):
        trainer.train()
    assert callback.result.dtype == "bfloat16"
    assert callback.result.dtype_source == "autocast bfloat16 over float32 weights (the trainer's bf16=True)"


def _first_forward_on_a_padded_batch(model, policy: str, action: str):
    """A fresh callback's first forward on a padded (3, 13) batch, under ``warnings.simplefilter(action)``:
    (the callback, the warnings recorded). The batch must reach the model unchanged (None from the hook)."""
    import warnings

    ids = torch.randint(3, 200, (3, 13))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    callback = PackcheckCallback(on_mismatch=policy)
    model.train()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter(action)
            assert callback._first_forward(model, (), batch) is None
    finally:
        model.eval()
    return callback, caught


@pytest.mark.parametrize("policy", ["raise", "warn", "disable"])
def test_callback_on_a_padded_batch_says_not_packed_once(llama_sdpa, monkeypatch, policy):
    """Issue 28: on a padded (not packed) first batch the callback's line said "SKIPPED ... on 3 packed examples"
    and came twice (printed, then warned). It says "not packed: nothing to check", once, and training goes on."""

    from pytest_packcheck.guard import PackcheckGuardWarning
    from pytest_packcheck.guard import callback as callback_module

    printed: list[str] = []
    monkeypatch.setattr(callback_module, "print_line", printed.append)
    callback, caught = _first_forward_on_a_padded_batch(llama_sdpa.model, policy, "always")
    said = printed + [str(w.message) for w in caught if issubclass(w.category, PackcheckGuardWarning)]
    assert len(said) == 1, said
    assert said[0].startswith("packcheck guard: not packed: nothing to check") and "packed examples" not in said[0]
    assert said[0].endswith("training goes on unchanged") and "(3, 13)" in said[0]
    assert callback.result.verdict == "skipped" and callback.result.lengths == [] and callback.fallback is None



@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_blanket_ignore_filter_does_not_hide_the_guards_not_packed_line(llama_sdpa, capsys, policy):
    """Trial 5 #118 / #121: a training script's own warnings.simplefilter("ignore") silenced the guard's "not
    packed: nothing to check" line (said by its PackcheckGuardWarning alone): the user was told nothing. Where a
    blanket filter would hide it the line is printed on stderr (the guard's verdict channel), once."""
    callback, caught = _first_forward_on_a_padded_batch(llama_sdpa.model, policy, "ignore")  # the script's own filter
    err = capsys.readouterr().err
    assert caught == [] and err.count("packcheck guard: not packed: nothing to check") == 1, err
    assert callback.result.verdict == "skipped"


def test_the_guards_warning_follows_a_filter_that_names_it_and_is_printed_past_a_blanket_one(capsys):
    """The channel of every guard line that warns (the callback's, verify_packed_batch(on_mismatch="warn")'s):
    a filter naming PackcheckGuardWarning or its text is the user's say on it; a blanket "ignore" is not."""
    import warnings

    from pytest_packcheck.guard import PackcheckGuardWarning
    from pytest_packcheck.guard.result import say

    line = "packcheck guard: FAIL (leak) on 3 packed examples"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        say(line)
    assert caught == [] and capsys.readouterr().err == line + "\n"
    for named in ({"category": PackcheckGuardWarning}, {"message": "packcheck guard"}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.filterwarnings("ignore", **named)
            say(line)
        assert caught == [] and capsys.readouterr().err == "", named
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        say(line)
    assert [str(w.message) for w in caught] == [line] and capsys.readouterr().err == ""
    assert Path(caught[0].filename).name == Path(__file__).name  # attributed to the caller's line

def test_callback_on_trls_wrapped_packing_says_it_packs_without_boundaries(llama_sdpa):
    """Trial 4, 151: SFTConfig(packing=True, packing_strategy="wrapped") feeds rows cut from one stream (an all-ones
    mask, no position_ids): the guard said "not packed: nothing to check" though the user packs. It says the rows
    are packed by wrapping, with no boundaries by design, and which TRL options keep examples apart."""
    import warnings
    from types import SimpleNamespace

    ids = torch.randint(3, 200, (2, 13))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    model, callback = llama_sdpa.model, PackcheckCallback(on_mismatch="warn", verbose=False)
    args = SimpleNamespace(output_dir=None, packing=True, packing_strategy="wrapped", padding_free=False)
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True), None, model=model)
    callback._remove()
    model.train()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            callback._first_forward(model, (), batch)
    finally:
        model.eval()
    assert callback.result.evidence.startswith("packed by wrapping (no boundaries: examples attend to each other by design; "
                                               "packing_strategy='bfd' or padding_free=True keeps them apart)")
    assert "not packed" not in callback.result.evidence


def test_callback_verbose_must_be_a_bool():
    with pytest.raises(PackcheckUsageError, match="verbose='no': expected True or False"):
        PackcheckCallback(verbose="no")


def _row(llama_sdpa, **change):
    batch = llama_sdpa.packed()
    batch.update(change)
    return batch


@pytest.mark.parametrize(("make", "message"), [
    (lambda b: _row(b, input_ids=torch.zeros(1, 0, dtype=torch.long), position_ids=torch.zeros(1, 0, dtype=torch.long),
                    labels=torch.zeros(1, 0, dtype=torch.long)), "has shape (1, 0): an empty row"),
    (lambda b: _row(b, input_ids=b.packed()["input_ids"].float()), "has dtype torch.float32: token ids are integers"),
    (lambda b: _row(b, input_ids=torch.full((1, 31), -100)), "holds token id -100, outside the model's vocabulary"),
    (lambda b: _row(b, labels=b.packed()["labels"].float()), "batch['labels'] has dtype torch.float32"),
    (lambda b: _row(b, labels=torch.where(b.packed()["labels"] == -100, -1, b.packed()["labels"])),
     "batch['labels'] holds -1, neither -100 (not scored) nor a token id"),
    (lambda b: _row(b, position_ids=list(range(31))), "batch['position_ids'] is a list, expected a tensor"),
    (lambda b: _row(b, position_ids=torch.arange(31)), "batch['position_ids'] has shape (31,), expected (1, 31)"),
    (lambda b: _row(b, cu_seq_lens_q=torch.tensor([0.0, 11.0, 18.0, 31.0])), "batch['cu_seq_lens_q'] is (4,) torch.float32"),
    (lambda b: _row(b, cu_seq_lens_q=[0, 11, 18, 31]), "batch['cu_seq_lens_q'] is a list"),
    (lambda b: _row(b, use_cache="no"), "batch['use_cache'] is 'no': expected True, False or no key"),
    (lambda b: _row(b, fused_lm_head=True), "batch['fused_lm_head'] is True but LlamaForCausalLM has no fused LM head"),
    # issue 28's second trial: labels on another device raised from torch (the label check ran before the device
    # check); every malformed field a collator can hand over is one line
    (lambda b: _row(b, labels=b.packed()["labels"].to("meta")), "batch['labels'] is on the meta device"),
    (lambda b: _row(b, **{k: v.to("meta") for k, v in b.packed().items()}), "batch['input_ids'] is on the meta device"),
    (lambda b: _row(b, max_length_q="13"), "batch['max_length_q'] is '13': expected a whole number >= 0"),
    (lambda b: _row(b, max_length_k=13.0), "batch['max_length_k'] is 13.0: expected a whole number"),
    (lambda b: _row(b, max_length_q=torch.tensor([13, 13])), "batch['max_length_q'] is a (2,) torch.int64 tensor"),
    (lambda b: _row(b, max_length_q=True), "batch['max_length_q'] is True"),
    (lambda b: _row(b, num_items_in_batch="9"), "batch['num_items_in_batch'] is '9'"),
    (lambda b: _row(b, num_items_in_batch=-1), "batch['num_items_in_batch'] is -1"),
    (lambda b: _row(b, num_items_in_batch=torch.tensor(2.5)), "batch['num_items_in_batch'] is a () torch.float32 tensor"),
    (lambda b: _row(b, labels=b.packed()["labels"] > 0), "batch['labels'] has dtype torch.bool: labels are integers"),
    (lambda b: _row(b, labels=b.packed()["labels"].to(torch.complex64)), "batch['labels'] has dtype torch.complex64"),
    (lambda b: _row(b, position_ids=b.packed()["position_ids"] > 0), "batch['position_ids'] has dtype torch.bool"),
    (lambda b: _row(b, input_ids=b.packed()["input_ids"].to(torch.uint8)), "batch['input_ids'] has dtype torch.uint8"),
    (lambda b: _row(b, position_ids=b.packed()["position_ids"].to_sparse()), "batch['position_ids'] is a torch.sparse_coo tensor"),
    (lambda b: _row(b, input_ids=tuple(b.packed()["input_ids"][0].tolist())), "batch['input_ids'] is tuple, expected a tensor"),
    (lambda b: _row(b, labels=tuple(b.packed()["labels"][0].tolist())), "batch['labels'] is a tuple, expected a tensor"),
    (lambda b: {**b.packed(), 0: 1}, "batch has the key 0 (int)"),
    # a (1, 1, 31) position_ids on a model without M-RoPE crashed inside the model (verdict fail, cause crash)
    (lambda b: _row(b, position_ids=b.packed()["position_ids"][None]),
     ("batch['position_ids'] has shape (1, 1, 31), expected (1, 31) (batch, length) like input_ids: a llama model reads no "
     "multi-row M-RoPE position_ids")),
], ids=["empty_row", "float_ids", "id_out_of_vocab", "float_labels", "labels_minus_one", "list_positions", "1d_positions", "float_cu", "list_cu",
        "string_use_cache", "fused_without_head", "meta_labels", "meta_batch", "string_max_length", "float_max_length",
        "1d_max_length", "bool_max_length", "string_num_items", "negative_num_items", "fractional_num_items", "bool_labels", "complex_labels",
        "bool_positions", "uint8_ids", "sparse_positions", "tuple_ids", "tuple_labels", "int_key", "3d_positions_without_mrope"])
def test_malformed_batch_is_one_clear_line(llama_sdpa, make, message):
    with pytest.raises(PackcheckUsageError) as info:
        verify_packed_batch(llama_sdpa.model, make(llama_sdpa))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_batch_on_another_device_than_the_model_is_one_clear_line(tolerances, monkeypatch):
    """A model whose embeddings are on another device than the batch (a second device stood in by the model's device
    reading cuda:1: none on a CPU machine): refused before any value is read, naming both devices. A model on the meta
    device (no weights) is refused as such: moving the batch to meta, as the line said before, cannot run either
    (hostile trial 5)."""
    import pytest_packcheck.guard.verify as verify_module

    bench = make_bench("llama", "sdpa", tolerances)
    batch = bench.packed()
    with monkeypatch.context() as patch:
        patch.setattr(verify_module, "model_device", lambda model: torch.device("cuda", 1))
        with pytest.raises(PackcheckUsageError) as info:
            verify_packed_batch(bench.model, batch)
    assert "batch['input_ids'] is on cpu, the model's embeddings on cuda:1" in str(info.value) and "\n" not in str(info.value)
    bench.model.to("meta")
    with pytest.raises(PackcheckUsageError, match="the model's weights are on the meta device .*load them first"):
        verify_packed_batch(bench.model, batch)


def test_good_scalars_still_pass(llama_sdpa):
    """The scalars a collator and a Trainer really hand over (an int, a 0-d integer tensor, transformers 5.24's
    float32 count of label tokens) are taken as before."""
    for count in (torch.tensor(28), torch.tensor(28.0), 28):
        row = _row(llama_sdpa, max_length_q=13, max_length_k=torch.tensor(13), num_items_in_batch=count)
        assert verify_packed_batch(llama_sdpa.model, row, use_cache=False).verdict == "pass"


def test_num_items_in_batch_below_the_rows_own_count_fails(llama_sdpa, monkeypatch):
    """Before: num_items_in_batch 5 beside a row of 28 scored label tokens passed with no word. Below the row's own
    count it is a collator_contract failure naming both numbers; above it (gradient accumulation's whole-step count)
    nothing is said; where the Trainer may divide it (DataParallel, tensor / context parallel) it is a note."""
    from pytest_packcheck.guard import batch as guard_batch

    llama_sdpa.model.config.use_cache = False
    batch = llama_sdpa.packed()
    assert int((batch["labels"][:, 1:] != -100).sum()) == 28
    result = verify_packed_batch(llama_sdpa.model, {**batch, "num_items_in_batch": 5})
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert "num_items_in_batch 5 is below this row's own 28 scored label tokens" in result.evidence
    assert "labels[..., 1:] != -100" in result.remedy
    for count in (28, torch.tensor(112.0), 500):  # the accumulation step's count: this row and others
        larger = verify_packed_batch(llama_sdpa.model, {**batch, "num_items_in_batch": count})
        assert larger.verdict == "pass" and not any("num_items" in n for n in larger.notes), larger.line()
    monkeypatch.setattr(guard_batch, "_count_may_be_divided", lambda: True)
    divided = verify_packed_batch(llama_sdpa.model, {**batch, "num_items_in_batch": 14})
    assert divided.verdict == "pass", divided.line()
    assert any("num_items_in_batch 14 is below this row's own 28" in n and "tp * cp * sp" in n for n in divided.notes)


@pytest.mark.parametrize(("bad", "message"), [
    ({"float32": {"logits_atol": 1e-4}}, "tolerances['float32'] has no 'loss_atol' (given: 'logits_atol')"),
    ({"float32": {"logits_atol": "1e-4", "loss_atol": 1e-5}}, "tolerances['float32']['logits_atol'] = '1e-4'"),
    ({"float32": {"logits_atol": -1e-4, "loss_atol": 1e-5}}, "tolerances['float32']['logits_atol'] = -0.0001"),
    ({"float32": {"logits_atol": float("nan"), "loss_atol": 1e-5}}, "tolerances['float32']['logits_atol'] = nan"),
    ({"fp32": {"logits_atol": 1e-4, "loss_atol": 1e-5}}, "unknown dtype row 'fp32'"),
    ({"float32": 1e-4}, "tolerances['float32'] is a float (0.0001)"),
    ("1e-4", "tolerances is a str ('1e-4')"),
], ids=["one_key_of_two", "string", "negative", "nan", "unknown_dtype", "row_not_dict", "not_dict"])
def test_bad_tolerances_are_one_clear_line(llama_sdpa, bad, message):
    for call in (lambda: verify_packed_batch(llama_sdpa.model, llama_sdpa.packed(), tolerances=bad),
                 lambda: PackcheckCallback(tolerances=bad)):
        with pytest.raises(PackcheckUsageError) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"use_cache": "yes"}, "use_cache='yes'"), ({"padded_probe": 1}, "padded_probe=1"), ({"training": 0}, "training=0"),
])
def test_bad_arguments_are_one_clear_line(llama_sdpa, kwargs, message):
    with pytest.raises(PackcheckUsageError, match=message.replace("(", r"\(")):
        verify_packed_batch(llama_sdpa.model, llama_sdpa.packed(), **kwargs)
    with pytest.raises(PackcheckUsageError, match="model is a dict without a config"):
        verify_packed_batch({}, llama_sdpa.packed())


# ------------------------------------------------------------------------------------------------------------
# The fallback choice under on_mismatch="disable"


def test_disable_has_no_fallback_for_a_broken_contract(llama_sdpa, tmp_path):
    bench = llama_sdpa
    flat = bench.collator_factory(return_position_ids=True)

    def unmasked(features, *a, **k):
        batch = flat(features, *a, **k)
        _labels_unmasked(batch)
        return batch

    callback = PackcheckCallback(on_mismatch="disable", verbose=False)
    with pytest.raises(PackedBatchMismatch, match="collator_contract"):
        _trainer(bench, tmp_path, unmasked, callback).train()
    assert callback.fallback is None


def test_disable_cache_trap_falls_back_to_use_cache_false(tolerances, tmp_path):
    from transformers import Trainer

    bench = make_bench("llama", "sdpa", tolerances)
    callback = PackcheckCallback(on_mismatch="disable", verbose=False)
    trainer = _plain_trainer(bench, tmp_path, callback, _with_inputs(Trainer, use_cache=lambda b: True))
    trainer.train()
    assert callback.result.cause == "cache_trap" and callback.fallback.startswith("use_cache=False")
    assert trainer.state.global_step == 1


def test_cause_stateful_layers(tolerances):
    """lfm2 on sdpa: every attention call keeps the boundaries, its short-conv layers carry state from one example
    into the next (3.58e-03)."""
    bench = make_bench("lfm2", "sdpa", tolerances)
    bench.model.config.use_cache = False
    result = verify_packed_batch(bench.model, bench.packed())
    assert result.cause == "stateful_layers" and "Lfm2ShortConv" in result.evidence, result.line()
    assert result.attention["boundaries_missing"] == 0


def test_cause_stateful_layers_refused(tolerances):
    """qwen3_next handed cu_seq_lens_q refuses the row without flash-linear-attention (transformers 5.x raises):
    the audit's cause with the model's own message, not a crash out of the guard."""
    bench = make_bench("qwen3_next", "sdpa", tolerances)
    bench.model.config.use_cache = False
    result = verify_packed_batch(bench.model, bench.packed(flash_kwargs=True))
    assert result.verdict == "fail" and result.cause == "stateful_layers_refused", result.line()
    assert "can't keep packed sequences apart" in result.evidence and result.remedy.startswith("disable packing")


# ------------------------------------------------------------------------------------------------------------
# A batch of packed rows (batch size > 1): judged, not "not packed"


def _two_rows(bench, padded: bool):
    """Rows [e0 + e1] (18 tokens) and [e1 + e0], or with ``padded`` [e2 + e1] (20): the first right-padded, an
    attention_mask marking the padding."""
    ex = bench.examples
    first, second = bench.packed([ex[0], ex[1]]), bench.packed([ex[2], ex[1]] if padded else [ex[1], ex[0]])
    width = second["input_ids"].shape[1]

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    batch = {k: torch.cat([pad(first[k], fill), second[k]]) for k, fill in (("input_ids", 0), ("labels", -100), ("position_ids", 0))}
    if padded:
        batch["attention_mask"] = torch.cat([pad(torch.ones_like(first["input_ids"]), 0), torch.ones_like(second["input_ids"])])
    return batch


@pytest.mark.parametrize(("backend", "padded", "verdict"), [
    ("sdpa", False, "pass"), ("sdpa", True, "fail"), ("packcheck_flash_ref", False, "fail"),
], ids=["sdpa-equal", "sdpa-padded", "varlen_ref-equal"])
def test_batch_of_packed_rows_is_judged(tolerances, backend, padded, verdict):
    """sdpa keeps two equal rows apart (0.0); a padded pair (the attention_mask overrides the packed mask) and the
    varlen reference (transformers 5.24 reads flash boundaries from position_ids for batch size 1 only) do not:
    batch_rows, with each row alone passing."""
    bench = make_bench("llama", backend, tolerances)
    bench.model.config.use_cache = False
    batch = _two_rows(bench, padded)
    result = verify_packed_batch(bench.model, batch)
    assert result.verdict == verdict and len(result.lengths) == 4, result.line()
    # the run record is the batch's (trial 21, 76: attention_mask False beside a padding mask), and the trainer's
    # label count is every row's, as label_tokens is
    assert result.run["attention_mask"] is padded and len(result.per_example_logprob_diff) == 4
    assert result.probes["trainer_label_tokens"] == int((batch["labels"][:, 1:] != -100).sum())  # after the shift
    assert result.probes["rows"] == ["pass", "pass"]
    if verdict == "fail":
        assert result.cause == "batch_rows" and "run together differ from each row alone by" in result.evidence
        assert result.max_logprob_diff > result.tolerance["logits_atol"] and "one row per step" in result.remedy
        # the batch's own forward failed row 1 against its examples alone: judged row by row, as before the fast path
        assert result.probes["rows_together"].startswith("not judged together (row 1 gave "), result.probes
    else:  # judged on the batch's own forward: every row's examples in one set of padded batches (issue 47)
        assert "2 packed rows (2, 18) judged together: the batch's forward vs each example alone" in result.line()
        assert result.probes["reference"].startswith("right-padded batches over every row: 4 examples in")
        assert result.forwards <= 3 and "rows_together" not in result.probes, result.forwards
        assert result.max_logprob_diff <= result.tolerance["logits_atol"] / 2


@pytest.mark.parametrize("use_cache", [False, True], ids=["standard", "use_cache"])
def test_a_batch_of_packed_rows_reports_the_numbers_of_every_row(llama_sdpa, use_cache):
    """Trial 20, 97 / 99: two packed rows of 3 and 2 examples read "5 packed examples" beside label_tokens,
    per_example_logprob_diff and the log-prob figure of row 1 alone (28 label tokens of 57, 3 diffs for 5
    examples). Every row's examples now have their diff, the label tokens are summed, the worst diff is over
    both rows, and the loss figures name the row they are from."""
    ex = llama_sdpa.examples
    second = [ex[1][:3], ex[2][:5] + ex[0][:10]]  # 3 + 15 = 18 tokens, as long as row 1 (11 + 7)
    rows = [llama_sdpa.packed([ex[0], ex[1]]), llama_sdpa.packed(second)]
    batch = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    alone = [verify_packed_batch(llama_sdpa.model, r, use_cache=use_cache) for r in rows]
    result = verify_packed_batch(llama_sdpa.model, batch, use_cache=use_cache)
    assert result.lengths == [11, 7, 3, 15] and len(result.per_example_logprob_diff) == 4, result.line()
    assert result.per_example_logprob_diff == [d for r in alone for d in r.per_example_logprob_diff]
    assert result.label_tokens == sum(r.label_tokens for r in alone) == (10 + 6) + (2 + 14)
    assert result.max_logprob_diff == max(r.max_logprob_diff for r in alone)
    worst = max(range(2), key=lambda i: alone[i].loss_delta)
    assert result.loss_delta == alone[worst].loss_delta and result.loss_packed == alone[worst].loss_packed
    assert f"loss figures of row {worst + 1} of 2" in result.line()
    assert result.verdict == ("fail" if use_cache else "pass") and (result.cause == "cache_trap") == use_cache, result.line()


def test_batch_of_packed_rows_padded_inside_is_one_clear_line(llama_sdpa):
    batch = _two_rows(llama_sdpa, padded=True)
    batch["attention_mask"][0, 3] = 0
    with pytest.raises(PackcheckUsageError, match=r"row 0 of the \(2, 20\) packed rows has padding between its tokens"):
        verify_packed_batch(llama_sdpa.model, batch)


def test_numerics_band_line_verdict_and_raise_agree(tolerances, tmp_path):
    """Trainer(bf16=True) with a bf16 row tightened to a third of the measured difference: the float32 rerun
    agrees, so the callback (on_mismatch="raise") does not raise, prints PASS with the note, and trains."""
    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = verify_packed_batch(bench.model, bench.packed()).max_logprob_diff
    callback = PackcheckCallback(tolerances={"bfloat16": _band(measured)}, verbose=False)
    trainer = _plain_trainer(bench, tmp_path, callback, bf16=True)
    trainer.train()
    result = callback.result
    assert result.verdict == "pass" and result.dtype == "bfloat16", result.line()
    assert result.line().startswith("packcheck guard: PASS") and "in float32 the same row agrees" in result.line()
    assert result.tolerance["logits_atol"] < result.max_logprob_diff and trainer.state.global_step == 1
    assert json.loads((tmp_path / RESULT_FILE).read_text())["verdict"] == "pass"


def test_unpack_row_refuses_bad_arguments_in_one_line():
    from pytest_packcheck.guard import unpack_row

    b = {"input_ids": torch.arange(10)[None], "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])}
    for args, kwargs, match in (
        ((b, [slice(0, 4)]), {"pad_id": 0, "keep": [5]}, r"unpack_row: keep=\[5\]: pass indices into slices \(0 to 0\)"),
        ((b, [slice(0, 4), slice(8, 20)]), {"pad_id": 0}, r"unpack_row: slices holds slice\(8, 20, None\): .*stop <= 10"),
        ((b, [slice(0, 4)]), {"pad_id": "x"}, r"unpack_row: pad_id='x' \(str\): pass the tokenizer's pad_token_id"),
        (([1], [slice(0, 4)]), {"pad_id": 0}, r"unpack_row: batch is list: pass one packed row"),
    ):
        with pytest.raises(PackcheckUsageError, match=match):
            unpack_row(*args, **kwargs)
    out = unpack_row(b, [slice(0, 4), slice(4, 7), slice(7, 10)], pad_id=9, keep=[1, 2])
    assert out["input_ids"].tolist() == [[4, 5, 6], [7, 8, 9]] and out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_callback_tolerance_errors_name_the_callback_and_check_each_keys_range():
    with pytest.raises(PackcheckUsageError, match=r"^PackcheckCallback: tolerances\['float32'\]\['logits_atol'\] = -1: "
                                                  "a tolerance is a finite number >= 0"):
        PackcheckCallback(tolerances={"float32": {"logits_atol": -1, "loss_atol": 1e-5}})
    with pytest.raises(PackcheckUsageError, match=r"^PackcheckCallback: tolerances is a str \('strict'\)"):
        PackcheckCallback(tolerances="strict")
    from pytest_packcheck.guard.precision import _tolerances

    with pytest.raises(PackcheckUsageError, match=r"^verify_packed_batch: .*\['grad_cos_min'\] = 2: a tolerance is a number from -1 to 1"):
        _tolerances({"float32": {"logits_atol": 1e-4, "loss_atol": 1e-5, "grad_cos_min": 2}})


def test_a_diagnostic_rerun_the_model_cannot_run_judges_nothing_and_raises_nothing():
    """A default SFTTrainer(packing=True) on OPT with max_position_embeddings=128 and a 137-token packed row: the
    guard's rerun with plain position_ids 0..136 ran past OPT's position table and its IndexError killed
    train() (trial 6, 136). The rerun the model refuses is recorded and judges nothing; the verdict stands."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128,
                                     max_position_embeddings=128, word_embed_proj_dim=32))
    model.config._attn_implementation = "sdpa"
    lengths = [60, 50, 27]
    ids = torch.randint(3, 128, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    for start in (0, 60, 110):
        labels[0, start] = -100
    result = verify_packed_batch(model, {"input_ids": ids, "position_ids": pos, "labels": labels}, on_mismatch="return")
    assert result.verdict == "fail" and result.cause == "leak", result.line()
    assert "IndexError" in result.probes["plain_position_ids_error"] and "plain_position_ids" not in result.probes


def test_position_ids_that_never_count_up_are_named_not_the_labels(llama_sdpa):
    """Trial 11, 98: a DataCollatorWithFlattening row whose position_ids were zeroed (31 one-token examples) failed
    with "no labelled token (every label is -100)" beside "labels not -100 at 28 example starts", and the labels'
    remedy. The zeroed position_ids are the item named, with their remedy, and the evidence says why nothing was
    scored. Planted against: the collator's own row passes."""
    batch = llama_sdpa.packed()
    assert verify_packed_batch(llama_sdpa.model, dict(batch), use_cache=False).verdict == "pass"
    zeroed = {**batch, "position_ids": torch.zeros_like(batch["position_ids"])}
    result = verify_packed_batch(llama_sdpa.model, zeroed, use_cache=False, on_mismatch="return")
    total = batch["input_ids"].shape[1]
    assert result.verdict == "fail" and result.cause == "collator_contract", result.summary()
    assert f"every one of the {total} tokens starts an example of its own" in result.evidence
    assert "every label is -100" not in result.evidence and "labels not -100" not in result.evidence
    assert "count up within each example" in result.remedy and "set labels to -100" not in result.remedy


def test_a_pad_token_id_past_the_embedding_does_not_crash_the_padded_probe(tolerances):
    """Trial 12, 198: SFTTrainer + OPT with a tokenizer whose pad id (512) is past the model's 512 embeddings: the
    guard's padded probe (run on a mismatch) raised IndexError inside the user's training. Pad positions are masked,
    so the probe pads with an id inside the vocabulary; the verdict and its number are unchanged."""
    opt = make_bench("opt", "sdpa", tolerances)
    batch = opt.packed()
    before = verify_packed_batch(opt.model, dict(batch), use_cache=False, padded_probe=True, on_mismatch="return")
    opt.model.config.pad_token_id = opt.model.get_input_embeddings().num_embeddings  # one past the last row
    after = verify_packed_batch(opt.model, dict(batch), use_cache=False, padded_probe=True, on_mismatch="return")
    assert before.verdict == after.verdict == "fail" and after.cause == before.cause, after.summary()
    assert after.max_logprob_diff == before.max_logprob_diff


@pytest.mark.parametrize(("arch", "backend", "expected"), [
    ("llama", "sdpa", ("pass", "pass")),  # 5.x builds the packed mask from position_ids.diff() != 1: exact
    ("gpt2", "sdpa", ("pass", "pass")),  # learned absolute positions: exact only against the chunk at its own positions
    ("llama", "packcheck_flash_ref", ("leak", "flash_boundaries")),  # the flash path cuts where position_ids == 0 only
    ("opt", "sdpa", ("leak", "leak")),  # planted: a model that leaks anyway still fails with a continuation chunk
])
def test_a_continuation_chunk_is_judged_by_what_the_model_computes(tolerances, arch, backend, expected):
    """Issue 41: one example whose position_ids start above 0 (a long document split across rows) was failed by
    contract (wrong_positions) although the model computed it exactly. It is now run alone at the same positions and
    judged by the numbers: a pass where the backend keeps the boundary, the measured cause where it does not (the
    flash path finds boundaries at position 0 only, so a chunk mid-row leaks and a chunk first in the row breaks
    cu_seq_lens). Mid-row: the second example from position 5; first: the first example from position 40."""
    bench = make_bench(arch, backend, tolerances)
    bench.model.config.use_cache = False
    got = []
    for start, stop, shift in ((11, 18, 5), (0, 11, 40)):
        batch = bench.packed()
        batch["position_ids"] = batch["position_ids"].clone()
        batch["position_ids"][0, start:stop] += shift
        result = verify_packed_batch(bench.model, batch, on_mismatch="return")
        assert any(n.startswith(f"continuation chunk (token {start} from position {shift}") for n in result.notes), result.notes
        assert "wrong_positions" not in result.causes, result.line()
        got.append("pass" if result.verdict == "pass" else result.cause)
        if result.verdict == "pass":
            assert result.max_logprob_diff <= result.tolerance["logits_atol"], result.line()
    assert tuple(got) == expected, got


def test_the_guard_never_ends_a_run_it_passed(tolerances, tmp_path):
    """Issue 42: the same callback added twice crashed the first step; a read-only output_dir turned a PASS into an
    OSError that ended training. Now one guard judges once, and an unwritable result file is one warning while the
    verdict stands and the step runs. Planted: both at once on a correct llama / sdpa run."""
    import os
    import stat
    import warnings

    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False
    callback = PackcheckCallback()
    out = tmp_path / "ro"
    out.mkdir()
    trainer = _trainer(bench, out, bench.collator_factory(return_position_ids=True), callback)
    trainer.add_callback(callback)  # twice
    os.chmod(out, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(out, os.W_OK):  # root ignores the mode: a file where the folder should be is read-only to anyone
            os.chmod(out, stat.S_IRWXU)
            trainer.args.output_dir = str(tmp_path / "a-file" / "below")
            (tmp_path / "a-file").write_text("")
            callback_dir = tmp_path / "a-file" / "below"
        else:
            callback_dir = out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        os.chmod(out, stat.S_IRWXU)
    assert trainer.state.global_step == 1
    assert callback.result is not None and callback.result.verdict == "pass", callback.result.line()
    said = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(said) == 1 and str(callback_dir / RESULT_FILE) in said[0] and said[0].endswith("training goes on: pass")


@pytest.mark.parametrize("plant", [None, "first_micro_batch_only", "counted_twice"])
def test_num_items_in_batch_is_checked_over_the_accumulation_window(tolerances, tmp_path, monkeypatch, plant):
    """Issue 41: with gradient accumulation the trainer divides by the count of the whole window (the sum over its
    micro-batches); the guard compared it with one micro-batch only (count >= that row's), so a count too large or
    from one micro-batch passed. Real Trainer, 2 micro-batches of 3 packed examples, one optimizer step. Planted: the
    trainer's count of the first micro-batch only (below the window's), or the window counted twice (above it, which
    one micro-batch's own count never showed). Counting before the shift is no fault on a packed row, whose first
    label is -100 (known fault trainer-num-items-before-shift: only the padded run was off)."""
    from transformers import Trainer, TrainingArguments

    from pytest_packcheck.checks.training import TRAIN_RECIPE

    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False
    real = Trainer._get_num_items_in_batch
    if plant == "first_micro_batch_only":
        monkeypatch.setattr(Trainer, "_get_num_items_in_batch", lambda self, batches, device: real(self, batches[:1], device))
    elif plant == "counted_twice":
        monkeypatch.setattr(Trainer, "_get_num_items_in_batch", lambda self, batches, device: 2 * real(self, batches, device))
    callback = PackcheckCallback()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             max_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, **TRAIN_RECIPE)
    examples = [{"input_ids": e} for e in bench.examples] * 2
    trainer = Trainer(model=bench.model, args=args, train_dataset=examples,
                      data_collator=bench.collator_factory(return_position_ids=True), callbacks=[callback])
    if plant is None:
        trainer.train()
        assert callback.result.verdict == "pass", callback.result.line()
        assert any("of the 2 micro-batches of the first accumulation step" in n for n in callback.result.notes)
        return
    with pytest.raises(PackedBatchMismatch) as info:
        trainer.train()
    result = info.value.result
    assert result.cause == "loss_normalisation" and "first accumulation step's 2 micro-batches" in result.evidence, result.line()
    assert trainer.state.global_step == 0  # stopped before the optimizer step


def test_the_bf16_cache_trap_is_named_under_a_tolerance_below_bf16_rounding(tolerances):
    """Issue 42: the bf16 guard with the cache left on, at a tolerance below bf16 rounding, said leak: the rerun with
    use_cache=False (7.15e-04) and the row as run (6.25e-02) both lie in bf16's numerics band, so the rule "the rerun
    is numerics while the row is not" never named the cache. A rerun 10x better than a row off by more than one
    rounding level names it. Planted: tiny llama in bfloat16, use_cache=True, tolerance 1e-6; the fixed rule itself
    on numbers, both ways."""
    from pytest_packcheck.checks.registry import fixed_by

    bench = make_bench("llama", "sdpa", tolerances)
    model = bench.model.to(torch.bfloat16)
    model.config.use_cache = True
    model.train()
    result = verify_packed_batch(model, bench.packed(), tolerances={"bfloat16": {"logits_atol": 1e-6, "loss_atol": 1e-6}})
    assert result.verdict == "fail" and result.cause == "cache_trap", result.line()
    assert fixed_by(7.15e-4, 6.25e-2, 1e-6, "bfloat16", 5.0)
    assert not fixed_by(7.15e-4, 1.0e-3, 1e-6, "bfloat16", 5.0)  # no 10x improvement: not the suspect
    assert not fixed_by(7.15e-4, 2.0e-2, 1e-6, "bfloat16", 5.0)  # the row within one rounding level (3.9e-2)


def test_a_token_in_the_models_own_error_never_leaves_the_guard_in_clear(tolerances, tmp_path, capsys):
    """Trial of issue 42: a model whose forward raised with a token in its message had it in clear in the
    PackedBatchMismatch, the guard's stderr line and packcheck-guard.json (the warn policy's warning was scrubbed)."""
    token = "hf_ABCdefGHIjklMNOpqrSTUvwxYZ123456"
    bench = make_bench("llama", "sdpa", tolerances)
    bench.model.config.use_cache = False

    def boom(*args, **kwargs):
        raise RuntimeError(f"auth failed for {token}")

    bench.model.model.forward = boom
    callback = PackcheckCallback()
    trainer = _trainer(bench, tmp_path, bench.collator_factory(return_position_ids=True), callback)
    with pytest.raises(PackedBatchMismatch) as info:
        trainer.train()
    said = capsys.readouterr()
    assert token not in str(info.value) and token not in said.err + said.out
    written = (tmp_path / RESULT_FILE).read_text()
    assert token not in written and "auth failed for ***" in written


# Encoders and embedding models (issue 46 part 4): judged on what they output, against each example alone as the
# model numbers it alone (transformers 5.25.0 builds the packed bidirectional mask from position_ids).


def _encoder(model_type, backend, tolerances, base=False):
    from test_encoders import enc_bench

    bench = enc_bench(model_type, backend, tolerances)
    if base:  # AutoModel: the embedding model without a head, the same weights
        from transformers import AutoModel

        model = AutoModel.from_config(bench.model.config, attn_implementation=bench.model.config._attn_implementation)
        model.load_state_dict(bench.model.base_model.state_dict(), strict=False)  # the pooler: random, never compared
        bench.model = model.eval()
    return bench


@pytest.mark.parametrize(("model_type", "base", "compared"), [
    ("bert", False, "logit"), ("bert", True, "hidden-state"), ("roberta", False, "logit"), ("roberta", True, "hidden-state"),
], ids=["bert-mlm", "bert-base", "roberta-mlm", "roberta-base"])
def test_an_encoder_passes_on_its_outputs_and_pooled_embeddings(tolerances, model_type, base, compared):
    """A correct encoder row (position_ids restarting from the model's first position: RoBERTa's padding_idx + 1)
    passes against each example alone numbered by the model itself: per-token outputs and mean / CLS / last-token
    embeddings per segment within 5e-07 on sdpa (transformers 5.25.0); one forward per example."""
    bench = _encoder(model_type, "sdpa", tolerances, base)
    result = verify_packed_batch(bench.model, bench.packed())
    assert result.verdict == "pass" and result.compared == compared, result.line()
    assert f"worst {compared} diff" in result.line() and len(result.per_example_logprob_diff) == 3
    assert result.max_logprob_diff <= 1e-6 and set(result.probes["pooled"]) == {"mean", "cls", "last"}
    assert result.forwards == 1 + 3 and result.probes["reference"].startswith("one at a time, numbered by the model")
    assert (result.loss_delta is not None) == (compared == "logit")  # the MLM loss where the head gives logits


def test_modernbert_on_sdpa_leaks_and_the_varlen_reference_keeps_it(tolerances):
    """ModernBERT on sdpa (transformers 5.25.0) mixes the packed examples: fail, cause leak, with the numbers and the
    isolation probe's; on the varlen reference fed cu_seq_lens_q/k the same model passes exactly."""
    bench = _encoder("modernbert", "sdpa", tolerances)
    result = verify_packed_batch(bench.model, bench.packed())
    assert result.verdict == "fail" and result.cause == "leak", result.line()
    assert result.max_logprob_diff > 1e-3 and max(result.probes["pooled"].values()) > 1e-3
    assert result.probes["isolation_moved"] > result.tolerance["logits_atol"]
    assert "changing the first example moves the others' logits by" in result.evidence and result.remedy
    flash = _encoder("modernbert", "packcheck_flash_ref", tolerances)
    result = verify_packed_batch(flash.model, flash.packed(flash_kwargs=True))
    assert result.verdict == "pass" and result.max_logprob_diff <= 1e-6, result.line()


def test_an_encoder_row_whose_position_ids_never_restart_fails_with_its_number(tolerances):
    """Planted: a flattening collator whose position_ids run 0 .. N-1 over the row beside its cu_seq_lens_q: sdpa
    builds one example of the row (collator_contract), measured against each example alone."""
    bench = _encoder("bert", "sdpa", tolerances)
    batch = bench.packed(flash_kwargs=True)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    result = verify_packed_batch(bench.model, batch)
    assert result.verdict == "fail" and result.cause == "collator_contract", result.line()
    assert "position_ids restart at tokens [0], cu_seq_lens_q start examples at [0, 11, 18]" in result.evidence
    assert result.max_logprob_diff > 1e-2 and "same segmentation" in result.remedy


def test_roberta_numbered_from_zero_is_wrong_positions(tolerances):
    """Planted: RoBERTa's row numbered from 0 (a collator that ignores padding_idx + 1): wrong_positions, measured
    against each example as RoBERTa numbers it alone (from 2), and the remedy names 2."""
    bench = _encoder("roberta", "sdpa", tolerances)
    batch = bench.packed()
    batch["position_ids"] = batch["position_ids"] - bench.start
    result = verify_packed_batch(bench.model, batch)
    assert result.verdict == "fail" and result.cause == "wrong_positions", result.line()
    assert result.max_logprob_diff > 1e-2 and "restart position_ids at 2" in result.remedy


def test_an_encoders_leak_is_named_by_the_isolation_probe(tolerances):
    """Planted: BERT's packed rows fed no position_ids beside cu_seq_lens_q on sdpa (the mask is built from
    position_ids: none, so one example of the row): the guard names leak from the isolation probe."""
    bench = _encoder("bert", "sdpa", tolerances)
    batch = bench.packed(flash_kwargs=True)
    batch.pop("position_ids")
    result = verify_packed_batch(bench.model, batch)
    assert result.verdict == "fail" and result.cause == "leak", result.line()
    assert result.probes["isolation_moved"] > result.tolerance["logits_atol"] and result.max_logprob_diff > 1e-2


def test_a_batch_of_encoder_rows_is_judged_row_by_row_and_together(tolerances):
    """Two packed rows of an encoder: each row judged on its outputs, the batch together vs each row alone."""
    bench = _encoder("bert", "sdpa", tolerances)
    ex = bench.examples
    rows = [bench.packed([ex[0], ex[1]]), bench.packed([ex[2][:7], ex[0][:11]])]
    batch = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    result = verify_packed_batch(bench.model, batch)
    assert result.verdict == "pass" and result.compared == "logit" and result.probes["rows"] == ["pass", "pass"], result.line()
    assert "2 packed rows (2, 18): together vs each row alone" in result.line()
    assert result.probes["rows_together"].startswith("not judged together (an encoder")


@pytest.mark.parametrize(("model_type", "verdict"), [("bert", "pass"), ("modernbert", "fail")])
def test_the_callback_judges_an_encoder_in_a_trainer(tolerances, tmp_path, model_type, verdict):
    """transformers' Trainer on a masked-LM encoder with DataCollatorWithFlattening: the callback judges the first
    batch on the model's logits; ModernBERT on sdpa (transformers 5.25.0) raises before the first optimizer step."""
    from transformers import DataCollatorWithFlattening

    bench = _encoder(model_type, "sdpa", tolerances)
    callback = PackcheckCallback()
    before = _params(bench.model)
    trainer = _trainer(bench, tmp_path, DataCollatorWithFlattening(), callback)
    if verdict == "pass":
        trainer.train()
    else:
        with pytest.raises(PackedBatchMismatch):
            trainer.train()
        assert trainer.state.global_step == 0 and all(torch.equal(p, before[n]) for n, p in bench.model.named_parameters())
    result = callback.result
    assert result.verdict == verdict and result.compared == "logit", result.line()
    assert (result.cause == "leak") == (verdict == "fail") and json.loads((tmp_path / RESULT_FILE).read_text())["compared"] == "logit"
