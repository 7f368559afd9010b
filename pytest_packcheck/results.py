"""Cell records, the results JSON (schema, environment fingerprint), load and write."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import PackcheckUsageError, scrub_secrets

#: 2: cells carry ``role`` (from the check registry), ``cause``, ``evidence`` and ``findings`` (cause codes the
#: check returned). A version-1 file is upgraded on load (role from the registry, no cause codes).
SCHEMA_VERSION = 2

#: Verdicts, worst first. ``error``: crashed (exception, or the signal that killed the isolated child).
#: ``timeout``: no result within --packcheck-timeout. ``oom``: out of memory (with the memory figures).
#: ``fallback``: the requested backend is not what ran. ``unsupported``: the stack refuses packing with an
#: explicit error. ``skipped``: this environment lacks something.
STATUSES = ("error", "timeout", "oom", "fail", "fallback", "unsupported", "skipped", "pass")
SYMBOLS = {"pass": "✅", "fail": "❌", "fallback": "⚠️", "unsupported": "🚫", "skipped": "⏭️", "error": "💥",
           "timeout": "⏱️", "oom": "🧱"}


@dataclass
class CheckResult:
    """What a check returns: a verdict, the numbers it measured, a one-line message, and the cause code
    (:data:`registry.CAUSES`) of a verdict that is not a pass, with its evidence (numbers). ``findings``: causes
    the check's probes saw beside its verdict, as ``{"cause", "evidence"}`` records (e.g. a two-row probe)."""

    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    cause: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    #: every cause of the verdict, each with its own numbers, primary first: ``[{"cause": code, "evidence": {...}}]``
    #: (``cause`` / ``evidence`` are the first entry). A cell failing for several reasons lists each (issue 23.2).
    causes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {STATUSES}")
        from .checks.registry import CAUSES

        _align_causes(self)
        for code in [self.cause, *(f.get("cause") for f in self.findings), *(c.get("cause") for c in self.causes)]:
            if code is not None and code not in CAUSES:
                raise ValueError(f"unknown cause {code!r}; expected one of {tuple(CAUSES)}")


@dataclass
class CellResult:
    """One cell of the matrix: model x backend x check x dtype."""

    cell_id: str
    model: dict[str, Any]
    backend: str | None
    check: str
    dtype: str
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    duration_s: float = 0.0
    tolerances: dict[str, float] = field(default_factory=dict)
    #: the version environment the cell ran in (label, requirements, resolved versions, its environment()),
    #: None when it ran in the environment of the report
    env: dict[str, Any] | None = None
    #: the check's role (registry): correctness decides the cell's headline; hazards and findings do not
    role: str = "correctness"
    cause: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    #: :attr:`CheckResult.causes`: every cause of the verdict, primary first (a file without it: ``[cause]``)
    causes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from .checks.registry import role

        self.role = role(self.check)
        _align_causes(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=_jsonable)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _align_causes(result: Any) -> None:
    """``cause`` / ``evidence`` and ``causes`` tell one story: the primary cause is ``causes[0]``; a result given
    only one of them gets the other; a cause repeated in ``causes`` is kept once (the first, with its numbers)."""
    if result.causes:
        seen: set[str] = set()
        result.causes = [c for c in result.causes if c.get("cause") and not (c["cause"] in seen or seen.add(c["cause"]))]
    if result.cause and (not result.causes or result.causes[0]["cause"] != result.cause):
        result.causes = [{"cause": result.cause, "evidence": result.evidence},
                         *(c for c in result.causes if c["cause"] != result.cause)]
    elif result.causes and not result.cause:
        result.cause, result.evidence = result.causes[0]["cause"], dict(result.causes[0].get("evidence") or {})


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _package_version() -> str | None:
    """packcheck's version where it runs without its distribution (a version environment links the package)."""
    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    except OSError:
        return None
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else None


def environment(device: str = "cpu") -> dict[str, Any]:
    """The versions and hardware a result was measured on. No paths, no tokens."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "packcheck": _version("packcheck") or _package_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "trl": _version("trl"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "device": device,
        "cuda": None,
        "device_name": platform.processor() or platform.machine(),
        "cpu_threads": None,
    }
    from .backends import stand_in_active

    if stand_in_active():
        env["torch_varlen_kernel"] = "stand-in"  # PACKCHECK_TORCH_VARLEN_STAND_IN=1: a CPU rehearsal
    try:
        import torch

        env["cuda"] = torch.version.cuda
        env["cpu_threads"] = torch.get_num_threads()
        if device.startswith("cuda"):
            env["device_name"] = cuda_device_name(device)
    except ImportError:
        pass
    return env


def cuda_device_name(device: str) -> str:
    """The GPU's name without initialising CUDA in this process (``nvidia-smi``): the audit's controller forks
    the children that run the cells, and a child of a process that initialised CUDA cannot use it ("Cannot
    re-initialize CUDA in forked subprocess"). Falls back to torch once CUDA is initialised here anyway.

    nvidia-smi numbers GPUs in PCI order, CUDA fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: with
    different GPU models and another order, the names of all are given rather than a guess.
    """
    import shutil
    import subprocess

    names: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], check=False,
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        names = [line.strip() for line in out.splitlines() if line.strip()]
    if len(set(names)) == 1:
        return names[0]
    if names:
        index = device.split(":", 1)[1] if ":" in device else "0"
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if visible and index.isdigit() and int(index) < len(visible):
            index = visible[int(index)]
        if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and index.isdigit() and int(index) < len(names):
            return names[int(index)]
        return " / ".join(sorted(set(names))) + f" (mixed GPUs; which one is {device} depends on CUDA_DEVICE_ORDER)"
    import torch

    if torch.cuda.is_initialized():  # never is_available() first: it poisons fork unless asked through NVML
        return torch.cuda.get_device_name(torch.device(device))
    return "unknown GPU (no nvidia-smi; CUDA not initialised in the controller)"


def build_document(cells: list[CellResult], env: dict[str, Any], settings: dict[str, Any], command: str) -> dict[str, Any]:
    """The results JSON: schema_version, environment, settings, the reproducing command, and the cells."""
    return {
        "schema_version": SCHEMA_VERSION,
        "packcheck_version": env.get("packcheck"),
        "environment": env,
        "settings": settings,
        "command": command,
        "cells": [json.loads(c.to_json()) for c in sorted(cells, key=lambda c: c.cell_id)],
    }


def scrub(text: str) -> str:
    """Remove what must never reach a report, journal or log: the values of secret-looking environment
    variables (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, ..., 8+ characters) become ``***``, and the home directory
    becomes ``~``."""
    text = scrub_secrets(text)
    home = os.path.expanduser("~")
    if len(home) > 1:
        text = text.replace(home, "~")
    return text


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


def atomic_write(path: Path, text: str, flag: str = "--packcheck-report-dir") -> None:
    """Write via a temp file in the same folder and rename, so a kill never leaves half a file. The text is
    :func:`scrub`-bed first; temp files of a killed earlier write are removed.

    Raises:
        PackcheckUsageError: the folder cannot be created or written (a full disk says so).
    """
    write_set([(Path(path), text)], flag)


def cell_problem(cell: Any) -> str | None:
    """What makes ``cell`` (a results-file cell or a journal line's cell) unusable, or None: the fields every
    reader indexes must be there with the right types."""
    if not isinstance(cell, dict):
        return f"a cell is a JSON {type(cell).__name__}, not an object"
    name = cell.get("cell_id", "?")
    for key, kind in (("cell_id", str), ("check", str), ("dtype", str), ("status", str), ("model", dict)):
        if not isinstance(cell.get(key), kind):
            return f"cell {name!r} has {key}={cell.get(key)!r} (expected a {kind.__name__})"
    if cell["status"] not in STATUSES:
        return f"cell {name!r} has unknown status {cell['status']!r} (expected one of {', '.join(STATUSES)})"
    if not isinstance(cell.get("backend"), str | None):
        return f"cell {name!r} has backend={cell.get('backend')!r} (expected a string or null)"
    for key, kind in (("metrics", dict), ("tolerances", dict), ("message", str), ("env", dict)):
        if key in cell and not isinstance(cell[key], kind) and not (key == "env" and cell[key] is None):
            return f"cell {name!r} has \"{key}\": {json.dumps(cell[key])[:40]} (expected a {'JSON object' if kind is dict else 'string'})"
    if not isinstance(cell["model"].get("label"), str):
        return f"cell {name!r} has a model without a label"
    unbacked = unbacked_pass(cell["check"], cell["status"], cell.get("metrics") or {})
    if unbacked:
        return f"cell {name!r} passes on {unbacked[0]}={json.dumps(unbacked[1])[:40]} (expected a finite number)"
    return None


def unbacked_pass(check: str, status: str, metrics: dict[str, Any]) -> tuple[str, Any] | None:
    """(key, value) when a pass rests on a key number (the registry's ``key_metric``, which the gate compares)
    that is not a finite number: NaN, infinity or text cannot back a verdict. None otherwise, and for a check
    whose key number is not in ``metrics``. The runner turns such a pass into an error; a results file holding
    one is corrupt."""
    from .checks.registry import SPECS

    spec = SPECS.get(check)
    if status != "pass" or not spec or not spec.key_metric or spec.key_metric[0] not in metrics:
        return None
    value = metrics[spec.key_metric[0]]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return spec.key_metric[0], value
    return None


def load_document(path: str | Path) -> dict[str, Any]:
    """Load a results JSON written by packcheck.

    Raises:
        PackcheckUsageError: missing, a directory, not JSON, a schema_version newer than this packcheck reads,
            or no valid cells.
    """
    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():  # /dev/zero would be read for ever
        raise PackcheckUsageError(f"Results file {p} is not a regular file (a device or a pipe): pass a packcheck-matrix.json file.")
    try:
        # scrubbed as read: a results file from elsewhere may carry a token, which gate / merge would print
        data = json.loads(scrub_secrets(p.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise PackcheckUsageError(f"Results file {p} does not exist: run `packcheck audit` first.") from None
    except json.JSONDecodeError as exc:
        raise PackcheckUsageError(f"Results file {p} is not valid JSON ({exc.msg}, line {exc.lineno}).") from None
    except IsADirectoryError:
        raise PackcheckUsageError(f"Results file {p} is a directory: pass a packcheck-matrix.json file.") from None
    except UnicodeDecodeError as exc:
        raise PackcheckUsageError(f"Results file {p} is not UTF-8 text (byte {exc.start}): it is not a packcheck results "
                                  "file; pass the packcheck-matrix.json an audit wrote.") from None
    except OSError as exc:
        raise PackcheckUsageError(f"Results file {p} cannot be read ({exc.strerror}): pass a readable packcheck-matrix.json.") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int):
        raise PackcheckUsageError(f"Results file {p} has no schema_version: it was not written by packcheck.")
    if version > SCHEMA_VERSION:
        raise PackcheckUsageError(
            f"Results file {p} has schema_version {version}, newer than {SCHEMA_VERSION} that this packcheck reads: "
            "upgrade packcheck."
        )
    for key in ("settings", "environment"):
        if key in data and not isinstance(data[key], dict):
            raise PackcheckUsageError(f"Results file {p} is corrupt: \"{key}\" is {json.dumps(data[key])[:40]} (expected a JSON "
                                      "object). Regenerate it with `packcheck audit`.")
    for key, value in (data.get("settings") or {}).items():
        if key in ("models", "backends", "checks", "dtypes", "versions") and not (
                isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise PackcheckUsageError(f"Results file {p} is corrupt: \"settings\".\"{key}\" is {json.dumps(value)[:40]} "
                                      "(expected a list of strings). Regenerate it with `packcheck audit`.")
    cells = data.get("cells")
    required = ("cell_id", "model", "backend", "check", "dtype", "status")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and all(k in c for k in required) for c in cells):
        raise PackcheckUsageError(
            f"Results file {p} has no valid 'cells' list (each cell needs {', '.join(required)}): it is not a packcheck results file."
        )
    if not all(isinstance(c["model"], dict) and "label" in c["model"] for c in cells):
        raise PackcheckUsageError(f"Results file {p} has cells whose 'model' lacks a label: it is not a packcheck results file.")
    problem = next((cell_problem(c) for c in cells if cell_problem(c)), None)
    if problem:
        raise PackcheckUsageError(f"Results file {p} is corrupt: {problem}. Regenerate it with `packcheck audit`.")
    data.setdefault("environment", {})
    return upgrade(data)


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Bring an older results document to :data:`SCHEMA_VERSION` in place: version 1 cells get their role from
    the registry and empty cause codes (their diagnosis, if any, is kept)."""
    from .checks.registry import role

    if data.get("schema_version", SCHEMA_VERSION) < 2:
        for c in data.get("cells", []):
            c.setdefault("role", role(c["check"]))
            c.setdefault("cause", None)
            c.setdefault("evidence", {})
            c.setdefault("findings", [])
        data["schema_version"] = SCHEMA_VERSION
    return data
