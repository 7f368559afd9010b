"""Stack elements (model/stack.py) in the checks: which element a failing row is due to, and the row-order probe.

A cell of ``llama+lora`` runs the usual checks on the model with the element applied. When one of them fails, the
element is lifted (:meth:`StackedModel.lifted`: adapter disabled, hooks removed, checkpointing off, uncompiled) and
the same measurement reruns; when that fixes the row (:func:`registry.fixed_by`), the cause is the element's own
(:attr:`StackElement.cause`, with both numbers), not the model's. Torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model import batches as B
from ..model.stack import StackUnavailable, stack_record
from ..results import CheckResult
from .registry import fixed_by
from .workbench import Workbench, _fmt, capture_warnings


def stacked(wb: Workbench) -> Any:
    """The workbench's :class:`StackedModel`, or None for a model without a stack element."""
    return wb.model if type(wb.model).__name__ == "StackedModel" else None


def packed_vs_solo(wb: Workbench, examples: list[list[int]] | None = None) -> float:
    """Max abs diff of a packed row of ``examples`` (default the workbench's) against each example alone, both run
    now (never the workbench's cached logits: :func:`stack_cause` calls it with the element lifted)."""
    examples = examples or wb.examples
    logits = wb.forward(wb.packed(examples)).logits[0].float()
    return max(float((logits[s] - wb.solo(e)).abs().max()) for s, e in zip(B.segment_slices([len(e) for e in examples]),
                                                                            examples, strict=True))


def grads_vs_padded(wb: Workbench) -> float:
    """Relative error ``||g_packed - g_padded|| / ||g_padded||`` over the parameters that train (the grad_parity
    number), both backward passes run now."""
    import torch

    packed = torch.cat([g.flatten() for _, g in wb.param_grads(wb.packed())])
    padded = torch.cat([g.flatten() for _, g in wb.param_grads(B.padded_batch(wb.examples, wb.pad_id, "right", wb.start, wb.device))])
    return float((packed - padded).norm() / padded.norm().clamp_min(1e-30))


def stack_cause(wb: Workbench, measure: Callable[[Workbench], float] = packed_vs_solo, diff: float | None = None,
                atol: float | None = None) -> dict[str, Any] | None:
    """``{"cause", "evidence"}`` naming the stack element when lifting it fixes the row, else None (no element, the
    element cannot be lifted, or the row is wrong without it too: the model's own fault). ``measure``: the number
    that failed (default :func:`packed_vs_solo`, against ``logits_atol``), rerun with the element lifted; ``diff``:
    its value with the element (measured now when None). Evidence: both numbers, the element's record (its library
    version) and the warnings the element's forward raised (peft's "Position ids are not supported ...")."""
    model = stacked(wb)
    if model is None:
        return None
    atol = wb.tol["logits_atol"] if atol is None else atol
    key = ("stack_cause", id(model), getattr(measure, "__name__", str(measure)), diff, atol)
    if key in wb._cache:
        return wb._cache[key]
    with capture_warnings() as said:
        with_element = measure(wb) if diff is None else diff
        if diff is not None:
            wb.forward(wb.packed())  # the element's warnings on the packed row
    try:
        with model.lifted():
            without = measure(wb)
    except StackUnavailable:
        wb._cache[key] = None
        return None
    out = None
    if with_element > atol and fixed_by(without, with_element, atol, wb.dtype):
        evidence = {"element": model.element.name, "with_element": with_element, "without_element": without, "atol": atol,
                    "measured": getattr(measure, "__name__", "measure"), "stack": stack_record(model)}
        warned = sorted({" ".join(m.split())[:160] for m in said if "position" in m.lower() or "mask" in m.lower()})
        if warned:
            evidence["warnings"] = warned[:3]
        if model.element.cause in FLASH_REMEDY_CAUSES:
            evidence.update(_flash_remedy(wb, measure, with_element, atol))
        out = {"cause": model.element.cause, "evidence": evidence}
    wb._cache[key] = out
    return out


#: Stack causes whose remedy sends the user to a flash backend ("a flash backend keeps the boundaries in position_ids /
#: cu_seq_lens_q"): :func:`stack_cause` checks that remedy on the element's own fault before it is given.
FLASH_REMEDY_CAUSES = frozenset({"stack_mask_dropped"})


def _flash_remedy(wb: Workbench, measure: Callable[[Workbench], float], with_element: float, atol: float) -> dict[str, Any]:
    """The remedy "use a flash backend" applied to the element's fault (issue 41: a remedy must fix the cause under
    the stack that produced it): ``measure`` rerun with the element still applied, on packcheck's varlen reference
    (:data:`~pytest_packcheck.backends.REFERENCE_BACKEND`: transformers' flash-attention preparation on an exact CPU
    kernel, the flash path's boundaries from position_ids / cu_seq_lens_q). ``{"flash_with_element": number,
    "flash_keeps_boundaries": bool}``; on a cell already on that backend its own number (the flash path is what
    failed). A hook that removes the boundaries on every backend (the mask and the position_ids / cu_seq_lens the
    flash path reads) gets False, and :mod:`checks.causes` then gives no flash remedy. ``{}`` when the model cannot
    switch backends (no ``set_attn_implementation``, or the switch raised)."""
    from ..backends import REFERENCE_BACKEND, ensure_registered

    if wb.backend == REFERENCE_BACKEND:
        return {"flash_with_element": with_element, "flash_keeps_boundaries": with_element <= atol}
    base = getattr(stacked(wb), "base", None)
    switch = getattr(base, "set_attn_implementation", None)
    before = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if not callable(switch) or before is None:
        return {}
    try:
        ensure_registered(REFERENCE_BACKEND)
        switch(REFERENCE_BACKEND)
    except Exception:  # noqa: BLE001 - a model that cannot run the flash path: the remedy is not checked, said by its absence
        return {}
    try:
        import dataclasses

        flash = measure(dataclasses.replace(wb, backend=REFERENCE_BACKEND, _cache={}))
    finally:
        switch(before)
    return {"flash_with_element": flash, "flash_keeps_boundaries": flash <= atol}


def rotated(examples: list[list[int]]) -> list[list[int]]:
    """The examples in another order (the first moved to the end): the same row length, other boundaries."""
    return [*examples[1:], examples[0]]


def reordered_vs_solo(wb: Workbench) -> float:
    """:func:`packed_vs_solo` of the :func:`rotated` row, run after the default row (so a model that keeps the
    first row it saw of a length is caught on the second)."""
    wb.forward(wb.packed())
    return packed_vs_solo(wb, rotated(wb.examples))


def check_row_order(wb: Workbench) -> CheckResult:
    """The default packed row, then the same examples in another order (one row length, other boundaries: a
    compiled graph, a cache or a hook keyed by the row's shape that kept the first row's boundaries gets the second
    wrong), each example = each alone (max abs diff <= ``logits_atol``). Cause: the stack element's when lifting it
    fixes the row (``compile_frozen`` for torch.compile), else the model's (:func:`probes.mismatch_causes`)."""
    from .probes import mismatch_causes

    first = packed_vs_solo(wb)
    second = reordered_vs_solo(wb)
    lengths = [len(e) for e in rotated(wb.examples)]
    atol = wb.tol["logits_atol"]
    metrics = {"max_abs_diff": max(first, second), "max_abs_diff_first_row": first, "max_abs_diff_reordered": second,
               "reordered_lengths": lengths, "atol": atol}
    record = stack_record(wb.model)
    if record:
        metrics["stack"] = record
    if max(first, second) <= atol:
        return CheckResult("pass", metrics, f"row {wb.lengths} then {lengths} (same length): each example = alone within "
                           f"{_fmt(max(first, second))}")
    found = stack_cause(wb, reordered_vs_solo, second, atol) if second > atol else stack_cause(wb, packed_vs_solo, first, atol)
    causes = [found] if found else mismatch_causes(wb, max(first, second), atol)
    which = "the reordered row" if second > atol >= first else "the first row" if first > atol >= second else "both rows"
    return CheckResult("fail", metrics, f"{which} differ from each example alone: row {wb.lengths} by {_fmt(first)}, "
                       f"row {lengths} by {_fmt(second)}" + (f" (fixed without {found['evidence']['element']}: "
                                                             f"{_fmt(found['evidence']['without_element'])})" if found else ""),
                       causes=causes)
