"""The checks of one cell group share their identical forwards through the Workbench (issue 47), with the numbers
they had when each ran its own: the packed row's output (logits and loss), the padded batches, the boundary-free row
(position_ids and the isolation probe's negative control) and each whole example's solo run (the two-row probe)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_bench
from faults import collator_label_leak, collator_no_reset

from pytest_packcheck import checks as C
from pytest_packcheck.model import batches as B

SHARING = ("position_ids", "isolation", "logits_parity", "loss_parity")


def _count_forwards(wb) -> list[int]:
    calls: list[int] = []
    wb.model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_parity_checks_share_their_identical_forwards(tolerances):
    wb = make_bench("llama", "sdpa", tolerances)
    calls = _count_forwards(wb)
    results = {name: getattr(C, f"check_{name}")(wb) for name in SHARING}
    assert all(r.status == "pass" for r in results.values()), {n: r.message for n, r in results.items()}
    # packed row 1, examples alone 3, position_ids' plain row (= the isolation control's) 1, isolation: perturbed,
    # perturbed plain, counted 3, padded right / left 2, two rows 1 + the cut example alone 1, grad-accum 4
    assert len(calls) == 16, len(calls)


def test_shared_forwards_give_the_numbers_of_their_own_forwards(tolerances):
    wb = make_bench("llama", "sdpa", tolerances)
    results = {name: getattr(C, f"check_{name}")(wb) for name in SHARING}
    fresh = make_bench("llama", "sdpa", tolerances)  # the same seed: the same weights, nothing cached
    packed = fresh.packed()
    padded = B.padded_batch(fresh.examples, fresh.pad_id, "right", fresh.start, fresh.device)
    loss = results["loss_parity"].metrics
    assert loss["loss_packed"] == float(fresh.forward(packed, labels=packed["labels"]).loss)
    assert loss["loss_padded"] == float(fresh.forward(padded, labels=padded["labels"]).loss)
    plain = dict(packed, position_ids=torch.arange(sum(fresh.lengths))[None])
    later = slice(fresh.lengths[0], sum(fresh.lengths))
    own = float((fresh.packed_logits()[later] - fresh.packed_logits(plain)[later]).abs().max())
    assert results["position_ids"].metrics["max_change"] == own
    right = fresh.forward(padded).logits.float()
    pack_vs_pad = max(float((right[row, sl] - fresh.packed_logits()[seg]).abs().max())
                      for (row, sl), seg in zip(B.real_token_rows(fresh.examples, "right"), B.segment_slices(fresh.lengths),
                                                strict=True))
    assert results["logits_parity"].metrics["max_abs_diff_right_padded"] == pack_vs_pad


@pytest.mark.parametrize(("fault", "check", "cause"), [(collator_label_leak, "loss_parity", "loss_normalisation"),
                                                      (collator_no_reset, "isolation", "leak")])
def test_a_collator_swapped_after_the_shared_forwards_is_never_served_them(tolerances, fault, check, cause):
    """Planted: the cached packed output and boundary-free row belong to the collator that made them; a faulty
    collator handed in afterwards (as a test plants one) is measured on its own rows and fails."""
    wb = make_bench("llama", "sdpa", tolerances)
    assert all(getattr(C, f"check_{name}")(wb).status == "pass" for name in SHARING)
    wb.collator_factory = fault
    result = getattr(C, f"check_{check}")(wb)
    assert result.status == "fail" and cause in {result.cause, *(c["cause"] for c in result.causes or [])}, result.message


def test_tiny_models_run_on_one_intra_op_thread_outside_xdist(monkeypatch):
    from pytest_packcheck.run.process import limit_threads

    class Config:  # a controller or -n 0 run: no workerinput
        pass

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        limit_threads(Config(), tiny=False)
        assert torch.get_num_threads() == 2  # a real model outside xdist: torch's own choice stays
        limit_threads(Config(), tiny=True)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        limit_threads(Config(), tiny=True)
        assert torch.get_num_threads() == 2  # the user's OMP_NUM_THREADS wins
    finally:
        torch.set_num_threads(before)
