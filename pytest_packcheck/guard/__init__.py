"""Check the user's own run: the first packed batch of a training run, measured on the user's model.

The audit answers "does packing work for this architecture at these versions" on tiny random models; this
module answers it for one run: the user's checkpoint, collator, device and stack. Three entry points share
:func:`verify_packed_batch`:

- :class:`PackcheckCallback`, a ``transformers.TrainerCallback`` for ``Trainer`` / TRL's ``SFTTrainer``: a
  forward pre-hook sees the first training batch exactly as the trainer feeds it (after its collator and
  device placement), runs the probes before the first optimizer step, removes itself, and raises, warns or
  falls back by policy;
- :func:`verify_packed_batch` for hand-written and accelerate loops;
- the ``packcheck_verify`` pytest fixture (``plugin.py``) for users' own test suites.

The probes: the batch contract (:func:`parse_row`: each broken item fails the batch with a cause code and a
remedy, and the numbers are still measured); the packed row run as the loop runs it (its use_cache,
attention_mask, autocast, attn_implementation; TRL's fused LM head when the trainer asks for it) and each
labelled example alone from its true positions, in eval mode under ``torch.no_grad`` with the RNG state
restored; per-token log-probs of the labelled tokens and their mean loss compared with the tolerance row of
the dtype the forward computes in (:class:`_ComputeProbe`: autocast read inside the forward, bf16 / fp16
weights, the LM head's output; ``audit/tolerances.toml``: ``logits_atol``, ``loss_atol``); attention calls
counted per backend. A mismatch is rerun with each suspect removed (no attention_mask, use_cache=False, M-RoPE
layout, plain position_ids), then an isolation probe separates ``leak`` from ``wrong_positions`` and a float32
rerun decides the numerics band, with the cause codes and remedies of :mod:`pytest_packcheck.analysis.diagnose`. A batch
of packed rows is judged on its own forward, every row's examples in one set of padded batches, and row by row and
together (``batch_rows``) where that is not a clean pass. An encoder or embedding model (BERT, RoBERTa, ModernBERT as
``AutoModel`` or ``AutoModelForMaskedLM``) is judged on its outputs (:mod:`.encoder`); a VLM row with ``pixel_values`` on its
text log-probs against each sample alone with its own pixels, and its M-RoPE positions per sample (:mod:`.pixels`).

Modules, in the order a batch meets them: :mod:`.batch` (the batch contract, :func:`parse_row`), :mod:`.encoder` (encoders: what they output), :mod:`.precision`
(the tolerance row: the dtype the forward computes in), :mod:`.forward` (the packed row, each example alone, the
comparison), :mod:`.diagnosis` (the reruns that name the cause), :mod:`.verify` (:func:`verify_packed_batch`, the
probes in order, the remedy), :mod:`.result` (:class:`GuardResult`, the errors and warning), :mod:`.callback`
(:class:`PackcheckCallback`), and for RL loops :mod:`.rl` (:func:`verify_packed_logprobs` on a packed RL row and
the trainer's completion log-probs; :func:`guard_grpo` inside TRL's GRPOTrainer).
"""

from __future__ import annotations

from .batch import CONTRACT_REMEDIES, IGNORE_INDEX, TOKEN_KEYS, packed_rows, parse_row, unpack_row
from .callback import FALLBACKS, PADDING_FALLBACK, POLICIES, RESULT_FILE, PackcheckCallback, print_line
from .result import GuardResult, NotPackedError, PackcheckGuardWarning, PackedBatchMismatch
from .rl import LOSS_TYPES, RLGuardResult, guard_grpo, verify_packed_logprobs
from .verify import verify_packed_batch

__all__ = [
    "CONTRACT_REMEDIES",
    "FALLBACKS",
    "IGNORE_INDEX",
    "LOSS_TYPES",
    "PADDING_FALLBACK",
    "POLICIES",
    "RESULT_FILE",
    "TOKEN_KEYS",
    "GuardResult",
    "NotPackedError",
    "PackcheckCallback",
    "PackcheckGuardWarning",
    "PackedBatchMismatch",
    "RLGuardResult",
    "guard_grpo",
    "packed_rows",
    "parse_row",
    "print_line",
    "unpack_row",
    "verify_packed_batch",
    "verify_packed_logprobs",
]
