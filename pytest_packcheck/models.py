"""Building models: a Hub ID / local directory / architecture name -> config -> (shrunk) model.

``--packcheck-weights=random`` reads only ``config.json`` (through ``AutoConfig.from_pretrained``, so the real
Hub loading and caching code runs), shrinks it with :func:`shrink_config` and builds random weights;
``pretrained`` loads the real weights with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PackcheckUsageError
from .specs import ModelSpec

# Target sizes of a shrunk config. Small enough for a 2-core CPU, big enough that every attention feature
# still has room to matter (several heads per KV head, a window shorter than the examples).
TINY_HEAD_DIM = 16
TINY_HIDDEN = 64
TINY_VOCAB = 512
TINY_SLIDING_WINDOW = 8
TINY_EXPERTS = 4

# Keys set to a fixed small value when present (top level and in nested sub-configs such as dbrx's).
_FIXED = {
    "intermediate_size": 2 * TINY_HIDDEN,
    "ffn_hidden_size": 2 * TINY_HIDDEN,
    "ffn_dim": 2 * TINY_HIDDEN,
    "intermediate_size_mlp": 2 * TINY_HIDDEN,
    "n_inner": 2 * TINY_HIDDEN,
    "moe_intermediate_size": TINY_HIDDEN // 2,
    "shared_expert_intermediate_size": TINY_HIDDEN // 2,
    "num_experts": TINY_EXPERTS,
    "num_local_experts": TINY_EXPERTS,
    "n_routed_experts": TINY_EXPERTS,
    "moe_num_experts": TINY_EXPERTS,
    "n_group": 1,
    "num_expert_group": 1,  # kimi_linear, bailing_hybrid (n_group under another name)
    "topk_group": 1,
    # MLA (deepseek_v3): keep the split into rope / no-rope parts, at a small size.
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": TINY_HEAD_DIM,
    # linear-attention / state-space layers (qwen3_next, mamba)
    "linear_key_head_dim": TINY_HEAD_DIM,
    "linear_value_head_dim": TINY_HEAD_DIM,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": TINY_HEAD_DIM,  # kimi_linear, bailing_hybrid
    "linear_num_heads": 4,
    "state_size": 8,
    "time_step_rank": 8,
    "word_embed_proj_dim": TINY_HIDDEN,
    # hybrid mamba2 blocks (falcon_h1 and friends): n_heads * d_head == d_ssm
    "mamba_d_ssm": 64,
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    # encoder-decoder families used as causal decoders (bart, blenderbot, ...)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 2 * TINY_HIDDEN,
    "decoder_ffn_dim": 2 * TINY_HIDDEN,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "d_model": TINY_HIDDEN,
    "d_inner": 2 * TINY_HIDDEN,
    # longcat_flash: routed experts plus identity ("zero") experts, each with its own size key
    "expert_ffn_hidden_size": TINY_HIDDEN // 2,
    "zero_expert_num": 2,
    # blt: hashed n-gram embeddings, one table of this many rows per n-gram size
    "encoder_hash_byte_group_vocab": TINY_VOCAB,
    # gemma3n / gemma4: a second embedding table feeding every layer
    "vocab_size_per_layer_input": TINY_VOCAB,
    # dots3: the indexer of its indexed-attention layers, and shared experts
    "index_head_dim": TINY_HEAD_DIM,
    "index_n_heads": 4,
    "shared_experts_intermediate_size": TINY_HIDDEN // 2,
    "hidden_size_per_layer_input": TINY_HEAD_DIM,
}
#: Random-weight models above this many parameters are refused (the shrink missed a size key).
MAX_RANDOM_PARAMS = 30_000_000


class ShrinkError(RuntimeError):
    """packcheck could not make a tiny model of this config (a limit of packcheck, not of the model)."""


_SPECIAL_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_k", "num_experts_per_token", "moe_topk")
_LOOP_SPLIT = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
_DROP_KEYS = ("quantization_config", "auto_map", "_name_or_path", "transformers_version")


@dataclass
class ResolvedModel:
    """A model spec resolved to a config: what every cell records about its model."""

    spec: ModelSpec
    config: Any  # transformers.PretrainedConfig, original (not shrunk)
    model_type: str
    model_class: str
    revision: str | None  # commit SHA when the Hub cache gives one
    error: str | None = None  # the config itself cannot be built: every cell of this model is an error
    error_status: str = "error"  # "unsupported" where this transformers version does not know the model
    error_cause: str | None = None  # "library_config" where transformers' own default config does not build
    #: config values set beyond the checkpoint's or the default config: the spec's overrides and what the
    #: shrink had to set (a value the config left None, a layer-kind variant), one line each
    notes: list[str] = field(default_factory=list)
    #: the transformers auto class that builds it: AutoModelForCausalLM, or for a multimodal model run on its
    #: text path (:data:`TEXT_PATH_AUTO_CLASSES`) the one whose mapping names ``model_class``
    auto_class: str = "AutoModelForCausalLM"
    #: "mrope" for a multimodal model run on its text path with M-RoPE position_ids; None for a causal LM
    text_path: str | None = None

    def record(self, weights: str | None = None) -> dict[str, Any]:
        """What every cell records about its model; with ``weights`` (the --packcheck-weights mode) also what
        the cell ran on (:func:`loaded_weights`)."""
        extra = {"config_overrides": dict(self.spec.overrides)} if self.spec.overrides else {}
        if weights:
            extra["weights"] = loaded_weights(self.spec.kind, weights)
        if self.notes:
            extra["config_notes"] = list(self.notes)
        if self.text_path:
            extra["text_path"] = (f"{self.model_class} on its text path: text-only rows (no pixel_values), M-RoPE "
                                  "position_ids (a text row, then the rows of its own get_rope_index), restarting per example")
        return {
            "spec": self.spec.raw,
            "label": self.spec.label,
            "kind": self.spec.kind,
            "revision": self.revision,
            "model_type": self.model_type,
            "model_class": self.model_class,
            **extra,
        }


def loaded_weights(kind: str, weights: str) -> str:
    """What a cell of a model spec of ``kind`` (arch, hub, local) runs on under --packcheck-weights ``weights``:
    ``"pretrained"`` (the checkpoint, :func:`build_model` through ``from_pretrained``), or ``"random"`` (the
    shrunk config with random weights). An ``arch:`` spec has no checkpoint: it is random in either mode."""
    return "pretrained" if weights == "pretrained" and kind != "arch" else "random"


def causal_lm_class_name(model_type: str) -> str | None:
    """The causal-LM class name of ``model_type``: from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, else a
    ``*ForCausalLM`` class registered only in a multimodal mapping (:func:`multimodal_only_causal_lm`); None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    name = name if isinstance(name, str) else (name[0] if name else None)
    if name is None:
        found = multimodal_only_causal_lm(model_type)
        name = found[0] if found else None
    return name


def multimodal_only_causal_lm(model_type: str) -> tuple[str, str] | None:
    """(class name, auto class) of a text decoder whose ``*ForCausalLM`` class transformers registers only in a
    multimodal mapping (:data:`TEXT_PATH_AUTO_CLASSES`), not in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: mistral4 in
    5.24 (``Mistral4ForCausalLM`` under image-text-to-text and multimodal-lm). None for any other model type."""
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    for auto, mapping in TEXT_PATH_AUTO_CLASSES:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name if isinstance(name, str) else (name[0] if name else None)
        if name and name.endswith("ForCausalLM"):
            return name, auto
    return None


def causal_lm_architectures() -> list[str]:
    """Every model_type with a causal-LM class in the installed transformers, sorted: the causal-LM mapping's and
    the decoders registered only in a multimodal mapping (:func:`multimodal_only_causal_lm`, mistral4)."""
    from transformers.models.auto import modeling_auto

    names = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for _, mapping in TEXT_PATH_AUTO_CLASSES:
        names |= {t for t in getattr(modeling_auto, mapping, {}) if multimodal_only_causal_lm(t)}
    return sorted(names)


#: Auto classes (and their mapping in ``transformers.models.auto.modeling_auto``) of multimodal models packcheck
#: runs on their text path, in the order they are looked up.
TEXT_PATH_AUTO_CLASSES = (("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
                          ("AutoModelForMultimodalLM", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"))


def mrope_text_path(model_type: str) -> tuple[str, str] | None:
    """(class name, auto class) of a multimodal model with no causal-LM class whose own generate() lays out
    multi-row M-RoPE position_ids (its class overrides ``_prepare_position_ids_for_generation``: Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, GLM-4V and their kin in transformers 5.x), which packcheck runs on its text path;
    None for any other model type."""
    import transformers
    from transformers.models.auto import modeling_auto

    for auto, mapping in TEXT_PATH_AUTO_CLASSES:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name if isinstance(name, str) else (name[0] if name else None)
        try:
            cls = getattr(transformers, name) if name and hasattr(transformers, auto) else None
        except (ImportError, AttributeError):  # a model class whose optional dependency is missing
            cls = None
        if cls is not None and any("_prepare_position_ids_for_generation" in vars(k) for k in cls.__mro__
                                   if k.__module__.startswith("transformers.models.")):
            return name, auto
    return None


def mrope_text_path_architectures() -> list[str]:
    """Every model_type :func:`mrope_text_path` runs on its text path in the installed transformers, sorted."""
    from transformers.models.auto import modeling_auto

    names = set()
    for _, mapping in TEXT_PATH_AUTO_CLASSES:
        names |= set(getattr(modeling_auto, mapping, {}))
    causal = set(causal_lm_architectures())
    return sorted(t for t in names if t not in causal and mrope_text_path(t))


def resolve_model(spec: ModelSpec, source: str, trust_remote_code: bool = False) -> ResolvedModel:
    """Resolve a spec to its config, model_type, causal-LM class and revision, reading only ``config.json``.

    Raises:
        PackcheckUsageError: unknown Hub ID or revision, offline with nothing cached, gated repo, remote code
            without ``--packcheck-trust-remote-code``, unknown model_type, or a model with no causal-LM head.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    revision = None
    if spec.kind == "arch":
        if spec.name not in CONFIG_MAPPING:
            from .errors import closest

            raise PackcheckUsageError(
                f"Unknown architecture 'arch:{spec.name}' (from {source}): not a model_type of the installed "
                f"transformers.{closest(spec.name, list(CONFIG_MAPPING.keys()))} "
                "`packcheck audit --all-architectures` lists the causal-LM ones."
            )
        try:
            config = _default_config(CONFIG_MAPPING[spec.name], spec)
        except Exception as exc:  # noqa: BLE001 - a default config that does not validate is an error cell
            cls = causal_lm_class_name(spec.name) or "?"
            text = " ".join(str(exc).split())[:300]
            return ResolvedModel(spec=spec, config=None, model_type=spec.name, model_class=cls, revision=None,
                                 error=(f"{spec.name}: transformers' own default config does not build "
                                        f"({type(exc).__name__}: {text}); not packcheck's shrink: give the values "
                                        f"it needs as 'arch:{spec.name}{{key=value}}', or a checkpoint's config"),
                                 error_cause="library_config")
    else:
        config_dict, revision = _read_config_dict(spec, source)
        if "auto_map" in config_dict and not trust_remote_code:
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}) needs trust_remote_code (its config.json has auto_map): "
                "packcheck refuses to run remote code; pass --packcheck-trust-remote-code if you trust this repo."
            )
        if config_dict.get("model_type") not in CONFIG_MAPPING and not trust_remote_code:
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}) has model_type={config_dict.get('model_type')!r}, unknown to the "
                "installed transformers: upgrade transformers, or pass --packcheck-trust-remote-code for remote code."
            )
        try:
            config = AutoConfig.from_pretrained(
                spec.name, revision=spec.revision, trust_remote_code=trust_remote_code
            )
        except Exception as exc:  # noqa: BLE001 - a config.json transformers rejects (num_attention_heads: 0, ...)
            text = " ".join(str(exc).split())[:300]
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}): transformers cannot build a config from its config.json "
                f"({type(exc).__name__}: {text}): fix the config.json or pick another model."
            ) from None
    notes: list[str] = []
    if spec.kind == "arch" and not any(k.split(".")[-1] in ("layer_types", "layers_block_type") for k, _ in spec.overrides):
        notes += _layer_variant(config, spec.name)
    if spec.overrides:
        _apply_overrides(config, spec, source)
    _refuse_absurd_sizes(config, spec, source)
    model_type = config.model_type
    cls = causal_lm_class_name(model_type)
    text_path = mrope_text_path(model_type) if cls is None else None
    if text_path is not None:
        notes += _mrope_section_default(config, text_path[0])
        return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=text_path[0], revision=revision,
                             notes=notes, auto_class=text_path[1], text_path="mrope")
    if cls is None and not getattr(config, "auto_map", None):
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is a '{model_type}' model with no causal-LM head in transformers, and "
            "not a multimodal model with M-RoPE position_ids whose text path packcheck runs (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, GLM-4V, ...): packcheck checks causal language models; pick a decoder model."
        )
    elsewhere = multimodal_only_causal_lm(model_type)
    return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=cls or "remote code", revision=revision,
                         notes=notes, auto_class=elsewhere[1] if elsewhere else "AutoModelForCausalLM")


def _mrope_section_default(config: Any, class_name: str) -> list[str]:
    """Write the text model's built-in ``mrope_section`` into the text config's ``rope_parameters`` where the config
    leaves it out (transformers 5.24's default Qwen2-VL config: the rotary module falls back to [16, 24, 24]), so
    the shrink can scale it with the head size; returns the note for the model record ([] when the config has it,
    or no text rotary module names one)."""
    import sys

    import torch
    import transformers

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
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


#: Layer kinds an architecture's checkpoints have that its default config leaves out, as the layer_types
#: pattern of those checkpoints (cycled over the layers). LFM2's default is all full attention, but LFM2
#: checkpoints start conv, conv, full_attention, and its conv layers are what leaks in a packed row; Bamba's and
#: Granite-4.0-H's defaults are all mamba, their checkpoints mix in attention layers.
LAYER_VARIANTS: dict[str, tuple[str, ...]] = {
    "lfm2": ("conv", "conv", "full_attention"),
    "lfm2_moe": ("conv", "conv", "full_attention"),
    "bamba": ("linear_attention", "linear_attention", "full_attention"),
    "granitemoehybrid": ("linear_attention", "linear_attention", "full_attention"),
}


def _layer_variant(config: Any, model_type: str) -> list[str]:
    """Give an architecture's default config every layer kind of :data:`LAYER_VARIANTS` it lacks, in place;
    returns the note for the cell's model record ([] when the default already has them all)."""
    pattern = LAYER_VARIANTS.get(model_type)
    n_layers = getattr(config, "num_hidden_layers", None)
    if not pattern or not isinstance(n_layers, int):
        return []
    current = list(getattr(config, "layer_types", None) or [])
    missing = sorted(set(pattern) - set(current))
    if not missing:
        return []
    types = [pattern[i % len(pattern)] for i in range(n_layers)]
    try:
        config.layer_types = types
    except AttributeError:  # bamba: layer types derived from attn_layer_indices (a read-only property)
        config.attn_layer_indices = [i for i, t in enumerate(types) if t == "full_attention"]
    return [(f"layer variant: layer_types cycles {', '.join(pattern)} (the default config has no {', '.join(missing)} "
             "layer; checkpoints of this architecture do)")]


def _default_config(config_class: Any, spec: ModelSpec) -> Any:
    """The architecture's default config, built with the spec's top-level overrides as arguments where the class
    takes them (a default that does not validate without them: gemma4_assistant), else without."""
    fields = set(getattr(config_class, "__dataclass_fields__", None) or inspect.signature(config_class).parameters)
    plain = {k: v for k, v in spec.overrides if "." not in k and k in fields}
    if plain:
        with contextlib.suppress(Exception):  # refused as arguments: set on the default config afterwards
            return config_class(**plain)
    return config_class()


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    return [(name, value) for name, value in vars(config).items() if hasattr(value, "to_dict") and hasattr(value, "model_type")]


#: Size keys a model cannot have outside [1, bound]: the shrink replaces them for its tiny models, so an absurd
#: value (hidden_size=0, num_hidden_layers=-2, vocab_size=10**9) would otherwise pass under the absurd label. The
#: bounds are 16x to 64x the largest released checkpoints (vocabulary 262,144: Gemma 3; hidden 16,384 and 126
#: layers: Llama 3.1 405B; 128 heads: DeepSeek-V3).
SIZE_BOUNDS = {"vocab_size": 2**24, "hidden_size": 2**18, "intermediate_size": 2**20, "num_hidden_layers": 2**12,
               "num_attention_heads": 2**12, "num_key_value_heads": 2**12, "head_dim": 2**12}


def _refuse_absurd_sizes(config: Any, spec: ModelSpec, source: str) -> None:
    """Refuse a size (:data:`SIZE_BOUNDS`) that is not a whole number in [1, bound]: an override the user typed
    (``arch:llama{hidden_size=0}``, ``--packcheck-config``), or a value of a checkpoint's / local config.json.
    Transformers' own default configs are not judged (glm5_next's default head_dim is 0 and is derived).

    Raises:
        PackcheckUsageError: naming the key, the value, where it came from and the range.
    """
    found: list[tuple[str, Any, str]] = [(k, v, "override") for k, v in spec.overrides if k.split(".")[-1] in SIZE_BOUNDS]
    if spec.kind != "arch":
        def walk(d: dict[str, Any], path: str = "") -> Any:
            for k, v in d.items():
                if isinstance(v, dict):
                    yield from walk(v, f"{path}{k}.")
                elif k in SIZE_BOUNDS and k != "head_dim":
                    yield f"{path}{k}", v, "config.json"

        found += list(walk(config.to_dict()))
    for key, value, origin in found:
        bound = SIZE_BOUNDS[key.split(".")[-1]]
        for v in value if isinstance(value, list | tuple) else [value]:  # per-layer sizes (gemma3n) in a list
            if v is None and origin == "config.json":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= bound:
                where = "an override" if origin == "override" else "its config.json"
                raise PackcheckUsageError(
                    f"Config value {key}={v!r} (in {where} of model spec '{spec.raw}' from {source}) is not a size a model "
                    f"can have: expected a whole number from 1 to {bound:,}. packcheck replaces sizes with tiny ones for "
                    "its probes, so this value would not run and its cells would pass under its label; give a real "
                    "size or leave the key out.")
    typed = {k.split(".")[-1] for k, _, _ in found}
    if typed & {"num_attention_heads", "num_key_value_heads"}:  # the shrink keeps only the ratio: it must be whole
        for _, sub in [("", config), *_sub_configs(config)]:
            heads, kv = getattr(sub, "num_attention_heads", None), getattr(sub, "num_key_value_heads", None)
            if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
                raise PackcheckUsageError(
                    f"Config values num_attention_heads={heads} and num_key_value_heads={kv} (in model spec "
                    f"'{spec.raw}' from {source}) do not divide: grouped-query attention shares each key/value head "
                    f"among a whole number of query heads. Give a num_key_value_heads that divides {heads}.")


def _apply_overrides(config: Any, spec: ModelSpec, source: str) -> None:
    """Set the spec's overrides on ``config`` in place: a dotted key walks sub-configs; a plain key the top-level
    config lacks goes to the one sub-config that has it (``clip_qkv`` -> dbrx's ``attn_config``).

    Raises:
        PackcheckUsageError: a dotted key through something that is not a sub-config.
    """
    for key, value in spec.overrides:
        target, parts = config, key.split(".")
        for part in parts[:-1]:
            sub = target.get(part) if isinstance(target, dict) else getattr(target, part, None)
            if sub is None or not (hasattr(sub, "to_dict") or isinstance(sub, dict)):
                raise PackcheckUsageError(
                    f"Config override '{key}' (in model spec '{spec.raw}' from {source}): '{part}' is not a sub-config "
                    f"(or a dict such as rope_parameters) of {type(target).__name__}: use a key of the config (its "
                    "config.json) or subconfig.key.")
            target = sub
        name = parts[-1]
        if len(parts) == 1 and not hasattr(config, name):
            owners = [sub for _, sub in _sub_configs(config) if hasattr(sub, name)]
            target = owners[0] if len(owners) == 1 else config
            if not owners:  # a typo ({clip_qvk=8}) would otherwise be set silently and change nothing
                import warnings

                from .errors import PackcheckWarning, closest

                known = [k for c in (config, *(sub for _, sub in _sub_configs(config))) for k in c.to_dict() if isinstance(k, str)]
                warnings.warn(f"Config override '{key}' (in model spec '{spec.raw}' from {source}) is not a key of "
                              f"{type(config).__name__} or its sub-configs: set as a new attribute, which the model may "
                              f"never read.{closest(name, known)}", PackcheckWarning, stacklevel=2)
        try:
            if isinstance(target, dict):
                target[name] = value
            else:
                setattr(target, name, value)
        except Exception as exc:  # noqa: BLE001 - a strict config field (huggingface_hub dataclass validators) refuses it
            text = " ".join(str(exc).split())[:200]
            raise PackcheckUsageError(
                f"Config override '{key}={value!r}' (in model spec '{spec.raw}' from {source}) is refused by "
                f"{type(target).__name__} ({type(exc).__name__}: {text}): give a value of the type the config "
                "declares.") from None


def _read_config_dict(spec: ModelSpec, source: str) -> tuple[dict[str, Any], str | None]:
    if spec.kind == "local":
        path = Path(spec.name) / "config.json"
        if not path.exists():
            raise PackcheckUsageError(
                f"Local model directory '{spec.raw}' (from {source}) has no config.json: point to a saved model folder."
            )
        return _parse_config_json(path, spec, source), None

    from huggingface_hub import errors as hub_errors
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(spec.name, "config.json", revision=spec.revision)
    except hub_errors.GatedRepoError:
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is gated: accept its licence on the Hub and set HF_TOKEN "
            "(or run `hf auth login`)."
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise PackcheckUsageError(
            f"Unknown Hub model ID '{spec.name}' (from {source}): check the spelling on the Hub, or log in for a private "
            f"repo{_arch_hint(spec.name)}."
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise PackcheckUsageError(
            f"Revision '{spec.revision}' of '{spec.name}' not found (from {source}): use an existing branch, tag or commit SHA."
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        rev = f" at revision '{spec.revision}'" if spec.revision else ""
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is not in the local Hub cache{rev} and the Hub cannot be reached "
            f"(no network, or HF_HUB_OFFLINE=1): run once online or `hf download {spec.name} config.json`"
            f"{_arch_hint(spec.name)}."
        ) from None
    except hub_errors.EntryNotFoundError:
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) has no config.json: it is not a transformers model repo."
        ) from None
    resolved = Path(path).parent.name  # .../snapshots/<commit sha>/config.json
    revision = resolved if Path(path).parent.parent.name == "snapshots" else spec.revision
    return _parse_config_json(Path(path), spec, source), revision


def _parse_config_json(path: Path, spec: ModelSpec, source: str) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        PackcheckUsageError: not UTF-8 text, not JSON, or JSON that is not an object.
    """
    import json

    where = f"Model '{spec.raw}' (from {source}): its config.json ({path})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise PackcheckUsageError(f"{where} is not text (binary content): replace it with the model's config.json.") from None
    except json.JSONDecodeError as exc:
        raise PackcheckUsageError(f"{where} is not valid JSON ({exc.msg}, line {exc.lineno}): fix or replace it.") from None
    except OSError as exc:
        raise PackcheckUsageError(f"{where} cannot be read ({exc.strerror}): check its permissions.") from None
    if not isinstance(data, dict):
        raise PackcheckUsageError(
            f"{where} holds a JSON {type(data).__name__}, not an object: a config.json is one object, e.g. "
            '{"model_type": "llama", ...}.'
        )
    return data


def _is_index_list(value: Any, n_layers: int) -> bool:
    """A list of layer indices (moe_layers=[0, 1, ...]) rather than one entry per layer."""
    return (isinstance(value, list) and bool(value) and all(type(v) is int for v in value)
            and value == sorted(set(value)) and value[-1] < n_layers and len(set(value)) == len(value) and len(value) > 2)


def _arch_hint(name: str) -> str:
    from transformers import CONFIG_MAPPING

    return f" (or did you mean arch:{name})" if "/" not in name and name in CONFIG_MAPPING else ""


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
    return _cover_derived_layer_kinds(config, type(config).from_dict(d), notes)


#: The most layers :func:`_cover_derived_layer_kinds` gives a shrunk model to reach every layer kind.
_MAX_COVER_LAYERS = 8


def derived_layer_kinds(config: Any) -> dict[str, set[str]]:
    """Layer kinds a config derives rather than lists: every property that returns one string per layer
    (jamba's ``layers_block_type`` from ``attn_layer_period`` / ``attn_layer_offset``, recurrent_gemma's from its
    cycled ``block_types``), by property name. Serialised per-layer lists are covered by the shrink itself."""
    n_layers = getattr(config, "num_hidden_layers", None)
    kinds: dict[str, set[str]] = {}
    if not isinstance(n_layers, int):
        return kinds
    for name in dir(type(config)):
        if not isinstance(getattr(type(config), name, None), property):
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
        d["qk_rope_head_dim"], d["qk_nope_head_dim"] = _FIXED["qk_rope_head_dim"], _FIXED["qk_nope_head_dim"]
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
        if "head_dim" in d:  # the rope part (deepseek), or the whole q/k head where it says so (dots3's SWA layers)
            whole = original.get("head_dim") == original.get("qk_rope_head_dim", 0) + original.get("qk_nope_head_dim", 0)
            d["head_dim"] = d["qk_rope_head_dim"] + (d["qk_nope_head_dim"] if whole else 0)

    def fix(sub: dict[str, Any]) -> None:
        for key, value in _FIXED.items():
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
    _mrope_sections(d, real("hidden_size"), heads_key, original)
    _shrink_towers(d)

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


#: The top-k a sparse-attention indexer is shrunk to (DeepSeek-V3.2-style ``index_topk``, 2048 in glm_moe_dsa,
#: deepseek_v32, axk2; 512 in deepseek_v4): below the probe row's shortest example (7 tokens), so the indexer
#: selects among the keys of an example instead of all of them.
TINY_INDEX_TOPK = 4
#: Key pooling of glm5_next's indexer (``index_topk`` must be a multiple of it; 16 by default): 2 tokens a pool.
TINY_INDEX_KPOOL = 2


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
    out: list[str] = []
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
                out.append(f"not exercised: {key} {value} >= the {bound} example ({limit} tokens, row {total}): {what} "
                           "does not act in the probe row")
        experts = next((read(sub, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if isinstance(read(sub, k), int) and read(sub, k) > 0), None)
        per_token = next((read(sub, k) for k in _TOP_K_KEYS if isinstance(read(sub, k), int)), None)
        if experts and per_token and per_token >= experts:
            out.append(f"not exercised: {per_token} experts per token of {experts}: MoE routing never chooses")
    return list(dict.fromkeys(out))


def _mrope_sections(d: dict[str, Any], hidden_key: str, heads_key: str, original: dict[str, int]) -> None:
    """Scale ``rope_parameters["mrope_section"]`` (multimodal RoPE: how many rotary frequencies the temporal, height
    and width positions each get) to the shrunk head: its sum is half the rotary dims (``torch.split`` of the
    frequencies by it in Qwen2-VL's ``recomposition_frequencies``, transformers 5.24), so it keeps its proportions
    and sums to the new half (largest remainders, every section at least one frequency). A section that did not
    sum to the old half (a default config that does not run at full size either) keeps that ratio."""
    params = d.get("rope_parameters")
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


#: Size of a shrunk vision / audio tower: blocks, attention heads (head size :data:`TINY_HEAD_DIM`).
TINY_TOWER_DEPTH = 2
TINY_TOWER_HEADS = 2


def _shrink_towers(d: dict[str, Any]) -> None:
    """Shrink the vision / audio towers of a composite config (``vision_config``, ``audio_config``) under the
    names the generic shrink does not know (Qwen2-VL's ``depth``, ``embed_dim``, ``num_heads``), and point their
    output width at the shrunk text model (``out_hidden_size``; Qwen2-VL's vision ``hidden_size`` is its
    merger's output). The text path never runs them; they only have to build small."""
    text = d.get("text_config")
    width = text.get("hidden_size") if isinstance(text, dict) else None
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
            d["mamba_d_head"] = max(1, inner // d["mamba_n_heads"])  # bamba, granitemoehybrid, nemotron_h
        if isinstance(d.get("n_mamba_heads"), int) and "mamba_headdim" in d:  # zamba2
            d["mamba_headdim"] = max(1, inner // d["n_mamba_heads"])
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


def mrope_section_mismatch(config: Any) -> tuple[str, str] | None:
    """(why, fix) when a multimodal config's text ``rope_parameters["mrope_section"]`` cannot run, else None. It must
    exist (HunYuan-VL's rotary has no built-in default: None in transformers 5.24's default config) and sum to half
    the rotary dims, head_dim x partial_rotary_factor / 2 (the text model splits its frequencies by it). 5.24's
    default GLM-4V config gives [8, 12, 12] (32) to heads of 128 rotary dims (64; its checkpoints set
    partial_rotary_factor 0.5); GLM-4.5V's and Qwen3-Omni's defaults leave head_dim to hidden / heads (42, 73;
    their checkpoints set 128). ``fix``: the override(s) that make it consistent."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    section = params.get("mrope_section")
    if section is None:
        return ("text rope_parameters has no mrope_section, and its rotary module no built-in default",
                "text_config.rope_parameters.mrope_section=[...] (its checkpoints' value)")
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
        fixes.append(f"text_config.rope_parameters.partial_rotary_factor={2 * sum(section) / head_dim:g}")
    why = (f"text rope_parameters mrope_section {section} sums to {sum(section)} rotary frequencies, but its heads have "
           f"{half} (head_dim {head_dim} x partial_rotary_factor {factor} / 2)")
    return why, " or ".join(fixes)


def auto_model_class(resolved: ResolvedModel) -> Any:
    """The transformers auto class that builds ``resolved`` (``AutoModelForCausalLM``; for a multimodal model run
    on its text path, ``AutoModelForImageTextToText`` or ``AutoModelForMultimodalLM``)."""
    import transformers

    return getattr(transformers, resolved.auto_class)


def _build_unshrunk_on_meta(resolved: ResolvedModel, trust_remote_code: bool) -> tuple[Any, str | None]:
    """``resolved.config`` built unshrunk on the meta device (no memory): (model, None), or (None, its error)."""
    import torch

    try:
        with torch.device("meta"):
            return auto_model_class(resolved).from_config(copy.deepcopy(resolved.config), trust_remote_code=trust_remote_code), None
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"


def _unshrunk_build_error(resolved: ResolvedModel, trust_remote_code: bool) -> str | None:
    """The error of building ``resolved.config`` unshrunk, on the meta device (no memory), or None if it builds."""
    return _build_unshrunk_on_meta(resolved, trust_remote_code)[1]


def _normalised(error: str) -> str:
    """An error message with its numbers blanked: a crash at full size names other sizes than the tiny one."""
    import re

    return re.sub(r"\d+", "N", error)


def unshrunk_forward_reproduces(resolved: ResolvedModel, exc: BaseException, trust_remote_code: bool = False) -> str | None:
    """Why ``exc`` (raised by the tiny model packcheck built) is the config's own fault, or None.

    The unshrunk config is built at full size on the meta device (no memory, no compute) and called once on a
    packed row of 31 meta tokens (position_ids restarting at 0, 11, 18; use_cache=False):
    - it does not build at all (dbrx's default: ``DbrxAttentionConfig`` without ``rope_theta``, which the shrink
      had to fill in): "the unshrunk config does not build (...)";
    - its forward raises the same exception type with the same message up to its numbers (dbrx's default
      ``clip_qkv=None`` reaching ``torch.clamp``): "the unshrunk config raises it too".
    Anything else (the meta run passes, or fails otherwise: a meta tensor cannot be read) -> None: the shrink
    stays suspect."""
    import torch

    if resolved.config is None:
        return None
    model, build_error = _build_unshrunk_on_meta(resolved, trust_remote_code)
    if build_error is not None:  # a default config that does not build is the library's
        return f"the unshrunk config does not build ({build_error[:160]})"
    with torch.device("meta"):
        try:
            ids = torch.zeros(1, 31, dtype=torch.long)
            pos = torch.cat([torch.arange(11), torch.arange(7), torch.arange(13)])[None]
            model(input_ids=ids, position_ids=pos, use_cache=False)
        except Exception as full:  # noqa: BLE001 - any failure is compared with the tiny model's
            if type(full) is type(exc) and _normalised(str(full)) == _normalised(str(exc)):
                return "the unshrunk config raises it too"
    return None


@contextlib.contextmanager
def reference_kernel_accepted(auto: Any, config: Any, attn_implementation: str) -> Any:
    """While a model is built on ``packcheck_flash_ref``, list it in the ``_compatible_flash_implementations`` of
    the model's classes that declare them. transformers 5.x swaps any flash-like name that is not listed for the
    first listed Hub kernel (GPT-OSS: ``kernels-community/vllm-flash-attn3``, ``modeling_utils.
    _check_and_adjust_attn_implementation``), which needs the ``kernels`` package and the Hub: GPT-OSS got no flash
    verdict on CPU. The reference kernel takes the sinks such kernels exist for (``s_aux``, see
    :func:`backends.varlen_reference_kernel`), so it is a compatible implementation. The torch varlen stand-in
    has no sinks and is not listed. Restored on exit."""
    import sys

    from .backends import REFERENCE_BACKEND

    patched: list[tuple[type, Any]] = []
    if attn_implementation == REFERENCE_BACKEND:
        try:
            module = sys.modules.get(auto._model_mapping[type(config)].__module__)
        except Exception:  # noqa: BLE001 - remote code or an unmapped config: nothing declared to extend
            module = None
        for obj in list(vars(module).values()) if module else []:
            listed = vars(obj).get("_compatible_flash_implementations") if isinstance(obj, type) else None
            if isinstance(listed, list | tuple) and REFERENCE_BACKEND not in listed:
                patched.append((obj, listed))
                obj._compatible_flash_implementations = [*listed, REFERENCE_BACKEND]
    try:
        yield
    finally:
        for obj, listed in patched:
            obj._compatible_flash_implementations = listed


def _refuse_undeclared_flash(model: Any, backend: str) -> None:
    """packcheck's two flash-path stand-ins are registered through AttentionInterface, which transformers does not
    check against a model's declared support: a class with ``_supports_flash_attn = False`` (bloom, mpt, llama4's
    chunked attention, the BERT-style decoders: 22 causal LMs of 5.24) was built anyway and crashed on the 2-D
    flash mask. transformers refuses ``flash_attention_2`` for them; packcheck refuses its stand-ins the same way.

    Raises:
        ValueError: "... does not support flash attention ..." (the runner files it as unsupported).
    """
    from .backends import PACKCHECK_REGISTERED

    if backend not in PACKCHECK_REGISTERED:
        return
    cls = type(model)
    declared = getattr(cls, "_supports_flash_attn", getattr(cls, "_supports_flash_attn_2", None))  # 2 before 4.48
    if declared is False:
        raise ValueError(f"{cls.__name__} does not support flash attention (it declares _supports_flash_attn = False, "
                         f"so transformers refuses flash_attention_2 for it): {backend}, packcheck's stand-in for the "
                         "flash path, is refused the same way")


def _override_hint(resolved: ResolvedModel) -> str:
    spec = resolved.spec.raw.split("{", 1)[0]
    return f"'{spec}{{key=value}}' or --packcheck-config key=value"


class LibraryConfigError(RuntimeError):
    """The model's own config does not build in transformers, shrunk or not (the library's, not packcheck's)."""


class WeightsError(RuntimeError):
    """``--packcheck-weights=pretrained`` loaded no tensor of the model (every cell of it is an error)."""


def weight_counts(model: Any, info: dict[str, Any]) -> dict[str, int]:
    """Tensors of the model's state dict that ``from_pretrained`` loaded, left missing (randomly initialised)
    or found unexpected in the file, from its ``output_loading_info``."""
    missing = set(info.get("missing_keys") or [])
    total = len(model.state_dict())
    return {"loaded": max(0, total - len(missing)), "missing": len(missing),
            "unexpected": len(set(info.get("unexpected_keys") or [])),
            "mismatched": len(info.get("mismatched_keys") or [])}


def dtype_kwarg(torch_dtype: Any) -> dict[str, Any]:
    """``dtype=`` for ``from_pretrained`` / ``from_config`` from transformers 4.56 on, ``torch_dtype=`` before
    (4.56 renamed it and deprecated the old name)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype": torch_dtype}


def build_model(
    resolved: ResolvedModel,
    attn_implementation: str,
    dtype: str,
    weights: str = "random",
    device: str = "cpu",
    seed: int = 0,
    trust_remote_code: bool = False,
    shrink: bool = True,
    sliding_window: int | None = None,
) -> Any:
    """Build the model for one cell group, in eval mode, on ``device``.

    The config is deep-copied for every model: ``_from_config`` stores the object it gets, so a second model
    built from the same config would switch the first one's attention backend (transformers 5.24,
    ``PreTrainedModel._from_config`` keeps the config object it is given).
    """
    import torch

    auto = auto_model_class(resolved)  # AutoModelForCausalLM, or a multimodal model's auto class
    torch_dtype = getattr(torch, dtype)
    from .backends import backend_build, prepare_backend_model

    backend = attn_implementation  # the cell's backend; what transformers is asked for comes from backend_build
    if weights == "pretrained" and resolved.spec.kind != "arch":
        with backend_build(backend, resolved.config) as attn:
            model, info = auto.from_pretrained(
                resolved.spec.name,
                revision=resolved.spec.revision,
                attn_implementation=attn,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
                **dtype_kwarg(torch_dtype),
            )
        model.packcheck_weights = weight_counts(model, info)
        if model.packcheck_weights["loaded"] == 0:
            raise WeightsError(
                f"--packcheck-weights=pretrained: the weights of '{resolved.spec.raw}' match no tensor of "
                f"{type(model).__name__} ({model.packcheck_weights['missing']} missing, "
                f"{model.packcheck_weights['unexpected']} unexpected): the model would run on random weights")
    elif not shrink:  # full size, random weights (packcheck bench on a real config)
        torch.manual_seed(seed)
        # initialised on the device: a 1.2B model's random init takes 20 s on 2 CPU cores, well under 1 s on a GPU
        with torch.device(device), backend_build(backend, resolved.config) as attn:
            model = auto.from_config(
                copy.deepcopy(resolved.config), attn_implementation=attn, trust_remote_code=trust_remote_code,
                **dtype_kwarg(torch_dtype),
            )
    else:
        notes: list[str] = []
        mismatch = mrope_section_mismatch(resolved.config) if resolved.text_path else None
        if mismatch:  # the text model's rotary fails at full size too: the config's, not the shrink's
            spec = resolved.spec.raw.split("{", 1)[0]
            fixes = " or ".join(f"'{spec}{{{fix}}}'" for fix in mismatch[1].split(" or "))
            raise LibraryConfigError(
                f"{resolved.model_type}: the {'default ' if resolved.spec.kind == 'arch' else ''}config does not run in "
                f"transformers itself, at full size either ({mismatch[0]}); not packcheck's shrink: give the value its "
                f"checkpoints have, {fixes}, or use a checkpoint's config")
        try:
            config = shrink_config(copy.deepcopy(resolved.config), keep_auto_map=trust_remote_code, notes=notes,
                                   sliding_window=sliding_window or TINY_SLIDING_WINDOW)
            # Count parameters on the meta device first: a config whose size keys the shrink does not know
            # would otherwise allocate a full-size model (an OOM kill on a 24 GB machine, seen with llama4).
            with torch.device("meta"):
                probe = auto.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code)
            n_params = sum(p.numel() for p in probe.parameters())
        except ImportError:
            raise  # a missing optional package (PIL for gemma3n's vision tower): skipped with its reason
        except Exception as exc:
            own = _unshrunk_build_error(resolved, trust_remote_code)
            if own is not None:  # the config does not build at full size either: the library's, not the shrink's
                raise LibraryConfigError(
                    f"{resolved.model_type}: the {'default ' if resolved.spec.kind == 'arch' else ''}config does not "
                    f"build in transformers itself, at full size either ({own}); not packcheck's shrink: give the "
                    f"values it lacks as {_override_hint(resolved)}, or a checkpoint's config") from exc
            raise ShrinkError(f"packcheck's shrunk {resolved.model_type} config does not build: {type(exc).__name__}: {exc}") from exc
        from .batches import DEFAULT_LENGTHS

        notes += mechanism_gaps(config, DEFAULT_LENGTHS)
        resolved.notes = [*resolved.notes, *(n for n in notes if n not in resolved.notes)]
        if n_params > MAX_RANDOM_PARAMS:
            raise ShrinkError(
                f"packcheck's shrink left {resolved.model_type} at {n_params / 1e6:.0f}M parameters (limit "
                f"{MAX_RANDOM_PARAMS / 1e6:.0f}M): its config has size keys the shrink does not know"
            )
        torch.manual_seed(seed)
        with backend_build(backend, config) as attn, reference_kernel_accepted(auto, config, attn):
            model = auto.from_config(
                config, attn_implementation=attn, trust_remote_code=trust_remote_code, **dtype_kwarg(torch_dtype)
            )
    _refuse_undeclared_flash(model, backend)
    model = prepare_backend_model(model, backend)
    language = getattr(model.config, "languages", None)
    if hasattr(model, "set_default_language") and getattr(model.config, "default_language", None) is None and language:
        # X-MOD routes every token through a per-language adapter and refuses to run without one
        model.set_default_language(language[0])
        if shrink and weights != "pretrained":
            note = f"default_language={language[0]!r} (the model refuses input without a language)"
            resolved.notes = [*resolved.notes, note] if note not in resolved.notes else resolved.notes
    for module in model.modules():  # pretrained configs keep their dropout; checks need determinism
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device).eval()


class TextPathError(ShrinkError):
    """A multimodal model's own generate() gives position_ids packcheck cannot lay a packed text row out from (a
    limit of packcheck, as :class:`ShrinkError`)."""


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


def position_layout(model: Any, resolved: ResolvedModel) -> Any:
    """How the built model takes a packed row's position_ids (:class:`batches.PositionLayout`).

    A causal LM: as the collator gives them, ``(batch, length)``. A multimodal model run on its text path: the
    packed layout its text model reads (``Qwen2VLTextModel.forward`` and its copies, transformers 5.24: "prepend
    text-only position ids ... [4, bs, seq-len]"): a text row, whose restarts give the packed mask / flash
    boundaries, then the M-RoPE rows its own ``get_rope_index`` gives a text-only row (3 in 5.24: temporal,
    height, width, each 0..n-1). Both are read from the model on a 5-token row, so another version's row count is
    followed, not assumed; what its generate() lays out (``_prepare_position_ids_for_generation``) goes into the
    record beside it (the Qwen2-VL family: the same 4 rows; Cosmos3-Edge, HunYuan-VL: the M-RoPE rows without the
    text row). Without a usable ``get_rope_index`` the generate() layout is used. The model's ``rope_deltas``
    cache, which both set, is put back.

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
    try:
        generate = _text_only_rows(model._prepare_position_ids_for_generation(ids, {"input_ids": ids}), n)
        rope = None
        if owner is not None:
            params = inspect.signature(owner.get_rope_index).parameters
            kwargs = {"mm_token_type_ids": torch.zeros_like(ids)} if "mm_token_type_ids" in params else {}
            with contextlib.suppress(Exception):  # another signature (audio lengths, ...): the generate() layout decides
                out = owner.get_rope_index(ids, **kwargs)
                rope = _text_only_rows(out[0] if isinstance(out, tuple) else out, n)
    finally:
        if owner is not None and hasattr(owner, "rope_deltas"):
            owner.rope_deltas = saved
    made_by = {None: "packcheck cannot read", 0: "(batch, length)"}
    if rope:
        seen = made_by.get(generate, f"{generate} rows") if generate != rope + 1 else "the same"
        return PositionLayout(rows=rope + 1, source=(
            f"text row + the {rope} rows of {type(owner).__name__}.get_rope_index (text-only row); its generate() "
            f"({name}._prepare_position_ids_for_generation) lays out {seen}"))
    if generate is not None:
        return PositionLayout(rows=generate or None, source=f"{name}._prepare_position_ids_for_generation (text-only row)")
    raise TextPathError(
        f"{resolved.model_type}: neither {name}.get_rope_index nor its generate() preparation gives text-only position_ids "
        "(rows, 1, 5) of 0..4 in every row for a 5-token row: packcheck cannot lay out its packed text rows; run a "
        "causal-LM architecture instead, or report it to packcheck")
