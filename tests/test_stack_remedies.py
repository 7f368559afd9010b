"""The remedy a stack element's cause carries, applied to the element's own planted fault (issue 41: a remedy must fix
the cause under the stack that produced it, not only name it). "Use a flash backend" is checked on the fault with
the element still applied: accelerate's context-parallel hook drops only the mask, so the flash path keeps the
boundaries and the remedy stands; a hook that removes the boundaries on every backend gets no flash remedy. The
other elements' remedies (an adapter that passes position_ids through, checkpointing off, uncompiled) are applied
and the row is right."""

from __future__ import annotations

import contextlib

import pytest
from conftest import make_bench

from pytest_packcheck.analysis.diagnose import remedy
from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks.registry import SPECS
from pytest_packcheck.model import stack as S

pytest.importorskip("peft")
pytest.importorskip("accelerate")


def run(name, wb):
    return SPECS[name].load()(wb)


def _remedy(result, wb, check):
    cell = {"backend": wb.backend, "check": check, "status": result.status, "metrics": result.metrics,
            "causes": result.causes}
    return remedy(result.cause, cell, {})


def _every_boundary_dropped(module, args, kwargs):
    """A planted context-parallel hook that removes the packed boundaries on every backend: the mask (as accelerate's
    does) and the position_ids / cu_seq_lens the flash path finds its boundaries in."""
    kwargs["attention_mask"] = None
    kwargs["is_causal"] = True
    for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(key, None)
    return args, kwargs


def _hooked(wb):
    model = wb.model
    handles = []

    def attach():
        handles.extend(m.register_forward_pre_hook(_every_boundary_dropped, with_kwargs=True, prepend=True)
                       for n, m in model.named_modules() if n.endswith("self_attn"))

    @contextlib.contextmanager
    def lift():
        while handles:
            handles.pop().remove()
        try:
            yield
        finally:
            attach()

    attach()
    wb.model = S.stacked(model, model, S.BY_NAME["cp"], {"element": "cp"}, lift)
    return wb


def test_the_flash_remedy_of_a_dropped_mask_is_checked_on_the_hooks_own_fault(tolerances):
    """accelerate 1.16's own hook on sdpa: the remedy sends the user to a flash backend with the number measured
    there, and applied (the same hook on packcheck's varlen reference) the row is right."""
    wb = make_bench("llama", "sdpa", tolerances)
    wb.model = S.apply_element(wb.model, "cp", "sdpa")
    result = run("isolation", wb)
    atol = tolerances["float32"]["logits_atol"]
    assert result.status == "fail" and result.cause == "stack_mask_dropped", result.message
    evidence = result.evidence
    assert evidence["flash_keeps_boundaries"] is True and evidence["flash_with_element"] <= atol < evidence["with_element"]
    said = _remedy(result, wb, "isolation")
    assert "a flash backend keeps the boundaries" in said and f"{evidence['flash_with_element']:.1e}" in said, said
    applied = make_bench("llama", REFERENCE_BACKEND, tolerances)
    applied.model = S.apply_element(applied.model, "cp", REFERENCE_BACKEND)
    assert run("isolation", applied).status == "pass"  # the remedy, applied under the same hook


def test_a_hook_that_drops_the_boundaries_on_every_backend_gets_no_flash_remedy(tolerances):
    """Planted: a hook that removes the mask and the flash path's position_ids / cu_seq_lens_q. Before, the cause's
    remedy read "a flash backend keeps the boundaries"; applied, the flash path leaks too. Now the remedy says so, with
    the number, and lifting the hook (what it does recommend) makes the row right."""
    wb = _hooked(make_bench("llama", "sdpa", tolerances))
    result = run("isolation", wb)
    atol = tolerances["float32"]["logits_atol"]
    assert result.status == "fail" and result.cause == "stack_mask_dropped", result.message
    evidence = result.evidence
    assert evidence["flash_keeps_boundaries"] is False and evidence["flash_with_element"] > 1e-2, evidence
    assert evidence["without_element"] <= atol
    said = _remedy(result, wb, "isolation")
    assert said.startswith("do not pack under this hook on any backend") and "flash backend keeps" not in said, said
    applied = _hooked(make_bench("llama", REFERENCE_BACKEND, tolerances))  # the remedy it no longer gives, applied
    on_flash = run("isolation", applied)
    assert on_flash.status == "fail" and on_flash.cause == "stack_mask_dropped", on_flash.message
    assert on_flash.evidence["flash_keeps_boundaries"] is False


def test_the_adapter_remedy_lora_is_right_where_prompt_tuning_leaks(tolerances):
    """adapter_positions' remedy ("use LoRA / DoRA, which pass position_ids through"), applied to the same model."""
    wb = make_bench("llama", "sdpa", tolerances)
    wb.model = S.apply_element(wb.model, "prompt_tuning", "sdpa")
    result = run("isolation", wb)
    assert result.status == "fail" and result.cause == "adapter_positions", result.message
    assert "LoRA / DoRA" in _remedy(result, wb, "isolation")
    for element in ("lora", "dora"):
        applied = make_bench("llama", "sdpa", tolerances)
        applied.model = S.apply_element(applied.model, element, "sdpa")
        assert run("isolation", applied).status == "pass", element


def test_the_checkpointing_and_compile_remedies_are_the_element_lifted(tolerances):
    """checkpoint_recompute's remedy (train without gradient checkpointing) and compile_frozen's (do not compile the
    packed forward) are the element lifted: each planted fault's own number without the element is within tolerance."""
    from test_stack import _FrozenBoundaries, _planted, _recompute_without_packed_kwargs

    wb = make_bench("llama", "sdpa", tolerances)
    wb.model = S.apply_element(wb.model, "checkpointing", "sdpa")
    for layer in (m for m in wb.model.base.modules() if getattr(m, "gradient_checkpointing", False)):
        layer._gradient_checkpointing_func = _recompute_without_packed_kwargs
    result = run("grad_parity", wb)
    assert result.cause == "checkpoint_recompute" and "without gradient checkpointing" in _remedy(result, wb, "grad_parity")
    assert result.evidence["without_element"] <= tolerances["float32"]["grad_rel_err"] < result.evidence["with_element"]
    frozen = make_bench("llama", "sdpa", tolerances)
    _planted(frozen, _FrozenBoundaries(frozen.model), "compile")
    result = run("row_order", frozen)
    assert result.cause == "compile_frozen" and "do not compile" in _remedy(result, frozen, "row_order")
    assert result.evidence["without_element"] <= tolerances["float32"]["logits_atol"] < result.evidence["with_element"]
