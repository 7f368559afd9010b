"""Input variants beside the standard packed row (pytest_packcheck.checks.variants): each check on the correct stack
and on a planted fault that it must catch."""

from __future__ import annotations

import pytest
import torch

from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks import variants as V
from pytest_packcheck.checks.workbench import Workbench
from pytest_packcheck.model.batches import default_collator_factory


def _bench(model, tolerances, backend):
    return Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=dict(tolerances["float32"]))


@pytest.fixture(scope="module")
def models(tolerances):
    from conftest import make_bench

    return {(m, b): make_bench(m, b, tolerances).model for m in ("llama", "gpt2") for b in ("sdpa", REFERENCE_BACKEND)}


@pytest.fixture
def bench(models, tolerances):
    return lambda model, backend: _bench(models[(model, backend)], tolerances, backend)


class _Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


class DropsOffsetPositions(_Wrapper):
    """Planted: on a packed row (more than one segment) rebases every segment's position_ids to start at 0, as a
    packed branch that rebuilds positions from the boundaries would (a model that drops offset positions)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        step = None if position_ids is None else torch.diff(position_ids[0], prepend=position_ids[0, :1] - 1) != 1
        if step is not None and int(step.sum()) > 1:
            pos = position_ids[0].clone()
            first = pos[torch.cummax(torch.where(step, torch.arange(len(pos)), 0), 0).values]
            position_ids = (pos - first)[None]
        return self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)


class MaskAsPadding(_Wrapper):
    """Planted: a 4-D mask reaches attention as an all-ones padding mask (its block structure lost)."""

    def forward(self, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.ndim == 4:
            attention_mask = torch.ones(1, attention_mask.shape[-1], dtype=torch.long)
        return self.inner(attention_mask=attention_mask, **kwargs)


class SegmentAware(_Wrapper):
    """The fix a framework applies: 2-D segment ids turned into the 4-D block-diagonal mask."""

    def forward(self, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.ndim == 2 and int(attention_mask.max()) > 1:
            seg = attention_mask[0]
            attention_mask = (torch.ones(len(seg), len(seg), dtype=torch.bool).tril() & (seg[:, None] == seg[None]))[None, None]
        return self.inner(attention_mask=attention_mask, **kwargs)


class TriplesOneRow(_Wrapper):
    """Planted (transformers 5.3.0's Qwen3.5 fault): one sequence's cu_seq_lens spread over 3x its tokens."""

    def forward(self, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
        if cu_seq_lens_q is not None and len(cu_seq_lens_q) == 2:
            n = int(cu_seq_lens_q[-1])
            cu_seq_lens_q = cu_seq_lens_k = torch.tensor([0, n, 2 * n, 3 * n], dtype=torch.int32)
        return self.inner(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, **kwargs)


def collator_shifted_cu(**kwargs):
    """Planted: a flattening collator whose cu_seq_lens disagree with its position_ids (boundaries one token late)."""
    real = default_collator_factory(**kwargs)

    def collate(features, return_tensors="pt"):
        batch = real(features, return_tensors=return_tensors)
        if "cu_seq_lens_q" in batch:
            cu = batch["cu_seq_lens_q"].clone()
            cu[1:-1] += 1
            batch["cu_seq_lens_q"], batch["cu_seq_lens_k"] = cu, cu.clone()
        return batch

    return collate


# ------------------------------------------------------------------------------------------------------------
# offset positions


def test_offset_positions_hold_on_sdpa_and_a_model_that_drops_them_is_caught(bench):
    for model in ("llama", "gpt2"):
        r = V.check_offset_positions(bench(model, "sdpa"))
        assert r.status == "pass" and r.metrics["max_abs_diff"] < 1e-5, r.message
    b = bench("gpt2", "sdpa")
    assert V.check_offset_positions(b).metrics["offset_sensitivity"] > 1e-2  # learned positions see the offset
    b.model = DropsOffsetPositions(b.model)
    r = V.check_offset_positions(b)
    assert r.status == "fail" and r.cause == "offset_positions" and r.metrics["items"]["position_ids"]["max_abs_diff"] > 1e-2, r.message


def test_flash_path_offset_row_is_a_verdict_not_a_crash(bench):
    """transformers 5.24's flash path finds boundaries where position_ids == 0: a row whose first example starts at
    10 gets cu_seqlens [11, 31] (FlashAttention-2 would read outside the row); with cu_seq_lens given it holds."""
    r = V.check_offset_positions(bench("llama", REFERENCE_BACKEND))
    items = r.metrics["items"]
    assert r.status == "fail" and r.cause == "offset_positions"
    assert "FlashBoundariesError" in items["position_ids"]["evidence"]
    assert items["with_cu_seq_lens"]["status"] == "pass"


# ------------------------------------------------------------------------------------------------------------
# cu_seq_lens without / against position_ids


def test_cu_seq_lens_without_position_ids_rotary_fine_learned_positions_wrong(bench):
    rotary = V.check_cu_seq_lens(bench("llama", REFERENCE_BACKEND))
    assert rotary.status == "pass", rotary.message
    learned = V.check_cu_seq_lens(bench("gpt2", REFERENCE_BACKEND))
    item = learned.metrics["items"]["without_position_ids"]
    assert learned.status == "fail" and learned.cause == "positions_not_restarted" and item["max_abs_diff"] > 0.1, learned.message
    assert learned.metrics["without_position_ids_moved"] <= 1e-6  # the boundaries held
    sdpa = V.check_cu_seq_lens(bench("llama", "sdpa"))  # sdpa reads no cu_seq_lens: one causal row
    assert sdpa.status == "fail" and sdpa.cause == "leak", sdpa.message
    assert sdpa.metrics["standard_row_right"] is True  # the hazard showing (trial W6), not the model's own leak


def test_collator_whose_cu_seq_lens_disagree_with_position_ids_is_caught(bench):
    b = bench("llama", REFERENCE_BACKEND)
    assert V.check_cu_seq_lens(b).metrics["items"]["agree"]["status"] == "pass"
    b.collator_factory = collator_shifted_cu
    r = V.check_cu_seq_lens(b)
    assert r.status == "fail" and r.cause == "collator_contract", r.message
    assert r.metrics["items"]["agree"]["status"] == "fail"


def test_disagreeing_inputs_say_what_each_backend_follows(bench):
    assert V.check_cu_seq_lens(bench("llama", "sdpa")).metrics["disagreeing"]["follows"] == "position_ids"
    flash = V.check_cu_seq_lens(bench("llama", REFERENCE_BACKEND)).metrics["disagreeing"]
    # the kernel keeps cu_seq_lens' boundaries, rotary the position_ids' restarts: neither split alone
    assert flash["follows"] == "neither" and flash["max_abs_diff_position_ids_split"] > 1e-3
    # a model that drops position_ids (planted, faults.DropPositionIds) on the flash path: cu_seq_lens alone decide
    from faults import DropPositionIds

    b = bench("llama", REFERENCE_BACKEND)
    b.model = DropPositionIds(b.model)
    dropped = V.check_cu_seq_lens(b).metrics["disagreeing"]
    assert dropped["follows"] == "cu_seq_lens" and dropped["max_abs_diff_cu_seq_lens_split"] < 1e-5, dropped


# ------------------------------------------------------------------------------------------------------------
# segment masks


def test_segment_masks_four_d_holds_on_sdpa_two_d_segment_ids_do_not(bench):
    r = V.check_segment_masks(bench("llama", "sdpa"))
    items = r.metrics["items"]
    assert items["block_diagonal_4d"]["status"] == "pass", items
    assert r.status == "fail" and r.cause == "segment_mask" and items["segment_ids_2d"]["max_abs_diff"] > 1e-2


def test_flash_path_refusing_a_four_d_mask_is_the_items_verdict(bench):
    r = V.check_segment_masks(bench("llama", REFERENCE_BACKEND))
    items = r.metrics["items"]
    assert items["segment_ids_2d"]["status"] == "pass"  # nothing unpadded from non-zero ids: the ids' boundaries hold
    assert items["block_diagonal_4d"]["status"] == "fail" and "the forward raised" in items["block_diagonal_4d"]["evidence"]
    assert r.status == "fail" and r.cause == "segment_mask"


def test_a_mask_that_reaches_attention_as_padding_is_caught_and_a_segment_aware_model_passes(bench):
    b = bench("llama", "sdpa")
    b.model = MaskAsPadding(b.model)
    assert V.check_segment_masks(b).metrics["items"]["block_diagonal_4d"]["status"] == "fail"
    b = bench("llama", "sdpa")
    b.model = SegmentAware(b.model)
    r = V.check_segment_masks(b)
    assert r.status == "pass" and r.metrics["max_abs_diff"] < 1e-5, r.message


# ------------------------------------------------------------------------------------------------------------
# one unpacked row


def test_single_row_equals_the_dense_path_and_a_tripled_row_is_caught(bench):
    for backend in ("sdpa", REFERENCE_BACKEND):
        r = V.check_single_row(bench("llama", backend))
        assert r.status == "pass" and r.metrics["max_abs_diff"] < 1e-5, r.message
    b = bench("llama", REFERENCE_BACKEND)
    b.model = TriplesOneRow(b.model)
    r = V.check_single_row(b)
    assert r.status == "fail" and r.cause == "single_row", r.message
    assert r.metrics["items"]["position_ids"]["status"] == "pass"  # only the cu_seq_lens row is tripled
    assert "with_cu_seq_lens" in r.evidence["item"]


def test_a_variant_on_a_model_wrong_without_it_names_the_models_own_fault(bench, monkeypatch):
    """Planted: the standard packed row is itself wrong (sdpa attends across examples, faults.leaky_sdpa): the
    offset row fails too, but its cause is the model's own (leak), the variant's a finding, as the traps do."""
    from faults import leaky_sdpa

    with leaky_sdpa():
        r = V.check_offset_positions(bench("llama", "sdpa"))
    assert r.status == "fail" and r.cause == "leak" and r.metrics["standard_row_diff"] > 1e-2, r.message
    assert r.metrics["standard_row_right"] is False  # the report counts it as the model's fault, not the hazard
    assert [f["cause"] for f in r.findings][:1] == ["offset_positions"]


class RaisesWithoutZero(torch.nn.Module):
    """transformers 4.54.1's flash path in miniature: position_ids that never contain 0 raise, packed or not
    (``max()`` of the empty set of restarts), even for one example alone."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        if position_ids is not None and not bool((position_ids == 0).any()):
            torch.empty(0).max()  # RuntimeError: max(): Expected reduction dim to be specified for input.numel() == 0
        return self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)


def test_a_backend_that_raises_on_an_offset_example_alone_is_a_verdict(bench):
    """4.54.1 (measured): the offset example alone raised, and packcheck crashed (shrunk_crash); it is the
    check's verdict, offset_positions, naming the example alone."""
    b = bench("llama", "sdpa")
    b.model = RaisesWithoutZero(b.model)
    r = V.check_offset_positions(b)
    assert r.status == "fail" and r.cause == "offset_positions", r.message
    assert "one example alone at positions 10..20" in r.message and "RuntimeError: max()" in r.message


def collator_without_flash_kwargs(**kwargs):
    """DataCollatorWithFlattening before 4.52: no return_flash_attn_kwargs, so never cu_seq_lens."""
    kwargs.pop("return_flash_attn_kwargs", None)
    return default_collator_factory(**kwargs)


def test_cu_seq_lens_on_a_collator_that_cannot_send_them_is_not_checked(bench):
    """4.45.2 (measured): the collator returns no cu_seq_lens; the cell was an error (a pass resting on no number);
    it is not checked, with the reason, and the disagreeing row is still reported."""
    b = bench("llama", "sdpa")
    b.collator_factory = collator_without_flash_kwargs
    r = V.check_cu_seq_lens(b)
    assert r.status == "skipped" and "returns no cu_seq_lens_q" in r.message, r.message
    assert r.metrics["items"]["without_position_ids"]["status"] == "not_checked"
