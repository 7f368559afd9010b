"""Backend names the trainers branch on (checks/backend_names.py): every attn_implementation name transformers
accepts, GPU-only ones on packcheck's CPU reference standing behind the name (backends/registration.standing_in),
with the decisions taken by the name and the padding-free row measured; a planted TRL-style name branch (position_ids
only for flash names, as TRL 0.20 - 0.23 sent them) is caught with its cause, and the name registries are restored."""

from __future__ import annotations

import functools

import pytest
from conftest import make_bench

from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.checks import backend_names as N

pytest.importorskip("trl")


def test_every_accepted_name_is_probed_with_its_decisions_and_the_flash_names_run_on_the_reference(tolerances):
    wb = make_bench("llama", "sdpa", tolerances)
    result = N.check_backend_names(wb)
    names = result.metrics["names"]
    assert set(names) == set(N.accepted_names()) and {"eager", "sdpa", "flash_attention_2", "flash_attention_3"} <= set(names)
    assert wb.model.config._attn_implementation == "sdpa"  # the model's own backend is back
    for name, e in names.items():
        assert e["flash_requested"] == ("flash" in name) and e["flash_requested_at"].startswith("transformers/utils/generic.py:")
        assert e["sft"] == "accepted" and e["padding_free"] is True and e["position_ids_passed"] is True, (name, e)
        # transformers' Trainer under context parallelism takes sdpa only, by the name (file:line recorded)
        cp = e["context_parallel"]
        assert (cp["decision"] == "accepted") == (name == "sdpa"), (name, cp)
        if name != "sdpa":
            assert cp["raised_at"].startswith("transformers/trainer.py:") and name in cp["raised"]
    for name in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2"):
        e = names[name]
        assert e["runs_as"] == "stand-in" and e["status"] == "pass", (name, e)
        assert e["logits_max_abs_diff"] <= tolerances["float32"]["logits_atol"]
    assert names["sdpa"]["runs_as"] == "native" and names["sdpa"]["status"] == "pass"
    assert names["eager"]["ulysses"]["decision"] == "refused" and names["flash_attention_2"]["ulysses"]["decision"] == "accepted"
    failed = {n for n, e in names.items() if e["status"] == "fail"}
    assert (result.status == "fail") == bool(failed)
    if failed:
        assert result.cause in ("leak", "mask_override") and all(names[n]["logits_max_abs_diff"] > 1e-2 for n in failed)


def test_a_planted_trl_name_branch_that_sends_position_ids_to_flash_names_only_is_caught(tolerances, monkeypatch):
    import trl.trainer.sft_trainer as st

    monkeypatch.setattr(N, "accepted_names", lambda: ("sdpa", "flash_attention_2"))
    original = st.SFTTrainer.__init__

    @functools.wraps(original)  # SFTTrainer's own signature (packcheck reads its argument names)
    def branching_init(self, *args, **kwargs):  # TRL 0.20-0.23: use_flash_attention = name in [...]
        original(self, *args, **kwargs)
        if self.model.config._attn_implementation not in ("flash_attention_2", "flash_attention_3"):
            collate = self.data_collator.torch_call

            def no_positions(examples):
                batch = collate(examples)
                for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
                    batch.pop(key, None)
                return batch

            self.data_collator.torch_call = no_positions

    monkeypatch.setattr(st.SFTTrainer, "__init__", branching_init)
    result = N.check_backend_names(make_bench("llama", "sdpa", tolerances))
    names = result.metrics["names"]
    assert names["sdpa"]["position_ids_passed"] is False and names["sdpa"]["status"] == "fail"
    assert names["sdpa"]["logits_max_abs_diff"] > 1e-2
    assert names["flash_attention_2"]["position_ids_passed"] is True and names["flash_attention_2"]["status"] == "pass"
    assert result.status == "fail" and result.cause == "mask_override", result.message


def test_standing_in_puts_the_reference_behind_a_name_and_restores_the_registries(tolerances):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from pytest_packcheck.backends.registration import standing_in

    wb = make_bench("llama", REFERENCE_BACKEND, tolerances)
    name = "kernels-community/flash-attn2"
    assert name not in ALL_ATTENTION_FUNCTIONS._global_mapping
    before = dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)
    ref = wb.packed_logits()
    with standing_in(name):
        wb.model.config._attn_implementation = name
        under = wb.forward(wb.packed()).logits[0].float()
    wb.model.config._attn_implementation = REFERENCE_BACKEND
    assert float((under - ref).abs().max()) == 0.0
    assert name not in ALL_ATTENTION_FUNCTIONS._global_mapping and dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping) == before


def test_a_stacked_cell_is_skipped_naming_the_bare_model(tolerances):
    pytest.importorskip("peft")
    from pytest_packcheck.model import stack as S

    wb = make_bench("llama", "sdpa", tolerances)
    wb.model = S.apply_element(wb.model, "lora", "sdpa")
    result = N.check_backend_names(wb)
    assert result.status == "skipped" and "without --packcheck-stack" in result.message
