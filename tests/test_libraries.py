"""The libraries table (versions/libraries.py): every list of libraries is read from it."""

from __future__ import annotations

from importlib import metadata

import pytest

from pytest_packcheck.versions import libraries as L


@pytest.fixture
def new_library(monkeypatch):
    """A library added to the table as one record (tabulate: installed here, in no list before)."""
    record = L.Library("tabulate", "tabulate", repo="astanin/python-tabulate", recorded=True, header=True, stack=True,
                       upgrade_names=("tabulate",))
    monkeypatch.setattr(L, "LIBRARIES", (*L.LIBRARIES, record))
    monkeypatch.setattr(L, "BY_NAME", {**L.BY_NAME, record.name: record})
    monkeypatch.setattr(L, "_UPGRADE", L._upgrade_pattern())
    return record


def test_a_new_record_reaches_the_environment_fingerprint_and_header(new_library):
    from pytest_packcheck.results.environment import environment
    from pytest_packcheck.run.journal import fingerprint

    env = environment()
    assert env["tabulate"] == metadata.version("tabulate")
    assert new_library in L.header_libraries() and new_library in L.stack_libraries()
    assert f"tabulate {metadata.version('tabulate')}" in L.versions_line(env)
    # a run measured under another version of the new library is not resumed from the journal
    assert fingerprint({}, env, {}) != fingerprint({}, {**env, "tabulate": "0.0.1"}, {})


def test_an_unrecorded_library_changes_no_fingerprint():
    from pytest_packcheck.results.environment import environment
    from pytest_packcheck.run.journal import fingerprint

    env = environment()
    assert "tabulate" not in env
    assert fingerprint({}, env, {}) == fingerprint({}, {**env, "tabulate": "0.0.1"}, {})


def test_record_keys_follow_the_table():
    from pytest_packcheck.results.environment import environment

    env = environment()
    assert [lib.key for lib in L.recorded_libraries()] == ["torch", "transformers", "trl", "flash_attn"]
    assert all(lib.key in env for lib in L.recorded_libraries())
    assert [lib.label for lib in L.header_libraries()] == ["torch", "transformers", "trl", "flash-attn"]
    assert L.versions_line({"torch": "2.13.0"}) == ("torch 2.13.0, transformers not installed, trl not installed, "
                                                    "flash-attn not installed")


def test_version_axis_and_links_come_from_the_table():
    from pytest_packcheck.versions import envs

    assert "torch" not in envs.KNOWN_LIBRARIES and "transformers" in envs.KNOWN_LIBRARIES
    for name in ("torch", "flash-attn", "flash-attn-3", "pytorch-triton-rocm", "nvidia-cublas-cu12", "mamba-ssm"):
        assert envs.is_hardware_bound(name), name
    for name in ("transformers", "trl", "accelerate", "kernels"):
        assert not envs.is_hardware_bound(name), name
    assert envs.TRL_FLOOR == "trl>=0.19"
    assert {"accelerate", "huggingface-hub"} <= set(envs.PACKCHECK_RUNTIME)


def test_upgrade_wording_is_written_and_read_by_the_table(new_library):
    from pytest_packcheck.analysis.remedies import remedy_claims

    assert L.upgrade_advice("trl", "0.23.1") == "upgrade TRL to >= 0.23.1"
    assert L.find_upgrade("train with flash, or upgrade TRL to >= 0.23.1 (bisected)") == ("trl", "0.23.1")
    assert L.find_upgrade("upgrade transformers to >= 4.53.1 (packed masks)") == ("transformers", "4.53.1")
    assert L.find_upgrade("upgrade TRL (from 0.21 bfd packing turns padding-free on)") is None
    cell = {"diagnosis": {"cause": "leak", "remedy": L.upgrade_advice("tabulate", "9.1") + ", or use flash"}}
    assert remedy_claims(cell, []) == [{"cause": "leak", "remedy": "upgrade tabulate to >= 9.1, or use flash",
                                        "kind": "upgrade", "library": "tabulate", "version": "9.1"}]
    with pytest.raises(KeyError, match="unknown library"):
        L.upgrade_advice("transformer", "1.0")


def test_table_rules_are_checked_at_import(monkeypatch):
    monkeypatch.setattr(L, "LIBRARIES", (*L.LIBRARIES, L.Library("cuda-python", "cuda", hardware=True)))
    monkeypatch.setattr(L, "BY_NAME", {lib.name: lib for lib in L.LIBRARIES})
    with pytest.raises(ValueError, match="cuda-python: a hardware library is linked"):
        L._check_table()


def test_the_rl_trainers_are_libraries_on_the_version_axis():
    """verl, OpenRLHF and ms-swift (the trainers the rl suite runs the code of) are records: named on
    --packcheck-versions they are parsed as libraries of the axis, never as a typo, and each reads its installed
    version from its distribution (ms-swift's module is swift)."""
    from pytest_packcheck.versions import envs

    for name in ("verl", "openrlhf", "ms-swift"):
        assert name in envs.KNOWN_LIBRARIES and L.library(name) in L.axis_libraries()
    assert L.library("ms_swift").import_name == "swift"
    combos = envs.parse_versions(["trl==1.16.0&verl==0.9.1"], "--packcheck-versions")
    assert combos[0].requirements == ("trl==1.16.0", "verl==0.9.1")
    with pytest.raises(Exception, match="verl"):
        envs.parse_versions(["vrel==0.9.1"], "--packcheck-versions")  # a misspelt trainer is refused, naming it
