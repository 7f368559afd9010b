"""Example lengths -> flattened (packed), padded and solo batches.

The packed batch always comes from transformers' own ``DataCollatorWithFlattening`` (the code under test),
with the arguments the installed version supports (feature-detected from its signature).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.options import OPT_LENGTHS, default_of

#: Example lengths (tokens) of the packed row: the --packcheck-lengths default (:mod:`pytest_packcheck.config.options`
#: says why those lengths).
DEFAULT_LENGTHS: tuple[int, ...] = default_of(OPT_LENGTHS)
IGNORE_INDEX = -100

# Architectures whose absolute position embeddings start at padding_idx + 1 (transformers' RoBERTa family);
# the flattening collator must restart them there (position_ids_start, transformers >= 5.15.0, bisected).
ROBERTA_LIKE = {"roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "xmod", "mpnet", "esm", "data2vec-text"}


def position_ids_start(config: Any) -> int:
    """The first position id of an example for this architecture: 0, or padding_idx + 1 for RoBERTa-likes."""
    if config.model_type in ROBERTA_LIKE and config.pad_token_id is not None:
        return int(config.pad_token_id) + 1
    return 0


@dataclass(frozen=True)
class PositionLayout:
    """How a packed row's ``position_ids`` reach the model.

    ``rows=None``: as ``DataCollatorWithFlattening`` returns them, int64 ``(batch, length)``.
    ``rows=R``: multimodal RoPE (M-RoPE) position_ids, int64 ``(R, batch, length)``, every row the 1-D positions
    restarting per example. For text-only input each M-RoPE section (temporal, height, width) is the token's own
    position (``get_rope_index`` gives a text run ``arange(n)`` in all three), and transformers 5.x's Qwen2-VL
    family puts a text row first (R = 4): the row ``create_causal_mask`` and the flash path's
    ``prepare_fa_kwargs_from_position_ids`` find the packed boundaries in (``Qwen2VLTextModel.forward``,
    ``Qwen2VLForConditionalGeneration._prepare_position_ids_for_generation``, transformers 5.24). ``source``:
    where R was read, for the cell record.
    """

    rows: int | None = None
    source: str = ""

    def apply(self, position_ids: Any) -> Any:
        """``position_ids`` int64 ``(batch, length)`` -> this layout; ids that already have another rank pass
        through unchanged."""
        if self.rows is None or position_ids is None or position_ids.ndim != 2:
            return position_ids
        return position_ids[None].expand(self.rows, -1, -1).contiguous()

    def describe(self) -> dict[str, Any]:
        """What the cell record says about a multimodal model's text path: the layout and where it was read."""
        shape = "(batch, length)" if self.rows is None else f"({self.rows}, batch, length), every row"
        return {"path": "text", "input": "text only (no pixel_values)", "position_ids": f"{shape} restarting per example",
                "source": self.source}


#: position_ids as the collator gives them (every causal LM).
PLAIN_POSITIONS = PositionLayout()


def make_examples(config: Any, lengths: tuple[int, ...] = DEFAULT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Random token ids (Python ints), one list per example, avoiding the config's special token ids."""
    import torch

    special = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        special.update(value if isinstance(value, list) else [value])
    vocab = int(config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n * 2,), generator=gen).tolist()
        ids = [i for i in ids if i not in special][:n]
        while len(ids) < n:
            ids.append(max(0, min(vocab - 1, 5 + len(ids))))
        out.append(ids)
    return out


#: The keys DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds: the varlen boundaries a flash path reads
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def collator_supports() -> set[str]:
    """Keyword arguments of the installed ``DataCollatorWithFlattening`` (``return_flash_attn_kwargs`` from
    4.52, ``return_seq_idx`` from 4.52, ``position_ids_start`` from 5.16)."""
    from transformers import DataCollatorWithFlattening

    return set(_parameters(DataCollatorWithFlattening.__init__))


@functools.lru_cache(maxsize=16)
def _parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of ``function``, read once per function object (issue 47: the signature was read on every
    packed row, 1,000 times an audit); a collator class or ``__init__`` swapped in (a planted one) is read anew."""
    return tuple(inspect.signature(function).parameters)


class CollatorUnsupported(NotImplementedError):
    """The installed ``DataCollatorWithFlattening`` cannot give what a check asks of it (a keyword it refuses, the
    flash kwargs it does not return): an "unsupported" cell whose message is the library's reason (the runner reads
    "is not supported" as a refusal, :data:`run.runner._UNSUPPORTED_MARKERS`), never a crash blamed on the model."""


def _refusal(kwargs: dict[str, Any]) -> str:
    """The library's own words for refusing ``kwargs`` (the constructor called with them unfiltered: transformers
    4.51.3's ``__init__(*args, return_position_ids=True, separator_id=-100, **kwargs)`` hands
    ``return_flash_attn_kwargs`` to ``DefaultDataCollator``: "TypeError: DefaultDataCollator.__init__() got an
    unexpected keyword argument 'return_flash_attn_kwargs'"), or "" when it takes them."""
    from transformers import DataCollatorWithFlattening

    try:
        DataCollatorWithFlattening(**kwargs)
    except TypeError as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return ""


def _unsupported(what: str, said: str) -> CollatorUnsupported:
    import transformers

    return CollatorUnsupported(f"{what} is not supported by transformers {transformers.__version__}'s "
                               f"DataCollatorWithFlattening ({said or 'its signature has no such argument'}; "
                               "return_flash_attn_kwargs and return_seq_idx from 4.52, position_ids_start from 5.16)")


def default_collator_factory(**kwargs: Any) -> Callable[..., dict]:
    """``DataCollatorWithFlattening(**kwargs)`` keeping only the arguments the installed version knows.

    Raises:
        CollatorUnsupported: the collator refuses the arguments its signature names (a TypeError at construction),
            with the library's message.
    """
    from transformers import DataCollatorWithFlattening

    supported = collator_supports()
    kept = {k: v for k, v in kwargs.items() if k in supported}
    try:
        return DataCollatorWithFlattening(**kept)
    except TypeError as exc:  # a release whose constructor refuses what its signature shows: the library's reason
        raise _unsupported(f"DataCollatorWithFlattening({', '.join(f'{k}={v!r}' for k, v in kept.items())})",
                           f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from exc


def packed_batch(
    examples: list[list[int]],
    collator_factory: Callable[..., Any] = default_collator_factory,
    start: int = 0,
    flash_kwargs: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """One flattened row: ``input_ids``, ``labels``, ``position_ids`` int64 ``(1, total_tokens)``; with
    ``flash_kwargs`` also ``cu_seq_lens_q/k`` int32 ``(num_examples + 1,)`` and ``max_length_q/k`` ints.

    Raises:
        CollatorUnsupported: ``flash_kwargs`` asked of a collator that returns no ``cu_seq_lens_q`` (transformers
            before 4.52: the cell is "unsupported" with the library's refusal, issue 41), or one the collator
            factory raises.
    """
    collator = collator_factory(
        return_position_ids=True, return_flash_attn_kwargs=flash_kwargs, position_ids_start=start
    )
    batch = collator([{"input_ids": list(e)} for e in examples], return_tensors="pt")
    if flash_kwargs and "cu_seq_lens_q" not in batch:
        raise _unsupported("a packed row with cu_seq_lens_q (return_flash_attn_kwargs=True)",
                           _refusal({"return_flash_attn_kwargs": True}))
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}


def padded_batch(examples: list[list[int]], pad_id: int, side: str = "right", start: int = 0, device: str = "cpu") -> dict[str, Any]:
    """A padded batch ``(num_examples, max_len)``: input_ids, attention_mask, position_ids (restarting at
    ``start`` on the first real token, as generate() does for left padding) and labels (-100 on padding)."""
    import torch

    width = max(len(e) for e in examples)
    ids, mask, pos, labels = [], [], [], []
    for e in examples:
        pad = width - len(e)
        real_pos = list(range(start, start + len(e)))
        if side == "right":
            ids.append(e + [pad_id] * pad)
            mask.append([1] * len(e) + [0] * pad)
            pos.append(real_pos + [start] * pad)
            labels.append(e + [IGNORE_INDEX] * pad)
        else:
            ids.append([pad_id] * pad + e)
            mask.append([0] * pad + [1] * len(e))
            pos.append([start] * pad + real_pos)
            labels.append([IGNORE_INDEX] * pad + e)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return {"input_ids": as_long(ids), "attention_mask": as_long(mask), "position_ids": as_long(pos), "labels": as_long(labels)}


def real_token_rows(examples: list[list[int]], side: str) -> list[tuple[int, slice]]:
    """For a padded batch: (row, slice of real tokens) per example."""
    width = max(len(e) for e in examples)
    return [(i, slice(0, len(e)) if side == "right" else slice(width - len(e), width)) for i, e in enumerate(examples)]


def segment_slices(lengths: list[int]) -> list[slice]:
    """Slices of each example in a flattened row."""
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out


def count_label_tokens(labels: Any) -> int:
    """Number of label tokens that count in a causal-LM loss: labels != -100 after the one-token shift
    (what Trainer passes as ``num_items_in_batch``)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


#: Lengths of TRL's padding-free probe row: 1027 tokens, padded to 1032 by pad_to_multiple_of=8.
TRL_PROBE_LENGTHS = (400, 300, 327)


def trl_collator_factory(**kwargs: Any) -> Callable[..., dict] | None:
    """TRL's padding-free ``DataCollatorForLanguageModeling(**kwargs)`` (``trl.trainer.sft_trainer``, TRL >= 0.19;
    ``padding_free`` from 0.16), keeping the arguments the installed version knows; None without TRL or
    without padding_free."""
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError:
        return None
    params = set(inspect.signature(DataCollatorForLanguageModeling.__init__).parameters)
    if "padding_free" not in params:
        return None
    return DataCollatorForLanguageModeling(**{k: v for k, v in kwargs.items() if k in params})
