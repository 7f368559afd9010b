"""The self-contained HTML report (``packcheck-matrix.html``): the matrix coloured by verdict, filters by model,
backend, version and verdict, and each cell's checks, numbers, cause and remedy on click. No network assets:
the data is embedded as JSON and the page's script and style are inline. Pure: a :class:`model.Report` in, text
out.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from typing import Any

from .model import Report, banners, env_header, environment_line
from .numbers import key_number
from .sections import models_are, trainer_note
from .text import cut
from .verdicts import (
    LEGEND,
    ROLE_LEGEND,
    ROLE_MARKS,
    VERDICT_SYMBOLS,
    VERDICT_WORDS,
    VERDICTS,
    cause_label,
    check_mark,
    checked_only,
    headline_text,
    numerics_only,
    role_of,
    verdict_key,
)

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
td.cell{cursor:pointer;white-space:nowrap}
td.cell:hover{outline:2px solid #333}
.pass{background:#d9f2d9}.fail{background:#f8d0d0}.fallback{background:#fde9c4}.unsupported{background:#e5e5e5}
.skipped,.not_run{background:#f4f4f4;color:#666}.error,.timeout,.oom{background:#f3c6f0}
.hazard{background:#fff1c2}.finding{background:#dce9f8}
.hazard-unmeasured,.hazard-error,.hazard-timeout,.hazard-oom,.finding-error,.finding-timeout,.finding-oom{background:#eee;color:#555}
#filters label{margin-right:1em}
#details{position:fixed;top:1em;right:1em;width:min(48em,48vw);max-height:calc(100vh - 2em);overflow:auto;
  padding:.5em 1em;border:2px solid #333;background:#fafafa;box-shadow:0 4px 16px rgba(0,0,0,.25);z-index:10}
#details-close{float:right;cursor:pointer}
.legend span,.chart span{display:inline-block;margin:0 .4em .3em 0;padding:1px 6px;border:1px solid #ccc}
.chart{margin:.3em 0 .6em}
.hidden{display:none}
code{background:#eee;padding:0 3px}
"""

_SCRIPT = """
const DATA = JSON.parse(document.getElementById('packcheck-data').textContent);
const $ = (id) => document.getElementById(id);
function esc(s){return String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));}
function fill(id, values, names){const sel=$(id); for(const v of values){const o=document.createElement('option'); o.value=v; o.textContent=(names && names[v]) || v; sel.appendChild(o);}}
fill('f-model', DATA.models); fill('f-backend', DATA.backends); fill('f-version', DATA.columns_are_versions ? DATA.columns : DATA.versions);
fill('f-verdict', DATA.verdicts, DATA.verdict_names);
function render(){
  const fm=$('f-model').value, fb=$('f-backend').value, fv=$('f-version').value, fs=$('f-verdict').value;
  const cols = DATA.columns.filter(c => !DATA.columns_are_versions || !fv || c === fv)
                           .filter(c => DATA.columns_are_versions || !fb || c === fb);
  let out = '<table id="matrix"><thead><tr>' + DATA.row_headers.map(h => '<th>'+esc(h)+'</th>').join('')
          + cols.map(c => '<th>'+esc(c)+'</th>').join('') + '</tr></thead><tbody>';
  for (const row of DATA.rows){
    if (fm && row.model !== fm) continue;
    if (fb && row.backend && row.backend !== fb) continue;
    const shown = cols.map(c => row.cells[c]).filter(Boolean);
    if (fs && !shown.some(x => x.status === fs)) continue;
    out += '<tr>' + row.head.map(h => '<td>'+esc(h)+'</td>').join('');
    for (const c of cols){
      const x = row.cells[c];
      if (!x){ out += '<td title="no cell of this model and column in the results">— not measured</td>'; continue; }
      const dim = fs && x.status !== fs ? ' style="opacity:.35"' : '';
      out += '<td class="cell '+esc(x.status)+'" data-key="'+esc(x.key)+'"'+dim+'>'+esc(x.text)+'</td>';
    }
    out += '</tr>';
  }
  $('matrix-wrap').innerHTML = out + '</tbody></table>';
  for (const td of document.querySelectorAll('td.cell')) td.addEventListener('click', () => show(td.dataset.key));
}
function show(key){
  const g = DATA.groups[key];
  let out = '<button id="details-close" type="button">close ✕</button><h3>'+esc(g.title)+'</h3><p>'+esc(g.verdict)
          + '</p><table><tr><th>check</th><th>role</th><th>verdict</th><th>number</th><th>cause</th><th>remedy</th><th>message</th></tr>';
  for (const c of g.checks){
    out += '<tr class="'+esc(c.css)+'"><td><code>'+esc(c.check)+'</code></td><td>'+esc(c.role)+'</td><td>'+esc(c.mark+' '+c.label)+'</td><td>'+esc(c.number)
         + '</td><td>'+esc(c.cause)+'</td><td>'+esc(c.remedy)+'</td><td>'+esc(c.message)+'</td></tr>';
  }
  $('details').innerHTML = out + '</table>';
  $('details').classList.remove('hidden');
  $('details-close').addEventListener('click', () => $('details').classList.add('hidden'));
}
for (const id of ['f-model','f-backend','f-version','f-verdict']) $(id).addEventListener('change', render);
render();
"""


def page_data(rep: Report) -> dict[str, Any]:
    """The page's data: matrix rows with each cell's headline text and status, the groups' checks (verdict, key
    number, cause, remedy, message) and the filter values. Without version environments the columns are the
    backends; with them, one row per model and backend and the versions as columns, so a regression reads as a
    colour change along a row."""
    cells, labels = rep.cells, rep.labels
    lay = rep.layout  # the Markdown's layout: version columns in version order there and here
    backends, envs, versioned, models, dtypes, by_group = lay.backends, lay.envs, lay.versioned, list(lay.models), lay.dtypes, lay.by_group
    marks = rep.marks
    groups: dict[str, Any] = {}
    partial = bool(rep.coverage)  # the run left correctness checks out: a ✅ names the ones it rests on

    def entry(label: str, b: str, dtype: str, e: str | None) -> dict[str, Any] | None:
        group = by_group.get((label, b, dtype, e))
        if not group:
            return None
        key = f"{label}|{b}|{dtype}|{e or ''}"
        h = rep.headlines[(label, b, dtype, e)]
        text = headline_text(h, marks.get((label, e, dtype, b)))
        groups[key] = {
            "title": f"{label} / {labels.get(b, b)} / {dtype}" + (f" / {env_header(e, cells)}" if e else ""),
            "verdict": text,
            "checks": [{"check": c["check"], "role": role_of(c), "status": c["status"], "number": key_number(c),
                        "mark": check_mark(c)[0], "label": check_mark(c)[1], "css": check_mark(c)[2],
                        "cause": (c.get("diagnosis") or {}).get("cause") or "", "remedy": (c.get("diagnosis") or {}).get("remedy") or "",
                        "message": c["message"]} for c in group],
        }
        verdict = verdict_key(h)  # "not run (interrupted)" apart from "not checked"
        word = VERDICT_WORDS[verdict]
        # a text label beside every mark: "✅ pass", "❌ fail: leak" (no emoji font: the word still reads); a text
        # that opens with it ("⏭️ not run: 2 of 7 checks (interrupted)") says it once
        shown = text if text.split(" ", 1)[-1].startswith(word.split(" (", 1)[0]) else text.replace(" ", f" {word}: ", 1) if " " in text else f"{text} {word}"
        only = checked_only(cells, h, label, dtype, b, partial)  # as the CSV note and the answer's per-model line
        shown += f" ({only})" if only else ""
        groups[key]["verdict"] = shown
        return {"key": key, "status": verdict, "text": shown}

    rows = []
    for dtype in dtypes:
        for label in models:
            if versioned:
                for b in backends:
                    row_cells = {env_header(e, cells): x for e in envs if (x := entry(label, b, dtype, e))}
                    if row_cells:
                        rows.append({"model": label, "backend": b, "head": [label, labels.get(b, b), dtype], "cells": row_cells})
            else:
                row_cells = {labels.get(b, b): x for b in backends if (x := entry(label, b, dtype, None))}
                if row_cells:
                    rows.append({"model": label, "backend": None, "head": [label, dtype, *_bench_head(rep, label)], "cells": row_cells})
    # backends that ran nothing here (every group not checked: e.g. a CUDA kernel on a CPU machine): one line
    # above the matrix instead of a column of "not checked" cells
    bench = rep.doc.get("bench")
    collapsed = {} if versioned else {rep.label(b): why for b, why in rep.not_run.items()}
    if collapsed:
        for row in rows:
            row["cells"] = {k: v for k, v in row["cells"].items() if k not in collapsed}
    columns = [env_header(e, cells) for e in envs] if versioned else [labels.get(b, b) for b in backends if labels.get(b, b) not in collapsed]
    return {
        "collapsed": collapsed,
        "models": models, "backends": [x for x in columns] if not versioned else backends,
        "versions": [env_header(e, cells) for e in envs], "columns": columns, "columns_are_versions": versioned,
        "row_headers": ["model", "backend", "dtype"] if versioned else ["model", "dtype", *(["speedup / memory"] if bench else [])],
        "verdicts": sorted({g["status"] for r in rows for g in r["cells"].values()}), "rows": rows, "groups": groups,
        # the filter's words are the cells' words ("✅ pass", "⏭️ not checked"), not the status codes
        "verdict_names": {s: f"{VERDICT_SYMBOLS[s]} {VERDICT_WORDS[s]}" for s in VERDICTS},
    }


def _bench_head(rep: Report, label: str) -> list[str]:
    """The Markdown matrix's "speedup / memory" entry of a model (:func:`.bench.bench_cell`), [] without bench."""
    bench = rep.doc.get("bench")
    if not bench:
        return []
    from .bench import bench_cell

    return [bench_cell([r for r in bench["results"] if r["model"]["label"] == label], rep.cells)]


def _markdown_html(lines: list[str]) -> str:
    """Markdown lines of a report section (``## heading``, a GitHub table, ``- `` items, sentences) as HTML, so a
    section the Markdown renders (the payoff of --bench: :func:`.bench.bench_section`) is shown from the
    same lines, not rewritten."""
    import re

    def unescape(text: str) -> str:
        return _inline_md(re.sub(r"\\([|<>\[\]`*_\\])", r"\1", text))

    out: list[str] = []
    table: list[list[str]] = []
    items: list[str] = []

    def flush() -> None:
        if table:
            head, body = table[0], [r for r in table[1:] if not all(set(c.strip()) <= set(":-") for c in r)]
            out.append("<table><tr>" + "".join(f"<th>{unescape(c.strip())}</th>" for c in head) + "</tr>" + "".join(
                "<tr>" + "".join(f"<td>{unescape(c.strip())}</td>" for c in r) + "</tr>" for r in body) + "</table>")
            table.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{unescape(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in "\n".join(lines).splitlines():  # a table comes as one multi-line item
        if line.startswith("|"):
            table.append(re.split(r"(?<!\\)\|", line.strip())[1:-1])
            continue
        if line.startswith("- "):
            items.append(line[2:])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h2>{unescape(line[3:])}</h2>")
        elif line.strip():
            out.append(f"<p>{unescape(line)}</p>")
    flush()
    return "\n".join(out)


def _inline_md(text: str) -> str:
    """A Markdown sentence of the report (``**bold**``, `` `code` ``, ``\\_`` escapes) as escaped HTML."""
    import re

    out = html.escape(text.replace("\\_", "_"))
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def _summary_html(rep: Report, data: dict[str, Any]) -> str:
    """The page's static head: the legend (every mark with its words), the do-not-pack list (model, backends,
    cause, remedy), the stack hazards and findings that showed, the gate result when the document holds one, and
    the backends that could not run on this machine (collapsed out of the matrix)."""
    e = html.escape
    doc, labels, lay = rep.doc, rep.labels, rep.layout
    # what was measured, first and in the Markdown's words: what the models are, and the trainers when none ran
    scope = [models_are(lay.models, doc.get("settings") or {}), *(t for t in trainer_note(doc.get("cells") or []) if t),
             rep.coverage]  # what every ✅ covers, said once as the Markdown says it ("" for a full run)
    out = [f'<p class="scope">{_inline_md(t)}</p>' for t in scope if t]
    out.append('<h2>Legend</h2><p class="legend">')
    out += [f'<span class="{s}">{VERDICT_SYMBOLS[s]} {e(VERDICT_WORDS[s])}</span> {e(LEGEND[s].split(": ", 1)[-1])}<br>'
            for s in reversed(VERDICTS)]
    out += [f'<span class="{r}">{sym} {e(label)}</span> {e(ROLE_LEGEND[r])}<br>' for r, (sym, label) in ROLE_MARKS.items()]
    out.append("</p>")
    bad: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    for x in rep.do_not_pack:
        if x.judged and not numerics_only(rep.headlines[(x.model, x.backend, x.dtype, x.env)]):
            where = rep.label(x.backend) + (f" @ {x.env}" if x.env else "") + (f" ({x.dtype})" if len(lay.dtypes) > 1 else "")
            bad[x.model].append((where, x.causes, f"{x.first['check']} {key_number(x.first)}".strip(), x.remedy))
    out.append('<h2 id="do-not-pack">Do not pack</h2>')
    if bad:
        out.append("<table><tr><th>model</th><th>backends</th><th>cause</th><th>number</th><th>remedy</th></tr>")
        for model, rows in bad.items():
            out.append(f'<tr class="fail"><td>{e(model)}</td><td>{e(", ".join(r[0] for r in rows))}</td>'
                       f'<td>{e("; ".join(dict.fromkeys(r[1] for r in rows)))}</td><td>{e(rows[0][2])}</td>'
                       f'<td>{e("; ".join(dict.fromkeys(r[3] for r in rows if r[3])))}</td></tr>')
        out.append("</table>")
    else:
        out.append("<p>None: no model failed a correctness check here for a packing cause.</p>")
    numerics = [x for x in rep.do_not_pack if x.judged and numerics_only(rep.headlines[(x.model, x.backend, x.dtype, x.env)])]
    if numerics:
        out.append("<p>Within numerics, failed on the tolerance only (boundaries kept: not a packing fault): " + "; ".join(
            f"<b>{e(x.model)}</b> on {e(rep.label(x.backend))} ({e(x.first['check'])} {e(key_number(x.first))}: {e(x.remedy)})"
            for x in numerics) + "</p>")
    shown = [(k, r) for k, r in rep.hazards.items() if r["shown"]]
    out.append('<h2 id="hazards">Stack hazards (never a model failure)</h2>')
    out.append("<ul>" + "".join(
        f'<li><span class="hazard">{ROLE_MARKS["hazard"][0]} {e(cause_label(k[0]))}</span> on {e(labels.get(k[3], k[3]))} / {e(k[2])}'
        f'{e(" @ " + k[1]) if k[1] else ""}: {len(r["shown"])}/{len(r["measured"])} models</li>' for k, r in sorted(
            shown, key=lambda kv: tuple(str(x) for x in kv[0]))) + "</ul>" if shown else "<p>none shown.</p>")
    found = {k: set(models) for k, models in rep.findings.items()}
    out.append('<h2 id="findings">Stack findings (facts of the library stack)</h2>')
    out.append("<ul>" + "".join(f'<li><span class="finding">{ROLE_MARKS["finding"][0]} {e(check)}</span> {e(cut(text, 220))} '
                                f'({len(models)} models)</li>' for (check, text), models in sorted(found.items())) + "</ul>"
               if found else "<p>none.</p>")
    gate = rep.gate
    if gate is not None:
        cells = gate.get("cells") or []
        out.append('<h2 id="gate">Gate</h2>' + f'<p class="{"fail" if gate.get("regressions") else "pass"}">'
                   f'{"❌" if gate.get("regressions") else "✅"} {e(str(gate.get("regressions", 0)))} regression(s), '
                   f'{e(str(gate.get("changed", 0)))} changed cell(s): {e(str(gate.get("candidate", "")))} (candidate) against '
                   f'{e(str(gate.get("baseline", "")))} (baseline){": " + e(", ".join(map(str, cells))) if cells else ""}</p>')
    if doc.get("bench"):  # the Markdown's payoff section, from the same lines
        from .bench import bench_section

        out.append('<div id="payoff">' + _markdown_html(bench_section(doc["bench"], doc.get("cells") or [])) + "</div>")
    if lay.versioned:
        out.append(_release_chart(rep))
    if data.get("collapsed"):
        out.append('<p id="collapsed">Not run on this machine (columns left out): ' + "; ".join(
            f"<b>{e(b)}</b>: {e(why)}" for b, why in data["collapsed"].items()) + "</p>")
    return "\n".join(out)


def _release_chart(rep: Report) -> str:
    """For version audits, per model a small chart: one row per backend, one box per release (in version
    order) coloured by the cell's verdict, with its word and the release in the box, so a regression reads as a
    change of colour along the row."""
    e = html.escape
    doc, lay, labels = rep.doc, rep.layout, rep.labels
    out = ['<h2 id="releases">Verdict per release</h2>']
    for model in lay.models:
        rows = []
        for dtype in lay.dtypes:
            for b in lay.backends:
                boxes = []
                for env in lay.envs:
                    h = rep.headlines.get((model, b, dtype, env))
                    if not h:
                        continue
                    status = verdict_key(h)
                    word = VERDICT_WORDS[status]
                    boxes.append(f'<span class="{e(status)}" title="{e(word)}">{e(env_header(env, doc["cells"]))}: {e(word)}</span>')
                if boxes:
                    rows.append(f"<div>{e(labels.get(b, b))}{' / ' + e(dtype) if len(lay.dtypes) > 1 else ''}: {' → '.join(boxes)}</div>")
        if rows:
            out.append(f'<div class="chart"><b>{e(model)}</b>{"".join(rows)}</div>')
    return "\n".join(out)


def render(rep: Report) -> str:
    """The whole page as one string (UTF-8). The embedded JSON escapes ``<`` so no string in it can close the
    script element."""
    doc = rep.doc
    env = doc.get("environment", {})
    data_ = page_data(rep)
    data = json.dumps(data_, sort_keys=True).replace("<", "\\u003c")
    summary = _summary_html(rep, data_)
    title = "packcheck support matrix" + (f" — {doc['settings']['audit']}" if doc.get("settings", {}).get("audit") else "")
    versions = f"{environment_line(env)}, device {env.get('device')}"
    incomplete = "".join(f'<p id="{key}" style="background:#fde9c4;padding:.5em"><b>{html.escape(text)}.</b></p>'
                         for key, text in banners(doc))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(versions)}. Reproduce: <code>{html.escape(doc.get('command', ''))}</code></p>
{incomplete}
<p>A cell's verdict comes from its correctness checks; hazards and stack findings have their own marks and are
listed once per stack below. Click a cell for every check's number, cause and remedy (the panel opens over the page,
at the top right).</p>
{summary}
<h2>Matrix</h2>
<div id="filters">
<label>model <select id="f-model"><option value="">all</option></select></label>
<label>backend <select id="f-backend"><option value="">all</option></select></label>
<label>version <select id="f-version"><option value="">all</option></select></label>
<label>verdict <select id="f-verdict"><option value="">all</option></select></label>
</div>
<div id="matrix-wrap"></div>
<div id="details" class="hidden"></div>
<script type="application/json" id="packcheck-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
