"""Backend names the trainers branch on: every ``attn_implementation`` name the installed transformers accepts,
each probed with what transformers, TRL and accelerate decide by the *name*, and the packed row measured under it.

A name that runs on this machine (eager, sdpa, flex_attention, ``paged|eager``) runs as it is; one that needs a GPU
or a Hub kernel (``flash_attention_2/3/4``, ``kernels-community/...``) runs with packcheck's CPU varlen reference
standing behind it (:func:`backends.registration.standing_in`: transformers' real flash path, the exact kernel), so
every decision keyed on the name is taken as on the GPU. Per name (:func:`probe_name`):

- ``flash_requested``: transformers' ``is_flash_attention_requested`` (``utils/generic.py``: "flash" in the name),
  which skips the mask and reads the boundaries from position_ids;
- SFTTrainer(``packing=False, padding_free=True``) built on a model under the name: the padding_free in force, and
  whether its first batch carries ``position_ids`` / ``cu_seq_lens_q`` (TRL 0.20 - 0.23 sent none to non-flash names:
  measured from the batch, whatever line decides it; :mod:`analysis.fidelity` lists such lines per release);
- transformers' Trainer under context parallelism (``_prepare_context_parallel_inputs`` called on that batch with a
  cp-enabled torch ``parallelism_config``): accepted, or the ValueError and its file:line ("only with SDPA");
- accelerate's Ulysses (``DeepSpeedSequenceParallelConfig(sp_attn_implementation=name)``): accepted or refused;
- the trainer's own batch through the model: each example vs alone (max abs diff, ``logits_atol``).

Torch, transformers, TRL and accelerate are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

from ..results import CheckResult
from .sft_setup import SENTENCES
from .stack_trainers import logits_vs_alone, raised_at, source_line
from .workbench import _fmt, capture_warnings


def accepted_names() -> tuple[str, ...]:
    """Every ``attn_implementation`` the installed transformers accepts, in this order: ``eager``, the names in its
    attention registry (``ALL_ATTENTION_FUNCTIONS``; packcheck's own excluded), the Hub flash kernels it knows
    (``modeling_flash_attention_utils.FLASH_ATTN_KERNEL_VERSIONS``, 5.x)."""
    import transformers.modeling_flash_attention_utils as mfu
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..backends.table import PACKCHECK_REGISTERED

    names = ["eager", *ALL_ATTENTION_FUNCTIONS._global_mapping, *getattr(mfu, "FLASH_ATTN_KERNEL_VERSIONS", {})]
    return tuple(dict.fromkeys(n for n in names if n not in PACKCHECK_REGISTERED))


@contextlib.contextmanager
def under_name(model: Any, name: str) -> Any:
    """``model`` (built on packcheck's varlen reference) running under ``name``: transformers' own
    ``set_attn_implementation(name)`` where that works here ("native"), else the reference standing behind the name
    (``config._attn_implementation = name`` inside :func:`standing_in`). Yields ``(how, why)``; restored on exit."""
    from ..backends.registration import standing_in

    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(name)
        how, why = "native", None
    except (ImportError, ValueError, RuntimeError, KeyError) as exc:
        how, why = "stand-in", f"{type(exc).__name__}: {' '.join(str(exc).split())[:140]}"
    try:
        if how == "native":
            yield how, why
        else:
            with standing_in(name):
                model.config._attn_implementation = name
                yield how, why
    finally:
        model.config._attn_implementation = before


def _cp_decision(trainer: Any, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Trainer's own context-parallel input preparation (``Trainer._prepare_context_parallel_inputs``, called
    unbound) on ``batch``, as it runs when accelerate's ``parallelism_config`` has ``cp_enabled`` with the torch
    backend (one CPU process cannot build that config: the trainer is handed one that says so)."""
    config = types.SimpleNamespace(cp_enabled=True, cp_backend="torch", sp_backend=None, sp_enabled=False)
    accelerator = types.SimpleNamespace(parallelism_config=config, maybe_context_parallel=contextlib.nullcontext)
    try:
        type(trainer)._prepare_context_parallel_inputs(types.SimpleNamespace(accelerator=accelerator), model, dict(batch))
        return {"decision": "accepted"}
    except ValueError as exc:
        return {"decision": "refused", "raised": " ".join(str(exc).split())[:160], "raised_at": raised_at(exc)}


def _sp_decision(name: str) -> dict[str, Any]:
    try:
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    except ImportError as exc:
        return {"decision": "not available", "why": str(exc)[:120]}
    try:
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=name)
        return {"decision": "accepted"}
    except ValueError as exc:
        return {"decision": "refused", "raised": " ".join(str(exc).split())[:160], "raised_at": raised_at(exc)}


def probe_name(sft: Any, name: str) -> dict[str, Any]:
    """One name's decisions and measurement (see the module docstring); ``sft`` is the shared SFT set-up on a
    workbench whose model is built on packcheck's varlen reference."""
    from transformers.utils import generic
    from transformers.utils.generic import is_flash_attention_requested

    from .sft_probes import _effective, _segment_starts

    wb = sft.wb
    entry: dict[str, Any] = {"flash_requested": is_flash_attention_requested(requested_attention_implementation=name),
                             "flash_requested_at": source_line(generic, 'return "flash" in checked_attention_implementation')}
    with under_name(wb.model, name) as (how, why):
        entry["runs_as"] = how
        if why:
            entry["native_refused"] = why
        mode = {"packing": False, "padding_free": True, sft.feats["max_length_key"]: None,
                "per_device_train_batch_size": len(SENTENCES)}
        try:
            with capture_warnings() as said:
                trainer = sft.trainer(**mode)
        except (ValueError, TypeError, ImportError, RuntimeError) as exc:
            entry.update({"sft": "refused", "sft_raised": f"{type(exc).__name__}: {str(exc)[:160]}", "sft_raised_at": raised_at(exc)})
            return entry
        batch = next(iter(trainer.get_train_dataloader()))
        effective = _effective(trainer)
        entry.update({"sft": "accepted", "padding_free": effective["padding_free"], "collator": effective["collator"],
                      "position_ids_passed": "position_ids" in batch, "cu_seq_lens_passed": "cu_seq_lens_q" in batch})
        warned = sorted({" ".join(m.split())[:160] for m in said if "attn" in m.lower() or "flash" in m.lower()})
        if warned:
            entry["sft_warnings"] = warned[:2]
        entry["context_parallel"] = _cp_decision(trainer, wb.model, batch)
        entry["ulysses"] = _sp_decision(name)
        starts, source = _segment_starts(batch, sft.examples())
        if starts is None or int(batch["input_ids"].shape[0]) != 1:
            entry["status"] = "not_checked"
            entry["why"] = f"the first batch is not one row split into examples ({source})"
            return entry
        try:
            entry["logits_max_abs_diff"] = logits_vs_alone(wb, batch, starts)
        except Exception as exc:  # noqa: BLE001 - a name whose forward breaks here is its cell's error, named
            entry.update({"status": "error", "why": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"})
            return entry
    entry["status"] = "pass" if entry["logits_max_abs_diff"] <= wb.tol["logits_atol"] else "fail"
    return entry


def check_backend_names(wb: Any) -> CheckResult:
    """Every ``attn_implementation`` name transformers accepts (:func:`accepted_names`), each with the decisions
    transformers, TRL and accelerate make by the name and the padding-free row SFTTrainer then trains, measured
    (:func:`probe_name`). Fails on a name whose trainer batch mixes the examples (cause ``leak``; ``mask_override``
    when the trainer dropped the position_ids). Skipped without trl, and on a cell with a stack element (the names are
    probed on the bare model); "unsupported" where packcheck's reference cannot be registered (its reason). The
    model's own attn_implementation is restored afterwards."""
    import dataclasses

    from ..backends import REFERENCE_BACKEND, ensure_registered
    from .sft_setup import _run_sft_check
    from .stack import stacked

    if stacked(wb) is not None:
        return CheckResult("skipped", {}, "backend_names probes the bare model once per model: run it without "
                           "--packcheck-stack (packcheck audit --audit backend_names)")
    try:
        ensure_registered(REFERENCE_BACKEND)
    except RuntimeError as exc:
        return CheckResult("unsupported", {}, str(exc))
    model = wb.model
    before = model.config._attn_implementation
    bench = dataclasses.replace(wb, backend=REFERENCE_BACKEND, _cache={})

    def body(sft: Any) -> CheckResult:
        names = {name: probe_name(sft, name) for name in accepted_names()}
        metrics: dict[str, Any] = {"trl": sft.feats["version"], "names": names,
                                   "max_abs_diff": max((n.get("logits_max_abs_diff", 0.0) for n in names.values()), default=0.0)}
        text = "; ".join(_describe(n, e) for n, e in names.items())
        failed = [n for n, e in names.items() if e.get("status") == "fail"]
        if not failed:
            return CheckResult("pass", metrics, f"{len(names)} names: {text}")
        causes = [{"cause": "mask_override" if not names[n]["position_ids_passed"] else "leak",
                   "evidence": {"name": n, "logits_max_abs_diff": names[n]["logits_max_abs_diff"],
                                "position_ids_passed": names[n]["position_ids_passed"]}} for n in failed]
        return CheckResult("fail", metrics, f"packed rows mix examples under {', '.join(failed)}: {text}", causes=causes[:1]
                           + [c for c in causes[1:] if c["cause"] != causes[0]["cause"]][:1])

    try:
        model.set_attn_implementation(REFERENCE_BACKEND)  # the names are swapped in from packcheck's reference
        return _run_sft_check(bench, body)
    finally:
        model.config._attn_implementation = before


def _describe(name: str, e: dict[str, Any]) -> str:
    if e.get("sft") == "refused":
        return f"{name}: SFTTrainer refuses ({e['sft_raised_at']})"
    parts = [e.get("runs_as", "?"), "flash path" if e["flash_requested"] else "mask path",
             f"padding_free {'kept' if e.get('padding_free') else 'dropped'}",
             f"position_ids {'passed' if e.get('position_ids_passed') else 'not passed'}",
             f"CP {e['context_parallel']['decision']}", f"Ulysses {e['ulysses']['decision']}"]
    number = f" Δ {_fmt(e['logits_max_abs_diff'])}" if "logits_max_abs_diff" in e else f" ({e.get('why', '')[:60]})"
    return f"{name} {e.get('status')}{number} ({', '.join(parts)})"
