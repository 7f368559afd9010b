"""The guard on a multimodal packed row with pixels (issue 46 part 4): verify_packed_batch takes a VLM batch with
pixel_values (image_grid_thw, mm_token_type_ids) and judges its text log-probs against each sample alone with its own
pixels; it passes a correct row and fails the planted faults (transformers 5.25.0, tiny Qwen2-VL / LLaVA, sdpa)."""

from __future__ import annotations

import pytest
import torch
from test_multimodal_pixels import fixed_bench, no_text_row, pixel_bench, whole_row

from pytest_packcheck.checks import pixels as P
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.guard import PackedBatchMismatch, verify_packed_batch


@pytest.fixture(scope="module")
def qwen2_vl(tolerances):
    return pixel_bench("qwen2_vl", "sdpa", tolerances)


def test_a_correct_qwen2_vl_pixel_row_passes(qwen2_vl):
    batch = P.pack(qwen2_vl.model, P.mm_samples(qwen2_vl))
    result = verify_packed_batch(qwen2_vl.model, batch)
    assert result.verdict == "pass" and result.max_logprob_diff < 1e-5 and result.loss_delta < 1e-5, result.line()
    assert result.lengths == [len(s.ids) for s in P.mm_samples(qwen2_vl)] and result.forwards == 4
    assert result.probes["tokens_misplaced"] == 0 and "image_grid_thw" in result.run["pixels"]


def test_the_flat_collator_row_fails_with_its_images_misplaced(qwen2_vl):
    """Planted: DataCollatorWithFlattening's (1, total) row on Qwen2-VL: the image tokens sit at text positions and no
    packed mask is derived (log-probs 5.6e-01 off on 5.25.0)."""
    batch = P.pack(qwen2_vl.model, P.mm_samples(qwen2_vl), "flat")
    result = verify_packed_batch(qwen2_vl.model, batch)
    assert (result.verdict, result.cause) == ("fail", "wrong_positions"), result.line()
    assert result.max_logprob_diff > 1e-2 and result.probes["tokens_misplaced"] > 0
    with pytest.raises(PackedBatchMismatch, match="wrong_positions"):
        verify_packed_batch(qwen2_vl.model, batch, on_mismatch="raise")


def test_get_rope_index_over_the_whole_row_fails_on_the_positions_alone(qwen2_vl):
    """Planted: get_rope_index called once on the packed row (text row restarting): every later sample is shifted by
    a constant, which RoPE does not see in the logits (log-probs equal), the positions probe does."""
    result = verify_packed_batch(qwen2_vl.model, whole_row(qwen2_vl.model, P.mm_samples(qwen2_vl), None))
    assert (result.verdict, result.cause) == ("fail", "wrong_positions"), result.line()
    assert result.max_logprob_diff < 1e-5 and result.probes["tokens_misplaced"] > 0


def test_m_rope_rows_without_the_text_row_leak(qwen2_vl):
    batch = no_text_row(qwen2_vl.model, P.mm_samples(qwen2_vl), None)
    result = verify_packed_batch(qwen2_vl.model, batch)
    assert (result.verdict, result.cause) == ("fail", "leak"), result.line()
    assert result.probes["isolation_moved"] > 1e-2


def test_images_that_do_not_fill_the_image_tokens_are_a_usage_error(qwen2_vl):
    batch = P.pack(qwen2_vl.model, P.mm_samples(qwen2_vl))
    batch["image_grid_thw"] = batch["image_grid_thw"][:1]
    batch["pixel_values"] = batch["pixel_values"][:16]
    with pytest.raises(PackcheckUsageError, match="image tokens, its images fill"):
        verify_packed_batch(qwen2_vl.model, batch)


def test_llava_rows_pass_and_a_row_that_never_restarts_is_not_judged(tolerances):
    wb = fixed_bench("llava", "sdpa", tolerances)
    samples = P.mm_samples(wb)
    result = verify_packed_batch(wb.model, P.pack(wb.model, samples))
    assert result.verdict == "pass" and result.max_logprob_diff < 1e-5 and len(result.lengths) == 3, result.line()
    result = verify_packed_batch(wb.model, whole_row(wb.model, samples, None))
    assert result.verdict == "skipped" and "never restart" in result.evidence
    # planted: positions that never restart, the boundaries given by cu_seq_lens_q only (which sdpa does not read)
    batch = P.pack(wb.model, samples)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    batch["cu_seq_lens_q"] = torch.tensor([0, len(samples[0].ids), len(samples[0].ids) + len(samples[1].ids),
                                           batch["input_ids"].shape[1]], dtype=torch.int32)
    result = verify_packed_batch(wb.model, batch)
    assert (result.verdict, result.cause) == ("fail", "leak"), result.line()  # one causal block on sdpa


def test_a_video_row_is_judged_with_each_sample_s_own_video(qwen2_vl):
    """pixel_values_videos / video_grid_thw split per sample as the images are: the release's row passes, the M-RoPE
    rows of get_rope_index over the whole row fail wrong_positions, a video that does not fill its tokens is refused."""
    samples = P.video_samples(qwen2_vl)
    batch = P.pack(qwen2_vl.model, samples)
    result = verify_packed_batch(qwen2_vl.model, batch)
    assert result.verdict == "pass" and result.max_logprob_diff < 1e-5, result.line()
    assert {"pixel_values_videos", "video_grid_thw", "pixel_values"} <= set(result.run["pixels"])
    result = verify_packed_batch(qwen2_vl.model, whole_row(qwen2_vl.model, samples, None))
    assert (result.verdict, result.cause) == ("fail", "wrong_positions") and result.probes["tokens_misplaced"] > 0
    result = verify_packed_batch(qwen2_vl.model, no_text_row(qwen2_vl.model, samples, None))
    assert (result.verdict, result.cause) == ("fail", "leak"), result.line()
    batch["video_grid_thw"] = torch.tensor([[1, 4, 4]])
    with pytest.raises(PackcheckUsageError, match="8 video tokens, its videos fill 4"):
        verify_packed_batch(qwen2_vl.model, batch)


@pytest.mark.parametrize("name", ["llava_next", "mistral3", "idefics3", "paligemma"])
def test_every_pixel_layout_of_the_llava_style_families_is_split_per_sample(name, tolerances):
    """LLaVA-NeXT's tiles with image_sizes, Pixtral's padded images of two sizes, Idefics3's (1, images, 3, h, w),
    PaliGemma's prefix token_type_ids: the correct row passes; the planted row (positions that never restart, the
    boundaries in cu_seq_lens_q only, which sdpa does not read) fails as a leak."""
    wb = fixed_bench(name, "sdpa", tolerances)
    samples = P.mm_samples(wb)
    result = verify_packed_batch(wb.model, P.pack(wb.model, samples))
    assert result.verdict == "pass" and result.max_logprob_diff < 1e-5 and len(result.lengths) == 3, result.line()
    batch = P.pack(wb.model, samples)
    lengths = [len(s.ids) for s in samples]
    batch["position_ids"] = torch.arange(sum(lengths))[None]
    batch["cu_seq_lens_q"] = torch.tensor([0, lengths[0], lengths[0] + lengths[1], sum(lengths)], dtype=torch.int32)
    result = verify_packed_batch(wb.model, batch)
    assert (result.verdict, result.cause) == ("fail", "leak"), result.line()
    # planted: positions restarting per sample but stepping by 2: the row differs, no sample reaches another (the first
    # sample's own images perturbed, not the others': Idefics3's images along dim 1, LLaVA-NeXT's tiles kept together)
    batch = P.pack(wb.model, samples)
    batch["position_ids"] = 2 * batch["position_ids"]
    result = verify_packed_batch(wb.model, batch)
    assert (result.verdict, result.cause) == ("fail", "packed_mismatch"), result.line()
    assert result.probes["isolation_moved"] <= 1e-6


def test_the_callback_judges_the_first_pixel_row_the_trainer_feeds(qwen2_vl, tmp_path):
    """PackcheckCallback's forward pre-hook on a VLM: the first training forward's pixel row is judged before it runs
    (the release's row passes; the flat collator row raises PackedBatchMismatch before the forward)."""
    from types import SimpleNamespace

    from pytest_packcheck.guard import PackcheckCallback

    model = qwen2_vl.model
    args = SimpleNamespace(output_dir=str(tmp_path), gradient_accumulation_steps=1)
    for layout, ok in (("text+mrope", True), ("flat", False)):
        callback = PackcheckCallback(on_mismatch="raise", verbose=False)
        callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True), None, model=model)
        batch = P.pack(model, P.mm_samples(qwen2_vl), layout)
        model.train()
        try:
            if ok:
                model(**batch, use_cache=False)
                assert callback.result.verdict == "pass" and callback.result.run["pixels"], callback.result.line()
            else:
                with pytest.raises(PackedBatchMismatch, match="wrong_positions"):
                    model(**batch, use_cache=False)
        finally:
            model.eval()
            callback.on_train_end(args, None, None)
