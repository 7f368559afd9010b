"""The varlen kernels' argument contract (:data:`VARLEN_CONTRACT`, with the flash-attn 2.8.3 / flash-attn-4 source
lines), judged per call (:func:`varlen_argument_contract`) and enforced by packcheck's kernels
(:func:`enforce_varlen_contract`); the two errors a broken call becomes (a verdict on the model's flash path, not
a crash). Heavy imports (torch) happen inside functions.
"""

from __future__ import annotations

import itertools
from typing import Any


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

