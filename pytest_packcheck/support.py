"""Does padding-free packing work for this architecture, backend and transformers release? Answered offline
from the atlas (``reports/atlas/support.json``, schema ``reports/atlas/SCHEMA.md``), at start-up speed.

    >>> from pytest_packcheck.support import lookup
    >>> answer = lookup("qwen2", "sdpa", "4.56.2")
    >>> answer.measured, answer.verdict, answer.causes          # doctest: +SKIP
    (True, 'pass', [])

Imports nothing heavy (no torch, no transformers): json and packaging only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .backends.table import FLASH_FAMILY, REFERENCE_BACKEND
from .errors import PackcheckUsageError

#: ``$PACKCHECK_SUPPORT_FILE`` overrides where :func:`lookup` reads the atlas.
SUPPORT_FILE_ENV = "PACKCHECK_SUPPORT_FILE"
#: The schema versions this module reads.
READABLE_SCHEMA = (1,)
#: attn_implementation values answered from another measured column (the flash varlen path is measured on CPU
#: through packcheck's reference kernel, which runs the release's own flash_attention_2 code path).
#: Every flash-family backend of the backend table, and the Hub kernels transformers loads for the same path.
ANSWERED_FROM = {**{name: REFERENCE_BACKEND for name in FLASH_FAMILY if name != REFERENCE_BACKEND},
                 **{kernel: REFERENCE_BACKEND for kernel in ("kernels-community/flash-attn", "kernels-community/flash-attn3")}}


def default_support_file() -> Path:
    """``$PACKCHECK_SUPPORT_FILE``, else the atlas shipped in the wheel (``pytest_packcheck/_atlas/support.json``,
    pyproject's force-include), else the one committed in the source tree (``reports/atlas/support.json``)."""
    env = os.environ.get(SUPPORT_FILE_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    shipped = here / "_atlas" / "support.json"
    return shipped if shipped.exists() else here.parent / "reports" / "atlas" / "support.json"


@dataclass(frozen=True)
class Answer:
    """One lookup. ``measured``: the atlas holds this (architecture, backend, release); then ``verdict`` (pass /
    fail / unsupported / error / ...), ``causes`` (packcheck cause codes, worst first), ``check`` and ``number``
    (the check that decided it and its key number: max |Δ logits| or the like, float32 units of the logits /
    loss) and ``measured_at``. Not measured: ``nearest`` holds the closest measured releases below and above
    with their verdicts. ``where``: the support file, its generation date, and the command that reproduces it."""

    model_type: str
    attn_implementation: str
    transformers_version: str
    measured: bool
    verdict: str | None = None
    causes: list[str] = field(default_factory=list)
    check: str | None = None
    number: float | None = None
    message: str = ""
    measured_at: str | None = None
    backend: str | None = None
    nearest: list[dict[str, Any]] = field(default_factory=list)
    where: str = ""
    reproduce: str = ""
    notes: list[str] = field(default_factory=list)
    #: with ``trl_version``: the TRL axis's answer (:func:`pytest_packcheck.atlas.trl_render.trl_answer`)
    trl: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        head = f"{self.model_type} / {self.attn_implementation} @ transformers {self.transformers_version}: "
        if self.measured:
            num = f" ({self.check} {self.number:.1e})" if self.number is not None and self.check else ""
            why = f" [{', '.join(self.causes)}]" if self.causes else ""
            text = head + f"{self.verdict}{why}{num}, measured at {self.measured_at} on {self.backend}"
        else:
            near = "; ".join(f"{n['transformers']}: {n['verdict']}" + (f" [{', '.join(n['causes'])}]" if n.get("causes") else "")
                             for n in self.nearest)
            text = head + "not measured" + (f" (nearest measured: {near})" if near else "")
        if self.trl:
            from .atlas.trl_render import trl_answer_lines

            text = "\n".join([text, *trl_answer_lines(self.trl, self.model_type, self.attn_implementation)])
        extra = [*self.notes, f"source: {self.where}"] + ([f"reproduce: {self.reproduce}"] if self.reproduce else [])
        return "\n".join([text, *("  " + e for e in extra)])


@lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PackcheckUsageError(f"Support file '{path}' does not exist: pass --support-file / ${SUPPORT_FILE_ENV}, or "
                                  "generate it with `packcheck atlas`.") from None
    except (OSError, ValueError) as exc:
        raise PackcheckUsageError(f"Support file '{path}' cannot be read ({exc}): regenerate it with "
                                  "`packcheck atlas --render-only`.") from None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if doc.get("schema") != "packcheck-atlas-support" or version not in READABLE_SCHEMA:
        raise PackcheckUsageError(f"Support file '{path}' has schema {doc.get('schema')!r} version {version!r}; this "
                                  f"packcheck reads packcheck-atlas-support version {', '.join(map(str, READABLE_SCHEMA))}: "
                                  "upgrade packcheck or regenerate the file.")
    return doc


def load_support(path: str | Path | None = None) -> dict[str, Any]:
    """The support document (cached per path and modification time).

    Raises:
        PackcheckUsageError: missing, unreadable, or another schema.
    """
    p = Path(path) if path else default_support_file()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        mtime = 0.0
    return _load(str(p), mtime)


def lookup(model_type: str, attn_implementation: str, transformers_version: str, trl_version: str | None = None,
           path: str | Path | None = None) -> Answer:
    """The atlas's answer for ``model_type`` (``config.model_type``) on ``attn_implementation`` at
    ``transformers_version``: measured (verdict, causes, number, release), or not measured with the nearest
    measured releases. Offline (reads the support file; no torch / transformers import), about a millisecond
    once loaded. ``trl_version``: ``Answer.trl`` also holds the TRL axis's answer (SFTTrainer with
    ``packing=True`` and with ``padding_free=True``, per mode; :func:`pytest_packcheck.atlas.trl_render.trl_answer`),
    from the support file's ``trl`` block.

    Raises:
        PackcheckUsageError: ``transformers_version`` or ``trl_version`` is not a version, or the support file is
            unusable.
    """
    from packaging.version import InvalidVersion, Version

    try:
        wanted = Version(transformers_version)
    except InvalidVersion:
        raise PackcheckUsageError(f"transformers version '{transformers_version}' is not a version: write e.g. 4.56.2.") from None
    doc = load_support(path)
    src = path or default_support_file()
    where = f"{src} (packcheck atlas of {doc.get('generated')}, {doc.get('device')} {doc.get('dtype')}, torch {doc.get('torch')})"
    backend = ANSWERED_FROM.get(attn_implementation, attn_implementation)
    notes = []
    if backend != attn_implementation:
        notes.append(f"{attn_implementation} is answered from {backend} (transformers' flash varlen path on packcheck's "
                     "CPU reference kernel)")
    base = {"model_type": model_type, "attn_implementation": attn_implementation,
            "transformers_version": transformers_version, "where": where}
    if trl_version:
        from .atlas.trl_render import trl_answer

        trl = trl_answer(doc, model_type, backend, trl_version, transformers_version)
        notes += trl.pop("notes")
        base["trl"] = trl
    arch = doc["cells"].get(model_type)
    if arch is None:
        from .errors import closest

        notes.append(f"architecture '{model_type}' is not in the atlas ({len(doc['cells'])} measured){closest(model_type, list(doc['cells']))}")
        return Answer(**base, measured=False, notes=notes)
    row = arch.get(backend)
    if row is None:
        notes.append(f"backend '{backend}' is not measured for {model_type} (measured: {', '.join(sorted(arch))})")
        return Answer(**base, measured=False, notes=notes)
    entry = row.get(str(wanted))
    if entry is not None:
        from .atlas import reproduce_command

        return Answer(**base, measured=True, verdict=entry["verdict"], causes=list(entry.get("causes", [])),
                      check=entry.get("check"), number=entry.get("number"), message=entry.get("message", ""),
                      measured_at=str(wanted), backend=backend, notes=notes,
                      reproduce=reproduce_command(str(wanted), model_type, backend))
    measured = sorted(row, key=Version)
    below = [v for v in measured if Version(v) < wanted]
    above = [v for v in measured if Version(v) > wanted]
    nearest = [{"transformers": v, "verdict": row[v]["verdict"], "causes": list(row[v].get("causes", [])),
                "side": side} for v, side in ((below[-1] if below else None, "below"), (above[0] if above else None, "above")) if v]
    if below and above and _same(row[below[-1]], row[above[0]]):
        notes.append(f"both neighbours agree ({row[below[-1]]['verdict']}); the atlas records no transition between them")
    elif below and above:
        notes.append(f"the verdict changes between {below[-1]} and {above[0]}: this release is on one side of it")
    return Answer(**base, measured=False, nearest=nearest, backend=backend, notes=notes)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["verdict"] == b["verdict"] and list(a.get("causes", [])) == list(b.get("causes", []))
