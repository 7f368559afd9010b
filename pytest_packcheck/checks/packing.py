"""TRL's packer on its own (``pack_dataset``, no model): the tokens each packing strategy loses, duplicates or cuts
(the ``packing_content`` finding)."""

from __future__ import annotations

import inspect
from typing import Any

from ..results import CheckResult
from .sft_setup import (
    _WHOLE_SEGMENTS,
    STRATEGIES,
    _quiet_datasets,
)


def check_packing_content(wb: Any) -> CheckResult:
    """Token accounting of TRL's ``pack_dataset`` per strategy (:func:`packing_content`): per model, no backend
    (the packer never sees the model). ``pack_dataset`` appeared in TRL 0.16: before, "unsupported"."""
    from ..versions.libraries import module_version

    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return CheckResult("skipped", {}, f"trl is not installed ({exc})")
    version = module_version("trl")
    try:
        with _quiet_datasets():
            content = packing_content()
    except ImportError as exc:
        return CheckResult("unsupported", {"trl": version}, f"not available in trl {version}: {exc}")
    problems = [f"{s}: {p}" for s, v in content.items() for p in v["problems"]]
    metrics = {"trl": version, "strategies": content}
    ran = {s: v for s, v in content.items() if v.get("available", True)}
    summary = "; ".join(f"{s}: {v['lost']} lost ({v['overflow']} overflow), {v['duplicated']} duplicated, {v['tail_starts']} tail starts"
                        for s, v in ran.items())
    if problems:
        return CheckResult("fail", metrics, "; ".join(problems) + f" (trl {version})", cause="packing_content",
                           evidence={s: {k: v[k] for k in ("lost", "duplicated", "tail_starts") if k in v} for s, v in content.items()
                                     if v["problems"]})
    return CheckResult("pass", metrics, f"trl {version}: {summary}")


CONTENT_PROBES = {"mixed": ((40, 10, 70, 25, 5, 90), 64), "tails": ((13, 11), 10)}


def packing_content(pack: Any = None, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Token accounting of TRL's ``pack_dataset`` per strategy over :data:`CONTENT_PROBES`, on examples whose
    token ids are unique (so every output token traces back to one input position).

    What each strategy must do (TRL's documentation): ``bfd`` (and TRL 0.19's ``ffd``) keeps each example's first
    ``seq_length`` tokens, whole and starting at its first token; its overflow may be dropped, but a segment that
    starts inside an example (a truncated tail that lost its prompt) is a failure. ``bfd_split`` loses nothing (its split tails
    are counted, not failed: splitting is what it is for). ``wrapped`` loses nothing, or exactly an unfilled last
    row. No strategy may duplicate a token or exceed ``seq_length`` per row.

    Returns strategy -> {available, lost, overflow, duplicated, tail_starts, rows, probes: {name: {...}},
    problems}; the counts are summed over the probes. Raises ImportError when TRL has no ``pack_dataset``
    (before 0.16).
    """
    from datasets import Dataset

    if pack is None:
        from trl.data_utils import pack_dataset as pack
    params = inspect.signature(pack).parameters
    out: dict[str, Any] = {}
    for strategy in strategies:
        if "strategy" not in params and strategy != "wrapped":  # TRL 0.17's pack_dataset only concatenates and cuts
            out[strategy] = {"available": False, "problems": [], "reason": "pack_dataset has no strategy argument (it wraps)"}
            continue
        entry: dict[str, Any] = {"available": True, "lost": 0, "overflow": 0, "duplicated": 0, "tail_starts": 0, "rows": 0,
                                 "probes": {}, "problems": []}
        for name, (lengths, seq_length) in CONTENT_PROBES.items():
            examples, start = [], 1
            for n in lengths:
                examples.append(list(range(start, start + n)))
                start += n
            try:
                packed = pack(Dataset.from_list([{"input_ids": e} for e in examples]), seq_length,
                              **({"strategy": strategy} if "strategy" in params else {}))
            except (ValueError, KeyError, TypeError) as exc:  # a strategy this TRL does not have
                entry = {"available": False, "problems": [], "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                break
            probe = _account(examples, [list(r) for r in packed["input_ids"]], seq_length, strategy,
                             packed["seq_lengths"] if "seq_lengths" in packed.column_names else None)
            entry["probes"][name] = probe
            for key in ("lost", "overflow", "duplicated", "tail_starts", "rows"):
                entry[key] += probe[key]
            entry["problems"] += [f"{name} probe {list(lengths)} into {seq_length}: {p}" for p in probe.pop("problems")]
        out[strategy] = entry
    return out


def _account(examples: list[list[int]], rows: list[list[int]], seq_length: int, strategy: str,
             seq_lengths: list[list[int]] | None) -> dict[str, Any]:
    """One probe of :func:`packing_content`: counts and problems of ``rows`` packed from ``examples``."""
    tokens = [t for r in rows for t in r]
    seen = set(tokens)
    all_tokens = [t for e in examples for t in e]
    lost = len(set(all_tokens) - seen)
    overflow = sum(max(0, len(e) - seq_length) for e in examples)
    firsts = {e[0] for e in examples}
    segment_starts = []
    for r, lengths in zip(rows, seq_lengths or [[len(r)] for r in rows], strict=True):
        at = 0
        for n in lengths:
            if n and at < len(r):
                segment_starts.append(r[at])
            at += n
    tail_starts = [t for t in segment_starts if t not in firsts] if seq_lengths is not None else []
    problems = []
    if len(tokens) != len(seen):
        problems.append(f"{len(tokens) - len(seen)} tokens duplicated")
    if any(len(r) > seq_length for r in rows):
        problems.append(f"a row of {max(map(len, rows))} tokens exceeds seq_length {seq_length}")
    if strategy in _WHOLE_SEGMENTS:
        if lost > overflow:
            problems.append(f"{lost} tokens lost, at most the {overflow} overflow tokens may be")
        if tail_starts:
            problems.append(f"{len(tail_starts)} segments start inside an example (truncated tails that lost their prompt, "
                            f"{lost} of {overflow} overflow tokens dropped, {len(rows)} rows)")
    elif strategy == "wrapped":
        if lost not in (0, len(all_tokens) % seq_length):
            problems.append(f"{lost} tokens lost, none or the unfilled last row ({len(all_tokens) % seq_length}) may be")
    elif lost:
        problems.append(f"{lost} tokens lost, none may be")
    return {"segments_known": seq_lengths is not None,  # without seq_lengths, tails cannot be told from examples
            "tokens_in": len(all_tokens), "tokens_out": len(tokens), "lost": lost, "overflow": overflow,
            "duplicated": len(tokens) - len(seen), "tail_starts": len(tail_starts), "rows": len(rows),
            "longest_row": max(map(len, rows), default=0), "problems": problems}


def key_number(metrics: dict[str, Any]) -> str | None:
    """packing_content's key number: tails packed without their prompt by the whole-segment strategies (bfd, ffd)
    and tokens duplicated, over the strategies the installed TRL has; None for a result without strategies."""
    if not isinstance(metrics.get("strategies"), dict):
        return None
    ran = {k: v for k, v in metrics["strategies"].items() if v.get("available")}
    tails = sum(v["tail_starts"] for k, v in ran.items() if k in _WHOLE_SEGMENTS)
    return f"{tails} bfd tails, {sum(v['duplicated'] for v in ran.values())} dup" if ran else ""
