"""The probes of the SFTTrainer checks, each on its own: effective configuration, the first batch's row contract, the
trainer's first-batch loss against each example alone, N steps packed vs padded, and completion-only labels."""

from __future__ import annotations

import itertools
from typing import Any

from ..results import CheckResult
from .reference import alone_batch
from .sft_setup import (
    SENTENCES,
    STEPS,
    _Sft,
)


def _effective(trainer: Any) -> dict[str, Any]:
    """What is in force after SFTTrainer was built. The collator is what pads or flattens: its padding_free
    is the one in force (TRL 1.16's bfd packing turns it on whatever SFTConfig.padding_free says)."""
    from ..backends import effective_attn_implementation

    collator_free = getattr(trainer.data_collator, "padding_free", None)
    model = trainer.model
    return {"packing": trainer.args.packing,
            "padding_free": collator_free if collator_free is not None else getattr(trainer.args, "padding_free", None),
            "packing_strategy": getattr(trainer.args, "packing_strategy", None),
            "collator": type(trainer.data_collator).__name__,
            # TRL 0.20-0.23 build it as use_flash_attention: False on every other backend
            "return_position_ids": getattr(trainer.data_collator, "return_position_ids", None),
            "use_cache": getattr(model.config, "use_cache", None),
            "attn_implementation": effective_attn_implementation(model)}


def _configuration(sft: _Sft, trainer: Any, requested: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Metrics (TRL version, requested vs effective configuration, overrides) and a one-line summary."""
    effective = _effective(trainer)
    overridden = {k: (v, effective.get(k)) for k, v in requested.items() if k in effective and effective[k] != v}
    metrics = {"trl": sft.feats["version"], "requested": requested, "effective": effective,
               "overridden": {k: list(v) for k, v in overridden.items()}}
    over = "; ".join(f"{k} requested {a} -> in force {b}" for k, (a, b) in overridden.items())
    summary = (f"trl {sft.feats['version']}: {effective['collator']}, packing={effective['packing']}, "
               f"padding_free={effective['padding_free']}, packing_strategy={effective['packing_strategy']}, "
               f"use_cache={effective['use_cache']}" + (f"; overridden: {over}" if over else ""))
    return metrics, summary


def _row_contract(wb: Any, batch: dict[str, Any], metrics: dict[str, Any],
                  examples: list[list[int]] | None = None) -> tuple[list[str], list[int] | None]:
    """The first batch of a packed or padding-free run: one row whose position_ids restart per example, labels
    -100 at each example's first token, cu_seq_lens_q and seq_idx (where TRL emits them) at the restarts, and no all-ones
    attention_mask (it would override the boundaries on eager / sdpa / flex). Returns the problems and the
    example starts: the position_ids restarts; in a row without position_ids, where the known ``examples`` start
    along the row (:func:`_segment_starts`), so the labels at the boundaries are still checked beside the missing
    boundaries (issue 41: that row named mask_override alone); None when neither splits the row."""
    problems = []
    metrics["keys"] = sorted(batch)
    all_ones = "attention_mask" in batch and int((batch["attention_mask"] == 0).sum()) == 0 and batch["input_ids"].shape[0] == 1
    metrics["row_contract"] = {"all_ones_attention_mask": all_ones, "position_ids": "position_ids" in batch}
    if all_ones:
        problems.append("the packed batch carries an all-ones attention_mask (it overrides the boundaries on eager/sdpa/flex)")
    pos = batch.get("position_ids")
    if pos is None:
        effective = metrics.get("effective") or {}
        why = (": padding_free is on, but the collator has return_position_ids=False (TRL builds it as use_flash_attention)"
               if effective.get("padding_free") and effective.get("return_position_ids") is False else "")
        problems.append(f"the packed batch carries no position_ids{why}: examples are concatenated without boundaries")
        starts, _ = _segment_starts(batch, examples or []) if examples and batch["input_ids"].shape[0] == 1 else (None, "")
        if starts is not None:
            _boundary_labels(batch, starts, problems, metrics, " (found by the examples' token ids)")
        return problems, starts
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    metrics["examples_in_row"] = len(starts)
    if len(starts) < 2:
        problems.append(f"position_ids restart {len(starts)} time(s): the row is not packed")
    _boundary_labels(batch, starts, problems, metrics)
    if "seq_idx" in batch:  # TRL 1.x, for the short convolutions of linear-attention layers: example index per token
        seq_idx = batch["seq_idx"][0].tolist()
        bounds = [*starts, int(pos.shape[-1])]
        expected = [i for i in range(len(starts)) for _ in range(bounds[i + 1] - bounds[i])]
        metrics["seq_idx_matches"] = seq_idx == expected
        if seq_idx != expected:
            wrong = next(i for i, (a, b) in enumerate(zip(seq_idx, expected, strict=False)) if a != b) if len(seq_idx) == len(expected) else None
            problems.append(f"seq_idx disagrees with the position_ids restarts (first at token {wrong}, length "
                            f"{len(seq_idx)} vs {len(expected)})")
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].tolist()
        metrics["cu_seq_lens_q"] = cu[:12]
        if cu != [*starts, int(pos.shape[-1])]:
            problems.append(f"cu_seq_lens_q {cu[:8]} disagree with the position_ids restarts {starts[:8]} and the row "
                            f"length {int(pos.shape[-1])}")
    return problems, starts


def _boundary_labels(batch: dict[str, Any], starts: list[int], problems: list[str], metrics: dict[str, Any],
                     found: str = "") -> None:
    """Labels that are not -100 at an example start (``starts``): a problem of the row, and its own cause
    (boundary_labels, :func:`_contract_probe`) beside whatever else the row breaks."""
    labels = batch.get("labels")
    if labels is None:
        return
    unmasked = [s for s in starts if int(labels[0, s]) != -100]
    if unmasked:
        text = f"labels not -100 at {len(unmasked)} example starts {unmasked[:5]}{found}"
        problems.append(text)
        metrics["row_contract"].update({"unmasked_starts": unmasked[:12], "label_problem": text})


#: The probes of an SFT mode, most specific first. Each runs whatever the others found and records its own item
#: (``metrics["probes"][name]``: status pass / fail / not_checked, evidence, cause); the cell's causes are the
#: failed probes' in this order, each with its own numbers (``CheckResult.causes``), the first one primary. Labels (prompt tokens trained)
#: and a broken row are read off the batch; the loss probes measure what they do to training.
PROBES = ("completion_only", "row_contract", "boundary_labels", "label_count", "first_batch_loss", "steps",
          "gradient_checkpointing")


def _record(metrics: dict[str, Any], name: str, status: str, evidence: str, cause: str | None = None,
            numbers: dict[str, Any] | None = None) -> None:
    """One probe's item in ``metrics["probes"]``: status ("pass", "fail", "not_checked"), evidence (one line),
    cause code (a fail's), and the numbers behind the cause."""
    metrics.setdefault("probes", {})[name] = {"status": status, "evidence": evidence, "cause": cause if status == "fail" else None,
                                              **({"numbers": numbers} if numbers else {})}


def _segment_starts(batch: dict[str, Any], examples: list[list[int]]) -> tuple[list[int] | None, str]:
    """Where the examples of a one-row batch start, and how that was found: the ``position_ids`` restarts; else
    the known examples' token ids matched one after another along the row (a row that carries no position_ids:
    TRL 0.19 - 0.23 on non-flash backends); (None, why) when neither splits the whole row."""
    pos = batch.get("position_ids")
    if pos is not None:
        return (pos[0] == 0).nonzero().flatten().tolist(), "position_ids"
    row = batch["input_ids"][0].tolist()
    pool = sorted((e for e in examples if e), key=len, reverse=True)
    starts, at = [], 0
    while at < len(row):
        match = next((e for e in pool if row[at:at + len(e)] == e), None)
        if match is None:
            return None, f"no position_ids, and no known example starts at token {at} of {len(row)}"
        starts.append(at)
        at += len(match)
    return starts, "the known examples' token ids (the row has no position_ids)"


def _reference_loss(wb: Any, ids: Any, labels: Any, starts: list[int]) -> float:
    """Token-mean loss of each segment of the row run alone (positions from 0, use_cache=False, train mode, no
    grad), over the row's own labels after the shift inside each segment."""
    import torch

    device, model = wb.device, wb.model
    ids, labels = ids.to(device), labels.to(device)
    ends = starts[1:] + [int(ids.shape[1])]
    total, count = 0.0, 0
    model.train()
    try:
        with torch.no_grad():
            for s, e in zip(starts, ends, strict=True):
                # TRL's rows restart positions at 0: each segment alone from 0 (.reference)
                logits = model(**alone_batch(ids[:, s:e], 0), use_cache=False).logits[0, :-1].float()
                target = labels[0, s + 1:e]
                keep = target != -100
                if keep.any():
                    total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
                    count += int(keep.sum())
    finally:
        model.eval()
    return total / max(count, 1)


def _first_batch_probe(sft: _Sft, first: dict[str, Any], trainer_loss: float, metrics: dict[str, Any], name: str = "first_batch_loss",
                       prefix: str = "") -> None:
    """The trainer's own loss on its first batch (what its ``compute_loss`` returned at step 1: train mode, the
    use_cache and num_items_in_batch it passed; TRL 0.24's compute_loss passes use_cache=False whatever the
    config says) vs each example of that batch alone (:func:`_reference_loss`), ``loss_atol``. The examples are
    split at the position_ids restarts, else at the known examples' token ids; "not_checked" when neither
    splits the row."""
    wb = sft.wb
    starts, source = _segment_starts(first, sft.examples())
    metrics.update({"first_batch_use_cache": first.get("use_cache"), "first_batch_boundaries": source,
                    "first_batch_num_items_in_batch": _int(first.get("num_items_in_batch"))})
    if starts is None or "labels" not in first:
        _record(metrics, name, "not_checked", f"{prefix}first-batch loss not checked: no boundaries to split at ({source})")
        return
    _label_count_probe(first, starts, metrics, name.replace("first_batch_loss", "label_count"), prefix)
    reference = _reference_loss(wb, first["input_ids"], first["labels"], starts)
    delta = abs(trainer_loss - reference)
    metrics.update({"loss_packed": trainer_loss, "loss_reference": reference, "loss_delta": delta, "atol": wb.tol["loss_atol"]})
    text = (f"{prefix}first-batch loss {trainer_loss:.6f} (the trainer's own, use_cache={first.get('use_cache')}) vs per-example "
            f"reference {reference:.6f} (delta {delta:.2e}; {len(starts)} examples split at {source.split(' (')[0]})")
    if delta <= wb.tol["loss_atol"]:
        _record(metrics, name, "pass", text)
        return
    cause, numbers = _loss_cause(wb, metrics)
    _record(metrics, name, "fail", text, cause, numbers)


def _label_count_probe(first: dict[str, Any], starts: list[int], metrics: dict[str, Any], name: str, prefix: str) -> None:
    """``num_items_in_batch`` the trainer passed with its first batch vs the label tokens that batch trains, each
    example on its own (labels != -100 after the shift inside each segment): a label unmasked at a boundary, or a
    count made before the shift (transformers 4.46 - 5.10.0), makes them differ. Its own cause
    (loss_normalisation), with both numbers. No item when the trainer passes no count (TRL 1.16's compute_loss
    normalises by itself: the first-batch loss probe measures that); packcheck's SFT runs use no gradient
    accumulation, so a count covers this one batch."""
    given = _int(first.get("num_items_in_batch"))
    if given is None:
        return
    labels = first["labels"][0]
    ends = [*starts[1:], int(labels.shape[-1])]
    expected = sum(int((labels[s + 1:e] != -100).sum()) for s, e in zip(starts, ends, strict=True))
    text = f"{prefix}num_items_in_batch {given} (the trainer's) vs {expected} label tokens of the examples each on its own"
    if given == expected:
        _record(metrics, name, "pass", text)
    else:
        _record(metrics, name, "fail", f"{text} ({given - expected:+d})", "loss_normalisation",
                {"num_items_in_batch": given, "label_tokens_expected": expected})


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _no_boundaries(row: dict[str, Any]) -> bool:
    """The row contract found no boundaries: no position_ids, or an all-ones attention_mask beside them."""
    return bool(row.get("all_ones_attention_mask")) or row.get("position_ids") is False


def _loss_cause(wb: Any, metrics: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The cause of a loss probe off the reference: ``mask_override`` when the row carries no boundaries (the
    row contract says why), else measured (:func:`pytest_packcheck.checks.mismatch_cause`: leak, stateful
    layers, ...), or ``loss_normalisation`` when the packed logits match each example alone."""
    from .probes import mismatch_cause

    row = metrics.get("row_contract") or {}
    if _no_boundaries(row):
        return "mask_override", dict(row)
    logits_diff, _ = wb.diff_to_solo(wb.packed_logits())
    if logits_diff <= wb.tol["logits_atol"]:
        return "loss_normalisation", {"logits_diff": logits_diff}
    return mismatch_cause(wb, logits_diff, wb.tol["logits_atol"])


def _contract_probe(metrics: dict[str, Any], problems: list[str], starts: list[int] | None, name: str = "row_contract",
                    prefix: str = "") -> None:
    """The row contract's probe, and the boundary labels' on their own (``boundary_labels``: labels not -100 at
    example starts train each example's first token as the previous one's next token, whatever else holds)."""
    row = metrics.get("row_contract") or {}
    label_problem = row.get("label_problem")
    if starts is not None:
        base = name.replace("row_contract", "boundary_labels")
        if label_problem:
            _record(metrics, base, "fail", prefix + label_problem, "boundary_labels",
                    {"unmasked_starts": row.get("unmasked_starts"), "examples": len(starts)})
        else:
            _record(metrics, base, "pass", f"{prefix}labels -100 at all {len(starts)} example starts")
    problems = [x for x in problems if x != label_problem]
    if not problems:
        _record(metrics, name, "pass", f"{prefix}{len(starts or [])} examples per row, position_ids restart at each")
        return
    cause = "mask_override" if _no_boundaries(row) else "collator_contract"
    _record(metrics, name, "fail", "; ".join(prefix + p for p in problems), cause, dict(row))


def _steps_probe(sft: _Sft, run: tuple[list[float], list[float]], metrics: dict[str, Any], label: str,
                 name: str = "steps") -> None:
    metrics["steps"], bad = _compare_steps(sft.wb, run, sft.padded_steps(), label)
    if not bad:
        _record(metrics, name, "pass", f"{label}: {STEPS} steps = padded reference (loss delta {metrics['steps']['max_loss_delta']:.2e})")
        return
    cause, numbers = _loss_cause(sft.wb, metrics)
    _record(metrics, name, "fail", "; ".join(bad), cause, numbers)


def _verdict(metrics: dict[str, Any], summary: str, passed: str) -> CheckResult:
    """The cell from its probes: pass when none failed (not-checked items named); else fail with every failed
    probe's evidence, the first one's cause (in :data:`PROBES` order) and the others' as findings."""
    probes = metrics.get("probes") or {}

    def rank(name: str) -> int:
        base = name.rsplit(":", 1)[-1]
        return PROBES.index(base) if base in PROBES else len(PROBES)

    failed = sorted((n for n, p in probes.items() if p["status"] == "fail"), key=rank)
    unchecked = [p["evidence"] for p in probes.values() if p["status"] == "not_checked"]
    if not failed:
        return CheckResult("pass", metrics, passed + "".join(f"; {u}" for u in unchecked))
    causes, seen = [], set()
    for n in failed:  # every failed probe's cause, once, with that probe's numbers: the first is primary
        if probes[n]["cause"] and probes[n]["cause"] not in seen:
            seen.add(probes[n]["cause"])
            causes.append({"cause": probes[n]["cause"], "evidence": {"probe": n, **(probes[n].get("numbers") or {})}})
    text = "; ".join(probes[n]["evidence"] for n in failed) + "".join(f"; {u}" for u in unchecked) + f" ({summary})"
    return CheckResult("fail", metrics, text, causes=causes)


def _compare_steps(wb: Any, run: tuple[list[float], list[float]], reference: tuple[list[float], list[float]],
                   label: str) -> tuple[dict[str, Any], list[str]]:
    """Per-step loss (``train_loss_atol``) and grad norm (relative, ``train_grad_norm_rel``) of ``run`` vs the
    padded ``reference``: metrics and the problems (the first diverging step with both losses)."""
    (loss, norm), (ref_loss, ref_norm) = run, reference
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "padded_loss": ref_loss, "padded_grad_norm": ref_norm}
    if not (len(loss) == len(ref_loss) == STEPS):
        return metrics, [f"{label}: {STEPS}-step training logged {len(loss)} steps, the padded run {len(ref_loss)}"]
    tol_loss, tol_norm = wb.tol["train_loss_atol"], wb.tol["train_grad_norm_rel"]
    diverged = next((i + 1 for i, (a, b) in enumerate(zip(loss, ref_loss, strict=True)) if abs(a - b) > tol_loss), None)
    norm_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norm, ref_norm, strict=True))
    metrics.update({"first_diverging_step": diverged, "max_grad_norm_rel": norm_rel,
                    "max_loss_delta": max(abs(a - b) for a, b in zip(loss, ref_loss, strict=True))})
    if diverged:
        return metrics, [(f"{label}: {STEPS}-step training, packed vs padded loss diverge at step {diverged} "
                          f"({loss[diverged - 1]:.6f} vs {ref_loss[diverged - 1]:.6f})")]
    if norm_rel > tol_norm:
        return metrics, [f"{label}: {STEPS}-step training, grad norm differs by {norm_rel:.2e} (relative)"]
    return metrics, []


def _packed_run(sft: _Sft, trainer: Any, requested: dict[str, Any], label: str,
                **train: Any) -> tuple[dict[str, Any], str, tuple[list[float], list[float]]]:
    """What every packed / padding-free SFT mode is checked for, each probe on its own whatever the others
    found: the configuration in force next to ``requested``, the first batch's row contract, the trainer's
    first-batch loss vs each example alone, and STEPS steps (``train_steps(**train)``) against the padded
    reference. Returns metrics (with ``probes``), the summary and the run's (losses, grad norms)."""
    metrics, summary = _configuration(sft, trainer, requested)
    batch = next(iter(trainer.get_train_dataloader()))
    problems, starts = _row_contract(sft.wb, batch, metrics, sft.examples())
    _contract_probe(metrics, problems, starts)
    first: dict[str, Any] = {}
    run = sft.train_steps(capture=first, **train)
    if run[0]:
        _first_batch_probe(sft, first or batch, run[0][0], metrics)
    else:
        _record(metrics, "first_batch_loss", "not_checked", "first-batch loss not checked: the trainer logged no step")
    _steps_probe(sft, run, metrics, label)
    return metrics, summary, run


def completion_pairs() -> list[dict[str, str]]:
    """The prompt-completion pairs of the completion-only probes: each of :data:`SENTENCES` split after its second word."""
    return [{"prompt": " ".join(t.split(" ")[:2]), "completion": " " + " ".join(t.split(" ")[2:] or ["end."])} for t in SENTENCES]


def prompt_tokens_in_loss(batch: dict[str, Any], prompts: list[list[int]]) -> tuple[int, int]:
    """(segments whose prompt was found at their start, prompt tokens among them whose label is not -100) of a
    one-row batch split at its position_ids restarts (:func:`_segment_starts`)."""
    starts, _ = _segment_starts(batch, [])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    matched, in_loss = 0, 0
    for s, e in itertools.pairwise([*(starts or []), len(ids)] if starts else []):
        prompt = next((p for p in prompts if ids[s:e][: len(p)] == p), None)
        if prompt is not None:
            matched += 1
            in_loss += sum(1 for x in labels[s:s + len(prompt)] if x != -100)
    return matched, in_loss


def _completion_checkpointing_probe(sft: _Sft, metrics: dict[str, Any], mode: dict[str, Any]) -> None:
    """Completion-only labels through ``padding_free`` with gradient checkpointing on (issue 25): SFTTrainer on the
    prompt-completion pairs (:func:`completion_pairs`, TRL's completion_only_loss default for them), one batch of
    all six flattened into a row, ``gradient_checkpointing=True``, :data:`STEPS` steps. Probes, in ``metrics["probes"]``:
    ``gradient_checkpointing:completion_only`` (every prompt token of the first trained row has label -100; cause
    completion_mask) and ``gradient_checkpointing:first_batch_loss`` (the trainer's own first loss, recomputed in
    backward, vs each example alone over the same labels; numbers in ``metrics["completion_checkpointing"]``)."""
    pairs = completion_pairs()
    first: dict[str, Any] = {}
    losses, _ = sft.train_steps(capture=first, data=pairs, **mode, gradient_checkpointing=True)
    name = "gradient_checkpointing:completion_only"
    if not first or "labels" not in first or first.get("position_ids") is None:
        _record(metrics, name, "not_checked", "completion-only with gradient checkpointing not checked: the first trained "
                "row carries no labels or position_ids")
        return
    prompts = [sft.tokenizer(p["prompt"])["input_ids"] for p in pairs]
    matched, in_loss = prompt_tokens_in_loss(first, prompts)
    sub: dict[str, Any] = {"segments_matched": matched, "prompt_tokens_in_loss": in_loss}
    if matched == 0:
        _record(metrics, name, "not_checked", "completion-only with gradient checkpointing not checked: no prompt found "
                "at an example start of the row")
    elif in_loss:
        _record(metrics, name, "fail", f"completion-only, padding_free, gradient checkpointing: {in_loss} prompt tokens keep "
                f"their labels in {matched} examples", "completion_mask", {"prompt_tokens_in_loss": in_loss})
    else:
        _record(metrics, name, "pass", f"completion-only, padding_free, gradient checkpointing: prompts out of the loss in "
                f"all {matched} examples")
    if losses:
        _first_batch_probe(sft, first, losses[0], sub, name="gradient_checkpointing:first_batch_loss",
                           prefix="completion-only, padding_free, gradient checkpointing: ")
        metrics.setdefault("probes", {}).update(sub.pop("probes", {}))
    metrics["completion_checkpointing"] = sub


def _completion_only(wb: Any, feats: dict[str, Any], tokenizer: Any, cfg_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SFTTrainer(packing=True) on prompt-completion pairs (TRL's default for them: completion_only_loss): in the
    packed row, every prompt token must have label -100 and every completion token (after the first position
    of its example) a label. The row is split at its position_ids restarts, else (no position_ids: TRL 0.19 -
    0.23 on non-flash backends) at the pairs' token ids as SFTTrainer(packing=False) tokenizes them; each
    segment is matched to its example by its prompt's token ids. TRL 0.19's packer drops the completion mask
    (measured: 0.19.1 trains the prompts, 0.20.0 does not)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    pairs = [{"prompt": " ".join(t.split(" ")[:2]), "completion": " " + " ".join(t.split(" ")[2:] or ["end."])} for t in SENTENCES]
    kwargs = {k: v for k, v in cfg_kwargs.items() if k != "dataset_text_field" and (k in feats["fields"] or k == "output_dir")}

    def build(**over: Any) -> Any:
        return SFTTrainer(model=wb.model, args=SFTConfig(**{**kwargs, **over}), train_dataset=Dataset.from_list(pairs),
                          **{feats["tokenizer_key"]: tokenizer})

    trainer = build()
    batch = next(iter(trainer.get_train_dataloader()))
    examples = [] if "position_ids" in batch else [list(e) for e in build(packing=False, padding_free=False).train_dataset["input_ids"]]
    starts, source = _segment_starts(batch, examples)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in pairs]
    matched, prompt_in_loss, completion_masked = 0, 0, 0
    for s, e in itertools.pairwise([*(starts or []), len(ids)] if starts else []):
        seg = ids[s:e]
        prompt = next((p for p in prompts if seg[: len(p)] == p), None)
        if prompt is None:
            continue
        matched += 1
        prompt_in_loss += sum(1 for x in labels[s:s + len(prompt)] if x != -100)
        completion_masked += sum(1 for x in labels[s + len(prompt):e] if x == -100)
    return {"segments_matched": matched, "prompt_tokens_in_loss": prompt_in_loss, "completion_tokens_masked": completion_masked,
            "completion_only_loss": getattr(trainer.args, "completion_only_loss", None), "boundaries": source,
            "dataset_columns": list(trainer.train_dataset.column_names)}


#: The packing-content probes: (example lengths, seq_length). "mixed": some examples longer than a row, some
#: short. "tails": two examples of 13 and 11 tokens into rows of 10, the case where TRL 0.27 / 0.28's bfd packs
#: the two cut-off tails into a third row of their own (0.26 drops them).
