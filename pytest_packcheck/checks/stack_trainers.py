"""A stack element through the trainers: the packed training step of transformers' ``Trainer`` and TRL's
``SFTTrainer`` (``packing=True``, ``padding_free=True``) with their own collators, on a model carrying a PEFT adapter
or accelerate's context-parallel hook (model/stack.py), against each example of the trainer's own batch alone.

Each trainer mode (:data:`MODES`) is built as users build it, on the element's model (the ``PeftModel``, or the base
model with the hook attached): its decision is recorded (built or refused, with the exception and the file:line
that raised; the padding-free / collator in force; for ``cp``, the predicates transformers' Trainer applies to a
batch under context parallelism, read from the installed source). Then the first batch its dataloader gives (the
real collator, SFTTrainer's dataset packing) goes through one ``trainer.training_step`` (its own ``compute_loss``,
``num_items_in_batch`` = the label tokens after the shift) and is compared with each example of that batch alone
through the same element model (peft prepends its virtual tokens to each example then, as in unpacked training):
the loss (nats, ``loss_atol``), the gradients of every trainable tensor (``||g_trainer - g_alone|| / ||g_alone||``,
``grad_rel_err``) and the packed row's logits (max abs diff, ``logits_atol``). A failing mode is rerun with the
element lifted (:func:`checks.stack.stack_cause`); when that fixes the row, the cause is the element's.

Shares the SFT checks' set-up (:mod:`.sft_setup`: the offline tokenizer, the six texts, SFTConfig by TRL release)
and the segment split (:func:`.sft_probes._segment_starts`). Torch, transformers, TRL and peft are imported inside
the functions.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

from ..results import CheckResult
from .sft_setup import SENTENCES
from .workbench import _fmt, capture_warnings

#: Trainer modes, in report order: (name, what the user writes, SFTConfig overrides; None: transformers' Trainer).
MODES: tuple[tuple[str, str, dict[str, Any] | None], ...] = (
    ("trainer", "Trainer(data_collator=DataCollatorWithFlattening(return_position_ids=True))", None),
    ("sft_packing", "SFTTrainer(SFTConfig(packing=True))", {"packing": True}),
    ("sft_padding_free", "SFTTrainer(SFTConfig(packing=False, padding_free=True))",
     {"packing": False, "padding_free": True, "max_length": None}),
)

#: The decisions transformers' Trainer takes on a batch under context parallelism
#: (``Trainer._prepare_context_parallel_inputs``), found in the installed source by their messages.
CP_PREDICATES = {
    "sdpa_only": "Context parallelism is supported only with SDPA attention",
    "causal_mask_only": "Context parallelism only supports causal attention masks",
}


def source_line(module: Any, needle: str) -> str | None:
    """``<package>/<file>:<line>`` of the first line of ``module``'s source that contains ``needle`` (the
    installed release's own file, so every release is read as it is), or None."""
    import inspect

    try:
        path = inspect.getsourcefile(module)
        with open(path or "", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if needle in line:
                    return f"{_short(path or '')}:{number}"
    except (OSError, TypeError):
        return None
    return None


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    at = max((i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")), default=len(parts) - 3)
    return "/".join(parts[at + 1:])


def raised_at(exc: BaseException) -> str:
    """``file:line`` of the library frame that raised ``exc`` (the innermost frame outside packcheck)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "pytest_packcheck" not in f.filename]
    return f"{_short(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"


def _mode_kwargs(sft: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(overrides)
    if "max_length" in out:  # TRL 1.16 refuses max_length on padding-free batches that are not packed
        out[sft.feats["max_length_key"] or "max_length"] = out.pop("max_length")
    if not out.get("packing", True):
        out["per_device_train_batch_size"] = len(SENTENCES)  # one padding-free row of all six texts
    return out


def _build(sft: Any, mode: str, overrides: dict[str, Any] | None) -> Any:
    """The trainer of ``mode`` on ``sft.wb.model`` (the element's model), as a user builds it."""
    if overrides is not None:
        return sft.trainer(**_mode_kwargs(sft, overrides))
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=sft.base["output_dir"], per_device_train_batch_size=len(SENTENCES), report_to=[],
                             use_cpu=not sft.wb.device.startswith("cuda"), seed=0, disable_tqdm=True,
                             save_strategy="no", remove_unused_columns=False)
    eos = sft.tokenizer.eos_token_id  # tokenized as a Trainer user does (SFTTrainer's own path is its mode's)
    rows = [{"input_ids": [*sft.tokenizer(t)["input_ids"], eos]} for t in SENTENCES]
    collator = sft.wb.collator_factory(return_position_ids=True, position_ids_start=0)
    return Trainer(model=sft.wb.model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collator)


#: What each mode asks the trainer for (``asked`` in its entry): Trainer's flattening collator is padding-free.
ASKED: dict[str, dict[str, bool]] = {
    name: ({"padding_free": True} if overrides is None else
           {"packing": bool(overrides.get("packing")), "padding_free": bool(overrides.get("padding_free"))})
    for name, _, overrides in MODES}


def settled(asked: bool, in_force: bool | None) -> str:
    """A setting asked for vs the one in force after the trainer was built: ``kept`` (asked, in force), ``forced``
    (not asked, in force: SFTTrainer turns padding_free on for packing_strategy "bfd" / "ffd"), ``dropped`` (asked,
    not in force), ``off`` (neither), ``unknown`` (the trainer does not say)."""
    if in_force is None:
        return "unknown"
    return {(True, True): "kept", (False, True): "forced", (True, False): "dropped"}.get((asked, in_force), "off")


def decision(trainer: Any, element: Any, batch: dict[str, Any] | None = None, mode: str | None = None) -> dict[str, Any]:
    """What the built trainer has in force under the element: the collator, its padding_free / position_ids, the
    file:line that decides padding_free (SFTTrainer), and for accelerate's CP hook what Trainer's context-parallel
    input preparation would do with ``batch`` (its predicates evaluated with transformers' own helpers).

    With ``mode`` (:data:`MODES`): ``asked`` (:data:`ASKED`), ``in_force`` (``packing``: SFTConfig's after the
    build; ``padding_free``: SFTTrainer's own ``self.padding_free``, else the collator's) and ``settled``
    (:func:`settled` per key), and ``position_ids_in_batch`` (the collator's first batch carries them)."""
    import transformers.trainer as tt

    out: dict[str, Any] = {"decision": "accepted", "collator": type(trainer.data_collator).__name__}
    for key in ("padding_free", "return_position_ids"):
        if hasattr(trainer.data_collator, key):
            out[key] = getattr(trainer.data_collator, key)
    if type(trainer).__name__ == "SFTTrainer":
        import trl.trainer.sft_trainer as st

        out["decided_at"] = source_line(st, "self.padding_free = args.padding_free")
    if mode is not None:
        asked = ASKED[mode]
        in_force: dict[str, bool | None] = {
            "padding_free": getattr(trainer, "padding_free", None) if type(trainer).__name__ == "SFTTrainer"
            else (True if type(trainer.data_collator).__name__ == "DataCollatorWithFlattening"
                  else getattr(trainer.data_collator, "padding_free", None))}
        if "packing" in asked:
            in_force["packing"] = getattr(trainer.args, "packing", None)
        out.update({"asked": dict(asked), "in_force": in_force,
                    "settled": {k: settled(asked[k], in_force.get(k)) for k in asked}})
        if batch is not None:
            out["position_ids_in_batch"] = "position_ids" in batch
    if element.name == "cp":
        attn = getattr(trainer.model.config, "_attn_implementation", None)
        cp: dict[str, Any] = {"attn_implementation": attn}
        for key, needle in CP_PREDICATES.items():
            cp[f"{key}_at"] = source_line(tt, needle)
        cp["refuses_backend"] = attn != "sdpa"
        if batch is not None and "attention_mask" in batch:
            try:  # transformers 5.x keeps it in trainer_pt_utils (the predicate's own module, trainer.py imports it)
                from transformers.trainer_pt_utils import is_attention_mask_causal
            except ImportError:
                from transformers.trainer_utils import is_attention_mask_causal

            cp["refuses_mask"] = not is_attention_mask_causal(batch["attention_mask"])
        else:
            cp["refuses_mask"] = False
            cp["mask"] = "the batch carries no attention_mask: nothing to refuse, the boundaries ride position_ids"
        out["context_parallel"] = cp
        if cp["refuses_backend"] or cp["refuses_mask"]:
            out["decision"] = "refused under cp_size > 1"
    return out


def _trainable(model: Any) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _grads(model: Any) -> Any:
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                      for _, p in _trainable(model)])


def trainer_step(trainer: Any, batch: dict[str, Any], base: Any = None,
                 seen: dict[str, bool] | None = None) -> tuple[float, Any, list[str]]:
    """One ``trainer.training_step`` on ``batch`` (train mode, ``num_items_in_batch`` = label tokens != -100 after
    the shift, as Trainer counts them from 5.10): the loss it returned (nats per label token), the flattened
    gradients of the trainable tensors, and the warnings its forward raised. Gradients are cleared afterwards.

    ``base`` / ``seen``: the transformers model under the element and a dict; when given, what its decoder's forward
    received is recorded in ``seen`` (``position_ids``: True when a tensor reached it, not None or absent)."""
    import torch

    model = trainer.model
    labels = batch["labels"]
    num_items = int((labels[..., 1:] != -100).sum())
    model.zero_grad(set_to_none=True)
    model.train()
    seen = {} if seen is None else seen

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["position_ids"] = seen.get("position_ids", False) or kwargs.get("position_ids") is not None

    # the decoder (LlamaModel), which LlamaForCausalLM calls as a module: peft's tuners call the causal LM's .forward
    target = base.get_decoder() if base is not None and hasattr(base, "get_decoder") else base
    handle = target.register_forward_pre_hook(record, with_kwargs=True) if target is not None else None
    try:
        with capture_warnings() as said:
            loss = trainer.training_step(model, trainer._prepare_inputs(dict(batch)), torch.tensor(num_items))
        grads = _grads(model)
    finally:
        if handle is not None:
            handle.remove()
        model.zero_grad(set_to_none=True)
        model.eval()
    return float(loss), grads, said


def dropped_at(model: Any) -> str | None:
    """``file:line`` of peft's line that drops ``position_ids`` for a prompt-learning adapter (its warning "Position
    ids are not supported", ``peft/peft_model.py:1673`` in 0.21.2), in the release installed; None elsewhere."""
    import sys

    module = sys.modules.get(type(model).__module__)
    return source_line(module, "Position ids are not supported") if module is not None else None


def alone_step(wb: Any, batch: dict[str, Any], starts: list[int]) -> tuple[float, Any]:
    """Each example of the one-row ``batch`` (split at ``starts``) alone through the workbench's element model
    (positions from 0; prompt tuning's virtual tokens prepended to each, their logits cut by the
    :class:`StackedModel`), train mode: summed cross-entropy over the batch's own labels after the shift inside
    each example, divided by their count (the packed step's ``num_items_in_batch``), and its gradients."""
    import torch

    from .reference import alone_batch

    model, ids, labels = wb.model, batch["input_ids"], batch["labels"]
    ends = [*starts[1:], int(ids.shape[1])]
    count = int(sum(int((labels[0, s + 1:e] != -100).sum()) for s, e in zip(starts, ends, strict=True)))
    model.zero_grad(set_to_none=True)
    model.train()
    total = 0.0
    try:
        for s, e in zip(starts, ends, strict=True):
            logits = model(**alone_batch(ids[:, s:e], 0), use_cache=False).logits[0, :-1].float()
            target = labels[0, s + 1:e]
            keep = target != -100
            if keep.any():
                loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum") / max(count, 1)
                loss.backward()
                total += float(loss.detach())
        grads = _grads(model)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return total, grads


def logits_vs_alone(wb: Any, batch: dict[str, Any], starts: list[int]) -> float:
    """Max abs diff of the packed ``batch``'s logits (eval, no grad, the batch's own keys) against each example
    alone (:meth:`Workbench.solo` from position 0)."""
    logits = wb.forward({k: v for k, v in batch.items() if k != "labels"}).logits[0].float()
    ends = [*starts[1:], int(batch["input_ids"].shape[1])]
    ids = batch["input_ids"][0].tolist()
    return max(float((logits[s:e] - wb.solo(ids[s:e], first=0)).abs().max()) for s, e in zip(starts, ends, strict=True))


def _mode(sft: Any, wb: Any, element: Any, name: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """One trainer mode's entry: its decision, numbers, status and (on a fail) cause."""
    from .sft_probes import _segment_starts
    from .stack import stack_cause

    try:
        trainer = _build(sft, name, overrides)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
        return {"status": "refused", "decision": "refused", "raised": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
                "raised_at": raised_at(exc)}
    batch = next(iter(trainer.get_train_dataloader()))
    entry = decision(trainer, element, batch, name)
    starts, source = _segment_starts(batch, [] if "position_ids" in batch else sft.examples())
    if starts is None or int(batch["input_ids"].shape[0]) != 1:
        return {**entry, "status": "not_checked", "why": f"the trainer's first batch is not one packed row ({source})"}
    entry.update({"examples_in_row": len(starts), "split_at": source.split(" (")[0], "keys": sorted(batch)})
    seen: dict[str, bool] = {}
    try:
        loss, grads, said = trainer_step(trainer, batch, getattr(wb.model, "base", None), seen)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:  # the trainer's own step cannot train this row
        return {**entry, "status": "raises", "raised": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
                "raised_at": raised_at(exc)}
    if seen:
        entry["position_ids_to_model"] = seen["position_ids"]
        if entry.get("position_ids_in_batch") and not entry["position_ids_to_model"]:
            entry["position_ids_dropped_at"] = dropped_at(trainer.model)
    ref_loss, ref_grads = alone_step(wb, batch, starts)
    grad_rel = float((grads - ref_grads).norm() / ref_grads.norm().clamp_min(1e-30))
    logits = logits_vs_alone(wb, batch, starts)
    tol = wb.tol
    entry.update({"loss": loss, "loss_alone": ref_loss, "loss_delta": abs(loss - ref_loss), "grad_rel_err": grad_rel,
                  "trainable_tensors": len(_trainable(trainer.model)), "logits_max_abs_diff": logits})
    warned = sorted({" ".join(m.split())[:160] for m in said if "position" in m.lower()})
    if warned:
        entry["warnings"] = warned[:2]
    bad = [f"loss {_fmt(abs(loss - ref_loss))} nats" if abs(loss - ref_loss) > tol["loss_atol"] else "",
           f"gradients {_fmt(grad_rel)} relative" if grad_rel > tol["grad_rel_err"] else "",
           f"logits {_fmt(logits)}" if logits > tol["logits_atol"] else ""]
    bad = [b for b in bad if b]
    entry["status"] = "fail" if bad else "pass"
    entry["off"] = bad
    if entry["decision"] != "accepted":  # the trainer protects the user: measured, recorded, not failed
        entry["status"] = "refused"
    elif bad:
        found = stack_cause(wb, _BatchMeasure(batch, starts), logits, tol["logits_atol"]) if logits > tol["logits_atol"] else None
        entry["cause"] = found["cause"] if found else "leak" if logits > tol["logits_atol"] else "loss_normalisation"
        if found:
            entry["without_element"] = found["evidence"]["without_element"]
    return entry


class _BatchMeasure:
    """:func:`logits_vs_alone` of one trainer batch, as :func:`checks.stack.stack_cause` reruns it (named)."""

    def __init__(self, batch: dict[str, Any], starts: list[int]) -> None:
        self.batch, self.starts = batch, starts
        self.__name__ = "trainer_batch_vs_alone"

    def __call__(self, wb: Any) -> float:
        return logits_vs_alone(wb, self.batch, self.starts)


def check_stack_trainers(wb: Any) -> CheckResult:
    """The cell's stack element through transformers' Trainer (DataCollatorWithFlattening) and TRL's SFTTrainer
    (``packing=True``; ``padding_free=True``): per mode the trainer's decision (accepted / refused, file:line) and
    one training step's loss (nats), gradients (relative) and logits (max abs) vs each example of its own batch
    alone. Fails on any mode that accepts packing and trains the row wrong (cause: the element's when lifting it
    fixes the row, else ``leak``); a refusal is recorded, not failed (the trainer protects the user); a training step
    that raises (TRL 0.19's SFTTrainer.compute_loss on a prompt-tuned row: its logits 4 virtual tokens longer than
    the labels) is recorded per mode (``raises``, the file:line) and, with no mode failing, makes the cell an error. Skipped
    without an element, trl or a backward pass; "unsupported" for an element that is not an adapter or ``cp``."""
    from ..model.stack import stack_record
    from .sft_setup import _run_sft_check
    from .stack import stacked

    model = stacked(wb)
    if model is None:
        return CheckResult("skipped", {}, "no stack element on this cell (--packcheck-stack names one)")
    element = model.element
    if element.kind != "adapter" and element.name != "cp":
        return CheckResult("unsupported", {"stack": stack_record(model)},
                           f"stack_trainers runs the adapters and accelerate's cp hook, not {element.name}")

    def body(sft: Any) -> CheckResult:
        # the trainers get the element's own model (a PeftModel, the hooked base), as users hand it to them
        inner = dataclasses.replace(wb, model=model.inner, _cache={})
        trainer_sft = dataclasses.replace(sft, wb=inner)
        modes = {name: _mode(trainer_sft, wb, element, name, overrides) for name, _, overrides in MODES}
        metrics: dict[str, Any] = {"trl": sft.feats["version"], "stack": stack_record(model), "modes": modes,
                                   "max_abs_diff": max((m.get("logits_max_abs_diff", 0.0) for m in modes.values()), default=0.0),
                                   "max_loss_delta": max((m.get("loss_delta", 0.0) for m in modes.values()), default=0.0)}
        failed = [n for n, m in modes.items() if m["status"] == "fail"]
        text = "; ".join(_describe(n, m) for n, m in modes.items())
        if not failed and any(m["status"] == "raises" for m in modes.values()):
            # a training step that raises trains nothing wrong, but the user cannot train: an error, each mode recorded
            return CheckResult("error", metrics, f"{element.name} through the trainers: {text}")
        if not failed:
            return CheckResult("pass", metrics, f"{element.name} through the trainers: {text}")
        causes = []
        for n in failed:
            m = modes[n]
            if m["cause"] not in {c["cause"] for c in causes}:
                causes.append({"cause": m["cause"], "evidence": {"mode": n, "logits_max_abs_diff": m["logits_max_abs_diff"],
                                                                 "loss_delta": m["loss_delta"], "grad_rel_err": m["grad_rel_err"],
                                                                 **({"without_element": m["without_element"]}
                                                                    if "without_element" in m else {})}})
        return CheckResult("fail", metrics, f"{element.name} through the trainers: {text}", causes=causes)

    return _run_sft_check(wb, body)


def _describe(name: str, m: dict[str, Any]) -> str:
    if m["status"] == "refused" and "raised_at" in m:
        return f"{name} refuses ({m['raised_at']}: {m['raised'][:80]})"
    if m["status"] == "raises":
        return f"{name} accepts, its training step raises ({m['raised_at']}: {m['raised'][:80]})"
    if m["status"] == "not_checked":
        return f"{name} not checked ({m['why']})"
    cp = m.get("context_parallel")
    said = (f", Trainer under cp_size > 1: {'refuses' if m['decision'] != 'accepted' else 'accepts'} "
            f"({cp['sdpa_only_at']})") if cp else ""
    nums = (f"loss {_fmt(m['loss_delta'])}, grads {_fmt(m['grad_rel_err'])}, logits {_fmt(m['logits_max_abs_diff'])}")
    return f"{name} {m['status']} ({nums}{said})"

