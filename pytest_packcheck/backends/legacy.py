"""The module-globals flash path of transformers 4.44 .. 4.55.0 (no kernel loader): flash-attn's functions are
module globals of ``modeling_flash_attention_utils``, imported only with flash-attn installed; packcheck binds its
CPU kernels there (and in the model's modules) for the duration of each forward (:func:`legacy_flash_globals`),
and answers transformers' flash-attn probes as flash-attn :data:`EMULATED_FLASH_ATTN` would, for a build only
(:func:`emulated_flash_attn_installed`). Heavy imports happen inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .kernels import dense_reference_kernel, varlen_reference_kernel

#: First transformers release whose flash path reads packed position_ids (``_flash_attention_forward(...,
#: position_ids)`` -> ``prepare_fa2_from_position_ids``), the release of DataCollatorWithFlattening.
REFERENCE_FLOOR = "4.44"

#: The flash-attn release the reference stands in for on transformers' module-globals flash path (4.44 ..
#: 4.55.0): the last whose ``unpad_input`` returns 4 values (4.44 - 4.48 unpack exactly 4; 2.7 returns 5), with
#: ``window_size`` (2.3), ``deterministic`` (2.4.1) and ``softcap`` (2.6).
EMULATED_FLASH_ATTN = "2.6.3"


def reference_index_first_axis(tensor: Any, indices: Any) -> Any:
    """``flash_attn.bert_padding.index_first_axis``: ``tensor`` ``(N, ...)`` -> ``tensor[indices]``."""
    return tensor.reshape(tensor.shape[0], *tensor.shape[1:])[indices]


def reference_unpad_input(hidden_states: Any, attention_mask: Any) -> tuple[Any, Any, Any, int]:
    """``flash_attn.bert_padding.unpad_input`` of flash-attn 2.6: ``hidden_states`` ``(batch, seqlen, ...)``,
    ``attention_mask`` ``(batch, seqlen)`` (1 = token) -> (tokens ``(nnz, ...)``, indices ``(nnz,)``, cu_seqlens
    int32 ``(batch + 1,)``, max_seqlen int)."""
    import torch
    import torch.nn.functional as F

    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max())


def reference_pad_input(hidden_states: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """``flash_attn.bert_padding.pad_input``: ``(nnz, ...)`` -> ``(batch, seqlen, ...)``, zeros where no token."""
    import torch

    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], device=hidden_states.device, dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


#: What stands in for flash-attn's functions on the module-globals path, by flash-attn name. A table (read at each
#: forward) so that :func:`count_attention_calls` can wrap the kernels before transformers' code sees them.
FLASH_ATTN_STAND_INS: dict[str, Callable] = {
    "flash_attn_func": dense_reference_kernel,
    "flash_attn_varlen_func": varlen_reference_kernel,
    "index_first_axis": reference_index_first_axis,
    "pad_input": reference_pad_input,
    "unpad_input": reference_unpad_input,
}
_FLASH_ATTN_SOURCES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.flash_attn_interface")
_AVAILABILITY_CHECKS = ("is_flash_attn_2_available", "is_flash_attn_greater_or_equal_2_10", "is_flash_attn_greater_or_equal")


def _emulated_availability() -> dict[str, Callable]:
    """transformers' flash-attn probes as they answer with flash-attn :data:`EMULATED_FLASH_ATTN` on a CUDA device."""
    from packaging.version import Version

    def is_flash_attn_2_available() -> bool:
        return True

    def is_flash_attn_greater_or_equal_2_10() -> bool:
        return True

    def is_flash_attn_greater_or_equal(library_version: str) -> bool:
        return Version(EMULATED_FLASH_ATTN) >= Version(library_version)

    return {"is_flash_attn_2_available": is_flash_attn_2_available,
            "is_flash_attn_greater_or_equal_2_10": is_flash_attn_greater_or_equal_2_10,
            "is_flash_attn_greater_or_equal": is_flash_attn_greater_or_equal}


@functools.cache
def _flash_conditional_imports(module_name: str) -> dict[str, tuple[str, str]]:
    """Names a module imports only under ``if is_flash_attn_2_available():`` (or ``is_flash_attn_available()``):
    ``{local name: (absolute source module, name)}``, read from its source with ast. Without flash-attn these
    names are missing (a NameError at the first flash call): packcheck binds them for the forward."""
    import ast
    import textwrap

    module = sys.modules.get(module_name)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module)))
    except (OSError, TypeError, SyntaxError):
        return {}
    package = module_name.rsplit(".", 1)[0]
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        tests = {getattr(n.func, "id", getattr(n.func, "attr", None)) for n in ast.walk(node.test) if isinstance(n, ast.Call)}
        if not tests & {"is_flash_attn_2_available", "is_flash_attn_available"}:
            continue
        for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
            if isinstance(sub, ast.ImportFrom):
                base = package.split(".")
                source = ".".join(base[: len(base) - sub.level + 1] + ([sub.module] if sub.module else [])) if sub.level else sub.module
                for alias in sub.names:
                    found[alias.asname or alias.name] = (source, alias.name)
    return found


class _ModuleGlobals:
    """Sets the names transformers' module-globals flash path reads, for the duration of a forward, and puts back
    what was there (re-entrant: nested forwards and gradient-checkpointing recomputations share one setting)."""

    def __init__(self) -> None:
        self.depth = 0
        self.saved: list[tuple[Any, str, bool, Any]] = []

    def bindings(self, module_names: tuple[str, ...]) -> list[tuple[Any, str, Any]]:
        import transformers.modeling_flash_attention_utils as mfu

        kernels = dict(FLASH_ATTN_STAND_INS)
        availability = _emulated_availability()
        out: list[tuple[Any, str, Any]] = []
        for name, (source, attr) in _flash_conditional_imports(mfu.__name__).items():
            if source in _FLASH_ATTN_SOURCES and attr in kernels:
                out.append((mfu, name, kernels[attr]))
        out.append((mfu, "_flash_supports_window_size", True))  # set in the same block (4.44 - 4.53)
        if hasattr(mfu, "_lazy_imports"):  # 4.54 - 4.55.0 cache the loaded kernels in module globals on first call
            out += [(mfu, "_flash_fn", kernels["flash_attn_func"]), (mfu, "_flash_varlen_fn", kernels["flash_attn_varlen_func"]),
                    (mfu, "_pad_fn", kernels["pad_input"]), (mfu, "_unpad_fn", kernels["unpad_input"]),
                    (mfu, "_is_fa3", False), (mfu, "_flash_supports_window", True)]
        out += [(mfu, name, fn) for name, fn in availability.items() if hasattr(mfu, name)]
        integration = sys.modules.get("transformers.integrations.flash_attention")
        if integration is not None and hasattr(integration, "_use_top_left_mask"):
            out.append((integration, "_use_top_left_mask", False))  # computed at import, without flash-attn (>= 2.1: False)
        for module_name in module_names:
            module = sys.modules.get(module_name)
            if module is None or module is mfu:
                continue
            for name, (source, attr) in _flash_conditional_imports(module_name).items():
                if source == mfu.__name__:  # the mfu name as mfu has it during the forward
                    value = _MFU_LATE.get(attr) or kernels.get(attr) or getattr(mfu, attr, None)
                    if value is not None:
                        out.append((module, name, value))
                elif source in _FLASH_ATTN_SOURCES and attr in kernels:
                    out.append((module, name, kernels[attr]))
        return out

    def enter(self, module_names: tuple[str, ...], extra: Callable[[], list[tuple[Any, str, Any]]] | None = None) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        try:
            for module, name, value in [*self.bindings(module_names), *(extra() if extra else [])]:
                self.saved.append((module, name, name in vars(module), vars(module).get(name)))
                setattr(module, name, value)
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth:
            return
        for module, name, had, value in reversed(self.saved):
            if had:
                setattr(module, name, value)
            else:
                delattr(module, name)
        self.saved.clear()


_LEGACY_GLOBALS = _ModuleGlobals()
#: mfu functions bound into model modules under another object than mfu's own attribute (the call counter's
#: wrapper of ``_flash_attention_forward`` while it counts)
_MFU_LATE: dict[str, Callable] = {}


@contextlib.contextmanager
def legacy_flash_globals(module_names: tuple[str, ...] = ()) -> Iterator[None]:
    """The module-globals flash path of transformers 4.44 .. 4.55.0 made runnable on any device for the block:
    ``modeling_flash_attention_utils``'s flash-attn globals (``flash_attn_func``, ``flash_attn_varlen_func``,
    ``pad_input``, ``unpad_input``, ``index_first_axis``, ``_flash_supports_window_size``; 4.54 - 4.55.0: the kernel
    cache ``_flash_fn`` ...) set to :data:`FLASH_ATTN_STAND_INS`, its flash-attn version probes answering as
    flash-attn :data:`EMULATED_FLASH_ATTN`, and the names each module in ``module_names`` imports only with
    flash-attn installed bound the same way. Everything is put back on exit, also on an exception."""
    _LEGACY_GLOBALS.enter(module_names)
    try:
        yield
    finally:
        _LEGACY_GLOBALS.exit()


@contextlib.contextmanager
def emulated_flash_attn_installed(config: Any = None) -> Iterator[None]:
    """For a model build only: transformers' availability probes (``is_flash_attn_2_available``,
    ``is_flash_attn_greater_or_equal_2_10``, ``is_flash_attn_greater_or_equal``) answer as with flash-attn
    :data:`EMULATED_FLASH_ATTN` installed on a CUDA device, in every loaded transformers module that imported them
    (``_check_and_enable_flash_attn_2`` / ``_flash_attn_2_can_dispatch``, the FlashAttention2 classes' top-left
    mask flag). ``transformers.utils`` keeps the real probes, so a module first imported inside the block
    runs its ``if is_flash_attn_2_available():`` imports as without flash-attn: ``config``'s model module is
    imported before the probes are patched. Restored on exit."""
    if config is not None:
        with contextlib.suppress(Exception):  # the model class's module; a failure shows again in the build itself
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM._model_mapping[type(config)]
    import transformers.utils.import_utils as iu

    originals = {name: getattr(iu, name) for name in _AVAILABILITY_CHECKS if hasattr(iu, name)}
    fakes = _emulated_availability()
    saved = []
    try:
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith("transformers.") or module_name.startswith("transformers.utils"):
                continue
            for name, original in originals.items():
                if vars(module).get(name) is original:
                    saved.append((module, name, original))
                    setattr(module, name, fakes[name])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)

