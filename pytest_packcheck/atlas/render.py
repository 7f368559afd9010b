"""``support.json`` rendered: ``atlas.md`` (read in a minute) and the self-contained ``atlas.html``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..results.schema import SYMBOLS
from .plan import version_key

#: The verdict marks of every packcheck report (results.schema.SYMBOLS): the atlas reads as the matrices do.
SYMBOL = SYMBOLS


def _label(entry: dict[str, Any]) -> str:
    causes = ", ".join(c.replace("_", " ") for c in entry.get("causes", []))
    return f"{SYMBOL.get(entry['verdict'], entry['verdict'])}{' ' + causes if causes else ''}"


def transition_side(entry: dict[str, Any], label: Any = _label) -> str:
    """One side of a transition in atlas.md's tables: its label and, where measured, ``(check number)``."""
    num = f" ({entry['check']} {entry['number']:.1e})" if entry.get("number") is not None and entry.get("check") else ""
    return label(entry) + num


def _runs(row: dict[str, dict[str, Any]], order: list[str]) -> list[tuple[str, str, str]]:
    """(first release, last release, label) of each run of equal verdict + causes along ``order``."""
    runs: list[list[str]] = []
    for version in order:
        if version not in row:
            continue
        label = _label(row[version])
        if runs and runs[-1][2] == label:
            runs[-1][1] = version
        else:
            runs.append([version, version, label])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _why(entry: dict[str, Any]) -> str:
    """Why an entry without a cause code got no verdict, in a few words common to its kind (its message with the
    model's class name left out: "does not support flash attention", "does not support an attention implementation
    through ...")."""
    import re

    text = " ".join(str(entry.get("message") or "").split())
    text = re.sub(r"^model build: \w+: ", "", text)
    text = re.sub(r"^\w+(ForCausalLM|LMHeadModel|ForConditionalGeneration|Model)\b ", "the model ", text)
    text = re.split(r"[(:;]", text, maxsplit=1)[0].strip()
    return text[:80] or "no reason recorded"


def at_a_glance(support: dict[str, Any]) -> list[str]:
    """atlas.md's first section: on the newest measured release, per backend the (architecture) entries by verdict,
    then the ones not to pack grouped by backend and cause, and the passing ones with a finding beside, each
    architecture named; a user finds their model here or under "Per architecture". [] with no release."""
    if not support["releases"]:
        return []
    newest = max((r["transformers"] for r in support["releases"]), key=version_key)
    lines = [f"## At a glance: transformers {newest}", "",
             ("The newest measured release, per backend: how many architectures pack as padding does (✅), do not "
              "(❌, with the cause), or got no verdict (the reason is in their line under \"Per architecture\"). Your "
              "model on another release: `packcheck lookup MODEL_TYPE ATTN VERSION`, or its line below."), "",
             "| backend | ✅ pass | ❌ fail | no verdict |", "|---|---|---|---|"]
    bad: dict[tuple[str, str], list[str]] = {}
    none: dict[tuple[str, str, str], list[str]] = {}
    noted: dict[tuple[str, str], list[str]] = {}
    passing: dict[str, int] = {}
    for backend in support["backends"]:
        counts = {"pass": 0, "fail": 0, "other": 0}
        for name in sorted(support["cells"]):
            e = support["cells"][name].get(backend, {}).get(newest)
            if e is None:
                continue
            kind = e["verdict"] if e["verdict"] in ("pass", "fail") else "other"
            counts[kind] += 1
            if kind == "fail":
                bad.setdefault((backend, ", ".join(e.get("causes") or []) or "fail"), []).append(name)
            elif kind == "other":
                none.setdefault((backend, e["verdict"], ", ".join(e.get("causes") or []) or _why(e)), []).append(name)
            elif kind == "pass":
                for finding in e.get("findings") or []:
                    noted.setdefault((backend, finding), []).append(name)
        passing[backend] = counts["pass"]
        lines.append(f"| {backend} | {counts['pass']} | {counts['fail']} | {counts['other']} |")
    rank = {b: i for i, b in enumerate(support["backends"])}  # per backend, the most common cause first
    if bad:
        lines += ["", f"Do not pack on {newest} (backend, cause: architectures):", ""]
        lines += [f"- {backend}, {cause.replace('_', ' ')} ({len(names)}): {name_md(', '.join(names))}"
                  for (backend, cause), names in sorted(bad.items(), key=lambda kv: (rank[kv[0][0]], -len(kv[1]), kv[0][1]))]
    if none:
        lines += ["", (f"No verdict on {newest} (backend, verdict, why: architectures; each cause's meaning and remedy "
                       "are in the legend below):"), ""]
        lines += [f"- {backend}, {SYMBOL.get(verdict, '')} {verdict}, {why.replace('_', ' ')} ({len(names)}): {name_md(', '.join(names))}"
                  for (backend, verdict, why), names in sorted(none.items(), key=lambda kv: (rank[kv[0][0]], -len(kv[1]), kv[0][1:]))]
    if noted:
        lines += ["", f"Passing on {newest}, with a finding beside the verdict (backend, finding: architectures):", ""]
        # a finding on every pass of a backend is the backend's (the flash path's batch_rows), said once
        lines += [f"- {backend}, {finding.replace('_', ' ')} ("
                  + (f"every one of the {len(names)} passing)" if len(names) == passing[backend] > 1 else
                     f"{len(names)}): {name_md(', '.join(names))}")
                  for (backend, finding), names in sorted(noted.items())]
    return [*lines, ""]


def legend(support: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, meaning, remedy) of every verdict mark and every cause or finding code the atlas uses, from the
    results schema's marks and the cause registry (:mod:`pytest_packcheck.checks.causes`): atlas.md's and atlas.html's
    legend, never typed by hand."""
    from ..checks.causes import CAUSE_RECORDS

    words = {"pass": "packs as padding does: every correctness check within its tolerance",
             "fail": "does not: a correctness check measured a difference above its tolerance (the cause says which)",
             "fallback": "the requested backend did not run (another one did)",
             "unsupported": "the release or backend refuses this combination (its own error)",
             "skipped": "not checked here (something this environment lacks)",
             "error": "no verdict: the model did not build or run (the cause says whose fault)",
             "timeout": "no verdict: the cell did not finish in time", "oom": "no verdict: out of memory"}
    used = sorted({c for row in support["cells"].values() for by in row.values() for e in by.values()
                   for c in [*(e.get("causes") or []), *(e.get("findings") or []), *((e.get("hazards") or {}).values())]})
    out = [(f"{SYMBOL.get(v, v)} {v}", words[v], "") for v in words
           if any(e.get("verdict") == v for row in support["cells"].values() for by in row.values() for e in by.values())]
    for code in used:
        record = CAUSE_RECORDS.get(code)
        out.append((code.replace("_", " "), record.meaning if record else "", record.remedy if record else ""))
    return out


def render_markdown(support: dict[str, Any]) -> str:
    """atlas.md: coverage, per architecture one line per backend with its transitions, every transition with its
    number and cause, then the architectures that never pass and why."""
    order = [r["transformers"] for r in support["releases"]]
    lines = ["# packcheck atlas: padding-free packing per architecture, backend and transformers release", "",
             (f"Generated {support['generated']} by packcheck {support['packcheck_version']} (torch {support['torch']}, "
             f"CPU, float32, tiny random models from each release's own configs). Backends: "
             f"{', '.join(support['backends'])}; checks: {', '.join(support['checks'])} (hazards never decide a "
             "verdict). Machine-readable: `support.json` (schema: `SCHEMA.md`); "
             "`packcheck lookup MODEL_TYPE ATTN TRANSFORMERS_VERSION` answers from it."), "",
             *at_a_glance(support),
             "## Legend", "",
             "Every mark and cause label this atlas uses: what it means and what to do (from packcheck's cause registry).", "",
             "| label | meaning | remedy |", "|---|---|---|",
             *(f"| {name_md(label)} | {name_md(meaning)} | {name_md(remedy) or '—'} |" for label, meaning, remedy in legend(support)),
             "",
             "## Coverage", "",
             f"Measured releases: {', '.join(order) or 'none'}.",
             f"Not measured yet: {', '.join(support['missing']) or 'none'}" + (" (resume: `packcheck atlas`)." if support["missing"] else "."),
             "", "| release | architectures | cells | wall s | CPU s | s per (arch, backend) |", "|---|---|---|---|---|---|"]
    resumed, seeded, overridden = [], [], []
    for r in support["releases"]:
        pairs = sum(1 for by in support["cells"].values() for b in by.values() if r["transformers"] in b)
        per = f"{r['wall_s'] / pairs:.2f}" if r.get("wall_s") and pairs and not r.get("resumed") else "—"
        mark = " ¹" if r.get("resumed") else ""
        if r.get("overrides"):  # its environment needed a documented uv override (audit/env_overrides.toml)
            mark += " ³"
            overridden.append(f"{r['transformers']}: " + "; ".join(f"`{o['requirement']}` ({o['reason']})" for o in r["overrides"]))
        if str(r.get("source", "")).startswith("seeded from"):  # another run's results: its checks, no atlas timing
            mark = " ²"
            seeded.append(f"{r['transformers']} ({r['source'].removeprefix('seeded from ')})")
        if r.get("resumed"):
            count = r.get("resumed_cells")
            resumed.append(f"{r['transformers']}" + (f" ({count} of {r['cells']} cells)" if count is not None else ""))
        lines.append(f"| {r['transformers']} | {r['architectures']} | {r['cells']} | {r.get('wall_s') or '—'}{mark} | "
                     f"{r.get('cpu_s') or '—'}{mark} | {per} |")
    if resumed:
        lines += ["", ("¹ Resumed from an earlier, interrupted run's journal: wall and CPU cover only the last part, "
                       f"so no cost per (arch, backend) is given: {', '.join(resumed)}.")]
    if overridden:
        lines += ["", ("³ Measured in an environment with a uv override from `audit/env_overrides.toml`, used only where "
                       "the package index could not meet the release's own requirements, or where they resolve to a set "
                       "the release does not run with (the reason says which): " + "; ".join(overridden) + ".")]
    if seeded:
        lines += ["", ("² Seeded (`packcheck atlas --seed`) from an existing run of every architecture, not run by the atlas: "
                       "its cells are that run's checks (more than the atlas runs), and it recorded no atlas timing: "
                       f"{'; '.join(seeded)}.")]
    lines += ["", "## Per architecture", "",
              ("One line per backend: the verdict (and causes) over the measured releases, each run of equal verdict "
              "with its first and last release."), ""]
    for name in sorted(support["cells"]):
        parts = []
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row:
                continue
            runs = _runs(row, order)
            text = "; ".join(f"{label} {a}" + (f" .. {b}" if b != a else "") for a, b, label in runs)
            parts.append(f"- **{name}** / {backend}: {text}")
        lines += parts
    lines += config_sections(support)
    lines += ["", "## Transitions", "",
              ("Every change of verdict or cause between two adjacent measured releases, with the number that backs "
              "each side; `bisected` names the exact patch where one was run."), "",
              "| architecture | backend | last before | first after | before | after | bisected |", "|---|---|---|---|---|---|---|"]
    for t in support["transitions"]:
        b = t.get("bisected")
        bis = f"{b['outcome']}: first {b.get('first')}, last {b.get('last')}" if b else "not yet"
        lines.append(f"| {name_md(t['model_type'])} | {t['backend']} | {t['last_before']} | {t['first_after']} | "
                     f"{transition_side(t['before'])} | {transition_side(t['after'])} | {bis} |")
    if not support["transitions"]:
        lines.append("| — | — | — | — | — | — | fewer than two measured releases share an architecture |")
    lines += ["", "## Never pass", "", ("Architecture / backend pairs with no passing measured release, and why "
              "(the causes and the message of the check that decided the newest release)."), ""]
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row or any(e["verdict"] == "pass" for e in row.values()):
                continue
            newest = max(row, key=version_key)
            e = row[newest]
            why = e.get("message") or ", ".join(e.get("causes", [])) or e["verdict"]
            lines.append(f"- **{name}** / {backend} ({newest}): {_label(e)}: {name_md(why)}")
    lines += ["", "## Where packcheck itself stopped", "",
              ("Entries whose cause is packcheck's own (the shrink it applies, a crash only its shrunk model shows, an "
              "inconclusive probe): no verdict about the library. The issue's bar is none on any release."), ""]
    own: dict[tuple[str, str], list[str]] = {}
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            for version, e in support["cells"][name].get(backend, {}).items():
                for cause in e.get("causes", []):
                    if cause in OWN_CAUSES and e["verdict"] not in ("pass", "fail"):
                        own.setdefault((version, cause), []).append(f"{name}/{backend}")
    for (version, cause), items in sorted(own.items(), key=lambda kv: (version_key(kv[0][0]), kv[0][1])):
        archs = sorted({i.split("/")[0] for i in items})
        lines.append(f"- {version} {cause.replace('_', ' ')}: {len(items)} (architecture, backend) of {len(archs)} "
                     f"architectures: {', '.join(archs)}")
    if not own:
        lines.append("- none")
    if support.get("trl"):  # the TRL axis (packcheck atlas --trl), carried from trl.json
        from .trl_render import render_trl_markdown

        lines += render_trl_markdown(support["trl"])
    from .kinds_render import BLOCKS, render_kind_markdown

    for name in BLOCKS:  # the encoder and multimodal blocks (atlas/kinds.py), carried in support.json
        if isinstance(support.get(name), dict):
            lines += render_kind_markdown(support[name])
    return "\n".join(lines) + "\n"


def config_sections(support: dict[str, Any]) -> list[str]:
    """atlas.md's two config sections: the architectures answered on a config of packcheck's config-fix table
    (``model/config_fixes.py``: where transformers' default config does not run, the entries' ``config``), with the
    releases and the config each rests on; then the entries still ``library_config`` (the config itself does not run
    there), per architecture with their releases and the newest message."""
    lines = ["", "## Built from another config", "",
             ("Where transformers' own default config for an architecture does not run on a release, the atlas builds it "
              "from packcheck's config-fix table (a checkpoint's config.json, the causal-LM class's own text config, or "
              "named values), shrunk the same way; `lookup` names it in its answer."), ""]
    fixed: dict[tuple[str, str], list[str]] = {}
    left: dict[str, dict[str, Any]] = {}
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            for version, e in support["cells"][name].get(backend, {}).items():
                if e.get("config"):
                    fixed.setdefault((name, e["config"]), []).append(version)
                if "library_config" in e.get("causes", []):
                    slot = left.setdefault(name, {"versions": set(), "entries": 0, "newest": version, "message": ""})
                    slot["versions"].add(version)
                    slot["entries"] += 1
                    if version_key(version) >= version_key(slot["newest"]):
                        slot["newest"], slot["message"] = version, e.get("message") or ""
    for (name, config), versions in sorted(fixed.items()):
        releases = sorted(set(versions), key=version_key)
        lines.append(f"- **{name}** ({len(releases)} releases, {releases[0]} .. {releases[-1]}): {name_md(config)}")
    if not fixed:
        lines.append("- none")
    lines += ["", "## Still library_config", "",
              (f"{sum(v['entries'] for v in left.values())} entries of {len(left)} architectures where the config the atlas "
               "builds does not run in transformers itself (the newest message says why)."), ""]
    for name, slot in sorted(left.items()):
        releases = sorted(slot["versions"], key=version_key)
        lines.append(f"- **{name}**: {slot['entries']} entries, {len(releases)} releases ({releases[0]} .. {releases[-1]}); "
                     f"{slot['newest']}: {name_md(slot['message'])}")
    if not left:
        lines.append("- none")
    return lines


#: Causes that are packcheck's own rather than the library's (the Markdown's "Where packcheck itself stopped").
OWN_CAUSES = ("shrink_limit", "shrunk_crash", "probe_inconclusive")


def name_md(text: str) -> str:
    from ..report.text import escape_md

    return escape_md(text)


def render_html(support: dict[str, Any]) -> str:
    """atlas.html: one self-contained page (no external asset), rows architecture x backend, columns releases,
    cells coloured by verdict; clicking a cell shows its number, cause, message and the command to reproduce.
    Each cell carries only its symbol and an index into one deduplicated JSON block (the page stays small at
    40 releases x 200 architectures x 3 backends)."""
    # newest first: the release a user is on is most likely a recent one (issue 41: the page opened on 4.44 .. 5.9)
    order = sorted((r["transformers"] for r in support["releases"]), key=version_key, reverse=True)
    classes = {"pass": "p", "fail": "f", "fallback": "b", "unsupported": "u", "skipped": "s", "error": "e", "timeout": "e", "oom": "e"}
    entries: list[list[Any]] = []
    index: dict[str, int] = {}
    head = "".join(f"<th>{html.escape(v)}</th>" for v in order)
    rows = []
    for name in sorted(support["cells"]):
        for backend in support["backends"]:
            row = support["cells"][name].get(backend)
            if not row:
                continue
            tds = []
            for v in order:
                e = row.get(v)
                if e is None:
                    tds.append("<td></td>")
                    continue
                # the message stays in support.json and atlas.md: the page carries verdict, causes and number only
                item = [e["verdict"], e.get("causes", []), e.get("check"), e.get("number"), "", e.get("hazards", {})]
                key = json.dumps(item, sort_keys=True)
                if key not in index:
                    index[key] = len(entries)
                    entries.append(item)
                tds.append(f"<td class={classes.get(e['verdict'], 'e')} data-i={index[key]}>{SYMBOL.get(e['verdict'], '?')}</td>")
            rows.append(f"<tr data-a=\"{html.escape(name)}\" data-b={backend}><th>{html.escape(name)}</th><th>{backend}</th>{''.join(tds)}</tr>")
    data = json.dumps({"releases": order, "entries": entries, "checks": list(support["checks"]),
                       "backends": list(support["backends"])}, separators=(",", ":")).replace("</", "<\\/")
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>packcheck atlas</title><style>"
            "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 5px;text-align:center}td[data-i]{cursor:pointer}.p{background:#8fd18f}.f{background:#f08080}"
            ".b{background:#f5c26b}.u{background:#c8c8c8}.s{background:#eee}.e{background:#b48ae6}"
            "#d{position:sticky;top:0;background:#ffffe0;border:1px solid #aa8;padding:6px;white-space:pre-wrap;"
            "font-family:monospace;min-height:2em}</style></head><body>"
            f"<h1>packcheck atlas</h1><p>Generated {html.escape(support['generated'])} by packcheck "
            f"{html.escape(str(support['packcheck_version']))}, torch {html.escape(str(support['torch']))}, CPU float32. "
            f"Not measured yet: {html.escape(', '.join(support['missing']) or 'none')}. Click a cell.</p>"
            "<details><summary>Legend: every mark and cause label, its meaning and remedy</summary><table>"
            + "".join(f"<tr><th>{html.escape(label)}</th><td style=\"text-align:left\">{html.escape(meaning)}</td>"
                      f"<td style=\"text-align:left\">{html.escape(remedy)}</td></tr>" for label, meaning, remedy in legend(support))
            + "</table></details>"
            "<p>Filter: <input id=\"q\" placeholder=\"architecture, e.g. qwen2\"> <select id=\"bk\"><option value=\"\">every backend</option>"
            + "".join(f"<option>{html.escape(b)}</option>" for b in support["backends"]) + "</select> "
            "Newest release first.</p>"
            "<div id=\"d\">number, cause and reproduce command of the clicked cell</div>"
            f"<table id=\"m\"><tr><th>architecture</th><th>backend</th>{head}</tr>{''.join(rows)}</table>"
            f"<script id=\"data\" type=\"application/json\">{data}</script>"
            "<script>var D=JSON.parse(document.getElementById('data').textContent);"
            "function F(){var q=document.getElementById('q').value.toLowerCase(),b=document.getElementById('bk').value;"
            "document.querySelectorAll('#m tr[data-a]').forEach(function(r){r.style.display=(r.dataset.a.toLowerCase()"
            ".indexOf(q)>=0&&(!b||r.dataset.b==b))?'':'none';});}"
            "document.getElementById('q').oninput=F;document.getElementById('bk').onchange=F;"
            "document.getElementById('m').onclick=function(ev){var td=ev.target.closest('td[data-i]');if(!td)return;"
            "var tr=td.parentNode,e=D.entries[+td.dataset.i],v=D.releases[td.cellIndex-2],a=tr.dataset.a,b=tr.dataset.b;"
            "var t=a+' / '+b+' @ transformers '+v+': '+e[0]+(e[1].length?' ('+e[1].join(', ')+')':'');"
            "if(e[2])t+='\\n'+e[2]+(e[3]===null?'':' '+e[3]);if(e[4])t+='\\n'+e[4];"
            "if(Object.keys(e[5]).length)t+='\\nhazards: '+JSON.stringify(e[5]);"
            "t+='\\nreproduce: packcheck audit --models arch:'+a+' --versions transformers=='+v+' --packcheck-attn='+b+"
            "' --packcheck-checks='+D.checks.join(',');document.getElementById('d').textContent=t;};</script></body></html>\n")


def write_outputs(support: dict[str, Any], out: Path) -> list[Path]:
    """Write support.json, atlas.md and atlas.html into ``out`` as one set (:func:`results.io.write_set`: every text
    rendered first, then renamed into place, support.json last; a kill never leaves a new support.json beside an old
    atlas.md, issue 42)."""
    from ..analysis.library_axes import attach_axes
    from ..results.io import write_set

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the library axes (rl_peers.json, stack.json beside it) ride along on every render, whichever writer renders
    support = attach_axes(support, out)
    paths = [out / "support.json", out / "atlas.md", out / "atlas.html"]
    write_set([(paths[1], render_markdown(support)), (paths[2], render_html(support)),
               (paths[0], json.dumps(support, indent=None, separators=(",", ":"), sort_keys=True) + "\n")], flag="-o/--output-dir")
    return paths
