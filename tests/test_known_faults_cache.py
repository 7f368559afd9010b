"""The known faults' JSON copy (analysis.diagnose._parsed_toml, issue 47: lookup reads them on every answer): the same
faults as the TOML, a new key on an edit, a damaged copy healed, an unwritable cache only slower."""

from __future__ import annotations

import pytest
import tomllib

from pytest_packcheck.analysis import diagnose as D
from pytest_packcheck.config.audits import PACKAGE_AUDIT_DIR

SHIPPED = PACKAGE_AUDIT_DIR / "known_faults.toml"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(tmp_path / "cache"))
    D._read_known_faults.cache_clear()
    yield tmp_path / "cache" / "known-faults"
    D._read_known_faults.cache_clear()


def test_the_copy_gives_what_the_toml_gives_and_is_read_on_the_next_start(cache):
    want = tomllib.loads(SHIPPED.read_text())
    assert D._parsed_toml(SHIPPED) == want  # parsed, then written
    (copy,) = cache.glob("*.json")
    assert D._parsed_toml(SHIPPED) == want and list(cache.glob("*.json")) == [copy]
    assert D.load_known_faults() and {f.id for f in D.load_known_faults()} == {f["id"] for f in want["fault"]}


def test_an_edit_is_a_new_copy_and_a_damaged_copy_is_healed(cache, tmp_path):
    mine = tmp_path / "faults.toml"
    mine.write_text(SHIPPED.read_text())
    D._parsed_toml(mine)
    (copy,) = cache.glob("*.json")
    copy.write_text("{not json")  # planted: a copy cut mid-write by another process
    assert D._parsed_toml(mine) == tomllib.loads(mine.read_text())
    mine.write_text(mine.read_text().replace("[[fault]]", "[[fault]]\n", 1))  # an edit: another key, never the old copy
    D._parsed_toml(mine)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_planted_stale_copy_under_another_key_is_never_read(cache, tmp_path):
    mine = tmp_path / "faults.toml"
    mine.write_text('[[fault]]\nid = "a"\n')
    assert D._parsed_toml(mine)["fault"][0]["id"] == "a"
    for copy in cache.glob("*.json"):
        copy.write_text('{"fault": [{"id": "stale"}]}')  # the copy of the old bytes, changed behind our back
    mine.write_text('[[fault]]\nid = "b"\n')
    assert D._parsed_toml(mine)["fault"][0]["id"] == "b"


def test_an_unwritable_cache_only_parses_each_time(tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("PACKCHECK_CACHE_DIR", str(blocked))
    assert D._parsed_toml(SHIPPED) == tomllib.loads(SHIPPED.read_text())


def test_edits_leave_only_the_newest_copies(cache, tmp_path):
    """Planted: ten edits of the file. Before, each left its 20 KB copy behind for good; now the newest
    KNOWN_FAULTS_KEEP stay, the current one among them, and it is still the one read."""
    import os

    mine = tmp_path / "faults.toml"
    for i in range(10):
        mine.write_text(f'[[fault]]\nid = "f{i}"\n')
        assert D._parsed_toml(mine)["fault"][0]["id"] == f"f{i}"
        for n, copy in enumerate(sorted(cache.glob("*.json"))):  # older copies in the past, whatever the clock
            if f'"f{i}"' not in copy.read_text():
                os.utime(copy, (1_000_000 + i * 100 + n,) * 2)
    assert len(list(cache.glob("*.json"))) == D.KNOWN_FAULTS_KEEP
    assert D._parsed_toml(mine)["fault"][0]["id"] == "f9"
