"""The gate's rules on planted result documents (pure, no model built): one duplicate-cell rule shared with
merge, causes compared (a cell that stays red but gains a cause is a regression), and the job summary."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest

from pytest_packcheck.analysis.gate import cell_causes, compare, index_cells, merge, regressions, render_summary
from pytest_packcheck.errors import PackcheckUsageError


def _cell(cell_id="llama-sdpa-trainer-float32", check="trainer", status="pass", cause=None, **over):
    cell = {"cell_id": cell_id, "model": {"label": "llama", "spec": "arch:llama"}, "backend": "sdpa", "check": check,
            "dtype": "float32", "status": status, "metrics": {"max_loss_delta": 3.2e-1 if status == "fail" else 1e-7},
            "message": "ok" if status == "pass" else "packed run differs from the padded reference at every step",
            "tolerances": {"train_loss_atol": 2e-5}, "cause": cause}
    if cause:
        cell["diagnosis"] = {"cause": cause, "remedy": "set use_cache=False in the model config", "findings": [],
                             "known_faults": ["trainer-keeps-use-cache"]}
    cell = {**cell, **over}
    from pytest_packcheck.checks.registry import SPECS

    spec = SPECS.get(cell["check"])
    if cell["status"] == "pass" and spec and spec.key_metric and spec.key_metric[0] not in cell["metrics"]:
        cell["metrics"] = {**cell["metrics"], spec.key_metric[0]: 1e-7}  # a pass rests on its check's key number
    return cell


def _doc(cells, transformers="5.24.0"):
    return {"schema_version": 2, "environment": {"transformers": transformers, "trl": "1.16.0", "torch": "2.13.0+cpu"},
            "settings": {"models": ["arch:llama"], "backends": ["sdpa"], "checks": ["trainer"], "dtypes": ["float32"]},
            "cells": cells}


def test_a_cell_held_twice_with_two_verdicts_is_refused_by_gate_and_merge_alike():
    base = _doc([_cell()])
    twice = _doc([_cell(status="fail", cause="leak"), _cell()])  # first fail, then pass
    with pytest.raises(PackcheckUsageError, match=r"Cell llama-sdpa-trainer-float32 is 'fail' and 'pass' in the candidate"):
        compare(base, twice)
    with pytest.raises(PackcheckUsageError, match=r"Cell llama-sdpa-trainer-float32 is 'fail' and 'pass' in the baseline"):
        compare(twice, base)
    with pytest.raises(PackcheckUsageError, match=r"is 'fail' and 'pass' in the files merged"):
        merge([twice])
    with pytest.raises(PackcheckUsageError, match=r"is 'pass' and 'fail' in the files merged"):
        merge([base, _doc([_cell(status="fail", cause="leak")])])
    # the same verdict twice (overlapping shards, a resumed run) is one cell, in both
    same = _doc([_cell(), _cell()])
    assert compare(base, same) == [] and len(merge([same, base])["cells"]) == 1
    assert list(index_cells(same["cells"], lambda c: c["cell_id"], "x")) == ["llama-sdpa-trainer-float32"]


def test_an_interrupted_runs_not_run_placeholder_yields_to_the_measured_cell_in_gate_and_merge():
    """Merging an interrupted shard with its completed rerun was refused: "Cell llama-sdpa-backend-float32 is
    'skipped' and 'pass' in the files merged: ... two verdicts" (trial 10, 245), though the skipped record is only the
    "not run (interrupted)" placeholder. In the one duplicate-cell rule it yields to a measured record, in either
    order, for merge and the gate alike; the merged matrix is then complete (every placeholder measured), and two
    measured verdicts are still refused."""
    unrun = _cell(status="skipped", metrics={"not_run": "interrupted"}, message="not run: the run was interrupted")
    other = _cell(cell_id="llama-sdpa-isolation-float32", check="isolation")
    stopped, rerun = _doc([other, unrun]), _doc([other, _cell()])
    stopped["incomplete"] = {"reason": "the run was interrupted", "cells": 1, "resume": "rerun with --packcheck-resume"}
    for docs in ([stopped, rerun], [rerun, stopped]):
        merged = merge(docs, ["i2.json", "r1.json"])
        assert [c["status"] for c in merged["cells"]] == ["pass", "pass"], merged["cells"]
        assert "incomplete" not in merged  # the rerun measured every cell the interrupted shard never reached
    assert compare(_doc([_cell()]), _doc([unrun, _cell()])) == [] and compare(_doc([_cell(), unrun]), _doc([_cell()])) == []
    # a placeholder no other file measured keeps the merged matrix incomplete, as a "not run" cell
    alone = _doc([_cell(cell_id="llama-sdpa-isolation-float32", check="isolation", status="skipped",
                        metrics={"not_run": "interrupted"}), _cell()])
    alone["incomplete"] = stopped["incomplete"]
    merged = merge([alone, _doc([_cell()])], ["i2.json", "r1.json"])
    assert merged["incomplete"]["reason"] == "the run was interrupted (i2.json)"
    with pytest.raises(PackcheckUsageError, match=r"is 'skipped' and 'pass' in the files merged"):  # a measured skip
        merge([_doc([_cell(status="skipped", message="needs a CUDA device")]), rerun])


def _sourced(doc, source):
    doc["settings"]["tolerance_source"] = source
    return doc


def test_merge_refuses_documents_whose_tolerances_differ_and_names_each_source_when_they_agree():
    """One matrix has one Tolerances table: two halves judged with different tolerances would show one half's
    source beside the other's values, wrong for both; the same values from two sources name both."""
    loose = _cell("opt-sdpa-trainer-float32", model={"label": "opt", "spec": "arch:opt"}, tolerances={"train_loss_atol": 10.0})
    a, b = _sourced(_doc([_cell()]), "tolerances.toml"), _sourced(_doc([loose]), "/tmp/huge.toml")
    with pytest.raises(PackcheckUsageError, match=r"^Cannot merge r1\.json and x63\.json: their float32 tolerances differ "
                       r"\(train_loss_atol 2e-05 vs 10\.0; from tolerances\.toml vs /tmp/huge\.toml\).*Rerun one audit with "
                       r"the other's tolerances \(--packcheck-tolerances\)"):
        merge([a, b], ["r1.json", "x63.json"])
    same = _sourced(_doc([_cell("opt-sdpa-trainer-float32", model={"label": "opt", "spec": "arch:opt"})]), "/tmp/copy.toml")
    assert merge([a, same])["settings"]["tolerance_source"] == "tolerances.toml; /tmp/copy.toml"
    assert merge([a, _sourced(_doc([_cell()]), "tolerances.toml")])["settings"]["tolerance_source"] == "tolerances.toml"


def test_gate_cli_refuses_a_duplicate_cell_in_one_line_exit_2(tmp_path):
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps(_doc([_cell()])))
    cand.write_text(json.dumps(_doc([_cell(status="fail", cause="leak"), _cell()])))
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "gate", "--baseline", str(base), "--candidate",
                           str(cand)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip().count("\n") == 0 and "is 'fail' and 'pass' in the candidate" in proc.stderr
    assert "No cell changed" not in proc.stdout


def test_a_red_cell_that_gains_a_cause_is_a_regression_and_one_that_loses_one_is_not():
    one = _doc([_cell(status="fail", cause="leak")])
    two = copy.deepcopy(one)
    two["cells"][0]["diagnosis"]["findings"] = [{"cause": "loss_normalisation", "remedy": "pass num_items_in_batch"}]
    gained = compare(one, two)
    assert [(c.worse, c.detail) for c in gained] == [(True, "gained cause loss_normalisation")]
    assert len(regressions(gained)) == 1
    lost = compare(two, one)
    assert [(c.worse, c.detail) for c in lost] == [(False, "lost cause loss_normalisation")] and regressions(lost) == []
    # several causes in a ``causes`` list (a cell failing for several reasons) count as well
    listed = copy.deepcopy(one)
    # the results' shape (CheckResult.causes: {"cause", "evidence"} records, primary first) and the diagnosis's
    listed["cells"][0]["causes"] = [{"cause": "leak", "evidence": {"moved": 3.1e-2}},
                                    {"cause": "wrong_positions", "evidence": {"max_abs_diff": 5.45e-1}}]
    assert [c.detail for c in regressions(compare(one, listed))] == ["gained cause wrong_positions"]
    diagnosed = copy.deepcopy(one)
    diagnosed["cells"][0]["diagnosis"]["causes"] = [{"cause": "leak", "remedy": "x"}, {"cause": "boundary_labels", "remedy": "y"}]
    assert [c.detail for c in regressions(compare(one, diagnosed))] == ["gained cause boundary_labels"]
    assert cell_causes({**one["cells"][0], "causes": ["leak", "wrong_positions"]}) == {"leak", "wrong_positions"}
    assert compare(one, copy.deepcopy(one)) == []  # the same causes: no change
    # a status-only code (a crash is its status) is no new cause
    assert cell_causes(_cell(status="error", cause="crash")) == set()


def test_job_summary_names_the_trainer_regression_with_versions_number_cause_known_fault_and_remedy():
    base = _doc([_cell(status="fail", cause="cache_trap")], transformers="4.57.1")
    cand = _doc([_cell()], transformers="5.24.0")
    better = render_summary(compare(base, cand), base["environment"], cand["environment"])
    assert "no regression, 1 changed cell(s)" in better and "fail → pass" in better
    assert "transformers 4.57.1 → 5.24.0, trl 1.16.0" in better
    # the other way round: the regression, with its cause, known fault and remedy from the candidate's diagnosis
    worse = render_summary(compare(cand, base), cand["environment"], base["environment"])
    row = next(line for line in worse.splitlines() if line.startswith("| llama"))
    for part in ("| sdpa", "| trainer", "| transformers 5.24.0 → 4.57.1 |", "pass → fail", "loss Δ 1.0e-07 → loss Δ 3.2e-01", "cache\\_trap",
                 "trainer-keeps-use-cache", "set use\\_cache=False in the model config", "**REGRESSION**"):
        assert part in row, (part, row)
    assert worse.startswith("### packcheck gate: 1 regression(s)")
    assert render_summary([], cand["environment"], cand["environment"]).rstrip().endswith("No cell changed.")


def test_gate_summary_flag_appends_markdown_and_names_an_unwritable_file(tmp_path):
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps(_doc([_cell()], transformers="4.57.1")))
    cand.write_text(json.dumps(_doc([_cell(status="fail", cause="cache_trap")])))
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    cmd = [sys.executable, "-m", "pytest_packcheck.cli", "gate", "--baseline", str(base), "--candidate", str(cand)]
    proc = subprocess.run([*cmd, "--summary", str(summary)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n### packcheck gate: 1 regression(s)") and "cache\\_trap" in text
    proc = subprocess.run([*cmd, "--summary", str(tmp_path / "no" / "such" / "dir.md")], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "(from --summary)" in proc.stderr and "dir.md" in proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# versions checked up front, the packages the checks need, and the gate's default checks


def test_a_version_that_is_not_released_is_a_usage_error_naming_the_nearest_releases():
    from pytest_packcheck.versions.envs import parse_versions
    from pytest_packcheck.versions.releases import validate_versions

    asked: list[str] = []

    def lookup(name):
        asked.append(name)
        return {"transformers": ["4.57.0", "4.57.1", "5.23.0", "5.24.0", "5.25.0.dev0"], "trl": ["0.24.0", "1.16.0"]}[name]

    combos = parse_versions(["transformers==4.57.1,5.25.0", "trl==1.16.0"], "--versions")
    with pytest.raises(PackcheckUsageError, match=r"'transformers==5.25.0' \(from --versions\) matches no release of "
                                                  r"transformers on .*: the nearest releases are 5.23.0, 5.24.0\. "
                                                  r"Pass a released version, e.g\. transformers==5.24.0\."):
        validate_versions(combos, "--versions", lookup)
    assert asked == ["transformers"]  # stops at the first bad library; one query per library
    asked.clear()
    assert validate_versions(parse_versions(["transformers==4.57.1,5.24.0", "trl>=1.0"], "--versions"), "--versions", lookup) == []
    assert asked == ["transformers", "trl"]  # 4 combinations, 2 queries

    def offline(name):
        raise OSError("Name or service not known")

    notes = validate_versions(combos, "--versions", offline)
    assert len(notes) == 2 and "transformers versions not checked against" in notes[0]


def test_unreleased_version_stops_the_audit_before_any_environment_is_built(pytester):
    pytester.makeconftest("""
import pytest_packcheck.versions.envs as envs
import pytest_packcheck.versions.releases as releases

releases.release_versions = lambda name, timeout=20.0: ["4.57.1", "5.23.0", "5.24.0"]

def built(combo, log=None):
    raise AssertionError("an environment was built")

envs.ensure_env = built
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--packcheck-models=arch:llama", "--packcheck-attn=sdpa",
                                           "--packcheck-checks=isolation", "--packcheck-versions=transformers==4.57.1,5.25.0",
                                           f"--packcheck-report-dir={pytester.path / 'out'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'transformers==5.25.0' (from --packcheck-versions) matches no release" in result.stderr.str()
    assert "an environment was built" not in result.stdout.str() + result.stderr.str()


def test_version_environments_get_what_the_sft_checks_need():
    from pytest_packcheck.versions.envs import TRL_FLOOR, VersionCombo, _base_requirements, check_requirements, env_key

    combo = VersionCombo(("transformers==4.57.1",))
    assert check_requirements(("isolation", "trainer"), combo) == ()
    need = check_requirements(("isolation", "sft", "sft_padded"), combo)
    assert need == (TRL_FLOOR,) == ("trl>=0.19",)  # trl is installed here (the test extras); it brings datasets
    assert check_requirements(("sft",), VersionCombo(("transformers==4.57.1", "trl==0.24.0"))) == ()
    with_sft = VersionCombo(combo.requirements, need)
    assert with_sft == combo and with_sft.label == combo.label  # the label (cell ids) does not change
    assert TRL_FLOOR in _base_requirements(with_sft) and not any(r.startswith("trl") for r in _base_requirements(combo))
    assert env_key(with_sft) != env_key(combo)  # another environment in the cache


def test_an_environment_where_no_trl_fits_is_made_without_it(monkeypatch, tmp_path):
    """uv cannot resolve the TRL floor beside this transformers: the environment is made without TRL (its sft
    cells then say TRL is missing) instead of every cell being an error."""
    from pytest_packcheck.versions import envs

    made = []

    def ensure(combo, log=None):
        made.append(combo.extras)
        if combo.extras:
            raise envs.EnvError("trl>=0.19: not installable: no version fits transformers==4.44.0")
        raise envs.EnvError("stop here")  # the second attempt is what matters

    monkeypatch.setattr(envs, "ensure_env", ensure)
    settings = type("S", (), {"checks": ("sft",)})()
    run = envs.run_in_env(envs.VersionCombo(("transformers==4.44.0",)), settings, ["arch:llama"], tmp_path)
    assert made == [("trl>=0.19",), ()] and run.error == "stop here"


def test_the_header_does_not_claim_a_library_the_environment_lacks():
    from pytest_packcheck.analysis.gate import stack

    cell = _cell()
    cell["env"] = {"label": "transformers==4.57.1", "versions": {"transformers": "4.57.1"},
                   "environment": {"transformers": "4.57.1", "trl": None, "torch": "2.13.0+cpu"}}
    env = stack(_doc([cell]))  # the controller has trl 1.16.0
    assert env["transformers"] == "4.57.1" and env["trl"] is None and env["torch"] == "2.13.0+cpu"


def test_audit_gate_runs_the_training_checks_unless_checks_are_named(monkeypatch):
    from pytest_packcheck.cli import _parser
    from pytest_packcheck.cli.audit import _pytest_args, gate_checks

    monkeypatch.delenv("PACKCHECK_CHECKS", raising=False)
    monkeypatch.delenv("PACKCHECK_AUDIT", raising=False)
    assert {"trainer", "trainer_padded", "sft", "sft_padded", "isolation"} <= set(gate_checks())
    base = ["audit", "--models", "arch:llama", "--versions", "transformers==4.57.1,5.24.0"]
    args = _pytest_args(_parser().parse_args([*base, "--gate"]))
    assert f"--packcheck-checks={','.join(gate_checks())}" in args
    assert not any(a.startswith("--packcheck-checks") for a in _pytest_args(_parser().parse_args(base)))
    named = _pytest_args(_parser().parse_args([*base, "--gate", "--packcheck-checks", "isolation"]))
    assert [a for a in named if a.startswith("--packcheck-checks")] == ["--packcheck-checks=isolation"]
    monkeypatch.setenv("PACKCHECK_CHECKS", "isolation")
    assert not any(a.startswith("--packcheck-checks") for a in _pytest_args(_parser().parse_args([*base, "--gate"])))


def test_a_baseline_cell_the_candidate_lacks_is_labelled_missing_never_better_or_neutral():
    """A candidate without a hazard cell (cells: []) labelled it "better/neutral": it was not measured."""
    from pytest_packcheck.analysis.gate import render_changes

    hazard = _cell("llama-sdpa-cache_trap-float32", check="cache_trap", status="fail", cause="cache_trap")
    base = _doc([hazard, _cell()])
    base["settings"]["checks"] = ["trainer", "cache_trap"]
    cand = {**base, "cells": []}
    changes = compare(base, cand)
    table = render_changes(changes, base["environment"], cand["environment"], markdown=False)
    summary = render_summary(changes, base["environment"], cand["environment"])
    for text in (table, summary):
        assert "neutral" not in text, text
    rows = [line for line in table.splitlines() if line.startswith("llama-")]
    assert len(rows) == 2 and all("missing" in row for row in rows), rows
    assert "REGRESSION (missing)" in table  # the pass that is gone still counts
    assert re.search(r"\| missing +\|", summary) and "**REGRESSION (missing)**" in summary


def test_a_cell_an_interrupted_candidate_never_ran_is_not_run_never_better_or_neutral():
    """Trial 9, 186: an audit stopped by SIGINT leaves its unreached cells "skipped" with ``metrics.not_run``; the
    gate labelled a baseline fail that the candidate never ran "better/neutral" (a pass was already a regression).
    Planted: the same comparison with the not_run mark dropped reads fail -> skipped as better/neutral."""
    from pytest_packcheck.analysis.gate import render_changes, verdict_label

    ids = ("llama-sdpa-trainer-float32", "opt-sdpa-trainer-float32")
    base = _doc([_cell(ids[0]), _cell(ids[1], status="fail", cause="leak", model={"label": "opt", "spec": "arch:opt"})])
    base["settings"]["models"].append("arch:opt")
    unrun = {"status": "skipped", "metrics": {"not_run": True}, "message": "not run (interrupted)", "cause": None}
    cand = _doc([{**c, **unrun} for c in base["cells"]])
    labels = {ch.after["cell_id"]: verdict_label(ch) for ch in compare(base, cand)}
    assert labels == {ids[0]: "REGRESSION (not run)", ids[1]: "not run"}, labels
    table = render_changes(compare(base, cand), base["environment"], cand["environment"], markdown=False)
    assert "neutral" not in table and "not run in the candidate (interrupted)" in table, table
    assert len(regressions(compare(base, cand))) == 1
    planted = _doc([{**c, **unrun, "metrics": {}} for c in base["cells"]])  # without the mark: an ordinary skip
    assert {verdict_label(ch) for ch in compare(base, planted)} == {"REGRESSION", "better/neutral"}


def test_gate_summary_under_a_regular_file_says_it_is_a_file(tmp_path):
    """--summary /tmp/x/afile/x.md, afile a regular file, said "its folder ... does not exist"."""
    from pytest_packcheck.analysis.gate import probe_summary

    afile = tmp_path / "afile"
    afile.write_text("x")
    for path in (afile / "x.md", afile / "deeper" / "x.md"):
        with pytest.raises(PackcheckUsageError, match=f"{afile} is a file, not a folder") as info:
            probe_summary(str(path))
        assert "does not exist" not in str(info.value)
    with pytest.raises(PackcheckUsageError, match="does not exist"):
        probe_summary(str(tmp_path / "nodir" / "x.md"))


def test_gate_and_merge_refuse_sides_measured_with_different_probe_settings(tmp_path):
    """A candidate run with --packcheck-lengths 9,5 was compared with a baseline of the default lengths (the gate only
    warned), and merge kept one file's numbers under the other's ``settings.lengths``, its warning calling the dedup
    "the union of their cells" (trial 10, 60). Files measured with different probe settings are refused by the one
    rule of differing tolerances, on the CLI with exit 2 and one line naming both values; settings that do not
    change a measurement (the per-cell timeout) still only warn."""
    base, cand = _doc([_cell()]), _doc([_cell(metrics={"max_loss_delta": 2e-7})])
    base["settings"]["lengths"], cand["settings"]["lengths"] = [17, 9, 5], [9, 5]
    cand["settings"]["report_dir"] = "elsewhere"  # incidental, as in merge
    paths = []
    for name, doc in (("base", base), ("cand", cand)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "gate", "--baseline", str(paths[0]),
                           "--candidate", str(paths[1])], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("Cannot compare the baseline and the candidate: they were measured with different probe settings "
            "(lengths [17, 9, 5] vs [9, 5])") in proc.stderr and "--packcheck-lengths" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "merge", "-o", str(tmp_path / "out"), *map(str, paths)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and not (tmp_path / "out" / "packcheck-matrix.json").exists(), proc.stderr
    assert (f"Cannot merge {paths[0]} and {paths[1]}: they were measured with different probe settings "
            "(lengths [17, 9, 5] vs [9, 5])") in proc.stderr, proc.stderr
    for key, a, b in (("sliding_window", 8, 4), ("weights", "random", "pretrained"), ("device", "cpu", "cuda")):
        one, two = _doc([_cell()]), _doc([_cell()])
        one["settings"][key], two["settings"][key] = a, b
        with pytest.raises(PackcheckUsageError, match=f"different probe settings \\({key} "):
            merge([one, two])
        with pytest.raises(PackcheckUsageError, match=f"different probe settings \\({key} "):
            compare(one, two)
    base["settings"]["lengths"] = cand["settings"]["lengths"]
    base["settings"]["timeout_s"], cand["settings"]["timeout_s"] = 600.0, 60.0
    from pytest_packcheck.analysis.gate import probe_settings_note

    assert "timeout_s 600.0 vs 60.0" in probe_settings_note(base, cand, "packcheck gate")
    assert merge([base, cand])["merged_settings_differ"] == ["timeout_s"]  # one rule with merge
    other = _doc([_cell()], transformers="4.57.1")  # another stack, another selection: what the gate compares across
    other["settings"].update(checks=["trainer", "isolation"], lengths=[9, 5], timeout_s=600.0)
    assert probe_settings_note(base, other, "packcheck gate") is None


def test_merge_warning_of_unrelated_audits_counts_what_it_kept(tmp_path):
    """The warning for files that are not shards of one audit said "the matrix shows the union of their cells" where
    14 of 28 records were dropped as one cell id held twice (trial 10, 60): it now counts the distinct cells and the
    records left out."""
    from conftest import planted_cell, planted_doc

    iso = planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0)
    one, two = planted_doc([iso]), planted_doc([iso, planted_cell("llama", "sdpa", "logits_parity", "pass", max_abs_diff_solo=0.0)])
    one["settings"]["timeout_s"], two["settings"]["timeout_s"] = 600.0, 60.0
    paths = []
    for name, doc in (("one", one), ("two", two)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "merge", "-o", str(tmp_path / "out"), *map(str, paths)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "union" not in proc.stderr, proc.stderr
    assert ("the matrix holds the 2 distinct cells of the 2 files; 1 record(s) of a cell id already held left out "
            "(one cell per id), and every command") in proc.stderr, proc.stderr


def test_gate_refuses_sides_judged_with_different_tolerances():
    """A candidate judged with float32.loss_atol=1e-12 read "2 regression(s)", exit 1, with identical stacks and the
    identical Δ on both sides (trial 6, 165), and swapped it read "better/neutral" (164): merge refuses the pair, the
    gate now too (one rule, analysis.gate._refuse_unlike_measurements)."""
    from pytest_packcheck.analysis.gate import compare
    from pytest_packcheck.errors import PackcheckUsageError

    loose, tight = _cell(tolerances={"loss_atol": 1e-4}), _cell(tolerances={"loss_atol": 1e-12})
    with pytest.raises(PackcheckUsageError, match=r"Cannot compare the baseline and the candidate: their float32 tolerances "
                                                  r"differ \(loss_atol 0.0001 vs 1e-12.*tolerance's change, not the stack's"):
        compare(_doc([loose]), _doc([tight]))
    assert compare(_doc([loose]), _doc([_cell(tolerances={"loss_atol": 1e-4})])) == []


def test_a_file_whose_cells_of_one_dtype_differ_in_tolerances_is_corrupt(tmp_path):
    """Trial 15, 54: one cell's logits_atol edited to 1.0 in a candidate: the gate took the first cell's tolerances,
    said "No cell changed", exit 0. One audit judges a dtype with one set, so such a file is refused where results
    files are read (gate, merge), naming both cells and the differing key."""
    one = {"loss_atol": 1e-4, "logits_atol": 1e-4}
    cells = [_cell(tolerances=one), _cell("gpt2-sdpa-trainer-float32", tolerances={**one, "logits_atol": 1.0})]
    proc = _run_gate(tmp_path, _doc([_cell(tolerances=one)]), _doc(cells))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert ("cells 'llama-sdpa-trainer-float32' and 'gpt2-sdpa-trainer-float32' were judged with different float32 "
            "tolerances (logits_atol 0.0001 vs 1.0)") in proc.stderr, proc.stderr
    same = _run_gate(tmp_path, _doc([_cell(tolerances=one)]), _doc([_cell(tolerances=one), _cell("gpt2-sdpa-trainer-float32", tolerances=one)]))
    assert same.returncode == 0, same.stderr


def _run_gate(tmp_path, base: dict, cand: dict) -> subprocess.CompletedProcess:
    paths = []
    for name, doc in (("base", base), ("cand", cand)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "gate", "--baseline", str(paths[0]), "--candidate",
                           str(paths[1])], capture_output=True, text=True, check=False)


def test_a_new_models_hazards_and_findings_are_not_regressions(tmp_path):
    """Adding gpt2 beside llama failed the gate with "3 regression(s)": gpt2's cache_trap and mask_trap (hazards shown)
    and its collate (a stack finding) as "fail REGRESSION new cell", while the baseline's llama showed the very same
    (trial 10, 45). A new cell whose check's role is hazard or finding is never a regression; a new correctness cell
    that is not a pass stays one. The "missing cells count as regressions" warning of an incomplete candidate is
    printed only where such a cell was counted."""
    def cells(model: str) -> list[dict]:
        return [_cell(f"{model}-sdpa-cache_trap-float32", "cache_trap", "fail", "cache_trap", model={"label": model}),
                _cell(f"{model}-sdpa-mask_trap-float32", "mask_trap", "fail", "mask_override", model={"label": model}),
                _cell(f"{model}-collate-float32", "collate", "fail", "labels_contract", model={"label": model}, backend=None),
                _cell(f"{model}-sdpa-isolation-float32", "isolation", model={"label": model})]

    base, cand = _doc(cells("llama")), _doc(cells("llama") + cells("gpt2"))
    changes = compare(base, cand)
    assert sorted(c.key[2] for c in changes) == ["cache_trap", "collate", "isolation", "mask_trap"]
    assert regressions(changes) == []
    from pytest_packcheck.analysis.gate import verdict_label

    assert {verdict_label(c) for c in changes} == {"new"}  # not "better/neutral": nothing was before
    broken = _doc(cells("llama") + cells("gpt2")[:3] + [_cell("gpt2-sdpa-isolation-float32", "isolation", "fail", "leak",
                                                              model={"label": "gpt2"})])
    assert [c.key[:3] for c in regressions(compare(base, broken))] == [("gpt2", "sdpa", "isolation")]
    proc = _run_gate(tmp_path, base, cand)
    assert proc.returncode == 0 and "0 regression(s), 4 changed cell(s)" in proc.stdout, proc.stdout + proc.stderr
    # an incomplete candidate whose not-run cells are not counted (the baseline failed them) says nothing of counting
    stopped = _doc([*cells("llama")[:3], _cell("llama-sdpa-isolation-float32", "isolation", "skipped",
                                               metrics={"not_run": "interrupted"}, model={"label": "llama"})])
    stopped["incomplete"] = {"reason": "the run was interrupted", "cells": 3}
    failing = _doc([*cells("llama")[:3], _cell("llama-sdpa-isolation-float32", "isolation", "fail", "leak",
                                               model={"label": "llama"})])
    proc = _run_gate(tmp_path, failing, stopped)
    assert proc.returncode == 0 and "count as regressions" not in proc.stderr, proc.stderr
    proc = _run_gate(tmp_path, base, stopped)  # the baseline passed it: counted, and said
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("the candidate run was incomplete (the run was interrupted); 1 of its missing or not-run cells count as "
            "regressions (they passed in the baseline)") in proc.stderr, proc.stderr


def test_baseline_cells_the_candidate_did_not_select_are_neither_changed_nor_listed(tmp_path):
    """Trial 11, 51: a candidate run on 1 of the baseline's models said "27 baseline cells not compared" and then
    "0 regression(s), 27 changed cell(s)", its table listing them as missing. They are said once (the warning) and
    neither counted nor listed; a planned cell that is missing still is (a regression where it passed)."""
    from pytest_packcheck.analysis.gate import compared

    gpt2 = {"label": "gpt2", "spec": "arch:gpt2"}
    base = _doc([_cell(), _cell("gpt2-sdpa-trainer-float32", model=gpt2), _cell("gpt2-sdpa-isolation-float32", "isolation", model=gpt2)])
    base["settings"].update(models=["arch:llama", "arch:gpt2"], checks=["trainer", "isolation"])
    cand = _doc([_cell(status="fail", cause="leak")])  # llama only
    changes = compare(base, cand)
    assert len(changes) == 3 and [c.key[0] for c in compared(changes)] == ["llama"]
    proc = _run_gate(tmp_path, base, cand)
    assert proc.returncode == 1 and "1 regression(s), 1 changed cell(s)" in proc.stdout, proc.stdout + proc.stderr
    assert "2 baseline cell(s) are not in the candidate" in proc.stderr and "gpt2" not in proc.stdout, proc.stdout


def test_a_file_without_an_environment_is_said_unrecorded_not_uninstalled():
    """Trial 15, 32 / 72: a results file with no "environment" read "torch not installed, transformers not
    installed" in the merged matrix and the gate's stack line: a claim about a stack nobody recorded."""
    from pytest_packcheck.report import render_markdown, render_terminal

    doc = _doc([_cell(model={"label": "llama", "spec": "arch:llama", "model_type": "llama", "model_class": "L"})])
    doc["environment"] = {}
    md = render_markdown(doc)
    assert "Environment not recorded (the results file has no" in md and "torch not installed" not in md
    assert "environment not recorded" in render_terminal(doc, [])[0]
    summary = render_summary([], {"transformers": "5.24.0", "torch": "2.13.0"}, {})
    assert "transformers 5.24.0 → not recorded" in summary and "torch 2.13.0 → not recorded" in summary, summary


def test_an_isolation_fail_its_own_number_contradicts_is_corrupt(tmp_path):
    """Trial 14, 53: an isolation cell edited to "fail", cause leak, with max_change 0.0 was gated as a REGRESSION
    "Δ 0.0e+00 → Δ 0.0e+00". An isolation fail means the other examples moved more than isolation_atol, so one within
    it is refused as the mirror case (a pass above it) is; a fail at a number over it is read."""
    iso = {"check": "isolation", "cell_id": "llama-sdpa-isolation-float32", "tolerances": {"isolation_atol": 1e-5}}
    base = _doc([_cell(**iso, metrics={"max_change": 0.0})])
    edited = _doc([_cell(**iso, status="fail", cause="leak", metrics={"max_change": 0.0})])
    proc = _run_gate(tmp_path, base, edited)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "fails with max_change=0, within its tolerance isolation_atol=1e-05 (a fail its own number contradicts)" in proc.stderr
    real = _doc([_cell(**iso, status="fail", cause="leak", metrics={"max_change": 0.16})])
    assert _run_gate(tmp_path, base, real).returncode == 1  # a measured leak: a regression


def test_merge_refuses_files_measured_on_different_stacks():
    """Trial 17, 69: a 5.24.0 file and one recording transformers 9.9.9 merged silently, the header naming whichever
    came first and one cell id holding one stack's numbers under the other's. merge refuses; gate compares them."""
    base, other = _doc([_cell()]), _doc([_cell("gpt2-sdpa-trainer-float32")], transformers="9.9.9")
    with pytest.raises(PackcheckUsageError, match=r"Cannot merge file 1 and file 2: they were measured on different "
                                                  r"stacks \(transformers 5.24.0 vs 9.9.9\).*packcheck gate"):
        merge([base, other])
    assert len(merge([base, _doc([_cell("gpt2-sdpa-trainer-float32")])])["cells"]) == 2  # one stack: merged
    assert compare(base, other) is not None  # the gate's job


def test_what_the_gate_counts_a_pass_stays_a_pass_and_crossing_the_tolerance_is_pass_to_fail():
    """Issue 41: the rule "a pass whose number grew by more than its tolerance" could never fire (a pass above its
    tolerance is refused on load; both sides share tolerances) and was removed. What the gate counts instead, planted:
    a pass whose loss delta grows inside the tolerance is no change; the same growth past it is a fail, and a
    pass -> fail is a regression."""
    base = _doc([_cell(metrics={"max_loss_delta": 1e-9})])
    grown = _doc([_cell(metrics={"max_loss_delta": 1.9e-5})])  # x19000, still under train_loss_atol 2e-5
    assert compare(base, grown) == []
    crossed = _doc([_cell(status="fail", cause="leak", metrics={"max_loss_delta": 3e-5})])
    changes = compare(base, crossed)
    assert [(c.baseline, c.candidate, c.worse) for c in changes] == [("pass", "fail", True)] and len(regressions(changes)) == 1
