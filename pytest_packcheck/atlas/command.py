"""``packcheck atlas``: seed, generate what is missing, optionally bisect, then render; ``packcheck atlas --trl``
(:func:`main_trl`): the TRL axis, measured and rendered into the same atlas."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError
from .collect import collect, committed_releases, load_committed
from .release_run import generate, seed_release
from .render import write_outputs


@dataclass(frozen=True)
class AtlasArgs:
    releases: list[str]
    build: Path
    out: Path
    shard: tuple[int, int] | None
    workers: int
    render_only: bool
    bisect: bool
    bisect_limit: int | None
    models: list[str] | None = None
    bisect_models: list[str] | None = None
    seed: list[str] | None = None
    no_render: bool = False
    remeasure: bool = False


def seeded_bisects(committed: dict[str, Any] | None) -> dict[str, Any]:
    """The bisect records (``bisects.json``'s ``model|backend|last_before|first_after`` -> record) a committed
    support.json holds in its transitions, for a render from a folder without bisects.json: the 745 placements were
    dropped there, and the render exited 0 (issue 42)."""
    out: dict[str, Any] = {}
    for t in (committed or {}).get("transitions") or []:
        record = t.get("bisected") if isinstance(t, dict) else None
        if isinstance(record, dict):
            out["|".join(str(t.get(k)) for k in ("model_type", "backend", "last_before", "first_after"))] = record
    return out


def main(args: AtlasArgs, log: Callable[[str], None] = print) -> int:
    """``packcheck atlas``: generate what is missing (unless ``render_only``), optionally bisect, then render.
    Exit 1 when a release could not be measured this time (its error is in ``<build>/<release>/atlas-error.json``;
    run again to resume), 0 otherwise."""
    for path in args.seed or []:
        record = seed_release(Path(path), args.build)
        log(f"atlas {record['transformers']}: {record['source']}")
    committed = load_committed(args.out, log, render_only=args.render_only)
    failed = []
    if not args.render_only:
        kept = [] if args.remeasure else [r for r in args.releases if r in committed_releases(committed)]
        if kept:
            log(f"atlas: {', '.join(kept)} already in {args.out / 'support.json'}: kept, not measured again "
                "(--remeasure measures them)")
        todo = [r for r in args.releases if r not in kept]
        failed = [r for r in generate(todo, args.build, args.shard, args.workers, log, models=args.models) if "error" in r]
    if args.no_render:
        return 1 if failed else 0
    bisects_file = args.out / "bisects.json"
    bisects = json.loads(bisects_file.read_text()) if bisects_file.exists() else seeded_bisects(committed)
    support = collect(args.build, args.releases, bisects, committed)
    if args.bisect:
        from ..results import atomic_write
        from .sweep import sweep_transitions

        def save(done: dict[str, Any]) -> None:
            atomic_write(bisects_file, json.dumps(done, indent=1, sort_keys=True) + "\n")

        bisects = sweep_transitions(support, args.build, done=bisects, limit=args.bisect_limit, models=args.bisect_models,
                                    log=log, save=save)
        save(bisects)
        support = collect(args.build, args.releases, bisects, committed)
    from .trl import attach_trl

    support = attach_trl(support, args.out)  # the TRL axis's block rides along (trl.json)
    if "trl" not in support and committed and committed.get("trl"):
        support["trl"] = committed["trl"]  # no trl.json beside it: the committed support.json's block is kept (issue 42)
    from .kinds import carry_kinds

    support = carry_kinds(support, committed)  # the encoder and multimodal blocks (issue 46) are kept as measured
    if "axes" not in support and committed and isinstance(committed.get("axes"), dict):
        support["axes"] = committed["axes"]  # the library axes: rebuilt by write_outputs where their sources are beside it
    paths = write_outputs(support, args.out)
    log(f"atlas written: {', '.join(str(p) for p in paths)} ({len(support['releases'])} releases measured, "
        f"{len(support['missing'])} missing)")
    sys.stdout.flush()
    return 1 if failed else 0


def main_trl(planned: list[str], build: Path, out: Path, render_only: bool = False, no_render: bool = False,
             remeasure: bool = False, log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None,
             ensure: Callable[..., Any] | None = None, part: str = "sft") -> int:
    """``packcheck atlas --trl`` (``--rl``: ``part="rl"``, the RL trainers): measure the TRL releases of ``planned`` not measured yet (the committed
    ``<out>/trl.json`` and the done folders under ``build`` count, unless ``remeasure``), then (unless
    ``no_render``) write ``<out>/trl.json`` and re-render ``support.json`` (its ``trl`` block), ``atlas.md`` (its
    TRL section) and ``atlas.html`` from the committed ``support.json`` (the transformers axis is not measured
    again). Exit 1 when a release could not be measured this time (run again to resume), 0 otherwise.

    Raises:
        PackcheckUsageError: ``<out>/support.json`` is missing or of another schema (render the transformers
            axis first: ``packcheck atlas``), when rendering.
    """
    from ..results import atomic_write
    from .trl import PARTS, TRL_FILE, collect_trl, generate_trl, load_trl

    committed = load_trl(out, log)
    failed = []
    if not render_only:
        kept = [] if remeasure else [r["trl"] for r in (committed or {}).get(PARTS[part][1], []) if r["trl"] in planned]
        if kept:
            log(f"atlas trl: {', '.join(kept)} already in {Path(out) / TRL_FILE}: kept, not measured again "
                "(--remeasure measures them)")
        failed = [r for r in generate_trl(planned, None if remeasure else committed, build, log, runner, ensure, part)
                  if "error" in r]
    if no_render:
        return 1 if failed else 0
    block = collect_trl(build, planned, None if remeasure else committed)
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(out) / TRL_FILE, json.dumps(block, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    support = load_committed(out, log)
    if support is None:
        raise PackcheckUsageError(f"packcheck atlas --trl: {Path(out) / 'support.json'} is missing or of another schema, "
                                  f"so the TRL block has no atlas to join ({Path(out) / TRL_FILE} is written): render the "
                                  "transformers axis first with `packcheck atlas --render-only`.")
    support["trl"] = block
    paths = write_outputs(support, out)
    log(f"atlas trl written: {Path(out) / TRL_FILE}, {', '.join(str(p) for p in paths)} ({len(block['releases'])} TRL "
        f"releases measured, {len(block['missing'])} missing)")
    return 1 if failed else 0
