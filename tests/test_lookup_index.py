"""`packcheck lookup`'s split index of the atlas (issue 47): the same answers as the full support file, rebuilt when
the file changes, healed when damaged, and never needed (an unwritable cache only costs speed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pytest_packcheck.analysis import support_file as S
from pytest_packcheck.support import lookup, lookup_releases

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [("llama", "sdpa", "4.53.1", None), ("qwen2", "eager", "4.57", None), ("gpt2", "sdpa", "5.24.0", "1.16.0"),
             ("opt", "packcheck_flash_ref", "4.46.3", None), ("nosuchmodel", "sdpa", "5.0.0", None),
             ("bert", "sdpa", "5.24.0", None), ("encoder:bert", "sdpa", "5.25.0", None)]


@pytest.fixture
def atlas(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(S, "_VIEWS", {})
    monkeypatch.setattr(S, "_DIGESTS", {})
    path = tmp_path / "support.json"
    shutil.copy(REPO / "reports" / "atlas" / "support.json", path)
    return path


def _answers(path):
    return [[a.as_dict() for a in lookup_releases(m, b, v, t, path=path)] for m, b, v, t in QUESTIONS]


def test_the_index_answers_as_the_full_file_does(atlas, monkeypatch):
    first = _answers(atlas)  # builds the index
    assert isinstance(S.load_support_view(atlas), S.SupportView)
    assert _answers(atlas) == first
    monkeypatch.setattr(S, "load_support_view", lambda path=None: S.load_support(path))  # the full document
    import pytest_packcheck.support as P

    monkeypatch.setattr(P, "load_support_view", lambda path=None: S.load_support(path))
    assert _answers(atlas) == first


def test_a_changed_file_gets_a_new_index_and_a_damaged_one_is_healed(atlas, tmp_path):
    lookup("llama", "sdpa", "4.53.1", path=atlas)
    doc = json.loads(atlas.read_text())
    doc["cells"]["llama"]["sdpa"]["4.53.3"]["verdict"] = "skipped"  # planted: the file changes after its index
    doc["cells"]["llama"]["sdpa"]["4.53.3"]["message"] = "planted"
    doc["cells"]["llama"]["sdpa"]["4.53.3"].pop("number", None)
    atlas.write_text(json.dumps(doc))
    S._VIEWS.clear()
    assert lookup("llama", "sdpa", "4.53.3", path=atlas).verdict == "skipped"
    assert len(list((tmp_path / "cache" / "support-index").iterdir())) == 2
    view = S.load_support_view(atlas)
    for f in (view._folder / "cells").iterdir():  # planted: a cache cleaned by hand under a running index
        f.unlink()
    assert view["cells"]["llama"]["sdpa"]["4.53.3"]["verdict"] == "skipped"  # read from the file itself
    assert not view._folder.exists()


def test_an_unwritable_cache_costs_only_speed(atlas, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(blocker / "cache"))  # under a file: nothing can be written
    assert lookup("llama", "sdpa", "4.53.1", path=atlas).verdict == "pass"
    assert isinstance(S.load_support_view(atlas), dict)


def test_an_edit_that_keeps_size_and_mtime_is_seen(atlas):
    """Trial 3: the index was keyed by path, size, mtime and inode: an in-place edit under `touch -r` kept answering
    the old number. Keyed by the file's bytes now."""
    import os

    before = lookup("llama", "sdpa", "4.44.2", path=atlas)
    text = atlas.read_text()
    stat = atlas.stat()
    old = '"number":0.16,'
    assert before.number == 0.16 and old in text
    at = text.index(old, text.index('"4.44.2"', text.index('"sdpa"', text.index('"llama":{'))))  # llama / sdpa / 4.44.2's
    with atlas.open("r+") as fh:  # same size, in place (same inode), then the old times back
        fh.write(text[:at] + '"number":0.19,' + text[at + len(old):])
    os.utime(atlas, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    S._VIEWS.clear()
    S._DIGESTS.clear()  # a new process: in one process a file's state is its stat
    assert lookup("llama", "sdpa", "4.44.2", path=atlas).number == 0.19


@pytest.mark.parametrize(("name", "content"), [("meta.json", "{}"), ("meta.json", "[]"), ("meta.json", "null"),
                                               ("meta.json", '{"_index": 1}'), ("cells/0.json", "[]"), ("cells/0.json", "{}"),
                                               ("cells/0.json", "null"), ("transitions.json", "{}"), ("transitions.json", '"x"'),
                                               ("trl.json", "[]")])
def test_an_index_file_of_the_wrong_shape_is_healed_not_believed(atlas, name, content):
    """Trial 3: valid JSON of the wrong shape in an index file gave tracebacks or "not measured"."""
    want = [a.as_dict() for a in lookup_releases("llama", "sdpa", "4.53", "1.16.0", path=atlas)]
    folder = next(iter(S._VIEWS))
    target = folder / name
    if name.startswith("cells/"):  # llama's row
        target = folder / S._VIEWS[folder]._meta["_index"]["cells"]["llama"]
    target.write_text(content)
    S._VIEWS.clear()
    assert [a.as_dict() for a in lookup_releases("llama", "sdpa", "4.53", "1.16.0", path=atlas)] == want


def test_old_indexes_are_pruned(atlas, tmp_path):
    doc = json.loads(atlas.read_text())
    for i in range(S.INDEX_KEEP + 3):  # planted: the atlas edited again and again
        doc["generated"] = f"edit {i}"
        atlas.write_text(json.dumps(doc))
        S._VIEWS.clear()
        lookup("llama", "sdpa", "4.53.1", path=atlas)
    assert len([d for d in (tmp_path / "cache" / "support-index").iterdir() if d.is_dir()]) == S.INDEX_KEEP


def test_a_plain_answer_reads_no_block_and_imports_no_atlas_machinery(atlas):
    """A plain lookup from the index: the pointer to the encoder block comes from the index's ``block_models``
    (no block file read) and the reproduce command from the file's ``checks`` (no ``pytest_packcheck.atlas``
    import: 45 ms of a 0.1 s lookup, issue 47)."""
    import subprocess
    import sys

    lookup("llama", "sdpa", "5.25.0", path=atlas)  # builds the index
    code = ("import sys, json; from pytest_packcheck.support import lookup; from pytest_packcheck.analysis import "
            "support_file as S; a = lookup('bert', 'sdpa', '5.24.0', path=sys.argv[1]); v = S.load_support_view(sys.argv[1]); "
            "print(json.dumps({'atlas': sorted(m for m in sys.modules if m.startswith('pytest_packcheck.atlas')), "
            "'heavy': sorted(m for m in sys.modules if m in HEAVY), "
            "'lazy': sorted(v._lazy), 'notes': a.notes, 'reproduce': a.reproduce}))")
    # neither the option table (its help texts import the registry) nor the backends' kernels / counting, nor the
    # check registry: 35 ms of a 0.14 s lookup before (issue 47); config.flags, backends.table, checks.causes suffice
    heavy = ("pytest_packcheck.config.options", "pytest_packcheck.checks.registry", "pytest_packcheck.backends.counting",
             "pytest_packcheck.backends.availability", "pytest_packcheck.backends.registration", "pytest_packcheck.results")
    code = f"HEAVY = {heavy!r}; " + code
    proc = subprocess.run([sys.executable, "-c", code, str(atlas)], capture_output=True, text=True, check=True,
                          env={**__import__("os").environ})
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["atlas"] == [] and not {"encoders", "multimodal"} & set(seen["lazy"])
    assert seen["heavy"] == [], seen["heavy"]
    assert any("packcheck lookup encoder:bert sdpa 5.24.0" in n for n in seen["notes"])
    from pytest_packcheck.atlas import reproduce_command

    assert seen["reproduce"] == reproduce_command("5.24.0", "bert", "sdpa")  # the same command the atlas builds
