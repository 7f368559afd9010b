"""packcheck gate / merge on real result documents (a small audit run once per module). The CLI runs in this process
(tests/cli_inprocess.py): the tests read its words, exit codes and files."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.analysis.gate import compare, merge, regressions
from pytest_packcheck.results.schema import SCHEMA_VERSION, read_results


@pytest.fixture(scope="module")
def baseline_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    proc = packcheck("audit", "--models", "arch:llama,arch:opt", "--packcheck-attn", "sdpa", "--packcheck-checks",
                     "isolation,logits_parity", "-n", "0", "-q", "--save-baseline", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root / "reports" / "baseline.json"


def _pretend_pass(cell):
    """A measured fail edited into a pass, its key number within tolerance and its cause gone with it (a pass its own
    record contradicts is a corrupt file: aee42b8, trial 13 #143)."""
    from pytest_packcheck.checks.registry import SPECS

    cell["status"], cell["cause"], cell["causes"], cell["evidence"] = "pass", None, [], {}
    cell.pop("diagnosis", None)
    spec = SPECS[cell["check"]]
    if spec.key_metric and spec.key_metric[0] in (cell.get("metrics") or {}):
        cell["metrics"][spec.key_metric[0]] = 0.0
    return cell


def _gate(*args):
    """``packcheck gate ARGS`` in this process (tests/cli_inprocess.py): its words and exit code."""
    return packcheck("gate", *args)


def test_same_results_pass_the_gate(baseline_path):
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(baseline_path))
    assert proc.returncode == 0 and "0 regression(s)" in proc.stdout


def test_pass_to_fail_is_a_regression_unless_allowed(baseline_path, tmp_path):
    doc = read_results(baseline_path)
    worse = copy.deepcopy(doc)
    cell = next(c for c in worse["cells"] if c["cell_id"] == "llama-sdpa-isolation-float32")
    cell["status"], cell["message"] = "fail", "leak across boundaries: 3.1e-01"
    cell["metrics"]["max_change"] = 0.31  # the number of a fail (an isolation fail within tolerance is corrupt)
    cand = tmp_path / "cand.json"
    cand.write_text(json.dumps(worse))
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(cand))
    assert proc.returncode == 1 and "REGRESSION" in proc.stdout and "llama-sdpa-isolation-float32" in proc.stdout
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(cand), "--allow", "llama-sdpa=accepted for the test")
    assert proc.returncode == 0 and "allowed: accepted for the test" in proc.stdout
    summary = tmp_path / "s.md"  # a token pasted as the reason reaches neither the table nor --summary
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(cand), "--allow", "llama-sdpa=hf_typedTOKENvalue987654",
                 "--summary", str(summary))
    assert proc.returncode == 0 and "allowed: ***" in proc.stdout
    assert "hf_typed" not in proc.stdout + proc.stderr + summary.read_text()


def test_parity_number_growing_beyond_tolerance_is_refused_as_a_pass_and_counted_as_a_fail(baseline_path, tmp_path):
    """A pass whose number grew past its tolerance contradicts itself: the gate's loader refuses it (issue 41: the
    gate's own "pass that grew by more than its tolerance" rule could never fire and was removed); written as the
    fail it is, it is a regression."""
    from pytest_packcheck.results.schema import cell_problem

    doc = read_results(baseline_path)
    worse = copy.deepcopy(doc)
    cell = next(c for c in worse["cells"] if c["cell_id"] == "llama-sdpa-logits_parity-float32")
    cell["metrics"]["max_abs_diff_solo"] += 2 * cell["tolerances"]["logits_atol"]
    assert "above its tolerance" in cell_problem(cell)
    cell.update(status="fail", cause="leak")
    assert [c.key for c in regressions(compare(doc, worse))] == [("llama", "sdpa", "logits_parity", "float32", None)]
    better = copy.deepcopy(doc)
    opt = next(c for c in better["cells"] if c["cell_id"] == "opt-sdpa-isolation-float32")
    _pretend_pass(opt)
    assert regressions(compare(doc, better)) == [] and len(compare(doc, better)) == 1


def test_gate_bad_inputs(baseline_path, tmp_path):
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema_version": 99, "cells": []}))
    proc = _gate("--baseline", str(newer), "--candidate", str(baseline_path))
    assert proc.returncode == 2 and f"schema_version 99, newer than {SCHEMA_VERSION}" in proc.stderr
    proc = _gate("--baseline", str(tmp_path / "missing.json"), "--candidate", str(baseline_path))
    assert proc.returncode == 2 and f"{tmp_path / 'missing.json'} (from --baseline) does not exist" in proc.stderr


def test_merge_shards(baseline_path):
    doc = read_results(baseline_path)
    a, b = copy.deepcopy(doc), copy.deepcopy(doc)
    a["cells"], b["cells"] = doc["cells"][:2], doc["cells"][2:]
    merged = merge([a, b])
    assert [c["cell_id"] for c in merged["cells"]] == sorted(c["cell_id"] for c in doc["cells"])
    assert "merged_settings_differ" not in merged  # shards of one audit
    b["cells"][0]["cell_id"] = a["cells"][0]["cell_id"]
    b["cells"][0]["status"] = "error" if a["cells"][0]["status"] != "error" else "pass"
    with pytest.raises(Exception, match="in the files merged"):
        merge([a, b])


def test_pytest_baseline_fails_session_after_writing_matrix(pytester, baseline_path):
    doc = read_results(baseline_path)
    cell = next(c for c in doc["cells"] if c["cell_id"] == "opt-sdpa-isolation-float32")
    _pretend_pass(cell)  # pretend opt was fine before: today's measured leak is then a regression
    base = pytester.path / "base.json"
    base.write_text(json.dumps(doc))
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama,arch:opt", "--packcheck-attn=sdpa",
                                          "--packcheck-checks=isolation", f"--packcheck-baseline={base}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*packcheck gate against*", "*opt-sdpa-isolation-float32*pass*fail*REGRESSION*", "1 regression(s)*"])
    assert (pytester.path / "reports" / "packcheck-matrix.json").exists()


def test_pytest_missing_baseline_is_usage_error(pytester, monkeypatch):
    """The error names the option the path came from (issue 28: it named the file only)."""
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", "--packcheck-baseline=nope.json", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: Results file nope.json (from --packcheck-baseline) does not exist*"])
    monkeypatch.setenv("PACKCHECK_BASELINE", "gone.json")
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: Results file gone.json (from $PACKCHECK_BASELINE) does not exist*"])


def test_shards_partition_the_models(pytester):
    ids = []
    for shard in ("1/2", "2/2"):
        result = pytester.runpytest_inprocess("--packcheck-models=arch:llama,arch:opt,arch:qwen2", "--packcheck-attn=sdpa",
                                              "--packcheck-checks=isolation", f"--packcheck-shard={shard}", "-p", "no:cacheprovider",
                                              f"--packcheck-report-dir=r{shard[0]}")
        assert result.ret in (0, 1)
        ids.append({c["cell_id"] for c in read_results(pytester.path / f"r{shard[0]}" / "packcheck-matrix.json")["cells"]})
    assert ids[0] == {"llama-sdpa-isolation-float32", "qwen2-sdpa-isolation-float32"}
    assert ids[1] == {"opt-sdpa-isolation-float32"}
    docs = [read_results(pytester.path / f"r{i}" / "packcheck-matrix.json") for i in (1, 2)]
    assert [d["settings"]["shard"] for d in docs] == [[1, 2], [2, 2]]  # recorded, so merge can tell a missing shard
    assert merge(docs[:1])["incomplete"]["reason"].startswith("shard 2 of 2 not merged") and "incomplete" not in merge(docs)


def test_missing_candidate_cell_is_a_regression_and_bad_files_are_usage_errors(baseline_path, tmp_path):
    import json

    from pytest_packcheck.analysis.gate import compare, regressions
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.results import load_document

    doc = load_document(baseline_path)
    empty = {**doc, "cells": []}
    bad = regressions(compare(doc, empty))
    passing = [c for c in doc["cells"] if c["status"] == "pass"]
    assert len(bad) == len(passing) > 0 and all(c.detail == "cell missing in candidate" for c in bad)
    assert regressions(compare(doc, empty, {passing[0]["model"]["label"]: "dropped on purpose"})) != bad
    for content, message in [({"schema_version": 1}, "no valid 'cells'"),
                             ({"schema_version": 1, "cells": [{"cell_id": "x", "model": {}, "backend": None, "check": "c",
                                                               "dtype": "float32", "status": "pass"}]}, "lacks a label")]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(content))
        with pytest.raises(PackcheckUsageError, match=message):
            load_document(path)
    with pytest.raises(PackcheckUsageError, match="is a directory"):
        load_document(tmp_path)


def test_merge_of_unrelated_audits_warns_and_keeps_every_column(baseline_path, tmp_path):
    """Two audits with other checks: the merged matrix keeps both documents' checks and commands, and
    ``packcheck merge`` warns on stderr that they are not shards of one audit."""
    doc = read_results(baseline_path)
    other = copy.deepcopy(doc)
    other["settings"]["checks"] = ["packing_content"]
    other["command"] = "packcheck audit --packcheck-checks packing_content"
    for cell in other["cells"]:
        cell["check"], cell["cell_id"], cell["role"] = "packing_content", cell["cell_id"] + "-other", "finding"
    doc["bench"] = {"profiles": ["flan"], "steps": 1, "device": "cpu", "results": [{"model": {"label": "a"}, "profile": "flan", "error": "x"}]}
    other["bench"] = {"profiles": ["orcamath"], "steps": 1, "device": "cpu", "results": [{"model": {"label": "b"}, "profile": "orcamath", "error": "y"}]}
    merged = merge([doc, other])
    assert [r["model"]["label"] for r in merged["bench"]["results"]] == ["a", "b"]  # every file's bench figures
    assert merged["bench"]["profiles"] == ["flan", "orcamath"]
    assert merged["merged_settings_differ"] == ["checks"]
    assert merged["settings"]["checks"][-1] == "packing_content" and other["command"] in merged["command"]
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (tmp_path / "b.json").write_text(json.dumps(other))
    proc = packcheck("merge", "-o", tmp_path / "out", tmp_path / "a.json", tmp_path / "b.json")
    assert proc.returncode == 0, proc.stderr
    assert "not shards of one audit" in proc.stderr and "checks" in proc.stderr


def test_audit_with_a_baseline_exits_1_on_a_regression_as_the_gate_does(tmp_path):
    """`packcheck audit --packcheck-baseline B` printed a regression and exited 0 (pytest's exit 1 for failing
    cells was read as "matrix written"). A regression now exits 1, by the gate's one rule (analysis.gate.compare):
    a correctness cell that got worse and a hazard probe that newly shows its hazard both count, in the audit as
    in `packcheck gate`; failing cells that were failing before do not."""
    run = ["audit", "--models", "arch:llama,arch:opt", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation,cache_trap",
           "-n", "0", "-q"]
    first = packcheck(*run, "--packcheck-report-dir", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    doc = read_results(tmp_path / "a" / "packcheck-matrix.json")
    cells = {c["cell_id"]: c for c in doc["cells"]}
    assert cells["opt-sdpa-isolation-float32"]["status"] == "fail" and cells["llama-sdpa-cache_trap-float32"]["status"] == "fail"
    same = tmp_path / "same.json"
    same.write_text(json.dumps(doc))
    proc = packcheck(*run, "--packcheck-report-dir", tmp_path / "b", "--packcheck-baseline", same)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr  # failing as before: no regression
    _pretend_pass(cells["opt-sdpa-isolation-float32"])  # a correctness cell that passed before
    _pretend_pass(cells["llama-sdpa-cache_trap-float32"])  # a hazard that did not show before
    base = tmp_path / "base.json"
    base.write_text(json.dumps(doc))
    proc = packcheck(*run, "--packcheck-report-dir", tmp_path / "c", "--packcheck-baseline", base)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "2 regression(s), 2 changed cell(s)" in proc.stdout
    assert "packcheck audit: 2 regression(s) against the baseline" in proc.stderr and "--packcheck-baseline" in proc.stderr
    gate = _gate("--baseline", str(base), "--candidate", str(tmp_path / "c" / "packcheck-matrix.json"))
    assert gate.returncode == 1 and "2 regression(s)" in gate.stdout + gate.stderr  # one rule: the gate agrees


def test_baseline_cells_the_candidate_did_not_select_are_named_as_not_compared(baseline_path, tmp_path):
    """`gpt2-sdpa-isolation-float32 pass -> — better/neutral (not in the candidate's selection)` and exit 0 said nothing
    else: the gate now warns that those baseline cells were not compared (the exit code is unchanged)."""
    doc = read_results(baseline_path)
    cand = copy.deepcopy(doc)
    cand["cells"] = [c for c in cand["cells"] if c["model"]["label"] != "opt"]
    cand["settings"]["models"] = ["arch:llama"]
    path = tmp_path / "cand.json"
    path.write_text(json.dumps(cand))
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(path))
    assert proc.returncode == 0, proc.stderr
    assert ("warning: 2 baseline cell(s) are not in the candidate: they were not compared "
            "(opt-sdpa-isolation-float32, opt-sdpa-logits_parity-float32)") in proc.stderr, proc.stderr


def test_a_gate_that_compares_no_cell_is_refused_naming_what_each_side_holds(baseline_path, tmp_path):
    """Baseline llama+opt against a candidate of gpt2 only: a warning that the baseline cells were not compared, then
    "0 regression(s)" and exit 0 (trial 6, 30). Nothing compared is now a usage error, one line; a candidate that
    planned the baseline's cells but lacks them still fails as regressions (missing), exit 1."""
    doc = read_results(baseline_path)
    cand = copy.deepcopy(doc)
    cand["cells"] = [c for c in cand["cells"] if c["model"]["label"] == "llama"]  # passes: new cells, no regression
    for cell in cand["cells"]:
        cell["model"] = {**cell["model"], "label": "gpt2", "spec": "arch:gpt2"}
        cell["cell_id"] = cell["cell_id"].replace("llama-", "gpt2-")
    cand["settings"]["models"] = ["arch:gpt2"]
    path = tmp_path / "cand.json"
    path.write_text(json.dumps(cand))
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(path))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("Nothing compared: no baseline cell is in the candidate's selection (baseline: 4 cell(s) of llama, opt; sdpa; "
            "isolation, logits_parity; float32; candidate: 2 cell(s) of gpt2; sdpa; isolation, logits_parity; float32)") in proc.stderr
    planned = {**doc, "cells": []}  # the baseline's selection, no cell: every pass is a missing regression
    path.write_text(json.dumps(planned))
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(path))
    assert proc.returncode == 1 and "REGRESSION (missing)" in proc.stdout, proc.stdout + proc.stderr


def test_an_empty_baseline_is_refused_by_the_gate_and_the_plugin(baseline_path, tmp_path, pytester):
    """A baseline with "cells": [] passed with 0 regressions, exit 0 (pc gate and --packcheck-baseline)."""
    doc = read_results(baseline_path)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**doc, "cells": []}))
    proc = _gate("--baseline", str(empty), "--candidate", str(baseline_path))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert f"Baseline {empty} (from --baseline) holds no cells: there is nothing to compare against" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", f"--packcheck-baseline={empty}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: Baseline {empty} (from --packcheck-baseline) holds no cells*"])


def test_a_refused_baseline_comparison_is_the_gates_only_line_in_the_plugin_and_the_audit(baseline_path, tmp_path, pytester):
    """Trial 7, 192 / 193: after "Cannot compare ... tolerances differ" / "Nothing compared ..." the plugin still printed
    "packcheck gate against base.json" and "0 regression(s), 0 changed cell(s)", the llama logits cell that went
    pass -> fail under logits_atol=0 counted as unchanged. The refusal is now the gate's only line (a usage error),
    and the matrix is still written."""
    result = pytester.runpytest_inprocess("--packcheck-models=arch:llama", "--packcheck-attn=sdpa",
                                          "--packcheck-checks=isolation,logits_parity", f"--packcheck-baseline={baseline_path}",
                                          "--packcheck-tolerance=float32.logits_atol=0", "-p", "no:cacheprovider")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    assert "Cannot compare" in out and "regression(s)" not in out and "packcheck gate against" not in out, out[-2000:]
    # on its own line, not glued to pytest's progress ("[100%]packcheck: error: ...", trial 21, 161)
    assert any(line.startswith("packcheck: error: Cannot compare") for line in result.stdout.lines), result.stdout.lines[-20:]
    assert (pytester.path / "reports" / "packcheck-matrix.json").exists()
    proc = packcheck("audit", "--models", "arch:gpt2", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation", "-n", "0",
                     "-q", "--packcheck-report-dir", tmp_path / "r", "--packcheck-baseline", baseline_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "Nothing compared" in out and "regression(s)" not in out and "packcheck gate against" not in out, out[-2000:]
    assert (tmp_path / "r" / "packcheck-matrix.json").exists()


def test_an_unwritable_summary_is_refused_before_the_comparison(baseline_path, tmp_path):
    """`--summary /proc/nope/x.md` printed the table, then exit 2 hid the regression's exit 1: refused up front."""
    doc = read_results(baseline_path)
    passed = next(c for c in doc["cells"] if c["status"] == "pass" and c["check"] != "isolation")
    passed["status"] = "fail"  # (an isolation fail needs its own number over the tolerance: trial 14, 53)
    cand = tmp_path / "cand.json"
    cand.write_text(json.dumps(doc))
    for summary, why in [("/proc/nope/x.md", "its folder /proc/nope does not exist"), (str(tmp_path), "it is a directory")]:
        proc = _gate("--baseline", str(baseline_path), "--candidate", str(cand), "--summary", summary)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert f"Cannot write the job summary '{summary}' (from --summary): {why}" in proc.stderr
    ok = tmp_path / "summary.md"
    proc = _gate("--baseline", str(baseline_path), "--candidate", str(cand), "--summary", str(ok))
    assert proc.returncode == 1 and ok.read_text()


@pytest.mark.parametrize("flag", [["--packcheck-shard={}/2"], ["--packcheck-shard", "{}/2"]])
def test_merged_shards_reproduce_as_the_whole_audit(baseline_path, flag):
    """Trial 7, 86: the merged matrix's Reproduce line was shard 1/2's command, which reruns shard 1's models
    alone. It is the audit without its shard flag (either spelling)."""
    doc = read_results(baseline_path)
    shards = []
    for i, cells in enumerate((doc["cells"][:2], doc["cells"][2:]), start=1):
        shard = copy.deepcopy(doc)
        shard["cells"], shard["settings"]["shard"] = cells, [i, 2]
        shard["command"] = " ".join(["packcheck audit --models arch:llama,arch:opt", *(w.format(i) for w in flag), "-n 0",
                                     f"--packcheck-report-dir=s{i}"])  # trial 8, 48: each shard in its own folder
        shards.append(shard)
    merged = merge(shards)
    assert merged["command"] == "packcheck audit --models arch:llama,arch:opt -n 0", merged["command"]


def test_an_empty_value_is_refused_by_every_command():
    """Trial 7, 82: `packcheck gate --summary ''` (what --summary "$GITHUB_STEP_SUMMARY" gives with the variable
    unset) wrote no summary and said nothing. One rule for every flag and argument of every command."""
    from pytest_packcheck.cli import main

    for argv, name in ((["gate", "--baseline", "b.json", "--candidate", "c.json", "--summary", ""], "--summary"),
                       (["lookup", " ", "sdpa", "4.56.2"], "MODEL_TYPE"), (["merge", "a.json", "", "-o", "m"], "FILES"),
                       (["bench", "--model", ","], "--model"),
                       (["bisect", "llama-sdpa-isolation-float32", "--good", "", "--bad", "transformers==5.24.0"], "--good")):
        proc_err = io.StringIO()
        with contextlib.redirect_stderr(proc_err):
            assert main(argv) == 2, argv
        line = proc_err.getvalue().strip()
        assert "\n" not in line and "Empty value" in line and f"for {name} (from the command line)" in line, line
        # trial 7, 182: a required flag or an argument has no default to leave it out for
        assert ("leave" in line) == (name in ("--summary", "--model")), line


def test_a_cell_without_a_message_renders_and_a_role_off_the_registry_is_refused(baseline_path, tmp_path):
    """Trial 7, 91: merge of a hand-edited file whose cells lack "message" was a KeyError traceback in the HTML
    writer. Trial 7, 94: a cell with role "villain" was merged, and rendered as a pass in the headline and "not
    checked" on the details page. A missing optional field is read as empty; a role the registry does not give
    that check is a corrupt file, one line naming the cell and the role."""
    from pytest_packcheck.cli import main

    doc = read_results(baseline_path)
    for cell in doc["cells"]:
        cell.pop("message", None)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(doc))
    assert main(["merge", str(bare), "-o", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "packcheck-matrix.html").exists()
    doc["cells"][0]["role"] = "villain"
    bad = tmp_path / "villain.json"
    bad.write_text(json.dumps(doc))
    for argv in (["merge", str(bad), "-o", str(tmp_path / "v")], ["gate", "--baseline", str(baseline_path), "--candidate", str(bad)]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(argv) == 2, argv
        line = err.getvalue().strip()
        assert "\n" not in line and f"cell '{doc['cells'][0]['cell_id']}' has role \"villain\"" in line, line


def test_a_pass_its_own_number_contradicts_is_a_corrupt_file(baseline_path, tmp_path):
    """Trial 11, 174: a hand-edited results file whose isolation "pass" holds max_change 0.5 under isolation_atol
    1e-05 was merged and rendered ✅ "safe" beside its own Δ 5.0e-01. Such a pass is a corrupt file for merge and
    gate alike (one line naming the cell, the number and the tolerance); the unedited file merges."""
    from pytest_packcheck.cli import main

    doc = read_results(baseline_path)
    cell = next(c for c in doc["cells"] if c["check"] == "isolation" and c["status"] == "pass")
    assert main(["merge", str(baseline_path), "-o", str(tmp_path / "ok")]) == 0  # planted below, not here
    cell["metrics"]["max_change"] = 0.5
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(doc))
    for argv in (["merge", str(bad), "-o", str(tmp_path / "m")], ["gate", "--baseline", str(baseline_path), "--candidate", str(bad)]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(argv) == 2, argv
        line = err.getvalue().strip()
        assert "\n" not in line and f"cell '{cell['cell_id']}' passes with max_change=0.5 above its tolerance isolation_atol=" in line, line


def test_a_contract_item_with_a_status_off_the_list_is_a_corrupt_file(tmp_path):
    """Trial 12, 67: a hand-edited collate item with status "bogus" was rendered with an empty mark. Each contract
    item is a verdict of its own: a status off the list makes the file corrupt (one line naming cell and item)."""
    from pytest_packcheck.results.schema import cell_problem

    cell = {"cell_id": "llama-collate-float32", "check": "collate", "dtype": "float32", "status": "fail", "backend": None,
            "model": {"label": "llama"}, "metrics": {"items": {"labels": {"status": "pass", "evidence": "ok"}}}}
    assert cell_problem(cell) is None
    cell["metrics"]["items"]["cu_seq_lens"] = {"status": "bogus", "evidence": "?"}
    said = cell_problem(cell)
    assert said.startswith("cell 'llama-collate-float32' has contract item 'cu_seq_lens' with status \"bogus\" (expected one of"), said


def test_a_pass_with_a_cause_or_a_failed_item_is_a_corrupt_record():
    """Trial 13, 143 / 144: a journal edited fail -> pass (sed) was resumed and gated as passes that still carried
    cause leak ("boundaries missing in 2 of 2 calls") or a failed contract item. No run writes either (0 of 47716
    passing cells of the committed reports and atlas builds): such a record is corrupt, in results files and
    journal lines alike (both read cell_problem)."""
    from pytest_packcheck.results.schema import cell_problem

    base = {"cell_id": "opt-sdpa-backend-float32", "check": "backend", "dtype": "float32", "backend": "sdpa",
            "model": {"label": "opt"}, "metrics": {}}
    assert cell_problem({**base, "status": "fail", "cause": "leak"}) is None
    said = cell_problem({**base, "status": "pass", "cause": "leak"})
    assert said == "cell 'opt-sdpa-backend-float32' passes with cause \"leak\" (a pass its own record contradicts)", said
    collate = {**base, "cell_id": "opt-collate-float32", "check": "collate", "backend": None, "cause": None,
               "metrics": {"items": {"labels": {"status": "pass"}, "integer_labels": {"status": "fail"}}}}
    assert cell_problem({**collate, "status": "fail"}) is None
    assert "passes while its contract item 'integer_labels' failed" in cell_problem({**collate, "status": "pass"})


def test_shards_are_never_merged_short_silently_nor_gated_against_each_other(baseline_path, tmp_path):
    """Trial 20: a shard file with no cells merged silently, its model gone from the matrix (148); a file without
    settings was merged under a banner saying its shard was missing while its model was in the matrix (149); shard 1
    gated against shard 2 of the same audit read every llama cell "REGRESSION (missing)" (161): shard 2 never planned
    llama, so nothing is compared."""
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.results.schema import load_document

    doc = read_results(baseline_path)

    def shard(i, model):
        out = copy.deepcopy(doc)
        out["cells"] = [c for c in doc["cells"] if c["model"]["label"] == model]
        out["settings"]["shard"] = [i, 2]
        return out

    one, two = shard(1, "llama"), shard(2, "opt")
    assert one["cells"] and two["cells"] and "incomplete" not in merge([one, two])
    empty = merge([{**one, "cells": []}, two], ["s1.json", "s2.json"])
    assert "s1.json holds no cell (shard 1 of 2: its models are not in the matrix)" in empty["incomplete"]["reason"]
    with pytest.raises(PackcheckUsageError, match="Nothing compared: no baseline cell is in the candidate's selection"):
        compare(one, two)
    assert regressions(compare(one, one)) == []  # a shard against itself is compared as before
    bare = {k: v for k, v in one.items() if k != "settings"}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    with pytest.raises(PackcheckUsageError, match='bare.json is corrupt: it has no "settings"'):
        load_document(tmp_path / "bare.json")
