"""Every check, described once: what it runs, where, what its verdict means, and what it can find.

The rest of packcheck reads checks from here: the plan (:mod:`runner`), the settings' allowed names and
defaults, the report's headline verdict, key numbers and legend, the gate's tolerances, the diagnosis's cause
codes, bench's warning mark, ``--help`` and the README's check table. Importing this module imports neither
torch nor transformers (the plugin imports it while pytest loads).

Roles decide what a verdict means for a matrix cell:

- ``correctness``: the packed row as transformers' Trainer (5.x) and TRL feed it (``DataCollatorWithFlattening``
  output, restarting ``position_ids``, no ``attention_mask``, ``use_cache=False``, one packed row per
  micro-batch) trains the model the same as padding. Only these checks decide the cell's headline: ✅ means
  every one that ran passed.
- ``hazard``: a fact about using the model outside that contract (a cache, an ``attention_mask`` beside the
  packed row). True and worth saying, once per stack; never a model failure.
- ``finding``: a fact about the library stack that does not depend on the model (the collators' contracts,
  TRL's packer). Reported once per environment with the count of models it was measured on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROLES = {
    "correctness": "decides the cell: padding-free packing, fed as transformers' Trainer and TRL feed it, trains the "
                   "model the same as padding",
    "hazard": "a usage hazard outside that contract (a cache, an attention_mask beside the packed row): reported once per "
              "stack, never a model failure",
    "finding": "a fact of the library stack (collator contract, TRL's packer), independent of the model: reported once per "
               "environment",
}
LEVELS = {"model": "once per model (no attention backend)", "backend": "once per model x attention backend"}

#: Cause codes a check can return, with what each means. The diagnosis maps a code to a remedy; it never reads
#: a check's message.
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
    "dense_kernel": "the flash backend ran its dense (padded) kernel, not the varlen one: the row was attended whole",
    "call_count": "attention calls counted differ from the attention modules found; parity decides whether it matters",
    "labels_contract": "the collator's labels contract (non-token labels) is broken",
    "boundary_labels": "labels are not -100 at example starts: each example's first token is trained as the previous "
                       "example's next token",
    "collator_contract": "the collator's output breaks the packing contract (lengths, positions, cu_seq_lens)",
    "empty_example": "an empty example is neither dropped nor refused: it leaves a zero-length segment or stray labels",
    "position_layout": "the collator's (batch, length) position_ids reach a multimodal-RoPE model that expands them "
                       "without the text row its packed mask / flash boundaries are read from: examples attend across",
    "batch_rows": "two packed rows (batch size > 1) without cu_seq_lens lose their boundaries on this backend",
    "packing_content": "TRL's packer loses, duplicates or cuts tokens beyond what its strategy documents (a tail packed without its prompt)",
    "padded_normalisation": "the trainer's own padded run divides by the label count before the causal shift (the padded side is wrong)",
    "padded_mismatch": "the trainer's own padded run differs from the hand-written reference, not by the unshifted label count",
    "completion_mask": "prompt tokens keep their labels in the packed row: the completion mask is lost, prompts are trained",
    "packed_mismatch": "the packed run differs from the reference, and no probe in the cell could say why",
    "probe_inconclusive": "the probe could not see a planted leak on this model: its pass would mean nothing",
    "cross_backend": "this backend's per-example (unpacked) logits differ from eager's on the same weights (another "
                     "window, softcap or scaling): packed-vs-solo cannot see it, both share it",
    "non_causal": "a later token changes earlier positions' logits: the backend runs non-causal (bidirectional) attention",
    "flash_boundaries": "the model's flash path built cu_seq_lens that do not fit the packed row (past its end, or "
                        "decreasing): FlashAttention-2 would read outside the row; the reference kernels refuse",
    "kernel_arguments": "the model's flash path handed the varlen kernel arguments its contract refuses or misreads "
                        "(cu_seqlens not int32, max_seqlen below the longest segment, a zero-length segment with "
                        "max_seqlen_q == 1 under GQA; a tensor max_seqlen, which FlashAttention-4 does not take)",
    "stand_in_differs": "the model's or TRL's code branches on the name flash_attention_2, so under packcheck's "
                        "stand-in it takes the non-flash side: the cell says nothing about real FA2 (not checked)",
    "non_finite": "a run produced NaN or infinite numbers (gradients, logits): where only the packed run does, a fail; "
                  "where the reference does, no comparison is possible",
    "offset_positions": "a row whose examples' position_ids start at k > 0 (a continuation chunk) differs from each "
                        "example alone at the same positions, or the model refuses it",
    "positions_not_restarted": "cu_seq_lens without position_ids: boundaries hold but the positions run on across "
                               "examples (learned absolute position embeddings see the wrong positions)",
    "segment_mask": "a segment mask beside the packed row (2-D segment ids, 4-D block-diagonal) does not keep the "
                    "examples apart, or the model refuses it",
    "single_row": "one unpacked example through the flattening collator differs from the dense path (the example alone)",
    "selection_ties": "top-k selection (a sparse-attention indexer) has exact ties at its cut: which tied key is kept "
                      "depends on the row, so packed and alone differ without a leak",
    "mechanism_not_exercised": "a mechanism of the model (top-k selection, chunked attention, ...) is longer than the "
                               "probe row, so the row never exercises it: its pass says nothing about it",
    "crash": "the cell crashed (see the exception)",
    "shrunk_crash": "the cell crashed in the tiny model packcheck made of the config (random weights): the full-size "
                    "model may run; packcheck's shrink is suspect before the library",
    "packcheck_error": "packcheck's own probe code crashed (no frame of the model or its libraries in the traceback): "
                       "packcheck's bug, the check judged nothing; the traceback is in the details",
    "reference_unavailable": "the reference the check compares with (padded or solo run) could not be computed or "
                             "carries no signal (non-finite, all-zero): not checked, the reason is given",
    "shrink_limit": "packcheck could not make a tiny model of this config (a limit of packcheck, not of the model)",
    "library_config": "the config does not build in transformers itself, shrunk or not (the library's own error)",
    "hang": "the cell did not finish within the timeout",
    "out_of_memory": "the cell ran out of memory",
}

#: A parity difference at most this many times the tolerance, with isolation holding, is kernel numerics.
NUMERICS_FACTOR = 10.0


@dataclass(frozen=True)
class CheckSpec:
    """One check. ``function``: ``"module:function"`` inside pytest_packcheck, imported on first call.
    ``key_metric``: (metrics key, label) of the number that backs the verdict, and optionally a third field, the
    key-number format the report writes it in (a name in :data:`report.numbers.KEY_FORMATS`; default ``number``:
    the label and the value); a format that reads several metrics has no single key (None). ``tolerance``: the
    tolerances key that bounds it (the gate flags a pass whose number grew by more). ``causes``: the codes it can
    return."""

    name: str
    function: str
    level: str
    role: str
    summary: str
    key_metric: tuple[str, str] | tuple[str | None, str, str] | None = None
    tolerance: str | None = None
    bears_on_bench: bool = False
    causes: tuple[str, ...] = ()
    training: bool = False
    #: backends this check is not planned on (cross_backend: eager is its reference)
    skip_backends: tuple[str, ...] = ()
    #: not run unless named (--packcheck-checks, or an audit such as audit/variants.toml): the input variants
    opt_in: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"check {self.name}: unknown level {self.level!r}")
        if self.role not in ROLES:
            raise ValueError(f"check {self.name}: unknown role {self.role!r}")
        unknown = [c for c in self.causes if c not in CAUSES]
        if unknown:
            raise ValueError(f"check {self.name}: unknown causes {unknown}")

    def load(self) -> Callable[[Any], Any]:
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(f"pytest_packcheck.{module}"), attr)


_PARITY_CAUSES = ("leak", "stateful_layers", "kernel_numerics", "wrong_positions", "sliding_window", "selection_ties")

#: The checks in matrix order.
REGISTRY: tuple[CheckSpec, ...] = (
    CheckSpec("collate", "checks:check_collate", "model", "finding",
              "transformers' DataCollatorWithFlattening contract, item by item: per-token key lengths, position_ids "
              "restarts, labels -100 at boundaries, cu_seq_lens_q/k int32, max_length_q/k ints, an empty example, "
              "integer labels",
              causes=("collator_contract", "labels_contract", "wrong_positions", "empty_example")),
    CheckSpec("collate_trl", "checks:check_collate_trl", "model", "finding",
              "TRL's padding-free collator (pad_to_multiple_of=8), item by item: equal-length per-token keys, "
              "position_ids restarts, labels -100 at example starts and on the padding",
              causes=("collator_contract",)),
    CheckSpec("position_ids", "checks:check_position_ids", "backend", "correctness",
              "restarting position_ids must change later examples' logits (the model consumes them)",
              ("max_change", "Δ"), None, True, ("ignores_position_ids",)),
    CheckSpec("isolation", "checks:check_isolation", "backend", "correctness",
              "perturb one example: the others' logits must not move; a planted leak (no boundaries) must move them",
              ("max_change", "Δ"), "isolation_atol", True, ("leak", "stateful_layers", "kernel_numerics", "probe_inconclusive")),
    CheckSpec("logits_parity", "checks:check_logits_parity", "backend", "correctness",
              "packed logits = each example run alone (padded batches reported beside)",
              ("max_abs_diff_solo", "Δ"), "logits_atol", True,
              (*_PARITY_CAUSES, "batch_rows", "position_layout", "mechanism_not_exercised")),
    CheckSpec("loss_parity", "checks:check_loss_parity", "backend", "correctness",
              "token-mean loss and gradient-accumulation sum loss (num_items_in_batch) = the per-example reference",
              ("loss_delta", "Δ"), "loss_atol", True, (*_PARITY_CAUSES, "loss_normalisation", "reference_unavailable")),
    CheckSpec("grad_parity", "checks:check_grad_parity", "backend", "correctness",
              "every parameter's gradient, packed vs right-padded: relative error, worst tensor, cosine",
              ("grad_rel_err", "rel"), "grad_rel_err", True, (*_PARITY_CAUSES, "loss_normalisation", "non_finite", "reference_unavailable")),
    CheckSpec("backend", "checks:check_backend", "backend", "correctness",
              "the requested attn_implementation ran: one call per attention layer, packed boundaries reached, "
              "flash backends on the varlen kernel only",
              (None, "calls", "attention_calls"), None, True, ("backend_swap", "leak", "dense_kernel", "call_count", "kernel_arguments")),
    CheckSpec("cross_backend", "checks:check_cross_backend", "backend", "correctness",
              "each example alone on this backend = on eager with the same weights, incl. lengths around the sliding window",
              ("max_abs_diff_vs_eager", "Δ eager"), "logits_atol", True, ("cross_backend", "sliding_window"),
              skip_backends=("eager",)),
    CheckSpec("causality", "checks:check_causality", "backend", "correctness",
              "perturb each example's last token: no earlier position's logits may move (causal attention)",
              ("max_change_earlier", "Δ"), "isolation_atol", True, ("non_causal", "probe_inconclusive")),
    CheckSpec("edge_lengths", "checks:check_edge_lengths", "backend", "correctness",
              "rows of edge lengths (one-token examples, two adjacent; one at the sliding window; one much longer) = "
              "each example alone, logits and loss",
              ("max_abs_diff", "Δ"), "logits_atol", True, (*_PARITY_CAUSES, "loss_normalisation")),
    CheckSpec("single_row", "variants:check_single_row", "backend", "correctness",
              "one example, unpacked, through DataCollatorWithFlattening (position_ids; with cu_seq_lens_q/k) = the "
              "dense path (the example alone)",
              ("max_abs_diff", "Δ"), "logits_atol", True, ("single_row",)),
    CheckSpec("cache_trap", "checks:check_cache_trap", "backend", "hazard",
              "the packed row called with use_cache left as configured (a hand-written loop): a cache disables the "
              "packed mask on eager / sdpa / flex",
              ("max_abs_diff_default", "Δ"), "logits_atol", False, ("cache_trap", *_PARITY_CAUSES)),
    CheckSpec("mask_trap", "checks:check_mask_trap", "backend", "hazard",
              "an all-ones attention_mask beside the packed row (a padding collator's habit) overrides the boundaries",
              ("max_abs_diff_with_mask", "Δ"), "logits_atol", False, ("mask_override", *_PARITY_CAUSES)),
    CheckSpec("offset_positions", "variants:check_offset_positions", "backend", "hazard",
              "a continuation row: position_ids start at 10, 0, 3 (never 0 in the first example), without and with "
              "cu_seq_lens_q/k, vs each example alone at the same positions",
              ("max_abs_diff", "Δ"), "logits_atol", False, ("offset_positions", *_PARITY_CAUSES), opt_in=True),
    CheckSpec("cu_seq_lens", "variants:check_cu_seq_lens", "backend", "hazard",
              "cu_seq_lens_q/k without position_ids (DataCollatorWithFlattening(return_flash_attn_kwargs=True, "
              "return_position_ids=False)) vs each example alone; the collator's cu_seq_lens = its position_ids "
              "restarts; which one a backend follows when they disagree",
              ("max_abs_diff", "Δ"), "logits_atol", False, ("positions_not_restarted", "collator_contract", *_PARITY_CAUSES),
              opt_in=True),
    CheckSpec("segment_masks", "variants:check_segment_masks", "backend", "hazard",
              "a 2-D integer segment-id mask (1,1,2,2,3,...) and a 4-D bool block-diagonal mask beside the packed row "
              "vs each example alone",
              ("max_abs_diff", "Δ"), "logits_atol", False, ("segment_mask", *_PARITY_CAUSES), opt_in=True),
    CheckSpec("trainer", "training:check_trainer", "backend", "correctness",
              "transformers' Trainer + DataCollatorWithFlattening, 3 SGD steps vs a hand-written padded reference; "
              "gradient accumulation's num_items_in_batch",
              ("max_loss_delta", "loss Δ"), "train_loss_atol", False,
              ("cache_trap", "loss_normalisation", "leak", "stateful_layers", "packed_mismatch", "padded_normalisation"),
              training=True),
    CheckSpec("trainer_padded", "training:check_trainer_padded", "backend", "correctness",
              "transformers' Trainer's own padded run (a padding collator), 3 SGD steps vs the hand-written padded "
              "reference: the padded side's verdict (its label count before the shift)",
              ("max_loss_delta", "loss Δ"), "train_loss_atol", False, ("padded_normalisation", "padded_mismatch"),
              training=True),
    CheckSpec("sft", "sft:check_sft", "backend", "correctness",
              "TRL's SFTTrainer(packing=True) as configured by default, every probe on its own: effective configuration, "
              "first-batch row contract, the trainer's first-batch loss, 3 steps vs padded, gradient checkpointing, "
              "completion-only labels",
              ("loss_delta", "loss Δ"), "train_loss_atol", False,
              ("completion_mask", "mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              training=True),
    CheckSpec("sft_padded", "sft:check_sft_padded", "backend", "correctness",
              "TRL's SFTTrainer's own padded run (packing=False), 3 steps vs the hand-written padded reference: the "
              "padded side's verdict",
              ("max_loss_delta", "loss Δ"), "train_loss_atol", False, ("padded_normalisation", "padded_mismatch"),
              training=True),
    CheckSpec("sft_padding_free", "sft:check_sft_padding_free", "backend", "correctness",
              "TRL's SFTTrainer(packing=False, padding_free=True) vs padded: row contract, first-batch loss, 3 steps",
              ("loss_delta", "loss Δ"), "train_loss_atol", False,
              ("mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              training=True),
    CheckSpec("sft_strategies", "sft:check_sft_strategies", "backend", "correctness",
              "TRL's SFTTrainer(packing=True) per packing_strategy (bfd, bfd_split; wrapped shown, not judged) vs padded",
              (None, "loss Δ", "strategy_loss"), "train_loss_atol", False,
              ("mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              training=True),
    CheckSpec("packing_content", "sft:check_packing_content", "model", "finding",
              "token accounting of TRL's pack_dataset per strategy: lost, duplicated, tails packed without their prompt",
              (None, "bfd tails", "pack_tails"), None, False, ("packing_content",), training=True),
)

SPECS: dict[str, CheckSpec] = {s.name: s for s in REGISTRY}
CHECKS: tuple[str, ...] = tuple(SPECS)
#: Checks that run once per model, with no backend.
MODEL_LEVEL_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.level == "model")
#: Whole Trainer / SFTTrainer runs (and TRL's packer): opt in with --packcheck-checks or audit/training.toml.
TRAINING_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.training)
#: Input variants beside the standard row (offset positions, cu_seq_lens without position_ids, segment masks):
#: opt in with --packcheck-checks or audit/variants.toml.
VARIANT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.opt_in and not s.training)
#: Checks run when none are named: all but :data:`TRAINING_CHECKS` and :data:`VARIANT_CHECKS`.
DEFAULT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if not s.training and not s.opt_in)
#: Checks that bear on what bench computes (a packed row, use_cache=False, no attention_mask).
BENCH_RELEVANT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.bears_on_bench)


def role(check: str) -> str:
    """The role of ``check`` (``"correctness"`` for a name this packcheck does not know: a newer results file)."""
    spec = SPECS.get(check)
    return spec.role if spec else "correctness"


def check_help() -> str:
    """The --packcheck-checks help text: every check with its role, the default set and the training set."""
    return ("Checks to run, comma-separated. Default: " + ", ".join(DEFAULT_CHECKS) + ". Training checks (opt in): "
            + ", ".join(TRAINING_CHECKS) + ". Input variants (opt in): " + ", ".join(VARIANT_CHECKS) + ". Roles: correctness decides a cell; hazards and findings are reported once "
            "per stack. See `packcheck checks`.")


def describe() -> list[tuple[str, str, str, str]]:
    """(name, level, role, summary) of every check, in matrix order: the README table and ``packcheck checks``."""
    return [(s.name, s.level, s.role + (", training" if s.training else ", opt-in" if s.opt_in else ""), s.summary)
            for s in REGISTRY]
