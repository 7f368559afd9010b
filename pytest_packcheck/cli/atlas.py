"""``packcheck atlas``: every architecture x backend x transformers release (4.44 ..), resumable; writes
``reports/atlas/`` (atlas.md, atlas.html, support.json) through :func:`pytest_packcheck.atlas.main`."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(atlas: argparse.ArgumentParser) -> None:
    atlas.description = ("Measures each release in its own version environment (cached), one release "
                         "after another; a killed run resumes where it stopped (per-release results and "
                         "journal under --build-dir).")
    atlas.add_argument("--releases", default=None, metavar="A,B", help="Exact transformers releases, e.g. 4.44.2,5.24.0 "
                       "(default: the latest patch of every minor from --since to --until, from the package index).")
    atlas.add_argument("--since", default=None, help="Oldest minor (default 4.44, the varlen reference's floor; with "
                       "--trl, 0.19).")
    atlas.add_argument("--until", default=None, help="Newest minor (default: the newest on the index).")
    atlas.add_argument("--build-dir", default=None, help="Per-release results and journals (default build/atlas, with "
                                                         "--trl build/atlas-trl; not committed).")
    atlas.add_argument("--trl", action="store_true", help="The TRL axis instead: SFTTrainer's packing and padding_free "
                       "paths on a few families per TRL minor from 0.19 (--releases / --since / --until name TRL releases); "
                       "writes OUTPUT_DIR/trl.json and the TRL parts of support.json and atlas.md.")
    atlas.add_argument("--rl", action="store_true", help="With --trl: the axis's RL part (TRL's GRPO, DPO, KTO and "
                       "AsyncGRPO log-prob code, pytest_packcheck/atlas/trl.py TRL_RL_MODES), measured per TRL release "
                       "into BUILD_DIR/rl and rendered beside the SFT part.")
    atlas.add_argument("--rloo", action="store_true", help="With --trl: TRL's RLOOTrainer log-prob path per TRL release "
                       "(TRL_RLOO_MODES), measured into BUILD_DIR/rl-rloo and merged into the RL part.")
    atlas.add_argument("-o", "--output-dir", default="reports/atlas", help="Where atlas.md / .html and support.json go.")
    atlas.add_argument("--shard", default=None, metavar="I/N", help="Run shard I of N of each release (whole models, "
                                                                    "round-robin; as --packcheck-shard).")
    atlas.add_argument("--models", default=None, metavar="SPECS", help="Only these models (arch:llama,arch:qwen2; default "
                       "every architecture of each release). Use its own --build-dir: a release done for a subset is done.")
    atlas.add_argument("-n", "--workers", type=int, default=1, help="pytest-xdist workers per release (default 1).")
    atlas.add_argument("--list-releases", action="store_true", help="Print the releases the atlas covers as a JSON list "
                       "(for a CI matrix) and exit.")
    atlas.add_argument("--no-render", action="store_true", help="Measure only (a CI job of one release or shard); "
                       "the merge job renders.")
    atlas.add_argument("--render-only", action="store_true", help="Only render reports/atlas/ from what --build-dir holds.")
    atlas.add_argument("--seed", action="append", default=[], metavar="FILE", help="Take this results JSON (one "
                       "release's --all-architectures run on the atlas backends) as its release's run; repeatable.")
    atlas.add_argument("--remeasure", action="store_true", help="Measure again the releases the committed atlas "
                       "(OUTPUT_DIR/support.json) already holds; by default they are kept, not run.")
    atlas.add_argument("--bisect", action="store_true", help="Place every transition between adjacent measured releases "
                       "on the exact patch: each release on the index between the two is run once, with every "
                       "architecture that changes across that gap (resumable; runs under BUILD_DIR/sweep).")
    atlas.add_argument("--bisect-limit", type=int, default=None, help="Sweep at most this many gaps (pairs of adjacent "
                       "measured releases), cheapest first (fewest releases between x architectures).")
    atlas.add_argument("--bisect-models", default=None, metavar="TYPES", help="Bisect only these model types' transitions "
                                                                             "(e.g. llama,qwen2).")


def run(ns: argparse.Namespace) -> int:
    """``packcheck atlas``: the releases, then :func:`pytest_packcheck.atlas.main`.

    Raises:
        PackcheckUsageError: an empty value, bad --releases / --shard / --seed, --releases the index lacks, an
            unknown --bisect-models type, --since newer than --until (or not a version), an -o/--output-dir
            that cannot be written, --render-only with --no-render or with a --build-dir that is not
            a folder, -n or --bisect-limit below 1, an unreachable package index.
    """
    import sys

    from ..atlas import ATLAS_SINCE, AtlasArgs, index_releases, parse_release_list, parse_shard
    from ..atlas import main as atlas_main
    from ..errors import PackcheckUsageError

    # an empty value (`--releases ''` listed every release) was refused by cli._refuse_empty_values, for every command
    if ns.render_only and ns.no_render:
        raise PackcheckUsageError("--render-only and --no-render exclude each other: pick one.")
    build_dir = ns.build_dir or ("build/atlas-trl" if ns.trl else "build/atlas")
    _check_since_until(ns.since, ns.until, "TRL" if ns.trl else "transformers")
    if ns.bisect_limit is not None and ns.bisect_limit < 1:
        raise PackcheckUsageError(f"--bisect-limit {ns.bisect_limit} must be >= 1 (the most gaps to sweep); leave it "
                                  "out to sweep every gap.")
    if (ns.rl or ns.rloo) and not ns.trl:
        raise PackcheckUsageError(f"{'--rl' if ns.rl else '--rloo'} is a part of the TRL axis: add --trl.")
    if ns.rl and ns.rloo:
        raise PackcheckUsageError("--rl and --rloo are two runs of the TRL axis: give one.")
    if ns.trl:
        from ..atlas.command import main_trl
        from ..atlas.trl import TRL_SINCE, trl_index_releases

        extra = [flag for flag, given in (("--shard", ns.shard), ("--models", ns.models), ("--seed", ns.seed),
                                          ("--bisect", ns.bisect), ("-n", ns.workers != 1)) if given]
        if extra:
            raise PackcheckUsageError(f"{', '.join(extra)} do not apply with --trl (its families, backends and modes are "
                                      "fixed: pytest_packcheck/atlas/trl.py): drop them.")
        if not ns.list_releases:  # before the package index is asked: nothing there to render from
            _refuse_nothing_to_render(ns, build_dir)
        planned = parse_release_list(ns.releases, "--releases") if ns.releases is not None else trl_index_releases(ns.since or TRL_SINCE, ns.until)
        if ns.list_releases:
            import json

            print(json.dumps(planned))
            return 0
        _probe_output(ns)
        return main_trl(planned, Path(build_dir), Path(ns.output_dir), ns.render_only, ns.no_render,
                        ns.remeasure, log=lambda line: print(line, flush=True), part="rl" if ns.rl else "rloo" if ns.rloo else "sft")
    for flag, given in (("--bisect-limit", ns.bisect_limit is not None), ("--bisect-models", bool(ns.bisect_models))):
        if given and not ns.bisect:
            print(f"packcheck atlas: warning: {flag} has no effect without --bisect", file=sys.stderr)
    # every flag is checked whatever the mode (--list-releases included), before the package index is asked
    shard = parse_shard(ns.shard, "--shard") if ns.shard is not None else None
    if ns.workers < 1:
        raise PackcheckUsageError(f"-n/--workers {ns.workers} must be >= 1.")
    from ..atlas.release_run import check_seed

    for seed in ns.seed:
        check_seed(Path(seed))
    models = [m.strip() for m in ns.models.split(",") if m.strip()] if ns.models is not None else None
    bisect_models = [m.strip() for m in ns.bisect_models.split(",") if m.strip()] if ns.bisect_models is not None else None
    if bisect_models:
        from ..analysis.support_file import refuse_unknown_model_type

        committed = Path(ns.output_dir) / "support.json"
        for name in bisect_models:  # a typo bisected nothing and said nothing
            refuse_unknown_model_type(name, "--bisect-models", str(committed) if committed.is_file() else None)
    if not ns.list_releases:  # every flag checked first (trial 13, 153), then before the package index is asked
        _refuse_nothing_to_render(ns, build_dir)
    releases = parse_release_list(ns.releases, "--releases") if ns.releases is not None else index_releases(ns.since or ATLAS_SINCE, ns.until)
    if ns.releases is not None and (ns.list_releases or not ns.render_only):
        _refuse_unreleased(releases)
    if ns.list_releases:
        import json

        print(json.dumps(releases))
        return 0
    _probe_output(ns)
    return atlas_main(AtlasArgs(releases, Path(ns.build_dir or "build/atlas"), Path(ns.output_dir), shard, ns.workers, ns.render_only,
                                ns.bisect, ns.bisect_limit, models, bisect_models, ns.seed, ns.no_render, ns.remeasure),
                      log=lambda line: print(line, flush=True))


def _probe_output(ns: argparse.Namespace) -> None:
    """Refuse an -o/--output-dir that cannot be written (under a file: ``-o /dev/null/x``) before any measuring or
    rendering, with the probe bench and bisect use (:func:`~pytest_packcheck.results.io.probe_folder`)."""
    if not ns.no_render:
        from ..results.io import probe_folder

        probe_folder(Path(ns.output_dir), "-o/--output-dir", "Output directory")


def _check_since_until(since: str | None, until: str | None, library: str) -> None:
    """Refuse a ``--since`` / ``--until`` that is not a version, or a ``--since`` newer than ``--until`` (an empty
    plan, printed as ``[]`` with exit 0 before), before the package index is asked.

    Raises:
        PackcheckUsageError: naming the flag and its value.
    """
    from packaging.version import InvalidVersion, Version

    from ..errors import PackcheckUsageError

    parsed = {}
    for flag, value in (("--since", since), ("--until", until)):
        if value is None:
            continue
        try:
            parsed[flag] = Version(value)
        except InvalidVersion:
            raise PackcheckUsageError(f"{flag} '{value}' is not a {library} version: write a minor or release such as "
                                      "5.20 or 5.20.2.") from None
    if len(parsed) == 2 and parsed["--since"] > parsed["--until"]:
        raise PackcheckUsageError(f"--since {since} is newer than --until {until}: no {library} release lies between "
                                  "them; swap them (--since is the oldest minor, --until the newest).")


def _refuse_unreleased(releases: list[str]) -> None:
    """Refuse a ``--releases`` item the package index does not have (``4.99.0``), naming the nearest releases, before
    any environment is built; the same index the atlas plans from (``$PACKCHECK_INDEX_URL``). An unreachable index
    is a warning: the environment build then says what it cannot install.

    Raises:
        PackcheckUsageError: a release not on the index (or yanked there).
    """
    import sys

    from ..analysis.bisect import fetch_index_page, parse_simple_index
    from ..errors import PackcheckUsageError
    from ..versions.releases import refuse_unreleased

    try:
        known, _ = parse_simple_index(fetch_index_page("transformers"))
    except PackcheckUsageError as exc:
        print(f"packcheck atlas: warning: --releases not checked against the package index ({exc})", file=sys.stderr)
        return
    refuse_unreleased([(release, "--releases") for release in releases], known, "transformers",
                      "Pass one of them, or use --since / --until for every minor's latest patch.", " (final, not yanked)")


def _refuse_nothing_to_render(ns: argparse.Namespace, build_dir: str) -> None:
    """--render-only with nothing to render: a --build-dir that is a file, or one that holds no finished release
    (nor shard; a missing folder holds none) beside an -o without the atlas file to re-render. The render was an
    empty atlas ("0 releases measured", torch None), exit 0 (trial 3 #158). A committed atlas in -o re-renders
    with or without a build folder (trial 13, 53: the error asked for such an -o, then refused the missing default
    build/atlas beside it).

    Raises:
        PackcheckUsageError: naming both folders and the fix.
    """
    if not ns.render_only:
        return
    from ..atlas import DONE_MARKER
    from ..errors import PackcheckUsageError

    given = (f"--build-dir '{build_dir}'" if ns.build_dir
             else f"the default --build-dir '{build_dir}' (no --build-dir given; under {Path.cwd()})")
    if Path(build_dir).exists() and not Path(build_dir).is_dir():
        raise PackcheckUsageError(f"Nothing to render (with --render-only): {given} is not a folder. Pass the folder a "
                                  "measuring run wrote with --build-dir.")
    kept = Path(ns.output_dir) / ("trl.json" if ns.trl else "support.json")
    done = any(Path(build_dir).glob(f"*/{DONE_MARKER}")) or any(Path(build_dir).glob(f"*/shard-*/{DONE_MARKER}"))
    if not done and not kept.is_file():
        state = "holds no finished release" if Path(build_dir).is_dir() else "does not exist"
        raise PackcheckUsageError(f"Nothing to render (with --render-only): {given} {state}, and -o '{ns.output_dir}' "
                                  f"holds no {kept.name} to re-render. Pass --build-dir with the folder a measuring run "
                                  f"wrote, or -o with a folder holding a committed atlas ({kept.name} in it, as in "
                                  "reports/atlas), or run without --render-only.")
