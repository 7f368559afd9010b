"""pytest hooks, options and registration only; the work happens in :mod:`pytest_packcheck.run.session`.

Importing this module imports neither torch nor transformers: pytest loads every installed plugin on every
run, also in projects that never use packcheck.

Items are made in ``pytest_collection_modifyitems`` rather than by ``pytest_generate_tests``: packcheck runs
in directories that hold no test file of the user's, so there is no test function to parametrize.
"""

from __future__ import annotations

from typing import Any

import pytest

from .config.options import OPTIONS

_SESSION_KEY = pytest.StashKey["Any"]()
_OFF_KEY = pytest.StashKey["str | None"]()  # packcheck off though its options were given (settings.off_without_models)
#: The names this module is registered under: pyproject's ``pytest11`` entry point and its module path (``-p
#: pytest_packcheck.plugin``, ``pytest_plugins = [...]``). pluggy refuses one module under two names.
ENTRY_POINT = "packcheck"
PLUGIN_NAMES = (ENTRY_POINT, __name__)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Called as this module is registered (pytest replays the hook for each plugin): block its other name, so
    that ``-p pytest_packcheck.plugin`` beside the installed entry point (or the reverse order, through
    ``pytest_plugins``) is one plugin instead of pytest's "Plugin already registered under a different name"."""
    import sys

    here = pluginmanager.get_name(sys.modules[__name__])
    if here in PLUGIN_NAMES:
        for name in PLUGIN_NAMES:
            if name != here and not pluginmanager.is_blocked(name) and pluginmanager.get_plugin(name) is None:
                pluginmanager.set_blocked(name)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("packcheck", "packcheck: padding-free packing checks")
    for opt in OPTIONS:
        kwargs: dict[str, Any] = {"dest": opt.dest, "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
            if opt.action == "store_true":
                kwargs["default"] = False
        group.addoption(opt.flag, **kwargs)
        if opt.ini:
            parser.addini(opt.ini, opt.help)


def pytest_configure(config: pytest.Config) -> None:
    """Resolve the settings, open the session (its journal) and resolve the model specs. The PackcheckWarnings
    this raises are handed to pytest's ``pytest_warning_recorded`` hook (``when="config"``, as
    ``config.issue_config_time_warning`` does), without a source line: pytest wraps no warning capture around
    pytest_configure, so Python printed them at once with a line of packcheck's own source under each, which
    read like a traceback (trial 21, 157); now pytest's warnings summary lists each message on its own."""
    import warnings

    from .errors import PackcheckWarning

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PackcheckWarning)
            _configure(config)
    finally:  # a usage error still shows the warnings raised before it
        for w in caught:
            if issubclass(w.category, PackcheckWarning):
                if hasattr(config, "workerinput"):  # xdist forwards a worker's: the controller's copy is the one shown
                    continue
                quiet = warnings.WarningMessage(w.message, w.category, w.filename, w.lineno, line="")  # no source echo
                config.hook.pytest_warning_recorded.call_historic(kwargs={
                    "warning_message": quiet, "when": "config", "nodeid": "", "location": (w.filename, w.lineno, "pytest_configure")})
            else:  # another library's warning: as it would have shown
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _configure(config: pytest.Config) -> None:
    from .config.settings import resolve
    from .errors import PackcheckUsageError

    state = None
    try:
        settings = resolve(lambda dest: config.getoption(dest), lambda key: config.getini(key))
        if settings is None:
            from .config.settings import off_without_models

            config.stash[_OFF_KEY] = off_without_models(lambda dest: config.getoption(dest))
            return
        from .run.session import PackcheckSession

        state = PackcheckSession(config, settings)
        # Resolve the model specs now (config.json only), on the xdist controller too, so that a bad spec is
        # one usage error before any worker starts, not an empty run.
        state.resolved_models()
        config.stash[_SESSION_KEY] = state
        config.pluginmanager.register(_ResultRecorder(state), "packcheck-results")
    except (PackcheckUsageError, ImportError, MemoryError, OSError) as exc:
        from .errors import load_failure_message, path_failure_message

        if isinstance(exc, OSError) and not path_failure_message(exc):
            raise
        if state is not None:
            state.release()
        raise pytest.UsageError(load_failure_message(exc) or path_failure_message(exc) or str(exc)) from None


def _state(config: pytest.Config) -> Any:
    return config.stash.get(_SESSION_KEY, None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    if state is None:
        return
    from .errors import PackcheckUsageError

    try:
        cells = state.make_items(session)
    except PackcheckUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    items[:0] = cells
    # Tell reporters (the "collected N items" line) about the items made here.
    config.hook.pytest_collectreport(report=pytest.CollectReport("packcheck", "passed", None, cells))


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Cells ``-k`` / ``-m`` left out: recorded in the results' settings (``deselected``), so a gate against a full
    baseline does not count them as missing regressions (issue 42)."""
    if not items:
        return
    state = _state(items[0].config)
    if state is None:
        return
    state.deselected.update(item.cell.cell_id for item in items if hasattr(item, "cell"))


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """While packcheck is on, every line pytest's terminal writes is scrubbed (:class:`errors.ScrubbingStream`): a
    token in ``-k`` or in a model spec, an index URL's password, in pytest's own lines as in packcheck's."""
    if _state(session.config) is None:
        return
    from .errors import ScrubbingStream

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    writer = getattr(reporter, "_tw", None)
    if writer is not None and hasattr(writer, "_file") and not isinstance(writer._file, ScrubbingStream):
        writer._file = ScrubbingStream(writer._file)


def _error_line(config: pytest.Config, text: str) -> None:
    """``text`` on a line of its own, in red: after pytest's progress ("....[100%]") a new line first (trial 21, 161:
    "[100%]packcheck: error: Nothing compared ...")."""
    tw = config.get_terminal_writer()
    if getattr(tw, "width_of_current_line", 0):
        tw.line()
    tw.line(text, red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    state = _state(session.config)
    if state is None or hasattr(session.config, "workerinput"):
        return
    _scrub_interrupt_line(session.config)
    from .errors import PackcheckUsageError

    try:
        # -x / --maxfail sets shouldfail (xdist's controller shouldstop): cells never run, as after Ctrl-C
        stopped = session.shouldstop or session.shouldfail
        state.finish(interrupted=session.exitstatus == pytest.ExitCode.INTERRUPTED or bool(stopped),
                     reason=f"the run stopped early ({stopped})" if isinstance(stopped, str) and stopped else None)
    except PackcheckUsageError as exc:  # e.g. the report path became a directory: one line, not a traceback
        _error_line(session.config, f"packcheck: error: {exc}")
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    except Exception as exc:  # noqa: BLE001 - never leave the previous run's matrix looking current
        line = state.discard_stale_matrix(exc)
        _error_line(session.config, f"packcheck: error: {line}")
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
        return
    if state.regressions:
        # the gate fails the session after the matrix is written; the summary below prints why
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
    """Before pytest's terminal formats the Ctrl-C / SIGTERM traceback: drop the entries without a line number
    (:func:`drop_lineless_entries`). A signal that lands on an instruction without one (CPython 3.11+) gave pytest's
    formatter ``TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'``: a traceback, exit 1 and a
    matrix not marked incomplete instead of exit 130 (trial 8, 110)."""
    drop_lineless_entries(excinfo.tb)
    return (yield)


def drop_lineless_entries(tb: Any) -> None:
    """Unlink, in place, the entries after ``tb`` (a traceback chain) whose ``tb_lineno`` is None."""
    while tb is not None and tb.tb_next is not None:
        if tb.tb_next.tb_lineno is None:
            tb.tb_next = tb.tb_next.tb_next
        else:
            tb = tb.tb_next


def _scrub_interrupt_line(config: pytest.Config) -> None:
    """The "path:line: KeyboardInterrupt" line pytest's terminal prints after a Ctrl-C (its reporter keeps it
    until after this hook): the home directory there becomes ``~`` and a secret ``***``, as on every other line
    (trial 7, 50). ``--full-trace`` prints the whole traceback as asked, unchanged."""
    from .results.io import scrub

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    crash = getattr(getattr(reporter, "_keyboardinterrupt_memo", None), "reprcrash", None)
    if crash is not None and isinstance(getattr(crash, "path", None), str):
        crash.path, crash.message = scrub(crash.path), scrub(str(crash.message))


def pytest_unconfigure(config: pytest.Config) -> None:
    state = _state(config)
    if state is not None:
        _after_pytests_count(config, state.document)
        state.release()


def _after_pytests_count(config: pytest.Config, document: dict[str, Any] | None) -> None:
    """One line under pytest's own last line ("no tests ran in 8.25s") when an interrupted run's matrix holds cells
    that pytest never counted (finished in this run's forked child, journaled, but never reported to pytest before
    the interrupt), so the last word on the terminal is not a count that contradicts the matrix (trial 8, 52). Cells a
    --packcheck-resume reuses are pytest items that pass from the journal: pytest counts them (trial 12, 61)."""
    if not document:
        return
    journal = (document.get("incomplete") or {}).get("journal") or {}
    uncounted = journal.get("this") if isinstance(journal.get("this"), int) else 0
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if uncounted and reporter is not None:
        from .report.verdicts import not_run

        cells = sum(1 for c in document.get("cells") or [] if not not_run(c))
        # "finished in this run": not the cells a --packcheck-resume took from an earlier run's journal, which pytest
        # counts (trial 21, 50: "4 of them came from the journal" beside "17 of 75 cells were taken from the journal")
        reporter.write_line(f"packcheck: the matrix holds {cells} measured cell(s); {uncounted} of them came from the journal, "
                            "finished in this run but not reported to pytest before the interrupt, so pytest's count above "
                            "leaves them out (see the packcheck summary)")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = _state(config)
    if state is None and config.stash.get(_OFF_KEY, None):
        terminalreporter.write_line(config.stash[_OFF_KEY], yellow=True)
    if state is None or state.document is None:
        return
    from .errors import scrub_secrets
    from .report.formats import render_terminal

    terminalreporter.write_sep("=", "packcheck summary")
    for line in render_terminal(state.document, state.written):
        terminalreporter.write_line(scrub_secrets(line))  # as scrubbed as the report files
    for line in state.notes:
        terminalreporter.write_line(scrub_secrets(line))
    if state.settings.baseline and state.gate_refused is None:  # a refused comparison: its error line is the gate's
        terminalreporter.write_sep("=", f"packcheck gate against {state.settings.baseline}")
        terminalreporter.write_line(state.gate_text)
        terminalreporter.write_line(f"{len(state.regressions)} regression(s), {len(state.changes)} changed cell(s)")


@pytest.fixture
def packcheck_verify(request: pytest.FixtureRequest) -> Any:
    """Check a packed batch of your own on your own model (:func:`pytest_packcheck.guard.verify_packed_batch`,
    raising :class:`~pytest_packcheck.guard.PackedBatchMismatch` with the one-line diagnosis on a mismatch).

    Plain: ``def test_packing(packcheck_verify): packcheck_verify(model, collator(features))``. Parametrized
    (``indirect=True``) with ``(model, batch)`` or ``{"model": ..., "batch": ..., **options}`` (callables are
    called first, so models can be built lazily): the fixture runs the check and returns the result.
    """
    __tracebackhide__ = _hide_mismatch
    from .errors import PackcheckUsageError

    param = getattr(request, "param", None)
    if param is None:
        return _verify_in_test
    try:
        model, batch, options = _fixture_param(param)
        return _verify(model, batch, **options)
    except PackcheckUsageError as exc:  # the test's parametrization is wrong: one line, no traceback into packcheck
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)


def _hide_mismatch(excinfo: Any) -> bool:
    """``__tracebackhide__`` of the fixture's frames: :func:`~pytest_packcheck.guard.result.hide_mismatch_frames`
    (the guard is imported by the time a test failed through it)."""
    from .guard.result import hide_mismatch_frames

    return hide_mismatch_frames(excinfo)


def _verify_in_test(model: Any, batch: Any, **options: Any) -> Any:
    """:func:`_verify` called from the user's test: a batch or option it refuses fails the test with the one-line
    usage error, as the parametrized form does, not a traceback through packcheck's batch parsing."""
    __tracebackhide__ = _hide_mismatch
    from .errors import PackcheckUsageError

    try:
        return _verify(model, batch, **options)
    except PackcheckUsageError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    pytest.fail(refused, pytrace=False)  # outside the except: no "During handling of the above exception"


def _verify(model: Any, batch: Any, **options: Any) -> Any:
    """:func:`~pytest_packcheck.guard.verify_packed_batch` raising on a mismatch; an option it does not take is a
    usage error naming it and the ones it takes.

    Raises:
        PackcheckUsageError: an unknown option (and whatever verify_packed_batch refuses).
    """
    __tracebackhide__ = _hide_mismatch
    import inspect

    from .errors import PackcheckUsageError
    from .guard import verify_packed_batch

    taken = [n for n, p in inspect.signature(verify_packed_batch).parameters.items() if p.kind == p.KEYWORD_ONLY]
    unknown = [k for k in options if k not in taken]
    if unknown:
        raise PackcheckUsageError(f"packcheck_verify: unknown option {unknown[0]!r}: it takes {', '.join(taken)} "
                                  "(verify_packed_batch's keyword arguments).")
    options.setdefault("on_mismatch", "raise")
    return verify_packed_batch(model, batch, **options)


def _fixture_param(param: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, batch, options)`` from the fixture's indirect parameter: ``(model, batch)`` or ``{"model": ...,
    "batch": ..., **options}``; a model or batch that is a callable (not a module) is called first.

    Raises:
        PackcheckUsageError: any other parameter (a callable, a string, a tuple of another length, a dict without
            "model" or "batch"), naming what it is and the two accepted forms.
    """
    from .errors import PackcheckUsageError

    forms = ("pass (model, batch) or {'model': ..., 'batch': ..., **options} (a model or batch may be a callable "
             "that builds it)")
    if isinstance(param, dict):
        missing = [k for k in ("model", "batch") if k not in param]
        if missing:
            raise PackcheckUsageError(f"packcheck_verify's parameter has no {missing[0]!r} key (keys: "
                                      f"{', '.join(map(repr, param)) or 'none'}): {forms}.")
        spec = dict(param)
    elif isinstance(param, list | tuple) and len(param) == 2:
        spec = {"model": param[0], "batch": param[1]}
    else:
        what = f"a {len(param)}-item {type(param).__name__}" if isinstance(param, list | tuple) else f"a {type(param).__name__}"
        raise PackcheckUsageError(f"packcheck_verify's parameter is {what} ({param!r:.60}): {forms}.")
    model, batch = (v() if callable(v) and not hasattr(v, "forward") else v for v in (spec.pop("model"), spec.pop("batch")))
    return model, batch, spec


class _ResultRecorder:
    """Gathers the cell results from every test report; on the xdist controller these include the workers'."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.state.progress.started(nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # the result travels scrubbed (run.sandbox.result_json: every string but the cell id, which the controller
        # matches with its plan), so what later hooks write from the report (--junitxml's <property>, other plugins'
        # logs) carries no token, as no report file does
        self.state.record(report)
        self.state.progress.finished(report)
