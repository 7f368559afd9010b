"""``packcheck ARGS`` run in the test's own process (issue 47, the suite): the CLI's words and exit code without a
fresh Python that imports torch and transformers again (seconds of CPU per call, up to a minute of wall under load).

For tests about what the CLI says and returns. A test about a real process boundary (a signal, a killed child's exit
status, what a fresh interpreter imports, a closed or full terminal, HF_HOME / offline behaviour read at import)
keeps its subprocess.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

#: Python's default warning filters (``python -W`` unset, the console script's): what a subprocess would print
_PYTHON_DEFAULT_FILTERS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                           ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, ""))


@contextlib.contextmanager
def _loggers_to(stream: io.StringIO):
    """Every logging StreamHandler bound to the process's standard error (transformers' own handler binds it when
    made) writes to ``stream`` meanwhile, as in a subprocess its lines would reach the captured stderr."""
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                for h in getattr(lg, "handlers", []) if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__)]
    old = [h.setStream(stream) for h in handlers]
    try:
        yield
    finally:
        for h, s in zip(handlers, old):
            h.setStream(s)


def packcheck(*args: str | Path, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``packcheck ARGS``: ``pytest_packcheck.cli.main(args)`` with ``cwd`` as the working folder and ``env`` as the whole environment
    (both restored after, and any variable the command set), its standard output and error captured: a
    ``CompletedProcess`` as ``subprocess.run(..., capture_output=True, text=True)`` gives for
    ``python -m pytest_packcheck.cli ARGS``. Warnings are printed on its stderr as Python's default filters print them,
    and log lines bound for stderr land there too, so a test of "one line, nothing else" still sees them. An argparse
    refusal (``SystemExit``) is its exit code, as the console script's; any other exception propagates (a traceback
    the subprocess would have printed fails the test here)."""
    from pytest_packcheck.cli import main

    return _in_process(main, "packcheck", [str(a) for a in args], cwd, env)


def pytest_run(*args: str | Path, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` as :func:`packcheck` runs the CLI: ``pytest.main(args)`` in this process (the
    packcheck plugin loads from its entry point, as in a fresh pytest), its exit code as an int. For tests of what
    the plugin says and writes; none that needs a conftest of its own (it would meet this suite's ``conftest``)."""
    import pytest

    return _in_process(lambda argv: int(pytest.main(argv)), "pytest", [str(a) for a in args], cwd, env)


def _in_process(main, name: str, argv: list[str], cwd: str | Path | None, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    try:
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _loggers_to(err), \
                warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()
            for action, category, module in reversed(_PYTHON_DEFAULT_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: usage line + exit 2; --help / --version: 0
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            for w in seen:
                err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        os.chdir(old_cwd)
        if os.environ != old_env:  # ``env``, or a variable the command set for its children
            os.environ.clear()
            os.environ.update(old_env)
    return subprocess.CompletedProcess([name, *argv], code, out.getvalue(), err.getvalue())
