"""The atlas's TRL axis: SFTTrainer's two padding-free paths on a handful of families, per TRL minor (issue 26).

For every TRL minor from :data:`TRL_SINCE` (the latest patch of each, from the package index or named), the
release's version environment (``trl==X``, made with uv and cached as every version environment is; transformers
is this environment's, pinned, when TRL accepts it, so only TRL changes along the axis) runs the packcheck plugin on
:data:`TRL_FAMILIES` x :data:`TRL_BACKENDS` with :data:`TRL_MODES` (``sft``: ``packing=True`` as that TRL
configures it by default; ``sft_padding_free``: ``padding_free=True`` without packing), writing
``<build>/<trl version>/packcheck-matrix.json`` and its journal there (``--packcheck-resume``: a killed run goes on
where it stopped; a release whose ``atlas-done.json`` exists is not run again).

:func:`collect_trl` reduces the per-release results to the ``trl`` block (schema: ``reports/atlas/SCHEMA.md``,
"TRL block"), seeded from the committed ``reports/atlas/trl.json`` (its releases count as measured, so a fresh
checkout adds releases and drops none). The block is committed as ``trl.json`` and copied into ``support.json``
(:func:`attach_trl`) whenever the atlas is rendered, so a re-render of the transformers axis keeps it.
Rendering (``atlas.md``'s TRL section) and the lookup answer: :mod:`.trl_render`.

Backends: ``sdpa`` is what SFTTrainer gets by default (no ``attn_implementation`` in its ``model_init_kwargs``)
and, on the transformers of the axis, shares eager's mask construction (``masking_utils``: a packed row is
detected from ``position_ids`` on both), so eager is not run again; ``packcheck_flash_ref`` is the flash varlen
path (what TRL recommends for ``padding_free``), through packcheck's CPU reference kernel. Where a TRL release
branches on the backend's *name* (``attn_implementation == "flash_attention_2"``), the stand-in runs TRL's
non-flash side and its cell is ``skipped`` with cause ``stand_in_differs`` and the line of TRL that branches: a
measured fact about that release, not a verdict on real flash-attn.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..backends.table import REFERENCE_BACKEND
from ..results.schema import read_results
from .plan import DONE_MARKER, entry_message, index_latest_patches, version_key
from .release_run import check_recorded_version, done_record, is_done, run_failure, run_plugin_in_env

#: The oldest TRL minor of the axis (TRL 0.19 introduced ``packing_strategy``; packcheck's TRL floor).
TRL_SINCE = "0.19"
#: The families of the axis (``config.model_type``; measured as ``arch:<type>``, the release's own tiny config).
TRL_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3_text", "gpt_neox", "mistral")
#: The backends of the axis (module docstring: why not eager).
TRL_BACKENDS: tuple[str, ...] = ("sdpa", REFERENCE_BACKEND)
#: The trainer paths of the axis: check name (``checks/registry.py``) -> what SFTTrainer is asked for.
TRL_MODES: dict[str, str] = {"sft": "packing=True (TRL's default packing_strategy)",
                             "sft_padding_free": "padding_free=True, packing=False"}
#: The RL trainers on the axis (issue 44): check name (``checks/registry.py``, the ``rl`` suite) -> the TRL code it runs.
#: Measured per TRL minor in a run of its own (``<build>/rl/<version>``); on a release where the trainer or the path
#: does not exist, or cannot run on CPU, the check skips naming that release and what it lacks (never a silent pass).
TRL_RL_MODES: dict[str, str] = {
    "rl_trl_grpo": "GRPOTrainer's per-token log-probs and entropies (its log-prob method on the left-padded batch)",
    "rl_trl_dpo": "DPOTrainer._compute_loss on DataCollatorForPreference's batch (sequence sums, margin, loss at ln 2)",
    "rl_trl_kto": "KTOTrainer._compute_loss on DataCollatorForUnpairedPreference's batch (apo_zero_unpaired)",
    "rl_trl_async": "AsyncGRPO's padding-free row (DataCollatorForRollout, compute_loss's forward; 1.7 to 1.15)",
    "rl_trl_tree": "AsyncGRPO's tree (shared-prefix) row (TreeRow, tree_attention on an exact CPU kernel; 1.16 on)",
}
#: RLOO on the axis: ``RLOOTrainer``'s own copy of GRPO's per-token log-prob method (``checks/rl.py``
#: ``check_rl_trl_rloo``), measured per TRL minor in a run of its own (``<build>/rl-rloo/<version>``, ``packcheck atlas
#: --trl --rloo``), added to the RL part after it: its entries sit beside the RL part's, its runs in ``rloo_releases``.
TRL_RLOO_MODES: dict[str, str] = {
    "rl_trl_rloo": ("RLOOTrainer's per-token log-probs and entropies (its own _get_per_token_logps_and_entropies on the "
                    "left-padded batch; the online RLOOTrainer of trl <= 0.21 has none)"),
}
#: The families and backends of the RL part (small: the per-minor run stays a few minutes).
TRL_RL_FAMILIES: tuple[str, ...] = ("llama", "qwen2")
TRL_RL_BACKENDS: tuple[str, ...] = TRL_BACKENDS
#: A model-level check's cells carry no backend: the key it is filed under (rl_trl_tree runs TRL's own attention).
MODEL_LEVEL_BACKEND = "tree_attention"
#: The axis's two parts, each measured in its own run per release: (folder under the build, releases key of the
#: block, families, backends, modes).
PARTS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "sft": ("", "releases", TRL_FAMILIES, TRL_BACKENDS, TRL_MODES),
    "rl": ("rl", "rl_releases", TRL_RL_FAMILIES, TRL_RL_BACKENDS, TRL_RL_MODES),
    "rloo": ("rl-rloo", "rloo_releases", TRL_RL_FAMILIES, TRL_RL_BACKENDS, TRL_RLOO_MODES),
}
#: The flag of each part on ``packcheck atlas --trl`` (none for the SFT part).
PART_FLAGS = {"sft": "", "rl": " --rl", "rloo": " --rloo"}
#: ``trl.json`` / ``support.json["trl"]`` schema version (reports/atlas/SCHEMA.md); bump on an incompatible change.
TRL_SCHEMA_VERSION = 1
#: The committed TRL axis, beside support.json.
TRL_FILE = "trl.json"
#: The effective-configuration keys kept per entry (the check's ``metrics["effective"]``): what TRL really ran.
EFFECTIVE_KEYS = ("packing", "padding_free", "packing_strategy", "collator", "return_position_ids")


def trl_index_releases(since: str = TRL_SINCE, until: str | None = None) -> list[str]:
    """The latest patch of every TRL minor from ``since`` to ``until`` on the package index
    (``$PACKCHECK_INDEX_URL`` or PyPI), ascending.

    Raises:
        PackcheckUsageError: the index cannot be reached.
    """
    return index_latest_patches("trl", "packcheck atlas --trl", "0.19.1,1.16.0", since, until)


def trl_flags(report_dir: str, part: str = "sft") -> list[str]:
    """The ``--packcheck-*`` flags of one TRL release's run of ``part`` (:data:`PARTS`): its families, backends and
    modes, resumable from the release folder's journal."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS, OPT_MODELS, OPT_REPORT_DIR, OPT_RESUME

    _, _, families, backends, modes = PARTS[part]
    return [f"{OPT_MODELS}={','.join('arch:' + f for f in families)}", f"{OPT_BACKENDS}={','.join(backends)}",
            f"{OPT_CHECKS}={','.join(modes)}", f"{OPT_REPORT_DIR}={report_dir}", OPT_RESUME]


def trl_reproduce(trl_version: str, model_type: str | None = None, backend: str | None = None, part: str = "sft") -> str:
    """The command that measures one TRL release's ``part`` (or one family / backend of it) again."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS

    _, _, _, backends, modes = PARTS[part]
    if model_type is None:
        return f"packcheck atlas --trl{PART_FLAGS[part]} --releases {trl_version}"
    return shlex.join(["packcheck", "audit", "--models", f"arch:{model_type}", "--versions", f"trl=={trl_version}",
                       f"{OPT_BACKENDS}={backend or ','.join(backends)}", f"{OPT_CHECKS}={','.join(modes)}"])


def _child_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_trl_release(version: str, build: Path, log: Callable[[str], None] = print,
                    runner: Callable[..., Any] | None = None, ensure: Callable[..., Any] | None = None,
                    part: str = "sft") -> dict[str, Any]:
    """Measure one TRL release into ``<build>/<version>``: make (or find) ``trl==version``'s environment and run the
    plugin there with :func:`trl_flags`. Resumes a killed run (its journal); returns the done record (also written
    as ``atlas-done.json``: ``trl``, ``versions`` (what the environment resolved: transformers, accelerate,
    datasets, ...), ``cells``, ``wall_s``, ``child_cpu_s``), or a record with ``error`` (uv's reason, or the run's
    last lines; written as ``atlas-error.json``) when no results were written. ``runner`` / ``ensure``: replace
    ``subprocess.run`` / :func:`pytest_packcheck.versions.envs.ensure_env` (tests). ``part``: :data:`PARTS` (``"rl"``:
    the RL trainers, into ``<build>/rl/<version>``)."""
    from ..versions.envs import EnvError, VersionCombo, ensure_env

    folder = (Path(build) / PARTS[part][0] / version).resolve()
    if is_done(folder):
        return done_record(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cpu0 = _child_cpu()
    combo = VersionCombo((f"trl=={version}",))
    try:
        env = (ensure or ensure_env)(combo)
    except EnvError as exc:
        record = {"trl": version, "error": str(exc), "wall_s": round(time.perf_counter() - t0, 1)}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas trl {version}: no environment: {exc}")
        return record
    log(f"atlas trl {version}: running in {env.path.name} ({'made' if env.created else 'cached'} {env.seconds:.1f} s, "
        f"transformers {env.versions.get('transformers')}); log {folder / 'atlas-run.log'}")
    proc = run_plugin_in_env(env.python, combo.label, folder, trl_flags(str(folder), part), trl_reproduce(version, part=part),
                             runner)
    wall = round(time.perf_counter() - t0, 1)
    result = folder / "packcheck-matrix.json"
    failure = run_failure(folder, proc.returncode)
    if failure:
        record = {"trl": version, "error": failure, "wall_s": wall}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"atlas trl {version}: no complete results (exit {proc.returncode}); run again to resume")
        return record
    doc = read_results(result)
    record = {"trl": env.versions.get("trl", version), "requested": version, "versions": dict(env.versions),
              "cells": len(doc.get("cells", [])), "wall_s": wall, "child_cpu_s": round(_child_cpu() - cpu0, 1),
              "env_seconds": env.seconds, "env_created": env.created,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    (folder / "atlas-error.json").unlink(missing_ok=True)
    log(f"atlas trl {version}: {record['cells']} cells, {wall:.0f} s wall, {record['child_cpu_s']:.0f} s CPU")
    return record


def next_release(planned: list[str], block: dict[str, Any], skip: set[str] | frozenset[str] = frozenset(),
                 part: str = "sft") -> str | None:
    """The TRL release to measure next, given the ``trl`` block measured so far (:func:`collect_trl`): the newest
    and the oldest of ``planned`` first; then the middle of the widest run of unmeasured releases between two
    measured ones whose entries differ (a transition lies there: each release halves it, so it is found within a
    release after log2(gap) runs); then, with no such gap left, :func:`pytest_packcheck.atlas.plan.gap_order`
    (the widest unmeasured run). ``skip``: releases not to pick (tried and failed in this run). ``part``: whose
    releases and modes count (:data:`PARTS`). None when every release is measured or skipped."""
    from .plan import gap_order

    measured = {r["trl"] for r in block.get(PARTS[part][1], [])}
    left = [v for v in planned if v not in measured and v not in skip]
    if not left:
        return None
    for end in (planned[-1], planned[0]):
        if end in left:
            return end
    done = [v for v in planned if v in measured]
    gaps = []
    for a, b in itertools.pairwise(done):
        between = [v for v in planned[planned.index(a) + 1:planned.index(b)] if v in left]
        if between and _rows_differ(block, a, b, PARTS[part][4]):
            gaps.append(between)
    if gaps:
        widest = max(gaps, key=len)
        return widest[(len(widest) - 1) // 2]
    return next(v for v in gap_order(planned, sorted(measured | set(skip), key=version_key)) if v in left)


def _rows_differ(block: dict[str, Any], a: str, b: str, modes: dict[str, str] | None = None) -> bool:
    """Some (family, mode, backend) measured on both releases has another verdict or causes on each (``modes``: only
    those modes)."""
    for by_mode in block["cells"].values():
        for mode, by_backend in by_mode.items():
            if modes is not None and mode not in modes:
                continue
            for row in by_backend.values():
                if a in row and b in row and _signature(row[a]) != _signature(row[b]):
                    return True
    return False


def generate_trl(planned: list[str], committed: dict[str, Any] | None, build: Path, log: Callable[[str], None] = print,
                 runner: Callable[..., Any] | None = None, ensure: Callable[..., Any] | None = None,
                 part: str = "sft") -> list[dict[str, Any]]:
    """Run every release of ``planned`` measured neither in ``committed`` (the committed block, None with
    ``--remeasure``) nor under ``build``, one at a time in :func:`next_release`'s order (a partial axis brackets
    every transition it has seen tightly); a release that fails is recorded and the next one runs. ``part``:
    :data:`PARTS`."""
    records, failed = [], set()
    while True:
        version = next_release(planned, collect_trl(build, planned, committed), failed, part)
        if version is None:
            return records
        record = run_trl_release(version, build, log, runner, ensure, part)
        records.append(record)
        if "error" in record:
            failed.add(version)


# ----------------------------------------------------------------------------------------------------------------
# Reduction to the ``trl`` block


def reduce_trl_release(doc: dict[str, Any], part: str = "sft") -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """One TRL release's results document -> ``{model_type: {mode: {backend: entry}}}`` (entry: SCHEMA.md, "TRL
    block"): the cell's own status as ``verdict``, its cause codes, the key number (``loss_delta``: the trainer's
    first-batch loss against the per-example reference; absent on a skipped cell, whose number is the stand-in's), the
    message (:func:`~.releases.entry_message`: at most 160 characters, cut at a word with "…"; absent on a pass)
    and the effective configuration TRL ran (:data:`EFFECTIVE_KEYS`). Cells of other checks (than ``part``'s
    modes), backends or dtypes are left out; a model-level check's cell (no backend) is filed under
    :data:`MODEL_LEVEL_BACKEND`."""
    from ..report.numbers import key_metric

    _, _, _, backends, modes = PARTS[part]
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for cell in doc.get("cells", []):
        if cell.get("check") in modes and cell.get("backend") is None:
            cell = {**cell, "backend": MODEL_LEVEL_BACKEND}
        if (cell.get("check") not in modes or cell.get("backend") not in (*backends, MODEL_LEVEL_BACKEND)
                or cell.get("dtype") != "float32"):
            continue
        model = cell.get("model") or {}
        name = model.get("model_type") or model.get("label")
        causes = [c["cause"] for c in cell.get("causes") or [] if isinstance(c, dict) and c.get("cause")]
        if not causes and cell.get("cause"):
            causes = [cell["cause"]]
        entry: dict[str, Any] = {"verdict": cell["status"], "causes": [c for c in dict.fromkeys(causes) if c != cell["status"]]}
        metrics = cell.get("metrics") or {}
        key = key_metric(cell)
        value = key[1] if key else None
        # a skipped cell's number is the stand-in's (e.g. TRL's non-flash side under packcheck_flash_ref): no verdict's
        if cell["status"] != "skipped" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            entry["number"] = float(f"{value:.3g}")
        if cell["status"] != "pass":
            entry["message"] = entry_message(cell.get("message", ""))
        effective = {k: v for k, v in (metrics.get("effective") or {}).items() if k in EFFECTIVE_KEYS}
        if effective:
            entry["effective"] = effective
        out.setdefault(name, {}).setdefault(cell["check"], {})[cell["backend"]] = entry
    return out


def _release_docs(build: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(TRL release, results document, done record) of every finished release folder under ``build``, ascending;
    a folder not named as a release is skipped; one whose run records another TRL is refused
    (:func:`~pytest_packcheck.atlas.release_run.check_recorded_version`)."""
    from packaging.version import InvalidVersion, Version

    from ..results import load_document

    found = []
    if not Path(build).is_dir():
        return found
    for folder in Path(build).iterdir():
        try:
            key = Version(folder.name)
        except InvalidVersion:
            continue
        if folder.is_dir() and is_done(folder):
            doc, record = load_document(folder / "packcheck-matrix.json"), done_record(folder)
            check_recorded_version(folder, folder.name, "trl", doc, record)
            found.append((key, folder.name, doc, record))
    return [(name, doc, record) for _, name, doc, record in sorted(found, key=lambda t: t[0])]


def load_trl(out: Path, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The committed TRL axis (``<out>/trl.json``) that :func:`collect_trl` is seeded from, or None when there is
    none or its schema is not this packcheck's (logged: its releases are then measured again)."""
    path = Path(out) / TRL_FILE
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != "packcheck-atlas-trl" or doc.get("schema_version") != TRL_SCHEMA_VERSION:
        log(f"atlas trl: {path} has schema {doc.get('schema')} v{doc.get('schema_version')}, not v{TRL_SCHEMA_VERSION}: "
            "not seeded from it, its releases are measured again")
        return None
    return doc


def collect_trl(build: Path, planned: list[str] | None = None, committed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``trl`` block (SCHEMA.md, "TRL block") from every finished TRL release under ``build`` (the SFT part in
    ``<build>/<version>``, the RL part in ``<build>/rl/<version>``: :data:`PARTS`), seeded from ``committed``
    (:func:`load_trl`): a release it holds for a part counts as measured for that part unless ``build`` holds a run
    of it, which replaces it. ``planned``: the releases the axis should hold (those measured in neither are
    ``missing``; ``rl_missing`` for the RL part)."""
    from .. import __version__

    cells: dict[str, Any] = {}
    found: dict[str, list[dict[str, Any]]] = {}
    for part, (sub, key, _, _, modes) in PARTS.items():
        releases = []
        docs = _release_docs(Path(build) / sub if sub else Path(build))
        built = {v for v, _, _ in docs}
        for r in (committed or {}).get(key, []):
            if r["trl"] in built:
                continue
            releases.append(dict(r))
            for name, by_mode in (committed or {}).get("cells", {}).items():
                for mode, by_backend in by_mode.items():
                    if mode not in modes:
                        continue
                    for backend, row in by_backend.items():
                        if r["trl"] in row:
                            cells.setdefault(name, {}).setdefault(mode, {}).setdefault(backend, {})[r["trl"]] = row[r["trl"]]
        for version, doc, record in docs:
            env_versions = record.get("versions") or {}
            env = next((c.get("env", {}).get("environment") for c in doc.get("cells", []) if c.get("env")), None) or {}
            releases.append({"trl": version, "transformers": env_versions.get("transformers") or env.get("transformers"),
                             "torch": env.get("torch") or (doc.get("environment") or {}).get("torch"),
                             "versions": env_versions, "cells": record.get("cells"), "wall_s": record.get("wall_s"),
                             "cpu_s": record.get("child_cpu_s"), "packcheck_version": doc.get("packcheck_version"),
                             "command": trl_reproduce(version, part=part)})
            for name, by_mode in reduce_trl_release(doc, part).items():
                for mode, by_backend in by_mode.items():
                    for backend, entry in by_backend.items():
                        cells.setdefault(name, {}).setdefault(mode, {}).setdefault(backend, {})[version] = entry
        releases.sort(key=lambda r: version_key(r["trl"]))
        found[part] = releases
    block = {"schema": "packcheck-atlas-trl", "schema_version": TRL_SCHEMA_VERSION, "packcheck_version": __version__,
             "generated": time.strftime("%Y-%m-%d", time.gmtime()), "device": "cpu", "dtype": "float32",
             "families": list(TRL_FAMILIES), "backends": list(TRL_BACKENDS), "modes": dict(TRL_MODES),
             "releases": found["sft"], "missing": [v for v in (planned or []) if v not in {r["trl"] for r in found["sft"]}],
             "cells": cells}
    if found["rl"] or (committed or {}).get("rl_releases") is not None:
        block.update({"rl_families": list(TRL_RL_FAMILIES), "rl_backends": [*TRL_RL_BACKENDS, MODEL_LEVEL_BACKEND],
                      "rl_modes": dict(TRL_RL_MODES), "rl_releases": found["rl"],
                      "rl_missing": [v for v in (planned or []) if v not in {r["trl"] for r in found["rl"]}]})
    if found["rloo"] or (committed or {}).get("rloo_releases") is not None:  # RLOO, measured after the RL part
        block.setdefault("rl_modes", {}).update(TRL_RLOO_MODES)
        block.setdefault("rl_families", list(TRL_RL_FAMILIES))
        block.setdefault("rl_backends", [*TRL_RL_BACKENDS, MODEL_LEVEL_BACKEND])
        block.update({"rloo_releases": found["rloo"],
                      "rloo_missing": [v for v in (planned or []) if v not in {r["trl"] for r in found["rloo"]}]})
    _share_skip_messages(cells)
    block["transitions"] = trl_transitions(block)
    return block


def _share_skip_messages(cells: dict[str, Any]) -> None:
    """A skipped RL entry's message names the release and what it lacks, the same text for every family and backend
    of that release: it is kept on the first (family, backend) in sorted order only, the others carry
    ``"message_from": "<family>/<backend>"`` (:func:`entry_text` reads it back). Keeps ``trl.json`` small."""
    first: dict[tuple[str, str, str], tuple[str, str]] = {}
    for name in sorted(cells):
        for mode in (*TRL_RL_MODES, *TRL_RLOO_MODES):
            for backend in sorted(cells[name].get(mode, {})):
                for version, entry in cells[name][mode][backend].items():
                    if entry["verdict"] != "skipped" or "message" not in entry:
                        continue
                    key = (mode, version, entry["message"])
                    if key in first:
                        del entry["message"]
                        entry["message_from"] = "/".join(first[key])
                    else:
                        first[key] = (name, backend)


def entry_text(block: dict[str, Any], mode: str, version: str, entry: dict[str, Any]) -> str:
    """An entry's message, following ``message_from`` (:func:`_share_skip_messages`) to the entry that holds it."""
    if "message" in entry or "message_from" not in entry:
        return entry.get("message", "")
    name, backend = entry["message_from"].split("/", 1)
    return block["cells"].get(name, {}).get(mode, {}).get(backend, {}).get(version, {}).get("message", "")


def _signature(entry: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    return entry["verdict"], tuple(entry.get("causes", []))


def trl_transitions(block: dict[str, Any]) -> list[dict[str, Any]]:
    """Every change of verdict or causes of one (family, mode, backend) between two adjacent measured TRL
    releases where both have it: ``model_type``, ``mode``, ``backend``, ``last_before``, ``first_after``,
    ``before`` / ``after`` (``verdict``, ``causes``, ``number``). A release missing for that row is skipped over
    (its neighbours are adjacent), so the gap is as wide as what was measured."""
    order = sorted({r["trl"] for r in [*block["releases"], *block.get("rl_releases", []), *block.get("rloo_releases", [])]},
                   key=version_key)
    out = []
    for name in sorted(block["cells"]):
        for mode in (*TRL_MODES, *TRL_RL_MODES, *TRL_RLOO_MODES):
            for backend in (*TRL_BACKENDS, MODEL_LEVEL_BACKEND):
                row = block["cells"][name].get(mode, {}).get(backend, {})
                present = [v for v in order if v in row]
                for old, new in itertools.pairwise(present):
                    a, b = row[old], row[new]
                    if _signature(a) == _signature(b):
                        continue
                    out.append({"model_type": name, "mode": mode, "backend": backend, "last_before": old, "first_after": new,
                                "before": {k: a.get(k) for k in ("verdict", "causes", "number")},
                                "after": {k: b.get(k) for k in ("verdict", "causes", "number")}})
    return out


def attach_trl(support: dict[str, Any], out: Path) -> dict[str, Any]:
    """``support`` with ``trl`` set to the committed TRL axis (``<out>/trl.json``) when there is one (unchanged
    otherwise): every render of the atlas carries the TRL block, whichever axis was measured."""
    block = load_trl(out, log=lambda _line: None)
    if block is not None:
        support["trl"] = block
    return support


def trl_known_fault_agreement(block: dict[str, Any], faults: list[Any]) -> list[dict[str, Any]]:
    """Each TRL window of the known faults (:class:`pytest_packcheck.analysis.diagnose.KnownFault` with
    ``library == "trl"``) against the TRL axis, per measured TRL release: ``agrees``, ``disagrees`` (why) or
    ``not_checkable`` (its checks or backends are not on the axis, or nothing matching was measured there).

    Inside a window at least one matching (family, mode, backend) shows the cause; outside it none does, unless
    another TRL entry with the same cause covers that release (a cause with two windows is two entries). A
    ``skipped`` entry (e.g. ``stand_in_differs``) measured nothing and counts on neither side."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = []
    for f in (f for f in faults if f.library == "trl"):
        base = {"id": f.id, "versions": f.versions, "cause": f.cause}
        backends = [b for b in block["backends"] if "*" in f.backends or b in f.backends]
        modes = [m for m in block["modes"] if m in f.checks]
        if not backends or not modes:
            out.append({**base, "status": "not_checkable", "why": f"its checks ({', '.join(f.checks)}) or backends "
                        f"({', '.join(f.backends)}) are not on the TRL axis"})
            continue
        archs = sorted(block["cells"]) if "*" in f.architectures else [a for a in f.architectures if a in block["cells"]]
        for r in (r["trl"] for r in block["releases"]):
            inside = SpecifierSet(f.versions).contains(Version(r), prereleases=True)
            entries = [(f"{a}/{m}/{b}", e) for a in archs for m in modes for b in backends
                       for e in [block["cells"][a].get(m, {}).get(b, {}).get(r)] if e and e["verdict"] != "skipped"]
            hits = [k for k, e in entries if f.cause in e.get("causes", [])]
            rec = {**base, "release": r, "inside": inside, "measured": len(entries), "hits": hits[:8]}
            covered = any(g is not f and g.library == "trl" and g.cause == f.cause
                          and SpecifierSet(g.versions).contains(Version(r), prereleases=True) for g in faults)
            if not entries:
                out.append({**rec, "status": "not_checkable", "why": "nothing matching measured on this release"})
            elif inside and not hits:
                out.append({**rec, "status": "disagrees", "why": f"inside the window, and none of {len(entries)} matching "
                            f"(family, mode, backend) shows {f.cause}"})
            elif not inside and hits and not covered:
                out.append({**rec, "status": "disagrees", "why": f"outside the window, and {', '.join(hits[:8])} shows {f.cause}"})
            else:
                out.append({**rec, "status": "agrees"})
    return out
