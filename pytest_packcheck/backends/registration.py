"""Registration: how packcheck's varlen backends (the table's ``registered_by="packcheck"`` records) reach the
installed transformers' flash path. 4.55.1+: registered through ``AttentionInterface`` with kernels returned by a
wrapped kernel loader (:func:`register_reference_backend`); 4.44 .. 4.55.0: the model is built as
``flash_attention_2`` and the module globals are set per forward (:mod:`.legacy`, :func:`backend_build`,
:func:`prepare_backend_model`). Heavy imports happen inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from .legacy import _LEGACY_GLOBALS, REFERENCE_FLOOR, _flash_conditional_imports, emulated_flash_attn_installed
from .table import BACKENDS, PACKCHECK_REGISTERED, REFERENCE_BACKEND, needs_registration


def reference_mode() -> str | None:
    """How the reference reaches the installed transformers' flash path: ``"loader"`` (4.55.1+: the kernel
    loader ``_lazy_imports`` / ``lazy_import_flash_attention``, routed per attn_implementation name through
    ``AttentionInterface``), ``"module_globals"`` (4.44 .. 4.55.0: flash-attn's functions are module globals of
    ``modeling_flash_attention_utils`` and the model runs as ``flash_attention_2``), None when unsupported
    (:func:`reference_backend_supported` says why)."""
    return _reference_support()[0]


def reference_backend_supported() -> tuple[bool, str]:
    """Feature-detect what the reference backend needs from transformers.

    4.55.1+: AttentionInterface and the flash kernel loader ``modeling_flash_attention_utils._lazy_imports`` /
    ``lazy_import_flash_attention``. 4.44 .. 4.55.0 (no loader, bisected: 4.55.0 lacks it): flash-attn's
    functions are module globals of ``modeling_flash_attention_utils``, imported only when flash-attn is
    installed (4.54 - 4.55.0 cache them in ``_flash_fn`` / ``_flash_varlen_fn`` ... on the first call); packcheck
    sets those globals to its CPU kernels for the duration of each forward (:func:`legacy_flash_globals`).
    Before 4.44 the flash path has no padding-free support (no ``position_ids``) and is not emulated.
    """
    mode, why = _reference_support()
    return mode is not None, why


@functools.cache
def _reference_support() -> tuple[str | None, str]:
    import transformers
    from packaging.version import Version

    version = transformers.__version__
    try:
        import transformers.modeling_flash_attention_utils as mfu
    except ImportError as exc:
        return None, f"transformers {version} has no flash attention path (modeling_flash_attention_utils: {exc})"
    if all(hasattr(mfu, n) for n in ("_lazy_imports", "lazy_import_flash_attention", "_pad_input", "_unpad_input")):
        try:
            from transformers import AttentionInterface  # noqa: F401
            from transformers.integrations import flash_attention  # noqa: F401
        except ImportError as exc:
            return None, f"transformers {version} lacks the attention interface the reference backend needs ({exc})"
        if _kernel_tuple_arity(mfu) is None:
            return None, f"transformers {version}: unknown _lazy_imports return layout"
        return "loader", ""
    forward = getattr(mfu, "_flash_attention_forward", None)
    if Version(version).release < (4, 44) or forward is None or "position_ids" not in inspect.signature(forward).parameters:
        return None, (f"transformers {version} is older than {REFERENCE_FLOOR}, the first release whose flash path reads "
                      "packed position_ids (padding-free): packcheck's varlen reference does not emulate flash-attn there")
    if not hasattr(mfu, "_lazy_imports") and not _flash_conditional_imports(mfu.__name__):
        return None, (f"transformers {version}: modeling_flash_attention_utils imports no flash-attn functions under "
                      "is_flash_attn_2_available() and has no kernel loader: unknown flash kernel layout")
    return "module_globals", ""


#: attribute packcheck sets on a model whose ``config._attn_implementation`` says flash_attention_2 but whose flash
#: kernels are packcheck's (the reference on the module-globals path): the backend it really runs
PACKCHECK_BACKEND_ATTR = "_packcheck_attn_implementation"


def build_attn_implementation(name: str) -> str:
    """The ``attn_implementation`` to build a model with for the backend ``name``: ``flash_attention_2`` for the
    reference on transformers 4.44 .. 4.55.0 (models there pick their flash path, masks included, by that exact
    string: ``config._attn_implementation == "flash_attention_2"``), else ``name``."""
    return "flash_attention_2" if name == REFERENCE_BACKEND and reference_mode() == "module_globals" else name


@contextlib.contextmanager
def backend_build(name: str, config: Any = None) -> Iterator[str]:
    """Build a model for backend ``name`` inside this block, with the ``attn_implementation`` it yields; then
    hand the model to :func:`prepare_backend_model`."""
    attn = build_attn_implementation(name)
    if attn != name:
        with emulated_flash_attn_installed(config):
            yield attn
    else:
        yield attn


def prepare_backend_model(model: Any, name: str) -> Any:
    """After :func:`backend_build`: for the reference on the module-globals path, mark the model and bind
    :func:`legacy_flash_globals` around its forward and each attention module's (gradient checkpointing recomputes
    those outside the model's forward). Returns ``model``."""
    if build_attn_implementation(name) == name:
        return model
    import torch

    modules = tuple(sorted({type(m).__module__ for m in model.modules()}))
    configs = list({id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}.values())

    def fp32_cast_target() -> list[tuple[Any, str, Any]]:
        # transformers' flash path picks the half dtype to cast fp32 inputs to from the first nn.Linear (a
        # StopIteration for gpt2's Conv1D) unless the config names a quantization dtype; real FA2 runs in bf16 /
        # fp16 and never asks. The reference is exact in fp32: the config names fp32 for the forward (no cast).
        if next(model.parameters()).dtype != torch.float32:
            return []
        return [(c, "_pre_quantization_dtype", torch.float32) for c in configs if not hasattr(c, "_pre_quantization_dtype")]

    def enter(module: Any, args: Any) -> None:
        _LEGACY_GLOBALS.enter(modules, fp32_cast_target)

    def leave(module: Any, args: Any, output: Any) -> None:
        _LEGACY_GLOBALS.exit()

    setattr(model, PACKCHECK_BACKEND_ATTR, name)
    for module in model.modules():
        if module is model or "Attention" in type(module).__name__:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)
    return model


def effective_attn_implementation(model: Any) -> str | None:
    """The backend ``model`` runs: its ``config._attn_implementation``, or the packcheck backend it was built for
    when that one runs under transformers' ``flash_attention_2`` name (the reference on 4.44 .. 4.55.0)."""
    effective = getattr(getattr(model, "config", None), "_attn_implementation", None)
    marked = getattr(model, PACKCHECK_BACKEND_ATTR, None)
    return marked if marked and effective == "flash_attention_2" else effective


def _kernel_tuple_arity(mfu: Any) -> int | None:
    """How many kernels ``lazy_import_flash_attention`` unpacks from ``_lazy_imports``: 4 in 4.56 (func, varlen,
    pad, unpad), 5 from 5.x (func, varlen, with_kvcache, pad, unpad). Read from its source with ast."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(mfu.lazy_import_flash_attention)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "_lazy_imports" and isinstance(node.targets[0], ast.Tuple)):
            return len(node.targets[0].elts)
    return None


_REGISTERED = False
#: [name of the packcheck varlen backend running now, name of the last one that ran]
_ACTIVE: list[str | None] = [None, None]


def _forget_loaded_kernels(mfu: Any) -> None:
    for name in ("_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn"):
        if hasattr(mfu, name):
            setattr(mfu, name, None)


def register_reference_backend() -> None:
    """Register :data:`REFERENCE_BACKEND` with transformers (idempotent).

    Wraps ``modeling_flash_attention_utils._lazy_imports`` (the kernel loader) so that, for this implementation
    name only, it returns the reference kernels with transformers' own pad/unpad helpers; the caching and the
    kwargs processing in ``lazy_import_flash_attention`` stay transformers' own. Every other name goes to the
    original loader.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    ok, why = reference_backend_supported()
    if not ok:
        raise RuntimeError(why)
    if reference_mode() == "module_globals":
        return  # nothing to register: the model runs as flash_attention_2 (backend_build / prepare_backend_model)
    import torch
    import transformers.modeling_flash_attention_utils as mfu
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    except ImportError:  # before 4.53 each model builds its own mask; the flash path ignores it when None
        ALL_MASK_ATTENTION_FUNCTIONS = flash_attention_mask = None

    original = mfu._lazy_imports
    with_kvcache = (None,) if _kernel_tuple_arity(mfu) == 5 else ()
    forget_on_switch = not with_kvcache  # 4.56 keeps the first kernels it loaded; 5.x keys them by name
    # every flash-family backend packcheck registers, with the kernels its table record names
    kernels = {b.name: (*b.kernel_functions(), *with_kvcache, mfu._pad_input, mfu._unpad_input)
               for b in BACKENDS if b.registered_by == "packcheck" and b.kernels}

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in kernels:
            return kernels[implementation]
        if implementation is None and _ACTIVE[0] in kernels:
            # 4.56 asks with implementation=None (its flash_attention_forward passes the name under another
            # keyword); packcheck_flash_ref below says which of ours is running.
            return kernels[_ACTIVE[0]]
        return original(implementation, *args, **kwargs)

    _lazy_imports.__wrapped__ = original  # type: ignore[attr-defined]
    mfu._lazy_imports = _lazy_imports

    def packcheck_flash_ref(module, query, key, value, attention_mask, **kwargs):
        name = getattr(getattr(module, "config", None), "_attn_implementation", REFERENCE_BACKEND)
        if forget_on_switch and _ACTIVE[1] is not None and _ACTIVE[1] != name:
            _forget_loaded_kernels(mfu)  # 4.56 caches the first kernels it loaded, whatever the name
        _ACTIVE[0] = _ACTIVE[1] = name
        # 4.x picks the fp32 cast target inline: the first nn.Linear's dtype, a StopIteration for gpt2 / opt-style
        # Conv1D models; a quantization dtype on the config short-cuts that (restored right after the call)
        config = getattr(module, "config", None)
        shortcut = (original_target_dtype is None and name == REFERENCE_BACKEND and config is not None
                    and query.dtype == torch.float32 and not hasattr(config, "_pre_quantization_dtype"))
        if shortcut:
            config._pre_quantization_dtype = torch.float32
        try:
            return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)
        finally:
            _ACTIVE[0] = None
            if shortcut:
                del config._pre_quantization_dtype

    # flash_attention_forward asks get_target_dtype for the half dtype to cast fp32 inputs to, because real
    # flash kernels take fp16/bf16 only. The reference kernel is exact in fp32, so no cast: this also avoids a
    # StopIteration in 5.24 for models without nn.Linear (gpt2's Conv1D), a path real FA2 (bf16) never takes.
    import transformers.integrations.flash_attention as fa_integration

    original_target_dtype = getattr(fa_integration, "get_target_dtype", None)  # 5.x; 4.x computes it inline

    def get_target_dtype(query, module):
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == REFERENCE_BACKEND:  # not torch varlen: it needs bf16/fp16
            return None
        return original_target_dtype(query, module)

    if original_target_dtype is not None:
        fa_integration.get_target_dtype = get_target_dtype

    for name in PACKCHECK_REGISTERED:
        AttentionInterface.register(name, packcheck_flash_ref)
        if ALL_MASK_ATTENTION_FUNCTIONS is not None:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    _REGISTERED = True


def ensure_registered(name: str) -> None:
    """Register ``name`` with transformers when packcheck provides it (its record's ``registered_by`` is
    "packcheck"); nothing for transformers' own backends. Call before building a model on ``name``.

    Raises:
        RuntimeError: the installed transformers cannot host packcheck's backends (the reason).
    """
    if needs_registration(name):
        register_reference_backend()


@contextlib.contextmanager
def standing_in(name: str) -> Iterator[None]:
    """packcheck's CPU varlen reference behind transformers' attention name ``name`` (``flash_attention_2``,
    ``kernels-community/flash-attn2``, ...) for the duration: a model whose ``config._attn_implementation`` is
    ``name`` then runs transformers' real flash path (``flash_attention_forward``, the mask skipped as
    ``flash_attention_mask`` does, the boundaries from position_ids / cu_seq_lens_q) on the exact reference
    kernel, so every decision made by the *name* (``is_flash_attention_requested``: "flash" in the name; a
    trainer's list of names) is taken as on a GPU. transformers >= 4.55.1 (registration through
    ``AttentionInterface``); the attention and mask registries and the kernel loader are restored on exit.

    Raises:
        RuntimeError: the installed transformers cannot host the reference (:func:`reference_backend_supported`).
    """
    if reference_mode() == "module_globals":
        raise RuntimeError("standing_in needs transformers >= 4.55.1 (AttentionInterface registration)")
    register_reference_backend()
    import transformers.modeling_flash_attention_utils as mfu
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    missing = object()
    attn, masks = ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved = (attn.get(name, missing), masks.get(name, missing), mfu._lazy_imports)
    loader = mfu._lazy_imports

    def _lazy_imports(implementation: Any, *args: Any, **kwargs: Any) -> Any:
        return loader(REFERENCE_BACKEND if implementation == name else implementation, *args, **kwargs)

    attn[name], masks[name], mfu._lazy_imports = attn[REFERENCE_BACKEND], flash_attention_mask, _lazy_imports
    if hasattr(mfu, "_loaded_implementation"):
        mfu._loaded_implementation = None  # 5.x caches the kernels by name: load them for this name
    try:
        yield
    finally:
        for registry, value in ((attn, saved[0]), (masks, saved[1])):
            if value is missing:
                registry.pop(name, None)
            else:
                registry[name] = value
        mfu._lazy_imports = saved[2]
        if hasattr(mfu, "_loaded_implementation"):
            mfu._loaded_implementation = None
