"""Exceptions and warnings packcheck raises. Import-light."""

from __future__ import annotations

import os
import re
from typing import Any

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
#: :func:`escape_md` writes it), so a token is still caught in a rendered report whatever its writer
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


#: Credentials in a URL (``https://user:password@host/...``, an index URL in UV_INDEX_URL or PACKCHECK_INDEX_URL):
#: the user and password are masked wherever the URL is printed (issue 42: printed in clear).
URL_CREDENTIALS = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@:]+(?::[^/\s@]*)?@")


def mask_url_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL replaced by ``***@``."""
    return URL_CREDENTIALS.sub(r"\1***@", text)


class ScrubbingStream:
    """A text stream that :func:`scrub_secrets` each write (pytest's terminal writer while packcheck is on, the
    CLI's stderr): a token typed into ``-k`` or an override, an index URL with a password, never reach the terminal
    (issue 42). Everything else is the wrapped stream's own."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(scrub_secrets(text))  # type: ignore[attr-defined]
        return len(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


#: A secret-named variable's value that is plain lower-case words (``isolation``, ``llama-sdpa``, ``production``) is
#: no secret's shape: replacing it everywhere rewrote cell ids and check names (issue 42). Every other value of 8+
#: characters under a secret name (a digit, an upper-case letter, a symbol in it) is scrubbed where it stands.
_PLAIN_WORDS = re.compile(r"[a-z]+(?:[-_.][a-z]+)*")


def escape_md(text: Any) -> str:
    """Escape model-provided text for a Markdown table cell: no pipes, HTML, links or line breaks. Defined here, under
    :func:`scrub_secrets`, which must find a secret in its escaped form too; the renderers take it from
    :mod:`pytest_packcheck.report.text`."""
    s = " ".join(str(text).split())
    s = s.replace("\\", "\\\\")
    s = re.sub(r"([|<>\[\]`*_])", r"\\\1", s)
    return s


#: :func:`secret_forms`'s memo: (the environment's variable names, the secret-named ones' values, the forms), the
#: names and values as ``os.environ`` keeps them (CPython's ``_Environ._data``).
_SECRET_FORMS: tuple[frozenset[Any] | None, dict[Any, Any], tuple[str, ...]] = (None, {}, ())


def secret_forms() -> tuple[str, ...]:
    """The texts :func:`scrub_secrets` replaces by value, in the environment's order: the value (8+ characters, not
    plain lower-case words: :data:`_PLAIN_WORDS`) of every environment variable whose name holds TOKEN, KEY, SECRET or
    PASSWORD, as typed and as :func:`escape_md` writes it in a Markdown report.

    Read once per change that matters (issue 47: rescanning the environment cost ~0.35 s over the ~4,000 scrubs of
    one audit): the memo is reused while ``os.environ`` holds the same variable names and the same values under the
    secret-named ones (C-level comparisons of ``os.environ``'s underlying mapping, CPython's ``_Environ._data``), so
    a variable set, changed or removed since (``os.environ[...] = ...``, ``monkeypatch.setenv``) is seen at the next
    call, while pytest's own PYTEST_CURRENT_TEST, rewritten for every test, costs no rescan. Where ``os.environ`` has
    no such mapping the forms are computed on every call, as before."""
    global _SECRET_FORMS
    data = getattr(os.environ, "_data", None)
    names, watched, forms = _SECRET_FORMS
    if isinstance(data, dict):
        if names is not None and data.keys() == names and all(data.get(k) == v for k, v in watched.items()):
            return forms
        decode_key = getattr(os.environ, "decodekey", None)
        decode_value = getattr(os.environ, "decodevalue", None)
        if not (callable(decode_key) and callable(decode_value)):
            data = None
    found: dict[str, None] = {}
    watched = {}
    for raw_name, raw_value in (data.items() if isinstance(data, dict) else os.environ.items()):
        name, value = (decode_key(raw_name), decode_value(raw_value)) if isinstance(data, dict) else (raw_name, raw_value)
        if _SECRET_NAME.search(name):
            watched[raw_name] = raw_value
            if len(value) >= 8 and not _PLAIN_WORDS.fullmatch(value):
                found.update(dict.fromkeys((value, escape_md(value))))  # as typed, and as a Markdown report escapes it
    forms = tuple(found)
    _SECRET_FORMS = (frozenset(data.keys()), watched, forms) if isinstance(data, dict) else (None, {}, ())
    return forms


def scrub_secrets(text: str) -> str:
    """``text`` with every secret replaced by ``***``: by value, the value (8+ characters, not plain lower-case words:
    :data:`_PLAIN_WORDS`) of every environment variable whose name holds TOKEN, KEY, SECRET or PASSWORD; the
    ``user:password@`` of a URL; by shape, anything that looks like an access token
    (:data:`SECRET_SHAPES`: ``hf_...``, ``ghp_...``, ``github_pat_...``, ``sk-...``, ``AKIA...``, ...). For what
    reaches a terminal (test ids, warnings, error lines) as well as files (reports, journal, the run's owner file).
    The values are read from the environment once per change of it (:func:`secret_forms`)."""
    for form in secret_forms():
        if form in text:
            text = text.replace(form, "***")
    return mask_url_credentials(SECRET_SHAPES.sub("***", text)) if "@" in text else SECRET_SHAPES.sub("***", text)


class PackcheckError(Exception):
    """Base class of packcheck's own errors."""


class PackcheckUsageError(PackcheckError):
    """Bad input from the user: a one-line message naming the value, where it came from and the fix.

    The pytest plugin turns it into ``pytest.UsageError`` and the CLI into exit code 2. The message is
    :func:`scrub_secrets`-ed: a token pasted where a model ID belongs is not echoed back.
    """

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(one_line(scrub_secrets(str(message))), *args)


def one_line(text: str) -> str:
    """``text`` with each ASCII control character written as its escape (a newline as ``\\n``, ESC as ``\\x1b``): a
    value with a newline in it (``--packcheck-checks $'isolation\\nx'``) no longer splits the one-line error that
    quotes it, and no escape sequence reaches the terminal (hostile trial 5: 16 flags' errors spanned two lines)."""
    if not has_control_character(text):
        return text
    return "".join(repr(c)[1:-1] if ord(c) < 32 or ord(c) == 127 else c for c in text)


class PackcheckWarning(UserWarning):
    """Base class of every warning packcheck emits, so users can filter them with one entry. The message is
    :func:`scrub_secrets`-ed (a token typed into an override is not echoed to the terminal)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(scrub_secrets(str(message)), *args)


#: Machine epsilon by dtype name (torch.finfo(dtype).eps), without importing torch: :func:`closest`'s precision
#: rule (:func:`nearest_precision`) and the checks' rounding floor (:func:`checks.registry.rounding_level`).
DTYPE_EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def nearest_precision(dtype: str, choices: list[str] | tuple[str, ...]) -> str | None:
    """The one of ``choices`` (dtype names) whose precision is nearest ``dtype``'s (by machine epsilon, in bits; a tie
    goes to the more precise), so a suggestion for a dtype packcheck lacks never lowers precision more than needed
    ("float64" -> "float32", never "float16" for looking alike); None when ``dtype`` or no choice has a known epsilon."""
    import math

    if dtype not in DTYPE_EPS:
        return None
    known = [c for c in choices if c in DTYPE_EPS]
    if not known:
        return None
    bits = math.log2(DTYPE_EPS[dtype])
    return min(known, key=lambda c: (abs(math.log2(DTYPE_EPS[c]) - bits), DTYPE_EPS[c]))


def has_control_character(text: str) -> bool:
    """Whether ``text`` holds an ASCII control character (a newline, a tab, DEL, ...): a value that would split the
    one-line error naming it, or make a file name no one can type (hostile trials: a model spec, a report folder)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def closest(value: str, choices: list[str] | tuple[str, ...], prefix: str = "") -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), or an empty string. A dtype name packcheck
    lacks gets the choice of the nearest precision (:func:`nearest_precision`: "float64" ->
    "float32"), never the look-alike of lower precision difflib picks ("float16"). ``prefix`` is shown before the
    match but kept out of the comparison: a shared ``arch:`` counted toward difflib's ratio, and ``arch:nosuch`` was
    offered ``arch:moshi`` (hostile trial 4)."""
    import difflib

    best = nearest_precision(value, choices)
    # a choice that differs only in case first ('LLaMA' -> 'llama': difflib's ratio is case-sensitive; trial 14, 67)
    same = [c for c in choices if c.lower() == value.lower() and c != value]
    match = [best] if best else same[:1] or difflib.get_close_matches(value, list(choices), n=1)
    return f" Did you mean '{prefix}{match[0]}'?" if match else ""


#: The largest file packcheck reads (bytes): the committed atlas's support.json is ~10 MB and an all-architectures
#: results file ~60 MB; a bigger one is not one of packcheck's files (a /dev/zero symlink, a log). Raise it with
#: $PACKCHECK_MAX_FILE_MB.
MAX_FILE_BYTES = 512 * 1024 * 1024
#: The deepest nesting of JSON / TOML packcheck accepts: its own files nest 6 levels; 100,000 levels raised
#: RecursionError tracebacks in every reader (issue 42).
MAX_NESTING = 64


def _max_file_bytes() -> int:
    import os

    raw = os.environ.get("PACKCHECK_MAX_FILE_MB", "").strip()
    if not raw:
        return MAX_FILE_BYTES
    try:
        value = float(raw)
    except ValueError:
        raise PackcheckUsageError(f"PACKCHECK_MAX_FILE_MB={raw!r} (from the environment) is not a number of megabytes: "
                                  "unset it or give e.g. 1024.") from None
    if not 0 < value < float("inf"):  # 'inf' / '1e400' (a hostile trial: OverflowError from int())
        raise PackcheckUsageError(f"PACKCHECK_MAX_FILE_MB={raw!r} (from the environment) must be a finite number above 0: "
                                  "unset it or give e.g. 1024.")
    return int(value * 1024 * 1024)


def nesting_depth(value: object, limit: int = MAX_NESTING) -> int:
    """How deeply lists / dicts nest in ``value`` (0 for a scalar), counted without recursion and stopping past
    ``limit`` (then ``limit + 1``)."""
    if not isinstance(value, dict | list | tuple):
        return 0
    deepest, stack = 1, [(value, 1)]
    containers = (dict, list, tuple)
    while stack:
        item, depth = stack.pop()
        children = [v for v in (item.values() if type(item) is dict else item) if type(v) in containers]
        if children:  # only containers are pushed: scalars (most of a document) cost one type() each
            if depth + 1 > deepest:
                deepest = depth + 1
                if deepest > limit:
                    return limit + 1
            stack.extend((v, depth + 1) for v in children)
    return deepest


def parse_document(text: str, fmt: str, what: str, fix: str) -> object:
    """``text`` parsed as ``fmt`` ("json" or "toml"), refused in one line when it is not that format, or nests deeper
    than :data:`MAX_NESTING` (the parsers raise RecursionError for 100,000 levels; packcheck's own code would for a
    few thousand), or exhausts memory. ``what`` names the file (and where it came from), ``fix`` the way out.

    Raises:
        PackcheckUsageError: ``{what} is not valid JSON (...) / nests N levels deep ... : {fix}``.
    """
    import json

    import tomllib

    try:
        data = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except RecursionError:
        raise PackcheckUsageError(f"{what} nests its arrays / objects more deeply than a parser can follow (over "
                                  f"{MAX_NESTING} levels): it is not one of packcheck's files; {fix}") from None
    except MemoryError:
        raise PackcheckUsageError(f"{what} does not fit in memory when parsed: {fix}") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:  # JSONDecodeError is a ValueError
        where = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else " ".join(str(exc).split())[:160]
        raise PackcheckUsageError(f"{what} is not valid {fmt.upper()} ({where}): {fix}") from None
    if nesting_depth(data) > MAX_NESTING:
        raise PackcheckUsageError(f"{what} nests its arrays / objects over {MAX_NESTING} levels deep: it is not one of "
                                  f"packcheck's files; {fix}")
    return data


def read_document(path: object, fmt: str, what: str, fix: str) -> object:
    """:func:`read_user_text` then :func:`parse_document`: the one bounded reader of a JSON / TOML file the user
    names (size, regular file, UTF-8, format, nesting).

    Raises:
        PackcheckUsageError: as those two, naming ``what`` and the path.
    """
    from pathlib import Path

    text = read_user_text(path, what, fix)
    return parse_document(text, fmt, f"{what} {Path(str(path))}", fix)


def read_user_text(path: object, what: str, fix: str, named: str | None = None) -> str:
    """The UTF-8 text of a file the user named (an audit, a tolerance file, a length profile), a leading UTF-8
    byte-order mark (as Windows editors write) dropped.

    Raises:
        PackcheckUsageError: ``{what} {path} is not UTF-8 text / is a directory / is not a regular file (a device,
            a pipe: /dev/zero would be read for ever) / cannot be read (...): {fix}``
            instead of the UnicodeDecodeError or OSError of ``Path.read_text``.
    """
    from pathlib import Path

    p = Path(str(path))
    label = named or f"{what} {p}"  # ``named``: the file as the caller names it (its path and where it came from)
    if p.exists() and not p.is_file() and not p.is_dir():  # /dev/zero would be read for ever
        raise PackcheckUsageError(f"{label} is not a regular file (a device or a pipe): {fix}")
    limit = _max_file_bytes()
    try:
        size = p.stat().st_size
    except OSError:
        size = 0  # the read below names what is wrong
    if size > limit:
        raise PackcheckUsageError(f"{label} is {size / 1024 ** 2:.0f} MB, over the {limit / 1024 ** 2:.0f} MB packcheck reads "
                                  f"($PACKCHECK_MAX_FILE_MB raises it): {fix}")
    try:
        with p.open("rb") as handle:  # bounded even where stat lies (a file growing while read, /proc), and read in
            chunks, got = [], 0  # chunks: read(limit) would allocate the whole limit up front (a MemoryError under ulimit -v)
            while got <= limit:
                chunk = handle.read(min(1 << 22, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            raw = b"".join(chunks)
        if len(raw) > limit:
            raise PackcheckUsageError(f"{label} holds over {limit / 1024 ** 2:.0f} MB, more than packcheck reads "
                                      f"($PACKCHECK_MAX_FILE_MB raises it): {fix}")
        return raw.decode("utf-8-sig")  # a BOM made TOML say "Invalid statement (at line 1, column 1)"
    except UnicodeDecodeError as exc:
        raise PackcheckUsageError(f"{label} is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x}): {fix}") from None
    except IsADirectoryError:
        raise PackcheckUsageError(f"{label} is a directory: {fix}") from None
    except OSError as exc:
        raise PackcheckUsageError(f"{label} cannot be read ({exc.strerror or exc}): {fix}") from None


def _while_importing(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a module was being imported (a frame of importlib's bootstrap)."""
    tb = exc.__traceback__
    while tb is not None:
        if "importlib._bootstrap" in tb.tb_frame.f_code.co_filename or tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        tb = tb.tb_next
    return False


def _last_frame(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``exc``'s traceback ("" without one)."""
    import os

    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return f"{os.path.basename(code.co_filename)}:{last.tb_lineno} in {code.co_name}"


def path_failure_message(exc: BaseException) -> str | None:
    """One line for an OSError a path itself raises before anything is read or written, or None: a name longer than
    the file system takes (ENAMETOOLONG, a component over 255 bytes). Python's ``Path.exists()`` / ``is_dir()`` raise
    it rather than answer False (3.11 pathlib ignores only ENOENT, ENOTDIR, EBADF, ELOOP), so every reader of a flag's
    path met it as a traceback (a hostile trial, helper G: ``--packcheck-report-dir``, ``--audit``, ``gate``, ``lookup``)."""
    import errno

    if not isinstance(exc, OSError) or exc.errno != errno.ENAMETOOLONG:
        return None
    name = str(exc.filename) if exc.filename is not None else ""
    shown = f"'{name}'" if len(name) <= 120 else f"'{name[:60]}...{name[-30:]}' ({len(name)} characters)"
    return (f"the path {shown} is longer than the file system takes ({exc.strerror or 'File name too long'}: a name "
            "over 255 bytes, or a path over 4096): give a shorter path.")


def load_failure_message(exc: BaseException) -> str | None:
    """One line for an ImportError / MemoryError raised while packcheck loads torch or transformers, or None
    when ``exc`` is not one. Under a process memory limit (``ulimit -v``) the dynamic loader cannot map
    libtorch_cpu.so ("failed to map segment from shared object") and Python raises ImportError: the line names
    the limit (RLIMIT_AS, in KiB as ``ulimit -v`` shows it) and the fix."""
    if not isinstance(exc, ImportError | MemoryError):
        return None
    text = " ".join(str(exc).split())[:200]
    if isinstance(exc, MemoryError) and exc.__traceback__ is not None and not _while_importing(exc):
        # out of memory in packcheck's own work (a huge input, a big batch), not while loading torch (issue 42: a
        # MemoryError reading a file in `lookup`, which imports no torch, was "could not load torch/transformers")
        where = _last_frame(exc)
        return (f"packcheck ran out of memory{f' in {where}' if where else ''} (MemoryError{': ' + text if text else ''}): "
                "give it a smaller input (the file or batch named above), free memory, or raise the process limit "
                "(ulimit -v) and run again.")
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


def refuse_empty(value: Any, flag: str, positional: bool = False) -> None:
    """Refuse a flag given an empty value (``--packcheck-attn ''``, ``atlas --releases ''``: an unset shell
    variable): it is never read as "the default" or "every one" (the docs). ``positional``: an argument or a
    required flag, which has no default to fall back on (the message does not offer one).

    Raises:
        PackcheckUsageError: ``value`` is a string of nothing but blanks and commas.
    """
    if isinstance(value, str) and not value.replace(",", "").strip():
        leave = "" if positional else f" or leave {flag} out for its default"
        raise PackcheckUsageError(f"Empty value {value!r} for {flag} (from the command line): give a value "
                                  f"(see --help){leave}.")
