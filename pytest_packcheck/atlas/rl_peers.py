"""The RL trainers' own packing code per release: verl, OpenRLHF, ms-swift (issue 44, part 2).

For each minor of each trainer since its packed path exists (:data:`RELEASES`, the latest patch of each), the
release's wheel (``pip download --no-deps``, saved under ``build/rl-peers/releases``) is unpacked and imported from
the files (:mod:`..checks.rl_wheels`) in a child process of its own, with the few pure-Python packages its modules
import (:data:`..checks.rl_wheels.NEEDS`, from ``build/rl-peers``), and the trainer's check
(:data:`CHECKS`: ``rl_verl_rmpad``, ``rl_openrlhf_packed``, ``rl_swift_padding_free``) runs on :data:`FAMILIES` x
:data:`BACKENDS` against each sample alone. The library is the axis; the stack is this environment's (torch,
transformers), but for ms-swift, whose every release declares ``trl<1.0``: its releases run in the cached ``trl==0.29.1``
version environment (``--swift-python``) where one exists.

Each release also records what its wheel does, read from its files (:func:`read_path`): the file and line of the
path's anchor (verl: the label roll of the remove-padding forward, ``torch.roll(input_ids_rmpad``; OpenRLHF: where
``Actor.forward`` packs; ms-swift: ``get_cu_seqlens`` in its padding-free DPO ``concatenated_forward``), and for verl
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
}
#: The check each trainer's releases run (checks/registry.py, the rl suite).
CHECKS = {"verl": "rl_verl_rmpad", "openrlhf": "rl_openrlhf_packed", "ms-swift": "rl_swift_padding_free"}
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
    out["declared"] = declared(folder)
    return out


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
    from ..checks import rl_trainers
    from ..checks.rl_wheels import wheels_on_path
    from .peer_paths import build_bench

    check = getattr(rl_trainers, f"check_{CHECKS[spec['dist']]}")
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
    extras = {d: pinned[d] for d in NEEDS[dist][1:]}
    found, missing = find_wheels(build, extras)
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} wheel in {build}: pip download --no-deps -r "
                                "constraints/rl-peers.txt -d build/rl-peers")
    folders = [folder, *(unpack_wheel(found[d]) for d in extras)]
    folders += [unpack_wheel(_wheel(releases, d, v)) for d, v in RELEASE_EXTRAS.get(dist, {}).items()]
    record: dict[str, Any] = {"version": version, "path": read_path(dist, folder)}
    if record["path"]["anchor"] is None:
        record["cells"] = []
        record["skip"] = (f"{dist} {version} has no such path: no line of {', '.join(ANCHORS[dist][0])} matches "
                          f"{ANCHORS[dist][1]!r} (read from its wheel)")
        return record
    spec = {"dist": dist, "folders": [str(f) for f in folders], "families": list(families), "backends": list(backends)}
    code = ("import json, sys; from pytest_packcheck.atlas.rl_peers import _child; "
            "print('RLPEERS' + json.dumps(_child(json.loads(sys.argv[1]))))")
    started = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([python, "-c", code, json.dumps(spec)], check=False, capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=900)
    record["wall_s"] = round(time.monotonic() - started, 1)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RLPEERS")), None)
    if line is None:
        tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
        record["cells"], record["skip"] = [], f"the child exited {proc.returncode} before any cell: {tail}"
    else:
        record["cells"] = json.loads(line[len("RLPEERS"):])
    return pack(home_as_tilde(record))


#: The metrics a cell keeps in the block (the check's numbers and the release's semantics it was compared under).
KEPT_METRICS = ("max_abs_logprob_diff", "max_abs_seq_logprob_diff", "max_abs_entropy_diff", "max_abs_margin_diff",
                "initial_loss", "non_finite_logprobs", "entropy_compared", "logprob_temperature", "entropy_temperature",
                "missing_module", "raised_at")


def pack(record: dict[str, Any]) -> dict[str, Any]:
    """A release's record as the block keeps it (small: reports/ has a size cap): the stand-ins once per release
    (``stand_ins``, taken out of each cell's message and metrics), :data:`KEPT_METRICS` only, and a message equal to
    the release's first cell's stored once (``message_from: 0``). :func:`render` reads it as it is."""
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
        if first is not None and message == first:
            cell.pop("message", None)
            cell["message_from"] = 0
        else:
            cell["message"] = message
        first = first if first is not None else message
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
            if r["path"].get("declared") and r["path"]["declared"] not in notes:
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
                kept[version] = record
                print(f"  {verdict(record)} ({record.get('wall_s', 0)} s)", flush=True)
                block["trainers"][dist] = sorted(kept.values(), key=lambda r: version_key(r["version"]))
                block["measured"] = time.strftime("%Y-%m-%d")
                block["stack"] = "; ".join(sorted({", ".join(f"{k} {v}" for k, v in r["stack"].items())
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
