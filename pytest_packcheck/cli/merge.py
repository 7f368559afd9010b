"""``packcheck merge``: join results JSON files (shards of one audit) and render the matrix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(merge: argparse.ArgumentParser) -> None:
    merge.add_argument("files", nargs="+", help="Results JSON files.")
    merge.add_argument("-o", "--output-dir", default="reports", help="Where packcheck-matrix.md / .json go (default reports).")


def run(ns: argparse.Namespace) -> int:
    """``packcheck merge``: exit 0 with the matrix written.

    Raises:
        PackcheckUsageError: a results file that cannot be read; files that hold no cells; an output folder that cannot be made or is held
            by a running audit.
    """
    from ..analysis.diagnose import diagnose_document
    from ..analysis.gate import merge
    from ..errors import PackcheckUsageError
    from ..report.formats import LOGS_DIR, remove_unreferenced_logs, write_reports
    from ..results import load_document, write_failure
    from ..run.process import hold_report_dir

    files = _distinct_files(ns.files)
    documents = [load_document(f, "packcheck merge's FILES") for f in files]
    if not any(d["cells"] for d in documents):  # a matrix with no cells would claim a run that checked nothing
        raise PackcheckUsageError(f"no cells to merge: {', '.join(ns.files)} (packcheck merge's FILES) hold no cells; pass "
                                  "the packcheck-matrix.json of audits that checked something.")
    doc = diagnose_document(merge(documents, files))
    out = Path(ns.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackcheckUsageError(write_failure(out / "packcheck-matrix.json", exc, "-o/--output-dir")) from None
    lock = hold_report_dir(out, "-o/--output-dir")  # an audit writing there now would have its matrix replaced
    try:
        write_reports(out, doc, "-o/--output-dir")
        journal = out / "packcheck-journal.jsonl"  # an audit's journal beside the merged matrix: --resume would take it for this one's
        if journal.is_file():
            journal.unlink()
            print(f"packcheck merge: note: removed {journal}, the journal of the audit that wrote there before: it does not "
                  "belong to the merged matrix.", file=sys.stderr)
        gone = remove_unreferenced_logs(out, doc)
        if gone:
            print(f"packcheck merge: note: removed {len(gone)} log(s) of an earlier run from {out / LOGS_DIR} "
                  f"({', '.join(Path(g).name for g in gone)}): the merged matrix does not name them.", file=sys.stderr)
    finally:
        lock.release(force=True)
    if doc.get("merged_settings_differ"):
        # what the matrix holds, counted: a cell id held by several files is one cell (index_cells), never "a union"
        held = sum(len(d["cells"]) for d in documents)
        twice = (f"; {held - len(doc['cells'])} record(s) of a cell id already held left out (one cell per id)"
                 if held > len(doc["cells"]) else "")
        print(f"packcheck merge: warning: these files are not shards of one audit (their settings differ in "
              f"{', '.join(doc['merged_settings_differ'])}); the matrix holds the {len(doc['cells'])} distinct cells "
              f"of the {len(files)} files{twice}, and every command", file=sys.stderr)
    if doc.get("incomplete"):
        print(f"packcheck merge: warning: the merged matrix is incomplete: {doc['incomplete']['reason']}; it says so "
              "in its header", file=sys.stderr)
    print(f"merged {len(files)} file{'s' if len(files) != 1 else ''}, {len(doc['cells'])} cells into {out}")
    return 0


def _distinct_files(files: list[str]) -> list[str]:
    """``files`` with a file named again (the same path, or another path to it) kept once, as the duplicate-cell rule
    keeps a cell held twice with one verdict once, each repeat noted on stderr: ``merge a.json a.json`` merged "2
    files" and a forgotten second shard went unnoticed."""
    import os

    from ..errors import scrub_secrets as scrub

    kept: list[str] = []
    for f in files:
        same = next((k for k in kept if k == f or (os.path.exists(k) and os.path.exists(f) and os.path.samefile(k, f))), None)
        if same is None:
            kept.append(f)
        else:
            print(f"packcheck merge: note: {scrub(f)} is the same file as {scrub(same)}, given twice: merged once; "
                  "if you meant another shard, pass its packcheck-matrix.json", file=sys.stderr)
    return kept
