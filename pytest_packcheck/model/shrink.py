"""Shrinking a config to a tiny one that keeps what changes the attention path (:func:`shrink_config`), and
saying which mechanisms the probe row still leaves unexercised (:func:`mechanism_gaps`)."""

from __future__ import annotations

import copy
import math
from typing import Any

from .configs import SPECIAL_TOKEN_KEYS as _SPECIAL_TOKEN_KEYS
from .multimodal import scale_mrope_sections, shrink_towers
from .tiny import (
    FIXED_SIZES,
    TINY_HEAD_DIM,
    TINY_HIDDEN,
    TINY_INDEX_KPOOL,
    TINY_INDEX_TOPK,
    TINY_SLIDING_WINDOW,
    TINY_VOCAB,
)

_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_k", "num_experts_per_token", "moe_topk")
_LOOP_SPLIT = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
_DROP_KEYS = ("quantization_config", "auto_map", "_name_or_path", "transformers_version")


def _is_index_list(value: Any, n_layers: int) -> bool:
    """A list of layer indices (moe_layers=[0, 1, ...]) rather than one entry per layer."""
    return (isinstance(value, list) and bool(value) and all(type(v) is int for v in value)
            and value == sorted(set(value)) and value[-1] < n_layers and len(set(value)) == len(value) and len(value) > 2)


def _layer_columns(d: dict[str, Any], n_layers: int) -> list[list[str]]:
    """Per-layer descriptions, one list per feature: every per-layer list of the config (layer_types,
    no_rope_layers, mlp_layer_types, ...), the ``per_layer_config`` overrides (gemma4, dots3: another head_dim or
    head count on some layers), and gemma3n's KV sharing (the last ``num_kv_shared_layers`` layers reuse the
    cache of an earlier layer of their type: each type must keep a producer and a consumer)."""
    columns = [[repr(item) for item in value] for value in d.values()
               if isinstance(value, list) and len(value) == n_layers and not _is_index_list(value, n_layers)]
    overrides = d.get("per_layer_config")
    if isinstance(overrides, dict):
        by_layer = {int(k): repr(v) for k, v in overrides.items() if str(k).isdigit()}
        columns.append([by_layer.get(i, "") for i in range(n_layers)])
    shared, types = d.get("num_kv_shared_layers"), d.get("layer_types")
    if isinstance(shared, int) and 0 < shared < n_layers and isinstance(types, list) and len(types) == n_layers:
        columns.append([f"{t}/{'consumer' if i >= n_layers - shared else 'producer'}" for i, t in enumerate(types)])
    return columns


#: Layer kinds whose layers share weights across the stack (zamba's shared transformer block in every
#: "hybrid" layer): two of them are kept, so the sharing itself is part of the shrunk model.
_SHARED_KINDS = ("'hybrid'",)


def _per_layer_indices(d: dict[str, Any], n_layers: int) -> list[int]:
    """Layers to keep: the first of each distinct value of every per-layer feature (see :func:`_layer_columns`),
    so a shrunk model still has every kind of layer (sliding and full, linear and full attention, conv, dense
    and MoE, NoPE, KV-shared, per-layer head sizes)."""
    keep = {0, 1} if n_layers > 1 else {0}
    if n_layers < 2:
        return sorted(keep)
    for value in d.values():  # layer index lists (bamba's attn_layer_indices, moe_layers): one of them
        if _is_index_list(value, n_layers):
            keep.add(value[0])
    for column in _layer_columns(d, n_layers):
        seen: dict[str, int] = {}
        for i, item in enumerate(column):
            if seen.get(item, 0) < (2 if item in _SHARED_KINDS else 1):
                keep.add(i)
            seen[item] = seen.get(item, 0) + 1
    return sorted(keep)


#: Head counts a model's own code divides by a number the config does not carry, by model_type: CodeGen's fused
#: qkv_proj is interleaved across ``mp_num = 4`` model-parallel shards (hard-coded in modeling_codegen), and
#: transformers 4.44 .. 5.19 reshape each shard to ``n_head // mp_num`` heads: 2 heads gave 0 heads per shard
#: ("shape '[1, 31, 4, 0, 16]' is invalid"). The shrink keeps the head count a multiple of it.
HEAD_MULTIPLES = {"codegen": 4}


def shrink_config(config: Any, keep_auto_map: bool = False, notes: list[str] | None = None,
                  sliding_window: int = TINY_SLIDING_WINDOW) -> Any:
    """A tiny copy of ``config`` that keeps what changes the attention path.

    Kept: GQA ratio (num_attention_heads / num_key_value_heads), explicit head_dim (set to 16), every distinct
    layer type (sliding / full / linear attention, NoPE layers), a sliding window (shortened to 8 tokens so the
    examples exceed it), softcapping, rope scaling parameters, MoE routing (4 experts), MLA ranks. Shrunk: layer
    count, hidden size, vocabulary (512; special token ids clamped into it).
    ``keep_auto_map``: keep the ``auto_map`` that remote-code models need to find their classes.
    ``sliding_window``: the window a longer one is shortened to (tokens; ``--packcheck-sliding-window``).
    ``notes``: receives one line per value the shrink set that is not a size (a required value the config left
    None), for the cell's model record.
    Returns a new config object (``config`` is not modified).
    """
    d = copy.deepcopy(config.to_dict())
    for key in _DROP_KEYS:
        if not (keep_auto_map and key in ("auto_map", "_name_or_path")):  # remote code needs both to find its classes
            d.pop(key, None)
    notes = notes if notes is not None else []
    _shrink_dict(d, dict(getattr(config, "attribute_map", {}) or {}), notes, sliding_window)
    try:
        rebuilt = type(config).from_dict(d)
    except (ValueError, TypeError) as exc:
        slim = _own_keys_of_sub_configs(config, d)
        if slim is None or "unknown" not in str(exc).lower() and "unexpected keyword" not in str(exc):
            raise
        # transformers 4.57's DbrxConfig cannot read back its own to_dict(): each nested sub-config's dict carries
        # every PretrainedConfig key, which DbrxAttentionConfig refuses ("Found unknown kwargs"). The sub-configs get
        # their own keys only; the cell then has a verdict, not a shrink_limit gap (issue 41)
        rebuilt = type(config).from_dict(slim)
        notes.append(f"{type(config).__name__} cannot read back its own to_dict() in this transformers (its sub-configs "
                     "refuse the common config keys): the shrink passed each sub-config its own keys only")
    return _cover_derived_layer_kinds(config, rebuilt, notes)


def _own_keys_of_sub_configs(config: Any, d: dict[str, Any]) -> dict[str, Any] | None:
    """``d`` with each nested sub-config's dict (an attribute of ``config`` that is a PretrainedConfig) reduced to the
    keys a bare PretrainedConfig does not have; None when ``config`` has no such sub-config."""
    from transformers import PretrainedConfig

    common = set(PretrainedConfig().to_dict()) - {"model_type"}
    out, changed = dict(d), False
    for key, value in d.items():
        if isinstance(value, dict) and isinstance(getattr(config, key, None), PretrainedConfig):
            out[key] = {k: v for k, v in value.items() if k not in common}
            changed = True
    return out if changed else None


#: The most layers :func:`_cover_derived_layer_kinds` gives a shrunk model to reach every layer kind.
_MAX_COVER_LAYERS = 8


def derived_layer_kinds(config: Any) -> dict[str, set[str]]:
    """Layer kinds a config derives rather than lists: every property that returns one string per layer
    (jamba's ``layers_block_type`` from ``attn_layer_period`` / ``attn_layer_offset``, recurrent_gemma's from its
    cycled ``block_types``), by property name. Serialised per-layer lists are covered by the shrink itself."""
    from transformers import PretrainedConfig

    n_layers = getattr(config, "num_hidden_layers", None)
    kinds: dict[str, set[str]] = {}
    if not isinstance(n_layers, int):
        return kinds
    # the base class's own properties describe no layers, and some only warn (5.x: torch_dtype, use_return_dict
    # log "is deprecated! Use dtype instead!" on every read: `packcheck bench` printed it)
    generic = {n for k in PretrainedConfig.__mro__ for n, v in vars(k).items() if isinstance(v, property)}
    for name in dir(type(config)):
        if name in generic or not isinstance(getattr(type(config), name, None), property):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001, S112 - a property that cannot be read describes no layers
            continue
        if isinstance(value, list | tuple) and len(value) == n_layers and value and all(isinstance(v, str) for v in value):
            kinds[name] = set(value)
    return kinds


def _cover_derived_layer_kinds(original: Any, shrunk: Any, notes: list[str]) -> Any:
    """Give ``shrunk`` more layers (at most :data:`_MAX_COVER_LAYERS`, never more than ``original``) until it has
    every derived layer kind ``original`` has (see :func:`derived_layer_kinds`): two layers of jamba's default
    config are both mamba (its attention layer is layer 4 of every 8) and two of recurrent_gemma's both recurrent,
    so a tiny model without attention would "pass" or fail on a model that is not the architecture's. Records
    the change in ``notes``; returns ``shrunk`` unchanged when nothing is missing or no count reaches them all."""
    want = derived_layer_kinds(original)
    n_shrunk, n_original = getattr(shrunk, "num_hidden_layers", None), getattr(original, "num_hidden_layers", None)
    if not want or not isinstance(n_shrunk, int) or not isinstance(n_original, int):
        return shrunk

    def missing(cfg: Any) -> set[str]:
        have = derived_layer_kinds(cfg)
        return set().union(*(kinds - have.get(name, set()) for name, kinds in want.items()))

    lacking = missing(shrunk)
    if not lacking:
        return shrunk
    d = shrunk.to_dict()
    for n in range(n_shrunk + 1, min(n_original, _MAX_COVER_LAYERS) + 1):
        d["num_hidden_layers"] = n
        candidate = type(shrunk).from_dict(d)
        if not missing(candidate):
            notes.append(f"shrink: {n} layers instead of {n_shrunk}, so the tiny model has the {', '.join(sorted(lacking))} "
                         "layer(s) the architecture has")
            return candidate
    return shrunk


def _shrink_dict(d: dict[str, Any], amap: dict[str, str], notes: list[str], sliding_window: int = TINY_SLIDING_WINDOW) -> None:
    """Shrink one config dict in place, then every nested sub-config (text_config, vision_config, ...) of a
    composite model."""
    for key, value in d.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            # nested configs serialise the generic keys too; 5.17's DbrxFFNConfig rejects them as unknown kwargs
            for drop in (*_DROP_KEYS, "output_attentions"):
                value.pop(drop, None)
            if key not in ("attn_config", "ffn_config"):
                _shrink_dict(value, {}, notes, sliding_window)

    def real(key: str) -> str:
        return amap.get(key, key) if key not in d and amap.get(key, key) in d else key

    original = {k: v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)}

    # layers
    layer_key = next((real(k) for k in _LAYER_COUNT_KEYS if real(k) in d), None)
    types = d.get("layer_types")
    if layer_key and isinstance(types, list) and "mlp" in types and all(isinstance(d.get(k), int) for k in _LOOP_SPLIT):
        # dory's released configs list attention and mlp blocks as separate entries, one pair per layer, which
        # its config halves on load: halve here first, so the shrink keeps whole layers
        d["layer_types"], d[layer_key] = types[::2], int(d[layer_key]) // 2
    if layer_key is not None:
        n_layers = int(d[layer_key])
        keep = _per_layer_indices(d, n_layers)
        for key, value in list(d.items()):
            if _is_index_list(value, n_layers):  # renumber layer indices into the kept layers
                d[key] = [keep.index(i) for i in value if i in keep]
            elif isinstance(value, list) and len(value) == n_layers and n_layers > 1:
                d[key] = [value[i] for i in keep]
        if isinstance(d.get("per_layer_config"), dict):  # renumbered into the kept layers; sizes scaled below
            d["per_layer_config"] = {str(keep.index(int(k))): v for k, v in d["per_layer_config"].items()
                                     if str(k).isdigit() and int(k) in keep}
        shared = d.get("num_kv_shared_layers")
        if isinstance(shared, int) and shared > 0:  # every layer shared: gemma4's assistant models
            d["num_kv_shared_layers"] = sum(1 for i in keep if i >= n_layers - shared)
        d[layer_key] = len(keep)
        if all(isinstance(d.get(k), int) for k in _LOOP_SPLIT):  # dory: input + recurrent + output == layers
            d["n_input_layers"], d["n_output_layers"] = 1, 1
            d["n_recurrent_layers"] = len(keep) - 2
        for key in ("first_k_dense_replace", "max_window_layers"):
            if isinstance(d.get(key), int):
                d[key] = min(d[key], 1)
        if isinstance(d.get("no_rope_layer_interval"), int):
            d["no_rope_layer_interval"] = min(d["no_rope_layer_interval"], 2)

    # heads, keeping the GQA ratio
    heads_key = real("num_attention_heads")
    if heads_key in d and isinstance(d[heads_key], int):
        n_heads = d[heads_key]
        kv_key = next((k for k in ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num") if isinstance(d.get(k), int)), None)
        n_kv = d[kv_key] if kv_key else n_heads
        if d.get("multi_query") is True:
            n_kv = 1
        ratio = max(1, n_heads // max(1, n_kv))
        new_kv = 2 if ratio <= 4 else 1
        new_heads = new_kv * ratio
        if new_heads > 16:
            new_heads, new_kv = 16, max(1, 16 // ratio)
        multiple = HEAD_MULTIPLES.get(str(d.get("model_type")))
        if multiple and new_heads % multiple:  # whole heads on every shard the model's code splits them across
            new_heads = multiple * math.ceil(new_heads / multiple)
            new_kv = max(1, new_heads // ratio)
        d[heads_key] = new_heads
        if kv_key:
            d[kv_key] = new_kv
        explicit_head_dim = isinstance(d.get("head_dim"), int)
        hidden = new_heads * TINY_HEAD_DIM
        if explicit_head_dim:
            d["head_dim"] = TINY_HEAD_DIM
            # hidden != heads * head_dim where the config allows it (gemma), but a multiple of the head count,
            # which several configs validate (cwm, iquestcoder: 6 and 5 heads)
            hidden = TINY_HIDDEN if TINY_HIDDEN % new_heads == 0 else new_heads * TINY_HEAD_DIM
            if d.get(real("hidden_size")) == n_heads * original.get("head_dim", 0):
                hidden = new_heads * TINY_HEAD_DIM  # hidden == heads x head_dim, which helium's o_proj assumes
        hidden_key = real("hidden_size")
        if hidden_key in d:
            d[hidden_key] = hidden
        if isinstance(d.get("query_pre_attn_scalar"), int | float):
            d["query_pre_attn_scalar"] = TINY_HEAD_DIM
    elif real("hidden_size") in d:
        d[real("hidden_size")] = TINY_HIDDEN

    if "qk_rope_head_dim" in d:  # MLA: head_dim is the rope part, qk_head_dim the sum
        d["qk_rope_head_dim"], d["qk_nope_head_dim"] = FIXED_SIZES["qk_rope_head_dim"], FIXED_SIZES["qk_nope_head_dim"]
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
        if "head_dim" in d:  # the rope part (deepseek), or the whole q/k head where it says so (dots3's SWA layers)
            whole = original.get("head_dim") == original.get("qk_rope_head_dim", 0) + original.get("qk_nope_head_dim", 0)
            d["head_dim"] = d["qk_rope_head_dim"] + (d["qk_nope_head_dim"] if whole else 0)

    def fix(sub: dict[str, Any]) -> None:
        for key, value in FIXED_SIZES.items():
            if key in ("qk_rope_head_dim", "qk_nope_head_dim"):
                continue
            if isinstance(sub.get(key), int) and not isinstance(sub.get(key), bool) and sub[key] > 0:
                sub[key] = value if key != "num_experts_per_tok" else min(sub[key], 2)
            elif isinstance(sub.get(key), list) and sub[key] and all(type(v) is int for v in sub[key]):
                sub[key] = [value if v > 0 else v for v in sub[key]]  # one size per layer (gemma3n)
        for key in _TOP_K_KEYS:  # experts per token, under each config's own name
            if isinstance(sub.get(key), int) and not isinstance(sub.get(key), bool):
                sub[key] = min(sub[key], 2)

    fix(d)
    for value in d.values():
        if isinstance(value, dict):
            fix(value)
    # dbrx keeps its sizes in sub-configs under other names
    if isinstance(d.get("ffn_config"), dict):
        d["ffn_config"]["ffn_hidden_size"] = 2 * TINY_HIDDEN
    # transformers 5.24: DbrxConfig() builds an attn_config without rope_theta, which modeling_dbrx reads
    # (AttributeError at build). Hub configs carry it; give the default config the top-level value.
    if isinstance(d.get("attn_config"), dict) and "rope_theta" not in d["attn_config"]:
        theta = (d.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            d["attn_config"]["rope_theta"] = theta

    _derived_sizes(d, real("hidden_size"), heads_key, original)
    _fill_required(d, real("hidden_size"), heads_key, notes)
    scale_mrope_sections(d, real("hidden_size"), heads_key, original)
    shrink_towers(d)

    text, global_ = d.get("text_config"), d.get("global_config")
    for tower in (v for v in d.values() if isinstance(v, dict)):
        if isinstance(tower.get("adapter_out_dim"), int) and isinstance(text, dict):
            tower["adapter_out_dim"] = text.get("hidden_size", TINY_HIDDEN)
        if isinstance(tower.get("hidden_size_global"), int) and isinstance(global_, dict):
            tower["hidden_size_global"] = global_.get("hidden_size", TINY_HIDDEN)  # blt: local <-> global model

    # no dropout: checks compare runs token by token, and call the model in train mode as trainers do
    for sub in [d, *[v for v in d.values() if isinstance(v, dict)]]:
        for key, value in list(sub.items()):
            # also MoE router jitter (phimoe, switch): train-mode noise would make packed and reference runs differ
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key or "jitter" in key) and value > 0:
                sub[key] = 0.0

    # sliding window: shorter than the examples, so the window is exercised on every packed row
    for key in ("sliding_window", "attention_window_size", "attention_chunk_size"):
        if isinstance(d.get(key), int) and d[key] > sliding_window:
            notes.append(f"mechanism: {key} {d[key]} -> {sliding_window} tokens (shorter than the probe examples, so it "
                         "acts inside the packed row)")
            d[key] = sliding_window
    _shrink_selection(d, notes)

    # vocabulary (marian: the decoder's own vocabulary too, which its lm_head and loss use)
    if isinstance(d.get("decoder_vocab_size"), int) and d["decoder_vocab_size"] > TINY_VOCAB:
        d["decoder_vocab_size"] = TINY_VOCAB
    if isinstance(d.get("vocab_size"), int) and d["vocab_size"] > TINY_VOCAB:
        d["vocab_size"] = TINY_VOCAB
        for key in _SPECIAL_TOKEN_KEYS:
            value = d.get(key)
            if isinstance(value, int) and value >= TINY_VOCAB:
                d[key] = TINY_VOCAB - 1 - _SPECIAL_TOKEN_KEYS.index(key)
            elif isinstance(value, list):
                d[key] = [v if v < TINY_VOCAB else TINY_VOCAB - 1 for v in value]


def _shrink_selection(d: dict[str, Any], notes: list[str]) -> None:
    """Top-k selection and MoE routing small enough to act in a row of a few dozen tokens, each value set recorded in
    ``notes``. ``index_topk`` -> :data:`TINY_INDEX_TOPK` (and ``index_kpool`` -> :data:`TINY_INDEX_KPOOL` where the
    config pools keys); the experts (:data:`TINY_EXPERTS`, 2 per token, set with the sizes) are only recorded."""
    topk = d.get("index_topk")
    if isinstance(topk, int) and not isinstance(topk, bool) and topk > TINY_INDEX_TOPK:
        pool = d.get("index_kpool")
        if isinstance(pool, int) and pool > TINY_INDEX_KPOOL:
            notes.append(f"mechanism: index_kpool {pool} -> {TINY_INDEX_KPOOL} (index_topk must be a multiple of it)")
            d["index_kpool"] = TINY_INDEX_KPOOL
        notes.append(f"mechanism: index_topk {topk} -> {TINY_INDEX_TOPK} (below the shortest probe example, so the "
                     "sparse-attention indexer selects among an example's keys)")
        d["index_topk"] = TINY_INDEX_TOPK
    experts = next((d[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > 0), None)
    per_token = next((d[k] for k in _TOP_K_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    if experts and per_token:
        notes.append(f"mechanism: MoE {experts} experts, {per_token} per token (tokens of the row compete for them)")


#: Mechanisms that only act when shorter than the row: (config key, what it is, compared with: the shortest or the
#: longest example). A value the shrink could not bring below its bound is named in the cell's config_notes.
MECHANISM_BOUNDS = (
    ("index_topk", "top-k selection", "shortest"),
    ("sliding_window", "sliding window", "longest"),
    ("attention_window_size", "sliding window", "longest"),
    ("attention_chunk_size", "chunked attention", "longest"),
)


def mechanism_gaps(config: Any, lengths: tuple[int, ...]) -> list[str]:
    """The mechanisms of a (shrunk) ``config`` and its sub-configs the probe row of ``lengths`` (tokens) never
    exercises, one line each ("index_topk 2048 >= example 7: top-k selection not exercised"): a top-k as large as the
    shortest example selects every key, a window or chunk as long as the longest example never cuts; MoE routing
    with as many experts per token as experts never chooses. [] when every mechanism acts."""
    return [line for _, line in mechanism_gap_items(config, lengths)]


def mechanism_gap_items(config: Any, lengths: tuple[int, ...]) -> list[tuple[str, str]]:
    """:func:`mechanism_gaps` with a short label beside each line: ``(label, line)``, the label what a matrix cell's
    qualifier says ("sliding window 4096 >= longest example 13"; "MoE routing, 2 of 2 experts per token")."""
    out: list[tuple[str, str]] = []
    shortest, longest, total = min(lengths), max(lengths), sum(lengths)
    subs = [config, *(v for v in getattr(config, "__dict__", {}).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))]

    def read(sub: Any, key: str) -> Any:
        try:  # dots3_note's per-layer configs refuse a global read of a per-layer key (5.24)
            return getattr(sub, key, None)
        except Exception:  # noqa: BLE001 - unreadable globally: nothing to compare
            return None

    for sub in subs:
        for key, what, bound in MECHANISM_BOUNDS:
            value = read(sub, key)
            limit = shortest if bound == "shortest" else longest
            if isinstance(value, int) and not isinstance(value, bool) and value >= limit:
                out.append((f"{what} {value} >= {bound} example {limit}",
                            f"not exercised: {key} {value} >= the {bound} example ({limit} tokens, row {total}): {what} "
                            + "does not act in the probe row"))
        experts = next((read(sub, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if isinstance(read(sub, k), int) and read(sub, k) > 0), None)
        per_token = next((read(sub, k) for k in _TOP_K_KEYS if isinstance(read(sub, k), int)), None)
        if experts and per_token and per_token >= experts:
            out.append((f"MoE routing, {per_token} of {experts} experts per token",
                        f"not exercised: {per_token} experts per token of {experts}: MoE routing never chooses"))
    return list(dict.fromkeys(out))


def _derived_sizes(d: dict[str, Any], hidden_key: str, heads_key: str, original: dict[str, int]) -> None:
    """Sizes a config derives from hidden_size and the head count, set again after the shrink: ``from_dict``
    keeps the serialised values rather than deriving them (zamba2's mamba_headdim stayed 640 with hidden 32),
    and several configs validate them (bamba, mamba2: heads x head size == expand x hidden; xlnet: d_head)."""
    hidden, heads = d.get(hidden_key), d.get(heads_key)
    if not isinstance(hidden, int):
        return
    # twin keys a config keeps equal to hidden_size / the layer count (xlstm: embedding_dim, num_blocks), both
    # serialised: the shrink set one, so set the other (the tiny xlstm crashed on 4096 vs 64)
    for twin, of in (("embedding_dim", hidden_key), ("num_blocks", next((k for k in _LAYER_COUNT_KEYS if k in d), ""))):
        if (isinstance(d.get(twin), int) and isinstance(original.get(of), int) and twin != of
                and original.get(twin) == original[of]):
            d[twin] = d[of]
    expand = d.get("mamba_expand", d.get("expand"))
    if isinstance(expand, int | float) and not isinstance(expand, bool):
        inner = int(expand * hidden)
        if isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_head"), int) and "mamba_d_ssm" not in d:
            d["mamba_d_head"] = max(1, inner // d["mamba_n_heads"])  # bamba, granitemoehybrid
        if isinstance(d.get("mamba_num_heads"), int) and isinstance(d.get("mamba_head_dim"), int):
            _shrink_nemotron_h_mixer(d, inner)
        if isinstance(d.get("n_mamba_heads"), int) and "mamba_headdim" in d:  # zamba2
            d["mamba_headdim"] = max(1, inner // d["n_mamba_heads"])
            if isinstance(d.get("chunk_size"), int) and d["chunk_size"] > SSD_CHUNK:
                # 256 at full size: the CPU scan padded the 31-token row to 256 (4x the CPU of 16, issue 47), and
                # the whole row sat in one chunk; 16 also carries the state from chunk to chunk across a boundary
                d["chunk_size"] = SSD_CHUNK
        if isinstance(d.get("num_heads"), int) and isinstance(d.get("head_dim"), int) and heads_key not in d:
            d["num_heads"] = max(1, inner // d["head_dim"])  # mamba2: num_heads x head_dim == expand x hidden
            if isinstance(d.get("n_groups"), int):
                d["n_groups"] = math.gcd(d["n_groups"], d["num_heads"])
    if isinstance(heads, int) and heads > 0:
        if isinstance(d.get("attention_hidden_size"), int):  # zamba, zamba2: attention on [hidden, residual]
            d["attention_hidden_size"] = 2 * hidden
            if isinstance(d.get("attention_head_dim"), int):
                d["attention_head_dim"] = 2 * hidden // heads
        for key in ("kv_channels", "d_head"):  # zamba2, xlnet
            if isinstance(d.get(key), int):
                d[key] = hidden // heads
        if isinstance(d.get("num_query_groups"), int) and original.get("num_query_groups") == original.get(heads_key):
            d["num_query_groups"] = heads
    for key in ("adapter_in_dim", "adapter_input_size"):  # dots3's vision / audio adapters: tower -> text model
        if isinstance(d.get(key), int):
            d[key] = hidden
    # partial rotary as an absolute size (gptj, codegen: rotary_dim 64 of a 256 head): the same fraction of the
    # shrunk head, or every backend crashes on a rotary part wider than the head
    old_heads = original.get(heads_key)
    if isinstance(d.get("rotary_dim"), int) and isinstance(old_heads, int) and isinstance(heads, int) and heads > 0:
        old_head_dim = original.get("head_dim") or original.get(hidden_key, 0) // max(1, old_heads)
        new_head_dim = d["head_dim"] if isinstance(d.get("head_dim"), int) else hidden // heads
        if old_head_dim:
            d["rotary_dim"] = max(2, 2 * round(d["rotary_dim"] * new_head_dim / old_head_dim / 2))
    if isinstance(d.get("mamba_dt_rank"), int):
        d["mamba_dt_rank"] = math.ceil(hidden / 16)
    # per-layer overrides (gemma4: head_dim 512 on full-attention layers; dots3: half the heads on some layers):
    # scaled by the same factor as the top-level value they override, so the difference survives the shrink
    for layer_cfg in (d.get("per_layer_config") or {}).values():
        if not isinstance(layer_cfg, dict):
            continue
        for key, value in list(layer_cfg.items()):
            old, new = original.get(key), d.get(key)
            if type(value) is int and isinstance(old, int) and old > 0 and isinstance(new, int):
                layer_cfg[key] = max(1, round(value * new / old))
        nope = layer_cfg.get("qk_nope_head_dim")
        if isinstance(nope, int) and "head_dim" in d and original.get("head_dim") == (
                original_layer_nope(layer_cfg, nope, original, d) + original.get("qk_rope_head_dim", -1)):
            # dots3: the sliding layers' head_dim is their own nope part plus the shared rope part
            d["head_dim"] = nope + d["qk_rope_head_dim"]


#: The chunk (tokens) of a mamba2 mixer's SSD scan after the shrink, where the config names it ``chunk_size`` (zamba2,
#: nemotron_h; ``mamba_chunk_size`` of the other hybrids is in FIXED_SIZES): shorter than the probe row, so one
#: boundary falls inside a chunk and the state crosses from chunk to chunk.
SSD_CHUNK = FIXED_SIZES["mamba_chunk_size"]
#: nemotron_h's B / C groups after the shrink (each shared by several heads, as at full size: 8 groups of 16 heads).
NEMOTRON_H_GROUPS = 2


def _shrink_nemotron_h_mixer(d: dict[str, Any], inner: int) -> None:
    """nemotron_h's mamba2 mixer (transformers 5.3+ ``NemotronHMamba2Mixer``: intermediate = mamba_num_heads x
    mamba_head_dim, B / C of n_groups x ssm_state_size, the SSD scan in chunks of chunk_size): heads x head size ==
    ``inner`` (expand x hidden, as at full size), :data:`NEMOTRON_H_GROUPS` groups, chunks of :data:`SSD_CHUNK`
    tokens, shorter than the probe row (31 tokens), so the scan both runs within a chunk across a boundary and carries
    the state from one chunk to the next; the conv kernel (4) is kept. The heads and the state size come from
    :data:`FIXED_SIZES`. Full size, the CPU scan materialises chunk x chunk x heads x state per chunk (128^4 floats,
    1 GiB), ~1.7 h of the atlas's CPU (issue 47)."""
    heads = d["mamba_num_heads"]
    d["mamba_head_dim"] = max(1, inner // heads)
    if isinstance(d.get("n_groups"), int) and d["n_groups"] > 1:
        d["n_groups"] = math.gcd(NEMOTRON_H_GROUPS, heads)
    if isinstance(d.get("chunk_size"), int) and d["chunk_size"] > SSD_CHUNK:
        d["chunk_size"] = SSD_CHUNK


def _fill_required(d: dict[str, Any], hidden_key: str, heads_key: str, notes: list[str]) -> None:
    """Values a config leaves None that its model divides or indexes by (transformers 5.24's default configs of
    hunyuan_v1_dense, ministral: head_dim; nemotron: num_key_value_heads; deepseek_v2: num_experts_per_tok):
    set to what a checkpoint's config.json gives, and said in ``notes``."""
    hidden, heads = d.get(hidden_key), d.get(heads_key)
    fills: dict[str, Any] = {}
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        if "head_dim" in d and d["head_dim"] is None:
            fills["head_dim"] = hidden // heads
        if "num_key_value_heads" in d and d["num_key_value_heads"] is None:
            fills["num_key_value_heads"] = heads
    experts = next((d[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if isinstance(d.get(k), int)), None)
    if experts and "num_experts_per_tok" in d and d["num_experts_per_tok"] is None:
        fills["num_experts_per_tok"] = min(2, experts)
    for key, value in fills.items():
        d[key] = value
        notes.append(f"{key}={value} (None in the config, which its model cannot build or run with)")


def original_layer_nope(layer_cfg: dict[str, Any], nope: int, original: dict[str, int], d: dict[str, Any]) -> int:
    """The per-layer qk_nope_head_dim before :func:`_derived_sizes` scaled it."""
    old, new = original.get("qk_nope_head_dim"), d.get("qk_nope_head_dim")
    return round(nope * old / new) if isinstance(old, int) and isinstance(new, int) and new else nope
