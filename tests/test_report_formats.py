"""The report formats table: every format is written as one set from one report model, the session's file lists
follow the table, and the CSV matrix holds one row per matrix cell with the JSON's verdict. What every renderer
reads from one place: key numbers from the check registry, the header's libraries from ``environment_rows``."""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections import defaultdict

import pytest
from conftest import planted_cell, planted_doc

from pytest_packcheck.results.schema import read_results


def _cells() -> list[dict]:
    cells = []
    for m in ("llama", "qwen3"):
        cells += [planted_cell(m, b, "isolation", "pass", max_change=0.0) for b in ("eager", "sdpa")]
        cells.append(planted_cell(m, None, "collate", "pass"))
    cells.append(planted_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3))
    cells.append(planted_cell("opt", "eager", "isolation", "skipped", message="needs a CUDA device"))
    return cells


def csv_problems(doc: dict, text: str) -> list[str]:
    """What a CSV matrix gets wrong against its results document: a matrix cell (model x backend x dtype x
    version environment) missing, extra or listed twice, or a verdict / cause other than the matrix's."""
    from pytest_packcheck.report.verdicts import VERDICT_WORDS, headline, verdict_key

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in doc["cells"]:
        if c["backend"]:
            groups[(c["model"]["label"], c["backend"], c["dtype"], (c.get("env") or {}).get("label") or "")].append(c)
    want = {k: headline(g) for k, g in groups.items()}
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    got = {(r["model"], r["backend"], r["dtype"], r["versions"]): r for r in rows}
    problems = [f"missing {k}" for k in want if k not in got] + [f"extra {k}" for k in got if k not in want]
    problems += ["a cell listed twice"] if len(rows) != len(got) else []
    for k, h in want.items():
        r = got.get(k)
        word = VERDICT_WORDS[verdict_key(h)]
        if r and (r["verdict"], r["cause"]) != (word, ", ".join(h["causes"])):
            problems.append(f"{k}: {r['verdict']} ({r['cause']}), the matrix says {word} ({h['causes']})")
    return problems


def test_every_format_is_written_and_the_csv_reads_back_as_the_json_matrix(tmp_path):
    from pytest_packcheck.report.formats import FORMATS, write_reports

    paths = write_reports(tmp_path, planted_doc(_cells()))
    assert [p.rsplit("/", 1)[-1] for p in paths] == [f.file for f in FORMATS]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.file for f in FORMATS)
    doc = read_results(tmp_path / "packcheck-matrix.json")
    with open(tmp_path / "packcheck-matrix.csv", newline="", encoding="utf-8") as fh:
        text = fh.read()
    assert text.startswith("model,backend,dtype,versions,verdict,cause,check,key number,note\r\n")
    assert csv_problems(doc, text) == []
    rows = {(r["model"], r["backend"]): r for r in csv.DictReader(io.StringIO(text, newline=""))}
    assert len(rows) == 6 and ("llama", None) not in rows  # model-level checks are not matrix cells
    assert (rows[("opt", "sdpa")]["verdict"], rows[("opt", "sdpa")]["cause"]) == ("fail", "leak")
    assert (rows[("opt", "sdpa")]["check"], rows[("opt", "sdpa")]["key number"]) == ("isolation", "Δ 3.0e-01")
    assert rows[("opt", "eager")]["verdict"] == "not checked" and rows[("llama", "eager")]["key number"] == "Δ 0.0e+00"


def test_the_csv_note_carries_what_the_markdown_says_of_a_cell():
    """The CSV of an interrupted run listed its unrun cells as plain "skipped" (no incomplete marker), dropped a
    pass's "(not checked: grad_parity)" that the Markdown shows, and gave a skipped cell no reason."""
    from pytest_packcheck.report import csvfile, render_markdown
    from pytest_packcheck.report.model import build_report

    cells = [planted_cell("llama", "flex_attention", "isolation", "pass", max_change=0.0),
             planted_cell("llama", "flex_attention", "grad_parity", "skipped", message="flex_attention has no backward here"),
             planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0),
             planted_cell("llama", "sdpa", "grad_parity", "skipped", message="not run: the run was interrupted", not_run="interrupted"),
             planted_cell("llama", "eager", "isolation", "skipped", message="needs a CUDA device"),
             planted_cell("llama", "eager", "grad_parity", "skipped", message="needs a CUDA device")]
    doc = planted_doc(cells)
    rows = {r["backend"]: r for r in csv.DictReader(io.StringIO(csvfile.render(build_report(doc)), newline=""))}
    md = render_markdown(doc)
    # the run left the other correctness checks out: the pass names what it rests on (trial 16, 145)
    assert rows["flex_attention"]["verdict"] == "pass"
    assert rows["flex_attention"]["note"] == "not checked: grad_parity; checked: isolation only"
    assert "(not checked: grad_parity)" in md
    assert rows["sdpa"]["note"] == "not run: 1 of 2 checks (interrupted)"
    assert "not run: 1 of 2 checks (interrupted)" in md
    assert rows["eager"]["note"] == "not checked: isolation: needs a CUDA device", rows["eager"]


def test_the_csv_verdict_is_the_word_the_markdown_and_html_count_it_under():
    """The CSV gave an interrupted cell the verdict "skipped", as it did a cell the machine cannot run, while the
    Markdown and HTML say "not run (interrupted)" and "not checked" (trial 10, 35): a filter on the verdict mixed
    them. The CSV's verdict column is the one rule of every format (verdicts.VERDICT_WORDS of verdict_key)."""
    from pytest_packcheck.report import csvfile, html, render_markdown
    from pytest_packcheck.report.model import build_report

    cells = [planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0),
             planted_cell("llama", "sdpa", "grad_parity", "skipped", message="not run: the run was interrupted", not_run="interrupted"),
             planted_cell("llama", "eager", "isolation", "skipped", message="needs a CUDA device"),
             planted_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3)]
    doc = planted_doc(cells)
    rows = {(r["model"], r["backend"]): r["verdict"] for r in csv.DictReader(io.StringIO(csvfile.render(build_report(doc)), newline=""))}
    assert rows == {("llama", "sdpa"): "not run (interrupted)", ("llama", "eager"): "not checked", ("opt", "sdpa"): "fail"}
    md, page = render_markdown(doc), html.render(build_report(doc))
    for word in ("not run (interrupted) 1", "not checked 1", "fail 1"):
        assert word in md, md
    assert "not run (interrupted)" in page and "not checked" in page


def test_what_to_do_names_the_check_of_each_remedy_line():
    """One cell (llama / sdpa) with edge_lengths and logits_parity both kernel_numerics below a float32.logits_atol=1e-9
    gave two "What to do" lines, each "1 check in 1 model / backend: llama / sdpa", with 1.2e-07 and 8.9e-08 and no
    word of which check each number is (trial 6, 33). Each line names its checks; one remedy over several checks is
    still one line naming them all."""
    from pytest_packcheck.report import render_markdown

    def numerics(check: str, diff: float) -> dict:
        cell = planted_cell("llama", "sdpa", check, "fail", "kernel_numerics", atol=1e-9)
        cell["evidence"] = {"atol": 1e-09, "below_rounding": True, "diff": diff, "dtype": "float32", "isolation_atol": 1e-05,
                            "isolation_moved": 0.0, "rounding_level": 2.0 ** -23, "tolerance": "logits_atol"}
        cell["causes"] = [{"cause": "kernel_numerics", "evidence": cell["evidence"]}]
        return cell

    doc = planted_doc([numerics("edge_lengths", 1.1920928955078125e-07), numerics("logits_parity", 8.940696716308594e-08),
                       planted_cell("opt", "sdpa", "isolation", "fail", "leak"), planted_cell("opt", "sdpa", "logits_parity", "fail", "leak")])
    md = render_markdown(doc)
    lines = [x for x in md[md.index("## What to do"):md.index("## Legend")].splitlines() if x.startswith("- **")]
    numbers = [x for x in lines if "kernel\\_numerics" in x]
    assert len(numbers) == 2, lines
    assert "1 check (edge\\_lengths) in 1 model / backend: llama / sdpa" in numbers[0] and "at least 1.2e-07" in numbers[0]
    assert "1 check (logits\\_parity) in 1 model / backend: llama / sdpa" in numbers[1] and "at least 8.9e-08" in numbers[1]
    leak = [x for x in lines if "**leak**" in x]
    assert len(leak) == 1 and "2 checks (isolation, logits\\_parity) in 1 model / backend: opt / sdpa" in leak[0], lines


def test_an_interrupted_runs_unrun_checks_are_counted_and_listed_apart_from_not_checked(tmp_path):
    """Trial 6 #105: an interrupted run's matrix counted its unrun cells as "⏭️ not checked N" (the legend: "this
    environment lacks something") and the "Not checked" section said "sdpa, 2 models: isolation, position_ids,
    logits_parity" although llama / sdpa had finished isolation. Unrun cells are now counted, legended and listed
    as "not run (interrupted)" in every format with a headline or legend, each line naming only the checks its
    models never ran."""
    from pytest_packcheck.report import render_markdown, terminal
    from pytest_packcheck.report.formats import write_reports
    from pytest_packcheck.report.model import build_report

    unrun = {"message": "not run: the run was interrupted before this check; rerun with --packcheck-resume",
             "not_run": "interrupted"}
    checks = ["isolation", "position_ids", "logits_parity"]
    cells = [planted_cell("llama", "eager", k, "pass", max_change=0.0) for k in checks]
    cells += [planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0)]
    cells += [planted_cell("llama", "sdpa", k, "skipped", **unrun) for k in checks[1:]]
    cells += [planted_cell("gpt2", b, k, "skipped", **unrun) for b in ("eager", "sdpa") for k in checks]
    cells += [planted_cell("opt", "sdpa", "isolation", "skipped", message="needs a CUDA device")]
    doc = planted_doc(cells)
    doc["incomplete"] = {"reason": "the run was interrupted", "cells": 4, "resume": "rerun with --packcheck-resume"}
    md = render_markdown(doc)
    assert "judged by the correctness checks): ✅ pass 1, ⏭️ not run (interrupted) 3, ⏭️ not checked 1 (of 5)." in md
    assert "Checks run: not run (interrupted) 8, not checked 1, pass 4 (of 13)." in md
    assert "- ⏭️ not run (interrupted): the run stopped before this check" in md
    assert "- ⏭️ not checked: this environment lacks something" in md  # opt / sdpa's, and only it
    not_checked = md[md.index("## Not checked"):].split("\n\n")[1].splitlines()
    assert not_checked == ["- sdpa, 1 model: isolation: needs a CUDA device"], not_checked
    not_run = md[md.index("## Not run (interrupted)"):].split("\n\n")[1].splitlines()
    assert [line.split(": not run:")[0] for line in not_run] == [
        "- eager, 1 model (gpt2): isolation, position\\_ids, logits\\_parity",
        "- sdpa, 1 model (gpt2): isolation, position\\_ids, logits\\_parity",
        "- sdpa, 1 model (llama): position\\_ids, logits\\_parity"], not_run  # llama ran isolation: never listed
    out = terminal.render(build_report(doc), [])
    assert "pass 1, not run (interrupted) 3, not checked 1 (of 5)." in "\n".join(out)
    assert "  not checked sdpa / float32, 1 model: needs a CUDA device" in out
    assert any(line.startswith("  not run (interrupted) sdpa / float32, 2 models: not run: the run was interrupted")
               for line in out), out
    write_reports(tmp_path, doc)
    page = (tmp_path / "packcheck-matrix.html").read_text()
    assert '<span class="not_run">⏭️ not run (interrupted)</span> the run stopped before this check' in page
    data = json.loads(page[page.index('id="packcheck-data">') + 20:page.index("</script>")].replace("\\u003c", "<"))
    llama = next(r for r in data["rows"] if r["model"] == "llama")["cells"]["sdpa"]
    assert (llama["status"], llama["text"]) == ("not_run", "⏭️ not run: 2 of 3 checks (interrupted)")
    assert next(r for r in data["rows"] if r["model"] == "opt")["cells"]["sdpa"]["text"] == "⏭️ not checked"
    assert data["verdict_names"]["not_run"] == "⏭️ not run (interrupted)"
    details = (tmp_path / "packcheck-details.md").read_text()
    assert "| ⏭️ not run (interrupted) | ✅ Δ 0.0e+00 |" in details

def test_the_html_shows_the_bench_payoff_the_markdown_shows():
    """With --bench the Markdown and JSON carried the speedup, the payoff section and a model's ⚠; the HTML none."""
    from pytest_packcheck.report import render_markdown
    from pytest_packcheck.report.formats import write_reports

    result = {"model": {"label": "opt"}, "profile": "fixed", "attn_implementation": "sdpa", "dtype": "float32",
              "runs": {"padded": {"useful_tokens_per_s": 1000.0}, "packed": {"useful_tokens_per_s": 1500.0}},
              "memory_reduction": None, "lengths": {"median": 20}, "padding_overhead": 0.5, "speedup": 1.5,
              "ideal_speedup": 1.6, "fraction_of_ideal": 0.94, "loss_first_step_delta": 1e-6, "steps": 1, "warmup": 1,
              "batch_size": 2, "max_length": 32}
    doc = planted_doc([planted_cell("opt", "sdpa", "isolation", "fail", "leak", max_change=0.3)])
    doc["bench"] = {"steps": 1, "device": "cpu", "profiles": ["fixed"], "results": [result]}
    md = render_markdown(doc)
    assert "## Packing payoff (packcheck bench)" in md and "1.50x" in md and "opt ⚠" in md
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        write_reports(Path(d), doc)
        page = (Path(d) / "packcheck-matrix.html").read_text()
    payoff = page[page.index('<div id="payoff">'):]
    assert "<h2>Packing payoff (packcheck bench)</h2>" in payoff and "<td>1.50x</td>" in payoff and "<td>opt ⚠</td>" in payoff
    assert "speed of a different computation" in payoff and "\\_" not in payoff.split("</div>")[0]
    data = json.loads(page[page.index('id="packcheck-data">') + 20:page.index("</script>")].replace("\\u003c", "<"))
    assert data["row_headers"] == ["model", "dtype", "speedup / memory"]
    assert data["rows"][0]["head"][2] == "fixed 1.50x / mem n/a ⚠ packing wrong on sdpa"


def test_the_committed_csv_has_every_cell_of_the_committed_matrix():
    from pathlib import Path

    from pytest_packcheck.report import csvfile
    from pytest_packcheck.report.model import build_report
    from pytest_packcheck.results import load_document

    reports = Path(__file__).parent.parent / "reports"
    doc = load_document(reports / "packcheck-matrix.json")
    text = csvfile.render(build_report(doc))
    assert csv_problems(doc, text) == []
    with open(reports / "packcheck-matrix.csv", newline="", encoding="utf-8") as fh:
        assert fh.read() == text  # the committed CSV is the committed JSON's


@pytest.mark.parametrize("fault", ["drop a cell", "wrong verdict"])
def test_a_planted_csv_fault_is_caught(monkeypatch, fault):
    """The planted faults: a CSV renderer that loses a matrix cell, or writes a pass for a failing one."""
    from pytest_packcheck.report import csvfile
    from pytest_packcheck.report.model import build_report

    doc = planted_doc(_cells())
    real = csvfile.rows

    def faulty(rep):
        rows = real(rep)
        if fault == "drop a cell":
            return rows[:-1]
        return [{**r, "verdict": "pass", "cause": ""} if r["verdict"] == "fail" else r for r in rows]

    monkeypatch.setattr(csvfile, "rows", faulty)
    assert csv_problems(doc, csvfile.render(build_report(doc)))


def test_the_session_checks_and_cleans_up_the_files_of_the_formats_table(tmp_path, monkeypatch):
    """The session's list of report files is the table's: a new format's stale file is removed with the others."""
    from pytest_packcheck.report.formats import FORMATS, write_reports
    from pytest_packcheck.run.session import PackcheckSession

    write_reports(tmp_path, planted_doc(_cells()))

    class Settings:
        report_dir = str(tmp_path)

    session = PackcheckSession.__new__(PackcheckSession)
    session.settings = Settings()
    line = session.discard_stale_matrix(RuntimeError("disk"))
    assert not any((tmp_path / f.file).exists() for f in FORMATS)
    assert all(f.file in line for f in FORMATS)


def test_key_numbers_are_written_as_the_registry_says():
    """Each check's key number follows its check record (``key_metric`` and ``key_number_format``); the report
    names no check to format one."""
    import ast
    import inspect

    from pytest_packcheck.checks.registry import CHECKS
    from pytest_packcheck.report import key_number, numbers

    strings = {n.value for n in ast.walk(ast.parse(inspect.getsource(numbers))) if isinstance(n, ast.Constant)}
    assert not strings & set(CHECKS)
    calls = planted_cell("llama", "flash_attention_2", "backend", "pass", calls={"flash_attention_2": 2}, expected_calls=2,
                         varlen_kernel_calls=2, dense_kernel_calls=0)
    assert key_number(calls) == "2/2 calls, varlen 2 / dense 0"
    assert key_number(planted_cell("llama", "sdpa", "logits_parity", "pass", max_abs_diff_solo=1.5e-7)) == "Δ 1.5e-07"


def test_a_planted_unknown_key_format_is_refused(monkeypatch):
    """The planted fault: a check record naming a key-number formatter that does not exist fails loudly."""
    import dataclasses

    from pytest_packcheck.checks.registry import SPECS
    from pytest_packcheck.report import key_number

    monkeypatch.setitem(SPECS, "isolation", dataclasses.replace(SPECS["isolation"], key_number_format="parity:sparkline"))
    with pytest.raises(AttributeError, match="sparkline"):
        key_number(planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0))


def test_every_header_names_the_libraries_of_environment_rows(monkeypatch):
    """Markdown, HTML and the terminal name the libraries of the libraries table (its ``header`` records): a library
    marked there shows in each."""
    import dataclasses

    from pytest_packcheck.report import environment_rows, render_html, render_markdown, render_terminal
    from pytest_packcheck.versions import libraries

    doc = planted_doc(_cells())
    doc["environment"].update({"torch": "2.13.0+cpu", "kernels": "0.9.1"})
    assert ("torch", "2.13.0+cpu") in environment_rows(doc["environment"])
    assert ("trl", "not installed") in environment_rows(doc["environment"])
    table = tuple(dataclasses.replace(lib, header=True) if lib.name == "kernels" else lib for lib in libraries.LIBRARIES)
    monkeypatch.setattr(libraries, "LIBRARIES", table)
    assert "flash-attn not installed, kernels 0.9.1" in render_markdown(doc).split("Reproduce:")[0]
    assert "flash-attn not installed, kernels 0.9.1, device cpu" in render_html(doc)
    assert render_terminal(doc, [])[0] == ("torch 2.13.0+cpu, transformers 5.24.0, trl not installed, flash-attn not "
                                           "installed, kernels 0.9.1, device cpu")


@pytest.mark.parametrize("token", ["hf_TrIaL2sEcReT0123456789abcdefABCDEF", "github_pat_" + "11AB_" * 10, "sk-proj_" + "x1" * 12])
def test_a_token_in_the_audit_name_reaches_no_report_format(tmp_path, monkeypatch, token):
    """Markdown escapes ``_`` before the files are scrubbed (``hf\\_...``): the scrub must still catch the token,
    by shape and by the value of a secret-named variable, in every file of the set."""
    from pytest_packcheck.report.formats import FORMATS, write_reports

    monkeypatch.setenv("MY_SERVICE_KEY", "plain_value_42")
    doc = planted_doc(_cells())
    doc["settings"]["audit"] = f"{token} plain_value_42"
    write_reports(tmp_path, doc)
    for f in FORMATS:
        text = (tmp_path / f.file).read_text(encoding="utf-8")
        assert "TrIaL" not in text and "11AB" not in text and "x1x1" not in text and "value\\_42" not in text, f.file
    assert (tmp_path / "packcheck-matrix.md").read_text(encoding="utf-8").splitlines()[0] == "# packcheck support matrix — *** ***"


def test_logs_no_cell_names_are_removed_beside_a_new_matrix_and_named_ones_kept(tmp_path):
    from pytest_packcheck.report.formats import remove_unreferenced_logs

    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("transformers-5.24.0-old.log", "transformers-4.56.2-now.log", "notes.txt"):
        (logs / name).write_text("x")
    doc = planted_doc(_cells())
    doc["cells"][0]["env"] = {"label": "transformers==4.56.2", "log": "logs/transformers-4.56.2-now.log"}
    assert remove_unreferenced_logs(tmp_path, doc) == [str(logs / "transformers-5.24.0-old.log")]
    assert sorted(p.name for p in logs.iterdir()) == ["notes.txt", "transformers-4.56.2-now.log"]
    (logs / "notes.txt").unlink()
    assert remove_unreferenced_logs(tmp_path, planted_doc(_cells())) == [str(logs / "transformers-4.56.2-now.log")]
    assert not logs.exists()  # left empty: gone too


def test_an_audit_removes_an_earlier_runs_version_logs_and_says_so(tmp_path):
    """A --versions run's logs/ stayed beside a later matrix that has no version environment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "r"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "transformers-5.24.0-abc.log").write_text("an earlier run's log\n")
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "audit", "--models", "arch:llama", "--packcheck-attn",
                           "eager", "--packcheck-checks", "isolation", "-n", "0", "--packcheck-report-dir", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, check=False, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert not (out / "logs").exists()
    notes = [line for line in proc.stdout.splitlines() if "removed 1 log(s) of an earlier run" in line]
    assert len(notes) == 1 and "transformers-5.24.0-abc.log" in notes[0], proc.stdout[-1500:]


def test_the_environment_table_says_not_installed_for_a_missing_library():
    """A fresh install without TRL (the README's main job) read "trl not installed" in the header and "| trl | None |"
    in the Environment table: one wording for a library the run did not have."""
    from pytest_packcheck.report import render_markdown

    doc = planted_doc([planted_cell("llama", "sdpa", "isolation", "pass", max_change=0.0)])
    doc["environment"].update(trl=None, flash_attn=None, cuda=None)
    table = render_markdown(doc).split("## Environment", 1)[1]
    assert re.search(r"\| trl +\| not installed +\|", table) and re.search(r"\| flash_attn +\| not installed +\|", table), table
    assert re.search(r"\| cuda +\| none +\|", table) and "None" not in table


def test_a_shards_own_reports_say_it_is_one_shard_and_a_merge_does_not():
    """Trial 19, 95: a --packcheck-shard 1/2 matrix read "✅ pass 1 (of 1)" like a complete audit of its one model;
    only its Reproduce line named the shard, while merge knew it was half. Every report of a shard says so."""
    from pytest_packcheck.analysis.gate import merge
    from pytest_packcheck.report import build_report, render_details, render_html, render_markdown, render_terminal

    def shard(i, model):
        doc = planted_doc([planted_cell(model, "sdpa", "isolation", "pass", max_change=0.0)])
        doc["settings"].update(models=["arch:llama", "arch:gpt2"], shard=[i, 2])
        return doc

    one = shard(1, "llama")
    said = "Shard 1 of 2 (--packcheck-shard): this matrix holds 1 of the audit's 2 models (llama)"
    for text in (render_markdown(one), render_details(one), render_html(one), "\n".join(render_terminal(one, []))):
        assert said in html.unescape(text).replace("\\", ""), text[:600]
    merged = merge([one, shard(2, "gpt2")], ["a.json", "b.json"])
    assert "Shard" not in render_markdown(merged) and "shard" not in build_report(merged).settings
