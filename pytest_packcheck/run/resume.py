"""Resuming a run: the journal a session opens (emptied by a fresh run, read by ``--packcheck-resume``), and the
line that says why journaled cells of another run are not reused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from ..errors import PackcheckWarning
from .journal import Journal, fingerprint, local_model_files


def open_journal(config: pytest.Config, settings: Any) -> tuple[Journal, dict[str, dict[str, Any]]]:
    """The journal of finished cells, and the cells to reuse (cell_id -> cell record). A fresh run empties it
    (on the controller, before any worker starts); --packcheck-resume keeps it and takes the cells it holds for
    the same settings, versions and local model files (:func:`~.journal.fingerprint`); a file that is not a packcheck journal is
    named in a warning and emptied, as for a fresh run.

    Raises:
        PackcheckUsageError: a fresh run cannot empty the journal (the report folder is not writable).
    """
    from ..results.environment import environment

    files = local_model_files(settings.models, settings.model_source)
    fp = fingerprint(settings.as_dict(), environment(settings.device), settings.tolerances, files)
    # one writer unless this is an xdist worker (one of several appending; without xdist, or on its controller, only
    # this process appends: the report-folder lock keeps a second run out)
    journal = Journal(Path(settings.report_dir) / "packcheck-journal.jsonl", fp, settings.as_dict(), files,
                      shared=hasattr(config, "workerinput"))
    resumed: dict[str, dict[str, Any]] = {}
    if settings.resume:
        resumed = journal.load(warn=not hasattr(config, "workerinput"))  # warned once, by the controller
        if journal.foreign and not hasattr(config, "workerinput"):  # not a packcheck journal: start it afresh
            journal.reset()
        if journal.other_cells and not hasattr(config, "workerinput"):
            warnings.warn(PackcheckWarning(resume_mismatch(settings, journal, len(resumed), journal.other_cells)), stacklevel=2)
    elif not hasattr(config, "workerinput") and not getattr(getattr(config, "option", None), "collectonly", False):
        _keep_a_copy(journal, settings)  # an interrupted run's finished cells: said, and kept in previous/ (issue 42)
        journal.reset()  # a fresh run; --collect-only runs nothing and keeps an interrupted run's journal (issue 42)
    return journal, resumed


def resume_mismatch(settings: Any, journal: Journal, reused: int, other: int) -> str:
    """The line --packcheck-resume prints when the journal holds cells of another run: how many are reused,
    how many are not, and which settings differ from those the journal's other cells were made with (the
    settings stamped on their lines, :attr:`Journal.other_settings`; a journal of an older packcheck has none), and
    which local model folders were edited since (:attr:`Journal.other_model_files`)."""
    changed = ""
    before, now = journal.other_settings, settings.as_dict()
    if isinstance(before, dict):
        keys = sorted(k for k in set(now) | set(before) if k not in ("shard", "report_dir") and now.get(k) != before.get(k))
        if keys:
            changed = "; their settings -> these: " + ", ".join(
                f"{k} {json.dumps(before.get(k))[:60]} -> {json.dumps(now.get(k))[:60]}" for k in keys)
        files_before = journal.other_model_files
        edited = sorted(m for m in journal.model_files
                        if isinstance(files_before, dict) and m in files_before and files_before[m] != journal.model_files[m])
        if edited:
            changed += ("; local model folder(s) edited since (config.json, remote code *.py or weights files): "
                        + ", ".join(edited))
    return (f"--packcheck-resume: the journal {journal.path} holds {other} finished cell(s) of a run with other "
            f"settings, tolerances, library versions or model files{changed or ' (the journal does not record which)'}: "
            f"none of them is reused; {reused} cell(s) journaled under these settings are.")


def _incomplete(matrix: Path) -> bool:
    """Whether the results file ``matrix`` is an interrupted run's (its ``incomplete`` record: written on Ctrl-C /
    SIGTERM, "rerun with --resume"); a file that cannot be read is not."""
    try:
        return bool(json.loads(matrix.read_text(encoding="utf-8")).get("incomplete"))
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _keep_a_copy(journal: Journal, settings: Any) -> None:
    """Before a fresh run empties a journal that holds finished cells (a run killed before its matrix, or an
    interrupted one whose matrix is marked incomplete (hostile trial 5), whose cells --packcheck-resume would have
    reused: issue 42, they were emptied without a word), copy it to
    ``<report dir>/previous/packcheck-journal.jsonl`` and say so once, with how many cells it held and how to reuse
    them."""
    import shutil

    path = journal.path
    matrix = Path(settings.report_dir) / "packcheck-matrix.json"
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size == 0:
            return
        if matrix.is_file() and matrix.stat().st_mtime >= path.stat().st_mtime - 1 and not _incomplete(matrix):
            return  # that run finished and wrote its matrix after its last cell: nothing of it is lost
        held = journal.load(warn=False)
    except OSError:
        return
    if not held:
        return
    aside = Path(settings.report_dir) / "previous"
    try:
        aside.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, aside / path.name)
    except OSError:
        return
    warnings.warn(PackcheckWarning(
        f"packcheck journal: {path} held {len(held)} finished cell(s) of an earlier run with these settings that wrote "
        f"no matrix or an incomplete one (interrupted or killed); this fresh run starts the journal afresh, and a copy is kept in "
        f"{aside / path.name}: to reuse them, stop this run, copy it back and rerun with --packcheck-resume."), stacklevel=2)
