"""The torch varlen backend (:data:`~.table.TORCH_VARLEN_BACKEND`): flash-attn's varlen call, as transformers makes
it, mapped onto PyTorch's own FlashAttention-2 varlen kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA only),
and the CPU stand-in with torch 2.11's signature that rehearses the GPU pipeline (:data:`~.table.STAND_IN_ENV`).
Heavy imports (torch) happen inside functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .contract import enforce_varlen_contract
from .kernels import _dense_as_varlen, varlen_reference_kernel
from .table import stand_in_active


def _torch_varlen_attn() -> Any:
    """PyTorch's varlen kernel, looked up at call time; :func:`varlen_attn_stand_in` when :data:`STAND_IN_ENV`
    is set."""
    if stand_in_active():
        return varlen_attn_stand_in
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_attn_stand_in(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Any, max_q: int, max_k: int, *,
                         return_aux: Any = None, scale: float | None = None, window_size: tuple[int, int] = (-1, -1)) -> Any:
    """CPU stand-in with the signature of torch 2.11.0's ``torch.nn.attention.varlen.varlen_attn`` (read from its
    wheel: no ``enable_gqa``, causal as ``window_size=(-1, 0)``), computing with :func:`varlen_reference_kernel`.

    Checks what the CUDA kernel requires and would otherwise misread: int32 cu_seq tensors, Python-int max
    lengths, equal q / k head counts (2.11 has no GQA), a ``(left, right)`` window.

    Raises:
        TypeError: max_q / max_k are not Python ints.
        ValueError: cu_seq tensors not int32 / not spanning the tokens; q and k head counts differ.
    """
    if type(max_q) is not int or type(max_k) is not int:
        raise TypeError(f"varlen_attn stand-in: max_q / max_k must be Python ints, got {type(max_q).__name__} / {type(max_k).__name__}")
    if query.shape[1] != key.shape[1]:
        raise ValueError(f"varlen_attn stand-in: torch 2.11's varlen_attn has no GQA: q has {query.shape[1]} heads, k {key.shape[1]}")
    left, right = window_size
    causal = right == 0
    out = varlen_reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                  window_size=(left, -1 if causal else right))
    return (out, None) if return_aux is not None else out


def build_torch_varlen_args(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
    softmax_scale: float | None, causal: bool, window_size: tuple[int, int] | None, params: set[str] | frozenset[str],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Map flash-attn's varlen call (as transformers makes it) onto ``varlen_attn``'s arguments.

    Rules: cu_seq lens must be int32 (flash-attn and varlen_attn read them as int32); max lengths become Python
    ints (a 0-d tensor forces a device sync and breaks torch.compile); flash-attn's ``causal`` + ``window_size``
    (left, right) become varlen_attn's ``window_size`` (-1, 0) / (left, 0) in torch >= 2.11, or ``is_causal``
    where the installed signature has it; GQA uses ``enable_gqa`` when available, else K/V heads are repeated.
    ``params`` is the set of parameter names of the installed varlen_attn.

    Raises:
        KernelArgumentError, FlashBoundariesError: the arguments break the varlen kernels' contract
            (:func:`enforce_varlen_contract`), checked per call before they are mapped.
    """
    enforce_varlen_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size=window_size)
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    kwargs: dict[str, Any] = {"scale": softmax_scale}
    left, right = window_size if window_size is not None else (-1, -1)
    if "is_causal" in params:
        kwargs["is_causal"] = bool(causal)
        if (left, right) != (-1, -1) and "window_size" in params:
            kwargs["window_size"] = (left, right)
    else:
        kwargs["window_size"] = (left if left is not None else -1, 0) if causal else (left, right)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k), kwargs


@functools.lru_cache(maxsize=8)
def _parameters(fn: Callable) -> frozenset[str]:
    """Parameter names of the installed varlen_attn, read once (not once per attention layer)."""
    return frozenset(inspect.signature(fn).parameters)


def torch_varlen_kernel(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Any:
    """``flash_attn_varlen_func`` signature over ``torch.nn.attention.varlen.varlen_attn`` (CUDA).

    q ``(total_q, heads, dim)``, k/v ``(total_k, kv_heads, dim)`` in bf16/fp16; returns ``(total_q, heads, dim)``.

    Raises:
        NotImplementedError: ``softcap`` > 0 (gemma2's logit softcapping): varlen_attn has none. The parameter is
            in the signature on purpose: transformers 5.17 drops a kwarg the kernel does not declare (the model
            would run unsoftcapped and pass), 5.24 refuses it; declared and refused, the cell is unsupported on
            both.
    """
    if softcap:
        raise NotImplementedError(f"torch varlen_attn does not support `softcap` (got {softcap}): this model's "
                                  "attention logit softcapping cannot run on packcheck_flash_torch_varlen")
    if dropout_p:
        raise ValueError(f"torch varlen kernel got dropout_p={dropout_p}: packcheck runs without dropout")
    fn = _torch_varlen_attn()
    params = _parameters(fn)
    args, kwargs = build_torch_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           softmax_scale, causal, window_size, params)
    out = fn(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def dense_torch_varlen_kernel(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              deterministic: bool = False) -> Any:
    """``flash_attn_func`` signature over :func:`torch_varlen_kernel` (not counted as a varlen call, as above)."""
    return _dense_as_varlen(torch_varlen_kernel, q, k, v, dropout_p, softmax_scale, causal,
                            window_size, softcap, deterministic)
