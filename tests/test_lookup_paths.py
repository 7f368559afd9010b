"""`packcheck lookup` answers for the path the user trains through (issue 41, part 1): the model fed the packed row,
transformers' Trainer and TRL's SFTTrainer; a bare `pass` only where every known path passes with no hazard on its
default way of running; the first release from which a failing path passes and the remedy at the asked release; a
bare minor answered per patch; a Hub model ID, a model folder or a config.json read offline for its model_type.

Each test reads the committed atlas (reports/atlas/support.json) and audit/known_faults.toml, and would fail on the
code before this change (lookup printed `pass` for llama / sdpa @ 4.53.1, answered 4.53 as 4.53.0, and refused
`Qwen/Qwen2.5-0.5B` as an unknown architecture with no hint)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.support import guess_model_type, lookup, lookup_releases

REPO = Path(__file__).resolve().parent.parent


def _path(answer, name):
    return next(p for p in answer.paths if p["path"] == name)


def test_llama_sdpa_4_53_1_names_the_trainer_paths_fault_and_its_remedy():
    """The issue's case: the model's packed forward passes (with use_cache=False), transformers' Trainer keeps
    config.use_cache=True on 4.53.1 .. 4.57.x (known fault trainer-keeps-config-use_cache, bisected to 5.0.0)."""
    answer = lookup("llama", "sdpa", "4.53.1")
    assert answer.verdict == "pass"  # the model path's verdict as before
    assert answer.overall == "fail"
    trainer = _path(answer, "Trainer")
    assert trainer["verdict"] == "fail" and trainer["causes"] == ["cache_trap"], trainer
    assert "use_cache = False" in trainer["remedy"] and trainer["safe_from"] == "5.0.0"
    assert "trainer-keeps-config-use_cache" in trainer["source"]
    text = str(answer)
    assert text.splitlines()[0].startswith("llama / sdpa @ transformers 4.53.1: fail on the Trainer path")
    assert "remedy at 4.53.1: set model.config.use_cache = False before Trainer" in text
    assert "passes as is from: 5.0.0" in text
    as_json = answer.as_dict()
    assert as_json["overall"] == "fail" and {p["path"] for p in as_json["paths"]} == {"model", "Trainer"}


def test_the_trainer_verdict_rests_on_the_known_fault_planted_away():
    """Planted: the same answer computed without the known fault passes the Trainer path: its failure comes from
    known_faults.toml's window, not from a hard-coded release."""
    from packaging.version import Version

    from pytest_packcheck.analysis.diagnose import load_known_faults
    from pytest_packcheck.analysis.training_paths import training_paths
    from pytest_packcheck.support import load_support

    doc = load_support()
    entry = doc["cells"]["llama"]["sdpa"]["4.53.3"]
    faults = load_known_faults()
    with_it = training_paths(doc, "llama", "sdpa", Version("4.53.1"), entry, "pass", [], faults=faults)
    without = training_paths(doc, "llama", "sdpa", Version("4.53.1"), entry, "pass", [],
                             faults=[f for f in faults if f.id != "trainer-keeps-config-use_cache"])
    assert [p["verdict"] for p in with_it] == ["hazard", "fail"]
    assert [p["verdict"] for p in without] == ["hazard", "pass"]


def test_a_bare_pass_only_where_every_path_passes():
    """llama on the flash path at 5.24.0: no cache hazard, the Trainer sets use_cache=False from 5.0.0: pass.
    On sdpa the default config's use_cache=True is a hazard of the model path (the Trainer path passes)."""
    flash = lookup("llama", "flash_attention_2", "5.24.0")
    assert flash.overall == "pass" and all(p["verdict"] == "pass" for p in flash.paths)
    sdpa = lookup("llama", "sdpa", "5.24.0")
    assert sdpa.overall == "hazard" and _path(sdpa, "Trainer")["verdict"] == "pass"
    model = _path(sdpa, "model")
    assert model["causes"] == ["cache_trap"] and "use_cache = False" in model["remedy"]
    assert "hazard on the model path" in str(sdpa).splitlines()[0]


def test_a_failing_model_path_names_the_first_release_that_passes_patch_exact():
    """4.51.3 leaks on sdpa; the atlas measured 4.52.4 (fail) and 4.53.3 (pass) and the bisect placed the change at
    4.53.1: the smallest safe upgrade is 4.53.1, not 4.53.3."""
    answer = lookup("llama", "sdpa", "4.51.3")
    model = _path(answer, "model")
    assert model["verdict"] == "fail" and model["safe_from"] == "4.53.1"
    assert "4.53.1" in model["remedy"] and "no-packed-mask-before-4.54" in model["source"]


def test_sfttrainer_path_with_a_trl_release():
    answer = lookup("llama", "sdpa", "5.24.0", "1.16.0")
    sft = _path(answer, "SFTTrainer")
    assert sft["verdict"] == "pass" and "trl 1.16.0" in sft["source"]
    assert "SFTTrainer: not asked" not in str(answer)
    assert "SFTTrainer: not asked" in str(lookup("llama", "sdpa", "4.53.1"))


def test_a_bare_minor_is_answered_for_each_patch():
    answers = lookup_releases("llama", "sdpa", "4.53")
    assert [a.transformers_version for a in answers] == ["4.53.0", "4.53.1", "4.53.2", "4.53.3"]
    assert [a.verdict for a in answers] == ["fail", "pass", "pass", "pass"]
    assert [a.overall for a in answers] == ["fail", "fail", "fail", "fail"]
    # a full version is one answer, as before
    assert [a.transformers_version for a in lookup_releases("llama", "sdpa", "4.53.3")] == ["4.53.3"]
    out = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "lookup", "llama", "sdpa", "4.53", "--json"],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["minor"] == "4.53" and doc["answers"][0]["transformers_version"] == "4.53.0"


def test_a_hub_id_a_folder_and_a_config_json_are_read_offline(offline_hub, tmp_path):
    answer = lookup("Qwen/Qwen2.5-0.5B", "sdpa", "5.24.0")
    assert answer.model_type == "qwen2" and "local Hub cache of Qwen/Qwen2.5-0.5B" in answer.resolved_from
    assert "model_type 'qwen2' read from" in str(answer)
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert lookup(str(folder), "sdpa", "5.24.0").model_type == "llama"
    assert lookup(str(folder / "config.json"), "sdpa", "5.24.0").model_type == "llama"
    with pytest.raises(PackcheckUsageError, match=r"hf download Qwen/Qwen3-0\.6B config\.json.*model_type 'qwen3'"):
        lookup("Qwen/Qwen3-0.6B", "sdpa", "5.24.0")  # not in the cache: how to get it, and a guess by name
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PackcheckUsageError, match="has no model_type"):
        lookup(str(folder), "sdpa", "5.24.0")
    (folder / "config.json").write_text("[" * 100_000)
    with pytest.raises(PackcheckUsageError, match="nests its arrays"):
        lookup(str(folder), "sdpa", "5.24.0")


def test_unknown_names_get_the_nearest_type_by_name():
    known = ["qwen2", "qwen2_moe", "qwen3", "llama", "gemma2", "gemma"]
    assert guess_model_type("Qwen/Qwen2.5-0.5B", known) == "qwen2"
    assert guess_model_type("meta-llama/Meta-Llama-3-8B", known) == "llama"
    assert guess_model_type("google/gemma-2-2b-it", known) == "gemma2"
    assert guess_model_type("nothing-like-it", known) is None
    answer = lookup("Qwen2.5", "sdpa", "5.24.0")
    assert not answer.answered and any("Did you mean 'qwen2'?" in n for n in answer.notes)


@pytest.mark.parametrize(("args", "words"), [
    (("llama", "sdpa", "4.53.1.1.1"), "transformers version '4.53.1.1.1' has 5 parts"),
    (("llama", "sdpa", "4.53.1", "1.2.3.4"), "trl version '1.2.3.4' has 4 parts"),
])
def test_a_version_no_release_has_is_refused_not_answered_from_a_neighbour(args, words):
    # hostile trial 4: 4.53.1.1.1 sorts between 4.53.1 and 4.53.3 and was answered from 4.53.1's bisect, exit 0
    with pytest.raises(PackcheckUsageError, match=words):
        lookup(*args)
    assert lookup("llama", "sdpa", "4.53.1").transformers_version == "4.53.1"  # the release itself is still answered
