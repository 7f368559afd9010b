"""Tolerances per dtype: ``audit/tolerances.toml`` (or the user's file) plus ``[dtype.]key=value`` overrides."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import tomllib

from ..errors import PackcheckUsageError, closest, read_user_text
from .audits import PACKAGE_AUDIT_DIR
from .options import DTYPES, OPT_TOLERANCE

#: The bounds (inclusive) of a tolerance key whose meaning caps it; every other key is a non-negative finite number.
#: grad_cos_min is a cosine similarity (parity.py compares cos(g_packed, g_padded) against it), so above 1 even
#: identical gradients would fail.
BOUNDS: dict[str, tuple[float, float]] = {"grad_cos_min": (-1.0, 1.0)}


def tolerance_problem(key: str, value: object) -> str | None:
    """Why ``value`` cannot be tolerance ``key`` (None when it can): a number within ``BOUNDS[key]``, or for
    every other key a finite number >= 0."""
    low, high = BOUNDS.get(key, (0.0, float("inf")))
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        return f"must be a number from {low:g} to {high:g}" if key in BOUNDS else "must be a finite number >= 0"
    return None


def load_tolerances(path: str | None, overrides: list[str] | None, source: str) -> tuple[dict[str, dict[str, float]], str]:
    """Tolerances per dtype from a TOML file plus ``[dtype.]key=value`` overrides.

    Raises:
        PackcheckUsageError: missing file, bad TOML, a file that sets no tolerance, unknown dtype or key, or a value out of its key's range
            (:data:`BOUNDS`; else a non-negative finite number), or one ``[dtype.]key`` overridden twice.
    """
    default = PACKAGE_AUDIT_DIR / "tolerances.toml"
    file = Path(path) if path else default
    if not file.exists():
        raise PackcheckUsageError(f"Tolerance file {file} (from {source}) does not exist: pass an existing TOML file.")
    from ..errors import parse_document

    fix = f"pass a TOML file of [dtype] tables (from {source}), e.g. audit/tolerances.toml."
    data = parse_document(read_user_text(file, "Tolerance file", fix), "toml", f"Tolerance file {file}", fix)
    base = tomllib.loads(default.read_text())
    keys = tuple(base["float32"])
    out: dict[str, dict[str, float]] = {}
    for dtype, table in data.items():
        if not isinstance(table, dict):
            raise PackcheckUsageError(f"Tolerance file {file} (from {source}) has a top-level key '{dtype}': put keys under a dtype table such as [float32].")
        if dtype not in DTYPES:
            raise PackcheckUsageError(f"Tolerance file {file} (from {source}) has unknown dtype table [{dtype}]. Expected: {', '.join(DTYPES)}.{closest(dtype, DTYPES)}")
        for key in table:
            if key not in keys:
                raise PackcheckUsageError(f"Tolerance file {file} (from {source}) has unknown key {dtype}.{key}. Expected: {', '.join(keys)}.{closest(key, keys)}")
        for key, value in table.items():
            problem = tolerance_problem(key, value)
            if problem:
                raise PackcheckUsageError(f"Tolerance {dtype}.{key} = {value!r} in {file} (from {source}) {problem}.")
        out[dtype] = {**base.get(dtype, {}), **{k: float(v) for k, v in table.items()}}
    if not any(data.values()):  # an empty file (or empty tables) would run on the defaults under the file's name
        raise PackcheckUsageError(f"Tolerance file {file} (from {source}) sets no tolerance: write at least one key under "
                                  "a dtype table, e.g. [float32] then logits_atol = 1e-4 (see audit/tolerances.toml), "
                                  "or name no tolerance file for the defaults.")
    for dtype in DTYPES:
        out.setdefault(dtype, dict(base[dtype]))
    label = str(file.name if file == default else file)
    if file != default and any(key not in (data.get(dtype) or {}) for dtype in DTYPES for key in base[dtype]):
        # the file's values merge over the packaged ones: the label says so (it read as if the file set them all)
        label += f" over the defaults (audit/{default.name})"
    said: dict[str, str] = {}
    for item in overrides or []:
        lhs, sep, rhs = item.partition("=")
        dtype, _, key = lhs.rpartition(".")
        targets = [dtype] if dtype else list(DTYPES)
        if sep and lhs in said:  # no silent last-wins, as for --packcheck-config (hostile trial 5)
            raise PackcheckUsageError(f"Tolerance override '{lhs}' given twice (from {OPT_TOLERANCE}): {said[lhs]} and "
                                      f"{item}; give each [dtype.]key once, with the value you mean.")
        said[lhs] = item
        if not sep:
            raise PackcheckUsageError(f"Bad tolerance override '{item}' (from {OPT_TOLERANCE}): write [dtype.]key=value, e.g. float32.logits_atol=1e-3.")
        if dtype and dtype not in DTYPES:
            raise PackcheckUsageError(
                f"Bad tolerance override '{item}' (from {OPT_TOLERANCE}): unknown dtype '{dtype}'; expected one of {', '.join(DTYPES)}.{closest(dtype, DTYPES)}"
            )
        if key not in keys:
            raise PackcheckUsageError(
                f"Bad tolerance override '{item}' (from {OPT_TOLERANCE}): write [dtype.]key=value with key one of {', '.join(keys)}.{closest(key, keys)}"
            )
        try:
            number = float(rhs)
        except ValueError:
            number = None
        problem = tolerance_problem(key, number)
        if problem:
            raise PackcheckUsageError(f"Tolerance override '{item}' (from {OPT_TOLERANCE}) {problem.replace('must be', 'needs')}, got '{rhs}'.")
        for t in targets:
            out[t][key] = number
        label += f" + {item}"
    return out, label


@functools.cache
def default_tolerances() -> dict[str, dict[str, float]]:
    """The shipped tolerances (``audit/tolerances.toml``), per dtype, read once per process: a shared mapping,
    not to be changed in place."""
    return load_tolerances(None, None, "default")[0]
