"""Multimodal rows with pixels (issue 46 part 3): each check passes on the release's layout and catches its planted
fault (transformers 5.25.0, the pinned stack; tiny Qwen2-VL / Qwen2.5-VL with a 2-block vision tower)."""

from __future__ import annotations

import pytest
import torch

from pytest_packcheck.checks import pixels as P


def pixel_bench(arch: str, backend: str, tolerances: dict):
    """The tiny ``arch:<arch>`` VLM on ``backend``, as the runner builds its workbench."""
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import text_config_of
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    ensure_registered(backend)
    model = build_model(resolve_model(parse_model_spec(f"arch:{arch}", "test"), "test"), backend, "float32")
    return Workbench(model=model, config=text_config_of(model.config), backend=backend, dtype="float32",
                     tol=tolerances["float32"])


@pytest.fixture(scope="module")
def qwen2_vl(tolerances):
    return pixel_bench("qwen2_vl", "sdpa", tolerances)


def whole_row(model, samples, layout):
    """Planted: get_rope_index called once on the packed row (positions run on across samples)."""
    return P.pack(model, samples, layout, rope=P.rope_whole_row)


def no_text_row(model, samples, layout):
    """Planted: the 3 M-RoPE rows without the text row (the model derives no packed mask)."""
    return P.pack(model, samples, "mrope")


def images_reversed(model, samples, layout):
    """Planted: pixel_values / image_grid_thw in reverse sample order (a collator that sorts images by size)."""
    batch = P.pack(model, samples, layout)
    grids = batch["image_grid_thw"].tolist()
    sizes = [g[0] * g[1] * g[2] for g in grids]
    chunks = list(torch.split(batch["pixel_values"], sizes))
    batch["pixel_values"] = torch.cat(chunks[::-1])
    batch["image_grid_thw"] = torch.tensor(grids[::-1])
    return batch


def test_the_samples_carry_two_images_of_different_sizes_and_a_text_only_sample(qwen2_vl):
    samples = P.mm_samples(qwen2_vl)
    config = qwen2_vl.model.config
    assert [s.grid for s in samples] == [(1, 4, 4), None, (1, 4, 6)]
    assert [s.ids.count(config.image_token_id) for s in samples] == [4, 0, 6]
    assert samples[0].pixels.shape == (16, 3 * 2 * 14 * 14) and samples[2].pixels.shape[0] == 24
    vocab = config.get_text_config(decoder=True).vocab_size
    assert all(getattr(config, n, 0) < vocab for n in P.SPECIAL_IDS)  # moved inside the tiny vocabulary
    batch = P.pack(qwen2_vl.model, samples)
    total = sum(len(s.ids) for s in samples)
    assert batch["position_ids"].shape == (4, 1, total) and batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert batch["pixel_values"].shape[0] == 40
    # the per-sample rows are the model's own get_rope_index of each sample alone: image tokens on a 2-D grid
    rope = P.rope_alone(qwen2_vl.model, samples[0])
    assert rope.shape == (3, 1, len(samples[0].ids)) and not torch.equal(rope[1], rope[2])
    with pytest.raises(ValueError, match="unknown pixel-row layout 'nope'"):
        P.pack(qwen2_vl.model, samples, "nope")


def test_isolation_passes_and_catches_a_row_without_the_text_row(qwen2_vl):
    result = P.check_mm_isolation(qwen2_vl)
    assert result.status == "pass" and result.metrics["max_change"] <= 1e-6, result.message
    result = P.check_mm_isolation(qwen2_vl, collator=no_text_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["max_change"] > 1e-2, result.message


def test_parity_passes_and_catches_images_in_another_order(qwen2_vl):
    result = P.check_mm_parity(qwen2_vl)
    assert result.status == "pass", result.message
    assert P.causality_numbers(qwen2_vl)["max_change_earlier"] == 0.0
    assert result.metrics["max_abs_diff"] < 1e-5 and result.metrics["loss_delta"] < 1e-5
    result = P.check_mm_parity(qwen2_vl, collator=images_reversed)
    assert result.status == "fail" and result.metrics["max_abs_diff"] > 1e-2, result.message
    assert result.metrics["max_abs_diff_per_sample"][1] < 1e-5  # the text-only sample is untouched
    result = P.check_mm_parity(qwen2_vl, collator=no_text_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["loss_delta"] > 1e-3, result.message


def test_positions_pass_and_catch_get_rope_index_over_the_whole_row(qwen2_vl):
    result = P.check_mm_positions(qwen2_vl)
    assert result.status == "pass" and result.metrics["tokens_misplaced"] == 0, result.message
    result = P.check_mm_positions(qwen2_vl, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "wrong_positions"), result.message
    # the first sample is placed right; the later ones run on from where the previous sample ended
    assert result.metrics["max_position_diff_per_sample"][0] == 0 and result.metrics["tokens_misplaced"] > 0
    # RoPE is shift-invariant: a constant shift per sample leaves the logits where they were (why parity cannot see it)
    assert P.check_mm_parity(qwen2_vl, collator=whole_row).metrics["max_abs_diff"] < 1e-5


def test_layouts_say_which_hold_on_sdpa(qwen2_vl):
    result = P.check_mm_layouts(qwen2_vl)
    assert result.status == "pass"
    assert result.metrics["held"] == ["text+mrope"], result.message
    assert result.metrics["leaked"] == ["mrope", "flat", "mrope+cu_seq_lens"], result.message  # sdpa reads no cu_seq_lens
    assert result.metrics["layouts"]["flat"]["tokens_misplaced"] > 0
    assert [f["cause"] for f in result.findings] == ["leak", "leak", "leak"]
    assert all(result.metrics["layouts"][k]["isolation"] > 0.1 for k in result.metrics["leaked"])


def test_a_text_model_is_a_skip_naming_why(tolerances):
    from conftest import make_bench

    result = P.check_mm_parity(make_bench("llama", "sdpa", tolerances))
    assert result.status == "skipped" and "vision_config" in result.message


@pytest.mark.parametrize("backend", ["eager", "packcheck_flash_ref"])
def test_qwen2_5_vl_holds_on_the_release_layout(backend, tolerances):
    wb = pixel_bench("qwen2_5_vl", backend, tolerances)
    for check in (P.check_mm_isolation, P.check_mm_parity, P.check_mm_positions):
        result = check(wb)
        assert result.status == "pass", (check.__name__, result.message)
    assert P.check_mm_isolation(wb, collator=no_text_row).status == "fail"
    # the flash path reads the boundaries from cu_seq_lens_q/k; eager never does
    held = P.check_mm_layouts(wb).metrics["held"]
    assert held == (["text+mrope", "mrope+cu_seq_lens"] if backend == "packcheck_flash_ref" else ["text+mrope"])


def test_the_registry_plans_the_suite():
    from pytest_packcheck.checks.registry import REGISTRY
    from pytest_packcheck.config.audits import load_audit

    names = {c.name for c in REGISTRY if c.suite == "multimodal"}
    assert names == {"mm_isolation", "mm_parity", "mm_positions", "mm_videos", "mm_layouts", "mm_processor"}
    audit = load_audit("multimodal")
    assert set(audit.checks) == names and "arch:qwen2_vl" in audit.models


def test_qwen3_vl_keeps_the_flat_rows_boundaries_but_misplaces_its_images(tolerances):
    """Qwen3-VL builds its packed mask from a 2-D position_ids row (transformers 5.25.0): the text collator's flat row
    isolates the samples, but its image tokens get text positions, so the logits move (a wrong_positions finding)."""
    wb = pixel_bench("qwen3_vl", "sdpa", tolerances)
    result = P.check_mm_layouts(wb)
    flat = result.metrics["layouts"]["flat"]
    assert flat["isolation"] <= 1e-6 and flat["max_abs_diff"] > 1e-2 and flat["tokens_misplaced"] > 0, result.message
    assert {f["evidence"]["layout"]: f["cause"] for f in result.findings}["flat"] == "wrong_positions"
    assert result.metrics["held"] == ["text+mrope"]


GEMMA3 = "gemma3{vision_config.image_size=64,mm_tokens_per_image=4}"


@pytest.fixture(scope="module")
def gemma3(tolerances):
    return pixel_bench(GEMMA3, "sdpa", tolerances)


def test_gemma3_rows_take_fixed_size_images_and_one_restarting_position_row(gemma3):
    samples = P.mm_samples(gemma3)
    config = gemma3.model.config
    assert [s.ids.count(config.image_token_id) for s in samples] == [4, 0, 4]
    batch = P.pack(gemma3.model, samples)
    assert batch["pixel_values"].shape == (2, 3, 64, 64) and "image_grid_thw" not in batch
    assert batch["position_ids"].shape == (1, sum(len(s.ids) for s in samples)) and "token_type_ids" in batch
    assert P.check_mm_positions(gemma3).status == "pass"
    # planted: positions that never restart (the collator's row without restarts)
    result = P.check_mm_positions(gemma3, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "wrong_positions") and result.metrics["tokens_misplaced"] > 0
    result = P.check_mm_isolation(gemma3, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["max_change"] > 1e-2, result.message


def test_gemma3_token_type_ids_make_later_samples_see_their_own_future(gemma3):
    """transformers 5.25.0: Gemma 3's packed row with token_type_ids differs from each sample alone for every sample
    but the first (the text-only sample 3.9e-01 on sdpa), while perturbing a sample moves no other (0.0) and the
    positions restart. Its sliding-layer mask ORs the image blocks (block_sequence_ids) read by the restarting
    position_ids, so a later sample's tokens at the positions where the first sample has its image attend each other
    both ways: a sample's last token moves its own earlier tokens (non_causal). Without token_type_ids the text-only
    sample is exact."""
    assert P.check_mm_isolation(gemma3).status == "pass"
    result = P.check_mm_parity(gemma3)
    assert (result.status, result.cause) == ("fail", "non_causal"), result.message
    first, text, _ = result.metrics["max_abs_diff_per_sample"]
    assert first < 1e-5 and text > 1e-2 and result.evidence["isolation_moved"] <= 1e-6
    assert result.evidence["max_change_earlier_per_sample"][0] <= 1e-6  # the first sample stays causal
    assert result.evidence["max_change_earlier_per_sample"][1] > 1e-2
    layouts = P.check_mm_layouts(gemma3)
    assert layouts.metrics["held"] == [] and {f["cause"] for f in layouts.findings} == {"non_causal"}, layouts.message
    batch = P.pack(gemma3.model, P.mm_samples(gemma3))
    del batch["token_type_ids"]
    logits = P._run(gemma3.model, batch).logits[0].float()
    start = len(P.mm_samples(gemma3)[0].ids)
    alone = P.alone(gemma3, P.mm_samples(gemma3)[1])[0]
    assert float((logits[start:start + alone.shape[0]] - alone).abs().max()) < 1e-5


#: The LLaVA-style families (issue 46 part 3, 1-D positions: the image features scattered into the image tokens), the
#: first five as audit/multimodal.toml builds them (vlm: specs; tiny images, 4 .. 10 tokens each), then the other
#: families of FIXED_IMAGES.
FIXED = {name: spec for name, spec in P.TINY_SPECS.items() if name != "gemma3"}  # gemma3: its own fixture above


def fixed_bench(name: str, backend: str, tolerances: dict):
    """The tiny ``FIXED[name]`` VLM on ``backend``, as the runner builds its workbench."""
    from pytest_packcheck.backends import ensure_registered
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import text_config_of
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    ensure_registered(backend)
    model = build_model(resolve_model(parse_model_spec(FIXED[name], "test"), "test"), backend, "float32")
    return Workbench(model=model, config=text_config_of(model.config), backend=backend, dtype="float32",
                     tol=tolerances["float32"])


def fixed_images_reversed(model, samples, layout):
    """Planted: the images' pixel_values (and Pixtral's image_sizes) in reverse sample order."""
    batch = P.pack(model, samples, layout)
    batch["pixel_values"] = batch["pixel_values"].flip(1 if P.fixed_images(model).pixels == "stacked" else 0)
    if "image_sizes" in batch:
        batch["image_sizes"] = batch["image_sizes"].flip(0)
    return batch


@pytest.mark.parametrize("name", list(FIXED))
def test_llava_style_rows_hold_and_catch_positions_that_never_restart(name, tolerances):
    """transformers 5.25.0, sdpa: each LLaVA-style family's packed row (image features scattered into the image tokens,
    one restarting position row) is exact against each sample alone; positions that run on across samples make the
    language model's mask one causal block (mm_isolation: leak) and misplace every later sample (mm_positions)."""
    wb = fixed_bench(name, "sdpa", tolerances)
    samples = P.mm_samples(wb)
    config = wb.model.config
    counts = [s.ids.count(config.image_token_id) for s in samples]
    assert counts[1] == 0 and counts[0] > 0 and counts[2] > 0
    batch = P.pack(wb.model, samples)
    assert batch["position_ids"].shape == (1, sum(len(s.ids) for s in samples))
    for check in (P.check_mm_isolation, P.check_mm_parity, P.check_mm_positions):
        result = check(wb)
        assert result.status == "pass", (check.__name__, result.message)
    assert P.parity_numbers(wb)["max_abs_diff"] < 1e-5
    result = P.check_mm_isolation(wb, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["max_change"] > 1e-3, result.message
    result = P.check_mm_positions(wb, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "wrong_positions") and result.metrics["max_position_diff_per_sample"][0] == 0
    if name != "mistral3":  # Pixtral's two images differ in size: reversed, the token counts no longer match (a crash)
        result = P.check_mm_parity(wb, collator=fixed_images_reversed)
        assert result.status == "fail" and result.metrics["max_abs_diff"] > 1e-3, result.message
        assert result.metrics["max_abs_diff_per_sample"][1] < 1e-5  # the text-only sample is untouched


def test_mistral3_packs_two_images_of_different_sizes_padded_with_image_sizes(tolerances):
    wb = fixed_bench("mistral3", "sdpa", tolerances)
    samples = P.mm_samples(wb)
    assert [s.grid for s in samples] == [(1, 56, 56), None, (1, 56, 84)]
    assert [s.ids.count(wb.model.config.image_token_id) for s in samples] == [4, 0, 6]
    batch = P.pack(wb.model, samples)
    assert batch["pixel_values"].shape == (2, 3, 56, 84) and batch["image_sizes"].tolist() == [[56, 56], [56, 84]]
    assert float(batch["pixel_values"][0, :, :, 56:].abs().sum()) == 0.0  # the smaller image padded with zeros


def test_paligemma_prefix_type_ids_stay_inside_each_sample(tolerances):
    """PaliGemma's token_type_ids (0 on the image and the prompt: attended both ways) in a packed row: every sample's
    prefix is block 0 (block_sequence_ids), yet the packed mask from the restarting position_ids keeps the blocks
    apart (transformers 5.25.0). Planted: the whole row as prefix (type ids all 0): each sample then sees its own
    future (non_causal), and no other sample's content (isolation 0.0)."""
    wb = fixed_bench("paligemma", "sdpa", tolerances)
    batch = P.pack(wb.model, P.mm_samples(wb))
    types = batch["token_type_ids"][0].tolist()
    assert types[:3 + 4 + 3] == [0] * 10 and types[10] == 1  # 3 text tokens, 4 image tokens, then the 3-token prompt

    def all_prefix(model, samples, layout):
        out = P.pack(model, samples, layout)
        out["token_type_ids"] = torch.zeros_like(out["token_type_ids"])
        return out

    result = P.check_mm_parity(wb, collator=all_prefix)
    assert (result.status, result.cause) == ("fail", "non_causal"), result.message
    assert result.evidence["isolation_moved"] <= 1e-6


def test_llava_cu_seq_lens_reach_the_vision_tower_on_the_flash_path(tolerances):
    """transformers 5.25.0: LLaVA hands the forward's kwargs (a flattening collator's cu_seq_lens_q/k, max_length_q/k)
    to its vision tower as well, whose flash attention then reads the text row's boundaries over the images' patches
    (the reference kernel refuses them: cu_seqlens ending at the row's tokens, past the tower's). The 1-D row alone
    holds on the flash path."""
    wb = fixed_bench("llava", "packcheck_flash_ref", tolerances)
    assert P.check_mm_parity(wb).status == "pass"
    result = P.check_mm_layouts(wb)
    assert result.metrics["held"] == ["flat"], result.message
    assert "FlashBoundariesError" in result.metrics["layouts"]["flat+cu_seq_lens"]["error"]
    assert [f["cause"] for f in result.findings] == ["flash_boundaries"]


def test_a_vlm_spec_builds_the_image_text_to_text_class_and_names_a_model_without_one():
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    spec = parse_model_spec("vlm:llava{vision_config.image_size=28}", "test")
    assert (spec.head, spec.label) == ("vlm", "llava-vlm{vision_config.image_size=28}")
    resolved = resolve_model(spec, "test")
    assert (resolved.model_class, resolved.auto_class) == ("LlavaForConditionalGeneration", "AutoModelForImageTextToText")
    assert resolved.record()["model_kind"] == "vlm"
    with pytest.raises(PackcheckUsageError, match="no image-text-to-text class.*vlm:llava"):
        resolve_model(parse_model_spec("vlm:llama", "test"), "test")
    with pytest.raises(PackcheckUsageError, match=r"vlm: takes a transformers model_type such as vlm:llava"):
        parse_model_spec("vlm:Bad Name", "test")


def test_llava_processor_rows_through_the_flattening_collator(tolerances):
    """LLaVA's processor, built from local files (a word-level tokenizer with <image> at the tiny model's image id, its
    PIL image processor at the tower's 28 pixels), makes the samples; transformers 5.25.0's DataCollatorWithFlattening
    packs them. As it is, the collator keeps input_ids / labels / position_ids only: the images' pixel_values are
    dropped (collator_contract; the image tokens keep their placeholder embeddings). With the processor's pixel_values
    added the row is exact against each sample alone, with or without the flash kwargs (sdpa reads none)."""
    from pytest_packcheck.checks import pixel_processors as PP

    wb = fixed_bench("llava", "sdpa", tolerances)
    samples = PP.processor_samples(wb)
    image = wb.model.config.image_token_id
    assert [s.ids.count(image) for s in samples] == [4, 0, 4]  # (28 / 14)^2 patches, the CLS counted and dropped
    assert samples[0].pixels.shape == (1, 3, 28, 28)  # the 56x56 and 56x84 images resized and cropped by the processor
    flat = PP.flattening_collator(wb.model, samples, "flattening")
    assert set(flat) == {"input_ids", "labels", "position_ids"}
    result = P.check_mm_processor(wb)
    layouts = result.metrics["layouts"]
    assert layouts["flattening"]["dropped"] == ["pixel_values"] and layouts["flattening"]["max_abs_diff"] > 1e-2
    assert result.metrics["held"] == ["flattening+pixels", "flattening+flash_kwargs+pixels"], result.message
    assert [f["cause"] for f in result.findings] == ["collator_contract"]
    with pytest.raises(ValueError, match="unknown collator layout 'nope'"):
        PP.flattening_collator(wb.model, samples, "nope")


def test_a_family_without_a_processor_recipe_is_a_skip_naming_torchvision(qwen2_vl):
    result = P.check_mm_processor(qwen2_vl)
    assert result.status == "skipped" and "torchvision" in result.message and "qwen2_vl" in result.message


def test_gemma3_processor_rows_carry_its_image_markers(gemma3):
    """Gemma 3's processor from local files: <start_of_image> in the prompt becomes boi, mm_tokens_per_image image
    tokens, eoi (Gemma3Processor.full_image_sequence); the 56x84 image resized to the tower's 64x64."""
    from pytest_packcheck.checks import pixel_processors as PP

    config = gemma3.model.config
    samples = PP.processor_samples(gemma3)
    assert [s.ids.count(config.image_token_id) for s in samples] == [4, 0, 4]
    first = samples[0].ids
    at = first.index(config.boi_token_id)
    assert first[at + 1:at + 6] == [config.image_token_id] * 4 + [config.eoi_token_id]
    assert samples[2].pixels.shape == (1, 3, 64, 64)
    batch = PP.flattening_collator(gemma3.model, samples, "flattening+pixels")
    assert batch["pixel_values"].shape == (2, 3, 64, 64) and int(batch["token_type_ids"].sum()) == 8


def test_a_video_row_holds_and_catches_both_planted_faults(qwen2_vl):
    """Qwen2-VL with a video (pixel_values_videos / video_grid_thw 2x4x4: 8 video tokens) beside a text-only and an
    image sample, transformers 5.25.0 sdpa: exact on the release's layout (2.98e-07); get_rope_index over the whole
    row misplaces the later samples (wrong_positions, logits equal), the M-RoPE rows alone leak (7.9e-01)."""
    samples = P.video_samples(qwen2_vl)
    config = qwen2_vl.model.config
    assert samples[0].video and samples[0].ids.count(config.video_token_id) == 8
    batch = P.pack(qwen2_vl.model, samples)
    assert batch["pixel_values_videos"].shape == (32, 3 * 2 * 14 * 14) and batch["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6]] and int((batch["mm_token_type_ids"] == 2).sum()) == 8
    result = P.check_mm_videos(qwen2_vl)
    assert result.status == "pass" and result.metrics["max_abs_diff"] < 1e-5, result.message
    result = P.check_mm_videos(qwen2_vl, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "wrong_positions") and result.metrics["max_abs_diff"] < 1e-5
    result = P.check_mm_videos(qwen2_vl, collator=no_text_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["isolation"] > 1e-2, result.message


def test_a_model_without_video_rows_is_a_skip(tolerances):
    result = P.check_mm_videos(fixed_bench("llava", "sdpa", tolerances))
    assert result.status == "skipped" and "video" in result.message


def test_every_fixed_image_family_is_built_by_a_test():
    assert set(FIXED) | {"gemma3"} == set(P.FIXED_IMAGES)


def test_idefics3_processor_rows_keep_their_pixel_attention_mask(tolerances):
    """Idefics3's processor from local files (one global image, not split, resized to the tower's 128 pixels, with its
    pixel_attention_mask, all ones here: nothing padded); DataCollatorWithFlattening drops pixel_values and
    the mask (collator_contract, text logits 1.5e-01 off on sdpa, transformers 5.25.0); with them added the row holds
    (1.0e-07), and the guard judges the same row with each sample's own mask (a pass)."""
    from pytest_packcheck.checks import pixel_processors as PP
    from pytest_packcheck.guard import verify_packed_batch

    wb = fixed_bench("idefics3", "sdpa", tolerances)
    samples = PP.processor_samples(wb)
    assert [s.ids.count(wb.model.config.image_token_id) for s in samples] == [4, 0, 4]
    assert samples[2].pixels.shape == (1, 1, 3, 128, 128) and samples[2].mask.shape == (1, 1, 128, 128)
    result = P.check_mm_processor(wb)
    assert result.metrics["layouts"]["flattening"]["dropped"] == ["pixel_values", "pixel_attention_mask"], result.message
    assert result.metrics["held"] == ["flattening+pixels", "flattening+flash_kwargs+pixels"], result.message
    batch = PP.flattening_collator(wb.model, samples, "flattening+pixels")
    assert batch["pixel_attention_mask"].shape == (1, 2, 128, 128)
    guard = verify_packed_batch(wb.model, batch)
    assert guard.verdict == "pass" and "pixel_attention_mask" in guard.run["pixels"], guard.line()


def test_llava_next_rows_with_several_tiles_hold_and_catch_the_planted_faults(tolerances):
    """LLaVA-NeXT with two grid pinpoints (28x28, 28x56 at image_size 28): the first image is one tile, the second
    fills the 28x56 pinpoint, two tiles (image_sizes [28, 56]: 4 base + 8 tile patches + 2 newlines = 14 tokens),
    its pixel_values (images, 1 + most tiles, 3, 28, 28) with the one-tile image's missing tile zeros. Isolation,
    parity and positions hold on sdpa and the varlen reference as for one tile (transformers 5.25.0), and the guard
    judges the row (a pass). Planted: positions that never restart (leak, wrong_positions); the second image's tiles
    swapped (its base image kept): the text after it moves, its sample alone is not."""
    import dataclasses

    from pytest_packcheck.guard import verify_packed_batch

    FIXED["llava_next_tiles"] = "vlm:llava_next{vision_config.image_size=28,image_grid_pinpoints=[[28,28],[28,56]]}"
    try:
        benches = {b: fixed_bench("llava_next_tiles", b, tolerances) for b in ("sdpa", "packcheck_flash_ref")}
    finally:
        del FIXED["llava_next_tiles"]
    wb = benches["sdpa"]
    samples = P.mm_samples(wb)
    assert P.pinpoint_size(wb.model.config) == (28, 56)
    assert [s.grid for s in samples] == [(1, 28, 28), None, (1, 28, 56)]
    assert [s.ids.count(wb.model.config.image_token_id) for s in samples] == [10, 0, 14]
    batch = P.pack(wb.model, samples)
    assert batch["pixel_values"].shape == (2, 3, 3, 28, 28) and batch["image_sizes"].tolist() == [[28, 28], [28, 56]]
    assert float(batch["pixel_values"][0, 2].abs().sum()) == 0.0  # the one-tile image's missing tile
    for backend, bench in benches.items():
        for check in (P.check_mm_isolation, P.check_mm_parity, P.check_mm_positions):
            result = check(bench)
            assert result.status == "pass", (backend, check.__name__, result.message)
    assert P.parity_numbers(wb)["max_abs_diff"] < 1e-5
    guard = verify_packed_batch(wb.model, batch)
    assert guard.verdict == "pass", guard.line()
    result = P.check_mm_isolation(wb, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "leak") and result.metrics["max_change"] > 1e-3, result.message
    result = P.check_mm_positions(wb, collator=whole_row)
    assert (result.status, result.cause) == ("fail", "wrong_positions")

    def tiles_swapped(model, samples, layout):
        """Planted: the tiled image's two tiles in swapped order (the row's pixels are not its sample's)."""
        swapped = [dataclasses.replace(s, pixels=s.pixels[:, [0, 2, 1]]) if s.pixels is not None and s.pixels.shape[1] == 3
                   else s for s in samples]
        return P.pack(model, swapped, layout)

    result = P.check_mm_parity(wb, collator=tiles_swapped)
    assert result.status == "fail" and result.metrics["max_abs_diff"] > 1e-3, result.message
    assert result.metrics["max_abs_diff_per_sample"][:2] == pytest.approx([0, 0], abs=1e-5)  # only the tiled sample


def test_an_mrope_family_numbered_otherwise_is_a_skip_naming_what_its_config_lacks():
    """--all-architectures reaches M-RoPE VLMs whose configs lack what packcheck's pixel row reads (transformers 5.25.0:
    GLM-4V has no vision_start_token_id, PaddleOCR-VL's tower no temporal_patch_size): a skip naming the keys, not
    packcheck's crash inside the row builder. Planted on a Qwen2-VL-shaped stub: each key removed in turn."""
    from types import SimpleNamespace

    def stub(**drop):
        vision = {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
        top = {"model_type": "glm4v", "image_token_id": 5, "vision_start_token_id": 6, "vision_end_token_id": 7}
        config = SimpleNamespace(**{k: v for k, v in top.items() if k not in drop},
                                 vision_config=SimpleNamespace(**{k: v for k, v in vision.items() if k not in drop}))
        return SimpleNamespace(config=config, model=SimpleNamespace(get_rope_index=lambda *a: None))

    assert P.is_pixel_model(stub()) is None
    for key in (*P.MROPE_ROW_KEYS, *P.MROPE_VISION_KEYS):
        why = P.is_pixel_model(stub(**{key: True}))
        assert why is not None and "has no " in why and key in why, (key, why)


def test_all_architectures_on_the_multimodal_audit_adds_every_vlm_packcheck_lays_out_not_the_causal_lms():
    """`--audit multimodal --all-architectures`: the suite's models, then every M-RoPE architecture and each
    FIXED_IMAGES family at its tiny spec (pixels.TINY_SPECS, the specs these tests build); before, the flag added every
    causal LM (arch:llama ...) to a pixel suite. The tiny specs are the ones this file builds."""
    from pytest_packcheck.config.settings import resolve

    options = {"packcheck_audit": "multimodal", "packcheck_all_architectures": True}
    models = resolve(lambda dest: options.get(dest), lambda key: None).models
    assert "arch:llama" not in models and "arch:glm4v" in models and "arch:qwen3_vl_moe" in models
    assert P.TINY_SPECS["smolvlm"] in models and P.TINY_SPECS["aya_vision"] in models
    assert len([m for m in models if m.split(":", 1)[1].startswith("qwen2_vl")]) == 1  # the suite's, not twice
    assert {k: v for k, v in P.TINY_SPECS.items() if k in FIXED} == FIXED and set(P.TINY_SPECS) == set(P.FIXED_IMAGES)
