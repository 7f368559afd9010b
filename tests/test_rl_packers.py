"""unsloth's GRPO sequence packing, prime-rl's packed micro-batches, open-instruct's packed GRPO and DPO (issue 44):
each check runs the trainer's own code, passes on the correct stack and catches its planted fault; the vendored
sources are the commits' own bytes; open-instruct's DPO padding inside a segment is named."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_bench
from test_rl_trainers import released_folders

from pytest_packcheck.checks import rl_packers as R
from pytest_packcheck.checks import rl_wheels as W

pytest.importorskip("trl")

MIRRORS = {"prime-rl": Path("/work/.mirror/PrimeIntellect-ai+prime-rl/repo"),
           "open-instruct": Path("/work/.mirror/allenai+open-instruct/repo")}


@pytest.fixture(scope="module")
def llama(tolerances):
    return make_bench("llama", "sdpa", tolerances)


@pytest.fixture
def unsloth():
    """unsloth's and unsloth_zoo's released wheels on sys.path for the test (imported from the files, never
    installed; a skip names a missing wheel), out of sys.modules after it. Yields the unpacked folders."""
    folders = released_folders("unsloth")
    with W.wheels_on_path(folders):
        yield folders


@pytest.mark.parametrize("trainer", sorted(R.VENDORED))
def test_the_vendored_blocks_are_the_commits_own_bytes(trainer):
    """Every '# ---- path:first-last' block of the vendored file is those lines of the file at the recorded commit
    (checked where the repository snapshot is on the machine), and the header names the repository and commit."""
    file, _, url, commit = R.VENDORED[trainer]
    text = (R.VENDOR / file).read_text()
    assert url in text and commit in text and "Apache License" in text
    assert (R.VENDOR / f"{trainer.replace('-', '_')}_LICENSE.txt").read_text().lstrip().startswith("Apache License")
    repo = MIRRORS[trainer]
    if not repo.is_dir():
        pytest.skip(f"no {trainer} snapshot at {repo} ({url} at {commit[:7]}): the sha256 check on load still holds")
    parts = text.split("\n# ---- ")[1:]
    assert parts
    for part in parts:
        head, _, body = part.partition("\n")
        path, _, span = head.rpartition(":")
        first, last = (int(x) for x in span.split("-"))
        lines = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True,
                               text=True).stdout.splitlines(keepends=True)
        assert body.rstrip("\n") == "".join(lines[first - 1:last]).rstrip("\n"), head


def test_a_changed_vendored_file_is_refused(monkeypatch, tmp_path):
    file = R.VENDORED["prime-rl"][0]
    (tmp_path / file).write_text((R.VENDOR / file).read_text() + "# edited\n")
    monkeypatch.setattr(R, "VENDOR", tmp_path)
    monkeypatch.setattr(R, "_LOADED", {})
    with pytest.raises(ValueError, match="rebuild it with tools/vendor_rl_sources.py"):
        R.load_vendored("prime-rl")


# ------------------------------------------------------------------------------------------------------------ prime-rl


def test_prime_rl_passes_and_catches_labels_not_shifted_back(llama, monkeypatch):
    """prime-rl's micro-batch (padded to a multiple of 8: the tail joins the last seq_lens) and its train.py order.
    Planted: shift_tensor_right dropped, so each log-prob sits one token early (labels read across each segment's
    end)."""
    result = R.check_rl_prime_rl_packed(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["max_abs_entropy_diff"] < 1e-5
    assert result.metrics["prime-rl"] == "559b447" and result.metrics["padding"] > 0
    ns, _ = R.load_vendored("prime-rl")
    monkeypatch.setitem(ns, "shift_tensor_right", lambda t, pad_value=None: t)
    result = R.check_rl_prime_rl_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-1, result.message


def test_prime_rl_catches_positions_that_run_on_over_the_micro_batch(llama, monkeypatch):
    """Planted: _materialize_bin's position_ids counted over the whole micro-batch, so the samples attend each other."""
    ns, _ = R.load_vendored("prime-rl")
    original = ns["_materialize_bin"]

    def run_on(bin_content):
        mb = original(bin_content)
        mb.position_ids = list(range(len(mb.input_ids)))
        return mb

    monkeypatch.setitem(ns, "_materialize_bin", run_on)
    result = R.check_rl_prime_rl_packed(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-2, result.message


# ------------------------------------------------------------------------------------------------------ open-instruct


def test_open_instruct_grpo_passes_and_catches_a_response_mask_off_by_one(llama, monkeypatch):
    """open-instruct's pack_sequences and compute_logprobs. Planted: each response mask starts one token late and
    runs one past the response (the first completion token dropped, the next sample's first token read)."""
    import torch

    result = R.check_rl_open_instruct_grpo(llama)
    assert result.status == "pass", result.message
    assert result.metrics["max_abs_logprob_diff"] < 1e-5 and result.metrics["open-instruct"] == "e6c3044"
    ns, _ = R.load_vendored("open-instruct")
    original = ns["pack_sequences"]

    def late(**kwargs):
        packed = original(**kwargs)
        packed.response_masks = [torch.cat([t[:1], t[:-1]]) for t in packed.response_masks]
        return packed

    monkeypatch.setitem(ns, "pack_sequences", late)
    result = R.check_rl_open_instruct_grpo(llama)
    assert result.status == "fail" and result.metrics["max_abs_logprob_diff"] > 1e-1, result.message
    assert result.cause == "collator_contract"  # the last sample's last completion token is no longer selected


def test_open_instruct_dpo_names_the_padding_inside_a_segment(llama, tolerances):
    """dpo.py's --packing passes max_seq_length: each branch is right-padded to it and the rejected cu_seq_lens are
    offset by the padded length, so the chosen branch's padding falls inside the first rejected segment. sdpa reads
    the segments from position_ids (right); a varlen kernel reading cu_seq_lens_k gets a segment longer than
    max_length_k and rows past cu_seq_lens[-1] (packcheck_flash_ref refuses it)."""
    result = R.check_rl_open_instruct_dpo(llama)
    assert result.status == "pass", result.message
    assert result.metrics["padding_tokens_in_segments"] == R.OPEN_INSTRUCT_SLACK
    assert result.metrics["longest_segment"] > result.metrics["longest_sequence"]
    assert abs(result.metrics["initial_loss"] - 0.6931471805599453) < 1e-5
    flash = R.check_rl_open_instruct_dpo(make_bench("llama", "packcheck_flash_ref", tolerances))
    assert flash.status == "fail" and flash.cause == "collator_contract", flash.message
    assert flash.metrics["max_abs_seq_logprob_diff_unpadded"] < 1e-5  # without max_seq_length the row is right
    # the arguments made valid, the padding inside the first rejected segment moves that sequence's sum
    assert flash.metrics["max_abs_seq_logprob_diff"] > 1e-3 and "FlashBoundariesError" in flash.metrics["kernel_refused"]


def test_open_instruct_dpo_catches_a_spurious_padding_segment(llama, monkeypatch):
    """Planted: concatenated_inputs adds a boundary (a padding segment at the row's front in cu_seq_lens_k), so
    get_batch_logps reads every sequence off its neighbour's segment."""
    import torch

    ns, _ = R.load_vendored("open-instruct")
    original = ns["concatenated_inputs"]

    def spurious(batch, tag="concatenated_"):
        out, bs = original(batch, tag)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            cu = out[tag + key]
            out[tag + key] = torch.cat([cu[:1], cu[1:2] - 1, cu[1:]])
        return out, bs

    monkeypatch.setitem(ns, "concatenated_inputs", spurious)
    monkeypatch.setitem(ns, "pf_concatenated_inputs", spurious)
    result = R.check_rl_open_instruct_dpo(llama)
    assert result.status == "fail" and result.metrics["max_abs_seq_logprob_diff"] > 1e-1, result.message


# ------------------------------------------------------------------------------------------------------------ unsloth


@contextlib.contextmanager
def one_leaky_layer(layer: int = 0):
    """sdpa that ignores its mask in one decoder layer only (attends causally over the whole row): a partial leak."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]

    def leaky(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) == layer:
            attention_mask = None
            kwargs = {**{k: v for k, v in kwargs.items() if k != "is_causal"}, "is_causal": True}
        return original(module, query, key, value, attention_mask, **kwargs)

    mapping["sdpa"] = leaky
    try:
        yield
    finally:
        mapping["sdpa"] = original


def test_unsloth_packing_passes_and_its_own_verifier_passes_a_partial_leak(llama, unsloth):
    """unsloth's GRPO sequence-packing block, read from its release, on its left-packed rows: right on llama, and its
    own verifier agrees. Planted: one decoder layer attends across the row. packcheck fails it at its tolerance;
    unsloth's verifier measures the same leak and compares it with its own 0.7-nat threshold."""
    folders = unsloth
    result = R.check_rl_unsloth_grpo_packed(llama)
    assert result.status == "pass", result.message
    m = result.metrics
    assert m["unsloth"] == "2026.10.9" and m["max_abs_logprob_diff"] < 1e-5 and m["unsloth_verifier_diff"] < 1e-5
    assert m["unsloth_accept_below"] == 0.7 and m["unsloth_disable_at"] == 1.5
    import sys

    assert R.unsloth_source()["zoo"].__file__.startswith(str(folders[1]))  # from the unpacked wheel
    assert "unsloth" not in sys.modules  # its package __init__ (GPU check) never ran
    with one_leaky_layer():
        leaky = R.check_rl_unsloth_grpo_packed(llama)
    assert leaky.status == "fail" and leaky.metrics["max_abs_logprob_diff"] > 1e-2, leaky.message
    diff = leaky.metrics["unsloth_verifier_diff"]
    assert diff > 1e-2 and abs(diff - leaky.metrics["max_abs_logprob_diff"]) < 1e-3
    print(f"one-layer leak: packcheck {leaky.metrics['max_abs_logprob_diff']:.3f} nats, unsloth verifier {diff:.3f} "
          f"(accepts below {m['unsloth_accept_below']})")


def test_unsloth_catches_logits_to_keep_off_by_one(llama, monkeypatch, unsloth):
    """Planted: the batch hands unsloth's block logits_to_keep one short (the last completion token dropped from the
    completion mask, each row's first completion token scored off the wrong position)."""
    original = R.unsloth_grpo_batch

    def one_more(samples, pad_id):
        ids, keep = original(samples, pad_id)
        return ids, keep + 1

    monkeypatch.setattr(R, "unsloth_grpo_batch", one_more)
    result = R.check_rl_unsloth_grpo_packed(llama)
    assert result.status == "fail" and result.cause == "collator_contract", result.message


def test_without_unsloth_the_check_is_a_skip_naming_it(llama, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "unsloth" else real(name, *a))
    monkeypatch.delitem(__import__("sys").modules, "unsloth", raising=False)
    result = R.check_rl_unsloth_grpo_packed(llama)
    assert result.status == "skipped" and "'unsloth'" in result.message, result.message


def test_unsloth_declines_to_pack_a_sliding_window_model_past_its_window(tolerances, unsloth):
    """unsloth's own gate (_pk_sw_ok): a model whose sliding_window is shorter than a sample is scored padded; the
    skip says so and carries what the gate read."""
    result = R.check_rl_unsloth_grpo_packed(make_bench("gemma3_text", "sdpa", tolerances))
    assert result.status == "skipped" and "sliding_window" in result.message, result.message
    gate = result.metrics["unsloth_gate"]
    assert gate["longest_segment"] > gate["sliding_window"]


def test_the_committed_rl_matrix_holds_what_docs_rl_md_quotes_for_these_trainers():
    """docs/rl.md's section and rows on unsloth, prime-rl and open-instruct quote reports/rl's cells: llama sdpa's
    numbers, every varlen cell's collator_contract on open-instruct's padded DPO row with the quoted range, unsloth's
    bound and its sliding-window skips."""
    import re

    from pytest_packcheck.results.schema import read_results

    repo = Path(__file__).resolve().parent.parent
    doc = (repo / "docs" / "rl.md").read_text()
    cells = {(c["model"]["model_type"], c["backend"], c["check"]): c
             for c in read_results(repo / "reports" / "rl" / "packcheck-matrix.json")["cells"]}
    dpo = cells[("llama", "sdpa", "rl_open_instruct_dpo")]
    assert dpo["status"] == "pass" and "sequence log-probs 3.28e-06 nats, preference margin 5.85e-06" in dpo["message"]
    assert "sequence log-probs 3.28e-06 nats, margin 5.85e-06" in doc
    flash = {m: c for (m, b, k), c in cells.items() if b == "packcheck_flash_ref" and k == "rl_open_instruct_dpo"}
    assert flash and all(c["cause"] == "collator_contract" for c in flash.values())
    diffs = sorted(c["metrics"]["max_abs_seq_logprob_diff"] for c in flash.values())
    assert f"({diffs[0]:.1e} to {diffs[-1]:.1e} across the models)" in doc
    assert f"off by {flash['llama']['metrics']['max_abs_seq_logprob_diff']:.2e} nats" in doc
    unsloth = [c for (m, b, k), c in cells.items() if k == "rl_unsloth_grpo_packed" and c["status"] == "pass"]
    worst = max(c["metrics"]["max_abs_logprob_diff"] for c in unsloth)
    bound = float(re.search(r"Every model passes within ([0-9.e-]+) nats per token", doc).group(1))
    assert len(unsloth) >= 12 and worst <= bound
    assert all("sliding_window" in cells[(m, b, "rl_unsloth_grpo_packed")]["message"]
               for m in ("gemma3_text", "gpt_oss") for b in ("eager", "packcheck_flash_ref"))
    assert cells[("llama", "sdpa", "rl_unsloth_grpo_packed")]["metrics"]["unsloth_accept_below"] == 0.7


def test_unsloth_2026_7s_hidden_states_forward_is_run_and_a_wrong_hand_off_fails(llama, monkeypatch, unsloth):
    """unsloth 2026.7's block takes the forward's .logits as the final hidden states (its patched forwards under
    UNSLOTH_RETURN_HIDDEN_STATES=1) and applies lm_head itself: the check hands it lm_head's input, and that passes
    (run on 2026.10.9's block with the mode forced: its _unsloth_grpo_returns_hidden_states sees a hidden-wide tensor
    and takes the same branch). Planted: the hand-off scaled by 2 (a forward that returned another layer's states):
    the check fails it, and its stand-in is named."""
    original = R.unsloth_source

    def forced():
        return {**original(), "hidden_states": True}

    monkeypatch.setattr(R, "unsloth_source", forced)
    result = R.check_rl_unsloth_grpo_packed(llama)
    assert result.status == "pass" and result.metrics["max_abs_logprob_diff"] < 1e-5, result.message
    assert R.HIDDEN_STATES_STAND_IN in result.metrics["stand_ins"]
    call = R._UnslothModel.__call__

    def doubled(self, **kwargs):
        out = call(self, **kwargs)
        if self.hidden_states and kwargs.get("packed_seq_lengths") is not None:
            out.logits = out.logits * 2
        return out

    monkeypatch.setattr(R._UnslothModel, "__call__", doubled)
    wrong = R.check_rl_unsloth_grpo_packed(llama)
    assert wrong.status == "fail" and wrong.metrics["max_abs_logprob_diff"] > 1e-2, wrong.message


def test_python_body_unwraps_a_fullgraph_compiled_function():
    """unsloth_zoo before 2026.10 compiles its gathers with fullgraph=True, which refuses to run with dynamo disabled:
    _python_body hands back the function's own body (planted: a compiled function, its body returned)."""
    import torch

    def body(x):
        return x + 1

    compiled = torch.compile(body, fullgraph=True)
    assert R._python_body(compiled) is body and R._python_body(body) is body


def test_unsloths_process_wide_hooks_do_not_outlive_the_check(llama, monkeypatch, unsloth):
    """Planted by unsloth_zoo itself: its tiled_mlp.py registers a process-wide nn.Module registration hook
    (register_module_module_registration_hook) when the 2026.7-style hidden-states path loads it. The hook outlived the
    check, and test_stack's torch.compile test, later in the same xdist worker, traced it and failed importing
    'unsloth_zoo.tiled_mlp' once the wheel had left the path. After the check, torch's global hooks and the torch /
    transformers attributes are what they were."""
    from torch.nn.modules import module as nn_module

    def hooks():
        return {n: list(v) for n, v in vars(nn_module).items() if n.startswith("_global_") and isinstance(v, dict)}

    before = hooks()
    original = R.unsloth_source
    monkeypatch.setattr(R, "unsloth_source", lambda: {**original(), "hidden_states": True})
    result = R.check_rl_unsloth_grpo_packed(llama)
    assert result.status == "pass", result.message
    assert hooks() == before
    leaked = [(name, attr) for name, mod in list(sys.modules.items()) if name.startswith(("torch", "transformers"))
              and mod is not None for attr, value in list(vars(mod).items())
              if str(getattr(value, "__module__", "") or "").startswith("unsloth")]
    assert not leaked, leaked
