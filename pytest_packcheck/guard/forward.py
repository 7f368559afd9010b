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


def _row_log_probs(model: Any, keys: dict[str, Any], r: int, targets: Any, fused: bool, rows: int,
                   logits: Any = None) -> Any:
    """Log-probs ``(length - 1,)`` of row ``r`` of the whole batch run together (targets of the other rows -100).
    ``logits``: the batch's logits ``(rows, length, vocab)`` from one forward already run (not with ``fused``:
    TRL's fused head takes each row's labels in its forward)."""
    import torch

    accepted = _accepts(model)
    call = {k: v for k, v in keys.items() if accepted is None or k in accepted or k == "position_ids"}
    if fused:
        labels = torch.full((rows, targets.shape[1] + 1), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
        labels[r, 1:] = targets[0]
        return model(**call, labels=labels, fused_lm_head=True).log_probs[r].float()
    logits = (model(**call).logits if logits is None else logits)[r, :-1].float()
    keep = targets[0] != IGNORE_INDEX
    lp = torch.zeros(targets.shape[1], dtype=torch.float32, device=logits.device)
    lp[keep] = logits[keep].log_softmax(-1).gather(-1, targets[0, keep][:, None])[:, 0]
    return lp


def _solo(model: Any, row: _Row, targets: Any, fused: bool, counter: list[int],
          only: set[int] | None = None) -> tuple[list[Any], list[int]]:
    """Log-probs of each labelled example run alone (of the examples ``only``, default all): its slice of every
    per-token key, true positions (never the row's own position_ids:
    :func:`~pytest_packcheck.checks.reference.position_ids_alone`), use_cache=False, no mask. The per-example
    truth, one forward per example."""
    import torch

    from ..checks.reference import position_ids_alone

    out, which = [], []
    pos = row.batch.get("position_ids")
    for i, s in enumerate(row.slices):
        seg_targets = targets[:, s.start:s.stop - 1]
        if (only is not None and i not in only) or s.stop - s.start < 2 or not bool((seg_targets != IGNORE_INDEX).any()):
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


#: Right-padded reference batches hold at most this many padded tokens per real token (examples sorted by length,
#: grouped greedily): 64 examples of 8-16 tokens run as one batch; one of 700 beside 63 of 10 runs in its own. 1.5,
#: not 1.25: a forward's fixed cost (masks, RoPE tables, the calls of every layer) outweighs a quarter more padded
#: tokens on the bench's row (benchmarks/bench_guard.py, 64 examples in 4 rows of a tiny qwen2: 2 padded groups, not
#: 3; guard / step 1.04 vs 1.30, medians of 11 interleaved pairs at load 11 on 2 shared cores).
_PAD_BUDGET = 1.5


def _groups(lengths: dict[int, int]) -> list[list[int]]:
    """Example indices grouped for right-padded batches: sorted by length (longest first), a group grows while its
    padded area ``len(group) * longest`` stays within :data:`_PAD_BUDGET` times its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= _PAD_BUDGET * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _batchable(model: Any, row: _Row, fused: bool) -> str | None:
    """Why the examples cannot run as right-padded batches (then each runs alone, :func:`_solo`), or None.
    A padded batch needs a forward that takes ``attention_mask`` and no per-token key but ``input_ids``
    and ``position_ids`` (a key packcheck does not know how to pad stays one-at-a-time); TRL's fused LM head and
    stateful layers (conv / SSM states that a padding token may reach: :func:`~pytest_packcheck.checks.probes.stateful_layers`)
    run one at a time, as measured against the per-example truth in tests/test_guard.py."""
    import torch

    from ..checks.probes import stateful_layers

    accepted = _accepts(model)
    if accepted is not None and "attention_mask" not in accepted:
        return f"{type(model).__name__}.forward takes no attention_mask"
    if fused:
        return "TRL's fused LM head"
    extra = [k for k, v in row.batch.items() if k not in _ROW_KEYS and k not in ("input_ids", "position_ids")
             and isinstance(v, torch.Tensor) and tuple(v.shape) == (1, row.total)]
    if extra:
        return f"per-token keys {', '.join(extra)}"
    if stateful_layers(model):
        return "stateful layers"
    return None


def _reference(model: Any, row: _Row, targets: Any, fused: bool, counter: list[int]) -> tuple[list[Any], list[int]]:
    """The per-example reference of :func:`_solo`, its labelled examples run as right-padded batches
    (:func:`_groups`; each example's own ``position_ids`` from its first position, the pads at 0, an
    ``attention_mask`` of its real tokens, use_cache=False): one forward per group instead of one per example.
    A group of one runs exactly as :func:`_solo` runs it. Where :func:`_batchable` says no, :func:`_solo` itself.

    The padded batch is not bit-identical to one-at-a-time in every kernel (a different GEMM shape): the guard
    uses it for the pass path only and recomputes :func:`_solo` before judging a mismatch (verify._measure), so a
    failing verdict, its numbers and its diagnosis are the one-at-a-time truth's. Returns (log-probs, indices)
    as :func:`_solo`; ``counter`` counts the forwards."""
    import torch

    if _batchable(model, row, fused) is not None:
        return _solo(model, row, targets, fused, counter)
    pos = row.batch.get("position_ids")
    lengths = {}
    for i, s in enumerate(row.slices):
        seg_targets = targets[:, s.start:s.stop - 1]
        if s.stop - s.start >= 2 and bool((seg_targets != IGNORE_INDEX).any()):
            lengths[i] = s.stop - s.start
    results: dict[int, Any] = {}
    ids = row.batch["input_ids"]
    accepted = _accepts(model)
    for group in _groups(lengths):
        if len(group) == 1:
            out, _ = _solo(model, row, targets, fused, counter, only={group[0]})
            results[group[0]] = out[0]
            continue
        width = lengths[group[0]]
        starts = torch.tensor([row.slices[i].start for i in group], device=ids.device)
        sizes = torch.tensor([lengths[i] for i in group], device=ids.device)
        offsets = torch.arange(width, device=ids.device)
        real = offsets[None] < sizes[:, None]  # (group, width): the attention_mask of the real tokens
        where = (starts[:, None] + offsets[None]).clamp(max=row.total - 1)
        inputs: dict[str, Any] = {"input_ids": torch.where(real, ids[0][where], 0), "attention_mask": real.long(),
                                  "use_cache": False}
        if isinstance(pos, torch.Tensor):  # position_ids_alone of each example (its own first position), the pads at 0
            first = torch.tensor([row.continued.get(row.slices[i].start, row.first) for i in group], device=pos.device)
            alone = torch.where(real, first[:, None] + offsets[None], 0).to(pos.dtype)
            inputs["position_ids"] = alone.expand(pos.shape[0], *alone.shape).contiguous() if pos.ndim == 3 else alone
        call = {k: v for k, v in inputs.items() if accepted is None or k in accepted or k == "position_ids"}
        logits = model(**call).logits[:, :-1]
        counter[0] += 1
        wanted = targets[0][where[:, :-1].clamp(max=row.total - 2)]  # (group, width - 1): each example's own targets
        scored = real[:, 1:] & (wanted != IGNORE_INDEX)
        # only the scored tokens' rows of the vocabulary: the pads' (up to a quarter of the batch) are never read
        lp = torch.zeros(scored.shape, dtype=torch.float32, device=logits.device)
        lp[scored] = logits[scored].float().log_softmax(-1).gather(-1, wanted[scored][:, None])[:, 0]
        for r, i in enumerate(group):
            results[i] = lp[r, :lengths[i] - 1]
    which = sorted(results)
    return [results[i] for i in which], which


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
