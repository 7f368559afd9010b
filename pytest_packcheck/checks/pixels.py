"""Multimodal rows with pixels (issue 46 part 3): a VLM's packed row that carries ``pixel_values`` and
``image_grid_thw`` for two images of different sizes beside a text-only sample, against each sample alone.

The model is the tiny ``*ForConditionalGeneration`` packcheck builds for an M-RoPE VLM (``arch:qwen2_vl``,
``arch:qwen2_5_vl``; a 2-block vision tower, patch 14, temporal patch 2, merge 2). Its checkpoint's special token ids
(``image_token_id`` 151655 ...) lie beyond the tiny text vocabulary (512): :func:`point_special_ids` moves them to
the vocabulary's last ids, as a checkpoint's tokenizer has them inside its vocabulary.

The samples (:func:`mm_samples`): image sample A (grid ``(1, 4, 4)``: 16 patches, 4 image tokens after the 2x2
merge), a text-only sample, image sample B (grid ``(1, 4, 6)``: 24 patches, 6 image tokens); each image sample is
``text, <vision_start>, <image> x k, <vision_end>, text``. ``pixel_values``: float32 ``(patches, 3 x 2 x 14 x 14)``,
seeded normal values. The packed row (:func:`pack`): ``input_ids`` ``(1, total)`` concatenated, ``pixel_values``
and ``image_grid_thw`` concatenated in sample order, ``position_ids`` in one of :data:`LAYOUTS` (a VLM without M-RoPE,
:data:`FIXED_IMAGES`: Gemma 3 and the LLaVA-style families built from ``vlm:`` specs: :data:`PLAIN_LAYOUTS`, one
restarting row, two images whose size fixes their token count, joined as the family's forward takes them, and the type
ids the forward takes; :func:`video_samples`: a video in place of image A, for the M-RoPE families):

- ``text+mrope`` (the release's packed layout, ``Qwen2VLTextModel.forward`` transformers 5.25.0 "prepend
  text-only position ids ... [4, bs, seq-len]"): ``(4, 1, total)``, a text row restarting at 0 per sample, then
  the 3 M-RoPE rows of the model's own ``get_rope_index`` of each sample alone, concatenated;
- ``mrope``: the 3 M-RoPE rows alone, ``(3, 1, total)`` (the model then derives no packed mask: text_position_ids
  None);
- ``flat``: ``(1, total)``, the text collator's restarting positions (``DataCollatorWithFlattening``), which
  the model expands to 3 equal rows (image tokens lose their height / width positions);
- ``mrope+cu_seq_lens``: the 3 M-RoPE rows plus ``cu_seq_lens_q/k`` / ``max_length_q/k`` (int32 ``(samples + 1,)``,
  ints), which only a flash-family backend reads.

Each sample alone is the model's own forward of ``input_ids (1, n)``, its own ``pixel_values`` /
``image_grid_thw`` and ``mm_token_type_ids``, no ``position_ids`` (the model computes them with ``get_rope_index``)
and no ``attention_mask``: inference as a user runs it. Compared: the text tokens' logits (not the image
placeholders'), max abs float32 difference, and the loss in nats (labels = input_ids with image placeholders at -100;
the packed row's mean over its label tokens vs the token-weighted mean of each alone).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..results import CheckResult
from .registry import numerics_evidence, within_numerics
from .workbench import Workbench, _fmt

#: The special ids a pixel row needs, in the order :func:`point_special_ids` gives them the vocabulary's last ids.
SPECIAL_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "boi_token_id",
               "eoi_token_id")
#: Image grids (temporal, height, width) in patches: two images of different sizes (4 and 6 tokens after a 2x2 merge).
IMAGE_GRIDS = ((1, 4, 4), (1, 4, 6))
#: Layouts of a packed row's position_ids: name -> (rows, what it is).
LAYOUTS = {
    "text+mrope": "(4, 1, total): a text row restarting per sample, then get_rope_index of each sample alone (the release's)",
    "mrope": "(3, 1, total): get_rope_index of each sample alone, no text row",
    "flat": "(1, total): the text collator's restarting position_ids, expanded by the model to 3 equal rows",
    "mrope+cu_seq_lens": "(3, 1, total) M-RoPE rows alone plus cu_seq_lens_q/k and max_length_q/k (a flattening "
                         "collator's return_flash_attn_kwargs=True): the boundaries reach the flash path only",
}
#: Layouts of a VLM without M-RoPE (Gemma 3: one position row, a fixed number of tokens per image).
PLAIN_LAYOUTS = {
    "flat": "(1, total): the text collator's restarting position_ids (the release's)",
    "flat+cu_seq_lens": "(1, total) plus cu_seq_lens_q/k and max_length_q/k (return_flash_attn_kwargs=True)",
}
#: The layout the checks judge (the release's own); the others are measured by ``mm_layouts``.
RELEASE_LAYOUT = "text+mrope"
PLAIN_RELEASE_LAYOUT = "flat"


@dataclass
class Sample:
    """One sample: token ids, and its image's grid ``(t, h, w)`` and ``pixel_values`` float32 (None for a text-only
    sample): ``(t*h*w, patch_dim)`` patches for an M-RoPE model, ``(1, 3, size, size)`` for a plain one (its grid then
    only names the image: ``(1, size, size)``). ``video``: the pixels are a video's (M-RoPE families:
    ``pixel_values_videos`` / ``video_grid_thw``, its tokens ``video_token_id``)."""

    ids: list[int]
    grid: tuple[int, int, int] | None = None
    pixels: Any = None
    video: bool = False
    #: Idefics3's ``pixel_attention_mask`` ``(1, 1, h, w)`` from its processor (the padded part of a resized image), or None
    mask: Any = None


def _vision(config: Any) -> Any:
    return config.vision_config


@dataclass(frozen=True)
class FixedImages:
    """How a VLM without M-RoPE takes an image (one restarting position row; its image tokens a number the image size
    fixes). ``tokens(config, height, width)``: image tokens of one image (what ``get_image_features`` returns for it,
    the model's ``get_placeholder_mask`` checks the count); ``sizes``: the two images' (height, width) in pixels, None for
    the tower's ``image_size`` square (a spec override sets it small); ``markers``: config attributes of the ids put
    around the image tokens; ``type_ids``: ``"image"`` (1 on image tokens), ``"prefix"`` (PaliGemma: 0 on the
    image and the prompt, its first 3 text tokens, 1 after), None (the forward takes none); ``pixels``: ``"cat"``
    (``(images, 3, h, w)``), ``"padded"`` (the same padded to the largest, with ``image_sizes`` ``(images, 2)``: Pixtral),
    ``"stacked"`` (``(1, images, 3, h, w)``: Idefics3). Where each comes from: the model file's
    ``get_image_features`` in transformers 5.25.0."""

    tokens: Callable[[Any, int, int], int]
    sizes: tuple[tuple[int, int], tuple[int, int]] | None = None
    markers: tuple[str, str] | None = None
    type_ids: str | None = None
    pixels: str = "cat"
    #: any-resolution tiles beside the base image (LLaVA-NeXT: ``pixel_values`` ``(images, 1 + tiles, 3, h, w)``)
    tiles: int = 0
    #: the second image is the config's grid pinpoint of the most tiles (``image_grid_pinpoints``, each side a
    #: multiple of the tower's ``image_size``): ``(rows x cols)`` tiles of the tower's size beside the base image,
    #: ``image_sizes`` the pinpoint (LLaVA-NeXT; one pinpoint of the tower's size: the one tile of ``tiles``)
    pinpoint_tiles: bool = False


def pinpoint_size(config: Any) -> tuple[int, int]:
    """(height, width) in pixels of the config's ``image_grid_pinpoints`` entry of the most tower-size tiles (each side
    a multiple of the tower's ``image_size``; the first of equals), the tower's square where none is: the size of
    the image a LLaVA-NeXT row tiles most (``[[28, 28], [28, 56]]`` at image_size 28: (28, 56), 2 tiles)."""
    side = int(_vision(config).image_size)
    fits = [(int(h), int(w)) for h, w in (getattr(config, "image_grid_pinpoints", None) or []) if int(h) % side == 0 and int(w) % side == 0]
    return max(fits, key=lambda hw: (hw[0] // side) * (hw[1] // side), default=(side, side))


def _patches(config: Any, h: int, w: int, merge: int = 1) -> int:
    p = int(_vision(config).patch_size) * merge
    return (h // p) * (w // p)


#: The VLM families without M-RoPE packcheck lays out, by model_type (transformers 5.25.0).
FIXED_IMAGES: dict[str, FixedImages] = {
    "gemma3": FixedImages(lambda c, h, w: int(c.mm_tokens_per_image), markers=("boi_token_id", "eoi_token_id"),
                          type_ids="image"),
    # vision_feature_select_strategy "default" drops the CLS feature, "full" keeps it (LlavaModel.get_image_features)
    "llava": FixedImages(lambda c, h, w: _patches(c, h, w) + (c.vision_feature_select_strategy == "full")),
    "paligemma": FixedImages(lambda c, h, w: _patches(c, h, w), type_ids="prefix"),
    # any resolution with one grid pinpoint the image's own size (image_grid_pinpoints=[[s, s]]): the base image and
    # one tile, whose features keep an image_newline per row (LlavaNextModel.pack_image_features; LLaVA-OneVision's
    # count is the same at this size). Exact for an image of the pinpoint's size only: the guard refuses (a usage
    # error naming the counts) a row whose images were tiled otherwise
    # Several tiles (a pinpoint of rows x cols tower sizes, the image that size): the base image's patches, the
    # tiles' (h / patch) x (w / patch) patches and one image_newline per patch row (h / patch), nothing unpadded as the
    # image fills the pinpoint (LlavaNextModel.pack_image_features, transformers 5.25.0: an image of 28x56 pixels at
    # image_size 28, patch 14: 4 + 8 + 2 = 14 tokens; one tile of 28x28: 4 + 4 + 2 = 10)
    "llava_next": FixedImages(lambda c, h, w: _patches(c, *(int(_vision(c).image_size),) * 2) + _patches(c, h, w)
                              + h // int(_vision(c).patch_size), pixels="padded", tiles=1, pinpoint_tiles=True),
    "llava_onevision": FixedImages(lambda c, h, w: 2 * _patches(c, h, w) + h // int(_vision(c).patch_size),
                                   pixels="padded", tiles=1),
    # a pixel shuffle by downsample_factor (AyaVisionMultiModalProjector)
    "aya_vision": FixedImages(lambda c, h, w: _patches(c, h, w, int(c.downsample_factor))),
    # Pixtral: each image at its own size, spatial_merge_size x spatial_merge_size patches merged (Mistral3PatchMerger)
    "mistral3": FixedImages(lambda c, h, w: _patches(c, h, w, int(c.spatial_merge_size)), sizes=((56, 56), (56, 84)),
                            pixels="padded"),
    # a pixel shuffle by scale_factor (Idefics3Connector)
    "idefics3": FixedImages(lambda c, h, w: _patches(c, h, w) // int(c.scale_factor) ** 2, pixels="stacked"),
    "smolvlm": FixedImages(lambda c, h, w: _patches(c, h, w) // int(c.scale_factor) ** 2, pixels="stacked"),
}


#: The tiny spec of each :data:`FIXED_IMAGES` family (its images a few tokens: the tower's image_size shrunk, the
#: projector sized to the tiny text model) that the multimodal suite (audit/multimodal.toml) and its
#: ``--all-architectures`` build; tests/test_multimodal_pixels.py builds each.
TINY_SPECS: dict[str, str] = {
    "gemma3": "arch:gemma3{vision_config.image_size=64,mm_tokens_per_image=4}",
    "llava": "vlm:llava{vision_config.image_size=28}",
    "paligemma": "vlm:paligemma{vision_config.image_size=28,projection_dim=128}",
    "mistral3": "vlm:mistral3",
    "idefics3": "vlm:idefics3{vision_config.image_size=128}",
    "llava_next": "vlm:llava_next{vision_config.image_size=28,image_grid_pinpoints=[[28,28]]}",
    "aya_vision": "vlm:aya_vision{vision_config.image_size=56}",
    "llava_onevision": "vlm:llava_onevision{vision_config.image_size=28,image_grid_pinpoints=[[28,28]]}",
    "smolvlm": "vlm:smolvlm{vision_config.image_size=128}",
}


def multimodal_specs() -> list[str]:
    """Every VLM packcheck lays out pixel rows for in the installed transformers, as specs: each M-RoPE text-path
    architecture (``arch:qwen2_vl``, :func:`pytest_packcheck.model.architectures.mrope_text_path_architectures`; one
    whose config numbers its row otherwise is a skip naming why, :func:`is_pixel_model`), then each
    :data:`FIXED_IMAGES` family transformers has, at its :data:`TINY_SPECS`: what ``--all-architectures`` adds to a
    multimodal audit."""
    from transformers import CONFIG_MAPPING

    from ..model.architectures import mrope_text_path_architectures

    return [*(f"arch:{a}" for a in mrope_text_path_architectures()),
            *(TINY_SPECS[t] for t in FIXED_IMAGES if t in CONFIG_MAPPING)]


def fixed_images(model: Any) -> FixedImages | None:
    """The :data:`FIXED_IMAGES` row of ``model`` (None for an M-RoPE model or a family packcheck does not lay out)."""
    return None if _rope_owner(model) is not None else FIXED_IMAGES.get(getattr(model.config, "model_type", None))


def is_plain(model: Any) -> bool:
    """A VLM without M-RoPE that packcheck lays out (:data:`FIXED_IMAGES`: Gemma 3, LLaVA, PaliGemma, Mistral 3,
    Aya Vision, Idefics3 / SmolVLM); its packed row takes one position row."""
    return fixed_images(model) is not None


def layouts_of(model: Any) -> tuple[dict[str, str], str]:
    """(the layouts ``mm_layouts`` measures, the release's) for ``model``'s family."""
    return (PLAIN_LAYOUTS, PLAIN_RELEASE_LAYOUT) if is_plain(model) else (LAYOUTS, RELEASE_LAYOUT)


def is_pixel_model(model: Any) -> str | None:
    """None when ``model`` takes image rows (a ``vision_config`` and a ``get_rope_index`` on it or its ``model``, or
    a family of :data:`FIXED_IMAGES`, :func:`is_plain`); else why not, for the skip."""
    config = model.config
    if getattr(config, "vision_config", None) is None:
        return f"{type(model).__name__} has no vision tower (vision_config): the multimodal suite runs VLMs"
    if _rope_owner(model) is None and not is_plain(model):
        return (f"{type(model).__name__} has no get_rope_index and its model_type {config.model_type!r} is not in "
                f"FIXED_IMAGES ({', '.join(FIXED_IMAGES)}): packcheck lays out M-RoPE pixel rows and those families only")
    if getattr(config, "image_token_id", None) is None:
        return f"{type(model).__name__}'s config has no image_token_id"
    if not is_plain(model):  # the M-RoPE row mm_samples lays out (the Qwen2-VL family's config attributes)
        vision = config.vision_config
        lacks = [n for n in MROPE_ROW_KEYS if getattr(config, n, None) is None] + \
            [f"vision_config.{n}" for n in MROPE_VISION_KEYS if getattr(vision, n, None) is None]
        if lacks:
            return (f"{type(model).__name__}'s config has no {', '.join(lacks)}: packcheck lays out M-RoPE pixel rows "
                    "as the Qwen2-VL family's (<vision_start> image tokens <vision_end>, temporal x spatial patches "
                    "merged spatial_merge_size^2 to a token), which this family does not number so")
    return None


#: The config attributes an M-RoPE pixel row needs (:func:`mm_samples`): the ids around the image tokens, and the
#: vision tower's patching (in transformers 5.25.0 the GLM-4V, Ernie 4.5-VL, PaddleOCR-VL, Cosmos 3 Edge, HunYuan-VL
#: and Qwen-Omni configs lack one of them: a skip naming it, not a crash).
MROPE_ROW_KEYS = ("vision_start_token_id", "vision_end_token_id")
MROPE_VISION_KEYS = ("patch_size", "temporal_patch_size", "spatial_merge_size")


def _rope_owner(model: Any) -> Any:
    return next((m for m in (getattr(model, "model", None), model) if m is not None and hasattr(m, "get_rope_index")), None)


def point_special_ids(model: Any) -> list[str]:
    """Move the config's special ids (:data:`SPECIAL_IDS`) that lie outside the text vocabulary to its last ids
    (the tiny build keeps the checkpoint's 151655 beside a 512-token vocabulary: the embedding would index past its
    end). Returns the notes (``[]`` when every id fits). Idempotent."""
    config = model.config
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    notes = []
    for i, name in enumerate(SPECIAL_IDS):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= vocab:
            setattr(config, name, vocab - 1 - i)
            notes.append(f"{name} {value} -> {vocab - 1 - i} (tiny vocabulary of {vocab})")
    return notes


def mm_samples(wb: Workbench) -> list[Sample]:
    """The three samples (image A, text only, image B) with seeded pixels; cached per model."""
    key = ("mm_samples", id(wb.model))
    if key in wb._cache:
        return wb._cache[key]
    import torch

    config = wb.model.config
    point_special_ids(wb.model)
    vision = _vision(config)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    texts = [[t % (vocab - len(SPECIAL_IDS)) for t in e] for e in wb.examples]
    gen = torch.Generator().manual_seed(0)
    family = fixed_images(wb.model)
    if family is not None:  # a fixed number of tokens per image size, the image as (1, 3, h, w)
        sizes = family.sizes or ((int(vision.image_size),) * 2, pinpoint_size(config) if family.pinpoint_tiles
                                 else (int(vision.image_size),) * 2)
        marks = [getattr(config, m) for m in family.markers] if family.markers else [None, None]
        out = []
        for i, size in enumerate((sizes[0], None, sizes[1])):
            text = texts[i % len(texts)]
            if size is None:
                out.append(Sample(text))
                continue
            h, w = size
            image = [marks[0], *[config.image_token_id] * family.tokens(config, h, w), marks[1]]
            side = int(vision.image_size)
            tiles = (h // side) * (w // side) if family.pinpoint_tiles else family.tiles
            shape = (1, 1 + tiles, 3, side, side) if family.pinpoint_tiles else (1, 1 + family.tiles, 3, h, w) \
                if family.tiles else (1, 1, 3, h, w) if family.pixels == "stacked" else (1, 3, h, w)
            out.append(Sample([*text[:3], *[t for t in image if t is not None], *text[3:]], (1, h, w),
                              torch.randn(*shape, generator=gen)))
        wb._cache[key] = out
        return out
    patch_dim = int(vision.in_channels if hasattr(vision, "in_channels") else 3) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    merge = int(vision.spatial_merge_size)
    out = []
    for i, grid in enumerate((IMAGE_GRIDS[0], None, IMAGE_GRIDS[1])):
        text = texts[i % len(texts)]
        if grid is None:
            out.append(Sample(text))
            continue
        t, h, w = grid
        k = t * h * w // merge**2
        ids = [*text[:3], config.vision_start_token_id, *[config.image_token_id] * k, config.vision_end_token_id, *text[3:]]
        out.append(Sample(ids, grid, torch.randn(t * h * w, patch_dim, generator=gen)))
    wb._cache[key] = out
    return out


#: A video's grid (temporal, height, width) in patches: 2 temporal patches (4 frames at temporal_patch_size 2) of 4x4,
#: 8 video tokens after the 2x2 merge.
VIDEO_GRID = (2, 4, 4)


def video_samples(wb: Workbench) -> list[Sample]:
    """A video sample (grid :data:`VIDEO_GRID`: ``text, <vision_start>, <video> x 8, <vision_end>, text``, seeded
    ``pixel_values_videos`` ``(32, patch_dim)``), the text-only sample and image sample B of :func:`mm_samples`; cached
    per model. M-RoPE families with a ``video_token_id`` only."""
    key = ("mm_video_samples", id(wb.model))
    if key in wb._cache:
        return wb._cache[key]
    import torch

    image_a, text, image_b = mm_samples(wb)
    config = wb.model.config
    vision = _vision(config)
    t, h, w = VIDEO_GRID
    k = t * h * w // int(vision.spatial_merge_size) ** 2
    words = [i for i in image_a.ids if i not in {getattr(config, n, None) for n in SPECIAL_IDS}]
    if config.model_type.startswith("qwen3_vl"):  # one <vision_start> .. <vision_end> block per temporal patch
        frame = [config.vision_start_token_id, *[config.video_token_id] * (k // t), config.vision_end_token_id]
        ids = [*words[:3], *frame * t, *words[3:]]  # (Qwen3VLProcessor, transformers 5.25.0; timestamps left out)
    else:
        ids = [*words[:3], config.vision_start_token_id, *[config.video_token_id] * k, config.vision_end_token_id, *words[3:]]
    pixels = torch.randn(t * h * w, image_a.pixels.shape[1], generator=torch.Generator().manual_seed(1))
    out = [Sample(ids, VIDEO_GRID, pixels, video=True), text, image_b]
    wb._cache[key] = out
    return out


def _type_ids(model: Any, ids: list[int]) -> Any:
    """``(1, n)`` int64 type ids of one sample's ``ids`` (or a row of samples with images, for the M-RoPE families):
    1 on image tokens; PaliGemma's (:class:`FixedImages` ``type_ids="prefix"``): 0 on the prefix (up to the last
    image token and 3 text tokens after it, or the first 3 text tokens), 1 on the suffix, as its processor gives them
    with a suffix."""
    import torch

    family = fixed_images(model)
    if family is not None and family.type_ids == "prefix":
        image = [i for i, t in enumerate(ids) if t == model.config.image_token_id]
        end = (image[-1] + 1 if image else 0) + 3
        return torch.tensor([[0 if i < end else 1 for i in range(len(ids))]])
    video = getattr(model.config, "video_token_id", None)
    return torch.tensor([[1 if t == model.config.image_token_id else 2 if t == video else 0 for t in ids]])


def _row_type_ids(model: Any, samples: list[Sample]) -> Any:
    import torch

    return torch.cat([_type_ids(model, s.ids) for s in samples], dim=1)


def _type_key(model: Any) -> str | None:
    """The name the forward takes the image-token types under: ``mm_token_type_ids`` (Qwen2-VL family, 5.x) or
    ``token_type_ids`` (Gemma 3: image tokens attend to each other both ways; PaliGemma: its prefix both ways); None
    where the forward names neither (LLaVA, Mistral 3, Idefics3)."""
    params = inspect.signature(model.forward).parameters
    family = fixed_images(model)
    if "mm_token_type_ids" in params or (family is None and "token_type_ids" not in params):
        return "mm_token_type_ids"
    return "token_type_ids" if "token_type_ids" in params and (family is None or family.type_ids) else None


def _pixels(model: Any, images: list[Sample]) -> dict[str, Any]:
    """The pixel inputs of ``images`` (in order) as the family's forward takes them: ``pixel_values`` (and
    ``image_grid_thw`` for M-RoPE, ``image_sizes`` for Pixtral's padded images)."""
    import torch

    if not images:
        return {}
    family = fixed_images(model)
    if family is None:
        out: dict[str, Any] = {}
        for key, grid_key, video in (("pixel_values", "image_grid_thw", False), ("pixel_values_videos", "video_grid_thw", True)):
            mine = [s for s in images if s.video == video]
            if mine:
                out[key], out[grid_key] = torch.cat([s.pixels for s in mine]), torch.tensor([s.grid for s in mine])
        return out
    if family.pixels == "stacked":
        out = {"pixel_values": torch.cat([s.pixels for s in images], dim=1)}
        if all(s.mask is not None for s in images):
            out["pixel_attention_mask"] = torch.cat([s.mask for s in images], dim=1)
        return out
    if family.pinpoint_tiles:  # (images, 1 + most tiles, 3, side, side): fewer tiles padded with zero tiles
        most = max(s.pixels.shape[1] for s in images)
        tiles = [torch.nn.functional.pad(s.pixels, (0, 0, 0, 0, 0, 0, 0, most - s.pixels.shape[1])) for s in images]
        return {"pixel_values": torch.cat(tiles), "image_sizes": torch.tensor([s.grid[1:] for s in images])}
    if family.pixels == "padded":
        h, w = max(s.grid[1] for s in images), max(s.grid[2] for s in images)
        padded = [torch.nn.functional.pad(s.pixels, (0, w - s.grid[2], 0, h - s.grid[1])) for s in images]
        return {"pixel_values": torch.cat(padded), "image_sizes": torch.tensor([s.grid[1:] for s in images])}
    return {"pixel_values": torch.cat([s.pixels for s in images])}


def rope_alone(model: Any, sample: Sample) -> Any:
    """The M-RoPE rows ``(3, 1, n)`` int64 the model's own ``get_rope_index`` gives ``sample`` alone (its grid; a
    text-only sample: 0..n-1 in every row). The model's ``rope_deltas`` cache is put back."""
    import torch

    if is_plain(model):  # one position row, 0..n-1
        return torch.arange(len(sample.ids))[None, None]
    owner = _rope_owner(model)
    ids = torch.tensor([sample.ids])
    kwargs: dict[str, Any] = {}
    params = inspect.signature(owner.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = _type_ids(model, sample.ids)
    if sample.grid is not None:
        kwargs["video_grid_thw" if sample.video else "image_grid_thw"] = torch.tensor([sample.grid])
    saved = getattr(owner, "rope_deltas", None)
    try:
        out = owner.get_rope_index(ids, **kwargs)
    finally:
        if hasattr(owner, "rope_deltas"):
            owner.rope_deltas = saved
    return (out[0] if isinstance(out, tuple) else out).to(torch.int64)


def text_row(samples: list[Sample]) -> Any:
    """The text row ``(1, 1, total)``: 0..n-1 per sample (where the packed mask and the flash boundaries come from)."""
    import torch

    return torch.cat([torch.arange(len(s.ids)) for s in samples])[None, None]


def rope_per_sample(model: Any, samples: list[Sample]) -> Any:
    """The M-RoPE rows ``(3, 1, total)``: :func:`rope_alone` of each sample, concatenated (what a correct collator
    builds)."""
    import torch

    return torch.cat([rope_alone(model, s) for s in samples], dim=-1)


def rope_whole_row(model: Any, samples: list[Sample]) -> Any:
    """The planted fault: ``get_rope_index`` called once on the packed row (as a collator that hands the model's
    helper the concatenated ids and grids does): positions run on across samples, ``(3, 1, total)``."""
    import torch

    whole = Sample([t for s in samples for t in s.ids])
    if is_plain(model):  # positions that never restart
        return torch.arange(len(whole.ids))[None, None]
    owner = _rope_owner(model)
    ids = torch.tensor([whole.ids])
    kwargs: dict[str, Any] = {"mm_token_type_ids": _type_ids(model, whole.ids)}
    for key, video in (("image_grid_thw", False), ("video_grid_thw", True)):
        grids = [s.grid for s in samples if s.pixels is not None and s.video == video]
        if grids:
            kwargs[key] = torch.tensor(grids)
    saved = getattr(owner, "rope_deltas", None)
    try:
        out = owner.get_rope_index(ids, **kwargs)
    finally:
        owner.rope_deltas = saved
    return (out[0] if isinstance(out, tuple) else out).to(torch.int64)


#: A pixel-row collator: (model, samples, layout) -> the batch. The checks use :func:`pack`; tests plant others.
PixelCollator = Callable[[Any, list[Sample], str], dict[str, Any]]


def pack(model: Any, samples: list[Sample], layout: str | None = None, rope: Callable[..., Any] = rope_per_sample) -> dict[str, Any]:
    """The packed row of ``samples`` in ``layout`` (:data:`LAYOUTS`): ``input_ids`` ``(1, total)``, ``labels``
    (image placeholders at -100), ``pixel_values`` ``(patches, patch_dim)`` and ``image_grid_thw`` ``(images, 3)`` in
    sample order, ``mm_token_type_ids``, ``position_ids``; ``rope``: how the M-RoPE rows are made (a planted fault
    passes :func:`rope_whole_row`)."""
    import torch

    known, release = layouts_of(model)
    layout = layout or release
    if layout not in known:
        raise ValueError(f"unknown pixel-row layout {layout!r} (from pack's layout argument): one of {', '.join(known)}")
    ids = [t for s in samples for t in s.ids]
    batch: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    if (type_key := _type_key(model)) is not None:
        batch[type_key] = _row_type_ids(model, samples)
    batch["labels"] = _labels(model, batch["input_ids"])
    batch.update(_pixels(model, [s for s in samples if s.pixels is not None]))
    text = text_row(samples)
    lengths = [len(s.ids) for s in samples]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if layout.endswith("+cu_seq_lens"):
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    if is_plain(model):
        batch["position_ids"] = rope(model, samples)[0]
    elif layout == "flat":
        batch["position_ids"] = text[0]
    elif layout.startswith("mrope"):
        batch["position_ids"] = rope(model, samples)
    else:
        batch["position_ids"] = torch.cat([text, rope(model, samples)])
    return batch


def _labels(model: Any, input_ids: Any) -> Any:
    labels = input_ids.clone()
    for name in SPECIAL_IDS[:2]:
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            labels[labels == value] = -100
    return labels


def _run(model: Any, batch: dict[str, Any]) -> Any:
    import torch

    owner = _rope_owner(model)
    if owner is not None and hasattr(owner, "rope_deltas"):
        owner.rope_deltas = None  # a previous forward's cache never positions this one
    with torch.no_grad():
        return model(**batch, use_cache=False)


def alone(wb: Workbench, sample: Sample) -> tuple[Any, float, int]:
    """(logits ``(n, vocab)`` float32, loss in nats, label tokens) of ``sample`` alone: the model's own forward with
    its pixels, no position_ids (``get_rope_index`` inside the model), no attention_mask."""
    import torch

    ids = torch.tensor([sample.ids])
    batch: dict[str, Any] = {"input_ids": ids, "labels": _labels(wb.model, ids)}
    if (type_key := _type_key(wb.model)) is not None:
        batch[type_key] = _type_ids(wb.model, sample.ids)
    batch.update(_pixels(wb.model, [sample] if sample.pixels is not None else []))
    out = _run(wb.model, batch)
    return out.logits[0].float(), float(out.loss), int((batch["labels"][0, 1:] != -100).sum())


def _alone_all(wb: Workbench, samples: list[Sample]) -> list[tuple[Any, float, int]]:
    key = ("mm_alone", id(wb.model), id(samples))
    if key not in wb._cache:
        wb._cache[key] = [alone(wb, s) for s in samples]
    return wb._cache[key]


def _text_mask(model: Any, ids: list[int]) -> Any:
    import torch

    return torch.tensor([t not in {getattr(model.config, n, None) for n in SPECIAL_IDS[:2]} for t in ids])


def parity_numbers(wb: Workbench, layout: str | None = None, collator: Callable[..., Any] = pack,
                   samples: list[Sample] | None = None) -> dict[str, Any]:
    """Text-token logits of the packed row vs each sample alone (max abs, per sample) and the loss: the packed
    row's mean over its label tokens vs the token-weighted mean of the samples alone (nats). The packed loss is
    recomputed per sample boundary (labels whose next token lies in another sample are excluded), as the packing
    collators' ``-100`` at each sample's first label does."""
    import torch

    samples = samples or mm_samples(wb)
    layout = layout or layouts_of(wb.model)[1]
    batch = collator(wb.model, samples, layout)
    lengths = [len(s.ids) for s in samples]
    first = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    batch["labels"][0, first] = -100  # the collators' -100 at each sample's first token: no cross-sample target
    out = _run(wb.model, batch)
    logits = out.logits[0].float()
    refs = _alone_all(wb, samples)
    per, start = [], 0
    for s, (ref, _, _) in zip(samples, refs, strict=True):
        keep = _text_mask(wb.model, s.ids)
        per.append(float((logits[start:start + len(s.ids)][keep] - ref[keep]).abs().max()))
        start += len(s.ids)
    n = sum(r[2] for r in refs)
    alone_loss = sum(r[1] * r[2] for r in refs) / n
    return {"max_abs_diff": max(per), "max_abs_diff_per_sample": per, "loss_packed": float(out.loss),
            "loss_alone": alone_loss, "loss_delta": abs(float(out.loss) - alone_loss), "layout": layout,
            "samples": [(("video " if s.video else "image ") + "x".join(map(str, s.grid))) if s.pixels is not None else "text"
                        for s in samples],
            "tokens": lengths}


def _perturbed(samples: list[Sample], index: int, vocab: int) -> list[Sample]:
    """Sample ``index`` changed: its pixels negated and scaled (an image sample) or its text tokens shifted by half
    the vocabulary (a text-only sample); the others as they are."""
    out = list(samples)
    s = samples[index]
    if s.pixels is not None:
        out[index] = dataclasses.replace(s, pixels=-3.0 * s.pixels + 1.0)
    else:
        out[index] = Sample([(t + vocab // 2) % (vocab - len(SPECIAL_IDS)) for t in s.ids])
    return out


def isolation_numbers(wb: Workbench, layout: str | None = None, collator: Callable[..., Any] = pack,
                      samples: list[Sample] | None = None) -> dict[str, Any]:
    """Perturb one sample at a time (pixels of an image sample, tokens of the text-only one); every other
    sample's text-token logits must not move (``max_change``, float32 max abs). Samples after the perturbed one
    only: a causal row's earlier samples cannot see it in any layout."""
    samples = samples or mm_samples(wb)
    layout = layout or layouts_of(wb.model)[1]
    vocab = int(wb.model.config.get_text_config(decoder=True).vocab_size)
    base = _run(wb.model, collator(wb.model, samples, layout)).logits[0].float()
    lengths = [len(s.ids) for s in samples]
    starts = [sum(lengths[:i]) for i in range(len(samples))]
    moved, per = 0.0, []
    for i in range(len(samples)):
        pert = _run(wb.model, collator(wb.model, _perturbed(samples, i, vocab), layout)).logits[0].float()
        m = 0.0
        for j in range(i + 1, len(samples)):
            keep = _text_mask(wb.model, samples[j].ids)
            sl = slice(starts[j], starts[j] + lengths[j])
            m = max(m, float((pert[sl][keep] - base[sl][keep]).abs().max()))
        per.append(m)
        moved = max(moved, m)
    return {"max_change": moved, "max_change_per_perturbed_sample": per, "layout": layout}


def causality_numbers(wb: Workbench, layout: str | None = None, collator: Callable[..., Any] = pack,
                      samples: list[Sample] | None = None) -> dict[str, Any]:
    """Change each sample's last token (shifted by half the text vocabulary): its own earlier text tokens' logits must
    not move (``max_change_earlier``, float32 max abs): a packed row whose mask lets a token see later tokens of its
    own sample (Gemma 3's sliding-layer image overlay read by restarting positions) moves them."""
    samples = samples or mm_samples(wb)
    layout = layout or layouts_of(wb.model)[1]
    vocab = int(wb.model.config.get_text_config(decoder=True).vocab_size) - len(SPECIAL_IDS)
    base = _run(wb.model, collator(wb.model, samples, layout)).logits[0].float()
    moved, per, start = 0.0, [], 0
    for i, s in enumerate(samples):
        changed = list(samples)
        changed[i] = dataclasses.replace(s, ids=[*s.ids[:-1], (s.ids[-1] + vocab // 2) % vocab])
        out = _run(wb.model, collator(wb.model, changed, layout)).logits[0].float()
        keep = _text_mask(wb.model, s.ids)[:-1]
        sl = slice(start, start + len(s.ids) - 1)
        m = float((out[sl][keep] - base[sl][keep]).abs().max())
        per.append(m)
        moved, start = max(moved, m), start + len(s.ids)
    return {"max_change_earlier": moved, "max_change_earlier_per_sample": per, "layout": layout}


def positions_numbers(wb: Workbench, layout: str | None = None, collator: Callable[..., Any] = pack,
                      samples: list[Sample] | None = None) -> dict[str, Any]:
    """The packed row's M-RoPE rows, per sub-sequence, against ``get_rope_index`` of that sample alone: the
    largest difference and how many tokens differ; the text row must restart at 0 per sample."""
    import torch

    samples = samples or mm_samples(wb)
    layout = layout or layouts_of(wb.model)[1]
    pos = collator(wb.model, samples, layout)["position_ids"]
    rope = pos[1:] if pos.ndim == 3 and pos.shape[0] == 4 else (pos if pos.ndim == 3 else pos[None])  # (1, 1, n) broadcasts
    text = pos[0] if pos.ndim == 3 and pos.shape[0] == 4 else None
    worst, wrong, start, per = 0, 0, 0, []
    for s in samples:
        n = len(s.ids)
        ref = rope_alone(wb.model, s)
        d = (rope[:, :, start:start + n] - ref).abs()
        per.append(int(d.max()))
        worst, wrong = max(worst, int(d.max())), wrong + int((d.amax(0) > 0).sum())
        if text is not None:
            wrong += int((text[0, start:start + n] != torch.arange(n)).sum())
        start += n
    return {"max_position_diff": worst, "tokens_misplaced": wrong, "max_position_diff_per_sample": per, "layout": layout}


def _skip(wb: Workbench) -> CheckResult | None:
    why = is_pixel_model(wb.model)
    return CheckResult("skipped", {}, why) if why else None


def _fail_cause(wb: Workbench, value: float, atol: float, name: str) -> tuple[str, dict[str, Any]]:
    if within_numerics(value, atol, wb.dtype):
        return "kernel_numerics", numerics_evidence(name, value, atol, wb.dtype)
    return "leak", {"moved": value, name: atol}


def check_mm_isolation(wb: Workbench, collator: Callable[..., Any] = pack) -> CheckResult:
    """Perturb one sample of the pixel row at a time (an image's pixels, the text-only sample's tokens): the later
    samples' text-token logits must stay within ``isolation_atol`` (the release's layout, :func:`layouts_of`)."""
    if (skip := _skip(wb)) is not None:
        return skip
    numbers = isolation_numbers(wb, collator=collator)
    iso = wb.tol["isolation_atol"]
    message = (f"perturbing one sample's pixels or tokens moved the later samples' text logits by "
               f"{_fmt(numbers['max_change'])} (tol {_fmt(iso)}, layout {numbers['layout']})")
    if numbers["max_change"] <= iso:
        return CheckResult("pass", {**numbers, "atol": iso}, message)
    cause, evidence = _fail_cause(wb, numbers["max_change"], iso, "isolation_atol")
    return CheckResult("fail", {**numbers, "atol": iso}, message, cause=cause, evidence=evidence)


def check_mm_parity(wb: Workbench, collator: Callable[..., Any] = pack) -> CheckResult:
    """The pixel row's text-token logits (max abs) and loss (nats) = each sample alone with its own pixels."""
    if (skip := _skip(wb)) is not None:
        return skip
    numbers = parity_numbers(wb, collator=collator)
    atol, latol = wb.tol["logits_atol"], wb.tol["loss_atol"]
    metrics = {**numbers, "atol": atol, "loss_atol": latol}
    message = (f"text logits packed vs alone {_fmt(numbers['max_abs_diff'])} (tol {_fmt(atol)}), loss "
               f"{numbers['loss_packed']:.6f} vs {numbers['loss_alone']:.6f} nats (Δ {_fmt(numbers['loss_delta'])}), "
               f"layout {numbers['layout']}")
    if numbers["max_abs_diff"] <= atol and numbers["loss_delta"] <= latol:
        return CheckResult("pass", metrics, message)
    pos = positions_numbers(wb, collator=collator)
    if pos["tokens_misplaced"]:
        return CheckResult("fail", metrics, message, cause="wrong_positions",
                           evidence={"max_abs_diff": numbers["max_abs_diff"], **pos})
    iso = isolation_numbers(wb, collator=collator)["max_change"]
    causal = causality_numbers(wb, collator=collator)
    if iso <= wb.tol["isolation_atol"] and causal["max_change_earlier"] > wb.tol["isolation_atol"]:
        return CheckResult("fail", metrics, f"{message}; a sample's last token moves its own earlier tokens by "
                           f"{_fmt(causal['max_change_earlier'])}: the row's mask is not causal",
                           cause="non_causal", evidence={"max_abs_diff": numbers["max_abs_diff"], "isolation_moved": iso,
                                                         **causal})
    if iso <= wb.tol["isolation_atol"] and not within_numerics(numbers["max_abs_diff"], atol, wb.dtype):
        # no sample's content reaches another and the positions are right, yet the row differs (Gemma 3's
        # token_type_ids in a packed row): named, not called a leak
        return CheckResult("fail", metrics, f"{message}; perturbing a sample moves no other ({_fmt(iso)})",
                           cause="packed_mismatch", evidence={"max_abs_diff": numbers["max_abs_diff"],
                                                              "max_abs_diff_per_sample": numbers["max_abs_diff_per_sample"],
                                                              "isolation_moved": iso, "tokens_misplaced": 0})
    cause, evidence = _fail_cause(wb, numbers["max_abs_diff"], atol, "logits_atol")
    return CheckResult("fail", metrics, message, cause=cause, evidence=evidence)


def check_mm_positions(wb: Workbench, collator: Callable[..., Any] = pack) -> CheckResult:
    """The pixel row's M-RoPE rows per sub-sequence = the model's own ``get_rope_index`` of that sample alone, and
    its text row restarts at 0 per sample."""
    if (skip := _skip(wb)) is not None:
        return skip
    numbers = positions_numbers(wb, collator=collator)
    message = (f"{numbers['tokens_misplaced']} tokens placed otherwise than their sample alone (get_rope_index, or 0..n-1 on one row) "
               f"(largest difference {numbers['max_position_diff']}, layout {numbers['layout']})")
    if numbers["tokens_misplaced"] == 0:
        return CheckResult("pass", numbers, message)
    return CheckResult("fail", numbers, message, cause="wrong_positions", evidence=numbers)


def check_mm_videos(wb: Workbench, collator: Callable[..., Any] = pack) -> CheckResult:
    """A row with a video (:func:`video_samples`: ``pixel_values_videos`` / ``video_grid_thw``, 8 video tokens over 2
    temporal patches) beside a text-only sample and an image sample, on the release's layout: isolation (perturb one
    sample, the later ones' text logits must not move), text logits and loss against each sample alone with its own
    video / image, and its M-RoPE positions per sample against ``get_rope_index`` of that sample alone. M-RoPE
    families with a ``video_token_id`` only (a skip names the others)."""
    if (skip := _skip(wb)) is not None:
        return skip
    if is_plain(wb.model) or getattr(wb.model.config, "video_token_id", None) is None:
        return CheckResult("skipped", {}, f"{type(wb.model).__name__} takes no video rows packcheck lays out (M-RoPE "
                           "families with a video_token_id: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    samples = video_samples(wb)
    iso = isolation_numbers(wb, None, collator, samples)["max_change"]
    par = parity_numbers(wb, None, collator, samples)
    pos = positions_numbers(wb, None, collator, samples)
    atol, latol, itol = wb.tol["logits_atol"], wb.tol["loss_atol"], wb.tol["isolation_atol"]
    metrics = {"isolation": iso, **par, **pos, "atol": atol, "loss_atol": latol}
    message = (f"video row ({', '.join(par['samples'])}): isolation {_fmt(iso)}, text logits packed vs alone "
               f"{_fmt(par['max_abs_diff'])} (tol {_fmt(atol)}), loss Δ {_fmt(par['loss_delta'])} nats, "
               f"{pos['tokens_misplaced']} tokens misplaced, layout {par['layout']}")
    if iso <= itol and par["max_abs_diff"] <= atol and par["loss_delta"] <= latol and not pos["tokens_misplaced"]:
        return CheckResult("pass", metrics, message)
    if pos["tokens_misplaced"]:
        return CheckResult("fail", metrics, message, cause="wrong_positions", evidence=pos)
    if iso > itol:
        cause, evidence = _fail_cause(wb, iso, itol, "isolation_atol")
    else:
        cause, evidence = _fail_cause(wb, par["max_abs_diff"], atol, "logits_atol")
    return CheckResult("fail", metrics, message, cause=cause, evidence=evidence)


def check_mm_layouts(wb: Workbench) -> CheckResult:
    """A finding: each layout of :func:`layouts_of` the model measured on this backend: isolation (max change), parity (text
    logits max abs, loss delta in nats) and whether its positions match ``get_rope_index`` per sample; holds =
    isolation and parity within tolerance. Each layout that does not hold is a finding: ``leak`` where perturbing
    one sample moves another, else ``wrong_positions`` where tokens are misplaced, else ``non_causal`` where a
    sample's last token moves its own earlier tokens (:func:`causality_numbers`), else ``packed_mismatch``; a layout
    the varlen kernel contract refuses (a collator's ``cu_seq_lens_q/k`` handed to the vision tower's flash attention
    too: LLaVA, transformers 5.25.0) ``flash_boundaries`` / ``kernel_arguments``."""
    if (skip := _skip(wb)) is not None:
        return skip
    return layout_findings(wb, list(layouts_of(wb.model)[0]), pack, mm_samples(wb))


def layout_findings(wb: Workbench, layouts: list[str], collator: Callable[..., Any], samples: list[Sample]) -> CheckResult:
    """The finding of :func:`check_mm_layouts` for ``samples`` packed by ``collator`` in each of ``layouts``; metrics
    ``layouts`` (per layout: isolation, max_abs_diff, loss_delta in nats, tokens_misplaced, holds; or error), ``held``,
    ``leaked``."""
    from ..backends import FlashBoundariesError, KernelArgumentError

    rows, held, leaked = {}, [], []
    for layout in layouts:
        try:
            iso = isolation_numbers(wb, layout, collator, samples)["max_change"]
            par = parity_numbers(wb, layout, collator, samples)
        except (FlashBoundariesError, KernelArgumentError) as exc:
            # a collator's cu_seq_lens_q/k that reach the vision tower's flash attention too (LLaVA, 5.25.0): the
            # reference kernels refuse boundaries past the tower's tokens, where FlashAttention-2 reads outside them
            rows[layout] = {"error": f"{type(exc).__name__}: {exc}", "holds": False}
            leaked.append(layout)
            continue
        pos = positions_numbers(wb, layout, collator, samples)["tokens_misplaced"]
        holds = iso <= wb.tol["isolation_atol"] and par["max_abs_diff"] <= wb.tol["logits_atol"] and par["loss_delta"] <= wb.tol["loss_atol"]
        rows[layout] = {"isolation": iso, "max_abs_diff": par["max_abs_diff"], "loss_delta": par["loss_delta"],
                        "tokens_misplaced": pos, "holds": holds}
        kept = collator(wb.model, samples, layout)
        if dropped := [k for k in _pixels(wb.model, [s for s in samples if s.pixels is not None]) if k not in kept]:
            rows[layout]["dropped"] = dropped  # the collator's row lost the images' inputs (DataCollatorWithFlattening)
        (held if holds else leaked).append(layout)
    def word(v: dict[str, Any]) -> str:
        return "holds" if v["holds"] else "leaks" if v["isolation"] > wb.tol["isolation_atol"] else "differs"

    message = "; ".join(f"{k}: refused by the kernel contract ({v['error']})" if "error" in v else
                        f"{k}: {word(v)} (iso {_fmt(v['isolation'])}, Δ {_fmt(v['max_abs_diff'])}, "
                        f"loss Δ {_fmt(v['loss_delta'])}, {v['tokens_misplaced']} misplaced"
                        f"{', dropped ' + '/'.join(v['dropped']) if v.get('dropped') else ''})" for k, v in rows.items())
    def cause(k: str) -> str:
        if "error" in rows[k]:
            return "flash_boundaries" if rows[k]["error"].startswith("FlashBoundariesError") else "kernel_arguments"
        if rows[k].get("dropped"):
            return "collator_contract"
        if rows[k]["isolation"] > wb.tol["isolation_atol"]:
            return "leak"
        if rows[k]["tokens_misplaced"]:
            return "wrong_positions"
        rows[k]["max_change_earlier"] = causality_numbers(wb, k, collator, samples)["max_change_earlier"]
        return "non_causal" if rows[k]["max_change_earlier"] > wb.tol["isolation_atol"] else "packed_mismatch"

    findings = [{"cause": cause(k),
                 "evidence": {"layout": k, **rows[k]}} for k in leaked]
    return CheckResult("pass", {"layouts": rows, "held": held, "leaked": leaked}, message, findings=findings)


def check_mm_processor(wb: Workbench) -> CheckResult:
    """A finding: the family's processor, built from local files, makes the samples (two images of different sizes
    and a text-only prompt, :func:`.pixel_processors.processor_samples`), and ``DataCollatorWithFlattening`` packs
    them in each layout of :data:`.pixel_processors.COLLATOR_LAYOUTS`; per layout as :func:`check_mm_layouts`
    (isolation, text logits and loss against each sample alone, positions; the cause of each that does not hold).
    Skipped for a family without a processor recipe, naming why."""
    if (skip := _skip(wb)) is not None:
        return skip
    from . import pixel_processors as PP

    if (why := PP.processor_skip(wb.model)) is not None:
        return CheckResult("skipped", {}, why)
    try:
        samples = PP.processor_samples(wb)
    except ImportError as exc:  # a processor whose class needs a package not installed (torchvision)
        return CheckResult("skipped", {}, f"{type(wb.model).__name__}'s processor does not build here: {' '.join(str(exc).split())[:200]}")
    result = layout_findings(wb, list(PP.COLLATOR_LAYOUTS), PP.flattening_collator, samples)
    result.metrics["samples"] = [("image " + "x".join(map(str, s.grid[1:]))) if s.pixels is not None else "text" for s in samples]
    result.metrics["image_tokens"] = [s.ids.count(wb.model.config.image_token_id) for s in samples]
    result.message = f"processor rows ({', '.join(result.metrics['samples'])}): {result.message}"
    return result
