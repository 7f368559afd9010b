"""The floor of one atlas release: the same tiny models and the same probes, without the harness.

Runs in a release's version environment (its overlay links this packcheck), e.g.

    build/cache/envs/transformers-4.57.6-*/bin/python benchmarks/atlas_floor.py --out build/atlas-floor-4.57.6.json
    python benchmarks/atlas_floor.py --compare build/atlas/4.57.6 build/atlas-floor-4.57.6.json

Floor: every architecture of the installed transformers (as --packcheck-all-architectures lists them), each
(architecture, backend) model built once, every atlas check called in one process through the runner's
CellRunner (the function the plugin calls per cell): no pytest collection, no forked child per model, no journal,
no report. The harness's overhead for that release is its run's wall (``atlas-done.json``) / this wall.
``--compare`` also gives the cost per (architecture, backend) of both and the slowest architectures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def floor(out: Path, limit: int | None, only: list[str] | None = None) -> None:
    import transformers

    from pytest_packcheck.atlas import ATLAS_BACKENDS, atlas_checks
    from pytest_packcheck.config.tolerances import load_tolerances
    from pytest_packcheck.model.architectures import causal_lm_architectures, mrope_text_path_architectures
    from pytest_packcheck.model.resolve import resolve_model
    from pytest_packcheck.model.specs import parse_model_spec
    from pytest_packcheck.run.runner import CellRunner, plan_cells

    archs = only or [*causal_lm_architectures(), *mrope_text_path_architectures()][:limit]
    t0, c0 = time.perf_counter(), time.process_time()
    models = [resolve_model(parse_model_spec(f"arch:{a}", "atlas_floor"), "atlas_floor") for a in archs]
    tolerances, _ = load_tolerances(None, None, "default")
    runner = CellRunner(models, tolerances)
    per: dict[str, float] = {}
    cells = plan_cells(models, ATLAS_BACKENDS, atlas_checks(), ("float32",))
    for cell in cells:
        t = time.perf_counter()
        runner.run(cell)
        key = f"{cell.label}|{cell.backend}"
        per[key] = per.get(key, 0.0) + time.perf_counter() - t
    record = {"transformers": transformers.__version__, "architectures": len(archs), "cells": len(cells),
              "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
              "per_arch_backend_s": {k: round(v, 3) for k, v in per.items()}}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"floor {record['transformers']}: {record['architectures']} architectures, {record['cells']} cells, "
          f"{record['wall_s']} s wall, {record['cpu_s']} s CPU")


def compare(release_dir: Path, floor_file: Path) -> None:
    done = json.loads((release_dir / "atlas-done.json").read_text())
    fl = json.loads(floor_file.read_text())
    from pytest_packcheck.results.schema import read_results
    doc = read_results(release_dir / "packcheck-matrix.json")
    harness: dict[str, float] = {}
    print(f"CPU: harness {done.get('child_cpu_s')} s / floor {fl['cpu_s']} s = {done.get('child_cpu_s', 0) / fl['cpu_s']:.2f}")
    for c in doc["cells"]:
        if c.get("backend"):
            key = f"{c['model']['label']}|{c['backend']}"
            harness[key] = harness.get(key, 0.0) + float(c.get("duration_s") or 0.0)
    pairs = len(fl["per_arch_backend_s"])
    print(f"transformers {fl['transformers']}: harness {done['wall_s']} s wall ({done.get('child_cpu_s')} s CPU), "
          f"floor {fl['wall_s']} s wall ({fl['cpu_s']} s CPU): wall / floor = {done['wall_s'] / fl['wall_s']:.2f}")
    print(f"per (architecture, backend): harness {done['wall_s'] / max(pairs, 1):.2f} s, floor {fl['wall_s'] / max(pairs, 1):.2f} s; "
          f"sum of the cells' own durations {sum(harness.values()):.1f} s (the rest is collection, forks, journal, report)")
    top = sorted(fl["per_arch_backend_s"].items(), key=lambda kv: -kv[1])[:8]
    print("slowest (floor): " + ", ".join(f"{k} {v:.1f} s" for k, v in top))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/atlas-floor.json"))
    parser.add_argument("--limit", type=int, default=None, help="Only the first N architectures (a quick look).")
    parser.add_argument("--models", default=None, help="Only these model types (comma-separated), e.g. the ones of a "
                        "`packcheck atlas --models` run to compare with.")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("RELEASE_DIR", "FLOOR_JSON"))
    ns = parser.parse_args()
    if ns.compare:
        compare(*ns.compare)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    floor(ns.out, ns.limit, [m.strip() for m in ns.models.split(",") if m.strip()] if ns.models else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
