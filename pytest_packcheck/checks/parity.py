"""The parity checks: position_ids consumed, isolation, logits / loss / gradient parity against each example
alone, causality and edge lengths."""

from __future__ import annotations

from typing import Any

from ..backends import backend_availability
from ..model import batches as B
from ..results import CheckResult
from ..results.metrics import VERDICT_METRIC, num_items_ignored, num_items_ignored_pass
from .probes import _also, inconclusive_evidence, leak_probe, mismatch_cause, mismatch_causes, window_probe
from .registry import NUMERICS_FACTOR, numerics_evidence, within_numerics
from .stack import grads_vs_padded, stack_cause
from .workbench import Workbench, _fmt, edge_examples, trainer_passes_num_items

# ------------------------------------------------------------------------------------------------------------
# 2. position_ids


def check_position_ids(wb: Workbench) -> CheckResult:
    """The model consumes position_ids: the packed row with restarting ids vs a plain 0..n-1 range must
    change the logits of the later examples by more than ``position_min_change``."""
    import torch

    if wb.accepted is not None and "position_ids" not in wb.accepted:
        return CheckResult("fail", {}, f"{type(wb.model).__name__}.forward takes no position_ids: packed positions cannot reach the model",
                           cause="ignores_position_ids", evidence={"forward_takes_position_ids": False})
    batch = wb.packed()
    packed = wb.packed_logits()
    total = sum(wb.lengths)
    if any(k in batch for k in B.FLASH_KWARGS):  # the row keeps its cu_seq_lens: only its positions change
        plain = dict(batch)
        plain["position_ids"] = torch.arange(wb.start, wb.start + total, device=wb.device)[None]
        ranged = wb.packed_logits(plain)
    else:  # the same row as the isolation probe's negative control: one forward for both
        ranged = wb.plain_row_logits()
    later = slice(wb.lengths[0], total)
    change = float((packed[later] - ranged[later]).abs().max())
    metrics = {"max_change": change, "threshold": wb.tol["position_min_change"]}
    if change <= wb.tol["position_min_change"]:
        return CheckResult("fail", metrics, f"position_ids ignored: restarting them changed later examples' logits by only {_fmt(change)}",
                           cause="ignores_position_ids", evidence={"max_change": change})
    return CheckResult("pass", metrics, f"restarting position_ids changes later examples' logits by {_fmt(change)}")


def leak_visible(change: float, tol: dict[str, float]) -> bool:
    """Whether a negative control's ``change`` (max abs logit change, same units as the tolerances) proves the
    probe can see a leak: at least ``leak_min`` and above ``isolation_atol``, the bar a real leak must clear to
    fail. A control under ``isolation_atol`` (``leak_min`` set at or below it) would let any leak pass unseen."""
    return change >= tol["leak_min"] and change > tol["isolation_atol"]


def leak_shortfall(change: float, tol: dict[str, float]) -> str:
    """Why :func:`leak_visible` refused a negative control's ``change``, the bar it missed first:
    ``"3.58e-03, not above isolation_atol 1.00e+02"`` and / or ``"..., under leak_min ..."`` (both when both)."""
    missed = []
    if not change > tol["isolation_atol"]:
        missed.append(f"not above isolation_atol {_fmt(tol['isolation_atol'])}")
    if change < tol["leak_min"]:
        missed.append(f"under leak_min {_fmt(tol['leak_min'])}")
    return f"{_fmt(change)}, {' and '.join(missed)}"


def check_isolation(wb: Workbench) -> CheckResult:
    """Perturb every token of the first example; the logits of the other examples must not move (max change
    <= ``isolation_atol``). Negative control: the same probe on the row with plain 0..n-1 position_ids (no
    boundaries) must move them by >= ``leak_min`` and by more than ``isolation_atol`` (:func:`leak_visible`),
    proving the probe can see a leak on this model (:func:`leak_probe`). Causes: leak, stateful_layers, kernel_numerics, probe_inconclusive."""
    probe = leak_probe(wb)
    moved, control = probe["max_change"], probe["negative_control_change"]
    metrics = {"max_change": moved, "negative_control_change": control, "atol": wb.tol["isolation_atol"],
               "stateful_layers": probe["stateful_layers"], "attention_boundaries": probe["attention_boundaries"]}
    if moved > wb.tol["isolation_atol"]:
        cause, evidence = mismatch_cause(wb)
        return CheckResult("fail", metrics, f"leak across boundaries: perturbing example 0 moved the other examples' logits by {_fmt(moved)}",
                           cause=cause, evidence=evidence)
    if not leak_visible(control, wb.tol):
        return CheckResult("error", metrics, f"probe inconclusive: a planted leak (no boundaries) moved logits by {leak_shortfall(control, wb.tol)}",
                           cause="probe_inconclusive", evidence=inconclusive_evidence(wb, "negative_control_change", control))
    return CheckResult("pass", metrics, f"other examples moved {_fmt(moved)} (a planted leak moves them {_fmt(control)})")


# ------------------------------------------------------------------------------------------------------------
# 4. logits parity


def two_row_layout(lengths: list[int]) -> tuple[int, int, int, int] | None:
    """(a, b, c, cut): indices of three examples and a cut length such that rows [a + b] and [c + a[:cut]] are of
    equal length with 2 <= cut <= len(a): the example order first (11,7,13: rows 11+7 and 13+5), then any other
    order of three (11,1,13: rows 13+1 and 11+3; trial 19, 72 found the probe silently gone there). None when no
    three examples make two such rows (fewer than 3 examples, or lengths like 5,1,5)."""
    from itertools import permutations

    for a, b, c in permutations(range(len(lengths)), 3):
        cut = lengths[a] + lengths[b] - lengths[c]
        if 2 <= cut <= lengths[a]:
            return a, b, c, cut
    return None


def _two_row_probe(wb: Workbench) -> float | str | None:
    """Two packed rows (batch size 2) of two examples each, position_ids restarting per example and no
    cu_seq_lens: max abs diff of every example against its solo run. Which backends keep boundaries for
    batch > 1 differs (transformers 5.24 derives flash boundaries from position_ids for batch size 1 only).
    None when the examples do not split into two rows of equal length (:func:`two_row_layout`)."""
    import torch

    ex = wb.examples
    layout = two_row_layout([len(e) for e in ex])
    if layout is None:
        return None
    a, b, c, cut = layout
    rows = [[ex[a], ex[b]], [ex[c], ex[a][:cut]]]
    ids = torch.tensor([[t for e in r for t in e] for r in rows], device=wb.device)
    pos = torch.tensor([[p for e in r for p in range(wb.start, wb.start + len(e))] for r in rows], device=wb.device)
    try:
        out = wb.forward({"input_ids": ids, "position_ids": pos}).logits.float()
    except Exception as exc:  # noqa: BLE001 - a backend that refuses batch > 1 packed rows: say so
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    worst = 0.0
    solo = wb.solo_logits()  # whole examples: the cached reference; the cut one runs alone
    refs = [[solo[a], solo[b]], [solo[c], None]]
    for r, row in enumerate(rows):
        start = 0
        for e, cached in zip(row, refs[r], strict=True):
            ref = cached if cached is not None else wb.solo(e)
            worst = max(worst, float((out[r, start:start + len(e)] - ref).abs().max()))
            start += len(e)
    return worst


def check_logits_parity(wb: Workbench) -> CheckResult:
    """Packed logits vs each example alone (the verdict), and vs right- and left-padded batches (reported;
    a padded batch that differs from the solo runs is named as such, not blamed on packing)."""
    import torch

    packed = wb.packed_logits()
    worst, per = wb.diff_to_solo(packed)
    metrics: dict[str, Any] = {"max_abs_diff_solo": worst, "per_example": per, "atol": wb.tol["logits_atol"]}
    notes = []
    for side in ("right", "left"):
        out = wb.padded_output(side).logits.float()
        pad_vs_solo, pack_vs_pad = 0.0, 0.0
        for (row, sl), seg, ref in zip(B.real_token_rows(wb.examples, side), B.segment_slices(wb.lengths), wb.solo_logits(), strict=True):
            pad_vs_solo = max(pad_vs_solo, float((out[row, sl] - ref).abs().max()))
            pack_vs_pad = max(pack_vs_pad, float((out[row, sl] - packed[seg]).abs().max()))
        metrics[f"max_abs_diff_{side}_padded"] = pack_vs_pad
        metrics[f"{side}_padded_vs_solo"] = pad_vs_solo
        if pad_vs_solo > wb.tol["logits_atol"]:
            notes.append(f"{side}-padded batch itself differs from solo runs by {_fmt(pad_vs_solo)}")
    if wb.start and "position_ids" in wb.packed():
        # RoBERTa-likes count positions from padding_idx + 1; a collator without position_ids_start (before
        # 5.16) restarts them at 0. Measure the row both ways, so the report separates shifted positions (what
        # position_ids_start fixes) from boundaries that never reach attention (a leak that stays either way).
        import torch

        for name, first in (("zero_based", 0), ("start_based", wb.start)):
            row = dict(wb.packed())
            row["position_ids"] = torch.cat([torch.arange(first, first + n) for n in wb.lengths])[None].to(wb.device)
            try:
                metrics[f"max_abs_diff_{name}_positions"] = wb.diff_to_solo(wb.packed_logits(row))[0]
            except Exception as exc:  # noqa: BLE001 - e.g. the 5.14 flash path derives no boundary from positions not starting at 0
                metrics[f"max_abs_diff_{name}_positions"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"

        def show(value: Any) -> str:
            return _fmt(value) if isinstance(value, float) else str(value)

        notes.append(f"positions from {wb.start} (position_ids_start, 5.16+): {show(metrics['max_abs_diff_start_based_positions'])}, "
                     f"from 0: {show(metrics['max_abs_diff_zero_based_positions'])}")
    metrics["batch_has_position_ids"] = "position_ids" in wb.packed()
    collator_ids = None
    if wb.layout.rows is not None and metrics["batch_has_position_ids"]:
        # a multimodal model's text path: the collator's (batch, length) ids as the Trainer passes them on, not
        # laid out in M-RoPE rows (Qwen2-VL 5.24 expands them to 3 rows with no text row: no packed mask)
        collator_ids = wb.diff_to_solo(wb.forward(wb.packed(), layout=B.PLAIN_POSITIONS).logits[0].float())[0]
        metrics["max_abs_diff_collator_position_ids"] = collator_ids
        notes.append(f"the collator's (batch, length) position_ids as given: {_fmt(collator_ids)}")
    two_rows = _two_row_probe(wb)
    if two_rows is None:  # said in the hazards section, never a silently missing row (trial 19, 72)
        metrics["two_rows_not_measured"] = (f"the example lengths {','.join(str(len(e)) for e in wb.examples)} make no "
                                            "two packed rows of equal length (three examples a, b, c with 2 <= "
                                            "len(a) + len(b) - len(c) <= len(a))")
    else:
        metrics["max_abs_diff_two_rows"] = two_rows
        if isinstance(two_rows, float) and two_rows > wb.tol["logits_atol"]:
            notes.append(f"two packed rows (batch size 2, no cu_seq_lens) differ from solo by {_fmt(two_rows)}")
    if worst > wb.tol["logits_atol"]:
        window = window_probe(wb)
        if window is not None:
            metrics.update(window)
    findings = []
    if isinstance(two_rows, float) and two_rows > wb.tol["logits_atol"] and worst <= wb.tol["logits_atol"]:
        # only where the packed row itself is right: a row that already leaks says nothing more with two rows
        findings.append({"cause": "batch_rows", "evidence": f"two packed rows differ from solo by {_fmt(two_rows)}"})
    shifted = metrics.get("max_abs_diff_start_based_positions")
    if isinstance(shifted, float) and worst > wb.tol["logits_atol"] and shifted < worst / 10:
        findings.append({"cause": "wrong_positions", "evidence": (
            f"the collated row differs by {_fmt(worst)}; with positions from padding_idx + 1 by {_fmt(shifted)} "
            "(what position_ids_start fixes)")})
    from .mechanisms import mechanism_findings

    findings += mechanism_findings(wb)  # a mechanism longer than the row: named, never a silent pass
    note = f" (note: {'; '.join(notes)})" if notes else ""
    if worst > wb.tol["logits_atol"]:
        bad = [i for i, d in enumerate(per) if d > wb.tol["logits_atol"]]
        causes = mismatch_causes(wb, worst, wb.tol["logits_atol"])
        cause, evidence = causes[0]["cause"], causes[0]["evidence"]
        if cause == "wrong_positions" and isinstance(shifted, float):
            evidence["start_based_positions_diff"] = shifted
        causes[0]["evidence"] = {**evidence, "max_abs_diff_solo": worst}
        named = {c["cause"] for c in causes}
        return CheckResult("fail", metrics, f"packed vs solo logits differ by {_fmt(worst)} (examples {bad}){note}"
                           + _also(causes), causes=causes, findings=[f for f in findings if f["cause"] not in named])
    if collator_ids is not None and collator_ids > wb.tol["logits_atol"]:
        # a verdict, not a note: fed as transformers' Trainer and TRL feed it (the collator's ids), the model leaks;
        # the laid-out row's number says what the remedy gives
        metrics[VERDICT_METRIC] = "max_abs_diff_collator_position_ids"  # the verdict's number, not the laid-out row's
        return CheckResult("fail", metrics, (
            f"the collator's (batch, length) position_ids, as the Trainer passes them on, leak: logits differ from "
            f"solo by {_fmt(collator_ids)}; laid out as ({wb.layout.rows}, batch, length) they hold ({_fmt(worst)}){note}"),
            cause="position_layout", evidence={"max_abs_diff_collator_position_ids": collator_ids,
                                               "max_abs_diff_laid_out": worst, "rows": wb.layout.rows},
            findings=findings)
    return CheckResult("pass", metrics, f"packed vs solo max abs diff {_fmt(worst)}{note}", findings=findings)


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


def check_loss_parity(wb: Workbench) -> CheckResult:
    """Token-mean loss: packed vs right-padded vs the solo reference. Then gradient accumulation over two
    micro-batches with sum reduction (``num_items_in_batch`` = label tokens != -100 after the shift, counted
    over both micro-batches, as Trainer does since transformers 4.46): packed vs padded vs reference. The count
    is passed only where Trainer would pass it (:func:`.workbench.trainer_passes_num_items`, its
    ``model_accepts_loss_kwargs``); elsewhere the micro-batch means are weighted by their label tokens. The
    evidence names which (``ga_normalisation``) and the rule that chose it."""
    ref_sum, ref_count = _reference_loss(wb.examples, wb.solo_logits(), wb.device)
    if not ref_count:  # every example one token long: no next token to predict (settings refuse such lengths)
        return CheckResult("skipped", {"num_items_expected": 0, "lengths": wb.lengths}, (
            f"not checked: reference loss has no label token (lengths {wb.lengths}: no example of 2 or more tokens)"),
            cause="reference_unavailable", evidence={"num_items_expected": 0, "lengths": wb.lengths})
    reference = ref_sum / ref_count
    if wb.takes_labels():  # the forwards every parity check shares (the batches carry their labels)
        loss_packed, loss_padded = float(wb.packed_output().loss), float(wb.padded_output("right").loss)
    else:
        packed = wb.packed()
        loss_packed = float(wb.forward(packed, labels=packed["labels"]).loss)
        padded = B.padded_batch(wb.examples, wb.pad_id, "right", wb.start, wb.device)
        loss_padded = float(wb.forward(padded, labels=padded["labels"]).loss)
    # gradient accumulation over two micro-batches: [e0, e1] and [e2] for three examples, [e0] and [e1] for two
    split = (len(wb.examples) + 1) // 2
    micro = [wb.examples[:split], wb.examples[split:]]
    packed_mbs = [wb.packed(m) for m in micro]
    padded_mbs = [B.padded_batch(m, wb.pad_id, "right", wb.start, wb.device) for m in micro]
    n_packed = sum(B.count_label_tokens(mb["labels"]) for mb in packed_mbs)
    n_padded = sum(B.count_label_tokens(mb["labels"]) for mb in padded_mbs)
    takes_items, rule = trainer_passes_num_items(wb.model)
    ga_packed = _ga_loss(wb, packed_mbs, n_packed, takes_items)
    ga_padded = _ga_loss(wb, padded_mbs, n_padded, takes_items)
    normalisation = "num_items_in_batch" if takes_items else "label_token_weighted_mean"
    atol = wb.tol["loss_atol"]
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
    # which gradient-accumulation normalisation was used, and the Trainer rule that chose it (evidence of every verdict)
    ga_evidence = {"ga_normalisation": normalisation, "ga_normalisation_rule": rule}
    metrics["ga_packed_vs_padded"] = abs(ga_packed - ga_padded)
    ignored = num_items_ignored(metrics)
    problems = []
    if n_packed != ref_count:
        problems.append(f"num_items_in_batch {n_packed} from packed labels, expected {ref_count} ({n_packed - ref_count:+d}; a boundary label is not masked)")
    if metrics["loss_delta"] > atol:
        problems.append(f"token-mean loss packed {loss_packed:.6f} vs reference {reference:.6f} (delta {_fmt(metrics['loss_delta'])})")
    if metrics["ga_delta"] > atol and not ignored:
        problems.append(f"grad-accum sum loss packed {ga_packed:.6f} vs reference {reference:.6f} (delta {_fmt(metrics['ga_delta'])})")
    if problems:
        logits_diff, _ = wb.diff_to_solo(wb.packed_logits())
        causes = []
        worst = max(metrics["loss_delta"], metrics["ga_delta"])
        if metrics["ga_delta"] > atol and metrics["ga_delta"] > metrics["loss_delta"]:
            # the number the fail rests on (gemma4 on 5.5.4 read "fail loss_parity Δ 1.4e-07": the token-mean delta,
            # within tolerance, beside a grad-accum delta of 6.2)
            metrics[VERDICT_METRIC] = "ga_delta"
        missing = leak_probe(wb)["attention_boundaries"] == "missing"  # numerics only with the boundaries kept
        if n_packed == ref_count and logits_diff <= wb.tol["logits_atol"] and missing:
            # the counts are right and the logits within tolerance, yet attention calls lacked the packed
            # boundaries: the examples mix (trial 15, 242), whatever the size of the difference
            causes.append({"cause": "leak", "evidence": {"attention_boundaries": "missing", "logits_diff": logits_diff,
                                                         "loss_delta": metrics["loss_delta"]}})
        elif (n_packed == ref_count and logits_diff <= wb.tol["logits_atol"]
                and within_numerics(worst, 0.0, wb.dtype, reference)):
            # the count is right, the logits match and the loss is within 10 ulps at its magnitude (not 10x a
            # tolerance: a small real normalisation fault stays one): only a tolerance below float rounding fails
            # it (float32.loss_atol=1e-12 read "loss_normalisation, do not pack"; trial 6, 163)
            causes.append({"cause": "kernel_numerics", "evidence": {
                "num_items_in_batch_packed": n_packed, "num_items_expected": ref_count, "logits_diff": logits_diff,
                **numerics_evidence("loss_atol", worst, atol, wb.dtype, reference)}})
        elif n_packed != ref_count or logits_diff <= wb.tol["logits_atol"]:
            # a label not masked (the count says so), or logits that match: labels or the count used to normalise
            causes.append({"cause": "loss_normalisation", "evidence": {
                "num_items_in_batch_packed": n_packed, "num_items_expected": ref_count,
                "logits_diff": logits_diff, "loss_delta": metrics["loss_delta"], **ga_evidence}})
        if logits_diff > wb.tol["logits_atol"]:  # the logits differ too: their own cause(s), each with its number
            causes += mismatch_causes(wb, logits_diff, wb.tol["logits_atol"])
        for c in causes:
            c["evidence"] = {**c.get("evidence", {}), **ga_evidence}
        return CheckResult("fail", metrics, "; ".join(problems) + _also(causes) + _ga_note(takes_items), causes=causes)
    if ignored:
        message, finding = num_items_ignored_pass(metrics, ga_evidence)
        return CheckResult("pass", metrics, message + _ga_note(takes_items), evidence=ga_evidence, findings=[finding])
    return CheckResult("pass", metrics, (f"loss delta {_fmt(metrics['loss_delta'])}, grad-accum delta {_fmt(metrics['ga_delta'])}, "
                                         f"padded delta {_fmt(metrics['padded_delta'])}{_ga_note(takes_items)}"), evidence=ga_evidence)


def _ga_loss(wb: Workbench, micro_batches: list[dict[str, Any]], n_items: int, takes_items: bool) -> float:
    """The gradient-accumulation loss over ``micro_batches`` (float, loss units): with ``takes_items`` the sum of
    the model's own sum-reduced losses (``num_items_in_batch=n_items``, as Trainer passes it since transformers
    4.46); otherwise each micro-batch's token-mean loss weighted by its label tokens (!= -100 after the shift)
    over ``n_items``: the same token mean, computed here for a forward that takes no ``num_items_in_batch``
    (transformers <= 4.46's llama: it raised TypeError)."""
    import torch

    if takes_items:
        return sum(float(wb.forward(mb, labels=mb["labels"], num_items_in_batch=torch.tensor(n_items)).loss) for mb in micro_batches)
    return sum(float(wb.forward(mb, labels=mb["labels"]).loss) * B.count_label_tokens(mb["labels"]) / n_items
               for mb in micro_batches if B.count_label_tokens(mb["labels"]))


def _ga_note(takes_items: bool) -> str:
    return "" if takes_items else " (grad accum: label-token-weighted micro-batch means; the forward takes no num_items_in_batch)"


# ------------------------------------------------------------------------------------------------------------
# 6. gradient parity


def check_grad_parity(wb: Workbench) -> CheckResult:
    """After backward of the token-mean loss (train mode), every parameter's gradient, packed vs right-padded:
    relative error ||g_packed - g_padded|| / ||g_padded|| over all parameters, the worst parameter, and the
    cosine similarity."""
    import torch

    avail = backend_availability(wb.backend or "eager", wb.device)
    if not avail.backward:
        return CheckResult("skipped", {}, avail.backward_reason)
    params = [(n, p) for n, p in wb.model.named_parameters() if p.requires_grad]
    g_packed = [g for _, g in wb.param_grads(wb.packed())]
    g_padded = [g for _, g in wb.param_grads(B.padded_batch(wb.examples, wb.pad_id, "right", wb.start, wb.device))]
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
                    "label_tokens": B.count_label_tokens(B.padded_batch(wb.examples, wb.pad_id, "right", wb.start, wb.device)["labels"])}
        return CheckResult("skipped", evidence, (
            f"not checked: reference gradients (padded run) are all zero over {len(params)} tensors "
            f"({evidence['label_tokens']} label tokens; packed run norm {_fmt(evidence['packed_grad_norm'])}): nothing to compare"),
            cause="reference_unavailable", evidence=evidence)
    rel = float((flat_a - flat_b).norm() / flat_b.norm().clamp_min(1e-30))
    # in float64 and clamped: float32 rounding made a cosine of 1.0000037 (trial 12, 2), which no cosine is
    cos = min(1.0, max(-1.0, float(torch.nn.functional.cosine_similarity(flat_a.double(), flat_b.double(), dim=0))))
    per = [(float((a - b).norm() / b.norm().clamp_min(1e-12)), n) for (n, _), a, b in zip(params, g_packed, g_padded, strict=True) if b.norm() > 0]
    worst_rel, worst_name = max(per) if per else (0.0, "")
    metrics = {"grad_rel_err": rel, "grad_cosine": cos, "worst_param": worst_name, "worst_param_rel_err": worst_rel,
               "num_params": len(params), "rel_tol": wb.tol["grad_rel_err"], "cos_min": wb.tol["grad_cos_min"]}
    if rel > wb.tol["grad_rel_err"] or cos < wb.tol["grad_cos_min"]:
        logits_diff, _ = wb.diff_to_solo(wb.packed_logits())
        scale = float(flat_a.norm() / flat_b.norm().clamp_min(1e-30))
        causes: list[dict[str, Any]] = []
        found = (stack_cause(wb, grads_vs_padded, rel, wb.tol["grad_rel_err"])
                 if logits_diff <= wb.tol["logits_atol"] else None)  # the forward holds: the element's backward?
        if found:
            causes = [found]
            cause, evidence = found["cause"], found["evidence"]
        elif logits_diff > wb.tol["logits_atol"]:
            causes = mismatch_causes(wb, logits_diff, wb.tol["logits_atol"])
            cause, evidence = causes[0]["cause"], causes[0]["evidence"]
        elif cos >= wb.tol["grad_cos_min"]:
            # same direction, another length: the loss is normalised differently (e.g. 28/31 label tokens)
            cause, evidence = "loss_normalisation", {"grad_norm_ratio": scale, "grad_cosine": cos}
        elif leak_probe(wb)["attention_boundaries"] == "missing":
            # another direction, and attention calls lacked the packed boundaries: the examples mix, never numerics
            # (trial 15, 242: opt / sdpa in bfloat16, rel err 0.25, cosine 0.968, read kernel_numerics)
            cause, evidence = "leak", {"attention_boundaries": "missing", "grad_rel_err": rel, "grad_cosine": cos,
                                       "logits_diff": logits_diff}
        else:
            numerics = rel <= NUMERICS_FACTOR * wb.tol["grad_rel_err"]
            cause, evidence = ("kernel_numerics" if numerics else "wrong_positions",
                               {"grad_rel_err": rel, "logits_diff": logits_diff,
                                **(numerics_evidence("grad_rel_err", rel, wb.tol["grad_rel_err"], wb.dtype) if numerics else {})})
        metrics["grad_norm_ratio"] = scale
        causes = causes or [{"cause": cause, "evidence": evidence}]
        n_packed = B.count_label_tokens(wb.packed()["labels"])
        n_expected = sum(max(0, n - 1) for n in wb.lengths)
        if n_packed != n_expected and all(c["cause"] != "loss_normalisation" for c in causes):
            # a boundary label left unmasked adds a token to the packed loss: its own cause beside the logits'
            causes.append({"cause": "loss_normalisation", "evidence": {"label_tokens_packed": n_packed, "label_tokens_expected": n_expected}})
        return CheckResult("fail", metrics, f"gradients differ: rel err {_fmt(rel)}, cosine {cos:.6f}, norm ratio {scale:.4f}, "
                           f"worst {worst_name} ({_fmt(worst_rel)})" + _also(causes), causes=causes)
    return CheckResult("pass", metrics, f"grad rel err {_fmt(rel)}, cosine {cos:.7f} over {len(params)} tensors")


def check_causality(wb: Workbench) -> CheckResult:
    """For each example of the packed row, perturb its last token alone; no position before it (in that example or
    an earlier one) may move (<= ``isolation_atol``), while the perturbed position's own logits must (>= ``leak_min``:
    the perturbation reached the model). A causal model that leaks moves only later positions, so this tells
    non-causal (bidirectional) attention from a leak, even when the boundaries hold. Cause: non_causal."""
    vocab = int(wb.config.vocab_size)
    base = wb.packed_logits()
    change, own, first = 0.0, float("inf"), None
    for k, sl in enumerate(B.segment_slices(wb.lengths)):
        perturbed = [list(e) for e in wb.examples]
        perturbed[k][-1] = (perturbed[k][-1] + 1 + vocab // 2) % vocab
        moved = (base - wb.packed_logits(wb.packed(perturbed))).abs().amax(dim=-1)
        last = sl.stop - 1
        own = min(own, float(moved[last]))
        if last:
            before = float(moved[:last].max())
            if before > change:
                change = before
                first = int((moved[:last] > wb.tol["isolation_atol"]).nonzero().flatten()[0]) if before > wb.tol["isolation_atol"] else first
    metrics = {"max_change_earlier": change, "perturbed_position_change": own, "atol": wb.tol["isolation_atol"],
               "leak_min": wb.tol["leak_min"]}
    if change > wb.tol["isolation_atol"]:
        return CheckResult("fail", metrics, f"not causal: changing an example's last token moved earlier positions' "
                           f"logits by {_fmt(change)} (first at token {first})", cause="non_causal",
                           evidence={"max_change_earlier": change, "first_position": first})
    if not leak_visible(own, wb.tol):
        return CheckResult("error", metrics, f"probe inconclusive: the perturbed tokens' own logits moved {leak_shortfall(own, wb.tol)}",
                           cause="probe_inconclusive", evidence=inconclusive_evidence(wb, "perturbed_position_change", own))
    return CheckResult("pass", metrics, f"earlier positions moved {_fmt(change)} (the perturbed ones {_fmt(own)})")


def check_edge_lengths(wb: Workbench) -> CheckResult:
    """Packed rows of edge lengths (:data:`EDGE_ROWS`) vs each example alone: max abs logits diff <=
    ``logits_atol``, and the packed token-mean loss vs the per-example reference (one-token examples carry no
    label) <= ``loss_atol``. Causes: as :func:`mismatch_cause`."""
    rows, worst_row, worst, loss_worst = [], None, 0.0, 0.0
    for examples in edge_examples(wb.config):
        lengths = tuple(len(e) for e in examples)
        batch = wb.packed(examples)
        out = wb.forward(batch, labels=batch["labels"])
        logits = out.logits[0].float()
        solo = [wb.solo(e) for e in examples]
        diff = max(float((logits[sl] - ref).abs().max()) for sl, ref in zip(B.segment_slices(list(lengths)), solo, strict=True))
        total, count = _reference_loss(examples, solo, wb.device)
        loss_delta = abs(float(out.loss) - total / max(count, 1))
        rows.append({"lengths": list(lengths), "max_abs_diff": diff, "loss_delta": loss_delta})
        if diff >= worst:
            worst, worst_row = diff, list(lengths)
        loss_worst = max(loss_worst, loss_delta)
    metrics = {"rows": rows, "max_abs_diff": worst, "max_loss_delta": loss_worst, "atol": wb.tol["logits_atol"]}
    if worst > wb.tol["logits_atol"] or loss_worst > wb.tol["loss_atol"]:
        cause, evidence = mismatch_cause(wb, worst, wb.tol["logits_atol"]) if worst > wb.tol["logits_atol"] else (
            "loss_normalisation", {"max_loss_delta": loss_worst})
        return CheckResult("fail", metrics, f"edge lengths: packed vs solo logits differ by {_fmt(worst)} (row {worst_row}), "
                           f"loss by {_fmt(loss_worst)}", cause=cause, evidence={**evidence, "row": worst_row})
    return CheckResult("pass", metrics, f"{len(rows)} edge rows ({', '.join(str(r['lengths']) for r in rows)}): logits "
                       f"{_fmt(worst)}, loss {_fmt(loss_worst)}")
