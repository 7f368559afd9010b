"""The libraries whose versions matter, described once.

One :class:`Library` record per library: its names, where its releases come from, whether it is tied to this
machine's hardware, how it gets into a version environment, where its version is shown, and how a remedy
words an upgrade of it. Everything else reads this table: the results' environment record and the resume
fingerprint (``results.environment``, ``run.sandbox``), the report headers (:func:`header_libraries`), the
version axis (``versions.envs``), the gate's stack lines, the guard's version record and bisect (release
notes, the library a gate regression moved, upgrade remedies).

Adding a library is one record here (and a test); a library on the version axis needs nothing else.
Pure data and string functions: no import beyond the standard library (the plugin imports this module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

#: How a library gets into a version environment (``--packcheck-versions``), see :attr:`Library.install`.
INSTALL_KINDS = ("linked", "pinned", "runtime", "checks", "axis")


@dataclass(frozen=True)
class Library:
    """One library whose version changes what packcheck measures.

    ``name``: the distribution's canonical (PEP 503) name on the package index, e.g. ``flash-attn``; ``key``
    (derived) is the name in a results file's ``environment`` record and the stack lines (``flash_attn``).
    ``import_name``: the top-level module. ``dists``: further distribution names its version is read from.
    ``source``: where its releases are listed (``pypi``: the PEP 691 simple index, ``$PACKCHECK_INDEX_URL`` or
    uv's / pip's configured index); ``repo``: the GitHub owner/repo whose releases pages bisect links to.

    ``hardware``: tied to this machine's hardware or the torch build: never reinstalled, so it can never be on
    the version axis; ``pattern`` (a regex over canonical names, default the name) also covers its siblings.

    ``install``: how it gets into a version environment: ``linked`` (from this environment, never installed:
    every hardware library), ``pinned`` (this environment's version unless the combination names one),
    ``runtime`` (packcheck's own runtime: installed in every environment, the resolver picks the version),
    ``checks`` (installed at ``floor`` or later when the run's checks need it), ``axis`` (only when the
    combination names it).

    Where its version is shown: ``recorded`` (every results file's environment record, hence the fingerprint a
    resumed run must match), ``header`` (the report headers and the gate's versions lines), ``stack`` (the
    gate's stack line and the guard's record), ``env_versions`` (the resolved versions a version environment
    records). ``upgrade_names``: how remedy prose names it in "upgrade <name> to >= <version>", the first one
    written by :func:`upgrade_advice`.
    """

    name: str
    import_name: str
    dists: tuple[str, ...] = ()
    source: str = "pypi"
    repo: str | None = None
    hardware: bool = False
    pattern: str | None = None
    install: str = "axis"
    floor: str | None = None
    recorded: bool = False
    header: bool = False
    stack: bool = False
    env_versions: bool = False
    upgrade_names: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The name in a results file's ``environment`` and in the gate's stacks: ``flash_attn``."""
        return self.name.replace("-", "_")

    @property
    def label(self) -> str:
        """The name in headers and messages: the distribution's (``flash-attn``)."""
        return self.name


#: In order: the order of every header and stack line.
LIBRARIES: tuple[Library, ...] = (
    Library("torch", "torch", repo="pytorch/pytorch", hardware=True, install="linked",
            recorded=True, header=True, stack=True),
    Library("transformers", "transformers", repo="huggingface/transformers", install="pinned",
            recorded=True, header=True, stack=True, env_versions=True, upgrade_names=("transformers",)),
    Library("trl", "trl", repo="huggingface/trl", install="checks", floor="0.19",
            recorded=True, header=True, stack=True, env_versions=True, upgrade_names=("TRL", "trl")),
    # flash-attn-3 (flash_attn_interface) is a sibling distribution: linked the same way
    Library("flash-attn", "flash_attn", dists=("flash_attn",), repo="Dao-AILab/flash-attention", hardware=True,
            pattern=r"flash-attn.*", install="linked", recorded=True, header=True, stack=True),
    Library("accelerate", "accelerate", repo="huggingface/accelerate", install="runtime", stack=True, env_versions=True),
    # the stack elements' adapters (model/stack.py: lora, dora, prompt / p- / prefix tuning): a version axis
    # (--packcheck-versions peft==X); each stack cell records the version it ran (metrics["stack"]["peft"])
    Library("peft", "peft", repo="huggingface/peft", env_versions=True),
    Library("datasets", "datasets", repo="huggingface/datasets", stack=True, env_versions=True),
    Library("tokenizers", "tokenizers", repo="huggingface/tokenizers", env_versions=True),
    Library("huggingface-hub", "huggingface_hub", repo="huggingface/huggingface_hub", install="runtime", env_versions=True),
    Library("kernels", "kernels", repo="huggingface/kernels"),
    # the RL trainers whose own packing code the rl suite runs (checks/rl_trainers.py): on the axis when named
    # ("verl==0.9.1"); their GPU stacks (ray, flash-attn, deepspeed, modelscope) are not installed with them here
    Library("verl", "verl", repo="volcengine/verl", env_versions=True),
    Library("openrlhf", "openrlhf", repo="OpenRLHF/OpenRLHF", env_versions=True),
    Library("ms-swift", "swift", repo="modelscope/ms-swift", env_versions=True),
    # the rest of the torch build: linked, never on the axis, versions not shown
    Library("torchvision", "torchvision", hardware=True, install="linked"),
    Library("torchaudio", "torchaudio", hardware=True, install="linked"),
    Library("triton", "triton", hardware=True, pattern=r"triton|pytorch-triton.*", install="linked"),
    Library("xformers", "xformers", hardware=True, install="linked"),
    Library("causal-conv1d", "causal_conv1d", hardware=True, install="linked"),
    Library("mamba-ssm", "mamba_ssm", hardware=True, install="linked"),
)

#: Distributions of the CUDA build that are no library of the table but are as tied to the hardware (regexes
#: over canonical names): linked into version environments like the hardware libraries.
CUDA_PACKAGES = (r"nvidia-.*", r"cuda-.*", r"cupy-.*")

BY_NAME: dict[str, Library] = {lib.name: lib for lib in LIBRARIES}


def _check_table() -> None:
    """The table's own rules, at import: unique names, a known install kind, hardware libraries linked."""
    problems = [] if len(BY_NAME) == len(LIBRARIES) else ["a library is listed twice"]
    for lib in LIBRARIES:
        if lib.install not in INSTALL_KINDS:
            problems.append(f"{lib.name}: install {lib.install!r} is not one of {INSTALL_KINDS}")
        if lib.hardware != (lib.install == "linked"):
            problems.append(f"{lib.name}: a hardware library is linked, and no other is")
        if lib.install == "checks" and not lib.floor:
            problems.append(f"{lib.name}: a library installed for the checks needs a floor")
        if lib.name != re.sub(r"[-_.]+", "-", lib.name).lower():
            problems.append(f"{lib.name}: not a canonical (PEP 503) name")
    if problems:
        raise ValueError("versions/libraries.py: " + "; ".join(problems))


_check_table()


def library(name: str) -> Library | None:
    """The record of ``name`` (a distribution name in any spelling, or an environment key); None if unlisted."""
    canonical = re.sub(r"[-_.]+", "-", name).lower()
    return BY_NAME.get(canonical)


def recorded_libraries() -> tuple[Library, ...]:
    """The libraries in every results file's environment record (and the resume fingerprint), in order."""
    return tuple(lib for lib in LIBRARIES if lib.recorded)


def header_libraries() -> tuple[Library, ...]:
    """The libraries a report header names, in order (``lib.label`` and its ``environment[lib.key]``)."""
    return tuple(lib for lib in LIBRARIES if lib.header)


def stack_libraries() -> tuple[Library, ...]:
    """The libraries of the stack a gate's summary and a guard report name, in order."""
    return tuple(lib for lib in LIBRARIES if lib.stack)


def axis_libraries() -> tuple[Library, ...]:
    """The libraries a user may put on the version axis: every one not tied to the hardware."""
    return tuple(lib for lib in LIBRARIES if not lib.hardware)


def hardware_patterns() -> tuple[str, ...]:
    """Regexes over canonical distribution names of everything a version environment links instead of
    installing: the hardware libraries (and their siblings) and the CUDA packages."""
    return (*(lib.pattern or re.escape(lib.name) for lib in LIBRARIES if lib.hardware), *CUDA_PACKAGES)


def installed_version(lib: Library) -> str | None:
    """The installed version of ``lib`` in this environment (its distribution's metadata); None if absent."""
    for dist in (lib.name, *lib.dists):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def module_version(dist: str) -> str:
    """The installed version of the distribution ``dist`` (``trl``, ``transformers``) from its metadata, the one
    source: a package need not define ``__version__`` (issue 41: a TRL release read without it was "unknown").
    Falls back to the imported module's ``__version__`` where the distribution has no metadata (a source checkout on
    ``PYTHONPATH``), else ``"not installed"``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        import importlib

        try:
            return str(importlib.import_module(dist.replace("-", "_")).__version__)
        except (ImportError, AttributeError):
            return "not installed"


def versions_line(env: dict[str, Any], libraries: tuple[Library, ...] | None = None, missing: str = "not installed") -> str:
    """``torch 2.13.0+cpu, transformers 5.24.0, trl 1.16.0, flash-attn not installed``: the header libraries'
    versions in ``env`` (an environment record)."""
    return ", ".join(f"{lib.label} {env.get(lib.key) or missing}" for lib in libraries or header_libraries())


def upgrade_advice(name: str, version: str) -> str:
    """The words of an upgrade remedy, which :func:`find_upgrade` reads back: ``upgrade TRL to >= 0.23.1``.

    Raises:
        KeyError: ``name`` is not in the table.
    """
    lib = library(name)
    if lib is None:
        raise KeyError(f"unknown library {name!r}; expected one of {', '.join(BY_NAME)}")
    return f"upgrade {(lib.upgrade_names or (lib.name,))[0]} to >= {version}"


def _upgrade_pattern() -> re.Pattern[str]:
    names = {n: lib for lib in LIBRARIES if not lib.hardware for n in (*lib.upgrade_names, lib.name)}
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"upgrade ({alternatives}) to >= ([0-9][0-9.]*[0-9])")


_UPGRADE = _upgrade_pattern()


def find_upgrade(text: str) -> tuple[str, str] | None:
    """(library name, version) of the first "upgrade <library> to >= <version>" in a remedy; None when it names
    no upgrade of a library of the table."""
    m = _UPGRADE.search(text)
    if not m:
        return None
    lib = library(m.group(1))
    return (lib.name if lib else m.group(1).lower()), m.group(2)
