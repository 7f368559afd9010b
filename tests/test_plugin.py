"""End-to-end through pytester: a real pytest run in an empty directory, asserting outcomes and files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pytest_packcheck.results.schema import read_results

pytest_plugins = ["pytester"]

FAST_BACKENDS = ("sdpa", "packcheck_flash_ref", "flash_attention_2")
FAST = [f"--packcheck-attn={','.join(FAST_BACKENDS)}", "-p", "no:cacheprovider"]
#: the correctness checks opt's sdpa cells fail (its packed mask leaks); every other default check passes there
OPT_SDPA_FAILS = {"isolation", "logits_parity", "loss_parity", "grad_parity", "backend", "edge_lengths"}
#: the hazards that show on sdpa for every model (a cache, an all-ones mask beside the packed row): xfails
SDPA_HAZARDS = {"cache_trap", "mask_trap"}


def _doc(pytester):
    return read_results(pytester.path / "reports" / "packcheck-matrix.json")


def default_cells(models: tuple[str, ...], backends: tuple[str, ...] = FAST_BACKENDS) -> list[tuple[str, str | None, str]]:
    """(model, backend, check) of every cell the default suite plans, read from the check registry: a model-level
    check once per model (backend None), the others once per backend but their ``skip_backends``. A check added to
    the default suite is counted here with no edit to this file."""
    from pytest_packcheck.checks.registry import DEFAULT_CHECKS, SPECS

    cells: list[tuple[str, str | None, str]] = []
    for model in models:
        cells += [(model, None, c) for c in DEFAULT_CHECKS if SPECS[c].level == "model"]
        cells += [(model, b, c) for b in backends for c in DEFAULT_CHECKS
                  if SPECS[c].level != "model" and b not in SPECS[c].skip_backends]
    return cells


def fast_outcome(model: str, backend: str | None, check: str) -> str:
    """The pytest outcome of a default cell of llama / opt under :data:`FAST`, from what is known of them: the
    flash_attention_2 cells are skipped (no CUDA here); collate's integer labels are a stack finding (transformers
    5.24, an xfail); the sdpa hazards show (xfails); opt leaks on sdpa (:data:`OPT_SDPA_FAILS` fail); the rest pass."""
    if backend == "flash_attention_2":
        return "skipped"
    if check == "collate" or (backend == "sdpa" and check in SDPA_HAZARDS):
        return "xfailed"
    if (model, backend) == ("opt", "sdpa") and check in OPT_SDPA_FAILS:
        return "failed"
    return "passed"


def _usage_error(pytester, *args):
    """A run that must stop at configure with a usage error, run in this process: the one-line message is the
    subject, not the process boundary (each subprocess imported torch and transformers again: about 2 s of CPU each,
    and the Did-you-mean lists of architectures more). Returns pytester's RunResult."""
    return pytester.runpytest_inprocess(*args, "-p", "no:cacheprovider")


def test_the_named_outcomes_name_default_checks_and_the_derivation_follows_the_registry(monkeypatch):
    """The names fast_outcome reads are default checks planned per backend (a renamed check fails here, not as a
    count); a check planted in the default suite adds one cell per model and backend, a model-level one one per
    model, one that skips sdpa none there."""
    import dataclasses

    from pytest_packcheck.checks import registry

    per_backend = {c for c in registry.DEFAULT_CHECKS if registry.SPECS[c].level != "model"}
    assert OPT_SDPA_FAILS | SDPA_HAZARDS <= per_backend and registry.SPECS["collate"].level == "model"
    before = default_cells(("llama", "opt"))
    base = registry.SPECS["isolation"]
    planted = {"planted_backend": dataclasses.replace(base, name="planted_backend"),
               "planted_model": dataclasses.replace(base, name="planted_model", level="model"),
               "planted_no_sdpa": dataclasses.replace(base, name="planted_no_sdpa", skip_backends=("sdpa",))}
    monkeypatch.setattr(registry, "SPECS", {**registry.SPECS, **planted})
    monkeypatch.setattr(registry, "DEFAULT_CHECKS", (*registry.DEFAULT_CHECKS, *planted))
    after = default_cells(("llama", "opt"))
    assert len(after) - len(before) == 2 * (len(FAST_BACKENDS) + 1 + len(FAST_BACKENDS) - 1)
    assert ("opt", None, "planted_model") in after and ("llama", "sdpa", "planted_no_sdpa") not in after


def test_items_outcomes_and_matrix(pytester):
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama,arch:opt", *FAST, "-rA")
    # every default check of the registry on 2 models x 3 backends (default_cells); flash_attention_2 is not on this
    # machine: skipped. llama: every correctness check passes; the cache and mask traps on sdpa (hazards) and
    # collate's integer labels (a stack finding, 5.24) are xfails. opt leaks on sdpa: OPT_SDPA_FAILS fail (the
    # other correctness checks pass); its traps there are xfails too (fast_outcome).
    planned = default_cells(("llama", "opt"))
    outcomes = Counter(fast_outcome(*c) for c in planned)
    result.assert_outcomes(**{k: outcomes[k] for k in ("passed", "failed", "skipped", "xfailed")})
    result.stdout.fnmatch_lines(["*packcheck summary*", "*matrix written: reports/packcheck-matrix.md*"])
    result.stdout.fnmatch_lines(["*PASSED packcheck::llama::packcheck?llama-packcheck_flash_ref-isolation-float32?*"])
    result.stdout.fnmatch_lines(["*FAILED packcheck::opt::packcheck?opt-sdpa-isolation-float32?*"])
    result.stdout.fnmatch_lines(["fail (leak; remedy: do not pack *): leak across boundaries: perturbing example 0 moved*"])
    doc = _doc(pytester)
    assert doc["schema_version"] == 3 and doc["environment"]["transformers"]  # schema 3: the file has the tables
    assert "models" in json.loads((pytester.path / "reports" / "packcheck-matrix.json").read_text()) and "models" not in doc
    cells = {c["cell_id"]: c for c in doc["cells"]}
    assert len(cells) == len(planned)
    assert sorted((c["model"]["label"], c["backend"] or "", c["check"]) for c in doc["cells"]) == sorted(
        (m, b or "", c) for m, b, c in planned)
    assert {c["check"] for c in doc["cells"] if c["status"] == "fail" and c["model"]["label"] == "opt" and c["backend"] == "sdpa"} == (
        OPT_SDPA_FAILS | SDPA_HAZARDS)
    assert cells["llama-sdpa-logits_parity-float32"]["metrics"]["max_abs_diff_solo"] < 1e-5
    assert cells["opt-sdpa-isolation-float32"]["status"] == "fail"
    assert cells["llama-flash_attention_2-backend-float32"]["status"] == "skipped"
    assert cells["llama-sdpa-backend-float32"]["model"]["model_class"] == "LlamaForCausalLM"
    md = (pytester.path / "reports" / "packcheck-matrix.md").read_text()
    assert "| llama" in md and "varlen reference (CPU, not FA2)" in md and "transformers" in md


def test_keyword_selection(pytester):
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama", *FAST, "-k", "llama-sdpa-loss_parity")
    result.assert_outcomes(passed=1, deselected=len(default_cells(("llama",))) - 1)
    assert [c["cell_id"] for c in _doc(pytester)["cells"]] == ["llama-sdpa-loss_parity-float32"]


def test_xdist_and_junitxml(pytester):
    pytest.importorskip("xdist")
    result = pytester.runpytest_subprocess("--packcheck-models=arch:llama,arch:qwen2", *FAST, "-n", "2",
                                           "--junitxml=out.xml", "--packcheck-checks=isolation,backend")
    result.assert_outcomes(passed=8, skipped=4)
    assert len(_doc(pytester)["cells"]) == 12  # results from both workers reach the controller
    xml = (pytester.path / "out.xml").read_text()
    assert 'name="packcheck[qwen2-sdpa-isolation-float32]"' in xml and 'property name="packcheck"' in xml


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["in-process", "xdist"])
def test_junitxml_property_is_scrubbed(pytester, workers):
    """A token typed into an override travels raw to the controller (the cell as run) but reaches --junitxml's
    <property name="packcheck"> scrubbed, as every report file does (trial: the raw hf_... in each cell's property)."""
    if workers:
        pytest.importorskip("xdist")
    token = "hf_PyTestSecret1234567890abcdefABCD"
    result = pytester.runpytest_subprocess(f'--packcheck-models=arch:llama{{note="{token}"}}', "--packcheck-attn=sdpa",
                                           "--packcheck-checks=isolation,logits_parity", "-p", "no:cacheprovider",
                                           "--junitxml=j.xml", *workers)
    result.assert_outcomes(passed=2)
    xml = (pytester.path / "j.xml").read_text()
    assert 'property name="packcheck"' in xml and xml.count("***") >= 2
    assert token not in xml and token not in result.stdout.str()
    assert len(_doc(pytester)["cells"]) == 2  # the results were recorded before the scrub


def test_hub_id_offline(pytester, offline_hub):
    result = pytester.runpytest_subprocess("--packcheck-models=meta-llama/Llama-3.2-1B", "--packcheck-attn=sdpa",
                                           "--packcheck-checks=logits_parity", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (cell,) = _doc(pytester)["cells"]
    assert cell["model"]["revision"] == offline_hub["meta-llama/Llama-3.2-1B"]
    assert cell["model"]["model_type"] == "llama" and cell["cell_id"] == "meta-llama/Llama-3.2-1B-sdpa-logits_parity-float32"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--packcheck-models=arch:llama", "--packcheck-attn=sdpaa"], "Unknown backend 'sdpaa' (from --packcheck-attn)*Did you mean 'sdpa'?"),
        (["--packcheck-models=arch:llama", "--packcheck-checks=isolaton"], "Unknown check 'isolaton'*Did you mean 'isolation'?"),
        (["--packcheck-models=arch:lama"], "Unknown architecture 'arch:lama' (from --packcheck-models)*Did you mean 'arch:llama'?*"),
        (["--packcheck-models=arch:bert-generation,arch:t5"], "*'t5' model with no causal-LM head*"),
        (["--packcheck-models=,"], "*model list*empty*"),
        (["--packcheck-models=not a model"], "Malformed model spec 'not a model' (from --packcheck-models)*"),
        (["--packcheck-models=org/name@"], "*names no revision*"),
        (["--packcheck-models=arch:llama", "--packcheck-dtypes=fp32"], "Unknown dtype 'fp32'*"),
        (["--packcheck-models=arch:llama", "--packcheck-tolerance=float32.logit_atol=1"], "Bad tolerance override*Did you mean 'logits_atol'?"),
    ],
)
def test_usage_errors_are_one_line(pytester, args, message):
    result = _usage_error(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: " + message])


def test_an_empty_shard_is_blamed_on_the_shard(pytester):
    """Shard 3/3 of two models holds none: the error names the shard and the N that works, not the filters."""
    result = _usage_error(pytester, "--packcheck-models=arch:llama,arch:opt", "--packcheck-attn=sdpa",
                          "--packcheck-checks=isolation", "--packcheck-shard=3/3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *shard 3/3 (from --packcheck-shard*) holds no model: the 2 models go to shards 1..2; use N <= 2."])
    result.stderr.no_fnmatch_line("*--packcheck-attn / --packcheck-checks*")


def test_hub_errors_offline(pytester, offline_hub):
    result = _usage_error(pytester, "--packcheck-models=nobody/missing-model")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([("ERROR: Model 'nobody/missing-model' (from --packcheck-models) is not in the local Hub cache*HF_HUB_OFFLINE=1*"
                                 "`hf download nobody/missing-model config.json`*")])


def test_remote_code_refused(pytester, tmp_path):
    model_dir = tmp_path / "custom"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "custom", "auto_map": {"AutoConfig": "x.Config"}}))
    result = _usage_error(pytester, f"--packcheck-models={model_dir}")
    result.stderr.fnmatch_lines(["ERROR: Model *custom* needs trust_remote_code*--packcheck-trust-remote-code*"])


def test_plugin_inactive_without_models(pytester):
    pytester.makepyfile("def test_x(): assert True")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "reports").exists()


def test_plugin_import_is_light():
    import subprocess
    import sys

    code = "import sys, pytest_packcheck.plugin; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_local_directory_with_pretrained_weights(pytester, tmp_path):
    """--packcheck-weights=pretrained loads saved weights with from_pretrained (local directory spec)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tiny-llama")
    result = pytester.runpytest_subprocess(f"--packcheck-models={tmp_path / 'tiny-llama'}", "--packcheck-weights=pretrained",
                                           "--packcheck-attn=sdpa", "--packcheck-checks=isolation,logits_parity", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    cells = _doc(pytester)["cells"]
    assert {c["cell_id"] for c in cells} == {"tiny-llama-sdpa-isolation-float32", "tiny-llama-sdpa-logits_parity-float32"}
    assert cells[0]["model"]["kind"] == "local"


def test_missing_revision_offline(pytester, offline_hub):
    result = _usage_error(pytester, "--packcheck-models=meta-llama/Llama-3.2-1B@v9.9")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([("ERROR: Model 'meta-llama/Llama-3.2-1B@v9.9' (from --packcheck-models) is not in the local Hub cache at revision 'v9.9'*"
                                 # the fix fetches that revision, not main (trial 19, 123)
                                 "`hf download meta-llama/Llama-3.2-1B config.json --revision v9.9`*")])


def test_report_path_that_is_a_directory_is_a_usage_error(pytester):
    (pytester.path / "out" / "packcheck-matrix.md").mkdir(parents=True)
    result = _usage_error(pytester, "--packcheck-models=arch:llama", "--packcheck-report-dir=out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: 'out/packcheck-matrix.md' (in --packcheck-report-dir) is a directory*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--packcheck-models=arch:t5", "-n", "2"], "*'t5' model with no causal-LM head*"),
        (["--packcheck-models=", ], "The model list from --packcheck-models is empty*"),
        (["--packcheck-models=arch:llama", "--packcheck-report-dir=/proc/nope"], "Report directory '/proc/nope' (from --packcheck-report-dir) is not writable*"),
        (["--packcheck-models=arch:llama", "--packcheck-device=cuda"], "Device 'cuda' (from --packcheck-device) is not available*"),
        (["--packcheck-models=llama"], "*not in the local Hub cache*did you mean arch:llama)."),
    ],
)
def test_more_usage_errors(pytester, offline_hub, args, message):
    pytest.importorskip("xdist")
    # with -n, xdist starts its workers: that one runs as a user starts it, in its own process
    result = (pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider") if "-n" in args else _usage_error(pytester, *args))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: " + message])


def test_tolerance_file_values_are_checked(pytester, tmp_path):
    bad = tmp_path / "tol.toml"
    bad.write_text('[float32]\nlogits_atol = "abc"\n')
    result = _usage_error(pytester, "--packcheck-models=arch:llama", f"--packcheck-tolerances={bad}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: Tolerance float32.logits_atol = 'abc' in * must be a finite number >= 0."])


@pytest.mark.parametrize("how", ["-p", "pytest_plugins"])
def test_plugin_named_by_module_beside_the_entry_point_is_one_plugin(pytester, how):
    """`-p pytest_packcheck.plugin` (or a conftest's pytest_plugins) beside the installed entry point: pytest
    refused the second name ("Plugin already registered under a different name"); now it is one plugin."""
    pytester.makepyfile(test_a="def test_fixture(packcheck_verify):\n    assert callable(packcheck_verify)\n")
    args = ["-p", "no:cacheprovider"]
    if how == "-p":
        args += ["-p", "pytest_packcheck.plugin"]
    else:
        pytester.makeconftest('pytest_plugins = ["pytest_packcheck.plugin"]\n')
    result = pytester.runpytest_subprocess(*args)
    assert "already registered" not in result.stderr.str() + result.stdout.str()
    result.assert_outcomes(passed=1)


def test_entry_point_name_is_the_one_in_pyproject():
    from pathlib import Path

    import tomllib

    from pytest_packcheck import plugin

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {plugin.ENTRY_POINT: plugin.__name__}


@pytest.mark.parametrize(("param", "message"), [
    (lambda: None, "packcheck_verify's parameter is a function"),
    ("arch:llama", "packcheck_verify's parameter is a str ('arch:llama')"),
    ((1, 2, 3), "packcheck_verify's parameter is a 3-item tuple"),
    ({"model": 1}, "packcheck_verify's parameter has no 'batch' key (keys: 'model')"),
    (None, "packcheck_verify's parameter is a NoneType"),
])
def test_fixture_parameter_that_is_not_model_and_batch_is_one_line(param, message):
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.plugin import _fixture_param

    with pytest.raises(PackcheckUsageError) as info:
        _fixture_param(param)
    assert message in str(info.value) and "(model, batch) or {'model'" in str(info.value) and "\n" not in str(info.value)


def test_fixture_parameter_refused_through_pytest_shows_no_traceback_into_packcheck(pytester):
    """A wrong indirect parameter (a dict without "batch", a string) errors at setup with the one-line usage error:
    it showed a traceback ending inside pytest_packcheck/plugin.py."""
    pytester.makepyfile(test_a='''
import pytest

@pytest.mark.parametrize("packcheck_verify", [{"model": 1}, "arch:llama"], indirect=True)
def test_x(packcheck_verify):
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*PackcheckUsageError: packcheck_verify's parameter has no 'batch' key (keys: 'model')*"])
    result.stdout.fnmatch_lines(["*PackcheckUsageError: packcheck_verify's parameter is a str ('arch:llama')*"])
    assert "plugin.py" not in out and "raise PackcheckUsageError" not in out


def test_fixture_given_a_callable_or_an_unknown_option_is_a_usage_error(pytester):
    """Through pytest, as a user writes it: a callable as the indirect parameter, an unknown option, and a
    callable where the model goes (verify_packed_batch's own refusal): each a one-line PackcheckUsageError."""
    pytester.makepyfile(test_a='''
import pytest

@pytest.mark.parametrize("packcheck_verify", [lambda: ("model", "batch")], indirect=True)
def test_callable_param(packcheck_verify):
    pass

def test_unknown_option(packcheck_verify):
    packcheck_verify(None, {}, on_mismtach="warn")

def test_callable_model(packcheck_verify):
    packcheck_verify(lambda: None, {})
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, failed=2)
    result.stdout.fnmatch_lines(["*PackcheckUsageError: packcheck_verify's parameter is a function*"])
    result.stdout.fnmatch_lines(["*PackcheckUsageError: packcheck_verify: unknown option 'on_mismtach': it takes *"])
    result.stdout.fnmatch_lines(["*PackcheckUsageError: verify_packed_batch: model is a function without a config*"])


def test_fixture_called_with_a_batch_it_refuses_shows_no_traceback_into_packcheck(pytester):
    """`packcheck_verify(model, unpacked_batch)` in a user's test showed a full traceback through packcheck's own
    guard/batch.py (docstring and source), while the parametrized form gives one line (trial 4, 269)."""
    pytester.makepyfile(test_a='''
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def test_x(packcheck_verify):
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    packcheck_verify(model, {"input_ids": torch.ones(2, 3, dtype=torch.long)})
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["NotPackedError: verify_packed_batch: batch*has shape (2, 3)*"])  # the whole failure
    assert "guard/batch.py" not in out and "During handling" not in out and "raise " not in out, out[-3000:]


def test_packcheck_options_without_models_say_packcheck_is_off(pytester):
    """`pytest --packcheck-attn sdpa` in a folder of plain tests, without models, was silently ignored: one line
    now names the options given and how to switch packcheck on; a plain run prints no such line."""
    pytester.makepyfile(test_plain="def test_a():\n    assert True\n")
    result = pytester.runpytest_inprocess("--packcheck-attn", "sdpa")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["packcheck: off: --packcheck-attn given but no models, so packcheck ran nothing; *--packcheck-models*"])
    assert "packcheck: off" not in pytester.runpytest_inprocess().stdout.str()


def test_a_mismatch_through_the_fixture_shows_the_diagnosis_not_packchecks_source(pytester):
    """Trial 7, 148: a packcheck_verify mismatch printed 139 lines walking through packcheck's plugin.py and
    verify.py source, where a usage error is one line. The guard's frames are hidden when what they raise is the
    mismatch (pytest's __tracebackhide__): the user's line and the diagnosis remain."""
    pytester.makepyfile(test_a='''
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, OPTConfig

def test_opt_packs(packcheck_verify):
    torch.manual_seed(0)
    config = OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128,
                       max_position_embeddings=64, word_embed_proj_dim=32)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    row = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": list(range(3, 14))},
                                                                 {"input_ids": list(range(20, 33))}])
    packcheck_verify(model, row)
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*PackedBatchMismatch: packcheck guard: FAIL*leak*"])
    assert "packcheck_verify(model, row)" in out  # the user's own line
    assert "verify.py" not in out and "plugin.py" not in out and "def verify_packed_batch" not in out, out
