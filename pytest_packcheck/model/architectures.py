"""Which model types packcheck runs, and through which transformers class: causal LMs, decoders registered only
in a multimodal mapping, and multimodal models run on their text path (M-RoPE)."""

from __future__ import annotations


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
#: ``AutoModelForVision2Seq`` last: the only one that maps Qwen2-VL in transformers 4.45 .. 4.48 (4.49 added it to
#: image-text-to-text; 5.x has no Vision2Seq mapping).
TEXT_PATH_AUTO_CLASSES = (("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
                          ("AutoModelForMultimodalLM", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"),
                          ("AutoModelForVision2Seq", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES"))


def mrope_text_path(model_type: str) -> tuple[str, str] | None:
    """(class name, auto class) of a multimodal model with no causal-LM class whose own generate() lays out
    multi-row M-RoPE position_ids (its class overrides ``_prepare_position_ids_for_generation``: Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, GLM-4V and their kin in transformers 5.x), which packcheck runs on its text path;
    None for any other model type. A transformers without that generate() hook (``GenerationMixin`` has none
    before 5.0: 4.45 .. 4.57) is read by what it has instead: the class, or a class of its module (its inner
    ``*Model``, 4.52 on), defines ``get_rope_index`` (:func:`multimodal.position_layout` reads the rows from it)."""
    import sys

    import transformers
    from transformers.models.auto import modeling_auto

    hook = hasattr(getattr(transformers, "GenerationMixin", object), "_prepare_position_ids_for_generation")

    def mrope(cls: type) -> bool:
        if hook:
            return any("_prepare_position_ids_for_generation" in vars(k) for k in cls.__mro__
                       if k.__module__.startswith("transformers.models."))
        module = sys.modules.get(cls.__module__)
        return cls.__module__.startswith("transformers.models.") and any(
            isinstance(obj, type) and "get_rope_index" in vars(obj) for obj in vars(module or object).values())

    for auto, mapping in TEXT_PATH_AUTO_CLASSES:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name if isinstance(name, str) else (name[0] if name else None)
        try:
            cls = getattr(transformers, name) if name and hasattr(transformers, auto) else None
        except (ImportError, AttributeError):  # a model class whose optional dependency is missing
            cls = None
        if cls is not None and mrope(cls):
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


#: Auto classes an ``encoder:`` spec is built with, in the order they are looked up (and their mapping in
#: ``transformers.models.auto.modeling_auto``): the masked-LM head (its logits and MLM loss), else the base model
#: (hidden states only).
ENCODER_AUTO_CLASSES = (("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"), ("AutoModel", "MODEL_MAPPING_NAMES"))


def encoder_class_name(model_type: str) -> tuple[str, str] | None:
    """(class name, auto class) an ``encoder:<model_type>`` spec builds: its masked-LM class
    (``BertForMaskedLM``, ``AutoModelForMaskedLM``), else its base model (``AutoModel``); None when transformers
    maps neither."""
    from transformers.models.auto import modeling_auto

    for auto, mapping in ENCODER_AUTO_CLASSES:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name if isinstance(name, str) else (name[0] if name else None)
        if name:
            return name, auto
    return None


def vlm_class_name(model_type: str) -> tuple[str, str] | None:
    """(class name, auto class) a ``vlm:<model_type>`` spec builds: the first of :data:`TEXT_PATH_AUTO_CLASSES` whose
    mapping names it (``LlavaForConditionalGeneration``, ``AutoModelForImageTextToText``); None when none does."""
    from transformers.models.auto import modeling_auto

    for auto, mapping in TEXT_PATH_AUTO_CLASSES:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        name = name if isinstance(name, str) else (name[0] if name else None)
        if name:
            return name, auto
    return None


def encoder_architectures() -> list[str]:
    """Every model_type with a masked-LM class in the installed transformers, sorted: what ``--all-architectures``
    adds to an encoder audit (audit/encoders.toml). Those whose tiny build or forward fails become cells with their
    reason, as every architecture does."""
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
