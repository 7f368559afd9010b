"""The stack table: one :class:`StackElement` record per thing users run the packed row through besides the model
(a PEFT adapter, gradient checkpointing, ``torch.compile``, accelerate's context-parallel hook, Liger's kernels),
and everything else derived from it (``--packcheck-stack``'s names, validation and help, the docs' table).

A stack element is applied to the built model before a cell's checks run (:func:`apply_element`): the checks then
run on :class:`StackedModel`, which calls the element's model as a training loop would and hands back logits
``(batch, tokens, vocab)`` for the row's own tokens (prompt tuning's and p-tuning's virtual tokens stripped). The
element's name is part of the cell's id and record (``llama+lora-sdpa-isolation-float32``). A check that fails
lifts the element (:meth:`StackedModel.lifted`: the adapter disabled, the hooks removed, checkpointing off, the
uncompiled module) and reruns: when that fixes the row, the element is the cause (its :attr:`StackElement.cause`).

Adding an element is one record here (its ``apply`` function below) and its planted-fault test in
tests/test_stack.py. Importing this module imports neither torch nor transformers (the option help reads it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

#: virtual tokens of the prompt-learning adapters packcheck builds (prompt / p- / prefix tuning)
NUM_VIRTUAL_TOKENS = 4
#: LoRA / DoRA rank of the adapters packcheck builds (weights random, not zero: an untrained LoRA is the identity)
LORA_RANK = 4


@dataclass(frozen=True)
class StackElement:
    """One stack element: what it applies to the model or batch and how, what it needs, what its fault is called.

    ``name``: the ``--packcheck-stack`` value and the suffix of the cell's model label. ``kind``: "adapter",
    "checkpointing", "compile", "parallelism" or "kernels". ``applies``: what it does to the model or batch, in the
    words of the library. ``apply``: the function here that applies it (``(model, backend) -> StackedModel``).
    ``library``: the distribution it needs, whose version is recorded in each cell (its version axis in
    versions/libraries.py); ``since``: the first release of ``library`` that has it. ``needs``: modules that must
    import for it to run (named in the skip). ``cpu``: True when it runs on CPU; else why not (the skip reason).
    ``cause``: the cause code (checks/causes.py) a check returns when lifting this element fixes the row."""

    name: str
    kind: str
    applies: str
    apply: str
    library: str | None
    cause: str
    since: str | None = None
    needs: tuple[str, ...] = ()
    cpu: bool | str = True
    note: str = ""


#: Every stack element, in the order the report lists them.
ELEMENTS: tuple[StackElement, ...] = (
    StackElement("lora", "adapter", f"peft.get_peft_model(model, LoraConfig(r={LORA_RANK}, target_modules='all-linear', "
                 "init_lora_weights=False)): a low-rank update beside every linear layer; the base forward keeps its "
                 "kwargs (position_ids, cu_seq_lens_q)", "apply_peft", "peft", cause="adapter_positions", since="0.1.0",
                 needs=("peft",)),
    StackElement("dora", "adapter", "LoRA with use_dora=True (weight-decomposed), as lora otherwise", "apply_peft", "peft",
                 cause="adapter_positions", since="0.9.0", needs=("peft",)),
    StackElement("prompt_tuning", "adapter", f"PromptTuningConfig(num_virtual_tokens={NUM_VIRTUAL_TOKENS}): learned "
                 "embeddings prepended to the row's inputs_embeds (once per row, not per example); peft's "
                 "_adjust_prompt_learning_kwargs sets position_ids=None with a warning", "apply_peft", "peft",
                 cause="adapter_positions", needs=("peft",)),
    StackElement("p_tuning", "adapter", f"PromptEncoderConfig(num_virtual_tokens={NUM_VIRTUAL_TOKENS}): an MLP prompt "
                 "encoder's virtual tokens prepended as prompt tuning's (position_ids dropped the same way)", "apply_peft",
                 "peft", cause="adapter_positions", needs=("peft",)),
    StackElement("prefix_tuning", "adapter", f"PrefixTuningConfig(num_virtual_tokens={NUM_VIRTUAL_TOKENS}): learned "
                 "key / value prefixes handed in as past_key_values (a cache), position_ids shifted by "
                 "num_virtual_tokens", "apply_peft", "peft", cause="adapter_positions", needs=("peft",)),
    StackElement("checkpointing", "checkpointing", "model.activation_checkpointing_enable(use_reentrant=False) "
                 "(gradient_checkpointing_enable before transformers 5.24): every decoder layer recomputed in the "
                 "backward from the kwargs it was called with", "apply_checkpointing", None, cause="checkpoint_recompute"),
    StackElement("checkpointing_reentrant", "checkpointing", "as checkpointing, use_reentrant=True (torch's reentrant "
                 "autograd.Function; transformers enables input grads for it)", "apply_checkpointing", None,
                 cause="checkpoint_recompute"),
    StackElement("compile", "compile", "torch.compile(model, backend='aot_eager'): the forward and backward traced by "
                 "dynamo and AOTAutograd (no inductor: aot_eager runs the traced graph with eager kernels, on CPU); on a "
                 "flash backend the packed-sequence detection from position_ids runs under tracing",
                 "apply_compile", None, cause="compile_frozen"),
    StackElement("cp", "parallelism", "accelerate's context-parallel hook (big_modeling._attach_context_parallel_hooks, "
                 "what Accelerator.prepare attaches when parallelism_config.cp_size > 1): a forward pre-hook on every "
                 "self_attn that drops attention_mask and passes is_causal=True", "apply_cp_hook", "accelerate",
                 cause="stack_mask_dropped", since="1.10.0", needs=("accelerate",),
                 note="the hook alone, on one process: the sequence sharding itself (torch's context_parallel over a cp "
                      "mesh, FSDP2) needs two or more CUDA devices and is not run on CPU"),
    StackElement("liger", "kernels", "liger_kernel.transformers._apply_liger_kernel_to_instance(model): Triton "
                 "RMSNorm / RoPE / SwiGLU and the fused linear cross-entropy", "apply_liger", "liger-kernel",
                 cause="stack_kernel", needs=("liger_kernel", "triton"),
                 cpu="liger-kernel's kernels are Triton GPU kernels: it needs triton, which has no CPU build "
                     "(liger-kernel 0.8.5: `import liger_kernel.transformers` raises ModuleNotFoundError: triton)"),
)

BY_NAME: dict[str, StackElement] = {e.name: e for e in ELEMENTS}
#: ``--packcheck-stack``'s allowed values, in table order.
STACK_NAMES: tuple[str, ...] = tuple(BY_NAME)


def stack_help() -> str:
    """``--packcheck-stack``'s help: the elements, by kind."""
    kinds: dict[str, list[str]] = {}
    for e in ELEMENTS:
        kinds.setdefault(e.kind, []).append(e.name)
    return ("Stack elements to apply to each model before its checks run, comma-separated: each one is its own cell "
            "(model label '<model>+<element>'), none by default. "
            + "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())
            + ". See docs/stack.md; opt in to the whole set with --audit stack.")


class StackUnavailable(ImportError):
    """An element that cannot be applied here: ``status`` "skipped" (a package or device is missing) or
    "unsupported" (the library refuses this model), the message names the package or the refusal."""

    def __init__(self, message: str, status: str = "skipped") -> None:
        super().__init__(message)
        self.status = status


def library_version(element: StackElement) -> str | None:
    """The installed version of ``element``'s library (None: none needed, or not installed)."""
    from importlib import metadata

    if element.library is None:
        return None
    try:
        return metadata.version(element.library)
    except metadata.PackageNotFoundError:
        return None


def availability(element: StackElement) -> str | None:
    """Why ``element`` cannot run here (the skip's message), or None when it can: a module of :attr:`needs` that
    does not import, then its :attr:`cpu` reason (checked only where the modules import), then a ``library``
    release older than :attr:`since`."""
    missing = [m for m in element.needs if find_spec(m) is None]
    if missing:
        why = f" ({element.cpu})" if element.cpu is not True else ""
        return (f"stack element {element.name} needs {' and '.join(m.replace('_', '-') for m in missing)} "
                f"(not installed here){why}")
    if element.since and element.library:
        from packaging.version import Version

        have = library_version(element)
        if have and Version(have) < Version(element.since):
            return f"stack element {element.name} needs {element.library} >= {element.since} (installed: {have})"
    return None


def describe() -> list[tuple[str, str, str, str, str]]:
    """(name, kind, library, runs on CPU, what it applies) of every element: the docs' stack table."""
    return [(e.name, e.kind, e.library or "torch / transformers", "yes" if e.cpu is True else f"no: {e.cpu}", e.applies)
            for e in ELEMENTS]


# ------------------------------------------------------------------------------------------------------------------
# applying an element (torch, transformers and the element's library are imported here, inside the functions)


def _stacked_model_class() -> type:
    import torch

    class StackedModel(torch.nn.Module):
        """``inner`` (the element's model: a PeftModel, a compiled module, the hooked model) called as a training
        loop calls it; logits of prepended virtual tokens (``strip`` of them) are cut, so logits and loss are the
        row's own ``(batch, tokens, vocab)``. ``base``: the transformers model under the element. ``element``: its
        :class:`StackElement`; ``detail``: what was applied (versions, settings), recorded in every cell."""

        def __init__(self, inner: Any, base: Any, element: StackElement, detail: dict[str, Any],
                     lift: Callable[[], contextlib.AbstractContextManager[Any]], strip: int = 0) -> None:
            super().__init__()
            self.inner = inner
            self.config = base.config
            self.element, self.detail, self.strip, self._lift = element, detail, strip, lift
            self._lifted = False
            self.__dict__["base"] = base  # not a submodule twice: its parameters are inner's

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = self.inner(*args, **kwargs)
            if self.strip and not self._lifted and getattr(out, "logits", None) is not None:
                out.logits = out.logits[:, self.strip:]
            return out

        @contextlib.contextmanager
        def lifted(self) -> Iterator[None]:
            """The same model without the element (adapter disabled, hooks removed, checkpointing off, uncompiled)."""
            with self._lift():
                self._lifted = True
                try:
                    yield
                finally:
                    self._lifted = False

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.__dict__["base"], name)

    return StackedModel


def stacked(inner: Any, base: Any, element: StackElement, detail: dict[str, Any],
            lift: Callable[[], contextlib.AbstractContextManager[Any]], strip: int = 0) -> Any:
    """A :class:`StackedModel` (built on first use; its ``forward`` takes what the base model's takes, so the
    workbench hands it the same keys)."""
    import inspect

    model = _stacked_model_class()(inner, base, element, detail, lift, strip)
    sig = inspect.signature(base.forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return type(model).forward(model, *args, **kwargs)

    forward.__signature__ = sig  # type: ignore[attr-defined]
    model.__dict__["forward"] = forward
    return model


def apply_element(model: Any, name: str, backend: str | None) -> Any:
    """``model`` with the element ``name`` applied (a :class:`StackedModel`), in eval mode.

    Raises:
        StackUnavailable: the element cannot run here (skipped: a package or device missing, named) or the library
            refuses this model (unsupported: its own message).
        KeyError: ``name`` is not an element (``--packcheck-stack`` validates names before any cell runs).
    """
    element = BY_NAME[name]
    why = availability(element)
    if why:
        raise StackUnavailable(why)
    out = globals()[element.apply](model, element, backend)
    out.eval()
    return out


def _versions(element: StackElement) -> dict[str, Any]:
    return {"element": element.name, "kind": element.kind,
            **({element.library: library_version(element)} if element.library else {})}


def apply_peft(model: Any, element: StackElement, backend: str | None) -> Any:
    """A PEFT adapter of :attr:`StackElement.name` on ``model`` (peft's own ``get_peft_model``, task CAUSAL_LM);
    LoRA / DoRA weights random (``init_lora_weights=False``), prompt-learning ones as peft initialises them.
    Lifted: ``PeftModel.disable_adapter()`` (peft/peft_model.py: the base forward for prompt learning)."""
    import peft
    import torch

    torch.manual_seed(0)
    name = element.name
    if name in ("lora", "dora"):
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear",
                                 init_lora_weights=False, use_dora=name == "dora")
    elif name == "prompt_tuning":
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=NUM_VIRTUAL_TOKENS)
    elif name == "p_tuning":
        config = peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=NUM_VIRTUAL_TOKENS, encoder_hidden_size=16)
    else:
        config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=NUM_VIRTUAL_TOKENS)
    try:
        inner = peft.get_peft_model(model, config)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise StackUnavailable(f"peft {peft.__version__} refuses {name} on {type(model).__name__}: "
                               f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", status="unsupported") from exc
    prepends = name in ("prompt_tuning", "p_tuning")
    detail = {**_versions(element), "peft_type": str(config.peft_type.value),
              **({"num_virtual_tokens": NUM_VIRTUAL_TOKENS} if name not in ("lora", "dora") else {"r": LORA_RANK})}
    return stacked(inner, model, element, detail, inner.disable_adapter, strip=NUM_VIRTUAL_TOKENS if prepends else 0)


def apply_checkpointing(model: Any, element: StackElement, backend: str | None) -> Any:
    """Gradient (activation) checkpointing on ``model``'s decoder layers, ``use_reentrant`` as the element says
    (transformers 5.24+: ``activation_checkpointing_enable``, before: ``gradient_checkpointing_enable``; active
    only in train mode with grad, so the forward-only checks run as without it). Lifted: disabled, then enabled."""
    reentrant = element.name.endswith("_reentrant")
    kwargs = {"use_reentrant": reentrant}

    def enable() -> None:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def disable() -> None:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise StackUnavailable(f"{type(model).__name__} does not support gradient checkpointing "
                               "(supports_gradient_checkpointing is False)", status="unsupported")
    enable()
    layers = checkpointed_layers(model)
    if not layers:  # enabled by name, applied nowhere: the cells would measure the bare model under its name
        raise StackUnavailable(f"{element.name}: enabling checkpointing on {type(model).__name__} set "
                               "gradient_checkpointing on no module: the element is not applied, nothing is measured "
                               "under its name", status="unsupported")

    @contextlib.contextmanager
    def lift() -> Iterator[None]:
        disable()
        try:
            yield
        finally:
            enable()

    return stacked(model, model, element, {**_versions(element), "use_reentrant": reentrant,
                                           "checkpointed_layers": layers}, lift)


def checkpointed_layers(model: Any) -> int:
    """How many modules of ``model`` checkpoint in training (``gradient_checkpointing`` True: transformers'
    ``GradientCheckpointingLayer``, ``modeling_layers.py``; or the pre-5.x models' own flag)."""
    return sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True)


def apply_compile(model: Any, element: StackElement, backend: str | None) -> Any:
    """``torch.compile(model, backend="aot_eager")`` (CPU: no inductor). Lifted: the module itself, uncompiled.
    The detail records dynamo's graph and graph-break counts as the cell ends (:func:`stack_record`)."""
    import torch

    compiled = torch.compile(model, backend="aot_eager")
    holder: dict[str, Any] = {}

    @contextlib.contextmanager
    def lift() -> Iterator[None]:
        out = holder["stacked"]
        out.inner = model
        try:
            yield
        finally:
            out.inner = compiled

    holder["stacked"] = out = stacked(compiled, model, element, {**_versions(element), "backend": "aot_eager",
                                                                    "torch": torch.__version__}, lift)
    return out


def apply_cp_hook(model: Any, element: StackElement, backend: str | None) -> Any:
    """accelerate's context-parallel hook on ``model`` (accelerate/big_modeling.py ``_attach_context_parallel_hooks``,
    1.16.0: ``module_kwargs["attention_mask"] = None; module_kwargs["is_causal"] = True`` on every ``*self_attn``).
    A model whose ``supports_context_parallel`` is False is refused by accelerate (unsupported, its message).
    Lifted: the hooks it added removed from each module's forward pre-hooks, then put back."""
    import accelerate
    from accelerate.big_modeling import _attach_context_parallel_hooks

    before = {n: set(m._forward_pre_hooks) for n, m in model.named_modules()}
    try:
        _attach_context_parallel_hooks(model)
    except ValueError as exc:
        raise StackUnavailable(f"accelerate {accelerate.__version__} refuses context parallelism on "
                               f"{type(model).__name__}: {' '.join(str(exc).split())[:220]}", status="unsupported") from exc
    added = {n: [(k, m._forward_pre_hooks[k], m._forward_pre_hooks_with_kwargs.get(k)) for k in m._forward_pre_hooks
                 if k not in before.get(n, set())] for n, m in model.named_modules()}
    added = {n: hooks for n, hooks in added.items() if hooks}
    if not added:  # the hook is said to be attached, and is on no module: nothing would be measured under cp
        raise StackUnavailable(f"accelerate {accelerate.__version__}'s _attach_context_parallel_hooks attached no hook to "
                               f"{type(model).__name__} (it hooks modules named *self_attn): the element is not "
                               "applied, nothing is measured under its name", status="unsupported")
    modules = dict(model.named_modules())

    @contextlib.contextmanager
    def lift() -> Iterator[None]:
        for n, hooks in added.items():
            for key, _, _ in hooks:
                modules[n]._forward_pre_hooks.pop(key, None)
        try:
            yield
        finally:
            for n, hooks in added.items():
                for key, hook, kw in hooks:
                    modules[n]._forward_pre_hooks[key] = hook
                    modules[n]._forward_pre_hooks.move_to_end(key, last=False)  # prepend=True, as accelerate adds it
                    if kw is not None:
                        modules[n]._forward_pre_hooks_with_kwargs[key] = kw

    detail = {**_versions(element), "hooked_modules": len(added), "sharding": "not run (needs >= 2 CUDA devices)"}
    return stacked(model, model, element, detail, lift)


def apply_liger(model: Any, element: StackElement, backend: str | None) -> Any:
    """Liger's kernels on ``model`` (``_apply_liger_kernel_to_instance``); where they do not import (no triton),
    skipped with the package named. Lifted: not possible in place (the patch swaps modules): the rerun is refused."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise StackUnavailable(f"stack element liger: liger-kernel does not import here ({type(exc).__name__}: {exc}); "
                               f"{element.cpu}") from exc
    _apply_liger_kernel_to_instance(model=model)

    @contextlib.contextmanager
    def lift() -> Iterator[None]:
        raise StackUnavailable("liger's patch cannot be lifted in place")
        yield

    return stacked(model, model, element, _versions(element), lift)


def stack_record(model: Any) -> dict[str, Any] | None:
    """What the cell's model ran with (the element, its library version, its settings; for compile, dynamo's
    unique graphs and graph breaks so far in this process), or None for a model without an element."""
    detail = getattr(model, "detail", None) if type(model).__name__ == "StackedModel" else None
    if detail is None:
        return None
    out = dict(detail)
    if detail.get("element") == "compile":
        from torch._dynamo.utils import counters

        out["unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
        out["graph_breaks"] = int(sum(counters["graph_break"].values()))
    return out
