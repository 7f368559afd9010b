"""Naming the cause of a mismatch: the packed row rerun with each suspect removed (attention_mask, cache, M-RoPE
layout, plain position_ids), the isolation probe (``leak`` vs ``wrong_positions``), the float32 rerun of the
numerics band, the right-padded probe, and the cause of a row the model refuses."""

from __future__ import annotations

from typing import Any

from ..results.metrics import worst as worst_diff
from .batch import IGNORE_INDEX, _Row, _text_config, takes_mrope, unpack_row
from .forward import _accepts, _log_probs, _solo
from .precision import _REDUCED, _ComputeProbe, _default_tolerances
from .result import _tol


def _refusal_cause(model: Any, exc: BaseException) -> str | None:
    """The audit's cause of a packed row the model refuses: its flash path's cu_seq_lens that do not fit the row
    (``flash_boundaries``, the reference kernels' FlashBoundariesError), or stateful layers that cannot keep
    examples apart here (``stateful_layers_refused``: transformers 5.x raises "can't keep packed sequences apart"
    without flash-linear-attention / causal_conv1d); None for any other exception (a crash)."""
    from ..backends import FlashBoundariesError
    from ..checks.probes import stateful_layers
    from ..run.runner import STATEFUL_REFUSALS

    if isinstance(exc, FlashBoundariesError):
        return "flash_boundaries"
    if stateful_layers(model) and any(m in str(exc) for m in STATEFUL_REFUSALS):
        return "stateful_layers_refused"
    return None

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
        worst = worst_diff(worst, float((lp[s.start:s.stop - 1][keep] - ref[keep]).abs().max()))
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
    if pos is None or pos.ndim != 2 or not takes_mrope(text):
        return None
    from ..model.multimodal import position_layout

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
    from the batch's keys): the attention_mask, then the cache, then both (the suspect's, when the rerun without it
    is within tolerance or within numerics while the row is not: :func:`~pytest_packcheck.checks.registry.fixed_by`,
    the audit's rule, so a tolerance of 0 does not turn a cache trap into a leak); then the attention counts, the
    stateful layers, the position_ids (ignored; an M-RoPE layout), the numerics band
    (:func:`~pytest_packcheck.checks.registry.within_numerics`, the audit's rule; a float32 rerun), and an
    isolation probe (change the first example, see whether the others move) for ``leak`` vs
    ``wrong_positions``."""
    import torch

    from ..checks.probes import stateful_layers
    from ..checks.registry import NUMERICS_FACTOR, fixed_by, rounding_level, within_numerics

    atol, worst = tol["logits_atol"], cmp["max"] or 0.0
    if others:
        return "backend_swap", f"requested {attention['requested']}, attention ran on {others}; packed vs solo {worst:.2e}"
    if packed is None:
        packed, _ = _log_probs(model, inputs, targets, fused)
        counter[0] += 1
    scale = float(packed[targets[0] != IGNORE_INDEX].abs().max())  # the log-probs' magnitude: their rounding level

    def fixed(rerun: float | None) -> bool:  # the suspect removed, the row is right: the audit's rule (registry.fixed_by)
        return rerun is not None and fixed_by(rerun, worst, atol, dtype, scale)

    def rerun(name: str, **change: Any) -> float | None:
        """One diagnostic rerun, recorded in ``probes``; a rerun the model cannot run (OPT's 128 learned positions
        and plain position_ids over a 137-token row: IndexError) is recorded as such and judges nothing, never an
        exception out of the trainer's first step (trial 6, 136)."""
        try:
            probes[name] = _rerun(model, row, targets, inputs, fused, counter, reference, **change)
        except Exception as exc:  # noqa: BLE001 - the model's refusal of the probe's input is the probe's answer
            probes[f"{name}_error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
            return None
        return probes[name]

    if "attention_mask" in inputs and fixed(rerun("without_attention_mask", attention_mask=None)):
        return "mask_override", (f"with the attention_mask {worst:.2e}, without it {probes['without_attention_mask']:.2e}")
    if inputs.get("use_cache"):
        if fixed(rerun("use_cache_false", use_cache=False)):
            return "cache_trap", f"use_cache=True {worst:.2e}, use_cache=False {probes['use_cache_false']:.2e}"
        if "attention_mask" in inputs:
            both = rerun("use_cache_false_without_attention_mask", use_cache=False, attention_mask=None)
            if fixed(both):
                return "mask_override", (f"{worst:.2e} as run; correct only without the attention_mask and with "
                                         f"use_cache=False ({both:.2e}): also set use_cache=False")
    stateful = stateful_layers(model)
    if stateful and not attention["boundaries_missing"]:
        return "stateful_layers", f"layers {', '.join(stateful[:3])}; attention boundaries reached; packed vs solo {worst:.2e}"
    pos = inputs.get("position_ids")
    layout = _mrope_layout(model, inputs)
    if layout is not None and fixed(rerun("laid_out_position_ids", position_ids=layout.apply(pos))):
        return "position_layout", (f"the collator's (1, {row.total}) position_ids {worst:.2e}; laid out as "
                                   f"({layout.rows}, 1, {row.total}) {probes['laid_out_position_ids']:.2e}")
    if isinstance(pos, torch.Tensor) and pos.ndim == 2:
        plain = torch.arange(row.total, device=pos.device)[None] + int(pos[0, 0])
        same = rerun("plain_position_ids", position_ids=plain)
        if same is not None and abs(same - worst) <= 1e-6 * max(1.0, worst):
            return "ignores_position_ids", (f"restarting position_ids changes nothing (packed vs solo {worst:.2e} either "
                                            "way)")
    moved = _isolation_moved(model, row, targets, inputs, fused, counter, packed)
    probes["isolation_moved"] = moved
    missing = attention["boundaries_missing"]
    isolated = not missing and (moved <= atol if moved is not None else attention["boundaries_reached"] > 0)
    moved_text = f"changing the first example moves the others by {moved:.2e}" if moved is not None else "no later example to move"
    if not isolated:
        detail = f"; boundaries missing in {missing} of {sum(attention['calls'].values())} attention calls" if missing else ""
        return "leak", f"packed vs solo log-probs differ by {worst:.2e}; {moved_text}{detail}"
    floor = rounding_level(dtype, scale)
    within = (f"within {NUMERICS_FACTOR:g}x the {dtype} tolerance {_tol(atol)}" if atol >= floor else
              f"within {NUMERICS_FACTOR:g}x {dtype} rounding ({floor:.2e} at log-probs of {scale:.2f}; tolerance "
              f"{_tol(atol)} is below it)")
    band = f"{worst:.2e}, {within}, boundaries kept ({moved_text})"
    if within_numerics(worst, atol, dtype, scale):
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
        if within_numerics(f32, f32_atol, "float32", scale):
            return "kernel_numerics", f"log-probs differ by {band}; in float32 {f32:.2e} (tol {f32_atol:.0e})"
        worst_text = f"{worst:.2e} ({dtype}), {f32:.2e} in float32"
    else:
        worst_text = f"{worst:.2e}"
    return "wrong_positions", (f"packed vs solo log-probs differ by {worst_text}, but {moved_text}: attention is isolated, "
                               "the positions the model sees are not the examples' own")


def _padded_diff(model: Any, row: _Row, targets: Any, inputs: dict[str, Any], fused: bool,
                 reference: dict[int, Any]) -> float:
    """Worst log-prob diff of the labelled examples run as one right-padded batch, vs the solo runs."""
    import torch

    order = list(reference)
    pad = getattr(model.config, "pad_token_id", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    # the pad positions are masked, so any id in the vocabulary does; a tokenizer's pad id past the embedding (512 of
    # 512, an added pad token the model was not resized for) raised IndexError inside the user's training (trial 12, 198)
    ok = isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 and (not isinstance(rows, int) or pad < rows)
    padded = unpack_row({**inputs, "input_ids": row.batch["input_ids"]}, row.slices, pad if ok else 0, order)
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
        worst = worst_diff(worst, float((lp[r, : s.stop - s.start - 1][keep] - reference[i][keep]).abs().max()))
    return worst
