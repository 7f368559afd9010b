"""The RL trainers per release (atlas/rl_peers.py, issue 44 part 2): what a release's files say (anchors, the import
chain to ray), the release's own code measured in the child on planted releases (a right one passes, a wrong one
fails with its number), and the block's transitions and rendering."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from pytest_packcheck.atlas import rl_peers as R

pytest.importorskip("trl")

# verl 0.9.1's pure-torch remove-padding helpers and log-prob gather, reduced to what the check calls
ATTENTION_UTILS = """
import torch
import torch.nn.functional as F
def index_first_axis(tensor, indices):
    return tensor[indices]
def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])
def unpad_input(hidden_states, attention_mask, unused_mask=None):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices), indices, cu, int(seqlens.max()), seqlens
def rearrange(tensor, pattern):
    assert pattern == "b s ... -> (b s) ..."
    return tensor.reshape(-1, *tensor.shape[2:])
"""
TORCH_FUNCTIONAL = """
import torch
def logprobs_from_logits(logits, labels, inplace_backward=True):
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
"""
# planted: the gather reads the label one position on (a second roll, as a release that shifted twice would)
TORCH_FUNCTIONAL_SHIFTED = TORCH_FUNCTIONAL.replace("labels.unsqueeze(-1)", "torch.roll(labels, -1).unsqueeze(-1)")
DP_ACTOR = """
import torch
def forward(input_ids_rmpad):
    input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1)  # (1, total_nnz)
"""


def _release(root: Path, functional: str, name: str = "verl") -> Path:
    files = {f"{name}/__init__.py": "import ray\n", f"{name}/utils/__init__.py": "import omegaconf\n",
             f"{name}/utils/attention_utils.py": ATTENTION_UTILS, f"{name}/utils/torch_functional.py": functional,
             f"{name}/workers/__init__.py": "", f"{name}/workers/actor/__init__.py": "",
             f"{name}/workers/actor/dp_actor.py": DP_ACTOR}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_a_release_is_measured_with_its_own_functions_and_a_shifted_gather_fails(tmp_path):
    right = _release(tmp_path / "right", TORCH_FUNCTIONAL)
    spec = {"dist": "verl", "families": ["llama"], "backends": ["sdpa"]}
    cells = R._child({**spec, "folders": [str(right)]})
    assert [c["status"] for c in cells] == ["pass"], cells
    assert cells[0]["metrics"]["max_abs_logprob_diff"] < 1e-5 and "remove-padding path" in cells[0]["message"]
    wrong = _release(tmp_path / "wrong", TORCH_FUNCTIONAL_SHIFTED)
    cells = R._child({**spec, "folders": [str(wrong)]})
    assert cells[0]["status"] == "fail" and cells[0]["metrics"]["max_abs_logprob_diff"] > 1e-1, cells
    # the anchor is read from the files, with its line
    assert R.read_path("verl", right)["anchor"] == "verl/workers/actor/dp_actor.py:4"


def test_the_import_chain_to_ray_is_read_from_the_files_and_bare_packages_are_passed_by(tmp_path):
    root = tmp_path / "w"
    for rel, text in {"verl/__init__.py": "from .protocol import DataProto\n", "verl/protocol.py": "import os\nimport ray\n",
                      "verl/workers/__init__.py": "", "verl/workers/engine/__init__.py": "",
                      "verl/workers/engine/impl.py": "import torch\nfrom verl.utils.balance import x\n",
                      "verl/utils/__init__.py": "", "verl/utils/balance.py": "\n\nfrom ..protocol import DataProto\n",
                      "verl/workers/engine/free.py": "import torch\ntry:\n    import ray\nexcept ImportError:\n    pass\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    bare = ("verl", "verl.utils", "verl.workers", "verl.workers.engine")
    assert R.import_chain(root, "verl.workers.engine.impl", "ray", bare=bare) == [
        "verl/workers/engine/impl.py:2", "verl/utils/balance.py:3", "verl/protocol.py:2 import ray"]
    # without the bare packages the package __init__ is the shorter way
    assert R.import_chain(root, "verl.workers.engine.impl", "ray") == ["verl/__init__.py:1", "verl/protocol.py:2 import ray"]
    assert R.import_chain(root, "verl.workers.engine.free", "ray", bare=bare) == []  # a guarded import is no chain
    assert R.import_chain(root, "verl.workers.engine.absent", "ray") is None


def _record(version: str, anchor: str | None, statuses: list[str], number: float = 3e-7) -> dict:
    cells = [{"model": "llama", "backend": "sdpa", "status": s, "message": f"{s} msg", "cause": None,
              "metrics": {"max_abs_logprob_diff": number}} for s in statuses]
    return {"version": version, "path": {"anchor": anchor, "code": "x"}, "cells": cells}


def test_transitions_name_a_moved_path_and_a_changed_verdict_and_render_them():
    records = [_record("0.1", None, []), _record("0.2", "verl/workers/actor/dp_actor.py:81", ["pass"]),
               _record("0.3", "verl/workers/actor/dp_actor.py:97", ["pass"]),
               _record("0.8", "verl/workers/engine/fsdp/transformer_impl.py:965", ["pass", "fail"], 2e-1)]
    records[0]["skip"] = "verl 0.1 has no such path"
    moves = R.transitions(records)
    assert [(t["from"], t["to"]) for t in moves] == [("0.1", "0.2"), ("0.3", "0.8")]
    assert "path moved: none -> verl/workers/actor/dp_actor.py:81" in moves[0]["what"]
    assert "verdict skipped -> pass" in moves[0]["what"] and "verdict pass -> fail" in moves[1]["what"]
    block = {"families": ["llama"], "backends": ["sdpa"], "stack": "torch 2.13.0+cpu", "measured": "2026-12-06",
             "trainers": {"verl": records}}
    text = R.render(block)
    assert "| 0.8 | fail | 2.0e-01 | `verl/workers/engine/fsdp/transformer_impl.py:965` | llama/sdpa: fail msg |" in text
    assert "| 0.1 | skipped |  | none | verl 0.1 has no such path |" in text
    assert "0.3 -> 0.8: path moved" in text


def test_the_committed_block_renders_to_the_committed_page():
    """reports/atlas/rl-peers.md is the render of rl_peers.json by the current code (python -m
    pytest_packcheck.atlas.rl_peers --render-only writes it)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / R.BLOCK_FILE).read_text()
    assert "/.cache/" not in text.replace("~/.cache/", "")  # home written ~ (R.home_as_tilde)
    block = json.loads(text)
    assert (root / R.RENDER_FILE).read_text() == R.render(block)
    assert set(block["trainers"]) == set(R.RELEASES)
    for dist, records in block["trainers"].items():
        assert [r["version"] for r in records] == list(R.RELEASES[dist])
        for r in records:  # every release is measured or a named skip, never silent
            assert r.get("cells") or r.get("skip"), (dist, r["version"])


# OpenRLHF 0.6.4's Actor.forward for packed samples, reduced to the packed branch (models/actor.py:197-265)
OPENRLHF_PACKED_SEQ_LENS = '''
import torch
def reset_position_ids(attention_mask):
    position_ids = torch.zeros_like(attention_mask, dtype=torch.long)
    for i in range(attention_mask.size(0)):
        mask = attention_mask[i]
        for index in range(1, mask.max().item() + 1):
            sample_mask = mask == index
            position_ids[i, sample_mask] = torch.arange(int(sample_mask.sum()), device=mask.device)
    return position_ids
def log_probs_from_logits(logits, labels, temperature=1.0):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
class Actor:
    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False, ring_attn_group=None,
                logps_allgather=False, packed_seq_lens=None):
        position_ids = reset_position_ids(attention_mask)
        attention_mask = None
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        output["logits"] = output["logits"].to(torch.float32)
        log_probs = log_probs_from_logits(output["logits"][:, :-1, :], sequences[:, 1:], temperature=self.temperature)
        action_log_probs, offset = [], 0
        for num_action, seq_len in zip(num_actions, packed_seq_lens):
            start, end = max(0, offset + seq_len - num_action - 1), offset + seq_len - 1
            action_log_probs.append(log_probs[:, start:end])
            offset += seq_len
        return torch.cat(action_log_probs, dim=1)
'''


def _module(tmp_path: Path, name: str, source: str):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_openrlhf_packed_seq_lens_releases_run_their_own_forward_and_a_mask_handed_to_the_model_leaks(tmp_path, monkeypatch,
                                                                                                   tolerances):
    """OpenRLHF 0.4-0.6's layout (the experience maker packs; forward slices each sample's actions): right as 0.5 /
    0.6 have it (attention_mask dropped after reset_position_ids); planted as 0.4.6 has it (the segment-id mask handed
    to the model, which reads it as all ones: one causal sequence over the row)."""
    from conftest import make_bench

    from pytest_packcheck.checks import rl_trainers as T

    wb = make_bench("llama", "sdpa", tolerances)
    right = _module(tmp_path, "actor_right", OPENRLHF_PACKED_SEQ_LENS)
    monkeypatch.setattr(T, "import_openrlhf_actor", lambda: (right, []))
    monkeypatch.setattr(T, "_dist_version", lambda name: "0.6.4")
    result = T.check_rl_openrlhf_packed(wb)
    assert result.status == "pass" and not result.metrics["entropy_compared"], result.message
    assert result.metrics["logprob_temperature"] != 1.0 and "computes no entropy" in result.message
    leaky = _module(tmp_path, "actor_leaky", OPENRLHF_PACKED_SEQ_LENS.replace("        attention_mask = None\n", ""))
    monkeypatch.setattr(T, "import_openrlhf_actor", lambda: (leaky, []))
    result = T.check_rl_openrlhf_packed(wb)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def _unsloth_release(root: Path, source: str, zoo_min: str = "2026.10.9") -> Path:
    """A planted unsloth release: its ``unsloth/models/rl_replacements.py`` (``source``) and a METADATA declaring
    ``unsloth_zoo>=zoo_min``, nothing else (the check reads the block from the file; unsloth is never imported)."""
    (root / "unsloth" / "models").mkdir(parents=True)
    (root / "unsloth" / "models" / "rl_replacements.py").write_text(source)
    (root / "unsloth-2026.10.9.dist-info").mkdir()
    (root / "unsloth-2026.10.9.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: unsloth\nVersion: 2026.10.9\nRequires-Dist: unsloth_zoo>={zoo_min}\n"
        f"Requires-Dist: unsloth_zoo>={zoo_min}; extra == \"huggingface\"\n")
    return root


def test_an_unsloth_release_is_measured_with_its_own_block_and_a_packed_position_run_fails(tmp_path):
    """unsloth per release (rl_peers' unsloth axis): the release's block read from its file and run in the child
    with the zoo beside it. The real 2026.10.9 file passes; planted in a copy: the block numbers position_ids over
    the whole packed row instead of per row (the samples attend each other), and it fails with its number. The path
    record reads the block's line, the verifier's thresholds with their lines, and the zoo the release declares."""
    from tests.test_rl_trainers import released_folders

    real, zoo = released_folders("unsloth")
    source = (real / "unsloth" / "models" / "rl_replacements.py").read_text()
    per_row = "_pk_pos = (_pk_keep.cumsum(dim = 1) - 1)[_pk_keep].unsqueeze(0)"
    assert source.count(per_row) == 1
    right = _unsloth_release(tmp_path / "right", source, zoo_min="2026.10.7")
    path = R.read_path("unsloth", right)
    anchor_line = next(i for i, x in enumerate(source.splitlines(), 1) if "_pk_pad = self.processing_class.pad_token_id" in x)
    assert path["anchor"] == f"unsloth/models/rl_replacements.py:{anchor_line}" and path["zoo"] == "2026.10.7"
    assert re.fullmatch(r"unsloth/models/rl_replacements\.py:\d+ accepts below 0\.7; :\d+ disables packing at 1\.5 \(nats\)",
                        path["verifier"]), path["verifier"]
    spec = {"dist": "unsloth", "families": ["llama"], "backends": ["sdpa"]}
    cells = R._child({**spec, "folders": [str(right), str(zoo)]})
    assert [c["status"] for c in cells] == ["pass"] and cells[0]["metrics"]["unsloth_verifier_diff"] < 1e-5, cells
    wrong = _unsloth_release(tmp_path / "wrong", source.replace(
        per_row, "_pk_pos = torch.arange(int(_pk_keep.sum()), device = input_ids.device).unsqueeze(0)"))
    cells = R._child({**spec, "folders": [str(wrong), str(zoo)]})
    assert cells[0]["status"] == "fail" and cells[0]["metrics"]["max_abs_logprob_diff"] > 1e-2, cells
    # unsloth's own verifier sees the same leak (its number is beside packcheck's in the cell)
    assert cells[0]["metrics"]["unsloth_verifier_diff"] > 1e-2


def test_a_release_without_the_block_is_a_named_skip_never_run(tmp_path):
    """A release whose rl_replacements.py has no sequence-packing block (2026.6.9's case) is a record that says so,
    with no cells and no child started."""
    folder = _unsloth_release(tmp_path / "old", "def _get_per_token_logps_and_entropies(self):\n    pass\n")
    path = R.read_path("unsloth", folder)
    assert path["anchor"] is None and "verifier" not in path and path["zoo"] == "2026.10.9"
    record = {"version": "2026.6.9", "path": path, "cells": [], "skip": "unsloth 2026.6.9 has no GRPO sequence-packing block"}
    assert R.verdict(record) == "skipped"
    text = R.render({"families": ["llama"], "backends": ["sdpa"], "stack": "torch", "measured": "x",
                     "trainers": {"unsloth": [record]}})
    assert "| 2026.6.9 | skipped |  | none | unsloth 2026.6.9 has no GRPO sequence-packing block |" in text


def test_lean_records_keep_what_render_and_the_axes_read():
    """:func:`R.lean` (unsloth's records) drops a passing cell's message and rounds its numbers to 3 digits, keeps a
    failing cell's message (through message_from), and the render is the same before and after."""
    cells = [{"model": "llama", "backend": "sdpa", "status": "pass", "message": "first msg", "cause": None,
              "metrics": {"max_abs_logprob_diff": 3.6418029836227106e-07, "max_abs_entropy_diff": None,
                          "non_finite_logprobs": 0, "unsloth_verifier_diff": 4.76837158203125e-07, "stand_ins": "x"}},
             {"model": "qwen2", "backend": "sdpa", "status": "fail", "message_from": 0, "cause": "leak",
              "metrics": {"max_abs_logprob_diff": 0.3123456}}]
    record = {"version": "2026.7.1", "path": {"anchor": "a:1", "verifier": "v", "zoo": "z"}, "cells": cells}
    block = {"families": ["llama", "qwen2"], "backends": ["sdpa"], "stack": "t", "measured": "x", "trainers": {"unsloth": [record]}}
    before = R.render(json.loads(json.dumps(block)))
    lean = R.lean(record)
    assert "message" not in lean["cells"][0] and "cause" not in lean["cells"][0]
    assert lean["cells"][0]["metrics"] == {"max_abs_logprob_diff": 3.64e-07, "unsloth_verifier_diff": 4.77e-07}
    assert lean["cells"][1]["message"] == "first msg" and lean["cells"][1]["cause"] == "leak"
    assert R.render(block) == before  # the same page
    assert R.lean(json.loads(json.dumps(lean))) == lean  # idempotent
