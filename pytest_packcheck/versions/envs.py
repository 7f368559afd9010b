"""Library-version environments: parse ``--packcheck-versions``, make one uv environment per combination, run
the packcheck plugin in it (a subprocess) and hand back its results.

An environment is a uv venv of this Python whose ``site-packages`` holds the requested libraries (and what they
need), layered over this environment's hardware-bound packages (torch, triton, flash-attn, CUDA libraries):
those are never installed again. They are linked into a separate *overlay* folder that a ``.pth`` file puts on
``sys.path`` after the venv's own ``site-packages``; uv never sees the overlay, so it can neither download
another torch nor write through the links (which it would do to linked folders inside ``site-packages``).
Requirements on the hardware packages are dropped at resolution (a uv override with a never-true marker) and
checked afterwards with ``packaging``: an environment whose libraries need another torch is an error, named.

Environments are cached under ``$PACKCHECK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/packcheck``, i.e.
``~/.cache/packcheck``), one folder per exact requirement set and base environment (hash in the name), with
uv's own cache beside them unless ``UV_CACHE_DIR`` is set. A folder is used only once its ``packcheck-env.json``
is written, so a killed build is rebuilt, never half-used.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError
from ..results.io import read_results
from .cache import cache_root
from .libraries import LIBRARIES, axis_libraries, hardware_patterns

#: Distributions bound to this machine's hardware or to the torch build (the table's hardware libraries and the
#: CUDA packages): linked from the base environment, never installed into a version environment. Matched
#: against canonical (PEP 503) names.
HARDWARE_PATTERNS = hardware_patterns()
#: The libraries a user may put on the version axis (anything else pure-Python works too; these are checked
#: for typos).
KNOWN_LIBRARIES = tuple(lib.name for lib in axis_libraries())
#: What packcheck itself imports in the environment (its own code comes from the overlay): its runtime
#: packages, and the libraries of the table it needs in every environment (accelerate for transformers'
#: Trainer, the trainer check).
PACKCHECK_RUNTIME = ("pytest", "pytest-xdist", "packaging", "tabulate", "rich", "filelock",
                     *(lib.name for lib in LIBRARIES if lib.install == "runtime"))
ENV_MARKER = "packcheck-env.json"
_OPERATORS = ("==", "!=", "<=", ">=", "~=", "<", ">", "===")


def canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def is_hardware_bound(name: str) -> bool:
    return any(re.fullmatch(p, canonical(name)) for p in HARDWARE_PATTERNS)


@dataclass(frozen=True)
class VersionCombo:
    """One environment to run in: requirement strings (PEP 508, normalised), e.g. ("transformers==4.51.3",)."""

    requirements: tuple[str, ...]
    #: what the run's checks need besides the requirements (:func:`check_requirements`): installed, not in the label
    extras: tuple[str, ...] = field(default=(), compare=False)

    @property
    def label(self) -> str:
        """Short label for cell ids and matrix columns: ``transformers==4.51.3+trl==0.17.0``."""
        return "+".join(r.replace(" ", "") for r in self.requirements)

    def names(self) -> list[str]:
        from packaging.requirements import Requirement

        return [canonical(Requirement(r).name) for r in self.requirements]


def _parse_one(text: str, source: str) -> Any:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise PackcheckUsageError(
            f"Unparsable version specifier '{text}' (from {source}): {str(exc).splitlines()[0]}. "
            "Write e.g. transformers==4.51.3,5.24.0 or 'transformers>=4.54,<5'."
        ) from None
    if not req.specifier:
        raise PackcheckUsageError(
            f"Version specifier '{text}' (from {source}) names no version: write e.g. {req.name}==<version> or '{req.name}>=X,<Y'."
        )
    if req.url or req.marker:
        raise PackcheckUsageError(f"Version specifier '{text}' (from {source}) has a URL or marker: give name and versions only.")
    if is_hardware_bound(req.name):
        raise PackcheckUsageError(
            f"'{req.name}' (from {source}) is bound to this machine's hardware and is never reinstalled: version "
            f"environments reuse the installed {req.name}. Run packcheck from an environment with the {req.name} you want."
        )
    known = set(KNOWN_LIBRARIES) | {canonical(d.metadata["Name"] or "") for d in metadata.distributions()}
    if canonical(req.name) not in known:
        from ..errors import closest

        hint = closest(canonical(req.name), KNOWN_LIBRARIES)
        raise PackcheckUsageError(
            f"Unknown library '{req.name}' in '{text}' (from {source}).{hint or ''} A version axis takes one of "
            f"{', '.join(KNOWN_LIBRARIES)}, or a library installed here.")
    return req


def parse_axis(value: str, source: str) -> list[str]:
    """One axis ``name<spec>[,<version or spec>...]`` -> requirement strings, one per alternative.

    A bare version after a comma starts a new alternative (``transformers==4.51.3,4.57.1`` is two); an item
    that starts with an operator extends the current one (``transformers>=4.54,<5`` is one).

    Raises:
        PackcheckUsageError: unparsable, no version, a hardware-bound package, or a misspelt library name.
    """
    text = value.strip()
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?)\s*(.*)$", text)
    if not m or not m.group(2):
        raise PackcheckUsageError(
            f"Unparsable version specifier '{value}' (from {source}): write name==version[,version...], "
            "e.g. transformers==4.51.3,5.24.0."
        )
    name, rest = m.group(1), m.group(2)
    clauses: list[str] = []
    for part in (p.strip() for p in rest.split(",")):
        if not part:
            raise PackcheckUsageError(f"Empty item in version specifier '{value}' (from {source}): remove the extra comma.")
        if part.startswith(_OPERATORS):
            # "<5" after ">=4.54" narrows that alternative; "==X" always starts a new one
            if clauses and not part.startswith("=="):
                clauses[-1] += "," + part
            else:
                clauses.append(part)
        elif re.fullmatch(r"[0-9][0-9A-Za-z.+!*-]*", part):
            clauses.append("==" + part)
        else:
            raise PackcheckUsageError(
                f"Unparsable item '{part}' in version specifier '{value}' (from {source}): expected a version "
                "(4.57.1) or a specifier (>=4.54)."
            )
    out = []
    for clause in clauses:
        req = _parse_one(f"{name}{clause}", source)
        out.append(f"{req.name}{clause.replace(' ', '')}")
    return list(dict.fromkeys(out))


def parse_versions(values: list[str], source: str) -> list[VersionCombo]:
    """``--packcheck-versions`` values -> the combinations to run.

    Each value is an axis (``transformers==4.51.3,5.24.0``) or an explicit combination of several
    requirements joined by ``&`` (``transformers==4.51.3 & trl==0.17.0``). Axes multiply (every combination);
    explicit combinations are added as given.

    Raises:
        PackcheckUsageError: a bad specifier, or one library on two axes.
    """
    axes: dict[str, list[str]] = {}
    combos: list[VersionCombo] = []
    for value in values:
        for item in (v for v in _split_top(value) if v.strip()):
            if "&" in item:
                reqs = []
                if any(not part.strip() for part in item.split("&")):
                    raise PackcheckUsageError(
                        f"Empty requirement in the combination '{item.strip()}' (from {source}): write name==version on both sides of '&'."
                    )
                for part in item.split("&"):
                    alts = parse_axis(part, source)
                    if len(alts) != 1:
                        raise PackcheckUsageError(
                            f"'{part.strip()}' in the combination '{item.strip()}' (from {source}) names {len(alts)} versions: "
                            "a combination takes one version per library."
                        )
                    reqs.append(alts[0])
                combo = VersionCombo(tuple(reqs))
                if len(set(combo.names())) != len(reqs):
                    raise PackcheckUsageError(f"The combination '{item.strip()}' (from {source}) names a library twice.")
                combos.append(combo)
                continue
            alts = parse_axis(item, source)
            from packaging.requirements import Requirement

            name = canonical(Requirement(alts[0]).name)
            if name in axes:
                raise PackcheckUsageError(
                    f"'{name}' is given twice as a version axis (from {source}): list its versions in one value, "
                    f"e.g. {name}==A,B."
                )
            axes[name] = alts
    if axes:
        combos += [VersionCombo(tuple(c)) for c in itertools.product(*axes.values())]
    unique = list(dict.fromkeys(combos))
    if not unique:
        raise PackcheckUsageError(f"No version given (from {source}): write e.g. transformers==4.51.3,5.24.0.")
    if len(unique) > MAX_ENVIRONMENTS:
        low, high = (len(unique) * s / 3600 for s in SECONDS_PER_ENVIRONMENT)
        raise PackcheckUsageError(
            f"{len(unique)} version environments (from {source}) are over packcheck's cap of {MAX_ENVIRONMENTS}: each is "
            f"one environment to install and one audit run ({SECONDS_PER_ENVIRONMENT[0]}-{SECONDS_PER_ENVIRONMENT[1]} s "
            f"each in the committed reports), about {low:.1f}-{high:.1f} h here. List fewer versions (the axes multiply), "
            "or split them over several runs with their own --packcheck-report-dir and `packcheck merge` them.")
    return unique


#: The most version environments one run takes (``--packcheck-versions``, the audit's ``versions``): the
#: committed reports use 4 (reports/versions) to 13 (reports/trl-versions).
MAX_ENVIRONMENTS = 64
#: Seconds per environment (cold install + the audit in it) in the committed reports, fastest and slowest:
#: reports/trl-versions 3-4 s to install + about 20 s to run, reports/training up to 98 s to run.
SECONDS_PER_ENVIRONMENT = (24, 100)


def _split_top(value: str) -> list[str]:
    """Values may hold several axes separated by ';' (ini files and the audit TOML give lists instead)."""
    return value.split(";")


# ----------------------------------------------------------------------------------------------------------------
# Making environments


class EnvError(Exception):
    """An environment could not be made; the message says why in one line (it becomes the cells' message)."""


@dataclass
class VersionEnv:
    """A ready environment."""

    combo: VersionCombo
    path: Path
    python: Path
    versions: dict[str, str]  # resolved versions of the requested libraries (and transformers, trl)
    created: bool  # made now (cold) rather than found in the cache (warm)
    seconds: float  # time to make or find it
    info: dict[str, Any] = field(default_factory=dict)




def check_cache_root() -> Path:
    """:func:`cache_root`, made if missing, checked once before any cell: a ``PACKCHECK_CACHE_DIR`` or
    ``XDG_CACHE_HOME`` that is a file, or a folder that cannot be written, turned every cell of a version audit into
    "the process running this cell died" with exit 0 (issue 42).

    Raises:
        PackcheckUsageError: naming the variable it came from, its value and the fix.
    """
    from ..errors import PackcheckUsageError

    root = cache_root()
    var = ("PACKCHECK_CACHE_DIR" if os.environ.get("PACKCHECK_CACHE_DIR") else
           "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "")
    came = f" (from ${var}={os.environ[var]!r})" if var else " (the default, ~/.cache/packcheck)"
    fix = (f"point {var} at a folder you can write, or unset it" if var else
           "set PACKCHECK_CACHE_DIR to a folder you can write")
    try:
        (root / "envs").mkdir(parents=True, exist_ok=True)
        probe = root / "envs" / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise PackcheckUsageError(f"The version-environment cache {root}{came} cannot be used ({exc.strerror or exc}: "
                                  f"{exc.filename or root}): {fix}.") from None
    return root


def _hardware_dists() -> list[metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and is_hardware_bound(name) and canonical(name) not in seen:
            seen[canonical(name)] = dist
    return [seen[k] for k in sorted(seen)]


def _package_root() -> Path:
    return Path(__file__).resolve().parents[1]  # pytest_packcheck/ (this module is in its versions/)


def _base_requirements(combo: VersionCombo) -> list[str]:
    """What every environment needs besides the combination: torch's own pure-Python dependencies (torch is
    linked, its dependencies are not), packcheck's runtime, and this environment's version of each ``pinned``
    library of the table (transformers) that the combination does not name (so an axis over trl alone changes
    only trl)."""
    from packaging.requirements import Requirement

    reqs: list[str] = []
    names = set(combo.names())
    for dist in _hardware_dists():
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            if not is_hardware_bound(req.name) and canonical(req.name) not in names:
                reqs.append(f"{req.name}{req.specifier}")
    reqs += [p for p in PACKCHECK_RUNTIME if canonical(p) not in names]
    reqs += [p for p in combo.extras if canonical(p) not in names]
    for lib in LIBRARIES:
        if lib.install == "pinned" and lib.name not in names:
            try:
                reqs.append(f"{lib.name}=={metadata.version(lib.name)}")
            except metadata.PackageNotFoundError:
                reqs.append(lib.name)
    return list(dict.fromkeys(reqs))


#: uv overrides for environments whose own requirements the index cannot meet (``audit/env_overrides.toml``).
ENV_OVERRIDES_FILE = "env_overrides.toml"
#: When an override applies: after the release's own requirements failed to resolve, or from the first resolution.
OVERRIDE_WHEN = ("unresolvable", "always")


def applicable_overrides(combo: VersionCombo, path: Path | None = None) -> list[dict[str, str]]:
    """The entries of ``audit/env_overrides.toml`` (``path``: another file) whose ``applies_to`` (one library
    requirement, e.g. ``transformers>=5.25.0``) matches a pinned version of ``combo``: each ``{"requirement",
    "applies_to", "reason", "when"}``. ``when`` (default ``"unresolvable"``): :func:`ensure_env` adds the entry as a
    uv override only after the environment failed to resolve without it; ``"always"``: from the first resolution, for
    a release whose own requirements resolve to a set it does not run with (transformers 5.4.0 annotates
    ``tie_word_embeddings: int = False``, and huggingface_hub 1.9.0 on refuses a bool for an int field, so every
    config of 15 architectures raises at construction).

    Raises:
        EnvError: the file is not valid TOML, or an entry lacks a key or has a requirement that does not parse.
    """
    import tomllib
    from packaging.requirements import InvalidRequirement, Requirement

    from ..config.audits import PACKAGE_AUDIT_DIR

    file = path or PACKAGE_AUDIT_DIR / ENV_OVERRIDES_FILE
    if not file.exists():
        return []
    try:
        entries = tomllib.loads(file.read_text()).get("override", [])
    except tomllib.TOMLDecodeError as exc:
        raise EnvError(f"{file} is not valid TOML ({exc}): fix the file.") from None
    pinned = {}
    for r in combo.requirements:
        req = Requirement(r)
        versions = [s.version for s in req.specifier if s.operator == "=="]
        if versions:
            pinned[canonical(req.name)] = versions[0]
    out = []
    for i, entry in enumerate(entries):
        if not all(isinstance(entry.get(k), str) for k in ("requirement", "applies_to", "reason")):
            raise EnvError(f"{file}: override {i + 1} needs the strings requirement, applies_to and reason (got "
                           f"{sorted(entry)}): fix the file.")
        when = entry.get("when", "unresolvable")
        if when not in OVERRIDE_WHEN:
            raise EnvError(f"{file}: override {i + 1}: when = {when!r} is not one of {', '.join(OVERRIDE_WHEN)}: fix the file.")
        try:
            Requirement(entry["requirement"])
            scope = Requirement(entry["applies_to"])
        except InvalidRequirement as exc:
            raise EnvError(f"{file}: override {i + 1}: {' '.join(str(exc).split())}: fix the file.") from None
        version = pinned.get(canonical(scope.name))
        if version is not None and scope.specifier.contains(version, prereleases=True):
            out.append({**{k: entry[k] for k in ("requirement", "applies_to", "reason")}, "when": when})
    return out


def env_key(combo: VersionCombo) -> str:
    """Cache key: the exact requirement set plus what the environment is layered over."""
    payload = {
        "requirements": sorted(combo.requirements),
        "base": sorted(_base_requirements(combo)),
        "python": sys.version,
        "executable": os.path.realpath(sys.executable),
        "hardware": [f"{d.metadata['Name']}=={d.version}@{d.locate_file('')}" for d in _hardware_dists()],
        "layout": 1,
    }
    always = sorted(o["requirement"] for o in applicable_overrides(combo) if o["when"] == "always")
    if always:  # only then: every other environment keeps its key
        payload["always_overrides"] = always
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", combo.label).strip("-")[:60]
    return f"{slug}-{digest}"


def _uv() -> str:
    try:
        import uv

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            raise EnvError("uv is not installed: pip install uv (packcheck makes version environments with it)") from None
        return found


def _site_packages(env: Path) -> Path:
    paths = sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})
    return Path(paths["purelib"])


def _link_overlay(overlay: Path) -> None:
    """Link every top-level entry of the hardware-bound distributions, and packcheck's own package."""
    overlay.mkdir(parents=True, exist_ok=True)
    for dist in _hardware_dists():
        root = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in (dist.files or []) if Path(str(f)).parts and Path(str(f)).parts[0] != ".."}
        for top in sorted(tops):
            src = root / top
            if src.exists() and not (overlay / top).exists():
                (overlay / top).symlink_to(src)
    (overlay / "pytest_packcheck").symlink_to(_package_root())


def _relink_package(overlay: Path) -> None:
    """Point a cached environment at the packcheck that runs now (another checkout or version may have made it)."""
    link = overlay / "pytest_packcheck"
    if link.is_symlink() and Path(os.readlink(link)) != _package_root():
        tmp = overlay / f".pytest_packcheck.{os.getpid()}"
        tmp.symlink_to(_package_root())
        os.replace(tmp, link)


def _uv_reason(output: str) -> str:
    """uv's explanation of a failed resolution, on one line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    why = [ln.removeprefix("╰─▶ ").removeprefix("cause: ") for ln in lines if ln.startswith(("╰─▶", "Because", "And because", "cause:"))]
    if not why:
        why = [ln for ln in lines if "error" in ln.lower()] or lines[-2:]
    return " ".join(" ".join(why).split())[:600]


def _check_hardware_requirements(site: Path) -> None:
    """Every requirement an installed library has on a hardware-bound package must hold for the linked one.

    Raises:
        EnvError: e.g. "accelerate 1.2 needs torch>=2.14: this environment's torch is 2.13.0+cpu".
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    linked = {canonical(d.metadata["Name"]): d.version for d in _hardware_dists()}
    for dist in metadata.distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            name = canonical(req.name)
            if name not in linked or not req.specifier:
                continue
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            have = Version(linked[name])
            if not req.specifier.contains(Version(have.public), prereleases=True):
                raise EnvError(
                    f"{dist.metadata['Name']} {dist.version} needs {req.name}{req.specifier}: this environment's "
                    f"{req.name} is {linked[name]}, and packcheck never installs another (run from an environment that has it)"
                )


def ensure_env(combo: VersionCombo, log: Any = None) -> VersionEnv:
    """Find or make the environment of ``combo``.

    Raises:
        EnvError: uv missing, resolution failed (uv's reason), or the libraries need another torch.
    """
    from filelock import FileLock

    t0 = time.perf_counter()
    root = cache_root() / "envs"
    root.mkdir(parents=True, exist_ok=True)
    key = env_key(combo)
    path = root / key
    with FileLock(str(root / f"{key}.lock")):
        marker = path / ENV_MARKER
        if marker.exists():
            _relink_package(path / "packcheck-overlay")
            info = json.loads(marker.read_text())
            return VersionEnv(combo, path, path / "bin" / "python", info["versions"], False,
                              round(time.perf_counter() - t0, 3), info)
        if path.exists():
            shutil.rmtree(path)  # a build that was killed half-way
        uv = _uv()
        env = {**os.environ, "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(cache_root() / "uv")}
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(path)],
                              check=False, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise EnvError(f"uv venv failed: {_uv_reason(proc.stderr)}")
        site = _site_packages(path)
        overlay = path / "packcheck-overlay"
        _link_overlay(overlay)
        (site / "_packcheck_overlay.pth").write_text(str(overlay) + "\n")
        overrides = path / "packcheck-overrides.txt"
        hardware = "".join(f'{canonical(d.metadata["Name"])} ; python_version < "0"\n' for d in _hardware_dists())
        applicable = applicable_overrides(combo)
        always = [o for o in applicable if o["when"] == "always"]
        overrides.write_text(hardware + "".join(o["requirement"] + "\n" for o in always))
        requirements = [*combo.requirements, *_base_requirements(combo)]
        cmd = [uv, "pip", "install", "--python", str(path / "bin" / "python"), "--override", str(overrides), *requirements]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        used: list[dict[str, str]] = [{**o, "without": "resolves, but to a set the release does not run with"}
                                      for o in always]
        if proc.returncode and (extra := [o for o in applicable if o["when"] != "always"]):
            # the index cannot meet the release's own requirements: the documented overrides, then say so
            overrides.write_text(hardware + "".join(o["requirement"] + "\n" for o in (*always, *extra)))
            first = _uv_reason(proc.stderr + proc.stdout)
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
            used += [{**o, "without": first} for o in extra]
        if log:
            log(f"[{combo.label}] {' '.join(cmd[1:3])} ...: exit {proc.returncode}")
        if proc.returncode:
            shutil.rmtree(path, ignore_errors=True)
            raise EnvError(f"{' '.join(combo.requirements)}: not installable: {_uv_reason(proc.stderr + proc.stdout)}")
        try:
            _check_hardware_requirements(site)
        except EnvError:
            shutil.rmtree(path, ignore_errors=True)
            raise
        versions = {}
        for dist in metadata.distributions(path=[str(site)]):
            name = canonical(dist.metadata["Name"])
            if name in set(combo.names()) | {lib.name for lib in LIBRARIES if lib.env_versions}:
                versions[name] = dist.version
        info = {"requirements": list(combo.requirements), "installed": requirements, "versions": versions,
                "seconds": round(time.perf_counter() - t0, 3), "uv": proc.stderr.strip().splitlines()[:2],
                **({"overrides": used} if used else {})}
        marker.write_text(json.dumps(info, indent=1) + "\n")
    return VersionEnv(combo, path, path / "bin" / "python", versions, True, round(time.perf_counter() - t0, 3), info)


# ----------------------------------------------------------------------------------------------------------------
# Running the plugin in an environment

#: Set in the child run: its label; the child then turns a model its transformers cannot resolve into an
#: "unsupported" model instead of a usage error (the parent resolved it with another version).
CHILD_ENV_VAR = "PACKCHECK_ENV_LABEL"


@dataclass
class EnvRun:
    """What one environment's run handed back."""

    combo: VersionCombo
    cells: dict[str, dict[str, Any]]  # child cell_id -> cell record
    env: VersionEnv | None
    error: str | None  # the environment could not be made, or the run produced no results
    environment: dict[str, Any] = field(default_factory=dict)  # the child's environment() fingerprint
    log: str | None = None  # the run's output, relative to the report folder
    seconds: float = 0.0


def _tolerance_toml(tolerances: dict[str, dict[str, float]]) -> str:
    return "".join(f"[{d}]\n" + "".join(f"{k} = {v!r}\n" for k, v in t.items()) for d, t in tolerances.items())


def env_run_timeout(settings: Any, n_models: int) -> float | None:
    """Seconds the whole run in one version environment may take: every cell at the per-cell timeout, plus 10
    minutes of start-up; None when --packcheck-timeout is 0 (no limit)."""
    if not settings.timeout_s:
        return None
    cells = max(1, n_models) * len(settings.dtypes) * len(settings.checks) * max(1, len(settings.backends))
    return settings.timeout_s * cells + 600.0


def run_in_env(combo: VersionCombo, settings: Any, models: list[str], report_dir: Path, threads: int | None = None) -> EnvRun:
    """Make (or find) the environment of ``combo`` and run the packcheck plugin there on ``models`` with the
    same backends, checks, dtypes, weights, device and tolerances. Never raises for an environment problem:
    that becomes ``EnvRun.error``."""
    import dataclasses
    import tempfile

    t0 = time.perf_counter()
    extras = check_requirements(settings.checks, combo, getattr(settings, "stack_libraries", ()))
    try:
        try:
            env = ensure_env(dataclasses.replace(combo, extras=extras))
        except EnvError:
            if not extras:
                raise
            # no TRL fits this combination: the environment without it; its sft cells say TRL is not installed
            env = ensure_env(combo)
    except EnvError as exc:
        return EnvRun(combo, {}, None, str(exc), seconds=round(time.perf_counter() - t0, 3))
    slug = env.path.name
    from ..report.formats import LOGS_DIR

    log_rel = f"{LOGS_DIR}/{slug}.log"  # relative to the report folder; the matrix's cells name it
    with tempfile.TemporaryDirectory(prefix="packcheck-env-") as tmp:
        root = Path(tmp)
        tol = root / "tolerances.toml"
        tol.write_text(_tolerance_toml(settings.tolerances))
        out = root / "out"
        args = [str(env.python), "-m", "pytest", "-p", "pytest_packcheck.plugin", "-p", "no:cacheprovider",
                str(root), "--rootdir", str(root), "-c", os.devnull, "-o", "addopts=", "-q", "-rN",
                "-W", "ignore::pytest.PytestAssertRewriteWarning",
                *settings.to_args(tolerance_file=str(tol), models=models, report_dir=str(out), version_child=True)]
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("PACKCHECK_") or k == "PACKCHECK_CACHE_DIR"}
        child_env.pop("VIRTUAL_ENV", None)
        child_env.pop("PYTHONPATH", None)  # the environment's own site-packages, nothing of this one
        child_env[CHILD_ENV_VAR] = combo.label
        if threads:
            child_env["OMP_NUM_THREADS"] = str(threads)
        limit = env_run_timeout(settings, len(models))
        try:
            proc = subprocess.run(args, check=False, capture_output=True, text=True, env=child_env, cwd=root, timeout=limit)
        except subprocess.TimeoutExpired as exc:  # the child's own per-cell timeouts failed to end it
            def text_of(b: Any) -> str:
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            proc = subprocess.CompletedProcess(args, -9, text_of(exc.stdout),
                                               text_of(exc.stderr) + f"\nkilled: no end within {limit:g} s")
        log = report_dir / log_rel
        log.parent.mkdir(parents=True, exist_ok=True)
        text = f"$ {' '.join(args[1:])}\n# exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        from ..results.io import scrub

        try:
            log.write_text(scrub(text))  # no tokens, no home-directory paths in what a report links to
        except OSError as exc:  # the disk filled up during the run: one line, not a traceback
            from ..results.io import write_failure

            raise PackcheckUsageError(write_failure(log, exc)) from None
        result = out / "packcheck-matrix.json"
        if not result.exists():
            tail = " | ".join(ln.strip() for ln in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
            return EnvRun(combo, {}, env, f"the run in {combo.label} wrote no results (exit {proc.returncode}; "
                          f"{tail[:400]}; full output in {log_rel})", log=log_rel, seconds=round(time.perf_counter() - t0, 3))
        doc = read_results(result)
    cells = {c["cell_id"]: c for c in doc["cells"]}
    return EnvRun(combo, cells, env, None, doc.get("environment", {}), log_rel, round(time.perf_counter() - t0, 3))


# ----------------------------------------------------------------------------------------------------------------
# What the checks need (whether the versions exist: versions/releases.py)


#: The TRL a version environment gets for the SFT checks when the combination names none: packcheck's own floor
#: (pyproject's ``trl`` extra). Unbounded, uv took trl 0.11.4 and datasets 2.14.4 beside transformers 4.57.1
#: (huggingface-hub < 1.0), whose datasets breaks on today's pyarrow and takes transformers' Trainer down with it.
TRL_FLOOR = next(f"{lib.name}>={lib.floor}" for lib in LIBRARIES if lib.install == "checks")


def check_requirements(checks: Any, combo: VersionCombo, libraries: Any = ()) -> tuple[str, ...]:
    """Distributions a version environment needs for ``checks`` beyond packcheck's runtime: TRL (which brings
    ``datasets``) for the SFT checks (the ``sft`` module's rows of the registry), when TRL is installed here (the
    controller plans them only then) and the combination names no TRL; at :data:`TRL_FLOOR` or later, so uv picks
    the TRL that fits the environment's transformers. Issue 27: with ``--packcheck-checks trainer,sft`` the sft
    cells were skipped with "No module named 'datasets'" inside the environments while the header said trl 1.16.0.
    Where no TRL fits, :func:`run_in_env` makes the environment without it and the sft cells say so.

    ``libraries``: the stack elements' libraries (``Settings.stack_libraries``): each one the combination does not
    name and packcheck's runtime does not bring (peft for the adapters) at this environment's version, so an axis over
    accelerate or trl runs the adapters with the peft installed here (before, ``--packcheck-versions accelerate==X
    --packcheck-stack lora`` skipped every lora cell: "needs peft (not installed here)")."""
    from ..checks.registry import SPECS

    names = set(combo.names())
    out: list[str] = []
    if "trl" not in names and any("trl" in SPECS[c].requires for c in checks or () if c in SPECS):
        try:
            metadata.version("trl")
            out.append(TRL_FLOOR)
        except metadata.PackageNotFoundError:
            pass
    runtime = {canonical(p) for p in PACKCHECK_RUNTIME}
    for lib in libraries or ():
        if canonical(lib) in names or canonical(lib) in runtime:
            continue
        try:
            out.append(f"{lib}=={metadata.version(lib)}")
        except metadata.PackageNotFoundError:
            continue  # not installed here: the element's cells say which package they need
    return tuple(dict.fromkeys(out))


def stack_version_mismatch(combo: VersionCombo, cell: dict[str, Any]) -> str | None:
    """Why a version environment's ``cell`` did not run the combination's own stack library, or None: a cell's
    ``metrics["stack"]`` records the version of its element's library (``peft`` for the adapters, ``accelerate`` for
    ``cp``, model/stack.py), and where ``combo`` pins that library (``peft==0.17.1``) the two must agree. They do not
    when the child imports another copy than its environment's (a ``PYTHONPATH`` or ``.pth`` that reaches this
    environment's site-packages): the cell would be filed under a release it never ran."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    stack = (cell.get("metrics") or {}).get("stack") or {}
    for text in combo.requirements:
        req = Requirement(text)
        got = stack.get(canonical(req.name)) or stack.get(canonical(req.name).replace("-", "_"))
        if got is None:
            continue
        try:
            ok = Version(str(got)) in req.specifier
        except InvalidVersion:
            ok = False
        if not ok:
            return (f"the cell ran {req.name} {got}, not {text} (its environment's): the child imported another "
                    f"{req.name}; check PYTHONPATH and the environment's .pth files, then run again")
    return None
