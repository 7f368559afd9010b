"""The packcheck session behind the pytest hooks: plan items, run cells, gather results, write the matrix.

The session holds the state of one pytest process and hands off: the process and machine set-up to
:mod:`.process`, the journal to :mod:`.resume`, cells in version environments to :mod:`.version_cells`, a
model's cells to the forked children of :mod:`.sandbox`, the pytest nodes to :mod:`.items` and the progress line
to :mod:`.progress`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from ..config.options import shard_holds
from ..config.settings import Settings
from ..errors import PackcheckUsageError, PackcheckWarning
from .items import RESULT_PROPERTY, PackcheckCollector, PackcheckItem
from .process import check_inputs, fork_poisoned, limit_threads, pin_worker_gpu, release_stop_signals, stop_on_sigterm
from .progress import Progress
from .resume import open_journal
from .version_cells import VersionCells


class PackcheckSession:
    """State of one pytest session (controller or xdist worker)."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        #: cell ids -k / -m deselected (the plugin's pytest_deselected): written as settings.deselected
        self.deselected: set[str] = set()
        #: the previous run's report files this run moved into ``previous/`` when it took the folder
        self.set_aside: list[str] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.written: list[str] = []
        self.document: dict[str, Any] | None = None
        self.changes: list[Any] = []
        self.regressions: list[Any] = []
        self.gate_text = ""
        # why the baseline comparison was refused (other tolerances, no common cell, a bad baseline file): then the
        # refusal is the gate's only line, never "0 regression(s)" (trial 7, 192 / 193)
        self.gate_refused: str | None = None
        self.notes: list[str] = []  # one line each, printed after the summary (what finish changed beside the reports)
        self._resolved: list[Any] | None = None
        self._runner: Any = None
        self._group_results: dict[str, dict[str, Any]] = {}
        self._pool: Any = None  # the SideBySide of this run's groups; False: one child at a time (_side_by_side)
        self._cuda_fork_verdict: bool | None = None
        self._report_lock: Any = None
        self.resumed: dict[str, Any] = {}
        self.progress = Progress(config, self._plan, journaled=self.resumed)  # the dict open_journal fills, below
        pin_worker_gpu(config, settings.device)
        stop_on_sigterm(config)
        # bad input (a model spec, a matrix the filters or the shard empty) is refused before the report folder is
        # touched: a refused run leaves it as it found it (no owner file, lock or emptied journal)
        self._shard_cells()
        self._report_lock = check_inputs(config, settings)
        self.journal, resumed = open_journal(config, settings)
        if not hasattr(config, "workerinput") and not getattr(getattr(config, "option", None), "collectonly", False):
            self.set_aside = set_aside_previous(settings.report_dir)
        self.resumed.update(resumed)  # the same dict the progress line reads
        self.version_cells = VersionCells(config, settings)

    def release(self) -> None:
        """Release the report folder and the stop signals (pytest_unconfigure)."""
        release_stop_signals()
        if self._pool:
            self._pool.close(kill=True)  # children still running (pytest -x stopped the run): killed, not left behind
        lock = self._report_lock
        if lock is not None and lock.is_locked:
            lock.release(force=True)

    def resolved_models(self) -> list[Any]:
        if self._resolved is None:
            from ..model.specs import parse_model_list

            specs = parse_model_list(list(self.settings.models), self.settings.model_source)
            self._resolved = [self._resolve(s) for s in specs]
        return self._resolved

    def _resolve(self, spec: Any) -> Any:
        from ..model.resolve import ResolvedModel, resolve_model
        from ..versions.envs import CHILD_ENV_VAR

        try:
            with _quiet_default_config() if spec.kind == "arch" else contextlib.nullcontext():
                return resolve_model(spec, self.settings.model_source, self.settings.trust_remote_code)
        except PackcheckUsageError as exc:
            if not os.environ.get(CHILD_ENV_VAR):
                raise
            # In a version environment the parent already resolved this spec with its own transformers: what
            # this version cannot resolve (an architecture it does not have yet) is a cell it cannot express.
            import transformers

            return ResolvedModel(spec=spec, config=None, model_type=spec.name if spec.kind == "arch" else "?",
                                 model_class="?", revision=None, error_status="unsupported",
                                 error=f"transformers {transformers.__version__}: {exc}")

    def runner(self) -> Any:
        if self._runner is None:
            limit_threads(self.config, tiny=self.settings.weights == "random" and self.settings.device.startswith("cpu"))
            from .runner import CellRunner

            self._runner = CellRunner(self.resolved_models(), self.settings.tolerances, self.settings.weights,
                                      lengths=self.settings.lengths, sliding_window=self.settings.sliding_window,
                                      device=self.settings.device, trust_remote_code=self.settings.trust_remote_code)
        return self._runner

    def _plan(self) -> dict[str, str]:
        """{cell id: group} of the cells this shard runs: what the progress line counts against."""
        return {c.cell_id: c.group for c in self._planned().values() if shard_holds(c.model_index, self.settings.shard)}

    def _shard_cells(self) -> list[Any]:
        """The planned cells this shard runs (whole models per shard, round-robin in audit order); resolves the
        model specs.

        Raises:
            PackcheckUsageError: a model spec that does not resolve; a matrix the filters emptied; a shard that
                holds no model (names the shards that do).
        """
        planned = list(self._planned().values())
        index, count = self.settings.shard
        cells = [c for c in planned if shard_holds(c.model_index, self.settings.shard)]
        if not planned:
            raise PackcheckUsageError("The packcheck matrix is empty after filtering: check --packcheck-attn / --packcheck-checks.")
        if not cells:  # the shard emptied it, not the filters: name the shards that hold a model
            from ..config.options import OPT_SHARD

            models = sorted({c.model_index for c in planned})
            held = sorted({m % count + 1 for m in models})
            where = f"shards 1..{held[-1]}" if held == list(range(1, held[-1] + 1)) else f"shards {', '.join(map(str, held))}"
            fix = f"use N <= {len(models)}" if count > len(models) else f"use I in {', '.join(map(str, held))}"
            raise PackcheckUsageError(f"The packcheck matrix is empty: shard {index}/{count} (from {OPT_SHARD} or $PACKCHECK_SHARD) holds no "
                                      f"model: the {len(models)} model{'s' * (len(models) != 1)} go to {where}; {fix}.")
        return cells

    def make_items(self, session: pytest.Session) -> list[pytest.Item]:
        cells = self._shard_cells()
        # One collector per group (a model, or a version environment): node ids read
        # packcheck::<group>::packcheck[<cell id>], so `--dist loadscope` keeps a group on one xdist worker.
        # (xdist's loadgroup marks no longer reach the node id under pytest 9.2: it sets Node._nodeid, which
        # pytest 9.2 no longer reads.)
        root = PackcheckCollector.from_parent(session, name="packcheck", nodeid="packcheck")
        parents: dict[str, PackcheckCollector] = {}
        items = []
        for c in cells:
            if c.group not in parents:
                parents[c.group] = PackcheckCollector.from_parent(root, name=c.group)
            items.append(PackcheckItem.from_parent(parents[c.group], name=f"packcheck[{c.cell_id}]", cell=c, session_state=self))
        self.progress.planned(items)
        return items

    def result_for(self, item: PackcheckItem) -> Any:
        """The result of one item's cell: from the journal (resume), from its version environment, from the
        forked child that runs its model's cells, or run here (--packcheck-isolation=none)."""
        from ..results.schema import CellResult

        cell = item.cell
        if cell.cell_id in self.resumed:
            return CellResult.from_dict(self.resumed[cell.cell_id])
        if cell.env:
            result = self.version_cells.result(cell, self.resolved_models())
            self.journal.append(result.to_json())
            return result
        if self.settings.sandbox == "none" or self._cuda_initialised_here():
            result = self.runner().run(cell)
            self.journal.append(result.to_json())
            return result
        group = self._group_results.get(cell.group)
        if group is None or cell.cell_id not in group:
            from .sandbox import result_json, run_isolated, warm_up

            warm_up(self.settings.tolerances.get("float32", {}), self.settings.device, self.settings.backends,
                    self.settings.checks)
            pool = self._side_by_side(item)
            if pool is not None and cell.group in pool:
                group = self._group_results.setdefault(cell.group, {})
                group.update(pool.wait_for(cell.group))
                if cell.cell_id in group:
                    return group[cell.cell_id]
            todo = [i.cell for i in item.session.items
                    if isinstance(i, PackcheckItem) and i.cell.group == cell.group and i.cell.cell_id not in self.resumed
                    and i.cell.cell_id not in (group or {})]
            if cell not in todo:
                todo.insert(0, cell)
            group = self._group_results.setdefault(cell.group, {})
            group.update(run_isolated(todo, self.runner().run, self._failure,
                                      lambda r: self.journal.append(result_json(r), scrubbed=True), self.settings.timeout_s))
        return group[cell.cell_id]

    def _side_by_side(self, item: PackcheckItem) -> Any:
        """The :class:`~.sandbox.SideBySide` of this run's model groups when ``packcheck audit`` asked for children
        side by side (:class:`ChildrenSideBySide`, more than one) on a CPU device: made at the first cell, over every
        collected cell of this process not taken from the journal, group by group in item order; None otherwise
        (one child at a time, :func:`~.sandbox.run_isolated`)."""
        if self._pool is None:
            plugin = next((p for p in self.config.pluginmanager.get_plugins() if isinstance(p, ChildrenSideBySide)), None)
            jobs = plugin.jobs if plugin is not None else 1
            if jobs <= 1 or not self.settings.device.startswith("cpu"):
                self._pool = False
                return None
            from .sandbox import SideBySide, result_json

            groups: dict[str, list[Any]] = {}
            for i in item.session.items:
                if isinstance(i, PackcheckItem) and not i.cell.env and i.cell.cell_id not in self.resumed:
                    groups.setdefault(i.cell.group, []).append(i.cell)
            # one thread in a child: shrunk random-weight models gain nothing from more (process.limit_threads), and
            # one thread never enters an OpenMP team a fork left half copied (sandbox.SideBySide: more hang). The
            # audit keeps xdist workers for pretrained weights (cli.audit._side_by_side)
            threads = 1
            self._pool = SideBySide(list(groups.items()), self.runner().run, self._failure,
                                    lambda r: self.journal.append(result_json(r), scrubbed=True), self.settings.timeout_s, jobs=jobs,
                                    child_threads=None if os.environ.get("OMP_NUM_THREADS") else threads)
        return self._pool or None

    def _cuda_initialised_here(self) -> bool:
        """True when a child forked from this process could not use CUDA (:func:`~.process.fork_poisoned`, asked
        once). The cells then run here (as with --packcheck-isolation=none), with one warning, instead of in
        children whose every cell would fail."""
        if not self.settings.device.startswith("cuda") or "torch" not in sys.modules:
            return False
        if getattr(self, "_cuda_fork_verdict", None) is None:
            self._cuda_fork_verdict = fork_poisoned()
            if self._cuda_fork_verdict:
                warnings.warn(PackcheckWarning(
                    "CUDA was initialised in the audit's controller before its cells ran, so they run in this process "
                    "(forked children cannot use CUDA): a crashing cell can stop the run; --packcheck-isolation=none says "
                    "so explicitly"))
        return self._cuda_fork_verdict

    def _failure(self, cell: Any, status: str, message: str, metrics: dict[str, Any]) -> Any:
        from ..results.schema import CellResult
        from .runner import stacked_record

        return CellResult(cell_id=cell.cell_id, model=stacked_record(self.resolved_models()[cell.model_index].record(self.settings.weights), cell.stack),
                          stack=cell.stack, backend=cell.backend, check=cell.check, dtype=cell.dtype, status=status, metrics=metrics,
                          message=message, tolerances=self.settings.tolerances.get(cell.dtype, {}))

    # results travel on reports (user_properties) so they survive xdist workers
    def record(self, report: pytest.TestReport) -> None:
        found = False
        for key, value in getattr(report, "user_properties", []):
            if key == RESULT_PROPERTY:
                data = json.loads(value)
                self.results[data["cell_id"]] = data
                found = True
        if not found and report.failed and "packcheck[" in report.nodeid:
            self._record_lost(report)

    def _record_lost(self, report: pytest.TestReport) -> None:
        """A failed report without a result: the process running the cell died (an xdist worker crash with
        --packcheck-isolation=none). The cell becomes an error cell with pytest's account of it."""
        name = report.nodeid.split("packcheck[", 1)[1]
        cell_id = name[: name.rfind("]")]
        if cell_id in self.results:
            return
        cell = self._planned().get(cell_id)
        if cell is None:
            return
        text = " ".join(str(report.longrepr).split())[-400:]
        self.results[cell_id] = json.loads(self._failure(cell, "error", f"the process running this cell died: {text}",
                                                         {"stage": "worker"}).to_json())

    def _planned(self) -> dict[str, Any]:
        """cell_id -> Cell for every cell of the run (each version environment, or this one), in run order."""
        from .runner import plan_cells

        envs = [v.label for v in self.settings.versions] or [None]
        return {c.cell_id: c for env in envs for c in plan_cells(self.resolved_models(), self.settings.backends,
                                                                  self.settings.checks, self.settings.dtypes, env,
                                                                  self.settings.stack)}

    def finish(self, interrupted: bool = False, reason: str | None = None) -> None:
        """Build the results document (diagnosed), write the reports, and compare with the baseline (the gate);
        ``interrupted``: also take the journaled cells whose reports never arrived, and mark the matrix incomplete
        (``reason``: why, default "the run was interrupted"; pytest's -x says "stopping after 1 failures")."""
        from ..report.formats import LOGS_DIR, remove_unreferenced_logs, write_reports
        from ..results.environment import environment
        from ..results.schema import CellResult, build_document

        unreported = {"earlier": 0, "this": 0}  # journaled cells pytest never reported (its counts leave them out)
        if interrupted:
            # cells that finished (journaled) but whose reports never reached this process (an xdist worker's, a
            # forked child's last) still belong in the matrix
            planned = self._planned()
            for cell_id, data in self.journal.load(warn=False).items():  # its bad lines were named at the start
                if cell_id in planned and cell_id not in self.results:
                    self.results[cell_id] = data
                    unreported["earlier" if cell_id in self.resumed else "this"] += 1
        if not self.results:
            if interrupted:
                line = self.discard_stale_matrix(RuntimeError("the run was interrupted before any cell finished"))
            else:  # nothing selected (-k / -m) or collected: no matrix of this run; none of an earlier one left as if it were
                line = self._nothing_ran()
            self.config.get_terminal_writer().line(f"packcheck: {line}", yellow=True)
            return
        # cells whose forked child was stopped by a signal (a `kill` of it, not of this process) are not run too
        finished = sum(1 for d in self.results.values() if not (d.get("metrics") or {}).get("not_run"))
        stopped = self._stopped_children()
        if interrupted:
            self._name_unrun_checks(reason)
        cells = [CellResult.from_dict(d) for d in self.results.values()]
        flags = list(self.settings.reproduce_flags())
        if self.config.option.keyword:
            flags += ["-k", self.config.option.keyword]
        command = "pytest " + " ".join(shlex.quote(f) for f in flags)
        command = os.environ.get("PACKCHECK_REPRODUCE", command)  # set by `packcheck audit` to its own argv
        from ..analysis.diagnose import diagnose_document

        self.document = diagnose_document(build_document(cells, environment(self.settings.device), self.settings.as_dict(), command))
        deselected = set(self.deselected)
        if not interrupted and (self.config.option.keyword or self.config.option.markexpr):
            # under xdist the workers deselect and this controller hears nothing: a planned cell with no result in a
            # run that was not interrupted was left out by -k / -m (a crash still reports its cell)
            deselected |= set(self._planned()) - set(self.results)
        if deselected:
            self.document["settings"]["deselected"] = sorted(deselected - set(self.results))
        reused = len(set(self.results) & set(self.resumed))
        if reused:  # said in every report: these cells' numbers are an earlier run's
            self.document["resumed"] = {"cells": reused, "of": len(self.results)}
        if interrupted or stopped:
            why = "; ".join(w for w in ((reason or "the run was interrupted") if interrupted else None, stopped) if w)
            self.document["incomplete"] = {"reason": why, "cells": finished,
                                           "resume": "rerun the same command with --packcheck-resume",
                                           # of ``cells``: taken from the journal, never reported to pytest
                                           "journal": unreported}
        self.written = write_reports(self.settings.report_dir, self.document)
        drop_previous(self.settings.report_dir)  # this run's set is whole: the one set aside at the start goes
        gone = remove_unreferenced_logs(self.settings.report_dir, self.document)
        if gone:  # printed with the summary
            self.notes.append(f"packcheck: note: removed {len(gone)} log(s) of an earlier run from "
                              f"{Path(self.settings.report_dir) / LOGS_DIR} ({', '.join(Path(g).name for g in gone)}): "
                              "this matrix does not name them.")
        if self.settings.baseline:
            from ..analysis.gate import compare, compared, missing_note, regressions, render_changes, stack
            from ..errors import PackcheckUsageError
            from ..results.schema import load_document

            try:
                baseline = load_document(self.settings.baseline, self.settings.baseline_source)
                self.changes = compare(baseline, self.document)
            except PackcheckUsageError as exc:  # the matrix is written; the gate result is the refusal alone
                self.gate_refused = str(exc)
                raise
            gone = missing_note(self.changes, "packcheck gate")
            if gone:  # printed with the summary: those cells were never compared
                self.notes.append(gone)
            self.changes = compared(self.changes)
            self.gate_text = render_changes(self.changes, stack(baseline), stack(self.document), markdown=False)
            self.regressions = regressions(self.changes)

    def _stopped_children(self) -> str | None:
        """Why cells are not run though this process was not interrupted: the forked children that a signal stopped
        (:func:`.sandbox.interrupt_signal`, their cells' ``metrics.signal``), as "the isolated child of llama was
        stopped by SIGTERM"; None when none was."""
        stops: dict[str, str] = {}
        for data in self.results.values():
            metrics = data.get("metrics") or {}
            if metrics.get("not_run") and metrics.get("signal"):
                stops.setdefault(str((data.get("model") or {}).get("label")), str(metrics["signal"]))
        if not stops:
            return None
        return "; ".join(f"the isolated child of {label} was stopped by {sig}" for label, sig in stops.items())

    def _name_unrun_checks(self, reason: str | None = None) -> None:
        """An interrupted run: every planned check of this shard (correctness, hazard and finding, backend and
        model level: as many as pytest collected) that did not run becomes a "skipped" cell whose metrics say
        ``not_run: "interrupted"``, so a cell is "not run", never a pass resting on the checks that happened to finish
        (:func:`report.verdicts.headline`), and a cell that never started is counted ("of 6" when 6 were planned),
        not missing. The matrix is marked incomplete and ``--packcheck-resume`` runs them."""
        from ..checks.registry import SPECS

        why = f"not run: {reason or 'the run was interrupted'} before this check" + (
            " (or -k / -m deselected it)" if self.config.option.keyword or self.config.option.markexpr else "")
        for cell_id, cell in self._planned().items():
            spec = SPECS.get(cell.check)
            if cell_id in self.results or spec is None:
                continue
            if shard_holds(cell.model_index, self.settings.shard):  # this shard's cells (make_items): another shard's are its own
                self.results[cell_id] = json.loads(self._failure(cell, "skipped", f"{why}; rerun with --packcheck-resume",
                                                                 {"not_run": "interrupted"}).to_json())

    def discard_stale_matrix(self, exc: BaseException) -> str:
        """The matrix of this run could not be written: remove the previous run's files, so no stale matrix
        looks current, and return the one line that says so."""
        what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return (f"the matrix could not be written ({what}){remove_report_files(self.settings.report_dir)}. The journal "
                "keeps the finished cells: rerun with --packcheck-resume.")

    def _nothing_ran(self) -> str:
        """No cell of this run was selected or collected (``-k nomatch``): the folder's owner file names this run and
        a fresh run emptied the journal, so an earlier matrix left there would be taken for this run's. Removes it
        as :meth:`discard_stale_matrix` does and returns the line that says so."""
        opt = self.config.option
        if getattr(opt, "collectonly", False):  # --collect-only ran nothing and touched nothing (issue 42)
            return ("--collect-only: no cell ran; the report folder and its journal are left as they were "
                    "(an interrupted run still resumes with --packcheck-resume).")
        given = [(flag, value) for flag, value in (("-k", opt.keyword), ("-m", opt.markexpr)) if value]
        why = " or ".join(f"{flag} {value!r}" for flag, value in given)
        broken = [f"{flag} {value!r}" for flag, value in given if not _parses(value)]
        if broken:  # pytest refused the expression (its line follows): nothing was deselected (hostile trial 5)
            why = f"{' and '.join(broken)} does not parse (pytest's error below)"
        journal = ("; the journal keeps its cells (--packcheck-resume)" if self.settings.resume
                   else f"; this run emptied the journal {self.journal.path} when it started")
        moved = (f"; the previous {' and '.join(self.set_aside)} {'was' if len(self.set_aside) == 1 else 'were'} set aside in {Path(self.settings.report_dir) / PREVIOUS_DIR} "
                 "so they are not taken for this run's" if self.set_aside else "")
        return (f"no packcheck cell ran ({('' if broken else 'deselected by ') + why if why else 'none was collected'}), so no matrix was "
                f"written{remove_report_files(self.settings.report_dir) or moved}{journal}.")


def _parses(expression: str) -> bool:
    """Whether pytest's ``-k`` / ``-m`` matcher compiles ``expression`` (its own parser; True where that private module
    is not there to ask)."""
    try:
        from _pytest.mark.expression import Expression
    except ImportError:
        return True
    try:
        Expression.compile(expression)
    except SyntaxError:
        return False
    return True


class ChildrenSideBySide:
    """A pytest plugin object ``packcheck audit`` hands to ``pytest.main``: run the cell children of ``jobs`` models
    side by side, all forked from the one pytest process (:class:`~.sandbox.SideBySide`), instead of pytest-xdist
    workers that each import torch and transformers, resolve the models and warm up (issue 47)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs


#: Where a run that takes the report folder puts the previous run's report set (issue 42: after a SIGKILL, a SIGHUP
#: or a full disk mid-run, the earlier complete set stayed there unmarked, beside the new run's journal, and read as
#: this run's). Removed once this run's own set is written; left only where a run did not finish.
PREVIOUS_DIR = "previous"


def set_aside_previous(report_dir: str) -> list[str]:
    """Move the report files of the previous run from ``report_dir`` into ``report_dir/previous/`` (replacing an
    older one there), before any cell runs; the names moved."""
    from ..report.formats import REPORT_FILES

    out = Path(report_dir)
    present = [name for name in REPORT_FILES if (out / name).is_file()]
    if not present:
        return []
    aside = out / PREVIOUS_DIR
    with contextlib.suppress(OSError):
        aside.mkdir(exist_ok=True)
        for name in REPORT_FILES:
            with contextlib.suppress(FileNotFoundError):
                (aside / name).unlink()
        for name in present:
            os.replace(out / name, aside / name)
    return present


def drop_previous(report_dir: str) -> None:
    """This run's set is written: the set-aside previous report set goes (a journal copy kept there stays, with the
    folder; the folder goes once empty)."""
    from ..report.formats import REPORT_FILES

    aside = Path(report_dir) / PREVIOUS_DIR
    for name in REPORT_FILES:
        with contextlib.suppress(OSError):
            (aside / name).unlink()
    with contextlib.suppress(OSError):
        aside.rmdir()


def remove_report_files(report_dir: str) -> str:
    """Remove the previous run's report files from ``report_dir``; the clause that names them ("" if none)."""
    out = Path(report_dir)
    removed = []
    from ..report.formats import REPORT_FILES

    for name in REPORT_FILES:
        with contextlib.suppress(OSError):
            (out / name).unlink()
            removed.append(name)
    return (f"; the previous {' and '.join(removed)} in {out} were removed so they are not taken for this run's"
            if removed else "")


@contextlib.contextmanager
def _quiet_default_config() -> Any:
    """transformers' warnings off (errors kept) while an ``arch:`` spec's default config is made: the config is the
    library's own, not the user's, and its complaints ("bos_token_id must be None or an integer within the
    vocabulary ... got 50256", starcoder2's and phi's defaults in transformers 5.24) printed before the first
    cell say nothing about packing."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
