"""Re-render the committed measurements with this checkout's code, without measuring again.

    python tools/rerender.py            rewrite what is stale, say which files changed
    python tools/rerender.py --check    exit 1 and name the stale files (what tests/test_committed_reports.py runs)

The committed reports are outputs of packcheck's renderers over stored numbers: the default matrix
(``reports/packcheck-matrix.json`` -> its Markdown, CSV and details), the RL matrix the docs quote
(``reports/rl/``, the same files) and the atlas (``reports/atlas/support.json``
-> ``atlas.md`` and ``support.json`` itself, with its TRL block and bisect placements; ``atlas.html`` is not
committed: ``packcheck atlas --render-only`` writes it). A change
to a renderer, a legend or packcheck's version makes them stale; this command brings them up to date, and the test
says when that is due. Numbers never change here: a re-measure is ``packcheck audit`` / ``packcheck atlas``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPORTS = REPO / "reports"
#: the files of the default matrix that are committed (the HTML is left out: ~0.7 MB, made by every audit)
MATRIX_FILES = ("packcheck-matrix.md", "packcheck-matrix.csv", "packcheck-details.md", "packcheck-matrix.json")
#: the atlas files that are committed: atlas.html (~0.77 MB, a view of support.json with no number of its own) is
#: written by every ``packcheck atlas`` render, ``--render-only`` included, and not committed
ATLAS_FILES = ("atlas.md", "support.json")


#: the committed matrices, as folders under reports/ ("" the default audit's)
MATRIX_DIRS = ("", "rl")


def matrix_texts(reports: Path = REPORTS) -> dict[Path, str]:
    """The committed matrices' files as this checkout renders them from their JSON."""
    from pytest_packcheck.report.formats import FORMATS
    from pytest_packcheck.report.model import build_report

    out: dict[Path, str] = {}
    for sub in MATRIX_DIRS:
        folder = reports / sub if sub else reports
        if not (folder / "packcheck-matrix.json").exists():
            continue
        from pytest_packcheck.results.schema import load_document
        rep = build_report(load_document(folder / "packcheck-matrix.json"))
        out.update({folder / f.file: f.render(rep) for f in FORMATS if f.file in MATRIX_FILES})
    return out


def atlas_texts(reports: Path = REPORTS) -> dict[Path, str]:
    """The committed atlas pages as ``packcheck atlas --render-only`` writes them from ``support.json`` alone."""
    from pytest_packcheck.atlas.command import AtlasArgs, main

    atlas = reports / "atlas"
    committed = json.loads((atlas / "support.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "atlas"
        out.mkdir()
        (out / "support.json").write_text((atlas / "support.json").read_text(encoding="utf-8"), encoding="utf-8")
        for source in ("rl_peers.json", "stack.json"):  # the library axes' sources: support.json["axes"] is built from them
            if (atlas / source).exists():
                (out / source).write_text((atlas / source).read_text(encoding="utf-8"), encoding="utf-8")
        args = AtlasArgs(releases=[r["transformers"] for r in committed["releases"]], build=Path(tmp) / "build", out=out,
                         shard=None, workers=1, render_only=True, bisect=False, bisect_limit=None)
        if main(args, log=lambda _line: None) != 0:
            raise SystemExit("tools/rerender.py: packcheck atlas --render-only failed on reports/atlas/support.json")
        return {atlas / name: (out / name).read_text(encoding="utf-8") for name in ATLAS_FILES}


def stale(reports: Path = REPORTS) -> dict[Path, str]:
    """The committed files whose text differs from this checkout's render, with the text they should hold."""
    wanted = {**matrix_texts(reports), **atlas_texts(reports)}
    return {p: t for p, t in wanted.items() if not p.exists() or p.read_bytes().decode("utf-8") != t}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only name the stale files; exit 1 when there are any.")
    ns = parser.parse_args(argv)
    todo = stale()
    for path in todo:
        print(f"{'stale' if ns.check else 're-rendered'}: {path.relative_to(REPO)}")
    if ns.check:
        if todo:
            print("run: python tools/rerender.py", file=sys.stderr)
        return 1 if todo else 0
    from pytest_packcheck.results import write_set

    if todo:
        write_set(sorted(todo.items(), key=lambda kv: kv[0].name.endswith(".json")))
    print(f"{len(todo)} file(s) re-rendered" if todo else "the committed reports are up to date")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
