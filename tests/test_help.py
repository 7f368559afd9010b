"""Help and docs derived from the registry: --help lists every check, cause, audit and exit code; the docs' option
page (generated, docs/hooks.py) holds exactly the registered flags; bisect --cause offers the registry's codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_packcheck.checks.causes import CAUSES
from pytest_packcheck.checks.registry import REGISTRY
from pytest_packcheck.cli import EXIT_CODES, _parser, audits
from pytest_packcheck.config.options import OPTIONS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _page(name: str) -> str:
    """A generated reference page of the docs (docs/hooks.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("packcheck_docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.PAGES[f"reference/{name}.md"]()


def _help(*argv: str) -> str:
    parser = _parser()
    if not argv:
        return parser.format_help()
    # argparse has no public accessor for a subcommand's parser
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")
    return sub.choices[argv[0]].format_help()


def test_help_lists_every_check_cause_audit_and_exit_code_from_the_registry():
    for text in (_help(), _help("audit")):
        flat = " ".join(text.split())
        for spec in REGISTRY:
            assert f"{spec.name} ({spec.role}" in flat, spec.name
        for code in CAUSES:
            assert f"{code}: " in flat, code
        assert {"default", "training"} <= set(audits())
        for name in audits():
            assert f"{name}: " in flat, name
        for code in EXIT_CODES:
            assert f"{code}: " in flat, code
    assert "--audit training" in " ".join(_help("audit").split())


def test_the_option_page_holds_exactly_the_registered_flags():
    table = _page("options")
    in_table = {f for row in table.splitlines() if row.startswith("| `--") for f in re.findall(r"--packcheck-[a-z-]+", row.split("|")[1])}
    assert in_table == {o.flag for o in OPTIONS}
    for opt in OPTIONS:  # and --help (the same option records)
        assert opt.flag in _help("audit"), opt.flag


def _option_row(flag: str) -> str:
    return next(row for row in _page("options").splitlines() if row.startswith(f"| `{flag}` |"))


def test_the_checks_row_names_every_check_and_the_attn_row_every_backend():
    """Issue 28: the README's row was typed by hand and missed single_row and the variants suite; the page's rows
    are the options' own help."""
    from pytest_packcheck.backends.table import KNOWN_BACKENDS

    row = _option_row("--packcheck-checks")
    assert [s.name for s in REGISTRY if s.name not in row] == []
    row = _option_row("--packcheck-attn")
    assert [b for b in KNOWN_BACKENDS if b not in row] == []


def test_lookups_exit_codes_are_in_the_help_and_readme(tmp_path):
    """Trial 7, 152: lookup exits 1 for "not measured", said only in cli/lookup.py's docstring; --help's exit-code list
    gave 1 for gate / bisect only. EXIT_CODES (the one source of --help) now names lookup's 0 and 1, and so does the
    README's exit-code line."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "lookup", "qwen2", "sdpa", "9.0.0"],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert proc.returncode == 1 and "not measured" in proc.stdout, proc.stdout + proc.stderr
    assert "lookup: not measured" in EXIT_CODES[1] and "lookup: a measured answer" in EXIT_CODES[0]
    flat = " ".join(_help().split())
    assert "lookup: not measured" in flat and "lookup: a measured answer" in flat
    assert "`packcheck lookup` exits `1` when the release is not measured" in " ".join(README.split())


def test_the_exit_code_page_names_every_exit_code():
    page = _page("exit-codes")
    for code, meaning in EXIT_CODES.items():
        assert f"| `{code}` | {' '.join(meaning.split()).replace('|', chr(92) + '|')} |" in page, code


def test_bisect_cause_help_offers_the_registry_codes_only():
    flat = " ".join(_help("bisect").split())
    assert "padded_normalisation" in flat and "e.g. loss_normalisation" not in flat
    for code in CAUSES:
        assert code in flat


def test_packcheck_checks_exists_as_the_checks_flag_help_says(capsys):
    """`--packcheck-checks --help` says "See `packcheck checks`": the command lists every check with its role, level,
    suite, key number, tolerance (shipped values) and causes; --markdown prints the docs' check table; an unknown name
    is a usage error naming the allowed ones."""
    from pytest_packcheck.cli import main
    from pytest_packcheck.config.options import OPT_CHECKS

    assert "See `packcheck checks`" in next(o.help for o in OPTIONS if o.flag == OPT_CHECKS)
    assert "checks" in _help() and main(["checks"]) == 0
    listing = capsys.readouterr().out
    blocks = {b.split()[0]: b for b in listing.split("\n\n") if b.strip() and not b.startswith("suites:")}
    assert list(blocks) == [s.name for s in REGISTRY]
    for spec in REGISTRY:
        flat = " ".join(blocks[spec.name].split())
        assert f"({spec.role}, per {spec.level}; suite {spec.suite}" in flat
        assert "causes: " + ", ".join(spec.causes) in flat
        if spec.tolerance:
            assert f"tolerance: {spec.tolerance} (float32 " in flat
        assert ("requires: trl" in flat) == ("trl" in spec.requires)
    assert main(["checks", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| check | runs | role | what it checks |") and table in _page("checks")
    assert main(["checks", "isolaton"]) == 2
    assert "unknown check 'isolaton'. Expected one of: collate," in capsys.readouterr().err


def test_every_cause_has_a_meaning_and_the_listing_gives_its_remedy(capsys):
    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.checks.listing import main

    assert main(["--causes"]) == 0
    out = capsys.readouterr().out
    for code, cause in CAUSE_RECORDS.items():
        assert cause.meaning and f"\n{code}\n" in f"\n{out}"
    assert "remedy: do not pass attention_mask with packed rows" in " ".join(out.split())


def test_causes_with_a_check_name_lists_only_that_checks_causes(capsys):
    """`packcheck checks sft --causes` printed every cause: the check filter was silently ignored."""
    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.checks.listing import main
    from pytest_packcheck.checks.registry import SPECS

    assert main(["sft", "--causes"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith(" ")]
    assert listed == [c for c in CAUSE_RECORDS if c in SPECS["sft"].causes] and set(listed) == set(SPECS["sft"].causes)
    assert len(listed) < len(CAUSE_RECORDS)


def test_every_command_of_the_table_is_a_subcommand_with_its_help_in_table_order():
    from pytest_packcheck.cli import COMMANDS

    sub = next(a for a in _parser()._subparsers._group_actions if a.dest == "command")
    assert list(sub.choices) == [c.name for c in COMMANDS]
    flat = " ".join(_help().split())
    for command in COMMANDS:
        assert " ".join(command.help.split()) in flat, command.name


def test_a_command_that_parses_its_own_arguments_gets_the_rest_of_the_command_line(monkeypatch, capsys):
    import sys
    import types

    from pytest_packcheck import cli
    from pytest_packcheck.errors import PackcheckUsageError

    seen = []

    def own_main(argv):
        seen.append(argv)
        if "--bad" in argv:
            raise PackcheckUsageError("--bad is refused: drop it.")
        return 0

    module = types.ModuleType("packcheck_test_own_main")
    module.main = own_main
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, cli.Command("own", module.__name__, "A command with its own parser.")))
    assert "own" in _help() and "A command with its own parser." in _help()
    assert cli.main(["own", "--markdown", "-x"]) == 0 and seen == [["--markdown", "-x"]]
    assert cli.main(["own", "--bad"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["packcheck own: error: --bad is refused: drop it."]


def test_version_flag_and_license_file():
    """Issue 43: no --version and no LICENSE file. The version is the package's (its metadata, pyproject's)."""
    import subprocess
    import sys
    from importlib.metadata import version
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "--version"], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == f"packcheck {version('packcheck')}"
    license_text = (Path(__file__).resolve().parent.parent / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def test_a_mistyped_command_names_the_one_meant(capsys):
    """Trial 3: `packcheck lookp` got argparse's bare "invalid choice" list."""
    from pytest_packcheck.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["lookp", "llama", "sdpa", "5.24.0"])
    assert exit_.value.code == 2
    assert "unknown command 'lookp'. Did you mean 'lookup'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["zzzzz"])  # nothing close: argparse's own list
    assert "invalid choice: 'zzzzz'" in capsys.readouterr().err
