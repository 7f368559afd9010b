"""The self-contained HTML report (``packcheck-matrix.html``): the matrix coloured by verdict, filters by model,
backend, version and verdict, and each cell's checks, numbers, cause and remedy on click. No network assets:
the data is embedded as JSON and the page's script and style are inline. Pure: results document in, text out.
"""

from __future__ import annotations

import html
import json
from typing import Any

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
td.cell{cursor:pointer;white-space:nowrap}
td.cell:hover{outline:2px solid #333}
.pass{background:#d9f2d9}.fail{background:#f8d0d0}.fallback{background:#fde9c4}.unsupported{background:#e5e5e5}
.skipped{background:#f4f4f4;color:#666}.error,.timeout,.oom{background:#f3c6f0}
#filters label{margin-right:1em}
#details{margin-top:1em;padding:.5em 1em;border:1px solid #999;background:#fafafa}
.hidden{display:none}
code{background:#eee;padding:0 3px}
"""

_SCRIPT = """
const DATA = JSON.parse(document.getElementById('packcheck-data').textContent);
const $ = (id) => document.getElementById(id);
function esc(s){return String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));}
function fill(id, values){const sel=$(id); for(const v of values){const o=document.createElement('option'); o.value=v; o.textContent=v; sel.appendChild(o);}}
fill('f-model', DATA.models); fill('f-backend', DATA.backends); fill('f-version', DATA.columns_are_versions ? DATA.columns : DATA.versions);
fill('f-verdict', DATA.verdicts);
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
      if (!x){ out += '<td></td>'; continue; }
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
  let out = '<h3>'+esc(g.title)+'</h3><p>'+esc(g.verdict)+'</p><table><tr><th>check</th><th>role</th><th>verdict</th><th>number</th><th>cause</th><th>remedy</th><th>message</th></tr>';
  for (const c of g.checks){
    out += '<tr class="'+esc(c.status)+'"><td><code>'+esc(c.check)+'</code></td><td>'+esc(c.role)+'</td><td>'+esc(c.status)+'</td><td>'+esc(c.number)
         + '</td><td>'+esc(c.cause)+'</td><td>'+esc(c.remedy)+'</td><td>'+esc(c.message)+'</td></tr>';
  }
  $('details').innerHTML = out + '</table>';
  $('details').classList.remove('hidden');
}
for (const id of ['f-model','f-backend','f-version','f-verdict']) $(id).addEventListener('change', render);
render();
"""


def html_data(doc: dict[str, Any]) -> dict[str, Any]:
    """The page's data: matrix rows with each cell's headline text and status, the groups' checks (verdict, key
    number, cause, remedy, message) and the filter values. Without version environments the columns are the
    backends; with them, one row per model and backend and the versions as columns, so a regression reads as a
    colour change along a row."""
    from .backends import backend_labels
    from .report import _env_header, _headline_text, _key_number, _role, departures, headline, layout

    cells = doc["cells"]
    labels = backend_labels(doc.get("environment", {}))
    lay = layout(doc)  # the Markdown's layout: version columns in version order there and here
    backends, envs, versioned, models, dtypes, by_group = lay.backends, lay.envs, lay.versioned, list(lay.models), lay.dtypes, lay.by_group
    marks = departures(cells)
    groups: dict[str, Any] = {}

    def entry(label: str, b: str, dtype: str, e: str | None) -> dict[str, Any] | None:
        group = by_group.get((label, b, dtype, e))
        if not group:
            return None
        key = f"{label}|{b}|{dtype}|{e or ''}"
        h = headline(group)
        text = _headline_text(group, marks.get((label, e, dtype, b)))
        groups[key] = {
            "title": f"{label} / {labels.get(b, b)} / {dtype}" + (f" / {_env_header(e, cells)}" if e else ""),
            "verdict": text,
            "checks": [{"check": c["check"], "role": _role(c), "status": c["status"], "number": _key_number(c),
                        "cause": (c.get("diagnosis") or {}).get("cause") or "", "remedy": (c.get("diagnosis") or {}).get("remedy") or "",
                        "message": c["message"]} for c in group],
        }
        return {"key": key, "status": h["status"], "text": text}

    rows = []
    for dtype in dtypes:
        for label in models:
            if versioned:
                for b in backends:
                    row_cells = {_env_header(e, cells): x for e in envs if (x := entry(label, b, dtype, e))}
                    if row_cells:
                        rows.append({"model": label, "backend": b, "head": [label, labels.get(b, b), dtype], "cells": row_cells})
            else:
                row_cells = {labels.get(b, b): x for b in backends if (x := entry(label, b, dtype, None))}
                if row_cells:
                    rows.append({"model": label, "backend": None, "head": [label, dtype], "cells": row_cells})
    columns = [_env_header(e, cells) for e in envs] if versioned else [labels.get(b, b) for b in backends]
    return {
        "models": models, "backends": [labels.get(b, b) for b in backends] if not versioned else backends,
        "versions": [_env_header(e, cells) for e in envs], "columns": columns, "columns_are_versions": versioned,
        "row_headers": ["model", "backend", "dtype"] if versioned else ["model", "dtype"],
        "verdicts": sorted({g["status"] for r in rows for g in r["cells"].values()}), "rows": rows, "groups": groups,
    }


def render_html(doc: dict[str, Any]) -> str:
    """The whole page as one string (UTF-8). The embedded JSON escapes ``<`` so no string in it can close the
    script element."""
    from .report import _v

    env = doc.get("environment", {})
    data = json.dumps(html_data(doc), sort_keys=True).replace("<", "\\u003c")
    title = "packcheck support matrix" + (f" — {doc['settings']['audit']}" if doc.get("settings", {}).get("audit") else "")
    versions = (f"torch {_v(env, 'torch')}, transformers {_v(env, 'transformers')}, trl {_v(env, 'trl')}, "
                f"flash-attn {_v(env, 'flash_attn')}, device {env.get('device')}")
    inc = doc.get("incomplete")
    incomplete = (f'<p id="incomplete" style="background:#fde9c4;padding:.5em"><b>Incomplete: {html.escape(str(inc.get("reason")))} '
                  f'after {html.escape(str(inc.get("cells")))} cells; {html.escape(str(inc.get("resume", "")))}.</b></p>' if inc else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(versions)}. Reproduce: <code>{html.escape(doc.get('command', ''))}</code></p>
{incomplete}
<p>A cell's verdict comes from its correctness checks; hazards and stack findings are listed in the Markdown report
once per stack. Click a cell for every check's number, cause and remedy.</p>
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
