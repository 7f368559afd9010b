"""Planted faults. Each check must fail on its fault and pass on the correct stack."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class DropPositionIds(torch.nn.Module):
    """A model wrapper that silently drops position_ids (as some custom forward() signatures do)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


def collator_no_reset(**kwargs: Any):
    """A flattening collator whose position_ids run 0..N-1 across the whole row (do not restart)."""
    from pytest_packcheck.batches import default_collator_factory

    real = default_collator_factory(**kwargs)

    def collate(features, return_tensors="pt"):
        batch = real(features, return_tensors=return_tensors)
        n = batch["input_ids"].shape[-1]
        batch["position_ids"] = torch.arange(n)[None] + kwargs.get("position_ids_start", 0)
        return batch

    return collate


def collator_label_leak(**kwargs: Any):
    """A flattening collator that does not mask the label at example boundaries."""
    from pytest_packcheck.batches import default_collator_factory

    real = default_collator_factory(**kwargs)

    def collate(features, return_tensors="pt"):
        batch = real(features, return_tensors=return_tensors)
        batch["labels"] = batch["input_ids"].clone()
        return batch

    return collate


@contextlib.contextmanager
def leaky_sdpa():
    """sdpa that ignores the mask it is given and attends causally across the whole row."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]

    def leaky(module, query, key, value, attention_mask, **kwargs):
        return original(module, query, key, value, None, is_causal=True, **{k: v for k, v in kwargs.items() if k != "is_causal"})

    mapping["sdpa"] = leaky
    try:
        yield
    finally:
        mapping["sdpa"] = original


class SilentSwap(torch.nn.Module):
    """A model whose config says sdpa, but whose forward switches attention to eager for the call."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, **kwargs):
        requested = self.inner.config._attn_implementation
        self.inner.config._attn_implementation_internal = "eager"
        try:
            return self.inner(**kwargs)
        finally:
            self.inner.config._attn_implementation_internal = requested


class DropAttentionMask(torch.nn.Module):
    """The fix for the mask trap, as a wrapper: the attention_mask of a packed row is dropped before the model."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, **kwargs):
        kwargs.pop("attention_mask", None)
        return self.inner(**kwargs)


@contextlib.contextmanager
def bidirectional_sdpa():
    """sdpa that keeps the packed boundaries but attends both ways inside each example (non-causal): the block
    mask it is given, OR its transpose."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]

    def bidirectional(module, query, key, value, attention_mask, **kwargs):
        mask = attention_mask
        if mask is not None and mask.dtype == torch.bool:
            mask = mask | mask.transpose(-1, -2)
        elif mask is not None:
            mask = torch.maximum(mask, mask.transpose(-1, -2))
        kwargs.pop("is_causal", None)
        return original(module, query, key, value, mask, is_causal=False, **kwargs)

    mapping["sdpa"] = bidirectional
    try:
        yield
    finally:
        mapping["sdpa"] = original


@contextlib.contextmanager
def windowless_sdpa():
    """sdpa that drops the mask it is given and attends plain causally: on a sliding-window model, solo runs longer
    than the window see beyond it (what a flash path applying another window than eager does)."""
    with leaky_sdpa():
        yield
