"""``packcheck atlas``: every architecture x backend x transformers release, resumable, and its outputs.

One release at a time: the release's version environment (:mod:`pytest_packcheck.versions.envs`, made with uv and cached)
runs the packcheck plugin with ``--packcheck-all-architectures`` (the architectures *that* release has), on
:data:`ATLAS_BACKENDS`, with the checks that decide a cell and the hazards (:func:`atlas_checks`), writing
``<build>/<version>/packcheck-matrix.json`` and its journal there. A killed run is resumed with
``--packcheck-resume`` (the journal keeps every finished cell); a release whose ``atlas-done.json`` exists is not
run again. :func:`collect` reduces the per-release results to ``support.json`` (schema: ``reports/atlas/SCHEMA.md``),
seeded from the committed ``support.json`` (its releases count as measured and are not run again, so a fresh
checkout, whose git-ignored build folder is empty, adds releases and drops none), and :func:`write_outputs` renders ``atlas.md`` and the self-contained ``atlas.html`` from it.

Modules: :mod:`.plan` (the plan and its order), :mod:`.release_run` (one release's run, seeding), :mod:`.collect`
(the reduction to ``support.json``, transitions, bisection, known-fault windows), :mod:`.render` (``atlas.md``,
``atlas.html``), :mod:`.sweep` (transitions to the exact patch), :mod:`.command` (``packcheck atlas``). The names below are the package's public surface.
"""

from .collect import (
                      collect,
                      committed_releases,
                      known_fault_agreement,
                      load_committed,
                      reduce_release,
                      shows,
                      transition_key,
                      transitions,
)
from .command import AtlasArgs, main
from .plan import (
                      ATLAS_BACKENDS,
                      ATLAS_SINCE,
                      DONE_MARKER,
                      SUPPORT_SCHEMA_VERSION,
                      atlas_checks,
                      gap_order,
                      index_releases,
                      latest_patches,
                      parse_release_list,
                      parse_shard,
                      version_key,
)
from .release_run import generate, is_done, release_dir, release_flags, reproduce_command, run_release, seed_release
from .render import render_html, render_markdown, write_outputs
from .sweep import deferred_gaps, measure_between, place, sweep_gaps, sweep_transitions

__all__ = [
                      "ATLAS_BACKENDS",
                      "ATLAS_SINCE",
                      "DONE_MARKER",
                      "SUPPORT_SCHEMA_VERSION",
                      "AtlasArgs",
                      "atlas_checks",
                      "collect",
                      "committed_releases",
                      "deferred_gaps",
                      "gap_order",
                      "generate",
                      "index_releases",
                      "is_done",
                      "known_fault_agreement",
                      "latest_patches",
                      "load_committed",
                      "main",
                      "measure_between",
                      "parse_release_list",
                      "parse_shard",
                      "place",
                      "reduce_release",
                      "release_dir",
                      "release_flags",
                      "render_html",
                      "render_markdown",
                      "reproduce_command",
                      "run_release",
                      "seed_release",
                      "shows",
                      "sweep_gaps",
                      "sweep_transitions",
                      "transition_key",
                      "transitions",
                      "version_key",
                      "write_outputs",
]
