"""Input variants: the packed rows trainers feed besides ``DataCollatorWithFlattening``'s default output.

The default row (restarting ``position_ids``, no ``attention_mask``) is what transformers' Trainer and TRL send;
other trainers send other shapes of the same information, and each reaches the model through another branch of
transformers' masking and flash code (transformers 5.24, ``masking_utils.find_packed_sequence_indices``: packed
boundaries where ``position_ids`` do not step by 1; ``modeling_flash_attention_utils._flash_attention_forward``:
``cu_seq_lens_q/k`` first, else boundaries from ``position_ids``). One check per variant, each a plain function
``check(wb) -> CheckResult`` over a :class:`checks.Workbench`, each item measured on its own
(``metrics["items"]``) against each example run alone with the same positions:

- :func:`check_offset_positions`: continuation chunks whose ids start at k > 0 (long documents split across rows,
  context-parallel shards);
- :func:`check_cu_seq_lens`: ``cu_seq_lens_q/k`` without ``position_ids``
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)``), the collator's
  cu_seq_lens against its own position_ids, and what a backend follows when the two disagree;
- :func:`check_segment_masks`: a 2-D integer segment-id mask (1,1,1,2,2,3,...: LLaMA-Factory, open-instruct) and a
  4-D boolean block-diagonal mask beside the row;
- :func:`check_single_row`: one unpacked example through the collator must equal the dense path.

No pytest in here. A model or backend that raises on a variant gives that item a verdict with the exception, not
a crash of the check.
"""

from __future__ import annotations

from typing import Any

from ..model import batches as B
from ..results import CheckResult

#: First position id of each example in the offset-positions row (cycled). The first example continues a
#: document (starts at 10, never 0); the third starts at 3 after an example ending at 6, so every boundary is a
#: step other than +1 (a continuation that started at 7 would be indistinguishable from the example before it).
OFFSETS = (10, 0, 3)


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def _tensor(values: list[int], dtype: Any = None, device: str = "cpu") -> Any:
    import torch

    return torch.tensor([values], dtype=dtype or torch.long, device=device)


def cu_seq_lens(lengths: list[int], device: str = "cpu") -> Any:
    """int32 ``(len(lengths) + 1,)``: 0, then the running sum of ``lengths`` (tokens), as flash-attn's varlen
    kernels take them."""
    import torch

    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def flash_kwargs(lengths: list[int], device: str = "cpu") -> dict[str, Any]:
    """``cu_seq_lens_q/k`` int32 and ``max_length_q/k`` Python ints for a row of ``lengths``."""
    cu = cu_seq_lens(lengths, device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": max(lengths), "max_length_k": max(lengths)}


def solo_at(wb: Any, example: list[int], first: int) -> Any:
    """Logits ``(len, vocab)`` float32 of ``example`` run alone with position_ids ``first .. first + len - 1``
    (:meth:`Workbench.solo <pytest_packcheck.checks.workbench.Workbench.solo>` from ``first``)."""
    return wb.solo(example, first=first)


def row_diff(logits: Any, lengths: list[int], refs: list[Any]) -> tuple[float, list[float]]:
    """Max abs diff of a row's logits ``(total, vocab)`` against per-example references, overall and per example."""
    per = [float((logits[s] - r).abs().max()) for s, r in zip(B.segment_slices(lengths), refs, strict=True)]
    return max(per), per


def _measure(wb: Any, batch: dict[str, Any], lengths: list[int], refs: list[Any]) -> tuple[float | None, str]:
    """(max abs diff against ``refs``, "") of the row ``batch``; (None, the exception) when the forward raises."""
    try:
        logits = wb.forward(batch).logits[0].float()
    except Exception as exc:  # noqa: BLE001 - a model that refuses the variant: the item's verdict
        return None, _short(exc)
    return row_diff(logits, lengths, refs)[0], ""


def _judge(items: dict[str, Any], name: str, diff: float | None, error: str, atol: float, cause: str, what: str) -> None:
    if diff is None:
        items[name] = {"status": "fail", "cause": cause, "evidence": f"{what}: the forward raised {error}"}
    elif diff > atol:
        items[name] = {"status": "fail", "cause": cause, "max_abs_diff": diff,
                       "evidence": f"{what}: logits differ from each example alone by {_fmt(diff)}"}
    else:
        items[name] = {"status": "pass", "max_abs_diff": diff, "evidence": f"{what}: = each example alone ({_fmt(diff)})"}


def _verdict(items: dict[str, Any], metrics: dict[str, Any], what: str, wb: Any = None) -> CheckResult:
    """Fail when any item failed (cause: the first failed item's; other failed items' causes are findings). With
    ``wb`` (the hazard variants): when the standard packed row is itself wrong (its logits differ from each
    example alone by more than ``logits_atol``), the variant's failure is the model's own fault, not the
    variant's: the cause is :func:`checks.mismatch_cause`'s (as cache_trap and mask_trap do), the variant's a
    finding, and ``metrics["standard_row_diff"]`` says by how much; ``metrics["standard_row_right"]`` (bool) whether
    it was within ``logits_atol``, i.e. the failure is the variant's own (a ``leak`` of cu_seq_lens without
    position_ids on eager / sdpa included)."""
    metrics["items"] = items
    diffs = [v["max_abs_diff"] for v in items.values() if isinstance(v.get("max_abs_diff"), float)]
    metrics["max_abs_diff"] = max(diffs) if diffs else None
    failed = [(k, v) for k, v in items.items() if v["status"] == "fail"]
    if not failed:
        return CheckResult("pass", metrics, f"{what}: " + "; ".join(f"{k}: {v['evidence']}" for k, v in items.items()))
    (first, head), rest = failed[0], failed[1:]
    message = f"{what}: " + "; ".join(f"{k}: {v['evidence']}" for k, v in failed)
    evidence = {"item": first, "detail": head["evidence"],
                **({"max_abs_diff": head["max_abs_diff"]} if "max_abs_diff" in head else {})}
    findings = [{"cause": v["cause"], "evidence": f"{k}: {v['evidence']}"} for k, v in rest if v["cause"] != head["cause"]]
    if wb is not None:
        from .probes import mismatch_cause

        standard, _ = wb.diff_to_solo(wb.packed_logits())
        metrics["standard_row_diff"] = standard
        # the report counts the failure as the hazard showing (verdicts.hazard_rows) and the remedy is the variant's
        metrics["standard_row_right"] = standard <= wb.tol["logits_atol"]
        if standard > wb.tol["logits_atol"]:  # wrong without the variant too: the model's own fault
            cause, why = mismatch_cause(wb, standard, wb.tol["logits_atol"])
            return CheckResult("fail", metrics, f"{message} (the standard packed row is wrong too: {_fmt(standard)})",
                               cause=cause, evidence={**evidence, **why, "standard_row_diff": standard},
                               findings=[{"cause": head["cause"], "evidence": f"{first}: {head['evidence']}"}, *findings])
    return CheckResult("fail", metrics, message, cause=head["cause"], evidence=evidence, findings=findings)


# ------------------------------------------------------------------------------------------------------------


def check_offset_positions(wb: Any) -> CheckResult:
    """A packed row whose examples' position_ids start at :data:`OFFSETS` (10, 0, 3: the first never contains 0)
    vs each example alone with the same positions, max abs logits diff <= ``logits_atol``; items
    ``position_ids`` (ids only: boundaries from the steps) and ``with_cu_seq_lens`` (ids plus cu_seq_lens_q/k, what
    a context-parallel trainer sends). A forward that raises is the item's verdict (transformers 4.54.1's flash
    path crashes on a row whose ids never contain 0, issue 25). ``metrics["offset_sensitivity"]``: how far an
    example alone at its offset differs from it at 0 (learned absolute positions: large; rotary: ~0, so an offset
    dropped by the model is invisible there, only its boundaries are). Cause: offset_positions."""
    import torch

    lengths = wb.lengths
    offsets = [OFFSETS[i % len(OFFSETS)] + wb.start for i in range(len(lengths))]
    atol = wb.tol["logits_atol"]
    items: dict[str, Any] = {}
    what = f"offset positions ({', '.join(map(str, offsets))})"
    metrics: dict[str, Any] = {"offsets": offsets, "lengths": lengths, "atol": atol}
    refs = []
    for e, k in zip(wb.examples, offsets, strict=True):
        try:
            refs.append(solo_at(wb, e, k))
        except Exception as exc:  # noqa: BLE001 - 4.54.1's flash path: max() of no zero in the ids, even unpacked
            alone = f"one example alone at positions {k}..{k + len(e) - 1} (no packing at all): the forward raised {_short(exc)}"
            for name in ("position_ids", "with_cu_seq_lens"):
                items[name] = {"status": "fail", "cause": "offset_positions", "evidence": alone}
            return _verdict(items, metrics, what, wb)
    ids = [t for e in wb.examples for t in e]
    pos = torch.cat([torch.arange(k, k + n) for k, n in zip(offsets, lengths, strict=True)])[None].to(wb.device)
    row = {"input_ids": _tensor(ids, device=wb.device), "position_ids": pos}
    _judge(items, "position_ids", *_measure(wb, row, lengths, refs), atol, "offset_positions", "position_ids from "
           + ", ".join(map(str, offsets)))
    _judge(items, "with_cu_seq_lens", *_measure(wb, {**row, **flash_kwargs(lengths, wb.device)}, lengths, refs), atol,
           "offset_positions", "with cu_seq_lens_q/k")
    sensitivity = max(float((r - s).abs().max()) for r, s, k in zip(refs, wb.solo_logits(), offsets, strict=True) if k != wb.start)
    metrics["offset_sensitivity"] = sensitivity
    return _verdict(items, metrics, what, wb)


def _boundaries_from_position_ids(position_ids: Any, start: int) -> list[int]:
    """Token indices where ``position_ids`` ``(1, total)`` restart at ``start``, then the total."""
    flat = position_ids[0].tolist()
    return [i for i, p in enumerate(flat) if p == start] + [len(flat)]


def check_cu_seq_lens(wb: Any) -> CheckResult:
    """cu_seq_lens as trainers send them. Items:

    - ``without_position_ids``: ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
      return_position_ids=False)``'s row (input_ids, cu_seq_lens_q/k, max_length_q/k) vs each example alone.
      The flash path keeps the boundaries from cu_seq_lens but the positions run on across examples: rotary
      models are unaffected (relative), learned absolute positions are not (gpt2, cause
      ``positions_not_restarted``); eager / sdpa read no cu_seq_lens and attend across (cause ``leak``). The
      cause comes from perturbing example 0 in that row: the others move (leak) or not.
    - ``agree``: the collator asked for both returns cu_seq_lens_q equal to the restarts of its position_ids
      (cause ``collator_contract``).

    ``metrics["disagreeing"]`` (reported, not judged): position_ids restarting per example with cu_seq_lens of
    another split (the examples' lengths rotated by one): the row's diff against each split's per-example
    references, and which one the backend follows ("cu_seq_lens", "position_ids" or "neither")."""
    atol = wb.tol["logits_atol"]
    lengths, items = wb.lengths, {}
    metrics: dict[str, Any] = {"lengths": lengths, "atol": atol}
    collator = wb.collator_factory(return_position_ids=False, return_flash_attn_kwargs=True, position_ids_start=wb.start)

    def collate(examples: list[list[int]]) -> dict[str, Any]:
        batch = collator([{"input_ids": list(e)} for e in examples], return_tensors="pt")
        return {k: (v.to(wb.device) if hasattr(v, "to") else v) for k, v in batch.items() if k != "labels"}

    batch = collate(wb.examples)
    metrics["keys_without_position_ids"] = sorted(batch)
    if "cu_seq_lens_q" not in batch:
        items["without_position_ids"] = {"status": "not_checked", "evidence": "the installed collator returns no "
                                         "cu_seq_lens_q (return_flash_attn_kwargs: transformers >= 4.52)"}
    else:
        diff, error = _measure(wb, batch, lengths, wb.solo_logits())
        _judge(items, "without_position_ids", diff, error, atol, "positions_not_restarted", "cu_seq_lens_q/k, no position_ids")
        if items["without_position_ids"]["status"] == "fail" and diff is not None:
            vocab = int(wb.config.vocab_size)
            perturbed = [[(t + 1 + vocab // 2) % vocab for t in wb.examples[0]], *wb.examples[1:]]
            rest = slice(lengths[0], sum(lengths))
            moved = float((wb.forward(batch).logits[0, rest].float()
                           - wb.forward(collate(perturbed)).logits[0, rest].float()).abs().max())
            metrics["without_position_ids_moved"] = moved
            if moved > wb.tol["isolation_atol"]:
                items["without_position_ids"]["cause"] = "leak"
                items["without_position_ids"]["evidence"] += f" (perturbing example 0 moves the others by {_fmt(moved)}: no boundaries)"
            else:
                items["without_position_ids"]["evidence"] += (f" (boundaries hold: perturbing example 0 moves the others by "
                                                              f"{_fmt(moved)}; positions run on across examples)")
    both = wb.collator_factory(return_position_ids=True, return_flash_attn_kwargs=True, position_ids_start=wb.start)
    out = both([{"input_ids": list(e)} for e in wb.examples], return_tensors="pt")
    if "cu_seq_lens_q" in out and "position_ids" in out:
        cu, restarts = out["cu_seq_lens_q"].tolist(), _boundaries_from_position_ids(out["position_ids"], wb.start)
        ok = cu == restarts
        items["agree"] = {"status": "pass" if ok else "fail", **({} if ok else {"cause": "collator_contract"}),
                          "evidence": f"cu_seq_lens_q {cu} = position_ids restarts" if ok else
                          f"cu_seq_lens_q {cu} but position_ids restart at {restarts[:-1]} (of {restarts[-1]} tokens)"}
    # a collator whose own two outputs disagree explains whatever the row without position_ids does: its item first
    items = {k: items[k] for k in ("agree", "without_position_ids") if k in items}
    # both given, disagreeing: which one the backend follows
    other = lengths[1:] + lengths[:1]
    if other != lengths:
        row = dict(wb.packed())
        row.pop("labels", None)
        row.update(flash_kwargs(other, wb.device))
        ids = [t for e in wb.examples for t in e]
        split = [ids[s] for s in B.segment_slices(other)]
        by_pos, err = _measure(wb, row, lengths, wb.solo_logits())
        by_cu, _ = _measure(wb, row, other, [solo_at(wb, e, wb.start) for e in split])
        follows = ("raised " + err) if by_pos is None else (
            "position_ids" if by_pos <= atol else "cu_seq_lens" if by_cu is not None and by_cu <= atol else "neither")
        metrics["disagreeing"] = {"position_ids_lengths": lengths, "cu_seq_lens_lengths": other, "follows": follows,
                                  "max_abs_diff_position_ids_split": by_pos, "max_abs_diff_cu_seq_lens_split": by_cu}
    judged = {k: v for k, v in items.items() if v["status"] != "not_checked"}
    if judged:
        result = _verdict(judged, metrics, "cu_seq_lens variants", wb)
    else:  # transformers < 4.52: the collator returns no cu_seq_lens; the disagreeing row is reported, never judged
        metrics["items"] = items
        result = CheckResult("skipped", metrics, "not checked: cu_seq_lens variants: " + "; ".join(
            f"{k}: {v['evidence']}" for k, v in items.items()))
    if "disagreeing" in metrics:
        result.message += f"; position_ids and cu_seq_lens disagreeing: the backend follows {metrics['disagreeing']['follows']}"
    return result


def segment_ids(lengths: list[int]) -> list[int]:
    """The 2-D segment-id mask's row: 1 for every token of the first example, 2 for the second, ..."""
    return [i + 1 for i, n in enumerate(lengths) for _ in range(n)]


def block_diagonal_mask(lengths: list[int], device: str = "cpu") -> Any:
    """bool ``(1, 1, total, total)``: True where query i may attend key j (same example, j <= i)."""
    import torch

    seg = torch.tensor(segment_ids(lengths), device=device)
    total = len(seg)
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def check_segment_masks(wb: Any) -> CheckResult:
    """Masks frameworks send beside the packed row (with its restarting position_ids), each vs each example alone
    (max abs logits diff <= ``logits_atol``). Items: ``segment_ids_2d`` (int64 ``(1, total)`` segment ids 1, 1, ..., 2,
    ...: LLaMA-Factory's and open-instruct's packed mask; transformers reads a 2-D mask as padding, every non-zero
    token attended, and builds no packed mask beside it), ``block_diagonal_4d`` (bool ``(1, 1, total, total)``,
    causal within each example; transformers 5.x passes a 4-D mask through on eager / sdpa, the flash path takes
    none). A forward that raises is the item's verdict. Cause: segment_mask."""
    atol = wb.tol["logits_atol"]
    base = dict(wb.packed())
    base.pop("labels", None)
    lengths, items = wb.lengths, {}
    masks = {"segment_ids_2d": (_tensor(segment_ids(lengths), device=wb.device), "2-D integer segment ids"),
             "block_diagonal_4d": (block_diagonal_mask(lengths, wb.device), "4-D bool block-diagonal mask")}
    for name, (mask, what) in masks.items():
        _judge(items, name, *_measure(wb, {**base, "attention_mask": mask}, lengths, wb.solo_logits()), atol,
               "segment_mask", what)
    return _verdict(items, {"lengths": lengths, "atol": atol}, "segment masks", wb)


def check_single_row(wb: Any) -> CheckResult:
    """One example, unpacked (the workbench's longest), through the flattening collator (restarting position_ids, one
    segment) must equal the dense path (the example alone, :meth:`checks.Workbench.solo`): items ``position_ids``
    and ``with_cu_seq_lens`` (the collator's ``return_flash_attn_kwargs=True`` row), max abs logits diff <=
    ``logits_atol``. transformers 5.3.0 turned Qwen3.5's 3-D position_ids on one sequence into cu_seqlens over 3x
    the tokens (issue 25). Cause: single_row."""
    atol = wb.tol["logits_atol"]
    items: dict[str, Any] = {}
    k = max(range(len(wb.examples)), key=lambda i: wb.lengths[i])
    example, ref = wb.examples[k], wb.solo_logits()[k]
    for name, kwargs, what in (("position_ids", {}, "the collator's position_ids"),
                               ("with_cu_seq_lens", {"flash_kwargs": True}, "position_ids and cu_seq_lens_q/k")):
        batch = dict(wb.packed([example], **kwargs))
        batch.pop("labels", None)
        _judge(items, name, *_measure(wb, batch, [len(example)], [ref]), atol, "single_row", what)
    return _verdict(items, {"length": len(example), "atol": atol}, f"one unpacked row ({len(example)} tokens)")
