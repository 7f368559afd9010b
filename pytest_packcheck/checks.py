"""The checks. Each is a plain function ``check(bench) -> CheckResult``; no pytest in here.

A :class:`Workbench` holds one built model (one model x backend x dtype) plus the examples, and caches the
per-example reference logits, so all checks of a cell group share one model build and one reference run.
Faults can be planted by handing the workbench another model or collator factory (see tests/).

Upstream behaviour the checks rely on (transformers 5.24, FIELD-NOTES):
- eager / sdpa / flex build a packed (block-diagonal) mask from ``position_ids`` only when there is no
  attention_mask and no cache (``masking_utils.find_packed_sequence_indices``, transformers >= 4.54);
- the flash path derives varlen boundaries from ``cu_seq_lens_q/k`` or from packed ``position_ids``
  (``modeling_flash_attention_utils._flash_attention_forward``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import batches as B
from .backends import FLASH_FAMILY, backend_availability, count_attention_calls
from .results import CheckResult

#: Check names in matrix order. :data:`MODEL_LEVEL_CHECKS` run per model (no backend); the others per model x backend.
CHECKS = ("collate", "position_ids", "isolation", "logits_parity", "loss_parity", "grad_parity", "backend", "cache_trap",
          "mask_trap", "trainer", "sft", "sft_padding_free", "sft_strategies", "packing_content")
MODEL_LEVEL_CHECKS = ("collate", "packing_content")
#: Whole Trainer / SFTTrainer runs (and TRL's packer): opt in with --packcheck-checks or audit/training.toml.
TRAINING_CHECKS = ("trainer", "sft", "sft_padding_free", "sft_strategies", "packing_content")
#: Checks run when none are named: all but :data:`TRAINING_CHECKS`.
DEFAULT_CHECKS = tuple(c for c in CHECKS if c not in TRAINING_CHECKS)


@dataclass
class Workbench:
    """Everything the checks of one cell group share.

    ``model``: a causal LM in eval mode, no dropout. ``examples``: token id lists, lengths
    :data:`batches.DEFAULT_LENGTHS`. ``tol``: the dtype's tolerances (see audit/tolerances.toml).
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

    def forward(self, batch: dict[str, Any], grad: bool = False, **kwargs: Any) -> Any:
        """Call the model as a packed-training user would, minus the cache (``use_cache=False``) unless
        ``kwargs`` says otherwise. Keys the forward does not take are dropped, except position_ids."""
        import torch

        accepted = self.accepted
        inputs = {k: v for k, v in batch.items() if accepted is None or k in accepted or k == "position_ids"}
        inputs.update(kwargs)
        inputs.setdefault("use_cache", False)
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

    def solo_logits(self) -> list[Any]:
        """Logits ``(len_i, vocab)`` float32 of each example run alone (positions from ``start``)."""
        key = ("solo", id(self.model))
        if key not in self._cache:
            import torch

            outs = []
            for e in self.examples:
                ids = torch.tensor([e], device=self.device)
                pos = torch.arange(self.start, self.start + len(e), device=self.device)[None]
                outs.append(self.forward({"input_ids": ids, "position_ids": pos}).logits[0].float())
            self._cache[key] = outs
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


def check_collate(bench: Workbench) -> CheckResult:
    """The flattening collator's contract on the examples plus one empty example.

    Measures: per-token key lengths, position_ids restart at ``start`` (0, or padding_idx + 1 for RoBERTa-likes),
    labels == -100 at every boundary, cu_seq_lens_q/k int32 from 0 to the token count, max_length_q/k Python
    ints, empty examples dropped or rejected, non-token (integer) labels rejected with a clear error.
    """
    import torch

    problems: list[str] = []
    supported = B.collator_supports()
    start = bench.start
    if start and "position_ids_start" not in supported:
        problems.append(f"architecture starts positions at {start} but the collator has no position_ids_start (added in 5.16)")
    lengths = bench.lengths
    features = [{"input_ids": list(e)} for e in bench.examples] + [{"input_ids": []}]
    collator = bench.collator_factory(
        return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start
    )
    metrics: dict[str, Any] = {"lengths": lengths, "position_ids_start": start}
    try:
        batch = collator(features, return_tensors="pt")
        empty = "dropped"
    except ValueError as exc:
        empty = f"rejected ({exc})"
        batch = collator(features[:-1], return_tensors="pt")
    metrics["empty_example"] = empty
    total = sum(lengths)
    token_keys = [k for k in ("input_ids", "labels", "position_ids", "seq_idx") if k in batch]
    shapes = {k: tuple(batch[k].shape) for k in token_keys}
    metrics["shapes"] = {k: list(v) for k, v in shapes.items()}
    if any(s != (1, total) for s in shapes.values()):
        problems.append(f"per-token keys differ from (1, {total}): {shapes}")
    expected_pos = torch.cat([torch.arange(start, start + n) for n in lengths])
    if "position_ids" not in batch:
        problems.append("no position_ids returned")
    elif batch["position_ids"].shape[-1] == total:
        bad = (batch["position_ids"][0] != expected_pos).nonzero().flatten().tolist()
        metrics["position_ids_mismatches"] = len(bad)
        if bad:
            problems.append(f"position_ids do not restart at {start} per example: {len(bad)} tokens wrong, first at index {bad[0]}")
    if "labels" in batch and batch["labels"].shape[-1] == total:
        starts = [s.start for s in B.segment_slices(lengths)]
        unmasked = [i for i in starts if int(batch["labels"][0, i]) != B.IGNORE_INDEX]
        metrics["unmasked_boundaries"] = len(unmasked)
        if unmasked:
            problems.append(f"labels not -100 at {len(unmasked)} example boundaries (token indices {unmasked})")
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + n)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key not in batch:
            if "return_flash_attn_kwargs" in supported:
                problems.append(f"{key} missing although return_flash_attn_kwargs=True")
            continue
        cu = batch[key]
        if cu.dtype != torch.int32:
            problems.append(f"{key} dtype {cu.dtype}, flash-attn needs torch.int32")
        if cu.tolist() != expected_cu:
            problems.append(f"{key}={cu.tolist()}, expected {expected_cu}")
    for key in ("max_length_q", "max_length_k"):
        if key in batch and (type(batch[key]) is not int or batch[key] != max(lengths)):
            problems.append(f"{key}={batch[key]!r} ({type(batch[key]).__name__}), expected Python int {max(lengths)}")
    # Non-token labels (sequence classification): must be refused clearly, not mangled.
    try:
        out = collator([{"input_ids": list(e), "labels": 1} for e in bench.examples[:2]], return_tensors="pt")
        metrics["integer_labels"] = f"accepted silently (labels shape {tuple(out['labels'].shape)})"
        problems.append("integer (sequence-classification) labels accepted silently")
    except (ValueError, TypeError) as exc:
        clear = isinstance(exc, ValueError) or "label" in str(exc).lower()
        metrics["integer_labels"] = f"{type(exc).__name__}: {exc}"
        if not clear:
            problems.append(f"integer labels raise an unclear {type(exc).__name__} inside the collator ({exc}) [labels contract]")
    problems += _trl_padding_free_probe(bench, metrics)
    if problems:
        return CheckResult("fail", metrics, "; ".join(problems))
    return CheckResult("pass", metrics, f"contract holds for {len(lengths)} examples ({total} tokens); empty example {empty.split(' ')[0]}")


def _trl_padding_free_probe(bench: Workbench, metrics: dict[str, Any]) -> list[str]:
    """TRL's padding-free collator with pad_to_multiple_of=8 on a 1027-token row: every per-token key
    (input_ids, labels, position_ids, seq_idx) must be padded to the same 1032 tokens (a shorter position_ids
    makes the model's rotary tables mismatch), position_ids restart per example, labels are -100 at each
    example's first token and on the padding. Records ``trl_padding_free``; nothing when TRL is absent."""
    import math

    collator = bench.trl_collator_factory(pad_token_id=bench.pad_id, padding_free=True, pad_to_multiple_of=8,
                                          return_position_ids=True)
    if collator is None:
        metrics["trl_padding_free"] = "not checked: trl with padding_free not installed"
        return []
    vocab = int(bench.config.vocab_size)
    lengths = B.TRL_PROBE_LENGTHS
    examples = [{"input_ids": [(7 * i + j) % (vocab - 1) + 1 for j in range(n)]} for i, n in enumerate(lengths)]
    total = sum(lengths)
    padded = math.ceil(total / 8) * 8
    try:
        batch = collator(examples)
    except Exception as exc:  # noqa: BLE001 - the collator itself failing is the finding
        metrics["trl_padding_free"] = f"{type(exc).__name__}: {exc}"
        return [f"TRL padding-free collator raised {type(exc).__name__}: {exc}"]
    shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "labels", "position_ids", "seq_idx") if k in batch}
    metrics["trl_padding_free"] = {"tokens": total, "pad_to_multiple_of": 8, "shapes": {k: list(v) for k, v in shapes.items()}}
    problems = []
    if any(v != (1, padded) for v in shapes.values()):
        problems.append(f"TRL padding-free collator (pad_to_multiple_of=8, {total} tokens): per-token keys differ from "
                        f"(1, {padded}): {shapes}")
    elif "position_ids" in batch:
        pos = batch["position_ids"][0].tolist()
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        wrong = [s for s, n in zip(starts, lengths, strict=True) if pos[s:s + n] != list(range(n))]
        if wrong:
            problems.append(f"TRL padding-free collator: position_ids do not restart at examples starting at {wrong}")
        labels = batch["labels"][0].tolist()
        unmasked = [s for s in starts if labels[s] != B.IGNORE_INDEX] + [i for i in range(total, padded) if labels[i] != B.IGNORE_INDEX]
        if unmasked:
            problems.append(f"TRL padding-free collator: labels not -100 at {len(unmasked)} boundary / padding tokens")
    return problems


# ------------------------------------------------------------------------------------------------------------
# 2. position_ids


def check_position_ids(bench: Workbench) -> CheckResult:
    """The model consumes position_ids: the packed row with restarting ids vs a plain 0..n-1 range must
    change the logits of the later examples by more than ``position_min_change``."""
    import torch

    if bench.accepted is not None and "position_ids" not in bench.accepted:
        return CheckResult("fail", {}, f"{type(bench.model).__name__}.forward takes no position_ids: packed positions cannot reach the model")
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
        return CheckResult("fail", metrics, f"position_ids ignored: restarting them changed later examples' logits by only {_fmt(change)}")
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


def check_isolation(bench: Workbench) -> CheckResult:
    """Perturb every token of the first example; the logits of the other examples must not move (max change
    <= ``isolation_atol``). Negative control: the same probe on the row with plain 0..n-1 position_ids (no
    boundaries) must move them by >= ``leak_min``, proving the probe can see a leak on this model."""
    import torch

    vocab = int(bench.config.vocab_size)
    perturbed = [list(e) for e in bench.examples]
    perturbed[0] = [(t + 1 + vocab // 2) % vocab for t in perturbed[0]]
    rest = slice(bench.lengths[0], sum(bench.lengths))
    base_batch, pert_batch = bench.packed(), bench.packed(perturbed)
    moved = float((bench.packed_logits()[rest] - bench.packed_logits(pert_batch)[rest]).abs().max())
    total = sum(bench.lengths)
    plain = torch.arange(bench.start, bench.start + total, device=bench.device)[None]
    control = float(
        (
            bench.packed_logits({**base_batch, "position_ids": plain})[rest]
            - bench.packed_logits({**pert_batch, "position_ids": plain})[rest]
        ).abs().max()
    )
    metrics = {"max_change": moved, "negative_control_change": control, "atol": bench.tol["isolation_atol"],
               "stateful_layers": stateful_layers(bench.model)}
    if moved > bench.tol["isolation_atol"]:
        return CheckResult("fail", metrics, f"leak across boundaries: perturbing example 0 moved the other examples' logits by {_fmt(moved)}")
    if control < bench.tol["leak_min"]:
        return CheckResult("error", metrics, f"probe inconclusive: a planted leak (no boundaries) moved logits by only {_fmt(control)}")
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
            ref = bench.forward({"input_ids": torch.tensor([e], device=bench.device),
                                 "position_ids": torch.arange(bench.start, bench.start + len(e), device=bench.device)[None]}).logits[0].float()
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
    two_rows = _two_row_probe(bench)
    if two_rows is not None:
        metrics["max_abs_diff_two_rows"] = two_rows
        if isinstance(two_rows, float) and two_rows > bench.tol["logits_atol"]:
            notes.append(f"two packed rows (batch size 2, no cu_seq_lens) differ from solo by {_fmt(two_rows)}")
    window = getattr(bench.config, "sliding_window", None)
    if worst > bench.tol["logits_atol"] and isinstance(window, int) and 2 < window < max(bench.lengths):
        # Examples no longer than the window: if these match and the long ones do not, the window is the cause.
        short = [e[: max(2, window - 1)] for e in bench.examples]
        solo = [bench.forward({"input_ids": torch.tensor([e], device=bench.device),
                               "position_ids": torch.arange(bench.start, bench.start + len(e), device=bench.device)[None]}).logits[0].float()
                for e in short]
        row = bench.packed_logits(bench.packed(short))
        offsets = B.segment_slices([len(e) for e in short])
        metrics["sliding_window"] = window
        metrics["max_abs_diff_within_window"] = max(float((row[sl] - ref).abs().max()) for sl, ref in zip(offsets, solo, strict=True))
    note = f" (note: {'; '.join(notes)})" if notes else ""
    if worst > bench.tol["logits_atol"]:
        bad = [i for i, d in enumerate(per) if d > bench.tol["logits_atol"]]
        return CheckResult("fail", metrics, f"packed vs solo logits differ by {_fmt(worst)} (examples {bad}){note}")
    return CheckResult("pass", metrics, f"packed vs solo max abs diff {_fmt(worst)}{note}")


# ------------------------------------------------------------------------------------------------------------
# 5. loss parity


def _reference_loss(bench: Workbench, examples_idx: list[int]) -> tuple[float, int]:
    """Sum of per-token cross-entropy over the given examples (solo runs) and the token count."""
    import torch

    total, count = 0.0, 0
    for i in examples_idx:
        logits = bench.solo_logits()[i]
        target = torch.tensor(bench.examples[i][1:], device=bench.device)
        total += float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))
        count += len(target)
    return total, count


def check_loss_parity(bench: Workbench) -> CheckResult:
    """Token-mean loss: packed vs right-padded vs the solo reference. Then gradient accumulation over two
    micro-batches with sum reduction (``num_items_in_batch`` = label tokens != -100 after the shift, counted
    over both micro-batches, as Trainer does since transformers 4.46): packed vs padded vs reference."""
    import torch

    ref_sum, ref_count = _reference_loss(bench, list(range(len(bench.examples))))
    reference = ref_sum / ref_count
    packed = bench.packed()
    loss_packed = float(bench.forward(packed, labels=packed["labels"]).loss)
    padded = B.padded_batch(bench.examples, bench.pad_id, "right", bench.start, bench.device)
    loss_padded = float(bench.forward(padded, labels=padded["labels"]).loss)
    # gradient accumulation: micro-batches [e0, e1] and [e2]
    micro = [bench.examples[:2], bench.examples[2:]]
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
        return CheckResult("fail", metrics, "; ".join(problems))
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
    flat_a = torch.cat([g.flatten() for g in g_packed])
    flat_b = torch.cat([g.flatten() for g in g_padded])
    rel = float((flat_a - flat_b).norm() / flat_b.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))
    per = [(float((a - b).norm() / b.norm().clamp_min(1e-12)), n) for (n, _), a, b in zip(params, g_packed, g_padded, strict=True) if b.norm() > 0]
    worst_rel, worst_name = max(per) if per else (0.0, "")
    metrics = {"grad_rel_err": rel, "grad_cosine": cos, "worst_param": worst_name, "worst_param_rel_err": worst_rel,
               "num_params": len(params), "rel_tol": bench.tol["grad_rel_err"], "cos_min": bench.tol["grad_cos_min"]}
    if rel > bench.tol["grad_rel_err"] or cos < bench.tol["grad_cos_min"]:
        return CheckResult("fail", metrics, f"gradients differ: rel err {_fmt(rel)}, cosine {cos:.6f}, worst {worst_name} ({_fmt(worst_rel)})")
    return CheckResult("pass", metrics, f"grad rel err {_fmt(rel)}, cosine {cos:.7f} over {len(params)} tensors")


# ------------------------------------------------------------------------------------------------------------
# 7. backend / fallback


def expected_attention_calls(model: Any) -> int:
    """Attention modules a forward should call once each: innermost modules whose class name ends with
    "Attention" (LlamaAttention, GPT2Attention, ...), skipping linear-attention / state-space mixers."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Attention") and not any(
            type(child).__name__.endswith("Attention") for child in module.children()
        ):
            count += 1
    return count


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
    effective = getattr(bench.model.config, "_attn_implementation", None)
    expected = expected_attention_calls(bench.model)
    with capture_warnings() as logged, count_attention_calls(bench.model, bench.lengths) as probe:
        bench.forward(bench.packed())  # a real forward, never the cached logits
    counts = probe.counts()
    on_requested = sum(v for k, v in counts.items() if k == requested or (requested == "sdpa" and k.startswith("sdpa")))
    others = {k: v for k, v in counts.items() if not (k == requested or (requested == "sdpa" and k.startswith("sdpa")))}
    isolated = [c.isolated for c in probe.calls]
    # only attention fallbacks: a convolution kernel falling back to PyTorch (causal_conv1d) is not a backend swap
    fallback_msgs = [m for m in logged if any(w in m.lower() for w in _FALLBACK_WORDS)
                     and any(a in m.lower() for a in _ATTENTION_WORDS)]
    metrics = {
        "requested": requested,
        "effective": effective,
        "calls": counts,
        "expected_calls": expected,
        "varlen_kernel_calls": probe.varlen_calls,
        "dense_kernel_calls": probe.dense_flash_calls,
        "boundaries_reached": sum(1 for i in isolated if i),
        "boundaries_missing": sum(1 for i in isolated if i is False),
        "warnings": fallback_msgs[:3],
        "other_fallback_warnings": [m[:200] for m in logged if m not in fallback_msgs and any(w in m.lower() for w in _FALLBACK_WORDS)][:3],
    }
    if effective != requested:
        return CheckResult("fallback", metrics, f"requested {requested}, model runs {effective}")
    if others:
        return CheckResult("fallback", metrics, f"silent backend swap: requested {requested} but attention ran on {others}")
    if fallback_msgs:
        return CheckResult("fallback", metrics, f"fallback warning: {fallback_msgs[0][:160]}")
    if expected and not counts and requested == "eager":
        return CheckResult("skipped", metrics, f"{type(bench.model).__name__} computes eager attention inline (no dispatch function to count); isolation and parity checks still apply")
    if expected and on_requested == 0:
        return CheckResult("fail", metrics, f"no attention call reached {requested} (expected {expected})")
    if on_requested != expected:
        return CheckResult("fail", metrics, f"{on_requested} attention calls on {requested}, expected {expected} (one per attention layer)")
    if requested in FLASH_FAMILY and (probe.dense_flash_calls or probe.varlen_calls != on_requested):
        return CheckResult("fail", metrics, (
            f"varlen kernel called {probe.varlen_calls} times and the dense (padded) flash kernel "
            f"{probe.dense_flash_calls} times for {on_requested} attention calls: the dense path ran"))
    if metrics["boundaries_missing"]:
        return CheckResult("fail", metrics, f"packed boundaries missing in {metrics['boundaries_missing']} of {len(isolated)} attention calls")
    if expected == 0:
        return CheckResult("skipped", metrics, f"{type(bench.model).__name__} has no attention layers: no backend to verify")
    return CheckResult("pass", metrics, f"{on_requested}/{expected} calls on {requested}, boundaries reached in all")


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
            default_logits = model(**{k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "labels")}).logits[0].float()
    finally:
        model.eval()
    diff_default, _ = bench.diff_to_solo(default_logits)
    diff_no_cache, _ = bench.diff_to_solo(bench.packed_logits())
    atol = bench.tol["logits_atol"]
    metrics = {"config_use_cache": getattr(model.config, "use_cache", None), "max_abs_diff_default": diff_default,
               "max_abs_diff_use_cache_false": diff_no_cache, "atol": atol}
    if diff_default <= atol:
        return CheckResult("pass", metrics, f"correct with defaults (diff {_fmt(diff_default)})")
    if diff_no_cache <= atol:
        return CheckResult("fail", metrics, f"cache trap: correct only with use_cache=False (default {_fmt(diff_default)} vs {_fmt(diff_no_cache)})")
    return CheckResult("fail", metrics, f"wrong with and without use_cache (default {_fmt(diff_default)}, use_cache=False {_fmt(diff_no_cache)})")


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
    if diff_plain <= atol:
        return CheckResult("fail", metrics, f"mask trap: an all-ones attention_mask overrides the packed boundaries "
                           f"(diff {_fmt(diff_mask)}; without it {_fmt(diff_plain)})")
    return CheckResult("fail", metrics, f"wrong with and without attention_mask (with {_fmt(diff_mask)}, without {_fmt(diff_plain)})")


# ------------------------------------------------------------------------------------------------------------
# 10. training as users run it: Trainer + DataCollatorWithFlattening


TRAINER_STEPS = 3


class _PaddingCollator:
    """Right-padding collator for token lists (what DataCollatorForLanguageModeling(mlm=False) gives, without
    needing a tokenizer): input_ids, attention_mask, labels -100 on the padding."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return B.padded_batch([f["input_ids"] for f in features], self.pad_id, "right")


def _checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on: ``is_activation_checkpointing`` in 5.x,
    ``is_gradient_checkpointing`` before (5.x keeps it, deprecated)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def train_and_restore(model: Any, make_trainer: Callable[[], Any]) -> tuple[list[float], list[float], dict[str, Any]]:
    """Build a trainer with ``make_trainer()``, train it without printing its logs, and return the per-step loss,
    the grad norm from its log history, and the parameters after the last step. The loss is what the trainer's
    own ``compute_loss`` returned, summed over the micro-batches of each optimizer step (the logged loss is
    rounded to 4 decimals in transformers 4.x). The model's weights, ``config.use_cache`` (transformers' Trainer
    and TRL's SFTTrainer both set it), gradient checkpointing and its ``forward`` (accelerate wraps it for mixed
    precision) are restored afterwards, accelerate's process-wide state is reset, and the model is left in eval
    mode; the caller may set ``use_cache`` before the call."""
    import copy

    from transformers.trainer_callback import PrinterCallback

    state = copy.deepcopy(model.state_dict())
    saved_cache = getattr(model.config, "use_cache", None)
    checkpointing = _checkpointing(model)
    own_forward = vars(model).get("forward")  # accelerate wraps model.forward on the instance for mixed precision
    try:
        trainer = make_trainer()
        trainer.remove_callback(PrinterCallback)  # the log history is read below; no printing
        micro: list[float] = []
        compute_loss = trainer.compute_loss

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = compute_loss(*args, **kwargs)
            micro.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

        trainer.compute_loss = recording
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        accum = max(1, int(trainer.args.gradient_accumulation_steps))
        losses = [sum(micro[i:i + accum]) for i in range(0, len(micro), accum)]
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        if not checkpointing and _checkpointing(model):  # the trainer turned it on (gradient_checkpointing=True)
            disable = "activation_checkpointing_disable" if hasattr(type(model), "activation_checkpointing_disable") else "gradient_checkpointing_disable"
            getattr(model, disable)()
        model.load_state_dict(state)
        if saved_cache is not None:
            model.config.use_cache = saved_cache
        if vars(model).get("forward") is not own_forward:
            if own_forward is None:
                del model.forward
            else:
                model.forward = own_forward
        model.eval()
        model.zero_grad(set_to_none=True)
        _reset_accelerate_state()
    return losses, [float(h["grad_norm"]) for h in logs], params


def _reset_accelerate_state() -> None:
    """accelerate keeps one AcceleratorState per process, and a Trainer built later reuses what an earlier one
    set (its mixed precision, for one): measured on transformers 4.56.2, an SFTTrainer run in bf16 changed a
    later Trainer's float32 sdpa loss by 5e-6. Each training run starts from a fresh state."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    reset = getattr(AcceleratorState, "_reset_state", None)
    if reset is not None:
        reset()


#: Learning rate of every training comparison (plain SGD, constant, no clipping).
TRAIN_LR = 1e-2
#: The TrainingArguments / SFTConfig recipe of every trainer run the checks make: what :func:`reference_steps`
#: writes out by hand (plain SGD at TRAIN_LR, constant schedule, no warm-up, decay or clipping; a loss per step).
TRAIN_RECIPE = {"learning_rate": TRAIN_LR, "lr_scheduler_type": "constant", "optim": "sgd", "max_grad_norm": 1e9,
                "warmup_steps": 0, "weight_decay": 0.0, "logging_steps": 1, "seed": 0, "data_seed": 0}


def reference_steps(model: Any, batch: dict[str, Any], steps: int, lr: float = TRAIN_LR) -> tuple[list[float], list[float], dict[str, Any]]:
    """The reference the training checks compare with: ``steps`` plain SGD steps (no momentum, weight decay or
    clipping) on one padded batch, written out by hand. Loss = the model's own token mean over the label tokens
    != -100 after the shift (one batch, so no ``num_items_in_batch`` is needed and the mean is exact); train
    mode, ``use_cache=False``. Per-step loss and grad norm (2-norm over all gradients) and the parameters after
    the last step; the model is restored. Independent of how a Trainer version counts tokens: transformers'
    Trainer normalises padded batches by the label count before the shift in 4.x, and in 5.24 for models whose
    ``loss_type`` is not ForCausalLM (gpt2)."""
    import copy

    import torch

    state = copy.deepcopy(model.state_dict())
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    model.train()
    try:
        for _ in range(steps):
            loss = model(**inputs, use_cache=False).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        model.load_state_dict(state)
        model.eval()
        model.zero_grad(set_to_none=True)
    return losses, norms, params


def _train(bench: Workbench, collator: Any, out_dir: str, use_cache: bool | None, examples: list[list[int]] | None = None,
           batch_size: int | None = None, grad_accum: int = 1, steps: int = TRAINER_STEPS) -> tuple[list[float], list[float], dict[str, Any]]:
    """``steps`` optimizer steps of transformers' Trainer on ``examples`` (default: the bench's, all of them in
    one batch per step), fixed seed and data order, SGD, constant LR, no clipping; per-step loss and grad
    norm, and the parameters after the last step. ``use_cache`` None: the model as configured. The model is
    restored afterwards."""
    import torch
    from transformers import Trainer, TrainingArguments

    model = bench.model
    examples = examples or bench.examples
    saved_cache = getattr(model.config, "use_cache", None)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch_size or len(examples), max_steps=steps, save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True, use_cpu=not bench.device.startswith("cuda"),
        remove_unused_columns=False, gradient_accumulation_steps=grad_accum, **TRAIN_RECIPE,
    )
    data = [{"input_ids": list(e)} for e in examples]

    class _InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:  # fixed data order: micro-batches as listed
            return torch.utils.data.SequentialSampler(self.train_dataset)

    def make_trainer() -> Any:
        if use_cache is not None:
            model.config.use_cache = use_cache
        return _InOrder(model=model, args=args, train_dataset=data, data_collator=collator)

    try:
        return train_and_restore(model, make_trainer)
    finally:
        if saved_cache is not None:
            model.config.use_cache = saved_cache
        torch.manual_seed(0)


def padded_trainer_note(entry: dict[str, Any], ref_loss: list[float], labels: Any, who: str) -> str:
    """A trainer's own padded run (``entry``: its per-step "loss" and "max_loss_delta" against ``ref_loss``) told
    apart: a first-step loss equal to the reference's scaled by shifted / unshifted label tokens of ``labels``
    is a normalisation by the label count before the causal shift (transformers 4.x; gpt2 on 5.24). A packed
    row masks each example's first label, so both counts agree there and the packed run is unaffected. Adds
    ``loss_ratio``, ``label_tokens_shifted_over_unshifted`` and ``normalisation`` to ``entry``; returns a note
    for the check's message ("" when there is no first step to compare)."""
    if not entry.get("loss") or not ref_loss or not ref_loss[0]:
        return ""
    unshifted, shifted = int((labels != B.IGNORE_INDEX).sum()), B.count_label_tokens(labels)
    ratio = entry["loss"][0] / ref_loss[0]
    entry.update({"loss_ratio": ratio, "label_tokens_shifted_over_unshifted": shifted / unshifted})
    if abs(ratio - shifted / unshifted) < 1e-3:
        entry["normalisation"] = "divides by the label count before the shift"
        return (f"; {who}'s own padded run is off: loss x{ratio:.4f} = {shifted}/{unshifted} label tokens after / before "
                "the shift (it divides padded batches by the unshifted count)")
    return f"; {who}'s own padded run differs from the reference by {_fmt(entry['max_loss_delta'])}"


#: Lengths of the three extra examples of the gradient-accumulation probe (two micro-batches of three).
GRAD_ACCUM_LENGTHS = (9, 12, 5)


def _grad_accum(bench: Workbench, collator: Any, out_dir: str) -> dict[str, Any]:
    """One optimizer step of Trainer with gradient_accumulation_steps=2 over two micro-batches of three
    examples (the bench's and three more), use_cache=False. The ``num_items_in_batch`` the Trainer hands the
    model with each micro-batch is captured by a forward pre-hook; it must be the label tokens != -100 after
    the causal shift over both micro-batches (transformers >= 4.46 passes it where the model takes loss
    kwargs). Returns the counts seen (None where the Trainer passed none), the expected count and the loss."""
    model = bench.model
    examples = list(bench.examples) + B.make_examples(bench.config, GRAD_ACCUM_LENGTHS, seed=1)
    seen: list[int | None] = []

    def capture(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        n = kwargs.get("num_items_in_batch")
        seen.append(None if n is None else int(n))

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        loss, norm, _ = _train(bench, collator, out_dir, use_cache=False, examples=examples, batch_size=3, grad_accum=2, steps=1)
    finally:
        handle.remove()
    return {"num_items_in_batch": seen, "expected": sum(len(e) - 1 for e in examples), "micro_batches": len(seen),
            "loss": loss, "grad_norm": norm}


def check_trainer(bench: Workbench) -> CheckResult:
    """Training as a user runs it: transformers' ``Trainer`` with ``DataCollatorWithFlattening``, TRAINER_STEPS
    steps (same examples, seed and order, SGD, constant LR, no clipping), against :func:`reference_steps` on the
    right-padded batch: per-step loss (``train_loss_atol``), grad norm and the parameters after the last step
    (relative, ``train_grad_norm_rel``). The packed run is made twice: with the model as configured (the default
    ``use_cache=True`` of most configs builds a cache, so eager/sdpa/flex get no packed mask: the cache trap, in
    training) and with ``use_cache=False``. Then gradient accumulation 2 x 3 examples (:func:`_grad_accum`):
    the ``num_items_in_batch`` Trainer passes with the packed micro-batches must be the shifted label count.

    Trainer's own padded run is measured too and reported beside the verdict: Trainer normalises a padded batch
    by its label count before the shift in 4.x, and in 5.24 for models whose ``loss_type`` is not ForCausalLM
    (gpt2), which makes it differ from a correct packed run by shifted / unshifted tokens.

    Verdicts: pass when the packed run is right as configured; fail with "correct only with use_cache=False";
    fail when both are wrong, or on a wrong ``num_items_in_batch``."""
    import tempfile

    import torch

    avail = backend_availability(bench.backend or "eager", bench.device)
    if not avail.backward:
        return CheckResult("skipped", {}, avail.backward_reason)
    try:
        from transformers import Trainer  # noqa: F401 - needs accelerate
    except ImportError as exc:
        return CheckResult("skipped", {}, f"transformers' Trainer is not importable ({exc})")
    flat = bench.collator_factory(return_position_ids=True, position_ids_start=bench.start)
    padded = B.padded_batch(bench.examples, bench.pad_id, "right")
    ref_loss, ref_norm, ref_params = reference_steps(bench.model, padded, TRAINER_STEPS)
    with tempfile.TemporaryDirectory(prefix="packcheck-trainer-") as tmp:
        runs = {"as_configured": _train(bench, flat, tmp, use_cache=None), "use_cache_false": _train(bench, flat, tmp, use_cache=False),
                "padded_trainer": _train(bench, _PaddingCollator(bench.pad_id), tmp, use_cache=False)}
        ga_packed, ga_padded = _grad_accum(bench, flat, tmp), _grad_accum(bench, _PaddingCollator(bench.pad_id), tmp)
    # whole optimizer steps: the training tolerances (the sft checks use the same)
    tol_loss, tol_rel = bench.tol["train_loss_atol"], bench.tol["train_grad_norm_rel"]
    ref_flat = torch.cat([p.flatten() for p in ref_params.values()])
    metrics: dict[str, Any] = {"steps": TRAINER_STEPS, "reference_loss": ref_loss, "reference_grad_norm": ref_norm,
                               "config_use_cache": getattr(bench.config, "use_cache", None)}
    verdicts = {}
    for name, (loss, norm, params) in runs.items():
        loss_delta = max((abs(a - b) for a, b in zip(loss, ref_loss, strict=True)), default=float("inf")) if len(loss) == len(ref_loss) else float("inf")
        norm_rel = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norm, ref_norm, strict=True)), default=float("inf")) if len(norm) == len(ref_norm) else float("inf")
        flat_p = torch.cat([params[n].flatten() for n in ref_params])
        param_rel = float((flat_p - ref_flat).norm() / ref_flat.norm().clamp_min(1e-30))
        first_bad = next((i + 1 for i, (a, b) in enumerate(zip(loss, ref_loss, strict=False)) if abs(a - b) > tol_loss), None)
        metrics[name] = {"loss": loss, "grad_norm": norm, "max_loss_delta": loss_delta, "max_grad_norm_rel": norm_rel,
                         "param_rel_diff": param_rel, "first_diverging_step": first_bad}
        verdicts[name] = loss_delta <= tol_loss and norm_rel <= tol_rel and param_rel <= tol_rel
    metrics["max_loss_delta"] = metrics["as_configured"]["max_loss_delta"]
    a, b = metrics["as_configured"], metrics["use_cache_false"]
    pt = metrics["padded_trainer"]
    note = padded_trainer_note(pt, ref_loss, padded["labels"], "Trainer") if not verdicts["padded_trainer"] else ""
    metrics["grad_accum"] = {"packed": ga_packed, "padded": ga_padded}
    counts = {n for n in ga_packed["num_items_in_batch"] if n is not None}
    if counts and counts != {ga_packed["expected"]}:
        off = max(counts, key=lambda n: abs(n - ga_packed["expected"])) - ga_packed["expected"]
        return CheckResult("fail", metrics, f"gradient accumulation 2 x 3 examples: Trainer passed num_items_in_batch "
                           f"{sorted(counts)} with the packed micro-batches, expected {ga_packed['expected']} (label tokens "
                           f"!= -100 after the shift; {off:+d}, and 2 x 2 example boundaries lie inside the packed rows: an unmasked "
                           "boundary label adds one each)" + note)
    ga_text = (f"grad accum 2 x 3: num_items_in_batch {ga_packed['expected']} as expected" if counts
               else "grad accum 2 x 3: the Trainer passes no num_items_in_batch to this model")
    if verdicts["as_configured"]:
        return CheckResult("pass", metrics, f"{TRAINER_STEPS} Trainer steps packed = reference as configured: loss delta "
                           f"{_fmt(a['max_loss_delta'])}, grad norm rel {_fmt(a['max_grad_norm_rel'])}, params rel "
                           f"{_fmt(a['param_rel_diff'])}; {ga_text}" + note)
    if verdicts["use_cache_false"]:
        return CheckResult("fail", metrics, f"Trainer packed run correct only with use_cache=False: as configured loss differs "
                           f"from step {a['first_diverging_step']} by up to {_fmt(a['max_loss_delta'])} (params rel {_fmt(a['param_rel_diff'])}); "
                           f"with use_cache=False {_fmt(b['max_loss_delta'])}" + note)
    return CheckResult("fail", metrics, f"Trainer packed run differs from the reference (from step {b['first_diverging_step']}): "
                       f"loss delta {_fmt(b['max_loss_delta'])} with use_cache=False, {_fmt(a['max_loss_delta'])} as configured; "
                       f"params rel {_fmt(b['param_rel_diff'])}" + note)


def check_sft(bench: Workbench) -> CheckResult:
    """TRL's SFTTrainer(packing=True) as configured by default: effective configuration, first-batch contract
    and loss vs the per-example reference (:func:`pytest_packcheck.sft.check_sft`; TRL is imported only here)."""
    from .sft import check_sft as run

    return run(bench)


def check_sft_padding_free(bench: Workbench) -> CheckResult:
    """TRL's SFTTrainer(packing=False, padding_free=True) vs padded (:func:`pytest_packcheck.sft.check_sft_padding_free`)."""
    from .sft import check_sft_padding_free as run

    return run(bench)


def check_sft_strategies(bench: Workbench) -> CheckResult:
    """TRL's SFTTrainer(packing=True) per packing_strategy vs padded (:func:`pytest_packcheck.sft.check_sft_strategies`)."""
    from .sft import check_sft_strategies as run

    return run(bench)


def check_packing_content(bench: Workbench) -> CheckResult:
    """Token accounting of TRL's pack_dataset per strategy (:func:`pytest_packcheck.sft.check_packing_content`)."""
    from .sft import check_packing_content as run

    return run(bench)


CHECK_FUNCTIONS: dict[str, Callable[[Workbench], CheckResult]] = {
    "collate": check_collate,
    "position_ids": check_position_ids,
    "isolation": check_isolation,
    "logits_parity": check_logits_parity,
    "loss_parity": check_loss_parity,
    "grad_parity": check_grad_parity,
    "backend": check_backend,
    "cache_trap": check_cache_trap,
    "mask_trap": check_mask_trap,
    "trainer": check_trainer,
    "sft": check_sft,
    "sft_padding_free": check_sft_padding_free,
    "sft_strategies": check_sft_strategies,
    "packing_content": check_packing_content,
}
