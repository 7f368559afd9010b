"""Issue 16 (part b): the shrink covers every architecture whose default config builds, keeps every layer kind,
spec config overrides, and the labels of what packcheck measured (its own shrink, the library's config, a
backend it cannot load, an explicit refusal, the attention count)."""

from __future__ import annotations

import pytest

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.model.build import MAX_RANDOM_PARAMS, build_model
from pytest_packcheck.model.build_errors import LibraryConfigError
from pytest_packcheck.model.resolve import resolve_model
from pytest_packcheck.model.shrink import shrink_config
from pytest_packcheck.model.specs import parse_model_spec


def _meta_params(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), model


#: Architectures of transformers 5.24 whose default config builds but whose shrunk config did not (or left the
#: model above the parameter limit) before issue 16: 17 of the 30 shrink errors of the all-architectures audit.
SHRINK_FIXED = ("bamba", "blt", "cwm", "dory", "dots3_note_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text",
                "gemma4_unified_assistant", "iquestcoder", "longcat_flash", "mamba2", "xlnet", "zamba", "zamba2")


@pytest.mark.parametrize("model_type", SHRINK_FIXED)
def test_shrunk_config_builds_small(model_type):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this transformers")
    n_params, _ = _meta_params(shrink_config(CONFIG_MAPPING[model_type]()))
    assert n_params < MAX_RANDOM_PARAMS / 10, f"{model_type}: {n_params / 1e6:.1f}M parameters"


def test_shrink_keeps_per_head_sizes_consistent():
    """gptj / codegen: rotary_dim 64 of a 256 head became 64 of a 16 head (every backend crashed); helium:
    hidden == heads x head_dim is kept (its o_proj assumes it); cwm: hidden a multiple of its 6 heads."""
    from transformers import CONFIG_MAPPING

    for model_type in ("gptj", "codegen"):
        full = CONFIG_MAPPING[model_type]()
        tiny = shrink_config(full)
        head_dim = tiny.n_embd // tiny.n_head
        assert tiny.rotary_dim <= head_dim
        assert tiny.rotary_dim / head_dim == pytest.approx(full.rotary_dim / (full.n_embd // full.n_head), rel=0.5)
    helium = shrink_config(CONFIG_MAPPING["helium"]())
    assert helium.hidden_size == helium.num_attention_heads * helium.head_dim
    cwm = shrink_config(CONFIG_MAPPING["cwm"]())
    assert cwm.hidden_size % cwm.num_attention_heads == 0
    marian = shrink_config(CONFIG_MAPPING["marian"]())  # lm_head and loss use the decoder's vocabulary
    assert marian.decoder_vocab_size == marian.vocab_size == 512
    xlstm = shrink_config(CONFIG_MAPPING["xlstm"]())  # embedding_dim / num_blocks twin hidden_size / the layers
    assert (xlstm.embedding_dim, xlstm.num_blocks) == (xlstm.hidden_size, xlstm.num_hidden_layers) == (64, 2)
    blt = shrink_config(CONFIG_MAPPING["blt"]())  # local encoder / decoder project to and from the global model
    assert blt.encoder_config.hidden_size_global == blt.decoder_config.hidden_size_global == blt.global_config.hidden_size


def test_shrink_keeps_every_layer_kind():
    """per_layer_config overrides (gemma4: head_dim 512 on full-attention layers) survive, scaled; gemma3n's KV
    sharing keeps a producer of each type; zamba keeps two hybrid layers (their weights are shared)."""
    from transformers import CONFIG_MAPPING

    gemma4 = CONFIG_MAPPING["gemma4_text"]()
    tiny = shrink_config(gemma4)
    assert set(tiny.layer_types) == set(gemma4.layer_types)
    full_layers = [i for i, t in enumerate(tiny.layer_types) if t == "full_attention"]
    assert full_layers and all(str(i) in tiny.to_dict()["per_layer_config"] for i in full_layers)
    layer_cfgs = tiny.to_dict()["per_layer_config"]
    assert {cfg["head_dim"] for cfg in layer_cfgs.values()} == {2 * tiny.to_dict()["head_dim"]}  # 512 vs 256
    g3n = shrink_config(CONFIG_MAPPING["gemma3n_text"]())
    first_shared = g3n.num_hidden_layers - g3n.num_kv_shared_layers
    assert 0 < g3n.num_kv_shared_layers < g3n.num_hidden_layers
    assert set(g3n.layer_types[:first_shared]) == set(g3n.layer_types)
    zamba = shrink_config(CONFIG_MAPPING["zamba"]())
    assert zamba.layers_block_type.count("hybrid") == 2


def test_shrink_keeps_layer_kinds_a_config_derives():
    """jamba derives its layer kinds from attn_layer_period 8 / offset 4 and recurrent_gemma from its cycled
    block_types: two shrunk layers were all mamba / all recurrent (no attention layer, so position_ids "ignored"
    and a get_seq_length crash in cache_trap). The shrink adds layers until every kind is there, and says so."""
    from transformers import CONFIG_MAPPING

    jamba_notes: list[str] = []
    jamba = shrink_config(CONFIG_MAPPING["jamba"](), notes=jamba_notes)
    assert set(jamba.layers_block_type) == {"mamba", "attention"} and jamba.num_hidden_layers == 5
    assert [n for n in jamba_notes if not n.startswith("mechanism: ")] == [("shrink: 5 layers instead of 2, so the tiny model has the attention, full_attention "
                            "layer(s) the architecture has")]
    rg = shrink_config(CONFIG_MAPPING["recurrent_gemma"]())
    assert set(rg.layers_block_type) == {"linear_attention", "sliding_attention"} and rg.num_hidden_layers == 3
    llama_notes: list[str] = []  # nothing derived is missing: no extra layers, no note
    assert shrink_config(CONFIG_MAPPING["llama"](), notes=llama_notes).num_hidden_layers == 2 and llama_notes == []


def test_lfm2_default_gets_its_conv_layers_and_says_so():
    """arch:lfm2's default config is all full attention: the cell runs a variant with conv layers (LFM2's
    checkpoints), and the model record says so."""
    resolved = resolve_model(parse_model_spec("arch:lfm2", "t"), "t")
    assert "conv" in resolved.config.layer_types
    notes = resolved.record()["config_notes"]
    assert any("conv" in n and "default config has no" in n for n in notes)
    assert set(shrink_config(resolved.config).layer_types) == {"conv", "full_attention"}
    # the user's own layer_types win: no variant
    own = resolve_model(parse_model_spec('arch:lfm2{layer_types=["full_attention","full_attention"],num_hidden_layers=2}', "t"), "t")
    assert set(own.config.layer_types) == {"full_attention"} and "config_notes" not in own.record()


def test_spec_config_overrides_reach_sub_configs_and_the_record():
    spec = parse_model_spec("arch:dbrx{clip_qkv=8}", "--packcheck-models")
    assert spec.overrides == (("clip_qkv", 8),) and spec.label == "dbrx{clip_qkv=8}"
    resolved = resolve_model(spec, "t")
    assert resolved.config.attn_config.clip_qkv == 8  # dbrx keeps clip_qkv in its attn_config
    assert resolved.record()["config_overrides"] == {"clip_qkv": 8}
    dotted = resolve_model(parse_model_spec("arch:dbrx{attn_config.clip_qkv=4.5}", "t"), "t")
    assert dotted.config.attn_config.clip_qkv == 4.5
    with pytest.raises(PackcheckUsageError, match=r"Bad config override 'clip_qkv' \(in model spec"):
        parse_model_spec("arch:dbrx{clip_qkv}", "--packcheck-models")
    with pytest.raises(PackcheckUsageError, match="'nope' is not a sub-config"):
        resolve_model(parse_model_spec("arch:llama{nope.x=1}", "t"), "t")


def test_an_override_key_no_config_has_warns_with_the_closest():
    """arch:dbrx{clip_qvk=8} (a typo) was accepted silently and the cell crashed as without it."""
    from pytest_packcheck.errors import PackcheckWarning

    with pytest.warns(PackcheckWarning, match=r"Config override 'clip_qvk' .* is not a key of DbrxConfig .*Did you mean 'clip_qkv'"):
        resolve_model(parse_model_spec("arch:dbrx{clip_qvk=8}", "--packcheck-models"), "--packcheck-models")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_model(parse_model_spec("arch:dbrx{clip_qkv=8}", "--packcheck-models"), "--packcheck-models")


def test_packcheck_config_flag_applies_to_every_model():
    from pytest_packcheck.config.options import OPT_CONFIG
    from pytest_packcheck.config.settings import resolve

    options = {"packcheck_models": "arch:llama,arch:dbrx{clip_qkv=8,rope_theta=5}",
               "packcheck_config": ["clip_qkv=2", "initializer_range=0.01"]}
    settings = resolve(lambda dest: options.get(dest), lambda key: None)
    assert settings.models == ("arch:llama{clip_qkv=2,initializer_range=0.01}",
                               "arch:dbrx{clip_qkv=8,initializer_range=0.01,rope_theta=5}")  # the spec's own wins
    assert OPT_CONFIG == "--packcheck-config"
    with pytest.raises(PackcheckUsageError, match=r"Bad config override '=3' \(from --packcheck-config\)"):
        resolve(lambda dest: {"packcheck_models": "arch:llama", "packcheck_config": ["=3"]}.get(dest), lambda key: None)


@pytest.mark.parametrize(("models", "config", "message"), [
    ("arch:llama{a=1,a=2}", [], ("Config key 'a' given twice (in model spec 'arch:llama{a=1,a=2}' from "
                                 "--packcheck-models): a=1 and a=2")),
    ("arch:llama{hidden_act=silu,num_hidden_layers=2,hidden_act=gelu}", [],
     ("Config key 'hidden_act' given twice (in model spec 'arch:llama{hidden_act=silu,num_hidden_layers=2,hidden_act=gelu}' "
      "from --packcheck-models): hidden_act=silu and hidden_act=gelu")),
    ("arch:llama", ["a=1", "a=2"], "Config key 'a' given twice (from --packcheck-config): a=1 and a=2"),
    ("arch:llama", ["a=1,b=3,a= 2"], "Config key 'a' given twice (from --packcheck-config): a=1 and a=2"),
], ids=["spec", "spec_real_key", "config_repeated", "config_one_value"])
def test_a_config_key_given_twice_is_refused_naming_both_values(models, config, message):
    """Before: the last value won with no word (arch:llama{a=1,a=2} ran as llama{a=2}). A spec's own key beside
    --packcheck-config's is no repeat: the spec's wins, as documented."""
    from pytest_packcheck.config.settings import resolve

    options = {"packcheck_models": models, "packcheck_config": config}
    with pytest.raises(PackcheckUsageError) as info:
        if config:
            resolve(lambda dest: options.get(dest), lambda key: None)
        else:
            parse_model_spec(models, "--packcheck-models")
    assert message in str(info.value) and "give each key once" in str(info.value) and "\n" not in str(info.value)
    options = {"packcheck_models": "arch:llama{a=1}", "packcheck_config": ["a=2"]}
    assert resolve(lambda dest: options.get(dest), lambda key: None).models == ("arch:llama{a=1}",)


def test_a_config_key_given_twice_exits_2_on_the_cli(tmp_path):
    from cli_inprocess import packcheck  # the words and the exit code, in this process

    proc = packcheck("audit", "--models", "arch:llama{a=1,a=2}", "-n", "0", "--packcheck-report-dir", tmp_path / "r", cwd=tmp_path)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Config key 'a' given twice" in said and "a=1 and a=2" in said, said[-1500:]


def test_library_default_config_errors_are_named_as_the_librarys(monkeypatch):
    """dots1's default config does not build in transformers 5.24 at full size either: the cell says so, with
    the library_config cause, never "packcheck's shrunk config". (The atlas builds dots1 from the config-fix
    table's values; without that entry the default's own error is the answer.)"""
    from transformers import CONFIG_MAPPING

    from pytest_packcheck.model.config_fixes import CONFIG_FIXES
    from pytest_packcheck.run.runner import Cell, CellRunner

    monkeypatch.delitem(CONFIG_FIXES, "dots1")

    if "dots1" not in CONFIG_MAPPING:
        pytest.skip("no dots1 here")
    resolved = resolve_model(parse_model_spec("arch:dots1", "t"), "t")
    try:
        _meta_params(CONFIG_MAPPING["dots1"]())
    except Exception:  # noqa: BLE001 - the premise: the library's default config does not build
        with pytest.raises(LibraryConfigError, match="does not build in transformers itself"):
            build_model(resolved, "sdpa", "float32")
        result = CellRunner([resolved], {"float32": {}}).run(Cell(0, "dots1", "sdpa", "isolation", "float32"))
        assert result.status == "error" and result.cause == "library_config"
        assert "packcheck's shrunk" not in result.message
    else:
        pytest.skip("dots1's default config builds in this transformers")


def test_required_values_the_default_leaves_none_are_filled_and_recorded():
    """hunyuan_v1_dense's default config leaves head_dim None (its attention computes head_dim ** -0.5)."""
    resolved = resolve_model(parse_model_spec("arch:hunyuan_v1_dense", "t"), "t")
    model = build_model(resolved, "sdpa", "float32")
    assert model.config.head_dim == model.config.hidden_size // model.config.num_attention_heads
    assert any(n.startswith("head_dim=") for n in resolved.record()["config_notes"])


def test_labels_of_a_failed_cell():
    """A crash in a model packcheck shrank says so; falcon's flash path without flash-attn cannot load the
    backend (skipped); an explicit 'cannot be run on CPU' refusal is unsupported."""
    from pytest_packcheck.run.runner import CellRunner

    runner = CellRunner([], {"float32": {}})
    runner._key = (0, "packcheck_flash_ref", "float32")
    name_error = NameError("name '_flash_attention_forward' is not defined", name="_flash_attention_forward")
    skipped = runner._failed("check", name_error)
    assert skipped.status == "skipped" and skipped.message.startswith("cannot load this backend")
    runner._key = (0, "sdpa", "float32")
    assert runner._failed("check", NameError("name 'x' is not defined", name="x")).cause == "shrunk_crash"
    crash = runner._failed("check", RuntimeError("The size of tensor a (16) must match the size of tensor b (64)"))
    assert crash.status == "error" and crash.cause == "shrunk_crash" and "packcheck shrank" in crash.message
    runner.weights = "pretrained"
    assert runner._failed("check", RuntimeError("boom")).cause is None  # a real model's crash is a plain crash
    runner._key = (0, "flex_attention", "float32")
    sinks = ValueError("Attention sinks cannot be run on CPU with flex attention. Please switch to a different device")
    assert runner._failed("check", sinks).status == "unsupported"
    assistant = ValueError("inputs_embeds and shared_kv_states cannot be None.")
    assert runner._failed("check", assistant).status == "unsupported"
    from pytest_packcheck.analysis.diagnose import remedy
    from pytest_packcheck.checks.registry import CAUSES

    cell = {"backend": "sdpa", "check": "isolation", "metrics": {}}
    for cause in ("shrunk_crash", "shrink_limit", "library_config"):
        assert cause in CAUSES and remedy(cause, cell, {"transformers": "5.24.0"}), cause


def test_a_crash_the_unshrunk_config_shares_is_the_librarys(monkeypatch):
    """arch:dbrx on 5.24: the tiny model crashes in torch.clamp (clip_qkv None) and the unshrunk default config
    does not even build (no rope_theta in attn_config): library_config, not shrunk_crash. gemma4_assistant's
    default config fails validation: library_config at resolution. A crash the full-size model does not share
    stays shrunk_crash. (The atlas builds dbrx from the config-fix table's values; without that entry the
    default's own error is the answer.)"""
    from pytest_packcheck.model.config_fixes import CONFIG_FIXES
    from pytest_packcheck.run.runner import CellRunner

    monkeypatch.delitem(CONFIG_FIXES, "dbrx")
    monkeypatch.delitem(CONFIG_FIXES, "gemma4_assistant")
    dbrx = resolve_model(parse_model_spec("arch:dbrx", "t"), "t")
    llama = resolve_model(parse_model_spec("arch:llama", "t"), "t")
    runner = CellRunner([dbrx, llama], {"float32": {}})
    runner._key = (0, "sdpa", "float32")
    clamp = RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    got = runner._failed("check", clamp)
    assert got.cause == "library_config" and "the unshrunk config does not build (AttributeError" in got.message
    runner._key = (1, "sdpa", "float32")  # llama's full-size forward on meta runs: the shrink stays suspect
    assert runner._failed("check", RuntimeError("The size of tensor a (4096) must match the size of tensor b (64)")).cause == "shrunk_crash"
    from transformers import LlamaForCausalLM

    from pytest_packcheck.model.twin import unshrunk_forward_reproduces

    def crashes(self, *args, **kwargs):  # planted: the full-size forward fails like the tiny one, at its sizes
        raise RuntimeError(f"size {self.config.hidden_size} does not match")

    monkeypatch.setattr(LlamaForCausalLM, "forward", crashes)
    assert unshrunk_forward_reproduces(llama, RuntimeError("size 64 does not match")) == "the unshrunk config raises it too"
    assert unshrunk_forward_reproduces(llama, ValueError("size 64 does not match")) is None  # another type
    assert unshrunk_forward_reproduces(llama, RuntimeError("another error")) is None
    assistant = resolve_model(parse_model_spec("arch:gemma4_assistant", "t"), "t")
    if assistant.error:  # 5.24's default does not validate
        assert assistant.error_cause == "library_config" and "transformers' own default config" in assistant.error


def test_models_without_declared_flash_support_refuse_the_flash_stand_ins():
    """bloom declares _supports_flash_attn = False: transformers refuses flash_attention_2 for it, and packcheck's
    stand-ins (registered through AttentionInterface, which checks nothing) were built anyway and crashed on the
    2-D flash mask (22 shrunk_crash cells of the all-architectures audit). Now unsupported, named; llama builds."""
    from pytest_packcheck.backends import REFERENCE_BACKEND, register_reference_backend
    from pytest_packcheck.run.runner import CellRunner

    register_reference_backend()
    bloom = resolve_model(parse_model_spec("arch:bloom", "t"), "t")
    with pytest.raises(ValueError, match="BloomForCausalLM does not support flash attention .*_supports_flash_attn = False") as info:
        build_model(bloom, REFERENCE_BACKEND, "float32")
    runner = CellRunner([bloom], {"float32": {}})
    runner._key = (0, REFERENCE_BACKEND, "float32")
    assert runner._failed("build", info.value).status == "unsupported"
    assert build_model(bloom, "eager", "float32") is not None  # other backends are not touched
    llama = resolve_model(parse_model_spec("arch:llama", "t"), "t")
    assert build_model(llama, REFERENCE_BACKEND, "float32") is not None


def test_flash_boundaries_past_the_row_are_a_fail_of_the_flash_path():
    """GLM-4.5V / ERNIE-4.5-VL on 5.24 derive cu_seq_lens from their 3 M-RoPE rows: [0, 11, 18, 31, ..., 93] for a
    31-token row. The reference kernel refuses values that do not fit the row (FlashAttention-2 would read past
    it); the cell is a fail with cause flash_boundaries and the boundaries, not a crash of packcheck's shrink."""
    import torch

    from pytest_packcheck.analysis.diagnose import remedy
    from pytest_packcheck.backends import FlashBoundariesError, varlen_reference_kernel
    from pytest_packcheck.run.runner import CellRunner

    q = torch.randn(31, 2, 16)
    fits = torch.tensor([0, 11, 18, 31], dtype=torch.int32)
    assert varlen_reference_kernel(q, q, q, fits, fits, 13, 13, causal=True).shape == q.shape
    for bad in ([0, 11, 18, 31, 42, 49, 62, 73, 80, 93], [0, 18, 11, 31], [1, 11, 18, 31]):
        cu = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(FlashBoundariesError) as info:
            varlen_reference_kernel(q, q, q, cu, cu, 13, 13, causal=True)
        assert info.value.boundaries == bad and info.value.total == 31
    runner = CellRunner([], {"float32": {}})
    runner._key = (0, "packcheck_flash_ref", "float32")
    result = runner._failed("check", info.value)
    assert result.status == "fail" and result.cause == "flash_boundaries"
    assert result.evidence == {"cu_seqlens": [1, 11, 18, 31], "tokens": 31}
    assert "cu_seqlens_q=[1, 11, 18, 31] for a row of 31 tokens" in result.message
    assert "flash backend" in remedy("flash_boundaries", {"backend": "packcheck_flash_ref", "check": "isolation", "metrics": {}}, {})


def test_backend_count_follows_the_attention_modules_that_run(tolerances):
    """diffllama dispatches twice per attention module (differential attention): a pass. A module that runs
    but never dispatches is still a call_count failure; a module that never runs (a vision tower) is not
    expected."""
    import torch
    from conftest import make_bench

    from pytest_packcheck import checks as C

    diff = make_bench("diffllama", "sdpa", tolerances)
    result = C.check_backend(diff)
    assert result.status == "pass", result.message
    assert result.metrics["calls"]["sdpa"] == 2 * result.metrics["attention_module_runs"]

    bench = make_bench("llama", "sdpa", tolerances)

    class SilentAttention(torch.nn.Module):  # runs, dispatches nothing
        def forward(self, hidden_states, *args, **kwargs):
            return torch.zeros_like(hidden_states), None

    class IdleAttention(torch.nn.Module):  # never called
        def forward(self, *args, **kwargs):
            raise AssertionError("not on the text path")

    class ShortConvDeltaAttention(torch.nn.Module):  # a linear-attention mixer: its own state, no dispatch
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3)

        def forward(self, hidden_states):
            return hidden_states

    mixer = ShortConvDeltaAttention()
    bench.model.model.idle = torch.nn.ModuleList([IdleAttention(), mixer])
    bench.model.model.norm.register_forward_pre_hook(lambda module, args: (mixer(args[0]),))
    assert C.check_backend(bench).status == "pass"  # the idle module is found, not expected; the mixer not either
    bench.model.model.layers[0].self_attn = SilentAttention()
    failed = C.check_backend(bench)
    assert failed.status == "fail" and failed.cause == "call_count", failed.message


def test_any_attn_implementation_transformers_takes():
    """Names outside packcheck's list run when transformers takes them (paged|sdpa, a registry name), are skipped
    with transformers' own reason when it knows but cannot load them (a kernel-hub repo without `kernels`), and
    a name it does not know is a usage error quoting it."""
    from pytest_packcheck.backends import attn_implementation_refusal, backend_availability
    from pytest_packcheck.config.settings import resolve

    def settings(attn):
        return resolve(lambda dest: {"packcheck_models": "arch:llama", "packcheck_attn": attn}.get(dest), lambda key: None)

    assert settings("paged|sdpa,sdpa").backends == ("paged|sdpa", "sdpa")
    assert backend_availability("paged|sdpa").available
    with pytest.raises(PackcheckUsageError, match=r"Unknown backend 'sdpaa' \(from --packcheck-attn\).*does not take it"):
        settings("sdpaa")
    with pytest.raises(PackcheckUsageError) as bogus:  # transformers' long list is quoted by its first sentence, whole words
        settings("bogus_attn")
    quoted = str(bogus.value).split("(ValueError: ", 1)[1].split("). Expected", 1)[0]
    assert quoted.endswith("is not supported") and "`\"att" not in str(bogus.value), quoted
    hub = "kernels-community/flash-attn"
    refusal = attn_implementation_refusal(hub)
    if refusal is not None:  # no `kernels` package here: skipped with transformers' words, not a usage error
        assert settings(hub).backends == (hub,)
        avail = backend_availability(hub)
        assert not avail.available and avail.status == "skipped" and refusal[1] in avail.reason


def test_paged_prefix_runs_the_checks(tolerances):
    from conftest import make_bench

    from pytest_packcheck import checks as C

    bench = make_bench("llama", "paged|sdpa", tolerances)
    result = C.check_backend(bench)
    assert result.status == "pass", result.message
    assert C.check_isolation(bench).status == "pass"


def test_an_override_value_is_copied_into_the_config():
    """A dict override (4.x's rope_scaling) is copied: transformers 5.x standardises the dict it is given in place
    (rope_type, rope_theta added), which changed the spec's own value and label, so a version environment's cells
    no longer matched the parent's and every cell was lost."""
    spec = parse_model_spec('arch:qwen2_vl{rope_scaling={"type":"mrope","mrope_section":[16,24,24]}}', "t")
    label = spec.label
    resolve_model(spec, "t")
    assert spec.label == label and dict(spec.overrides)["rope_scaling"] == {"type": "mrope", "mrope_section": [16, 24, 24]}


def test_a_tolerance_override_for_a_dtype_the_run_does_not_measure_is_warned():
    """--packcheck-tolerance bfloat16.logits_atol=1 on a float32-only run changed nothing, silently (trial 3, U3)."""
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.errors import PackcheckWarning

    def settings(overrides, dtypes=None):
        values = {"packcheck_models": "arch:llama", "packcheck_tolerance": overrides, "packcheck_dtypes": dtypes}
        return resolve(lambda dest: values.get(dest), lambda key: None)

    with pytest.warns(PackcheckWarning, match=r"'bfloat16.logits_atol=1' \(from --packcheck-tolerance\) sets a dtype "
                                              r"this run does not measure \(dtypes: float32\).*--packcheck-dtypes float32,bfloat16"):
        assert settings(["bfloat16.logits_atol=1"]).tolerances["bfloat16"]["logits_atol"] == 1.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", PackcheckWarning)  # a measured dtype, or every dtype: no warning
        settings(["float32.logits_atol=1", "loss_atol=1"])
        settings(["bfloat16.logits_atol=1"], "float32,bfloat16")


def test_codegen_keeps_whole_heads_on_each_of_its_four_shards(tolerances):
    """CodeGen splits its fused qkv across mp_num=4 shards (hard-coded) and transformers 4.44 .. 5.19 reshape each
    to n_head // 4 heads: the shrink's 2 heads gave "shape '[1, 31, 4, 0, 16]' is invalid for input of size 992"
    (shrunk_crash on every release). That reshape, replayed on the shrunk sizes, and the tiny model judged on 5.24."""
    import torch
    from transformers import CONFIG_MAPPING

    from pytest_packcheck import checks as C
    from pytest_packcheck.model.shrink import HEAD_MULTIPLES

    tiny = shrink_config(CONFIG_MAPPING["codegen"]())
    mp_num, head_dim = HEAD_MULTIPLES["codegen"], tiny.n_embd // tiny.n_head
    assert tiny.n_head % mp_num == 0 and head_dim * tiny.n_head == tiny.n_embd and tiny.rotary_dim <= head_dim
    qkv = torch.zeros(1, 31, 3 * tiny.n_embd).reshape(1, 31, mp_num, -1)  # modeling_codegen 4.44 .. 5.19
    query = qkv.split(head_dim * tiny.n_head // mp_num, dim=-1)[0]
    assert query.reshape(1, 31, mp_num, tiny.n_head // mp_num, head_dim).shape[-2] >= 1
    from conftest import make_bench

    bench = make_bench("codegen", "sdpa", tolerances)
    assert bench.model.config.n_head == tiny.n_head
    got = C.check_isolation(bench)
    assert got.status == "pass" and got.metrics["negative_control_change"] > tolerances["float32"]["leak_min"], got.message


def test_gits_text_only_loss_is_the_librarys_not_the_shrinks():
    """arch:git: its loss slices the logits from the image tokens on (``logits[:, 197:-1]`` at full size), empty on
    a text-only row: "Expected input batch_size (0) to match target batch_size (30)" on every release. The meta
    twin called the forward without labels (and the packed position_ids stop git's mask on meta), so the cell was
    shrunk_crash. Now the twin also calls it with labels: the unshrunk model raises it too "(with labels)", and
    model/needs_inputs.py names what git needs (its image tokens): unsupported / needs_inputs, not library_config.
    Planted: the table without git's entry: library_config, as before it."""
    from pytest_packcheck.model import needs_inputs as N
    from pytest_packcheck.run.runner import Cell, CellRunner

    git = resolve_model(parse_model_spec("arch:git", "t"), "t")
    result = CellRunner([git], {"float32": {}}).run(Cell(0, "git", "eager", "isolation", "float32"))
    assert result.status == "unsupported" and result.cause == "needs_inputs", result.message
    assert "needs inputs packcheck does not give: pixel_values" in result.message
    assert "Expected input batch_size (0) to match target batch_size" in result.message
    assert result.evidence["unshrunk"] == "the unshrunk config raises it too (with labels)"
    planted = pytest.MonkeyPatch()
    planted.setattr(N, "NEEDS_INPUTS", tuple(n for n in N.NEEDS_INPUTS if n.model_type != "git"))
    try:
        bare = CellRunner([git], {"float32": {}}).run(Cell(0, "git", "eager", "isolation", "float32"))
    finally:
        planted.undo()
    assert bare.status == "error" and bare.cause == "library_config", bare.message


def test_needs_inputs_matches_the_librarys_words_for_its_own_model_type_only():
    """The table's patterns, on the messages the atlas recorded (transformers 5.0 .. 5.25): gemma3's token_type_ids,
    musicgen's labels per codebook, musicgen_melody's input_ids per codebook. Planted: the same message from another
    model type (a llama's batch mismatch is no input contract packcheck knows) matches nothing."""
    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.model.needs_inputs import needed_inputs

    assert "needs_inputs" in CAUSE_RECORDS
    gemma = needed_inputs("gemma3", "ValueError: `token_type_ids` is required as a model input when training")
    assert gemma is not None and gemma.inputs == "token_type_ids"
    mismatch = "Expected input batch_size (31) to match target batch_size (1)."
    assert "codebook" in needed_inputs("musicgen", mismatch).inputs
    assert "codebook" in needed_inputs("musicgen_melody", "shape '[-1, 4, 31]' is invalid for input of size 31").inputs
    assert needed_inputs("git", mismatch) is None  # git's is a batch of 0 (its loss skips the image tokens)
    assert needed_inputs("llama", mismatch) is None and needed_inputs("gemma3", mismatch) is None


def test_encoder_families_causal_heads_are_built_as_decoders(tolerances):
    """arch:bert (and roberta, camembert, xlm-roberta, ...): BertLMHeadModel attends both ways unless is_decoder=True
    (transformers warns), which the shrink never set: causality non_causal, and the isolation probe's planted leak
    (7.29e-04) under leak_min on packcheck_flash_ref, probe_inconclusive. Now built as a decoder: causal, and the
    planted leak clears leak_min, so the flash path's isolation is judged."""
    from conftest import make_bench

    from pytest_packcheck import checks as C
    from pytest_packcheck.backends import REFERENCE_BACKEND, register_reference_backend

    register_reference_backend()
    bench = make_bench("bert", REFERENCE_BACKEND, tolerances)
    assert bench.model.config.is_decoder is True
    causal, iso = C.check_causality(bench), C.check_isolation(bench)
    assert causal.status == "pass" and causal.metrics["max_change_earlier"] == 0.0, causal.message
    assert iso.status == "pass" and iso.metrics["negative_control_change"] > tolerances["float32"]["leak_min"], iso.message
    # sdpa on bert: transformers before 5.25.0 builds no packed mask for it (the boundaries are ignored, the planted
    # leak is caught: fail); 5.25.0 builds packed masks from position_ids for these models (create_bidirectional_mask
    # and the decoder path alike), so the same cell isolates. The release each outcome holds for is named.
    import transformers
    from packaging.version import Version

    sdpa = C.check_isolation(make_bench("bert", "sdpa", tolerances))
    expected = "fail" if Version(transformers.__version__) < Version("5.25.0") else "pass"
    assert sdpa.status == expected, f"transformers {transformers.__version__}: bert sdpa isolation {sdpa.status}: {sdpa.message}"


def test_the_reproduce_line_carries_the_tolerances_the_run_was_judged_with():
    """A pytest run with --packcheck-tolerance float32.logits_atol=1e-9 failed; its Reproduce line left the override
    out, so rerunning it passed (trial 6, 32). Every tolerance of a measured dtype off the shipped default is in it."""
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.config.tolerances import load_tolerances

    values = {"packcheck_models": "arch:llama", "packcheck_tolerance": ["float32.logits_atol=1e-9"]}
    settings = resolve(lambda dest: values.get(dest), lambda key: None)
    flags = settings.reproduce_flags()
    assert "--packcheck-tolerance=float32.logits_atol=1e-09" in flags and not any("bfloat16" in f for f in flags)
    again = [f.split("=", 1)[1] for f in flags if f.startswith("--packcheck-tolerance=")]
    assert load_tolerances(None, again, "test")[0] == settings.tolerances  # the line resolves to the same tolerances
    plain = resolve(lambda dest: {"packcheck_models": "arch:llama"}.get(dest), lambda key: None)
    assert not any(f.startswith("--packcheck-tolerance") for f in plain.reproduce_flags())
