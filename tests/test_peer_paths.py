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
        for p in packages:
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


def test_a_path_packcheck_does_not_drive_is_not_run_even_where_it_imports(tmp_path, bench):
    wheel = _wheel(tmp_path, "ms_swift", "4.6.0", {"swift.model.patcher": "def revert_padding_free(o, i): return o\n"})
    results = measure(wheel, bench, models=("llama",), backends=("sdpa",))
    assert [(r.peer, r.verdict) for r in results] == [("ms_swift", "not_run")]
    assert "does not drive this path yet" in results[0].reason


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
    assert wheel_version(Path("ms_swift-4.6.0-py3-none-any.whl")) == ("ms-swift", "4.6.0")
    with pytest.raises(ValueError, match="not a wheel"):
        wheel_version(Path("axolotl-0.19.0.tar.gz"))


def _real(name: str) -> Path:
    folder = os.environ.get("PEER_WHEELS") or str(Path(__file__).resolve().parents[1] / "build" / "peers")
    hits = sorted(Path(folder).glob(f"{name}-*.whl")) if folder else []
    if not hits:
        pytest.skip(f"no {name} wheel in $PEER_WHEELS or build/peers (.ci/run downloads it: pip download --no-deps -r constraints/peers.txt -d build/peers)")
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
