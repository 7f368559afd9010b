"""Each example alone: the one reference a packed row is compared with, by the checks, the SFT probes and the guard.

The convention, everywhere: an example alone is a batch of one, ``(1, n)``, whose ``position_ids`` run
``first .. first + n - 1``, where ``first`` is the position its first token has in the packed row: 0 for the
collators' restarting rows (TRL's too), ``position_ids_start`` for a model that counts positions past its padding
index (RoBERTa-like: ``padding_idx + 1``), ``k`` for a continuation chunk that starts at k. It runs with
``use_cache=False`` and no ``attention_mask`` (a batch of one has no padding). Where the model reads positions in
another layout (M-RoPE's ``(3 or 4, batch, length)``), the caller's layout maps the ``(1, n)`` row.

Torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any


def position_ids_alone(first: int, n: int, device: Any = "cpu", like: Any = None) -> Any:
    """``position_ids`` of one example of ``n`` tokens alone: ``first .. first + n - 1``, int64 ``(1, n)``; in
    ``like``'s dtype, device and layout when given (``(R, 1, n)`` for a 3-D ``like``, each row the same)."""
    import torch

    if like is None:
        return torch.arange(first, first + n, device=device)[None]
    ids = torch.arange(first, first + n, device=like.device, dtype=like.dtype)[None]
    return ids.expand(like.shape[0], 1, n).contiguous() if like.ndim == 3 else ids


def alone_batch(input_ids: Any, first: int, device: Any = "cpu") -> dict[str, Any]:
    """The batch of one example alone: ``input_ids`` ``(1, n)`` (from a token list, or a ``(1, n)`` tensor kept
    as it is) and :func:`position_ids_alone` from ``first``. No ``use_cache`` key: the caller's forward adds it."""
    import torch

    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor([list(input_ids)], device=device)
    return {"input_ids": ids, "position_ids": position_ids_alone(first, int(ids.shape[-1]), ids.device)}
