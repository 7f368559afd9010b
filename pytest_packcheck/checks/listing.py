"""``packcheck checks``: every check with its role, level, suite, requirements, key number, tolerance and causes,
read from the registry; ``--markdown`` prints the check table of the docs (docs/reference/checks.md), ``--causes`` every cause with its remedy.

Imports neither torch nor transformers (the tolerances are read from ``audit/tolerances.toml``).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

from .causes import CAUSE_RECORDS
from .registry import REGISTRY, SUITES, CheckSpec, describe

HELP = "List the checks: role, level, suite, requirements, key number, tolerance and causes (the registry)."


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``packcheck checks`` (the CLI's subcommand and :func:`main` share them)."""
    parser.add_argument("names", nargs="*", metavar="CHECK", help="Only these checks (default: all, in matrix order).")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--markdown", action="store_true", help="Print the check table (Markdown) of the docs' checks page instead.")
    form.add_argument("--causes", action="store_true", help="Print every cause code (only the named checks' causes with CHECK) with its meaning and remedy instead.")
    return parser


def markdown_table(specs: tuple[CheckSpec, ...] = REGISTRY) -> str:
    """The docs' check table (docs/reference/checks.md): one row per check (name, where it runs, role and suite, summary)."""
    names = {s.name for s in specs}
    rows = [f"| `{name}` | {level} | {role} | {summary} |" for name, level, role, summary in describe() if name in names]
    return "\n".join(["| check | runs | role | what it checks |", "|---|---|---|---|", *rows]) + "\n"


def _tolerance_values(key: str, tolerances: dict[str, dict[str, float]]) -> str:
    values = [f"{dtype} {table[key]:g}" for dtype, table in tolerances.items() if key in table]
    return f"{key} ({', '.join(values)})" if values else key


def text_listing(specs: tuple[CheckSpec, ...] = REGISTRY, tolerances: dict[str, dict[str, float]] | None = None) -> str:
    """One block per check: name, role, level and suite; the summary; key number, tolerance (with the shipped
    values per dtype), requirements and causes."""
    wrap = textwrap.TextWrapper(width=100, initial_indent="  ", subsequent_indent="    ")
    lines: list[str] = []
    for s in specs:
        lines.append(f"{s.name}  ({s.role}, per {s.level}; suite {s.suite}{', opt in' if s.opt_in else ''})")
        lines += wrap.wrap(s.summary)
        key = f"{s.key_metric.key} (shown as '{s.key_metric.label} <number>')" if s.key_metric else (
            "its own format" if s.key_number_format else "none")
        details = [f"key number: {key}",
                   "tolerance: " + (_tolerance_values(s.tolerance, tolerances or {}) if s.tolerance else "none"),
                   "requires: " + (", ".join(s.requires) if s.requires else "packcheck's runtime only")]
        if s.skip_backends:
            details.append("not planned on: " + ", ".join(s.skip_backends))
        details.append("causes: " + ", ".join(s.causes))
        lines += [line for d in details for line in wrap.wrap(d)]
        lines.append("")
    lines += ["suites:"] + [line for name, what in SUITES.items() for line in wrap.wrap(f"{name}: {what}")]
    return "\n".join(lines) + "\n"


def causes_listing(specs: tuple[CheckSpec, ...] | None = None) -> str:
    """Every cause code: its meaning and its remedy (version advice comes from audit/known_faults.toml). With
    ``specs`` (``packcheck checks sft --causes``), only the causes those checks name (their registry records), each
    with the remedies that hold on any of them."""
    wrap = textwrap.TextWrapper(width=100, initial_indent="  ", subsequent_indent="    ")
    names = {s.name for s in specs} if specs else None
    codes = {c for s in specs for c in s.causes} if specs else None
    lines: list[str] = []
    for cause in CAUSE_RECORDS.values():
        if codes is not None and cause.code not in codes:
            continue
        lines.append(cause.code)
        lines += wrap.wrap(f"means: {cause.meaning}") + wrap.wrap(f"remedy: {cause.remedy or '(none: see the evidence)'}")
        lines += [line for r in cause.when if names is None or not r.checks or names & set(r.checks) for line in wrap.wrap(
            "on " + "; ".join(part for part in (", ".join(r.backends), ", ".join(r.checks),
                                               ", ".join(k for k, _ in r.facts)) if part) + f": {r.shown}")]
    return "\n".join(lines) + "\n"


def run(ns: argparse.Namespace) -> int:
    """Print the listing ``ns`` asks for. Exit status 0, or 2 for an unknown check name."""
    from .registry import SPECS

    unknown = [n for n in ns.names if n not in SPECS]
    if unknown and all(part.strip() in SPECS for n in unknown for part in n.split(",") if part.strip()) and any("," in n for n in unknown):
        from ..errors import scrub_secrets

        # `packcheck checks isolation,logits_parity` (as --packcheck-checks takes them): say how this command takes them
        spaced = " ".join(part.strip() for n in ns.names for part in n.split(",") if part.strip())
        print(scrub_secrets(f"packcheck checks: error: {', '.join(map(repr, unknown))} is a comma-separated list: this "
                            f"command takes check names separated by spaces: packcheck checks {spaced}"), file=sys.stderr)
        return 2
    if unknown:
        from ..errors import closest, scrub_secrets

        # scrubbed: a token pasted as a check name is not echoed back
        print(scrub_secrets(f"packcheck checks: error: unknown check {', '.join(map(repr, unknown))}. Expected one of: "
                            f"{', '.join(SPECS)} (as the CHECK argument).{closest(unknown[0], list(SPECS))}"), file=sys.stderr)
        return 2
    specs = tuple(SPECS[n] for n in ns.names) or REGISTRY
    if ns.markdown:
        sys.stdout.write(markdown_table(specs))
    elif ns.causes:
        sys.stdout.write(causes_listing(tuple(SPECS[n] for n in ns.names) or None))
    else:
        sys.stdout.write(text_listing(specs, _shipped_tolerances()))
    return 0


def _shipped_tolerances() -> dict[str, Any]:
    from ..config.tolerances import load_tolerances

    return load_tolerances(None, None, "packcheck checks")[0]


def main(argv: list[str] | None = None) -> int:
    """``packcheck checks [CHECK ...] [--markdown | --causes]``."""
    parser = add_arguments(argparse.ArgumentParser(prog="packcheck checks", description=HELP, allow_abbrev=False))
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
