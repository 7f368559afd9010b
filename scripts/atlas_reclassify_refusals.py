"""Re-judge the committed atlas's recorded crashes with the runner's current classification, without measuring
again. Two rules, each relabelling an entry whose cause is ``shrunk_crash`` from its recorded exception as a new
run would write it:

- ``refusal``: a build exception the runner now classes as the library's refusal
  (:func:`pytest_packcheck.run.runner._classify_exception` -> ``unsupported``) becomes ``unsupported`` (message
  ``model build: <exception>``, no cause, no number, the hazards of the same build ``unsupported``). Written for
  transformers <= 4.53's "X does not support Flash Attention 2.0 yet", which a case-sensitive marker classed as
  shrunk_crash (runner fix 7f97a2d).
- ``missing_package``: an exception the runner now reads as a missing optional package
  (:func:`pytest_packcheck.run.runner.missing_packages`: jamba / zamba's "Fast Mamba kernels are not available",
  mamba-ssm / causal-conv1d) becomes ``skipped`` with the package named
  (:func:`~pytest_packcheck.run.runner.missing_package_message`), no cause, no number, and no hazards (a skipped
  hazard is not recorded, as :func:`pytest_packcheck.atlas.collect.reduce_release` writes it).

Each release record that changed gains one ``reclassified`` record per rule (count, rule, date; SCHEMA.md), so a
reader sees which entries were relabelled rather than measured. Idempotent.

    PYTHONPATH=$PWD python scripts/atlas_reclassify_refusals.py reports/atlas/support.json
    PYTHONPATH=$PWD python -m pytest_packcheck.cli atlas --render-only     # atlas.md / atlas.html follow
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_packcheck.atlas.releases import entry_message
from pytest_packcheck.run.runner import _classify_exception, missing_package_message, missing_packages

PREFIX = "crashed in the model packcheck shrank (random weights): "
BUILD = "model build: "
KINDS = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}
RULES = {
    "refusal": "recorded build exception is the library's refusal (runner marker, case-insensitive): shrunk_crash -> "
               "unsupported, not measured again",
    "missing_package": "recorded exception names a missing optional package (runner MISSING_PACKAGE_MARKERS): "
                       "shrunk_crash -> skipped, not measured again",
}


def _exception(entry: dict) -> tuple[str, str, str] | None:
    """(stage, exception type, text) of a shrunk_crash entry's recorded exception, or None."""
    message = entry.get("message", "")
    if entry.get("verdict") != "error" or entry.get("causes") != ["shrunk_crash"] or not message.startswith(PREFIX):
        return None
    exception = message[len(PREFIX):]
    stage = "build" if exception.startswith(BUILD) else "check"
    exception = exception.removeprefix(BUILD)
    kind, _, text = exception.partition(": ")
    return (stage, kind, text) if kind in KINDS else None


def relabel(entry: dict) -> tuple[str, dict] | None:
    """(rule, the entry a run with today's classification would write), or None when it stays."""
    found = _exception(entry)
    if found is None:
        return None
    stage, kind, text = found
    exc = KINDS[kind](text)
    packages = missing_packages(exc)
    if packages:
        message = entry_message(missing_package_message(stage, packages, f"{kind}: {text}"))
        return "missing_package", {"verdict": "skipped", "causes": [], "check": entry.get("check"), "message": message}
    if stage != "build" or _classify_exception(exc) != "unsupported":
        return None
    out = {"verdict": "unsupported", "causes": [], "check": entry.get("check"), "message": f"model build: {kind}: {text}"}
    if entry.get("hazards"):
        out["hazards"] = {k: "unsupported" for k in entry["hazards"]}
    return "refusal", out


def reclassify(support: dict, date: str | None = None) -> dict[tuple[str, str], int]:
    """Relabel ``support`` (the support.json document) in place; (release, rule) -> entries relabelled. Each
    release record gains (or updates) one ``reclassified`` record per rule; an older single record (one object)
    becomes a one-record list."""
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    counts: dict[tuple[str, str], int] = {}
    for by_backend in support["cells"].values():
        for row in by_backend.values():
            for version, entry in row.items():
                found = relabel(entry)
                if found is not None:
                    rule, row[version] = found
                    counts[(version, rule)] = counts.get((version, rule), 0) + 1
    for record in support["releases"]:
        old = record.get("reclassified")
        records = [old] if isinstance(old, dict) else list(old or [])
        for (version, rule), n in sorted(counts.items()):
            if version != record["transformers"]:
                continue
            same = next((r for r in records if r.get("rule") == RULES[rule]), None)
            if same is None:
                records.append({"entries": n, "date": date, "rule": RULES[rule]})
            else:  # the rule relabelled more entries this time (a release measured since the last run)
                same.update(entries=same["entries"] + n, date=date)
        if records:
            record["reclassified"] = records
    return counts


def main(path: str) -> int:
    file = Path(path)
    support = json.loads(file.read_text())
    counts = reclassify(support)
    file.write_text(json.dumps(support, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"relabelled {sum(counts.values())} entries: {dict(sorted((f'{v} {r}', n) for (v, r), n in counts.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "reports" / "atlas" / "support.json")))
