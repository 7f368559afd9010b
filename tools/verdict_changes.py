"""Headline verdicts that changed between two packcheck results files, one line per matrix cell.

    python tools/verdict_changes.py OLD.json NEW.json [--backend sdpa] [--markdown]

A matrix cell is one model x backend x dtype (x version environment); its verdict is what the Markdown matrix
shows (``report.headline``: the worst correctness check, with its diagnosed causes). Old files of results
schema 1 are upgraded on load. Prints the counts the all-architectures audit is judged by (models with a
verdict per backend: pass or fail; cells that stopped in packcheck's own shrink) and every changed cell, with
the new cell's first failing check and its key number, so each new failure names the probe that found it.

Exit status: 0, or 2 for an unreadable file.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

from tabulate import tabulate

from pytest_packcheck.errors import PackcheckUsageError
from pytest_packcheck.report import headline, key_number
from pytest_packcheck.results.schema import load_document


def matrix(doc: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """(model label, backend, dtype, env) -> headline, for every model-and-backend cell of ``doc``."""
    groups: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for cell in doc["cells"]:
        if cell.get("backend"):
            groups[(cell["model"]["label"], cell["backend"], cell["dtype"], cell.get("env"))].append(cell)
    return {key: headline(group) for key, group in groups.items()}


def verdict(h: dict[str, Any] | None) -> str:
    if h is None:
        return "(absent)"
    return h["status"] + (f" ({', '.join(h['causes'])})" if h["causes"] and h["status"] != "pass" else "")


def evidence(h: dict[str, Any] | None) -> str:
    """The first failing correctness check of a headline and its key number ("" when it passed)."""
    if not h or not h["bad"]:
        return ""
    first = h["bad"][0]
    number = key_number(first)
    return f"{first['check']}: {number}" if number else f"{first['check']}: {first['message'][:90]}"


def counts(heads: dict[tuple, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per backend: models with a verdict (pass or fail), models with none (error or oom: an explicit refusal,
    unsupported, is an answer), and cells stopped in packcheck's shrink."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"verdict": 0, "none": 0, "shrink_limit": 0, "cells": 0})
    for (_, backend, _, _), h in heads.items():
        row = out[backend]
        row["cells"] += 1
        row["verdict"] += h["status"] in ("pass", "fail")
        row["none"] += h["status"] in ("error", "oom")
        row["shrink_limit"] += "shrink_limit" in h["causes"] or any(
            "packcheck's shrunk" in c.get("message", "") for c in h["bad"])  # schema-1 files name it in the message
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--backend", action="append", help="Only this backend (repeatable; default all).")
    parser.add_argument("--markdown", action="store_true", help="Print GitHub Markdown tables.")
    ns = parser.parse_args(argv)
    try:
        old, new = matrix(load_document(ns.old)), matrix(load_document(ns.new))
    except PackcheckUsageError as exc:
        print(f"verdict_changes: {exc}", file=sys.stderr)
        return 2
    fmt = "github" if ns.markdown else "simple"
    keep = (lambda key: key[1] in ns.backend) if ns.backend else (lambda key: True)
    before, after = counts({k: v for k, v in old.items() if keep(k)}), counts({k: v for k, v in new.items() if keep(k)})
    fields = ("cells", "verdict", "none", "shrink_limit")
    rows = [(b, *(f"{before.get(b, {}).get(f, 0)} -> {after.get(b, {}).get(f, 0)}" for f in fields))
            for b in sorted(set(before) | set(after))]
    print(tabulate(rows, headers=["backend", "models", "pass or fail", "no verdict (error)", "stopped in the shrink"],
                   tablefmt=fmt))
    changed = []
    for key in sorted(set(old) | set(new), key=lambda k: tuple(str(x) for x in k)):
        if not keep(key):
            continue
        a, b = verdict(old.get(key)), verdict(new.get(key))
        if a != b:
            model, backend, _, env = key
            changed.append((model, backend + (f" @{env}" if env else ""), a, b, evidence(new.get(key))))
    print()
    print(f"{len(changed)} matrix cells changed verdict")
    if changed:
        print(tabulate(changed, headers=["model", "backend", "old", "new", "new evidence"], tablefmt=fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
