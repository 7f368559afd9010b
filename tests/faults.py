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
    from pytest_packcheck.model.batches import default_collator_factory

    real = default_collator_factory(**kwargs)

    def collate(features, return_tensors="pt"):
        batch = real(features, return_tensors=return_tensors)
        n = batch["input_ids"].shape[-1]
        batch["position_ids"] = torch.arange(n)[None] + kwargs.get("position_ids_start", 0)
        return batch

    return collate


def collator_label_leak(**kwargs: Any):
    """A flattening collator that does not mask the label at example boundaries."""
    from pytest_packcheck.model.batches import default_collator_factory

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


class _Wrapper(torch.nn.Module):
    """A model seen through a wrapper: the config and parameters are the inner model's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


def _is_packed_row(kwargs: dict) -> bool:
    """One row whose position_ids restart (a packed row), not a padded batch or a solo run."""
    pos = kwargs.get("position_ids")
    return pos is not None and pos.shape[0] == 1 and bool((pos[0, 1:] < pos[0, :-1]).any())


class DropNumItemsInBatch(_Wrapper):
    """A model that never receives ``num_items_in_batch`` (a hand-written accumulation loop forgets it): each
    micro-batch's loss is its own token mean, so the accumulated sum is not the reference's token mean."""

    def forward(self, input_ids=None, position_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)


class DropNumItemsInBatchPacked(_Wrapper):
    """``num_items_in_batch`` dropped on packed rows only (a packing path that loses the loss kwargs): a packed
    micro-batch's loss is its token mean, a padded one's the sum over the accumulation step's count."""

    def forward(self, input_ids=None, position_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        if not _is_packed_row({"position_ids": position_ids}):
            kwargs["num_items_in_batch"] = num_items_in_batch
        return self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)


class ScalePackedLoss(_Wrapper):
    """The packed row's loss scaled by ``factor`` (28/31: divided by the label count before the shift), logits
    untouched: the packed gradient is the padded one times ``factor``, same direction (cosine 1)."""

    factor = 28 / 31

    def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)
        if labels is not None and _is_packed_row({"position_ids": position_ids}):
            out.loss = out.loss * self.factor
        return out


class TiltPackedGradient(_Wrapper):
    """The packed row's loss plus ``eps`` times a fixed random projection of one weight: logits and the loss value
    untouched (the term is subtracted back as a constant), the gradient's direction turned by ``eps``."""

    eps = 1.0

    def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, labels=labels, **kwargs)
        if labels is not None and _is_packed_row({"position_ids": position_ids}):
            weight = dict(self.inner.named_parameters())["lm_head.weight"]
            direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
            tilt = self.eps * (weight * direction).sum()
            out.loss = out.loss + tilt - tilt.detach()
        return out


class NoPositionIdsArgument(_Wrapper):
    """A forward whose signature has no position_ids at all (and no **kwargs): packed positions cannot reach it."""

    def forward(self, input_ids=None, labels=None, use_cache=None):
        return self.inner(input_ids=input_ids, labels=labels, use_cache=use_cache)


class RunsTwice(_Wrapper):
    """A forward that runs the inner model twice: twice the attention calls the modules found promise."""

    def forward(self, **kwargs):
        self.inner(**kwargs)
        return self.inner(**kwargs)


class ForceCache(_Wrapper):
    """A forward that always builds a cache: eager / sdpa get no packed mask, the boundaries never reach attention."""

    def forward(self, **kwargs):
        kwargs["use_cache"] = True
        return self.inner(**kwargs)


class UnigramLM(torch.nn.Module):
    """A model whose logits at a position depend on that position's token only: no example can ever see another,
    with or without boundaries, so the isolation probe's negative control (a planted leak) cannot move anything
    and a pass would mean nothing."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.table = torch.nn.Embedding(int(config.vocab_size), int(config.vocab_size))

    def forward(self, input_ids=None, position_ids=None, labels=None, use_cache=None, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table(input_ids), loss=None)


class WarnsOnForward(_Wrapper):
    """A forward that logs ``message`` through transformers' logger (as a backend falling back does)."""

    message = "sdpa is not supported for this model, falling back to eager attention"

    def forward(self, **kwargs):
        import logging

        logging.getLogger("transformers.modeling_utils").warning(self.message)
        return self.inner(**kwargs)


# ---- multimodal models' text path (M-RoPE position_ids) -------------------------------------------------------


def _packed(position_ids) -> bool:
    """A (batch, length) row whose ids restart somewhere: a packed row, not a solo run or a padded batch."""
    return position_ids.ndim == 2 and position_ids.shape[0] == 1 and bool((position_ids[0, 1:] < position_ids[0, :-1]).any())


def _layout(rows: int, source: str):
    from pytest_packcheck.model.batches import PositionLayout

    return PositionLayout(rows=rows, source=source)


class TextRowNoRestart(type(_layout(4, ""))):
    """(4, batch, length) ids whose text row runs 0..N-1 across the row (does not restart), the three M-RoPE rows
    restarting: the text row is where Qwen2-VL finds the packed boundaries, so there are none."""

    def apply(self, position_ids):
        out = super().apply(position_ids).clone()
        if position_ids.ndim == 2:
            out[0] = torch.arange(position_ids.shape[-1])[None].expand_as(position_ids)
        return out


class SectionNoRestart(type(_layout(4, ""))):
    """(4, batch, length) ids whose temporal row (M-RoPE section 1, the frequencies :class:`FrozenSection` shows
    matter) runs 0..N-1 across a packed row; the text row restarts. Each example's temporal positions are shifted
    by a constant, which rotary attention cannot see (it depends on position differences only): harmless, as
    measured."""

    def apply(self, position_ids):
        out = super().apply(position_ids).clone()
        if _packed(position_ids):
            out[1] = torch.arange(position_ids.shape[-1])[None]
        return out


class FrozenSection(type(_layout(4, ""))):
    """(4, batch, length) ids whose temporal row (M-RoPE section 1, the highest rotary frequencies) is 0 on every
    token of a packed row (solo runs are right): boundaries hold, positions inside each example are wrong. (The
    width section holds the lowest frequencies: with rope_theta 1e6 and 16-dim heads, freezing it moves logits by
    only 1e-5 over 13 tokens.)"""

    def apply(self, position_ids):
        out = super().apply(position_ids).clone()
        if _packed(position_ids):
            out[1] = 0
        return out
