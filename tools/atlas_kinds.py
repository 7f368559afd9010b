"""Measure the atlas's encoder and multimodal blocks (issue 46) release by release, then place their transitions on
the exact patch and write the blocks into ``reports/atlas/support.json`` and re-render atlas.md / atlas.html.

Per release (the committed atlas's releases; ``--releases`` names others), the release's version environment runs
the block's audit suite (``audit/encoders.toml``, ``audit/multimodal.toml``: :mod:`pytest_packcheck.atlas.kinds`),
resumable under ``build/atlas-kinds/<block>/<release>/``. 5.25.0 and 5.24.0 first (the known BERT-family
transition), then the releases in :func:`pytest_packcheck.atlas.plan.gap_order`.

    setsid nice -n 10 env HF_HUB_OFFLINE=1 python tools/atlas_kinds.py >> build/atlas-kinds/run.log 2>&1 &

A release measured before the suite gained a model runs that model alone (``<release>/extra/``) and keeps the rest.
Options: ``--kinds encoders,multimodal``, ``--releases A,B``, ``--models SPEC,SPEC`` (measure only these of the
suite: e.g. the committed suite's while a newer model is still being added), ``--no-measure`` (collect and render only),
``--bisect`` (sweep the transitions' gaps: every release on the index between two measured ones), ``--rows`` (measure
the block's named rows, :attr:`~pytest_packcheck.atlas.kinds.Kind.rows`, on each release that lacks them, alone, the
release's other entries kept: :func:`~pytest_packcheck.atlas.kinds.add_rows`), ``--side`` (measure the block's side
checks, :attr:`~pytest_packcheck.atlas.kinds.Kind.side`, for the suite's models on each release, the verdicts kept:
:func:`~pytest_packcheck.atlas.kinds.add_side`), ``--no-render``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "reports" / "atlas"
BUILD = REPO / "build" / "atlas-kinds"


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def save_bisects(path: Path, done: dict) -> None:
    """Write the sweep's placements so far to ``path`` (its folder made: a fresh checkout with ``--no-measure`` has
    no build folder yet)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(done, sort_keys=True) + "\n")


def main() -> int:
    from pytest_packcheck.atlas.collect import load_committed
    from pytest_packcheck.atlas.kinds import (
        KINDS,
        add_rows,
        add_side,
        block_bisects,
        collect_kind,
        measure_between,
        packed,
        run_kind_release,
    )
    from pytest_packcheck.atlas.kinds_render import unpack
    from pytest_packcheck.atlas.plan import gap_order, parse_release_list
    from pytest_packcheck.atlas.render import write_outputs
    from pytest_packcheck.atlas.sweep import sweep_transitions
    from pytest_packcheck.model.specs import split_top

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--releases", default=None)
    parser.add_argument("--models", default=None)
    parser.add_argument("--no-measure", action="store_true")
    parser.add_argument("--bisect", action="store_true")
    parser.add_argument("--rows", action="store_true")
    parser.add_argument("--side", action="store_true")
    parser.add_argument("--no-render", action="store_true")
    ns = parser.parse_args()
    kinds = [KINDS[k] for k in ns.kinds.split(",")]
    committed = load_committed(OUT)
    planned = [r["transformers"] for r in committed["releases"]]
    todo = parse_release_list(ns.releases, "--releases") if ns.releases else \
        [v for v in ("5.25.0", "5.24.0") if v in planned] + gap_order(planned, [v for v in ("5.25.0", "5.24.0") if v in planned])
    if not ns.no_measure:
        for version in todo:
            for kind in kinds:
                models = [m for m in split_top(ns.models) if m in kind.models] if ns.models else None
                if ns.models and not models:
                    continue
                record = run_kind_release(kind, version, BUILD / kind.name, models, log=log)
                log(f"{kind.name} {version}: " + (f"not measured ({str(record['error'])[:200]})" if record.get("error")
                                                  else f"{record.get('cells')} cells, {record.get('wall_s')} s wall, "
                                                       f"{record.get('child_cpu_s')} s CPU"))
    for kind in kinds:
        support = load_committed(OUT)  # read again: a concurrent render of the transformers axis is kept
        previous = support.get(kind.name)
        if ns.rows and previous and kind.rows:
            previous = add_rows(kind, unpack(previous), BUILD / kind.name, log=log)
        if ns.side and previous and kind.side:
            previous = add_side(kind, unpack(previous), BUILD / kind.name, log=log)
        saved = BUILD / kind.name / "bisects.json"  # the sweep's placements so far (a killed sweep keeps its gaps)
        bisects = {**block_bisects(previous), **(json.loads(saved.read_text()) if saved.exists() else {})}
        block = collect_kind(kind, BUILD / kind.name, planned, previous, bisects)
        if ns.bisect:
            bisects = sweep_transitions(block, BUILD / kind.name, done=bisects, log=log, measure=partial(measure_between, kind),
                                        save=partial(save_bisects, saved))
            block = collect_kind(kind, BUILD / kind.name, planned, previous, bisects)
        support = load_committed(OUT)
        support[kind.name] = packed(block)  # runs of equal entries per row (SCHEMA.md)
        log(f"{kind.name}: {len(block['releases'])} releases, {len(block['missing'])} missing, "
            f"{len(block['transitions'])} transitions ({sum(1 for t in block['transitions'] if t.get('bisected'))} placed)")
        if not ns.no_render:
            write_outputs(support, OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
