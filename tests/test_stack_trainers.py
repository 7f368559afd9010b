"""Stack elements through the trainers (checks/stack_trainers.py): LoRA passes through Trainer and SFTTrainer, a
planted adapter that drops position_ids and accelerate's own CP hook are caught in every mode with the element's
cause, and a trainer that refuses is recorded with the file:line that raised, not failed."""

from __future__ import annotations

import contextlib

import pytest
from conftest import make_bench

from pytest_packcheck.checks.stack_trainers import MODES, check_stack_trainers, raised_at, source_line
from pytest_packcheck.model import stack as S

pytest.importorskip("peft")
pytest.importorskip("trl")


def bench(tolerances, element, backend="sdpa"):
    wb = make_bench("llama", backend, tolerances)
    wb.model = S.apply_element(wb.model, element, backend)
    return wb


def test_lora_through_every_trainer_mode_is_exact_and_accepted(tolerances):
    result = check_stack_trainers(bench(tolerances, "lora"))
    assert result.status == "pass", result.message
    modes = result.metrics["modes"]
    assert set(modes) == {name for name, _, _ in MODES}
    for name, m in modes.items():
        assert m["decision"] == "accepted" and m["examples_in_row"] == 6, (name, m)
        assert m["loss_delta"] <= tolerances["float32"]["loss_atol"] and m["grad_rel_err"] <= 1e-5
        assert m["trainable_tensors"] > 0  # the adapter's own weights got gradients
    assert modes["sft_packing"]["decided_at"].startswith("trl/trainer/sft_trainer.py:")
    assert modes["sft_padding_free"]["padding_free"] is True
    # what was asked vs what the trainer has in force, and position_ids reaching the decoder (a hook on it)
    assert modes["sft_packing"]["asked"] == {"packing": True, "padding_free": False}
    assert modes["sft_packing"]["settled"] == {"packing": "kept", "padding_free": "forced"}  # TRL 1.16: bfd forces it
    assert modes["sft_padding_free"]["settled"] == {"packing": "off", "padding_free": "kept"}
    assert modes["trainer"]["settled"] == {"padding_free": "kept"}
    for m in modes.values():
        assert m["position_ids_in_batch"] is True and m["position_ids_to_model"] is True
        assert "position_ids_dropped_at" not in m


def test_a_planted_adapter_that_drops_position_ids_fails_every_mode_with_the_adapters_cause(tolerances):
    wb = bench(tolerances, "lora")
    inner = wb.model.inner
    forward = inner.forward

    def dropping(*args, **kwargs):  # the fault: an adapter that drops position_ids (as peft's prompt learning does)
        kwargs.pop("position_ids", None)
        return forward(*args, **kwargs)

    inner.forward = dropping
    lifted = wb.model._lift

    @contextlib.contextmanager
    def lift():  # lifting the element lifts the fault too
        inner.forward = forward
        with lifted():
            try:
                yield
            finally:
                inner.forward = dropping

    wb.model._lift = lift
    result = check_stack_trainers(wb)
    assert result.status == "fail" and result.cause == "adapter_positions", result.message
    for name, m in result.metrics["modes"].items():
        assert m["status"] == "fail" and m["logits_max_abs_diff"] > 1e-2 and m["grad_rel_err"] > 1e-3, (name, m)
        assert m["without_element"] <= tolerances["float32"]["logits_atol"]


@pytest.mark.parametrize("element", ["prompt_tuning", "prefix_tuning"])
def test_prompt_learning_adapters_train_the_packed_row_wrong_in_every_trainer(tolerances, element):
    result = check_stack_trainers(bench(tolerances, element))
    assert result.status == "fail" and result.cause == "adapter_positions", result.message
    for m in result.metrics["modes"].values():
        assert m["decision"] == "accepted" and m["grad_rel_err"] > 1e-2
        if element == "prompt_tuning":  # peft drops them before the decoder, with only a warning: its line named
            assert m["position_ids_in_batch"] is True and m["position_ids_to_model"] is False
            assert m["position_ids_dropped_at"].startswith("peft/peft_model.py:")


def test_accelerates_cp_hook_is_accepted_on_sdpa_and_leaks_and_the_flash_path_is_refused_and_exact(tolerances):
    sdpa = check_stack_trainers(bench(tolerances, "cp"))
    assert sdpa.status == "fail" and sdpa.cause == "stack_mask_dropped", sdpa.message
    cp = sdpa.metrics["modes"]["trainer"]["context_parallel"]
    assert cp["refuses_backend"] is False and cp["refuses_mask"] is False
    assert cp["sdpa_only_at"].startswith("transformers/trainer.py:")
    from pytest_packcheck.backends import REFERENCE_BACKEND

    flash = check_stack_trainers(bench(tolerances, "cp", REFERENCE_BACKEND))
    for m in flash.metrics["modes"].values():  # Trainer refuses CP on any backend but sdpa: recorded, not failed
        assert m["status"] == "refused" and m["context_parallel"]["refuses_backend"] is True
        assert m["logits_max_abs_diff"] <= tolerances["float32"]["logits_atol"]
    assert flash.status == "pass", flash.message


def test_a_trainer_that_refuses_is_recorded_with_the_line_that_raised(tolerances, monkeypatch):
    import trl

    def refuse(self, *args, **kwargs):
        raise ValueError("packing is not supported with this adapter")

    monkeypatch.setattr(trl.SFTTrainer, "__init__", refuse)
    result = check_stack_trainers(bench(tolerances, "lora"))
    for name in ("sft_packing", "sft_padding_free"):
        m = result.metrics["modes"][name]
        assert m["status"] == "refused" and "packing is not supported" in m["raised"]
        assert m["raised_at"].startswith("test_stack_trainers.py:") or "test_stack_trainers.py:" in m["raised_at"]
    assert result.metrics["modes"]["trainer"]["status"] == "pass" and result.status == "pass"


def test_no_element_is_a_skip_and_a_non_adapter_element_is_unsupported(tolerances):
    assert check_stack_trainers(make_bench("llama", "sdpa", tolerances)).status == "skipped"
    assert check_stack_trainers(bench(tolerances, "checkpointing")).status == "unsupported"


def test_source_line_and_raised_at_name_the_installed_file():
    import transformers.trainer as tt

    assert source_line(tt, "def training_step").startswith("transformers/trainer.py:")
    assert source_line(tt, "no such text anywhere 123") is None
    try:
        int("x")
    except ValueError as exc:
        assert ":" in raised_at(exc)


def test_settled_names_kept_forced_dropped_and_off():
    from pytest_packcheck.checks.stack_trainers import settled

    assert [settled(True, True), settled(False, True), settled(True, False), settled(False, False), settled(True, None)] \
        == ["kept", "forced", "dropped", "off", "unknown"]


def test_a_trainer_that_drops_padding_free_and_a_training_step_that_raises_are_recorded_per_mode(tolerances, monkeypatch):
    import functools

    import trl

    init = trl.SFTTrainer.__init__

    @functools.wraps(init)  # the SFT set-up reads __init__'s signature (processing_class / tokenizer by release)
    def dropping(self, *args, **kwargs):  # planted: an SFTTrainer that quietly turns padding_free off
        init(self, *args, **kwargs)
        self.padding_free = False

    monkeypatch.setattr(trl.SFTTrainer, "__init__", dropping)

    def raising(self, model, inputs, num_items_in_batch=None):  # planted: a training step that cannot take the row
        if type(self).__name__ == "SFTTrainer":
            raise RuntimeError("The size of tensor a (197) must match the size of tensor b (193)")
        return step(self, model, inputs, num_items_in_batch)

    import transformers

    step = transformers.Trainer.training_step
    monkeypatch.setattr(transformers.Trainer, "training_step", raising)
    result = check_stack_trainers(bench(tolerances, "lora"))
    modes = result.metrics["modes"]
    assert modes["sft_padding_free"]["settled"]["padding_free"] == "dropped", modes["sft_padding_free"]
    for name in ("sft_packing", "sft_padding_free"):
        assert modes[name]["status"] == "raises" and "197" in modes[name]["raised"]
        assert "test_stack_trainers.py:" in modes[name]["raised_at"]
    assert modes["trainer"]["status"] == "pass"
    assert result.status == "error" and "its training step raises" in result.message
