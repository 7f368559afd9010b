"""The stack elements through the trainers per release (issue 45, part 1): ``stack_trainers`` (checks/stack_trainers.py)
on a tiny llama on ``sdpa``, in the version environment of every minor of one library, the others held at this
environment's versions. Three axes (:data:`AXES`): TRL's minors (the releases the TRL axis measures), accelerate's
minors since its context-parallel hook exists (1.10), peft's minors since TRL's own peft floor (0.13).

Per release and element and trainer mode (Trainer + DataCollatorWithFlattening; SFTTrainer ``packing=True``;
SFTTrainer ``padding_free=True``) the block keeps what the trainer decided: built or refused (and the file:line that
raised), packing / padding_free ``kept`` / ``forced`` / ``dropped`` / ``off`` against what was asked
(:func:`~pytest_packcheck.checks.stack_trainers.settled`), position_ids in the collator's batch and reaching the
decoder, the cell's verdict and cause, and its numbers (gradients relative, logits max abs, loss nats); and per
release the file:line of that release that decides it (SFTTrainer's ``self.padding_free = ...``, peft's line that
drops position_ids). Consecutive releases with the same decision are one run ``[first, last, record]`` (numbers: the
run's largest), so a change of decision is a transition between two runs (:func:`transitions`).

Written as ``reports/atlas/stack.json`` (one block per axis, SCHEMA.md "Stack block") and rendered as
``reports/atlas/stack.md`` by ``tools/stack_releases.py``; the per-release runs are cached like the TRL axis's
(``<build>/<axis>/<version>/``, ``atlas-done.json``, resumable). Light: no torch / transformers import.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..results.schema import read_results
from .plan import DONE_MARKER, version_key
from .release_run import done_record, is_done, run_failure, run_plugin_in_env

#: ``stack.json``'s schema version (reports/atlas/SCHEMA.md, "Stack block").
STACK_SCHEMA_VERSION = 1
#: The committed file, beside trl.json.
STACK_FILE = "stack.json"
#: The model and backend every axis runs on (the check's cost per release stays a few seconds per element).
MODEL, BACKEND, CHECK = "arch:llama", "sdpa", "stack_trainers"


@dataclass(frozen=True)
class StackAxis:
    """One library's releases through the trainers: ``library`` (its ``==X`` is the environment's pin), ``since`` (its
    oldest minor), ``elements`` (model/stack.py names run per release), ``pins`` (libraries pinned at this
    environment's version in every release's environment, so only ``library`` changes), ``why``: why these releases;
    ``needles``: ``(key, file, text)`` read from each release's installed file (:func:`source_lines`) where the
    deciding line is the library's own and not one the check records (accelerate's hook)."""

    library: str
    since: str
    elements: tuple[str, ...]
    pins: tuple[str, ...]
    why: str
    needles: tuple[tuple[str, str, str], ...] = ()


#: The axes, by library.
AXES: dict[str, StackAxis] = {
    "trl": StackAxis("trl", "0.19", ("lora", "prompt_tuning", "cp"), ("peft",),
                     "the TRL axis's minors (0.19 introduced packing_strategy; packcheck's TRL floor)"),
    "accelerate": StackAxis("accelerate", "1.10", ("cp",), ("trl", "peft"),
                            "accelerate's minors since its context-parallel hook (_attach_context_parallel_hooks, 1.10.0)",
                            (("hook_at", "accelerate/big_modeling.py", 'module_kwargs["is_causal"] = True'),)),
    "peft": StackAxis("peft", "0.13", ("lora", "dora", "prompt_tuning", "prefix_tuning"), ("trl",),
                      "peft's minors since TRL's own peft floor (trl[peft]: peft>=0.13.0)"),
}
#: The decision fields of an entry: a change in any of them is a transition (numbers and lines are not).
DECISION_KEYS = ("status", "decision", "settled", "position_ids_in_batch", "position_ids_to_model", "cause", "raised")
#: The numbers kept per run (the run's largest).
NUMBER_KEYS = ("grad_rel_err", "logits_max_abs_diff", "loss_delta")
#: The file:line keys of a mode's entry, and what each says in stack.md.
LINE_KEYS = {"decided_at": "padding_free decided at", "position_ids_dropped_at": "position_ids dropped at",
             "raised_at": "raised at", "hook_at": "the CP hook sets is_causal=True (dropping attention_mask) at"}


def axis_flags(axis: StackAxis, report_dir: str) -> list[str]:
    """The ``--packcheck-*`` flags of one release's run: llama, sdpa, ``stack_trainers``, the axis's elements."""
    from ..config.options import OPT_BACKENDS, OPT_CHECKS, OPT_MODELS, OPT_REPORT_DIR, OPT_RESUME, OPT_STACK

    return [f"{OPT_MODELS}={MODEL}", f"{OPT_BACKENDS}={BACKEND}", f"{OPT_CHECKS}={CHECK}",
            f"{OPT_STACK}={','.join(axis.elements)}", f"{OPT_REPORT_DIR}={report_dir}", OPT_RESUME]


def combo_of(axis: StackAxis, version: str, installed: Callable[[str], str] | None = None) -> Any:
    """The release's :class:`~pytest_packcheck.versions.envs.VersionCombo`: ``library==version`` and each pin at
    the version installed here (``installed``: replaces ``importlib.metadata.version``, tests)."""
    from importlib import metadata

    from ..versions.envs import VersionCombo

    have = installed or metadata.version
    return VersionCombo((f"{axis.library}=={version}", *(f"{p}=={have(p)}" for p in axis.pins)))


def reproduce(axis: StackAxis, version: str) -> str:
    """The command that measures one release of ``axis`` again."""
    import shlex

    combo = combo_of(axis, version)
    return shlex.join(["packcheck", "audit", "--versions", " & ".join(combo.requirements),
                       *axis_flags(axis, "packcheck-report")[:-2]])


def run_release(axis: StackAxis, version: str, build: Path, log: Callable[[str], None] = print,
                runner: Callable[..., Any] | None = None, ensure: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Measure ``version`` of ``axis`` into ``<build>/<library>/<version>`` (made or found cached as every version
    environment is; the run resumes its journal): the done record (``versions`` the environment resolved,
    ``cells``, ``wall_s``, ``env_seconds``), or a record with ``error`` (uv's reason, or the run's last lines).
    ``runner`` / ``ensure``: replace ``subprocess.run`` / ``ensure_env`` (tests)."""
    from ..versions.envs import EnvError, ensure_env

    folder = (Path(build) / axis.library / version).resolve()
    if is_done(folder):
        return done_record(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    combo = combo_of(axis, version)
    try:
        env = (ensure or ensure_env)(combo)
    except EnvError as exc:
        record = {axis.library: version, "error": str(exc), "wall_s": round(time.perf_counter() - t0, 1)}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"stack {axis.library} {version}: no environment: {exc}")
        return record
    proc = run_plugin_in_env(env.python, combo.label, folder, axis_flags(axis, str(folder)), reproduce(axis, version), runner)
    wall = round(time.perf_counter() - t0, 1)
    failure = run_failure(folder, proc.returncode)
    if failure:
        record = {axis.library: version, "error": failure, "wall_s": wall}
        (folder / "atlas-error.json").write_text(json.dumps(record, indent=1) + "\n")
        log(f"stack {axis.library} {version}: no complete results (exit {proc.returncode})")
        return record
    doc = read_results(folder / "packcheck-matrix.json")
    record = {axis.library: env.versions.get(axis.library, version), "requested": version, "versions": dict(env.versions),
              "cells": len(doc.get("cells", [])), "wall_s": wall, "env_seconds": env.seconds, "env_created": env.created}
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    (folder / "atlas-error.json").unlink(missing_ok=True)
    log(f"stack {axis.library} {version}: {record['cells']} cells, {wall:.0f} s wall "
        f"(environment {'made' if env.created else 'cached'} {env.seconds:.0f} s)")
    return record


# ----------------------------------------------------------------------------------------------------------------
# Reduction


def check_stack_version(axis: StackAxis, version: str, doc: dict[str, Any], where: str) -> None:
    """Each cell's ``metrics.stack`` records the version of the element's library it ran with (peft for the adapters,
    accelerate for ``cp``): where that library is the axis's, it must be ``version``.

    Raises:
        PackcheckUsageError: a cell ran another release (the environment picked up another copy of the library, or
            the results were copied into another release's folder): names ``where``, the cell, both versions, the fix.
    """
    from packaging.version import Version

    from ..errors import PackcheckUsageError

    for cell in doc.get("cells", []):
        got = ((cell.get("metrics") or {}).get("stack") or {}).get(axis.library)
        if got is not None and Version(str(got)) != Version(version):
            raise PackcheckUsageError(
                f"{where}: cell {cell.get('cell_id')} ran {axis.library} {got}, not {version} (the release this run is "
                f"filed under): delete the release folder and measure it again (tools/stack_releases.py --axis "
                f"{axis.library} --releases {version}); if it records {got} again, the environment imports another "
                f"{axis.library} than its own.")


def reduce_release(doc: dict[str, Any]) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, str]]:
    """One release's results -> ``({element: {mode: entry}}, lines)``: each entry the :data:`DECISION_KEYS` and
    :data:`NUMBER_KEYS` of the mode (a skipped / errored cell: its status and message under every mode it would
    have run, ``"*"``), and ``lines`` the release's file:line per :data:`LINE_KEYS` (several joined with ", ")."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    lines: dict[str, set[str]] = {}
    for cell in doc.get("cells", []):
        if cell.get("check") != CHECK or cell.get("backend") != BACKEND:
            continue
        element = cell.get("stack") or ((cell.get("metrics") or {}).get("stack") or {}).get("element")
        modes = (cell.get("metrics") or {}).get("modes")
        if not element:
            continue
        if not modes:
            why = re.sub(r"\s*\((?:~|/)\S*(?:\)|$)", "", " ".join(str(cell.get("message") or "").split()))
            rows[element] = {"*": {"status": cell.get("status"), "why": why[:160]}}  # paths (the release's env) cut
            continue
        for mode, m in modes.items():
            entry: dict[str, Any] = {k: m[k] for k in DECISION_KEYS if k in m}
            if "raised" in entry:
                entry["raised"] = entry["raised"].split(":")[0]  # the exception type; the message changes by release
            entry.update({k: m[k] for k in NUMBER_KEYS if isinstance(m.get(k), int | float)})
            rows.setdefault(element, {})[mode] = entry
            for key in LINE_KEYS:
                if m.get(key):
                    lines.setdefault(key, set()).add(str(m[key]))
    return rows, {k: ", ".join(sorted(v)) for k, v in lines.items()}


def source_lines(axis: StackAxis, site: Path) -> dict[str, str]:
    """``{key: "<file>:<line>"}`` of each of ``axis.needles`` in a release environment's ``site`` (its site-packages):
    the first line of the file that contains the text; a key is absent when the file or the text is not there."""
    out = {}
    for key, rel, needle in axis.needles:
        try:
            text = (Path(site) / rel).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        line = next((i for i, t in enumerate(text, 1) if needle in t), None)
        if line:
            out[key] = f"{rel}:{line}"
    return out


def _decision(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in NUMBER_KEYS}


def stack_block(axis: StackAxis, reduced: dict[str, tuple[dict[str, Any], dict[str, str]]],
                records: dict[str, dict[str, Any]] | None = None, missing: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Releases -> :func:`reduce_release` output (and their done records: cost and versions) -> the axis's block:
    ``library``, ``elements``, ``releases`` (ascending), ``rows[element][mode]`` = runs ``[first, last, record]`` of
    consecutive releases with the same decision (numbers: the run's largest), ``lines[version]`` (the release's
    file:line per :data:`LINE_KEYS`), ``cost`` (per release: ``wall_s`` of the run, ``env_seconds``, ``cells_s``: the
    cells' own seconds, what the check costs without the interpreter's start and imports) and
    ``held`` (the other libraries' versions, from the newest release's environment); ``missing``: releases of the plan
    not measured (a run spans measured releases only: a release between two of its releases that is missing here was
    not measured, so the run says nothing about it)."""
    order = sorted(reduced, key=version_key)
    rows: dict[str, dict[str, list[list[Any]]]] = {}
    for version in order:
        for element, modes in reduced[version][0].items():
            for mode, entry in modes.items():
                runs = rows.setdefault(element, {}).setdefault(mode, [])
                if runs and _decision(runs[-1][2]) == _decision(entry) and runs[-1][1] == _previous(order, version):
                    runs[-1][1] = version
                    for k in NUMBER_KEYS:
                        if k in entry:
                            runs[-1][2][k] = max(runs[-1][2].get(k, entry[k]), entry[k])
                else:
                    runs.append([version, version, dict(entry)])
    records = records or {}
    newest = (records.get(order[-1]) or {}).get("versions") or {} if order else {}
    return {"library": axis.library, "why": axis.why, "elements": list(axis.elements), "model": MODEL, "backend": BACKEND,
            "releases": order, "rows": rows, "lines": {v: reduced[v][1] for v in order},
            "cost": {v: {k: records[v][k] for k in ("wall_s", "env_seconds", "cells_s") if k in records[v]}
                     for v in order if v in records},
            "held": {k: v for k, v in sorted(newest.items()) if k != axis.library},
            "missing": sorted(missing, key=version_key)}


def _previous(order: list[str], version: str) -> str | None:
    i = order.index(version)
    return order[i - 1] if i else None


def transitions(block: dict[str, Any]) -> list[str]:
    """Every change of decision along the axis, named: ``prompt_tuning / sft_packing: 0.22.2 -> 0.23.1:
    position_ids_in_batch False -> True``."""
    out = []
    for element, modes in sorted(block.get("rows", {}).items()):
        for mode, runs in sorted(modes.items()):
            for (_, last, a), (first, _, b) in itertools.pairwise(runs):
                da, db = _decision(a), _decision(b)
                changed = [f"{k} {_show(da.get(k))} -> {_show(db.get(k))}" for k in dict.fromkeys([*da, *db])
                           if da.get(k) != db.get(k)]
                if not changed:  # the same decision on both sides of releases where the cell did not run ("*" rows)
                    continue
                out.append(f"{element} / {mode}: {last} -> {first}: {'; '.join(changed)}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return "—" if value is None else str(value)


def describe(entry: dict[str, Any]) -> str:
    """One run's record in words: ``accepted; padding_free forced; position_ids batch ✓ model ✗; fail
    (adapter_positions): grads 6.3e-01, logits 1.8e-01``."""
    if "why" in entry:
        return f"{entry.get('status')}: {entry['why']}"
    raised = f" ({entry['raised']})" if entry.get("raised") else ""
    parts = [str(entry.get("decision", "?")) + (raised if entry.get("status") != "raises" else "")]
    parts += [f"{k} {v}" for k, v in (entry.get("settled") or {}).items()]
    if "position_ids_in_batch" in entry:
        to_model = entry.get("position_ids_to_model")
        parts.append(f"position_ids batch {'✓' if entry['position_ids_in_batch'] else '✗'} model "
                     f"{'?' if to_model is None else '✓' if to_model else '✗'}")
    verdict = "training step raises" + raised if entry.get("status") == "raises" else str(entry.get("status"))
    if entry.get("cause"):
        verdict += f" ({entry['cause']})"
    nums = [f"{label} {entry[k]:.1e}" for k, label in (("grad_rel_err", "grads"), ("logits_max_abs_diff", "logits"),
                                                         ("loss_delta", "loss")) if k in entry]
    return "; ".join(parts) + f"; {verdict}" + (f": {', '.join(nums)}" if nums else "")


def markdown(doc: dict[str, Any]) -> str:
    """``stack.md``: per axis, per element and mode, one row per run of releases, then the transitions and the
    file:line of each release."""
    out = ["# Stack elements through the trainers, per release", "",
           ("Generated by `tools/stack_releases.py` from `stack.json` (do not edit). Check `stack_trainers` "
           f"(`checks/stack_trainers.py`) on `{MODEL}`, `{BACKEND}`, float32, CPU, in each release's version "
           "environment: per element and trainer mode (Trainer + DataCollatorWithFlattening; SFTTrainer packing=True; "
           "SFTTrainer padding_free=True) what the trainer decided (accepted or refused; packing / padding_free "
           "kept, forced, dropped or off against what was asked; position_ids in the collator's batch and reaching "
           "the decoder) and one training step against each example alone (gradients relative, logits max abs, "
           "loss nats: the run's largest).")]
    for name, block in doc.get("axes", {}).items():
        order = block.get("releases") or []
        cost = sorted(c.get("wall_s", 0.0) for c in (block.get("cost") or {}).values())
        cells = sorted(c["cells_s"] for c in (block.get("cost") or {}).values() if "cells_s" in c)
        held = ", ".join(f"{k} {v}" for k, v in (block.get("held") or {}).items())
        out += ["", f"## {name} ({len(order)} releases: {order[0] if order else '—'} .. {order[-1] if order else '—'})", "",
                f"{block.get('why', '')}; elements {', '.join(block.get('elements', []))}; held: {held or '—'}. "
                + (f"Per release {cost[0]:.0f}-{cost[-1]:.0f} s wall (median {cost[len(cost) // 2]:.0f} s; the machine's "
                   "load is not recorded)" if cost else "")
                + (f", of which the cells {cells[0]:.0f}-{cells[-1]:.0f} s (median {cells[len(cells) // 2]:.0f} s)"
                   if cells else "") + ".", "",
                "| element | mode | releases | decision and verdict |", "|---|---|---|---|"]
        for element, modes in sorted(block.get("rows", {}).items()):  # sorted: stack.json is written with sorted keys
            for mode, runs in sorted(modes.items()):
                for first, last, record in runs:
                    span = first if first == last else f"{first} .. {last}"
                    out.append(f"| {element} | {mode} | {span} | {describe(record)} |")
        if block.get("missing"):
            out += ["", (f"Not measured yet: {', '.join(block['missing'])} (`python tools/stack_releases.py --axis {name}` "
                         "measures them; a run of releases above spans only the releases measured, none of these).")]
        moves = transitions(block)
        out += ["", "Transitions: none (every release decides alike)." if not moves else "Transitions:", ""]
        out += [f"- {t}" for t in moves]
        out += ["", "The lines that decide, per release:", ""]
        previous: dict[str, str] | None = None
        for version in order:
            lines = (block.get("lines") or {}).get(version) or {}
            if lines != previous:
                out.append(f"- {version}: " + ("; ".join(f"{LINE_KEYS.get(k, k)} `{v}`" for k, v in sorted(lines.items()))
                                               or "—"))
            previous = lines
    return "\n".join(out) + "\n"


def write(atlas_dir: Path, name: str, block: dict[str, Any]) -> None:
    """Put ``block`` as axis ``name`` into ``<atlas_dir>/stack.json`` (read right before writing; the other axes
    kept) and write ``stack.md`` from it."""
    path = Path(atlas_dir) / STACK_FILE
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc = {"schema_version": STACK_SCHEMA_VERSION, "axes": {**doc.get("axes", {}), name: block}}
    path.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")  # compact: reports/ has a byte budget
    (Path(atlas_dir) / "stack.md").write_text(markdown(doc))
