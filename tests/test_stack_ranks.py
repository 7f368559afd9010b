"""accelerate's context parallelism on two gloo ranks (checks/stack_ranks.py): the hook, Trainer's CP buffers and
torch's context_parallel sharding run on CPU; the forward needs the CUDA SDPA kernels (a skip naming torch's
NotImplementedError); the planted fault, a row that reaches the trainer without position_ids (a collator or hook that
drops them: Trainer then makes arange positions over the whole row), is caught as wrong_positions."""

from __future__ import annotations

import pytest
from conftest import make_bench

from pytest_packcheck.checks.stack_ranks import check_cp_ranks, row_for_ranks, ulysses_availability
from pytest_packcheck.model import stack as S

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def cp_bench(tolerances):
    wb = make_bench("llama", "sdpa", tolerances)
    wb.model = S.apply_element(wb.model, "cp", "sdpa")
    return wb


def test_two_gloo_ranks_shard_the_row_with_its_position_ids_and_name_what_the_forward_needs(cp_bench):
    result = check_cp_ranks(cp_bench)
    ranks = result.metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and "position_ids" in result.metrics["buffers"]
    assert sum(r["shard_tokens"] for r in ranks) == result.metrics["row_tokens"]
    if all(r.get("forward") == "ran" for r in ranks):  # a machine where torch's ring attention runs
        assert result.status in ("pass", "fail") and "max_abs_diff" in result.metrics
    else:
        assert result.status == "skipped" and "needs CUDA" in result.message and "context_parallel" in result.message
        assert "NotImplementedError" in result.metrics["forward"]
    assert result.metrics["ulysses"] == (ulysses_availability() or "available")


def test_a_row_without_position_ids_under_cp_is_caught_as_wrong_positions(cp_bench):
    result = check_cp_ranks(cp_bench, drop_position_ids=True)
    assert result.status == "fail" and result.cause == "wrong_positions", result.message
    # Trainer generated arange positions over the whole row: rank 1's shard has no restart at an example start
    assert max(result.metrics["ranks"][1]["shard_position_ids"]) >= 16


def test_the_row_is_padded_to_a_multiple_of_twice_the_world_size_with_masked_labels(cp_bench):
    batch, examples = row_for_ranks(cp_bench)
    total = int(batch["input_ids"].shape[1])
    assert total % 4 == 0 and sum(len(e) for e in examples) == total
    real = sum(cp_bench.lengths)
    assert (batch["labels"][0, real:] == -100).all()


def test_other_cells_are_skipped_or_refused_with_the_trainers_line(tolerances):
    from pytest_packcheck.backends import REFERENCE_BACKEND

    assert check_cp_ranks(make_bench("llama", "sdpa", tolerances)).status == "skipped"
    wb = make_bench("llama", REFERENCE_BACKEND, tolerances)
    wb.model = S.apply_element(wb.model, "cp", REFERENCE_BACKEND)
    result = check_cp_ranks(wb)
    assert result.status == "unsupported" and result.metrics["refused_at"].startswith("transformers/trainer.py:")
