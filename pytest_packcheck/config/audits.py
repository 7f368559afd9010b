"""Audit definitions: the ``audit/*.toml`` files that name an audit's models, backends, checks, dtypes, versions,
example lengths, sliding window and tolerance profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

from ..errors import PackcheckUsageError, read_user_text

# Wheels carry audit/ as pytest_packcheck/_audit (pyproject force-include); an editable install reads the
# repository's audit/ folder directly.
_HERE = Path(__file__).resolve().parent.parent
PACKAGE_AUDIT_DIR = _HERE / "_audit" if (_HERE / "_audit").is_dir() else _HERE.parent / "audit"


@dataclass(frozen=True)
class AuditDefinition:
    """An audit file: which models, backends, checks and dtypes to run, and its tolerance profile."""

    path: str
    name: str
    models: tuple[str, ...]
    backends: tuple[str, ...] | None = None
    checks: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    tolerances: str | None = None
    versions: tuple[str, ...] | None = None  # version axes / combinations, as for --packcheck-versions
    lengths: tuple[int, ...] | None = None  # example lengths of the packed row, as for --packcheck-lengths
    sliding_window: int | None = None  # as for --packcheck-sliding-window


_AUDIT_KEYS = {"name", "description", "models", "backends", "checks", "dtypes", "tolerances", "versions", "lengths",
               "sliding_window"}


def resolve_audit_path(value: str) -> Path:
    """An audit name (``default``) or path; names are looked up in ./audit/ then in the packaged audit/."""
    path = Path(value)
    if path.suffix == ".toml" and path.exists():
        return path
    for base in (Path.cwd() / "audit", PACKAGE_AUDIT_DIR):
        candidate = base / f"{value}.toml"
        if candidate.exists():
            return candidate
    if path.is_dir():  # a folder is there, so "not found" would send the user looking for the wrong thing
        raise PackcheckUsageError(f"Audit '{value}' is a directory: give an audit TOML file (e.g. "
                                  f"{PACKAGE_AUDIT_DIR / 'default.toml'}) or the name of one under audit/.")
    raise PackcheckUsageError(
        f"Audit '{value}' not found (looked for {path} and {value}.toml in ./audit and {PACKAGE_AUDIT_DIR}): "
        "give an existing .toml file or the name of one under audit/."
    )


def load_audit(value: str) -> AuditDefinition:
    """Read an audit definition (TOML).

    Raises:
        PackcheckUsageError: file missing, not TOML, unknown keys, no models or an empty list (backends, checks,
            dtypes, versions).
    """
    path = resolve_audit_path(value)
    try:
        data = tomllib.loads(read_user_text(path, "Audit file", "pass an audit definition (TOML), e.g. audit/default.toml."))
    except tomllib.TOMLDecodeError as exc:
        raise PackcheckUsageError(f"Audit file {path} is not valid TOML ({exc}): fix the syntax.") from None
    audit = data.get("audit", data)
    unknown = set(audit) - _AUDIT_KEYS
    if unknown:
        raise PackcheckUsageError(
            f"Audit file {path} has unknown keys {sorted(unknown)}: allowed are {sorted(_AUDIT_KEYS)}."
        )
    models = audit.get("models") or []
    for key in ("models", "backends", "checks", "dtypes", "versions"):
        if key in audit and not (isinstance(audit[key], list) and all(isinstance(x, str) for x in audit[key])):
            raise PackcheckUsageError(
                f"Audit file {path}: '{key}' must be a list of strings, e.g. {key} = [\"...\"], not {audit[key]!r}."
            )
        if key in audit and not audit[key] and key != "models":  # an empty value is never "every backend" (README)
            raise PackcheckUsageError(f"Audit file {path}: '{key}' is empty: list at least one, or leave '{key}' out "
                                      "for the default.")
    if not models:
        raise PackcheckUsageError(f"Audit file {path} lists no models: add models = [\"arch:llama\", ...].")

    def opt(key: str) -> tuple[str, ...] | None:
        return tuple(audit[key]) if audit.get(key) else None

    lengths = audit.get("lengths")
    if lengths is not None and not (isinstance(lengths, list) and len(lengths) >= 2
                                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)):
        raise PackcheckUsageError(f"Audit file {path}: 'lengths' must list at least two whole numbers >= 1, e.g. "
                                  f"lengths = [11, 1, 13], not {lengths!r}.")
    window = audit.get("sliding_window")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 2):
        raise PackcheckUsageError(f"Audit file {path}: 'sliding_window' must be a whole number >= 2, e.g. "
                                  f"sliding_window = 16, not {window!r}.")
    return AuditDefinition(
        lengths=tuple(lengths) if lengths else None, sliding_window=window,
        path=str(path),
        name=audit.get("name", path.stem),
        models=tuple(models),
        backends=opt("backends"),
        checks=opt("checks"),
        dtypes=opt("dtypes"),
        tolerances=audit.get("tolerances"),
        versions=opt("versions"),
    )
