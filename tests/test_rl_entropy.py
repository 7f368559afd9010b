"""A path that gathers log-probs only (verl's remove-padding gather, trl 0.19's _get_per_token_logps, an OpenRLHF
release whose Actor.forward computes no entropy, AsyncGRPO's tree row) reports its entropy as not compared: None in
the metrics and "entropy not compared" in the message, never a 0.0 that reads as a measured match."""

from __future__ import annotations

import pytest
import torch
from conftest import make_bench

from pytest_packcheck.checks import rl


@pytest.fixture(scope="module")
def llama(tolerances):
    return make_bench("llama", "sdpa", tolerances)


def _rows(n: int = 3, shift: float = 0.0):
    torch.manual_seed(0)
    ref = [(torch.randn(4).double(), torch.rand(4).double()) for _ in range(n)]
    return ref, [(lp.clone(), h + shift) for lp, h in ref]


def test_compare_measures_entropy_where_the_path_has_it_and_says_none_where_not():
    ref, got = _rows()
    assert rl.compare(got, ref)["max_abs_entropy_diff"] == 0.0
    _, planted = _rows(shift=0.5)  # planted: every entropy off by 0.5 nats
    assert rl.compare(planted, ref)["max_abs_entropy_diff"] == pytest.approx(0.5)
    numbers = rl.compare([(lp, None) for lp, _ in got], ref)
    assert numbers["max_abs_entropy_diff"] is None and numbers["max_abs_logprob_diff"] == 0.0


def test_a_log_probs_only_verdict_says_entropy_not_compared_and_still_fails_on_log_probs(llama):
    ref, got = _rows()
    only = [(lp, None) for lp, _ in got]
    result = rl._verdict(llama, "a log-probs-only path", rl.compare(only, ref), {})
    assert result.status == "pass" and "entropy not compared" in result.message, result.message
    leaking = [(lp + 0.3, None) for lp, _ in got]  # planted: log-probs off by 0.3 nats
    result = rl._verdict(llama, "a log-probs-only path", rl.compare(leaking, ref), {})
    assert result.status == "fail" and "completion log-probs 3.00e-01 nats per token" in result.message, result.message
