"""Attention backends: availability, the CPU varlen reference backend, and call counting.

The reference backend (``packcheck_flash_ref``) is registered through transformers' ``AttentionInterface``
and calls transformers' own ``flash_attention_forward`` -> ``_flash_attention_forward``, so the code that
turns ``position_ids`` / ``cu_seq_lens_q`` / ``attention_mask`` into varlen boundaries is the real one
(``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids``, ``_upad_input``,
``_process_flash_attention_kwargs``). Only the kernel is replaced: :func:`varlen_reference_kernel` computes
each segment exactly (fp32 softmax) on any device. It is a reference, never FlashAttention-2; the matrix
labels it so. On transformers 4.44 .. 4.55.0, which have no kernel loader, the model runs as
``flash_attention_2`` and flash-attn's module globals are packcheck's kernels for the duration of each forward
(:func:`legacy_flash_globals`, :func:`prepare_backend_model`).

Heavy imports (torch, transformers) happen inside functions: importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: attn_implementation name of the CPU varlen reference backend. It contains "flash" on purpose: transformers
#: treats any name with "flash" as a flash backend (``is_flash_attention_requested``), so models take exactly
#: the code path they take under FlashAttention-2 (no 4D mask, position_ids handed to attention).
REFERENCE_BACKEND = "packcheck_flash_ref"

#: attn_implementation name of the backend that runs PyTorch's own FlashAttention-2 varlen kernel
#: (``torch.nn.attention.varlen.varlen_attn``, CUDA only) behind transformers' flash preparation code.
TORCH_VARLEN_BACKEND = "packcheck_flash_torch_varlen"

#: Backends packcheck knows, in matrix column order.
KNOWN_BACKENDS = ("eager", "sdpa", "flex_attention", REFERENCE_BACKEND, TORCH_VARLEN_BACKEND, "flash_attention_2",
                  "flash_attention_3")
_VARLEN_BACKENDS = (REFERENCE_BACKEND, TORCH_VARLEN_BACKEND)
#: Backends that run through transformers' ``_flash_attention_forward``: a packed row must reach their varlen
#: kernel once per attention layer and never their dense one.
FLASH_FAMILY = ("flash_attention_2", "flash_attention_3", "flash_attention_4", *_VARLEN_BACKENDS)

#: Environment variable: set to 1 to run :data:`TORCH_VARLEN_BACKEND` on CPU through
#: :func:`varlen_attn_stand_in` (torch 2.11's varlen_attn signature over the exact reference kernel). A
#: rehearsal of the GPU pipeline (scripts/gpu_check.sh) that exercises every line but PyTorch's kernel; the
#: environment and the matrix label say so, and no speed or numerics claim comes from it.
STAND_IN_ENV = "PACKCHECK_TORCH_VARLEN_STAND_IN"
STAND_IN_LABEL = "torch varlen_attn CPU STAND-IN (rehearsal, not FA2)"

BACKEND_LABELS = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flex_attention": "flex_attention",
    REFERENCE_BACKEND: "varlen reference (CPU, not FA2)",
    TORCH_VARLEN_BACKEND: "torch varlen_attn (PyTorch FA2 kernel)",
    "flash_attention_2": "flash_attention_2",
    "flash_attention_3": "flash_attention_3",
}


@dataclass(frozen=True)
class BackendAvailability:
    """Whether a backend can run here, whether it has a backward pass, and why not."""

    name: str
    available: bool
    reason: str = ""
    backward: bool = True
    backward_reason: str = ""
    #: verdict of its cells when not available: "skipped" (this machine lacks something) or "unsupported"
    #: (the installed transformers cannot express it)
    status: str = "skipped"


def stand_in_active() -> bool:
    """Whether :data:`STAND_IN_ENV` is set to 1 in this process."""
    import os

    return os.environ.get(STAND_IN_ENV) == "1"


def backend_labels(env: dict[str, Any] | None = None) -> dict[str, str]:
    """Matrix column labels; the torch varlen column is labelled a stand-in when ``env`` (a results document's
    environment) records that the stand-in ran."""
    labels = dict(BACKEND_LABELS)
    if (env or {}).get("torch_varlen_kernel") == "stand-in":
        labels[TORCH_VARLEN_BACKEND] = STAND_IN_LABEL
    return labels


def backend_availability(name: str, device: str = "cpu") -> BackendAvailability:
    """Tell whether ``name`` can run on ``device`` with the installed libraries.

    flash_attention_2 needs CUDA and the ``flash_attn`` package; flash_attention_3 needs a Hopper GPU (compute
    capability 9.x) and ``flash_attn_interface`` (the flash-attn-3 build, as transformers' ``is_flash_attn_3_available``
    looks for it); flex_attention has no backward on CPU
    (torch raises NotImplementedError, measured on torch 2.13.0+cpu).
    """
    if name in ("flash_attention_2", "flash_attention_3"):
        missing = []
        if not device.startswith("cuda"):
            missing.append(f"a CUDA device (running on {device})")
        elif name == "flash_attention_3" and (capability := cuda_capability(device))[0] != 9:
            missing.append("a Hopper GPU (compute capability 9.x; this one is {}.{})".format(*capability))
        module, package = {"flash_attention_2": ("flash_attn", "the flash-attn package"),
                           "flash_attention_3": ("flash_attn_interface", "the flash-attn-3 package")}[name]
        if importlib.util.find_spec(module) is None:
            missing.append(f"{package} ({module} not importable)")
        elif name == "flash_attention_3" and not _distributed_as(module, "flash-attn-3"):
            # transformers' is_flash_attn_3_available also requires the distribution's name (FA2/FA4 builds
            # can ship a flash_attn_interface module too)
            missing.append("the flash-attn-3 package (flash_attn_interface is installed by another distribution)")
        return _needs(name, missing)
    if name == "flex_attention" and not device.startswith("cuda"):
        return BackendAvailability(
            name, True, backward=False, backward_reason="flex_attention has no backward pass on CPU (forward-only)"
        )
    if name == REFERENCE_BACKEND:
        ok, why = reference_backend_supported()
        return BackendAvailability(name, ok, why, status="unsupported")
    if name == TORCH_VARLEN_BACKEND:
        missing = []
        if not device.startswith("cuda") and not stand_in_active():
            missing.append(f"a CUDA device (running on {device}): varlen_attn is CUDA-only")
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            missing.append("torch.nn.attention.varlen (PyTorch >= 2.10)")
        ok, why = reference_backend_supported()
        if not ok:
            missing.append(why)
        elif reference_mode() != "loader":
            missing.append(f"transformers >= 4.55.1 (its flash kernel loader; {_transformers_version()} keeps flash-attn's "
                           "functions as module globals, which packcheck routes to its CPU reference only)")
        return _needs(name, missing)
    if name not in KNOWN_BACKENDS:  # any other name transformers takes: run it, or skip with transformers' reason
        refusal = attn_implementation_refusal(name)
        if refusal is not None:
            return BackendAvailability(name, False, f"is refused by transformers here: {refusal[1]}", status="skipped")
    return BackendAvailability(name, True)


#: The start of transformers' refusal of a name it does not know at all (5.x ``get_correct_attn_implementation``)
_UNKNOWN_ATTN = "is not supported. The only possible arguments are"


@functools.cache
def attn_implementation_refusal(name: str) -> tuple[str, str] | None:
    """How the installed transformers takes ``attn_implementation=name`` (a registry name, a kernel-hub repo,
    ``paged|sdpa``): None when a tiny llama builds with it (on the meta device, no memory); ("unknown", its
    message) when transformers does not know the name (a typo: a usage error); ("refused", its message) when it
    knows the name but cannot load it here (``kernels`` not installed, flash-attn missing): cells are skipped with
    that reason."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, attn_implementation=name)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal is the answer
        text = " ".join(str(exc).split())
        return ("unknown" if _UNKNOWN_ATTN in text else "refused", f"{type(exc).__name__}: {text[:300]}")
    return None


def _distributed_as(module: str, distribution: str) -> bool:
    from importlib.metadata import packages_distributions

    return distribution in {d.replace("_", "-").lower() for d in packages_distributions().get(module, [])}


def _needs(name: str, missing: list[str]) -> BackendAvailability:
    return BackendAvailability(name, not missing, "needs " + " and ".join(missing) if missing else "")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def cuda_capability(device: str) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of ``device`` (e.g. ``(9, 0)`` on H100 / H200)."""
    import torch

    return torch.cuda.get_device_capability(torch.device(device))


# --------------------------------------------------------------------------------------------------------------
# The reference varlen kernel


def varlen_reference_kernel(
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
    s_aux: Any = None,
) -> Any:
    """Exact per-segment attention with the signature of ``flash_attn.flash_attn_varlen_func``.

    Args:
        q: ``(total_q, num_heads, head_dim)``; k, v: ``(total_k, num_kv_heads, head_dim)``, any float dtype.
        cu_seqlens_q, cu_seqlens_k: int32 ``(num_segments + 1,)``, starting at 0, ending at total tokens.
        max_seqlen_q, max_seqlen_k: ints (unused by the computation), validated: each >= its longest segment.
        causal: bottom-right aligned causal mask, as in flash-attn >= 2.1.
        window_size: ``(left, right)`` in tokens, -1 meaning unbounded (flash-attn convention).
        softcap: ``softcap * tanh(scores / softcap)`` before the softmax when > 0 (gemma2).
        s_aux: attention sinks, float ``(num_heads,)`` logits, one per query head (GPT-OSS's ``sinks``, passed by
            transformers' flash path as ``s_aux`` when the kernel's signature names it, as vllm's FA3 does:
            ``modeling_flash_attention_utils._process_flash_attention_kwargs``, 5.x). Each head's softmax runs
            over its scores plus the sink logit, and the sink's share is dropped (:func:`sink_softmax`), exactly as
            ``modeling_gpt_oss.eager_attention_forward``. None: no sink.

    Returns:
        ``(total_q, num_heads, head_dim)`` in q's dtype. Softmax runs in float32.

    Raises:
        KernelArgumentError: cu_seqlens not int32 or not 1-D of one length; max_seqlen_q / max_seqlen_k below
            the longest segment; a zero-length segment with max_seqlen_q == 1 under GQA (FA2's swapped path).
        FlashBoundariesError: cu_seqlens that do not start at 0, decrease or do not end at the token count.
            Both are the contract violations the CUDA kernels reject or silently misread
            (:data:`VARLEN_CONTRACT`, with the flash-attn 2.8.3 / flash-attn-4 source lines); a 0-d tensor
            max_seqlen, which FA2 takes and FA4 does not, is recorded by the call counter, not raised.
    """
    import torch

    enforce_varlen_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size=window_size)
    if dropout_p:
        raise ValueError(f"varlen reference kernel got dropout_p={dropout_p}: packcheck runs without dropout")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    n_rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1).float()  # (H, Lq, D)
        ki = k[ks:ke].transpose(0, 1).float().repeat_interleave(n_rep, dim=0)
        vi = v[ks:ke].transpose(0, 1).float().repeat_interleave(n_rep, dim=0)
        scores = torch.matmul(qi, ki.transpose(-1, -2)) * scale
        if softcap and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        lq, lk = qe - qs, ke - ks
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right alignment
        cols = torch.arange(lk, device=q.device)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= cols <= rows
        left, right = window_size if window_size is not None else (-1, -1)
        if left is not None and left >= 0:
            allowed &= cols >= rows - left
        if right is not None and right >= 0:
            allowed &= cols <= rows + right
        # a query with no key it may see (bottom-right causal with fewer keys than queries: gemma3n's KV-shared
        # sliding layers on a padded batch) gets output 0, as in flash-attn, and a zero gradient: a softmax over
        # all -inf would be NaN, and nan_to_num keeps the NaN in the backward pass
        empty = ~allowed.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
        probs = (torch.softmax(scores, dim=-1) if s_aux is None else sink_softmax(scores, s_aux)).masked_fill(empty, 0.0)
        out[qs:qe] = torch.matmul(probs, vi).transpose(0, 1).to(q.dtype)
    return out


def sink_softmax(scores: Any, s_aux: Any) -> Any:
    """Softmax over the last axis of ``scores`` float32 ``(num_heads, Lq, Lk)`` with one extra sink logit per head,
    ``s_aux`` ``(num_heads,)``, whose probability is dropped: ``exp(s_j) / (sum_k exp(s_k) + exp(s_aux[h]))``. The
    rows then sum to less than 1 (what the sink absorbed). Masked scores (-inf) get 0."""
    import torch

    sink = s_aux.float().reshape(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _dense_as_varlen(varlen: Callable, q: Any, k: Any, v: Any, *args: Any) -> Any:
    """Run a ``flash_attn_func``-style call (q ``(batch, seqlen, heads, dim)``) through a varlen kernel, each batch
    row being one segment; ``args`` are the varlen kernel's arguments after max_seqlen_k."""
    import torch

    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * lk, lk, dtype=torch.int32, device=q.device)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    return varlen(*flat, cu_q, cu_k, lq, lk, *args).reshape(b, lq, *q.shape[2:])


def dense_reference_kernel(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                           causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           deterministic: bool = False, s_aux: Any = None) -> Any:
    """``flash_attn_func`` signature over :func:`varlen_reference_kernel` (the call counter wraps the kernels
    transformers' loader returns, so this inner varlen call is never counted as one); ``s_aux``: attention sinks."""
    return _dense_as_varlen(varlen_reference_kernel, q, k, v, dropout_p, softmax_scale, causal,
                            window_size, softcap, deterministic, s_aux)


class FlashBoundariesError(ValueError):
    """The model's flash path handed the varlen kernel boundaries that do not fit its tokens (``cu_seqlens`` not
    starting at 0, not ending at the token count, or not increasing): FlashAttention-2 would read outside the row
    (undefined results, no error), the reference kernels refuse. A verdict on the model's flash path, not a crash:
    e.g. GLM-4.5V on 5.24 derives ``cu_seq_lens`` from its 3 M-RoPE rows, ``[0, 11, 18, 31, ..., 93]`` for 31
    tokens. ``boundaries``: the values received; ``total``: the token count."""

    def __init__(self, name: str, boundaries: list[int], total: int) -> None:
        self.name, self.boundaries, self.total = name, boundaries, total
        super().__init__(f"{name}={boundaries} must start at 0, increase and end at the token count {total}")


def _validate_cu_seqlens(cu: Any, total: int, name: str) -> None:
    """dtype and shape always; the values (first 0, last the token count, never decreasing) only for CPU
    tensors, where reading them is free. On CUDA that read is a device sync per attention layer, which would slow
    every step packcheck bench times; the collate check verifies the collator's cu_seq_lens values instead.

    Raises:
        ValueError: not int32, or not 1-D.
        FlashBoundariesError: values that do not fit the ``total`` tokens (CPU tensors only).
    """
    import torch

    if cu.dtype != torch.int32:
        raise ValueError(f"{name} has dtype {cu.dtype}; flash-attn varlen kernels require torch.int32")
    if cu.ndim != 1:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}; flash-attn varlen kernels take a 1-D tensor")
    if cu.device.type == "cpu":
        values = cu.tolist()
        if not values or values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
            raise FlashBoundariesError(name, values, total)


class KernelArgumentError(ValueError):
    """An argument the model's flash path handed the varlen kernel breaks the kernels' contract (one item of
    :data:`VARLEN_CONTRACT`: cu_seqlens not int32 or not 1-D, max_seqlen below the longest segment, a zero-length
    segment with ``max_seqlen_q == 1`` under GQA). A verdict on the model's flash path (cause
    ``kernel_arguments``), not a crash. ``item``: the contract item; ``received``: what came, as text."""

    def __init__(self, item: str, received: str) -> None:
        self.item, self.received = item, received
        expected, source, _ = VARLEN_CONTRACT[item]
        super().__init__(f"varlen kernel argument {item}: received {received}, expected {expected} ({source})")


#: What the real varlen kernels require of their arguments, item by item: (expected, where the kernel says so,
#: what the kernel does otherwise: "refused" (it raises), "misread" (no check: wrong numbers, no error) or
#: "fa4" (FlashAttention-2 accepts it, FlashAttention-4's interface does not take it)). Read from flash-attn
#: 2.8.3's sdist (flash_attn/flash_attn_interface.py, csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd``) and
#: flash-attn-4 4.0.0b36's wheel (flash_attn/cute/interface.py). packcheck's kernels refuse "refused" and
#: "misread" items (:class:`KernelArgumentError`, :class:`FlashBoundariesError` for the values) and record "fa4"
#: items: the backend check reports them, as a finding.
VARLEN_CONTRACT: dict[str, tuple[str, str, str]] = {
    "cu_seqlens_dtype": ("torch.int32", ("flash_api.cpp mha_varlen_fwd TORCH_CHECK(cu_seqlens_q.dtype() == torch::kInt32); "
                         "flash-attn-4 interface.py:813 assert t.dtype == torch.int32"), "refused"),
    "cu_seqlens_shape": ("1-D, the same length for q and k", ("flash_api.cpp CHECK_SHAPE(cu_seqlens_q / cu_seqlens_k, "
                         "batch_size + 1); flash-attn-4 interface.py:787-792"), "refused"),
    "cu_seqlens_values": ("start at 0, never decrease, end at the token count", ("neither kernel checks: they are read "
                          "as offsets into q / k (outside the row when they do not fit)"), "misread"),
    "max_seqlen_type": ("Python int", ("flash_attn_interface.py declares max_seqlen_q: int, and its torch.library custom "
                        "op converts a 0-d tensor (one device sync per call); flash-attn-4 declares Optional[int] and, "
                        "off SM100/110, uses it as a host number (interface.py:386, 649, 941-949)"), "fa4"),
    "max_seqlen_bound": (">= the longest segment", ("flash_api.cpp mha_varlen_fwd sizes the grid by max_seqlen_q (rows "
                         "past it are never computed) and drops window_size_left >= max_seqlen_k; flash-attn-4 bounds "
                         "its scheduler by it (interface.py:386, 649)"), "misread"),
    "zero_length_single_query": ("no zero-length query segment when max_seqlen_q == 1 with GQA and no window",
                                 ("flash_api.cpp mha_varlen_fwd seqlenq_ngroups_swapped: q.reshape({batch_size, ...}) "
                                 "and cu_seqlens_q unused, one query per segment assumed"), "misread"),
}

#: flash_attn_varlen_func's positional parameters, as transformers calls it
_VARLEN_PARAMS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                  "softmax_scale", "causal", "window_size")


def _received(value: Any) -> str:
    """An argument as the contract reports it: Python type, dtype and value (``int 13``, ``Tensor int64 0-d 13``)."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        dtype = str(value.dtype).removeprefix("torch.")
        shown = value.tolist() if value.device.type == "cpu" and value.numel() <= 12 else f"({value.numel()} values)"
        return f"Tensor {dtype} {'0-d' if value.ndim == 0 else tuple(value.shape)} {shown}"
    return f"{type(value).__name__} {value!r}"


def varlen_argument_contract(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """Judge one varlen kernel call's arguments (``flash_attn_varlen_func``'s signature) against
    :data:`VARLEN_CONTRACT`, item by item: ``{item: {"ok": bool | None, "received": str, "kind": str}}``
    (``ok`` None: not decidable, e.g. values of a CUDA tensor, which packcheck does not read per call). Pure: it
    raises nothing; :func:`enforce_varlen_contract` raises."""
    bound = dict(zip(_VARLEN_PARAMS, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in _VARLEN_PARAMS})
    q, k = bound.get("q"), bound.get("k")
    cu_q, cu_k = bound.get("cu_seqlens_q"), bound.get("cu_seqlens_k")
    max_q, max_k = bound.get("max_seqlen_q"), bound.get("max_seqlen_k")
    window = bound.get("window_size") or (-1, -1)
    out: dict[str, dict[str, Any]] = {}

    def item(name: str, ok: bool | None, received: str) -> None:
        out[name] = {"ok": ok, "received": received, "kind": VARLEN_CONTRACT[name][2]}

    import torch

    tensors = [t for t in (cu_q, cu_k) if isinstance(t, torch.Tensor)]
    item("cu_seqlens_dtype", len(tensors) == 2 and all(t.dtype == torch.int32 for t in tensors),
         f"cu_seqlens_q {_received(cu_q)}, cu_seqlens_k {_received(cu_k)}" if len(tensors) < 2 else
         f"{str(cu_q.dtype).removeprefix('torch.')} / {str(cu_k.dtype).removeprefix('torch.')}")
    shapes_ok = len(tensors) == 2 and cu_q.ndim == 1 and cu_k.ndim == 1 and cu_q.shape == cu_k.shape
    item("cu_seqlens_shape", shapes_ok, " / ".join(str(tuple(t.shape)) for t in tensors))
    readable = shapes_ok and all(t.device.type == "cpu" for t in tensors) and q is not None and k is not None
    bq = cu_q.tolist() if readable else None
    bk = cu_k.tolist() if readable else None
    if readable:
        fits = all(b and b[0] == 0 and b[-1] == n and all(y >= x for x, y in itertools.pairwise(b))
                   for b, n in ((bq, q.shape[0]), (bk, k.shape[0])))
        item("cu_seqlens_values", fits, f"q {bq} for {q.shape[0]} tokens, k {bk} for {k.shape[0]} tokens")
    else:
        item("cu_seqlens_values", None, "not read (not CPU tensors)")
    types_ok = type(max_q) is int and type(max_k) is int
    item("max_seqlen_type", types_ok, f"max_seqlen_q {_received(max_q)}, max_seqlen_k {_received(max_k)}")
    if readable and out["cu_seqlens_values"]["ok"] and max_q is not None and max_k is not None:
        long_q = max((y - x for x, y in itertools.pairwise(bq)), default=0)
        long_k = max((y - x for x, y in itertools.pairwise(bk)), default=0)
        item("max_seqlen_bound", int(max_q) >= long_q and int(max_k) >= long_k,
             f"max_seqlen_q {int(max_q)} (longest q segment {long_q}), max_seqlen_k {int(max_k)} (longest k segment {long_k})")
        gqa = q.ndim == 3 and k.ndim == 3 and q.shape[1] > k.shape[1]
        no_window = tuple(window) == (-1, -1)
        empty = sum(1 for x, y in itertools.pairwise(bq) if y == x)
        swapped = int(max_q) == 1 and gqa and no_window
        item("zero_length_single_query", not (swapped and empty),
             f"max_seqlen_q {int(max_q)}, {empty} zero-length q segments, "
             f"{'GQA ' + str(q.shape[1]) + '/' + str(k.shape[1]) if gqa else 'no GQA'}, window {tuple(window)}")
    else:
        item("max_seqlen_bound", None, "not decidable (values not read or not valid)")
        item("zero_length_single_query", None, "not decidable (values not read or not valid)")
    return out


def enforce_varlen_contract(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    """:func:`varlen_argument_contract`, raising on the first item the real kernels refuse or misread; "fa4"
    items (a 0-d tensor max_seqlen that FlashAttention-2 takes) are returned, not raised.

    Raises:
        KernelArgumentError: cu_seqlens not int32 / not 1-D of one length, max_seqlen below the longest segment,
            a zero-length segment with max_seqlen_q == 1 under GQA.
        FlashBoundariesError: cu_seqlens values that do not fit the tokens (CPU tensors only).
    """
    contract = varlen_argument_contract(*args, **kwargs)
    for name in ("cu_seqlens_dtype", "cu_seqlens_shape"):
        if contract[name]["ok"] is False:
            raise KernelArgumentError(name, contract[name]["received"])
    if contract["cu_seqlens_values"]["ok"] is False:
        bound = dict(zip(_VARLEN_PARAMS, args, strict=False)) | kwargs
        for key, tokens in (("cu_seqlens_q", bound["q"].shape[0]), ("cu_seqlens_k", bound["k"].shape[0])):
            _validate_cu_seqlens(bound[key], tokens, key)
    for name in ("max_seqlen_bound", "zero_length_single_query"):
        if contract[name]["ok"] is False:
            raise KernelArgumentError(name, contract[name]["received"])
    return contract


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



# --------------------------------------------------------------------------------------------------------------
# Registration


#: First transformers release whose flash path reads packed position_ids (``_flash_attention_forward(...,
#: position_ids)`` -> ``prepare_fa2_from_position_ids``), the release of DataCollatorWithFlattening.
REFERENCE_FLOOR = "4.44"

#: The flash-attn release the reference stands in for on transformers' module-globals flash path (4.44 ..
#: 4.55.0): the last whose ``unpad_input`` returns 4 values (4.44 - 4.48 unpack exactly 4; 2.7 returns 5), with
#: ``window_size`` (2.3), ``deterministic`` (2.4.1) and ``softcap`` (2.6).
EMULATED_FLASH_ATTN = "2.6.3"


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


# --------------------------------------------------------------------------------------------------------------
# The module-globals flash path (transformers 4.44 .. 4.55.0)


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
    kernels = {
        REFERENCE_BACKEND: (dense_reference_kernel, varlen_reference_kernel, *with_kvcache, mfu._pad_input, mfu._unpad_input),
        TORCH_VARLEN_BACKEND: (dense_torch_varlen_kernel, torch_varlen_kernel, *with_kvcache, mfu._pad_input, mfu._unpad_input),
    }

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

    for name in _VARLEN_BACKENDS:
        AttentionInterface.register(name, packcheck_flash_ref)
        if ALL_MASK_ATTENTION_FUNCTIONS is not None:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    _REGISTERED = True


# --------------------------------------------------------------------------------------------------------------
# Call counting


@dataclass
class AttentionCall:
    """One call of an attention function, as seen by :class:`AttentionProbe`."""

    backend: str
    isolated: bool | None  # did the boundaries of the packed examples reach this call? None: not decidable


@dataclass
class AttentionProbe:
    """Counts attention calls per backend during a forward and checks that packed boundaries reached them.

    ``segments``: lengths (tokens) of the examples packed into row 0, used to decide isolation from the mask,
    the varlen cu_seqlens or the flex BlockMask that each call receives.
    """

    segments: list[int] | None = None
    calls: list[AttentionCall] = field(default_factory=list)
    #: calls of the varlen flash kernel (flash_attn_varlen_func or its stand-in) and of the dense one
    #: (flash_attn_func: the whole row as one sequence), as transformers dispatched them
    varlen_calls: int = 0
    dense_flash_calls: int = 0
    varlen_boundaries: list[list[int]] = field(default_factory=list)
    #: :func:`varlen_argument_contract` of each varlen kernel call (recorded when ``segments`` is given)
    varlen_arguments: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    _inside: int = 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.backend] = out.get(c.backend, 0) + 1
        return out

    # Pairs (query index, key index) that cross a boundary in row 0: the first token of each later example
    # against the last token of the example before it.
    def _cross_pairs(self) -> list[tuple[int, int]]:
        if not self.segments or len(self.segments) < 2:
            return []
        pairs, start = [], 0
        for length in self.segments[:-1]:
            start += length
            pairs.append((start, start - 1))
        return pairs

    def isolation_from_mask(self, mask: Any) -> bool | None:
        import torch

        pairs = self._cross_pairs()
        if not pairs:
            return None
        if mask is None:
            return False
        if type(mask).__name__ == "BlockMask":
            mod = getattr(mask, "mask_mod", None)
            if mod is None:
                return None
            z = torch.zeros((), dtype=torch.int64)
            for qi, ki in pairs:
                allowed = mod(z, z, torch.tensor(qi), torch.tensor(ki))
                if bool(allowed):
                    return False
            return True
        if isinstance(mask, torch.Tensor):
            m = mask
            while m.ndim > 2:
                m = m[0]
            for qi, ki in pairs:
                if qi >= m.shape[-2] or ki >= m.shape[-1]:
                    return None
                val = m[qi, ki]
                allowed = bool(val) if m.dtype == torch.bool else bool(val > torch.finfo(m.dtype).min / 2)
                if allowed:
                    return False
            return True
        return None

    def isolation_from_cu_seqlens(self, cu: Any) -> bool | None:
        if not self.segments or len(self.segments) < 2:
            return None
        bounds = set(cu.tolist())
        start = 0
        for length in self.segments[:-1]:
            start += length
            if start not in bounds:
                return False
        return True


@contextlib.contextmanager
def count_attention_calls(model: Any, segments: list[int] | None = None) -> Iterator[AttentionProbe]:
    """Count attention calls (per backend) while the block runs.

    Wraps every function in transformers' ``ALL_ATTENTION_FUNCTIONS``, the ``eager_attention_forward`` of the
    model's own modeling module, and the flash kernels transformers' ``_flash_attention_forward`` dispatches to
    (varlen and dense, from ``lazy_import_flash_attention`` on 4.55.1+, the module's ``flash_attn_func`` /
    ``flash_attn_varlen_func`` before), restoring them on exit. The model must be
    called inside the block. Adds two Python calls per attention layer; no tensor work except the isolation
    probe on a handful of mask entries.
    """
    try:  # 4.48 - 4.50: a plain dict; 4.51+: an AttentionInterface; before 4.48 none (attention classes per backend)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        ALL_ATTENTION_FUNCTIONS = {}

    probe = AttentionProbe(segments=segments)
    mapping = getattr(ALL_ATTENTION_FUNCTIONS, "_global_mapping", ALL_ATTENTION_FUNCTIONS)
    saved_mapping = dict(mapping)
    patched_modules: list[tuple[Any, str, Callable]] = []
    # the reference on 4.44 .. 4.55.0 runs under transformers' flash_attention_2 name: its calls are counted as the
    # backend the model was built for
    alias = {"flash_attention_2": getattr(model, PACKCHECK_BACKEND_ATTR)} if getattr(model, PACKCHECK_BACKEND_ATTR, None) else {}

    def wrap(backend: str, fn: Callable) -> Callable:
        def counted(module, query, key, value, attention_mask, *args, **kwargs):
            if backend in FLASH_FAMILY:
                isolated = None  # decided by the varlen kernel hook below (or by cu_seq_lens kwargs)
                cu = kwargs.get("cu_seq_lens_q")
                if cu is not None:
                    isolated = probe.isolation_from_cu_seqlens(cu)
            else:
                isolated = probe.isolation_from_mask(attention_mask)
            probe.calls.append(AttentionCall(backend, isolated))
            probe._inside += 1
            try:
                return fn(module, query, key, value, attention_mask, *args, **kwargs)
            finally:
                probe._inside -= 1

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    # The flash kernels, at the point transformers dispatches to them (every flash-family backend: flash-attn 2/3,
    # hub kernels, packcheck's two): count varlen and dense calls and record the boundaries the varlen kernel
    # really received. Boundaries are read (a device-to-host copy of cu_seqlens) only when the probe has segments
    # to check them against: counting alone (packcheck bench's instrumentation) adds no synchronisation. Wrappers
    # are made once per kernel, not once per call.
    import torch.nn.functional as F
    import transformers.modeling_flash_attention_utils as mfu

    wrapped: dict[int, Callable] = {}

    def once_per_kernel(make: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        def get(kernel: Callable) -> Callable:
            if id(kernel) not in wrapped:
                wrapped[id(kernel)] = functools.wraps(kernel)(make(kernel))
            return wrapped[id(kernel)]

        return get

    @once_per_kernel
    def count_varlen(original_varlen: Callable) -> Callable:
        def counted_varlen(*args, **kwargs):
            probe.varlen_calls += 1
            cu = kwargs.get("cu_seqlens_q", args[3] if len(args) > 3 else None)
            if cu is not None and probe.segments:
                probe.varlen_boundaries.append(cu.tolist())
                try:
                    probe.varlen_arguments.append(varlen_argument_contract(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - arguments the contract cannot read: say so, call on
                    probe.varlen_arguments.append({"unreadable": {"ok": None, "received": repr(exc)[:120], "kind": "misread"}})
                if probe.calls and probe.calls[-1].isolated is None:
                    probe.calls[-1].isolated = probe.isolation_from_cu_seqlens(cu)
            return original_varlen(*args, **kwargs)

        return counted_varlen

    @once_per_kernel
    def count_dense(original_dense: Callable) -> Callable:
        def counted_dense(*args, **kwargs):
            probe.dense_flash_calls += 1
            if probe.calls and probe.calls[-1].isolated is None and probe.segments and len(probe.segments) > 1:
                probe.calls[-1].isolated = False  # one dense call over the packed row: no boundaries
            return original_dense(*args, **kwargs)

        return counted_dense

    loader = getattr(mfu, "lazy_import_flash_attention", None)

    def counted_loader(*args, **kwargs):
        kernels, *rest = loader(*args, **kwargs)  # ((flash_fn, varlen_fn, ...), process fn(s))
        dense, varlen = kernels[0], kernels[1]
        kernels = (count_dense(dense) if dense is not None else None,
                   count_varlen(varlen) if varlen is not None else None, *kernels[2:])
        return (kernels, *rest)

    # Models outside the AttentionInterface (falcon's legacy path in 5.24) call torch's SDPA directly: count those
    # calls, but not the ones made from inside a counted interface function.
    original_sdpa = F.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        if not probe._inside:
            probe.calls.append(AttentionCall("sdpa (direct torch call)", probe.isolation_from_mask(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))))
        return original_sdpa(*args, **kwargs)

    flash_backend = alias.get("flash_attention_2", "flash_attention_2")

    def count_flash_forward(original_forward: Callable) -> Callable:
        """A model module's own ``_flash_attention_forward`` (its FlashAttention2 class calls it; before 4.48 there
        is no AttentionInterface): one attention call of the flash backend, unless an interface call counted it."""
        def counted_flash_forward(*args, **kwargs):
            if probe._inside:
                return original_forward(*args, **kwargs)
            cu = kwargs.get("cu_seq_lens_q")
            probe.calls.append(AttentionCall(flash_backend, probe.isolation_from_cu_seqlens(cu) if cu is not None else None))
            probe._inside += 1
            try:
                return original_forward(*args, **kwargs)
            finally:
                probe._inside -= 1

        return functools.wraps(original_forward)(counted_flash_forward)

    saved_flash: dict[str, Callable] = {}
    saved_stand_ins = dict(FLASH_ATTN_STAND_INS)
    saved_late = dict(_MFU_LATE)
    try:  # every patch inside: a failure half-way still restores what was patched
        for name, fn in saved_mapping.items():
            mapping[name] = wrap(alias.get(name, name.removeprefix("paged|")), fn)
        for mod in {type(m).__module__ for m in model.modules()}:
            module = sys.modules.get(mod)
            fn = getattr(module, "eager_attention_forward", None)
            if callable(fn):
                patched_modules.append((module, "eager_attention_forward", fn))
                module.eager_attention_forward = wrap("eager", fn)
            fn = vars(module).get("_flash_attention_forward") if module is not None else None
            if callable(fn) and loader is None:
                patched_modules.append((module, "_flash_attention_forward", fn))
                module._flash_attention_forward = count_flash_forward(fn)
        if loader is not None:  # 4.55.1+: _flash_attention_forward asks the loader for the kernels on every call
            saved_flash["lazy_import_flash_attention"] = loader
            mfu.lazy_import_flash_attention = functools.wraps(loader)(counted_loader)
        else:
            # before 4.55.1 the flash-attn functions are module globals of modeling_flash_attention_utils (4.54 -
            # 4.55.0: cached in _flash_fn / _flash_varlen_fn after the first call); packcheck's reference binds them
            # at each forward from FLASH_ATTN_STAND_INS, and a model module that imports _flash_attention_forward
            # only with flash-attn installed gets it bound from _MFU_LATE
            for name, wrapper in (("flash_attn_func", count_dense), ("flash_attn_varlen_func", count_varlen),
                                  ("_flash_fn", count_dense), ("_flash_varlen_fn", count_varlen)):
                fn = getattr(mfu, name, None)
                if callable(fn):
                    saved_flash[name] = fn
                    setattr(mfu, name, wrapper(fn))
            FLASH_ATTN_STAND_INS["flash_attn_func"] = count_dense(saved_stand_ins["flash_attn_func"])
            FLASH_ATTN_STAND_INS["flash_attn_varlen_func"] = count_varlen(saved_stand_ins["flash_attn_varlen_func"])
            if callable(getattr(mfu, "_flash_attention_forward", None)):
                _MFU_LATE["_flash_attention_forward"] = count_flash_forward(mfu._flash_attention_forward)
        F.scaled_dot_product_attention = counted_sdpa
        yield probe
    finally:
        mapping.clear()
        mapping.update(saved_mapping)
        for module, attr, fn in patched_modules:
            setattr(module, attr, fn)
        for name, fn in saved_flash.items():
            setattr(mfu, name, fn)
        FLASH_ATTN_STAND_INS.clear()
        FLASH_ATTN_STAND_INS.update(saved_stand_ins)
        _MFU_LATE.clear()
        _MFU_LATE.update(saved_late)
        F.scaled_dot_product_attention = original_sdpa
