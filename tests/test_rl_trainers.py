"""The preference trainers' and RL trainers' own code (issue 44, part 2): each check passes on the correct stack and
catches its planted fault; a trainer whose code does not import is a skip naming the package, never a pass."""

from __future__ import annotations

import contextlib
import math
import zipfile
from pathlib import Path

import pytest
from conftest import make_bench
from faults import collator_no_reset

from pytest_packcheck.checks import rl_trainers as T
from pytest_packcheck.checks import rl_wheels as W

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]


def released_folders(trainer: str) -> list[Path]:
    """The unpacked wheels ``trainer``'s measured modules need (:data:`rl_wheels.NEEDS`), at the versions
    constraints/rl-peers.txt pins, from $RL_PEER_WHEELS or build/rl-peers; a skip naming each missing wheel."""
    pinned = W.pins((ROOT / W.RL_PEERS_FILE).read_text())
    wanted = {d: pinned[d] for d in W.NEEDS[trainer]}
    found, missing = W.find_wheels(W.wheel_folder(ROOT), wanted)
    if missing:
        pytest.skip(f"no {', '.join(missing)} wheel in $RL_PEER_WHEELS or build/rl-peers (.ci/run downloads them: "
                    "pip download --no-deps -r constraints/rl-peers.txt -d build/rl-peers)")
    return [W.unpack_wheel(found[d]) for d in wanted]


@pytest.fixture
def released():
    """``released(trainer)``: the trainer's released wheels on sys.path for the rest of the test (imported from the
    files, never installed; an installed copy is set aside), and out of sys.modules after it."""
    with contextlib.ExitStack() as stack:
        def use(trainer: str) -> list[Path]:
            folders = released_folders(trainer)
            stack.enter_context(W.wheels_on_path(folders))
            return folders

        yield use


def _planted_wheel(folder: Path, dist: str, version: str, files: dict[str, str], tag: str = "py3-none-any") -> Path:
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n")
    return path


def test_a_wheel_is_imported_from_its_files_and_its_top_level_tests_never_shadow_ours(tmp_path):
    """As OpenRLHF 0.11.2's wheel is laid out: the package under <name>.data/purelib and a top-level tests package.
    Unpacked, the package is at the top and tests is left out; on sys.path only inside the block; an installed copy
    set aside comes back. Planted: a folder unpacked by hand that keeps tests/ is refused."""
    import sys

    import tests as ours

    wheel = _planted_wheel(tmp_path, "rlpeer_probe", "0.1.0", {
        "rlpeer_probe-0.1.0.data/purelib/rlpeer_probe/__init__.py": "VALUE = 7\n",
        "rlpeer_probe-0.1.0.data/purelib/tests/__init__.py": "SHADOW = True\n",
        "rlpeer_probe-0.1.0.data/scripts/run.sh": "#!/bin/sh\n"}, tag="cp311-cp311-manylinux1_x86_64")
    folder = W.unpack_wheel(wheel)
    assert folder == tmp_path / "unpacked" / wheel.name[:-4] and W.top_names(folder) == {"rlpeer_probe"}
    assert W.unpack_wheel(wheel) == folder  # reused: its marker holds the wheel's sha256
    installed = type(sys)("rlpeer_probe")
    sys.modules["rlpeer_probe"] = installed
    try:
        with W.wheels_on_path([folder]) as tops:
            import rlpeer_probe

            import tests

            assert tops == {"rlpeer_probe"} and rlpeer_probe.VALUE == 7 and tests is ours
        assert sys.modules["rlpeer_probe"] is installed and str(folder) not in sys.path
    finally:
        del sys.modules["rlpeer_probe"]
    (folder / "tests").mkdir()
    (folder / "tests" / "__init__.py").write_text("SHADOW = True\n")
    with pytest.raises(ValueError, match="shadow"), W.wheels_on_path([folder]):
        pass


def test_without_the_wheels_the_trainers_tests_skip_naming_each_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv(W.ENV_VAR, str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=r"no verl==0\.9\.1, tensordict==0\.10\.0, .*einops==0\.8\.2 wheel"):
        released_folders("verl")
    _planted_wheel(tmp_path, "openrlhf", "0.11.1", {"openrlhf/__init__.py": ""})  # another release: not the pinned one
    with pytest.raises(pytest.skip.Exception, match=r"no openrlhf==0\.11\.2, einops==0\.8\.2 wheel"):
        released_folders("openrlhf")
    with pytest.raises(ValueError, match="rl-peers.txt:2: 'verl>=0.9' is not name==version"):
        W.pins("# c\nverl>=0.9\n")


@pytest.fixture(scope="module")
def llama(tolerances):
    return make_bench("llama", "sdpa", tolerances)


def _roll_completion_mask(cls, monkeypatch):
    """Planted: the collator's completion_mask one position early (the last prompt token scored, the last completion
    token dropped), as a label shift across the prompt / completion boundary does."""
    import torch

    original = cls.torch_call

    def shifted(self, examples):
        out = original(self, examples)
        out["completion_mask"] = torch.roll(out["completion_mask"], -1, dims=1)
        return out

    monkeypatch.setattr(cls, "torch_call", shifted)


def test_pairs_share_a_prompt_and_differ():
    wb = type("Wb", (), {"examples": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], "config": type("C", (), {"vocab_size": 11})()})
    pairs = T.preference_pairs(wb())
    assert len(pairs) == 2 and all(c.prompt == r.prompt and c.completion != r.completion for c, r in pairs)
    assert pairs[1][1].completion == (10, 0)  # shifted by one mod the vocabulary


def test_trl_dpo_passes_and_catches_a_shifted_completion_mask(llama, monkeypatch):
    result = T.check_rl_trl_dpo(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - math.log(2)) < 1e-5 and result.metrics["max_abs_margin_diff"] < 1e-4
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    _roll_completion_mask(DataCollatorForPreference, monkeypatch)
    result = T.check_rl_trl_dpo(llama)
    assert result.status == "fail" and result.cause == "packed_mismatch", result.message
    assert result.metrics["max_abs_seq_logprob_diff"] > 1e-1


def test_trl_kto_passes_and_catches_a_shifted_completion_mask(llama, monkeypatch):
    result = T.check_rl_trl_kto(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - 0.5) < 1e-5
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    _roll_completion_mask(DataCollatorForUnpairedPreference, monkeypatch)
    result = T.check_rl_trl_kto(llama)
    assert result.status == "fail" and result.cause == "packed_mismatch", result.message


def test_packed_preference_row_passes_and_catches_a_spurious_padding_segment(llama, monkeypatch):
    """Planted: the collator pads the row's front and counts the padding as a segment of cu_seq_lens_q (the public DPO
    collator bug): every sequence is read off its neighbour's segment and the initial loss is far from ln 2."""
    import torch

    result = T.check_rl_preference_packed(llama)
    assert result.status == "pass", result.message
    original = T.preference_row

    def padded_segment(wb, pairs):
        row = original(wb, pairs)
        pad = 3
        row["input_ids"] = torch.cat([torch.full((1, pad), wb.pad_id), row["input_ids"]], dim=1)
        row["position_ids"] = torch.cat([torch.arange(pad)[None], row["position_ids"]], dim=1)
        row["labels"] = torch.cat([torch.full((1, pad), -100), row["labels"]], dim=1)
        cu = row["cu_seq_lens_q"]
        row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = torch.cat([cu[:1], cu + pad]).to(cu.dtype)
        return row

    monkeypatch.setattr(T, "preference_row", padded_segment)
    result = T.check_rl_preference_packed(llama)
    assert result.status == "fail" and result.cause == "collator_contract", result.message
    assert result.metrics["segments"] == result.metrics["expected_segments"] + 1
    assert result.metrics["max_abs_margin_diff"] > 1.0 and abs(result.metrics["initial_loss"] - math.log(2)) > 1e-2


def test_packed_preference_row_catches_row_wide_mean_normalisation(llama, monkeypatch):
    """Planted: the per-sequence mean divides by the row's completion tokens (packed) instead of each sequence's
    (per sample): the sums stay right, so only the length-normalised reductions (sigmoid_norm, IPO) are off."""
    original = T.reduce_packed

    def row_mean(logits, batch):
        sums, _ = original(logits, batch)
        cu = batch["cu_seq_lens_q"].tolist()
        total = sum(cu[i + 1] - cu[i] - p for i, p in enumerate(batch["prompt_lengths"]))
        return sums, [s / total for s in sums]

    monkeypatch.setattr(T, "reduce_packed", row_mean)
    result = T.check_rl_preference_packed(llama)
    assert result.status == "fail" and result.cause == "loss_normalisation", result.message
    assert result.metrics["max_abs_seq_logprob_diff"] < 1e-4 < result.metrics["max_abs_mean_logprob_diff"]


def test_packed_preference_row_catches_a_leak(tolerances):
    leaky = make_bench("llama", "sdpa", tolerances, collator_factory=collator_no_reset)
    result = T.check_rl_preference_packed(leaky)
    assert result.status == "fail" and result.cause == "leak", result.message


def test_verl_remove_padding_path_passes_and_catches_positions_over_the_row(llama, monkeypatch, released):
    """verl's own unpad / roll / gather / pad-back on its rollout batch, from its released wheel. Planted:
    position_ids counted on over the whole batch (never restarting per sample), so the unpadded row reads as one
    sequence and the samples attend to each other."""
    import sys

    folders = released("verl")
    result = T.check_rl_verl_rmpad(llama)
    assert result.status == "pass", result.message
    assert result.metrics["verl"] == "0.9.1" and result.metrics["max_abs_logprob_diff"] < 1e-5
    # imported from the unpacked wheel, its package __init__s (ray, omegaconf) never run
    assert sys.modules["verl.utils.torch_functional"].__file__.startswith(str(folders[0]))
    assert "ray" not in sys.modules and "omegaconf" not in sys.modules
    original = T.verl_batch

    def columns(samples, pad_id, device="cpu"):
        batch, width = original(samples, pad_id, device)
        mask = batch["attention_mask"]
        batch["position_ids"] = (mask.flatten().cumsum(0) - 1).clamp(min=0).view_as(mask)
        return batch, width

    monkeypatch.setattr(T, "verl_batch", columns)
    result = T.check_rl_verl_rmpad(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_a_trainer_that_does_not_import_is_a_skip_naming_the_package(llama, monkeypatch):
    """Never a silent pass: a missing module is named (the distribution or the module its path needs), and a module
    that imports but is not driven is still a skip."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    for package in ("swift", "openrlhf", "verl"):
        monkeypatch.delitem(sys.modules, package, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("swift", "openrlhf", "verl") else real(name, *a))
    for check, needs in ((T.check_rl_swift_padding_free, "'swift'"), (T.check_rl_openrlhf_packed, "'openrlhf'"),
                         (T.check_rl_verl_rmpad, "'verl'")):
        result = check(llama)
        assert result.status == "skipped" and needs in result.message, result.message


def _openrlhf(released):
    released("openrlhf")
    return T.import_openrlhf_actor()


def test_openrlhf_packed_samples_pass_with_named_stand_ins_and_catch_the_cache_left_on(llama, monkeypatch, released):
    """OpenRLHF's own Actor.forward(packing_samples=True) on its rollout layout: right with Actor.__init__'s
    use_cache=False; planted, the cache left on (a model handed to forward without Actor.__init__): transformers then
    does not read the packed row from position_ids and the samples attend each other."""
    _, stand_ins = _openrlhf(released)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["openrlhf"] == "0.11.2"
    if stand_ins:  # flash_attn not installed: the cell names what stood in for it
        assert "from flash_attn 2.8.3's source" in result.message and "deepspeed stubbed" in result.message
        assert result.metrics["stand_ins"] == stand_ins
    monkeypatch.setattr(T, "OPENRLHF_USE_CACHE", True)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_openrlhf_positions_counted_over_the_row_are_caught(llama, monkeypatch, released):
    """Planted in OpenRLHF's own unpad_and_slice_tensor: position_ids counted on over the packed row (not restarting
    per sample), so transformers sees one sequence."""
    import torch

    actor, _ = _openrlhf(released)
    original = actor.unpad_and_slice_tensor

    def over_the_row(sequences, attention_mask, group):
        seqs, _pos, rolled, pad, indices = original(sequences, attention_mask, group)
        return seqs, torch.arange(seqs.shape[1], device=seqs.device)[None], rolled, pad, indices

    monkeypatch.setattr(actor, "unpad_and_slice_tensor", over_the_row)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


def test_openrlhf_entropy_is_its_own_compute_entropy_and_a_temperature_on_one_path_is_caught(llama, monkeypatch, released):
    """OpenRLHF's compute_entropy (@torch.compile'd) runs eagerly with torch._dynamo disabled and is compared with each
    sample alone. Planted: the entropy computed on the logits before the temperature (OpenRLHF 0.11.2 divides once,
    before both; a release that scaled the log-probs only would read so)."""
    actor, _ = _openrlhf(released)
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "pass" and result.metrics["entropy_compared"], result.message
    assert 0 <= result.metrics["max_abs_entropy_diff"] < 1e-5
    from pytest_packcheck.checks.rl import RL_TEMPERATURE

    original = actor.compute_entropy

    monkeypatch.setattr(actor, "compute_entropy", lambda logits: original(logits * RL_TEMPERATURE))
    result = T.check_rl_openrlhf_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_entropy_diff"] > 1e-3, result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5  # the log-probs are untouched: only the entropy moves


def test_the_flash_attn_stand_in_is_flash_attns_own_source_and_leaves_nothing_behind(monkeypatch, released):
    import sys

    from pytest_packcheck.checks import stand_ins

    released("einops")
    if stand_ins.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed: nothing stands in")
    with stand_ins.flash_attn_stand_in() as named:
        from flash_attn.bert_padding import pad_input, unpad_input

        assert "flash_attn 2.8.3's source" in named and callable(pad_input) and callable(unpad_input)
    assert "flash_attn" not in sys.modules and "flash_attn.bert_padding" not in sys.modules
    # a file that is not flash-attn's is refused, naming the tag to restore it from
    monkeypatch.setitem(stand_ins.FLASH_ATTN_FILES, "flash_attn.bert_padding",
                        (stand_ins.FLASH_ATTN_FILES["flash_attn.bert_padding"][0], "0" * 64))
    with pytest.raises(ValueError, match="v2.8.3"), stand_ins.flash_attn_stand_in():
        pass
    with stand_ins.stub_module("packcheck_no_such_package", "a test") as named:
        import packcheck_no_such_package as stub

        assert named == "packcheck_no_such_package stubbed: a test"
        with pytest.raises(ModuleNotFoundError, match="packcheck_no_such_package"):
            stub.anything  # noqa: B018
    assert "packcheck_no_such_package" not in sys.modules


def _swift(monkeypatch, released):
    """ms-swift's DPO module from its released wheel. ms-swift 4.6.0 declares trl<1.0: on trl 1.16 its import of
    RunningMoments (bco_pair's, dpo_trainer.py:20-23, never used by concatenated_forward) fails, so the test hands
    trl.trainer.utils one (a test-only stand-in; the check itself skips there, naming the module and ms-swift's
    declared requirements)."""
    from trl.trainer import utils

    released("ms-swift")
    monkeypatch.setattr(utils, "RunningMoments", type("RunningMoments", (), {}), raising=False)
    monkeypatch.delitem(T._STAND_INS, "ms-swift", raising=False)
    return T.import_swift_dpo()


def _trainer_globals() -> tuple:
    from transformers import trainer

    return trainer.DEFAULT_CALLBACKS, trainer.DEFAULT_CALLBACKS[0], trainer.DEFAULT_PROGRESS_CALLBACK, trainer.PrinterCallback


def test_swift_on_trl_1_is_a_skip_naming_the_module_and_its_declared_requirements(llama, monkeypatch, released):
    released("ms-swift")
    monkeypatch.delitem(T._STAND_INS, "ms-swift", raising=False)
    before = _trainer_globals()
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "skipped" and "trl.experimental.bco" in result.message, result.message
    assert "ms-swift declares" in result.message and "trl<1.0" in result.message
    # ms-swift 4.6.0's swift/trainers/patcher.py:106-108 swaps transformers.trainer's default callbacks at import (its
    # flow callback reads args.max_epochs): every later Trainer in the process raised at its first epoch's end (CI)
    assert _trainer_globals() == before


def test_what_a_trainer_module_patches_at_import_is_put_back(monkeypatch):
    """Planted: a module that, at import, swaps a transformers module global, deletes a TRL class's method and adds
    a name; _undo_import_patches puts the first two back and keeps the addition."""
    from transformers import trainer
    from trl import DPOTrainer

    before, init = _trainer_globals(), DPOTrainer.__dict__["__init__"]
    with T._undo_import_patches():
        trainer.DEFAULT_CALLBACKS = ["planted"]
        trainer.PrinterCallback = object
        del DPOTrainer.__init__
        trainer._packcheck_planted_addition = 1
    try:
        assert _trainer_globals() == before and DPOTrainer.__dict__["__init__"] is init
        assert trainer._packcheck_planted_addition == 1
    finally:
        del trainer._packcheck_planted_addition


def test_swift_padding_free_dpo_passes_and_catches_a_boundary_inside_a_completion(llama, monkeypatch, released):
    """ms-swift's own concatenated_forward on its padding-free row: right; planted, a position_ids restart inside the
    first chosen completion (a spurious segment in get_cu_seqlens): every later sequence's sum is read off its
    neighbour's tokens, and the margin and the loss move."""
    from trl import DPOTrainer

    trl_init = DPOTrainer.__dict__["__init__"]
    _, stand_ins = _swift(monkeypatch, released)
    # ms-swift 4.6.0's dpo_trainer.py:28 deletes trl's DPOTrainer.__init__ at import: packcheck puts it back
    assert DPOTrainer.__dict__.get("__init__") is trl_init
    from transformers import trainer
    from transformers.trainer_callback import DefaultFlowCallback

    assert trainer.DEFAULT_CALLBACKS == [DefaultFlowCallback]  # ms-swift's patcher.py:107 swap is put back
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "pass", result.message
    assert abs(result.metrics["initial_loss"] - T.LN2) < 1e-4 and result.metrics["max_abs_margin_diff"] < 1e-4
    if stand_ins:
        assert "modelscope stubbed" in result.message
    original = T.swift_padding_free_row

    def spurious(pairs, device="cpu"):
        batch = original(pairs, device)
        pos = batch["position_ids"].clone()
        first = len(pairs[0][0].prompt) + 1  # inside the first completion
        pos[0, first:len(pairs[0][0].tokens)] = pos[0, first:len(pairs[0][0].tokens)] - pos[0, first]
        batch["position_ids"] = pos
        return batch

    monkeypatch.setattr(T, "swift_padding_free_row", spurious)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "fail" and result.metrics["max_abs_seq_logprob_diff"] > 1e-2, result.message


def test_swift_labels_rolled_twice_are_caught(llama, monkeypatch, released):
    """Planted: labels pre-shifted by the collator and rolled again by concatenated_forward (off by one token)."""
    import torch

    _swift(monkeypatch, released)
    original = T.swift_padding_free_row

    def shifted(pairs, device="cpu"):
        batch = original(pairs, device)
        batch["labels"] = torch.roll(batch["labels"], shifts=-1, dims=1)
        return batch

    monkeypatch.setattr(T, "swift_padding_free_row", shifted)
    result = T.check_rl_swift_padding_free(llama)
    assert result.status == "fail" and result.metrics["max_abs_seq_logprob_diff"] > 1e-2, result.message


def test_ci_downloads_every_wheel_the_trainers_need_and_pins_each_exactly():
    """.ci/run downloads constraints/rl-peers.txt into build/rl-peers (what released_folders reads), and every wheel
    rl_wheels.NEEDS names is pinned there (name==version), so CI runs the released code, never skips it."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip download -q --no-deps -r constraints/rl-peers.txt -d build/rl-peers" in ci
    pinned = W.pins((ROOT / W.RL_PEERS_FILE).read_text())
    assert {d for need in W.NEEDS.values() for d in need} == set(pinned), pinned
    assert pinned["verl"] == "0.9.1" and pinned["openrlhf"] == "0.11.2" and pinned["ms-swift"] == "4.6.0"
