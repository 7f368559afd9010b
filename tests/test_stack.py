"""Stack elements (model/stack.py): each applied to a tiny model, measured by the packed-row checks, and each fault
the issue names planted and caught with its cause: a hook that drops the packed mask, an adapter that drops or
shifts position_ids, checkpointing that recomputes without the packed kwargs, a compiled graph that freezes one
row's boundaries. Each also passes without its fault."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from conftest import make_bench

from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks.registry import SPECS, suite_checks
from pytest_packcheck.config.options import OPT_STACK, parse_stack
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.model import stack as S

pytest.importorskip("peft")


def run(name, wb):
    return SPECS[name].load()(wb)


def stacked_bench(tolerances, element, backend="sdpa", arch="llama"):
    wb = make_bench(arch, backend, tolerances)
    wb.model = S.apply_element(wb.model, element, backend)
    return wb


# ------------------------------------------------------------------------------------------------------------------
# the table and the option


def test_every_element_names_a_known_cause_an_apply_function_and_a_kind():
    from pytest_packcheck.checks.causes import CAUSES

    for e in S.ELEMENTS:
        assert e.cause in CAUSES and callable(getattr(S, e.apply)) and e.kind in S.stack_help()
        assert e.name in S.stack_help()
    assert S.STACK_NAMES == tuple(e.name for e in S.ELEMENTS)


def test_stack_option_refuses_a_bad_name_in_one_line_naming_it_its_source_and_the_valid_ones():
    with pytest.raises(PackcheckUsageError) as err:
        parse_stack("lora,lorra", OPT_STACK)
    text = str(err.value)
    assert "\n" not in text and "'lorra'" in text and f"from {OPT_STACK}" in text and "prompt_tuning" in text
    assert "Did you mean 'lora'" in text
    with pytest.raises(PackcheckUsageError, match="item 2 is empty"):
        parse_stack("lora,,cp", "$PACKCHECK_STACK")
    assert parse_stack("cp,lora,cp", OPT_STACK) == ("cp", "lora") and parse_stack(["lora"], "audit") == ("lora",)
    assert parse_stack("none", OPT_STACK) == ()


def test_stack_audit_resolves_and_plans_one_cell_group_per_element(monkeypatch):
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import plan_cells

    opts = {"packcheck_audit": "stack"}
    settings = resolve(lambda dest: opts.get(dest), lambda key: None)
    assert settings.stack == S.STACK_NAMES and "row_order" in settings.checks
    assert set(suite_checks("stack")) <= set(settings.checks)
    assert "--packcheck-stack=" + ",".join(S.STACK_NAMES) in settings.to_args()
    models = [resolve_model(parse_model_spec("arch:llama", "test"), "test")]
    cells = plan_cells(models, ("sdpa",), ("isolation",), ("float32",), stack=("lora", "cp"))
    assert [c.cell_id for c in cells] == ["llama+lora-sdpa-isolation-float32", "llama+cp-sdpa-isolation-float32"]
    assert [c.cell_id for c in plan_cells(models, ("sdpa",), ("isolation",), ("float32",))] == ["llama-sdpa-isolation-float32"]
    monkeypatch.setenv("PACKCHECK_STACK", "lora,bogus")
    with pytest.raises(PackcheckUsageError, match=r"'lora,bogus' \(from \$PACKCHECK_STACK\): unknown stack element 'bogus'"):
        resolve(lambda dest: {"packcheck_models": "arch:llama"}.get(dest), lambda key: None)


def test_a_cell_records_its_element_and_an_element_that_cannot_run_is_a_skip_naming_the_package(tolerances):
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import Cell, CellRunner

    resolved = resolve_model(parse_model_spec("arch:llama", "test"), "test")
    runner = CellRunner([resolved], {"float32": tolerances["float32"]})
    lora = runner.run(Cell(0, "llama+lora", "sdpa", "isolation", "float32", stack="lora"))
    assert lora.status == "pass" and lora.stack == "lora" and lora.model["label"] == "llama+lora"
    assert lora.metrics["stack"]["peft"] == S.library_version(S.BY_NAME["lora"])
    liger = runner.run(Cell(0, "llama+liger", "sdpa", "isolation", "float32", stack="liger"))
    if S.availability(S.BY_NAME["liger"]):  # a CPU machine: never a silent pass
        assert liger.status == "skipped" and "liger-kernel" in liger.message and "triton" in liger.message


# ------------------------------------------------------------------------------------------------------------------
# PEFT adapters, measured


def test_lora_and_dora_are_exact_on_the_packed_row(tolerances):
    for element in ("lora", "dora"):
        wb = stacked_bench(tolerances, element)
        for check in ("isolation", "logits_parity", "grad_parity"):
            result = run(check, wb)
            assert result.status == "pass", (element, check, result.message)
        assert run("grad_parity", wb).metrics["num_params"] > 0  # the adapter's own weights train


@pytest.mark.parametrize("element", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_adapters_leak_on_the_packed_row_and_name_the_adapter(tolerances, element):
    wb = stacked_bench(tolerances, element)
    result = run("isolation", wb)
    assert result.status == "fail" and result.cause == "adapter_positions", result.message
    evidence = result.evidence
    assert evidence["with_element"] > 1e-2 and evidence["without_element"] <= tolerances["float32"]["logits_atol"]
    assert evidence["stack"]["peft"] and evidence["element"] == element
    if element != "prefix_tuning":  # peft drops position_ids with only a warning
        assert any("Position ids are not supported" in w for w in evidence["warnings"])


# ------------------------------------------------------------------------------------------------------------------
# planted faults


def test_a_hook_that_drops_the_packed_mask_is_caught_on_sdpa_and_the_flash_path_keeps_its_boundaries(tolerances):
    wb = stacked_bench(tolerances, "cp", "sdpa")  # accelerate's own context-parallel hook
    result = run("isolation", wb)
    assert result.status == "fail" and result.cause == "stack_mask_dropped"
    assert result.evidence["with_element"] > 1e-2 and result.evidence["stack"]["accelerate"]
    flash = stacked_bench(tolerances, "cp", REFERENCE_BACKEND)
    assert run("isolation", flash).status == "pass"  # attention_mask is None there: the boundaries ride position_ids


class _PositionsAdapter(torch.nn.Module):
    """A planted adapter: drops position_ids (``shift=None``) or shifts them ``shift`` tokens along the row (the
    restarts land ``shift`` tokens late, as when virtual tokens are counted in one place and not the other)."""

    def __init__(self, model, shift=None):
        super().__init__()
        self.model, self.shift = model, shift

    def forward(self, position_ids=None, **kwargs):
        if self.shift is not None and position_ids is not None:
            kwargs["position_ids"] = position_ids.roll(self.shift, dims=-1)
        return self.model(**kwargs)


def _planted(wb, inner, element):
    holder = {}

    @contextlib.contextmanager
    def lift():
        holder["m"].inner = base
        try:
            yield
        finally:
            holder["m"].inner = inner

    base = wb.model
    holder["m"] = wb.model = S.stacked(inner, base, S.BY_NAME[element], {"element": element}, lift)
    return wb


@pytest.mark.parametrize(("shift", "backend"), [(None, "sdpa"), (None, REFERENCE_BACKEND), (1, "sdpa")])
def test_an_adapter_that_drops_or_shifts_position_ids_is_caught(tolerances, shift, backend):
    wb = make_bench("llama", backend, tolerances)
    assert run("isolation", wb).status == "pass"
    _planted(wb, _PositionsAdapter(wb.model, shift), "lora")
    result = run("isolation", wb)
    assert result.status == "fail" and result.cause == "adapter_positions", result.message
    assert result.evidence["without_element"] <= tolerances["float32"]["logits_atol"]


def _recompute_without_packed_kwargs(function, *args, **kwargs):
    """A planted checkpoint function: the forward as called, the backward's recompute with a plain causal mask
    and 0..n-1 position_ids (the packed kwargs lost); the same tensors are saved, so torch does not notice."""
    calls = {"n": 0}

    def run_layer(*a):
        calls["n"] += 1
        if calls["n"] == 1:
            return function(*a)
        kw = dict(function.keywords)
        mask = kw.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            n = mask.shape[-1]
            causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
            kw["attention_mask"] = (causal.expand_as(mask) if mask.dtype == torch.bool
                                    else torch.where(causal, 0.0, torch.finfo(mask.dtype).min).to(mask.dtype).expand_as(mask))
        return function.func(*function.args, *a, **kw)

    return torch.utils.checkpoint.checkpoint(run_layer, *args, use_reentrant=False)


@pytest.mark.parametrize("element", ["checkpointing", "checkpointing_reentrant"])
def test_checkpointing_that_recomputes_without_the_packed_kwargs_is_caught_by_gradient_parity(tolerances, element):
    wb = stacked_bench(tolerances, element)
    real = run("grad_parity", wb)
    assert real.status == "pass", real.message  # transformers' own checkpointing keeps the kwargs
    layers = [m for m in wb.model.base.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers, "checkpointing is on"
    for layer in layers:
        layer._gradient_checkpointing_func = _recompute_without_packed_kwargs
    assert run("logits_parity", wb).status == "pass"  # the forward is right: only the recompute differs
    result = run("grad_parity", wb)
    assert result.status == "fail" and result.cause == "checkpoint_recompute", result.message
    assert result.evidence["without_element"] <= tolerances["float32"]["grad_rel_err"] < result.evidence["with_element"]


class _FrozenBoundaries(torch.nn.Module):
    """A planted 'compiled graph': keeps the position_ids of the first row of each length it saw (a graph that
    specialised on one row's boundaries)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, {}

    def forward(self, position_ids=None, **kwargs):
        if position_ids is not None:
            position_ids = self.seen.setdefault(tuple(position_ids.shape), position_ids)
        return self.model(position_ids=position_ids, **kwargs)


@pytest.mark.parametrize("backend", ["sdpa", REFERENCE_BACKEND])
def test_a_compiled_graph_that_freezes_one_rows_boundaries_is_caught_by_row_order(tolerances, backend):
    wb = make_bench("llama", backend, tolerances)
    _planted(wb, _FrozenBoundaries(wb.model), "compile")
    result = run("row_order", wb)
    assert result.status == "fail" and result.cause == "compile_frozen", result.message
    assert result.metrics["max_abs_diff_first_row"] <= tolerances["float32"]["logits_atol"]
    assert result.metrics["max_abs_diff_reordered"] > 1e-2


def test_torch_compile_keeps_the_boundaries_of_every_row(tolerances):
    wb = stacked_bench(tolerances, "compile", REFERENCE_BACKEND)  # the flash path's packed detection, traced
    for check in ("row_order", "isolation", "grad_parity"):
        result = run(check, wb)
        assert result.status == "pass", (check, result.message)
    record = S.stack_record(wb.model)
    assert record["unique_graphs"] >= 1 and record["backend"] == "aot_eager"


def test_row_order_passes_on_the_bare_model_and_fails_a_real_leak(tolerances):
    from faults import leaky_sdpa

    wb = make_bench("llama", "sdpa", tolerances)
    assert run("row_order", wb).status == "pass"
    wb = make_bench("llama", "sdpa", tolerances)
    with leaky_sdpa():
        result = run("row_order", wb)
    assert result.status == "fail" and result.cause == "leak"


def test_an_element_without_its_library_release_is_skipped_with_the_version(monkeypatch):
    monkeypatch.setattr(S, "library_version", functools.partial(lambda e: "0.8.0"))
    assert "needs peft >= 0.9.0 (installed: 0.8.0)" in S.availability(S.BY_NAME["dora"])


def test_the_libraries_of_the_elements_are_version_axes():
    from pytest_packcheck.versions import envs

    for e in S.ELEMENTS:
        if e.library and e.library != "liger-kernel":
            assert e.library in envs.KNOWN_LIBRARIES, e.name
