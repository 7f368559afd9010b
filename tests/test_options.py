"""The option table is the one place an option's default, parsing and serialisation are written: Settings, the
Reproduce line, the shrink, the batches and --help all read them from there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pytest_packcheck.config.options import (
    BY_FLAG,
    OPT_ISOLATION,
    OPT_LENGTHS,
    OPT_SLIDING_WINDOW,
    OPT_TIMEOUT,
    OPTIONS,
    default_of,
)
from pytest_packcheck.config.settings import Settings

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_packcheck"


def _settings(**changes):
    base = {"models": ("arch:llama",), "model_source": "test", "backends": ("sdpa",), "checks": ("isolation",),
            "dtypes": ("float32",), "weights": "random", "device": "cpu", "trust_remote_code": False,
            "report_dir": default_of("--packcheck-report-dir"), "tolerances": {}}
    return Settings(**{**base, **changes})


def test_every_settings_default_is_its_options_default():
    defaults = {f.name: f.default for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING}
    fields = {f.name for f in dataclasses.fields(Settings)}
    for opt in OPTIONS:
        if opt.field is None:
            continue
        assert opt.field in fields, opt.flag
        if opt.field in defaults:
            assert defaults[opt.field] == opt.default, opt.flag


def test_modules_that_need_a_default_read_it_from_the_table():
    from pytest_packcheck.model.batches import DEFAULT_LENGTHS
    from pytest_packcheck.model.tiny import TINY_SLIDING_WINDOW

    assert DEFAULT_LENGTHS == default_of(OPT_LENGTHS) and TINY_SLIDING_WINDOW == default_of(OPT_SLIDING_WINDOW)
    literal = repr(default_of(OPT_LENGTHS))  # "(11, 7, 13)": written once, in the table
    holders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if literal in p.read_text(encoding="utf-8") and p.relative_to(PACKAGE) != Path("config", "options.py")]
    assert holders == [], f"{literal} retyped outside the option table in {holders}: read default_of({OPT_LENGTHS!r})"


def test_reproduce_line_names_the_always_options_and_only_the_changed_others():
    always = {o.flag for o in OPTIONS if o.always}
    at_defaults = _settings().reproduce_flags()
    assert {a.partition("=")[0] for a in at_defaults} == always
    changed = _settings(lengths=(11, 1, 13), sandbox="none", shard=(2, 3)).reproduce_flags()
    assert set(changed) - set(at_defaults) == {f"{OPT_LENGTHS}=11,1,13", f"{OPT_ISOLATION}=none", "--packcheck-shard=2/3"}


def test_version_child_gets_the_in_child_options_only():
    args = _settings(shard=(2, 3), baseline="b.json", resume=True).to_args(version_child=True)
    flags = {a.partition("=")[0] for a in args}
    assert flags == {o.flag for o in OPTIONS if o.in_child and o.field and o.to_arg is not None}


@pytest.mark.parametrize("flag, text", [(OPT_TIMEOUT, "default 600;"), (OPT_LENGTHS, "default 11,7,13;"),
                                        (OPT_SLIDING_WINDOW, "default 8,")])
def test_help_quotes_the_tables_default(flag, text):
    assert text in BY_FLAG[flag].help


def test_isolation_flag_fills_the_sandbox_field():
    """The flag keeps its public name; the field is ``sandbox``, not "isolation" (also a check's name)."""
    assert BY_FLAG[OPT_ISOLATION].field == "sandbox" and BY_FLAG[OPT_ISOLATION].dest == "packcheck_isolation"


@pytest.mark.parametrize("env, value, message", [
    ("PACKCHECK_DEVICE", "xpu", "Unknown device 'xpu' (from $PACKCHECK_DEVICE)"),
    ("PACKCHECK_DEVICE", "cuda:a", "Unknown device 'cuda:a' (from $PACKCHECK_DEVICE). Expected cpu, cuda or cuda:N"),
    ("PACKCHECK_TIMEOUT", "-1", "Bad timeout '-1' (from $PACKCHECK_TIMEOUT)"),
    ("PACKCHECK_SHARD", "3/2", "Bad shard '3/2' (from $PACKCHECK_SHARD)"),
])
def test_a_bad_value_is_refused_by_its_rows_parse_naming_its_source(monkeypatch, env, value, message):
    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.errors import PackcheckUsageError

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    monkeypatch.setenv(env, value)
    with pytest.raises(PackcheckUsageError) as err:
        resolve(lambda dest: "arch:llama" if dest == "packcheck_models" else None, lambda key: None)
    assert message in str(err.value)


def test_an_audits_lengths_go_through_the_same_parse(tmp_path, monkeypatch):
    from pytest_packcheck.config.settings import resolve

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    audit = tmp_path / "a.toml"
    audit.write_text('[audit]\nmodels = ["arch:llama"]\nlengths = [5, 1, 6]\nsliding_window = 4\n')
    settings = resolve(lambda dest: str(audit) if dest == "packcheck_audit" else None, lambda key: None)
    assert settings.lengths == (5, 1, 6) and settings.sliding_window == 4
    assert f"{OPT_LENGTHS}=5,1,6" in settings.reproduce_flags()


def test_a_timeout_given_with_isolation_none_is_warned_as_not_enforced_and_recorded(monkeypatch):
    """`--packcheck-isolation none --packcheck-timeout 1`: the limit is enforced by killing a forked child, so
    without one it is not enforced; the run says so at start (it ran a 4 s cell silently) and the settings record
    both the timeout and the isolation."""
    import warnings

    from pytest_packcheck.config.settings import resolve
    from pytest_packcheck.errors import PackcheckWarning

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    given = {"packcheck_models": "arch:llama", BY_FLAG[OPT_ISOLATION].dest: "none", BY_FLAG[OPT_TIMEOUT].dest: "1"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        settings = resolve(given.get, lambda key: None)
    lines = [str(w.message) for w in seen if issubclass(w.category, PackcheckWarning)]
    assert len(lines) == 1 and "timeout 1 s (from --packcheck-timeout) is not enforced" in lines[0]
    assert f"{OPT_ISOLATION}=fork" in lines[0]
    assert settings.as_dict()["isolation"] == "none" and settings.as_dict()["timeout_s"] == 1
    with warnings.catch_warnings(record=True) as seen:  # the default timeout with isolation none: no warning
        warnings.simplefilter("always")
        resolve({k: v for k, v in given.items() if k != BY_FLAG[OPT_TIMEOUT].dest}.get, lambda key: None)
    assert not [w for w in seen if issubclass(w.category, PackcheckWarning)]
