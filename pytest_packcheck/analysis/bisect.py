"""``packcheck bisect``: the release of a library that broke (or fixed) one cell.

The search (:func:`bisect_releases`) is pure: it takes the ordered releases and a probe function and halves the
range like ``git bisect``, testing both endpoints first. Releases the probe cannot judge (not installable, a crash,
a cell the version cannot express) are skipped and listed, like ``git bisect skip``. The rest of the module wires
it to the package index (:func:`list_releases`, yanked releases left out) and to version environments
(:func:`cell_probe`: one environment per release, running only the cell's model, backend and check).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import PackcheckUsageError
from ..versions.libraries import LIBRARIES
from ..versions.releases import version_key

#: Where the releases pages of the libraries of the table live (owner/repo on GitHub).
RELEASE_REPOS = {lib.name: lib.repo for lib in LIBRARIES if lib.repo}
DEFAULT_INDEX = "https://pypi.org/simple"
#: Environment variable naming another simple index (PEP 691 JSON) to read release lists from.
INDEX_ENV_VAR = "PACKCHECK_INDEX_URL"
#: Cell statuses that are a verdict on the cell; anything else (error, timeout, oom, skipped, unsupported) is
#: not, so a release that gives one is skipped.
_VERDICTS = ("pass", "fail", "fallback")
MODEL_LEVEL_BACKEND = "sdpa"  # model-level checks (collate, packing_content) need some backend to be selected


@dataclass(frozen=True)
class Probe:
    """What one release gave: ``holds`` True (the good side's verdict), False (the bad side's), None (skipped:
    ``detail`` says why). ``seconds`` is the wall time of the probe (environment included)."""

    version: str
    holds: bool | None
    detail: str = ""
    status: str | None = None  # the cell's status, when it ran
    key_number: str = ""
    seconds: float = 0.0
    env_created: bool | None = None


@dataclass
class BisectResult:
    """The outcome of :func:`bisect_releases`.

    ``outcome``: "found" (``first`` is the first bad / first fixed release, ``last`` the last release before it
    with the old verdict), "ambiguous" (skipped releases hide the boundary: it is one of ``candidates``), or
    "endpoints" (an endpoint did not hold as stated: ``message`` says which; nothing else was probed).
    """

    library: str
    good: str
    bad: str
    direction: str  # "first bad" (good is older) or "first fixed" (bad is older)
    outcome: str
    first: str | None
    last: str | None
    probes: list[Probe]
    skipped: list[str]
    releases: list[str]
    message: str
    candidates: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "probes": [asdict(p) for p in self.probes]}


def bisect_releases(releases: list[str], good: str, bad: str, probe: Callable[[str], Probe], library: str = "") -> BisectResult:
    """Find where the verdict changes between ``good`` (the cell holds) and ``bad`` (it does not).

    ``releases`` are the candidate versions (any order; the endpoints are added if missing, versions outside
    them dropped). The endpoints are probed first: ``good`` must hold and ``bad`` must not, else the search stops
    with outcome "endpoints". Then the untested release nearest the middle of the open range is probed, and the
    range halves; a release whose probe gives ``holds=None`` is skipped and the next nearest one is tried.
    When ``good`` is older, the answer is the first bad release ("first bad"); when ``bad`` is older, the first
    release that holds again ("first fixed"). ``last`` is the release just before ``first`` with the old
    verdict.

    Raises:
        ValueError: ``good`` and ``bad`` are the same version.
    """
    if version_key(good) == version_key(bad):
        raise ValueError(f"good and bad are the same version ({good}): nothing to bisect")
    old, new = sorted((good, bad), key=version_key)
    inside = {v for v in releases if version_key(old) < version_key(v) < version_key(new)}
    ordered = [old, *sorted(inside, key=version_key), new]
    direction = "first bad" if old == good else "first fixed"
    probes: list[Probe] = []
    skipped: list[str] = []

    def result(outcome: str, message: str, first: str | None = None, last: str | None = None,
               candidates: list[str] | None = None) -> BisectResult:
        return BisectResult(library, good, bad, direction, outcome, first, last, probes, skipped, ordered,
                            message, candidates or [])

    for version, want in ((good, True), (bad, False)):
        p = probe(version)
        probes.append(p)
        if p.holds is not want:
            side = "--good" if want else "--bad"
            got = "could not be judged" if p.holds is None else ("holds" if p.holds else "does not hold")
            return result("endpoints", f"the {side} endpoint {version} {got} ({p.detail or p.status}): "
                          f"{'the good side must pass' if want else 'the bad side must fail'}; nothing else was probed")
    old_holds = old == good  # the verdict on the old side of the boundary
    lo, hi = 0, len(ordered) - 1  # ordered[lo] has the old verdict, ordered[hi] the new one
    tried: set[int] = set()
    while True:
        open_ = [i for i in range(lo + 1, hi) if i not in tried]
        if not open_:
            break
        middle = (lo + hi) / 2
        i = min(open_, key=lambda j: (abs(j - middle), j))
        tried.add(i)
        p = probe(ordered[i])
        probes.append(p)
        if p.holds is None:
            skipped.append(ordered[i])
        elif p.holds == old_holds:
            lo = i
        else:
            hi = i
    if hi - lo > 1:  # only skipped releases between the last old and the first new verdict
        hidden = ordered[lo + 1:hi + 1]
        return result("ambiguous", f"the {direction} release is one of {', '.join(hidden)}: "
                      f"{', '.join(ordered[lo + 1:hi])} could not be judged", candidates=hidden, last=ordered[lo])
    word = "broke" if direction == "first bad" else "fixed"
    return result("found", f"{direction}: {ordered[hi]} (last {'good' if old_holds else 'bad'}: {ordered[lo]}); "
                  f"{len(probes)} probes, {len(skipped)} skipped: the cell {word} in {ordered[hi]}",
                  first=ordered[hi], last=ordered[lo])


# ----------------------------------------------------------------------------------------------------------------
# Releases from the package index


def parse_simple_index(doc: dict[str, Any], pre: bool = False) -> tuple[list[str], list[str]]:
    """(releases, yanked) from a PEP 691 JSON simple-index page: a release counts when at least one of its files
    is not yanked (PEP 592); pre- and dev-releases only with ``pre``. Both lists ascending."""
    from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    files: dict[str, list[bool]] = {}
    for f in doc.get("files", []):
        name = f.get("filename", "")
        try:
            version = parse_wheel_filename(name)[1] if name.endswith(".whl") else parse_sdist_filename(name)[1]
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue
        files.setdefault(str(version), []).append(bool(f.get("yanked")))
    for v in doc.get("versions", []):
        try:
            files.setdefault(str(Version(v)), [])
        except InvalidVersion:
            continue
    releases, yanked = [], []
    for v, flags in files.items():
        if (Version(v).is_prerelease or Version(v).is_devrelease) and not pre:
            continue
        if flags and all(flags):
            yanked.append(v)
        elif flags:
            releases.append(v)
    return sorted(releases, key=Version), sorted(yanked, key=Version)


def fetch_index_page(library: str, timeout: float = 30.0) -> dict[str, Any]:
    """The PEP 691 JSON simple-index page of ``library`` from ``$PACKCHECK_INDEX_URL`` (default PyPI).

    Raises:
        PackcheckUsageError: the index cannot be reached or does not know the library.
    """
    import os
    import urllib.error
    import urllib.request

    from ..versions.envs import canonical

    base = os.environ.get(INDEX_ENV_VAR) or DEFAULT_INDEX
    url = f"{base.rstrip('/')}/{canonical(library)}/"
    from ..versions.releases import open_index

    try:
        with open_index(url, timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise PackcheckUsageError(f"The package index has no '{library}' ({url}: HTTP {exc.code}): check the library name "
                                  f"or set ${INDEX_ENV_VAR} to an index that has it.") from None
    except (urllib.error.URLError, OSError, ValueError, RecursionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PackcheckUsageError(f"Cannot read the release list of '{library}' from {url} ({reason}): bisect needs the "
                                  f"package index; set ${INDEX_ENV_VAR} to a reachable PEP 691 simple index.") from None


def release_notes_url(library: str, version: str) -> str:
    """The GitHub releases page of ``version`` (text only; nothing is fetched). Empty for an unknown library."""
    from ..versions.envs import canonical

    repo = RELEASE_REPOS.get(canonical(library))
    return f"https://github.com/{repo}/releases/tag/v{version}" if repo else ""


# ----------------------------------------------------------------------------------------------------------------
# The cell and the two sides


@dataclass(frozen=True)
class CellRef:
    """A parsed cell id: ``llama-sdpa-trainer-float32`` (backend None for model-level checks)."""

    cell_id: str
    model: str  # the model spec to build: arch:<label>, or the Hub ID for labels with a '/'
    label: str
    backend: str | None
    check: str
    dtype: str


def parse_cell_id(cell_id: str, source: str, model: str | None = None) -> CellRef:
    """``<model label>-[<backend>-]<check>-<dtype>[@env]`` -> the cell to probe. The model is ``arch:<label>``
    unless ``model`` (a spec) is given or the label is a Hub ID.

    Raises:
        PackcheckUsageError: an unknown dtype, check or backend, no model label, or an ``arch:`` model type that
            neither the installed transformers nor the atlas knows.
    """
    from ..backends import KNOWN_BACKENDS
    from ..checks import CHECKS, MODEL_LEVEL_CHECKS
    from ..config.options import DTYPES
    from ..errors import closest
    from ..model.specs import parse_model_spec

    text = cell_id.strip()
    head, sep, env = text.rpartition("@")
    if sep and "==" in env:  # a version environment's suffix (the gate prints it); a Hub revision has no '=='
        text = head
    parts = text.rsplit("-", 2)
    example = "e.g. llama-sdpa-trainer-float32 (model-backend-check-dtype) or llama-collate-float32"
    if len(parts) != 3:
        raise PackcheckUsageError(f"Cell id '{cell_id}' (from {source}) is not model-backend-check-dtype: write {example}.")
    head, check, dtype = parts
    if dtype not in DTYPES:
        raise PackcheckUsageError(f"Cell id '{cell_id}' (from {source}) ends with '{dtype}', not a dtype "
                                  f"({', '.join(DTYPES)}).{closest(dtype, DTYPES)} Write {example}.")
    if check not in CHECKS:
        raise PackcheckUsageError(f"Cell id '{cell_id}' (from {source}) names no known check before the dtype ('{check}'; "
                                  f"expected one of {', '.join(CHECKS)}).{closest(check, CHECKS)}")
    backend: str | None = None
    label = head
    if check not in MODEL_LEVEL_CHECKS:
        label, _, backend = head.rpartition("-")
        if backend not in KNOWN_BACKENDS:
            raise PackcheckUsageError(f"Cell id '{cell_id}' (from {source}) has no known backend before '{check}' "
                                      f"('{backend}'; expected one of {', '.join(KNOWN_BACKENDS)}).{closest(backend, KNOWN_BACKENDS)}")
    if not label:
        raise PackcheckUsageError(f"Cell id '{cell_id}' (from {source}) names no model: write {example}.")
    spec = model or (label if "/" in label else f"arch:{label}")
    parsed = parse_model_spec(spec, "--model" if model else f"the model label of {source}")
    from ..model.configs import refuse_absurd_sizes

    refuse_absurd_sizes(None, parsed, "--model" if model else f"the model label of {source}")  # before any env is built
    if parsed.kind == "arch":  # arch:nosuch built an environment, then "the endpoint could not be judged"
        from .support_file import refuse_unknown_model_type

        refuse_unknown_model_type(parsed.name, "--model" if model else f"the model label of {source}")
    labelled, builds = label.split("{", 1)[0].split("+", 1)[0], parsed.label.split("{", 1)[0]
    if model and parsed.kind == "arch" and "/" not in label and labelled != builds:
        # the cell id names one architecture and --model builds another: the record would carry the cell's name
        # over the other model's verdicts (hostile trial 5: llama-sdpa-isolation-float32 --model arch:gpt2)
        raise PackcheckUsageError(f"--model '{model}' builds {builds}, and the cell id '{cell_id}' (from {source}) "
                                  f"names {labelled}: give the cell id of {builds} (e.g. {builds}-"
                                  f"{backend + '-' if backend else ''}{check}-{dtype}), or a --model of {labelled}.")
    if parsed.kind == "local":  # a folder without a readable config.json: refused now, not after the environments are
        from ..model.configs import read_config_dict  # built and each endpoint crashed on it (hostile trial 4)

        read_config_dict(parsed, "--model" if model else f"the model label of {source}")
    return CellRef(cell_id.strip(), spec, label, backend, check, dtype)


@dataclass(frozen=True)
class Sides:
    """The two specs of a bisection: which library moves, its good and bad versions, what stays pinned."""

    library: str
    good: str
    bad: str
    pinned: tuple[str, ...]  # requirement strings of the other libraries, as in both specs

    def spec(self, version: str) -> str:
        """The --good / --bad spec of ``version``: ``transformers==5.10.1 & trl==0.24.0``."""
        return " & ".join((f"{self.library}=={version}", *self.pinned))


def parse_sides(good: str, bad: str) -> Sides:
    """``--good`` / ``--bad`` specs (``transformers==5.10.1``, or a combination ``transformers==5.10.1 & trl==0.24.0``)
    -> the library that differs and what stays pinned. Each library must be pinned with ``==``.

    Raises:
        PackcheckUsageError: a bad specifier, no exact pin, or not exactly one library that differs.
    """
    from packaging.requirements import Requirement

    from ..versions.envs import canonical, parse_versions

    def pins(spec: str, flag: str) -> dict[str, str]:
        combos = parse_versions([spec], flag)
        if len(combos) != 1:
            raise PackcheckUsageError(f"'{spec}' (from {flag}) names {len(combos)} combinations: give one version per "
                                      "library, e.g. transformers==5.10.1.")
        out = {}
        for text in combos[0].requirements:
            req = Requirement(text)
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
                raise PackcheckUsageError(f"'{text}' (from {flag}) is not one exact release: write {req.name}==<version>, "
                                          f"e.g. {req.name}==5.10.1.")
            out[canonical(req.name)] = specs[0].version
        return out

    g, b = pins(good, "--good"), pins(bad, "--bad")
    if set(g) != set(b):
        raise PackcheckUsageError(f"--good '{good}' and --bad '{bad}' name different libraries ({', '.join(sorted(g))} vs "
                                  f"{', '.join(sorted(b))}): pin the same ones on both sides.")
    moving = [n for n in g if version_key(g[n]) != version_key(b[n])]
    if len(moving) != 1:
        what = "no library" if not moving else f"{len(moving)} libraries ({', '.join(moving)})"
        raise PackcheckUsageError(f"--good '{good}' and --bad '{bad}' differ in {what}: bisect moves exactly one library; "
                                  "keep the others at the same version on both sides.")
    lib = moving[0]
    pinned = tuple(f"{n}=={v}" for n, v in g.items() if n != lib)
    return Sides(lib, g[lib], b[lib], pinned)


# ----------------------------------------------------------------------------------------------------------------
# Probing one release in a version environment


def probe_number(cell: dict[str, Any]) -> str:
    from ..report.numbers import key_metric

    key = key_metric(cell)
    value = key[1] if key else None
    if isinstance(value, float):
        return f"{key[0]} {value:.2e}"
    return f"{key[0]} {value}" if key and value is not None else ""


def judge(cell: dict[str, Any] | None, cause: str | None, supported: bool, doc_env: dict[str, Any]) -> tuple[bool | None, str]:
    """(holds, detail) of one cell record. Default: pass holds, fail / fallback does not, anything else is
    skipped. With ``cause``: the cell holds when its diagnosis names neither that cause nor a finding of it.
    With ``supported``: holds when the cell gives any verdict, not when it is unsupported."""
    from .diagnose import diagnose_document

    if cell is None:
        return None, "the run gave no such cell"
    status = cell["status"]
    if supported:
        if status == "unsupported":
            return False, f"unsupported: {cell['message'][:160]}"
        return (True, f"{status}: {cell['message'][:120]}") if status in _VERDICTS else (None, f"{status}: {cell['message'][:160]}")
    if status not in _VERDICTS:
        return None, f"{status}: {cell['message'][:160]}"
    doc = diagnose_document({"environment": doc_env, "cells": [json.loads(json.dumps(cell))]}, faults=[])
    diagnosis = doc["cells"][0]["diagnosis"] or {}
    named = [(diagnosis.get("cause"), diagnosis.get("evidence", ""))] + [(f["cause"], f["evidence"]) for f in diagnosis.get("findings", [])]
    if cause is None:
        # a passing cell can still carry a finding (the Trainer's own padded run, two packed rows): named, so a
        # user whose endpoint "holds" sees what --cause to bisect instead
        findings = sorted({c for c, _ in named if c})
        extra = f" [findings: {', '.join(findings)}; bisect one with --cause]" if status == "pass" and findings else ""
        return status == "pass", cell["message"][:160] + extra
    hit = next((e for c, e in named if c == cause), None)
    if hit is not None:
        return False, f"{cause}: {hit[:160]}"
    return True, f"no {cause} ({status}: {cell['message'][:100]})"


def probe_settings(models: list[str], backends: tuple[str, ...], checks: tuple[str, ...], dtypes: tuple[str, ...],
                   weights: str = "random") -> Any:
    """The :class:`~pytest_packcheck.config.settings.Settings` of a probe run: those cells only, on CPU, default
    tolerances and timeout, forked isolation."""
    from ..config.options import OPT_REPORT_DIR, default_of
    from ..config.settings import Settings
    from ..config.tolerances import load_tolerances

    tolerances, source = load_tolerances(None, None, "default")
    return Settings(models=tuple(models), model_source="packcheck bisect", backends=backends, checks=checks, dtypes=dtypes,
                    weights=weights, device="cpu", trust_remote_code=False, report_dir=default_of(OPT_REPORT_DIR), tolerances=tolerances,
                    tolerance_source=source)


def cell_probe(ref: CellRef, sides: Sides, report_dir: Any, cause: str | None = None, supported: bool = False,
               log: Callable[[str], None] | None = None) -> Callable[[str], Probe]:
    """A probe for :func:`bisect_releases`: for a version of ``sides.library``, make (or find) the environment of
    that version plus the pinned libraries and run only the cell's model, backend, check and dtype there.
    An environment that cannot be made (uv's reason) is a skip, not a verdict."""
    from ..versions.envs import VersionCombo, run_in_env

    settings = probe_settings([ref.model], (ref.backend or MODEL_LEVEL_BACKEND,), (ref.check,), (ref.dtype,))

    def probe(version: str) -> Probe:
        combo = VersionCombo((f"{sides.library}=={version}", *sides.pinned))
        t0 = time.perf_counter()
        run = run_in_env(combo, settings, [ref.model], report_dir)
        seconds = round(time.perf_counter() - t0, 2)
        created = run.env.created if run.env else None
        if run.error:
            p = Probe(version, None, f"not judged: {run.error[:300]}", None, "", seconds, created)
        else:
            cell = next((c for c in run.cells.values() if c["check"] == ref.check and c["dtype"] == ref.dtype
                         and c["backend"] == ref.backend), None)
            holds, detail = judge(cell, cause, supported, run.environment)
            p = Probe(version, holds, detail, cell["status"] if cell else None, probe_number(cell) if cell else "", seconds, created)
        if log:
            verdict = {True: "good", False: "bad", None: "skip"}[p.holds]
            log(f"  {sides.library} {version}: {verdict} ({p.status or '-'}; {p.key_number or p.detail[:100]}) {p.seconds:.1f} s"
                f"{' cold' if p.env_created else ''}")
        return p

    return probe


def run_bisect(ref: CellRef, sides: Sides, releases: list[str], yanked: list[str], probe: Callable[[str], Probe],
               cause: str | None = None, supported: bool = False) -> dict[str, Any]:
    """Bisect and assemble the JSON record (cell, sides, every probe, the answer, release notes links, seconds)."""
    import datetime

    t0 = time.perf_counter()
    res = bisect_releases(releases, sides.good, sides.bad, probe, sides.library)
    lo, hi = sorted((sides.good, sides.bad), key=version_key)
    return {
        "cell": ref.cell_id, "model": ref.model, "backend": ref.backend, "check": ref.check, "dtype": ref.dtype,
        "predicate": f"cause {cause}" if cause else ("supported" if supported else "pass"),
        "library": sides.library, "good": sides.good, "bad": sides.bad, "pinned": list(sides.pinned),
        "direction": res.direction, "outcome": res.outcome, "first": res.first, "last": res.last,
        "first_bad": res.first if res.direction == "first bad" else None,
        "first_fixed": res.first if res.direction == "first fixed" else None,
        "candidates": res.candidates, "message": res.message,
        "release_notes": release_notes_url(sides.library, res.first) if res.first else "",
        "releases": res.releases, "yanked_in_range": [v for v in yanked if version_key(lo) < version_key(v) < version_key(hi)],
        "skipped": res.skipped, "probes": [asdict(p) for p in res.probes],
        "environments_made": sum(1 for p in res.probes if p.env_created),
        "seconds": round(time.perf_counter() - t0, 1),
        "measured": datetime.date.today().isoformat(),
    }


def render_text(record: dict[str, Any]) -> str:
    """The bisect record as terminal text: the answer, then one line per probe."""
    lib = record["library"]
    lines = [f"packcheck bisect {record['cell']}: {lib} {record['good']} (good) .. {record['bad']} (bad), "
             f"{len(record['releases']) - 2} releases between, predicate {record['predicate']}"
             + (f", pinned {' '.join(record['pinned'])}" if record["pinned"] else "")]
    if record["outcome"] == "found":
        lines.append(f"{record['direction']}: {lib} {record['first']}   (last {'good' if record['direction'] == 'first bad' else 'bad'}: "
                     f"{record['last']})")
        if record["release_notes"]:
            lines.append(f"release notes: {record['release_notes']}")
    else:
        lines.append(f"{record['outcome']}: {record['message']}")
    lines.append("probes (in order):")
    for p in record["probes"]:
        verdict = {True: "good", False: "bad", None: "skip"}[p["holds"]]
        lines.append(f"  {p['version']:>12}  {verdict:4}  {p['status'] or '-':8} {p['key_number'] or ''}  {p['seconds']:.1f} s  "
                     f"{p['detail'][:140]}")
    if record["skipped"]:
        lines.append(f"skipped: {', '.join(record['skipped'])}")
    if record["yanked_in_range"]:
        lines.append(f"yanked, not probed: {', '.join(record['yanked_in_range'])}")
    lines.append(f"{len(record['probes'])} probes, {record['environments_made']} environments made, {record['seconds']:.1f} s")
    return "\n".join(lines)


def output_name(record: dict[str, Any]) -> str:
    """File stem for the JSON record: ``<cell>--<library>-<good>-<bad>``, plus ``--cause-<cause>`` or
    ``--supported`` when the predicate is not the verdict (so two questions on one range keep two files)."""
    stem = f"{record['cell']}--{record['library']}-{record['good']}-{record['bad']}"
    if record["predicate"] != "pass":
        stem += "--" + record["predicate"].replace(" ", "-")
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", stem)


# ----------------------------------------------------------------------------------------------------------------
# The command


def bisect_cell(cell_id: str, good: str, bad: str, *, model: str | None = None, pre: bool = False, cause: str | None = None,
                supported: bool = False, output_dir: Any = "reports/bisect", log: Callable[[str], None] | None = None,
                fetch: Callable[[str], dict[str, Any]] | None = None,
                make_probe: Callable[..., Callable[[str], Probe]] | None = None) -> dict[str, Any]:
    """``packcheck bisect``: check the input, list the releases between ``good`` and ``bad`` from the index, bisect
    with one version environment per probe, write ``<output_dir>/<cell>--<library>-<good>-<bad>.json`` and
    return the record (its ``path`` included). ``fetch`` and ``make_probe`` replace the index and the probe
    (tests).

    Raises:
        PackcheckUsageError: a bad cell id, spec, cause or flag combination, an unreachable index, or an
            unwritable output folder, or a --good / --bad the index does not have; all before anything is probed.
    """
    from pathlib import Path

    from ..errors import closest
    from .diagnose import CAUSES

    if cause is not None and cause not in CAUSES:
        raise PackcheckUsageError(f"Unknown cause '{cause}' (from --cause). Expected one of: {', '.join(CAUSES)}.{closest(cause, tuple(CAUSES))}")
    if cause and supported:
        raise PackcheckUsageError("--cause and --supported ask different questions: give one (--supported bisects where a "
                                  "cell stops being unsupported, --cause where a cause appears or goes).")
    ref = parse_cell_id(cell_id, "CELL", model)
    sides = parse_sides(good, bad)
    log = log or (lambda line: print(line, flush=True))  # progress as it goes: each probe takes seconds
    out = Path(output_dir)
    from ..results.io import probe_folder

    probe_folder(out, "-o/--output-dir", "Output directory")  # each probe writes its log and results there: a full disk is refused now
    page = (fetch or fetch_index_page)(sides.library)
    releases, yanked = parse_simple_index(page, pre=pre)
    from ..versions.releases import refuse_unreleased

    listed, listed_yanked = parse_simple_index(page, pre=True)  # an endpoint may be a pre-release or yanked: it installs
    refuse_unreleased([(sides.good, "--good"), (sides.bad, "--bad")], listed + listed_yanked, sides.library,
                      "Pass releases the index has as --good / --bad.")
    if log:
        lo, hi = sorted((sides.good, sides.bad), key=version_key)
        inside = [v for v in releases if version_key(lo) < version_key(v) < version_key(hi)]
        log(f"packcheck bisect {ref.cell_id}: {sides.library} {lo} .. {hi}: {len(inside)} releases between"
            f"{' (pre-releases included)' if pre else ''}; endpoints first")
    probe = (make_probe or cell_probe)(ref, sides, out, cause=cause, supported=supported, log=log)
    record = run_bisect(ref, sides, releases, yanked, probe, cause=cause, supported=supported)
    path = out / f"{output_name(record)}.json"
    from ..results.io import atomic_write, scrub

    atomic_write(path, scrub(json.dumps(record, indent=1)) + "\n")
    record["path"] = str(path)
    return record


def gate_sides(base_cell: dict[str, Any], cand_cell: dict[str, Any], base_env: dict[str, Any],
               cand_env: dict[str, Any]) -> tuple[Sides | None, str]:
    """The sides of a gate regression: the one library (a recorded library of the table that is not tied to the
    hardware: transformers or trl) whose version differs between the baseline's cell (good) and the candidate's
    (bad); TRL stays pinned for the checks that use it. (None, why) when no single library moved."""
    from .diagnose import library_version

    versions = {lib.name: (library_version(base_cell, base_env, lib.key), library_version(cand_cell, cand_env, lib.key))
                for lib in LIBRARIES if lib.recorded and not lib.hardware}
    moved = [lib for lib, (a, b) in versions.items() if a and b and version_key(a) != version_key(b)]
    if len(moved) != 1:
        what = "no library version" if not moved else "both transformers and trl"
        return None, f"{what} changed between the baseline and the candidate: nothing to bisect on its own"
    lib = moved[0]
    pinned: tuple[str, ...] = ()
    other = "trl" if lib == "transformers" else "transformers"
    if other == "transformers" or base_cell["check"] in ("sft", "sft_padding_free", "sft_strategies", "packing_content"):
        a, b = versions[other]
        if a and a == b:
            pinned = (f"{other}=={a}",)
    return Sides(lib, versions[lib][0], versions[lib][1], pinned), ""
