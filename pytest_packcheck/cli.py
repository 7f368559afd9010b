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

from .settings import OPT_ALL_ARCHS, OPT_AUDIT, OPT_MODELS, OPTIONS

_ALIASES = {OPT_MODELS: "--models", OPT_AUDIT: "--audit", OPT_ALL_ARCHS: "--all-architectures"}


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
    audit.add_argument("pytest_args", nargs="*", help="Extra pytest arguments after --, e.g. -- -k sdpa.")
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
        return 0
    if code == pytest.ExitCode.USAGE_ERROR:
        return 2
    return 3 if code != pytest.ExitCode.INTERRUPTED else 130


if __name__ == "__main__":
    sys.exit(main())
