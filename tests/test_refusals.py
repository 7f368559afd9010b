"""One-line refusals of inputs issue 28's second adversarial trial found accepted or answered wrongly: each is a
PackcheckUsageError (exit 2) naming the value, where it came from and the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck.errors import PackcheckUsageError

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", *args], capture_output=True, text=True, check=False,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize(("args", "message"), [
    (("qwen2", "sdpaa", "4.56.2"), "Unknown attn_implementation 'sdpaa' (from the attn_implementation argument)"),
    (("qwen2", "paged|sdpa", "5.24.0"), "Unknown attn_implementation 'paged|sdpa'"),
    (("qwen2", "sdpa", "4.56.x"), "transformers version '4.56.x' is not a version"),
    (("qwen2", "sdpa", "5.24.0", "--trl", "banana"), "trl version 'banana' is not a version"),
])
def test_lookup_refuses_an_unknown_backend_and_a_bad_release(args, message):
    """`packcheck lookup qwen2 sdpaa 4.56.2` answered "not measured" (exit 1): a typo is a usage error naming the
    backends the atlas answers (from the backend table), exit 2."""
    proc = _cli("lookup", *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    if "sdpaa" in args:
        from pytest_packcheck.backends.table import KNOWN_BACKENDS

        assert all(b in proc.stderr for b in KNOWN_BACKENDS) and "Did you mean 'sdpa'" in proc.stderr


def test_lookup_still_answers_the_backends_it_knows():
    from pytest_packcheck.support import lookup

    assert lookup("llama", "sdpa", "5.24.0").measured
    assert lookup("llama", "sdpa", "5.24").measured_at == "5.24.0"  # 5.24 is 5.24.0, not "not measured"
    assert lookup("llama", "flash_attention_2", "5.24.0").backend == "packcheck_flash_ref"  # answered from the reference
    with pytest.raises(PackcheckUsageError, match="Unknown attn_implementation 'spda'.*Did you mean 'sdpa'"):
        lookup("llama", "spda", "5.24.0")


@pytest.mark.parametrize(("args", "message"), [
    (("--render-only", "--build-dir", "/nonexistent/atlas"),
     "--build-dir '/nonexistent/atlas' (with --render-only) does not exist: there is nothing to render"),
    (("--render-only", "--build-dir", __file__), "(with --render-only) is not a folder"),
    (("--releases", "5.24.0", "--bisect", "--bisect-limit", "-1"), "--bisect-limit -1 must be >= 1"),
    (("--releases", "5.24.0", "--bisect", "--bisect-limit", "0"), "--bisect-limit 0 must be >= 1"),
])
def test_atlas_refuses_a_missing_build_dir_and_a_non_positive_bisect_limit(args, message, tmp_path):
    """`packcheck atlas --render-only --build-dir /nonexistent` exited 0 and `--bisect-limit -1` was accepted."""
    proc = _cli("atlas", *args, "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("spec", "message"), [
    ("arch:llama{pad_token_id=-5}", ("Config value pad_token_id=-5 (in an override of model spec 'arch:llama{pad_token_id=-5}' "
                                    "from test) is not a token id of the model's vocabulary [0, 32,000)")),
    ("arch:llama{bos_token_id=100000}", "Config value bos_token_id=100000"),
    ("arch:llama{eos_token_id=[2,-1]}", "Config value eos_token_id=-1"),
])
def test_a_typed_special_token_id_outside_the_vocabulary_is_refused(spec, message):
    """`arch:llama{pad_token_id=-5}` ran with the pad row wrapped to id 507 of the shrunk vocabulary, under the
    absurd label and with no note: refused as an absurd size is (model/configs.py)."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec(spec, "test"), "test")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_special_token_ids_inside_the_vocabulary_still_resolve():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    for spec in ("arch:llama{pad_token_id=31999}", "arch:llama{pad_token_id=null}", "arch:llama{eos_token_id=[2,7]}"):
        assert resolve_model(parse_model_spec(spec, "test"), "test").error is None, spec


def test_a_special_token_id_from_packcheck_config_is_refused_by_the_audit(tmp_path):
    proc = _cli("audit", "--models", "arch:llama", "--packcheck-config", "pad_token_id=-5", "-n", "0", "-q",
                "--packcheck-report-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "Config value pad_token_id=-5" in proc.stdout + proc.stderr, proc.stdout[-1500:] + proc.stderr
    assert "from --packcheck-config, folded into --packcheck-models" in proc.stdout + proc.stderr  # not the model list alone
    assert not (tmp_path / "r" / "packcheck-matrix.json").exists()


def test_a_size_or_unknown_key_from_packcheck_config_names_that_option():
    from pytest_packcheck.model import configs
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    try:
        configs.CONFIG_OPTION_OVERRIDES.update({"hidden_size": 0, "clip_qvk": 8})
        with pytest.raises(PackcheckUsageError, match=r"\(in an override of model spec 'arch:llama\{hidden_size=0\}' from "
                                                      r"--packcheck-config, folded into --packcheck-models\)"):
            resolve_model(parse_model_spec("arch:llama{hidden_size=0}", "--packcheck-models"), "--packcheck-models")
        with pytest.warns(Warning, match=r"'clip_qvk' \(in model spec 'arch:llama\{clip_qvk=8\}' from --packcheck-config"):
            resolve_model(parse_model_spec("arch:llama{clip_qvk=8}", "--packcheck-models"), "--packcheck-models")
        with pytest.raises(PackcheckUsageError, match=r"from --packcheck-models\) is not a size") as own:  # the spec's own value
            resolve_model(parse_model_spec("arch:llama{hidden_size=-1}", "--packcheck-models"), "--packcheck-models")
        assert "--packcheck-config" not in str(own.value)
    finally:
        configs.CONFIG_OPTION_OVERRIDES.clear()


@pytest.mark.parametrize(("spec", "what"), [
    ("arch:llama{rope_theta=", "an unclosed '{'"),
    ("arch:llama}", "a '}' without its '{'"),
    ("arch:llama{rope_theta=1}x", "text after the closing '}'"),
])
def test_a_model_spec_with_a_broken_brace_names_the_brace(spec, what):
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError, match=f"Malformed model spec '{re.escape(spec)}' \\(from --packcheck-models\\): {what}"):
        parse_model_spec(spec, "--packcheck-models")


def test_an_unknown_architecture_points_at_a_list_not_at_a_full_audit():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec("arch:nosuchthing", "--packcheck-models"), "--packcheck-models")
    assert "--all-architectures" not in str(info.value) and "print(sorted(CONFIG_MAPPING))" in str(info.value)
    assert "\n" not in str(info.value)
