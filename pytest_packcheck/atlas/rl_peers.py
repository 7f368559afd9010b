"""The RL trainers' own packing code per release: verl, OpenRLHF, ms-swift, unsloth (issue 44, part 2).

For each minor of each trainer since its packed path exists (:data:`RELEASES`, the latest patch of each), the
release's wheel (``pip download --no-deps``, saved under ``build/rl-peers/releases``) is unpacked and imported from
the files (:mod:`..checks.rl_wheels`) in a child process of its own, with the few pure-Python packages its modules
import (:data:`..checks.rl_wheels.NEEDS`, from ``build/rl-peers``), and the trainer's check
(:data:`CHECKS`: ``rl_verl_rmpad``, ``rl_openrlhf_packed``, ``rl_swift_padding_free``, ``rl_unsloth_grpo_packed``)
runs on :data:`FAMILIES` x
:data:`BACKENDS` against each sample alone. The library is the axis; the stack is this environment's (torch,
transformers), but for ms-swift, whose every release declares ``trl<1.0``: its releases run in the cached ``trl==0.29.1``
version environment (``--swift-python``) where one exists. unsloth's releases run with the unsloth_zoo release each
declares as its minimum (``Requires-Dist: unsloth_zoo>=X``, read from the wheel: :func:`zoo_of`), downloaded beside them.

Each release also records what its wheel does, read from its files (:func:`read_path`): the file and line of the
path's anchor (verl: the label roll of the remove-padding forward, ``torch.roll(input_ids_rmpad``; OpenRLHF: where
``Actor.forward`` packs; ms-swift: ``get_cu_seqlens`` in its padding-free DPO ``concatenated_forward``; unsloth: the first line of its GRPO
sequence-packing block, ``_pk_pad = self.processing_class.pad_token_id``, with its verifier's thresholds and their lines
(:func:`unsloth_verifier`)), and for verl
the import chain from its engine's ``forward_step`` module to ``ray`` (:func:`import_chain`): the engine path is a
named skip, never run. A transition is a release whose anchor file or verdict differs from the release before it.

The block is written to ``reports/atlas/rl_peers.json`` and rendered to ``reports/atlas/rl-peers.md`` (docs/rl.md
includes it); ``python -m pytest_packcheck.atlas.rl_peers --render-only`` renders it again without measuring.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..checks.rl_wheels import NEEDS, find_wheels, pins, unpack_wheel, wheel_dist
from .plan import version_key

#: The releases measured: the latest patch of every minor since the packed path exists (``pip index versions``).
#: verl 0.1 has no remove-padding forward (named: read from its wheel); OpenRLHF's ``packing_samples`` reaches
#: ``Actor.forward`` from 0.3; ms-swift's padding-free DPO from 3.5 (its ``dpo_trainer.py`` reads ``get_cu_seqlens``).
RELEASES: dict[str, tuple[str, ...]] = {
    "verl": ("0.1", "0.2.0.post2", "0.3.0.post1", "0.4.1", "0.5.0", "0.6.1", "0.7.1", "0.8.0", "0.9.1"),
    "openrlhf": ("0.3.8", "0.4.6", "0.5.9.post1", "0.6.4", "0.7.5", "0.8.11", "0.9.10", "0.10.4", "0.11.2"),
    "ms-swift": ("3.5.3", "3.6.4", "3.7.3", "3.8.3", "3.9.3", "3.10.3", "3.11.3", "3.12.6", "4.0.4", "4.1.3", "4.2.3",
                 "4.3.2", "4.4.2", "4.5.3", "4.6.0"),
    # unsloth: the newest patch of each month since 2026.7.1, the first release whose rl_replacements.py holds the GRPO
    # sequence-packing block (2026.6.9, the last without it, is its row that says so), and 2026.7.1 itself
    "unsloth": ("2026.6.9", "2026.7.1", "2026.7.6", "2026.8.22", "2026.9.14", "2026.10.9"),
}
#: The check each trainer's releases run (checks/registry.py, the rl suite).
CHECKS = {"verl": "rl_verl_rmpad", "openrlhf": "rl_openrlhf_packed", "ms-swift": "rl_swift_padding_free",
          "unsloth": "rl_unsloth_grpo_packed"}
#: Cheap: two families, sdpa and the CPU varlen reference.
FAMILIES: tuple[str, ...] = ("llama", "qwen2")
BACKENDS: tuple[str, ...] = ("sdpa", "packcheck_flash_ref")
#: Packages a release's modules import that neither the environment it runs in nor ``constraints/rl-peers.txt``
#: provides, downloaded beside the releases: the trl 0.29.1 environment has no peft (ms-swift's dpo_trainer.py imports
#: it at its top), no requests (ms-swift 3.x's swift/utils and swift/hub import it) and no pillow (ms-swift 4.x's
#: template modules import PIL); at this environment's versions.
RELEASE_EXTRAS = {"ms-swift": {"peft": "0.21.2", "requests": "2.34.2", "urllib3": "2.8.0", "certifi": "2026.10.19.post1",
                               "charset-normalizer": "3.5.3", "pillow": "13.0.0"}}
#: The path's anchor in a release's files: (folder under the wheel, regex), the first match named with file:line.
#: Several places: the first that matches (verl's actor until 0.7, its FSDP engine from 0.8).
ANCHORS: dict[str, tuple[tuple[str, ...], str]] = {
    "verl": (("verl/workers/actor/dp_actor.py", "verl/workers/engine/fsdp/transformer_impl.py", "verl/workers"),
             r"torch\.roll\(input_ids_rmpad"),
    "openrlhf": (("openrlhf/models/actor.py",), r"unpad_and_slice_tensor\(|reset_position_ids\(attention_mask\)"),
    "ms-swift": (("swift",), r"self\.get_cu_seqlens\("),
    "unsloth": (("unsloth/models/rl_replacements.py",), r"_pk_pad = self\.processing_class\.pad_token_id"),
}
#: The packages whose ``__init__`` rl_trainers never runs (bare namespaces): an import chain does not pass them.
BARE = {"verl": ("verl", "verl.utils", "verl.workers", "verl.workers.engine", "verl.workers.engine.fsdp")}
#: verl's engine module whose ``forward_step`` runs ``use_remove_padding`` (0.8 on; only there from 0.8).
VERL_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
BLOCK_FILE = Path("reports") / "atlas" / "rl_peers.json"
RENDER_FILE = Path("reports") / "atlas" / "rl-peers.md"
SCHEMA_VERSION = 1


def _files(folder: Path, where: str) -> list[Path]:
    path = folder / where
    return [path] if path.is_file() else sorted(path.rglob("*.py")) if path.is_dir() else []


def read_path(dist: str, folder: Path) -> dict[str, Any]:
    """What a release's files show of its packed path: ``{"anchor": "file:line" or None, "code": the line}``, and for
    verl ``engine``: the import chain from :data:`VERL_ENGINE` to ray (:func:`import_chain`), None where the module is
    absent."""
    wheres, pattern = ANCHORS[dist]
    out: dict[str, Any] = {"anchor": None, "code": None}
    for path in [p for where in wheres for p in _files(folder, where)]:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(pattern, line):
                out.update(anchor=f"{path.relative_to(folder)}:{number}", code=line.strip()[:120])
                break
        if out["anchor"]:
            break
    if dist == "verl":
        out["engine"] = import_chain(folder, VERL_ENGINE, "ray", bare=BARE["verl"])
    if dist == "unsloth":
        out["zoo"] = zoo_of(folder)
        if out["anchor"]:
            out["verifier"] = unsloth_verifier(folder / ANCHORS["unsloth"][0][0], int(out["anchor"].rsplit(":", 1)[1]))
    out["declared"] = declared(folder)
    return out


def zoo_of(folder: Path) -> str | None:
    """The unsloth_zoo release an unpacked unsloth wheel requires at least (its METADATA's ``Requires-Dist:
    unsloth_zoo>=X`` without extras), e.g. "2026.7.7"; None when it declares none."""
    meta = next(iter(sorted(folder.glob("*.dist-info/METADATA"))), None)
    for line in meta.read_text(errors="replace").splitlines() if meta else []:
        hit = re.match(r"Requires-Dist:\s*unsloth[_-]zoo\s*>=\s*([0-9][0-9.]*)\s*$", line)
        if hit:
            return hit.group(1)
    return None


def unsloth_verifier(path: Path, start: int) -> str | None:
    """unsloth's runtime verifier's thresholds in a release, read after line ``start`` (the packing block's first):
    "<file>:<line> accepts below 0.7; :<line> disables packing at 1.5" (``if _pk_diff < X`` / ``if _pk_diff >= Y``);
    None when either is missing."""
    lines = path.read_text(errors="replace").splitlines()
    found = {}
    for number in range(start, len(lines)):
        for key, pattern in (("accept", r"if _pk_diff < ([0-9.e+-]+):"), ("disable", r"if _pk_diff >= ([0-9.e+-]+):")):
            hit = re.search(pattern, lines[number - 1])
            if hit and key not in found:
                found[key] = (number, float(hit.group(1)))
        if len(found) == 2:
            rel = "unsloth/models/rl_replacements.py"
            return (f"{rel}:{found['accept'][0]} accepts below {found['accept'][1]:g}; "
                    f":{found['disable'][0]} disables packing at {found['disable'][1]:g} (nats)")
    return None


def declared(folder: Path, names: tuple[str, ...] = ("transformers", "trl")) -> str:
    """What an unpacked wheel's METADATA declares on ``names`` (its ``Requires-Dist`` lines without extras), e.g.
    "transformers==4.46.1"; "" when it declares nothing on them."""
    meta = next(iter(sorted(folder.glob("*.dist-info/METADATA"))), None)
    if meta is None:
        return ""
    picked = []
    for line in meta.read_text(errors="replace").splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].split(";")[0].replace(" ", "")
            if re.split(r"[<>=!~\[(]", req, maxsplit=1)[0].lower() in names:
                picked.append(req)
    return ", ".join(dict.fromkeys(picked))


def _top_imports(path: Path) -> list[tuple[str, int]]:
    """The modules a file imports at its top level (not inside a function or a ``try`` body), with the lines."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    out: list[tuple[str, int]] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append(("." * node.level + (node.module or ""), node.lineno))
                out += [("." * node.level + ((node.module + ".") if node.module else "") + a.name, node.lineno)
                        for a in node.names]
            else:
                out.append((node.module or "", node.lineno))
                out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _module_file(folder: Path, name: str) -> Path | None:
    base = folder.joinpath(*name.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py" if (base / "__init__.py").is_file() else None


def _resolve(importer: str, name: str, is_package: bool) -> str:
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    rest = name.lstrip(".")
    return ".".join([*base, rest] if rest else base)


def import_chain(folder: Path, start: str, target: str, bare: tuple[str, ...] = ()) -> list[str] | None:
    """The shortest chain of top-level imports from module ``start`` to package ``target`` in an unpacked wheel,
    read with ``ast`` (nothing imported): ``["verl/workers/engine/fsdp/transformer_impl.py:38", ...,
    "verl/single_controller/base/worker.py:23 import ray"]``; every package ``__init__`` on the way counts (Python runs
    them) but those of ``bare`` (registered as bare namespaces, as rl_trainers imports verl). None when ``start`` is
    not in the wheel; [] when no chain reaches ``target``."""
    if _module_file(folder, start) is None:
        return None
    top = start.split(".")[0]
    queue: list[tuple[str, list[str]]] = []
    seen: set[str] = set()

    def visit(module: str, chain: list[str]) -> None:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way run their __init__ first
            name = ".".join(parts[:i])
            if name not in seen and (name == module or name not in bare) and _module_file(folder, name) is not None:
                seen.add(name)
                queue.append((name, chain))

    visit(start, [])
    while queue:
        module, chain = queue.pop(0)
        path = _module_file(folder, module)
        if path is None:
            continue
        rel = str(path.relative_to(folder))
        for name, line in _top_imports(path):
            resolved = _resolve(module, name, path.name == "__init__.py")
            if resolved.split(".")[0] == target:
                return [*chain, f"{rel}:{line} import {target}"]
            if resolved.split(".")[0] == top:
                visit(resolved, [*chain, f"{rel}:{line}"])
    return []


# ------------------------------------------------------------------------------------------------------------
# one release, in a child process


def _child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run in the child: the folders on sys.path, the trainer's check on every family x backend. Returns the cells."""
    from ..checks import rl_packers, rl_trainers
    from ..checks.rl_wheels import wheels_on_path
    from .peer_paths import build_bench

    name = f"check_{CHECKS[spec['dist']]}"
    check = getattr(rl_trainers, name, None) or getattr(rl_packers, name)
    cells = []
    with wheels_on_path([Path(f) for f in spec["folders"]]):
        for family in spec["families"]:
            for backend in spec["backends"]:
                started = time.process_time()
                try:
                    result = check(build_bench(family, backend))
                    cell = {"status": result.status, "message": result.message, "cause": result.cause,
                            "metrics": {k: v for k, v in result.metrics.items()
                                        if isinstance(v, (int, float, str, bool, list)) or v is None}}
                except Exception as exc:  # noqa: BLE001 - a model that does not build here is a cell, not a crash
                    cell = {"status": "error", "message": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
                            "cause": "crash", "metrics": {}}
                cell.update(model=family, backend=backend, cpu_s=round(time.process_time() - started, 2))
                cells.append(cell)
    return cells


def _wheel(folder: Path, dist: str, version: str) -> Path:
    found, missing = find_wheels(folder, {dist: version})
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", f"{dist}=={version}", "-d", str(folder)], check=True)
        found, missing = find_wheels(folder, {dist: version})
        if missing:
            raise FileNotFoundError(f"pip download saved no wheel of {dist}=={version} in {folder}")
    return found[dist]


def run_release(dist: str, version: str, build: Path, python: str, families: tuple[str, ...] = FAMILIES,
                backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """One release: its wheel (downloaded into ``<build>/releases`` when missing) read (:func:`read_path`) and
    measured in a child ``python`` with the pinned extras from ``<build>`` (:data:`..checks.rl_wheels.NEEDS`) and
    :data:`RELEASE_EXTRAS`. Returns the release's record: version, path, cells (or skip), the child's wall seconds."""
    releases = build / "releases"
    releases.mkdir(parents=True, exist_ok=True)
    folder = unpack_wheel(_wheel(releases, dist, version))
    pinned = pins((Path(__file__).resolve().parents[2] / "constraints" / "rl-peers.txt").read_text())
    extras = {d: pinned[d] for d in NEEDS[dist][1:] if not (dist == "unsloth" and d == "unsloth-zoo")}
    found, missing = find_wheels(build, extras)
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} wheel in {build}: pip download --no-deps -r "
                                "constraints/rl-peers.txt -d build/rl-peers")
    folders = [folder, *(unpack_wheel(found[d]) for d in extras)]
    folders += [unpack_wheel(_wheel(releases, d, v)) for d, v in RELEASE_EXTRAS.get(dist, {}).items()]
    record: dict[str, Any] = {"version": version, "path": read_path(dist, folder)}
    if dist == "unsloth" and record["path"]["anchor"] and record["path"].get("zoo"):  # the zoo it declares, per release
        folders.append(unpack_wheel(_wheel(releases, "unsloth-zoo", record["path"]["zoo"])))
    if record["path"]["anchor"] is None:
        record["cells"] = []
        record["skip"] = (f"{dist} {version} has no such path: no line of {', '.join(ANCHORS[dist][0])} matches "
                          f"{ANCHORS[dist][1]!r} (read from its wheel)")
        if dist == "unsloth":  # the anchor is a plain line: quote it as it reads
            record["skip"] = (f"unsloth {version} has no GRPO sequence-packing block: no line of {ANCHORS[dist][0][0]} "
                              f"holds '{ANCHORS[dist][1].replace(chr(92), '')}' (read from its wheel)")
        return record
    spec = {"dist": dist, "folders": [str(f) for f in folders], "families": list(families), "backends": list(backends)}
    code = ("import json, sys; from pytest_packcheck.atlas.rl_peers import _child; "
            "print('RLPEERS' + json.dumps(_child(json.loads(sys.argv[1]))))")
    started, cpu = time.monotonic(), _children_cpu()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # unsloth_zoo 2026.9's temporary_patches/moe_utils.py copies itself there at import (default: the cwd's
           # unsloth_compiled_cache/, the repository root here)
           "UNSLOTH_COMPILE_LOCATION": str((releases / "unsloth_compiled_cache").resolve())}
    proc = subprocess.run([python, "-c", code, json.dumps(spec)], check=False, capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=900)
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["cpu_s"] = round(_children_cpu() - cpu, 1)  # the child's user + system seconds, imports included
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RLPEERS")), None)
    if line is None:
        tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
        record["cells"], record["skip"] = [], f"the child exited {proc.returncode} before any cell: {tail}"
    else:
        record["cells"] = json.loads(line[len("RLPEERS"):])
    return lean(pack(home_as_tilde(record))) if dist in LEAN else pack(home_as_tilde(record))


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (``resource.RUSAGE_CHILDREN``)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


#: The metrics a cell keeps in the block (the check's numbers and the release's semantics it was compared under).
KEPT_METRICS = ("max_abs_logprob_diff", "max_abs_seq_logprob_diff", "max_abs_entropy_diff", "max_abs_margin_diff",
                "initial_loss", "non_finite_logprobs", "entropy_compared", "logprob_temperature", "entropy_temperature",
                "missing_module", "raised_at", "unsloth_verifier_diff")


def pack(record: dict[str, Any]) -> dict[str, Any]:
    """A release's record as the block keeps it (small: reports/ has a size cap): the stand-ins once per release
    (``stand_ins``, taken out of each cell's message and metrics), :data:`KEPT_METRICS` only, and a message equal to
    the release's first cell's stored once (``message_from: 0``); a passing cell after the first keeps no message (its
    numbers are its metrics; :func:`render` reads the first cell's tags and the messages of the others that do not
    pass). :func:`render` reads it as it is."""
    cells = record.get("cells", [])
    stand_ins = next((c["metrics"].get("stand_ins") for c in cells if c.get("metrics", {}).get("stand_ins")),
                     record.get("stand_ins") or [])
    if stand_ins:
        record["stand_ins"] = stand_ins
    first = None
    for cell in cells:
        message = cell.get("message")
        if message is not None:
            for text in (f" ({'; '.join(stand_ins)})", f"; {'; '.join(stand_ins)}", *stand_ins):
                message = message.replace(text, "") if text.strip("(); ") else message
        cell["metrics"] = {k: v for k, v in cell.get("metrics", {}).items() if k in KEPT_METRICS}
        if first is not None and cell.get("status") == "pass":  # its numbers are its metrics; render reads cell 0's
            cell.pop("message", None)
        elif first is not None and message == first:
            cell.pop("message", None)
            cell["message_from"] = 0
        else:
            cell["message"] = message
        first = first if first is not None else message
    return record


#: The trainers whose records :func:`lean` trims further (added when reports/ was within 15 KB of its size cap).
LEAN = ("unsloth",)
#: The metrics a lean cell keeps.
LEAN_METRICS = ("max_abs_logprob_diff", "max_abs_seq_logprob_diff", "unsloth_verifier_diff", "non_finite_logprobs",
                "missing_module", "raised_at")


def lean(record: dict[str, Any]) -> dict[str, Any]:
    """A packed record (:func:`pack`) smaller still: a passing cell keeps no message (its numbers are its metrics);
    metrics are :data:`LEAN_METRICS`, floats to 3 significant digits, None and a zero ``non_finite_logprobs`` left
    out; a ``cause`` of None left out. A non-passing cell keeps its message. Idempotent."""
    cells = record.get("cells", [])
    texts = [message_of(record, c) for c in cells]  # before any message goes (message_from points at cell 0)
    for cell, text in zip(cells, texts, strict=True):
        cell.pop("message", None)
        cell.pop("message_from", None)
        if cell.get("status") != "pass":
            cell["message"] = text
        if cell.get("cause", 0) is None:
            cell.pop("cause")
        metrics = {}
        for key, value in cell.get("metrics", {}).items():
            if key not in LEAN_METRICS or value is None or (key == "non_finite_logprobs" and value == 0):
                continue
            metrics[key] = float(f"{value:.3g}") if isinstance(value, float) else value
        cell["metrics"] = metrics
    return record


def message_of(record: dict[str, Any], cell: dict[str, Any]) -> str:
    """A cell's message, read back through ``message_from`` (:func:`pack`)."""
    if "message_from" in cell:
        return record["cells"][cell["message_from"]]["message"]
    return cell.get("message") or ""


def home_as_tilde(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the user's home folder written ``~`` in every message (an environment's path in an import
    error names the machine, not the release)."""
    return json.loads(json.dumps(record).replace(json.dumps(str(Path.home()))[1:-1], "~"))


def _versions_of(python: str) -> dict[str, str]:
    code = ("import json, torch, transformers, trl; print(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'trl': trl.__version__}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def swift_python() -> str | None:
    """The cached ``trl==0.29.1`` version environment's python (ms-swift declares ``trl<1.0``), or None."""
    from ..versions.cache import cache_root

    hits = sorted((cache_root() / "envs").glob("trl-0.29.1-*/bin/python"))
    return str(hits[-1]) if hits else None


# ------------------------------------------------------------------------------------------------------------
# the block: verdicts, transitions, rendering


def verdict(record: dict[str, Any]) -> str:
    """A release's verdict over its cells: "pass" (every cell), "fail" (any), "skipped" (no cell ran), "error"."""
    statuses = {c["status"] for c in record.get("cells", [])}
    if not statuses or statuses <= {"skipped"}:
        return "skipped"
    for s in ("fail", "error"):
        if s in statuses:
            return s
    return "pass"


def _anchor_file(record: dict[str, Any]) -> str | None:
    anchor = record["path"].get("anchor")
    return anchor.rsplit(":", 1)[0] if anchor else None


def transitions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Releases whose path anchor's file, or verdict, differs from the release before: ``{"from", "to", "what"}``."""
    out = []
    for before, after in itertools.pairwise(records):
        what = []
        if _anchor_file(before) != _anchor_file(after):
            what.append(f"path moved: {before['path'].get('anchor') or 'none'} -> {after['path'].get('anchor') or 'none'}")
        if verdict(before) != verdict(after):
            what.append(f"verdict {verdict(before)} -> {verdict(after)}")
        if what:
            out.append({"from": before["version"], "to": after["version"], "what": "; ".join(what)})
    return out


def _number(cell: dict[str, Any]) -> str:
    m = cell.get("metrics", {})
    for key in ("max_abs_logprob_diff", "max_abs_seq_logprob_diff"):
        if isinstance(m.get(key), (int, float)):
            return f"{m[key]:.1e}"
    return ""


def _short(message: str, n: int = 150) -> str:
    text = " ".join(message.split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 3] + "..."


def _gist(message: str) -> str:
    """The part of a cell's message that says what happened: from "does not import here" on for an import skip, the
    numbers for a verdict (the path's description before them is the check's, the same for every release)."""
    at = message.find("does not import here")
    if at >= 0:
        return message[at:]
    numbers = re.search(r"(?:completion log-probs|sequence log-probs) .*$", message)
    return numbers.group(0) if numbers else message


def _stand_in_short(text: str) -> str:
    """A cell's stand-in sentence, short: "deepspeed stubbed", "flash_attn.bert_padding from flash-attn 2.8.3's source
    (the release's actor imports it)"."""
    if "stubbed" in text:
        return text.split(":")[0]
    if "flash_attn" not in text:  # unsloth's: "self (pad_token_id; ...)", "UNSLOTH_ALLOW_CPU=1 (...)"
        return text.split(" (")[0]
    why = re.findall(r"\(([^()]*(?:release|CPU branch)[^()]*)\)", text)
    version = re.search(r"flash_attn (\S+)'s source", text)
    return (f"flash_attn.bert_padding from flash-attn {version.group(1) if version else ''}'s source"
            + (f" ({why[-1]})" if why else ""))


def render(block: dict[str, Any]) -> str:
    """The markdown of the block: per trainer, one row per release (verdict, worst log-prob difference in nats over
    its cells, the anchor file:line, notes), its transitions and what each skip or failure said."""
    lines = ["<!-- generated by python -m pytest_packcheck.atlas.rl_peers (reports/atlas/rl_peers.json); do not edit -->",
             "", (f"Families {', '.join(block['families'])} x backends {', '.join(block['backends'])}; float32, CPU. "
                  f"Stack: {block['stack']}. Measured {block['measured']}."), ""]
    for dist in [d for d in RELEASES if d in block["trainers"]]:
        records, check = block["trainers"][dist], CHECKS[dist]
        lines += [f"### {dist} (`{check}`)", "", "| release | verdict | max log-prob diff (nats) | path (from the wheel) | notes |",
                  "|---|---|---|---|---|"]
        for r in records:
            cells = r.get("cells", [])
            worst = max((float(_number(c)) for c in cells if _number(c)), default=None)
            notes = r.get("skip") or ""
            if not notes and cells:
                odd = [c for c in cells if c["status"] != "pass"]
                gists = {_gist(message_of(r, c)) for c in odd}
                if odd and len(gists) == 1 and len(odd) == len(cells):
                    notes = f"every cell: {_short(gists.pop(), 300)}"
                else:
                    notes = "; ".join(f"{c['model']}/{c['backend']}: {_short(_gist(message_of(r, c)), 160)}" for c in odd[:2])
                tags = re.findall(r"\[([^\]]+)\]", message_of(r, cells[0]))
                shorts = [] if odd else [_stand_in_short(x) for x in r.get("stand_ins") or []]
                notes = "; ".join(x for x in [notes, *tags[:1], *shorts] if x)
            if dist == "verl" and r["path"].get("engine"):
                notes = (notes + "; " if notes else "") + "engine forward_step: needs ray (" + " -> ".join(r["path"]["engine"]) + ")"
            if dist == "unsloth":  # the zoo it ran with, its own verifier, the stand-ins (what it declares: lookup)
                seen = [c["metrics"]["unsloth_verifier_diff"] for c in cells
                        if isinstance(c.get("metrics", {}).get("unsloth_verifier_diff"), (int, float))]
                notes = notes if not r["path"].get("anchor") else "; ".join(x for x in [
                    f"unsloth_zoo {r['path'].get('zoo')}",
                    "its verifier " + (f"{max(seen):.1e} nats, " if seen else "") + (r["path"].get("verifier") or "not found"),
                    ("stand-ins: " + ", ".join(_stand_in_short(x) for x in r.get("stand_ins") or [])) if r.get("stand_ins") else "",
                    "; ".join(f"{c['model']}/{c['backend']}: {_short(_gist(message_of(r, c)), 160)}"
                              for c in cells if c["status"] != "pass")] if x)
            elif r["path"].get("declared") and r["path"]["declared"] not in notes:
                notes = (notes + "; " if notes else "") + f"declares {r['path']['declared']}"
            anchor = f"`{r['path']['anchor']}`" if r["path"].get("anchor") else "none"
            lines.append(f"| {r['version']} | {verdict(r)} | {'' if worst is None else f'{worst:.1e}'} | {anchor} | {_short(notes, 400)} |")
        moves = transitions(records)
        lines += ["", "Transitions: " + ("; ".join(f"{t['from']} -> {t['to']}: {t['what']}" for t in moves) if moves else "none"), ""]
    return "\n".join(lines).rstrip() + "\n"


def dump(block: dict[str, Any]) -> str:
    """The block's file text: sorted keys, one release record per line (small, and a re-measure diffs by release)."""
    head = {k: v for k, v in block.items() if k != "trainers"}
    lines = ["{", *(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}," for k, v in sorted(head.items())), ' "trainers": {']
    dists = sorted(block["trainers"])
    for i, dist in enumerate(dists):
        lines.append(f"  {json.dumps(dist)}: [")
        records = block["trainers"][dist]
        lines += [f"   {json.dumps(r, sort_keys=True, separators=(',', ':'))}{',' if j < len(records) - 1 else ''}"
                  for j, r in enumerate(records)]
        lines.append(f"  ]{',' if i < len(dists) - 1 else ''}")
    return "\n".join([*lines, " }", "}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_packcheck.atlas.rl_peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default=",".join(RELEASES), help="comma-separated: verl,openrlhf,ms-swift")
    parser.add_argument("--releases", default="", help="comma-separated versions (default: RELEASES)")
    parser.add_argument("--build", default="build/rl-peers", help="the pinned wheels' folder (releases go to <build>/releases)")
    parser.add_argument("--swift-python", default=None, help="the python ms-swift's releases run in (default: the cached trl==0.29.1 env)")
    parser.add_argument("--out", default=str(BLOCK_FILE))
    parser.add_argument("--render-only", action="store_true")
    ns = parser.parse_args(argv)
    out = Path(ns.out)
    block = json.loads(out.read_text()) if out.exists() else None
    if not ns.render_only:
        build = Path(ns.build)
        block = block or {"schema_version": SCHEMA_VERSION, "families": list(FAMILIES), "backends": list(BACKENDS),
                          "trainers": {}}
        stacks: dict[str, dict[str, str]] = {}
        for dist in [d.strip() for d in ns.trainers.split(",") if d.strip()]:
            python = (ns.swift_python or swift_python() or sys.executable) if dist == "ms-swift" else sys.executable
            stacks[python] = stacks.get(python) or _versions_of(python)
            wanted = [v for v in ns.releases.split(",") if v] or list(RELEASES[dist])
            kept = {r["version"]: r for r in block["trainers"].get(dist, []) if r["version"] not in wanted}
            for version in wanted:
                print(f"{dist} {version} ...", flush=True)
                record = run_release(dist, version, build, python)
                record["stack"] = stacks[python]  # the stack it ran on, not the machine's path to it
                if dist == "unsloth" and record["cells"] and record["path"].get("zoo"):
                    record["stack"] = {**stacks[python], "unsloth_zoo": record["path"]["zoo"]}
                kept[version] = record
                print(f"  {verdict(record)} ({record.get('wall_s', 0)} s wall, {record.get('cpu_s', 0)} s CPU)", flush=True)
                block["trainers"][dist] = sorted(kept.values(), key=lambda r: version_key(r["version"]))
                block["measured"] = time.strftime("%Y-%m-%d")
                block["stack"] = "; ".join(sorted({", ".join(f"{k} {v}" for k, v in r["stack"].items() if k != "unsloth_zoo")
                                                   for rs in block["trainers"].values() for r in rs}))
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(dump(block))  # after each release: resumable
    if block is None:
        print(f"{out} does not exist: run without --render-only first", file=sys.stderr)
        return 2
    render_to = out.with_name(RENDER_FILE.name) if out != BLOCK_FILE else RENDER_FILE
    render_to.write_text(render(block))
    print(f"wrote {out} and {render_to}")
    return 0


__all__ = ["CHECKS", "RELEASES", "import_chain", "main", "read_path", "render", "run_release", "transitions",
           "verdict", "wheel_dist"]


if __name__ == "__main__":
    raise SystemExit(main())
