"""A fourth hostile trial, as a new user from README.md (helper G, ~600 tries: CLI flags and env vars, the guard's
inputs, signals, damaged journals, full disks): each failure it found that had a small fix, reproduced here.

- A model spec the Hub's own validator refuses (``org/név``, 5000 characters) was an INTERNALERROR traceback (exit 3)
  from huggingface_hub's ``HFValidationError``; now one line, exit 2.
- A control character in a spec (a newline in ``org/model@rev``) split the error over lines; now refused at parse.
- An ``arch:`` typo imported every multimodal model's module to choose its suggestion; now only the near ones.
- ``verify_packed_logprobs`` compared integer / bool / complex "log-probs" (token ids handed over) as numbers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_packcheck.errors import PackcheckUsageError


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("spec", ["org/név", "x" * 300, "a--b/c"], ids=["unicode", "long", "double-dash"])
def test_a_hub_id_the_hub_refuses_is_one_usage_line(spec):
    """Planted: IDs huggingface_hub's validate_repo_id refuses; read_config_dict let its HFValidationError out."""
    from pytest_packcheck.model.configs import read_config_dict
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError, match="neither a local folder nor a Hub model ID") as info:
        read_config_dict(parse_model_spec(spec, "--packcheck-models"), "--packcheck-models")
    text = str(info.value)
    assert "\n" not in text and "from --packcheck-models" in text and "arch:<model_type>" in text
    assert len(text) < 600, text  # a 300-character ID is shortened, with its length


def test_the_audit_says_it_in_one_line_and_exits_2(tmp_path):
    proc = _cli(["audit", "--models", "org/név", "--packcheck-attn", "sdpa", "-n", "0", "-q",
                 "--packcheck-report-dir", str(tmp_path / "r")], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.strip()][-1].startswith("ERROR: Model 'org/név'")
    assert not (tmp_path / "r" / "packcheck-matrix.json").exists()


@pytest.mark.parametrize("spec", ["org/model@rev\nwith newline", "arch:llama\t", "org/mo\x1bdel"])
def test_a_control_character_in_a_spec_is_refused_on_one_line(spec):
    from pytest_packcheck.model.specs import parse_model_spec

    if spec.strip() != spec:  # surrounding whitespace is stripped, as before: a trailing tab is no error
        assert parse_model_spec(spec, "--packcheck-models").name == "llama"
        return
    with pytest.raises(PackcheckUsageError, match="holds a control character") as info:
        parse_model_spec(spec, "--packcheck-models")
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_an_arch_typo_asks_only_the_near_multimodal_names(monkeypatch):
    """Planted: a counter on mrope_text_path (it imports a model's module). Before, the suggestion asked it of every
    multimodal model_type of the installed transformers (mrope_text_path_architectures)."""
    from pytest_packcheck.model import architectures, resolve
    from pytest_packcheck.model.specs import parse_model_spec

    asked: list[str] = []
    real = architectures.mrope_text_path

    def counted(model_type):
        asked.append(model_type)
        return real(model_type)

    monkeypatch.setattr(architectures, "mrope_text_path", counted)
    monkeypatch.setattr(resolve, "mrope_text_path", counted)
    for typo, meant in (("lama", "llama"), ("qwen2vl", "qwen2_vl"), ("glm4v_x", "glm4v")):
        asked.clear()
        with pytest.raises(PackcheckUsageError, match=rf"Did you mean 'arch:{meant}'\?"):
            resolve.resolve_model(parse_model_spec(f"arch:{typo}", "--packcheck-models"), "--packcheck-models")
        assert len(asked) <= 4, asked


def test_an_arch_typo_is_matched_without_the_arch_prefix():
    """Planted: the shared ``arch:`` counted toward difflib's ratio, so ``arch:nosuch`` was offered ``arch:moshi``
    (hostile trial 4): 'nosuch' and 'moshi' alone are not close (ratio 0.55), and no name is offered."""
    from pytest_packcheck.model import resolve
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as caught:
        resolve.resolve_model(parse_model_spec("arch:nosuch", "--packcheck-models"), "--packcheck-models")
    assert "Unknown architecture 'arch:nosuch'" in str(caught.value)
    assert "Did you mean" not in str(caught.value), str(caught.value)


@pytest.fixture(scope="module")
def rl_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _rl_row():
    ids = [3, 4, 5, 9, 10, 11, 6, 7, 12, 13, 14]
    pos = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "completion_mask": torch.tensor([mask])}


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool, torch.complex64])
def test_logprobs_that_are_not_real_numbers_are_refused(rl_model, dtype):
    """Planted: the row's token ids (or its mask) handed over as the trainer's log-probs; they were compared as numbers
    and read as a packed_mismatch of ~5 nats."""
    from pytest_packcheck.guard import verify_packed_logprobs

    batch = _rl_row()
    bad = batch["input_ids"].to(dtype) if dtype != torch.bool else batch["completion_mask"].bool()
    with pytest.raises(PackcheckUsageError, match=rf"logprobs has dtype {dtype}: it holds real numbers"):
        verify_packed_logprobs(rl_model, batch, bad)
    with pytest.raises(PackcheckUsageError, match="per_token_loss has dtype"):
        verify_packed_logprobs(rl_model, batch, None, per_token_loss=bad, loss=0.5, loss_type="token_mean")


def test_float_logprobs_and_a_whole_number_loss_are_still_taken(rl_model):
    from pytest_packcheck.guard import verify_packed_logprobs

    batch = _rl_row()
    with torch.no_grad():
        logits = rl_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    lp = torch.full((11,), float("nan"))
    lp[1:] = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, batch["input_ids"][0, 1:, None])[:, 0].float()
    assert verify_packed_logprobs(rl_model, batch, lp[None]).verdict == "pass"
    assert verify_packed_logprobs(rl_model, batch, lp.tolist()).verdict == "pass"  # a list of floats, as before
    result = verify_packed_logprobs(rl_model, batch, lp[None], per_token_loss=torch.zeros(1, 11), loss=0,
                                    loss_type="token_mean")
    assert result.verdict == "pass", result.line()


BLOCK_FIND_SPEC = '''
import importlib.util, os
_real = importlib.util.find_spec
_gone = set(os.environ["PACKCHECK_TRIAL_MISSING"].split(","))
importlib.util.find_spec = lambda name, *a, **k: None if name in _gone else _real(name, *a, **k)
'''


@pytest.mark.parametrize(("example", "missing"), [("guard_trainer.py", "accelerate"), ("guard_sft.py", "trl,datasets")])
def test_an_example_without_its_extra_says_what_to_install(tmp_path, example, missing):
    """Planted: the packages a fresh ``pip install -e .`` lacks hidden from the example (its find_spec says not
    installed). README said the examples run on CPU in seconds; guard_trainer.py ended in transformers' ImportError
    traceback (accelerate), guard_sft.py in ModuleNotFoundError: datasets."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_FIND_SPEC)
    repo = Path(__file__).resolve().parent.parent
    env = {**__import__("os").environ, "PYTHONPATH": f"{site}:{repo}", "PACKCHECK_TRIAL_MISSING": missing}
    proc = subprocess.run([sys.executable, str(repo / "examples" / example), "--output-dir", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"examples/{example}: ") and f"not installed: {missing.replace(',', ', ')}." in lines[0]
    assert "-e '.[trl]'" in lines[0] and not (tmp_path / "out").exists()


LONG = "d" * 300  # one path component over the 255 bytes a Linux file system takes: ENAMETOOLONG


@pytest.mark.parametrize("args", [
    ["gate", "--baseline", "/tmp/{long}/x.json", "--candidate", "{r1}"],
    ["lookup", "llama", "sdpa", "4.53.1", "--support-file", "/tmp/{long}/support.json"],
    ["audit", "--audit", "/tmp/{long}.toml"],
    ["audit", "--models", "arch:llama", "--packcheck-tolerances", "/tmp/{long}.toml"],
    ["audit", "--models", "arch:llama", "--packcheck-attn", "sdpa", "-n", "0", "--packcheck-report-dir", "{tmp}/{long}"],
], ids=["gate", "lookup", "audit-file", "tolerances", "report-dir"])
def test_a_path_too_long_for_the_file_system_is_one_line_exit_2(tmp_path, args):
    """Planted: a path with a 300-byte name. Path.exists() / is_dir() raise ENAMETOOLONG rather than answer, and each
    reader let it out as an OSError traceback (an INTERNALERROR, exit 3, from the audit)."""
    r1 = tmp_path / "r1.json"
    r1.write_text("{}")
    args = [a.format(long=LONG, r1=r1, tmp=tmp_path) for a in args]
    proc = _cli(args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "Traceback" not in out and "INTERNALERROR" not in out, out[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and ("longer than the file system takes" in said[0] or "File name too long" in said[0]), said


def test_the_path_line_names_the_path_shortened():
    import errno

    from pytest_packcheck.errors import path_failure_message

    exc = OSError(errno.ENAMETOOLONG, "File name too long", f"/tmp/{LONG}/x.json")
    line = path_failure_message(exc)
    assert line.startswith("the path '/tmp/ddd") and "(312 characters)" in line and "give a shorter path" in line
    assert path_failure_message(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert path_failure_message(ValueError("x")) is None


@pytest.mark.parametrize(("content", "says"), [("{not json", "is not valid JSON"), (None, "has no config.json")])
def test_bisect_refuses_a_local_model_without_a_readable_config_before_any_environment(tmp_path, content, says):
    """Planted: --model a folder whose config.json is broken or missing. bisect built both endpoints' environments and
    ran the cell in each before the model's config was read (a hostile trial: minutes, and an endpoint crash)."""
    from pytest_packcheck.analysis.bisect import parse_cell_id

    folder = tmp_path / "m"
    folder.mkdir()
    if content is not None:
        (folder / "config.json").write_text(content)
    with pytest.raises(PackcheckUsageError, match=rf"\(from --model\).*{says}"):
        parse_cell_id("llama-sdpa-isolation-float32", "CELL", str(folder))
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text('{"model_type": "llama"}')
    assert parse_cell_id("llama-sdpa-isolation-float32", "CELL", str(good)).model == str(good)


@pytest.mark.parametrize(("args", "says"), [
    (["gate", "--baseline", "x", "--token=hf_TrialSecretToken0123456789abcdef"], "unrecognized arguments: --token=***"),
    (["hf_TrialSecretToken0123456789abcdef"], "invalid choice: '***'"),
    (["lookup", "llama", "sdpa", "4.53", "--jsn"], "unrecognized arguments: --jsn. Did you mean '--json'?"),
    (["gate", "--baseline", "x", "--candiate", "y"], "Did you mean '--candidate'?"),
], ids=["token-in-flag", "token-as-command", "typo-lookup", "typo-gate"])
def test_argparse_errors_are_scrubbed_and_name_the_flag_meant(tmp_path, args, says):
    """Planted: a token pasted into an unknown flag or as the command; argparse printed it in clear (its errors ran
    before the CLI's scrubbing stderr), and an unknown flag got no suggestion."""
    proc = _cli(args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "hf_TrialSecretToken" not in proc.stdout + proc.stderr
    assert says in proc.stderr.splitlines()[-1], proc.stderr[-1500:]


@pytest.mark.parametrize(("args", "says"), [
    (["audit", "--packcheck-lengths", "-3,5"], "give it as --packcheck-lengths=VALUE"),
    (["bench", "-o"], "give it as --output-dir=VALUE"),
    (["bench", "--steps", "abc"], "invalid int value: 'abc'"),
    (["gate"], "the following arguments are required: --baseline"),
])
def test_an_argparse_error_is_one_line(tmp_path, args, says):
    """Planted: values argparse itself refuses. It printed the command's usage block first (30 lines for audit), and a
    value starting with '-' read as 'expected one argument' with no way out named."""
    proc = _cli(args, tmp_path)
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(said) == 1, proc.stderr[-2500:]
    assert says in said[0] and said[0].endswith("--help)"), said


@pytest.mark.parametrize("value", ["inf", "1e400", "-inf"])
def test_an_infinite_file_size_bound_is_refused(tmp_path, monkeypatch, value):
    """Planted: $PACKCHECK_MAX_FILE_MB=1e400 / inf; int(inf) raised OverflowError, an INTERNALERROR from the audit."""
    from pytest_packcheck.errors import read_document

    (tmp_path / "a.json").write_text("{}")
    monkeypatch.setenv("PACKCHECK_MAX_FILE_MB", value)
    with pytest.raises(PackcheckUsageError, match=r"must be a finite number above 0"):
        read_document(tmp_path / "a.json", "json", "Results file", "fix")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to fill the disk under stdout")
@pytest.mark.parametrize("args", [["--help"], ["lookup", "--help"], ["--version"]])
def test_help_or_version_to_a_full_disk_exits_74_in_one_line(args):
    # hostile trial 4: argparse drops the write's OSError, so `packcheck --help > /dev/full` exited 0 with the help lost
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, check=False)
    assert proc.returncode == 74, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "packcheck: standard output could not be written (No space left on device): the text was dropped."]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_report_folder_with_a_control_character_is_refused_before_anything_is_made(tmp_path, how):
    # hostile trial 4: --packcheck-report-dir "$(printf 'a\nb')" was accepted and the folder made
    from cli_inprocess import packcheck

    bad = "rep\nort"
    args = ["audit", "--packcheck-models", "llama", "-q"] + (["--packcheck-report-dir", bad] if how == "flag" else [])
    proc = packcheck(*args, cwd=tmp_path, env={"PACKCHECK_REPORT_DIR": bad} if how == "env" else None)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds a control character" in proc.stdout + proc.stderr
    assert ("--packcheck-report-dir" if how == "flag" else "$PACKCHECK_REPORT_DIR") in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []
