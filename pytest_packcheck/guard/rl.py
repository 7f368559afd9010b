"""The guard for RL loops: a packed RL batch's completion log-probs, as the trainer computed them, against each sample
run alone (issue 44).

RL trainers gather the log-prob of each completion token from a packed (or padded) forward and reduce it in their own
loss; a wrong boundary, a label rolled across a sample, ``logits_to_keep`` off by one or a temperature applied on one
path only leaves the loss finite and the run going. :func:`verify_packed_logprobs` takes the batch as verl / TRL
AsyncGRPO / OpenRLHF build it (one row, ``position_ids`` restarting or ``cu_seq_lens_q``, a completion mask) and,
optionally, the log-probs the trainer computed from it, and measures:

- the model's own packed row, gathered per segment, against each sample alone (the model and backend: ``leak``,
  ``wrong_positions``);
- the trainer's log-probs against the same reference (the trainer's gather: ``label_shift``,
  ``temperature_mismatch``, else ``packed_mismatch``);
- the trainer's loss against the reduction it says it uses (``loss_normalisation``: a per-token mean where a
  per-sequence mean was meant, or the reverse).

:func:`guard_grpo` wraps TRL's ``GRPOTrainer`` so its first training log-prob computation is checked the same way.
Units: nats. Tolerances: the model dtype's row of ``audit/tolerances.toml`` (``logits_atol`` for log-probs,
``loss_atol`` for the loss).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import PackcheckUsageError
from .precision import _pick, _tolerances
from .result import PackedBatchMismatch, say

#: Loss reductions :func:`verify_packed_logprobs` recomputes: over all completion tokens of the row at once (DAPO,
#: TRL's ``loss_type="bnpo"`` / ``"dapo"``), or per sample first and then over samples (GRPO's original, TRL's
#: ``loss_type="grpo"``).
LOSS_TYPES = ("token_mean", "sequence_mean")
#: Temperatures tried when the trainer's log-probs disagree: does another temperature explain them?
_TEMPERATURES = tuple(round(0.05 * k, 2) for k in range(1, 101))


@dataclass
class RLGuardResult:
    """What :func:`verify_packed_logprobs` measured. ``verdict``: "pass" or "fail"; ``cause`` / ``remedy``: the cause
    code (:mod:`pytest_packcheck.checks.causes`) and its fix, None / "" on a pass. ``max_packed_diff``: worst
    per-token |log-prob| difference (nats) of the model's packed row vs each sample alone; ``max_trainer_diff``: the
    same for the trainer's log-probs (None when none were given); ``loss_*``: the trainer's loss and the reduction
    recomputed (None when not given). ``segments``: the samples' lengths; ``completion_tokens``: tokens compared;
    ``forwards``: model forwards run; ``duration_s``: wall seconds; ``versions``: the stack measured. A model that
    raises on the row: "fail", cause ``crash`` (or the missing package's), ``max_packed_diff`` None."""

    verdict: str
    cause: str | None
    remedy: str
    evidence: dict[str, Any]
    dtype: str
    tolerance: dict[str, float]
    temperature: float
    segments: list[int]
    completion_tokens: int
    max_packed_diff: float | None
    max_trainer_diff: float | None = None
    loss: float | None = None
    loss_expected: float | None = None
    loss_type: str | None = None
    forwards: int = 0
    duration_s: float = 0.0
    versions: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict != "fail"

    def line(self) -> str:
        """One line: verdict, the numbers with their tolerance, cause and remedy."""
        from ..errors import scrub_secrets

        tol = self.tolerance["logits_atol"]
        skipped = self.verdict == "skipped"  # no token compared: no number (it read "0.00e+00 nats", hostile trial 5)
        parts = [(f"packcheck RL guard: {self.verdict.upper()} on {len(self.segments)} packed samples "
                  f"({self.completion_tokens} completion tokens, {self.dtype}, temperature {self.temperature:g}): "
                  + (f"model's packed row {self.max_packed_diff:.2e} nats per token (tol {tol:.0e})"
                     if self.max_packed_diff is not None and not skipped else
                     (self.evidence.get("why") if skipped else None) or "nothing compared"))]
        if self.max_trainer_diff is not None and not skipped:
            parts.append(f"trainer's log-probs {self.max_trainer_diff:.2e}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.6g} vs {self.loss_type} {self.loss_expected:.6g}")
        text = ", ".join(parts)
        if self.cause:
            text += f"; cause {self.cause}: {self.evidence.get('why', '')}".rstrip(": ") + f"; remedy: {self.remedy}"
        return scrub_secrets(text)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _refuse(message: str) -> PackcheckUsageError:
    return PackcheckUsageError(f"verify_packed_logprobs: {message}")


def _row(batch: Mapping[str, Any], key: str, length: int | None = None) -> Any:
    """``batch[key]`` as a 1-D tensor of one row: ``(1, N)`` or ``(N,)``; ``length`` when given must match."""
    import torch

    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise _refuse(f"batch[{key!r}] is a {type(value).__name__}: expected a torch.Tensor of shape (1, N).")
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1 or (length is not None and value.numel() != length):
        want = f"(1, {length})" if length is not None else "(1, N)"
        raise _refuse(f"batch[{key!r}] has shape {tuple(batch[key].shape)}: expected {want}, one packed row as the "
                      "trainer feeds the model (split a batch of rows and check each).")
    return value


def _temperature(value: Any) -> float:
    """A sampling temperature: a finite number above 0 (a float, an int or a 0-d tensor; not a string)."""
    import math

    try:
        t = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        t = float("nan")
    if isinstance(value, bool | str) or not math.isfinite(t) or t <= 0:
        raise _refuse(f"temperature={value!r:.40}: give the sampling temperature the trainer divides the logits by, a "
                      "finite number above 0 (GRPOConfig.temperature, e.g. 0.7 or 1.0).")
    return t


def _model_ok(model: Any) -> int | None:
    """The vocabulary size of ``model`` (its input embeddings' rows), after checking it is a torch module with
    parameters; None when the model does not say."""
    import torch

    if not isinstance(model, torch.nn.Module) or next(iter(model.parameters()), None) is None:
        raise _refuse(f"model is a {type(model).__name__}: expected the policy, a transformers causal LM (a torch.nn.Module "
                      "with parameters).")
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError):
        return None


def _as_values(value: Any, what: str, n: int) -> Any:
    """``value`` (a tensor, a list, a numpy array) as a float64 CPU tensor of ``n`` values, one per token."""
    import torch

    try:
        t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise _refuse(f"{what} is a {type(value).__name__} that is not a tensor of numbers ({type(exc).__name__}): "
                      f"give one value per token, a tensor of shape (1, {n}).") from None
    # log-probs and a per-token loss are real numbers: a bool / complex tensor, or an integer one (token ids handed over
    # as log-probs, e.g. completion_ids) was compared as if it were (a hostile trial); a whole-number loss is a number
    if t.dtype == torch.bool or t.dtype.is_complex or (what != "loss" and not t.dtype.is_floating_point):
        raise _refuse(f"{what} has dtype {t.dtype}: it holds real numbers (floats, in nats); pass the trainer's own "
                      f"{what}, not token ids or a mask.")
    try:
        t = t.to("cpu", torch.float64).reshape(-1)
    except (RuntimeError, NotImplementedError) as exc:  # a meta tensor holds no values
        raise _refuse(f"{what} cannot be read as numbers on the CPU ({type(exc).__name__}, on {t.device}): give one value "
                      f"per token, a tensor of shape (1, {n}).") from None
    if t.numel() != n:
        raise _refuse(f"{what} has {t.numel()} values for a row of {n} tokens: give one per token, (1, {n}), aligned to "
                      "the token it scores.")
    return t


def segments_of(batch: Mapping[str, Any]) -> tuple[list[tuple[int, int]], list[str]]:
    """The samples' ``(start, end)`` in the row, from ``cu_seq_lens_q`` when the batch holds it, else from where
    ``position_ids`` restart (drop below or equal to the previous position); and the contract problems found: the two
    disagreeing, a zero-length segment. Raises :class:`PackcheckUsageError` when neither key is there or
    ``cu_seq_lens_q`` does not cover the row."""
    n = int(_row(batch, "input_ids").numel())
    problems: list[str] = []
    from_positions = None
    if "position_ids" in batch:
        pos = _row(batch, "position_ids", n).tolist()
        starts = [0] + [t for t in range(1, n) if pos[t] <= pos[t - 1]]
        from_positions = list(zip(starts, [*starts[1:], n], strict=True))
    if "cu_seq_lens_q" in batch:
        cu = [int(x) for x in _row(batch, "cu_seq_lens_q").tolist()]
        if not cu or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in itertools.pairwise(cu)):
            raise _refuse(f"batch['cu_seq_lens_q'] = {cu[:8]}{'...' if len(cu) > 8 else ''} does not run from 0 up to the "
                          f"row's {n} tokens: give the cumulative sample lengths [0, len0, len0+len1, ..., {n}].")
        segs = list(itertools.pairwise(cu))
        empty = [i for i, (a, b) in enumerate(segs) if a == b]
        if empty:
            problems.append(f"cu_seq_lens_q holds {len(empty)} zero-length segment(s) (at {empty[:3]})")
        segs = [s for s in segs if s[0] < s[1]]
        if from_positions is not None and from_positions != segs:
            problems.append(f"cu_seq_lens_q's {len(segs)} segments are not where position_ids restart ({len(from_positions)} "
                            "segments)")
        return segs, problems
    if from_positions is None:
        raise _refuse("the batch has neither position_ids nor cu_seq_lens_q: a packed RL row needs one of them to say "
                      "where each sample starts.")
    return from_positions, problems


def _logprobs_of(logits: Any, tokens: Any, temperature: float) -> Any:
    """Log-prob (float64) of ``tokens[t]`` from ``logits[t - 1]`` for t >= 1 (the audit's own gather,
    :func:`pytest_packcheck.checks.rl.completion_logprobs`, from the sample's second token); NaN at t = 0 (nothing
    predicts it), so the result lines up with the row's tokens."""
    import torch

    from ..checks.rl import completion_logprobs

    lp = completion_logprobs(logits, tokens, 1, temperature, with_entropy=False)[0]
    return torch.cat([torch.full((1,), float("nan"), dtype=torch.float64), lp])


def _forward(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return model(**inputs, use_cache=False).logits[0].float()


def _reduce(per_token: Any, mask: Any, segs: list[tuple[int, int]], loss_type: str) -> float:
    if loss_type == "token_mean":
        return float(per_token[mask].sum() / mask.sum().clamp(min=1))
    means = [per_token[a:b][mask[a:b]].sum() / mask[a:b].sum() for a, b in segs if mask[a:b].any()]
    return float(sum(means) / max(len(means), 1))


def verify_packed_logprobs(model: Any, batch: Mapping[str, Any], logprobs: Any = None, *, temperature: float = 1.0,
                           per_token_loss: Any = None, loss: Any = None, loss_type: str | None = None,
                           tolerances: Any = None, on_mismatch: str = "return",
                           _explain: dict[str, tuple[Any, dict[str, Any]]] | None = None) -> RLGuardResult:
    """Check one packed RL row and, optionally, what the trainer computed from it.

    Args:
        model: the policy (a causal LM), as the trainer holds it; run in eval mode under no_grad, then put back.
        batch: ``input_ids`` ``(1, N)`` int64; ``position_ids`` ``(1, N)`` restarting at each sample and/or
            ``cu_seq_lens_q`` ``(S + 1,)`` int32 (both as verl's remove-padding path and TRL's padding-free rows
            give them; when both are given they must agree); ``completion_mask`` ``(1, N)`` (1 on the completion
            tokens the loss scores), or ``labels`` ``(1, N)`` unshifted (-100 where not scored).
        logprobs: the trainer's per-token log-probs ``(1, N)`` or ``(N,)``, float: ``logprobs[t]`` = log p(input_ids[t]
            | its sample's tokens before t), read where the completion mask is 1. None: only the model is checked.
        temperature: the sampling temperature the trainer divides the logits by (``GRPOConfig.temperature``).
        per_token_loss, loss, loss_type: the trainer's per-token loss ``(1, N)``, its reduced loss (a scalar) and the
            reduction it means (:data:`LOSS_TYPES`); all three or none.
        tolerances: dtype rows as :func:`verify_packed_batch` takes them (default ``audit/tolerances.toml``).
        on_mismatch: "return" (default: the result only), "raise" (:class:`PackedBatchMismatch` on a failure) or
            "warn" (a :class:`PackcheckGuardWarning` on a failure). A pass says nothing.
        _explain: for :func:`guard_grpo`: cause -> (log-probs, evidence) of a known wrong way to compute them; when the
            trainer's log-probs are those, that cause is named.

    Tolerance: the dtype's ``logits_atol``, times ``1 / temperature`` below a temperature of 1 (a log-prob divides
    the logits by it, magnifying their noise). A row whose completion mask scores nothing is "skipped", not passed.

    Returns:
        :class:`RLGuardResult`. A failed check raises only with ``on_mismatch="raise"``.

    Raises:
        PackcheckUsageError: a key missing or of the wrong shape or dtype, token ids outside the model's vocabulary,
            an empty row, a completion token at a sample's first position, ``cu_seq_lens_q`` not covering the row, a
            temperature that is not a finite number above 0, values that are not numbers, an unknown ``loss_type``
            or ``on_mismatch``, or a model that is not a torch module.
    """
    import math

    import torch

    t0 = time.perf_counter()
    if on_mismatch not in ("return", "raise", "warn"):
        raise _refuse(f"on_mismatch={on_mismatch!r}: expected 'return', 'raise' or 'warn'.")
    if loss_type is not None and loss_type not in LOSS_TYPES:
        raise _refuse(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}.")
    if (per_token_loss is None) != (loss is None) or (loss is not None and loss_type is None) or (loss is None and loss_type):
        raise _refuse(f"per_token_loss, loss and loss_type go together (loss_type one of {LOSS_TYPES}); got "
                      f"per_token_loss {'given' if per_token_loss is not None else 'None'}, loss "
                      f"{'given' if loss is not None else 'None'}, loss_type={loss_type!r}.")
    temperature = _temperature(temperature)
    vocab = _model_ok(model)
    if not isinstance(batch, Mapping):
        raise _refuse(f"batch is a {type(batch).__name__}: expected a dict of tensors (input_ids, position_ids or "
                      "cu_seq_lens_q, completion_mask).")
    if "input_ids" not in batch:
        raise _refuse("the batch has no 'input_ids'.")
    ids = _row(batch, "input_ids")
    from .batch import model_device, refuse_meta_model

    device_of_model = model_device(model)
    refuse_meta_model(device_of_model, _refuse)  # before a forward: a meta model is the caller's, not a crash verdict
    if device_of_model is not None and ids.device != device_of_model:
        raise _refuse(f"batch['input_ids'] is on {ids.device}, the model's embeddings on {device_of_model}: move the "
                      f"batch to the model's device (batch = {{k: v.to({str(device_of_model)!r}) for k, v in "
                      "batch.items()}).")
    n = int(ids.numel())
    if n == 0:
        raise _refuse("batch['input_ids'] is an empty row: nothing to check.")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise _refuse(f"batch['input_ids'] has dtype {ids.dtype}: token ids are integers (torch.long).")
    if int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab):
        raise _refuse(f"batch['input_ids'] holds token ids {int(ids.min())}..{int(ids.max())}, outside the model's "
                      f"vocabulary 0..{vocab - 1 if vocab else '?'}: the row and the model do not belong together.")
    segs, problems = segments_of(batch)
    if "completion_mask" in batch:
        mask = _row(batch, "completion_mask", n).bool()
    elif "labels" in batch:
        mask = _row(batch, "labels", n) != -100
    else:
        raise _refuse("the batch has neither 'completion_mask' nor 'labels': say which tokens the loss scores.")
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if isinstance(pad, int):  # a segment of padding inside the row (a collator's trailing pad counted as a sample)
        padding = [i for i, (a, b) in enumerate(segs) if not bool(mask[a:b].any()) and bool((ids[a:b] == pad).all())]
        if padding:
            problems.append(f"segment {padding[0]} of {len(segs)} holds only padding tokens (pad_token_id {pad}): the row's "
                            "boundaries count padding as a sample")
    firsts = [a for a, _ in segs if bool(mask[a])]
    if firsts and not problems:  # with a broken contract the segments themselves are in doubt: that is the finding
        raise _refuse(f"the completion mask scores the first token of {len(firsts)} sample(s) (position {firsts[0]}): "
                      "nothing before it predicts it; mask it out (prompts are at least one token).")
    scored = mask.cpu() & ~torch.isin(torch.arange(n), torch.tensor([a for a, _ in segs], dtype=torch.long))
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    tol = dict(_pick(_tolerances(tolerances, "verify_packed_logprobs"), dtype))
    # a log-prob is a difference of logits divided by the temperature: below 1 it magnifies the logits' own noise
    atol = tol["logits_atol"] * max(1.0, 1.0 / temperature)
    tol["logprob_atol"] = atol
    device = ids.device
    was_training = model.training
    model.eval()
    forwards = 0
    stage = "a sample run alone"
    try:
        # the reference: each sample alone, positions from 0
        alone_logits = []
        for a, b in segs:
            alone_logits.append(_forward(model, {"input_ids": ids[a:b][None], "position_ids": torch.arange(b - a, device=device)[None]}))
            forwards += 1
        stage = "the packed row as given"
        # the model's packed row, as the trainer feeds it (no attention_mask, no cache)
        inputs = {"input_ids": ids[None]}
        if "position_ids" in batch:
            inputs["position_ids"] = _row(batch, "position_ids", n)[None]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            if key in batch:
                inputs[key] = batch[key]
        if "position_ids" not in inputs:
            inputs["position_ids"] = torch.cat([torch.arange(b - a, device=device) for a, b in segs])[None]
        packed_logits = _forward(model, inputs)
        forwards += 1
    except PackcheckUsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model cannot run the row: a crash verdict, as verify_packed_batch gives
        return _crashed(model, exc, stage, dtype, tol, temperature, segs, forwards, t0, on_mismatch)
    finally:
        model.train(was_training)

    def reference(temp: float) -> Any:
        return torch.cat([_logprobs_of(lg, ids[a:b], temp) for lg, (a, b) in zip(alone_logits, segs, strict=True)])

    ref = reference(temperature)
    packed_lp = torch.cat([_logprobs_of(packed_logits[a:b], ids[a:b], temperature) for a, b in segs])
    evidence: dict[str, Any] = {}
    cause = None
    trainer_diff = None
    if problems:
        cause, evidence = "collator_contract", {"why": "; ".join(problems)}
    packed_diff, bad = _worst(packed_lp, ref, scored)
    if bad and cause is None:
        cause, evidence = "non_finite", {"why": f"{bad} completion log-probs are NaN or infinite (the model's packed row "
                                                "or a sample alone)", "non_finite": bad}
    if packed_diff > atol and cause is None:
        pos = inputs["position_ids"].reshape(-1).tolist()
        restarted = all(pos[a] == 0 for a, _ in segs)
        cause = "leak" if restarted else "wrong_positions"
        evidence = {"why": (f"the model's packed row gives {packed_diff:.2e} nats per token against each sample alone"
                            + ("" if restarted else "; position_ids do not start at 0 in every sample")),
                    "max_packed_diff": packed_diff}
    if logprobs is not None:
        got = _as_values(logprobs, "logprobs", n)
        trainer_diff, bad = _worst(got, ref, scored)
        if (trainer_diff > atol or bad) and cause is None:
            cause, evidence = _trainer_cause(got, ref, scored, reference, temperature, atol, trainer_diff, bad, _explain)
    loss_value = loss_expected = None
    if loss is not None:
        ptl = _as_values(per_token_loss, "per_token_loss", n)
        loss_t = _as_values(loss, "loss", 1)
        loss_value = float(loss_t[0])
        loss_expected = _reduce(ptl, mask.cpu(), segs, loss_type)
        if not (math.isfinite(loss_value) and math.isfinite(loss_expected)) and cause is None:
            cause, evidence = "non_finite", {"why": f"the loss ({loss_value}) or the per-token loss it reduces "
                                                    f"({loss_expected}) is NaN or infinite", "non_finite": 1}
        elif abs(loss_value - loss_expected) > tol["loss_atol"] and cause is None:
            other = next(t for t in LOSS_TYPES if t != loss_type)
            alt = _reduce(ptl, mask.cpu(), segs, other)
            matched = abs(loss_value - alt) <= tol["loss_atol"]
            cause = "loss_normalisation"
            evidence = {"why": (f"the loss {loss_value:.6g} is the {other} of the per-token loss ({alt:.6g}), not the "
                                f"{loss_type} ({loss_expected:.6g})") if matched else
                        f"the loss {loss_value:.6g} is neither the {loss_type} ({loss_expected:.6g}) nor the {other} ({alt:.6g})",
                        "matches": other if matched else None}
    judged = int(scored.sum())
    from ..checks.causes import CAUSE_RECORDS
    from .verify import _versions

    remedy = CAUSE_RECORDS[cause].remedy_for({"check": "guard", "status": "fail"}, evidence) if cause else ""
    verdict = "fail" if cause else "pass" if judged else "skipped"
    if verdict == "skipped":
        evidence = {"why": "the completion mask scores no token after a sample's first: nothing was compared"}
    result = RLGuardResult(
        verdict=verdict, cause=cause, remedy=remedy, evidence=evidence, dtype=dtype, tolerance=tol,
        temperature=float(temperature), segments=[b - a for a, b in segs], completion_tokens=judged,
        max_packed_diff=packed_diff, max_trainer_diff=trainer_diff, loss=loss_value, loss_expected=loss_expected,
        loss_type=loss_type, forwards=forwards, duration_s=round(time.perf_counter() - t0, 3), versions=_versions())
    return _deliver(result, on_mismatch)


def _deliver(result: RLGuardResult, on_mismatch: str) -> RLGuardResult:
    """``result``, and on a failure what ``on_mismatch`` asks: raise :class:`PackedBatchMismatch` or say its line."""
    if not result.ok and on_mismatch == "raise":
        raise PackedBatchMismatch(result)  # type: ignore[arg-type] - the exception carries any result with line()
    if not result.ok and on_mismatch == "warn":
        say(result.line())
    return result


def _crashed(model: Any, exc: Exception, stage: str, dtype: str, tol: dict[str, Any], temperature: float,
             segs: list[tuple[int, int]], forwards: int, t0: float, on_mismatch: str) -> RLGuardResult:
    """The verdict of a row the model raised on: "fail", cause ``crash`` (or the missing package's cause, as
    :func:`~.verify.verify_packed_batch` names it), the exception's first line with secrets scrubbed."""
    from ..errors import scrub_secrets
    from .diagnosis import _refusal_cause
    from .verify import _versions

    said = str(exc).splitlines()[0][:200] if str(exc) else ""
    cause = _refusal_cause(model, exc) or "crash"
    result = RLGuardResult(
        verdict="fail", cause=cause, remedy="see the exception: the model cannot run this row as the loop feeds it",
        evidence={"why": scrub_secrets(f"{stage} raised {type(exc).__name__}: {said}")}, dtype=dtype, tolerance=tol,
        temperature=float(temperature), segments=[b - a for a, b in segs], completion_tokens=0, max_packed_diff=None,
        max_trainer_diff=None, loss=None, loss_expected=None, loss_type=None, forwards=forwards + 1,
        duration_s=round(time.perf_counter() - t0, 3), versions=_versions())
    return _deliver(result, on_mismatch)


def _worst(got: Any, ref: Any, where: Any) -> tuple[float, int]:
    """Worst |got - ref| over ``where`` (nats) where both are finite (NaN when none of ``where`` is; 0.0 when ``where``
    is empty), and how many of ``where`` are not finite."""
    import torch

    finite = where & torch.isfinite(got) & torch.isfinite(ref)
    # none of ``where`` finite: NaN, never 0.0 (hostile trial 5: all-NaN log-probs read "trainer's log-probs 0.00e+00")
    worst = float((got[finite] - ref[finite]).abs().max()) if finite.any() else float("nan") if where.any() else 0.0
    return worst, int(where.sum() - finite.sum())


def _trainer_cause(got: Any, ref: Any, scored: Any, reference: Any, temperature: float, atol: float,
                   diff: float, bad: int = 0, explain: dict[str, tuple[Any, dict[str, Any]]] | None = None) -> tuple[str, dict[str, Any]]:
    """Why the trainer's log-probs differ from the reference while the model's packed row does not: one position
    off (a label rolled across a sample, ``logits_to_keep`` off by one; a value rolled in from outside the row is
    NaN), another temperature, non-finite values, or unexplained."""
    import torch

    for shift in (1, -1):
        moved = torch.roll(ref, shift)
        ok = scored & torch.isfinite(moved) & torch.isfinite(got)
        # on most of the scored tokens (a sample's last token has no shifted partner): a chance match at 1e-4 nats
        # on several tokens does not happen
        if int(ok.sum()) >= max(1, int(scored.sum()) // 2) and float((got[ok] - moved[ok]).abs().max()) <= atol:
            return "label_shift", {"why": f"the trainer's log-probs match the reference {abs(shift)} position "
                                          f"{'later' if shift == 1 else 'earlier'} (worst {diff:.2e} as aligned)", "shift": shift}
    if bad:
        return "non_finite", {"why": f"{bad} of the trainer's completion log-probs are NaN or infinite", "non_finite": bad}
    for cause, (candidate, evidence) in (explain or {}).items():
        if _worst(got, candidate, scored)[0] <= atol:
            return cause, evidence
    best = min(_TEMPERATURES, key=lambda t: _worst(got, reference(t), scored)[0])
    best_diff = _worst(got, reference(best), scored)[0]
    if best_diff <= atol and abs(best - temperature) > 1e-9:
        return "temperature_mismatch", {"why": f"the trainer's log-probs are the reference at temperature {best:g} "
                                               f"({best_diff:.2e}), not {temperature:g}", "matches_temperature": best}
    return "packed_mismatch", {"why": f"the trainer's log-probs differ from each sample alone by {diff:.2e} nats, the "
                                      "model's packed row does not", "trainer_logprobs": True}


def guard_grpo(trainer: Any, on_mismatch: str = "raise", tolerances: Any = None) -> Any:
    """Check the first training log-prob computation of TRL's ``GRPOTrainer`` (or ``RLOOTrainer``): wraps
    ``trainer._get_per_token_logps_and_entropies`` for one call made in training mode, rebuilds each sample from the
    left-padded batch (``attention_mask``), and compares the trainer's completion log-probs with each sample alone at
    ``trainer.temperature`` (:func:`verify_packed_logprobs`). When they differ as the model's own left-padded forward
    without ``position_ids`` differs (GRPO calls the model with ``input_ids`` and ``attention_mask`` only), the cause is
    ``padded_positions``. Prints the result's line on stderr (beside the trainer's progress bar) and returns a holder
    whose ``.result`` is the :class:`RLGuardResult` once the check ran.

    With ``on_mismatch="raise"`` (default) a failed check raises :class:`PackedBatchMismatch` out of that training
    step, before its optimizer step; "warn" warns; "return" only records. The wrapper removes itself after the first
    check.

    Raises:
        PackcheckUsageError: ``trainer`` has no ``_get_per_token_logps_and_entropies`` (not a TRL GRPO / RLOO trainer,
            or a TRL release without it), or ``on_mismatch`` is none of the three.
    """
    import torch

    from .result import print_line

    if on_mismatch not in ("return", "raise", "warn"):
        raise PackcheckUsageError(f"guard_grpo: on_mismatch={on_mismatch!r}: expected 'return', 'raise' or 'warn'.")
    original = getattr(trainer, "_get_per_token_logps_and_entropies", None)
    if not callable(original):
        raise PackcheckUsageError(f"guard_grpo: {type(trainer).__name__} has no _get_per_token_logps_and_entropies: pass a "
                                  "TRL GRPOTrainer or RLOOTrainer (trl >= 0.17), after constructing it.")
    holder = type("RLGuard", (), {"result": None})()

    def wrapped(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
        out = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if not model.training:
            return out
        trainer._get_per_token_logps_and_entropies = original  # once
        unwrapped = getattr(trainer.accelerator, "unwrap_model", lambda m: m)(model)
        temperature = float(getattr(trainer, "temperature", 1.0))
        # the trainer's own computation again in eval mode: dropout (GPT-2's 0.1; GRPOConfig.disable_dropout is off by
        # default) would otherwise be read as a mismatch. The training step keeps its own output.
        unwrapped.eval()
        try:
            with torch.no_grad():
                logps = original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)[0]
                # the model's own left-padded forward, as GRPO calls it (no position_ids)
                plain = unwrapped(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        finally:
            unwrapped.train()
        rows, positions, masks, given, padded = [], [], [], [], []
        width_p = input_ids.shape[1] - logits_to_keep
        for i in range(input_ids.shape[0]):
            keep = attention_mask[i].bool()
            ids = input_ids[i][keep]
            rows.append(ids)
            positions.append(torch.arange(ids.numel(), device=ids.device))
            n_prompt = int(keep[:width_p].sum())
            n_completion = ids.numel() - n_prompt
            masks.append(torch.cat([torch.zeros(n_prompt, dtype=torch.long), torch.ones(n_completion, dtype=torch.long)]).to(ids.device))
            lp = torch.full((ids.numel(),), float("nan"), dtype=torch.float64)
            lp[n_prompt:] = logps[i, :n_completion].detach().double().cpu()
            given.append(lp)
            padded.append(_logprobs_of(plain[i][keep], ids, temperature))
        batch = {"input_ids": torch.cat(rows)[None], "position_ids": torch.cat(positions)[None],
                 "completion_mask": torch.cat(masks)[None]}
        explain = {"padded_positions": (torch.cat(padded), {
            "why": "the trainer's log-probs are the model's left-padded forward without position_ids, which numbers "
                   "each sample's positions from its padding count"})}
        holder.result = verify_packed_logprobs(unwrapped, batch, torch.cat(given)[None], temperature=temperature,
                                               tolerances=tolerances, on_mismatch=on_mismatch, _explain=explain)
        print_line(holder.result.line())
        return out

    trainer._get_per_token_logps_and_entropies = wrapped
    return holder
