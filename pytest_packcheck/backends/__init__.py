"""Attention backends: the backend table, availability, the CPU varlen reference backend, and call counting.

Read :mod:`.table` first: one :class:`~.table.Backend` record per backend (name, label, family, who registers
it, what it needs to run, backward on CPU, bench order, whether it takes a mask, how its calls are counted), and
every list derived from it. Then, by the flow of a cell:

- :mod:`.availability`: can it run here, and the reason a skipped cell shows;
- :mod:`.registration`: packcheck's two varlen backends registered with transformers (:mod:`.legacy`: the
  module-globals flash path of transformers 4.44 .. 4.55.0);
- :mod:`.kernels` (the CPU reference kernel), :mod:`.torch_varlen` (PyTorch's varlen_attn), both checked against
  :mod:`.contract` (the varlen kernels' argument contract, with the flash-attn source lines);
- :mod:`.counting`: which backend each attention call ran on, and whether the boundaries reached it.

The reference backend (``packcheck_flash_ref``) is registered through transformers' ``AttentionInterface``
and calls transformers' own ``flash_attention_forward`` -> ``_flash_attention_forward``, so the code that
turns ``position_ids`` / ``cu_seq_lens_q`` / ``attention_mask`` into varlen boundaries is the real one
(``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids``, ``_upad_input``,
``_process_flash_attention_kwargs``). Only the kernel is replaced: :func:`varlen_reference_kernel` computes
each segment exactly (fp32 softmax) on any device. It is a reference, never FlashAttention-2; the matrix
labels it so. On transformers 4.44 .. 4.55.0, which have no kernel loader, the model runs as
``flash_attention_2`` and flash-attn's module globals are packcheck's kernels for the duration of each forward
(:func:`legacy_flash_globals`, :func:`prepare_backend_model`).

Heavy imports (torch, transformers) happen inside functions, and every module but :mod:`.table` is imported on first
use of one of its names (:data:`_LAZY`): importing this package costs the table only.
"""

from __future__ import annotations

from typing import Any

from .table import (
    BACKEND_LABELS,
    BACKENDS,
    BENCH_BACKEND_PREFERENCE,
    BY_NAME,
    CPU_BACKENDS,
    DEFAULT_BACKENDS,
    FLASH_FAMILY,
    KNOWN_BACKENDS,
    MASKED_BACKENDS,
    PACKCHECK_REGISTERED,
    REFERENCE_BACKEND,
    STAND_IN_ENV,
    STAND_IN_LABEL,
    TORCH_VARLEN_BACKEND,
    Backend,
    Need,
    backend_labels,
    backends_help,
    is_call_on,
    needs_registration,
    stand_in_active,
)

__all__ = [
    "BACKENDS", "BACKEND_LABELS", "BENCH_BACKEND_PREFERENCE", "BY_NAME", "CPU_BACKENDS", "DEFAULT_BACKENDS",
    "EMULATED_FLASH_ATTN", "FLASH_ATTN_STAND_INS", "FLASH_FAMILY", "KNOWN_BACKENDS", "MASKED_BACKENDS",
    "PACKCHECK_BACKEND_ATTR", "PACKCHECK_REGISTERED", "REFERENCE_BACKEND", "REFERENCE_FLOOR", "STAND_IN_ENV",
    "STAND_IN_LABEL", "TORCH_VARLEN_BACKEND", "VARLEN_CONTRACT", "AttentionCall", "AttentionProbe", "Backend",
    "BackendAvailability", "FlashBoundariesError", "KernelArgumentError", "Need", "_ModuleGlobals", "_dense_as_varlen",
    "_flash_conditional_imports", "attn_implementation_refusal", "backend_availability", "backend_build",
    "backend_labels", "backends_help", "build_attn_implementation", "build_torch_varlen_args", "count_attention_calls",
    "cuda_capability", "dense_reference_kernel", "dense_torch_varlen_kernel", "effective_attn_implementation",
    "emulated_flash_attn_installed", "enforce_varlen_contract", "ensure_registered", "is_call_on",
    "legacy_flash_globals", "needs_registration", "prepare_backend_model", "reference_backend_supported",
    "reference_index_first_axis", "reference_mode", "reference_pad_input", "reference_unpad_input",
    "register_reference_backend", "sink_softmax", "stand_in_active", "torch_varlen_kernel", "varlen_argument_contract",
    "varlen_attn_stand_in", "varlen_reference_kernel",
]

#: every other name, by module: imported on first use (``lookup`` reads the table only; the kernels, counting and
#: registration modules stay unimported until a cell needs them)
_LAZY = {
    "BackendAvailability": "availability",
    "attn_implementation_refusal": "availability",
    "backend_availability": "availability",
    "cuda_capability": "availability",
    "VARLEN_CONTRACT": "contract",
    "FlashBoundariesError": "contract",
    "KernelArgumentError": "contract",
    "enforce_varlen_contract": "contract",
    "varlen_argument_contract": "contract",
    "AttentionCall": "counting",
    "AttentionProbe": "counting",
    "count_attention_calls": "counting",
    "_dense_as_varlen": "kernels",
    "dense_reference_kernel": "kernels",
    "sink_softmax": "kernels",
    "varlen_reference_kernel": "kernels",
    "EMULATED_FLASH_ATTN": "legacy",
    "FLASH_ATTN_STAND_INS": "legacy",
    "REFERENCE_FLOOR": "legacy",
    "_flash_conditional_imports": "legacy",
    "_ModuleGlobals": "legacy",
    "emulated_flash_attn_installed": "legacy",
    "legacy_flash_globals": "legacy",
    "reference_index_first_axis": "legacy",
    "reference_pad_input": "legacy",
    "reference_unpad_input": "legacy",
    "PACKCHECK_BACKEND_ATTR": "registration",
    "backend_build": "registration",
    "build_attn_implementation": "registration",
    "effective_attn_implementation": "registration",
    "ensure_registered": "registration",
    "prepare_backend_model": "registration",
    "reference_backend_supported": "registration",
    "reference_mode": "registration",
    "register_reference_backend": "registration",
    "build_torch_varlen_args": "torch_varlen",
    "dense_torch_varlen_kernel": "torch_varlen",
    "torch_varlen_kernel": "torch_varlen",
    "varlen_attn_stand_in": "torch_varlen",
}
_SUBMODULES = frozenset({"availability", "contract", "counting", "kernels", "legacy", "registration", "table", "torch_varlen"})


def __getattr__(name: str) -> Any:
    """``backends.count_attention_calls``, ``backends.availability`` (a submodule), ...: imported on first use, so
    importing the package costs the table only."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later reads are plain attribute reads
    return value
