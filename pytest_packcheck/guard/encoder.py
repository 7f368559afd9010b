"""The guard on an encoder or embedding model (issue 46 part 4): a model with no causal-LM head, attending both ways
(BERT, RoBERTa, ModernBERT as ``AutoModel`` or ``AutoModelForMaskedLM``; a token-classification head), judged on what
it outputs instead of next-token log-probs.

:func:`encoder_output` says whether a model is one and what it outputs per token; :func:`measure_encoder` runs the
packed row as the loop runs it and each example alone as the model numbers it alone (no ``position_ids``: BERT
counts from 0, RoBERTa-likes from ``padding_idx + 1``, ``create_position_ids_from_input_ids``), and compares per
example the per-token outputs (logits of the head, else ``last_hidden_state``), the mean / CLS / last-token embeddings
of each segment's last hidden states (sentence-transformers' poolings, as ``checks/encoders.py`` pools), and with
labels the masked-LM / token-classification loss (labels on their own token, unshifted: nats per labelled token).
A mismatch is named by reruns: the attention_mask dropped (``mask_override``), an isolation probe (the first
example's tokens changed: do the others move? ``leak``), else the numerics band or ``wrong_positions``.
"""

from __future__ import annotations

import math
from typing import Any

from ..results.metrics import worst as worst_diff
from .batch import _ROW_KEYS, IGNORE_INDEX, _Row, _text_config
from .forward import _accepts
from .result import GuardResult, _fmt

#: Head class-name endings whose forward returns per-token logits over labels (not a causal LM's next-token logits).
_PER_TOKEN_HEADS = ("ForMaskedLM", "ForTokenClassification")
#: The poolings compared per segment (as :data:`pytest_packcheck.checks.encoders.POOLINGS`).
_POOLINGS = ("mean", "cls", "last")
#: Contract items that read labels as next-token targets (shifted): not an encoder's, whose labels sit on their token.
_SHIFTED_LABEL_ITEMS = ("labels", "num_items")


def encoder_output(model: Any) -> str | None:
    """What the guard compares on ``model`` when it is a bidirectional encoder: ``"logit"`` (a masked-LM or
    token-classification head: ``.logits`` ``(batch, length, labels)``), ``"hidden-state"`` (its base model:
    ``.last_hidden_state`` ``(batch, length, hidden)``); None for every other model (a causal LM, a decoder's base
    model, a pooled head). An encoder: ``config.is_decoder`` false and the model_type has a masked-LM class in the
    installed transformers (``MODEL_FOR_MASKED_LM_MAPPING_NAMES``), the class a per-token head or that type's base
    model (``MODEL_MAPPING_NAMES``)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_decoder", False):
        return None
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    if model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return None
    name = type(model).__name__
    if name.endswith(_PER_TOKEN_HEADS):
        return "logit"
    base = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    base = base if isinstance(base, str) else (base[0] if base else None)
    return "hidden-state" if name == base else None


def _call(model: Any, inputs: dict[str, Any]) -> Any:
    """The model's output on ``inputs`` (keys its forward takes; ``position_ids`` always), with every layer's hidden
    states where the forward takes ``output_hidden_states``."""
    accepted = _accepts(model)
    call = {k: v for k, v in inputs.items() if v is not None and (accepted is None or k in accepted or k == "position_ids")}
    if accepted is None or "output_hidden_states" in accepted:
        call["output_hidden_states"] = True
    return model(**call)


def _read(out: Any, kind: str) -> tuple[Any, Any]:
    """(per-token outputs ``(length, d)`` float32, last hidden states ``(length, hidden)`` float32 or None) of row 0."""
    states = getattr(out, "hidden_states", None)
    last = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else (states[-1] if states else None)
    token = out.logits if kind == "logit" else last
    return token[0].float(), None if last is None else last[0].float()


def _loss(logits: Any, labels: Any) -> tuple[float, int]:
    """(summed NLL in nats, labelled tokens) of ``labels`` ``(length,)`` on their own tokens' logits ``(length, n)``."""
    keep = labels != IGNORE_INDEX
    if not bool(keep.any()):
        return 0.0, 0
    nll = -logits[keep].log_softmax(-1).gather(-1, labels[keep][:, None])[:, 0]
    return float(nll.sum()), int(keep.sum())


def _alone(model: Any, row: _Row, s: slice) -> dict[str, Any]:
    """One example alone: its slice of every per-token key but ``position_ids`` (the model numbers it as it numbers
    any batch of one), no attention_mask, no cu_seq_lens."""
    import torch

    return {k: v[:, s] for k, v in row.batch.items()
            if k not in _ROW_KEYS and k != "position_ids" and isinstance(v, torch.Tensor) and tuple(v.shape) == (1, row.total)}


def _compare(row: _Row, kind: str, packed: tuple[Any, Any], alone: list[tuple[Any, Any]], labels: Any) -> dict[str, Any]:
    """Per example: the worst per-token output diff and the worst pooled-embedding diff; the losses (nats per
    labelled token) where ``labels`` ``(length,)`` are given and fit the head's outputs."""
    token, hidden = packed
    per, pooled = [], dict.fromkeys(_POOLINGS, 0.0)
    for s, (a_token, a_hidden) in zip(row.slices, alone, strict=True):
        worst = float((token[s] - a_token).abs().max())
        if hidden is not None and a_hidden is not None:
            p, a = hidden[s], a_hidden
            for how, (x, y) in {"mean": (p.mean(0), a.mean(0)), "cls": (p[0], a[0]), "last": (p[-1], a[-1])}.items():
                pooled[how] = worst_diff(pooled[how], float((x - y).abs().max()))
        per.append(worst)
    out = {"per_example": per, "pooled": pooled if hidden is not None else {},
           "max": worst_diff(*per, *pooled.values()) if hidden is not None else worst_diff(*per),
           "loss_packed": None, "loss_reference": None, "loss_delta": None, "label_tokens": 0}
    if kind == "logit" and labels is not None and int(labels.max()) < token.shape[-1]:
        nll_p, n = _loss(token, labels)
        nll_s = sum(_loss(a_token, labels[s])[0] for s, (a_token, _) in zip(row.slices, alone, strict=True))
        if n:
            out.update(loss_packed=nll_p / n, loss_reference=nll_s / n, loss_delta=abs(nll_p - nll_s) / n, label_tokens=n)
    out["finite"] = all(math.isfinite(x) for x in [out["max"], *(v for v in (out["loss_delta"],) if v is not None)])
    return out


def measure_encoder(model: Any, row: _Row, run: dict[str, Any], tols: dict[str, dict[str, float]], kind: str,
                    base: dict[str, Any]) -> GuardResult:
    """The probes on an encoder's packed row, in eval mode under no_grad (the caller's): see the module docstring.
    ``base``: the fields :func:`~.verify._measure` fills for every result (verdict, lengths, contract, run,
    versions, notes, causes). Returns the result without its remedy (``verify._finish`` fills it). Cost: the packed
    forward plus one forward per example; a mismatch adds the reruns (at most two)."""
    import torch

    from ..backends import count_attention_calls, is_call_on
    from ..checks.attention import expected_attention_calls
    from .precision import _ComputeProbe, _pick

    items = [item for item in row.items if item[2] not in _SHIFTED_LABEL_ITEMS]
    notes = [*base["notes"], *(f"not an encoder's contract: {text}" for _, text, key in row.items
                               if key in _SHIFTED_LABEL_ITEMS)]
    row.items[:] = items
    base = {**base, "contract": row.problems, "causes": [c for c, _, _ in items], "notes": notes}
    labels = row.batch.get("labels")
    labels = labels[0] if isinstance(labels, torch.Tensor) else None
    inputs = {k: v for k, v in row.batch.items() if k not in ("labels", "use_cache", "fused_lm_head", "num_items_in_batch")}
    lengths = [s.stop - s.start for s in row.slices]
    forwards = 0
    probe_dtype = _ComputeProbe(model, row.batch["input_ids"].device.type)
    try:
        with count_attention_calls(model, lengths) as probe:
            packed = _read(_call(model, inputs), kind)
        forwards += 1
    finally:
        probe_dtype.remove()
    if kind == "logit" and labels is not None:  # labels the head cannot score: the loss was left out, a silent pass
        scored = labels[labels != IGNORE_INDEX]  # (hostile trial 5: token-classification labels 9 on a 3-label head)
        outputs = int(packed[0].shape[-1])
        if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= outputs):
            from .result import _usage

            bad = int(scored.max()) if int(scored.max()) >= outputs else int(scored.min())
            raise _usage(f"batch['labels'] holds {bad}, outside the {outputs} outputs of {type(model).__name__}'s head "
                         f"(num_labels, or the vocabulary of a masked-LM head): labels are 0..{outputs - 1}, or "
                         f"{IGNORE_INDEX} where not scored.")
    dtype, source = probe_dtype.decide(False)
    run["autocast"] = probe_dtype.autocast
    tol = _pick(tols, dtype)
    counts = probe.counts()
    others = {k: v for k, v in counts.items() if not is_call_on(k, run["attn_implementation"])}
    isolated = [c.isolated for c in probe.calls]
    attention = {"requested": run["attn_implementation"], "calls": counts, "expected_calls": expected_attention_calls(model),
                 "boundaries_reached": sum(1 for i in isolated if i), "boundaries_missing": sum(1 for i in isolated if i is False),
                 "varlen_kernel_calls": probe.varlen_calls, "dense_kernel_calls": probe.dense_flash_calls}
    base = {**base, "dtype": dtype, "dtype_source": source}
    empty = {"max_logprob_diff": None, "loss_packed": None, "loss_reference": None, "loss_delta": None}
    if len(row.slices) < 2:
        return GuardResult(**{**base, "verdict": "fail" if items else "skipped"}, **empty, cause=items[0][0] if items else None,
                           remedy="", evidence="; ".join(row.problems or ["one example in the row: nothing to compare"]),
                           tolerance=tol, attention=attention, forwards=forwards, compared=kind)
    alone = []
    for s in row.slices:
        alone.append(_read(_call(model, _alone(model, row, s)), kind))
        forwards += 1
    cmp = _compare(row, kind, packed, alone, labels)
    probes: dict[str, Any] = {"reference": f"one at a time, numbered by the model ({len(alone)} forwards)",
                              "compared": f"{'logits of ' + type(model).__name__ if kind == 'logit' else 'last_hidden_state'}"
                                          f"{', mean / CLS / last-token embeddings per segment' if cmp['pooled'] else ''}",
                              "pooled": cmp["pooled"], "batch_has_position_ids": "position_ids" in row.batch}
    result = GuardResult(**{**base, "label_tokens": cmp["label_tokens"], "per_example_logprob_diff": cmp["per_example"]},
                         max_logprob_diff=cmp["max"], loss_packed=cmp["loss_packed"], loss_reference=cmp["loss_reference"],
                         loss_delta=cmp["loss_delta"], cause=None, remedy="", evidence="", tolerance=tol,
                         attention=attention, probes=probes, forwards=forwards, compared=kind)
    result._packed_outputs = packed[0]  # not a field: a batch of rows reuses it as the row alone (rows_diff)
    numbers = (f"packed vs each example alone: {kind}s {_fmt(max(cmp['per_example']))}"
               + (f", pooled embeddings {_fmt(worst_diff(*cmp['pooled'].values()))}" if cmp["pooled"] else "")
               + (f", loss {_fmt(cmp['loss_packed'])} vs {_fmt(cmp['loss_reference'])} nats" if cmp["loss_delta"] is not None else ""))
    bad = not cmp["max"] <= tol["logits_atol"] or (cmp["loss_delta"] is not None and not cmp["loss_delta"] <= tol["loss_atol"])
    if not cmp["finite"]:
        result.cause, result.evidence = "non_finite", f"non-finite outputs ({numbers}): no comparison is possible, nothing passes"
        return result
    if items:
        result.cause, result.evidence = items[0][0], "; ".join(row.problems) + f" ({numbers})"
        from .batch import _contract_remedy

        result.remedy = _contract_remedy(row)
        return result
    if not bad:
        result.verdict = "fallback" if others else "pass"
        if others:
            result.cause, result.evidence = "backend_swap", f"requested {run['attn_implementation']}, attention ran on {others}"
        return result
    result.cause, result.evidence = _diagnose(model, row, kind, inputs, packed, [a for a, _ in alone], cmp, tol, others,
                                              probes, result, numbers)
    return result


def _diagnose(model: Any, row: _Row, kind: str, inputs: dict[str, Any], packed: tuple[Any, Any], alone: list[Any],
              cmp: dict[str, Any], tol: dict[str, float], others: dict[str, int], probes: dict[str, Any], result: GuardResult,
              numbers: str) -> tuple[str, str]:
    """The cause of an encoder's mismatch, measured: a backend swap; the attention_mask dropped (``mask_override``
    when the row is then right); the isolation probe (every token of the first example moved by half the vocabulary,
    as ``encoder_isolation`` perturbs: the other examples' outputs move, ``leak``); else the numbers within the
    numerics band (``kernel_numerics``) or ``wrong_positions``."""
    from ..checks.registry import within_numerics

    atol, worst = tol["logits_atol"], cmp["max"]
    if others:
        return "backend_swap", f"requested {result.run['attn_implementation']}, attention ran on {others}; {numbers}"

    def worst_of(token: Any) -> float:  # a rerun of the packed row vs each example alone
        return max(float((token[s] - a).abs().max()) for s, a in zip(row.slices, alone, strict=True))

    if "attention_mask" in inputs:
        rerun = worst_of(_read(_call(model, {**inputs, "attention_mask": None}), kind)[0])
        result.forwards += 1
        probes["without_attention_mask"] = rerun
        if rerun <= atol:
            return "mask_override", f"{numbers}; without the attention_mask {rerun:.2e}"
    vocab = int(getattr(_text_config(model.config), "vocab_size", int(inputs["input_ids"].max()) + 2))
    ids = inputs["input_ids"].clone()
    first = row.slices[0]
    ids[0, first] = (ids[0, first] + 1 + vocab // 2) % vocab
    moved_token = _read(_call(model, {**inputs, "input_ids": ids}), kind)[0]
    result.forwards += 1
    later = slice(row.slices[1].start, row.total)
    moved = float((moved_token[later] - packed[0][later]).abs().max())
    probes["isolation_moved"] = moved
    if moved > atol:
        return "leak", f"{numbers}; changing the first example moves the others' {kind}s by {moved:.2e}"
    if within_numerics(worst, atol, result.dtype, float(packed[0].abs().max())):
        return "kernel_numerics", f"{numbers}; boundaries kept (the others move {moved:.2e})"
    return "wrong_positions", (f"{numbers}, but changing the first example moves the others by {moved:.2e}: attention is "
                               "isolated, the positions the model sees are not the ones it numbers an example alone with")


def rows_diff(model: Any, batch: dict[str, Any], spans: list[slice], results: list[GuardResult], kind: str) -> float | None:
    """Worst per-token output diff of a batch of an encoder's packed rows run together vs each row alone (the
    row's packed outputs its own check kept), over each row's real tokens; None where no row kept them. One
    forward, under the caller's eval / no_grad."""
    kept = [getattr(r, "_packed_outputs", None) for r in results]
    if any(k is None for k in kept):
        return None
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "use_cache", "fused_lm_head", "num_items_in_batch")}
    out = _call(model, inputs)
    states = getattr(out, "hidden_states", None)
    token = (out.logits if kind == "logit" else out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None
             else states[-1]).float()
    return max(float((token[r, s] - kept[r]).abs().max()) for r, s in enumerate(spans))
