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

    monkeypatch.setattr(BK.kernels, "varlen_reference_kernel", sinkless)
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
    from pytest_packcheck.model.architectures import causal_lm_architectures, multimodal_only_causal_lm
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    assert multimodal_only_causal_lm("llama") is None  # in the causal-LM mapping: not a multimodal-only one
    assert multimodal_only_causal_lm("qwen2_vl") is None  # no *ForCausalLM class: run on its text path instead
    found = multimodal_only_causal_lm("mistral4")
    assert found is not None and found[0] == "Mistral4ForCausalLM"
    assert "mistral4" in causal_lm_architectures() and "qwen2_vl" not in causal_lm_architectures()
    resolved = resolve_model(parse_model_spec("arch:mistral4", "test"), "test")
    assert (resolved.model_class, resolved.auto_class, resolved.text_path) == ("Mistral4ForCausalLM", found[1], None)


# ------------------------------------------------------------------------------------------------------------
# top-k selection: shrunk into the row, ties at the cut are their own cause, a whole-row top-k is a leak


def test_shrink_brings_selection_and_windows_into_the_row_and_says_so():
    from transformers import CONFIG_MAPPING

    from pytest_packcheck.model.batches import DEFAULT_LENGTHS
    from pytest_packcheck.model.shrink import mechanism_gaps, shrink_config
    from pytest_packcheck.model.tiny import TINY_INDEX_TOPK

    for model_type, key in (("axk2", "index_topk"), ("deepseek_v32", "index_topk"), ("llama4_text", "attention_chunk_size"),
                            ("mistral", "sliding_window")):
        original = CONFIG_MAPPING[model_type]()
        assert any(key in gap for gap in mechanism_gaps(original, DEFAULT_LENGTHS)), model_type  # unshrunk: too long
        notes: list[str] = []
        shrunk = shrink_config(original, notes=notes)
        bound = min(DEFAULT_LENGTHS) if key == "index_topk" else max(DEFAULT_LENGTHS)  # selects among / cuts an example
        assert getattr(shrunk, key) < bound, (model_type, getattr(shrunk, key))
        assert any(n.startswith(f"mechanism: {key} ") for n in notes), notes
        assert mechanism_gaps(shrunk, DEFAULT_LENGTHS) == [], model_type
    assert shrink_config(CONFIG_MAPPING["axk2"]()).index_topk == TINY_INDEX_TOPK
    notes = []
    shrink_config(CONFIG_MAPPING["qwen3_moe"](), notes=notes)
    assert any("MoE 4 experts, 2 per token" in n for n in notes)
    # routing with every expert chosen never chooses: named
    assert any("MoE routing" in g for g in mechanism_gaps(CONFIG_MAPPING["qwen3_moe"](num_experts=2, num_experts_per_tok=2), DEFAULT_LENGTHS))


def test_a_mechanism_longer_than_the_row_is_named_in_the_cell(tolerances, monkeypatch):
    from conftest import make_bench

    bench = make_bench("llama", "sdpa", tolerances)
    assert not [f for f in C.check_logits_parity(bench).findings if f["cause"] == "mechanism_not_exercised"]
    monkeypatch.setattr(bench.config, "index_topk", 2048, raising=False)
    result = C.check_logits_parity(bench)
    gaps = [f["evidence"] for f in result.findings if f["cause"] == "mechanism_not_exercised"]
    assert result.status == "pass" and gaps and "index_topk 2048" in gaps[0] and "not exercised" in gaps[0]
    # the short label a matrix cell's ✅ carries (report.verdicts.pass_qualifier)
    labels = [f["mechanism"] for f in result.findings if f["cause"] == "mechanism_not_exercised"]
    assert labels[0].startswith("top-k selection 2048 >= shortest example "), labels


@pytest.fixture(scope="module")
def axk2(tolerances):
    from conftest import make_bench

    return make_bench("axk2", "eager", tolerances)


def test_ties_at_the_topk_cut_are_their_own_cause(axk2):
    """axk2 shrunk to index_topk=4, 2 indexer heads (ReLU'd scores: exact zeros tie at the cut): the packed row
    differs from the examples alone (4.5e-3 on 5.24) with isolation exact; the cause is selection_ties."""
    from pytest_packcheck.checks.mechanisms import selection_ties

    axk2._cache.clear()
    assert C.check_isolation(axk2).status == "pass"
    parity = C.check_logits_parity(axk2)
    assert parity.status == "fail" and parity.cause == "selection_ties", parity.message
    ties = selection_ties(axk2)
    assert ties["tied_cuts"] > 0 and any(k == 4 for k, _ in ties["tied_at"]), ties


def test_without_ties_the_same_difference_is_not_called_a_tie(axk2, monkeypatch):
    """Planted: the tie probe sees no tie: the same difference falls back to wrong_positions (the ties branch
    decides the cause, nothing else)."""
    import pytest_packcheck.checks.mechanisms as M

    axk2._cache.clear()
    monkeypatch.setattr(M, "selection_ties", lambda bench: {"topk_calls": 4, "tied_cuts": 0, "tied_at": []})
    assert C.check_logits_parity(axk2).cause == "wrong_positions"


def test_a_topk_computed_over_the_whole_row_is_a_leak(axk2, monkeypatch):
    """Planted: the indexer scores every earlier key of the row (a causal mask without the packed boundaries), so it
    selects keys of other examples: isolation moves, the cause is leak, not selection_ties."""
    import sys

    indexer = type(axk2.model.model.layers[0].self_attn.indexer)
    real = indexer.forward

    def whole_row(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs):
        n = hidden_states.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = causal.expand_as(attention_mask)
        elif attention_mask is not None:
            attention_mask = torch.zeros(n, n).masked_fill(~causal, float("-inf")).expand_as(attention_mask)
        return real(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs)

    assert "transformers.models.axk2" in sys.modules[indexer.__module__].__name__
    monkeypatch.setattr(indexer, "forward", whole_row)
    axk2._cache.clear()
    isolation = C.check_isolation(axk2)
    axk2._cache.clear()
    assert isolation.status == "fail" and isolation.cause == "leak", isolation.message


def test_derived_layer_kinds_reads_no_deprecated_property(monkeypatch):
    """Trial U10: the shrink read every property of the config to find derived layer kinds, so transformers 5.x
    logged "`torch_dtype` is deprecated! Use `dtype` instead!" (and use_return_dict's) on `packcheck bench`. The base
    class's properties are not read; jamba's derived ``layers_block_type`` is still found."""
    import transformers.configuration_utils as cu
    from transformers import JambaConfig, LlamaConfig

    from pytest_packcheck.model.shrink import derived_layer_kinds

    said = []
    monkeypatch.setattr(cu.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    assert derived_layer_kinds(LlamaConfig()) == {}
    assert derived_layer_kinds(JambaConfig())["layers_block_type"] == {"attention", "mamba"}
    assert not [m for m in said if "deprecated" in m], said
