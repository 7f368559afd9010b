"""The option table: one record per ``--packcheck-*`` option, shared by the pytest plugin and the ``packcheck`` CLI.

Each :class:`Option` says once what the rest of packcheck needs: its flag, ini key, environment variable, help,
default, how a given value is parsed and checked (``parse``), which :class:`~.settings.Settings` field it
fills (``field``) and how that value becomes a flag again (``to_arg``, for the report's Reproduce line and the
version-environment children: :meth:`~.settings.Settings.to_args`). Every other module reads defaults from
here (:func:`default_of`), never retypes them.

Importing this module imports neither torch nor transformers (the plugin imports it while pytest loads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backends.table import backends_help
from ..checks.registry import check_help
from ..errors import PackcheckUsageError, refuse_empty  # noqa: F401 - refuse_empty: re-exported (its callers read it here)
from ..model.stack import stack_help
from .flags import (  # the flags' names, re-exported: callers read them here
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
)

#: How a model's cells run: in a forked child (a crash or hang costs one cell) or in this process.
SANDBOX_MODES = ("fork", "none")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("random", "pretrained")

#: The longest packed row (tokens) and sliding window packcheck's probes take: the eager / sdpa references build
#: a dense [length, length] mask per layer, and the window probes pack examples longer than the window.
MAX_PROBE_TOKENS = 4096

#: Example lengths (tokens) of the packed row. Longer than the shrunk sliding window (8), different from each
#: other so that a boundary off by one token moves a measurable logit.
_LENGTHS = (11, 7, 13)
#: The window (tokens) a model's longer sliding window is shortened to when packcheck shrinks it: shorter than
#: the examples, so the window acts inside the packed row.
_SLIDING_WINDOW = 8
#: Seconds one cell may run (model build included) before its child is killed; 0: no limit.
_TIMEOUT_S = 600.0


def split_values(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """Comma-separated items (brace-aware: ``arch:dbrx{a=1,b=2}`` is one item), stripped, empty ones dropped."""
    from ..model.specs import split_top

    items = split_top(value) if isinstance(value, str) else [x for v in value for x in split_top(str(v))]
    return [x.strip() for x in items if x.strip()]


def parse_stack(value: Any, source: str) -> tuple[str, ...]:
    """Stack elements ``"lora,cp"`` (or an audit's ``["lora", "cp"]``) -> ("lora", "cp"), each once, in the order
    given; ``none`` -> () (no element: how a default is written back as a flag).

    Raises:
        PackcheckUsageError: a name that is not in the stack table (model/stack.py), or an empty item, in one line
            naming the value, where it came from and the valid names.
    """
    from ..errors import closest
    from ..model.stack import STACK_NAMES

    items = [p.strip() for p in (value.split(",") if isinstance(value, str) else [str(v) for v in value])]
    if items == ["none"]:
        return ()
    for item in items:
        if item not in STACK_NAMES:
            shown = f"item {items.index(item) + 1} is empty" if not item else f"unknown stack element '{item}'"
            raise PackcheckUsageError(f"Bad {OPT_STACK} value '{value if isinstance(value, str) else ','.join(items)}' "
                                      f"(from {source}): {shown}. Expected one or more of: {', '.join(STACK_NAMES)} "
                                      f"(or none).{closest(item, STACK_NAMES) if item else ''}")
    return tuple(dict.fromkeys(items))


def parse_lengths(value: Any, source: str) -> tuple[int, ...]:
    """Example lengths ``"11,1,13"`` (or an audit's ``[11, 1, 13]``) -> (11, 1, 13).

    Raises:
        PackcheckUsageError: an empty item (``5,,5``), not whole numbers >= 1, fewer than two (a packed row needs two
            examples), every example one token (no next-token label: loss and gradient parity have nothing to
            judge), or a packed row longer than :data:`MAX_PROBE_TOKENS`. Any other shape runs every check (two examples included).
    """
    from ..model.specs import split_top

    value = value if isinstance(value, str) else ",".join(map(str, value))  # an audit's list
    parts = [p.strip() for p in split_top(value)]
    empty = [i for i, p in enumerate(parts, 1) if not p]
    if empty and len(parts) > 1:  # `5,,5` is not `5,5`: one example the user meant is missing (a wholly empty value: below)
        raise PackcheckUsageError(f"Bad example lengths '{value}' (from {source}): item {empty[0]} of {len(parts)} is "
                                  f"empty; give one whole number >= 1 per example, e.g. {OPT_LENGTHS}=11,1,13.")
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


def parse_sliding_window(value: Any, source: str) -> int:
    """A window ``"16"`` (tokens) -> 16.

    Raises:
        PackcheckUsageError: not a whole number from 2 to :data:`MAX_PROBE_TOKENS`.
    """
    text = str(value).strip()
    if not text.isdigit() or not 2 <= int(text) <= MAX_PROBE_TOKENS:
        raise PackcheckUsageError(f"Bad sliding window '{value}' (from {source}): give a whole number of tokens "
                                  f"from 2 to {MAX_PROBE_TOKENS} (the window probes pack examples longer than it), "
                                  f"e.g. {OPT_SLIDING_WINDOW}=16.")
    return int(text)


def parse_timeout(value: Any, source: str) -> float:
    """Seconds ``"300"`` -> 300.0 (0: no limit).

    Raises:
        PackcheckUsageError: not a number from 0 to 1,000,000 (nan and inf included).
    """
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = -1.0
    if not 0 <= timeout_s <= 1e6:  # also nan and inf; beyond ~11 days the OS wait primitives overflow
        raise PackcheckUsageError(f"Bad timeout '{value}' (from {source}): give seconds from 0 to 1000000, e.g. {OPT_TIMEOUT}=300 (0: no limit).")
    return timeout_s


def parse_shard(value: Any, source: str, example: str = f"{OPT_SHARD}=2/4") -> tuple[int, int]:
    """``"2/4"`` -> (2, 4), as ``--packcheck-shard`` and ``packcheck atlas --shard`` read it. ``example``: the
    spelling the error shows.

    Raises:
        PackcheckUsageError: not I/N with 1 <= I <= N.
    """
    i, _, n = str(value).partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise PackcheckUsageError(f"Bad shard '{value}' (from {source}): write I/N with 1 <= I <= N, e.g. {example}.")
    return int(i), int(n)


def shard_holds(model_index: int, shard: tuple[int, int] | list[int]) -> bool:
    """Whether shard ``(I, N)`` runs the audit's model number ``model_index`` (0-based, in audit order): whole
    models dealt round-robin, the one rule of the session, its version environments and the gate's planned cells."""
    index, count = shard
    return model_index % count == index - 1


def parse_device(value: Any, source: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (N the GPU index): the devices packcheck runs on (``--packcheck-device``,
    ``packcheck bench --device``).

    Raises:
        PackcheckUsageError: any other device (``tpu``, ``cudax``, ``cuda:a``), naming it, its source and the accepted ones.
    """
    import re

    device = str(value).strip()
    if not (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device)):
        raise PackcheckUsageError(f"Unknown device '{device}' (from {source}). Expected cpu, cuda or cuda:N (the GPU's index, "
                                  "e.g. cuda:0).")
    return device


def _joined(values: Any) -> str:
    return ",".join(map(str, values))


@dataclass(frozen=True)
class Option:
    """One ``--packcheck-*`` option. ``field``: the :class:`~.settings.Settings` field it resolves into (None: it is
    folded into another one, as the audit's models into ``models``). ``parse(value, source)``: the checked value
    of a given string (errors name ``source``). ``to_arg(value)``: the text after ``flag=`` (store_true options
    have none). ``in_child``: a version-environment child run gets it too. ``always``: the Reproduce line names it
    even at its default. ``measures``: its value changes what a cell measures (the probe row, the weights, the
    kernels), so two results files that differ in it hold different measurements under one cell id
    (:data:`PROBE_SETTINGS`)."""

    flag: str
    help: str
    ini: str | None = None  # ini key (durable settings)
    env: str | None = None
    default: Any = None
    action: str | None = None
    multiple: bool = False
    field: str | None = None
    parse: Callable[[Any, str], Any] | None = None
    to_arg: Callable[[Any], str] | None = str
    in_child: bool = True
    always: bool = False
    measures: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS = (
    Option(OPT_MODELS, "Comma-separated model specs: org/name[@rev], a local directory, or arch:<model_type>. "
           "Turns packcheck on.", ini="packcheck_models", env="PACKCHECK_MODELS", field="models", to_arg=_joined,
           always=True),
    Option(OPT_AUDIT, "Audit definition: a name under audit/ (default) or a .toml path; its models are added.",
           ini="packcheck_audit", env="PACKCHECK_AUDIT"),
    Option(OPT_ALL_ARCHS, "Sweep every causal-LM architecture of the installed transformers (arch:<type>), and the multimodal "
           "ones packcheck runs on their text path (M-RoPE).",
           action="store_true", default=False),
    Option(OPT_BACKENDS, backends_help(),
           ini="packcheck_attn", env="PACKCHECK_ATTN", field="backends", to_arg=_joined, always=True),
    Option(OPT_CHECKS, check_help(), ini="packcheck_checks", env="PACKCHECK_CHECKS", field="checks", to_arg=_joined,
           always=True),
    Option(OPT_DTYPES, "dtypes, comma-separated: float32, bfloat16, float16 (default float32 on CPU, bfloat16 on CUDA).",
           ini="packcheck_dtypes", env="PACKCHECK_DTYPES", field="dtypes", to_arg=_joined, always=True),
    Option(OPT_WEIGHTS, "random: config.json only, shrunk, random weights; pretrained: the real weights. "
           "Default: random on CPU, pretrained on CUDA.", ini="packcheck_weights", env="PACKCHECK_WEIGHTS",
           field="weights", always=True, measures=True),
    Option(OPT_DEVICE, "Device: cpu or cuda[:N] (default: cpu).", ini="packcheck_device", env="PACKCHECK_DEVICE", default="cpu",
           field="device", parse=parse_device, always=True, measures=True),
    Option(OPT_TRUST, "Allow models that need trust_remote_code (refused otherwise).", action="store_true", default=False,
           field="trust_remote_code", to_arg=None),
    Option(OPT_REPORT_DIR, "Where packcheck-matrix.md / .json are written (default: reports).",
           ini="packcheck_report_dir", env="PACKCHECK_REPORT_DIR", default="reports", field="report_dir"),
    Option(OPT_TOLERANCES, "Tolerance file (TOML, one table per dtype; default: audit/tolerances.toml).",
           ini="packcheck_tolerances", env="PACKCHECK_TOLERANCES"),
    Option(OPT_TOLERANCE, "Override one tolerance: [dtype.]key=value, e.g. float32.logits_atol=1e-3 (repeatable).",
           action="append", multiple=True),
    Option(OPT_BASELINE, "Baseline results JSON: after the matrix is written, print the changed cells and fail the "
           "session if a cell got worse (the same rules as `packcheck gate`).", ini="packcheck_baseline", env="PACKCHECK_BASELINE",
           field="baseline", in_child=False),
    Option(OPT_SHARD, "Run shard I of N (I/N, 1-based): a deterministic slice of the models, so a CI matrix can "
           "spread an audit; join the JSON files with `packcheck merge`.", env="PACKCHECK_SHARD", default=(1, 1),
           field="shard", parse=parse_shard, to_arg=lambda s: f"{s[0]}/{s[1]}", in_child=False),
    Option(OPT_VERSIONS, "Library versions to run under, each in its own uv environment over this torch: an axis "
           "'transformers==4.51.3,5.24.0' (axes multiply) or a combination 'transformers==4.51.3 & trl==0.17.0' "
           "(repeatable; ';' separates values in ini/env).", ini="packcheck_versions", env="PACKCHECK_VERSIONS",
           action="append", multiple=True, default=(), field="versions",
           to_arg=lambda combo: " & ".join(combo.requirements), in_child=False),
    Option(OPT_TIMEOUT, "Seconds one cell may run (its model build included) before its child is killed and the "
           f"cell is a timeout (default {_TIMEOUT_S:g}; 0: no limit).", ini="packcheck_timeout", env="PACKCHECK_TIMEOUT",
           default=_TIMEOUT_S, field="timeout_s", parse=parse_timeout, to_arg=lambda s: f"{s:g}"),
    Option(OPT_ISOLATION, "fork (default where available): each model's cells run in a forked child, so a crash "
           "or hang costs one cell; none: in this process.", ini="packcheck_isolation", env="PACKCHECK_ISOLATION",
           default=SANDBOX_MODES[0], field="sandbox"),
    Option(OPT_LENGTHS, "Token lengths of the examples packed into one row, comma-separated, each >= 1 (default "
           f"{_joined(_LENGTHS)}; e.g. 11,1,13 puts a one-token example between two; at least two examples, one of them "
           f">= 2 tokens; at most {MAX_PROBE_TOKENS} tokens in all).", ini="packcheck_lengths", env="PACKCHECK_LENGTHS",
           default=_LENGTHS, field="lengths", parse=parse_lengths, to_arg=_joined, measures=True),
    Option(OPT_SLIDING_WINDOW, f"The window (tokens, 2 to {MAX_PROBE_TOKENS}) a model's longer sliding window is shortened "
           f"to when packcheck shrinks it (default {_SLIDING_WINDOW}, so the examples exceed it).",
           ini="packcheck_sliding_window", env="PACKCHECK_SLIDING_WINDOW", default=_SLIDING_WINDOW,
           field="sliding_window", parse=parse_sliding_window, measures=True),
    Option(OPT_CONFIG, "Override one config value of every model: key=value (JSON value, or a string), dotted keys "
           "reach sub-configs, e.g. attn_config.clip_qkv=8 (repeatable, each key once; a spec's own {key=value} wins). Recorded "
           "in each cell's model record.", action="append", multiple=True),
    Option(OPT_STACK, stack_help(), ini="packcheck_stack", env="PACKCHECK_STACK", default=(), field="stack",
           parse=parse_stack, to_arg=lambda v: _joined(v) or "none", measures=True),
    Option(OPT_RESUME, "Reuse the cells already in <report dir>/packcheck-journal.jsonl from an interrupted run with "
           "the same settings and versions; run the rest.", action="store_true", default=False, field="resume",
           to_arg=None, in_child=False),
)

#: Environment variables packcheck reads besides its options' own (:attr:`Option.env`): its cache, the package
#: index, the atlas support file, the CPU stand-in kernel, and what it hands to its own child processes. A
#: ``PACKCHECK_*`` variable in neither is a typo (:func:`unknown_env_vars`).
OTHER_ENV_VARS = ("PACKCHECK_CACHE_DIR", "PACKCHECK_MAX_FILE_MB", "PACKCHECK_INDEX_URL", "PACKCHECK_SUPPORT_FILE", "PACKCHECK_TORCH_VARLEN_STAND_IN",
                  "PACKCHECK_REPRODUCE", "PACKCHECK_RUN_DIR", "PACKCHECK_ENV_LABEL")


def unknown_env_vars(environ: dict[str, str]) -> list[tuple[str, str]]:
    """``(name, hint)`` for every set ``PACKCHECK_*`` variable packcheck does not read (PACKCHECK_MODELS without its S: trial
    15, 130, ignored without a word), ``hint`` the " Did you mean ...?" of the closest known one, or ""."""
    from ..errors import closest

    known = [o.env for o in OPTIONS if o.env] + list(OTHER_ENV_VARS)
    return [(name, closest(name, known)) for name in sorted(environ)
            if name.startswith("PACKCHECK_") and name not in known]


BY_FLAG = {opt.flag: opt for opt in OPTIONS}
#: The ``settings`` keys (results JSON) whose value changes what a cell measures, by their options' ``measures``:
#: ``packcheck merge`` and the gate refuse two files that differ in one (analysis.gate).
PROBE_SETTINGS = {opt.field: opt.flag for opt in OPTIONS if opt.measures and opt.field}


def default_of(flag: str) -> Any:
    """The default of the option ``flag`` (e.g. ``default_of(OPT_TIMEOUT)`` -> 600.0): the one place it is written.

    Raises:
        KeyError: ``flag`` is not a packcheck option.
    """
    return BY_FLAG[flag].default
