"""The docs (issue 43): the site builds with warnings as errors, its reference pages are generated from packcheck's
own tables (a row added to a table is on its page with no other edit), README stays short and points into the docs,
and no page types a dated measurement."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def _hooks():
    spec = importlib.util.spec_from_file_location("packcheck_docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_registered_name_is_on_its_reference_page():
    from pytest_packcheck.backends.table import BACKENDS
    from pytest_packcheck.checks.causes import CAUSE_RECORDS
    from pytest_packcheck.checks.registry import REGISTRY
    from pytest_packcheck.cli import COMMANDS, EXIT_CODES
    from pytest_packcheck.config.options import OPTIONS

    pages = _hooks().reference_pages()
    assert all(f"| `{s.name}` |" in pages["reference/checks.md"] for s in REGISTRY)
    assert all(f"\n## {code}\n" in pages["reference/causes.md"] for code in CAUSE_RECORDS)
    assert all(f"| `{b.name}` |" in pages["reference/backends.md"] for b in BACKENDS)
    assert all(f"| `{o.flag}` |" in pages["reference/options.md"] for o in OPTIONS)
    assert all(f"\n## packcheck {c.name}\n" in pages["reference/commands.md"] for c in COMMANDS)
    assert all(f"| `{code}` |" in pages["reference/exit-codes.md"] for code in EXIT_CODES)
    assert "`duration_s`" in pages["reference/results-schema.md"] and "| `pass` | ✅ |" in pages["reference/results-schema.md"]
    assert pages["reference/support-schema.md"].startswith("# ")
    # the known faults' remedies, with their version windows
    assert "`trainer-keeps-config-use_cache`" in pages["reference/causes.md"]


def test_a_row_added_to_a_table_reaches_its_page_with_no_other_edit(monkeypatch):
    """Planted: one new option, backend, cause and exit code, each added to its table only."""
    import dataclasses

    from pytest_packcheck import cli
    from pytest_packcheck.backends import table
    from pytest_packcheck.checks import causes
    from pytest_packcheck.config import options

    hooks = _hooks()
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, options.Option("--packcheck-planted", "A planted option.")))
    monkeypatch.setattr(table, "BACKENDS", (*table.BACKENDS, dataclasses.replace(table.BACKENDS[0], name="planted_attn")))
    monkeypatch.setattr(causes, "CAUSE_RECORDS", {**causes.CAUSE_RECORDS, "planted_cause": causes.Cause(
        "planted_cause", "a planted meaning", "a planted remedy")})
    monkeypatch.setattr(cli, "EXIT_CODES", {**cli.EXIT_CODES, 99: "a planted exit"})
    assert "| `--packcheck-planted` |" in hooks.options_page()
    assert "| `planted_attn` |" in hooks.backends_page()
    assert "## planted_cause" in hooks.causes_page() and "a planted remedy" in hooks.causes_page()
    assert "| `99` | a planted exit |" in hooks.exit_codes_page()


def _site_copy(tmp_path: Path) -> Path:
    site = tmp_path / "site-src"
    site.mkdir()
    shutil.copytree(REPO / "docs", site / "docs")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(REPO / name, site / name)
    (site / "reports").symlink_to(REPO / "reports")
    return site


def _build(site: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site / "out")], cwd=site,
                          capture_output=True, text=True, check=False, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin",
                                                                             "HOME": str(site)})


def test_the_site_builds_with_warnings_as_errors_and_a_broken_link_fails_it(tmp_path):
    site = _site_copy(tmp_path)
    proc = _build(site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {p.relative_to(site / "out").as_posix() for p in (site / "out").rglob("index.html")}
    assert {"reference/checks/index.html", "reference/causes/index.html", "guard/index.html"} <= built
    (site / "docs" / "guard.md").write_text((site / "docs" / "guard.md").read_text() + "\n[gone](no-such-page.md)\n")
    proc = _build(site)
    assert proc.returncode != 0 and "no-such-page.md" in proc.stderr + proc.stdout


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 150, len(README.splitlines())
    links = re.findall(r"\]\(([^)#]+)\)", README)
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert links and not missing, missing
    for step in ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                 "pip install -c constraints/cpu.txt -e . && packcheck audit"):
        assert step in README  # the two set-up commands


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_no_page_types_a_dated_measurement():
    """Figures live in generated files with the command that made them; a date in prose is a figure typed by hand.
    The changelog's release dates are its form."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    dated = {p.name: DATED.findall(p.read_text(encoding="utf-8")) for p in pages if p.name != "changelog.md"}
    assert not {k: v for k, v in dated.items() if v}, dated
    assert DATED.findall("measured on 2026-12-01 on this machine")  # the pattern catches one


def contributing_path_problems(text: str, root: Path = REPO) -> list[str]:
    """The files CONTRIBUTING.md's walkthroughs name that are not in the tree: a backticked path (a short one such
    as ``checks/parity.py`` is under pytest_packcheck/; ``<name>`` placeholders and bare file names are left out) or
    a ``tests/x.py::test_name`` whose test is not defined there. A module moved without its walkthrough is named."""
    top = {"pytest_packcheck", "tests", "tools", "audit", "docs", "benchmarks", "examples"}
    problems = []
    for path, test in re.findall(r"`([\w./<>-]+\.(?:py|toml|sh))(?:::(\w+))?`", text):
        if "<" in path or "/" not in path:
            continue
        file = root / path if path.split("/")[0] in top else root / "pytest_packcheck" / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
        elif test and f"def {test}(" not in file.read_text(encoding="utf-8"):
            problems.append(f"{path}::{test}: no such test")
    return problems


def test_contributing_names_only_files_and_tests_that_exist():
    """The walkthroughs name the files a contributor edits (measured, CONTRIBUTING.md); each is in the tree. Planted:
    a moved module and a renamed test are named."""
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert "`pytest_packcheck/checks/registry.py`" in text and "`tests/test_checks.py`" in text
    assert contributing_path_problems(text) == []
    planted = "`checks/parity_moved.py` and `tests/test_checks.py::test_no_such_test`, `report/<name>.py`"
    assert contributing_path_problems(planted) == ["checks/parity_moved.py: no such file",
                                                   "tests/test_checks.py::test_no_such_test: no such test"]
