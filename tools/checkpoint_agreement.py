"""Issue 41 part 2's third point: the default audit's models built from transformers' default config (the committed
``reports/packcheck-matrix.json``) against the same architectures built from public checkpoints' config.json
(``../shared/hub-configs``, shrunk the same way), cell by cell: verdicts and causes must agree; a difference is a
finding with its numbers. Writes ``reports/atlas/checkpoint-configs.md``.

    nice -n 10 python -m pytest -p pytest_packcheck.plugin ... --packcheck-models=<config folders> \\
        --packcheck-report-dir=build/atlas-fix/ckpt     # the audit's backends and checks (see the report's command)
    python tools/checkpoint_agreement.py build/atlas-fix/ckpt/packcheck-matrix.json
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(path: str) -> int:
    from pytest_packcheck.report.numbers import key_metric
    from pytest_packcheck.results.schema import read_results
    ckpt = read_results(path)
    base = read_results(REPO / "reports" / "packcheck-matrix.json")
    default = {(c["model"]["label"], c["backend"], c["check"]): c for c in base["cells"] if c["dtype"] == "float32"}

    def num(c: dict) -> float | None:
        k = key_metric(c)
        return k[1] if k and isinstance(k[1], int | float) else None

    rows, per = [], {}
    for c in ckpt["cells"]:
        if c["dtype"] != "float32":
            continue
        source = "/".join(c["model"]["label"].split("/")[-2:])
        d = default.get((str(c["model"].get("model_type")), c["backend"], c["check"]))
        if d is None or "skipped" in (c["status"], d["status"]):
            continue
        same = (c["status"], c.get("cause")) == (d["status"], d.get("cause"))
        stat = per.setdefault(source, {"type": c["model"]["model_type"], "cells": 0, "agree": 0, "moved": []})
        stat["cells"] += 1
        stat["agree"] += same
        a, b = num(d), num(c)
        if not same:
            rows.append(f"| {source} | {c['backend']} | {c['check']} | {d['status']} {d.get('cause') or ''} {a} | "
                        f"{c['status']} {c.get('cause') or ''} {b} |")
        elif a is not None and b is not None and abs(a - b) > 1e-6 * max(1.0, abs(a)):
            stat["moved"].append(f"{c['backend']} {c['check']} {a:.3g} -> {b:.3g}")
    env = ckpt.get("environment", {})
    lines = ["# The default audit's models on their checkpoints' configs", "",
             (f"transformers {env.get('transformers')}, torch {env.get('torch')}, CPU float32; default side: "
              f"`reports/packcheck-matrix.json` (transformers {base['environment'].get('transformers')}); checkpoint side: "
              "each public checkpoint's config.json (`../shared/hub-configs`, Phi-3's `auto_map` dropped: it runs in "
              "transformers), shrunk as packcheck shrinks every model, on eager, sdpa and packcheck_flash_ref with the "
              "default audit's checks. Cells skipped on either side are not compared."), "",
             "| checkpoint | model_type | cells compared | same verdict and cause | same verdict, other number |",
             "|---|---|---|---|---|"]
    for source, s in sorted(per.items()):
        moved = "; ".join(s["moved"]) or "none"
        lines.append(f"| {source} | {s['type']} | {s['cells']} | {s['agree']} | {moved} |")
    total = sum(s["cells"] for s in per.values())
    agree = sum(s["agree"] for s in per.values())
    lines += ["", f"{agree} of {total} cells agree on verdict and cause.", ""]
    if rows:
        lines += ["## Differences (findings)", "", "| checkpoint | backend | check | default | checkpoint |", "|---|---|---|---|---|", *rows]
    else:
        checks = sorted({m.split()[1] for s in per.values() for m in s["moved"]})
        lines += [(f"No verdict differs. Numbers moved only in {', '.join(checks)}: how far the logits move when the "
                   "positions are not restarted or a trap is sprung (a sensitivity, not a parity error): the real configs' RoPE "
                   "scaling (Llama 3.2's llama3 scaling factor 32, SmolLM2's rope_theta 1e5, Qwen's 1e6), tied heads and "
                   "windows change how far, not whether.")]
    out = REPO / "reports" / "atlas" / "checkpoint-configs.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"{out}: {agree} of {total} agree, {len(rows)} differ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
