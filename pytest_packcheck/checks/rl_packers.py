"""unsloth's GRPO sequence packing, prime-rl's packed micro-batches and open-instruct's packed GRPO / DPO (issue 44).

Three more trainers that pack RL batches by default, their own code run on the cell's model on CPU against each
sample alone (:func:`.rl.alone`, the one reference), in nats per token and per sequence, as :mod:`.rl_trainers`
does for verl / OpenRLHF / ms-swift:

- ``rl_unsloth_grpo_packed``: unsloth's GRPO sequence packing (on by default, ``UNSLOTH_GRPO_SEQ_PACKING``): the
  block of its ``_get_per_token_logps_and_entropies`` that flattens the left-packed rows into one row, numbers
  ``position_ids`` per row, gathers the completion log-probs with unsloth_zoo's ``chunked_selective_log_softmax`` and
  scatters them back to ``[rows, logits_to_keep]``; then unsloth's own runtime verifier (packed against its per-row
  forward) and its thresholds (accept below 0.7 nats, disable packing at 1.5), read from the release. The block is
  cut out of ``unsloth/models/rl_replacements.py`` (the release's file, found without importing unsloth, whose
  ``__init__`` refuses without a GPU) and executed; unsloth_zoo's module is imported without its package
  ``__init__``. Its shared-prefix grouping (PrefixGrouper) is not run: it needs unsloth's patched model forwards to
  carry ``prefix_seg_info`` into a ``torch.compile``d FlexAttention kernel (a CUDA GPU); the cell says so.
- ``rl_prime_rl_packed``: prime-rl (always packed): its ``packed_samples_into_micro_bs`` / ``_materialize_bin`` /
  ``pad_micro_batch`` build the micro-batch (``position_ids`` restarting, ``seq_lens``, padding to a multiple), then
  the trainer's order (``train.py:379-447``): labels ``shift_tensor_left`` over the whole row, logits divided by the
  per-token temperatures, ``selective_log_softmax``, ``compute_entropy``, ``shift_tensor_right``, split by
  ``sequence_lengths``, the completion read through ``loss_mask``.
- ``rl_open_instruct_grpo``: open-instruct's ``pack_sequences`` and ``compute_logprobs`` / ``forward_for_logprobs``
  (labels shifted over the packed row, ``response_masks`` select each sample's completion).
- ``rl_open_instruct_dpo``: open-instruct's ``TensorDataCollatorWithFlatteningDPO`` (with ``max_seq_length`` as
  ``dpo.py`` passes it with ``--packing``) and ``concatenated_forward(packing=True)``: chosen then rejected in one
  row, ``cu_seq_lens_q/k`` and ``position_ids`` to the model, ``get_batch_logps`` reducing per segment.

prime-rl and open-instruct are not on PyPI: the functions are vendored verbatim (``vendor/*.py.txt``, Apache-2.0,
the repository, commit and source lines in each file's header; ``tools/vendor_rl_sources.py`` rebuilds them) and
checked against their sha256 on load.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import itertools
import math
import os
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

from ..results import CheckResult
from .rl import RLSample, _model_copy, alone, rl_samples
from .workbench import Workbench

VENDOR = Path(__file__).with_name("vendor")

#: The vendored sources: trainer -> (file under vendor/, its sha256, repository, commit).
VENDORED = {
    "prime-rl": ("prime_rl_559b447.py.txt", "3d7404ce9afa509d9c1877d784684d8bc7d9816c62b38c5cc590c980ee09a31a",
                 "https://github.com/PrimeIntellect-ai/prime-rl", "559b44772e471d1538537b8805cc77f3824a5e64"),
    "open-instruct": ("open_instruct_e6c3044.py.txt", "4bf050d3c1d26aa6bf12d218652f5a38d5147725c5ae5dbd155c83ddc1e6344b",
                      "https://github.com/allenai/open-instruct", "e6c3044aa6201c8bfa4573c1b03142af599e730d"),
}
_LOADED: dict[str, tuple[dict[str, Any], list[str]]] = {}


def vendored_version(trainer: str) -> str:
    """``trainer``'s vendored commit as the cells name it, e.g. ``prime-rl@559b447``."""
    return f"{trainer}@{VENDORED[trainer][3][:7]}"


class _Shape:
    """jaxtyping's ``Float`` / ``Int`` / ``Bool`` stand-in: ``Float[Tensor, "b s"]`` is ``Tensor`` (annotations only)."""

    def __getitem__(self, item: Any) -> Any:
        return item[0] if isinstance(item, tuple) else item


class _Fields:
    """prime-rl's ``MicroBatch`` (``prime_rl/transports/rollouts/types.py``, a msgspec Struct) stand-in: the fields as
    keyword arguments, attributes to read and set."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _never(name: str) -> Any:
    def call(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{name} is not vendored: packcheck's path never reaches it")
    return call


def load_vendored(trainer: str) -> tuple[dict[str, Any], list[str]]:
    """The vendored functions of ``trainer`` (:data:`VENDORED`) executed into one namespace, and the stand-ins they
    needed (named in the cells). Cached per process; a test planting a fault swaps an entry of the namespace.

    Raises:
        ValueError: the file's sha256 is not the recorded one (restore it: ``tools/vendor_rl_sources.py``)."""
    if trainer in _LOADED:
        return _LOADED[trainer]
    import torch

    file, digest, url, commit = VENDORED[trainer]
    data = (VENDOR / file).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise ValueError(f"{VENDOR / file}: sha256 {got}, not the {url} {commit[:7]} copy recorded ({digest}): rebuild "
                         "it with tools/vendor_rl_sources.py")
    module = types.ModuleType(f"packcheck_vendored_{trainer.replace('-', '_')}")
    module.__file__ = str(VENDOR / file)
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    ns: dict[str, Any] = module.__dict__
    stand_ins: list[str] = []
    if trainer == "prime-rl":
        try:
            from beartype import beartype as typechecker
            from jaxtyping import Bool, Float, Int, jaxtyped
        except ImportError:
            typechecker, Bool = None, _Shape()
            Float = Int = Bool

            def jaxtyped(**_k: Any) -> Any:
                return lambda f: f
            stand_ins.append("jaxtyping / beartype not installed: the shape annotations unchecked")
        ns.update({"typechecker": typechecker, "Bool": Bool, "Float": Float, "Int": Int, "jaxtyped": jaxtyped,
                   "MicroBatch": _Fields, "EncodedTensor": Any, "RoutedExperts": Any,
                   "_copy_routed_experts": _never("_copy_routed_experts"),
                   "_pad_routed_experts": _never("_pad_routed_experts"),
                   "_expand_bins_by_splitting": _never("_expand_bins_by_splitting")})
        stand_ins.append("MicroBatch (a msgspec Struct) as a plain record of its fields")
    exec(compile(data, str(VENDOR / file), "exec"), ns)  # noqa: S102 - the projects' own source, hash-checked
    if trainer == "open-instruct":
        ns["tensor_utils"] = types.SimpleNamespace(pad_to_length=ns["pad_to_length"])
        ns["model_utils"] = types.SimpleNamespace(log_softmax_and_gather=ns["log_softmax_and_gather"],
                                                  entropy_from_logits=ns["entropy_from_logits"])
        # dpo_utils.py:57-58 import the padding-free collator's functions under these names
        ns["pf_concatenated_inputs"], ns["pf_get_batch_logps"] = ns["concatenated_inputs"], ns["get_batch_logps"]
        ns["olmo_core_utils"] = types.SimpleNamespace(doc_lens_from_attention_mask=_never("olmo_core_utils"))
    del torch
    _LOADED[trainer] = (ns, stand_ins)
    return ns, stand_ins


def _eager() -> Any:
    """``torch.compile``d functions (prime-rl's ``selective_log_softmax``, open-instruct's ``log_softmax_and_gather``)
    run as their Python bodies: inductor on CPU would compile C++ per shape for the same arithmetic."""
    import torch

    return torch._dynamo.config.patch(disable=True)


class _Forward:
    """The cell's model as a trainer calls it (``model(input_ids=..., position_ids=..., ...)``), through the
    workbench's forward (no grad, ``use_cache=False``); keys the model does not take are dropped there. Records the
    keys it was given (``calls``). With ``repair``, :func:`_repaired` varlen arguments."""

    def __init__(self, wb: Workbench, model: Any, repair: bool = False) -> None:
        self.wb, self.model, self.calls, self.repair = wb, model, [], repair
        self.config = model.config

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(sorted(kwargs))
        batch = {k: v for k, v in kwargs.items() if v is not None and k not in ("labels", "temperature", "use_cache")}
        if self.repair:
            batch = _repaired(batch)
        return self.wb.forward(batch)


def _repaired(batch: dict[str, Any]) -> dict[str, Any]:
    """The two varlen arguments a checking kernel refuses, made valid and nothing else: the row's tokens past
    ``cu_seq_lens[-1]`` as one more segment (causal: no earlier token reads them) and ``max_length_q/k`` = the longest
    segment. A padding run inside a segment stays, so what the segment's tokens read is what flash-attn computes for
    them where it computes them."""
    import torch

    out = dict(batch)
    n = int(out["input_ids"].shape[-1])
    for q in ("q", "k"):
        cu = out.get(f"cu_seq_lens_{q}")
        if cu is None:
            continue
        if int(cu[-1]) < n:
            cu = torch.cat([cu, cu.new_tensor([n])])
        out[f"cu_seq_lens_{q}"] = cu
        out[f"max_length_{q}"] = int((cu[1:] - cu[:-1]).max())
    return out


def _versions(trainer: str) -> dict[str, Any]:
    file, _, url, commit = VENDORED[trainer]
    return {trainer: commit[:7], "source": f"{url}/tree/{commit}", "vendored": f"vendor/{file}"}


def _crash(trainer: str, where: str, exc: BaseException) -> CheckResult:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    last = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return CheckResult("error", {"raised_at": last}, f"{trainer} {where} raised {type(exc).__name__}: "
                       f"{' '.join(str(exc).split())[:160]} (at {last})", cause="crash",
                       evidence={"exception": type(exc).__name__, "raised_at": last})


# ------------------------------------------------------------------------------------------------------------
# prime-rl


#: prime-rl's ``pad_to_multiple_of`` as the check runs it (its orchestrator pads each micro-batch to a multiple: a
#: padding tail that starts its own ``position_ids`` and joins the last sample's ``seq_lens``).
PRIME_RL_PAD_TO = 8


def prime_rl_micro_batch(ns: dict[str, Any], samples: list[RLSample], temperature: float) -> Any:
    """prime-rl's packed micro-batch of ``samples``: each sample as ``prepare_sample`` makes it
    (``src/prime_rl/trainer/batch.py:345-459``: ``position_ids = range(len)``, ``loss_mask`` on the completion,
    per-token ``temperatures``, ``seq_lens = [len]``; ``env_names`` carry the sample's index here), then
    ``packed_samples_into_micro_bs`` (first fit decreasing: one bin, one train worker) and ``pad_micro_batch`` to
    :data:`PRIME_RL_PAD_TO`. Returns the ``MicroBatch`` record."""
    def sample(i: int, s: RLSample) -> Any:
        n = len(s.tokens)
        return _Fields(input_ids=list(s.tokens), advantages=[0.0] * n, loss_mask=[False] * len(s.prompt) + [True] * len(s.completion),
                       position_ids=list(range(n)), inference_logprobs=[0.0] * n, sequence_lengths=[n], ref_logprobs=None,
                       temperatures=[temperature] * n, routed_experts=None, mm_token_type_ids=None, env_names=[f"s{i}"] * n,
                       mm_kwargs=None, rl_weights=None, ce_weights=None, ref_kl_weights=None, seq_lens=[n])

    micro = [sample(i, s) for i, s in enumerate(samples)]
    total = sum(len(s.tokens) for s in samples)
    (packed,) = ns["packed_samples_into_micro_bs"](micro, total, 1, lambda lengths: sum(lengths))
    return ns["pad_micro_batch"](packed, PRIME_RL_PAD_TO)


def prime_rl_logprobs(ns: dict[str, Any], forward: Any, mb: Any, vocab: int) -> list[tuple[int, Any, Any]]:
    """prime-rl's trainer on one micro-batch, in ``src/prime_rl/trainer/rl/train.py``'s order (379-447, the HF model's
    ``VanillaOutputLinear`` branch): ``labels = shift_tensor_left(input_ids)``; the model on ``input_ids`` and
    ``position_ids``; ``logits / temperatures``; ``selective_log_softmax`` and ``compute_entropy``;
    ``shift_tensor_right`` (pad values ``log(1/vocab)``, ``log(vocab)``); split by ``sequence_lengths``; each piece's
    completion through its ``loss_mask``. Returns ``(sample index, log-probs, entropies)`` per packed sample (float64,
    nats)."""
    import torch

    input_ids = torch.tensor([mb.input_ids])
    position_ids = torch.tensor([mb.position_ids])
    temperatures = torch.tensor([mb.temperatures], dtype=torch.float32)
    labels = ns["shift_tensor_left"](input_ids)
    with _eager():
        logits = forward(input_ids=input_ids, position_ids=position_ids, labels=labels, temperature=temperatures).logits.float()
        scaled = logits / temperatures.unsqueeze(-1)
        logprobs = ns["selective_log_softmax"](scaled, labels)
        entropy = ns["compute_entropy"](scaled)
    logprobs = ns["shift_tensor_right"](logprobs, pad_value=torch.log(torch.tensor(1.0 / vocab)).item())
    entropy = ns["shift_tensor_right"](entropy, pad_value=torch.log(torch.tensor(float(vocab))).item())
    mask = torch.tensor(mb.loss_mask)
    out = []
    pieces = zip(logprobs.squeeze(0).split(mb.sequence_lengths), entropy.squeeze(0).split(mb.sequence_lengths),
                 mask.split(mb.sequence_lengths), torch.tensor(range(len(mb.env_names))).split(mb.sequence_lengths), strict=True)
    for lp, h, m, where in pieces:
        index = int(mb.env_names[int(where[0])][1:])
        out.append((index, lp[m].double().cpu(), h[m].double().cpu()))
    return out


def check_rl_prime_rl_packed(wb: Workbench) -> CheckResult:
    """prime-rl's packed micro-batch and its trainer's log-prob / entropy path (:func:`prime_rl_micro_batch`,
    :func:`prime_rl_logprobs`), its vendored code, at the RL temperature against each sample alone."""
    from .rl import RL_TEMPERATURE, _base_metrics, _too_short, _verdict, compare

    short = _too_short(wb)
    if short:
        return short
    try:
        ns, stand_ins = load_vendored("prime-rl")
    except Exception as exc:  # noqa: BLE001 - a damaged vendored file: the cell says which
        return _crash("prime-rl", "vendored source", exc)
    samples = rl_samples(wb.examples)
    try:
        mb = prime_rl_micro_batch(ns, samples, RL_TEMPERATURE)
        with _model_copy(wb) as model:
            rows = prime_rl_logprobs(ns, _Forward(wb, model), mb, int(wb.config.vocab_size))
    except Exception as exc:  # noqa: BLE001 - prime-rl's code raised on this model: the cell says where
        return _crash("prime-rl", "packed micro-batch", exc)
    got = {i: (lp, h) for i, lp, h in rows}
    if sorted(got) != list(range(len(samples))) or any(len(got[i][0]) != len(s.completion) for i, s in enumerate(samples)):
        return CheckResult("fail", {**_versions("prime-rl"), "segments": len(rows), "samples": len(samples)},
                           f"prime-rl {vendored_version('prime-rl')[9:]} packed micro-batch: {len(rows)} pieces by "
                           f"sequence_lengths for {len(samples)} samples, or a loss_mask of the wrong length",
                           cause="collator_contract", evidence={"pieces": len(rows), "samples": len(samples)})
    numbers = compare([got[i] for i in range(len(samples))], alone(wb, samples, RL_TEMPERATURE))
    metrics = {**numbers, **_base_metrics(wb, samples), **_versions("prime-rl"), "stand_ins": stand_ins,
               "seq_lens": list(mb.seq_lens), "padding": len(mb.input_ids) - sum(len(s.tokens) for s in samples),
               "compiled_functions": "torch._dynamo disabled (eager)"}
    what = f"{vendored_version('prime-rl')} packed micro-batch (train.py log-prob path; {'; '.join(stand_ins)})"
    return _verdict(wb, what, numbers, metrics)


# ------------------------------------------------------------------------------------------------------------
# open-instruct


def open_instruct_grpo_logprobs(ns: dict[str, Any], forward: Any, samples: list[RLSample], pad_id: int,
                                temperature: float) -> list[Any]:
    """open-instruct's packed GRPO log-probs: ``pack_sequences`` (``open_instruct/rl_utils.py:227``; one pack,
    ``attention_masks`` numbering the samples, ``position_ids`` from ``reset_position_ids``, ``response_masks`` = the
    sample's number on its response, made bool as ``data_loader.py:1520`` does) and ``compute_logprobs`` (``grpo_utils.py:577``: ``forward_for_logprobs`` with
    ``attention_mask=None`` and the pack's ``position_ids``, labels ``query_responses[:, 1:]`` over the row, logits
    divided by ``temperature``, ``log_softmax_and_gather``; ``mask_logprobs`` by ``response_masks[:, 1:]``). Returns
    each sample's completion log-probs (float64, nats), read where the response mask holds its number."""
    total = sum(len(s.tokens) for s in samples)
    packed = ns["pack_sequences"](queries=[list(s.prompt) for s in samples], responses=[list(s.completion) for s in samples],
                                  masks=[[1] * len(s.completion) for s in samples], pack_length=total, pad_token_id=pad_id,
                                  vllm_logprobs=[[0.0] * len(s.completion) for s in samples])
    data = types.SimpleNamespace(query_responses=[t.unsqueeze(0) for t in packed.query_responses],
                                 position_ids=[t.unsqueeze(0) for t in packed.position_ids],
                                 attention_masks=[t.unsqueeze(0) for t in packed.attention_masks],
                                 # data_loader.py:1520: the doc-numbered masks downcast to bool after the advantages
                                 response_masks=[t.bool().unsqueeze(0) for t in packed.response_masks])
    with _eager():
        logprobs = ns["compute_logprobs"](forward, data, pad_id, temperature)
    out: dict[int, Any] = {}
    for lp, rm in zip(logprobs, [t.unsqueeze(0) for t in packed.response_masks], strict=True):
        shifted = rm[0, 1:]
        for number in sorted(set(shifted.tolist()) - {0}):
            out[number - 1] = lp[0][shifted == number].double().cpu()
    return [out.get(i) for i in range(len(samples))]


def check_rl_open_instruct_grpo(wb: Workbench) -> CheckResult:
    """open-instruct's packed GRPO (:func:`open_instruct_grpo_logprobs`), its vendored code, at the RL temperature
    against each sample alone; log-probs only (``compute_logprobs`` returns no entropy: not compared)."""
    from .rl import RL_TEMPERATURE, _base_metrics, _too_short, _verdict, compare

    short = _too_short(wb)
    if short:
        return short
    samples = rl_samples(wb.examples)
    if any(wb.pad_id in s.prompt for s in samples):  # pack_sequences asserts no pad token in a query
        samples = [RLSample(tuple(t for t in s.prompt if t != wb.pad_id) or (wb.pad_id + 1,), s.completion, s.group)
                   for s in samples]
    try:
        ns, stand_ins = load_vendored("open-instruct")
        with _model_copy(wb) as model:
            got = open_instruct_grpo_logprobs(ns, _Forward(wb, model), samples, wb.pad_id, RL_TEMPERATURE)
    except Exception as exc:  # noqa: BLE001 - open-instruct's code raised on this model: the cell says where
        return _crash("open-instruct", "pack_sequences / compute_logprobs", exc)
    if any(g is None or len(g) != len(s.completion) for g, s in zip(got, samples, strict=True)):
        return CheckResult("fail", {**_versions("open-instruct"), "max_abs_logprob_diff": math.inf},
                           f"{vendored_version('open-instruct')} packed GRPO: the "
                           "response masks do not select each sample's completion", cause="collator_contract",
                           evidence={"found": [None if g is None else len(g) for g in got]})
    numbers = compare([(g, None) for g in got], alone(wb, samples, RL_TEMPERATURE))
    metrics = {**numbers, **_base_metrics(wb, samples), **_versions("open-instruct"), "stand_ins": stand_ins,
               "compiled_functions": "torch._dynamo disabled (eager)"}
    return _verdict(wb, f"{vendored_version('open-instruct')} packed GRPO (pack_sequences, compute_logprobs)", numbers, metrics)


#: ``--max_seq_length`` as the check hands it to the DPO collator: the chosen row's length plus this many tokens (the
#: collator right-pads each branch to it; ``dpo.py:195-196`` passes ``args.max_seq_length`` with ``--packing``).
OPEN_INSTRUCT_SLACK = 3


def open_instruct_dpo_features(pairs: list[tuple[RLSample, RLSample]]) -> list[dict[str, Any]]:
    """The DPO features open-instruct's collator reads: ``chosen_input_ids`` / ``chosen_labels`` (-100 on the prompt)
    and the rejected pair, ``index``."""
    import torch

    def labels(s: RLSample) -> Any:
        return torch.tensor([-100] * len(s.prompt) + list(s.completion))

    return [{"chosen_input_ids": torch.tensor(c.tokens), "chosen_labels": labels(c), "rejected_input_ids": torch.tensor(r.tokens),
             "rejected_labels": labels(r), "index": i} for i, (c, r) in enumerate(pairs)]


def open_instruct_dpo_logps(ns: dict[str, Any], forward: Any, pairs: list[tuple[RLSample, RLSample]],
                            max_seq_length: int | None) -> tuple[list[float], list[float], dict[str, Any]]:
    """``TensorDataCollatorWithFlatteningDPO(return_position_ids=True, return_flash_attn_kwargs=True,
    max_seq_length=...)`` (``dpo.py:195-196``) on the pairs, then ``concatenated_forward(model, batch, packing=True)``
    (``dpo_utils.py:826``): chosen and rejected rows concatenated (``pf_concatenated_inputs``: the rejected
    ``cu_seq_lens`` offset by the chosen row's padded length), the model on ``input_ids``, ``cu_seq_lens_q/k``,
    ``max_length_q/k``, ``position_ids``, ``seq_idx``, ``calculate_per_token_logps`` and ``get_batch_logps`` per
    segment. Returns (chosen sums, rejected sums) in nats and the row's layout (its ``cu_seq_lens_k``, length)."""
    collate = ns["TensorDataCollatorWithFlatteningDPO"](return_position_ids=True, return_flash_attn_kwargs=True,
                                                          max_seq_length=max_seq_length)
    batch = collate(open_instruct_dpo_features(pairs))
    concatenated, _ = ns["concatenated_inputs"](batch)
    chosen, rejected, _ = ns["concatenated_forward"](forward, batch, average_log_prob=False, packing=True)
    layout = {"cu_seq_lens_k": [int(x) for x in concatenated["concatenated_cu_seq_lens_k"].tolist()],
              "row_length": int(concatenated["concatenated_input_ids"].shape[-1])}
    return [float(x) for x in chosen], [float(x) for x in rejected], layout


def check_rl_open_instruct_dpo(wb: Workbench) -> CheckResult:
    """open-instruct's packed DPO (:func:`open_instruct_dpo_logps`), its vendored code, with ``max_seq_length`` as
    ``dpo.py`` passes it (each branch right-padded to it: :data:`OPEN_INSTRUCT_SLACK` padding tokens past the chosen
    row): the per-sequence sums and margins against each sequence alone, the DPO loss at the reference ``ln 2``.
    Fails ``collator_contract`` when the segments ``cu_seq_lens_k`` gives the model do not cover the sequences
    exactly (a padding run inside a segment); the same row without ``max_seq_length`` is measured beside it
    (``max_abs_seq_logprob_diff_unpadded``)."""
    from .rl_trainers import _pair_metrics, _preference_verdict, _too_few, dpo_loss, preference_pairs, sequence_logps

    short = _too_few(wb)
    if short:
        return short
    pairs = preference_pairs(wb)
    ref_c, ref_r, _, _ = sequence_logps(wb, pairs)
    width = sum(len(c.tokens) for c, _ in pairs)
    max_len = max(width, sum(len(r.tokens) for _, r in pairs)) + OPEN_INSTRUCT_SLACK
    lengths = [len(c.tokens) for c, _ in pairs] + [len(r.tokens) for _, r in pairs]
    refused = None
    try:
        ns, stand_ins = load_vendored("open-instruct")
        with _model_copy(wb) as model:
            bare_c, bare_r, _ = open_instruct_dpo_logps(ns, _Forward(wb, model), pairs, None)
            try:
                got_c, got_r, layout = open_instruct_dpo_logps(ns, _Forward(wb, model), pairs, max_len)
            except Exception as exc:
                # a varlen kernel that checks its arguments (packcheck_flash_ref) refuses the padded row's
                # cu_seq_lens / max_length: flash-attn itself does not check them (its result there is undefined)
                if not type(exc).__name__.endswith(("BoundariesError", "KernelArgumentError")):
                    raise
                refused = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                got_c, got_r, layout = open_instruct_dpo_logps(ns, _Forward(wb, model, repair=True), pairs, max_len)
    except Exception as exc:  # noqa: BLE001 - open-instruct's code raised on this model: the cell says where
        return _crash("open-instruct", "TensorDataCollatorWithFlatteningDPO / concatenated_forward", exc)
    cu = layout["cu_seq_lens_k"]
    gaps = open_instruct_padding_in_segments(cu, lengths)
    unpadded = (_pair_metrics(bare_c, bare_r, ref_c, ref_r, dpo_loss(bare_c, bare_r, ref_c, ref_r), wb)
                if len(bare_c) == len(bare_r) == len(pairs) else {"max_abs_seq_logprob_diff": math.inf, "initial_loss": math.nan})
    shape = {**_versions("open-instruct"), "stand_ins": stand_ins, "max_seq_length": max_len, "cu_seq_lens_k": cu,
             "row_length": layout["row_length"], "padding_tokens_in_segments": gaps,
             "trailing_tokens_outside_cu_seq_lens": layout["row_length"] - cu[-1],
             "longest_segment": max(b - a for a, b in itertools.pairwise(cu)), "longest_sequence": max(lengths),
             "max_abs_seq_logprob_diff_unpadded": unpadded["max_abs_seq_logprob_diff"],
             "initial_loss_unpadded": unpadded["initial_loss"]}
    where = (f"cu_seq_lens_k {cu} puts {gaps} padding tokens of the chosen branch inside the first rejected segment "
             f"(longest segment {shape['longest_segment']}, max_length_k {max(lengths)})")
    if refused and len(got_c) == len(got_r) == len(pairs):
        metrics = {**_pair_metrics(got_c, got_r, ref_c, ref_r, dpo_loss(got_c, got_r, ref_c, ref_r), wb), **shape,
                   "kernel_refused": refused, "repaired_for_the_kernel": "cu_seq_lens closed at the row's end, max_length = "
                   "the longest segment"}
        return CheckResult("fail", metrics, f"{vendored_version('open-instruct')} packed DPO (max_seq_length={max_len}): "
                           f"{where}; the varlen kernel refuses the row ({refused[:90]}); with the row's end and "
                           f"max_length made valid, the padding inside the segment moves the sequence log-probs by "
                           f"{_fmt_nats(metrics['max_abs_seq_logprob_diff'])}, the margin by "
                           f"{_fmt_nats(metrics['max_abs_margin_diff'])}; without max_seq_length "
                           f"{_fmt_nats(unpadded['max_abs_seq_logprob_diff'])}", cause="collator_contract",
                           evidence={k: shape[k] for k in ("cu_seq_lens_k", "padding_tokens_in_segments", "longest_segment")})
    if len(got_c) != len(pairs) or len(got_r) != len(pairs):  # get_batch_logps read another number of segments
        return CheckResult("fail", {**shape, "chosen_sums": len(got_c), "rejected_sums": len(got_r), "pairs": len(pairs),
                                    "max_abs_seq_logprob_diff": math.inf, "max_abs_margin_diff": math.inf},
                           f"{vendored_version('open-instruct')} packed DPO: {len(got_c)} chosen and {len(got_r)} rejected "
                           f"sums for {len(pairs)} pairs (cu_seq_lens_k {cu} does not match the sequences)",
                           cause="collator_contract", evidence={"cu_seq_lens_k": cu, "pairs": len(pairs)})
    metrics = {**_pair_metrics(got_c, got_r, ref_c, ref_r, dpo_loss(got_c, got_r, ref_c, ref_r), wb), **shape}
    what = (f"{vendored_version('open-instruct')} packed DPO (TensorDataCollatorWithFlatteningDPO max_seq_length={max_len}, "
            f"concatenated_forward; {len(pairs)} pairs)")
    result = _preference_verdict(what, metrics, wb.tol["logits_atol"], "collator_contract" if gaps else "leak")
    if gaps:
        result = CheckResult(result.status, metrics, f"{result.message}; {where}" + (
            ": read by a flash-attention varlen kernel only" if result.status == "pass" else ""),
            cause=result.cause, evidence={**(result.evidence or {}), "cu_seq_lens_k": cu, "padding_tokens_in_segments": gaps}
            if result.status == "fail" else None)
    return result


def open_instruct_padding_in_segments(cu: list[int], lengths: list[int]) -> int:
    """How many padding tokens the segments of ``cu`` (``cu_seq_lens_k`` as the model gets it) hold beyond the
    sequences' own tokens: ``sum(segment lengths) - sum(sequence lengths)`` over the segments (0 when each segment is
    exactly one sequence)."""
    if len(cu) != len(lengths) + 1:
        return abs(len(cu) - 1 - len(lengths))
    return sum(max(0, (b - a) - n) for a, b, n in zip(cu[:-1], cu[1:], lengths, strict=True))


# ------------------------------------------------------------------------------------------------------------
# unsloth


#: The file holding unsloth's GRPO log-prob replacement, and the anchors of its sequence-packing block there.
UNSLOTH_FILE = ("unsloth", "models/rl_replacements.py")
UNSLOTH_PACK = ("_pk_pad = self.processing_class.pad_token_id", "_pk_in_packed = False")
#: The block's last line where a release has no ``_pk_in_packed`` flag (2026.7 .. 2026.9): the scatter back to
#: ``[rows, logits_to_keep + max_left_pad]``.
UNSLOTH_PACK_END = ".view(total_rows, _pk_L)[:, -_pk_W:]"
UNSLOTH_VERIFY = ("_pk_ref = torch.zeros_like(_pk_result)", "_pk_diff = float(")
UNSLOTH_HELPERS = ("_unsloth_grpo_returns_hidden_states", "_unsloth_grpo_hidden_states_signal")


def _package_file(package: str, rel: str) -> Path:
    """``rel`` inside the installed (or on-path) ``package``, found without importing it. Raises ModuleNotFoundError
    naming the package."""
    spec = sys.modules[package].__spec__ if package in sys.modules else importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named '{package}'", name=package)
    for root in spec.submodule_search_locations:
        if (Path(root) / rel).is_file():
            return Path(root) / rel
    raise ModuleNotFoundError(f"{package} has no {rel}", name=package)


def _block(source: str, first: str, last: str, start: int = 0) -> tuple[str, int, int]:
    """The lines of ``source`` from the first holding ``first`` (at or after line ``start``) through the next one
    holding ``last``, dedented, and their 1-based line numbers. Raises LookupError naming a missing anchor."""
    lines = source.splitlines(keepends=True)
    a = next((i for i in range(start, len(lines)) if first in lines[i]), None)
    if a is None:
        raise LookupError(f"'{first}' not found")
    b = next((i for i in range(a, len(lines)) if last in lines[i]), None)
    if b is None:
        raise LookupError(f"'{last}' not found after line {a + 1}")
    # the verifier's last line opens a parenthesised expression: take it to its closing line
    while b + 1 < len(lines):
        try:
            compile(textwrap.dedent("".join(lines[a:b + 1])), "<block>", "exec")
            break
        except SyntaxError:
            b += 1
    return textwrap.dedent("".join(lines[a:b + 1])), a + 1, b + 1


def unsloth_source() -> dict[str, Any]:
    """unsloth's sequence-packing block, its verifier and their helpers, read from the release's
    ``unsloth/models/rl_replacements.py`` (unsloth is not imported), with unsloth_zoo's ``rl_replacements`` imported
    without its package ``__init__``: ``{"pack": code, "verify": code, "helpers": code, "lines": {...}, "accept":
    float, "kill": float, "zoo": module, "file": str}``. Raises ImportError naming what is missing, LookupError when
    the release has no such block."""
    from .rl_trainers import _bare_package

    path = _package_file(*UNSLOTH_FILE)
    key = (str(path), path.stat().st_mtime_ns)
    cached = _UNSLOTH_READ.get(key)  # read and parsed once per file (8,000 lines of ast per cell otherwise), while its
    if cached and sys.modules.get("unsloth_zoo.rl_replacements") is cached["zoo"]:  # zoo is still the one imported
        return cached
    source = path.read_text()
    try:
        pack, p0, p1 = _block(source, *UNSLOTH_PACK)
    except LookupError:  # 2026.7 .. 2026.9: no _pk_in_packed flag; the block ends with its scatter back
        pack, p0, p1 = _block(source, UNSLOTH_PACK[0], UNSLOTH_PACK_END)
    verify, v0, v1 = _block(source, *UNSLOTH_VERIFY, start=p1)
    tree = ast.parse(source)
    wanted = [name for name in UNSLOTH_HELPERS if name in pack or name in verify]  # 2026.7: none (hidden states)
    helpers = [ast.get_source_segment(source, node) for node in tree.body
               if isinstance(node, ast.FunctionDef) and node.name in wanted]
    after = "\n".join(source.splitlines()[v1:v1 + 12])
    accept = re.search(r"if _pk_diff < ([0-9.e+-]+):", after)
    kill = re.search(r"if _pk_diff >= ([0-9.e+-]+):", "\n".join(source.splitlines()[v1:v1 + 40]))
    if accept is None or kill is None or len(helpers) != len(wanted):
        raise LookupError("the verifier's thresholds or the hidden-states helpers are not where 2026.7 .. 2026.10 have them")
    _bare_package("unsloth_zoo")
    cpu_switch = None
    try:
        with _compile_location():
            zoo = importlib.import_module("unsloth_zoo.rl_replacements")
    except NotImplementedError as exc:  # zoo < 2026.10's device_type.py: "You need a GPU" unless its test switch is on
        if "accelerator" not in str(exc):
            raise
        for name in [n for n in sys.modules if n.startswith("unsloth_zoo.")]:
            del sys.modules[name]
        cpu_switch = "UNSLOTH_ALLOW_CPU=1 (unsloth_zoo's own test-only CPU switch, device_type.py: DEVICE_TYPE reads 'cuda')"
        saved = os.environ.get("UNSLOTH_ALLOW_CPU")
        os.environ["UNSLOTH_ALLOW_CPU"] = "1"
        try:
            with _compile_location():
                zoo = importlib.import_module("unsloth_zoo.rl_replacements")
        finally:
            if saved is None:
                os.environ.pop("UNSLOTH_ALLOW_CPU", None)
            else:
                os.environ["UNSLOTH_ALLOW_CPU"] = saved
    _UNSLOTH_READ[key] = {"pack": pack, "verify": verify, "helpers": "\n\n".join(helpers), "accept": float(accept.group(1)),
                          "kill": float(kill.group(1)), "zoo": zoo, "file": "unsloth/models/rl_replacements.py",
                          "lines": {"pack": f"{p0}-{p1}", "verify": f"{v0}-{v1}"},
                          "hidden_states": UNSLOTH_HELPERS[0] not in pack, "cpu_switch": cpu_switch}
    # hidden_states: the release's block takes the forward's .logits as the final hidden states (unsloth's patched
    # forwards under UNSLOTH_RETURN_HIDDEN_STATES=1) and applies lm_head itself, with no check of the width
    return _UNSLOTH_READ[key]


_UNSLOTH_READ: dict[tuple[str, int], dict[str, Any]] = {}


@contextlib.contextmanager
def _compile_location() -> Any:
    """``UNSLOTH_COMPILE_LOCATION`` under the temporary folder while unsloth_zoo imports, unless set: its
    ``temporary_patches/moe_utils.py`` (2026.9 on) copies itself into ``unsloth_compiled_cache/`` of the current
    folder at import (the repository root under pytest). What the import patches is taken off by
    :func:`check_rl_unsloth_grpo_packed`, around everything unsloth's code does."""
    import tempfile

    if os.environ.get("UNSLOTH_COMPILE_LOCATION"):
        yield
        return
    os.environ["UNSLOTH_COMPILE_LOCATION"] = str(Path(tempfile.gettempdir()) / "packcheck-unsloth-compiled-cache")
    try:
        yield
    finally:
        os.environ.pop("UNSLOTH_COMPILE_LOCATION", None)


@contextlib.contextmanager
def _global_module_hooks_kept() -> Any:
    """torch's process-wide ``nn.Module`` hooks (``torch.nn.modules.module._global_*``: registration, forward,
    backward) as they were before the block: unsloth_zoo's ``tiled_mlp.py`` registers a module-registration hook at
    import (``register_module_module_registration_hook(_bump_module_tree_version)``), and a later ``torch.compile``
    in the process traced it and failed importing ``unsloth_zoo.tiled_mlp`` (test_stack's compile test, in CI's
    order). The dicts are filled in place, so :func:`.rl_trainers._undo_import_patches` does not see them."""
    from torch.nn.modules import module as nn_module

    saved = {name: dict(value) for name, value in vars(nn_module).items()
             if name.startswith("_global_") and isinstance(value, dict)}
    try:
        yield
    finally:
        for name, before in saved.items():
            hooks = getattr(nn_module, name)
            for key in [k for k in hooks if k not in before]:
                del hooks[key]


def unsloth_grpo_batch(samples: list[RLSample], pad_id: int) -> tuple[Any, int]:
    """TRL GRPO's batch as unsloth's ``_get_per_token_logps_and_entropies`` gets it: prompts left-padded, completions
    right-padded (``input_ids`` ``(rows, P + C)``), ``logits_to_keep = C``."""
    from .rl import left_padded_batch

    batch, _, width = left_padded_batch(samples, pad_id)
    return batch["input_ids"], width


def unsloth_packed_logprobs(src: dict[str, Any], model: Any, input_ids: Any, logits_to_keep: int, pad_id: int,
                            temperature: float, verify: bool = True) -> dict[str, Any]:
    """unsloth's sequence-packing block run as its ``_get_per_token_logps_and_entropies`` runs it (after
    ``calculate_pad_tokens_in_prompt`` and ``left_pack_padding``, unsloth_zoo's, as that method calls them), with
    ``model`` as the unwrapped model (called with ``input_ids``, ``position_ids``, ``packed_seq_lengths``,
    ``use_cache=False``); then, with ``verify``, its runtime verifier (the per-row forward). Returns ``{"packed":
    (rows, logits_to_keep + max_left_pad) float32 log-probs, "mask": the completion mask the loss uses, "verifier_diff":
    unsloth's max |packed - per-row| over that mask (nats) or None, "used": whether the block ran packed, "max_left_pad":
    int}``. The stand-ins: ``self`` (its tokenizer's ``pad_token_id``, autocast off in fp32),
    ``_get_inference_mode_context_manager`` as ``torch.inference_mode``."""
    import torch

    zoo = types.SimpleNamespace(**{name: _python_body(getattr(src["zoo"], name)) for name in (
        "calculate_pad_tokens_in_prompt", "left_pack_padding", "create_completion_attention_mask",
        "chunked_selective_log_softmax", "chunked_hidden_states_selective_log_softmax")})
    lm_head = model.get_output_embeddings().weight
    left = zoo.calculate_pad_tokens_in_prompt(input_ids, logits_to_keep, pad_id)
    max_left_pad = int(torch.max(left).item())
    packed_ids = zoo.left_pack_padding(input_ids, pad_id)
    me = types.SimpleNamespace(processing_class=types.SimpleNamespace(pad_token_id=pad_id), _autocast_dtype=torch.float32,
                               _autocast_enabled=False)
    scope: dict[str, Any] = {"torch": torch, "math": math}
    exec(compile(src["helpers"], src["file"], "exec"), scope)  # noqa: S102 - unsloth's own source, read from its release
    scope.update({
        "self": me, "input_ids": packed_ids, "logits_to_keep": logits_to_keep, "max_left_pad": max_left_pad,
        "left_pad_tokens_per_prompt": left, "unwrapped_model": model, "model": model, "batch_size": input_ids.shape[0],
        "seq_len": input_ids.shape[1], "total_rows": input_ids.shape[0], "multiplier": 4, "lm_head": lm_head,
        "temperature": temperature, "logit_scale_multiply": 0.0, "logit_scale_divide": 0.0, "logit_softcapping": 0.0,
        "create_completion_attention_mask": zoo.create_completion_attention_mask,
        "chunked_selective_log_softmax": zoo.chunked_selective_log_softmax,
        "chunked_hidden_states_selective_log_softmax": zoo.chunked_hidden_states_selective_log_softmax,
        "_get_inference_mode_context_manager": lambda _m: torch.inference_mode(), "DEVICE_TYPE_TORCH": "cpu",
        "device_synchronize": lambda: None, "UNSLOTH_ENABLE_LOGGING": False, "_pk_ok": None, "_pk_result": None,
    })
    with _eager():  # unsloth_zoo's log-softmax gathers are torch.compile'd: their Python bodies run
        exec(compile(src["pack"], f"{src['file']}:{src['lines']['pack']}", "exec"), scope)  # noqa: S102 - unsloth's block
        if scope.get("_pk_result") is None:  # its gate declined (_pk_fits): what it read
            gate = {k: scope.get(v) for k, v in (("sliding_window", "_pk_sw"), ("longest_segment", "_pk_maxseg"),
                                                  ("tokens", "_pk_T"), ("token_cap", "_pk_cap"), ("fits", "_pk_fits"))}
            return {"packed": None, "mask": None, "verifier_diff": None, "used": False, "max_left_pad": max_left_pad,
                    "gate": gate}
        diff = None
        if verify:
            exec(compile(src["verify"], f"{src['file']}:{src['lines']['verify']}", "exec"), scope)  # noqa: S102
            diff = float(scope["_pk_diff"])
    return {"packed": scope["_pk_result"], "mask": scope["_pk_cmask"], "verifier_diff": diff, "used": True,
            "max_left_pad": max_left_pad}


def _python_body(function: Any) -> Any:
    """A ``torch.compile``d function's Python body (``_torchdynamo_orig_callable``): unsloth_zoo before 2026.10
    compiles its log-softmax gathers with ``fullgraph=True``, which torch 2.13 refuses to run with dynamo disabled
    ("found no compiled frames"); any other function as it is."""
    return getattr(function, "_torchdynamo_orig_callable", function)


class _UnslothModel:
    """The cell's model as unsloth's block calls ``unwrapped_model(...)``: through the workbench's forward;
    ``packed_seq_lengths`` (read by unsloth's own patched attention, ``unsloth/models/llama.py``) is dropped: a
    transformers model takes the row's segments from ``position_ids``."""

    def __init__(self, wb: Workbench, model: Any, hidden_states: bool = False) -> None:
        self.wb, self.model, self.config, self.hidden_states = wb, model, model.config, hidden_states
        self.packed_seq_lengths: list[list[int]] = []

    def get_output_embeddings(self) -> Any:
        return self.model.get_output_embeddings()

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs.get("packed_seq_lengths") is not None:
            self.packed_seq_lengths.append([int(x) for x in kwargs["packed_seq_lengths"].tolist()])
        batch = {k: kwargs[k] for k in ("input_ids", "position_ids") if kwargs.get(k) is not None}
        if not self.hidden_states:
            return self.wb.forward(batch)
        # what unsloth's patched forwards return as .logits under UNSLOTH_RETURN_HIDDEN_STATES=1: lm_head's input
        seen: list[Any] = []
        hook = self.wb.model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
        try:
            self.wb.forward(batch)
        finally:
            hook.remove()
        return types.SimpleNamespace(logits=seen[-1])


#: The stand-in a release whose block reads the forward's ``.logits`` as hidden states (2026.7) needs, as cells name it.
HIDDEN_STATES_STAND_IN = ("the forward's .logits = lm_head's input (unsloth's patched forwards under "
                          "UNSLOTH_RETURN_HIDDEN_STATES=1)")
#: unsloth's shared-prefix grouping, as the cell names it.
PREFIX_GROUPER = ("its shared-prefix grouping (PrefixGrouper, UNSLOTH_GRPO_PREFIX_GROUPER) is not run: it needs unsloth's "
                  "patched model forwards (FastLanguageModel) to carry prefix_seg_info into a torch.compile'd "
                  "FlexAttention kernel (unsloth/utils/prefix_grouper_kernel.py), a CUDA GPU with triton")


def check_rl_unsloth_grpo_packed(wb: Workbench) -> CheckResult:
    """unsloth's GRPO sequence packing (:func:`unsloth_packed_logprobs`), its own block from the release, at the RL
    temperature against each sample alone (log-probs; the no-grad scoring path computes no entropy). The metrics also
    carry unsloth's own verifier's number on this batch and its thresholds (``unsloth_verifier_diff``,
    ``unsloth_accept_below``, ``unsloth_disable_at``). A skip names the package where unsloth / unsloth_zoo are not
    on the path. Whatever unsloth's code installs process-wide while it runs (torch's global ``nn.Module`` hooks,
    replaced torch / transformers / trl attributes) is taken off after it: a later ``torch.compile`` in the process
    traced unsloth_zoo's registration hook and failed once the wheel left the path."""
    from .rl_trainers import _undo_import_patches

    # a module unsloth_zoo's import patches, loaded first so that its attributes are saved (one the block loads is
    # not): temporary_patches/common.py sets torch._inductor.async_compile.tqdm
    with contextlib.suppress(ImportError):
        importlib.import_module("torch._inductor.async_compile")
    with _undo_import_patches(("torch", "transformers", "trl"), first=None), _global_module_hooks_kept():
        return _check_unsloth(wb)


def _check_unsloth(wb: Workbench) -> CheckResult:
    from .rl import RL_TEMPERATURE, _base_metrics, _too_short, _verdict, compare
    from .rl_trainers import _dist_version, _not_importable

    short = _too_short(wb)
    if short:
        return short
    try:
        src = unsloth_source()
    except ImportError as exc:
        return _not_importable("unsloth", "unsloth", exc, "GRPO sequence packing (unsloth/models/rl_replacements.py, "
                               "unsloth_zoo.rl_replacements)")
    except Exception as exc:  # noqa: BLE001 - the release moved its block or its zoo raised at import
        return _crash("unsloth", "GRPO sequence packing (reading the release)", exc)
    samples = rl_samples(wb.examples)
    input_ids, keep = unsloth_grpo_batch(samples, wb.pad_id)
    try:
        with _model_copy(wb) as model:
            wrapped = _UnslothModel(wb, model, hidden_states=src["hidden_states"])
            out = unsloth_packed_logprobs(src, wrapped, input_ids.to(wb.device), keep, wb.pad_id, RL_TEMPERATURE)
    except Exception as exc:  # noqa: BLE001 - unsloth's code raised on this model: the cell says where
        return _crash("unsloth", "GRPO sequence packing", exc)
    versions = {"unsloth": _dist_version("unsloth"), "unsloth_zoo": _dist_version("unsloth_zoo"),
                "code": f"{src['file']}:{src['lines']['pack']} (packing), {src['lines']['verify']} (verifier)"}
    if not out["used"]:
        gate = out["gate"]
        sw, seg = gate["sliding_window"], gate["longest_segment"]
        why = (f"the model's sliding_window {sw} is shorter than the longest sample ({seg} tokens): its _pk_sw_ok "
               "('Sliding-window models lose the per-sequence local window in a packed stream')"
               if isinstance(sw, int) and sw > 0 and isinstance(seg, int) and seg > sw else f"its gate read {gate}")
        return CheckResult("skipped", {**versions, "unsloth_gate": gate}, f"unsloth {versions['unsloth']}'s GRPO sequence "
                           f"packing declines this batch and scores it padded ({src['file']}:{src['lines']['pack']}): {why}")
    packed, mask = out["packed"], out["mask"]
    rows = [(packed[i][mask[i]].double().cpu(), None) for i in range(len(samples))]
    counts = [len(r[0]) for r in rows]
    if counts != [len(s.completion) for s in samples]:
        return CheckResult("fail", {**versions, "completion_tokens_read": counts, "max_abs_logprob_diff": math.inf,
                                    "unsloth_verifier_diff": out["verifier_diff"]},
                           f"unsloth {versions['unsloth']} GRPO sequence packing: the completion mask reads {counts} tokens "
                           f"for completions of {[len(s.completion) for s in samples]} (logits_to_keep {keep})",
                           cause="collator_contract", evidence={"completion_tokens_read": counts})
    numbers = compare(rows, alone(wb, samples, RL_TEMPERATURE))
    metrics = {**numbers, **_base_metrics(wb, samples), **versions, "unsloth_verifier_diff": out["verifier_diff"],
               "unsloth_accept_below": src["accept"], "unsloth_disable_at": src["kill"],
               "packed_seq_lengths": wrapped.packed_seq_lengths[0] if wrapped.packed_seq_lengths else None,
               "stand_ins": ["self (pad_token_id; autocast off, fp32)", "inference mode as torch.inference_mode",
                             *([HIDDEN_STATES_STAND_IN] if src["hidden_states"] else []),
                             *([src["cpu_switch"]] if src["cpu_switch"] else [])],
               "compiled_functions": "torch._dynamo disabled (eager)",
               "not_run": PREFIX_GROUPER}
    what = (f"unsloth {versions['unsloth']} GRPO sequence packing ({src['file']}:{src['lines']['pack']}; its verifier "
            f"{_fmt_nats(out['verifier_diff'])}, accepts below {src['accept']:g})")
    return _verdict(wb, what, numbers, metrics)


def _fmt_nats(x: float | None) -> str:
    from .workbench import _fmt

    return "not run" if x is None else f"{_fmt(x)} nats"

