"""Multimodal models on their text path: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE position_ids, transformers 5.24).

They have no causal-LM class; packcheck builds their ForConditionalGeneration from a shrunk config (tiny vision
tower) and feeds text-only packed rows with position_ids (4, 1, N): a text row, then the three M-RoPE rows
(temporal, height, width) of the model's own get_rope_index, all restarting per example. Planted faults lay the
rows out wrong and must fail with the right cause.
"""

from __future__ import annotations

import pytest
from faults import DropPositionIds, FrozenSection, SectionNoRestart, TextRowNoRestart

from pytest_packcheck.results.schema import read_results


def _bench(spec: str, backend: str, tolerances: dict, **kwargs):
    from pytest_packcheck.backends import REFERENCE_BACKEND, register_reference_backend
    from pytest_packcheck.checks.workbench import Workbench
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import position_layout
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import text_config

    if backend == REFERENCE_BACKEND:
        register_reference_backend()
    resolved = resolve_model(parse_model_spec(spec, "test"), "test")
    model = build_model(resolved, backend, "float32")
    kwargs.setdefault("layout", position_layout(model, resolved))
    return Workbench(model=model, config=text_config(model.config), backend=backend, dtype="float32",
                     tol=tolerances["float32"], **kwargs)


@pytest.fixture(scope="module")
def tol() -> dict:
    from pathlib import Path

    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[1] / "audit" / "tolerances.toml").read_text())


@pytest.fixture(scope="module")
def qwen2_vl_sdpa(tol):
    return _bench("arch:qwen2_vl", "sdpa", tol)


def test_resolve_runs_mrope_models_on_their_text_path():
    """arch:qwen2_vl resolves to its ForConditionalGeneration (no causal-LM class) with its built-in mrope_section
    made explicit; a multimodal model without M-RoPE is still refused with the reason."""
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.architectures import mrope_text_path_architectures
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    resolved = resolve_model(parse_model_spec("arch:qwen2_vl", "test"), "test")
    assert (resolved.model_class, resolved.auto_class, resolved.text_path) == (
        "Qwen2VLForConditionalGeneration", "AutoModelForImageTextToText", "mrope")
    assert resolved.config.get_text_config().rope_parameters["mrope_section"] == [16, 24, 24]
    record = resolved.record()
    assert "text path" in record["text_path"] and any("mrope_section=[16, 24, 24]" in n for n in record["config_notes"])
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"} <= set(mrope_text_path_architectures())
    with pytest.raises(PackcheckUsageError, match="'llava' model with no causal-LM head.*not a multimodal model with M-RoPE"):
        resolve_model(parse_model_spec("arch:llava", "test"), "test")


def test_shrink_makes_the_tower_tiny_and_scales_mrope_section():
    """The shrunk config keeps mrope_section's proportions at the tiny head (sum = head_dim / 2 = 8), makes the
    vision tower 2 blocks of 2 heads and points its output at the text width; the model has under 1M parameters."""
    import torch

    from pytest_packcheck.model.resolve import auto_model_class, resolve_model
    from pytest_packcheck.model.shrink import shrink_config
    from pytest_packcheck.model.specs import parse_model_spec

    for model_type, section in (("qwen2_vl", [2, 3, 3]), ("qwen3_vl", [3, 3, 2])):
        resolved = resolve_model(parse_model_spec(f"arch:{model_type}", "test"), "test")
        config = shrink_config(resolved.config)
        text, vision = config.text_config, config.vision_config
        assert text.rope_parameters["mrope_section"] == section, model_type
        assert vision.depth == 2 and vision.num_heads == 2
        width = getattr(vision, "out_hidden_size", None) or vision.hidden_size
        assert width == text.hidden_size
        if model_type == "qwen2_vl":  # embed_dim is the tower's width, hidden_size its merger's output
            assert vision.embed_dim == 32
        if model_type == "qwen3_vl":
            assert vision.deepstack_visual_indexes == [1]
        with torch.device("meta"):
            model = auto_model_class(resolved).from_config(config)
        assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_default_config_that_cannot_run_is_the_librarys(tol, monkeypatch):
    """GLM-4V's default config gives mrope_section [8, 12, 12] (32 frequencies) to 64-frequency heads: it fails at
    full size too, so the cell is library_config with the override that fixes it, and that override runs. (The
    atlas builds glm4v from the config-fix table's values; without that entry the default's own error is the answer.)"""
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.build_errors import LibraryConfigError
    from pytest_packcheck.model.config_fixes import CONFIG_FIXES

    monkeypatch.delitem(CONFIG_FIXES, "glm4v")
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    resolved = resolve_model(parse_model_spec("arch:glm4v", "test"), "test")
    with pytest.raises(LibraryConfigError, match=r"mrope_section \[8, 12, 12\] sums to 32 .* heads have 64 .*"
                       r"'arch:glm4v\{text_config.rope_parameters.partial_rotary_factor=0.5\}'"):
        build_model(resolved, "sdpa", "float32")
    bench = _bench("arch:glm4v{text_config.rope_parameters.partial_rotary_factor=0.5}", "sdpa", tol)
    from pytest_packcheck.checks.parity import check_isolation

    assert check_isolation(bench).status == "pass"


def test_layout_is_read_from_the_model(qwen2_vl_sdpa):
    """Qwen2-VL on 5.24: a text row + get_rope_index's 3 rows, the same layout its generate() prepares; every
    forward gets (4, 1, N) ids equal to the collator's restarting row."""
    import torch

    layout = qwen2_vl_sdpa.layout
    assert layout.rows == 4 and "get_rope_index" in layout.source and "lays out the same" in layout.source
    row = qwen2_vl_sdpa.packed()["position_ids"]
    laid = layout.apply(row)
    assert laid.shape == (4, 1, row.shape[-1]) and all(torch.equal(laid[i], row) for i in range(4))
    assert layout.describe()["position_ids"].startswith("(4, batch, length)")


def test_layout_error_names_the_method():
    """A model whose generate() and get_rope_index give no usable text-only ids: a one-line TextPathError."""
    import torch

    from pytest_packcheck.model.build_errors import ShrinkError, TextPathError
    from pytest_packcheck.model.multimodal import position_layout
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def _prepare_position_ids_for_generation(self, ids, kwargs):
            return torch.zeros(2, 1, ids.shape[-1], dtype=torch.long)

    resolved = resolve_model(parse_model_spec("arch:qwen2_vl", "test"), "test")
    with pytest.raises(TextPathError, match=r"qwen2_vl: neither Odd.get_rope_index nor its generate\(\) .*\(rows, 1, 5\)") as err:
        position_layout(Odd(), resolved)
    assert isinstance(err.value, ShrinkError) and "\n" not in str(err.value)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "packcheck_flash_ref"])
def test_qwen2_vl_text_path_passes_every_check(backend, tol):
    """Every correctness check holds on Qwen2-VL's text path with its M-RoPE layout; the collator's own
    (batch, length) ids, as the Trainer passes them on, leak (no text row): logits_parity fails on them, cause
    position_layout, with both numbers."""
    from pytest_packcheck.checks.registry import SPECS

    bench = _bench("arch:qwen2_vl", backend, tol)
    for name in ("position_ids", "isolation", "loss_parity", "grad_parity", "backend",
                 "cross_backend", "causality", "edge_lengths"):
        result = SPECS[name].load()(bench)
        expected = "skipped" if (name, backend) == ("cross_backend", "eager") else "pass"
        assert result.status == expected, (name, result.message)
    parity = SPECS["logits_parity"].load()(bench)
    assert parity.status == "fail" and parity.cause == "position_layout", parity.message
    assert parity.metrics["max_abs_diff_collator_position_ids"] > 0.1 and parity.metrics["max_abs_diff_solo"] < 1e-5
    assert parity.evidence["rows"] == 4 and parity.evidence["max_abs_diff_laid_out"] < 1e-5
    # the number every output shows is the one the fail rests on, not the laid-out row's that holds (trial 4,
    # 172 / 176: "fail [position_layout] (logits_parity 3.6e-07)" in lookup, Δ 4.2e-07 in the Markdown / CSV / HTML)
    from pytest_packcheck.analysis.bisect import probe_number
    from pytest_packcheck.atlas.collect import reduce_release
    from pytest_packcheck.report.numbers import key_number

    collator = parity.metrics["max_abs_diff_collator_position_ids"]
    cell = {"check": "logits_parity", "status": "fail", "metrics": parity.metrics, "backend": backend, "dtype": "float32",
            "model": {"model_type": "qwen2_vl", "label": "qwen2_vl"}, "cause": parity.cause, "message": parity.message,
            "role": "correctness", "cell_id": f"qwen2_vl-{backend}-logits_parity-float32"}
    assert key_number(cell) == f"Δ {collator:.1e}" and probe_number(cell).startswith("max_abs_diff_collator_position_ids")
    assert reduce_release({"cells": [cell]})["qwen2_vl"][backend]["number"] == float(f"{collator:.3g}")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_other_mrope_models_keep_examples_apart(model_type, tol):
    """Qwen2.5-VL as Qwen2-VL; Qwen3-VL's text model expands (batch, length) ids into 4 rows with the text row
    itself (5.24), so the collator's ids hold there and logits_parity passes."""
    from pytest_packcheck.checks.parity import check_isolation, check_logits_parity

    bench = _bench(f"arch:{model_type}", "sdpa", tol)
    assert bench.layout.rows == 4 and check_isolation(bench).status == "pass"
    parity = check_logits_parity(bench)
    assert parity.metrics["max_abs_diff_solo"] < 1e-5
    collator_leaks = parity.metrics["max_abs_diff_collator_position_ids"] > bench.tol["logits_atol"]
    assert collator_leaks is (model_type == "qwen2_5_vl")
    assert (parity.status, parity.cause) == (("fail", "position_layout") if collator_leaks else ("pass", None))


@pytest.mark.parametrize(("spec", "layout"), [("arch:qwen2_vl", "collator"), ("arch:qwen2_vl", "rope_index"),
                                              ("arch:qwen3_vl", "rope_index"), ("arch:qwen2_vl", "text_row")])
@pytest.mark.parametrize("backend", ["sdpa", "packcheck_flash_ref"])
def test_planted_layout_without_boundaries_leaks(spec, layout, backend, tol):
    """Ids that carry no boundaries in the text row: the collator's (batch, length) ids on Qwen2-VL (expanded to
    3 rows), get_rope_index's 3 rows without the text row, a text row that does not restart. Isolation and parity
    fail with cause leak, on the masked and on the flash path."""
    from pytest_packcheck.checks.parity import check_isolation, check_logits_parity
    from pytest_packcheck.model.batches import PLAIN_POSITIONS, PositionLayout

    planted = {"collator": PLAIN_POSITIONS, "rope_index": PositionLayout(rows=3, source="get_rope_index only"),
               "text_row": TextRowNoRestart(rows=4, source="planted")}[layout]
    bench = _bench(spec, backend, tol, layout=planted)
    isolation, parity = check_isolation(bench), check_logits_parity(bench)
    assert (isolation.status, isolation.cause) == ("fail", "leak"), isolation.message
    assert (parity.status, parity.cause) == ("fail", "leak") and parity.metrics["max_abs_diff_solo"] > 0.1


def test_planted_frozen_section_is_wrong_positions(tol):
    """One M-RoPE row stuck at 0 in the packed row: the boundaries hold (isolation passes), the positions inside
    each example are wrong: parity fails with wrong_positions."""
    from pytest_packcheck.checks.parity import check_isolation, check_logits_parity, check_loss_parity

    bench = _bench("arch:qwen2_vl", "sdpa", tol, layout=FrozenSection(rows=4, source="planted"))
    assert check_isolation(bench).status == "pass"
    parity = check_logits_parity(bench)
    assert (parity.status, parity.cause) == ("fail", "wrong_positions") and parity.metrics["max_abs_diff_solo"] > 1e-2
    assert check_loss_parity(bench).cause == "wrong_positions"


def test_section_not_restarting_is_harmless(tol):
    """An M-RoPE row that runs on across the packed row while the text row restarts shifts each example's positions
    in that section by a constant: rotary attention depends on differences only, so the row matches the solo
    runs (measured, not assumed: a check may not call it a fault)."""
    from pytest_packcheck.checks.parity import check_logits_parity

    bench = _bench("arch:qwen2_vl", "sdpa", tol, layout=SectionNoRestart(rows=4, source="planted"))
    parity = check_logits_parity(bench)
    assert parity.metrics["max_abs_diff_solo"] < 1e-5  # the laid-out row holds (the collator's ids are another matter)


def test_planted_dropped_position_ids(qwen2_vl_sdpa, tol):
    """A VLM wrapper that drops position_ids: the model builds its own 0..N-1 rows, the position_ids check fails
    with ignores_position_ids."""
    from pytest_packcheck.checks.parity import check_position_ids
    from pytest_packcheck.checks.workbench import Workbench

    bench = Workbench(model=DropPositionIds(qwen2_vl_sdpa.model), config=qwen2_vl_sdpa.config, backend="sdpa",
                      dtype="float32", tol=tol["float32"], layout=qwen2_vl_sdpa.layout)
    result = check_position_ids(bench)
    assert (result.status, result.cause) == ("fail", "ignores_position_ids")


def test_position_layout_remedy():
    from pytest_packcheck.analysis.diagnose import remedy
    from pytest_packcheck.checks.registry import CAUSES, SPECS

    assert "position_layout" in CAUSES and "position_layout" in SPECS["logits_parity"].causes
    text = remedy("position_layout", {"backend": "sdpa", "check": "logits_parity", "metrics": {}}, {"transformers": "5.24.0"})
    assert "(4, batch, length)" in text and "cu_seq_lens" in text


def test_hub_id_qwen2_vl_offline(offline_hub, tmp_path, tol):
    """A Qwen2-VL Hub ID from a local Hub-layout cache (HF_HUB_OFFLINE=1): its flat config.json (rope_scaling
    mrope [16, 24, 24]) resolves with the cached revision, shrinks, and keeps the examples apart on sdpa."""
    from conftest import lay_out_hub_cache

    from pytest_packcheck.checks.parity import check_isolation, check_logits_parity
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    repo = "Qwen/Qwen2-VL-2B-Instruct"
    sha = lay_out_hub_cache(tmp_path / "hf_home" / "hub", [repo])[repo]
    resolved = resolve_model(parse_model_spec(repo, "test"), "test")
    assert (resolved.revision, resolved.model_class, resolved.text_path) == (sha, "Qwen2VLForConditionalGeneration", "mrope")
    assert not any("mrope_section" in n for n in resolved.notes)  # the checkpoint's own section, nothing written
    bench = _bench(repo, "sdpa", tol)
    assert bench.layout.rows == 4
    assert bench.model.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    parity = check_logits_parity(bench)
    assert check_isolation(bench).status == "pass" and parity.metrics["max_abs_diff_solo"] < 1e-5
    assert (parity.status, parity.cause) == ("fail", "position_layout")  # fed as the Trainer feeds it


def test_plugin_records_the_text_path(pytester):
    """End to end: the cells of arch:qwen2_vl carry the model record's text_path and, per cell, the layout fed."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--packcheck-models=arch:qwen2_vl",
                                           "--packcheck-attn=sdpa", "--packcheck-checks=isolation,logits_parity",
                                           "--packcheck-report-dir=out", "-q")
    result.assert_outcomes(passed=1, failed=1)  # logits_parity: the collator's (1, N) ids leak (position_layout)
    cells = read_results(pytester.path / "out" / "packcheck-matrix.json")["cells"]
    assert {c["check"] for c in cells} == {"isolation", "logits_parity"}
    for cell in cells:
        assert cell["model"]["model_class"] == "Qwen2VLForConditionalGeneration" and "text path" in cell["model"]["text_path"]
        assert cell["metrics"]["text_path"]["position_ids"].startswith("(4, batch, length)")


def test_vlm_audit_resolves():
    """audit/vlm.toml names architectures that all resolve to a text path (overrides included)."""
    from pytest_packcheck.config.audits import load_audit
    from pytest_packcheck.model.resolve import resolve_model

    audit = load_audit("vlm")
    from pytest_packcheck.model.specs import parse_model_spec

    resolved = [resolve_model(parse_model_spec(raw, "audit vlm"), "audit vlm") for raw in audit.models]
    assert len(resolved) >= 10 and all(r.text_path == "mrope" for r in resolved)


def test_all_architectures_includes_the_text_path_models():
    """--packcheck-all-architectures: every causal LM, then every multimodal model run on its text path."""
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.model.architectures import causal_lm_architectures, mrope_text_path_architectures

    settings = resolve({"packcheck_all_architectures": True}.get, lambda k: None)
    causal, vlm = causal_lm_architectures(), mrope_text_path_architectures()
    assert "qwen2_vl" in vlm and "qwen2_vl" not in causal
    assert list(settings.models) == [f"arch:{a}" for a in [*causal, *vlm]]
