"""Options (one table serves pytest and the CLI) resolved CLI > env > ini > default into a frozen Settings."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .checks.registry import check_help
from .errors import PackcheckUsageError, closest, read_user_text

OPT_MODELS = "--packcheck-models"
OPT_AUDIT = "--packcheck-audit"
OPT_ALL_ARCHS = "--packcheck-all-architectures"
OPT_BACKENDS = "--packcheck-attn"
OPT_CHECKS = "--packcheck-checks"
OPT_DTYPES = "--packcheck-dtypes"
OPT_WEIGHTS = "--packcheck-weights"
OPT_DEVICE = "--packcheck-device"
OPT_TRUST = "--packcheck-trust-remote-code"
OPT_REPORT_DIR = "--packcheck-report-dir"
OPT_TOLERANCES = "--packcheck-tolerances"
OPT_TOLERANCE = "--packcheck-tolerance"
OPT_BASELINE = "--packcheck-baseline"
OPT_SHARD = "--packcheck-shard"
OPT_VERSIONS = "--packcheck-versions"
OPT_TIMEOUT = "--packcheck-timeout"
OPT_ISOLATION = "--packcheck-isolation"
OPT_RESUME = "--packcheck-resume"
OPT_LENGTHS = "--packcheck-lengths"
OPT_SLIDING_WINDOW = "--packcheck-sliding-window"
OPT_CONFIG = "--packcheck-config"
ISOLATION = ("fork", "none")

DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("random", "pretrained")


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    ini: str | None = None  # ini key (durable settings)
    env: str | None = None
    default: Any = None
    action: str | None = None
    multiple: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS = (
    Option(OPT_MODELS, "Comma-separated model specs: org/name[@rev], a local directory, or arch:<model_type>. "
           "Turns packcheck on.", ini="packcheck_models", env="PACKCHECK_MODELS"),
    Option(OPT_AUDIT, "Audit definition: a name under audit/ (default) or a .toml path; its models are added.",
           ini="packcheck_audit", env="PACKCHECK_AUDIT"),
    Option(OPT_ALL_ARCHS, "Sweep every causal-LM architecture of the installed transformers (arch:<type>), and the multimodal "
           "ones packcheck runs on their text path (M-RoPE).",
           action="store_true", default=False),
    Option(OPT_BACKENDS, "Attention backends (attn_implementation), comma-separated. Default: eager, sdpa, "
           "flex_attention, packcheck_flash_ref (CPU varlen reference), packcheck_flash_torch_varlen (PyTorch's "
           "varlen_attn, CUDA), flash_attention_2, flash_attention_3 (Hopper).",
           ini="packcheck_attn", env="PACKCHECK_ATTN"),
    Option(OPT_CHECKS, check_help(), ini="packcheck_checks", env="PACKCHECK_CHECKS"),
    Option(OPT_DTYPES, "dtypes, comma-separated: float32, bfloat16, float16 (default float32 on CPU, bfloat16 on CUDA).",
           ini="packcheck_dtypes", env="PACKCHECK_DTYPES"),
    Option(OPT_WEIGHTS, "random: config.json only, shrunk, random weights; pretrained: the real weights. "
           "Default: random on CPU, pretrained on CUDA.", ini="packcheck_weights", env="PACKCHECK_WEIGHTS"),
    Option(OPT_DEVICE, "Device: cpu or cuda[:N] (default: cpu).", ini="packcheck_device", env="PACKCHECK_DEVICE", default="cpu"),
    Option(OPT_TRUST, "Allow models that need trust_remote_code (refused otherwise).", action="store_true", default=False),
    Option(OPT_REPORT_DIR, "Where packcheck-matrix.md / .json are written (default: reports).",
           ini="packcheck_report_dir", env="PACKCHECK_REPORT_DIR", default="reports"),
    Option(OPT_TOLERANCES, "Tolerance file (TOML, one table per dtype; default: audit/tolerances.toml).",
           ini="packcheck_tolerances", env="PACKCHECK_TOLERANCES"),
    Option(OPT_TOLERANCE, "Override one tolerance: [dtype.]key=value, e.g. float32.logits_atol=1e-3 (repeatable).",
           action="append", multiple=True),
    Option(OPT_BASELINE, "Baseline results JSON: after the matrix is written, print the changed cells and fail the "
           "session if a cell got worse (the same rules as `packcheck gate`).", ini="packcheck_baseline", env="PACKCHECK_BASELINE"),
    Option(OPT_SHARD, "Run shard I of N (I/N, 1-based): a deterministic slice of the models, so a CI matrix can "
           "spread an audit; join the JSON files with `packcheck merge`.", env="PACKCHECK_SHARD"),
    Option(OPT_VERSIONS, "Library versions to run under, each in its own uv environment over this torch: an axis "
           "'transformers==4.51.3,5.24.0' (axes multiply) or a combination 'transformers==4.51.3 & trl==0.17.0' "
           "(repeatable; ';' separates values in ini/env).", ini="packcheck_versions", env="PACKCHECK_VERSIONS",
           action="append", multiple=True),
    Option(OPT_TIMEOUT, "Seconds one cell may run (its model build included) before its child is killed and the "
           "cell is a timeout (default 600; 0: no limit).", ini="packcheck_timeout", env="PACKCHECK_TIMEOUT"),
    Option(OPT_ISOLATION, "fork (default where available): each model's cells run in a forked child, so a crash "
           "or hang costs one cell; none: in this process.", ini="packcheck_isolation", env="PACKCHECK_ISOLATION"),
    Option(OPT_LENGTHS, "Token lengths of the examples packed into one row, comma-separated, each >= 1 (default "
           "11,7,13; e.g. 11,1,13 puts a one-token example between two; at least two examples, one of them >= 2 tokens; at most 4096 tokens in all).", ini="packcheck_lengths", env="PACKCHECK_LENGTHS"),
    Option(OPT_SLIDING_WINDOW, "The window (tokens, 2 to 4096) a model's longer sliding window is shortened to when packcheck "
           "shrinks it (default 8, so the examples exceed it).", ini="packcheck_sliding_window", env="PACKCHECK_SLIDING_WINDOW"),
    Option(OPT_CONFIG, "Override one config value of every model: key=value (JSON value, or a string), dotted keys "
           "reach sub-configs, e.g. attn_config.clip_qkv=8 (repeatable; a spec's own {key=value} wins). Recorded "
           "in each cell's model record.", action="append", multiple=True),
    Option(OPT_RESUME, "Reuse the cells already in <report dir>/packcheck-journal.jsonl from an interrupted run with "
           "the same settings and versions; run the rest.", action="store_true", default=False),
)


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
    baseline: str | None = None
    shard: tuple[int, int] = (1, 1)
    versions: tuple[Any, ...] = ()  # envs.VersionCombo, one per environment; () = this environment only
    timeout_s: float = 600.0  # per cell; 0 = no limit
    isolation: str = "fork"
    resume: bool = False
    lengths: tuple[int, ...] = (11, 7, 13)  # batches.DEFAULT_LENGTHS
    sliding_window: int = 8  # models.TINY_SLIDING_WINDOW

    def as_dict(self) -> dict[str, Any]:
        return {
            "models": list(self.models), "backends": list(self.backends), "checks": list(self.checks),
            "dtypes": list(self.dtypes), "weights": self.weights, "device": self.device,
            "trust_remote_code": self.trust_remote_code, "audit": self.audit_name,
            "tolerance_source": self.tolerance_source,
            "versions": [v.label for v in self.versions],
            "lengths": list(self.lengths), "sliding_window": self.sliding_window,
        }

    def reproduce_flags(self) -> list[str]:
        """Flags that reproduce this run (the report header prints them): :meth:`to_args` without the
        settings left at their defaults."""
        return self.to_args(skip_defaults=True)

    def to_args(self, tolerance_file: str | None = None, models: list[str] | None = None, report_dir: str | None = None,
                version_child: bool = False, skip_defaults: bool = False) -> list[str]:
        """The ``--packcheck-*`` flags that resolve back into these settings: the one Settings -> argv conversion
        (the report's Reproduce line, the version-environment children). ``tolerance_file``: a TOML file holding
        ``self.tolerances`` (else the tolerances are not passed); ``models`` / ``report_dir`` replace this run's;
        ``version_child``: for the run inside one version environment (no versions, baseline, shard or resume)."""
        flags = [f"{OPT_MODELS}={','.join(models if models is not None else self.models)}",
                 f"{OPT_BACKENDS}={','.join(self.backends)}", f"{OPT_CHECKS}={','.join(self.checks)}",
                 f"{OPT_DTYPES}={','.join(self.dtypes)}", f"{OPT_WEIGHTS}={self.weights}", f"{OPT_DEVICE}={self.device}"]
        if self.trust_remote_code:
            flags.append(OPT_TRUST)
        if report_dir is not None or not skip_defaults or self.report_dir != "reports":
            flags.append(f"{OPT_REPORT_DIR}={report_dir if report_dir is not None else self.report_dir}")
        if tolerance_file:
            flags.append(f"{OPT_TOLERANCES}={tolerance_file}")
        if not skip_defaults or self.timeout_s != 600.0:
            flags.append(f"{OPT_TIMEOUT}={self.timeout_s:g}")
        if not skip_defaults or self.isolation != "fork":
            flags.append(f"{OPT_ISOLATION}={self.isolation}")
        if not skip_defaults or self.lengths != (11, 7, 13):
            flags.append(f"{OPT_LENGTHS}={','.join(map(str, self.lengths))}")
        if not skip_defaults or self.sliding_window != 8:
            flags.append(f"{OPT_SLIDING_WINDOW}={self.sliding_window}")
        if version_child:
            return flags
        if self.baseline:
            flags.append(f"{OPT_BASELINE}={self.baseline}")
        if self.shard != (1, 1):
            flags.append(f"{OPT_SHARD}={self.shard[0]}/{self.shard[1]}")
        flags += [f"{OPT_VERSIONS}={' & '.join(v.requirements)}" for v in self.versions]
        if self.resume:
            flags.append(OPT_RESUME)
        return flags



#: The longest packed row (tokens) and sliding window packcheck's probes take: the eager / sdpa references build
#: a dense [length, length] mask per layer, and the window probes pack examples longer than the window.
MAX_PROBE_TOKENS = 4096


def parse_lengths(value: Any, source: str) -> tuple[int, ...]:
    """Example lengths ``"11,1,13"`` -> (11, 1, 13).

    Raises:
        PackcheckUsageError: not whole numbers >= 1, fewer than two (a packed row needs two examples), every
            example one token (no next-token label: loss and gradient parity have nothing to judge), or a packed
            row longer than :data:`MAX_PROBE_TOKENS`. Any other shape runs every check (two examples included).
    """
    parts = _split(str(value))
    if len(parts) < 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise PackcheckUsageError(f"Bad example lengths '{value}' (from {source}): give at least two whole numbers >= 1, "
                                  f"comma-separated, e.g. {OPT_LENGTHS}=11,1,13.")
    lengths = tuple(int(p) for p in parts)
    if max(lengths) < 2:  # no next-token label: loss_parity and grad_parity would have no reference to judge
        raise PackcheckUsageError(f"Bad example lengths '{value}' (from {source}): every example is 1 token, so no "
                                  "example has a next token to predict and loss / gradient parity cannot be judged; "
                                  "give at least one example of 2 or more tokens, e.g. 11,1,13.")
    if sum(lengths) > MAX_PROBE_TOKENS:
        raise PackcheckUsageError(f"Bad example lengths '{value}' (from {source}): the packed row would be {sum(lengths)} "
                                  f"tokens, over packcheck's {MAX_PROBE_TOKENS} (the references build a dense mask per "
                                  "layer on CPU); give shorter examples, e.g. 11,1,13.")
    return lengths


def _split(value: str | list[str] | tuple[str, ...]) -> list[str]:
    from .specs import split_top  # brace-aware: arch:dbrx{a=1,b=2} is one spec

    items = split_top(value) if isinstance(value, str) else [x for v in value for x in split_top(str(v))]
    return [x.strip() for x in items if x.strip()]


def _with_overrides(spec: str, common: tuple[tuple[str, Any], ...], fmt: Any, parse: Any) -> str:
    """``spec`` with ``common`` overrides added; the spec's own values win."""
    base, own = spec, ()
    if spec.endswith("}") and "{" in spec:
        base, _, body = spec[:-1].partition("{")
        own = parse(body, f"in model spec '{spec}'")
    merged = dict(common) | dict(own)
    return f"{base}{{{fmt(list(merged.items()))}}}"


def _validate_backends(values: list[str], source: str) -> tuple[str, ...]:
    """packcheck's backends, or any attn_implementation the installed transformers knows (its attention
    registry, a kernel-hub repo such as kernels-community/flash-attn, composed names such as paged|sdpa).

    Raises:
        PackcheckUsageError: an empty list, or a name transformers does not know (its own message quoted).
    """
    from .backends import KNOWN_BACKENDS, attn_implementation_refusal

    for v in values:
        if v in KNOWN_BACKENDS:
            continue
        refusal = attn_implementation_refusal(v) if re.fullmatch(r"[\w.|/\-:]+", v) else ("unknown", "not a name")
        if refusal is not None and refusal[0] == "unknown":
            raise PackcheckUsageError(
                f"Unknown backend '{v}' (from {source}): the installed transformers does not take it as "
                f"attn_implementation ({refusal[1][:160]}). Expected one of: {', '.join(KNOWN_BACKENDS)}, or a name "
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


def load_tolerances(path: str | None, overrides: list[str] | None, source: str) -> tuple[dict[str, dict[str, float]], str]:
    """Tolerances per dtype from a TOML file plus ``[dtype.]key=value`` overrides.

    Raises:
        PackcheckUsageError: missing file, bad TOML, unknown dtype or key, or a non-numeric value.
    """
    from .specs import PACKAGE_AUDIT_DIR

    default = PACKAGE_AUDIT_DIR / "tolerances.toml"
    file = Path(path) if path else default
    if not file.exists():
        raise PackcheckUsageError(f"Tolerance file {file} (from {source}) does not exist: pass an existing TOML file.")
    try:
        data = tomllib.loads(read_user_text(file, "Tolerance file", f"pass a TOML file of [dtype] tables (from {source}), e.g. audit/tolerances.toml."))
    except tomllib.TOMLDecodeError as exc:
        raise PackcheckUsageError(f"Tolerance file {file} is not valid TOML ({exc}).") from None
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
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise PackcheckUsageError(
                    f"Tolerance {dtype}.{key} = {value!r} in {file} (from {source}) must be a non-negative number."
                )
        out[dtype] = {**base.get(dtype, {}), **{k: float(v) for k, v in table.items()}}
    for dtype in DTYPES:
        out.setdefault(dtype, dict(base[dtype]))
    label = str(file.name if file == default else file)
    for item in overrides or []:
        lhs, sep, rhs = item.partition("=")
        dtype, _, key = lhs.rpartition(".")
        targets = [dtype] if dtype else list(DTYPES)
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
            number = -1.0
        if not 0 <= number < float("inf"):
            raise PackcheckUsageError(f"Tolerance override '{item}' (from {OPT_TOLERANCE}) needs a non-negative number, got '{rhs}'.")
        for t in targets:
            out[t][key] = number
        label += f" + {item}"
    return out, label


def resolve(get_option: Any, get_ini: Any) -> Settings | None:
    """Resolve every option CLI > env > ini > default. ``get_option(dest)`` returns the CLI value or None,
    ``get_ini(key)`` the ini value or None. Returns None when packcheck is not switched on (no models, no
    audit, no --packcheck-all-architectures).

    Raises:
        PackcheckUsageError: any invalid value, with its source.
    """
    from .backends import KNOWN_BACKENDS
    from .checks.registry import CHECKS, DEFAULT_CHECKS
    from .specs import load_audit

    def pick(opt: Option) -> tuple[Any, str]:
        cli = get_option(opt.dest)
        if isinstance(cli, str) and not cli.strip() and opt.flag != OPT_MODELS:
            # `--packcheck-attn ''` (an unset shell variable): refused, never read as "the default" or "every one"
            raise PackcheckUsageError(f"Empty value {cli!r} for {opt.flag} (from the command line): give a value "
                                      f"(see --help) or leave {opt.flag} out for its default.")
        if cli is not None and cli is not False and cli != []:
            return cli, opt.flag
        if opt.env and os.environ.get(opt.env):
            return os.environ[opt.env], f"${opt.env}"
        if opt.ini and get_ini(opt.ini):
            return get_ini(opt.ini), f"ini {opt.ini}"
        return opt.default, "default"

    by_flag = {o.flag: o for o in OPTIONS}
    models_value, models_source = pick(by_flag[OPT_MODELS])
    audit_value, _audit_source = pick(by_flag[OPT_AUDIT])
    all_archs, _ = pick(by_flag[OPT_ALL_ARCHS])
    if models_value is not None and models_source == OPT_MODELS and not _split(models_value):
        raise PackcheckUsageError(f"The model list from {OPT_MODELS} is empty: give at least one model, e.g. {OPT_MODELS}=arch:llama.")
    if not models_value and not audit_value and not all_archs:
        return None
    models: list[str] = _split(models_value) if models_value else []
    audit = load_audit(audit_value) if audit_value else None
    if audit:
        models += [m for m in audit.models if m not in models]
    if all_archs:
        from .models import causal_lm_architectures, mrope_text_path_architectures

        # every causal LM, then the multimodal models run on their text path (M-RoPE: Qwen2-VL and kin)
        models += [f"arch:{a}" for a in [*causal_lm_architectures(), *mrope_text_path_architectures()]
                   if f"arch:{a}" not in models]
    source = " + ".join(s for s, on in ((models_source, bool(models_value)), (f"audit {audit.path}" if audit else "", bool(audit)), (OPT_ALL_ARCHS, bool(all_archs))) if on)
    if not models:
        raise PackcheckUsageError(f"The model list (from {source}) is empty after filtering: give at least one model.")

    config_items = get_option(by_flag[OPT_CONFIG].dest) or []
    if any(not str(item).strip() for item in config_items):
        raise PackcheckUsageError(f"Empty value '' for {OPT_CONFIG} (from the command line): write key=value, e.g. "
                                  f"{OPT_CONFIG} clip_qkv=8, or leave {OPT_CONFIG} out.")
    if config_items:  # folded into every spec, so the record, the Reproduce line and version children carry them
        from .specs import format_overrides, parse_overrides

        common = parse_overrides(",".join(config_items), f"from {OPT_CONFIG}")
        models = [_with_overrides(m, common, format_overrides, parse_overrides) for m in models]

    device, _ = pick(by_flag[OPT_DEVICE])
    device = str(device)
    if not (device == "cpu" or device.startswith("cuda")):
        raise PackcheckUsageError(f"Unknown device '{device}' (from {OPT_DEVICE}). Expected cpu or cuda[:N].")

    def given_empty(flag: str, what: str, allowed: tuple[str, ...]) -> None:
        # `--packcheck-attn ''` (an unset shell variable) named no value: refused, not read as "every one"
        value, src = pick(by_flag[flag])
        if value is not None and src != "default" and not _split(value):
            raise PackcheckUsageError(f"Empty {what} list {value!r} (from {src}): give at least one of {', '.join(allowed)}, "
                                      f"or leave {flag} out for the default.")

    def names(flag: str, allowed: tuple[str, ...], what: str, audit_default: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
        given_empty(flag, what, allowed)
        value, src = pick(by_flag[flag])
        if value:
            return _validate_names(_split(value), allowed, what, src)
        if audit_default:
            return _validate_names(list(audit_default), allowed, what, f"audit {audit.path if audit else ''}")
        return default

    given_empty(OPT_BACKENDS, "backend", KNOWN_BACKENDS)
    backends_value, backends_src = pick(by_flag[OPT_BACKENDS])
    if backends_value:
        backends = _validate_backends(_split(backends_value), backends_src)
    else:
        backends = names(OPT_BACKENDS, KNOWN_BACKENDS, "backend", audit.backends if audit else None, KNOWN_BACKENDS)
    checks = names(OPT_CHECKS, CHECKS, "check", audit.checks if audit else None, DEFAULT_CHECKS)
    checks = tuple(c for c in CHECKS if c in checks)
    dtypes = names(OPT_DTYPES, DTYPES, "dtype", audit.dtypes if audit else None,
                   ("bfloat16",) if device.startswith("cuda") else ("float32",))
    weights_value, weights_src = pick(by_flag[OPT_WEIGHTS])
    weights = str(weights_value or ("pretrained" if device.startswith("cuda") else "random"))
    _validate_names([weights], WEIGHTS, "weights mode", weights_src)
    archs = [m for m in models if m.startswith("arch:")]
    if weights == "pretrained" and archs and weights_src != "default":
        from .models import loaded_weights

        # an arch: spec has no checkpoint: its cells run shrunk random weights (each cell's model.weights says so)
        if len(archs) == len(models):
            raise PackcheckUsageError(
                f"{OPT_WEIGHTS}=pretrained (from {weights_src}) has no weights to load: every model is an arch: spec "
                f"({', '.join(archs[:3])}{', ...' if len(archs) > 3 else ''}), a config without a checkpoint, which runs "
                f"{loaded_weights('arch', 'pretrained')} weights. Give Hub ids or local folders for pretrained "
                f"weights, or {OPT_WEIGHTS}=random.")
        import warnings

        from .errors import PackcheckWarning

        warnings.warn(PackcheckWarning(
            f"{OPT_WEIGHTS}=pretrained (from {weights_src}): {len(archs)} arch: spec(s) ({', '.join(archs[:3])}"
            f"{', ...' if len(archs) > 3 else ''}) have no checkpoint and run shrunk random weights; each cell's "
            "model record says what it ran (weights: pretrained / random)."), stacklevel=2)
    trust, _ = pick(by_flag[OPT_TRUST])
    report_dir, _ = pick(by_flag[OPT_REPORT_DIR])
    tol_path, tol_src = pick(by_flag[OPT_TOLERANCES])
    if not tol_path and audit and audit.tolerances:
        tol_path, tol_src = str(Path(audit.path).parent / audit.tolerances), f"audit {audit.path}"
    overrides = get_option(by_flag[OPT_TOLERANCE].dest) or []
    tolerances, tol_label = load_tolerances(tol_path, overrides, tol_src)
    baseline, _ = pick(by_flag[OPT_BASELINE])
    shard_value, shard_src = pick(by_flag[OPT_SHARD])
    shard = (1, 1)
    if shard_value:
        i, _, n = str(shard_value).partition("/")
        if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
            raise PackcheckUsageError(f"Bad shard '{shard_value}' (from {shard_src}): write I/N with 1 <= I <= N, e.g. {OPT_SHARD}=2/4.")
        shard = (int(i), int(n))
    versions_value, versions_src = pick(by_flag[OPT_VERSIONS])
    if not versions_value and audit and audit.versions:
        versions_value, versions_src = list(audit.versions), f"audit {audit.path}"
    versions: tuple[Any, ...] = ()
    if versions_value:
        from .envs import parse_versions

        values = [versions_value] if isinstance(versions_value, str) else list(versions_value)
        versions = tuple(parse_versions(values, versions_src))
    timeout_value, timeout_src = pick(by_flag[OPT_TIMEOUT])
    try:
        timeout_s = 600.0 if timeout_value in (None, "") else float(timeout_value)
    except ValueError:
        timeout_s = -1.0
    if not 0 <= timeout_s <= 1e6:  # also nan and inf; beyond ~11 days the OS wait primitives overflow
        raise PackcheckUsageError(f"Bad timeout '{timeout_value}' (from {timeout_src}): give seconds from 0 to 1000000, e.g. {OPT_TIMEOUT}=300 (0: no limit).")
    from .isolation import fork_available

    isolation_value, isolation_src = pick(by_flag[OPT_ISOLATION])
    isolation = str(isolation_value or ("fork" if fork_available() else "none"))
    _validate_names([isolation], ISOLATION, "isolation mode", isolation_src)
    if isolation == "fork" and not fork_available():
        raise PackcheckUsageError(f"Isolation 'fork' (from {isolation_src}) is not available on this platform: use {OPT_ISOLATION}=none.")
    resume, _ = pick(by_flag[OPT_RESUME])
    lengths_value, lengths_src = pick(by_flag[OPT_LENGTHS])
    if not lengths_value and audit and audit.lengths:
        lengths_value, lengths_src = ",".join(map(str, audit.lengths)), f"audit {audit.path}"
    lengths = parse_lengths(lengths_value, lengths_src) if lengths_value else (11, 7, 13)
    window_value, window_src = pick(by_flag[OPT_SLIDING_WINDOW])
    if window_value in (None, "") and audit and audit.sliding_window:
        window_value, window_src = audit.sliding_window, f"audit {audit.path}"
    sliding_window = 8
    if window_value not in (None, ""):
        text = str(window_value).strip()
        if not text.isdigit() or not 2 <= int(text) <= MAX_PROBE_TOKENS:
            raise PackcheckUsageError(f"Bad sliding window '{window_value}' (from {window_src}): give a whole number of tokens "
                                      f"from 2 to {MAX_PROBE_TOKENS} (the window probes pack examples longer than it), "
                                      f"e.g. {OPT_SLIDING_WINDOW}=16.")
        sliding_window = int(text)
    return Settings(
        lengths=lengths, sliding_window=sliding_window,
        timeout_s=timeout_s, isolation=isolation, resume=bool(resume),
        baseline=str(baseline) if baseline else None, shard=shard, versions=versions,
        models=tuple(models), model_source=source, backends=backends, checks=checks, dtypes=dtypes,
        weights=weights, device=device, trust_remote_code=bool(trust), report_dir=str(report_dir),
        tolerances=tolerances, tolerance_source=tol_label, audit_name=audit.name if audit else None,
    )
