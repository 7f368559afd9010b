"""The atlas's plan: its backends and checks, the releases (the latest patch of every minor from 4.44, from the
package index or named), and the order missing releases are measured in (:func:`gap_order`)."""

from __future__ import annotations

from ..backends.table import REFERENCE_BACKEND
from ..errors import PackcheckUsageError
from ..versions.releases import version_key

#: The backends of the atlas: the two dense-mask paths every release has, and the flash varlen path through the
#: CPU reference kernel (``packcheck_flash_ref``; its floor is transformers 4.44).
ATLAS_BACKENDS: tuple[str, ...] = ("eager", "sdpa", REFERENCE_BACKEND)
#: The oldest minor of the atlas (the varlen reference's floor).
ATLAS_SINCE = "4.44"
#: ``support.json`` schema version (reports/atlas/SCHEMA.md); bump on an incompatible change.
SUPPORT_SCHEMA_VERSION = 1
#: Marker written into a release's build folder once its run ended with a results file.
DONE_MARKER = "atlas-done.json"
#: The longest ``message`` an atlas entry keeps (reports/atlas/SCHEMA.md), ellipsis included.
MESSAGE_CHARS = 160


def entry_message(message: object) -> str:
    """A cell's message as an atlas entry stores it (``support.json``'s and the TRL block's ``message``): one line,
    at most :data:`MESSAGE_CHARS` characters, a longer one cut at a word boundary and ended with "…" (never
    mid-word, never mid-sentence without a mark)."""
    from ..report.text import cut, plain

    return cut(plain(message), MESSAGE_CHARS)


def atlas_checks() -> tuple[str, ...]:
    """The checks the atlas runs, from the registry: every default (non-training) check whose role decides a
    cell (``correctness``) or is a stack hazard (``hazard``); the collator findings are left out."""
    from ..checks.registry import DEFAULT_CHECKS, SPECS

    return tuple(c for c in DEFAULT_CHECKS if SPECS[c].role in ("correctness", "hazard"))


def latest_patches(releases: list[str], since: str = ATLAS_SINCE, until: str | None = None) -> list[str]:
    """The latest patch release of every minor from ``since`` (e.g. "4.44") to ``until`` (default: the newest),
    ascending. ``releases``: final, not yanked releases (:func:`pytest_packcheck.analysis.bisect.parse_simple_index`).

    Raises:
        PackcheckUsageError: ``since`` / ``until`` is not a version.
    """
    from packaging.version import InvalidVersion, Version

    try:
        low = Version(since)
        high = Version(until) if until else None
    except InvalidVersion as exc:
        raise PackcheckUsageError(f"--since / --until: {exc}: write a release such as 4.44 or 5.24.") from None
    best: dict[tuple[int, int], Version] = {}
    for text in releases:
        v = Version(text)
        if v.is_prerelease or v.is_devrelease or (v.major, v.minor) < (low.major, low.minor):
            continue
        if high is not None and (v.major, v.minor) > (high.major, high.minor):
            continue
        key = (v.major, v.minor)
        if key not in best or v > best[key]:
            best[key] = v
    return [str(best[k]) for k in sorted(best)]


def index_releases(since: str = ATLAS_SINCE, until: str | None = None) -> list[str]:
    """:func:`latest_patches` of transformers from the package index (``$PACKCHECK_INDEX_URL`` or PyPI).

    Raises:
        PackcheckUsageError: the index cannot be reached.
    """
    return index_latest_patches("transformers", "packcheck atlas", "4.44.2,5.24.0", since, until)


def index_latest_patches(library: str, command: str, example: str, since: str, until: str | None) -> list[str]:
    """:func:`latest_patches` of ``library`` from the package index; the transformers and the TRL axes' plan.

    Raises:
        PackcheckUsageError: the index cannot be reached (naming ``command`` and ``--releases example`` as the way out),
            or no release on it falls between ``since`` and ``until`` (naming the newest release there).
    """
    from ..analysis.bisect import fetch_index_page, parse_simple_index

    try:
        page = fetch_index_page(library)
    except PackcheckUsageError as exc:
        raise PackcheckUsageError(str(exc).replace("bisect needs", f"{command} needs")
                                  + f" Or name the releases with --releases {example}.") from None
    releases, _ = parse_simple_index(page)
    picked = latest_patches(releases, since, until)
    if not picked:  # `--since 9.0` printed [] and measured nothing, saying nothing
        from packaging.version import Version

        finals = [r for r in releases if not Version(r).is_prerelease and not Version(r).is_devrelease]
        newest = max(finals, key=Version) if finals else None
        window = f"--since {since}" + (f" --until {until}" if until else "")
        raise PackcheckUsageError(
            f"No {library} release on the package index matches {window} ({command}): the newest there is "
            f"{newest or 'none'}; give a --since / --until window that holds releases, or name them with --releases {example}.")
    return picked


def parse_release_list(text: str, source: str) -> list[str]:
    """``"4.44.2,5.24.0"`` -> exact releases, ascending.

    Raises:
        PackcheckUsageError: an item is not an exact release (e.g. ``4.44`` or ``>=4.44``), or is empty (``4.44.2,``
            was dropped in silence, where ``--packcheck-checks`` refuses an empty item: hostile trial 5).
    """
    from packaging.version import InvalidVersion, Version

    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise PackcheckUsageError(f"{source} '{text}' has an empty item: write releases separated by single commas, "
                                      "e.g. 4.44.2,5.24.0.")
        try:
            v = Version(item)
        except InvalidVersion:
            raise PackcheckUsageError(f"Release '{item}' (from {source}) is not a version: write exact releases such as "
                                      "4.44.2,5.24.0 (or use --since / --until for every minor's latest patch).") from None
        if len(v.release) < 3:
            raise PackcheckUsageError(f"Release '{item}' (from {source}) names a minor, not a release: write its patch, "
                                      f"e.g. {item}.0 (or use --since {item} --until {item} for its latest patch).")
        out.append(str(v))
    if not out:
        raise PackcheckUsageError(f"{source} names no release: write e.g. 4.44.2,5.24.0.")
    return sorted(dict.fromkeys(out), key=Version)


def parse_shard(text: str, source: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4), as ``--packcheck-shard`` reads it (:func:`pytest_packcheck.config.options.parse_shard`).

    Raises:
        PackcheckUsageError: not I/N with 1 <= I <= N.
    """
    from ..config.options import parse_shard as parse

    return parse(text, source, example=f"{source} 2/4")


def gap_order(planned: list[str], measured: list[str]) -> list[str]:
    """The releases of ``planned`` not in ``measured``, in the order that narrows the gaps between measured
    releases fastest: the first release of a new major version first (the transition across a major is the one
    users ask about most), then, repeatedly, the middle of the widest run of unmeasured minors (the oldest such
    run on a tie), so each added release halves a gap and every transition found is between close releases."""
    have = set(measured)
    order = [v for v in planned if v not in have and version_key(v).minor == 0 and version_key(v).micro == 0
             and any(version_key(m).major < version_key(v).major for m in have)]
    have |= set(order)
    while True:
        runs: list[list[str]] = [[]]
        for v in planned:
            if v in have:
                runs.append([])
            else:
                runs[-1].append(v)
        widest = max(runs, key=len)
        if not widest:
            return order
        pick = widest[(len(widest) - 1) // 2]
        order.append(pick)
        have.add(pick)
