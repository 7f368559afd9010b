"""The TRL axis rendered (``atlas.md``'s TRL section) and answered (:func:`trl_answer`, for
:func:`pytest_packcheck.support.lookup`). Light: json and packaging only, no torch / transformers / trl import."""

from __future__ import annotations

from typing import Any

from .plan import version_key

#: Short names of the modes in the Markdown (``TRL_MODES`` of :mod:`.trl` holds what each asks SFTTrainer for).
MODE_NAMES = {"sft": "packing=True", "sft_padding_free": "padding_free", "rl_trl_grpo": "GRPO log-probs",
              "rl_trl_rloo": "RLOO log-probs",
              "rl_trl_dpo": "DPO", "rl_trl_kto": "KTO", "rl_trl_async": "AsyncGRPO padding-free",
              "rl_trl_tree": "AsyncGRPO tree"}
#: The key number of each mode as the Markdown and the lookup print it (the RL modes' are nats: checks/registry.py).
MODE_NUMBERS = {"sft": "loss Δ", "sft_padding_free": "loss Δ", "rl_trl_grpo": "Δlogp", "rl_trl_rloo": "Δlogp",
                "rl_trl_dpo": "Δmargin",
                "rl_trl_kto": "Δmargin", "rl_trl_async": "Δlogp", "rl_trl_tree": "Δlogp"}


def _symbol(verdict: str) -> str:
    from ..results.schema import SYMBOLS as SYMBOL

    return SYMBOL.get(verdict, verdict)


def _label(entry: dict[str, Any]) -> str:
    causes = ", ".join(c.replace("_", " ") for c in entry.get("causes", []))
    return f"{_symbol(entry['verdict'])}{' ' + causes if causes else ''}"


def version_runs(row: dict[str, dict[str, Any]], order: list[str], label: Any = _label,
                 with_check: bool = False) -> list[dict[str, Any]]:
    """Runs of equal ``label(entry)`` (verdict + causes) along ``order`` (measured releases; a release the row lacks
    is skipped over): ``first``, ``last``, ``label`` and ``number`` (the largest key number in the run, None when
    none was measured); ``with_check``: also ``check``, the check of that number (else of the run's first entry).
    The one reduction of the TRL axis (:func:`trl_runs`) and the atlas blocks (:func:`.kinds_render.block_runs`)."""
    runs: list[dict[str, Any]] = []
    for version in order:
        entry = row.get(version)
        if entry is None:
            continue
        text = label(entry)
        if runs and runs[-1]["label"] == text:
            runs[-1]["last"] = version
        else:
            runs.append({"first": version, "last": version, "label": text, "number": None,
                         **({"check": entry.get("check")} if with_check else {})})
        num = entry.get("number")
        if num is not None and (runs[-1]["number"] is None or num > runs[-1]["number"]):
            runs[-1]["number"] = num
            if with_check:
                runs[-1]["check"] = entry.get("check")
    return runs


def trl_runs(row: dict[str, dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """:func:`version_runs` along the measured TRL releases: ``first``, ``last``, ``label`` and ``number``."""
    return version_runs(row, order)


def runs_text(runs: list[dict[str, Any]], unit: str = "loss Δ") -> str:
    """``❌ mask override up to 0.23.1 (loss Δ ≤ 1.2e-02), ✅ from 0.24.0 (loss Δ ≤ 9.5e-07)``: the first run "up
    to", the last "from", those between "A .. B"; one run: "A .. B". ``unit``: the key number's name
    (:data:`MODE_NUMBERS`)."""
    parts = []
    for i, r in enumerate(runs):
        span = f"{r['first']}" if r["first"] == r["last"] else f"{r['first']} .. {r['last']}"
        if len(runs) > 1 and i == 0:
            span = f"up to {r['last']}"
        elif len(runs) > 1 and i == len(runs) - 1:
            span = f"from {r['first']}"
        num = f" ({unit} ≤ {r['number']:.1e})" if r["number"] is not None else ""
        parts.append(f"{r['label']} {span}{num}")
    return ", ".join(parts)


def _effective_text(effective: dict[str, Any]) -> str:
    keys = ("packing_strategy", "padding_free", "return_position_ids", "collator")
    return ", ".join(f"{k} {effective[k]}" for k in keys if k in effective) or "not recorded"


def render_trl_markdown(block: dict[str, Any]) -> list[str]:
    """The TRL section of ``atlas.md`` (lines): what each TRL release configures for ``packing=True``, per family
    one line per mode and backend with its transitions and numbers, every transition, the releases measured
    (with the transformers each ran on) and those not measured yet."""
    from ..report.text import escape_md as name_md

    order = [r["trl"] for r in block["releases"]]
    tf = sorted({str(r.get("transformers")) for r in block["releases"]}, key=lambda v: version_key(v) if v[0].isdigit() else version_key("0"))
    lines = ["", "## TRL: SFTTrainer's packing paths per TRL release", "",
             (f"TRL's `SFTTrainer` on {', '.join(block['families'])} ({', '.join(block['backends'])}; float32, CPU, tiny "
              f"random models), each TRL minor's latest patch in its own environment with transformers {', '.join(tf) or '—'} "
              "(the version environment pins this environment's transformers, which every TRL release measured accepts, "
              "so only TRL changes along the axis). Modes: "
              + "; ".join(f"`{m}`: {what}" for m, what in block["modes"].items())
              + ". The number is the largest first-batch loss difference from the per-example reference over the run "
              "(`loss_delta`). `packcheck lookup MODEL_TYPE ATTN TRANSFORMERS --trl X` answers from it."), "",
             f"Measured TRL releases: {', '.join(order) or 'none'}.",
             f"Not measured yet: {', '.join(block['missing']) or 'none'}"
             + (" (resume: `packcheck atlas --trl`)." if block["missing"] else "."), ""]
    effective = _default_configuration(block, order)
    if effective:
        lines += ["What `packing=True` runs by default (the effective configuration the `sft` check recorded):", ""]
        lines += [f"- {r['first']}{' .. ' + r['last'] if r['last'] != r['first'] else ''}: {r['text']}" for r in effective]
        lines.append("")
    lines += ["Per family, one line per mode: each backend's verdict over the measured TRL releases, with its transitions.", ""]
    for name in sorted(block["cells"]):
        for mode in block["modes"]:
            parts = [f"{backend}: {runs_text(trl_runs(row, order))}" for backend in block["backends"]
                     for row in [block["cells"][name].get(mode, {}).get(backend)] if row]
            if parts:
                lines.append(f"- **{name_md(name)}** / {MODE_NAMES.get(mode, mode)}: {'; '.join(parts)}")
    lines += _rl_lines(block)
    lines += ["", "### TRL transitions", "",
              "| family | mode | backend | last before | first after | before | after |", "|---|---|---|---|---|---|---|"]
    for t in block["transitions"]:
        def side(s: dict[str, Any], unit: str = MODE_NUMBERS.get(t["mode"], "loss Δ")) -> str:
            return _label(s) + (f" ({unit} {s['number']:.1e})" if s.get("number") is not None else "")
        lines.append(f"| {name_md(t['model_type'])} | {MODE_NAMES.get(t['mode'], t['mode'])} | {t['backend']} | "
                     f"{t['last_before']} | {t['first_after']} | {side(t['before'])} | {side(t['after'])} |")
    if not block["transitions"]:
        lines.append("| — | — | — | — | — | — | no change between measured TRL releases |")
    lines += ["", "### TRL releases measured", "",
              "| trl | transformers | accelerate | datasets | cells | wall s | CPU s | CPU s per (family, backend) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in block["releases"]:
        pairs = len({(name, b) for name, by_mode in block["cells"].items() for mode, by_b in by_mode.items()
                     if mode in block["modes"] for b, row in by_b.items() if r["trl"] in row})
        v = r.get("versions") or {}
        per = f"{r['cpu_s'] / pairs:.1f}" if r.get("cpu_s") and pairs else "—"
        lines.append(f"| {r['trl']} | {r.get('transformers') or '—'} | {v.get('accelerate', '—')} | {v.get('datasets', '—')} | "
                     f"{r.get('cells') or '—'} | {r.get('wall_s') or '—'} | {r.get('cpu_s') or '—'} | {per} |")
    return lines


def _rl_lines(block: dict[str, Any]) -> list[str]:
    """The RL part of the TRL section (issue 44): TRL's own RL trainer code per TRL release, per family one line per
    mode with each backend's runs, and the RL releases measured. Nothing when the block has no RL part."""
    from ..report.text import escape_md as name_md

    if not block.get("rl_modes"):
        return []
    rloo = block.get("rloo_releases", [])  # RLOO, measured in runs of its own after the RL part (packcheck atlas --trl --rloo)
    order = sorted({r["trl"] for r in [*block.get("rl_releases", []), *rloo]}, key=version_key)
    tf = sorted({str(r.get("transformers")) for r in [*block.get("rl_releases", []), *rloo]})
    lines = ["", "### TRL's RL trainers per TRL release", "",
             (f"TRL's own RL code on {', '.join(block['rl_families'])} (float32, CPU, tiny random models, a sampling "
              f"temperature 0.7), each TRL minor's latest patch in its own environment with transformers "
              f"{', '.join(tf) or '—'}, against each sample alone. Modes: "
              + "; ".join(f"`{m}`: {what}" for m, what in sorted(block["rl_modes"].items()))
              + ". Numbers in nats: Δlogp the worst completion-token log-prob difference, Δmargin the worst DPO / KTO "
              "chosen-minus-rejected margin difference, over the run. A release where a trainer or its path does not "
              "exist, or cannot run on CPU, is ⏭️ skipped, its reason naming the release and what it lacks "
              "(`packcheck lookup MODEL_TYPE ATTN TRANSFORMERS --trl X` prints it)."), "",
             f"Measured TRL releases (RL part): {', '.join(order) or 'none'}.",
             f"Not measured yet: {', '.join(block.get('rl_missing', [])) or 'none'}"
             + (" (resume: `packcheck atlas --trl --rl`)." if block.get("rl_missing") else ".")]
    if "rloo_releases" in block:
        lines.append(f"RLOO (`rl_trl_rloo`) measured in runs of its own (`packcheck atlas --trl --rloo`): {len(rloo)} TRL "
                     f"releases, {sum(r.get('wall_s') or 0 for r in rloo):.0f} s wall, {sum(r.get('cpu_s') or 0 for r in rloo):.0f} s "
                     f"CPU in all; not measured yet: {', '.join(block.get('rloo_missing', [])) or 'none'}.")
    lines.append("")
    for name in sorted(block["cells"]):
        for mode in sorted(block["rl_modes"]):  # sorted: trl.json and support.json are written with sorted keys
            parts = [f"{backend}: {runs_text(trl_runs(row, order), MODE_NUMBERS.get(mode, 'Δ'))}"
                     for backend in block["rl_backends"] for row in [block["cells"][name].get(mode, {}).get(backend)] if row]
            if parts:
                lines.append(f"- **{name_md(name)}** / {MODE_NAMES.get(mode, mode)}: {'; '.join(parts)}")
    reasons = _skip_reasons(block, order)
    if reasons:
        lines += ["", "Why a mode is skipped, per TRL release (the check's own reason, first family and backend):", ""]
        lines += [f"- {MODE_NAMES.get(m, m)}, {r['first']}{' .. ' + r['last'] if r['last'] != r['first'] else ''}: {r['text']}"
                  for m, r in reasons]
    lines += ["", "| trl (RL part) | transformers | cells | wall s | CPU s |", "|---|---|---|---|---|"]
    lines += [f"| {r['trl']} | {r.get('transformers') or '—'} | {r.get('cells') or '—'} | {r.get('wall_s') or '—'} | "
              f"{r.get('cpu_s') or '—'} |" for r in block["rl_releases"]]
    return lines


def _skip_reasons(block: dict[str, Any], order: list[str]) -> list[tuple[str, dict[str, str]]]:
    """Per RL mode, runs over the RL releases of the skip message of its first family and backend, release numbers
    masked so that one reason over several releases is one run."""
    import re

    from .trl import entry_text

    out = []
    names = sorted(block["cells"])
    for mode in sorted(block["rl_modes"]):
        runs: list[dict[str, str]] = []
        for version in order:
            entry = next((e for name in names for backend in block["rl_backends"]
                          for e in [block["cells"][name].get(mode, {}).get(backend, {}).get(version)] if e), None)
            if entry is None or entry["verdict"] != "skipped":
                runs.append({"first": version, "last": version, "text": ""})
                continue
            text = re.sub(r"\btrl \d+\.\d+\.\d+", "trl X", entry_text(block, mode, version, entry))
            if runs and runs[-1]["text"] == text:
                runs[-1]["last"] = version
            else:
                runs.append({"first": version, "last": version, "text": text})
        out += [(mode, r) for r in runs if r["text"]]
    return out


def _default_configuration(block: dict[str, Any], order: list[str]) -> list[dict[str, str]]:
    """Runs over the TRL releases of the effective configuration ``packing=True`` ran (the ``sft`` mode on
    ``sdpa``, the first family that has it per release): how each TRL release configures packing by default."""
    runs: list[dict[str, str]] = []
    for version in order:
        text = next((_effective_text(e["effective"]) for name in sorted(block["cells"])
                     for e in [block["cells"][name].get("sft", {}).get("sdpa", {}).get(version)] if e and e.get("effective")), None)
        if text is None:
            continue
        if runs and runs[-1]["text"] == text:
            runs[-1]["last"] = version
        else:
            runs.append({"first": version, "last": version, "text": text})
    return runs


def trl_answer(doc: dict[str, Any], model_type: str, backend: str, trl_version: str, transformers_version: str) -> dict[str, Any]:
    """The TRL axis's answer for ``model_type`` on ``backend`` (the measured column, e.g. ``packcheck_flash_ref``
    for flash_attention_2) at ``trl_version``: ``measured`` (bool), ``trl``, ``transformers`` (what that TRL
    release ran with on the axis), ``modes`` (mode -> ``verdict``, ``causes``, ``number`` (loss Δ), ``message``,
    ``effective``) and ``reproduce`` (the command the TRL axis ran for that release) when measured, else ``nearest`` (mode -> the closest measured TRL releases below / above with
    their verdicts), and ``notes``. A support document without a ``trl`` block answers not measured with a note.

    Raises:
        pytest_packcheck.errors.PackcheckUsageError: ``trl_version`` is not a version.
    """
    from packaging.version import InvalidVersion, Version

    from ..errors import PackcheckUsageError

    try:
        wanted = Version(trl_version)
    except InvalidVersion:
        raise PackcheckUsageError(f"TRL version '{trl_version}' (--trl) is not a version: write e.g. 0.24.0.") from None
    block = doc.get("trl")
    out: dict[str, Any] = {"trl": trl_version, "measured": False, "transformers": None, "modes": {}, "nearest": {}, "notes": []}
    if not block:
        out["notes"].append(f"trl {trl_version}: this support file has no TRL axis (no `trl` block); the answer above is "
                            "transformers' padding-free forward / backward, not SFTTrainer's configuration")
        return out
    if backend not in block["backends"]:
        out["notes"].append(f"trl {trl_version}: the TRL axis runs {', '.join(block['backends'])}, not {backend}")
        return out
    by_mode = block["cells"].get(model_type)
    if by_mode is None:
        out["notes"].append(f"trl {trl_version}: '{model_type}' is not a family of the TRL axis ({', '.join(sorted(block['cells']))})")
        return out
    release = next((r for r in block["releases"] if Version(r["trl"]) == wanted), None)
    rl_release = next((r for r in block.get("rl_releases", []) if Version(r["trl"]) == wanted), None)
    rloo_release = next((r for r in block.get("rloo_releases", []) if Version(r["trl"]) == wanted), None)
    # the RL part (issue 44) where the family is on it: its model-level mode (the tree) has its own attention
    asked = [(mode, release, backend) for mode in block["modes"]]
    if model_type in block.get("rl_families", []):
        asked += [(mode, rloo_release if mode == "rl_trl_rloo" else rl_release,
                   backend if backend in by_mode.get(mode, {}) else next(iter(by_mode.get(mode, {})), backend))
                  for mode in sorted(block.get("rl_modes", {}))]
    for mode, measured_in, column in asked:
        row = by_mode.get(mode, {}).get(column, {})
        entry = row.get(str(wanted)) if measured_in else None
        if entry is not None:
            out["modes"][mode] = {k: entry.get(k) for k in ("verdict", "causes", "number", "message", "effective") if k in entry}
            if "message_from" in entry:  # a skip's reason shared with another family / backend of the release
                from .trl import entry_text

                out["modes"][mode]["message"] = entry_text(block, mode, str(wanted), entry)
            continue
        below = [v for v in sorted(row, key=Version) if Version(v) < wanted]
        above = [v for v in sorted(row, key=Version) if Version(v) > wanted]
        out["nearest"][mode] = [{"trl": v, "side": side, "verdict": row[v]["verdict"], "causes": list(row[v].get("causes", []))}
                                for v, side in ((below[-1] if below else None, "below"), (above[0] if above else None, "above")) if v]
    out["rl_modes"] = sorted(block.get("rl_modes", {}))  # the RL trainers' modes (not SFTTrainer's)
    if rl_release and any(m in out["modes"] for m in block.get("rl_modes", {})):
        out["rl_transformers"] = rl_release.get("transformers")
        out["rl_reproduce"] = rl_release.get("command")
    if rloo_release and "rl_trl_rloo" in out["modes"]:
        out["rloo_reproduce"] = rloo_release.get("command")
        out.setdefault("rl_transformers", rloo_release.get("transformers"))
    if release and out["modes"]:
        from .trl import trl_reproduce

        out["measured"] = True
        out["transformers"] = release.get("transformers")
        # the command the TRL axis ran for this release (recorded in trl.json): what measured the answers above;
        # the transformers answer's own reproduce line runs no sft check and no TRL
        out["reproduce"] = release.get("command") or trl_reproduce(release["trl"])
        if release.get("transformers") and Version(str(release["transformers"])) != Version(transformers_version):
            out["notes"].append(f"trl {release['trl']} was measured with transformers {release['transformers']}, not "
                                f"{transformers_version}: its answer is about TRL's configuration there")
    elif (rl_release or rloo_release) and out["modes"]:
        out["measured"] = True
        out["transformers"] = (rl_release or rloo_release).get("transformers")
    if not release:
        out["notes"].append(f"trl {trl_version} is not measured on the TRL axis's SFT part (measured: "
                            f"{', '.join(r['trl'] for r in block['releases']) or 'none'})")
    return out


def trl_answer_lines(answer: dict[str, Any], model_type: str, attn_implementation: str) -> list[str]:
    """:func:`trl_answer` as the lines ``packcheck lookup`` prints."""
    head = f"{model_type} / {attn_implementation} @ trl {answer['trl']}"
    lines = []
    if answer["measured"]:
        for mode, e in answer["modes"].items():
            why = f" [{', '.join(e.get('causes') or [])}]" if e.get("causes") else ""
            num = f" ({MODE_NUMBERS.get(mode, 'Δ')} {e['number']:.1e})" if e.get("number") is not None else ""
            tf = answer.get("rl_transformers") if mode.startswith("rl_") and answer.get("rl_transformers") else answer["transformers"]
            skip = f": {e['message']}" if e["verdict"] == "skipped" and e.get("message") else ""
            lines.append(f"{head} / {MODE_NAMES.get(mode, mode)}: {e['verdict']}{why}{num}{skip}, measured with transformers {tf}")
        if answer.get("reproduce"):
            lines.append(f"  reproduce (the trl {answer['trl']} answers): {answer['reproduce']}")
        if answer.get("rl_reproduce"):
            lines.append(f"  reproduce (the trl {answer['trl']} RL answers): {answer['rl_reproduce']}")
        if answer.get("rloo_reproduce"):
            lines.append(f"  reproduce (the trl {answer['trl']} RLOO answer): {answer['rloo_reproduce']}")
    for mode, near in answer["nearest"].items():
        text = "; ".join(f"{n['trl']}: {n['verdict']}" + (f" [{', '.join(n['causes'])}]" if n["causes"] else "") for n in near)
        lines.append(f"{head} / {MODE_NAMES.get(mode, mode)}: not measured" + (f" (nearest measured: {text})" if text else ""))
    return lines + [f"  {n}" for n in answer.get("notes", [])]
