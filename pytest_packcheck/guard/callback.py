"""The Trainer / SFTTrainer callback: :class:`PackcheckCallback` checks the first training batch before the first
optimizer step and raises, warns or installs a fallback by policy; :func:`print_line` prints the guard's line
past the progress bars."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import PackcheckUsageError
from .batch import IGNORE_INDEX, parse_row, unpack_row
from .precision import _ComputeProbe, _default_tolerances, _pick, _tolerances
from .result import GuardResult, NotPackedError, PackedBatchMismatch, print_line, say
from .verify import _versions, verify_packed_batch

#: What the callback does on a mismatch: stop before the first optimizer step, warn and go on, or switch to a
#: safe fallback (:data:`FALLBACKS`) and go on.
POLICIES = ("raise", "warn", "disable")
#: The fallback ``on_mismatch="disable"`` installs, per cause; causes not listed fall back to padding.
FALLBACKS = {
    "cache_trap": "use_cache=False on every training forward",
    "mask_override": "attention_mask dropped from packed rows",
}
PADDING_FALLBACK = "packing off: every packed row unpacked into a right-padded batch before the model"
#: The callback's JSON, in the trainer's output_dir.
RESULT_FILE = "packcheck-guard.json"


#: Packages whose frames lie between the user's ``trainer.train()`` and the guard's hook; a warning names the
#: first frame outside them (Python 3.12's ``skip_file_prefixes``, by hand for 3.11).
_LOOP_PACKAGES = ("pytest_packcheck", "torch", "transformers", "trl", "accelerate", "tqdm", "peft")


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by :func:`_warn` that names the user's own line (the one that called
    ``trainer.train()``), not torch's ``module.py`` that ran the forward pre-hook; 2 (the hook) when the
    whole stack is library code."""
    from ..errors import is_stdlib_file, package_dirs

    prefixes = package_dirs(_LOOP_PACKAGES)
    frame, level = sys._getframe(2), 2  # stacklevel 1 is _warn itself, 2 its caller
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(prefixes) or is_stdlib_file(path)):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _warn(line: str) -> None:
    """A :class:`PackcheckGuardWarning` from inside the training loop (:func:`.result.say`: printed instead where a
    blanket ``warnings.simplefilter("ignore")`` would hide it), shown while the progress bars are cleared
    (``tqdm.external_write_mode``), so its text does not land inside a bar either; attributed to the user's line
    that runs the loop (:func:`_user_stacklevel`)."""
    level = _user_stacklevel()
    try:
        from tqdm import tqdm
    except ImportError:
        say(line, stacklevel=level)
        return
    with tqdm.external_write_mode(file=sys.stderr):
        say(line, stacklevel=level)


#: The line for TRL's ``SFTConfig(packing=True, packing_strategy="wrapped")``: rows cut from one stream, an all-ones
#: mask, no position_ids, so examples attend to each other by design (TRL 1.16: "bfd" / "bfd_split" keep them apart).
WRAPPED = ("packed by wrapping (no boundaries: examples attend to each other by design; packing_strategy='bfd' or "
           "padding_free=True keeps them apart)")


def _scored(labels: Any) -> int:
    """The label tokens a causal LM's loss scores in a batch: ``(labels[..., 1:] != -100).sum()``, 0 without labels."""
    if labels is None or not hasattr(labels, "shape"):
        return 0
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _packing_of(args: Any) -> str | None:
    """How the trainer's arguments say it packs, where the first batch cannot show it: :data:`WRAPPED` for TRL's
    ``SFTConfig(packing=True, packing_strategy="wrapped")`` without ``padding_free``; else None."""
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", None) == "wrapped" and not getattr(args, "padding_free", False):
        return WRAPPED
    return None


def _autocast_of(args: Any) -> str | None:
    """The mixed-precision autocast the trainer's arguments turn on (``bf16`` / ``fp16``; TRL's SFTConfig defaults
    to ``bf16=True``), None without."""
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else None


def _not_packed(model: Any, batch: Mapping[str, Any], why: str, packing: str | None = None,
                autocast: str | None = None) -> GuardResult:
    """The result for a first training batch that is not a packed row: nothing judged. ``packing``: how the
    trainer's arguments pack although the batch shows no boundaries (:func:`_packing_of`), said instead of
    "not packed". ``autocast``: the trainer's mixed precision (:func:`_autocast_of`), the compute dtype, as the
    packed path measures it ("autocast bfloat16 over float32 weights"), not the weights' alone."""
    import torch

    ids = batch.get("input_ids")
    shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
    config = getattr(model, "config", None)
    run = {"attn_implementation": getattr(config, "_attn_implementation", None), "training": True, "input_ids": shape,
           "keys": sorted(map(str, batch)), "packed": False}
    dtype = _ComputeProbe(model, ids.device.type if isinstance(ids, torch.Tensor) else "cpu")
    dtype.remove()
    compute = autocast or dtype.weights
    source = (f"autocast {autocast} over {dtype.weights} weights (the trainer's "
              f"{'bf16' if autocast == 'bfloat16' else 'fp16'}=True)" if autocast else f"{dtype.weights} weights")
    return GuardResult(verdict="skipped", cause=None, remedy="", dtype=compute, dtype_source=source,
                       evidence=(f"{packing}: nothing to check" if packing else
                                 f"not packed: nothing to check ({why.removeprefix('verify_packed_batch: ')})"),
                       tolerance=_pick(_default_tolerances(), compute), max_logprob_diff=None,
                       per_example_logprob_diff=[], loss_packed=None, loss_reference=None, loss_delta=None,
                       lengths=[], label_tokens=0, contract=[], run=run,
                       attention={}, versions=_versions())


class PackcheckCallback(TrainerCallback):
    """Check the first training batch of a ``Trainer`` / ``SFTTrainer`` run before the first optimizer step.

    ``trainer.add_callback(PackcheckCallback())``, or ``callbacks=[PackcheckCallback()]`` when building the
    trainer. At ``on_train_begin`` a forward pre-hook goes on the model; the first forward in training mode
    hands it the batch exactly as the trainer feeds the model (after the collator and device placement); the
    hook removes itself, runs :func:`verify_packed_batch` on it (same model, dtype, autocast, use_cache,
    attn_implementation), prints one line, writes the full result to ``<output_dir>/packcheck-guard.json``
    (main process) and keeps it in ``self.result``. Then, on a mismatch, by ``on_mismatch``:

    - ``"raise"`` (default): raise :class:`PackedBatchMismatch` from inside that forward: no step is taken;
    - ``"warn"``: a :class:`PackcheckGuardWarning`, training goes on unchanged;
    - ``"disable"``: a fallback for the rest of training (``self.fallback`` says which): ``use_cache=False``
      on every training forward for the cache trap, the attention_mask dropped from packed rows for the mask
      trap, else packing off: each packed row unpacked into a right-padded batch (:func:`unpack_row`) before
      the model, provided the first batch padded matches its examples alone (else it raises: no safe fallback).
      A broken batch contract (cause ``collator_contract``) has no fallback and raises.

    The model's modes, config, gradients, the RNG states, the optimizer and the dataloader are left as they
    were: the first step is bit-identical with and without the callback.
    """

    def __init__(self, on_mismatch: str = "raise", tolerances: Mapping[str, Mapping[str, float]] | None = None,
                 verbose: bool = True) -> None:
        if on_mismatch not in POLICIES:
            raise PackcheckUsageError(f"PackcheckCallback: unknown on_mismatch={on_mismatch!r}: expected one of "
                                      f"{', '.join(POLICIES)}.")
        _tolerances(tolerances, "PackcheckCallback")  # a bad tolerances dict is refused here, not at the first training step
        self.on_mismatch = on_mismatch
        self.tolerances = tolerances
        self.verbose = verbose
        self.result: GuardResult | None = None
        self.fallback: str | None = None
        self._handles: list[Any] = []
        self._fix: dict[str, Any] | str = {}
        if not isinstance(verbose, bool):
            raise PackcheckUsageError(f"PackcheckCallback: verbose={verbose!r}: expected True or False.")
        self._output_dir: str | None = None
        self._accumulation = 1
        #: the first accumulation window: the num_items_in_batch the trainer passed and each micro-batch's scored tokens
        self._window: dict[str, Any] | None = None
        self._packing: str | None = None
        self._autocast: str | None = None
        self._main = True

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None or self.result is not None or self._handles:
            return  # the same callback added twice (trainer.add_callback(cb) beside callbacks=[cb]): one guard
        self._output_dir = getattr(args, "output_dir", None)
        accumulation = getattr(args, "gradient_accumulation_steps", 1)
        self._accumulation = accumulation if isinstance(accumulation, int) and accumulation > 1 else 1
        self._packing = _packing_of(args)
        self._autocast = _autocast_of(args)
        self._main = bool(getattr(state, "is_world_process_zero", True))
        self._handles.append(model.register_forward_pre_hook(self._first_forward, with_kwargs=True))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _first_forward(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return None  # an evaluation before training: wait for the first training forward
        if self.result is not None:  # a second registration's hook in the same forward: judged once (issue 42)
            return None
        self._remove()
        batch = dict(kwargs)
        if args and "input_ids" not in batch:
            batch["input_ids"] = args[0]
        try:
            result = verify_packed_batch(module, batch, training=True, tolerances=self.tolerances,
                                         padded_probe=self.on_mismatch == "disable")
        except NotPackedError as exc:  # a run that does not pack: nothing to check, training goes on
            result = _not_packed(module, batch, str(exc), self._packing, self._autocast)
        self.result = result
        count = batch.get("num_items_in_batch")
        count = int(count) if isinstance(count, int) or (hasattr(count, "numel") and count.numel() == 1) else None
        if result.ok and self._accumulation > 1 and count is not None:
            # with gradient accumulation the trainer divides by the count of the whole window (the sum over its
            # micro-batches): checked on the window's last forward, before the optimizer step (issue 41)
            self._window = {"count": count, "scored": [_scored(batch.get("labels"))]}
            self._handles.append(module.register_forward_pre_hook(self._window_forward, with_kwargs=True))
        if not result.ok and self.on_mismatch == "disable":
            self.fallback = self._install_fallback(module, result)
            result.fallback = self.fallback
        # a result that warns is said by its warning alone: its line once, not printed and warned
        warns = result.verdict in ("fallback", "skipped") if result.ok else self.on_mismatch == "warn"
        self._report(result, echo=not warns)
        if result.ok:
            if warns:
                _warn(result.line())
            return None
        if self.on_mismatch == "raise" or (self.on_mismatch == "disable" and self.fallback is None):
            raise PackedBatchMismatch(result)
        if self.on_mismatch == "warn":
            _warn(result.line())
            return None
        return self._apply(module, args, kwargs)  # this first batch takes the fallback too

    def _window_forward(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Each later training forward of the first accumulation window: add its scored label tokens; on the last,
        compare the trainer's num_items_in_batch with their sum (both after the shift, as transformers >= 5.10.1
        counts them; a count split over processes is a note, as for one micro-batch)."""
        import torch

        window = self._window
        if window is None or not module.training or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        window["scored"].append(_scored(labels))
        if len(window["scored"]) < self._accumulation:
            return
        self._remove()
        self._window = None
        result, total, count = self.result, sum(window["scored"]), window["count"]
        if result is None or count == total:
            if result is not None:
                result.notes.append(f"num_items_in_batch {count} = the scored label tokens of the {self._accumulation} "
                                    f"micro-batches of the first accumulation step ({' + '.join(map(str, window['scored']))})")
                self._report(result, echo=False)
            return
        from .batch import _count_may_be_divided

        said = (f"num_items_in_batch {count} is not the scored label tokens of the first accumulation step's "
                f"{self._accumulation} micro-batches ({' + '.join(map(str, window['scored']))} = {total}, labels != -100 "
                "after the shift): the loss is divided by the wrong count")
        if _count_may_be_divided():
            result.notes.append(f"{said}, unless the Trainer divided it over processes")
            self._report(result, echo=False)
            return
        result.verdict, result.cause = "fail", "loss_normalisation"
        result.causes = ["loss_normalisation", *[c for c in result.causes if c != "loss_normalisation"]]
        result.evidence = said
        result.remedy = ("count num_items_in_batch as the scored label tokens after the shift over every micro-batch "
                         "of the accumulation step (transformers' Trainer does from 5.10.1); a custom loop or "
                         "get_batch_samples override must sum them over the window")
        result.probes["window_scored"] = window["scored"]
        self._report(result, echo=self.on_mismatch != "warn")
        if self.on_mismatch in ("raise", "disable"):
            raise PackedBatchMismatch(result)
        _warn(result.line())

    def _report(self, result: GuardResult, echo: bool = True) -> None:
        if self.verbose and echo:
            print_line(result.line())
        if self._main and self._output_dir:
            path = Path(self._output_dir) / RESULT_FILE
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(result.to_json())
            except OSError as exc:  # a read-only or full output_dir: the verdict stands, training goes on (issue 42)
                _warn(f"packcheck guard: could not write {path} ({exc.strerror or type(exc).__name__}); the verdict "
                      f"above stands and training goes on: {result.verdict}")

    def _install_fallback(self, model: Any, result: GuardResult) -> str | None:
        # a broken batch contract (and every cause without a listed fallback) gets padding only if the padded probe
        # ran and matched; the contract path returns before it runs, so it has no fallback and raises
        if result.cause in FALLBACKS:
            self._fix = {"cache_trap": {"use_cache": False},
                         "mask_override": {"attention_mask": None, **({"use_cache": False} if result.run["use_cache"] else {})}}[result.cause]
            text = FALLBACKS[result.cause] + (" (and use_cache=False)" if result.cause == "mask_override" and result.run["use_cache"] else "")
        else:
            padded = result.probes.get("padded")
            if not isinstance(padded, float) or padded > result.tolerance["logits_atol"]:
                return None
            self._fix = "padding"
            text = f"{PADDING_FALLBACK} (first batch padded vs its examples alone: {padded:.2e})"
        self._handles.append(model.register_forward_pre_hook(self._apply, with_kwargs=True))
        return text

    def _apply(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        """The installed fallback, on every training forward of a packed row."""
        if not module.training:
            return None
        if self._fix != "padding":
            new = {k: v for k, v in {**kwargs, **self._fix}.items() if v is not None}
            return args, new
        batch = dict(kwargs)
        if args and "input_ids" not in batch:
            batch["input_ids"], args = args[0], args[1:]
        try:
            row = parse_row(batch, getattr(module, "config", None))
        except PackcheckUsageError:
            return None  # not a packed row: leave it alone
        if len(row.slices) < 2:
            return None
        labels = batch.get("labels")
        # slices without a label (TRL's pad_to_multiple_of tail: one token each) add nothing to the loss
        keep = [i for i, s in enumerate(row.slices) if labels is None or bool((labels[0, s.start + 1:s.stop] != IGNORE_INDEX).any())]
        pad = getattr(module.config, "pad_token_id", None)
        return args, unpack_row(batch, row.slices, pad if isinstance(pad, int) else 0, keep or None)
