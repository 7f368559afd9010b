"""Why a cell failed, what to do about it, and which known upstream fault it matches.

Pure functions over a results document. A cell's cause is the cause code its check returned
(:data:`registry.CAUSES`, with the check's evidence), or, for a cell that did not get to measure anything,
its status's (crash, hang, out_of_memory). The diagnosis maps codes to remedies; it never reads a message and
never changes a verdict. Known faults come from ``audit/known_faults.toml``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .backends import MASKED_BACKENDS
from .registry import CAUSES, NUMERICS_FACTOR  # noqa: F401 - re-exported: code written against 0.1 reads them here


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


def _short(evidence: Any) -> str:
    """Evidence as one line: ``key value`` pairs with numbers in scientific notation."""
    if not isinstance(evidence, dict):
        return str(evidence)[:200]
    parts = []
    for k, v in evidence.items():
        parts.append(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(parts)[:240]


def classify(cell: dict[str, Any]) -> tuple[str | None, str]:
    """(cause, evidence) of a cell: the cause code its check returned; for a cell that measured nothing, its
    status's (error with a stage: crash; timeout: hang; oom: out_of_memory; fallback: backend_swap); a failed
    cell of a results file written before cause codes (schema 1): packed_mismatch. (None, "") for a pass or a
    skip. Reads codes and numbers only, never the message."""
    status, m = cell["status"], cell.get("metrics") or {}
    if status in ("pass", "skipped"):
        return None, ""
    if cell.get("cause"):
        return cell["cause"], _short(cell.get("evidence") or {})
    if status == "error":  # a crash (with its stage); an error without one measured nothing to name
        return ("crash", _short({k: m[k] for k in ("stage", "exception", "where") if k in m})) if m.get("stage") else (None, "")
    if status == "timeout":
        return "hang", f"no result within {m.get('timeout_s')} s"
    if status == "oom":
        return "out_of_memory", ", ".join(f"{k} {v}" for k, v in m.items() if str(k).endswith("_mib"))
    if status == "fallback":
        return "backend_swap", _short({k: m[k] for k in ("requested", "effective") if k in m})
    if status == "fail":
        return "packed_mismatch", "a results file written before cause codes: the check named none"
    return None, ""


# ----------------------------------------------------------------------------------------------------------------
# Remedies


def remedy(cause: str, cell: dict[str, Any], doc_env: dict[str, Any]) -> str:
    """One line that fits the cell's versions and backend."""
    backend = cell["backend"]
    tf = _v(library_version(cell, doc_env, "transformers"))
    m = cell.get("metrics", {})
    if cause == "leak":
        if backend in MASKED_BACKENDS and tf is not None and tf < _v("4.53.1"):  # bisected: 4.53.0 has none
            return "upgrade transformers to >= 4.53.1 (packed masks for eager/sdpa/flex), or use a flash backend"
        if backend in MASKED_BACKENDS:
            return ("do not pack on eager/sdpa/flex for this model; the flash path may keep the boundaries (see its "
                    "varlen reference cell, packcheck's CPU stand-in for the FA2 preparation code): run packcheck with "
                    "flash_attention_2 on your GPU before training with it packed")
        return "disable packing for this architecture on this backend"
    if cause == "mask_override" and cell["check"] in ("sft", "sft_padding_free", "sft_strategies"):
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
        own = next((c.get("evidence") or {} for c in cell.get("causes") or [] if c.get("cause") == cause), {})
        if m.get("batch_has_position_ids") is False or own.get("batch_has_position_ids") is False:
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
        "stateful_layers": ("disable packing for this architecture on this stack (its state carries from one example into the "
                            "next), or train on GPU with the kernels that restart state at seq_idx / cu_seq_lens "
                            "(mamba_ssm and causal_conv1d with seq_idx, flash-linear-attention with cu_seqlens), fed by "
                            "a collator that returns seq_idx (DataCollatorWithFlattening(return_seq_idx=True), TRL's "
                            "padding-free collator), and check it here on that stack"),
        "stateful_layers_refused": ("disable packing for this architecture here; on GPU, the kernels that take seq_idx "
                                    "(mamba_ssm, causal_conv1d) can keep examples apart"),
        "dense_kernel": "pass position_ids that restart per example, or cu_seq_lens_q/k, so the varlen kernel runs",
        "call_count": ("none if isolation and parity pass here: the count reflects attention modules reused or never "
                       "called; see the backend cell's counts"),
        "empty_example": "drop empty examples before collating (the collator keeps them as a zero-length segment)",
        "padded_normalisation": ("the padded baseline is off, not the packed run: compare with transformers >= 5.10.1 "
                                 "(counts after the shift) or a hand-written reference"),
        "padded_mismatch": ("the padded baseline is off, not the packed run: see the padded cell's per-step losses; "
                            "compare packed runs with a hand-written reference"),
        "completion_mask": ("upgrade TRL to >= 0.20.0 (the packer of 0.17.0 - 0.19.1 drops the completion_mask column, so prompts are "
                            "trained), or mask the prompt labels yourself before packing; check with the sft cell"),
        "probe_inconclusive": "run this model in float32 (the probe is conclusive there) to check isolation",
        "backend_swap": "install the requested backend or request one that runs (see which ran in the backend cell)",
        "labels_contract": "use a padding collator for non-token (sequence-classification) labels",
        "boundary_labels": ("set labels to -100 at each example's first token (DataCollatorWithFlattening and TRL's "
                            "padding-free collator do); a collator of your own must mask them"),
        "collator_contract": "fix the collator's output (see the collate cell), or upgrade transformers",
        "loss_normalisation": ("compare packed runs with a correctly normalised padded baseline, and count num_items_in_batch "
                               "after the shift over the whole accumulation step; keep labels -100 at boundaries"),
        "kernel_numerics": "none needed: within a small multiple of the dtype tolerance; widen it if this dtype is expected to differ",
        "position_layout": ("lay the packed row's position_ids out as the model's own get_rope_index and generate() do: "
                            "(4, batch, length), the collator's row as the text row and again for temporal / height / "
                            "width (text-only rows), e.g. position_ids[None].expand(4, -1, -1); or, on a flash backend, "
                            "pass cu_seq_lens_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True))"),
        "batch_rows": "pack one row per step (DataCollatorWithFlattening does), or pass cu_seq_lens_q/k with the batch",
        "packed_mismatch": "rerun with the current packcheck: it names the cause",
        "flash_boundaries": ("do not pack this model on a flash backend at this version (its flash path derives "
                             "cu_seq_lens that do not fit the row); use sdpa with position_ids, and report it upstream"),
        "kernel_arguments": ("do not run this model on that flash kernel at this transformers version (its flash path "
                             "builds arguments the kernel refuses or misreads, see the backend cell's kernel_arguments); "
                             "pass cu_seq_lens_q/k (int32) and int max_length_q/k from the collator, and report it upstream"),
        "stand_in_differs": ("check this cell with flash_attention_2 on a GPU (the stand-in cannot take the branch "
                             "real FA2 takes, see the evidence's file:line); or upgrade the library that branches "
                             "(TRL >= 0.23.1 sends position_ids to every backend)"),
        "non_finite": ("find which run overflows (the evidence names the first tensors): in the packed run only, do not "
                       "pack this model on this backend; in the reference, check the model in float32 first"),
        "crash": "see the exception; report it upstream if it is the library's",
        "shrunk_crash": ("check the model at full size (a Hub ID, or --packcheck-weights=pretrained) before reporting "
                         "upstream: packcheck shrank this one, and a crash only there is packcheck's to fix"),
        "packcheck_error": ("report it to packcheck with the traceback in the details (the model was not judged by "
                            "this check); the other checks' numbers stand"),
        "reference_unavailable": ("not checked here: compute the reference in float32 or on another backend (the "
                                  "evidence says why this one could not be)"),
        "shrink_limit": "report it to packcheck (its shrink does not know this config), or run the model at full size",
        "library_config": ("give the values the config lacks (arch:<type>{key=value} or --packcheck-config key=value), "
                           "or use a checkpoint's config; report the default config upstream"),
        "offset_positions": ("pass cu_seq_lens_q/k with offset position_ids (the flash path of 5.24 reads boundaries where "
                             "position_ids == 0 otherwise), or restart continuation chunks at 0"),
        "positions_not_restarted": ("also return position_ids (DataCollatorWithFlattening(return_position_ids=True)): "
                                    "learned absolute positions need them restarted per example"),
        "segment_mask": ("send restarting position_ids and no attention_mask (or cu_seq_lens_q/k on a flash backend) "
                         "instead of a segment mask; a 4-D mask only where the backend honours it (see the items)"),
        "single_row": "do not route one unpacked example through the packed path on this version: collate it without flash kwargs",
        "selection_ties": ("none for packing itself: tied top-k scores are cut by index, so the selection depends on "
                           "the row; check with inputs without ties (or real weights) before blaming packing"),
        "mechanism_not_exercised": ("rerun with a config whose value fits the probe row (arch:<type>{key=value}), or "
                                    "longer --packcheck-lengths, to exercise it"),
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

    from .config.audits import PACKAGE_AUDIT_DIR

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
    """Add ``diagnosis`` to every cell ({cause, evidence, remedy, causes, findings, known_faults}) and ``known_faults_not_seen``
    to the document. A cell's diagnosis depends on that cell alone (its cause codes), never on which other checks
    ran. Verdicts are untouched."""
    faults = load_known_faults() if faults is None else faults
    env = doc.get("environment", {})
    not_seen: dict[str, list[str]] = defaultdict(list)
    for c in doc["cells"]:
        cause, evidence = classify(c)
        # every cause of the verdict (CheckResult.causes), primary first, each with its own numbers
        extra = [(x["cause"], x.get("evidence") or {}) for x in c.get("causes") or []
                 if cause and x.get("cause") and x["cause"] != cause] if c["status"] not in ("pass", "skipped") else []
        named = {cause, *(x for x, _ in extra)}
        findings = [(f["cause"], f.get("evidence", "")) for f in c.get("findings") or [] if f.get("cause") and f["cause"] not in named]
        causes = ([cause] if cause else []) + [x for x, _ in extra] + [f for f, _ in findings]
        matched = [f.id for f in faults if f.cause in causes and f.applies(c, env)]
        for f in faults:
            if c["status"] == "pass" and f.cause not in causes and f.applies(c, env):
                not_seen[f.id].append(c["cell_id"])
        listed = [{"cause": cause, "evidence": evidence, "remedy": remedy(cause, c, env)}] if cause else []
        listed += [{"cause": x, "evidence": _short(e), "remedy": remedy(x, c, env)} for x, e in extra]
        remedies = list(dict.fromkeys(r["remedy"] for r in listed if r["remedy"]))
        c["diagnosis"] = {
            "cause": cause, "evidence": evidence,
            # one remedy that covers every cause of the verdict, in their order
            "remedy": remedies[0] if len(remedies) == 1 else "; and ".join(
                f"{r['cause']}: {r['remedy']}" for r in listed if r["remedy"]) if remedies else "",
            "causes": listed,
            "findings": [{"cause": f, "evidence": _short(e), "remedy": remedy(f, c, env)} for f, e in findings],
            "known_faults": matched,
        } if causes else None
    doc["known_faults_not_seen"] = {k: sorted(v) for k, v in sorted(not_seen.items())}
    return doc
