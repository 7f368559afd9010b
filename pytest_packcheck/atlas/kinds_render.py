"""The encoder and multimodal blocks (:mod:`.kinds`) rendered (``atlas.md``'s sections) and answered
(:func:`kind_answer`, for :func:`pytest_packcheck.support.lookup`). Light: json and packaging only, no torch /
transformers import, nothing of the atlas's measuring machinery."""

from __future__ import annotations

from typing import Any

from ..analysis.support_file import BLOCK_PREFIXES

#: Block name -> (the ``packcheck lookup`` prefix that asks it, atlas.md's heading, what a row is). The lookup
#: prefix of the encoder block is the spec prefix the audit builds it with (``encoder:bert``); the multimodal
#: block's models are ``arch:`` specs, whose plain model_type the text-path atlas answers, so it is asked as
#: ``multimodal:qwen2_vl``.
BLOCKS: dict[str, tuple[str, str, str]] = {
    "encoders": (BLOCK_PREFIXES["encoders"], "Encoders and embedding models per release",
                 ("the model built with its masked-LM head (else its base model), fed the row DataCollatorWithFlattening "
                 "gives (position_ids restarting per example, no attention_mask), against each example alone: "
                 "isolation of hidden states and pooled embeddings, hidden-state parity, mean / CLS / last-token pooling "
                 "per segment, MLM loss, positions as the model numbers them. The number is the deciding check's "
                 "max |Δ| of float32 hidden states (loss: nats)")),
    "multimodal": (BLOCK_PREFIXES["multimodal"], "Multimodal rows with pixels per release",
                   ("a VLM built tiny (2-block vision tower) with real pixel_values for two images of different sizes, "
                   "packed in one row with a text-only sample, against each sample alone with its own pixels: "
                   "isolation and parity of the text logits and loss, M-RoPE positions per sample against the model's "
                   "own get_rope_index. The number is the deciding check's max |Δ| of float32 text logits; "
                   "\"layouts\" says which collator layouts hold on that release")),
}
#: Block name -> the spec prefix its models are built with where the block holds a model beyond its suite's (a block
#: over every architecture: ``encoder:albert``, ``arch:glm4v``) and its ``specs`` names none of its own.
SPEC_PREFIXES = {"encoders": "encoder:", "multimodal": "arch:"}
#: Verdict of an entry whose model is not in that release's transformers (:data:`.collect.ABSENT`).
ABSENT = "absent"


def _symbol(verdict: str) -> str:
    from ..results.schema import SYMBOLS

    return "∅" if verdict == ABSENT else SYMBOLS.get(verdict, verdict)


def _label(entry: dict[str, Any]) -> str:
    causes = ", ".join(c.replace("_", " ") for c in entry.get("causes", []))
    word = ABSENT if entry["verdict"] == ABSENT else ""
    return f"{_symbol(entry['verdict'])}{' ' + word if word else ''}{' ' + causes if causes else ''}"


def block_runs(row: dict[str, dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """Runs of equal verdict + causes along ``order`` (the block's measured releases): ``first``, ``last``,
    ``label``, ``check`` and ``number`` (the largest key number in the run; None when none was measured):
    :func:`.trl_render.version_runs` with this block's labels (``∅ absent``)."""
    from .trl_render import version_runs

    return version_runs(row, order, _label, with_check=True)


def runs_text(runs: list[dict[str, Any]]) -> str:
    """``∅ absent up to 4.47.1; ❌ leak 4.48.3 .. 5.24.0 (encoder_parity ≤ 1.2e-02); ✅ from 5.25.0``."""
    parts = []
    for i, r in enumerate(runs):
        span = r["first"] if r["first"] == r["last"] else f"{r['first']} .. {r['last']}"
        if len(runs) > 1 and i == 0:
            span = f"up to {r['last']}"
        elif len(runs) > 1 and i == len(runs) - 1:
            span = f"from {r['first']}"
        num = f" ({r['check']} ≤ {r['number']:.1e})" if r["number"] is not None and r.get("check") and "✅" not in r["label"] else ""
        parts.append(f"{r['label']} {span}{num}")
    return "; ".join(parts)


def _short(message: Any) -> str:
    """A no-verdict entry's reason in a few words: its message without the "model build: ValueError: " lead, up
    to its first colon or parenthesis."""
    import re

    text = re.sub(r"^model build: \w+: ", "", " ".join(str(message or "").split()))
    return re.split(r"[(:;]", text, maxsplit=1)[0].strip()[:100] or "no reason recorded"


def render_kind_markdown(block: dict[str, Any]) -> list[str]:
    """One block's section of ``atlas.md`` (lines): what is measured, on the newest release what does not pack,
    per model one line per backend with its runs over the releases, the collator layouts per release (multimodal),
    every transition with where it was placed, and the releases measured with their cost."""
    from ..report.text import escape_md as name_md
    from .render import transition_side

    block = unpack(block)
    prefix, title, what = BLOCKS[block["kind"]]
    order = [r["transformers"] for r in block["releases"]]
    newest = order[-1] if order else None
    example = next((n for n in sorted(block["cells"])), "bert")
    every = block.get("all_architectures")
    lines = ["", f"## {title}", "",
             (f"`{block['kind']}` block (`packcheck audit --audit {block['kind']}"
              + (" --all-architectures`'s models on each release, in that release's environment: the suite's and every "
                 "architecture that release has, one it lacks has no line there" if every else
                 "`'s models on each release, in that release's environment")
              + f"; {', '.join(block['backends'])}; checks {', '.join(block['checks'])}; float32, CPU, "
              f"tiny random models): {what}. ∅ absent: the suite's model is not a model_type of that release. "
              f"`packcheck lookup {prefix}{example} sdpa {newest or '5.25.0'}` answers from it."), "",
             f"Measured releases: {', '.join(order) or 'none'}.",
             f"Not measured yet: {', '.join(block.get('missing') or []) or 'none'}"
             + (" (resume: `python tools/atlas_kinds.py`)." if block.get("missing") else "."), ""]
    if newest:
        entries = [(name, backend, e) for name in sorted(block["cells"]) for backend in block["backends"]
                   for e in [block["cells"][name].get(backend, {}).get(newest)] if e]
        bad = [(n, b, e) for n, b, e in entries if e["verdict"] == "fail"]
        lines.append(f"On {newest}, packed is not as each example alone (model / backend: cause, deciding check and "
                     "number): " + ("; ".join(f"{prefix}{name_md(n)} / {b}: {_label(e)}"
                                              + (f" ({e['check']} {e['number']:.1e})" if e.get("number") is not None else "")
                                              for n, b, e in bad) or "none") + ".")
        other = [(n, b, e) for n, b, e in entries if e["verdict"] not in ("pass", "fail", ABSENT)]
        if other:
            lines.append(f"No verdict on {newest}: " + "; ".join(
                f"{prefix}{name_md(n)} / {b}: {_label(e)} ({name_md(_short(e.get('message')))})" for n, b, e in other) + ".")
        leaky = sorted({f"{name_md(n)} {layout}" for n, by in block["cells"].items() for e in [by.get("sdpa", {}).get(newest)] if e
                        for layout, (verdict, _) in (e.get("layouts") or {}).items() if verdict != "holds"})
        if leaky:
            lines.append(f"Collator layouts that do not hold on {newest} (sdpa): {', '.join(leaky)}.")
        lines.append("")
    lines += ["Per model, one line per backend: the verdict over the measured releases, each run with its first and last release.", ""]
    for name in sorted(block["cells"]):
        for backend in block["backends"]:
            row = block["cells"][name].get(backend)
            if row:
                lines.append(f"- **{prefix}{name_md(name)}** / {backend}: {runs_text(block_runs(row, order))}")
    for field, intro in SIDE_SECTIONS:
        if any(e.get(field) for by in block["cells"].values() for row in by.values() for e in row.values()):
            lines += ["", intro, ""]
            for name in sorted(block["cells"]):
                runs = _field_runs(block["cells"][name].get("sdpa", {}), field, order)
                if runs:
                    lines.append(f"- **{name_md(name)}**: " + "; ".join(f"{a}{' .. ' + b if b != a else ''}: {t}" for a, b, t in runs))
    if block.get("labels"):  # the encoders block: the flattening collator on classification labels per release
        from .labels import labels_markdown

        lines += labels_markdown(block["labels"])
    lines += ["", f"### {title.split(' per ')[0]}: transitions", "",
              "| model | backend | last before | first after | before | after | placed |", "|---|---|---|---|---|---|---|"]
    for t in block["transitions"]:
        b = t.get("bisected")
        placed = f"{b['outcome']}: first {b.get('first')}, last {b.get('last')}" if b else "not yet"
        lines.append(f"| {prefix}{name_md(t['model_type'])} | {t['backend']} | {t['last_before']} | {t['first_after']} | "
                     f"{transition_side(t['before'], _label)} | {transition_side(t['after'], _label)} | {placed} |")
    if not block["transitions"]:
        lines.append("| — | — | — | — | — | — | no change between measured releases |")
    lines += ["", "| release | models present | cells | wall s | CPU s |", "|---|---|---|---|---|"]
    lines += [f"| {r['transformers']} | {r.get('models', '—')} | {r.get('cells') or '—'} | {r.get('wall_s') or '—'} | "
              f"{r.get('cpu_s') or '—'} |" for r in block["releases"]]
    return lines


#: The multimodal block's per-entry fields beyond the verdict (:data:`.kinds.SIDE_FIELDS` and ``layouts``), each an
#: atlas.md list of runs over the releases (sdpa), with its heading line.
SIDE_SECTIONS = (
    ("layouts", ("Collator layouts per release (sdpa; `mm_layouts`: holds = text logits packed as alone, leaks = one "
                "sample moves another, differs = no leak but not as alone), each run of equal layouts with its releases:")),
    ("videos", ("A row with a video per release (sdpa; `mm_videos`: pixel_values_videos / video_grid_thw beside a text-only "
               "and an image sample, on the release's layout; the number is the max |Δ| of text logits packed vs alone; "
               "M-RoPE families with a video_token_id only), each run with its releases:")),
    ("processor", ("The family's processor through DataCollatorWithFlattening per release (sdpa; `mm_processor`: the "
                  "processor's rows packed by the collator as it is, plus the pixels, plus flash kwargs; as the layouts "
                  "above; families with a processor recipe that builds on CPU: LLaVA, Gemma 3, Idefics3), each run "
                  "with its releases:")),
    ("token_cls", ("A token-classification head on the packed row per release (sdpa; `encoder_token_cls`: the head's "
                  "logits and loss, labels per token, against each example alone; the number is the worse of the two), "
                  "each run with its releases:")),
    ("seq_cls", ("The model's own sequence-classification head on a packed row of 3 examples per release (sdpa; "
                "`encoder_seq_cls`: ✅ one logits row per example, ❌ pooled head: the rows it returns, pooled once per "
                "packed row; pool per segment instead), each run with its releases:")),
)
#: The side fields that are one [verdict, number, cause?] (kinds.VERDICT_FIELDS), and ``seq_cls``, whose number is a
#: count of logits rows, not a difference.
_VERDICT_FIELDS = ("videos", "token_cls", "seq_cls")


def _field_text(field: str, value: Any) -> str:
    """One entry's ``layouts`` / ``processor`` (``layout verdict, ...``), ``videos`` / ``token_cls`` (``✅``, ``❌ leak``)
    or ``seq_cls`` (``❌ pooled head (1 logits row)``)."""
    if field in _VERDICT_FIELDS:
        verdict, number, *cause = value
        rows = [f"({number:g} logits row{'s' if number != 1 else ''})"] if field == "seq_cls" and number is not None else []
        return " ".join([_symbol(verdict), *(c.replace("_", " ") for c in cause), *rows])
    return ", ".join(f"{k} {verdict}" for k, (verdict, _) in value.items())


def _field_number(field: str, value: Any) -> float | None:
    """The largest number of an entry's field: ``videos``' / ``token_cls``' max |Δ|, a layout's (``layouts`` /
    ``processor``); None for ``seq_cls`` (its count is in its text)."""
    if field == "seq_cls":
        return None
    nums = [value[1]] if field in _VERDICT_FIELDS else [n for _, n in value.values()]
    nums = [n for n in nums if isinstance(n, (int, float))]
    return max(nums) if nums else None


def _field_runs(row: dict[str, Any], field: str, order: list[str]) -> list[list[str]]:
    """[first, last, text] runs of equal :func:`_field_text` along ``order``, over the releases whose entry has
    ``field``; the text ends with the run's largest number (``max |Δ| 3.1e-07``)."""
    runs: list[list[Any]] = []
    for version in order:
        e = row.get(version)
        if not e or not e.get(field):
            continue
        text, num = _field_text(field, e[field]), _field_number(field, e[field])
        if runs and runs[-1][2] == text:
            runs[-1][1] = version
            runs[-1][3] = num if runs[-1][3] is None or (num is not None and num > runs[-1][3]) else runs[-1][3]
        else:
            runs.append([version, version, text, num])
    return [[a, b, t + (f" (max |Δ| {n:.1e})" if n is not None else "")] for a, b, t, n in runs]


def pack(block: dict[str, Any]) -> dict[str, Any]:
    """The block as ``support.json`` stores it: ``cells`` (model -> backend -> release -> entry) as ``rows`` (model ->
    backend -> runs ``[first, last, entry]`` over the block's releases, a run being consecutive measured releases
    with equal entries: a row of 40 releases is a few runs, not 40 copies). :func:`unpack` gives ``cells`` back
    exactly. A packed block is returned as is."""
    if "rows" in block:
        return block
    order = [r["transformers"] for r in block["releases"]]
    rows: dict[str, dict[str, list[list[Any]]]] = {}
    for name, by_backend in block["cells"].items():
        for backend, row in by_backend.items():
            runs: list[list[Any]] = []
            contiguous = False
            for version in order:
                entry = row.get(version)
                if entry is None:
                    contiguous = False
                    continue
                if contiguous and runs[-1][2] == entry:
                    runs[-1][1] = version
                else:
                    runs.append([version, version, entry])
                contiguous = True
            rows.setdefault(name, {})[backend] = runs
    return {**{k: v for k, v in block.items() if k != "cells"}, "rows": rows}


def unpack(block: dict[str, Any]) -> dict[str, Any]:
    """:func:`pack`'s inverse: ``rows`` back to ``cells`` (a block that has ``cells`` is returned as is).

    Raises:
        ValueError: a run names a release the block's ``releases`` does not hold (a hand-edited file).
    """
    if "rows" not in block or "cells" in block:
        return block
    order = [r["transformers"] for r in block["releases"]]
    index = {v: i for i, v in enumerate(order)}
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for name, by_backend in block["rows"].items():
        for backend, runs in by_backend.items():
            row = cells.setdefault(name, {}).setdefault(backend, {})
            for first, last, entry in runs:
                if first not in index or last not in index:
                    raise ValueError(f"{block.get('kind')} block: run {first} .. {last} of {name} / {backend} names a "
                                     "release not in its releases")
                for version in order[index[first]:index[last] + 1]:
                    row[version] = entry
    return {**{k: v for k, v in block.items() if k != "rows"}, "cells": cells}


def block_of(model_type: str) -> tuple[str, str] | None:
    """(block name, model_type) for a lookup argument with a block's prefix (``encoder:bert`` -> ``("encoders",
    "bert")``, ``multimodal:qwen2_vl``), None for any other."""
    for name, (prefix, _, _) in BLOCKS.items():
        if model_type.startswith(prefix):
            return name, model_type.removeprefix(prefix).strip()
    return None


def reproduce(block: dict[str, Any], version: str, model_type: str, backend: str) -> str:
    """The command that measures one (model, backend) of ``block`` on ``version`` again."""
    import shlex

    from ..config.options import OPT_BACKENDS, OPT_CHECKS

    spec = next((s for s in block.get("models", []) if s.split(":", 1)[-1].split("{", 1)[0] == model_type),
                (block.get("specs") or {}).get(model_type)  # an architecture beyond the suite's, with a spec of its own
                or f"{SPEC_PREFIXES.get(block.get('kind'), '')}{model_type}")
    return shlex.join(["packcheck", "audit", "--models", spec, "--versions", f"transformers=={version}",
                       f"{OPT_BACKENDS}={backend}", f"{OPT_CHECKS}={','.join(block.get('checks', []))}"])


def block_doc(doc: Any, name: str) -> dict[str, Any] | None:
    """The support document's ``name`` block as :func:`pytest_packcheck.support._model_answer` reads a support
    document (``cells``, ``releases``, ``transitions``, ``generated``), None when the file has no such block.

    Raises:
        ValueError: the block is malformed (a run that does not unpack, an entry without a verdict): the caller
            names the file (:func:`pytest_packcheck.support.block_answer`).
    """
    block = doc.get(name)
    if not isinstance(block, dict) or not isinstance(block.get("cells", block.get("rows")), dict):
        return None
    try:
        block = unpack(block)
        for rows in block["cells"].values():
            for by_release in rows.values():
                for entry in by_release.values():
                    if not isinstance(entry, dict) or not isinstance(entry.get("verdict"), str):
                        raise ValueError(f"{name} block: an entry is {str(entry)[:60]!r}, not an object with a verdict")  # noqa: TRY004 - bad data, one error kind
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        text = str(exc) if isinstance(exc, ValueError) else f"{name} block: {type(exc).__name__}: {exc}"
        raise ValueError(text) from None
    return block


def newest_markdown(support: dict[str, Any]) -> str:
    """The docs page (``docs/hooks.py``: ``reference/atlas-newest.md``) of the blocks' newest release, generated from
    the support file (``reports/atlas/support.json``), never typed: per block, the models that do not pack on it (a
    table: each backend's verdict, cause and the deciding check's number), those that pack on every backend, and for
    the multimodal block each model's collator layouts, processor rows and video row (sdpa)."""
    from ..report.text import escape_md as name_md

    out = ["# The newest release: encoders and VLM rows",
           "",
           ("Generated from `reports/atlas/support.json` (the atlas's encoder and multimodal blocks, `tools/atlas_kinds.py`; "
            "float32, CPU, tiny random models) when the docs are built: what the newest measured transformers release "
            "does with a packed row, against each example alone. `packcheck lookup encoder:<model_type> <backend> "
            "<release>` and `packcheck lookup multimodal:<model_type> <backend> <release>` answer any release.")]
    for name, (prefix, title, _what) in BLOCKS.items():
        raw = support.get(name)
        if not isinstance(raw, dict):
            continue
        block = unpack(raw)
        order = [r["transformers"] for r in block["releases"]]
        if not order:
            continue
        newest, backends = order[-1], block["backends"]
        rows = {m: {b: block["cells"][m].get(b, {}).get(newest) for b in backends} for m in sorted(block["cells"])}
        rows = {m: by for m, by in rows.items() if any(by.values()) and not all(e and e["verdict"] == ABSENT for e in by.values() if e)}
        bad = {m: by for m, by in rows.items() if any(e and e["verdict"] != "pass" for e in by.values())}
        good = [m for m in rows if m not in bad]
        out += ["", f"## {title.split(' per ')[0]} on transformers {newest}", "",
                (f"{len(rows)} models measured on {newest} ({', '.join(backends)}); {len(bad)} are not as each example "
                 "alone on every backend (a fail, no verdict, or a backend the model refuses):"), "",
                "| model | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for m, by in bad.items():
            out.append(f"| {prefix}{name_md(m)} | " + " | ".join(_newest_cell(e) for e in by.values()) + " |")
        out += ["", f"Pack on every backend measured: {', '.join(name_md(m) for m in good) or 'none'}."]
        lines = []
        for m, by in rows.items():
            e = by.get("sdpa") or {}
            parts = [f"{label} {_numbered(field, e[field])}" for field, label in
                     (("layouts", "collator layouts:"), ("processor", "processor rows:"), ("videos", "video row:"),
                      ("token_cls", "token classification:"), ("seq_cls", "sequence classification:")) if e.get(field)]
            if parts:
                lines.append(f"- **{name_md(m)}**: " + "; ".join(parts))
        if lines and name == "encoders":
            out += ["", (f"Classification heads on a packed row on {newest} (sdpa): a token-classification head's logits "
                         "and loss against each example alone (the worse |Δ|), and the rows the model's own "
                         "sequence-classification head returns for a row of 3 examples (one per example, or pooled once "
                         "per row: `pooled_head`):"), "", *lines]
        elif lines:
            out += ["", (f"Collator layouts, the family's processor through DataCollatorWithFlattening, and a row with "
                         f"a video on {newest} (sdpa; holds = as each sample alone, leaks = one sample moves another, "
                         "differs = no leak but not as alone):"), "", *lines]
    return "\n".join(out) + "\n"


def _numbered(field: str, value: Any) -> str:
    """An entry's ``layouts`` / ``processor`` with each layout's number (``flat leaks 3.9e-01, text+mrope holds
    4.2e-07``), its ``videos`` / ``token_cls`` (``✅ 3.0e-07``) or ``seq_cls`` (``❌ pooled head (1 logits row)``)."""
    if field == "seq_cls":
        return _field_text(field, value)
    if field in _VERDICT_FIELDS:
        return _field_text(field, value) + (f" {value[1]:.1e}" if value[1] is not None else "")
    return ", ".join(f"{k} {verdict}" + (f" {number:.1e}" if number is not None else "") for k, (verdict, number) in value.items())


def _newest_cell(entry: dict[str, Any] | None) -> str:
    """One table cell of :func:`newest_markdown`: ``✅``, ``❌ leak (encoder_isolation 3.6e-03)``, or a no-verdict
    entry's label and reason."""
    if not entry:
        return "—"
    if entry["verdict"] == "pass":
        return _symbol("pass")
    number = f" ({entry.get('check')} {entry['number']:.1e})" if entry.get("number") is not None and entry.get("check") else ""
    reason = f" ({_short(entry.get('message'))})" if entry["verdict"] != "fail" and entry.get("message") else ""
    return (_label(entry) + number + reason).replace("|", "\\|")
