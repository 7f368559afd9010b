"""One release's run: its version environment runs the plugin on every architecture, resumable from its journal
(``<build>/<version>/``), or a finished results file is seeded as the run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError
from ..results.schema import read_results
from .plan import ATLAS_BACKENDS, DONE_MARKER, atlas_checks


def release_flags(report_dir: str, shard: tuple[int, int] | None = None, models: list[str] | None = None) -> list[str]:
    """The ``--packcheck-*`` flags of one release's run (or one shard of it), resumable from its journal: every
    architecture of the release (``--packcheck-all-architectures``) unless ``models`` names some."""
    from ..config.options import (
        OPT_ALL_ARCHS,
        OPT_BACKENDS,
        OPT_CHECKS,
        OPT_MODELS,
        OPT_REPORT_DIR,
        OPT_RESUME,
        OPT_SHARD,
    )

    flags = [f"{OPT_MODELS}={','.join(models)}" if models else OPT_ALL_ARCHS, f"{OPT_BACKENDS}={','.join(ATLAS_BACKENDS)}", f"{OPT_CHECKS}={','.join(atlas_checks())}",
             f"{OPT_REPORT_DIR}={report_dir}", OPT_RESUME]
    if shard and shard != (1, 1):
        flags.append(f"{OPT_SHARD}={shard[0]}/{shard[1]}")
    return flags


def reproduce_command(version: str, model_type: str | None = None, backend: str | None = None) -> str:
    """The command a user runs to measure one release (or one architecture / backend of it) again."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS

    if model_type is None:
        return f"packcheck atlas --releases {version}"
    return shlex.join(["packcheck", "audit", "--models", f"arch:{model_type}", "--versions", f"transformers=={version}",
                       f"{OPT_BACKENDS}={backend or ','.join(ATLAS_BACKENDS)}", f"{OPT_CHECKS}={','.join(atlas_checks())}"])


def release_dir(build: Path, version: str, shard: tuple[int, int] | None = None) -> Path:
    """``<build>/<version>`` (``<build>/<version>/shard-I-of-N`` for a shard)."""
    base = Path(build) / version
    return base / f"shard-{shard[0]}-of-{shard[1]}" if shard and shard != (1, 1) else base


def is_done(folder: Path) -> bool:
    """A release folder (or shard) holds a finished run: its ``atlas-done.json`` beside ``packcheck-matrix.json``.
    The one rule of both atlas axes (transformers, ``--trl``), measuring and ``--render-only``: a marker that is
    there is read (:func:`done_record`), so a corrupt one is an error, never a release silently left out.

    Raises:
        PackcheckUsageError: the marker exists but is not a JSON object (:func:`done_record`).
    """
    folder = Path(folder)
    if not (folder / DONE_MARKER).exists():
        return False
    done_record(folder)  # a corrupt marker: the one line naming it and the fix
    return (folder / "packcheck-matrix.json").exists()


def done_record(folder: Path) -> dict[str, Any]:
    """The finished run's record (``atlas-done.json``) of a release folder.

    Raises:
        PackcheckUsageError: the file is not a JSON object (hand-edited, cut off by a full disk), naming it and
            the fix: delete it, and the next ``packcheck atlas`` measures that release again (resuming its journal).
    """
    path = Path(folder) / DONE_MARKER
    from ..errors import parse_document, read_user_text

    try:
        record = parse_document(read_user_text(path, "Atlas run record", "delete it."), "json", "Atlas run record", "delete it.")
    except PackcheckUsageError as exc:
        record = exc
    if not isinstance(record, dict):
        why = f"not valid JSON ({record})" if isinstance(record, Exception) else f"a JSON {type(record).__name__}, not an object"
        raise PackcheckUsageError(f"Atlas run record {path} is {why}: delete it, and the next `packcheck atlas` measures "
                                  "that release again (resuming from its journal).")
    return record


def check_recorded_version(folder: Path, release: str, library: str, doc: dict[str, Any], record: dict[str, Any]) -> None:
    """A finished release folder's (or shard's: ``folder``; its release: ``release``) ``library`` version (``"transformers"``, or ``"trl"`` on the TRL axis) is the one
    its name says: the done record's (``atlas-done.json``) and the results file's own environment (each cell's
    version environment where cells carry one, else the document's) must agree with ``release``, the folder name. The file
    carries the version, so a file copied into another release's folder is never labelled by the folder.
    The one rule of both axes, before a release is reduced.

    Raises:
        PackcheckUsageError: a recorded version differs from the folder name: names the folder, the file, both
            versions and the fix (move the run to the folder of its own release, or delete the folder).
    """
    from packaging.version import InvalidVersion, Version

    folder = Path(folder)
    envs = [(c.get("env") or {}).get("environment") or {} for c in doc.get("cells", []) if c.get("env")]
    recorded = [(folder / DONE_MARKER, record.get(library))]
    recorded += [(folder / "packcheck-matrix.json", e.get(library)) for e in (envs or [doc.get("environment") or {}])]

    def same(version: Any) -> bool:
        try:
            return Version(str(version)) == Version(release)
        except InvalidVersion:
            return False

    for path, version in recorded:
        if version is not None and not same(version):
            raise PackcheckUsageError(
                f"Atlas release folder {folder} is {library} {release}, but {path} records {library} {version}: "
                f"move the run to the release folder named {version} (or delete {folder}, and the next "
                f"`packcheck atlas` measures {release} again).")


def run_release(version: str, build: Path, shard: tuple[int, int] | None = None, workers: int = 1,
                log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None,
                models: list[str] | None = None, flags: list[str] | None = None,
                reproduce: str | None = None, extras: tuple[str, ...] = ()) -> dict[str, Any]:
    """Measure one release into :func:`release_dir`: make (or find) ``transformers==version``'s environment and run
    the plugin there with :func:`release_flags` (or ``flags``, with ``reproduce`` its reproduce command: another
    block of the atlas, :mod:`.kinds`). Resumes a killed run (its journal); returns the done record
    (also written as ``atlas-done.json``), or a record with ``error`` when no results were written (uv's reason,
    or the run's last lines). ``extras``: distributions the environment also installs (:attr:`VersionCombo.extras`:
    pillow for the multimodal block's processors, :mod:`.kinds`), not in its label. ``runner``: replaces
    ``subprocess.run`` (tests)."""
    from ..versions.envs import EnvError, VersionCombo, ensure_env

    folder = release_dir(build, version, shard).resolve()
    if is_done(folder):
        return done_record(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpu0 = _child_cpu()
    resumed = _journaled_cells(folder)
    combo = VersionCombo((f"transformers=={version}",), extras=tuple(extras))
    try:
        env = ensure_env(combo)
    except EnvError as exc:
        record = {"transformers": version, "error": str(exc), "wall_s": round(time.perf_counter() - t0, 1)}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas {version}: no environment: {exc}")
        return record
    flags = [*(release_flags(str(folder.resolve()), shard, models) if flags is None else flags)]
    if workers > 1:
        flags += ["-n", str(workers), "--dist", "loadscope"]
    part = f" shard {shard[0]}/{shard[1]}" if shard and shard != (1, 1) else ""
    log(f"atlas {version}{part}: running in {env.path.name} "
        f"({'made' if env.created else 'cached'} {env.seconds:.1f} s); log {folder / 'atlas-run.log'}")
    proc = run_plugin_in_env(env.python, combo.label, folder, flags, reproduce or reproduce_command(version), runner)
    wall = round(time.perf_counter() - t0, 1)
    result = folder / "packcheck-matrix.json"
    failure = run_failure(folder, proc.returncode)
    if failure:
        record = {"transformers": version, "error": failure, "wall_s": wall}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas {version}: no complete results (exit {proc.returncode}); run again to resume")
        return record
    doc = read_results(result)
    record = {"transformers": env.versions.get("transformers", version), "requested": version, "shard": list(shard or (1, 1)),
              "cells": len(doc.get("cells", [])), "wall_s": wall, "child_cpu_s": round(_child_cpu() - cpu0, 1),
              "env_seconds": env.seconds, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if resumed:  # the time of the earlier, interrupted part is not known: the timings cover the last part only
        record.update(resumed=True, resumed_cells=resumed)
    if (env.info or {}).get("overrides"):  # made with audit/env_overrides.toml: the release's record says so
        record["overrides"] = env.info["overrides"]
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    (folder / "atlas-error.json").unlink(missing_ok=True)
    log(f"atlas {version}: {record['cells']} cells, {wall:.0f} s wall, {record['child_cpu_s']:.0f} s CPU")
    return record


def _journaled_cells(folder: Path) -> int:
    """Cells an earlier, interrupted run of this release left in its journal (one JSON line each), which this run
    reuses instead of measuring: the done record's ``wall_s`` / ``child_cpu_s`` then cover only the rest."""
    try:
        with (folder / "packcheck-journal.jsonl").open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def check_seed(results_file: Path) -> tuple[dict[str, Any], str]:
    """(the document, its transformers release) of a ``--seed`` file that can seed the atlas; ``packcheck atlas``
    checks every one up front, whatever the mode (``--list-releases`` included).

    Raises:
        PackcheckUsageError: the file does not load (:func:`~pytest_packcheck.results.load_document`: missing, not
            JSON, not a results document), ran in version environments, or lacks an atlas backend.
    """
    from ..results import load_document

    doc = load_document(results_file, "--seed")
    version = (doc.get("environment") or {}).get("transformers")
    settings = doc.get("settings") or {}
    if not version or settings.get("versions"):
        raise PackcheckUsageError(f"--seed '{results_file}' did not run in one transformers (its environment names "
                                  f"{version or 'none'}, versions {settings.get('versions')}): seed with one release's run.")
    lacking = [b for b in ATLAS_BACKENDS if b not in (settings.get("backends") or [])]
    if lacking or not settings.get("models"):
        raise PackcheckUsageError(f"--seed '{results_file}' lacks the atlas backends {', '.join(lacking)}: run "
                                  f"`{reproduce_command(version)}` instead.")
    return doc, version


def seed_release(results_file: Path, build: Path) -> dict[str, Any]:
    """Take a finished results JSON (e.g. ``reports/all-architectures/packcheck-matrix.json``, an
    ``--all-architectures`` run on every backend) as its release's atlas run instead of measuring it again: it
    becomes ``<build>/<its transformers>/`` with a done record naming the file as the source. Only the atlas's
    backends and checks are read from it later.

    Raises:
        PackcheckUsageError: the file does not load, ran in version environments, or lacks an atlas backend.
    """
    import shutil

    doc, version = check_seed(results_file)
    folder = release_dir(build, version).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(results_file, folder / "packcheck-matrix.json")
    record = {"transformers": version, "requested": version, "shard": [1, 1], "cells": len(doc.get("cells", [])),
              "wall_s": None, "child_cpu_s": None, "source": f"seeded from {results_file} ({doc.get('command', '')})",
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _child_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def generate(releases: list[str], build: Path, shard: tuple[int, int] | None = None, workers: int = 1,
             log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None,
             models: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every release not done yet, oldest first; a release that fails is recorded and the next one runs."""
    return [run_release(v, build, shard, workers, log, runner, models) for v in releases]

def run_plugin_in_env(python: Any, label: str, folder: Path, flags: list[str], reproduce: str,
                      runner: Callable[..., Any] | None = None) -> Any:
    """Run the packcheck plugin with ``flags`` under a version environment's ``python`` in ``folder/root`` (an
    empty rootdir), appending its output to ``folder/atlas-run.log``; the child sees no ``PACKCHECK_*`` but the
    cache dir, no ``VIRTUAL_ENV`` / ``PYTHONPATH`` (the environment's own site-packages), the combo ``label`` and
    the ``reproduce`` command, and one intra-op thread (``OMP_NUM_THREADS=1`` unless set): the atlas's tiny models
    gain nothing from more (4 architectures x 3 backends on 2 quiet cores: 9.0 s wall either way, 9.4 s CPU vs
    11.6 s with torch's default 2), and beside another job on the same cores 2 threads spin against each other
    (at load 5: 14-16 s wall / 9-10 s CPU vs 54-86 s / 35-56 s). Shared by the transformers and the TRL axes;
    ``runner`` replaces ``subprocess.run`` (tests). Without pytest's logging plugin (``-p no:logging``): it wraps
    each item's setup, call and teardown in handlers on the root logger, a quarter of the harness's wall in a
    release of 7,700 cells (cProfile of 5.25.0 resumed from a complete journal, nothing measured: 34.0 -> 29.6 s CPU
    without it, load 17-20, issue 47), and no verdict reads it: the checks read transformers' warnings through their
    own handler on its logger (:func:`~pytest_packcheck.checks.workbench.capture_warnings`). Returns the finished
    process."""
    from ..versions.envs import CHILD_ENV_VAR

    root = folder / "root"
    root.mkdir(exist_ok=True)
    args = [str(python), "-m", "pytest", "-p", "pytest_packcheck.plugin", "-p", "no:cacheprovider", "-p", "no:logging", str(root),
            "--rootdir", str(root), "-c", os.devnull, "-o", "addopts=", "-q", "-rN", "--tb=no",
            "-W", "ignore::pytest.PytestAssertRewriteWarning", *flags]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PACKCHECK_") or k == "PACKCHECK_CACHE_DIR"}
    child_env.pop("VIRTUAL_ENV", None)
    child_env.pop("PYTHONPATH", None)  # the environment's own site-packages (its overlay links this packcheck)
    child_env[CHILD_ENV_VAR] = label
    child_env["PACKCHECK_REPRODUCE"] = reproduce
    child_env.setdefault("OMP_NUM_THREADS", "1")
    with open(folder / "atlas-run.log", "a") as out:
        out.write(f"$ {shlex.join(args)}\n")
        out.flush()
        return (runner or subprocess.run)(args, check=False, stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=root)


def run_failure(folder: Path, returncode: int) -> str | None:
    """Why a run in ``folder`` gave no complete results (no ``packcheck-matrix.json``, or an exit other than pytest's
    0 / 1), with the log's last lines; None when it did."""
    if (folder / "packcheck-matrix.json").exists() and returncode in (0, 1):
        return None
    tail = " | ".join((folder / "atlas-run.log").read_text(errors="replace").strip().splitlines()[-3:])[:400]
    return f"exit {returncode}; {tail}"
