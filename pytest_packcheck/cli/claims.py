"""``packcheck claims``: what axolotl / ms-swift / LLaMA-Factory claim about packing (read from their wheels, not
imported), judged against the atlas: ``reports/atlas/claims.md``."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(claims: argparse.ArgumentParser) -> None:
    claims.add_argument("wheels", nargs="+", metavar="WHEEL", help="Peer wheels (pip download --no-deps axolotl ms-swift llamafactory).")
    claims.add_argument("--support-file", default=None, help="support.json to judge against (default: the committed atlas).")
    claims.add_argument("-o", "--output", default="reports/atlas/claims.md", help="Markdown to write (default reports/atlas/claims.md).")


def run(ns: argparse.Namespace) -> int:
    """``packcheck claims``: read each peer wheel, judge its claims against the atlas, write the Markdown."""
    from ..atlas.claims import read_wheel, render_claims
    from ..results import atomic_write
    from ..support import load_support

    peers = [read_wheel(w) for w in ns.wheels]
    out = Path(ns.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, render_claims(peers, load_support(ns.support_file)))
    print(f"claims written: {out} ({', '.join(f'{p.peer} {p.version}: {len(p.claims)} claims' for p in peers)})")
    return 0
