"""Measure the atlas's missing releases one at a time, in :func:`pytest_packcheck.atlas.gap_order`, and commit each
release's reduced outputs (``reports/atlas/``) as it completes. Resumable: run it again and it goes on where it
stopped (a release killed half-way resumes from its journal under ``build/atlas/<release>/``).

    nohup nice -n 19 env PYTHONPATH=$PWD PACKCHECK_CACHE_DIR=$PWD/build/cache HF_HUB_OFFLINE=1 \\
        .venv/bin/python tools/atlas_generate.py >> build/atlas-generate.log 2>&1 &

Options: ``--releases A,B`` (measure these, in this order, instead of the gap order), ``--remeasure`` (measure the
named releases even where the committed atlas holds them: results of an older packcheck), ``--no-commit`` (only
render), ``--max N`` (stop after N releases). One pytest worker per release (``-n 1``). After each render,
``reports/atlas/claims.md`` is judged again from the peers' packages under ``build/peers/`` (what
``packcheck claims --download`` fetched), when there are any. Each commit touches only
``reports/atlas/``: "atlas: 5.0.0 measured (161 architectures, 335 s wall, 598 s CPU)".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_packcheck import atlas as A

BUILD = REPO / "build" / "atlas"
OUT = REPO / "reports" / "atlas"
PEERS = REPO / "build" / "peers"  # the peers' packages `packcheck claims --download` fetched, if any


def packcheck(*args: str) -> int:
    return subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "atlas", *args], cwd=REPO, check=False).returncode


def commit(message: str) -> None:
    """Commit reports/atlas/ only (other staged or unstaged work is left alone); retried while git's index is locked."""
    for _ in range(30):
        subprocess.run(["git", "add", "reports/atlas"], cwd=REPO, check=False)
        proc = subprocess.run(["git", "commit", "-q", "-m", message, "--", "reports/atlas"], cwd=REPO, check=False,
                              capture_output=True, text=True)
        if proc.returncode == 0 or "nothing to commit" in proc.stdout + proc.stderr:
            print(f"committed: {message}" if proc.returncode == 0 else "nothing to commit", flush=True)
            return
        print(f"git commit failed ({proc.stderr.strip()[:200]}); retrying", flush=True)
        time.sleep(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", default=None)
    parser.add_argument("--remeasure", action="store_true")
    parser.add_argument("--no-commit", action="store_true")
    parser.add_argument("--max", type=int, default=None)
    ns = parser.parse_args()
    planned = A.index_releases()
    committed = A.load_committed(OUT)
    measured = A.committed_releases(committed)
    todo = ns.releases.split(",") if ns.releases else A.gap_order(planned, measured)
    if ns.remeasure and not ns.releases:
        parser.error("--remeasure needs --releases: name the committed releases to measure again")
    todo = [r for r in todo if ns.remeasure or r not in measured][: ns.max]
    print(f"{time.strftime('%H:%M:%S')} atlas generate: {len(measured)} measured, order {', '.join(todo)}", flush=True)
    for version in todo:
        print(f"{time.strftime('%H:%M:%S')} atlas generate: {version}", flush=True)
        rc = packcheck("--releases", version, "--build-dir", str(BUILD), "-o", str(OUT), "-n", "1", "--no-render",
                       *(["--remeasure"] if ns.remeasure else []))
        done = BUILD / version / A.DONE_MARKER
        if rc != 0 or not done.exists():
            print(f"{time.strftime('%H:%M:%S')} atlas generate: {version} not measured (exit {rc}); next", flush=True)
            continue
        packcheck("--render-only", "--releases", ",".join(planned), "--build-dir", str(BUILD), "-o", str(OUT))
        peers = sorted(str(p) for p in PEERS.glob("*") if p.suffix == ".whl" or p.name.endswith(".tar.gz"))
        if peers:  # claims.md judged against the atlas just rendered, not the one of its last refresh
            subprocess.run([sys.executable, "-m", "pytest_packcheck.cli", "claims", *peers, "-o", str(OUT / "claims.md")],
                           cwd=REPO, check=False)
        record = json.loads(done.read_text())
        support = json.loads((OUT / "support.json").read_text())
        archs = next(r["architectures"] for r in support["releases"] if r["transformers"] == version)
        message = (f"atlas: {version} {'re-measured' if ns.remeasure else 'measured'} ({archs} architectures, {record['wall_s']:.0f} s wall, "
                   f"{record['child_cpu_s']:.0f} s CPU; {len(support['releases'])} of {len(planned)} releases, "
                   f"{len(support['transitions'])} transitions)")
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)
        if not ns.no_commit:
            commit(message)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
