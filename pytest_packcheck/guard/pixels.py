"""The guard on a multimodal packed row with pixels (issue 46 part 4): a VLM's batch that carries ``pixel_values``
(``image_grid_thw`` / ``mm_token_type_ids`` for the Qwen2-VL family, ``image_sizes`` for Pixtral, ``token_type_ids``
for Gemma 3 / PaliGemma), judged on its text logits against each sample alone with its own pixels.

The row is split where its text positions restart (the first row of a ``(4, 1, N)`` M-RoPE layout, a ``(1, N)`` row,
or all three rows of a ``(3, 1, N)`` layout at 0), or by ``cu_seq_lens_q``; each image goes to the sample whose image
tokens it fills, in order (an M-RoPE image: ``t*h*w / merge**2`` tokens of its ``image_grid_thw``; a family of
:data:`..checks.pixels.FIXED_IMAGES`: its ``tokens(config, h, w)``). Each sample alone is the model's own forward of
its ids, its images and its type ids, no ``position_ids`` (``get_rope_index`` inside the model), no attention_mask.
Compared: the log-probs of the labelled next tokens (``labels``; without labels every next token that is not an
image placeholder; none across a sample start), their worst absolute difference and the mean loss (nats), and, on an
M-RoPE model, the row's M-RoPE positions per sample against the model's ``get_rope_index`` of that sample alone.

Causes: ``wrong_positions`` (tokens placed otherwise than alone: a flat ``(1, N)`` row on Qwen2-VL, whose image tokens
then sit at text positions; ``get_rope_index`` called once over the whole row, which shifts every later sample, a
constant RoPE is blind to, caught by the positions alone), ``leak`` (changing the first sample's pixels moves the
others' log-probs), else ``packed_mismatch``.
"""

from __future__ import annotations

import time
from typing import Any

from ..results.metrics import worst as worst_diff
from .result import GuardResult

#: The keys a pixel row may carry beside the text row's.
PIXEL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_sizes",
              "pixel_attention_mask", "mm_token_type_ids", "token_type_ids")
#: The M-RoPE families' modalities: (pixels key, grid key, the config's token id attribute).
MODALITIES = (("pixel_values", "image_grid_thw", "image_token_id"), ("pixel_values_videos", "video_grid_thw", "video_token_id"))


def is_pixel_batch(batch: Any) -> bool:
    """True when ``batch`` carries ``pixel_values`` or ``pixel_values_videos``: the guard then judges it here."""
    return hasattr(batch, "get") and any(batch.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))


def _starts(batch: Any, n: int) -> list[int]:
    import torch

    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return [int(v) for v in cu[:-1]]
    pos = batch.get("position_ids")
    if pos is None:
        raise ValueError("a pixel row needs position_ids (restarting per sample) or cu_seq_lens_q to say where its "
                         "samples start")
    if pos.ndim == 3:
        text = pos[0, 0] if pos.shape[0] == 4 else (pos[:, 0] == 0).all(0).to(torch.int64) - 1
    else:
        text = pos[0]
    return [i for i in range(n) if int(text[i]) == 0]


def _image_tokens(model: Any, batch: Any, grid_key: str = "image_grid_thw") -> list[int]:
    """Tokens each image (each video, ``grid_key`` ``video_grid_thw``) of the batch fills, in order."""
    from ..checks import pixels as P

    config = model.config
    if batch.get(grid_key) is not None:
        merge = int(config.vision_config.spatial_merge_size)
        return [int(g.prod()) // merge**2 for g in batch[grid_key]]
    if grid_key != "image_grid_thw" or batch.get("pixel_values") is None:
        return []
    family = P.fixed_images(model)
    if family is None:
        raise ValueError(f"{type(model).__name__}: no image_grid_thw in the batch and model_type {config.model_type!r} "
                         f"is not in FIXED_IMAGES ({', '.join(P.FIXED_IMAGES)})")
    values = batch["pixel_values"]
    if batch.get("image_sizes") is not None:
        sizes = [(int(h), int(w)) for h, w in batch["image_sizes"]]
    else:
        count = values.shape[1] if family.pixels == "stacked" else values.shape[0]
        sizes = [tuple(values.shape[-2:])] * count
    return [family.tokens(config, h, w) for h, w in sizes]


def _image_inputs(model: Any, batch: Any, images: list[int], modality: tuple[str, str, str] = MODALITIES[0]) -> dict[str, Any]:
    """The pixel inputs of the images (videos: ``modality`` :data:`MODALITIES` ``[1]``) numbered ``images``."""
    from ..checks import pixels as P

    if not images:
        return {}
    key, grid_key, _ = modality
    values = batch[key]
    if batch.get(grid_key) is not None:
        sizes = [int(g.prod()) for g in batch[grid_key]]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rows = [values[starts[i]:starts[i] + sizes[i]] for i in images]
        import torch

        return {key: torch.cat(rows), grid_key: batch[grid_key][images]}
    family = P.fixed_images(model)
    if family.pixels == "stacked":
        out = {"pixel_values": values[:, images]}
        if batch.get("pixel_attention_mask") is not None:
            out["pixel_attention_mask"] = batch["pixel_attention_mask"][:, images]
        return out
    out = {"pixel_values": values[images]}
    if batch.get("image_sizes") is not None:
        sizes = batch["image_sizes"][images]
        out["pixel_values"] = out["pixel_values"][..., :int(sizes[:, 0].max()), :int(sizes[:, 1].max())]
        out["image_sizes"] = sizes
    return out


def check_pixel_fields(batch: Any, device: Any) -> None:
    """Each pixel key of ``batch`` as a VLM processor hands it over, before a forward (hostile trial 5: an empty,
    1-D, list, meta or surplus ``pixel_values`` and a float ``image_grid_thw`` were tracebacks from inside the model):
    a dense tensor of numbers on ``device`` (:func:`.batch.model_device`) holding values; ``image_grid_thw`` /
    ``video_grid_thw`` integer ``(images, 3)`` rows of (t, h, w) >= 1 (their patch rows: :func:`check_patch_rows`).

    Raises:
        PackcheckUsageError: the first key that breaks it, naming the key, what it holds and the fix.
    """
    import torch

    from .result import _usage

    for key in PIXEL_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise _usage(f"a pixel row: batch[{key!r}] is a {type(value).__name__}: expected a tensor, as the model's processor "
                             "returns it (return_tensors='pt')")
        if value.is_meta or value.numel() == 0:
            raise _usage(f"a pixel row: batch[{key!r}] has shape {tuple(value.shape)}{' on the meta device' if value.is_meta else ''}: "
                             "it holds no values; pass the processor's output for the row's images")
        if (value.dtype == torch.bool and key != "pixel_attention_mask") or value.is_complex():
            raise _usage(f"a pixel row: batch[{key!r}] has dtype {value.dtype}: expected numbers (pixels as floats, grids as integers)")
        if device is not None and value.device != device:
            raise _usage(f"a pixel row: batch[{key!r}] is on {value.device}, the model on {device}: move the batch to the model's "
                             "device")
    for _, grid_key, _ in MODALITIES:
        grid = batch.get(grid_key)
        if grid is None:
            continue
        if grid.is_floating_point() or grid.ndim != 2 or grid.shape[-1] != 3 or bool((grid < 1).any()):
            raise _usage(f"a pixel row: batch[{grid_key!r}] is {tuple(grid.shape)} {grid.dtype}: expected integer rows of (t, h, w), "
                             f"each >= 1, one per {'video' if 'video' in grid_key else 'image'} (the processor's {grid_key})")


def check_patch_rows(batch: Any) -> None:
    """``pixel_values`` (videos: ``pixel_values_videos``) hold the patch rows their grid asks (t * h * w per image),
    checked once the images are known to fill the row's image tokens (:func:`split_pixel_row` says where not).

    Raises:
        ValueError: naming both shapes and the fix.
    """
    for pixels_key, grid_key, _ in MODALITIES:
        grid, pixels = batch.get(grid_key), batch.get(pixels_key)
        if grid is None:
            continue
        patches = int(grid.prod(-1).sum())
        if pixels is not None and (pixels.ndim != 2 or int(pixels.shape[0]) != patches):
            raise ValueError(f"batch[{pixels_key!r}] is {tuple(pixels.shape)}, and {grid_key} {grid.tolist()} asks "
                             f"{patches} patch rows (t * h * w per image): pass the processor's {pixels_key} and "
                             f"{grid_key} of the same images, in the row's sample order")


def split_pixel_row(model: Any, batch: Any) -> list[dict[str, Any]]:
    """Each sample of the pixel row as the model takes it alone: ``input_ids`` ``(1, n)``, its type ids, its images'
    pixel inputs, no position_ids. Raises ValueError where the images do not fill the image tokens."""
    ids = batch["input_ids"]
    n = int(ids.shape[-1])
    starts = _starts(batch, n)
    ends = [*starts[1:], n]
    kinds = [(m, _image_tokens(model, batch, m[1])) for m in MODALITIES if getattr(model.config, m[2], None) is not None]
    at = {m: 0 for m, _ in kinds}
    samples = []
    for s, e in zip(starts, ends, strict=True):
        sample = {"input_ids": ids[:, s:e]}
        for modality, counts in kinds:
            tokens = int((ids[0, s:e] == int(getattr(model.config, modality[2]))).sum())
            mine, filled = [], 0
            while filled < tokens and at[modality] < len(counts):
                mine.append(at[modality])
                filled, at[modality] = filled + counts[at[modality]], at[modality] + 1
            if filled != tokens:
                what = "video" if modality[2] == "video_token_id" else "image"
                raise ValueError(f"the sample at tokens {s}..{e} has {tokens} {what} tokens, its {what}s fill {filled}: "
                                 f"{modality[0]} / {modality[1]} are not in the row's sample order")
            sample.update(_image_inputs(model, batch, mine, modality))
        for key in ("mm_token_type_ids", "token_type_ids"):
            if batch.get(key) is not None:
                sample[key] = batch[key][:, s:e]
        samples.append(sample)
    return samples


def _logprobs(logits: Any, targets: Any, keep: Any) -> Any:
    return logits[:-1][keep].float().log_softmax(-1).gather(-1, targets[keep][:, None])[:, 0]


def _forward(model: Any, inputs: dict[str, Any]) -> Any:
    owner = next((m for m in (getattr(model, "model", None), model) if m is not None and hasattr(m, "rope_deltas")), None)
    if owner is not None:
        owner.rope_deltas = None
    return model(**inputs, use_cache=False).logits[0]


def nothing_compared(model: Any, batch: Any, tols: dict[str, dict[str, float]], verdict: str, cause: str | None,
                     evidence: str, lengths: list[int]) -> GuardResult:
    """A pixel row's result with no number: ``verdict`` ("skipped": one sample; "fail" with ``cause`` "crash": the
    model raised), ``evidence`` saying why, the dtype's tolerances and the row's size."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tol = tols.get(dtype, tols["float32"])
    return GuardResult(
        verdict=verdict, cause=cause, remedy="", evidence=evidence, dtype=dtype,
        tolerance={"logits_atol": tol["logits_atol"], "loss_atol": tol["loss_atol"]}, max_logprob_diff=None,
        per_example_logprob_diff=[], loss_packed=None, loss_reference=None, loss_delta=None, lengths=lengths,
        label_tokens=0, contract=[], run={"packed": True, "attn_implementation": getattr(model.config, "_attn_implementation", None),
                                          "tokens": int(batch["input_ids"].shape[-1])}, attention={}, dtype_source=f"{dtype} weights")


def measure_pixel_row(model: Any, batch: Any, tols: dict[str, dict[str, float]]) -> GuardResult:
    """Judge one packed pixel row (see the module's text); the caller holds eval mode, ``torch.no_grad`` and the RNG
    state. ``tols``: the dtype rows of the tolerances."""
    import torch

    from ..checks import pixels as P
    from ..checks.registry import within_numerics

    started = time.perf_counter()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tol = dict(tols.get(dtype, tols["float32"]))
    ids = batch["input_ids"]
    n = int(ids.shape[-1])
    samples = split_pixel_row(model, batch)
    check_patch_rows(batch)  # a surplus or a 1-D pixel_values was a traceback from inside the vision tower
    lengths = [int(s["input_ids"].shape[-1]) for s in samples]
    if len(samples) < 2:  # nothing marks a second sample: nothing to compare (as the text guard's one-example row)
        return nothing_compared(model, batch, tols, "skipped", None, f"one sample in the pixel row ({n} tokens): its "
                                "positions never restart and no cu_seq_lens_q splits it, so nothing is compared", lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    labels = batch.get("labels")
    special = {getattr(model.config, k, None) for k in P.SPECIAL_IDS[:2]}
    if labels is None:
        labels = ids.masked_fill(torch.isin(ids, torch.tensor([v for v in special if isinstance(v, int)])), -100)
    targets = labels[0, 1:].clone()
    for s in starts[1:]:
        targets[s - 1] = -100  # no target across a sample start
    keep = targets != -100
    call = {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch", "use_cache")}
    packed = _forward(model, call)
    packed_lp = _logprobs(packed, targets.clamp(min=0), keep)
    alone_lp, per, forwards = [], [], 1
    for s, start, length in zip(samples, starts, lengths, strict=True):
        logits = _forward(model, s)
        forwards += 1
        t, k = targets[start:start + length - 1].clamp(min=0), keep[start:start + length - 1]
        lp = _logprobs(logits, t, k)
        alone_lp.append(lp)
        ref = packed_lp[int(keep[:start].sum()):int(keep[:start].sum()) + int(k.sum())]
        per.append(float((ref - lp).abs().max()) if lp.numel() else 0.0)
    alone_all = torch.cat(alone_lp)
    worst = worst_diff(*per)
    loss_packed, loss_alone = float(-packed_lp.mean()), float(-alone_all.mean())
    delta = abs(loss_packed - loss_alone)
    probes: dict[str, Any] = {}
    misplaced = 0
    if P._rope_owner(model) is not None:  # the row's M-RoPE rows per sample vs get_rope_index of that sample alone
        pos = batch["position_ids"]
        rope = pos[1:] if pos.ndim == 3 and pos.shape[0] == 4 else (pos if pos.ndim == 3 else pos[None])
        for s, start, length in zip(samples, starts, lengths, strict=True):
            grids = [(g, key == "video_grid_thw") for key in ("image_grid_thw", "video_grid_thw") for g in s.get(key, [])]
            if len(grids) > 1:
                raise ValueError("a sample with more than one image or video: the positions probe takes one per sample")
            one = P.Sample(s["input_ids"][0].tolist(), tuple(int(v) for v in grids[0][0]) if grids else None,
                           video=bool(grids) and grids[0][1])
            ref = P.rope_alone(model, one)
            misplaced += int(((rope[:, :, start:start + length] - ref).abs().amax(0) > 0).sum())
        probes["tokens_misplaced"] = misplaced
    numbers = f"text log-probs packed vs alone {worst:.2e}, loss {loss_packed:.6f} vs {loss_alone:.6f} nats"
    cause, evidence = None, numbers
    # NaN compares as within any tolerance: NaN / inf pixels passed with "worst log-prob diff nan" (hostile trial 5)
    not_finite = (int((~torch.isfinite(packed_lp)).sum()), int((~torch.isfinite(alone_all)).sum()))
    if any(not_finite):
        cause, evidence = "non_finite", (f"{numbers}; {not_finite[0]} text log-probs of the packed row and {not_finite[1]} "
                                         "of the samples alone are NaN or infinite (the pixels, or the model, overflow): "
                                         "nothing could be compared")
    elif misplaced:
        cause, evidence = "wrong_positions", (f"{numbers}; {misplaced} tokens sit at other M-RoPE positions than "
                                              "get_rope_index gives their sample alone")
    elif worst > tol["logits_atol"] or delta > tol["loss_atol"]:
        changed = dict(call)
        first = samples[0]
        key = next((k for k in ("pixel_values", "pixel_values_videos") if k in first), None)
        if key is not None:  # the first sample's pixels changed: do the others move?
            values = batch[key].clone()
            family = P.fixed_images(model)
            stacked = family is not None and family.pixels == "stacked"  # Idefics3: (1, images, 3, h, w)
            mine = first[key].shape[1 if stacked else 0]  # its patch rows (M-RoPE) or its images
            part = values[:, :mine] if stacked else values[:mine]
            part.mul_(-3.0).add_(1.0)
            changed[key] = values
        else:
            vocab = int(model.config.get_text_config(decoder=True).vocab_size) - len(P.SPECIAL_IDS)
            changed["input_ids"] = ids.clone()
            changed["input_ids"][0, :lengths[0]] = (ids[0, :lengths[0]] + vocab // 2) % vocab
        moved_logits = _forward(model, changed)
        forwards += 1
        moved = float((moved_logits[lengths[0]:] - packed[lengths[0]:]).abs().max())
        probes["isolation_moved"] = moved
        if moved > tol["logits_atol"]:
            cause, evidence = "leak", f"{numbers}; changing the first sample moves the others' logits by {moved:.2e}"
        elif within_numerics(worst, tol["logits_atol"], dtype):
            cause, evidence = "kernel_numerics", f"{numbers}; boundaries kept (the others move {moved:.2e})"
        else:
            cause, evidence = "packed_mismatch", f"{numbers}; no sample's content reaches another ({moved:.2e})"
    attn = getattr(model.config, "_attn_implementation", None)
    return GuardResult(
        verdict="fail" if cause else "pass", cause=cause, remedy="", evidence=evidence, dtype=dtype,
        tolerance={"logits_atol": tol["logits_atol"], "loss_atol": tol["loss_atol"]}, max_logprob_diff=worst,
        per_example_logprob_diff=per, loss_packed=loss_packed, loss_reference=loss_alone, loss_delta=delta,
        lengths=lengths, label_tokens=int(keep.sum()), contract=[],
        run={"packed": True, "attn_implementation": attn, "pixels": [k for k in PIXEL_KEYS if batch.get(k) is not None],
             "tokens": n},
        attention={}, probes=probes, forwards=forwards, duration_s=time.perf_counter() - started, dtype_source=f"{dtype} weights",
        causes=[cause] if cause else [])
