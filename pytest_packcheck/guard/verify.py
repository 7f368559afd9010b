"""The check of one packed batch: :func:`verify_packed_batch` (one packed row, or a batch of packed rows row by row
and together) and the probes in order (:func:`_measure`), the remedy filled in last (:func:`_finish`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from ..errors import PackcheckUsageError
from ..results.metrics import worst as worst_diff
from .batch import (
    IGNORE_INDEX,
    LOGPROB_NEUTRAL,
    _contract_remedy,
    _int_or_none,
    _Row,
    _targets,
    check_fields,
    model_device,
    packed_rows,
    parse_row,
)
from .diagnosis import _NUMERICS_PASS, _bad, _diagnose, _padded_diff, _refusal_cause
from .encoder import encoder_output, measure_encoder, rows_diff
from .forward import _accepts, _batchable, _compare, _log_probs, _reference, _row_log_probs, _solo
from .pixels import is_pixel_batch, measure_pixel_row
from .precision import _REDUCED, _ComputeProbe, _pick, _tolerances
from .result import GuardResult, PackedBatchMismatch, _fmt, _usage, say
from .result import hide_mismatch_frames as _hide


@functools.cache
def _installed_versions() -> tuple[tuple[str, Any], ...]:
    """Read once per process: importlib.metadata parses each distribution's METADATA (~10 ms each)."""
    from ..versions.libraries import installed_version, stack_libraries

    return tuple((lib.name, installed_version(lib)) for lib in stack_libraries())


def _versions() -> dict[str, Any]:
    return dict(_installed_versions())


def _gradient_checkpointing(model: Any) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


#: Class-name endings of language models: accepted even where get_output_embeddings() says nothing (a 4.x class
#: that does not override it); every other model must show an LM head.
_LM_CLASS_ENDINGS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
#: Class names of transformers' heads that are not causal LMs (refused even with an output embedding: ForMaskedLM).
_NOT_CAUSAL_CLASS_ENDINGS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _not_a_causal_lm(model: Any) -> str | None:
    """Why ``model`` is not a causal LM the guard can judge (its forward returns no ``.logits`` over the vocabulary:
    a bare backbone such as LlamaModel, a classification head; or it attends both ways), or None. Asked only of a
    model that is not an encoder the guard judges on its outputs (:func:`.encoder.encoder_output`: BertModel,
    BertForMaskedLM, ...ForTokenClassification of an encoder).
    Structural: the class name ends in a non-causal head's (:data:`_NOT_CAUSAL_CLASS_ENDINGS`), or
    ``get_output_embeddings()`` is None and the class name is not a language model's; a wrapper without the method
    (PEFT delegates it, a custom module may not have it) is let through, its forward decides."""
    name = type(model).__name__
    getter = getattr(model, "get_output_embeddings", None)
    head: Any = True  # unknown: a wrapper without the method, or one that cannot say
    if callable(getter) and not name.endswith(_LM_CLASS_ENDINGS):
        try:
            head = getter()
        except Exception:  # noqa: BLE001 - a model that cannot say: its forward decides
            head = True
    if head is None:
        return (f"model is a {name}, which has no LM head (get_output_embeddings() is None): the guard needs "
                "a causal LM, whose forward returns .logits over the vocabulary (e.g. LlamaForCausalLM, or a multimodal "
                "...ForConditionalGeneration on its text path), or an encoder's base model / masked-LM / "
                "token-classification head (BertModel, RobertaForMaskedLM); pass that model (the Trainer's model, "
                "AutoModelForCausalLM.from_pretrained(...)).")
    if name.endswith(_NOT_CAUSAL_CLASS_ENDINGS):  # BertForMaskedLM has an LM head, but its attention sees both ways
        return (f"model is a {name}, not a causal LM (a masked-LM, classification or QA head: every token attends to "
                "the whole row both ways, so there is no causal packing contract to check): the guard needs a causal "
                "LM, whose forward returns .logits over the vocabulary (e.g. LlamaForCausalLM); pass that model.")
    return None


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
    :data:`~pytest_packcheck.checks.registry.NUMERICS_FACTOR` times it (or times the dtype's rounding level where
    the tolerance is below it: :func:`~pytest_packcheck.checks.registry.within_numerics`), with every attention call
    keeping the boundaries, is rerun in float32 (autocast off) when the weights are float32: a pass with a note when float32
    agrees; without float32 weights it fails as ``kernel_numerics`` with the float32 check as remedy.

    An encoder or embedding model (:func:`.encoder.encoder_output`: ``config.is_decoder`` false, a model_type with a
    masked-LM class; its base model as ``AutoModel`` builds it, or its masked-LM / token-classification head) is
    judged on what it outputs (:func:`.encoder.measure_encoder`, ``result.compared``): the per-token logits (else
    ``last_hidden_state``), the mean / CLS / last-token embeddings of each segment and, with ``labels`` (on their own
    token, unshifted), the masked-LM loss, against each example alone without ``position_ids`` (the model numbers it:
    BERT from 0, RoBERTa-likes from ``padding_idx + 1``); a mismatch is named ``mask_override``, ``leak`` (the others
    move when the first example changes), ``kernel_numerics`` or ``wrong_positions``.

    A VLM row with ``pixel_values`` (``image_grid_thw`` / ``mm_token_type_ids``, ``image_sizes``, ``token_type_ids``)
    is judged by :func:`.pixels.measure_pixel_row`: its text log-probs and loss against each sample alone with its own
    pixels (the model's own forward, positions from its ``get_rope_index``), and on an M-RoPE model its positions per
    sample; ``wrong_positions``, ``leak`` or ``packed_mismatch``.

    A batch of packed rows ``(rows, length)`` is judged on its own forward (:func:`_rows_together`): the batch run
    once as the loop runs it and every row's examples as one set of right-padded batches; anything short of a clean
    pass is judged row by row (each row alone, then the batch together vs each row: ``batch_rows``).

    Cost: the packed forward plus one forward per labelled example of the row, under ``torch.no_grad`` in eval
    mode; a mismatch adds a few reruns to name the cause (one more with ``padded_probe``; a float32 rerun of the
    row and its examples in the numerics band). The model's train/eval mode of every module, its config and the
    torch RNG states (CPU and CUDA) are restored; no gradient is touched. Units: log-probs and losses in nats.

    Raises:
        PackcheckUsageError: ``batch`` is not one packed row (see :func:`parse_row`; :class:`NotPackedError` for a
            padded batch), a bad ``tolerances`` (see :func:`_tolerances`), or an unknown ``on_mismatch`` /
            non-bool ``use_cache`` / ``training`` / ``padded_probe``, or a ``model`` that is neither a causal LM nor
            an encoder (no LM head: ``get_output_embeddings()`` None, e.g. LlamaModel or ...ForSequenceClassification,
            whose pooled head returns one row per packed row): one line naming the value and the fix.
        PackedBatchMismatch: on a mismatch with ``on_mismatch="raise"``.
    """
    __tracebackhide__ = _hide
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
    encoder = encoder_output(model)  # an encoder / embedding model: judged on its outputs (issue 46 part 4)
    not_lm = None if encoder else _not_a_causal_lm(model)
    if not_lm:
        raise _usage(not_lm)
    tols = _tolerances(tolerances)
    if is_pixel_batch(batch):  # a VLM row with pixel_values: its text logits vs each sample with its own pixels
        return _verify_pixels(model, batch, tols, on_mismatch)
    check_fields(batch, model_device(model))  # devices, dtypes and types before any value is read
    _check_embedding_ranges(model, batch)
    rows = packed_rows(batch)
    if rows:
        return _verify_rows(model, batch, rows, use_cache=use_cache, training=training, tolerances=tolerances,
                            on_mismatch=on_mismatch, padded_probe=padded_probe)
    started = time.perf_counter()
    row = parse_row(batch, getattr(model, "config", None))
    run, cache, fused = _run_record(model, row.batch, use_cache, training)
    modes = {m: m.training for m in model.modules()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    if encoder:
        run["use_cache"] = False  # an encoder keeps no cache (is_decoder False): the key is never passed
    try:
        model.eval()
        with torch.no_grad():
            result = (_measure_encoder(model, row, run, tols, encoder) if encoder else
                      _measure(model, row, run, cache, fused, tols, padded_probe))
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
        say(result.line(), stacklevel=2)
    return result


def _check_embedding_ranges(model: Any, batch: Mapping[str, Any]) -> None:
    """``token_type_ids`` within the config's ``type_vocab_size`` and ``position_ids`` within a learned absolute
    position table (``position_embeddings`` as BERT's, ``wpe`` as GPT-2's): out of range, the model's embedding lookup
    raised IndexError / RuntimeError from inside the forward (hostile trial 5, BertModel: token type 7 of 2, position
    104 of 64).

    Raises:
        PackcheckUsageError: naming the key, its largest value, the table's size and the fix.
    """
    import torch

    config = getattr(model, "config", None)
    types, kinds = batch.get("token_type_ids"), getattr(config, "type_vocab_size", None)
    if isinstance(types, torch.Tensor) and types.numel() and isinstance(kinds, int) and not types.is_floating_point():
        low, high = int(types.min()), int(types.max())
        if low < 0 or high >= kinds:
            raise _usage(f"batch['token_type_ids'] holds {high if high >= kinds else low}, outside the model's "
                         f"type_vocab_size {kinds} (0..{kinds - 1}): build them with this model's tokenizer, or all 0 "
                         "for single-segment examples.")
    positions = batch.get("position_ids")
    if not (isinstance(positions, torch.Tensor) and positions.numel()) or positions.is_floating_point():
        return
    table = next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe")
                  and isinstance(m, torch.nn.Embedding)), None)
    if table is not None and int(positions.max()) >= table.num_embeddings:
        raise _usage(f"batch['position_ids'] reaches {int(positions.max())}, past the model's learned position table of "
                     f"{table.num_embeddings} (max_position_embeddings): each example's positions restart at 0 in a "
                     "packed row; split longer examples, or give the positions the collator builds.")


def _verify_pixels(model: Any, batch: Mapping[str, Any], tols: dict[str, dict[str, float]], on_mismatch: str) -> GuardResult:
    """:func:`.pixels.measure_pixel_row` in eval mode under ``torch.no_grad``, the modes and RNG state put back."""
    import torch

    from .pixels import check_pixel_fields

    check_fields(batch, model_device(model))  # the text row's keys, as for a text row (input_ids dtype, devices, ...)
    check_pixel_fields(batch, model_device(model))
    modes = {m: m.training for m in model.modules()}
    rng = torch.get_rng_state()
    try:
        model.eval()
        with torch.no_grad():
            result = measure_pixel_row(model, batch, tols)
    except ValueError as exc:  # the images do not fill the row's image tokens, or no boundaries
        raise _usage(f"a pixel row: {exc}") from None
    except PackcheckUsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model raised on the pixel row: a verdict, as the text row's crash
        result = _pixel_crash(model, batch, tols, exc)  # (it came out raw: hostile trial 5)
    finally:
        for module, mode in modes.items():
            module.training = mode
        torch.set_rng_state(rng)
    result = _finish(result, model)
    result.versions = _versions()
    if not result.ok and on_mismatch == "raise":
        raise PackedBatchMismatch(result)
    if not result.ok and on_mismatch == "warn":
        say(result.line(), stacklevel=3)
    return result


def _pixel_crash(model: Any, batch: Mapping[str, Any], tols: dict[str, dict[str, float]], exc: Exception) -> GuardResult:
    """The ``crash`` verdict of a model that raised on a pixel row (its exception's type and first line, scrubbed by
    GuardResult's line as every evidence is), shaped as the text row's: no number, nothing compared."""
    from .pixels import nothing_compared

    said = str(exc).splitlines()[0][:200] if str(exc) else ""
    return nothing_compared(model, batch, tols, "fail", "crash", f"the pixel row as given raised {type(exc).__name__}: "
                            f"{said}", [])


def _run_record(model: Any, batch: Mapping[str, Any], use_cache: bool | None,
                training: bool | None) -> tuple[dict[str, Any], bool, bool]:
    """How the loop runs ``batch`` (``result.run``), the ``use_cache`` it passes and whether TRL's fused LM head
    runs: the batch's ``use_cache``, else the caller's, else ``model.config.use_cache``; off under gradient
    checkpointing in training and under the fused head."""
    config = model.config
    training = model.training if training is None else training
    explicit = batch.get("use_cache")
    cache = bool(explicit if explicit is not None else use_cache if use_cache is not None else getattr(config, "use_cache", False))
    if cache and training and _gradient_checkpointing(model):
        cache = False  # transformers' merge_with_config_defaults / GradientCheckpointingLayer, 5.x
    fused = bool(batch.get("fused_lm_head"))
    if fused:
        cache = False  # trl 1.16 add_fused_lm_head: _fused_forward sets kwargs["use_cache"] = False
    run = {"use_cache": cache, "attention_mask": "attention_mask" in batch,
           "attn_implementation": getattr(config, "_attn_implementation", None),
           "gradient_checkpointing": _gradient_checkpointing(model), "training": training, "fused_lm_head": fused,
           "device": str(batch["input_ids"].device), "autocast": None, "model": type(model).__name__,
           "num_items_in_batch": _int_or_none(batch.get("num_items_in_batch"))}
    return run, cache, fused


def _verify_rows(model: Any, batch: Mapping[str, Any], spans: list[slice], **options: Any) -> GuardResult:
    """A batch of packed rows: the batch as the loop runs it vs each row run alone (the cause ``batch_rows`` when
    they differ: transformers 5.24 derives packed boundaries from position_ids for batch size 1 only), then each
    row judged as its own packed row; the result is the worst row's, over every row's examples."""
    __tracebackhide__ = _hide
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
    rows_text = f"{len(spans)} packed rows {tuple(batch['input_ids'].shape)}"
    started = time.perf_counter()
    together = _rows_together(model, batch, singles, spans, **options)
    if isinstance(together, GuardResult):  # every row passed on the batch's own forward: the common case, 2-3 forwards
        together.duration_s = time.perf_counter() - started
        return together
    why, kept, spent = together
    results = [verify_packed_batch(model, one, on_mismatch="return", **options) for one in singles]
    worst = next((r for r in results if r.verdict == "fail"), None) or next(
        (r for r in results if r.verdict != "skipped"), results[0])
    result = GuardResult(**worst.to_dict())
    result.lengths = [n for r in results for n in r.lengths]
    # the batch as the loop gave it, not the row alone (its padding mask is dropped there): trial 21, 76
    result.run = {**result.run, "attention_mask": "attention_mask" in batch}
    result.probes = {**worst.probes, "rows": [f"{r.verdict}{' ' + r.cause if r.cause else ''}" for r in results],
                     "rows_together": f"not judged together ({why}): each row alone"}
    _numbers_over_rows(result, results)
    result.forwards = sum(r.forwards for r in results) + spent
    encoder = encoder_output(model)
    if encoder:
        batched = _encoder_rows(model, batch, spans, results, encoder, result)
    else:
        batched = _batched_vs_rows(model, batch, singles, spans, worst, result, results,
                                   kept if kept is not None and kept[0] == bool(worst.run.get("use_cache")) else None)
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
        say(result.line(), stacklevel=3)
    return result


def _encoder_rows(model: Any, batch: Mapping[str, Any], spans: list[slice], results: list[GuardResult], kind: str,
                  result: GuardResult) -> float | None:
    """An encoder's batch of packed rows run together vs each row alone (:func:`.encoder.rows_diff`), in eval mode
    under no_grad, the modes restored; one forward."""
    import torch

    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            batched = rows_diff(model, dict(batch), spans, results, kind)
    finally:
        for module, mode in modes.items():
            module.training = mode
    result.forwards += batched is not None
    return batched


def _numbers_over_rows(result: GuardResult, results: list[GuardResult]) -> None:
    """The numbers of a batch of packed rows over every row (trial 20, 97: they were the worst row's alone beside
    the example count and tokens of all rows): ``per_example_logprob_diff`` in row order, ``label_tokens`` summed,
    ``max_logprob_diff`` the worst of any row (NaN if any is); ``loss_*`` are the row's with the largest loss
    difference (each row's loss is its own token mean), named in a note with every row's difference."""
    import math

    result.per_example_logprob_diff = [d for r in results for d in r.per_example_logprob_diff]
    result.label_tokens = sum(r.label_tokens for r in results)
    counted = [r.probes["trainer_label_tokens"] for r in results if isinstance(r.probes.get("trainer_label_tokens"), int)]
    if counted:  # as label_tokens: every row's, not the worst row's alone (trial 21, 76)
        result.probes["trainer_label_tokens"] = sum(counted)
    # a row with no diff of its own (one example, nothing labelled) says why, beside the other rows' diffs
    result.notes = [*result.notes, *(f"row {j + 1} of {len(results)}: {r.evidence or 'nothing compared'}"
                                     for j, r in enumerate(results) if len(r.per_example_logprob_diff) < len(r.lengths)
                                     and r.verdict == "skipped")]
    worst = [r.max_logprob_diff for r in results if r.max_logprob_diff is not None]
    result.max_logprob_diff = (math.nan if any(math.isnan(w) for w in worst) else max(worst)) if worst else None
    deltas = [(i, r) for i, r in enumerate(results) if r.loss_delta is not None]
    if not deltas:
        return
    i, row = max(deltas, key=lambda x: (math.isnan(x[1].loss_delta), x[1].loss_delta))
    result.loss_packed, result.loss_reference, result.loss_delta = row.loss_packed, row.loss_reference, row.loss_delta
    if len(results) > 1:
        each = ", ".join(f"row {j + 1} {_fmt(r.loss_delta)}" for j, r in enumerate(results))
        result.notes = [*result.notes, f"loss figures of row {i + 1} of {len(results)}, the largest loss difference ({each})"]


def _batched_vs_rows(model: Any, batch: Mapping[str, Any], singles: list[dict[str, Any]], spans: list[slice],
                     worst: GuardResult, result: GuardResult, results: list[GuardResult],
                     kept_logits: tuple[bool, Any] | None = None) -> float | None:
    """Worst log-prob diff (nats, labelled next tokens inside each row's examples) of the batch run together vs
    each row run alone, both as given (eval mode, no_grad, modes restored). None when nothing is labelled. Each
    row alone is the packed forward its own check ran (``results``, kept where it ran with this use_cache and
    without TRL's fused head), the batch together one forward for every row (``kept_logits``: (use_cache, logits
    ``(rows, length, vocab)``) of that forward where :func:`_rows_together` already ran it)."""
    import torch

    fused = bool(batch.get("fused_lm_head"))
    keys = {k: v for k, v in batch.items() if k not in ("labels", "fused_lm_head", "num_items_in_batch")}
    keys["use_cache"] = bool(worst.run.get("use_cache"))
    modes = {m: m.training for m in model.modules()}
    diffs = []
    # the batch together: one forward for every row (it was one per row), none where _rows_together ran it
    logits = kept_logits[1] if kept_logits is not None and not fused else None
    try:
        model.eval()
        with torch.no_grad():
            for r, (one, s) in enumerate(zip(singles, spans, strict=True)):
                row = parse_row(one, model.config)
                _, targets = _targets(row)
                if not bool((targets != IGNORE_INDEX).any()):
                    continue
                kept = getattr(results[r], "_packed_logprobs", None)
                if kept is not None and not fused and results[r].run.get("use_cache") == keys["use_cache"]:
                    alone = kept  # the same forward on the same row: its log-probs at every target kept here
                else:
                    alone, _ = _log_probs(model, {k: v for k, v in one.items() if k not in (
                        "labels", "fused_lm_head", "num_items_in_batch")} | {"use_cache": keys["use_cache"]}, targets, fused)
                    result.forwards += 1
                full = torch.full((1, batch["input_ids"].shape[1] - 1), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
                full[0, s.start:s.stop - 1] = targets[0]
                if logits is None and not fused:
                    accepted = _accepts(model)
                    logits = model(**{k: v for k, v in keys.items() if accepted is None or k in accepted
                                      or k == "position_ids"}).logits
                    result.forwards += 1
                together = _row_log_probs(model, keys, r, full, fused, batch["input_ids"].shape[0], logits)
                keep = targets[0] != IGNORE_INDEX
                diffs.append(float((together[s.start:s.stop - 1][keep] - alone[keep]).abs().max()))
                result.forwards += fused
    finally:
        for module, mode in modes.items():
            module.training = mode
    return worst_diff(*diffs) if diffs else None


def _rows_together(model: Any, batch: Mapping[str, Any], singles: list[dict[str, Any]], spans: list[slice], *,
                   use_cache: bool | None, training: bool | None, tolerances: Any, padded_probe: bool,
                   ) -> GuardResult | tuple[str, tuple[bool, Any] | None, int]:
    """A batch of packed rows judged on its own forward: the batch run together once, as the loop runs it, and
    every row's labelled examples alone as one set of right-padded batches (:func:`~.forward._reference` over the
    rows' examples, grouped by length across rows), each row's log-probs read from the batch's logits. Passes only
    a clean pass: every row within half the tolerance (the padded reference's margin, as :func:`_measure`), finite,
    no contract item, float32 compute, attention on the requested backend, each row two or more examples with a
    labelled token. Anything else returns ``(why, (use_cache, logits) or None, forwards spent)`` and
    :func:`_verify_rows` judges row by row as before, so every failing verdict, its numbers and its diagnosis are
    the row-by-row ones. Cost of a pass: one forward of the batch plus the padded groups (64 examples of 8-16
    tokens in 4 rows: 3 forwards; row by row it was 14)."""
    import torch

    from ..backends import count_attention_calls, is_call_on
    from ..checks.attention import expected_attention_calls
    from ..errors import PackcheckUsageError

    if batch.get("fused_lm_head"):
        return "TRL's fused LM head", None, 0
    if encoder_output(model):
        return "an encoder: each row judged on its outputs", None, 0
    try:
        rows = [parse_row(one, model.config) for one in singles]
    except PackcheckUsageError as exc:  # each row alone refuses it the same way, with its own line
        return f"a row refused: {exc}", None, 0
    for r, row in enumerate(rows):
        _, targets = _targets(row)
        why = (f"contract items {', '.join(dict.fromkeys(c for c, _, _ in row.items))}" if row.items else
               "one example" if len(row.slices) < 2 else
               "no labelled token" if not bool((targets != IGNORE_INDEX).any()) else None)
        if why:
            return f"row {r + 1}: {why}", None, 0
    why = _batchable(model, rows[0], False)  # the rows share the batch's keys: one look at the model and the keys
    if why:
        return why, None, 0
    tols = _tolerances(tolerances)
    run, cache, _ = _run_record(model, batch, use_cache, training)
    probe_dtype = _ComputeProbe(model, batch["input_ids"].device.type)
    probe_dtype.remove()
    if probe_dtype.weights != "float32":
        return f"{probe_dtype.weights} weights", None, 0
    keys = {k: v for k, v in batch.items() if k not in ("labels", "fused_lm_head", "num_items_in_batch")}
    keys["use_cache"] = cache
    accepted = _accepts(model)
    forwards = [0]
    modes = {m: m.training for m in model.modules()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        model.eval()
        with torch.no_grad():
            probe_dtype = _ComputeProbe(model, batch["input_ids"].device.type)
            try:
                # row 0's boundaries decide the attention probe's isolation, as where the row runs alone
                with count_attention_calls(model, [s.stop - s.start for s in rows[0].slices] if spans[0].start == 0
                                           else None) as probe:
                    logits = model(**{k: v for k, v in keys.items() if accepted is None or k in accepted
                                      or k == "position_ids"}).logits
                forwards[0] += 1
            finally:
                probe_dtype.remove()
            dtype, source = probe_dtype.decide(False)
            run["autocast"] = probe_dtype.autocast
            kept = (cache, logits)
            counts = probe.counts()
            others = {k: v for k, v in counts.items() if not is_call_on(k, run["attn_implementation"])}
            if dtype != "float32" or others:
                return (f"{dtype} compute" if dtype != "float32" else f"attention ran on {others}"), kept, forwards[0]
            joined, targets, owner = _joined(rows)
            try:
                solo, which = _reference(model, joined, targets, False, forwards)
            except Exception as exc:  # noqa: BLE001 - a model that refuses a padded batch: row by row decides
                return f"the padded batch raised {type(exc).__name__}", kept, forwards[0]
    finally:
        for module, mode in modes.items():
            module.training = mode
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    tol = _pick(tols, dtype)
    attention = {"requested": run["attn_implementation"], "calls": counts, "expected_calls": expected_attention_calls(model),
                 "boundaries_reached": sum(1 for c in probe.calls if c.isolated),
                 "boundaries_missing": sum(1 for c in probe.calls if c.isolated is False),
                 "varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls}
    width = batch["input_ids"].shape[1]
    # every row's log-probs from the batch's logits at once (one log_softmax over the scored tokens of all rows, as
    # _row_log_probs reads one row): the trainer's targets of each row at its span, -100 elsewhere
    full = torch.full((len(rows), width - 1), IGNORE_INDEX, dtype=torch.long, device=logits.device)
    for r, (row, s) in enumerate(zip(rows, spans, strict=True)):
        full[r, s.start:s.stop - 1] = _targets(row)[0][0]
    scored = full != IGNORE_INDEX
    every = torch.zeros(full.shape, dtype=torch.float32, device=logits.device)
    every[scored] = logits[:, :-1][scored].float().log_softmax(-1).gather(-1, full[scored][:, None])[:, 0]
    results = []
    for r, (row, s) in enumerate(zip(rows, spans, strict=True)):
        trainer, own = _targets(row)
        packed = every[r, s.start:s.stop - 1]
        mine = [(lp, owner[i][1]) for lp, i in zip(solo, which, strict=True) if owner[i][0] == r]
        cmp = _compare(row, trainer, own, packed, [lp for lp, _ in mine], [i for _, i in mine])
        if not cmp["finite"] or _bad(cmp, {k: v / 2 for k, v in tol.items()}):
            return f"row {r + 1} gave {_fmt(cmp['max'])} against its examples alone: not a clean pass", kept, forwards[0]
        results.append(GuardResult(
            verdict="pass", cause=None, remedy="", evidence="", dtype=dtype, tolerance=tol, max_logprob_diff=cmp["max"],
            per_example_logprob_diff=cmp["per_example"], loss_packed=cmp["loss_packed"],
            loss_reference=cmp["loss_reference"], loss_delta=cmp["loss_delta"], lengths=[x.stop - x.start for x in row.slices],
            label_tokens=cmp["label_tokens"], contract=[], run=run, attention=attention,
            probes={"trainer_label_tokens": cmp["trainer_label_tokens"], "batch_has_position_ids": True},
            versions=_versions(), dtype_source=source, notes=list(row.notes)))
    result = GuardResult(**results[0].to_dict())
    result.lengths = [n for r in results for n in r.lengths]
    result.probes = {**result.probes, "rows": ["pass"] * len(results),
                     "reference": (f"right-padded batches over every row: {len(which)} examples in {forwards[0] - 1} "
                                   f"forward{'s' * (forwards[0] != 2)}, against the batch's own packed forward")}
    _numbers_over_rows(result, results)
    result.forwards = forwards[0]
    result.notes = [*result.notes, (f"{len(spans)} packed rows {tuple(batch['input_ids'].shape)} judged together: the "
                                    f"batch's forward vs each example alone {_fmt(result.max_logprob_diff)}")]
    return result


def _joined(rows: list[_Row]) -> tuple[_Row, Any, list[tuple[int, int]]]:
    """The rows' real tokens end to end as one virtual row for :func:`~.forward._reference` (never run as a row:
    it only carries each example's tokens, first position and targets), its reference targets ``(1, total - 1)``
    (-100 across every example start and every row's end) and, per example of it, (row, example in the row)."""
    import torch

    ids = torch.cat([row.batch["input_ids"] for row in rows], dim=1)
    batch: dict[str, Any] = {"input_ids": ids}
    if all("position_ids" in row.batch for row in rows):
        batch["position_ids"] = torch.cat([row.batch["position_ids"] for row in rows], dim=-1)
    parts, slices, owner, continued, offset = [], [], [], {}, 0
    for r, row in enumerate(rows):
        _, targets = _targets(row)
        parts += [targets[0], targets.new_full((1,), IGNORE_INDEX)]
        slices += [slice(s.start + offset, s.stop + offset) for s in row.slices]
        owner += [(r, i) for i in range(len(row.slices))]
        continued |= {start + offset: first for start, first in row.continued.items()}
        offset += row.total
    return (_Row(batch, offset, slices, [], [], rows[0].first, continued), torch.cat(parts[:-1])[None], owner)


def _measure_encoder(model: Any, row: _Row, run: dict[str, Any], tols: dict[str, dict[str, float]], kind: str) -> GuardResult:
    """An encoder's packed row (:func:`.encoder.measure_encoder`), its remedy filled in (:func:`_finish`)."""
    weights = _ComputeProbe(model, row.batch["input_ids"].device.type)
    weights.remove()
    base = {"verdict": "fail", "dtype": weights.weights, "lengths": [s.stop - s.start for s in row.slices],
            "contract": row.problems, "run": run, "versions": _versions(), "per_example_logprob_diff": [],
            "label_tokens": 0, "notes": list(row.notes), "causes": [c for c, _, _ in row.items],
            "dtype_source": f"{weights.weights} weights"}
    return _finish(measure_encoder(model, row, run, tols, kind, base), model)


def _nothing_scored(row: _Row) -> str:
    """Why no token is scored: every label is -100, or labels are given but none is left after the shift within
    each example (one-token examples: the row said "every label is -100" beside "labels not -100 at 28 example
    starts"; trial 11, 98)."""
    labels = row.batch.get("labels")
    if labels is None or not bool((labels != IGNORE_INDEX).any()):
        return "no labelled token (every label is -100): nothing judged"
    return (f"no token is scored: {len(row.slices)} examples in {row.total} tokens leave no label to predict after the "
            "shift within each example: nothing judged")


def _measure(model: Any, row: _Row, run: dict[str, Any], cache: bool, fused: bool,
             tols: dict[str, dict[str, float]], padded_probe: bool = False) -> GuardResult:
    """The probes, in eval mode under no_grad (see :func:`verify_packed_batch`)."""
    from ..backends import count_attention_calls, is_call_on
    from ..checks.attention import expected_attention_calls

    lengths = [s.stop - s.start for s in row.slices]
    probe_dtype = _ComputeProbe(model, row.batch["input_ids"].device.type)
    probe_dtype.remove()  # only the weights' dtype until the packed forward runs
    base = {"verdict": "fail", "dtype": probe_dtype.weights, "lengths": lengths, "contract": row.problems, "run": run,
            "versions": _versions(), "per_example_logprob_diff": [], "label_tokens": 0, "notes": list(row.notes),
            "causes": [code for code, _, _ in row.items], "dtype_source": f"{probe_dtype.weights} weights"}
    empty = {"max_logprob_diff": None, "loss_packed": None, "loss_reference": None, "loss_delta": None}
    contract_cause = row.items[0][0] if row.items else None
    trainer, targets = _targets(row)
    base["label_tokens"] = int((targets != IGNORE_INDEX).sum())  # the row's scored labels, also where nothing is compared
    if not bool((targets != IGNORE_INDEX).any()):
        return _finish(GuardResult(**{**base, "verdict": "skipped" if not row.items else "fail"}, **empty,
                                   cause=contract_cause, remedy=_contract_remedy(row) if row.items else "",
                                   evidence=_nothing_scored(row)
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
                                   evidence="; ".join(row.problems or ["one example in the row: nothing to compare"]),
                                   tolerance=tol, attention=attention, forwards=forwards[0]), model)
    probes: dict[str, Any] = {}
    try:
        # the pass path reads the examples as right-padded batches (one forward per group); anything short of a clean
        # pass (a number past half the tolerance, non-finite, a contract item) is judged on the one-at-a-time truth
        why = _batchable(model, row, fused) or (None if dtype == "float32" else f"{dtype} compute")
        if why is None:
            before = forwards[0]
            try:
                solo, which = _reference(model, row, targets, fused, forwards)
            except Exception as exc:  # noqa: BLE001 - a model that refuses a padded batch: one at a time decides
                why = f"the padded batch raised {type(exc).__name__}"
            else:
                cmp = _compare(row, trainer, targets, packed, solo, which)
                spent = forwards[0] - before
                probes["reference"] = f"right-padded batches: {len(which)} examples in {spent} forward{'s' * (spent != 1)}"
                if row.items or not cmp["finite"] or _bad(cmp, {k: v / 2 for k, v in tol.items()}):
                    why = f"the padded batches gave {_fmt(cmp['max'])}: not a clean pass"
        if why is not None:
            solo, which = _solo(model, row, targets, fused, forwards)
            cmp = _compare(row, trainer, targets, packed, solo, which)
            probes["reference"] = f"one at a time ({why})"
    except Exception as exc:  # noqa: BLE001 - no reference: say so, with the exception
        return _finish(GuardResult(**base, **empty, cause="crash", remedy="",
                                   evidence=f"the examples run alone raised {type(exc).__name__}: {str(exc)[:200]}",
                                   tolerance=tol, attention=attention, forwards=forwards[0] + 1), model)
    if model_loss is not None and hasattr(model_loss, "item") and cmp["loss_packed"] is not None and run["num_items_in_batch"] is None:
        probes["model_loss"] = float(model_loss)
    probes["trainer_label_tokens"] = cmp["trainer_label_tokens"]
    probes["batch_has_position_ids"] = "position_ids" in row.batch
    result = GuardResult(**{**base, "label_tokens": cmp["label_tokens"], "per_example_logprob_diff": cmp["per_example"]},
                         max_logprob_diff=cmp["max"], loss_packed=cmp["loss_packed"], loss_reference=cmp["loss_reference"],
                         loss_delta=cmp["loss_delta"], cause=None, remedy="", evidence="", tolerance=tol,
                         attention=attention, probes=probes, forwards=forwards[0])
    result._packed_logprobs = packed  # not a field: a batch of rows reuses it as the row alone (_batched_vs_rows)
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
        if (cmp["max"] is not None and not cmp["max"] <= tol["logits_atol"]
                and all(key in LOGPROB_NEUTRAL for _, _, key in row.items)):
            # no contract item moves a log-prob, yet they differ: name what the probes measure as well, so fixing
            # the contract does not leave an unexplained mismatch (an empty example on sdpa beside a leak, trial 10)
            cause, evidence = _diagnose(model, row, targets, inputs, fused, cmp, tol, attention, others, probes, forwards,
                                        dict(zip(which, solo, strict=True)), dtype, tols, packed)
            if cause != _NUMERICS_PASS and cause not in result.causes:
                result.causes.append(cause)
                result.also.append({"cause": cause, "evidence": evidence, "remedy": _remedy(cause, result)})
            result.forwards = forwards[0]
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


def _finish(result: GuardResult, model: Any) -> GuardResult:
    """Fill in the remedy (:func:`_remedy`); ``causes`` leads with ``cause`` (it was empty on a leak the probes
    named, trial 7, 139)."""
    if result.cause:
        result.causes = [result.cause, *(c for c in result.causes if c != result.cause)]
    if result.cause and not result.remedy:
        result.remedy = _remedy(result.cause, result)
    return result


def _remedy(cause: str, result: GuardResult) -> str:
    """The remedy of ``cause`` from diagnose.remedy, for the backend that ran and the installed versions; the
    guard's own where it knows better (numerics, a leak of a row without position_ids, a crash)."""
    from ..analysis.diagnose import remedy
    from ..backends import MASKED_BACKENDS

    if cause == "kernel_numerics" and result.dtype in _REDUCED:
        return (f"not decided in {result.dtype}: run verify_packed_batch once on a float32 copy of the model "
                "(model.float()) with this batch; if it passes there, widen the tolerance "
                f"(tolerances={{'{result.dtype}': {{'logits_atol': ..., 'loss_atol': ...}}}})")
    if cause == "kernel_numerics":
        return ("the kernel differs on packed vs per-example shapes while keeping the boundaries: if it is "
                f"expected to differ by {_fmt(result.max_logprob_diff)}, widen logits_atol (tolerances="
                "{'float32': {'logits_atol': ..., 'loss_atol': ...}}); else report it to the kernel's maintainers")
    if (cause == "leak" and result.probes.get("batch_has_position_ids") is False
            and result.run.get("attn_implementation") in MASKED_BACKENDS):
        return ("return position_ids from the collator (DataCollatorWithFlattening(return_position_ids=True)): "
                "eager / sdpa / flex build the packed mask from position_ids; cu_seq_lens_q reach only the flash path")
    if cause == "crash":
        return "see the exception: the model cannot run this batch as the loop feeds it"
    cell = {"backend": result.run.get("attn_implementation"), "check": "guard",
            "metrics": {"batch_has_position_ids": bool(result.probes.get("batch_has_position_ids", True))}}
    return remedy(cause, cell, {k: v for k, v in result.versions.items() if v})
