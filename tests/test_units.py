"""Unit tests of the pure modules: specs, config shrinking, tolerances, rendering, the reference kernel."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_packcheck.backends import varlen_reference_kernel
from pytest_packcheck.config.audits import load_audit
from pytest_packcheck.config.tolerances import load_tolerances
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.model.resolve import resolve_model
from pytest_packcheck.model.shrink import shrink_config
from pytest_packcheck.model.specs import parse_model_spec
from pytest_packcheck.report import cell_status, render_details, render_markdown
from pytest_packcheck.results.schema import SCHEMA_VERSION, CellResult, build_document, load_document


def test_parse_specs():
    assert parse_model_spec("meta-llama/Llama-3.2-1B@abc123", "t").revision == "abc123"
    assert parse_model_spec("arch:qwen3", "t").kind == "arch"
    # two slashes: only a path can look like that, so a missing one is "no such folder", not a Hub lookup
    with pytest.raises(PackcheckUsageError, match="No such folder 'a/b/c' \\(from t\\)"):
        parse_model_spec("a/b/c", "t")


def test_default_audit_lists_the_announced_architectures():
    audit = load_audit("default")
    names = {m.removeprefix("arch:").split("{")[0] for m in audit.models}  # dbrx{clip_qkv=8}: an override, same architecture
    assert {"llama", "mistral", "dbrx", "falcon", "qwen3_next", "mamba", "deepseek_v3"} <= names and len(names) == 26


def test_shrink_keeps_attention_features(offline_hub):
    from pytest_packcheck.model.specs import parse_model_spec as p

    gemma = resolve_model(p("google/gemma-2-2b-it", "t"), "t").config
    tiny = shrink_config(gemma)
    assert tiny.num_attention_heads // tiny.num_key_value_heads == gemma.num_attention_heads // gemma.num_key_value_heads
    assert set(tiny.layer_types) == {"sliding_attention", "full_attention"}
    assert tiny.sliding_window == 8 and tiny.attn_logit_softcapping == gemma.attn_logit_softcapping
    assert tiny.head_dim == 16 and tiny.vocab_size == 512
    assert gemma.num_hidden_layers == 26  # the original is untouched
    qwen = resolve_model(p("Qwen/Qwen2.5-0.5B", "t"), "t").config
    tq = shrink_config(qwen)
    assert tq.num_attention_heads // tq.num_key_value_heads == 7  # 14 / 2 heads: GQA ratio kept
    llama = resolve_model(p("meta-llama/Llama-3.2-1B", "t"), "t")
    assert shrink_config(llama.config).rope_parameters["rope_type"] == "llama3"
    assert llama.revision == offline_hub["meta-llama/Llama-3.2-1B"]


def test_shrink_keeps_hybrid_and_mla_layers():
    from transformers import CONFIG_MAPPING

    nxt = shrink_config(CONFIG_MAPPING["qwen3_next"]())
    assert set(nxt.layer_types) == {"linear_attention", "full_attention"}
    ds = shrink_config(CONFIG_MAPPING["deepseek_v3"]())
    assert ds.kv_lora_rank == 32 and ds.qk_head_dim == ds.qk_rope_head_dim + ds.qk_nope_head_dim


def test_tolerances_override_and_errors(tmp_path):
    tol, label = load_tolerances(None, ["float32.logits_atol=1e-3", "loss_atol=2"], "t")
    assert tol["float32"]["logits_atol"] == 1e-3 and tol["bfloat16"]["loss_atol"] == 2.0 and "logits_atol" in label
    bad = tmp_path / "tol.toml"
    bad.write_text("[float32]\nlogit_atol = 1\n")
    with pytest.raises(PackcheckUsageError, match="unknown key float32.logit_atol.*Did you mean 'logits_atol'"):
        load_tolerances(str(bad), [], "t")


def test_an_unknown_dtype_is_never_offered_a_lower_precision(tmp_path):
    """`--packcheck-dtypes=float64` and a tolerance table [float64] got "Did you mean 'float16'?" (difflib's
    look-alike): a suggestion that drops precision. The nearest precision packcheck has is float32."""
    from pytest_packcheck.config.options import DTYPES
    from pytest_packcheck.config.settings import _validate_names
    from pytest_packcheck.errors import closest

    with pytest.raises(PackcheckUsageError, match=r"Unknown dtype 'float64' \(from --packcheck-dtypes\).*Did you mean 'float32'\?"):
        _validate_names(["float64"], DTYPES, "dtype", "--packcheck-dtypes")
    table = tmp_path / "tol.toml"
    table.write_text("[float64]\nlogits_atol = 1e-9\n")
    with pytest.raises(PackcheckUsageError, match=r"unknown dtype table \[float64\].*Did you mean 'float32'\?"):
        load_tolerances(str(table), [], "t")
    with pytest.raises(PackcheckUsageError, match=r"unknown dtype 'float64'.*Did you mean 'float32'\?"):
        load_tolerances(None, ["float64.logits_atol=1"], "t")
    assert closest("flaot16", DTYPES) == " Did you mean 'float16'?"  # a typo: still difflib's


def test_reference_kernel_matches_sdpa_per_segment():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = varlen_reference_kernel(q, k, v, cu, cu, 5, 5, causal=True)
    for s, e in [(0, 4), (4, 9)]:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0), v[s:e].transpose(0, 1).repeat_interleave(2, 0), is_causal=True
        ).transpose(0, 1)
        assert torch.allclose(out[s:e], ref, atol=1e-6)


@pytest.mark.parametrize(("cu", "match"), [(torch.tensor([0, 4, 9]), "int32"), (torch.tensor([1, 9], dtype=torch.int32), "start at 0")])
def test_reference_kernel_rejects_bad_cu_seqlens(cu, match):
    q = torch.randn(9, 2, 8)
    with pytest.raises(ValueError, match=match):
        varlen_reference_kernel(q, q, q, cu, cu, 9, 9)


def _cell(**kw):
    base = {"cell_id": "m-sdpa-isolation-float32", "model": {"label": "m", "model_type": "llama", "model_class": "L", "revision": None},
                "backend": "sdpa", "check": "isolation", "dtype": "float32", "status": "pass", "metrics": {"max_change": 0.0}, "message": "ok"}
    base.update(kw)
    return CellResult(**base)


def test_markdown_escapes_model_strings_and_backs_verdicts_with_numbers():
    evil = _cell(status="error", message="boom | <script>alert(1)</script> [x](http://evil)",
                 model={"label": "a|b", "model_type": "llama", "model_class": "L", "revision": None})
    doc = build_document([_cell(), evil, _cell(cell_id="m-sdpa-grad_parity-float32", check="grad_parity", status="fail",
                                               metrics={"grad_rel_err": 0.25}, message="gradients differ")],
                         {"transformers": "5.24.0", "torch": "2.13.0"}, {"backends": ["sdpa"], "checks": ["isolation", "grad_parity"]}, "pytest x")
    md = render_markdown(doc) + render_details(doc)
    assert "<script>" not in md and "[x](http" not in md and "\\[x\\]" in md and "a\\|b" in md
    assert "rel 2.5e-01" in md and "Δ 0.0e+00" in md and "5.24.0" in md and "pytest x" in md


def test_cell_status_ignores_skipped_unless_all_skipped():
    assert cell_status(["pass", "skipped"]) == "pass"
    assert cell_status(["skipped", "skipped"]) == "skipped"
    assert cell_status(["pass", "fallback", "fail"]) == "fail"


def test_load_document_schema(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "cells": []}))
    with pytest.raises(PackcheckUsageError, match=f"schema_version {SCHEMA_VERSION + 1}, newer than {SCHEMA_VERSION}"):
        load_document(p)
    p.write_text("{not json")
    with pytest.raises(PackcheckUsageError, match="not valid JSON"):
        load_document(p)
    for version, kind in (('"2"', "a string"), ("true", "a boolean"), ("2.0", "a number with a fraction")):
        p.write_text(f'{{"schema_version": {version}, "cells": []}}')  # true was read as version 1
        with pytest.raises(PackcheckUsageError, match=f'"schema_version" is {version} \\({kind}, expected an integer'):
            load_document(p)
    p.write_text('{"cells": []}')
    with pytest.raises(PackcheckUsageError, match="has no schema_version: it was not written by packcheck"):
        load_document(p)


def test_oversized_shrunk_model_is_refused_before_allocation(monkeypatch, tolerances):
    """A config the shrink cannot make tiny is an error cell (counted on the meta device), never an OOM kill."""
    from pytest_packcheck.model import build
    from pytest_packcheck.run.runner import Cell, CellRunner

    monkeypatch.setattr(build, "MAX_RANDOM_PARAMS", 1000)
    resolved = resolve_model(parse_model_spec("arch:llama", "t"), "t")
    result = CellRunner([resolved], tolerances).run(Cell(0, "llama", "sdpa", "isolation", "float32"))
    assert result.status == "error" and "shrink left llama at" in result.message and "limit" in result.message


def test_tolerance_file_and_override_errors_name_the_problem(tmp_path):
    from pytest_packcheck.config.tolerances import load_tolerances

    cases = [("logits_atol = 1\n", "top-level key 'logits_atol'"),
             ("[float32]\nisolation_atol = nan\n", "must be a finite number >= 0"),
             ("[float32]\nisolation_atol = inf\n", "must be a finite number >= 0"),
             ("[fp32]\nlogits_atol = 1\n", "unknown dtype table [fp32]"),
             ("[float32]\ngrad_cos_min = 2\n", "float32.grad_cos_min = 2 * must be a number from -1 to 1"),
             ("[bfloat16]\ngrad_cos_min = -1.5\n", "must be a number from -1 to 1"),
             # a file that sets nothing ran on the defaults while the report named it as the source
             ("", "sets no tolerance * [float32] then logits_atol = 1e-4"),
             ("# nothing yet\n[float32]\n", "sets no tolerance")]
    for text, message in cases:
        path = tmp_path / "tol.toml"
        path.write_text(text)
        with pytest.raises(PackcheckUsageError) as exc:
            load_tolerances(str(path), [], "--packcheck-tolerances")
        assert all(part in str(exc.value) for part in message.split(" * ")) and "--packcheck-tolerances" in str(exc.value)
    for item, message in [("logits_atol", "write [dtype.]key=value"), ("fp32.logits_atol=1", "unknown dtype 'fp32'"),
                          ("float32.logits_atol=nan", "needs a finite number >= 0, got 'nan'"),
                          ("grad_cos_min=1.01", "needs a number from -1 to 1, got '1.01'")]:
        with pytest.raises(PackcheckUsageError, match=message.replace("[", r"\[").replace(".", r"\.")):
            load_tolerances(None, [item], "x")
    assert load_tolerances(None, ["grad_cos_min=-1"], "x")[0]["float32"]["grad_cos_min"] == -1.0  # the bound itself is a cosine


def test_audit_file_lists_must_be_lists(tmp_path):
    from pytest_packcheck.config.audits import load_audit

    path = tmp_path / "a.toml"
    path.write_text('[audit]\nmodels = "arch:llama"\n')
    with pytest.raises(PackcheckUsageError, match="'models' must be a list of strings"):
        load_audit(str(path))
    for key in ("backends", "checks", "dtypes", "versions"):  # empty is never "every backend"
        path.write_text(f'[audit]\nname = "x"\nmodels = ["arch:llama"]\n{key} = []\n')
        with pytest.raises(PackcheckUsageError, match=f"Audit file {path}: '{key}' is empty: list at least one, or leave '{key}' out"):
            load_audit(str(path))
    path.write_text('[audit]\nmodels = []\n')
    with pytest.raises(PackcheckUsageError, match="lists no models"):
        load_audit(str(path))


def test_an_audit_that_is_a_directory_is_named_as_one(tmp_path):
    from pytest_packcheck.config.audits import load_audit

    with pytest.raises(PackcheckUsageError) as exc:
        load_audit(str(tmp_path))  # was "Audit '...' not found (looked for ...)" for a folder that is there
    assert f"Audit '{tmp_path}' is a directory: give an audit TOML file" in str(exc.value) and "not found" not in str(exc.value)


def test_timeout_must_be_finite():
    from pytest_packcheck.config.settings import resolve

    for value in ("inf", "1e400", "nan", "-1", "10000000"):
        with pytest.raises(PackcheckUsageError, match=f"Bad timeout '{value}'"):
            resolve(lambda dest, v=value: {"packcheck_models": "arch:llama", "packcheck_timeout": v}.get(dest), lambda key: None)


def test_softcapped_model_on_torch_varlen_is_unsupported_not_silently_unsoftcapped(monkeypatch, tolerances):
    """varlen_attn has no softcap. transformers 5.17 drops a kwarg the kernel does not declare (gemma2 would run
    unsoftcapped and pass), 5.24 refuses it: the kernel declares softcap and refuses it, so both are unsupported."""
    from pytest_packcheck.backends import STAND_IN_ENV, TORCH_VARLEN_BACKEND
    from pytest_packcheck.run.runner import Cell, CellRunner

    monkeypatch.setenv(STAND_IN_ENV, "1")
    resolved = resolve_model(parse_model_spec("arch:gemma2", "t"), "t")
    assert resolved.config.attn_logit_softcapping  # the real default config softcaps
    result = CellRunner([resolved], tolerances).run(Cell(0, "gemma2", TORCH_VARLEN_BACKEND, "logits_parity", "float32"))
    assert result.status == "unsupported", result.message
    assert "torch varlen_attn does not support `softcap`" in result.message  # ours, not 5.24's own refusal


def test_model_with_a_fixed_attention_table_is_unsupported(monkeypatch, tolerances):
    """falcon on 5.17 looks its attention class up by name (FALCON_ATTENTION_CLASSES[...]): a KeyError naming the
    backend at build time is the model refusing the backend, not a crash. Another KeyError stays an error."""
    from pytest_packcheck.run import runner
    from pytest_packcheck.run.runner import Cell, CellRunner

    resolved = resolve_model(parse_model_spec("arch:llama", "t"), "t")
    cells = CellRunner([resolved], tolerances)
    monkeypatch.setattr(runner.CellRunner, "workbench", lambda self, cell: {}[cell.backend])
    refused = cells.run(Cell(0, "llama", "sdpa", "isolation", "float32"))
    assert refused.status == "unsupported" and "fixed table by name (KeyError: 'sdpa')" in refused.message
    monkeypatch.setattr(runner.CellRunner, "workbench", lambda self, cell: {}["rope_theta"])
    assert cells.run(Cell(0, "llama", "sdpa", "isolation", "float32")).status == "error"


def test_backend_key_number_shows_which_flash_kernel_ran():
    """'2/2 calls, varlen 2 / dense 0' where both kernels were counted; results written before the dense kernel
    was counted show no dense figure rather than an unmeasured 0."""
    from pytest_packcheck.report import key_number

    cell = {"check": "backend", "metrics": {"calls": {"packcheck_flash_ref": 2}, "expected_calls": 2,
                                            "varlen_kernel_calls": 2, "dense_kernel_calls": 0}}
    assert key_number(cell) == "2/2 calls, varlen 2 / dense 0"
    dense = {**cell, "metrics": {**cell["metrics"], "varlen_kernel_calls": 0, "dense_kernel_calls": 2}}
    assert key_number(dense) == "2/2 calls, varlen 0 / dense 2"
    old = {**cell, "metrics": {k: v for k, v in cell["metrics"].items() if k != "dense_kernel_calls"}}
    assert key_number(old) == "2/2 calls"
    sdpa = {"check": "backend", "metrics": {"calls": {"sdpa": 2}, "expected_calls": 2, "varlen_kernel_calls": 0, "dense_kernel_calls": 0}}
    assert key_number(sdpa) == "2/2 calls"
    # trial 12, 3: opt's fail (boundaries missing in 2 of 2 calls) showed "2/2 calls", as a pass does
    leaky = {"check": "backend", "metrics": {**sdpa["metrics"], "boundaries_missing": 2}}
    assert key_number(leaky) == "2/2 calls, boundaries missing in 2"


def test_a_revision_pins_the_snapshot_its_config_is_read_from(two_snapshots):
    """Two snapshots of one repo in the offline cache: ``org/name@<sha>`` and ``org/name@<branch>`` read the old
    snapshot's config.json (3 layers, rope_theta 10000) and record its SHA; the bare ID reads main's."""
    from pytest_packcheck.model.specs import parse_model_spec as p

    repo, main, old = two_snapshots["repo"], two_snapshots["main"], two_snapshots["old"]
    assert main != old
    latest = resolve_model(p(repo, "t"), "t")
    assert latest.revision == main and latest.config.num_hidden_layers == 16
    for rev in (old, "v1"):
        pinned = resolve_model(p(f"{repo}@{rev}", "t"), "t")
        assert pinned.revision == old, rev
        assert pinned.config.num_hidden_layers == 3 and pinned.config.rope_parameters["rope_theta"] == 10000.0, rev
    assert resolve_model(p(f"{repo}@{main}", "t"), "t").config.num_hidden_layers == 16


def test_audit_file_values_are_type_checked_in_one_place(tmp_path):
    """Trial #57 (`audit = 5` crashed with TypeError), #61 (`tolerances = 5` crashed in settings), #64 (`name = 5`
    was recorded in the JSON), #71 (a table beside [audit] was ignored): each is a usage error naming the file,
    the key, the value's type and the expected type."""
    from pytest_packcheck.config.audits import load_audit

    path = tmp_path / "a.toml"
    cases = [
        ("audit = 5\n", "[audit] must be a table of keys (models = [...], ...), not an integer (5)"),
        ('[audit]\nmodels = ["arch:llama"]\ntolerances = 5\n',
         "'tolerances' must be a file name string, e.g. tolerances = \"tolerances.toml\"; got an integer (5)"),
        ('[audit]\nmodels = ["arch:llama"]\nname = 5\n', "'name' must be a string, e.g. name = \"my-audit\"; got an integer (5)"),
        ('[audit]\nmodels = ["arch:llama"]\ndescription = ["x"]\n', ("'description' must be a string, e.g. description = "
                                                                    "\"what this audit covers\"; got a list (['x'])")),
        ('[audit]\nmodels = ["arch:llama"]\nbackends = "sdpa"\n', ("'backends' must be a list of strings, e.g. backends = "
                                                                  "[\"...\"]; got a string ('sdpa')")),
        ('[audit]\nmodels = ["arch:llama"]\nsliding_window = 1.5\n', ("'sliding_window' must be a whole number >= 2, "
                                                                     "e.g. sliding_window = 16; got a float (1.5)")),
        ('[audit]\nmodels = ["arch:llama"]\nsliding_window = 1\n', ("'sliding_window' must be a whole number >= 2, "
                                                                   "e.g. sliding_window = 16; got an integer (1)")),  # trial 16, 263
        ('[audit]\nmodels = ["arch:llama"]\n[other]\nx = 1\n', ("has top-level ['other'] beside [audit]: the only "
                                                                "table allowed is [audit]")),
        ('models = ["arch:llama"]\n[other]\nx = 1\n', "has unknown keys ['other']"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(PackcheckUsageError) as exc:
            load_audit(str(path))
        assert str(exc.value).startswith(f"Audit file {path}") and message in str(exc.value), (text, str(exc.value))
    path.write_text('[audit]\nname = "n"\ndescription = "d"\nmodels = ["arch:llama"]\ntolerances = "t.toml"\n')
    got = load_audit(str(path))
    assert (got.name, got.tolerances, got.models) == ("n", "t.toml", ("arch:llama",))


def test_an_audit_file_named_without_toml_is_read_and_its_fault_said(tmp_path):
    """Trial 12, 47: `--audit /bin/ls` (a file that is there) said "Audit '/bin/ls' not found"; a .toml-named copy
    got the right "not UTF-8". A file that exists is read whatever its name; a missing one is still "not found"."""
    from pytest_packcheck.config.audits import load_audit

    binary = tmp_path / "audit.cfg"
    binary.write_bytes(bytes(range(200, 256)) * 4)
    with pytest.raises(PackcheckUsageError, match=f"Audit file {binary} is not UTF-8 text"):
        load_audit(str(binary))
    good = tmp_path / "mine.cfg"
    good.write_text('[audit]\nmodels = ["arch:llama"]\n')
    assert list(load_audit(str(good)).models) == ["arch:llama"]
    with pytest.raises(PackcheckUsageError, match="not found"):
        load_audit(str(tmp_path / "absent.cfg"))


def test_models_sentence_never_counts_zero_default_configs_and_overhead_below_zero_is_noise():
    """Trial 12, 153: a run of one local folder under pretrained read "The models: 0 transformers default configs
    (shrunk, pretrained weights) and 1 named checkpoints". Trial 12, 119: bench printed "instrumentation overhead
    -76.7 %" (the counted run was the faster) as a figure."""
    from pytest_packcheck.report.bench import _instrumentation_text
    from pytest_packcheck.report.sections import models_are

    folder = {"m": {"kind": "local", "spec": "./m"}}
    assert models_are(folder, {"weights": "pretrained"}) == "The models: 1 named checkpoint(s) or folder(s), pretrained weights."
    mixed = models_are({**folder, "llama": {"kind": "arch", "spec": "arch:llama"}}, {"weights": "pretrained"})
    assert mixed.startswith("The models: 1 transformers default config(s) (shrunk, random weights) and 1 named") and "0 " not in mixed
    assert _instrumentation_text({"instrumentation_overhead": 0.125}) == "+12.5 %"
    assert _instrumentation_text({"instrumentation_overhead": -0.767}) == "none measurable (-76.7 %, timing noise)"
    assert _instrumentation_text({}) == "—"


def test_a_library_version_comes_from_its_metadata_not_its_dunder_version(monkeypatch):
    """Issue 41: a TRL release whose module has no ``__version__`` (trl 0.22.0's) must still be named by its version.
    Planted: trl's ``__version__`` replaced by "unknown"; the SFT feature probe reads the metadata."""
    from importlib import metadata

    import trl

    from pytest_packcheck.checks.sft_setup import trl_features
    from pytest_packcheck.versions.libraries import module_version

    monkeypatch.setattr(trl, "__version__", "unknown", raising=False)
    assert module_version("trl") == metadata.version("trl") == trl_features()["version"]
    assert module_version("no-such-distribution-here") == "not installed"


def test_the_shrink_passes_sub_configs_their_own_keys_when_the_config_cannot_read_back_its_to_dict(monkeypatch):
    """transformers 4.57's DbrxConfig refuses its own to_dict() (issue 41: dbrx had a shrink_limit gap there). Planted on
    the installed DbrxConfig: from_dict refuses sub-config dicts that carry common PretrainedConfig keys, as 4.57's
    DbrxAttentionConfig did; the shrink retries with each sub-config's own keys and says so in its notes."""
    import copy

    from transformers import DbrxConfig, PretrainedConfig

    from pytest_packcheck.model.shrink import shrink_config

    real = DbrxConfig.from_dict.__func__
    common = set(PretrainedConfig().to_dict()) - {"model_type"}

    def strict(cls, d, **kwargs):
        extra = sorted(k for k in (d.get("attn_config") or {}) if k in common)
        if extra:
            raise ValueError(f"Found unknown kwargs={extra[:3]}")
        return real(cls, d, **kwargs)

    monkeypatch.setattr(DbrxConfig, "from_dict", classmethod(strict))
    notes: list[str] = []
    tiny = shrink_config(copy.deepcopy(DbrxConfig(attn_config={"clip_qkv": 8})), notes=notes)
    assert isinstance(tiny, DbrxConfig) and tiny.d_model < DbrxConfig().d_model
    assert any("cannot read back its own to_dict()" in n for n in notes), notes
