"""The training paths of one lookup answer: the model fed the packed row, transformers' ``Trainer``, TRL's
``SFTTrainer``. The atlas measures the first (its verdict and its traps' ``hazards``); ``audit/known_faults.toml``
holds what goes wrong on the others by release window (bisected where it says so); the TRL axis of the support file
measures the third per TRL release. A bare ``pass`` is for an answer whose every known path passes and whose
default way of running carries no hazard.

Imports neither torch nor transformers: tomllib and packaging only (``packcheck lookup`` answers at start-up speed).
"""

from __future__ import annotations

from typing import Any

#: The atlas's trap checks, recorded per entry under ``hazards`` (check -> the cause it measured there), that hit
#: the default way of running a packed row: the default config keeps ``use_cache=True``, and a forward that builds
#: a cache gets no packed mask on eager / sdpa / flex (known fault ``cache-disables-packed-mask``).
DEFAULT_HAZARDS = {"cache_trap": ("cache_trap", ("a forward with config.use_cache=True (the default of most configs) builds a "
                                                 "cache and gets no packed mask: the examples attend to each other"),
                                  ("set model.config.use_cache = False before training (TRL's SFTTrainer does, transformers' "
                                   "Trainer does from 5.0.0)"))}
#: Traps that hit only a batch built by hand against the collator's default (``DataCollatorWithFlattening`` sends no
#: ``attention_mask``): named in the answer, not counted against a bare pass.
OPT_IN_HAZARDS = {"mask_trap": ("mask_override", ("an attention_mask passed beside the packed position_ids overrides the "
                                                 "boundaries (DataCollatorWithFlattening sends none)"),
                                "do not pass attention_mask with packed rows")}
#: Known-fault causes that describe the trainer's *padded* baseline, not the packed run (the packed run is right):
#: a note on the path, never its failure.
BASELINE_ONLY = {"padded_normalisation"}


def training_paths(doc: dict[str, Any], model_type: str, backend: str, wanted: Any, entry: dict[str, Any] | None,
                   verdict: str | None, causes: list[str], trl: dict[str, Any] | None = None,
                   faults: list[Any] | None = None) -> list[dict[str, Any]]:
    """One dict per path: ``path`` ("model", "Trainer", "SFTTrainer"), ``verdict`` ("pass", "fail", "hazard",
    "not measured", or the model's own "error" / "unsupported"), ``causes`` (cause codes), ``reasons`` (one line
    each: what goes wrong), ``remedy`` (what makes *this* release safe, "" when nothing does), ``safe_from`` (the
    first release, patch exact where a transition was bisected or a known fault's ``fixed_in`` says so, from which
    the path passes as is; None when it passes already or no measured release does), and ``source`` (what the path's
    verdict rests on: the atlas entry, the known-fault ids, the TRL axis).

    ``wanted``: the release asked (a ``packaging`` Version). ``entry``: the atlas entry the model verdict came from
    (its ``hazards``), None when the answer was inferred. ``faults``: default, the shipped known faults.
    """
    from packaging.version import Version

    if faults is None:
        from .diagnose import load_known_faults

        faults = load_known_faults()
    hazards = (entry or {}).get("hazards") or {}
    model: dict[str, Any] = {"path": "model", "verdict": verdict, "causes": list(causes), "reasons": [], "remedy": "",
                             "safe_from": None, "source": f"atlas entry {model_type} / {backend}"}
    if verdict == "fail":
        model["safe_from"] = first_passing_release(doc, model_type, backend, wanted)
    elif verdict == "pass":
        for check, (cause, why, fix) in DEFAULT_HAZARDS.items():
            if hazards.get(check) == cause:
                model.update(verdict="hazard", remedy=fix)
                model["causes"].append(cause)
                model["reasons"].append(f"{check}: {why}")
        for check, (cause, why, fix) in OPT_IN_HAZARDS.items():
            if hazards.get(check) == cause:
                model["reasons"].append(f"{check} (only if you pass one): {why}; {fix}")
    paths = [model]

    def window(library: str, check_names: set[str], version: Any) -> list[Any]:
        """The known faults of ``library`` whose window, architectures, backends and checks hold this answer at
        ``version``: :meth:`KnownFault.applies`, the diagnosis's own rule, on the answer as a cell."""
        env = {library: str(version)}
        return [f for f in faults if f.library == library and any(
            f.applies({"model": {"model_type": model_type}, "backend": backend, "check": check}, env) for check in check_names)]

    if verdict == "fail":  # the known fault behind the model's own failure, where one is in its window: its remedy
        own = [f for f in window("transformers", {(entry or {}).get("check") or "isolation"}, wanted) if f.cause in causes]
        model["remedy"] = "; or ".join(dict.fromkeys(f.remedy for f in own))
        if own:
            model["source"] += " and audit/known_faults.toml: " + ", ".join(f.id for f in own)
    # Trainer: the model's forward inside Trainer.training_step; what the known faults add in this release's window
    trainer = _from_faults("Trainer", window("transformers", {"trainer"}, wanted), model)
    paths.append(trainer)
    # SFTTrainer: the TRL axis's measurement where asked with --trl, else the known faults cannot be placed
    if trl is not None:
        sft = {"path": "SFTTrainer", "verdict": "not measured", "causes": [], "reasons": [], "remedy": "", "safe_from": None,
               "source": f"the atlas's TRL axis, trl {trl.get('trl')}"}
        if trl.get("measured"):
            # SFTTrainer's modes only: the RL trainers' (trl_answer's rl_modes) are other trainers, printed apart
            modes = {m: r for m, r in (trl.get("modes") or {}).items() if m not in trl.get("rl_modes", ())}
            bad = {m: r for m, r in modes.items() if r.get("verdict") != "pass"}
            sft["verdict"] = "pass" if modes and not bad else "fail"
            for mode, r in bad.items():
                sft["causes"] += [c for c in r.get("causes") or [] if c not in sft["causes"]]
                sft["reasons"].append(f"{mode}: {r.get('verdict')}" + (f" [{', '.join(r.get('causes') or [])}]" if r.get("causes") else ""))
            try:
                trl_faults = window("trl", {"sft", "sft_padding_free", "sft_strategies"}, Version(str(trl.get("trl"))))
            except ValueError:
                trl_faults = []
            remedies = [f.remedy for f in trl_faults if f.cause not in BASELINE_ONLY]
            if sft["verdict"] == "fail" and remedies:
                sft["remedy"] = "; or ".join(dict.fromkeys(remedies))
                fixed = [f.fixed_in for f in trl_faults if f.fixed_in]
                sft["safe_from"] = f"trl {max(fixed, key=Version)}" if fixed else None
                sft["source"] += " and " + ", ".join(f.id for f in trl_faults)
        paths.append(sft)
    return paths


def _from_faults(name: str, faults: list[Any], model: dict[str, Any]) -> dict[str, Any]:
    """A trainer path: the model path's verdict (the trainer runs that forward), worsened by the known faults whose
    window holds the release (their remedies are what makes this release safe, their ``fixed_in`` the first release
    past them)."""
    from packaging.version import Version

    out = {"path": name, "verdict": model["verdict"], "causes": [c for c in model["causes"] if c != "cache_trap"], "reasons": [],
           "remedy": "", "safe_from": model["safe_from"], "source": "the model path and audit/known_faults.toml"}
    if out["verdict"] == "hazard":  # the cache hazard is the trainer's own question: the faults below answer it
        out["verdict"] = "pass"
    real = [f for f in faults if f.cause not in BASELINE_ONLY]
    for f in faults:
        if f.cause in BASELINE_ONLY:
            out["reasons"].append(f"note ({f.id}): {f.summary}")
    if real:
        if out["verdict"] == "pass":
            out["verdict"] = "fail"
        out["causes"] += [f.cause for f in real if f.cause not in out["causes"]]
        out["reasons"] += [f"{f.id}: {f.summary}" for f in real]
        out["remedy"] = "; or ".join(dict.fromkeys(f.remedy for f in real))
        fixed = [Version(f.fixed_in) for f in real if f.fixed_in]
        candidates = fixed + ([Version(out["safe_from"])] if out["safe_from"] else [])
        out["safe_from"] = str(max(candidates)) if candidates and len(fixed) == len(real) else out["safe_from"]
        out["source"] = "audit/known_faults.toml: " + ", ".join(f.id for f in real)
    return out


def first_passing_release(doc: dict[str, Any], model_type: str, backend: str, wanted: Any) -> str | None:
    """The first release after ``wanted`` from which every measured release of (``model_type``, ``backend``) passes:
    patch exact where the transition into it was bisected (``transitions[].bisected.first``), else the measured
    release itself. None when the newest measured release does not pass."""
    from packaging.version import InvalidVersion, Version

    row = (doc.get("cells", {}).get(model_type) or {}).get(backend) or {}
    try:
        releases = sorted(row, key=Version)
    except InvalidVersion:
        return None
    start = None
    for v in reversed(releases):
        if Version(v) <= wanted or row[v].get("verdict") != "pass":
            break
        start = v
    if start is None:
        return None
    i = releases.index(start)
    before = releases[i - 1] if i else None
    for t in doc.get("transitions", []):
        if (t.get("model_type"), t.get("backend"), t.get("last_before"), t.get("first_after")) == (model_type, backend, before, start):
            b = t.get("bisected") or {}
            if b.get("outcome") == "found" and b.get("first") and Version(b["first"]) > wanted:
                return str(b["first"])
    return start
