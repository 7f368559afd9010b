"""A stack element that is said to be applied but is not (issue 45, part 3: "a patch that is logged as applied but is
not"): accelerate's context-parallel hook attached to no module, checkpointing enabled on no layer. Each would
measure the bare model under the element's name, a pass that says nothing about the element; packcheck refuses to
file it (``unsupported`` with the reason) and the real element, applied, is recorded with what it touched."""

from __future__ import annotations

import pytest
from conftest import make_bench

from pytest_packcheck.model import stack as S

pytest.importorskip("accelerate")


def test_a_cp_hook_attached_to_no_module_is_refused_not_measured(tolerances, monkeypatch):
    import accelerate.big_modeling as bm

    real = make_bench("llama", "sdpa", tolerances)
    applied = S.apply_element(real.model, "cp", "sdpa")
    assert applied.detail["hooked_modules"] == 2  # every self_attn of the tiny llama

    monkeypatch.setattr(bm, "_attach_context_parallel_hooks", lambda model: None)  # planted: "attached", nothing hooked
    wb = make_bench("llama", "sdpa", tolerances)
    with pytest.raises(S.StackUnavailable, match="attached no hook to LlamaForCausalLM") as info:
        S.apply_element(wb.model, "cp", "sdpa")
    assert info.value.status == "unsupported"


@pytest.mark.parametrize("element", ["checkpointing", "checkpointing_reentrant"])
def test_checkpointing_enabled_on_no_layer_is_refused_not_measured(tolerances, monkeypatch, element):
    real = make_bench("llama", "sdpa", tolerances)
    applied = S.apply_element(real.model, element, "sdpa")
    assert applied.detail["checkpointed_layers"] == S.checkpointed_layers(applied.base) > 0

    wb = make_bench("llama", "sdpa", tolerances)
    cls = type(wb.model)
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(cls, name):  # planted: the call returns as if it worked and flags no layer
            monkeypatch.setattr(cls, name, lambda self, *a, **k: None)
    with pytest.raises(S.StackUnavailable, match="set gradient_checkpointing on no module") as info:
        S.apply_element(wb.model, element, "sdpa")
    assert info.value.status == "unsupported"


def test_the_runner_files_an_element_that_did_nothing_as_unsupported_with_its_reason(tolerances, monkeypatch):
    import accelerate.big_modeling as bm

    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import Cell, CellRunner

    monkeypatch.setattr(bm, "_attach_context_parallel_hooks", lambda model: None)
    resolved = resolve_model(parse_model_spec("arch:llama", "test"), "test")
    runner = CellRunner([resolved], {"float32": tolerances["float32"]})
    cell = runner.run(Cell(0, "llama+cp", "sdpa", "isolation", "float32", stack="cp"))
    assert cell.status == "unsupported" and "attached no hook" in cell.message, (cell.status, cell.message)
