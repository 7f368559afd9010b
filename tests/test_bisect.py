"""``packcheck bisect``: the search on planted verdict sequences (no network), the release list, cell ids and specs,
the CLI with an injected index and probe, and the known-fault windows against their recorded bisect results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_packcheck.analysis import bisect as B
from pytest_packcheck.analysis import remedies as R
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.support import default_support_file

RELEASES = ["4.57.1", "4.57.2", "4.57.3", "4.57.4", "4.57.5", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0",
            "5.5.0", "5.6.0", "5.7.0", "5.8.0", "5.9.0", "5.10.1", "5.11.0", "5.12.0", "5.13.0", "5.14.1"]


def planted(holds: dict[str, bool | None]):
    """A probe that answers from a planted table and records what it was asked."""
    asked: list[str] = []

    def probe(version: str) -> B.Probe:
        asked.append(version)
        return B.Probe(version, holds[version], "planted")

    return probe, asked


def step(boundary: str, holds_before: bool) -> dict[str, bool | None]:
    from packaging.version import Version

    return {v: (Version(v) < Version(boundary)) == holds_before for v in RELEASES}


@pytest.mark.parametrize("boundary", RELEASES[1:])
def test_first_fixed_is_found_wherever_it_is(boundary):
    """bad is older: every release from the boundary on holds -> the boundary is the first fixed one."""
    probe, asked = planted(step(boundary, holds_before=False))
    res = B.bisect_releases(RELEASES, good=RELEASES[-1], bad=RELEASES[0], probe=probe)
    assert res.outcome == "found" and res.direction == "first fixed"
    assert res.first == boundary and res.last == RELEASES[RELEASES.index(boundary) - 1]
    assert asked[:2] == [RELEASES[-1], RELEASES[0]]  # endpoints first, the good one first
    assert len(asked) <= 2 + 5  # log2(21) rounded up, plus the endpoints
    assert len(set(asked)) == len(asked)  # nothing probed twice


@pytest.mark.parametrize("boundary", RELEASES[1:])
def test_first_bad_is_found_wherever_it_is(boundary):
    probe, asked = planted(step(boundary, holds_before=True))
    res = B.bisect_releases(list(reversed(RELEASES)), good=RELEASES[0], bad=RELEASES[-1], probe=probe)
    assert res.outcome == "found" and res.direction == "first bad"
    assert (res.first, res.last) == (boundary, RELEASES[RELEASES.index(boundary) - 1])
    assert len(asked) <= 7


def test_releases_outside_the_endpoints_are_never_probed():
    table = step("5.10.1", holds_before=False)
    probe, asked = planted(table)
    res = B.bisect_releases(RELEASES, good="5.12.0", bad="5.7.0", probe=probe)
    assert res.first == "5.10.1" and res.last == "5.9.0"
    assert res.releases == ["5.7.0", "5.8.0", "5.9.0", "5.10.1", "5.11.0", "5.12.0"]
    assert set(asked) <= set(res.releases)


def test_skipped_releases_are_passed_over_and_listed():
    """Releases that cannot be judged (not installable, crash) are skipped like git bisect skip: the search
    tries the next nearest one and still finds the boundary."""
    table = step("5.5.0", holds_before=False)
    unjudged = {"5.2.0", "5.3.0", "5.6.0", "5.7.0", "5.11.0"}
    for v in unjudged:
        table[v] = None
    probe, asked = planted(table)
    res = B.bisect_releases(RELEASES, good=RELEASES[-1], bad=RELEASES[0], probe=probe)
    assert res.outcome == "found" and (res.first, res.last) == ("5.5.0", "5.4.0")
    assert set(res.skipped) <= unjudged and res.skipped
    assert all(v in asked for v in res.skipped)


def test_skips_next_to_the_boundary_make_it_ambiguous():
    table = step("5.5.0", holds_before=False)
    table["5.5.0"] = table["5.4.0"] = None
    probe, _ = planted(table)
    res = B.bisect_releases(RELEASES, good=RELEASES[-1], bad=RELEASES[0], probe=probe)
    assert res.outcome == "ambiguous" and res.first is None
    assert res.candidates == ["5.4.0", "5.5.0", "5.6.0"] and res.last == "5.3.0"
    assert "5.4.0, 5.5.0 could not be judged" in res.message


@pytest.mark.parametrize(("good_holds", "bad_holds", "expected"), [
    (False, False, "the --good endpoint 5.14.1 does not hold"),
    (None, False, "the --good endpoint 5.14.1 could not be judged"),
    (True, True, "the --bad endpoint 4.57.1 holds"),
    (True, None, "the --bad endpoint 4.57.1 could not be judged"),
])
def test_endpoints_that_do_not_hold_stop_the_search(good_holds, bad_holds, expected):
    table = step("5.0.0", holds_before=False)
    table["5.14.1"], table["4.57.1"] = good_holds, bad_holds
    probe, asked = planted(table)
    res = B.bisect_releases(RELEASES, good="5.14.1", bad="4.57.1", probe=probe)
    assert res.outcome == "endpoints" and res.first is None and expected in res.message
    assert set(asked) <= {"5.14.1", "4.57.1"}  # nothing in between


def test_adjacent_endpoints_need_no_probe_between():
    probe, asked = planted({"5.9.0": False, "5.10.1": True})
    res = B.bisect_releases(["5.9.0", "5.10.1"], good="5.10.1", bad="5.9.0", probe=probe)
    assert (res.first, res.last, asked) == ("5.10.1", "5.9.0", ["5.10.1", "5.9.0"])


def test_same_version_on_both_sides_is_refused():
    with pytest.raises(ValueError, match="same version"):
        B.bisect_releases(RELEASES, "5.0.0", "5.0", lambda v: B.Probe(v, True))


# ----------------------------------------------------------------------------------------------------------------
# The package index page


def test_yanked_and_pre_releases_are_left_out():
    page = {"versions": ["5.9.0", "5.10.0", "5.10.1", "5.11.0rc1", "4.57.0"], "files": [
        {"filename": "transformers-5.9.0-py3-none-any.whl", "yanked": False},
        {"filename": "transformers-5.10.0-py3-none-any.whl", "yanked": "pushed from an old branch"},
        {"filename": "transformers-5.10.0.tar.gz", "yanked": True},
        {"filename": "transformers-5.10.1.tar.gz", "yanked": False},
        {"filename": "transformers-5.10.1-py3-none-any.whl", "yanked": False},
        {"filename": "transformers-5.11.0rc1-py3-none-any.whl", "yanked": False},
        {"filename": "transformers-4.57.0-py3-none-any.whl", "yanked": True},
        {"filename": "transformers-4.57.0.tar.gz", "yanked": False},  # one file still there: a release
    ]}
    releases, yanked = B.parse_simple_index(page)
    assert releases == ["4.57.0", "5.9.0", "5.10.1"] and yanked == ["5.10.0"]
    assert B.parse_simple_index(page, pre=True)[0] == ["4.57.0", "5.9.0", "5.10.1", "5.11.0rc1"]


def test_release_notes_link_is_text_only():
    assert B.release_notes_url("transformers", "5.10.1") == "https://github.com/huggingface/transformers/releases/tag/v5.10.1"
    assert B.release_notes_url("TRL", "0.24.0") == "https://github.com/huggingface/trl/releases/tag/v0.24.0"
    assert B.release_notes_url("somelib", "1.0") == ""


# ----------------------------------------------------------------------------------------------------------------
# Cell ids and specs


def test_cell_ids_parse_into_model_backend_check_dtype():
    ref = B.parse_cell_id("llama-sdpa-trainer-float32", "CELL")
    assert (ref.model, ref.backend, ref.check, ref.dtype) == ("arch:llama", "sdpa", "trainer", "float32")
    ref = B.parse_cell_id("xlm-roberta-packcheck_flash_ref-logits_parity-float32@transformers==5.14.1", "CELL")
    assert (ref.model, ref.backend, ref.check) == ("arch:xlm-roberta", "packcheck_flash_ref", "logits_parity")
    ref = B.parse_cell_id("llama-packing_content-float32", "CELL")
    assert (ref.model, ref.backend, ref.check) == ("arch:llama", None, "packing_content")


@pytest.mark.parametrize(("cell", "expected"), [
    ("llama-sdpa-trainer", "not a dtype"),
    ("llama-sdpa-trainr-float32", "Did you mean 'trainer'?"),
    ("llama-sdpaa-trainer-float32", "Did you mean 'sdpa'?"),
    ("sdpa-trainer-float32", "names no model"),
    ("llama", "is not model-backend-check-dtype"),
])
def test_bad_cell_ids_are_one_line_usage_errors(cell, expected):
    with pytest.raises(PackcheckUsageError) as exc:
        B.parse_cell_id(cell, "CELL")
    assert expected in str(exc.value) and "CELL" in str(exc.value) and "\n" not in str(exc.value)


def test_sides_name_the_library_that_moves_and_keep_the_rest_pinned():
    sides = B.parse_sides("transformers==5.10.1 & trl==0.24.0", "transformers==5.9.0 & trl==0.24.0")
    assert (sides.library, sides.good, sides.bad, sides.pinned) == ("transformers", "5.10.1", "5.9.0", ("trl==0.24.0",))


@pytest.mark.parametrize(("good", "bad", "expected"), [
    ("transformers>=5.10", "transformers==5.9.0", "is not one exact release"),
    ("transformers==5.10.1", "trl==0.24.0", "name different libraries"),
    ("transformers==5.10.1 & trl==0.25.0", "transformers==5.9.0 & trl==0.24.0", "differ in 2 libraries"),
    ("transformers==5.10.1", "transformers==5.10.1", "differ in no library"),
    ("transfromers==5.10.1", "transformers==5.9.0", "Did you mean 'transformers'?"),
])
def test_bad_sides_are_one_line_usage_errors(good, bad, expected):
    with pytest.raises(PackcheckUsageError) as exc:
        B.parse_sides(good, bad)
    assert expected in str(exc.value) and "\n" not in str(exc.value)


def _trainer_cell(status: str, ratio: float | None) -> dict:
    """A trainer cell as the check writes it: cause code on a failure, the padded-run normalisation as a finding."""
    padded = {"loss": [5.6], "max_loss_delta": 0.5}
    findings = []
    if ratio is not None:
        padded.update({"loss_ratio": ratio, "normalisation": "divides by the label count before the shift"})
        findings = [{"cause": "padded_normalisation", "evidence": {"loss_ratio": ratio}}]
    return {"cell_id": "llama-sdpa-trainer-float32", "model": {"label": "llama", "model_type": "llama"}, "backend": "sdpa",
            "check": "trainer", "dtype": "float32", "status": status, "message": "3 Trainer steps",
            "cause": "cache_trap" if status == "fail" else None, "evidence": {}, "findings": findings,
            "metrics": {"max_loss_delta": 9.5e-7, "padded_trainer": padded}}


def test_judge_reads_the_verdict_or_the_named_cause():
    """Default: pass holds (a finding is named in the detail). With a cause: a passing cell whose diagnosis names
    the cause as a finding does not hold (the 5.9.0 Trainer: packed run right, its padded run normalised before
    the shift)."""
    holds, detail = B.judge(_trainer_cell("pass", 28 / 31), None, False, {})
    assert holds is True and "[findings: padded_normalisation; bisect one with --cause]" in detail
    holds, detail = B.judge(_trainer_cell("pass", 28 / 31), "padded_normalisation", False, {})
    assert holds is False and "padded_normalisation" in detail
    assert B.judge(_trainer_cell("pass", None), "padded_normalisation", False, {})[0] is True
    assert B.judge(_trainer_cell("fail", 28 / 31), "cache_trap", False, {})[0] is False
    assert B.judge(_trainer_cell("fail", None), None, False, {})[0] is False
    assert B.judge(_trainer_cell("error", None), None, False, {})[0] is None
    assert B.judge(None, None, False, {})[0] is None
    unsupported = {**_trainer_cell("unsupported", None), "message": "the varlen reference needs 4.56"}
    assert B.judge(unsupported, None, False, {})[0] is None  # no verdict: skipped
    assert B.judge(unsupported, None, True, {})[0] is False  # --supported: the floor is what is bisected
    assert B.judge(_trainer_cell("fail", None), None, True, {})[0] is True


# ----------------------------------------------------------------------------------------------------------------
# The command, with the index and the probe replaced (no network, no environments)


def _index_page(versions: list[str], yanked: tuple[str, ...] = ()) -> dict:
    return {"versions": versions, "files": [{"filename": f"transformers-{v}-py3-none-any.whl", "yanked": v in yanked}
                                            for v in versions]}


@pytest.fixture
def fake_world(monkeypatch):
    """The index lists RELEASES plus a yanked 5.10.0; releases from 5.10.1 on hold, 5.3.0 cannot install."""
    from packaging.version import Version

    asked: list[str] = []
    monkeypatch.setattr(B, "fetch_index_page", lambda library: _index_page([*RELEASES, "5.10.0"], yanked=("5.10.0",)))

    def make_probe(ref, sides, out, cause=None, supported=False, log=None):
        def probe(version):
            asked.append(version)
            if version == "5.3.0":
                return B.Probe(version, None, "not judged: transformers==5.3.0: not installable", seconds=0.1)
            ok = Version(version) >= Version("5.10.1")
            return B.Probe(version, ok, "planted", "pass" if ok else "fail", "max_loss_delta 1.0e-02", 0.1, True)
        return probe

    monkeypatch.setattr(B, "cell_probe", make_probe)
    return asked


def test_cli_bisect_names_the_first_fixed_release_and_writes_json(fake_world, tmp_path, capsys):
    from pytest_packcheck.cli import main

    code = main(["bisect", "llama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1",
                 "-o", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "first fixed: transformers 5.10.1   (last bad: 5.9.0)" in out
    assert "https://github.com/huggingface/transformers/releases/tag/v5.10.1" in out
    assert "yanked, not probed: 5.10.0" in out and "5.10.0" not in fake_world
    # the progress line and the answer's header count the same releases (3 vs 1 when the header counted the endpoints)
    assert "4.57.1 .. 5.14.1: 19 releases between" in out and "(bad), 19 releases between, predicate pass" in out
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["first_fixed"] == "5.10.1" and record["last"] == "5.9.0" and record["first_bad"] is None
    assert [p["version"] for p in record["probes"]] == fake_world and len(fake_world) <= 7
    assert record["library"] == "transformers" and record["cell"] == "llama-sdpa-trainer-float32"


def test_cli_bisect_endpoints_that_do_not_hold_exit_1(fake_world, tmp_path, capsys):
    from pytest_packcheck.cli import main

    code = main(["bisect", "llama-sdpa-trainer-float32", "--good", "transformers==5.9.0", "--bad", "transformers==5.14.1",
                 "-o", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "endpoints: the --good endpoint 5.9.0 does not hold" in out
    assert fake_world == ["5.9.0"]


@pytest.mark.parametrize(("args", "expected"), [
    (["llama-sdpa-trainer-float3", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1"], "not a dtype"),
    (["llama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers>=4.57"], "is not one exact release"),
    (["llama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1", "--cause", "leek"],
     "Did you mean 'leak'?"),
    (["llama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1", "--cause", "leak",
      "--supported"], "give one"),
    (["llama-sdpa-isolation-float32", "--good", "transformers==5.10.1", "--bad", "transformers==5.12.0", "--model",
      "arch:llama{hidden_size=0}"], "Config value hidden_size=0 (in an override of model spec 'arch:llama{hidden_size=0}' from --model)"),
    # a model type no transformers we know of has: refused before the first endpoint's environment is built
    (["llama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1", "--model", "arch:nosuch"],
     "Unknown model type 'nosuch' (from --model): not a model_type of the installed transformers"),
    (["lama-sdpa-trainer-float32", "--good", "transformers==5.14.1", "--bad", "transformers==4.57.1"],
     "Did you mean 'llama'?"),
    # an endpoint the index does not have: refused naming the nearest releases, not installed and probed
    (["llama-sdpa-isolation-float32", "--good", "transformers==99.0.0", "--bad", "transformers==5.12.0"],
     "Release '99.0.0' (from --good) is not a transformers release on the package index: the nearest are 5.13.0, 5.14.1."),
    (["llama-sdpa-isolation-float32", "--good", "transformers==5.12.0", "--bad", "transformers==5.9.9"],
     "Release '5.9.9' (from --bad) is not a transformers release on the package index: the nearest are 5.8.0, 5.9.0, 5.10.0, 5.10.1."),
])
def test_cli_bisect_usage_errors_exit_2_before_any_probe(fake_world, tmp_path, capsys, args, expected):
    from pytest_packcheck.cli import main

    code = main(["bisect", *args, "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and fake_world == []


def test_a_model_type_only_an_older_release_has_is_still_bisected(tmp_path):
    """A type the installed transformers lacks but the atlas measured (an older release had it) passes: the
    endpoints may know it. One neither knows is refused."""
    from pytest_packcheck.analysis.support_file import refuse_unknown_model_type

    support = tmp_path / "support.json"
    doc = json.loads(Path(default_support_file()).read_text())
    doc["cells"]["retired_arch"] = doc["cells"]["llama"]
    support.write_text(json.dumps(doc))
    refuse_unknown_model_type("retired_arch", "--model", str(support))
    refuse_unknown_model_type("llama", "--model", str(support))
    with pytest.raises(PackcheckUsageError, match=f"nor of any release the atlas measured \\({support}\\)"):
        refuse_unknown_model_type("retired_archh", "--model", str(support))


def test_unreachable_index_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(B.INDEX_ENV_VAR, "http://127.0.0.1:9/simple")
    with pytest.raises(PackcheckUsageError, match=r"Cannot read the release list of 'transformers'.*PACKCHECK_INDEX_URL"):
        B.fetch_index_page("transformers", timeout=2)


def _gate_cell(version: str, status: str) -> dict:
    return {"cell_id": "llama-sdpa-trainer-float32", "model": {"label": "llama", "model_type": "llama", "spec": "arch:llama"},
            "backend": "sdpa", "check": "trainer", "dtype": "float32", "status": status, "message": status,
            "metrics": {"max_loss_delta": 1e-7 if status == "pass" else 3e-1},
            "tolerances": {}, **({"cause": "cache_trap"} if status == "fail" else {})}


def _gate_doc(version: str, status: str, trl: str | None = "1.16.0") -> dict:
    from pytest_packcheck.results.schema import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "environment": {"torch": "2.13.0+cpu", "transformers": version, "trl": trl},
            "settings": {"backends": ["sdpa"], "checks": ["trainer"], "models": ["arch:llama"], "dtypes": ["float32"]},
            "command": "x", "cells": [_gate_cell(version, status)]}


def test_gate_sides_move_one_library_and_pin_trl_only_where_the_check_uses_it():
    cell = _gate_cell("", "pass")
    sides, why = B.gate_sides(cell, cell, {"transformers": "5.14.1", "trl": "1.16.0"}, {"transformers": "5.9.0", "trl": "1.16.0"})
    assert (sides.library, sides.good, sides.bad, sides.pinned) == ("transformers", "5.14.1", "5.9.0", ())
    sft = {**cell, "check": "sft"}
    sides, _ = B.gate_sides(sft, sft, {"transformers": "5.14.1", "trl": "1.16.0"}, {"transformers": "5.9.0", "trl": "1.16.0"})
    assert sides.pinned == ("trl==1.16.0",) and sides.spec("5.9.0") == "transformers==5.9.0 & trl==1.16.0"
    sides, why = B.gate_sides(cell, cell, {"transformers": "5.14.1", "trl": "1.16.0"}, {"transformers": "5.9.0", "trl": "1.0.0"})
    assert sides is None and "both transformers and trl" in why


def test_gate_bisect_bisects_each_regression(fake_world, tmp_path, capsys, monkeypatch):
    from pytest_packcheck.cli import main

    monkeypatch.chdir(tmp_path)
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps(_gate_doc("5.14.1", "pass")))
    cand.write_text(json.dumps(_gate_doc("4.57.1", "fail")))
    code = main(["gate", "--baseline", str(base), "--candidate", str(cand), "--bisect", "--bisect-output-dir", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert code == 1 and "1 regression(s)" in out
    assert "first fixed: transformers 5.10.1" in out and list((tmp_path / "b").glob("*.json"))


# ----------------------------------------------------------------------------------------------------------------
# Known-fault windows against their recorded bisect results


def _fault_window_problems(fault, root: Path) -> list[str]:
    """What is wrong with one entry's window given its recorded bisect results ([] when it agrees)."""
    from packaging.specifiers import SpecifierSet

    rec = fault.bisect
    if not isinstance(rec, dict):
        return [f"{fault.id}: no [fault.bisect] table (a bisect result, or unavailable = why it cannot be bisected on CPU)"]
    if not rec.get("results"):
        return [] if len(rec.get("unavailable", "")) > 20 else [f"{fault.id}: neither results nor an 'unavailable' reason"]
    problems = []
    window = SpecifierSet(fault.versions)
    inside = lambda v: window.contains(v, prereleases=True)
    found = {"first_fixed": None, "first_bad": None}
    for name in rec["results"]:
        result = json.loads((root / name).read_text())
        if result["outcome"] != "found" or result["library"] != fault.library:
            problems.append(f"{fault.id}: {name} found no {fault.library} boundary ({result['outcome']})")
            continue
        if rec.get("measured") != result["measured"]:
            problems.append(f"{fault.id}: measured {rec.get('measured')} is not {name}'s {result['measured']}")
        if result["first_fixed"]:  # the window ends at the fix: the last bad release inside, the fix outside
            found["first_fixed"] = result["first_fixed"]
            if not (inside(result["last"]) and not inside(result["first_fixed"])):
                problems.append(f"{fault.id}: window {fault.versions} disagrees with last bad {result['last']} / first fixed {result['first_fixed']}")
            if fault.fixed_in != result["first_fixed"] or f">= {result['first_fixed']}" not in fault.remedy:
                problems.append(f"{fault.id}: fixed_in / remedy must name the exact release {result['first_fixed']}")
        else:  # the window starts at the first bad release
            found["first_bad"] = result["first_bad"]
            if not (inside(result["first_bad"]) and not inside(result["last"])):
                problems.append(f"{fault.id}: window {fault.versions} disagrees with last good {result['last']} / first bad {result['first_bad']}")
    for key, value in found.items():
        if rec.get(key) != value:
            problems.append(f"{fault.id}: recorded {key} {rec.get(key)} is not the results' {value}")
    return problems


def test_known_fault_windows_agree_with_their_recorded_bisect_results():
    from pytest_packcheck.analysis.diagnose import load_known_faults
    from pytest_packcheck.config.audits import PACKAGE_AUDIT_DIR

    faults = load_known_faults()
    problems = [p for f in faults for p in _fault_window_problems(f, PACKAGE_AUDIT_DIR.parent)]
    assert problems == []
    assert sum(1 for f in faults if f.bisect.get("results")) >= 2


def test_a_window_that_disagrees_with_its_bisect_result_is_caught(tmp_path):
    """Planted: the old trainer-num-items-before-shift window (<5.14) against a result that found 5.10.1."""
    from pytest_packcheck.analysis.diagnose import KnownFault

    result = {"outcome": "found", "library": "transformers", "first_fixed": "5.10.1", "first_bad": None, "last": "5.9.0",
              "measured": "2026-11-20"}
    (tmp_path / "r.json").write_text(json.dumps(result))
    rec = {"first_fixed": "5.10.1", "last_bad": "5.9.0", "measured": "2026-11-20", "results": ["r.json"]}
    fault = KnownFault("x", "", "s", "transformers", ">=4.46,<5.14", ("*",), ("*",), ("trainer",), "loss_normalisation",
                       "5.14", "upgrade transformers to >= 5.14", "e", rec)
    problems = _fault_window_problems(fault, tmp_path)
    assert any("disagrees with last bad 5.9.0 / first fixed 5.10.1" in p for p in problems)
    assert any("exact release 5.10.1" in p for p in problems)
    fixed = KnownFault("x", "", "s", "transformers", ">=4.46,<5.10.1", ("*",), ("*",), ("trainer",), "loss_normalisation",
                       "5.10.1", "upgrade transformers to >= 5.10.1", "e", rec)
    assert _fault_window_problems(fixed, tmp_path) == []
    wrong_record = KnownFault(*[getattr(fixed, k) for k in ("id", "upstream", "summary", "library", "versions", "architectures",
                                                              "backends", "checks", "cause", "fixed_in", "remedy", "evidence")],
                              {**rec, "first_fixed": "5.10.2"})
    assert any("recorded first_fixed 5.10.2" in p for p in _fault_window_problems(wrong_record, tmp_path))


def test_two_questions_on_one_range_keep_two_files():
    base = {"cell": "llama-sdpa-trainer-float32", "library": "transformers", "good": "5.14.1", "bad": "4.57.1"}
    names = {B.output_name({**base, "predicate": p}) for p in ("pass", "cause loss_normalisation", "supported")}
    assert len(names) == 3 and "llama-sdpa-trainer-float32--transformers-5.14.1-4.57.1" in names


# ----------------------------------------------------------------------------------------------------------------
# Verified remedies


def _failing(check: str, cause: str, remedy: str, metrics: dict, version: str = "4.51.3", label: str = "llama") -> dict:
    return {"cell_id": f"{label}-sdpa-{check}-float32", "model": {"label": label, "model_type": label, "spec": f"arch:{label}"},
            "backend": "sdpa", "check": check, "dtype": "float32", "status": "fail", "message": "fail", "metrics": metrics,
            "cause": cause, "evidence": {}, "findings": [],
            "tolerances": {}, "diagnosis": {"cause": cause, "evidence": "", "remedy": remedy, "findings": [], "known_faults": []}}


def test_remedies_are_verified_by_running_the_upgrade_or_reading_the_setting(tmp_path):
    """Planted: at 4.54 llama's isolation holds (the upgrade remedy is verified) and opt's still leaks (not
    verified, with its number); a cache trap whose use_cache=False number is within tolerance verifies the setting,
    one outside it does not."""
    from types import SimpleNamespace

    upgrade = "upgrade transformers to >= 4.54 (packed masks for eager/sdpa/flex), or use a flash backend"
    doc = {"environment": {"transformers": "4.51.3"}, "settings": {"weights": "random"}, "cells": [
        _failing("isolation", "leak", upgrade, {"max_change": 0.28}),
        _failing("isolation", "leak", upgrade, {"max_change": 0.3}, label="opt"),
        _failing("cache_trap", "cache_trap", "set use_cache=False", {"max_abs_diff_use_cache_false": 1e-7, "atol": 1e-5}),
        _failing("cache_trap", "cache_trap", "set use_cache=False", {"max_abs_diff_use_cache_false": 0.2, "atol": 1e-5}, label="opt"),
    ]}
    runs = []

    def fake_run(combo, settings, models, report_dir):
        runs.append((combo.label, models, settings.checks))
        cells = {}
        for label, status, change in (("llama", "pass", 1e-7), ("opt", "fail", 0.31)):
            cells[label] = {**_failing("isolation", "leak", "", {"max_change": change, "atol": 1e-5}, label=label),
                            "status": status, "message": "isolation", "diagnosis": None,
                            "cause": "leak" if status == "fail" else None}
        return SimpleNamespace(error=None, cells=cells, environment={"transformers": "4.54.0"})

    records = R.verify_remedies(doc, tmp_path, run=fake_run, faults=[])
    assert runs == [("transformers==4.54", ["arch:llama", "arch:opt"], ("isolation",))]  # one environment for both
    by = {(r["cell_id"], r["kind"]): r for r in records}
    assert by[("llama-sdpa-isolation-float32", "upgrade")]["verified"] is True
    opt = by[("opt-sdpa-isolation-float32", "upgrade")]
    assert opt["verified"] is False and "max_change 3.10e-01" in opt["detail"] and opt["at"] == "transformers==4.54"
    assert by[("llama-sdpa-cache_trap-float32", "setting")]["verified"] is True
    assert by[("opt-sdpa-cache_trap-float32", "setting")]["verified"] is False
    md = R.render_remedy_checks(records)
    assert "✔ verified at transformers==4.54: `llama-sdpa-isolation-float32`" in md and "2 of 4 remedies verified" in md
    assert doc["remedy_checks"] == records


def test_remedy_claims_parse_upgrades_from_diagnosis_findings_and_known_faults():
    from pytest_packcheck.analysis.diagnose import load_known_faults

    cell = _failing("trainer", "cache_trap", "set use_cache=False", {})
    cell["diagnosis"]["findings"] = [{"cause": "padded_normalisation", "evidence": "", "remedy": "compare ... baseline"}]
    cell["diagnosis"]["known_faults"] = ["trainer-num-items-before-shift", "trainer-keeps-config-use_cache"]
    claims = R.remedy_claims(cell, load_known_faults())
    upgrades = {(c["cause"], c["library"], c["version"]) for c in claims if c["kind"] == "upgrade"}
    assert upgrades == {("padded_normalisation", "transformers", "5.10.1"), ("cache_trap", "transformers", "5.0.0")}
