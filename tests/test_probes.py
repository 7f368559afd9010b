"""The probes that only a cross-backend, causality or edge-length view sees: each passes on the correct stack and
fails on its planted fault with the right cause."""

from __future__ import annotations

from conftest import make_bench
from faults import bidirectional_sdpa, windowless_sdpa

from pytest_packcheck import checks as C
from pytest_packcheck.checks.attention import window_probe_lengths
from pytest_packcheck.run.runner import plan_cells


def test_cross_backend_passes_on_sdpa_and_catches_a_backend_without_the_window(tolerances):
    """mistral's window is shrunk to 8 tokens; sdpa per-example logits equal eager's on the same weights. A sdpa
    that drops the window (packed and solo alike, so packed-vs-solo parity cannot see it) fails, cause
    sliding_window, and the lengths at or below the window match."""
    bench = make_bench("mistral", "sdpa", tolerances)
    assert window_probe_lengths(bench) == [7, 8, 11]
    ok = C.check_cross_backend(bench)
    assert ok.status == "pass" and ok.metrics["max_abs_diff_vs_eager"] < 1e-5, ok.message
    with windowless_sdpa():
        bad = C.check_cross_backend(make_bench("mistral", "sdpa", tolerances))
    assert bad.status == "fail" and bad.cause == "sliding_window", bad.message
    assert bad.metrics["per_length"]["7"] < 1e-5 and bad.metrics["per_length"]["11"] > 1e-3


def test_cross_backend_names_a_backend_that_differs_everywhere(tolerances):
    """llama has no window: a sdpa that attends non-causally differs from eager at every length -> cross_backend."""
    with bidirectional_sdpa():
        result = C.check_cross_backend(make_bench("llama", "sdpa", tolerances))
    assert result.status == "fail" and result.cause == "cross_backend", result.message


def test_cross_backend_within_float_rounding_of_eager_is_kernel_numerics(tolerances):
    """Trial 10, 64: under a tolerance below float rounding (float32.logits_atol=1e-9) llama / sdpa's per-example
    logits differ from eager's by ~1.2e-07 (float32 rounding): that is kernel numerics, the same attention, never
    cross_backend (which put llama under "Do not pack"). Planted: a sdpa that attends non-causally is still
    cross_backend under the same tolerance."""
    import copy

    tight = copy.deepcopy(tolerances)
    tight["float32"]["logits_atol"] = 1e-9
    result = C.check_cross_backend(make_bench("llama", "sdpa", tight))
    diff = result.metrics["max_abs_diff_vs_eager"]
    if diff <= 1e-9:
        import pytest

        pytest.skip(f"sdpa equals eager bit for bit here ({diff}): nothing within rounding to judge")
    assert result.status == "fail" and result.cause == "kernel_numerics", result.message
    assert result.evidence["tolerance"] == "logits_atol" and result.evidence["below_rounding"] is True
    with bidirectional_sdpa():
        planted = C.check_cross_backend(make_bench("llama", "sdpa", tight))
    assert planted.status == "fail" and planted.cause == "cross_backend", planted.message


def test_cross_backend_is_not_planned_on_eager():
    class M:
        class spec:
            label = "m"

    cells = plan_cells([M()], ("eager", "sdpa"), ("cross_backend", "isolation"), ("float32",))
    assert [(c.backend, c.check) for c in cells] == [("eager", "isolation"), ("sdpa", "cross_backend"), ("sdpa", "isolation")]


def test_causality_passes_and_catches_bidirectional_attention_that_keeps_boundaries(tolerances):
    """A sdpa that is bidirectional inside each example keeps the boundaries (isolation passes) but a later token
    moves earlier logits: causality fails, cause non_causal."""
    bench = make_bench("llama", "sdpa", tolerances)
    ok = C.check_causality(bench)
    assert ok.status == "pass" and ok.metrics["max_change_earlier"] == 0.0 and ok.metrics["perturbed_position_change"] > 1e-2
    with bidirectional_sdpa():
        bench = make_bench("llama", "sdpa", tolerances)
        iso, causal = C.check_isolation(bench), C.check_causality(bench)
    assert iso.status == "pass", iso.message
    assert causal.status == "fail" and causal.cause == "non_causal" and causal.metrics["max_change_earlier"] > 1e-3


def test_edge_lengths_with_one_token_examples(tolerances):
    """One-token examples (two adjacent), one at the window, one much longer: packed = solo on llama; the reference
    loss takes examples without labels (an empty target tensor once crashed it). A collator whose positions do
    not restart (so no boundaries) fails it as a leak."""
    from faults import collator_no_reset

    bench = make_bench("llama", "sdpa", tolerances)
    ok = C.check_edge_lengths(bench)
    assert ok.status == "pass", ok.message
    assert [r["lengths"] for r in ok.metrics["rows"]] == [[1, 1, 9], [8, 5], [40, 2, 3]]
    bench = make_bench("llama", "sdpa", tolerances, collator_factory=collator_no_reset)
    bad = C.check_edge_lengths(bench)
    assert bad.status == "fail" and bad.cause == "leak", (bad.cause, bad.message)  # no restarts: no boundaries


def test_reference_loss_takes_a_one_token_example(tolerances):
    bench = make_bench("llama", "sdpa", tolerances)
    bench.examples = [bench.examples[0], [5], bench.examples[2]]
    result = C.check_loss_parity(bench)
    assert result.status == "pass", result.message
    assert result.metrics["num_items_expected"] == len(bench.examples[0]) - 1 + len(bench.examples[2]) - 1


def test_lengths_and_sliding_window_reach_the_workbench(tolerances):
    """--packcheck-lengths 11,1,13 packs a one-token example between two (the loss reference counts its zero labels);
    --packcheck-sliding-window 16 is the window the shrink gives mistral."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import Cell, CellRunner

    resolved = [resolve_model(parse_model_spec(m, "test"), "test") for m in ("arch:llama", "arch:mistral")]
    runner = CellRunner(resolved, tolerances, lengths=(11, 1, 13), sliding_window=16)
    loss = runner.run(Cell(0, "llama", "sdpa", "loss_parity", "float32"))
    assert loss.status == "pass" and loss.metrics["num_items_expected"] == 10 + 0 + 12, loss.message
    assert runner.workbench(Cell(1, "mistral", "sdpa", "isolation", "float32")).config.sliding_window == 16


def test_bad_lengths_and_window_are_one_line_errors(tmp_path):
    import pytest

    from pytest_packcheck.config.audits import load_audit
    from pytest_packcheck.config.options import OPT_LENGTHS, parse_lengths
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.errors import PackcheckUsageError

    for bad in ("11", "11,0,13", "a,b", "11,-1", "4000,97"):
        with pytest.raises(PackcheckUsageError, match=f"Bad example lengths '{bad}' \\(from {OPT_LENGTHS}\\)"):
            parse_lengths(bad, OPT_LENGTHS)
    for window in ("1", "4097"):
        with pytest.raises(PackcheckUsageError, match=f"Bad sliding window '{window}' \\(from --packcheck-sliding-window\\): .* from 2 to 4096"):
            resolve({"packcheck_models": "arch:llama", "packcheck_sliding_window": window}.get, lambda k: None)
    assert parse_lengths("4000,96", OPT_LENGTHS) == (4000, 96)  # 4096 tokens: the longest row taken
    for bad, item in (("5,,5", "item 2 of 3"), ("11,7,", "item 3 of 3"), (",5,5", "item 1 of 3")):
        # an empty item is refused, never dropped (`5,,5` ran as 5,5 while the Reproduce line said 5,,5)
        with pytest.raises(PackcheckUsageError, match=f"Bad example lengths '{bad}' \\(from {OPT_LENGTHS}\\): {item} is empty"):
            parse_lengths(bad, OPT_LENGTHS)
    audit = tmp_path / "a.toml"
    audit.write_text('models = ["arch:llama"]\nlengths = [11, 1, 13]\nsliding_window = 12\n')
    got = load_audit(str(audit))
    assert got.lengths == (11, 1, 13) and got.sliding_window == 12
    settings = resolve(lambda d: {"packcheck_audit": str(audit)}.get(d), lambda k: None)
    assert settings.lengths == (11, 1, 13) and settings.sliding_window == 12
    audit.write_text('models = ["arch:llama"]\nlengths = [11]\n')
    with pytest.raises(PackcheckUsageError, match="'lengths' must be a list of at least two whole numbers >= 1"):
        load_audit(str(audit))
