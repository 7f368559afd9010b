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


def _grpo(tmp_path, temperature=0.7, arch="llama"):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
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
    if arch == "gpt2":  # learned absolute positions
        model = GPT2LMHeadModel._from_config(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                                        bos_token_id=tok.eos_token_id), attn_implementation="sdpa")
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


# ----------------------------------------------------------------------------------------------------------------
# trial 3 of the RL guard: what passed silently, what was misnamed, what raised from deep inside


def test_a_nan_loss_or_per_token_loss_is_never_a_pass(model):
    batch = _row()
    per_token = torch.rand(1, 18) * batch["completion_mask"]
    for loss, ptl in ((float("nan"), per_token), (0.5, per_token.masked_fill(batch["completion_mask"].bool(), float("nan")))):
        result = verify_packed_logprobs(model, batch, per_token_loss=ptl, loss=loss, loss_type="token_mean", temperature=T)
        assert result.verdict == "fail" and result.cause == "non_finite", result.line()


def test_a_row_that_scores_nothing_is_skipped_not_passed(model):
    batch = _row()
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    result = verify_packed_logprobs(model, batch, torch.full((1, 18), 5.0), temperature=T)
    assert result.verdict == "skipped" and result.completion_tokens == 0 and "nothing was compared" in result.evidence["why"]


@pytest.mark.parametrize("temperature", [0, -0.7, float("nan"), float("inf"), "0.7", None, True])
def test_a_temperature_that_is_not_a_positive_number_is_refused(model, temperature):
    with pytest.raises(PackcheckUsageError, match=r"temperature=.*finite number above 0"):
        verify_packed_logprobs(model, _row(), temperature=temperature)


def test_a_low_temperature_widens_the_tolerance_by_its_inverse(model):
    """Trial 3: at temperature 1e-4 a correct model failed as a leak (4.5e-04 > 1e-04): a log-prob divides the logits'
    own noise by the temperature."""
    result = verify_packed_logprobs(model, _row(), temperature=1e-4)
    assert result.verdict == "pass", result.line()
    assert result.tolerance["logprob_atol"] == pytest.approx(result.tolerance["logits_atol"] * 1e4)


def test_a_pass_says_nothing_and_return_never_warns(model):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest's filterwarnings=error: a pass must not raise
        assert verify_packed_logprobs(model, _row(), temperature=T).verdict == "pass"
        batch = _row()
        assert verify_packed_logprobs(model, batch, _trainer_logprobs(model, batch, roll=1), temperature=T).verdict == "fail"


def test_shifted_positions_on_learned_positions_are_wrong_positions(tolerances):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    batch = _row()
    batch.pop("cu_seq_lens_q")
    batch["position_ids"] = batch["position_ids"] + 3  # planted: every sample starts at 3
    result = verify_packed_logprobs(gpt2, batch, temperature=T)
    assert result.cause == "wrong_positions", result.line()


def test_a_cu_seq_lens_boundary_inside_a_completion_is_the_contract_not_the_mask(model):
    batch = _row()
    batch["cu_seq_lens_q"] = torch.tensor([0, 5, 12, 18], dtype=torch.int32)  # 5 is inside the first completion
    result = verify_packed_logprobs(model, batch, temperature=T)
    assert result.cause == "collator_contract" and "not where position_ids restart" in result.evidence["why"], result.line()


@pytest.mark.parametrize(("change", "needle"), [
    (lambda b: b.update(input_ids=b["input_ids"].float()), "has dtype torch.float32"),
    (lambda b: b["input_ids"].__setitem__((0, 3), 999), "outside the model's vocabulary"),
    (lambda b: b.update(input_ids=b["input_ids"][:, :0], position_ids=b["position_ids"][:, :0],
                        completion_mask=b["completion_mask"][:, :0], cu_seq_lens_q=torch.tensor([0], dtype=torch.int32)),
     "empty row"),
])
def test_more_bad_batches_are_one_line_errors(model, change, needle):
    batch = _row()
    change(batch)
    with pytest.raises(PackcheckUsageError, match="verify_packed_logprobs: ") as err:
        verify_packed_logprobs(model, batch)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"logprobs": "abc"}, "logprobs is a str"),
    ({"logprobs": {}}, "logprobs is a dict"),
    ({"per_token_loss": torch.zeros(1, 18), "loss": torch.tensor([1.0, 2.0]), "loss_type": "token_mean"}, "loss has 2 values"),
    ({"per_token_loss": torch.zeros(1, 18), "loss": "abc", "loss_type": "token_mean"}, "loss is a str"),
    ({"loss_type": "bogus"}, "loss_type='bogus'"),
    ({"loss_type": "token_mean"}, "go together"),
])
def test_bad_values_are_one_line_errors(model, kwargs, needle):
    with pytest.raises(PackcheckUsageError, match="verify_packed_logprobs: ") as err:
        verify_packed_logprobs(model, _row(), **kwargs)
    assert needle in str(err.value)


def test_not_a_model_or_not_a_batch_is_refused(model):
    with pytest.raises(PackcheckUsageError, match="model is a NoneType"):
        verify_packed_logprobs(None, _row())
    with pytest.raises(PackcheckUsageError, match="batch is a NoneType"):
        verify_packed_logprobs(model, None)
    assert verify_packed_logprobs(model, _row(), [[float(x) for x in _trainer_logprobs(model, _row())[0]]],
                                  temperature=T).verdict == "pass"  # a list of lists is taken as a tensor is


def test_guard_grpo_refuses_a_non_trainer_and_a_bad_policy_at_the_call(tmp_path):
    with pytest.raises(PackcheckUsageError, match="has no _get_per_token_logps_and_entropies"):
        guard_grpo(None)
    with pytest.raises(PackcheckUsageError, match="on_mismatch='bogus'"):
        guard_grpo(object(), on_mismatch="bogus")


def test_guard_grpo_names_padded_positions_on_gpt2(tmp_path):
    """Trial 3: GRPO on gpt2 (learned positions, a left-padded batch without position_ids) was packed_mismatch with a
    remedy to rerun packcheck; it is what the RL audit calls padded_positions."""
    trainer = _grpo(tmp_path, arch="gpt2")
    guard = guard_grpo(trainer, on_mismatch="return")
    trainer.train()
    assert guard.result.cause == "padded_positions", guard.result.line()
    assert "position_ids" in guard.result.remedy


def test_a_model_whose_forward_raises_is_a_crash_verdict_with_the_secret_scrubbed(model, monkeypatch):
    # hostile trial 4: the model's exception came through verify_packed_logprobs raw, a token in its message unscrubbed
    monkeypatch.setenv("HF_TOKEN", "hf_PlantedSecretValue123456")

    def raising(*args, **kwargs):
        raise RuntimeError("backend rejected token hf_PlantedSecretValue123456 on this row")

    monkeypatch.setattr(model, "forward", raising)
    result = verify_packed_logprobs(model, _row(), temperature=T)
    assert (result.verdict, result.cause, result.max_packed_diff) == ("fail", "crash", None)
    assert "a sample run alone raised RuntimeError: backend rejected token" in result.line()
    assert "hf_PlantedSecretValue123456" not in result.line() and "hf_Planted" not in str(result.evidence)
    with pytest.raises(PackedBatchMismatch):
        verify_packed_logprobs(model, _row(), temperature=T, on_mismatch="raise")
