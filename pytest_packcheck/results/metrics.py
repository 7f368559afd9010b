"""The numbers a cell's verdict rests on, as every reader of a cell takes them (a run, a journal, a results file
judged again on load): which metrics key names the verdict's number, and loss_parity's grad-accum rule.

Pure: no torch, no transformers, no packcheck imports.
"""

from __future__ import annotations

from typing import Any


def worst(*diffs: float) -> float:
    """The largest of ``diffs`` (absolute differences), NaN if any is NaN. Python's ``max`` drops a NaN that is not
    first (``max(0.0, nan)`` is 0.0): a guard that folded NaN outputs that way printed "0.00e+00" beside them
    (hostile trial 5), and a NaN after a finite example would read as that example's small difference. Raises
    ValueError on no values, as ``max`` does."""
    import math

    if not diffs:
        raise ValueError("worst() of no differences")
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


#: The metrics key a check sets when its verdict rests on another number than its key metric (the report, the
#: atlas, bisect and the gate then show that one).
VERDICT_METRIC = "verdict_metric"


def num_items_ignored(metrics: dict[str, Any]) -> bool:
    """Whether loss_parity's grad-accum delta is the model's and not packing's: the grad-accum sum loss is off the
    reference (``ga_delta`` > ``atol``) in the padded run as much as in the packed one (``ga_loss_packed`` and
    ``ga_loss_padded`` within ``atol``), while the token-mean loss is right (``loss_delta`` <= ``atol``) and
    the packed labels count as the reference's (``num_items_in_batch_packed`` = ``num_items_expected``). Measured
    on gemma3 (4.50-4.54), gemma4 (5.5.4), modernbert-decoder and phi4_multimodal: both 2.0x the reference, the sum
    of two micro-batch means, since the loss ignores the ``num_items_in_batch`` Trainer hands it. ``metrics``:
    loss_parity's (losses in loss units); False where a number is missing."""
    try:
        atol = float(metrics["atol"])
        return (float(metrics["ga_delta"]) > atol
                and abs(float(metrics["ga_loss_packed"]) - float(metrics["ga_loss_padded"])) <= atol
                and float(metrics["loss_delta"]) <= atol
                and metrics["num_items_in_batch_packed"] == metrics["num_items_expected"])
    except (KeyError, TypeError, ValueError):
        return False


def num_items_ignored_pass(metrics: dict[str, Any], ga_evidence: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(message, ``num_items_ignored`` finding) of a loss_parity pass whose grad-accum delta is the model's
    (:func:`num_items_ignored`): the one form of such a cell, for the check
    (:func:`pytest_packcheck.checks.parity.check_loss_parity`) and for results judged again on load
    (:func:`pytest_packcheck.results.schema.upgrade`). Marks ``metrics``: ``ga_packed_vs_padded``, and the key number
    is the token-mean delta the pass rests on (:data:`VERDICT_METRIC`). The finding's ``ga_ratio``: the
    padded grad-accum loss over the reference (None with a reference of 0)."""
    ref, packed, padded = metrics["loss_reference"], metrics["ga_loss_packed"], metrics["ga_loss_padded"]
    metrics["ga_packed_vs_padded"] = abs(packed - padded)
    metrics[VERDICT_METRIC] = "loss_delta"
    ratio = f"{padded / ref:.2f}x" if ref else "off"
    message = (f"loss delta {metrics['loss_delta']:.2e}; grad-accum sum loss packed {packed:.6f} = padded {padded:.6f} "
               f"(delta {abs(packed - padded):.2e}), both {ratio} the reference {ref:.6f}: the model's "
               "num_items_in_batch handling, padded too, not packing")
    finding = {"cause": "num_items_ignored", "evidence": {
        "ga_loss_packed": packed, "ga_loss_padded": padded, "loss_reference": ref, "ga_ratio": padded / ref if ref else None,
        "num_items_in_batch": metrics["num_items_expected"], **ga_evidence}}
    return message, finding
