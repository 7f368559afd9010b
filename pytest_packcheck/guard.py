"""Check the user's own run: the first packed batch of a training run, measured on the user's model.

The audit answers "does packing work for this architecture at these versions" on tiny random models; this
module answers it for one run: the user's checkpoint, collator, device and stack. Three entry points share
:func:`verify_packed_batch`:

- :class:`PackcheckCallback`, a ``transformers.TrainerCallback`` for ``Trainer`` / TRL's ``SFTTrainer``: a
  forward pre-hook sees the first training batch exactly as the trainer feeds it (after its collator and
  device placement), runs the probes before the first optimizer step, removes itself, and raises, warns or
  falls back by policy;
- :func:`verify_packed_batch` for hand-written and accelerate loops;
- the ``packcheck_verify`` pytest fixture (``plugin.py``) for users' own test suites.

The probes: the batch contract (:func:`parse_row`: each broken item fails the batch with a cause code and a
remedy, and the numbers are still measured); the packed row run as the loop runs it (its use_cache,
attention_mask, autocast, attn_implementation; TRL's fused LM head when the trainer asks for it) and each
labelled example alone from its true positions, in eval mode under ``torch.no_grad`` with the RNG state
restored; per-token log-probs of the labelled tokens and their mean loss compared with the tolerance row of
the dtype the forward computes in (:class:`_ComputeProbe`: autocast read inside the forward, bf16 / fp16
weights, the LM head's output; ``audit/tolerances.toml``: ``logits_atol``, ``loss_atol``); attention calls
counted per backend. A mismatch is rerun with each suspect removed (no attention_mask, use_cache=False, M-RoPE
layout, plain position_ids), then an isolation probe separates ``leak`` from ``wrong_positions`` and a float32
rerun decides the numerics band, with the cause codes and remedies of :mod:`pytest_packcheck.diagnose`. A batch
of packed rows is judged row by row and together (``batch_rows``).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .errors import PackcheckError, PackcheckUsageError, PackcheckWarning

#: What the callback does on a mismatch: stop before the first optimizer step, warn and go on, or switch to a
#: safe fallback (:data:`FALLBACKS`) and go on.
POLICIES = ("raise", "warn", "disable")
#: The fallback ``on_mismatch="disable"`` installs, per cause; causes not listed fall back to padding.
FALLBACKS = {
    "cache_trap": "use_cache=False on every training forward",
    "mask_override": "attention_mask dropped from packed rows",
}
PADDING_FALLBACK = "packing off: every packed row unpacked into a right-padded batch before the model"
#: The callback's JSON, in the trainer's output_dir.
RESULT_FILE = "packcheck-guard.json"
#: Keys that run along the tokens of the row: all must have the row's length.
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "seq_idx", "token_type_ids", "completion_mask",
              "assistant_masks")
#: Keys the probes never hand to the model as they came: replaced per probe, or only meaningful for the whole row.
_ROW_KEYS = ("labels", "attention_mask", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
             "num_items_in_batch", "use_cache", "fused_lm_head", "completion_mask", "assistant_masks")
IGNORE_INDEX = -100


def _tol(value: Any) -> str:
    """A tolerance as short as it is exact: 1e-04, 1.5e-02."""
    return f"{value:.1e}".replace(".0e", "e") if isinstance(value, int | float) else str(value)


class PackedBatchMismatch(PackcheckError):
    """The packed row does not train like its examples alone; ``.result`` holds the :class:`GuardResult`."""

    def __init__(self, result: GuardResult) -> None:
        super().__init__(result.line())
        self.result = result


class PackcheckGuardWarning(PackcheckWarning):
    """A mismatch under ``on_mismatch="warn"``, a silent backend swap, or a batch with nothing to compare."""


class NotPackedError(PackcheckUsageError):
    """The batch is not a packed row (a padded ``(batch, length)`` batch, or one row that nothing marks as packed:
    no position_ids, no cu_seq_lens_q). :class:`PackcheckCallback` reads it as "not packed: nothing to check"
    and lets training go on; :func:`verify_packed_batch` raises it (a :class:`PackcheckUsageError`)."""


@dataclass
class GuardResult:
    """What :func:`verify_packed_batch` measured on one packed row.

    ``verdict``: "pass", "fail", "fallback" (numbers agree but attention ran on another backend than
    requested) or "skipped" (nothing judged: one example in the row, no labelled token, or a batch that is not
    packed; ``evidence`` says which). ``cause``: a code of :data:`pytest_packcheck.diagnose.CAUSES` (None on a
    pass) and ``remedy`` its one-line fix; a broken batch contract names its items' codes in ``causes``.
    ``dtype``: the tolerance row, from how the forward computed (``dtype_source``, e.g. "autocast bfloat16
    over float32 weights").
    ``max_logprob_diff``: the worst absolute difference (nats) of a labelled token's log-prob, packed vs its
    example alone; ``loss_*``: the token-mean negative log-likelihood (nats) over the labelled tokens.
    ``tolerance``: the dtype's ``logits_atol`` (log-probs) and ``loss_atol`` (loss). ``probes``: the reruns
    that named the cause. ``forwards``: model forwards the check ran; ``duration_s``: its wall time (seconds).
    """

    verdict: str
    cause: str | None
    remedy: str
    evidence: str
    dtype: str
    tolerance: dict[str, float]
    max_logprob_diff: float | None
    per_example_logprob_diff: list[float]
    loss_packed: float | None
    loss_reference: float | None
    loss_delta: float | None
    lengths: list[int]
    label_tokens: int
    contract: list[str]
    run: dict[str, Any]
    attention: dict[str, Any]
    probes: dict[str, Any] = field(default_factory=dict)
    fallback: str | None = None
    forwards: int = 0
    duration_s: float = 0.0
    versions: dict[str, Any] = field(default_factory=dict)
    dtype_source: str = ""
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True unless the packed row trains differently from its examples (a pass, a fallback or a skip)."""
        return self.verdict != "fail"

    def line(self) -> str:
        """One line: verdict, worst difference and its tolerance, cause and remedy."""
        worst = "n/a" if self.max_logprob_diff is None else f"{self.max_logprob_diff:.2e}"
        loss = "n/a" if self.loss_delta is None else f"{self.loss_delta:.2e}"
        verdict = "SKIPPED (nothing judged)" if self.verdict == "skipped" else self.verdict.upper()
        dtype = f"{self.dtype} ({self.dtype_source})" if self.dtype_source and self.dtype_source != f"{self.dtype} weights" else self.dtype
        head = (f"packcheck guard: {verdict} on {len(self.lengths)} packed examples ({sum(self.lengths)} tokens, "
                f"{dtype}, {self.run.get('attn_implementation')}): worst log-prob diff {worst} "
                f"(tol {_tol(self.tolerance.get('logits_atol'))}), loss diff {loss} (tol {_tol(self.tolerance.get('loss_atol'))})")
        if self.cause:
            head += f"; cause {self.cause}: {self.evidence}; remedy: {self.remedy}"
        elif self.evidence:
            head += f"; {self.evidence}"
        if self.notes:
            head += "; note: " + "; ".join(self.notes)
        if self.fallback:
            head += f"; fallback: {self.fallback}"
        return head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------------------------
# The batch

#: Per-token keys that must hold integers (token ids, positions, label ids, segment ids).
_INTEGER_KEYS = ("input_ids", "labels", "position_ids", "seq_idx", "token_type_ids")
#: Remedies of the batch contract's items, by item.
CONTRACT_REMEDIES = {
    "lengths": "collate every per-token key (input_ids, labels, position_ids, ...) to the row's length",
    "restart": "restart position_ids at {first} for each example (DataCollatorWithFlattening(return_position_ids=True) does)",
    "cu_agree": ("return position_ids and cu_seq_lens_q/k from the same segmentation "
                 "(DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True))"),
    "cu_form": "cu_seq_lens_q/k must run non-decreasing from 0 to the row's length (DataCollatorWithFlattening builds them)",
    "cu_qk": "for a packed row cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same examples)",
    "max_length": "max_length_q/k must be at least the longest example (DataCollatorWithFlattening sets it)",
    "labels": ("set labels to -100 at each example's first token, so no example is trained to predict the next one's "
               "start (DataCollatorWithFlattening(separator_id=-100) does)"),
    "empty": "drop empty examples before collating (the collator keeps them as a zero-length segment)",
    "cu_dtype": "build cu_seq_lens_q/k as torch.int32 (flash-attn's varlen kernels refuse int64; DataCollatorWithFlattening does)",
}


@dataclass
class _Row:
    """A validated packed row: its keys, the example slices (from every segmentation the batch declares), the
    position id examples start at, the contract items ``(cause, text, remedy key)`` and notes."""

    batch: dict[str, Any]
    total: int
    slices: list[slice]
    items: list[tuple[str, str, str]]
    notes: list[str]
    fatal: bool
    first: int = 0

    @property
    def problems(self) -> list[str]:
        return [text for _, text, _ in self.items]


def _usage(message: str) -> PackcheckUsageError:
    return PackcheckUsageError(f"verify_packed_batch: {message}")


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except Exception:  # noqa: BLE001 - a config whose text config cannot be read: its own attributes are used
        return config


def _shape(value: Any) -> str:
    import torch

    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def parse_row(batch: Any, config: Any = None) -> _Row:
    """Validate ``batch`` as one packed row and split it into examples at every boundary the batch declares:
    the position_ids restarts (any break in +1 steps; the text row of ``(R, 1, N)`` M-RoPE ids), the
    ``cu_seq_lens_q`` offsets and the ``seq_idx`` changes. The per-example reference is built from this
    segmentation with true positions, so ids that restart wrong are measured, not copied into the reference.

    Contract items (each fails the batch with a cause code and a remedy, :data:`CONTRACT_REMEDIES`): per-token
    keys of different lengths (no numbers then), position_ids that restart anywhere but at the architecture's
    first id (0; padding_idx + 1 for RoBERTa-likes), position_ids disagreeing with ``cu_seq_lens_q``,
    ``cu_seq_lens_q`` not running non-decreasing from 0 to the row length, ``cu_seq_lens_k`` unlike
    ``cu_seq_lens_q``, ``max_length_q`` below the longest example, zero-length examples, labels that are not -100
    at example starts. Notes (no verdict of their own): an attention_mask beside the row (the reruns measure
    it), ``cu_seq_lens_q`` not int32 (flash-attn 2.x refuses it; the packed run shows whether this backend does).

    Raises:
        NotPackedError: ``input_ids`` is ``(batch > 1, length)`` or nothing marks the row as packed (neither
            position_ids nor cu_seq_lens_q).
        PackcheckUsageError: ``batch`` is not a mapping; ``input_ids`` missing, not a 2-D integer tensor, empty
            ``(1, 0)`` or holding ids outside ``[0, vocab_size)``; a per-token key that is not a tensor or of the
            wrong rank; an integer key (labels, position_ids, seq_idx) of float dtype; ``cu_seq_lens_q/k`` not a
            1-D integer tensor; keys on different devices. One line naming the value, where it came from and the fix.
    """
    import torch

    from .model.batches import position_ids_start

    if not isinstance(batch, Mapping):
        raise _usage(f"batch is a {type(batch).__name__}, expected a dict of tensors (the collator's output, e.g. "
                     "DataCollatorWithFlattening(return_position_ids=True)(features)).")
    ids = batch.get("input_ids")
    if ids is None:
        raise _usage(f"batch has no 'input_ids' (keys: {', '.join(map(str, batch)) or 'none'}): pass the collator's output "
                     "(inputs_embeds is not supported).")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise _usage(f"batch['input_ids'] is {_shape(ids) if isinstance(ids, torch.Tensor) else type(ids).__name__}, expected a "
                     "tensor of shape (1, total_tokens): one packed row (return_tensors='pt').")
    if ids.shape[0] != 1:
        raise NotPackedError(f"verify_packed_batch: batch['input_ids'] has shape {tuple(ids.shape)}: a packed row has shape "
                             "(1, total_tokens); pack with DataCollatorWithFlattening or SFTConfig(padding_free=True), which "
                             "put a batch into one row.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise _usage(f"batch['input_ids'] has dtype {ids.dtype}: token ids are integers (torch.long); collate with "
                     "return_tensors='pt' from the tokenizer's ids, not from float features.")
    total = int(ids.shape[1])
    if total == 0:
        raise _usage("batch['input_ids'] has shape (1, 0): an empty row holds nothing to check; pass a row of at least two "
                     "non-empty examples.")
    text = _text_config(config) if config is not None else None
    vocab = getattr(text, "vocab_size", None)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        bad = low if low < 0 else high
        raise _usage(f"batch['input_ids'] holds token id {bad}, outside the model's vocabulary [0, {vocab}): pad input_ids "
                     "with the tokenizer's pad_token_id (-100 belongs in labels), and tokenize with this model's tokenizer.")
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.dtype.is_floating_point and labels.numel():
        scored = labels[labels != IGNORE_INDEX]
        if scored.numel() and (int(scored.min()) < 0 or (isinstance(vocab, int) and int(scored.max()) >= vocab)):
            bad = int(scored.min()) if int(scored.min()) < 0 else int(scored.max())
            raise _usage(f"batch['labels'] holds {bad}, neither -100 (not scored) nor a token id of the model's vocabulary "
                         f"[0, {vocab}): mask labels with -100 (DataCollatorWithFlattening's separator_id=-100).")
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device != ids.device:
            raise _usage(f"batch[{key!r}] is on {value.device}, input_ids on {ids.device}: move the whole batch to the model's "
                         "device (batch = {k: v.to(device) for k, v in batch.items()}).")
    items: list[tuple[str, str, str]] = []
    notes: list[str] = []
    fatal = False
    for key in TOKEN_KEYS:
        value = batch.get(key)
        if value is None or key == "input_ids":
            continue
        if not isinstance(value, torch.Tensor):
            raise _usage(f"batch[{key!r}] is a {type(value).__name__}, expected a tensor of shape (1, {total}) like input_ids "
                         "(return_tensors='pt').")
        rank_ok = value.ndim == 2 or (key == "position_ids" and value.ndim == 3)
        if not rank_ok:
            raise _usage(f"batch[{key!r}] has shape {tuple(value.shape)}, expected (1, {total}) like input_ids"
                         f"{' (or (rows, 1, total) M-RoPE ids)' if key == 'position_ids' else ''}.")
        if key in _INTEGER_KEYS and (value.dtype.is_floating_point or value.dtype.is_complex):
            raise _usage(f"batch[{key!r}] has dtype {value.dtype}: {key} are integers (torch.long); build them as ids, not floats.")
        if tuple(value.shape[-2:]) != (1, total):
            items.append(("collator_contract", (f"{key} has shape {tuple(value.shape)}, input_ids {(1, total)}: per-token keys "
                                               "differ in length"), "lengths"))
            fatal = True
    cu = {}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.ndim != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            what = f"{_shape(value)} {value.dtype}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise _usage(f"batch[{key!r}] is {what}: expected a 1-D int32 tensor of example offsets (0, ..., {total}) "
                         "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)).")
        cu[key] = [int(x) for x in value.tolist()]
        if value.dtype != torch.int32:
            notes.append(f"{key} dtype {value.dtype}, flash-attn 2.x needs torch.int32")
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) and "cu_seq_lens_q" not in cu:
        raise NotPackedError(f"verify_packed_batch: batch carries neither position_ids nor cu_seq_lens_q (keys: "
                             f"{', '.join(map(str, batch))}): it is not a packed row; use DataCollatorWithFlattening"
                             "(return_position_ids=True) or SFTConfig(padding_free=True).")
    first = position_ids_start(text) if text is not None and hasattr(text, "model_type") else 0
    boundaries = {0}
    pos_starts: list[int] | None = None
    if isinstance(pos, torch.Tensor) and not fatal:
        p = (pos[0, 0] if pos.ndim == 3 else pos[0]).tolist()
        pos_starts = [0] + [i for i in range(1, total) if p[i] != p[i - 1] + 1]
        boundaries.update(pos_starts)
        wrong = [s for s in pos_starts if p[s] != first]
        if wrong:
            items.append(("wrong_positions", (f"position_ids restart at {p[wrong[0]]}, not {first}, at token {wrong[0]} "
                                             f"({len(wrong)} of {len(pos_starts)} examples)"), "restart"))
    cu_q = cu.get("cu_seq_lens_q")
    if cu_q is not None:
        ok = len(cu_q) >= 2 and cu_q[0] == 0 and cu_q[-1] == total and all(b >= a for a, b in itertools.pairwise(cu_q))
        if not ok:
            items.append(("collator_contract", (f"cu_seq_lens_q {cu_q[:8]} do not run non-decreasing from 0 to the row length "
                                               f"{total}"), "cu_form"))
        else:
            if any(b == a for a, b in itertools.pairwise(cu_q)):
                items.append(("empty_example", f"cu_seq_lens_q {cu_q[:8]} hold a zero-length example", "empty"))
            cu_starts = sorted(set(cu_q[:-1]))
            boundaries.update(cu_starts)
            if pos_starts is not None and pos_starts != cu_starts:
                items.append(("collator_contract", (f"position_ids restart at tokens {pos_starts[:8]}, cu_seq_lens_q start "
                                                   f"examples at {cu_starts[:8]}"), "cu_agree"))
        cu_k = cu.get("cu_seq_lens_k")
        if cu_k is not None and cu_k != cu_q:
            items.append(("collator_contract", f"cu_seq_lens_k {cu_k[:8]} differ from cu_seq_lens_q {cu_q[:8]}", "cu_qk"))
    seq_idx = batch.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and not fatal:
        s = seq_idx[0].tolist()
        boundaries.update(i for i in range(1, total) if s[i] != s[i - 1])
    starts = sorted(b for b in boundaries if b < total)
    ends = [*starts[1:], total]
    longest = max(e - s for s, e in zip(starts, ends, strict=True))
    for key in ("max_length_q", "max_length_k"):
        value = batch.get(key)
        number = _int_or_none(value)
        if value is not None and number is not None and number < longest:
            items.append(("collator_contract", f"{key} {number} is below the longest example ({longest} tokens)", "max_length"))
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not fatal:
        unmasked = [s for s in starts[1:] if int(labels[0, s]) != IGNORE_INDEX]
        if unmasked:
            items.append(("collator_contract", (f"labels not -100 at {len(unmasked)} example starts (token indices "
                                               f"{unmasked[:5]}): the trainer scores those tokens across the boundary"), "labels"))
    for key in ("use_cache", "fused_lm_head"):
        if batch.get(key) is not None and not isinstance(batch.get(key), bool):
            raise _usage(f"batch[{key!r}] is {batch.get(key)!r}: expected True, False or no key.")
    if isinstance(batch.get("attention_mask"), torch.Tensor):
        notes.append("an attention_mask rides beside the packed row (eager/sdpa/flex then build no packed mask)")
    return _Row(dict(batch), total, [slice(s, e) for s, e in zip(starts, ends, strict=True)], items, notes, fatal, first)


def _targets(row: _Row) -> tuple[Any, Any]:
    """Next-token targets ``(1, total - 1)``: as the trainer scores them (the labels shifted, else the input_ids
    with -100 across example starts) and as the reference does (-100 across every example start)."""
    src = row.batch.get("labels")
    trainer = (row.batch["input_ids"] if src is None else src)[:, 1:].clone()
    reference = trainer.clone()
    for s in row.slices[1:]:
        reference[0, s.start - 1] = IGNORE_INDEX  # never score a token from the example before it
        if src is None:
            trainer[0, s.start - 1] = IGNORE_INDEX
    return trainer, reference


def _tolerances(tolerances: Any) -> dict[str, dict[str, float]]:
    """The tolerance rows: ``audit/tolerances.toml``, each row given in ``tolerances`` replacing its dtype's.

    Raises:
        PackcheckUsageError: ``tolerances`` is not ``{dtype: {"logits_atol": x, "loss_atol": y}}`` with a known
            dtype, both keys, and each value a finite number >= 0 (a string, a negative or NaN value is named).
    """
    import math
    from numbers import Real

    defaults = _default_tolerances()
    out = {k: dict(v) for k, v in defaults.items()}
    if tolerances is None:
        return out
    shape = "{'float32': {'logits_atol': 1e-4, 'loss_atol': 1e-5}, ...}"
    if not isinstance(tolerances, Mapping):
        raise _usage(f"tolerances is a {type(tolerances).__name__} ({tolerances!r:.60}): expected a dict of dtype rows, {shape}.")
    for dtype, row in tolerances.items():
        if dtype not in defaults:
            raise _usage(f"tolerances has an unknown dtype row {dtype!r}: expected {', '.join(map(repr, defaults))}, as {shape}.")
        if not isinstance(row, Mapping):
            raise _usage(f"tolerances[{dtype!r}] is a {type(row).__name__} ({row!r:.60}): expected a dict like "
                         "{'logits_atol': 1e-4, 'loss_atol': 1e-5}.")
        missing = [k for k in ("logits_atol", "loss_atol") if k not in row]
        if missing:
            raise _usage(f"tolerances[{dtype!r}] has no {' or '.join(map(repr, missing))} (given: {', '.join(map(repr, row)) or 'none'}): "
                         "give both logits_atol and loss_atol for each dtype row you set.")
        for key, value in row.items():
            if key not in defaults[dtype]:
                raise _usage(f"tolerances[{dtype!r}] has an unknown key {key!r}: expected {', '.join(map(repr, defaults[dtype]))}.")
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)) or float(value) < 0:
                raise _usage(f"tolerances[{dtype!r}][{key!r}] = {value!r}: a tolerance is a finite number >= 0 (nats), e.g. "
                             f"{defaults[dtype][key]!r}.")
        out[dtype] = {**defaults[dtype], **{k: float(v) for k, v in row.items()}}
    return out


@functools.cache
def _default_tolerances() -> dict[str, dict[str, float]]:
    """audit/tolerances.toml, read once per process."""
    from .config.tolerances import load_tolerances

    return load_tolerances(None, None, "default")[0]


def _pick(tols: dict[str, dict[str, float]], dtype: str) -> dict[str, float]:
    table = tols.get(dtype) or tols["float32"]
    return {"logits_atol": table["logits_atol"], "loss_atol": table["loss_atol"]}


# ------------------------------------------------------------------------------------------------------------
# Running the model


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


def _solo(model: Any, row: _Row, targets: Any, fused: bool, counter: list[int]) -> tuple[list[Any], list[int]]:
    """Log-probs of each labelled example run alone: its slice of every per-token key, true positions (never the
    row's own position_ids), use_cache=False, no mask."""
    import torch

    from .checks.reference import position_ids_alone

    out, which = [], []
    pos = row.batch.get("position_ids")
    for i, s in enumerate(row.slices):
        seg_targets = targets[:, s.start:s.stop - 1]
        if s.stop - s.start < 2 or not bool((seg_targets != IGNORE_INDEX).any()):
            continue  # nothing labelled (padding, a prompt-only example): nothing to compare, no forward spent
        inputs = {k: v[:, s] for k, v in row.batch.items()
                  if k not in _ROW_KEYS and k != "position_ids" and isinstance(v, torch.Tensor) and tuple(v.shape) == (1, row.total)}
        if isinstance(pos, torch.Tensor):
            inputs["position_ids"] = position_ids_alone(row.first, s.stop - s.start, like=pos)
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


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


_REDUCED = ("bfloat16", "float16")


class _ComputeProbe:
    """How the forward really computes, read inside it: the autocast state where the first submodule runs (any
    wrapper's autocast: accelerate's mixed-precision wrapper of ``model.forward``, ``Trainer(bf16=True)``,
    ``torch.autocast`` around the call), the LM head's output dtype (its forward hook never fires under TRL's
    fused LM head, trl 1.16 ``add_fused_lm_head``: the head's weight is used in a chunked matmul), the weights'."""

    def __init__(self, model: Any, device_type: str) -> None:
        self.device_type = device_type
        self.autocast: Any = None
        self.seen_autocast = False
        self.head: Any = None
        self.handles: list[Any] = []
        params = [p for p in model.parameters() if p.is_floating_point()]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        self.weights = _dtype_name(weight.dtype if weight is not None else params[0].dtype if params else "float32")
        first = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if first is None:
            first = next((m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))), None)
        if first is not None:
            self.handles.append(first.register_forward_pre_hook(self._pre))
        if head is not None:
            self.handles.append(head.register_forward_hook(self._post))

    def _pre(self, module: Any, args: Any) -> None:
        import torch

        if not self.seen_autocast:
            self.seen_autocast = True
            on = torch.is_autocast_enabled(self.device_type)
            self.autocast = _dtype_name(torch.get_autocast_dtype(self.device_type)) if on else None

    def _post(self, module: Any, args: Any, out: Any) -> None:
        if self.head is None and hasattr(out, "dtype"):
            self.head = _dtype_name(out.dtype)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def decide(self, fused: bool) -> tuple[str, str]:
        """(tolerance row, what it was read from): the first reduced precision among autocast, the weights and the
        LM head's output, else float32."""
        if self.autocast in _REDUCED:
            return self.autocast, f"autocast {self.autocast} over {self.weights} weights"
        if self.weights in _REDUCED:
            return self.weights, f"{self.weights} weights"
        if self.head in _REDUCED:
            return self.head, f"{self.weights} weights, LM head output {self.head}"
        fused_note = ", TRL's fused LM head" if fused else ""
        return "float32", f"float32 weights, no autocast{fused_note}"


@functools.cache
def _installed_versions() -> tuple[tuple[str, Any], ...]:
    """Read once per process: importlib.metadata parses each distribution's METADATA (~10 ms each)."""
    from .versions.libraries import installed_version, stack_libraries

    return tuple((lib.name, installed_version(lib)) for lib in stack_libraries())


def _versions() -> dict[str, Any]:
    return dict(_installed_versions())


def _gradient_checkpointing(model: Any) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def verify_packed_batch(
    model: Any,
    batch: Mapping[str, Any],
    *,
    use_cache: bool | None = None,
    training: bool | None = None,
    tolerances: Mapping[str, Mapping[str, float]] | None = None,
    on_mismatch: str = "return",
    padded_probe: bool = False,
) -> GuardResult:
    """Check one packed row on ``model`` as the training loop would run it.

    ``batch``: the collator's output for one step, one packed row: ``input_ids`` int64 ``(1, total_tokens)``
    and ``position_ids`` ``(1, total_tokens)`` (or M-RoPE ``(R, 1, total_tokens)``) restarting per example, or
    ``cu_seq_lens_q`` int32 ``(num_examples + 1,)``; optional ``labels`` ``(1, total_tokens)`` (-100 = not
    scored; without labels every next token is scored), ``attention_mask``, ``cu_seq_lens_k``,
    ``max_length_q/k``, ``seq_idx``, ``num_items_in_batch`` and ``fused_lm_head`` (TRL's fused LM head), all on
    the model's device. Call it where the loop calls the model (inside its ``torch.autocast``, if any).
    ``use_cache``: what the loop passes (default: the batch's, else ``model.config.use_cache``; transformers
    turns it off under gradient checkpointing in training, TRL's fused head always). ``training``: whether the
    loop trains (default: the model's mode), used only for that rule. ``tolerances``: dtype rows replacing those
    of ``audit/tolerances.toml`` (``{"bfloat16": {"logits_atol": 5e-2, "loss_atol": 1.5e-2}}``).
    ``on_mismatch``: "return" the result, "warn" (:class:`PackcheckGuardWarning`) or "raise"
    (:class:`PackedBatchMismatch`). ``padded_probe``: on a mismatch, also run the row unpacked into a
    right-padded batch (:func:`unpack_row`, one more forward) and put its worst log-prob diff against the solo
    runs in ``probes["padded"]``: whether turning packing off would train right.

    The tolerance row is the dtype the forward computes in, read inside it (:class:`_ComputeProbe`): an active
    autocast, else bf16/fp16 weights, else the LM head's output, else float32; ``dtype_source`` says which
    ("autocast bfloat16 over float32 weights"). A difference above the row's tolerance but within
    :data:`~pytest_packcheck.registry.NUMERICS_FACTOR` times it, with every attention call keeping the
    boundaries, is rerun in float32 (autocast off) when the weights are float32: a pass with a note when float32
    agrees; without float32 weights it fails as ``kernel_numerics`` with the float32 check as remedy.

    Cost: the packed forward plus one forward per labelled example of the row, under ``torch.no_grad`` in eval
    mode; a mismatch adds a few reruns to name the cause (one more with ``padded_probe``; a float32 rerun of the
    row and its examples in the numerics band). The model's train/eval mode of every module, its config and the
    torch RNG states (CPU and CUDA) are restored; no gradient is touched. Units: log-probs and losses in nats.

    Raises:
        PackcheckUsageError: ``batch`` is not one packed row (see :func:`parse_row`; :class:`NotPackedError` for a
            padded batch), a bad ``tolerances`` (see :func:`_tolerances`), or an unknown ``on_mismatch`` /
            non-bool ``use_cache`` / ``training`` / ``padded_probe``: one line naming the value and the fix.
        PackedBatchMismatch: on a mismatch with ``on_mismatch="raise"``.
    """
    import torch

    if on_mismatch not in ("return", "warn", "raise"):
        raise _usage(f"unknown on_mismatch={on_mismatch!r}: expected 'return', 'warn' or 'raise'.")
    for name, value, allowed in (("use_cache", use_cache, (None, True, False)), ("training", training, (None, True, False)),
                                 ("padded_probe", padded_probe, (True, False))):
        if not any(value is a for a in allowed):
            raise _usage(f"{name}={value!r}: expected {' or '.join(map(str, allowed))}.")
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise _usage(f"model is a {type(model).__name__} without a config: pass the transformers model itself "
                     "(a PreTrainedModel, e.g. AutoModelForCausalLM.from_pretrained(...)).")
    tols = _tolerances(tolerances)
    rows = packed_rows(batch)
    if rows:
        return _verify_rows(model, batch, rows, use_cache=use_cache, training=training, tolerances=tolerances,
                            on_mismatch=on_mismatch, padded_probe=padded_probe)
    started = time.perf_counter()
    row = parse_row(batch, getattr(model, "config", None))
    config = model.config
    training = model.training if training is None else training
    explicit = row.batch.get("use_cache")
    cache = bool(explicit if explicit is not None else use_cache if use_cache is not None else getattr(config, "use_cache", False))
    if cache and training and _gradient_checkpointing(model):
        cache = False  # transformers' merge_with_config_defaults / GradientCheckpointingLayer, 5.x
    fused = bool(row.batch.get("fused_lm_head"))
    if fused:
        cache = False  # trl 1.16 add_fused_lm_head: _fused_forward sets kwargs["use_cache"] = False
    requested = getattr(config, "_attn_implementation", None)
    run = {"use_cache": cache, "attention_mask": "attention_mask" in row.batch, "attn_implementation": requested,
           "gradient_checkpointing": _gradient_checkpointing(model), "training": training, "fused_lm_head": fused,
           "device": str(row.batch["input_ids"].device), "autocast": None, "model": type(model).__name__,
           "num_items_in_batch": _int_or_none(row.batch.get("num_items_in_batch"))}
    modes = {m: m.training for m in model.modules()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        model.eval()
        with torch.no_grad():
            result = _measure(model, row, run, cache, fused, tols, padded_probe)
    finally:
        for module, mode in modes.items():
            module.training = mode
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    result.duration_s = time.perf_counter() - started
    if not result.ok and on_mismatch == "raise":
        raise PackedBatchMismatch(result)
    if (not result.ok or result.verdict == "fallback") and on_mismatch == "warn":
        warnings.warn(result.line(), PackcheckGuardWarning, stacklevel=2)
    return result


def packed_rows(batch: Any) -> list[slice] | None:
    """The real-token span of each row of a ``(batch > 1, length)`` batch of packed rows: position_ids
    ``(batch, length)`` that step down between two real tokens of a row (a restart; ``attention_mask`` zeros are
    padding). None for one row, a padded batch of unpacked examples, or anything else.

    Raises:
        PackcheckUsageError: a row whose real tokens are not one run (padding inside the row).
    """
    import torch

    ids, pos = (batch.get("input_ids"), batch.get("position_ids")) if isinstance(batch, Mapping) else (None, None)
    if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[0] > 1 and isinstance(pos, torch.Tensor)
            and tuple(pos.shape) == tuple(ids.shape) and ids.shape[1] > 1):
        return None
    mask = batch.get("attention_mask")
    real = mask.bool() if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape) else torch.ones_like(ids, dtype=torch.bool)
    restarts = (pos[:, 1:] < pos[:, :-1]) & real[:, 1:] & real[:, :-1]
    if not bool(restarts.any()):
        return None
    spans = []
    for r in range(ids.shape[0]):
        where = real[r].nonzero().flatten().tolist()
        if not where or where != list(range(where[0], where[-1] + 1)):
            raise _usage(f"row {r} of the {tuple(ids.shape)} packed rows has padding between its tokens (attention_mask "
                         f"{real[r].int().tolist()[:12]}...): pad packed rows on one side only.")
        spans.append(slice(where[0], where[-1] + 1))
    return spans


def _verify_rows(model: Any, batch: Mapping[str, Any], spans: list[slice], **options: Any) -> GuardResult:
    """A batch of packed rows: the batch as the loop runs it vs each row run alone (the cause ``batch_rows`` when
    they differ: transformers 5.24 derives packed boundaries from position_ids for batch size 1 only), then each
    row judged as its own packed row; the result is the worst row's, over every row's examples."""
    import torch

    on_mismatch = options.pop("on_mismatch")
    per_token = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and tuple(v.shape[-2:]) == tuple(batch["input_ids"].shape)}
    padded = any(s.stop - s.start != batch["input_ids"].shape[1] for s in spans)
    singles = []
    for r, s in enumerate(spans):
        one = {k: (v[..., r:r + 1, s] if k in per_token else v) for k, v in batch.items()
               if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        if padded:
            one.pop("attention_mask", None)  # it only marked the padding; the row alone has none
        singles.append(one)
    results = [verify_packed_batch(model, one, on_mismatch="return", **options) for one in singles]
    worst = next((r for r in results if r.verdict == "fail"), None) or next(
        (r for r in results if r.verdict != "skipped"), results[0])
    result = GuardResult(**worst.to_dict())
    result.lengths = [n for r in results for n in r.lengths]
    result.probes = {**worst.probes, "rows": [f"{r.verdict}{' ' + r.cause if r.cause else ''}" for r in results]}
    result.forwards = sum(r.forwards for r in results)
    batched = _batched_vs_rows(model, batch, singles, spans, worst, result)
    rows_text = f"{len(spans)} packed rows {tuple(batch['input_ids'].shape)}"
    if batched is not None and not batched <= result.tolerance["logits_atol"]:
        result.verdict, result.cause, result.remedy = "fail", "batch_rows", ""
        result.max_logprob_diff = max(batched, result.max_logprob_diff or 0.0)
        result.causes = ["batch_rows", *([worst.cause] if worst.cause else [])]
        result.evidence = (f"{rows_text} run together differ from each row alone by {batched:.2e}; each row alone: "
                           f"{', '.join(result.probes['rows'])}")
        _finish(result, model)
    else:
        result.notes = [*result.notes, f"{rows_text}: together vs each row alone {_fmt(batched)}"]
    if not result.ok and on_mismatch == "raise":
        raise PackedBatchMismatch(result)
    if (not result.ok or result.verdict == "fallback") and on_mismatch == "warn":
        warnings.warn(result.line(), PackcheckGuardWarning, stacklevel=3)
    return result


def _batched_vs_rows(model: Any, batch: Mapping[str, Any], singles: list[dict[str, Any]], spans: list[slice],
                     worst: GuardResult, result: GuardResult) -> float | None:
    """Worst log-prob diff (nats, labelled next tokens inside each row's examples) of the batch run together vs
    each row run alone, both as given (eval mode, no_grad, modes restored). None when nothing is labelled."""
    import torch

    fused = bool(batch.get("fused_lm_head"))
    keys = {k: v for k, v in batch.items() if k not in ("labels", "fused_lm_head", "num_items_in_batch")}
    keys["use_cache"] = bool(worst.run.get("use_cache"))
    modes = {m: m.training for m in model.modules()}
    diffs = []
    try:
        model.eval()
        with torch.no_grad():
            for r, (one, s) in enumerate(zip(singles, spans, strict=True)):
                row = parse_row(one, model.config)
                _, targets = _targets(row)
                if not bool((targets != IGNORE_INDEX).any()):
                    continue
                alone, _ = _log_probs(model, {k: v for k, v in one.items() if k not in ("labels", "fused_lm_head",
                                                                                          "num_items_in_batch")}
                                      | {"use_cache": keys["use_cache"]}, targets, fused)
                full = torch.full((1, batch["input_ids"].shape[1] - 1), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
                full[0, s.start:s.stop - 1] = targets[0]
                together = _row_log_probs(model, keys, r, full, fused, batch["input_ids"].shape[0])
                keep = targets[0] != IGNORE_INDEX
                diffs.append(float((together[s.start:s.stop - 1][keep] - alone[keep]).abs().max()))
                result.forwards += 2
    finally:
        for module, mode in modes.items():
            module.training = mode
    return max(diffs) if diffs else None


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


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _contract_remedy(row: _Row) -> str:
    keys = dict.fromkeys(key for _, _, key in row.items)
    return "; ".join(CONTRACT_REMEDIES[k].format(first=row.first) for k in keys)


def _measure(model: Any, row: _Row, run: dict[str, Any], cache: bool, fused: bool,
             tols: dict[str, dict[str, float]], padded_probe: bool = False) -> GuardResult:
    """The probes, in eval mode under no_grad (see :func:`verify_packed_batch`)."""
    from .backends import count_attention_calls, is_call_on
    from .checks.attention import expected_attention_calls

    lengths = [s.stop - s.start for s in row.slices]
    probe_dtype = _ComputeProbe(model, row.batch["input_ids"].device.type)
    probe_dtype.remove()  # only the weights' dtype until the packed forward runs
    base = {"verdict": "fail", "dtype": probe_dtype.weights, "lengths": lengths, "contract": row.problems, "run": run,
            "versions": _versions(), "per_example_logprob_diff": [], "label_tokens": 0, "notes": list(row.notes),
            "causes": [code for code, _, _ in row.items], "dtype_source": f"{probe_dtype.weights} weights"}
    empty = {"max_logprob_diff": None, "loss_packed": None, "loss_reference": None, "loss_delta": None}
    contract_cause = row.items[0][0] if row.items else None
    if row.fatal:
        return _finish(GuardResult(**base, **empty, cause=contract_cause, remedy=_contract_remedy(row),
                                   evidence="; ".join(row.problems), tolerance=_pick(tols, probe_dtype.weights),
                                   attention={}), model)
    trainer, targets = _targets(row)
    if not bool((targets != IGNORE_INDEX).any()):
        return _finish(GuardResult(**{**base, "verdict": "skipped" if not row.items else "fail"}, **empty,
                                   cause=contract_cause, remedy=_contract_remedy(row) if row.items else "",
                                   evidence="no labelled token (every label is -100): nothing judged"
                                            + ("; " + "; ".join(row.problems) if row.items else ""),
                                   tolerance=_pick(tols, probe_dtype.weights), attention={}), model)
    forwards = [0]
    inputs = {k: v for k, v in row.batch.items() if k not in ("labels", "use_cache", "fused_lm_head", "num_items_in_batch")}
    inputs["use_cache"] = cache
    probe_dtype = _ComputeProbe(model, row.batch["input_ids"].device.type)
    try:
        with count_attention_calls(model, lengths) as probe:
            packed, model_loss = _log_probs(model, inputs, trainer, fused)
        forwards[0] += 1
    except PackcheckUsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model refuses the batch as given: a verdict, with the exception
        said = f"the packed row as given raised {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        contract_cause = contract_cause or _refusal_cause(model, exc)
        if not contract_cause and any(n.startswith("cu_seq_lens") for n in row.notes):
            row.items.append(("collator_contract", next(n for n in row.notes if n.startswith("cu_seq_lens")), "cu_dtype"))
            contract_cause = "collator_contract"
        return _finish(GuardResult(**{**base, "causes": [c for c, _, _ in row.items], "contract": row.problems}, **empty,
                                   cause=contract_cause or "crash",
                                   remedy=_contract_remedy(row) if row.items else "",
                                   evidence="; ".join([*row.problems, said] if row.items else [said, *row.notes]),
                                   tolerance=_pick(tols, probe_dtype.weights), attention={}, forwards=1), model)
    finally:
        probe_dtype.remove()
    dtype, source = probe_dtype.decide(fused)
    run["autocast"] = probe_dtype.autocast
    tol = _pick(tols, dtype)
    counts = probe.counts()
    requested = run["attn_implementation"]
    on_requested = {k: v for k, v in counts.items() if is_call_on(k, requested)}
    others = {k: v for k, v in counts.items() if k not in on_requested}
    isolated = [c.isolated for c in probe.calls]
    attention = {"requested": requested, "calls": counts, "expected_calls": expected_attention_calls(model),
                 "boundaries_reached": sum(1 for i in isolated if i), "boundaries_missing": sum(1 for i in isolated if i is False),
                 "varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls}
    base = {**base, "dtype": dtype, "dtype_source": source}
    if len(row.slices) < 2:
        return _finish(GuardResult(**{**base, "verdict": "skipped" if not row.items else "fail"}, **empty,
                                   cause=contract_cause, remedy=_contract_remedy(row) if row.items else "",
                                   evidence="; ".join(["one example in the row: nothing to compare", *row.problems]),
                                   tolerance=tol, attention=attention, forwards=forwards[0]), model)
    try:
        solo, which = _solo(model, row, targets, fused, forwards)
    except Exception as exc:  # noqa: BLE001 - no reference: say so, with the exception
        return _finish(GuardResult(**base, **empty, cause="crash", remedy="",
                                   evidence=f"the examples run alone raised {type(exc).__name__}: {str(exc)[:200]}",
                                   tolerance=tol, attention=attention, forwards=forwards[0] + 1), model)
    cmp = _compare(row, trainer, targets, packed, solo, which)
    probes: dict[str, Any] = {}
    if model_loss is not None and hasattr(model_loss, "item") and cmp["loss_packed"] is not None and run["num_items_in_batch"] is None:
        probes["model_loss"] = float(model_loss)
    probes["trainer_label_tokens"] = cmp["trainer_label_tokens"]
    probes["batch_has_position_ids"] = "position_ids" in row.batch
    result = GuardResult(**{**base, "label_tokens": cmp["label_tokens"], "per_example_logprob_diff": cmp["per_example"]},
                         max_logprob_diff=cmp["max"], loss_packed=cmp["loss_packed"], loss_reference=cmp["loss_reference"],
                         loss_delta=cmp["loss_delta"], cause=None, remedy="", evidence="", tolerance=tol,
                         attention=attention, probes=probes, forwards=forwards[0])
    numbers = (f"packed vs per-example log-probs {_fmt(cmp['max'])}, loss {_fmt(cmp['loss_packed'])} as the trainer scores "
               f"{cmp['trainer_label_tokens']} tokens vs {_fmt(cmp['loss_reference'])} over the examples' {cmp['label_tokens']}")
    if not cmp["finite"]:
        result.cause = "non_finite"
        packed_bad = not bool(packed[targets[0] != IGNORE_INDEX].isfinite().all())
        solo_bad = any(not bool(lp.isfinite().all()) for lp in solo)
        where = " and ".join(n for n, bad in (("the packed row", packed_bad), ("the examples alone", solo_bad)) if bad) or "the loss"
        result.evidence = f"non-finite log-probs in {where} ({numbers}): no comparison is possible, nothing passes"
        return _finish(result, model)
    if row.items:
        result.cause = contract_cause
        result.evidence = "; ".join(row.problems) + f" ({numbers})"
        result.remedy = _contract_remedy(row)
        return _finish(result, model)
    if not _bad(cmp, tol):
        result.verdict = "pass"
        if others:
            result.verdict, result.cause = "fallback", "backend_swap"
            result.evidence = f"requested {requested}, attention ran on {others}"
        return _finish(result, model)
    reference = dict(zip(which, solo, strict=True))
    result.cause, result.evidence = _diagnose(model, row, targets, inputs, fused, cmp, tol, attention, others, probes,
                                              forwards, reference, dtype, tols, packed)
    if result.cause == _NUMERICS_PASS:
        result.verdict, result.cause = "pass", None
        result.notes.append(result.evidence)
        result.evidence = ""
    elif padded_probe:
        probes["padded"] = _padded_diff(model, row, targets, inputs, fused, reference)
        forwards[0] += 1
    result.forwards = forwards[0]
    return _finish(result, model)


def _refusal_cause(model: Any, exc: BaseException) -> str | None:
    """The audit's cause of a packed row the model refuses: its flash path's cu_seq_lens that do not fit the row
    (``flash_boundaries``, the reference kernels' FlashBoundariesError), or stateful layers that cannot keep
    examples apart here (``stateful_layers_refused``: transformers 5.x raises "can't keep packed sequences apart"
    without flash-linear-attention / causal_conv1d); None for any other exception (a crash)."""
    from .backends import FlashBoundariesError
    from .checks.probes import stateful_layers
    from .run.runner import _STATEFUL_REFUSALS

    if isinstance(exc, FlashBoundariesError):
        return "flash_boundaries"
    if stateful_layers(model) and any(m in str(exc) for m in _STATEFUL_REFUSALS):
        return "stateful_layers_refused"
    return None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


#: Internal: the numbers exceed the reduced-precision row, and the float32 rerun agrees.
_NUMERICS_PASS = "_numerics_pass"


def _bad(cmp: dict[str, Any], tol: dict[str, float]) -> bool:
    """True unless both numbers are within tolerance (a NaN is never within: ``not nan <= x``)."""
    return bool((cmp["max"] is not None and not cmp["max"] <= tol["logits_atol"])
                or (cmp["loss_delta"] is not None and not cmp["loss_delta"] <= tol["loss_atol"]))


def _diff(row: _Row, targets: Any, lp: Any, reference: dict[int, Any]) -> float:
    worst = 0.0
    for i, ref in reference.items():
        s = row.slices[i]
        keep = targets[0, s.start:s.stop - 1] != IGNORE_INDEX
        worst = max(worst, float((lp[s.start:s.stop - 1][keep] - ref[keep]).abs().max()))
    return worst


def _rerun(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool, counter: list[int],
           reference: dict[int, Any], **change: Any) -> float:
    """Worst log-prob diff of the packed row rerun with ``change`` (None drops the key) vs the solo runs."""
    call = {k: v for k, v in {**inputs, **change}.items() if v is not None}
    lp, _ = _log_probs(model, call, targets, fused)
    counter[0] += 1
    return _diff(row, targets, lp, reference)


def _isolation_moved(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool, counter: list[int],
                     packed_lp: Any) -> float | None:
    """How far the later examples' log-probs move when the first example's tokens change (nats): > 0 only if
    attention (or state) crosses the boundaries. None when no later example has a labelled token."""
    import torch

    later = torch.zeros_like(targets[0], dtype=torch.bool)
    later[row.slices[1].start:] = True
    keep = later & (targets[0] != IGNORE_INDEX)
    if not bool(keep.any()):
        return None
    ids = inputs["input_ids"].clone()
    vocab = int(getattr(_text_config(model.config), "vocab_size", int(ids.max()) + 2))
    ids[0, row.slices[0]] = (ids[0, row.slices[0]] + 1) % vocab
    lp, _ = _log_probs(model, {**inputs, "input_ids": ids}, targets, fused)
    counter[0] += 1
    return float((lp[keep] - packed_lp[keep]).abs().max())


def _float32_diff(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool,
                  counter: list[int]) -> float | None:
    """Worst packed-vs-solo log-prob diff with autocast off (float32 weights): accelerate's mixed-precision
    wrapper is bypassed through the ``model._original_forward`` it keeps (accelerate 1.x ``prepare_model``).
    None when autocast stays on inside the forward (another wrapper): no float32 number to read."""
    import torch

    device_type = row.batch["input_ids"].device.type
    missing = object()
    saved = model.__dict__.get("forward", missing)
    original = getattr(model, "_original_forward", None)
    try:
        if original is not None:
            model.forward = original
        check = _ComputeProbe(model, device_type)
        with torch.autocast(device_type, enabled=False):
            try:
                packed, _ = _log_probs(model, inputs, targets, fused)
            finally:
                check.remove()
            counter[0] += 1
            if check.autocast in _REDUCED:
                return None
            solo, which = _solo(model, row, targets, fused, counter)
    finally:
        if original is not None:
            if saved is missing:
                del model.forward
            else:
                model.forward = saved
    return _diff(row, targets, packed, dict(zip(which, solo, strict=True)))


def _mrope_layout(model: Any, inputs: dict[str, Any]) -> Any:
    """The packed M-RoPE layout of a multimodal-RoPE model fed ``(1, N)`` position_ids (models.position_layout,
    transformers 5.x Qwen2-VL family); None for every other model or ids already laid out."""
    from types import SimpleNamespace

    pos = inputs.get("position_ids")
    text = _text_config(model.config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if pos is None or pos.ndim != 2 or not (isinstance(rope, Mapping) and "mrope_section" in rope):
        return None
    from .model.multimodal import position_layout

    try:
        layout = position_layout(model, SimpleNamespace(text_path="guard", model_type=getattr(text, "model_type", "?")))
    except Exception:  # noqa: BLE001 - a layout packcheck cannot read: no rerun, the other probes decide
        return None
    return layout if layout.rows else None


def _diagnose(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool, cmp: dict[str, Any],
              tol: dict[str, float], attention: dict[str, Any], others: dict[str, int], probes: dict[str, Any],
              counter: list[int], reference: dict[int, Any], dtype: str = "float32",
              tols: dict[str, dict[str, float]] | None = None, packed: Any = None) -> tuple[str, str]:
    """Name the cause of a mismatch by rerunning the packed row with each suspect removed (measured, not inferred
    from the batch's keys): the attention_mask, then the cache, then both; then the attention counts, the
    stateful layers, the position_ids (ignored; an M-RoPE layout), the numerics band (a float32 rerun), and an
    isolation probe (change the first example, see whether the others move) for ``leak`` vs
    ``wrong_positions``."""
    import torch

    from .checks.probes import stateful_layers
    from .checks.registry import NUMERICS_FACTOR

    atol, worst = tol["logits_atol"], cmp["max"] or 0.0
    if others:
        return "backend_swap", f"requested {attention['requested']}, attention ran on {others}; packed vs solo {worst:.2e}"
    if "attention_mask" in inputs:
        probes["without_attention_mask"] = _rerun(model, row, targets, inputs, fused, counter, reference, attention_mask=None)
        if probes["without_attention_mask"] <= atol:
            return "mask_override", (f"with the attention_mask {worst:.2e}, without it {probes['without_attention_mask']:.2e}")
    if inputs.get("use_cache"):
        probes["use_cache_false"] = _rerun(model, row, targets, inputs, fused, counter, reference, use_cache=False)
        if probes["use_cache_false"] <= atol:
            return "cache_trap", f"use_cache=True {worst:.2e}, use_cache=False {probes['use_cache_false']:.2e}"
        if "attention_mask" in inputs:
            both = _rerun(model, row, targets, inputs, fused, counter, reference, use_cache=False, attention_mask=None)
            probes["use_cache_false_without_attention_mask"] = both
            if both <= atol:
                return "mask_override", (f"{worst:.2e} as run; correct only without the attention_mask and with "
                                         f"use_cache=False ({both:.2e}): also set use_cache=False")
    stateful = stateful_layers(model)
    if stateful and not attention["boundaries_missing"]:
        return "stateful_layers", f"layers {', '.join(stateful[:3])}; attention boundaries reached; packed vs solo {worst:.2e}"
    pos = inputs.get("position_ids")
    layout = _mrope_layout(model, inputs)
    if layout is not None:
        probes["laid_out_position_ids"] = _rerun(model, row, targets, inputs, fused, counter, reference,
                                                 position_ids=layout.apply(pos))
        if probes["laid_out_position_ids"] <= atol:
            return "position_layout", (f"the collator's (1, {row.total}) position_ids {worst:.2e}; laid out as "
                                       f"({layout.rows}, 1, {row.total}) {probes['laid_out_position_ids']:.2e}")
    if isinstance(pos, torch.Tensor) and pos.ndim == 2:
        plain = torch.arange(row.total, device=pos.device)[None] + int(pos[0, 0])
        probes["plain_position_ids"] = _rerun(model, row, targets, inputs, fused, counter, reference, position_ids=plain)
        if abs(probes["plain_position_ids"] - worst) <= 1e-6 * max(1.0, worst):
            return "ignores_position_ids", (f"restarting position_ids changes nothing (packed vs solo {worst:.2e} either "
                                            "way)")
    if packed is None:
        packed, _ = _log_probs(model, inputs, targets, fused)
        counter[0] += 1
    moved = _isolation_moved(model, row, targets, inputs, fused, counter, packed)
    probes["isolation_moved"] = moved
    missing = attention["boundaries_missing"]
    isolated = not missing and (moved <= atol if moved is not None else attention["boundaries_reached"] > 0)
    moved_text = f"changing the first example moves the others by {moved:.2e}" if moved is not None else "no later example to move"
    if not isolated:
        detail = f"; boundaries missing in {missing} of {sum(attention['calls'].values())} attention calls" if missing else ""
        return "leak", f"packed vs solo log-probs differ by {worst:.2e}; {moved_text}{detail}"
    band = f"{worst:.2e}, within {NUMERICS_FACTOR:g}x the {dtype} tolerance {_tol(atol)}, boundaries kept ({moved_text})"
    if worst <= NUMERICS_FACTOR * atol:
        if dtype not in _REDUCED:
            return "kernel_numerics", f"log-probs differ by {band}: no lower-noise run than float32 to compare with"
        weights = _ComputeProbe(model, row.batch["input_ids"].device.type)
        weights.remove()
        if weights.weights != "float32":
            return "kernel_numerics", f"log-probs differ by {band}; {weights.weights} weights: no float32 rerun here"
        f32 = _float32_diff(model, row, targets, inputs, fused, counter)
        probes["float32"] = f32
        f32_atol = (tols or _default_tolerances())["float32"]["logits_atol"]
        if f32 is None:
            return "kernel_numerics", f"log-probs differ by {band}; autocast stayed on inside the forward: no float32 rerun"
        if f32 <= f32_atol:
            return _NUMERICS_PASS, (f"{dtype} kernel numerics: {worst:.2e} is above the {dtype} tolerance {_tol(atol)} "
                                    f"(within {NUMERICS_FACTOR:g}x), and in float32 the same row agrees to {f32:.2e} "
                                    f"(tol {_tol(f32_atol)})")
        if f32 <= NUMERICS_FACTOR * f32_atol:
            return "kernel_numerics", f"log-probs differ by {band}; in float32 {f32:.2e} (tol {f32_atol:.0e})"
        worst_text = f"{worst:.2e} ({dtype}), {f32:.2e} in float32"
    else:
        worst_text = f"{worst:.2e}"
    return "wrong_positions", (f"packed vs solo log-probs differ by {worst_text}, but {moved_text}: attention is isolated, "
                               "the positions the model sees are not the examples' own")


def unpack_row(batch: Mapping[str, Any], slices: list[slice], pad_id: int, keep: list[int] | None = None) -> dict[str, Any]:
    """The packed row ``batch`` as a right-padded batch ``(num_examples, max_len)``: per-token keys split at
    ``slices`` (the examples ``keep``, default all) and padded (input_ids with ``pad_id``, labels with -100,
    the others with 0), an ``attention_mask`` of the real tokens, the packed-only keys (cu_seq_lens_q/k,
    max_length_q/k, seq_idx) dropped, every other key (num_items_in_batch, use_cache, ...) kept."""
    import torch

    ids = batch["input_ids"]
    total = int(ids.shape[1])
    chosen = [slices[i] for i in (keep if keep is not None else range(len(slices)))]
    width = max(s.stop - s.start for s in chosen)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "attention_mask"):
            continue
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (1, total):
            fill = pad_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            rows = value.new_full((len(chosen), width), fill)
            for r, s in enumerate(chosen):
                rows[r, : s.stop - s.start] = value[0, s]
            out[key] = rows
        else:
            out[key] = value
    mask = torch.zeros((len(chosen), width), dtype=torch.long, device=ids.device)
    for r, s in enumerate(chosen):
        mask[r, : s.stop - s.start] = 1
    out["attention_mask"] = mask
    return out


def _padded_diff(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool,
                 reference: dict[int, Any]) -> float:
    """Worst log-prob diff of the labelled examples run as one right-padded batch, vs the solo runs."""
    import torch

    order = list(reference)
    pad = getattr(model.config, "pad_token_id", None)
    padded = unpack_row({**inputs, "input_ids": row.batch["input_ids"]}, row.slices, pad if isinstance(pad, int) else 0, order)
    padded["use_cache"] = False
    width = padded["input_ids"].shape[1]
    tgt = torch.full((len(order), width - 1), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
    for r, i in enumerate(order):
        s = row.slices[i]
        tgt[r, : s.stop - s.start - 1] = targets[0, s.start:s.stop - 1]
    accepted = _accepts(model)
    call = {k: v for k, v in padded.items() if accepted is None or k in accepted or k == "position_ids"}
    if fused:
        lp = model(**call, labels=torch.cat([tgt[:, :1], tgt], dim=1), fused_lm_head=True).log_probs.float()
    else:
        logits = model(**call).logits[:, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, tgt.clamp_min(0)[..., None])[..., 0]
    worst = 0.0
    for r, i in enumerate(order):
        s = row.slices[i]
        keep = tgt[r, : s.stop - s.start - 1] != IGNORE_INDEX
        worst = max(worst, float((lp[r, : s.stop - s.start - 1][keep] - reference[i][keep]).abs().max()))
    return worst


def _finish(result: GuardResult, model: Any) -> GuardResult:
    """Fill in the remedy from diagnose.remedy, for the backend that ran and the installed versions."""
    if result.cause and not result.remedy:
        from .analysis.diagnose import remedy
        from .backends import MASKED_BACKENDS

        cell = {"backend": result.run.get("attn_implementation"), "check": "guard",
                "metrics": {"batch_has_position_ids": bool(result.probes.get("batch_has_position_ids", True))}}
        result.remedy = remedy(result.cause, cell, {k: v for k, v in result.versions.items() if v})
        if result.cause == "kernel_numerics" and result.dtype in _REDUCED:
            result.remedy = (f"not decided in {result.dtype}: run verify_packed_batch once on a float32 copy of the model "
                             "(model.float()) with this batch; if it passes there, widen the tolerance "
                             f"(tolerances={{'{result.dtype}': {{'logits_atol': ..., 'loss_atol': ...}}}})")
        elif result.cause == "kernel_numerics":
            result.remedy = ("the kernel differs on packed vs per-example shapes while keeping the boundaries: if it is "
                             f"expected to differ by {_fmt(result.max_logprob_diff)}, widen logits_atol (tolerances="
                             "{'float32': {'logits_atol': ..., 'loss_atol': ...}}); else report it to the kernel's maintainers")
        elif (result.cause == "leak" and result.probes.get("batch_has_position_ids") is False
              and result.run.get("attn_implementation") in MASKED_BACKENDS):
            result.remedy = ("return position_ids from the collator (DataCollatorWithFlattening(return_position_ids=True)): "
                             "eager / sdpa / flex build the packed mask from position_ids; cu_seq_lens_q reach only the "
                             "flash path")
        elif result.cause == "crash":
            result.remedy = "see the exception: the model cannot run this batch as the loop feeds it"
    return result


def print_line(line: str) -> None:
    """Print the guard's line on its own line of stderr: through ``tqdm.write`` (which clears the live progress
    bars the Trainer's ProgressCallback draws on the same stream, prints, and redraws them), else after a newline."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it no bar can be live
        print(f"\n{line}", file=sys.stderr)
        return
    tqdm.write(line, file=sys.stderr)


def _warn(line: str) -> None:
    """A :class:`PackcheckGuardWarning` from inside the training loop, shown while the progress bars are cleared
    (``tqdm.external_write_mode``), so its text does not land inside a bar either."""
    try:
        from tqdm import tqdm
    except ImportError:
        warnings.warn(line, PackcheckGuardWarning, stacklevel=3)
        return
    with tqdm.external_write_mode(file=sys.stderr):
        warnings.warn(line, PackcheckGuardWarning, stacklevel=3)


def _not_packed(model: Any, batch: Mapping[str, Any], why: str) -> GuardResult:
    """The result for a first training batch that is not a packed row: nothing judged."""
    import torch

    ids = batch.get("input_ids")
    shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
    config = getattr(model, "config", None)
    run = {"attn_implementation": getattr(config, "_attn_implementation", None), "training": True, "input_ids": shape,
           "keys": sorted(map(str, batch))}
    dtype = _ComputeProbe(model, ids.device.type if isinstance(ids, torch.Tensor) else "cpu")
    dtype.remove()
    rows = shape[0] if shape and len(shape) == 2 else 0
    return GuardResult(verdict="skipped", cause=None, remedy="", dtype=dtype.weights, dtype_source=f"{dtype.weights} weights",
                       evidence=f"not packed: nothing to check ({why.removeprefix('verify_packed_batch: ')})",
                       tolerance=_pick(_default_tolerances(), dtype.weights), max_logprob_diff=None,
                       per_example_logprob_diff=[], loss_packed=None, loss_reference=None, loss_delta=None,
                       lengths=[shape[1]] * rows if shape and len(shape) == 2 else [], label_tokens=0, contract=[], run=run,
                       attention={}, versions=_versions())


# ------------------------------------------------------------------------------------------------------------
# The Trainer / SFTTrainer callback


class PackcheckCallback(TrainerCallback):
    """Check the first training batch of a ``Trainer`` / ``SFTTrainer`` run before the first optimizer step.

    ``trainer.add_callback(PackcheckCallback())``, or ``callbacks=[PackcheckCallback()]`` when building the
    trainer. At ``on_train_begin`` a forward pre-hook goes on the model; the first forward in training mode
    hands it the batch exactly as the trainer feeds the model (after the collator and device placement); the
    hook removes itself, runs :func:`verify_packed_batch` on it (same model, dtype, autocast, use_cache,
    attn_implementation), prints one line, writes the full result to ``<output_dir>/packcheck-guard.json``
    (main process) and keeps it in ``self.result``. Then, on a mismatch, by ``on_mismatch``:

    - ``"raise"`` (default): raise :class:`PackedBatchMismatch` from inside that forward: no step is taken;
    - ``"warn"``: a :class:`PackcheckGuardWarning`, training goes on unchanged;
    - ``"disable"``: a fallback for the rest of training (``self.fallback`` says which): ``use_cache=False``
      on every training forward for the cache trap, the attention_mask dropped from packed rows for the mask
      trap, else packing off: each packed row unpacked into a right-padded batch (:func:`unpack_row`) before
      the model, provided the first batch padded matches its examples alone (else it raises: no safe fallback).
      A broken batch contract (cause ``collator_contract``) has no fallback and raises.

    The model's modes, config, gradients, the RNG states, the optimizer and the dataloader are left as they
    were: the first step is bit-identical with and without the callback.
    """

    def __init__(self, on_mismatch: str = "raise", tolerances: Mapping[str, Mapping[str, float]] | None = None,
                 verbose: bool = True) -> None:
        if on_mismatch not in POLICIES:
            raise PackcheckUsageError(f"PackcheckCallback: unknown on_mismatch={on_mismatch!r}: expected one of "
                                      f"{', '.join(POLICIES)}.")
        _tolerances(tolerances)  # a bad tolerances dict is refused here, not at the first training step
        self.on_mismatch = on_mismatch
        self.tolerances = tolerances
        self.verbose = verbose
        self.result: GuardResult | None = None
        self.fallback: str | None = None
        self._handles: list[Any] = []
        self._fix: dict[str, Any] | str = {}
        self._output_dir: str | None = None
        self._main = True

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None or self.result is not None:
            return
        self._output_dir = getattr(args, "output_dir", None)
        self._main = bool(getattr(state, "is_world_process_zero", True))
        self._handles.append(model.register_forward_pre_hook(self._first_forward, with_kwargs=True))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _first_forward(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return None  # an evaluation before training: wait for the first training forward
        self._remove()
        batch = dict(kwargs)
        if args and "input_ids" not in batch:
            batch["input_ids"] = args[0]
        try:
            result = verify_packed_batch(module, batch, training=True, tolerances=self.tolerances,
                                         padded_probe=self.on_mismatch == "disable")
        except NotPackedError as exc:  # a run that does not pack: nothing to check, training goes on
            result = _not_packed(module, batch, str(exc))
        self.result = result
        if not result.ok and self.on_mismatch == "disable":
            self.fallback = self._install_fallback(module, result)
            result.fallback = self.fallback
        self._report(result)
        if result.ok:
            if result.verdict in ("fallback", "skipped"):
                _warn(result.line())
            return None
        if self.on_mismatch == "raise" or (self.on_mismatch == "disable" and self.fallback is None):
            raise PackedBatchMismatch(result)
        if self.on_mismatch == "warn":
            _warn(result.line())
            return None
        return self._apply(module, args, kwargs)  # this first batch takes the fallback too

    def _report(self, result: GuardResult) -> None:
        if self.verbose:
            print_line(result.line())
        if self._main and self._output_dir:
            path = Path(self._output_dir) / RESULT_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(result.to_json())

    def _install_fallback(self, model: Any, result: GuardResult) -> str | None:
        # a broken batch contract (and every cause without a listed fallback) gets padding only if the padded probe
        # ran and matched; the contract path returns before it runs, so it has no fallback and raises
        if result.cause in FALLBACKS:
            self._fix = {"cache_trap": {"use_cache": False},
                         "mask_override": {"attention_mask": None, **({"use_cache": False} if result.run["use_cache"] else {})}}[result.cause]
            text = FALLBACKS[result.cause] + (" (and use_cache=False)" if result.cause == "mask_override" and result.run["use_cache"] else "")
        else:
            padded = result.probes.get("padded")
            if not isinstance(padded, float) or padded > result.tolerance["logits_atol"]:
                return None
            self._fix = "padding"
            text = f"{PADDING_FALLBACK} (first batch padded vs its examples alone: {padded:.2e})"
        self._handles.append(model.register_forward_pre_hook(self._apply, with_kwargs=True))
        return text

    def _apply(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        """The installed fallback, on every training forward of a packed row."""
        if not module.training:
            return None
        if self._fix != "padding":
            new = {k: v for k, v in {**kwargs, **self._fix}.items() if v is not None}
            return args, new
        batch = dict(kwargs)
        if args and "input_ids" not in batch:
            batch["input_ids"], args = args[0], args[1:]
        try:
            row = parse_row(batch, getattr(module, "config", None))
        except PackcheckUsageError:
            return None  # not a packed row: leave it alone
        if len(row.slices) < 2:
            return None
        labels = batch.get("labels")
        # slices without a label (TRL's pad_to_multiple_of tail: one token each) add nothing to the loss
        keep = [i for i, s in enumerate(row.slices) if labels is None or bool((labels[0, s.start + 1:s.stop] != IGNORE_INDEX).any())]
        pad = getattr(module.config, "pad_token_id", None)
        return args, unpack_row(batch, row.slices, pad if isinstance(pad, int) else 0, keep or None)
