"""Re-measure the atlas entries the config-fix table changes (issue 41 part 2), release by release, and merge each
release's new entries into ``reports/atlas/support.json`` as it completes (the other entries stay as measured).

Per release: the architectures whose committed entry is ``error`` / ``library_config`` and that either have a fix in
:data:`pytest_packcheck.model.config_fixes.CONFIG_FIXES` or failed because their forward takes no ``position_ids``
(now cause ``no_position_ids``); they run as the atlas runs a release (:func:`pytest_packcheck.atlas.release_run.
run_release`: the atlas backends and checks, resumable from its journal under ``build/atlas-fix/runs/<release>/``).
Their entries replace the committed ones; the transitions are derived again (the committed bisect records kept
where their transition still exists). ``--render`` re-renders atlas.md / atlas.html from the merged support.json.

    setsid nice -n 10 env HF_HUB_OFFLINE=1 python tools/atlas_refix.py --releases 4.57.6,5.25.0 >> build/atlas-fix/run.log 2>&1 &

A change of the shrink re-measures named architectures only (issue 47: nemotron_h's mixer, 23 releases, 7-8 s CPU each):

    python tools/atlas_refix.py --releases 5.3.0,5.4.0 --arch nemotron_h --only-arch --build build/atlas47/runs --why "issue 47: ..."
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "reports" / "atlas"
BUILD = REPO / "build" / "atlas-fix" / "runs"


def affected(support: dict, version: str, match: tuple[str, ...] = ()) -> list[str]:
    """The architectures of ``version`` whose entry is ``library_config`` and that the fix table or the
    ``no_position_ids`` cause answers now, or whose message contains one of ``match`` (``--match``: a cause answered
    elsewhere, e.g. the environment's)."""
    from pytest_packcheck.model.config_fixes import CONFIG_FIXES

    out = set()
    for arch, row in support["cells"].items():
        for entry in (b.get(version) for b in row.values()):
            message = (entry or {}).get("message") or ""
            if entry and "library_config" in entry.get("causes", []) and (
                    arch in CONFIG_FIXES or "'position_ids'" in message or any(m in message for m in match)):
                out.add(arch)
    return sorted(out)


def merge(support: dict, version: str, entries: dict) -> int:
    """Replace ``version``'s entries of the architectures in ``entries`` (``{arch: {backend: entry}}``); returns how
    many entries were replaced."""
    n = 0
    for arch, by_backend in entries.items():
        row = support["cells"].setdefault(arch, {})
        for backend in list(row):  # a backend the new run did not give (skipped) loses the old entry
            if version in row[backend] and backend not in by_backend:
                del row[backend][version]
        for backend, entry in by_backend.items():
            row.setdefault(backend, {})[version] = entry
            n += 1
    return n


def main() -> int:
    from pytest_packcheck.atlas.collect import load_committed, reduce_release, transitions
    from pytest_packcheck.atlas.command import seeded_bisects
    from pytest_packcheck.atlas.release_run import run_release
    from pytest_packcheck.atlas.render import write_outputs
    from pytest_packcheck.results import atomic_write, load_document

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", required=True)
    parser.add_argument("--render", action="store_true", help="re-render atlas.md / atlas.html after each merge")
    parser.add_argument("--build", default=str(BUILD), help="the runs' folder (a later pass after the table grew: another)")
    parser.add_argument("--why", default="config-fix table (issue 41)", help="the reason the release record states")
    parser.add_argument("--match", action="append", default=[],
                        help="also re-measure library_config entries whose message contains this text (repeatable)")
    parser.add_argument("--arch", action="append", default=[],
                        help="re-measure this architecture's entries of each release whatever their cause (repeatable)")
    parser.add_argument("--only-arch", action="store_true",
                        help="re-measure the --arch architectures only, not the ones the config-fix table answers (a "
                             "change of the shrink: issue 47's nemotron_h)")
    ns = parser.parse_args()
    build = Path(ns.build)
    for version in ns.releases.split(","):
        support = load_committed(OUT)
        archs = sorted({*(() if ns.only_arch else affected(support, version, tuple(ns.match))),
                        *(a for a in ns.arch if any(version in b for b in support["cells"].get(a, {}).values()))})
        if not archs:
            print(f"{time.strftime('%H:%M:%S')} {version}: nothing to re-measure", flush=True)
            continue
        print(f"{time.strftime('%H:%M:%S')} {version}: {len(archs)} architectures: {', '.join(archs)}", flush=True)
        record = run_release(version, build, models=[f"arch:{a}" for a in archs])
        if record.get("error"):
            print(f"{time.strftime('%H:%M:%S')} {version}: not measured ({str(record['error'])[:300]})", flush=True)
            continue
        doc = load_document(build / version / "packcheck-matrix.json")
        entries = {a: e for a, e in reduce_release(doc).items() if a in archs}
        support = load_committed(OUT)  # read again: merged releases of a concurrent run are kept
        n = merge(support, version, entries)
        release = next(r for r in support["releases"] if r["transformers"] == version)
        if record.get("overrides"):  # the environment was made with audit/env_overrides.toml: the release says so
            release["overrides"] = record["overrides"]
        release.setdefault("remeasured", []).append({"architectures": sorted(entries), "why": ns.why,
                                                     "wall_s": record.get("wall_s"), "cpu_s": record.get("child_cpu_s"),
                                                     "measured": (record.get("finished") or "")[:10]})
        support["transitions"] = transitions(support, seeded_bisects(support))
        if ns.render:
            write_outputs(support, OUT)
        else:
            atomic_write(OUT / "support.json", json.dumps(support, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
        load_committed(OUT)  # validated as lookup reads it
        print(f"{time.strftime('%H:%M:%S')} {version}: {n} entries merged ({record.get('wall_s')} s wall)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
