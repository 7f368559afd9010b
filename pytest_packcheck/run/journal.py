"""The results journal: a JSON-lines file, one finished cell per line, each stamped with the run's fingerprint
(settings, tolerances and library versions). ``--packcheck-resume`` takes the cells already journaled under the
same fingerprint instead of running them again; a line cut off by a kill is skipped with a warning."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, PackcheckWarning


def fingerprint(settings: dict[str, Any], environment: dict[str, Any], tolerances: dict[str, Any],
                model_files: dict[str, str] | None = None) -> str:
    """What must match for a journaled cell to be reused: settings, tolerances, the versions of packcheck,
    Python and the recorded libraries (:func:`~pytest_packcheck.versions.libraries.recorded_libraries`), the
    device, and the files of the local model folders (``model_files``: :func:`local_model_files`; a Hub ID's
    config comes from its revision in the settings, an arch: spec's from the installed transformers, whose version
    is recorded)."""
    from ..versions.libraries import recorded_libraries

    keys = ("packcheck", "python", *(lib.key for lib in recorded_libraries()), "device", "cuda", "device_name")
    # the order of a list of models / backends / checks / dtypes is no setting of any cell (issue 42: --resume with the
    # same models in another order reused nothing); the shard's share is, so a sharded run keeps its order
    unordered = ("models", "backends", "checks", "dtypes") if not settings.get("shard") else ("backends", "checks", "dtypes")
    settings = {k: sorted(v, key=str) if k in unordered and isinstance(v, list) else v for k, v in settings.items()}
    payload = {"settings": settings, "tolerances": tolerances, "environment": {k: environment.get(k) for k in keys},
               **({"model_files": model_files} if model_files else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def local_model_files(models: Iterable[str], source: str) -> dict[str, str]:
    """A digest of each local model folder among ``models`` (the settings' model specs), by spec: the content of
    its config.json and its remote code (``*.py``), and the size and modification time of its weights files
    (:data:`~pytest_packcheck.model.resolve.LOCAL_WEIGHTS_FILES`; not their content, which may be gigabytes). An
    edited folder so no longer matches the journal of an earlier run, whose cells --packcheck-resume would otherwise
    replay as this run's. Hub IDs and arch: specs have no entry. A spec that does not parse has none either (the
    run refuses it elsewhere, with its own error)."""
    from ..model.resolve import LOCAL_WEIGHTS_FILES
    from ..model.specs import parse_model_spec

    digests: dict[str, str] = {}
    for raw in models:
        try:
            spec = parse_model_spec(raw, source)
        except PackcheckUsageError:
            continue
        folder = Path(spec.name)
        if spec.kind != "local" or not folder.is_dir():
            continue
        weights = {p for name, pattern in LOCAL_WEIGHTS_FILES for p in [folder / name, *(folder.glob(pattern) if pattern else ())]}
        h = hashlib.sha256()
        for path in sorted({folder / "config.json", *folder.glob("*.py"), *weights}):
            try:
                if path in weights:
                    st = path.stat()
                    h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
                else:
                    h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
            except OSError:  # absent (no config.json yet) or unreadable: the run names it when it loads the model
                h.update(f"{path.name}\0missing\0".encode())
        digests[raw] = h.hexdigest()[:16]
    return digests


class Journal:
    """Append-only JSON lines: ``{"fingerprint": ..., "cell": {...}}`` per finished cell. Several processes
    (xdist workers) append to one file; a file lock keeps each line whole. ``shared`` False: this process is the
    file's only writer (no xdist worker: the session's report-folder lock keeps other runs out), so no lock is taken
    per line (issue 47: 650 FileLocks per default audit)."""

    def __init__(self, path: str | Path, fp: str, settings: dict[str, Any] | None = None,
                 model_files: dict[str, str] | None = None, shared: bool = True) -> None:
        self.path = Path(path)
        self.fp = fp
        self.shared = shared
        #: (fp, settings, model_files) -> the JSON text after the cell of every line, made once (:meth:`_line`)
        self._tail: tuple[tuple[str, int, int], str, str] | None = None  # (key, tail, tail scrubbed): _line
        #: the run's settings, stamped on every line: a later --packcheck-resume names what differed
        self.settings = settings
        #: the digests of the run's local model folders (:func:`local_model_files`), stamped on every line likewise
        self.model_files = model_files or {}
        #: the settings of the latest line of another fingerprint :meth:`load` found (None: not recorded)
        self.other_settings: dict[str, Any] | None = None
        #: the model folder digests of that line (None: not recorded)
        self.other_model_files: dict[str, str] | None = None
        #: the first write error (OSError), after which the run goes on without a journal
        self.failed: OSError | None = None
        #: cells the last :meth:`load` found journaled under another fingerprint (settings, tolerances, versions)
        self.other_cells = 0
        #: the last :meth:`load` found a non-empty file none of whose lines is a journal record (a JSON object with a
        #: "fingerprint"): not a packcheck journal, so a resumed run starts fresh and empties it
        self.foreign = False

    def reset(self) -> None:
        """Empty the journal (a fresh run).

        Raises:
            PackcheckUsageError: the report folder cannot be written (a full disk is named as such).
        """
        from ..results.io import write_failure

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
                self.path.unlink()  # a symlink to /dev/zero, a FIFO: replaced by a journal of its own (issue 42)
            self.path.write_text("")
        except OSError as exc:
            raise PackcheckUsageError(write_failure(self.path, exc)) from None

    def append(self, cell_json: str, scrubbed: bool = False) -> None:
        """Add one finished cell. A write that fails (a disk that filled up during the run) is named once in a
        :class:`PackcheckWarning` and the run goes on without a journal: the cell's verdict stands, only
        --packcheck-resume cannot reuse the cells from then on. ``scrubbed``: ``cell_json`` is
        :func:`~pytest_packcheck.run.sandbox.result_json`'s (secrets scrubbed but in the cell id, sorted keys, as
        ``CellResult.to_json`` writes it): written as it is, not scrubbed nor encoded again; the home directory still
        becomes ``~`` (:func:`~pytest_packcheck.results.io.scrub`), and a cell id that holds a secret still has the
        whole line scrubbed."""
        if self.failed is not None:
            return
        try:
            if scrubbed:
                self._append(cell_json, scrubbed=True)
            else:
                self._append(cell_json)
        except OSError as exc:
            from ..results.io import write_failure

            self.failed = exc
            warnings.warn(PackcheckWarning(f"packcheck journal: {write_failure(self.path, exc)} The run goes on and its "
                                           "cells keep their verdicts; from this cell on none is journaled, so "
                                           "--packcheck-resume would run them again."), stacklevel=2)

    def _append(self, cell_json: str, scrubbed: bool = False) -> None:
        from filelock import FileLock

        from ..errors import scrub_secrets
        from ..results.io import scrub, without_home

        cell = json.loads(cell_json)
        if (cell.get("metrics") or {}).get("not_journaled"):  # killed from outside, judged nothing: a resume runs it again
            return
        cell_id = cell.get("cell_id")
        if scrubbed and isinstance(cell_id, str) and scrub_secrets(cell_id) == cell_id:
            line = without_home(self._line(cell, cell_json)) + "\n"  # the tail is scrubbed once, in _line
        else:
            line = scrub(self._line(cell)) + "\n"
        with FileLock(str(self.path) + ".lock") if self.shared else contextlib.nullcontext(), open(self.path, "a+b") as fh:
            # a line cut off by a kill has no newline: end it first, so this line stays whole
            fh.seek(0, os.SEEK_END)
            if fh.tell():
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write(line.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def _line(self, cell: dict[str, Any], cell_text: str | None = None) -> str:
        """``json.dumps({"fingerprint": ..., "cell": cell, "settings": ..., "model_files": ...}, sort_keys=True)``,
        the same text, with everything after the cell (the same on every line) serialised once. ``cell_text``: the
        cell already written so (``json.dumps(cell, sort_keys=True)``, scrubbed): then the tail is given scrubbed
        (:func:`~pytest_packcheck.results.io.scrub`, once per tail)."""
        key = (self.fp, id(self.settings), id(self.model_files))
        if self._tail is None or self._tail[0] != key:
            from ..results.io import scrub

            rest = {"fingerprint": self.fp, **({"settings": self.settings} if self.settings is not None else {}),
                    **({"model_files": self.model_files} if self.model_files else {})}
            tail = "".join(f", {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(rest.items()))
            self._tail = (key, tail, scrub(tail))
        if cell_text is not None:
            return '{"cell": ' + cell_text + self._tail[2] + "}"
        return '{"cell": ' + json.dumps(cell, sort_keys=True) + self._tail[1] + "}"

    def load(self, warn: bool = True) -> dict[str, dict[str, Any]]:
        """Cells journaled under this fingerprint (the last line per cell wins). Lines that do not parse (cut
        off by a kill) are skipped with a warning; lines of another fingerprint are ignored. A non-empty file
        none of whose lines is a journal record (a JSON object with a "fingerprint": random bytes, another
        tool's file) is named as not a packcheck journal in one warning and :attr:`foreign` is set. ``warn``
        False: the same result without the warnings (an xdist worker reads the journal the controller warned of:
        trial 19, 73, one cut-off line read as three warnings)."""
        if not self.path.exists():
            return {}
        from ..errors import _max_file_bytes
        from ..results.schema import cell_problem

        if not self.path.is_file() or self.path.stat().st_size > _max_file_bytes():
            # a symlink to /dev/zero was read without bound (an OOM kill) and a FIFO hung --resume (issue 42)
            self.foreign = True
            if warn:
                what = ("not a regular file (a device or a pipe)" if not self.path.is_file() else
                        f"{self.path.stat().st_size / 1024 ** 2:.0f} MB, over what packcheck reads ($PACKCHECK_MAX_FILE_MB)")
                warnings.warn(PackcheckWarning(f"packcheck journal: {self.path} is {what}: it is not a packcheck journal "
                                               "and is not read; this run starts a journal of its own there."), stacklevel=2)
            return {}

        cells: dict[str, dict[str, Any]] = {}
        others: set[str] = set()
        bad = records = 0
        shapes: list[str] = []
        for line in _lines(self.path):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, RecursionError):  # a 100,000-deep line is a bad line, not a traceback
                bad += 1
                continue
            records += isinstance(entry, dict) and "fingerprint" in entry
            problem = (cell_problem(entry.get("cell")) if isinstance(entry, dict)
                       else f"a line is a JSON {type(entry).__name__}, not an object")
            if problem:  # valid JSON of the wrong shape: edited by hand or written by something else
                shapes.append(problem)
                continue
            if entry.get("fingerprint") == self.fp:
                cells[entry["cell"]["cell_id"]] = entry["cell"]
            else:
                others.add(entry["cell"]["cell_id"])
                if isinstance(entry.get("settings"), dict):
                    self.other_settings = entry["settings"]
                    files = entry.get("model_files", {})
                    self.other_model_files = files if isinstance(files, dict) else None
        self.other_cells = len(others - set(cells))
        self.foreign = not records and bool(bad or shapes)
        if self.foreign:  # random bytes were "skipped 31 unreadable line(s) (cut off by a kill?)"
            first = shapes[0] if shapes else "a line is not JSON"
            if warn:
                warnings.warn(f"packcheck journal {self.path} is not a packcheck journal: none of its {bad + len(shapes)} "
                              f"line(s) is a journal record (first: {first}); the run starts fresh (every cell runs) and "
                              "the file is emptied.", PackcheckWarning, stacklevel=2)
            return {}
        if bad and warn:
            warnings.warn(f"packcheck journal {self.path}: skipped {bad} unreadable line(s) (cut off by a kill?); "
                          "those cells run again.", PackcheckWarning, stacklevel=2)
        if shapes and warn:
            warnings.warn(f"packcheck journal {self.path}: skipped {len(shapes)} line(s) that are not journal entries "
                          f"(first: {shapes[0]}); those cells run again.", PackcheckWarning, stacklevel=2)
        return cells


def _lines(path: Path) -> Iterable[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                yield line
