"""Building models: a Hub ID / local directory / architecture name -> config -> (shrunk) model.

``--packcheck-weights=random`` reads only ``config.json`` (through ``AutoConfig.from_pretrained``, so the real
Hub loading and caching code runs), shrinks it with :func:`shrink_config` and builds random weights;
``pretrained`` loads the real weights with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
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
}
#: Random-weight models above this many parameters are refused (the shrink missed a size key).
MAX_RANDOM_PARAMS = 30_000_000


class ShrinkError(RuntimeError):
    """packcheck could not make a tiny model of this config (a limit of packcheck, not of the model)."""


_SPECIAL_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
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

    def record(self) -> dict[str, Any]:
        return {
            "spec": self.spec.raw,
            "label": self.spec.label,
            "kind": self.spec.kind,
            "revision": self.revision,
            "model_type": self.model_type,
            "model_class": self.model_class,
        }


def causal_lm_class_name(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else (name[0] if name else None)


def causal_lm_architectures() -> list[str]:
    """Every model_type with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


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
            config = CONFIG_MAPPING[spec.name]()
        except Exception as exc:  # noqa: BLE001 - a default config that does not validate is an error cell
            cls = causal_lm_class_name(spec.name) or "?"
            text = " ".join(str(exc).split())[:300]
            return ResolvedModel(spec=spec, config=None, model_type=spec.name, model_class=cls, revision=None,
                                 error=f"{type(exc).__name__} building the default {spec.name} config: {text}")
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
    model_type = config.model_type
    cls = causal_lm_class_name(model_type)
    if cls is None and not getattr(config, "auto_map", None):
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is a '{model_type}' model with no causal-LM head in transformers: "
            "packcheck checks causal language models; pick a decoder model."
        )
    return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=cls or "remote code", revision=revision)


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


def _per_layer_indices(d: dict[str, Any], n_layers: int) -> list[int]:
    """Layers to keep: the first of each distinct value of every per-layer list (layer_types, no_rope_layers,
    ...), so a shrunk model still has every kind of layer (sliding and full, linear and full attention)."""
    keep = {0, 1} if n_layers > 1 else {0}
    for value in d.values():
        if isinstance(value, list) and len(value) == n_layers and n_layers > 1 and not _is_index_list(value, n_layers):
            seen: set[str] = set()
            for i, item in enumerate(value):
                key = repr(item)
                if key not in seen:
                    seen.add(key)
                    keep.add(i)
    return sorted(keep)


def shrink_config(config: Any, keep_auto_map: bool = False, sliding_window: int = TINY_SLIDING_WINDOW) -> Any:
    """A tiny copy of ``config`` that keeps what changes the attention path.

    Kept: GQA ratio (num_attention_heads / num_key_value_heads), explicit head_dim (set to 16), every distinct
    layer type (sliding / full / linear attention, NoPE layers), a sliding window (shortened to 8 tokens so the
    examples exceed it), softcapping, rope scaling parameters, MoE routing (4 experts), MLA ranks. Shrunk: layer
    count, hidden size, vocabulary (512; special token ids clamped into it).
    ``keep_auto_map``: keep the ``auto_map`` that remote-code models need to find their classes.
    ``sliding_window``: the window a longer one is shortened to (tokens; ``--packcheck-sliding-window``).
    Returns a new config object (``config`` is not modified).
    """
    d = copy.deepcopy(config.to_dict())
    for key in _DROP_KEYS:
        if not (keep_auto_map and key == "auto_map"):  # remote code (--packcheck-trust-remote-code) needs it
            d.pop(key, None)
    _shrink_dict(d, dict(getattr(config, "attribute_map", {}) or {}), sliding_window)
    return type(config).from_dict(d)


def _shrink_dict(d: dict[str, Any], amap: dict[str, str], sliding_window: int = TINY_SLIDING_WINDOW) -> None:
    """Shrink one config dict in place, then every nested sub-config (text_config, vision_config, ...) of a
    composite model."""
    for key, value in d.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            # nested configs serialise the generic keys too; 5.17's DbrxFFNConfig rejects them as unknown kwargs
            for drop in (*_DROP_KEYS, "output_attentions"):
                value.pop(drop, None)
            if key not in ("attn_config", "ffn_config"):
                _shrink_dict(value, {}, sliding_window)

    def real(key: str) -> str:
        return amap.get(key, key) if key not in d and amap.get(key, key) in d else key

    # layers
    layer_key = next((real(k) for k in _LAYER_COUNT_KEYS if real(k) in d), None)
    if layer_key is not None:
        n_layers = int(d[layer_key])
        keep = _per_layer_indices(d, n_layers)
        for key, value in list(d.items()):
            if _is_index_list(value, n_layers):  # renumber layer indices into the kept layers
                d[key] = [keep.index(i) for i in value if i in keep]
            elif isinstance(value, list) and len(value) == n_layers and n_layers > 1:
                d[key] = [value[i] for i in keep]
        d[layer_key] = len(keep)
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
            hidden = TINY_HIDDEN
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
        if "head_dim" in d:
            d["head_dim"] = d["qk_rope_head_dim"]

    def fix(sub: dict[str, Any]) -> None:
        for key, value in _FIXED.items():
            if key in ("qk_rope_head_dim", "qk_nope_head_dim"):
                continue
            if isinstance(sub.get(key), int) and not isinstance(sub.get(key), bool) and sub[key] > 0:
                sub[key] = value if key != "num_experts_per_tok" else min(sub[key], 2)
        if isinstance(sub.get("num_experts_per_tok"), int):
            sub["num_experts_per_tok"] = min(sub["num_experts_per_tok"], 2)
        if isinstance(sub.get("moe_top_k"), int):
            sub["moe_top_k"] = min(sub["moe_top_k"], 2)

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

    # no dropout: checks compare runs token by token, and call the model in train mode as trainers do
    for sub in [d, *[v for v in d.values() if isinstance(v, dict)]]:
        for key, value in list(sub.items()):
            # also MoE router jitter (phimoe, switch): train-mode noise would make packed and reference runs differ
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key or "jitter" in key) and value > 0:
                sub[key] = 0.0

    # sliding window: shorter than the examples, so the window is exercised on every packed row
    for key in ("sliding_window", "attention_window_size", "attention_chunk_size"):
        if isinstance(d.get(key), int) and d[key] > sliding_window:
            d[key] = sliding_window

    # vocabulary
    if isinstance(d.get("vocab_size"), int) and d["vocab_size"] > TINY_VOCAB:
        d["vocab_size"] = TINY_VOCAB
        for key in _SPECIAL_TOKEN_KEYS:
            value = d.get(key)
            if isinstance(value, int) and value >= TINY_VOCAB:
                d[key] = TINY_VOCAB - 1 - _SPECIAL_TOKEN_KEYS.index(key)
            elif isinstance(value, list):
                d[key] = [v if v < TINY_VOCAB else TINY_VOCAB - 1 for v in value]


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
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if weights == "pretrained" and resolved.spec.kind != "arch":
        model, info = AutoModelForCausalLM.from_pretrained(
            resolved.spec.name,
            revision=resolved.spec.revision,
            attn_implementation=attn_implementation,
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
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(resolved.config), attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                **dtype_kwarg(torch_dtype),
            )
    else:
        try:
            config = shrink_config(copy.deepcopy(resolved.config), keep_auto_map=trust_remote_code,
                                   sliding_window=sliding_window or TINY_SLIDING_WINDOW)
            # Count parameters on the meta device first: a config whose size keys the shrink does not know
            # would otherwise allocate a full-size model (an OOM kill on a 24 GB machine, seen with llama4).
            with torch.device("meta"):
                probe = AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code)
            n_params = sum(p.numel() for p in probe.parameters())
        except Exception as exc:
            raise ShrinkError(f"packcheck's shrunk {resolved.model_type} config does not build: {type(exc).__name__}: {exc}") from exc
        if n_params > MAX_RANDOM_PARAMS:
            raise ShrinkError(
                f"packcheck's shrink left {resolved.model_type} at {n_params / 1e6:.0f}M parameters (limit "
                f"{MAX_RANDOM_PARAMS / 1e6:.0f}M): its config has size keys the shrink does not know"
            )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **dtype_kwarg(torch_dtype)
        )
    for module in model.modules():  # pretrained configs keep their dropout; checks need determinism
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device).eval()
