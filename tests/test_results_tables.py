"""Schema 3 of the results JSON (issue 43, a lean tree): each model record and tolerance set kept once, in the
top-level tables ``models`` / ``tolerances`` the cells name; the loader expands them, so every reader sees the cells of
schema 2. Planted: a dangling reference, a table that is not one, two records under one label, a regression in a
schema-3 candidate gated against a schema-2 baseline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results import dumps_results
from pytest_packcheck.results.schema import SCHEMA_VERSION, TABLES, compact_document, load_document, read_results

REPO = Path(__file__).resolve().parent.parent
COMMITTED = (REPO / "reports" / "packcheck-matrix.json", REPO / "reports" / "rl" / "packcheck-matrix.json")


def _schema2(doc: dict) -> dict:
    """``doc`` (as loaded) in the shape packcheck wrote before schema 3: every cell self-contained, no tables."""
    return {**copy.deepcopy(doc), "schema_version": 2}


@pytest.mark.parametrize("path", COMMITTED, ids=["default", "rl"])
def test_the_committed_matrices_are_schema_3_and_load_to_self_contained_cells(path):
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert raw["schema_version"] == SCHEMA_VERSION == 3
    assert set(TABLES) <= set(raw) and all(isinstance(c["model"], str) and isinstance(c["tolerances"], str) for c in raw["cells"])
    doc = load_document(path)
    assert not set(TABLES) & set(doc)  # the tables are expanded and dropped: readers see schema 2's cells
    assert all(isinstance(c["model"], dict) and c["model"]["label"] and isinstance(c["tolerances"], dict) for c in doc["cells"])
    assert {c["model"]["label"] for c in doc["cells"]} == set(raw["models"])


@pytest.mark.parametrize("path", COMMITTED, ids=["default", "rl"])
def test_round_trip_gives_the_cells_schema_2_gives(path, tmp_path):
    """write (schema 3) -> load gives the cells a schema-2 file of the same document gives, field for field; the
    schema-3 text is smaller and its tables hold each record once."""
    doc = load_document(path)
    v2, v3 = tmp_path / "v2.json", tmp_path / "v3.json"
    v2.write_text(json.dumps(_schema2(doc)), encoding="utf-8")
    v3.write_text(dumps_results(doc), encoding="utf-8")
    a, b = load_document(v2), load_document(v3)
    assert a["schema_version"] == 2 and b["schema_version"] == 3  # a schema-2 file still loads, as itself
    assert json.dumps(a["cells"], sort_keys=True) == json.dumps(b["cells"], sort_keys=True)
    assert {k: v for k, v in a.items() if k != "schema_version"} == {k: v for k, v in b.items() if k != "schema_version"}
    assert read_results(v3)["cells"] == b["cells"]  # the unchecked reader of packcheck's own files agrees
    assert len(v3.read_bytes()) < 0.75 * len(json.dumps(_schema2(doc), separators=(",", ":")).encode())
    raw = json.loads(v3.read_text())
    assert len(raw["tolerances"]) == len({json.dumps(c["tolerances"], sort_keys=True) for c in doc["cells"]})
    assert dumps_results(b) == v3.read_text()  # written again: the same text (a re-render changes nothing)


def test_two_model_records_under_one_label_keep_their_own_entries():
    """Planted: a version environment's cell whose model record differs from another under the same label (another
    revision): each cell gets its own record back, not the first one's."""
    doc = load_document(COMMITTED[1])
    cells = doc["cells"]
    label = cells[0]["model"]["label"]
    other = next(i for i, c in enumerate(cells) if c["model"]["label"] == label and i > 0)
    cells[other] = {**cells[other], "model": {**cells[other]["model"], "revision": "planted-rev"}}
    small = compact_document(doc)
    assert {label, f"{label}~1"} <= set(small["models"]) and small["cells"][other]["model"] == f"{label}~1"
    assert doc["cells"][0]["model"].get("revision") != "planted-rev"  # compact_document leaves its input alone


@pytest.mark.parametrize(("plant", "says"), [
    (lambda raw: raw["cells"][3].update(model="no-such-model"),
     "names model 'no-such-model', which its \"models\" table lacks"),
    (lambda raw: raw["cells"][3].update(tolerances="t9"), "names tolerances 't9', which its \"tolerances\" table lacks"),
    (lambda raw: raw.pop("tolerances"), "names tolerances 't0', which its \"tolerances\" table lacks (0 entries)"),
    (lambda raw: raw.update(models=["llama"]), '"models" is ["llama"] (expected a JSON object of model records by key)'),
], ids=["dangling-model", "dangling-tolerances", "table-missing", "table-not-an-object"])
def test_a_dangling_reference_is_one_line_naming_the_file_the_cell_and_the_key(tmp_path, plant, says):
    raw = json.loads(COMMITTED[1].read_text(encoding="utf-8"))
    plant(raw)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw), encoding="utf-8")
    for read in (load_document, read_results):
        with pytest.raises(PackcheckUsageError) as info:
            read(bad)
        text = str(info.value)
        assert "\n" not in text and str(bad) in text and says in text
        if says.startswith("names"):  # the cell that names the missing key (the first such: cell 0 without a table)
            assert repr(raw["cells"][0 if "(0 entries)" in says else 3]["cell_id"]) in text
    gated = packcheck("gate", "--baseline", COMMITTED[1], "--candidate", bad, cwd=tmp_path)
    assert gated.returncode == 2 and says in gated.stderr and "Traceback" not in gated.stderr


def test_the_gate_compares_a_schema_2_baseline_with_a_schema_3_run(tmp_path):
    """A baseline a user saved before schema 3 against this packcheck's run: no change when the cells are the same;
    planted, a regression in the schema-3 candidate is found and named (exit 1)."""
    doc = load_document(COMMITTED[1])
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(_schema2(doc)), encoding="utf-8")
    same = packcheck("gate", "--baseline", baseline, "--candidate", COMMITTED[1], cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "No cell changed" in same.stdout and "0 regression(s), 0 changed cell(s)" in same.stdout

    cell = next(c for c in doc["cells"] if c["check"] == "isolation" and c["status"] == "pass")
    cell.update(status="fail", cause="leak", causes=[], evidence={"moved": 0.31}, message="leak across boundaries: 3.1e-01",
                metrics={**cell["metrics"], "max_change": 0.31})
    cell.pop("diagnosis", None)
    candidate = tmp_path / "candidate.json"
    candidate.write_text(dumps_results(doc), encoding="utf-8")
    assert json.loads(candidate.read_text())["schema_version"] == 3
    regressed = packcheck("gate", "--baseline", baseline, "--candidate", candidate, cwd=tmp_path)
    assert regressed.returncode == 1, regressed.stdout + regressed.stderr
    assert cell["model"]["label"] in regressed.stdout and "1 regression(s)" in regressed.stdout
