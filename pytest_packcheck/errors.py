"""Exceptions and warnings packcheck raises. Import-light."""

from __future__ import annotations

import os
import re

#: Environment variables whose value is a secret: a name with TOKEN, KEY, SECRET or PASSWORD (HF_TOKEN,
#: HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...).
_SECRET_NAME = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD)", re.IGNORECASE)

#: Shapes of common access tokens, scrubbed wherever they stand (a token typed into an override, a spec, a file):
#: Hugging Face (hf_ + 34), GitHub (ghp_/gho_/ghu_/ghs_/ghr_ + 36, github_pat_ + 82), OpenAI / Anthropic
#: (sk-, sk-proj-, sk-ant-), AWS access key ids (AKIA/ASIA + 16), Slack (xoxb-...), GitLab (glpat-), Google API
#: keys (AIza + 35). Each needs 16+ characters after its prefix (hf_ / gh?_: 8+ when they mix upper case with lower
#: case or digits, as every real one does: ``ghp_AbCdEfGhIjKl``, trial 14, 150; ``hf_transfer`` stays), and no
#: letter or digit right before it; sk- needs a digit or an upper-case letter in it (``sk-learn-...`` stays), sk-proj-
#: and sk-ant- only 8+ characters. An underscore may stand Markdown-escaped (``hf\_...``, as
#: :func:`report.text.escape_md` writes it), so a token is still caught in a rendered report whatever its writer
#: escaped first.
_U = r"\\?_"  # "_" or Markdown's "\_"
_MIXED = r"(?=[A-Za-z0-9]*[A-Z])(?=[A-Za-z0-9]*[a-z0-9])[A-Za-z0-9]{8,}"  # 8+ characters, upper case and lower / digit
SECRET_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    rf"hf{_U}(?:[A-Za-z0-9]{{16,}}|{_MIXED})"
    rf"|gh[pousr]{_U}(?:[A-Za-z0-9]{{16,}}|{_MIXED})"
    rf"|github{_U}pat{_U}(?:[A-Za-z0-9]|{_U}){{16,}}"
    r"|sk-(?:proj|ant)-(?:[A-Za-z0-9-]|" + _U + r"){8,}"
    r"|sk-(?=(?:[A-Za-z0-9-]|" + _U + r")*[0-9A-Z])(?:[A-Za-z0-9-]|" + _U + r"){16,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|xox[abeprs]-[A-Za-z0-9-]{10,}"
    rf"|glpat-(?:[A-Za-z0-9-]|{_U}){{16,}}"
    rf"|AIza(?:[0-9A-Za-z-]|{_U}){{35}}"
    r")"
)


def scrub_secrets(text: str) -> str:
    """``text`` with every secret replaced by ``***``: by value, the value (8+ characters) of every environment
    variable whose name holds TOKEN, KEY, SECRET or PASSWORD; by shape, anything that looks like an access token
    (:data:`SECRET_SHAPES`: ``hf_...``, ``ghp_...``, ``github_pat_...``, ``sk-...``, ``AKIA...``, ...). For what
    reaches a terminal (test ids, warnings, error lines) as well as files (reports, journal, the run's owner file)."""
    from .report.text import escape_md  # pure, no packcheck imports

    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name):
            for form in dict.fromkeys((value, escape_md(value))):  # as typed, and as a Markdown report escapes it
                if form in text:
                    text = text.replace(form, "***")
    return SECRET_SHAPES.sub("***", text)


class PackcheckError(Exception):
    """Base class of packcheck's own errors."""


class PackcheckUsageError(PackcheckError):
    """Bad input from the user: a one-line message naming the value, where it came from and the fix.

    The pytest plugin turns it into ``pytest.UsageError`` and the CLI into exit code 2. The message is
    :func:`scrub_secrets`-ed: a token pasted where a model ID belongs is not echoed back.
    """

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(scrub_secrets(str(message)), *args)


class PackcheckWarning(UserWarning):
    """Base class of every warning packcheck emits, so users can filter them with one entry. The message is
    :func:`scrub_secrets`-ed (a token typed into an override is not echoed to the terminal)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(scrub_secrets(str(message)), *args)


def closest(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), or an empty string. A dtype name packcheck
    lacks gets the choice of the nearest precision (:func:`checks.registry.nearest_precision`: "float64" ->
    "float32"), never the look-alike of lower precision difflib picks ("float16")."""
    import difflib

    from .checks.registry import nearest_precision

    best = nearest_precision(value, choices)
    # a choice that differs only in case first ('LLaMA' -> 'llama': difflib's ratio is case-sensitive; trial 14, 67)
    same = [c for c in choices if c.lower() == value.lower() and c != value]
    match = [best] if best else same[:1] or difflib.get_close_matches(value, list(choices), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""


def read_user_text(path: object, what: str, fix: str) -> str:
    """The UTF-8 text of a file the user named (an audit, a tolerance file, a length profile), a leading UTF-8
    byte-order mark (as Windows editors write) dropped.

    Raises:
        PackcheckUsageError: ``{what} {path} is not UTF-8 text / is a directory / is not a regular file (a device,
            a pipe: /dev/zero would be read for ever) / cannot be read (...): {fix}``
            instead of the UnicodeDecodeError or OSError of ``Path.read_text``.
    """
    from pathlib import Path

    p = Path(str(path))
    if p.exists() and not p.is_file() and not p.is_dir():  # /dev/zero would be read for ever
        raise PackcheckUsageError(f"{what} {p} is not a regular file (a device or a pipe): {fix}")
    try:
        return p.read_text(encoding="utf-8-sig")  # a BOM made TOML say "Invalid statement (at line 1, column 1)"
    except UnicodeDecodeError as exc:
        raise PackcheckUsageError(f"{what} {p} is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x}): {fix}") from None
    except IsADirectoryError:
        raise PackcheckUsageError(f"{what} {p} is a directory: {fix}") from None
    except OSError as exc:
        raise PackcheckUsageError(f"{what} {p} cannot be read ({exc.strerror or exc}): {fix}") from None


def load_failure_message(exc: BaseException) -> str | None:
    """One line for an ImportError / MemoryError raised while packcheck loads torch or transformers, or None
    when ``exc`` is not one. Under a process memory limit (``ulimit -v``) the dynamic loader cannot map
    libtorch_cpu.so ("failed to map segment from shared object") and Python raises ImportError: the line names
    the limit (RLIMIT_AS, in KiB as ``ulimit -v`` shows it) and the fix."""
    if not isinstance(exc, ImportError | MemoryError):
        return None
    text = " ".join(str(exc).split())[:200]
    memory = isinstance(exc, MemoryError) or any(s in text.lower() for s in ("failed to map segment", "cannot allocate memory"))
    limit = "none"
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limit = f"{soft // 1024} KiB (ulimit -v {soft // 1024})"
    except (ImportError, OSError, ValueError):
        pass
    if memory or limit != "none":
        return (f"packcheck could not load torch/transformers ({type(exc).__name__}: {text}) under the process memory "
                f"limit {limit}: importing torch and transformers alone maps about 0.8 GB of address space (torch 2.13 CPU: "
                "ulimit -v 600000 fails, 800000 loads) and a run needs more; raise the limit (ulimit -v unlimited) and run again.")
    return (f"packcheck could not import a library it needs ({type(exc).__name__}: {text}): install it into this "
            "environment (pip install torch transformers) and run again.")


def package_dirs(packages: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The folders (each ending in ``os.sep``) of those of ``packages`` that are imported, for telling whose code a
    traceback frame or a warning's caller is; a package not imported adds nothing."""
    import sys

    dirs: list[str] = []
    for name in packages:
        for path in getattr(sys.modules.get(name), "__path__", None) or []:
            dirs.append(os.path.join(os.path.abspath(path), ""))
    return tuple(dirs)


def is_stdlib_file(path: str) -> bool:
    """True for a file of Python's standard library: below sysconfig's ``stdlib`` folder and in no site-packages
    folder. A system or Docker Python keeps site-packages below the standard library
    (``/usr/local/lib/python3.11/site-packages``): a prefix test alone takes transformers' frames for the
    standard library's."""
    import sysconfig

    paths = sysconfig.get_paths()
    path = os.path.abspath(path)
    if not path.startswith(os.path.join(paths["stdlib"], "")):
        return False
    sites = {os.path.join(paths[key], "") for key in ("purelib", "platlib") if paths.get(key)}
    parts = path.split(os.sep)
    return not any(path.startswith(site) for site in sites) and "site-packages" not in parts and "dist-packages" not in parts
