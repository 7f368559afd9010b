"""What the terminal shows: a progress line per model (quiet under -q), a summary that groups passes and skips
with counts and whole reasons, and pytest short lines that lead with the cause and the remedy."""

from __future__ import annotations

from conftest import planted_cell, planted_doc


def _cell(model, backend, check, status, cause=None, message=None):
    return planted_cell(model, backend, check, status, cause, message, max_change=0.3 if status == "fail" else 0.0)


_doc = planted_doc


def test_summary_groups_passes_and_skips_with_counts_and_whole_reasons():
    from pytest_packcheck.report.formats import render_terminal

    why = ("flash_attention_2 needs a CUDA device (running on cpu) and the flash-attn package (flash_attn not importable), "
           "a reason longer than the old ninety-character cut")
    cells = []
    for m in ("a", "b", "c"):
        cells += [_cell(m, "sdpa", "isolation", "pass"), _cell(m, "flash_attention_2", "isolation", "skipped", message=why)]
    cells.append(_cell("opt", "sdpa", "isolation", "fail", "leak"))
    lines = render_terminal(_doc(cells), [])
    assert "  pass        sdpa / float32: 3 models (a, b, c)" in lines
    assert f"  not checked flash_attention_2 / float32, 3 models: {why}" in lines  # once, whole
    (fail,) = [line for line in lines if line.startswith("  fail ")]
    assert fail.startswith("  fail        opt / sdpa / float32: leak — remedy: ")
    assert len([line for line in lines if line.startswith("  ")]) == 3


def test_cut_never_cuts_mid_word():
    from pytest_packcheck.report.text import cut

    text = "model build: ValueError: Gemma2ForCausalLM does not support an attention implementation through torch"
    short = cut(text, 60)
    assert len(short) <= 60 and short.endswith("…") and text.startswith(short[:-1]) and text[len(short) - 1] == " "
    assert cut("short", 60) == "short"


def test_failure_text_leads_with_cause_and_remedy():
    from pytest_packcheck.results.schema import CellResult
    from pytest_packcheck.run.items import PackcheckCellFailure, cause_and_remedy

    result = CellResult.from_dict(_cell("opt", "sdpa", "isolation", "fail", "leak"))
    cause, fix = cause_and_remedy(result)
    assert cause == "leak" and fix and "do not pack" in fix
    assert str(PackcheckCellFailure("fail", "moved 3.0e-01", cause, fix)).startswith(f"fail (leak; remedy: {fix}): moved")
    assert cause_and_remedy(CellResult.from_dict(_cell("a", "sdpa", "isolation", "pass"))) == (None, None)


def test_progress_line_per_model_and_quiet_under_q(pytester, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    args = ["-p", "no:cacheprovider", "--packcheck-models=arch:llama,arch:opt", "--packcheck-attn=sdpa",
            "--packcheck-checks=isolation", f"--packcheck-report-dir={pytester.path / 'out'}", "-rf"]
    result = pytester.runpytest_inprocess(*args)  # the progress words, not the process: in this one
    out = result.stdout.str()
    assert "packcheck: building llama (model 1/2); 0/2 cells, 0:00 elapsed, ETA —" in out
    assert "packcheck: building opt (model 2/2); 1/2 cells," in out and "ETA 0:" in out
    # the short summary line leads with the cause and the remedy (pytest cuts it at the terminal width)
    assert "FAILED packcheck::opt::packcheck[opt-sdpa-isolation-float32] - fail (leak; remedy: do not pack on" in out
    quiet = pytester.runpytest_inprocess(*args, "-q").stdout.str()
    assert "packcheck: building" not in quiet
    # a resume builds no model whose cells the journal holds, and counts them as done from the start (trial 19, 67:
    # "building llama (model 1/3); 0/75 cells" for models taken wholly from the journal)
    journal = pytester.path / "out" / "packcheck-journal.jsonl"
    journal.write_text("\n".join(line for line in journal.read_text().splitlines() if "opt-sdpa" not in line) + "\n")
    resumed = pytester.runpytest_inprocess(*args, "--packcheck-resume").stdout.str()
    assert "packcheck: llama (model 1/2): its 1 cell from the journal (--packcheck-resume), nothing to build; 1/2 cells (1 from the journal)" in resumed, resumed
    assert "packcheck: building opt (model 2/2); 1/2 cells (1 from the journal)," in resumed and "building llama" not in resumed


def test_default_config_warnings_of_arch_specs_are_silenced(pytester):
    """transformers 5.24 warns about starcoder2's own default config (bos / eos 50256 outside its 49152-token
    vocabulary) when packcheck makes it: not the user's config, nothing about packing, not printed."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--packcheck-models=arch:starcoder2",
                                           "--packcheck-attn=sdpa", "--packcheck-checks=isolation", "--collect-only", "-q")
    assert result.ret == 0
    out = result.stdout.str() + result.stderr.str()
    assert "1 test collected" in out and "bos_token_id must be" not in out
    import transformers
    from transformers.utils import logging as hf_logging

    from pytest_packcheck.run.session import _quiet_default_config

    before = hf_logging.get_verbosity()
    with _quiet_default_config():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert hf_logging.get_verbosity() == before and transformers.__version__
