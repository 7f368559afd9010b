"""The atlas's encoder and multimodal blocks (issue 46; pytest_packcheck/atlas/kinds.py, kinds_render.py): per-release
runs reduced to a block, absent models, transitions placed on the exact patch, rendered, carried and looked up.
Planted: a verdict flipped in one release is a transition (both ways); a model absent from a release is ``absent``
(never a pass, never a transition); a release between two measured ones places the fix."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from pytest_packcheck import atlas as A
from pytest_packcheck.atlas import kinds as K
from pytest_packcheck.atlas.kinds_render import render_kind_markdown, unpack
from pytest_packcheck.results.schema import SCHEMA_VERSION
from pytest_packcheck.support import lookup

ENC = K.KINDS["encoders"]
MM = K.KINDS["multimodal"]
KEYS = {"encoder_isolation": "max_change", "encoder_parity": "max_abs_diff", "mm_isolation": "max_change",
        "mm_parity": "max_abs_diff", "mm_layouts": "none"}


def _cell(model: str, backend: str, check: str, status: str, cause: str | None = None, number: float = 0.0,
          message: str | None = None, prefix: str = "encoder:", metrics: dict | None = None) -> dict:
    return {"cell_id": f"{model}-{backend}-{check}-float32",
            "model": {"label": f"{model}-encoder", "model_type": model, "spec": f"{prefix}{model}"},
            "backend": backend, "check": check, "dtype": "float32", "status": status,
            "metrics": metrics if metrics is not None else {KEYS[check]: number},
            "message": message or f"{check} {status} {number:.2e}", "cause": cause,
            "role": "finding" if check == "mm_layouts" else "correctness",
            "tolerances": {"isolation_atol": 1e-05, "logits_atol": 1e-04}, "findings": [],
            "diagnosis": {"cause": cause, "findings": [], "known_faults": []}}


def _absent(model: str, backend: str, version: str) -> list[dict]:
    words = (f"transformers {version}: Unknown architecture 'arch:{model}' (from --packcheck-models): {K.ABSENT_MARK}. "
             "The model types are the keys of transformers' CONFIG_MAPPING")
    return [_cell(model, backend, c, "unsupported", message=words) for c in ("encoder_isolation", "encoder_parity")]


def _pair(model: str, backend: str, status: str, number: float) -> list[dict]:
    cause = "leak" if status == "fail" else None
    return [_cell(model, backend, "encoder_isolation", status, cause, number if status == "fail" else 0.0),
            _cell(model, backend, "encoder_parity", status, cause, number * 2.6 if status == "fail" else 3e-7)]


def _write(build: Path, version: str, cells: list[dict]) -> None:
    folder = A.release_dir(build, version)
    folder.mkdir(parents=True)
    doc = {"schema_version": SCHEMA_VERSION, "packcheck_version": "0.1.0", "command": "planted",
           "environment": {"transformers": version, "torch": "2.13.0+cpu", "trl": None},
           "settings": {"models": sorted({c["model"]["spec"] for c in cells}), "backends": ["eager", "sdpa"], "versions": []},
           "cells": cells}
    (folder / "packcheck-matrix.json").write_text(json.dumps(doc))
    (folder / A.DONE_MARKER).write_text(json.dumps({"transformers": version, "cells": len(cells), "wall_s": 20.0,
                                                    "child_cpu_s": 9.0, "finished": "2026-12-06T10:00:00Z"}))


#: bert / sdpa leaks up to 5.24.0 and passes on 5.25.0 (the known fix); roberta / sdpa passes on 5.23.0 and 5.25.0 and
#: is flipped to a leak on 5.24.0 alone; modernbert is not in 5.23.0 and leaks from 5.24.0; deberta-v2 refuses sdpa.
PLAN = {
    "5.23.0": [*_pair("bert", "sdpa", "fail", 0.0042), *_pair("roberta", "sdpa", "pass", 0), *_absent("modernbert", "sdpa", "5.23.0"),
               _cell("deberta-v2", "sdpa", "encoder_isolation", "unsupported",
                     message="model build: ValueError: DebertaV2ForMaskedLM does not support an attention implementation through sdpa")],
    "5.24.0": [*_pair("bert", "sdpa", "fail", 0.0042), *_pair("roberta", "sdpa", "fail", 0.0037), *_pair("modernbert", "sdpa", "fail", 0.0036)],
    "5.25.0": [*_pair("bert", "sdpa", "pass", 0), *_pair("roberta", "sdpa", "pass", 0), *_pair("modernbert", "sdpa", "fail", 0.0036)],
}


@pytest.fixture
def build(tmp_path):
    for version, cells in PLAN.items():
        _write(tmp_path / "enc", version, cells)
    return tmp_path / "enc"


def test_a_block_holds_each_release_absent_models_as_absent_and_a_flipped_release_as_two_transitions(build):
    block = K.collect_kind(ENC, build, planned=["5.22.2", "5.23.0", "5.24.0", "5.25.0"])
    cells = block["cells"]
    assert [r["transformers"] for r in block["releases"]] == ["5.23.0", "5.24.0", "5.25.0"] and block["missing"] == ["5.22.2"]
    assert cells["modernbert"]["sdpa"]["5.23.0"] == {"verdict": "absent", "causes": []}  # not a pass, not an error
    assert cells["bert"]["sdpa"]["5.24.0"] == {"verdict": "fail", "causes": ["leak"], "check": "encoder_isolation", "number": 0.0042}
    assert cells["bert"]["sdpa"]["5.25.0"] == {"verdict": "pass", "causes": [], "number": 0.0}  # the block's first check's
    assert "does not support" in cells["deberta-v2"]["sdpa"]["5.23.0"]["message"]  # a no-verdict entry keeps its reason
    assert [r["models"] for r in block["releases"]] == [3, 3, 3]
    moves = {(t["model_type"], t["last_before"], t["first_after"]): (t["before"]["verdict"], t["after"]["verdict"])
             for t in block["transitions"]}
    assert moves == {("bert", "5.24.0", "5.25.0"): ("fail", "pass"), ("roberta", "5.23.0", "5.24.0"): ("pass", "fail"),
                     ("roberta", "5.24.0", "5.25.0"): ("fail", "pass")}  # modernbert appearing is no transition
    # without the flip, roberta has no transition: the planted release is what the collector saw
    quiet = {**PLAN, "5.24.0": [*_pair("bert", "sdpa", "fail", 0.0042), *_pair("roberta", "sdpa", "pass", 0)]}
    other = build.parent / "quiet"
    for version, cells_ in quiet.items():
        _write(other, version, cells_)
    assert {t["model_type"] for t in K.collect_kind(ENC, other)["transitions"]} == {"bert"}


def test_the_sweep_places_the_fix_on_the_exact_patch_and_the_render_and_lookup_answer_from_the_block(build, tmp_path, monkeypatch):
    block = K.collect_kind(ENC, build)
    runs: list = []

    def run(kind, version, folder, models=None, log=print, runner=None):  # a planted 5.24.1: bert still leaks, roberta fixed
        runs.append((version, list(models)))
        _write(folder, version, [*_pair("bert", "sdpa", "fail", 0.0041), *_pair("roberta", "sdpa", "pass", 0)])
        return {"transformers": version, "cells": 4}

    monkeypatch.setattr(K, "run_kind_release", run)
    placed = A.sweep_transitions(block, build, finals=["5.23.0", "5.24.0", "5.24.1", "5.25.0"], log=lambda s: None,
                                 measure=partial(K.measure_between, ENC))
    assert runs == [("5.24.1", ["encoder:bert", "encoder:roberta"])]  # one run serves the gap's transitions
    by = {k: v for k, v in placed.items()}
    bert = by["bert|sdpa|5.24.0|5.25.0"]
    assert (bert["outcome"], bert["first"], bert["last"]) == ("found", "5.25.0", "5.24.1")
    assert (by["roberta|sdpa|5.24.0|5.25.0"]["first"], by["roberta|sdpa|5.24.0|5.25.0"]["last"]) == ("5.24.1", "5.24.0")
    assert by["roberta|sdpa|5.23.0|5.24.0"]["first"] == "5.24.0"  # nothing between 5.23.0 and 5.24.0: no run
    block = K.collect_kind(ENC, build, bisects=placed)
    text = "\n".join(render_kind_markdown(block))
    assert "- **encoder:modernbert** / sdpa: ∅ absent up to 5.23.0; ❌ leak from 5.24.0 (encoder_isolation ≤ 3.6e-03)" in text
    assert "| encoder:bert | sdpa | 5.24.0 | 5.25.0 | ❌ leak (encoder_isolation 4.2e-03) | ✅ | found: first 5.25.0, last 5.24.1 |" in text
    assert "encoder:modernbert / sdpa: ❌ leak (encoder_isolation 3.6e-03)" in text  # what leaks on the newest release
    # support.json carries the block; a re-render of the transformers axis keeps it
    main = {"schema": "packcheck-atlas-support", "schema_version": A.SUPPORT_SCHEMA_VERSION, "packcheck_version": "0.1.0",
            "generated": "2026-12-06", "device": "cpu", "dtype": "float32", "torch": "2.13.0+cpu", "backends": list(A.ATLAS_BACKENDS),
            "checks": ["isolation"], "releases": [{"transformers": "5.25.0", "architectures": 1, "cells": 1}], "missing": [],
            "cells": {"llama": {"sdpa": {"5.25.0": {"verdict": "pass", "causes": [], "check": "isolation", "number": 0.0}}}},
            "transitions": []}
    stored = K.packed(block)  # support.json holds runs of equal entries per row, and gives the cells back exactly
    assert "cells" not in stored and stored["rows"]["bert"]["sdpa"] == [
        ["5.23.0", "5.24.0", {"verdict": "fail", "causes": ["leak"], "check": "encoder_isolation", "number": 0.0042}],
        ["5.25.0", "5.25.0", {"verdict": "pass", "causes": [], "number": 0.0}]]
    assert unpack(stored)["cells"] == block["cells"] and K.collect_kind(ENC, build / "none", committed=stored)["cells"] == block["cells"]
    carried = K.carry_kinds(dict(main), {**main, "encoders": stored})
    assert carried["encoders"] is stored and "## Encoders and embedding models per release" in A.render_markdown(carried)
    out = tmp_path / "out"
    A.write_outputs(carried, out)
    support = out / "support.json"
    answer = lookup("encoder:bert", "sdpa", "5.24.0", path=support)
    assert (answer.measured, answer.verdict, answer.causes, answer.number) == (True, "fail", ["leak"], 0.0042)
    assert answer.model_type == "encoder:bert" and "encoder:bert" in answer.reproduce and "transformers==5.24.0" in answer.reproduce
    fixed = lookup("encoder:bert", "flash_attention_2", "5.25.0", path=support)
    assert not fixed.measured and fixed.verdict is None  # sdpa alone was planted: the flash column is not measured
    assert any("backend 'packcheck_flash_ref' is not measured for bert" in n for n in fixed.notes)
    assert "pass (encoder_isolation 0.0e+00), measured at 5.25.0" in str(lookup("encoder:bert", "sdpa", "5.25.0", path=support))
    swept = lookup("encoder:roberta", "sdpa", "5.24.1", path=support)
    assert (swept.measured, swept.verdict, swept.measured_at) == (True, "pass", "5.24.1")
    gone = lookup("encoder:modernbert", "sdpa", "5.23.0", path=support)
    assert gone.verdict == "absent" and any("not a model_type of transformers 5.23.0" in n for n in gone.notes)
    unknown = lookup("encoder:llama", "sdpa", "5.25.0", path=support)
    assert not unknown.measured and any("encoder:llama" in n for n in unknown.notes)
    assert lookup("llama", "sdpa", "5.25.0", path=support).verdict == "pass"  # the transformers axis answers as before
    no_block = tmp_path / "plain"
    A.write_outputs(dict(main), no_block)
    assert "no multimodal block" in str(lookup("multimodal:qwen2_vl", "sdpa", "5.25.0", path=no_block / "support.json"))


def test_multimodal_layouts_and_the_run_flags_come_from_the_suite(tmp_path):
    layouts = {"layouts": {"text+mrope": {"holds": True, "max_abs_diff": 4.2e-07}, "mrope": {"holds": False, "max_abs_diff": 1.07},
                           "flat": {"holds": False, "max_abs_diff": 0.0727}}, "leaked": ["mrope"], "held": ["text+mrope"]}
    source = "Qwen/Qwen2-VL-2B-Instruct config.json (the default config does not run)"
    cells = [{**_cell("qwen2_vl", "sdpa", "mm_isolation", "pass", prefix="arch:"),
              "model": {"label": "qwen2_vl", "model_type": "qwen2_vl", "spec": "arch:qwen2_vl", "config_source": source}}, _cell("qwen2_vl", "sdpa", "mm_parity", "pass", prefix="arch:"),
             _cell("qwen2_vl", "sdpa", "mm_layouts", "pass", prefix="arch:", metrics=layouts),
             *(_cell("qwen2_vl", "eager", c, "pass", prefix="arch:") for c in ("mm_isolation", "mm_parity")),
             _cell("qwen2_vl", "eager", "mm_layouts", "pass", prefix="arch:", metrics=layouts)]
    _write(tmp_path / "mm", "5.25.0", cells)
    block = K.collect_kind(MM, tmp_path / "mm")
    entry = block["cells"]["qwen2_vl"]["sdpa"]["5.25.0"]
    assert entry["verdict"] == "pass" and entry["number"] == 0.0 and "check" not in entry
    assert entry["layouts"] == {"flat": ["differs", 0.0727], "mrope": ["leaks", 1.07], "text+mrope": ["holds", 4.2e-07]}
    assert block["configs"] == {"qwen2_vl": source} and "config" not in entry  # once per model, not per entry
    assert "layouts" not in block["cells"]["qwen2_vl"]["eager"]["5.25.0"]  # eager's, the same as sdpa's, not repeated
    text = "\n".join(render_kind_markdown(block))
    assert "Collator layouts that do not hold on 5.25.0 (sdpa): qwen2\\_vl flat, qwen2\\_vl mrope." in text
    main = {"schema": "packcheck-atlas-support", "schema_version": A.SUPPORT_SCHEMA_VERSION, "packcheck_version": "0.1.0",
            "generated": "2026-12-06", "device": "cpu", "dtype": "float32", "torch": "2.13.0+cpu", "backends": list(A.ATLAS_BACKENDS),
            "checks": ["isolation"], "releases": [], "missing": [], "cells": {}, "transitions": [], "multimodal": K.packed(block)}
    A.write_outputs(main, tmp_path / "out")
    for backend in ("sdpa", "eager"):  # eager's layouts are sdpa's, not stored twice, and answered
        answer = lookup("multimodal:qwen2_vl", backend, "5.25.0", path=tmp_path / "out" / "support.json")
        assert answer.verdict == "pass" and "collator layouts at 5.25.0: flat differs (7.3e-02), mrope leaks (1.1e+00)" in str(answer)
    flags = K.kind_flags(MM, "/tmp/r")
    assert any(f.startswith("--packcheck-models=arch:qwen2_vl,") for f in flags)
    from pytest_packcheck.config.options import OPT_BACKENDS

    assert f"{OPT_BACKENDS}=eager,sdpa,packcheck_flash_ref" in flags  # the suite's backends the atlas has
    assert K.kind_flags(ENC, "/tmp/r", ["encoder:bert"])[0] == "--packcheck-models=encoder:bert"
    assert K.model_type_of("arch:gemma3{vision_config.image_size=64}") == "gemma3" and K.model_type_of("encoder:bert") == "bert"


def test_the_absent_mark_is_what_the_release_says_for_a_model_type_it_lacks():
    from pytest_packcheck.errors import PackcheckUsageError
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec

    with pytest.raises(PackcheckUsageError) as exc:
        resolve_model(parse_model_spec("arch:not_a_model_type_here", "test"), "--packcheck-models")
    assert K.ABSENT_MARK in str(exc.value)


def test_a_model_the_suite_gained_is_run_alone_on_a_measured_release_and_joined(tmp_path, monkeypatch):
    """5.25.0 was measured when the suite had bert only and the block no side checks: the next run measures the side
    checks (the classification heads) alone on bert, then the suite's other models alone (under extra/), keeps bert's
    run, and the block holds both; a third run has nothing to do."""
    _write(tmp_path / "enc", "5.25.0", _pair("bert", "sdpa", "pass", 0))
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None):
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1].split(",")
        checks = next(f for f in flags if f.startswith("--packcheck-checks=")).split("=", 1)[1].split(",")
        calls.append((Path(build).relative_to(tmp_path / "enc").parts[:2], models, checks))
        cells = [c for m in models for c in _pair(K.model_type_of(m), "sdpa", "fail", 0.0036)]
        if checks == list(ENC.side):
            cells = [_cell(K.model_type_of(m), "sdpa", c, "pass", metrics={"max_abs_diff": 1e-07, "head_rows": 3})
                     for m in models for c in checks]
        _write(Path(build), version, cells)
        return {"transformers": version, "cells": len(cells)}

    monkeypatch.setattr(K, "run_release", run_release)
    monkeypatch.setattr(K, "release_architectures", lambda kind, version, build: ["bert"])  # nothing beyond the suite
    K.run_kind_release(ENC, "5.25.0", tmp_path / "enc", log=lambda s: None)
    assert [(c[0][:2], c[2]) for c in calls] == [(("5.25.0", "extra"), list(ENC.side)), (("5.25.0", "extra"), list(ENC.run_checks))]
    assert calls[0][1] == ["encoder:bert"] and set(calls[1][1]) == set(ENC.models) - {"encoder:bert"}
    block = K.collect_kind(ENC, tmp_path / "enc")
    assert block["cells"]["bert"]["sdpa"]["5.25.0"]["verdict"] == "pass"
    assert block["cells"]["modernbert"]["sdpa"]["5.25.0"]["verdict"] == "fail"
    assert block["releases"][0]["cells"] == 2 * len(ENC.models) + 2 and block["releases"][0]["wall_s"] == 60.0
    K.run_kind_release(ENC, "5.25.0", tmp_path / "enc", log=lambda s: None)
    assert len(calls) == 2  # every model of the suite measured, with the side checks: nothing runs


def test_a_malformed_block_is_a_one_line_error_naming_the_file_and_a_plain_model_type_points_to_its_block(tmp_path):
    from pytest_packcheck.errors import PackcheckUsageError

    committed = json.loads((Path(__file__).parents[1] / "reports" / "atlas" / "support.json").read_text())
    assert lookup("encoder:bert", "sdpa", "5.24.0").verdict == "fail"  # the committed block answers
    plain = lookup("bert", "sdpa", "5.24.0")  # the causal-LM text path, with a pointer to the encoder block
    assert any("packcheck lookup encoder:bert sdpa 5.24.0" in n for n in plain.notes)
    assert not any("block measures it too" in n for n in lookup("llama", "sdpa", "5.25.0").notes)
    backend = next(iter(committed["encoders"]["rows"]["bert"]))
    first = committed["encoders"]["rows"]["bert"][backend][0]
    for damage, said in ([[first[0], "9.9.9", first[2]], "names a release not in its releases"],
                         [[first[0], first[1], "oops"], "an entry is 'oops'"],
                         [[first[0], first[1]], "not enough values to unpack"]):
        doc = json.loads(json.dumps(committed))
        doc["encoders"]["rows"]["bert"][backend][0] = damage
        path = tmp_path / f"support-{len(said)}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(PackcheckUsageError) as err:
            lookup("encoder:bert", "sdpa", "5.24.0", path=path)
        assert str(err.value).startswith(f"Support file '{path}' is corrupt: ") and said in str(err.value)
        assert "\n" not in str(err.value)
        # the plain answer does not unpack the block: a damaged block does not take the text-path answer down
        assert lookup("bert", "sdpa", "5.24.0", path=path).verdict == "fail"


def test_every_architecture_of_a_release_is_run_beyond_the_suite_and_one_a_release_lacks_has_no_entry(tmp_path, monkeypatch):
    """The encoders block runs every masked-LM architecture of each release (Kind.all_architectures): 5.25.0, measured
    with the suite alone, runs albert and gte alone (extra/); 5.24.0 has no gte, so the block has no gte entry there
    (not absent, no transition); a sweep between them measures gte as encoder:gte; the reproduce command and the
    block's render say --all-architectures. Planted: a release's list that gains an architecture runs it, a list
    without it leaves no entry."""
    lists = {"5.24.0": ["albert", "bert"], "5.25.0": ["albert", "bert", "gte"]}
    saved = tmp_path / "enc" / K.ARCHITECTURES
    saved.mkdir(parents=True)
    for version, names in lists.items():  # the release environments' answers, as release_architectures keeps them
        (saved / f"{version}.json").write_text(json.dumps(names))
    for version in lists:
        _write(tmp_path / "enc", version, [c for m in ENC.models for c in _pair(K.model_type_of(m), "sdpa", "pass", 0)])
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None):
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1].split(",")
        checks = next(f for f in flags if f.startswith("--packcheck-checks=")).split("=", 1)[1].split(",")
        if checks == list(ENC.side):  # the suite's models measured before the block had its side checks: those alone
            _write(Path(build), version, [_cell(K.model_type_of(m), "sdpa", c, "pass", metrics={"max_abs_diff": 1e-07})
                                          for m in models for c in checks])
            return {"transformers": version, "cells": 2 * len(models)}
        calls.append((version, models, reproduce))
        _write(Path(build), version, [c for m in models for c in _pair(K.model_type_of(m), "sdpa", "fail", 0.0056)])
        return {"transformers": version, "cells": 2 * len(models)}

    monkeypatch.setattr(K, "run_release", run_release)
    for version in lists:
        K.run_kind_release(ENC, version, tmp_path / "enc", log=lambda s: None)
    assert [(v, m) for v, m, _ in calls] == [("5.24.0", ["encoder:albert"]), ("5.25.0", ["encoder:albert", "encoder:gte"])]
    assert "--audit encoders --all-architectures" in calls[0][2]
    assert K.release_models(ENC, "5.25.0", tmp_path / "enc")[-2:] == ["encoder:albert", "encoder:gte"]
    block = K.collect_kind(ENC, tmp_path / "enc")
    assert set(block["cells"]["gte"]["sdpa"]) == {"5.25.0"} and block["all_architectures"] is True
    assert block["cells"]["albert"]["sdpa"]["5.24.0"]["verdict"] == "fail"
    assert not [t for t in block["transitions"] if t["model_type"] in ("gte", "albert")]
    text = "\n".join(render_kind_markdown(K.packed(block)))
    assert "--all-architectures`'s models" in text and "**encoder:gte** / sdpa: ❌ leak 5.25.0" in text
    from pytest_packcheck.atlas.kinds_render import reproduce

    assert "--models encoder:gte " in reproduce(block, "5.25.0", "gte", "sdpa")
    seen: list = []
    monkeypatch.setattr(K, "run_kind_release", lambda kind, version, sub, specs, log=print, runner=None:
                        seen.append(specs) or {"error": "planted"})
    K.measure_between(ENC, "5.24.1", ["gte", "bert"], tmp_path / "sweep")
    assert seen == [["encoder:bert", "encoder:gte"]]


def test_the_video_row_and_the_processor_rows_ride_beside_the_verdict_and_a_release_measured_without_them_runs_them(tmp_path, monkeypatch):
    """The multimodal block's side checks (mm_videos, mm_processor: Kind.side) fill an entry's ``videos`` / ``processor``
    and never its verdict; a skipped one fills nothing; a release measured before the block ran them runs those checks
    alone on the models it holds (extra/), then nothing. Planted: a video row that leaks on 5.25.0 under an isolation
    that passes stays a pass with ``videos`` = fail / leak; a processor layout that leaks reads ``leaks``."""
    processor = {"layouts": {"as_is": {"holds": False, "max_abs_diff": 0.31, "isolation": 0.12},
                             "pixels": {"holds": True, "max_abs_diff": 2e-07, "isolation": 0.0},
                             "dropped": {"holds": False, "max_abs_diff": 0.2, "isolation": 0.0}},
                 "leaked": ["as_is", "dropped"], "held": ["pixels"]}  # dropped: not as alone, nothing moved: differs
    base = [_cell("qwen2_vl", "sdpa", c, "pass", prefix="arch:") for c in ("mm_isolation", "mm_parity")]
    _write(tmp_path / "mm", "5.24.0", base)
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None, extras=()):
        assert [e.split("==")[0] for e in extras] == ["pillow"]  # the processors' image_utils need it in the env
        checks = next(f for f in flags if f.startswith("--packcheck-checks=")).split("=", 1)[1].split(",")
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1].split(",")
        calls.append((version, models, checks))
        _write(Path(build), version, [
            {**_cell("qwen2_vl", "sdpa", "mm_videos", "fail", "leak", prefix="arch:", metrics={"max_abs_diff": 0.2041}),
             "diagnosis": {"cause": "leak"}},
            _cell("qwen2_vl", "sdpa", "mm_processor", "pass", prefix="arch:", metrics=processor),
            _cell("qwen2_vl", "eager", "mm_processor", "skipped", prefix="arch:", metrics={}, message="needs torchvision")])
        return {"transformers": version, "cells": 3}

    monkeypatch.setattr(K, "run_release", run_release)
    K.run_kind_release(MM, "5.24.0", tmp_path / "mm", ["arch:qwen2_vl"], log=lambda s: None)
    assert calls == [("5.24.0", ["arch:qwen2_vl"], ["mm_videos", "mm_processor"])]
    K.run_kind_release(MM, "5.24.0", tmp_path / "mm", ["arch:qwen2_vl"], log=lambda s: None)
    assert len(calls) == 1  # every check of the block ran: nothing runs
    block = K.collect_kind(MM, tmp_path / "mm")
    entry = block["cells"]["qwen2_vl"]["sdpa"]["5.24.0"]
    assert entry["verdict"] == "pass" and entry["videos"] == ["fail", 0.204, "leak"]
    assert entry["processor"] == {"as_is": ["leaks", 0.31], "dropped": ["differs", 0.2], "pixels": ["holds", 2e-07]}
    assert "eager" not in block["cells"]["qwen2_vl"] and block["side_checks"] == list(MM.side)  # a side check makes no entry
    text = "\n".join(render_kind_markdown(K.packed(block)))
    assert "- **qwen2\\_vl**: 5.24.0: ❌ leak (max |Δ| 2.0e-01)" in text
    assert "- **qwen2\\_vl**: 5.24.0: as_is leaks, dropped differs, pixels holds (max |Δ| 3.1e-01)" in text
    main = {"schema": "packcheck-atlas-support", "schema_version": A.SUPPORT_SCHEMA_VERSION, "packcheck_version": "0.1.0",
            "generated": "2026-12-06", "device": "cpu", "dtype": "float32", "torch": "2.13.0+cpu", "backends": list(A.ATLAS_BACKENDS),
            "checks": ["isolation"], "releases": [], "missing": [], "cells": {}, "transitions": [], "multimodal": K.packed(block)}
    A.write_outputs(main, tmp_path / "out")
    answer = str(lookup("multimodal:qwen2_vl", "sdpa", "5.24.0", path=tmp_path / "out" / "support.json"))
    assert "a row with a video at 5.24.0: fail (leak), text logits max |Δ| 2.0e-01" in answer
    assert "the processor's rows through DataCollatorWithFlattening at 5.24.0: as_is leaks (3.1e-01)" in answer


def test_the_docs_page_of_the_newest_release_is_generated_from_the_blocks(build):
    """docs/hooks.py's reference/atlas-newest.md (kinds_render.newest_markdown): the newest release's models that are
    not as alone on every backend, with each backend's cause and number, and the ones that pack; a model fixed on the
    newest release is not listed as leaking (planted: bert leaks up to 5.24.0, passes on 5.25.0; modernbert leaks on
    5.25.0), nor is one only an older release had."""
    from pytest_packcheck.atlas.kinds_render import newest_markdown

    block = K.collect_kind(ENC, build)
    text = newest_markdown({"encoders": K.packed(block)})
    assert "## Encoders and embedding models on transformers 5.25.0" in text
    assert "| encoder:modernbert | — | ❌ leak (encoder_isolation 3.6e-03) | — |" in text
    assert "Pack on every backend measured: bert, roberta." in text and "deberta" not in text
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
    import hooks

    assert "reference/atlas-newest.md" in hooks.PAGES and hooks.newest_page().startswith("# The newest release")


def test_the_multimodal_block_runs_every_vlm_of_a_release_at_its_own_tiny_spec(tmp_path, monkeypatch):
    """The multimodal block over every architecture: a release's list (pixels.multimodal_specs in its environment:
    specs, not model_types) adds arch:glm4v and SmolVLM at its tiny spec; the block keeps that spec ('specs'), the
    reproduce command and a sweep build it the same way."""
    saved = tmp_path / "mm" / K.ARCHITECTURES
    saved.mkdir(parents=True)
    smol = "vlm:smolvlm{vision_config.image_size=128}"
    (saved / "5.25.0.json").write_text(json.dumps(["arch:qwen2_vl", "arch:glm4v", smol]))
    _write(tmp_path / "mm", "5.25.0", [_cell(K.model_type_of(m), "sdpa", c, "skipped", prefix="arch:", metrics={})
                                       for m in MM.models for c in MM.run_checks])  # the suite, every check run
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None, extras=()):
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1]
        calls.append(models)
        cells = [{**_cell("glm4v", "sdpa", "mm_isolation", "skipped", prefix="arch:", message="Glm4vConfig has no vision_start_token_id")},
                 {**_cell("smolvlm", "sdpa", "mm_isolation", "pass", prefix="vlm:"),
                  "model": {"label": "smolvlm-vlm", "model_type": "smolvlm", "spec": smol}}]
        _write(Path(build), version, cells)
        return {"transformers": version, "cells": 2}

    monkeypatch.setattr(K, "run_release", run_release)
    assert "all_architectures" not in K.collect_kind(MM, tmp_path / "mm")  # the suite alone so far: not every VLM
    K.run_kind_release(MM, "5.25.0", tmp_path / "mm", log=lambda s: None)
    assert calls == [f"arch:glm4v,{smol},{MM.rows[0][2]}"]  # and the LLaVA-NeXT tiled row: llava_next is in the suite
    block = K.collect_kind(MM, tmp_path / "mm")
    assert block["specs"] == {"smolvlm": smol} and block["all_architectures"] is True
    assert block["cells"]["smolvlm"]["sdpa"]["5.25.0"]["verdict"] == "pass"
    from pytest_packcheck.atlas.kinds_render import reproduce

    assert f"--models '{smol}'" in reproduce(block, "5.25.0", "smolvlm", "sdpa")
    assert "--models arch:glm4v " in reproduce(block, "5.25.0", "glm4v", "sdpa")
    assert K.spec_of(MM, "smolvlm") == smol and K.spec_of(MM, "glm4v") == "arch:glm4v" and K.spec_of(MM, "qwen2_vl") == "arch:qwen2_vl"


def test_a_named_row_is_measured_alone_on_each_release_its_family_has_and_kept_apart_from_the_family(tmp_path, monkeypatch):
    """The multimodal block's LLaVA-NeXT row with two grid pinpoints (Kind.rows: llava_next_tiles) is measured alone
    on each committed release whose llava_next is present (the release's other entries kept, its models count + 1),
    ``absent`` with no run where the family is absent; its cells (model_type llava_next, the row's spec) are the
    row's, never the family's; the block names its spec and finds its transition. Planted: the tiled row leaks on
    5.24.0 while the family's one-tile row passes there."""
    name, family, spec = MM.rows[0]
    assert (name, family) == ("llava_next_tiles", "llava_next") and K.model_type_of(spec) == name
    tiny = K.spec_of(MM, family)
    assert K.spec_of(MM, name) == spec and K.model_type_of(tiny) == family and tiny != spec
    for version, present in (("4.30.0", False), ("5.24.0", True), ("5.25.0", True)):
        cells = [_cell(family, "sdpa", "mm_isolation", "pass", prefix="vlm:")] if present else \
            [{**c, "model": {**c["model"], "spec": tiny}} for c in _absent(family, "sdpa", version)]
        _write(tmp_path / "mm", version, cells)
    committed = K.collect_kind(MM, tmp_path / "mm")
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None, extras=()):
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1]
        calls.append((version, models))
        status = "fail" if version == "5.24.0" else "pass"
        cell = _cell(family, "sdpa", "mm_isolation", status, "leak" if status == "fail" else None,
                     0.031 if status == "fail" else 0.0, prefix="vlm:")
        _write(Path(build), version, [{**cell, "model": {**cell["model"], "spec": spec}}])
        return {"transformers": version, "cells": 1}

    monkeypatch.setattr(K, "run_release", run_release)
    block = K.add_rows(MM, unpack(K.packed(committed)), tmp_path / "build", log=lambda s: None)
    assert calls == [("5.24.0", spec), ("5.25.0", spec)]  # none on 4.30.0, where llava_next is absent
    row = block["cells"][name]["sdpa"]
    assert row["4.30.0"]["verdict"] == "absent" and row["5.25.0"]["verdict"] == "pass"
    assert (row["5.24.0"]["verdict"], row["5.24.0"]["causes"], row["5.24.0"]["number"]) == ("fail", ["leak"], 0.031)
    assert {v: e["verdict"] for v, e in block["cells"][family]["sdpa"].items()} == \
        {"4.30.0": "absent", "5.24.0": "pass", "5.25.0": "pass"}  # the family's row untouched
    assert [r["models"] for r in block["releases"]] == [r["models"] + (r["transformers"] != "4.30.0")
                                                        for r in committed["releases"]]
    assert K.add_rows(MM, block, tmp_path / "build", log=lambda s: None) == block and len(calls) == 2  # measured once
    again = K.collect_kind(MM, tmp_path / "empty", committed=K.packed(block))
    assert again["specs"][name] == spec
    moved = [(t["model_type"], t["last_before"], t["first_after"]) for t in again["transitions"]]
    assert moved == [(name, "5.24.0", "5.25.0")]


def test_the_classification_heads_ride_beside_each_encoder_entry_per_release_and_never_its_verdict(build, monkeypatch):
    """The encoders block's side checks (encoder_token_cls, encoder_seq_cls) measured on each committed release for
    the suite's models present there (add_side: one run per release, those checks alone): ``token_cls`` = [verdict,
    worse of logits / loss |Δ|, cause], ``seq_cls`` = [verdict, logits rows, cause]; the entries' verdicts unchanged,
    each release its own fields though one packed run shares its entry; atlas.md and the newest page print them.
    Planted: modernbert's token-classification head leaks on 5.24.0 alone (1.2e-02), every sequence-classification
    head pools once per packed row (pooled_head, 1 row for 3 examples; a finding run once per model, on the sdpa
    entry); roberta's crashes on 5.25.0 (error, shrunk_crash) and refuses the row on 5.23.0 (unsupported,
    no_position_ids); deberta-v2's token head refuses sdpa as its entry does (left out)."""
    committed = K.collect_kind(ENC, build)
    calls: list = []

    def run_release(version, build, log=print, runner=None, flags=None, reproduce=None, extras=()):
        models = next(f for f in flags if f.startswith("--packcheck-models=")).split("=", 1)[1].split(",")
        checks = next(f for f in flags if f.startswith("--packcheck-checks=")).split("=", 1)[1]
        calls.append((version, models, checks))
        cells = []
        for spec in models:
            m = K.model_type_of(spec)
            leak = m == "modernbert" and version == "5.24.0"
            if m == "deberta-v2":  # refuses sdpa, as its entry says: nothing to add
                cells.append(_cell(m, "sdpa", "encoder_token_cls", "unsupported", metrics={}, message="refuses sdpa"))
            else:
                cells.append(_cell(m, "sdpa", "encoder_token_cls", "fail" if leak else "pass", "leak" if leak else None,
                                   metrics={"max_abs_diff": 0.012 if leak else 2.1e-07, "loss_delta": 0.004 if leak else 1e-07}))
            crash = m == "roberta" and version == "5.25.0"  # a crash is said, never a missing field
            refused = m in ("roberta", "deberta-v2") and version == "5.23.0"  # so is a head that refuses the row
            status, cause = ("error", "shrunk_crash") if crash else ("unsupported", "no_position_ids") if refused else ("fail", "pooled_head")
            cells.append({**_cell(m, "sdpa", "encoder_seq_cls", status, cause,
                                  metrics={"head_rows": 1, "examples": 3} if status == "fail" else {}),
                          "role": "finding", "backend": None})  # a stack finding: once per model, no backend
        _write(Path(build), version, cells)
        return {"transformers": version, "cells": len(cells)}

    monkeypatch.setattr(K, "run_release", run_release)
    block = K.add_side(ENC, unpack(K.packed(committed)), build.parent / "side-build", log=lambda s: None)
    assert [(v, [K.model_type_of(m) for m in ms], c) for v, ms, c in calls] == [
        ("5.23.0", ["bert", "roberta", "deberta-v2"], "encoder_token_cls,encoder_seq_cls"),  # modernbert absent there
        ("5.24.0", ["bert", "roberta", "modernbert"], "encoder_token_cls,encoder_seq_cls"),
        ("5.25.0", ["bert", "roberta", "modernbert"], "encoder_token_cls,encoder_seq_cls")]
    modern = block["cells"]["modernbert"]["sdpa"]
    assert modern["5.24.0"]["token_cls"] == ["fail", 0.012, "leak"] and modern["5.25.0"]["token_cls"] == ["pass", 2.1e-07]
    assert modern["5.25.0"]["seq_cls"] == ["fail", 1, "pooled_head"]
    assert block["cells"]["roberta"]["sdpa"]["5.25.0"]["seq_cls"] == ["error", None, "shrunk_crash"]
    assert block["cells"]["roberta"]["sdpa"]["5.23.0"]["seq_cls"] == ["unsupported", None, "no_position_ids"]
    assert "token_cls" not in block["cells"]["deberta-v2"]["sdpa"]["5.23.0"]  # its entry says unsupported already
    assert block["cells"]["deberta-v2"]["sdpa"]["5.23.0"]["seq_cls"] == ["unsupported", None, "no_position_ids"]  # its own
    assert {v: (e["verdict"], e.get("number")) for v, e in modern.items()} == \
        {v: (e["verdict"], e.get("number")) for v, e in committed["cells"]["modernbert"]["sdpa"].items()}
    assert "token_cls" not in committed["cells"]["modernbert"]["sdpa"]["5.25.0"]  # the committed block untouched
    again = K.collect_kind(ENC, build.parent / "empty", committed=K.packed(block))
    assert again["side_checks"] == ["encoder_token_cls", "encoder_seq_cls"]
    assert again["cells"]["modernbert"]["sdpa"]["5.24.0"]["token_cls"] == ["fail", 0.012, "leak"]
    text = "\n".join(render_kind_markdown(K.packed(again)))
    assert "- **modernbert**: 5.24.0: ❌ leak (max |Δ| 1.2e-02); 5.25.0: ✅ (max |Δ| 2.1e-07)" in text
    assert "- **bert**: 5.23.0 .. 5.25.0: ❌ pooled head (1 logits row)" in text
    from pytest_packcheck.atlas.kinds_render import newest_markdown

    page = newest_markdown({"encoders": K.packed(again)})
    assert "- **modernbert**: token classification: ✅ 2.1e-07; sequence classification: ❌ pooled head (1 logits row)" in page
    assert "Classification heads on a packed row on 5.25.0" in page
    main = {"schema": "packcheck-atlas-support", "schema_version": A.SUPPORT_SCHEMA_VERSION, "packcheck_version": "0.1.0",
            "generated": "2026-12-06", "device": "cpu", "dtype": "float32", "torch": "2.13.0+cpu", "backends": list(A.ATLAS_BACKENDS),
            "checks": ["isolation"], "releases": [{"transformers": "5.25.0", "architectures": 1, "cells": 1}], "missing": [],
            "cells": {"llama": {"sdpa": {"5.25.0": {"verdict": "pass", "causes": [], "check": "isolation", "number": 0.0}}}},
            "transitions": []}
    A.write_outputs({**main, "encoders": K.packed(again)}, build.parent / "out")
    notes = lookup("encoder:modernbert", "sdpa", "5.24.0", path=build.parent / "out" / "support.json").notes
    assert "a token-classification head on the packed row at 5.24.0: fail (leak), logits / loss max |Δ| 1.2e-02" in notes
    assert "the model's own sequence-classification head on a row of 3 examples at 5.24.0: fail (pooled_head), 1 logits row" in notes
    notes = lookup("encoder:roberta", "sdpa", "5.25.0", path=build.parent / "out" / "support.json").notes
    assert [n for n in notes if "classification" in n] == [
        "a token-classification head on the packed row at 5.25.0: pass, logits / loss max |Δ| 2.1e-07",
        "the model's own sequence-classification head on a row of 3 examples at 5.25.0: error (shrunk_crash)"]  # said
