"""The batch contract: :func:`parse_row` validates one packed row and splits it into its examples at every boundary
the batch declares (each broken item a cause code with a remedy, :data:`CONTRACT_REMEDIES`); :func:`packed_rows`
finds a batch of several packed rows; :func:`unpack_row` turns a packed row into a right-padded batch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .result import NotPackedError, _usage

#: Keys that run along the tokens of the row: all must have the row's length.
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "seq_idx", "token_type_ids", "completion_mask",
              "assistant_masks")
#: Keys the probes never hand to the model as they came: replaced per probe, or only meaningful for the whole row.
_ROW_KEYS = ("labels", "attention_mask", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
             "num_items_in_batch", "use_cache", "fused_lm_head", "completion_mask", "assistant_masks")
IGNORE_INDEX = -100
#: Per-token keys that must hold integers (token ids, positions, label ids, segment ids).
_INTEGER_KEYS = ("input_ids", "labels", "position_ids", "seq_idx", "token_type_ids")
#: Remedies of the batch contract's items, by item.
CONTRACT_REMEDIES = {
    "lengths": "collate every per-token key (input_ids, labels, position_ids, ...) to the row's length",
    "restart": "restart position_ids at {first} for each example (DataCollatorWithFlattening(return_position_ids=True) does)",
    "cu_agree": ("return position_ids and cu_seq_lens_q/k from the same segmentation "
                 "(DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True))"),
    "cu_form": "cu_seq_lens_q/k must run non-decreasing from 0 to the row's length (DataCollatorWithFlattening builds them)",
    "seq_agree": ("return seq_idx from the same segmentation as position_ids and cu_seq_lens_q "
                  "(DataCollatorWithFlattening(return_position_ids=True, return_seq_idx=True))"),
    "num_items": ("count num_items_in_batch as the scored label tokens after the shift ((labels[..., 1:] != -100).sum()) "
                  "over every micro-batch of the accumulation step, as transformers' Trainer does: never fewer than one "
                  "row's own"),
    "cu_qk": "for a packed row cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same examples)",
    "max_length": "max_length_q/k must be at least the longest example (DataCollatorWithFlattening sets it)",
    "labels": ("set labels to -100 at each example's first token, so no example is trained to predict the next one's "
               "start (DataCollatorWithFlattening(separator_id=-100) does)"),
    "empty": "drop empty examples before collating (the collator keeps them as a zero-length segment)",
    "cu_dtype": "build cu_seq_lens_q/k as torch.int32 (flash-attn's varlen kernels refuse int64; DataCollatorWithFlattening does)",
    "one_token": ("return position_ids that count up within each example (0, 1, 2, ... from each example's start; "
                  "DataCollatorWithFlattening(return_position_ids=True) builds them): ids that never count up make every "
                  "token an example of its own"),
}

#: Contract items (remedy keys) that cannot move a token's log-prob: they change what is scored, how the loss is
#: divided or add no token, the segmentation the model reads and the reference's being the same. A row whose
#: log-probs differ with only these broken has a cause of its own, which the probes name beside them.
LOGPROB_NEUTRAL = ("labels", "num_items", "empty", "cu_dtype")


@dataclass
class _Row:
    """A validated packed row: its keys, the example slices (from every segmentation the batch declares), the
    position id examples start at, the contract items ``(cause, text, remedy key)`` and notes."""

    batch: dict[str, Any]
    total: int
    slices: list[slice]
    items: list[tuple[str, str, str]]
    notes: list[str]
    first: int = 0
    #: example start (token index) -> its first position id, for examples whose position_ids start above ``first``:
    #: continuation chunks (a long document split across rows), run alone at those same positions
    continued: dict[int, int] = field(default_factory=dict)

    @property
    def problems(self) -> list[str]:
        return [text for _, text, _ in self.items]


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except Exception:  # noqa: BLE001 - a config whose text config cannot be read: its own attributes are used
        return config


def takes_mrope(text_config: Any) -> bool:
    """Whether a model of this text config reads multi-row M-RoPE position_ids ``(3|4, batch, length)``: its RoPE
    parameters (``rope_parameters`` in transformers 5.x, ``rope_scaling`` before) carry an ``mrope_section``
    (Qwen2-VL and its kin). Every other model takes ``(batch, length)`` position_ids."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope


def _shape(value: Any) -> str:
    import torch

    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


#: Keys holding one whole number for the row (DataCollatorWithFlattening's max_length_q/k, the Trainer's
#: num_items_in_batch): a Python int or a 0-d integer tensor.
_SCALAR_KEYS = ("max_length_q", "max_length_k", "num_items_in_batch")
#: Keys holding a switch: True, False or absent.
_FLAG_KEYS = ("use_cache", "fused_lm_head")
#: Token id dtypes an embedding takes (torch.nn.functional.embedding: Long or Int).
_ID_DTYPES = ("int64", "int32")


def _is_integer(dtype: Any) -> bool:
    """A whole-number dtype (int8 .. int64, uint8 ..): not float, complex or bool."""
    import torch

    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def model_device(model: Any) -> Any:
    """The device a batch must be on for ``model``: its input embeddings' weight (the first layer a batch meets;
    with a ``device_map`` the other layers move activations themselves), else its first parameter; None for a
    model without parameters."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = getter() if callable(getter) else None
    except Exception:  # noqa: BLE001 - a model whose embeddings cannot be read: its first parameter decides
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    if weight is not None and hasattr(weight, "device"):
        return weight.device
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return None if first is None else first.device


def refuse_meta_model(device: Any, refuse: Any) -> None:
    """Raise ``refuse(message)`` when ``device`` (:func:`model_device`) is the meta device: a model built under
    ``torch.device("meta")`` or ``init_empty_weights()`` holds no weights, so no forward can run. Hostile trial 5:
    the guard told the user to move the batch to 'meta' (then refused the meta batch), and
    ``verify_packed_logprobs`` called the run a "fail" with cause crash."""
    if device is not None and getattr(device, "type", None) == "meta":
        raise refuse("the model's weights are on the meta device (built under torch.device('meta') or "
                     "init_empty_weights(): no values, nothing can run): load them first, e.g. "
                     "AutoModelForCausalLM.from_pretrained(...), or model.to_empty(device='cpu') then "
                     "model.load_state_dict(...).")


def check_fields(batch: Any, device: Any = None) -> Any:
    """The batch's fields as a collator can hand them over, before any value is read (one packed row or a batch of
    packed rows): a mapping with string keys; ``input_ids`` a 2-D dense tensor of token-id dtype (int64 / int32), and
    no ``inputs_embeds`` beside it;
    every tensor dense and
    on input_ids' device (a 0-d CPU scalar may ride beside a CUDA batch, as torch allows), and input_ids on
    ``device`` (:func:`model_device`) when given; no meta tensor (it holds no values); every per-token key
    (:data:`TOKEN_KEYS`) given as a tensor of rank >= 2 with input_ids' ``(batch, length)`` as its last two dims
    (labels (1, 20) beside input_ids (1, 31) is a malformed batch, not a verdict); ``max_length_q/k`` and
    ``num_items_in_batch`` a whole number >= 0 (int or 0-d integer tensor; the count may be a whole 0-d float tensor,
    as transformers 5.24's Trainer hands it); ``use_cache`` / ``fused_lm_head``
    True or False. Returns ``input_ids``.

    Raises:
        PackcheckUsageError: the first field that breaks the above, one line naming the key, what it holds and the fix;
            first of all a model on the meta device (:func:`refuse_meta_model`).
    """
    import torch

    refuse_meta_model(device, _usage)
    if not isinstance(batch, Mapping):
        raise _usage(f"batch is a {type(batch).__name__}, expected a dict of tensors (the collator's output, e.g. "
                     "DataCollatorWithFlattening(return_position_ids=True)(features)).")
    odd = [k for k in batch if not isinstance(k, str)]
    if odd:
        raise _usage(f"batch has the key {odd[0]!r} ({type(odd[0]).__name__}): the model is called with batch as keyword "
                     "arguments, so every key is a str (input_ids, labels, position_ids, ...).")
    ids = batch.get("input_ids")
    if ids is None:
        raise _usage(f"batch has no 'input_ids' (keys: {', '.join(map(str, batch)) or 'none'}): pass the collator's output "
                     "(inputs_embeds is not supported).")
    if batch.get("inputs_embeds") is not None:  # the model refuses both ("exactly one of"): a crash verdict before
        raise _usage("batch has both 'input_ids' and 'inputs_embeds', which contradict each other (the model takes exactly "
                     "one of them): drop 'inputs_embeds'; the guard checks the packed row of token ids.")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise _usage(f"batch['input_ids'] is {_shape(ids) if isinstance(ids, torch.Tensor) else type(ids).__name__}, expected a "
                     "tensor of shape (1, total_tokens): one packed row (return_tensors='pt').")
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise _usage(f"batch[{key!r}] is a {value.layout} tensor: the model takes dense tensors; pass value.to_dense().")
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise _usage(f"batch[{key!r}] is on the meta device, which holds shapes but no values: build the batch from "
                         "real data on the model's device.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or str(ids.dtype).rsplit(".", 1)[-1] not in _ID_DTYPES:
        raise _usage(f"batch['input_ids'] has dtype {ids.dtype}: token ids are integers (torch.long, or torch.int32: the two an "
                     "embedding takes); collate with return_tensors='pt' from the tokenizer's ids.")
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.device == ids.device:
            continue
        if value.ndim == 0 and value.device.type == "cpu":
            continue  # a CPU scalar beside a CUDA batch: torch takes it
        raise _usage(f"batch[{key!r}] is on {value.device}, input_ids on {ids.device}: move the whole batch to the model's "
                     "device (batch = {k: v.to(device) for k, v in batch.items()}).")
    for key in TOKEN_KEYS:  # per-token keys run along input_ids' tokens: (batch, length) as the last two dims
        value = batch.get(key)
        if key != "input_ids" and isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[-2:] != ids.shape:
            raise _usage(f"batch[{key!r}] has shape {tuple(value.shape)}, input_ids {tuple(ids.shape)}: a per-token key runs "
                         f"along the row's tokens, so the batch is malformed; {CONTRACT_REMEDIES['lengths']}.")
    if device is not None and ids.device != device:
        raise _usage(f"batch['input_ids'] is on {ids.device}, the model's embeddings on {device}: move the batch to the "
                     f"model's device (batch = {{k: v.to({str(device)!r}) for k, v in batch.items()}}).")
    for key in _SCALAR_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        whole = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, torch.Tensor) and value.ndim == 0 and _is_integer(value.dtype))
        if key == "num_items_in_batch" and isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype.is_floating_point:
            number = float(value)  # transformers 5.24's Trainer hands a float32 count
            whole = math.isfinite(number) and number == int(number)
        if not whole or int(value) < 0:
            shown = f"a {_shape(value)} {value.dtype} tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise _usage(f"batch[{key!r}] is {shown}: expected a whole number >= 0 (an int or a 0-d integer tensor"
                         f"{', as DataCollatorWithFlattening(return_flash_attn_kwargs=True) sets it' if key != 'num_items_in_batch' else ', the count of scored label tokens'}).")
    for key in _FLAG_KEYS:
        if batch.get(key) is not None and not isinstance(batch.get(key), bool):
            raise _usage(f"batch[{key!r}] is {batch.get(key)!r}: expected True, False or no key.")
    return ids


def _cu_form_problems(cu: list[int], total: int) -> list[str]:
    """What keeps the offsets ``cu`` (cu_seq_lens_q) from running non-decreasing from 0 to ``total``, each named
    with its values ("decrease at index 2 (18 > 11)"); [] when they do. Offsets that do not end at ``total`` never
    get here: :func:`parse_row` refuses them as a malformed batch."""
    if len(cu) == 1:
        return [f"hold one offset, expected 0, ..., {total}"]
    out = [] if cu[0] == 0 else [f"start at {cu[0]}, not 0"]
    down = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if down is not None:
        out.append(f"decrease at index {down} ({cu[down - 1]} > {cu[down]})")
    return out


def _checked_ids(batch: Any, config: Any) -> tuple[Any, int, Any]:
    """``batch``'s ``input_ids``, the row length and the model's text config (None without ``config``), after every
    refusal of a malformed batch (:func:`parse_row`'s NotPackedError and PackcheckUsageError): the fields
    (:func:`check_fields`), one non-empty row, ids and labels inside the vocabulary, every per-token key a tensor of
    the row's rank, integer where it holds ids."""
    import torch

    ids = check_fields(batch)
    if ids.shape[0] != 1:
        raise NotPackedError(f"verify_packed_batch: batch['input_ids'] has shape {tuple(ids.shape)}: a packed row has shape "
                             "(1, total_tokens); pack with DataCollatorWithFlattening or SFTConfig(padding_free=True), which "
                             "put a batch into one row.")
    if int(ids.shape[1]) == 0:
        raise _usage("batch['input_ids'] has shape (1, 0): an empty row holds nothing to check; pass a row of at least two "
                     "non-empty examples.")
    total = int(ids.shape[1])
    text = _text_config(config) if config is not None else None
    vocab = getattr(text, "vocab_size", None)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        bad = low if low < 0 else high
        raise _usage(f"batch['input_ids'] holds token id {bad}, outside the model's vocabulary [0, {vocab}): pad input_ids "
                     "with the tokenizer's pad_token_id (-100 belongs in labels), and tokenize with this model's tokenizer.")
    for key in TOKEN_KEYS:
        value = batch.get(key)
        if value is None or key == "input_ids":
            continue
        if not isinstance(value, torch.Tensor):
            raise _usage(f"batch[{key!r}] is a {type(value).__name__}, expected a tensor of shape (1, {total}) like input_ids "
                         "(return_tensors='pt').")
        # multi-row M-RoPE ids only for a model that reads them (or one whose config is not known)
        mrope = key == "position_ids" and (text is None or takes_mrope(text))
        rank_ok = value.ndim == 2 or (mrope and value.ndim == 3 and value.shape[0] in (3, 4))
        if not rank_ok:
            if key == "position_ids" and not mrope:
                kind = getattr(text, "model_type", None) or type(text).__name__
                raise _usage(f"batch['position_ids'] has shape {tuple(value.shape)}, expected (1, {total}) (batch, length) "
                             f"like input_ids: a {kind} model reads no multi-row M-RoPE position_ids; pass one row of "
                             "positions restarting per example (DataCollatorWithFlattening(return_position_ids=True)).")
            raise _usage(f"batch[{key!r}] has shape {tuple(value.shape)}, expected (1, {total}) (batch, length) like input_ids"
                         f"{' (or (3|4, batch, length) M-RoPE ids)' if key == 'position_ids' else ''}.")
        if key in _INTEGER_KEYS and not _is_integer(value.dtype):
            raise _usage(f"batch[{key!r}] has dtype {value.dtype}: {key} are integers (torch.long); build them as ids, not "
                         f"{'booleans' if value.dtype == torch.bool else 'complex numbers' if value.dtype.is_complex else 'floats'}.")
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.numel():
        scored = labels[labels != IGNORE_INDEX]
        if scored.numel() and (int(scored.min()) < 0 or (isinstance(vocab, int) and int(scored.max()) >= vocab)):
            bad = int(scored.min()) if int(scored.min()) < 0 else int(scored.max())
            raise _usage(f"batch['labels'] holds {bad}, neither -100 (not scored) nor a token id of the model's vocabulary "
                         f"[0, {vocab}): mask labels with -100 (DataCollatorWithFlattening's separator_id=-100).")
    return ids, total, text


def _offsets(batch: Any, ids: Any, total: int, notes: list[str]) -> dict[str, list[int]]:
    """``cu_seq_lens_q`` / ``cu_seq_lens_k`` as lists of offsets, each refused unless a 1-D integer tensor ending at the
    row length ``total``; one that is not int32 adds a note to ``notes``."""
    import torch

    cu: dict[str, list[int]] = {}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.ndim != 1 or not _is_integer(value.dtype):
            what = f"{_shape(value)} {value.dtype}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise _usage(f"batch[{key!r}] is {what}: expected a 1-D int32 tensor of example offsets (0, ..., {total}) "
                         "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)).")
        cu[key] = [int(x) for x in value.tolist()]
        if not cu[key] or cu[key][-1] != total:
            end = f"end at {cu[key][-1]}" if cu[key] else "hold no offset"
            raise _usage(f"batch[{key!r}] {cu[key][:8]} (shape {_shape(value)}) {end}, input_ids {tuple(ids.shape)}: the offsets "
                         f"must end at the row length {total}, so the batch is malformed; {CONTRACT_REMEDIES['cu_form']}.")
        if value.dtype != torch.int32:
            notes.append(f"{key} dtype {value.dtype}, flash-attn 2.x needs torch.int32")
    return cu


def _position_starts(pos: Any, total: int, first: int, items: list[tuple[str, str, str]],
                     notes: list[str]) -> tuple[list[int], dict[int, int]]:
    """(the tokens the position_ids start an example at: every break in +1 steps; the continuation chunks among
    them, token -> first position). Adds to ``items`` ids that never count up or restart below the architecture's
    ``first`` position, and to ``notes`` the continuation chunks."""
    p = (pos[0, 0] if pos.ndim == 3 else pos[0]).tolist()
    pos_starts = [0] + [i for i in range(1, total) if p[i] != p[i - 1] + 1]
    # an example starting above the model's first position is a continuation chunk (a long document split across
    # rows): judged by what the model computes against it alone at the same positions, never by contract (issue
    # 41: the guard failed it as wrong_positions where the model computed it exactly); below it is wrong
    wrong = [s for s in pos_starts if p[s] < first]
    continued = {s: int(p[s]) for s in pos_starts if p[s] > first and len(pos_starts) < total}
    if continued:
        shown = ", ".join(f"token {s} from position {v}" for s, v in list(continued.items())[:4])
        notes.append(f"continuation chunk{'s' if len(continued) > 1 else ''} ({shown}): position_ids start above "
                     f"{first}, as a document continued from another row; judged against that example alone at the "
                     "same positions")
    if total > 1 and len(pos_starts) == total:
        # all 0 (a collator that zeroed them): every token restarts, so each is a one-token example with nothing
        # to predict; said first, ahead of the labels "at every start" it implies (trial 11, 98)
        items.append(("collator_contract", (f"position_ids never count up ({p[:6]}...): every one of the {total} "
                                           "tokens starts an example of its own (one-token examples)"), "one_token"))
    if wrong:
        items.append(("wrong_positions", (f"position_ids restart at {p[wrong[0]]}, below {first}, at token {wrong[0]} "
                                         f"({len(wrong)} of {len(pos_starts)} examples)"), "restart"))
    return pos_starts, continued


def _label_items(batch: Any, starts: list[int], items: list[tuple[str, str, str]], notes: list[str]) -> None:
    """Adds to ``items`` labels that are not -100 at an example start (unless every token is an example of its own)
    and a ``num_items_in_batch`` below the row's own scored label tokens (to ``notes`` where the Trainer may have
    divided it)."""
    import torch

    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not any(key == "one_token" for _, _, key in items):
        unmasked = [s for s in starts[1:] if int(labels[0, s]) != IGNORE_INDEX]
        if unmasked:
            items.append(("collator_contract", (f"labels not -100 at {len(unmasked)} example starts (token indices "
                                               f"{unmasked[:5]}): the trainer scores those tokens across the boundary"), "labels"))
    count = _int_or_none(batch.get("num_items_in_batch"))
    if count is not None and isinstance(labels, torch.Tensor):
        scored = int((labels[..., 1:] != IGNORE_INDEX).sum())
        if count < scored:
            said = (f"num_items_in_batch {count} is below this row's own {scored} scored label tokens (labels != -100 "
                    "after the shift): the loss is divided by too few tokens")
            if _count_may_be_divided():
                notes.append(f"{said}, unless the Trainer divided it (DataParallel // n_gpu; / tp * cp * sp size)")
            else:
                items.append(("collator_contract", said, "num_items"))


def parse_row(batch: Any, config: Any = None) -> _Row:
    """Validate ``batch`` as one packed row and split it into examples at every boundary the batch declares:
    the position_ids restarts (any break in +1 steps; the text row of ``(R, 1, N)`` M-RoPE ids), the
    ``cu_seq_lens_q`` offsets and the ``seq_idx`` changes. The per-example reference is built from this
    segmentation with true positions, so ids that restart wrong are measured, not copied into the reference.

    Contract items (each fails the batch with a cause code and a remedy, :data:`CONTRACT_REMEDIES`): position_ids
    that restart anywhere but at the architecture's
    first id (0; padding_idx + 1 for RoBERTa-likes), segmentations that disagree (``cu_seq_lens_q`` or ``seq_idx``
    starting examples elsewhere than the position_ids restarts, or ``seq_idx`` elsewhere than ``cu_seq_lens_q``),
    ``cu_seq_lens_q`` not starting at 0 or decreasing, ``cu_seq_lens_k`` unlike
    ``cu_seq_lens_q``, ``max_length_q`` below the longest example, zero-length examples, labels that are not -100
    at example starts, a ``num_items_in_batch`` below the row's own scored label tokens (a note instead where the
    Trainer may divide it: :func:`_count_may_be_divided`; a larger count is gradient accumulation's, never flagged). Notes (no verdict of their own): an attention_mask beside the row (the reruns measure
    it), ``cu_seq_lens_q`` not int32 (flash-attn 2.x refuses it; the packed run shows whether this backend does).

    Raises:
        NotPackedError: ``input_ids`` is ``(batch > 1, length)`` or nothing marks the row as packed (neither
            position_ids nor cu_seq_lens_q).
        PackcheckUsageError: a field :func:`check_fields` refuses (not a mapping, a non-str key, ``input_ids``
            missing or not a 2-D int64 / int32 tensor, a sparse or meta tensor, keys on different devices, a
            ``max_length_q/k`` / ``num_items_in_batch`` that is not a whole number, a non-bool ``use_cache``);
            ``input_ids`` empty ``(1, 0)`` or holding ids outside ``[0, vocab_size)``; a per-token key that is not
            a tensor or of the wrong rank; an integer key (labels, position_ids, seq_idx, token_type_ids) of float,
            complex or bool dtype; labels outside the vocabulary but -100; ``cu_seq_lens_q/k`` not a 1-D integer
            tensor or not ending at the row length; a per-token key whose length is not the row's (see
            :func:`check_fields`). One line naming the value, where it came from and the fix.
    """
    import torch

    from ..model.batches import position_ids_start

    ids, total, text = _checked_ids(batch, config)
    items: list[tuple[str, str, str]] = []
    notes: list[str] = []
    cu = _offsets(batch, ids, total, notes)
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) and "cu_seq_lens_q" not in cu:
        raise NotPackedError(f"verify_packed_batch: batch carries neither position_ids nor cu_seq_lens_q (keys: "
                             f"{', '.join(map(str, batch))}): it is not a packed row; use DataCollatorWithFlattening"
                             "(return_position_ids=True) or SFTConfig(padding_free=True).")
    first = position_ids_start(text) if text is not None and hasattr(text, "model_type") else 0
    boundaries = {0}
    #: every segmentation the batch declares, as (what it says, example starts, remedy key): they must agree
    segmentations: list[tuple[str, list[int], str]] = []
    continued: dict[int, int] = {}
    if isinstance(pos, torch.Tensor):
        pos_starts, continued = _position_starts(pos, total, first, items, notes)
        boundaries.update(pos_starts)
        segmentations.append(("position_ids restart at tokens", pos_starts, "restart"))
    cu_q = cu.get("cu_seq_lens_q")
    if cu_q is not None:
        wrong_form = _cu_form_problems(cu_q, total)
        if wrong_form:
            items.append(("collator_contract", f"cu_seq_lens_q {cu_q[:8]} {' and '.join(wrong_form)}", "cu_form"))
        else:
            if any(b == a for a, b in itertools.pairwise(cu_q)):
                items.append(("empty_example", f"cu_seq_lens_q {cu_q[:8]} hold a zero-length example", "empty"))
            cu_starts = sorted(set(cu_q[:-1]))
            boundaries.update(cu_starts)
            segmentations.append(("cu_seq_lens_q start examples at", cu_starts, "cu_agree"))
        cu_k = cu.get("cu_seq_lens_k")
        if cu_k is not None and cu_k != cu_q:
            items.append(("collator_contract", f"cu_seq_lens_k {cu_k[:8]} differ from cu_seq_lens_q {cu_q[:8]}", "cu_qk"))
    seq_idx = batch.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        s = seq_idx[0].tolist()
        seq_starts = [0] + [i for i in range(1, total) if s[i] != s[i - 1]]
        boundaries.update(seq_starts)
        segmentations.append(("seq_idx starts segments at", seq_starts, "seq_agree"))
    if segmentations:  # each against the first (position_ids where given): the model reads one, the reference all
        said, starts0, _ = segmentations[0]
        for text, other, key in segmentations[1:]:
            if other != starts0:
                items.append(("collator_contract", f"{said} {starts0[:8]}, {text} {other[:8]}", key))
    starts = sorted(b for b in boundaries if b < total)
    ends = [*starts[1:], total]
    longest = max(e - s for s, e in zip(starts, ends, strict=True))
    for key in ("max_length_q", "max_length_k"):
        number = _int_or_none(batch.get(key))
        if number is not None and number < longest:
            items.append(("collator_contract", f"{key} {number} is below the longest example ({longest} tokens)", "max_length"))
    _label_items(batch, starts, items, notes)
    if isinstance(batch.get("attention_mask"), torch.Tensor):
        notes.append("an attention_mask rides beside the packed row (eager/sdpa/flex then build no packed mask)")
    return _Row(dict(batch), total, [slice(s, e) for s, e in zip(starts, ends, strict=True)], items, notes, first,
                continued)


def _count_may_be_divided() -> bool:
    """True where transformers' Trainer may hand a num_items_in_batch below one row's own count: several processes
    (tensor / context / sequence parallel divide it by tp * cp * sp size) or several visible GPUs in one process
    (DataParallel: // n_gpu). Elsewhere it counts the whole accumulation step, never less than one row."""
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() > 1


def _targets(row: _Row) -> tuple[Any, Any]:
    """Next-token targets ``(1, total - 1)``: as the trainer scores them (the labels shifted, else the input_ids
    with -100 across example starts) and as the reference does (-100 across every example start)."""
    src = row.batch.get("labels")
    trainer = (row.batch["input_ids"] if src is None else src)[:, 1:].clone()
    reference = trainer.clone()
    for s in row.slices[1:]:
        reference[0, s.start - 1] = IGNORE_INDEX  # never score a token from the example before it
        if src is None:
            trainer[0, s.start - 1] = IGNORE_INDEX
    return trainer, reference


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _contract_remedy(row: _Row) -> str:
    keys = dict.fromkeys(key for _, _, key in row.items)
    return "; ".join(CONTRACT_REMEDIES[k].format(first=row.first) for k in keys)


def packed_rows(batch: Any) -> list[slice] | None:
    """The real-token span of each row of a ``(batch > 1, length)`` batch of packed rows: position_ids
    ``(batch, length)`` that step down between two real tokens of a row (a restart; ``attention_mask`` zeros are
    padding). None for one row, a padded batch of unpacked examples, or anything else.

    Raises:
        PackcheckUsageError: a row whose real tokens are not one run (padding inside the row).
    """
    import torch

    ids, pos = (batch.get("input_ids"), batch.get("position_ids")) if isinstance(batch, Mapping) else (None, None)
    if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[0] > 1 and isinstance(pos, torch.Tensor)
            and tuple(pos.shape) == tuple(ids.shape) and ids.shape[1] > 1):
        return None
    mask = batch.get("attention_mask")
    real = mask.bool() if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape) else torch.ones_like(ids, dtype=torch.bool)
    restarts = (pos[:, 1:] < pos[:, :-1]) & real[:, 1:] & real[:, :-1]
    if not bool(restarts.any()):
        return None
    spans = []
    for r in range(ids.shape[0]):
        where = real[r].nonzero().flatten().tolist()
        if not where or where != list(range(where[0], where[-1] + 1)):
            raise _usage(f"row {r} of the {tuple(ids.shape)} packed rows has padding between its tokens (attention_mask "
                         f"{real[r].int().tolist()[:12]}...): pad packed rows on one side only.")
        spans.append(slice(where[0], where[-1] + 1))
    return spans


def unpack_row(batch: Mapping[str, Any], slices: list[slice], pad_id: int, keep: list[int] | None = None) -> dict[str, Any]:
    """The packed row ``batch`` as a right-padded batch ``(num_examples, max_len)``: per-token keys split at
    ``slices`` (the examples ``keep``, default all) and padded (input_ids with ``pad_id``, labels with -100,
    the others with 0), an ``attention_mask`` of the real tokens, the packed-only keys (cu_seq_lens_q/k,
    max_length_q/k, seq_idx) dropped, every other key (num_items_in_batch, use_cache, ...) kept.

    Raises:
        PackcheckUsageError: ``batch`` not a mapping with a ``(1, seq_len)`` tensor ``input_ids``; ``slices`` not
            non-empty ``slice(start, stop)`` within the row; ``pad_id`` not an int; ``keep`` not indices of ``slices``.
    """
    import torch

    from ..errors import PackcheckUsageError

    def refuse(message: str) -> PackcheckUsageError:
        return PackcheckUsageError(f"unpack_row: {message}")

    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor) or batch["input_ids"].dim() != 2 \
            or batch["input_ids"].shape[0] != 1:
        raise refuse(f"batch is {type(batch).__name__ if not isinstance(batch, Mapping) else 'a mapping without a (1, seq_len) tensor input_ids'}: "
                     "pass one packed row, a dict with input_ids of shape (1, seq_len) (DataCollatorWithFlattening's output).")
    ids = batch["input_ids"]
    total = int(ids.shape[1])
    if not isinstance(pad_id, int) or isinstance(pad_id, bool):
        raise refuse(f"pad_id={pad_id!r} ({type(pad_id).__name__}): pass the tokenizer's pad_token_id, an int.")
    if not isinstance(slices, list | tuple) or not slices:
        raise refuse(f"slices={slices!r}: pass a non-empty list of slice(start, stop), one per packed example (parse_row(...).slices).")
    for s in slices:
        if not isinstance(s, slice) or not isinstance(s.start, int) or not isinstance(s.stop, int) or s.step not in (None, 1) \
                or not 0 <= s.start < s.stop <= total:
            raise refuse(f"slices holds {s!r}: each must be slice(start, stop) with 0 <= start < stop <= {total} (the row's length).")
    if keep is not None and not (isinstance(keep, list | tuple) and keep and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(slices) for i in keep)):
        raise refuse(f"keep={keep!r}: pass indices into slices (0 to {len(slices) - 1}), or None for every example.")
    chosen = [slices[i] for i in (keep if keep is not None else range(len(slices)))]
    width = max(s.stop - s.start for s in chosen)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "attention_mask"):
            continue
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (1, total):
            fill = pad_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            rows = value.new_full((len(chosen), width), fill)
            for r, s in enumerate(chosen):
                rows[r, : s.stop - s.start] = value[0, s]
            out[key] = rows
        else:
            out[key] = value
    mask = torch.zeros((len(chosen), width), dtype=torch.long, device=ids.device)
    for r, s in enumerate(chosen):
        mask[r, : s.stop - s.start] = 1
    out["attention_mask"] = mask
    return out
