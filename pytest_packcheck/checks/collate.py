"""The collators' contracts, item by item: transformers' DataCollatorWithFlattening and TRL's padding-free
collator (the ``finding`` checks collate and collate_trl)."""

from __future__ import annotations

import itertools
from typing import Any

from ..model import batches as B
from ..results import CheckResult
from .workbench import Workbench

# ------------------------------------------------------------------------------------------------------------
# 1. collate


def _item(items: dict[str, Any], name: str, ok: bool, evidence: str, cause: str = "collator_contract") -> None:
    items[name] = {"status": "pass" if ok else "fail", "evidence": evidence, **({} if ok else {"cause": cause})}


def _items_result(items: dict[str, Any], metrics: dict[str, Any], what: str) -> CheckResult:
    """A contract check's verdict from its items: fail when any item failed; the cause is the first failed
    item's, every other failed item's cause is a finding. Every item was checked on its own."""
    metrics["items"] = items
    failed = [(k, v) for k, v in items.items() if v["status"] == "fail"]
    if not failed:
        return CheckResult("pass", metrics, f"{what}: {len(items)} contract items hold")
    (first, head), rest = failed[0], failed[1:]
    return CheckResult("fail", metrics, "; ".join(f"{k}: {v['evidence']}" for k, v in failed),
                       cause=head["cause"], evidence={"item": first, "detail": head["evidence"]},
                       findings=[{"cause": v["cause"], "evidence": f"{k}: {v['evidence']}"} for k, v in rest
                                 if v["cause"] != head["cause"]])


def _describe_empty(batch: dict[str, Any], total: int, lengths: list[int]) -> tuple[bool, str]:
    """What the collator did with an empty example appended to ``lengths``: (acceptable, what happened).
    Dropped means every per-token key has ``total`` tokens and cu_seq_lens has no zero-length segment."""
    shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "labels", "position_ids", "seq_idx") if k in batch}
    cu = batch.get("cu_seq_lens_q")
    cu_list = cu.tolist() if cu is not None else None
    zero_length = cu_list is not None and any(b == a for a, b in itertools.pairwise(cu_list))
    if all(s[-1] == total for s in shapes.values()) and not zero_length:
        return True, "dropped"
    parts = [f"{k} {list(v)}" for k, v in shapes.items()]
    text = "kept, not dropped: " + ", ".join(parts) + (f", cu_seq_lens_q {cu_list}" if cu_list is not None else "")
    return False, text


def check_collate(wb: Workbench) -> CheckResult:
    """transformers' ``DataCollatorWithFlattening`` contract, each item checked and reported on its own
    (``metrics["items"]``: status, evidence, cause), on the workbench's examples:

    - ``position_ids_start``: an architecture whose positions start at padding_idx + 1 needs the collator's
      ``position_ids_start`` (transformers >= 5.16);
    - ``shapes``: input_ids, labels, position_ids, seq_idx all (1, total tokens);
    - ``position_ids``: restart at ``start`` per example;
    - ``labels``: -100 at every example's first token;
    - ``cu_seq_lens``: cu_seq_lens_q/k int32, 0 .. total at the example boundaries;
    - ``max_length``: max_length_q/k Python ints equal to the longest example;
    - ``empty_example``: an empty example appended is dropped or refused with a ValueError (measured: dropped on
      5.24; on 4.56.2 it is kept, labels (1, 9) against input_ids (1, 8), cu_seq_lens [0, 3, 8, 8]);
    - ``integer_labels``: non-token (sequence-classification) labels refused with a clear error.

    A stack finding (registry role): reported once per environment, never a model failure.
    """
    import torch

    supported = B.collator_supports()
    start = wb.start
    lengths = wb.lengths
    total = sum(lengths)
    items: dict[str, Any] = {}
    metrics: dict[str, Any] = {"lengths": lengths, "position_ids_start": start}
    if start:
        _item(items, "position_ids_start", "position_ids_start" in supported,
              f"positions start at {start}; the collator " + ("takes" if "position_ids_start" in supported else
                                                               "has no") + " position_ids_start (added in 5.16)",
              "wrong_positions")
    collator = wb.collator_factory(
        return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start
    )
    batch = collator([{"input_ids": list(e)} for e in wb.examples], return_tensors="pt")
    token_keys = [k for k in ("input_ids", "labels", "position_ids", "seq_idx") if k in batch]
    shapes = {k: tuple(batch[k].shape) for k in token_keys}
    metrics["shapes"] = {k: list(v) for k, v in shapes.items()}
    wrong = {k: list(v) for k, v in shapes.items() if v != (1, total)}
    _item(items, "shapes", not wrong, f"per-token keys (1, {total})" if not wrong else f"keys differ from (1, {total}): {wrong}")
    expected_pos = torch.cat([torch.arange(start, start + n) for n in lengths])
    if "position_ids" not in batch:
        _item(items, "position_ids", False, "no position_ids returned", "wrong_positions")
    else:
        got = batch["position_ids"][0][:total]
        bad = (got != expected_pos[: len(got)]).nonzero().flatten().tolist() + list(range(len(got), total))
        metrics["position_ids_mismatches"] = len(bad)
        _item(items, "position_ids", not bad, f"restart at {start} per example" if not bad else
              f"do not restart at {start} per example: {len(bad)} tokens wrong, first at index {bad[0]}", "wrong_positions")
    if "labels" in batch:
        starts = [s.start for s in B.segment_slices(lengths)]
        labels = batch["labels"][0].tolist()
        unmasked = [i for i in starts if i >= len(labels) or labels[i] != B.IGNORE_INDEX]
        metrics["unmasked_boundaries"] = len(unmasked)
        _item(items, "labels", not unmasked, f"-100 at all {len(starts)} example starts" if not unmasked else
              f"not -100 at {len(unmasked)} example boundaries (token indices {unmasked})")
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + n)
    cu_problems = []
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key not in batch:
            if "return_flash_attn_kwargs" in supported:
                cu_problems.append(f"{key} missing although return_flash_attn_kwargs=True")
            continue
        cu = batch[key]
        if cu.dtype != torch.int32:
            cu_problems.append(f"{key} dtype {cu.dtype}, flash-attn needs torch.int32")
        if cu.tolist() != expected_cu:
            cu_problems.append(f"{key}={cu.tolist()}, expected {expected_cu}")
    if "return_flash_attn_kwargs" in supported:
        _item(items, "cu_seq_lens", not cu_problems, f"int32 {expected_cu}" if not cu_problems else "; ".join(cu_problems))
        max_problems = [f"{key}={batch[key]!r} ({type(batch[key]).__name__}), expected Python int {max(lengths)}"
                        for key in ("max_length_q", "max_length_k")
                        if key in batch and (type(batch[key]) is not int or batch[key] != max(lengths))]
        _item(items, "max_length", not max_problems, f"Python int {max(lengths)}" if not max_problems else "; ".join(max_problems))
    # an empty example, appended: dropped, refused, or kept (and then what it did to the row)
    try:
        with_empty = collator([{"input_ids": list(e)} for e in wb.examples] + [{"input_ids": []}], return_tensors="pt")
        ok, empty = _describe_empty(with_empty, total, lengths)
    except ValueError as exc:
        ok, empty = True, f"rejected ({exc})"
    metrics["empty_example"] = empty
    _item(items, "empty_example", ok, empty, "empty_example")
    # non-token labels (sequence classification): must be refused clearly, not mangled
    try:
        out = collator([{"input_ids": list(e), "labels": 1} for e in wb.examples[:2]], return_tensors="pt")
        metrics["integer_labels"] = f"accepted silently (labels shape {tuple(out['labels'].shape)})"
        _item(items, "integer_labels", False, "integer (sequence-classification) labels accepted silently", "labels_contract")
    except (ValueError, TypeError) as exc:
        clear = isinstance(exc, ValueError) or "label" in str(exc).lower()
        metrics["integer_labels"] = f"{type(exc).__name__}: {exc}"
        _item(items, "integer_labels", clear, f"refused: {type(exc).__name__}: {exc}" if clear else
              f"integer labels raise an unclear {type(exc).__name__} inside the collator ({exc})", "labels_contract")
    return _items_result(items, metrics, f"DataCollatorWithFlattening, {len(lengths)} examples ({total} tokens)")


def check_collate_trl(wb: Workbench) -> CheckResult:
    """TRL's padding-free collator (``DataCollatorForLanguageModeling(padding_free=True)``) with
    pad_to_multiple_of=8 on a 1027-token row, each item on its own (``metrics["items"]``):

    - ``shapes``: input_ids, labels, position_ids, seq_idx all padded to the same 1032 tokens (a shorter
      position_ids makes the model's rotary tables mismatch);
    - ``position_ids``: restart at 0 per example;
    - ``labels``: -100 at each example's first token;
    - ``labels_padding``: -100 on the padding.

    Each item is read on the tokens that exist, so a row whose keys have the wrong length still has its labels
    looked at. Skipped when TRL (with padding_free) is not installed. A stack finding (registry role)."""
    import math

    collator = wb.trl_collator_factory(pad_token_id=wb.pad_id, padding_free=True, pad_to_multiple_of=8,
                                          return_position_ids=True)
    if collator is None:
        return CheckResult("skipped", {}, "trl with padding_free is not installed")
    vocab = int(wb.config.vocab_size)
    lengths = B.TRL_PROBE_LENGTHS
    examples = [{"input_ids": [(7 * i + j) % (vocab - 1) + 1 for j in range(n)]} for i, n in enumerate(lengths)]
    total = sum(lengths)
    padded = math.ceil(total / 8) * 8
    metrics: dict[str, Any] = {"tokens": total, "pad_to_multiple_of": 8}
    try:
        batch = collator(examples)
    except Exception as exc:  # noqa: BLE001 - the collator itself failing is the finding
        metrics["exception"] = f"{type(exc).__name__}: {exc}"
        return CheckResult("fail", metrics, f"TRL padding-free collator raised {type(exc).__name__}: {exc}",
                           cause="collator_contract", evidence={"exception": metrics["exception"]})
    shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "labels", "position_ids", "seq_idx") if k in batch}
    metrics["shapes"] = {k: list(v) for k, v in shapes.items()}
    items: dict[str, Any] = {}
    wrong = {k: list(v) for k, v in shapes.items() if v != (1, padded)}
    _item(items, "shapes", not wrong, f"per-token keys (1, {padded})" if not wrong else f"keys differ from (1, {padded}): {wrong}")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    if "position_ids" in batch:
        pos = batch["position_ids"][0].tolist()
        bad = [s for s, n in zip(starts, lengths, strict=True) if pos[s:s + n] != list(range(n))]
        _item(items, "position_ids", not bad, "restart at 0 per example" if not bad else
              f"do not restart at the examples starting at {bad}", "collator_contract")
    else:
        _item(items, "position_ids", False, "no position_ids returned")
    if "labels" in batch:
        labels = batch["labels"][0].tolist()
        at_starts = [s for s in starts if s >= len(labels) or labels[s] != B.IGNORE_INDEX]
        _item(items, "labels", not at_starts, f"-100 at all {len(starts)} example starts" if not at_starts else
              f"not -100 at the example starts {at_starts}")
        on_pad = [i for i in range(total, min(padded, len(labels))) if labels[i] != B.IGNORE_INDEX]
        _item(items, "labels_padding", not on_pad, f"-100 on {padded - total} padding tokens" if not on_pad else
              f"not -100 on {len(on_pad)} padding tokens")
    else:
        _item(items, "labels", False, "no labels returned")
    return _items_result(items, metrics, f"TRL padding-free collator, {len(lengths)} examples ({total} tokens, padded to {padded})")
