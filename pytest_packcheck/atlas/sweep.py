"""Transitions to the exact patch by a sweep: every release on the index between two adjacent measured ones, run
once for all the architectures that change across that gap.

A bisect per transition (:func:`pytest_packcheck.analysis.bisect.bisect_cell`) costs 3-5 version environments of one
model each, 30-50 s a probe here: 800 transitions would take a day and a half. Between two adjacent minors there
are 1-4 patch releases, so running each of them once, with every architecture whose entry changed across the gap,
is no more runs than a bisection and shares each run among all the gap's transitions. Each release between is
measured as the atlas measures one (:func:`.build.run_release`: the same backends and checks, restricted to those
architectures with ``--packcheck-models``) and reduced with :func:`.collect.reduce_release`, so the entries are
compared on the same signature (verdict and causes) that defined the transition.

Runs live under ``<build>/sweep/<release>/<digest>/`` (the digest names the architectures run there; a later gap
needing more architectures of the same release runs only those). Resumable like the atlas: a finished run is not
run again, a killed one resumes from its journal.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .collect import _signature, reduce_release, transition_key
from .plan import version_key
from .release_run import is_done, run_release

#: The file in a sweep run's folder naming the architectures it was asked for.
SWEEP_MODELS = "sweep-models.json"


def index_finals(library: str = "transformers") -> list[str]:
    """Every final, not yanked release of ``library`` on the package index, ascending.

    Raises:
        PackcheckUsageError: the index cannot be reached.
    """
    from ..analysis.bisect import fetch_index_page, parse_simple_index

    releases, _ = parse_simple_index(fetch_index_page(library))
    return releases


def sweep_gaps(support: dict[str, Any], finals: list[str], done: dict[str, Any],
               models: list[str] | None = None) -> list[dict[str, Any]]:
    """The gaps to sweep, cheapest first (releases between x architectures, then oldest: a gap with no release
    between places its transitions with no run at all): per pair of adjacent measured releases (``last_before``, ``first_after``)
    with transitions that are neither in ``done`` nor already placed by a bisect, the releases on the index
    strictly between (``between``, ascending) and the architectures whose entry changed (``model_types``).
    ``models``: only these architectures' transitions. A gap with a planned release not yet measured between
    (``support["missing"]``) is left out: once that release is measured the gap splits in two and its transitions
    change, so a sweep now would measure what the atlas is about to (see :func:`deferred_gaps`)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in support["transitions"]:
        if t.get("bisected") or transition_key(t) in done or (models and t["model_type"] not in models):
            continue
        groups.setdefault((t["last_before"], t["first_after"]), []).append(t)
    waiting = {(lo, hi) for lo, hi, _ in deferred_gaps(support)}
    out = []
    for (lo, hi), ts in groups.items():
        if (lo, hi) in waiting:
            continue
        between = [v for v in finals if version_key(lo) < version_key(v) < version_key(hi)]
        out.append({"last_before": lo, "first_after": hi, "between": between, "transitions": ts,
                    "model_types": sorted({t["model_type"] for t in ts})})
    return sorted(out, key=lambda g: (len(g["between"]) * len(g["model_types"]), version_key(g["last_before"])))


def deferred_gaps(support: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(``last_before``, ``first_after``, the planned releases not yet measured between) of every gap with a
    transition not placed yet that :func:`sweep_gaps` leaves out, oldest first: the one rule of both."""
    pending = set(support.get("missing") or [])
    gaps = {(t["last_before"], t["first_after"]) for t in support["transitions"] if not t.get("bisected")}
    out = []
    for lo, hi in sorted(gaps, key=lambda g: version_key(g[0])):
        inside = sorted((v for v in pending if version_key(lo) < version_key(v) < version_key(hi)), key=version_key)
        if inside:
            out.append((lo, hi, inside))
    return out


def _runs(folder: Path, version: str) -> list[tuple[list[str], Path]]:
    """(architectures asked for, run folder) of every finished sweep run of ``version`` under ``folder``."""
    out = []
    for sub in sorted(p for p in folder.glob("*") if p.is_dir()) if folder.is_dir() else []:
        run = sub / version
        if is_done(run) and (sub / SWEEP_MODELS).exists():
            out.append((json.loads((sub / SWEEP_MODELS).read_text()), run))
    return out


def measure_between(version: str, model_types: list[str], root: Path, log: Callable[[str], None] = print,
                    runner: Callable[..., Any] | None = None) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any] | None]:
    """The atlas entries (``{model_type: {backend: entry}}``) of ``model_types`` on ``version``: the finished sweep
    runs under ``root/version`` are reused, the architectures none of them ran are run now (one run, atlas backends
    and checks). Returns (entries, the new run's done record or None; a record with ``error`` when it failed)."""
    folder = root / version
    covered = {m for asked, _ in _runs(folder, version) for m in asked}
    missing = sorted(set(model_types) - covered)
    record = None
    if missing:
        sub = folder / hashlib.sha1(",".join(missing).encode()).hexdigest()[:10]
        sub.mkdir(parents=True, exist_ok=True)
        (sub / SWEEP_MODELS).write_text(json.dumps(missing) + "\n")
        record = run_release(version, sub, log=log, runner=runner, models=[f"arch:{m}" for m in missing])
    entries: dict[str, dict[str, dict[str, Any]]] = {}
    from ..results import load_document

    for _, run in _runs(folder, version):
        for name, by_backend in reduce_release(load_document(run / "packcheck-matrix.json")).items():
            entries.setdefault(name, {}).update(by_backend)
    return entries, record


def place(t: dict[str, Any], sequence: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
    """The bisect record of transition ``t`` from its ``sequence`` of (release, entry or None when not measured),
    ``last_before`` first and ``first_after`` last.

    ``first`` is the earliest release from which every measured entry has the after side's signature, ``last`` the
    measured release before it. ``outcome``: ``found`` when every measured entry before ``first`` has the before
    side's signature and no release between ``last`` and ``first`` went unmeasured; ``not_monotonic`` (a third
    signature, or a flip back and forth, on the way: the sequence says where) or ``unmeasured`` (a release next to
    the boundary has no entry) otherwise, without which :mod:`pytest_packcheck.support` places no release."""
    before, after = _signature(t["before"]), _signature(t["after"])
    known = [(v, e) for v, e in sequence if e is not None]
    i = len(known) - 1
    while i > 0 and _signature(known[i - 1][1]) == after:
        i -= 1
    first, last = known[i][0], known[i - 1][0]
    gap = [v for v, e in sequence if e is None and version_key(last) < version_key(v) < version_key(first)]
    monotonic = all(_signature(e) == before for _, e in known[:i])
    outcome = "found" if monotonic and not gap else "unmeasured" if monotonic else "not_monotonic"
    verb = ("first fixed" if after[0] == "pass" else "first bad" if before[0] == "pass" else "changed")
    steps = [{"version": v, **({"verdict": e["verdict"], "causes": e.get("causes", []), "number": e.get("number"),
                                "check": e.get("check")} if e is not None else {"verdict": None})}
             for v, e in sequence]
    inner = len(sequence) - 2
    summary = (f"{verb}: {first} (last as before: {last}); swept {inner} release{'s' if inner != 1 else ''} between "
               f"{t['last_before']} and {t['first_after']}")
    if outcome == "unmeasured":
        summary += f"; not measured next to the boundary: {', '.join(gap)}"
    elif outcome == "not_monotonic":
        summary += "; not monotonic: " + ", ".join(f"{s['version']} {s['verdict']}" for s in steps)
    return {"outcome": outcome, "first": first, "last": last, "cell": f"{t['model_type']}-{t['backend']}",
            "cause": None, "method": "sweep", "file": None, "probes": steps, "summary": summary}


def sweep_transitions(support: dict[str, Any], build: Path, finals: list[str] | None = None,
                      done: dict[str, Any] | None = None, limit: int | None = None, models: list[str] | None = None,
                      log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None,
                      measure: Callable[..., Any] | None = None,
                      save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Place every transition of ``support`` (of ``models`` only, when given) on the exact patch by sweeping its
    gap (:func:`sweep_gaps`, at most ``limit`` gaps); returns ``done`` (the ``bisects.json`` records,
    :func:`transition_key` -> record) with the new records added. A gap whose release between could not be run
    keeps that release as unmeasured (its transitions say so); a gap with no release between needs no run:
    ``first_after`` is the first release. ``save`` gets ``done`` after each gap, so a sweep killed half-way keeps
    the gaps it placed. ``measure``: replaces :func:`measure_between` (tests)."""
    done = dict(done or {})
    finals = index_finals() if finals is None else finals
    measure = measure or measure_between
    root = Path(build) / "sweep"
    for lo, hi, inside in deferred_gaps(support):
        log(f"atlas sweep {lo} .. {hi}: left until {', '.join(inside)} {'is' if len(inside) == 1 else 'are'} measured")
    for gap in sweep_gaps(support, finals, done, models)[:limit]:
        started = time.perf_counter()
        entries: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for version in gap["between"]:
            got, record = measure(version, gap["model_types"], root, log=log, runner=runner)
            if record and record.get("error"):
                log(f"atlas sweep {version}: not measured ({str(record['error'])[:160]})")
            entries[version] = got
        seconds = round(time.perf_counter() - started, 1)
        for t in gap["transitions"]:
            sequence = [(t["last_before"], t["before"])]
            sequence += [(v, entries[v].get(t["model_type"], {}).get(t["backend"])) for v in gap["between"]]
            sequence.append((t["first_after"], t["after"]))
            done[transition_key(t)] = {**place(t, sequence), "seconds": seconds}
        log(f"atlas sweep {gap['last_before']} .. {gap['first_after']}: {len(gap['between'])} release(s) between, "
            f"{len(gap['model_types'])} architecture(s), {len(gap['transitions'])} transition(s) placed in {seconds:.0f} s")
        if save is not None:
            save(done)
    return done
