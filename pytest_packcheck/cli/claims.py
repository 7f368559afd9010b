"""``packcheck claims``: what axolotl / ms-swift / LLaMA-Factory / verl / unsloth claim about packing (read from
their released wheels or sdists, not imported), judged against the atlas: ``reports/atlas/claims.md``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(claims: argparse.ArgumentParser) -> None:
    claims.add_argument("wheels", nargs="*", metavar="PACKAGE", help="Peer wheels or sdists (pip download --no-deps axolotl "
                        "ms-swift llamafactory verl unsloth).")
    claims.add_argument("--download", default=None, metavar="PEERS", help="Download the newest release of these peers "
                        "first (comma-separated, e.g. axolotl,ms-swift,llamafactory,verl,unsloth; pip download --no-deps "
                        "into --download-dir).")
    claims.add_argument("--download-dir", default="build/peers", help="Where --download puts the packages (default build/peers).")
    claims.add_argument("--support-file", default=None, help="support.json to judge against (default: the committed atlas).")
    claims.add_argument("--run-own-paths", action="store_true", help="Also run each peer's own packing code (imported from "
                        "its wheel) on tiny models on CPU against each example alone, and write the results as "
                        "peer_paths.json beside the output (a few seconds per peer).")
    claims.add_argument("--own-paths", default=None, metavar="JSON", help="Own-path results to show (default: peer_paths.json "
                        "beside the output, where it exists).")
    claims.add_argument("-o", "--output", default="reports/atlas/claims.md", help="Markdown to write (default reports/atlas/claims.md).")


def download(peers: list[str], dest: Path) -> list[Path]:
    """The newest released package of each peer, ``pip download --no-deps`` into ``dest`` (a wheel, else the sdist).

    Raises:
        PackcheckUsageError: pip cannot fetch one (its last line named, with the peer).
    """
    import subprocess
    import sys

    from ..errors import PackcheckUsageError

    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for peer in peers:
        before = set(dest.iterdir())
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), peer],
                              capture_output=True, text=True, check=False)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        if proc.returncode != 0:
            raise PackcheckUsageError(f"Peer '{peer}' (from --download) could not be downloaded: "
                                      f"{lines[-1] if lines else f'pip exit {proc.returncode}'}; check the name or pass the package file.")
        new = sorted(set(dest.iterdir()) - before)
        saved = next((line.split("Saved ", 1)[1].strip() for line in lines if "Saved " in line), None)
        found = new[0] if new else Path(saved) if saved else _existing(dest, peer)
        if found is None:
            raise PackcheckUsageError(f"Peer '{peer}' (from --download): pip reported no package file in {dest}; pass the file instead.")
        paths.append(found)
    return paths


def _own_paths(ns: argparse.Namespace, files: list[Path], out: Path) -> dict | None:
    """The own-path results claims.md shows: measured now (``--run-own-paths``: each wheel's paths, written to
    peer_paths.json beside ``out``), else read from ``--own-paths`` or that file where it exists; None otherwise.

    Raises:
        PackcheckUsageError: an --own-paths file that is not a peer-paths document."""

    from ..atlas.peer_paths import build_bench, dumps_document, expand_document, measure, results_document
    from ..errors import PackcheckUsageError, read_document
    from ..results import atomic_write

    beside = out.parent / "peer_paths.json"
    if ns.run_own_paths:
        results = [r for w in files if w.name.endswith(".whl") for r in measure(w, build_bench)]
        doc = results_document(results)
        atomic_write(beside, dumps_document(doc))
        print(f"own paths written: {beside} ({sum(r.verdict == 'fail' for r in results)} fail of {len(results)} cells)")
        return doc
    path = Path(ns.own_paths) if ns.own_paths else beside if beside.is_file() else None
    if path is None:
        return None
    fix = "pass the peer_paths.json `packcheck claims --run-own-paths` writes."
    doc = read_document(path, "json", "--own-paths", fix)
    if not isinstance(doc, dict) or doc.get("schema") != "packcheck-peer-paths":
        raise PackcheckUsageError(f"--own-paths '{path}' is not a peer-paths document (schema packcheck-peer-paths): "
                                  "pass the peer_paths.json `packcheck claims --run-own-paths` writes.")
    return expand_document(doc)


def dependency_only(package: Path) -> bool:
    """A wheel a peer's own path imports beside the peer's (:attr:`..atlas.peer_paths.PeerPath.beside`: unsloth_zoo,
    json_repair, einops) and that is no peer itself: ``build/peers/*.whl`` holds unsloth_zoo beside unsloth."""
    from ..atlas.claims import READERS
    from ..atlas.peer_paths import PEER_PATHS

    name = package.name.split("-")[0].lower().replace("-", "_")
    beside = {d.lower().replace("-", "_") for p in PEER_PATHS for d in p.beside}
    return name in beside and name not in {r.replace("-", "_") for r in READERS} and name not in {p.peer for p in PEER_PATHS}


def _existing(dest: Path, peer: str) -> Path | None:
    """A package of ``peer`` pip found already in ``dest`` (pip says "File was already downloaded")."""
    stem = peer.replace("-", "_").lower()
    hits = sorted(p for p in dest.iterdir() if p.name.replace("-", "_").lower().startswith(stem + "_"))
    return hits[-1] if hits else None


def run(ns: argparse.Namespace) -> int:
    """``packcheck claims``: check the support file, download what ``--download`` names, read each peer package,
    judge its claims against the atlas, write the Markdown.

    Raises:
        PackcheckUsageError: no package given, an unusable support file (checked before anything is downloaded),
            a package that cannot be downloaded or read, an -o/--output that cannot be written (checked first too).
    """
    from ..atlas.claims import read_wheel, render_claims
    from ..errors import PackcheckUsageError
    from ..results import atomic_write
    from ..results.io import write_failure
    from ..support import load_support

    if not ns.wheels and not ns.download:
        raise PackcheckUsageError("packcheck claims needs peer packages: pass wheel / sdist files or --download "
                                  "axolotl,ms-swift,llamafactory,verl,unsloth.")
    support = load_support(ns.support_file)  # before any download: a bad support file costs nothing
    out = Path(ns.output)
    if out.is_dir():
        raise PackcheckUsageError(f"-o/--output '{out}' is a folder: pass the Markdown file to write, e.g. {out / 'claims.md'}.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackcheckUsageError(write_failure(out, exc, "-o/--output (a Markdown file)")) from None
    given = [Path(w) for w in ns.wheels]
    files = list({w.resolve(): w for w in given}.values())  # the same package twice is read once (trial of issue 42)
    if len(files) < len(given):
        print(f"packcheck claims: note: {len(given) - len(files)} package(s) given twice; each is read once", file=sys.stderr)
    if ns.download:
        files += download([p.strip() for p in ns.download.split(",") if p.strip()], Path(ns.download_dir))
    deps = [w for w in files if dependency_only(w)]
    if deps:
        print(f"packcheck claims: note: {', '.join(w.name for w in deps)}: imported by a peer's own path, not a peer; "
              "not read", file=sys.stderr)
    peers = [read_wheel(w) for w in files if w not in deps]
    own = _own_paths(ns, files, out)
    atomic_write(out, render_claims(peers, support, own))
    print(f"claims written: {out} ({', '.join(f'{p.peer} {p.version}: ' + (f'{len(p.claims)} claims' if not p.reason else p.reason) for p in peers)})")
    return 0
