"""The checks. Each is a plain function ``check(bench) -> CheckResult``; no pytest in here.

A :class:`Workbench` holds one built model (one model x backend x dtype) plus the examples, and caches the
per-example reference logits, so all checks of a cell group share one model build and one reference run.
Faults can be planted by handing the workbench another model or collator factory (see tests/).

Upstream behaviour the checks rely on (transformers 5.24, read in its source; file names below):
- eager / sdpa / flex build a packed (block-diagonal) mask from ``position_ids`` only when there is no
  attention_mask and no cache (``masking_utils.find_packed_sequence_indices``, transformers >= 4.54);
- the flash path derives varlen boundaries from ``cu_seq_lens_q/k`` or from packed ``position_ids``
  (``modeling_flash_attention_utils._flash_attention_forward``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .backends import (
    FLASH_FAMILY,
    MASKED_BACKENDS,
    backend_availability,
    count_attention_calls,
    effective_attn_implementation,
    is_call_on,
)
from .model import batches as B

# The check names, levels and roles live in the registry; re-exported here for code written against 0.1.
from .registry import CHECKS, DEFAULT_CHECKS, MODEL_LEVEL_CHECKS, NUMERICS_FACTOR, TRAINING_CHECKS  # noqa: F401
from .results import CheckResult


@dataclass
class Workbench:
    """Everything the checks of one cell group share.

    ``model``: a causal LM in eval mode, no dropout (or a multimodal model run on its text path).
    ``examples``: token id lists, lengths :data:`batches.DEFAULT_LENGTHS`. ``tol``: the dtype's tolerances (see
    audit/tolerances.toml). ``layout``: how position_ids reach the model (:class:`batches.PositionLayout`: as
    the collator gives them, or M-RoPE rows for a multimodal model's text path); every forward goes through it.
    """

    model: Any
    config: Any
    backend: str | None
    dtype: str
    tol: dict[str, float]
    device: str = "cpu"
    collator_factory: Callable[..., Any] = B.default_collator_factory
    trl_collator_factory: Callable[..., Any] = B.trl_collator_factory
    examples: list[list[int]] = field(default_factory=list)
    layout: B.PositionLayout = B.PLAIN_POSITIONS
    _cache: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.examples:
            self.examples = B.make_examples(self.config)

    @property
    def lengths(self) -> list[int]:
        return [len(e) for e in self.examples]

    @property
    def start(self) -> int:
        return B.position_ids_start(self.config)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def packed(self, examples: list[list[int]] | None = None, **kwargs: Any) -> dict[str, Any]:
        return B.packed_batch(examples or self.examples, self.collator_factory, self.start, device=self.device, **kwargs)

    def forward(self, batch: dict[str, Any], grad: bool = False, layout: B.PositionLayout | None = None, **kwargs: Any) -> Any:
        """Call the model as a packed-training user would, minus the cache (``use_cache=False``) unless
        ``kwargs`` says otherwise. Keys the forward does not take are dropped, except position_ids, which go
        through ``layout`` (default: the bench's)."""
        import torch

        accepted = self.accepted
        inputs = {k: v for k, v in batch.items() if accepted is None or k in accepted or k == "position_ids"}
        inputs.update(kwargs)
        inputs.setdefault("use_cache", False)
        if "position_ids" in inputs:
            inputs["position_ids"] = (layout or self.layout).apply(inputs["position_ids"])
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            return self.model(**inputs)

    @property
    def accepted(self) -> set[str] | None:
        """Keyword arguments the model's forward takes by name; None when it takes ``**kwargs`` only."""
        params = inspect.signature(self.model.forward).parameters
        named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if "input_ids" not in named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            named |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "num_items_in_batch"}
        return named

    def solo(self, example: list[int], model: Any = None) -> Any:
        """Logits ``(len, vocab)`` float32 of one example run alone, positions from ``start``, ``use_cache=False``,
        no grad; on ``model`` when given (cross_backend's eager twin), else as :meth:`forward` calls the bench's."""
        import torch

        batch = {"input_ids": torch.tensor([example], device=self.device),
                 "position_ids": torch.arange(self.start, self.start + len(example), device=self.device)[None]}
        if model is None:
            return self.forward(batch).logits[0].float()
        with torch.no_grad():
            return model(**{**batch, "position_ids": self.layout.apply(batch["position_ids"])}, use_cache=False).logits[0].float()

    def solo_logits(self) -> list[Any]:
        """:meth:`solo` of each of the bench's examples (cached per model)."""
        key = ("solo", id(self.model))
        if key not in self._cache:
            self._cache[key] = [self.solo(e) for e in self.examples]
        return self._cache[key]

    def packed_logits(self, batch: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Logits ``(total_tokens, vocab)`` float32 of the flattened row (the default row's are cached, keyed by
        the model and collator in use, so a planted fault swapped in by a test is never served stale logits)."""
        if batch is None and not kwargs:
            key = ("packed", id(self.model), id(self.collator_factory))
            if key not in self._cache:
                self._cache[key] = self.forward(self.packed()).logits[0].float()
            return self._cache[key]
        return self.forward(batch or self.packed(), **kwargs).logits[0].float()

    def diff_to_solo(self, logits: Any, skip_first: bool = False) -> tuple[float, list[float]]:
        """Max abs diff of a packed row's logits against the solo runs, overall and per example."""
        per = [
            float((logits[s] - ref).abs().max())
            for s, ref in zip(B.segment_slices(self.lengths), self.solo_logits(), strict=True)
        ]
        return max(per[1:] if skip_first else per), per


def _fmt(x: float) -> str:
    return f"{x:.2e}"


@contextlib.contextmanager
def capture_warnings() -> Iterator[list[str]]:
    """Collect Python warnings and transformers logger warnings raised in the block (messages only)."""
    messages: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Handler()
    logger = logging.getLogger("transformers")
    # transformers' warning_once is an lru_cache: clear it, so a warning an earlier model already emitted in this
    # process is seen again (otherwise the verdict would depend on the order cells run in).
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield messages
        finally:
            logger.removeHandler(handler)
            messages.extend(str(w.message) for w in caught)


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


def check_collate(bench: Workbench) -> CheckResult:
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
    start = bench.start
    lengths = bench.lengths
    total = sum(lengths)
    items: dict[str, Any] = {}
    metrics: dict[str, Any] = {"lengths": lengths, "position_ids_start": start}
    if start:
        _item(items, "position_ids_start", "position_ids_start" in supported,
              f"positions start at {start}; the collator " + ("takes" if "position_ids_start" in supported else
                                                               "has no") + " position_ids_start (added in 5.16)",
              "wrong_positions")
    collator = bench.collator_factory(
        return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start
    )
    batch = collator([{"input_ids": list(e)} for e in bench.examples], return_tensors="pt")
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
        with_empty = collator([{"input_ids": list(e)} for e in bench.examples] + [{"input_ids": []}], return_tensors="pt")
        ok, empty = _describe_empty(with_empty, total, lengths)
    except ValueError as exc:
        ok, empty = True, f"rejected ({exc})"
    metrics["empty_example"] = empty
    _item(items, "empty_example", ok, empty, "empty_example")
    # non-token labels (sequence classification): must be refused clearly, not mangled
    try:
        out = collator([{"input_ids": list(e), "labels": 1} for e in bench.examples[:2]], return_tensors="pt")
        metrics["integer_labels"] = f"accepted silently (labels shape {tuple(out['labels'].shape)})"
        _item(items, "integer_labels", False, "integer (sequence-classification) labels accepted silently", "labels_contract")
    except (ValueError, TypeError) as exc:
        clear = isinstance(exc, ValueError) or "label" in str(exc).lower()
        metrics["integer_labels"] = f"{type(exc).__name__}: {exc}"
        _item(items, "integer_labels", clear, f"refused: {type(exc).__name__}: {exc}" if clear else
              f"integer labels raise an unclear {type(exc).__name__} inside the collator ({exc})", "labels_contract")
    return _items_result(items, metrics, f"DataCollatorWithFlattening, {len(lengths)} examples ({total} tokens)")


def check_collate_trl(bench: Workbench) -> CheckResult:
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

    collator = bench.trl_collator_factory(pad_token_id=bench.pad_id, padding_free=True, pad_to_multiple_of=8,
                                          return_position_ids=True)
    if collator is None:
        return CheckResult("skipped", {}, "trl with padding_free is not installed")
    vocab = int(bench.config.vocab_size)
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


# ------------------------------------------------------------------------------------------------------------
# 2. position_ids


def check_position_ids(bench: Workbench) -> CheckResult:
    """The model consumes position_ids: the packed row with restarting ids vs a plain 0..n-1 range must
    change the logits of the later examples by more than ``position_min_change``."""
    import torch

    if bench.accepted is not None and "position_ids" not in bench.accepted:
        return CheckResult("fail", {}, f"{type(bench.model).__name__}.forward takes no position_ids: packed positions cannot reach the model",
                           cause="ignores_position_ids", evidence={"forward_takes_position_ids": False})
    batch = bench.packed()
    packed = bench.packed_logits()
    plain = dict(batch)
    total = sum(bench.lengths)
    plain["position_ids"] = torch.arange(bench.start, bench.start + total, device=bench.device)[None]
    ranged = bench.packed_logits(plain)
    later = slice(bench.lengths[0], total)
    change = float((packed[later] - ranged[later]).abs().max())
    metrics = {"max_change": change, "threshold": bench.tol["position_min_change"]}
    if change <= bench.tol["position_min_change"]:
        return CheckResult("fail", metrics, f"position_ids ignored: restarting them changed later examples' logits by only {_fmt(change)}",
                           cause="ignores_position_ids", evidence={"max_change": change})
    return CheckResult("pass", metrics, f"restarting position_ids changes later examples' logits by {_fmt(change)}")


# ------------------------------------------------------------------------------------------------------------
# 3. isolation


#: Module class-name fragments of layers that carry state along the sequence (state-space, linear attention,
#: short convolutions): packed examples mix there whatever the attention backend does.
_STATEFUL_FRAGMENTS = ("Mixer", "GatedDeltaNet", "DeltaNet", "LinearAttention", "ShortConv", "RGLRU", "Recurrent", "SSM",
                       "RWKV", "Lightning")


def stateful_layers(model: Any) -> list[str]:
    """Class names of the model's sequence-state layers (``nn.Conv1d`` and mixers / linear attention / SSM
    blocks, not their norms or wrapping layers), sorted and unique; [] for a pure attention model."""
    import torch

    names = set()
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or (
            any(f in name for f in _STATEFUL_FRAGMENTS) and not name.endswith(("Norm", "Block", "Layer", "Model", "ForCausalLM"))
        ):
            names.add(name)
    return sorted(names)


def leak_probe(bench: Workbench) -> dict[str, Any]:
    """The isolation probe, once per workbench (cached): perturb every token of the first example and measure
    how far the other examples' logits move (``max_change``); the same on the row with plain 0..n-1
    position_ids (no boundaries: ``negative_control_change``); the model's stateful layers; and whether the
    packed boundaries reached every attention call (``attention_boundaries``: "reached", "missing" or "none"
    when the model has no attention call to inspect). Every parity check reads its cause from this, so a cell's
    cause does not depend on which other checks ran."""
    key = ("leak_probe", id(bench.model), id(bench.collator_factory))
    if key in bench._cache:
        return bench._cache[key]
    import torch

    vocab = int(bench.config.vocab_size)
    perturbed = [list(e) for e in bench.examples]
    perturbed[0] = [(t + 1 + vocab // 2) % vocab for t in perturbed[0]]
    rest = slice(bench.lengths[0], sum(bench.lengths))
    base_batch, pert_batch = bench.packed(), bench.packed(perturbed)
    moved = float((bench.packed_logits()[rest] - bench.packed_logits(pert_batch)[rest]).abs().max())
    total = sum(bench.lengths)
    plain = torch.arange(bench.start, bench.start + total, device=bench.device)[None]
    # the control row carries no boundary at all: plain positions and none of the flash kwargs (a collator with
    # return_flash_attn_kwargs=True would keep the examples apart through cu_seq_lens, and the control then shows
    # nothing: 0.00e+00 on gpt2 / packcheck_flash_ref, 'probe inconclusive' where the row is fine)
    def unbounded(batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in batch.items() if k not in B.FLASH_KWARGS}, "position_ids": plain}

    control = float(
        (bench.packed_logits(unbounded(base_batch))[rest] - bench.packed_logits(unbounded(pert_batch))[rest]).abs().max()
    )
    try:
        with count_attention_calls(bench.model, bench.lengths) as probe:
            bench.forward(base_batch)
        isolated = [c.isolated for c in probe.calls]
        boundaries = "none" if not isolated else ("missing" if any(i is False for i in isolated) else "reached")
    except Exception:  # noqa: BLE001 - a model the counter cannot wrap: decided by the backend kind below
        boundaries = "unknown"
    out = {"max_change": moved, "negative_control_change": control, "stateful_layers": stateful_layers(bench.model),
           "attention_boundaries": boundaries}
    bench._cache[key] = out
    return out


def mismatch_cause(bench: Workbench, diff: float | None = None, atol: float | None = None) -> tuple[str, dict[str, Any]]:
    """The cause code of a packed-vs-reference difference, from measurements only (:func:`leak_probe`, the
    sliding-window probe): ``stateful_layers`` when the examples mix although attention kept its boundaries (or
    the model has no attention to keep them); ``kernel_numerics`` when the mixing, or ``diff`` with no mixing,
    is within :data:`NUMERICS_FACTOR` times its tolerance; ``leak`` for any other mixing; ``sliding_window``
    when examples within the window match and longer ones do not; ``selection_ties`` when a top-k selection in the
    forward cut through exactly tied scores (:func:`mechanisms.selection_ties`); else ``wrong_positions``."""
    probe = leak_probe(bench)
    moved, iso_tol = probe["max_change"], bench.tol["isolation_atol"]
    evidence: dict[str, Any] = {"isolation_moved": moved, "isolation_atol": iso_tol}
    if moved > iso_tol:
        stateful = probe["stateful_layers"]
        attention_kept = probe["attention_boundaries"] in ("reached", "none") or (
            probe["attention_boundaries"] == "unknown" and bench.backend not in MASKED_BACKENDS)
        if stateful and attention_kept:
            return "stateful_layers", {**evidence, "stateful_layers": stateful[:3], "attention_boundaries": probe["attention_boundaries"]}
        if moved <= NUMERICS_FACTOR * iso_tol:
            return "kernel_numerics", evidence
        return "leak", evidence
    window = _window_probe(bench)
    if window is not None and window["max_abs_diff_within_window"] <= bench.tol["logits_atol"]:
        return "sliding_window", {**evidence, **window}
    from .mechanisms import selection_ties

    ties = selection_ties(bench)  # boundaries hold, yet the rows differ: a top-k cut through tied scores (issue 25)
    if ties and ties["tied_cuts"]:
        return "selection_ties", {**evidence, **ties}
    if diff is not None and atol and diff <= NUMERICS_FACTOR * atol:
        return "kernel_numerics", {**evidence, "diff": diff, "atol": atol}
    return "wrong_positions", {**evidence, **({"diff": diff} if diff is not None else {})}


def positions_probe(bench: Workbench) -> dict[str, Any] | None:
    """Positions as the packed row hands them to the model, each example run alone (cached): the collated
    ``position_ids`` slice of each example (or, where the row has none, the 0..N-1 the model falls back to,
    from ``start``) against its solo run's restart at ``start``. Alone, an example cannot leak, so this number is
    what wrong positions alone do (``max_abs_diff_collated_positions``); None when every slice already restarts."""
    key = ("positions", id(bench.model), id(bench.collator_factory))
    if key in bench._cache:
        return bench._cache[key]
    import torch

    batch = bench.packed()
    total = sum(bench.lengths)
    given = batch.get("position_ids")
    row = given[0].to(bench.device) if given is not None else torch.arange(bench.start, bench.start + total, device=bench.device)
    worst, moved, out = 0.0, 0, None
    for sl, e, ref in zip(B.segment_slices(bench.lengths), bench.examples, bench.solo_logits(), strict=True):
        pos = row[sl]
        if torch.equal(pos, torch.arange(bench.start, bench.start + len(e), device=bench.device)):
            continue
        moved += 1
        logits = bench.forward({"input_ids": torch.tensor([e], device=bench.device), "position_ids": pos[None]}).logits[0].float()
        worst = max(worst, float((logits - ref).abs().max()))
    if moved:
        out = {"max_abs_diff_collated_positions": worst, "examples_with_other_positions": moved,
               "batch_has_position_ids": given is not None}
    bench._cache[key] = out
    return out


def mismatch_causes(bench: Workbench, diff: float | None = None, atol: float | None = None) -> list[dict[str, Any]]:
    """Every cause of a packed-vs-reference difference, each with its own numbers, primary first: the
    :func:`mismatch_cause` code, then ``wrong_positions`` when the collated positions alone (each example run by
    itself with them, :func:`positions_probe`) move the logits by more than ``logits_atol``: e.g. a collator with
    cu_seq_lens but no position_ids (attention isolated, gpt2's learned absolute positions counted over the row)
    beside a leak. A list of ``{"cause", "evidence"}`` records (:attr:`results.CheckResult.causes`)."""
    cause, evidence = mismatch_cause(bench, diff, atol)
    probe = positions_probe(bench) if cause not in ("stateful_layers",) else None
    wrong = probe is not None and probe["max_abs_diff_collated_positions"] > bench.tol["logits_atol"]
    if cause == "wrong_positions" and probe is not None:
        evidence = {**evidence, **probe}
    out = [{"cause": cause, "evidence": evidence}]
    if wrong and cause != "wrong_positions":
        out.append({"cause": "wrong_positions", "evidence": {**probe, "logits_atol": bench.tol["logits_atol"]}})
    return out


def _window_probe(bench: Workbench) -> dict[str, Any] | None:
    """Examples cut below the config's sliding window, packed vs solo (cached): None when the model has no
    window shorter than the longest example."""
    window = getattr(bench.config, "sliding_window", None)
    if not (isinstance(window, int) and 2 < window < max(bench.lengths)):
        return None
    key = ("window", id(bench.model), id(bench.collator_factory))
    if key not in bench._cache:
        short = [e[: max(2, window - 1)] for e in bench.examples]
        solo = [bench.solo(e) for e in short]
        row = bench.packed_logits(bench.packed(short))
        offsets = B.segment_slices([len(e) for e in short])
        bench._cache[key] = {"sliding_window": window, "max_abs_diff_within_window":
                             max(float((row[sl] - ref).abs().max()) for sl, ref in zip(offsets, solo, strict=True))}
    return bench._cache[key]


def check_isolation(bench: Workbench) -> CheckResult:
    """Perturb every token of the first example; the logits of the other examples must not move (max change
    <= ``isolation_atol``). Negative control: the same probe on the row with plain 0..n-1 position_ids (no
    boundaries) must move them by >= ``leak_min``, proving the probe can see a leak on this model
    (:func:`leak_probe`). Causes: leak, stateful_layers, kernel_numerics, probe_inconclusive."""
    probe = leak_probe(bench)
    moved, control = probe["max_change"], probe["negative_control_change"]
    metrics = {"max_change": moved, "negative_control_change": control, "atol": bench.tol["isolation_atol"],
               "stateful_layers": probe["stateful_layers"], "attention_boundaries": probe["attention_boundaries"]}
    if moved > bench.tol["isolation_atol"]:
        cause, evidence = mismatch_cause(bench)
        return CheckResult("fail", metrics, f"leak across boundaries: perturbing example 0 moved the other examples' logits by {_fmt(moved)}",
                           cause=cause, evidence=evidence)
    if control < bench.tol["leak_min"]:
        return CheckResult("error", metrics, f"probe inconclusive: a planted leak (no boundaries) moved logits by only {_fmt(control)}",
                           cause="probe_inconclusive", evidence={"negative_control_change": control, "leak_min": bench.tol["leak_min"]})
    return CheckResult("pass", metrics, f"other examples moved {_fmt(moved)} (a planted leak moves them {_fmt(control)})")


# ------------------------------------------------------------------------------------------------------------
# 4. logits parity


def _two_row_probe(bench: Workbench) -> float | str | None:
    """Two packed rows (batch size 2) of two examples each, position_ids restarting per example and no
    cu_seq_lens: max abs diff of every example against its solo run. Which backends keep boundaries for
    batch > 1 differs (transformers 5.24 derives flash boundaries from position_ids for batch size 1 only).
    None when the examples do not split into two rows of equal length."""
    import torch

    ex = bench.examples
    if len(ex) < 3:
        return None
    # rows [e0 + e1] and [e2 + a cut of e0] of equal length
    first = ex[0] + ex[1]
    cut = len(first) - len(ex[2])
    if cut < 2 or cut > len(ex[0]):
        return None
    rows = [[ex[0], ex[1]], [ex[2], ex[0][:cut]]]
    ids = torch.tensor([[t for e in r for t in e] for r in rows], device=bench.device)
    pos = torch.tensor([[p for e in r for p in range(bench.start, bench.start + len(e))] for r in rows], device=bench.device)
    try:
        out = bench.forward({"input_ids": ids, "position_ids": pos}).logits.float()
    except Exception as exc:  # noqa: BLE001 - a backend that refuses batch > 1 packed rows: say so
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    worst = 0.0
    for r, row in enumerate(rows):
        start = 0
        for e in row:
            ref = bench.solo(e)
            worst = max(worst, float((out[r, start:start + len(e)] - ref).abs().max()))
            start += len(e)
    return worst


def check_logits_parity(bench: Workbench) -> CheckResult:
    """Packed logits vs each example alone (the verdict), and vs right- and left-padded batches (reported;
    a padded batch that differs from the solo runs is named as such, not blamed on packing)."""
    import torch

    packed = bench.packed_logits()
    worst, per = bench.diff_to_solo(packed)
    metrics: dict[str, Any] = {"max_abs_diff_solo": worst, "per_example": per, "atol": bench.tol["logits_atol"]}
    notes = []
    for side in ("right", "left"):
        pb = B.padded_batch(bench.examples, bench.pad_id, side, bench.start, bench.device)
        out = bench.forward(pb).logits.float()
        pad_vs_solo, pack_vs_pad = 0.0, 0.0
        for (row, sl), seg, ref in zip(B.real_token_rows(bench.examples, side), B.segment_slices(bench.lengths), bench.solo_logits(), strict=True):
            pad_vs_solo = max(pad_vs_solo, float((out[row, sl] - ref).abs().max()))
            pack_vs_pad = max(pack_vs_pad, float((out[row, sl] - packed[seg]).abs().max()))
        metrics[f"max_abs_diff_{side}_padded"] = pack_vs_pad
        metrics[f"{side}_padded_vs_solo"] = pad_vs_solo
        if pad_vs_solo > bench.tol["logits_atol"]:
            notes.append(f"{side}-padded batch itself differs from solo runs by {_fmt(pad_vs_solo)}")
    if bench.start and "position_ids" in bench.packed():
        # RoBERTa-likes count positions from padding_idx + 1; a collator without position_ids_start (before
        # 5.16) restarts them at 0. Measure the row both ways, so the report separates shifted positions (what
        # position_ids_start fixes) from boundaries that never reach attention (a leak that stays either way).
        import torch

        for name, first in (("zero_based", 0), ("start_based", bench.start)):
            row = dict(bench.packed())
            row["position_ids"] = torch.cat([torch.arange(first, first + n) for n in bench.lengths])[None].to(bench.device)
            try:
                metrics[f"max_abs_diff_{name}_positions"] = bench.diff_to_solo(bench.packed_logits(row))[0]
            except Exception as exc:  # noqa: BLE001 - e.g. the 5.14 flash path derives no boundary from positions not starting at 0
                metrics[f"max_abs_diff_{name}_positions"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"

        def show(value: Any) -> str:
            return _fmt(value) if isinstance(value, float) else str(value)

        notes.append(f"positions from {bench.start} (position_ids_start, 5.16+): {show(metrics['max_abs_diff_start_based_positions'])}, "
                     f"from 0: {show(metrics['max_abs_diff_zero_based_positions'])}")
    metrics["batch_has_position_ids"] = "position_ids" in bench.packed()
    collator_ids = None
    if bench.layout.rows is not None and metrics["batch_has_position_ids"]:
        # a multimodal model's text path: the collator's (batch, length) ids as the Trainer passes them on, not
        # laid out in M-RoPE rows (Qwen2-VL 5.24 expands them to 3 rows with no text row: no packed mask)
        collator_ids = bench.diff_to_solo(bench.forward(bench.packed(), layout=B.PLAIN_POSITIONS).logits[0].float())[0]
        metrics["max_abs_diff_collator_position_ids"] = collator_ids
        notes.append(f"the collator's (batch, length) position_ids as given: {_fmt(collator_ids)}")
    two_rows = _two_row_probe(bench)
    if two_rows is not None:
        metrics["max_abs_diff_two_rows"] = two_rows
        if isinstance(two_rows, float) and two_rows > bench.tol["logits_atol"]:
            notes.append(f"two packed rows (batch size 2, no cu_seq_lens) differ from solo by {_fmt(two_rows)}")
    if worst > bench.tol["logits_atol"]:
        window = _window_probe(bench)
        if window is not None:
            metrics.update(window)
    findings = []
    if isinstance(two_rows, float) and two_rows > bench.tol["logits_atol"] and worst <= bench.tol["logits_atol"]:
        # only where the packed row itself is right: a row that already leaks says nothing more with two rows
        findings.append({"cause": "batch_rows", "evidence": f"two packed rows differ from solo by {_fmt(two_rows)}"})
    shifted = metrics.get("max_abs_diff_start_based_positions")
    if isinstance(shifted, float) and worst > bench.tol["logits_atol"] and shifted < worst / 10:
        findings.append({"cause": "wrong_positions", "evidence": (
            f"the collated row differs by {_fmt(worst)}; with positions from padding_idx + 1 by {_fmt(shifted)} "
            "(what position_ids_start fixes)")})
    from .mechanisms import mechanism_findings

    findings += mechanism_findings(bench)  # a mechanism longer than the row: named, never a silent pass
    note = f" (note: {'; '.join(notes)})" if notes else ""
    if worst > bench.tol["logits_atol"]:
        bad = [i for i, d in enumerate(per) if d > bench.tol["logits_atol"]]
        causes = mismatch_causes(bench, worst, bench.tol["logits_atol"])
        cause, evidence = causes[0]["cause"], causes[0]["evidence"]
        if cause == "wrong_positions" and isinstance(shifted, float):
            evidence["start_based_positions_diff"] = shifted
        causes[0]["evidence"] = {**evidence, "max_abs_diff_solo": worst}
        named = {c["cause"] for c in causes}
        return CheckResult("fail", metrics, f"packed vs solo logits differ by {_fmt(worst)} (examples {bad}){note}"
                           + _also(causes), causes=causes, findings=[f for f in findings if f["cause"] not in named])
    if collator_ids is not None and collator_ids > bench.tol["logits_atol"]:
        # a verdict, not a note: fed as transformers' Trainer and TRL feed it (the collator's ids), the model leaks;
        # the laid-out row's number says what the remedy gives
        return CheckResult("fail", metrics, (
            f"the collator's (batch, length) position_ids, as the Trainer passes them on, leak: logits differ from "
            f"solo by {_fmt(collator_ids)}; laid out as ({bench.layout.rows}, batch, length) they hold ({_fmt(worst)}){note}"),
            cause="position_layout", evidence={"max_abs_diff_collator_position_ids": collator_ids,
                                               "max_abs_diff_laid_out": worst, "rows": bench.layout.rows},
            findings=findings)
    return CheckResult("pass", metrics, f"packed vs solo max abs diff {_fmt(worst)}{note}", findings=findings)


# ------------------------------------------------------------------------------------------------------------
# 5. loss parity


def _also(causes: list[dict[str, Any]]) -> str:
    """The message's tail for the causes after the first: "; also wrong_positions (max_abs_diff_... 1.2e-01)"."""
    def number(evidence: dict[str, Any]) -> str:
        first = next(((k, v) for k, v in evidence.items() if isinstance(v, float | int) and not isinstance(v, bool)), None)
        return f" ({first[0]} {_fmt(first[1]) if isinstance(first[1], float) else first[1]})" if first else ""

    return "".join(f"; also {c['cause']}{number(c.get('evidence') or {})}" for c in causes[1:])


def _reference_loss(examples: list[list[int]], solo: list[Any], device: str) -> tuple[float, int]:
    """Sum of per-token cross-entropy of each example's next tokens under its solo logits ``(len, vocab)``, and
    the token count (a one-token example adds none)."""
    import torch

    total, count = 0.0, 0
    for e, logits in zip(examples, solo, strict=True):
        target = torch.tensor(e[1:], dtype=torch.long, device=device)  # long even when empty
        total += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
        count += len(target)
    return total, count


def check_loss_parity(bench: Workbench) -> CheckResult:
    """Token-mean loss: packed vs right-padded vs the solo reference. Then gradient accumulation over two
    micro-batches with sum reduction (``num_items_in_batch`` = label tokens != -100 after the shift, counted
    over both micro-batches, as Trainer does since transformers 4.46): packed vs padded vs reference."""
    import torch

    ref_sum, ref_count = _reference_loss(bench.examples, bench.solo_logits(), bench.device)
    if not ref_count:  # every example one token long: no next token to predict (settings refuse such lengths)
        return CheckResult("skipped", {"num_items_expected": 0, "lengths": bench.lengths}, (
            f"not checked: reference loss has no label token (lengths {bench.lengths}: no example of 2 or more tokens)"),
            cause="reference_unavailable", evidence={"num_items_expected": 0, "lengths": bench.lengths})
    reference = ref_sum / ref_count
    packed = bench.packed()
    loss_packed = float(bench.forward(packed, labels=packed["labels"]).loss)
    padded = B.padded_batch(bench.examples, bench.pad_id, "right", bench.start, bench.device)
    loss_padded = float(bench.forward(padded, labels=padded["labels"]).loss)
    # gradient accumulation over two micro-batches: [e0, e1] and [e2] for three examples, [e0] and [e1] for two
    split = (len(bench.examples) + 1) // 2
    micro = [bench.examples[:split], bench.examples[split:]]
    packed_mbs = [bench.packed(m) for m in micro]
    padded_mbs = [B.padded_batch(m, bench.pad_id, "right", bench.start, bench.device) for m in micro]
    n_packed = sum(B.count_label_tokens(mb["labels"]) for mb in packed_mbs)
    n_padded = sum(B.count_label_tokens(mb["labels"]) for mb in padded_mbs)
    ga_packed = sum(float(bench.forward(mb, labels=mb["labels"], num_items_in_batch=torch.tensor(n_packed)).loss) for mb in packed_mbs)
    ga_padded = sum(float(bench.forward(mb, labels=mb["labels"], num_items_in_batch=torch.tensor(n_padded)).loss) for mb in padded_mbs)
    atol = bench.tol["loss_atol"]
    metrics = {
        "loss_reference": reference,
        "loss_packed": loss_packed,
        "loss_padded": loss_padded,
        "loss_delta": abs(loss_packed - reference),
        "padded_delta": abs(loss_padded - reference),
        "num_items_in_batch_packed": n_packed,
        "num_items_in_batch_padded": n_padded,
        "num_items_expected": ref_count,
        "ga_loss_packed": ga_packed,
        "ga_loss_padded": ga_padded,
        "ga_delta": abs(ga_packed - reference),
        "atol": atol,
    }
    problems = []
    if n_packed != ref_count:
        problems.append(f"num_items_in_batch {n_packed} from packed labels, expected {ref_count} ({n_packed - ref_count:+d}; a boundary label is not masked)")
    if metrics["loss_delta"] > atol:
        problems.append(f"token-mean loss packed {loss_packed:.6f} vs reference {reference:.6f} (delta {_fmt(metrics['loss_delta'])})")
    if metrics["ga_delta"] > atol:
        problems.append(f"grad-accum sum loss packed {ga_packed:.6f} vs reference {reference:.6f} (delta {_fmt(metrics['ga_delta'])})")
    if problems:
        logits_diff, _ = bench.diff_to_solo(bench.packed_logits())
        causes = []
        if n_packed != ref_count or logits_diff <= bench.tol["logits_atol"]:
            # a label not masked (the count says so), or logits that match: labels or the count used to normalise
            causes.append({"cause": "loss_normalisation", "evidence": {
                "num_items_in_batch_packed": n_packed, "num_items_expected": ref_count,
                "logits_diff": logits_diff, "loss_delta": metrics["loss_delta"]}})
        if logits_diff > bench.tol["logits_atol"]:  # the logits differ too: their own cause(s), each with its number
            causes += mismatch_causes(bench, logits_diff, bench.tol["logits_atol"])
        return CheckResult("fail", metrics, "; ".join(problems) + _also(causes), causes=causes)
    return CheckResult("pass", metrics, f"loss delta {_fmt(metrics['loss_delta'])}, grad-accum delta {_fmt(metrics['ga_delta'])}, padded delta {_fmt(metrics['padded_delta'])}")


# ------------------------------------------------------------------------------------------------------------
# 6. gradient parity


def check_grad_parity(bench: Workbench) -> CheckResult:
    """After backward of the token-mean loss (train mode), every parameter's gradient, packed vs right-padded:
    relative error ||g_packed - g_padded|| / ||g_padded|| over all parameters, the worst parameter, and the
    cosine similarity."""
    import torch

    avail = backend_availability(bench.backend or "eager", bench.device)
    if not avail.backward:
        return CheckResult("skipped", {}, avail.backward_reason)
    model = bench.model
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def grads(batch: dict[str, Any]) -> list[Any]:
        model.zero_grad(set_to_none=True)
        model.train()
        try:
            bench.forward(batch, grad=True, labels=batch["labels"]).loss.backward()
        finally:
            model.eval()
        return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32) for _, p in params]

    g_packed = grads(bench.packed())
    g_padded = grads(B.padded_batch(bench.examples, bench.pad_id, "right", bench.start, bench.device))
    model.zero_grad(set_to_none=True)
    bad_packed = [n for (n, _), g in zip(params, g_packed, strict=True) if not torch.isfinite(g).all()]
    bad_padded = [n for (n, _), g in zip(params, g_padded, strict=True) if not torch.isfinite(g).all()]
    if bad_packed or bad_padded:  # NaN compares False with every tolerance: never let it reach the test below
        evidence = {"non_finite_packed": bad_packed[:5], "non_finite_padded": bad_padded[:5],
                    "tensors_packed": len(bad_packed), "tensors_padded": len(bad_padded)}
        if bad_packed and not bad_padded:
            return CheckResult("fail", evidence, f"non-finite gradients in the packed run only: {len(bad_packed)} of "
                               f"{len(params)} tensors (first {bad_packed[0]}); the padded run's are finite",
                               cause="non_finite", evidence=evidence)
        return CheckResult("skipped", evidence, f"not checked: reference gradients (padded run) are non-finite in "
                           f"{len(bad_padded)} of {len(params)} tensors (first {bad_padded[0]}; packed run: "
                           f"{len(bad_packed)}): there is no finite reference to compare with",
                           cause="reference_unavailable", evidence={**evidence, "why": "non_finite"})
    flat_a = torch.cat([g.flatten() for g in g_packed])
    flat_b = torch.cat([g.flatten() for g in g_padded])
    if not bool(flat_b.abs().max() > 0):
        # an all-zero reference gradient (no label token, a detached loss) has no direction: a cosine or a relative
        # error against it says nothing about packing, so the check is not judged (never kernel_numerics)
        evidence = {"why": "zero_reference", "reference_grad_norm": 0.0, "packed_grad_norm": float(flat_a.norm()),
                    "label_tokens": B.count_label_tokens(B.padded_batch(bench.examples, bench.pad_id, "right", bench.start, bench.device)["labels"])}
        return CheckResult("skipped", evidence, (
            f"not checked: reference gradients (padded run) are all zero over {len(params)} tensors "
            f"({evidence['label_tokens']} label tokens; packed run norm {_fmt(evidence['packed_grad_norm'])}): nothing to compare"),
            cause="reference_unavailable", evidence=evidence)
    rel = float((flat_a - flat_b).norm() / flat_b.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))
    per = [(float((a - b).norm() / b.norm().clamp_min(1e-12)), n) for (n, _), a, b in zip(params, g_packed, g_padded, strict=True) if b.norm() > 0]
    worst_rel, worst_name = max(per) if per else (0.0, "")
    metrics = {"grad_rel_err": rel, "grad_cosine": cos, "worst_param": worst_name, "worst_param_rel_err": worst_rel,
               "num_params": len(params), "rel_tol": bench.tol["grad_rel_err"], "cos_min": bench.tol["grad_cos_min"]}
    if rel > bench.tol["grad_rel_err"] or cos < bench.tol["grad_cos_min"]:
        logits_diff, _ = bench.diff_to_solo(bench.packed_logits())
        scale = float(flat_a.norm() / flat_b.norm().clamp_min(1e-30))
        causes: list[dict[str, Any]] = []
        if logits_diff > bench.tol["logits_atol"]:
            causes = mismatch_causes(bench, logits_diff, bench.tol["logits_atol"])
            cause, evidence = causes[0]["cause"], causes[0]["evidence"]
        elif cos >= bench.tol["grad_cos_min"]:
            # same direction, another length: the loss is normalised differently (e.g. 28/31 label tokens)
            cause, evidence = "loss_normalisation", {"grad_norm_ratio": scale, "grad_cosine": cos}
        else:
            cause, evidence = ("kernel_numerics" if rel <= NUMERICS_FACTOR * bench.tol["grad_rel_err"] else "wrong_positions",
                               {"grad_rel_err": rel, "logits_diff": logits_diff})
        metrics["grad_norm_ratio"] = scale
        causes = causes or [{"cause": cause, "evidence": evidence}]
        n_packed = B.count_label_tokens(bench.packed()["labels"])
        n_expected = sum(max(0, n - 1) for n in bench.lengths)
        if n_packed != n_expected and all(c["cause"] != "loss_normalisation" for c in causes):
            # a boundary label left unmasked adds a token to the packed loss: its own cause beside the logits'
            causes.append({"cause": "loss_normalisation", "evidence": {"label_tokens_packed": n_packed, "label_tokens_expected": n_expected}})
        return CheckResult("fail", metrics, f"gradients differ: rel err {_fmt(rel)}, cosine {cos:.6f}, norm ratio {scale:.4f}, "
                           f"worst {worst_name} ({_fmt(worst_rel)})" + _also(causes), causes=causes)
    return CheckResult("pass", metrics, f"grad rel err {_fmt(rel)}, cosine {cos:.7f} over {len(params)} tensors")


# ------------------------------------------------------------------------------------------------------------
# 7. backend / fallback


# LlamaAttention, GPT2Attention, ...; LongcatFlashMLA; before 4.48 a class per backend: LlamaFlashAttention2
_ATTENTION_SUFFIXES = ("Attention", "MLA", "FlashAttention2")


def attention_modules(model: Any) -> list[Any]:
    """Innermost modules whose class name ends with "Attention" or "MLA" (LlamaAttention, LongcatFlashMLA)."""
    return [module for module in model.modules() if type(module).__name__.endswith(_ATTENTION_SUFFIXES)
            and not any(type(child).__name__.endswith(_ATTENTION_SUFFIXES) for child in module.children())]


def _sequence_mixer(module: Any, stateful: set[str]) -> bool:
    """A linear-attention / state-space mixer named like attention (KimiLinearDeltaAttention): it keeps its own
    state and dispatches to no attention backend."""
    import torch

    return type(module).__name__ in stateful or any(isinstance(m, torch.nn.Conv1d) for m in module.modules())


def expected_attention_calls(model: Any) -> int:
    """Attention modules found in the model (each called once by a plain forward); :func:`check_backend` counts
    the ones that actually run instead (see :func:`count_attention_module_runs`)."""
    return len(attention_modules(model))


@contextlib.contextmanager
def count_attention_module_runs(model: Any, calls: list[Any]) -> Iterator[list[int]]:
    """Attention dispatches each attention-module forward made while the block runs (``calls``: the probe's
    list of dispatches, read before and after each forward), one entry per forward: a layer reused across cycles
    (hrm_text's H/L cycles) has an entry per run, a module that never runs on the text path (a vision tower's
    attention, phi4_multimodal's audio blocks) none, diffllama's differential attention 2 per run."""
    runs: list[int] = []
    starts: list[int] = []
    stateful = set(stateful_layers(model))

    def pre(*_: Any) -> None:
        starts.append(len(calls))

    def post(module: Any, *_: Any) -> None:
        n = len(calls) - starts.pop()
        if n or not _sequence_mixer(module, stateful):  # a mixer that dispatches nothing is not an attention call
            runs.append(n)

    modules = attention_modules(model)
    handles = [m.register_forward_pre_hook(pre) for m in modules] + [m.register_forward_hook(post) for m in modules]
    try:
        yield runs
    finally:
        for handle in handles:
            handle.remove()


# names of attention backends as transformers writes them; "flash-linear-attention" (a linear-attention kernel
# package) and causal_conv1d fallbacks are other components, reported but not a backend swap
_ATTENTION_WORDS = ("sdpa", "eager", "flash_attention", "flex_attention", "scaled_dot_product", "attn_implementation",
                    "attention implementation")
_FALLBACK_WORDS = ("fall back", "falling back", "fallback", "not support", "instead of", "will be used")


def check_backend(bench: Workbench) -> CheckResult:
    """Requested vs effective attn_implementation; attention calls per backend in one packed forward (expected:
    one per attention layer, all on the requested backend); whether the packed boundaries reached every call
    (mask / cu_seq_lens inspected); fallback warnings logged during the forward."""
    requested = bench.backend
    effective = effective_attn_implementation(bench.model)
    if requested and requested.startswith("paged|") and effective == requested.removeprefix("paged|"):
        requested = effective  # transformers drops the prefix it deprecated (5.x: "only needed for paged|eager")
    found = expected_attention_calls(bench.model)
    with capture_warnings() as logged, count_attention_calls(bench.model, bench.lengths) as probe, \
            count_attention_module_runs(bench.model, probe.calls) as runs:
        bench.forward(bench.packed())  # a real forward, never the cached logits
    # each attention-module forward that ran must dispatch at least once (diffllama dispatches twice); where no
    # module ran through a module call, one per module found
    expected = sum(max(1, n) for n in runs) if runs else found
    counts = probe.counts()
    on_requested = sum(v for k, v in counts.items() if is_call_on(k, requested))
    others = {k: v for k, v in counts.items() if not is_call_on(k, requested)}
    isolated = [c.isolated for c in probe.calls]
    # only attention fallbacks: a convolution kernel falling back to PyTorch (causal_conv1d) is not a backend swap
    fallback_msgs = [m for m in logged if any(w in m.lower() for w in _FALLBACK_WORDS)
                     and any(a in m.lower() for a in _ATTENTION_WORDS)]
    metrics = {
        "requested": requested,
        "effective": effective,
        "calls": counts,
        "expected_calls": expected,
        "attention_modules_found": found,
        "attention_module_runs": len(runs),
        "dispatches_per_run": sorted(set(runs)),
        "varlen_kernel_calls": probe.varlen_calls,
        "dense_kernel_calls": probe.dense_flash_calls,
        "boundaries_reached": sum(1 for i in isolated if i),
        "boundaries_missing": sum(1 for i in isolated if i is False),
        "warnings": fallback_msgs[:3],
        "other_fallback_warnings": [m[:200] for m in logged if m not in fallback_msgs and any(w in m.lower() for w in _FALLBACK_WORDS)][:3],
    }
    contract = kernel_argument_items(probe.varlen_arguments)
    if contract:
        metrics["kernel_arguments"] = contract
    swap = {"requested": requested, "effective": effective, "calls": counts}
    if effective != requested:
        return CheckResult("fallback", metrics, f"requested {requested}, model runs {effective}", cause="backend_swap", evidence=swap)
    if others:
        return CheckResult("fallback", metrics, f"silent backend swap: requested {requested} but attention ran on {others}",
                           cause="backend_swap", evidence=swap)
    if fallback_msgs:
        return CheckResult("fallback", metrics, f"fallback warning: {fallback_msgs[0][:160]}", cause="backend_swap",
                           evidence={**swap, "warning": fallback_msgs[0][:160]})
    if expected and not counts and requested == "eager":
        return CheckResult("skipped", metrics, f"{type(bench.model).__name__} computes eager attention inline (no dispatch function to count); isolation and parity checks still apply")
    count = {"attention_calls": on_requested, "attention_module_runs": len(runs), "attention_modules_found": found}
    if expected and on_requested == 0:
        return CheckResult("fail", metrics, f"no attention call reached {requested} (expected {expected})", cause="backend_swap",
                           evidence=count)
    if on_requested != expected:
        return CheckResult("fail", metrics, (
            f"{on_requested} attention calls on {requested}, expected {expected} ({len(runs)} forward calls of attention "
            f"modules in this packed forward, each dispatching at least once; {found} attention modules found)"),
            cause="call_count", evidence=count)
    if requested in FLASH_FAMILY and (probe.dense_flash_calls or probe.varlen_calls != on_requested):
        return CheckResult("fail", metrics, (
            f"varlen kernel called {probe.varlen_calls} times and the dense (padded) flash kernel "
            f"{probe.dense_flash_calls} times for {on_requested} attention calls: the dense path ran"),
            cause="dense_kernel", evidence={"varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls})
    broken = {k: v for k, v in contract.items() if v["status"] == "fail" and v["kind"] != "fa4"}
    if broken:  # a real flash kernel (no enforcement of its own) received what it refuses or misreads
        name, item = next(iter(broken.items()))
        return CheckResult("fail", metrics, (
            f"the varlen kernel received {name}: {item['received']} in {item['calls_failing']} of {item['calls']} calls; "
            f"it requires {item['expected']}"), cause="kernel_arguments",
            evidence={k: {"received": v["received"], "calls_failing": v["calls_failing"]} for k, v in broken.items()})
    if metrics["boundaries_missing"]:
        return CheckResult("fail", metrics, f"packed boundaries missing in {metrics['boundaries_missing']} of {len(isolated)} attention calls",
                           cause="leak", evidence={"boundaries_missing": metrics["boundaries_missing"], "attention_calls": len(isolated)})
    if expected == 0:
        return CheckResult("skipped", metrics, f"{type(bench.model).__name__} has no attention layers: no backend to verify")
    # items FlashAttention-2 accepts and FlashAttention-4 does not (a 0-d tensor max_seqlen): a finding beside the pass
    fa4 = [{"cause": "kernel_arguments", "evidence": f"{k}: {v['received']} in {v['calls_failing']} of {v['calls']} varlen "
            f"calls; FlashAttention-2 takes it, FlashAttention-4 requires {v['expected']}"}
           for k, v in contract.items() if v["status"] == "fail" and v["kind"] == "fa4"]
    held = sum(1 for v in contract.values() if v["status"] == "pass")
    note = f"; varlen kernel arguments: {held}/{len(contract)} contract items hold" if contract else ""
    return CheckResult("pass", metrics, f"{on_requested}/{expected} calls on {requested}, boundaries reached in all{note}",
                       findings=fa4)


def kernel_argument_items(calls: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The varlen kernel argument contract over one forward's calls (:func:`backends.varlen_argument_contract`
    per call), item by item: ``status`` pass (held in every call), fail (broken in at least one) or n/a (not
    decidable), what was received (the first failing call's, else the first call's), the expected value, the
    kernel source that states it, its kind (refused / misread / fa4) and the call counts. Empty without varlen
    calls."""
    from .backends import VARLEN_CONTRACT

    out: dict[str, dict[str, Any]] = {}
    for name, (expected, source, kind) in VARLEN_CONTRACT.items():
        seen = [c[name] for c in calls if name in c]
        if not seen:
            continue
        failing = [i for i in seen if i["ok"] is False]
        decided = [i for i in seen if i["ok"] is not None]
        status = "fail" if failing else ("pass" if decided else "n/a")
        out[name] = {"status": status, "received": (failing or seen)[0]["received"], "expected": expected,
                     "source": source, "kind": kind, "calls": len(seen), "calls_failing": len(failing)}
    return out


# ------------------------------------------------------------------------------------------------------------
# 8. the cache trap


def check_cache_trap(bench: Workbench) -> CheckResult:
    """Packed forward as a Trainer user calls it (train mode, labels, use_cache left as configured) vs with
    use_cache=False, both against the solo runs. Fails when packing is correct only with use_cache=False:
    a cache disables the packed mask on eager/sdpa/flex (masking_utils, transformers >= 4.54)."""
    import torch

    batch = bench.packed()
    model = bench.model
    model.train()
    try:
        with torch.no_grad():  # forward-only: no backward needed to see the mask, and flex has none on CPU
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "labels")}
            if "position_ids" in inputs:
                inputs["position_ids"] = bench.layout.apply(inputs["position_ids"])
            default_logits = model(**inputs).logits[0].float()
    finally:
        model.eval()
    diff_default, _ = bench.diff_to_solo(default_logits)
    diff_no_cache, _ = bench.diff_to_solo(bench.packed_logits())
    atol = bench.tol["logits_atol"]
    metrics = {"config_use_cache": getattr(model.config, "use_cache", None), "max_abs_diff_default": diff_default,
               "max_abs_diff_use_cache_false": diff_no_cache, "atol": atol}
    if diff_default <= atol:
        return CheckResult("pass", metrics, f"correct with defaults (diff {_fmt(diff_default)})")
    evidence = {"max_abs_diff_default": diff_default, "max_abs_diff_use_cache_false": diff_no_cache, "atol": atol}
    if diff_no_cache <= atol:
        return CheckResult("fail", metrics, f"cache trap: correct only with use_cache=False (default {_fmt(diff_default)} vs {_fmt(diff_no_cache)})",
                           cause="cache_trap", evidence=evidence)
    cause, why = mismatch_cause(bench, diff_no_cache, atol)  # the row is wrong without the cache too: the model's own fault
    return CheckResult("fail", metrics, f"wrong with and without use_cache (default {_fmt(diff_default)}, use_cache=False {_fmt(diff_no_cache)})",
                       cause=cause, evidence={**evidence, **why})


# ------------------------------------------------------------------------------------------------------------
# 9. the attention_mask trap


def check_mask_trap(bench: Workbench) -> CheckResult:
    """The packed row with an all-ones ``attention_mask`` added (what a padding collator or a hand-written
    training loop passes along) vs without, both against the solo runs.

    eager/sdpa/flex build the packed mask only when attention_mask is None (masking_utils, >= 4.54), so the
    mask wins there. The flash path unpads from a mask that has padding, but its mask function drops an
    all-ones mask (measured: boundaries kept on 5.24). Fails when the mask makes examples attend to each other;
    ``max_abs_diff_without_mask`` shows whether the row was right without it.
    """
    import torch

    batch = dict(bench.packed())
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    diff_mask, _ = bench.diff_to_solo(bench.packed_logits(batch))
    diff_plain, _ = bench.diff_to_solo(bench.packed_logits())
    atol = bench.tol["logits_atol"]
    metrics = {"max_abs_diff_with_mask": diff_mask, "max_abs_diff_without_mask": diff_plain, "atol": atol}
    if diff_mask <= atol:
        return CheckResult("pass", metrics, f"boundaries hold with an all-ones attention_mask (diff {_fmt(diff_mask)})")
    evidence = {"max_abs_diff_with_mask": diff_mask, "max_abs_diff_without_mask": diff_plain, "atol": atol}
    if diff_plain <= atol:
        return CheckResult("fail", metrics, f"mask trap: an all-ones attention_mask overrides the packed boundaries "
                           f"(diff {_fmt(diff_mask)}; without it {_fmt(diff_plain)})", cause="mask_override", evidence=evidence)
    cause, why = mismatch_cause(bench, diff_plain, atol)  # the row is wrong without the mask too: the model's own fault
    return CheckResult("fail", metrics, f"wrong with and without attention_mask (with {_fmt(diff_mask)}, without {_fmt(diff_plain)})",
                       cause=cause, evidence={**evidence, **why})


# ------------------------------------------------------------------------------------------------------------
# 10. cross-backend parity, causality, edge lengths


def _eager_twin(bench: Workbench) -> Any:
    """A copy of the workbench's model on eager attention, same weights (cached per model): the reference every
    other backend's per-example logits are compared with. ``set_attn_implementation`` from transformers 4.48 (it
    reaches every sub-config); before, the configs' ``_attn_implementation`` is set directly. A model whose
    attention modules are a class per backend (before 4.48: LlamaFlashAttention2, LlamaSdpaAttention), which a
    config switch does not change, is built again on eager and given the same weights."""
    key = ("eager_twin", id(bench.model))
    if key not in bench._cache:
        import copy

        setter = getattr(bench.model, "set_attn_implementation", None)
        per_backend = any(type(m).__name__.endswith(("FlashAttention2", "SdpaAttention")) for m in bench.model.modules())
        if per_backend and not callable(setter):
            config = copy.deepcopy(bench.model.config)
            config._attn_implementation_internal = None
            param = next(bench.model.parameters())
            twin = type(bench.model)._from_config(config, attn_implementation="eager", torch_dtype=param.dtype)
            twin.load_state_dict(bench.model.state_dict())
            bench._cache[key] = twin.to(param.device).eval()
            return bench._cache[key]
        twin = copy.deepcopy(bench.model)
        setter = getattr(twin, "set_attn_implementation", None)
        if callable(setter):
            setter("eager")
        else:
            for module in twin.modules():
                config = getattr(module, "config", None)
                if config is not None and hasattr(config, "_attn_implementation_internal"):
                    config._attn_implementation_internal = "eager"
        bench._cache[key] = twin
    return bench._cache[key]


def window_probe_lengths(bench: Workbench) -> list[int]:
    """Example lengths around the model's sliding window (window - 1, window, window + 3) when it has one within
    64 tokens; [] otherwise."""
    window = getattr(bench.config, "sliding_window", None)
    if isinstance(window, int) and 2 < window <= 64:
        return [window - 1, window, window + 3]
    return []


def check_cross_backend(bench: Workbench) -> CheckResult:
    """This backend's per-example (unpacked) logits vs eager's on the same weights (a deep copy switched to eager),
    on the bench's examples and on lengths around the sliding window (:func:`window_probe_lengths`): max abs
    diff <= ``logits_atol``. Catches what packed-vs-solo cannot, because packed and solo runs share it: a backend
    that applies another sliding window, softcap or scaling than eager. Not planned on eager (the reference).
    Causes: sliding_window (only examples longer than the window differ), cross_backend."""
    if bench.backend in (None, "eager"):
        return CheckResult("skipped", {}, "eager is the reference other backends are compared with")
    twin = _eager_twin(bench)
    extra = B.make_examples(bench.config, tuple(window_probe_lengths(bench)), seed=3) if window_probe_lengths(bench) else []
    diffs = [(len(e), float((mine - bench.solo(e, twin)).abs().max()))  # this backend's solo logits are cached
             for e, mine in zip(bench.examples, bench.solo_logits(), strict=True)]
    for e in extra:
        diffs.append((len(e), float((bench.solo(e) - bench.solo(e, twin)).abs().max())))
    atol = bench.tol["logits_atol"]
    worst = max(d for _, d in diffs)
    metrics = {"max_abs_diff_vs_eager": worst, "per_length": {str(n): d for n, d in diffs}, "atol": atol,
               "window_probe_lengths": window_probe_lengths(bench)}
    if worst <= atol:
        return CheckResult("pass", metrics, f"per-example logits = eager's within {_fmt(worst)} on {len(diffs)} examples "
                           f"(lengths {sorted({n for n, _ in diffs})})")
    window = getattr(bench.config, "sliding_window", None)
    bad = sorted({n for n, d in diffs if d > atol})
    evidence = {"max_abs_diff_vs_eager": worst, "lengths_off": bad}
    if isinstance(window, int) and all(n > window for n in bad) and any(n <= window for n, _ in diffs):
        return CheckResult("fail", metrics, f"per-example logits differ from eager's by {_fmt(worst)} only above the "
                           f"{window}-token sliding window (lengths {bad})", cause="sliding_window",
                           evidence={**evidence, "sliding_window": window})
    return CheckResult("fail", metrics, f"per-example logits differ from eager's by {_fmt(worst)} (lengths {bad}): this "
                       "backend computes another attention than eager, packed or not", cause="cross_backend", evidence=evidence)


def check_causality(bench: Workbench) -> CheckResult:
    """For each example of the packed row, perturb its last token alone; no position before it (in that example or
    an earlier one) may move (<= ``isolation_atol``), while the perturbed position's own logits must (>= ``leak_min``:
    the perturbation reached the model). A causal model that leaks moves only later positions, so this tells
    non-causal (bidirectional) attention from a leak, even when the boundaries hold. Cause: non_causal."""
    vocab = int(bench.config.vocab_size)
    base = bench.packed_logits()
    change, own, first = 0.0, float("inf"), None
    for k, sl in enumerate(B.segment_slices(bench.lengths)):
        perturbed = [list(e) for e in bench.examples]
        perturbed[k][-1] = (perturbed[k][-1] + 1 + vocab // 2) % vocab
        moved = (base - bench.packed_logits(bench.packed(perturbed))).abs().amax(dim=-1)
        last = sl.stop - 1
        own = min(own, float(moved[last]))
        if last:
            before = float(moved[:last].max())
            if before > change:
                change = before
                first = int((moved[:last] > bench.tol["isolation_atol"]).nonzero().flatten()[0]) if before > bench.tol["isolation_atol"] else first
    metrics = {"max_change_earlier": change, "perturbed_position_change": own, "atol": bench.tol["isolation_atol"],
               "leak_min": bench.tol["leak_min"]}
    if change > bench.tol["isolation_atol"]:
        return CheckResult("fail", metrics, f"not causal: changing an example's last token moved earlier positions' "
                           f"logits by {_fmt(change)} (first at token {first})", cause="non_causal",
                           evidence={"max_change_earlier": change, "first_position": first})
    if own < bench.tol["leak_min"]:
        return CheckResult("error", metrics, f"probe inconclusive: the perturbed tokens' own logits moved only {_fmt(own)}",
                           cause="probe_inconclusive", evidence={"perturbed_position_change": own})
    return CheckResult("pass", metrics, f"earlier positions moved {_fmt(change)} (the perturbed ones {_fmt(own)})")


#: Rows of the edge-length probe: one-token examples (two adjacent), an example exactly at the sliding window
#: (``w``, replaced by the window or 8), and one example much longer than the rest.
EDGE_ROWS = ((1, 1, 9), ("w", 5), (40, 2, 3))


def check_edge_lengths(bench: Workbench) -> CheckResult:
    """Packed rows of edge lengths (:data:`EDGE_ROWS`) vs each example alone: max abs logits diff <=
    ``logits_atol``, and the packed token-mean loss vs the per-example reference (one-token examples carry no
    label) <= ``loss_atol``. Causes: as :func:`mismatch_cause`."""

    window = getattr(bench.config, "sliding_window", None)
    w = window if isinstance(window, int) and 2 < window <= 64 else 8
    rows, worst_row, worst, loss_worst = [], None, 0.0, 0.0
    for r, spec in enumerate(EDGE_ROWS):
        lengths = tuple(w if n == "w" else n for n in spec)
        examples = B.make_examples(bench.config, lengths, seed=10 + r)
        batch = bench.packed(examples)
        out = bench.forward(batch, labels=batch["labels"])
        logits = out.logits[0].float()
        solo = [bench.solo(e) for e in examples]
        diff = max(float((logits[sl] - ref).abs().max()) for sl, ref in zip(B.segment_slices(list(lengths)), solo, strict=True))
        total, count = _reference_loss(examples, solo, bench.device)
        loss_delta = abs(float(out.loss) - total / max(count, 1))
        rows.append({"lengths": list(lengths), "max_abs_diff": diff, "loss_delta": loss_delta})
        if diff >= worst:
            worst, worst_row = diff, list(lengths)
        loss_worst = max(loss_worst, loss_delta)
    metrics = {"rows": rows, "max_abs_diff": worst, "max_loss_delta": loss_worst, "atol": bench.tol["logits_atol"]}
    if worst > bench.tol["logits_atol"] or loss_worst > bench.tol["loss_atol"]:
        cause, evidence = mismatch_cause(bench, worst, bench.tol["logits_atol"]) if worst > bench.tol["logits_atol"] else (
            "loss_normalisation", {"max_loss_delta": loss_worst})
        return CheckResult("fail", metrics, f"edge lengths: packed vs solo logits differ by {_fmt(worst)} (row {worst_row}), "
                           f"loss by {_fmt(loss_worst)}", cause=cause, evidence={**evidence, "row": worst_row})
    return CheckResult("pass", metrics, f"{len(rows)} edge rows ({', '.join(str(r['lengths']) for r in rows)}): logits "
                       f"{_fmt(worst)}, loss {_fmt(loss_worst)}")
