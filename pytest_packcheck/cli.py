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

from .settings import OPT_ALL_ARCHS, OPT_AUDIT, OPT_CHECKS, OPT_MODELS, OPT_RESUME, OPT_TIMEOUT, OPT_VERSIONS, OPTIONS

OPTIONS_BY_FLAG = {opt.flag: opt for opt in OPTIONS}

_ALIASES = {OPT_MODELS: "--models", OPT_AUDIT: "--audit", OPT_ALL_ARCHS: "--all-architectures", OPT_VERSIONS: "--versions",
            OPT_RESUME: "--resume", OPT_TIMEOUT: "--timeout"}


_SUMMARY_HELP = ("For the gate: append GitHub job-summary Markdown to FILE (e.g. \"$GITHUB_STEP_SUMMARY\"): a row per "
                 "changed cell with model, backend, versions, verdict before / after, number, cause, known fault, remedy.")


#: What ``packcheck`` exits with, for --help and the README.
EXIT_CODES = {
    0: "the matrix was written (whatever the verdicts); gate: no regression; bisect: an answer",
    1: "gate: a regression (after the table is printed); bisect: the endpoints do not hold or skips hide the boundary",
    2: "usage error (one line naming the value, where it came from and the fix)",
    3: "internal error (pytest's)",
    130: "interrupted (Ctrl-C / SIGTERM): the finished cells are written, marked incomplete; rerun with --resume",
}


def audits() -> dict[str, str]:
    """The audits shipped with packcheck (audit/*.toml with an ``[audit]`` table): name -> description."""
    import tomllib

    from .specs import PACKAGE_AUDIT_DIR

    out = {}
    for path in sorted(PACKAGE_AUDIT_DIR.glob("*.toml")):
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8")).get("audit")
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
        if isinstance(table, dict):
            out[path.stem] = str(table.get("description", ""))
    return out


def help_epilog() -> str:
    """The end of ``packcheck --help`` / ``packcheck audit --help``, generated from the registry (checks with
    their roles, cause codes), the shipped audits and :data:`EXIT_CODES`: never retyped."""
    import textwrap

    from .registry import CAUSES, DEFAULT_CHECKS, REGISTRY, TRAINING_CHECKS

    def wrap(text: str, indent: str = "  ") -> str:
        return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent + "  ")

    lines = ["checks (--packcheck-checks; default: all but the training ones):"]
    lines += [wrap(f"{s.name} ({s.role}{', training' if s.training else ''}): {s.summary}") for s in REGISTRY]
    lines += [wrap(f"default: {', '.join(DEFAULT_CHECKS)}; training (opt in, or --audit training): {', '.join(TRAINING_CHECKS)}"),
              "", "causes (a failing cell names each; bisect --cause takes one):"]
    lines += [wrap(f"{code}: {meaning}") for code, meaning in CAUSES.items()]
    lines += ["", "audits (--audit NAME; default: default):"]
    lines += [wrap(f"{name}: {desc}") for name, desc in audits().items()]
    lines += ["", "exit codes:"] + [wrap(f"{code}: {meaning}") for code, meaning in EXIT_CODES.items()]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from .registry import CAUSES

    parser = argparse.ArgumentParser(prog="packcheck", description="Checks that padding-free packing trains the same model.",
                                     epilog=help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="Run the matrix and write reports/packcheck-matrix.md and .json.",
                           description="Runs the embedded default audit (audit/default.toml) when no model is given. "
                                       "The default audit runs no Trainer / SFTTrainer: --audit training does.",
                           epilog=help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
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
    audit.add_argument("--summary", metavar="FILE", default=None, help=_SUMMARY_HELP)
    audit.add_argument("pytest_args", nargs="*", help="Extra pytest arguments after --, e.g. -- -k sdpa.")
    gate = sub.add_parser("gate", help="Compare a candidate results JSON with a baseline; exit 1 if a cell got worse.")
    gate.add_argument("--baseline", required=True, help="Baseline results JSON (e.g. reports/baseline.json).")
    gate.add_argument("--candidate", help="Candidate results JSON (e.g. from the upgraded stack; default: the "
                                          "--baseline file, for --baseline-env / --candidate-env on one file).")
    gate.add_argument("--baseline-env", metavar="LABEL", help="Compare only the cells of this version environment of "
                      "the baseline file (its label, e.g. transformers==5.24.0, or a unique part of it such as 5.24.0).")
    gate.add_argument("--candidate-env", metavar="LABEL", help="The same for the candidate file.")
    gate.add_argument("--allow", action="append", default=[], metavar="CELL=REASON",
                      help="Accept a regression of a cell id or id prefix (e.g. 'opt-sdpa=known OPT leak'); repeatable.")
    gate.add_argument("--bisect", action="store_true",
                      help="Bisect each regression it prints: the transformers or trl release between the two stacks "
                           "that broke the cell (one version environment per probe; needs the package index).")
    gate.add_argument("--bisect-output-dir", default="reports/bisect", help="Where --bisect writes its JSON (default reports/bisect).")
    gate.add_argument("--summary", metavar="FILE", default=None, help=_SUMMARY_HELP)
    bisect = sub.add_parser("bisect", help="Name the release that broke (or fixed) one cell, from the package index.",
                            description="Bisects the releases between --good and --bad, one version environment per "
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
    bench = sub.add_parser("bench", help="Train the same examples padded and packed; report tokens/s, memory, speedup.",
                           description="Packed vs padded training steps on synthetic token ids with a length profile.")
    bench.add_argument("--model", default="arch:llama", help="Model spec (org/name, local dir, arch:<type>); default arch:llama.")
    bench.add_argument("--profile", action="append", default=[],
                       help="Length profile: flan, orcamath, uniform, fixed, or a file of lengths (repeatable; default flan and orcamath).")
    bench.add_argument("--steps", type=int, default=10, help="Measured optimizer steps per mode (default 10).")
    bench.add_argument("--warmup", type=int, default=2, help="Warm-up steps per mode, not measured (default 2).")
    bench.add_argument("--batch-size", type=int, default=16, help="Examples per step (default 16).")
    bench.add_argument("--max-length", type=int, default=2048, help="Longest example in tokens (default 2048).")
    bench.add_argument("--attn", "--packcheck-attn", dest="attn", default=None, help="attn_implementation (default sdpa on CPU, packcheck_flash_torch_varlen on CUDA).")
    bench.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu).")
    bench.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default float32 on CPU, bfloat16 on CUDA).")
    bench.add_argument("--full-size", action="store_true", help="Random weights at the config's real size (no shrink).")
    bench.add_argument("--no-instrumentation", action="store_true", help="Skip the run with attention-call counting on.")
    bench.add_argument("-o", "--output-dir", default="reports", help="Where <name>.md / .json go (default reports).")
    bench.add_argument("--name", default="bench", help="File name stem (default bench).")
    atlas = sub.add_parser("atlas", help="Every architecture x backend x transformers release (4.44 ..): resumable; "
                                         "writes reports/atlas/ (atlas.md, atlas.html, support.json).",
                           description="Measures each release in its own version environment (cached), one release "
                                       "after another; a killed run resumes where it stopped (per-release results and "
                                       "journal under --build-dir).")
    atlas.add_argument("--releases", default=None, metavar="A,B", help="Exact transformers releases, e.g. 4.44.2,5.24.0 "
                       "(default: the latest patch of every minor from --since to --until, from the package index).")
    atlas.add_argument("--since", default="4.44", help="Oldest minor (default 4.44, the varlen reference's floor).")
    atlas.add_argument("--until", default=None, help="Newest minor (default: the newest on the index).")
    atlas.add_argument("--build-dir", default="build/atlas", help="Per-release results and journals (default build/atlas; "
                                                                  "not committed).")
    atlas.add_argument("-o", "--output-dir", default="reports/atlas", help="Where atlas.md / .html and support.json go.")
    atlas.add_argument("--shard", default=None, metavar="I/N", help="Run shard I of N of each release (whole models, "
                                                                    "round-robin; as --packcheck-shard).")
    atlas.add_argument("--models", default=None, metavar="SPECS", help="Only these models (arch:llama,arch:qwen2; default "
                       "every architecture of each release). Use its own --build-dir: a release done for a subset is done.")
    atlas.add_argument("-n", "--workers", type=int, default=1, help="pytest-xdist workers per release (default 1).")
    atlas.add_argument("--list-releases", action="store_true", help="Print the releases the atlas covers as a JSON list "
                       "(for a CI matrix) and exit.")
    atlas.add_argument("--no-render", action="store_true", help="Measure only (a CI job of one release or shard); "
                       "the merge job renders.")
    atlas.add_argument("--render-only", action="store_true", help="Only render reports/atlas/ from what --build-dir holds.")
    atlas.add_argument("--seed", action="append", default=[], metavar="FILE", help="Take this results JSON (one "
                       "release's --all-architectures run on the atlas backends) as its release's run; repeatable.")
    atlas.add_argument("--remeasure", action="store_true", help="Measure again the releases the committed atlas "
                       "(OUTPUT_DIR/support.json) already holds; by default they are kept, not run.")
    atlas.add_argument("--bisect", action="store_true", help="Bisect every transition between adjacent measured releases "
                       "to the exact patch (packcheck bisect per transition; resumable).")
    atlas.add_argument("--bisect-limit", type=int, default=None, help="Bisect at most this many transitions.")
    atlas.add_argument("--bisect-models", default=None, metavar="TYPES", help="Bisect only these model types' transitions "
                                                                             "(e.g. llama,qwen2).")
    lookup = sub.add_parser("lookup", help="Does packing work for MODEL_TYPE on ATTN at this transformers? (the atlas)",
                            description="Answers offline from reports/atlas/support.json (the committed atlas).")
    lookup.add_argument("model_type", help="config.model_type, e.g. qwen2.")
    lookup.add_argument("attn_implementation", help="eager, sdpa, flash_attention_2 (answered from packcheck_flash_ref), ...")
    lookup.add_argument("transformers_version", help="e.g. 4.56.2.")
    lookup.add_argument("--trl", default=None, help="TRL version (the atlas has no TRL axis yet: noted in the answer).")
    lookup.add_argument("--support-file", default=None, help="support.json to read (default: the packaged atlas).")
    lookup.add_argument("--json", action="store_true", help="Print the answer as JSON.")
    claims = sub.add_parser("claims", help="What axolotl / ms-swift / LLaMA-Factory claim about packing (read from their "
                                           "wheels, not imported), against the atlas: reports/atlas/claims.md.")
    claims.add_argument("wheels", nargs="+", metavar="WHEEL", help="Peer wheels (pip download --no-deps axolotl ms-swift llamafactory).")
    claims.add_argument("--support-file", default=None, help="support.json to judge against (default: the committed atlas).")
    claims.add_argument("-o", "--output", default="reports/atlas/claims.md", help="Markdown to write (default reports/atlas/claims.md).")
    merge = sub.add_parser("merge", help="Join results JSON files (shards of one audit) and render the matrix.")
    merge.add_argument("files", nargs="+", help="Results JSON files.")
    merge.add_argument("-o", "--output-dir", default="reports", help="Where packcheck-matrix.md / .json go (default reports).")
    return parser


def gate_checks() -> tuple[str, ...]:
    """The checks ``audit --gate`` runs when none are named: the default checks plus the Trainer's (packed and its
    own padded run) and, where TRL is installed here, the SFTTrainer's (packed and padded). Issue 27: a gate without
    a training check said "No cell changed" while the Trainer went from fail (4.57.x keeps use_cache) to pass."""
    from importlib.util import find_spec

    from .registry import DEFAULT_CHECKS

    training = ("trainer", "trainer_padded") + (("sft", "sft_padded") if find_spec("trl") else ())
    return (*DEFAULT_CHECKS, *training)


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
    if given["packcheck_report_dir"] is None or given["packcheck_report_dir"].strip():  # '' goes on, to be refused
        given["packcheck_report_dir"] = os.path.abspath(given["packcheck_report_dir"] or "reports")
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

    from .errors import PackcheckUsageError

    if ns.command in ("gate", "merge", "bench", "bisect", "atlas", "lookup", "claims"):
        try:
            return {"gate": _gate, "merge": _merge, "bench": _bench, "bisect": _bisect, "atlas": _atlas,
                    "lookup": _lookup, "claims": _claims}[ns.command](ns)
        except PackcheckUsageError as exc:
            print(f"packcheck {ns.command}: error: {exc}", file=sys.stderr)
            return 2
        except (ImportError, MemoryError) as exc:  # torch cannot load (ulimit -v): one line, not a traceback
            from .errors import load_failure_message

            print(f"packcheck {ns.command}: error: {load_failure_message(exc)}", file=sys.stderr)
            return 2

    os.environ["PACKCHECK_REPRODUCE"] = _reproduce_line(argv)
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
        from .bench import sample_lengths

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
        allow = _parse_allow(ns.allow)
        if ns.allow and not ns.gate:
            raise PackcheckUsageError("--allow works with --gate (or `packcheck gate`): add --gate.")
        if ns.summary and not ns.gate:
            raise PackcheckUsageError(f"--summary '{ns.summary}' writes the gate's job summary: add --gate (or run `packcheck gate`).")
        if ns.gate:
            _gate_environments(ns)
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    args = _pytest_args(ns)
    if workers not in ("0", "1"):
        try:
            import xdist  # noqa: F401

            args += ["-n", workers, "--dist", "loadscope"]
        except ImportError:
            print("packcheck: pytest-xdist not installed; running in one process", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="packcheck-") as root:
        # the plugin by module, the entry point blocked: the same with packcheck installed or only on PYTHONPATH
        # (scripts/gpu_check.sh on the GPU machine)
        full = [root, "--rootdir", root, "-p", "no:cacheprovider", "-p", "no:packcheck", "-p", "pytest_packcheck.plugin",
                "-o", "addopts=", "-o", "testpaths=",
                "-W", "ignore::pytest.PytestAssertRewriteWarning",
                # --tb=no: the packcheck summary and the matrix name every failing cell with its number; pytest's
                # FAILURES section repeated them, at a cost quadratic in the reports (about a minute for the 2160
                # failing cells of the all-architectures audit). `-- --tb=short` brings it back.
                "-c", os.devnull, *(["-q"] if ns.quiet else []), "-rN", "--tb=no", *args, *ns.pytest_args]
        code = pytest.main(full)
    if code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        if ns.gate:
            return _gate_versions(Path(ns.packcheck_report_dir or "reports"), allow, ns.summary)
        if ns.bench:
            _bench_into_report(ns, Path(ns.packcheck_report_dir or "reports"))
        if ns.verify_remedies:
            _verify_remedies_into_report(Path(ns.packcheck_report_dir or "reports"))
        if ns.save_baseline:
            from .results import atomic_write

            out = Path(ns.packcheck_report_dir or "reports")
            try:  # atomic and named: a full disk is one line, and never half a baseline
                atomic_write(out / "baseline.json", (out / "packcheck-matrix.json").read_text(encoding="utf-8"))
            except (PackcheckUsageError, OSError) as exc:
                print(f"packcheck audit: error: --save-baseline: {exc}", file=sys.stderr)
                return 2
            print(f"baseline written: {out / 'baseline.json'}")
        return 0
    if code == pytest.ExitCode.USAGE_ERROR:
        return 2
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:  # every cell deselected (`-- -k nothing`): nothing was checked
        print(f"packcheck audit: error: the pytest arguments {' '.join(ns.pytest_args) or '(none)'} deselected every cell of "
              "the matrix: nothing was checked and no matrix written; select cells with -k on ids such as "
              "llama-sdpa-isolation-float32.", file=sys.stderr)
        return 2
    return 3 if code != pytest.ExitCode.INTERRUPTED else 130


def _gate_environments(ns: argparse.Namespace) -> tuple[str, str]:
    """The two version environments ``audit --gate`` compares (baseline first, as given), before the audit runs.

    Raises:
        PackcheckUsageError: --versions does not name exactly two environments, or --bench / --save-baseline too.
    """
    from .envs import parse_versions
    from .errors import PackcheckUsageError

    values = getattr(ns, OPTIONS_BY_FLAG[OPT_VERSIONS].dest) or []
    combos = parse_versions(values, "--versions") if values else []
    if len(combos) != 2:
        raise PackcheckUsageError(
            f"--gate compares two version environments, and --versions names {len(combos)}"
            f"{' (' + ', '.join(c.label for c in combos) + ')' if combos else ''}: write e.g. "
            "--versions 'transformers==5.24.0,5.25.0' --gate (the first is the baseline).")
    if ns.bench or ns.save_baseline:
        raise PackcheckUsageError("--gate compares two version environments; run --bench / --save-baseline without it.")
    return combos[0].label, combos[1].label


def _gate_versions(out: Path, allow: dict[str, str], summary: str | None = None) -> int:
    """``audit --versions A,B --gate``: gate environment B against A in the matrix just written."""
    from .errors import PackcheckUsageError
    from .gate import select_env
    from .results import load_document

    try:
        doc = load_document(out / "packcheck-matrix.json")
        labels = doc["settings"].get("versions") or []
        if len(labels) != 2:
            raise PackcheckUsageError(f"the matrix in {out} holds {len(labels)} version environments, not two.")
        baseline, candidate = (select_env(doc, label, "--versions") for label in labels)
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    print(f"\npackcheck gate: {labels[1]} (candidate) against {labels[0]} (baseline)")
    try:
        code = _run_gate(baseline, candidate, allow, "packcheck gate", summary=summary)
    except PackcheckUsageError as exc:
        print(f"packcheck audit: error: {exc}", file=sys.stderr)
        return 2
    _gate_into_report(out, doc, baseline, candidate, allow, labels)
    return code


def _gate_into_report(out: Path, doc: dict, baseline: dict, candidate: dict, allow: dict[str, str], labels: list[str]) -> None:
    """Record the gate's result in the matrix files (the HTML shows it): ``doc["gate"]`` with the two
    environments, the counts and each regression's cell id, then the four files written again as a set."""
    from .gate import compare, regressions
    from .report import write_reports

    changes = compare(baseline, candidate, allow)
    bad = regressions(changes)
    doc["gate"] = {"baseline": labels[0], "candidate": labels[1], "changed": len(changes), "regressions": len(bad),
                   "cells": ["-".join(str(x) for x in ch.key[:4] if x) for ch in bad]}
    write_reports(out, doc)


def _reproduce_line(argv: list[str]) -> str:
    """The report's Reproduce line: the settings' environment variables that are set, then the command."""
    import shlex

    envs = [f"{opt.env}={shlex.quote(os.environ[opt.env])}" for opt in OPTIONS if opt.env and os.environ.get(opt.env)]
    return " ".join([*envs, "packcheck " + shlex.join(argv)])


def _versions_source(ns: argparse.Namespace) -> str | None:
    """Where version environments were asked for (--packcheck-versions, its environment variable, or the audit
    definition's ``versions``), or None."""
    from .specs import load_audit

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
    import json

    from .bench import bench_audit
    from .report import write_reports

    path = out / "packcheck-matrix.json"
    doc = json.loads(path.read_text())
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
    import json

    from .bisect import render_remedy_checks, verify_remedies
    from .results import write_set

    path = out / "packcheck-matrix.json"
    doc = json.loads(path.read_text())
    records = verify_remedies(doc, out, log=lambda line: print(line, flush=True))
    md = out / "packcheck-matrix.md"
    # one set (results.write_set), the JSON last: a kill between the two never leaves one updated, one not
    write_set([(md, md.read_text().rstrip("\n") + "\n\n" + render_remedy_checks(records)),
               (path, json.dumps(doc, indent=1) + "\n")])
    verified = sum(1 for r in records if r["verified"])
    print(f"remedies verified: {verified} of {len(records)} (section 'Remedies verified' in {md})")


def _parse_allow(items: list[str]) -> dict[str, str]:
    from .errors import PackcheckUsageError

    allow = {}
    for item in items:
        cell, sep, reason = item.partition("=")
        if not sep or not cell or not reason:
            raise PackcheckUsageError(f"--allow '{item}' needs CELL=REASON, e.g. --allow 'opt-sdpa=known OPT leak'.")
        allow[cell] = reason
    return allow


def _gate(ns: argparse.Namespace) -> int:
    from .errors import PackcheckUsageError
    from .gate import select_env
    from .results import load_document

    allow = _parse_allow(ns.allow)
    if ns.candidate is None and not (ns.baseline_env and ns.candidate_env):
        raise PackcheckUsageError("packcheck gate needs --candidate FILE, or --baseline-env and --candidate-env to "
                                  "compare two version environments of the --baseline file.")
    baseline = load_document(ns.baseline)
    candidate = load_document(ns.candidate) if ns.candidate else baseline
    if ns.baseline_env:
        baseline = select_env(baseline, ns.baseline_env, "--baseline-env")
    if ns.candidate_env:
        candidate = select_env(candidate, ns.candidate_env, "--candidate-env")
    return _run_gate(baseline, candidate, allow, "packcheck gate", ns.bisect_output_dir if ns.bisect else None, ns.summary)


def _run_gate(baseline: dict, candidate: dict, allow: dict[str, str], prog: str, bisect_dir: str | None = None,
              summary: str | None = None) -> int:
    """Print the changed cells (a rich table on a terminal, plain text otherwise), append the job summary to
    ``summary`` when given, bisect each regression when ``bisect_dir`` is given, and return 1 on a regression.

    Raises:
        PackcheckUsageError: a cell held twice with two verdicts; the summary file cannot be written.
    """
    from .gate import allowed_reason, compare, regressions, render_changes, render_summary, stack, write_summary

    changes = compare(baseline, candidate, allow)
    ids = {c["cell_id"] for c in baseline["cells"]} | {c["cell_id"] for c in candidate["cells"]}
    for key in allow:
        if not any(allowed_reason(i, {key: "x"}) for i in ids):
            print(f"{prog}: warning: --allow '{key}' matches no cell of either file", file=sys.stderr)
    if candidate.get("incomplete"):
        print(f"{prog}: warning: the candidate run was incomplete ({candidate['incomplete']['reason']}); "
              "its missing cells count as regressions", file=sys.stderr)
    if sys.stdout.isatty():
        _print_changes_rich(changes, stack(baseline), stack(candidate))
    else:
        print(render_changes(changes, stack(baseline), stack(candidate), markdown=False))
    bad = regressions(changes)
    if summary:
        write_summary(summary, render_summary(changes, stack(baseline), stack(candidate)))
    print(f"\n{prog}: {len(bad)} regression(s), {len(changes)} changed cell(s)")
    if bisect_dir and bad:
        _gate_bisect(bad, baseline, candidate, bisect_dir)
    return 1 if bad else 0


def _bisect(ns: argparse.Namespace) -> int:
    """``packcheck bisect``: exit 0 with an answer, 1 when the endpoints do not hold or skips hide the boundary."""
    from .bisect import bisect_cell, render_text

    record = bisect_cell(ns.cell, ns.good, ns.bad, model=ns.model, pre=ns.pre, cause=ns.cause, supported=ns.supported,
                         output_dir=ns.output_dir)
    print(render_text(record))
    print(f"bisect written: {record['path']}")
    return 0 if record["outcome"] == "found" else 1


def _atlas(ns: argparse.Namespace) -> int:
    """``packcheck atlas``: the releases, then :func:`pytest_packcheck.atlas.main`."""
    from .atlas import AtlasArgs, index_releases, parse_release_list, parse_shard
    from .atlas import main as atlas_main
    from .errors import PackcheckUsageError

    releases = parse_release_list(ns.releases, "--releases") if ns.releases else index_releases(ns.since, ns.until)
    if ns.list_releases:
        import json

        print(json.dumps(releases))
        return 0
    if ns.render_only and ns.no_render:
        raise PackcheckUsageError("--render-only and --no-render exclude each other: pick one.")
    shard = parse_shard(ns.shard, "--shard") if ns.shard else None
    if ns.workers < 1:
        raise PackcheckUsageError(f"-n/--workers {ns.workers} must be >= 1.")
    models = [m.strip() for m in ns.models.split(",") if m.strip()] if ns.models else None
    bisect_models = [m.strip() for m in ns.bisect_models.split(",") if m.strip()] if ns.bisect_models else None
    return atlas_main(AtlasArgs(releases, Path(ns.build_dir), Path(ns.output_dir), shard, ns.workers, ns.render_only,
                                ns.bisect, ns.bisect_limit, models, bisect_models, ns.seed, ns.no_render, ns.remeasure),
                      log=lambda line: print(line, flush=True))


def _lookup(ns: argparse.Namespace) -> int:
    """``packcheck lookup``: exit 0 with a measured answer, 1 when not measured (the nearest measured release is named)."""
    import json

    from .support import lookup

    answer = lookup(ns.model_type, ns.attn_implementation, ns.transformers_version, ns.trl, path=ns.support_file)
    print(json.dumps(answer.as_dict(), indent=1) if ns.json else str(answer))
    return 0 if answer.measured else 1


def _claims(ns: argparse.Namespace) -> int:
    """``packcheck claims``: read each peer wheel, judge its claims against the atlas, write the Markdown."""
    from .claims import read_wheel, render_claims
    from .results import atomic_write
    from .support import load_support

    peers = [read_wheel(w) for w in ns.wheels]
    out = Path(ns.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, render_claims(peers, load_support(ns.support_file)))
    print(f"claims written: {out} ({', '.join(f'{p.peer} {p.version}: {len(p.claims)} claims' for p in peers)})")
    return 0


def _gate_bisect(bad: list, baseline: dict, candidate: dict, output_dir: str) -> None:
    """Bisect each regression of a gate run between the baseline's and the candidate's library versions."""
    from .bisect import bisect_cell, gate_sides, render_text
    from .errors import PackcheckUsageError
    from .gate import _key

    base_cells = {_key(c): c for c in baseline["cells"]}
    cand_cells = {_key(c): c for c in candidate["cells"]}
    for change in bad:
        b, c = base_cells.get(change.key), cand_cells.get(change.key)
        cell_id = (c or b)["cell_id"].partition("@")[0]
        if b is None or c is None:
            print(f"packcheck gate --bisect: {cell_id}: not bisected (the cell is missing on one side)")
            continue
        sides, why = gate_sides(b, c, baseline.get("environment", {}), candidate.get("environment", {}))
        if sides is None:
            print(f"packcheck gate --bisect: {cell_id}: not bisected ({why})")
            continue
        try:
            record = bisect_cell(cell_id, sides.spec(sides.good), sides.spec(sides.bad), model=c["model"].get("spec"),
                                 output_dir=output_dir)
        except PackcheckUsageError as exc:
            print(f"packcheck gate --bisect: {cell_id}: not bisected ({exc})")
            continue
        print(render_text(record))
        print(f"bisect written: {record['path']}")



def _print_changes_rich(changes: list, baseline_env: dict, candidate_env: dict) -> None:
    """The gate's table for a terminal (rich): the same rows as :func:`gate.render_changes`, regressions in red."""
    from rich.console import Console
    from rich.table import Table

    from .gate import render_changes

    head = render_changes([], baseline_env, candidate_env).splitlines()[:2]
    console = Console()
    for line in head:
        console.print(line, highlight=False, markup=False)
    if not changes:
        console.print("No cell changed.")
        return
    table = Table("cell", "baseline", "candidate", "verdict", "detail")
    for ch in changes:
        cell = "-".join(str(x) for x in ch.key[:4] if x) + (f"@{ch.key[4]}" if ch.key[4] else "")
        verdict = "REGRESSION" if ch.worse and not ch.allowed else (f"allowed: {ch.allowed}" if ch.allowed else "better/neutral")
        table.add_row(cell, ch.baseline or "—", ch.candidate or "—", verdict, ch.detail,
                      style="red" if verdict == "REGRESSION" else None)
    console.print(table)


def _merge(ns: argparse.Namespace) -> int:

    from .diagnose import diagnose_document
    from .errors import PackcheckUsageError
    from .gate import merge
    from .report import write_reports
    from .results import load_document, write_failure
    from .session import hold_report_dir

    doc = diagnose_document(merge([load_document(f) for f in ns.files]))
    out = Path(ns.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackcheckUsageError(write_failure(out / "packcheck-matrix.json", exc, "-o/--output-dir")) from None
    lock = hold_report_dir(out, "-o/--output-dir")  # an audit writing there now would have its matrix replaced
    try:
        write_reports(out, doc, "-o/--output-dir")
    finally:
        lock.release(force=True)
    if doc.get("merged_settings_differ"):
        print(f"packcheck merge: warning: these files are not shards of one audit (their settings differ in "
              f"{', '.join(doc['merged_settings_differ'])}); the matrix shows the union of their cells and every command",
              file=sys.stderr)
    print(f"merged {len(ns.files)} files, {len(doc['cells'])} cells into {out}")
    return 0


def _bench(ns: argparse.Namespace) -> int:
    import json

    from .backends import (
        KNOWN_BACKENDS,
        REFERENCE_BACKEND,
        TORCH_VARLEN_BACKEND,
        backend_availability,
        register_reference_backend,
    )
    from .bench import load_targets, render_bench, run_bench, sample_lengths
    from .errors import PackcheckUsageError, closest
    from .models import build_model, resolve_model
    from .results import environment, probe_folder, write_set
    from .settings import DTYPES
    from .specs import parse_model_spec

    cuda = ns.device.startswith("cuda")
    attn = ns.attn or (TORCH_VARLEN_BACKEND if cuda else "sdpa")
    dtype = ns.dtype or ("bfloat16" if cuda else "float32")
    if attn not in KNOWN_BACKENDS:
        raise PackcheckUsageError(f"Unknown backend '{attn}' (from --attn). Expected one of: {', '.join(KNOWN_BACKENDS)}.{closest(attn, KNOWN_BACKENDS)}")
    if dtype not in DTYPES:
        raise PackcheckUsageError(f"Unknown dtype '{dtype}' (from --dtype). Expected one of: {', '.join(DTYPES)}.{closest(dtype, DTYPES)}")
    for name, least in (("steps", 1), ("warmup", 1), ("batch_size", 1), ("max_length", 2)):
        if getattr(ns, name) < least:
            why = " (the first step of each mode pays one-time costs; it is never timed)" if name == "warmup" else ""
            raise PackcheckUsageError(f"--{name.replace('_', '-')} {getattr(ns, name)} must be >= {least}{why}.")
    if not ns.name or any(ch in ns.name for ch in "/\\") or ns.name in (".", ".."):
        raise PackcheckUsageError(f"--name '{ns.name}' must be a file name stem without a path: use -o/--output-dir for the folder.")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise PackcheckUsageError(f"Device '{ns.device}' (from --device) is not available: torch sees no CUDA device. Use --device cpu.")
    targets = load_targets()  # a broken targets file is refused before anything is measured
    profiles = ns.profile or ["flan", "orcamath"]
    for profile in profiles:  # a bad profile or lengths file is refused before the model is built
        sample_lengths(profile, 1, ns.max_length, source="--profile")
    avail = backend_availability(attn, ns.device)
    if not avail.available:
        raise PackcheckUsageError(f"Backend '{attn}' (from --attn) cannot run on {ns.device}: {avail.reason}.")
    if not avail.backward:
        raise PackcheckUsageError(f"Backend '{attn}' (from --attn) cannot train on {ns.device}: {avail.backward_reason}. "
                                  "Use sdpa or eager there.")
    resolved = resolve_model(parse_model_spec(ns.model, "--model"), "--model")
    if resolved.error:
        raise PackcheckUsageError(f"Model '{ns.model}' (from --model) cannot be built: {resolved.error}")
    out = Path(ns.output_dir)
    probe_folder(out, "-o/--output-dir", "Output directory")  # before minutes of measuring, not after (a full disk says so)
    if attn in (REFERENCE_BACKEND, TORCH_VARLEN_BACKEND):
        register_reference_backend()
    try:  # a model that cannot run on this backend (mamba on sdpa) is refused before anything is measured
        model = build_model(resolved, attn, dtype, "random", ns.device, shrink=not ns.full_size)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises at build: one line, exit 2
        text = " ".join(str(exc).split())
        first = text if len(text) <= 300 else text[:300] + " ..."
        hint = " (try --attn eager)" if attn != "eager" else ""
        raise PackcheckUsageError(f"Model '{ns.model}' (from --model) cannot be built with --attn {attn} on {ns.device}: "
                                  f"{type(exc).__name__}: {first}{hint}") from None
    n_params = sum(p.numel() for p in model.parameters())
    env = environment(ns.device)
    label = f"{resolved.spec.label} ({n_params / 1e6:.1f}M parameters{'' if ns.full_size else ', shrunk'})"
    results: list[dict] = []
    for profile in profiles:
        base = {"model": resolved.record(), "parameters": n_params, "attn_implementation": attn, "dtype": dtype, "profile": profile}
        try:
            r = run_bench(model, profile=profile, steps=ns.steps, warmup=ns.warmup, batch_size=ns.batch_size,
                          max_length=ns.max_length, device=ns.device, instrumentation=not ns.no_instrumentation,
                          targets=targets)
        except Exception as exc:  # noqa: BLE001 - one profile failing (OOM, kernel error) keeps the others' figures
            results.append({**base, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            print(f"{profile}: not measured: {results[-1]['error']}", file=sys.stderr)
        else:
            results.append({**base, **r})
            print(f"{profile}: speedup {r['speedup']:.2f}x (ideal {r['ideal_speedup']:.2f}x), padding {r['padding_overhead'] * 100:.0f} %, "
                  f"memory saved {r['memory_reduction'] if r['memory_reduction'] is not None else 'n/a'}, "
                  f"instrumentation {r.get('instrumentation_overhead', 'n/a')}")
        if "error" in results[-1]:
            _free_cuda(ns.device)  # out of the except block: its traceback no longer holds the failed step's tensors
        # written after every profile: a run stopped by a time limit keeps what it measured
        # one set (results.write_set), the JSON last; the folder named as the flag that chose it
        write_set([(out / f"{ns.name}.md", render_bench(results, env, label)),
                   (out / f"{ns.name}.json", json.dumps({"environment": env, "results": results}, indent=1) + "\n")],
                  "-o/--output-dir")
    print(f"bench written: {out / (ns.name + '.md')}, {out / (ns.name + '.json')}")
    return 1 if all("error" in r for r in results) else 0


def _free_cuda(device: str) -> None:
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
