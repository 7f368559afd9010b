"""The sandbox a model's cells run in: a forked child per model, with crash isolation and per-cell timeouts.

A model's cells run in a forked child process (``fork`` copies the already-imported torch and transformers, so
a child costs milliseconds, not an interpreter start). The child sends each cell's result through a pipe as
soon as it has it; the parent appends it to the journal at once. When the child dies (abort, segfault, an
OOM kill) the cell it was running becomes an ``error`` cell with the signal and the last lines of the child's
output; when no result arrives within the timeout the child is killed and that cell is a ``timeout`` cell.
Either way a new child takes the remaining cells: one broken cell never costs the others. A child stopped by an
interrupt (SIGINT, SIGTERM or SIGHUP: a ``kill`` of the busy process seen in ``top``) did not crash: the cell it was
running and the rest of its cells are "not run (interrupted)", named by the signal, left out of the journal so
``--packcheck-resume`` runs them, and the run goes on with the other models. The parent hands each result to
``on_result`` (the session appends it to the journal, :mod:`.journal`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..config.options import OPT_TIMEOUT, default_of
from .process import STOP_SIGNALS

#: The signals that stop a cell child without its model having crashed: Ctrl-C, ``kill`` / CI limits, a closed
#: terminal. A child stopped by one exits ``INTERRUPT_EXIT_BASE + signum`` (the shell's code for it, from
#: :func:`_child_main`) or dies by it; either way its cells are not run, never a crash (:func:`interrupt_signal`).
#: SIGKILL, SIGSEGV, SIGABRT (an OOM kill, a segfault, an abort) stay crashes.
INTERRUPT_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)
INTERRUPT_EXIT_BASE = 128

#: Default seconds a single cell may run (model build included) before its child is killed: --packcheck-timeout's.
DEFAULT_TIMEOUT_S: float = default_of(OPT_TIMEOUT)


class _HeldStopSignals:
    """SIGINT and SIGTERM held while a cell child is forked, then delivered.

    A stop signal that lands while ``os.fork`` runs its at-fork handlers (logging's ``_releaseLock``, say) raised
    KeyboardInterrupt inside the handler, where CPython only prints it as unraisable: the run went on and exited
    0 with a complete-looking matrix (trial 6, #102). A signal mask cannot hold it: the kernel hands a
    process-directed signal to any thread that does not block it (torch's OpenMP team, execnet's IO thread) and
    CPython still runs the Python handler in the main thread, wherever it is. So for the fork the Python handlers
    only record the signal (:meth:`restore` puts the previous ones back), and :meth:`deliver` then calls the
    previous handler (default_int_handler raises KeyboardInterrupt), after the fork has returned. Outside the main
    thread (where handlers cannot be set) nothing is held."""

    def __init__(self) -> None:
        import threading

        self.caught: list[int] = []
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._record)
        self._held = dict(self.previous)

    def _record(self, signum: int, frame: Any) -> None:
        self.caught.append(signum)

    def restore(self) -> None:
        """Put the previous handlers back (in the parent after the fork, first thing in the child)."""
        for sig, handler in self._held.items():
            signal.signal(sig, handler)
        self._held = {}

    def deliver(self) -> None:
        """Act on a stop signal that came while held, as its previous handler would have."""
        for signum in dict.fromkeys(self.caught):
            handler = self.previous.get(signum)
            if callable(handler):
                handler(signum, None)  # default_int_handler / stop_on_sigterm's: KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


#: The interrupt signal that stopped this (child) process, set by :func:`_child_interrupted`.
_CHILD_STOPPED_BY: list[int] = []


def _child_interrupted(signum: int, frame: Any) -> None:
    """In a cell child: the first interrupt signal is recorded and raises KeyboardInterrupt (the child then exits
    ``INTERRUPT_EXIT_BASE + signum``); later ones are ignored, the child is already stopping."""
    if not _CHILD_STOPPED_BY:
        _CHILD_STOPPED_BY.append(signum)
        raise KeyboardInterrupt(f"signal {signum} ({signal.Signals(signum).name})")


def _trap_interrupts() -> None:
    """In a cell child: :data:`INTERRUPT_SIGNALS` go to :func:`_child_interrupted`, except one this process ignores
    (``nohup``'s SIGHUP, a background job's SIGINT), which stays ignored."""
    for sig in INTERRUPT_SIGNALS:
        try:
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, _child_interrupted)
        except (ValueError, OSError):  # not the main thread: the parent's handlers stay
            pass


def interrupt_signal(exitcode: int | None) -> signal.Signals | None:
    """The interrupt signal (of :data:`INTERRUPT_SIGNALS`) that ended a cell child with ``exitcode``
    (``multiprocessing``'s: ``-N`` killed by signal N; ``INTERRUPT_EXIT_BASE + N`` its own exit after
    KeyboardInterrupt, :func:`_child_main`); None for any other end (a crash, an abort, SIGKILL / an OOM kill)."""
    if exitcode is None or exitcode == 0:
        return None
    signum = -exitcode if exitcode < 0 else exitcode - INTERRUPT_EXIT_BASE
    return signal.Signals(signum) if signum in INTERRUPT_SIGNALS else None


def _child_main(cells: list[Any], run_cell: Callable[[Any], Any], conn: Any, log_path: str,
                held: _HeldStopSignals | None = None, threads: int | None = None, reuse: bool = False) -> None:
    """In the forked child: route stdout/stderr to the log, run the cells (on ``threads`` torch intra-op threads
    when given), send each result, exit hard: 0 when every cell was sent, ``INTERRUPT_EXIT_BASE + N`` when signal N
    of :data:`INTERRUPT_SIGNALS` (or a KeyboardInterrupt: SIGINT) stopped it, 70 when anything else escaped the
    runner. ``reuse`` (:class:`SideBySide`): then wait on ``conn`` for the next group's cells and run them the same
    way (the log emptied first, so a crash names this group's output), until None comes (or the pipe closes)."""
    _die_with_parent()
    if threads and "torch" in sys.modules:  # before any torch op here (SideBySide: the parent's OpenMP team)
        sys.modules["torch"].set_num_threads(threads)
    if held is not None:
        held.restore()
    _trap_interrupts()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        for signum in dict.fromkeys(held.caught if held is not None else ()):
            # a stop signal this child got before its handlers were back: acted on as the child's own
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, None)
        from ..results.io import scrub_json

        for cell in cells:
            conn.send(scrub_json(run_cell(cell).to_json()))  # scrubbed once, here: result_json
        while reuse:
            try:
                more = conn.recv()
            except EOFError:
                break
            if more is None:
                break
            os.ftruncate(1, 0)  # the log holds this group's output alone (O_APPEND: writes go on from 0)
            for cell in more:
                conn.send(scrub_json(run_cell(cell).to_json()))
    except KeyboardInterrupt:  # an interrupt, not a crash: the parent reads the signal from the exit code
        signum = _CHILD_STOPPED_BY[0] if _CHILD_STOPPED_BY else signal.SIGINT
        print(f"packcheck: cell child stopped by {signal.Signals(signum).name}", file=sys.stderr)
        code = INTERRUPT_EXIT_BASE + signum
    except BaseException:  # noqa: BLE001 - anything escaping the runner: report through the exit code
        import traceback

        traceback.print_exc()
        code = 70
    finally:
        try:
            conn.close()
            os.fsync(1)
        except OSError:
            pass
        os._exit(code)  # no atexit handlers, no pytest teardown in the child


def _die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this child when its parent dies (a killed audit leaves no orphan)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _reap(proc: Any, kill: bool = False) -> None:
    """Join a cell child: within 5 s, else killed (``kill``: killed at once), then joined."""
    if proc.is_alive():
        if kill:
            proc.kill()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _tail(path: str, lines: int = 5) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-600:]


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


_WARM = False


def warm_up(tolerances: dict[str, float], device: str, backends: Iterable[str] = ("sdpa",),
            check_names: Iterable[str] = ()) -> None:
    """Once per process, before the first fork, on CPU only: run a tiny llama through the collator, packed and
    padded forwards and a backward on each CPU backend of the run, calling the check functions directly (not
    through the registry); TRL's collator too when ``check_names`` holds collate_trl. Lazy imports and torch's
    first-call setup (flex_attention's above all) then happen once here instead of in every child. On CUDA nothing is done: CUDA must not be initialised before
    a fork.
    """
    global _WARM
    if _WARM or not device.startswith("cpu"):
        return
    _WARM = True
    warm_trl = "collate_trl" in check_names
    try:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from .. import checks
        from ..backends import (
            CPU_BACKENDS,
            backend_build,
            ensure_registered,
            prepare_backend_model,
        )
        from .runner import _no_compile_on_cpu
    except Exception:  # noqa: BLE001 - warming up is an optimisation; the cells report real problems
        return
    for name in check_names:  # every check module of the run imported here, once, not in each forked child
        spec = checks.registry.SPECS.get(name)
        if spec is not None:
            with contextlib.suppress(Exception):
                spec.load()
    # One intra-op thread: torch then starts no OpenMP thread team in this process; a child forked after a
    # team exists can deadlock in its first parallel region (libgomp is not fork-safe).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for backend in backends:
            if backend not in CPU_BACKENDS:
                continue
            try:
                ensure_registered(backend)
                config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=128, use_cache=False)
                torch.manual_seed(0)
                with backend_build(backend, config) as attn_implementation:
                    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
                model = prepare_backend_model(model, backend)
                bench = checks.Workbench(model=model, config=model.config, backend=backend, dtype="float32", tol=tolerances)
                with _no_compile_on_cpu(backend, device):
                    checks.check_logits_parity(bench)
                    checks.check_backend(bench)
                    if backend != "flex_attention":
                        checks.check_grad_parity(bench)
                    if warm_trl:
                        checks.check_collate_trl(bench)  # imports TRL (seconds) once here, not in every forked child
            except Exception:  # noqa: BLE001, S112 - as above
                continue
    finally:
        torch.set_num_threads(threads)


def result_json(result: Any) -> str:
    """``result.to_json()`` with its secrets scrubbed (:func:`~pytest_packcheck.results.io.scrub_json`: every string
    but the cell id): for a result a cell child sent, the JSON it sent, scrubbed there, neither encoded nor scrubbed
    again (issue 47: a CellResult's to_json took 0.4 ms, twice per cell in the parent, and its scrub three times);
    for any other (a crash or a timeout the parent wrote, a cell run in this process) made here. What the journal, the
    pytest report's property and the controller read."""
    wire = getattr(result, "_wire_json", None)
    if isinstance(wire, str):
        return wire
    from ..results.io import scrub_json

    return scrub_json(result.to_json())


def from_child(result: Any) -> bool:
    """Whether ``result`` is one a cell child sent (its text, and so its message, already scrubbed: :func:`result_json`)."""
    return isinstance(getattr(result, "_wire_json", None), str)


def run_isolated(
    cells: list[Any],
    run_cell: Callable[[Any], Any],
    make_failure: Callable[[Any, str, str, dict[str, Any]], Any],
    on_result: Callable[[Any], None],
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    child_threads: int | None = None,
) -> dict[str, Any]:
    """Run ``cells`` (in order) in forked children; return cell_id -> result.

    ``run_cell(cell)`` runs in the child and returns an object with ``to_json()``; the parent turns each JSON
    back with ``CellResult.from_dict`` and calls ``on_result`` at once (the journal). ``make_failure(cell,
    status, message, metrics)`` builds the result of a cell whose child crashed ("error") or hung ("timeout"); its
    ``duration_s`` is then set here, the wall seconds until the crash or the kill.
    ``timeout_s`` None or 0: no limit. A child stopped by an interrupt (:func:`interrupt_signal`) leaves its cells
    as ``make_failure(cell, "skipped", ...)`` with ``metrics.not_run`` "interrupted" and ``metrics.signal``
    (returned, not handed to ``on_result``: they did not finish, so the journal does not hold them).
    ``child_threads``: the child's torch intra-op threads (:class:`SideBySide`). One group of
    :class:`SideBySide`, one child at a time.
    """
    return SideBySide([("", cells)], run_cell, make_failure, on_result, timeout_s, jobs=1,
                      child_threads=child_threads).wait_for("")


class _GroupChildren:
    """One group's cells (a model's) in forked children, in order: one child runs them all; after a crash or a
    timeout a new child takes the rest (:func:`run_isolated`'s rules). Driven by :class:`SideBySide`: :meth:`start`
    forks, :meth:`step` handles what the child sent (or its silence past the timeout)."""

    def __init__(self, cells: list[Any], run_cell: Callable[[Any], Any],
                 make_failure: Callable[[Any, str, str, dict[str, Any]], Any], on_result: Callable[[Any], None],
                 timeout_s: float | None, child_threads: int | None, pool: SideBySide | None = None) -> None:
        self.pending = list(cells)
        self.results: dict[str, Any] = {}
        self.run_cell, self.make_failure, self.on_result = run_cell, make_failure, on_result
        self.timeout_s, self.child_threads = timeout_s, child_threads
        #: where an idle child comes from and goes back to (None: one child per group, reaped when it is done)
        self.pool = pool
        self.proc: Any = None
        self.reader: Any = None
        self.log_path = ""
        self.t_start = 0.0
        self.groups_run = 0  # groups the running child has taken, this one included (SideBySide.MAX_GROUPS_PER_CHILD)

    @property
    def done(self) -> bool:
        return self.proc is None and not self.pending

    def deadline(self) -> float | None:
        """perf_counter seconds by which the running cell must answer (None: no limit)."""
        return self.t_start + self.timeout_s if self.timeout_s else None

    def start(self) -> None:
        """Hand the pending cells to an idle child of the pool (:class:`SideBySide`), or fork a child for them
        (stop signals held during the fork, :class:`_HeldStopSignals`)."""
        import multiprocessing

        idle = self.pool.idle_child() if self.pool is not None else None
        while idle is not None:
            proc, conn, log_path, groups_run = idle
            try:
                conn.send(list(self.pending))
            except (OSError, EOFError, ValueError):  # it died while idle: reaped, and the next one (or a fork) takes them
                SideBySide.retire(idle, kill=True)
                idle = self.pool.idle_child() if self.pool is not None else None
                continue
            self.proc, self.reader, self.log_path, self.groups_run = proc, conn, log_path, groups_run + 1
            self.t_start = time.perf_counter()
            return
        ctx = multiprocessing.get_context("fork")
        fd, self.log_path = tempfile.mkstemp(prefix="packcheck-child-", suffix=".log")
        os.close(fd)
        reuse = self.pool is not None
        # one pipe each way for a child the pool may reuse (the parent sends it the next group's cells)
        reader, writer = ctx.Pipe(duplex=reuse)
        self.t_start = time.perf_counter()
        gc.freeze()  # the child's collector then skips the parent's objects: no copy-on-write of their pages
        held = _HeldStopSignals()
        try:
            proc = ctx.Process(target=_child_main, args=(self.pending, self.run_cell, writer, self.log_path, held,
                                                         self.child_threads, reuse), daemon=True)
            proc.start()
        finally:
            held.restore()
            writer.close()
        self.proc, self.reader, self.groups_run = proc, reader, 1
        held.deliver()  # a Ctrl-C that came during the fork is raised here; SideBySide's close() reaps the child

    def step(self) -> None:
        """Handle one message of the child (a result, or its end: a crash or an interrupt), or kill it when its cell
        is past the timeout; a new child takes the remaining cells after a crash or a timeout."""
        from ..results.schema import CellResult

        if not self.reader.poll(0):
            deadline = self.deadline()
            if deadline is None or time.perf_counter() < deadline:
                return
            self.proc.kill()
            self.proc.join()
            cell = self.pending.pop(0)
            waited = time.perf_counter() - self.t_start
            result = self.make_failure(cell, "timeout", f"no result within {self.timeout_s:g} s (--packcheck-timeout); "
                                       f"the child was killed. Last output: {_tail(self.log_path) or '(none)'}",
                                       {"timeout_s": self.timeout_s, "waited_s": round(waited, 2)})
            result.duration_s = round(waited, 4)  # until the kill, never 0.0 (trial 19, 133)
            self._finish(cell, result)
            return self._next_child()
        try:
            message = self.reader.recv()
        except (EOFError, OSError):
            self.proc.join()
            stopped = interrupt_signal(self.proc.exitcode)
            if stopped is not None:  # an interrupt (`kill` of the child), not a crash: its cells are not run
                for cell in self.pending:  # not journaled: --packcheck-resume runs them
                    self.results[cell.cell_id] = self.make_failure(cell, "skipped", (
                        f"not run: the isolated child running this model's cells was stopped by {stopped.name} "
                        f"(an interrupt, not a crash; {_signal_name(self.proc.exitcode)}) before this check; rerun "
                        "with --packcheck-resume"), {"not_run": "interrupted", "signal": stopped.name,
                                                     "exitcode": self.proc.exitcode})
                self.pending.clear()
                return self._next_child()
            cell = self.pending.pop(0)
            how = _signal_name(self.proc.exitcode)
            if self.proc.exitcode == -signal.SIGKILL:  # from outside: the OOM killer or `kill -9`, not the model
                result = self.make_failure(cell, "error", (
                    f"the isolated child running this cell was killed from outside ({how}: the kernel's OOM "
                    "killer or a `kill -9`), not a crash of the model: nothing was judged; --packcheck-resume "
                    f"runs it again. Last output: {_tail(self.log_path) or '(none)'}"),
                    {"exitcode": self.proc.exitcode, "stage": "child", "not_journaled": "killed"})
                result.cause = "killed"
                result.evidence = {"signal": "SIGKILL", "exitcode": self.proc.exitcode}
            else:
                result = self.make_failure(cell, "error", f"the isolated child crashed ({how}) running this cell. "
                                           f"Last output: {_tail(self.log_path) or '(none)'}",
                                           {"exitcode": self.proc.exitcode, "stage": "child"})
            result.duration_s = round(time.perf_counter() - self.t_start, 4)  # until the crash
            self._finish(cell, result)
            return self._next_child()
        result = CellResult.from_dict(json.loads(message))
        result._wire_json = message  # type: ignore[attr-defined]  # its to_json(), scrubbed by the child: result_json
        cell = self.pending.pop(0)
        if result.cell_id != cell.cell_id:  # a programming error, not a model problem: say so loudly
            raise RuntimeError(f"isolated child answered {result.cell_id} for {cell.cell_id}")
        self._finish(cell, result)
        self.t_start = time.perf_counter()
        if not self.pending:
            self._release()

    def _finish(self, cell: Any, result: Any) -> None:
        self.results[cell.cell_id] = result
        self.on_result(result)

    def _release(self) -> None:
        """Every cell answered: the child goes back to the pool for the next group (:meth:`SideBySide.take_idle`), or
        is reaped (no pool)."""
        if self.pool is None or self.proc is None:
            return self._next_child()
        child = (self.proc, self.reader, self.log_path, self.groups_run)
        self.proc, self.reader, self.log_path = None, None, ""
        self.pool.take_idle(child)

    def _next_child(self) -> None:
        """The child is done (its cells answered) or gone: reap it; fork the next one for the cells left."""
        self.close()
        if self.pending:
            self.start()

    def close(self, kill: bool = False) -> None:
        """Reap the child (killed when it does not end within 5 s, or at once with ``kill``) and remove its log."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        proc, self.proc = self.proc, None
        if proc is not None:
            _reap(proc, kill)
        if self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self.log_path = ""


class SideBySide:
    """Groups of cells (a model's each) run in forked children, ``jobs`` of them at a time, all forked from this one
    process: torch, transformers and the resolved models are imported and made once, not once per xdist worker
    (issue 47: the default audit's three processes each imported torch and transformers, resolved the 26 models
    and warmed up; 28.3 s of CPU against 15 s in one process). Groups start in the order given; each group is
    :func:`run_isolated`'s (a crash or a timeout costs one cell, an interrupt leaves the rest not run).

    ``child_threads``: each child sets torch's intra-op threads to it before its first cell (None: inherited). A
    child forked from a process whose OpenMP thread team exists deadlocks in its first parallel region of more
    than one thread (libgomp is not fork-safe: torch 2.13.0+cpu here, a 512x512 matmul in the parent on two threads,
    then one in the child, hung every time); one thread in the child never enters the team
    (tests/test_isolation.py runs it twice after a parallel matmul in the parent).

    :meth:`wait_for` runs the children until a group is done and returns its results (cell_id -> result); the
    children of the next groups go on meanwhile. :meth:`close` reaps every child (an interrupt, a pytest -x)."""

    #: Groups one child runs before it is retired and the next group gets a fresh fork: a bound on what a long run's
    #: child accumulates (the modules and caches of the models it built).
    MAX_GROUPS_PER_CHILD = 16

    def __init__(self, groups: list[tuple[str, list[Any]]], run_cell: Callable[[Any], Any],
                 make_failure: Callable[[Any, str, str, dict[str, Any]], Any], on_result: Callable[[Any], None],
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, jobs: int = 1, child_threads: int | None = None,
                 reuse: bool = True) -> None:
        pool = self if reuse and len(groups) > 1 else None
        self.queue = [(name, _GroupChildren(cells, run_cell, make_failure, on_result, timeout_s, child_threads, pool))
                      for name, cells in groups]
        self.names = {name for name, _ in groups}
        self.jobs = max(1, int(jobs))
        self.running: dict[str, _GroupChildren] = {}
        self.finished: dict[str, dict[str, Any]] = {}
        #: children whose group is done, waiting for the next group's cells: (process, pipe, log path, groups run)
        self.idle: list[tuple[Any, Any, str, int]] = []

    def idle_child(self) -> tuple[Any, Any, str, int] | None:
        """An idle child for the next group (the one that went idle last), or None."""
        return self.idle.pop() if self.idle else None

    def take_idle(self, child: tuple[Any, Any, str, int]) -> None:
        """A child whose group is done: kept for a group still to start, else retired (also once it ran
        :data:`MAX_GROUPS_PER_CHILD` groups)."""
        waiting = any(group.pending for _, group in self.queue)
        if waiting and child[3] < self.MAX_GROUPS_PER_CHILD and child[0].is_alive():
            self.idle.append(child)
        else:
            self.retire(child)

    @staticmethod
    def retire(child: tuple[Any, Any, str, int], kill: bool = False) -> None:
        """End an idle child: told to exit (None), reaped within 5 s (else killed; ``kill``: at once), its log removed."""
        proc, conn, log_path, _ = child
        if not kill:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        with contextlib.suppress(OSError):
            conn.close()
        _reap(proc, kill)
        if log_path:
            Path(log_path).unlink(missing_ok=True)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def wait_for(self, name: str) -> dict[str, Any]:
        """Run the children until group ``name`` is done; its cell_id -> result. Raises KeyError for a group not
        given; anything raised here (KeyboardInterrupt) first reaps every child."""
        if name not in self.names:
            raise KeyError(name)
        try:
            while name not in self.finished:
                self._fill()
                self._step()
        except BaseException:
            self.close()
            raise
        return self.finished[name]

    def _fill(self) -> None:
        while self.queue and len(self.running) < self.jobs:
            name, group = self.queue.pop(0)
            self.running[name] = group
            if group.pending:
                group.start()
            self._collect()

    def _collect(self) -> None:
        for name in [n for n, g in self.running.items() if g.done]:
            self.finished[name] = self.running.pop(name).results

    def _step(self) -> None:
        from multiprocessing.connection import wait

        self._collect()
        if not self.running:
            return
        deadlines = [d for d in (g.deadline() for g in self.running.values()) if d is not None]
        timeout = max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None
        ready = wait([g.reader for g in self.running.values()], timeout)
        now = time.perf_counter()
        for group in list(self.running.values()):
            deadline = group.deadline()
            if group.reader in ready or (deadline is not None and now >= deadline):
                group.step()
        self._collect()

    def close(self, kill: bool = False) -> None:
        """Reap every running child (each within 5 s, else killed; ``kill``: killed at once, its cells abandoned: the
        run stopped without them, pytest -x)."""
        for group in self.running.values():
            group.close(kill)
        self.running.clear()
        while self.idle:
            self.retire(self.idle.pop(), kill)
