"""README's figures come from the committed reports (issue 41: the README quoted matrices of another transformers):
each figure it quotes is read back from the file that holds it, so regenerating a report without the README (or
the README without the report) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_packcheck.results.schema import read_results

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def _counts(text: str) -> dict[str, str]:
    """verdict word -> count (and the failing models) of a "Matrix cells ..." headline."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(pass|not checked|unsupported|fail) (\d+)", text)}


def test_the_readmes_default_matrix_headline_is_the_committed_matrixs():
    quoted = re.search(r'\("Matrix cells:\s(.*?)"\)', README, re.DOTALL)
    assert quoted, "README no longer quotes the default matrix's headline"
    matrix = (REPO / "reports" / "packcheck-matrix.md").read_text(encoding="utf-8")
    line = next(ln for ln in matrix.splitlines() if ln.startswith("Matrix cells"))
    said, held = _counts(" ".join(quoted.group(1).split())), _counts(line.split(" (of ")[0])
    assert said == held, (said, held)
    failing = re.search(r"❌ fail \d+ \((\d+ models: [^)]*)\)", line)
    assert failing and failing.group(1) in " ".join(quoted.group(1).split())


def test_the_committed_matrix_was_made_on_the_pinned_transformers():
    """The committed default matrix is the pinned release's (constraints/test.txt): a fresh install at the pins
    reproduces it."""
    pins = dict(line.split("==", 1) for line in (REPO / "constraints" / "test.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    doc = read_results(REPO / "reports" / "packcheck-matrix.json")
    assert doc["environment"]["transformers"] == pins["transformers"]
    assert doc["environment"]["torch"].split("+")[0] == pins["torch"]
