"""Verdict rules that hold for every check's result, wherever it comes from (a run, a journal, a results file)."""

from __future__ import annotations

import math
from typing import Any


def unbacked_pass(check: str, status: str, metrics: dict[str, Any]) -> tuple[str, Any] | None:
    """(key, value) when a pass rests on a key number (the registry's ``key_metric``, which the gate compares)
    that is not a finite number: NaN, infinity or text cannot back a verdict. None otherwise, and for a check
    whose key number is not in ``metrics``. The runner turns such a pass into an error; a results file holding
    one is corrupt."""
    from ..checks.registry import SPECS

    spec = SPECS.get(check)
    if status != "pass" or not spec or not spec.key_metric or spec.key_metric[0] not in metrics:
        return None
    value = metrics[spec.key_metric[0]]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return spec.key_metric[0], value
    return None
