"""Fidelity of the flash stand-ins: code that branches on the flash_attention_2 name makes a stand-in cell
"not checked: differs from real FA2 because <file:line>", never a verdict."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import torch

from pytest_packcheck.analysis import fidelity as F
from pytest_packcheck.backends import REFERENCE_BACKEND
from pytest_packcheck.results import CheckResult

TRL_0_19_1 = '''\
            if model.config._attn_implementation != "flash_attention_2":
                warnings.warn("Padding-free training is enabled, but the attention implementation is not set to ...")
            data_collator = DataCollatorForLanguageModeling(
                pad_token_id=pad_token_id,
                completion_only_loss=self.completion_only_loss,
                padding_free=self.padding_free,
                # Using position_ids without flash_attn hurts the training
                return_position_ids=model.config._attn_implementation == "flash_attention_2",
'''
TRL_0_21_0 = '''\
        use_flash_attention = model.config._attn_implementation in [
            "flash_attention_2",
            "kernels-community/vllm-flash-attn3",
        ]
'''


def _planted_module(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_trls_collator_branches_are_found_and_its_warnings_are_not(tmp_path):
    """The lines of TRL 0.19.1 (sft_trainer.py:411 warns, :449 builds the collator) and 0.21.0 (:440): the
    collator lines count, the warning does not."""
    for text, expected in ((TRL_0_19_1, ["return_position_ids=model.config._attn_implementation"]),
                           (TRL_0_21_0, ["use_flash_attention = model.config._attn_implementation in ["])):
        path = tmp_path / "sft_trainer.py"
        path.write_text(text)
        F._branches_in.cache_clear()
        found = F._branches_in(str(path), True)
        assert [f.split(": ", 1)[1].split(" ==")[0].rstrip() for f in found] == [e.split(" ==")[0] for e in expected], found


def test_a_model_that_branches_on_the_name_makes_its_stand_in_cell_differ(tmp_path):
    """Planted: a model whose forward tests ``_attn_implementation == "flash_attention_2"`` (as 4.57.1's dbrx /
    bloom _update_causal_mask do). Under packcheck_flash_ref it differs, naming file:line; under sdpa, or built
    as flash_attention_2 (4.44 .. 4.55.0), it does not."""
    module = _planted_module(tmp_path, "planted_branching_model", '''
        import torch

        class Config:
            _attn_implementation = "packcheck_flash_ref"

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = Config()
                self.lin = torch.nn.Linear(2, 2)

            def forward(self, x, mask=None):
                if self.config._attn_implementation == "flash_attention_2":
                    mask = None
                return self.lin(x)
        ''')
    F._branches_in.cache_clear()
    model = module.Model()
    found = F.stand_in_differs(model, REFERENCE_BACKEND)
    assert len(found) == 1 and "planted_branching_model.py:14: if self.config._attn_implementation" in found[0], found
    assert F.stand_in_differs(model, "sdpa") == []
    model.config._attn_implementation = "flash_attention_2"
    assert F.stand_in_differs(model, REFERENCE_BACKEND) == []

    from pytest_packcheck.run.runner import Cell, _fidelity

    model.config._attn_implementation = REFERENCE_BACKEND
    bench = type("B", (), {"model": model})()
    cell = Cell(0, "m", REFERENCE_BACKEND, "logits_parity", "float32")
    got = _fidelity(CheckResult("pass", {"max_abs_diff_solo": 1e-7}, "packed vs solo max abs diff 1.00e-07"), bench, cell)
    assert got.status == "skipped" and got.cause == "stand_in_differs", got.message
    assert got.message.startswith("not checked: differs from real FA2 because ")
    assert "planted_branching_model.py:14" in got.message
    assert got.evidence["measured_status"] == "pass" and got.metrics["max_abs_diff_solo"] == 1e-7
    crashed = CheckResult("error", {}, "IndexError: index 33 is out of bounds", cause="shrunk_crash")
    assert _fidelity(crashed, bench, cell).cause == "stand_in_differs"  # opt on 4.57.1: the branch's crash
    own = CheckResult("error", {}, "boom", cause="packcheck_error")
    assert _fidelity(own, bench, cell) is own
    assert _fidelity(CheckResult("skipped", {}, "no GPU"), bench, cell).status == "skipped"


def test_the_installed_stack_has_no_name_branch_on_the_training_path(tolerances):
    """transformers 5.24 and TRL 1.16 (installed): a default decoder on packcheck_flash_ref reads no
    flash_attention_2 name branch, so its cells stay verdicts (measured, not assumed)."""
    from conftest import make_bench

    bench = make_bench("llama", REFERENCE_BACKEND, tolerances)
    assert F.stand_in_differs(bench.model, REFERENCE_BACKEND, with_trl=True) == []
    assert torch.is_tensor(bench.packed()["input_ids"])
