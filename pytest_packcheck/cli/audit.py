"""``packcheck audit``: run the packcheck matrix through pytest and write the support matrix.

The command takes the same ``--packcheck-*`` flags as the pytest plugin (``--models`` etc. are short aliases)
and runs pytest in an empty temporary root, so no test file of the current project is collected. After the
audit: ``--bench`` figures, ``--verify-remedies``, ``--save-baseline`` or ``--gate`` (two version environments,
:mod:`pytest_packcheck.cli.gate`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from ..config.options import (
    OPT_ALL_ARCHS,
    OPT_AUDIT,
    OPT_BASELINE,
    OPT_CHECKS,
    OPT_MODELS,
    OPT_REPORT_DIR,
    OPT_RESUME,
    OPT_TIMEOUT,
    OPT_VERSIONS,
    OPTIONS,
    default_of,
)
from .gate import SUMMARY_HELP

OPTIONS_BY_FLAG = {opt.flag: opt for opt in OPTIONS}

_ALIASES = {OPT_MODELS: "--models", OPT_AUDIT: "--audit", OPT_ALL_ARCHS: "--all-architectures", OPT_VERSIONS: "--versions",
            OPT_RESUME: "--resume", OPT_TIMEOUT: "--timeout"}


def configure(audit: argparse.ArgumentParser) -> None:
    """The audit's arguments: every option of the plugin (:data:`~pytest_packcheck.config.options.OPTIONS`) and the
    audit's own."""
    from . import help_epilog

    audit.description = ("Runs the embedded default audit (audit/default.toml) when no model is given. "
                         "The default audit runs no Trainer / SFTTrainer: --audit training does.")
    audit.epilog = help_epilog()
    audit.formatter_class = argparse.RawDescriptionHelpFormatter
    for opt in OPTIONS:
        flags = [opt.flag] + ([_ALIASES[opt.flag]] if opt.flag in _ALIASES else [])
        kwargs = {"dest": opt.dest, "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
        audit.add_argument(*flags, **kwargs)
    audit.add_argument("-n", "--workers", default="2",
                       help="Models run at once (default 2): on a CPU device their cell children side by side, "
                            "forked from this one process; pytest-xdist workers on CUDA, with --packcheck-isolation "
                            "none or with version environments. 0: one model at a time, in this process.")
    audit.add_argument("-q", "--quiet", action="store_true", help="Less pytest output.")
    audit.add_argument("--save-baseline", action="store_true",
                       help="Also copy the results JSON to <report dir>/baseline.json for `packcheck gate`.")
    audit.add_argument("--bench", action="append", default=[], metavar="PROFILE",
                       help="After the audit, bench each model packed vs padded on this length profile (flan, orcamath, "
                            "uniform, fixed, or a file of lengths; repeatable): a 'speedup / memory' column in the matrix.")
    audit.add_argument("--bench-steps", type=int, default=10, help="Measured steps per mode for --bench (default 10).")
    audit.add_argument("--bench-batch-size", type=int, default=16, help="Examples per step for --bench (default 16).")
    audit.add_argument("--bench-max-length", type=int, default=2048, help="Longest example for --bench (default 2048).")
    audit.add_argument("--verify-remedies", action="store_true",
                       help="After the audit, run each failing cell again at the release its upgrade remedy names (one "
                            "version environment per release) and judge setting remedies from the cell's own numbers: "
                            "a 'Remedies verified' section in the matrix.")
    audit.add_argument("--gate", action="store_true",
                       help="With --versions naming two environments (e.g. 'transformers==5.24.0,5.25.0'): after the "
                            "audit, gate the second against the first cell by cell; exit 1 on a regression.")
    audit.add_argument("--allow", action="append", default=[], metavar="CELL=REASON",
                       help="For --gate: accept a regression of a cell id or id prefix; repeatable.")
    audit.add_argument("--fail-on-failure", action="store_true",
                       help="Exit 1 when a correctness check did not pass (a fail, a fallback, or an error: nothing "
                            "judged), after the matrix is written: for CI. Without it the audit exits 0 once the matrix is "
                            "written, whatever the verdicts.")
    audit.add_argument("--summary", metavar="FILE", default=None, help=SUMMARY_HELP)
    audit.add_argument("pytest_args", nargs="*", help="Extra pytest arguments after --, e.g. -- -k sdpa.")


def _closing_line(out: Path, started: float, fail_on_failure: bool) -> int:
    """Print the audit's last line: the failing correctness checks (pytest's "failed" items), the matrix cells and
    the models they fall on, in one sentence with why the exit status is what it is (issue 41: "41 failed" above
    an exit 0 read as a contradiction). Returns the number of correctness checks that did not pass, which
    ``--fail-on-failure`` exits 1 on (0 when the matrix cannot be read: the plugin has said why)."""

    from ..errors import PackcheckUsageError, scrub_secrets
    from ..report.verdicts import closing_sentence
    from ..results.schema import read_results

    matrix = out / "packcheck-matrix.json"
    try:
        if matrix.stat().st_mtime < started - 1:  # not this run's matrix: nothing to sum up
            return 0
        cells = read_results(matrix)["cells"]
        text, not_passed = closing_sentence(cells, fail_on_failure)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, PackcheckUsageError):  # a dangling table key
        return 0
    print(scrub_secrets(text))
    return not_passed


class _BaselineGate:
    """A pytest plugin object handed to ``pytest.main``: after the session, the number of regressions the
    plugin's baseline gate found (``--packcheck-baseline``), which pytest's own exit code (1 for any failing cell,
    which the audit reads as "matrix written") does not tell apart."""

    def __init__(self) -> None:
        self.regressions = 0
        self.baseline: str | None = None
        #: why the baseline comparison was refused (nothing compared): said again as the audit's last line
        self.refused: str | None = None
        self.source = OPT_BASELINE

    def pytest_unconfigure(self, config: object) -> None:
        from ..plugin import _state

        state = _state(config)
        if state is not None and state.settings.baseline:
            self.regressions, self.baseline = len(state.regressions), state.settings.baseline
            self.refused, self.source = state.gate_refused, state.settings.baseline_source


def gate_checks() -> tuple[str, ...]:
    """The checks ``audit --gate`` runs when none are named: the default checks plus the Trainer's (packed and its
    own padded run) and, where TRL is installed here, the SFTTrainer's (packed and padded). Issue 27: a gate without
    a training check said "No cell changed" while the Trainer went from fail (4.57.x keeps use_cache) to pass."""
    from ..checks.registry import gate_checks as planned

    return planned()


def _pytest_args(ns: argparse.Namespace) -> list[str]:
    args: list[str] = []
    given = {opt.dest: getattr(ns, opt.dest) for opt in OPTIONS}
    checks_opt = OPTIONS_BY_FLAG[OPT_CHECKS]
    if (getattr(ns, "gate", False) and given[checks_opt.dest] is None and not os.environ.get(checks_opt.env or "")
            and not given["packcheck_audit"] and not os.environ.get(OPTIONS_BY_FLAG[OPT_AUDIT].env or "")):
        given[checks_opt.dest] = ",".join(gate_checks())
    from_env = any(os.environ.get(OPTIONS_BY_FLAG[flag].env or "") for flag in (OPT_MODELS, OPT_AUDIT))
    if given["packcheck_models"] is None and not given["packcheck_audit"] and not given["packcheck_all_architectures"] and not from_env:
        given["packcheck_audit"] = "default"  # $PACKCHECK_MODELS / $PACKCHECK_AUDIT replace the default audit (CLI > env)
    if given["packcheck_audit"] and not os.path.isabs(given["packcheck_audit"]) and given["packcheck_audit"].endswith(".toml"):
        given["packcheck_audit"] = os.path.abspath(given["packcheck_audit"])  # abspath: a symlink loop is the plugin's to name
    report_env = OPTIONS_BY_FLAG[OPT_REPORT_DIR].env or ""
    if given["packcheck_report_dir"] is None and os.environ.get(report_env, "").strip():
        # $PACKCHECK_REPORT_DIR, as pytest honours it (issue 42: the audit wrote to ./reports regardless): the plugin
        # reads the variable itself, so its errors name the variable, not a flag the user never gave
        ns.packcheck_report_dir = os.path.abspath(os.environ[report_env])
    else:
        if given["packcheck_report_dir"] is None or given["packcheck_report_dir"].strip():  # '' goes on, to be refused
            given["packcheck_report_dir"] = os.path.abspath(given["packcheck_report_dir"] or default_of(OPT_REPORT_DIR))
        ns.packcheck_report_dir = given["packcheck_report_dir"]  # the closing line, bench and the gate read this folder
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


def run(ns: argparse.Namespace) -> int:
    """``packcheck audit``. Exit codes: 0 matrix written (whatever the verdicts), 1 a gate regression (``--gate``, or a
    cell worse than ``--packcheck-baseline``'s), 2 usage error, 3 internal error, 130 interrupted."""
    import pytest

    from ..errors import PackcheckUsageError
    from .gate import gate_environments, gate_versions, parse_allow

    os.environ["PACKCHECK_REPRODUCE"] = _reproduce_line(ns.argv)
    workers = str(ns.workers)
    if not (workers.isdigit() or workers in ("auto", "logical")):
        print(f"packcheck audit: error: -n/--workers '{workers}' must be a number of workers (0: this process) or auto.",
              file=sys.stderr)
        return 2
    for flag, value, default in (("--bench-steps", ns.bench_steps, 10), ("--bench-batch-size", ns.bench_batch_size, 16),
                                 ("--bench-max-length", ns.bench_max_length, 2048)):
        if value != default and not ns.bench:
            print(f"packcheck audit: warning: {flag} has no effect without --bench", file=sys.stderr)
    if ns.bench:
        from ..run.throughput import sample_lengths

        ns.bench = list(dict.fromkeys(ns.bench))
        for profile in ns.bench:  # the same checks `packcheck bench` makes, before the audit spends its time
            try:
                sample_lengths(profile, 1, 2048, source="--bench")
            except PackcheckUsageError as exc:
                print(f"packcheck audit: error: {exc}", file=sys.stderr)
                return 2
        if ns.bench_steps < 1:
            print(f"packcheck audit: error: --bench-steps {ns.bench_steps} must be >= 1.", file=sys.stderr)
            return 2
        if ns.bench_steps > 10_000:  # packcheck bench's bound: a run without end (hostile trial 5: 10**9 steps)
            print(f"packcheck audit: error: --bench-steps {ns.bench_steps} is over 10,000: a bench's figures settle within "
                  "tens of steps; give e.g. --bench-steps 20.", file=sys.stderr)
            return 2
        versions_from = _versions_source(ns)
        if versions_from:
            print(f"packcheck audit: error: --bench measures in this environment only, and {versions_from} asks for "
                  "version environments: run it without versions (or run `packcheck bench` inside the version's "
                  "environment).", file=sys.stderr)
            return 2
        for flag, value, least in (("--bench-batch-size", ns.bench_batch_size, 1), ("--bench-max-length", ns.bench_max_length, 2)):
            if value < least:
                print(f"packcheck audit: error: {flag} {value} must be >= {least}.", file=sys.stderr)
                return 2
    try:
        _refuse_own_flags_after_dashes(ns.pytest_args)
        allow = parse_allow(ns.allow)
        if ns.allow and not ns.gate:
            raise PackcheckUsageError("--allow works with --gate (or `packcheck gate`): add --gate.")
        if ns.summary and not ns.gate:
            raise PackcheckUsageError(f"--summary '{ns.summary}' writes the gate's job summary: add --gate (or run `packcheck gate`).")
        if ns.gate:
            gate_environments(ns)
        if ns.summary:
            from ..analysis.gate import probe_summary

            probe_summary(ns.summary)  # before the audit runs, not after its table
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    args = _pytest_args(ns)
    plugins: list[object] = [gate := _BaselineGate()]
    if workers not in ("0", "1"):
        if _side_by_side(ns):
            from ..run.session import ChildrenSideBySide

            plugins.append(ChildrenSideBySide(int(workers) if workers.isdigit() else (os.cpu_count() or 1)))
        else:
            try:
                import xdist  # noqa: F401

                args += ["-n", workers, "--dist", "loadscope"]
            except ImportError:
                print("packcheck: pytest-xdist not installed; running in one process", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="packcheck-") as root:
        # the plugin by module, the entry point blocked: the same with packcheck installed or only on PYTHONPATH
        # (tools/gpu_check.sh on the GPU machine)
        full = [root, "--rootdir", root, "-p", "no:cacheprovider", "-p", "no:packcheck", "-p", "pytest_packcheck.plugin",
                "-o", "addopts=", "-o", "testpaths=",
                "-W", "ignore::pytest.PytestAssertRewriteWarning",
                # no test file is collected: pytest's assertion rewriting (every packcheck module imported, here and
                # in each cell child, went through its import hook and AST rewrite) and its logging capture (a
                # handler added to and removed from every logger three times per cell) serve no verdict (issue 47)
                "--assert=plain", "-p", "no:logging",
                # --tb=no: the packcheck summary and the matrix name every failing cell with its number; pytest's
                # FAILURES section repeated them, at a cost quadratic in the reports (about a minute for the 2160
                # failing cells of the all-architectures audit). `-- --tb=short` brings it back.
                "-c", os.devnull, *(["-q"] if ns.quiet else []), "-rN", "--tb=no", *args, *ns.pytest_args]
        started = time.time()
        try:
            code = pytest.main(full, plugins=plugins)
        except KeyboardInterrupt:  # before pytest's session could catch it (plugins loading, the config parsed)
            code = pytest.ExitCode.INTERRUPTED
    if code in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.NO_TESTS_COLLECTED):
        from ..run.process import already_stopping

        with already_stopping():  # a second Ctrl-C must not leave the previous matrix half removed (trial 9, 211)
            _discard_previous_matrix(Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR)), started,
                                     "interrupted before it wrote a matrix" if code == pytest.ExitCode.INTERRUPTED else "checked nothing")
    if code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        not_passed = _closing_line(Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR)), started, ns.fail_on_failure)
        if gate.regressions:
            # --packcheck-baseline: the gate's table and count are printed; a regression fails the audit as it
            # fails `packcheck gate` and plain pytest (the same rule, analysis.gate.compare)
            print(f"packcheck audit: {gate.regressions} regression(s) against the baseline {gate.baseline} (from "
                  f"{OPT_BASELINE}): exit 1.", file=sys.stderr)
            return 1
        if ns.gate:
            return gate_versions(Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR)), allow, ns.summary)
        if ns.bench:
            _bench_into_report(ns, Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR)))
        if ns.verify_remedies:
            _verify_remedies_into_report(Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR)))
        if ns.save_baseline:
            from ..results import atomic_write

            out = Path(ns.packcheck_report_dir or default_of(OPT_REPORT_DIR))
            try:  # atomic and named: a full disk is one line, and never half a baseline
                atomic_write(out / "baseline.json", (out / "packcheck-matrix.json").read_text(encoding="utf-8"))
            except (PackcheckUsageError, OSError) as exc:
                print(f"packcheck audit: error: --save-baseline: {exc}", file=sys.stderr)
                return 2
            from ..errors import scrub_secrets

            print(scrub_secrets(f"baseline written: {out / 'baseline.json'}"))
        return 1 if ns.fail_on_failure and not_passed else 0
    if code == pytest.ExitCode.USAGE_ERROR:
        if gate.refused:  # its line came before the summary; the last line says why the exit is 2 (hostile trial 5)
            from ..errors import scrub_secrets

            print(scrub_secrets(f"packcheck audit: error: the matrix is written, but the comparison with the baseline "
                                f"{gate.baseline} (from {gate.source}) was refused: {gate.refused}"), file=sys.stderr)
        return 2
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:  # every cell deselected (`-- -k nothing`): nothing was checked
        print(f"packcheck audit: error: the pytest arguments {' '.join(ns.pytest_args) or '(none)'} deselected every cell of "
              "the matrix: nothing was checked and no matrix written; select cells with -k on ids such as "
              "llama-sdpa-isolation-float32.", file=sys.stderr)
        return 2
    return 3 if code != pytest.ExitCode.INTERRUPTED else 130


def _refuse_own_flags_after_dashes(pytest_args: list[str]) -> None:
    """Refuse an audit option given after ``--`` (``-- --packcheck-report-dir out``): pytest took it past the audit,
    so the audit's closing line, ``--save-baseline``, ``--bench`` and ``--gate`` read the folder and models the audit
    was given (or its defaults) while pytest wrote another (hostile trial 5: ``--save-baseline`` copied the previous
    run's reports/packcheck-matrix.json as the new baseline, and ``-- --packcheck-models arch:gpt2`` dropped
    ``--models arch:llama`` without a word).

    Raises:
        PackcheckUsageError: naming the option and where it belongs.
    """
    from ..errors import PackcheckUsageError, closest

    taken = {opt.flag for opt in OPTIONS} | set(_ALIASES.values())
    for arg in pytest_args:
        name = arg.split("=", 1)[0]
        if name not in taken and name.startswith("--packcheck-"):
            raise PackcheckUsageError(f"{name} (after `--`) is not an option of packcheck audit: see packcheck audit "
                                      f"--help.{closest(name, sorted(taken))}")
        if name in taken:
            raise PackcheckUsageError(
                f"{name} is given after `--`, where the arguments go to pytest past packcheck audit: put it before "
                f"`--` (packcheck audit {name}=...); after `--` only pytest's own arguments, e.g. -- -k sdpa.")


def _side_by_side(ns: argparse.Namespace) -> bool:
    """Whether ``-n N`` runs N models' cell children side by side in this one process
    (:class:`~pytest_packcheck.run.session.ChildrenSideBySide`) rather than N pytest-xdist workers: yes on a CPU device
    with fork isolation (the defaults) and no version environments. Each xdist worker imports torch and
    transformers, resolves every model and warms up again (issue 47: the default audit, eager and sdpa, took 28.3 s of
    CPU with two workers, 15 s in one process); a CUDA device (a worker per GPU), ``--packcheck-isolation none``
    (the cells run in the worker), version environments (a child environment per group) and pretrained weights
    (children of one thread each: see :class:`~pytest_packcheck.run.sandbox.SideBySide`) keep the workers.
    An ini file is not read here: the audit runs pytest with ``-c /dev/null``."""
    from ..config.options import OPT_DEVICE, OPT_ISOLATION, OPT_WEIGHTS

    def given(flag: str) -> str:
        opt = OPTIONS_BY_FLAG[flag]
        value = getattr(ns, opt.dest, None) or os.environ.get(opt.env or "") or opt.default
        return str(value).strip().lower()

    # pretrained weights keep the workers: their children want more than one thread, and a child forked after this
    # process's OpenMP team exists hangs in its first parallel region of more than one (sandbox.SideBySide)
    return (given(OPT_DEVICE).startswith("cpu") and given(OPT_ISOLATION) != "none" and _versions_source(ns) is None
            and given(OPT_WEIGHTS) != "pretrained")


def _discard_previous_matrix(out: Path, started: float, why: str) -> None:
    """The run ended (exit 130 or 2) without writing its matrix: remove the report files in ``out`` older than
    ``started`` (seconds since the epoch), so the previous run's matrix is not taken for this one's, and say so.
    A kill that lands before the plugin's session holds the folder (collection) reaches only this."""
    from ..report.formats import REPORT_FILES

    removed = []
    for name in REPORT_FILES:
        try:
            if (out / name).stat().st_mtime < started:
                (out / name).unlink()
                removed.append(name)
        except OSError:
            continue
    if removed:
        print(f"packcheck audit: the run {why}: the previous {' and '.join(removed)} in {out} were removed so they are "
              "not taken for this run's.", file=sys.stderr)


def _reproduce_line(argv: list[str]) -> str:
    """The report's Reproduce line: the settings' environment variables that are set, then the command."""
    import shlex

    envs = [f"{opt.env}={shlex.quote(os.environ[opt.env])}" for opt in OPTIONS if opt.env and os.environ.get(opt.env)]
    return " ".join([*envs, "packcheck " + shlex.join(argv)])


def _versions_source(ns: argparse.Namespace) -> str | None:
    """Where version environments were asked for (--packcheck-versions, its environment variable, or the audit
    definition's ``versions``), or None."""
    from ..config.audits import load_audit

    if getattr(ns, OPTIONS_BY_FLAG[OPT_VERSIONS].dest):
        return "--packcheck-versions"
    if os.environ.get(OPTIONS_BY_FLAG[OPT_VERSIONS].env or ""):
        return f"${OPTIONS_BY_FLAG[OPT_VERSIONS].env}"
    audit = ns.packcheck_audit or (None if ns.packcheck_models or ns.packcheck_all_architectures else "default")
    if audit:
        try:
            if load_audit(audit).versions:
                return f"the audit definition '{audit}'"
        except Exception:  # noqa: BLE001 - a bad audit file is reported by the audit itself, with its own message
            return None
    return None


def _bench_into_report(ns: argparse.Namespace, out: Path) -> None:
    """Bench every model of the audit just written (``--bench``) and render the matrix again with the figures."""

    from ..report.formats import write_reports
    from ..run.throughput import bench_audit

    path = out / "packcheck-matrix.json"
    from ..results.schema import read_results
    doc = read_results(path)
    if doc.get("settings", {}).get("versions"):  # asked for through an ini file: caught here, after the audit
        print("packcheck audit: error: --bench measures in this environment only, and this audit ran in version "
              "environments: its matrix is written without bench figures.", file=sys.stderr)
        return
    device = doc.get("settings", {}).get("device", "cpu")
    doc["bench"] = {"profiles": list(ns.bench), "steps": ns.bench_steps, "device": device,
                    "batch_size": ns.bench_batch_size, "max_length": ns.bench_max_length,
                    "results": bench_audit(doc, list(ns.bench), ns.bench_steps, device, batch_size=ns.bench_batch_size,
                                           max_length=ns.bench_max_length)}
    write_reports(out, doc)
    print(f"bench figures added to {out / 'packcheck-matrix.md'}")


def _verify_remedies_into_report(out: Path) -> None:
    """``--verify-remedies``: verify the remedies of the audit just written; the records go into the JSON
    (``remedy_checks``) and a "Remedies verified" section is appended to the Markdown."""

    from ..analysis.remedies import render_remedy_checks, verify_remedies
    from ..results import dumps_results, write_set

    path = out / "packcheck-matrix.json"
    from ..results.schema import read_results
    doc = read_results(path)
    records = verify_remedies(doc, out, log=lambda line: print(line, flush=True))
    md = out / "packcheck-matrix.md"
    # one set (results.write_set), the JSON last: a kill between the two never leaves one updated, one not
    write_set([(md, md.read_text().rstrip("\n") + "\n\n" + render_remedy_checks(records)),
               (path, dumps_results(doc))])
    verified = sum(1 for r in records if r["verified"])
    print(f"remedies verified: {verified} of {len(records)} (section 'Remedies verified' in {md})")
