"""The ``packcheck`` command line: one module per command, listed once in :data:`COMMANDS`.

``main`` builds the parser from the table (``packcheck --help`` lists the rows in their order) and hands the
parsed arguments to the command's module. A command module has either

- ``configure(parser)`` (adds its arguments to its subparser; may set ``parser.description`` / ``epilog``) and
  ``run(ns) -> int`` (the exit code; ``ns.argv`` holds the command line after ``packcheck``), or
- ``main(argv) -> int`` alone: it parses its own arguments (``argv`` is what follows the command's name).

A :class:`~pytest_packcheck.errors.PackcheckUsageError` out of a command is one line ``packcheck <command>:
error: ...`` and exit 2, as is an ImportError / MemoryError while torch loads (``ulimit -v``).

``audit`` runs the packcheck matrix through pytest and writes the support matrix: it takes the same
``--packcheck-*`` flags as the pytest plugin (``--models`` etc. are short aliases) and runs pytest in an empty
temporary root, so no test file of the current project is collected.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Any, NamedTuple


class Command(NamedTuple):
    """One ``packcheck`` command: its name, the module that implements it, the one line ``packcheck --help`` shows."""

    name: str
    module: str
    help: str


#: Every ``packcheck`` command, in the order ``packcheck --help`` lists them.
COMMANDS = (
    Command("audit", "pytest_packcheck.cli.audit", "Run the matrix and write reports/packcheck-matrix.md and .json."),
    Command("gate", "pytest_packcheck.cli.gate", "Compare a candidate results JSON with a baseline; exit 1 if a cell got worse."),
    Command("bisect", "pytest_packcheck.cli.bisect", "Name the release that broke (or fixed) one cell, from the package index."),
    Command("bench", "pytest_packcheck.cli.bench", "Train the same examples padded and packed; report tokens/s, memory, speedup."),
    Command("atlas", "pytest_packcheck.cli.atlas", "Every architecture x backend x transformers release (4.44 ..): resumable; "
                                                   "writes reports/atlas/ (atlas.md, atlas.html, support.json)."),
    Command("lookup", "pytest_packcheck.cli.lookup", "Does packing work for MODEL_TYPE on ATTN at this transformers? (the atlas)"),
    Command("claims", "pytest_packcheck.cli.claims", "What axolotl / ms-swift / LLaMA-Factory / verl / unsloth claim about "
                                                     "packing (read from their released packages, not imported), against the "
                                                     "atlas: reports/atlas/claims.md."),
    Command("merge", "pytest_packcheck.cli.merge", "Join results JSON files (shards of one audit) and render the matrix."),
    # a command whose module has only main(argv) parses its own arguments
    Command("checks", "pytest_packcheck.checks.listing", "List the checks: role, level, suite, requirements, key number, "
                                                         "tolerance and causes (--markdown: the docs' check table)."),
)

#: What ``packcheck`` exits with, for --help and the docs (docs/reference/exit-codes.md).
EXIT_CODES = {
    0: "the matrix was written (whatever the verdicts, unless audit --fail-on-failure); gate: no regression; bisect: an answer; lookup: a measured "
       "answer (or one a bisect places)",
    1: "audit --fail-on-failure: a correctness check failed (the matrix is written); gate: a regression (after the table is printed); bisect: the endpoints do not hold or skips hide the boundary; "
       "lookup: not measured (the nearest measured releases are named; with --trl, also that TRL release not measured; with a "
       "library axis, --verl / --peft ..., also that release not measured, or outside the axis's measured range: one line naming it)",
    2: "usage error (one line naming the value, where it came from and the fix)",
    3: "internal error (pytest's)",
    130: "interrupted (Ctrl-C / SIGTERM): the finished cells are written, marked incomplete; rerun with --resume",
    74: "standard output could not be written (a full disk, a closed descriptor): one line on stderr says why; an "
        "audit still writes its reports and exits as its verdicts say",
    141: "the reader of the output went away (`| head`): the rest of the output was dropped (an audit finishes and writes its matrix, exiting as usual)",
}


def audits() -> dict[str, str]:
    """The audits shipped with packcheck (audit/*.toml with an ``[audit]`` table): name -> description."""
    import tomllib

    from ..config.audits import PACKAGE_AUDIT_DIR

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

    from ..checks.causes import CAUSES
    from ..checks.registry import DEFAULT_CHECKS, REGISTRY, SUITES, suite_checks

    def wrap(text: str, indent: str = "  ") -> str:
        return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent + "  ")

    lines = ["checks (--packcheck-checks; default: the default suite's):"]
    lines += [wrap(f"{s.name} ({s.role}{'' if s.suite == 'default' else ', ' + s.suite}): {s.summary}") for s in REGISTRY]
    suites = [f"{suite} (opt in, or --audit {suite}): {', '.join(suite_checks(suite))}" for suite in SUITES
              if suite != "default" and suite_checks(suite)]
    lines += [wrap(f"default: {', '.join(DEFAULT_CHECKS)}; " + "; ".join(suites)),
              "", "causes (a failing cell names each; bisect --cause takes one):"]
    lines += [wrap(f"{code}: {meaning}") for code, meaning in CAUSES.items()]
    lines += ["", "audits (--audit NAME; default: default):"]
    lines += [wrap(f"{name}: {desc}") for name, desc in audits().items()]
    lines += ["", "exit codes:"] + [wrap(f"{code}: {meaning}") for code, meaning in EXIT_CODES.items()]
    return "\n".join(lines)


def _module(command: Command) -> ModuleType:
    return importlib.import_module(command.module)


#: why argparse's own output (--help, --version's sibling texts) could not be written, if it could not
_HELP_LOST: list[str] = []


class _Parser(argparse.ArgumentParser):
    """``packcheck``'s top-level parser: its epilog (:func:`help_epilog`: the registry, the shipped audits, the exit
    codes) is built when help is printed, not on every start (``packcheck lookup`` answers in a fraction of it)."""

    def format_help(self) -> str:
        if self.epilog is None:
            self.epilog = help_epilog()
        return super().format_help()

    def _print_message(self, message: str, file: Any = None) -> None:
        """argparse's, flushed, with a failed write kept in :data:`_HELP_LOST` (argparse drops the OSError: the help
        sent to a full disk was lost with exit 0); :func:`main` exits 74 on it."""
        if not message:
            return
        file = sys.stderr if file is None else file
        try:
            file.write(message)
            file.flush()
        except (OSError, AttributeError, ValueError) as exc:  # a full disk, a closed or missing stream
            _HELP_LOST.append(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)

    def error(self, message: str) -> Any:
        """argparse's error, with the closest flag of the command for an unknown one (``--packcheck-atn``: a hostile
        trial, helper G)."""
        if message.startswith("unrecognized arguments: "):
            from ..errors import closest

            first = message.removeprefix("unrecognized arguments: ").split(" ")[0].split("=", 1)[0]
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            command = subs[0].choices.get(getattr(self, "only", None) or "") if subs else None
            flags = sorted({o for a in (command or self)._actions for o in a.option_strings})
            message += "." + closest(first, flags) if first.startswith("-") else ""
        elif message.endswith("expected one argument"):  # --packcheck-lengths -3,5: argparse read the value as a flag
            flag = max(message.removeprefix("argument ").split(":")[0].split("/"), key=len)  # the long form takes '='
            message += f": give it as {flag}=VALUE (a value starting with '-' only that way)"
        # one line, not the command's usage block first (30 lines for audit): --help shows it
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _VersionAction(argparse.Action):
    """``--version``: the version read from the distribution's metadata only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None) -> None:
        from .. import __version__

        parser._print_message(f"packcheck {__version__}\n", sys.stdout)  # on stdout, as argparse's own version action
        parser.exit()


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``packcheck`` parser: one subparser per row of :data:`COMMANDS`, configured by its module. ``only``: the
    one command this run parses; the others are named (so a typo is still answered with every choice) but their
    modules are not imported."""
    parser = _Parser(prog="packcheck", description="Checks that padding-free packing trains the same model.",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     allow_abbrev=False)  # a prefix never stands for a flag (trial 13, 130: --packcheck-trust)
    parser.only = only  # the command parsed: its flags are the ones an unknown flag is matched with
    parser.add_argument("--version", action=_VersionAction, help="Print packcheck's version and exit.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        if only is not None and command.name != only:
            sub.add_parser(command.name, help=command.help, add_help=False)
            continue
        module = _module(command)
        if hasattr(module, "configure"):
            module.configure(sub.add_parser(command.name, help=command.help, allow_abbrev=False))
            sub.choices[command.name].set_defaults(_empty_check=sub.choices[command.name])
        else:  # main(argv): parsed by the module itself (main hands it over before this parser runs)
            sub.add_parser(command.name, help=command.help, add_help=False, allow_abbrev=False).add_argument("args", nargs=argparse.REMAINDER)
    return parser


#: Why standard output could not be written in this run (a full disk, a closed descriptor, an I/O error): the
#: first reason, said once on stderr when the command ends (issue 42: tracebacks, and no matrix with stdout closed).
_OUTPUT_FAILED: list[str] = []


def _devnull_stream() -> Any:
    import os

    return open(os.devnull, "w", encoding="utf-8")


def _output_failed(stream: Any, exc: OSError) -> Any:
    """Record why ``stream`` cannot be written and hand back a devnull stream (its descriptor pointed at devnull too,
    for pytest's terminal writer and the forked cells)."""
    if not _OUTPUT_FAILED:
        _OUTPUT_FAILED.append(exc.strerror or type(exc).__name__)
    _fd_to_devnull(stream)
    return _devnull_stream()


def _reopen_closed_descriptors() -> None:
    """Put devnull on a closed fd 1 / 2 (``packcheck audit >&-``): otherwise the next file packcheck opens (the
    journal) takes descriptor 1, and the cells' output would be written into it."""
    import os

    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                got = os.open(os.devnull, os.O_WRONLY)
                if got != fd:
                    os.dup2(got, fd)
                    os.close(got)
            except OSError:
                pass


class _Scrubbed:
    """``sys.stdout`` for a command's own output with :func:`~pytest_packcheck.errors.scrub_secrets` applied to each
    write: a token in a path the user chose (``-o out-ghp_...``) or in an override is not echoed in the
    "bisect written: ..." line, as it is not in the files (trial 4, 207). Everything else is the stream's own. A
    stream that cannot be written (closed, a full disk) is recorded once and the output dropped, never a traceback;
    a reader that went away (BrokenPipeError) still ends the command with 141."""

    def __init__(self, stream: Any) -> None:
        if stream is None:  # `>&-`: Python has no sys.stdout at all
            _OUTPUT_FAILED.append("standard output is closed")
            stream = _devnull_stream()
        self._stream = stream

    def write(self, text: str) -> int:
        from ..errors import scrub_secrets

        try:
            self._stream.write(scrub_secrets(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._stream = _output_failed(self._stream, exc)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._stream = _output_failed(self._stream, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _fd_to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at devnull once its reader has gone (Python's recipe for SIGPIPE, signal
    module docs): later writes and the flush at exit raise nothing."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _PipeSafe:
    """``sys.stdout`` for ``packcheck audit``: once the reader of the output has gone (``| head``: the write raises
    BrokenPipeError), the rest of the output goes to devnull and the run goes on to write its matrix, as it would
    to a terminal; before, the audit stopped with exit 141 and left an empty journal (trial 5, 230)."""

    def __init__(self, stream: Any) -> None:
        if stream is None:  # `>&-`: the run goes on and writes its matrix, and says once that stdout was closed
            _OUTPUT_FAILED.append("standard output is closed")
            stream = _devnull_stream()
        self._stream = stream

    def _drop(self, exc: OSError | None = None) -> None:
        if exc is not None and not isinstance(exc, BrokenPipeError):  # a full disk, an I/O error: said at the end
            self._stream = _output_failed(self._stream, exc)
            return
        _fd_to_devnull(self._stream)  # the descriptor too: pytest's terminal writer and forked cells write to fd 1
        self._stream = _devnull_stream()

    def write(self, text: str) -> int:
        from ..errors import scrub_secrets

        try:
            self._stream.write(scrub_secrets(text))
            return len(text)
        except OSError as exc:
            self._drop(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._drop(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Entry point. Exit codes: :data:`EXIT_CODES` (0 matrix written whatever the verdicts, 2 usage error, 3 internal
    error)."""
    argv = sys.argv[1:] if argv is None else argv
    from ..errors import ScrubbingStream

    _HELP_LOST.clear()
    real_stderr = sys.stderr
    if real_stderr is not None:  # argparse's errors echo the arguments: a token in one (--token=hf_...) never in clear
        sys.stderr = ScrubbingStream(real_stderr)
    try:
        return _main(argv)
    except SystemExit as exc:  # argparse's --help / --version: the text went to stdout; a full disk loses it
        if exc.code not in (0, None) or not _HELP_LOST:
            raise
        # `packcheck --help > /dev/full` exited 0 with the help lost: argparse swallows the write's OSError (trial 4)
        _fd_to_devnull(sys.stdout)  # the flush at interpreter exit would fail again, as "Exception ignored"
        print(f"packcheck: standard output could not be written ({_HELP_LOST[0]}): the text was dropped.", file=sys.stderr)
        return 74
    finally:
        sys.stderr = real_stderr


def _main(argv: list[str]) -> int:
    by_name = {c.name: c for c in COMMANDS}
    if argv and argv[0] in by_name and not hasattr(_module(by_name[argv[0]]), "configure"):
        name, run = argv[0], lambda: _module(by_name[argv[0]]).main(argv[1:])
    else:
        if argv and not argv[0].startswith("-") and argv[0] not in by_name:  # a typo'd command: say which one was meant
            from ..errors import closest

            hint = closest(argv[0], list(by_name))
            if hint:
                _parser(next(iter(by_name))).error(f"unknown command {argv[0]!r}.{hint} (choose from {', '.join(by_name)})")
        ns = _parser(argv[0] if argv and argv[0] in by_name else None).parse_args(argv)
        ns.argv = argv
        name, run = ns.command, lambda: _module(by_name[ns.command]).run(_refuse_empty_values(ns))
    stdout, stderr = sys.stdout, sys.stderr
    _reopen_closed_descriptors()
    _OUTPUT_FAILED.clear()
    if sys.stderr is None:
        sys.stderr = _devnull_stream()
    from ..errors import ScrubbingStream

    if not isinstance(sys.stderr, ScrubbingStream):  # main() wrapped it already
        sys.stderr = ScrubbingStream(sys.stderr)  # error lines and notes: a token in -k or a URL password never in clear
    # audit's output is pytest's terminal, scrubbed line by line by the plugin; a reader that goes away
    # (`packcheck audit ... | head -2`) must not abandon the run: the matrix is still written
    sys.stdout = _PipeSafe(stdout) if name == "audit" else _Scrubbed(stdout)
    try:
        code = _run(name, run)
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    if _OUTPUT_FAILED:
        # said once, on stderr: the work is done and the reports written; only the terminal output was lost. An audit
        # exits as its verdicts say (its matrix is its result); another command's answer never reached its reader: 74
        try:
            print(f"packcheck {name}: standard output could not be written ({_OUTPUT_FAILED[0]}): the rest of the output "
                  "was dropped" + ("; the reports were written as usual." if name == "audit" else "."), file=sys.stderr or sys.__stderr__)
        except (OSError, AttributeError, ValueError):
            pass
        if name != "audit" and code == 0:
            return 74
    return code


def _refuse_empty_values(ns: argparse.Namespace) -> argparse.Namespace:
    """``ns`` once no flag or argument of its command holds an empty value (``--summary ''``, what
    ``--summary "$GITHUB_STEP_SUMMARY"`` gives with the variable unset, was taken as "no summary" in silence):
    one rule for every command, :func:`~pytest_packcheck.errors.refuse_empty`'s (the docs: an empty value is
    never the default).

    Raises:
        PackcheckUsageError: naming the flag (its long form) or the argument and the empty value.
    """
    from ..errors import PackcheckUsageError, has_control_character, refuse_empty

    parser = vars(ns).pop("_empty_check", None)
    for action in getattr(parser, "_actions", []):
        value = getattr(ns, action.dest, None)
        name = max(action.option_strings, key=len) if action.option_strings else (action.metavar or action.dest.upper())
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item != action.default:
                refuse_empty(item, str(name), positional=not action.option_strings or action.required)
                if action.dest in _WRITTEN_PATHS and has_control_character(item):
                    raise PackcheckUsageError(
                        f"{name} {item!r} holds a control character (a newline, tab, ...): it would make a file or "
                        "folder no one can type; give its name on one line.")
                if not action.option_strings and has_control_character(item):  # lookup $'lla\nma' printed 2 lines
                    raise PackcheckUsageError(
                        f"{name} {item!r} holds a control character (a newline, tab, ...): no model type, backend, "
                        "version, cell or path has one; give it on one line.")
    return ns


#: the destinations of the flags that name a file or folder a command writes (merge / bisect / atlas / bench -o,
#: claims --output and --download-dir, atlas --build-dir, gate --bisect-output-dir, --summary, bench --name): a
#: control character there made ``m7/\nx`` and split the "merged into" line (hostile trial 5), as
#: --packcheck-report-dir refuses (config.settings)
_WRITTEN_PATHS = frozenset({"output_dir", "output", "build_dir", "bisect_output_dir", "download_dir", "summary", "name"})


def _run(name: str, run: Any) -> int:
    """``run()`` with packcheck's exits: a usage error is one line and 2, a closed pipe 141 (:data:`EXIT_CODES`)."""
    from ..errors import PackcheckUsageError

    try:
        code = run()
        sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at interpreter exit
        return code
    except KeyboardInterrupt:  # Ctrl-C outside a pytest session (gate, merge, lookup, audit's start): 128 + SIGINT
        print(f"\npackcheck {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `packcheck lookup ... | head -2`: the reader closed the pipe; exit 128 + SIGPIPE
        _fd_to_devnull(sys.stdout)
        return 141
    except PackcheckUsageError as exc:
        print(f"packcheck {name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the file system refuses (a name over 255 bytes): one line, exit 2
        from ..errors import path_failure_message

        if not path_failure_message(exc):
            raise
        print(f"packcheck {name}: error: {path_failure_message(exc)}", file=sys.stderr)
        return 2
    except (ImportError, MemoryError) as exc:  # torch cannot load (ulimit -v): one line, not a traceback
        from ..errors import load_failure_message

        print(f"packcheck {name}: error: {load_failure_message(exc)}", file=sys.stderr)
        return 2
