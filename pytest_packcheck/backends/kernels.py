"""The CPU reference kernel: exact per-segment attention with flash-attn's varlen signature (fp32 softmax),
the dense (``flash_attn_func``) signature over it, and attention sinks.

It is a reference, never FlashAttention-2; the matrix labels it so. Each call is checked against the real
kernels' argument contract first (:func:`.contract.enforce_varlen_contract`, :data:`.contract.VARLEN_CONTRACT`).
Heavy imports (torch) happen inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .contract import enforce_varlen_contract


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

