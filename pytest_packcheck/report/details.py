"""``packcheck-details.md``: per model, in a collapsible block, every check's verdict and key number per backend,
then each check that did not pass with its message, cause and remedy. Pure: a :class:`model.Report` in, text
out."""

from __future__ import annotations

from ..checks.registry import SPECS
from .model import Report, banners, env_header
from .numbers import key_number
from .text import cut, escape_md
from .verdicts import ROLE_MARKS, check_mark, model_mark, role_of, unread_overrides


def render(rep: Report) -> str:
    """The details page of ``rep`` (an incomplete run says so under the title)."""
    lines = _details(rep)
    lines[1:1] = [x for _, text in banners(rep.doc) for x in ("", f"**⚠️ {escape_md(text)}.**")]
    return "\n".join(lines)


def _details(rep: Report) -> list[str]:
    from .text import github_table

    lay, labels, cells = rep.layout, rep.labels, rep.cells
    models, by_group, backends, dtypes, envs, checks = list(lay.models), lay.by_group, lay.backends, lay.dtypes, lay.envs, lay.checks

    lines = ["# packcheck details", "", "Every check's verdict and the number it rests on, per model (click to open).", "",
             ("Marks follow the checks' roles: ✅ pass and ❌ fail are correctness checks (they decide the model's mark); "
              f"{ROLE_MARKS['hazard'][0]} {ROLE_MARKS['hazard'][1]} is a hazard probe that showed its hazard and "
              f"{ROLE_MARKS['finding'][0]} {ROLE_MARKS['finding'][1]} a failed contract item of the library stack: "
              "neither is a failure of the model."), ""]
    for label in models:
        blocks = []
        for dtype in dtypes:
            for e in envs:
                rows, notes = [], []
                for b in [None, *backends]:
                    group = {c["check"]: c for c in by_group.get((label, b, dtype, e), [])}
                    if not group or all(c["status"] == "skipped" for c in group.values()):
                        continue  # listed under "Not checked" / "Not run (interrupted)"
                    row = [labels.get(b, b) if b else "(model level)"]
                    for chk in checks:
                        c = group.get(chk)
                        if c:
                            sym, word, _ = check_mark(c)
                            row.append(f"{sym} {word if word not in ('pass', 'fail') or role_of(c) != 'correctness' else ''} "
                                       f"{key_number(c)}".replace("  ", " ").strip())
                        else:
                            row.append("")
                        if c and c["status"] not in ("pass", "skipped"):
                            d = c.get("diagnosis") or {}
                            # the dash outside escape_md, which strips the text it is given (trial 19, 133: "(none)— cause")
                            said = f"cause: {d.get('cause')}; remedy: {d.get('remedy')}"
                            cause = f" — {escape_md(said)}" if d.get("cause") and d.get("remedy") else ""
                            notes.append(f"- {labels.get(b, b) if b else 'model level'} / {chk} ({role_of(c)}), {check_mark(c)[1]}: "
                                         f"{escape_md(cut(c['message'], 400))}{cause}")
                    rows.append(row)
                if rows:
                    where = f", {env_header(e, cells)}" if e else ""
                    headers = ["backend"] + [f"{chk} ({SPECS[chk].role})" if chk in SPECS and SPECS[chk].role != "correctness" else chk
                                             for chk in checks]
                    blocks += [f"**{dtype}{escape_md(where)}**", "", github_table(rows, headers=headers), "", *notes, ""]
        # the user's override the config has no key for, beside the model's mark (trial 16, 227): its ✅ is of the default
        unread = unread_overrides(cells, label)
        if blocks:
            lines += ["<details>", f"<summary>{model_mark(label, by_group)} {escape_md(label)}</summary>", "",
                      *([f"note: {escape_md('; '.join(unread))}.", ""] if unread else []), *blocks,
                      "</details>", ""]
    return lines

