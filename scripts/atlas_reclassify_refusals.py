"""Re-judge the committed atlas's recorded build errors with the runner's current refusal markers, without measuring
again: an entry whose cause is ``shrunk_crash`` at model build and whose recorded exception the runner now classes
as the library's refusal (:func:`pytest_packcheck.run.runner._classify_exception` -> ``unsupported``) becomes
``unsupported``, as a new run would write it (message ``model build: <exception>``, no cause, no number, the
hazards of the same build ``unsupported``). Each release record that changed gains ``reclassified`` (count, rule,
date), so a reader sees which entries were relabelled rather than measured.

Written for transformers <= 4.53's "X does not support Flash Attention 2.0 yet", which a case-sensitive marker
classed as shrunk_crash (runner fix 7f97a2d). Idempotent.

    PYTHONPATH=$PWD python scripts/atlas_reclassify_refusals.py reports/atlas/support.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_packcheck.run.runner import _classify_exception

PREFIX = "crashed in the model packcheck shrank (random weights): model build: "


def relabel(entry: dict) -> dict | None:
    """The entry a run with today's markers would write, or None when it stays."""
    message = entry.get("message", "")
    if entry.get("verdict") != "error" or entry.get("causes") != ["shrunk_crash"] or not message.startswith(PREFIX):
        return None
    exception = message[len(PREFIX):]
    kind, _, text = exception.partition(": ")
    if kind not in ("ValueError", "NotImplementedError"):
        return None
    if _classify_exception({"ValueError": ValueError, "NotImplementedError": NotImplementedError}[kind](text)) != "unsupported":
        return None
    out = {"verdict": "unsupported", "causes": [], "check": entry.get("check"), "message": f"model build: {exception}"}
    if entry.get("hazards"):
        out["hazards"] = {k: "unsupported" for k in entry["hazards"]}
    return out


def main(path: str) -> int:
    file = Path(path)
    support = json.loads(file.read_text())
    counts: dict[str, int] = {}
    for by_backend in support["cells"].values():
        for row in by_backend.values():
            for version, entry in row.items():
                new = relabel(entry)
                if new is not None:
                    row[version] = new
                    counts[version] = counts.get(version, 0) + 1
    for record in support["releases"]:
        n = counts.get(record["transformers"])
        if n:
            record["reclassified"] = {"entries": n, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                                      "rule": "recorded build exception is the library's refusal (runner marker, "
                                              "case-insensitive): shrunk_crash -> unsupported, not measured again"}
    file.write_text(json.dumps(support, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"relabelled {sum(counts.values())} entries: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "reports" / "atlas" / "support.json")))
