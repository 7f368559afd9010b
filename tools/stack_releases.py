"""Measure the stack elements through the trainers per release (issue 45, part 1) and write
``reports/atlas/stack.json`` / ``stack.md`` (:mod:`pytest_packcheck.atlas.stack_axis`).

Per release of the axis's library, its version environment (``<library>==X`` and the axis's pins at this
environment's versions; made with uv and cached as every version environment is) runs ``stack_trainers`` on a tiny
llama on sdpa with the axis's stack elements:

    nice -n 10 env HF_HUB_OFFLINE=1 python tools/stack_releases.py --axis trl          # every TRL minor since 0.19
    python tools/stack_releases.py --axis accelerate --releases 1.10.1,1.16.0
    python tools/stack_releases.py --axis peft --render-only                           # stack.md from stack.json

Runs are cached under ``--build`` (default ``~/.cache/packcheck/stack-axis``; a finished release is not run again, a
killed one resumes). A release whose environment cannot be made, or whose run fails, is printed with its reason and
left out of the block (never a silent pass).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--axis", required=True, choices=("trl", "accelerate", "peft"))
    parser.add_argument("--releases", default=None, help="comma-separated releases (default: the latest patch of "
                                                         "every minor since the axis's floor, from the package index)")
    parser.add_argument("--build", default=str(Path.home() / ".cache" / "packcheck" / "stack-axis"))
    parser.add_argument("--atlas-dir", default=str(REPO / "reports" / "atlas"))
    parser.add_argument("--no-write", action="store_true", help="print the block, write nothing")
    parser.add_argument("--render-only", action="store_true", help="write stack.md from stack.json, measure nothing")
    parser.add_argument("--cached-only", action="store_true",
                        help="reduce the releases already measured under --build, run none; the others are listed as missing")
    ns = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from pytest_packcheck.atlas import stack_axis as A
    from pytest_packcheck.atlas.plan import index_latest_patches

    atlas = Path(ns.atlas_dir)
    if ns.render_only:
        doc = json.loads((atlas / A.STACK_FILE).read_text())
        (atlas / "stack.md").write_text(A.markdown(doc))
        return 0
    axis = A.AXES[ns.axis]
    releases = (ns.releases.split(",") if ns.releases else
                index_latest_patches(axis.library, "tools/stack_releases.py", "X,Y", axis.since, None))
    reduced, records, missing = {}, {}, []
    for version in releases:
        if ns.cached_only and not (Path(ns.build) / axis.library / version / "atlas-done.json").exists():
            missing.append(version)
            continue
        record = A.run_release(axis, version, Path(ns.build), print)
        if "error" in record:
            print(f"{version}: left out: {record['error']}", file=sys.stderr)
            missing.append(version)
            continue
        folder = Path(ns.build) / axis.library / version
        from pytest_packcheck.results.schema import read_results
        doc = read_results(folder / "packcheck-matrix.json")
        A.check_stack_version(axis, version, doc, str(folder))
        cells_s = round(sum(float(c.get("duration_s") or 0.0) for c in doc.get("cells", [])), 1)
        rows, lines = A.reduce_release(doc)
        if axis.needles:  # the library's own deciding line, read from the release's installed file
            from pytest_packcheck.versions.envs import _site_packages, ensure_env

            lines.update(A.source_lines(axis, _site_packages(ensure_env(A.combo_of(axis, version)).path)))
        reduced[version], records[version] = (rows, lines), {**record, "cells_s": cells_s}
    block = A.stack_block(axis, reduced, records, missing)
    for line in A.transitions(block):
        print("transition:", line)
    if ns.no_write:
        print(json.dumps(block, indent=1, sort_keys=True))
    else:
        A.write(atlas, ns.axis, block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
