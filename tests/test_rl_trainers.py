"""The preference trainers' and RL trainers' own code (issue 44, part 2): each check passes on the correct stack and
catches its planted fault; a trainer whose code does not import is a skip naming the package, never a pass."""

from __future__ import annotations

import math

import pytest
from conftest import make_bench
from faults import collator_no_reset

from pytest_packcheck.checks import rl_trainers as T

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def llama(tolerances):
    return make_bench("llama", "sdpa", tolerances)


def _roll_completion_mask(cls, monkeypatch):
    """Planted: the collator's completion_mask one position early (the last prompt token scored, the last completion
    token dropped), as a label shift across the prompt / completion boundary does."""
    import torch

    original = cls.torch_call

    def shifted(self, examples):
        out = original(self, examples)
        out["completion_mask"] = torch.roll(out["completion_mask"], -1, dims=1)
        return out

    monkeypatch.setattr(cls, "torch_call", shifted)


def test_pairs_share_a_prompt_and_differ():
    wb = type("Wb", (), {"examples": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], "config": type("C", (), {"vocab_size": 11})()})
    pairs = T.preference_pairs(wb())
    assert len(pairs) == 2 and all(c.prompt == r.prompt and c.completion != r.completion for c, r in pairs)
    assert pairs[1][1].completion == (10, 0)  # shifted by one mod the vocabulary


def test_trl_dpo_passes_and_catches_a_shifted_completion_mask(llama, monkeypatch):
    result = T.check_rl_trl_dpo(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - math.log(2)) < 1e-5 and result.metrics["max_abs_margin_diff"] < 1e-4
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    _roll_completion_mask(DataCollatorForPreference, monkeypatch)
    result = T.check_rl_trl_dpo(llama)
    assert result.status == "fail" and result.cause == "packed_mismatch", result.message
    assert result.metrics["max_abs_seq_logprob_diff"] > 1e-1


def test_trl_kto_passes_and_catches_a_shifted_completion_mask(llama, monkeypatch):
    result = T.check_rl_trl_kto(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - 0.5) < 1e-5
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    _roll_completion_mask(DataCollatorForUnpairedPreference, monkeypatch)
    result = T.check_rl_trl_kto(llama)
    assert result.status == "fail" and result.cause == "packed_mismatch", result.message


def test_packed_preference_row_passes_and_catches_a_spurious_padding_segment(llama, monkeypatch):
    """Planted: the collator pads the row's front and counts the padding as a segment of cu_seq_lens_q (the public DPO
    collator bug): every sequence is read off its neighbour's segment and the initial loss is far from ln 2."""
    import torch

    result = T.check_rl_preference_packed(llama)
    assert result.status == "pass", result.message
    original = T.preference_row

    def padded_segment(wb, pairs):
        row = original(wb, pairs)
        pad = 3
        row["input_ids"] = torch.cat([torch.full((1, pad), wb.pad_id), row["input_ids"]], dim=1)
        row["position_ids"] = torch.cat([torch.arange(pad)[None], row["position_ids"]], dim=1)
        row["labels"] = torch.cat([torch.full((1, pad), -100), row["labels"]], dim=1)
        cu = row["cu_seq_lens_q"]
        row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = torch.cat([cu[:1], cu + pad]).to(cu.dtype)
        return row

    monkeypatch.setattr(T, "preference_row", padded_segment)
    result = T.check_rl_preference_packed(llama)
    assert result.status == "fail" and result.cause == "collator_contract", result.message
    assert result.metrics["segments"] == result.metrics["expected_segments"] + 1
    assert result.metrics["max_abs_margin_diff"] > 1.0 and abs(result.metrics["initial_loss"] - math.log(2)) > 1e-2


def test_packed_preference_row_catches_row_wide_mean_normalisation(llama, monkeypatch):
    """Planted: the per-sequence mean divides by the row's completion tokens (packed) instead of each sequence's
    (per sample): the sums stay right, so only the length-normalised reductions (sigmoid_norm, IPO) are off."""
    original = T.reduce_packed

    def row_mean(logits, batch):
        sums, _ = original(logits, batch)
        cu = batch["cu_seq_lens_q"].tolist()
        total = sum(cu[i + 1] - cu[i] - p for i, p in enumerate(batch["prompt_lengths"]))
        return sums, [s / total for s in sums]

    monkeypatch.setattr(T, "reduce_packed", row_mean)
    result = T.check_rl_preference_packed(llama)
    assert result.status == "fail" and result.cause == "loss_normalisation", result.message
    assert result.metrics["max_abs_seq_logprob_diff"] < 1e-4 < result.metrics["max_abs_mean_logprob_diff"]


def test_packed_preference_row_catches_a_leak(tolerances):
    leaky = make_bench("llama", "sdpa", tolerances, collator_factory=collator_no_reset)
    result = T.check_rl_preference_packed(leaky)
    assert result.status == "fail" and result.cause == "leak", result.message


def test_verl_remove_padding_path_passes_and_catches_positions_over_the_row(llama, monkeypatch):
    """verl's own unpad / roll / gather / pad-back on its rollout batch. Planted: position_ids counted on over the
    whole batch (never restarting per sample), so the unpadded row reads as one sequence and the samples attend to
    each other."""
    try:
        T.import_without_package_init("verl", "verl.utils.attention_utils")
        T.import_without_package_init("verl", "verl.utils.torch_functional")
        import einops  # noqa: F401 - verl's rearrange without flash-attn
    except ImportError as exc:
        result = T.check_rl_verl_rmpad(llama)
        assert result.status == "skipped" and "needs" in result.message, result.message
        pytest.skip(f"verl's remove-padding modules do not import here: {exc}")
    result = T.check_rl_verl_rmpad(llama)
    assert result.status == "pass", result.message
    assert result.metrics["verl"] != "not installed"
    original = T.verl_batch

    def columns(samples, pad_id, device="cpu"):
        batch, width = original(samples, pad_id, device)
        mask = batch["attention_mask"]
        batch["position_ids"] = (mask.flatten().cumsum(0) - 1).clamp(min=0).view_as(mask)
        return batch, width

    monkeypatch.setattr(T, "verl_batch", columns)
    result = T.check_rl_verl_rmpad(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_a_trainer_that_does_not_import_is_a_skip_naming_the_package(llama, monkeypatch):
    """Never a silent pass: a missing module is named (the distribution or the module its path needs), and a module
    that imports but is not driven is still a skip."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    for package in ("swift", "openrlhf", "verl"):
        monkeypatch.delitem(sys.modules, package, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("swift", "openrlhf", "verl") else real(name, *a))
    for check, needs in ((T.check_rl_swift_padding_free, "'swift'"), (T.check_rl_openrlhf_packed, "'openrlhf'"),
                         (T.check_rl_verl_rmpad, "'verl'")):
        result = check(llama)
        assert result.status == "skipped" and needs in result.message, result.message


def _openrlhf():
    pytest.importorskip("einops", reason="flash_attn.bert_padding's stand-in imports einops")
    try:
        return T.import_openrlhf_actor()
    except ImportError as exc:
        pytest.skip(f"openrlhf's Actor does not import here: {exc}")


def test_openrlhf_packed_samples_pass_with_named_stand_ins_and_catch_the_cache_left_on(llama, monkeypatch):
    """OpenRLHF's own Actor.forward(packing_samples=True) on its rollout layout: right with Actor.__init__'s
    use_cache=False; planted, the cache left on (a model handed to forward without Actor.__init__): transformers then
    does not read the packed row from position_ids and the samples attend each other."""
    _, stand_ins = _openrlhf()
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["openrlhf"] == "0.11.2"
    if stand_ins:  # flash_attn not installed: the cell names what stood in for it
        assert "from flash_attn 2.8.3's source" in result.message and "deepspeed stubbed" in result.message
        assert result.metrics["stand_ins"] == stand_ins
    monkeypatch.setattr(T, "OPENRLHF_USE_CACHE", True)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_openrlhf_positions_counted_over_the_row_are_caught(llama, monkeypatch):
    """Planted in OpenRLHF's own unpad_and_slice_tensor: position_ids counted on over the packed row (not restarting
    per sample), so transformers sees one sequence."""
    import torch

    actor, _ = _openrlhf()
    original = actor.unpad_and_slice_tensor

    def over_the_row(sequences, attention_mask, group):
        seqs, _pos, rolled, pad, indices = original(sequences, attention_mask, group)
        return seqs, torch.arange(seqs.shape[1], device=seqs.device)[None], rolled, pad, indices

    monkeypatch.setattr(actor, "unpad_and_slice_tensor", over_the_row)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_the_flash_attn_stand_in_is_flash_attns_own_source_and_leaves_nothing_behind(monkeypatch):
    import sys

    from pytest_packcheck.checks import stand_ins

    pytest.importorskip("einops")
    if stand_ins.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed: nothing stands in")
    with stand_ins.flash_attn_stand_in() as named:
        from flash_attn.bert_padding import pad_input, unpad_input

        assert "flash_attn 2.8.3's source" in named and callable(pad_input) and callable(unpad_input)
    assert "flash_attn" not in sys.modules and "flash_attn.bert_padding" not in sys.modules
    # a file that is not flash-attn's is refused, naming the tag to restore it from
    monkeypatch.setitem(stand_ins.FLASH_ATTN_FILES, "flash_attn.bert_padding",
                        (stand_ins.FLASH_ATTN_FILES["flash_attn.bert_padding"][0], "0" * 64))
    with pytest.raises(ValueError, match="v2.8.3"), stand_ins.flash_attn_stand_in():
        pass
    with stand_ins.stub_module("packcheck_no_such_package", "a test") as named:
        import packcheck_no_such_package as stub

        assert named == "packcheck_no_such_package stubbed: a test"
        with pytest.raises(ModuleNotFoundError, match="packcheck_no_such_package"):
            stub.anything  # noqa: B018
    assert "packcheck_no_such_package" not in sys.modules


def _swift(monkeypatch):
    """ms-swift's DPO module. ms-swift 4.6.0 declares trl<1.0: on trl 1.16 its import of RunningMoments (bco_pair's,
    dpo_trainer.py:20-23, never used by concatenated_forward) fails, so the test hands trl.trainer.utils one (a
    test-only stand-in; the check itself skips there, naming the module and ms-swift's declared requirements)."""
    from trl.trainer import utils

    try:
        import importlib.util

        if importlib.util.find_spec("swift") is None:
            pytest.skip("ms-swift is not installed")
    except ValueError:
        pass
    monkeypatch.setattr(utils, "RunningMoments", type("RunningMoments", (), {}), raising=False)
    try:
        return T.import_swift_dpo()
    except ImportError as exc:
        pytest.skip(f"ms-swift's DPO module does not import here: {exc}")


def test_swift_on_trl_1_is_a_skip_naming_the_module_and_its_declared_requirements(llama, monkeypatch):
    import importlib.util
    import sys

    if importlib.util.find_spec("swift") is None:
        pytest.skip("ms-swift is not installed")
    monkeypatch.delitem(sys.modules, "swift.rlhf_trainers.dpo_trainer", raising=False)
    monkeypatch.delitem(T._STAND_INS, "ms-swift", raising=False)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "skipped" and "trl.experimental.bco" in result.message, result.message
    assert "ms-swift declares" in result.message and "trl<1.0" in result.message


def test_swift_padding_free_dpo_passes_and_catches_a_boundary_inside_a_completion(llama, monkeypatch):
    """ms-swift's own concatenated_forward on its padding-free row: right; planted, a position_ids restart inside the
    first chosen completion (a spurious segment in get_cu_seqlens): every later sequence's sum is read off its
    neighbour's tokens, and the margin and the loss move."""
    _, stand_ins = _swift(monkeypatch)
    monkeypatch.delitem(T._STAND_INS, "ms-swift", raising=False)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - T.LN2) < 1e-4 and result.metrics["max_abs_margin_diff"] < 1e-4
    if stand_ins:
        assert "modelscope stubbed" in result.message
    original = T.swift_padding_free_row

    def spurious(pairs, device="cpu"):
        batch = original(pairs, device)
        pos = batch["position_ids"].clone()
        first = len(pairs[0][0].prompt) + 1  # inside the first completion
        pos[0, first:len(pairs[0][0].tokens)] = pos[0, first:len(pairs[0][0].tokens)] - pos[0, first]
        batch["position_ids"] = pos
        return batch

    monkeypatch.setattr(T, "swift_padding_free_row", spurious)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "fail" and result.metrics["max_abs_seq_logprob_diff"] > 1e-2, result.message


def test_swift_labels_rolled_twice_are_caught(llama, monkeypatch):
    """Planted: labels pre-shifted by the collator and rolled again by concatenated_forward (off by one token)."""
    import torch

    _swift(monkeypatch)
    original = T.swift_padding_free_row

    def shifted(pairs, device="cpu"):
        batch = original(pairs, device)
        batch["labels"] = torch.roll(batch["labels"], shifts=-1, dims=1)
        return batch

    monkeypatch.setattr(T, "swift_padding_free_row", shifted)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "fail" and result.metrics["max_abs_seq_logprob_diff"] > 1e-2, result.message
