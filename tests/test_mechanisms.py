"""Mechanisms a model has, exercised on the probe rows: attention sinks in the CPU reference flash kernel
(GPT-OSS's ``s_aux``), the shrink's mechanism settings, every decoder in --all-architectures."""

from __future__ import annotations

import pytest
import torch

from pytest_packcheck import backends as BK
from pytest_packcheck import checks as C


def _eager_with_sinks(q, k, v, sinks, scale):
    """modeling_gpt_oss.eager_attention_forward's sink math on one causal segment: q (H, L, D), sinks (H,)."""
    scores = q @ k.transpose(-1, -2) * scale
    n = q.shape[1]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    combined = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def test_reference_kernel_sinks_equal_gpt_oss_eager_math():
    torch.manual_seed(0)
    lengths, heads, dim = [5, 9, 3], 4, 8
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim) for _ in range(3))
    sinks = torch.randn(heads) * 2
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    out = BK.varlen_reference_kernel(q, k, v, cu, cu, 9, 9, causal=True, s_aux=sinks)
    plain = BK.varlen_reference_kernel(q, k, v, cu, cu, 9, 9, causal=True)
    worst = 0.0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = _eager_with_sinks(*(x[s:e].transpose(0, 1) for x in (q, k, v)), sinks, dim ** -0.5).transpose(0, 1)
        worst = max(worst, float((out[s:e] - ref).abs().max()))
    assert worst < 1e-6, worst
    assert float((out - plain).abs().max()) > 1e-2  # the sinks act: a kernel that ignored them differs
    dense = BK.dense_reference_kernel(q[None, :5], k[None, :5], v[None, :5], causal=True, s_aux=sinks)
    assert float((dense[0] - out[:5]).abs().max()) < 1e-6


@pytest.fixture(scope="module")
def gpt_oss_flash(tolerances):
    from conftest import make_bench

    bench = make_bench("gpt_oss", BK.REFERENCE_BACKEND, tolerances)
    with torch.no_grad():  # sinks large enough to matter (random init gives them std 0.02)
        for layer in bench.model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    return bench


def test_gpt_oss_gets_a_flash_verdict_on_cpu(gpt_oss_flash):
    """Built on packcheck_flash_ref (not swapped for a Hub kernel), sinks reaching the reference kernel: per-example
    logits equal eager's, and the packed row equals the examples alone."""
    assert gpt_oss_flash.model.config._attn_implementation == BK.REFERENCE_BACKEND
    cross = C.check_cross_backend(gpt_oss_flash)
    assert cross.status == "pass" and cross.metrics["max_abs_diff_vs_eager"] < 1e-5, cross.message
    parity = C.check_logits_parity(gpt_oss_flash)
    assert parity.status == "pass", parity.message


def test_a_kernel_that_drops_the_sinks_is_caught(gpt_oss_flash, monkeypatch):
    """Planted fault: the reference kernel ignores s_aux (what transformers does silently when a kernel's signature
    has no s_aux): cross_backend sees the flash path compute another attention than eager."""
    real = BK.varlen_reference_kernel

    def sinkless(*args, s_aux=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(BK, "varlen_reference_kernel", sinkless)
    import functools

    import transformers.modeling_flash_attention_utils as mfu

    dropped = functools.partial(sinkless)
    loader = mfu._lazy_imports
    monkeypatch.setattr(mfu, "_lazy_imports", lambda impl, *a, **k: (
        (lambda q, kk, vv, *x, s_aux=None, **kw: BK._dense_as_varlen(dropped, q, kk, vv, *x)), dropped,
        *loader(impl, *a, **k)[2:]) if impl == BK.REFERENCE_BACKEND else loader(impl, *a, **k))
    for attr in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_process_flash_kwargs_fn"):
        if hasattr(mfu, attr):
            monkeypatch.setattr(mfu, attr, None)
    gpt_oss_flash._cache.clear()
    cross = C.check_cross_backend(gpt_oss_flash)
    gpt_oss_flash._cache.clear()
    assert cross.status == "fail" and cross.cause == "cross_backend", cross.message
    assert cross.metrics["max_abs_diff_vs_eager"] > 1e-2


def test_decoders_registered_only_in_multimodal_mappings_join_all_architectures():
    """mistral4's Mistral4ForCausalLM sits only under image-text-to-text / multimodal-lm in transformers 5.24: it is
    a causal LM all the same, resolved with the auto class whose mapping holds it."""
    from pytest_packcheck.models import causal_lm_architectures, multimodal_only_causal_lm, resolve_model
    from pytest_packcheck.specs import parse_model_spec

    assert multimodal_only_causal_lm("llama") is None  # in the causal-LM mapping: not a multimodal-only one
    assert multimodal_only_causal_lm("qwen2_vl") is None  # no *ForCausalLM class: run on its text path instead
    found = multimodal_only_causal_lm("mistral4")
    assert found is not None and found[0] == "Mistral4ForCausalLM"
    assert "mistral4" in causal_lm_architectures() and "qwen2_vl" not in causal_lm_architectures()
    resolved = resolve_model(parse_model_spec("arch:mistral4", "test"), "test")
    assert (resolved.model_class, resolved.auto_class, resolved.text_path) == ("Mistral4ForCausalLM", found[1], None)
