"""The varlen reference kernel is the ground truth of every flash-path verdict: each of its features (causal
masking, sliding window, softcapping, GQA, the argument contract) agrees with an independent computation, and a
planted fault in each is caught. The contract is what flash-attn 2.8.3 and flash-attn-4 4.0.0b36 require
(backends.VARLEN_CONTRACT cites the lines); the backend check reports it item by item."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pytest_packcheck import backends as BK
from pytest_packcheck import checks as C

LENGTHS = [5, 1, 7]


def _inputs(heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, heads, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
    return q, k, v, cu


def _independent(q, k, v, causal=False, window=(-1, -1), softcap=0.0):
    """Each segment on its own, written out: GQA query head h reads kv head h // (heads / kv_heads), a key j is
    visible to query i when (causal) j <= i and (window) i - left <= j <= i + right, scores softcapped."""
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    start = 0
    for n in LENGTHS:
        for h in range(q.shape[1]):
            qs, ks, vs = q[start:start + n, h], k[start:start + n, h // rep], v[start:start + n, h // rep]
            scores = qs @ ks.T / math.sqrt(q.shape[-1])
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            allowed = torch.ones(n, n, dtype=torch.bool)
            if causal:
                allowed &= j <= i
            if window[0] >= 0:
                allowed &= j >= i - window[0]
            if window[1] >= 0:
                allowed &= j <= i + window[1]
            out[start:start + n, h] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vs
        start += n
    return out


FEATURES = {
    "causal": {"causal": True},
    "sliding_window": {"causal": True, "window": (2, 0)},
    "softcap": {"softcap": 0.5},
    "gqa": {},
}


def _run(kernel, feature):
    q, k, v, cu = _inputs()
    opts = FEATURES[feature]
    got = kernel(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=opts.get("causal", False),
                 window_size=opts.get("window", (-1, -1)), softcap=opts.get("softcap", 0.0))
    want = _independent(q, k, v, opts.get("causal", False), opts.get("window", (-1, -1)), opts.get("softcap", 0.0))
    return float((got - want).abs().max())


# planted faults, one per feature: the kernel as it would be with that feature broken
def _no_causal(q, k, v, *a, causal=False, **kw):
    return BK.varlen_reference_kernel(q, k, v, *a, causal=False, **kw)


def _no_window(q, k, v, *a, window_size=(-1, -1), **kw):
    return BK.varlen_reference_kernel(q, k, v, *a, window_size=(-1, -1), **kw)


def _no_softcap(q, k, v, *a, softcap=0.0, **kw):
    return BK.varlen_reference_kernel(q, k, v, *a, softcap=0.0, **kw)


def _gqa_tiled(q, k, v, *a, **kw):
    """Query head h reads kv head h % kv_heads (repeat, not repeat_interleave)."""
    rep = q.shape[1] // k.shape[1]
    return BK.varlen_reference_kernel(q, k.repeat(1, rep, 1), v.repeat(1, rep, 1), *a, **kw)


PLANTED = {"causal": _no_causal, "sliding_window": _no_window, "softcap": _no_softcap, "gqa": _gqa_tiled}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_reference_kernel_feature_is_exact_and_its_planted_fault_is_caught(feature):
    assert _run(BK.varlen_reference_kernel, feature) < 1e-5
    assert _run(PLANTED[feature], feature) > 1e-2, f"planted fault in {feature} not caught"


def _kernel_call(**override):
    q, k, v, cu = _inputs()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 7, "max_seqlen_k": 7}
    args.update(override)
    return args


@pytest.mark.parametrize(("override", "item", "received"), [
    ({"cu_seqlens_q": torch.tensor([0, 5, 6, 13]), "cu_seqlens_k": torch.tensor([0, 5, 6, 13])}, "cu_seqlens_dtype", "int64 / int64"),
    ({"cu_seqlens_q": torch.tensor([[0, 5, 6, 13]], dtype=torch.int32)}, "cu_seqlens_shape", "(1, 4) / (4,)"),
    ({"max_seqlen_q": 5}, "max_seqlen_bound", "max_seqlen_q 5 (longest q segment 7)"),
    ({"max_seqlen_k": 6}, "max_seqlen_bound", "max_seqlen_k 6 (longest k segment 7)"),
])
def test_the_reference_kernel_refuses_what_the_real_kernels_refuse_or_misread(override, item, received):
    """Planted: each broken item, one at a time; the kernel names the item and what it received."""
    with pytest.raises(BK.KernelArgumentError) as err:
        BK.varlen_reference_kernel(**_kernel_call(**override))
    assert err.value.item == item and received in err.value.received, str(err.value)
    assert "flash_api.cpp" in str(err.value) or "interface.py" in str(err.value)


def test_cu_seqlens_that_do_not_fit_the_row_are_refused():
    for bad in ([0, 5, 6, 12], [0, 6, 5, 13], [1, 5, 6, 13]):
        cu = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(BK.FlashBoundariesError):
            BK.varlen_reference_kernel(**_kernel_call(cu_seqlens_q=cu, cu_seqlens_k=cu))


def test_a_zero_length_segment_with_one_query_under_gqa_is_refused():
    """flash-attn 2.8.3 mha_varlen_fwd: max_seqlen_q == 1 with GQA and no window takes the swapped path, which
    reshapes q as (batch_size, ...) and ignores cu_seqlens_q: a zero-length segment breaks it. Without GQA, or
    with a window, the kernel reads cu_seqlens_q and the same segments are fine."""
    q, k, v = torch.randn(2, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu_q = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(BK.KernelArgumentError) as err:
        BK.varlen_reference_kernel(q, k, v, cu_q, cu_k, 1, 1)
    assert err.value.item == "zero_length_single_query" and "1 zero-length q segments" in err.value.received
    assert BK.varlen_reference_kernel(q, k, v, cu_q, cu_k, 1, 1, window_size=(4, 0)).shape == q.shape
    k1, v1 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    assert BK.varlen_reference_kernel(q, k1, v1, cu_q, cu_k, 1, 1).shape == q.shape


def test_a_tensor_max_seqlen_is_recorded_not_refused():
    """transformers 5.24's prepare_fa_kwargs_from_position_ids gives max_length_q = cu_seq_lens_q.diff().max(), a
    0-d tensor, which FA2's custom op converts and FA4 does not take: the kernel runs, the contract says so."""
    call = _kernel_call(max_seqlen_q=torch.tensor(7, dtype=torch.int32), max_seqlen_k=torch.tensor(7, dtype=torch.int32))
    contract = BK.varlen_argument_contract(**call)
    assert contract["max_seqlen_type"]["ok"] is False and contract["max_seqlen_type"]["kind"] == "fa4"
    assert "Tensor int32 0-d 7" in contract["max_seqlen_type"]["received"]
    assert all(v["ok"] for n, v in contract.items() if n != "max_seqlen_type")
    assert BK.varlen_reference_kernel(**call).shape == call["q"].shape
    assert BK.varlen_argument_contract(**_kernel_call())["max_seqlen_type"]["ok"] is True


def test_the_torch_varlen_path_checks_the_same_contract():
    q, k, v, cu = _inputs()
    with pytest.raises(BK.KernelArgumentError, match="max_seqlen_bound"):
        BK.build_torch_varlen_args(q, k, v, cu, cu, 3, 7, None, True, (-1, -1), {"enable_gqa"})
    args, _ = BK.build_torch_varlen_args(q, k, v, cu, cu, torch.tensor(7), torch.tensor(7), None, True, (-1, -1), {"enable_gqa"})
    assert args[5:] == (7, 7) and type(args[5]) is int


@pytest.fixture(scope="module")
def flash_ref(tolerances):
    from conftest import make_bench

    return make_bench("llama", BK.REFERENCE_BACKEND, tolerances)


def test_the_backend_check_reports_the_contract_item_by_item(flash_ref):
    """On transformers 5.24 (installed): five items hold, max_seqlen_type does not (a 0-d int32 tensor): a pass
    with a kernel_arguments finding that names what was received."""
    got = C.check_backend(flash_ref)
    items = got.metrics["kernel_arguments"]
    assert set(items) == set(BK.VARLEN_CONTRACT)
    assert items["cu_seqlens_dtype"]["status"] == "pass" and items["cu_seqlens_dtype"]["received"] == "int32 / int32"
    assert items["cu_seqlens_values"]["received"].startswith("q [0, 11, 18, 31] for 31 tokens")
    assert got.status == "pass", got.message
    fa4 = [f for f in got.findings if f["cause"] == "kernel_arguments"]
    if items["max_seqlen_type"]["status"] == "fail":
        assert fa4 and "FlashAttention-4 requires Python int" in fa4[0]["evidence"]
    else:
        assert not fa4


def test_a_real_kernel_handed_broken_arguments_fails_the_backend_check(flash_ref, monkeypatch):
    """Planted: the varlen calls the model makes are recorded with int64 cu_seqlens, by a kernel that checks
    nothing itself (as a CUDA kernel reached on a GPU, where packcheck only records). The backend check fails with cause kernel_arguments and
    the received dtype; the runner turns the kernel's own refusal into the same verdict."""
    real = BK.varlen_argument_contract

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        out["cu_seqlens_dtype"] = {"ok": False, "received": "int64 / int64", "kind": "refused"}
        return out

    monkeypatch.setattr(BK.counting, "varlen_argument_contract", planted)  # what the call counter records
    monkeypatch.setattr(BK.kernels, "enforce_varlen_contract", lambda *a, **k: None)  # a real kernel: no check in Python
    got = C.check_backend(flash_ref)
    assert got.status == "fail" and got.cause == "kernel_arguments", got.message
    assert got.evidence["cu_seqlens_dtype"]["received"] == "int64 / int64" and "int64 / int64" in got.message
    from pytest_packcheck.run.runner import CellRunner

    runner = CellRunner([], {"float32": {}})
    runner._key = (0, BK.REFERENCE_BACKEND, "float32")
    verdict = runner._failed("check", BK.KernelArgumentError("max_seqlen_bound", "max_seqlen_q 5 (longest q segment 7)"))
    assert verdict.status == "fail" and verdict.cause == "kernel_arguments" and verdict.evidence["item"] == "max_seqlen_bound"


def test_the_fa4_only_finding_on_a_passing_cell_does_not_say_do_not_run():
    """Trial W2: a passing varlen-reference cell ("safe") whose only kernel_arguments item is FA4's (a 0-d tensor
    max_seqlen) got the cause's failing-cell remedy in "What to do": "do not run this model on that flash kernel".
    The finding beside a pass gets FA4's own advice; a failing backend cell keeps "do not run"."""
    from pytest_packcheck.analysis.diagnose import remedy

    evidence = "max_seqlen_type: 0-d int32 tensor in 2 of 2 varlen calls; FlashAttention-2 takes it, FlashAttention-4 requires Python int"
    passing = {"backend": BK.REFERENCE_BACKEND, "check": "backend", "status": "pass", "metrics": {},
               "findings": [{"cause": "kernel_arguments", "evidence": evidence}]}
    failing = {**passing, "status": "fail", "causes": [{"cause": "kernel_arguments", "evidence": {"item": "cu_seqlens_dtype"}}]}
    fa4 = remedy("kernel_arguments", passing, {})
    assert fa4.startswith("nothing to change on FlashAttention-2") and "do not run" not in fa4
    assert remedy("kernel_arguments", failing, {}).startswith("do not run this model on that flash kernel")
