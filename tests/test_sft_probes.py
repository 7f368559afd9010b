"""The SFT / Trainer probes of issue 16: every probe runs and reports on its own, the padded side has a verdict
of its own, and the first-batch loss is the trainer's own. Planted faults in this environment prove each branch;
the real version cases (tests marked ``slow``) run with PACKCHECK_RUN_SLOW=1."""

from __future__ import annotations

import contextlib
from importlib import metadata

import pytest

from pytest_packcheck.checks import sft as S
from pytest_packcheck.checks import training as T
from pytest_packcheck.results.schema import read_results

pytest.importorskip("trl")

_BOUNDARY_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@contextlib.contextmanager
def trl_collator(drop_boundaries: bool = False, drop_completion_mask: bool = False):
    """TRL's collator with planted faults: ``drop_boundaries``, the packed row leaves with no position_ids (nor
    cu_seq_lens) and an all-ones attention_mask (what TRL 0.20-0.23 send to non-flash backends);
    ``drop_completion_mask``, the examples lose their completion_mask before collating (what TRL 0.19's packer
    does; TRL 1.x folds it into ``labels`` first, so those become the input_ids), so prompt tokens keep their
    labels."""
    from trl.trainer import sft_trainer

    cls = sft_trainer.DataCollatorForLanguageModeling
    real = cls.torch_call

    def planted(self, examples):
        if drop_completion_mask:  # TRL 1.x folds the mask into a labels column before collating: drop both
            examples = [{**{k: v for k, v in e.items() if k not in ("completion_mask", "labels")},
                         **({"labels": list(e["input_ids"])} if "labels" in e else {})} for e in examples]
        out = real(self, examples)
        if drop_boundaries and out["input_ids"].shape[0] == 1:
            for key in _BOUNDARY_KEYS:
                out.pop(key, None)
            import torch

            out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    cls.torch_call = planted
    try:
        yield
    finally:
        cls.torch_call = real


def _probes(result):
    return {n: (p["status"], p["cause"]) for n, p in result.metrics["probes"].items()}


def test_every_sft_probe_runs_when_the_row_has_no_boundaries_and_prompts_are_trained(llama_sdpa):
    """Planted, as TRL 0.19.1 on sdpa: no position_ids, an all-ones mask, and the completion mask dropped. The
    contract fails, and still the first-batch loss (split at the known examples), the 3 steps and the
    completion-only probe each report their number; the cell's cause is the most specific, completion_mask,
    with mask_override as its second cause. With the completion mask kept (TRL 0.20.0), the same row fails on
    mask_override alone: two faults that looked identical are told apart."""
    with trl_collator(drop_boundaries=True, drop_completion_mask=True):
        both = S.check_sft(llama_sdpa)
    probes = _probes(both)
    assert both.status == "fail" and both.cause == "completion_mask", both.message
    assert probes["row_contract"] == ("fail", "mask_override")
    assert probes["first_batch_loss"] == ("fail", "mask_override") and both.metrics["loss_delta"] > 1e-3
    assert both.metrics["first_batch_boundaries"].startswith("the known examples")
    assert probes["steps"] == ("fail", "mask_override") and both.metrics["steps"]["first_diverging_step"] == 1
    assert probes["completion_only"] == ("fail", "completion_mask")
    assert both.metrics["completion_only"]["segments_matched"] == 6 and both.metrics["completion_only"]["prompt_tokens_in_loss"] > 6
    assert [c["cause"] for c in both.causes] == ["completion_mask", "mask_override"] and not both.findings
    assert both.causes[1]["evidence"]["probe"] == "row_contract"  # each cause with the probe that measured it
    assert "first-batch loss" in both.message and "prompt tokens keep their labels" in both.message

    with trl_collator(drop_boundaries=True):
        contract_only = S.check_sft(llama_sdpa)
    assert contract_only.status == "fail" and contract_only.cause == "mask_override", contract_only.message
    assert _probes(contract_only)["completion_only"] == ("pass", None)
    assert contract_only.metrics["completion_only"]["segments_matched"] == 6
    assert contract_only.metrics["loss_delta"] > 1e-3


def test_a_dropped_completion_mask_fails_on_its_own_cause(llama_sdpa):
    """Planted: only the completion mask dropped; the row keeps its boundaries, so the contract and the loss
    probes pass and the cell fails on completion_mask alone (remedy: TRL >= 0.20)."""
    from pytest_packcheck.analysis.diagnose import remedy

    with trl_collator(drop_completion_mask=True):
        result = S.check_sft(llama_sdpa)
    probes = _probes(result)
    assert result.status == "fail" and result.cause == "completion_mask" and not result.findings, result.message
    assert probes["row_contract"] == ("pass", None) and probes["first_batch_loss"] == ("pass", None)
    assert probes["steps"] == ("pass", None) and probes["gradient_checkpointing"] == ("pass", None)
    # the upgrade is the known fault's (trl-packing-drops-completion-mask, its window), never the cause's own
    assert "0.20" in remedy("completion_mask", {"backend": "sdpa", "check": "sft"}, {"trl": "0.19.1"})
    assert "0.20" not in remedy("completion_mask", {"backend": "sdpa", "check": "sft"}, {"trl": "1.16.0"})


def test_sft_padding_free_reports_each_probe_on_a_row_without_boundaries(llama_sdpa):
    """SFTTrainer(packing=False, padding_free=True), planted row without boundaries: contract, first-batch loss
    (split at the known examples) and steps each fail with their numbers."""
    with trl_collator(drop_boundaries=True):
        result = S.check_sft_padding_free(llama_sdpa)
    assert result.status == "fail" and result.cause == "mask_override", result.message
    # the labels at the example starts are checked there too, at the starts the examples' token ids give (issue 41)
    assert {n: s for n, (s, _) in _probes(result).items() if not n.startswith("gradient_checkpointing:")} == {
        "row_contract": "fail", "boundary_labels": "pass", "first_batch_loss": "fail", "steps": "fail"}
    assert result.metrics["loss_delta"] > 1e-3 and "padding-free: 3-step training" in result.message


def test_completion_only_labels_through_padding_free_with_gradient_checkpointing(llama_sdpa):
    """SFTTrainer(packing=False, padding_free=True, gradient_checkpointing=True) on prompt-completion pairs: the
    prompts are out of the loss and the trainer's first loss (recomputed in backward) = each example alone. Planted,
    as TRL 0.19.1's packer: the completion mask dropped before collating, so the prompts keep their labels."""
    result = S.check_sft_padding_free(llama_sdpa)
    probes = _probes(result)
    assert probes["gradient_checkpointing:completion_only"] == ("pass", None), result.metrics["probes"]
    assert probes["gradient_checkpointing:first_batch_loss"] == ("pass", None), result.metrics["probes"]
    numbers = result.metrics["completion_checkpointing"]
    assert numbers["segments_matched"] == len(S.SENTENCES) and numbers["loss_delta"] < llama_sdpa.tol["loss_atol"]
    with trl_collator(drop_completion_mask=True):
        planted = S.check_sft_padding_free(llama_sdpa)
    assert _probes(planted)["gradient_checkpointing:completion_only"] == ("fail", "completion_mask"), planted.message
    assert planted.status == "fail" and planted.cause == "completion_mask"
    assert planted.metrics["completion_checkpointing"]["prompt_tokens_in_loss"] > 0


def test_first_batch_loss_is_the_trainers_own(llama_sdpa, monkeypatch):
    """Planted, as transformers 4.57.1 + TRL 0.24: the trainer leaves config.use_cache=True on the model while
    its compute_loss passes use_cache=False. The first-batch loss is the one the trainer computed (use_cache
    False, as in training) and matches each example alone; a forward with the config's use_cache (what packcheck
    measured before) differs from it: the false failure this removes."""
    import torch

    real = S._Sft.trainer

    def keeps_cache(self, *args, **kwargs):
        trainer = real(self, *args, **kwargs)
        self.wb.model.config.use_cache = True
        return trainer

    monkeypatch.setattr(S._Sft, "trainer", keeps_cache)
    result = S.check_sft(llama_sdpa)
    assert result.status == "pass", result.message
    assert result.metrics["effective"]["use_cache"] is True and result.metrics["first_batch_use_cache"] is False
    assert result.metrics["loss_delta"] < llama_sdpa.tol["loss_atol"]
    # the old measurement: the trainer's first batch, forwarded with the config's use_cache
    trainer = S._run_sft_check(llama_sdpa, lambda sft: sft.trainer())
    batch = next(iter(trainer.get_train_dataloader()))
    model = llama_sdpa.model
    model.config.use_cache = True
    model.train()
    with torch.no_grad():
        with_cache = float(model(**{k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}).loss)
    model.eval()
    assert abs(with_cache - result.metrics["loss_packed"]) > llama_sdpa.tol["loss_atol"]


@contextlib.contextmanager
def unshifted_count():
    """Planted: Trainer counts num_items_in_batch before the causal shift (as transformers did up to 5.9)."""
    from transformers import Trainer

    real = Trainer._get_num_items_in_batch

    def before_shift(self, batch_samples, device):
        return sum(b["labels"].ne(-100).sum() for b in batch_samples).to(device)

    Trainer._get_num_items_in_batch = before_shift
    try:
        yield
    finally:
        Trainer._get_num_items_in_batch = real


def test_the_padded_side_has_a_verdict_of_its_own(llama_sdpa):
    """Planted: the unshifted label count. Trainer's and SFTTrainer's own padded runs fail with
    padded_normalisation (loss x shifted/unshifted: 28/31 for the Trainer's three examples), while the packed
    Trainer run, measured against the hand-written reference, still passes: the verdict says which side is
    wrong. Without the plant both padded runs pass."""
    pytest.importorskip("accelerate")
    assert T.check_trainer_padded(llama_sdpa).status == "pass"
    llama_sdpa._cache.clear()  # the padded runs are cached per model: measure them again under the plant
    with unshifted_count():
        padded = T.check_trainer_padded(llama_sdpa)
        sft_padded = S.check_sft_padded(llama_sdpa)
    assert padded.status == "fail" and padded.cause == "padded_normalisation", padded.message
    assert abs(padded.metrics["loss_ratio"] - 28 / 31) < 1e-3 and "x0.9032" in padded.message
    assert sft_padded.status == "fail" and sft_padded.cause == "padded_normalisation", sft_padded.message
    ratio = sft_padded.metrics["label_tokens_shifted_over_unshifted"]
    assert ratio < 1 and abs(sft_padded.metrics["loss_ratio"] - ratio) < 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Real versions (the package index is reachable; torch is never downloaded)


@pytest.fixture(scope="module")
def version_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("packcheck-cache")


def _audit(pytester, monkeypatch, cache, versions: list[str], models: str, checks: str) -> dict:
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(cache))
    torch_before = metadata.distribution("torch").version
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--packcheck-models={models}", "--packcheck-attn=sdpa",
                                  f"--packcheck-checks={checks}", *[f"--packcheck-versions={v}" for v in versions],
                                  f"--packcheck-report-dir={pytester.path / 'out'}")
    assert metadata.distribution("torch").version == torch_before
    doc = read_results(pytester.path / "out" / "packcheck-matrix.json")
    return {c["cell_id"]: c for c in doc["cells"]}


@pytest.mark.slow
def test_real_trl_0_19_1_trains_prompts_and_0_20_0_does_not(pytester, monkeypatch, version_cache):
    """tiny llama, sdpa, packing=True, prompt-completion pairs: TRL 0.19.1's packer drops the completion mask
    (prompts trained) and 0.20.0's does not; both rows carry no position_ids. Every probe reports: the
    first-batch loss has its number on both, and the causes differ (completion_mask vs mask_override)."""
    env = "transformers==4.56.2+trl=="
    cells = _audit(pytester, monkeypatch, version_cache,
                   ["transformers==4.56.2 & trl==0.19.1", "transformers==4.56.2 & trl==0.20.0"], "arch:llama", "sft")
    old, new = cells[f"llama-sdpa-sft-float32@{env}0.19.1"], cells[f"llama-sdpa-sft-float32@{env}0.20.0"]
    for cell in (old, new):
        probes = cell["metrics"]["probes"]
        assert cell["status"] == "fail" and probes["row_contract"]["cause"] == "mask_override", cell["message"]
        assert probes["first_batch_loss"]["status"] == "fail" and cell["metrics"]["loss_delta"] > 1e-3
        assert probes["steps"]["status"] == "fail"
    assert old["cause"] == "completion_mask" and old["metrics"]["completion_only"]["prompt_tokens_in_loss"] > 0
    assert new["cause"] == "mask_override" and new["metrics"]["probes"]["completion_only"]["status"] == "pass"
    assert old["diagnosis"]["remedy"].startswith("upgrade TRL to >= 0.20")


@pytest.mark.slow
def test_real_first_batch_on_4_57_1_trl_0_24_is_measured_as_training(pytester, monkeypatch, version_cache):
    """tiny gpt_neox, sdpa, transformers 4.57.1 + TRL 0.24.0: config.use_cache stays True, TRL's compute_loss
    passes use_cache=False. The first-batch loss is the trainer's own and matches the per-example reference (a
    forward with the config's cache was off by 6.78e-4, a false failure); the 3 steps match as before."""
    cells = _audit(pytester, monkeypatch, version_cache, ["transformers==4.57.1 & trl==0.24.0"], "arch:gpt_neox", "sft")
    cell = cells["gpt_neox-sdpa-sft-float32@transformers==4.57.1+trl==0.24.0"]
    m = cell["metrics"]
    assert m["effective"]["use_cache"] is True and m["first_batch_use_cache"] is False
    assert m["probes"]["first_batch_loss"]["status"] == "pass" and m["loss_delta"] < 1e-5, cell["message"]
    assert m["steps"]["max_loss_delta"] < 1e-5


@pytest.mark.slow
def test_real_padded_trainer_before_5_10_is_a_hazard_shown(pytester, monkeypatch, version_cache):
    """transformers 4.56.2: Trainer's and SFTTrainer's own padded runs divide by the label count before the
    shift (loss x0.9032 = 28/31 for the Trainer): trainer_padded and sft_padded fail with padded_normalisation."""
    cells = _audit(pytester, monkeypatch, version_cache, ["transformers==4.56.2 & trl==0.20.0"], "arch:llama",
                   "trainer_padded,sft_padded")
    env = "@transformers==4.56.2+trl==0.20.0"
    trainer = cells[f"llama-sdpa-trainer_padded-float32{env}"]
    assert trainer["status"] == "fail" and trainer["cause"] == "padded_normalisation", trainer["message"]
    assert abs(trainer["metrics"]["loss_ratio"] - 28 / 31) < 1e-3
    sft = cells[f"llama-sdpa-sft_padded-float32{env}"]
    assert sft["status"] == "fail" and sft["cause"] == "padded_normalisation", sft["message"]


def test_unmasked_boundary_labels_and_a_leak_are_each_a_cause_of_one_sft_cell(llama_sdpa):
    """Planted in TRL's own run: the collator's labels at every example start set back to the token (boundaries
    unmasked) and sdpa ignoring the packed mask. One cell, both causes, each with the probe that measured it:
    boundary_labels (the starts named) and the attention cause of the loss probes (leak)."""
    import torch
    from faults import leaky_sdpa
    from trl.trainer import sft_trainer

    cls = sft_trainer.DataCollatorForLanguageModeling
    real = cls.torch_call

    def unmasked(self, examples):
        out = real(self, examples)
        if "position_ids" in out and out["input_ids"].shape[0] == 1:
            starts = (out["position_ids"][0] == 0).nonzero().flatten()
            out["labels"][0, starts[1:]] = out["input_ids"][0, starts[1:]]
        return out

    cls.torch_call = unmasked
    try:
        with leaky_sdpa():
            result = S.check_sft(llama_sdpa)
    finally:
        cls.torch_call = real
    codes = [c["cause"] for c in result.causes]
    # each start is a prompt token, so the completion-only probe counts it as well: three causes, probe order
    assert result.status == "fail" and codes == ["completion_mask", "boundary_labels", "leak"], result.causes
    labels = result.causes[1]["evidence"]
    assert labels["probe"] == "boundary_labels" and len(labels["unmasked_starts"]) == labels["examples"] - 1
    leak = next(c for c in result.causes if c["cause"] == "leak")
    assert leak["evidence"]["isolation_moved"] > 1e-3
    assert torch.is_tensor(llama_sdpa.packed()["input_ids"])


def test_trl_whose_fused_head_lost_its_kernel_is_not_checked_with_the_reason(llama_sdpa, monkeypatch):
    """TRL 1.15.0 on the CPU torch wheel: its fused LM head's Triton kernel is None (no triton) and every SFT cell
    of every family was "shrunk_crash: AttributeError: 'NoneType' object has no attribute 'apply'" in the TRL axis
    of the atlas, blamed on the shrunk model. Planted: the kernel None, as TRL 1.15 leaves it without triton."""
    import trl.trainer.utils as U

    monkeypatch.setattr(U, "_ChunkedLogProbFunction", None)
    for check in (S.check_sft, S.check_sft_padding_free):
        got = check(llama_sdpa)
        assert got.status == "skipped" and got.cause is None, got.message
        assert "Triton kernel and triton is not installed" in got.message and "TRL >= 1.16" in got.message
    monkeypatch.undo()
    assert S.check_sft(llama_sdpa).status == "pass"  # the kernel present (TRL 1.16 here): measured as before


def test_unmasked_boundary_labels_in_a_row_without_position_ids_are_named_beside_the_missing_boundaries(llama_sdpa):
    """Issue 41: a packed row that carries no position_ids (TRL 0.20 - 0.23's collator on non-flash backends) was
    checked for its labels at the example starts only where position_ids gave the starts, so a row that also
    trained each example's first token as the previous one's next named mask_override alone. The starts are found
    by the examples' token ids (as the first-batch loss probe splits such a row) and both causes are named.
    Planted in TRL's own run: the collator's position_ids dropped and its labels at every example start set back
    to the token, an all-ones attention_mask in their place."""
    import torch
    from trl.trainer import sft_trainer

    cls = sft_trainer.DataCollatorForLanguageModeling
    real = cls.torch_call

    def dropped(self, examples):
        out = real(self, examples)
        if "position_ids" in out and out["input_ids"].shape[0] == 1:
            starts = (out.pop("position_ids")[0] == 0).nonzero().flatten()
            out["labels"][0, starts[1:]] = out["input_ids"][0, starts[1:]]
            out["attention_mask"] = torch.ones_like(out["input_ids"])  # TRL 1.16's compute_loss needs one of the two
        return out

    cls.torch_call = dropped
    try:
        result = S.check_sft(llama_sdpa)
    finally:
        cls.torch_call = real
    codes = [c["cause"] for c in result.causes]
    assert result.status == "fail" and {"mask_override", "boundary_labels"} <= set(codes), result.causes
    labels = next(c["evidence"] for c in result.causes if c["cause"] == "boundary_labels")
    assert labels["probe"] == "boundary_labels" and len(labels["unmasked_starts"]) == labels["examples"] - 1 >= 2, labels
    assert "found by the examples' token ids" in result.metrics["probes"]["boundary_labels"]["evidence"]
