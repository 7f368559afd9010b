"""packcheck bench on CPU: the machinery (a smoke test, no speed claims) and its arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results.schema import read_results
from pytest_packcheck.run.throughput import PROFILES, run_bench, sample_lengths


def test_profiles_are_shaped_as_documented(tmp_path):
    flan, orca = sample_lengths("flan", 2000, 4096), sample_lengths("orcamath", 2000, 4096)
    import statistics

    def cv(xs):
        return statistics.pstdev(xs) / statistics.fmean(xs)

    assert sorted(flan)[1000] < sorted(orca)[1000]  # shorter
    assert cv(flan) > 2 * cv(orca)  # and much more variable
    assert set(sample_lengths("fixed", 5, 4096)) == {512} and max(sample_lengths("uniform", 50, 100)) <= 100
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("10\n20\n")
    assert sample_lengths(str(lengths), 3, 15) == [10, 15, 10]
    lengths.write_text("10\nabc\n")
    with pytest.raises(PackcheckUsageError, match="line 2: 'abc'"):
        sample_lengths(str(lengths), 3, 15)
    with pytest.raises(PackcheckUsageError, match="Unknown length profile 'flna'"):
        sample_lengths("flna", 3, 15)
    assert "flan" in PROFILES


def test_bench_same_examples_same_first_loss(tolerances):
    """Padded and packed see the same examples: the first step's token-mean loss is equal (same weights);
    the padding overhead and the ideal speedup follow from the lengths."""
    from conftest import make_bench

    model = make_bench("llama", "sdpa", tolerances).model
    r = run_bench(model, profile="flan", steps=2, warmup=1, batch_size=6, max_length=96, seed=3)
    pad, pack = r["runs"]["padded"], r["runs"]["packed"]
    assert pad["useful_tokens_per_step"] == pack["useful_tokens_per_step"] > 0
    assert pack["tokens_per_step"] < pad["tokens_per_step"]
    assert r["loss_first_step_delta"] < 1e-4
    assert r["ideal_speedup"] == pytest.approx(1 + r["padding_overhead"], abs=1e-3)
    assert r["speedup"] > 0 and isinstance(r["instrumentation_overhead"], float)
    assert pad["peak_memory_mib"] is None  # CPU: no memory claim


def test_bench_cli_writes_markdown_and_json(tmp_path):
    out = tmp_path / "out"
    proc = packcheck("bench", "--steps", "1", "--warmup", "1", "--batch-size", "4", "--max-length", "64", "--profile", "flan",
                     "-o", out)  # in this process (tests/cli_inprocess.py): the files and the exit code
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["results"][0]["profile"] == "flan" and data["environment"]["torch"]
    assert "smoke test" in (out / "bench.md").read_text()
    bad = packcheck("bench", "--attn", "sdpaa")
    assert bad.returncode == 2 and "Unknown backend 'sdpaa' (from --attn)" in bad.stderr


def test_bench_cli_refuses_a_backend_that_cannot_run_here(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "bench", "--attn", "packcheck_flash_torch_varlen",
                           "-o", str(tmp_path)], capture_output=True, text=True, check=False, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PACKCHECK_TORCH_VARLEN_STAND_IN"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Backend 'packcheck_flash_torch_varlen' (from --attn) cannot run on cpu: needs a CUDA device" in proc.stderr


def test_bench_cli_keeps_the_profiles_measured_before_one_fails(tmp_path, monkeypatch, capsys):
    """A profile that crashes (an OOM on the GPU, say) becomes an entry with its reason; the figures of the
    profiles before and after it are written."""
    from pytest_packcheck import cli
    from pytest_packcheck.run import throughput as bench

    real = bench.run_bench

    def flaky(model, **kwargs):
        if kwargs["profile"] == "uniform":
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, **kwargs)

    monkeypatch.setattr(bench, "run_bench", flaky)
    rc = cli.main(["bench", "--steps", "1", "--warmup", "1", "--batch-size", "3", "--max-length", "48", "--no-instrumentation",
                   "--profile", "flan", "--profile", "uniform", "--profile", "fixed", "-o", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert [r["profile"] for r in results] == ["flan", "uniform", "fixed"]
    assert "speedup" in results[0] and "speedup" in results[2] and "out of memory" in results[1]["error"]
    assert "uniform: not measured: RuntimeError: CUDA out of memory" in (tmp_path / "bench.md").read_text()


def test_gpu_bench_path_rehearsed_on_cpu_in_bf16(tmp_path):
    """The command tools/gpu_check.sh runs on the GPU (torch varlen backend, bfloat16, instrumentation on),
    on CPU through the stand-in kernel: the md names the stand-in, the JSON records it."""
    env = {**os.environ, "PACKCHECK_TORCH_VARLEN_STAND_IN": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "bench", "--attn", "packcheck_flash_torch_varlen",
                           "--dtype", "bfloat16", "--steps", "2", "--warmup", "1", "--batch-size", "4", "--max-length", "64",
                           "--profile", "flan", "-o", str(tmp_path), "--name", "gpu-bench"],
                          capture_output=True, text=True, check=False, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert data["environment"]["torch_varlen_kernel"] == "stand-in"
    r = data["results"][0]
    assert r["dtype"] == "bfloat16" and r["loss_first_step_delta"] < 5e-2 and "instrumentation_overhead" in r
    assert "CPU STAND-IN" in (tmp_path / "gpu-bench.md").read_text()


def test_targets_are_judged_on_cuda_only(tmp_path):
    """audit/bench_targets.toml: on CUDA each target is met or missed from the measured figure; on CPU listed,
    not judged. A planted shortfall (1.5x against 1.8x) is missed; a bad targets file is refused by name."""
    from pytest_packcheck.report.bench import _targets_summary
    from pytest_packcheck.run.throughput import judge_targets, load_targets

    targets = load_targets()
    assert targets["flan"]["min_speedup"] == 1.8 and targets["all"]["max_instrumentation_overhead"] == 0.02
    good = {"profile": "flan", "speedup": 2.4, "fraction_of_ideal": 0.9, "memory_reduction": 0.3, "instrumentation_overhead": 0.004}
    judged = judge_targets(good, targets, "cuda")
    assert len(judged) == 4 and all(t["met"] for t in judged) and _targets_summary(judged) == "4/4 met"
    short = judge_targets({**good, "speedup": 1.5}, targets, "cuda:0")
    assert _targets_summary(short) == "3/4 met (missed: min_speedup)"
    assert all(t["met"] is None for t in judge_targets(good, targets, "cpu"))
    assert [t["target"] for t in judge_targets({**good, "profile": "orcamath"}, targets, "cuda")] == ["max_instrumentation_overhead"]
    bad = tmp_path / "targets.toml"
    bad.write_text("[flan]\nmin_speedupp = 1.8\n")
    with pytest.raises(PackcheckUsageError, match="min_speedupp = 1.8"):
        load_targets(bad)


def _model_on_a_planted_clock(monkeypatch, tolerances, cost):
    """A tiny llama whose every forward advances bench's clock by ``cost(call number, input_ids)`` seconds."""
    from conftest import make_bench

    from pytest_packcheck.run import throughput as bench

    clock = {"t": 0.0, "calls": 0}

    class Clock:
        @staticmethod
        def perf_counter():
            return clock["t"]

    model = make_bench("llama", "sdpa", tolerances).model
    original_forward = model.forward

    def forward(*args, **kwargs):
        clock["calls"] += 1
        clock["t"] += cost(clock["calls"], kwargs["input_ids"])
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(bench, "time", Clock)
    monkeypatch.setattr(model, "forward", forward)
    return model


def test_speedup_and_ideal_use_the_same_aggregation(monkeypatch, tolerances):
    """With step time exactly proportional to the tokens a step computes on (perfect packing), the measured
    speedup must equal the ideal one. A median of per-step rates would not (helper review: 0.888 of ideal on the
    flan lengths); planted here by a clock that advances by the batch's token count."""
    from pytest_packcheck.run import throughput as bench

    model = _model_on_a_planted_clock(monkeypatch, tolerances, lambda call, ids: ids.numel() * 1e-3)
    r = bench.run_bench(model, profile="flan", steps=6, warmup=1, batch_size=6, max_length=200, seed=5, instrumentation=False)
    assert r["ideal_speedup"] > 1.3
    assert r["speedup"] == pytest.approx(r["ideal_speedup"], rel=2e-3) and r["fraction_of_ideal"] == pytest.approx(1.0, abs=3e-3)
    assert r["speedup_per_step"]["min"] <= r["speedup_per_step"]["median"] <= r["speedup_per_step"]["max"]


def test_modes_are_interleaved_so_first_step_costs_hit_both(monkeypatch, tolerances):
    """Identical batches (fixed lengths, no padding) under a planted drift: every forward costs a little less
    than the one before (clocks ramping, caches warming). Run padded-then-packed, padded ran in the slow phase
    (here it would read 1.145x; the helper review measured 1.93x on identical batches with --warmup 0). Rotating
    the order each step shares the drift: within 3 % of 1.0. --warmup 0 is refused."""
    from pytest_packcheck.run import throughput as bench

    # calls 1-2 are the no-grad first-loss probes
    model = _model_on_a_planted_clock(monkeypatch, tolerances, lambda call, ids: 1.0 + 0.2 * max(0, 40 - call))
    r = bench.run_bench(model, profile="fixed", steps=4, warmup=1, batch_size=2, max_length=40, instrumentation=True)
    assert r["ideal_speedup"] == 1.0 and abs(r["speedup"] - 1) < 0.03 and abs(r["instrumentation_overhead"]) < 0.03
    assert r["loss_first_step_delta"] < 1e-4
    with pytest.raises(PackcheckUsageError, match="warmup >= 1"):
        bench.run_bench(model, profile="fixed", steps=1, warmup=0, batch_size=2, max_length=40)


def test_bench_cli_refuses_bad_input_before_measuring(tmp_path):
    """Each refused before the model is built, in one line naming the value, its flag and the fix."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    cases = [
        # issue 28: `--device tpu` went on to build the model (never refused up front)
        (["--device", "tpu"], "Unknown device 'tpu' (from --device). Expected cpu, cuda or cuda:N"),
        (["--device", "cudax"], "Unknown device 'cudax' (from --device)"),
        (["--warmup", "0"], "--warmup 0 must be >= 1 (the first step of each mode pays one-time costs"),
        (["--max-length", "1"], "--max-length 1 must be >= 2"),
        (["--name", "../escape"], "--name '../escape' must be a file name stem without a path"),
        # a token as --name named the files and was printed with their paths: refused, never echoed
        (["--name", "sk-TrIaL2skSecret0123456789abcdef"], "--name looks like an access token"),
        (["--name", ""], "Empty value '' for --name (from the command line)"),  # the one rule for empty values
        (["-o", str(blocker / "sub")], f"Output directory '{blocker / 'sub'}' (from -o/--output-dir) is not writable"),
        (["--attn", "flex_attention"], "Backend 'flex_attention' (from --attn) cannot train on cpu: flex_attention has no backward"),
        (["--profile", str(tmp_path / "missing.txt")], f"Length file '{tmp_path / 'missing.txt'}' (from --profile) does not exist"),
    ]
    for args, message in cases:  # each in this process (tests/cli_inprocess.py): the line and the exit code
        proc = packcheck("bench", *args, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr[-1500:])
        assert message in proc.stderr and "TrIaL" not in proc.stderr + proc.stdout, (args, proc.stderr)
    assert not (tmp_path / "reports").exists()


def test_bench_terminal_line_carries_the_markdowns_caveats_and_percentages(tmp_path, monkeypatch, capsys):
    """The terminal printed "orcamath: speedup 9.76x (ideal 1.00x), padding 0 %, memory saved n/a, instrumentation
    16.9641": none of the Markdown's caveats (smoke test, 976 % of the ideal) and a raw fraction where the Markdown
    writes +1696.4 % (trial 6, 138). The line now uses the Markdown's formatters and caveats."""
    from pytest_packcheck import cli
    from pytest_packcheck.run import throughput as bench

    real = bench.run_bench

    def noisy(model, **kwargs):  # the trial's figures: CPU timing noise on one step
        return {**real(model, **kwargs), "speedup": 9.76, "ideal_speedup": 1.0, "fraction_of_ideal": 9.76,
                "instrumentation_overhead": 16.9641}

    monkeypatch.setattr(bench, "run_bench", noisy)
    rc = cli.main(["bench", "--steps", "1", "--warmup", "1", "--batch-size", "2", "--max-length", "48", "--profile", "fixed",
                   "-o", str(tmp_path)])
    out, md = capsys.readouterr().out, (tmp_path / "bench.md").read_text()
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("fixed: speedup"))
    assert line == ("fixed: speedup 9.76x (ideal 1.00x, 976 % of ideal), padding 0 %, peak memory saved n/a (CPU), "
                    "instrumentation overhead +1696.4 %; CPU run: a smoke test of the machinery, not a speed claim."), line
    assert "| +1696.4 %" in md and "n/a (CPU)" in md and "CPU run: a smoke test of the machinery, not a speed claim." in md
    after = out.splitlines()[out.splitlines().index(line) + 1:][:2]  # the Markdown's caveats of this profile, in its order
    assert after[0] == "  fixed: 4 of 4 lengths were clipped to max_length 48." and "- fixed: 4 of 4 lengths were clipped" in md
    caveat = "fixed: the measured speedup is 976 % of the ideal one."
    assert after[1].startswith(f"  {caveat}") and f"- {caveat}" in md, after


def test_bench_page_states_clipping_and_a_speedup_above_the_ideal():
    from pytest_packcheck.report.bench import bench_caveats

    r = {"profile": "big.txt", "steps": 2, "warmup": 1, "batch_size": 4, "max_length": 64, "fraction_of_ideal": 2.14,
         "lengths": {"clipped_to_max_length": 12}}
    lines = bench_caveats([r])
    assert lines[0] == "- big.txt: 12 of 12 lengths were clipped to max_length 64."
    assert "214 % of the ideal one" in lines[1]
    assert bench_caveats([{**r, "fraction_of_ideal": 0.93, "lengths": {"clipped_to_max_length": 0}}]) == []


def test_clipping_is_counted_on_the_draw_itself():
    """uniform draws within its range (nothing to clip, also below 16 tokens); a file's long lines are clipped."""
    from pytest_packcheck.run.throughput import raw_lengths, sample_lengths

    raw = raw_lengths("uniform", 64, 512)
    assert max(raw) <= 512 and sum(x > 512 for x in raw) == 0
    assert set(sample_lengths("uniform", 20, 8)) <= set(range(2, 9))  # max_length below uniform's 16: no crash
    assert raw_lengths("flan", 200, 64) == raw_lengths("flan", 200, 4096)  # drawn independently of the cap


def test_bench_warning_counts_only_checks_that_bear_on_the_benched_computation():
    """A speedup is marked when isolation / logits / loss / grads / positions / backend failed on the benched
    backend and dtype; cache_trap and mask_trap judge other calls (bench runs use_cache=False, no mask), and an
    inconclusive (error) cell is not a verdict."""
    from pytest_packcheck.report.bench import _packing_fails

    r = {"model": {"label": "llama"}, "attn_implementation": "sdpa", "dtype": "float32"}

    def cell(check, status, dtype="float32", backend="sdpa"):
        return {"model": {"label": "llama"}, "backend": backend, "dtype": dtype, "check": check, "status": status}

    assert _packing_fails([cell("cache_trap", "fail"), cell("mask_trap", "fail"), cell("isolation", "pass"),
                           cell("isolation", "error")], r) == []
    assert _packing_fails([cell("isolation", "fail"), cell("logits_parity", "fail", dtype="bfloat16"),
                           cell("loss_parity", "fail", backend="eager")], r) == ["isolation"]


def test_verdict_changes_lists_a_planted_change_with_its_evidence(tmp_path, capsys):
    """tools/verdict_changes.py (the all-architectures comparison in the notes): one correctness cell of the
    committed matrix turned into a leak is the one changed matrix cell, with its check and number."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("verdict_changes", root / "tools" / "verdict_changes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = read_results(root / "reports" / "packcheck-matrix.json")
    (tmp_path / "old.json").write_text(json.dumps(doc))
    cell = next(c for c in doc["cells"] if c["cell_id"] == "llama-sdpa-isolation-float32")
    assert cell["status"] == "pass"
    cell.update(status="fail", cause="leak", message="leak across boundaries", diagnosis={"cause": "leak"})
    cell["metrics"]["max_change"] = 0.25
    (tmp_path / "new.json").write_text(json.dumps(doc))
    assert module.main([str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--backend", "sdpa"]) == 0
    out = capsys.readouterr().out
    assert "1 matrix cells changed verdict" in out
    line = next(line for line in out.splitlines() if line.startswith("llama "))
    assert "pass" in line and "fail (leak)" in line and "isolation: Δ 2.5e-01" in line
    assert module.main([str(tmp_path / "old.json"), str(tmp_path / "missing.json")]) == 2
