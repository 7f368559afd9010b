"""The check registry and what a verdict means: the headline comes from correctness checks only, hazards and
stack findings are counted once per stack, departures are marked, and every rendering reads the registry."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_packcheck.checks.registry import CAUSES, CHECKS, DEFAULT_CHECKS, REGISTRY, TRAINING_CHECKS, VARIANT_CHECKS, describe

REPO = Path(__file__).resolve().parents[1]


def test_every_check_is_described_once_and_loads():
    assert len(CHECKS) == len(set(CHECKS)) == len(REGISTRY)
    for spec in REGISTRY:
        assert callable(spec.load()), spec.name
        assert set(spec.causes) <= set(CAUSES) and spec.summary
        if spec.tolerance:
            from pytest_packcheck.config.tolerances import load_tolerances

            assert spec.tolerance in load_tolerances(None, None, "test")[0]["float32"], spec.name
    from pytest_packcheck.checks.registry import SUITES, suite_checks

    assert set().union(*(suite_checks(suite) for suite in SUITES)) == set(CHECKS)
    assert {s.name for s in REGISTRY if s.role == "hazard"} == {"cache_trap", "mask_trap", "trainer_padded", "sft_padded",
                                                                 "rl_padded", *VARIANT_CHECKS}
    assert set(VARIANT_CHECKS) == {"offset_positions", "cu_seq_lens", "segment_masks"}
    assert {s.name for s in REGISTRY if s.role == "finding"} == {"collate", "collate_trl", "packing_content", "rl_trl_tree",
                                                                  "rl_trainer_config", "encoder_seq_cls", "mm_layouts",
                                                                  "mm_processor"}


def test_suites_requirements_and_the_gate_set_are_read_from_the_rows(monkeypatch):
    """Opt-in is the suite (variants, training), not "training"; what needs TRL is the rows' ``requires`` (read by
    the version environments, the fidelity check and the gate); the gate's set is the default suite plus the
    rows marked ``gate`` whose requirements are installed."""
    import importlib.util

    from pytest_packcheck.checks.registry import SPECS, SUITES, gate_checks, suite_checks

    assert set(SUITES) == {"default", "variants", "training", "rl", "stack", "stack_trainers", "backend_names",
                           "encoders", "multimodal"}
    assert set(suite_checks("training")) == set(TRAINING_CHECKS) and set(suite_checks("variants")) == set(VARIANT_CHECKS)
    assert {s.name for s in REGISTRY if s.opt_in} == {n for suite in SUITES if suite != "default" for n in suite_checks(suite)}
    assert not {s.name for s in REGISTRY if s.opt_in} & set(DEFAULT_CHECKS)
    assert {s.name for s in REGISTRY if "trl" in s.requires} == {
        "sft", "sft_padded", "sft_padding_free", "sft_strategies", "packing_content", "rl_trl_grpo", "rl_trl_rloo", "rl_trl_tree",
        "rl_trainer_config", "rl_trl_dpo", "rl_trl_kto", "rl_trl_async", "stack_trainers",
        "backend_names"}
    assert not SPECS["trainer"].requires and SPECS["trainer"].training and not SPECS["offset_positions"].training
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert gate_checks() == (*DEFAULT_CHECKS, "trainer", "trainer_padded")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "trl" else real(name, *a))
    assert gate_checks() == (*DEFAULT_CHECKS, "trainer", "trainer_padded", "sft", "sft_padded")


def test_a_row_with_an_unknown_suite_or_cause_is_refused_at_import():
    from pytest_packcheck.checks.registry import CheckSpec

    with pytest.raises(ValueError, match="unknown suite 'nightly'. Expected one of: default, variants, training, rl"):
        CheckSpec(name="x", function="parity:x", level="backend", role="correctness", summary="s", suite="nightly")
    with pytest.raises(ValueError, match=r"unknown causes \['no_such_cause'\] \(add them to checks/causes.py\)"):
        CheckSpec(name="x", function="parity:x", level="backend", role="correctness", summary="s", causes=("no_such_cause",))


def test_key_numbers_are_formatted_by_the_check_record():
    """The report's key number comes from the check's record (its key metric, or its own formatter), so no module
    outside a check names it."""
    from pytest_packcheck.checks.registry import SPECS

    assert SPECS["isolation"].key_number({"max_change": 3e-2}) == "Δ 3.0e-02"
    assert SPECS["backend"].key_number({"calls": {"sdpa": 2}, "expected_calls": 2, "dense_kernel_calls": 1}) == \
        "2/2 calls, varlen 0 / dense 1"
    assert SPECS["collate"].key_number({"items": {"a": {"status": "pass"}, "b": {"status": "fail"}}}) == "1/2 items"
    assert SPECS["sft_strategies"].key_number({"strategies": {
        "bfd": {"available": True, "steps": {"max_loss_delta": 2e-3}}, "wrapped": {"available": True, "steps": {"max_loss_delta": 9.0}}}}) == \
        "loss Δ 2.0e-03"
    assert SPECS["packing_content"].key_number({"strategies": {
        "bfd": {"available": True, "tail_starts": 2, "duplicated": 0}, "wrapped": {"available": False}}}) == "2 bfd tails, 0 dup"
    assert SPECS["cache_trap"].key_number({}) == ""


def test_settings_help_and_readme_agree_with_the_registry():
    """The docs' check table (docs/hooks.py) is what `packcheck checks --markdown` prints, and the flag's help names
    every check."""
    import importlib.util

    from pytest_packcheck.checks.listing import markdown_table
    from pytest_packcheck.config.options import OPT_CHECKS, OPTIONS

    help_text = next(o.help for o in OPTIONS if o.flag == OPT_CHECKS)
    for name, _, _, _ in describe():
        assert name in help_text
    table = markdown_table()
    assert table.count("\n") == len(REGISTRY) + 2
    spec = importlib.util.spec_from_file_location("packcheck_docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert table in hooks.checks_page()


def _cell(model: str, backend: str | None, check: str, status: str, cause: str | None = None, **metrics) -> dict:
    from pytest_packcheck.results.schema import CellResult

    c = CellResult(cell_id="-".join(x for x in (model, backend, check, "float32") if x), model={
        "label": model, "model_type": model, "model_class": "M", "revision": None}, backend=backend, check=check,
        dtype="float32", status=status, metrics=metrics, message=f"{check} {status}", cause=cause,
        evidence={"moved": 0.3} if cause else {})
    return json.loads(c.to_json())


def _doc(cells: list[dict]) -> dict:
    from pytest_packcheck.analysis.diagnose import diagnose_document

    backends = sorted({c["backend"] for c in cells if c["backend"]})
    checks = [s.name for s in REGISTRY if any(c["check"] == s.name for c in cells)]
    return diagnose_document({"schema_version": 2, "environment": {"transformers": "5.24.0", "device": "cpu"}, "command": "x",
                              "settings": {"backends": backends, "checks": checks}, "cells": cells})


def _correct(model: str, backend: str = "sdpa", cache: str = "fail", mask: str = "fail") -> list[dict]:
    cells = [_cell(model, backend, c, "pass", max_change=0.0) for c in ("isolation", "logits_parity", "loss_parity", "backend")]
    cells.append(_cell(model, backend, "cache_trap", cache, "cache_trap" if cache == "fail" else None))
    cells.append(_cell(model, backend, "mask_trap", mask, "mask_override" if mask == "fail" else None))
    return cells


def test_headline_ignores_hazards_and_names_the_cause():
    from pytest_packcheck.report import headline, render_markdown

    llama = _correct("llama")
    opt = [_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3),
           _cell("opt", "sdpa", "logits_parity", "fail", "leak"), _cell("opt", "sdpa", "backend", "pass")]
    flex = _correct("qwen2", "flex_attention") + [_cell("qwen2", "flex_attention", "grad_parity", "skipped")]
    doc = _doc(llama + opt + flex + [_cell("llama", None, "collate", "fail", "labels_contract")])
    assert headline([c for c in doc["cells"] if c["model"]["label"] == "llama" and c["backend"] == "sdpa"])["status"] == "pass"
    md = render_markdown(doc)
    matrix = md[md.index("## Matrix"):]
    row = {line.split("|")[1].strip(): line for line in matrix.splitlines() if line.startswith("| ")}
    assert "| ✅ " in row["llama"] and "cache" not in row["llama"] and "collate" not in row["llama"]
    assert "❌ leak" in row["opt"]
    assert "✅ (not checked: grad\\_parity)" in row["qwen2"] or "✅ (not checked: grad_parity)" in row["qwen2"]
    answer = md[md.index("## The answer"):md.index("## Stack")]
    assert "**opt**: **do not pack** on sdpa with this stack (leak" in answer and "**llama**: safe on sdpa" in answer
    hazards = md[md.index("## Stack hazards"):md.index("## Stack findings")]
    assert "cache trap" in hazards and "| 1/1 " in hazards  # llama on sdpa: counted once, not a model failure


def test_a_numerics_only_failure_is_not_do_not_pack_and_its_remedy_names_the_tolerance():
    """Trial #64: at logits_atol 0 a cell failing on kernel_numerics alone said "**do not pack**" beside "remedy: none
    needed: within a small multiple of the dtype tolerance". Now the answer words it as failed on the tolerance only,
    and the remedy (Remedy(when=...) on checks.registry.numerics_evidence) names the key, its value and the measured
    difference; a leak beside it is still "do not pack"."""
    from pytest_packcheck.checks.registry import numerics_evidence
    from pytest_packcheck.report import render_html, render_markdown

    cells = [_cell("llama", "eager", "isolation", "pass", max_change=0.0),
             _cell("llama", "eager", "logits_parity", "fail", "kernel_numerics", max_abs_diff_solo=8.94e-8),
             _cell("opt", "eager", "logits_parity", "fail", "leak", max_abs_diff_solo=0.3)]
    cells[1]["evidence"] = {"isolation_moved": 0.0, **numerics_evidence("logits_atol", 8.94e-8, 0.0)}
    cells[1]["causes"] = [{"cause": "kernel_numerics", "evidence": cells[1]["evidence"]}]
    doc = _doc(cells)
    fix = doc["cells"][1]["diagnosis"]["remedy"]
    assert "logits_atol = 0.0e+00" in fix and "8.9e-08" in fix and "within float rounding" in fix and "none needed" not in fix
    md = render_markdown(doc)
    answer = md[md.index("## The answer"):md.index("## Matrix")]
    assert "**llama**: fails on the tolerance only on eager" in answer and "**llama**: **do not pack**" not in answer
    assert "**opt**: **do not pack** on eager" in answer
    dont = answer[answer.index("### Do not pack"):answer.index("### Within numerics")]
    assert "**opt**" in dont and "**llama**" not in dont
    html = render_html(doc)
    table = html[html.index('id="do-not-pack"'):html.index('id="hazards"')]
    assert "<td>opt</td>" in table and "<td>llama</td>" not in table and "<b>llama</b> on eager" in table
    bf = numerics_evidence("logits_atol", 3e-5, 1e-5)  # above rounding: within 10x the tolerance
    assert not bf["below_rounding"] and bf["rounding_level"] == 2.0 ** -23


def test_a_model_departing_from_its_stack_is_marked():
    from pytest_packcheck.report import departures, render_markdown

    cells = _correct("a") + _correct("b") + _correct("c") + _correct("d", cache="pass")
    doc = _doc(cells)
    assert departures(doc["cells"]) == {("d", None, "float32", "sdpa"): ["no cache trap"]}
    md = render_markdown(doc)
    assert "✅ ⚑ no cache trap" in md and md.count("⚑ no cache trap") >= 2  # matrix and answer


def test_hazard_on_a_row_that_is_wrong_anyway_is_not_counted_as_the_hazard():
    from pytest_packcheck.report.model import hazard_rows

    cells = _correct("a") + [_cell("m", "sdpa", "cache_trap", "fail", "leak")]
    rows = hazard_rows(_doc(cells)["cells"])
    assert rows[("cache_trap", None, "float32", "sdpa")]["measured"] == ["a"]


def test_hazards_section_lists_every_hazard_check_of_the_registry():
    """Issue 28: the section rendered cache_trap / mask_trap / batch_rows only (a retyped list), so a run of the
    variant hazards alone had an empty table. Every hazard-role check of the registry gets its row."""
    from pytest_packcheck.checks.registry import REGISTRY
    from pytest_packcheck.report import render_markdown

    hazards = [s for s in REGISTRY if s.role == "hazard"]
    assert {"offset_positions", "cu_seq_lens", "segment_masks"} <= {s.name for s in hazards}
    cells = []
    for spec in hazards:
        cells += [_cell("a", "sdpa", spec.name, "fail", spec.shown_by[0]), _cell("b", "sdpa", spec.name, "pass")]
    for only in ([c for c in cells if c["check"] in ("offset_positions", "cu_seq_lens", "segment_masks")], cells):
        md = render_markdown(_doc(only))
        section = md[md.index("## Stack hazards"):md.index("## Matrix")]
        for name in {c["check"] for c in only}:
            row = next((line for line in section.splitlines() if line.startswith(f"| {name.replace('_', ' ')}: ")), None)
            assert row is not None and row.split("|")[-2].strip() == "1/2", (name, section)


def test_hazard_count_agrees_with_the_hazards_table():
    """Issue 28: the counts line counted every hazard probe that ran (a model already wrong without the hazard, a
    refused one), the table only those measured: one computation (hazard_rows) now gives both."""
    import re

    from pytest_packcheck.report import render_markdown

    cells = _correct("a") + _correct("b", cache="pass") + [
        _cell("m", "sdpa", "isolation", "fail", "leak"), _cell("m", "sdpa", "cache_trap", "fail", "leak"),
        _cell("m", "sdpa", "mask_trap", "unsupported")]
    md = render_markdown(_doc(cells))
    shown, measured = map(int, re.search(r"Hazards: \S+ (\d+) of (\d+) hazard probes", md).groups())
    section = md[md.index("## Stack hazards"):md.index("## Matrix")]
    pairs = [tuple(map(int, p)) for p in re.findall(r"\| (\d+)/(\d+) ", section)]
    assert (shown, measured) == (sum(p[0] for p in pairs), sum(p[1] for p in pairs)) == (3, 4)


def test_stack_findings_are_listed_once_per_item_with_counts():
    from pytest_packcheck.report import render_markdown

    cells = []
    for m in ("a", "b", "c"):
        c = _cell(m, None, "collate", "fail", "labels_contract")
        c["metrics"]["items"] = {"labels": {"status": "pass", "evidence": "-100 at all 3 example starts"},
                                 "integer_labels": {"status": "fail", "evidence": "unclear TypeError", "cause": "labels_contract"}}
        cells.append(c)
    md = render_markdown(_doc(cells + _correct("a")))
    findings = md[md.index("## Stack findings"):md.index("## Matrix")]
    assert findings.count("integer_labels") == 1 and "3/3 models" in findings
    assert "collate" not in md[md.index("## Matrix"):md.index("## Legend")].split("\n", 3)[2]  # no collate column


def test_schema_1_results_file_is_upgraded_and_rendered():
    """The golden version-1 file (a slice of the 0.1 default audit): roles come from the registry, cells without
    cause codes get packed_mismatch, and llama on sdpa reads ✅ with the hazards counted once."""
    from pytest_packcheck.analysis.diagnose import diagnose_document
    from pytest_packcheck.report import render_markdown
    from pytest_packcheck.results.schema import SCHEMA_VERSION, load_document

    doc = diagnose_document(load_document(REPO / "tests" / "data" / "schema-1.json"))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert {c["role"] for c in doc["cells"] if c["check"] == "cache_trap"} == {"hazard"}
    md = render_markdown(doc)
    row = next(line for line in md.splitlines() if line.startswith("| llama "))
    assert "✅" in row.split("|")[4]  # sdpa column (model, class, eager... order from settings)


def test_terminal_summary_and_gate_table_are_plain_text():
    from pytest_packcheck.analysis.gate import compare, render_changes
    from pytest_packcheck.report.formats import render_terminal

    doc = _doc(_correct("llama") + [_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3)])
    text = "\n".join(render_terminal(doc, ["x.md"]))
    assert "\\_" not in text and "hazard      cache trap on sdpa / float32: 1/1 models" in text
    worse = json.loads(json.dumps(doc))
    worse["cells"][0]["status"] = "fail"
    worse["cells"][0]["message"] = "a -> b | c"
    table = render_changes(compare(doc, worse), {}, {}, markdown=False)
    assert "REGRESSION" in table and "\\>" not in table and "\\|" not in table


def test_html_report_is_self_contained_and_holds_every_group():
    from pytest_packcheck.report import html_data, render_html

    doc = _doc(_correct("llama") + [_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3)])
    page = render_html(doc)
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    data = html_data(doc)
    assert set(data["groups"]) == {"llama|sdpa|float32|", "opt|sdpa|float32|"}
    assert data["groups"]["opt|sdpa|float32|"]["checks"][0]["cause"] == "leak"


def test_collate_items_are_checked_each_on_its_own(llama_sdpa):
    """A collator that keeps an empty example as a zero-length segment (transformers 4.56.2's behaviour, planted)
    fails the empty_example item and says what happened; every other item still holds."""
    from pytest_packcheck import checks as C
    from pytest_packcheck.model.batches import default_collator_factory

    def keeps_empty(**kwargs):
        inner = default_collator_factory(**kwargs)

        def collate(features, return_tensors="pt"):
            import torch

            batch = inner([f for f in features if f["input_ids"]], return_tensors=return_tensors)
            if any(not f["input_ids"] for f in features) and "labels" in batch and not isinstance(features[0].get("labels"), int):
                batch["labels"] = torch.cat([batch["labels"], torch.tensor([[-100]])], dim=1)
                batch["cu_seq_lens_q"] = torch.cat([batch["cu_seq_lens_q"], batch["cu_seq_lens_q"][-1:]])
            return batch

        return collate

    llama_sdpa.collator_factory = keeps_empty
    result = C.check_collate(llama_sdpa)
    items = result.metrics["items"]
    assert items["empty_example"]["status"] == "fail" and items["empty_example"]["cause"] == "empty_example"
    assert "kept, not dropped" in items["empty_example"]["evidence"] and "labels [1, 32]" in items["empty_example"]["evidence"]
    assert "cu_seq_lens_q [0, 11, 18, 31, 31]" in items["empty_example"]["evidence"]
    assert all(items[k]["status"] == "pass" for k in ("shapes", "position_ids", "labels", "cu_seq_lens", "max_length"))


@pytest.mark.slow
def test_html_report_in_a_headless_browser(tmp_path):
    """Debian's chromium loads the page, a click on a cell opens its details (checked in the DOM that chromium
    dumps after the click), and a screenshot is taken. Slow (chromium start); needs `apt-get install chromium`."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from pytest_packcheck.report import render_html

    doc = _doc(_correct("llama") + [_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3)])
    page = render_html(doc).replace(
        "render();\n</script>", "render();\ndocument.querySelector('td.cell.fail').click();\n</script>")
    path = tmp_path / "m.html"
    path.write_text(page)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120,
                         check=False).stdout
    assert 'id="details" class=""' in dom or 'id="details" class="">' in dom or "<h3>opt / sdpa / float32</h3>" in dom
    assert "<h3>opt / sdpa / float32</h3>" in dom and ">leak<" in dom
    # the panel opens over the page with a close button; every mark has its word; the summary sits above the matrix
    assert 'id="details-close"' in dom and ">❌ fail: leak<" in dom and ">✅ pass<" in dom
    assert dom.index('id="do-not-pack"') < dom.index('id="matrix"') and 'class="legend"' in dom
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1200,800", path.as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert shot.exists() and shot.stat().st_size > 1000


def test_incomplete_run_is_marked_in_every_report():
    """An interrupted run's matrix says so in the HTML and the details too, not only in the Markdown."""
    from pytest_packcheck.report import render_details, render_html, render_markdown

    doc = _doc(_correct("llama"))
    doc["incomplete"] = {"reason": "the run was interrupted", "cells": 6, "resume": "rerun with --packcheck-resume"}
    for text in (render_markdown(doc), render_details(doc), render_html(doc)):
        assert "Incomplete: the run was interrupted" in text and "after 6 cells" in text


def test_a_pass_resting_on_a_number_that_is_not_finite_is_corrupt(tmp_path):
    """A pass whose key number is NaN (or text) cannot back a verdict or a gate comparison: the file is refused."""
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.results import load_document

    doc = _doc(_correct("llama"))
    doc["cells"][0]["metrics"]["max_change"] = float("nan")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PackcheckUsageError, match="passes on max_change=NaN"):
        load_document(path)
    doc["cells"][0]["metrics"]["max_change"] = "big"
    path.write_text(json.dumps(doc))
    with pytest.raises(PackcheckUsageError, match='passes on max_change="big"'):
        load_document(path)


def test_a_pass_on_a_row_too_short_for_a_mechanism_says_so_in_every_headline():
    """Trial W5 (#214): mistral with sliding_window 4096 passed on a 31-token row; the matrix cell read a plain ✅,
    the answer "safe on sdpa" and the terminal "pass sdpa / float32: 1 model": only "What to do" named
    mechanism_not_exercised. The headline carries it (verdicts.pass_qualifier), so every format says it."""
    from pytest_packcheck.report import render_markdown, render_terminal

    gap = {"cause": "mechanism_not_exercised", "mechanism": "sliding window 4096 >= longest example 13",
           "evidence": "not exercised: sliding_window 4096 >= the longest example (13 tokens, row 31): sliding window "
                       "does not act in the probe row"}
    cells = [_cell("mistral", "sdpa", c, "pass", max_change=0.0) for c in ("isolation", "logits_parity")]
    cells[1]["findings"] = [gap]
    doc = _doc(cells)
    md = render_markdown(doc)
    qualifier = "sliding window 4096 >= longest example 13: not exercised"
    matrix = md[md.index("## Matrix"):]
    row = next(line for line in matrix.splitlines() if line.startswith("| mistral"))
    assert f"✅ ({qualifier})" in row
    answer = md[md.index("## The answer"):md.index("## Matrix")]
    assert f"on sdpa ({qualifier}): mistral" in answer and f"**mistral**: safe on sdpa ({qualifier}" in answer
    terminal = "\n".join(render_terminal(doc, []))
    assert f"pass        mistral / sdpa / float32: ({qualifier})" in terminal
    assert "pass        sdpa / float32: 1 model" not in terminal
    # a results file written before the short label: the label from the evidence line
    del cells[1]["findings"][0]["mechanism"]
    assert "✅ (sliding_window 4096 >= the longest example (13 tokens, row 31): not exercised)" in render_markdown(_doc(cells))


def test_a_variant_hazard_that_leaks_on_a_right_row_counts_as_shown_with_its_own_remedy():
    """Trial W6 (#220): cu_seq_lens without position_ids leaked on sdpa (llama, gpt2; standard row right), but the
    hazards table showed "—", the counts "7 of 10" (9 of 12 showed), the terminal no sdpa cu_seq_lens hazard, and
    the cells' remedy was "do not pack on eager/sdpa/flex" beside "safe on sdpa". A failed variant that measured
    the standard row right (metrics.standard_row_right) is the hazard showing, remedied by position_ids; one whose
    standard row is wrong stays the model's own fault."""
    from pytest_packcheck.report import render_markdown, render_terminal

    def variant(model, right):
        return _cell(model, "sdpa", "cu_seq_lens", "fail", "leak", standard_row_diff=1e-7 if right else 0.3,
                     standard_row_right=right, atol=1e-4)

    cells = [_cell(m, "sdpa", "isolation", "pass", max_change=0.0) for m in ("llama", "gpt2")]
    cells += [variant("llama", True), variant("gpt2", True), _cell("opt", "sdpa", "isolation", "fail", "leak"),
              variant("opt", False)]
    doc = _doc(cells)
    md = render_markdown(doc)
    assert "2 of 2 hazard probes showed one" in md
    section = md[md.index("## Stack hazards"):md.index("## Matrix")]
    assert "| cu seq lens: " in section and "| 2/2 " in section
    assert "- cu seq lens: also return position\\_ids from the collator" in section and "do not pack" not in section
    by = {c["model"]["label"]: c for c in doc["cells"] if c["check"] == "cu_seq_lens"}
    assert by["llama"]["diagnosis"]["remedy"].startswith("also return position_ids from the collator")
    assert by["opt"]["diagnosis"]["remedy"].startswith("do not pack")  # wrong without the variant: its own leak
    assert "  hazard      cu seq lens on sdpa / float32: 2/2 models" in render_terminal(doc, [])


def test_a_run_of_some_correctness_checks_says_once_which_the_passes_cover():
    """Trial U4 (#75b, #83): an audit of checks=["isolation"] (or pytest -k isolation) read "llama: safe on eager"
    resting on 1 of the correctness checks, the rest named nowhere. The answer and the counts line (matrix header,
    terminal) name the checks run and the ones not run, once; a full set says nothing."""
    from pytest_packcheck.checks.registry import SPECS
    from pytest_packcheck.report import render_markdown, render_terminal
    from pytest_packcheck.report.verdicts import coverage

    doc = _doc([_cell("llama", "eager", "isolation", "pass", max_change=0.0)])
    md = render_markdown(doc)
    said = "The ✅ cells cover the correctness checks run here: isolation only; not run: position_ids, logits_parity"
    answer = md[md.index("## The answer"):md.index("## Matrix")]
    assert escape(said) in answer and "cross_backend" not in coverage(doc["cells"])  # not planned on eager
    header = md[:md.index("## The answer")]
    assert said in header and md.count(escape(said)) == 1  # once
    # the per-model line a user copies carries it too (trial 13, 158: "**llama**: safe on eager.")
    assert "**llama**: safe on eager (checked: isolation only; see the note on the ✅ cells above)." in answer
    from pytest_packcheck.report import build_report, csvfile

    assert csvfile.rows(build_report(doc))[0]["note"] == "checked: isolation only"  # the CSV row too (trial 16, 145)
    from pytest_packcheck.report.html import page_data
    from pytest_packcheck.report.html import render as render_html

    # and the HTML: its cell and its head (trial 18, 205: a bare "✅ pass", the caveat only in md / CSV)
    (cell,) = [x for row in page_data(build_report(doc))["rows"] for x in row["cells"].values()]
    assert cell["text"] == "✅ pass (checked: isolation only)", cell
    assert said in render_html(build_report(doc))
    full = render_markdown(_doc([_cell("llama", "eager", c, "pass") for c in
                                 (s.name for s in REGISTRY if s.role == "correctness" and s.suite == "default"
                                  and "eager" not in s.skip_backends)]))
    assert "**llama**: safe on eager." in full and "(checked:" not in full
    assert said in "\n".join(render_terminal(doc, []))
    every = [s.name for s in REGISTRY if s.role == "correctness" and s.suite == "default" and "eager" not in s.skip_backends]
    assert SPECS["isolation"].suite == "default" and coverage(_doc([_cell("llama", "eager", c, "pass") for c in every])["cells"]) == ""


def test_merged_runs_with_different_checks_name_what_each_pass_covers():
    """merge of gpt2 / eager (isolation, logits_parity, loss_parity) and llama / sdpa (isolation only) read "The ✅
    cells cover the correctness checks run here: isolation, logits_parity, loss_parity": llama's ✅ rests on
    isolation alone (trial 5, 235). Passes that lack different checks are named per group."""
    from pytest_packcheck.report.verdicts import coverage

    cells = [_cell("gpt2", "eager", c, "pass") for c in ("isolation", "logits_parity", "loss_parity")]
    cells += [_cell("llama", "sdpa", "isolation", "pass")]
    said = coverage(cells)
    assert said.startswith("The ✅ cells do not all cover the same correctness checks"), said
    assert said.endswith(": llama / sdpa: isolation only; gpt2 / eager: isolation, logits_parity, loss_parity."), said
    # a run whose passes lack the same checks on both backends keeps the one sentence
    same = [_cell("gpt2", "eager", "isolation", "pass"), _cell("llama", "sdpa", "isolation", "pass")]
    assert coverage(same).startswith("The ✅ cells cover the correctness checks run here: isolation only; not run:")


def escape(text: str) -> str:
    from pytest_packcheck.report.text import escape_md

    return escape_md(text)


def test_an_inconclusive_probe_reads_inconclusive_once_and_leads_with_the_bar_it_missed():
    """Trial W2 (#56): isolation_atol raised to 100 made the isolation probe inconclusive; the terminal said
    "probe inconclusive: probe inconclusive: ... (needs >= leak_min 1.00e-09…" (doubled, the applying bar cut
    off), the answer "refused / crashed on sdpa", and the header "The ✅ cells cover ..." with no ✅ cell."""
    from pytest_packcheck.checks.parity import leak_shortfall
    from pytest_packcheck.report import render_markdown, render_terminal

    tol = {"isolation_atol": 100.0, "leak_min": 1e-9}
    why = leak_shortfall(3.58e-3, tol)
    assert why == "3.58e-03, not above isolation_atol 1.00e+02"
    assert leak_shortfall(1e-12, {"isolation_atol": 1e-3, "leak_min": 1e-9}).endswith(
        "not above isolation_atol 1.00e-03 and under leak_min 1.00e-09")
    message = f"probe inconclusive: a planted leak (no boundaries) moved logits by {why}"
    doc = _doc([_cell("opt", "sdpa", "isolation", "error", "probe_inconclusive") | {"message": message},
                _cell("opt", "sdpa", "logits_parity", "pass", max_change=0.0)])
    (line,) = [x for x in render_terminal(doc, []) if x.startswith("  error ")]
    assert line.count("probe inconclusive") == 1 and line.endswith("not above isolation_atol 1.00e+02"), line
    md = render_markdown(doc)
    answer = md[md.index("## The answer"):md.index("## Matrix")]
    assert "**opt**: inconclusive on sdpa (probe inconclusive: a planted leak" in answer and "refused" not in answer
    assert "cells cover" not in md and "cells cover" not in "\n".join(render_terminal(doc, []))


def test_checks_run_count_hazards_shown_as_hazards_not_failures():
    """Trial U1 (#3): a llama eager,sdpa audit's header said "Checks run: fail 5, pass 20 (of 25)" where pytest said
    "20 passed, 5 xfailed" and the same header called hazards "never a model failure". The counts go by
    check_mark: a hazard probe that showed its hazard is "hazard shown", a skipped check "not checked"."""
    from pytest_packcheck.report import render_markdown, render_terminal

    cells = _correct("llama", "eager") + _correct("llama", "sdpa")
    cells.append(_cell("llama", "sdpa", "grad_parity", "skipped"))
    doc = _doc(cells)
    said = "Checks run: hazard shown 4, not checked 1, pass 8 (of 13)."
    assert said in render_markdown(doc) and said in "\n".join(render_terminal(doc, []))


def test_a_hazards_only_run_judges_no_model():
    """Trial 14, 140: `--packcheck-checks cache_trap,mask_trap` said "none judged" in the header and then put gpt2
    under "Do not pack", ❌ in the matrix, "fail" in the CSV and the terminal: a headline with no correctness check
    took the hazards as its verdict. Hazards never decide a cell; a crash there still shows (it is the model's)."""
    from pytest_packcheck.report import build_report, csvfile, render_markdown, render_terminal
    from pytest_packcheck.report.verdicts import headline

    cells = [_cell("gpt2", "sdpa", "cache_trap", "fail", "cache_trap"), _cell("gpt2", "sdpa", "mask_trap", "fail", "mask_override")]
    doc = _doc(cells)
    h = headline(doc["cells"])
    assert h["status"] == "skipped" and h["no_correctness"] and not h["bad"]
    md = render_markdown(doc)
    assert "**gpt2**: not judged on sdpa (no correctness check ran" in md and "❌" not in md[:md.index("## Legend")]
    assert "- none: no model failed" in md and "Not run on this machine" not in md
    assert "| cache trap" in md[md.index("## Stack hazards"):]  # the hazard is still said, where hazards are
    terminal = "\n".join(render_terminal(doc, []))
    assert "  fail " not in terminal and "hazard      cache trap on sdpa / float32: 1/1 models" in terminal
    assert ",fail," not in csvfile.render(build_report(doc))
    crashed = _doc([_cell("gpt2", "sdpa", "cache_trap", "error", "crash")])
    assert headline(crashed["cells"])["status"] == "error"  # a model that does not run is still shown
    idle = _doc([_cell("gpt2", "sdpa", "cache_trap", "skipped")])
    assert headline(idle["cells"])["status"] == "skipped" and not headline(idle["cells"]).get("no_correctness")


def test_tolerances_other_than_the_defaults_are_said_in_the_counts_line():
    """Trial 14, 178: a tolerances file with logits_atol = 1e300 gave logits_parity a ✅ that judged nothing, and
    only the table at the report's end showed 1e+300. The counts line (header and terminal) names every tolerance
    that is not the shipped one of its dtype; the defaults say nothing."""
    from pytest_packcheck.config.tolerances import default_tolerances
    from pytest_packcheck.report import render_markdown, render_terminal

    shipped = dict(default_tolerances()["float32"])
    cell = _cell("llama", "sdpa", "logits_parity", "pass", max_abs_diff_solo=0.5)
    assert "Tolerances not" not in render_markdown(_doc([{**cell, "tolerances": shipped}]))
    doc = _doc([{**cell, "tolerances": {**shipped, "logits_atol": 1e300}}])
    said = "Tolerances not packcheck's defaults (every verdict is judged against them): float32.logits_atol = 1e+300 (default 0.0001)."
    assert said in render_markdown(doc).split("## The answer")[0] and said in "\n".join(render_terminal(doc, []))


def test_a_matrix_cell_no_file_holds_says_not_measured():
    """Trial 15, 73: a merge of a llama run on eager and sdpa with a gpt2 run on sdpa left gpt2 / eager blank in the
    matrix, with nothing saying that no file measured it."""
    from pytest_packcheck.report import render_html, render_markdown

    doc = _doc([_cell("llama", "eager", "isolation", "pass", max_change=0.0), _cell("llama", "sdpa", "isolation", "pass", max_change=0.0),
                _cell("gpt2", "sdpa", "isolation", "pass", max_change=0.0)])
    matrix = render_markdown(doc).split("## Matrix", 1)[1].split("##", 1)[0]
    row = next(line for line in matrix.splitlines() if line.startswith("| gpt2"))
    assert "— not measured" in row and row.count("✅") == 1, row
    # the HTML page draws its table in the browser from its data: a column the row lacks is drawn with the same words
    page = render_html(doc)
    assert "if (!x){ out += '<td title=\"no cell of this model and column in the results\">— not measured</td>'" in page


def test_a_measured_failure_outranks_an_inconclusive_probe():
    """Trial 15, 241: opt / sdpa in bfloat16, its backend check failing with leak (boundaries missing in 2 of 2
    attention calls) while isolation and causality were inconclusive, read 💥 "probe inconclusive, ..., leak", under
    "refused / crashed", and "Do not pack: none". The measured leak decides the cell; a real crash still does."""
    from pytest_packcheck.report import render_markdown
    from pytest_packcheck.report.verdicts import headline

    cells = [_cell("opt", "sdpa", "backend", "fail", "leak", boundaries_missing=2),
             _cell("opt", "sdpa", "isolation", "error", "probe_inconclusive"),
             _cell("opt", "sdpa", "logits_parity", "pass", max_abs_diff_solo=0.0)]
    doc = _doc(cells)
    h = headline(doc["cells"])
    assert h["status"] == "fail" and h["causes"] == ["leak", "probe_inconclusive"], h["causes"]
    md = render_markdown(doc)
    assert "- **opt** on sdpa: leak, probe inconclusive" in md and "refused / crashed" not in md
    crashed = _doc([*cells[:2], _cell("opt", "sdpa", "logits_parity", "error", "crash")])
    assert headline(crashed["cells"])["status"] == "error"  # a crash is not a probe that could not judge
    alone = _doc(cells[1:])
    assert headline(alone["cells"])["status"] == "error"  # nothing failed: still the inconclusive probe's cell


def test_a_model_with_a_cell_an_interrupted_run_left_is_never_marked_pass():
    """Trial 16, 140: after an interrupt, the details summary read "✅ pass gpt2" while gpt2's sdpa cell was "not run
    (interrupted)" in the matrix. The model's mark is "not run" beside a pass; a failure still outranks it."""
    from pytest_packcheck.report.model import build_report
    from pytest_packcheck.report.verdicts import model_mark

    unrun = _cell("gpt2", "sdpa", "isolation", "skipped", not_run="interrupted")
    doc = _doc([_cell("gpt2", "eager", "isolation", "pass", max_change=0.0), unrun])
    assert model_mark("gpt2", build_report(doc).layout.by_group).startswith("⏭️ not run (interrupted)")
    failed = _doc([_cell("gpt2", "eager", "isolation", "fail", "leak", max_change=0.3), unrun])
    assert model_mark("gpt2", build_report(failed).layout.by_group).startswith("❌ fail")
    whole = _doc([_cell("gpt2", "eager", "isolation", "pass", max_change=0.0)])
    assert model_mark("gpt2", build_report(whole).layout.by_group).startswith("✅ pass")


def test_the_hazard_count_says_which_probes_sit_inside_another_check():
    """Trial 16, 44: "Hazards: 3 of 6 hazard probes showed one" beside "Checks run: hazard shown 2": the third was
    batch_rows, logits_parity's probe of two packed rows, which "Checks run" counts as a passing logits_parity. The
    counts line names such a probe; a run of hazard checks only does not."""
    from pytest_packcheck.report.verdicts import counts_line

    two_rows = {**_cell("a", "sdpa", "logits_parity", "pass", max_abs_diff_solo=0.0, max_abs_diff_two_rows=0.3),
                "findings": [{"cause": "batch_rows", "evidence": "planted"}]}
    line = counts_line(_doc([*_correct("a")[:1], two_rows, *_correct("a")[4:]])["cells"], symbols=False)
    assert "hazard probes showed one (never a model failure; batch rows: a probe inside another check" in line, line
    plain = counts_line(_doc(_correct("b"))["cells"], symbols=False)
    assert "(never a model failure)." in plain and "inside another check" not in plain


def test_a_model_with_no_cell_in_a_dtype_says_so_in_that_dtypes_list():
    """Trial 18, 53: a merge of a gpt2 float32 run and a llama bfloat16 run read "- **gpt2**: ." in the bfloat16
    answer (nothing after the colon). The line says the model was not measured in that dtype."""
    from pytest_packcheck.report import render_markdown

    llama = {**_cell("llama", "sdpa", "isolation", "pass", max_change=0.0), "dtype": "bfloat16",
             "cell_id": "llama-sdpa-isolation-bfloat16"}
    md = render_markdown(_doc([_cell("gpt2", "sdpa", "isolation", "pass", max_change=0.0), llama]))
    assert "- **gpt2**: not measured in bfloat16 (no cell of it in the results)." in md
    assert "- **llama**: not measured in float32 (no cell of it in the results)." in md and "**: ." not in md


def test_a_stack_finding_counts_models_not_dtypes():
    """Trial 18, 228: gpt2 alone in bfloat16 and float16 read "integer_labels ... (2/2 models)" in the terminal and
    "2/2 models" in the Markdown: one model measured in two dtypes was counted twice."""
    from pytest_packcheck.report import render_markdown, render_terminal

    cells = []
    for dtype in ("bfloat16", "float16"):
        c = _cell("gpt2", None, "collate", "fail", "labels_contract")
        c.update(dtype=dtype, cell_id=f"gpt2-collate-{dtype}",
                 metrics={"items": {"integer_labels": {"status": "fail", "evidence": "integer labels raise"}}})
        cells.append(c)
    doc = _doc(cells)
    assert "integer_labels: integer labels raise (1/1 models)" in "\n".join(render_terminal(doc, []))
    md = render_markdown(doc)
    assert "1/1 models" in md and "2/2 models" not in md
