"""Encoders and embedding models on packed rows (issue 46): bidirectional attention, no causal-LM head.

An ``encoder:<model_type>`` spec builds the model with its masked-LM head (else its base model,
:func:`model.architectures.encoder_class_name`); the checks here feed it the row ``DataCollatorWithFlattening``
gives (``position_ids`` restarting at each example, from ``position_ids_start`` for RoBERTa-likes, no
``attention_mask``, ``use_cache=False``) and compare with each example alone (:mod:`.reference`):

- ``encoder_isolation``: perturb one example at a time; the other examples' last hidden states and pooled
  embeddings must not move (attention is bidirectional: an example before the perturbed one can move too);
- ``encoder_parity``: last hidden states, packed vs alone;
- ``encoder_pooling``: mean / CLS / last-token embeddings pooled per segment, the segments read from the row's
  ``position_ids`` restarts (and ``cu_seq_lens_q`` where the row has them), vs the same pooling alone;
- ``encoder_mlm_loss``: the masked-LM loss of the packed row (15% of each example's tokens masked) vs the
  token-weighted mean of the examples alone;
- ``encoder_positions``: the packed row numbers positions as the model numbers an example alone (no
  ``position_ids``: BERT counts from 0, RoBERTa from ``padding_idx + 1``);
- ``encoder_token_cls``: a token-classification head's logits and loss on the packed row vs alone;
- ``encoder_seq_cls``: a finding: what the model's own sequence-classification head returns for a packed row
  (one pooled position per row), and what the flattening collator does with scalar labels.

transformers 5.25.0 builds the packed bidirectional mask from ``position_ids`` (``masking_utils.
create_bidirectional_mask``, which BERT, RoBERTa, ELECTRA and about 45 model files call with them); 5.24.0 did not.
Units: hidden states and logits as the model computes them (float32 differences); losses in nats.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from ..model import batches as B
from ..results import CheckResult
from .registry import numerics_evidence, within_numerics
from .workbench import Workbench, _fmt

#: The poolings an embedding model's users apply per segment (sentence-transformers' mean / CLS / last-token).
POOLINGS = ("mean", "cls", "last")
#: Fraction of each example's tokens the MLM probe masks (BERT's 15%), at least one per example.
MLM_FRACTION = 0.15
#: Labels of the token-classification head the classification probes build.
NUM_LABELS = 3


def hidden_states(wb: Workbench, batch: dict[str, Any], model: Any = None) -> Any:
    """Last hidden states ``(batch, length, hidden)`` float32 of ``batch`` (no grad, ``use_cache=False``, position_ids
    through the workbench's layout), read from ``hidden_states[-1]`` of a head model or ``last_hidden_state`` of a
    base model; on ``model`` when given (a probe's own model), else the workbench's."""
    saved = wb.model
    if model is not None:
        wb.model = model
    try:
        out = wb.forward(batch, output_hidden_states=True)
    finally:
        wb.model = saved
    states = getattr(out, "hidden_states", None)
    return (states[-1] if states else out.last_hidden_state).float()


def alone_hidden(wb: Workbench, example: list[int], first: int | None = None, with_positions: bool = True) -> Any:
    """Last hidden states ``(len, hidden)`` of one example alone (:func:`reference.alone_batch`, positions from
    ``first``, default the workbench's start); without ``position_ids`` when ``with_positions`` is False (the model
    numbers them itself)."""
    from .reference import alone_batch

    batch = alone_batch(example, wb.start if first is None else first, wb.device)
    if not with_positions:
        batch.pop("position_ids")
    return hidden_states(wb, batch)[0]


def segments_of(batch: dict[str, Any]) -> list[slice]:
    """The row's segments, read as a user's pooling reads them: where ``position_ids`` restart (a position that is
    not its predecessor + 1); ``cu_seq_lens_q`` where the row has it and it disagrees wins nothing: both are
    returned by :func:`segment_sources`. Row 0 of ``position_ids`` ``(1, length)``."""
    pos = batch["position_ids"][0].tolist()
    starts = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(pos)], strict=True)]


def segment_sources(batch: dict[str, Any]) -> dict[str, list[int]]:
    """Segment lengths (tokens) from each source the row carries: ``position_ids`` restarts, and
    ``cu_seq_lens_q`` (int32 ``(n + 1,)``) when present."""
    out = {"position_ids": [s.stop - s.start for s in segments_of(batch)]}
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        edges = [int(x) for x in cu.tolist()]
        out["cu_seq_lens_q"] = [b - a for a, b in itertools.pairwise(edges)]
    return out


def pool(hidden: Any, how: str) -> Any:
    """One embedding ``(hidden,)`` of a segment's hidden states ``(len, hidden)``: ``mean`` over its tokens, ``cls``
    (its first token), ``last`` (its last token)."""
    return hidden.mean(0) if how == "mean" else hidden[0] if how == "cls" else hidden[-1]


def packed_row(wb: Workbench, examples: list[list[int]] | None = None) -> dict[str, Any]:
    """The packed row the encoder checks feed: ``DataCollatorWithFlattening``'s (position_ids restarting from the
    workbench's start), with ``cu_seq_lens_q/k`` and ``max_length_q/k`` on a flash-family backend
    (``return_flash_attn_kwargs=True``, as embedding trainers flatten for the varlen kernel)."""
    return wb.packed(examples, flash_kwargs=True) if _flash(wb) else wb.packed(examples)


def _perturbed(wb: Workbench, index: int) -> list[list[int]]:
    vocab = int(wb.config.vocab_size)
    out = [list(e) for e in wb.examples]
    out[index] = [(t + 1 + vocab // 2) % vocab for t in out[index]]
    return out


def _moved(wb: Workbench, base: Any, other: Any, skip: int) -> tuple[float, float]:
    """(hidden states, pooled embeddings) max abs change of every segment but ``skip`` between two rows'
    hidden states ``(length, hidden)``."""
    h = p = 0.0
    for i, s in enumerate(B.segment_slices(wb.lengths)):
        if i == skip:
            continue
        h = max(h, float((base[s] - other[s]).abs().max()))
        p = max(p, *(float((pool(base[s], how) - pool(other[s], how)).abs().max()) for how in POOLINGS))
    return h, p


def isolation_numbers(wb: Workbench) -> dict[str, Any]:
    """Perturb each example in turn (every token moved by half the vocabulary): the others' last hidden states and
    pooled embeddings must not move (``max_change``, ``max_change_pooled``). The same on the row with no boundaries
    (plain positions, no flash kwargs: ``negative_control_change``): the probe can see a leak. Cached per model."""
    key = ("encoder_isolation", id(wb.model), id(wb.collator_factory))
    if key in wb._cache:
        return wb._cache[key]
    import torch

    base_batch = packed_row(wb)
    base = hidden_states(wb, base_batch)[0]
    total = sum(wb.lengths)
    plain = torch.arange(wb.start, wb.start + total, device=wb.device)[None]

    def unbounded(batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in batch.items() if k not in B.FLASH_KWARGS}, "position_ids": plain}

    control_base = hidden_states(wb, unbounded(base_batch))[0]
    moved = pooled = control = 0.0
    per: list[float] = []
    for i in range(len(wb.examples)):
        pert = packed_row(wb, _perturbed(wb, i))
        h, p = _moved(wb, base, hidden_states(wb, pert)[0], i)
        per.append(h)
        moved, pooled = max(moved, h), max(pooled, p)
        control = max(control, _moved(wb, control_base, hidden_states(wb, unbounded(pert))[0], i)[0])
    out = {"max_change": moved, "max_change_pooled": pooled, "max_change_per_perturbed_example": per,
           "negative_control_change": control, "examples": len(wb.examples)}
    wb._cache[key] = out
    return out


def _leak_cause(wb: Workbench, numbers: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """leak / kernel_numerics / probe_inconclusive from :func:`isolation_numbers` (the rule of
    :func:`probes.mismatch_cause`, on hidden states)."""
    iso = wb.tol["isolation_atol"]
    moved = max(numbers["max_change"], numbers["max_change_pooled"])
    evidence = {"isolation_moved": moved, "isolation_atol": iso}
    if moved > iso:
        if within_numerics(moved, iso, wb.dtype):
            return "kernel_numerics", {**evidence, **numerics_evidence("isolation_atol", moved, iso, wb.dtype)}
        return "leak", evidence
    return "probe_inconclusive", {**evidence, "negative_control_change": numbers["negative_control_change"],
                                  "dtype": wb.dtype, "leak_min": wb.tol["leak_min"]}


def check_encoder_isolation(wb: Workbench) -> CheckResult:
    """Perturb one example of the packed row at a time: every other example's last hidden states and pooled
    embeddings (mean / CLS / last token) must stay within ``isolation_atol``. A probe that cannot see the planted
    leak (the same row with no boundaries) moving by ``leak_min`` is inconclusive."""
    numbers = isolation_numbers(wb)
    iso = wb.tol["isolation_atol"]
    moved = max(numbers["max_change"], numbers["max_change_pooled"])
    metrics = {**numbers, "atol": iso}
    message = (f"perturbing one example moved the others' hidden states by {_fmt(numbers['max_change'])}, pooled "
               f"embeddings by {_fmt(numbers['max_change_pooled'])} (tol {_fmt(iso)}; a row with no boundaries: "
               f"{_fmt(numbers['negative_control_change'])})")
    if moved <= iso:
        if numbers["negative_control_change"] < wb.tol["leak_min"]:
            cause, evidence = _leak_cause(wb, {**numbers, "max_change": 0.0, "max_change_pooled": 0.0})
            return CheckResult("fail", metrics, f"{message}: the probe cannot see a leak", cause=cause, evidence=evidence)
        return CheckResult("pass", metrics, message)
    cause, evidence = _leak_cause(wb, numbers)
    return CheckResult("fail", metrics, message, cause=cause, evidence=evidence)


def parity_numbers(wb: Workbench) -> dict[str, Any]:
    """Last hidden states and pooled embeddings of the packed row vs each example alone (cached per model)."""
    key = ("encoder_parity", id(wb.model), id(wb.collator_factory))
    if key in wb._cache:
        return wb._cache[key]
    batch = packed_row(wb)
    packed = hidden_states(wb, batch)[0]
    sources = segment_sources(batch)
    segs = segments_of(batch)
    alone = [alone_hidden(wb, e) for e in wb.examples]
    per, pooled = [], {how: 0.0 for how in POOLINGS}
    for s, ref in zip(B.segment_slices(wb.lengths), alone, strict=True):
        per.append(float((packed[s] - ref).abs().max()))
    for i, ref in enumerate(alone):  # the segments as the user's pooling reads them from the row
        seg = segs[i] if i < len(segs) else None
        for how in POOLINGS:
            got = pool(packed[seg], how) if seg is not None else None
            diff = float((got - pool(ref, how)).abs().max()) if got is not None and got.shape == ref[0].shape else float("inf")
            pooled[how] = max(pooled[how], diff)
    cos = min(float(_cos(pool(packed[s], "mean"), pool(ref, "mean"))) for s, ref in zip(B.segment_slices(wb.lengths), alone, strict=True))
    out = {"max_abs_diff": max(per), "max_abs_diff_per_example": per,
           "max_abs_diff_pooled": max(pooled.values()), **{f"max_abs_diff_{how}": v for how, v in pooled.items()},
           "min_cosine_mean": cos, "segments": sources, "examples": len(wb.examples),
           "batch_has_position_ids": "position_ids" in batch}
    wb._cache[key] = out
    return out


def _cos(a: Any, b: Any) -> Any:
    import torch

    return torch.nn.functional.cosine_similarity(a[None].double(), b[None].double())[0]


def _flash(wb: Workbench) -> bool:
    from ..backends import FLASH_FAMILY

    return wb.backend in FLASH_FAMILY


def _parity_verdict(wb: Workbench, what: str, diff: float, metrics: dict[str, Any], atol: float) -> CheckResult:
    message = f"{what}: {_fmt(diff)} (tol {_fmt(atol)})"
    if diff <= atol:
        return CheckResult("pass", metrics, message)
    iso = isolation_numbers(wb)
    if max(iso["max_change"], iso["max_change_pooled"]) > wb.tol["isolation_atol"]:
        cause, evidence = _leak_cause(wb, iso)
    elif within_numerics(diff, atol, wb.dtype):
        cause, evidence = "kernel_numerics", numerics_evidence("logits_atol", diff, atol, wb.dtype)
    else:
        cause, evidence = "wrong_positions", {"isolation_moved": iso["max_change"], **positions_numbers(wb)}
    return CheckResult("fail", metrics, message, cause=cause, evidence={**evidence, "max_abs_diff": diff})


def check_encoder_parity(wb: Workbench) -> CheckResult:
    """Last hidden states ``(tokens, hidden)`` of the packed row = each example alone, within ``logits_atol``; a
    difference is a leak when the isolation probe moves, numerics within 10x the tolerance, else wrong positions."""
    numbers = parity_numbers(wb)
    return _parity_verdict(wb, "last hidden states, packed vs alone", numbers["max_abs_diff"],
                           {**numbers, "atol": wb.tol["logits_atol"]}, wb.tol["logits_atol"])


def check_encoder_pooling(wb: Workbench) -> CheckResult:
    """Embeddings pooled per segment (mean / CLS / last token; the segments where the row's ``position_ids``
    restart) = the same pooling of each example alone. Fails ``collator_contract`` when the row's segments are not
    the examples (``position_ids`` that do not restart, or ``cu_seq_lens_q`` that disagree with them)."""
    numbers = parity_numbers(wb)
    metrics = {**numbers, "atol": wb.tol["logits_atol"]}
    sources = numbers["segments"]
    if any(v != wb.lengths for v in sources.values()):
        return CheckResult("fail", metrics, f"the row's segments are not the examples ({wb.lengths}): {sources}",
                           cause="collator_contract", evidence={"segments": sources, "lengths": wb.lengths})
    return _parity_verdict(wb, "pooled embeddings (mean / CLS / last token) per segment, packed vs alone",
                           numbers["max_abs_diff_pooled"], metrics, wb.tol["logits_atol"])


def positions_numbers(wb: Workbench) -> dict[str, Any]:
    """Each example alone without ``position_ids`` (the model numbers them) vs with the packed row's numbering of
    its segment (``position_ids_start`` = the workbench's start, from the collator): ``max_abs_diff_numbering``; and
    ``model_first_position``: the first position id with which the example alone matches the model's own numbering
    (searched in 0 .. start + 4), None when none does."""
    key = ("encoder_positions", id(wb.model), id(wb.collator_factory))
    if key in wb._cache:
        return wb._cache[key]
    batch = wb.packed()
    segs = segments_of(batch)
    row_first = [int(batch["position_ids"][0, s.start]) for s in segs]
    diff, first = 0.0, None
    example = wb.examples[0]
    own = alone_hidden(wb, example, with_positions=False)
    for i, e in enumerate(wb.examples):
        mine = own if i == 0 else alone_hidden(wb, e, with_positions=False)
        given = alone_hidden(wb, e, first=row_first[i] if i < len(row_first) else wb.start)
        diff = max(diff, float((mine - given).abs().max()))
    for k in range(wb.start + 5):
        if float((own - alone_hidden(wb, example, first=k)).abs().max()) <= wb.tol["logits_atol"]:
            first = k
            break
    out = {"max_abs_diff_numbering": diff, "row_first_positions": row_first, "model_first_position": first,
           "position_ids_start": wb.start}
    wb._cache[key] = out
    return out


def check_encoder_positions(wb: Workbench) -> CheckResult:
    """The packed row numbers each example as the model numbers it alone: an example alone without
    ``position_ids`` (BERT: 0 .. n-1; RoBERTa-likes: ``padding_idx + 1`` on, ``create_position_ids_from_input_ids``)
    = the same example with the positions its segment has in the row, within ``logits_atol``."""
    numbers = positions_numbers(wb)
    atol = wb.tol["logits_atol"]
    diff = numbers["max_abs_diff_numbering"]
    metrics = {**numbers, "atol": atol}
    message = (f"the row numbers examples from {sorted(set(numbers['row_first_positions']))}, the model from "
               f"{numbers['model_first_position']}: {_fmt(diff)} (tol {_fmt(atol)})")
    if diff <= atol:
        return CheckResult("pass", metrics, message)
    evidence = {"max_abs_diff_numbering": diff, "row_first_positions": numbers["row_first_positions"],
                "model_first_position": numbers["model_first_position"]}
    if numbers["model_first_position"] is not None and numbers["model_first_position"] != wb.start:
        evidence["max_abs_diff_start_based_positions"] = diff  # the remedy: position_ids_start=padding_idx + 1
    return CheckResult("fail", metrics, message, cause="wrong_positions", evidence=evidence)


def mlm_batch(wb: Workbench) -> tuple[list[list[int]], list[list[int]]]:
    """The MLM probe's inputs and labels: in each example every ``1 / MLM_FRACTION``-th token from its second one
    (at least one) is replaced by the config's ``mask_token_id`` (token 4 when it has none), its label the original
    token; -100 elsewhere. Deterministic."""
    mask = getattr(wb.config, "mask_token_id", None)
    mask = int(mask) if isinstance(mask, int) and 0 <= mask < int(wb.config.vocab_size) else 4
    step = max(1, round(1 / MLM_FRACTION))
    inputs, labels = [], []
    for e in wb.examples:
        picked = set(range(min(1, len(e) - 1), len(e), step))
        inputs.append([mask if i in picked else t for i, t in enumerate(e)])
        labels.append([t if i in picked else B.IGNORE_INDEX for i, t in enumerate(e)])
    return inputs, labels


def check_encoder_mlm_loss(wb: Workbench) -> CheckResult:
    """The masked-LM loss (nats per masked token) of the packed row, labels per token as the row carries them
    (unshifted: an MLM label sits on its own token), = the mean over every masked token of the examples alone."""
    import torch

    inputs, labels = mlm_batch(wb)
    batch = packed_row(wb, inputs)
    batch["labels"] = torch.tensor([[t for row in labels for t in row]], device=wb.device)
    out = wb.forward(batch)
    if getattr(out, "logits", None) is None or getattr(out, "loss", None) is None:
        return CheckResult("skipped", {}, f"{type(wb.model).__name__} has no masked-LM head (built as a base model): no "
                           "MLM loss to compare")
    from .reference import alone_batch

    total, count = 0.0, 0
    for e, lab in zip(inputs, labels, strict=True):
        logits = wb.forward(alone_batch(e, wb.start, wb.device)).logits[0].double()
        target = torch.tensor(lab, device=logits.device)
        total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=B.IGNORE_INDEX, reduction="sum"))
        count += int((target != B.IGNORE_INDEX).sum())
    ref, got = total / count, float(out.loss)
    delta = abs(got - ref)
    atol = wb.tol["loss_atol"]
    metrics = {"loss_delta": delta, "loss_packed": got, "loss_alone": ref, "masked_tokens": count, "atol": atol}
    if delta > atol:
        hidden = parity_numbers(wb)["max_abs_diff"]
        if hidden <= wb.tol["logits_atol"]:  # the row's hidden states match: the loss's own reduction differs
            return CheckResult("fail", metrics, f"MLM loss packed {got:.6f} vs alone {ref:.6f} nats (Δ {_fmt(delta)}) while "
                               f"the hidden states match ({_fmt(hidden)})", cause="loss_normalisation",
                               evidence={"loss_delta": delta, "max_abs_diff_hidden": hidden})
    return _parity_verdict(wb, f"MLM loss packed {got:.6f} vs alone {ref:.6f} nats, Δ", delta, metrics, atol)


def head_model(wb: Workbench, auto: str) -> Any:
    """The cell's config built with another head (``auto``: ``"AutoModelForTokenClassification"``, ...) on the
    cell's attn_implementation, :data:`NUM_LABELS` labels, seed 0, dropout off, eval. Raises what the build raises
    (a config without the head: ValueError 'Unrecognized configuration class')."""
    import torch
    import transformers

    config = copy.deepcopy(wb.model.config)
    config.num_labels = NUM_LABELS
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config, attn_implementation=wb.model.config._attn_implementation)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(wb.device).eval()


def _no_head(wb: Workbench, auto: str, exc: BaseException) -> CheckResult:
    return CheckResult("skipped", {"head": auto}, f"{wb.config.model_type} has no {auto.removeprefix('AutoModelFor')} head "
                       f"in this transformers ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})")


def check_encoder_token_cls(wb: Workbench) -> CheckResult:
    """A token-classification head (``AutoModelForTokenClassification``, :data:`NUM_LABELS` labels) on the packed
    row: its logits ``(tokens, labels)`` and its loss (labels per token, unshifted) = each example alone."""
    import torch

    try:
        model = head_model(wb, "AutoModelForTokenClassification")
    except ValueError as exc:
        return _no_head(wb, "AutoModelForTokenClassification", exc)
    from .reference import alone_batch

    labels = [[(t % NUM_LABELS) for t in e] for e in wb.examples]
    batch = packed_row(wb)
    batch["labels"] = torch.tensor([[x for row in labels for x in row]], device=wb.device)
    saved = wb.model
    wb.model = model
    try:
        out = wb.forward(batch)
        alone = [wb.forward({**alone_batch(e, wb.start, wb.device), "labels": torch.tensor([lab], device=wb.device)})
                 for e, lab in zip(wb.examples, labels, strict=True)]
    finally:
        wb.model = saved
    logits = out.logits[0].float()
    diff = max(float((logits[s] - a.logits[0].float()).abs().max()) for s, a in zip(B.segment_slices(wb.lengths), alone, strict=True))
    ref = sum(float(a.loss) * len(e) for a, e in zip(alone, wb.examples, strict=True)) / sum(wb.lengths)
    delta = abs(float(out.loss) - ref)
    atol = wb.tol["logits_atol"]
    metrics = {"max_abs_diff": diff, "loss_delta": delta, "loss_packed": float(out.loss), "loss_alone": ref,
               "head": type(model).__name__, "atol": atol}
    worst = max(diff, delta)
    return _parity_verdict(wb, f"token-classification logits {_fmt(diff)}, loss Δ {_fmt(delta)} nats; worst", worst, metrics, atol)


def scalar_label_collation(collator_factory: Any = B.default_collator_factory) -> dict[str, Any]:
    """What the flattening collator does with scalar (sequence-classification) labels, one int per example:
    ``{"outcome": "raises" | "flattened", "exception": ..., "labels": ...}``. transformers 5.25.0's
    ``DataCollatorWithFlattening.__call__`` concatenates ``[separator_id] + labels[1:]`` per example
    (data/data_collator.py): an int label raises TypeError."""
    examples = [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8, 9], "labels": 0}]
    try:
        out = collator_factory(return_position_ids=True)(examples, return_tensors="pt")
    except Exception as exc:  # noqa: BLE001 - the finding is how it fails
        return {"outcome": "raises", "exception": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
    labels = out.get("labels")
    return {"outcome": "flattened", "labels": labels.tolist() if hasattr(labels, "tolist") else labels}


def check_encoder_seq_cls(wb: Workbench) -> CheckResult:
    """A finding: sequence classification on a packed row. The model's own head
    (``AutoModelForSequenceClassification``) pools one position per row, so a row of N examples gives
    ``head_rows`` = 1 logits row, not N, and N scalar labels do not fit it; the per-segment reference (each
    example's logits alone) is what a packed trainer must reproduce by pooling per segment
    (``encoder_pooling`` judges that pooling). Also measured: the flattening collator on scalar labels
    (:func:`scalar_label_collation`)."""
    import torch

    try:
        model = head_model(wb, "AutoModelForSequenceClassification")
    except ValueError as exc:
        return _no_head(wb, "AutoModelForSequenceClassification", exc)
    batch = packed_row(wb)
    batch.pop("labels", None)
    saved = wb.model
    wb.model = model
    try:
        rows = int(wb.forward(batch).logits.shape[0])
        try:
            wb.forward({**batch, "labels": torch.arange(len(wb.examples), device=wb.device) % NUM_LABELS})
            with_labels = "ran"
        except Exception as exc:  # noqa: BLE001 - the finding is how the loss fails
            with_labels = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    finally:
        wb.model = saved
    collation = scalar_label_collation(wb.collator_factory)
    metrics = {"head": type(model).__name__, "head_rows": rows, "examples": len(wb.examples),
               "scalar_labels_loss": with_labels, "collator_scalar_labels": collation}
    findings = []
    if collation["outcome"] == "raises":
        findings.append({"cause": "labels_contract", "evidence": {"collator_scalar_labels": collation["exception"]}})
    message = (f"DataCollatorWithFlattening with scalar labels {collation['outcome']}"
               + (f" ({collation['exception']})" if collation["outcome"] == "raises" else "")
               + f"; the sequence-classification head returns {rows} logits row(s) for a packed row of "
               f"{len(wb.examples)} examples; {len(wb.examples)} scalar labels: {with_labels}")
    if rows != len(wb.examples):
        return CheckResult("fail", metrics, message, cause="pooled_head",
                           evidence={"head_rows": rows, "examples": len(wb.examples)}, findings=findings)
    return CheckResult("pass", metrics, message, findings=findings)
