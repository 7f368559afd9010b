"""TRL's SFTTrainer as users configure it: what is really in force, and what its batches carry.

Offline: the tokenizer is a small BPE trained with the ``tokenizers`` library on a few sentences (with a chat
template), so no Hub access is needed. Version drift is feature-detected (``processing_class`` vs ``tokenizer``,
``max_length`` vs ``max_seq_length``, ``padding_free`` from TRL 0.16, ``packing_strategy`` from 0.19); what the
installed TRL cannot express is "unsupported" with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..results import CheckResult
from .sft_probes import (
    _compare_steps,
    _completion_checkpointing_probe,
    _completion_only,
    _contract_probe,
    _effective,
    _first_batch_probe,
    _packed_run,
    _record,
    _row_contract,
    _steps_probe,
    _verdict,
)
from .sft_setup import (
    SENTENCES,
    STEPS,
    STRATEGIES,
    _run_sft_check,
    _Sft,
)


def check_sft(wb: Any) -> CheckResult:
    """SFTTrainer(packing=True) on six short texts, as configured by default for the installed TRL.

    Reports the effective configuration next to the request (padding_free, packing_strategy, the collator
    class, use_cache, attn_implementation; a silent override is named) and runs every probe whatever the others
    found (:data:`PROBES`): the first batch's contract (:func:`_row_contract`), the trainer's own first-batch
    loss against the per-example reference (``loss_atol``), STEPS steps packed vs the padded reference
    (``train_loss_atol``, ``train_grad_norm_rel``), gradient checkpointing on vs off, and completion-only labels on
    prompt-completion pairs. Fails on any of these, with the most specific probe's cause. SFTTrainer's own
    padded run is the ``sft_padded`` check's.
    """
    return _run_sft_check(wb, _check_sft)


def _check_sft(sft: _Sft) -> CheckResult:
    wb = sft.wb
    requested = {"packing": True, "padding_free": False}
    if "packing_strategy" in sft.feats["fields"]:
        requested["packing_strategy"] = next(f.default for f in dataclasses.fields(sft.config()) if f.name == "packing_strategy")
    metrics, summary, packed = _packed_run(sft, sft.trainer(), requested, "packed", packing=True)
    if "completion_only_loss" in sft.feats["fields"]:
        _completion_probe(metrics, _completion_only(wb, sft.feats, sft.tokenizer, sft.base))
    if "gradient_checkpointing" in sft.feats["fields"]:
        # gradient checkpointing recomputes the forward in backward: the packed boundaries must survive it
        g_loss, g_norm = sft.train_steps(packing=True, gradient_checkpointing=True)
        p_loss, p_norm = packed
        if len(g_loss) == len(p_loss) == STEPS:
            gc_loss = max(abs(a - b) for a, b in zip(g_loss, p_loss, strict=True))
            gc_norm = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(g_norm, p_norm, strict=True))
            metrics["gradient_checkpointing"] = {"max_loss_delta": gc_loss, "max_grad_norm_rel": gc_norm}
            text = f"gradient checkpointing on vs off: loss {gc_loss:.2e}, grad norm {gc_norm:.2e} relative"
            if gc_loss > wb.tol["train_loss_atol"] or gc_norm > wb.tol["train_grad_norm_rel"]:
                _record(metrics, "gradient_checkpointing", "fail", f"{text}: gradient checkpointing changes the packed run",
                        "packed_mismatch", {"max_loss_delta": gc_loss, "max_grad_norm_rel": gc_norm})
            else:
                _record(metrics, "gradient_checkpointing", "pass", text)
        else:
            _record(metrics, "gradient_checkpointing", "not_checked",
                    f"gradient checkpointing not checked: {len(g_loss)} and {len(p_loss)} steps logged")
    passed = (f"{summary}; {metrics.get('examples_in_row')} examples per row, first-batch loss delta {metrics.get('loss_delta', float('nan')):.2e}; "
              f"{STEPS} steps packed = padded (loss delta {metrics['steps'].get('max_loss_delta', float('nan')):.2e})"
              + (f"; gradient checkpointing: loss delta {metrics['gradient_checkpointing']['max_loss_delta']:.2e}"
                 if "gradient_checkpointing" in metrics else ""))
    return _verdict(metrics, summary, passed)


def _completion_probe(metrics: dict[str, Any], found: dict[str, Any]) -> None:
    metrics["completion_only"] = found
    if found["segments_matched"] == 0:
        _record(metrics, "completion_only", "not_checked",
                f"completion-only loss not checked: no prompt-completion example found in the packed row ({found['boundaries']})")
    elif found["prompt_tokens_in_loss"]:
        _record(metrics, "completion_only", "fail",
                f"completion-only loss: {found['prompt_tokens_in_loss']} prompt tokens keep their labels (prompts are trained; "
                f"{found['segments_matched']} examples split at {found['boundaries'].split(' (')[0]})", "completion_mask",
                {"prompt_tokens_in_loss": found["prompt_tokens_in_loss"], "completion_only_loss": found["completion_only_loss"]})
    elif found["segments_matched"] < len(SENTENCES):
        _record(metrics, "completion_only", "fail", f"completion-only loss: {found['segments_matched']} of {len(SENTENCES)} "
                "prompt-completion examples found whole in the packed row", "collator_contract")
    else:
        _record(metrics, "completion_only", "pass", f"completion-only loss: prompts out of the loss in all {found['segments_matched']} examples")


def check_sft_padded(wb: Any) -> CheckResult:
    """SFTTrainer's own padded run (``packing=False, padding_free=False``), STEPS steps, against the hand-written
    reference (:func:`pytest_packcheck.checks.training.reference_steps` on the same padded batch): the padded side's
    verdict. A loss off by label tokens after / before the shift is ``padded_normalisation`` (the trainer divides
    padded batches by the unshifted count: transformers' Trainer up to 5.9, gpt2 on 5.24); the packed checks
    compare with the reference, so a wrong padded side never shows as a packing fault."""
    return _run_sft_check(wb, _check_sft_padded)


def _check_sft_padded(sft: _Sft) -> CheckResult:
    from .training import padded_verdict

    result = padded_verdict(sft.wb, sft.padded_trainer_steps(), sft.padded_steps(), sft.padded_batch()["labels"], "SFTTrainer")
    result.metrics["trl"] = sft.feats["version"]
    return result


def check_sft_padding_free(wb: Any) -> CheckResult:
    """SFTTrainer(packing=False, padding_free=True): each batch of six texts is flattened into one row by TRL's
    collator (no packing of the dataset). Effective configuration vs the request, the first batch's contract
    and the trainer's loss on it vs the per-example reference, and STEPS steps padding-free vs padded, each
    probe on its own. Where the model's backend builds no packed mask from position_ids (eager / sdpa before
    transformers 4.54) the examples attend to each other and the loss diverges. ``padding_free`` appeared in
    TRL 0.16: before, "unsupported"."""
    return _run_sft_check(wb, _check_sft_padding_free)


def _check_sft_padding_free(sft: _Sft) -> CheckResult:
    requested = {"packing": False, "padding_free": True}
    # TRL 1.16 refuses max_length with padding-free batches that are not packed (it could not enforce it); the
    # six texts are short, so no length limit is needed
    mode = {"packing": False, "padding_free": True, sft.feats["max_length_key"]: None}
    trainer = sft.trainer(**mode, per_device_train_batch_size=len(SENTENCES))
    metrics, summary, _ = _packed_run(sft, trainer, requested, "padding-free", **mode)
    if {"completion_only_loss", "gradient_checkpointing"} <= set(sft.feats["fields"]):
        _completion_checkpointing_probe(sft, metrics, mode)
    return _verdict(metrics, summary, f"{summary}; {metrics.get('examples_in_row')} examples per row, loss delta "
                    f"{metrics.get('loss_delta', float('nan')):.2e}; {STEPS} steps padding-free = padded (loss delta "
                    f"{metrics['steps'].get('max_loss_delta', float('nan')):.2e})")


def check_sft_strategies(wb: Any) -> CheckResult:
    """SFTTrainer(packing=True) once per packing_strategy the installed TRL accepts (bfd, bfd_split, wrapped),
    STEPS steps each vs the padded run. ``bfd`` and ``bfd_split`` keep the boundaries (padding-free rows) and
    must match the padded run: each gets the row contract, first-batch loss and steps probes, on their own;
    ``wrapped`` ignores boundaries by design (TRL's documentation), so its numbers are reported but never fail
    the cell. ``packing_strategy`` appeared in TRL 0.19: before, "unsupported"."""
    return _run_sft_check(wb, _check_sft_strategies)


def _check_sft_strategies(sft: _Sft) -> CheckResult:
    wb = sft.wb
    if "packing_strategy" not in sft.feats["fields"]:
        return CheckResult("unsupported", {"trl": sft.feats["version"]},
                           f"not available in trl {sft.feats['version']}: SFTConfig has no packing_strategy (added in 0.19)")
    metrics: dict[str, Any] = {"trl": sft.feats["version"], "strategies": {}, "probes": {}}
    ran = []
    for strategy in STRATEGIES:
        try:
            trainer = sft.trainer(packing=True, packing_strategy=strategy)
        except ValueError as exc:  # an older TRL refuses a strategy it does not have
            metrics["strategies"][strategy] = {"available": False, "reason": str(exc).splitlines()[0][:200]}
            continue
        entry: dict[str, Any] = {"available": True, "effective": _effective(trainer)}
        batch = next(iter(trainer.get_train_dataloader()))
        first: dict[str, Any] = {}
        run = sft.train_steps(capture=first, packing=True, packing_strategy=strategy)
        if strategy == "wrapped":
            entry["steps"], _ = _compare_steps(wb, run, sft.padded_steps(), strategy)
            entry["keys"] = sorted(batch)
            entry["by_design"] = "wrapped packing ignores example boundaries by design (TRL docs): measured, not compared for parity"
        else:
            # every probe of the strategy on its own: the row contract says why the steps diverge (e.g. TRL
            # 0.20-0.23 send no position_ids to non-flash backends), the loss probes say by how much
            problems, starts = _row_contract(wb, batch, entry, sft.examples())
            _contract_probe(entry, problems, starts, prefix=f"{strategy}: ")
            if run[0]:
                _first_batch_probe(sft, first or batch, run[0][0], entry, prefix=f"{strategy}: ")
            _steps_probe(sft, run, entry, strategy)
            metrics["probes"].update({f"{strategy}:{k}": v for k, v in entry.pop("probes").items()})
        metrics["strategies"][strategy] = entry
        ran.append(f"{strategy} {entry['steps'].get('max_loss_delta', float('nan')):.2e}")
    if not ran:
        return CheckResult("unsupported", metrics, f"no packing strategy runs in trl {sft.feats['version']}")
    summary = f"trl {sft.feats['version']}, {STEPS}-step loss delta vs padded: " + ", ".join(ran)
    if metrics["strategies"].get("wrapped", {}).get("available"):
        summary += " (wrapped: boundaries ignored by design, not failed)"
    return _verdict(metrics, summary, summary)


def key_number_strategies(metrics: dict[str, Any]) -> str | None:
    """sft_strategies' key number: the worst N-step loss delta over the judged strategies (wrapped is shown, not
    judged); "" when none ran, None for a result without strategies."""
    from .registry import format_number

    if not isinstance(metrics.get("strategies"), dict):
        return None
    deltas = [(v.get("steps") or {}).get("max_loss_delta") for k, v in metrics["strategies"].items()
              if k != "wrapped" and v.get("available")]
    deltas = [d for d in deltas if isinstance(d, float)]
    return f"loss Δ {format_number(max(deltas))}" if deltas else ""
