"""Training as users run it: transformers' Trainer + DataCollatorWithFlattening, and the harness the training
checks share (the TRL ones in :mod:`pytest_packcheck.checks.sft` too): a hand-written SGD reference, a trainer run that
leaves no trace on the model, and the trainer's own padded run told apart.

The Trainer's token counting this relies on: ``num_items_in_batch`` is passed to models that take loss kwargs
since transformers 4.46 (``Trainer.get_batch_samples``); it counts labels after the causal shift from 5.10
(``trainer.py``, ``_get_num_items_in_batch``; measured: 5.9.0 counts before the shift, 5.10.1 after).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..backends import backend_availability
from ..model import batches as B
from ..results import CheckResult

if TYPE_CHECKING:
    from .workbench import Workbench


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def _cannot_train(wb: Workbench) -> CheckResult | None:
    """The skipped verdict of a Trainer check where it cannot run: a backend without a backward pass here
    (flex_attention on CPU), or transformers' Trainer not importable (it needs accelerate); None where it can."""
    avail = backend_availability(wb.backend or "eager", wb.device)
    if not avail.backward:
        return CheckResult("skipped", {}, avail.backward_reason)
    try:
        from transformers import Trainer  # noqa: F401 - needs accelerate
    except ImportError as exc:
        return CheckResult("skipped", {}, f"transformers' Trainer is not importable ({exc})")
    return None


TRAINER_STEPS = 3


class _PaddingCollator:
    """Right-padding collator for token lists (what DataCollatorForLanguageModeling(mlm=False) gives, without
    needing a tokenizer): input_ids, attention_mask, labels -100 on the padding."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return B.padded_batch([f["input_ids"] for f in features], self.pad_id, "right")


def _checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on: ``is_activation_checkpointing`` in 5.x,
    ``is_gradient_checkpointing`` before (5.x keeps it, deprecated)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def train_and_restore(model: Any, make_trainer: Callable[[], Any]) -> tuple[list[float], list[float], dict[str, Any]]:
    """Build a trainer with ``make_trainer()``, train it without printing its logs, and return the per-step loss,
    the grad norm from its log history, and the parameters after the last step. The loss is what the trainer's
    own ``compute_loss`` returned, summed over the micro-batches of each optimizer step (the logged loss is
    rounded to 4 decimals in transformers 4.x). The model's weights, ``config.use_cache`` (transformers' Trainer
    and TRL's SFTTrainer both set it), gradient checkpointing and its ``forward`` (accelerate wraps it for mixed
    precision) are restored afterwards, accelerate's process-wide state is reset, and the model is left in eval
    mode; the caller may set ``use_cache`` before the call."""
    import copy

    from transformers.trainer_callback import PrinterCallback

    state = copy.deepcopy(model.state_dict())
    saved_cache = getattr(model.config, "use_cache", None)
    checkpointing = _checkpointing(model)
    own_forward = vars(model).get("forward")  # accelerate wraps model.forward on the instance for mixed precision
    try:
        trainer = make_trainer()
        trainer.remove_callback(PrinterCallback)  # the log history is read below; no printing
        micro: list[float] = []
        compute_loss = trainer.compute_loss

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = compute_loss(*args, **kwargs)
            micro.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

        trainer.compute_loss = recording
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        accum = max(1, int(trainer.args.gradient_accumulation_steps))
        losses = [sum(micro[i:i + accum]) for i in range(0, len(micro), accum)]
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        if not checkpointing and _checkpointing(model):  # the trainer turned it on (gradient_checkpointing=True)
            disable = "activation_checkpointing_disable" if hasattr(type(model), "activation_checkpointing_disable") else "gradient_checkpointing_disable"
            getattr(model, disable)()
        model.load_state_dict(state)
        if saved_cache is not None:
            model.config.use_cache = saved_cache
        if vars(model).get("forward") is not own_forward:
            if own_forward is None:
                del model.forward
            else:
                model.forward = own_forward
        model.eval()
        model.zero_grad(set_to_none=True)
        _reset_accelerate_state()
    return losses, [float(h["grad_norm"]) for h in logs], params


def _reset_accelerate_state() -> None:
    """accelerate keeps one AcceleratorState per process, and a Trainer built later reuses what an earlier one
    set (its mixed precision, for one): measured on transformers 4.56.2, an SFTTrainer run in bf16 changed a
    later Trainer's float32 sdpa loss by 5e-6. Each training run starts from a fresh state."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    reset = getattr(AcceleratorState, "_reset_state", None)
    if reset is not None:
        reset()


#: Learning rate of every training comparison (plain SGD, constant, no clipping).
TRAIN_LR = 1e-2
#: The TrainingArguments / SFTConfig recipe of every trainer run the checks make: what :func:`reference_steps`
#: writes out by hand (plain SGD at TRAIN_LR, constant schedule, no warm-up, decay or clipping; a loss per step).
TRAIN_RECIPE = {"learning_rate": TRAIN_LR, "lr_scheduler_type": "constant", "optim": "sgd", "max_grad_norm": 1e9,
                "warmup_steps": 0, "weight_decay": 0.0, "logging_steps": 1, "seed": 0, "data_seed": 0}


def reference_steps(model: Any, batch: dict[str, Any], steps: int, lr: float = TRAIN_LR) -> tuple[list[float], list[float], dict[str, Any]]:
    """The reference the training checks compare with: ``steps`` plain SGD steps (no momentum, weight decay or
    clipping) on one padded batch, written out by hand. Loss = the model's own token mean over the label tokens
    != -100 after the shift (one batch, so no ``num_items_in_batch`` is needed and the mean is exact); train
    mode, ``use_cache=False``. Per-step loss and grad norm (2-norm over all gradients) and the parameters after
    the last step; the model is restored. Independent of how a Trainer version counts tokens: transformers'
    Trainer normalises padded batches by the label count before the shift in 4.x, and in 5.24 for models whose
    ``loss_type`` is not ForCausalLM (gpt2)."""
    import copy

    import torch

    state = copy.deepcopy(model.state_dict())
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    model.train()
    try:
        for _ in range(steps):
            loss = model(**inputs, use_cache=False).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        model.load_state_dict(state)
        model.eval()
        model.zero_grad(set_to_none=True)
    return losses, norms, params


def _train(wb: Workbench, collator: Any, out_dir: str, use_cache: bool | None, examples: list[list[int]] | None = None,
           batch_size: int | None = None, grad_accum: int = 1, steps: int = TRAINER_STEPS) -> tuple[list[float], list[float], dict[str, Any]]:
    """``steps`` optimizer steps of transformers' Trainer on ``examples`` (default: the workbench's, all of them in
    one batch per step), fixed seed and data order, SGD, constant LR, no clipping; per-step loss and grad
    norm, and the parameters after the last step. ``use_cache`` None: the model as configured. The model is
    restored afterwards."""
    import torch
    from transformers import Trainer, TrainingArguments

    model = wb.model
    examples = examples or wb.examples
    saved_cache = getattr(model.config, "use_cache", None)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch_size or len(examples), max_steps=steps, save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True, use_cpu=not wb.device.startswith("cuda"),
        remove_unused_columns=False, gradient_accumulation_steps=grad_accum, **TRAIN_RECIPE,
    )
    data = [{"input_ids": list(e)} for e in examples]

    class _InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:  # fixed data order: micro-batches as listed
            return torch.utils.data.SequentialSampler(self.train_dataset)

    def make_trainer() -> Any:
        if use_cache is not None:
            model.config.use_cache = use_cache
        return _InOrder(model=model, args=args, train_dataset=data, data_collator=collator)

    try:
        return train_and_restore(model, make_trainer)
    finally:
        if saved_cache is not None:
            model.config.use_cache = saved_cache
        torch.manual_seed(0)


def padded_trainer_note(entry: dict[str, Any], ref_loss: list[float], labels: Any, who: str) -> str:
    """A trainer's own padded run (``entry``: its per-step "loss" and "max_loss_delta" against ``ref_loss``) told
    apart: a first-step loss equal to the reference's scaled by shifted / unshifted label tokens of ``labels``
    is a normalisation by the label count before the causal shift (transformers 4.x; gpt2 on 5.24). A packed
    row masks each example's first label, so both counts agree there and the packed run is unaffected. Adds
    ``loss_ratio``, ``label_tokens_shifted_over_unshifted`` and ``normalisation`` to ``entry``; returns a note
    for the check's message ("" when there is no first step to compare)."""
    if not entry.get("loss") or not ref_loss or not ref_loss[0]:
        return ""
    unshifted, shifted = int((labels != B.IGNORE_INDEX).sum()), B.count_label_tokens(labels)
    ratio = entry["loss"][0] / ref_loss[0]
    entry.update({"loss_ratio": ratio, "label_tokens_shifted_over_unshifted": shifted / unshifted})
    if abs(ratio - shifted / unshifted) < 1e-3:
        entry["normalisation"] = "divides by the label count before the shift"
        return (f"; {who}'s own padded run is off: loss x{ratio:.4f} = {shifted}/{unshifted} label tokens after / before "
                "the shift (it divides padded batches by the unshifted count)")
    return f"; {who}'s own padded run differs from the reference by {_fmt(entry['max_loss_delta'])}"


def padded_verdict(wb: Workbench, run: tuple[list[float], list[float]], reference: tuple[list[float], list[float]],
                   labels: Any, who: str) -> CheckResult:
    """The verdict on a trainer's own padded run (``run``: per-step loss and grad norm) against the hand-written
    ``reference`` on the same padded batch (``labels``: its labels): pass within ``train_loss_atol`` and
    ``train_grad_norm_rel``; else fail, ``padded_normalisation`` when the first-step loss is the reference's
    times shifted / unshifted label tokens (:func:`padded_trainer_note`), ``padded_mismatch`` otherwise."""
    (loss, norm), (ref_loss, ref_norm) = run, reference
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "reference_loss": ref_loss, "reference_grad_norm": ref_norm}
    if not loss or len(loss) != len(ref_loss):
        return CheckResult("fail", metrics, f"{who}'s own padded run logged {len(loss)} steps, the reference {len(ref_loss)}",
                           cause="padded_mismatch", evidence={"steps": len(loss), "reference_steps": len(ref_loss)})
    metrics["max_loss_delta"] = max(abs(a - b) for a, b in zip(loss, ref_loss, strict=True))
    metrics["max_grad_norm_rel"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norm, ref_norm, strict=True))
    text = (f"{who}'s own padded run vs the hand-written reference, {len(loss)} steps: loss delta {_fmt(metrics['max_loss_delta'])}, "
            f"grad norm rel {_fmt(metrics['max_grad_norm_rel'])}")
    if metrics["max_loss_delta"] <= wb.tol["train_loss_atol"] and metrics["max_grad_norm_rel"] <= wb.tol["train_grad_norm_rel"]:
        return CheckResult("pass", metrics, text)
    note = padded_trainer_note(metrics, ref_loss, labels, who)
    cause = "padded_normalisation" if metrics.get("normalisation") else "padded_mismatch"
    evidence = {k: metrics[k] for k in ("max_loss_delta", "loss_ratio", "label_tokens_shifted_over_unshifted") if k in metrics}
    return CheckResult("fail", metrics, text + note, cause=cause, evidence=evidence)


def _padded_runs(wb: Workbench, out_dir: str) -> tuple[dict[str, Any], tuple, tuple]:
    """The right-padded batch of the workbench's examples, the hand-written reference on it and Trainer's own padded
    run (a padding collator, use_cache=False), TRAINER_STEPS steps each; cached per model, so the trainer and
    trainer_padded checks of a group share them."""
    key = ("trainer_padded_runs", id(wb.model), wb.pad_id)
    if key not in wb._cache:
        padded = B.padded_batch(wb.examples, wb.pad_id, "right")
        wb._cache[key] = (padded, reference_steps(wb.model, padded, TRAINER_STEPS),
                             _train(wb, _PaddingCollator(wb.pad_id), out_dir, use_cache=False))
    return wb._cache[key]


def check_trainer_padded(wb: Workbench) -> CheckResult:
    """transformers' Trainer's own padded run (a right-padding collator, use_cache=False), TRAINER_STEPS SGD
    steps, against :func:`reference_steps` on the same batch: the padded side's verdict, so a gate can hold it.
    Trainer divides padded batches by the label count before the causal shift up to 5.9 (all models) and on 5.24
    for models whose ``loss_type`` is not ForCausalLM (gpt2): loss x shifted / unshifted label tokens (x0.9032 =
    28/31 here), cause ``padded_normalisation``. The ``trainer`` check measures the packed run against the same
    reference, so this fault never shows there as a packing one."""
    import tempfile

    cannot = _cannot_train(wb)
    if cannot is not None:
        return cannot
    with tempfile.TemporaryDirectory(prefix="packcheck-trainer-") as tmp:
        padded, (ref_loss, ref_norm, _), (loss, norm, _) = _padded_runs(wb, tmp)
    return padded_verdict(wb, (loss, norm), (ref_loss, ref_norm), padded["labels"], "Trainer")


#: Lengths of the three extra examples of the gradient-accumulation probe (two micro-batches of three).
GRAD_ACCUM_LENGTHS = (9, 12, 5)


def _grad_accum(wb: Workbench, collator: Any, out_dir: str) -> dict[str, Any]:
    """One optimizer step of Trainer with gradient_accumulation_steps=2 over two micro-batches of three
    examples (the workbench's and three more), use_cache=False. The ``num_items_in_batch`` the Trainer hands the
    model with each micro-batch is captured by a forward pre-hook; it must be the label tokens != -100 after
    the causal shift over both micro-batches (transformers >= 4.46 passes it where the model takes loss
    kwargs). Returns the counts seen (None where the Trainer passed none), the expected count and the loss."""
    model = wb.model
    examples = list(wb.examples) + B.make_examples(wb.config, GRAD_ACCUM_LENGTHS, seed=1)
    seen: list[int | None] = []

    def capture(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        n = kwargs.get("num_items_in_batch")
        seen.append(None if n is None else int(n))

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        loss, norm, _ = _train(wb, collator, out_dir, use_cache=False, examples=examples, batch_size=3, grad_accum=2, steps=1)
    finally:
        handle.remove()
    return {"num_items_in_batch": seen, "expected": sum(len(e) - 1 for e in examples), "micro_batches": len(seen),
            "loss": loss, "grad_norm": norm}


def check_trainer(wb: Workbench) -> CheckResult:
    """Training as a user runs it: transformers' ``Trainer`` with ``DataCollatorWithFlattening``, TRAINER_STEPS
    steps (same examples, seed and order, SGD, constant LR, no clipping), against :func:`reference_steps` on the
    right-padded batch: per-step loss (``train_loss_atol``), grad norm and the parameters after the last step
    (relative, ``train_grad_norm_rel``). The packed run is made twice: with the model as configured (the default
    ``use_cache=True`` of most configs builds a cache, so eager/sdpa/flex get no packed mask: the cache trap, in
    training) and with ``use_cache=False``. Then gradient accumulation 2 x 3 examples (:func:`_grad_accum`):
    the ``num_items_in_batch`` Trainer passes with the packed micro-batches must be the shifted label count.

    Trainer's own padded run is measured too and reported beside the verdict: Trainer normalises a padded batch
    by its label count before the shift in 4.x, and in 5.24 for models whose ``loss_type`` is not ForCausalLM
    (gpt2), which makes it differ from a correct packed run by shifted / unshifted tokens.

    Verdicts: pass when the packed run is right as configured; fail with "correct only with use_cache=False";
    fail when both are wrong, or on a wrong ``num_items_in_batch``."""
    import tempfile

    import torch

    cannot = _cannot_train(wb)
    if cannot is not None:
        return cannot
    flat = wb.collator_factory(return_position_ids=True, position_ids_start=wb.start)
    with tempfile.TemporaryDirectory(prefix="packcheck-trainer-") as tmp:
        padded, (ref_loss, ref_norm, ref_params), padded_run = _padded_runs(wb, tmp)
        runs = {"as_configured": _train(wb, flat, tmp, use_cache=None), "use_cache_false": _train(wb, flat, tmp, use_cache=False),
                "padded_trainer": padded_run}
        ga_packed, ga_padded = _grad_accum(wb, flat, tmp), _grad_accum(wb, _PaddingCollator(wb.pad_id), tmp)
    # whole optimizer steps: the training tolerances (the sft checks use the same)
    tol_loss, tol_rel = wb.tol["train_loss_atol"], wb.tol["train_grad_norm_rel"]
    ref_flat = torch.cat([p.flatten() for p in ref_params.values()])
    metrics: dict[str, Any] = {"steps": TRAINER_STEPS, "reference_loss": ref_loss, "reference_grad_norm": ref_norm,
                               "config_use_cache": getattr(wb.config, "use_cache", None)}
    verdicts = {}
    for name, (loss, norm, params) in runs.items():
        loss_delta = max((abs(a - b) for a, b in zip(loss, ref_loss, strict=True)), default=float("inf")) if len(loss) == len(ref_loss) else float("inf")
        norm_rel = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norm, ref_norm, strict=True)), default=float("inf")) if len(norm) == len(ref_norm) else float("inf")
        flat_p = torch.cat([params[n].flatten() for n in ref_params])
        param_rel = float((flat_p - ref_flat).norm() / ref_flat.norm().clamp_min(1e-30))
        first_bad = next((i + 1 for i, (a, b) in enumerate(zip(loss, ref_loss, strict=False)) if abs(a - b) > tol_loss), None)
        metrics[name] = {"loss": loss, "grad_norm": norm, "max_loss_delta": loss_delta, "max_grad_norm_rel": norm_rel,
                         "param_rel_diff": param_rel, "first_diverging_step": first_bad}
        verdicts[name] = loss_delta <= tol_loss and norm_rel <= tol_rel and param_rel <= tol_rel
    metrics["max_loss_delta"] = metrics["as_configured"]["max_loss_delta"]
    a, b = metrics["as_configured"], metrics["use_cache_false"]
    pt = metrics["padded_trainer"]
    note = padded_trainer_note(pt, ref_loss, padded["labels"], "Trainer") if not verdicts["padded_trainer"] else ""
    metrics["grad_accum"] = {"packed": ga_packed, "padded": ga_padded}
    counts = {n for n in ga_packed["num_items_in_batch"] if n is not None}
    findings = []
    if pt.get("normalisation"):
        findings.append({"cause": "padded_normalisation", "evidence": (
            f"Trainer's own padded run: loss x{pt['loss_ratio']:.4f} = label tokens after / before the shift (it divides "
            "by the unshifted count); the packed run is measured against a correctly normalised reference")})
    gap = max((abs(x - y) for x, y in zip(a.get("loss") or [], b.get("loss") or [], strict=False)), default=0.0)
    if counts and counts != {ga_packed["expected"]}:
        off = max(counts, key=lambda n: abs(n - ga_packed["expected"])) - ga_packed["expected"]
        return CheckResult("fail", metrics, f"gradient accumulation 2 x 3 examples: Trainer passed num_items_in_batch "
                           f"{sorted(counts)} with the packed micro-batches, expected {ga_packed['expected']} (label tokens "
                           f"!= -100 after the shift; {off:+d}, and 2 x 2 example boundaries lie inside the packed rows: an unmasked "
                           "boundary label adds one each)" + note, cause="loss_normalisation",
                           evidence={"num_items_in_batch": sorted(counts), "expected": ga_packed["expected"]}, findings=findings)
    ga_text = (f"grad accum 2 x 3: num_items_in_batch {ga_packed['expected']} as expected" if counts
               else "grad accum 2 x 3: the Trainer passes no num_items_in_batch to this model")
    if verdicts["as_configured"]:
        return CheckResult("pass", metrics, f"{TRAINER_STEPS} Trainer steps packed = reference as configured: loss delta "
                           f"{_fmt(a['max_loss_delta'])}, grad norm rel {_fmt(a['max_grad_norm_rel'])}, params rel "
                           f"{_fmt(a['param_rel_diff'])}; {ga_text}" + note, findings=findings)
    if verdicts["use_cache_false"]:
        return CheckResult("fail", metrics, f"Trainer packed run correct only with use_cache=False: as configured loss differs "
                           f"from step {a['first_diverging_step']} by up to {_fmt(a['max_loss_delta'])} (params rel {_fmt(a['param_rel_diff'])}); "
                           f"with use_cache=False {_fmt(b['max_loss_delta'])}" + note, cause="cache_trap",
                           evidence={"as_configured_loss_delta": a["max_loss_delta"], "use_cache_false_loss_delta": b["max_loss_delta"],
                                     "config_use_cache": metrics["config_use_cache"]}, findings=findings)
    from .probes import mismatch_cause

    logits_diff, _ = wb.diff_to_solo(wb.packed_logits())
    if logits_diff <= wb.tol["logits_atol"]:
        cause, evidence = "loss_normalisation", {"logits_diff": logits_diff}
    else:
        cause, evidence = mismatch_cause(wb, logits_diff, wb.tol["logits_atol"])
    if gap > 1e-3:
        findings.append({"cause": "cache_trap", "evidence": f"the packed run as configured differs from use_cache=False by {gap:.2e} in loss"})
    return CheckResult("fail", metrics, f"Trainer packed run differs from the reference (from step {b['first_diverging_step']}): "
                       f"loss delta {_fmt(b['max_loss_delta'])} with use_cache=False, {_fmt(a['max_loss_delta'])} as configured; "
                       f"params rel {_fmt(b['param_rel_diff'])}" + note, cause=cause,
                       evidence={**evidence, "use_cache_false_loss_delta": b["max_loss_delta"]},
                       findings=[f for f in findings if f["cause"] != cause])
