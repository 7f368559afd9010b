"""Where the releases of the libraries come from (their ``source`` in the libraries table: the package index),
and whether the versions a run asks for exist, checked before any environment is built."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import PackcheckUsageError
from .envs import VersionCombo, canonical


#: The package index a version is checked against: uv's / pip's configured index, else PyPI's simple API.
def version_key(version: str) -> Any:
    """``packaging.version.Version(version)``: the one sort key of release strings (bisect, atlas, TRL axis).

    Raises:
        packaging.version.InvalidVersion: ``version`` is not a PEP 440 version.
    """
    from packaging.version import Version

    return Version(version)


def index_url() -> str:
    for var in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(var):
            return os.environ[var].rstrip("/")
    return "https://pypi.org/simple"


def open_index(url: str, timeout: float, accept: str = "application/vnd.pypi.simple.v1+json") -> Any:
    """``urllib.request.urlopen`` of an index URL that may carry ``user:password@`` (a private index in
    ``UV_INDEX_URL`` / ``PACKCHECK_INDEX_URL``): the credentials go in a Basic ``Authorization`` header, never in the
    URL urllib parses (it read the password as a port: ``InvalidURL: nonnumeric port``, an INTERNALERROR that
    printed it, issue 42).

    Raises:
        OSError: unreachable, refused, or an HTTP error (``urllib.error.URLError`` / ``HTTPError``); a malformed URL
            (``http.client.InvalidURL``) as OSError too, its credentials masked.
    """
    import base64
    import http.client
    import urllib.parse
    import urllib.request

    from ..errors import mask_url_credentials

    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": accept}
    if parts.username is not None:
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        try:
            port = parts.port
        except ValueError:
            raise OSError(f"malformed index URL {mask_url_credentials(url)} (its port is not a number)") from None
        if port:
            netloc += f":{port}"
        url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except (http.client.HTTPException, ValueError) as exc:
        raise OSError(f"malformed index URL {mask_url_credentials(url)} ({type(exc).__name__})") from None


def release_versions(name: str, timeout: float = 20.0) -> list[str]:
    """Every version of ``name`` on the index (PEP 691 JSON simple API, ``versions`` of PEP 700): one query.

    Raises:
        OSError: the index cannot be reached or answers with something else (the caller decides what that means).
    """

    with open_index(f"{index_url()}/{canonical(name)}/", timeout) as resp:
        try:
            data = json.loads(resp.read().decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise OSError(f"the index answered something other than JSON ({type(exc).__name__})") from None
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, list):
        raise OSError(f"{index_url()} did not list versions for {name}")
    return [str(v) for v in versions]


def _nearest(wanted: str, releases: list[Any]) -> list[str]:
    """The releases just below and just above ``wanted`` (two each at most), in version order."""
    from packaging.version import InvalidVersion, Version

    try:
        target = Version(wanted)
    except InvalidVersion:
        return [str(v) for v in releases[-3:]]
    below = [v for v in releases if v < target]
    above = [v for v in releases if v > target]
    return [str(v) for v in below[-2:] + above[:2]]


def refuse_unreleased(wanted: list[tuple[str, str]], known: list[str], library: str, fix: str, kind: str = "") -> None:
    """Refuse a version the package index does not have, naming the nearest releases: ``wanted`` is
    ``(version, where it came from)`` pairs, ``known`` the index's releases (strings), ``fix`` the remedy sentence,
    ``kind`` what ``known`` holds (`` (final, not yanked)``).
    The one rule for atlas ``--releases`` and bisect ``--good`` / ``--bad``.

    Raises:
        PackcheckUsageError: the first version of ``wanted`` not in ``known``.
    """
    from packaging.version import InvalidVersion, Version

    ordered = sorted(Version(v) for v in known)
    have = set(ordered)
    for version, source in wanted:
        try:
            present = Version(version) in have
        except InvalidVersion:
            present = False
        if not present:
            near = _nearest(version, ordered)
            raise PackcheckUsageError(f"Release '{version}' (from {source}) is not a {library} release on the package "
                                      f"index{kind}: the nearest are {', '.join(near) or 'none'}. {fix}")


def validate_versions(combos: list[VersionCombo], source: str, lookup: Any = None) -> list[str]:
    """Check every requirement of ``combos`` against the package index before any environment is built: one
    query per library (``lookup``, default :func:`release_versions`). Returns notes for libraries that could
    not be checked (the index unreachable, or ``UV_OFFLINE`` set): uv says then what it cannot install.

    Raises:
        PackcheckUsageError: a requirement that no release satisfies, naming the nearest releases and the fix.
    """
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    lookup = lookup or release_versions
    if os.environ.get("UV_OFFLINE", "").lower() in ("1", "true", "yes"):
        return ["versions not checked against the index (UV_OFFLINE is set)"]
    by_name: dict[str, list[Requirement]] = {}
    for combo in combos:
        for text in combo.requirements:
            req = Requirement(text)
            by_name.setdefault(canonical(req.name), []).append(req)
    notes: list[str] = []
    for name, reqs in by_name.items():
        try:
            found = lookup(name)
        except (OSError, ValueError) as exc:
            notes.append(f"{name} versions not checked against {index_url()} ({type(exc).__name__}: {exc})")
            continue
        releases = []
        for v in found:
            try:
                releases.append(Version(v))
            except InvalidVersion:
                continue
        releases.sort()
        final = [v for v in releases if not v.is_prerelease and not v.is_devrelease]
        for req in dict.fromkeys(reqs):
            if any(req.specifier.contains(v, prereleases=True) for v in releases):
                continue
            pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
            near = _nearest(pins[0] if pins else str(final[-1] if final else ""), final or releases)
            raise PackcheckUsageError(
                f"'{req}' (from {source}) matches no release of {name} on {index_url()}: the nearest releases are "
                f"{', '.join(near) or 'none'}. Pass a released version, e.g. {name}=={near[-1] if near else 'X.Y.Z'}.")
    return notes
