"""The gate's counting of new, missing, not-run and changed cells (analysis/gate.py: verdict_label, regressions,
compared, missing_note, cell_causes, the job summary's title): one synthetic document per rule, no model. These are
the tests tools/mutation.sh runs against the gate's counting (issue 41: tests that catch a broken checker)."""

from __future__ import annotations

import copy

from test_decisions import _gcell, _gdoc

from pytest_packcheck.analysis.gate import (
    UNCOMPARED,
    Change,
    cell_causes,
    compare,
    compared,
    missing_note,
    regressions,
    render_summary,
    verdict_label,
)

_KEY = ("m", "sdpa", "isolation", "float32", None)


def test_verdict_label_names_every_kind_of_change():
    """One label per rule, the regression suffix for a missing or not-run cell whose absence counts."""
    fail, passed = {"status": "fail"}, {"status": "pass"}
    not_run = {"status": "skipped", "metrics": {"not_run": True}}  # an interrupted run's placeholder
    cases = [
        (Change(_KEY, "pass", "fail", True, "", before=passed, after=fail), "REGRESSION"),
        (Change(_KEY, "pass", None, True, "cell missing in candidate", before=passed), "REGRESSION (missing)"),
        (Change(_KEY, "pass", "skipped", True, "not run", before=passed, after=not_run), "REGRESSION (not run)"),
        (Change(_KEY, "pass", "fail", True, "", "known", before=passed, after=fail), "allowed: known"),
        (Change(_KEY, "pass", None, True, "", "dropped", before=passed), "allowed: dropped (missing)"),
        (Change(_KEY, "fail", "skipped", False, "not run", before=fail, after=not_run), "not run"),
        (Change(_KEY, "fail", None, False, "cell missing in candidate", before=fail), "missing"),
        (Change(_KEY, None, "pass", False, "new cell", after=passed), "new"),
        (Change(_KEY, "fail", "pass", False, "", before=fail, after=passed), "better/neutral"),
    ]
    assert [verdict_label(ch) for ch, _ in cases] == [label for _, label in cases]


def test_regressions_count_worse_and_not_allowed_only():
    worse = Change(_KEY, "pass", "fail", True, "")
    allowed = Change(_KEY, "pass", "fail", True, "", "known")
    better = Change(_KEY, "fail", "pass", False, "")
    assert regressions([worse, allowed, better]) == [worse]


def test_new_cells_count_by_role_and_status():
    """A new correctness cell that is not a pass counts; a new pass, a new hazard shown or a new finding does not."""
    base = _gdoc(_gcell("m"))
    cand = _gdoc(_gcell("m"), _gcell("n", status="fail"), _gcell("p"), _gcell("q", check="cache_trap", status="fail"))
    changes = {c.key[0]: c for c in compare(base, cand)}
    assert set(changes) == {"n", "p", "q"} and all(c.detail == "new cell" and c.baseline is None for c in changes.values())
    assert [k for k, c in sorted(changes.items()) if c.worse] == ["n"]
    assert [verdict_label(changes[k]) for k in ("n", "p", "q")] == ["REGRESSION", "new", "new"]


def test_changed_causes_count_gained_as_worse_and_lost_as_a_change():
    """Two fails of one cell: a gained cause is worse, a lost one is a change that is not; the same causes in
    another order are no change."""
    base = _gdoc(_gcell("m", status="fail"))
    base["cells"][0]["cause"] = "leak"
    gained = copy.deepcopy(base)
    gained["cells"][0]["causes"] = [{"cause": "leak"}, {"cause": "wrong_positions"}]
    (ch,) = compare(base, gained)
    assert ch.worse and ch.detail == "gained cause wrong_positions" and verdict_label(ch) == "REGRESSION"
    lost = copy.deepcopy(gained)
    lost["cells"][0]["causes"] = []
    (ch,) = compare(gained, lost)
    assert not ch.worse and ch.detail == "lost cause wrong_positions" and verdict_label(ch) == "better/neutral"
    both = copy.deepcopy(base)
    both["cells"][0]["cause"] = "mask_override"
    (ch,) = compare(base, both)
    assert ch.worse and ch.detail == "gained cause mask_override; lost cause leak"
    assert compare(gained, copy.deepcopy(gained)) == []


def test_cell_causes_reads_every_place_a_cause_is_held():
    cell = {"cause": "leak", "causes": [{"cause": "wrong_positions"}, "mask_override"],
            "diagnosis": {"cause": "cache_trap", "causes": ["label_shift"], "findings": [{"cause": "sliding_window"}, None]},
            "findings": [{"cause": "mechanism_not_exercised"}]}
    assert cell_causes(cell) == {"leak", "wrong_positions", "mask_override", "cache_trap", "label_shift", "sliding_window",
                                 "mechanism_not_exercised"}
    assert cell_causes({"cause": "crash", "diagnosis": {"cause": "hang"}, "causes": ["backend_swap", "out_of_memory"]}) == set()
    assert cell_causes({"cause": "", "causes": [{"cause": None}, 3]}) == set()
    assert cell_causes({}) == set()


def test_cells_the_candidate_did_not_select_are_counted_apart():
    """Baseline cells outside the candidate's selection are neither compared nor regressions: compared() leaves them
    out, missing_note() counts them and names at most five."""
    settings = {"checks": ["isolation"], "backends": ["sdpa"], "dtypes": ["float32"]}
    labels = [f"m{i}" for i in range(7)]
    base = _gdoc(*(_gcell(x) for x in labels), models=[f"arch:{x}" for x in labels], **settings)
    cand = _gdoc(_gcell("m0", status="fail"), models=["arch:m0"], **settings)
    changes = compare(base, cand)
    assert len(changes) == 7 and [c.key[0] for c in compared(changes)] == ["m0"]
    assert [c.key[0] for c in regressions(changes)] == ["m0"]
    note = missing_note(changes, "packcheck gate")
    assert note.startswith("packcheck gate: warning: 6 baseline cell(s) are not in the candidate"), note
    assert "(m1-sdpa-isolation-float32, m2-sdpa-isolation-float32, m3-sdpa-isolation-float32, m4-sdpa-isolation-float32, " \
           "m5-sdpa-isolation-float32, ... (1 more))" in note, note
    assert all(c.detail == UNCOMPARED for c in changes if c.key[0] != "m0")
    assert missing_note(compared(changes), "packcheck gate") is None
    two = compare(base, _gdoc(*(_gcell(x) for x in labels[:5]), models=[f"arch:{x}" for x in labels[:5]], **settings))
    assert missing_note(two, "g") == (
        "g: warning: 2 baseline cell(s) are not in the candidate: they were not compared (m5-sdpa-isolation-float32, "
        "m6-sdpa-isolation-float32); run the candidate with the baseline's models, backends, checks and dtypes to "
        "compare them")
    # exactly five are all named; cells of a version environment are named without it
    in_env = _gdoc(*(_gcell(x, env="a") for x in labels), models=[f"arch:{x}" for x in labels], **settings)
    five = compare(in_env, _gdoc(*(_gcell(x, env="a") for x in labels[:2]), models=[f"arch:{x}" for x in labels[:2]], **settings))
    note = missing_note(five, "g")
    assert "5 baseline cell(s)" in note and "more" not in note and "m6-sdpa-isolation-float32)" in note, note
    assert "@a" not in note and "-a," not in note, note


def test_summary_title_counts_regressions_and_changed_cells():
    base = _gdoc(_gcell("m"), _gcell("n", status="fail"))
    cand = _gdoc(_gcell("m", status="fail"), _gcell("n"), _gcell("p", status="fail"))
    changes = compare(base, cand)
    title = render_summary(changes, {}, {}).splitlines()[0]
    assert title == "### packcheck gate: 2 regression(s), 3 changed cell(s)", title
    assert render_summary([], {}, {}).splitlines()[0] == "### packcheck gate: no regression, 0 changed cell(s)"
