"""Does padding-free packing work for this architecture, backend and transformers release? Answered offline
from the atlas (``reports/atlas/support.json``, schema ``reports/atlas/SCHEMA.md``), at start-up speed.

    >>> from pytest_packcheck.support import lookup
    >>> answer = lookup("qwen2", "sdpa", "4.56.2")
    >>> answer.measured, answer.verdict, answer.causes          # doctest: +SKIP
    (True, 'pass', [])

Imports nothing heavy (no torch, no transformers): json and packaging only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .analysis.support_file import default_support_file, is_version, load_support, load_support_view  # noqa: F401 - load_support: re-exported (cli/claims)
from .backends.table import FLASH_FAMILY, REFERENCE_BACKEND
from .errors import PackcheckUsageError

#: attn_implementation values answered from another measured column (the flash varlen path is measured on CPU
#: through packcheck's reference kernel, which runs the release's own flash_attention_2 code path).
#: Every flash-family backend of the backend table, and the Hub kernels transformers loads for the same path.
ANSWERED_FROM = {**{name: REFERENCE_BACKEND for name in FLASH_FAMILY if name != REFERENCE_BACKEND},
                 **{kernel: REFERENCE_BACKEND for kernel in ("kernels-community/flash-attn", "kernels-community/flash-attn3")}}


@dataclass(frozen=True)
class Answer:
    """One lookup. ``measured``: the atlas holds this (architecture, backend, release); then ``verdict`` (pass /
    fail / unsupported / error / ...), ``causes`` (packcheck cause codes, worst first), ``check`` and ``number``
    (the check that decided it and its key number: max |Δ logits| or the like, float32 units of the logits /
    loss) and ``measured_at``. Not measured: ``nearest`` holds the closest measured releases below and above
    with their verdicts; where a bisect record places the transition between them (``support.json``
    ``transitions[].bisected``), ``verdict`` / ``causes`` / ``check`` / ``number`` are the side this release lies
    on, ``measured_at`` the release that side was measured at, and ``inferred_from`` names the bisect (its cell,
    first / last release and file). ``where``: the support file, its generation date, and the command that
    reproduces it."""

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
    #: the UTC date (YYYY-MM-DD) ``measured_at`` was measured, where the atlas recorded it (releases[].measured)
    measured_on: str | None = None
    backend: str | None = None
    nearest: list[dict[str, Any]] = field(default_factory=list)
    where: str = ""
    reproduce: str = ""
    notes: list[str] = field(default_factory=list)
    inferred_from: str = ""
    #: cause codes the atlas recorded beside the verdict (``cells[].findings``: e.g. ``batch_rows`` beside a flash-path
    #: pass: two packed rows in one batch lose their boundaries); each is explained in ``notes``
    findings: list[str] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        """Measured at this release, or placed on one side of a bisected transition."""
        return self.measured or bool(self.inferred_from)
    #: with ``trl_version``: the TRL axis's answer (:func:`pytest_packcheck.atlas.trl_render.trl_answer`)
    trl: dict[str, Any] = field(default_factory=dict)
    #: one dict per training path (the model fed the packed row, ``Trainer``, ``SFTTrainer`` with ``--trl``): its
    #: verdict, causes, reasons, remedy at this release and ``safe_from`` (:func:`pytest_packcheck.analysis.training_paths.training_paths`)
    paths: list[dict[str, Any]] = field(default_factory=list)
    #: the config the atlas's tiny model rests on for this architecture (transformers' default config, shrunk)
    config_source: str = ""
    #: how ``model_type`` was read when a Hub ID, a model folder or a config.json was asked ("" for a plain type)
    resolved_from: str = ""
    #: with ``libraries`` (and ``stack``): one answer per library axis asked (``--verl``, ``--peft ... --stack E``:
    #: :func:`pytest_packcheck.analysis.library_axes.axis_answer`)
    axes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def overall(self) -> str | None:
        """``pass`` only where every known path passes with no hazard on its default way of running; else the
        worst path's verdict ("fail" before "hazard" before the rest); the model's verdict where no path is known."""
        if not self.paths:
            return self.verdict
        verdicts = [p["verdict"] for p in self.paths if p["verdict"] != "not measured"]
        for worst in ("fail", "error", "unsupported", "hazard"):
            if worst in verdicts:
                return worst
        return "pass" if verdicts and all(v == "pass" for v in verdicts) else self.verdict

    def as_dict(self) -> dict[str, Any]:
        """The answer's fields, and ``answered`` (measured, or placed by a bisect: a bisect-placed answer has
        ``measured`` false beside a verdict; ``--json`` readers told the two apart only by ``inferred_from``)."""
        return {**asdict(self), "answered": self.answered, "overall": self.overall}

    def summary(self) -> str:
        """The answer without its head (architecture / backend @ release) and notes: the verdict, causes, key
        number and where it was measured; the bisect it is inferred from; or "not measured" with the nearest
        measured releases. The one wording of :func:`lookup`'s answer (``packcheck lookup``, ``packcheck claims``)."""
        num = f" ({self.check} {self.number:.1e})" if self.number is not None and self.check else ""
        if self.findings:  # a pass with a finding is not a bare pass (atlas review: lookup dropped them)
            num += f" with finding{'s' if len(self.findings) > 1 else ''} {', '.join(self.findings)}"
        why = f" [{', '.join(self.causes)}]" if self.causes else ""
        if not self.causes and self.message and self.verdict not in (None, "pass"):  # why it is refused (trial 21, 12:
            why = f" ({' '.join(self.message.split())[:160]})"  # "unsupported" alone; the reason was only in --json)
        on = f" ({self.measured_on})" if self.measured_on else ""
        if self.measured:
            return f"{self.verdict}{why}{num}, measured at {self.measured_at}{on} on {self.backend}"
        if self.inferred_from:
            return (f"{self.verdict}{why}{num}, not measured at this release: from {self.inferred_from}; "
                    f"the verdict measured at {self.measured_at}{on} on {self.backend}")
        near = "; ".join(f"{n['transformers']}: {n['verdict']}" + (f" [{', '.join(n['causes'])}]" if n.get("causes") else "")
                         for n in self.nearest)
        return "not measured" + (f" (nearest measured: {near})" if near else "")

    def path_lines(self) -> list[str]:
        """The answer per training path, two spaces in: verdict, causes, what goes wrong, the remedy at this
        release and the first release from which the path passes as is."""
        lines = []
        for p in self.paths:
            why = f" [{', '.join(p['causes'])}]" if p["causes"] else ""
            lines.append(f"  {p['path']}: {p['verdict']}{why} ({p['source']})")
            lines += [f"    {r}" for r in p["reasons"]]
            if p["remedy"]:
                lines.append(f"    remedy at {self.transformers_version}: {p['remedy']}")
            if p["safe_from"]:
                lines.append(f"    passes as is from: {p['safe_from']}")
        if self.paths and not any(p["path"] == "SFTTrainer" for p in self.paths):
            lines.append("  SFTTrainer: not asked (add --trl VERSION for TRL's packing=True / padding_free paths)")
        return lines

    def __str__(self) -> str:
        head = f"{self.model_type} / {self.attn_implementation} @ transformers {self.transformers_version}: "
        if self.paths and self.overall != self.verdict:  # the model's pass is not the run's (issue 41: lookup said pass
            bad = [p["path"] for p in self.paths if p["verdict"] == self.overall]  # where the Trainer path fails)
            head += f"{self.overall} on the {' and '.join(bad)} path{'s' if len(bad) > 1 else ''}; model path: "
        lines = [head + self.summary(), *("  " + n for n in self.notes)]  # each answer's notes right under it
        if self.resolved_from:
            lines.insert(1, f"  model_type {self.model_type!r} read from {self.resolved_from}")
        if self.paths and self.overall != "pass" or any(p["reasons"] for p in self.paths):
            lines += self.path_lines()
        if self.config_source:
            lines.append(f"  config: {self.config_source}")
        if self.trl:
            from .atlas.trl_render import trl_answer_lines

            lines += trl_answer_lines(self.trl, self.model_type, self.attn_implementation)
        if self.axes:
            from .analysis.library_axes import axis_answer_lines

            for axis in self.axes:
                lines += axis_answer_lines(axis, self.model_type, self.attn_implementation)
        label = "reproduce (the transformers answer)" if self.trl or self.axes else "reproduce"  # the others carry their own
        extra = [f"source: {self.where}"] + ([f"{label}: {self.reproduce}"] if self.reproduce else [])
        return "\n".join([*lines, *("  " + e for e in extra)])


def lookup(model_type: str, attn_implementation: str, transformers_version: str, trl_version: str | None = None,
           path: str | Path | None = None, libraries: dict[str, str] | None = None, stack: str | None = None) -> Answer:
    """The atlas's answer for ``model_type`` (``config.model_type``) on ``attn_implementation`` at
    ``transformers_version``: measured (verdict, causes, number, release), or not measured with the nearest
    measured releases. Offline (reads the support file; no torch / transformers import), about a millisecond
    once loaded. ``trl_version``: ``Answer.trl`` also holds the TRL axis's answer (SFTTrainer with
    ``packing=True`` and with ``padding_free=True``, per mode; :func:`pytest_packcheck.atlas.trl_render.trl_answer`),
    from the support file's ``trl`` block. ``libraries`` (``{"verl": "0.9.1"}``) / ``stack`` (``"lora"``): ``Answer.axes``
    (:func:`pytest_packcheck.analysis.library_axes.answer_axes`).

    Raises:
        PackcheckUsageError: an argument is empty (or blank); ``transformers_version`` or ``trl_version`` is not a
            version; ``attn_implementation`` is
            none the backend table (:data:`~pytest_packcheck.backends.table.KNOWN_BACKENDS`), :data:`ANSWERED_FROM` or
            the atlas knows (``sdpaa``: a typo answered "not measured" before); the support file is unusable.
    """
    from packaging.version import InvalidVersion, Version

    # the public API's arguments are strings (issue 42: None, a float 5.24, a list or a 5,000-digit version crashed
    # lookup() with InvalidVersion / ValueError / TypeError tracebacks)
    for what, value, optional in (("model_type", model_type, False), ("attn_implementation", attn_implementation, False),
                                  ("transformers_version", transformers_version, False), ("trl_version", trl_version, True)):
        if value is None and optional:
            continue
        if not isinstance(value, str):
            raise PackcheckUsageError(f"lookup(): {what} is {type(value).__name__} {value!r:.40}, not a string: pass it as "
                                      "text, e.g. lookup('qwen2', 'sdpa', '4.56.2').")
        if len(value) > 200:
            raise PackcheckUsageError(f"The {what} argument is {len(value)} characters long ({value[:24]}...): no "
                                      f"{what.replace('_', ' ')} is; pass e.g. qwen2 sdpa 4.56.2.")
    if path is not None and not isinstance(path, str | os.PathLike):
        raise PackcheckUsageError(f"lookup(): path is {type(path).__name__} {path!r:.40}, not a file path: pass the "
                                  "support.json to read (a str or pathlib.Path), or None for the packaged atlas.")
    # an empty argument (an unset shell variable) was looked up: "architecture '' is not in the atlas", rc 1
    for what, value in (("model_type argument", model_type), ("attn_implementation argument", attn_implementation),
                        ("transformers_version argument", transformers_version), ("--trl", trl_version)):
        if value is not None and not str(value).strip():
            raise PackcheckUsageError(f"Empty value {value!r} for the {what}: give one, e.g. packcheck lookup qwen2 sdpa "
                                      "4.56.2 (--trl 0.19.1).")
    # each library's own example and prefix: a bad --trl was told "such as 4.56.2 (no 'transformers==')"
    for what, value, example in (("transformers", transformers_version, "4.56.2"), ("trl", trl_version, "0.19.1")):
        try:
            parsed = Version(str(value)) if value is not None else None
        except InvalidVersion:
            raise PackcheckUsageError(f"{what} version '{value}' is not a version (the {what} version asked about): write "
                                      f"a release number such as {example} (no '{what}==', no wildcard).") from None
        if parsed is not None and len(parsed.release) > 3:  # 4.53.1.1.1 was answered from 4.53.1's bisect, exit 0
            raise PackcheckUsageError(f"{what} version '{value}' has {len(parsed.release)} parts: no {what} release "
                                      f"does (they are MAJOR.MINOR.PATCH); write one such as {example}.")
    if libraries or stack is not None:  # the library axes (analysis/library_axes.py), beside the model's answer
        from .analysis.library_axes import answer_axes

        return answer_axes(load_support_view(path), lambda doc: _lookup(doc, model_type, attn_implementation,
                                                                         transformers_version, trl_version, path),
                           ANSWERED_FROM.get(attn_implementation, attn_implementation), libraries, stack, trl_version)
    return _lookup(load_support_view(path), model_type, attn_implementation, transformers_version, trl_version, path)


def _lookup(doc: Any, model_type: str, attn_implementation: str, transformers_version: str, trl_version: str | None,
            path: str | Path | None) -> Answer:
    """:func:`lookup` on the loaded document, its arguments checked (the library axes aside)."""
    from .backends.table import KNOWN_BACKENDS
    from .errors import closest

    resolved_from = ""
    asked = None
    if ":" in model_type:  # encoder:bert, multimodal:qwen2_vl: a block of the atlas (atlas/kinds.py), imported only then
        from .atlas.kinds_render import block_of

        asked = block_of(model_type)
    if model_type not in doc["cells"] and asked is None and looks_like_model_reference(model_type):
        model_type, resolved_from = resolve_model_type(model_type, list(doc["cells"]))
    in_cells = set(getattr(doc, "backends_in_cells", None) or {b for row in doc["cells"].values() for b in row})
    measured = list(dict.fromkeys([*(b for b in doc.get("backends") or [] if b in in_cells), *sorted(in_cells)]))
    known = list(dict.fromkeys([*KNOWN_BACKENDS, *ANSWERED_FROM, *measured]))
    if attn_implementation not in known:
        # what the atlas measures and what it answers from those columns (flex_attention, a backend packcheck knows,
        # was offered as answered and then answered "not measured": atlas review, U4)
        raise PackcheckUsageError(f"Unknown attn_implementation '{attn_implementation}' (from the attn_implementation "
                                  f"argument): the atlas measures {', '.join(measured)}, and answers "
                                  f"{', '.join(ANSWERED_FROM)} from {REFERENCE_BACKEND}.{closest(attn_implementation, known)}")
    src = path or default_support_file()
    # the atlas's render date is not when a cell was measured (trial 14, 78): the release's own date where recorded
    where = f"{src} (packcheck atlas rendered {doc.get('generated')}, {doc.get('device')} {doc.get('dtype')}, torch {doc.get('torch')})"
    if asked is not None:  # encoder:bert, multimodal:qwen2_vl: the atlas's encoder / multimodal block (atlas/kinds.py)
        return block_answer(doc, asked[0], asked[1], model_type, attn_implementation, transformers_version, where, src)
    answer = answer_at(doc, model_type, attn_implementation, transformers_version, trl_version, where)
    import dataclasses

    if resolved_from:
        answer = dataclasses.replace(answer, resolved_from=resolved_from)
    also = _blocks_measuring(doc, model_type)
    if also:  # bert / qwen2_vl here is the causal-LM / text path; the blocks judge the encoder / the pixels
        answer = dataclasses.replace(answer, notes=[*answer.notes, *(
            f"this is its text path as a causal LM; the atlas's {name} block measures it too: packcheck lookup "
            f"{prefix}{model_type} {attn_implementation} {transformers_version}" for name, prefix in also)])
    return answer


def _reproduce(doc: Any, version: str, model_type: str, backend: str) -> str:
    """The command that measures one atlas entry again: :func:`pytest_packcheck.atlas.reproduce_command` with the
    checks the support file says were run (its ``checks``), built here so that an answer does not import the atlas
    package (its measuring machinery: 45 ms of a 0.1 s lookup, issue 47); a file without ``checks`` asks the atlas."""
    checks = doc.get("checks")
    if not (isinstance(checks, list) and checks and all(isinstance(c, str) for c in checks)):
        from .atlas import reproduce_command

        return reproduce_command(version, model_type, backend)
    import shlex

    from .config.flags import OPT_BACKENDS, OPT_CHECKS  # not .options: its help texts import the registry

    return shlex.join(["packcheck", "audit", "--models", f"arch:{model_type}", "--versions", f"transformers=={version}",
                       f"{OPT_BACKENDS}={backend}", f"{OPT_CHECKS}={','.join(checks)}"])


def _blocks_measuring(doc: Any, model_type: str) -> list[tuple[str, str]]:
    """(block name, lookup prefix) of each atlas block (``encoders``, ``multimodal``) holding ``model_type``, read
    without unpacking the block (its ``rows`` / ``cells`` keys only); a malformed block counts as not holding it."""
    from .analysis.support_file import BLOCK_PREFIXES, _block_models

    held = doc.block_models() if hasattr(doc, "block_models") else _block_models(doc)  # the index: no block read
    return [(name, prefix) for name, prefix in BLOCK_PREFIXES.items() if model_type in held.get(name, ())]


def block_answer(doc: Any, name: str, model_type: str, asked: str, attn_implementation: str, transformers_version: str,
                 where: str = "", source: str | Path | None = None) -> Answer:
    """The answer of the atlas's ``name`` block (``encoders`` / ``multimodal``: ``support.json[name]``, SCHEMA.md)
    for ``model_type`` (``asked``: the argument as given, ``encoder:bert``), by the same rule as the transformers
    axis (:func:`_model_answer`: measured, a sweep's release, the side of a placed transition, or not measured with
    the nearest releases). An ``absent`` verdict: the model is not a model_type of that release (measured: the
    release ran, the model was not there). A support file without the block answers not measured with a note.

    Raises:
        PackcheckUsageError: the block is malformed (named with ``source``, the support file, and how to restore it).
    """
    import dataclasses

    from .atlas.kinds_render import ABSENT, block_doc, reproduce

    base = {"model_type": asked, "attn_implementation": attn_implementation, "transformers_version": transformers_version,
            "where": where}
    try:
        block = block_doc(doc, name)
    except ValueError as exc:  # a hand-edited block: one line naming the file, never a traceback
        from .analysis.support_file import RESTORE

        raise PackcheckUsageError(f"Support file '{source or default_support_file()}' is corrupt: {exc}; "
                                  f"{RESTORE}.") from None
    if block is None:
        return Answer(**base, measured=False, notes=[(f"this support file has no {name} block (`python tools/atlas_kinds.py` "
                                                     "measures it)")])
    answer = _model_answer(block, model_type, attn_implementation, transformers_version, None, where)
    notes = [n.replace(f"architecture '{model_type}'", f"model '{asked}'") for n in answer.notes]
    if answer.verdict == ABSENT:
        notes.append(f"{model_type} is not a model_type of transformers {answer.measured_at}: nothing to pack there")
    if answer.measured and answer.measured_at:  # the multimodal block's collator layouts (eager's: sdpa's unless stored)
        rows = block["cells"].get(model_type) or {}
        entry = rows.get(answer.backend or "", {}).get(answer.measured_at) or {}
        sdpa = rows.get("sdpa", {}).get(answer.measured_at) or {}
        for field, words in (("layouts", "collator layouts"), ("processor", ("the processor's rows through "
                                                                 "DataCollatorWithFlattening"))):  # mm_layouts, mm_processor
            got = entry.get(field) or (sdpa.get(field) if answer.backend == "eager" else None)
            if got:
                notes.append(f"{words} at {answer.measured_at}: "
                             + ", ".join(f"{name} {verdict} ({number:.1e})" for name, (verdict, number) in got.items()))
        videos = entry.get("videos") or (sdpa.get("videos") if answer.backend == "eager" else None)
        if videos:  # mm_videos: [verdict, max |Δ|, a fail's cause]
            verdict, number, *cause = videos
            notes.append(f"a row with a video at {answer.measured_at}: {verdict}{' (' + cause[0] + ')' if cause else ''}"
                         + (f", text logits max |Δ| {number:.1e}" if number is not None else ""))
        for field, words in (("token_cls", "a token-classification head on the packed row"),  # the encoders' side checks
                             ("seq_cls", "the model's own sequence-classification head on a row of 3 examples")):
            got = entry.get(field) or (sdpa.get(field) if answer.backend == "eager" or field == "seq_cls" else None)
            if got:  # [verdict, number, a fail's or a crash's cause]; seq_cls is once per model, on the sdpa entry
                verdict, number, *cause = got
                detail = "" if number is None else (f", {number:g} logits row{'s' if number != 1 else ''}" if field == "seq_cls"
                                                    else f", logits / loss max |Δ| {number:.1e}")
                notes.append(f"{words} at {answer.measured_at}: {verdict}{' (' + cause[0] + ')' if cause else ''}{detail}")
    if block.get("labels"):  # the encoders block: the flattening collator on scalar labels at the asked release
        from .atlas.labels import labels_note

        note = labels_note(block["labels"], transformers_version)
        if note:
            notes.append(note)
    check = answer.check or (block.get("checks") or [None])[0] if answer.number is not None else answer.check
    return dataclasses.replace(answer, model_type=asked, notes=notes, check=check, reproduce=reproduce(
        block, answer.measured_at, model_type, answer.backend or attn_implementation) if answer.measured and answer.measured_at else "")


def is_bare_minor(transformers_version: str) -> bool:
    """``4.53`` (a major.minor with no patch) as opposed to ``4.53.0``: a minor is answered per patch."""
    text = str(transformers_version).strip()
    return text.count(".") == 1 and all(part.isdigit() for part in text.split("."))


def lookup_releases(model_type: str, attn_implementation: str, transformers_version: str, trl_version: str | None = None,
                    path: str | Path | None = None, libraries: dict[str, str] | None = None,
                    stack: str | None = None) -> list[Answer]:
    """:func:`lookup` for one release, or, for a bare minor (``4.53``), one answer per patch of that minor the atlas
    knows (measured, swept, or placed by a bisect's first / last release), oldest first: a minor is not its ``.0``.
    A minor the atlas knows no patch of is answered as ``X.Y.0`` (not measured, with the nearest releases).

    Raises:
        PackcheckUsageError: as :func:`lookup`.
    """
    if not is_bare_minor(transformers_version):
        return [lookup(model_type, attn_implementation, transformers_version, trl_version, path, libraries, stack)]
    from packaging.version import Version

    first = lookup(model_type, attn_implementation, transformers_version + ".0", trl_version, path, libraries, stack)
    doc = load_support_view(path)
    minor = Version(transformers_version).release[:2]
    known = {r["transformers"] for r in doc.get("releases", [])}
    for row in (doc["cells"].get(first.model_type) or {}).values():
        known.update(row)
    for t in doc.get("transitions", []):
        b = t.get("bisected") or {}
        known.update(str(v) for v in (b.get("first"), b.get("last")) if v)
        known.update(str(p.get("version")) for p in b.get("probes") or [] if isinstance(p, dict) and p.get("version"))
    patches = sorted({Version(v) for v in known if is_version(v) and Version(v).release[:2] == minor})
    if not patches:
        return [first]
    top = patches[-1].release[2] if len(patches[-1].release) > 2 else 0
    out = []
    for patch in range(top + 1):  # every patch up to the newest known: one between two known ones is placed or named
        version = f"{minor[0]}.{minor[1]}.{patch}"
        out.append(first if patch == 0 else lookup(first.model_type, attn_implementation, version, trl_version, path,
                                                   libraries, stack))
    if first.resolved_from:
        import dataclasses

        out = [dataclasses.replace(a, resolved_from=first.resolved_from) for a in out]
    return out


def looks_like_model_reference(name: str) -> bool:
    """A Hub model ID (``Qwen/Qwen2.5-0.5B``), a model folder or a ``config.json`` path rather than a ``model_type``."""
    return "/" in name or name.endswith(".json") or Path(name).exists()


def resolve_model_type(name: str, known: list[str]) -> tuple[str, str]:
    """(``model_type``, where it was read) for a Hub model ID, a local model folder or a ``config.json`` path, read
    offline: the folder's / file's ``config.json``, else the local Hub cache (``HF_HUB_CACHE`` / ``HF_HOME``, as
    ``huggingface_hub.try_to_load_from_cache`` finds it; nothing is downloaded).

    Raises:
        PackcheckUsageError: the file is not a JSON object with a ``model_type``; the Hub ID is not in the local
            cache (the message says how to get its config and the nearest model_type by name).
    """
    from .errors import read_document

    candidate = Path(name)
    fix = "pass a model folder holding config.json, a config.json path, a Hub model ID in the local cache, or a model_type"
    if candidate.is_dir():
        candidate = candidate / "config.json"
        if not candidate.exists():
            raise PackcheckUsageError(f"Model folder '{name}' (the model_type argument) has no config.json: {fix}.")
    if candidate.exists():
        source = str(candidate)
    else:
        if name.count("/") != 1 or name.startswith(("/", ".")):
            raise PackcheckUsageError(f"Model '{name}' (the model_type argument) is neither a model_type, an existing file "
                                      f"or folder, nor a Hub model ID (owner/name): {fix}.")
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except (ValueError, OSError) as exc:  # a malformed ID: huggingface_hub validates it (HFValidationError)
            raise PackcheckUsageError(f"Model '{name}' (the model_type argument) is not a Hub model ID "
                                      f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]}): {fix}.") from None
        if not isinstance(cached, str):
            guess = guess_model_type(name, known)
            hint = f" By its name it may be model_type '{guess}': packcheck lookup {guess} ..." if guess else ""
            raise PackcheckUsageError(f"Hub model '{name}' has no config.json in the local Hub cache (looked up offline, "
                                      "HF_HUB_CACHE / HF_HOME): get it with `hf download " + name + " config.json` where the "
                                      f"Hub is reachable, or pass the model folder or its config.json.{hint}")
        source = f"{cached} (the local Hub cache of {name})"
        candidate = Path(cached)
    config = read_document(candidate, "json", "Model config", f"{fix}.")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise PackcheckUsageError(f"Model config {candidate} has no model_type (got {model_type!r:.60}): {fix}.")
    return model_type, source


def guess_model_type(name: str, known: list[str]) -> str | None:
    """The longest ``model_type`` of ``known`` that a model's name starts with, ignoring case and punctuation, from its
    whole name or any of its dash-separated parts (``Qwen/Qwen2.5-0.5B`` -> ``qwen2``, ``meta-llama/Meta-Llama-3-8B``
    -> ``llama``); None when none fits."""
    import re

    def norm(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    base = name.rsplit("/", 1)[-1]
    parts = base.split("-")
    starts = [norm("-".join(parts[i:])) for i in range(len(parts))]
    fits = [t for t in known if norm(t) and any(s.startswith(norm(t)) for s in starts)]
    return max(fits, key=lambda t: len(norm(t))) if fits else None


def answer_at(doc: dict[str, Any], model_type: str, attn_implementation: str, transformers_version: str,
              trl_version: str | None = None, where: str = "") -> Answer:
    """:func:`_model_answer` (the model fed the packed row), with the answer per training path
    (:func:`pytest_packcheck.analysis.training_paths.training_paths`: the model, ``Trainer``, ``SFTTrainer`` with ``trl_version``)
    wherever the model's verdict is answered, and the config the atlas's model rests on.

    Raises:
        InvalidVersion: ``transformers_version`` is not a version (:func:`lookup` checks it first).
    """
    import dataclasses

    from packaging.version import Version

    answer = _model_answer(doc, model_type, attn_implementation, transformers_version, trl_version, where)
    if not answer.answered:
        return answer
    from .analysis.training_paths import training_paths

    row = (doc["cells"].get(model_type) or {}).get(answer.backend or "") or {}
    entry = row.get(answer.measured_at or "")
    paths = training_paths(doc, model_type, answer.backend or attn_implementation, Version(transformers_version), entry,
                           answer.verdict, answer.causes, answer.trl if trl_version else None)
    config = (entry or {}).get("config") or "transformers' default config for the architecture, shrunk (packcheck's shrink)"
    return dataclasses.replace(answer, paths=paths, config_source=config)


def _model_answer(doc: dict[str, Any], model_type: str, attn_implementation: str, transformers_version: str,
                  trl_version: str | None = None, where: str = "") -> Answer:
    """:func:`lookup`'s answer from a loaded support document (:func:`load_support`), its arguments already
    checked: the one rule for "what does the atlas say at this release" (``packcheck lookup`` and ``packcheck
    claims`` both answer through it). Measured at ``transformers_version``; else, between two measured releases
    whose verdicts differ, the side a found bisect places it on (``inferred_from``); else not measured, with the
    nearest measured releases (``nearest``) and why (``notes``). ``where``: the source named in the answer.

    Raises:
        InvalidVersion: ``transformers_version`` is not a version (:func:`lookup` checks it first).
    """
    from packaging.version import Version

    from .errors import closest

    wanted = Version(transformers_version)
    backend = ANSWERED_FROM.get(attn_implementation, attn_implementation)
    notes = []
    if backend != attn_implementation:
        notes.append(f"{attn_implementation} is answered from {backend} (transformers' flash varlen path on packcheck's "
                     "CPU reference kernel)")
    base = {"model_type": model_type, "attn_implementation": attn_implementation,
            "transformers_version": transformers_version, "where": where}
    if trl_version:
        from .atlas.trl_render import trl_answer

        # the TRL answer keeps its own notes (trl.notes), printed under its own lines (trial 18, 137: a transformers
        # note printed below the TRL lines read as being about the TRL release)
        base["trl"] = trl_answer(doc, model_type, backend, trl_version, transformers_version)
    dates = {r["transformers"]: r["measured"] for r in doc.get("releases", []) if isinstance(r.get("measured"), str)}
    arch = doc["cells"].get(model_type)
    if arch is None:
        hint = closest(model_type, list(doc["cells"]))
        if not hint and guess_model_type(model_type, list(doc["cells"])):  # 'Qwen2.5' got no hint (issue 41)
            hint = f" Did you mean '{guess_model_type(model_type, list(doc['cells']))}'?"
        notes.append(f"architecture '{model_type}' is not in the atlas ({len(doc['cells'])} measured).{hint}")
        return Answer(**base, measured=False, notes=notes)
    row = arch.get(backend)
    if row is None:
        notes.append(f"backend '{backend}' is not measured for {model_type} (measured: {', '.join(sorted(arch))})")
        return Answer(**base, measured=False, notes=notes)
    # 4.56 is 4.56.0: the release the atlas names, whatever its spelling
    key = next((v for v in row if is_version(v) and Version(v) == wanted), str(wanted))
    entry = row.get(key)
    if entry is not None:
        return Answer(**base, measured=True, verdict=entry["verdict"], causes=list(entry.get("causes", [])),
                      check=entry.get("check"), number=entry.get("number"), message=entry.get("message", ""),
                      measured_at=key, measured_on=dates.get(key), backend=backend,
                      notes=notes + _finding_notes(entry), findings=list(entry.get("findings") or []),
                      reproduce=_reproduce(doc, key, model_type, backend))
    if _release_measured(doc, wanted) and not any(is_version(v) and Version(v) == wanted for r in arch.values() for v in r):
        # the release was measured and this architecture is not in it: not a gap of the atlas (atlas review, U3)
        first = min((v for r in arch.values() for v in r if is_version(v)), key=Version, default=None)
        notes.append(f"{model_type} is not among the architectures of transformers {wanted} (that release was measured)"
                     + (f"; the atlas measures it from {first}" if first and Version(first) > wanted else ""))
    measured = sorted(row, key=Version)
    below = [v for v in measured if Version(v) < wanted]
    above = [v for v in measured if Version(v) > wanted]
    nearest = [{"transformers": v, "verdict": row[v]["verdict"], "causes": list(row[v].get("causes", [])),
                "side": side} for v, side in ((below[-1] if below else None, "below"), (above[0] if above else None, "above")) if v]
    if below and above and _same(row[below[-1]], row[above[0]]):
        notes.append(f"both neighbours agree ({row[below[-1]]['verdict']}); the atlas records no transition between them")
    elif below and above:
        swept = _swept_entry(doc, model_type, backend, below[-1], above[0], wanted)
        if swept is not None:  # the sweep ran this very release: a measurement, not an inference (atlas review, U1)
            from .atlas import reproduce_command

            version, probe = swept
            notes.append(f"measured by the atlas's sweep of {below[-1]} .. {above[0]} (the patch releases between, run with "
                         "the architectures whose verdict changes across that gap)")
            return Answer(**base, measured=True, verdict=probe["verdict"], causes=list(probe.get("causes") or []),
                          check=probe.get("check"), number=probe.get("number"), measured_at=version, backend=backend,
                          nearest=nearest, notes=notes, reproduce=reproduce_command(version, model_type, backend))
        side = _bisected_side(doc, model_type, backend, below[-1], above[0], wanted)
        if side is not None:
            version, inferred = side
            entry = row[version]
            return Answer(**base, measured=False, verdict=entry["verdict"], causes=list(entry.get("causes", [])),
                          check=entry.get("check"), number=entry.get("number"), message=entry.get("message", ""),
                          measured_at=version, measured_on=dates.get(version), backend=backend, nearest=nearest,
                          notes=notes, inferred_from=inferred)
        record = _transition(doc, model_type, backend, below[-1], above[0], "bisected")
        why = ("not bisected yet" if not record else f"its bisect found no patch ({record.get('outcome')})"
               if record.get("outcome") != "found" else
               f"its bisect does not place it (last {record.get('last')}, first {record.get('first')})")
        notes.append(f"the verdict changes between {below[-1]} and {above[0]}: this release is on one side of it; {why}")
    return Answer(**base, measured=False, nearest=nearest, backend=backend, notes=notes)


def _transition(doc: dict[str, Any], model_type: str, backend: str, before: str, after: str, key: str | None = None) -> Any:
    """The support document's transition of (``model_type``, ``backend``) from ``before`` to ``after`` (or its
    ``key`` field), None when there is none."""
    t = next((t for t in doc.get("transitions", []) if (t["model_type"], t["backend"], t["last_before"], t["first_after"])
              == (model_type, backend, before, after)), None)
    return t if t is None or key is None else t.get(key)


def _bisected_side(doc: dict[str, Any], model_type: str, backend: str, before: str, after: str,
                   wanted: Any) -> tuple[str, str] | None:
    """(measured release whose verdict ``wanted`` shares, the bisect named) when a found bisect of the transition
    ``before`` -> ``after`` places ``wanted``: at or after its ``first`` release (the newer side's behaviour) -> ``after``,
    at or before its ``last`` -> ``before``. None when the transition was not bisected, the bisect found no patch,
    or ``wanted`` lies strictly between ``last`` and ``first`` (a yanked or unprobed release)."""
    from packaging.version import Version

    record = _transition(doc, model_type, backend, before, after, "bisected")
    if not record or record.get("outcome") != "found" or not record.get("first") or not record.get("last"):
        return None
    first, last = Version(record["first"]), Version(record["last"])
    side = after if wanted >= first else before if wanted <= last else None
    if side is None:
        return None
    what = f"bisect of {record.get('cell', model_type)}: first {record['first']}, last {record['last']}"
    if record.get("method") != "sweep":  # `packcheck bisect` probed one check; the other checks are the side's
        what += " (it probed that cell's check only; the verdict is the measured side's)"
    if record.get("file"):
        what += f" ({record['file']})"
    return side, what


def _swept_entry(doc: dict[str, Any], model_type: str, backend: str, before: str, after: str,
                 wanted: Any) -> tuple[str, dict[str, Any]] | None:
    """(release, its entry) when the sweep of the transition ``before`` -> ``after`` ran ``wanted`` itself and
    measured a verdict there (``bisected.probes``; a sweep probe is a whole atlas entry, any outcome); None
    otherwise (no sweep, or the release was not run or not measured)."""
    from packaging.version import Version

    record = _transition(doc, model_type, backend, before, after, "bisected")
    if not record or record.get("method") != "sweep":
        return None
    probe = next((p for p in record.get("probes") or [] if isinstance(p, dict) and is_version(str(p.get("version")))
                  and Version(str(p["version"])) == wanted and p.get("verdict")), None)
    return (str(probe["version"]), probe) if probe else None


def _release_measured(doc: dict[str, Any], wanted: Any) -> bool:
    from packaging.version import Version

    return any(is_version(r["transformers"]) and Version(r["transformers"]) == wanted for r in doc.get("releases", []))


def _finding_notes(entry: dict[str, Any]) -> list[str]:
    """One note per finding of ``entry``: its code and what it means (``checks.causes``)."""
    from .checks.causes import CAUSES

    return [f"finding {code}: {CAUSES[code]}" if code in CAUSES else f"finding {code}"
            for code in entry.get("findings") or []]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["verdict"] == b["verdict"] and list(a.get("causes", [])) == list(b.get("causes", []))
