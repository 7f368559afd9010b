"""Running the model: the packed row as the loop runs it, each labelled example alone from its true positions (the
reference), and the comparison of their per-token log-probs and losses."""

from __future__ import annotations

from typing import Any

from .batch import _ROW_KEYS, IGNORE_INDEX, _Row
from .result import _usage


def _accepts(model: Any) -> set[str] | None:
    """Keyword arguments the model's forward takes by name; None when it takes ``**kwargs``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _log_probs(model: Any, inputs: dict[str, Any], targets: Any, fused: bool) -> tuple[Any, Any]:
    """Log-prob of each target ``(n - 1,)`` float32 (0 where the target is -100) and the model's own loss (or
    None). ``fused``: TRL's fused LM head (``fused_lm_head=True``), as SFTTrainer calls it."""
    import torch

    accepted = _accepts(model)
    call = {k: v for k, v in inputs.items() if accepted is None or k in accepted or k == "position_ids"}
    if fused:
        labels = torch.cat([targets[:, :1], targets], dim=1)  # the fused head shifts labels itself
        out = model(**call, labels=labels, fused_lm_head=True)
        if getattr(out, "log_probs", None) is None:
            raise _usage(f"batch['fused_lm_head'] is True but {type(model).__name__} has no fused LM head (its output has "
                         "no log_probs): add it with trl's add_fused_lm_head(model), as SFTTrainer does, or drop the key.")
        return out.log_probs[0].float(), getattr(out, "loss", None)
    out = model(**call)
    logits = out.logits[0, :-1]
    keep = targets[0] != IGNORE_INDEX
    lp = torch.zeros(targets.shape[1], dtype=torch.float32, device=logits.device)
    if keep.any():
        picked = logits[keep].float().log_softmax(-1)
        lp[keep] = picked.gather(-1, targets[0, keep][:, None])[:, 0]
    return lp, getattr(out, "loss", None)


def _row_log_probs(model: Any, keys: dict[str, Any], r: int, targets: Any, fused: bool, rows: int) -> Any:
    """Log-probs ``(length - 1,)`` of row ``r`` of the whole batch run together (targets of the other rows -100)."""
    import torch

    accepted = _accepts(model)
    call = {k: v for k, v in keys.items() if accepted is None or k in accepted or k == "position_ids"}
    if fused:
        labels = torch.full((rows, targets.shape[1] + 1), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
        labels[r, 1:] = targets[0]
        return model(**call, labels=labels, fused_lm_head=True).log_probs[r].float()
    logits = model(**call).logits[r, :-1].float()
    keep = targets[0] != IGNORE_INDEX
    lp = torch.zeros(targets.shape[1], dtype=torch.float32, device=logits.device)
    lp[keep] = logits[keep].log_softmax(-1).gather(-1, targets[0, keep][:, None])[:, 0]
    return lp


def _solo(model: Any, row: _Row, targets: Any, fused: bool, counter: list[int]) -> tuple[list[Any], list[int]]:
    """Log-probs of each labelled example run alone: its slice of every per-token key, true positions (never the
    row's own position_ids: :func:`~pytest_packcheck.checks.reference.position_ids_alone`), use_cache=False, no
    mask."""
    import torch

    from ..checks.reference import position_ids_alone

    out, which = [], []
    pos = row.batch.get("position_ids")
    for i, s in enumerate(row.slices):
        seg_targets = targets[:, s.start:s.stop - 1]
        if s.stop - s.start < 2 or not bool((seg_targets != IGNORE_INDEX).any()):
            continue  # nothing labelled (padding, a prompt-only example): nothing to compare, no forward spent
        inputs = {k: v[:, s] for k, v in row.batch.items()
                  if k not in _ROW_KEYS and k != "position_ids" and isinstance(v, torch.Tensor) and tuple(v.shape) == (1, row.total)}
        if isinstance(pos, torch.Tensor):  # a continuation chunk at its own first position (issue 41)
            inputs["position_ids"] = position_ids_alone(row.continued.get(s.start, row.first), s.stop - s.start, like=pos)
        inputs["use_cache"] = False
        lp, _ = _log_probs(model, inputs, seg_targets, fused)
        counter[0] += 1
        out.append(lp)
        which.append(i)
    return out, which


def _compare(row: _Row, trainer: Any, targets: Any, packed: Any, solo: list[Any], which: list[int]) -> dict[str, Any]:
    """Worst per-token log-prob diff, per example (NaN where a number is not finite), and the token-mean losses:
    the packed row's over the tokens the trainer scores, the reference's over each example's own tokens."""
    import math

    per, total_s, count = [], 0.0, 0
    finite = True
    for lp, i in zip(solo, which, strict=True):
        s = row.slices[i]
        keep = targets[0, s.start:s.stop - 1] != IGNORE_INDEX
        a, b = packed[s.start:s.stop - 1][keep], lp[keep]
        worst = float((a - b).abs().max())
        finite = finite and math.isfinite(worst) and bool(a.isfinite().all()) and bool(b.isfinite().all())
        per.append(worst)
        total_s, count = total_s - float(b.sum()), count + int(keep.sum())
    # the trainer's tokens, summed per example in the reference's order (a 0.0 difference stays 0.0), then the
    # tokens it scores across example starts
    scored = trainer[0] != IGNORE_INDEX
    trainer_count, total_p = int(scored.sum()), 0.0
    inside = scored.clone()
    for s in row.slices:
        part = scored[s.start:s.stop - 1]
        if bool(part.any()):
            total_p -= float(packed[s.start:s.stop - 1][part].sum())
        inside[s.start:s.stop - 1] = False
    if bool(inside.any()):
        total_p -= float(packed[inside].sum())
    loss_p = total_p / trainer_count if trainer_count else None
    loss_s = total_s / count if count else None
    nan = float("nan")
    worst_all = (nan if any(math.isnan(x) for x in per) else max(per)) if per else None
    return {"max": worst_all, "per_example": per, "loss_packed": loss_p, "loss_reference": loss_s,
            "loss_delta": abs(loss_p - loss_s) if loss_p is not None and loss_s is not None else None,
            "label_tokens": count, "trainer_label_tokens": trainer_count,
            "finite": finite and all(x is None or math.isfinite(x) for x in (loss_p, loss_s))}
