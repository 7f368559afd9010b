"""The varlen reference on transformers 4.44 .. 4.55.0 (flash-attn's functions as module globals of
``modeling_flash_attention_utils``): the pure parts here, on the installed transformers. The real old releases run
in tests/test_versions.py (one in CI, the rest under ``slow``)."""

from __future__ import annotations

import sys
import types

import pytest

from pytest_packcheck import backends as BK


def test_installed_transformers_uses_the_kernel_loader():
    """5.24 has lazy_import_flash_attention: the reference is registered by name, never run as flash_attention_2."""
    assert BK.reference_mode() == "loader"
    assert BK.build_attn_implementation(BK.REFERENCE_BACKEND) == BK.REFERENCE_BACKEND


def test_conditional_flash_imports_are_read_from_the_source(tmp_path, monkeypatch):
    """What a module imports only when flash-attn is installed (4.44's modeling_mistral, 4.44's mfu), absolute and
    relative; imports under another condition (Ascend NPU) are not taken."""
    package = tmp_path / "fakepkg" / "models" / "m"
    package.mkdir(parents=True)
    for folder in (tmp_path / "fakepkg", tmp_path / "fakepkg" / "models", package):
        (folder / "__init__.py").write_text("")
    (package / "modeling_m.py").write_text(
        "from ...utils import is_flash_attn_2_available, is_torch_npu_available\n"
        "if is_flash_attn_2_available():\n"
        "    from ...modeling_flash_attention_utils import _flash_attention_forward\n"
        "    from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen\n"
        "    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input  # noqa\n"
        "if is_torch_npu_available():\n"
        "    from torch_npu import npu_rotary_mul as apply_rotary_emb\n")
    (tmp_path / "fakepkg" / "utils.py").write_text("def is_flash_attn_2_available(): return False\n"
                                                    "def is_torch_npu_available(): return False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("fakepkg.models.m.modeling_m")
    try:
        found = BK._flash_conditional_imports("fakepkg.models.m.modeling_m")
    finally:
        for name in [n for n in sys.modules if n.startswith("fakepkg")]:
            del sys.modules[name]
    assert found == {
        "_flash_attention_forward": ("fakepkg.modeling_flash_attention_utils", "_flash_attention_forward"),
        "flash_attn_func": ("flash_attn", "flash_attn_func"), "varlen": ("flash_attn", "flash_attn_varlen_func"),
        "index_first_axis": ("flash_attn.bert_padding", "index_first_axis"),
        "pad_input": ("flash_attn.bert_padding", "pad_input"), "unpad_input": ("flash_attn.bert_padding", "unpad_input"),
    }


def test_module_globals_are_put_back_after_the_forward_also_on_an_exception():
    """Names that were missing are removed again, names that existed get their value back; nested entries (a
    forward inside a forward, a checkpointed recomputation) change nothing until the outermost one leaves."""
    module = types.ModuleType("packcheck_fake_module")
    module.kept = "original"
    globals_ = BK._ModuleGlobals()
    globals_.bindings = lambda names: [(module, "kept", "patched"), (module, "added", BK.varlen_reference_kernel)]
    with pytest.raises(RuntimeError):
        globals_.enter(())
        try:
            globals_.enter(())
            assert module.kept == "patched" and module.added is BK.varlen_reference_kernel
            globals_.exit()
            assert module.kept == "patched"  # still inside the outer forward
            raise RuntimeError("the model raised")
        finally:
            globals_.exit()
    assert module.kept == "original" and not hasattr(module, "added") and globals_.depth == 0


def test_pad_and_unpad_stand_ins_follow_flash_attn_bert_padding():
    import torch

    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tokens, indices, cu, max_len = BK.reference_unpad_input(hidden, mask)
    assert tokens.shape == (5, 3) and indices.tolist() == [0, 1, 2, 4, 5]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5] and max_len == 3 and type(max_len) is int
    assert torch.equal(BK.reference_index_first_axis(hidden.reshape(8, 3), indices), tokens)
    padded = BK.reference_pad_input(tokens, indices, 2, 4)
    assert torch.equal(padded[mask.bool()], hidden[mask.bool()]) and not padded[~mask.bool()].any()


def test_effective_backend_of_a_model_run_as_flash_attention_2():
    """The reference on 4.44 .. 4.55.0 runs under transformers' flash_attention_2 name: the cell's backend is the
    one packcheck built it for; a model that really says something else is what it says."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert BK.effective_attn_implementation(model) == "flash_attention_2"
    setattr(model, BK.PACKCHECK_BACKEND_ATTR, BK.REFERENCE_BACKEND)
    assert BK.effective_attn_implementation(model) == BK.REFERENCE_BACKEND
    model.config._attn_implementation = "sdpa"  # switched behind packcheck's back: not relabelled
    assert BK.effective_attn_implementation(model) == "sdpa"
