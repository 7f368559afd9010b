"""Cells planned in a version environment (``--packcheck-versions``): the first cell of an environment makes it
(or finds it cached) and runs every cell of this shard there in one subprocess; xdist workers share that run
through a folder of the session (:data:`RUN_DIR_VAR`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: A folder for this session (made by the controller, inherited by xdist workers) where version-environment
#: runs are shared.
RUN_DIR_VAR = "PACKCHECK_RUN_DIR"


class VersionCells:
    """The version environments' runs of one session (controller or xdist worker), by environment label."""

    def __init__(self, config: pytest.Config, settings: Any) -> None:
        self.config = config
        self.settings = settings
        self.runs: dict[str, Any] = {}
        self._run_dir: Any = None
        if not hasattr(config, "workerinput") and settings.versions:
            self._run_dir = tempfile.TemporaryDirectory(prefix="packcheck-run-")
            os.environ[RUN_DIR_VAR] = self._run_dir.name

    def result(self, cell: Any, models: list[Any]) -> Any:
        """The result of a cell planned in a version environment: the first cell of an environment makes it
        (or finds it cached) and runs every cell of this shard there in one subprocess."""
        from ..results.schema import CellResult

        combo = next(v for v in self.settings.versions if v.label == cell.env)
        run = self.runs.get(cell.env)
        if run is None:
            run = self.runs[cell.env] = self._shared_run(combo, models)
        env_record = {k: run[k] for k in ("label", "requirements", "versions", "environment", "env_created", "env_seconds",
                                          "run_seconds", "log")}
        child = run["cells"].get(cell.base_id)
        if child is None:
            message = run["error"] or f"the run in {combo.label} produced no result for this cell (see {run['log']})"
            return CellResult(cell_id=cell.cell_id, model=models[cell.model_index].record(self.settings.weights), backend=cell.backend,
                              check=cell.check, dtype=cell.dtype, status="error", message=message,
                              tolerances=self.settings.tolerances.get(cell.dtype, {}), env=env_record)
        from ..versions.envs import stack_version_mismatch

        result = CellResult.from_dict(child)
        result.cell_id = cell.cell_id
        result.env = env_record
        wrong = stack_version_mismatch(combo, child)
        if wrong:  # never filed as a measurement of the release it did not run
            result.status, result.message, result.cause, result.evidence, result.causes = "error", wrong, None, {}, []
        return result

    def _shared_run(self, combo: Any, models: list[Any]) -> dict[str, Any]:
        """Run the plugin in ``combo``'s environment once per session: xdist workers that get cells of the same
        environment (any --dist mode) wait on a lock in the session's run folder and read the first one's results."""
        from filelock import FileLock

        from ..versions.envs import run_in_env

        run_dir = Path(os.environ[RUN_DIR_VAR]) if os.environ.get(RUN_DIR_VAR) else None
        stem = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in combo.label)
        lock = FileLock(str(run_dir / f"{stem}.lock")) if run_dir else contextlib.nullcontext()
        with lock:
            saved = run_dir / f"{stem}.json" if run_dir else None
            if saved is not None and saved.exists():
                return json.loads(saved.read_text())
            from ..config.options import shard_holds

            specs = [m.spec.name if m.spec.kind == "local" else m.spec.raw
                     for i, m in enumerate(models) if shard_holds(i, self.settings.shard)]
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
