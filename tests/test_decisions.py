"""The verdict-deciding functions outside the model checks, on synthetic documents and planted runs (issue 14):
the training verdicts (Trainer and SFT) from planted per-step numbers, the gate's comparison, the headline,
the cause classification and the tolerance resolution. No model is built: these run in seconds, which is what
tools/mutation.sh needs."""

from __future__ import annotations

import copy

import pytest
from test_diagnose import _ProbedBench

from pytest_packcheck.checks import training as T
from pytest_packcheck.results.schema import CheckResult


class _Said(CheckResult):
    def __post_init__(self) -> None:
        super().__post_init__()
        assert isinstance(self.message, str) and self.message.strip(), (self.status, self.message)


@pytest.fixture(autouse=True)
def _results_say_why(monkeypatch):
    """Every verdict says why in a one-line message."""
    monkeypatch.setattr(T, "CheckResult", _Said)

# ------------------------------------------------------------------------------------------------------------
# the Trainer check's verdict, from planted runs


class _TrainBench(_ProbedBench):
    """A workbench for :func:`training.check_trainer` whose runs are planted: no model, no Trainer."""

    def __init__(self, logits_diff: float = 0.0, moved: float = 0.0) -> None:
        super().__init__(moved, [], "missing")
        self.examples = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        self.lengths = [len(e) for e in self.examples]
        self.pad_id, self.start, self.device = 0, 0, "cpu"
        self.config.use_cache = True
        self.logits_diff = logits_diff
        probe = next(iter(self._cache.values()))
        self.collator_factory = lambda **kwargs: "flat"
        self._cache = {("leak_probe", id(self.model), id(self.collator_factory)): probe}

    def packed_logits(self):
        return None

    def diff_to_solo(self, logits):
        return self.logits_diff, []


REF = ([2.0, 1.9, 1.8], [1.0, 0.9, 0.8])


def _params(shift: float = 0.0):
    import torch

    return {"w": torch.ones(10) + shift, "b": torch.full((4,), 2.0)}


def _plant(monkeypatch, as_configured=None, use_cache_false=None, padded=None, counts=(None, None), expected=10):
    """Plant the runs check_trainer reads: (loss, grad norm, params) per run; the grad-accum counts."""
    good = (list(REF[0]), list(REF[1]), _params())
    runs = {None: as_configured or good, False: use_cache_false or good}

    def fake_reference(model, batch, steps):
        assert steps == T.TRAINER_STEPS and batch["labels"].shape == batch["input_ids"].shape == (3, 5)
        assert batch["labels"][1, -1] == -100  # right-padded: the 3-token example's padding is masked
        return list(REF[0]), list(REF[1]), _params()

    monkeypatch.setattr(T, "reference_steps", fake_reference)

    def fake_train(bench, collator, out_dir, use_cache, **kw):
        assert out_dir and not kw
        if isinstance(collator, T._PaddingCollator):
            assert use_cache is False and collator.pad_id == bench.pad_id
            return padded or good
        assert collator == "flat", collator
        return runs[use_cache]

    monkeypatch.setattr(T, "_train", fake_train)

    def fake_grad_accum(bench, collator, out_dir):
        assert collator == "flat" or isinstance(collator, T._PaddingCollator)
        return {"num_items_in_batch": list(counts), "expected": expected, "micro_batches": 2, "loss": [1.0], "grad_norm": [1.0],
                "collator": "flat" if collator == "flat" else "padded"}

    monkeypatch.setattr(T, "_grad_accum", fake_grad_accum)


def test_trainer_verdict_passes_equal_runs(monkeypatch):
    pytest.importorskip("accelerate")
    _plant(monkeypatch)
    result = T.check_trainer(_TrainBench())
    assert result.status == "pass" and result.cause is None and result.findings == [], result.message
    assert result.metrics["as_configured"]["param_rel_diff"] == 0.0 and "passes no num_items_in_batch" in result.message
    run = {"loss": REF[0], "grad_norm": REF[1], "max_loss_delta": 0.0, "max_grad_norm_rel": 0.0, "param_rel_diff": 0.0,
           "first_diverging_step": None}
    ga = {"num_items_in_batch": [None, None], "expected": 10, "micro_batches": 2, "loss": [1.0], "grad_norm": [1.0]}
    assert result.metrics == {"steps": T.TRAINER_STEPS, "reference_loss": REF[0], "reference_grad_norm": REF[1],
                              "config_use_cache": True, "as_configured": run, "use_cache_false": run, "padded_trainer": run,
                              "max_loss_delta": 0.0, "grad_accum": {"packed": {**ga, "collator": "flat"},
                                                                    "padded": {**ga, "collator": "padded"}}}


def test_trainer_is_skipped_without_a_backward(monkeypatch):
    pytest.importorskip("accelerate")
    _plant(monkeypatch)
    bench = _TrainBench()
    bench.backend = "flex_attention"  # no backward on CPU
    result = T.check_trainer(bench)
    assert result.status == "skipped" and "backward" in result.message and result.metrics == {}
    bench.backend = None  # no backend named: eager, which has one
    assert T.check_trainer(bench).status == "pass"


def test_trainer_names_the_padded_runs_normalisation(monkeypatch):
    """Trainer's own padded run off by shifted / unshifted label tokens (9/12 on the planted batch): a finding and a
    note, never the verdict."""
    pytest.importorskip("accelerate")
    ratio = 9 / 12
    _plant(monkeypatch, padded=([2.0 * ratio, 1.9, 1.8], list(REF[1]), _params()))
    result = T.check_trainer(_TrainBench())
    assert result.status == "pass" and [f["cause"] for f in result.findings] == ["padded_normalisation"]
    assert "x0.7500" in result.findings[0]["evidence"] and "own padded run is off" in result.message
    assert result.metrics["padded_trainer"]["normalisation"] and result.metrics["padded_trainer"]["loss_ratio"] == pytest.approx(ratio)


def test_trainer_verdict_reads_the_parameters_after_the_last_step(monkeypatch):
    """Planted: the same losses and grad norms, other parameters after the last step (an update the loss has not
    shown yet). The verdict must fail on the parameters."""
    pytest.importorskip("accelerate")
    off = (list(REF[0]), list(REF[1]), _params(shift=0.01))
    _plant(monkeypatch, as_configured=off, use_cache_false=off)
    result = T.check_trainer(_TrainBench())
    assert result.metrics["as_configured"]["max_loss_delta"] == 0.0 and result.metrics["as_configured"]["max_grad_norm_rel"] == 0.0
    assert result.status == "fail" and result.cause == "loss_normalisation", result.message
    assert result.metrics["use_cache_false"]["param_rel_diff"] == pytest.approx(0.01 * 10 ** 0.5 / 26 ** 0.5)
    assert result.evidence == {"logits_diff": 0.0, "use_cache_false_loss_delta": 0.0} and result.findings == []


def test_trainer_verdict_reads_the_grad_norm_and_the_loss(monkeypatch):
    pytest.importorskip("accelerate")
    norm_off = (list(REF[0]), [1.0, 0.9, 0.81], _params())
    _plant(monkeypatch, as_configured=norm_off, use_cache_false=norm_off)
    result = T.check_trainer(_TrainBench())
    assert result.status == "fail" and result.metrics["as_configured"]["max_grad_norm_rel"] > 1e-3
    loss_off = ([2.0, 1.95, 1.8], list(REF[1]), _params())
    _plant(monkeypatch, as_configured=loss_off, use_cache_false=loss_off)
    result = T.check_trainer(_TrainBench())
    assert result.status == "fail" and result.metrics["use_cache_false"]["first_diverging_step"] == 2


def test_trainer_verdict_at_its_tolerances_passes(monkeypatch):
    pytest.importorskip("accelerate")
    bench = _TrainBench()
    tol_loss, tol_rel = bench.tol["train_loss_atol"], bench.tol["train_grad_norm_rel"]
    edge = ([2.0 + tol_loss / 2, 1.9, 1.8], [1.0 * (1 + tol_rel / 2), 0.9, 0.8], _params(shift=0.0))
    _plant(monkeypatch, as_configured=edge, use_cache_false=edge)
    assert T.check_trainer(bench).status == "pass"


def test_trainer_verdict_bounds_are_inclusive(monkeypatch):
    """Each of the three numbers exactly at its tolerance passes (loss, grad norm, parameters, one at a time)."""
    pytest.importorskip("accelerate")
    runs = (([2.5, 1.9, 1.8], list(REF[1]), 0.0), (list(REF[0]), [1.5, 0.9, 0.8], 0.0), (list(REF[0]), list(REF[1]), 0.01))
    for run, key in zip(runs, ("train_loss_atol", "train_grad_norm_rel", "train_grad_norm_rel"), strict=True):
        planted = (run[0], run[1], _params(shift=run[2]))
        _plant(monkeypatch, as_configured=planted, use_cache_false=planted)
        bench = _TrainBench()
        first = T.check_trainer(bench)
        assert first.status == "fail"
        m = first.metrics["as_configured"]
        bench.tol[key] = {"train_loss_atol": m["max_loss_delta"]}.get(key, max(m["max_grad_norm_rel"], m["param_rel_diff"]))
        assert T.check_trainer(bench).status == "pass", (key, m)


def test_trainer_verdict_names_the_cache_trap_and_the_leak(monkeypatch):
    pytest.importorskip("accelerate")
    wrong = ([2.0, 2.5, 2.9], [1.0, 1.5, 1.9], _params(shift=0.1))
    _plant(monkeypatch, as_configured=wrong)
    trap = T.check_trainer(_TrainBench())
    assert trap.status == "fail" and trap.cause == "cache_trap"
    assert trap.evidence == {"as_configured_loss_delta": pytest.approx(1.1), "use_cache_false_loss_delta": 0.0, "config_use_cache": True}
    assert trap.metrics["as_configured"]["first_diverging_step"] == 2 and trap.metrics["max_loss_delta"] == pytest.approx(1.1)
    _plant(monkeypatch, as_configured=wrong, use_cache_false=wrong)
    leak = T.check_trainer(_TrainBench(logits_diff=0.3, moved=0.3))
    assert leak.status == "fail" and leak.cause == "leak" and leak.findings == []
    assert leak.evidence == {"isolation_moved": 0.3, "isolation_atol": leak.evidence["isolation_atol"],
                             "use_cache_false_loss_delta": pytest.approx(1.1)}
    gap = ([2.0, 2.5, 2.9], [1.0, 1.5, 1.9], _params(shift=0.1))
    _plant(monkeypatch, as_configured=gap, use_cache_false=([2.0, 2.2, 2.1], [1.0, 1.5, 1.9], _params(shift=0.1)))
    both = T.check_trainer(_TrainBench(logits_diff=0.0))
    assert both.cause == "loss_normalisation" and [f["cause"] for f in both.findings] == ["cache_trap"]
    assert both.findings[0]["evidence"] == "the packed run as configured differs from use_cache=False by 8.00e-01 in loss"
    small_gap = ([2.0, 2.2, 2.1005], [1.0, 1.5, 1.9], _params(shift=0.1))
    _plant(monkeypatch, as_configured=small_gap, use_cache_false=([2.0, 2.2, 2.1], [1.0, 1.5, 1.9], _params(shift=0.1)))
    assert T.check_trainer(_TrainBench(logits_diff=0.0)).findings == []  # within 1e-3: no cache trap named


def test_trainer_verdict_on_num_items_in_batch(monkeypatch):
    pytest.importorskip("accelerate")
    _plant(monkeypatch, counts=(12, 12), expected=10)
    wrong = T.check_trainer(_TrainBench())
    assert wrong.status == "fail" and wrong.cause == "loss_normalisation"
    assert wrong.evidence == {"num_items_in_batch": [12], "expected": 10}
    _plant(monkeypatch, counts=(10, 10), expected=10)
    right = T.check_trainer(_TrainBench())
    assert right.status == "pass" and "num_items_in_batch 10 as expected" in right.message


# ------------------------------------------------------------------------------------------------------------
# the SFT checks' step comparison and cause


def test_sft_steps_verdict_reads_loss_and_grad_norm():
    from pytest_packcheck.checks.sft_probes import STEPS, _compare_steps

    bench = _ProbedBench(0.0, [], "reached")
    ref = ([2.0, 1.9, 1.8][:STEPS], [1.0, 0.9, 0.8][:STEPS])
    metrics, problems = _compare_steps(bench, ref, ref, "packed")
    assert problems == [] and metrics["first_diverging_step"] is None and metrics["max_grad_norm_rel"] == 0.0
    norm_off = (ref[0], [1.0, 0.9 * 1.01, 0.8][:STEPS])
    metrics, problems = _compare_steps(bench, norm_off, ref, "packed")
    assert metrics["first_diverging_step"] is None and abs(metrics["max_grad_norm_rel"] - 0.01) < 1e-9
    assert len(problems) == 1 and "grad norm differs" in problems[0]
    tol = bench.tol["train_grad_norm_rel"]
    at_tol = (ref[0], [1.0, 0.9 * (1 + tol / 2), 0.8][:STEPS])
    assert _compare_steps(bench, at_tol, ref, "packed")[1] == []
    loss_off = ([2.0, 1.9 + 2 * bench.tol["train_loss_atol"], 1.8][:STEPS], ref[1])
    metrics, problems = _compare_steps(bench, loss_off, ref, "packed")
    assert metrics["first_diverging_step"] == 2 and len(problems) == 1 and "diverge at step 2" in problems[0]
    loss_at = ([2.0, 1.9 + bench.tol["train_loss_atol"] / 2, 1.8][:STEPS], ref[1])
    assert _compare_steps(bench, loss_at, ref, "packed")[0]["first_diverging_step"] is None
    bench.tol = {**bench.tol, "train_grad_norm_rel": 0.5, "train_loss_atol": 0.5}
    assert _compare_steps(bench, ([2.0, 1.9, 1.8][:STEPS], [1.5, 0.9, 0.8][:STEPS]), ref, "packed")[1] == []  # at the bounds
    assert _compare_steps(bench, ([2.5, 1.9, 1.8][:STEPS], ref[1]), ref, "packed")[1] == []
    short = ([2.0], [1.0])
    assert "logged 1 steps" in _compare_steps(bench, short, ref, "packed")[1][0]


class _SftBench(_ProbedBench):
    def __init__(self, logits_diff: float, moved: float = 0.0) -> None:
        super().__init__(moved, [], "missing")
        self.logits_diff = logits_diff

    def packed_logits(self):
        return None

    def diff_to_solo(self, logits):
        return self.logits_diff, []


def test_sft_loss_cause_from_what_the_mode_measured():
    """A loss probe off the reference: no boundaries in the row -> mask_override (whatever the logits say); packed
    logits equal to each example alone -> loss_normalisation (at the tolerance still equal); a moving isolation
    probe -> leak with its numbers; logits within NUMERICS_FACTOR x the tolerance -> kernel_numerics."""
    from pytest_packcheck.checks.sft_probes import _loss_cause

    tol = _SftBench(0.0).tol
    assert _loss_cause(_SftBench(0.3, moved=0.3), {"row_contract": {"all_ones_attention_mask": True}})[0] == "mask_override"
    assert _loss_cause(_SftBench(0.3, moved=0.3), {"row_contract": {"position_ids": False}}) == ("mask_override", {"position_ids": False})
    assert _loss_cause(_SftBench(tol["logits_atol"]), {}) == ("loss_normalisation", {"logits_diff": tol["logits_atol"]})
    cause, evidence = _loss_cause(_SftBench(0.3, moved=0.3), {"row_contract": {"position_ids": True}})
    assert cause == "leak" and evidence == {"isolation_moved": 0.3, "isolation_atol": tol["isolation_atol"]}
    cause, evidence = _loss_cause(_SftBench(3e-4), {})  # isolation holds, logits within 10 x: numerics
    assert cause == "kernel_numerics" and evidence["diff"] == 3e-4 and evidence["atol"] == tol["logits_atol"]
    assert _loss_cause(_SftBench(2e-3), {})[0] == "wrong_positions"  # beyond 10 x, isolation holding


# ------------------------------------------------------------------------------------------------------------
# the gate


def _gcell(label="m", check="isolation", status="pass", backend="sdpa", env=None, **metrics):
    from pytest_packcheck.config.tolerances import load_tolerances

    cell = {"cell_id": f"{label}-{backend}-{check}-float32" + (f"@{env}" if env else ""), "backend": backend, "check": check,
            "dtype": "float32", "status": status, "message": f"{check} {status}", "metrics": metrics,
            "model": {"label": label, "spec": f"arch:{label}"}, "tolerances": load_tolerances(None, None, "t")[0]["float32"]}
    if env:
        cell["env"] = {"label": env}
    return cell


def _gdoc(*cells, **settings):
    return {"schema_version": 2, "environment": {}, "settings": settings, "cells": list(cells)}


def test_gate_orders_verdicts_and_grows_numbers_against_the_tolerance():
    from pytest_packcheck.analysis.gate import compare, regressions

    base = _gdoc(_gcell(max_abs_diff_solo=1e-6, check="logits_parity"), _gcell("n", status="fail"), _gcell("o", status="skipped"))
    assert compare(base, copy.deepcopy(base)) == []
    tol = 1e-4
    # a pass stays a pass however its number moves under the tolerance (issue 41: the rule for "a pass that grew by
    # more than its tolerance" could never fire, a pass above it being refused on load, and was removed)
    from pytest_packcheck.results.schema import cell_problem

    for grow in (tol * 0.98, tol * 0.5, -1e-6):
        cand = copy.deepcopy(base)
        cand["cells"][0]["metrics"]["max_abs_diff_solo"] += grow
        assert compare(base, cand) == [] and cell_problem(cand["cells"][0]) is None, grow
    over = copy.deepcopy(base)
    over["cells"][0]["metrics"]["max_abs_diff_solo"] += tol * 1.01
    assert "above its tolerance" in cell_problem(over["cells"][0])
    for new, worse in (("fail", True), ("error", True), ("skipped", True), ("pass", False)):
        cand = copy.deepcopy(base)
        cand["cells"][0]["status"] = new
        assert bool(regressions(compare(base, cand))) is worse, new
    better = copy.deepcopy(base)
    better["cells"][1]["status"] = "pass"
    changes = compare(base, better)
    assert len(changes) == 1 and not changes[0].worse and changes[0].baseline == "fail" and changes[0].candidate == "pass"
    worse_still = copy.deepcopy(base)
    worse_still["cells"][1]["status"] = "error"
    assert [c.key[0] for c in regressions(compare(base, worse_still))] == ["n"]
    unsupported = copy.deepcopy(base)
    unsupported["cells"][2]["status"] = "unsupported"
    assert [c.key[0] for c in regressions(compare(base, unsupported))] == ["o"]


def test_gate_missing_new_and_allowed_cells():
    from pytest_packcheck.analysis.gate import allowed_reason, compare, regressions

    base = _gdoc(_gcell("m"), _gcell("n", status="fail"), models=["arch:m", "arch:n"], checks=["isolation"],
                 backends=["sdpa"], dtypes=["float32"])
    cand = _gdoc(_gcell("n", status="fail"), models=["arch:m", "arch:n"], checks=["isolation"], backends=["sdpa"], dtypes=["float32"])
    missing = regressions(compare(base, cand))
    assert [(c.key[0], c.detail) for c in missing] == [("m", "cell missing in candidate")]
    assert regressions(compare(base, cand, {"m-sdpa": "dropped"})) == []
    assert compare(base, cand, {"m-sdpa": "dropped"})[0].allowed == "dropped"
    other_models = copy.deepcopy(cand)
    other_models["settings"]["models"] = ["arch:n"]
    change = compare(base, other_models)[0]
    assert not change.worse and change.detail == "not in the candidate's selection"
    gone_fail = _gdoc(_gcell("m"), models=["arch:m", "arch:n"], checks=["isolation"], backends=["sdpa"], dtypes=["float32"])
    assert regressions(compare(base, gone_fail)) == []  # a fail that is gone is no regression
    new = _gdoc(_gcell("m"), _gcell("n", status="fail"), _gcell("p", status="fail"), _gcell("q"))
    changes = {c.key[0]: c for c in compare(_gdoc(_gcell("m"), _gcell("n", status="fail")), new)}
    assert changes["p"].worse and not changes["q"].worse and changes["p"].detail == "new cell"
    assert allowed_reason("m-sdpa-isolation-float32@transformers==5.24.0", {"m-sdpa-isolation-float32": "r"}) == "r"
    assert allowed_reason("m-sdpa-isolation-float32", {"m": "r"}) == "r"
    assert allowed_reason("mx-sdpa-isolation-float32", {"m": "r"}) is None


def test_gate_matches_cells_of_the_same_environment():
    from pytest_packcheck.analysis.gate import compare, regressions

    two = _gdoc(_gcell("m", env="a"), _gcell("m", env="b"))
    cand = copy.deepcopy(two)
    cand["cells"][1]["status"] = "fail"
    assert [c.key[4] for c in regressions(compare(two, cand))] == ["b"]
    one_stack = _gdoc(_gcell("m", env="a"))
    other_stack = _gdoc(_gcell("m", status="fail", env="b"))
    assert [c.key for c in regressions(compare(one_stack, other_stack))] == [("m", "sdpa", "isolation", "float32", None)]


def test_gate_planned_in_reads_every_setting():
    from pytest_packcheck.analysis.gate import _planned_in

    cell = _gcell("m")
    full = {"settings": {"checks": ["isolation"], "dtypes": ["float32"], "backends": ["sdpa"], "models": ["arch:m"]}}
    assert _planned_in(cell, full)
    for key, value in (("checks", ["backend"]), ("dtypes", ["bfloat16"]), ("backends", ["eager"]), ("models", ["arch:n"])):
        assert not _planned_in(cell, {"settings": {**full["settings"], key: value}}), key
    assert _planned_in(cell, {"settings": {}})
    # a setting left out: dtypes default to the cell's, the other lists to none
    assert _planned_in(cell, {"settings": {k: v for k, v in full["settings"].items() if k != "dtypes"}})
    for key in ("backends", "models"):
        assert not _planned_in(cell, {"settings": {k: v for k, v in full["settings"].items() if k != key}}), key
    no_spec = {**cell, "model": {"label": "arch:m"}}
    assert _planned_in(no_spec, full)  # a cell without a spec is matched by its label
    assert _planned_in({**cell, "backend": None}, {"settings": {**full["settings"], "backends": []}})


# ------------------------------------------------------------------------------------------------------------
# the headline


def _hcell(check, status, cause=None, role=None):
    cell = {"check": check, "status": status, "message": f"{check} {status}", "cause": cause}
    if role:
        cell["role"] = role
    return cell


def test_headline_takes_the_worst_correctness_check():
    from pytest_packcheck.report.verdicts import cell_status, headline

    assert cell_status(["pass", "skipped"]) == "pass" and cell_status(["skipped"]) == "skipped"
    assert cell_status(["pass", "fail", "error"]) == "error" and cell_status(["fallback", "pass"]) == "fallback"
    assert cell_status(["fail", "unsupported"]) == "fail"
    assert cell_status(["fail", "timeout"]) == "timeout" and cell_status(["pass", "oom", "fail"]) == "oom"  # by rank, not by name
    group = [_hcell("isolation", "pass"), _hcell("cache_trap", "fail", "cache_trap"), _hcell("collate", "fail", "labels_contract")]
    h = headline(group)
    assert h["status"] == "pass" and h["causes"] == [] and [c["check"] for c in h["cells"]] == ["isolation"]
    only_hazards = headline(group[1:])
    # no correctness check: nothing judged, the hazards and findings never decide (trial 14, 140)
    assert only_hazards["status"] == "skipped" and only_hazards["no_correctness"] and only_hazards["causes"] == []
    bad = headline([_hcell("logits_parity", "fail", "wrong_positions"), _hcell("isolation", "fail", "leak"),
                    _hcell("backend", "error"), _hcell("grad_parity", "skipped"), _hcell("loss_parity", "pass")])
    assert bad["status"] == "error" and bad["causes"] == ["error", "leak", "wrong_positions"]
    assert bad["not_checked"] == {"grad_parity": "grad_parity skipped"} and len(bad["bad"]) == 3
    diagnosed = [{**_hcell("isolation", "fail", "leak"), "diagnosis": {"cause": "stateful_layers"}}]
    assert headline(diagnosed)["causes"] == ["stateful_layers"]
    assert headline([_hcell("mystery", "fail", "leak")])["status"] == "fail"  # an unknown check counts (newer file)
    # a role recorded for a check the registry knows (an earlier packcheck's: trainer_padded was correctness) is read
    # as the registry's; a newer packcheck's check keeps the role its file records
    assert headline([_hcell("isolation", "pass"), _hcell("cache_trap", "fail", role="correctness")])["status"] == "pass"
    assert headline([_hcell("isolation", "pass"), _hcell("trainer_padded", "fail", role="correctness")])["status"] == "pass"
    assert headline([_hcell("isolation", "pass"), _hcell("mystery", "fail", role="hazard")])["status"] == "pass"
    assert headline([_hcell("isolation", "pass"), _hcell("mystery", "fail", role="correctness")])["status"] == "fail"


# ------------------------------------------------------------------------------------------------------------
# classification (the diagnosis reads codes only)


@pytest.mark.parametrize(("status", "metrics", "cause", "expected"), [
    ("fail", {}, "leak", "leak"),
    ("skipped", {}, "leak", None),
    ("pass", {}, "leak", None),
    ("error", {"stage": "build", "exception": "E"}, None, "crash"),
    ("error", {"stage": ""}, None, None),
    ("timeout", {"timeout_s": 3}, None, "hang"),
    ("oom", {"rss_mib": 1.0, "other": 2}, None, "out_of_memory"),
    ("fallback", {"requested": "sdpa"}, None, "backend_swap"),
    ("fail", {}, None, "packed_mismatch"),
    ("unsupported", {}, None, None),
    ("unsupported", {}, "stateful_layers_refused", "stateful_layers_refused"),
])
def test_classify_each_status(status, metrics, cause, expected):
    from pytest_packcheck.analysis.diagnose import classify

    cell = {"status": status, "metrics": metrics, "cause": cause, "evidence": {"moved": 0.25, "n": 3}}
    got, evidence = classify(cell)
    assert got == expected
    if cause and expected:
        assert evidence == "moved 2.50e-01, n 3"
    if expected == "hang":
        assert evidence == "no result within 3 s"
    if expected == "out_of_memory":
        assert evidence == "rss_mib 1.0"


def test_diagnosis_keeps_findings_apart_from_the_cause():
    from pytest_packcheck.analysis.diagnose import KnownFault, diagnose_document

    fault = KnownFault(id="rows", upstream="", summary="s", library="transformers", versions=">=5", architectures=("*",),
                       backends=("*",), checks=("logits_parity",), cause="batch_rows", fixed_in="", remedy="r", evidence="e")
    cell = {"cell_id": "m-sdpa-logits_parity-float32", "model": {"label": "m", "model_type": "llama"}, "backend": "sdpa",
            "check": "logits_parity", "dtype": "float32", "status": "pass", "metrics": {}, "message": "ok",
            "findings": [{"cause": "batch_rows", "evidence": "two rows"}]}
    elsewhere = KnownFault(id="leak", upstream="", summary="s", library="transformers", versions=">=5", architectures=("*",),
                           backends=("*",), checks=("logits_parity",), cause="leak", fixed_in="", remedy="r", evidence="e")
    doc = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [copy.deepcopy(cell)]}, [fault, elsewhere])
    d = doc["cells"][0]["diagnosis"]
    from pytest_packcheck.analysis.diagnose import remedy

    assert d == {"cause": None, "evidence": "", "remedy": "", "causes": [], "known_faults": ["rows"],
                 "findings": [{"cause": "batch_rows", "evidence": "two rows", "remedy": remedy("batch_rows", cell, {})}]}
    no_env = diagnose_document({"cells": [{**copy.deepcopy(cell), "findings": [{"cause": "batch_rows"}]}]}, [fault])
    assert no_env["cells"][0]["diagnosis"]["findings"][0]["evidence"] == "" and no_env["known_faults_not_seen"] == {}
    assert doc["known_faults_not_seen"] == {"leak": ["m-sdpa-logits_parity-float32"]} and doc["cells"][0]["status"] == "pass"
    clean = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [{**cell, "findings": []}]}, [fault])
    assert clean["cells"][0]["diagnosis"] is None and clean["known_faults_not_seen"] == {"rows": ["m-sdpa-logits_parity-float32"]}
    failed = {**cell, "status": "fail", "cause": "batch_rows", "evidence": {}}
    d = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [failed]}, [fault])["cells"][0]["diagnosis"]
    assert d == {"cause": "batch_rows", "evidence": "", "remedy": remedy("batch_rows", cell, {}), "findings": [], "known_faults": ["rows"],
                 "causes": [{"cause": "batch_rows", "evidence": "", "remedy": remedy("batch_rows", cell, {})}]}
    leaked = {**cell, "status": "fail", "cause": "leak", "evidence": {"moved": 0.5}}
    d = diagnose_document({"environment": {"transformers": "5.24.0"}, "cells": [leaked]}, [fault, elsewhere])["cells"][0]["diagnosis"]
    assert d["evidence"] == "moved 5.00e-01" and d["known_faults"] == ["rows", "leak"] and d["findings"][0]["cause"] == "batch_rows"


# ------------------------------------------------------------------------------------------------------------
# tolerances: file > defaults, overrides > file, a dtype-qualified override for that dtype only


def test_tolerance_file_values_win_over_the_defaults(tmp_path):
    from pytest_packcheck.config.options import DTYPES
    from pytest_packcheck.config.tolerances import load_tolerances

    default, label = load_tolerances(None, None, "t")
    assert label == "tolerances.toml" and set(default) == set(DTYPES)
    path = tmp_path / "tol.toml"
    path.write_text("[float32]\nlogits_atol = 0.5\n[bfloat16]\nloss_atol = 0\n")
    tol, label = load_tolerances(str(path), None, "t")
    assert tol["float32"]["logits_atol"] == 0.5 and tol["bfloat16"]["loss_atol"] == 0.0
    assert label == f"{path} over the defaults (audit/tolerances.toml)"  # the keys it leaves out are the packaged ones
    assert tol["float32"]["loss_atol"] == default["float32"]["loss_atol"]  # keys the file leaves out: defaults
    assert tol["float16"] == default["float16"]  # a dtype the file leaves out: defaults
    assert isinstance(tol["float32"]["logits_atol"], float)
    path.write_text("[float32]\nlogits_atol = 2\n")
    assert load_tolerances(str(path), ["float32.logits_atol=0.25"], "t")[0]["float32"]["logits_atol"] == 0.25


def test_a_partial_tolerance_file_is_labelled_as_merged_over_the_defaults(tmp_path):
    """Trial 4, 220: a file setting only float32.logits_atol was reported as "Source: t1.toml" though 8 of the 9
    float32 values shown came from the packaged defaults; a file that sets every value keeps its plain name."""
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.versions.envs import _tolerance_toml

    part = tmp_path / "t1.toml"
    part.write_text("[float32]\nlogits_atol = 1e-4\n")
    assert load_tolerances(str(part), None, "t")[1] == f"{part} over the defaults (audit/tolerances.toml)"
    full = tmp_path / "full.toml"
    full.write_text(_tolerance_toml(load_tolerances(None, None, "t")[0]))
    assert load_tolerances(str(full), None, "t")[1] == str(full)


def test_a_dtype_override_applies_to_that_dtype_only():
    from pytest_packcheck.config.options import DTYPES
    from pytest_packcheck.config.tolerances import load_tolerances

    default, _ = load_tolerances(None, None, "t")
    tol, label = load_tolerances(None, ["float32.logits_atol=0.7"], "t")
    assert tol["float32"]["logits_atol"] == 0.7 and label == "tolerances.toml + float32.logits_atol=0.7"
    assert tol["bfloat16"]["logits_atol"] == default["bfloat16"]["logits_atol"] != 0.7
    assert tol["float16"]["logits_atol"] == default["float16"]["logits_atol"] != 0.7
    every, _ = load_tolerances(None, ["leak_min=0"], "t")
    assert all(every[d]["leak_min"] == 0.0 for d in DTYPES)
    again, _ = load_tolerances(None, None, "t")
    assert again == default  # overrides never leak into the defaults


@pytest.mark.parametrize("item", ["float32.logits_atol=-1", "float32.logits_atol=inf", "float32.logits_atol=x",
                                  "float32.nope=1", "bf16.logits_atol=1", "logits_atol"])
def test_bad_overrides_are_refused(item):
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.errors import PackcheckUsageError

    with pytest.raises(PackcheckUsageError, match="--packcheck-tolerance"):
        load_tolerances(None, [item], "t")


@pytest.mark.parametrize("text", ["[float32]\nlogits_atol = -1\n", "[float32]\nlogits_atol = true\n",
                                  "[float32]\nlogits_atol = 'x'\n", "[float32\n", "[float32]\nx = 1\n", "[bf16]\nlogits_atol = 1\n"])
def test_bad_tolerance_files_are_refused(tmp_path, text):
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.errors import PackcheckUsageError

    path = tmp_path / "tol.toml"
    path.write_text(text)
    with pytest.raises(PackcheckUsageError):
        load_tolerances(str(path), None, "t")
    with pytest.raises(PackcheckUsageError, match="does not exist"):
        load_tolerances(str(tmp_path / "none.toml"), None, "t")
    zero = tmp_path / "zero.toml"
    zero.write_text("[float32]\nlogits_atol = 0\n")
    assert load_tolerances(str(zero), None, "t")[0]["float32"]["logits_atol"] == 0.0
