"""Every cause code a check can return: what it means and what to do about it, as data.

A check returns a code with its evidence (``cause="leak", evidence={"isolation_moved": 3.1e-2}``); the diagnosis
(:func:`pytest_packcheck.analysis.diagnose.remedy`) maps the code to a remedy and never reads a message. A cause's
remedy is :attr:`Cause.remedy`, or the first of :attr:`Cause.when` that fits the cell (its backend, its check, a
number it measured). Advice that depends on a library version is not here: it is the remedy of the matching entry
of ``audit/known_faults.toml`` (its version window, its ``fixed_in``), which the diagnosis prefers.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends.table import MASKED_BACKENDS


@dataclass(frozen=True)
class Remedy:
    """A remedy that replaces the cause's own on the cells it fits: every condition given must hold.
    ``backends`` / ``checks`` / ``statuses``: the cell's backend / check / status is one of them (a cause on a
    cell whose status is "pass" is a finding beside the verdict). ``facts``: ``(key, value)`` pairs that the cell's
    metrics or the cause's own evidence hold (``value`` a type: any value of that type). ``fill``: ``text`` names
    numbers of the cell as ``{key}`` (the cause's evidence, else the cell's metrics; floats as ``1.0e-03``), so
    every key it names must be among ``facts``."""

    text: str
    backends: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    facts: tuple[tuple[str, Any], ...] = ()
    statuses: tuple[str, ...] = ()
    fill: bool = False

    @property
    def shown(self) -> str:
        """``text`` as a listing shows it: ``{key}`` fields kept as the names they are, ``{{`` / ``}}`` as braces."""
        return self.text.replace("{{", "{").replace("}}", "}") if self.fill else self.text

    def render(self, cell: dict[str, Any], evidence: dict[str, Any]) -> str:
        """``text``, its ``{key}`` fields filled from ``evidence`` then the cell's metrics when :attr:`fill`."""
        if not self.fill:
            return self.text
        values = {**(cell.get("metrics") or {}), **evidence}
        return self.text.format_map({k: f"{v:.1e}" if isinstance(v, float) else v for k, v in values.items()})

    def fits(self, cell: dict[str, Any], evidence: dict[str, Any]) -> bool:
        if self.backends and cell.get("backend") not in self.backends:
            return False
        if self.checks and cell.get("check") not in self.checks:
            return False
        if self.statuses and cell.get("status") not in self.statuses:
            return False
        metrics = cell.get("metrics") or {}
        return all(_holds(metrics, key, value) or _holds(evidence, key, value) for key, value in self.facts)


def _holds(where: dict[str, Any], key: str, value: Any) -> bool:
    if key not in where:
        return False
    if isinstance(value, type):
        return isinstance(where[key], value)
    return where[key] is value if isinstance(value, bool) else where[key] == value


@dataclass(frozen=True)
class Cause:
    """One cause code: ``meaning`` (what the failure is; ``--help``, the report's legend) and ``remedy`` (one line:
    what to do; "" where packcheck has none to give), refined by ``when`` (the first that fits wins)."""

    code: str
    meaning: str
    remedy: str
    when: tuple[Remedy, ...] = ()

    def remedy_for(self, cell: dict[str, Any], evidence: dict[str, Any] | None = None) -> str:
        """The remedy that fits ``cell`` (a results-document cell; ``evidence``: this cause's own numbers)."""
        return next((r.render(cell, evidence or {}) for r in self.when if r.fits(cell, evidence or {})), self.remedy)


_CAUSES: tuple[Cause, ...] = (
    Cause("leak",
          "examples attend across boundaries (the isolation probe moves)",
          "disable packing for this architecture on this backend",
          when=(Remedy(checks=("cu_seq_lens",), facts=(("standard_row_right", True),), text=(
              "also return position_ids from the collator (DataCollatorWithFlattening(return_position_ids=True)): "
              "eager / sdpa / flex read no cu_seq_lens and find the boundaries where position_ids restart; the "
              "standard packed row (with position_ids) is right on this backend")),
                # the guard's user has no audit cell to look at: the same advice, in terms of the guard's own run
                Remedy(backends=MASKED_BACKENDS, checks=("guard",), text=(
              "do not pack on eager/sdpa/flex for this model; the flash path may keep the boundaries: load the model "
              "with attn_implementation='flash_attention_2' on your GPU and run this guard again (or `packcheck audit` "
              "with flash_attention_2) before training with it packed")),
                Remedy(backends=MASKED_BACKENDS, text=(
              # true whether or not this run measured the reference (trial 20, 125: "see its varlen reference cell"
              # in a run of eager and sdpa only, where no such cell was)
              "do not pack on eager/sdpa/flex for this model; the flash path may keep the boundaries: packcheck's "
              "varlen reference (--packcheck-attn packcheck_flash_ref, the FA2 preparation code on a CPU stand-in "
              "kernel) measures it, and `packcheck lookup <model_type> flash_attention_2 <transformers version>` "
              "gives the atlas's answer; run packcheck with flash_attention_2 on your GPU before training with it packed")),)),
    Cause("wrong_positions",
          "boundaries hold (isolation passes) but positions differ from the per-example runs",
          "check that position_ids restart at each example and reach the model's rotary / position embedding",
          when=(Remedy(facts=(("batch_has_position_ids", False),),
                 text="also return position_ids from the collator (DataCollatorWithFlattening(return_position_ids=True))"),
          Remedy(facts=(("max_abs_diff_start_based_positions", float),),
                 text="set position_ids_start=padding_idx + 1 on DataCollatorWithFlattening"))),
    Cause("loss_normalisation",
          "logits match but the loss differs: labels or the token count used to normalise",
          "compare packed runs with a correctly normalised padded baseline, and count num_items_in_batch after the "
          "shift over the whole accumulation step; keep labels -100 at boundaries"),
    Cause("num_items_ignored",
          "the grad-accum loss is off the per-token reference in the padded run as much as in the packed one (both "
          "equal): the model's own num_items_in_batch handling, not packing",
          "packing changes nothing here; for gradient accumulation with Trainer, set model.accepts_loss_kwargs = False "
          "(Trainer reads it from transformers 4.48.0) so it divides each micro-batch's mean loss by the accumulation "
          "steps, or move to a release where loss_parity has no such finding"),
    Cause("kernel_numerics",
          "differences within 10x the tolerance or the dtype's float rounding, boundaries kept: kernel numerics, not a leak",
          "the boundaries hold: widen the tolerance if this kernel is expected to differ by this much; else report it "
          "to the kernel's maintainers",
          # the numbers say which tolerance fails it (checks.registry.numerics_evidence)
          when=(Remedy(facts=(("below_rounding", True), ("tolerance", str), ("diff", float), ("atol", float),
                              ("rounding_level", float), ("dtype", str)), fill=True, text=(
              "within float rounding ({diff}; {dtype} rounds at {rounding_level}), boundaries kept; the tolerance "
              "{tolerance} = {atol} is below rounding: widen it to at least {diff} (--packcheck-tolerance "
              "{dtype}.{tolerance}=...) to judge packing here")),
                Remedy(facts=(("tolerance", str), ("diff", float), ("atol", float), ("dtype", str)), fill=True, text=(
              "within 10x the tolerance {tolerance} = {atol} ({diff} measured), boundaries kept: widen {tolerance} "
              "(--packcheck-tolerance {dtype}.{tolerance}=...) if this kernel is expected to differ by that much; "
              "else report it to the kernel's maintainers")))),
    Cause("cache_trap",
          "correct only with use_cache=False: a cache disables the packed mask",
          "set use_cache=False (model.config.use_cache = False): TRL's SFTTrainer does, and transformers' Trainer "
          "does from 5.0.0 on (TrainingArguments.use_cache=False; bisected, 4.57.6 does not); a hand-written loop "
          "does not"),
    Cause("mask_override",
          "an attention_mask beside the packed row overrides its boundaries",
          "do not pass attention_mask with packed rows (drop it from the batch)",
          when=(Remedy(checks=("sft", "sft_padding_free", "sft_strategies"), text=(
              "set padding_free=True in SFTConfig so packed rows carry position_ids and no attention_mask; the cell's "
              "row contract says what TRL's collator sent (a TRL release that sends an attention_mask is a known fault, "
              "with its upgrade)")),)),
    Cause("ignores_position_ids",
          "the model ignores position_ids (restarting them changes nothing)",
          "not supported for this architecture: disable packing for it"),
    Cause("no_position_ids",
          "the model's forward takes no position_ids, so a packed row cannot restart positions per example (its "
          "config builds and runs: the model class, not the config)",
          "do not pack this architecture on this release (the atlas names the first release whose forward takes "
          "position_ids), or pack with a collator that keeps examples in separate rows"),
    Cause("needs_inputs",
          "the model's training forward needs inputs a packed text row does not carry (token_type_ids, labels per "
          "codebook, image tokens): its input contract, not its config (model/needs_inputs.py names them)",
          "give the model the inputs it names (e.g. token_type_ids zeros for a text row, as TRL and axolotl do), or "
          "do not pack it as a text-only causal LM"),
    Cause("sliding_window",
          "parity holds for examples shorter than the sliding window and fails above it",
          "use a flash backend (the window is applied per segment), or keep examples shorter than the window"),
    Cause("stateful_layers",
          "state-space / linear-attention / conv layers carry state across examples (attention is isolated)",
          "disable packing for this architecture on this stack (its state carries from one example into the next), "
          "or train on GPU with the kernels that restart state at seq_idx / cu_seq_lens (mamba_ssm and "
          "causal_conv1d with seq_idx, flash-linear-attention with cu_seqlens), fed by a collator that returns "
          "seq_idx (DataCollatorWithFlattening(return_seq_idx=True), TRL's padding-free collator), and check it "
          "here on that stack"),
    Cause("stateful_layers_refused",
          "the model refuses packed rows: its stateful layers cannot keep examples apart here",
          "disable packing for this architecture here; on GPU, the kernels that take seq_idx (mamba_ssm, "
          "causal_conv1d) can keep examples apart"),
    Cause("backend_swap",
          "the requested attention backend is not the one that ran",
          "install the requested backend or request one that runs (see which ran in the backend cell)"),
    Cause("dense_kernel",
          "the flash backend ran its dense (padded) kernel, not the varlen one: the row was attended whole",
          "pass position_ids that restart per example, or cu_seq_lens_q/k, so the varlen kernel runs"),
    Cause("call_count",
          "attention calls counted differ from the attention modules found; parity decides whether it matters",
          "none if isolation and parity pass here: the count reflects attention modules reused or never called; see "
          "the backend cell's counts"),
    Cause("pooled_head",
          "the model's own sequence-classification head pools one position per row: a packed row of N examples gets one "
          "logits row, and N scalar labels do not fit it",
          "pool per segment yourself (the segments where position_ids restart, or cu_seq_lens_q) and apply the classifier "
          "to each pooled embedding, or give sequence classification padded rows"),
    Cause("labels_contract",
          "the collator's labels contract (non-token labels) is broken",
          "use a padding collator for non-token (sequence-classification) labels"),
    Cause("boundary_labels",
          "labels are not -100 at example starts: each example's first token is trained as the previous example's "
          "next token",
          "set labels to -100 at each example's first token (DataCollatorWithFlattening and TRL's padding-free "
          "collator do); a collator of your own must mask them"),
    Cause("collator_contract",
          "the collator's output breaks the packing contract (lengths, positions, cu_seq_lens)",
          "fix the collator's output (see the collate cell), or upgrade transformers"),
    Cause("empty_example",
          "an empty example is neither dropped nor refused: it leaves a zero-length segment or stray labels",
          "drop empty examples before collating (the collator keeps them as a zero-length segment)"),
    Cause("position_layout",
          "the collator's (batch, length) position_ids reach a multimodal-RoPE model that expands them without the "
          "text row its packed mask / flash boundaries are read from: examples attend across",
          "lay the packed row's position_ids out as the model's own get_rope_index and generate() do: (4, batch, "
          "length), the collator's row as the text row and again for temporal / height / width (text-only rows), "
          "e.g. position_ids[None].expand(4, -1, -1); or, on a flash backend, pass cu_seq_lens_q/k "
          "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))"),
    Cause("batch_rows",
          "two packed rows (batch size > 1) without cu_seq_lens lose their boundaries on this backend",
          "pack one row per step (DataCollatorWithFlattening does), or pass cu_seq_lens_q/k with the batch"),
    Cause("packing_content",
          "TRL's packer loses, duplicates or cuts tokens beyond what its strategy documents (a tail packed without "
          "its prompt)",
          "truncate examples to max_length before packing, or use packing_strategy='bfd_split' knowingly; report it "
          "to TRL"),
    Cause("padded_normalisation",
          "the trainer's own padded run divides by the label count before the causal shift (the padded side is "
          "wrong)",
          "the padded baseline is off, not the packed run: compare packed runs with a correctly normalised padded "
          "reference (label tokens counted after the shift, as packcheck's hand-written one is)"),
    Cause("padded_mismatch",
          "the trainer's own padded run differs from the hand-written reference, not by the unshifted label count",
          "the padded baseline is off, not the packed run: see the padded cell's per-step losses; compare packed "
          "runs with a hand-written reference"),
    Cause("completion_mask",
          "prompt tokens keep their labels in the packed row: the completion mask is lost, prompts are trained",
          "mask the prompt labels yourself before packing (set them to -100), or use a TRL whose packer keeps the "
          "completion_mask column; check with the sft cell"),
    Cause("padded_positions",
          "a left-padded batch runs without position_ids: the forward numbers positions over the columns, so each "
          "sample starts at its padding count (learned absolute positions see other positions than generation did)",
          "pass position_ids counted over the real tokens (attention_mask.cumsum(-1) - 1, clamped at 0) with a "
          "left-padded batch, or pack the samples padding-free with position_ids restarting at 0"),
    Cause("tree_packing",
          "a tree-packed row (shared prefixes forwarded once) gives a completion token another log-prob than its "
          "sample alone: a segment sees K/V outside its root-to-segment path, or a target is gathered from the wrong "
          "position",
          "train this model without tree packing (plain padding-free rows), and check the row's tree_kv_index / "
          "tree_cu_seqlens_k and token_index against the trie",
          when=(Remedy(facts=(("attention_sinks_dropped", True),), text=(
              "tree_attention hands the kernel no s_aux, so the model's attention sinks (GPT-OSS) are dropped: train "
              "it without tree packing (AsyncGRPO with plain padding-free rows), or pass module.sinks to the kernel "
              "as s_aux as transformers' flash path does")),)),
    Cause("label_shift",
          "the trainer's completion log-probs match the reference one position off: labels rolled across a sample "
          "boundary, or logits_to_keep off by one",
          "shift the labels within each sample (the last token of a sample predicts nothing; the first completion "
          "token is scored off the last prompt token) and take logits_to_keep = completion length"),
    Cause("temperature_mismatch",
          "the trainer's log-probs match the reference at another sampling temperature: the temperature is applied "
          "on one path only (generation and training, or the policy and the reference model)",
          "divide the logits by the same temperature on every path that computes log-probs (GRPOConfig.temperature "
          "is the generation temperature)"),
    Cause("config_dropped",
          "the trainer was asked to pack (padding_free=True) and its release runs padded: the flag is forced off, "
          "dropped or ignored (the evidence names the file and line)",
          "do not count on the flag at this release: check what the trainer runs (trainer.padding_free after "
          "construction) or use a release that honours it; the padded run is correct, only slower"),
    # stack elements (model/stack.py): each names the cause a check returns when lifting the element fixes the row
    Cause("adapter_positions",
          "a PEFT adapter broke the packed row: rerun with the adapter disabled, the row is right (prompt / p-tuning "
          "drop position_ids with a warning and prepend one set of virtual tokens per row; prefix tuning passes a "
          "cache and shifts position_ids by num_virtual_tokens)",
          "do not pack with this adapter: train it on padded batches, or use LoRA / DoRA, which pass position_ids "
          "through"),
    Cause("stack_mask_dropped",
          "a hook replaced the packed attention mask (accelerate's context-parallel hook: attention_mask=None, "
          "is_causal=True): rerun without the hook, the row is right",
          "do not pack under context parallelism on eager / sdpa / flex; a flash backend keeps the boundaries in "
          "position_ids / cu_seq_lens_q",
          # the flash remedy checked on the hook's own fault (checks/stack.py _flash_remedy, issue 41)
          when=(Remedy(facts=(("flash_keeps_boundaries", False), ("flash_with_element", float)), fill=True, text=(
                    "do not pack under this hook on any backend: it removes the boundaries on the flash path too "
                    "(packcheck's varlen reference with the hook: {flash_with_element}); train on padded batches "
                    "under it, or make the hook pass position_ids / cu_seq_lens_q through to attention")),
                Remedy(facts=(("flash_keeps_boundaries", True), ("flash_with_element", float)), fill=True, text=(
                    "do not pack under context parallelism on eager / sdpa / flex; a flash backend keeps the "
                    "boundaries in position_ids / cu_seq_lens_q (measured with the hook on packcheck's varlen "
                    "reference: {flash_with_element})")))),
    Cause("checkpoint_recompute",
          "gradient checkpointing's recompute did not reproduce the packed forward (the backward saw other kwargs "
          "than the forward): gradients differ, and rerun with checkpointing off they are right",
          "train this model without gradient checkpointing when packing (or with the other use_reentrant), and "
          "report the recompute to the library that wraps the layer"),
    Cause("compile_frozen",
          "the compiled model kept another row's boundaries: a row of the same length but other boundaries is wrong "
          "under torch.compile and right uncompiled",
          "compile with dynamic shapes and without static cu_seq_lens_q / max_length_q (torch.compile(dynamic=True)), "
          "or do not compile the packed forward"),
    Cause("stack_kernel",
          "a fused kernel patch (Liger) changed the packed row: rerun without the patch, the row is right",
          "do not apply the fused kernels to packed rows at this release"),
    Cause("packed_mismatch",
          "the packed run differs from the reference, and no probe in the cell could say why",
          "rerun with the current packcheck: it names the cause",
          when=(Remedy(checks=("guard",), facts=(("trainer_logprobs", True),), text=(
              "the trainer's completion log-probs differ from each sample alone while the model's packed row does "
              "not: compare how the trainer gathers them (labels shifted within each sample, logits_to_keep, the "
              "temperature, the dtype it computes in) with verify_packed_logprobs's reference")),)),
    Cause("probe_inconclusive",
          "the probe could not see a planted leak on this model: its pass would mean nothing",
          "run this model in float32 (the probe is conclusive there) to check isolation",
          # the tolerances, not the dtype, made the probe blind: name them; a float32 cell cannot go to float32
          when=(Remedy(facts=(("tolerances_raised", True), ("raised", str)), fill=True, text=(
              "the tolerances made the probe inconclusive: {raised}; the probe's planted change must clear both, so "
              "lower them back towards the defaults (--packcheck-tolerance / --packcheck-tolerances) for this check "
              "to judge anything")),
                Remedy(facts=(("dtype", "float32"), ("leak_min", float), ("isolation_atol", float)), fill=True, text=(
              "already float32, with leak_min {leak_min} and isolation_atol {isolation_atol} no higher than the defaults: the planted "
              "leak barely moves this model's logits, so the probe cannot judge its isolation; rely on logits_parity "
              "and loss_parity here, or use a config with larger activations (arch:<type>{{key=value}})")))),
    Cause("cross_backend",
          "this backend's per-example (unpacked) logits differ from eager's on the same weights (another window, "
          "softcap or scaling): packed-vs-solo cannot see it, both share it",
          ""),
    Cause("non_causal",
          "a later token changes earlier positions' logits: the backend runs non-causal (bidirectional) attention",
          ""),
    Cause("flash_boundaries",
          "the model's flash path built cu_seq_lens that do not fit the packed row (past its end, or decreasing): "
          "FlashAttention-2 would read outside the row; the reference kernels refuse",
          "do not pack this model on a flash backend at this version (its flash path derives cu_seq_lens that do "
          "not fit the row); use sdpa with position_ids, and report it upstream"),
    Cause("kernel_arguments",
          "the model's flash path handed the varlen kernel arguments its contract refuses or misreads (cu_seqlens "
          "not int32, max_seqlen below the longest segment, a zero-length segment with max_seqlen_q == 1 under GQA; "
          "a tensor max_seqlen, which FlashAttention-4 does not take)",
          "do not run this model on that flash kernel at this transformers version (its flash path builds arguments "
          "the kernel refuses or misreads, see the backend cell's kernel_arguments); pass cu_seq_lens_q/k (int32) "
          "and int max_length_q/k from the collator, and report it upstream",
          # the same code as a finding beside a passing backend cell: only an item FlashAttention-4 refuses and
          # FlashAttention-2 takes (a 0-d tensor max_seqlen; checks.attention)
          when=(Remedy(statuses=("pass",), text=(
              "nothing to change on FlashAttention-2 (it takes this argument: the cell passes); on FlashAttention-4, "
              "which refuses it, pass int max_length_q/k from the collator (DataCollatorWithFlattening("
              "return_flash_attn_kwargs=True)) or check a transformers that passes Python ints")),)),
    Cause("stand_in_differs",
          "the model's or TRL's code branches on the name flash_attention_2, so under packcheck's stand-in it takes "
          "the non-flash side: the cell says nothing about real FA2 (not checked)",
          "check this cell with flash_attention_2 on a GPU (the stand-in cannot take the branch real FA2 takes, see "
          "the evidence's file:line); or upgrade the library that branches to a release that no longer does"),
    Cause("non_finite",
          "a run produced NaN or infinite numbers (gradients, logits): where only the packed run does, a fail; "
          "where the reference does, no comparison is possible",
          "find which run overflows (the evidence names the first tensors): in the packed run only, do not pack "
          "this model on this backend; in the reference, check the model in float32 first"),
    Cause("offset_positions",
          "a row whose examples' position_ids start at k > 0 (a continuation chunk) differs from each example alone "
          "at the same positions, or the model refuses it",
          "pass cu_seq_lens_q/k with offset position_ids (the flash path of 5.24 reads boundaries where "
          "position_ids == 0 otherwise), or restart continuation chunks at 0"),
    Cause("positions_not_restarted",
          "cu_seq_lens without position_ids: boundaries hold but the positions run on across examples (learned "
          "absolute position embeddings see the wrong positions)",
          "also return position_ids (DataCollatorWithFlattening(return_position_ids=True)): learned absolute "
          "positions need them restarted per example"),
    Cause("segment_mask",
          "a segment mask beside the packed row (2-D segment ids, 4-D block-diagonal) does not keep the examples "
          "apart, or the model refuses it",
          "send restarting position_ids and no attention_mask (or cu_seq_lens_q/k on a flash backend) instead of a "
          "segment mask; a 4-D mask only where the backend honours it (see the items)"),
    Cause("single_row",
          "one unpacked example through the flattening collator differs from the dense path (the example alone)",
          "do not route one unpacked example through the packed path on this version: collate it without flash "
          "kwargs"),
    Cause("selection_ties",
          "top-k selection (a sparse-attention indexer) has exact ties at its cut: which tied key is kept depends "
          "on the row, so packed and alone differ without a leak",
          "none for packing itself: tied top-k scores are cut by index, so the selection depends on the row; check "
          "with inputs without ties (or real weights) before blaming packing"),
    Cause("mechanism_not_exercised",
          "a mechanism of the model (top-k selection, chunked attention, ...) is longer than the probe row, so the "
          "row never exercises it: its pass says nothing about it",
          "rerun with a config whose value fits the probe row (arch:<type>{key=value}), or longer "
          "--packcheck-lengths, to exercise it"),
    Cause("crash",
          "the cell crashed (see the exception)",
          "see the exception; report it upstream if it is the library's"),
    Cause("shrunk_crash",
          "the cell crashed in the tiny model packcheck made of the config (random weights): the full-size model "
          "may run; packcheck's shrink is suspect before the library",
          "check the model at full size (a Hub ID, or --packcheck-weights=pretrained) before reporting upstream: "
          "packcheck shrank this one, and a crash only there is packcheck's to fix"),
    Cause("packcheck_error",
          "packcheck's own probe code crashed (no frame of the model or its libraries in the traceback): "
          "packcheck's bug, the check judged nothing; the traceback is in the details",
          "report it to packcheck with the traceback in the details (the model was not judged by this check); the "
          "other checks' numbers stand"),
    Cause("reference_unavailable",
          "the reference the check compares with (padded or solo run) could not be computed or carries no signal "
          "(non-finite, all-zero): not checked, the reason is given",
          "not checked here: compute the reference in float32 or on another backend (the evidence says why this one "
          "could not be)"),
    Cause("shrink_limit",
          "packcheck could not make a tiny model of this config (a limit of packcheck, not of the model)",
          "report it to packcheck (its shrink does not know this config), or run the model at full size"),
    Cause("library_config",
          "the config does not build in transformers itself, shrunk or not (the library's own error)",
          "give the values the config lacks (arch:<type>{key=value} or --packcheck-config key=value), or use a "
          "checkpoint's config; report the default config upstream"),
    Cause("override_config",
          "the config with your own overrides (arch:<type>{key=value}, --packcheck-config) does not build in "
          "transformers while the config without them does, or the model built with them crashes: the override is "
          "suspect first, not the model, the library or packcheck's shrink",
          "fix the override (the message quotes the error: a value transformers refused, or one the packed row "
          "cannot fit, such as n_positions below the row's length); rerun without it to see the model's own verdict"),
    Cause("weights_mismatch",
          "--packcheck-weights=pretrained: the checkpoint's weights match no tensor of the model its config builds "
          "(another model's weights): packcheck refuses to run it on random weights, so nothing was judged",
          "put the model's own weights beside its config.json (or name the right Hub revision), or run "
          "--packcheck-weights=random"),
    Cause("weights_unreadable",
          "--packcheck-weights=pretrained: the checkpoint's weights file cannot be read (corrupt, truncated, or not a "
          "safetensors / torch file): nothing was judged, and it is not the library's fault",
          "re-download or replace the weights file (the message names the error), or run --packcheck-weights=random"),
    Cause("killed",
          "the isolated child running the cell was killed from outside (SIGKILL: the kernel's OOM killer or a `kill -9`), "
          "not a crash of the model or the library: nothing was judged",
          "rerun with --packcheck-resume (a killed cell is not journaled, so it runs again); if it is killed again, "
          "give the run more memory (dmesg names the OOM killer) or run fewer workers (-n 1)"),
    Cause("hang",
          "the cell did not finish within the timeout",
          "raise --packcheck-timeout if the model is just slow; else see the last output"),
    Cause("out_of_memory",
          "the cell ran out of memory",
          "use a smaller model or dtype, or run on a bigger device"),)

#: Every cause by code, in the order above.
CAUSE_RECORDS: dict[str, Cause] = {c.code: c for c in _CAUSES}
#: Code -> meaning: the codes a check may name (the registry validates its rows against it).
CAUSES: dict[str, str] = {c.code: c.meaning for c in _CAUSES}
