"""The config an ``arch:`` model is built from where transformers' own default config for it does not run.

The atlas builds every architecture from ``CONFIG_MAPPING[model_type]()``, shrunk. For 73 architectures that
default does not build or run in some release (the atlas of 2026-12: 2,066 of 18,663 entries were ``error`` /
``library_config``): a multimodal text model whose rotary reads an ``mrope_section`` the default leaves out
(Qwen2-VL on every 4.x), a composite config handed to a text-only causal LM (Llama 4, Emu3, MusicGen), a value the
default leaves None (dots1's expert count, DBRX's ``rope_theta``). Its checkpoints run there, so the atlas answers for
them: :data:`CONFIG_FIXES` names, per architecture, the config it is built from instead, one of

- ``checkpoint``: the ``config.json`` of its most-used public checkpoint, shipped in ``hub_configs/`` (its
  provenance in ``hub_configs/SOURCES.md``), read through ``AutoConfig.from_pretrained`` on that folder;
- ``text_config``: the default config of the causal-LM class's own ``config_class`` (``Llama4ForCausalLM`` is a
  ``Llama4TextConfig`` model: ``from_pretrained`` of a checkpoint hands it that sub-config, never the composite);
- ``overrides``: the smallest set of named values that makes the default run, each the value its public checkpoint
  has where one is known (named in ``checkpoint``), with the reason.

The fix is used only where the default does not run (:func:`choose_config`: it does not construct, its text rotary
lacks a usable ``mrope_section``, or it does not build at full size on the meta device), only for an ``arch:`` spec
without overrides of the user's, and then shrunk like every config (:func:`~.shrink.shrink_config`). Every cell
records it (``model.config_source``), and so does every atlas entry (``config``) and ``lookup``'s answer.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The shipped checkpoint configs: ``<org>/<name>/config.json``, one folder per Hub model ID.
HUB_CONFIGS = Path(__file__).with_name("hub_configs")

#: What an entry says when the default config is used (the atlas's entries carry no ``config`` key then).
DEFAULT_SOURCE = "transformers' default config for the architecture, shrunk (packcheck's shrink)"

_QWEN_MROPE = [16, 24, 24]  # Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni checkpoints' text mrope_section (head_dim 128)


@dataclass(frozen=True)
class ConfigFix:
    """One architecture's config where its default does not run.

    ``kind``: ``checkpoint`` | ``text_config`` | ``overrides`` (module docstring). ``checkpoint``: the public
    checkpoint whose ``config.json`` is shipped (kind ``checkpoint``) or whose values the overrides copy; None where
    packcheck knows none. ``overrides``: (key, value) pairs set on the config after it is made; a dotted key walks
    sub-configs, ``text.<key>`` is set on the text decoder's config (:func:`~.multimodal.text_config_of`) and
    ``text.mrope_section`` into its rotary dict (``rope_parameters``, ``rope_scaling`` in 4.x, made when None).
    ``reason``: why the default does not run, one line."""

    model_type: str
    kind: str
    reason: str
    checkpoint: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    #: constructor arguments (a sub-config given as a dict, which the config class turns into its config and
    #: validates at construction: Gemma 4 assistant's text_config), never set afterwards
    init: tuple[tuple[str, Any], ...] = ()

    def source(self) -> str:
        """The config this fix builds, as a cell, an atlas entry and ``lookup`` state it."""
        values = ", ".join(f"{k}={json.dumps(v)}" for k, v in (*self.init, *self.overrides))
        if self.kind == "checkpoint":
            return (f"{self.checkpoint}'s config.json (shipped with packcheck: pytest_packcheck/model/hub_configs), shrunk;"
                    f" the default does not run: {self.reason}")
        if self.kind == "text_config":
            return (f"the default config of the causal-LM class's own text config (as from_pretrained of a checkpoint gives "
                    f"it){', with ' + values if values else ''}, shrunk; the composite default does not run: {self.reason}")
        whose = f"{self.checkpoint}'s values" if self.checkpoint else "no public checkpoint config on disk: the smallest values that run"
        return f"transformers' default config with {values} ({whose}), shrunk; the default does not run: {self.reason}"


def _mrope(model_type: str, section: list[int] | None, checkpoint: str | None, *, head_dim: int | None = None,
           partial: float | None = None, why: str = "", extra: tuple[tuple[str, Any], ...] = ()) -> ConfigFix:
    """``extra``: more overrides, e.g. 5.0.0's missing ``pad_token_id`` of a sub-config (:data:`_PAD_SUB`)."""
    overrides: list[tuple[str, Any]] = list(extra)
    if head_dim is not None:
        overrides.append(("text.head_dim", head_dim))
    if partial is not None:
        overrides.append(("text.partial_rotary_factor", partial))
    if section is not None:
        overrides.append(("text.mrope_section", section))
    reason = why or "its text rotary reads an mrope_section the default config leaves out (or sizes for other heads)"
    if extra:
        reason += "; " + _PAD_SUB_WHY
    return ConfigFix(model_type, "overrides", reason, checkpoint, tuple(overrides))


_PAD_SUB_WHY = ("5.0.0's sub-config classes have no pad_token_id, which the model reads at build (None in 4.x and "
                "from 5.1.0)")
_TEXT_PAD = (("text.pad_token_id", None),)

_INDEXER_WHY = ("its attention's token indexer sizes are None in the default (indexer_budget // indexer_compress_ratio "
                "at build); a budget above the probe row keeps every token, so the selection itself is not exercised")
_INDEXER = (("indexer_n_heads", 4), ("indexer_kv_heads", 1), ("indexer_head_dim", 64), ("indexer_budget", 2048),
            ("indexer_compress_ratio", 4))

_GEMMA4_WHY = ("the default has no text_config (5.8 .. 5.19: the model reads text_config.vocab_size) or one its own "
               "validator refuses (5.20 on: hidden_size_per_layer_input must be 0); the assistant's text model is a "
               "Gemma 4 text config without per-layer inputs, MoE block or double-wide MLP")
_GEMMA4_INIT = (("text_config", {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "enable_moe_block": False,
                                 "use_double_wide_mlp": False, "vocab_size_per_layer_input": 0}),)

_TEXT = "the composite config is handed to the text-only causal LM, which reads text keys it does not have"

_PAD_WHY = ("transformers 5.0.0's config class has no pad_token_id (PretrainedConfig set it to None in 4.x, and the "
            "class declares it None again from 5.1.0), and the model reads config.pad_token_id for its embedding's "
            "padding_idx: AttributeError at build")
_PAD = (("pad_token_id", None),)


def _pad(model_type: str) -> ConfigFix:
    """5.0.0's missing ``pad_token_id``, given as the constructor argument a checkpoint's config.json gives."""
    return ConfigFix(model_type, "overrides", _PAD_WHY, None, init=_PAD)

#: Per architecture, the config it is built from where the default does not run (one table: everything else reads it).
CONFIG_FIXES: dict[str, ConfigFix] = {f.model_type: f for f in (
    ConfigFix("qwen2_vl", "checkpoint", "its text rotary reads rope_scaling['mrope_section'], which the default leaves None "
              "(every 4.x)", "Qwen/Qwen2-VL-2B-Instruct"),
    _mrope("qwen2_5_vl", _QWEN_MROPE, "Qwen/Qwen2.5-VL-7B-Instruct"),
    _mrope("qwen2_5_omni", _QWEN_MROPE, "Qwen/Qwen2.5-Omni-7B", extra=(("talker_config.pad_token_id", None),)),
    _mrope("qwen2_5_omni_thinker", _QWEN_MROPE, "Qwen/Qwen2.5-Omni-7B"),
    _mrope("qwen3_vl", [24, 20, 20], "Qwen/Qwen3-VL-8B-Instruct", head_dim=128),
    _mrope("qwen3_vl_moe", [24, 20, 20], "Qwen/Qwen3-VL-30B-A3B-Instruct", head_dim=128, extra=_TEXT_PAD),
    _mrope("qwen3_omni_moe", [24, 20, 20], "Qwen/Qwen3-Omni-30B-A3B-Instruct", head_dim=128),
    _mrope("qwen3_omni_moe_thinker", [24, 20, 20], "Qwen/Qwen3-Omni-30B-A3B-Instruct", head_dim=128),
    _mrope("glm4v", [8, 12, 12], "zai-org/GLM-4.1V-9B-Thinking", head_dim=128, partial=0.5, extra=_TEXT_PAD),
    _mrope("glm4v_moe", [8, 12, 12], "zai-org/GLM-4.5V", head_dim=128, partial=0.5),
    _mrope("glm46v", [8, 12, 12], "zai-org/GLM-4.6V", head_dim=128, partial=0.5, extra=_TEXT_PAD),
    _mrope("glmga", [8, 12, 12], None, head_dim=128, partial=0.5,
           why="its text mrope_section [8, 12, 12] sums to 32 frequencies for heads of 64 (the GLM-4V family's "
               "head_dim 128 x partial_rotary_factor 0.5 fits it)"),
    _mrope("paddleocr_vl", _QWEN_MROPE, "PaddlePaddle/PaddleOCR-VL", head_dim=128),
    _mrope("hunyuan_vl", _QWEN_MROPE, None, head_dim=128,
           why="its text config leaves head_dim and mrope_section None (Qwen2-VL's section for heads of 128)"),
    ConfigFix("cohere_compass", "overrides", "its text rotary reads rope_parameters per layer type "
              "(rope_parameters['full_attention']['rope_theta']) and the default's rope_parameters is empty; each layer "
              "type gets its rotary's own built-in mrope_section [24, 20, 20] (heads of 128)", None,
              (("text.head_dim", 128),
               ("text.rope_parameters", {t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [24, 20, 20]}
                                         for t in ("full_attention", "sliding_attention")}))),
    _mrope("exaone4_5", _QWEN_MROPE, None, head_dim=128,
           why="its text rotary has no mrope_section (Qwen2-VL's section for heads of 128)"),
    ConfigFix("llama4", "text_config", _TEXT),
    ConfigFix("emu3", "text_config", _TEXT),
    ConfigFix("qwen3_5", "text_config", _TEXT),
    ConfigFix("qwen3_5_moe", "text_config", _TEXT),
    ConfigFix("musicgen", "text_config", "the default composite needs its text_encoder, audio_encoder and decoder "
              "configs, and MusicgenForCausalLM is the decoder (MusicgenDecoderConfig); one codebook, so a packed row "
              "of tokens is its input (4 codebooks read input_ids as (batch x 4, length))", "facebook/musicgen-small",
              (("num_codebooks", 1),)),
    ConfigFix("musicgen_melody", "text_config", "the default composite needs its text_encoder, audio_encoder and decoder "
              "configs, and MusicgenMelodyForCausalLM is the decoder (MusicgenMelodyDecoderConfig)"),
    ConfigFix("mllama", "text_config", "MllamaForCausalLM is a MllamaTextConfig model; its rotary reads "
              "rope_scaling['rope_type'], None in the default",
              "meta-llama/Llama-3.2-11B-Vision",
              (("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192}),)),
    ConfigFix("reformer", "overrides", "ReformerModelWithLMHead asserts is_decoder=True, which the default leaves False; "
              "axial position embeddings need factors that sum to the hidden size (plain ones here)",
              "google/reformer-crime-and-punishment", (("is_decoder", True), ("axial_pos_embds", False))),
    ConfigFix("gemma4_assistant", "overrides", _GEMMA4_WHY, None, init=_GEMMA4_INIT),
    ConfigFix("gemma4_unified_assistant", "overrides", _GEMMA4_WHY, None, init=_GEMMA4_INIT),
    ConfigFix("qwen4_exp", "overrides", _INDEXER_WHY, None, _INDEXER),
    ConfigFix("qwen4_exp_text", "overrides", _INDEXER_WHY, None, _INDEXER),
    ConfigFix("cohere_compass_text", "overrides", "its rotary reads rope_parameters per layer type "
              "(rope_parameters['full_attention']), and the default's rope_parameters is empty", None,
              (("rope_parameters", {t: {"rope_type": "default", "rope_theta": 10000.0}
                                    for t in ("full_attention", "sliding_attention")}),)),
    ConfigFix("dots1", "overrides", "n_routed_experts and num_experts_per_tok are None in the default",
              "rednote-hilab/dots.llm1.base", (("n_routed_experts", 128), ("num_experts_per_tok", 6), ("n_shared_experts", 2))),
    ConfigFix("phi4_multimodal", "overrides", "4.51 .. 5.0.0's config constructs Phi4MultimodalVisionConfig() for a "
              "None vision_config and discards it (the assignment is missing), and makes the audio config only where "
              "vision_config is None (configuration_phi4_multimodal.py:417-424 in 4.51.3): both stay None and the model "
              "reads config.vision_config.image_token_id at build; each given as {} is its class's defaults, what 5.1.0's "
              "default makes (the public checkpoint microsoft/Phi-4-multimodal-instruct gives both)", None, init=(("vision_config", {}), ("audio_config", {}))),
    _pad("phi"), _pad("jetmoe"), _pad("stablelm"), _pad("exaone4"),
    ConfigFix("dbrx", "overrides", "its attn_config has no rope_theta (5.x) and clip_qkv None, which the attention clamps by",
              "databricks/dbrx-base", (("attn_config.rope_theta", 500000), ("attn_config.clip_qkv", 8))),
)}


def config_fix(model_type: str) -> ConfigFix | None:
    return CONFIG_FIXES.get(model_type)


def _set_text(config: Any, key: str, value: Any) -> None:
    from .multimodal import rope_key, text_config_of

    text = text_config_of(config)
    if key != "mrope_section":
        setattr(text, key, copy.deepcopy(value))
        return
    rkey = rope_key(text)
    params = getattr(text, rkey, None)
    if not isinstance(params, dict):
        # 4.x reads rope_scaling["type"] (Qwen2-VL: "mrope"); 5.x rope_parameters["rope_type"]
        # ("mrope" is no rotary type of 4.x's GLM-4V: KeyError 'mrope'; Qwen2-VL's config maps it to "default")
        params = {"type": "default", "rope_type": "default"} if rkey == "rope_scaling" else {
            "rope_type": "default", "rope_theta": getattr(text, "rope_theta", None) or 10000.0}
    params = {**params, "mrope_section": list(value)}
    setattr(text, rkey, params)


def apply_fix_overrides(config: Any, fix: ConfigFix) -> None:
    """Set ``fix.overrides`` on ``config`` in place (``text.<key>`` on the text decoder's config)."""
    from .configs import apply_overrides
    from .specs import ModelSpec

    plain = [(k, v) for k, v in fix.overrides if not k.startswith("text.")]
    for key, value in fix.overrides:
        if key.startswith("text."):
            _set_text(config, key[len("text."):], value)
    if plain:
        spec = ModelSpec(raw=f"arch:{fix.model_type}", kind="arch", name=fix.model_type, overrides=tuple(plain))
        apply_overrides(config, spec, "packcheck's config-fix table")


def fixed_config(fix: ConfigFix) -> Any:
    """The config ``fix`` builds (unshrunk).

    Raises:
        Exception: whatever transformers raises building it (the caller files it as the library's).
    """
    import transformers

    if fix.kind == "checkpoint":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(HUB_CONFIGS / fix.checkpoint))  # type: ignore[operator]
    elif fix.kind == "text_config":
        from .architectures import causal_lm_class_name

        cls = getattr(transformers, causal_lm_class_name(fix.model_type) or "", None)
        if cls is None or getattr(cls, "config_class", None) is None:
            raise ValueError(f"{fix.model_type}: this transformers has no causal-LM class with its own config class")
        config = cls.config_class()
    else:
        from .configs import default_config
        from .specs import ModelSpec

        # top-level values as constructor arguments where the class validates them at construction (5.x strict
        # dataclasses), the rest set afterwards
        plain = tuple((k, v) for k, v in fix.overrides if "." not in k)
        if fix.init:
            config = transformers.CONFIG_MAPPING[fix.model_type](**copy.deepcopy(dict(fix.init)))
        else:
            config = default_config(transformers.CONFIG_MAPPING[fix.model_type],
                                    ModelSpec(raw=f"arch:{fix.model_type}", kind="arch", name=fix.model_type, overrides=plain))
    apply_fix_overrides(config, fix)
    return config


def default_runs(config: Any, model_type: str) -> str | None:
    """Why the default ``config`` of ``model_type`` does not run (its text rotary's ``mrope_section`` for a model run on
    its text path, else the full-size build on the meta device), or None where it builds."""

    from .architectures import causal_lm_class_name, mrope_text_path
    from .multimodal import mrope_section_mismatch

    text_path = mrope_text_path(model_type) if causal_lm_class_name(model_type) is None else None
    if text_path is not None:
        from .multimodal import mrope_section_default

        config = copy.deepcopy(config)
        mrope_section_default(config, text_path[0])  # as resolve does next: the rotary's built-in section counts
        mismatch = mrope_section_mismatch(config)
        if mismatch:
            return mismatch[0]
        import transformers

        auto = getattr(transformers, text_path[1])
    else:
        from transformers import AutoModelForCausalLM as auto
    from .twin import build_on_meta

    try:
        build_on_meta(lambda: auto.from_config(copy.deepcopy(config)))
    except ImportError:
        return None  # a missing optional package is a skip with its name, not a config to replace
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return None


def choose_config(spec: Any, default: Any, default_error: BaseException | None) -> tuple[Any, str | None]:
    """(config, config_source) of an ``arch:`` spec: ``default`` (its default config, or None where constructing it
    raised ``default_error``) where it runs or no fix is known, with source None; else the fix's config and its
    :meth:`ConfigFix.source`. A spec with overrides of the user's keeps its default: the user chose its values.

    Raises:
        Exception: the default did not construct and no fix is known, or the fix itself raised (re-raised as the
            default's error, which the caller files as ``library_config``).
    """
    fix = config_fix(spec.name) if spec.kind == "arch" and not spec.overrides else None
    if fix is None:
        if default_error is not None:
            raise default_error
        return default, None
    if default_error is None and default_runs(default, spec.name) is None:
        return default, None
    try:
        return fixed_config(fix), fix.source()
    except Exception:  # noqa: BLE001 - a fix that does not build here: the default's own error is the answer
        if default_error is not None:
            raise default_error from None
        return default, None  # the fix does not build here either: the default's own error is the answer
