"""``packcheck audit``: run the packcheck matrix through pytest and write the support matrix.

The CLI takes the same ``--packcheck-*`` flags as the pytest plugin (``--models`` etc. are short aliases) and
runs pytest in an empty temporary root, so no test file of the current project is collected.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .settings import OPT_ALL_ARCHS, OPT_AUDIT, OPT_MODELS, OPT_VERSIONS, OPTIONS

_ALIASES = {OPT_MODELS: "--models", OPT_AUDIT: "--audit", OPT_ALL_ARCHS: "--all-architectures", OPT_VERSIONS: "--versions"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packcheck", description="Checks that padding-free packing trains the same model.")
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="Run the matrix and write reports/packcheck-matrix.md and .json.",
                           description="Runs the embedded default audit (audit/default.toml) when no model is given.")
    for opt in OPTIONS:
        flags = [opt.flag] + ([_ALIASES[opt.flag]] if opt.flag in _ALIASES else [])
        kwargs = {"dest": opt.dest, "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
        audit.add_argument(*flags, **kwargs)
    audit.add_argument("-n", "--workers", default="2",
                       help="pytest-xdist workers (default 2; 0 runs in this process).")
    audit.add_argument("-q", "--quiet", action="store_true", help="Less pytest output.")
    audit.add_argument("--save-baseline", action="store_true",
                       help="Also copy the results JSON to <report dir>/baseline.json for `packcheck gate`.")
    audit.add_argument("pytest_args", nargs="*", help="Extra pytest arguments after --, e.g. -- -k sdpa.")
    gate = sub.add_parser("gate", help="Compare a candidate results JSON with a baseline; exit 1 if a cell got worse.")
    gate.add_argument("--baseline", required=True, help="Baseline results JSON (e.g. reports/baseline.json).")
    gate.add_argument("--candidate", required=True, help="Candidate results JSON (e.g. from the upgraded stack).")
    gate.add_argument("--allow", action="append", default=[], metavar="CELL=REASON",
                      help="Accept a regression of a cell id or id prefix (e.g. 'opt-sdpa=known OPT leak'); repeatable.")
    merge = sub.add_parser("merge", help="Join results JSON files (shards of one audit) and render the matrix.")
    merge.add_argument("files", nargs="+", help="Results JSON files.")
    merge.add_argument("-o", "--output-dir", default="reports", help="Where packcheck-matrix.md / .json go (default reports).")
    return parser


def _pytest_args(ns: argparse.Namespace) -> list[str]:
    args: list[str] = []
    given = {opt.dest: getattr(ns, opt.dest) for opt in OPTIONS}
    if given["packcheck_models"] is None and not given["packcheck_audit"] and not given["packcheck_all_architectures"]:
        given["packcheck_audit"] = "default"
    if given["packcheck_audit"] and not os.path.isabs(given["packcheck_audit"]) and given["packcheck_audit"].endswith(".toml"):
        given["packcheck_audit"] = str(Path(given["packcheck_audit"]).resolve())
    given["packcheck_report_dir"] = str(Path(given["packcheck_report_dir"] or "reports").resolve())
    for opt in OPTIONS:
        value = given[opt.dest]
        if value is None or value is False or value == []:
            continue
        if opt.action == "store_true":
            args.append(opt.flag)
        elif opt.multiple:
            args += [f"{opt.flag}={v}" for v in value]
        else:
            args.append(f"{opt.flag}={value}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point. Exit codes: 0 matrix written (whatever the verdicts), 2 usage error, 3 internal error."""
    import pytest

    argv = sys.argv[1:] if argv is None else argv
    ns = _parser().parse_args(argv)
    import shlex

    from .errors import PackcheckUsageError

    if ns.command in ("gate", "merge"):
        try:
            return _gate(ns) if ns.command == "gate" else _merge(ns)
        except PackcheckUsageError as exc:
            print(f"packcheck {ns.command}: error: {exc}", file=sys.stderr)
            return 2

    os.environ["PACKCHECK_REPRODUCE"] = "packcheck " + shlex.join(argv)
    args = _pytest_args(ns)
    workers = str(ns.workers)
    if workers not in ("0", "1"):
        try:
            import xdist  # noqa: F401

            args += ["-n", workers, "--dist", "loadgroup"]
        except ImportError:
            print("packcheck: pytest-xdist not installed; running in one process", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="packcheck-") as root:
        full = [root, "--rootdir", root, "-p", "no:cacheprovider", "-o", "addopts=", "-o", "testpaths=",
                "-W", "ignore::pytest.PytestAssertRewriteWarning",
                "-c", os.devnull, *(["-q"] if ns.quiet else []), "-rN", *args, *ns.pytest_args]
        code = pytest.main(full)
    if code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        if ns.save_baseline:
            import shutil

            out = Path(ns.packcheck_report_dir or "reports")
            shutil.copyfile(out / "packcheck-matrix.json", out / "baseline.json")
            print(f"baseline written: {out / 'baseline.json'}")
        return 0
    if code == pytest.ExitCode.USAGE_ERROR:
        return 2
    return 3 if code != pytest.ExitCode.INTERRUPTED else 130


def _gate(ns: argparse.Namespace) -> int:
    from .gate import compare, regressions, render_changes
    from .results import load_document

    allow = {}
    for item in ns.allow:
        cell, sep, reason = item.partition("=")
        if not sep or not cell or not reason:
            from .errors import PackcheckUsageError

            raise PackcheckUsageError(f"--allow '{item}' needs CELL=REASON, e.g. --allow 'opt-sdpa=known OPT leak'.")
        allow[cell] = reason
    baseline, candidate = load_document(ns.baseline), load_document(ns.candidate)
    changes = compare(baseline, candidate, allow)
    print(render_changes(changes, baseline["environment"], candidate["environment"]))
    bad = regressions(changes)
    print(f"\npackcheck gate: {len(bad)} regression(s), {len(changes)} changed cell(s)")
    return 1 if bad else 0


def _merge(ns: argparse.Namespace) -> int:
    import json

    from .diagnose import diagnose_document
    from .gate import merge
    from .report import render_markdown
    from .results import atomic_write, load_document

    doc = diagnose_document(merge([load_document(f) for f in ns.files]))
    out = Path(ns.output_dir)
    atomic_write(out / "packcheck-matrix.json", json.dumps(doc, indent=1) + "\n")
    atomic_write(out / "packcheck-matrix.md", render_markdown(doc))
    print(f"merged {len(ns.files)} files, {len(doc['cells'])} cells into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
