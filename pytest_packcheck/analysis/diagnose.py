"""Why a cell failed, what to do about it, and which known upstream fault it matches.

Pure functions over a results document. A cell's cause is the cause code its check returned
(:data:`checks.causes.CAUSES`, with the check's evidence), or, for a cell that did not get to measure anything,
its status's (crash, hang, out_of_memory). The diagnosis maps codes to remedies; it never reads a message and
never changes a verdict. Known faults come from ``audit/known_faults.toml``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks.causes import CAUSE_RECORDS, CAUSES


def _v(text: str | None) -> Any:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


@functools.lru_cache(maxsize=256)
def _parsed_version(text: str | None) -> Any:
    """:func:`_v`, once per version text (a document's cells share a handful)."""
    return _v(text)


@functools.lru_cache(maxsize=256)
def _specifiers(versions: str) -> Any:
    """``packaging``'s SpecifierSet of a known fault's ``versions``, made once per text."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(versions)


def library_version(cell: dict[str, Any], doc_env: dict[str, Any], library: str) -> str | None:
    """The version of ``library`` the cell ran with: its version environment's, else the document's."""
    env = cell.get("env") or {}
    return (env.get("versions") or {}).get(library) or (env.get("environment") or {}).get(library) or doc_env.get(library)


def _short(evidence: Any) -> str:
    """Evidence as one line: ``key value`` pairs with numbers in scientific notation."""
    if not isinstance(evidence, dict):
        return str(evidence)[:200]
    parts = []
    for k, v in evidence.items():
        parts.append(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(parts)[:240]


def classify(cell: dict[str, Any]) -> tuple[str | None, str]:
    """(cause, evidence) of a cell: the cause code its check returned; for a cell that measured nothing, its
    status's (error with a stage: crash; timeout: hang; oom: out_of_memory; fallback: backend_swap); a failed
    cell of a results file written before cause codes (schema 1): packed_mismatch. (None, "") for a pass or a
    skip. Reads codes and numbers only, never the message."""
    status, m = cell["status"], cell.get("metrics") or {}
    if status in ("pass", "skipped"):
        return None, ""
    if cell.get("cause"):
        return cell["cause"], _short(cell.get("evidence") or {})
    if status == "error":  # a crash (with its stage); an error without one measured nothing to name
        return ("crash", _short({k: m[k] for k in ("stage", "exception", "where") if k in m})) if m.get("stage") else (None, "")
    if status == "timeout":
        return "hang", f"no result within {m.get('timeout_s')} s"
    if status == "oom":
        return "out_of_memory", ", ".join(f"{k} {v}" for k, v in m.items() if str(k).endswith("_mib"))
    if status == "fallback":
        return "backend_swap", _short({k: m[k] for k in ("requested", "effective") if k in m})
    if status == "fail":
        return "packed_mismatch", "a results file written before cause codes: the check named none"
    return None, ""


# ----------------------------------------------------------------------------------------------------------------
# Remedies


def remedy(cause: str, cell: dict[str, Any], doc_env: dict[str, Any], faults: list[KnownFault] | None = None) -> str:
    """One line that fits the cell: where a known fault with a fix (``fixed_in``) applies to the cell for this
    cause (its version window, architecture, backend and check: ``audit/known_faults.toml``), that fault's remedy
    (of the one fixed last: the upgrade past it fixes them all); else the cause's own (:mod:`checks.causes`, by
    the cell's backend, check and numbers). ``faults``: default, the shipped file. "" for an unknown code."""
    faults = load_known_faults() if faults is None else faults
    fixed = [f for f in faults if f.cause == cause and f.fixed_in and f.applies(cell, doc_env)]
    if fixed:
        return max(fixed, key=lambda f: _v(f.fixed_in) or _v("0")).remedy
    record = CAUSE_RECORDS.get(cause)
    if record is None:
        return ""
    own = next((c.get("evidence") or {} for c in cell.get("causes") or [] if c.get("cause") == cause), {})
    return record.remedy_for(cell, own if isinstance(own, dict) else {})


# ----------------------------------------------------------------------------------------------------------------
# Known faults


@dataclass(frozen=True)
class KnownFault:
    id: str
    upstream: str
    summary: str
    library: str
    versions: str
    architectures: tuple[str, ...]
    backends: tuple[str, ...]
    checks: tuple[str, ...]
    cause: str
    fixed_in: str
    remedy: str
    evidence: str
    # how the window was measured: a `packcheck bisect` result (first_bad / first_fixed, last, measured, result
    # file) or `unavailable` with the reason it cannot be bisected on CPU (tests/test_bisect.py compares them)
    bisect: Any = field(default=None, compare=False, hash=False)

    def applies(self, cell: dict[str, Any], doc_env: dict[str, Any]) -> bool:
        """The cell is inside this fault's window: library version, architecture, backend and check (the version last:
        issue 47, diagnosing the default audit parsed a specifier set for each of its 7,600 (cell, fault) pairs)."""
        arch_ok = "*" in self.architectures or (cell.get("model") or {}).get("model_type") in self.architectures
        backend = cell.get("backend")
        backend_ok = "*" in self.backends or backend in self.backends or backend is None
        if not (arch_ok and backend_ok and cell.get("check") in self.checks):
            return False
        version = _parsed_version(library_version(cell, doc_env, self.library))
        return version is not None and _specifiers(self.versions).contains(version.public, prereleases=True)


def load_known_faults(path: str | Path | None = None) -> list[KnownFault]:
    """Read ``audit/known_faults.toml`` (or ``path``); the shipped file is read once per process.

    Raises:
        ValueError: an entry with a missing key, an unknown cause or an invalid version specifier.
    """
    from ..config.audits import PACKAGE_AUDIT_DIR

    return list(_read_known_faults(Path(path) if path else PACKAGE_AUDIT_DIR / "known_faults.toml"))


@functools.lru_cache(maxsize=8)
def _read_known_faults(file: Path) -> tuple[KnownFault, ...]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    data = _parsed_toml(file)
    faults = []
    for raw in data.get("fault", []):
        try:
            fault = KnownFault(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k != "bisect"},
                               bisect=raw.get("bisect"))
        except TypeError as exc:
            raise ValueError(f"{file}: entry {raw.get('id', '?')}: {exc}") from None
        if fault.cause not in CAUSES:
            raise ValueError(f"{file}: entry {fault.id}: unknown cause '{fault.cause}'")
        try:
            SpecifierSet(fault.versions)
        except InvalidSpecifier:
            raise ValueError(f"{file}: entry {fault.id}: invalid versions '{fault.versions}'") from None
        faults.append(fault)
    return tuple(faults)


#: JSON copies of known_faults.toml kept in the cache (the newest by write; a hit never writes).
KNOWN_FAULTS_KEEP = 4


def _parsed_toml(file: Path) -> dict[str, Any]:
    """``file`` parsed as TOML, through a JSON copy in ``<cache>/known-faults/<digest>.json`` keyed by the BLAKE2
    digest of its bytes (an edit is a new key): ``packcheck lookup`` reads the known faults on every answer, and
    importing tomllib and parsing the file were about 7 ms of its 0.1 s budget (issue 47). The cache is only a
    speed-up: one that cannot be read or written is parsed from the TOML as before."""
    import hashlib
    import json
    import os

    from ..versions.cache import cache_root

    raw = file.read_bytes()
    cached = cache_root() / "known-faults" / f"{hashlib.blake2b(raw, digest_size=16).hexdigest()}.json"
    try:
        data = json.loads(cached.read_text())
        if isinstance(data, dict):
            return data
    except (OSError, ValueError):
        pass
    import tomllib

    data = tomllib.loads(raw.decode())
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(cached)
        # a miss is an edit (or a first start): keep the newest copies only, so that a known_faults.toml edited
        # again and again leaves no trail of 20 KB files (as support_file.INDEX_KEEP does for the support index)
        copies = sorted((f for f in cached.parent.glob("*.json") if f != cached), key=lambda f: f.stat().st_mtime,
                        reverse=True)
        for old in copies[KNOWN_FAULTS_KEEP - 1:]:
            old.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError):  # a read-only cache, or a TOML value JSON cannot hold: parse each time
        pass
    return data


def diagnose_document(doc: dict[str, Any], faults: list[KnownFault] | None = None) -> dict[str, Any]:
    """Add ``diagnosis`` to every cell ({cause, evidence, remedy, causes, findings, known_faults}) and ``known_faults_not_seen``
    to the document. A cell's diagnosis depends on that cell alone (its cause codes), never on which other checks
    ran. Verdicts are untouched."""
    faults = load_known_faults() if faults is None else faults
    env = doc.get("environment", {})
    not_seen: dict[str, list[str]] = defaultdict(list)
    for c in doc["cells"]:
        cause, evidence = classify(c)
        # every cause of the verdict (CheckResult.causes), primary first, each with its own numbers
        extra = [(x["cause"], x.get("evidence") or {}) for x in c.get("causes") or []
                 if cause and x.get("cause") and x["cause"] != cause] if c["status"] not in ("pass", "skipped") else []
        named = {cause, *(x for x, _ in extra)}
        findings = [(f["cause"], f.get("evidence", "")) for f in c.get("findings") or [] if f.get("cause") and f["cause"] not in named]
        causes = ([cause] if cause else []) + [x for x, _ in extra] + [f for f, _ in findings]
        matched = [f.id for f in faults if f.cause in causes and f.applies(c, env)]
        for f in faults:
            if c["status"] == "pass" and f.cause not in causes and f.applies(c, env):
                not_seen[f.id].append(c["cell_id"])
        listed = [{"cause": cause, "evidence": evidence, "remedy": remedy(cause, c, env, faults)}] if cause else []
        listed += [{"cause": x, "evidence": _short(e), "remedy": remedy(x, c, env, faults)} for x, e in extra]
        remedies = list(dict.fromkeys(r["remedy"] for r in listed if r["remedy"]))
        c["diagnosis"] = {
            "cause": cause, "evidence": evidence,
            # one remedy that covers every cause of the verdict, in their order
            "remedy": remedies[0] if len(remedies) == 1 else "; and ".join(
                f"{r['cause']}: {r['remedy']}" for r in listed if r["remedy"]) if remedies else "",
            "causes": listed,
            "findings": [{"cause": f, "evidence": _short(e), "remedy": remedy(f, c, env, faults)} for f, e in findings],
            "known_faults": matched,
        } if causes else None
    doc["known_faults_not_seen"] = {k: sorted(v) for k, v in sorted(not_seen.items())}
    return doc
