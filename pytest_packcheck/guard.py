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

The probes: the batch contract (position_ids restarting, labels -100 at example starts, cu_seq_lens_q
agreeing, no attention_mask beside the row, per-token keys of one length); the packed row run as the loop
runs it (its use_cache, attention_mask, autocast, attn_implementation; TRL's fused LM head when the trainer
asks for it) and each labelled example alone, in eval mode under ``torch.no_grad`` with the RNG state
restored; per-token log-probs of the labelled tokens and their mean loss compared with the dtype's
tolerances (``audit/tolerances.toml``: ``logits_atol``, ``loss_atol``); attention calls counted per backend.
A mismatch is rerun with the suspect removed (use_cache=False, no attention_mask) to name the cause, with the
cause codes and remedies of :mod:`pytest_packcheck.diagnose`.
"""

from __future__ import annotations

import functools
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


class PackedBatchMismatch(PackcheckError):
    """The packed row does not train like its examples alone; ``.result`` holds the :class:`GuardResult`."""

    def __init__(self, result: GuardResult) -> None:
        super().__init__(result.line())
        self.result = result


class PackcheckGuardWarning(PackcheckWarning):
    """A mismatch under ``on_mismatch="warn"``, a silent backend swap, or a batch with nothing to compare."""


@dataclass
class GuardResult:
    """What :func:`verify_packed_batch` measured on one packed row.

    ``verdict``: "pass", "fail", "fallback" (numbers agree but attention ran on another backend than
    requested) or "skipped" (one example in the row: nothing to compare). ``cause``: a code of
    :data:`pytest_packcheck.diagnose.CAUSES` (None on a pass) and ``remedy`` its one-line fix.
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

    @property
    def ok(self) -> bool:
        """True unless the packed row trains differently from its examples (a pass, a fallback or a skip)."""
        return self.verdict != "fail"

    def line(self) -> str:
        """One line: verdict, worst difference and its tolerance, cause and remedy."""
        worst = "n/a" if self.max_logprob_diff is None else f"{self.max_logprob_diff:.2e}"
        loss = "n/a" if self.loss_delta is None else f"{self.loss_delta:.2e}"
        head = (f"packcheck guard: {self.verdict.upper()} on {len(self.lengths)} packed examples ({sum(self.lengths)} tokens, "
                f"{self.dtype}, {self.run.get('attn_implementation')}): worst log-prob diff {worst} "
                f"(tol {self.tolerance.get('logits_atol'):.0e}), loss diff {loss} (tol {self.tolerance.get('loss_atol'):.0e})")
        if self.cause:
            head += f"; cause {self.cause}: {self.evidence}; remedy: {self.remedy}"
        elif self.evidence:
            head += f"; {self.evidence}"
        if self.fallback:
            head += f"; fallback: {self.fallback}"
        return head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------------------------
# The batch


@dataclass
class _Row:
    """A validated packed row: its keys, the example slices, the targets and the contract problems."""

    batch: dict[str, Any]
    total: int
    slices: list[slice]
    problems: list[str]
    fatal: bool


def _usage(message: str) -> PackcheckUsageError:
    return PackcheckUsageError(f"verify_packed_batch: {message}")


def parse_row(batch: Any, config: Any = None) -> _Row:
    """Validate ``batch`` as one packed row and split it into examples (at the position_ids restarts, else at
    ``cu_seq_lens_q``). Contract problems are collected, not raised.

    Raises:
        PackcheckUsageError: ``batch`` is not a mapping, has no tensor ``input_ids`` of shape (1, total_tokens), or
            carries neither position_ids nor cu_seq_lens_q (one line naming the value and the fix).
    """
    import torch

    from .batches import position_ids_start

    if not isinstance(batch, Mapping):
        raise _usage(f"batch is a {type(batch).__name__}, expected a dict of tensors (the collator's output, e.g. "
                     "DataCollatorWithFlattening(return_position_ids=True)(features)).")
    ids = batch.get("input_ids")
    if ids is None:
        raise _usage(f"batch has no 'input_ids' (keys: {', '.join(map(str, batch)) or 'none'}): pass the collator's output "
                     "(inputs_embeds is not supported).")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise _usage(f"batch['input_ids'] is {shape}, expected a tensor of shape (1, total_tokens): one packed row "
                     "(return_tensors='pt').")
    if ids.shape[0] != 1:
        raise _usage(f"batch['input_ids'] has shape {tuple(ids.shape)}: a packed row has shape (1, total_tokens); pack "
                     "with DataCollatorWithFlattening or SFTConfig(padding_free=True), which put a batch into one row.")
    total = int(ids.shape[1])
    problems: list[str] = []
    fatal = False
    for key in TOKEN_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != (1, total):
            problems.append(f"{key} has shape {tuple(value.shape)}, input_ids {(1, total)}: per-token keys differ in length")
            fatal = True
    pos, cu = batch.get("position_ids"), batch.get("cu_seq_lens_q")
    if not isinstance(pos, torch.Tensor) and not isinstance(cu, torch.Tensor):
        raise _usage(f"batch carries neither position_ids nor cu_seq_lens_q (keys: {', '.join(map(str, batch))}): it is not a "
                     "packed row; use DataCollatorWithFlattening(return_position_ids=True) or SFTConfig(padding_free=True).")
    starts: list[int] = []
    if isinstance(pos, torch.Tensor) and not fatal:
        p = pos[0].tolist()
        starts = [0] + [i for i in range(1, total) if p[i] != p[i - 1] + 1]
        first = position_ids_start(config) if config is not None else p[0]
        wrong = [s for s in starts if p[s] != first]
        if wrong:
            problems.append(f"position_ids restart at {p[wrong[0]]}, not {first}, at token {wrong[0]} ({len(wrong)} examples)")
    if isinstance(cu, torch.Tensor):
        cu_list = [int(x) for x in cu.tolist()]
        if not starts:
            starts = cu_list[:-1]
        elif cu_list != [*starts, total]:
            problems.append(f"cu_seq_lens_q {cu_list[:8]} disagree with the position_ids restarts {starts[:8]} and the row "
                            f"length {total}")
        if cu.dtype != torch.int32:
            problems.append(f"cu_seq_lens_q dtype {cu.dtype}, flash-attn needs torch.int32")
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not fatal:
        unmasked = [s for s in starts[1:] if int(labels[0, s]) != IGNORE_INDEX]
        if unmasked:
            problems.append(f"labels not -100 at {len(unmasked)} example starts (token indices {unmasked[:5]})")
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        problems.append("an attention_mask rides beside the packed row (eager/sdpa/flex then build no packed mask)")
    starts = starts or [0]
    ends = [*starts[1:], total]
    return _Row(dict(batch), total, [slice(s, e) for s, e in zip(starts, ends, strict=True)], problems, fatal)


def _targets(row: _Row) -> Any:
    """Next-token targets (1, total - 1): the labels shifted, else the input_ids; -100 across example starts."""
    src = row.batch.get("labels")
    src = row.batch["input_ids"] if src is None else src
    targets = src[:, 1:].clone()
    for s in row.slices[1:]:
        targets[0, s.start - 1] = IGNORE_INDEX  # never score a token from the example before it
    return targets


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
    """Log-probs of each labelled example run alone (positions as in the row, use_cache=False, no mask)."""
    import torch

    out, which = [], []
    for i, s in enumerate(row.slices):
        seg_targets = targets[:, s.start:s.stop - 1]
        if s.stop - s.start < 2 or not bool((seg_targets != IGNORE_INDEX).any()):
            continue  # nothing labelled (padding, a prompt-only example): nothing to compare, no forward spent
        inputs = {k: v[:, s] for k, v in row.batch.items()
                  if k not in _ROW_KEYS and isinstance(v, torch.Tensor) and tuple(v.shape) == (1, row.total)}
        inputs["use_cache"] = False
        lp, _ = _log_probs(model, inputs, seg_targets, fused)
        counter[0] += 1
        out.append(lp)
        which.append(i)
    return out, which


def _compare(row: _Row, targets: Any, packed: Any, solo: list[Any], which: list[int]) -> dict[str, Any]:
    """Worst per-token log-prob diff, per example, and the token-mean losses over the labelled tokens."""
    per, total_p, total_s, count = [], 0.0, 0.0, 0
    for lp, i in zip(solo, which, strict=True):
        s = row.slices[i]
        keep = targets[0, s.start:s.stop - 1] != IGNORE_INDEX
        a, b = packed[s.start:s.stop - 1][keep], lp[keep]
        per.append(float((a - b).abs().max()))
        total_p, total_s, count = total_p - float(a.sum()), total_s - float(b.sum()), count + int(keep.sum())
    loss_p, loss_s = (total_p / count, total_s / count) if count else (None, None)
    return {"max": max(per) if per else None, "per_example": per, "loss_packed": loss_p, "loss_reference": loss_s,
            "loss_delta": abs(loss_p - loss_s) if count else None, "label_tokens": count}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


@functools.cache
def _installed_versions() -> tuple[tuple[str, Any], ...]:
    """Read once per process: importlib.metadata parses each distribution's METADATA (~10 ms each)."""
    from .results import _version

    return tuple((lib, _version(lib)) for lib in ("torch", "transformers", "trl", "accelerate", "flash-attn"))


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
    and ``position_ids`` ``(1, total_tokens)`` restarting per example (or ``cu_seq_lens_q`` int32
    ``(num_examples + 1,)``); optional ``labels`` ``(1, total_tokens)`` (-100 = not scored; without labels every
    next token is scored), ``attention_mask``, ``cu_seq_lens_k``, ``max_length_q/k``, ``seq_idx``,
    ``num_items_in_batch`` and ``fused_lm_head`` (TRL's fused LM head), all on the model's device.
    ``use_cache``: what the loop passes (default: the batch's, else ``model.config.use_cache``; transformers
    turns it off under gradient checkpointing in training). ``training``: whether the loop trains (default: the
    model's mode), used only for that rule. ``tolerances``: per dtype, default ``audit/tolerances.toml``.
    ``on_mismatch``: "return" the result, "warn" (:class:`PackcheckGuardWarning`) or "raise"
    (:class:`PackedBatchMismatch`). ``padded_probe``: on a mismatch, also run the row unpacked into a
    right-padded batch (:func:`unpack_row`, one more forward) and put its worst log-prob diff against the solo
    runs in ``probes["padded"]``: whether turning packing off would train right.

    Cost: the packed forward plus one forward per labelled example of the row, under ``torch.no_grad`` in eval
    mode; a mismatch adds at most four reruns to name the cause (one more with ``padded_probe``). The model's train/eval mode of every module, its
    config and the torch RNG states (CPU and CUDA) are restored; no gradient is touched. Units: log-probs and
    losses in nats.

    Raises:
        PackcheckUsageError: ``batch`` is not one packed row (see :func:`parse_row`) or ``on_mismatch`` is unknown.
        PackedBatchMismatch: on a mismatch with ``on_mismatch="raise"``.
    """
    import torch

    if on_mismatch not in ("return", "warn", "raise"):
        raise _usage(f"unknown on_mismatch={on_mismatch!r}: expected 'return', 'warn' or 'raise'.")
    started = time.perf_counter()
    row = parse_row(batch, getattr(model, "config", None))
    config = model.config
    training = model.training if training is None else training
    explicit = row.batch.get("use_cache")
    cache = bool(explicit if explicit is not None else use_cache if use_cache is not None else getattr(config, "use_cache", False))
    if cache and training and _gradient_checkpointing(model):
        cache = False  # transformers' merge_with_config_defaults / GradientCheckpointingLayer, 5.x
    fused = bool(row.batch.get("fused_lm_head"))
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
            result = _measure(model, row, run, cache, fused, tolerances, padded_probe)
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


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _measure(model: Any, row: _Row, run: dict[str, Any], cache: bool, fused: bool,
             tolerances: Mapping[str, Mapping[str, float]] | None, padded_probe: bool = False) -> GuardResult:
    """The probes, in eval mode under no_grad (see :func:`verify_packed_batch`)."""
    import torch

    from .backends import count_attention_calls
    from .checks import expected_attention_calls

    lengths = [s.stop - s.start for s in row.slices]
    tols = _tolerances(tolerances)
    base = {"verdict": "fail", "dtype": "float32", "lengths": lengths, "contract": row.problems, "run": run,
            "versions": _versions(), "per_example_logprob_diff": [], "label_tokens": 0}
    empty = {"max_logprob_diff": None, "loss_packed": None, "loss_reference": None, "loss_delta": None}
    if row.fatal:
        return _finish(GuardResult(**base, **empty, cause="collator_contract", remedy="", evidence=row.problems[0],
                                   tolerance=_pick(tols, "float32"), attention={}), model)
    targets = _targets(row)
    forwards = [0]
    dtypes: list[Any] = []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hook = head.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype)) if head is not None else None
    inputs = {k: v for k, v in row.batch.items() if k not in ("labels", "use_cache", "fused_lm_head", "num_items_in_batch")}
    inputs["use_cache"] = cache
    try:
        with count_attention_calls(model, lengths) as probe:
            packed, model_loss = _log_probs(model, inputs, targets, fused)
        forwards[0] += 1
    finally:
        if hook is not None:
            hook.remove()
    dtype = _dtype_name(dtypes[0] if dtypes else next(model.parameters()).dtype)
    run["autocast"] = dtype if dtypes and dtypes[0] != next(model.parameters()).dtype else None
    tol = _pick(tols, dtype)
    counts = probe.counts()
    requested = run["attn_implementation"]
    on_requested = {k: v for k, v in counts.items() if k == requested or (requested == "sdpa" and k.startswith("sdpa"))}
    others = {k: v for k, v in counts.items() if k not in on_requested}
    isolated = [c.isolated for c in probe.calls]
    attention = {"requested": requested, "calls": counts, "expected_calls": expected_attention_calls(model),
                 "boundaries_reached": sum(1 for i in isolated if i), "boundaries_missing": sum(1 for i in isolated if i is False),
                 "varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls}
    if len(row.slices) < 2:
        return _finish(GuardResult(**{**base, "verdict": "skipped"}, **empty, cause=None, remedy="",
                                   evidence="one example in the row: nothing to compare", tolerance=tol,
                                   attention=attention, forwards=forwards[0]), model)
    solo, which = _solo(model, row, targets, fused, forwards)
    cmp = _compare(row, targets, packed, solo, which)
    bad = _bad(cmp, tol)
    probes: dict[str, Any] = {}
    if isinstance(model_loss, torch.Tensor) and cmp["loss_packed"] is not None and run["num_items_in_batch"] is None:
        probes["model_loss"] = float(model_loss)
    result = GuardResult(**{**base, "dtype": dtype, "label_tokens": cmp["label_tokens"],
                            "per_example_logprob_diff": cmp["per_example"]},
                         max_logprob_diff=cmp["max"], loss_packed=cmp["loss_packed"], loss_reference=cmp["loss_reference"],
                         loss_delta=cmp["loss_delta"], cause=None, remedy="", evidence="", tolerance=tol,
                         attention=attention, probes=probes, forwards=forwards[0])
    if not bad:
        result.verdict = "pass"
        if others:
            result.verdict, result.cause = "fallback", "backend_swap"
            result.evidence = f"requested {requested}, attention ran on {others}"
        elif row.problems:
            result.evidence = "numbers agree; note: " + "; ".join(row.problems)
        return _finish(result, model)
    reference = dict(zip(which, solo, strict=True))
    result.cause, result.evidence = _diagnose(model, row, targets, inputs, fused, cmp, tol, attention, others, probes,
                                              forwards, reference)
    if padded_probe:
        probes["padded"] = _padded_diff(model, row, targets, inputs, fused, reference)
        forwards[0] += 1
    result.forwards = forwards[0]
    return _finish(result, model)


def _bad(cmp: dict[str, Any], tol: dict[str, float]) -> bool:
    return bool((cmp["max"] is not None and cmp["max"] > tol["logits_atol"])
                or (cmp["loss_delta"] is not None and cmp["loss_delta"] > tol["loss_atol"]))


def _rerun(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool, counter: list[int],
           reference: dict[int, Any], **change: Any) -> float:
    """Worst log-prob diff of the packed row rerun with ``change`` (None drops the key) vs the solo runs."""
    call = {k: v for k, v in {**inputs, **change}.items() if v is not None}
    lp, _ = _log_probs(model, call, targets, fused)
    counter[0] += 1
    worst = 0.0
    for i, ref in reference.items():
        s = row.slices[i]
        keep = targets[0, s.start:s.stop - 1] != IGNORE_INDEX
        worst = max(worst, float((lp[s.start:s.stop - 1][keep] - ref[keep]).abs().max()))
    return worst


def _diagnose(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool, cmp: dict[str, Any],
              tol: dict[str, float], attention: dict[str, Any], others: dict[str, int], probes: dict[str, Any],
              counter: list[int], reference: dict[int, Any]) -> tuple[str, str]:
    """Name the cause of a mismatch by rerunning the packed row with each suspect removed (measured, not inferred
    from the batch's keys): the attention_mask, then the cache, then both; then the attention counts, the
    contract, the stateful layers, the position_ids, the size of the difference."""
    import torch

    from .checks import stateful_layers
    from .diagnose import NUMERICS_FACTOR

    atol, worst = tol["logits_atol"], cmp["max"] or 0.0
    if cmp["max"] is not None and worst <= atol:  # log-probs agree, the loss does not
        return "loss_normalisation", f"log-probs agree ({worst:.2e}) but the loss differs by {cmp['loss_delta']:.2e}"
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
    contract = [p for p in row.problems if not p.startswith("an attention_mask")]
    if contract:
        return "collator_contract", "; ".join(contract)
    stateful = stateful_layers(model)
    if stateful and not attention["boundaries_missing"]:
        return "stateful_layers", f"layers {', '.join(stateful[:3])}; attention boundaries reached; packed vs solo {worst:.2e}"
    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        plain = torch.arange(row.total, device=pos.device)[None] + int(pos[0, 0])
        probes["plain_position_ids"] = _rerun(model, row, targets, inputs, fused, counter, reference, position_ids=plain)
        if abs(probes["plain_position_ids"] - worst) <= 1e-6 * max(1.0, worst):
            return "ignores_position_ids", (f"restarting position_ids changes nothing (packed vs solo {worst:.2e} either "
                                            "way)")
    if worst <= NUMERICS_FACTOR * atol and not attention["boundaries_missing"]:
        return "kernel_numerics", f"log-probs differ by {worst:.2e} (tolerance {atol:.0e}), boundaries reached every call"
    missing = attention["boundaries_missing"]
    detail = f"; boundaries missing in {missing} of {sum(attention['calls'].values())} attention calls" if missing else ""
    return "leak", f"packed vs solo log-probs differ by {worst:.2e}{detail}"


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
    if result.cause:
        from .diagnose import remedy

        cell = {"backend": result.run.get("attn_implementation"), "check": "guard", "metrics": {}}
        result.remedy = remedy(result.cause, cell, {k: v for k, v in result.versions.items() if v})
        if result.cause == "collator_contract":
            result.remedy = ("fix the collator: one row with position_ids restarting per example, labels -100 at each "
                             "example start, cu_seq_lens_q int32 at the restarts (DataCollatorWithFlattening does)")
    return result


def _tolerances(tolerances: Mapping[str, Mapping[str, float]] | None) -> dict[str, dict[str, float]]:
    if tolerances is not None:
        return {k: dict(v) for k, v in tolerances.items()}
    return {k: dict(v) for k, v in _default_tolerances().items()}


@functools.cache
def _default_tolerances() -> dict[str, dict[str, float]]:
    """audit/tolerances.toml, read once per process."""
    from .settings import load_tolerances

    return load_tolerances(None, None, "default")[0]


def _pick(tols: dict[str, dict[str, float]], dtype: str) -> dict[str, float]:
    table = tols.get(dtype) or tols["float32"]
    return {"logits_atol": table["logits_atol"], "loss_atol": table["loss_atol"]}


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
        result = verify_packed_batch(module, batch, training=True, tolerances=self.tolerances,
                                     padded_probe=self.on_mismatch == "disable")
        self.result = result
        if not result.ok and self.on_mismatch == "disable":
            self.fallback = self._install_fallback(module, result)
            result.fallback = self.fallback
        self._report(result)
        if result.ok:
            if result.verdict in ("fallback", "skipped"):
                warnings.warn(result.line(), PackcheckGuardWarning, stacklevel=2)
            return None
        if self.on_mismatch == "raise" or (self.on_mismatch == "disable" and self.fallback is None):
            raise PackedBatchMismatch(result)
        if self.on_mismatch == "warn":
            warnings.warn(result.line(), PackcheckGuardWarning, stacklevel=2)
            return None
        return self._apply(module, args, kwargs)  # this first batch takes the fallback too

    def _report(self, result: GuardResult) -> None:
        if self.verbose:
            print(result.line(), file=sys.stderr)
        if self._main and self._output_dir:
            path = Path(self._output_dir) / RESULT_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(result.to_json())

    def _install_fallback(self, model: Any, result: GuardResult) -> str | None:
        if result.cause == "collator_contract":
            return None
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
