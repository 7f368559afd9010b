"""The atlas's blocks beyond the causal LM (issue 46): encoders and multimodal rows with pixels, per transformers release.

Each block (:data:`KINDS`) is an opt-in audit suite (``audit/encoders.toml``, ``audit/multimodal.toml``: its models
and backends, the one table) run as the atlas runs a release: the release's version environment runs the plugin on
the suite's models, on the suite's backends that the atlas has (:data:`~.plan.ATLAS_BACKENDS`: eager, sdpa and the
flash varlen reference; flex_attention is left out, its CPU compile costs more than the rest of a release), with the
block's checks (:attr:`Kind.checks`, the suite's correctness checks and findings that need no second model built),
writing ``<build>/<version>/packcheck-matrix.json`` (resumable from its journal, :func:`.release_run.run_release`).

:func:`collect_kind` reduces the per-release runs to the block (schema: ``reports/atlas/SCHEMA.md``, "Encoder and
multimodal blocks"), seeded from the committed ``support.json``'s block (its releases count as measured, so a fresh
checkout adds releases and drops none). An entry is the matrix headline of that (model, backend), as the atlas's
(:func:`.collect.reduce_release`), and ``absent`` where the model is not a ``model_type`` of that release's
transformers. Transitions are found and placed on the exact patch with the atlas's own machinery
(:func:`.collect.transitions`, :func:`.sweep.sweep_transitions` with :func:`measure_between` as the measure).
The blocks ride along in ``support.json`` (:func:`carry_kinds`: a re-render of the transformers axis keeps them),
render as ``atlas.md``'s encoder and multimodal sections (:func:`render_kind_markdown`) and are answered by
``packcheck lookup encoder:bert sdpa 5.24.0`` (:func:`kind_answer`).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collect import ABSENT, reduce_release, transitions
from .plan import ATLAS_BACKENDS, version_key
from .release_run import check_recorded_version, done_record, is_done, release_dir, run_release

#: Block schema version (``support.json["encoders"]`` / ``["multimodal"]``, reports/atlas/SCHEMA.md); bumped on a
#: change that removes or re-types a field of a block.
KIND_SCHEMA_VERSION = 1
#: The words of the error a release gives for a model_type it does not have (``model/resolve.py``,
#: ``resolve_model``): such a model's entry is ``absent``.
ABSENT_MARK = "not a model_type of the installed transformers"


@dataclass(frozen=True)
class Kind:
    """One block of the atlas beyond the causal LM.

    ``name``: the block's key in ``support.json`` and the audit suite it runs (``audit/<name>.toml``); ``checks``:
    the checks run per cell; ``prefix``: the spec prefix of its models (``encoder:``, ``arch:``), which
    ``packcheck lookup`` accepts; ``title``: atlas.md's section heading; ``all_architectures``: each release also
    runs every architecture of that release's transformers the suite's ``--all-architectures`` adds
    (:func:`release_models`: every masked-LM model_type for the encoders), not only the suite's models."""

    name: str
    checks: tuple[str, ...]
    prefix: str
    title: str
    all_architectures: bool = False
    #: ``module:function`` that lists, in a release's environment, what ``--all-architectures`` adds to the suite
    #: (:func:`release_architectures`): model_types (given ``prefix``) or specs
    architectures: str = ""
    #: checks run per cell beside ``checks`` whose outcome an entry carries as a field of its own (:data:`SIDE_FIELDS`),
    #: never in its verdict: the multimodal block's video row and processor rows
    side: tuple[str, ...] = ()
    #: distributions each release's environment also installs, at this machine's version (:func:`env_extras`):
    #: pillow for the multimodal block (transformers' image_utils defines PILImageResampling, which the processors of
    #: ``mm_processor`` import, only with it)
    packages: tuple[str, ...] = ()
    #: rows measured under a name of their own beside their family's: (row name, family model_type, spec), run on
    #: each release whose transformers has the family (:func:`release_models`, :func:`add_rows`); a cell of that spec
    #: is the row's, never the family's (:func:`row_name`)
    rows: tuple[tuple[str, str, str], ...] = ()

    @property
    def run_checks(self) -> tuple[str, ...]:
        """Every check a release's run of the block runs: ``checks``, then ``side``."""
        return (*self.checks, *self.side)

    def suite(self) -> Any:
        """The suite's definition (:func:`pytest_packcheck.config.audits.load_audit`)."""
        from ..config.audits import load_audit

        return load_audit(self.name)

    @property
    def models(self) -> tuple[str, ...]:
        """The suite's model specs (``encoder:bert``, ``arch:gemma3{...}``), as the audit runs them."""
        return tuple(self.suite().models)

    @property
    def backends(self) -> tuple[str, ...]:
        """The suite's backends the atlas has, in the atlas's order."""
        wanted = self.suite().backends or ATLAS_BACKENDS
        return tuple(b for b in ATLAS_BACKENDS if b in wanted)


#: The blocks: the encoder suite's isolation / hidden-state parity / pooled embeddings / MLM loss / positions, with
#: the two classification probes beside them (side checks: each builds a second model, the head, per cell), and the
#: multimodal suite's checks with its collator-layout finding.
KINDS: dict[str, Kind] = {
    "encoders": Kind("encoders", ("encoder_isolation", "encoder_parity", "encoder_pooling", "encoder_mlm_loss",
                                  "encoder_positions"), "encoder:", "Encoders and embedding models", all_architectures=True,
                     architectures="pytest_packcheck.model.architectures:encoder_architectures",
                     side=("encoder_token_cls", "encoder_seq_cls")),
    "multimodal": Kind("multimodal", ("mm_isolation", "mm_parity", "mm_positions", "mm_layouts"), "arch:",
                       "Multimodal rows with pixels", side=("mm_videos", "mm_processor"), packages=("pillow",),
                       all_architectures=True, architectures="pytest_packcheck.checks.pixels:multimodal_specs",
                       # LLaVA-NeXT with two grid pinpoints (28x28, 28x56 at image_size 28): the row's second image is
                       # split into two tiles beside its base image (14 tokens), the first is one tile (10 tokens);
                       # the family's row (one pinpoint) tiles each image once (checks/pixels.py FIXED_IMAGES)
                       rows=(("llava_next_tiles", "llava_next",
                              "vlm:llava_next{vision_config.image_size=28,image_grid_pinpoints=[[28,28],[28,56]]}"),)),
}
#: A side check (:attr:`Kind.side`) -> the entry field it fills: ``videos`` = [verdict, number] of the video row
#: (``mm_videos``: pass / fail, its max |Δ| of text logits, a fail's cause), ``processor`` = {layout: [holds / leaks / differs,
#: number]} of the processor's rows through DataCollatorWithFlattening (``mm_processor``, as ``layouts``);
#: ``token_cls`` = [verdict, number] of a token-classification head on the packed row (``encoder_token_cls``: its
#: logits' and loss's worst |Δ| against each example alone, a fail's cause), ``seq_cls`` = [verdict, logits rows the
#: model's own sequence-classification head returns for a packed row of :data:`SEQ_CLS_EXAMPLES` examples, a fail's
#: cause] (``encoder_seq_cls``: ``pooled_head`` where that is not one row per example). A skipped side check (no video
#: inputs, no processor recipe, a package the processor needs, no such head in that transformers) fills nothing.
SIDE_FIELDS = {"mm_videos": "videos", "mm_processor": "processor", "encoder_token_cls": "token_cls",
               "encoder_seq_cls": "seq_cls"}
#: The side fields that are one [verdict, number, cause?] (the others are layouts, as ``layouts``), and the metric
#: each number is: ``worst`` is the larger of ``max_abs_diff`` and ``loss_delta``.
VERDICT_FIELDS = {"videos": "max_abs_diff", "token_cls": "worst", "seq_cls": "head_rows"}
#: The side fields whose check builds a model of its own (a classification head): its crash or refusal is not the
#: entry's, so it is said (``error`` / ``unsupported`` / ``skipped`` and its cause: DistilBERT's sequence-classification
#: head takes no ``position_ids`` before 5.0), never left out; only a no-verdict status with no cause that the entry
#: says itself (the model refuses that backend) is left out (:func:`_adds`).
OWN_MODEL_FIELDS = ("token_cls", "seq_cls")
#: The entry a side check run once per model (its cells have no backend: ``encoder_seq_cls``) fills.
MODEL_LEVEL_BACKEND = "sdpa"
#: The examples of the encoder checks' packed row (checks/encoders.py, the workbench's three examples).
SEQ_CLS_EXAMPLES = 3


def _rows_by_spec() -> dict[str, str]:
    """A :attr:`Kind.rows` spec (whitespace dropped) -> its row name, over every block."""
    return {"".join(spec.split()): name for kind in KINDS.values() for name, _, spec in kind.rows}


def row_name(spec: str | None) -> str | None:
    """The row name of a :attr:`Kind.rows` spec (``llava_next_tiles`` for LLaVA-NeXT with two grid pinpoints),
    None for any other spec."""
    return _rows_by_spec().get("".join(spec.split())) if isinstance(spec, str) else None


def model_type_of(spec: str) -> str:
    """``encoder:bert`` -> ``bert``; ``arch:gemma3{vision_config.image_size=64}`` -> ``gemma3``; a
    :attr:`Kind.rows` spec -> its row name (:func:`row_name`)."""
    if (row := row_name(spec)) is not None:
        return row
    return spec.split(":", 1)[-1].split("{", 1)[0].strip()


def kind_flags(kind: Kind, report_dir: str, models: list[str] | None = None, checks: list[str] | None = None) -> list[str]:
    """The ``--packcheck-*`` flags of one release's run of ``kind`` (of ``models``, specs, and ``checks`` when
    given; else every check the block runs, :attr:`Kind.run_checks`), resumable."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS, OPT_MODELS, OPT_REPORT_DIR, OPT_RESUME

    return [f"{OPT_MODELS}={','.join(models or kind.models)}", f"{OPT_BACKENDS}={','.join(kind.backends)}",
            f"{OPT_CHECKS}={','.join(checks or kind.run_checks)}", f"{OPT_REPORT_DIR}={report_dir}", OPT_RESUME]


def kind_reproduce(kind: Kind, version: str, spec: str | None = None, backend: str | None = None) -> str:
    """The command that measures ``kind`` (or one model / backend of it) on ``version`` again: for a block over every
    architecture, the suite with ``--all-architectures``."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS

    which = ["--models", spec] if spec else ["--audit", kind.name, "--all-architectures"] if kind.all_architectures \
        else ["--models", ",".join(kind.models)]
    return shlex.join(["packcheck", "audit", *which, "--versions",
                       f"transformers=={version}", f"{OPT_BACKENDS}={backend or ','.join(kind.backends)}",
                       f"{OPT_CHECKS}={','.join(kind.run_checks)}"])


#: The folder of a release's later runs: models the suite gained after the release was measured.
EXTRA = "extra"
#: The folder (under a block's build) of each release's architecture list (:func:`release_architectures`), one JSON
#: file per release; not a version, so never read as a release's run.
ARCHITECTURES = "architectures"


def release_architectures(kind: Kind, version: str, build: Path) -> list[str]:
    """What ``transformers==version`` adds to ``kind``'s suite under ``--all-architectures`` (:attr:`Kind.architectures`:
    the encoders' :func:`pytest_packcheck.model.architectures.encoder_architectures`, every masked-LM model_type; the
    multimodal block's :func:`pytest_packcheck.checks.pixels.multimodal_specs`, every VLM packcheck lays out, as
    specs), asked in that release's version environment (2-4 s: an import of transformers' auto mappings) and kept in
    ``<build>/architectures/<version>.json``; [] for a kind without ``all_architectures``.

    Raises:
        RuntimeError: the environment cannot be made, or the question fails in it (its last lines).
    """
    if not kind.all_architectures:
        return []
    saved = Path(build) / ARCHITECTURES / f"{version}.json"
    if saved.exists():
        return list(json.loads(saved.read_text()))
    import os
    import subprocess

    from ..versions.envs import EnvError, VersionCombo, ensure_env

    try:
        env = ensure_env(VersionCombo((f"transformers=={version}",)))
    except EnvError as exc:
        raise RuntimeError(f"transformers {version}: no environment: {exc}") from None
    module, function = kind.architectures.split(":")
    code = f"import json; from {module} import {function} as a; print(json.dumps(a()))"
    child_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, check=False, env=child_env,
                          cwd=str(Path(build).resolve().parent))
    if proc.returncode != 0:
        raise RuntimeError(f"transformers {version}: the architecture list failed: {proc.stderr.strip()[-300:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(found) + "\n")
    return found


def release_models(kind: Kind, version: str, build: Path) -> list[str]:
    """The specs ``kind`` measures on ``version``: the suite's, then for a kind over every architecture each of
    :func:`release_architectures` the suite lacks (a model_type as ``<prefix><model_type>``: ``encoder:albert``; a
    spec as it is), then each of :attr:`Kind.rows` whose family is among them. A model_type the release lacks is not
    run there: the block has no entry for it on that release."""
    have = {model_type_of(s) for s in kind.models}
    found = [a if ":" in a else f"{kind.prefix}{a}" for a in release_architectures(kind, version, build)]
    models = [*kind.models, *(s for s in found if model_type_of(s) not in have)]
    types = {model_type_of(s) for s in models}
    return [*models, *(spec for name, family, spec in kind.rows if family in types and name not in types)]


def spec_of(kind: Kind, model_type: str) -> str:
    """The spec ``kind`` builds ``model_type`` with: the suite's; beyond it, the multimodal block's tiny spec of a
    FIXED_IMAGES family (:data:`pytest_packcheck.checks.pixels.TINY_SPECS`), else ``<prefix><model_type>``."""
    known = {model_type_of(s): s for s in kind.models} | {name: spec for name, _, spec in kind.rows}
    if model_type in known:
        return known[model_type]
    if kind.name == "multimodal":
        from ..checks.pixels import TINY_SPECS

        return TINY_SPECS.get(model_type, f"{kind.prefix}{model_type}")
    return f"{kind.prefix}{model_type}"


def env_extras(kind: Kind) -> dict[str, tuple[str, ...]]:
    """``{"extras": ("pillow==12.1.0", ...)}``: :attr:`Kind.packages` pinned at this machine's versions, as
    :func:`.release_run.run_release` takes them (a package not installed here is left out: its cells say what they
    lack); ``{}`` for a kind without packages."""
    from importlib import metadata

    pinned = []
    for name in kind.packages:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return {"extras": tuple(pinned)} if pinned else {}


def run_kind_release(kind: Kind, version: str, build: Path, models: list[str] | None = None,
                     log: Callable[[str], None] = print, runner: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Measure ``kind`` on one release into ``<build>/<version>`` (:func:`.release_run.run_release` with
    :func:`kind_flags`): the done record, or a record with ``error``. A release already measured is not run again;
    the suite's models (or ``models``) that none of its runs holds are run alone into
    ``<build>/<version>/extra/<digest>/<version>`` (the suite gained a model: the release adds it and keeps the rest),
    and that run's record is returned; a release measured before the block ran its side checks (:attr:`Kind.side`)
    runs them alone on the models it holds first (``extra/``). ``runner``: replaces ``subprocess.run``. A kind over every architecture
    (:attr:`Kind.all_architectures`) runs :func:`release_models` where ``models`` is not given."""
    from ..results import load_document

    if models is None and kind.all_architectures:
        try:
            models = release_models(kind, version, build)
        except RuntimeError as exc:
            return {"transformers": version, "error": str(exc)}
    folder = release_dir(Path(build), version).resolve()
    if is_done(folder):
        cells = [c for part in _parts(folder) for c in load_document(part / "packcheck-matrix.json").get("cells", [])]
        have = {_name(c) for c in cells}
        ran = {c.get("check") for c in cells}
        lacking = [c for c in kind.side if c not in ran]  # side checks the block gained since: on the models run
        held = [s for s in (models or kind.models) if model_type_of(s) in have]
        side_record = None
        if lacking and held:
            sub = folder / EXTRA / hashlib.sha1(",".join([*held, "|", *lacking]).encode()).hexdigest()[:10]
            sub.mkdir(parents=True, exist_ok=True)
            side_record = run_release(version, sub, log=log, runner=runner, reproduce=kind_reproduce(kind, version),
                                      flags=kind_flags(kind, str(sub / version), held, lacking), **env_extras(kind))
            if side_record.get("error"):
                return side_record
        wanted = [s for s in (models or kind.models) if model_type_of(s) not in have]
        if not wanted:
            return side_record or done_record(folder)
        sub = folder / EXTRA / hashlib.sha1(",".join(wanted).encode()).hexdigest()[:10]
        sub.mkdir(parents=True, exist_ok=True)
        return run_release(version, sub, log=log, runner=runner, flags=kind_flags(kind, str(sub / version), wanted),
                           reproduce=kind_reproduce(kind, version), **env_extras(kind))
    return run_release(version, Path(build), log=log, runner=runner, flags=kind_flags(kind, str(folder), models),
                       reproduce=kind_reproduce(kind, version), **env_extras(kind))


def _parts(folder: Path) -> list[Path]:
    """A release folder's finished runs: its own, then those under ``extra/`` (:func:`run_kind_release`)."""
    extra = sorted(p / folder.name for p in (folder / EXTRA).glob("*") if is_done(p / folder.name)) if (folder / EXTRA).is_dir() else []
    return [folder, *extra] if is_done(folder) else []


def reduce_kind_release(kind: Kind, doc: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """One release's run of ``kind`` -> ``{model_type: {backend: entry}}``: :func:`.collect.reduce_release`'s
    entries on the kind's backends, ``{"verdict": "absent", "causes": []}`` where every cell of the model says its
    model_type is not in that transformers (:data:`ABSENT_MARK`), and compact: a ``fail`` keeps its check, number and
    causes but not its message (the check's message is rebuilt from them), a ``pass`` its number but not its check
    (the block's first check, the isolation probe), a no-verdict entry its reason cut to :data:`MESSAGE_CHARS`. The
    multimodal collator-layout finding (``mm_layouts``) adds ``layouts``: layout -> [``holds`` / ``leaks`` /
    ``differs``, number] (:func:`_layouts`; on eager only where they are not sdpa's)."""
    doc = _rows_named(doc)
    absent = {_name(c) for c in doc.get("cells", []) if ABSENT_MARK in str(c.get("message") or "")}
    present = {_name(c) for c in doc.get("cells", []) if ABSENT_MARK not in str(c.get("message") or "")}
    side = _side_fields(doc, kind)
    doc = {**doc, "cells": [c for c in doc.get("cells", []) if c.get("check") not in kind.side]}  # never the verdict
    out = reduce_release(doc, kind.backends, pass_check=kind.checks[0])
    layouts = _layouts(doc, kind.backends)
    for name, by_backend in out.items():
        for backend, entry in by_backend.items():
            if name in absent and name not in present:
                by_backend[backend] = {"verdict": ABSENT, "causes": []}
                continue
            if entry["verdict"] == "fail":
                entry.pop("message", None)
            elif entry["verdict"] == "pass":
                entry.pop("check", None)  # a pass's number is the block's first check's (the isolation probe's)
            elif entry.get("message"):
                entry["message"] = _cut(entry["message"])
            mine = layouts.get((name, backend))
            # eager's layouts are kept only where they are not sdpa's (the two dense-mask paths mostly agree)
            if mine and not (backend == "eager" and mine == layouts.get((name, "sdpa"))):
                entry["layouts"] = mine
            for field, got in side.get((name, backend), {}).items():  # eager's, as layouts: only where not sdpa's
                if not (backend == "eager" and got == side.get((name, "sdpa"), {}).get(field)) and _adds(entry, got):
                    entry[field] = got
    return out


def _side_fields(doc: dict[str, Any], kind: Kind) -> dict[tuple[str, str], dict[str, Any]]:
    """(model_type, backend) -> the entry fields of the side checks (:data:`SIDE_FIELDS`) that ran with a verdict:
    ``videos`` / ``token_cls`` / ``seq_cls`` [``pass`` / ``fail`` (and no verdicts for :data:`OWN_MODEL_FIELDS`), the
    number :data:`VERDICT_FIELDS` names (3 significant digits), and a fail's or a crash's cause], ``processor`` as ``layouts`` (:func:`_layouts` of
    the ``mm_processor`` finding). A cell with no backend (a check run once per model) is :data:`MODEL_LEVEL_BACKEND`'s."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in doc.get("cells", []):
        field = SIDE_FIELDS.get(cell.get("check"))
        # a check run once per model (no backend: encoder_seq_cls, a stack finding) fills the sdpa entry
        backend = cell.get("backend") or (MODEL_LEVEL_BACKEND if MODEL_LEVEL_BACKEND in kind.backends else None)
        statuses = ("pass", "fail", "error", "unsupported", "skipped") if field in OWN_MODEL_FIELDS else ("pass", "fail")
        if field is None or cell.get("check") not in kind.side or backend not in kind.backends \
                or cell.get("dtype") != "float32" or cell.get("status") not in statuses:
            continue
        key = (_name(cell), backend)
        if field in VERDICT_FIELDS:
            metrics = cell.get("metrics") or {}
            num = max((v for v in (metrics.get("max_abs_diff"), metrics.get("loss_delta")) if isinstance(v, (int, float))),
                      default=None) if VERDICT_FIELDS[field] == "worst" else metrics.get(VERDICT_FIELDS[field])
            cause = (cell.get("diagnosis") or {}).get("cause") or cell.get("cause")
            number = (num if isinstance(num, int) else float(f"{num:.3g}")) if isinstance(num, (int, float)) else None
            out.setdefault(key, {})[field] = [cell["status"], number,
                                              *([cause] if cell["status"] != "pass" and cause else [])]
        elif rows := _layouts({"cells": [{**cell, "check": "mm_layouts"}]}, kind.backends).get(key):
            out.setdefault(key, {})[field] = rows
    return out


#: The longest message a block entry keeps (no-verdict entries only), ellipsis included.
MESSAGE_CHARS = 100


def _adds(entry: dict[str, Any], field: Any) -> bool:
    """Whether a side field says something its entry does not: any verdict or layouts, except a no-verdict status
    (``unsupported`` / ``skipped``) with no cause of its own that the entry has itself (the model refuses the backend)."""
    return not (isinstance(field, list) and field[0] in ("unsupported", "skipped") and len(field) < 3
                and entry.get("verdict") == field[0])


def _cut(message: str) -> str:
    from ..report.text import cut, plain

    return cut(plain(message), MESSAGE_CHARS)


def _name(cell: dict[str, Any]) -> str:
    """The block's row of a cell: its model_type (its label where it has none), or the :attr:`Kind.rows` name of its
    spec."""
    model = cell.get("model") or {}
    return row_name(model.get("spec")) or model.get("model_type") or model.get("label")


def _rows_named(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the model_type of each cell of a :attr:`Kind.rows` spec replaced by the row's name (so
    :func:`.collect.reduce_release`, which groups by model_type, keeps the row apart from its family's)."""
    cells = [{**c, "model": {**(c.get("model") or {}), "model_type": row}} if (row := row_name((c.get("model") or {}).get("spec")))
             else c for c in doc.get("cells", [])]
    return {**doc, "cells": cells}


def _layouts(doc: dict[str, Any], backends: tuple[str, ...]) -> dict[tuple[str, str], dict[str, Any]]:
    """(model_type, backend) -> ``{layout: [verdict, number]}`` from the ``mm_layouts`` finding's metrics (per
    collator layout, :func:`pytest_packcheck.checks.pixels.check_mm_layouts`): ``holds`` (text logits packed = alone),
    ``leaks`` (perturbing one sample moves the others) or ``differs`` (no leak, but not the sample alone: e.g. a
    mask that is not causal), with that layout's packed-vs-alone text logits difference (``max_abs_diff``, 3
    significant digits); a pair, not an object, to keep the block small."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in doc.get("cells", []):
        if cell.get("check") != "mm_layouts" or cell.get("backend") not in backends or cell.get("dtype") != "float32":
            continue
        metrics = cell.get("metrics") or {}
        rows, leaked = metrics.get("layouts"), set(metrics.get("leaked") or [])
        if not isinstance(rows, dict):
            continue
        got = {}
        iso_tol = (cell.get("tolerances") or {}).get("isolation_atol")
        for layout, m in sorted(rows.items()):
            if isinstance(m, dict) and isinstance(m.get("max_abs_diff"), (int, float)):
                # the finding's ``leaked`` lists every layout that does not hold (a collator that drops the pixels
                # too): leaks only where perturbing one sample moved another (its isolation past the cell's tolerance)
                iso = m.get("isolation")
                moved = iso > iso_tol if isinstance(iso, (int, float)) and isinstance(iso_tol, (int, float)) else layout in leaked
                verdict = "holds" if m.get("holds") else "leaks" if moved else "differs"
                got[layout] = [verdict, float(f"{m['max_abs_diff']:.3g}")]
        if got:
            out[(_name(cell), cell["backend"])] = got
    return out


def _release_runs(kind: Kind, build: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(release, results document, done record) of every finished release folder under ``build``, ascending: its
    own run and its later runs (``extra/``: models the suite gained since) as one document (their cells joined),
    one record (cells, wall and CPU seconds summed)."""
    from packaging.version import InvalidVersion, Version

    from ..results import load_document

    found = []
    for folder in sorted(Path(build).iterdir()) if Path(build).is_dir() else []:
        try:
            key = Version(folder.name)
        except InvalidVersion:
            continue
        parts = _parts(folder) if folder.is_dir() else []
        if not parts:
            continue
        docs, records = [load_document(p / "packcheck-matrix.json") for p in parts], [done_record(p) for p in parts]
        for part, part_doc, part_record in zip(parts, docs, records, strict=True):
            check_recorded_version(part, folder.name, "transformers", part_doc, part_record)
        doc = {**docs[0], "cells": [c for d in docs for c in d.get("cells", [])]}
        record = {**records[0], **{k: _sum(records, k) for k in ("cells", "wall_s", "child_cpu_s")}}
        found.append((key, folder.name, doc, record))
    return [(name, doc, record) for _, name, doc, record in sorted(found, key=lambda t: t[0])]


def _sum(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r.get(key) for r in records]
    return None if any(v is None for v in values) else round(sum(values), 1)


def collect_kind(kind: Kind, build: Path, planned: list[str] | None = None, committed: dict[str, Any] | None = None,
                 bisects: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kind`` block (SCHEMA.md, "Encoder and multimodal blocks") from every finished release under ``build``,
    seeded from ``committed`` (the committed ``support.json[kind.name]``): a release it holds counts as measured
    unless ``build`` holds a run of that release, which replaces it. ``planned``: the releases the block should hold
    (those measured in neither are ``missing``). ``bisects``: :func:`.collect.transition_key` -> sweep record."""
    from .. import __version__
    from .kinds_render import unpack

    committed = unpack(committed) if committed else committed
    releases, cells = [], {}
    runs = _release_runs(kind, build)
    built = {version for version, _, _ in runs}
    for r in (committed or {}).get("releases", []):
        if r["transformers"] in built:
            continue
        releases.append(dict(r))
        for name, by_backend in committed["cells"].items():  # type: ignore[index]
            for backend, row in by_backend.items():
                if r["transformers"] in row:
                    cells.setdefault(name, {}).setdefault(backend, {})[r["transformers"]] = row[r["transformers"]]
    torch_version = (committed or {}).get("torch")
    configs: dict[str, str] = dict((committed or {}).get("configs") or {})
    specs: dict[str, str] = dict((committed or {}).get("specs") or {})
    suite = {model_type_of(s) for s in kind.models}
    for version, doc, record in runs:
        for cell in doc.get("cells", []):  # a model beyond the suite built with a spec of its own (a tiny VLM's)
            spec, name = (cell.get("model") or {}).get("spec"), _name(cell)
            if isinstance(spec, str) and name not in suite and spec != f"{kind.prefix}{name}":
                specs.setdefault(name, spec)
        torch_version = (doc.get("environment") or {}).get("torch") or torch_version
        entries = reduce_kind_release(kind, doc)
        releases.append({"transformers": version, "models": sum(1 for by in entries.values()
                                                                if any(e["verdict"] != ABSENT for e in by.values())),
                         "cells": record.get("cells"), "wall_s": record.get("wall_s"), "cpu_s": record.get("child_cpu_s"),
                         **({"measured": record["finished"][:10]} if isinstance(record.get("finished"), str) else {}),
                         "packcheck_version": doc.get("packcheck_version")})
        for name, by_backend in entries.items():
            for backend, entry in by_backend.items():
                source = entry.pop("config", None)  # the config-fix table's source: once per model, not per entry
                if source:
                    configs.setdefault(name, source)
                cells.setdefault(name, {}).setdefault(backend, {})[version] = entry
    releases.sort(key=lambda r: version_key(r["transformers"]))
    measured = [r["transformers"] for r in releases]
    block = {"schema_version": KIND_SCHEMA_VERSION, "kind": kind.name, "packcheck_version": __version__,
             "generated": time.strftime("%Y-%m-%d", time.gmtime()), "device": "cpu", "dtype": "float32",
             "torch": torch_version, "models": list(kind.models), "backends": list(kind.backends),
             **({"all_architectures": True} if _every_architecture(kind, build, runs, committed, built) else {}),
             "checks": list(kind.checks), **({"side_checks": list(kind.side)} if kind.side else {}), "releases": releases,
             "missing": [v for v in (planned or []) if v not in measured], "cells": cells,
             **({"configs": dict(sorted(configs.items()))} if configs else {}),
             **({"specs": dict(sorted(specs.items()))} if specs else {}),
             # the collator's classification labels per release (tools/collator_labels.py): measured apart, kept
             **({"labels": committed["labels"]} if committed and committed.get("labels") else {})}
    block["transitions"] = transitions(block, bisects or {})
    return block


def _every_architecture(kind: Kind, build: Path, runs: list[tuple[str, dict[str, Any], dict[str, Any]]],
                        committed: dict[str, Any] | None, built: set[str]) -> bool:
    """Whether the block holds every architecture of each of its releases (what its ``all_architectures`` says): a
    kind over every architecture, each release run here with its list kept (:func:`release_architectures`) and
    every model of that list in its cells, and each release seeded from ``committed`` from a block that said so."""
    if not kind.all_architectures:
        return False
    seeded = [r for r in (committed or {}).get("releases", []) if r["transformers"] not in built]
    if seeded and not (committed or {}).get("all_architectures"):
        return False
    for version, doc, _ in runs:
        saved = Path(build) / ARCHITECTURES / f"{version}.json"
        if not saved.exists():
            return False
        have = {_name(c) for c in doc.get("cells", [])}
        if any(model_type_of(a) not in have for a in json.loads(saved.read_text())):
            return False
    return True


def block_bisects(block: dict[str, Any] | None) -> dict[str, Any]:
    """The placements a committed block carries (its transitions' ``bisected``), keyed as :func:`transitions` reads
    them, so a re-collect keeps them."""
    from .collect import transition_key

    return {transition_key(t): t["bisected"] for t in (block or {}).get("transitions", []) if t.get("bisected")}


def measure_between(kind: Kind, version: str, model_types: list[str], root: Path, log: Callable[[str], None] = print,
                    runner: Callable[..., Any] | None = None) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any] | None]:
    """:func:`.sweep.measure_between` for a block: ``model_types``' entries on ``version`` (a release between two
    measured ones), measured once under ``root/<version>/<digest of the models>/`` and reused after."""
    known = {model_type_of(s) for s in kind.models}  # an architecture beyond the suite's: spec_of
    specs = [s for s in kind.models if model_type_of(s) in model_types] + \
        [spec_of(kind, m) for m in sorted(model_types) if m not in known]
    sub = Path(root) / version / hashlib.sha1(",".join(specs).encode()).hexdigest()[:10]
    sub.mkdir(parents=True, exist_ok=True)
    record = run_kind_release(kind, version, sub, specs, log=log, runner=runner)
    if record.get("error"):
        return {}, record
    from ..results import load_document

    return reduce_kind_release(kind, load_document(sub / version / "packcheck-matrix.json")), record


def add_rows(kind: Kind, block: dict[str, Any], build: Path, log: Callable[[str], None] = print,
             measure: Callable[..., Any] | None = None) -> dict[str, Any]:
    """``block`` (unpacked, :func:`.kinds_render.unpack`) with each of ``kind``'s :attr:`Kind.rows` it lacks measured
    on every release it holds, the rest of the release kept: ``absent`` where the row's family is (no run), no entry
    where the family has none, else the row alone (:func:`measure_between`, under ``build/rows/<release>/``, reused after); the release's ``models`` count
    grows by the rows present, ``specs`` names each row's spec. A release whose run failed keeps no entry of the row
    (its transition, if any, is found between the releases measured). ``measure``: replaces :func:`measure_between`
    (tests)."""
    measure = measure or measure_between
    out = {**block, "cells": {k: {b: dict(r) for b, r in v.items()} for k, v in block["cells"].items()},
           "releases": [dict(r) for r in block["releases"]], "specs": dict(block.get("specs") or {})}
    for name, family, spec in kind.rows:
        rows = out["cells"].setdefault(name, {})
        for release in out["releases"]:
            version = release["transformers"]
            if any(version in rows.get(b, {}) for b in kind.backends):  # measured before
                continue
            fam = [e for b in kind.backends if (e := out["cells"].get(family, {}).get(b, {}).get(version)) is not None]
            if not fam:  # the family not measured there (not in that release's list): no entry
                continue
            if all(e.get("verdict") == ABSENT for e in fam):
                for backend in kind.backends:
                    rows.setdefault(backend, {})[version] = {"verdict": ABSENT, "causes": []}
                continue
            entries, record = measure(kind, version, [name], Path(build) / "rows", log=log)
            if record and record.get("error"):
                log(f"{kind.name} row {name} {version}: not measured ({str(record['error'])[:160]})")
                continue
            got = entries.get(name, {})
            for backend in kind.backends:
                if backend in got:
                    source = got[backend].pop("config", None)  # the config-fix table's source, once per model
                    if source:
                        out.setdefault("configs", {}).setdefault(name, source)
                    rows.setdefault(backend, {})[version] = got[backend]
            if any(e.get("verdict") != ABSENT for e in got.values()):
                release["models"] = int(release.get("models") or 0) + 1
        out["specs"][name] = spec
    return out


def add_side(kind: Kind, block: dict[str, Any], build: Path, log: Callable[[str], None] = print,
             runner: Callable[..., Any] | None = None) -> dict[str, Any]:
    """``block`` (unpacked) with ``kind``'s side checks (:attr:`Kind.side`) measured on every release it holds, for
    the suite's models (:attr:`Kind.models`) present there (an entry that is not ``absent``): one run per release of
    those models with the side checks alone (:func:`.release_run.run_release`, under ``build/side/<release>/``,
    reused after), its fields (:func:`_side_fields`) put on the release's entries, the verdicts untouched (eager's
    only where not sdpa's, as :func:`reduce_kind_release`). A release whose run failed keeps its entries as they were
    (logged). ``runner``: replaces ``subprocess.run`` (tests)."""
    from ..results import load_document

    out = {**block, "cells": {k: {b: dict(r) for b, r in v.items()} for k, v in block["cells"].items()}}
    for release in block["releases"]:
        version = release["transformers"]
        models = [s for s in kind.models if any(e.get("verdict") != ABSENT for e in
                                                (r.get(version) for r in out["cells"].get(model_type_of(s), {}).values()) if e)]
        if not models or not kind.side:
            continue
        sub = Path(build) / "side" / version / hashlib.sha1(",".join([*models, "|", *kind.side]).encode()).hexdigest()[:10]
        if not is_done(sub / version):
            sub.mkdir(parents=True, exist_ok=True)
            record = run_release(version, sub, log=log, runner=runner, reproduce=kind_reproduce(kind, version),
                                 flags=kind_flags(kind, str(sub / version), models, list(kind.side)), **env_extras(kind))
            if record.get("error"):
                log(f"{kind.name} side checks {version}: not measured ({str(record['error'])[:160]})")
                continue
        side = _side_fields(_rows_named(load_document(sub / version / "packcheck-matrix.json")), kind)
        for (name, backend), fields in side.items():
            entry = out["cells"].get(name, {}).get(backend, {}).get(version)
            if entry is None:
                continue
            mine = {f: got for f, got in fields.items()
                    if not (backend == "eager" and got == side.get((name, "sdpa"), {}).get(f)) and _adds(entry, got)}
            out["cells"][name][backend][version] = {**entry, **mine}  # a copy: unpack shares one entry along a run
    return out


def packed(block: dict[str, Any]) -> dict[str, Any]:
    """The block as ``support.json`` stores it (:func:`.kinds_render.pack`: runs of equal entries per row)."""
    from .kinds_render import pack

    return pack(block)


def carry_kinds(support: dict[str, Any], committed: dict[str, Any] | None) -> dict[str, Any]:
    """``support`` with the committed support.json's blocks (:data:`KINDS`) carried over where it lacks them: a
    re-render of the transformers axis keeps them (as the TRL block is kept)."""
    for name in KINDS:
        if name not in support and committed and isinstance(committed.get(name), dict):
            support[name] = committed[name]
    return support


def write_block(support_file: Path, block: dict[str, Any]) -> None:
    """Put ``block`` into ``support_file`` (as :func:`.render.write_outputs` writes it: compact, keys sorted)."""
    from ..results import atomic_write

    doc = json.loads(Path(support_file).read_text())
    doc[block["kind"]] = packed(block)
    atomic_write(Path(support_file), json.dumps(doc, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
