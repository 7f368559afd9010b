"""Audit definitions: the ``audit/*.toml`` files that name an audit's models, backends, checks, dtypes, versions,
example lengths, sliding window and tolerance profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    stack: tuple[str, ...] | None = None  # stack elements, as for --packcheck-stack


_AUDIT_KEYS = {"name", "description", "models", "backends", "checks", "dtypes", "tolerances", "versions", "lengths",
               "sliding_window", "stack"}


# The expected TOML type of each [audit] key: the one place an audit file's values are type-checked.
_STRING_LISTS = ("models", "backends", "checks", "dtypes", "versions", "stack")
_STRINGS = {"name": 'name = "my-audit"', "description": 'description = "what this audit covers"',
            "tolerances": 'tolerances = "tolerances.toml"'}


def _toml_type(value: object) -> str:
    """``value``'s TOML type in words, for an error message ("an integer (5)")."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (list, "a list"),
             (dict, "a table"))
    kind = next((word for cls, word in kinds if isinstance(value, cls)), "a date/time")
    return f"{kind} ({value!r})" if not isinstance(value, dict) else kind


def _audit_table(data: dict, path: Path) -> dict:
    """The audit's keys: the ``[audit]`` table, or the top level of a file without one.

    Raises:
        PackcheckUsageError: ``audit`` is not a table, another top-level table or key sits beside ``[audit]``,
            or a key is unknown.
    """
    if "audit" in data:
        if not isinstance(data["audit"], dict):
            raise PackcheckUsageError(f"Audit file {path}: [audit] must be a table of keys (models = [...], ...), not "
                                      f"{_toml_type(data['audit'])}: write [audit] on a line of its own, the keys "
                                      "below it.")
        extra = sorted(set(data) - {"audit"})
        if extra:
            raise PackcheckUsageError(f"Audit file {path} has top-level {extra} beside [audit]: the only table "
                                      f"allowed is [audit] (keys {sorted(_AUDIT_KEYS)}); remove the others or move "
                                      "their keys into [audit].")
        audit = data["audit"]
    else:
        audit = data
    unknown = set(audit) - _AUDIT_KEYS
    if unknown:
        raise PackcheckUsageError(
            f"Audit file {path} has unknown keys {sorted(unknown)}: allowed are {sorted(_AUDIT_KEYS)}."
        )
    return audit


def _check_audit_value(path: Path, key: str, value: object) -> None:
    """Refuse an [audit] value of the wrong type or range (``key`` is one of ``_AUDIT_KEYS``).

    Raises:
        PackcheckUsageError: ``Audit file {path}: '{key}' must be ..., e.g. ...; got {type} ({value})``.
    """
    def refuse(expected: str, example: str) -> None:
        # "got", not "not": "must be a whole number >= 2, ..., not an integer (1)" read as if 1 were no integer
        # (trial 16, 263)
        raise PackcheckUsageError(f"Audit file {path}: '{key}' must be {expected}, e.g. {example}; got "
                                  f"{_toml_type(value)}.")

    if key in _STRING_LISTS and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        refuse("a list of strings", f'{key} = ["..."]')
    if key in _STRINGS and not isinstance(value, str):
        refuse("a file name string" if key == "tolerances" else "a string", _STRINGS[key])
    if key == "lengths" and not (isinstance(value, list) and len(value) >= 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)):
        refuse("a list of at least two whole numbers >= 1", "lengths = [11, 1, 13]")
    if key == "sliding_window" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 2):
        refuse("a whole number >= 2", "sliding_window = 16")


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
    if path.is_file():  # a file that is there, named without .toml (/bin/ls), and no audit of that name: read, so its fault
        return path                      # is said (not UTF-8, not TOML), never "not found" (trial 12, 47)
    if path.exists():  # a device or a pipe (a symlink to /dev/zero): there, so never "not found" (trial of issue 42)
        raise PackcheckUsageError(f"Audit '{value}' is not a regular file (a device or a pipe): give an audit TOML file "
                                  f"(e.g. {PACKAGE_AUDIT_DIR / 'default.toml'}) or the name of one under audit/.")
    raise PackcheckUsageError(
        f"Audit '{value}' not found (looked for {path} and {value}.toml in ./audit and {PACKAGE_AUDIT_DIR}): "
        "give an existing .toml file or the name of one under audit/."
    )


def load_audit(value: str) -> AuditDefinition:
    """Read an audit definition (TOML).

    Raises:
        PackcheckUsageError: file missing, not TOML, [audit] not a table or another table beside it, unknown keys,
            a value of the wrong type (naming the key, its type and the expected one), no models or an empty list
            (backends, checks, dtypes, versions).
    """
    path = resolve_audit_path(value)
    from ..errors import parse_document

    data = parse_document(read_user_text(path, "Audit file", "pass an audit definition (TOML), e.g. audit/default.toml."),
                          "toml", f"Audit file {path}", "fix the syntax.")
    audit = _audit_table(data, path)
    for key, given in audit.items():
        _check_audit_value(path, key, given)
    models = audit.get("models") or []
    for key in ("backends", "checks", "dtypes", "versions", "stack"):
        if key in audit and not audit[key]:  # an empty value is never "every backend" (README)
            raise PackcheckUsageError(f"Audit file {path}: '{key}' is empty: list at least one, or leave '{key}' out "
                                      "for the default.")
    if not models:
        raise PackcheckUsageError(f"Audit file {path} lists no models: add models = [\"arch:llama\", ...].")

    def opt(key: str) -> tuple[str, ...] | None:
        return tuple(audit[key]) if audit.get(key) else None

    lengths, window = audit.get("lengths"), audit.get("sliding_window")
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
        stack=opt("stack"),
    )
