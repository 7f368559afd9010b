"""A fifth hostile trial, as a new user from README.md (helper h5: every ``packcheck audit`` flag, the env variables,
the subcommands and the guard's public API with hostile values): each failure it found that had a small fix,
reproduced here.

- A control character in any flag's value (``--packcheck-checks $'isolation\\nx'``) split the one-line error that
  quotes it over two lines (16 flags); :class:`PackcheckUsageError` now writes control characters as escapes.
- ``--packcheck-tolerance logits_atol=1e-3 --packcheck-tolerance logits_atol=2e-3`` was a silent last-wins, where
  ``--packcheck-config`` refuses the same key twice.
- ``--packcheck-baseline`` with no cell in common: exit 2, with the refusal printed above the summary and pytest's
  "1 passed" as the last line; the audit's last line now says why.
- A run stopped by Ctrl-C writes its matrix marked incomplete ("rerun with --resume"); a fresh run after it (a stray
  positional argument was enough) emptied the journal without the copy a killed run's journal gets.
- ``packcheck audit ... -- --packcheck-report-dir out --save-baseline``: pytest wrote ``out`` while the audit copied
  the previous run's ``reports/packcheck-matrix.json`` as the new baseline ("baseline written"); and ``--models
  arch:llama -- --packcheck-models arch:gpt2`` dropped llama without a word."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from cli_inprocess import packcheck, pytest_run

from pytest_packcheck.errors import PackcheckUsageError

SMALL = ["--models", "arch:llama", "--packcheck-attn", "sdpa", "-n", "0", "-q"]


@pytest.mark.parametrize(("flag", "value"), [
    ("--packcheck-checks", "isolation\nx"), ("--packcheck-shard", "1/2\nx"), ("--packcheck-tolerance", "logits_atol=1\nx"),
    ("--packcheck-versions", "transformers==4.51.3\ntrl==1"), ("--audit", "def\nault"), ("--packcheck-timeout", "30\x1b[2J"),
    ("--bench", "uni\nform"),
])
def test_a_control_character_in_any_flag_is_refused_on_one_line(tmp_path, flag, value):
    """Planted: a newline (or an escape sequence) in the value of a flag whose refusal quotes it."""
    args = [*SMALL, "--packcheck-checks", "isolation", "--packcheck-report-dir", str(tmp_path / "r")]
    if flag == "--packcheck-checks":
        args = args[:-4] + args[-2:]
    proc = packcheck("audit", *args, flag, value, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-1500:]
    said = [line for line in out.splitlines() if line.strip()]
    assert len(said) == 1 and "\x1b" not in out, said
    assert repr(value)[1:-1] in said[0], said


def test_the_usage_error_escapes_control_characters_and_keeps_plain_text():
    assert str(PackcheckUsageError("a\nb\tc\x1b[31m ü")) == "a\\nb\\tc\\x1b[31m ü"
    assert str(PackcheckUsageError("plain 'text' ü")) == "plain 'text' ü"


def test_a_tolerance_overridden_twice_is_refused():
    from pytest_packcheck.config.tolerances import load_tolerances

    with pytest.raises(PackcheckUsageError, match="Tolerance override 'logits_atol' given twice .*logits_atol=1e-3 and "
                                                  "logits_atol=2e-3"):
        load_tolerances(None, ["logits_atol=1e-3", "logits_atol=2e-3"], "t")
    # one key for every dtype, then one dtype's own: two targets, both taken (the later, narrower one wins for float32)
    tol, label = load_tolerances(None, ["logits_atol=1e-3", "float32.logits_atol=2e-3"], "t")
    assert tol["float32"]["logits_atol"] == 2e-3 and tol["bfloat16"]["logits_atol"] == 1e-3
    assert label.endswith("+ logits_atol=1e-3 + float32.logits_atol=2e-3")


def test_a_refused_baseline_comparison_is_the_audits_last_line(tmp_path):
    """Planted: a baseline of the collate check only, a candidate of isolation only: nothing compared."""
    base = packcheck("audit", *SMALL, "--packcheck-checks", "collate", "--packcheck-report-dir", str(tmp_path / "b"),
                     cwd=tmp_path)
    assert base.returncode == 0, base.stderr[-800:]
    proc = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--packcheck-report-dir", str(tmp_path / "c"),
                     "--packcheck-baseline", str(tmp_path / "b" / "packcheck-matrix.json"), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-1500:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("packcheck audit: error: the matrix is written, but the comparison with the baseline"), last
    assert "(from --packcheck-baseline)" in last and "Nothing compared" in last, last
    assert (tmp_path / "c" / "packcheck-matrix.json").exists()


def test_a_fresh_run_over_an_interrupted_runs_incomplete_matrix_keeps_its_journal(tmp_path):
    """Planted: the matrix of the earlier run carries the ``incomplete`` record a Ctrl-C writes (newer than its
    journal, as a stopped run writes it last); a fresh run then empties the journal: a copy is kept and said."""
    reports = tmp_path / "reports"
    args = ["audit", "--models", "arch:llama,arch:gpt2", "--packcheck-attn", "sdpa", "--packcheck-checks", "isolation",
            "-n", "0", "-q"]
    assert packcheck(*args, cwd=tmp_path).returncode == 0
    matrix = reports / "packcheck-matrix.json"
    doc = json.loads(matrix.read_text())
    doc["incomplete"] = {"reason": "interrupted (Ctrl-C / SIGTERM)"}
    time.sleep(0.01)
    matrix.write_text(json.dumps(doc))
    proc = packcheck(*args, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "held 2 finished cell(s) of an earlier run" in out and "an incomplete one" in out, out[-1500:]
    kept = reports / "previous" / "packcheck-journal.jsonl"
    assert kept.exists() and len(kept.read_text().splitlines()) == 2
    quiet = packcheck(*args, cwd=tmp_path)  # that run finished: its matrix is whole, nothing said
    assert "held" not in quiet.stdout + quiet.stderr


@pytest.mark.parametrize("after", [["--packcheck-report-dir", "out"], ["--packcheck-report-dir=out"],
                                   ["--packcheck-models", "arch:gpt2"], ["--packcheck-model", "arch:gpt2"]])
def test_an_audit_option_after_the_dashes_is_refused_before_anything_runs(tmp_path, after):
    """Planted: a previous run's reports/ (a baseline-to-be that this run must not copy) and the option after ``--``."""
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "packcheck-matrix.json").write_text("{}")
    os.utime(reports / "packcheck-matrix.json", (time.time() + 5,) * 2)
    proc = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--save-baseline", "--", *after, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-1500:]
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "after `--`" in said[0], said
    assert not (reports / "baseline.json").exists() and not (tmp_path / "out").exists()


def test_pytests_own_arguments_after_the_dashes_still_go_to_pytest(tmp_path):
    proc = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--packcheck-report-dir", str(tmp_path / "r"),
                     "--", "-k", "isolation", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert json.loads(Path(tmp_path / "r" / "packcheck-matrix.json").read_text())["cells"]


@pytest.mark.parametrize("args", [
    ["merge", "RESULTS", "-o", "m7/\nx"], ["gate", "--baseline", "RESULTS", "--candidate", "RESULTS", "--summary", "s\x1b.md"],
    ["claims", "--output", "c\nd.md"], ["atlas", "--render-only", "--build-dir", "b\nx", "-o", "at"],
    ["bench", "--model", "arch:llama", "--name", "a\tb"], ["audit", "--models", "arch:llama", "--summary", "s\n.md"],
], ids=["merge-o", "gate-summary", "claims-output", "atlas-build-dir", "bench-name", "audit-summary"])
def test_a_written_path_with_a_control_character_is_refused_before_anything_is_made(tmp_path, args):
    """Planted: a newline / ESC / tab in the name of a file or folder a command writes; `merge -o $'m7/\\nx'` made
    that folder and split its 'merged into' line. Refused as the arguments are read, before any file is (the results
    file here is never opened)."""
    (tmp_path / "r.json").write_text("{}")
    args = [str(tmp_path / "r.json") if a == "RESULTS" else a for a in args]
    proc = packcheck(*args, cwd=tmp_path)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(said) == 1 and "holds a control character" in said[0], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("args", [
    ["lookup", "lla\nma", "sdpa", "4.53.1"], ["lookup", "llama", "sd\x1bpa", "4.53.1"], ["lookup", "llama", "sdpa", "4.53\t.1"],
    ["bisect", "llama-sdpa-\nisolation-float32", "--good", "4.52.4", "--bad", "4.53.1"],
], ids=["lookup-model", "lookup-backend", "lookup-version", "bisect-cell"])
def test_a_positional_argument_with_a_control_character_is_one_line(tmp_path, args):
    """Planted: `packcheck lookup $'lla\\nma' sdpa 4.53.1` printed the model name over two lines ("architecture 'lla" /
    "ma' is not in the atlas") and an ESC reached the terminal. No positional argument of any command (a model type,
    backend, version, cell id or path) holds a control character: refused on one line, exit 2."""
    proc = packcheck(*args, cwd=tmp_path)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(said) == 1 and "holds a control character" in said[0], said
    assert "\x1b" not in proc.stdout + proc.stderr


def test_bisect_refuses_a_model_of_another_architecture_than_its_cell():
    """Planted: ``llama-sdpa-isolation-float32 --model arch:gpt2`` probed gpt2 and wrote its verdicts as llama's."""
    from pytest_packcheck.analysis.bisect import parse_cell_id

    with pytest.raises(PackcheckUsageError, match="--model 'arch:gpt2' builds gpt2, and the cell id .* names llama"):
        parse_cell_id("llama-sdpa-isolation-float32", "CELL", "arch:gpt2")
    with pytest.raises(PackcheckUsageError, match="builds roberta-encoder"):
        parse_cell_id("bert-encoder-sdpa-encoder_parity-float32", "CELL", "encoder:roberta")
    for cell, model in (("llama-sdpa-isolation-float32", "arch:llama{rope_theta=10.0}"),
                        ("llama+lora-sdpa-isolation-float32", "arch:llama"),
                        ("bert-encoder-sdpa-encoder_parity-float32", "encoder:bert")):
        assert parse_cell_id(cell, "CELL", model).model == model


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="sdpa")
    ids = torch.randint(1, 64, (1, 12))
    mask = torch.ones_like(ids)
    mask[0, [0, 5, 9]] = 0
    return config, LlamaForCausalLM(config).eval(), {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]),
                                                     "completion_mask": mask}


def test_a_model_on_the_meta_device_is_refused_by_both_guards(tiny_llama):
    """Planted: a model built under torch.device('meta'). verify_packed_logprobs gave a 'fail' verdict (cause crash:
    "Tensor on device meta is not on the expected device cpu"), verify_packed_batch the advice to move the batch to
    meta, which it then refuses."""
    import torch
    from transformers import LlamaForCausalLM

    from pytest_packcheck.guard import verify_packed_batch
    from pytest_packcheck.guard.rl import verify_packed_logprobs

    config, _, batch = tiny_llama
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    for check, row in ((verify_packed_logprobs, batch), (verify_packed_batch, {k: v for k, v in batch.items() if k != "completion_mask"})):
        with pytest.raises(PackcheckUsageError, match="the model's weights are on the meta device .*load them first") as info:
            check(meta, row)
        assert "\n" not in str(info.value) and "v.to('meta')" not in str(info.value)


def test_the_rl_guards_line_never_shows_a_number_it_did_not_measure(tiny_llama):
    """Planted: all-NaN trainer log-probs read "trainer's log-probs 0.00e+00"; a completion mask that scores nothing
    read "SKIPPED ...: model's packed row 0.00e+00 nats per token"."""
    import torch

    from pytest_packcheck.guard.rl import verify_packed_logprobs

    _, model, batch = tiny_llama
    nan = verify_packed_logprobs(model, batch, torch.full((1, 12), float("nan")))
    assert nan.verdict == "fail" and nan.cause == "non_finite" and "trainer's log-probs nan" in nan.line(), nan.line()
    skipped = verify_packed_logprobs(model, {**batch, "completion_mask": torch.zeros_like(batch["completion_mask"])},
                                     torch.zeros(1, 12))
    assert skipped.verdict == "skipped" and "e+00" not in skipped.line() and "scores no token" in skipped.line(), skipped.line()
    good = verify_packed_logprobs(model, batch)
    assert good.verdict == "pass" and "nats per token" in good.line()


@pytest.fixture(scope="module")
def qwen2_vl_row(tolerances):
    from test_multimodal_pixels import pixel_bench

    from pytest_packcheck.checks import pixels as P

    bench = pixel_bench("qwen2_vl", "sdpa", tolerances)
    return bench.model, P.pack(bench.model, P.mm_samples(bench))


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_pixels_fail_non_finite_never_pass(qwen2_vl_row, value):
    """Planted: NaN / inf pixel_values. NaN compares as within any tolerance: the pixel guard said PASS with
    "worst log-prob diff nan"."""
    from pytest_packcheck.guard import verify_packed_batch

    model, batch = qwen2_vl_row
    result = verify_packed_batch(model, {**batch, "pixel_values": batch["pixel_values"].clone().fill_(float(value))})
    assert (result.verdict, result.cause) == ("fail", "non_finite"), result.line()
    assert verify_packed_batch(model, batch).verdict == "pass"


def test_a_model_that_raises_on_a_pixel_row_is_a_crash_verdict(qwen2_vl_row, monkeypatch):
    """Planted: the vision tower raises (a broken model, hostile trial 5). The text row gives a `crash` verdict
    naming the exception; the pixel row let it out raw. Now the same verdict, with raise / warn as the caller asked."""
    from pytest_packcheck.guard import PackedBatchMismatch, verify_packed_batch

    model, batch = qwen2_vl_row
    visual = model.model.visual if hasattr(model.model, "visual") else model.visual

    def broken(*args, **kwargs):
        raise RuntimeError("planted: the vision tower is broken")

    monkeypatch.setattr(visual, "forward", broken)
    result = verify_packed_batch(model, batch, on_mismatch="return")
    assert (result.verdict, result.cause) == ("fail", "crash"), result.line()
    assert "RuntimeError: planted: the vision tower is broken" in result.evidence
    with pytest.raises(PackedBatchMismatch):
        verify_packed_batch(model, batch, on_mismatch="raise")


@pytest.mark.parametrize(("edit", "says"), [
    (lambda b: {"pixel_values": b["pixel_values"][:0]}, "it holds no values"),
    (lambda b: {"pixel_values": b["pixel_values"].reshape(-1)}, "asks 40 patch rows"),
    (lambda b: {"pixel_values": b["pixel_values"].repeat(2, 1)}, "asks 40 patch rows"),
    (lambda b: {"pixel_values": b["pixel_values"].tolist()}, "is a list: expected a tensor"),
    (lambda b: {"image_grid_thw": b["image_grid_thw"].float()}, "expected integer rows of (t, h, w)"),
    (lambda b: {"pixel_values": b["pixel_values"].to("meta")}, "meta device"),
], ids=["empty", "1-D", "surplus-rows", "list", "float-grid", "meta"])
def test_malformed_pixel_inputs_are_one_usage_line_not_a_traceback(qwen2_vl_row, edit, says):
    """Planted: each was a RuntimeError / TypeError from inside the vision tower or packcheck's split."""
    from pytest_packcheck.guard import verify_packed_batch

    model, batch = qwen2_vl_row
    with pytest.raises(PackcheckUsageError) as info:
        verify_packed_batch(model, {**batch, **edit(batch)})
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_an_audit_bench_that_cannot_fit_is_a_named_entry_not_a_run_without_end(tmp_path):
    """Planted: --bench-max-length 10**11 (and --bench-batch-size 10**8) ran the bench past any time limit after the
    audit; --bench-steps 10**9 the same. packcheck bench's own refusals, applied per model and up front."""
    import time

    started = time.perf_counter()
    proc = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--packcheck-report-dir", str(tmp_path / "r"),
                     "--bench", "uniform", "--bench-steps", "1", "--bench-max-length", str(10 ** 11), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    assert time.perf_counter() - started < 120
    bench = json.loads((tmp_path / "r" / "packcheck-matrix.json").read_text())["bench"]["results"]
    assert len(bench) == 1 and "needs about" in bench[0]["error"] and "--bench-max-length" in bench[0]["error"], bench
    steps = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--bench", "uniform", "--bench-steps",
                      str(10 ** 9), cwd=tmp_path)
    assert steps.returncode == 2 and "--bench-steps 1000000000 is over 10,000" in steps.stderr, steps.stderr


def test_embedding_ids_out_of_the_models_tables_are_one_usage_line():
    """Planted: BertModel with token_type_ids 7 (type_vocab_size 2) and position_ids up to 104 (64 learned
    positions): IndexError / RuntimeError tracebacks from the embedding lookup inside the forward."""
    import torch
    from transformers import BertConfig, BertModel

    from pytest_packcheck.guard import verify_packed_batch

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa")).eval()
    ids = torch.randint(1, 64, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
    for extra, says in (({"token_type_ids": torch.full_like(ids, 7)}, "holds 7, outside the model's type_vocab_size 2"),
                        ({"position_ids": pos + 100}, "reaches 104, past the model's learned position table of 64")):
        with pytest.raises(PackcheckUsageError, match=says):
            verify_packed_batch(model, {"input_ids": ids, "position_ids": pos, **extra})
    assert verify_packed_batch(model, {"input_ids": ids, "position_ids": pos,
                                       "token_type_ids": torch.zeros_like(ids)}).verdict == "pass"


def test_a_k_expression_pytest_cannot_parse_is_not_called_a_deselection(tmp_path):
    """Planted: ``-- -k 'llama and ('``: packcheck's line said "deselected by -k 'llama and ('" above pytest's
    "Wrong expression passed to '-k'"; nothing was deselected."""
    proc = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--", "-k", "llama and (", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "-k 'llama and (' does not parse" in out and "deselected by" not in out, out[-1500:]
    plain = packcheck("audit", *SMALL, "--packcheck-checks", "isolation", "--", "-k", "zzznothing", cwd=tmp_path)
    assert "deselected by -k 'zzznothing'" in plain.stdout + plain.stderr


def test_labels_a_token_classification_head_cannot_score_are_refused_not_left_out():
    """Planted: labels 9 on a 3-label BertForTokenClassification: the guard left the loss out ("loss diff n/a") and
    passed; the model's own loss would raise on them."""
    import torch
    from transformers import BertConfig, BertForTokenClassification

    from pytest_packcheck.guard import verify_packed_batch

    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                                  attn_implementation="sdpa")).eval()
    row = {"input_ids": torch.randint(1, 64, (1, 12)), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])}
    with pytest.raises(PackcheckUsageError, match="holds 9, outside the 3 outputs of BertForTokenClassification's head"):
        verify_packed_batch(model, {**row, "labels": torch.full((1, 12), 9)})
    good = verify_packed_batch(model, {**row, "labels": torch.randint(0, 3, (1, 12))})
    assert good.verdict == "pass" and good.loss_delta is not None


def test_an_ini_list_over_lines_is_one_item_per_line(tmp_path):
    """Planted: pytest's own ini list style, ``packcheck_models =`` then one spec per line: refused as "a control
    character" (the spec 'arch:llama\\narch:gpt2'); each line is now one item, as the flag's commas make them."""
    (tmp_path / "pytest.ini").write_text("[pytest]\npackcheck_models =\n    arch:llama\n    arch:gpt2\npackcheck_attn =\n"
                                         "    sdpa\n")
    proc = pytest_run("-p", "no:cacheprovider", "-q", "--packcheck-checks=isolation",
                      f"--packcheck-report-dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    cells = json.loads((tmp_path / "r" / "packcheck-matrix.json").read_text())["cells"]
    assert sorted(c["model"] for c in cells) == ["gpt2", "llama"]


def test_nan_encoder_outputs_are_never_a_small_number():
    """Planted: NaN in the encoder's weights printed "pooled embeddings 0.00e+00" beside the NaN (Python's max drops
    a NaN that is not first: max(0.0, nan) is 0.0); and a NaN after a finite example would have read as that
    example's small difference. Every number the line prints is nan, and the verdict is non_finite."""
    import math

    import torch
    from transformers import BertConfig, BertModel

    from pytest_packcheck.guard import verify_packed_batch
    from pytest_packcheck.results.metrics import worst as _worst

    assert math.isnan(_worst(1e-7, math.nan)) and math.isnan(_worst(math.nan, 1e-7)) and _worst(1e-7, 2e-7) == 2e-7
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight.fill_(float("nan"))
    row = {"input_ids": torch.randint(1, 64, (1, 12)), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])}
    result = verify_packed_batch(model, row)
    assert (result.verdict, result.cause) == ("fail", "non_finite"), result.line()
    assert "0.00e+00" not in result.line() and math.isnan(result.max_logprob_diff), result.line()
