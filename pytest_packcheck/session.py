"""The packcheck session behind the pytest hooks: plan items, run cells, gather results, write the matrix."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

from .errors import PackcheckUsageError, PackcheckWarning
from .settings import Settings

RESULT_PROPERTY = "packcheck"
#: A folder for this session (made by the controller, inherited by xdist workers) where version-environment
#: runs are shared.
RUN_DIR_VAR = "PACKCHECK_RUN_DIR"


class PackcheckItem(pytest.Item):
    """One cell of the matrix as a test item."""

    def __init__(self, *, cell: Any, session_state: PackcheckSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.state = session_state

    def runtest(self) -> None:
        result = self.state.result_for(self)
        # On the item's user_properties the result reaches every report of this item (so the xdist controller
        # and --junitxml get it as a property).
        self.user_properties.append((RESULT_PROPERTY, result.to_json()))
        from .errors import scrub_secrets

        message = scrub_secrets(result.message)  # the terminal gets what the files get: no token
        if result.status in ("skipped", "unsupported"):
            pytest.skip(f"{result.status}: {message}")
        if result.status in ("fail", "fallback") and result.role != "correctness":
            # a usage hazard or a fact of the library stack (registry role): true and reported once in the summary
            # and the matrix, never a failure of the model under test
            pytest.xfail(f"{result.role} ({result.cause or result.status}): {message}")
        if result.status != "pass":
            raise PackcheckCellFailure(result.status, message, *cause_and_remedy(result))

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if isinstance(excinfo.value, PackcheckCellFailure):
            return str(excinfo.value)
        if isinstance(excinfo.value, pytest.xfail.Exception):
            # pytest formats the traceback of an xfail too (then shows only the reason): with source lines that
            # was 0.35 s per hazard / finding item, 440 s of CPU in the all-architectures audit
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return "packcheck", 0, f"packcheck cell {self.cell.cell_id}"


class PackcheckCellFailure(Exception):
    """A cell that did not pass. Its text leads with the cause and the remedy, so pytest's one-line short summary
    (``FAILED ... - fail (leak; remedy: ...): ...``), which it cuts at the terminal width, still carries them."""

    def __init__(self, status: str, message: str, cause: str | None = None, remedy: str | None = None) -> None:
        why = f" ({cause}{'; remedy: ' + remedy if remedy else ''})" if cause else ""
        super().__init__(f"{status}{why}: {message}")
        self.status = status
        self.message = message
        self.cause = cause
        self.remedy = remedy


def cause_and_remedy(result: Any) -> tuple[str | None, str | None]:
    """The cause code of a cell result and its remedy (:func:`diagnose.remedy`, read from codes, never the
    message); (None, None) when the result names no cause. The remedy is judged without the document's
    environment (the versions it names may read "this stack")."""
    from .diagnose import classify, remedy

    cell = json.loads(result.to_json())
    cause, _ = classify(cell)
    if not cause:
        return None, None
    try:
        return cause, remedy(cause, cell, {})
    except Exception:  # noqa: BLE001 - a remedy that cannot be written never hides the verdict
        return cause, None


class PackcheckSession:
    """State of one pytest session (controller or xdist worker)."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.results: dict[str, dict[str, Any]] = {}
        self.written: list[str] = []
        self.document: dict[str, Any] | None = None
        self.changes: list[Any] = []
        self.regressions: list[Any] = []
        self.gate_text = ""
        self._resolved: list[Any] | None = None
        self._runner: Any = None
        self._env_runs: dict[str, Any] = {}
        self._group_results: dict[str, dict[str, Any]] = {}
        self.resumed: dict[str, dict[str, Any]] = {}
        self.progress = Progress(config, self._plan_size)
        self._pin_worker_gpu()
        self._stop_on_sigterm()
        self._check_inputs()
        self._open_journal()

    def _open_journal(self) -> None:
        """The journal of finished cells. A fresh run empties it (on the controller, before any worker starts);
        --packcheck-resume keeps it and takes the cells it holds for the same settings and versions."""
        from .isolation import Journal, fingerprint
        from .results import environment

        fp = fingerprint(self.settings.as_dict(), environment(self.settings.device), self.settings.tolerances)
        self.journal = Journal(Path(self.settings.report_dir) / "packcheck-journal.jsonl", fp)
        if self.settings.resume:
            self.resumed = self.journal.load()
            if self.journal.other_cells and not hasattr(self.config, "workerinput"):
                warnings.warn(PackcheckWarning(self._resume_mismatch(len(self.resumed), self.journal.other_cells)))
        elif not hasattr(self.config, "workerinput"):
            self.journal.reset()
        if not hasattr(self.config, "workerinput") and self.settings.versions:
            self._run_dir = tempfile.TemporaryDirectory(prefix="packcheck-run-")
            os.environ[RUN_DIR_VAR] = self._run_dir.name

    def _resume_mismatch(self, reused: int, other: int) -> str:
        """The line --packcheck-resume prints when the journal holds cells of another run: how many are reused,
        how many are not, and which settings differ from the previous matrix's (its ``settings``), if there is one."""
        changed = ""
        try:
            before = json.loads((Path(self.settings.report_dir) / "packcheck-matrix.json").read_text(encoding="utf-8"))["settings"]
            now = self.settings.as_dict()
            keys = sorted(k for k in set(now) | set(before) if k not in ("shard", "report_dir") and now.get(k) != before.get(k))
            if keys:
                changed = "; changed since the previous matrix: " + ", ".join(
                    f"{k} {json.dumps(before.get(k))[:60]} -> {json.dumps(now.get(k))[:60]}" for k in keys)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return (f"--packcheck-resume: the journal {self.journal.path} holds {other} finished cell(s) of a run with other "
                f"settings, tolerances or library versions{changed or ' (no previous matrix names which)'}: none of them "
                f"is reused; {reused} cell(s) journaled under these settings are.")

    def _stop_on_sigterm(self) -> None:
        """On the controller, SIGTERM (what CI time limits and `kill` send) stops the run the way Ctrl-C does, so
        the matrix of the cells that finished is written, marked incomplete, instead of the process dying with the
        previous run's matrix left in place. Only where nothing else handles SIGTERM."""
        import signal
        import threading

        if hasattr(self.config, "workerinput") or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def stop(signum: int, frame: Any) -> None:
                raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

            signal.signal(signal.SIGTERM, stop)

    def _pin_worker_gpu(self) -> None:
        """Under pytest-xdist on a machine with several GPUs, give each worker its own (CUDA_VISIBLE_DEVICES),
        before anything initialises CUDA in the worker. One GPU or none: nothing changes."""
        worker = getattr(self.config, "workerinput", None)
        if worker is None or not self.settings.device.startswith("cuda"):
            return
        chosen = gpu_for_worker(str(worker.get("workerid", "")), visible_gpus())
        if chosen is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = chosen

    def _check_inputs(self) -> None:
        """On the controller, before any cell runs: create the report folder and write a probe file, load the
        baseline, and check the device, so each problem is a usage error now rather than a traceback later."""
        if hasattr(self.config, "workerinput"):
            return
        path = Path(self.settings.report_dir)
        from .results import probe_folder

        probe_folder(path, "--packcheck-report-dir")  # a full disk is refused now, not at the report write
        self._lock_report_dir(path)
        from .report.formats import REPORT_FILES

        for name in (*REPORT_FILES, "packcheck-journal.jsonl"):
            if (path / name).is_dir():
                raise PackcheckUsageError(
                    f"'{path / name}' (in --packcheck-report-dir) is a directory: packcheck writes a file there; "
                    "move it or pass another --packcheck-report-dir."
                )
        if self.settings.baseline:
            from .results import load_document

            load_document(self.settings.baseline)  # missing, corrupt or newer: a usage error before any cell runs
        if getattr(self.settings, "versions", None):
            # before any environment is built: a release that does not exist is a usage error naming the nearest
            # ones (issue 27: transformers==5.25.0, not released, gave 13 "crash" regressions)
            from .envs import validate_versions
            from .settings import OPT_VERSIONS

            for note in validate_versions(list(self.settings.versions), OPT_VERSIONS):
                warnings.warn(PackcheckWarning(note))
        if self.settings.device.startswith("cuda"):
            # torch.cuda.is_available() calls cudaGetDeviceCount, which "poisons fork": the per-model children
            # forked later could not use CUDA. Asked through NVML it does not (torch/cuda/__init__.py).
            os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
            import torch

            if not torch.cuda.is_available():
                raise PackcheckUsageError(
                    f"Device '{self.settings.device}' (from --packcheck-device) is not available: torch "
                    f"{torch.__version__} sees no CUDA device. Use --packcheck-device=cpu."
                )

    def _lock_report_dir(self, path: Path) -> None:
        """One run per report folder (:func:`hold_report_dir`), released at the end of the session."""
        self._report_lock = hold_report_dir(path, "--packcheck-report-dir")

    def release(self) -> None:
        """Release the report folder (pytest_unconfigure)."""
        lock = getattr(self, "_report_lock", None)
        if lock is not None and lock.is_locked:
            lock.release(force=True)

    def resolved_models(self) -> list[Any]:
        if self._resolved is None:
            from .specs import parse_model_list

            specs = parse_model_list(list(self.settings.models), self.settings.model_source)
            self._resolved = [self._resolve(s) for s in specs]
        return self._resolved

    def _resolve(self, spec: Any) -> Any:
        from .envs import CHILD_ENV_VAR
        from .models import ResolvedModel, resolve_model

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
            self._limit_threads()
            from .runner import CellRunner

            self._runner = CellRunner(self.resolved_models(), self.settings.tolerances, self.settings.weights,
                                      lengths=self.settings.lengths, sliding_window=self.settings.sliding_window,
                                      device=self.settings.device, trust_remote_code=self.settings.trust_remote_code)
        return self._runner

    def _limit_threads(self) -> None:
        """Under pytest-xdist, give each worker its share of the cores: tiny models on oversubscribed torch
        thread pools run several times slower (2 workers x 2 threads on 2 cores)."""
        worker = getattr(self.config, "workerinput", None)
        if worker is None or os.environ.get("OMP_NUM_THREADS"):
            return
        import torch

        workers = int(worker.get("workercount", 1) or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

    def _plan_size(self) -> tuple[int, int]:
        """(cells, groups) this shard runs: what the progress line counts against."""
        index, count = self.settings.shard
        cells = [c for c in self._planned().values() if c.model_index % count == index - 1]
        return len(cells), len({c.group for c in cells})

    def make_items(self, session: pytest.Session) -> list[pytest.Item]:
        cells = list(self._planned().values())
        index, count = self.settings.shard
        # whole models per shard (each model is built once), assigned round-robin in audit order
        cells = [c for c in cells if c.model_index % count == index - 1]
        if not cells:
            raise PackcheckUsageError("The packcheck matrix is empty after filtering: check --packcheck-attn / --packcheck-checks.")
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
        from .results import CellResult

        cell = item.cell
        if cell.cell_id in self.resumed:
            return CellResult.from_dict(self.resumed[cell.cell_id])
        if cell.env:
            result = self.env_cell(cell)
            self.journal.append(result.to_json())
            return result
        if self.settings.isolation == "none" or self._cuda_initialised_here():
            result = self.runner().run(cell)
            self.journal.append(result.to_json())
            return result
        group = self._group_results.get(cell.group)
        if group is None or cell.cell_id not in group:
            from .isolation import run_isolated, warm_up

            warm_up(self.settings.tolerances.get("float32", {}), self.settings.device, self.settings.backends,
                    self.settings.checks)

            todo = [i.cell for i in item.session.items
                    if isinstance(i, PackcheckItem) and i.cell.group == cell.group and i.cell.cell_id not in self.resumed
                    and i.cell.cell_id not in (group or {})]
            if cell not in todo:
                todo.insert(0, cell)
            group = self._group_results.setdefault(cell.group, {})
            group.update(run_isolated(todo, self.runner().run, self._failure,
                                      lambda r: self.journal.append(r.to_json()), self.settings.timeout_s))
        return group[cell.cell_id]

    def _cuda_initialised_here(self) -> bool:
        """True when a child forked from this process could not use CUDA: this process initialised CUDA, or
        something here asked the driver in a way that "poisons fork" (torch.cuda.is_available() without
        PYTORCH_NVML_BASED_CUDA_CHECK=1, say), which a forked probe reads from torch's own bad-fork flag. The
        cells then run here (as with --packcheck-isolation=none), with one warning, instead of in children
        whose every cell would fail."""
        if not self.settings.device.startswith("cuda") or "torch" not in sys.modules:
            return False
        cached = getattr(self, "_cuda_fork_verdict", None)
        if cached is not None:
            return cached
        import torch

        unusable = torch.cuda.is_initialized()
        if not unusable and hasattr(os, "fork"):
            pid = os.fork()
            if pid == 0:  # the probe child: torch's at-fork handler has set its flag if the parent poisoned fork
                code = 2
                try:
                    code = 1 if torch.cuda._is_in_bad_fork() else 0
                finally:  # never return into pytest: a second controller would run the session again
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            unusable = os.waitstatus_to_exitcode(status) != 0
        self._cuda_fork_verdict = unusable
        if unusable:
            warnings.warn(PackcheckWarning(
                "CUDA was initialised in the audit's controller before its cells ran, so they run in this process "
                "(forked children cannot use CUDA): a crashing cell can stop the run; --packcheck-isolation=none says so explicitly"))
        return unusable

    def _shared_env_run(self, combo: Any, models: list[Any]) -> dict[str, Any]:
        """Run the plugin in ``combo``'s environment once per session: xdist workers that get cells of the same
        environment (any --dist mode) wait on a lock in the session's run folder and read the first one's results."""
        from filelock import FileLock

        from .envs import run_in_env

        run_dir = Path(os.environ[RUN_DIR_VAR]) if os.environ.get(RUN_DIR_VAR) else None
        stem = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in combo.label)
        lock = FileLock(str(run_dir / f"{stem}.lock")) if run_dir else contextlib.nullcontext()
        with lock:
            saved = run_dir / f"{stem}.json" if run_dir else None
            if saved is not None and saved.exists():
                return json.loads(saved.read_text())
            index, count = self.settings.shard
            specs = [m.spec.name if m.spec.kind == "local" else m.spec.raw
                     for i, m in enumerate(models) if i % count == index - 1]
            worker = getattr(self.config, "workerinput", None)
            threads = max(1, (os.cpu_count() or 1) // int(worker.get("workercount", 1) or 1)) if worker else None
            run = run_in_env(combo, self.settings, specs, Path(self.settings.report_dir), threads)
            data = {"label": combo.label, "requirements": list(combo.requirements),
                    "versions": run.env.versions if run.env else {}, "environment": run.environment,
                    "env_created": run.env.created if run.env else None, "env_seconds": run.env.seconds if run.env else None,
                    "run_seconds": run.seconds, "log": run.log, "cells": run.cells, "error": run.error}
            if saved is not None:
                saved.write_text(json.dumps(data))
            return data

    def _failure(self, cell: Any, status: str, message: str, metrics: dict[str, Any]) -> Any:
        from .results import CellResult

        return CellResult(cell_id=cell.cell_id, model=self.resolved_models()[cell.model_index].record(self.settings.weights),
                          backend=cell.backend, check=cell.check, dtype=cell.dtype, status=status, metrics=metrics,
                          message=message, tolerances=self.settings.tolerances.get(cell.dtype, {}))

    def env_cell(self, cell: Any) -> Any:
        """The result of a cell planned in a version environment: the first cell of an environment makes it
        (or finds it cached) and runs every cell of this shard there in one subprocess."""
        from .results import CellResult

        combo = next(v for v in self.settings.versions if v.label == cell.env)
        run = self._env_runs.get(cell.env)
        models = self.resolved_models()
        if run is None:
            run = self._env_runs[cell.env] = self._shared_env_run(combo, models)
        env_record = {k: run[k] for k in ("label", "requirements", "versions", "environment", "env_created", "env_seconds",
                                          "run_seconds", "log")}
        child = run["cells"].get(cell.base_id)
        if child is None:
            message = run["error"] or f"the run in {combo.label} produced no result for this cell (see {run['log']})"
            return CellResult(cell_id=cell.cell_id, model=models[cell.model_index].record(self.settings.weights), backend=cell.backend,
                              check=cell.check, dtype=cell.dtype, status="error", message=message,
                              tolerances=self.settings.tolerances.get(cell.dtype, {}), env=env_record)
        result = CellResult.from_dict(child)
        result.cell_id = cell.cell_id
        result.env = env_record
        return result

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
                                                                  self.settings.checks, self.settings.dtypes, env)}

    def finish(self, interrupted: bool = False) -> None:
        from .report import write_reports
        from .results import CellResult, build_document, environment

        if interrupted:
            # cells that finished (journaled) but whose reports never reached this process (an xdist worker's, a
            # forked child's last) still belong in the matrix
            planned = self._planned()
            for cell_id, data in self.journal.load().items():
                if cell_id in planned and cell_id not in self.results:
                    self.results[cell_id] = data
        if not self.results:
            if interrupted:
                line = self.discard_stale_matrix(RuntimeError("the run was interrupted before any cell finished"))
                self.config.get_terminal_writer().line(f"packcheck: {line}", yellow=True)
            return
        cells = [CellResult.from_dict(d) for d in self.results.values()]
        flags = list(self.settings.reproduce_flags())
        if self.config.option.keyword:
            flags += ["-k", self.config.option.keyword]
        command = "pytest " + " ".join(shlex.quote(f) for f in flags)
        command = os.environ.get("PACKCHECK_REPRODUCE", command)  # set by `packcheck audit` to its own argv
        from .diagnose import diagnose_document

        self.document = diagnose_document(build_document(cells, environment(self.settings.device), self.settings.as_dict(), command))
        if interrupted:
            self.document["incomplete"] = {"reason": "the run was interrupted", "cells": len(cells),
                                           "resume": "rerun the same command with --packcheck-resume"}
        self.written = write_reports(self.settings.report_dir, self.document)
        if self.settings.baseline:
            from .gate import compare, regressions, render_changes, stack
            from .results import load_document

            baseline = load_document(self.settings.baseline)
            self.changes = compare(baseline, self.document)
            self.gate_text = render_changes(self.changes, stack(baseline), stack(self.document), markdown=False)
            self.regressions = regressions(self.changes)


    def discard_stale_matrix(self, exc: BaseException) -> str:
        """The matrix of this run could not be written: remove the previous run's files, so no stale matrix
        looks current, and return the one line that says so."""
        out = Path(self.settings.report_dir)
        removed = []
        from .report.formats import REPORT_FILES

        for name in REPORT_FILES:
            with contextlib.suppress(OSError):
                (out / name).unlink()
                removed.append(name)
        what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        gone = (f"; the previous {' and '.join(removed)} in {out} were removed so they are not taken for this run's"
                if removed else "")
        return f"the matrix could not be written ({what}){gone}. The journal keeps the finished cells: rerun with --packcheck-resume."


class Progress:
    """One line per model as its cells start, on the controller (xdist's too): the model being built, models and
    cells done of the total, the time so far and an ETA from the mean time per finished cell. Nothing under
    ``-q`` (pytest's verbosity below 0) or without pytest's terminal reporter; on a terminal the line also ends
    the run of pytest's progress dots, which resume on the next line."""

    def __init__(self, config: pytest.Config, plan_size: Any = None) -> None:
        import time

        self.config = config
        self.plan_size = plan_size  # () -> (cells, groups) of this shard: the xdist controller collects nothing
        self.t0 = time.monotonic()
        self.groups: list[str] = []
        self.done: set[str] = set()
        self.total = 0
        self.n_groups = 0

    def _writer(self) -> Any:
        if self.config.get_verbosity() < 0 or hasattr(self.config, "workerinput"):
            return None
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def planned(self, items: list[pytest.Item]) -> None:
        self.total = len(items)
        self.n_groups = len({i.cell.group for i in items if isinstance(i, PackcheckItem)})

    def started(self, nodeid: str) -> None:
        group = _group_of(nodeid)
        tr = self._writer()
        if group is None or group in self.groups or tr is None:
            return
        if not self.total and self.plan_size is not None:
            self.total, self.n_groups = self.plan_size()
        if not self.groups:
            import time

            self.t0 = time.monotonic()  # from the first cell: worker start-up is not cell time
        self.groups.append(group)
        tw = getattr(tr, "_tw", None)  # end a line of progress dots first (pytest's writer knows where it is)
        if tw is not None and getattr(tw, "width_of_current_line", 0) and not getattr(tr, "currentfspath", None):
            tw.line()
        what = (f"making / running version environment {group[4:]} ({len(self.groups)}/{self.n_groups})" if group.startswith("env:")
                else f"building {group} (model {len(self.groups)}/{self.n_groups})")
        tr.write_line(f"packcheck: {what}; {self.line()}")

    def finished(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.done.add(report.nodeid)

    def line(self) -> str:
        """``120/2028 cells, 0:14 elapsed, ETA 0:41`` (ETA: the mean seconds per finished cell x the cells left)."""
        import time

        spent = time.monotonic() - self.t0
        n = len(self.done)
        eta = f"ETA {_clock(spent / n * (self.total - n))}" if n else "ETA —"
        return f"{n}/{self.total} cells, {_clock(spent)} elapsed, {eta}"


def _group_of(nodeid: str) -> str | None:
    """The group (model, or model in a version environment) of a packcheck item's node id
    ``packcheck::<group>::packcheck[<cell id>]``; None for another test."""
    parts = nodeid.split("::")
    return parts[1] if len(parts) == 3 and parts[0] == "packcheck" and parts[2].startswith("packcheck[") else None


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"


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


def hold_report_dir(path: Path, source: str, command: str | None = None) -> Any:
    """Take the report folder ``path`` for this process: one writer per folder (an audit, or ``packcheck merge
    -o``), since a second one writing there at the same time would replace the first's matrix and journal. Returns
    the held ``filelock.FileLock`` (released by the caller, or by the OS when the process dies); its owner file
    ``.packcheck-run.json`` (pid, command, start time; scrubbed) names the holder to whoever is refused.

    Raises:
        PackcheckUsageError: another run holds the folder (named by its pid, command and start time), or the
            owner file cannot be written (a full disk is named as such).
    """
    import time

    from filelock import FileLock, Timeout

    from .results import atomic_write

    lock = FileLock(str(path / ".packcheck-run.lock"))
    owner = path / ".packcheck-run.json"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            info = json.loads(owner.read_text())
            who = f"pid {info['pid']}, started {info['started']}: {info['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "unknown"
        raise PackcheckUsageError(
            f"Report directory '{path}' (from {source}) is in use by another packcheck run ({who}): "
            f"wait for it to finish, or pass another {source}.") from None
    except OSError as exc:
        from .results import write_failure

        raise PackcheckUsageError(write_failure(path / ".packcheck-run.lock", exc, source)) from None
    command = command or os.environ.get("PACKCHECK_REPRODUCE") or " ".join(shlex.quote(a) for a in sys.argv)
    try:  # scrubbed (no token, no home path); atomic: a full disk leaves no empty owner file
        atomic_write(owner, json.dumps({"pid": os.getpid(), "command": command,
                                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n", source)
    except PackcheckUsageError:
        lock.release(force=True)
        raise
    return lock


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without initialising CUDA: CUDA_VISIBLE_DEVICES when set, else the
    indices ``nvidia-smi -L`` lists (none when it is missing)."""
    import shutil
    import subprocess

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], check=False, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def gpu_for_worker(workerid: str, gpus: list[str]) -> str | None:
    """The GPU of xdist worker ``gwN``: ``gpus[N % len(gpus)]``; None when fewer than two GPUs are visible or
    the id is not an xdist worker id."""
    if len(gpus) < 2 or not workerid.startswith("gw") or not workerid[2:].isdigit():
        return None
    return gpus[int(workerid[2:]) % len(gpus)]


class PackcheckCollector(pytest.Collector):
    """Parent node of the packcheck items (they are planned from the options, not from files)."""

    def collect(self) -> list[pytest.Item]:
        return []
