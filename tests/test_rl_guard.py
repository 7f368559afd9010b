"""The guard for RL loops (issue 44): verify_packed_logprobs on packed RL rows with each planted fault, and guard_grpo
inside a real TRL GRPOTrainer run on a tiny model (CPU, generation by transformers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from faults import DropPositionIds

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.guard import PackedBatchMismatch, guard_grpo, verify_packed_logprobs

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[3, 4, 5], [6, 7], [3, 4, 5, 8]]
COMPLETIONS = [[9, 10, 11, 12], [13, 14, 15], [16, 17]]
T = 0.7


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _row(pad_segment: int = 0) -> dict:
    ids, pos, mask, cu = [], [], [], [0]
    for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
        ids += p + c
        pos += list(range(len(p) + len(c)))
        mask += [0] * len(p) + [1] * len(c)
        cu.append(len(ids))
    if pad_segment:  # planted: a collator's trailing padding counted as one more sample
        ids += [0] * pad_segment
        pos += list(range(pad_segment))
        mask += [0] * pad_segment
        cu.append(len(ids))
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "completion_mask": torch.tensor([mask]),
            "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32)}


def _trainer_logprobs(model, batch, temperature=T, roll=0):
    """What a correct trainer computes (each sample's labels shifted within it), or with its labels rolled by ``roll``
    positions over the whole row (a planted fault)."""
    ids = batch["input_ids"][0]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    out = torch.full((ids.numel(),), float("nan"), dtype=torch.float64)
    out[1:] = lp[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.roll(out, roll)[None] if roll else out[None]


def test_a_correct_row_and_correct_trainer_logprobs_pass(model):
    batch = _row()
    result = verify_packed_logprobs(model, batch, _trainer_logprobs(model, batch), temperature=T)
    assert result.verdict == "pass", result.line()
    assert result.max_packed_diff < 1e-5 and result.max_trainer_diff < 1e-5
    assert result.segments == [7, 5, 6] and result.completion_tokens == 9 and result.forwards == 4
    assert result.versions.get("torch") and "PASS on 3 packed samples" in result.line()


@pytest.mark.parametrize("roll", [1, -1], ids=["labels-rolled-across-a-boundary", "logits_to_keep-off-by-one"])
def test_a_shifted_gather_is_label_shift(model, roll):
    batch = _row()
    result = verify_packed_logprobs(model, batch, _trainer_logprobs(model, batch, roll=roll), temperature=T)
    assert result.verdict == "fail" and result.cause == "label_shift", result.line()
    assert result.evidence["shift"] == roll and "within each sample" in result.remedy


def test_a_temperature_on_one_path_is_named_with_the_temperature_that_fits(model):
    batch = _row()
    result = verify_packed_logprobs(model, batch, _trainer_logprobs(model, batch, temperature=1.0), temperature=T)
    assert result.cause == "temperature_mismatch" and result.evidence["matches_temperature"] == 1.0, result.line()


def test_a_padding_segment_inside_cu_seq_lens_breaks_the_contract(model):
    batch = _row(pad_segment=4)
    result = verify_packed_logprobs(model, batch, temperature=T)
    assert result.cause == "collator_contract" and "only padding tokens" in result.evidence["why"], result.line()


def test_a_leaking_packed_row_is_a_leak(model):
    batch = _row()
    result = verify_packed_logprobs(DropPositionIds(model), batch, temperature=T)  # no packed mask reaches sdpa
    assert result.cause == "leak" and result.max_packed_diff > 1e-2, result.line()
    with pytest.raises(PackedBatchMismatch, match="cause leak"):
        verify_packed_logprobs(DropPositionIds(model), batch, temperature=T, on_mismatch="raise")


def test_per_sample_and_per_token_means_swapped_are_loss_normalisation(model):
    batch = _row()
    per_token = torch.rand(1, batch["input_ids"].shape[1]) * batch["completion_mask"]
    mask = batch["completion_mask"][0].bool()
    token_mean = float(per_token[0][mask].mean())
    ok = verify_packed_logprobs(model, batch, per_token_loss=per_token, loss=token_mean, loss_type="token_mean", temperature=T)
    assert ok.verdict == "pass" and abs(ok.loss_expected - token_mean) < 1e-6  # float32 mean vs float64 sum
    swapped = verify_packed_logprobs(model, batch, per_token_loss=per_token, loss=token_mean, loss_type="sequence_mean",
                                     temperature=T)
    assert swapped.cause == "loss_normalisation" and swapped.evidence["matches"] == "token_mean", swapped.line()


@pytest.mark.parametrize(("change", "needle"), [
    (lambda b: b.pop("completion_mask"), "neither 'completion_mask' nor 'labels'"),
    (lambda b: (b.pop("position_ids"), b.pop("cu_seq_lens_q")), "neither position_ids nor cu_seq_lens_q"),
    (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 7, 12], dtype=torch.int32)), "does not run from 0 up to the row's 18"),
    (lambda b: b.update(input_ids=b["input_ids"].repeat(2, 1)), "has shape (2, 18)"),
    (lambda b: b["completion_mask"].__setitem__((0, 0), 1), "scores the first token of 1 sample"),
])
def test_bad_batches_are_one_line_errors_naming_the_key(model, change, needle):
    batch = _row()
    change(batch)
    with pytest.raises(PackcheckUsageError, match="verify_packed_logprobs: ") as err:
        verify_packed_logprobs(model, batch)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _grpo(tmp_path, temperature=0.7):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "examples"))
    try:
        from guard_trainer import TEXTS, build_tokenizer
    finally:
        sys.path.remove(str(REPO / "examples"))
    torch.manual_seed(0)
    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    data = Dataset.from_dict({"prompt": [t.rsplit(" ", 3)[0] for t in TEXTS]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                      max_steps=1, use_cpu=True, bf16=False, report_to=[], temperature=temperature, save_strategy="no")
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                       train_dataset=data, processing_class=tok)


def test_the_guard_passes_inside_a_real_grpo_run(tmp_path):
    trainer = _grpo(tmp_path)
    guard = guard_grpo(trainer)
    trainer.train()
    assert guard.result is not None and guard.result.verdict == "pass", guard.result
    assert guard.result.completion_tokens > 0 and guard.result.temperature == pytest.approx(0.7)


def test_the_guard_stops_a_grpo_run_whose_training_path_drops_the_temperature(tmp_path, monkeypatch):
    """Planted: the trainer's fused LM head is added without the sampling temperature (one path only)."""
    pytest.importorskip("trl")
    from trl.trainer import grpo_trainer

    original = grpo_trainer.add_fused_lm_head
    monkeypatch.setattr(grpo_trainer, "add_fused_lm_head", lambda model, temperature=1.0, **kw: original(model, temperature=1.0, **kw))
    trainer = _grpo(tmp_path)
    guard_grpo(trainer)
    with pytest.raises(PackedBatchMismatch, match="cause temperature_mismatch"):
        trainer.train()
