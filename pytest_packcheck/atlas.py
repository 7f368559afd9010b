"""``packcheck atlas``: every architecture x backend x transformers release, resumable, and its outputs.

One release at a time: the release's version environment (:mod:`pytest_packcheck.envs`, made with uv and cached)
runs the packcheck plugin with ``--packcheck-all-architectures`` (the architectures *that* release has), on
:data:`ATLAS_BACKENDS`, with the checks that decide a cell and the hazards (:data:`ATLAS_CHECKS`), writing
``<build>/<version>/packcheck-matrix.json`` and its journal there. A killed run is resumed with
``--packcheck-resume`` (the journal keeps every finished cell); a release whose ``atlas-done.json`` exists is not
run again. :func:`collect` reduces the per-release results to ``support.json`` (schema: ``reports/atlas/SCHEMA.md``),
seeded from the committed ``support.json`` (its releases count as measured and are not run again, so a fresh
checkout, whose git-ignored build folder is empty, adds releases and drops none), and :func:`write_outputs` renders ``atlas.md`` and the self-contained ``atlas.html`` from it.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PackcheckUsageError

#: The backends of the atlas: the two dense-mask paths every release has, and the flash varlen path through the
#: CPU reference kernel (``packcheck_flash_ref``; its floor is transformers 4.44).
ATLAS_BACKENDS: tuple[str, ...] = ("eager", "sdpa", "packcheck_flash_ref")
#: The oldest minor of the atlas (the varlen reference's floor).
ATLAS_SINCE = "4.44"
#: ``support.json`` schema version (reports/atlas/SCHEMA.md); bump on an incompatible change.
SUPPORT_SCHEMA_VERSION = 1
#: Marker written into a release's build folder once its run ended with a results file.
DONE_MARKER = "atlas-done.json"
#: The flash-family attn_implementation values a lookup answers from the packcheck_flash_ref column.
FLASH_FAMILY = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", "kernels-community/flash-attn3",
                "packcheck_flash_torch_varlen", "packcheck_flash_ref")


def atlas_checks() -> tuple[str, ...]:
    """The checks the atlas runs, from the registry: every default (non-training) check whose role decides a
    cell (``correctness``) or is a stack hazard (``hazard``); the collator findings are left out."""
    from .registry import DEFAULT_CHECKS, SPECS

    return tuple(c for c in DEFAULT_CHECKS if SPECS[c].role in ("correctness", "hazard"))


def _vkey(version: str) -> Any:
    from packaging.version import Version

    return Version(version)


def latest_patches(releases: list[str], since: str = ATLAS_SINCE, until: str | None = None) -> list[str]:
    """The latest patch release of every minor from ``since`` (e.g. "4.44") to ``until`` (default: the newest),
    ascending. ``releases``: final, not yanked releases (:func:`pytest_packcheck.bisect.parse_simple_index`).

    Raises:
        PackcheckUsageError: ``since`` / ``until`` is not a version.
    """
    from packaging.version import InvalidVersion, Version

    try:
        low = Version(since)
        high = Version(until) if until else None
    except InvalidVersion as exc:
        raise PackcheckUsageError(f"--since / --until: {exc}: write a release such as 4.44 or 5.24.") from None
    best: dict[tuple[int, int], Version] = {}
    for text in releases:
        v = Version(text)
        if v.is_prerelease or v.is_devrelease or (v.major, v.minor) < (low.major, low.minor):
            continue
        if high is not None and (v.major, v.minor) > (high.major, high.minor):
            continue
        key = (v.major, v.minor)
        if key not in best or v > best[key]:
            best[key] = v
    return [str(best[k]) for k in sorted(best)]


def index_releases(since: str = ATLAS_SINCE, until: str | None = None) -> list[str]:
    """:func:`latest_patches` of transformers from the package index (``$PACKCHECK_INDEX_URL`` or PyPI).

    Raises:
        PackcheckUsageError: the index cannot be reached.
    """
    from .bisect import fetch_index_page, parse_simple_index

    try:
        page = fetch_index_page("transformers")
    except PackcheckUsageError as exc:
        raise PackcheckUsageError(str(exc).replace("bisect needs", "packcheck atlas needs")
                                  + " Or name the releases with --releases 4.44.2,5.24.0.") from None
    releases, _ = parse_simple_index(page)
    return latest_patches(releases, since, until)


def parse_release_list(text: str, source: str) -> list[str]:
    """``"4.44.2,5.24.0"`` -> exact releases, ascending.

    Raises:
        PackcheckUsageError: an item is not an exact release (e.g. ``4.44`` or ``>=4.44``).
    """
    from packaging.version import InvalidVersion, Version

    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            v = Version(item)
        except InvalidVersion:
            raise PackcheckUsageError(f"Release '{item}' (from {source}) is not a version: write exact releases such as "
                                      "4.44.2,5.24.0 (or use --since / --until for every minor's latest patch).") from None
        if len(v.release) < 3:
            raise PackcheckUsageError(f"Release '{item}' (from {source}) names a minor, not a release: write its patch, "
                                      f"e.g. {item}.0 (or use --since {item} --until {item} for its latest patch).")
        out.append(str(v))
    if not out:
        raise PackcheckUsageError(f"{source} names no release: write e.g. 4.44.2,5.24.0.")
    return sorted(dict.fromkeys(out), key=Version)


def parse_shard(text: str, source: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4), as ``--packcheck-shard`` reads it.

    Raises:
        PackcheckUsageError: not I/N with 1 <= I <= N.
    """
    i, _, n = str(text).partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise PackcheckUsageError(f"Bad shard '{text}' (from {source}): write I/N with 1 <= I <= N, e.g. {source} 2/4.")
    return int(i), int(n)


def gap_order(planned: list[str], measured: list[str]) -> list[str]:
    """The releases of ``planned`` not in ``measured``, in the order that narrows the gaps between measured
    releases fastest: the first release of a new major version first (the transition across a major is the one
    users ask about most), then, repeatedly, the middle of the widest run of unmeasured minors (the oldest such
    run on a tie), so each added release halves a gap and every transition found is between close releases."""
    have = set(measured)
    order = [v for v in planned if v not in have and _vkey(v).minor == 0 and _vkey(v).micro == 0
             and any(_vkey(m).major < _vkey(v).major for m in have)]
    have |= set(order)
    while True:
        runs: list[list[str]] = [[]]
        for v in planned:
            if v in have:
                runs.append([])
            else:
                runs[-1].append(v)
        widest = max(runs, key=len)
        if not widest:
            return order
        pick = widest[(len(widest) - 1) // 2]
        order.append(pick)
        have.add(pick)


# ----------------------------------------------------------------------------------------------------------------
# One release


def release_flags(report_dir: str, shard: tuple[int, int] | None = None, models: list[str] | None = None) -> list[str]:
    """The ``--packcheck-*`` flags of one release's run (or one shard of it), resumable from its journal: every
    architecture of the release (``--packcheck-all-architectures``) unless ``models`` names some."""
    from .settings import OPT_ALL_ARCHS, OPT_BACKENDS, OPT_CHECKS, OPT_MODELS, OPT_REPORT_DIR, OPT_RESUME, OPT_SHARD

    flags = [f"{OPT_MODELS}={','.join(models)}" if models else OPT_ALL_ARCHS, f"{OPT_BACKENDS}={','.join(ATLAS_BACKENDS)}", f"{OPT_CHECKS}={','.join(atlas_checks())}",
             f"{OPT_REPORT_DIR}={report_dir}", OPT_RESUME]
    if shard and shard != (1, 1):
        flags.append(f"{OPT_SHARD}={shard[0]}/{shard[1]}")
    return flags


def reproduce_command(version: str, model_type: str | None = None, backend: str | None = None) -> str:
    """The command a user runs to measure one release (or one architecture / backend of it) again."""
    from .settings import OPT_BACKENDS, OPT_CHECKS

    if model_type is None:
        return f"packcheck atlas --releases {version}"
    return shlex.join(["packcheck", "audit", "--models", f"arch:{model_type}", "--versions", f"transformers=={version}",
                       f"{OPT_BACKENDS}={backend or ','.join(ATLAS_BACKENDS)}", f"{OPT_CHECKS}={','.join(atlas_checks())}"])


def release_dir(build: Path, version: str, shard: tuple[int, int] | None = None) -> Path:
    """``<build>/<version>`` (``<build>/<version>/shard-I-of-N`` for a shard)."""
    base = Path(build) / version
    return base / f"shard-{shard[0]}-of-{shard[1]}" if shard and shard != (1, 1) else base


def is_done(folder: Path) -> bool:
    return (folder / DONE_MARKER).exists() and (folder / "packcheck-matrix.json").exists()


def run_release(version: str, build: Path, shard: tuple[int, int] | None = None, workers: int = 1,
                log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None,
                models: list[str] | None = None) -> dict[str, Any]:
    """Measure one release into :func:`release_dir`: make (or find) ``transformers==version``'s environment and run
    the plugin there with :func:`release_flags`. Resumes a killed run (its journal); returns the done record
    (also written as ``atlas-done.json``), or a record with ``error`` when no results were written (uv's reason,
    or the run's last lines). ``runner``: replaces ``subprocess.run`` (tests)."""
    from .envs import CHILD_ENV_VAR, EnvError, VersionCombo, ensure_env

    folder = release_dir(build, version, shard).resolve()
    if is_done(folder):
        return json.loads((folder / DONE_MARKER).read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpu0 = _child_cpu()
    combo = VersionCombo((f"transformers=={version}",))
    try:
        env = ensure_env(combo)
    except EnvError as exc:
        record = {"transformers": version, "error": str(exc), "wall_s": round(time.perf_counter() - t0, 1)}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas {version}: no environment: {exc}")
        return record
    root = folder / "root"
    root.mkdir(exist_ok=True)
    args = [str(env.python), "-m", "pytest", "-p", "pytest_packcheck.plugin", "-p", "no:cacheprovider", str(root),
            "--rootdir", str(root), "-c", os.devnull, "-o", "addopts=", "-q", "-rN", "--tb=no",
            "-W", "ignore::pytest.PytestAssertRewriteWarning", *release_flags(str(folder.resolve()), shard, models)]
    if workers > 1:
        args += ["-n", str(workers), "--dist", "loadscope"]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PACKCHECK_") or k == "PACKCHECK_CACHE_DIR"}
    child_env.pop("VIRTUAL_ENV", None)
    child_env.pop("PYTHONPATH", None)  # the environment's own site-packages (its overlay links this packcheck)
    child_env[CHILD_ENV_VAR] = combo.label
    child_env["PACKCHECK_REPRODUCE"] = reproduce_command(version)
    part = f" shard {shard[0]}/{shard[1]}" if shard and shard != (1, 1) else ""
    log(f"atlas {version}{part}: running in {env.path.name} "
        f"({'made' if env.created else 'cached'} {env.seconds:.1f} s); log {folder / 'atlas-run.log'}")
    with open(folder / "atlas-run.log", "a") as out:
        out.write(f"$ {shlex.join(args)}\n")
        out.flush()
        proc = (runner or subprocess.run)(args, check=False, stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=root)
    wall = round(time.perf_counter() - t0, 1)
    result = folder / "packcheck-matrix.json"
    if not result.exists() or proc.returncode not in (0, 1):
        tail = " | ".join((folder / "atlas-run.log").read_text(errors="replace").strip().splitlines()[-3:])[:400]
        record = {"transformers": version, "error": f"exit {proc.returncode}; {tail}", "wall_s": wall}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas {version}: no complete results (exit {proc.returncode}); run again to resume")
        return record
    doc = json.loads(result.read_text())
    record = {"transformers": env.versions.get("transformers", version), "requested": version, "shard": list(shard or (1, 1)),
              "cells": len(doc.get("cells", [])), "wall_s": wall, "child_cpu_s": round(_child_cpu() - cpu0, 1),
              "env_seconds": env.seconds, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    (folder / "atlas-error.json").unlink(missing_ok=True)
    log(f"atlas {version}: {record['cells']} cells, {wall:.0f} s wall, {record['child_cpu_s']:.0f} s CPU")
    return record


def seed_release(results_file: Path, build: Path) -> dict[str, Any]:
    """Take a finished results JSON (e.g. ``reports/all-architectures/packcheck-matrix.json``, an
    ``--all-architectures`` run on every backend) as its release's atlas run instead of measuring it again: it
    becomes ``<build>/<its transformers>/`` with a done record naming the file as the source. Only the atlas's
    backends and checks are read from it later.

    Raises:
        PackcheckUsageError: the file does not load, ran in version environments, or lacks an atlas backend.
    """
    import shutil

    from .results import load_document

    doc = load_document(results_file)
    version = (doc.get("environment") or {}).get("transformers")
    settings = doc.get("settings") or {}
    if not version or settings.get("versions"):
        raise PackcheckUsageError(f"--seed '{results_file}' did not run in one transformers (its environment names "
                                  f"{version or 'none'}, versions {settings.get('versions')}): seed with one release's run.")
    lacking = [b for b in ATLAS_BACKENDS if b not in (settings.get("backends") or [])]
    if lacking or not settings.get("models"):
        raise PackcheckUsageError(f"--seed '{results_file}' lacks the atlas backends {', '.join(lacking)}: run "
                                  f"`{reproduce_command(version)}` instead.")
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


# ----------------------------------------------------------------------------------------------------------------
# Reduction to support.json


def _number(cell: dict[str, Any]) -> float | None:
    from .report import KEY_METRIC

    key = KEY_METRIC.get(cell["check"])
    value = (cell.get("metrics") or {}).get(key[0]) if key else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def reduce_release(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """One release's results document -> ``{model_type: {backend: entry}}`` (entry: SCHEMA.md ``cells``).

    The verdict is the matrix's headline (:func:`pytest_packcheck.report.headline`: the worst correctness check;
    hazards never decide it); ``number`` is the key number of the check that decided it (the first failing one,
    else isolation's ``max_change``)."""
    from .report import headline

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in doc.get("cells", []):
        if cell.get("backend") not in ATLAS_BACKENDS or cell.get("dtype") != "float32":
            continue
        model = cell["model"]
        name = model.get("model_type") or model.get("label")
        groups.setdefault((name, cell["backend"]), []).append(cell)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (name, backend), group in sorted(groups.items()):
        h = headline(group)
        decider = h["bad"][0] if h["bad"] else next((c for c in h["cells"] if c["check"] == "isolation"), None)
        entry: dict[str, Any] = {"verdict": h["status"], "causes": [c for c in h["causes"] if c != h["status"]]}
        if decider is not None:
            entry["check"] = decider["check"]
            num = _number(decider)
            if num is not None:
                entry["number"] = float(f"{num:.3g}")
            if h["status"] != "pass":
                entry["message"] = " ".join(str(decider.get("message", "")).split())[:160]
        hazards = {c["check"]: ((c.get("diagnosis") or {}).get("cause") or c.get("cause") or c["status"])
                   for c in group if c["check"] in ("cache_trap", "mask_trap") and c["status"] not in ("pass", "skipped")}
        if hazards:
            entry["hazards"] = hazards
        findings = sorted({f["cause"] for c in h["cells"] for f in (c.get("findings") or []) if isinstance(f, dict) and f.get("cause")})
        if findings:
            entry["findings"] = findings
        out.setdefault(name, {})[backend] = entry
    return out


def _release_docs(build: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(release, merged results document, done record) of every finished release folder, ascending."""
    from .gate import merge
    from .results import load_document

    found: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    if not Path(build).is_dir():  # a fresh checkout: nothing measured here yet
        return found
    for folder in sorted((p for p in Path(build).iterdir() if p.is_dir()), key=lambda p: _safe_key(p.name)):
        if _safe_key(folder.name) is None:
            continue
        parts = [folder] if is_done(folder) else sorted(p for p in folder.glob("shard-*") if is_done(p))
        if not parts:
            continue
        if parts[0] != folder:  # shards: the release counts when every shard of one split is done
            totals = {json.loads((p / DONE_MARKER).read_text()).get("shard", [1, 1])[1] for p in parts}
            if len(totals) != 1 or len(parts) != totals.pop():
                continue
        docs = [load_document(p / "packcheck-matrix.json") for p in parts]
        records = [json.loads((p / DONE_MARKER).read_text()) for p in parts]
        doc = docs[0] if len(docs) == 1 else merge(docs)
        record = {**records[0], "wall_s": _total(records, "wall_s"), "child_cpu_s": _total(records, "child_cpu_s"), "shards": len(records),
                  "cells": sum(r.get("cells", 0) for r in records)}
        found.append((folder.name, doc, record))
    return found


def _total(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r.get(key) for r in records]
    return None if any(v is None for v in values) else round(sum(values), 1)


def _safe_key(name: str) -> Any:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(name)
    except InvalidVersion:
        return None


def load_committed(out: Path, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The committed atlas (``<out>/support.json``) that :func:`collect` is seeded from, or None when there is
    none or its schema is not this packcheck's (logged: its releases are then measured again)."""
    path = Path(out) / "support.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != "packcheck-atlas-support" or doc.get("schema_version") != SUPPORT_SCHEMA_VERSION:
        log(f"atlas: {path} has schema {doc.get('schema')} v{doc.get('schema_version')}, not v{SUPPORT_SCHEMA_VERSION}: "
            "not seeded from it, its releases are measured again")
        return None
    return doc


def committed_releases(committed: dict[str, Any] | None) -> list[str]:
    return [r["transformers"] for r in (committed or {}).get("releases", [])]


def collect(build: Path, planned: list[str] | None = None, bisects: dict[str, Any] | None = None,
            committed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``support.json`` document (SCHEMA.md) from every finished release under ``build``, seeded from
    ``committed`` (the committed ``support.json``, :func:`load_committed`): a release it holds counts as measured
    (its release record and entries carried over) unless ``build`` holds a run of that release, which replaces it.
    So the build folder (git-ignored) of a fresh checkout adds releases and drops none. ``planned``: the releases
    the atlas should hold (those measured in neither are listed in ``missing``)."""
    from . import __version__

    releases, cells = [], {}
    docs = _release_docs(build)
    built = {version for version, _, _ in docs}
    for r in (committed or {}).get("releases", []):
        version = r["transformers"]
        if version in built:
            continue
        releases.append(dict(r))
        for name, by_backend in committed["cells"].items():  # type: ignore[index]
            for backend, row in by_backend.items():
                if version in row:
                    cells.setdefault(name, {}).setdefault(backend, {})[version] = row[version]
    torch_version = (committed or {}).get("torch")
    for version, doc, record in docs:
        env = doc.get("environment", {})
        torch_version = torch_version or env.get("torch")
        releases.append({"transformers": version, "trl": env.get("trl"), "torch": env.get("torch"),
                         "architectures": len({(c["model"].get("model_type") or c["model"].get("label"))
                                               for c in doc.get("cells", [])}),
                         "cells": record.get("cells"), "wall_s": record.get("wall_s"), "cpu_s": record.get("child_cpu_s"),
                         "packcheck_version": doc.get("packcheck_version"), "source": record.get("source", "packcheck atlas"),
                         "command": reproduce_command(version)})
        for name, by_backend in reduce_release(doc).items():
            for backend, entry in by_backend.items():
                cells.setdefault(name, {}).setdefault(backend, {})[version] = entry
    releases.sort(key=lambda r: _vkey(r["transformers"]))
    measured = [r["transformers"] for r in releases]
    missing = [v for v in (planned or []) if v not in measured]
    support = {"schema": "packcheck-atlas-support", "schema_version": SUPPORT_SCHEMA_VERSION,
               "packcheck_version": __version__, "generated": time.strftime("%Y-%m-%d", time.gmtime()),
               "device": "cpu", "dtype": "float32", "torch": torch_version, "backends": list(ATLAS_BACKENDS),
               "checks": list(atlas_checks()), "releases": releases, "missing": missing, "cells": cells}
    support["transitions"] = transitions(support, bisects or {})
    return support


def _signature(entry: dict[str, Any] | None) -> tuple[str, tuple[str, ...]] | None:
    return None if entry is None else (entry["verdict"], tuple(entry.get("causes", [])))


def transitions(support: dict[str, Any], bisects: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every change of verdict or causes of an (architecture, backend) between two adjacent measured releases
    where both have it (an architecture that appears is not a transition). ``bisects``: :func:`transition_key`
    -> bisect record (:func:`pytest_packcheck.bisect.bisect_cell`'s), attached as ``bisected``."""
    order = [r["transformers"] for r in support["releases"]]
    out = []
    for name in sorted(support["cells"]):
        for backend in ATLAS_BACKENDS:
            row = support["cells"][name].get(backend, {})
            for old, new in itertools.pairwise(order):
                a, b = row.get(old), row.get(new)
                if a is None or b is None or _signature(a) == _signature(b):
                    continue
                t = {"model_type": name, "backend": backend, "last_before": old, "first_after": new,
                     "before": {k: a.get(k) for k in ("verdict", "causes", "check", "number")},
                     "after": {k: b.get(k) for k in ("verdict", "causes", "check", "number")}}
                record = (bisects or {}).get(transition_key(t))
                if record:
                    t["bisected"] = record
                out.append(t)
    return out


def transition_key(t: dict[str, Any]) -> str:
    return f"{t['model_type']}|{t['backend']}|{t['last_before']}|{t['first_after']}"


def bisect_plan(t: dict[str, Any]) -> dict[str, Any] | None:
    """The :func:`pytest_packcheck.bisect.bisect_cell` arguments that find the exact patch of transition ``t``:
    the cell of the check that decided the failing side, ``good`` the side where it passes (or where the
    failing side's cause is absent), ``bad`` the other. None when neither side passes and the causes give no
    handle (e.g. crash on both sides)."""
    before, after = t["before"], t["after"]
    if before["verdict"] == "pass" or after["verdict"] == "pass":
        good, bad = (t["last_before"], t["first_after"]) if before["verdict"] == "pass" else (t["first_after"], t["last_before"])
        failing = after if before["verdict"] == "pass" else before
        cause = None
    else:  # both fail: bisect on a cause one side has and the other does not
        gone = [c for c in before.get("causes", []) if c not in after.get("causes", [])]
        came = [c for c in after.get("causes", []) if c not in before.get("causes", [])]
        if came:
            good, bad, failing, cause = t["last_before"], t["first_after"], after, came[0]
        elif gone:
            good, bad, failing, cause = t["first_after"], t["last_before"], before, gone[0]
        else:
            return None
    if not failing.get("check") or failing["verdict"] in ("unsupported", "skipped"):
        return {"supported": True, "cell": f"{t['model_type']}-{t['backend']}-isolation-float32",
                "good": f"transformers=={good}", "bad": f"transformers=={bad}", "cause": None}
    return {"cell": f"{t['model_type']}-{t['backend']}-{failing['check']}-float32", "good": f"transformers=={good}",
            "bad": f"transformers=={bad}", "cause": cause, "supported": False}


def bisect_transitions(support: dict[str, Any], output_dir: Path, limit: int | None = None,
                       bisect: Callable[..., dict[str, Any]] | None = None,
                       log: Callable[[str], None] = print, models: list[str] | None = None,
                       done: dict[str, Any] | None = None) -> dict[str, Any]:
    """Bisect each transition of ``support`` (of ``models`` only, when given) to the exact patch (``bisect``:
    :func:`bisect.bisect_cell` or a stand-in); returns :func:`transition_key` -> a compact record. Transitions in
    ``done`` (``bisects.json`` of an earlier run) are not bisected again, so it resumes too."""
    if bisect is None:
        from .bisect import bisect_cell as bisect
    done = dict(done or {})
    todo = [t for t in support["transitions"] if (not models or t["model_type"] in models) and transition_key(t) not in done]
    for t in todo[:limit]:
        plan = bisect_plan(t)
        if plan is None:
            continue
        try:
            record = bisect(plan["cell"], plan["good"], plan["bad"], cause=plan["cause"], supported=plan["supported"],
                            output_dir=str(output_dir))
        except PackcheckUsageError as exc:
            log(f"atlas bisect {transition_key(t)}: not bisected ({exc})")
            continue
        done[transition_key(t)] = {"outcome": record.get("outcome"), "first": record.get("first"), "last": record.get("last"),
                                   "cell": plan["cell"], "cause": plan["cause"],
                                   "file": str(record.get("path", "")), "probes": record.get("probes"),
                                   "seconds": record.get("seconds"),
                                   "summary": record.get("message") or record.get("summary") or record.get("outcome", "")}
        log(f"atlas bisect {transition_key(t)}: {done[transition_key(t)]['summary']}")
    return done


# ----------------------------------------------------------------------------------------------------------------
# Known faults against the atlas

#: Architecture a window over every architecture (``"*"``) is checked on outside its window: the reference
#: decoder, which has no fault of its own on the atlas backends.
REFERENCE_ARCHITECTURE = "llama"


def shows(entry: dict[str, Any] | None, cause: str) -> bool:
    """The atlas entry names ``cause``: as a correctness cause, a hazard's cause or a finding."""
    if entry is None:
        return False
    return cause in entry.get("causes", []) or cause in (entry.get("hazards") or {}).values() or cause in entry.get("findings", [])


def known_fault_agreement(support: dict[str, Any], faults: list[Any]) -> list[dict[str, Any]]:
    """Each known fault (:class:`pytest_packcheck.diagnose.KnownFault`) against the atlas, per measured release:
    ``agrees``, ``disagrees`` (with what was measured) or ``not_checkable`` (why: a TRL window, checks or
    backends the atlas does not run, no measured release on the relevant side).

    Inside a fault's window at least one matching (architecture, backend) must show its cause; outside it none
    of the fault's own architectures may show it (for ``"*"``: :data:`REFERENCE_ARCHITECTURE`)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = []
    releases = [r["transformers"] for r in support["releases"]]
    for f in faults:
        base = {"id": f.id, "versions": f.versions, "cause": f.cause}
        backends = [b for b in support["backends"] if "*" in f.backends or b in f.backends]
        checks = [c for c in support["checks"] if c in f.checks]
        if f.library != "transformers":
            out.append({**base, "status": "not_checkable", "why": f"a {f.library} window: the atlas has no {f.library} axis"})
            continue
        if not backends or not checks:
            out.append({**base, "status": "not_checkable", "why": f"its checks ({', '.join(f.checks)}) or backends "
                        f"({', '.join(f.backends)}) are not in the atlas"})
            continue
        archs = sorted(support["cells"]) if "*" in f.architectures else [a for a in f.architectures if a in support["cells"]]
        outside_archs = [REFERENCE_ARCHITECTURE] if "*" in f.architectures else archs
        window = SpecifierSet(f.versions)
        for r in releases:
            inside = window.contains(Version(r), prereleases=True)
            pool = archs if inside else outside_archs
            measured = [(a, b) for a in pool for b in backends if r in support["cells"].get(a, {}).get(b, {})]
            hits = [f"{a}/{b}" for a, b in measured if shows(support["cells"][a][b][r], f.cause)]
            rec = {**base, "release": r, "inside": inside, "measured": len(measured), "hits": hits[:8]}
            if not measured:
                out.append({**rec, "status": "not_checkable", "why": "no matching (architecture, backend) measured"})
            elif inside and not hits:
                out.append({**rec, "status": "disagrees", "why": f"inside the window, and none of {len(measured)} "
                            f"matching (architecture, backend) shows {f.cause}"})
            elif not inside and hits and not _covered(f, faults, r, backends):
                out.append({**rec, "status": "disagrees", "why": f"outside the window, and {', '.join(hits)} shows {f.cause}"})
            else:
                out.append({**rec, "status": "agrees"})
    return out


def _covered(fault: Any, faults: list[Any], release: str, backends: list[str]) -> bool:
    """Another entry of the same library and cause names ``release`` on these backends (a fault with two windows,
    e.g. batch_rows on 4.53.x and from 4.55.1, is two entries)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return any(g is not fault and g.library == fault.library and g.cause == fault.cause
               and SpecifierSet(g.versions).contains(Version(release), prereleases=True)
               and ("*" in g.backends or any(b in g.backends for b in backends)) for g in faults)


# ----------------------------------------------------------------------------------------------------------------
# Rendering

SYMBOL = {"pass": "✅", "fail": "❌", "fallback": "↩️", "unsupported": "🚫", "skipped": "⏭️", "error": "💥",
          "timeout": "⏱️", "oom": "🧨"}


def _label(entry: dict[str, Any]) -> str:
    causes = ", ".join(c.replace("_", " ") for c in entry.get("causes", []))
    return f"{SYMBOL.get(entry['verdict'], entry['verdict'])}{' ' + causes if causes else ''}"


def _runs(row: dict[str, dict[str, Any]], order: list[str]) -> list[tuple[str, str, str]]:
    """(first release, last release, label) of each run of equal verdict + causes along ``order``."""
    runs: list[list[str]] = []
    for version in order:
        if version not in row:
            continue
        label = _label(row[version])
        if runs and runs[-1][2] == label:
            runs[-1][1] = version
        else:
            runs.append([version, version, label])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def render_markdown(support: dict[str, Any]) -> str:
    """atlas.md: coverage, per architecture one line per backend with its transitions, every transition with its
    number and cause, then the architectures that never pass and why."""
    order = [r["transformers"] for r in support["releases"]]
    lines = ["# packcheck atlas: padding-free packing per architecture, backend and transformers release", "",
             (f"Generated {support['generated']} by packcheck {support['packcheck_version']} (torch {support['torch']}, "
             f"CPU, float32, tiny random models from each release's own configs). Backends: "
             f"{', '.join(support['backends'])}; checks: {', '.join(support['checks'])} (hazards never decide a "
             "verdict). Machine-readable: `support.json` (schema: `SCHEMA.md`); "
             "`packcheck lookup MODEL_TYPE ATTN TRANSFORMERS_VERSION` answers from it."), "",
             "## Coverage", "",
             f"Measured releases: {', '.join(order) or 'none'}.",
             f"Not measured yet: {', '.join(support['missing']) or 'none'}" + (" (resume: `packcheck atlas`)." if support["missing"] else "."),
             "", "| release | architectures | cells | wall s | CPU s | s per (arch, backend) |", "|---|---|---|---|---|---|"]
    for r in support["releases"]:
        pairs = sum(1 for by in support["cells"].values() for b in by.values() if r["transformers"] in b)
        per = f"{r['wall_s'] / pairs:.2f}" if r.get("wall_s") and pairs else "—"
        lines.append(f"| {r['transformers']} | {r['architectures']} | {r['cells']} | {r.get('wall_s') or '—'} | "
                     f"{r.get('cpu_s') or '—'} | {per} |")
    lines += ["", "## Per architecture", "",
              ("One line per backend: the verdict (and causes) over the measured releases, each run of equal verdict "
              "with its first and last release."), ""]
    for name in sorted(support["cells"]):
        parts = []
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row:
                continue
            runs = _runs(row, order)
            text = "; ".join(f"{label} {a}" + (f" .. {b}" if b != a else "") for a, b, label in runs)
            parts.append(f"- **{name}** / {backend}: {text}")
        lines += parts
    lines += ["", "## Transitions", "",
              ("Every change of verdict or cause between two adjacent measured releases, with the number that backs "
              "each side; `bisected` names the exact patch where one was run."), "",
              "| architecture | backend | last before | first after | before | after | bisected |", "|---|---|---|---|---|---|---|"]
    for t in support["transitions"]:
        def side(s: dict[str, Any]) -> str:
            num = f" ({s['check']} {s['number']:.1e})" if s.get("number") is not None and s.get("check") else ""
            return _label(s) + num
        b = t.get("bisected")
        bis = f"{b['outcome']}: first {b.get('first')}, last {b.get('last')}" if b else "not yet"
        lines.append(f"| {name_md(t['model_type'])} | {t['backend']} | {t['last_before']} | {t['first_after']} | "
                     f"{side(t['before'])} | {side(t['after'])} | {bis} |")
    if not support["transitions"]:
        lines.append("| — | — | — | — | — | — | fewer than two measured releases share an architecture |")
    lines += ["", "## Never pass", "", ("Architecture / backend pairs with no passing measured release, and why "
              "(the causes and the message of the check that decided the newest release)."), ""]
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row or any(e["verdict"] == "pass" for e in row.values()):
                continue
            newest = max(row, key=_vkey)
            e = row[newest]
            why = e.get("message") or ", ".join(e.get("causes", [])) or e["verdict"]
            lines.append(f"- **{name}** / {backend} ({newest}): {_label(e)}: {name_md(why)}")
    lines += ["", "## Where packcheck itself stopped", "",
              ("Entries whose cause is packcheck's own (the shrink it applies, a crash only its shrunk model shows, an "
              "inconclusive probe): no verdict about the library. The issue's bar is none on any release."), ""]
    own: dict[tuple[str, str], list[str]] = {}
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            for version, e in support["cells"][name].get(backend, {}).items():
                for cause in e.get("causes", []):
                    if cause in OWN_CAUSES and e["verdict"] not in ("pass", "fail"):
                        own.setdefault((version, cause), []).append(f"{name}/{backend}")
    for (version, cause), items in sorted(own.items(), key=lambda kv: (_vkey(kv[0][0]), kv[0][1])):
        archs = sorted({i.split("/")[0] for i in items})
        lines.append(f"- {version} {cause.replace('_', ' ')}: {len(items)} (architecture, backend) of {len(archs)} "
                     f"architectures: {', '.join(archs)}")
    if not own:
        lines.append("- none")
    return "\n".join(lines) + "\n"


#: Causes that are packcheck's own rather than the library's (the Markdown's "Where packcheck itself stopped").
OWN_CAUSES = ("shrink_limit", "shrunk_crash", "probe_inconclusive")


def name_md(text: str) -> str:
    from .markdown import escape_md

    return escape_md(text)


def render_html(support: dict[str, Any]) -> str:
    """atlas.html: one self-contained page (no external asset), rows architecture x backend, columns releases,
    cells coloured by verdict; clicking a cell shows its number, cause, message and the command to reproduce.
    Each cell carries only its symbol and an index into one deduplicated JSON block (the page stays small at
    40 releases x 200 architectures x 3 backends)."""
    order = [r["transformers"] for r in support["releases"]]
    classes = {"pass": "p", "fail": "f", "fallback": "b", "unsupported": "u", "skipped": "s", "error": "e", "timeout": "e", "oom": "e"}
    entries: list[list[Any]] = []
    index: dict[str, int] = {}
    head = "".join(f"<th>{html.escape(v)}</th>" for v in order)
    rows = []
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row:
                continue
            tds = []
            for v in order:
                e = row.get(v)
                if e is None:
                    tds.append("<td></td>")
                    continue
                # the message stays in support.json and atlas.md: the page carries verdict, causes and number only
                item = [e["verdict"], e.get("causes", []), e.get("check"), e.get("number"), "", e.get("hazards", {})]
                key = json.dumps(item, sort_keys=True)
                if key not in index:
                    index[key] = len(entries)
                    entries.append(item)
                tds.append(f"<td class={classes.get(e['verdict'], 'e')} data-i={index[key]}>{SYMBOL.get(e['verdict'], '?')}</td>")
            rows.append(f"<tr data-a=\"{html.escape(name)}\" data-b={backend}><th>{html.escape(name)}</th><th>{backend}</th>{''.join(tds)}</tr>")
    data = json.dumps({"releases": order, "entries": entries, "checks": list(support["checks"]),
                       "backends": list(support["backends"])}, separators=(",", ":")).replace("</", "<\\/")
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>packcheck atlas</title><style>"
            "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 5px;text-align:center}td[data-i]{cursor:pointer}.p{background:#8fd18f}.f{background:#f08080}"
            ".b{background:#f5c26b}.u{background:#c8c8c8}.s{background:#eee}.e{background:#b48ae6}"
            "#d{position:sticky;top:0;background:#ffffe0;border:1px solid #aa8;padding:6px;white-space:pre-wrap;"
            "font-family:monospace;min-height:2em}</style></head><body>"
            f"<h1>packcheck atlas</h1><p>Generated {html.escape(support['generated'])} by packcheck "
            f"{html.escape(str(support['packcheck_version']))}, torch {html.escape(str(support['torch']))}, CPU float32. "
            f"Not measured yet: {html.escape(', '.join(support['missing']) or 'none')}. Click a cell.</p>"
            "<div id=\"d\">number, cause and reproduce command of the clicked cell</div>"
            f"<table><tr><th>architecture</th><th>backend</th>{head}</tr>{''.join(rows)}</table>"
            f"<script id=\"data\" type=\"application/json\">{data}</script>"
            "<script>var D=JSON.parse(document.getElementById('data').textContent);"
            "document.querySelector('table').onclick=function(ev){var td=ev.target.closest('td[data-i]');if(!td)return;"
            "var tr=td.parentNode,e=D.entries[+td.dataset.i],v=D.releases[td.cellIndex-2],a=tr.dataset.a,b=tr.dataset.b;"
            "var t=a+' / '+b+' @ transformers '+v+': '+e[0]+(e[1].length?' ('+e[1].join(', ')+')':'');"
            "if(e[2])t+='\\n'+e[2]+(e[3]===null?'':' '+e[3]);if(e[4])t+='\\n'+e[4];"
            "if(Object.keys(e[5]).length)t+='\\nhazards: '+JSON.stringify(e[5]);"
            "t+='\\nreproduce: packcheck audit --models arch:'+a+' --versions transformers=='+v+' --packcheck-attn='+b+"
            "' --packcheck-checks='+D.checks.join(',');document.getElementById('d').textContent=t;};</script></body></html>\n")


def write_outputs(support: dict[str, Any], out: Path) -> list[Path]:
    """Write support.json, atlas.md and atlas.html into ``out``."""
    from .results import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "support.json", out / "atlas.md", out / "atlas.html"]
    atomic_write(paths[0], json.dumps(support, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    atomic_write(paths[1], render_markdown(support))
    atomic_write(paths[2], render_html(support))
    return paths


@dataclass(frozen=True)
class AtlasArgs:
    releases: list[str]
    build: Path
    out: Path
    shard: tuple[int, int] | None
    workers: int
    render_only: bool
    bisect: bool
    bisect_limit: int | None
    models: list[str] | None = None
    bisect_models: list[str] | None = None
    seed: list[str] | None = None
    no_render: bool = False
    remeasure: bool = False


def main(args: AtlasArgs, log: Callable[[str], None] = print) -> int:
    """``packcheck atlas``: generate what is missing (unless ``render_only``), optionally bisect, then render.
    Exit 1 when a release could not be measured this time (its error is in ``<build>/<release>/atlas-error.json``;
    run again to resume), 0 otherwise."""
    for path in args.seed or []:
        record = seed_release(Path(path), args.build)
        log(f"atlas {record['transformers']}: {record['source']}")
    committed = load_committed(args.out, log)
    failed = []
    if not args.render_only:
        kept = [] if args.remeasure else [r for r in args.releases if r in committed_releases(committed)]
        if kept:
            log(f"atlas: {', '.join(kept)} already in {args.out / 'support.json'}: kept, not measured again "
                "(--remeasure measures them)")
        todo = [r for r in args.releases if r not in kept]
        failed = [r for r in generate(todo, args.build, args.shard, args.workers, log, models=args.models) if "error" in r]
    if args.no_render:
        return 1 if failed else 0
    bisects_file = args.out / "bisects.json"
    bisects = json.loads(bisects_file.read_text()) if bisects_file.exists() else {}
    support = collect(args.build, args.releases, bisects, committed)
    if args.bisect:
        bisects = bisect_transitions(support, args.out / "bisect", args.bisect_limit, log=log, models=args.bisect_models,
                                     done=bisects)
        from .results import atomic_write

        atomic_write(bisects_file, json.dumps(bisects, indent=1, sort_keys=True) + "\n")
        support = collect(args.build, args.releases, bisects, committed)
    paths = write_outputs(support, args.out)
    log(f"atlas written: {', '.join(str(p) for p in paths)} ({len(support['releases'])} releases measured, "
        f"{len(support['missing'])} missing)")
    sys.stdout.flush()
    return 1 if failed else 0
