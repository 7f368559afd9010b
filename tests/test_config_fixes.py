"""The config-fix table (issue 41 part 2): an architecture whose default config does not run is built from a config
that does, and every answer names the config it rests on. Planted faults: the table's entry removed (the old code:
an error cell, cause library_config), a user override (keeps the default), a forward without position_ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytest_packcheck.model import config_fixes as cf
from pytest_packcheck.model.resolve import resolve_model
from pytest_packcheck.model.specs import parse_model_spec

REPO = Path(__file__).resolve().parents[1]


class PlantedPositions(torch.nn.Module):
    """A module class of this file without ``weight`` (speech_to_text_2's positional embedding from 4.51 on): a global
    of the frame that reads it, as the model's own classes are of its modeling file."""


def resolve(raw: str):
    return resolve_model(parse_model_spec(raw, "test"), "test")


def test_every_fix_is_well_formed_and_a_shipped_checkpoint_is_there():
    assert cf.CONFIG_FIXES, "the table is empty"
    for name, fix in cf.CONFIG_FIXES.items():
        assert fix.model_type == name
        assert fix.kind in ("checkpoint", "text_config", "overrides"), name
        assert fix.reason.strip(), name
        assert fix.kind != "overrides" or fix.overrides or fix.init, f"{name}: an overrides fix names no value"
        if fix.kind == "checkpoint":
            assert (cf.HUB_CONFIGS / fix.checkpoint / "config.json").is_file(), name
            assert fix.checkpoint in (cf.HUB_CONFIGS / "SOURCES.md").read_text(), f"{name}: provenance not in SOURCES.md"
        assert fix.reason in fix.source() and "shrunk" in fix.source()


def test_a_default_that_does_not_run_is_built_from_the_fix_and_says_so(monkeypatch):
    """glm4v on 5.25: the default's text mrope_section [8, 12, 12] sums to 32 frequencies for heads of 64. With the
    fix (GLM-4.1V's head_dim 128 x partial_rotary_factor 0.5) it builds and the record names the source."""
    from pytest_packcheck.model.multimodal import mrope_section_mismatch

    resolved = resolve("arch:glm4v")
    assert resolved.error is None
    assert resolved.config_source and "head_dim=128" in resolved.config_source
    assert mrope_section_mismatch(resolved.config) is None
    assert resolved.record()["config_source"] == resolved.config_source
    # planted: the table without its entry (the code before it): the default's mismatch is back, nothing named
    monkeypatch.delitem(cf.CONFIG_FIXES, "glm4v")
    bare = resolve("arch:glm4v")
    assert bare.config_source is None and "config_source" not in bare.record()
    assert mrope_section_mismatch(bare.config) is not None


def test_the_fixed_model_builds_shrunk_and_runs_a_packed_row():
    import torch

    from pytest_packcheck.model.build import build_model

    resolved = resolve("arch:glm4v")
    model = build_model(resolved, "eager", "float32")
    ids = torch.randint(0, 100, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    out = model(input_ids=ids, position_ids=pos)
    assert torch.isfinite(out.logits).all()


def test_a_default_that_runs_and_a_users_override_keep_the_default():
    assert resolve("arch:llama").config_source is None  # no fix: nothing changes
    own = resolve("arch:glm4v{text_config.head_dim=128}")  # the user's own values: not replaced by the table's
    assert own.config_source is None


def test_no_fix_re_raises_the_defaults_own_error():
    spec = parse_model_spec("arch:not_in_the_table", "test")
    with pytest.raises(ValueError, match="own"):
        cf.choose_config(spec, None, ValueError("the default's own error"))


def test_a_text_config_fix_builds_the_causal_lm_and_keeps_the_architecture_name(monkeypatch):
    """The text_config kind, planted on an architecture whose causal LM has its own config class: the answer stays
    the architecture's (model_type llama4, not llama4_text) and is built by the causal-LM class."""
    monkeypatch.setattr(cf, "default_runs", lambda config, model_type: "planted: does not run")
    resolved = resolve("arch:llama4")
    assert resolved.model_type == "llama4" and resolved.config.model_type == "llama4_text"
    assert "text config" in resolved.config_source
    from pytest_packcheck.model.build import build_model

    model = build_model(resolved, "eager", "float32")
    assert type(model).__name__ == "Llama4ForCausalLM"


def test_a_forward_without_position_ids_is_unsupported_with_its_cause_not_library_config():
    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.run.runner import NO_POSITION_IDS, _classify_exception

    exc = TypeError(f"BartForCausalLM.forward() got an {NO_POSITION_IDS}")
    assert _classify_exception(exc) == "unsupported"
    assert _classify_exception(TypeError("something else")) == "error"  # planted: any other TypeError stays an error
    assert "no_position_ids" in CAUSE_RECORDS


def test_an_atlas_entry_carries_the_config_and_lookup_answers_with_it():
    from pytest_packcheck.atlas.collect import reduce_release

    cell = {"backend": "eager", "dtype": "float32", "check": "isolation", "status": "pass",
            "metrics": {"max_change": 0.0}, "model": {"model_type": "glm4v", "config_source": "X's config.json, shrunk"}}
    entry = reduce_release({"cells": [cell]})["glm4v"]["eager"]
    assert entry["config"] == "X's config.json, shrunk"
    del cell["model"]["config_source"]  # planted: the default config: no key
    assert "config" not in reduce_release({"cells": [cell]})["glm4v"]["eager"]


def test_the_committed_atlas_answers_qwen2_vl_on_4x_from_its_checkpoint():
    """The atlas had no verdict for qwen2_vl on any 4.x (library_config); re-measured on the checkpoint's config."""
    from pytest_packcheck.support import lookup

    doc = json.loads((REPO / "reports/atlas/support.json").read_text())
    entry = doc["cells"]["qwen2_vl"]["eager"]["4.57.6"]
    assert "library_config" not in entry.get("causes", [])
    answer = lookup("qwen2_vl", "eager", "4.57.6", path=REPO / "reports/atlas/support.json")
    assert "Qwen/Qwen2-VL-2B-Instruct" in answer.config_source


def test_atlas_md_lists_the_configs_entries_rest_on_and_what_is_still_library_config():
    from pytest_packcheck.atlas.render import config_sections

    support = {"backends": ["eager"], "cells": {
        "glm4v": {"eager": {"5.25.0": {"verdict": "pass", "causes": [], "config": "GLM-4.1V's values, shrunk"},
                            "5.24.0": {"verdict": "pass", "causes": []}}},
        "git": {"eager": {"5.25.0": {"verdict": "error", "causes": ["library_config"], "message": "labels batch 0"}}}}}
    text = "\n".join(config_sections(support))
    assert "**glm4v** (1 releases, 5.25.0 .. 5.25.0): GLM-4.1V's values, shrunk" in text
    assert "**git**: 1 entries, 1 releases (5.25.0 .. 5.25.0); 5.25.0: labels batch 0" in text
    del support["cells"]["glm4v"]["eager"]["5.25.0"]["config"]  # planted: no entry rests on a fix
    assert "**glm4v**" not in "\n".join(config_sections(support))


def test_a_default_whose_rotary_has_a_built_in_section_keeps_the_default():
    """qwen2_vl on 5.x: the default config leaves mrope_section out, and the rotary module's built-in [16, 24, 24]
    runs (resolve writes it into the config). The default runs, so the checkpoint does not replace it (planted: the
    check before the built-in section is written took the checkpoint)."""
    resolved = resolve("arch:qwen2_vl")
    assert resolved.config_source is None
    assert any("mrope_section=[16, 24, 24]" in n for n in resolved.notes)


def _phi_500(monkeypatch):
    """transformers 5.0.0's PhiConfig, planted on the installed transformers: no pad_token_id unless the constructor
    gets one (as from a config.json), and PhiForCausalLM reads config.pad_token_id at build."""
    import transformers

    class Phi500Config(transformers.PhiConfig):
        def __init__(self, **kw):
            super().__init__(**kw)
            if "pad_token_id" not in kw:
                self.__dict__.pop("pad_token_id", None)

        def __getattribute__(self, key):
            if key == "pad_token_id" and key not in object.__getattribute__(self, "__dict__"):
                raise AttributeError("'PhiConfig' object has no attribute 'pad_token_id'")
            return super().__getattribute__(key)

    monkeypatch.setitem(transformers.CONFIG_MAPPING._extra_content, "phi", Phi500Config)
    monkeypatch.setitem(transformers.AutoModelForCausalLM._model_mapping._extra_content, Phi500Config,
                        transformers.PhiForCausalLM)
    return Phi500Config


def test_5_0_0s_missing_pad_token_id_is_given_as_the_constructor_argument(monkeypatch):
    """transformers 5.0.0 (atlas 2026-12: phi, jetmoe, stablelm, exaone4 library_config on 5.0.0 only): the config
    class has no pad_token_id, the model reads it at build. The fix passes pad_token_id=None (4.x's and 5.1.0's
    default) to the constructor; the record names it. Planted: the table without the entry re-raises the build's
    AttributeError as the default's answer."""
    cls = _phi_500(monkeypatch)
    default = cls()
    assert "pad_token_id" in cf.default_runs(default, "phi")
    spec = parse_model_spec("arch:phi", "test")
    config, source = cf.choose_config(spec, default, None)
    assert config.pad_token_id is None and cf.default_runs(config, "phi") is None
    assert "pad_token_id=null" in source and "5.0.0" in source
    for name in ("jetmoe", "stablelm", "exaone4"):
        assert cf.CONFIG_FIXES[name].init == (("pad_token_id", None),)
    for name in ("glm4v", "glm46v", "qwen3_vl_moe"):
        assert ("text.pad_token_id", None) in cf.CONFIG_FIXES[name].overrides
    # planted: no entry: the default is kept (its build error is what the cell then says)
    monkeypatch.delitem(cf.CONFIG_FIXES, "phi")
    kept, none = cf.choose_config(spec, default, None)
    assert kept is default and none is None and "pad_token_id" in cf.default_runs(kept, "phi")


def test_a_missing_package_at_full_size_is_a_skip_naming_it_not_library_config(monkeypatch):
    """gemma3n on 4.53 .. 4.56 (atlas 2026-12: 12 library_config entries): the shrunk build fails and the full-size
    build raises transformers' ImportError (TimmWrapperModel needs pillow and timm): the cell is a skip naming the
    packages, as the shrunk build's own ImportError is. Planted: the full-size build's AttributeError stays
    library_config."""
    from pytest_packcheck.model import build as B
    from pytest_packcheck.model.build_errors import LibraryConfigError

    said = ("ImportError: TimmWrapperModel requires the PIL library but it was not found in your environment. You can "
            "install it with pip: `pip install pillow`. TimmWrapperModel requires the timm library ... `pip install timm`")

    def shrink_fails(*args, **kwargs):
        raise RuntimeError("the shrunk vision tower does not build")

    monkeypatch.setattr(B, "shrink_config", shrink_fails)
    monkeypatch.setattr(B, "unshrunk_build_error", lambda *a: said)
    resolved = resolve("arch:llama")
    with pytest.raises(ImportError, match=r"^llama needs pillow, timm \(not installed\): TimmWrapperModel requires"):
        B.build_model(resolved, "eager", "float32")
    monkeypatch.setattr(B, "unshrunk_build_error", lambda *a: "AttributeError: 'X' object has no attribute 'y'")
    monkeypatch.setattr(B, "_without_overrides_builds", lambda *a: False)
    with pytest.raises(LibraryConfigError, match="at full size either"):
        B.build_model(resolved, "eager", "float32")


def test_a_rotary_per_layer_type_is_checked_per_layer_type_and_cohere_compass_builds():
    """Cohere Compass (5.16 .. 5.25: 30 library_config entries) keeps its text rotary per layer type
    (rope_parameters["full_attention"]), empty in the default. The fix gives each type its rotary's built-in section
    [24, 20, 20] for heads of 128; the mismatch check reads each type's dict. Planted: one type's section for other
    heads is named; the empty default still does not run."""
    import copy

    import torch

    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.multimodal import mrope_section_mismatch, text_config_of

    resolved = resolve("arch:cohere_compass")
    assert resolved.error is None and "rope_parameters" in resolved.config_source
    assert mrope_section_mismatch(resolved.config) is None
    model = build_model(resolved, "eager", "float32")
    ids = torch.randint(0, 100, (1, 12))
    assert model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])).logits.shape[1] == 12
    planted = copy.deepcopy(resolved.config)
    text_config_of(planted).rope_parameters["sliding_attention"]["mrope_section"] = [8, 12, 12]
    why, _ = mrope_section_mismatch(planted)
    assert "[8, 12, 12] sums to 32" in why
    text_config_of(planted).rope_parameters = {}
    assert "has no mrope_section" in mrope_section_mismatch(planted)[0]


def _phi4_multimodal_451(monkeypatch):
    """transformers 4.51 .. 5.0.0's Phi4MultimodalConfig, planted on the installed transformers: a None vision_config
    stays None (the constructed default is discarded), and the audio config is made only where vision_config is None,
    so it is None as soon as a vision_config is given (configuration_phi4_multimodal.py:417-424 in 4.51.3)."""
    import transformers

    class Phi4Multimodal451Config(transformers.Phi4MultimodalConfig):
        def __init__(self, vision_config=None, audio_config=None, **kw):
            super().__init__(vision_config=vision_config, audio_config=audio_config, **kw)
            if vision_config is None:
                self.vision_config = None
            if audio_config is None and vision_config is not None:
                self.audio_config = None

    monkeypatch.setitem(transformers.CONFIG_MAPPING._extra_content, "phi4_multimodal", Phi4Multimodal451Config)
    monkeypatch.setitem(transformers.AutoModelForCausalLM._model_mapping._extra_content, Phi4Multimodal451Config,
                        transformers.Phi4MultimodalForCausalLM)
    return Phi4Multimodal451Config


def test_phi4_multimodal_gets_the_sub_configs_its_4x_default_drops(monkeypatch):
    """phi4_multimodal on 4.51 .. 5.0.0 (atlas 2026-12: 24 library_config entries): the default leaves vision_config
    and audio_config None and the model reads config.vision_config.image_token_id at build. The fix gives both as {}
    (each class's defaults, as 5.1.0's default makes them) to the constructor; the model then builds shrunk and runs a
    packed row. Planted: the table without the entry keeps the default, whose build error is the answer; a fix that
    gives only the vision config (the audio one is then dropped) does not run."""
    import torch

    from pytest_packcheck.model.build import build_model

    cls = _phi4_multimodal_451(monkeypatch)
    default = cls()
    assert default.vision_config is None and "image_token_id" in cf.default_runs(default, "phi4_multimodal")
    spec = parse_model_spec("arch:phi4_multimodal", "test")
    config, source = cf.choose_config(spec, default, None)
    assert config.vision_config is not None and config.audio_config is not None
    assert cf.default_runs(config, "phi4_multimodal") is None
    assert 'vision_config={}, audio_config={}' in source and "configuration_phi4_multimodal.py" in source
    resolved = resolve("arch:phi4_multimodal")
    assert resolved.error is None and resolved.config_source == source
    model = build_model(resolved, "eager", "float32")
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    assert model(input_ids=torch.randint(0, 100, (1, 12)), position_ids=pos).logits.shape[:2] == (1, 12)
    # planted: only the vision config given: 4.51's constructor drops the audio config, and the build fails again
    half = cls(vision_config={})
    assert half.audio_config is None and "audio_token_id" in cf.default_runs(half, "phi4_multimodal")
    # planted: no entry: the default is kept (its build error is what the cell then says)
    monkeypatch.delitem(cf.CONFIG_FIXES, "phi4_multimodal")
    kept, none = cf.choose_config(spec, default, None)
    assert kept is default and none is None


def _xielu_500(monkeypatch):
    """transformers 4.56 .. 5.0.0's XIELUActivation, planted on the installed transformers: it reads its beta and eps
    buffers' values at build (``float(self.beta.detach().cpu().float().item())``, activations.py:250 in 5.0.0), which
    a tensor on the meta device does not have."""
    from transformers import activations

    made = activations.XIELUActivation.__init__

    def reads_its_buffers(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self._beta_scalar = float(self.beta.detach().cpu().float().item())
        self._eps_scalar = float(self.eps.detach().cpu().float().item())

    monkeypatch.setattr(activations.XIELUActivation, "__init__", reads_its_buffers)


def test_a_module_reading_a_buffer_at_build_is_built_on_meta_as_transformers_loads_it(monkeypatch):
    """apertus on 4.56 .. 5.0.0 (atlas 2026-12: 9 library_config entries, "Cannot copy out of meta tensor"): its XIELU
    activation reads a buffer's value at build, so packcheck's meta-device builds (the shrunk parameter count, the
    full-size twin) failed and the cell blamed the config, though the model builds on the CPU. The meta build is
    retried with the parameters alone on meta (buffers on the CPU, as 4.x's from_pretrained builds): the default
    runs, the shrunk model builds and runs a packed row. Planted: the retry removed (the old code) is library_config
    again; a build that fails otherwise is not retried."""
    import torch

    from pytest_packcheck.model import build as B
    from pytest_packcheck.model import twin
    from pytest_packcheck.model.build_errors import LibraryConfigError

    _xielu_500(monkeypatch)
    import transformers

    default = transformers.ApertusConfig()
    with pytest.raises(NotImplementedError, match=twin.META_READ), torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(default)
    assert cf.default_runs(default, "apertus") is None
    full = twin.build_on_meta(lambda: transformers.AutoModelForCausalLM.from_config(default))
    assert {p.device.type for p in full.parameters()} == {"meta"}
    assert sum(p.numel() for p in full.parameters()) > 6.9e9  # full size (6.98e9 on 5.25.0), no memory: all on meta
    resolved = resolve("arch:apertus")
    assert resolved.error is None and resolved.config_source is None
    model = B.build_model(resolved, "eager", "float32")
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    assert torch.isfinite(model(input_ids=torch.randint(0, 100, (1, 12)), position_ids=pos).logits).all()
    with twin.parameters_on_meta():
        assert torch.nn.Linear(2, 3).weight.device.type == "meta"
    assert torch.nn.Linear(2, 3).weight.device.type == "cpu"  # the patch is undone on leaving
    # planted: a build failing otherwise is not retried (the config's own error stays the answer)
    calls = []

    def broken():
        calls.append(1)
        raise NotImplementedError("something else")

    with pytest.raises(NotImplementedError, match="something else"):
        twin.build_on_meta(broken)
    assert calls == [1]

    # planted: no retry (the code before it): the meta builds fail and the cell is library_config
    def meta_only(build):
        with torch.device("meta"):
            return build()

    monkeypatch.setattr(twin, "build_on_meta", meta_only)
    monkeypatch.setattr(B, "build_on_meta", meta_only)
    with pytest.raises(LibraryConfigError, match="Cannot copy out of meta tensor"):
        B.build_model(resolve("arch:apertus"), "eager", "float32")


def test_a_model_whose_own_code_reads_an_attribute_its_module_lacks_is_a_crash_not_library_config(monkeypatch):
    """speech_to_text_2 on 4.51 .. 4.57 (atlas 2026-12: 21 library_config entries): its _init_weights reads ``weight``
    of its Speech2Text2SinusoidalPositionalEmbedding, whose __init__ no longer makes it (modeling_speech_to_text_2.py
    :402 in 4.51.3): no config builds it, so the cell is ``crash`` with the library's words, not ``library_config``.
    Planted on llama: its model's __init__ reads ``weight`` of a module class of the same file that has none. The
    planted fault: a config value left None (``'NoneType' object has no attribute``) stays library_config."""
    import transformers

    from pytest_packcheck.model import build as B
    from pytest_packcheck.model.build_errors import LibraryConfigError
    from pytest_packcheck.run.runner import Cell, CellRunner

    made = transformers.LlamaModel.__init__

    def reads_a_missing_weight(self, config, *args, **kwargs):
        made(self, config, *args, **kwargs)
        self.positions = PlantedPositions()
        self.positions.weight.shape  # noqa: B018 - the read transformers' _init_weights makes

    monkeypatch.setattr(transformers.LlamaModel, "__init__", reads_a_missing_weight)
    resolved = resolve("arch:llama")
    with pytest.raises(LibraryConfigError, match=r"own code reads weight of its module PlantedPositions, which has "
                       r"none, at test_config_fixes\.py:\d+ in reads_a_missing_weight") as raised:
        B.build_model(resolved, "eager", "float32")
    assert raised.value.cause == "crash" and "not its config" in str(raised.value)
    result = CellRunner([resolved], {"float32": {}}).run(Cell(0, "llama", "eager", "isolation", "float32"))
    assert result.status == "error" and result.cause == "crash", (result.cause, result.message)
    assert "'PlantedPositions' object has no attribute 'weight'" in result.message

    # planted: a config value left None (phi4_multimodal's vision_config): the config's, library_config
    def reads_a_none_value(self, config, *args, **kwargs):
        made(self, config, *args, **kwargs)
        config.planted_sub_config = None
        config.planted_sub_config.image_token_id  # noqa: B018

    monkeypatch.setattr(transformers.LlamaModel, "__init__", reads_a_none_value)
    resolved = resolve("arch:llama")
    with pytest.raises(LibraryConfigError, match="at full size either") as raised:
        B.build_model(resolved, "eager", "float32")
    assert raised.value.cause == "library_config"
    result = CellRunner([resolved], {"float32": {}}).run(Cell(0, "llama", "eager", "isolation", "float32"))
    assert result.status == "error" and result.cause == "library_config"
