"""Every check, described once: what it runs, where, what its verdict means, and what it can find.

The rest of packcheck reads checks from here: the plan (:mod:`runner`), the settings' allowed names and
defaults, the report's headline verdict, key numbers and legend, the gate's tolerances, the diagnosis's cause
codes, bench's warning mark, ``--help`` and the docs' reference pages (docs/hooks.py). Importing this module imports neither
torch nor transformers (the plugin imports it while pytest loads).

Adding a check is 3 files: its function in the family module (``parity.py``: ``check_x(wb) -> CheckResult``), one
:class:`CheckSpec` row in :data:`REGISTRY` here (at its matrix place), and its planted-fault test in
tests/test_checks.py; a new cause code is one more record in :mod:`.causes`. Every other list of checks (the plugin's
items and the counts tests/test_plugin.py asserts, ``--help``, the docs' pages, known_faults.toml's validation) is
read from the row; a default-suite check changes the committed reports' text: ``python tools/rerender.py``.

Roles decide what a verdict means for a matrix cell:

- ``correctness``: the packed row as transformers' Trainer (5.x) and TRL feed it (``DataCollatorWithFlattening``
  output, restarting ``position_ids``, no ``attention_mask``, ``use_cache=False``, one packed row per
  micro-batch) trains the model the same as padding. Only these checks decide the cell's headline: ✅ means
  every one that ran passed.
- ``hazard``: a fact about using the model outside that contract (a cache, an ``attention_mask`` beside the
  packed row), or about the padded baseline packing is compared with (``trainer_padded`` / ``sft_padded``: a
  trainer's own padded run that is itself off says nothing against packing). True and worth saying, once per
  stack; never a model failure.
- ``finding``: a fact about the library stack that does not depend on the model (the collators' contracts,
  TRL's packer). Reported once per environment with the count of models it was measured on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import DTYPE_EPS
from ..results.metrics import VERDICT_METRIC
from .causes import CAUSES

ROLES = {
    "correctness": "decides the cell: padding-free packing, fed as transformers' Trainer and TRL feed it, trains the "
                   "model the same as padding",
    "hazard": "a usage hazard outside that contract (a cache, an attention_mask beside the packed row, a trainer's own "
              "padded run that is itself off as the baseline packing is compared with): reported once per stack, never a "
              "model failure",
    "finding": "a fact of the library stack (collator contract, TRL's packer), independent of the model: reported once per "
               "environment",
}
LEVELS = {"model": "once per model (no attention backend)", "backend": "once per model x attention backend"}

#: A parity difference at most this many times the tolerance, with isolation holding, is kernel numerics.
NUMERICS_FACTOR = 10.0


def rounding_level(dtype: str = "float32", scale: float = 1.0) -> float:
    """The float rounding level of numbers of magnitude ``scale`` in ``dtype`` (a name: "float32", "bfloat16",
    ...): ``eps(dtype) * max(1, |scale|)``; float32's eps for an unknown name."""
    return DTYPE_EPS.get(dtype, DTYPE_EPS["float32"]) * max(1.0, abs(float(scale)))


def within_numerics(diff: float, atol: float, dtype: str = "float32", scale: float = 1.0) -> bool:
    """The numerics rule, audit and guard alike: a difference (isolation holding) is kernel numerics when it is at
    most :data:`NUMERICS_FACTOR` times the larger of the tolerance ``atol`` and the dtype's rounding level at
    ``scale`` (:func:`rounding_level`), so a difference of a few ulps is numerics even under a tolerance of 0.
    False for a NaN ``diff``."""
    return bool(diff <= NUMERICS_FACTOR * max(float(atol or 0.0), rounding_level(dtype, scale)))


def numerics_evidence(tolerance: str, diff: float, atol: float, dtype: str = "float32", scale: float = 1.0) -> dict[str, Any]:
    """The evidence of a ``kernel_numerics`` cause (the remedy names the tolerance key and the measured value from
    it): ``tolerance`` (the key, e.g. "logits_atol"), ``diff`` (measured), ``atol`` (the key's value), ``dtype``,
    ``rounding_level`` (:func:`rounding_level`) and ``below_rounding`` (the tolerance is under it, as a tolerance of
    0 is: the difference is float rounding, and only the tolerance fails it)."""
    floor = rounding_level(dtype, scale)
    return {"tolerance": tolerance, "diff": float(diff), "atol": float(atol or 0.0), "dtype": dtype,
            "rounding_level": floor, "below_rounding": float(atol or 0.0) < floor}


def fixed_by(rerun: float, diff: float, atol: float, dtype: str = "float32", scale: float = 1.0) -> bool:
    """Whether removing a suspect (the cache, an attention_mask, ...) fixes a row, audit and guard alike: the rerun
    without it (difference ``rerun``) is within the tolerance ``atol``, or is numerics by :func:`within_numerics`
    while the row as run (``diff``) is not. So under a tolerance of 0 a rerun a few ulps off still names the
    suspect, and a row off by 3e-1 never passes as numerics. In a low precision the numerics band can hold the row
    as run too (bfloat16 log-probs of magnitude 5: a band of 0.39 around a cache trap of 6.2e-2): there the rerun
    also names the suspect when it brings the row down by :data:`NUMERICS_FACTOR` or more and the row is off by more
    than one rounding level (issue 42: the bf16 guard at a tolerance below bf16 rounding said leak, not the cache
    trap: 6.25e-02 with the cache, 7.15e-04 without). False for a NaN ``rerun``."""
    if rerun <= float(atol or 0.0):
        return True
    if not within_numerics(rerun, atol, dtype, scale):
        return False
    return bool(not within_numerics(diff, atol, dtype, scale)
                or (diff >= NUMERICS_FACTOR * rerun and diff > rounding_level(dtype, scale)))


#: Suites: the set of checks a shipped audit (audit/<suite>.toml) plans; only ``default`` runs when no check is named.
SUITES = {
    "default": "run when no check is named",
    "variants": "input variants beside the standard row: opt in (--packcheck-checks, or --audit variants)",
    "training": "whole Trainer / SFTTrainer runs and TRL's packer: opt in (--packcheck-checks, or --audit training)",
    "rl": "completion log-probs as RL trainers gather them (packed rows, GRPO's padded batch, TRL's own GRPO and "
          "AsyncGRPO code): opt in (--packcheck-checks, or --audit rl)",
    "stack": "the packed row through the stack around the model (PEFT adapters, checkpointing, torch.compile, "
             "accelerate's context-parallel hook, Liger; --packcheck-stack): opt in (--packcheck-checks, or --audit stack)",
    "stack_trainers": "a stack element (PEFT adapter, accelerate's CP hook) through transformers' Trainer and TRL's "
                      "SFTTrainer (packing / padding_free): the trainer's decision and one training step vs each example "
                      "alone: opt in (--packcheck-checks, or --audit stack_trainers)",
    "backend_names": "every attn_implementation name transformers accepts (GPU-only ones with packcheck's CPU reference "
                     "behind the name): what transformers, TRL and accelerate decide by the name, and SFTTrainer's "
                     "padding-free row under it: opt in (--packcheck-checks, or --audit backend_names)",
    "encoders": "encoders and embedding models (encoder: specs): hidden states, pooled embeddings, MLM loss, positions and "
                "classification heads on packed rows vs each example alone: opt in (--packcheck-checks, or --audit encoders)",
    "multimodal": "VLM rows with pixels (two images of different sizes and a text-only sample in one row): isolation, "
                  "text logits and loss vs each sample alone, M-RoPE positions per sample: opt in (--packcheck-checks, "
                  "or --audit multimodal)",
}


class KeyMetric(NamedTuple):
    """The number a check's verdict rests on: its ``metrics`` key and the label the report puts before it."""

    key: str
    label: str


def format_number(value: Any) -> str:
    """A key number as the matrix shows it: floats as ``1.2e-03``, anything else as text."""
    return f"{value:.1e}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class CheckSpec:
    """One check, everything the rest of packcheck needs to know about it.

    ``function``: ``"module:function"`` inside :mod:`pytest_packcheck.checks`, imported on first call.
    ``key_metric``: the number that backs the verdict (the gate compares it, the report shows it);
    ``key_number_format``: ``"module:function"`` of a formatter ``metrics -> str | None`` for a check whose key
    number is not one float (None falls through to the generic rules of :meth:`key_number`); ``tolerance``: the
    tolerances key that bounds the key number (the gate flags a pass whose number grew by more).
    ``bears_on_bench``: the check judges what ``packcheck bench`` times (a packed row, use_cache=False, no
    attention_mask). ``causes``: the codes it can return (:mod:`.causes`). ``suite``: which shipped audit plans
    it (:data:`SUITES`); ``requires``: distributions it needs beyond packcheck's runtime (skipped without them);
    ``gate``: ``audit --gate`` runs it when no check is named (the default suite always). ``skip_backends``:
    backends it is not planned on (cross_backend: eager is its reference)."""

    name: str
    function: str
    level: str
    role: str
    summary: str
    key_metric: KeyMetric | None = None
    #: other metrics keys a fail can rest on (loss_parity: the grad-accum sum's ``ga_delta``): the key number where
    #: one exceeds the cell's ``atol`` and the key metric (cells measured before :data:`VERDICT_METRIC` named it)
    fail_metrics: tuple[str, ...] = ()
    key_number_format: str | None = None
    tolerance: str | None = None
    bears_on_bench: bool = False
    causes: tuple[str, ...] = ()
    suite: str = "default"
    requires: tuple[str, ...] = ()
    gate: bool = False
    skip_backends: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field_name, value, allowed in (("level", self.level, LEVELS), ("role", self.role, ROLES),
                                           ("suite", self.suite, SUITES)):
            if value not in allowed:
                raise ValueError(f"check {self.name}: unknown {field_name} {value!r}. Expected one of: {', '.join(allowed)}.")
        unknown = [c for c in self.causes if c not in CAUSES]
        if unknown:
            raise ValueError(f"check {self.name}: unknown causes {unknown} (add them to checks/causes.py)")

    @property
    def opt_in(self) -> bool:
        """Not run unless named (--packcheck-checks, or its suite's audit)."""
        return self.suite != "default"

    @property
    def training(self) -> bool:
        """A whole Trainer / SFTTrainer run (or TRL's packer)."""
        return self.suite == "training"

    @property
    def shown_by(self) -> tuple[str, ...]:
        """For a hazard check: the causes that mean its hazard showed, i.e. its causes but the parity causes every
        hazard probe shares (those mean the packed row is wrong without the hazard too: the model's own fault,
        counted under its correctness verdict). ``("cache_trap",)`` for cache_trap; empty for other roles."""
        return tuple(c for c in self.causes if c not in _PARITY_CAUSES) if self.role == "hazard" else ()

    def load(self) -> Callable[[Any], Any]:
        return _load(self.function)

    def missing(self) -> tuple[str, ...]:
        """The distributions of :attr:`requires` not installed here (no import: ``importlib.util.find_spec``)."""
        from importlib.util import find_spec

        return tuple(r for r in self.requires if find_spec(r) is None)

    def key_number(self, metrics: dict[str, Any]) -> str:
        """The key number of a cell of this check as the report shows it ("" when there is none): the check's own
        formatter when it has one and it answers; a contract check's items held / checked; else
        ``"<label> <number>"`` of :attr:`key_metric`."""
        if self.key_number_format:
            text = _load(self.key_number_format)(metrics)
            if text is not None:
                return text
        if isinstance(metrics.get("items"), dict):  # a contract check: items held / checked
            held = sum(1 for v in metrics["items"].values() if v.get("status") == "pass")
            return f"{held}/{len(metrics['items'])} items"
        key = self.key_metric_key(metrics)
        if key is not None:
            return f"{self.key_metric.label} {format_number(metrics[key])}"  # type: ignore[union-attr]
        return ""

    def key_metric_key(self, metrics: dict[str, Any]) -> str | None:
        """The metrics key of the key number: :data:`VERDICT_METRIC`'s when the cell names one it holds (the check
        failed on another number than its usual one: logits_parity's ``position_layout`` rests on the collator's
        position_ids, not on the laid-out row that holds), else :attr:`key_metric`'s; None when the cell has neither."""
        if not self.key_metric:
            return None
        named = metrics.get(VERDICT_METRIC)
        if isinstance(named, str) and named in metrics:
            return named
        atol, own = metrics.get("atol"), metrics.get(self.key_metric.key)
        for key in self.fail_metrics:  # the number that is over the tolerance, not the one within it
            value = metrics.get(key)
            if (isinstance(value, float) and isinstance(atol, int | float) and value > atol
                    and not (isinstance(own, int | float) and own >= value)):
                return key
        return self.key_metric.key if self.key_metric.key in metrics else None


def _load(ref: str) -> Callable[..., Any]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(f"pytest_packcheck.checks.{module}"), attr)


#: The causes a check names when lifting the cell's stack element (--packcheck-stack, model/stack.py) fixes the row.
_STACK_CAUSES = ("adapter_positions", "stack_mask_dropped", "checkpoint_recompute", "compile_frozen", "stack_kernel")

_PARITY_CAUSES = ("leak", "stateful_layers", "kernel_numerics", "wrong_positions", "sliding_window", "selection_ties",
                  "probe_inconclusive")

#: The checks in matrix order.
REGISTRY: tuple[CheckSpec, ...] = (
    CheckSpec(name="collate", function="collate:check_collate", level="model", role="finding",
              summary="transformers' DataCollatorWithFlattening contract, item by item: per-token key lengths, position_ids "
                      "restarts, labels -100 at boundaries, cu_seq_lens_q/k int32, max_length_q/k ints, an empty example, "
                      "integer labels",
              causes=("collator_contract", "labels_contract", "wrong_positions", "empty_example")),
    CheckSpec(name="collate_trl", function="collate:check_collate_trl", level="model", role="finding",
              summary="TRL's padding-free collator (pad_to_multiple_of=8), item by item: equal-length per-token keys, "
                      "position_ids restarts, labels -100 at example starts and on the padding",
              causes=("collator_contract",)),
    CheckSpec(name="position_ids", function="parity:check_position_ids", level="backend", role="correctness",
              summary="restarting position_ids must change later examples' logits (the model consumes them)",
              key_metric=KeyMetric("max_change", "Δ"), bears_on_bench=True,
              causes=("ignores_position_ids",)),
    CheckSpec(name="isolation", function="parity:check_isolation", level="backend", role="correctness",
              summary="perturb one example: the others' logits must not move; a planted leak (no boundaries) must move them",
              key_metric=KeyMetric("max_change", "Δ"), tolerance="isolation_atol", bears_on_bench=True,
              causes=("leak", "stateful_layers", "kernel_numerics", "probe_inconclusive", *_STACK_CAUSES)),
    CheckSpec(name="logits_parity", function="parity:check_logits_parity", level="backend", role="correctness",
              summary="packed logits = each example run alone (padded batches reported beside)",
              key_metric=KeyMetric("max_abs_diff_solo", "Δ"), tolerance="logits_atol", bears_on_bench=True,
              causes=(*_PARITY_CAUSES, "batch_rows", "position_layout", "mechanism_not_exercised", *_STACK_CAUSES)),
    CheckSpec(name="loss_parity", function="parity:check_loss_parity", level="backend", role="correctness",
              summary="token-mean loss and gradient-accumulation sum loss (num_items_in_batch) = the per-example reference",
              key_metric=KeyMetric("loss_delta", "Δ"), fail_metrics=("ga_delta",), tolerance="loss_atol", bears_on_bench=True,
              causes=(*_PARITY_CAUSES, "loss_normalisation", "num_items_ignored", "reference_unavailable", *_STACK_CAUSES)),
    CheckSpec(name="grad_parity", function="parity:check_grad_parity", level="backend", role="correctness",
              summary="every parameter's gradient, packed vs right-padded: relative error, worst tensor, cosine",
              key_metric=KeyMetric("grad_rel_err", "rel"), tolerance="grad_rel_err", bears_on_bench=True,
              causes=(*_PARITY_CAUSES, "loss_normalisation", "non_finite", "reference_unavailable", *_STACK_CAUSES)),
    CheckSpec(name="backend", function="attention:check_backend", level="backend", role="correctness",
              summary="the requested attn_implementation ran: one call per attention layer, packed boundaries reached, "
                      "flash backends on the varlen kernel only",
              key_number_format="attention:key_number", bears_on_bench=True,
              causes=("backend_swap", "leak", "dense_kernel", "call_count", "kernel_arguments")),
    CheckSpec(name="cross_backend", function="attention:check_cross_backend", level="backend", role="correctness",
              summary="each example alone on this backend = on eager with the same weights, incl. lengths around the sliding window",
              key_metric=KeyMetric("max_abs_diff_vs_eager", "Δ eager"), tolerance="logits_atol", bears_on_bench=True,
              causes=("cross_backend", "sliding_window", "kernel_numerics"),
              skip_backends=("eager",)),
    CheckSpec(name="causality", function="parity:check_causality", level="backend", role="correctness",
              summary="perturb each example's last token: no earlier position's logits may move (causal attention)",
              key_metric=KeyMetric("max_change_earlier", "Δ"), tolerance="isolation_atol", bears_on_bench=True,
              causes=("non_causal", "probe_inconclusive")),
    CheckSpec(name="edge_lengths", function="parity:check_edge_lengths", level="backend", role="correctness",
              summary="rows of edge lengths (one-token examples, two adjacent; one at the sliding window; one much longer) = "
                      "each example alone, logits and loss",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol", bears_on_bench=True,
              causes=(*_PARITY_CAUSES, "loss_normalisation")),
    CheckSpec(name="single_row", function="variants:check_single_row", level="backend", role="correctness",
              summary="one example, unpacked, through DataCollatorWithFlattening (position_ids; with cu_seq_lens_q/k) = the "
                      "dense path (the example alone)",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol", bears_on_bench=True,
              causes=("single_row",)),
    CheckSpec(name="cache_trap", function="traps:check_cache_trap", level="backend", role="hazard",
              summary="the packed row called with use_cache left as configured (a hand-written loop): a cache disables the "
                      "packed mask on eager / sdpa / flex",
              key_metric=KeyMetric("max_abs_diff_default", "Δ"), tolerance="logits_atol",
              causes=("cache_trap", *_PARITY_CAUSES)),
    CheckSpec(name="mask_trap", function="traps:check_mask_trap", level="backend", role="hazard",
              summary="an all-ones attention_mask beside the packed row (a padding collator's habit) overrides the boundaries",
              key_metric=KeyMetric("max_abs_diff_with_mask", "Δ"), tolerance="logits_atol",
              causes=("mask_override", *_PARITY_CAUSES)),
    CheckSpec(name="offset_positions", function="variants:check_offset_positions", level="backend", role="hazard",
              summary="a continuation row: position_ids start at 10, 0, 3 (never 0 in the first example), without and with "
                      "cu_seq_lens_q/k, vs each example alone at the same positions",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("offset_positions", *_PARITY_CAUSES),
              suite="variants"),
    CheckSpec(name="cu_seq_lens", function="variants:check_cu_seq_lens", level="backend", role="hazard",
              summary="cu_seq_lens_q/k without position_ids (DataCollatorWithFlattening(return_flash_attn_kwargs=True, "
                      "return_position_ids=False)) vs each example alone; the collator's cu_seq_lens = its position_ids "
                      "restarts; which one a backend follows when they disagree",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("positions_not_restarted", "collator_contract", *_PARITY_CAUSES),
              suite="variants"),
    CheckSpec(name="segment_masks", function="variants:check_segment_masks", level="backend", role="hazard",
              summary="a 2-D integer segment-id mask (1,1,2,2,3,...) and a 4-D bool block-diagonal mask beside the packed row "
                      "vs each example alone",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("segment_mask", *_PARITY_CAUSES),
              suite="variants"),
    CheckSpec(name="row_order", function="stack:check_row_order", level="backend", role="correctness",
              summary="the packed row, then the same examples in another order (one row length, other boundaries): each "
                      "example = alone in both (a compiled graph or hook keyed by the row's shape keeps the first's)",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, *_STACK_CAUSES), suite="stack"),
    CheckSpec(name="stack_trainers", function="stack_trainers:check_stack_trainers", level="backend", role="correctness",
              summary="the cell's stack element through Trainer + DataCollatorWithFlattening and SFTTrainer (packing=True; "
                      "padding_free=True): the trainer's decision (file:line) and one training step's loss, gradients and "
                      "logits vs each example of its batch alone",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("adapter_positions", "stack_mask_dropped", "leak", "loss_normalisation"),
              suite="stack_trainers", requires=("trl", "peft")),
    CheckSpec(name="cp_ranks", function="stack_ranks:check_cp_ranks", level="backend", role="correctness",
              summary="accelerate's context parallelism on two gloo ranks (CPU): the CP hook, Trainer's CP buffers sharded "
                      "by torch's context_parallel (position_ids with the row), the forward where it runs (CUDA SDPA "
                      "kernels only: on CPU a skip naming it), and Ulysses' need for deepspeed",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("wrong_positions", "stack_mask_dropped"), suite="stack_trainers", requires=("accelerate",)),
    CheckSpec(name="backend_names", function="backend_names:check_backend_names", level="model", role="correctness",
              summary="every attn_implementation name transformers accepts, GPU-only ones on packcheck's CPU reference: "
                      "flash path or mask path, SFTTrainer's padding_free and position_ids, Trainer's CP and accelerate's "
                      "Ulysses decisions (file:line), and the padding-free row vs each example alone",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("leak", "mask_override"), suite="backend_names", requires=("trl",)),
    CheckSpec(name="trainer", function="training:check_trainer", level="backend", role="correctness",
              summary="transformers' Trainer + DataCollatorWithFlattening, 3 SGD steps vs a hand-written padded reference; "
                      "gradient accumulation's num_items_in_batch",
              key_metric=KeyMetric("max_loss_delta", "loss Δ"), tolerance="train_loss_atol",
              causes=("cache_trap", "loss_normalisation", "leak", "stateful_layers", "packed_mismatch", "padded_normalisation"),
              suite="training", gate=True),
    CheckSpec(name="trainer_padded", function="training:check_trainer_padded", level="backend", role="hazard",
              summary="transformers' Trainer's own padded run (a padding collator), 3 SGD steps vs the hand-written padded "
                      "reference: the padded side's verdict (its label count before the shift)",
              key_metric=KeyMetric("max_loss_delta", "loss Δ"), tolerance="train_loss_atol",
              causes=("padded_normalisation", "padded_mismatch"),
              suite="training", gate=True),
    CheckSpec(name="sft", function="sft:check_sft", level="backend", role="correctness",
              summary="TRL's SFTTrainer(packing=True) as configured by default, every probe on its own: effective configuration, "
                      "first-batch row contract, the trainer's first-batch loss, 3 steps vs padded, gradient checkpointing, "
                      "completion-only labels",
              key_metric=KeyMetric("loss_delta", "loss Δ"), tolerance="train_loss_atol",
              causes=("completion_mask", "mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              suite="training", requires=("trl",), gate=True),
    CheckSpec(name="sft_padded", function="sft:check_sft_padded", level="backend", role="hazard",
              summary="TRL's SFTTrainer's own padded run (packing=False), 3 steps vs the hand-written padded reference: the "
                      "padded side's verdict",
              key_metric=KeyMetric("max_loss_delta", "loss Δ"), tolerance="train_loss_atol",
              causes=("padded_normalisation", "padded_mismatch"),
              suite="training", requires=("trl",), gate=True),
    CheckSpec(name="sft_padding_free", function="sft:check_sft_padding_free", level="backend", role="correctness",
              summary="TRL's SFTTrainer(packing=False, padding_free=True) vs padded: row contract, first-batch loss, 3 steps",
              key_metric=KeyMetric("loss_delta", "loss Δ"), tolerance="train_loss_atol",
              causes=("mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              suite="training", requires=("trl",)),
    CheckSpec(name="sft_strategies", function="sft:check_sft_strategies", level="backend", role="correctness",
              summary="TRL's SFTTrainer(packing=True) per packing_strategy (bfd, bfd_split; wrapped shown, not judged) vs padded",
              key_number_format="sft:key_number_strategies", tolerance="train_loss_atol",
              causes=("mask_override", "collator_contract", "boundary_labels", *_PARITY_CAUSES, "loss_normalisation", "packed_mismatch"),
              suite="training", requires=("trl",)),
    CheckSpec(name="packing_content", function="packing:check_packing_content", level="model", role="finding",
              summary="token accounting of TRL's pack_dataset per strategy: lost, duplicated, tails packed without their prompt",
              key_number_format="packing:key_number",
              causes=("packing_content",),
              suite="training", requires=("trl",)),
    CheckSpec(name="rl_logprobs", function="rl:check_rl_logprobs", level="backend", role="correctness",
              summary="completion log-probs and entropies (nats, at a sampling temperature) from one padding-free row of "
                      "RL samples, gathered per segment = each sample alone (verl's remove-padding, OpenRLHF's packed samples)",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "non_finite"), suite="rl"),
    CheckSpec(name="rl_padded", function="rl:check_rl_padded", level="backend", role="hazard",
              summary="GRPO's left-padded batch as GRPOTrainer calls the model (no position_ids): completion log-probs = "
                      "each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=("padded_positions", *_PARITY_CAUSES, "non_finite"), suite="rl"),
    CheckSpec(name="rl_trl_grpo", function="rl:check_rl_trl_grpo", level="backend", role="correctness",
              summary="TRL's own GRPO log-prob path (_get_per_token_logps_and_entropies, fused LM head, logits_to_keep) = "
                      "each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=("padded_positions", *_PARITY_CAUSES, "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trl_rloo", function="rl:check_rl_trl_rloo", level="backend", role="correctness",
              summary="TRL's own RLOO log-prob path (RLOOTrainer's _get_per_token_logps_and_entropies, fused LM head, "
                      "logits_to_keep) = each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=("padded_positions", *_PARITY_CAUSES, "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trl_tree", function="rl:check_rl_trl_tree", level="model", role="finding",
              summary="TRL AsyncGRPO's tree packing (TreeRow, tree_attention on an exact CPU kernel, log_probs[token_index]) "
                      "= each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=("tree_packing", "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trl_async", function="rl:check_rl_trl_async", level="backend", role="correctness",
              summary="TRL AsyncGRPO's padding-free row (DataCollatorForRollout, compute_loss's forward through TRL's LM "
                      "head) = each sample alone; trl 1.7 to 1.15 (earlier: padded; 1.16: trees, rl_trl_tree)",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trainer_config", function="rl:check_rl_trainer_config", level="model", role="finding",
              summary="what TRL's preference trainers run when asked to pack: DPOTrainer(padding_free=True) keeps it, or "
                      "the file and line that turns it off",
              causes=("config_dropped", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trl_dpo", function="rl_trainers:check_rl_trl_dpo", level="backend", role="correctness",
              summary="TRL's own DPO forward and reduction (DPOTrainer._compute_loss on its concatenated chosen / rejected "
                      "batch): per-sequence log-prob sums and the margin = each sequence alone, the loss at the reference ln 2",
              key_metric=KeyMetric("max_abs_margin_diff", "Δmargin"), tolerance="logits_atol",
              causes=("packed_mismatch", "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_trl_kto", function="rl_trainers:check_rl_trl_kto", level="backend", role="correctness",
              summary="TRL's own KTO forward and reduction (KTOTrainer._compute_loss, apo_zero_unpaired): per-sequence "
                      "log-prob sums = each sequence alone, the loss at the reference 0.5",
              key_metric=KeyMetric("max_abs_margin_diff", "Δmargin"), tolerance="logits_atol",
              causes=("packed_mismatch", "non_finite", "crash"), suite="rl", requires=("trl",)),
    CheckSpec(name="rl_preference_packed", function="rl_trainers:check_rl_preference_packed", level="backend",
              role="correctness",
              summary="preference pairs in one padding-free row (cu_seq_lens_q), reduced per segment: sums, per-sequence "
                      "means and the margin = each sequence alone, the DPO loss at the reference ln 2",
              key_metric=KeyMetric("max_abs_margin_diff", "Δmargin"), tolerance="logits_atol",
              causes=("collator_contract", "loss_normalisation", "leak", "non_finite"), suite="rl"),
    CheckSpec(name="rl_verl_rmpad", function="rl_trainers:check_rl_verl_rmpad", level="backend", role="correctness",
              summary="verl's remove-padding path with verl's own functions (unpad_input, labels rolled, "
                      "logprobs_from_logits, pad_input, response slice) = each sample alone; a skip names what verl needs",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_openrlhf_packed", function="rl_trainers:check_rl_openrlhf_packed", level="backend",
              role="correctness",
              summary="OpenRLHF's own Actor.forward with packing_samples (unpad_and_slice_tensor, rolled labels, "
                      "log_probs_from_logits, gather_and_pad_tensor) = each sample alone; stand-ins for flash_attn's "
                      "bert_padding and deepspeed named in the cell; a skip names what is still missing",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_swift_padding_free", function="rl_trainers:check_rl_swift_padding_free", level="backend",
              role="correctness",
              summary="ms-swift's own padding-free DPO (concatenated_forward: one row, labels rolled, get_cu_seqlens, "
                      "_packed_sequence_sum): sums and the margin = each sequence alone, the loss at ln 2; modelscope "
                      "stubbed, named; a skip names what still does not import",
              key_metric=KeyMetric("max_abs_margin_diff", "Δmargin"), tolerance="logits_atol",
              causes=("packed_mismatch", "collator_contract", "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_unsloth_grpo_packed", function="rl_packers:check_rl_unsloth_grpo_packed", level="backend",
              role="correctness",
              summary="unsloth's GRPO sequence packing, its own block from the release (flatten, position_ids per row, "
                      "unsloth_zoo's chunked_selective_log_softmax, scatter back) = each sample alone; its runtime "
                      "verifier's number and thresholds beside it; a skip names the package where unsloth is missing",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_prime_rl_packed", function="rl_packers:check_rl_prime_rl_packed", level="backend",
              role="correctness",
              summary="prime-rl's packed micro-batch (its packed_samples_into_micro_bs / pad_micro_batch) and its "
                      "trainer's log-prob path (shift_tensor_left, selective_log_softmax, shift_tensor_right, split by "
                      "sequence_lengths), vendored verbatim = each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "collator_contract", "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_open_instruct_grpo", function="rl_packers:check_rl_open_instruct_grpo", level="backend",
              role="correctness",
              summary="open-instruct's packed GRPO (pack_sequences, compute_logprobs / forward_for_logprobs), vendored "
                      "verbatim = each sample alone",
              key_metric=KeyMetric("max_abs_logprob_diff", "Δlogp"), tolerance="logits_atol",
              causes=(*_PARITY_CAUSES, "collator_contract", "non_finite", "crash"), suite="rl"),
    CheckSpec(name="rl_open_instruct_dpo", function="rl_packers:check_rl_open_instruct_dpo", level="backend",
              role="correctness",
              summary="open-instruct's packed DPO (TensorDataCollatorWithFlatteningDPO with max_seq_length, "
                      "concatenated_forward, get_batch_logps), vendored verbatim: sums and the margin = each sequence "
                      "alone, the loss at ln 2; the segments cu_seq_lens_k gives the model",
              key_metric=KeyMetric("max_abs_margin_diff", "Δmargin"), tolerance="logits_atol",
              causes=("collator_contract", "leak", "non_finite", "crash"), suite="rl"),
    CheckSpec(name="encoder_isolation", function="encoders:check_encoder_isolation", level="backend", role="correctness",
              summary="an encoder's packed row: perturb one example at a time, the others' last hidden states and pooled "
                      "embeddings (mean / CLS / last token) must not move",
              key_metric=KeyMetric("max_change", "Δ"), tolerance="isolation_atol",
              causes=("leak", "kernel_numerics", "probe_inconclusive"), suite="encoders"),
    CheckSpec(name="encoder_parity", function="encoders:check_encoder_parity", level="backend", role="correctness",
              summary="an encoder's last hidden states on the packed row = each example alone",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("leak", "kernel_numerics", "wrong_positions", "probe_inconclusive"), suite="encoders"),
    CheckSpec(name="encoder_pooling", function="encoders:check_encoder_pooling", level="backend", role="correctness",
              summary="embeddings pooled per segment (mean / CLS / last token; segments where position_ids restart, and "
                      "cu_seq_lens_q) = the same pooling of each example alone",
              key_metric=KeyMetric("max_abs_diff_pooled", "Δ"), tolerance="logits_atol",
              causes=("collator_contract", "leak", "kernel_numerics", "wrong_positions", "probe_inconclusive"),
              suite="encoders"),
    CheckSpec(name="encoder_mlm_loss", function="encoders:check_encoder_mlm_loss", level="backend", role="correctness",
              summary="the masked-LM loss of the packed row (15% of each example masked) = the mean over the masked "
                      "tokens of each example alone",
              key_metric=KeyMetric("loss_delta", "Δ"), tolerance="loss_atol",
              causes=("leak", "kernel_numerics", "wrong_positions", "probe_inconclusive", "loss_normalisation"),
              suite="encoders"),
    CheckSpec(name="encoder_positions", function="encoders:check_encoder_positions", level="backend", role="correctness",
              summary="the packed row numbers each example as the model numbers it alone (BERT from 0; RoBERTa-likes "
                      "from padding_idx + 1)",
              key_metric=KeyMetric("max_abs_diff_numbering", "Δ"), tolerance="logits_atol",
              causes=("wrong_positions",), suite="encoders"),
    CheckSpec(name="encoder_token_cls", function="encoders:check_encoder_token_cls", level="backend", role="correctness",
              summary="a token-classification head on the packed row: logits and loss (labels per token) = each "
                      "example alone",
              key_metric=KeyMetric("max_abs_diff", "Δ"), fail_metrics=("loss_delta",), tolerance="logits_atol",
              causes=("leak", "kernel_numerics", "wrong_positions", "probe_inconclusive"), suite="encoders"),
    CheckSpec(name="encoder_seq_cls", function="encoders:check_encoder_seq_cls", level="model", role="finding",
              summary="sequence classification on a packed row: the model's own head pools one position per row (logits "
                      "rows vs examples), and DataCollatorWithFlattening on scalar labels",
              causes=("pooled_head", "labels_contract"), suite="encoders"),
    CheckSpec(name="mm_isolation", function="pixels:check_mm_isolation", level="backend", role="correctness",
              summary="a VLM row with pixels: perturb one sample's pixels (or the text-only sample's tokens), the later "
                      "samples' text logits must not move",
              key_metric=KeyMetric("max_change", "Δ"), tolerance="isolation_atol",
              causes=("leak", "kernel_numerics"), suite="multimodal"),
    CheckSpec(name="mm_parity", function="pixels:check_mm_parity", level="backend", role="correctness",
              summary="a VLM row with pixels: text-token logits and the loss = each sample alone with its own pixels",
              key_metric=KeyMetric("max_abs_diff", "Δ"), fail_metrics=("loss_delta",), tolerance="logits_atol",
              causes=("leak", "kernel_numerics", "wrong_positions", "non_causal", "packed_mismatch"), suite="multimodal"),
    CheckSpec(name="mm_positions", function="pixels:check_mm_positions", level="backend", role="correctness",
              summary="a VLM row's M-RoPE position_ids per sub-sequence = the model's own get_rope_index of that sample "
                      "alone (and its text row restarts per sample)",
              key_metric=KeyMetric("tokens_misplaced", "n"), causes=("wrong_positions",), suite="multimodal"),
    CheckSpec(name="mm_videos", function="pixels:check_mm_videos", level="backend", role="correctness",
              summary="a VLM row with a video (pixel_values_videos, video_grid_thw) beside a text-only and an image "
                      "sample: isolation, text logits and loss vs each sample alone, M-RoPE positions per sample",
              key_metric=KeyMetric("max_abs_diff", "Δ"), tolerance="logits_atol",
              causes=("leak", "wrong_positions", "kernel_numerics"), suite="multimodal"),
    CheckSpec(name="mm_layouts", function="pixels:check_mm_layouts", level="backend", role="finding",
              summary="which position_ids layouts of a VLM pixel row hold on this backend (text row + M-RoPE, M-RoPE "
                      "alone, the text collator's flat row): isolation, parity and loss of each",
              causes=("leak", "wrong_positions", "non_causal", "packed_mismatch", "flash_boundaries", "kernel_arguments"),
              suite="multimodal"),
    CheckSpec(name="mm_processor", function="pixels:check_mm_processor", level="backend", role="finding",
              summary="the family's processor (built from local files) makes the pixel samples and transformers' "
                      "DataCollatorWithFlattening packs them (as it is, plus the pixels, plus flash kwargs): which hold",
              causes=("collator_contract", "leak", "wrong_positions", "non_causal", "packed_mismatch", "flash_boundaries",
                      "kernel_arguments"), suite="multimodal"),
)

SPECS: dict[str, CheckSpec] = {s.name: s for s in REGISTRY}
CHECKS: tuple[str, ...] = tuple(SPECS)
#: Checks that run once per model, with no backend.
MODEL_LEVEL_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.level == "model")
#: Whole Trainer / SFTTrainer runs (and TRL's packer): opt in with --packcheck-checks or audit/training.toml.
TRAINING_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.suite == "training")
#: Input variants beside the standard row (offset positions, cu_seq_lens without position_ids, segment masks):
#: opt in with --packcheck-checks or audit/variants.toml.
VARIANT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.suite == "variants")
#: Checks run when none are named: all but :data:`TRAINING_CHECKS` and :data:`VARIANT_CHECKS`.
DEFAULT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.suite == "default")
#: Checks that bear on what bench computes (a packed row, use_cache=False, no attention_mask).
BENCH_RELEVANT_CHECKS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.bears_on_bench)


def role(check: str) -> str:
    """The role of ``check`` (``"correctness"`` for a name this packcheck does not know: a newer results file)."""
    spec = SPECS.get(check)
    return spec.role if spec else "correctness"


def gate_checks() -> tuple[str, ...]:
    """The checks ``audit --gate`` runs when none are named: the default suite, then the rows marked ``gate``
    whose requirements are installed here (the Trainer's packed and padded runs; the SFTTrainer's where TRL is)."""
    return (*DEFAULT_CHECKS, *(s.name for s in REGISTRY if s.gate and s.suite != "default" and not s.missing()))


def suite_checks(suite: str) -> tuple[str, ...]:
    """The checks of one suite (:data:`SUITES`), in matrix order."""
    return tuple(s.name for s in REGISTRY if s.suite == suite)


def check_help() -> str:
    """The --packcheck-checks help text: the default set, then each opt-in suite's checks (:data:`SUITES`: a new
    suite is listed with no edit here)."""
    opt_in = " ".join(f"{suite.capitalize()} checks (opt in, or --audit {suite}): {', '.join(suite_checks(suite))}."
                      for suite in SUITES if suite != "default" and suite_checks(suite))
    return (f"Checks to run, comma-separated. Default: {', '.join(DEFAULT_CHECKS)}. {opt_in} Roles: correctness decides "
            "a cell; hazards and findings are reported once per stack. See `packcheck checks`.")


def describe() -> list[tuple[str, str, str, str]]:
    """(name, level, role, summary) of every check, in matrix order: the docs' check table and ``packcheck checks``."""
    return [(s.name, s.level, s.role + (", training" if s.training else ", opt-in" if s.opt_in else ""), s.summary)
            for s in REGISTRY]
