"""The processors' own rows (issue 46 part 3): a VLM's processor, built from local files (a tiny word-level tokenizer
whose special tokens carry the tiny model's ids, the family's image processor sized to the tiny vision tower, saved to
a temporary folder and loaded back with ``AutoProcessor.from_pretrained``, no Hub), turns two images of different
sizes (56x56 and 56x84 pixels, seeded) and a text-only prompt into the samples; transformers'
``DataCollatorWithFlattening`` packs them as a trainer's padding-free path does.

The collator's layouts (:data:`COLLATOR_LAYOUTS`), each run into the model and compared with each sample alone (the
processor's output of that sample, the model's own forward) by :mod:`.pixels`' probes:

- ``flattening``: ``DataCollatorWithFlattening()``'s output as it is: ``input_ids``, ``labels``, ``position_ids``
  ``(1, total)`` restarting per sample. It keeps no other key (transformers 5.25.0 ``data_collator.py``
  ``DataCollatorWithFlattening.__call__`` builds ``input_ids`` / ``labels`` / ``position_ids`` only): the images'
  ``pixel_values`` are dropped, so the image tokens keep their placeholder embeddings;
- ``flattening+pixels``: its output plus the processor's ``pixel_values`` (and ``image_sizes`` / ``token_type_ids``
  where the processor gives them) concatenated in sample order, as a user's wrapper adds them;
- ``flattening+flash_kwargs+pixels``: the same with ``return_flash_attn_kwargs=True`` (``cu_seq_lens_q/k``,
  ``max_length_q/k``).

TRL 1.16.0 has no packing VLM collator: ``DataCollatorForVisionLanguageModeling`` pads (it has no ``padding_free``),
and ``SFTTrainer`` raises ``ValueError`` for ``padding_free=True`` on a vision dataset (``sft_trainer.py``: "Padding-free
training is yet not supported for vision datasets").
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .pixels import SPECIAL_IDS, Sample, _labels, _pixels, fixed_images, point_special_ids
from .workbench import Workbench

#: The two images' (height, width) in pixels, before the processor resizes them.
IMAGE_SIZES = ((56, 56), (56, 84))
#: Layouts of a flattening collator's row: name -> what it is.
COLLATOR_LAYOUTS = {
    "flattening": "DataCollatorWithFlattening's output as it is (input_ids, labels, position_ids): pixel_values dropped",
    "flattening+pixels": "its output plus the processor's pixel_values (image_sizes, token_type_ids) in sample order",
    "flattening+flash_kwargs+pixels": "the same with return_flash_attn_kwargs=True (cu_seq_lens_q/k, max_length_q/k)",
}


@dataclass(frozen=True)
class ProcessorRecipe:
    """How to build a family's processor from local files. ``tokens``: the tokenizer's special tokens and the config
    attribute each takes its id from (None: an unused id of the tiny vocabulary); ``extra``: the tokenizer's named
    special tokens (``boi_token`` ...) the processor reads; ``placeholder``: what the prompt writes where the image goes;
    ``build(config, tokenizer)``: the processor object (saved and loaded back by :func:`build_processor`)."""

    tokens: dict[str, str | None]
    placeholder: str
    build: Callable[[Any, Any], Any]
    extra: tuple[tuple[str, str], ...] = ()


def _llava(config: Any, tokenizer: Any) -> Any:
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    size = int(config.vision_config.image_size)
    image = LlavaImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    # the CLS feature: llava-hf's processors count it (num_additional_image_tokens=1), the "default" strategy drops it
    return LlavaProcessor(image_processor=image, tokenizer=tokenizer, patch_size=int(config.vision_config.patch_size),
                          vision_feature_select_strategy=config.vision_feature_select_strategy, num_additional_image_tokens=1)


def _gemma3(config: Any, tokenizer: Any) -> Any:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    size = int(config.vision_config.image_size)
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": size, "width": size}),
                           tokenizer=tokenizer, image_seq_length=int(config.mm_tokens_per_image))


def _idefics3(config: Any, tokenizer: Any) -> Any:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = int(config.vision_config.image_size)
    image = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size},
                                      max_image_size={"longest_edge": size})
    tokens = (size // int(config.vision_config.patch_size)) ** 2 // int(config.scale_factor) ** 2
    return Idefics3Processor(image_processor=image, tokenizer=tokenizer, image_seq_len=tokens)


#: The families whose processor packcheck builds from local files, by model_type (transformers 5.25.0). Qwen2-VL,
#: Qwen2.5-VL, Qwen3-VL (their video processor) and Mistral 3 (PixtralProcessor) have none: in 5.25.0 their processors
#: need torchvision, which the test stack does not install, so no recipe of theirs was ever run. PaliGemma, LLaVA-NeXT,
#: SmolVLM and Aya Vision have none yet.
PROCESSORS: dict[str, ProcessorRecipe] = {
    "llava": ProcessorRecipe({"<image>": "image_token_id"}, "<image>", _llava),
    "gemma3": ProcessorRecipe({"<start_of_image>": "boi_token_id", "<image_soft_token>": "image_token_id",
                               "<end_of_image>": "eoi_token_id"}, "<start_of_image>", _gemma3,
                              extra=(("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"),
                                     ("eoi_token", "<end_of_image>"))),
    # one global image, not split into tiles (do_image_splitting=False), resized to the tower's size, with its
    # pixel_attention_mask: <fake_token_around_image><global-img><image> x image_seq_len<fake_token_around_image>
    "idefics3": ProcessorRecipe({"<image>": "image_token_id", "<fake_token_around_image>": None, "<global-img>": None},
                                "<image>", _idefics3),
}


def processor_skip(model: Any) -> str | None:
    """None when :data:`PROCESSORS` has a recipe for ``model``; else why not, for the skip."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in PROCESSORS:
        return None
    return (f"no local processor recipe for {model_type!r} (PROCESSORS: {', '.join(PROCESSORS)}); in transformers 5.25.0 "
            "the Qwen2-VL family's processors (their video processor) and PixtralProcessor need torchvision")


def _tokenizer(model: Any, recipe: ProcessorRecipe) -> Any:
    """A word-level tokenizer over the tiny vocabulary: ``w<i>`` is id i; each special token of ``recipe`` at the id its
    config attribute holds (an unused top id where it names none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
    specials: dict[str, int] = {}
    spare = vocab_size - len(SPECIAL_IDS) - 2
    for token, attr in recipe.tokens.items():
        if attr is not None:
            specials[token] = int(getattr(model.config, attr))
        else:
            while spare in specials.values():
                spare -= 1
            specials[token], spare = spare, spare - 1
    words = min(specials.values()) - 1
    vocab = {f"w{i}": i for i in range(words)}
    vocab["<unk>"] = words
    vocab.update(specials)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>",
                                   extra_special_tokens=dict(recipe.extra) or None)
    fast.add_special_tokens({"additional_special_tokens": list(specials)})
    return fast, words


def build_processor(model: Any) -> tuple[Any, int]:
    """(the family's processor, loaded back with ``AutoProcessor.from_pretrained`` from a temporary folder it was saved
    to; the number of plain words its tokenizer has). Raises KeyError for a model_type without a recipe."""
    from transformers import AutoProcessor

    recipe = PROCESSORS[model.config.model_type]
    point_special_ids(model)
    tokenizer, words = _tokenizer(model, recipe)
    with tempfile.TemporaryDirectory(prefix="packcheck-processor-") as folder:
        recipe.build(model.config, tokenizer).save_pretrained(folder)
        return AutoProcessor.from_pretrained(folder), words


def processor_samples(wb: Workbench) -> list[Sample]:
    """Image sample A (56x56), a text-only sample, image sample B (56x84), each the processor's own output of its prompt
    (the example's words, the image placeholder after the third) and image (seeded uint8 RGB); cached per model."""
    key = ("mm_processor_samples", id(wb.model))
    if key in wb._cache:
        return wb._cache[key]
    import numpy as np

    processor, words = build_processor(wb.model)
    recipe = PROCESSORS[wb.model.config.model_type]
    rng = np.random.RandomState(0)
    family = fixed_images(wb.model)
    out = []
    for i, size in enumerate((IMAGE_SIZES[0], None, IMAGE_SIZES[1])):
        text = [f"w{t % words}" for t in wb.examples[i % len(wb.examples)]]
        if size is None:
            enc = processor(text=[" ".join(text)], return_tensors="pt")
            out.append(Sample(enc["input_ids"][0].tolist()))
            continue
        image = (rng.rand(*size, 3) * 255).astype("uint8")
        enc = processor(text=[" ".join([*text[:3], recipe.placeholder, *text[3:]])], images=[image], return_tensors="pt")
        pixels = enc["pixel_values"]
        h, w = (int(v) for v in enc["image_sizes"][0]) if "image_sizes" in enc else pixels.shape[-2:]
        if family is not None and family.pixels == "padded":
            pixels = pixels[..., :h, :w]
        out.append(Sample(enc["input_ids"][0].tolist(), (1, int(h), int(w)), pixels, mask=enc.get("pixel_attention_mask")))
    wb._cache[key] = out
    return out


def flattening_collator(model: Any, samples: list[Sample], layout: str) -> dict[str, Any]:
    """The packed row of ``samples`` as ``transformers.DataCollatorWithFlattening`` builds it in ``layout``
    (:data:`COLLATOR_LAYOUTS`): features ``{"input_ids", "labels"}`` per sample (labels with the image placeholders at
    -100, as a VLM dataset gives them), then the pixel inputs added for the ``+pixels`` layouts."""
    from transformers import DataCollatorWithFlattening

    from .pixels import _row_type_ids, _type_key

    if layout not in COLLATOR_LAYOUTS:
        raise ValueError(f"unknown collator layout {layout!r} (from flattening_collator's layout argument): one of "
                         f"{', '.join(COLLATOR_LAYOUTS)}")
    import torch

    features = [{"input_ids": s.ids, "labels": _labels(model, torch.tensor([s.ids]))[0].tolist()} for s in samples]
    batch = dict(DataCollatorWithFlattening(return_flash_attn_kwargs="flash_kwargs" in layout)(features))
    if layout.endswith("+pixels"):
        batch.update(_pixels(model, [s for s in samples if s.pixels is not None]))
        if (type_key := _type_key(model)) is not None:
            batch[type_key] = _row_type_ids(model, samples)
    return batch
