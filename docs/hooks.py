"""The docs site's reference pages, generated from packcheck's own tables and registries at build time: never typed
by hand, so they cannot drift from the code. ``mkdocs build`` calls :func:`on_files` (an MkDocs hook, mkdocs.yml's
``hooks:``); ``tests/test_docs.py`` calls :func:`reference_pages` and plants a row in each table.

Each page names where it comes from (the module and the name of the table), and the command that prints the
same facts on a terminal where there is one.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _cell(text: Any) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _source(where: str, command: str = "") -> str:
    said = f"Generated from `{where}` when the site is built."
    return said + (f" On a terminal: `{command}`." if command else "") + "\n"


def checks_page() -> str:
    from pytest_packcheck.checks.listing import markdown_table
    from pytest_packcheck.checks.registry import DEFAULT_CHECKS, REGISTRY, TRAINING_CHECKS
    from pytest_packcheck.config.tolerances import load_tolerances

    tolerances, _ = load_tolerances(None, None, "audit/tolerances.toml")
    rows = []
    for s in REGISTRY:
        key = s.key_metric.key if s.key_metric else ""
        tol = ", ".join(f"{d} {t[s.tolerance]:g}" for d, t in tolerances.items() if s.tolerance and s.tolerance in t)
        rows.append([f"`{s.name}`", s.role, s.level, s.suite, f"`{key}`" if key else "-",
                     f"`{s.tolerance}` ({tol})" if s.tolerance else "-", ", ".join(s.requires) or "-",
                     ", ".join(f"[`{c}`](causes.md#{c})" for c in s.causes)])
    return ("# Checks\n\n" + _source("pytest_packcheck/checks/registry.py: REGISTRY", "packcheck checks")
            + "\nA **correctness** check decides a cell's verdict; a **hazard** reports a trap in the default way of "
              "running (it never decides); a **finding** reports a contract detail beside the verdict.\n\n"
            + markdown_table() + "\n## Key numbers, tolerances and causes\n\n"
            + _table(["check", "role", "runs per", "suite", "key number", "tolerance (per dtype)", "requires", "causes"], rows)
            + f"\nDefault checks: {', '.join(f'`{c}`' for c in DEFAULT_CHECKS)}.\n\n"
            + f"Training checks (opt in, or `--audit training`): {', '.join(f'`{c}`' for c in TRAINING_CHECKS)}.\n")


def causes_page() -> str:
    from pytest_packcheck.analysis.diagnose import load_known_faults
    from pytest_packcheck.checks.causes import CAUSE_RECORDS

    parts = ["# Causes and remedies\n", _source("pytest_packcheck/checks/causes.py: CAUSE_RECORDS and "
                                                "audit/known_faults.toml", "packcheck checks --causes"),
             ("\nA cell that is not a pass names its causes, each with its numbers; the diagnosis maps a cause to "
              "its remedy (the first refinement that fits the cell wins), and prefers the remedy of a known fault "
              "whose version window holds the cell.\n")]
    for cause in CAUSE_RECORDS.values():
        parts.append(f"\n## {cause.code}\n\n**Means:** {cause.meaning}.\n\n"
                     f"**Remedy:** {cause.remedy or '(none to give: read the evidence)'}\n")
        for r in cause.when:
            where = "; ".join(p for p in (", ".join(f"`{b}`" for b in r.backends), ", ".join(f"`{c}`" for c in r.checks),
                                          ", ".join(f"`{k}`" for k, _ in r.facts)) if p)
            parts.append(f"\n- on {where or 'any cell'}: {r.shown}")
        if cause.when:
            parts.append("\n")
    faults = load_known_faults()
    parts.append("\n## Known faults (by library version)\n\n" + _source("audit/known_faults.toml")
                 + "\n" + _table(["id", "library", "versions", "backends", "cause", "fixed in", "remedy", "upstream"],
                                 [[f"`{f.id}`", f.library, f"`{f.versions}`", ", ".join(f.backends), f"[`{f.cause}`](#{f.cause})",
                                   f.fixed_in or "-", f.remedy, f.upstream or "-"] for f in faults]))
    return "".join(parts)


def backends_page() -> str:
    from pytest_packcheck.backends.table import BACKENDS

    rows = [[f"`{b.name}`", b.label, b.family, b.registered_by, ", ".join(n.kind for n in b.needs) or "-",
             "yes" if b.default else "by name", "yes" if b.takes_mask else "no", "yes" if b.backward_on_cpu else "no",
             b.note or ""] for b in BACKENDS]
    return ("# Backends\n\n" + _source("pytest_packcheck/backends/table.py: BACKENDS", "packcheck audit --help")
            + "\nEach is an `attn_implementation` value. *Packed mask*: builds a block-diagonal mask from "
              "`position_ids` when no `attention_mask` is given (transformers >= 4.53.1, known fault "
              "`no-packed-mask-before-4.54`). *Backward on "
              "CPU*: no means forward-only there (the training checks are skipped).\n\n"
            + _table(["attn_implementation", "matrix label", "family", "registered by", "needs", "in the default matrix",
                      "packed mask", "backward on CPU", "note"], rows))


def options_page() -> str:
    from pytest_packcheck.config.options import OPTIONS, OTHER_ENV_VARS

    def default(o: Any) -> str:
        if o.action == "store_true":
            return "off"
        if o.default in (None, ()):
            return "-"
        return ",".join(map(str, o.default)) if isinstance(o.default, tuple) else str(o.default)

    rows = [[f"`{o.flag}`", f"`{o.ini}`" if o.ini else "-", f"`{o.env}`" if o.env else "-", default(o), o.help]
            for o in OPTIONS]
    return ("# Options\n\n" + _source("pytest_packcheck/config/options.py: OPTIONS", "pytest --help | grep packcheck")
            + "\nThe pytest plugin's options. A flag wins over its environment variable, which wins over the ini key "
              "(`[tool.pytest.ini_options]` or `pytest.ini`). `packcheck audit` takes the same options, and the "
              "short aliases `--models`, `--audit`, `--all-architectures`, `--versions`, `--resume` and `--timeout`.\n\n"
            + _table(["flag", "ini key", "environment variable", "default", "what it does"], rows)
            + "\nOther environment variables packcheck reads: " + ", ".join(f"`{v}`" for v in OTHER_ENV_VARS) + ".\n")


def commands_page() -> str:
    import os

    from pytest_packcheck.cli import COMMANDS, _parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the page must not depend on the builder's
    try:
        parser = _parser()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        return _commands_text(COMMANDS, sub)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def _commands_text(commands: Any, sub: Any) -> str:
    parts = ["# Commands\n\n", _source("pytest_packcheck/cli/__init__.py: COMMANDS", "packcheck COMMAND --help"), "\n",
             _table(["command", "what it does"], [[f"[`packcheck {c.name}`](#packcheck-{c.name})", c.help] for c in commands])]
    for c in commands:
        sp = sub.choices[c.name]
        text = sp.format_help() if sp.add_help else _own_help(c.module, c.name)
        parts.append(f"\n## packcheck {c.name}\n\n{c.help}\n\n```text\n{text.rstrip()}\n```\n")
    return "".join(parts)


def _own_help(module: str, name: str) -> str:
    """The help of a command that parses its own arguments (``main(argv)``): its module's parser."""
    import argparse
    import importlib

    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=f"packcheck {name}")
    return mod.add_arguments(parser).format_help() if hasattr(mod, "add_arguments") else (mod.__doc__ or "")


def exit_codes_page() -> str:
    from pytest_packcheck.cli import EXIT_CODES

    return ("# Exit codes\n\n" + _source("pytest_packcheck/cli/__init__.py: EXIT_CODES", "packcheck --help") + "\n"
            + _table(["code", "meaning"], [[f"`{code}`", meaning] for code, meaning in sorted(EXIT_CODES.items())]))


def _field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comments above a dataclass's fields in its source."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = re.match(r"(\w+):", stripped)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        pending = [] if not stripped.startswith("#") else pending
    return out


def results_schema_page() -> str:
    from pytest_packcheck.results import schema

    comments = _field_comments(schema.CellResult)
    rows = [[f"`{f.name}`", f"`{f.type if isinstance(f.type, str) else f.type.__name__}`", comments.get(f.name, "")]
            for f in dataclasses.fields(schema.CellResult)]
    statuses = [[f"`{s}`", schema.SYMBOLS.get(s, "")] for s in schema.STATUSES]
    return ("# The results file\n\n" + _source("pytest_packcheck/results/schema.py: CellResult, STATUSES")
            + f"\n`packcheck-matrix.json` (schema_version {schema.SCHEMA_VERSION}): an object with `schema_version`, "
              "`packcheck_version`, `environment` (the exact library versions the cells were measured on), `settings`, "
              "`command` (the command that reproduces it), the tables `models` (key, the model's label -> its model "
              "record) and `tolerances` (key `t0`, `t1`, ... -> a tolerance set), and `cells`, one record per model x "
              "backend x check x dtype, whose `model` and `tolerances` name their table entry (`\"model\": \"llama\"`, "
              "`\"tolerances\": \"t0\"`): each record is kept once (schema 3; the committed default matrix 2.42 -> 1.59 MB). "
              "`packcheck gate`, `packcheck merge`, `--packcheck-resume` and the atlas read it back through one loader "
              "(`results.schema.load_document`), which expands the tables: every reader sees each cell with its own "
              "`model` and `tolerances` objects, the fields below. A reference to a key its table lacks is a one-line "
              "error naming the file, the cell and the key. Files of older schema versions (schema 2: each cell "
              "self-contained, as gate baselines saved before schema 3 are) load as they are, and are upgraded on "
              "load. The journal (`packcheck-journal.jsonl`) keeps self-contained cells, one a line.\n\n## A cell\n\n"
            + _table(["field", "type", "meaning"], rows)
            + "\n## Verdicts (worst first)\n\n" + _table(["status", "symbol"], statuses))


def support_schema_page() -> str:
    text = (REPO / "reports" / "atlas" / "SCHEMA.md").read_text(encoding="utf-8")
    return text if text.startswith("# ") else "# The atlas support file\n\n" + text


def newest_page() -> str:
    """The encoder and multimodal blocks' newest release, from the committed support file (never typed)."""
    import json

    from pytest_packcheck.atlas.kinds_render import newest_markdown

    return newest_markdown(json.loads((REPO / "reports" / "atlas" / "support.json").read_text(encoding="utf-8")))


#: docs path -> page builder
PAGES = {
    "reference/checks.md": checks_page,
    "reference/causes.md": causes_page,
    "reference/backends.md": backends_page,
    "reference/options.md": options_page,
    "reference/commands.md": commands_page,
    "reference/exit-codes.md": exit_codes_page,
    "reference/results-schema.md": results_schema_page,
    "reference/support-schema.md": support_schema_page,
    "reference/atlas-newest.md": lambda: newest_page(),
}


def reference_pages() -> dict[str, str]:
    """Every generated page: docs path -> Markdown."""
    return {path: build() for path, build in PAGES.items()}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site (they exist only in the build, never in ``docs/``)."""
    from mkdocs.structure.files import File

    for path, text in reference_pages().items():
        files.append(File.generated(config, path, content=text))
    return files
