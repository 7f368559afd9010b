"""Writing results, journals and logs safely: secrets scrubbed, whole files only (temp file and rename, a set of
files replaced together), a full disk or an unwritable folder named in one line."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, scrub_secrets, secret_forms

#: :data:`.schema.SCHEMA_VERSION`, the version a file with the tables says it is (schema.py holds it to this)
RESULTS_SCHEMA_VERSION = 3
#: the cell fields a schema-3 file keeps in a top-level table of the same name, each with its key's prefix
#: ("" for models: the key is the model's label, ``label~1`` ... for a second record under one label)
TABLES = {"models": ("model", ""), "tolerances": ("tolerances", "t")}


def scrub(text: str) -> str:
    """Remove what must never reach a report, journal or log: the values of secret-looking environment
    variables (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, ..., 8+ characters) become ``***``, and the home directory
    becomes ``~``."""
    return without_home(scrub_secrets(text))


def without_home(text: str) -> str:
    """``text`` with the home directory written ``~`` (:func:`scrub`'s second half)."""
    home = os.path.expanduser("~")
    if len(home) > 1:
        text = text.replace(home, "~")
    return text


def scrub_json(text: str, keep: tuple[str, ...] = ("cell_id",)) -> str:
    """A JSON document's text with :func:`scrub_secrets` applied to every string in it (keys and values) but the
    top-level ``keep`` fields, still valid JSON: what a cell child sends its parent (:mod:`..run.sandbox`), scrubbed
    once there, so the parent's journal line, pytest report property and terminal message need no scrub of their own
    (issue 47: each result was scrubbed three times in the parent). The cell id is kept as the cell ran: it is made
    of the scrubbed model label and fixed names, and the parent matches it with the cell it planned.

    When nothing is scrubbed (every cell of a run without secrets) the text is returned as it is; otherwise (a
    secret in the text, as typed or JSON-escaped: a quote, a backslash, a non-ASCII letter in it) the document is
    read, scrubbed string by string and written again with sorted keys (as ``CellResult.to_json`` writes it):
    replacing a secret inside the text could eat a JSON escape around it."""
    import json

    escaped = (json.dumps(form)[1:-1] for form in secret_forms())
    if scrub_secrets(text) == text and not any(e in text for e in escaped):
        return text
    data = json.loads(text)

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return scrub_secrets(value)
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {scrub_secrets(k): clean(v) for k, v in value.items()}
        return value

    if isinstance(data, dict):
        data = {k if k in keep else scrub_secrets(k): v if k in keep else clean(v) for k, v in data.items()}
    else:
        data = clean(data)
    return json.dumps(data, sort_keys=True)


def write_failure(path: Path, exc: OSError, flag: str = "--packcheck-report-dir") -> str:
    """The one line for an OSError writing ``path``: a full disk (ENOSPC, EDQUOT) says so with the space left,
    a folder packcheck may not write (EACCES, EPERM, EROFS) asks for a writable ``flag``, anything else is named."""
    import errno
    import shutil

    reason = exc.strerror or str(exc)
    if isinstance(exc.filename, str) and exc.filename and Path(exc.filename).name not in (path.name, path.parent.name) \
            and not Path(exc.filename).name.startswith(f".{path.name}.") and exc.errno not in (
            errno.ENOSPC, errno.EDQUOT):
        path = Path(exc.filename)  # what actually failed: the journal's lock file, say, not the journal
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(path.parent if path.parent.exists() else Path('.')).free // 1024} KiB free"
        except OSError:
            free = "free space unknown"
        return (f"Cannot write {path}: the disk is full ({reason}; {free}): free space on it, or pass a folder on "
                f"another disk with {flag}.")
    if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.ELOOP):  # mkdir / open under a path that is not a folder
        for p in (path, *path.parents):
            if os.path.islink(p) and not os.path.exists(p):
                return f"Cannot write {path}: {p} is a broken or looping symlink: pass a folder with {flag}."
            if os.path.exists(p) and not os.path.isdir(p):
                return f"Cannot write {path}: {p} is a file, not a folder: pass a folder with {flag}."
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"Cannot write {path} ({reason}): pass a writable {flag}."
    return f"Cannot write {path} ({reason}): check the folder, or pass another one with {flag}."


#: Bytes :func:`probe_folder` writes (and removes): the smallest report set packcheck writes (one model, one
#: cell: journal, owner file and the four reports) is 11.7 KB of text in six files, 24 KiB in 4 KiB blocks.
PROBE_BYTES = 32 * 1024


def probe_folder(folder: Path, flag: str, what: str = "Report directory") -> None:
    """Create ``folder`` and write :data:`PROBE_BYTES` into a temp file there, before minutes of work: bytes, not
    only a name, since a full disk still creates empty files (a free inode) but takes no data.

    Raises:
        PackcheckUsageError: it cannot be created or written (:func:`write_failure`: a full disk says so).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".packcheck-probe") as probe:
            probe.write(b"\0" * PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise PackcheckUsageError(f"{what} '{folder}' (from {flag}) is not writable: "
                                  f"{write_failure(folder / '.packcheck-probe', exc, flag)}") from None


def remove_orphans(path: Path) -> list[Path]:
    """Remove the temp files ``.<name>.*.tmp`` a killed writer left beside ``path`` (see :func:`write_set`);
    returns them. The report folder's lock keeps two writers of one folder apart."""
    gone = []
    try:
        found = list(path.parent.glob(f".{path.name}.*.tmp"))
    except OSError:
        return gone
    for orphan in found:
        try:
            orphan.unlink()
            gone.append(orphan)
        except OSError:
            pass
    return gone


def write_set(files: list[tuple[Path, str]], flag: str = "--packcheck-report-dir") -> None:
    """Write files that belong together (the matrix's JSON, Markdown, HTML and details) as one set: every
    text (:func:`scrub`-bed) goes to a temp file in its folder first; only when all are written are the old
    files of the set removed and the temp files renamed into place, in the order given (the caller puts the
    JSON, which ``gate`` and ``merge`` read, last). A kill at any point leaves either the old set, or part of
    the new set with none of the old files beside it: never a new JSON next to an old Markdown. A failed write
    (full disk) removes its temp files and leaves the old set as it was.

    Raises:
        PackcheckUsageError: a file cannot be written (:func:`write_failure`: a full disk says so).
    """
    tmps: list[str] = []
    current = files[0][0] if files else Path(".")
    try:
        for path, text in files:
            current = path
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_orphans(path)  # a previous writer killed mid-write (also before a --packcheck-resume)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            tmps.append(tmp)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(scrub(text))
                fh.flush()
                os.fsync(fh.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a report is an ordinary file
        if len(files) > 1:
            for path, _ in files:
                current = path
                path.unlink(missing_ok=True)
        for (path, _), tmp in zip(files, tmps, strict=True):
            current = path
            os.replace(tmp, path)
    except OSError as exc:
        for tmp in tmps:
            Path(tmp).unlink(missing_ok=True)
        raise PackcheckUsageError(write_failure(current, exc, flag)) from None


def dumps_results(doc: dict) -> str:
    """A results document (``packcheck-matrix.json``) as text: the top-level keys one-space indented, and each
    cell of ``cells`` compact on a line of its own. Half the bytes of ``indent=1`` (the committed default matrix:
    2.4 MB, not 3.0 MB), and a re-measured cell is one changed line in a diff. Written as schema 3
    (:func:`compact_document`: each model record and tolerance set once, in top-level tables the cells
    name: 1.5 MB); ``doc`` is not changed. Read it back with :func:`.schema.load_document` (or
    :func:`read_results`), which expands the tables: a bare ``json.loads`` sees the references."""
    import json

    doc = compact_document(doc)
    parts = []
    for key, value in doc.items():
        if key == "cells" and isinstance(value, list) and value:
            body = ",\n".join("  " + json.dumps(cell, separators=(",", ":")) for cell in value)
            parts.append(f' {json.dumps(key)}: [\n{body}\n ]')
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def compact_document(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a results document as readers see it: every cell with its own ``model`` and ``tolerances`` objects)
    as a schema-3 file holds it: each distinct model record and tolerance set once in the top-level tables ``models``
    and ``tolerances`` (placed before ``cells``), a cell naming its entry. A new dict; ``doc`` is not changed. A cell
    whose field is not an object keeps it as it is (:func:`.schema.cell_problem` names it on load). The inverse of
    :func:`expand_tables`: ``expand_tables(compact_document(doc))["cells"] == doc["cells"]``."""
    cells = doc.get("cells")
    if not isinstance(cells, list):
        return dict(doc)
    tables: dict[str, dict[str, Any]] = {name: {} for name in TABLES}
    keys: dict[str, dict[str, str]] = {name: {} for name in TABLES}  # canonical JSON of a record -> its key
    out_cells = []
    for cell in cells:
        if not isinstance(cell, dict):
            out_cells.append(cell)
            continue
        cell = dict(cell)
        for name, (field_name, prefix) in TABLES.items():
            value = cell.get(field_name)
            if not isinstance(value, dict):
                continue
            text = json.dumps(value, sort_keys=True, default=str)
            key = keys[name].get(text)
            if key is None:
                if prefix:
                    key = f"{prefix}{len(tables[name])}"
                else:  # the label, unless another record already has it (two records under one label: label~1)
                    base = str(value.get("label"))
                    key, n = base, 0
                    while key in tables[name]:
                        n += 1
                        key = f"{base}~{n}"
                keys[name][text], tables[name][key] = key, value
            cell[field_name] = key
        out_cells.append(cell)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in TABLES:
            continue
        if key == "cells":
            out.update(tables)
            value = out_cells
        out[key] = value
    out["schema_version"] = RESULTS_SCHEMA_VERSION
    return out


def expand_tables(data: dict[str, Any], name: str) -> dict[str, Any]:
    """Give each cell of a schema-3 results document (``data``, as parsed) its entries of the top-level tables
    (:data:`TABLES`) back, in place, and drop the tables: the cells readers see are those of schema 2. A cell's
    entry is a shared object (readers do not change model records or tolerances in place). A document without
    tables (schema 1 / 2) is returned as it is. ``name``: the file, named in every error.

    Raises:
        PackcheckUsageError: a table that is not an object of objects, or a cell naming a key its table lacks (one
            line naming the file, the cell and the key).
    """
    if not isinstance(data, dict):
        return data
    tables = {}
    for table, (field_name, _prefix) in TABLES.items():
        if table not in data:
            continue
        value = data.pop(table)
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise PackcheckUsageError(f"Results file {name} is corrupt: \"{table}\" is {json.dumps(value)[:40]} (expected a JSON "
                                      f"object of {field_name} records by key). Regenerate it with `packcheck audit`.")
        tables[field_name] = (table, value)
    cells = data.get("cells")
    if not isinstance(cells, list):
        return data
    for cell in cells:
        if not isinstance(cell, dict):
            continue
        for field_name in ("model", "tolerances"):
            key = cell.get(field_name)
            if not isinstance(key, str):
                continue
            table, entries = tables.get(field_name, (next(t for t, (f, _) in TABLES.items() if f == field_name), {}))
            if key not in entries:
                raise PackcheckUsageError(
                    f"Results file {name} is corrupt: cell {str(cell.get('cell_id', '?'))!r} names {field_name} {key!r}, "
                    f"which its \"{table}\" table lacks ({len(entries)} entries). Regenerate it with `packcheck audit`.")
            cell[field_name] = entries[key]
    return data


def read_results(path: str | Path) -> dict[str, Any]:
    """A results JSON packcheck itself just wrote (a child audit's, a version environment's, an atlas release's),
    parsed and with its tables expanded (:func:`expand_tables`), without :func:`.schema.load_document`'s checks of a file
    from elsewhere: the cells every reader sees, schema 2's shape.

    Raises:
        OSError, ValueError: the file cannot be read or is not JSON (as ``json.loads``).
        PackcheckUsageError: a dangling table reference (:func:`expand_tables`).
    """
    p = Path(path)
    return expand_tables(json.loads(p.read_text(encoding="utf-8")), str(p))


def atomic_write(path: Path, text: str, flag: str = "--packcheck-report-dir") -> None:
    """Write via a temp file in the same folder and rename, so a kill never leaves half a file. The text is
    :func:`scrub`-bed first; temp files of a killed earlier write are removed.

    Raises:
        PackcheckUsageError: the folder cannot be created or written (a full disk says so).
    """
    write_set([(Path(path), text)], flag)
