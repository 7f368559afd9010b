"""The per-release results (and the committed ``support.json``) reduced to the ``support.json`` document, its
transitions, their bisection to the exact patch, and the known-fault windows checked against it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .plan import ATLAS_BACKENDS, SUPPORT_SCHEMA_VERSION, atlas_checks, entry_message, version_key
from .release_run import check_recorded_version, done_record, is_done, reproduce_command


def _number(cell: dict[str, Any]) -> float | None:
    from ..report.numbers import key_metric

    key = key_metric(cell)
    value = key[1] if key else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def reduce_release(doc: dict[str, Any], backends: tuple[str, ...] = ATLAS_BACKENDS,
                   pass_check: str = "isolation") -> dict[str, dict[str, dict[str, Any]]]:
    """One release's results document -> ``{model_type: {backend: entry}}`` (entry: SCHEMA.md ``cells``), the cells
    of ``backends`` only (the encoder and multimodal blocks, :mod:`.kinds`, reduce their runs the same way).

    The verdict is the matrix's headline (:func:`pytest_packcheck.report.headline`: the worst correctness check;
    hazards never decide it); ``number`` is the key number of the check that decided it (the first failing one,
    else ``pass_check``'s: isolation's ``max_change``)."""
    from ..report.verdicts import headline

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in doc.get("cells", []):
        if cell.get("backend") not in backends or cell.get("dtype") != "float32":
            continue
        model = cell["model"]
        name = model.get("model_type") or model.get("label")
        groups.setdefault((name, cell["backend"]), []).append(cell)
    from ..checks.registry import SPECS

    hazard_checks = {name for name, spec in SPECS.items() if spec.role == "hazard"}  # the registry's stack hazards
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (name, backend), group in sorted(groups.items()):
        h = headline(group)
        decider = h["bad"][0] if h["bad"] else next((c for c in h["cells"] if c["check"] == pass_check), None)
        entry: dict[str, Any] = {"verdict": h["status"], "causes": [c for c in h["causes"] if c != h["status"]]}
        if decider is not None:
            entry["check"] = decider["check"]
            num = _number(decider)
            if num is not None:
                entry["number"] = float(f"{num:.3g}")
            if h["status"] != "pass":
                entry["message"] = entry_message(decider.get("message", ""))
        hazards = {c["check"]: ((c.get("diagnosis") or {}).get("cause") or c.get("cause") or c["status"])
                   for c in group if c["check"] in hazard_checks and c["status"] not in ("pass", "skipped")}
        if hazards:
            entry["hazards"] = hazards
        source = next((c["model"].get("config_source") for c in group if c["model"].get("config_source")), None)
        if source:  # built from packcheck's config-fix table (model/config_fixes.py), not the default config
            entry["config"] = source
        # a finding beside a verdict, and a failing check's further causes (a cell's ``causes`` past its first:
        # roberta on 4.49 leaks *and* counts positions from 0, its wrong_positions the second cause of logits_parity)
        findings = sorted({f["cause"] for c in h["cells"] for f in (c.get("findings") or []) if isinstance(f, dict) and f.get("cause")}
                          | {x["cause"] for c in h["bad"] for x in (c.get("causes") or [])[1:] if isinstance(x, dict) and x.get("cause")}
                          - set(entry["causes"]))
        if findings:
            entry["findings"] = findings
        out.setdefault(name, {})[backend] = entry
    return out


def _release_docs(build: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(release, merged results document, done record) of every finished release folder, ascending.

    Raises:
        PackcheckUsageError: a run record or results file records another transformers than its folder's name
            (:func:`~pytest_packcheck.atlas.release_run.check_recorded_version`), or a run record is corrupt.
    """
    from ..analysis.gate import merge
    from ..results import load_document

    found: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    if not Path(build).is_dir():  # a fresh checkout: nothing measured here yet
        return found
    # a folder that is not named as a release (a user's, an editor's) is not one: skipped before sorting, since
    # None does not order against a Version
    releases = [p for p in Path(build).iterdir() if p.is_dir() and _safe_key(p.name) is not None]
    for folder in sorted(releases, key=lambda p: _safe_key(p.name)):
        parts = [folder] if is_done(folder) else sorted(p for p in folder.glob("shard-*") if is_done(p))
        if not parts:
            continue
        if parts[0] != folder:  # shards: the release counts when every shard of one split is done
            totals = {done_record(p).get("shard", [1, 1])[1] for p in parts}
            if len(totals) != 1 or len(parts) != totals.pop():
                continue
        docs = [load_document(p / "packcheck-matrix.json") for p in parts]
        records = [done_record(p) for p in parts]
        for part, part_doc, part_record in zip(parts, docs, records, strict=True):
            check_recorded_version(part, folder.name, "transformers", part_doc, part_record)
        doc = docs[0] if len(docs) == 1 else merge(docs)
        record = {**records[0], "wall_s": _total(records, "wall_s"), "child_cpu_s": _total(records, "child_cpu_s"), "shards": len(records),
                  "cells": sum(r.get("cells", 0) for r in records)}
        if any(r.get("resumed") for r in records):
            counts = [r.get("resumed_cells") for r in records if r.get("resumed")]
            record.update(resumed=True, resumed_cells=None if None in counts else sum(counts))
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


def load_committed(out: Path, log: Callable[[str], None] = print, render_only: bool = False) -> dict[str, Any] | None:
    """The committed atlas (``<out>/support.json``) that :func:`collect` is seeded from, or None when there is
    none or its schema is not this packcheck's (logged: its releases are then measured again).

    Raises:
        PackcheckUsageError: the file cannot be read (not UTF-8, not JSON: trial 16, 201 was a JSONDecodeError
            traceback) or is corrupt (:func:`~pytest_packcheck.analysis.support_file.validate_support`: a render seeded from it
            kept a pass its own number contradicts, trial 16, 200), with the fix (:data:`analysis.support_file.RESTORE`).
    """
    from ..analysis.support_file import RESTORE, validate_support
    from ..errors import PackcheckUsageError

    path = Path(out) / "support.json"
    if not path.exists():
        return None
    from ..errors import read_document

    doc = read_document(path, "json", "Support file (the atlas in -o/--output-dir, which a render is seeded from)", f"{RESTORE}.")
    if not isinstance(doc, dict) or doc.get("schema") != "packcheck-atlas-support" or doc.get("schema_version") != SUPPORT_SCHEMA_VERSION:
        found = (doc.get("schema"), doc.get("schema_version")) if isinstance(doc, dict) else (type(doc).__name__, None)
        if render_only:  # nothing is measured: a render from it would write an empty atlas over it (trial 17, 170)
            raise PackcheckUsageError(
                f"Support file '{path}' (the atlas in -o/--output-dir) has schema {found[0]!r} version {found[1]!r}, not "
                f"packcheck-atlas-support version {SUPPORT_SCHEMA_VERSION}, and --render-only measures nothing: a render "
                f"would replace it with an empty atlas beside its claims.md and bisects.json. {RESTORE[0].upper() + RESTORE[1:]}.")
        log(f"atlas: {path} has schema {found[0]} v{found[1]}, not v{SUPPORT_SCHEMA_VERSION}: "
            "not seeded from it, its releases are measured again")
        return None
    validate_support(doc, path)
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
    from .. import __version__

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
    tolerances = (committed or {}).get("tolerances")
    for version, doc, record in docs:
        # the float32 tolerances the cells were judged with (the atlas runs the shipped ones): lookup refuses a pass
        # its own number contradicts against them (analysis.support_file.validate_support)
        tolerances = next((c["tolerances"] for c in doc.get("cells", []) if c.get("dtype") == "float32"
                           and isinstance(c.get("tolerances"), dict)), None) or tolerances
        env = doc.get("environment", {})
        torch_version = torch_version or env.get("torch")
        releases.append({"transformers": version, "trl": env.get("trl"), "torch": env.get("torch"),
                         "architectures": len({(c["model"].get("model_type") or c["model"].get("label"))
                                               for c in doc.get("cells", [])}),
                         "cells": record.get("cells"), "wall_s": record.get("wall_s"), "cpu_s": record.get("child_cpu_s"),
                         **({"resumed": True, "resumed_cells": record.get("resumed_cells")} if record.get("resumed") else {}),
                         **({"measured": record["finished"][:10]} if isinstance(record.get("finished"), str) else {}),
                         **({"overrides": record["overrides"]} if record.get("overrides") else {}),
                         "packcheck_version": doc.get("packcheck_version"), "source": record.get("source", "packcheck atlas"),
                         "command": reproduce_command(version)})
        for name, by_backend in reduce_release(doc).items():
            for backend, entry in by_backend.items():
                cells.setdefault(name, {}).setdefault(backend, {})[version] = entry
    releases.sort(key=lambda r: version_key(r["transformers"]))
    measured = [r["transformers"] for r in releases]
    missing = [v for v in (planned or []) if v not in measured]
    support = {"schema": "packcheck-atlas-support", "schema_version": SUPPORT_SCHEMA_VERSION,
               "packcheck_version": __version__, "generated": time.strftime("%Y-%m-%d", time.gmtime()),
               "device": "cpu", "dtype": "float32", "torch": torch_version, "backends": list(ATLAS_BACKENDS),
               "checks": list(atlas_checks()), "releases": releases, "missing": missing, "cells": cells,
               **({"tolerances": tolerances} if tolerances else {})}
    support["transitions"] = transitions(support, bisects or {})
    return support


#: The verdict of a block entry (:mod:`.kinds`) whose model is not in that release's transformers.
ABSENT = "absent"


def _signature(entry: dict[str, Any] | None) -> tuple[str, tuple[str, ...]] | None:
    return None if entry is None else (entry["verdict"], tuple(entry.get("causes", [])))


def transitions(support: dict[str, Any], bisects: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every change of verdict or causes of an (architecture, backend) between two adjacent measured releases
    where both have it (an architecture that appears is not a transition, nor one whose entry is ``absent``: the
    encoder and multimodal blocks, :mod:`.kinds`). ``bisects``: :func:`transition_key` -> bisect record
    (:func:`pytest_packcheck.analysis.bisect.bisect_cell`'s), attached as ``bisected``. The backends are
    ``support["backends"]`` (the atlas's, :data:`ATLAS_BACKENDS`, where it names none)."""
    order = [r["transformers"] for r in support["releases"]]
    out = []
    for name in sorted(support["cells"]):
        for backend in support.get("backends") or ATLAS_BACKENDS:
            row = support["cells"][name].get(backend, {})
            for old, new in itertools.pairwise(order):
                a, b = row.get(old), row.get(new)
                if a is None or b is None or ABSENT in (a["verdict"], b["verdict"]) or _signature(a) == _signature(b):
                    continue
                t = {"model_type": name, "backend": backend, "last_before": old, "first_after": new,
                     "before": {k: a.get(k) for k in ("verdict", "causes", "check", "number")},
                     "after": {k: b.get(k) for k in ("verdict", "causes", "check", "number")}}
                record = (bisects or {}).get(transition_key(t)) or _narrowed(bisects or {}, t)
                if record:
                    t["bisected"] = record
                out.append(t)
    return out


def _narrowed(bisects: dict[str, Any], t: dict[str, Any]) -> dict[str, Any] | None:
    """A bisect found over a wider gap that a release measured since has narrowed: same (architecture, backend),
    and the patch it found lies in ``t``'s gap (``last`` before it, ``first`` at or before ``first_after``).
    Keeps a bisect's answer when the releases between its two ends are measured later."""
    lo, hi = version_key(t["last_before"]), version_key(t["first_after"])
    for key, record in sorted(bisects.items()):
        name, backend, *_ = key.split("|")
        if (name, backend) != (t["model_type"], t["backend"]) or record.get("outcome") != "found":
            continue
        if record.get("first") and record.get("last") and lo <= version_key(record["last"]) and version_key(record["first"]) <= hi:
            return record
    return None


def transition_key(t: dict[str, Any]) -> str:
    return f"{t['model_type']}|{t['backend']}|{t['last_before']}|{t['first_after']}"


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
    """Each known fault (:class:`pytest_packcheck.analysis.diagnose.KnownFault`) against the atlas, per measured release:
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
