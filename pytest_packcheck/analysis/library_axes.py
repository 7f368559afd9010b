"""The library axes of the atlas beside transformers and TRL's SFTTrainer: the RL trainers' own packing code per release
(verl, OpenRLHF, ms-swift, unsloth: ``reports/atlas/rl_peers.json``) and the stack elements through the trainers per release of
peft, accelerate and TRL (``reports/atlas/stack.json``), carried into ``support.json["axes"]`` (SCHEMA.md, "Library
axes block") so that ``packcheck lookup ... --verl 0.9.1`` / ``--peft 0.18.1 --stack prompt_tuning`` answers them.

One table (:data:`LIBRARY_AXES`) describes every axis: its lookup flag, its source file and key there, its check and
key number. :func:`axes_block` builds the block from the source files (the atlas's writer calls it on every render,
:func:`pytest_packcheck.atlas.render.write_outputs`); :func:`axis_answer` answers one (library, release, element) from
it. Light: json and packaging only, no torch / transformers import (``packcheck lookup``'s start-up, issue 47).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ``support.json["axes"]``'s own schema version (SCHEMA.md); bumped on a change that removes or re-types a field.
AXES_SCHEMA_VERSION = 1


from .axis_table import LIBRARY_AXES, LibraryAxis  # the one table of the axes (LibraryAxis re-exported)

#: The element name of an RL trainer's axis (it has one path, no ``--stack``).
RL_ELEMENT = "packed_path"
#: The key number of each RL trainer cell (the check's ``key_metric``, checks/registry.py).
RL_NUMBERS = {"rl_verl_rmpad": "max_abs_logprob_diff", "rl_openrlhf_packed": "max_abs_logprob_diff",
              "rl_swift_padding_free": "max_abs_margin_diff", "rl_unsloth_grpo_packed": "max_abs_logprob_diff"}
#: What each file:line of ``lines`` says, as lookup prints it (stack_axis.LINE_KEYS's words; the RL trainers' anchor).
LINE_NAMES = {"anchor": "packed path at", "declared": "declares", "decided_at": "padding_free decided at",
              "position_ids_dropped_at": "position_ids dropped at", "raised_at": "raised at",
              "hook_at": "the CP hook sets is_causal=True at", "verifier": "its verifier at"}
#: A stack run record's fields kept in an entry (numbers: the run's largest; stack_axis.NUMBER_KEYS).
STACK_KEYS = ("decision", "settled", "position_ids_in_batch", "position_ids_to_model", "raised", "grad_rel_err",
              "logits_max_abs_diff", "loss_delta")


def _version(text: str) -> Any:
    from packaging.version import Version

    return Version(text)


def _runs(values: list[tuple[str, dict[str, Any]]]) -> list[list[Any]]:
    """``[first, last, entry]`` over consecutive releases whose entries are equal."""
    runs: list[list[Any]] = []
    for release, entry in values:
        if runs and runs[-1][2] == entry:
            runs[-1][1] = release
        else:
            runs.append([release, release, entry])
    return runs


def _cut(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + "…"


def _rl_axis(axis: LibraryAxis, doc: dict[str, Any]) -> dict[str, Any] | None:
    """An RL trainer's axis from ``rl_peers.json``: per release the anchor (file:line of the packed path in that
    release's wheel) and what it declares; per (family, backend) runs of entries (``verdict``, ``causes``, ``number``:
    the check's key number in nats, 3 significant digits; ``message`` on a non-pass, at most 160 characters)."""
    records = doc.get("trainers", {}).get(axis.key)
    if not isinstance(records, list) or not records:
        return None
    families, backends = list(doc.get("families") or []), list(doc.get("backends") or [])
    stacks = [r.get("stack") or {} for r in records]
    held = max(stacks, key=stacks.count) if stacks else {}
    releases, lines, versions, values = [], {}, {}, {}
    for r in records:
        release = r["version"]
        releases.append(release)
        path = r.get("path") or {}
        lines[release] = {k: v for k, v in (("anchor", path.get("anchor")), ("declared", path.get("declared")),
                                            ("verifier", path.get("verifier"))) if v}  # verifier: unsloth's thresholds
        if (r.get("stack") or {}) != held:
            versions[release] = r.get("stack") or {}
        cells = r.get("cells") or []
        by_key = {(c.get("model"), c.get("backend")): c for c in cells}
        for family in families:
            for backend in backends:
                cell = by_key.get((family, backend))
                if cell is None:  # the release has no such path (verl 0.1): named once per release
                    entry = {"verdict": "skipped", "message": _cut(r.get("skip") or f"{axis.library} {release}: not run")}
                else:
                    text = cell.get("message") if "message" in cell else (
                        cells[cell["message_from"]].get("message", "") if isinstance(cell.get("message_from"), int) else "")
                    entry = {"verdict": cell.get("status"), "causes": [cell["cause"]] if cell.get("cause") else []}
                    value = (cell.get("metrics") or {}).get(RL_NUMBERS.get(axis.check, ""))
                    if cell.get("status") in ("pass", "fail") and isinstance(value, int | float) and not isinstance(value, bool):
                        entry["number"] = float(f"{value:.3g}")
                    if cell.get("status") != "pass" and text:
                        entry["message"] = _cut(text)
                values.setdefault((family, backend), []).append((release, entry))
    rows = [{"element": RL_ELEMENT, "model_type": f, "backend": b, "mode": None, "runs": _runs(values[(f, b)])}
            for f, b in sorted(values)]
    return {"kind": axis.kind, "source": f"reports/atlas/{axis.source}", "check": axis.check, "number": axis.number,
            "elements": [RL_ELEMENT], "families": families, "backends": backends, "releases": releases, "held": held,
            "versions": versions, "lines": lines, "rows": rows, "reproduce": axis.reproduce,
            "measured": doc.get("measured")}


def _stack_axis(axis: LibraryAxis, doc: dict[str, Any]) -> dict[str, Any] | None:
    """A stack axis from ``stack.json``: its runs as recorded (``status`` as ``verdict``, ``cause`` as ``causes``,
    ``logits_max_abs_diff`` as ``number``, the decision fields kept), per (element, mode); a cell that did not run
    (mode ``*``) is filed under every mode with its ``why``."""
    block = doc.get("axes", {}).get(axis.key)
    if not isinstance(block, dict) or not block.get("releases"):
        return None
    rows = []
    for element in block.get("elements", []):
        by_mode = block.get("rows", {}).get(element, {})
        modes = sorted(m for m in by_mode if m != "*")
        for mode in modes:
            runs = [*by_mode.get(mode, []), *by_mode.get("*", [])]
            runs.sort(key=lambda run: _version(run[0]))
            out = []
            for first, last, record in runs:
                entry: dict[str, Any] = {"verdict": record.get("status"),
                                         "causes": [record["cause"]] if record.get("cause") else []}
                if record.get("logits_max_abs_diff") is not None:
                    entry["number"] = float(f"{record['logits_max_abs_diff']:.3g}")
                entry.update({k: (float(f"{record[k]:.3g}") if isinstance(record[k], float) else record[k])
                              for k in STACK_KEYS if k in record and k != "logits_max_abs_diff"})
                if record.get("why"):
                    entry["message"] = _cut(record["why"])
                out.append([first, last, entry])
            rows.append({"element": element, "model_type": block.get("model", "arch:llama").split(":")[-1],
                         "backend": block.get("backend", "sdpa"), "mode": mode, "runs": out})
    return {"kind": axis.kind, "source": f"reports/atlas/{axis.source}", "check": axis.check, "number": axis.number,
            "elements": list(block.get("elements", [])), "families": [block.get("model", "arch:llama").split(":")[-1]],
            "backends": [block.get("backend", "sdpa")], "releases": list(block["releases"]), "held": block.get("held", {}),
            "versions": {}, "lines": block.get("lines", {}), "rows": rows, "reproduce": axis.reproduce,
            "why": block.get("why")}


def axes_block(atlas_dir: str | Path) -> dict[str, Any] | None:
    """``support.json["axes"]`` from the committed ``rl_peers.json`` and ``stack.json`` in ``atlas_dir``, one axis per
    :data:`LIBRARY_AXES` entry whose source holds it; None when neither file is there (the caller keeps the block it
    has)."""
    import json

    docs = {}
    for name in {a.source for a in LIBRARY_AXES.values()}:
        path = Path(atlas_dir) / name
        if path.is_file():
            docs[name] = json.loads(path.read_text(encoding="utf-8"))
    if not docs:
        return None
    axes = {}
    for library, axis in LIBRARY_AXES.items():
        doc = docs.get(axis.source)
        built = (_rl_axis if axis.kind == "rl_trainer" else _stack_axis)(axis, doc) if doc else None
        if built:
            axes[library] = built
    return {"schema_version": AXES_SCHEMA_VERSION, "axes": axes}


def attach_axes(support: dict[str, Any], atlas_dir: str | Path) -> dict[str, Any]:
    """``support`` with ``axes`` rebuilt from the source files in ``atlas_dir`` (:func:`axes_block`); unchanged where
    there are none (a support file rendered elsewhere keeps the block it carries)."""
    block = axes_block(atlas_dir)
    if block is not None:
        support["axes"] = block
    return support


# ----------------------------------------------------------------------------------------------------------------
# The answer


def validate_axes(block: Any) -> str:
    """Why ``support.json["axes"]`` cannot be read ("" when it can): the shape :func:`axis_answer` indexes."""
    from ..results.schema import STATUSES

    if not isinstance(block, dict) or not isinstance(block.get("axes"), dict):
        return "'axes' is not an object with an 'axes' object"
    for library, axis in block["axes"].items():
        if not (isinstance(axis, dict) and isinstance(axis.get("releases"), list) and isinstance(axis.get("rows"), list)):
            return f"axes.{library} has no 'releases' / 'rows' list"
        for row in axis["rows"]:
            for run in row.get("runs") if isinstance(row, dict) and isinstance(row.get("runs"), list) else [None]:
                if not (isinstance(run, list) and len(run) == 3 and isinstance(run[2], dict)
                        and run[2].get("verdict") in STATUSES + ("refused", "raises", "not_checked")):
                    return f"axes.{library}: a run {run!r:.80} is not [first, last, entry] with a verdict"
    return ""


def _at(runs: list[list[Any]], order: list[str], release: str) -> dict[str, Any] | None:
    """The entry of the run holding ``release`` (``order``: the axis's measured releases)."""
    if release not in order:
        return None
    i = order.index(release)
    for first, last, entry in runs:
        if first in order and last in order and order.index(first) <= i <= order.index(last):
            return entry
    return None


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("verdict") == b.get("verdict") and list(a.get("causes") or []) == list(b.get("causes") or [])


def axis_answer(doc: Any, library: str, release: str, model_type: str, backend: str, element: str | None = None) -> dict[str, Any]:
    """The answer of axis ``library`` (:data:`LIBRARY_AXES`) at ``release`` for ``model_type`` on ``backend`` (the
    measured column), ``element``: a stack element (None: every element of the axis). A dict: ``library``,
    ``release``, ``outside`` (the release lies outside the measured range: ``line`` says so in one line, naming the
    range), ``measured``, ``answers`` (one per row asked: ``element``, ``mode``, ``model_type``, ``backend``,
    ``verdict``, ``causes``, ``number``, ``entry``, ``measured_at``; not measured: ``nearest``, the releases below /
    above with their verdicts, and ``placement``: where the change lies), ``lines`` (the file:line of that release
    that decides), ``versions`` (what the release ran with), ``reproduce``, ``notes``.

    Raises:
        PackcheckUsageError: ``release`` is not a version; ``element`` is not one of the axis's elements.
    """
    from packaging.version import InvalidVersion, Version

    from ..errors import PackcheckUsageError, closest

    spec = LIBRARY_AXES[library]
    try:
        wanted = Version(release)
    except InvalidVersion:
        raise PackcheckUsageError(f"{library} version '{release}' (--{library}) is not a version: write a release such as "
                                  f"{'0.9.1' if spec.kind == 'rl_trainer' else '0.18.1'}.") from None
    out: dict[str, Any] = {"library": library, "release": release, "outside": False, "measured": False, "answers": [],
                           "lines": {}, "versions": {}, "reproduce": "", "notes": [], "line": "", "number_name": spec.number}
    block = doc.get("axes") if hasattr(doc, "get") else None
    axis = (block or {}).get("axes", {}).get(library) if isinstance(block, dict) else None
    if axis is None:
        out["notes"].append(f"{library}: this support file has no {library} axis (support.json 'axes', from "
                            f"reports/atlas/{spec.source})")
        out["line"] = out["notes"][0]
        out["outside"] = True
        return out
    if element is not None and element not in axis["elements"]:
        raise PackcheckUsageError(f"--stack {element!r} is not an element of the {library} axis: it measures "
                                  f"{', '.join(axis['elements'])}.{closest(element, axis['elements'])}")
    order = sorted(axis["releases"], key=Version)
    low, high = order[0], order[-1]
    if wanted < Version(low) or wanted > Version(high):
        out["outside"] = True
        out["line"] = (f"{library} {release} is outside the measured range of the {library} axis ({low} .. {high}, "
                       f"{len(order)} releases, {axis['source']}): not measured")
        return out
    key = next((v for v in order if Version(v) == wanted), None)
    family = model_type if model_type in axis["families"] else axis["families"][0]
    if family != model_type:
        out["notes"].append(f"the {library} axis measures {', '.join(axis['families'])}, not {model_type}: answered from "
                            f"{family} (the trainer's code path, on {family}'s tiny model)")
    column = backend if backend in axis["backends"] else axis["backends"][0]
    if column != backend:
        out["notes"].append(f"the {library} axis runs {', '.join(axis['backends'])}, not {backend}: answered from {column}")
    elements = [element] if element else list(axis["elements"])
    for row in axis["rows"]:
        if row["element"] not in elements or row["model_type"] != family or row["backend"] != column:
            continue
        base = {"element": row["element"], "mode": row.get("mode"), "model_type": family, "backend": column}
        entry = _at(row["runs"], order, key) if key else None
        if entry is not None:
            out["answers"].append({**base, "measured_at": key, "verdict": entry.get("verdict"),
                                   "causes": list(entry.get("causes") or []), "number": entry.get("number"), "entry": entry})
            continue
        below = [v for v in order if Version(v) < wanted]
        above = [v for v in order if Version(v) > wanted]
        near = [(v, side, _at(row["runs"], order, v)) for v, side in ((below[-1] if below else None, "below"),
                                                                    (above[0] if above else None, "above")) if v]
        nearest = [{"release": v, "side": side, "verdict": e.get("verdict"), "causes": list(e.get("causes") or []),
                    "number": e.get("number")} for v, side, e in near if e is not None]
        if len(nearest) == 2 and _same(nearest[0], nearest[1]):
            placement = (f"both neighbours agree ({nearest[0]['verdict']}); the axis records no change between "
                         f"{nearest[0]['release']} and {nearest[1]['release']}")
        elif len(nearest) == 2 and any(n["verdict"] not in ("pass", "fail") for n in nearest):
            unjudged = next(n for n in nearest if n["verdict"] not in ("pass", "fail"))
            placement = (f"{unjudged['release']} was not judged ({unjudged['verdict']}): nothing places {release} between "
                         f"{nearest[0]['release']} and {nearest[1]['release']}")
        elif len(nearest) == 2:
            placement = (f"the verdict changes between {nearest[0]['release']} and {nearest[1]['release']}: {release} is on "
                         "one side of it; not bisected (the axis measures each minor's latest patch)")
        else:
            placement = ""
        out["answers"].append({**base, "measured_at": None, "verdict": None, "causes": [], "number": None,
                               "nearest": nearest, "placement": placement})
    out["measured"] = bool(out["answers"]) and all(a["measured_at"] for a in out["answers"])
    if key:
        out["lines"] = dict(axis.get("lines", {}).get(key) or {})
        out["versions"] = {library: key, **{k: v for k, v in (axis.get("versions", {}).get(key) or axis.get("held") or {}).items()
                                            if k != library}}
        out["reproduce"] = axis.get("reproduce", "").format(release=key)
    return out


def _entry_text(a: dict[str, Any]) -> str:
    why = f" [{', '.join(a['causes'])}]" if a.get("causes") else ""
    entry = a.get("entry") or {}
    nums = []
    if a.get("number") is not None:
        nums.append(f"{a.get('number_name', 'Δ').split(' (')[0]} {a['number']:.1e}")
    if entry.get("loss_delta") is not None:
        nums.append(f"loss Δ {entry['loss_delta']:.1e} nats")
    num = f" ({', '.join(nums)})" if nums else ""
    settled = entry.get("settled")
    how = ""
    if settled or entry.get("decision"):
        how = f"; {entry.get('decision', '')}" + (", " + ", ".join(f"{k} {v}" for k, v in settled.items()) if settled else "")
        if entry.get("position_ids_to_model") is False and entry.get("verdict") in ("pass", "fail"):
            how += ", position_ids never reach the decoder"
    msg = f": {entry['message']}" if entry.get("message") and entry.get("verdict") not in ("pass", "fail") else ""
    if entry.get("message") and entry.get("verdict") == "fail" and not a.get("causes"):
        msg = f": {entry['message']}"
    return f"{a['verdict']}{why}{num}{how}{msg}"


def axis_answer_lines(answer: dict[str, Any], model_type: str, attn_implementation: str) -> list[str]:
    """:func:`axis_answer` as the lines ``packcheck lookup`` prints (the one line when the release is outside)."""
    if answer["outside"]:
        return [answer["line"]]
    library, release = answer["library"], answer["release"]
    lines = []
    for a in answer["answers"]:
        what = a["element"] if a["element"] != RL_ELEMENT else "packed path"
        head = f"{model_type} / {attn_implementation} @ {library} {release} / {what}" + (f" / {a['mode']}" if a.get("mode") else "")
        if a["measured_at"]:
            lines.append(f"{head}: {_entry_text({**a, 'number_name': answer['number_name']})}, measured at {library} "
                         f"{a['measured_at']} on {a['model_type']} / {a['backend']}")
        else:
            near = "; ".join(f"{n['release']}: {n['verdict']}" + (f" [{', '.join(n['causes'])}]" if n["causes"] else "")
                             for n in a.get("nearest", []))
            lines.append(f"{head}: not measured (nearest measured: {near})" + (f"; {a['placement']}" if a.get("placement") else ""))
    if answer["lines"]:
        lines.append(f"  file:line ({library} {release}): " + "; ".join(f"{LINE_NAMES.get(k, k)} {v}"
                                                                         for k, v in answer["lines"].items()))
    if answer["versions"]:
        lines.append(f"  versions: {', '.join(f'{k} {v}' for k, v in answer['versions'].items())} "
                     f"(key number: {answer['number_name']})")
    lines += [f"  {n}" for n in answer["notes"]]
    if answer["reproduce"]:
        lines.append(f"  reproduce (the {library} {release} answer): {answer['reproduce']}")
    return lines


def answer_axes(doc: Any, model_answer: Any, backend: str, libraries: dict[str, str] | None, stack: str | None,
                trl_version: str | None) -> Any:
    """:func:`pytest_packcheck.support.lookup` with library axes asked: ``model_answer(doc)`` (the model's answer) with
    ``axes`` set to one :func:`axis_answer` per axis :func:`_asked_axes` finds, on ``backend`` (the measured column).

    Raises:
        PackcheckUsageError: as :func:`_asked_axes` and :func:`axis_answer`.
    """
    import dataclasses

    asked = _asked_axes(libraries, stack, trl_version)
    answer = model_answer(doc)
    return dataclasses.replace(answer, axes=[axis_answer(doc, library, release, answer.model_type, backend, element)
                                             for library, release, element in asked])


def _asked_axes(libraries: dict[str, str] | None, stack: str | None, trl_version: str | None) -> list[tuple[str, str, str | None]]:
    """(library, release, stack element or None) per library axis asked: each of ``libraries``, and TRL's stack axis
    when ``stack`` is given with ``trl_version``; ``stack`` applies to the stack axes only.

    Raises:
        PackcheckUsageError: a library no axis measures; a release that is not a string; ``stack`` with no stack axis
            asked.
    """
    from ..errors import PackcheckUsageError

    asked = []
    for library, release in (libraries or {}).items():
        if library not in LIBRARY_AXES or library == "trl":
            raise PackcheckUsageError(f"lookup(): no library axis {library!r}: the atlas has "
                                      f"{', '.join(k for k in LIBRARY_AXES if k != 'trl')} (and --trl X --stack E).")
        if not isinstance(release, str) or not release.strip() or len(release) > 200:
            raise PackcheckUsageError(f"The {library} release {release!r:.40} is not a release number: give one, e.g. "
                                      f"--{library} {'0.9.1' if LIBRARY_AXES[library].kind == 'rl_trainer' else '0.18.1'}.")
        asked.append((library, release, stack if LIBRARY_AXES[library].kind == "stack" else None))
    if stack is not None:
        if not isinstance(stack, str) or not stack.strip():
            raise PackcheckUsageError(f"Empty value {stack!r} for --stack: give a stack element, e.g. --stack lora.")
        if trl_version:
            asked.append(("trl", trl_version, stack))
        if not any(LIBRARY_AXES[library].kind == "stack" for library, _, _ in asked):
            stacks = [k for k, a in LIBRARY_AXES.items() if a.kind == "stack"]
            raise PackcheckUsageError(f"--stack {stack} asks a stack axis: add the release of one of "
                                      f"{', '.join('--' + k for k in stacks)} (e.g. --peft 0.18.1 --stack {stack}).")
    return asked
