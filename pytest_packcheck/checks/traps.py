"""The hazards of the standard row: a cache (cache_trap) and an attention_mask beside the packed row (mask_trap)."""

from __future__ import annotations

from ..results import CheckResult
from .probes import mismatch_cause
from .registry import fixed_by
from .workbench import Workbench, _fmt

# ------------------------------------------------------------------------------------------------------------
# 8. the cache trap


def check_cache_trap(wb: Workbench) -> CheckResult:
    """Packed forward as a Trainer user calls it (train mode, labels, use_cache left as configured) vs with
    use_cache=False, both against the solo runs. Fails when packing is correct only with use_cache=False:
    a cache disables the packed mask on eager/sdpa/flex (masking_utils, transformers >= 4.54)."""
    import torch

    batch = wb.packed()
    model = wb.model
    model.train()
    try:
        with torch.no_grad():  # forward-only: no backward needed to see the mask, and flex has none on CPU
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "labels")}
            if "position_ids" in inputs:
                inputs["position_ids"] = wb.layout.apply(inputs["position_ids"])
            default_logits = model(**inputs).logits[0].float()
    finally:
        model.eval()
    diff_default, _ = wb.diff_to_solo(default_logits)
    diff_no_cache, _ = wb.diff_to_solo(wb.packed_logits())
    atol = wb.tol["logits_atol"]
    metrics = {"config_use_cache": getattr(model.config, "use_cache", None), "max_abs_diff_default": diff_default,
               "max_abs_diff_use_cache_false": diff_no_cache, "atol": atol}
    if diff_default <= atol:
        return CheckResult("pass", metrics, f"correct with defaults (diff {_fmt(diff_default)})")
    evidence = {"max_abs_diff_default": diff_default, "max_abs_diff_use_cache_false": diff_no_cache, "atol": atol}
    if fixed_by(diff_no_cache, diff_default, atol, wb.dtype):  # within numerics without the cache: the cache's fault
        return CheckResult("fail", metrics, f"cache trap: correct only with use_cache=False (default {_fmt(diff_default)} vs {_fmt(diff_no_cache)})",
                           cause="cache_trap", evidence=evidence)
    cause, why = mismatch_cause(wb, diff_no_cache, atol)  # the row is wrong without the cache too: the model's own fault
    return CheckResult("fail", metrics, f"wrong with and without use_cache (default {_fmt(diff_default)}, use_cache=False {_fmt(diff_no_cache)})",
                       cause=cause, evidence={**evidence, **why})


# ------------------------------------------------------------------------------------------------------------
# 9. the attention_mask trap


def check_mask_trap(wb: Workbench) -> CheckResult:
    """The packed row with an all-ones ``attention_mask`` added (what a padding collator or a hand-written
    training loop passes along) vs without, both against the solo runs.

    eager/sdpa/flex build the packed mask only when attention_mask is None (masking_utils, >= 4.54), so the
    mask wins there. The flash path unpads from a mask that has padding, but its mask function drops an
    all-ones mask (measured: boundaries kept on 5.24). Fails when the mask makes examples attend to each other;
    ``max_abs_diff_without_mask`` shows whether the row was right without it.
    """
    import torch

    batch = dict(wb.packed())
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    diff_mask, _ = wb.diff_to_solo(wb.packed_logits(batch))
    diff_plain, _ = wb.diff_to_solo(wb.packed_logits())
    atol = wb.tol["logits_atol"]
    metrics = {"max_abs_diff_with_mask": diff_mask, "max_abs_diff_without_mask": diff_plain, "atol": atol}
    if diff_mask <= atol:
        return CheckResult("pass", metrics, f"boundaries hold with an all-ones attention_mask (diff {_fmt(diff_mask)})")
    evidence = {"max_abs_diff_with_mask": diff_mask, "max_abs_diff_without_mask": diff_plain, "atol": atol}
    if fixed_by(diff_plain, diff_mask, atol, wb.dtype):  # within numerics without the mask: the mask's fault
        return CheckResult("fail", metrics, f"mask trap: an all-ones attention_mask overrides the packed boundaries "
                           f"(diff {_fmt(diff_mask)}; without it {_fmt(diff_plain)})", cause="mask_override", evidence=evidence)
    cause, why = mismatch_cause(wb, diff_plain, atol)  # the row is wrong without the mask too: the model's own fault
    return CheckResult("fail", metrics, f"wrong with and without attention_mask (with {_fmt(diff_mask)}, without {_fmt(diff_plain)})",
                       cause=cause, evidence={**evidence, **why})
