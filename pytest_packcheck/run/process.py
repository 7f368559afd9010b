"""What a run needs from the process and the machine it runs on: one run per report folder (a lock with an
owner file), a GPU per xdist worker, a share of the cores per worker, SIGTERM handled like Ctrl-C, and whether a
forked child could still use CUDA."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..errors import PackcheckUsageError, PackcheckWarning


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

    from ..results.io import atomic_write

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
        from ..results.io import write_failure

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


def check_inputs(config: pytest.Config, settings: Any) -> Any:
    """On the controller, before any cell runs: load the baseline and check the versions and the device (before
    the folder is touched), then create the report folder and write a probe file, so each problem is a usage
    error now rather than a traceback later. Returns
    the report folder's lock (:func:`hold_report_dir`), None on an xdist worker.

    Raises:
        PackcheckUsageError: the folder, the baseline, a version or the device is unusable.
    """
    if hasattr(config, "workerinput"):
        return None
    path = Path(settings.report_dir)
    from ..results.io import probe_folder

    _check_run_inputs(path, settings)  # before the folder is made or held: a refused run leaves it as it was
    probe_folder(path, getattr(settings, "report_dir_source", None) or "--packcheck-report-dir")  # a full disk: refused now
    return hold_report_dir(path, "--packcheck-report-dir")  # one run per report folder, released by the session


def _check_run_inputs(path: Path, settings: Any) -> None:
    """The report files are not folders, the baseline loads, the versions exist, the CUDA device is there.

    Raises:
        PackcheckUsageError: the first of them that does not hold.
    """
    from ..report.formats import REPORT_FILES

    for name in (*REPORT_FILES, "packcheck-journal.jsonl"):
        try:
            is_dir = (path / name).is_dir()
        except OSError:  # a path the OS refuses (a name over 255 bytes: an INTERNALERROR, trial 4): probe_folder names it
            is_dir = False
        if is_dir:
            raise PackcheckUsageError(
                f"'{path / name}' (in --packcheck-report-dir) is a directory: packcheck writes a file there; "
                "move it or pass another --packcheck-report-dir."
            )
    if settings.baseline:
        from ..analysis.gate import refuse_empty_baseline
        from ..results.schema import load_document

        # missing, corrupt, newer or empty: a usage error before any cell runs
        refuse_empty_baseline(load_document(settings.baseline, settings.baseline_source), settings.baseline,
                              settings.baseline_source)
    if getattr(settings, "versions", None):
        # before any environment is built: a release that does not exist is a usage error naming the nearest
        # ones (issue 27: transformers==5.25.0, not released, gave 13 "crash" regressions)
        from ..config.options import OPT_VERSIONS
        from ..versions.releases import validate_versions

        for note in validate_versions(list(settings.versions), getattr(settings, "versions_source", None) or OPT_VERSIONS):
            warnings.warn(PackcheckWarning(note))
    if settings.device.startswith("cuda"):
        # torch.cuda.is_available() calls cudaGetDeviceCount, which "poisons fork": the per-model children
        # forked later could not use CUDA. Asked through NVML it does not (torch/cuda/__init__.py).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        import torch

        if not torch.cuda.is_available():
            raise PackcheckUsageError(
                f"Device '{settings.device}' (from {settings.device_source}) is not available: torch "
                f"{torch.__version__} sees no CUDA device. Use --packcheck-device=cpu."
            )


#: The signals that stop a run: Ctrl-C, and SIGTERM from CI limits and ``kill`` (:func:`stop_on_sigterm`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_sigterm(config: pytest.Config) -> None:
    """On the controller, SIGTERM (what CI time limits and `kill` send) stops the run the way Ctrl-C does, so
    the matrix of the cells that finished is written, marked incomplete, instead of the process dying with the
    previous run's matrix left in place. Only where nothing else handles SIGTERM (and SIGINT: Python's own
    handler). The first stop signal raises KeyboardInterrupt; the ones after it only say that the run is
    stopping: ``timeout`` sends SIGTERM to the process and to its group (two signals), a user presses Ctrl-C
    twice, and the second one raised inside pytest's own interrupt handling: a traceback, exit 1 and a matrix that
    named no cell (trial 9, 59 / 62). SIGKILL still stops at once."""
    import threading

    if hasattr(config, "workerinput") or threading.current_thread() is not threading.main_thread():
        return
    owned = [sig for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))
             if signal.getsignal(sig) is default]
    for sig in owned:
        _OWNED_STOP_SIGNALS[sig] = signal.signal(sig, _stop)


def release_stop_signals() -> None:
    """Give the stop signals back to the handlers :func:`stop_on_sigterm` found (pytest_unconfigure): a process
    that runs several sessions (pytester, ``packcheck audit`` called in-process) keeps Python's own Ctrl-C."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_OWNED_STOP_SIGNALS.items()):
        if signal.getsignal(sig) in (_stop, _already_stopping):
            signal.signal(sig, previous)
        del _OWNED_STOP_SIGNALS[sig]


#: The stop signals :func:`stop_on_sigterm` handles in this process, with the handler each had before.
_OWNED_STOP_SIGNALS: dict[int, Any] = {}


def _stop(signum: int, frame: Any) -> None:
    """The first stop signal: KeyboardInterrupt (SIGINT's plain, SIGTERM's naming it); later ones are noted only."""

    for sig in _OWNED_STOP_SIGNALS:
        signal.signal(sig, _already_stopping)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


@contextlib.contextmanager
def already_stopping() -> Iterator[None]:
    """While the files of a run that is stopping are put right (``packcheck audit`` removing the previous matrix
    after an interrupt), a further SIGINT / SIGTERM is only noted: a second Ctrl-C 10 ms after the first left the
    earlier run's matrix in place beside a traceback (trial 9, 211). The handlers are given back after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _already_stopping) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _already_stopping(signum: int, frame: Any) -> None:
    import os

    os.write(2, b"\npackcheck: already stopping: the finished cells are being written (kill -9 stops at once)\n")


def pin_worker_gpu(config: pytest.Config, device: str) -> None:
    """Under pytest-xdist on a machine with several GPUs, give each worker its own (CUDA_VISIBLE_DEVICES),
    before anything initialises CUDA in the worker. One GPU or none: nothing changes."""
    worker = getattr(config, "workerinput", None)
    if worker is None or not device.startswith("cuda"):
        return
    chosen = gpu_for_worker(str(worker.get("workerid", "")), visible_gpus())
    if chosen is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen


def limit_threads(config: pytest.Config, tiny: bool = False) -> None:
    """Under pytest-xdist, give each worker its share of the cores: tiny models on oversubscribed torch
    thread pools run several times slower (2 workers x 2 threads on 2 cores). ``tiny`` (packcheck's shrunk
    random-weight models on CPU): one intra-op thread in any process, xdist or not: their matmuls are too small to
    split, and an OpenMP team's threads spin on a busy machine (the default audit with ``-n 0``, eager and sdpa, on
    2 shared cores at load 7 to 10, ``benchmarks/profile_audit.py --cpu-only``, torch 2.13.0+cpu: its cell children
    took 165 s of CPU on two threads, then 7.9 s on one, run back to back; another pair at load 7.3 gave 7.4 s on two
    and 7.6 s on one: two threads never helped, and sometimes cost 20x). ``OMP_NUM_THREADS`` set by the user wins."""
    worker = getattr(config, "workerinput", None)
    if os.environ.get("OMP_NUM_THREADS") or (worker is None and not tiny):
        return
    import torch

    workers = int(worker.get("workercount", 1) or 1) if worker is not None else 1
    torch.set_num_threads(1 if tiny else max(1, (os.cpu_count() or 1) // workers))


def fork_poisoned() -> bool:
    """True when a child forked from this process could not use CUDA: this process initialised CUDA, or
    something here asked the driver in a way that "poisons fork" (torch.cuda.is_available() without
    PYTORCH_NVML_BASED_CUDA_CHECK=1, say), which a forked probe reads from torch's own bad-fork flag (a probe
    that fails counts as poisoned)."""
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
    return unusable
