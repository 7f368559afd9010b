"""The library axes in the support index (``support.json["axes"]``, analysis/library_axes.py): `packcheck lookup`
answers verl / OpenRLHF / ms-swift / unsloth per release (rl_peers.json) and the stack elements per peft / accelerate / TRL
release (stack.json) from the committed atlas, with the number, the release, the deciding file:line and the versions;
a release outside the measured range is one line naming it, exit 1; the block is what the sources give (a planted
stale row changes the answer and is caught), and its docs examples are the real answers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pytest_packcheck.analysis.library_axes import LIBRARY_AXES, attach_axes, axes_block, axis_answer
from pytest_packcheck.errors import PackcheckUsageError

REPO = Path(__file__).resolve().parent.parent
ATLAS = REPO / "reports" / "atlas"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((ATLAS / "support.json").read_text(encoding="utf-8"))


def _cli(capsys, *args: str) -> tuple[int, str]:
    from pytest_packcheck.cli import main

    rc = main(["lookup", *args])
    return rc, capsys.readouterr().out


def test_the_committed_block_is_what_its_sources_give(committed):
    """support.json's axes block = axes_block(rl_peers.json, stack.json) (a re-measure of either without a render
    leaves support.json stale: caught here), one axis per row of the one table, small enough for reports/' cap."""
    fresh = axes_block(ATLAS)
    assert committed.get("axes") == fresh, "support.json's axes block is stale: run python tools/rerender.py"
    assert set(fresh["axes"]) == set(LIBRARY_AXES)
    text = json.dumps(fresh, separators=(",", ":"), sort_keys=True)
    assert json.loads(text) == fresh and len(text) < 60_000  # a JSON round-trip, 44 KB of the 11.25 MB cap


@pytest.mark.parametrize(("library", "release", "element", "verdict", "number", "line"), [
    ("verl", "0.9.1", None, "pass", 3.19e-07, "verl/workers/engine/fsdp/transformer_impl.py:1201"),
    ("openrlhf", "0.4.6", None, "fail", 6.18e-02, "openrlhf/models/actor.py:195"),
    ("ms-swift", "4.6.0", None, "pass", 5.85e-06, "swift/rlhf_trainers/dpo_trainer.py:153"),
    ("unsloth", "2026.7.1", None, "pass", 3.64e-07, "unsloth/models/rl_replacements.py:1578"),
    ("peft", "0.18.1", "prompt_tuning", "fail", 1.82e-01, "peft/peft_model.py:1739"),
    ("accelerate", "1.16.0", "cp", "fail", 3.13e-01, "accelerate/big_modeling.py:800"),
    ("trl", "0.22.2", "lora", "fail", 7.13e-01, "trl/trainer/sft_trainer.py:702"),
])
def test_each_axis_answers_a_measured_release(committed, library, release, element, verdict, number, line):
    answer = axis_answer(committed, library, release, "llama", "sdpa", element)
    assert answer["measured"] and not answer["outside"]
    first = answer["answers"][0]  # the RL trainers' one path; a stack element's sft_packing mode (sorted first)
    assert (first["verdict"], first["number"], first["measured_at"]) == (verdict, number, release)
    assert line in answer["lines"].values()
    assert answer["versions"][library] == release and answer["versions"]["transformers"] == "5.25.0"


def test_a_release_between_two_measured_ones_names_the_neighbours_and_the_placement(committed):
    answer = axis_answer(committed, "peft", "0.18.0", "llama", "sdpa", "prompt_tuning")
    assert not answer["measured"] and not answer["outside"]
    a = answer["answers"][0]
    assert [(n["release"], n["verdict"]) for n in a["nearest"]] == [("0.17.1", "skipped"), ("0.18.1", "fail")]
    assert "0.17.1 was not judged (skipped)" in a["placement"]
    same = axis_answer(committed, "trl", "0.23.0", "llama", "sdpa", "lora")["answers"][-1]  # trainer: pass on both sides
    assert "both neighbours agree (pass)" in same["placement"]


def test_a_release_outside_the_range_is_one_line_naming_it_exit_1(capsys):
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--verl", "1.2")
    assert rc == 1
    assert out.strip() == ("verl 1.2 is outside the measured range of the verl axis (0.1 .. 0.9.1, 9 releases, "
                           "reports/atlas/rl_peers.json): not measured")
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--trl", "0.18.0", "--stack", "lora")
    assert rc == 1 and out.count("\n") == 1 and "(0.19.1 .. 1.16.0, 28 releases" in out


def test_usage_errors_name_the_fix(capsys):
    with pytest.raises(PackcheckUsageError, match="Did you mean 'lora'"):
        axis_answer(json.loads((ATLAS / "support.json").read_text()), "peft", "0.18.1", "llama", "sdpa", "lorra")
    from pytest_packcheck.support import lookup

    with pytest.raises(PackcheckUsageError, match="--peft 0.18.1 --stack lora"):
        lookup("llama", "sdpa", "5.25.0", libraries={"verl": "0.9.1"}, stack="lora")
    with pytest.raises(PackcheckUsageError, match="no library axis 'deepspeed'"):
        lookup("llama", "sdpa", "5.25.0", libraries={"deepspeed": "0.1"})


def test_a_planted_stale_row_changes_the_answer_and_is_caught(tmp_path, capsys, committed):
    """Planted: OpenRLHF 0.4.6's llama / sdpa cell relabelled pass in a copy of rl_peers.json. The block built from it
    answers the planted verdict (the answer reads the file, not a constant), it differs from the committed one (the
    staleness test above fails on such a file), and a support.json carrying it answers pass through the CLI."""
    shutil.copy(ATLAS / "stack.json", tmp_path / "stack.json")
    peers = json.loads((ATLAS / "rl_peers.json").read_text())
    release = next(r for r in peers["trainers"]["openrlhf"] if r["version"] == "0.4.6")
    cell = next(c for c in release["cells"] if (c["model"], c["backend"]) == ("llama", "sdpa"))
    cell.update(status="pass", cause=None)
    (tmp_path / "rl_peers.json").write_text(json.dumps(peers))
    planted = axes_block(tmp_path)
    assert planted != committed["axes"]
    assert axis_answer({"axes": planted}, "openrlhf", "0.4.6", "llama", "sdpa")["answers"][0]["verdict"] == "pass"
    support = attach_axes(dict(committed), tmp_path)
    path = tmp_path / "support.json"
    path.write_text(json.dumps(support, separators=(",", ":"), sort_keys=True))
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--openrlhf", "0.4.6", "--support-file", str(path))
    assert rc == 0 and "@ openrlhf 0.4.6 / packed path: pass (Δlogp 6.2e-02)" in out
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--openrlhf", "0.4.6")
    assert rc == 0 and "@ openrlhf 0.4.6 / packed path: fail [wrong_positions] (Δlogp 6.2e-02)" in out


def test_a_corrupt_axes_block_is_refused_in_one_line(tmp_path, capsys, committed):
    """Planted: a run whose entry has no verdict; the support file is refused naming the axis (exit 2)."""
    doc = json.loads(json.dumps(committed))
    doc["axes"]["axes"]["verl"]["rows"][0]["runs"][0][2].pop("verdict")
    path = tmp_path / "support.json"
    path.write_text(json.dumps(doc))
    from pytest_packcheck.cli import main

    assert main(["lookup", "llama", "sdpa", "5.25.0", "--verl", "0.9.1", "--support-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is corrupt: axes.verl: a run" in err and err.count("\n") == 1


def _doc_examples() -> list[tuple[str, list[str]]]:
    """The library-axes examples of docs/atlas.md and docs/rl.md (unsloth's): each ``$ packcheck lookup ...`` line and
    the answer lines quoted under it."""
    block = ""
    for page in ("atlas.md", "rl.md"):
        text = (REPO / "docs" / page).read_text(encoding="utf-8")
        block += text.split("<!-- library-axes-examples -->")[1].split("<!-- /library-axes-examples -->")[0]
    out: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ packcheck lookup "):
            out.append((line[2:], []))
        elif out and line.strip() and not line.startswith("```"):
            out[-1][1].append(line)
    return out


def test_the_docs_examples_are_the_real_answers(capsys):
    examples = _doc_examples()
    asked = {re.search(r"--(verl|openrlhf|ms-swift|unsloth|peft|accelerate|trl) ", cmd).group(1) for cmd, _ in examples}
    assert asked == set(LIBRARY_AXES)  # one example per axis
    for command, quoted in examples:
        rc, out = _cli(capsys, *command.split()[2:])
        got = out.splitlines()
        assert quoted and all(q in got for q in quoted), (command, [q for q in quoted if q not in got])
        assert rc == (1 if "outside the measured range" in out or ": not measured (" in out else 0)


def test_the_rloo_rows_per_trl_minor_are_committed_and_docs_quote_them():
    """trl.json's RLOO part: every TRL minor of the axis measured, a skip naming what is missing up to 0.28.0 and at
    1.15.0, a pass from 0.29.1 elsewhere; docs/rl.md quotes its cost and largest Δlogp from the committed block."""
    block = json.loads((ATLAS / "trl.json").read_text(encoding="utf-8"))
    releases = [r["trl"] for r in block["rloo_releases"]]
    assert releases == [r["trl"] for r in block["rl_releases"]] and not block["rloo_missing"]
    verdicts = {v: e["verdict"] for v, e in block["cells"]["llama"]["rl_trl_rloo"]["sdpa"].items()}
    from packaging.version import Version

    assert {v for v, x in verdicts.items() if x == "pass"} == {v for v in releases if Version(v) >= Version("0.29.1")} - {"1.15.0"}
    assert all(verdicts[v] == "skipped" for v in ("0.19.1", "0.22.2", "0.28.0", "1.15.0"))
    worst = max(e.get("number") or 0 for row in block["cells"].values() for by_b in [row.get("rl_trl_rloo", {})]
                for r in by_b.values() for e in r.values())
    docs = (REPO / "docs" / "rl.md").read_text(encoding="utf-8")
    wall, cpu = sum(r["wall_s"] for r in block["rloo_releases"]), sum(r["cpu_s"] for r in block["rloo_releases"])
    assert f"{len(releases)} minors, {wall:.0f} s wall, {cpu:.0f} s CPU" in docs
    assert f"(Δlogp ≤ {worst:.1e} nats per token)" in docs


def test_a_plain_lookup_neither_imports_the_axes_nor_reads_their_block(tmp_path):
    """The library axes cost a plain `packcheck lookup` nothing but the flag table (issue 47: <= 0.1 s fresh): no
    analysis.library_axes import, and the index's axes.json not read. Planted: asking --verl imports and reads both."""
    import os
    import subprocess
    import sys

    code = ("import sys, json, io, contextlib; from pytest_packcheck.cli import main; from pytest_packcheck.analysis import "
            "support_file as S\nwith contextlib.redirect_stdout(io.StringIO()): main(['lookup', *sys.argv[1:]])\n"
            "v = next(iter(S._VIEWS.values()), None)\n"
            "print(json.dumps(['pytest_packcheck.analysis.library_axes' in sys.modules, sorted(v._lazy) if v else None]))")
    env = {**os.environ, "PACKCHECK_CACHE_DIR": str(tmp_path)}
    seen = []
    for args in (["llama", "sdpa", "5.25.0"], ["llama", "sdpa", "5.25.0"], ["llama", "sdpa", "5.25.0", "--verl", "0.9.1"]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert seen[1][0] is False and "axes" not in seen[1][1]  # the second start reads the index the first one built
    assert seen[2][0] is True and "axes" in seen[2][1]


def test_unsloth_per_release_a_release_without_the_block_is_named_never_a_pass(committed, capsys):
    """unsloth's axis (the newest patch of each month since the GRPO sequence-packing block, 2026.7.1): 2026.6.9 has
    no block and answers a skip naming it (never a pass); each release with it answers its own file:line of the block
    and its verifier's thresholds; the zoo it ran with is in the versions."""
    no_block = axis_answer(committed, "unsloth", "2026.6.9", "qwen2", "packcheck_flash_ref")
    assert {a["verdict"] for a in no_block["answers"]} == {"skipped"}
    assert all("has no GRPO sequence-packing block" in a["entry"]["message"] for a in no_block["answers"])
    lines = {}
    for release in ("2026.7.1", "2026.7.6", "2026.8.22", "2026.9.14", "2026.10.9"):
        answer = axis_answer(committed, "unsloth", release, "qwen2", "sdpa")
        assert answer["measured"] and answer["answers"][0]["verdict"] == "pass" and answer["answers"][0]["number"] < 1e-5
        assert "accepts below 0.7" in answer["lines"]["verifier"] and "at 1.5" in answer["lines"]["verifier"]
        assert answer["versions"]["unsloth_zoo"].startswith(release[:6])  # 2026.7.6 declares unsloth_zoo>=2026.7.7
        lines[release] = answer["lines"]["anchor"]
    assert len(set(lines.values())) == 5  # the block moves with every release: read from each wheel, not a constant
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--unsloth", "2026.6.9")
    assert rc == 0 and "@ unsloth 2026.6.9 / packed path: skipped: unsloth 2026.6.9 has no GRPO sequence-packing" in out
    assert "pass" not in out.split("@ unsloth")[1].split("\n")[0]


def test_a_planted_stale_unsloth_verdict_changes_the_answer(tmp_path, capsys, committed):
    """Planted in a copy of rl_peers.json: unsloth 2026.8.22's llama / sdpa cell relabelled fail (wrong_positions,
    0.31 nats), and 2026.7.1 given 2026.6.9's no-block record. The block built from the copy answers both (fail with
    the planted number; the release named as having no block), differs from the committed one, and the CLI on a
    support.json carrying it exits 0 with the planted fail."""
    shutil.copy(ATLAS / "stack.json", tmp_path / "stack.json")
    peers = json.loads((ATLAS / "rl_peers.json").read_text())
    records = {r["version"]: r for r in peers["trainers"]["unsloth"]}
    cell = next(c for c in records["2026.8.22"]["cells"] if (c["model"], c["backend"]) == ("llama", "sdpa"))
    cell.update(status="fail", cause="wrong_positions", message="planted", metrics={"max_abs_logprob_diff": 0.31})
    records["2026.7.1"].update(cells=[], skip=records["2026.6.9"]["skip"].replace("2026.6.9", "2026.7.1"))
    (tmp_path / "rl_peers.json").write_text(json.dumps(peers))
    planted = axes_block(tmp_path)
    assert planted["axes"]["unsloth"] != committed["axes"]["axes"]["unsloth"]
    got = axis_answer({"axes": planted}, "unsloth", "2026.8.22", "llama", "sdpa")["answers"][0]
    assert (got["verdict"], got["causes"], got["number"]) == ("fail", ["wrong_positions"], 0.31)
    gone = axis_answer({"axes": planted}, "unsloth", "2026.7.1", "llama", "sdpa")["answers"][0]
    assert gone["verdict"] == "skipped" and "2026.7.1 has no GRPO sequence-packing block" in gone["entry"]["message"]
    path = tmp_path / "support.json"
    path.write_text(json.dumps(attach_axes(dict(committed), tmp_path), separators=(",", ":"), sort_keys=True))
    rc, out = _cli(capsys, "llama", "sdpa", "5.25.0", "--unsloth", "2026.8.22", "--support-file", str(path))
    assert rc == 0 and "@ unsloth 2026.8.22 / packed path: fail [wrong_positions] (Δlogp 3.1e-01)" in out


def test_docs_rl_quotes_the_unsloth_rows_from_the_committed_block():
    """docs/rl.md's unsloth paragraph: the worst Δlogp over the releases' cells, the worst of unsloth's own verifier,
    the first release with the block and the cost, all from rl_peers.json (planted: a moved number fails here)."""
    peers = json.loads((ATLAS / "rl_peers.json").read_text())
    records = peers["trainers"]["unsloth"]
    cells = [c for r in records for c in r["cells"]]
    worst = max(c["metrics"]["max_abs_logprob_diff"] for c in cells)
    verifier = max(c["metrics"]["unsloth_verifier_diff"] for c in cells)
    first = next(r["version"] for r in records if r["path"].get("anchor"))
    ran = [r for r in records if r["cells"]]
    docs = " ".join((REPO / "docs" / "rl.md").read_text(encoding="utf-8").split())
    assert f"within {worst:.1e} nats per token" in docs and f"reads at most {verifier:.1e} nats" in docs
    assert f"{first} is the first release whose" in docs and first == "2026.7.1"
    cpu, wall = sum(r["cpu_s"] for r in ran), sum(r["wall_s"] for r in ran)
    assert f"The {['no', 'one', 'two', 'three', 'four', 'five', 'six'][len(ran)]} releases with the block cost {cpu:.0f} s CPU ({wall:.0f} s wall" in docs
    assert cpu < 15 * 60  # the brief's budget: the whole axis under 15 minutes of CPU
