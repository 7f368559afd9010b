"""Resolving a model spec to its config, model_type, class and revision, reading only ``config.json``.

``--packcheck-weights=random`` reads only ``config.json`` (through ``AutoConfig.from_pretrained``, so the real
Hub loading and caching code runs); :mod:`.build` shrinks it and builds random weights, or loads the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError
from .architectures import causal_lm_class_name, encoder_class_name, mrope_text_path, multimodal_only_causal_lm, vlm_class_name
from .configs import apply_layer_variant, apply_overrides, default_config, read_config_dict, refuse_absurd_sizes
from .multimodal import flat_vocab_size, mrope_section_default
from .specs import ModelSpec


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
    #: the config it rests on where it is neither the checkpoint's nor the architecture's default: a fix of
    #: :data:`~.config_fixes.CONFIG_FIXES` (its :meth:`~.config_fixes.ConfigFix.source`), else None
    config_source: str | None = None
    #: "encoder" for an ``encoder:`` spec (built with :func:`.architectures.encoder_class_name`'s class: attends both
    #: ways, no causal-LM head); "vlm" for a ``vlm:`` spec (its image-text-to-text class with the image tower: the
    #: multimodal suite); "causal_lm" for every other
    model_kind: str = "causal_lm"

    def record(self, weights: str | None = None) -> dict[str, Any]:
        """What every cell records about its model; with ``weights`` (the --packcheck-weights mode) also what
        the cell ran on (:func:`loaded_weights`)."""
        extra = {"config_overrides": dict(self.spec.overrides)} if self.spec.overrides else {}
        if weights:
            extra["weights"] = loaded_weights(self.spec.kind, weights)
        if self.notes:
            extra["config_notes"] = list(self.notes)
        if self.model_kind != "causal_lm":
            extra["model_kind"] = self.model_kind
        if self.config_source:
            extra["config_source"] = self.config_source
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


#: The weights files ``from_pretrained`` loads from a local folder (transformers' SAFE_WEIGHTS_NAME, WEIGHTS_NAME and
#: their sharded indexes); a shard of a sharded checkpoint matches the glob beside its name.
LOCAL_WEIGHTS_FILES = (("model.safetensors", "*.safetensors"), ("model.safetensors.index.json", None),
                       ("pytorch_model.bin", "pytorch_model*.bin"), ("pytorch_model.bin.index.json", None))


def refuse_local_without_weights(spec: ModelSpec, source: str, weights_flag: str, weights_source: str) -> None:
    """Refuse, before any cell runs, a local folder that pretrained weights would be loaded from but that holds no
    weights file (:data:`LOCAL_WEIGHTS_FILES`: a folder with only config.json became an error cell, cause crash).

    Raises:
        PackcheckUsageError: naming the folder, the files looked for and the two fixes.
    """
    if spec.kind != "local":
        return
    folder = Path(spec.name)
    if any((folder / name).is_file() or (pattern and any(folder.glob(pattern))) for name, pattern in LOCAL_WEIGHTS_FILES):
        return
    raise PackcheckUsageError(
        f"Local model folder '{spec.raw}' (from {source}) has no weights file ({', '.join(n for n, _ in LOCAL_WEIGHTS_FILES)}) "
        f"to load under {weights_flag}=pretrained (from {weights_source}): pass {weights_flag}=random to run its config "
        "with random weights, or save the weights into the folder (model.save_pretrained).")


#: A spec's head kind -> (the finder of its class in transformers' auto mappings: model_type -> (class name, auto
#: class) or None; what the refusal says a model without one has; the refusal's fix). The model is built with the class
#: found, as ``model_kind`` = the head kind.
_HEAD_KINDS = {
    "encoder": (encoder_class_name, "neither a masked-LM nor a base model class",
                "an encoder: spec needs one (encoder:bert, encoder:modernbert, ...)."),
    "vlm": (vlm_class_name, "no image-text-to-text class", "a vlm: spec needs one (vlm:llava, vlm:paligemma, ...)."),
}


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
            import difflib

            from transformers.models.auto import modeling_auto

            from ..errors import closest
            from .architectures import TEXT_PATH_AUTO_CLASSES, causal_lm_architectures
            from .specs import ARCH_NAME

            # suggested only as a spec that parses (arch:notamodel was offered 'EvollaModel', itself refused; trial 11, 4)
            # and that packcheck runs: a causal LM or a text path (trial 19, 30: arch:nonexistent_xyz was offered the
            # vision backbone 'arch:convnext'). A multimodal look-alike is asked mrope_text_path (it imports the model's
            # module) only when it is among the closest names: asking all of them cost a typo 28 s at load 17 (trial 4)
            causal = causal_lm_architectures()
            others = sorted({t for _, m in TEXT_PATH_AUTO_CLASSES for t in getattr(modeling_auto, m, {})} - set(causal))
            near = [t for t in others if t.lower() == spec.name.lower()] + difflib.get_close_matches(spec.name, others, n=3)
            runs = [*causal, *[t for t in dict.fromkeys(near) if mrope_text_path(t)]]
            arches = [k for k in runs if ARCH_NAME.fullmatch(k)]
            raise PackcheckUsageError(
                f"Unknown architecture 'arch:{spec.name}' (from {source}): not a model_type of the installed "
                f"transformers.{closest(spec.name, arches, prefix='arch:')} "
                "The model types are the keys of transformers' CONFIG_MAPPING (python -c \"from transformers import "
                "CONFIG_MAPPING; print(sorted(CONFIG_MAPPING))\"); reports/all-architectures/packcheck-matrix.md lists "
                "the causal-LM ones packcheck runs."
            )
        from .config_fixes import choose_config

        try:
            try:
                default, default_error = default_config(CONFIG_MAPPING[spec.name], spec), None
            except Exception as exc:  # noqa: BLE001 - a fix may stand in for it (config_fixes.CONFIG_FIXES)
                default, default_error = None, exc
            config, config_source = choose_config(spec, default, default_error)
        except Exception as exc:  # noqa: BLE001 - a default config that does not validate is an error cell
            cls = causal_lm_class_name(spec.name) or "?"
            text = " ".join(str(exc).split())[:300]
            return ResolvedModel(spec=spec, config=None, model_type=spec.name, model_class=cls, revision=None,
                                 error=(f"{spec.name}: transformers' own default config does not build "
                                        f"({type(exc).__name__}: {text}); not packcheck's shrink: give the values "
                                        f"it needs as 'arch:{spec.name}{{key=value}}', or a checkpoint's config"),
                                 error_cause="library_config")
    else:
        config_source = None
        config_dict, revision = read_config_dict(spec, source)
        if "auto_map" in config_dict and not trust_remote_code:
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}) needs trust_remote_code (its config.json has auto_map): "
                "packcheck refuses to run remote code; pass --packcheck-trust-remote-code if you trust this repo."
            )
        model_type = config_dict.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise PackcheckUsageError(  # trial 13, 104: not a matter of upgrading or of remote code
                f"Model '{spec.raw}' (from {source}): its config.json has no usable \"model_type\" key (found "
                f"{model_type!r}), so transformers cannot tell its architecture: add the model_type of the "
                "architecture (\"model_type\": \"llama\", ...) to config.json, or give the architecture as arch:NAME."
            )
        if model_type not in CONFIG_MAPPING and not trust_remote_code:
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}) has model_type={model_type!r}, unknown to the "
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
        notes += apply_layer_variant(config, spec.name)
    if spec.overrides:
        notes += apply_overrides(config, spec, source)
    refuse_absurd_sizes(config, spec, source)
    model_type = config.model_type
    if config_source is not None and model_type != spec.name:
        # a text_config fix (Llama4ForCausalLM's Llama4TextConfig): the answer is the architecture's, built on it
        cls = causal_lm_class_name(spec.name) or "?"
        return ResolvedModel(spec=spec, config=config, model_type=spec.name, model_class=cls, revision=revision, notes=notes,
                             auto_class=cls, config_source=config_source)
    if spec.head in _HEAD_KINDS:
        finder, lacks, fix = _HEAD_KINDS[spec.head]
        found = finder(model_type)
        if found is None:
            raise PackcheckUsageError(
                f"Model '{spec.raw}' (from {source}) is a '{model_type}' model with {lacks} in transformers' auto "
                f"mappings: {fix}")
        if spec.head == "encoder" and getattr(config, "is_encoder_decoder", False):
            # transformers maps bart / mbart / mvp's masked-LM to the seq2seq class (BartForConditionalGeneration):
            # its output has no encoder hidden states of the row alone, and its decoder is causal
            return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=found[0], revision=revision,
                                 notes=notes, auto_class=found[1], model_kind=spec.head, error_status="unsupported",
                                 error=(f"{model_type}: an encoder-decoder model ({found[0]}, config.is_encoder_decoder="
                                        "True), not an encoder: the encoder checks judge encoder-only models; its "
                                        "decoder's packing is the causal-LM atlas's (packcheck lookup "
                                        f"{model_type})"))
        return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=found[0], revision=revision,
                             notes=notes, auto_class=found[1], model_kind=spec.head)
    cls = causal_lm_class_name(model_type)
    text_path = mrope_text_path(model_type) if cls is None else None
    if text_path is not None:
        notes += mrope_section_default(config, text_path[0])
        notes += flat_vocab_size(config, text_path[0])
        return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=text_path[0], revision=revision,
                             notes=notes, auto_class=text_path[1], text_path="mrope", config_source=config_source)
    if cls is None and not getattr(config, "auto_map", None):
        raise PackcheckUsageError(
            f"Model '{spec.raw}' (from {source}) is a '{model_type}' model with no causal-LM head in transformers, and "
            "not a multimodal model with M-RoPE position_ids whose text path packcheck runs (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, GLM-4V, ...): packcheck checks causal language models; pick a decoder model."
        )
    elsewhere = multimodal_only_causal_lm(model_type)
    return ResolvedModel(spec=spec, config=config, model_type=model_type, model_class=cls or "remote code", revision=revision,
                         notes=notes, auto_class=elsewhere[1] if elsewhere else "AutoModelForCausalLM",
                         config_source=config_source)


def auto_model_class(resolved: ResolvedModel) -> Any:
    """The transformers auto class that builds ``resolved`` (``AutoModelForCausalLM``; for a multimodal model run
    on its text path, ``AutoModelForImageTextToText`` or ``AutoModelForMultimodalLM``)."""
    import transformers

    found = getattr(transformers, resolved.auto_class)
    if resolved.auto_class.startswith("Auto"):
        return found
    return _ClassAsAuto(found)


class _ClassAsAuto:
    """A model class used where an auto class is (``from_config`` / ``from_pretrained``): a config-fix's text config
    (MllamaTextConfig, MusicgenDecoderConfig) that no auto mapping lists, built by the causal-LM class itself
    (``PreTrainedModel._from_config``)."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self._model_mapping = {cls.config_class: cls}

    def from_config(self, config: Any, trust_remote_code: bool = False, **kwargs: Any) -> Any:
        return self.cls._from_config(config, **kwargs)

    def from_pretrained(self, *args: Any, trust_remote_code: bool = False, **kwargs: Any) -> Any:
        return self.cls.from_pretrained(*args, **kwargs)
