"""RL log-prob checks (issue 44): each passes on the correct stack and catches its planted fault, and the faults the
current releases really have are named (transformers 5.25.0 / trl 1.16.0, the pinned stack: constraints/test.txt)."""

from __future__ import annotations

import pytest
from conftest import make_bench
from faults import collator_no_reset

from pytest_packcheck.checks import rl
from pytest_packcheck.results.schema import read_results

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def llama(tolerances):
    return make_bench("llama", "sdpa", tolerances)


def test_samples_are_prompt_and_completion_with_a_grpo_group():
    samples = rl.rl_samples([[1, 2, 3, 4, 5, 6], [7, 8, 9], [10]])
    assert [s.prompt for s in samples] == [(1, 2, 3), (1, 2, 3), (7,)]
    assert samples[0].completion == (4, 5, 6) and samples[1].completion == (6, 5, 4) and samples[1].group == samples[0].group
    assert all(s.completion for s in samples)  # the one-token example has no completion: left out


def test_completion_logprobs_shift_labels_within_the_sample_and_apply_the_temperature():
    import torch

    logits = torch.randn(5, 11)
    tokens = [3, 1, 4, 1, 5]
    logp, entropy = rl.completion_logprobs(logits, tokens, 2, 0.5)
    want = torch.log_softmax(logits.double() / 0.5, -1)
    assert torch.allclose(logp, torch.stack([want[1, 4], want[2, 1], want[3, 5]]))
    assert entropy.shape == (3,) and bool((entropy > 0).all())


def test_rl_logprobs_passes_on_the_packed_row_and_catches_a_leak(llama, tolerances):
    result = rl.check_rl_logprobs(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["samples"] == 4
    leaky = make_bench("llama", "sdpa", tolerances, collator_factory=collator_no_reset)  # positions never restart
    result = rl.check_rl_logprobs(leaky)
    assert result.status == "fail" and result.cause == "leak" and result.metrics["max_abs_logprob_diff"] > 1e-2


def test_rl_padded_names_grpos_missing_position_ids_on_learned_positions(llama, tolerances):
    """GRPOTrainer calls the model with input_ids and attention_mask only: rotary llama is right (relative positions),
    gpt2's learned absolute positions are off by the padding count (transformers 5.25.0: no position_ids from the
    mask in a training forward), and position_ids from the mask fix it."""
    assert rl.check_rl_padded(llama).status == "pass"
    gpt2 = make_bench("gpt2", "sdpa", tolerances)
    result = rl.check_rl_padded(gpt2)
    assert result.status == "fail" and result.cause == "padded_positions", result.message
    assert result.metrics["max_abs_logprob_diff"] > 1e-2 and result.metrics["max_abs_logprob_diff_position_ids"] < 1e-5


def test_trl_grpo_logprob_path_passes_and_catches_a_temperature_on_one_path(llama, monkeypatch):
    from trl.trainer import utils

    result = rl.check_rl_trl_grpo(llama)
    assert result.status == "pass", result.message
    assert result.metrics["logits_to_keep"] == max(len(s.completion) for s in rl.rl_samples(llama.examples))
    original = utils.add_fused_lm_head

    def one_path(model, temperature=1.0, **kw):  # planted: the training path forgets the sampling temperature
        return original(model, temperature=1.0, **kw)

    monkeypatch.setattr(utils, "add_fused_lm_head", one_path)
    result = rl.check_rl_trl_grpo(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_trl_grpo_logits_to_keep_off_by_one_is_caught(llama, monkeypatch):
    from trl.trainer.grpo_trainer import GRPOTrainer

    original = GRPOTrainer._get_per_token_logps_and_entropies

    def off_by_one(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        logps, entropies, aux = original(self, model, input_ids, attention_mask, logits_to_keep + 1, **kw)
        return logps[:, :-1], entropies[:, :-1], aux  # planted: one prompt position too many, the last target dropped

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", off_by_one)
    result = rl.check_rl_trl_grpo(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_trl_rloo_runs_its_own_logprob_method_and_catches_a_fault_planted_there(llama, monkeypatch):
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer

    result = rl.check_rl_trl_rloo(llama)
    assert result.status == "pass" and "RLOO log-prob path" in result.message, result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["max_abs_entropy_diff"] < 1e-5
    original = RLOOTrainer._get_per_token_logps_and_entropies

    def off_by_one(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        logps, entropies, aux = original(self, model, input_ids, attention_mask, logits_to_keep + 1, **kw)
        return logps[:, :-1], entropies[:, :-1], aux  # planted in RLOO's copy only: logits_to_keep off by one

    monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", off_by_one)
    result = rl.check_rl_trl_rloo(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message
    assert rl.check_rl_trl_grpo(llama).status == "pass"  # GRPO's own method is another function: untouched
    assert RLOOTrainer._get_per_token_logps_and_entropies is not GRPOTrainer._get_per_token_logps_and_entropies


def test_trl_grpo_on_gpt2_is_off_by_its_left_padding(tolerances):
    result = rl.check_rl_trl_grpo(make_bench("gpt2", "sdpa", tolerances))
    assert result.status == "fail" and result.cause == "padded_positions", result.message
    assert result.metrics["max_abs_logprob_diff_position_ids"] < 1e-5


def test_trl_tree_packing_passes_and_catches_a_sibling_kv_gather(llama, monkeypatch):
    """AsyncGRPO's tree row, TRL's own code on the exact CPU kernel: right on llama; planted, the second completion of
    the GRPO group reads its sibling's K/V instead of its parent's (the shared prompt)."""
    import torch

    result = rl.check_rl_trl_tree(llama)
    assert result.status == "pass", result.message
    assert result.metrics["tree_tokens"] < result.metrics["raw_tokens"]  # the group's prompt is forwarded once
    original = rl.tree_row

    def sibling(samples):
        row = original(samples)
        kv, cu = row["tree_kv_index"].clone(), row["tree_cu_seqlens_k"]
        # the third segment is the second completion: its path is [prompt..., own]; point its prompt at segment 2
        start, first_own = int(cu[2]), int(row["tree_cu_seqlens_q"][2])
        sib = int(row["tree_cu_seqlens_q"][1])
        for i in range(start, start + (first_own - sib)):
            kv[i] = torch.tensor(sib + (i - start))
        row["tree_kv_index"] = kv
        return row

    monkeypatch.setattr(rl, "tree_row", sibling)
    result = rl.check_rl_trl_tree(llama)
    assert result.status == "fail" and result.cause == "tree_packing", result.message


def test_trl_tree_attention_drops_gpt_oss_sinks_and_crashes_on_gpt2(tolerances):
    """What trl 1.16.0's tree_attention does today: GPT-OSS's attention sinks never reach the kernel (right again with
    them passed as s_aux), and GPT-2 (Conv1D, no nn.Linear in its attention module) crashes in get_target_dtype."""
    result = rl.check_rl_trl_tree(make_bench("gpt_oss", "eager", tolerances))
    assert result.status == "fail" and result.evidence.get("attention_sinks_dropped") is True, result.message
    assert result.metrics["max_abs_logprob_diff_with_sinks"] < 1e-5 and result.metrics["max_abs_logprob_diff"] > 1e-2
    result = rl.check_rl_trl_tree(make_bench("gpt2", "eager", tolerances))
    assert result.status == "error" and result.cause == "crash" and "StopIteration" in result.message


def test_the_rl_remedies_fit_their_evidence():
    from pytest_packcheck.checks.causes import CAUSE_RECORDS

    cell = {"check": "rl_trl_tree", "backend": None, "status": "fail", "metrics": {}}
    assert "s_aux" in CAUSE_RECORDS["tree_packing"].remedy_for(cell, {"attention_sinks_dropped": True})
    assert "s_aux" not in CAUSE_RECORDS["tree_packing"].remedy_for(cell, {})
    assert "position_ids" in CAUSE_RECORDS["padded_positions"].remedy


def test_the_committed_rl_matrix_holds_the_findings_the_docs_quote():
    """docs/rl.md embeds reports/rl/packcheck-matrix.md: made on the pinned stack, with the findings this suite
    measures above (gpt2's padded path, GPT-OSS's dropped sinks, the gpt2 tree crash) and every other model within
    its tolerance."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    doc = read_results(repo / "reports" / "rl" / "packcheck-matrix.json")
    pins = dict(line.split("==", 1) for line in (repo / "constraints" / "test.txt").read_text().splitlines() if "==" in line)
    assert doc["environment"]["transformers"] == pins["transformers"] and doc["environment"]["trl"] == pins["trl"]
    cells = {(c["model"]["model_type"], c["backend"], c["check"]): c for c in doc["cells"]}
    assert cells[("gpt2", "sdpa", "rl_trl_grpo")]["cause"] == cells[("gpt2", "sdpa", "rl_trl_rloo")]["cause"] == "padded_positions"
    assert cells[("gpt_oss", None, "rl_trl_tree")]["evidence"].get("attention_sinks_dropped") is True
    assert cells[("gpt2", None, "rl_trl_tree")]["status"] == "error"
    for model in ("llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"):
        for check in ("rl_logprobs", "rl_trl_grpo", "rl_trl_rloo", "rl_trl_dpo", "rl_trl_kto", "rl_preference_packed",
                      "rl_verl_rmpad"):
            assert cells[(model, "sdpa", check)]["status"] == "pass", (model, check)
    # docs/rl.md's "measured" column quotes llama / sdpa's cells: each per-token number is in its cell's message
    import re

    rows = (repo / "docs" / "rl.md").read_text()
    quoted = re.findall(r"^\| [^|]+ \| `(rl_\w+)` \| [^|]*?([0-9.]+e-\d+) nats per token", rows, re.MULTILINE)
    assert {"rl_trl_grpo", "rl_trl_rloo", "rl_verl_rmpad"} <= {check for check, _ in quoted}
    for check, number in quoted:
        cell = cells.get(("llama", "sdpa", check)) or cells[("llama", None, check)]  # rl_trl_tree: model level
        assert f"{number} nats per token" in cell["message"], (check, number, cell["message"])
    # the trainers' own code (docs/rl.md's second table): TRL's DPO / KTO on every model's packed-capable backends,
    # GPT-OSS's eager path leaking into the padding-free preference row and verl's remove-padding row, verl measured
    # from its wheel, OpenRLHF's packed samples run with the stand-ins named, ms-swift on trl 1.x named with the module
    # it lacks and its declared trl<1.0, AsyncGRPO's padding-free row skipped on trl 1.16 (its rows are trees)
    dpo = cells[("llama", "sdpa", "rl_trl_dpo")]
    assert dpo["metrics"]["trl"] == pins["trl"] and dpo["metrics"]["max_abs_margin_diff"] <= dpo["tolerances"]["logits_atol"]
    for check in ("rl_preference_packed", "rl_verl_rmpad"):
        assert cells[("gpt_oss", "eager", check)]["cause"] == "leak", check
        assert cells[("gpt_oss", "packcheck_flash_ref", check)]["status"] == "pass", check
    assert cells[("llama", "sdpa", "rl_verl_rmpad")]["metrics"]["verl"] == "0.9.1"
    openrlhf, swift = cells[("llama", "sdpa", "rl_openrlhf_packed")], cells[("llama", "sdpa", "rl_swift_padding_free")]
    assert openrlhf["status"] == "pass" and openrlhf["metrics"]["openrlhf"] == "0.11.2", openrlhf["message"]
    assert "from flash_attn 2.8.3's source" in openrlhf["message"] and "deepspeed stubbed" in openrlhf["message"]
    assert cells[("gpt_oss", "eager", "rl_openrlhf_packed")]["cause"] == "leak"
    assert swift["status"] == "skipped" and "trl.experimental.bco" in swift["message"] and "trl<1.0" in swift["message"]
    assert "packs trees" in cells[("llama", "sdpa", "rl_trl_async")]["message"]


def test_dpo_asked_to_pack_runs_padded_on_trl_1_16_and_the_finding_names_the_line(llama, monkeypatch):
    """trl 1.16.0's DPOTrainer turns padding_free=True off ("temporarily unavailable after a refactor"); the finding
    names the file and line. Planted: a DPOTrainer that keeps the flag is a pass."""
    import trl

    result = rl.check_rl_trainer_config(llama)
    if rl._trl_version() == "1.16.0":
        assert result.status == "fail" and result.cause == "config_dropped", result.message
        assert "trl/trainer/dpo_trainer.py:" in result.metrics["items"]["dpo_padding_free"]["evidence"]

    class Keeps(trl.DPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.padding_free = True

    monkeypatch.setattr(trl, "DPOTrainer", Keeps)
    assert rl.check_rl_trainer_config(llama).status == "pass"


class _ChainCollator:
    """trl 1.7.1's ``DataCollatorForRollout`` (async_grpo_trainer.py:184-264), the fields the forward reads: every
    sample of the micro-batch concatenated into one row, ``position_ids`` restarting per sample. ``reset=False``
    plants the fault: positions run on across samples (one long sequence, the samples see each other)."""

    reset = True

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        import torch

        ids = [t for e in examples for t in e["input_ids"]]
        pos = (torch.cat([torch.arange(len(e["input_ids"])) for e in examples]) if self.reset
               else torch.arange(len(ids)))
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "completion_mask": torch.tensor([[m for e in examples for m in e["completion_mask"]]]),
                "position_ids": pos[None]}

    torch_call = __call__


def test_trl_async_padding_free_row_passes_and_catches_positions_that_do_not_restart(llama, monkeypatch):
    """AsyncGRPO 1.7 to 1.15 packs the samples into one row; on trl 1.16 (installed) the collator packs trees and the
    check skips naming the release. The 1.7-style chain collator stands in for 1.16's tree collator here (the real
    1.7.1 .. 1.15.0 collators are measured on the atlas's TRL axis); the LM head is 1.16's fused head, TRL's code."""
    from trl.experimental.async_grpo import async_grpo_trainer as ag

    result = rl.check_rl_trl_async(llama)
    assert result.status == "skipped" and "packs trees (TreeRow)" in result.message and "trl 1.16.0" in result.message
    monkeypatch.delattr(ag, "TreeRow")
    monkeypatch.setattr(ag, "DataCollatorForRollout", _ChainCollator)
    result = rl.check_rl_trl_async(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["lm_head"] == "add_fused_lm_head"
    monkeypatch.setattr(_ChainCollator, "reset", False)
    result = rl.check_rl_trl_async(llama)
    # one long sequence: the samples see each other and count positions on (packcheck's probes name the positions)
    assert result.status == "fail" and result.cause in ("leak", "wrong_positions"), result.message
    assert result.metrics["max_abs_logprob_diff"] > 1e-2


def test_trl_async_catches_a_temperature_on_one_path(llama, monkeypatch):
    from trl.experimental.async_grpo import async_grpo_trainer as ag
    from trl.trainer import utils

    monkeypatch.delattr(ag, "TreeRow")
    monkeypatch.setattr(ag, "DataCollatorForRollout", _ChainCollator)
    original = utils.add_fused_lm_head
    monkeypatch.setattr(utils, "add_fused_lm_head", lambda model, temperature=1.0, **kw: original(model, temperature=1.0, **kw))
    result = rl.check_rl_trl_async(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_a_padded_async_collator_is_a_skip_naming_the_release(llama, monkeypatch):
    """trl 1.0 .. 1.6's AsyncGRPO collator pads one row per sample (no position_ids): not padding-free, said so."""
    from trl.experimental.async_grpo import async_grpo_trainer as ag

    class Padded(_ChainCollator):
        def __call__(self, examples):
            out = super().__call__(examples)
            del out["position_ids"]
            return out

    monkeypatch.delattr(ag, "TreeRow")
    monkeypatch.setattr(ag, "DataCollatorForRollout", Padded)
    result = rl.check_rl_trl_async(llama)
    assert result.status == "skipped" and "not padding-free" in result.message and "trl 1.16.0" in result.message


def test_aiohttp_is_stubbed_for_the_async_import_only(monkeypatch):
    """trl 1.7 .. 1.15 import aiohttp at async_rollout_worker's top (trl's vllm extra): the stub stands in for that
    import only, is named, and is gone from sys.modules afterwards."""
    import importlib
    import sys

    real = importlib.import_module
    real("trl.experimental.async_grpo.async_grpo_trainer")  # imported for real first: the planted failure only names it
    calls = []

    def import_module(name, *a):
        calls.append(name)
        if len(calls) == 1:  # planted: the first import fails as trl 1.7.1's does without aiohttp
            raise ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")
        assert isinstance(sys.modules.get("aiohttp"), type(sys)) and sys.modules["aiohttp"].ClientError
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", import_module)
    had = "aiohttp" in sys.modules
    module, stand_in = rl.import_async_grpo()
    assert stand_in == rl.AIOHTTP_STAND_IN and "aiohttp stubbed" in stand_in and module.__name__.endswith("async_grpo_trainer")
    assert ("aiohttp" in sys.modules) == had


def test_a_fused_head_without_its_kernel_is_a_skip_naming_triton(llama, monkeypatch):
    """trl 1.15.0's fused LM head needs trl/kernels, which imports triton (absent from a CPU torch): GRPO, DPO, KTO and
    AsyncGRPO skip naming the package and the import, never crash and never pass."""
    import sys

    from trl.trainer import utils

    from pytest_packcheck.checks import rl_trainers

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", None)
    monkeypatch.setitem(sys.modules, "trl.kernels", None)  # planted: `import trl.kernels` raises ImportError
    for check in (rl.check_rl_trl_grpo, rl_trainers.check_rl_trl_dpo, rl_trainers.check_rl_trl_kto):
        result = check(llama)
        assert result.status == "skipped" and "fused LM head" in result.message, (check.__name__, result.message)
        assert "from ..kernels import ChunkedLogProbFunction" in result.message and "trl 1.16.0" in result.message


def test_a_dpo_trainer_without_compute_loss_is_a_skip_naming_the_release(llama, monkeypatch):
    """trl 0.19 .. 0.28's DPOTrainer reduces in concatenated_forward on another collator: skipped, named."""
    from trl import DPOTrainer

    from pytest_packcheck.checks import rl_trainers

    monkeypatch.delattr(DPOTrainer, "_compute_loss")
    result = rl_trainers.check_rl_trl_dpo(llama)
    assert result.status == "skipped" and "trl 1.16.0's DPOTrainer has no _compute_loss" in result.message


def test_grpo_reads_the_releases_log_prob_path(llama, monkeypatch):
    """The path per release: 1.16's fused head; a release without add_fused_lm_head runs
    _get_per_token_logps_and_entropies on the logits (trl 1.0 .. 1.7), trl 0.19 _get_per_token_logps."""
    from trl.trainer import utils
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert rl.grpo_logprob_path(GRPOTrainer) == "fused_lm_head"
    monkeypatch.delattr(utils, "add_fused_lm_head")
    assert rl.grpo_logprob_path(GRPOTrainer) == "logits"
    assert rl.grpo_logprob_path(type("Old", (), {"_get_per_token_logps": None})) == "logps_only"
    assert rl.grpo_logprob_path(type("None_", (), {})) is None


def test_trls_undeclared_vllm_client_imports_are_stubbed_for_the_import_only(monkeypatch):
    """trl 0.29 .. 1.13's GRPOTrainer imports requests and urllib3 at trl/generation/vllm_client.py's top (unguarded,
    undeclared): in a clean trl==X environment the import fails; each is stubbed for the import alone, named, and gone
    from sys.modules afterwards; a package that is not one of them is raised, never stubbed."""
    import importlib
    import sys

    real = importlib.import_module
    fails = ["requests", "urllib3"]

    def import_module(name, *a):
        if fails:  # planted: the import fails as trl 1.7.1's does without requests, then without urllib3
            missing = fails.pop(0)
            raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)
        assert sys.modules["requests.adapters"].HTTPAdapter and sys.modules["urllib3.util.retry"].Retry
        return real(name, *a)

    importlib.import_module("trl.trainer.grpo_trainer")  # imported for real first: the planted failures only name it
    had = {n: n in sys.modules for n in ("requests", "urllib3")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("requests", "urllib3") else real_spec(n, *a))
    real_spec = importlib.machinery.PathFinder.find_spec
    monkeypatch.setattr(importlib, "import_module", import_module)
    module, used = rl.import_trl_module("trl.trainer.grpo_trainer")
    assert module.__name__ == "trl.trainer.grpo_trainer"
    assert [u.split(" ")[0] for u in used] == ["requests", "urllib3"] and all("stubbed" in u for u in used)
    assert {n: n in sys.modules for n in had} == had
    fails[:] = ["mergekit"]
    with pytest.raises(ModuleNotFoundError, match="mergekit"):
        rl.import_trl_module("trl.trainer.grpo_trainer")
