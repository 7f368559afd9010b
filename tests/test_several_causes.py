"""A cell that fails for several reasons names each cause with its own number (``CheckResult.causes``, primary
first), and its diagnosis' remedy covers all of them."""

from __future__ import annotations

import pytest
import torch
from faults import collator_label_leak, leaky_sdpa

from pytest_packcheck import checks as C
from pytest_packcheck.analysis.diagnose import diagnose_document
from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks import sft_probes as S
from pytest_packcheck.model.batches import default_collator_factory
from pytest_packcheck.results.schema import CellResult, CheckResult


def _collator(**fixed):
    def factory(**kwargs):
        return default_collator_factory(**{**kwargs, **fixed})

    return factory


def _codes(result):
    return [c["cause"] for c in result.causes]


def test_gpt2_fed_cu_seq_lens_without_position_ids_has_wrong_positions_not_a_leak(tolerances):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False) on the varlen
    reference: cu_seq_lens keep attention isolated (isolation passes: moved 0.00e+00, its negative control, no
    boundaries at all, moves 3.6e-02; before, the control kept cu_seq_lens and the probe was 'inconclusive'),
    but gpt2's learned absolute positions count over the whole row: wrong_positions with the number the
    collated positions alone give (5.4e-01, each example run alone), and nothing else."""
    from conftest import make_bench

    bench = make_bench("gpt2", REFERENCE_BACKEND, tolerances,
                       collator_factory=_collator(return_flash_attn_kwargs=True, return_position_ids=False))
    assert "cu_seq_lens_q" in bench.packed() and "position_ids" not in bench.packed()
    iso = C.check_isolation(bench)
    assert iso.status == "pass" and iso.metrics["negative_control_change"] > 1e-3, iso.message
    for check in (C.check_logits_parity, C.check_loss_parity, C.check_grad_parity):
        got = check(bench)
        assert got.status == "fail" and _codes(got) == ["wrong_positions"], (check.__name__, got.causes)
        assert got.evidence["max_abs_diff_collated_positions"] > 1e-2 and got.evidence["batch_has_position_ids"] is False


def test_a_leak_and_wrong_positions_are_two_causes_each_with_its_number(tolerances):
    """Planted: gpt2 on sdpa fed neither position_ids nor cu_seq_lens: the examples attend across (isolation
    moves) and their positions are counted over the row. Both causes, leak first, each with its own number."""
    from conftest import make_bench

    bench = make_bench("gpt2", "sdpa", tolerances,
                       collator_factory=_collator(return_flash_attn_kwargs=False, return_position_ids=False))
    for check in (C.check_logits_parity, C.check_loss_parity, C.check_grad_parity):
        got = check(bench)
        assert _codes(got) == ["leak", "wrong_positions"], (check.__name__, got.causes)
        leak, positions = got.causes
        assert leak["evidence"]["isolation_moved"] > 1e-3
        assert positions["evidence"]["max_abs_diff_collated_positions"] > 1e-2
        assert "also wrong_positions" in got.message


def test_an_unmasked_boundary_label_beside_a_leak_is_two_causes(llama_sdpa):
    """Planted: labels equal to input_ids (boundaries unmasked) and sdpa ignoring the packed mask. loss_parity:
    loss_normalisation (29 label tokens for 28) and leak; grad_parity: leak and the label count. Before, the
    first cause won and the leak went unnamed."""
    bench = C.Workbench(model=llama_sdpa.model, config=llama_sdpa.config, backend="sdpa", dtype="float32",
                        tol=llama_sdpa.tol, collator_factory=collator_label_leak)
    with leaky_sdpa():
        loss, grad = C.check_loss_parity(bench), C.check_grad_parity(bench)
    assert _codes(loss) == ["loss_normalisation", "leak"], loss.causes
    assert loss.causes[0]["evidence"]["num_items_in_batch_packed"] > loss.causes[0]["evidence"]["num_items_expected"]
    assert _codes(grad) == ["leak", "loss_normalisation"], grad.causes
    assert grad.causes[1]["evidence"]["label_tokens_packed"] > grad.causes[1]["evidence"]["label_tokens_expected"]


def test_sft_boundary_labels_label_count_and_attention_are_separate_causes():
    """The SFT probes on a hand-made first batch (examples of 3 and 2 tokens): labels unmasked at the second
    example's start (boundary_labels), the trainer's num_items_in_batch counting it (4 for 3 label tokens:
    loss_normalisation), and the first-batch loss off through a leak: one cell, three causes in probe order,
    each with its numbers."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
             "labels": torch.tensor([[-100, 6, 7, 8, 9]]), "num_items_in_batch": torch.tensor(4)}
    metrics: dict = {}
    problems, starts = S._row_contract(None, batch, metrics)
    S._contract_probe(metrics, problems, starts)
    S._label_count_probe(batch, starts, metrics, "label_count", "")
    S._record(metrics, "first_batch_loss", "fail", "first-batch loss off by 2.1e-01", "leak", {"isolation_moved": 0.2})
    probes = metrics["probes"]
    assert probes["row_contract"]["status"] == "pass", probes  # the labels are their own probe now
    assert probes["boundary_labels"]["status"] == "fail" and probes["boundary_labels"]["numbers"]["unmasked_starts"] == [3]
    assert probes["label_count"]["numbers"] == {"num_items_in_batch": 4, "label_tokens_expected": 3}
    got = S._verdict(metrics, "planted", "planted")
    assert _codes(got) == ["boundary_labels", "loss_normalisation", "leak"], got.causes
    assert got.causes[2]["evidence"] == {"probe": "first_batch_loss", "isolation_moved": 0.2}
    fixed = {**batch, "labels": torch.tensor([[-100, 6, 7, -100, 9]]), "num_items_in_batch": torch.tensor(3)}
    metrics = {}
    problems, starts = S._row_contract(None, fixed, metrics)
    S._contract_probe(metrics, problems, starts)
    S._label_count_probe(fixed, starts, metrics, "label_count", "")
    assert S._verdict(metrics, "ok", "ok").status == "pass"


def test_the_remedy_covers_every_cause_and_old_files_read_as_one_cause():
    result = CheckResult("fail", {"batch_has_position_ids": False}, "x", causes=[
        {"cause": "leak", "evidence": {"isolation_moved": 0.1}},
        {"cause": "wrong_positions", "evidence": {"max_abs_diff_collated_positions": 0.5}}])
    assert result.cause == "leak" and result.evidence == {"isolation_moved": 0.1}
    cell = CellResult("gpt2-sdpa-logits_parity-float32", {"model_type": "gpt2"}, "sdpa", "logits_parity", "float32",
                      result.status, result.metrics, result.message, cause=result.cause, evidence=result.evidence,
                      causes=result.causes)
    doc = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [eval_json(cell)]}, faults=[])
    diagnosis = doc["cells"][0]["diagnosis"]
    assert [c["cause"] for c in diagnosis["causes"]] == ["leak", "wrong_positions"]
    assert "leak: " in diagnosis["remedy"] and "wrong_positions: also return position_ids" in diagnosis["remedy"]
    old = CellResult.from_dict({"cell_id": "a", "model": {}, "backend": "sdpa", "check": "isolation", "dtype": "float32",
                                "status": "fail", "cause": "leak", "evidence": {"isolation_moved": 0.1}})
    assert old.causes == [{"cause": "leak", "evidence": {"isolation_moved": 0.1}}]
    with pytest.raises(ValueError, match="unknown cause"):
        CheckResult("fail", {}, "x", causes=[{"cause": "no_such_cause", "evidence": {}}])


def eval_json(cell):
    import json

    return json.loads(cell.to_json())
