"""Counts, marks and colours follow the checks' roles (correctness / hazard / finding) in every rendering, on
planted results: a model whose correctness checks pass but whose hazards and findings fail is ✅ everywhere, with
the hazards and findings under their own marks; the headline counts matrix cells by verdict."""

from __future__ import annotations

import pytest
from conftest import planted_cell, planted_doc

_cell, _doc = planted_cell, planted_doc


def _model(label, backend="sdpa", correct=True):
    """A model on one backend: four correctness checks (a leak when not ``correct``), both hazards shown, and a
    failed collate finding with one failed contract item."""
    status, cause = ("pass", None) if correct else ("fail", "leak")
    cells = [_cell(label, backend, c, status, cause, max_change=0.0 if correct else 0.3)
             for c in ("isolation", "logits_parity", "loss_parity")] + [_cell(label, backend, "backend", "pass")]
    cells += [_cell(label, backend, "cache_trap", "fail", "cache_trap", max_abs_diff_default=0.29),
              _cell(label, backend, "mask_trap", "fail", "mask_override", max_abs_diff_with_mask=0.29)]
    collate = _cell(label, None, "collate", "fail", "labels_contract")
    collate["metrics"]["items"] = {"labels": {"status": "pass", "evidence": "-100 at all 3 example starts"},
                                   "integer_labels": {"status": "fail", "evidence": "unclear TypeError", "cause": "labels_contract"}}
    return cells + [collate]


@pytest.fixture
def doc():
    return _doc(_model("qwen3") + _model("llama") + _model("opt", correct=False))


def test_headline_counts_matrix_cells_by_verdict_not_checks(doc):
    from pytest_packcheck.report import counts_line, matrix_counts, render_markdown

    n = matrix_counts(doc["cells"])
    # 3 matrix cells (one per model on sdpa): 2 pass, 1 fail on opt; the 3 x 7 checks are counted apart
    assert dict(n["cells"]) == {"pass": 2, "fail": 1} and n["models"]["fail"] == ["opt"]
    # checks by their mark: a hazard or finding probe that showed is "hazard shown" / "stack finding", never "fail"
    assert n["hazards"] == (6, 6) and n["findings"] == (3, 3, 3)
    assert n["checks"]["fail"] == 3 and n["checks"]["hazard shown"] == 6 and n["checks"]["stack finding"] == 3
    line = counts_line(doc["cells"])
    assert line.startswith("Matrix cells (model x backend, judged by the correctness checks): ✅ pass 2, ❌ fail 1 (1 model: opt) (of 3).")
    assert "🔶 6 of 6 hazard probes" in line and "🔷 3 contract items failed in 3 of 3 finding checks" in line
    assert line in render_markdown(doc)


def test_headline_of_an_audit_with_only_a_finding_check_says_no_correctness_check_ran():
    """--packcheck-checks collate alone gave "Matrix cells (model x backend, judged by the correctness checks):  (of 0).":
    an empty count with a double space."""
    from pytest_packcheck.report import counts_line, render_markdown

    doc = _doc([c for c in _model("llama") if c["check"] == "collate"])
    for symbols in (True, False):
        line = counts_line(doc["cells"], symbols=symbols)
        assert line.startswith("Matrix cells: none judged (no correctness check ran)."), line
        assert "(of 0)" not in line and "  " not in line and "finding checks" in line
    assert counts_line(doc["cells"]) in render_markdown(doc)


def test_details_mark_a_model_by_its_correctness_checks_and_hazards_by_their_own_mark(doc):
    from pytest_packcheck.report.formats import render_details

    details = render_details(doc)
    summaries = [line for line in details.splitlines() if line.startswith("<summary>")]
    assert summaries == ["<summary>✅ pass (🔶 hazards, 🔷 stack findings) qwen3</summary>",
                         "<summary>✅ pass (🔶 hazards, 🔷 stack findings) llama</summary>",
                         "<summary>❌ fail (🔶 hazards, 🔷 stack findings) opt</summary>"]
    qwen3 = details[details.index("qwen3</summary>"):details.index("llama</summary>")]
    assert "❌" not in qwen3  # a ✅ model shows no red mark anywhere in its block
    assert "🔶 hazard shown Δ 2.9e-01" in qwen3 and "🔷 stack finding 1/2 items" in qwen3
    assert "sdpa / cache_trap (hazard), hazard shown:" in qwen3
    # a note's cause follows its message after a spaced dash (trial 19, 133: "Last output: (none)— cause: hang")
    said = [ln for ln in details.splitlines() if "cause: " in ln and ln.startswith("- ")]
    assert said and all(" — cause: " in ln and "— cause" not in ln.replace(" — cause", "") for ln in said), said


def test_markdown_findings_and_legend_use_the_role_marks(doc):
    from pytest_packcheck.report import render_markdown

    md = render_markdown(doc)
    findings = md[md.index("## Stack findings"):md.index("## Matrix")]
    assert "🔷 integer_labels" in findings and "❌" not in findings
    legend = md[md.index("## Legend"):md.index("## Details")]
    assert "- 🔶 hazard shown: a hazard probe" in legend and "- 🔷 stack finding: a contract item" in legend
    matrix = md[md.index("## Matrix"):md.index("## What to do")]
    row = {line.split("|")[1].strip(): line for line in matrix.splitlines() if line.startswith("| ")}
    assert "✅" in row["qwen3"] and "❌" not in row["qwen3"] and "❌ leak" in row["opt"]


def test_terminal_counts_cells_and_says_hazards_are_not_failures(doc):
    from pytest_packcheck.report.formats import render_terminal

    lines = render_terminal(doc, [])
    assert lines[1].startswith("Matrix cells (model x backend, judged by the correctness checks): pass 2, fail 1 (1 model: opt)")
    assert not any(line.startswith("checks: ") for line in lines)
    assert any(line.startswith("  hazard      cache trap on sdpa / float32: 3/3 models") for line in lines)
    assert any(line.startswith("  finding     collate integer_labels") for line in lines)


def test_html_panel_of_a_pass_cell_shows_hazards_in_their_own_colour_with_words(doc):
    from pytest_packcheck.report import html_data, render_html

    data = html_data(doc)
    group = data["groups"]["qwen3|sdpa|float32|"]
    css = {c["check"]: c["css"] for c in group["checks"]}
    assert css["cache_trap"] == css["mask_trap"] == "hazard" and css["isolation"] == "pass"
    assert {c["label"] for c in group["checks"] if c["check"] == "cache_trap"} == {"hazard shown"}
    assert "fail" not in css.values()  # a ✅ cell's panel has no red row
    assert group["verdict"].startswith("✅ pass")  # the panel's headline has its word too (and what a partial run covers)
    row = next(r for r in data["rows"] if r["model"] == "opt")
    assert row["cells"]["sdpa"]["text"] == "❌ fail: leak"  # a text label beside the mark
    assert next(r for r in data["rows"] if r["model"] == "qwen3")["cells"]["sdpa"]["text"] == "✅ pass (checked: isolation, logits_parity, loss_parity, backend only)"
    assert data["verdict_names"]["skipped"] == "⏭️ not checked"  # the filter's words are the cells' words
    page = render_html(doc)
    assert '<h2 id="do-not-pack">' in page and "<td>opt</td><td>sdpa</td><td>leak</td>" in page
    assert '<span class="hazard">🔶 cache trap</span> on sdpa / float32: 3/3 models' in page
    assert '<span class="finding">🔷 collate</span> integer_labels: unclear TypeError (3 models)' in page
    assert "🔶 hazard shown</span>" in page  # legend


def test_html_collapses_backends_that_ran_nothing_here():
    from pytest_packcheck.report import html_data, render_html

    cells = _model("qwen3") + [_cell("qwen3", "flash_attention_2", c, "skipped") for c in ("isolation", "logits_parity")]
    for c in cells[-2:]:
        c["message"] = "flash_attention_2 needs a CUDA device (running on cpu)"
    doc = _doc(cells)
    data = html_data(doc)
    assert data["columns"] == ["sdpa"] and "flash_attention_2" in data["collapsed"]
    assert all("flash_attention_2" not in r["cells"] for r in data["rows"])
    assert "Not run on this machine (columns left out): <b>flash_attention_2</b>: flash_attention_2 needs a CUDA device" in render_html(doc)


def test_a_planted_role_blind_mark_is_caught(doc, monkeypatch):
    """The planted fault: marks that ignore the role (every fail a red ❌) make the details of a correct model red."""
    from pytest_packcheck import report
    from pytest_packcheck.report import details
    from pytest_packcheck.results import SYMBOLS

    monkeypatch.setattr(details, "check_mark", lambda c: (SYMBOLS[c["status"]], c["status"], c["status"]))
    qwen3 = report.render_details(doc)
    qwen3 = qwen3[qwen3.index("qwen3</summary>"):qwen3.index("llama</summary>")]
    assert "❌" in qwen3  # what test_details_mark_a_model_... asserts is absent


def test_html_of_a_version_audit_charts_the_verdict_per_release_and_shows_the_gate():
    from pytest_packcheck.report import render_html

    def cell(env, status):
        c = _cell("llama", "sdpa", "trainer", status, "cache_trap" if status == "fail" else None, max_loss_delta=0.3)
        c["cell_id"] += f"@{env}"
        c["env"] = {"label": env, "requirements": [env], "versions": {"transformers": env.split("==")[1]},
                    "environment": {"torch": "2.13.0+cpu"}}
        return c

    doc = _doc([cell("transformers==5.24.0", "pass"), cell("transformers==4.57.1", "fail")])
    doc["settings"]["versions"] = ["transformers==4.57.1", "transformers==5.24.0"]
    doc["gate"] = {"baseline": "transformers==4.57.1", "candidate": "transformers==5.24.0", "changed": 1, "regressions": 0, "cells": []}
    page = render_html(doc)
    chart = page[page.index('id="releases"'):]
    # in version order, each box coloured and worded: a change of colour along the row
    assert ('<span class="fail" title="fail">transformers 4.57.1: fail</span> → '
            '<span class="pass" title="pass">transformers 5.24.0: pass</span>') in chart
    assert "✅ 0 regression(s), 1 changed cell(s): transformers==5.24.0 (candidate) against transformers==4.57.1 (baseline)" in page
    from pytest_packcheck.report import render_markdown

    assert ("**Gate: ✅ 0 regression(s), 1 changed cell(s)**, transformers==5.24.0 (candidate) against "
            "transformers==4.57.1 (baseline).") in render_markdown(doc)


def test_html_says_what_the_models_are_and_that_no_trainer_ran(doc):
    """A fresh user read a ✅ on the HTML page as covering training: the page must say, as the Markdown does, that
    the models are shrunk default configs and that no trainer check ran (and the command that runs one); once a
    trainer cell is in the document, the note goes."""
    from pytest_packcheck.report import render_html

    page = render_html(doc)
    assert "<b>Not run here: transformers&#x27; Trainer and TRL&#x27;s SFTTrainer themselves</b>" in page
    assert "<code>packcheck audit --audit training</code>" in page and "**" not in page.split("<h2>Legend")[0]
    assert page.index("Not run here") < page.index('<h2 id="do-not-pack">')
    with_trainer = _doc(doc["cells"] + [_cell("qwen3", "sdpa", "trainer", "pass")])
    assert "Not run here" not in render_html(with_trainer)


def test_an_override_the_config_has_no_key_for_is_noted_beside_the_models_verdict():
    """arch:llama{bogus_key=1} read "safe on sdpa" in the Markdown with the unread override only in the JSON's
    config_notes (trial 3, U7): the answer's line for the model now names it; other config notes stay in JSON."""
    from pytest_packcheck.report import render_markdown

    cells = _model("llama{bogus_key=1}")
    note = "override bogus_key=1 is not a key of LlamaConfig or its sub-configs: set as a new attribute"
    for c in cells:
        c["model"]["config_notes"] = [note, "num_hidden_layers 32 -> 2 (shrunk)"]
    md = render_markdown(_doc(cells + _model("qwen3")))
    line = next(ln for ln in md.splitlines() if ln.startswith("- **llama{bogus\\_key=1}**"))
    assert "safe on" in line and "note: override bogus\\_key=1 is not a key of LlamaConfig" in line
    assert "shrunk" not in line
    assert "note:" not in next(ln for ln in md.splitlines() if ln.startswith("- **qwen3**"))
    # and in every place the ✅ shows (trial 16, 227: the matrix cell, details, CSV and HTML read a bare pass)
    from pytest_packcheck.report import build_report, csvfile, render_details
    from pytest_packcheck.report.html import page_data

    matrix = md[md.index("## Matrix"):]
    assert "| ✅ (override bogus_key: not a config key) |" in matrix, matrix
    rep = build_report(_doc(cells + _model("qwen3")))
    notes = {r["model"]: r["note"] for r in csvfile.rows(rep)}
    assert notes["llama{bogus_key=1}"].startswith("override bogus_key: not a config key") and "override" not in notes["qwen3"]
    texts = {r["model"]: x["text"] for r in page_data(rep)["rows"] for x in r["cells"].values()}
    assert texts["llama{bogus_key=1}"].startswith("✅ pass: (override bogus_key: not a config key)") and "override" not in texts["qwen3"]
    details = render_details(_doc(cells + _model("qwen3")))
    block = details[details.index("llama{bogus\\_key=1}</summary>"):details.index("</details>")]
    assert "note: override bogus\\_key=1 is not a key of LlamaConfig" in block


def test_a_hazard_probe_wrong_without_the_hazard_too_is_not_hazard_shown():
    """opt / sdpa leaks, so cache_trap read "wrong with and without use_cache (default 2.71e-02, use_cache=False
    2.71e-02)": the cache made no difference, yet the details marked it 🔶 and "Checks run" counted it "hazard shown"
    while the hazards table rightly left it out (trial 4, 251). One rule (verdicts.hazard_shows) for all three."""
    from pytest_packcheck.report import matrix_counts, render_markdown
    from pytest_packcheck.report.formats import render_details
    from pytest_packcheck.report.verdicts import HAZARD_UNMEASURED, check_mark

    cells = [_cell("opt", "sdpa", c, "fail", "leak", max_change=0.3) for c in ("isolation", "logits_parity", "loss_parity")]
    cells += [_cell("opt", "sdpa", "cache_trap", "fail", "leak", max_abs_diff_default=2.71e-2, max_abs_diff_use_cache_false=2.71e-2),
              _cell("opt", "sdpa", "mask_trap", "fail", "leak", max_abs_diff_with_mask=2.71e-2, max_abs_diff_without_mask=2.71e-2)]
    doc = _doc(cells + _model("llama"))
    assert check_mark(cells[3])[1] == HAZARD_UNMEASURED and check_mark(_model("llama")[4])[1] == "hazard shown"
    n = matrix_counts(doc["cells"])
    assert n["checks"][HAZARD_UNMEASURED] == 2 and n["checks"]["hazard shown"] == 2 and n["hazards"] == (2, 2)
    details = render_details(doc)
    assert "<summary>❌ fail opt</summary>" in details and "<summary>✅ pass (🔶 hazards, 🔷 stack findings) llama</summary>" in details
    assert HAZARD_UNMEASURED in render_markdown(doc)


def test_a_trainers_padded_run_that_is_off_is_a_hazard_never_a_packing_failure():
    """Trial 9 #184 / #185: gpt2 on transformers 5.24.0, packed Trainer and SFTTrainer runs pass, only the trainers'
    own padded runs are off (loss x28/31, padded_normalisation: GPT2LMHeadModel.loss_type is None). The cell was ❌
    under "Do not pack" and the remedy named transformers >= 5.10.1 on 5.24.0. Now the padded runs are hazards
    (🔶, the cell ✅), and no remedy names a release the cell already has."""
    from pytest_packcheck.report import matrix_counts, render_html, render_markdown
    from pytest_packcheck.report.verdicts import check_mark

    padded = {"max_loss_delta": 0.6, "loss_ratio": 28 / 31, "label_tokens_shifted_over_unshifted": 28 / 31,
              "normalisation": "divides by the label count before the shift"}
    cells = [_cell("gpt2", "sdpa", "trainer", "pass", None, max_loss_delta=4.8e-07),
             _cell("gpt2", "sdpa", "sft", "pass", None, loss_delta=1e-6),
             _cell("gpt2", "sdpa", "trainer_padded", "fail", "padded_normalisation", **padded),
             _cell("gpt2", "sdpa", "sft_padded", "fail", "padded_normalisation", **padded)]
    doc = _doc(cells)
    n = matrix_counts(doc["cells"])
    assert dict(n["cells"]) == {"pass": 1} and n["hazards"] == (2, 2), n
    # a results file of the packcheck before this change records them as correctness: read as the registry says
    older = [dict(c, role="correctness") if c["check"].endswith("_padded") else c for c in doc["cells"]]
    assert matrix_counts(older) == n
    for c in doc["cells"]:
        if c["check"].endswith("_padded"):
            assert check_mark(c)[:2] == ("🔶", "hazard shown")
            assert c["diagnosis"]["known_faults"] == ["trainer-num-items-unshifted-without-causal-loss-type"]
            assert "5.10.1" not in c["diagnosis"]["remedy"] and "hand-written" in c["diagnosis"]["remedy"]
    md = render_markdown(doc)
    do_not_pack = md.split("### Do not pack", 1)[1].split("###", 1)[0]
    assert "gpt2" not in do_not_pack and "- **gpt2**: safe on sdpa (checked: trainer, sft only" in md, do_not_pack
    assert "🔶 6.0e-01 (loss x0.903)" in md and "❌" not in md.split("## Matrix", 1)[1].split("## Legend", 1)[0]
    assert ">= 5.10.1" not in md and ">= 5.10.1" not in render_html(doc)
    # on 4.57.6 the same cell is inside the fixed fault's window: its remedy, the upgrade, is the right one there
    old = _doc([dict(c, env={"label": "4.57.6", "versions": {"transformers": "4.57.6"}}) for c in cells])
    remedies = {c["diagnosis"]["remedy"] for c in old["cells"] if c["check"].endswith("_padded")}
    assert remedies and all("5.10.1" in r for r in remedies), remedies


def test_finding_checks_that_errored_are_said_to_have_measured_nothing():
    """Trial 10, 32: both collate checks errored (the model did not build: weights_mismatch) and the headline said
    "🔷 0 contract items failed in 0 of 2 finding checks", the section listing the error as an item named
    "verdict". Now: "none measured: 2 finding check(s) measured nothing (2 error)", the item "not measured"."""
    from pytest_packcheck.report import counts_line, render_markdown

    cells = [c for c in _model("llama") if c["check"] != "collate"]
    cells += [_cell(m, None, "collate", "error", None, message="--packcheck-weights=pretrained: the weights files hold another model")
              for m in ("llama", "qwen3")]
    doc = _doc(cells)
    line = counts_line(doc["cells"])
    assert "Stack findings: none measured: 2 finding check(s) measured nothing (2 error)." in line, line
    assert "0 contract items failed" not in line
    md = render_markdown(doc)
    assert "💥 not measured: --packcheck-weights=pretrained" in md and "verdict:" not in md
    # beside a measured one, the count of those measured and of those that measured nothing
    mixed = _doc([*_model("llama"), _cell("qwen3", None, "collate", "error", None, message="boom")])
    assert "in 1 of 1 finding checks (facts of the library stack); 1 finding check(s) measured nothing (1 error)." in counts_line(mixed["cells"])


def test_a_backend_named_with_a_pipe_keeps_every_markdown_table_whole():
    """Trial 11, 185: `--packcheck-attn 'paged|sdpa'` (a name transformers accepts) broke the matrix and hazard tables:
    the bare pipe made 4 header cells of 3. Every Markdown table is written by report.text.github_table, which
    escapes a pipe not already escaped; every row of every table has its header's column count."""
    import re

    from pytest_packcheck.report import render_details, render_markdown

    doc = _doc(_model("llama", backend="paged|sdpa"))
    for text in (render_markdown(doc), render_details(doc)):
        tables, current = [], []
        for line in [*text.splitlines(), ""]:
            if line.startswith("|"):
                current.append(line)
            elif current:
                tables.append(current)
                current = []
        assert tables and any("paged\\|sdpa" in row for t in tables for row in t), text
        for table in tables:
            widths = {len(re.findall(r"(?<!\\)\|", row)) for row in table}
            assert len(widths) == 1, table
