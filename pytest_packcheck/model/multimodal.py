"""The text path of multimodal models with M-RoPE position_ids (Qwen2-VL and kin): their rotary sections in the
config and the shrink, and the layout a packed text row's position_ids take (:func:`position_layout`)."""

from __future__ import annotations

import copy
import inspect
from typing import Any

from .build_errors import TextPathError
from .tiny import TINY_HEAD_DIM, TINY_TOWER_DEPTH, TINY_TOWER_HEADS


def text_config_of(config: Any) -> Any:
    """The text decoder's config of a composite config (``get_text_config(decoder=True)``; transformers 4.x
    before the ``decoder`` keyword: ``get_text_config()``; a flat config, Qwen2-VL in 4.45 .. 4.51: itself)."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config(decoder=True)
    except TypeError:
        return config.get_text_config()


def rope_key(text: Any) -> str:
    """Where a text config keeps its rotary settings, ``mrope_section`` among them: ``rope_parameters``
    (transformers 5.0 renamed it), or ``rope_scaling`` on a config that has no ``rope_parameters`` (4.x)."""
    return "rope_parameters" if hasattr(text, "rope_parameters") else "rope_scaling"


def mrope_section_default(config: Any, class_name: str) -> list[str]:
    """Write the text model's built-in ``mrope_section`` into the text config's ``rope_parameters`` where the config
    leaves it out (transformers 5.24's default Qwen2-VL config: the rotary module falls back to [16, 24, 24]), so
    the shrink can scale it with the head size; returns the note for the model record ([] when the config has it,
    or no text rotary module names one)."""
    import sys

    import torch
    import transformers

    text = text_config_of(config)
    params = getattr(text, rope_key(text), None)
    if not isinstance(params, dict) or "mrope_section" in params:
        return []
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    # the model's own module, and its text model's (Glm46V reuses Glm4v's text model)
    text_model = MODEL_MAPPING_NAMES.get(getattr(text, "model_type", ""))
    classes = [getattr(transformers, c, None) for c in (class_name, text_model if isinstance(text_model, str) else None) if c]
    candidates = {name: obj for cls in classes if cls is not None for name, obj in vars(sys.modules[cls.__module__]).items()}
    for name, obj in sorted(candidates.items()):
        if not (isinstance(obj, type) and name.endswith("RotaryEmbedding") and "Vision" not in name):
            continue
        try:
            with torch.device("meta"):
                section = getattr(obj(copy.deepcopy(text)), "mrope_section", None)
        except Exception:  # noqa: BLE001, S112 - a rotary class of another sub-model (audio, vision under another name)
            continue
        if isinstance(section, list | tuple) and section and all(type(v) is int for v in section):
            params["mrope_section"] = list(section)
            return [(f"mrope_section={list(section)} ({name}'s built-in default, which the config leaves out; written "
                     "so the shrink scales it with the head size)")]
    return []


def flat_vocab_size(config: Any, class_name: str) -> list[str]:
    """Copy the text config's ``vocab_size`` to the top level of a composite config that has none, where the
    model's forward (``transformers.<class_name>.forward``) reads ``self.config.vocab_size``, as a checkpoint's
    config has it; returns the note for the model record ([] when nothing was set).

    transformers 4.52 .. 4.54: ``Qwen2VLForConditionalGeneration.forward`` passes ``vocab_size=self.config.vocab_size``
    to the loss, while the default ``Qwen2VLConfig()`` keeps it only in ``text_config`` (checkpoints' config.json
    are flat and have it), so every labelled forward of a default config raised ``AttributeError`` there; 5.x
    reads ``self.config.text_config.vocab_size`` and gets nothing set."""
    import inspect

    import transformers

    text = text_config_of(config)
    if text is config or hasattr(config, "vocab_size") or not isinstance(getattr(text, "vocab_size", None), int):
        return []
    forward = getattr(getattr(transformers, class_name, None), "forward", None)
    try:
        reads = forward is not None and "self.config.vocab_size" in inspect.getsource(forward)
    except (OSError, TypeError):  # no source (a compiled or dynamically made class): leave the config as it is
        reads = False
    if not reads:
        return []
    config.vocab_size = text.vocab_size
    return [(f"vocab_size={text.vocab_size} copied from text_config to the top level, as a checkpoint's config.json has "
             f"it ({class_name}.forward reads config.vocab_size for the loss; this release's default config keeps it "
             "only in text_config)")]


def scale_mrope_sections(d: dict[str, Any], hidden_key: str, heads_key: str, original: dict[str, int]) -> None:
    """Scale ``rope_parameters["mrope_section"]`` (multimodal RoPE: how many rotary frequencies the temporal, height
    and width positions each get) to the shrunk head: its sum is half the rotary dims (``torch.split`` of the
    frequencies by it in Qwen2-VL's ``recomposition_frequencies``, transformers 5.24), so it keeps its proportions
    and sums to the new half (largest remainders, every section at least one frequency). A section that did not
    sum to the old half (a default config that does not run at full size either) keeps that ratio."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else d.get("rope_scaling")  # 4.x
    section = params.get("mrope_section") if isinstance(params, dict) else None
    if not (isinstance(section, list) and section and all(type(v) is int and v > 0 for v in section)):
        return
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    factor = factor if isinstance(factor, int | float) and not isinstance(factor, bool) else 1.0

    def half(head_dim: int | None) -> int:
        return int((head_dim or 0) * factor) // 2

    old_heads, heads = original.get(heads_key), d.get(heads_key)
    old = half(original.get("head_dim") or (original.get(hidden_key, 0) // old_heads if old_heads else 0))
    new = half(d["head_dim"] if isinstance(d.get("head_dim"), int) else
               (d.get(hidden_key, 0) // heads if isinstance(heads, int) and heads else 0))
    if old <= 0 or new <= 0:
        return
    total = max(len(section), round(sum(section) * new / old))
    raw = [v * total / sum(section) for v in section]
    scaled = [max(1, int(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True):
        if sum(scaled) >= total:
            break
        scaled[i] += 1
    while sum(scaled) > total:  # the max(1, ...) floors overshot: take from the largest
        scaled[scaled.index(max(scaled))] -= 1
    params["mrope_section"] = scaled


def shrink_towers(d: dict[str, Any]) -> None:
    """Shrink the vision / audio towers of a composite config (``vision_config``, ``audio_config``) under the
    names the generic shrink does not know (Qwen2-VL's ``depth``, ``embed_dim``, ``num_heads``), and point their
    output width at the shrunk text model (``out_hidden_size``; Qwen2-VL's vision ``hidden_size`` is its
    merger's output). The text path never runs them; they only have to build small."""
    text = d.get("text_config")
    # a flat config (Qwen2-VL in transformers 4.45 .. 4.51: the text model's keys at the top, beside vision_config)
    width = text.get("hidden_size") if isinstance(text, dict) else d.get("hidden_size")
    if not isinstance(width, int):
        return
    for key, tower in d.items():
        if not (isinstance(tower, dict) and key != "text_config" and ("vision" in key or "audio" in key)):
            continue
        depth = tower.get("depth")
        if isinstance(depth, int) and depth > TINY_TOWER_DEPTH:
            tower["depth"] = depth = TINY_TOWER_DEPTH
            for name, value in list(tower.items()):  # block indices (deepstack, full-attention blocks): the last block
                if name.endswith(("_indexes", "_indices")) and isinstance(value, list) and value:
                    tower[name] = [TINY_TOWER_DEPTH - 1]
        if isinstance(tower.get("num_heads"), int):
            tower["num_heads"] = TINY_TOWER_HEADS
            if isinstance(tower.get("embed_dim"), int):  # Qwen2-VL: embed_dim is the tower, hidden_size its output
                tower["embed_dim"] = TINY_TOWER_HEADS * TINY_HEAD_DIM
                tower["hidden_size"] = width
            elif isinstance(tower.get("hidden_size"), int):
                tower["hidden_size"] = TINY_TOWER_HEADS * TINY_HEAD_DIM
        for name in ("out_hidden_size", "text_hidden_size", "output_dim"):
            if isinstance(tower.get(name), int):
                tower[name] = width


def mrope_section_mismatch(config: Any) -> tuple[str, str] | None:
    """(why, fix) when a multimodal config's text ``rope_parameters["mrope_section"]`` cannot run, else None. It must
    exist (HunYuan-VL's rotary has no built-in default: None in transformers 5.24's default config) and sum to half
    the rotary dims, head_dim x partial_rotary_factor / 2 (the text model splits its frequencies by it). 5.24's
    default GLM-4V config gives [8, 12, 12] (32) to heads of 128 rotary dims (64; its checkpoints set
    partial_rotary_factor 0.5); GLM-4.5V's and Qwen3-Omni's defaults leave head_dim to hidden / heads (42, 73;
    their checkpoints set 128). ``fix``: the override(s) that make it consistent."""
    text = text_config_of(config)
    key = rope_key(text)
    params = getattr(text, key, None)
    if key == "rope_scaling" and params is None:  # transformers 4.x: the attention reads rope_scaling["mrope_section"]
        # 4.57.6: Qwen2-VL's and GLM-4V's attention index rope_scaling["mrope_section"] at forward, Qwen3-VL's
        # rotary calls rope_scaling.get("mrope_section", ...) at build: neither runs on None
        return ("text rope_scaling is None, and its text model reads mrope_section from it (4.x has no default for it)",
                'rope_scaling={"type":"mrope","mrope_section":[...]} (its checkpoints\' value)')
    if not isinstance(params, dict):
        return None
    if params and all(isinstance(v, dict) for v in params.values()):
        # per layer type (Cohere Compass 5.16 on: rope_parameters["full_attention"]): each type's own section
        return next((m for m in (_section_mismatch(text, key, sub) for sub in params.values()) if m), None)
    return _section_mismatch(text, key, params)


def _section_mismatch(text: Any, key: str, params: dict) -> tuple[str, str] | None:
    """:func:`mrope_section_mismatch` of one rotary's parameters ``params`` (the text config's ``key`` dict, or one
    layer type's dict in it)."""
    section = params.get("mrope_section")
    if section is None:
        return (f"text {key} has no mrope_section, and its rotary module no built-in default",
                f"text_config.{key}.mrope_section=[...] (its checkpoints' value)")
    if not (isinstance(section, list) and section and all(type(v) is int for v in section)):
        return None
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
    factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None) or 1.0)
    if not isinstance(head_dim, int):
        return None
    half = int(head_dim * factor) // 2
    if sum(section) == half:
        return None
    fixes = [f"text_config.head_dim={round(2 * sum(section) / factor)}"]
    if 2 * sum(section) < head_dim:
        where = "rope_parameters." if key == "rope_parameters" else ""  # 4.x: an attribute of the text config
        fixes.append(f"text_config.{where}partial_rotary_factor={2 * sum(section) / head_dim:g}")
    why = (f"text {key} mrope_section {section} sums to {sum(section)} rotary frequencies, but its heads have "
           f"{half} (head_dim {head_dim} x partial_rotary_factor {factor} / 2)")
    return why, " or ".join(fixes)


def _text_only_rows(pos: Any, n: int) -> int | None:
    """Rows R of ``pos`` when it is int ids ``(R, 1, n)`` equal to 0..n-1 in every row (``(1, n)``: 0), else None."""
    import torch

    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point:
        return None
    expected = torch.arange(n, device=pos.device)
    if pos.ndim == 2 and tuple(pos.shape) == (1, n) and bool((pos == expected).all()):
        return 0
    if pos.ndim == 3 and tuple(pos.shape[1:]) == (1, n) and bool((pos == expected).all()):
        return int(pos.shape[0])
    return None


def position_layout(model: Any, resolved: Any) -> Any:
    """How the built model takes a packed row's position_ids (:class:`~.batches.PositionLayout`); ``resolved``: its
    :class:`~.resolve.ResolvedModel` (typed ``Any`` here: resolve imports this module).

    A causal LM: as the collator gives them, ``(batch, length)``. A multimodal model run on its text path: the
    packed layout its text model reads (``Qwen2VLTextModel.forward`` and its copies, transformers 4.54 .. 5.24:
    "prepend text-only position ids ... [4, bs, seq-len]"): a text row, whose restarts give the packed mask / flash
    boundaries, then the M-RoPE rows its own ``get_rope_index`` gives a text-only row (3: temporal, height, width,
    each 0..n-1). The rows are read from the model on a 5-token row, so another version's row count is followed,
    not assumed: ``get_rope_index`` on the model's inner ``*Model`` (``model.model``, transformers 4.52 on) or on
    the model itself (4.45 .. 4.51), called with the ids alone (its grid / mask arguments are optional in every
    release; one that needs more gives no rows). Whether a text row goes first is read from the model too: where
    its generate() lays rows out (``_prepare_position_ids_for_generation``, 5.x) that layout goes into the record
    beside it (the Qwen2-VL family: the same 4 rows; Cosmos3-Edge, HunYuan-VL: the M-RoPE rows without the text
    row), and without a usable ``get_rope_index`` it is the layout; where it has no such hook (4.x) the forward
    probe :func:`takes_text_row` decides (4.45 .. 4.53 refuse a 4th row: 3 rows; 4.54 on take it). The model's
    ``rope_deltas`` cache, which both set, is put back.

    Raises:
        TextPathError: neither gives int ids ``(R, 1, 5)`` (or ``(1, 5)``) equal to 0..4 in every row.
    """
    import torch

    from .batches import PLAIN_POSITIONS, PositionLayout

    if resolved.text_path is None:
        return PLAIN_POSITIONS
    n = 5
    ids = torch.arange(1, n + 1, device=next(model.parameters()).device)[None]
    owner = next((m for m in (getattr(model, "model", None), model) if m is not None and hasattr(m, "get_rope_index")), None)
    saved = getattr(owner, "rope_deltas", None)
    name = type(model).__name__
    hook = getattr(model, "_prepare_position_ids_for_generation", None)
    try:
        generate = _text_only_rows(hook(ids, {"input_ids": ids}), n) if hook is not None else None
        rope, failed = None, ""
        if owner is not None:
            params = inspect.signature(owner.get_rope_index).parameters
            kwargs = {"mm_token_type_ids": torch.zeros_like(ids)} if "mm_token_type_ids" in params else {}
            try:
                out = owner.get_rope_index(ids, **kwargs)
                rope = _text_only_rows(out[0] if isinstance(out, tuple) else out, n)
            except Exception as exc:  # noqa: BLE001 - another signature (audio lengths, ...): the generate() layout decides
                failed = f" (get_rope_index raised {type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
        text_row = takes_text_row(model, ids, rope) if rope and hook is None else None
    finally:
        if owner is not None and hasattr(owner, "rope_deltas"):
            owner.rope_deltas = saved
    made_by = {None: "packcheck cannot read", 0: "(batch, length)"}
    rope_source = f"the {rope} rows of {type(owner).__name__}.get_rope_index (text-only row)"
    if text_row is not None:  # no generate() hook (transformers 4.x): the forward probe decides
        taken, why = text_row
        return PositionLayout(rows=rope + 1 if taken else rope,
                              source=f"{'text row + ' if taken else ''}{rope_source}; {why}")
    if rope:
        seen = made_by.get(generate, f"{generate} rows") if generate != rope + 1 else "the same"
        return PositionLayout(rows=rope + 1, source=(
            f"text row + {rope_source}; its generate() ({name}._prepare_position_ids_for_generation) lays out {seen}"))
    if generate is not None:
        return PositionLayout(rows=generate or None, source=f"{name}._prepare_position_ids_for_generation (text-only row)")
    raise TextPathError(
        f"{resolved.model_type}: neither {name}.get_rope_index nor its generate() preparation gives text-only position_ids "
        f"(rows, 1, 5) of 0..4 in every row for a 5-token row{failed}: packcheck cannot lay out its packed text rows; give "
        "the config what it lacks (a checkpoint's config, or 'arch:<type>{key=value}'), run a causal-LM architecture "
        "instead, or report it to packcheck")


def takes_text_row(model: Any, ids: Any, rows: int) -> tuple[bool, str]:
    """Whether ``model`` reads ``rows + 1`` position_ids rows as a text row followed by its ``rows`` M-RoPE rows
    (what transformers 4.54 on does, ``Qwen2VLTextModel.forward``: ``position_ids.shape[0] == 4`` -> text row
    ``position_ids[0]``), and why, for the record. ``ids``: int64 ``(1, n)`` token ids, n >= 3.

    Two forwards of the one row with an all-ones attention_mask (so no packed mask is derived from either layout):
    M-RoPE rows ``S`` = 0, 2, 4, ... (not a shift of the text row ``T`` = 0..n-1, which RoPE could not tell apart)
    alone, and ``T`` then ``S``. The model takes the text row when the second runs and gives the first's logits
    (within 1e-5): rows 1.. are its M-RoPE rows. It does not when the second raises (4.45 .. 4.53: the rotary
    expands its frequencies to 3 rows, a shape error) or gives other logits (it read ``T`` as a rotary row), and
    none is assumed when the first raises (GLM-4.5V on 4.57.6's flash path: cu_seqlens from 3 x n ids), so the
    checks, not the layout reading, give that model its verdict.
    """
    import torch

    n = int(ids.shape[-1])
    spread = (torch.arange(n, device=ids.device) * 2)[None, None].expand(rows, 1, n)
    text = torch.arange(n, device=ids.device)[None, None]
    mask = torch.ones_like(ids)
    name = type(model).__name__
    with torch.no_grad():
        try:
            alone = model(input_ids=ids, attention_mask=mask, position_ids=spread.contiguous(), use_cache=False).logits
        except Exception as exc:  # noqa: BLE001 - a model that fails on its own rows: the checks give its verdict
            return False, (f"{name}.forward raised on its {rows} M-RoPE rows alone ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:100]}): no text row assumed")
        try:
            both = model(input_ids=ids, attention_mask=mask, position_ids=torch.cat([text, spread]), use_cache=False).logits
        except Exception as exc:  # noqa: BLE001 - the release's rotary takes exactly its M-RoPE rows
            return False, f"{name}.forward refuses a text row first ({rows + 1} rows: {type(exc).__name__}: {' '.join(str(exc).split())[:100]})"
    diff = float((both.float() - alone.float()).abs().max())
    if diff <= 1e-5:
        return True, f"{name}.forward takes a text row first ({rows + 1} rows give the {rows} M-RoPE rows' logits, {diff:.1e})"
    return False, f"{name}.forward reads a {rows + 1}th row as a rotary row (logits move by {diff:.1e}), not as a text row"
