"""Liger's fused linear cross-entropy and num_items_in_batch (issue 45, the liger element). liger-kernel 0.8.5 has no
torch path: ``liger_kernel/ops/fused_linear_cross_entropy.py`` imports triton at line 2, so on CPU the liger cells
are a skip naming triton (tests/test_stack.py). Its contract with the Trainer is in
``liger_kernel/transformers/model/loss_utils.py``: ``reduction = "sum" if num_items_in_batch is not None else "mean"``
(line 42), then ``loss / num_items_in_batch`` (line 59). A pure-torch stand-in of that contract (the forward computes
the loss from the hidden states and the LM head weight in chunks, as liger's ``lce_forward`` does) stands in for the
kernel here: honouring num_items_in_batch it passes loss_parity, with completion masks too; the planted fault, a
fused loss that ignores num_items_in_batch (always a mean), is caught by loss_parity's gradient-accumulation part
(finding ``num_items_ignored``, 2.00x the reference over two micro-batches: packed and padded alike, so the loss's
fault, not packing's) and by the completion-masked micro-batches against each example alone."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import make_bench

from pytest_packcheck.checks.registry import SPECS
from pytest_packcheck.model import stack as S


def fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=None, chunk=5, honour_num_items=True):
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` shifted by one, computed ``chunk`` tokens at a time
    (no full logits), -100 ignored; sum / num_items_in_batch when it is given (liger's contract), else the mean."""
    h, y = hidden[:, :-1].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)
    total = hidden.new_zeros(())
    for s in range(0, h.shape[0], chunk):
        total = total + torch.nn.functional.cross_entropy(h[s:s + chunk] @ weight.T, y[s:s + chunk], ignore_index=-100,
                                                          reduction="sum")
    if num_items_in_batch is not None and honour_num_items:
        return total / num_items_in_batch
    return total / (y != -100).sum().clamp_min(1)


def patch_fused_forward(model, honour_num_items=True):
    """``model.forward`` replaced by a liger-style fused forward (the decoder, then the stand-in loss from the hidden
    states); logits are still returned for the checks that read them. Takes ``**kwargs`` as liger's lce_forward does,
    so Trainer (and loss_parity) hand it num_items_in_batch."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None, **kwargs):
        num_items = kwargs.pop("num_items_in_batch", None)
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        loss = None
        if labels is not None:
            loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, num_items, honour_num_items=honour_num_items)
        return CausalLMOutputWithPast(loss=loss, logits=model.lm_head(hidden))

    forward.__signature__ = inspect.signature(forward)
    model.forward = forward
    return model


def test_liger_has_no_torch_path_here_and_its_cells_name_triton():
    why = S.availability(S.BY_NAME["liger"])
    if why is None:
        pytest.skip("liger-kernel and triton are installed here: the liger element runs for real")
    assert "liger-kernel" in why and "triton" in why


@pytest.mark.parametrize("honour", [True, False])
def test_a_fused_loss_that_ignores_num_items_in_batch_is_caught_by_loss_parity(tolerances, honour):
    wb = make_bench("llama", "sdpa", tolerances)
    patch_fused_forward(wb.model, honour_num_items=honour)
    result = SPECS["loss_parity"].load()(wb)
    assert result.metrics["loss_delta"] <= tolerances["float32"]["loss_atol"]  # the token mean is right either way
    if honour:
        assert result.status == "pass" and not result.findings, result.message
        assert result.metrics["ga_delta"] <= tolerances["float32"]["loss_atol"]
    else:  # packing is not at fault (padded is 2x off too): a pass carrying the loss's own finding, with its ratio
        assert result.status == "pass" and [f["cause"] for f in result.findings] == ["num_items_ignored"], result.message
        assert abs(result.findings[0]["evidence"]["ga_ratio"] - 2.0) < 1e-3 and "num_items_in_batch" in result.message


@pytest.mark.parametrize("honour", [True, False])
def test_completion_masked_labels_through_the_fused_loss_over_two_micro_batches(tolerances, honour):
    """Completion masks (the first 3 tokens of every example are prompt: -100), gradient accumulation over two packed
    micro-batches with num_items_in_batch counted over both: the fused loss vs each example alone."""
    wb = make_bench("llama", "sdpa", tolerances)
    patch_fused_forward(wb.model, honour_num_items=honour)
    micro = [wb.examples[:2], wb.examples[2:]]
    batches = []
    for examples in micro:
        batch = wb.packed(examples)
        start = 0
        for e in examples:
            batch["labels"][0, start:start + 3] = -100
            start += len(e)
        batches.append(batch)
    n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    fused = sum(float(wb.forward(b, labels=b["labels"], num_items_in_batch=torch.tensor(n_items)).loss) for b in batches)
    total = 0.0
    for examples in micro:
        for e in examples:
            logits = wb.solo(e)[:-1]
            target = torch.tensor(e[1:])
            target[:2] = -100  # tokens 1 and 2 are prompt: their labels are -100 after the shift
            total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
    delta = abs(fused - total / n_items)
    if honour:
        assert delta <= tolerances["float32"]["loss_atol"], delta
    else:
        assert delta > 1e-2, delta
