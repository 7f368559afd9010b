"""The key number of a check's cell, written as its check record says (:meth:`CheckSpec.key_number`).

No check is named here: a check's record carries its key metric (metrics key, label) and, where one number does
not say it, the formatter beside the check (``key_number_format``). Pure: metrics in, text out.
"""

from __future__ import annotations

from typing import Any

from ..checks.registry import REGISTRY, SPECS

#: check -> (metrics key, label), for the checks whose key number is one metric (the atlas and bisect read it).
KEY_METRIC: dict[str, tuple[str, str]] = {s.name: (s.key_metric.key, s.key_metric.label) for s in REGISTRY
                                          if s.key_metric and s.key_metric.key}


def key_number(cell: dict[str, Any]) -> str:
    """The number a check's verdict rests on, as the report writes it (``Δ 3.1e-02``, ``2/2 calls``, ``5/6
    items``); "" when the cell holds none or its check is unknown to this packcheck (a newer results file)."""
    spec = SPECS.get(cell["check"])
    return spec.key_number(cell.get("metrics", {})) if spec else ""


def key_metric(cell: dict[str, Any]) -> tuple[str, Any] | None:
    """(metrics key, value) of the number a cell's verdict rests on (:meth:`CheckSpec.key_metric_key`: the check's
    key metric, or the one the cell names as deciding); None when its check is unknown or the cell holds none."""
    spec = SPECS.get(cell.get("check", ""))
    metrics = cell.get("metrics") or {}
    key = spec.key_metric_key(metrics) if spec else None
    return None if key is None else (key, metrics[key])
