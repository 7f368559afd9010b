"""The options of :mod:`.options` resolved CLI > env > ini > default into a frozen :class:`Settings`, and back
into flags (:meth:`Settings.to_args`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PackcheckUsageError, closest, has_control_character
from .options import (
    BY_FLAG,
    DTYPES,
    OPT_ALL_ARCHS,
    OPT_AUDIT,
    OPT_BACKENDS,
    OPT_BASELINE,
    OPT_CHECKS,
    OPT_CONFIG,
    OPT_DEVICE,
    OPT_DTYPES,
    OPT_ISOLATION,
    OPT_LENGTHS,
    OPT_MODELS,
    OPT_REPORT_DIR,
    OPT_RESUME,
    OPT_SHARD,
    OPT_SLIDING_WINDOW,
    OPT_STACK,
    OPT_TIMEOUT,
    OPT_TOLERANCE,
    OPT_TOLERANCES,
    OPT_TRUST,
    OPT_VERSIONS,
    OPT_WEIGHTS,
    OPTIONS,
    SANDBOX_MODES,
    WEIGHTS,
    Option,
    default_of,
    refuse_empty,
)
from .options import split_values as _split


@dataclass(frozen=True)
class Settings:
    """Everything a packcheck run needs, resolved and validated."""

    models: tuple[str, ...]
    model_source: str
    backends: tuple[str, ...]
    checks: tuple[str, ...]
    dtypes: tuple[str, ...]
    weights: str
    device: str
    trust_remote_code: bool
    report_dir: str
    tolerances: dict[str, dict[str, float]] = field(hash=False)
    tolerance_source: str = ""
    audit_name: str | None = None
    baseline: str | None = default_of(OPT_BASELINE)
    baseline_source: str = field(default=OPT_BASELINE, compare=False)  # where baseline came from (flag, $ENV, ini key)
    device_source: str = field(default=OPT_DEVICE, compare=False)  # where device came from (trial 16, 156: $PACKCHECK_DEVICE)
    shard: tuple[int, int] = default_of(OPT_SHARD)
    versions: tuple[Any, ...] = default_of(OPT_VERSIONS)  # envs.VersionCombo, one per environment; () = this environment only
    #: where ``versions`` came from (the flag, $PACKCHECK_VERSIONS, an audit file), named in its errors
    versions_source: str = OPT_VERSIONS
    #: where ``report_dir`` came from (the flag or $PACKCHECK_REPORT_DIR), named in its errors
    report_dir_source: str = OPT_REPORT_DIR
    timeout_s: float = default_of(OPT_TIMEOUT)  # per cell; 0 = no limit
    sandbox: str = default_of(OPT_ISOLATION)  # fork / none (--packcheck-isolation): where a model's cells run
    resume: bool = default_of(OPT_RESUME)
    lengths: tuple[int, ...] = default_of(OPT_LENGTHS)  # example lengths (tokens) of the packed row
    sliding_window: int = default_of(OPT_SLIDING_WINDOW)  # tokens a longer window is shortened to
    stack: tuple[str, ...] = default_of(OPT_STACK)  # stack elements (model/stack.py), each its own cells; () none

    @property
    def stack_libraries(self) -> tuple[str, ...]:
        """The distributions the stack elements need (model/stack.py's ``library``: peft, accelerate, liger-kernel), in
        table order: what a version environment installs besides the combination (versions.envs.check_requirements)."""
        from ..model.stack import BY_NAME

        return tuple(dict.fromkeys(lib for n in self.stack if n in BY_NAME and (lib := BY_NAME[n].library)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "models": list(self.models), "backends": list(self.backends), "checks": list(self.checks),
            "dtypes": list(self.dtypes), "weights": self.weights, "device": self.device,
            "trust_remote_code": self.trust_remote_code, "audit": self.audit_name,
            "tolerance_source": self.tolerance_source,
            "versions": [v.label for v in self.versions],
            "lengths": list(self.lengths), "sliding_window": self.sliding_window,
            **({"stack": list(self.stack)} if self.stack else {}),
            # the per-cell limit and where cells ran: a limit is enforced only in a forked child (isolation "fork")
            "isolation": self.sandbox, "timeout_s": self.timeout_s,
            # [index, count] of a sharded run, so `packcheck merge` can tell when shards are missing
            **({"shard": list(self.shard)} if self.shard[1] > 1 else {}),
        }

    def reproduce_flags(self) -> list[str]:
        """Flags that reproduce this run (the report header prints them): :meth:`to_args` without the
        settings left at their defaults, plus one ``--packcheck-tolerance dtype.key=value`` per tolerance of a
        measured dtype that is not the shipped default (from a file or an override alike: the Reproduce line of a
        run judged at float32.logits_atol=1e-9 reran at the default and passed)."""
        from .tolerances import default_tolerances

        shipped = default_tolerances()
        return self.to_args(skip_defaults=True) + [
            f"{OPT_TOLERANCE}={dtype}.{key}={value!r}" for dtype in self.dtypes
            for key, value in sorted(self.tolerances.get(dtype, {}).items()) if shipped.get(dtype, {}).get(key) != value]

    def to_args(self, tolerance_file: str | None = None, models: list[str] | None = None, report_dir: str | None = None,
                version_child: bool = False, skip_defaults: bool = False) -> list[str]:
        """The ``--packcheck-*`` flags that resolve back into these settings: the one Settings -> argv conversion
        (the report's Reproduce line, the version-environment children), read from the option table (each
        option's ``field``, ``to_arg``, ``in_child``, ``always`` and ``default``). ``tolerance_file``: a TOML file
        holding ``self.tolerances`` (else the tolerances are not passed); ``models`` / ``report_dir`` replace this
        run's; ``version_child``: for the run inside one version environment (no versions, baseline, shard or
        resume); ``skip_defaults``: leave out the options at their default."""
        given = {OPT_MODELS: models, OPT_REPORT_DIR: report_dir, OPT_TOLERANCES: tolerance_file or None}
        flags: list[str] = []
        # the options a version child gets first, then the session-only ones (baseline, shard, versions, resume)
        for child_pass in (True, False) if not version_child else (True,):
            for opt in (o for o in OPTIONS if o.in_child == child_pass):
                forced = given.get(opt.flag) is not None
                if not forced and opt.field is None:
                    continue  # folded into another option (audit and --packcheck-config into models, ...)
                value = given[opt.flag] if forced else getattr(self, opt.field or "")
                if opt.to_arg is None:  # a store_true switch
                    flags += [opt.flag] if value else []
                elif forced or opt.always or value != opt.default or (opt.in_child and not skip_defaults):
                    flags += [f"{opt.flag}={opt.to_arg(v)}" for v in (value if opt.multiple else [value])]
        return flags


def _with_overrides(spec: str, common: tuple[tuple[str, Any], ...], fmt: Any, parse: Any) -> str:
    """``spec`` with ``common`` overrides added; the spec's own values win."""
    base, own = spec, ()
    if spec.endswith("}") and "{" in spec:
        base, _, body = spec[:-1].partition("{")
        own = parse(body, f"in model spec '{spec}'")
    merged = dict(common) | dict(own)
    return f"{base}{{{fmt(list(merged.items()))}}}"


def _first_sentence(message: str, width: int = 160) -> str:
    """The first sentence of a library's message, cut at a word boundary (never mid-word) when still too long."""
    import textwrap

    head = re.split(r"(?<=[.!?])\s", message.strip(), maxsplit=1)[0].rstrip(".")
    return textwrap.shorten(head, width=width, placeholder=" ...")


def _validate_backends(values: list[str], source: str) -> tuple[str, ...]:
    """packcheck's backends, or any attn_implementation the installed transformers knows (its attention
    registry, a kernel-hub repo such as kernels-community/flash-attn, composed names such as paged|sdpa).

    Raises:
        PackcheckUsageError: an empty list, or a name transformers does not know (its own message quoted).
    """
    from ..backends import KNOWN_BACKENDS, attn_implementation_refusal

    for v in values:
        if v in KNOWN_BACKENDS:
            continue
        refusal = attn_implementation_refusal(v) if re.fullmatch(r"[\w.|/\-:]+", v) else ("unknown", "not a name")
        if refusal is not None and refusal[0] == "unknown":
            raise PackcheckUsageError(
                f"Unknown backend '{v}' (from {source}): the installed transformers does not take it as "
                f"attn_implementation ({_first_sentence(refusal[1])}). Expected one of: {', '.join(KNOWN_BACKENDS)}, or a name "
                f"of transformers' attention registry / a kernel-hub repo.{closest(v, KNOWN_BACKENDS)}")
    if not values:
        raise PackcheckUsageError(f"Empty backend list (from {source}): give at least one of {', '.join(KNOWN_BACKENDS)}.")
    return tuple(dict.fromkeys(values))


def _validate_names(values: list[str], allowed: tuple[str, ...], what: str, source: str) -> tuple[str, ...]:
    for v in values:
        if v not in allowed:
            raise PackcheckUsageError(
                f"Unknown {what} '{v}' (from {source}). Expected one of: {', '.join(allowed)}.{closest(v, allowed)}"
            )
    if not values:
        raise PackcheckUsageError(f"Empty {what} list (from {source}): give at least one of {', '.join(allowed)}.")
    return tuple(dict.fromkeys(values))


def off_without_models(get_option: Any) -> str | None:
    """The line a run prints when packcheck is off (:func:`resolve` returned None: no models, no audit, no
    --packcheck-all-architectures) though packcheck options were given on the command line (``--packcheck-attn
    sdpa`` alone did nothing, silently); None when none was given. ``get_option(dest)`` as for :func:`resolve`."""
    given = [opt.flag for opt in OPTIONS
             if opt.flag not in (OPT_MODELS, OPT_AUDIT, OPT_ALL_ARCHS) and get_option(opt.dest) not in (None, False, [])]
    if not given:
        return None
    return (f"packcheck: off: {', '.join(given)} given but no models, so packcheck ran nothing; turn it on with "
            f"{OPT_MODELS} (e.g. {OPT_MODELS}=arch:llama), {OPT_AUDIT} or {OPT_ALL_ARCHS}.")


def fork_available() -> bool:
    """Whether this platform can fork (the ``fork`` isolation mode, :mod:`pytest_packcheck.run.sandbox`)."""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


class _Sources:
    """Where each option's value comes from, CLI > env > ini > default (:meth:`pick`), and, once loaded, the audit
    whose values stand in for an option not given (:meth:`parsed`, :meth:`names`)."""

    def __init__(self, get_option: Any, get_ini: Any) -> None:
        self.get_option, self.get_ini = get_option, get_ini
        self.audit: Any = None

    def pick(self, opt: Option) -> tuple[Any, str]:
        cli = self.get_option(opt.dest)
        if isinstance(cli, str) and not cli.strip() and opt.flag != OPT_MODELS:
            refuse_empty(cli, opt.flag)  # `--packcheck-attn ''` (an unset shell variable)
        if cli is not None and cli is not False and cli != []:
            return cli, opt.flag
        if opt.env and os.environ.get(opt.env):
            return os.environ[opt.env], f"${opt.env}"
        if opt.ini and self.get_ini(opt.ini):
            value = self.get_ini(opt.ini)
            if isinstance(value, str) and "\n" in value.strip():
                # a list over lines, pytest's own ini style (packcheck_models =\n    arch:llama\n    arch:gpt2): one
                # item per line, as the flag takes them (hostile trial 5: refused as "a control character")
                lines = [line.strip() for line in value.splitlines() if line.strip()]
                value = lines if opt.multiple else ",".join(lines)
            return value, f"ini {opt.ini}"
        return opt.default, "default"

    def audit_source(self) -> str:
        return f"audit {self.audit.path if self.audit else ''}"

    def parsed(self, opt: Option) -> Any:
        """An option with a ``parse``: given (CLI > env > ini), else the audit's value of the same field (lengths,
        sliding_window), else the table's default; a given or audit value goes through the row's ``parse``."""
        value, src = self.pick(opt)
        if src == "default" and getattr(self.audit, opt.field or "", None) is not None:
            value, src = getattr(self.audit, opt.field or ""), self.audit_source()
        return value if src == "default" else opt.parse(value, src) if opt.parse else value

    def given_empty(self, flag: str, what: str, allowed: tuple[str, ...]) -> None:
        # `--packcheck-attn ''` (an unset shell variable) named no value: refused, not read as "every one"
        value, src = self.pick(BY_FLAG[flag])
        if value is not None and src != "default" and not _split(value):
            raise PackcheckUsageError(f"Empty {what} list {value!r} (from {src}): give at least one of {', '.join(allowed)}, "
                                      f"or leave {flag} out for the default.")

    @staticmethod
    def no_empty_item(value: Any, flag: str, src: str) -> None:
        """``isolation,,logits_parity`` (a slip) was taken silently (trial of issue 42): refused as the lengths are."""
        from ..model.specs import split_top

        for one in ([value] if isinstance(value, str) else list(value or [])):
            parts = split_top(str(one))
            empty = [i + 1 for i, part in enumerate(parts) if not part.strip()]
            if empty and len(parts) > 1:
                where = flag if src == flag else f"{flag}, from {src}"
                raise PackcheckUsageError(f"Bad list {str(one)!r} ({where}): item {empty[0]} of {len(parts)} is empty; "
                                          "write the names separated by single commas.")

    def names(self, flag: str, allowed: tuple[str, ...], what: str, audit_default: tuple[str, ...] | None,
              default: tuple[str, ...]) -> tuple[str, ...]:
        self.given_empty(flag, what, allowed)
        value, src = self.pick(BY_FLAG[flag])
        if value:
            self.no_empty_item(value, flag, src)
            return _validate_names(_split(value), allowed, what, src)
        if audit_default:
            return _validate_names(list(audit_default), allowed, what, self.audit_source())
        return default


def _warn(message: str) -> None:
    """A :class:`~pytest_packcheck.errors.PackcheckWarning` attributed to :func:`resolve`'s caller."""
    import warnings

    from ..errors import PackcheckWarning

    warnings.warn(PackcheckWarning(message), stacklevel=4)  # _warn <- a step of resolve <- resolve <- its caller


def _warn_unknown_env_vars() -> None:
    from .options import unknown_env_vars

    for name, hint in unknown_env_vars(dict(os.environ)):
        _warn(f"Environment variable ${name} is not one packcheck reads: it is ignored.{hint} "
              "`packcheck audit --help` names each option's variable.")


def _suite_of(check: str) -> str | None:
    """The registry's suite of ``check`` (None for a name it does not hold)."""
    from ..checks.registry import SPECS

    spec = SPECS.get(check)
    return spec.suite if spec else None


def _models(src: _Sources) -> tuple[list[str], str] | None:
    """The model specs (given, the audit's, every architecture with --packcheck-all-architectures), each with the
    --packcheck-config overrides folded in, and where they came from; loads the audit into ``src``. None when
    packcheck is not switched on."""
    from .audits import load_audit

    models_value, models_source = src.pick(BY_FLAG[OPT_MODELS])
    audit_value, _audit_source = src.pick(BY_FLAG[OPT_AUDIT])
    all_archs, _ = src.pick(BY_FLAG[OPT_ALL_ARCHS])
    if models_value is not None and models_source == OPT_MODELS and not _split(models_value):
        raise PackcheckUsageError(f"The model list from {OPT_MODELS} is empty: give at least one model, e.g. {OPT_MODELS}=arch:llama.")
    if not models_value and not audit_value and not all_archs:
        return None
    models: list[str] = _split(models_value) if models_value else []
    audit = src.audit = load_audit(audit_value) if audit_value else None
    if audit:
        models += [m for m in audit.models if m not in models]
    if all_archs and audit and audit.models and all(m.startswith("encoder:") for m in audit.models):
        from ..model.architectures import encoder_architectures

        # an encoder audit (audit/encoders.toml): every architecture with a masked-LM head, built as an encoder
        models += [f"encoder:{a}" for a in encoder_architectures() if f"encoder:{a}" not in models]
    elif all_archs and audit and audit.checks and all(_suite_of(c) == "multimodal" for c in audit.checks):
        from ..checks.pixels import multimodal_specs

        # a multimodal audit (audit/multimodal.toml): every VLM packcheck lays out pixel rows for, at its tiny spec
        have = {m.split(":", 1)[-1].split("{", 1)[0] for m in models}
        models += [s for s in multimodal_specs() if s.split(":", 1)[-1].split("{", 1)[0] not in have]
    elif all_archs:
        from ..model.architectures import causal_lm_architectures, mrope_text_path_architectures

        # every causal LM, then the multimodal models run on their text path (M-RoPE: Qwen2-VL and kin)
        models += [f"arch:{a}" for a in [*causal_lm_architectures(), *mrope_text_path_architectures()]
                   if f"arch:{a}" not in models]
    source = " + ".join(s for s, on in ((models_source, bool(models_value)), (f"audit {audit.path}" if audit else "", bool(audit)), (OPT_ALL_ARCHS, bool(all_archs))) if on)
    if not models:
        raise PackcheckUsageError(f"The model list (from {source}) is empty after filtering: give at least one model.")

    config_items = src.get_option(BY_FLAG[OPT_CONFIG].dest) or []
    if any(not str(item).strip() for item in config_items):
        raise PackcheckUsageError(f"Empty value '' for {OPT_CONFIG} (from the command line): write key=value, e.g. "
                                  f"{OPT_CONFIG} clip_qkv=8, or leave {OPT_CONFIG} out.")
    from ..model.configs import CONFIG_OPTION_OVERRIDES

    CONFIG_OPTION_OVERRIDES.clear()  # this run's alone: a process that runs several sessions kept the last one's
    if config_items:  # folded into every spec, so the record, the Reproduce line and version children carry them
        from ..model.specs import format_overrides, parse_overrides

        common = parse_overrides(",".join(config_items), f"from {OPT_CONFIG}")
        CONFIG_OPTION_OVERRIDES.update(common)
        models = [_with_overrides(m, common, format_overrides, parse_overrides) for m in models]
    from ..model.specs import parse_model_list

    parse_model_list(models, source)  # a malformed spec, or two with one label, refused before any cell runs
    return models, source


def _selection(src: _Sources, device: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(backends, checks in matrix order, dtypes): given, else the audit's, else the defaults (bfloat16 on CUDA)."""
    from ..backends import DEFAULT_BACKENDS, KNOWN_BACKENDS
    from ..checks.registry import CHECKS, DEFAULT_CHECKS

    audit = src.audit
    src.given_empty(OPT_BACKENDS, "backend", KNOWN_BACKENDS)
    backends_value, backends_src = src.pick(BY_FLAG[OPT_BACKENDS])
    if backends_value:
        src.no_empty_item(backends_value, OPT_BACKENDS, backends_src)
        backends = _validate_backends(_split(backends_value), backends_src)
    else:
        backends = src.names(OPT_BACKENDS, KNOWN_BACKENDS, "backend", audit.backends if audit else None, DEFAULT_BACKENDS)
    checks = src.names(OPT_CHECKS, CHECKS, "check", audit.checks if audit else None, DEFAULT_CHECKS)
    checks = tuple(c for c in CHECKS if c in checks)
    dtypes = src.names(OPT_DTYPES, DTYPES, "dtype", audit.dtypes if audit else None,
                       ("bfloat16",) if device.startswith("cuda") else ("float32",))
    return backends, checks, dtypes


def _weights(src: _Sources, models: list[str], source: str, device: str) -> str:
    """The weights mode (given, else pretrained on CUDA, random elsewhere), refused where pretrained has no weights
    to load (a local folder without a weights file, arch: specs only) and warned where some arch: specs run random."""
    weights_value, weights_src = src.pick(BY_FLAG[OPT_WEIGHTS])
    weights = str(weights_value or ("pretrained" if device.startswith("cuda") else "random"))
    _validate_names([weights], WEIGHTS, "weights mode", weights_src)
    archs = [m for m in models if m.startswith("arch:")]
    if weights == "pretrained":  # a local folder with no weights file: refused before any cell runs
        from ..model.resolve import refuse_local_without_weights
        from ..model.specs import parse_model_spec

        for m in models:
            if not m.startswith("arch:"):
                refuse_local_without_weights(parse_model_spec(m, source), source, OPT_WEIGHTS,
                                             weights_src if weights_src != "default" else f"the default on {device}")
    if weights == "pretrained" and archs and weights_src != "default":
        from ..model.resolve import loaded_weights

        # an arch: spec has no checkpoint: its cells run shrunk random weights (each cell's model.weights says so)
        if len(archs) == len(models):
            raise PackcheckUsageError(
                f"{OPT_WEIGHTS}=pretrained (from {weights_src}) has no weights to load: every model is an arch: spec "
                f"({', '.join(archs[:3])}{', ...' if len(archs) > 3 else ''}), a config without a checkpoint, which runs "
                f"{loaded_weights('arch', 'pretrained')} weights. Give Hub ids or local folders for pretrained "
                f"weights, or {OPT_WEIGHTS}=random.")
        _warn(f"{OPT_WEIGHTS}=pretrained (from {weights_src}): {len(archs)} arch: spec(s) ({', '.join(archs[:3])}"
              f"{', ...' if len(archs) > 3 else ''}) have no checkpoint and run shrunk random weights; each cell's "
              "model record says what it ran (weights: pretrained / random).")
    return weights


def _tolerances(src: _Sources, dtypes: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """(tolerances by dtype, where they came from): the given file, else the audit's, else the shipped ones, with the
    --packcheck-tolerance overrides; warned where an override sets a dtype this run does not measure."""
    from .tolerances import load_tolerances

    audit = src.audit
    tol_path, tol_src = src.pick(BY_FLAG[OPT_TOLERANCES])
    if not tol_path and audit and audit.tolerances:
        tol_path, tol_src = str(Path(audit.path).parent / audit.tolerances), f"audit {audit.path}"
    overrides = src.get_option(BY_FLAG[OPT_TOLERANCE].dest) or []
    tolerances, tol_label = load_tolerances(tol_path, overrides, tol_src)
    unused = [o for o in overrides if "." in o.partition("=")[0] and o.partition("=")[0].rpartition(".")[0] not in dtypes]
    if unused:
        _warn(f"Tolerance override {', '.join(repr(o) for o in unused)} (from {OPT_TOLERANCE}) sets a dtype this run does "
              f"not measure (dtypes: {', '.join(dtypes)}): it changes no verdict. Add {OPT_DTYPES} "
              f"{','.join(dict.fromkeys([*dtypes, *(o.partition('=')[0].rpartition('.')[0] for o in unused)]))} to use it.")
    return tolerances, tol_label


def _versions(src: _Sources) -> tuple[tuple[Any, ...], str]:
    """(the version combinations, where they came from): given, else the audit's; the environments' cache is
    checked once when there are any."""
    audit = src.audit
    versions_value, versions_src = src.pick(BY_FLAG[OPT_VERSIONS])
    if not versions_value and audit and audit.versions:
        versions_value, versions_src = list(audit.versions), f"audit {audit.path}"
    versions: tuple[Any, ...] = default_of(OPT_VERSIONS)
    if versions_value:
        from ..versions.envs import parse_versions

        values = [versions_value] if isinstance(versions_value, str) else list(versions_value)
        versions = tuple(parse_versions(values, versions_src))
        if versions:  # the cache the environments live in, checked once, before any cell (issue 42)
            from ..versions.envs import check_cache_root

            check_cache_root()
    return versions, versions_src


def _sandbox(src: _Sources, timeout_s: Any) -> str:
    """The isolation mode (fork where the platform can, else none), warned where a given timeout cannot be
    enforced (in this process there is no child to kill)."""
    sandbox_value, sandbox_src = src.pick(BY_FLAG[OPT_ISOLATION])
    fork, in_process = SANDBOX_MODES
    sandbox = str(sandbox_value if sandbox_src != "default" or fork_available() else in_process)
    _validate_names([sandbox], SANDBOX_MODES, "isolation mode", sandbox_src)
    if sandbox == fork and not fork_available():
        raise PackcheckUsageError(f"Isolation 'fork' (from {sandbox_src}) is not available on this platform: use {OPT_ISOLATION}=none.")
    _timeout_value, timeout_src = src.pick(BY_FLAG[OPT_TIMEOUT])
    if sandbox == in_process and timeout_s and timeout_src != "default":
        # the limit is enforced by killing the cell's forked child (run/sandbox.py): in this process there is none
        _warn(f"The timeout {timeout_s:g} s (from {timeout_src}) is not enforced: a timeout needs "
              f"{OPT_ISOLATION}=fork (the cell's child is killed at the limit), and isolation is 'none' (from {sandbox_src}), "
              f"so cells run in this process without a limit. Drop {OPT_ISOLATION}=none to enforce it.")
    return sandbox


def resolve(get_option: Any, get_ini: Any) -> Settings | None:
    """Resolve every option CLI > env > ini > default. ``get_option(dest)`` returns the CLI value or None,
    ``get_ini(key)`` the ini value or None. Returns None when packcheck is not switched on (no models, no
    audit, no --packcheck-all-architectures).

    Raises:
        PackcheckUsageError: any invalid value, with its source.
    """
    _warn_unknown_env_vars()
    src = _Sources(get_option, get_ini)
    picked = _models(src)
    if picked is None:
        return None
    models, source = picked
    audit = src.audit
    device = src.parsed(BY_FLAG[OPT_DEVICE])
    device_src = src.pick(BY_FLAG[OPT_DEVICE])[1]
    backends, checks, dtypes = _selection(src, device)
    weights = _weights(src, models, source, device)
    trust, _ = src.pick(BY_FLAG[OPT_TRUST])
    report_dir, report_dir_src = src.pick(BY_FLAG[OPT_REPORT_DIR])
    if has_control_character(str(report_dir)):  # a newline made a folder (hostile trial 4)
        raise PackcheckUsageError(f"Report folder {str(report_dir)!r} (from {report_dir_src or OPT_REPORT_DIR}) holds a "
                                  "control character (a newline, tab, ...): give a folder name without one.")
    tolerances, tol_label = _tolerances(src, dtypes)
    baseline, baseline_src = src.pick(BY_FLAG[OPT_BASELINE])
    versions, versions_src = _versions(src)
    # every other option with a parse (shard, timeout_s, lengths, sliding_window, ...): its row says it all
    parsed_fields = {opt.field: src.parsed(opt) for opt in OPTIONS if opt.parse and opt.field and opt.field != "device"}
    sandbox = _sandbox(src, parsed_fields.get("timeout_s"))
    resume, _ = src.pick(BY_FLAG[OPT_RESUME])
    return Settings(
        **parsed_fields, sandbox=sandbox, resume=bool(resume),
        baseline=str(baseline) if baseline else None, baseline_source=baseline_src, device_source=device_src, versions=versions,
        versions_source=versions_src or OPT_VERSIONS,
        models=tuple(models), model_source=source, backends=backends, checks=checks, dtypes=dtypes,
        weights=weights, device=device, trust_remote_code=bool(trust), report_dir=str(report_dir),
        report_dir_source=report_dir_src if report_dir_src and report_dir_src != "default" else OPT_REPORT_DIR,
        tolerances=tolerances, tolerance_source=tol_label, audit_name=audit.name if audit else None,
    )
