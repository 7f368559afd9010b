"""Cell records and the results JSON: its schema, loading (with the checks a reader relies on) and upgrading
older schema versions."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, scrub_secrets

# schema 3's tables are written and read in io.py, beside dumps_results, where versions.envs (a layer below results)
# may reach them; TABLES, compact_document and read_results are re-exported: readers import the file's reader from here
from .io import RESULTS_SCHEMA_VERSION, TABLES, compact_document, expand_tables, read_results  # noqa: F401
from .metrics import num_items_ignored, num_items_ignored_pass

#: 2: cells carry ``role`` (from the check registry), ``cause``, ``evidence`` and ``findings`` (cause codes the
#: check returned). A version-1 file is upgraded on load (role from the registry, no cause codes).
#: 3: the file keeps each distinct model record and tolerance set once, in the top-level tables :data:`TABLES`
#: (``models``: key -> model record, ``tolerances``: ``"t0"`` ... -> tolerances), and a cell names its entry
#: (``"model": "<key>"``, ``"tolerances": "t0"``): the committed default matrix 2.42 -> 1.59 MB. Only the file
#: changes (:mod:`.io` writes and reads the tables): :func:`load_document` / :func:`read_results` give every
#: reader the cells of schema 2 (the tables expanded and dropped), journals keep their self-contained cells, and a
#: schema-2 file still loads.
SCHEMA_VERSION = RESULTS_SCHEMA_VERSION

#: Verdicts, worst first. ``error``: crashed (exception, or the signal that killed the isolated child).
#: ``timeout``: no result within --packcheck-timeout. ``oom``: out of memory (with the memory figures).
#: ``fallback``: the requested backend is not what ran. ``unsupported``: the stack refuses packing with an
#: explicit error. ``skipped``: this environment lacks something.
STATUSES = ("error", "timeout", "oom", "fail", "fallback", "unsupported", "skipped", "pass")
SYMBOLS = {"pass": "✅", "fail": "❌", "fallback": "⚠️", "unsupported": "🚫", "skipped": "⏭️", "error": "💥",
           "timeout": "⏱️", "oom": "🧱"}



def is_shard(value: Any) -> bool:
    """Whether ``value`` is a results file's ``settings.shard``: ``[index, count]``, 1 <= index <= count."""
    return (isinstance(value, list) and len(value) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            and 1 <= value[0] <= value[1])


@dataclass
class CheckResult:
    """What a check returns: a verdict, the numbers it measured, a one-line message, and the cause code
    (:data:`registry.CAUSES`) of a verdict that is not a pass, with its evidence (numbers). ``findings``: causes
    the check's probes saw beside its verdict, as ``{"cause", "evidence"}`` records (e.g. a two-row probe)."""

    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    cause: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    #: every cause of the verdict, each with its own numbers, primary first: ``[{"cause": code, "evidence": {...}}]``
    #: (``cause`` / ``evidence`` are the first entry). A cell failing for several reasons lists each (issue 23.2).
    causes: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {STATUSES}")
        from ..checks.registry import CAUSES

        _align_causes(self)
        for code in [self.cause, *(f.get("cause") for f in self.findings), *(c.get("cause") for c in self.causes)]:
            if code is not None and code not in CAUSES:
                raise ValueError(f"unknown cause {code!r}; expected one of {tuple(CAUSES)}")


@dataclass
class CellResult:
    """One cell of the matrix: model x backend x check x dtype."""

    cell_id: str
    model: dict[str, Any]
    backend: str | None
    check: str
    dtype: str
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    duration_s: float = 0.0
    tolerances: dict[str, float] = field(default_factory=dict)
    #: the version environment the cell ran in (label, requirements, resolved versions, its environment()),
    #: None when it ran in the environment of the report
    env: dict[str, Any] | None = None
    #: the check's role (registry): correctness decides the cell's headline; hazards and findings do not
    role: str = "correctness"
    cause: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    #: :attr:`CheckResult.causes`: every cause of the verdict, primary first (a file without it: ``[cause]``)
    causes: list[dict[str, Any]] = field(default_factory=list)
    #: the stack element the cell's model ran with (``--packcheck-stack``, model/stack.py), None: the bare model
    stack: str | None = None

    def __post_init__(self) -> None:
        from ..checks.registry import role

        self.role = role(self.check)
        _align_causes(self)

    def to_json(self) -> str:
        """The cell as JSON with sorted keys: the text of ``json.dumps(dataclasses.asdict(self), sort_keys=True,
        default=_jsonable)``, without asdict's deep copy of every metric (issue 47: 0.4 ms a cell, in the child and
        again in the report): the fields go to json as they are; a dataclass inside them becomes its asdict where
        json meets it, anything else json cannot write goes through :func:`_jsonable`, as after the copy."""
        return json.dumps({name: getattr(self, name) for name in self.__dataclass_fields__}, sort_keys=True,
                          default=_json_default)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _align_causes(result: Any) -> None:
    """``cause`` / ``evidence`` and ``causes`` tell one story: the primary cause is ``causes[0]``; a result given
    only one of them gets the other; a cause repeated in ``causes`` is kept once (the first, with its numbers)."""
    if result.causes:
        seen: set[str] = set()
        result.causes = [c for c in result.causes if c.get("cause") and not (c["cause"] in seen or seen.add(c["cause"]))]
    if result.cause and (not result.causes or result.causes[0]["cause"] != result.cause):
        result.causes = [{"cause": result.cause, "evidence": result.evidence},
                         *(c for c in result.causes if c["cause"] != result.cause)]
    elif result.causes and not result.cause:
        result.cause, result.evidence = result.causes[0]["cause"], dict(result.causes[0].get("evidence") or {})


def _json_default(value: Any) -> Any:
    """:meth:`CellResult.to_json`'s ``default``: a dataclass instance as :func:`dataclasses.asdict` gives it (what
    asdict made of one nested in a field), else :func:`_jsonable`."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return _jsonable(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def build_document(cells: list[CellResult], env: dict[str, Any], settings: dict[str, Any], command: str) -> dict[str, Any]:
    """The results JSON: schema_version, environment, settings, the reproducing command, and the cells."""
    return {
        "schema_version": SCHEMA_VERSION,
        "packcheck_version": env.get("packcheck"),
        "environment": env,
        "settings": settings,
        "command": command,
        "cells": [json.loads(c.to_json()) for c in sorted(cells, key=lambda c: c.cell_id)],
    }


def cell_problem(cell: Any) -> str | None:
    """What makes ``cell`` (a results-file cell or a journal line's cell) unusable, or None: the fields every
    reader indexes must be there with the right types."""
    if not isinstance(cell, dict):
        return f"a cell is a JSON {type(cell).__name__}, not an object"
    name = cell.get("cell_id", "?")
    for key, kind in (("cell_id", str), ("check", str), ("dtype", str), ("status", str), ("model", dict)):
        if not isinstance(cell.get(key), kind):
            return f"cell {name!r} has {key}={cell.get(key)!r} (expected a {kind.__name__})"
    if cell["status"] not in STATUSES:
        return f"cell {name!r} has unknown status {cell['status']!r} (expected one of {', '.join(STATUSES)})"
    if not isinstance(cell.get("backend"), str | None):
        return f"cell {name!r} has backend={cell.get('backend')!r} (expected a string or null)"
    for key, kind in (("metrics", dict), ("tolerances", dict), ("message", str), ("env", dict)):
        if key in cell and not isinstance(cell[key], kind) and not (key == "env" and cell[key] is None):
            return f"cell {name!r} has \"{key}\": {json.dumps(cell[key])[:40]} (expected a {'JSON object' if kind is dict else 'string'})"
    if not isinstance(cell["model"].get("label"), str):
        return f"cell {name!r} has a model without a label"
    from ..checks.causes import CAUSES
    from ..checks.registry import SPECS

    if cell["check"] not in SPECS:  # trial of issue 42: a "bogus" check was read as a new cell and listed as run
        return f"cell {name!r} has check {cell['check']!r}, not a check of packcheck (packcheck checks lists them)"
    for key in ("causes", "findings"):  # trial of issue 42: causes as strings crashed merge's diagnosis
        value = cell.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(x, dict) and isinstance(x.get("cause"), str) for x in value):
            return (f"cell {name!r} has \"{key}\": {json.dumps(value)[:60]} (expected a list of objects with a \"cause\" "
                    "code, as packcheck writes them)")
        unknown = next((x["cause"] for x in value if x["cause"] not in CAUSES), None)
        if unknown is not None:
            return f"cell {name!r} names cause {unknown!r} in \"{key}\", not a cause code of packcheck"
    if cell.get("cause") is not None and cell["cause"] not in CAUSES:
        return f"cell {name!r} has cause {json.dumps(cell['cause'])[:40]}, not a cause code of packcheck"
    items = (cell.get("metrics") or {}).get("items") if isinstance(cell.get("metrics"), dict) else None
    if isinstance(items, dict):  # contract items (collate, single_row): each a verdict of its own (trial 12, 67)
        bad = next(((k, v) for k, v in items.items() if not (isinstance(v, dict) and v.get("status") in STATUSES)), None)
        if bad:
            said = json.dumps(bad[1].get("status") if isinstance(bad[1], dict) else bad[1])[:40]
            return f"cell {name!r} has contract item {bad[0]!r} with status {said} (expected one of {', '.join(STATUSES)})"
        failed = next((k for k, v in items.items() if v.get("status") == "fail"), None)
        if cell["status"] == "pass" and failed:  # trial 13, 143: a journal line edited fail -> pass was resumed
            return f"cell {name!r} passes while its contract item {failed!r} failed (a pass its own record contradicts)"
    if cell["status"] == "pass" and cell.get("cause"):
        # no run writes a pass with a cause code (0 of 47716 passing cells of the committed reports and atlas builds);
        # an edited one ("pass", cause leak, "boundaries missing in 2 of 2 calls") was resumed and gated (trial 13, 143/144)
        return f"cell {name!r} passes with cause {json.dumps(cell['cause'])[:40]} (a pass its own record contradicts)"
    from ..checks.registry import ROLES

    if "role" in cell and cell["role"] not in ROLES:
        # a hand-edited role ("villain") was rendered as a pass in one place and "not checked" in another (trial 7, 94);
        # a known role that differs from the registry's (an earlier packcheck's) is read as the registry's (role_of)
        return f"cell {name!r} has role {json.dumps(cell['role'])[:40]} (expected one of {', '.join(ROLES)})"
    from ..analysis.verdict_rules import fail_within_tolerance, pass_over_tolerance, unbacked_pass

    spec = SPECS[cell["check"]]
    if cell["status"] == "pass" and spec.key_metric and spec.key_metric[0] not in (cell.get("metrics") or {}):
        # trial of issue 42: a pass with "metrics": {} was gated as a pass (every pass packcheck writes carries it:
        # 16,045 of 16,045 in the committed reports)
        return f"cell {name!r} passes with no {spec.key_metric[0]} (a pass rests on its check's key number)"
    unbacked = unbacked_pass(cell["check"], cell["status"], cell.get("metrics") or {})
    if unbacked:
        return f"cell {name!r} passes on {unbacked[0]}={json.dumps(unbacked[1])[:40]} (expected a finite number)"
    over = pass_over_tolerance(cell["check"], cell["status"], cell.get("metrics") or {}, cell.get("tolerances") or {})
    if over:
        return (f"cell {name!r} passes with {over[0]}={over[1]:.3g} above its tolerance {over[2]}={over[3]:g} (a pass "
                "its own number contradicts)")
    under = fail_within_tolerance(cell["check"], cell["status"], cell.get("metrics") or {}, cell.get("tolerances") or {})
    if under:
        return (f"cell {name!r} fails with {under[0]}={under[1]:.3g}, within its tolerance {under[2]}={under[3]:g} (a "
                "fail its own number contradicts)")
    return None


def load_document(path: str | Path, source: str | None = None) -> dict[str, Any]:
    """Load a results JSON written by packcheck. ``source``: where the path came from (``--packcheck-baseline``,
    ``$PACKCHECK_BASELINE``, ``--candidate``), named in every error after the path.

    Raises:
        PackcheckUsageError: missing, a directory, not JSON, no schema_version or one that is not an integer (naming
            its type) or newer than this packcheck reads, no "settings" object,
            a malformed "incomplete" mark, or no valid cells.
    """
    p = Path(path)
    name = f"{p} (from {source})" if source else str(p)
    if p.exists() and not p.is_file() and not p.is_dir():  # /dev/zero would be read for ever
        raise PackcheckUsageError(f"Results file {name} is not a regular file (a device or a pipe): pass a packcheck-matrix.json file.")
    if not p.exists():
        raise PackcheckUsageError(f"Results file {name} does not exist: run `packcheck audit` first.")
    if p.is_dir():
        raise PackcheckUsageError(f"Results file {name} is a directory: pass a packcheck-matrix.json file.")
    from ..errors import parse_document, read_user_text

    # scrubbed as read: a results file from elsewhere may carry a token, which gate / merge would print; one bounded
    # reader for size, encoding, format and nesting (issue 42: a 100,000-deep array was a RecursionError traceback)
    fix = "pass the packcheck-matrix.json an audit wrote."
    data = parse_document(scrub_secrets(read_user_text(p, "Results file", fix, named=f"Results file {name}")), "json",
                          f"Results file {name}", fix)
    if not isinstance(data, dict):  # a bare list of cells was "has no schema_version" (trial of issue 42)
        raise PackcheckUsageError(f"Results file {name} is a JSON {type(data).__name__}, not a packcheck results file (an "
                                  "object with schema_version, settings, environment and cells): pass the "
                                  "packcheck-matrix.json an audit wrote.")
    version = data.get("schema_version")
    if version is None:
        raise PackcheckUsageError(f"Results file {name} has no schema_version: it was not written by packcheck.")
    if not isinstance(version, int) or isinstance(version, bool):  # "2" was reported as "has no schema_version"
        kind = {str: "a string", bool: "a boolean", float: "a number with a fraction"}.get(type(version), f"a JSON {type(version).__name__}")
        raise PackcheckUsageError(f"Results file {name} is corrupt: \"schema_version\" is {json.dumps(version)[:40]} ({kind}, "
                                  f"expected an integer such as {SCHEMA_VERSION}). Regenerate it with `packcheck audit`.")
    if version > SCHEMA_VERSION:
        raise PackcheckUsageError(
            f"Results file {name} has schema_version {version}, newer than {SCHEMA_VERSION} that this packcheck reads: "
            "upgrade packcheck."
        )
    expand_tables(data, name)
    for key in ("settings", "environment"):
        if key in data and not isinstance(data[key], dict):
            raise PackcheckUsageError(f"Results file {name} is corrupt: \"{key}\" is {json.dumps(data[key])[:40]} (expected a JSON "
                                      "object). Regenerate it with `packcheck audit`.")
    inc = data.get("incomplete")
    if inc is not None and not (isinstance(inc, dict) and isinstance(inc.get("reason"), str)):
        raise PackcheckUsageError(f"Results file {name} is corrupt: \"incomplete\" is {json.dumps(inc)[:40]} (expected a JSON "
                                  "object with a \"reason\" string, as an interrupted audit writes). Regenerate it with `packcheck audit`.")
    for key, value in (data.get("settings") or {}).items():
        if key in ("models", "backends", "checks", "dtypes", "versions") and not (
                isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise PackcheckUsageError(f"Results file {name} is corrupt: \"settings\".\"{key}\" is {json.dumps(value)[:40]} "
                                      "(expected a list of strings). Regenerate it with `packcheck audit`.")
    cells = data.get("cells")
    required = ("cell_id", "model", "backend", "check", "dtype", "status")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and all(k in c for k in required) for c in cells):
        raise PackcheckUsageError(
            f"Results file {name} has no valid 'cells' list (each cell needs {', '.join(required)}): it is not a packcheck results file."
        )
    if not all(isinstance(c["model"], dict) and "label" in c["model"] for c in cells):
        raise PackcheckUsageError(f"Results file {name} has cells whose 'model' lacks a label: it is not a packcheck results file.")
    if "settings" not in data:  # every audit records them; without, a merge cannot tell shards (trial 20, 149)
        raise PackcheckUsageError(f"Results file {name} is corrupt: it has no \"settings\" (the audit's models, backends, "
                                  "checks and shard, which every packcheck audit records). Regenerate it with `packcheck audit`.")
    problem = next((cell_problem(c) for c in cells if cell_problem(c)), None) or _mixed_tolerances(cells)
    if problem:
        raise PackcheckUsageError(f"Results file {name} is corrupt: {problem}. Regenerate it with `packcheck audit`.")
    data.setdefault("environment", {})
    return upgrade(data)


def _mixed_tolerances(cells: list[dict[str, Any]]) -> str | None:
    """Why the cells of one dtype were not judged with one set of tolerances, or None: an audit judges every cell
    of a dtype with the same ones (its ``## Tolerances`` table is one per dtype), so a file whose cells differ was
    edited; the gate took the first cell's and compared the rest unseen (trial 15, 54: one cell's logits_atol set to
    1.0, "No cell changed"). Cells that record none are not compared."""
    first: dict[str, tuple[str, dict[str, Any]]] = {}
    for c in cells:
        tol = c.get("tolerances")
        if not isinstance(tol, dict) or not tol:
            continue
        cid, before = first.setdefault(str(c["dtype"]), (str(c["cell_id"]), tol))
        keys = sorted(k for k in set(before) | set(tol) if before.get(k) != tol.get(k))
        if keys:
            values = ", ".join(f"{k} {before.get(k, 'unset')} vs {tol.get(k, 'unset')}" for k in keys)
            return (f"cells '{cid}' and '{c['cell_id']}' were judged with different {c['dtype']} tolerances ({values}), "
                    "and one audit judges a dtype with one set")
    return None


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Bring an older results document to :data:`SCHEMA_VERSION` in place: version 1 cells get their role from
    the registry and empty cause codes (their diagnosis, if any, is kept); a cell of any version without the
    optional ``message`` / ``metrics`` gets them empty."""
    from ..checks.registry import role

    for c in data.get("cells", []):  # a field a reader indexes is there (a hand-edited cell without "message" was a
        c.setdefault("role", role(c["check"]))  # KeyError in the HTML writer, trial 7, 91); version 1 had no causes
        c.setdefault("cause", None)
        c.setdefault("evidence", {})
        c.setdefault("findings", [])
        c.setdefault("message", "")
        c.setdefault("metrics", {})
    if data.get("schema_version", SCHEMA_VERSION) < 2:
        data["schema_version"] = SCHEMA_VERSION
    if _rejudge_num_items_ignored(data) and any("diagnosis" in c for c in data.get("cells", [])):
        from ..analysis.diagnose import diagnose_document

        diagnose_document(data)  # the re-judged cells' diagnosis (their remedy) follows their new causes
    return data


def _rejudge_num_items_ignored(data: dict[str, Any]) -> bool:
    """Judge again, from their own numbers, the loss_parity cells measured before packcheck told the model's
    grad-accum fault from packing's (:func:`.metrics.num_items_ignored`): a fail whose only
    cause is ``loss_normalisation`` while the padded grad-accum loss is as far off the reference as the packed one
    becomes what the check returns today, a pass with the ``num_items_ignored`` finding (its evidence says it was
    re-judged). The atlas's releases measured before the rule (gemma3 4.50-4.54, modernbert-decoder, ...) read the
    same as those measured after. Returns whether a cell changed."""
    candidates = [c for c in data.get("cells", []) if c["check"] == "loss_parity" and c["status"] == "fail"
                  and ([x.get("cause") for x in c.get("causes") or []] or [c.get("cause")]) == ["loss_normalisation"]]
    if not candidates:
        return False
    changed = False
    for c in candidates:
        m = c["metrics"]
        if not num_items_ignored(m):
            continue
        evidence = {k: v for k, v in (c.get("evidence") or {}).items() if k.startswith("ga_normalisation")}
        message, finding = num_items_ignored_pass(m, evidence)
        finding["evidence"]["rejudged"] = "measured as fail (loss_normalisation); judged again from its own numbers"
        c.update(status="pass", cause=None, causes=[], evidence=evidence, message=message,
                 findings=[*(c.get("findings") or []), finding])
        changed = True
    return changed
