"""Verified remedies (``packcheck audit --verify-remedies``): each remedy a failing cell's diagnosis makes is a
claim; an upgrade (worded by the libraries table) is run again at the named release, a setting is judged from
the cell's own measurement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..versions.libraries import find_upgrade
from .bisect import MODEL_LEVEL_BACKEND, judge, probe_number, probe_settings, version_key

#: Remedies that are a setting, and the measurement of the same cell (or its group) that already shows whether
#: the setting fixes it: (cause, check) -> (metric, what it is).
_SETTING_EVIDENCE = {
    ("cache_trap", "cache_trap"): ("max_abs_diff_use_cache_false", "logits with use_cache=False"),
    ("mask_override", "mask_trap"): ("max_abs_diff_without_mask", "logits without the attention_mask"),
}


def remedy_claims(cell: dict[str, Any], faults: list[Any] | None = None) -> list[dict[str, Any]]:
    """The remedies a failing cell's diagnosis makes, each as a claim to verify: ``kind`` "upgrade" (with
    ``library`` and ``version``, read by :func:`~pytest_packcheck.versions.libraries.find_upgrade` from "upgrade
    transformers to >= X") or "setting"; ``cause`` is what the
    remedy addresses. Remedies of the diagnosis, its findings and its known faults; duplicates dropped."""
    diagnosis = cell.get("diagnosis") or {}
    texts = []
    if diagnosis.get("cause"):
        texts.append((diagnosis["cause"], diagnosis.get("remedy", "")))
    texts += [(f["cause"], f.get("remedy", "")) for f in diagnosis.get("findings", [])]
    by_id = {f.id: f for f in faults or []}
    texts += [(by_id[k].cause, by_id[k].remedy) for k in diagnosis.get("known_faults", []) if k in by_id]
    claims, seen = [], set()
    for cause, text in texts:
        if not text:
            continue
        upgrade = find_upgrade(text)  # the table's wording (versions/libraries.py upgrade_advice)
        claim = ({"kind": "upgrade", "library": upgrade[0], "version": upgrade[1]} if upgrade else {"kind": "setting"})
        key = (cause, claim.get("library"), claim.get("version"), claim["kind"])
        if key in seen:
            continue
        seen.add(key)
        claims.append({"cause": cause, "remedy": text, **claim})
    return claims


def verify_setting(cell: dict[str, Any], cause: str) -> tuple[bool | None, str]:
    """A setting remedy (use_cache=False, no attention_mask) judged from the cell's own measurement:
    (True, number) when the cell is within tolerance with the setting applied, (False, number) when not,
    (None, why) when this cell measured nothing that shows it."""
    metric = _SETTING_EVIDENCE.get((cause, cell["check"]))
    m = cell.get("metrics") or {}
    if cell["check"] == "trainer" and cause == "cache_trap" and isinstance(m.get("use_cache_false"), dict):
        delta, tol = m["use_cache_false"].get("max_loss_delta"), (cell.get("tolerances") or {}).get("train_loss_atol")
        if isinstance(delta, float) and tol is not None:
            return delta <= tol, f"Trainer loss with use_cache=False {delta:.2e} (tolerance {tol:g})"
    if metric and isinstance(m.get(metric[0]), float) and m.get("atol") is not None:
        return m[metric[0]] <= m["atol"], f"{metric[1]} {m[metric[0]]:.2e} (tolerance {m['atol']:g})"
    return None, "no measurement of this cell shows it"


def verify_remedies(doc: dict[str, Any], report_dir: Any, run: Callable[..., Any] | None = None,
                    faults: list[Any] | None = None, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Verify the remedies of every failing cell of a diagnosed results document. An upgrade to X is run again:
    one version environment per (library, X, pinned libraries) with the affected models, backends, checks and
    dtypes; it is "verified at X" when the cell's cause is gone there. A setting is judged from the cell's own
    measurement. Returns one record per (cell, remedy) and stores them as ``doc["remedy_checks"]``. ``run``
    replaces :func:`pytest_packcheck.versions.envs.run_in_env` (tests)."""
    from ..versions.envs import VersionCombo, run_in_env
    from .diagnose import library_version, load_known_faults

    faults = load_known_faults() if faults is None else faults
    run = run or run_in_env
    env = doc.get("environment", {})
    records: list[dict[str, Any]] = []
    upgrades: dict[tuple, list[tuple[dict, dict]]] = {}
    for cell in doc["cells"]:
        if cell["status"] == "pass" and not (cell.get("diagnosis") or {}).get("findings"):
            continue
        for claim in remedy_claims(cell, faults):
            record = {"cell_id": cell["cell_id"], **claim, "verified": None, "detail": ""}
            records.append(record)
            if claim["kind"] == "setting":
                record["verified"], record["detail"] = verify_setting(cell, claim["cause"])
                continue
            have = library_version(cell, env, claim["library"])
            if have and version_key(have) >= version_key(claim["version"]):
                record["detail"] = f"the cell already runs {claim['library']} {have}: the upgrade is not the fix here"
                record["verified"] = False
                continue
            other = "trl" if claim["library"] == "transformers" else "transformers"
            pin = library_version(cell, env, other) if (other == "transformers" or cell["check"] in
                                                        ("sft", "sft_padding_free", "sft_strategies", "packing_content")) else None
            key = (claim["library"], claim["version"], f"{other}=={pin}" if pin else None)
            upgrades.setdefault(key, []).append((cell, record))
    for (library, version, pin), items in upgrades.items():
        combo = VersionCombo(tuple(r for r in (f"{library}=={version}", pin) if r))
        cells = [c for c, _ in items]
        models = list(dict.fromkeys(c["model"].get("spec") or f"arch:{c['model']['label']}" for c in cells))
        settings = probe_settings(models, tuple(dict.fromkeys(c["backend"] or MODEL_LEVEL_BACKEND for c in cells)),
                                  tuple(dict.fromkeys(c["check"] for c in cells)), tuple(dict.fromkeys(c["dtype"] for c in cells)),
                                  doc.get("settings", {}).get("weights", "random"))
        if log:
            log(f"verify remedies: {combo.label} for {len(items)} remedies ({', '.join(models)})")
        result = run(combo, settings, models, report_dir)
        for cell, record in items:
            record["at"] = combo.label
            if result.error:
                record["detail"] = f"not run at {combo.label}: {result.error[:200]}"
                continue
            again = next((c for c in result.cells.values() if c["model"]["label"] == cell["model"]["label"]
                          and c["backend"] == cell["backend"] and c["check"] == cell["check"] and c["dtype"] == cell["dtype"]), None)
            holds, detail = judge(again, record["cause"], False, result.environment)
            record["verified"] = holds
            number = probe_number(again) if again else ""
            record["detail"] = f"{again['status'] if again else 'no cell'} at {combo.label}{'; ' + number if number else ''}; {detail[:160]}"
    doc["remedy_checks"] = records
    return records


def render_remedy_checks(records: list[dict[str, Any]]) -> str:
    """The "Remedies verified" Markdown section: one line per (cell, remedy), verified or not, with the number."""
    from ..report.text import escape_md

    if not records:
        return "## Remedies verified\n\nNo failing cell made a remedy claim.\n"
    lines = ["## Remedies verified", "",
             ("Upgrades are run again at the named release (the cell's cause must be gone there); settings are judged "
              "from the measurement of the same cell. ✔ verified, ✘ not verified, ? nothing measured shows it."), ""]
    mark = {True: "✔ verified", False: "✘ not verified", None: "? unverified"}
    for r in records:
        where = f" at {r['at']}" if r.get("at") else ""
        lines.append(f"- {mark[r['verified']]}{where}: `{r['cell_id']}` ({r['cause']}): {escape_md(r['remedy'])} "
                     f"— {escape_md(r['detail'])}")
    verified = sum(1 for r in records if r["verified"])
    lines += ["", f"{verified} of {len(records)} remedies verified."]
    return "\n".join(lines) + "\n"
