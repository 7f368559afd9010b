"""Why a cell failed, what to do about it, and which known upstream fault it matches.

Pure functions over a results document: a cell's cause is read from what its group measured (the cells of
the same model, backend, dtype and version environment: isolation, logits, loss, position, cache and mask
probes, the attention call counts, the model's stateful layers). The diagnosis explains a verdict; it never
changes one. Known faults come from ``audit/known_faults.toml``.

Causes (``CAUSES``): leak, wrong_positions, loss_normalisation, kernel_numerics, cache_trap, mask_override,
ignores_position_ids, sliding_window, stateful_layers, stateful_layers_refused, backend_swap, labels_contract,
collator_contract, batch_rows, packing_content, packed_mismatch; and crash / hang / out_of_memory for error, timeout and oom cells.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

CAUSES = {
    "leak": "examples attend across boundaries (the isolation probe moves)",
    "wrong_positions": "boundaries hold (isolation passes) but positions differ from the per-example runs",
    "loss_normalisation": "logits match but the loss differs: labels or the token count used to normalise",
    "kernel_numerics": "differences within a small multiple of the dtype tolerance, no leak: kernel numerics",
    "cache_trap": "correct only with use_cache=False: a cache disables the packed mask",
    "mask_override": "an attention_mask beside the packed row overrides its boundaries",
    "ignores_position_ids": "the model ignores position_ids (restarting them changes nothing)",
    "sliding_window": "parity holds for examples shorter than the sliding window and fails above it",
    "stateful_layers": "state-space / linear-attention / conv layers carry state across examples (attention is isolated)",
    "stateful_layers_refused": "the model refuses packed rows: its stateful layers cannot keep examples apart here",
    "backend_swap": "the requested attention backend is not the one that ran",
    "labels_contract": "the collator's labels contract (non-token labels) is broken",
    "collator_contract": "the collator's output breaks the packing contract (lengths, positions, cu_seq_lens)",
    "batch_rows": "two packed rows (batch size > 1) without cu_seq_lens lose their boundaries on this backend",
    "packing_content": "TRL's packer loses, duplicates or cuts tokens beyond what its strategy documents (a tail packed without its prompt)",
    "packed_mismatch": "the packed run differs from the reference, and the audit ran no isolation / logits check to say why",
    "crash": "the cell crashed (see the exception)",
    "hang": "the cell did not finish within the timeout",
    "out_of_memory": "the cell ran out of memory",
}
#: A parity difference at most this many times the tolerance, with isolation holding, is kernel numerics.
NUMERICS_FACTOR = 10.0
_PARITY_CHECKS = ("isolation", "logits_parity", "loss_parity", "grad_parity", "backend", "cache_trap", "trainer")
_MASKED_BACKENDS = ("eager", "sdpa", "flex_attention")
#: The SFTTrainer checks: they share the batch-contract and first-batch-loss messages.
_SFT_CHECKS = ("sft", "sft_padding_free", "sft_strategies")


def _v(text: str | None) -> Any:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def library_version(cell: dict[str, Any], doc_env: dict[str, Any], library: str) -> str | None:
    """The version of ``library`` the cell ran with: its version environment's, else the document's."""
    env = cell.get("env") or {}
    return (env.get("versions") or {}).get(library) or (env.get("environment") or {}).get(library) or doc_env.get(library)


def _group_key(cell: dict[str, Any]) -> tuple:
    return (cell["model"]["label"], cell["backend"], cell["dtype"], (cell.get("env") or {}).get("label"))


def _metric(cell: dict[str, Any] | None, key: str) -> Any:
    return (cell or {}).get("metrics", {}).get(key)


def classify(cell: dict[str, Any], group: dict[str, dict[str, Any]], model_level: dict[str, dict[str, Any]]) -> tuple[str | None, str]:
    """(cause, evidence) of a cell that did not pass, from its group's measurements; (None, "") for a pass."""
    status, check, m = cell["status"], cell["check"], cell.get("metrics", {})
    if status == "pass" or status == "skipped":
        return None, ""
    if status == "error":  # a crash (with its stage), or an inconclusive probe (no cause to name)
        return ("crash", cell["message"][:160]) if m.get("stage") else (None, "")
    if status == "timeout":
        return "hang", f"no result within {m.get('timeout_s')} s"
    if status == "oom":
        return "out_of_memory", ", ".join(f"{k} {v}" for k, v in m.items() if str(k).endswith("_mib"))
    if status == "fallback":
        return "backend_swap", cell["message"][:160]
    if status == "unsupported":
        text = cell["message"]
        if "causal_conv1d" in text or "can't keep packed sequences apart" in text:
            return "stateful_layers_refused", text[:160]
        return None, ""
    if check == "collate":
        if "labels contract" in cell["message"] or "integer labels" in cell["message"]:
            return "labels_contract", str(m.get("integer_labels", ""))[:160]
        if "position" in cell["message"]:
            return "wrong_positions", cell["message"][:160]
        return "collator_contract", cell["message"][:160]
    if check == "trainer" and isinstance(m.get("use_cache_false"), dict) and "only with use_cache=False" in cell["message"]:
        return "cache_trap", cell["message"][:200]
    if check == "trainer" and "num_items_in_batch" in cell["message"]:
        return "loss_normalisation", cell["message"][:200]
    if check == "packing_content":
        return "packing_content", cell["message"][:200]
    if check in _SFT_CHECKS:
        if "without boundaries" in cell["message"] or "all-ones attention_mask" in cell["message"]:
            return "mask_override", cell["message"][:200]
        if "first-batch loss" in cell["message"] or "3-step training" in cell["message"]:
            iso = group.get("isolation")
            if iso is None or iso["status"] not in ("pass", "fail"):
                return "packed_mismatch", cell["message"][:200]
            if iso["status"] == "fail" and _metric(iso, "stateful_layers"):
                return "stateful_layers", f"layers {', '.join(_metric(iso, 'stateful_layers')[:3])}; {cell['message'][:160]}"
            return ("leak" if iso["status"] == "fail" else "loss_normalisation"), cell["message"][:200]
        return "collator_contract", cell["message"][:200]
    if check == "position_ids":
        return "ignores_position_ids", f"restarting position_ids changed later examples by {m.get('max_change')}"
    if check == "cache_trap" and isinstance(m.get("max_abs_diff_use_cache_false"), float) and m["max_abs_diff_use_cache_false"] <= m.get("atol", 0):
        return "cache_trap", f"default {m.get('max_abs_diff_default'):.2e} vs use_cache=False {m['max_abs_diff_use_cache_false']:.2e}"
    if check == "mask_trap" and isinstance(m.get("max_abs_diff_without_mask"), float) and m["max_abs_diff_without_mask"] <= m.get("atol", 0):
        return "mask_override", f"with the mask {m.get('max_abs_diff_with_mask'):.2e}, without {m['max_abs_diff_without_mask']:.2e}"
    # parity: read the group
    iso, logits = group.get("isolation"), group.get("logits_parity")
    backend = group.get("backend")
    stateful = _metric(iso, "stateful_layers") or []
    leaked = iso is not None and iso["status"] == "fail"
    boundaries_reached = backend is not None and backend["status"] == "pass"
    no_attention = backend is not None and backend["status"] == "skipped" and "no attention layers" in backend["message"]
    if leaked and stateful and (boundaries_reached or no_attention or cell["backend"] not in _MASKED_BACKENDS):
        return "stateful_layers", f"layers {', '.join(stateful[:3])}; attention boundaries reached; isolation moved {_metric(iso, 'max_change'):.2e}"
    within = _metric(logits, "max_abs_diff_within_window")
    if isinstance(within, float) and logits is not None and within <= _metric(logits, "atol"):
        return "sliding_window", (f"examples within the {_metric(logits, 'sliding_window')}-token window match ({within:.2e}), "
                                  f"longer ones differ by {_metric(logits, 'max_abs_diff_solo'):.2e}")
    if leaked:
        moved, tol = _metric(iso, "max_change"), _metric(iso, "atol") or 0
        if isinstance(moved, float) and tol and moved <= NUMERICS_FACTOR * tol:
            return "kernel_numerics", f"isolation moved {moved:.2e} (tolerance {tol:.0e})"
        return "leak", f"perturbing one example moved the others by {moved:.2e}"
    if logits is not None and logits["status"] == "fail":
        worst, tol = _metric(logits, "max_abs_diff_solo"), _metric(logits, "atol") or 0
        if isinstance(worst, float) and tol and worst <= NUMERICS_FACTOR * tol:
            return "kernel_numerics", f"logits differ by {worst:.2e} (tolerance {tol:.0e}), isolation holds"
        shifted = _metric(logits, "max_abs_diff_start_based_positions")
        detail = f"; positions from padding_idx + 1 give {shifted:.2e}" if isinstance(shifted, float) else ""
        return "wrong_positions", f"isolation holds, logits differ by {worst:.2e}{detail}"
    if check in ("loss_parity", "grad_parity") and (logits is None or logits["status"] == "pass"):
        if check == "loss_parity":
            return "loss_normalisation", cell["message"][:160]
        return "kernel_numerics", cell["message"][:160]
    if check == "cache_trap":
        return "leak", cell["message"][:160]
    if check == "backend":
        return ("leak" if cell["backend"] in _MASKED_BACKENDS else "collator_contract"), cell["message"][:160]
    if check == "trainer" and status == "fail":
        return "packed_mismatch", cell["message"][:200]
    return None, ""


def probe_findings(cell: dict[str, Any]) -> list[tuple[str, str]]:
    """Causes seen by a probe of a cell whatever its verdict (e.g. the two-row probe of logits_parity)."""
    out = []
    two = _metric(cell, "max_abs_diff_two_rows")
    tol = _metric(cell, "atol")
    shifted, worst = _metric(cell, "max_abs_diff_start_based_positions"), _metric(cell, "max_abs_diff_solo")
    if (cell["check"] == "logits_parity" and isinstance(shifted, float) and isinstance(worst, float) and tol is not None
            and worst > tol and shifted < worst / 10):
        out.append(("wrong_positions", (f"the collated row differs by {worst:.2e}; with positions from padding_idx + 1 "
                                        f"by {shifted:.2e} (what position_ids_start fixes)")))
    a, b = _metric(cell, "as_configured"), _metric(cell, "use_cache_false")
    if cell["check"] == "trainer" and isinstance(a, dict) and isinstance(b, dict) and a.get("loss") and b.get("loss"):
        gap = max(abs(x - y) for x, y in zip(a["loss"], b["loss"], strict=False))
        if gap > 1e-3:
            out.append(("cache_trap", f"the packed run as configured differs from use_cache=False by {gap:.2e} in loss"))
    padded_trainer = _metric(cell, "padded_trainer")
    if cell["check"] in ("trainer", "sft") and isinstance(padded_trainer, dict) and padded_trainer.get("normalisation"):
        out.append(("loss_normalisation", (f"Trainer's own padded run: loss x{padded_trainer['loss_ratio']:.4f} = label tokens "
                                           "after / before the shift (it divides by the unshifted count); the packed run "
                                           "is measured against a correctly normalised reference")))
    # only where the packed row itself is right: a row that already leaks says nothing more with two rows
    if cell["check"] == "logits_parity" and cell["status"] == "pass" and isinstance(two, float) and tol is not None and two > tol:
        out.append(("batch_rows", f"two packed rows differ from solo by {two:.2e}"))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Remedies


def remedy(cause: str, cell: dict[str, Any], doc_env: dict[str, Any]) -> str:
    """One line that fits the cell's versions and backend."""
    backend = cell["backend"]
    tf = _v(library_version(cell, doc_env, "transformers"))
    m = cell.get("metrics", {})
    if cause == "leak":
        if backend in _MASKED_BACKENDS and tf is not None and tf < _v("4.53.1"):  # bisected: 4.53.0 has none
            return "upgrade transformers to >= 4.53.1 (packed masks for eager/sdpa/flex), or use a flash backend"
        if backend in _MASKED_BACKENDS:
            return ("train with a flash backend (flash_attention_2/3) if its cells pass here (packcheck's varlen reference "
                    "shows whether the flash path keeps the boundaries): this model's eager/sdpa/flex path does not")
        return "disable packing for this architecture on this backend"
    if cause == "mask_override" and cell["check"] in _SFT_CHECKS:
        trl = _v(library_version(cell, doc_env, "trl"))
        if (m.get("effective") or {}).get("padding_free") and trl is not None and _v("0.19.0") <= trl < _v("0.23.1"):
            return (f"TRL {trl} sends position_ids with padding_free only to flash_attention_2 (return_position_ids="
                    "use_flash_attention): train with attn_implementation='flash_attention_2', or upgrade TRL to >= 0.23.1")
        return ("set padding_free=True in SFTConfig (TRL >= 0.16) so packed rows carry position_ids and no attention_mask, "
                "or upgrade TRL (from 0.21 bfd packing turns padding-free on; from 0.23.1 position_ids reach every backend)")
    if cause == "packing_content":
        trl = _v(library_version(cell, doc_env, "trl"))
        if trl is not None and _v("0.27") <= trl < _v("0.29"):
            return ("upgrade TRL to >= 0.29.0 (or pin <= 0.26.2: bfd drops the overflow there), or truncate examples to "
                    "max_length before packing so there is no overflow")
        return "truncate examples to max_length before packing, or use packing_strategy='bfd_split' knowingly; report it to TRL"
    if cause == "wrong_positions":
        if m.get("batch_has_position_ids") is False:
            return "also return position_ids from the collator (DataCollatorWithFlattening(return_position_ids=True))"
        if isinstance(m.get("max_abs_diff_start_based_positions"), float):
            if tf is not None and tf < _v("5.15.0"):  # bisected: position_ids_start arrives in 5.15.0
                return "upgrade transformers to >= 5.15.0 and set position_ids_start=padding_idx + 1 on the collator"
            return "set position_ids_start=padding_idx + 1 on DataCollatorWithFlattening"
        return "check that position_ids restart at each example and reach the model's rotary / position embedding"
    return {
        "cache_trap": ("set use_cache=False (model.config.use_cache = False): TRL's SFTTrainer does, and transformers' "
                       "Trainer does from 5.0.0 on (TrainingArguments.use_cache=False; bisected, 4.57.6 does not); a "
                       "hand-written loop does not"),
        "mask_override": "do not pass attention_mask with packed rows (drop it from the batch)",
        "ignores_position_ids": "not supported for this architecture: disable packing for it",
        "sliding_window": "use a flash backend (the window is applied per segment), or keep examples shorter than the window",
        "stateful_layers": "disable packing for this architecture (its state carries from one example into the next)",
        "stateful_layers_refused": "disable packing for this architecture here; on GPU, kernels that take seq_idx can keep examples apart",
        "backend_swap": "install the requested backend or request one that runs (see which ran in the backend cell)",
        "labels_contract": "use a padding collator for non-token (sequence-classification) labels",
        "collator_contract": "fix the collator's output (see the collate cell), or upgrade transformers",
        "loss_normalisation": ("compare packed runs with a correctly normalised padded baseline, and count num_items_in_batch "
                               "after the shift over the whole accumulation step; keep labels -100 at boundaries"),
        "kernel_numerics": "none needed: within a small multiple of the dtype tolerance; widen it if this dtype is expected to differ",
        "batch_rows": "pack one row per step (DataCollatorWithFlattening does), or pass cu_seq_lens_q/k with the batch",
        "packed_mismatch": "add isolation and logits_parity to --packcheck-checks: they tell a leak from wrong positions",
        "crash": "see the exception; report it upstream if it is the library's",
        "hang": "raise --packcheck-timeout if the model is just slow; else see the last output",
        "out_of_memory": "use a smaller model or dtype, or run on a bigger device",
    }.get(cause, "")


# ----------------------------------------------------------------------------------------------------------------
# Known faults


@dataclass(frozen=True)
class KnownFault:
    id: str
    upstream: str
    summary: str
    library: str
    versions: str
    architectures: tuple[str, ...]
    backends: tuple[str, ...]
    checks: tuple[str, ...]
    cause: str
    fixed_in: str
    remedy: str
    evidence: str
    # how the window was measured: a `packcheck bisect` result (first_bad / first_fixed, last, measured, result
    # file) or `unavailable` with the reason it cannot be bisected on CPU (tests/test_bisect.py compares them)
    bisect: Any = field(default=None, compare=False, hash=False)

    def applies(self, cell: dict[str, Any], doc_env: dict[str, Any]) -> bool:
        """The cell is inside this fault's window: library version, architecture, backend and check."""
        from packaging.specifiers import SpecifierSet

        version = _v(library_version(cell, doc_env, self.library))
        if version is None or not SpecifierSet(self.versions).contains(version.public, prereleases=True):
            return False
        arch_ok = "*" in self.architectures or cell["model"].get("model_type") in self.architectures
        backend_ok = "*" in self.backends or (cell["backend"] or "*") in self.backends or cell["backend"] is None
        return arch_ok and backend_ok and cell["check"] in self.checks


def load_known_faults(path: str | Path | None = None) -> list[KnownFault]:
    """Read ``audit/known_faults.toml`` (or ``path``).

    Raises:
        ValueError: an entry with a missing key, an unknown cause or an invalid version specifier.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from .specs import PACKAGE_AUDIT_DIR

    file = Path(path) if path else PACKAGE_AUDIT_DIR / "known_faults.toml"
    data = tomllib.loads(file.read_text())
    faults = []
    for raw in data.get("fault", []):
        try:
            fault = KnownFault(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k != "bisect"},
                               bisect=raw.get("bisect"))
        except TypeError as exc:
            raise ValueError(f"{file}: entry {raw.get('id', '?')}: {exc}") from None
        if fault.cause not in CAUSES:
            raise ValueError(f"{file}: entry {fault.id}: unknown cause '{fault.cause}'")
        try:
            SpecifierSet(fault.versions)
        except InvalidSpecifier:
            raise ValueError(f"{file}: entry {fault.id}: invalid versions '{fault.versions}'") from None
        faults.append(fault)
    return faults


def diagnose_document(doc: dict[str, Any], faults: list[KnownFault] | None = None) -> dict[str, Any]:
    """Add ``diagnosis`` to every cell ({cause, evidence, remedy, findings, known_faults}) and ``known_faults_not_seen``
    to the document. Verdicts are untouched."""
    faults = load_known_faults() if faults is None else faults
    env = doc.get("environment", {})
    groups: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for c in doc["cells"]:
        groups[_group_key(c)][c["check"]] = c
    not_seen: dict[str, list[str]] = defaultdict(list)
    for c in doc["cells"]:
        model_level = groups.get((c["model"]["label"], None, c["dtype"], (c.get("env") or {}).get("label")), {})
        cause, evidence = classify(c, groups[_group_key(c)], model_level)
        findings = [f for f in probe_findings(c) if f[0] != cause]
        causes = ([cause] if cause else []) + [f for f, _ in findings]
        matched = [f.id for f in faults if f.cause in causes and f.applies(c, env)]
        for f in faults:
            if c["status"] == "pass" and f.cause not in causes and f.applies(c, env):
                not_seen[f.id].append(c["cell_id"])
        c["diagnosis"] = {
            "cause": cause, "evidence": evidence, "remedy": remedy(cause, c, env) if cause else "",
            "findings": [{"cause": f, "evidence": e, "remedy": remedy(f, c, env)} for f, e in findings],
            "known_faults": matched,
        } if causes else None
    doc["known_faults_not_seen"] = {k: sorted(v) for k, v in sorted(not_seen.items())}
    return doc
