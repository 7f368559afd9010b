"""The flattening collator on classification labels per release (issue 46, part 2; pytest_packcheck/atlas/labels.py,
tools/collator_labels.py): the probe on the installed transformers, the stored runs, atlas.md's table and the
lookup note. Planted: a collator that drops labels, or returns scalar labels, is recorded as such (not as the
TypeError); a release that behaves differently is its own range in the render and in the lookup note."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pytest_packcheck.atlas import kinds as K
from pytest_packcheck.atlas.kinds_render import render_kind_markdown
from pytest_packcheck.atlas.labels import labels_block, labels_markdown, labels_note, record_at, reduce_probe
from pytest_packcheck.support import block_answer

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "reports" / "atlas" / "support.json"


def _tool():
    spec = importlib.util.spec_from_file_location("_collator_labels", REPO / "tools" / "collator_labels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RAISES = {"raises": "TypeError", "message": "'int' object is not subscriptable"}
TOKEN = {"labels": [[-100, 12, 13, -100, 15]], "shape": [1, 5]}
ALL_KW = ["return_flash_attn_kwargs", "return_seq_idx", "return_position_ids", "separator_id"]


def _raw(scalar=RAISES, token=TOKEN, kwargs=ALL_KW) -> dict:
    return {"scalar": scalar, "token": token, "kwargs": kwargs}


def test_the_probe_on_the_installed_collator_records_the_type_error_and_per_token_labels_and_catches_planted_collators(monkeypatch):
    import transformers
    from transformers import DataCollatorWithFlattening

    tool = _tool()
    record = reduce_probe(tool.probe())
    assert record["scalar"]["raises"] == "TypeError" and "subscriptable" in record["scalar"]["message"]
    assert record["token"] == {"shape": [1, 5], "per_token": True, "first_masked": True}
    assert record["kwargs"] == {"return_flash_attn_kwargs": True, "return_seq_idx": True}, transformers.__version__
    real = DataCollatorWithFlattening.__call__

    def dropping(self, features, *args, **kwargs):  # planted: a collator that drops labels
        return {k: v for k, v in real(self, [{"input_ids": f["input_ids"]} for f in features], *args, **kwargs).items()
                if k != "labels"}

    monkeypatch.setattr(DataCollatorWithFlattening, "__call__", dropping)
    assert reduce_probe(tool.probe())["scalar"] == {"dropped": True}

    def scalar_ok(self, features, *args, **kwargs):  # planted: one label per example kept as given; token labels not masked
        import torch

        out = real(self, [{"input_ids": f["input_ids"]} for f in features], *args, **kwargs)
        labels = [f["labels"] for f in features]
        out["labels"] = torch.tensor([labels] if isinstance(labels[0], int) else [[x for row in labels for x in row]])
        return out

    monkeypatch.setattr(DataCollatorWithFlattening, "__call__", scalar_ok)
    planted = reduce_probe(tool.probe())
    assert planted["scalar"] == {"shape": [1, 2]}
    assert planted["token"] == {"shape": [1, 5], "per_token": True, "first_masked": False}


def test_a_release_that_behaves_differently_is_its_own_range_in_the_render_and_the_lookup_note():
    raw = {v: _raw() for v in ("4.57.6", "5.0.0", "5.1.0", "5.2.0")}
    same = labels_block(raw)
    assert [r[:2] for r in same["runs"]] == [["4.57.6", "5.2.0"]]
    raw["5.1.0"] = _raw(scalar={"shape": [1, 2], "labels": [[1, 0]]})  # planted: 5.1.0 returns the scalar labels
    block = labels_block(raw)
    assert [r[:2] for r in block["runs"]] == [["4.57.6", "5.0.0"], ["5.1.0", "5.1.0"], ["5.2.0", "5.2.0"]]
    table = "\n".join(labels_markdown(block))
    assert "| 5.1.0 | labels (1, 2) |" in table and "| 4.57.6 .. 5.0.0 | raises TypeError" in table
    assert "| 5.2.0 | raises TypeError" in table
    assert "labels (1, 2)" in labels_note(block, "5.1.0") and "raises TypeError" in labels_note(block, "5.0.0")
    assert "not probed" in labels_note(block, "5.3.0") and record_at(block, "5.3.0") is None
    # through the lookup of the committed encoders block, with the planted labels in place of the measured ones
    support = json.loads(SUPPORT.read_text())
    support["encoders"]["labels"] = block
    notes = block_answer(support, "encoders", "bert", "encoder:bert", "sdpa", "5.1.0").notes
    assert any("at 5.1.0 on scalar" in n and "labels (1, 2)" in n for n in notes), notes
    notes = block_answer(support, "encoders", "bert", "encoder:bert", "sdpa", "5.0.0").notes
    assert any("at 5.0.0 on scalar" in n and "raises TypeError" in n for n in notes), notes
    section = "\n".join(render_kind_markdown(support["encoders"]))
    assert "| 5.1.0 | labels (1, 2) |" in section


def test_kwargs_and_token_masking_are_part_of_a_range():
    raw = {"4.44.2": _raw(kwargs=["return_position_ids"]), "4.45.2": _raw(),
           "4.46.3": _raw(token={"labels": [[11, 12, 13, 14, 15]], "shape": [1, 5]})}  # planted: first tokens kept
    block = labels_block(raw)
    assert len(block["runs"]) == 3
    rows = labels_markdown(block)[-3:]
    assert rows[0].endswith("| — | — |") and rows[1].endswith("| ✓ | ✓ |")
    assert "first token of each example kept" in rows[2]


def test_the_committed_encoders_block_holds_the_measured_labels_and_a_recollect_keeps_them(tmp_path):
    support = json.loads(SUPPORT.read_text())
    labels = support["encoders"].get("labels")
    if labels is None:
        pytest.fail("reports/atlas/support.json's encoders block has no labels: run tools/collator_labels.py")
    assert len(json.dumps(labels)) < 8000
    newest = labels["releases"][-1]
    assert record_at(labels, newest)["scalar"]["raises"] == "TypeError"  # 5.25.0's collator, as measured
    kept = K.collect_kind(K.KINDS["encoders"], tmp_path / "none", committed=support["encoders"])
    assert kept["labels"] == labels
