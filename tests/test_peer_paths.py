"""The peers' own packing code, run (atlas/peer_paths.py): planted faults in stand-in wheels that carry the peer's
module names and signatures, each caught; the real wheels where CI downloaded them ($PEER_WHEELS)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import make_bench

import pytest_packcheck.atlas.peer_paths as pp
from pytest_packcheck.atlas.peer_paths import PEER_PATHS, measure, render_own_paths, results_document, wheel_version

# LLaMA-Factory 0.9.5's prepare_4d_attention_mask, as data/collator.py has it (block-diagonal, causal)
LF_RIGHT = """
import torch
def prepare_4d_attention_mask(attention_mask_with_indices, dtype):
    _, seq_len = attention_mask_with_indices.size()
    min_dtype = torch.finfo(dtype).min
    zero_tensor = torch.tensor(0, dtype=dtype)
    non_padding_mask = (attention_mask_with_indices != 0).unsqueeze(1).unsqueeze(2)
    indices = attention_mask_with_indices.unsqueeze(1).unsqueeze(2)
    indices_t = attention_mask_with_indices.unsqueeze(1).unsqueeze(3)
    tril_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
    attention_mask_4d = (indices == indices_t) & non_padding_mask & tril_mask
    return torch.where(attention_mask_4d, zero_tensor, min_dtype)
class SFTDataCollatorWith4DAttentionMask:
    @staticmethod
    def _unpad_packed_features(features):
        keep = torch.nonzero(features["attention_mask"][0] != 0).flatten()
        for k in ("input_ids", "attention_mask", "position_ids"):
            features[k] = features[k].index_select(1, keep)
"""
# planted: the segment ids are ignored (a plain causal mask over the whole row)
LF_LEAKS = LF_RIGHT.replace("(indices == indices_t) & non_padding_mask & tril_mask", "non_padding_mask & tril_mask")

AXOLOTL_RIGHT = """
import numpy as np, torch
class V2BatchSamplerDataCollatorForSeq2Seq:
    def __init__(self, tokenizer=None, padding=True, pad_to_multiple_of=None, return_tensors="pt", **kw):
        self.m = pad_to_multiple_of or 1
    def __call__(self, features):
        f = features[0]
        out = {k: np.concatenate([np.array(x[k]) for x in f]) for k in f[0]}
        out["attention_mask"] = np.concatenate([(i + 1) * np.array(x["attention_mask"]) for i, x in enumerate(f)])
        n = len(out["input_ids"]); pad = (-n) % self.m
        out["position_ids"] = np.concatenate([out["position_ids"], np.arange(pad)])
        for k, v in (("input_ids", 0), ("labels", -100), ("attention_mask", 0)):
            out[k] = np.concatenate([out[k], np.full(pad, v)])
        return {k: torch.tensor(v[None]) for k, v in out.items()}
"""
# planted: the collator drops position_ids (the model then counts 0..n-1 over the whole row)
AXOLOTL_DROPS = AXOLOTL_RIGHT.replace("return {k: torch.tensor(v[None]) for k, v in out.items()}",
                                      "return {k: torch.tensor(v[None]) for k, v in out.items() if k != 'position_ids'}")


def _wheel(tmp_path: Path, dist: str, version: str, modules: dict[str, str]) -> Path:
    path = tmp_path / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        packages = set()
        for name, source in modules.items():
            parts = name.split(".")
            for i in range(1, len(parts)):
                packages.add("/".join(parts[:i]))
            z.writestr("/".join(parts) + ".py", textwrap.dedent(source))
        for p in packages - {n.replace(".", "/").removesuffix("/__init__") for n in modules if n.endswith(".__init__")}:
            z.writestr(p + "/__init__.py", "")
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


@pytest.fixture
def bench(tolerances):
    return lambda model, backend: make_bench(model, backend, tolerances)


def _by(results):
    return {(r.path, r.model, r.backend): r for r in results}


def test_llamafactory_segment_mask_is_judged_and_a_mask_that_ignores_segments_is_caught(tmp_path, bench):
    right = _by(measure(_wheel(tmp_path, "llamafactory", "0.9.5", {"llamafactory.data.collator": LF_RIGHT}), bench,
                        models=("llama",), backends=("eager",)))
    r = right[("neat_packing", "llama", "eager")]
    assert r.verdict == "pass" and r.max_abs_diff <= r.tolerance and len(r.per_example) == 3
    (tmp_path / "bad").mkdir()
    bad = _by(measure(_wheel(tmp_path / "bad", "llamafactory", "0.9.5", {"llamafactory.data.collator": LF_LEAKS}), bench,
                      models=("llama",), backends=("eager",)))
    r = bad[("neat_packing", "llama", "eager")]
    assert r.verdict == "fail" and r.cause == "segment_mask" and r.max_abs_diff > 1e-2
    assert r.per_example[0] <= r.tolerance  # the first example sees nothing before it: only the later ones move


def test_a_block_diagonal_mask_without_the_window_is_named_sliding_window(tmp_path, bench):
    results = _by(measure(_wheel(tmp_path, "llamafactory", "0.9.5", {"llamafactory.data.collator": LF_RIGHT}), bench,
                          models=("mistral",), backends=("sdpa",)))
    r = results[("neat_packing", "mistral", "sdpa")]
    assert r.verdict == "fail" and r.cause == "sliding_window", r
    assert "sliding_window 8" in r.note
    assert min(r.per_example) <= r.tolerance < max(r.per_example)  # the example within the window matches


def test_axolotl_multipack_collator_dropping_position_ids_is_caught(tmp_path, bench):
    right = _by(measure(_wheel(tmp_path, "axolotl", "0.19.0", {"axolotl.utils.collators.batching": AXOLOTL_RIGHT}), bench,
                        models=("llama",), backends=("sdpa",)))
    assert right[("multipack", "llama", "sdpa")].verdict == "pass"
    (tmp_path / "bad").mkdir()
    bad = _by(measure(_wheel(tmp_path / "bad", "axolotl", "0.19.0", {"axolotl.utils.collators.batching": AXOLOTL_DROPS}),
                      bench, models=("llama",), backends=("sdpa",)))
    r = bad[("multipack", "llama", "sdpa")]
    assert r.verdict == "fail" and r.cause == "leak" and r.max_abs_diff > 1e-2


def test_a_peer_module_that_does_not_import_is_a_not_run_cell_naming_the_package(tmp_path, bench):
    wheel = _wheel(tmp_path, "axolotl", "0.19.0", {"axolotl.utils.collators.batching": "import deepspeed_not_here\n"})
    results = measure(wheel, bench, models=("llama",), backends=("eager", "sdpa"))
    assert [r.verdict for r in results] == ["not_run", "not_run"]
    assert all("deepspeed_not_here" in r.reason and "axolotl.utils.collators.batching" in r.reason for r in results)
    assert "axolotl" not in sys.modules and not any(str(wheel) == p for p in sys.path)  # nothing left behind


# verl 0.9.1's monkey_patch.py, its remove-padding part: _ulysses_flash_attention_forward hands the call on to the
# _flash_attention_forward it imported (ulysses_sp_size 1); apply_monkey_patch swaps it into transformers' flash module.
# verl/utils/attention_utils.py's pure-torch unpad helpers, as 0.9.1 has them
VERL_UTILS = {
    "verl.utils.attention_utils": """
import torch
from einops import rearrange
def index_first_axis(x, indices):
    return x.reshape(-1, *x.shape[1:])[indices]
def unpad_input(hidden_states, attention_mask):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    return index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices), indices, seqlens
""",
}
VERL_PATCH = """
import sys
from transformers.modeling_flash_attention_utils import _flash_attention_forward
from verl.utils.import_utils import is_trl_available
def _ulysses_flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, *args,
                                     position_ids=None, **kwargs):
    query_length = query_states.size(1)
    return _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, *args,
                                    position_ids=position_ids, **kwargs)
def apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True):
    if is_trl_available():
        from trl import AutoModelForCausalLMWithValueHead
    if use_remove_padding:
        from transformers.integrations import flash_attention
        flash_attention._flash_attention_forward = _ulysses_flash_attention_forward
        print(f"Monkey patch _flash_attention_forward in {flash_attention.__name__}")
"""
# planted: logged as applied, but the flash module is never patched (the forward runs transformers' own)
VERL_LOGGED_NOT_APPLIED = VERL_PATCH.replace("        flash_attention._flash_attention_forward = _ulysses_flash_attention_forward\n", "")
# planted: verl's forward drops position_ids on the way (the flash path then sees one sequence: a leak)
VERL_DROPS_POSITIONS = VERL_PATCH.replace("position_ids=position_ids, **kwargs)", "position_ids=None, **kwargs)")


def _verl_wheel(tmp_path: Path, patch: str) -> Path:
    modules = {**VERL_UTILS, "verl.utils.import_utils": "def is_trl_available():\n    return True\n",
               "verl.models.transformers.monkey_patch": patch}
    wheel = _wheel(tmp_path, "verl", "0.9.1", {**modules, "verl.models.__init__": "import ray_not_here\n",
                                               "verl.utils.__init__": "import omegaconf_not_here\n"})
    _einops_beside(tmp_path)
    return wheel


def _einops_beside(folder: Path) -> None:
    """An einops wheel beside the peer's holding the one pattern verl's unpad helpers use."""
    _wheel(folder, "einops", "0.8.2", {"einops.__init__": (
        "def rearrange(x, pattern):\n"
        "    assert pattern == 'b s ... -> (b s) ...', pattern\n"
        "    return x.reshape(-1, *x.shape[2:])\n")})


def test_verl_remove_padding_runs_its_patch_over_the_flash_reference_and_catches_a_patch_logged_but_not_applied(tmp_path, bench):
    """verl's patch is applied to the cell's model and taken off after; the package __init__ files that import ray /
    omegaconf are not run (named); trl 1.x's missing value-head class is named, not a crash."""
    from transformers.integrations import flash_attention

    original = flash_attention._flash_attention_forward
    (tmp_path / "ok").mkdir()
    r = measure(_verl_wheel(tmp_path / "ok", VERL_PATCH), bench, models=("llama",))[0]
    assert (r.path, r.backend, r.verdict) == ("remove_padding", "packcheck_flash_ref", "pass"), r
    assert "handed on 2 calls" in r.note and "verl/__init__.py not run" in r.stubs
    assert any("is_trl_available() answered False" in s for s in r.stubs)
    assert flash_attention._flash_attention_forward is original and "verl" not in sys.modules
    (tmp_path / "logged").mkdir()
    r = measure(_verl_wheel(tmp_path / "logged", VERL_LOGGED_NOT_APPLIED), bench, models=("llama",))[0]
    assert r.verdict == "error" and "never called it" in r.reason, r
    (tmp_path / "drops").mkdir()
    r = measure(_verl_wheel(tmp_path / "drops", VERL_DROPS_POSITIONS), bench, models=("llama",))[0]
    assert r.verdict == "fail" and r.cause == "leak" and r.max_abs_diff > 1e-2, r


# ms-swift 4.6.0's Template._data_collator / packing_row, their padding_free branch as swift/template/base.py has it
SWIFT_TEMPLATE = """
import torch
from modelscope.hub.utils.utils import get_cache_dir
class Template:
    def packing_row(self, row):
        packed = {k: sum((x.get(k) or [] for x in row), start=[]) for k in ("input_ids", "labels")}
        packed["position_ids"] = sum((list(range(x["length"])) for x in row), start=[])
        return packed
    def _data_collator(self, batch, *, padding_to=None):
        assert self.tokenizer.pad_token_id is not None
        if self.padding_free:
            batch[:] = [self.packing_row(batch)]
        return {k: torch.tensor([v]) for k, v in batch[0].items()}
    @property
    def tokenizer(self):
        return self.processor
"""
# planted: position_ids counted over the whole row (0..n-1): the examples see each other
SWIFT_ONE_SEQUENCE = SWIFT_TEMPLATE.replace('sum((list(range(x["length"])) for x in row), start=[])',
                                            'list(range(sum(x["length"] for x in row)))')


def test_ms_swift_padding_free_collator_runs_with_modelscope_stubbed_and_its_planted_fault_is_caught(tmp_path, bench):
    for name, source, verdict in (("ok", SWIFT_TEMPLATE, "pass"), ("bad", SWIFT_ONE_SEQUENCE, "fail")):
        (tmp_path / name).mkdir()
        wheel = _wheel(tmp_path / name, "ms_swift", "4.6.0", {"swift.template.base": source,
                                                               "swift.__init__": "import modelscope_trainers_not_here\n"})
        _wheel(tmp_path / name, "json_repair", "0.64.6", {"json_repair.__init__": ""})
        _einops_beside(tmp_path / name)
        r = measure(wheel, bench, models=("llama",))[0]
        assert (r.path, r.backend, r.verdict) == ("padding_free", "packcheck_flash_ref", verdict), r
        assert any(s.startswith("modelscope stubbed") for s in r.stubs) and "swift/__init__.py not run" in r.stubs
    assert r.cause == "leak" and r.max_abs_diff > 1e-2
    assert "modelscope" not in sys.modules and "swift" not in sys.modules


def test_a_missing_wheel_beside_the_peer_is_a_not_run_naming_it(tmp_path, bench):
    wheel = _wheel(tmp_path, "ms_swift", "4.6.0", {"swift.template.base": SWIFT_TEMPLATE})
    results = measure(wheel, bench, models=("llama",))
    assert [r.verdict for r in results] == ["not_run"]
    assert "needs the package 'json_repair'" in results[0].reason


def test_a_model_that_does_not_build_and_a_batch_that_raises_are_cells_not_crashes(tmp_path, bench):
    def flaky(model, backend):
        if model == "nope":
            raise ValueError("no such architecture")
        return bench(model, backend)

    broken = LF_RIGHT.replace("return torch.where(", "raise RuntimeError('peer bug')\n    return torch.where(")
    results = _by(measure(_wheel(tmp_path, "llamafactory", "0.9.5", {"llamafactory.data.collator": broken}), flaky,
                          models=("nope", "llama"), backends=("eager",)))
    assert results[("neat_packing", "nope", "eager")].verdict == "not_run"
    assert "no such architecture" in results[("neat_packing", "nope", "eager")].reason
    assert results[("neat_packing", "llama", "eager")].verdict == "error"
    assert "peer bug" in results[("neat_packing", "llama", "eager")].reason


def test_the_written_document_is_compact_and_expands_to_every_result_whole():
    """peer_paths.json holds a path's shared fields once (schema_version 2); expanded, every result is whole again,
    a cell whose stubs differ from its path's keeps its own."""
    rows = [{**_row("verl", "vlm_forward", m, "packcheck_flash_ref", "pass", 1e-7), "per_example": [1.23456789e-7],
             "stubs": ["verl/__init__.py not run"], "transformers": "5.10.4"} for m in ("qwen2_vl_text", "qwen3_vl_text")]
    rows.append({**rows[0], "model": "glm4v_text", "stubs": ["verl/__init__.py not run", "glm4v stand-in"]})
    doc = {**_doc(rows), "schema_version": 1}
    text = pp.dumps_document(doc)
    compact = json.loads(text)
    assert compact["schema_version"] == 2 and compact["paths"]["verl:vlm_forward"]["transformers"] == "5.10.4"
    assert text.count("verl/__init__.py not run") == 2 and "reason" not in compact["results"][0]
    back = pp.expand_document(compact)["results"]
    assert [r["stubs"] for r in back] == [r["stubs"] for r in rows] and back[0]["per_example"] == [1.235e-7]
    assert {k: v for k, v in back[1].items() if k != "per_example"} == {k: v for k, v in rows[1].items() if k != "per_example"}


def test_own_paths_render_a_table_per_path_with_the_numbers_and_the_not_run_reasons():
    doc = {"torch": "2.13.0+cpu", "transformers": "5.25.0", "results": [
        {"peer": "llamafactory", "path": "neat_packing", "code": "llamafactory/data/collator.py:prepare_4d_attention_mask",
         "model": "mistral", "backend": "sdpa", "verdict": "fail", "max_abs_diff": 0.52, "per_example": [0.28, 1e-7, 0.52],
         "cause": "sliding_window", "note": "sliding_window 8", "stubs": ["torchaudio"], "reason": "", "not_on_cpu": ""},
        {"peer": "llamafactory", "path": "neat_packing", "code": "x", "model": "llama", "backend": "eager",
         "verdict": "not_run", "reason": "llamafactory.data.collator does not import", "stubs": [], "not_on_cpu": ""}]}
    text = "\n".join(render_own_paths(doc, "llamafactory"))
    assert "❌ 5.2e-01 (sliding_window)" in text and "stubbed (never called on this path): torchaudio" in text
    assert "⏭️ not run" in text and "does not import" in text and "per example 2.8e-01, 1.0e-07, 5.2e-01" in text
    assert render_own_paths(doc, "axolotl") == []
    assert "outside llamafactory's pin `<=5.6.0`" in "\n".join(render_own_paths(doc, "llamafactory", "<=5.6.0"))
    assert "outside" not in "\n".join(render_own_paths(doc, "llamafactory", ">=4.55"))


def test_cli_claims_refuses_an_own_paths_file_that_is_not_one(tmp_path):
    from pytest_packcheck.cli import main

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    wheel = _wheel(tmp_path, "axolotl", "0.19.0", {"axolotl.monkeypatch.multipack": "SUPPORTED_MULTIPACK_MODEL_TYPES = ['llama']\n"})
    assert main(["claims", str(wheel), "--own-paths", str(bad), "-o", str(tmp_path / "claims.md")]) == 2
    assert not (tmp_path / "claims.md").exists()


def test_the_table_names_real_modules_and_wheel_names_parse():
    assert {p.peer for p in PEER_PATHS} == {"llamafactory", "axolotl", "nemo_automodel", "ms_swift", "unsloth", "verl"}
    assert all(p.modules and p.backends and p.code.split(":")[0].startswith(p.modules[0].split(".")[0] + "/") for p in PEER_PATHS)
    assert all(globals_ok for globals_ok in [callable(getattr(pp, n)) for p in PEER_PATHS for n in (p.build, p.around, p.stand_in) if n])
    assert wheel_version(Path("ms_swift-4.6.0-py3-none-any.whl")) == ("ms-swift", "4.6.0")
    with pytest.raises(ValueError, match="not a wheel"):
        wheel_version(Path("axolotl-0.19.0.tar.gz"))


def _real(name: str) -> Path:
    """The released wheel of ``name``: in $PEER_WHEELS or build/peers, else (ms-swift, verl: pinned for the RL suite,
    with what their modules import) in $RL_PEER_WHEELS or build/rl-peers."""
    root = Path(__file__).resolve().parents[1]
    folders = [os.environ.get("PEER_WHEELS") or str(root / "build" / "peers"),
               os.environ.get("RL_PEER_WHEELS") or str(root / "build" / "rl-peers")]
    hits = [h for f in folders for h in sorted(Path(f).glob(f"{name}-*.whl"))]
    if not hits:
        pytest.skip(f"no {name} wheel in $PEER_WHEELS / build/peers or $RL_PEER_WHEELS / build/rl-peers (.ci/run downloads "
                    "it: pip download --no-deps -r constraints/peers.txt -d build/peers, and constraints/rl-peers.txt)")
    return hits[-1]


def test_the_released_llamafactory_neat_packing_drops_the_sliding_window_on_eager_and_sdpa(bench):
    """llamafactory 0.9.5's import leaves another transformers module object in sys.modules, which broke later tests'
    monkeypatches of transformers (CI); peer_modules puts the caller's entries back."""
    import transformers

    before = sys.modules["transformers"]
    assert before is transformers
    results = _by(measure(_real("llamafactory"), bench, models=("llama", "mistral")))
    assert sys.modules["transformers"] is before
    assert results[("neat_packing", "llama", "sdpa")].verdict == "pass"
    assert results[("neat_packing", "mistral", "eager")].cause == "sliding_window"
    assert results[("neat_packing_flash", "mistral", "packcheck_flash_ref")].verdict == "pass"
    assert results_document(list(results.values()))["peers"] == {"llamafactory": wheel_version(_real("llamafactory"))[1]}


def test_the_released_axolotl_multipack_collator_keeps_the_examples_apart(bench):
    results = measure(_real("axolotl"), bench, models=("llama", "gemma3_text"), backends=("sdpa", "packcheck_flash_ref"))
    assert [r.verdict for r in results] == ["pass"] * 4, [(r.model, r.backend, r.verdict, r.reason) for r in results]
    assert all("sdpa_varlen" in r.not_on_cpu for r in results)


def test_the_released_nemo_automodel_block_causal_bool_mask_is_not_applied_on_eager(bench):
    """NeMo Automodel 0.7.0's neat_packed_collater hands eager a 4-D *bool* block-causal mask; transformers' eager
    attention adds the mask to the scores, so True / False add 1 / 0 and nothing is masked (sdpa reads a bool mask
    as keep / drop and is exact). packcheck's own segment_masks hazard measures the same on its 4-D bool mask."""
    results = _by(measure(_real("nemo_automodel"), bench, models=("llama",)))
    eager, sdpa = results[("neat_packing", "llama", "eager")], results[("neat_packing", "llama", "sdpa")]
    assert eager.verdict == "fail" and eager.cause == "segment_mask" and eager.max_abs_diff > 1e-2
    assert sdpa.verdict == "pass"
    assert results[("neat_packing_flash_varlen", "llama", "packcheck_flash_ref")].verdict == "pass"


def test_the_released_ms_swift_verl_and_unsloth_own_paths_run_on_cpu_or_name_what_they_need(bench):
    """ms-swift 4.6.0's padding_free collator and verl 0.9.1's remove-padding patch run on the flash reference;
    unsloth's collator runs, its varlen attention names the GPU its device_type.py asks for."""
    swift = measure(_real("ms_swift"), bench, models=("llama",))
    assert [(r.path, r.verdict) for r in swift] == [("padding_free", "pass")], swift
    verl = measure(_real("verl"), bench, models=("llama",))
    assert [(r.path, r.verdict) for r in verl] == [("remove_padding", "pass")], verl
    assert "_ulysses_flash_attention_forward handed on" in verl[0].note
    unsloth = _by(measure(_real("unsloth"), bench, models=("llama",)))
    assert unsloth[("packing", "llama", "sdpa")].verdict == "pass"
    attention = unsloth[("hf_packed_attention", "llama", "sdpa")]
    assert attention.verdict == "not_run" and "unsloth/device_type.py" in attention.reason, attention


# --- claims.md per claim: the own paths' verdict beside stock transformers' and the statement (issue 45 part 2) ---

def _row(peer, path, model, backend, verdict, diff=None, cause="", reason=""):
    return {"peer": peer, "version": "1", "path": path, "code": "x", "model": model, "backend": backend, "verdict": verdict,
            "max_abs_diff": diff, "per_example": [], "cause": cause, "reason": reason, "note": "", "stubs": [], "not_on_cpu": "",
            "condition": ""}


def _doc(rows):
    return {"schema": "packcheck-peer-paths", "torch": "2.13.0+cpu", "transformers": "5.25.0", "results": rows}


def test_a_claim_shows_its_own_path_verdict_and_a_planted_own_path_failure_flips_it():
    from pytest_packcheck.atlas.claims import Claim, PeerClaims, own_verdict, render_claims

    claim = Claim("axolotl", "llama", True, ("packcheck_flash_ref",), "axolotl/monkeypatch/multipack.py", 12,
                  statement="SUPPORTED_MULTIPACK_MODEL_TYPES = [")
    good = _doc([_row("axolotl", "multipack", "llama", b, "pass", 1e-7) for b in ("eager", "sdpa")])
    own = own_verdict(claim, good)
    assert own["holds"] is True and "`axolotl:multipack` on llama: ✅ eager 1.0e-07, sdpa 1.0e-07" in own["text"]
    bad = _doc([_row("axolotl", "multipack", "llama", "eager", "pass", 1e-7),
                _row("axolotl", "multipack", "llama", "sdpa", "fail", 3e-1, "leak")])
    own = own_verdict(claim, bad)
    assert own["holds"] is False and "❌ eager 1.0e-07, sdpa 3.0e-01 (leak)" in own["text"]
    assert own_verdict(Claim("axolotl", "qwen2", True, (), "f", 1), good)["text"].endswith("not run on qwen2 (not among the models it runs)")
    support = {"releases": [{"transformers": "5.24.0"}], "cells": {}, "missing": []}
    md = [render_claims([PeerClaims("axolotl", "1", "", "a.whl", [claim])], support, d) for d in (good, bad)]
    assert "  - statement: `SUPPORTED_MULTIPACK_MODEL_TYPES = [`; own code, run (holds): `axolotl:multipack` on llama" in md[0]
    assert "own code, run (does not hold): `axolotl:multipack` on llama" in md[1]
    assert "Own code behind the claims (each claim's line below gives its verdict): a model it packs: `axolotl:multipack`" in md[0]
    assert "✅ eager 1.0e-07, sdpa 1.0e-07" in md[0] and "❌ eager 1.0e-07, sdpa 3.0e-01 (leak)" in md[1]


def test_a_claim_on_the_peers_own_code_is_judged_by_it_only_where_every_linked_path_ran():
    """unsloth's "packs *" rests on its collator and its varlen attention: with the attention not run (CPU) it stays
    not judged, the reason said; where both ran it is judged, and a planted own-path failure makes it not hold."""
    from pytest_packcheck.atlas.claims import Claim, claim_groups, judge_with_own_path

    claim = Claim("unsloth", "*", True, ("packcheck_flash_ref",), "unsloth/trainer.py", 1912, own_code="unsloth's varlen attention")
    stock = {"claim": claim, "release": "5.17.0", "holds": None, "why": "rests on the peer's own code: unsloth's varlen attention"}
    collator = [_row("unsloth", "packing", m, "sdpa", "pass", 1e-7) for m in ("llama", "qwen2")]
    cpu = judge_with_own_path(stock, _doc(collator + [_row("unsloth", "hf_packed_attention", "llama", "sdpa", "not_run",
                                                            reason="needs a GPU (unsloth/device_type.py:124)")]))
    assert cpu["holds"] is None and "a linked path did not run here" in cpu["why"]
    assert "⏭️ not run (1 cell): needs a GPU (unsloth/device_type.py:124)" in cpu["own"]["text"]
    assert claim_groups([cpu])["Rest on the peer's own patch or kernel"] == [cpu]
    ran = judge_with_own_path(stock, _doc(collator + [_row("unsloth", "hf_packed_attention", "llama", "sdpa", "pass", 2e-7)]))
    assert ran["holds"] is True and ran["why"].startswith("judged by its own code, run on CPU")
    planted = judge_with_own_path(stock, _doc(collator + [_row("unsloth", "hf_packed_attention", "llama", "sdpa", "fail", 4e-1, "leak")]))
    assert planted["holds"] is False and claim_groups([planted])["Claims that do not hold"] == [planted]
    assert "❌ 1 of 1 cells fail: llama/sdpa 4.0e-01 (leak)" in planted["own"]["text"]


def test_a_refusal_reads_its_models_own_path_cells_its_text_model_included():
    from pytest_packcheck.atlas.claims import Claim, own_verdict

    refusal = Claim("llamafactory", "gemma4", False, ("eager",), "llamafactory/data/collator.py", 493)
    needed = own_verdict(refusal, _doc([_row("llamafactory", "neat_packing", "gemma4_text", "eager", "fail", 5e-1, "sliding_window"),
                                        _row("llamafactory", "neat_packing_flash", "gemma4_text", "packcheck_flash_ref", "pass", 0.0)]))
    assert needed["holds"] is True and "`llamafactory:neat_packing` on gemma4_text: ❌ eager 5.0e-01 (sliding_window)" in needed["text"]
    safe = own_verdict(refusal, _doc([_row("llamafactory", "neat_packing", "gemma4_text", "eager", "pass", 1e-7),
                                      _row("llamafactory", "neat_packing_flash", "gemma4_text", "packcheck_flash_ref", "pass", 0.0)]))
    assert safe["holds"] is False and safe["word"] == "its own path passes on it"
    refused_sdpa = own_verdict(Claim("unsloth", "gpt_oss", False, ("eager",), "unsloth/trainer.py", 197), _doc([
        _row("unsloth", "packing", "gpt_oss", "eager", "fail", 5.8e-1, "leak"),
        _row("unsloth", "packing", "gpt_oss", "sdpa", "not_run", reason="the tiny model does not build: ValueError: "
             "GptOssForCausalLM does not support an attention implementation through sdpa yet.")]))
    assert refused_sdpa["holds"] is True and "❌ eager 5.8e-01 (leak); the library refuses sdpa" in refused_sdpa["text"]


def test_claims_reads_a_wheels_statement_line_and_skips_a_dependency_wheel(tmp_path):
    from pytest_packcheck.atlas.claims import read_wheel
    from pytest_packcheck.cli.claims import dependency_only

    wheel = _wheel(tmp_path, "axolotl", "0.19.0", {"axolotl.monkeypatch.multipack": "X = 1\nSUPPORTED_MULTIPACK_MODEL_TYPES = ['llama']\n",
                                                   "axolotl.utils.schemas.enums": "ATTN_IMPLS_SUPPORTING_PACKING = ['flash_attention_2']\n"})
    claims = read_wheel(wheel).claims
    assert [(c.line, c.statement) for c in claims] == [(2, "SUPPORTED_MULTIPACK_MODEL_TYPES = ['llama']")]
    assert dependency_only(Path("unsloth_zoo-2026.10.9-py3-none-any.whl")) and not dependency_only(Path("unsloth-2026.10.9-py3-none-any.whl"))


def test_docs_quote_the_committed_own_path_numbers():
    """docs/atlas.md's own-path figures against reports/atlas/peer_paths.json (a re-measure that moves one fails)."""
    root = Path(__file__).resolve().parents[1]
    doc = pp.expand_document(json.loads((root / "reports" / "atlas" / "peer_paths.json").read_text()))
    cells = {(r["peer"], r["path"], r["model"], r["backend"]): r for r in doc["results"]}
    text = " ".join((root / "docs" / "atlas.md").read_text().split())
    quoted = {("llamafactory", "neat_packing", "gemma4_text", "eager"): "gemma4's text model 8.1e-01",
              ("llamafactory", "neat_packing", "gpt_oss", "eager"): "gpt_oss 2.3e-01 on eager",
              ("unsloth", "packing", "gpt_oss", "eager"): "leaks on eager (5.8e-01)",
              ("nemo_automodel", "neat_packing", "llama", "eager"): "(llama 2.8e-01, cause `segment_mask`)"}
    for key, phrase in quoted.items():
        assert phrase in text and f"{cells[key]['max_abs_diff']:.1e}" in phrase and cells[key]["verdict"] == "fail", key
    passing = [r for r in doc["results"] if r["peer"] == "ms_swift" or (r["peer"], r["path"]) == ("verl", "remove_padding")
               or (r["peer"] == "unsloth" and r["path"] == "packing"
               and r["model"] in ("llama", "qwen2", "mistral", "gemma3_text"))]
    assert passing and all(r["verdict"] == "pass" for r in passing)
    assert f"(at most {max(r['max_abs_diff'] for r in passing):.1e})" in text
    attention = [r for r in doc["results"] if r["path"] == "hf_packed_attention"]
    assert attention and all(r["verdict"] == "not_run" and "unsloth/device_type.py:124" in r["reason"] for r in attention)


# unsloth 2026.10.9's enable_sample_packing, the part the packing path runs (utils/packing.py:233): the collator's
# torch_call wrapped to add packed_seq_lengths and drop attention_mask; the 'sdpa' wrapper install is left out here
UNSLOTH_PACKING = """
import torch
def enable_sample_packing(model, trainer, *, sequence_lengths_key="seq_lengths"):
    collator = trainer.data_collator
    collator.padding_free = True
    collator.return_position_ids = True
    original = collator.torch_call
    def torch_call_with_lengths(examples):
        batch = original(examples)
        lengths = [int(n) for e in examples for n in e.get(sequence_lengths_key, [])]
        batch["packed_seq_lengths"] = torch.tensor(lengths, dtype=torch.int32)
        batch.pop("attention_mask", None)
        return batch
    collator.torch_call = torch_call_with_lengths
"""
# planted: the wrapper renumbers position_ids over the whole row (one sequence): every later example sees the others
UNSLOTH_RENUMBERS = UNSLOTH_PACKING.replace('        batch.pop("attention_mask", None)\n',
                                            '        batch.pop("attention_mask", None)\n'
                                            '        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]\n'
                                            '        for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):\n'
                                            '            batch.pop(k, None)\n')


def test_unsloth_packing_collator_runs_without_its_package_init_and_a_renumbering_wrapper_is_caught(tmp_path, bench):
    results = {}
    for name, source in (("ok", UNSLOTH_PACKING), ("bad", UNSLOTH_RENUMBERS)):
        (tmp_path / name).mkdir()
        wheel = _wheel(tmp_path / name, "unsloth", "2026.10.9", {"unsloth.utils.packing": source,
                                                                "unsloth.__init__": "raise ImportError('needs unsloth_zoo')\n"})
        results[name] = _by(measure(wheel, bench, models=("llama",), backends=("sdpa",)))
    ok = results["ok"][("packing", "llama", "sdpa")]
    assert ok.verdict == "pass" and "packed_seq_lengths [" in ok.note and "unsloth/__init__.py not run" in ok.stubs, ok
    bad = results["bad"][("packing", "llama", "sdpa")]
    assert bad.verdict == "fail" and bad.cause == "leak" and bad.max_abs_diff > 1e-2, bad
    # the attention path's module is not in the stand-in wheel: named, never a pass
    assert results["ok"][("hf_packed_attention", "llama", "sdpa")].verdict == "not_run"


def test_cli_claims_reads_the_peers_and_names_a_dependency_wheel_it_does_not_read(tmp_path, capsys):
    from pytest_packcheck.cli import main

    peer = _wheel(tmp_path, "axolotl", "0.19.0", {"axolotl.monkeypatch.multipack": "SUPPORTED_MULTIPACK_MODEL_TYPES = ['llama']\n"})
    dep = _wheel(tmp_path, "unsloth_zoo", "2026.10.9", {"unsloth_zoo.utils": ""})
    assert main(["claims", str(peer), str(dep), "-o", str(tmp_path / "claims.md")]) == 0
    assert "unsloth_zoo-2026.10.9-py3-none-any.whl: imported by a peer's own path, not a peer; not read" in capsys.readouterr().err
    assert "## axolotl 0.19.0" in (tmp_path / "claims.md").read_text()


# --- the peers' per-model patches (issue 45 part 2): verl's VLM forwards, axolotl's hybrid-model patches -------------

def _run_path(key: str, wheel: Path, models: tuple[str, ...], backends: tuple[str, ...]):
    """``key``'s path on ``models`` in this process (its transformers pin taken off: the stand-in wheels run on the
    installed transformers, no pinned environment is made)."""
    import dataclasses

    path = dataclasses.replace(next(p for p in PEER_PATHS if p.key == key), transformers="")
    return pp._measure_path(wheel, path, wheel_version(wheel)[1], models, backends, pp.build_bench)


# verl 0.9.1's qwen2_vl forward patch, reduced to what the path judges: Qwen2VLForConditionalGeneration.forward
# replaced by verl's forward_with_normal_backend, which hands the batch on to the model's own forward
VERL_QWEN2_VL = """
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
_ORIGINAL = Qwen2VLForConditionalGeneration.forward
def forward_with_normal_backend(self, input_ids=None, labels=None, temperature=1.0, **kwargs):
    return _ORIGINAL(self, input_ids=input_ids, **kwargs)
"""
VERL_VLM_PATCH = VERL_PATCH + """
def _patch_vlm(model):
    if model.config.model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
        from verl.models.transformers.qwen2_vl import forward_with_normal_backend
        Qwen2VLForConditionalGeneration.forward = forward_with_normal_backend
        print(f"Monkey patch {model.__class__.__name__} model forward")
_apply = apply_monkey_patch
def apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True):
    _patch_vlm(model)
    return _apply(model, ulysses_sp_size, use_remove_padding)
"""
# planted: verl's forward renumbers position_ids over the whole row (one sample to the model: a leak)
VERL_QWEN2_VL_DROPS = VERL_QWEN2_VL.replace("    return _ORIGINAL(", (
    "    import torch\n    n = input_ids.shape[1]\n"
    "    kwargs['position_ids'] = torch.arange(n)[None, None].expand(4, 1, n).contiguous()\n    return _ORIGINAL("))
# planted: "Monkey patch ... model forward" printed, nothing installed (the batch would run on stock code)
VERL_VLM_LOGGED_ONLY = VERL_VLM_PATCH.replace("        Qwen2VLForConditionalGeneration.forward = forward_with_normal_backend\n", "")


def test_verl_vlm_forward_runs_its_patch_on_a_pixel_row_and_catches_renumbered_positions_and_a_patch_never_installed(tmp_path):
    """verl's VLM forward patch on the tiny Qwen2-VL: a pixel row (image, text, image) with M-RoPE position_ids
    (4, 1, total), each sample's text logits against the sample alone with its image; the class is put back after."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration

    original = Qwen2VLForConditionalGeneration.forward

    def run(folder: str, patch: str, forward: str):
        (tmp_path / folder).mkdir()
        wheel = _verl_wheel(tmp_path / folder, patch)
        with zipfile.ZipFile(wheel, "a") as z:
            z.writestr("verl/models/transformers/qwen2_vl.py", textwrap.dedent(forward))
        return _run_path("verl:vlm_forward", wheel, ("arch:qwen2_vl",), ("packcheck_flash_ref",))[0]

    r = run("ok", VERL_VLM_PATCH, VERL_QWEN2_VL)
    assert (r.model, r.verdict) == ("qwen2_vl_text", "pass") and len(r.per_example) == 3, r
    assert "position_ids (4, 1, " in r.note and "Qwen2VLForConditionalGeneration.forward x1" in r.note
    assert Qwen2VLForConditionalGeneration.forward is original
    r = run("renumbers", VERL_VLM_PATCH, VERL_QWEN2_VL_DROPS)  # the first image's M-RoPE rows move too
    assert r.verdict == "fail" and r.cause == "leak" and min(r.per_example) > 1e-2, (r.reason, r.note)
    r = run("logged", VERL_VLM_LOGGED_ONLY, VERL_QWEN2_VL)
    assert r.verdict == "error" and "never called it" in r.reason and "none installed" in r.note, r
    assert Qwen2VLForConditionalGeneration.forward is original


# verl 0.9.1's Qwen3.5 patch (verl/models/transformers/qwen3_5.py), reduced to the installed transformers' layer: the
# model's forward takes cu_seqlens (transformer_impl.py:594 passes them), the gated-delta-net layer convolves each
# sample alone (its _packed_causal_conv1d_fallback, :146) and hands cu_seqlens to the layer's chunk_gated_delta_rule
# wherever it takes **kwargs (_packed_chunk_gated_delta_rule, :175-179), else runs each sample alone (:181-190)
VERL_QWEN3_5 = """
import torch
import torch.nn.functional as F
from inspect import signature
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling
_ORIGINAL_LM, _ORIGINAL_NET = modeling.Qwen3_5ForConditionalGeneration.forward, modeling.Qwen3_5GatedDeltaNet.forward
_PACKED = [None]
def _call_accepts_kwarg(fn, name):
    params = signature(fn).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
def forward_with_normal_backend(self, input_ids=None, cu_seqlens=None, cu_seqlens_cpu=None, temperature=1.0, **kwargs):
    _PACKED[0] = cu_seqlens
    try:
        return _ORIGINAL_LM(self, input_ids=input_ids, **kwargs)
    finally:
        _PACKED[0] = None
def _packed_chunk_gated_delta_rule(self, q, k, v, g, beta, cu):
    kwargs = {"g": g, "beta": beta, "initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True}
    if _call_accepts_kwarg(self.chunk_gated_delta_rule, "cu_seqlens"):
        return self.chunk_gated_delta_rule(q, k, v, cu_seqlens=cu, cu_seqlens_cpu=cu, **kwargs)
    bounds, outs = cu.tolist(), []
    for a, b in zip(bounds, bounds[1:]):
        outs.append(self.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], **{**kwargs, "g": g[:, a:b], "beta": beta[:, a:b]})[0])
    return torch.cat(outs, dim=1), None
def qwen3_5_gated_delta_net_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    cu = _PACKED[0]
    if cu is None:
        return _ORIGINAL_NET(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    n, bounds = hidden_states.shape[1], cu.tolist()
    qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
    qkv = torch.cat([F.silu(self.conv1d(qkv[..., a:b])[..., :b - a]) for a, b in zip(bounds, bounds[1:])], dim=-1)
    q, k, v = torch.split(qkv.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k, v = q.reshape(1, n, -1, self.head_k_dim), k.reshape(1, n, -1, self.head_k_dim), v.reshape(1, n, -1, self.head_v_dim)
    z = self.in_proj_z(hidden_states).reshape(1, n, -1, self.head_v_dim)
    beta = self.in_proj_b(hidden_states).sigmoid()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
    if self.num_v_heads // self.num_k_heads > 1:
        q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
    out, _ = _packed_chunk_gated_delta_rule(self, q, k, v, g, beta, cu)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(1, n, -1)
    return self.out_proj(out)
"""
VERL_QWEN3_5_PATCH = VERL_PATCH + """
_apply = apply_monkey_patch
def apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True):
    if model.config.model_type in ("qwen3_5", "qwen3_5_moe"):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration, Qwen3_5GatedDeltaNet
        from verl.models.transformers.qwen3_5 import forward_with_normal_backend, qwen3_5_gated_delta_net_forward
        Qwen3_5ForConditionalGeneration.forward = forward_with_normal_backend
        Qwen3_5GatedDeltaNet.forward = qwen3_5_gated_delta_net_forward
        print(f"Monkey patch {model.__class__.__name__} model forward")
    return _apply(model, ulysses_sp_size, use_remove_padding)
"""

_REFERENCE = pp.fla_chunk_gated_delta_rule_reference


def _torch_chunk_gated_delta_rule_5_10_4(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                         output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers 5.10.4's torch_chunk_gated_delta_rule as verl meets it (modeling_qwen3_5.py:246): ``**kwargs``
    takes cu_seqlens and nothing reads it, the row runs as one sequence (5.25.0's raises on cu_seqlens instead)."""
    return _REFERENCE(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def test_verl_qwen3_5_is_judged_with_fla_on_its_cpu_stand_in_and_shown_without_it(tmp_path, monkeypatch):
    """verl's Qwen3.5 patch on the tiny Qwen3.5 VLM's pixel row, each gated-delta-net layer's chunk_gated_delta_rule as
    transformers 5.10.4's __init__ binds it without fla (modeling_qwen3_5.py:422; the installed release binds none): the judged
    path binds packcheck's per-segment stand-in of fla's kernel and passes, its condition saying so; a planted stand-in
    that drops cu_seqlens leaks; the no-fla path (transformers' torch_chunk_gated_delta_rule, which takes cu_seqlens in
    **kwargs and ignores it) leaks, its condition naming both files; the layers are put back after each cell."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    (tmp_path / "w").mkdir()
    wheel = _verl_wheel(tmp_path / "w", VERL_QWEN3_5_PATCH)
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("verl/models/transformers/qwen3_5.py", textwrap.dedent(VERL_QWEN3_5))
    layers = []

    def build(model, backend):  # the layers as transformers 5.10.4 builds them without fla
        bench = pp.build_bench(model, backend)
        for m in bench.model.modules():
            if isinstance(m, modeling.Qwen3_5GatedDeltaNet):
                object.__setattr__(m, "chunk_gated_delta_rule", _torch_chunk_gated_delta_rule_5_10_4)
                layers.append(m)
        return bench

    def run(key):
        import dataclasses

        path = dataclasses.replace(next(p for p in PEER_PATHS if p.key == key), transformers="")
        out = pp._measure_path(wheel, path, "0.9.1", ("vlm:qwen3_5",), ("packcheck_flash_ref",), build)[0]
        assert layers and all(m.chunk_gated_delta_rule is _torch_chunk_gated_delta_rule_5_10_4 for m in layers)
        return out

    r = run("verl:vlm_forward")
    assert (r.model, r.verdict) == ("qwen3_5_text", "pass") and len(r.per_example) == 3, (r.reason, r.note)
    assert r.condition.startswith("with fla (flash-linear-attention) installed") and "qwen3_5.py:" in r.condition, r.condition
    assert any("fla_chunk_gated_delta_rule_reference" in s for s in r.stubs), r.stubs
    assert "Qwen3_5GatedDeltaNet.forward x" in r.note
    real = pp.fla_chunk_gated_delta_rule_reference

    def drops(q, k, v, g, beta, cu_seqlens=None, **kwargs):  # planted: the stand-in runs the whole row as one sample
        return real(q, k, v, g, beta, **{k2: v2 for k2, v2 in kwargs.items() if k2 != "cu_seqlens_cpu"})

    monkeypatch.setattr(pp, "fla_chunk_gated_delta_rule_reference", drops)
    r = run("verl:vlm_forward")
    assert r.verdict == "fail" and r.cause == "leak" and r.max_abs_diff > 1e-4 and r.per_example[0] <= r.tolerance, r
    monkeypatch.undo()
    r = run("verl:vlm_forward_no_fla")
    assert r.verdict == "fail" and r.cause == "leak" and r.max_abs_diff > 1e-4, (r.reason, r.note)
    assert r.condition.startswith("without fla (flash-linear-attention), verl hands cu_seqlens (verl/models/transformers/"
                                  "qwen3_5.py:") and "to transformers' torch_chunk_gated_delta_rule (" in r.condition \
        and f"which ignores it: leak {r.max_abs_diff:.1e}" in r.condition, r.condition
    assert "engine.py:404-410" in r.condition and not any("fla_chunk" in s for s in r.stubs)


def test_verl_vlm_cells_name_a_model_transformers_lacks_and_a_model_without_a_pixel_row(tmp_path):
    (tmp_path / "w").mkdir()
    wheel = _verl_wheel(tmp_path / "w", VERL_VLM_PATCH)
    kimi = _run_path("verl:vlm_forward", wheel, ("arch:kimi_vl",), ("packcheck_flash_ref",))[0]
    assert kimi.verdict == "not_run" and kimi.model == "kimi_vl" and "remote code" in kimi.reason and "monkey_patch.py:485" in kimi.reason
    llama = _run_path("verl:vlm_forward", wheel, ("llama",), ("packcheck_flash_ref",))[0]
    assert llama.verdict == "not_run" and "packcheck lays out no pixel row for it" in llama.reason, llama


# axolotl 0.19.0's qwen3_next packing patch, reduced: the decoder layer hands position_ids to the linear attention
# (monkeypatch/models/qwen3_next/modeling.py:patched_decoder_forward), whose forward then runs each packed example
# alone (what fla's varlen kernels do with the cu_seqlens it derives from position_ids)
AXOLOTL_QWEN3_NEXT = """
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as modeling
fla_causal_conv1d = None
fla_chunk_gated_delta_rule = None
def patch_qwen3_next_modeling_packing():
    layer, net = modeling.Qwen3NextDecoderLayer.forward, modeling.Qwen3NextGatedDeltaNet.forward
    def patched_decoder_forward(self, hidden_states, *args, position_ids=None, **kwargs):
        if hasattr(self, "linear_attn"):
            self.linear_attn._position_ids = position_ids
        return layer(self, hidden_states, *args, position_ids=position_ids, **kwargs)
    def patched_gated_delta_net_forward(self, hidden_states, *args, **kwargs):
        pos = getattr(self, "_position_ids", None)
        if pos is None:
            return net(self, hidden_states, *args, **kwargs)
        if fla_chunk_gated_delta_rule is None:
            raise RuntimeError("Packed sequences require flash-linear-attention (cu_seqlens support in causal_conv1d "
                               "and chunk_gated_delta_rule).")
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
        return torch.cat([net(self, hidden_states[:, a:b]) for a, b in zip(starts, starts[1:])], dim=1)
    modeling.Qwen3NextDecoderLayer.forward = patched_decoder_forward
    modeling.Qwen3NextGatedDeltaNet.forward = patched_gated_delta_net_forward
"""
# planted: the decoder layer drops position_ids on the way to the linear attention (its state then crosses examples)
AXOLOTL_QWEN3_NEXT_DROPS = AXOLOTL_QWEN3_NEXT.replace("self.linear_attn._position_ids = position_ids", "self.linear_attn._position_ids = None")
# planted: the patch logs that it applied, installs nothing
AXOLOTL_QWEN3_NEXT_LOGGED = AXOLOTL_QWEN3_NEXT.replace(
    "    modeling.Qwen3NextDecoderLayer.forward = patched_decoder_forward\n    modeling.Qwen3NextGatedDeltaNet.forward = "
    "patched_gated_delta_net_forward\n", "    print('Applied Qwen3Next patch for packing')\n")
# planted: the patch crashes on the transformers it meets (an attribute that release renamed)
AXOLOTL_QWEN3_NEXT_CRASHES = AXOLOTL_QWEN3_NEXT.replace("    layer, net =", "    modeling.Qwen3NextGatedDeltaNet.cuda_kernels_forward\n    layer, net =")


def test_axolotl_model_patch_threads_boundaries_and_catches_dropped_positions_a_patch_never_installed_and_its_refusal(tmp_path):
    """axolotl's per-model patch under its multipack batch (position_ids, no attention_mask) on the tiny Qwen3-Next,
    fla's kernels bound to packcheck's CPU reference (named): the patch that threads the boundaries passes, each
    planted fault is caught, a refusal to pack without fla is a not-run naming it, and the classes are put back."""
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    originals = (modeling.Qwen3NextDecoderLayer.forward, modeling.Qwen3NextGatedDeltaNet.forward)

    def run(folder: str, patch: str):
        (tmp_path / folder).mkdir()
        wheel = _wheel(tmp_path / folder, "axolotl", "0.19.0", {"axolotl.utils.collators.batching": AXOLOTL_RIGHT,
                                                                "axolotl.monkeypatch.models.qwen3_next.modeling": patch})
        out = _run_path("axolotl:model_patches", wheel, ("qwen3_next",), ("sdpa",))[0]
        assert (modeling.Qwen3NextDecoderLayer.forward, modeling.Qwen3NextGatedDeltaNet.forward) == originals
        return out

    r = run("ok", AXOLOTL_QWEN3_NEXT)
    assert r.verdict == "pass" and "Qwen3NextGatedDeltaNet.forward x" in r.note, (r.reason, r.note)
    assert any("per-segment CPU reference of fla's" in s for s in r.stubs)
    r = run("drops", AXOLOTL_QWEN3_NEXT_DROPS)
    assert r.verdict == "fail" and r.cause == "leak" and r.max_abs_diff > 1e-3 and r.per_example[0] <= r.tolerance, r
    r = run("logged", AXOLOTL_QWEN3_NEXT_LOGGED)
    assert r.verdict == "error" and "never called it" in r.reason and "none installed" in r.note, r
    r = run("crashes", AXOLOTL_QWEN3_NEXT_CRASHES)
    assert r.verdict == "error" and "AttributeError" in r.reason and "qwen3_next/modeling.py" in r.reason, r
    refuses = AXOLOTL_QWEN3_NEXT.replace("fla_chunk_gated_delta_rule = None\n", "fla_chunk_gated_delta_rule = None\n"
                                         "_FLA_NOT_BOUND = True\n").replace("if fla_chunk_gated_delta_rule is None:", "if _FLA_NOT_BOUND:")
    r = run("refuses", refuses)
    assert r.verdict == "not_run" and r.reason.startswith("the peer's own refusal: RuntimeError: Packed sequences require "
                                                          "flash-linear-attention"), r


def test_the_fla_references_run_each_segment_alone():
    """packcheck's stand-ins for fla's varlen kernels: with cu_seqlens each segment equals that segment run alone
    (and differs from the whole row run as one, the leak they stand between)."""
    import torch

    torch.manual_seed(0)
    x, w = torch.randn(1, 9, 4), torch.randn(4, 4)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    y, _ = pp.fla_causal_conv1d_reference(x, w, activation="silu", cu_seqlens=cu)
    alone, _ = pp.fla_causal_conv1d_reference(x[:, 5:], w, activation="silu")
    whole, _ = pp.fla_causal_conv1d_reference(x, w, activation="silu")
    assert torch.allclose(y[:, 5:], alone) and not torch.allclose(whole[:, 5:], alone)
    q, k, v = torch.randn(1, 9, 2, 4), torch.randn(1, 9, 2, 4), torch.randn(1, 9, 2, 4)
    g, beta = -torch.rand(1, 9, 2), torch.rand(1, 9, 2)
    o, _ = pp.fla_chunk_gated_delta_rule_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o2, _ = pp.fla_chunk_gated_delta_rule_reference(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], use_qk_l2norm_in_kernel=True)
    o3, _ = pp.fla_chunk_gated_delta_rule_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(o[:, 5:], o2, atol=1e-6) and not torch.allclose(o3[:, 5:], o2, atol=1e-3)


def test_an_own_code_claim_reads_its_model_patch_path_and_a_shown_path_does_not_count():
    """axolotl's own-code claims read model_patches (its other claims multipack); verl's VLM claims are judged by the
    pixel row, the text-only micro-batch shown beside it: a planted failure there does not flip the claim, one in the
    pixel row does."""
    from pytest_packcheck.atlas.claims import Claim, judge_with_own_path, own_links

    own = Claim("axolotl", "qwen3_next", True, ("packcheck_flash_ref",), "axolotl/monkeypatch/multipack.py", 12,
                own_code="axolotl/monkeypatch/models/qwen3_next/")
    plain = Claim("axolotl", "llama", True, ("packcheck_flash_ref",), "axolotl/monkeypatch/multipack.py", 12)
    assert [k.paths for k in own_links(own)] == [("axolotl:model_patches",)]
    assert [k.paths for k in own_links(plain)] == [("axolotl:multipack",)]
    stock = {"claim": own, "release": "5.16.1", "holds": None, "why": "rests on the peer's own code"}
    ran = judge_with_own_path(stock, _doc([_row("axolotl", "model_patches", "qwen3_next", "sdpa", "pass", 2e-7)]))
    assert ran["holds"] is True and "`axolotl:model_patches` on qwen3_next: ✅ sdpa 2.0e-07" in ran["why"]
    vlm = Claim("verl", "qwen2_vl", True, ("packcheck_flash_ref",), "verl/models/transformers/monkey_patch.py", 365,
                own_code="verl/models/transformers/monkey_patch.py:365: verl replaces its forward / attention")
    stock = {"claim": vlm, "release": "5.10.4", "holds": None, "why": "rests on the peer's own code"}
    pixel = _row("verl", "vlm_forward", "qwen2_vl_text", "packcheck_flash_ref", "pass", 3.6e-7)
    text_error = _row("verl", "vlm_forward_text", "qwen2_vl_text", "packcheck_flash_ref", "error",
                      reason="AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'")
    j = judge_with_own_path(stock, _doc([pixel, text_error]))
    assert j["holds"] is True and "(shown, not counted)" in j["why"] and "💥 error" in j["why"]
    planted = judge_with_own_path(stock, _doc([{**pixel, "verdict": "fail", "max_abs_diff": 0.2, "cause": "leak"}, text_error]))
    assert planted["holds"] is False


def test_a_qwen3_5_claim_line_says_its_verdict_is_for_verl_with_fla_and_the_no_fla_leak_does_not_count():
    """verl's "packs qwen3_5" is judged by vlm_forward (fla's kernel on its stand-in): its line names the condition;
    the no-fla path's leak is shown with its own condition, never counted; a leak in the judged path flips it."""
    from pytest_packcheck.atlas.claims import Claim, judge_with_own_path

    claim = Claim("verl", "qwen3_5", True, ("packcheck_flash_ref",), "verl/models/transformers/monkey_patch.py", 500,
                  own_code="verl/models/transformers/monkey_patch.py:500: verl replaces its forward / attention")
    stock = {"claim": claim, "release": "5.10.4", "holds": None, "why": "rests on the peer's own code"}
    with_fla = {**_row("verl", "vlm_forward", "qwen3_5_text", "packcheck_flash_ref", "pass", 3.6e-7),
                "condition": "with fla (flash-linear-attention) installed: verl hands cu_seqlens to fla's kernel (x/y.py:1)"}
    no_fla = {**_row("verl", "vlm_forward_no_fla", "qwen3_5_text", "packcheck_flash_ref", "fail", 1.6e-3, cause="leak"),
              "condition": "without fla (flash-linear-attention), verl hands cu_seqlens (verl/a.py:158) to transformers' "
                           "torch_chunk_gated_delta_rule, which ignores it: leak 1.6e-03; engine.py:404-410 says it raises"}
    j = judge_with_own_path(stock, _doc([with_fla, no_fla]))
    assert j["holds"] is True, j["why"]
    assert "✅ packcheck_flash_ref 3.6e-07 (with fla (flash-linear-attention) installed: verl hands cu_seqlens to fla's kernel)" in j["why"]
    assert ("❌ packcheck_flash_ref 1.6e-03 (leak) (without fla (flash-linear-attention), verl hands cu_seqlens to transformers' "
            "torch_chunk_gated_delta_rule, which ignores it: leak 1.6e-03) (shown, not counted)") in j["why"], j["why"]
    planted = judge_with_own_path(stock, _doc([{**with_fla, "verdict": "fail", "max_abs_diff": 1.6e-3, "cause": "leak"}, no_fla]))
    assert planted["holds"] is False
    qwen2 = Claim("verl", "qwen2_vl", True, ("packcheck_flash_ref",), "verl/models/transformers/monkey_patch.py", 365,
                  own_code="verl/models/transformers/monkey_patch.py:365: verl replaces its forward / attention")
    other = judge_with_own_path({**stock, "claim": qwen2}, _doc([_row("verl", "vlm_forward", "qwen2_vl_text", "packcheck_flash_ref",
                                                                       "pass", 3.6e-7), no_fla]))
    assert other["holds"] is True and "no_fla" not in other["why"], other["why"]  # a shown path not run on it is left out


def test_docs_quote_the_committed_per_model_patch_numbers():
    """docs/atlas.md's figures for axolotl's and verl's per-model patches against reports/atlas/peer_paths.json (the
    largest max abs diff over a model's backends), and the file:line of each crash or refusal it names."""
    root = Path(__file__).resolve().parents[1]
    doc = pp.expand_document(json.loads((root / "reports" / "atlas" / "peer_paths.json").read_text()))
    text = " ".join((root / "docs" / "atlas.md").read_text().split())

    def cells(peer, path, model):
        found = [r for r in doc["results"] if (r["peer"], r["path"], r["model"]) == (peer, path, model)]
        assert found, (peer, path, model)
        return found

    quoted = {("axolotl", "model_patches", "qwen3_next"): ("qwen3_next (2.4e-07)", "pass"),
              ("axolotl", "model_patches", "qwen3_5_text"): ("qwen3_5 (4.8e-07)", "pass"),
              ("axolotl", "model_patches", "qwen4_exp_text"): ("qwen4_exp (8.9e-08)", "pass"),
              ("verl", "vlm_forward", "qwen2_5_vl_text"): ("qwen2_5_vl (3.6e-07)", "pass"),
              ("verl", "vlm_forward", "qwen3_vl_text"): ("qwen3_vl (8.9e-08)", "pass"),
              ("verl", "vlm_forward", "qwen3_vl_moe_text"): ("qwen3_vl_moe (1.0e-07)", "pass"),
              ("verl", "vlm_forward", "qwen3_5_text"): ("qwen3_5 (3.6e-07)", "pass"),
              ("verl", "vlm_forward", "qwen3_5_moe_text"): ("qwen3_5_moe (1.8e-07)", "pass"),
              ("verl", "vlm_forward_no_fla", "qwen3_5_text"): ("qwen3_5 (1.6e-03)", "fail"),
              ("verl", "vlm_forward_no_fla", "qwen3_5_moe_text"): ("qwen3_5_moe (2.7e-03)", "fail")}
    for key, (phrase, verdict) in quoted.items():
        ran = [r for r in cells(*key) if r["verdict"] in ("pass", "fail")]
        assert phrase in text and f"{max(r['max_abs_diff'] for r in ran):.1e}" in phrase, key
        assert {r["verdict"] for r in ran} == {verdict}, key
    assert cells("verl", "vlm_forward", "qwen2_vl_text")[0]["max_abs_diff"] <= cells("verl", "vlm_forward", "qwen2_5_vl_text")[0]["max_abs_diff"]
    named = {("axolotl", "model_patches", "granitemoehybrid"): ("error", "granitemoehybrid/modeling.py:73"),
             ("axolotl", "model_patches", "nemotron_h"): ("not_run", "nemotron_h/modeling.py:88"),
             ("axolotl", "model_patches", "falcon_h1"): ("not_run", "falcon_h1/modeling.py:283"),
             ("verl", "vlm_forward_text", "qwen2_vl_text"): ("error", "qwen2_vl.py:394"),
             ("verl", "vlm_forward_text", "glm4v_text"): ("error", "glm4v.py:385"),
             ("verl", "vlm_forward", "kimi_vl"): ("not_run", "monkey_patch.py:485")}
    for key, (verdict, where) in named.items():
        assert all(r["verdict"] == verdict and where in r["reason"] for r in cells(*key)), key
        assert where.rsplit("/", 1)[-1].split(":")[0] in text or where in text, key
    assert all(r.get("transformers") == "5.10.4" for r in doc["results"] if r["path"].startswith("vlm_forward"))
    # the judged Qwen3.5 cells are verl with fla (its stand-in named), the no-fla ones say what they are
    for model in ("qwen3_5_text", "qwen3_5_moe_text"):
        fla, = cells("verl", "vlm_forward", model)
        assert fla["condition"].startswith("with fla") and any("fla_chunk_gated_delta_rule_reference" in x for x in fla["stubs"])
        bare, = cells("verl", "vlm_forward_no_fla", model)
        assert bare["condition"].startswith("without fla (flash-linear-attention), verl hands cu_seqlens") \
            and f"which ignores it: leak {bare['max_abs_diff']:.1e}" in bare["condition"] and "engine.py:404-410" in bare["condition"]
    assert all(r.get("transformers") == "5.16.1" for r in doc["results"] if r["path"] == "model_patches")


def test_a_path_pinned_to_another_transformers_runs_in_its_environment_or_names_why_not(tmp_path, monkeypatch):
    """measure() hands a pinned path to packcheck's environment of that transformers (its results read back as JSON);
    an environment that cannot be made, or a run that fails there, is a not-run cell per model naming why."""
    import subprocess

    from pytest_packcheck.versions import envs

    (tmp_path / "w").mkdir()
    wheel = _verl_wheel(tmp_path / "w", VERL_VLM_PATCH)
    path = next(p for p in PEER_PATHS if p.key == "verl:vlm_forward")

    def no_env(combo, log=None):
        raise envs.EnvError("uv is not installed")

    monkeypatch.setattr(envs, "ensure_env", no_env)
    out = pp._measure_in_env(wheel, path, "0.9.1", ("arch:qwen2_vl", "arch:kimi_vl"), ("packcheck_flash_ref",))
    assert [(r.model, r.verdict) for r in out] == [("qwen2_vl", "not_run"), ("kimi_vl", "not_run")]
    assert all("no environment of transformers 5.10.4 (uv is not installed)" in r.reason and r.transformers == "5.10.4" for r in out)
    seen = {}

    def fake_env(combo, log=None):
        seen["combo"] = combo.requirements
        return envs.VersionEnv(combo, tmp_path, Path(sys.executable), {}, False, 0.0)

    row = pp.PathResult("verl", "0.9.1", "vlm_forward", "c", "qwen2_vl_text", "packcheck_flash_ref", "pass", 1e-7, [1e-7],
                        1e-4, transformers="5.10.4")

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, "log line\n" + json.dumps([row.as_dict()]) + "\n", "")

    monkeypatch.setattr(envs, "ensure_env", fake_env)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = pp._measure_in_env(wheel, path, "0.9.1", ("arch:qwen2_vl",), ("packcheck_flash_ref",))
    assert seen["combo"] == ("transformers==5.10.4",) and seen["cmd"][1:4] == ["-m", "pytest_packcheck.atlas.peer_paths", str(wheel.resolve())]
    assert [(r.model, r.verdict, r.transformers) for r in out] == [("qwen2_vl_text", "pass", "5.10.4")]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "Traceback\nImportError: boom"))
    out = pp._measure_in_env(wheel, path, "0.9.1", ("arch:qwen2_vl",), ("packcheck_flash_ref",))
    assert out[0].verdict == "not_run" and "failed (exit 1: ImportError: boom)" in out[0].reason
