"""``packcheck bisect``: name the release that broke (or fixed) one cell, from the package index."""

from __future__ import annotations

import argparse


def configure(bisect: argparse.ArgumentParser) -> None:
    from ..checks.causes import CAUSES

    bisect.description = ("Bisects the releases between --good and --bad, one version environment per "
                          "probe, endpoints first; releases that cannot install or crash are skipped.")
    bisect.add_argument("cell", metavar="CELL", help="Cell id: model-backend-check-dtype, e.g. llama-sdpa-trainer-float32 "
                                                     "(model-level checks: llama-collate-float32).")
    bisect.add_argument("--good", required=True, metavar="SPEC",
                        help="Where the cell holds: transformers==5.10.1, or 'transformers==5.10.1 & trl==0.24.0'.")
    bisect.add_argument("--bad", required=True, metavar="SPEC",
                        help="Where it does not: the same libraries, exactly one at another version. Either side may be "
                             "the older one (first bad / first fixed).")
    bisect.add_argument("--model", default=None, metavar="SPEC", help="Model spec to build (default arch:<the cell's model label>).")
    bisect.add_argument("--pre", action="store_true", help="Include pre-releases (default: final releases only).")
    bisect.add_argument("--cause", default=None, metavar="CAUSE",
                        help="Judge by a cause instead of the verdict: the cell holds when its diagnosis does not name "
                             "this cause. One of: " + ", ".join(CAUSES) + ".")
    bisect.add_argument("--supported", action="store_true",
                        help="Judge whether the cell is supported at all (unsupported is bad): a version floor.")
    bisect.add_argument("-o", "--output-dir", default="reports/bisect", help="Where the JSON goes (default reports/bisect).")


def run(ns: argparse.Namespace) -> int:
    """``packcheck bisect``: exit 0 with an answer, 1 when the endpoints do not hold or skips hide the boundary."""
    from ..analysis.bisect import bisect_cell, render_text

    record = bisect_cell(ns.cell, ns.good, ns.bad, model=ns.model, pre=ns.pre, cause=ns.cause, supported=ns.supported,
                         output_dir=ns.output_dir)
    print(render_text(record))
    print(f"bisect written: {record['path']}")
    return 0 if record["outcome"] == "found" else 1
