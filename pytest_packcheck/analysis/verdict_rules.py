"""Verdict rules that hold for every check's result, wherever it comes from (a run, a journal, a results file)."""

from __future__ import annotations

import math
from typing import Any


def pass_over_tolerance(check: str, status: str, metrics: dict[str, Any], tolerances: dict[str, Any]) -> tuple[str, float, str, float] | None:
    """(key, value, tolerance key, tolerance) when a pass's key number (the registry's ``key_metric``) is above the
    tolerance the cell records for it (the registry's ``tolerance``): a verdict its own number contradicts, which
    no run writes (0 of 27114 passing cells of the committed reports and atlas builds) and a hand-edited file can
    (trial 11, 174: isolation "pass" with max_change 0.5 under isolation_atol 1e-05). None otherwise."""
    from ..checks.registry import SPECS

    spec = SPECS.get(check)
    if status != "pass" or not spec or not spec.key_metric or not spec.tolerance:
        return None
    value, tol = metrics.get(spec.key_metric[0]), (tolerances or {}).get(spec.tolerance)
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (value, tol))
    return (spec.key_metric[0], float(value), spec.tolerance, float(tol)) if numbers and value > tol else None


#: Checks whose fail is, by definition, their key number above its tolerance: isolation fails only when the other
#: examples' logits moved more than ``isolation_atol`` (leak, stateful_layers, kernel_numerics; an inconclusive probe
#: is an error, not a fail). 0 of 2822 isolation fails of the committed reports and atlas builds were within it;
#: other checks' fails may rest on another probe (logits_parity on the collator's position layout), so they are not here.
FAIL_MEANS_OVER_TOLERANCE = ("isolation",)


def fail_within_tolerance(check: str, status: str, metrics: dict[str, Any], tolerances: dict[str, Any]) -> tuple[str, float, str, float] | None:
    """(key, value, tolerance key, tolerance) when a fail of a :data:`FAIL_MEANS_OVER_TOLERANCE` check has its key
    number at or under the tolerance the cell records: a verdict its own number contradicts (trial 14, 53 / trial 15,
    225: an isolation "fail", cause leak, with max_change 0.0). None otherwise."""
    from ..checks.registry import SPECS

    spec = SPECS.get(check)
    if status != "fail" or check not in FAIL_MEANS_OVER_TOLERANCE or not spec or not spec.key_metric or not spec.tolerance:
        return None
    value, tol = metrics.get(spec.key_metric[0]), (tolerances or {}).get(spec.tolerance)
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (value, tol))
    return (spec.key_metric[0], float(value), spec.tolerance, float(tol)) if numbers and value <= tol else None


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
