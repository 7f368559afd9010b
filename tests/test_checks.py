"""Every check passes on the correct stack (tiny llama, sdpa, use_cache=False) and fails on its planted fault."""

from __future__ import annotations

import pytest
import torch
from faults import DropPositionIds, SilentSwap, collator_label_leak, collator_no_reset, leaky_sdpa

from pytest_packcheck import checks as C
from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks import packing as P
from pytest_packcheck.checks import sft as S
from pytest_packcheck.checks import training as T
from pytest_packcheck.checks.registry import SPECS

CORRECT = ["collate_core", "position_ids", "isolation", "logits_parity", "loss_parity", "grad_parity", "backend"]


@pytest.mark.parametrize("name", ["position_ids", "isolation", "logits_parity", "loss_parity", "grad_parity", "backend"])
def test_checks_pass_on_correct_stack(llama_sdpa, name):
    result = SPECS[name].load()(llama_sdpa)
    assert result.status == "pass", result.message


def test_correct_stack_numbers(llama_sdpa):
    assert C.check_logits_parity(llama_sdpa).metrics["max_abs_diff_solo"] < 1e-5
    iso = C.check_isolation(llama_sdpa).metrics
    assert iso["max_change"] == 0.0 and iso["negative_control_change"] > 1e-2
    loss = C.check_loss_parity(llama_sdpa).metrics
    assert loss["num_items_in_batch_packed"] == loss["num_items_expected"] == sum(n - 1 for n in llama_sdpa.lengths)


def test_collate_contract_holds_except_integer_labels(llama_sdpa):
    result = C.check_collate(llama_sdpa)
    # transformers 5.24 still raises TypeError('int' object is not subscriptable) for integer labels
    assert "position_ids" not in result.message and "cu_seq_lens" not in result.message
    assert result.metrics["position_ids_mismatches"] == 0 and result.metrics["unmasked_boundaries"] == 0
    assert result.metrics["empty_example"] == "dropped"


def test_collate_fails_when_positions_do_not_reset(llama_sdpa):
    llama_sdpa.collator_factory = collator_no_reset
    result = C.check_collate(llama_sdpa)
    assert result.status == "fail" and "do not restart" in result.message
    assert result.metrics["position_ids_mismatches"] == sum(llama_sdpa.lengths[1:])


def test_isolation_and_parity_fail_when_positions_do_not_reset(llama_sdpa):
    llama_sdpa.collator_factory = collator_no_reset
    assert C.check_isolation(llama_sdpa).status == "fail"
    assert C.check_logits_parity(llama_sdpa).status == "fail"


def test_label_not_masked_at_boundary(llama_sdpa):
    llama_sdpa.collator_factory = collator_label_leak
    collate = C.check_collate(llama_sdpa)
    assert collate.status == "fail" and collate.metrics["unmasked_boundaries"] == len(llama_sdpa.lengths)
    loss = C.check_loss_parity(llama_sdpa)
    assert loss.status == "fail"
    # one extra label token per boundary inside a micro-batch ([e0, e1] and [e2]): the last token of e0 is
    # trained to predict the first token of e1
    assert loss.metrics["num_items_in_batch_packed"] - loss.metrics["num_items_expected"] == 1
    assert "num_items_in_batch" in loss.message


def test_model_that_drops_position_ids(llama_sdpa):
    llama_sdpa.model = DropPositionIds(llama_sdpa.model)
    result = C.check_position_ids(llama_sdpa)
    assert result.status == "fail" and result.metrics["max_change"] == 0.0
    assert C.check_isolation(llama_sdpa).status == "fail"


def test_attention_that_leaks(llama_sdpa):
    with leaky_sdpa():
        iso = C.check_isolation(llama_sdpa)
        logits = C.check_logits_parity(llama_sdpa)
        grads = C.check_grad_parity(llama_sdpa)
    assert iso.status == "fail" and iso.metrics["max_change"] > 1e-3
    assert logits.status == "fail"
    assert grads.status == "fail" and grads.metrics["grad_rel_err"] > 1e-3


def test_backend_sees_missing_boundaries(llama_sdpa):
    """A packed row whose mask never got the boundaries (here: a cache, so no packed mask is built)."""
    from pytest_packcheck.backends import count_attention_calls

    with count_attention_calls(llama_sdpa.model, llama_sdpa.lengths) as probe:
        llama_sdpa.forward(llama_sdpa.packed(), use_cache=True)
    assert [c.isolated for c in probe.calls] == [False, False]


def test_silent_backend_swap(llama_sdpa):
    llama_sdpa.model = SilentSwap(llama_sdpa.model)
    result = C.check_backend(llama_sdpa)
    assert result.status == "fallback", result.message
    assert result.metrics["calls"] == {"eager": 2}


def test_cache_trap_on_sdpa(llama_sdpa):
    """transformers 5.24 (masking_utils.create_causal_mask: no packed mask when past_key_values is set): a default
    forward builds a cache, which disables the packed mask."""
    result = C.check_cache_trap(llama_sdpa)
    assert result.status == "fail" and "use_cache=False" in result.message
    assert result.metrics["max_abs_diff_default"] > 1e-2
    assert result.metrics["max_abs_diff_use_cache_false"] < 1e-5


def test_mask_trap_on_sdpa_and_its_fix(llama_sdpa):
    """An all-ones attention_mask beside packed position_ids makes sdpa build a plain causal mask (leak);
    dropping the mask (the fix) passes. The same check, two verdicts."""
    from faults import DropAttentionMask

    result = C.check_mask_trap(llama_sdpa)
    assert result.status == "fail" and "overrides the packed boundaries" in result.message, result.message
    assert result.metrics["max_abs_diff_with_mask"] > 1e-2 and result.metrics["max_abs_diff_without_mask"] < 1e-5
    llama_sdpa.model = DropAttentionMask(llama_sdpa.model)
    fixed = C.check_mask_trap(llama_sdpa)
    assert fixed.status == "pass", fixed.message
    assert fixed.metrics["max_abs_diff_with_mask"] < 1e-5


def test_reference_backend_routes_through_flash_preparation(tolerances):
    from conftest import make_bench

    bench = make_bench("llama", REFERENCE_BACKEND, tolerances)
    backend = C.check_backend(bench)
    assert backend.status == "pass", backend.message
    assert backend.metrics["varlen_kernel_calls"] == backend.metrics["expected_calls"] == 2
    assert backend.metrics["dense_kernel_calls"] == 0
    assert C.check_cache_trap(bench).status == "pass"  # the flash path ignores the cache when building boundaries
    assert C.check_logits_parity(bench).metrics["max_abs_diff_solo"] < 1e-5


def test_state_space_model_leaks(tolerances):
    from conftest import make_bench

    bench = make_bench("mamba", "eager", tolerances)
    assert C.check_position_ids(bench).status == "fail"
    assert C.check_isolation(bench).status == "fail"


def test_flex_grad_parity_is_skipped_on_cpu(tolerances):
    from conftest import make_bench

    bench = make_bench("llama", "flex_attention", tolerances)
    result = C.check_grad_parity(bench)
    assert result.status == "skipped" and "forward-only" in result.message


def test_torch_varlen_backend_logic_with_cpu_stand_in(tolerances, monkeypatch):
    """The CUDA torch varlen backend's argument building, checked on CPU: a stand-in with varlen_attn's
    signature records what it receives and computes with the exact reference kernel."""
    import torch
    from conftest import make_bench

    from pytest_packcheck.backends import TORCH_VARLEN_BACKEND, torch_varlen, varlen_reference_kernel

    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        seen.append({"cu_dtype": cu_seq_q.dtype, "max_types": (type(max_q), type(max_k)), "window": window_size,
                     "gqa": enable_gqa, "heads": (query.shape[1], key.shape[1])})
        causal, left = window_size[1] == 0, window_size[0]
        return varlen_reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                                       causal=causal, window_size=(left, -1))

    monkeypatch.setattr(torch_varlen, "_torch_varlen_attn", lambda: varlen_attn)
    bench = make_bench("mistral", TORCH_VARLEN_BACKEND, tolerances)  # GQA 4:1 and a sliding window of 8
    assert C.check_logits_parity(bench).metrics["max_abs_diff_solo"] < 1e-5
    backend = C.check_backend(bench)
    assert backend.status == "pass" and backend.metrics["varlen_kernel_calls"] == 2
    packed_calls = [s for s in seen if s["gqa"]]
    assert packed_calls and all(s["cu_dtype"] == torch.int32 and s["max_types"] == (int, int) for s in seen)
    # causal; the window (8 tokens, flash-attn's inclusive left = 7) once a segment is longer than it
    assert {s["window"] for s in seen} <= {(-1, 0), (7, 0)} and (7, 0) in {s["window"] for s in seen}
    assert packed_calls[0]["heads"] == (8, 2)  # GQA passed through, not expanded


def test_torch_varlen_stand_in_for_the_gpu_rehearsal(tolerances, monkeypatch):
    """PACKCHECK_TORCH_VARLEN_STAND_IN=1 (tools/gpu_check.sh --rehearse): the torch varlen backend runs on CPU
    through the torch 2.11 signature; GQA is expanded before the call (2.11 has none), the boundaries reach it,
    and the document records the stand-in so the matrix never labels it PyTorch's kernel."""
    from conftest import make_bench

    from pytest_packcheck.backends import STAND_IN_ENV, STAND_IN_LABEL, TORCH_VARLEN_BACKEND, backend_availability, backend_labels
    from pytest_packcheck.results.environment import environment

    assert not backend_availability(TORCH_VARLEN_BACKEND, "cpu").available
    monkeypatch.setenv(STAND_IN_ENV, "1")
    assert backend_availability(TORCH_VARLEN_BACKEND, "cpu").available
    bench = make_bench("mistral", TORCH_VARLEN_BACKEND, tolerances)  # GQA 4:1, sliding window 8
    backend = C.check_backend(bench)
    assert backend.status == "pass", backend.message
    assert (backend.metrics["varlen_kernel_calls"], backend.metrics["dense_kernel_calls"]) == (2, 0)
    assert C.check_logits_parity(bench).metrics["max_abs_diff_solo"] < 1e-5
    env = environment("cpu")
    assert env["torch_varlen_kernel"] == "stand-in" and backend_labels(env)[TORCH_VARLEN_BACKEND] == STAND_IN_LABEL


def test_torch_varlen_stand_in_refuses_what_the_kernel_would_misread():
    import torch

    from pytest_packcheck.backends import varlen_attn_stand_in

    q = torch.zeros(9, 4, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(TypeError, match="Python ints"):
        varlen_attn_stand_in(q, q, q, cu, cu, torch.tensor(5), 5)
    with pytest.raises(ValueError, match="no GQA"):
        varlen_attn_stand_in(q, torch.zeros(9, 2, 8), torch.zeros(9, 2, 8), cu, cu, 5, 5)
    with pytest.raises(ValueError, match="int32"):
        varlen_attn_stand_in(q, q, q, cu.long(), cu.long(), 5, 5)


def test_torch_varlen_args_rules():
    import torch

    from pytest_packcheck.backends import build_torch_varlen_args

    q, k = torch.zeros(9, 4, 8), torch.zeros(9, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args, kw = build_torch_varlen_args(q, k, k, cu, cu, torch.tensor(5), torch.tensor(5), None, True, (7, 7), {"window_size", "enable_gqa"})
    assert args[5:] == (5, 5) and type(args[5]) is int and kw["window_size"] == (7, 0) and kw["enable_gqa"]
    args, kw = build_torch_varlen_args(q, k, k, cu, cu, 5, 5, 0.5, True, (-1, -1), {"is_causal"})
    assert kw == {"scale": 0.5, "is_causal": True} and args[1].shape[1] == 4  # older torch: K/V heads repeated
    with pytest.raises(ValueError, match="int32"):
        build_torch_varlen_args(q, k, k, cu.long(), cu.long(), 5, 5, None, True, (-1, -1), set())


def test_torch_varlen_args_for_the_torch_2_11_signature():
    """The device's torch 2.11.0 varlen_attn (read from its wheel): ``(query, key, value, cu_seq_q, cu_seq_k, max_q,
    max_k, *, return_aux, scale, window_size)``, no enable_gqa and no is_causal: causal is window_size (-1, 0),
    GQA heads are repeated."""
    import torch

    from pytest_packcheck.backends import build_torch_varlen_args

    params = {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size"}
    q, k = torch.zeros(9, 4, 8), torch.zeros(9, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args, kw = build_torch_varlen_args(q, k, k, cu, cu, 5, 5, None, True, (-1, -1), params)
    assert kw == {"scale": None, "window_size": (-1, 0)} and args[1].shape[1] == args[2].shape[1] == 4
    args, kw = build_torch_varlen_args(q, k, k, cu, cu, 5, 5, None, True, (3, 3), params)
    assert kw["window_size"] == (3, 0)


def test_flash_kernel_counting_before_4_56(monkeypatch, llama_sdpa):
    """transformers < 4.56 calls flash-attn's functions as module globals of modeling_flash_attention_utils (no
    lazy loader): the counter wraps those, tells varlen from dense calls, and puts them back."""
    import torch
    import transformers.modeling_flash_attention_utils as mfu

    from pytest_packcheck.backends import count_attention_calls

    monkeypatch.delattr(mfu, "lazy_import_flash_attention")
    dense, varlen = (lambda q, k, v, **kw: q), (lambda q, k, v, cu_seqlens_q, cu_seqlens_k, *a, **kw: q)
    monkeypatch.setattr(mfu, "flash_attn_func", dense, raising=False)
    monkeypatch.setattr(mfu, "flash_attn_varlen_func", varlen, raising=False)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with count_attention_calls(llama_sdpa.model, [3, 4]) as probe:
        mfu.flash_attn_varlen_func(None, None, None, cu_seqlens_q=cu, cu_seqlens_k=cu)
        mfu.flash_attn_varlen_func(None, None, None, cu, cu)
        mfu.flash_attn_func(None, None, None)
    assert (probe.varlen_calls, probe.dense_flash_calls) == (2, 1)
    assert probe.varlen_boundaries == [[0, 3, 7], [0, 3, 7]]
    assert mfu.flash_attn_func is dense and mfu.flash_attn_varlen_func is varlen


def test_flash_attention_3_availability_reasons(monkeypatch):
    """flash_attention_3 needs CUDA, a Hopper GPU and flash_attn_interface; each missing piece is named."""
    import importlib.util

    from pytest_packcheck import backends
    from pytest_packcheck.backends import availability

    cpu = backends.backend_availability("flash_attention_3", "cpu")
    assert not cpu.available and "CUDA device (running on cpu)" in cpu.reason and "flash-attn-3" in cpu.reason
    monkeypatch.setattr(availability, "cuda_capability", lambda device: (8, 0))
    ampere = backends.backend_availability("flash_attention_3", "cuda:0")
    assert not ampere.available and "this one is 8.0" in ampere.reason
    monkeypatch.setattr(availability, "cuda_capability", lambda device: (9, 0))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn_interface" else real_find_spec(name, *a))
    # a flash_attn_interface module from another distribution (transformers' check wants flash-attn-3)
    monkeypatch.setattr(availability, "_distributed_as", lambda module, dist: False)
    other = backends.backend_availability("flash_attention_3", "cuda")
    assert not other.available and "installed by another distribution" in other.reason
    monkeypatch.setattr(availability, "_distributed_as", lambda module, dist: (module, dist) == ("flash_attn_interface", "flash-attn-3"))
    assert backends.backend_availability("flash_attention_3", "cuda").available


def test_torch_varlen_skips_on_cpu():
    from pytest_packcheck.backends import TORCH_VARLEN_BACKEND, backend_availability

    avail = backend_availability(TORCH_VARLEN_BACKEND, "cpu")
    assert not avail.available and "CUDA" in avail.reason


def test_backend_flags_an_attention_fallback_warning_every_time(llama_sdpa, monkeypatch):
    """A logged attention fallback is a fallback verdict, also when an earlier model already logged it
    (transformers' warning_once would hide the repeat)."""
    from transformers.utils import logging as hf_logging

    inner = llama_sdpa.model.forward

    def forward(*args, **kwargs):
        hf_logging.get_logger("transformers.modeling_utils").warning_once("sdpa is not supported here, falling back to eager")
        return inner(*args, **kwargs)

    monkeypatch.setattr(llama_sdpa.model, "forward", forward)
    assert C.check_backend(llama_sdpa).status == "fallback"
    assert C.check_backend(llama_sdpa).status == "fallback"  # the second time too


def test_backend_sees_the_dense_flash_path(tolerances):
    """Positions that never restart: transformers' flash path takes the dense kernel, which the backend check
    must tell apart from the varlen kernel."""
    from conftest import make_bench

    bench = make_bench("llama", REFERENCE_BACKEND, tolerances, collator_factory=collator_no_reset)
    result = C.check_backend(bench)
    assert result.status == "fail" and result.metrics["varlen_kernel_calls"] == 0
    assert result.metrics["dense_kernel_calls"] == result.metrics["expected_calls"] == 2  # counted, not inferred
    assert "dense (padded) flash kernel 2 times" in result.message and result.metrics["boundaries_missing"] == 2


def test_trl_padding_free_collator_pads_position_ids(llama_sdpa):
    """TRL's padding-free collator, pad_to_multiple_of=8, a 1027-token row: every per-token key is 1032 long.
    Planted: a collator that pads input_ids but leaves position_ids at 1027 and unmasks the first label -> the
    shapes item fails, and the labels item is still looked at (and fails) on its own."""
    pytest.importorskip("trl")
    from pytest_packcheck.model.batches import trl_collator_factory

    result = C.check_collate_trl(llama_sdpa)
    assert result.status == "pass", result.message
    assert result.metrics["tokens"] == 1027 and set(map(tuple, result.metrics["shapes"].values())) == {(1, 1032)}
    assert {k: v["status"] for k, v in result.metrics["items"].items()} == dict.fromkeys(
        ("shapes", "position_ids", "labels", "labels_padding"), "pass")

    def short_positions(**kwargs):
        inner = trl_collator_factory(**kwargs)

        def collate(examples):
            batch = inner(examples)
            batch["position_ids"] = batch["position_ids"][:, :1027]
            batch["labels"][0, 400] = 5  # the second example's first label, unmasked
            return batch

        return collate

    llama_sdpa.trl_collator_factory = short_positions
    broken = C.check_collate_trl(llama_sdpa)
    items = broken.metrics["items"]
    assert broken.status == "fail" and broken.cause == "collator_contract"
    assert items["shapes"]["status"] == "fail" and "'position_ids': [1, 1027]" in items["shapes"]["evidence"]
    assert items["labels"]["status"] == "fail" and "[400]" in items["labels"]["evidence"]
    assert items["position_ids"]["status"] == "pass" and items["labels_padding"]["status"] == "pass"


def test_trainer_packed_equals_padded_and_catches_a_planted_fault(llama_sdpa):
    """Trainer + DataCollatorWithFlattening vs a padding collator, 3 steps: equal on a correct stack; a collator
    that does not restart position_ids (planted) makes the packed run diverge from step 1."""
    pytest.importorskip("accelerate")
    result = T.check_trainer(llama_sdpa)
    assert result.status == "pass", result.message
    assert result.metrics["as_configured"]["max_loss_delta"] < 1e-5 and len(result.metrics["reference_loss"]) == 3
    assert result.metrics["padded_trainer"]["max_loss_delta"] < 1e-5  # Trainer's own padded run agrees on llama (5.x)
    llama_sdpa.collator_factory = collator_no_reset
    broken = T.check_trainer(llama_sdpa)
    assert broken.status == "fail" and broken.metrics["use_cache_false"]["first_diverging_step"] == 1, broken.message


def test_trainer_reference_is_independent_of_trainer_normalisation(tolerances):
    """gpt2 (loss_type None): transformers' Trainer divides a padded batch by its label count before the shift,
    so Trainer's own padded run is off by 28/31; the packed run matches packcheck's hand-written reference and
    passes, with the padded run's normalisation reported beside it. Same for SFTTrainer's padded run."""
    pytest.importorskip("accelerate")
    from conftest import make_bench
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    gpt2 = make_bench("gpt2", "sdpa", tolerances)
    if LOSS_MAPPING.get(gpt2.model.loss_type) is ForCausalLMLoss:
        pytest.skip("this transformers gives GPT2LMHeadModel a ForCausalLM loss_type: Trainer counts it right")
    result = T.check_trainer(gpt2)
    assert result.status == "pass", result.message
    padded = result.metrics["padded_trainer"]
    assert padded["normalisation"] and abs(padded["loss_ratio"] - 28 / 31) < 1e-3
    assert "Trainer's own padded run is off: loss x0.90" in result.message
    assert result.metrics["grad_accum"]["padded"]["num_items_in_batch"] == [57, 57]  # unshifted: 51 + 6 examples
    padded_check = T.check_trainer_padded(gpt2)  # the padded side's own verdict (issue 16)
    assert padded_check.status == "fail" and padded_check.cause == "padded_normalisation", padded_check.message
    assert abs(padded_check.metrics["loss_ratio"] - 28 / 31) < 1e-3
    pytest.importorskip("trl")
    sft = S.check_sft(gpt2)
    assert sft.status == "pass", sft.message
    sft_padded = S.check_sft_padded(gpt2)
    assert sft_padded.status == "fail" and sft_padded.cause == "padded_normalisation", sft_padded.message


def test_trainer_grad_accum_counts_label_tokens_after_the_shift(llama_sdpa):
    """Gradient accumulation 2 with packed micro-batches of 3 examples: the num_items_in_batch Trainer hands the
    model is the label tokens != -100 after the shift over both micro-batches (the same for the padded run on
    5.x). Planted: a collator that leaves the boundary labels unmasked -> 2 x 2 tokens too many -> fail."""
    pytest.importorskip("accelerate")
    result = T.check_trainer(llama_sdpa)
    ga = result.metrics["grad_accum"]
    lengths = [*llama_sdpa.lengths, *T.GRAD_ACCUM_LENGTHS]
    assert ga["packed"]["expected"] == sum(n - 1 for n in lengths) == 51
    assert ga["packed"]["num_items_in_batch"] == [51, 51] and ga["packed"]["micro_batches"] == 2
    assert ga["padded"]["num_items_in_batch"] == [51, 51]
    assert abs(ga["packed"]["loss"][0] - ga["padded"]["loss"][0]) < 1e-5
    llama_sdpa.collator_factory = collator_label_leak
    broken = T.check_trainer(llama_sdpa)
    assert broken.status == "fail" and "num_items_in_batch [55]" in broken.message and "expected 51" in broken.message, broken.message


def test_sft_packing_reports_what_is_in_force_and_catches_a_leak(llama_sdpa):
    """TRL SFTTrainer(packing=True) with an offline BPE tokenizer: TRL sets use_cache=False, sends cu_seq_lens,
    and bfd packing turns padding-free on although padding_free=False was asked (named as an override); the
    first-batch loss equals the per-example reference. Planted: sdpa that ignores the packed mask -> fail."""
    pytest.importorskip("trl")
    result = S.check_sft(llama_sdpa)
    assert result.status == "pass", result.message
    assert llama_sdpa.model.config.use_cache is True  # restored for the group's other checks
    eff = result.metrics["effective"]
    assert eff["use_cache"] is False and "cu_seq_lens_q" in result.metrics["keys"] and "attention_mask" not in result.metrics["keys"]
    assert result.metrics["examples_in_row"] == 6 and result.metrics["loss_delta"] < 1e-5
    assert result.metrics["overridden"].get("padding_free") == [False, True]
    steps = result.metrics["steps"]  # 3 SFTTrainer steps packed vs padded (packing=False) on the same examples
    assert len(steps["loss"]) == len(steps["padded_loss"]) == 3 and steps["first_diverging_step"] is None and steps["max_loss_delta"] < 1e-4
    assert result.metrics["gradient_checkpointing"]["max_loss_delta"] < 1e-4  # on vs off, padding-free
    completion = result.metrics["completion_only"]  # prompt-completion pairs: prompts out of the loss
    assert completion["segments_matched"] == 6 and completion["prompt_tokens_in_loss"] == 0
    with leaky_sdpa():
        leaked = S.check_sft(llama_sdpa)
    assert leaked.status == "fail" and "first-batch loss" in leaked.message


def test_packing_content_accounts_for_every_token():
    """TRL's pack_dataset per strategy: bfd drops at most the overflow and starts every segment at an example's
    first token; bfd_split and wrapped lose nothing. Planted: a packer that drops one token per row."""
    pytest.importorskip("trl")
    from pytest_packcheck.checks.packing import CONTENT_PROBES, packing_content

    content = packing_content()
    overflow = sum(max(0, n - seq) for lengths, seq in CONTENT_PROBES.values() for n in lengths)
    assert content["bfd"]["lost"] == content["bfd"]["overflow"] == overflow == 36 and content["bfd"]["tail_starts"] == 0
    assert content["bfd"]["probes"]["tails"]["rows"] == 2  # 13 and 11 into 10: two rows, the tails dropped
    assert content["bfd_split"]["lost"] == 0 and content["bfd_split"]["tail_starts"] > 0 and content["wrapped"]["duplicated"] == 0
    assert all(not v["problems"] for v in content.values())

    from trl.data_utils import pack_dataset

    def lossy(dataset, seq_length, strategy="bfd"):
        packed = pack_dataset(dataset, seq_length, strategy=strategy)
        return packed.map(lambda row: {"input_ids": row["input_ids"][:-1]}, remove_columns=["seq_lengths"] if "seq_lengths" in packed.column_names else None)

    broken = packing_content(pack=lossy)
    assert all(any("tokens lost" in p for p in v["problems"]) for v in broken.values() if v["available"])
    assert [s for s, v in broken.items() if v["available"]] == ["bfd", "bfd_split", "wrapped"]  # no ffd after 0.19


def test_packing_content_catches_truncated_tails_packed_as_examples(llama_sdpa):
    """Planted: bfd that packs the overflow tails as segments of their own (what TRL 0.27 / 0.28 do: 13 and 11
    tokens into rows of 10 give a third row [11, 12, 13 | 111]) -> packing_content fails on bfd with the count."""
    pytest.importorskip("trl")
    from trl.data_utils import pack_dataset

    from pytest_packcheck.checks.packing import packing_content

    def tails_kept(dataset, seq_length, strategy="bfd"):
        return pack_dataset(dataset, seq_length, strategy="bfd_split" if strategy == "bfd" else strategy)

    content = packing_content(pack=tails_kept, strategies=("bfd",))
    tails = content["bfd"]["probes"]["tails"]
    assert tails["rows"] == 3 and tails["tail_starts"] == 2 and tails["lost"] == 0
    assert any("tails probe [13, 11] into 10: 2 segments start inside an example" in p for p in content["bfd"]["problems"])
    result = P.check_packing_content(llama_sdpa)
    assert result.status == "pass" and "bfd: 36 lost (36 overflow)" in result.message, result.message


def test_sft_padding_free_without_packing_and_a_planted_leak(llama_sdpa):
    """SFTTrainer(packing=False, padding_free=True): TRL flattens each batch of six into one row with
    position_ids; on sdpa (transformers >= 4.54 builds the packed mask) the loss matches the per-example
    reference and 3 steps match the padded run. Planted: sdpa that ignores the packed mask -> fail."""
    pytest.importorskip("trl")
    result = S.check_sft_padding_free(llama_sdpa)
    assert result.status == "pass", result.message
    assert result.metrics["effective"]["padding_free"] is True and result.metrics["effective"]["packing"] is False
    assert result.metrics["examples_in_row"] == 6 and "attention_mask" not in result.metrics["keys"]
    assert result.metrics["steps"]["max_loss_delta"] < 1e-4
    assert llama_sdpa.model.config.use_cache is True and llama_sdpa.model.config.eos_token_id == 2  # restored
    with leaky_sdpa():
        leaked = S.check_sft_padding_free(llama_sdpa)
    assert leaked.status == "fail" and "first-batch loss" in leaked.message and "padding-free: 3-step training" in leaked.message


def test_sft_strategies_compare_each_packing_strategy_with_padded(llama_sdpa):
    """Each packing_strategy 3 steps vs padded: bfd and bfd_split keep the boundaries (equal); wrapped joins
    the examples by design (measured, not failed). Planted: a leaking sdpa -> bfd and bfd_split fail."""
    pytest.importorskip("trl")
    result = S.check_sft_strategies(llama_sdpa)
    assert result.status == "pass", result.message
    strategies = result.metrics["strategies"]
    assert strategies["bfd"]["steps"]["max_loss_delta"] < 1e-4 and strategies["bfd_split"]["steps"]["max_loss_delta"] < 1e-4
    assert strategies["wrapped"]["steps"]["max_loss_delta"] > 1e-3 and "by design" in strategies["wrapped"]["by_design"]
    assert "attention_mask" in strategies["wrapped"]["keys"] and "position_ids" in strategies["bfd"]["keys"]
    with leaky_sdpa():
        leaked = S.check_sft_strategies(llama_sdpa)
    assert leaked.status == "fail" and "bfd: 3-step training" in leaked.message and "bfd_split: 3-step" in leaked.message


def test_completion_only_probe_sees_prompt_tokens_in_the_loss(llama_sdpa):
    """Planted: completion_only_loss=False on prompt-completion pairs -> the probe counts prompt tokens whose
    labels were kept (with TRL's default they are all -100)."""
    pytest.importorskip("trl")
    import tempfile

    from pytest_packcheck.checks.sft_probes import _completion_only
    from pytest_packcheck.checks.sft_setup import offline_tokenizer, trl_features

    feats = trl_features()
    base = {"output_dir": tempfile.mkdtemp(), "packing": True, "max_length": 512, "per_device_train_batch_size": 1,
            "report_to": [], "use_cpu": True}
    tokenizer = offline_tokenizer(int(llama_sdpa.config.vocab_size))
    assert _completion_only(llama_sdpa, feats, tokenizer, base)["prompt_tokens_in_loss"] == 0
    planted = _completion_only(llama_sdpa, feats, tokenizer, {**base, "completion_only_loss": False})
    assert planted["segments_matched"] == 6 and planted["prompt_tokens_in_loss"] > 0


def test_a_training_run_leaves_no_trace_on_the_model_or_the_next_trainer(llama_sdpa):
    """A Trainer in bf16 (SFTConfig's default) makes accelerate wrap model.forward in autocast and keep
    mixed_precision in its process-wide state; measured on transformers 4.56.2, a later float32 Trainer's sdpa
    loss moved by 5e-6. train_and_restore undoes both: the model's forward and the packed loss are as before."""
    pytest.importorskip("accelerate")
    import tempfile

    import torch
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    flat = llama_sdpa.collator_factory(return_position_ids=True, position_ids_start=llama_sdpa.start)
    packed = flat([{"input_ids": e} for e in llama_sdpa.examples], return_tensors="pt")
    model = llama_sdpa.model
    model.train()
    with torch.no_grad():
        before = float(model(**packed, use_cache=False).loss)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=1, bf16=True, use_cpu=True, report_to=[], save_strategy="no",
                                 per_device_train_batch_size=3, remove_unused_columns=False, logging_steps=1)
        T.train_and_restore(model, lambda: Trainer(model=model, args=args, train_dataset=[{"input_ids": e} for e in llama_sdpa.examples],
                                                   data_collator=flat))
    assert "forward" not in vars(model) and not AcceleratorState._shared_state
    model.train()
    with torch.no_grad():
        assert float(model(**packed, use_cache=False).loss) == before
    model.eval()


def test_sft_row_contract_checks_cu_seq_lens_and_seq_idx(llama_sdpa):
    """The batch contract on a hand-made padding-free row of examples of 3 and 2 tokens: right as built; a
    cu_seq_lens with an extra boundary, a seq_idx that does not follow the restarts, and an unmasked boundary
    label are each named (planted)."""
    import torch

    from pytest_packcheck.checks.sft_probes import _row_contract

    def row(**over):
        batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
                 "labels": torch.tensor([[-100, 6, 7, -100, 9]]), "cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
                 "seq_idx": torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32)}
        batch.update(over)
        metrics: dict = {}
        problems, starts = _row_contract(llama_sdpa, batch, metrics)
        return problems, starts, metrics

    problems, starts, metrics = row()
    assert problems == [] and starts == [0, 3] and metrics["seq_idx_matches"] is True
    assert "cu_seq_lens_q" in row(cu_seq_lens_q=torch.tensor([0, 2, 3, 5], dtype=torch.int32))[0][0]
    assert "seq_idx disagrees" in row(seq_idx=torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32))[0][0]
    assert "labels not -100 at 1 example starts [3]" in row(labels=torch.tensor([[-100, 6, 7, 8, 9]]))[0][0]


@pytest.mark.parametrize(("poisoned_call", "status", "cause"), [(0, "fail", "non_finite"), (1, "skipped", "reference_unavailable")])
def test_non_finite_gradients_never_pass(llama_sdpa, poisoned_call, status, cause):
    """NaN compares False with every tolerance, so grad_parity passed on grad_rel_err=NaN (gemma3n on the varlen
    reference: its padded flash path gives NaN gradients from the last layer down). Planted: NaN in one tensor's
    gradient of the packed run (call 0: fail, the packed run alone) or of the padded reference (call 1: not
    checked: reference ..., cause reference_unavailable); both name the tensor."""
    import torch

    calls = []
    weight = llama_sdpa.model.lm_head.weight

    def poison(grad):
        calls.append(1)
        return torch.full_like(grad, float("nan")) if len(calls) - 1 == poisoned_call else grad

    handle = weight.register_hook(poison)
    try:
        result = C.check_grad_parity(llama_sdpa)
    finally:
        handle.remove()
    assert result.status == status and result.cause == cause, result.message
    side = "packed" if poisoned_call == 0 else "padded"
    assert result.evidence[f"non_finite_{side}"] == ["lm_head.weight"] and result.evidence[f"tensors_{side}"] == 1


def test_a_pass_on_a_non_finite_number_becomes_an_error():
    """The runner's net under every check: a pass whose key number is NaN or infinite is an error (non_finite)."""
    from pytest_packcheck.results import CheckResult
    from pytest_packcheck.run.runner import _no_pass_on_non_finite

    for value in (float("nan"), float("inf")):
        got = _no_pass_on_non_finite("logits_parity", CheckResult("pass", {"max_abs_diff_solo": value}, "ok"))
        assert got.status == "error" and got.cause == "non_finite" and "max_abs_diff_solo is" in got.message
    fine = CheckResult("pass", {"max_abs_diff_solo": 1e-7}, "ok")
    assert _no_pass_on_non_finite("logits_parity", fine) is fine
    failed = CheckResult("fail", {"max_abs_diff_solo": float("nan")}, "x")
    assert _no_pass_on_non_finite("logits_parity", failed) is failed


def test_reference_kernel_gives_queries_without_keys_zero_output_and_finite_gradients():
    """Bottom-right causal with fewer keys than queries (a KV-shared sliding layer): the first queries see no
    key. flash-attn returns 0 for them; the reference did too, but its softmax over all -inf left NaN in the
    backward pass."""
    import torch

    from pytest_packcheck.backends import varlen_reference_kernel

    q = torch.randn(13, 2, 16, requires_grad=True)
    kv = torch.randn(8, 2, 16, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 13], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    out = varlen_reference_kernel(q, kv, kv, cu_q, cu_k, 13, 8, causal=True)
    assert out[:5].abs().max() == 0 and out[5:].abs().min() > 0  # queries 0-4 precede every key
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all() and q.grad[:5].abs().max() == 0


class _NoLossKwargs(torch.nn.Module):
    """transformers <= 4.46's llama forward (planted): named arguments only, no ``**kwargs``, so
    ``num_items_in_batch`` raises TypeError; its loss is the token mean."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                          use_cache=use_cache)

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


def test_loss_parity_passes_num_items_in_batch_only_where_trainer_would(llama_sdpa):
    """A forward without ``num_items_in_batch`` (transformers <= 4.46's llama: the atlas read TypeError as
    shrunk_crash) is checked with label-token-weighted micro-batch means, named in the evidence; a forward with
    ``**kwargs`` on 5.24 still gets the count (Trainer's model_accepts_loss_kwargs)."""
    stock = C.check_loss_parity(llama_sdpa)
    assert stock.status == "pass" and stock.evidence["ga_normalisation"] == "num_items_in_batch"
    assert "its forward has **kwargs" in stock.evidence["ga_normalisation_rule"]
    llama_sdpa.model = _NoLossKwargs(llama_sdpa.model)
    bare = C.check_loss_parity(llama_sdpa)
    assert bare.status == "pass", bare.message
    assert bare.evidence["ga_normalisation"] == "label_token_weighted_mean" and "no **kwargs" in bare.evidence["ga_normalisation_rule"]
    assert bare.metrics["ga_delta"] < bare.metrics["atol"] and abs(bare.metrics["ga_loss_packed"] - stock.metrics["ga_loss_packed"]) < 1e-5
    # the weighted mean still catches an unmasked boundary label, and the evidence says how it was normalised
    llama_sdpa.collator_factory = collator_label_leak
    leak = C.check_loss_parity(llama_sdpa)
    assert leak.status == "fail" and leak.evidence["ga_normalisation"] == "label_token_weighted_mean"


def test_trainer_num_items_rule_follows_each_release():
    """Trainer.__init__'s model_accepts_loss_kwargs, per release (trainer.py of 4.45.2 .. 5.24.0)."""
    from pytest_packcheck.checks.workbench import trainer_passes_num_items as rule

    class Named(torch.nn.Module):
        def forward(self, input_ids=None, labels=None, num_items_in_batch=None):
            pass

    class LossKwargs(torch.nn.Module):
        def forward(self, input_ids=None, **loss_kwargs):
            pass

    class Kwargs(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs):
            pass

    class RefusesKwargs(Kwargs):
        accepts_loss_kwargs = False

    cases = {("4.45.2", LossKwargs): False, ("4.46.0", LossKwargs): True, ("4.46.3", LossKwargs): True,
             ("4.46.3", Kwargs): False, ("4.47.1", Kwargs): True, ("4.47.1", RefusesKwargs): True,
             ("4.48.0", RefusesKwargs): False, ("5.24.0", RefusesKwargs): False, ("5.24.0", Kwargs): True,
             ("5.24.0", Named): False, ("4.46.3", Named): False, ("4.50.0.dev0", Kwargs): True}
    got = {(v, m): rule(m(), v)[0] for v, m in cases}
    assert got == cases
    assert "before 4.46.0" in rule(Kwargs(), "4.45.2")[1] and "**loss_kwargs" in rule(LossKwargs(), "4.46.3")[1]
