"""The atlas's support file (``reports/atlas/support.json``, schema ``reports/atlas/SCHEMA.md``): where it is, its
shape, checked once where it is loaded (:func:`validate_support`: no entry a verdict's own number contradicts, by the
rules of :mod:`.verdict_rules`), and the model types it measured (:func:`refuse_unknown_model_type`).

The reader under :mod:`pytest_packcheck.support` (the lookup), the atlas's render (which validates what it writes)
and ``packcheck bisect`` / ``packcheck atlas --bisect-models`` (which refuse a model type nobody knows). Imports
nothing heavy at import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError

#: ``$PACKCHECK_SUPPORT_FILE`` overrides where :func:`pytest_packcheck.support.lookup` reads the atlas.
SUPPORT_FILE_ENV = "PACKCHECK_SUPPORT_FILE"
#: The schema versions this module reads.
READABLE_SCHEMA = (1,)


def default_support_file() -> Path:
    """``$PACKCHECK_SUPPORT_FILE``, else the atlas shipped in the wheel (``pytest_packcheck/_atlas/support.json``,
    pyproject's force-include), else the one committed in the source tree (``reports/atlas/support.json``)."""
    env = os.environ.get(SUPPORT_FILE_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1]  # pytest_packcheck/
    shipped = here / "_atlas" / "support.json"
    return shipped if shipped.exists() else here.parent / "reports" / "atlas" / "support.json"


#: The fix for a support file that cannot be read or is corrupt. Not "re-render it with --render-only": that render
#: is seeded from the very file (trial 16, 200: the remedy went round in a circle).
RESTORE = ("restore it (git checkout -- reports/atlas/support.json), pass the committed reports/atlas/support.json, or "
           "render a new one from measured releases into an empty folder (packcheck atlas --render-only --build-dir "
           "build/atlas -o NEW_FOLDER)")


@lru_cache(maxsize=4)
def _load(path: str, version: Any) -> dict[str, Any]:
    """The validated document at ``path``; ``version``: what tells two states of the file apart (the cache key: its
    stat, or the digest of its bytes)."""
    if Path(path).is_dir():
        raise PackcheckUsageError(f"Support file '{path}' is a directory: pass the support.json file itself "
                                  "(--support-file / $PACKCHECK_SUPPORT_FILE), e.g. reports/atlas/support.json.")
    from ..errors import read_document

    if not Path(path).exists():
        raise PackcheckUsageError(f"Support file '{path}' does not exist: pass --support-file / ${SUPPORT_FILE_ENV}, or "
                                  "generate it with `packcheck atlas`.")
    # one bounded reader (issue 42): a /dev/zero symlink, a 100,000-deep array, a 2 GB file are one line each
    doc = read_document(path, "json", "Support file", f"{RESTORE}.")
    validate_support(doc, path)
    return doc


def validate_support(doc: Any, source: str | Path) -> None:
    """Check the shape of a support document (``reports/atlas/SCHEMA.md``) once, where it is loaded, so that
    :func:`pytest_packcheck.support.lookup`, ``packcheck claims`` and the TRL answer can index it without a traceback: a JSON object of
    schema ``packcheck-atlas-support`` in a :data:`READABLE_SCHEMA` version; ``cells`` a dict of model_type ->
    backend -> release -> entry, each release key a version, each entry's ``verdict`` one of
    :data:`~pytest_packcheck.results.schema.STATUSES`, ``number`` a float or absent, ``causes`` a list of strings;
    ``releases`` a list of objects whose ``transformers`` is a version; ``missing`` a list of versions.

    Raises:
        PackcheckUsageError: the first bad field, named with ``source`` (the file) and the fix (regenerate).
    """
    from ..results.schema import STATUSES

    def bad(what: str) -> PackcheckUsageError:
        return PackcheckUsageError(f"Support file '{source}' is corrupt: {what}; {RESTORE}.")

    if not isinstance(doc, dict):
        raise PackcheckUsageError(f"Support file '{source}' is a JSON {type(doc).__name__}, not a packcheck atlas support "
                                  "document (an object with schema 'packcheck-atlas-support'): pass reports/atlas/support.json.")
    version = doc.get("schema_version")
    if "schema" not in doc and isinstance(doc.get("cells"), list) and "settings" in doc:
        raise PackcheckUsageError(f"Support file '{source}' is a packcheck results matrix (packcheck-matrix.json of "
                                  "`packcheck audit`), not an atlas support file: pass reports/atlas/support.json (or "
                                  "`packcheck atlas` output); compare matrices with `packcheck gate`.")
    if doc.get("schema") != "packcheck-atlas-support" or version not in READABLE_SCHEMA:
        raise PackcheckUsageError(f"Support file '{source}' has schema {doc.get('schema')!r} version {version!r}; this "
                                  f"packcheck reads packcheck-atlas-support version {', '.join(map(str, READABLE_SCHEMA))}: "
                                  "upgrade packcheck or regenerate the file.")
    tolerances = doc.get("tolerances")
    if tolerances is not None and (not isinstance(tolerances, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in tolerances.values())):
        raise bad(f"'tolerances' is {tolerances!r:.80}, not an object of tolerance name -> number")
    if tolerances is None:  # a file rendered before it recorded them: the atlas runs the shipped float32 ones
        from ..config.tolerances import default_tolerances

        tolerances = default_tolerances()["float32"]
    cells = doc.get("cells")
    if not isinstance(cells, dict):
        raise bad(f"'cells' is {_kind(cells)}, not an object of model_type -> backend -> release -> entry")
    for arch, row in cells.items():
        if not isinstance(row, dict):
            raise bad(f"cells.{arch} is {_kind(row)}, not an object of backend -> release -> entry")
        for backend, by_release in row.items():
            if not isinstance(by_release, dict):
                raise bad(f"cells.{arch}.{backend} is {_kind(by_release)}, not an object of release -> entry")
            for release, entry in by_release.items():
                at = f"cells.{arch}.{backend}[{release!r}]"
                if not is_version(release):
                    raise bad(f"release key {release!r} under cells.{arch}.{backend} is not a version")
                if not isinstance(entry, dict):
                    raise bad(f"{at} is {_kind(entry)}, not an entry object")
                if entry.get("verdict") not in STATUSES:
                    raise bad(f"{at}.verdict is {entry.get('verdict')!r}, not one of {', '.join(STATUSES)}")
                number = entry.get("number")
                if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)
                                           or not math.isfinite(number) or number < 0):
                    # a key number is a distance or an error: never negative (trial 17, 30: isolation -1.0 was a pass)
                    raise bad(f"{at}.number is {number!r}, not a finite number >= 0 (a difference) or null")
                causes = entry.get("causes", [])
                if not isinstance(causes, list) or not all(isinstance(c, str) for c in causes):
                    raise bad(f"{at}.causes is {causes!r}, not a list of cause codes")
                contradiction = _entry_contradicted(entry, tolerances)
                if contradiction:
                    raise bad(f"{at} is {contradiction}" if contradiction.startswith("a fail") else f"{at} is a pass {contradiction}")
    releases = doc.get("releases")
    if not isinstance(releases, list):
        raise bad(f"'releases' is {_kind(releases)}, not a list of the measured releases")
    for i, release in enumerate(releases):
        if not isinstance(release, dict) or not isinstance(release.get("transformers"), str) or not is_version(release["transformers"]):
            raise bad(f"releases[{i}] has no transformers version (got {release!r:.80})")
    missing = doc.get("missing", [])
    if not isinstance(missing, list) or not all(isinstance(v, str) and is_version(v) for v in missing):
        raise bad(f"'missing' is {missing!r:.80}, not a list of versions")
    for key in ("transitions",):
        if not isinstance(doc.get(key, []), list):
            raise bad(f"'{key}' is {_kind(doc.get(key))}, not a list")
    if not isinstance(doc.get("trl") or {}, dict):
        raise bad(f"'trl' is {_kind(doc.get('trl'))}, not an object")
    if doc.get("axes") is not None:  # the library axes (verl, OpenRLHF, ms-swift, peft, accelerate, TRL's stack)
        from .library_axes import validate_axes

        why = validate_axes(doc["axes"])
        if why:
            raise bad(why)


def _entry_contradicted(entry: dict[str, Any], tolerances: dict[str, Any]) -> str:
    """Why an entry contradicts itself ("" when it does not): a fail that names no cause, or whose number is under its
    check's tolerance where a fail means over it (:func:`~pytest_packcheck.analysis.verdict_rules.fail_within_tolerance`;
    strictly under, as the entry's number is rounded to 3 digits); a pass that names causes, has no key number (trial
    15, 91), or whose number is above its check's tolerance (:func:`~pytest_packcheck.analysis.verdict_rules.pass_over_tolerance`).
    The rules ``gate`` and ``merge`` apply to a results file (trial 14, 69: an isolation "pass" of 0.9 was answered as
    a pass)."""
    if entry.get("verdict") not in ("pass", "fail"):
        return ""
    fail_within_tolerance, pass_over_tolerance, SPECS = _tolerance_rules()

    if entry.get("verdict") == "fail" and not entry.get("causes"):
        return "a fail that names no cause (every measured fail names what it measured)"
    spec = SPECS.get(entry.get("check"))
    if entry.get("verdict") == "fail" and spec and spec.key_metric and entry.get("number") is not None:
        under = fail_within_tolerance(spec.name, "fail", {spec.key_metric[0]: entry["number"]}, tolerances)
        if under and under[1] < under[3]:  # trial 15, 225: an edited "fail [leak]" with isolation 0.0 was rendered as a transition
            return (f"a fail whose {spec.name} number {under[1]:.3g} is within its tolerance {under[2]} {under[3]:.3g} "
                    "(a verdict its own number contradicts)")
    if entry.get("verdict") != "pass":
        return ""
    if entry.get("causes"):
        return f"with causes {entry['causes']!r} (a pass has none)"
    if spec is None or not spec.key_metric:
        return ""
    if entry.get("number") is None:  # trial 15, 91: a pass resting on nothing was answered "pass"
        return f"with no {spec.name} number (a pass rests on its check's key number)"
    over = pass_over_tolerance(spec.name, "pass", {spec.key_metric[0]: entry["number"]}, tolerances)
    return (f"whose {spec.name} number {over[1]:.3g} is above its tolerance {over[2]} {over[3]:.3g} (a verdict its "
            "own number contradicts)") if over else ""


@lru_cache(maxsize=1)
def _tolerance_rules() -> tuple[Any, Any, Any]:
    """(fail_within_tolerance, pass_over_tolerance, the check registry's SPECS), imported once: the validation
    calls for them per entry (18,663 in the 40-release atlas), and an import statement per call cost 0.1 s."""
    from ..checks.registry import SPECS
    from .verdict_rules import fail_within_tolerance, pass_over_tolerance

    return fail_within_tolerance, pass_over_tolerance, SPECS


def _kind(value: Any) -> str:
    """``value``'s JSON kind for a message: 'missing', 'a list', 'a string', ..."""
    if value is None:
        return "missing or null"
    return "a " + {"dict": "object", "list": "list", "str": "string", "bool": "boolean", "int": "number",
                   "float": "number"}.get(type(value).__name__, type(value).__name__)


def load_support(path: str | Path | None = None, version: Any = None) -> dict[str, Any]:
    """The support document, cached per path and state: ``version`` when given (:func:`load_support_view` passes the
    digest of the file's bytes), else the file's modification time, size and inode.

    Raises:
        PackcheckUsageError: missing, a directory, unreadable, another schema, or a corrupt shape
            (:func:`validate_support`).
    """
    p = Path(path) if path else default_support_file()
    if version is None:
        try:
            st = p.stat()
            version = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            version = 0
    try:
        return _load(str(p), version)
    except PackcheckUsageError as exc:
        if path or not os.environ.get(SUPPORT_FILE_ENV):
            raise
        # the file came from the environment: say so (it is not on the command line to be seen)
        text = str(exc).replace(f"Support file '{p}'", f"Support file '{p}' (from ${SUPPORT_FILE_ENV})", 1)
        raise PackcheckUsageError(text) from None


#: Format of the split index :func:`load_support_view` keeps beside packcheck's cache (bump on any layout change).
INDEX_FORMAT = 1
#: The keys of a support document the index keeps in files of their own, read only when asked for.
_LAZY_KEYS = ("transitions", "trl", "encoders", "multimodal", "axes")  # encoders, multimodal: atlas/kinds.py's blocks;
# axes: the library axes (analysis/library_axes.py)


def _index_dir(p: Path) -> Path | None:
    """Where the split index of the support file ``p`` lives: ``<cache>/support-index/<key>``, the key the BLAKE2 digest
    of the file's bytes (an edit that keeps the size and the modification time is a new index), this module's own
    modification time (its validation rules) and :data:`INDEX_FORMAT`. None when the file cannot be read (the full
    load names why)."""
    import hashlib

    from ..versions.cache import cache_root

    try:
        if not p.is_file():
            return None
        st = p.stat()
        seen = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        if seen not in _DIGESTS:  # once per state of the file in a process (a loop of lookups hashes it once)
            with p.open("rb") as fh:
                _DIGESTS[seen] = hashlib.file_digest(fh, "blake2b").hexdigest()[:32]
        digest = _DIGESTS[seen]
        rules = Path(__file__).stat().st_mtime_ns
    except OSError:
        return None
    key = hashlib.blake2b(f"{INDEX_FORMAT}|{digest}|{rules}".encode(), digest_size=12).hexdigest()
    return cache_root() / "support-index" / key


#: The digest of each support file's bytes, by its stat, in this process.
_DIGESTS: dict[tuple[str, int, int, int], str] = {}
#: Index folders kept in the cache (the newest by use): an atlas edited again and again leaves no trail of 5 MB folders.
INDEX_KEEP = 4


def _write_index(doc: dict[str, Any], folder: Path) -> None:
    """Split a validated support document into ``folder``: ``meta.json`` (every top-level key but the cells and
    :data:`_LAZY_KEYS`, plus the model types and backends the cells hold), one ``cells/<n>.json`` per model type, one
    file per lazy key. Written into a temporary folder renamed into place, so a reader never sees half an index."""
    import json
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        (tmp / "cells").mkdir()
        files = {}
        for i, (model_type, row) in enumerate(doc["cells"].items()):
            files[model_type] = f"cells/{i}.json"
            (tmp / files[model_type]).write_text(json.dumps(row, separators=(",", ":")), encoding="utf-8")
        for key in _LAZY_KEYS:
            (tmp / f"{key}.json").write_text(json.dumps(doc.get(key), separators=(",", ":")), encoding="utf-8")
        meta = {k: v for k, v in doc.items() if k != "cells" and k not in _LAZY_KEYS}
        meta["_index"] = {"cells": files, "backends": sorted({b for row in doc["cells"].values() for b in row}),
                          "lazy": [k for k in _LAZY_KEYS if k in doc], "block_models": _block_models(doc)}
        (tmp / "meta.json").write_text(json.dumps(meta, separators=(",", ":")), encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)  # a damaged index of the same file
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    others = sorted((d for d in folder.parent.iterdir() if d.is_dir() and not d.name.startswith(".") and d != folder),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for old in others[INDEX_KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


#: The atlas's blocks beside the transformers axis (:mod:`pytest_packcheck.atlas.kinds`) and the lookup prefix that
#: asks each (``encoder:bert``, ``multimodal:qwen2_vl``): here, so that a plain lookup names a block without importing
#: the atlas package (45 ms of imports: versions, importlib.metadata).
BLOCK_PREFIXES = {"encoders": "encoder:", "multimodal": "multimodal:"}


def _block_models(doc: Any) -> dict[str, list[str]]:
    """The model types each atlas block (``encoders``, ``multimodal``: support.json's ``rows`` / ``cells``) holds,
    by block: what a plain lookup needs to point at a block without reading it (:meth:`SupportView.block_models`)."""
    out = {}
    for key in BLOCK_PREFIXES:
        block = doc.get(key)
        rows = block.get("rows", block.get("cells")) if isinstance(block, dict) else None
        if isinstance(rows, dict):
            out[key] = sorted(rows)
    return out


class _Cells(Mapping):
    """``doc["cells"]`` of a :class:`SupportView`: the model types from the index, each row read on first use."""

    def __init__(self, view: SupportView) -> None:
        self._view, self._rows = view, {}

    def __getitem__(self, model_type: str) -> Any:
        if model_type not in self._rows:
            self._rows[model_type] = self._view._read(self._view._meta["_index"]["cells"][model_type], f"cells of {model_type}")
        return self._rows[model_type]

    def __iter__(self) -> Any:
        return iter(self._view._meta["_index"]["cells"])

    def __len__(self) -> int:
        return len(self._view._meta["_index"]["cells"])


class SupportView(Mapping):
    """A validated support document read from its split index (:func:`load_support_view`): the small keys at once,
    ``cells`` one architecture at a time, ``transitions`` and ``trl`` when asked for. Reads as the document does
    (``doc["cells"].get("llama")``, ``doc.get("transitions", [])``); ``backends_in_cells`` is precomputed."""

    def __init__(self, folder: Path, source: Path) -> None:
        import json

        self._folder, self._source = folder, source
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        index = meta.get("_index") if isinstance(meta, dict) else None
        if not (isinstance(index, dict) and isinstance(index.get("cells"), dict) and isinstance(index.get("backends"), list)
                and isinstance(index.get("lazy"), list) and all(isinstance(v, str) for v in index["cells"].values())
                and isinstance(meta.get("releases"), list)):
            raise ValueError(f"{folder / 'meta.json'} is not an index's meta")
        self._meta = meta
        self._lazy: dict[str, Any] = {}
        self._cells = _Cells(self)

    def _read(self, name: str, what: str) -> Any:
        """One file of the index; a file gone or damaged since (a cache cleaned by hand) falls back to the support
        file itself, loaded and validated in full, and the index is dropped so the next start rebuilds it."""
        import json
        import shutil

        #: the shape each file must have: a cells row maps backends to releases to entries
        shape = {"transitions.json": list}.get(name, dict if name.startswith("cells/") else (dict, type(None)))
        try:
            value = json.loads((self._folder / name).read_text(encoding="utf-8"))
            if not isinstance(value, shape) or (name.startswith("cells/") and not (
                    value and all(isinstance(r, dict) and all(isinstance(e, dict) for e in r.values()) for r in value.values()))):
                raise ValueError(f"{name} is not what the index wrote")
            return value
        except (OSError, ValueError):
            shutil.rmtree(self._folder, ignore_errors=True)
            _VIEWS.pop(self._folder, None)
            full = load_support(self._source)
            if name.startswith("cells/"):
                model_type = next(m for m, f in self._meta["_index"]["cells"].items() if f == name)
                return full["cells"][model_type]
            return full.get(name.removesuffix(".json"))

    @property
    def backends_in_cells(self) -> list[str]:
        return list(self._meta["_index"]["backends"])

    def block_models(self) -> dict[str, list[str]]:
        """Block name -> the model types it holds (:func:`_block_models`, stored in the index; an index written
        before it was stored reads the blocks)."""
        stored = self._meta["_index"].get("block_models")
        return stored if isinstance(stored, dict) else _block_models(self)

    def __getitem__(self, key: str) -> Any:
        if key == "cells":
            return self._cells
        if key in self._meta["_index"]["lazy"]:
            if key not in self._lazy:
                self._lazy[key] = self._read(f"{key}.json", key)
            return self._lazy[key]
        if key == "_index" or key not in self._meta:
            raise KeyError(key)
        return self._meta[key]

    def __iter__(self) -> Any:
        return iter([*(k for k in self._meta if k != "_index"), "cells", *self._meta["_index"]["lazy"]])

    def __len__(self) -> int:
        return len(self._meta) + len(self._meta["_index"]["lazy"])


#: The views read in this process, by index folder (the folder's name changes with the file).
_VIEWS: dict[Path, SupportView] = {}


def load_support_view(path: str | Path | None = None) -> Mapping[str, Any]:
    """The support document for a quick answer (``packcheck lookup``): from its split index when one was built for
    these very bytes (the digest of the file), else loaded and validated in full (:func:`load_support`)
    and split for the next start. A fresh process then reads the index's ``meta.json`` and one architecture's rows,
    not 5 MB of JSON validated entry by entry (issue 47: 0.3 s -> see benchmarks/bench_lookup.py). An unwritable
    cache only costs the next start its speed.

    Raises:
        PackcheckUsageError: as :func:`load_support` (the full load names a missing, corrupt or foreign file).
    """
    p = Path(path) if path else default_support_file()
    folder = _index_dir(p)
    if folder is not None and folder in _VIEWS:
        return _VIEWS[folder]
    if folder is not None and (folder / "meta.json").is_file():
        try:
            _VIEWS[folder] = SupportView(folder, p)
            os.utime(folder)  # the newest by use is kept (INDEX_KEEP)
            return _VIEWS[folder]
        except (OSError, ValueError, AttributeError, TypeError):
            pass  # a damaged index: the full load below rebuilds it
    doc = load_support(path, version=folder.name if folder is not None else None)
    if folder is not None:
        try:
            _write_index(doc, folder)
        except OSError:
            pass
    return doc


@lru_cache(maxsize=4096)
def is_version(version: str) -> bool:
    """Whether ``version`` is a version (cached: the support file names its 40 releases 18,000 times)."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(version)
    except InvalidVersion:
        return False
    return True


def refuse_unknown_model_type(name: str, source: str, atlas: str | None = None) -> None:
    """Refuse a model type that neither the installed transformers (``CONFIG_MAPPING``) nor the atlas
    (``support.json``: every release it measured, so a type an older transformers had still passes) knows, before
    any environment is built. ``atlas``: the support file (default :func:`default_support_file`).

    Raises:
        PackcheckUsageError: naming ``name``, ``source``, where it was looked for and the closest known type.
    """
    from transformers import CONFIG_MAPPING, __version__

    from ..errors import closest

    if name in CONFIG_MAPPING:
        return
    try:
        doc = load_support(atlas)
        measured = list(doc["cells"])
    except PackcheckUsageError:  # no atlas to ask: the installed transformers alone decides
        measured = []
    if name in measured:
        return
    known = sorted({*CONFIG_MAPPING.keys(), *measured})
    raise PackcheckUsageError(
        f"Unknown model type '{name}' (from {source}): not a model_type of the installed transformers {__version__} "
        f"nor of any release the atlas measured ({atlas or default_support_file()}).{closest(name, known)} "
        "Give a key of transformers' CONFIG_MAPPING (python -c \"from transformers import CONFIG_MAPPING; "
        "print(sorted(CONFIG_MAPPING))\").")
