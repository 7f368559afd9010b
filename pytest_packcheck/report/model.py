"""The format-neutral report model: read once from a results document, rendered by every format.

:func:`build_report` returns a :class:`Report`: the matrix's shape (:class:`Layout`), each matrix cell's
headline, the ⚑ departures, the stack hazards (counted once per environment, dtype and backend), the do-not-pack
list, the backends that ran nothing here, the environment rows of the header, the gate result. The renderers
(:mod:`.markdown`, :mod:`.details`, :mod:`.terminal`, :mod:`.html`, ...) read it and add only their
own words and layout. Pure: results document in, records out; no torch, no transformers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..checks.registry import REGISTRY
from ..results.environment import environment_recorded
from ..results.schema import is_shard
from .text import cut
from .verdicts import cause_label, coverage, env_label, hazard_rows, headline, role_of


def env_value(env: dict[str, Any], key: str) -> str:
    """One value of the environment record, "not installed" when absent or empty."""
    return str(env.get(key) or "not installed")


def environment_rows(environment: dict[str, Any]) -> list[tuple[str, str]]:
    """The libraries whose versions matter, as every report header names them: (name, version, or "not
    installed"), in the libraries table's order (:func:`~pytest_packcheck.versions.libraries.header_libraries`:
    the records with ``header=True``). ``environment``: a results document's ``environment``."""
    from ..versions.libraries import header_libraries

    return [(lib.label, env_value(environment, lib.key)) for lib in header_libraries()]


def incomplete_text(inc: dict[str, Any]) -> str:
    """The line an incomplete matrix carries (the document's ``incomplete``: reason, cells, resume, journal), plain
    text: why it stopped, after how many finished cells, how many of them were taken from the journal (finished in
    this run's forked child but never reported to pytest, or in an earlier run for --packcheck-resume: pytest's own
    counts, "no tests ran", leave those out), and how to resume."""
    journal = inc.get("journal") or {}
    parts = [f"{n} {what}" for n, what in (
        (journal.get("this"), "finished in this run but never reached pytest"),
        (journal.get("earlier"), "finished in an earlier run (--packcheck-resume)")) if n]
    source = f" ({'; '.join(parts)}: taken from the journal, so pytest's own counts leave them out)" if parts else ""
    return f"Incomplete: {inc.get('reason')} after {inc.get('cells')} cells{source}; {inc.get('resume', '')}"


def resumed_text(doc: dict[str, Any]) -> str:
    """The line a matrix carries when --packcheck-resume took some of its cells from the journal of an earlier run
    (the document's ``resumed``: ``{"cells": n, "of": total}``), plain text; "" when none was."""
    res = doc.get("resumed")
    if not isinstance(res, dict) or not res.get("cells"):
        return ""
    return (f"Resumed: {res['cells']} of {res.get('of', '?')} cells were taken from the journal of an earlier run "
            "(--packcheck-resume), not measured in this run: their numbers and durations are that run's")


def shard_text(doc: dict[str, Any]) -> str:
    """The line a shard's own matrix carries (``settings.shard`` ``[index, count]``, count > 1), plain text: which
    shard it is, the models it holds of the audit's, and that ``packcheck merge`` of every shard gives the whole
    matrix; "" for a run that is no shard and for a merge (trial 19, 95: a shard's matrix read like a complete
    audit of its one model)."""
    shard = (doc.get("settings") or {}).get("shard")
    if not (is_shard(shard) and shard[1] > 1):  # the one reading of a recorded shard, as merge's
        return ""
    here = list(dict.fromkeys(c["model"]["label"] for c in doc.get("cells") or [] if isinstance(c.get("model"), dict)))
    asked = (doc.get("settings") or {}).get("models") or []
    held = f"{len(here)} of the audit's {len(asked)} models ({', '.join(here)})" if asked else f"models {', '.join(here)}"
    return (f"Shard {shard[0]} of {shard[1]} (--packcheck-shard): this matrix holds {held}; the other shards hold the "
            f"rest; packcheck merge of every shard's packcheck-matrix.json (1 to {shard[1]}) gives the whole matrix")


def banners(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The warnings every report of ``doc`` shows under its title, as (id, plain text) in order: incomplete
    (:func:`incomplete_text`), resumed (:func:`resumed_text`), shard (:func:`shard_text`); the one list the
    Markdown, details, HTML and terminal read."""
    out = [("incomplete", incomplete_text(doc["incomplete"]))] if doc.get("incomplete") else []
    return out + [(key, text) for key, text in (("resumed", resumed_text(doc)), ("shard", shard_text(doc))) if text]


def environment_role(versioned: bool) -> str:
    """Whose versions the document's ``environment`` holds: the environment that measured every cell, or, in a
    ``--packcheck-versions`` run, the controller's (each version environment's own are on its cells)."""
    return ("Controller (each version environment ran its own cells, over its own torch and libraries)" if versioned
            else "Measured")


#: What a report says for a results file whose ``environment`` records nothing (trial 15, 32 / 72: such a file read
#: "torch not installed, transformers not installed", a claim about a stack nobody recorded).
NOT_RECORDED = "environment not recorded (the results file has no \"environment\" versions: the stack it was measured on is unknown)"


def environment_line(environment: dict[str, Any]) -> str:
    """:func:`environment_rows` in one phrase: ``torch 2.13.0+cpu, transformers 5.24.0, trl 1.16.0, flash-attn not installed``;
    :data:`NOT_RECORDED` for a document whose environment records nothing."""
    if not environment_recorded(environment):
        return NOT_RECORDED
    return ", ".join(f"{name} {version}" for name, version in environment_rows(environment))


# ------------------------------------------------------------------------------------------------------------
# version environments (--packcheck-versions)


def env_versions(label: str | None, cells: list[dict[str, Any]]) -> dict[str, str]:
    """The resolved versions of the version environment ``label`` (its first cell that records them)."""
    for c in cells:
        if env_label(c) == label and (c.get("env") or {}).get("versions"):
            return c["env"]["versions"]
    return {}


def _env_sort_key(label: str | None, cells: list[dict[str, Any]]) -> tuple:
    from packaging.version import InvalidVersion, Version

    out = []
    for name, version in sorted(env_versions(label, cells).items()):
        try:
            out.append((name, Version(version)))
        except InvalidVersion:
            out.append((name, Version("0")))
    return (tuple(out), label or "")


def env_header(label: str | None, cells: list[dict[str, Any]]) -> str:
    """Column title: the resolved versions of what the label asked for, e.g. ``transformers 4.51.3``."""
    if label is None:
        return "this environment"
    versions = env_versions(label, cells)
    asked = [r.split("=")[0].split("<")[0].split(">")[0].split("~")[0].split("!")[0] for r in label.split("+")]
    parts = [f"{n} {versions[n]}" if n in versions else r for n, r in zip(asked, label.split("+"), strict=True)]
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------------------
# the matrix's shape


@dataclass(frozen=True)
class Layout:
    """The shape of a matrix, read once from a results document for every renderer (Markdown, details, HTML):
    ``models`` (label -> model record, first-seen order), ``backends`` (the settings' order, else sorted),
    ``dtypes``, ``checks`` (the settings' order, else the registry's), ``envs`` (version environments by version,
    None first for this environment) and ``by_group`` ((model, backend, dtype, env) -> its cells)."""

    models: dict[str, dict[str, Any]]
    backends: list[str]
    dtypes: list[str]
    checks: list[str]
    envs: list[str | None]
    by_group: dict[tuple, list[dict[str, Any]]]

    @property
    def versioned(self) -> bool:
        return self.envs != [None]


def layout(doc: dict[str, Any]) -> Layout:
    """The :class:`Layout` of a results document."""
    cells = doc["cells"]
    settings = doc.get("settings", {})
    models: dict[str, dict[str, Any]] = {}
    by_group: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        models.setdefault(c["model"]["label"], c["model"])
        by_group[(c["model"]["label"], c["backend"], c["dtype"], env_label(c))].append(c)
    backends = [b for b in settings.get("backends", []) if any(c["backend"] == b for c in cells)] or sorted(
        {c["backend"] for c in cells if c["backend"]})
    checks = [c for c in settings.get("checks", []) if any(x["check"] == c for x in cells)] or list(dict.fromkeys(
        s.name for s in REGISTRY if any(x["check"] == s.name for x in cells)))
    envs = sorted({env_label(c) for c in cells}, key=lambda e: (e is not None, _env_sort_key(e, cells)))
    return Layout(models, backends, sorted({c["dtype"] for c in cells}), checks, envs, by_group)


# ------------------------------------------------------------------------------------------------------------
# stack hazards: counted once per environment, dtype and backend (verdicts.hazard_rows, which the counts read too)


def departures(cells: list[dict[str, Any]], rows: dict[tuple, dict[str, Any]] | None = None) -> dict[tuple, list[str]]:
    """⚑ marks: per (model, environment, dtype, backend), the hazards where this model departs from the pattern of
    the other models on its stack (shown where most are not, or the reverse). Needs at least three models.
    ``rows``: :func:`hazard_rows` of ``cells`` when already computed."""
    marks: dict[tuple, list[str]] = defaultdict(list)
    for (hazard, env, dtype, backend), row in (hazard_rows(cells) if rows is None else rows).items():
        n, k = len(row["measured"]), len(row["shown"])
        if n < 3 or k in (0, n):
            continue
        majority_shows = k * 2 > n
        for model in row["measured"]:
            if (model in row["shown"]) != majority_shows:
                marks[(model, env, dtype, backend)].append(("no " if majority_shows else "") + cause_label(hazard))
    return marks


def stack_findings(cells: list[dict[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """Failed contract items of the library stack, once each: (finding check, ``item: evidence``) -> the models
    it failed on (a finding check without items counts as one item, ``verdict``)."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in cells:
        if role_of(c) == "finding" and c["status"] == "fail":
            for name, it in ((c.get("metrics") or {}).get("items") or {"verdict": {"status": "fail", "evidence": c["message"]}}).items():
                if isinstance(it, dict) and it.get("status") == "fail" and c["model"]["label"] not in found[(c["check"], f"{name}: {it.get('evidence', '')}")]:
                    found[(c["check"], f"{name}: {it.get('evidence', '')}")].append(c["model"]["label"])  # once per model
    return found


# ------------------------------------------------------------------------------------------------------------
# the model


@dataclass(frozen=True)
class DoNotPack:
    """One matrix cell whose headline is fail or fallback: where (model, backend, dtype, env), its causes in
    words, the first failing check (``first``, its cell), the remedy, and whether a correctness check judged it
    (``judged``: False when only hazards were asked for)."""

    model: str
    backend: str
    dtype: str
    env: str | None
    causes: str
    first: dict[str, Any]
    remedy: str
    judged: bool


@dataclass(frozen=True)
class Report:
    """A results document read once for every renderer: ``doc`` (the document as written), ``layout``,
    ``labels`` (backend -> its column label), ``headlines`` (group key -> :func:`verdicts.headline`), ``marks``
    (⚑ departures), ``hazards`` (:func:`hazard_rows`), ``findings`` (:func:`stack_findings`), ``do_not_pack``,
    ``not_run`` (backends where no model ran anything -> the first reason, e.g. a CUDA kernel on a CPU machine),
    ``environment`` (:func:`environment_rows`), ``gate`` (the gate result an ``audit --gate`` wrote, or None),
    ``coverage`` (:func:`verdicts.coverage`: what every ✅ covers, "" for a full run; read once for the counts
    line, the answer, the CSV and the HTML)."""

    doc: dict[str, Any]
    layout: Layout
    labels: dict[str, str]
    headlines: dict[tuple, dict[str, Any]]
    marks: dict[tuple, list[str]]
    hazards: dict[tuple, dict[str, Any]]
    findings: dict[tuple[str, str], list[str]]
    do_not_pack: list[DoNotPack]
    not_run: dict[str, str]
    environment: list[tuple[str, str]]
    gate: dict[str, Any] | None
    coverage: str

    @property
    def cells(self) -> list[dict[str, Any]]:
        return self.doc["cells"]

    @property
    def settings(self) -> dict[str, Any]:
        return self.doc.get("settings", {})

    def label(self, backend: str | None) -> str:
        """A backend's column label (the torch varlen column relabelled when a stand-in ran); "(model level)" for
        the cells of a check that runs once per model (no backend)."""
        return self.labels.get(backend, backend) if backend is not None else "(model level)"


def build_report(doc: dict[str, Any]) -> Report:
    """Read a results document (``results.build_document``'s shape, diagnosed) into a :class:`Report`."""
    from ..backends import backend_labels

    cells = doc["cells"]
    lay = layout(doc)
    headlines = {key: headline(group) for key, group in lay.by_group.items()}
    hazards = hazard_rows(cells)
    bad = []
    for key, h in headlines.items():
        if h["status"] in ("fail", "fallback"):
            first = h["bad"][0]
            bad.append(DoNotPack(*key, ", ".join(cause_label(c) for c in h["causes"]), first,
                                 (first.get("diagnosis") or {}).get("remedy") or "",
                                 any(role_of(c) == "correctness" for c in lay.by_group[key])))
    not_run = {b: cut(" ".join(str(next(c for (m, bb, d, e), g in lay.by_group.items() if bb == b for c in g)["message"]).split()), 140)
               for b in lay.backends
               # a cell an interrupted run never finished is "not run" in its row, not this machine's lack
               if all(h["status"] == "skipped" and not h.get("not_run") and not h.get("no_correctness")
                      for (m, bb, d, e), h in headlines.items() if bb == b)
               and any(k[1] == b for k in lay.by_group)}
    gate = doc.get("gate")
    return Report(doc, lay, backend_labels(doc.get("environment", {})), headlines, departures(cells, hazards), hazards,
                  stack_findings(cells), bad, not_run, environment_rows(doc.get("environment", {})),
                  gate if isinstance(gate, dict) else None, coverage(cells))
