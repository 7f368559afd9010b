"""One-line refusals of inputs issue 28's second adversarial trial found accepted or answered wrongly: each is a
PackcheckUsageError (exit 2) naming the value, where it came from and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_inprocess import packcheck

from pytest_packcheck.errors import PackcheckUsageError

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None):
    """``packcheck ARGS`` in this process (tests/cli_inprocess.py): every test here is about the words and the exit
    code, none about the process boundary, and each fresh interpreter imported torch and transformers again."""
    return packcheck(*args, cwd=cwd)


@pytest.mark.parametrize(("args", "message"), [
    (("qwen2", "sdpaa", "4.56.2"), "Unknown attn_implementation 'sdpaa' (from the attn_implementation argument)"),
    (("qwen2", "paged|sdpa", "5.24.0"), "Unknown attn_implementation 'paged|sdpa'"),
    (("qwen2", "sdpa", "4.56.x"), "transformers version '4.56.x' is not a version"),
    (("qwen2", "sdpa", "4.56.x"), "such as 4.56.2 (no 'transformers=='"),
    (("qwen2", "sdpa", "5.24.0", "--trl", "banana"), "trl version 'banana' is not a version"),
    (("qwen2", "sdpa", "4.56.2", "--trl", "xyz"), "such as 0.19.1 (no 'trl==', no wildcard)"),  # was transformers' example
    # an empty argument (an unset shell variable) answered "architecture '' is not in the atlas", exit 1
    (("", "sdpa", "5.24.0"), "Empty value '' for MODEL_TYPE (from the command line)"),
    (("llama", " ", "5.24.0"), "Empty value ' ' for ATTN_IMPLEMENTATION (from the command line)"),
    (("llama", "sdpa", ""), "Empty value '' for TRANSFORMERS_VERSION (from the command line)"),
    (("llama", "sdpa", "5.24.0", "--trl", ""), "Empty value '' for --trl (from the command line)"),
])
def test_lookup_refuses_an_unknown_backend_and_a_bad_release(args, message):
    """`packcheck lookup qwen2 sdpaa 4.56.2` answered "not measured" (exit 1): a typo is a usage error naming the
    backends the atlas measures and the names it answers from them, exit 2; not every backend of the table (it
    offered flex_attention, which no architecture is measured on: the atlas review)."""
    proc = _cli("lookup", *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    if "sdpaa" in args:
        from pytest_packcheck.support import ANSWERED_FROM

        assert "the atlas measures eager, sdpa, packcheck_flash_ref, and answers " in proc.stderr, proc.stderr
        assert all(b in proc.stderr for b in ANSWERED_FROM) and "Did you mean 'sdpa'" in proc.stderr
        assert "flex_attention" not in proc.stderr


def test_lookup_still_answers_the_backends_it_knows():
    from pytest_packcheck.support import lookup

    assert lookup("llama", "sdpa", "5.24.0").measured
    assert lookup("llama", "sdpa", "5.24").measured_at == "5.24.0"  # 5.24 is 5.24.0, not "not measured"
    assert lookup("llama", "flash_attention_2", "5.24.0").backend == "packcheck_flash_ref"  # answered from the reference
    with pytest.raises(PackcheckUsageError, match="Unknown attn_implementation 'spda'.*Did you mean 'sdpa'"):
        lookup("llama", "spda", "5.24.0")


@pytest.mark.parametrize(("args", "message"), [
    (("--render-only", "--build-dir", "/nonexistent/atlas"),
     "--build-dir '/nonexistent/atlas' does not exist, and -o"),
    (("--render-only", "--build-dir", __file__), f"--build-dir '{__file__}' is not a folder"),
    # every flag is judged before the build folder (trial 13, 153-154: the missing folder hid them)
    (("--render-only", "--build-dir", "/nonexistent/atlas", "--shard", "5/2"), "--shard"),
    (("--render-only", "--build-dir", "/nonexistent/atlas", "--since", "nonsense"), "--since 'nonsense' is not a"),
    (("--releases", "5.24.0", "--bisect", "--bisect-limit", "-1"), "--bisect-limit -1 must be >= 1"),
    (("--releases", "5.24.0", "--bisect", "--bisect-limit", "0"), "--bisect-limit 0 must be >= 1"),
])
def test_atlas_refuses_a_missing_build_dir_and_a_non_positive_bisect_limit(args, message, tmp_path):
    """`packcheck atlas --render-only --build-dir /nonexistent` exited 0 and `--bisect-limit -1` was accepted."""
    proc = _cli("atlas", *args, "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "out").exists()


def test_atlas_render_only_refuses_a_missing_default_build_dir(tmp_path):
    """`pc atlas --render-only -o x` where the default build/atlas does not exist exited 0 and wrote an empty atlas
    ("0 releases measured", "torch None"); a missing --build-dir named explicitly was refused. Both are now."""
    proc = _cli("atlas", "--render-only", "-o", str(tmp_path / "atlas2"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "the default --build-dir 'build/atlas' (no --build-dir given" in proc.stderr and "does not exist" in proc.stderr
    assert "-o with a folder holding a committed atlas" in proc.stderr
    assert not (tmp_path / "atlas2").exists()


def test_atlas_render_only_re_renders_a_committed_atlas_without_a_build_dir(tmp_path):
    """Trial 13, 53: the refusal asked for "an -o holding a committed atlas", and with one the missing default
    build/atlas was refused again; it now re-renders from support.json alone, as the message says."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "support.json").write_text((Path(__file__).resolve().parents[1] / "reports" / "atlas" / "support.json").read_text())
    proc = _cli("atlas", "--render-only", "-o", str(kept), "--releases", "5.24.0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (kept / "atlas.md").exists() and not (tmp_path / "build").exists()


def test_atlas_render_only_refuses_an_empty_build_dir_and_a_new_output(tmp_path):
    """Trial 3 #158: an existing but empty --build-dir and an -o with no support.json rendered an empty atlas
    ("0 releases measured", torch None), exit 0. Refused, nothing written; an -o that holds a committed atlas is
    still re-rendered from an empty build dir (the way the committed atlas is refreshed)."""
    empty = tmp_path / "atlas_build_empty"
    empty.mkdir()
    proc = _cli("atlas", "--render-only", "-o", str(tmp_path / "out"), "--build-dir", str(empty), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "holds no finished release" in proc.stderr and "holds no support.json" in proc.stderr
    assert not list((tmp_path / "out").glob("*"))  # -o is probed (created) first; nothing is written in it
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "support.json").write_text((Path(__file__).resolve().parents[1] / "reports" / "atlas" / "support.json").read_text())
    proc = _cli("atlas", "--render-only", "-o", str(kept), "--build-dir", str(empty), "--releases", "5.24.0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (kept / "atlas.md").exists()


@pytest.mark.parametrize(("spec", "message"), [
    ("arch:llama{pad_token_id=-5}", ("Config value pad_token_id=-5 (in an override of model spec 'arch:llama{pad_token_id=-5}' "
                                    "from test) is not a token id of the model's vocabulary [0, 32,000)")),
    ("arch:llama{bos_token_id=100000}", "Config value bos_token_id=100000"),
    ("arch:llama{eos_token_id=[2,-1]}", "Config value eos_token_id=-1"),
])
def test_a_typed_special_token_id_outside_the_vocabulary_is_refused(spec, message):
    """`arch:llama{pad_token_id=-5}` ran with the pad row wrapped to id 507 of the shrunk vocabulary, under the
    absurd label and with no note: refused as an absurd size is (model/configs.py)."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec(spec, "test"), "test")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_special_token_ids_inside_the_vocabulary_still_resolve():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    for spec in ("arch:llama{pad_token_id=31999}", "arch:llama{pad_token_id=null}", "arch:llama{eos_token_id=[2,7]}"):
        assert resolve_model(parse_model_spec(spec, "test"), "test").error is None, spec


def test_a_special_token_id_from_packcheck_config_is_refused_by_the_audit(tmp_path):
    proc = _cli("audit", "--models", "arch:llama", "--packcheck-config", "pad_token_id=-5", "-n", "0", "-q",
                "--packcheck-report-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2 and "Config value pad_token_id=-5" in proc.stdout + proc.stderr, proc.stdout[-1500:] + proc.stderr
    assert "from --packcheck-config pad_token_id=-5, applied to model spec 'arch:llama' from --packcheck-models" in proc.stdout + proc.stderr  # not the model list alone
    assert not (tmp_path / "r" / "packcheck-matrix.json").exists()


def test_pretrained_weights_from_a_local_folder_without_a_weights_file_is_refused_up_front(tmp_path):
    """--models <folder with only config.json> --packcheck-weights pretrained became an error cell, cause crash
    ("OSError: no file named model.safetensors"), exit 0: a usage error before any cell runs."""
    folder = tmp_path / "cfgonly"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = _cli("audit", "--models", str(folder), "--packcheck-weights", "pretrained", "-n", "0", "-q",
                "--packcheck-report-dir", str(tmp_path / "r"), cwd=tmp_path)
    err = proc.stdout + proc.stderr
    assert proc.returncode == 2, err[-1500:]
    assert f"Local model folder '{folder}' (from --packcheck-models) has no weights file (model.safetensors," in err
    assert "--packcheck-weights=random" in err and not (tmp_path / "r" / "packcheck-matrix.json").exists()


# --- support files, claims and atlas flags of the third adversarial trial (TRIAL-FINDINGS group A) -------------------


def _support(tmp_path: Path, mutate=None, name="support.json") -> Path:
    """The committed atlas cut to llama (a valid support document), optionally changed by ``mutate(doc)``."""
    import json

    doc = json.loads((REPO / "reports" / "atlas" / "support.json").read_text())
    doc["cells"] = {"llama": doc["cells"]["llama"]}
    doc.pop("trl", None)
    doc = mutate(doc) if mutate else doc
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _set(doc, value, *keys):
    node = doc
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return doc


def _rename_release(doc):
    row = doc["cells"]["llama"]["sdpa"]
    row["notaversion"] = row.pop("5.24.0")
    return doc


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: [1, 2], "is a JSON list, not a packcheck atlas support document"),
    (lambda d: {"schema": d["schema"], "schema_version": 1}, "is corrupt: 'cells' is missing or null"),
    (lambda d: _set(d, [], "cells"), "is corrupt: 'cells' is a list"),
    (lambda d: _set(d, [], "cells", "llama"), "cells.llama is a list"),
    (lambda d: _set(d, "big", "cells", "llama", "sdpa", "5.24.0", "number"), "cells.llama.sdpa['5.24.0'].number is 'big', not a finite number >= 0"),
    (lambda d: _set(d, True, "cells", "llama", "sdpa", "5.24.0", "number"), ".number is True, not a finite number >= 0"),
    (_rename_release, "release key 'notaversion' under cells.llama.sdpa is not a version"),
    (lambda d: _set(d, "bogus", "cells", "llama", "sdpa", "5.24.0", "verdict"), ".verdict is 'bogus', not one of error"),
    (lambda d: _set(d, None, "cells", "llama", "sdpa", "5.24.0"), "cells.llama.sdpa['5.24.0'] is missing or null, not an entry"),
    (lambda d: _set(d, "leak", "cells", "llama", "sdpa", "5.24.0", "causes"), ".causes is 'leak', not a list of cause codes"),
    (lambda d: {k: v for k, v in d.items() if k != "releases"}, "'releases' is missing or null"),
    (lambda d: _set(d, [{"x": 1}], "releases"), "releases[0] has no transformers version"),
    (lambda d: _set(d, ["5.x"], "missing"), "'missing' is ['5.x'], not a list of versions"),
    (lambda d: {"schema_version": 2, "settings": {}, "cells": []}, "is a packcheck results matrix (packcheck-matrix.json"),
])
def test_a_corrupt_support_file_is_one_line_naming_the_file_and_the_field(tmp_path, mutate, message):
    """A support file of the wrong shape was a traceback of lookup / claims (AttributeError on a list, KeyError
    'cells' / 'releases', ValueError formatting a string number, InvalidVersion of a release key), or a bogus
    verdict printed as the answer with exit 0: now validate_support refuses it where it is loaded."""
    from pytest_packcheck.support import load_support, lookup

    good = _support(tmp_path, name="good.json")
    assert lookup("llama", "sdpa", "5.24.0", path=good).verdict == "pass"  # the unchanged document still answers
    bad = _support(tmp_path, mutate)
    with pytest.raises(PackcheckUsageError, match="Support file '.*support.json' ") as info:
        load_support(bad)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["lookup", "claims"])
def test_lookup_and_claims_refuse_a_corrupt_support_file_in_one_line(tmp_path, command):
    """T2 / T3 / T10: the CLI of both readers exits 2 with one line, no traceback."""
    bad = _support(tmp_path, lambda d: {"schema": d["schema"], "schema_version": 1})
    args = ("llama", "sdpa", "5.24.0") if command == "lookup" else (str(tmp_path / "peer.whl"), "-o", str(tmp_path / "c.md"))
    proc = _cli(command, *args, "--support-file", str(bad))
    assert proc.returncode == 2 and "is corrupt: 'cells' is missing" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_lookup_names_a_folder_or_a_results_matrix_given_as_the_support_file(tmp_path):
    """U5: a folder asked for the file; a matrix JSON said "schema None version 2 ... upgrade packcheck"."""
    folder = _cli("lookup", "llama", "sdpa", "5.24.0", "--support-file", str(tmp_path))
    assert folder.returncode == 2 and f"'{tmp_path}' is a directory: pass the support.json file itself" in folder.stderr, folder.stderr
    matrix = _cli("lookup", "llama", "sdpa", "5.24.0", "--support-file", str(REPO / "reports" / "packcheck-matrix.json"))
    assert matrix.returncode == 2 and "is a packcheck results matrix" in matrix.stderr and "upgrade" not in matrix.stderr, matrix.stderr


def test_lookup_and_checks_do_not_echo_a_token_typed_as_a_name():
    """X1 / X3: `packcheck lookup hf_... sdpa 5.24.0` and `packcheck checks hf_...` printed the token."""
    token = "hf_typedTOKENvalue987654"
    for args in (("lookup", token, "sdpa", "5.24.0"), ("lookup", token, "sdpa", "5.24.0", "--json"), ("checks", token)):
        proc = _cli(*args)
        assert token not in proc.stdout + proc.stderr and "***" in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)
    assert _cli("checks", token).returncode == 2


def _peer_wheel(path: Path, files: dict[str, str]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("axolotl-1.2.dist-info/METADATA", "Name: axolotl\nVersion: 1.2\nRequires-Dist: transformers==5.24.0\n")
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_a_peer_file_that_is_not_python_is_a_claimless_entry_not_a_traceback(tmp_path):
    """T9: `def (:` in axolotl/monkeypatch/multipack.py was a SyntaxError out of read_axolotl."""
    from pytest_packcheck.atlas.claims import read_wheel

    peer = read_wheel(_peer_wheel(tmp_path / "axolotl-1.2-py3-none-any.whl", {"axolotl/monkeypatch/multipack.py": "def (:\n"}))
    assert peer.claims == [] and peer.reason.startswith(
        "cannot parse axolotl/monkeypatch/multipack.py in axolotl-1.2-py3-none-any.whl (invalid syntax line 1)"), peer.reason


@pytest.mark.parametrize("content", [b"not an archive at all\n" * 40, b"\x1f\x8b\x08\x00" + b"\x00" * 20])
def test_a_package_that_is_no_archive_is_one_line(tmp_path, content):
    """U4: a file that is neither zip nor tar listed tarfile's four tries over six lines."""
    from pytest_packcheck.atlas.claims import read_wheel

    path = tmp_path / "notawheel.whl"
    path.write_bytes(content)
    with pytest.raises(PackcheckUsageError, match="is not a readable wheel or sdist") as info:
        read_wheel(path)
    assert "\n" not in str(info.value)


def test_claims_refuses_an_unwritable_output_before_reading(tmp_path):
    """T8: -o /dev/null/x.md was a FileExistsError traceback after reading every package."""
    wheel = _peer_wheel(tmp_path / "axolotl-1.2-py3-none-any.whl", {})
    under_file = _cli("claims", str(wheel), "-o", str(wheel / "x.md"))
    assert under_file.returncode == 2 and "is a file, not a folder" in under_file.stderr, under_file.stderr
    folder = _cli("claims", str(wheel), "-o", str(tmp_path))
    assert folder.returncode == 2 and "is a folder: pass the Markdown file to write" in folder.stderr, folder.stderr
    assert all(p.stderr.strip().count("\n") == 0 for p in (under_file, folder))


@pytest.mark.parametrize("args", [("--since", "5.20", "--until", "5.10"), ("--trl", "--since", "0.30", "--until", "0.20")])
def test_atlas_refuses_since_newer_than_until(args):
    """W8: --since 5.20 --until 5.10 printed [] with exit 0 (an empty plan); refused before the index is asked."""
    proc = _cli("atlas", "--list-releases", *args)
    assert proc.returncode == 2 and f"--since {args[-3]} is newer than --until {args[-1]}" in proc.stderr, proc.stderr


def test_atlas_render_refuses_an_output_dir_under_a_file(tmp_path):
    """T7: --render-only -o /dev/null/x was a NotADirectoryError traceback; the same probe bench and bisect use."""
    from pytest_packcheck.atlas import DONE_MARKER

    (tmp_path / "build" / "5.24.0").mkdir(parents=True)
    (tmp_path / "build" / "5.24.0" / DONE_MARKER).write_text("{}")  # something to render: only -o is wrong
    (tmp_path / "file").write_text("")
    proc = _cli("atlas", "--render-only", "--build-dir", str(tmp_path / "build"), "-o", str(tmp_path / "file" / "x"))
    assert proc.returncode == 2 and "(from -o/--output-dir) is not writable" in proc.stderr and "is a file, not a folder" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_a_corrupt_support_file_from_the_environment_says_so(tmp_path, monkeypatch):
    """T3 via $PACKCHECK_SUPPORT_FILE: the line names the variable the file came from (it is not on the command line)."""
    from pytest_packcheck.support import lookup

    bad = _support(tmp_path, lambda d: {"schema": d["schema"], "schema_version": 1})
    monkeypatch.setenv("PACKCHECK_SUPPORT_FILE", str(bad))
    with pytest.raises(PackcheckUsageError, match=r"\(from \$PACKCHECK_SUPPORT_FILE\) is corrupt: 'cells' is missing"):
        lookup("llama", "sdpa", "5.24.0")


def test_a_size_or_unknown_key_from_packcheck_config_names_that_option():
    from pytest_packcheck.model import configs
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    try:
        configs.CONFIG_OPTION_OVERRIDES.update({"hidden_size": 0, "clip_qvk": 8})
        with pytest.raises(PackcheckUsageError, match=r"\(from --packcheck-config hidden_size=0, applied to model spec "
                                                      r"'arch:llama' from --packcheck-models\)"):
            resolve_model(parse_model_spec("arch:llama{hidden_size=0}", "--packcheck-models"), "--packcheck-models")
        with pytest.warns(Warning, match=r"'clip_qvk' \(from --packcheck-config clip_qvk=8, applied to model spec 'arch:llama' from"):
            resolve_model(parse_model_spec("arch:llama{clip_qvk=8}", "--packcheck-models"), "--packcheck-models")
        with pytest.raises(PackcheckUsageError, match=r"from --packcheck-models\) is not a size") as own:  # the spec's own value
            resolve_model(parse_model_spec("arch:llama{hidden_size=-1}", "--packcheck-models"), "--packcheck-models")
        assert "--packcheck-config" not in str(own.value)
        # trial 8, 145: NaN != NaN, so a NaN folded in by --packcheck-config was named as typed in the spec
        configs.CONFIG_OPTION_OVERRIDES.update({"hidden_size": float("nan")})
        with pytest.raises(PackcheckUsageError, match=r"\(from --packcheck-config hidden_size=NaN, applied to model spec "
                                                      r"'arch:llama' from --packcheck-models\)"):
            resolve_model(parse_model_spec("arch:llama{hidden_size=NaN}", "--packcheck-models"), "--packcheck-models")
    finally:
        configs.CONFIG_OPTION_OVERRIDES.clear()


def test_a_warning_about_the_specs_own_override_quotes_the_spec_as_typed_and_names_the_config_option_apart():
    """With --packcheck-config api_key=..., the warning for the spec's own my_token quoted the spec as
    'arch:llama{api_key=...,my_token=...}' "from --packcheck-models", a spec the user never typed."""
    from pytest_packcheck.model import configs
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    try:
        configs.CONFIG_OPTION_OVERRIDES.update({"api_key": "k1"})
        with pytest.warns(Warning) as caught:
            resolve_model(parse_model_spec("arch:llama{api_key=k1,my_token=t1}", "--packcheck-models"), "--packcheck-models")
        texts = [str(w.message) for w in caught]
        own = next(t for t in texts if "'my_token'" in t)
        assert ("(in model spec 'arch:llama{my_token=t1}' from --packcheck-models, with --packcheck-config api_key=k1 "
                "applied)") in own
        assert "{api_key=k1,my_token=t1}" not in " ".join(texts)
    finally:
        configs.CONFIG_OPTION_OVERRIDES.clear()


def test_heads_that_do_not_divide_from_packcheck_config_name_that_option_and_the_value_as_typed():
    """--packcheck-config num_attention_heads=3 was refused "(in model spec 'arch:llama{num_attention_heads=3}' from
    --packcheck-models)": a spec the user never typed and the wrong flag."""
    from pytest_packcheck.model import configs
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    try:
        configs.CONFIG_OPTION_OVERRIDES.update({"num_attention_heads": 3})
        with pytest.raises(PackcheckUsageError) as info:
            resolve_model(parse_model_spec("arch:llama{num_attention_heads=3}", "--packcheck-models"), "--packcheck-models")
        assert ("(from --packcheck-config num_attention_heads=3, applied to model spec 'arch:llama' from "
                "--packcheck-models) do not divide") in str(info.value)
        assert "{num_attention_heads=3}" not in str(info.value)
    finally:
        configs.CONFIG_OPTION_OVERRIDES.clear()


def test_an_override_that_is_no_config_key_is_noted_in_the_cells_config_notes():
    """arch:llama{nosuchkey=1} warned on the terminal only: the reports said "safe" with no config note."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.warns(Warning, match="'nosuchkey'"):
        resolved = resolve_model(parse_model_spec("arch:llama{nosuchkey=1}", "--packcheck-models"), "--packcheck-models")
    assert resolved.record()["config_notes"] == [("override nosuchkey=1 is not a key of LlamaConfig or its sub-configs: set "
                                                  "as a new attribute, which the model may never read")]


@pytest.mark.parametrize(("spec", "what"), [
    ("arch:llama{rope_theta=", "an unclosed '{'"),
    ("arch:llama}", "a '}' without its '{'"),
    ("arch:llama{rope_theta=1}x", "text after the closing '}'"),
    ("arch:llama{num_hidden_layers=2}{x=1}", "a second pair of braces"),  # was a type error on '2}{x=1'
])
def test_a_model_spec_with_a_broken_brace_names_the_brace(spec, what):
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError, match=f"Malformed model spec '{re.escape(spec)}' \\(from --packcheck-models\\): {what}; "
                                                  "write the overrides last, in one pair of braces, e.g. arch:llama{"):
        parse_model_spec(spec, "--packcheck-models")


def test_the_override_examples_work_on_the_installed_transformers(recwarn):
    """The malformed-spec error suggested arch:llama{rope_theta=10000}, which transformers 5.x never reads (its RoPE
    base is rope_parameters.rope_theta): every example the error and the docs give sets a key the config has, a
    plain rope_theta is warned about naming the key that works, and a RoPE base <= 0 is refused as absurd."""
    from pytest_packcheck.errors import PackcheckWarning
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as bad:
        parse_model_spec("arch:llama{hidden_size=abc", "--packcheck-models")
    example = re.search(r"e\.g\. (\S+\})", str(bad.value)).group(1)
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    examples = [example, *(m.replace("org/name", "arch:llama") for m in re.findall(r"`(org/name\{[^`]*\})`", docs))]
    assert len(examples) >= 2 and not any("{rope_theta=" in e for e in examples), examples
    for spec in examples:
        spec = spec.replace(",attn_config.clip_qkv=8", "")  # llama has no attn_config: the rest must be read
        resolve_model(parse_model_spec(spec, "--packcheck-models"), "--packcheck-models")
    assert not [w for w in recwarn if issubclass(w.category, PackcheckWarning)], [str(w.message) for w in recwarn]
    got = resolve_model(parse_model_spec("arch:llama{rope_parameters.rope_theta=1e6}", "x"), "x")
    assert got.config.rope_parameters["rope_theta"] == 1e6
    with pytest.warns(PackcheckWarning, match=r"'rope_theta' .* keeps 'rope_theta' in rope_parameters: write "
                                              r"rope_parameters\.rope_theta=1000000\.0"):
        resolve_model(parse_model_spec("arch:llama{rope_theta=1e6}", "x"), "x")
    for spec in ("arch:llama{rope_theta=-1}", "arch:llama{rope_parameters.rope_theta=0}"):
        with pytest.raises(PackcheckUsageError, match=r"is not a RoPE base a model can have: expected a positive number"):
            resolve_model(parse_model_spec(spec, "--packcheck-models"), "--packcheck-models")


def test_an_unknown_architecture_points_at_a_list_not_at_a_full_audit():
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec("arch:nosuchthing", "--packcheck-models"), "--packcheck-models")
    assert "--all-architectures" not in str(info.value) and "print(sorted(CONFIG_MAPPING))" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("args", [
    ("--models", "arch:nosuchthing"),
    ("--models", "arch:llama", "--packcheck-device", "cuda"),  # this test machine's torch sees no GPU
    ("--models", "arch:llama", "--packcheck-shard", "2/2"),
])
def test_a_run_refused_for_bad_input_leaves_the_report_folder_as_it_found_it(tmp_path, args):
    """An unknown architecture, a missing CUDA device or an empty shard were refused after the run had taken the
    folder: the owner file, the lock and an emptied journal stayed. Now nothing is made, and a previous run's
    files are untouched."""
    pytest.importorskip("torch")
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is here: --packcheck-device cuda is not bad input")
    fresh = tmp_path / "fresh"
    proc = _cli("audit", *args, "--packcheck-attn", "eager", "--packcheck-checks", "isolation", "-n", "0",
                "--packcheck-report-dir", str(fresh), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip(), proc.stderr[-800:]
    assert not fresh.exists(), sorted(p.name for p in fresh.iterdir())
    old = tmp_path / "old"
    old.mkdir()
    (old / "packcheck-journal.jsonl").write_text('{"cell": 1}\n')
    (old / "packcheck-matrix.json").write_text("{}\n")
    _cli("audit", *args, "--packcheck-attn", "eager", "--packcheck-checks", "isolation", "-n", "0",
         "--packcheck-report-dir", str(old), cwd=tmp_path)
    assert {p.name: p.read_text() for p in old.iterdir()} == {"packcheck-journal.jsonl": '{"cell": 1}\n',
                                                              "packcheck-matrix.json": "{}\n"}


def test_an_override_that_breaks_the_config_names_the_override_not_the_library():
    """`--models 'arch:llama{hidden_act=not_an_activation}'` was filed under library_config ("the default config does
    not build in transformers itself ... report the default config upstream"): the user's override broke it."""
    from pytest_packcheck.model.build import build_model
    from pytest_packcheck.model.build_errors import OverrideConfigError
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import Cell, CellRunner

    resolved = resolve_model(parse_model_spec("arch:llama{hidden_act=not_an_activation}", "--models"), "--models")
    with pytest.raises(OverrideConfigError, match=r"llama: the config with your overrides hidden_act=not_an_activation "
                                                  r"does not build in transformers \(KeyError.*fix the override"):
        build_model(resolved, "sdpa", "float32")
    result = CellRunner([resolved], {"float32": {}}).run(Cell(0, "llama", "sdpa", "isolation", "float32"))
    assert result.status == "error" and result.cause == "override_config", (result.cause, result.message)
    assert "hidden_act=not_an_activation" in result.message and "itself" not in result.message


def test_two_model_specs_with_one_label_are_refused_before_any_cell_runs(tmp_path):
    """Trial 11, 84 / 85: `--models arch:llama,./m/llama` and two folders named llama ran one model under the label
    both have (the other silently dropped; a gpt2 folder's cells labelled llama). The label keys rows, cell ids and
    test ids, so two specs sharing one are refused with both named, exit 2. Planted: distinct names run both."""
    from pytest_packcheck.model.specs import parse_model_list

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    for parent in ("a", "b"):
        (tmp_path / parent / "llama").mkdir(parents=True)
        (tmp_path / parent / "llama" / "config.json").write_text(json.dumps(config))
    a, b = str(tmp_path / "a" / "llama"), str(tmp_path / "b" / "llama")
    for models in (["arch:llama", a], [a, b]):
        with pytest.raises(PackcheckUsageError, match=r"Model specs '.+' and '.+' \(from -m\) have one label, 'llama'"):
            parse_model_list(models, "-m")
    assert [s.label for s in parse_model_list(["arch:llama{num_hidden_layers=3}", a, a], "-m")] == [
        "llama{num_hidden_layers=3}", "llama"]  # distinct labels run; the same spec twice is one model
    proc = _cli("audit", "--models", f"arch:llama,{a}", "--packcheck-attn", "sdpa", "-n", "0",
                "--packcheck-report-dir", str(tmp_path / "r"), cwd=tmp_path)
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line and "have one label, 'llama'" in line and a in line, proc.stderr
    assert not (tmp_path / "r" / "packcheck-matrix.json").exists()


@pytest.mark.parametrize("name", ["notamodel", "lamma", "evolla_model", "qwen3moe", "nonexistent_xyz", "convnex"])
def test_an_unknown_architecture_is_offered_only_a_spec_that_parses_and_runs(name):
    """Trial 11, 4: arch:notamodel was answered "Did you mean 'EvollaModel'?", a CONFIG_MAPPING key that arch: itself
    refuses as malformed. Trial 19, 30: arch:nonexistent_xyz was offered 'arch:convnext', a vision backbone with no
    causal-LM head. A suggestion is an arch: spec that parses, of a causal LM or a text path packcheck runs."""
    import re as _re

    from pytest_packcheck.model.architectures import causal_lm_architectures, mrope_text_path_architectures
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec(f"arch:{name}", "-m"), "-m")
    said = _re.search(r"Did you mean '([^']+)'\?", str(info.value))
    # evolla_model was offered 'arch:olmoe' while the shared 'arch:' prefix counted toward difflib's ratio: no name
    # of the runnable ones is close to it, so none is offered (errors.closest's prefix)
    assert said or name in ("nonexistent_xyz", "convnex", "notamodel", "evolla_model"), str(info.value)
    if said:
        spec = parse_model_spec(said.group(1), "the suggestion")
        assert spec.kind == "arch" and spec.name in {*causal_lm_architectures(), *mrope_text_path_architectures()}, said.group(1)
    if name == "lamma":
        assert said.group(1) == "arch:llama"


@pytest.mark.parametrize("config", [{}, {"model_type": None}, {"model_type": ""}, {"model_type": ["llama"]}])
def test_a_config_without_a_model_type_is_told_to_add_one(config, tmp_path):
    """Trial 13, 104: a config.json with no model_type was told to upgrade transformers or pass
    --packcheck-trust-remote-code, neither of which helps; a list there was a TypeError (unhashable)."""
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackcheckUsageError) as info:
        resolve_model(parse_model_spec(str(tmp_path), "--packcheck-models"), "--packcheck-models")
    said = str(info.value)
    assert f"its config.json has no usable \"model_type\" key (found {config.get('model_type')!r})" in said, said
    assert "add the model_type" in said and "upgrade" not in said and "trust-remote-code" not in said and "\n" not in said


@pytest.mark.parametrize(("args", "prefix"), [
    (("audit", "--models", "arch:llama", "--packcheck-trust", "-n", "0"), "--packcheck-trust"),
    (("gate", "--baseline", "a.json", "--cand", "b.json"), "--cand"),
    (("lookup", "llama", "sdpa", "5.24.0", "--tr", "0.19.1"), "--tr"),
])
def test_a_prefix_of_a_flag_is_not_taken_for_the_flag(args, prefix, tmp_path):
    """Trial 13, 130: argparse expanded `--packcheck-trust` to --packcheck-trust-remote-code, and the audit ran
    remote code the user never asked for. No command takes an abbreviation (allow_abbrev=False, as pytest's own
    parser): the prefix is an unrecognized argument, exit 2, and nothing runs."""
    proc = _cli(*args, "--packcheck-report-dir" if args[0] == "audit" else "--no-such-flag-either", str(tmp_path / "r"),
                cwd=tmp_path)
    assert proc.returncode == 2 and f"unrecognized arguments: {prefix}" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("edit", "said"), [
    (lambda text: "{", "is not valid JSON (Expecting property name"),  # trial 16, 201: a traceback
    (lambda text: text, None),  # the committed atlas itself renders
    # trial 17, 170: another schema was "measured again" under --render-only: an empty atlas over it, claims.md kept
    (lambda text: json.dumps({"schema": "x"}),
     "has schema 'x' version None, not packcheck-atlas-support version 1, and --render-only measures nothing"),
    (lambda text: json.dumps({**json.loads(text), "cells": {"llama": {"sdpa": {"5.24.0": {
        "verdict": "pass", "causes": [], "check": "isolation", "number": 0.7}}}}}),
     "is a pass whose isolation number 0.7 is above its tolerance"),  # trial 16, 200: kept silently
])
def test_atlas_render_refuses_a_corrupt_committed_atlas_and_says_how_to_restore_it(edit, said, tmp_path):
    """`atlas --render-only` is seeded from -o's support.json: a truncated one was a JSONDecodeError traceback, one
    with a contradicted pass was rendered as is, and lookup's refusal of it said to re-render, which kept it."""
    kept = tmp_path / "kept"
    kept.mkdir()
    committed = (Path(__file__).resolve().parents[1] / "reports" / "atlas" / "support.json").read_text()
    (kept / "support.json").write_text(edit(committed))
    proc = _cli("atlas", "--render-only", "-o", str(kept), "--releases", "5.24.0", cwd=tmp_path)
    if said is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and said in proc.stderr, proc.stderr
    assert "git checkout -- reports/atlas/support.json" in proc.stderr and not (kept / "atlas.md").exists()
