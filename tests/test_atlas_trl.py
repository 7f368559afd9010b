"""The atlas's TRL axis: the releases, one resumable run per TRL release, the reduction to the ``trl`` block
(a planted transition, a missing release, a failing cell), its Markdown section, the lookup answer with a TRL
version, and the block riding along every render of the atlas. Fast: planted results documents and stand-in
environments, no model is built."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_packcheck import atlas as A
from pytest_packcheck.atlas import command as C
from pytest_packcheck.atlas import trl as T
from pytest_packcheck.atlas.trl_render import render_trl_markdown, runs_text, trl_runs
from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.results.schema import SCHEMA_VERSION
from pytest_packcheck.support import lookup

REPO = Path(__file__).resolve().parents[1]


def _cell(model: str, backend: str, check: str, status: str, cause: str | None = None, number: float | None = 0.0,
          strategy: str = "bfd") -> dict:
    metrics = {"effective": {"packing": check == "sft", "padding_free": True, "packing_strategy": strategy,
                             "collator": "DataCollatorForLanguageModeling", "use_cache": False}}
    if number is not None:
        metrics["loss_delta"] = number
    return {"cell_id": f"{model}-{backend}-{check}-float32", "model": {"label": model, "model_type": model, "spec": f"arch:{model}"},
            "backend": backend, "check": check, "dtype": "float32", "status": status, "metrics": metrics,
            "message": f"{check} {status}", "cause": cause, "role": "correctness",
            "causes": [{"cause": cause, "evidence": {}}] if cause else [], "findings": []}


def _doc(trl: str, cells: list[dict]) -> dict:
    env = {"transformers": "5.24.0", "torch": "2.13.0+cpu", "trl": trl}
    return {"schema_version": SCHEMA_VERSION, "packcheck_version": "0.1.0", "command": "planted",
            "environment": env,  # a run in trl==<trl>'s environment records that TRL (atlas.release_run.check_recorded_version)
            "settings": {"models": sorted({c["model"]["spec"] for c in cells}), "backends": list(T.TRL_BACKENDS),
                         "versions": []},
            "cells": [{**c, "env": {"environment": env, "versions": {"trl": trl, "transformers": "5.24.0"}}} for c in cells]}


def _write(build: Path, trl: str, cells: list[dict], wall: float = 60.0) -> None:
    folder = build / trl
    folder.mkdir(parents=True)
    (folder / "packcheck-matrix.json").write_text(json.dumps(_doc(trl, cells)))
    (folder / A.DONE_MARKER).write_text(json.dumps({"trl": trl, "versions": {"trl": trl, "transformers": "5.24.0",
                                                                             "accelerate": "1.15.0", "datasets": "5.2.0"},
                                                    "cells": len(cells), "wall_s": wall, "child_cpu_s": wall / 2}))


def _planted(build: Path) -> None:
    """llama / sdpa padding_free: mask_override on 0.19.1, pass on 0.24.0 and 1.16.0 (a transition); llama / sdpa
    packing: ffd on 0.19.1 with completion_mask, bfd after; qwen2 / sdpa packing errors on 0.24.0 only (a failing
    cell between two passes: two transitions); llama / flash packing skipped (stand_in_differs) on 0.19.1, not run
    on 0.24.0, passing on 1.16.0 (a transition across the release the row lacks). 0.22.2 is planned, never measured."""
    _write(build, "0.19.1", [
        _cell("llama", "sdpa", "sft_padding_free", "fail", "mask_override", 0.0123),
        _cell("llama", "sdpa", "sft", "fail", "completion_mask", 0.0044, strategy="ffd"),
        _cell("llama", "packcheck_flash_ref", "sft", "skipped", "stand_in_differs", 0.0044, strategy="ffd"),
        _cell("qwen2", "sdpa", "sft", "pass", number=2e-7),
        # not the axis's: another check, another backend, another dtype
        _cell("llama", "sdpa", "sft_padded", "fail", "padded_normalisation"), _cell("llama", "eager", "sft", "pass"),
        {**_cell("llama", "sdpa", "sft", "fail", "leak", 9.0), "dtype": "bfloat16"}])
    _write(build, "0.24.0", [
        _cell("llama", "sdpa", "sft_padding_free", "pass", number=9.5e-7), _cell("llama", "sdpa", "sft", "pass", number=5e-7),
        _cell("qwen2", "sdpa", "sft", "error", "crash", None)])
    _write(build, "1.16.0", [
        _cell("llama", "sdpa", "sft_padding_free", "pass", number=4.8e-7), _cell("llama", "sdpa", "sft", "pass", number=3e-7),
        _cell("qwen2", "sdpa", "sft", "pass", number=1e-7), _cell("llama", "packcheck_flash_ref", "sft", "pass", number=3e-7)])
    (build / "notes").mkdir()  # not a release: skipped


PLANNED = ["0.19.1", "0.22.2", "0.24.0", "1.16.0"]


# ----------------------------------------------------------------------------------------------------------------
# plan and flags


def test_trl_releases_are_the_latest_patch_of_each_minor_from_0_19(monkeypatch):
    from pytest_packcheck.analysis import bisect

    names = ["0.18.2", "0.19.0", "0.19.1", "0.22.1", "0.22.2", "1.0.0rc1", "1.0.0", "1.16.0"]
    page = {"files": [{"filename": f"trl-{v}-py3-none-any.whl", "yanked": False} for v in names]}
    monkeypatch.setattr(bisect, "fetch_index_page", lambda lib: page if lib == "trl" else pytest.fail(lib))
    assert T.trl_index_releases() == ["0.19.1", "0.22.2", "1.0.0", "1.16.0"]
    assert T.trl_index_releases(until="0.22") == ["0.19.1", "0.22.2"]


def test_trl_flags_name_the_families_backends_and_modes():
    flags = T.trl_flags("/r")
    assert "--packcheck-models=arch:llama,arch:qwen2,arch:qwen3,arch:gemma3_text,arch:gpt_neox,arch:mistral" in flags
    assert "--packcheck-attn=sdpa,packcheck_flash_ref" in flags and "--packcheck-checks=sft,sft_padding_free" in flags
    assert "--packcheck-resume" in flags and "--packcheck-report-dir=/r" in flags
    from pytest_packcheck.checks.registry import SPECS

    assert all("trl" in SPECS[m].requires for m in T.TRL_MODES)  # the modes are the registry's SFT checks


# ----------------------------------------------------------------------------------------------------------------
# one release, resumable


def _ensure(combo, log=None):
    from pytest_packcheck.versions import envs

    trl = combo.requirements[0].split("==")[1]
    return envs.VersionEnv(combo, Path("/tmp/env"), Path(sys.executable), {"trl": trl, "transformers": "5.24.0"}, False, 0.0)


def _report_dir(args: list[str]) -> Path:
    return Path(next(a.split("=", 1)[1] for a in args if a.startswith("--packcheck-report-dir=")))


def test_a_killed_trl_release_resumes_and_a_done_one_is_not_run_again(tmp_path):
    calls = []

    def killed(args, **kw):
        calls.append(args)
        (_report_dir(args) / "packcheck-journal.jsonl").write_text("{}\n")
        return subprocess.CompletedProcess(args, -9)

    record = T.run_trl_release("0.24.0", tmp_path, log=lambda s: None, runner=killed, ensure=_ensure)
    assert "error" in record and "exit -9" in record["error"] and (tmp_path / "0.24.0" / "atlas-error.json").exists()

    def finishes(args, **kw):
        calls.append(args)
        assert "--packcheck-resume" in args and kw["env"]["PACKCHECK_ENV_LABEL"] == "trl==0.24.0"
        assert "PYTHONPATH" not in kw["env"] and (_report_dir(args) / "packcheck-journal.jsonl").exists()
        (_report_dir(args) / "packcheck-matrix.json").write_text(json.dumps(_doc("0.24.0", [_cell("llama", "sdpa", "sft", "pass")])))
        return subprocess.CompletedProcess(args, 1)  # failing cells exit 1: still a finished run

    record = T.run_trl_release("0.24.0", tmp_path, log=lambda s: None, runner=finishes, ensure=_ensure)
    assert record["cells"] == 1 and record["versions"]["transformers"] == "5.24.0"
    assert not (tmp_path / "0.24.0" / "atlas-error.json").exists()

    def must_not_run(args, **kw):
        raise AssertionError("a done release ran again")

    assert T.run_trl_release("0.24.0", tmp_path, log=lambda s: None, runner=must_not_run, ensure=_ensure)["cells"] == 1
    assert len(calls) == 2


def test_no_environment_is_a_recorded_error_and_the_next_release_runs(tmp_path):
    from pytest_packcheck.versions.envs import EnvError

    def ensure(combo, log=None):
        if combo.requirements == ("trl==0.24.0",):
            raise EnvError("No solution found: trl==0.24.0 needs transformers<5")
        return _ensure(combo)

    ran = []

    def runner(args, **kw):
        ran.append(kw["env"]["PACKCHECK_ENV_LABEL"])
        (_report_dir(args) / "packcheck-matrix.json").write_text(json.dumps(_doc(kw["env"]["PACKCHECK_ENV_LABEL"].split("==")[1], [])))
        return subprocess.CompletedProcess(args, 0)

    records = T.generate_trl(["0.19.1", "0.24.0"], None, tmp_path, log=lambda s: None, runner=runner, ensure=ensure)
    assert "transformers<5" in records[0]["error"] and ran == ["trl==0.19.1"] and len(records) == 2


def _row_block(verdicts: dict[str, str]) -> dict:
    return {"releases": [{"trl": v} for v in verdicts],
            "cells": {"llama": {"sft": {"sdpa": {v: {"verdict": x, "causes": []} for v, x in verdicts.items()}}}}}


def test_next_release_takes_the_ends_then_halves_a_gap_with_a_transition_before_a_wider_quiet_one():
    planned = ["0.19.1", "0.20.0", "0.21.0", "0.22.2", "0.23.1", "0.24.0", "0.25.1", "0.26.2", "0.27.2", "0.28.0"]
    assert T.next_release(planned, _row_block({})) == "0.28.0"
    assert T.next_release(planned, _row_block({"0.28.0": "pass"})) == "0.19.1"
    # 0.19.1 fail .. 0.22.2 pass: the transition's gap (2 releases) before the quiet one (5 releases)
    assert T.next_release(planned, _row_block({"0.19.1": "fail", "0.22.2": "pass", "0.28.0": "pass"})) == "0.20.0"
    assert T.next_release(planned, _row_block({"0.19.1": "fail", "0.22.2": "pass", "0.28.0": "pass"}), {"0.20.0"}) == "0.21.0"
    pinned = _row_block({"0.19.1": "fail", "0.20.0": "fail", "0.21.0": "pass", "0.22.2": "pass", "0.28.0": "pass"})
    assert T.next_release(planned, pinned) == "0.25.1"  # no transition gap left: the widest quiet run's middle
    assert T.next_release(["0.19.1"], _row_block({"0.19.1": "pass"})) is None


def test_generate_pins_a_transition_first_and_skips_what_is_measured(tmp_path):
    order = []

    def runner(args, **kw):
        version = kw["env"]["PACKCHECK_ENV_LABEL"].split("==")[1]
        order.append(version)
        status = "pass" if A.version_key(version) >= A.version_key("0.24.0") else "fail"
        cells = [_cell("llama", "sdpa", "sft_padding_free", status, None if status == "pass" else "mask_override")]
        (_report_dir(args) / "packcheck-matrix.json").write_text(json.dumps(_doc(version, cells)))
        return subprocess.CompletedProcess(args, 0)

    planned = ["0.19.1", "0.20.0", "0.21.0", "0.22.2", "0.23.1", "0.24.0", "0.25.1"]
    T.generate_trl(planned, None, tmp_path / "a", log=lambda s: None, runner=runner, ensure=_ensure)
    assert order == ["0.25.1", "0.19.1", "0.22.2", "0.23.1", "0.24.0", "0.20.0", "0.21.0"]
    block = T.collect_trl(tmp_path / "a", planned)
    assert [(t["last_before"], t["first_after"]) for t in block["transitions"]] == [("0.23.1", "0.24.0")]
    # seeded: the committed releases and the done folders are not run again
    order.clear()
    committed = {**block, "releases": [r for r in block["releases"] if r["trl"] != "0.20.0"]}
    _write(tmp_path / "b", "0.21.0", [])
    T.generate_trl(planned, committed, tmp_path / "b", log=lambda s: None, runner=runner, ensure=_ensure)
    assert order == ["0.20.0"]


# ----------------------------------------------------------------------------------------------------------------
# reduction, transitions, rendering


def test_reduction_keeps_the_axis_cells_with_cause_number_and_configuration(tmp_path):
    _planted(tmp_path)
    block = T.collect_trl(tmp_path, PLANNED)
    assert [r["trl"] for r in block["releases"]] == ["0.19.1", "0.24.0", "1.16.0"] and block["missing"] == ["0.22.2"]
    assert block["releases"][0]["transformers"] == "5.24.0" and block["releases"][0]["versions"]["datasets"] == "5.2.0"
    assert block["releases"][0]["command"] == "packcheck atlas --trl --releases 0.19.1"
    llama = block["cells"]["llama"]
    assert set(llama) == {"sft", "sft_padding_free"} and set(llama["sft"]) == {"sdpa", "packcheck_flash_ref"}
    old = llama["sft_padding_free"]["sdpa"]["0.19.1"]
    assert old["verdict"] == "fail" and old["causes"] == ["mask_override"] and old["number"] == 0.0123 and old["message"]
    assert llama["sft"]["sdpa"]["0.19.1"]["effective"]["packing_strategy"] == "ffd"
    assert "use_cache" not in llama["sft"]["sdpa"]["0.19.1"]["effective"]  # only EFFECTIVE_KEYS
    assert "message" not in llama["sft"]["sdpa"]["0.24.0"]  # none on a pass
    flash = llama["sft"]["packcheck_flash_ref"]["0.19.1"]
    assert flash["verdict"] == "skipped" and flash["causes"] == ["stand_in_differs"] and "number" not in flash
    assert llama["sft"]["sdpa"]["0.19.1"]["number"] == 0.0044  # the bfloat16 cell (leak, 9.0) is not the axis's
    assert block["cells"]["qwen2"]["sft"]["sdpa"]["0.24.0"]["verdict"] == "error"


def test_transitions_bracket_changes_between_measured_releases(tmp_path):
    _planted(tmp_path)
    block = T.collect_trl(tmp_path, PLANNED)
    found = {(t["model_type"], t["mode"], t["backend"], t["last_before"], t["first_after"]) for t in block["transitions"]}
    assert found == {("llama", "sft_padding_free", "sdpa", "0.19.1", "0.24.0"), ("llama", "sft", "sdpa", "0.19.1", "0.24.0"),
                     ("qwen2", "sft", "sdpa", "0.19.1", "0.24.0"), ("qwen2", "sft", "sdpa", "0.24.0", "1.16.0"),
                     ("llama", "sft", "packcheck_flash_ref", "0.19.1", "1.16.0")}
    t = next(t for t in block["transitions"] if t["mode"] == "sft_padding_free")
    assert t["before"] == {"verdict": "fail", "causes": ["mask_override"], "number": 0.0123}
    assert t["after"]["verdict"] == "pass"


def test_markdown_section_lines_per_family_mode_and_backend(tmp_path):
    _planted(tmp_path)
    block = T.collect_trl(tmp_path, PLANNED)
    md = "\n".join(render_trl_markdown(block))
    assert ("- **llama** / padding_free: sdpa: ❌ mask override up to 0.19.1 (loss Δ ≤ 1.2e-02), "
            "✅ from 0.24.0 (loss Δ ≤ 9.5e-07)\n") in md
    assert "- **qwen2** / packing=True: sdpa: ✅ up to 0.19.1 (loss Δ ≤ 2.0e-07), 💥 crash 0.24.0, ✅ from 1.16.0 (loss Δ ≤ 1.0e-07)\n" in md
    assert ("- **llama** / packing=True: sdpa: ❌ completion mask up to 0.19.1 (loss Δ ≤ 4.4e-03), ✅ from 0.24.0 (loss Δ ≤ 5.0e-07); "
            "packcheck_flash_ref: ⏭️ stand in differs up to 0.19.1, ✅ from 1.16.0 (loss Δ ≤ 3.0e-07)\n") in md
    assert "Not measured yet: 0.22.2 (resume: `packcheck atlas --trl`)." in md
    assert "- 0.19.1: packing_strategy ffd" in md and "- 0.24.0 .. 1.16.0: packing_strategy bfd" in md
    assert "| llama | padding_free | sdpa | 0.19.1 | 0.24.0 | ❌ mask override (loss Δ 1.2e-02) | ✅ (loss Δ 9.5e-07) |" in md
    assert "| 0.19.1 | 5.24.0 | 1.15.0 | 5.2.0 | 7 | 60.0 | 30.0 | 10.0 |" in md  # 7 cells run, 3 (family, backend) pairs kept


def test_runs_skip_a_release_the_row_lacks():
    row = {"0.19.1": {"verdict": "pass", "causes": [], "number": 1e-7}, "1.16.0": {"verdict": "pass", "causes": [], "number": 3e-7}}
    runs = trl_runs(row, ["0.19.1", "0.24.0", "1.16.0"])
    assert runs == [{"first": "0.19.1", "last": "1.16.0", "label": "✅", "number": 3e-7}]
    assert runs_text(runs) == "✅ 0.19.1 .. 1.16.0 (loss Δ ≤ 3.0e-07)"


def test_seeded_from_the_committed_block_a_rerun_replaces_its_release(tmp_path):
    _planted(tmp_path / "a")
    committed = T.collect_trl(tmp_path / "a", PLANNED)
    _write(tmp_path / "b", "0.24.0", [_cell("llama", "sdpa", "sft_padding_free", "fail", "leak", 0.5)])
    block = T.collect_trl(tmp_path / "b", PLANNED, committed)
    assert [r["trl"] for r in block["releases"]] == ["0.19.1", "0.24.0", "1.16.0"]
    row = block["cells"]["llama"]["sft_padding_free"]["sdpa"]
    assert row["0.24.0"]["causes"] == ["leak"] and row["0.19.1"]["causes"] == ["mask_override"]
    assert "sft" not in block["cells"]["llama"] or "0.24.0" not in block["cells"]["llama"]["sft"]["sdpa"]  # replaced whole


# ----------------------------------------------------------------------------------------------------------------
# the command and lookup


@pytest.fixture
def rendered(tmp_path):
    """A transformers atlas (support.json) and the TRL axis over it, through ``main_trl`` with stand-ins."""
    from tests.test_atlas import _planted_atlas

    _planted_atlas(tmp_path / "build")
    A.write_outputs(A.collect(tmp_path / "build"), tmp_path / "out")
    _planted(tmp_path / "trl")
    rc = C.main_trl(PLANNED, tmp_path / "trl", tmp_path / "out", render_only=True, log=lambda s: None)
    assert rc == 0
    return tmp_path / "out"


def test_main_trl_writes_trl_json_the_support_block_and_the_markdown(rendered):
    block = json.loads((rendered / "trl.json").read_text())
    support = json.loads((rendered / "support.json").read_text())
    assert block["schema"] == "packcheck-atlas-trl" and support["trl"] == block and support["schema_version"] == 1
    assert "llama" in support["cells"]  # the transformers axis is kept
    md = (rendered / "atlas.md").read_text()
    assert "## TRL: SFTTrainer's packing paths per TRL release" in md and "- **llama** / sdpa: ❌ leak 4.52.4" in md


def test_a_render_of_the_transformers_axis_keeps_the_trl_block(rendered, tmp_path):
    args = A.AtlasArgs(["4.52.4", "5.24.0"], tmp_path / "build", rendered, None, 1, True, False, None)
    assert A.main(args, log=lambda s: None) == 0
    assert json.loads((rendered / "support.json").read_text())["trl"]["releases"][0]["trl"] == "0.19.1"
    assert "## TRL:" in (rendered / "atlas.md").read_text()


def test_main_trl_without_an_atlas_to_join_is_a_one_line_error(tmp_path):
    _planted(tmp_path / "trl")
    with pytest.raises(PackcheckUsageError, match="support.json is missing or of another schema.*packcheck atlas --render-only"):
        C.main_trl(PLANNED, tmp_path / "trl", tmp_path / "out", render_only=True, log=lambda s: None)
    assert (tmp_path / "out" / "trl.json").exists()


def test_lookup_with_a_trl_version(rendered):
    path = rendered / "support.json"
    hit = lookup("llama", "sdpa", "5.24.0", "0.19.1", path=path)
    assert hit.measured and hit.trl["measured"] and hit.trl["transformers"] == "5.24.0"
    assert hit.trl["modes"]["sft_padding_free"]["causes"] == ["mask_override"] and hit.trl["modes"]["sft"]["verdict"] == "fail"
    assert "llama / sdpa @ trl 0.19.1 / padding_free: fail [mask_override] (loss Δ 1.2e-02), measured with transformers 5.24.0" in str(hit)
    between = lookup("llama", "sdpa", "5.24.0", "0.22.2", path=path)
    assert not between.trl["measured"]
    assert [(n["trl"], n["side"], n["verdict"]) for n in between.trl["nearest"]["sft_padding_free"]] == [
        ("0.19.1", "below", "fail"), ("0.24.0", "above", "pass")]
    assert any("0.22.2 is not measured on the TRL axis" in n for n in between.trl["notes"])
    other_tf = lookup("llama", "sdpa", "4.52.4", "0.24.0", path=path)
    assert other_tf.trl["measured"] and any("measured with transformers 5.24.0, not 4.52.4" in n for n in other_tf.trl["notes"])
    flash = lookup("llama", "flash_attention_2", "5.24.0", "0.19.1", path=path)
    assert flash.trl["modes"]["sft"]["causes"] == ["stand_in_differs"] and flash.trl["nearest"] == {"sft_padding_free": []}
    assert not lookup("llama", "eager", "5.24.0", "0.19.1", path=path).trl["measured"]
    assert any("not a family of the TRL axis" in n for n in lookup("opt", "sdpa", "5.24.0", "0.19.1", path=path).trl["notes"])
    with pytest.raises(PackcheckUsageError, match="trl version 'new' is not a version"):
        lookup("llama", "sdpa", "5.24.0", "new", path=path)


def test_lookup_prints_each_answers_notes_under_its_own_lines(rendered):
    """Trial 18, 137: with --trl, the transformers answer's note ("the verdict changes between ...") was printed
    below the TRL lines, where it read as being about the TRL release. Each note now sits under its own answer,
    and the JSON keeps the TRL notes in ``trl.notes``."""
    answer = lookup("llama", "sdpa", "4.56.2", "0.22.2", path=rendered / "support.json")
    lines = str(answer).splitlines()
    first_trl = next(i for i, line in enumerate(lines) if "@ trl 0.22.2" in line)
    tf_note = next(i for i, line in enumerate(lines) if "changes between 4.52.4 and 5.24.0" in line)
    trl_note = next(i for i, line in enumerate(lines) if "0.22.2 is not measured on the TRL axis" in line)
    assert lines[0].startswith("llama / sdpa @ transformers 4.56.2") and 0 < tf_note < first_trl < trl_note
    assert not any("TRL axis" in n for n in answer.notes) and any("changes between" in n for n in answer.notes)


def test_lookup_trl_answers_carry_the_command_the_trl_axis_ran(rendered):
    """`lookup llama sdpa 5.24.0 --trl 1.16.0`: the one "reproduce:" line was the plain transformers audit (no sft
    check, no TRL), which does not measure the TRL answers printed above it."""
    hit = lookup("llama", "sdpa", "5.24.0", "0.19.1", path=rendered / "support.json")
    ran = json.loads((rendered / "trl.json").read_text())["releases"]
    command = next(r["command"] for r in ran if r["trl"] == "0.19.1")
    assert hit.trl["reproduce"] == command and "--trl --releases 0.19.1" in command
    text = str(hit)
    assert f"  reproduce (the trl 0.19.1 answers): {command}" in text
    assert "  reproduce (the transformers answer): packcheck audit" in text


def test_cli_lookup_trl_exit_codes(rendered):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "lookup", *args, "--support-file",
                               str(rendered / "support.json")], capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    ok = run("llama", "sdpa", "5.24.0", "--trl", "0.24.0")
    assert ok.returncode == 0 and "llama / sdpa @ trl 0.24.0 / padding_free: pass" in ok.stdout
    assert run("llama", "sdpa", "5.24.0", "--trl", "0.22.2").returncode == 1
    assert run("llama", "sdpa", "5.24.0").returncode == 0  # no --trl: the transformers answer alone
    bad = run("llama", "sdpa", "5.24.0", "--trl", "x")
    assert bad.returncode == 2 and "'x'" in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_lookup_with_trl_stays_offline_and_light(rendered):
    """The TRL answer imports no torch / transformers / trl either (a training script calls it at start-up)."""
    code = ("import sys\nfrom pytest_packcheck.support import lookup\n"
            f"a = lookup('llama', 'sdpa', '5.24.0', '0.24.0', path={str(rendered / 'support.json')!r})\n"
            "print(a.trl['measured'], *(m in sys.modules for m in ('torch', 'transformers', 'trl')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.split() == ["True", "False", "False", "False"]


# ----------------------------------------------------------------------------------------------------------------
# known faults against the TRL axis


def _fault(versions: str, cause: str = "mask_override", fid: str = "planted", checks=("sft_padding_free",)):
    from pytest_packcheck.analysis.diagnose import KnownFault

    return KnownFault(fid, "", "", "trl", versions, ("*",), ("sdpa",), checks, cause, "", "", "")


def test_a_wrong_trl_window_disagrees_with_the_axis(tmp_path):
    _planted(tmp_path)
    block = T.collect_trl(tmp_path, PLANNED)  # mask_override on 0.19.1 only
    status = lambda faults: {r["release"]: r["status"] for r in T.trl_known_fault_agreement(block, faults)}
    assert status([_fault("<0.21")]) == {"0.19.1": "agrees", "0.24.0": "agrees", "1.16.0": "agrees"}
    assert status([_fault("<0.25")])["0.24.0"] == "disagrees"  # claims 0.24.0, which passes
    assert status([_fault(">=0.20")])["0.19.1"] == "disagrees"  # 0.19.1 shows it outside the window
    # a second entry with the same cause covering 0.19.1 makes it agree
    assert status([_fault(">=0.20"), _fault("<0.20", fid="other")])["0.19.1"] == "agrees"
    # the flash stand-in's skipped cell measured nothing
    flash = _fault("<0.21", "completion_mask", checks=("sft",))
    flash = dataclasses.replace(flash, backends=("packcheck_flash_ref",))
    assert status([flash])["0.19.1"] == "not_checkable"
    assert T.trl_known_fault_agreement(block, [_fault("<0.21", checks=("packing_content",))])[0]["status"] == "not_checkable"


def test_every_trl_known_fault_window_agrees_with_the_committed_trl_axis():
    """The TRL windows of audit/known_faults.toml against reports/atlas/trl.json: a disagreement fails (correct the
    entry, with the axis as its evidence)."""
    from pytest_packcheck.analysis.diagnose import load_known_faults

    block = T.load_trl(REPO / "reports" / "atlas")
    assert block is not None and block["releases"]
    results = T.trl_known_fault_agreement(block, load_known_faults())
    bad = [r for r in results if r["status"] == "disagrees"]
    assert not bad, bad
    assert any(r["status"] == "agrees" for r in results)


def test_cli_atlas_trl_refuses_the_transformers_axis_flags(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "atlas", "--trl", "--releases", "0.24.0", "--shard", "1/2",
                           "-o", str(tmp_path)], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "--shard do not apply with --trl" in proc.stderr
    listed = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "atlas", "--trl", "--releases", "1.16.0,0.19.1",
                             "--list-releases"], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert json.loads(listed.stdout) == ["0.19.1", "1.16.0"]


# ----------------------------------------------------------------------------------------------------------------
# the RL part (issue 44): TRL's own RL trainer code per TRL release, in <build>/rl/<version>


def _rl_cell(model: str, backend: str | None, check: str, status: str, number: float | None = None, cause: str | None = None,
             message: str = "") -> dict:
    cell = _cell(model, backend or "sdpa", check, status, cause, None)
    key = "max_abs_margin_diff" if check in ("rl_trl_dpo", "rl_trl_kto") else "max_abs_logprob_diff"
    cell["metrics"] = {key: number} if number is not None else {}
    return {**cell, "backend": backend, "message": message or f"{check} {status}"}


def _planted_rl(build: Path) -> None:
    """GRPO on llama / sdpa passes on 1.7.1 and 1.16.0; AsyncGRPO's padding-free row passes on 1.7.1 and skips on
    1.16.0 (trees); the tree (model level, no backend) skips on 1.7.1 and passes on 1.16.0; a leak planted on
    qwen2 / sdpa GRPO at 1.7.1 (a fail-to-pass transition); the SFT part's cells in the same folder are ignored."""
    for trl, cells in (("1.7.1", [
            _rl_cell("llama", "sdpa", "rl_trl_grpo", "pass", 3.2e-7),
            _rl_cell("llama", "sdpa", "rl_trl_async", "pass", 3.2e-7),
            _rl_cell("llama", None, "rl_trl_tree", "skipped", message="trl 1.7.1 has no AsyncGRPO tree packing"),
            _rl_cell("qwen2", "sdpa", "rl_trl_grpo", "fail", 0.31, "leak"),
            _cell("llama", "sdpa", "sft", "pass", number=1e-7)]),
                       ("1.16.0", [
            _rl_cell("llama", "sdpa", "rl_trl_grpo", "pass", 3.1e-7),
            _rl_cell("llama", "sdpa", "rl_trl_async", "skipped",
                     message="trl 1.16.0's AsyncGRPO collator packs trees (TreeRow): rl_trl_tree measures it"),
            _rl_cell("llama", None, "rl_trl_tree", "pass", 3.4e-7),
            _rl_cell("qwen2", "sdpa", "rl_trl_grpo", "pass", 4.8e-7)])):
        _write(build / "rl", trl, cells)


def test_the_rl_part_runs_its_own_modes_into_its_own_folder(tmp_path):
    flags = T.trl_flags(str(tmp_path), "rl")
    assert f"--packcheck-checks={','.join(T.TRL_RL_MODES)}" in flags
    assert "--packcheck-models=arch:llama,arch:qwen2" in flags
    assert T.trl_reproduce("1.7.1", part="rl") == "packcheck atlas --trl --rl --releases 1.7.1"
    seen = {}

    def runner(cmd, **kw):  # the release's plugin run, planted: records where it ran, writes nothing
        seen["flags"] = [a for a in cmd if a.startswith("--packcheck-")]
        return subprocess.CompletedProcess(cmd, 1, "", "")

    env = type("Env", (), {"path": tmp_path / "env", "python": sys.executable, "created": False, "seconds": 0.1,
                           "versions": {"trl": "1.7.1", "transformers": "5.25.0"}})()
    record = T.run_trl_release("1.7.1", tmp_path / "build", log=lambda _l: None, runner=runner, ensure=lambda _c: env, part="rl")
    assert "error" in record and (tmp_path / "build" / "rl" / "1.7.1" / "atlas-error.json").exists()
    assert not (tmp_path / "build" / "1.7.1").exists()  # the SFT part's folder is untouched
    assert f"--packcheck-checks={','.join(T.TRL_RL_MODES)}" in seen["flags"]


def test_the_rl_part_is_reduced_collected_and_its_transitions_named(tmp_path):
    build = tmp_path / "build"
    _planted(build)
    _planted_rl(build)
    block = T.collect_trl(build, PLANNED + ["1.7.1"])
    assert [r["trl"] for r in block["rl_releases"]] == ["1.7.1", "1.16.0"]
    assert [r["trl"] for r in block["releases"]] == ["0.19.1", "0.24.0", "1.16.0"]  # the SFT part's own
    assert block["rl_missing"] == ["0.19.1", "0.22.2", "0.24.0"]
    llama = block["cells"]["llama"]
    assert llama["rl_trl_tree"][T.MODEL_LEVEL_BACKEND]["1.16.0"] == {"verdict": "pass", "causes": [], "number": 3.4e-7}
    assert llama["rl_trl_async"]["sdpa"]["1.16.0"]["verdict"] == "skipped"
    assert "1.7.1" not in llama["sft"]["sdpa"]  # an SFT cell inside an RL run is not the RL part's
    moved = {(t["model_type"], t["mode"], t["backend"]): t for t in block["transitions"] if t["mode"].startswith("rl_")}
    t = moved[("qwen2", "rl_trl_grpo", "sdpa")]
    assert (t["last_before"], t["first_after"]) == ("1.7.1", "1.16.0")
    assert t["before"] == {"verdict": "fail", "causes": ["leak"], "number": 0.31} and t["after"]["verdict"] == "pass"
    assert ("llama", "rl_trl_tree", T.MODEL_LEVEL_BACKEND) in moved and ("llama", "rl_trl_grpo", "sdpa") not in moved
    # seeded from the committed block: a fresh build keeps both parts' releases
    again = T.collect_trl(tmp_path / "empty", PLANNED + ["1.7.1"], block)
    assert [r["trl"] for r in again["rl_releases"]] == ["1.7.1", "1.16.0"] and again["cells"] == block["cells"]
    # the RL part's next release bisects its own gap (qwen2's GRPO changed between 1.7.1 and 1.16.0)
    planned = ["1.7.1", "1.8.0", "1.9.2", "1.10.0", "1.16.0"]
    assert T.next_release(planned, block, part="rl") == "1.9.2"


def test_the_rl_part_is_rendered_and_answered(tmp_path):
    build = tmp_path / "build"
    _planted(build)
    _planted_rl(build)
    block = T.collect_trl(build, PLANNED + ["1.7.1"])
    text = "\n".join(render_trl_markdown(block))
    assert "### TRL's RL trainers per TRL release" in text
    assert "- **qwen2** / GRPO log-probs: sdpa: ❌ leak up to 1.7.1 (Δlogp ≤ 3.1e-01), ✅ from 1.16.0 (Δlogp ≤ 4.8e-07)" in text
    assert "AsyncGRPO tree: tree_attention: ⏭️ up to 1.7.1, ✅ from 1.16.0 (Δlogp ≤ 3.4e-07)" in text
    assert "- AsyncGRPO padding-free, 1.16.0: trl X's AsyncGRPO collator packs trees (TreeRow)" in text
    assert "| qwen2 | GRPO log-probs | sdpa | 1.7.1 | 1.16.0 | ❌ leak (Δlogp 3.1e-01) | ✅ (Δlogp 4.8e-07) |" in text
    from pytest_packcheck.atlas.trl_render import trl_answer, trl_answer_lines

    answer = trl_answer({"trl": block}, "llama", "sdpa", "1.16.0", "5.25.0")
    assert answer["measured"] and answer["modes"]["rl_trl_tree"]["verdict"] == "pass"
    assert answer["modes"]["rl_trl_grpo"]["number"] == 3.1e-7 and answer["modes"]["sft"]["verdict"] == "pass"
    lines = "\n".join(trl_answer_lines(answer, "llama", "sdpa"))
    assert "llama / sdpa @ trl 1.16.0 / AsyncGRPO padding-free: skipped: trl 1.16.0's AsyncGRPO collator packs trees" in lines
    assert "reproduce (the trl 1.16.0 RL answers): packcheck atlas --trl --rl --releases 1.16.0" in lines
    # SFTTrainer's path is judged on SFTTrainer's modes: a skipped RL trainer mode does not make it a failure
    from packaging.version import Version

    from pytest_packcheck.analysis.training_paths import training_paths

    answer["modes"]["rl_trl_async"] = {"verdict": "skipped", "causes": []}
    sft = next(p for p in training_paths({"trl": block}, "llama", "sdpa", Version("5.25.0"), None, "pass", [], trl=answer,
                                         faults=[]) if p["path"] == "SFTTrainer")
    assert "rl_trl_async" in answer["rl_modes"] and sft["verdict"] == "pass", sft
    only_rl = trl_answer({"trl": block}, "llama", "sdpa", "1.7.1", "5.25.0")  # measured on the RL part only
    assert only_rl["measured"] and only_rl["modes"]["rl_trl_async"]["verdict"] == "pass" and "sft" in only_rl["nearest"]


def test_a_skip_reason_shared_by_families_is_kept_once_and_read_back(tmp_path):
    """trl.json stays small: a release's skip reason, the same for every family and backend, is stored on the first
    (family, backend) only; the others point at it and lookup prints it for each."""
    build = tmp_path / "build"
    why = "trl 1.16.0's AsyncGRPO collator packs trees (TreeRow): rl_trl_tree measures it"
    _write(build / "rl", "1.16.0", [_rl_cell("llama", "sdpa", "rl_trl_async", "skipped", message=why),
                                    _rl_cell("qwen2", "sdpa", "rl_trl_async", "skipped", message=why),
                                    _rl_cell("qwen2", "packcheck_flash_ref", "rl_trl_async", "skipped", message=why)])
    block = T.collect_trl(build, ["1.16.0"])
    cells = block["cells"]
    assert cells["llama"]["rl_trl_async"]["sdpa"]["1.16.0"]["message"] == why
    assert cells["qwen2"]["rl_trl_async"]["sdpa"]["1.16.0"] == {"verdict": "skipped", "causes": [], "message_from": "llama/sdpa"}
    from pytest_packcheck.atlas.trl_render import trl_answer

    answer = trl_answer({"trl": block}, "qwen2", "packcheck_flash_ref", "1.16.0", "5.25.0")
    assert answer["modes"]["rl_trl_async"]["message"] == why


def test_rloo_is_measured_in_a_run_of_its_own_and_merged_into_the_rl_part(tmp_path):
    """RLOO per TRL minor (``packcheck atlas --trl --rloo``, ``<build>/rl-rloo``): its entries join the RL part's
    without dropping them (the committed RL part seeds the rest), its runs' records go to ``rloo_releases``, it is
    rendered and answered per release. Planted: a leak in qwen2's RLOO at 1.7.1 is a transition, and a stale verdict
    in a copy of the block changes lookup's answer."""
    assert T.trl_flags(str(tmp_path), "rloo")[2] == "--packcheck-checks=rl_trl_rloo"
    assert T.trl_reproduce("1.7.1", part="rloo") == "packcheck atlas --trl --rloo --releases 1.7.1"
    build = tmp_path / "build"
    _planted(build)
    _planted_rl(build)
    committed = T.collect_trl(build, PLANNED + ["1.7.1"])
    assert "rloo_releases" not in committed
    rloo = tmp_path / "rloo-build"
    _write(rloo / "rl-rloo", "1.7.1", [_rl_cell("llama", "sdpa", "rl_trl_rloo", "pass", 3.2e-7),
                                      _rl_cell("qwen2", "sdpa", "rl_trl_rloo", "fail", 0.29, "leak")])
    _write(rloo / "rl-rloo", "1.16.0", [_rl_cell("llama", "sdpa", "rl_trl_rloo", "pass", 3.19e-7),
                                       _rl_cell("qwen2", "sdpa", "rl_trl_rloo", "pass", 4.78e-7)])
    block = T.collect_trl(rloo, PLANNED + ["1.7.1"], committed)
    assert [r["trl"] for r in block["rloo_releases"]] == ["1.7.1", "1.16.0"]
    assert [r["trl"] for r in block["rl_releases"]] == ["1.7.1", "1.16.0"]  # the RL part kept as committed
    assert block["cells"]["llama"]["rl_trl_grpo"] == committed["cells"]["llama"]["rl_trl_grpo"]
    assert "rl_trl_rloo" in block["rl_modes"] and block["rloo_missing"] == ["0.19.1", "0.22.2", "0.24.0"]
    moved = {(t["model_type"], t["mode"]) for t in block["transitions"]}
    assert ("qwen2", "rl_trl_rloo") in moved and ("llama", "rl_trl_rloo") not in moved
    text = "\n".join(render_trl_markdown(block))
    assert "- **qwen2** / RLOO log-probs: sdpa: ❌ leak up to 1.7.1 (Δlogp ≤ 2.9e-01), ✅ from 1.16.0 (Δlogp ≤ 4.8e-07)" in text
    assert "RLOO (`rl_trl_rloo`) measured in runs of its own (`packcheck atlas --trl --rloo`): 2 TRL releases" in text
    from pytest_packcheck.atlas.trl_render import trl_answer, trl_answer_lines

    answer = trl_answer({"trl": block}, "qwen2", "sdpa", "1.16.0", "5.25.0")
    assert answer["modes"]["rl_trl_rloo"] == {"verdict": "pass", "causes": [], "number": 4.78e-7}
    lines = trl_answer_lines(answer, "qwen2", "sdpa")
    assert any(line.startswith("qwen2 / sdpa @ trl 1.16.0 / RLOO log-probs: pass (Δlogp 4.8e-07), measured with "
                               "transformers ") for line in lines), lines
    assert "  reproduce (the trl 1.16.0 RLOO answer): packcheck atlas --trl --rloo --releases 1.16.0" in lines
    stale = json.loads(json.dumps(block))
    stale["cells"]["qwen2"]["rl_trl_rloo"]["sdpa"]["1.16.0"] = {"verdict": "fail", "causes": ["leak"], "number": 0.29}
    assert trl_answer({"trl": stale}, "qwen2", "sdpa", "1.16.0", "5.25.0")["modes"]["rl_trl_rloo"]["verdict"] == "fail"
    # a fresh build keeps RLOO's releases (seeded from the block it replaces)
    again = T.collect_trl(tmp_path / "empty", PLANNED + ["1.7.1"], block)
    assert again["rloo_releases"] == block["rloo_releases"] and again["cells"] == block["cells"]
