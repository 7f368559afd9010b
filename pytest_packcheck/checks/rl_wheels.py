"""The RL trainers' released wheels, imported from the files, never installed (issue 44).

verl, OpenRLHF and ms-swift pin GPU stacks (ray, vLLM, deepspeed, flash-attn) and versions of transformers / TRL
that a project's environment cannot take, so their packing code is run from the wheels ``pip download --no-deps``
saves (``constraints/rl-peers.txt`` pins them, with the few pure-Python packages their measured modules import;
``.ci/run`` downloads them into ``build/rl-peers``): :func:`unpack_wheel` unpacks a wheel once into a folder beside
it (a wheel's ``<name>.data/purelib`` / ``platlib`` content moved to the top, as pip installs it; a compiled module
such as tensordict's ``_C.so`` cannot load from a zip), and :func:`wheels_on_path` puts the folders on ``sys.path``
while a block runs and takes every module they gave out of ``sys.modules`` afterwards.

Top-level folders a wheel ships beside its package (:data:`SKIPPED_TOPS`) are never unpacked: OpenRLHF 0.11.2's
wheel carries a top-level ``tests`` package and verl 0.9.1's ``tests`` and ``scripts``; on ``sys.path`` they would
shadow a project's own ``tests`` (installed into site-packages, OpenRLHF's did).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The pins: the trainers' releases and what their measured modules import (relative to the repository root).
RL_PEERS_FILE = Path("constraints") / "rl-peers.txt"
#: Where ``.ci/run`` downloads them, and the variable naming another folder.
DEFAULT_DIR = Path("build") / "rl-peers"
ENV_VAR = "RL_PEER_WHEELS"
#: Top-level folders of a wheel never unpacked (module docstring).
SKIPPED_TOPS = frozenset({"tests", "test", "scripts", "examples", "docs", "benchmarks"})
#: The wheels each trainer's measured modules need (distribution names as in :data:`RL_PEERS_FILE`): the trainer's
#: own, then what its modules import that a project's test environment lacks.
NEEDS: dict[str, tuple[str, ...]] = {
    "verl": ("verl", "tensordict", "cloudpickle", "pyvers", "einops"),
    "openrlhf": ("openrlhf", "einops"),
    "ms-swift": ("ms-swift", "json-repair", "einops"),
    "einops": ("einops",),
    "unsloth": ("unsloth", "unsloth-zoo"),
}
#: The marker an unpacked folder holds: the wheel's sha256 (a changed wheel is unpacked again).
MARKER = ".packcheck-unpacked"


def pins(text: str) -> dict[str, str]:
    """``{distribution: version}`` of a constraints file's ``name==version`` lines (comments and blanks skipped),
    names normalised as pip does (lower case, ``_`` -> ``-``).

    Raises:
        ValueError: a line that is not ``name==version`` (named, with its number)."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{RL_PEERS_FILE}:{number}: '{raw.strip()}' is not name==version: pin each wheel exactly")
        out[_norm(name)] = version.strip()
    return out


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def wheel_dist(wheel: Path) -> tuple[str, str]:
    """``(distribution, version)`` of a wheel file name, the distribution normalised (``ms_swift-4.6.0-py3-none-any.whl``
    -> ``("ms-swift", "4.6.0")``).

    Raises:
        ValueError: the name is not a wheel's."""
    parts = wheel.name.split("-")
    if not wheel.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"'{wheel}' is not a wheel file name (name-version-python-abi-platform.whl): pass what "
                         "`pip download --no-deps` saves")
    return _norm(parts[0]), parts[1]


def find_wheels(folder: Path, wanted: dict[str, str]) -> tuple[dict[str, Path], list[str]]:
    """The wheel in ``folder`` for each ``{distribution: version}`` of ``wanted``: (found, missing), missing as
    ``name==version`` strings in ``wanted``'s order."""
    have: dict[tuple[str, str], Path] = {}
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        with contextlib.suppress(ValueError):
            have[wheel_dist(path)] = path
    found = {d: have[(d, v)] for d, v in wanted.items() if (d, v) in have}
    return found, [f"{d}=={v}" for d, v in wanted.items() if d not in found]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack_wheel(wheel: Path, root: Path | None = None) -> Path:
    """``wheel`` unpacked into ``<root>/<wheel name without .whl>`` (``root``: the wheel's folder's ``unpacked/``),
    once: a folder whose marker holds the wheel's sha256 is reused. ``<name>.data/purelib`` and ``platlib`` are moved to
    the top; :data:`SKIPPED_TOPS` and ``.data``'s scripts / headers are left out. Returns the folder to put on
    ``sys.path``.

    Raises:
        ValueError: the file is not a wheel (named)."""
    wheel_dist(wheel)
    dest = (root or wheel.parent / "unpacked") / wheel.name[:-len(".whl")]
    digest = _sha256(wheel)

    def ready() -> bool:
        marker = dest / MARKER
        return marker.is_file() and marker.read_text().strip() == digest

    if ready():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) > 2 and parts[0].endswith(".data"):
                    if parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if not parts or not parts[0] or parts[0] in SKIPPED_TOPS or info.is_dir():
                    continue
                target = tmp.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, target.open("wb") as out:
                    shutil.copyfileobj(src, out)
    except zipfile.BadZipFile as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"'{wheel}' is not a readable wheel ({exc}): download it again (pip download --no-deps)") from None
    (tmp / MARKER).write_text(digest + "\n")
    if ready():  # another process (an xdist worker) unpacked it meanwhile: theirs may be on its sys.path already
        shutil.rmtree(tmp, ignore_errors=True)
        return dest
    shutil.rmtree(dest, ignore_errors=True)  # a stale folder (another wheel of that name, an interrupted unpack)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not ready():
            raise
    return dest


def top_names(folder: Path) -> set[str]:
    """The importable top-level names an unpacked wheel gives (its packages and modules; dist-info left out)."""
    out = set()
    for entry in folder.iterdir():
        if entry.name.endswith((".dist-info", ".data")) or entry.name.startswith("."):
            continue
        if entry.is_dir() and entry.name.isidentifier():
            out.add(entry.name)
        elif entry.suffix in (".py", ".so") and entry.name.split(".")[0].isidentifier():
            out.add(entry.name.split(".")[0])
    return out


@contextlib.contextmanager
def wheels_on_path(folders: list[Path]) -> Iterator[set[str]]:
    """While the block runs, ``folders`` (unpacked wheels) come first on ``sys.path`` and the names they give import
    from them: entries of those names already in ``sys.modules`` (a copy installed in the environment) are set aside
    first. On exit the folders leave ``sys.path``, every module of those names leaves ``sys.modules`` and the entries
    set aside come back. Yields the top-level names."""
    tops = set().union(*(top_names(f) for f in folders)) if folders else set()
    guard = tops & SKIPPED_TOPS
    if guard:  # never: unpack_wheel leaves them out; a folder unpacked by hand must not shadow the project's tests
        raise ValueError(f"{sorted(guard)} would shadow the project's own packages: unpack with unpack_wheel")

    def ours(name: str) -> bool:
        return name.split(".")[0] in tops

    saved: dict[str, Any] = {n: m for n, m in sys.modules.items() if ours(n)}
    for name in saved:
        del sys.modules[name]
    entries = [str(f) for f in folders]
    sys.path[:0] = entries
    try:
        yield tops
    finally:
        for entry in entries:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def wheel_folder(repo_root: Path) -> Path:
    """``$RL_PEER_WHEELS`` or ``<repo_root>/build/rl-peers``."""
    return Path(os.environ.get(ENV_VAR) or repo_root / DEFAULT_DIR)


__all__ = ["DEFAULT_DIR", "ENV_VAR", "NEEDS", "RL_PEERS_FILE", "SKIPPED_TOPS", "find_wheels", "pins", "top_names",
           "unpack_wheel", "wheel_dist", "wheel_folder", "wheels_on_path"]

