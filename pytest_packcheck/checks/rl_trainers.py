"""Preference trainers and the RL trainers' own packing code (issue 44, part 2).

DPO and KTO reduce each completion's per-token log-probs to one number per sequence (TRL: the sum over the
completion, ``per_token_logps.sum(dim=1)``; its length-normalised variants ``sigmoid_norm`` / ``ipo`` divide by the
completion's own token count) and build the loss from the chosen-minus-rejected margin. The checks here run that
code on the cell's model against each sequence alone (:func:`.rl.alone`, the one reference), in nats:

- ``rl_trl_dpo``: TRL's ``DPOTrainer._compute_loss`` on TRL's own ``DataCollatorForPreference`` batch (chosen and
  rejected concatenated along the batch, right-padded), the reference log-probs precomputed from each sequence alone,
  so the initial loss must be ``ln 2`` (``-logsigmoid(0)``) and the logged ``logps/chosen`` / ``logps/rejected`` the
  sequences' own sums;
- ``rl_trl_kto``: TRL's ``KTOTrainer._compute_loss`` on its ``DataCollatorForUnpairedPreference`` batch, likewise;
- ``rl_preference_packed``: the same pairs in one padding-free row (``position_ids`` restarting, ``cu_seq_lens_q``),
  each completion reduced per segment as a padding-free preference collator's reducer reads the row (segments from
  ``cu_seq_lens_q``): sum, per-sequence mean, and the DPO loss at the reference;
- ``rl_verl_rmpad``: verl's remove-padding path (``use_remove_padding=True``): ``unpad_input`` with the
  ``attention_mask``, labels rolled over the row, ``logprobs_from_logits``, ``pad_input`` back and the response slice,
  with verl's own functions (imported from the installed wheel without its package ``__init__``, which imports ray);
- ``rl_openrlhf_packed``: OpenRLHF's ``Actor.forward`` with ``packing_samples`` (its module imported with
  flash-attn's own ``bert_padding`` source and deepspeed stubbed, :mod:`.stand_ins`, both named in the cell);
- ``rl_swift_padding_free``: ms-swift's padding-free DPO ``concatenated_forward`` (modelscope stubbed, named); where
  a module still does not import, a skip naming the package it needs (never a silent pass).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

from ..results import CheckResult
from .rl import RLSample, _model_copy, _trl_crash, _trl_version, alone, completion_logprobs, fused_head_blocker, rl_samples
from .workbench import Workbench, _fmt

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------------------
# preference pairs and their reference


def preference_pairs(wb: Workbench) -> list[tuple[RLSample, RLSample]]:
    """(chosen, rejected) pairs from the workbench's examples: the GRPO group's two completions of one prompt, then one
    pair per other prompt whose rejected completion is the chosen one with every token id shifted by one (mod the
    vocabulary), so the two always differ. Completions of one token and up."""
    samples = rl_samples(wb.examples)
    vocab = int(getattr(wb.config, "vocab_size", 0) or 0) or 1 + max(t for s in samples for t in s.tokens)
    pairs: list[tuple[RLSample, RLSample]] = []
    if len(samples) >= 2 and samples[0].group == samples[1].group:
        pairs.append((samples[0], samples[1]))
        samples = samples[2:]
    for s in samples:
        pairs.append((s, RLSample(s.prompt, tuple((t + 1) % vocab for t in s.completion), group=s.group)))
    return pairs


def sequence_logps(wb: Workbench, pairs: list[tuple[RLSample, RLSample]]) -> tuple[list[float], list[float], list[int], list[int]]:
    """The reference: each chosen and rejected sequence run alone, its completion log-probs (temperature 1) summed.
    Returns (chosen sums, rejected sums, chosen lengths, rejected lengths); sums in nats, lengths in tokens."""
    flat = [s for pair in pairs for s in pair]
    sums = [float(lp.sum()) for lp, _ in alone(wb, flat, 1.0)]
    return sums[0::2], sums[1::2], [len(c.completion) for c, _ in pairs], [len(r.completion) for _, r in pairs]


def dpo_loss(chosen: list[float], rejected: list[float], ref_chosen: list[float], ref_rejected: list[float],
             beta: float = 0.1) -> float:
    """TRL's ``sigmoid`` DPO loss (trl/trainer/dpo_trainer.py ``_compute_loss``): the mean over pairs of
    ``-logsigmoid(beta * ((c - ref_c) - (r - ref_r)))``; ``ln 2`` when the policy's sums are the reference's."""
    out = 0.0
    for c, r, rc, rr in zip(chosen, rejected, ref_chosen, ref_rejected, strict=True):
        z = beta * ((c - rc) - (r - rr))
        out += math.log1p(math.exp(-z)) if z > -30 else -z
    return out / len(chosen)


def _margins(chosen: list[float], rejected: list[float]) -> list[float]:
    return [c - r for c, r in zip(chosen, rejected, strict=True)]


def _preference_verdict(what: str, metrics: dict[str, Any], atol: float, cause: str) -> CheckResult:
    """Pass when every per-sequence sum and margin is within ``atol`` nats and the loss at the reference is
    ``metrics["expected_loss"]`` within ``atol``; else fail with ``cause``. ``metrics`` holds
    ``max_abs_seq_logprob_diff``, ``max_abs_margin_diff``, ``initial_loss`` and ``expected_loss``."""
    seq, margin, loss = metrics["max_abs_seq_logprob_diff"], metrics["max_abs_margin_diff"], metrics["initial_loss"]
    expected = metrics["expected_loss"]
    if not all(math.isfinite(x) for x in (seq, margin, loss)):
        return CheckResult("fail", metrics, f"{what}: a non-finite sequence log-prob or loss", cause="non_finite",
                           evidence={"initial_loss": loss})
    message = (f"{what}: sequence log-probs {_fmt(seq)} nats, preference margin {_fmt(margin)} nats, initial loss "
               f"{loss:.4f} (at the reference {expected:.4f}; {loss / LN2:.2f} x ln 2) (tol {_fmt(atol)})")
    if max(seq, margin, abs(loss - expected)) <= atol:
        return CheckResult("pass", metrics, message)
    return CheckResult("fail", metrics, message, cause=cause,
                       evidence={"max_abs_seq_logprob_diff": seq, "max_abs_margin_diff": margin, "initial_loss": loss,
                                 "loss_over_ln2": loss / LN2, "atol": atol})


def _too_few(wb: Workbench) -> CheckResult | None:
    if len(preference_pairs(wb)) < 2:
        return CheckResult("skipped", {}, "preference pairs need two examples of at least 2 tokens (a prompt and a "
                                          "completion each): lengthen --packcheck-lengths")
    return None


# ------------------------------------------------------------------------------------------------------------
# TRL's DPO and KTO, their own code


def _trl_trainer(wb: Workbench, model: Any, kind: str) -> Any:
    """A TRL ``DPOTrainer`` / ``KTOTrainer`` on ``model`` (a copy of the cell's model, eval mode: no dropout) with the
    reference log-probs precomputed (``precompute_ref_logps`` set after construction: the batch carries them), on CPU,
    fp32, nothing trained. Raises whatever TRL raises."""
    import copy
    import tempfile

    from datasets import Dataset

    from .sft_setup import _quiet_datasets, offline_tokenizer

    tokenizer = offline_tokenizer(int(wb.config.vocab_size))
    common = {"per_device_train_batch_size": 2, "max_steps": 1, "report_to": [], "use_cpu": True, "bf16": False,
              "save_strategy": "no"}
    with tempfile.TemporaryDirectory() as out, _quiet_datasets():
        if kind == "dpo":
            from trl import DPOConfig, DPOTrainer

            data = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2)
            trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(output_dir=out, **common),
                                 train_dataset=data, processing_class=tokenizer)
        else:
            from trl import KTOConfig, KTOTrainer

            data = Dataset.from_list([{"prompt": "a b", "completion": " c", "label": True},
                                      {"prompt": "a b", "completion": " d", "label": False}])
            trainer = KTOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=tokenizer,
                                 args=KTOConfig(output_dir=out, loss_type="apo_zero_unpaired", **common), train_dataset=data)
    trainer.precompute_ref_logps = True
    # MoE models add router_aux_loss_coef * aux_loss to the loss (trl 1.16.0 _compute_loss); the preference loss is
    # compared here, the aux term is no preference reduction (qwen3_moe: +2.1e-03 on ln 2 with it)
    trainer.aux_loss_enabled = False
    model.eval()
    return trainer


def _logged(trainer: Any, key: str) -> float:
    return float(trainer._metrics["eval"][key][-1])


def check_rl_trl_dpo(wb: Workbench) -> CheckResult:
    """TRL's DPO forward and reduction, its own code: ``DPOTrainer._compute_loss`` on ``DataCollatorForPreference``'s
    batch (prompt + chosen rows, then prompt + rejected rows, right-padded, ``attention_mask``), one pair per call and
    then all pairs at once (padding across pairs), with ``ref_chosen_logps`` / ``ref_rejected_logps`` from each
    sequence alone. The logged ``logps/chosen`` and ``logps/rejected`` (the per-sequence sums TRL reduces to) must be
    the reference's and the loss ``ln 2``. The trainer's machinery is not started (no ``train()``)."""
    short = _too_few(wb)
    if short:
        return short
    import torch

    try:
        from trl.trainer.dpo_trainer import DataCollatorForPreference
    except ImportError as exc:
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()}'s DPO DataCollatorForPreference "
                           f"does not import here ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})")
    from trl import DPOTrainer

    if not hasattr(DPOTrainer, "_compute_loss"):
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()}'s DPOTrainer has no _compute_loss "
                           "(its concatenated_forward reads prompt_input_ids / chosen_input_ids): the check reads the "
                           "chosen_ids / rejected_ids collator and _compute_loss of later releases (trl 0.29.1 has both)")
    blocked = fused_head_blocker("DPOTrainer._compute_loss")
    if blocked:
        return blocked
    pairs = preference_pairs(wb)
    ref_c, ref_r, _, _ = sequence_logps(wb, pairs)
    rows = [{"prompt_ids": list(c.prompt), "chosen_ids": list(c.completion), "rejected_ids": list(r.completion),
             "ref_chosen_logps": rc, "ref_rejected_logps": rr} for (c, r), rc, rr in zip(pairs, ref_c, ref_r, strict=True)]
    collate = DataCollatorForPreference(pad_token_id=wb.pad_id)
    got_c, got_r = [], []
    try:
        with _model_copy(wb) as model:
            trainer = _trl_trainer(wb, model, "dpo")
            with torch.no_grad():
                for row in rows:
                    trainer._compute_loss(model, _on(collate([row]), wb.device), return_outputs=False)
                    got_c.append(_logged(trainer, "logps/chosen"))
                    got_r.append(_logged(trainer, "logps/rejected"))
                loss = float(trainer._compute_loss(model, _on(collate(rows), wb.device), return_outputs=False))
    except Exception as exc:  # noqa: BLE001 - TRL's code raised on this model: the cell says where
        return _trl_crash("DPOTrainer._compute_loss", exc)
    metrics = _pair_metrics(got_c, got_r, ref_c, ref_r, loss, wb)
    metrics["trl"] = _trl_version()
    return _preference_verdict(f"trl {_trl_version()} DPO concatenated forward ({len(pairs)} pairs, padded)", metrics,
                               wb.tol["logits_atol"], "packed_mismatch")


def check_rl_trl_kto(wb: Workbench) -> CheckResult:
    """TRL's KTO forward and reduction, its own code: ``KTOTrainer._compute_loss`` (``loss_type="apo_zero_unpaired"``,
    no KL sequences) on ``DataCollatorForUnpairedPreference``'s batch of one desirable and one undesirable completion
    per call (left-padded prompts flushed left, right padding), reference log-probs from each sequence alone. The
    logged ``logps/chosen`` / ``logps/rejected`` must be the sequences' sums, ``rewards/margins`` 0."""
    short = _too_few(wb)
    if short:
        return short
    import torch

    try:
        from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
    except ImportError as exc:
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()} has no stable KTOTrainer with "
                           f"DataCollatorForUnpairedPreference in trl.trainer.kto_trainer ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:120]})")
    from trl.trainer.kto_trainer import KTOTrainer

    if not hasattr(KTOTrainer, "_compute_loss"):
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()}'s KTOTrainer has no _compute_loss: "
                           "the check reads the stable KTOTrainer's (trl.trainer.kto_trainer)")
    blocked = fused_head_blocker("KTOTrainer._compute_loss")
    if blocked:
        return blocked
    pairs = preference_pairs(wb)
    ref_c, ref_r, _, _ = sequence_logps(wb, pairs)
    got_c, got_r, margins, losses = [], [], [], []
    try:
        with _model_copy(wb) as model:
            trainer = _trl_trainer(wb, model, "kto")
            collate = DataCollatorForUnpairedPreference(pad_token_id=wb.pad_id)
            with torch.no_grad():
                for (c, r), rc, rr in zip(pairs, ref_c, ref_r, strict=True):
                    batch = collate([{"prompt_ids": list(c.prompt), "completion_ids": list(c.completion), "label": True},
                                     {"prompt_ids": list(r.prompt), "completion_ids": list(r.completion), "label": False}])
                    batch["ref_logps"] = torch.tensor([rc, rr])
                    losses.append(float(trainer._compute_loss(model, _on(batch, wb.device), return_outputs=False)))
                    got_c.append(_logged(trainer, "logps/chosen"))
                    got_r.append(_logged(trainer, "logps/rejected"))
                    margins.append(_logged(trainer, "rewards/margins"))
    except Exception as exc:  # noqa: BLE001 - TRL's code raised on this model: the cell says where
        return _trl_crash("KTOTrainer._compute_loss", exc)
    # apo_zero_unpaired at the reference: (1 - sigmoid(0)) for the desirable, sigmoid(0) for the undesirable
    metrics = _pair_metrics(got_c, got_r, ref_c, ref_r, max(losses, key=lambda x: abs(x - 0.5)), wb, expected=0.5)
    metrics["max_abs_reward_margin"] = max(abs(m) for m in margins)
    metrics["trl"] = _trl_version()
    return _preference_verdict(f"trl {_trl_version()} KTO forward ({len(pairs)} pairs, padded)", metrics,
                               wb.tol["logits_atol"], "packed_mismatch")


def _on(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}


def _pair_metrics(got_c: list[float], got_r: list[float], ref_c: list[float], ref_r: list[float], loss: float,
                  wb: Workbench, expected: float = LN2) -> dict[str, Any]:
    """Worst per-sequence sum and margin differences (nats) over the pairs; the loss as computed and the loss the
    reduction gives at the reference (``expected``: ``ln 2`` for DPO's sigmoid, 0.5 for KTO's apo_zero_unpaired)."""
    seq = max(abs(a - b) for a, b in zip([*got_c, *got_r], [*ref_c, *ref_r], strict=True))
    margin = max(abs(a - b) for a, b in zip(_margins(got_c, got_r), _margins(ref_c, ref_r), strict=True))
    return {"max_abs_seq_logprob_diff": seq, "max_abs_margin_diff": margin, "initial_loss": loss, "expected_loss": expected,
            "loss_over_ln2": loss / LN2, "pairs": len(got_c), "atol": wb.tol["logits_atol"]}


# ------------------------------------------------------------------------------------------------------------
# the padding-free preference row


def preference_row(wb: Workbench, pairs: list[tuple[RLSample, RLSample]]) -> dict[str, Any]:
    """The padding-free preference batch: every chosen sequence, then every rejected one (TRL's order), in one row
    from the workbench's collator with ``cu_seq_lens_q/k`` (int32, ``(2 * pairs + 1,)``), plus ``prompt_lengths``
    (tokens, one per segment): what ``DPOConfig(padding_free=True)`` asks a collator for."""
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    batch = wb.packed([s.tokens for s in seqs], flash_kwargs=True)
    batch["prompt_lengths"] = [len(s.prompt) for s in seqs]
    return batch


def reduce_packed(logits: Any, batch: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Each segment's completion log-probs (temperature 1) from the packed row's logits ``(N, vocab)``, segments read
    from ``batch["cu_seq_lens_q"]`` as a padding-free reducer reads them: (per-sequence sums in nats, per-sequence
    means in nats per token, each divided by its own completion length)."""
    cu = [int(x) for x in batch["cu_seq_lens_q"].tolist()]
    ids = batch["input_ids"][0]
    sums, means = [], []
    for i, first in enumerate(batch["prompt_lengths"]):
        a, b = cu[i], cu[i + 1]
        lp, _ = completion_logprobs(logits[a:b], ids[a:b], max(1, first), 1.0, with_entropy=False)
        sums.append(float(lp.sum()))
        means.append(float(lp.sum()) / max(1, b - a - first))
    return sums, means


def check_rl_preference_packed(wb: Workbench) -> CheckResult:
    """The preference pairs in one padding-free row (chosen sequences then rejected, ``position_ids`` restarting,
    ``cu_seq_lens_q``), each completion reduced per segment: the per-sequence sum (DPO's ``sigmoid``), the
    per-sequence mean (``sigmoid_norm``, IPO) and the preference margin = each sequence alone, in nats, and the DPO loss
    with the reference from each sequence alone = ``ln 2``. Fails ``collator_contract`` when ``cu_seq_lens_q`` does not
    match the pairs (a spurious padding segment shifts every later sequence onto its neighbour's numbers),
    ``loss_normalisation`` when only the means are off (a row-wide token count where each sequence's was meant)."""
    short = _too_few(wb)
    if short:
        return short
    pairs = preference_pairs(wb)
    ref_c, ref_r, len_c, len_r = sequence_logps(wb, pairs)
    batch = preference_row(wb, pairs)
    segments = int(batch["cu_seq_lens_q"].numel()) - 1
    logits = wb.forward(batch).logits[0].float()
    sums, means = reduce_packed(logits, batch)
    n = len(pairs)
    got_c, got_r = sums[:n], sums[n:2 * n]
    metrics = _pair_metrics(got_c, got_r, ref_c, ref_r, dpo_loss(got_c, got_r, ref_c, ref_r), wb)
    want_means = [s / k for s, k in zip([*ref_c, *ref_r], [*len_c, *len_r], strict=True)]
    metrics["max_abs_mean_logprob_diff"] = max(abs(a - b) for a, b in zip(means[:2 * n], want_means, strict=True))
    metrics["segments"] = segments
    atol = wb.tol["logits_atol"]
    if segments != 2 * n:
        metrics["expected_segments"] = 2 * n
        return CheckResult("fail", metrics, f"padding-free preference row: cu_seq_lens_q has {segments} segments for "
                           f"{2 * n} sequences; sequence log-probs off by {_fmt(metrics['max_abs_seq_logprob_diff'])} nats, "
                           f"initial loss {metrics['initial_loss']:.4f} = {metrics['loss_over_ln2']:.2f} x ln 2",
                           cause="collator_contract", evidence={"segments": segments, "expected_segments": 2 * n,
                                                                "initial_loss": metrics["initial_loss"]})
    result = _preference_verdict(f"padding-free preference row ({n} pairs)", metrics, atol, "leak")
    mean = metrics["max_abs_mean_logprob_diff"]
    if result.status == "pass" and mean > atol:
        return CheckResult("fail", metrics, f"padding-free preference row: sums right, per-sequence means off by "
                           f"{_fmt(mean)} nats per token (tol {_fmt(atol)})", cause="loss_normalisation",
                           evidence={"max_abs_mean_logprob_diff": mean, "atol": atol})
    if result.status == "pass":
        return CheckResult("pass", metrics, result.message + f", means {_fmt(mean)}")
    return result


# ------------------------------------------------------------------------------------------------------------
# verl, OpenRLHF, ms-swift: their own code where it imports


def _bare_package(package: str) -> None:
    """Register ``package`` as a bare namespace over its installed folder (its ``__init__`` not run), unless it is
    imported already. Raises ModuleNotFoundError naming it when it is not installed."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named '{package}'", name=package)
    bare = types.ModuleType(package)
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__spec__ = spec
    sys.modules[package] = bare


def import_without_package_init(package: str, module: str) -> Any:
    """Import ``module`` of ``package`` without running the ``__init__.py`` of ``package`` or of any package between
    it and ``module`` (verl 0.9.1's ``verl/__init__.py`` imports ray for its ``DataProto``, ``verl/utils/__init__.py``
    omegaconf for its config helpers; the remove-padding helpers touch neither): each is registered as a bare
    namespace over its folder first. Raises ImportError (ModuleNotFoundError naming the missing package) as the
    import does; a package already imported is used as it is."""
    parts = module.split(".")
    for i in range(len(package.split(".")), len(parts)):
        _bare_package(".".join(parts[:i]))
    return importlib.import_module(module)


def _dist_version(name: str) -> str:
    from ..versions.libraries import module_version

    return module_version(name)


def _not_importable(trainer: str, dist: str, exc: ImportError, path: str) -> CheckResult:
    """A skip naming what the trainer's path needs: the missing module (and the distribution to install) and the
    release read."""
    missing = getattr(exc, "name", None) or str(exc)
    version = _dist_version(dist)
    got = "not installed" if version == "not installed" else f"{dist} {version}"
    return CheckResult("skipped", {dist: version, "missing_module": missing},
                       f"{trainer}'s {path} does not import here ({got}): it needs '{missing}' "
                       f"({type(exc).__name__}: {' '.join(str(exc).split())[:140]})")


def verl_batch(samples: list[RLSample], pad_id: int, device: str = "cpu") -> tuple[dict[str, Any], int]:
    """verl's rollout layout: prompts left-padded, responses right-padded, ``attention_mask`` on the real tokens,
    ``position_ids`` counted over them (``compute_position_id_with_mask``: ``clip(cumsum(mask) - 1, 0)``). Returns
    the batch (int64 ``(B, P + R)``) and the response width R."""
    batch, _, width = _left_padded(samples, pad_id, device)
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch, width


def _left_padded(samples: list[RLSample], pad_id: int, device: str) -> tuple[dict[str, Any], int, int]:
    from .rl import left_padded_batch

    return left_padded_batch(samples, pad_id, device)


def verl_rmpad_logprobs(wb: Workbench, batch: dict[str, Any], response_length: int, temperature: float, verl: Any) -> Any:
    """verl's remove-padding forward (``use_remove_padding=True``), its functions in its order: ``unpad_input`` of
    ``input_ids`` with the ``attention_mask`` -> ``(1, nnz)``; ``position_ids`` gathered by ``index_first_axis`` at
    the same indices; the model on the row (no ``attention_mask``, ``use_cache=False``); labels
    ``torch.roll(input_ids_rmpad, -1)`` over the whole row (the rolled-in first token of the next sample lands on a
    position the response slice drops); logits divided by ``temperature``; ``logprobs_from_logits``; ``pad_input`` back
    to ``(B, S)``; the response slice ``[:, -R - 1:-1]``. ``verl`` holds verl's ``attention_utils`` and
    ``torch_functional`` modules. Returns float64 ``(B, R)`` log-probs in nats."""
    import torch

    au, tf = verl
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    bsz, seqlen = ids.shape
    ids_rmpad, indices, *_ = au.unpad_input(ids.unsqueeze(-1), mask)
    ids_rmpad = ids_rmpad.transpose(0, 1)  # (1, nnz)
    pos_rmpad = au.index_first_axis(au.rearrange(pos.unsqueeze(-1), "b s ... -> (b s) ..."), indices).transpose(0, 1)
    logits = wb.forward({"input_ids": ids_rmpad, "position_ids": pos_rmpad}).logits.squeeze(0).float()
    rolled = torch.roll(ids_rmpad, shifts=-1, dims=1).squeeze(0)
    logp = tf.logprobs_from_logits(logits=logits / temperature, labels=rolled)
    full = au.pad_input(hidden_states=logp.unsqueeze(-1), indices=indices, batch=bsz, seqlen=seqlen)
    return full.squeeze(-1)[:, -response_length - 1:-1].double().cpu()


def check_rl_verl_rmpad(wb: Workbench) -> CheckResult:
    """verl's remove-padding log-prob path on its rollout batch (:func:`verl_rmpad_logprobs`), with the release's own
    helpers (:func:`import_verl_rmpad`: ``verl.utils.attention_utils``'s pure-torch fallbacks in 0.9, flash-attn's
    ``bert_padding`` source where the release takes it from flash-attn, named) and
    ``verl.utils.torch_functional.logprobs_from_logits``, at the RL temperature, against each sample alone. A skip
    names the package verl's modules need where they do not import (tensordict, cloudpickle). Entropy is not compared
    (``max_abs_entropy_diff`` None: this path gathers log-probs only)."""
    from .rl import RL_TEMPERATURE, _base_metrics, _too_short, _verdict, compare

    short = _too_short(wb)
    if short:
        return short
    try:
        au, tf, stand_ins = import_verl_rmpad()
    except ImportError as exc:
        return _not_importable("verl", "verl", exc, "remove-padding path (verl.utils.attention_utils, torch_functional)")
    samples = rl_samples(wb.examples)
    batch, width = verl_batch(samples, wb.pad_id, wb.device)
    try:
        got = verl_rmpad_logprobs(wb, batch, width, RL_TEMPERATURE, (au, tf))
    except ImportError as exc:  # verl imports einops (its rearrange without flash-attn) on first use
        return _not_importable("verl", "verl", exc, "remove-padding path (verl.utils.attention_utils.rearrange)")
    except Exception as exc:  # noqa: BLE001 - verl's code raised on this model: the cell says where
        return _library_crash("verl", "remove-padding path", exc)
    ref = alone(wb, samples, RL_TEMPERATURE)
    rows = [(got[i, :len(s.completion)], None) for i, s in enumerate(samples)]  # log-probs only: entropy not compared
    numbers = compare(rows, ref)
    metrics = {**numbers, **_base_metrics(wb, samples), "verl": _dist_version("verl"), "response_length": width,
               "stand_ins": stand_ins}
    what = f"verl {_dist_version('verl')} remove-padding path" + (f" ({'; '.join(stand_ins)})" if stand_ins else "")
    return _verdict(wb, what, numbers, metrics)


def _unpads_on_cpu(au: Any) -> bool:
    """Whether ``au.unpad_input`` runs here (verl 0.6-0.8's ``attention_utils`` picks flash-attn's or the NPU's by
    device and has no CPU branch: it raises on first use)."""
    import torch

    try:
        au.unpad_input(torch.ones(1, 2, 1), torch.ones(1, 2, dtype=torch.long))
    except Exception:  # noqa: BLE001 - any failure: not runnable on CPU as the release ships it
        return False
    return True


def import_verl_rmpad() -> tuple[Any, Any, list[str]]:
    """verl's remove-padding helpers as the installed release runs them: (the module holding ``unpad_input`` /
    ``index_first_axis`` / ``pad_input`` / ``rearrange``, ``verl.utils.torch_functional``, the stand-ins named).

    verl 0.9 ships pure-torch fallbacks in ``verl/utils/attention_utils.py``; verl 0.6-0.8's ``attention_utils`` take
    ``flash_attn.bert_padding`` on CUDA and have no CPU branch; verl 0.2-0.5's actor imports ``flash_attn.bert_padding``
    directly (``verl/workers/actor/dp_actor.py``). Where the release's own module does not unpad on CPU, the functions
    are flash-attn's ``bert_padding`` (what the release runs on CUDA), from flash-attn's source
    (:func:`.stand_ins.flash_attn_stand_in`, named). Raises ImportError naming what is missing."""
    from .stand_ins import flash_attn_stand_in

    tf = import_without_package_init("verl", "verl.utils.torch_functional")
    try:
        au = import_without_package_init("verl", "verl.utils.attention_utils")
    except ModuleNotFoundError as exc:
        if exc.name != "verl.utils.attention_utils":
            raise
        au = None
    if au is not None and _unpads_on_cpu(au):
        return au, tf, []
    with flash_attn_stand_in() as fa:
        padding = importlib.import_module("flash_attn.bert_padding")
    where = "verl.utils.attention_utils has no CPU branch" if au is not None else "the release's actor imports it"
    return padding, tf, [f"{fa} ({where})"] if fa else []


def _library_crash(dist: str, where: str, exc: BaseException) -> CheckResult:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    # the file as the package has it: after site-packages/ or an unpacked wheel's folder (rl_wheels)
    where = re.sub(r"^.*/unpacked/[^/]+/", "", frames[-1].filename.rsplit("site-packages/", 1)[-1]) if frames else ""
    last = f"{where}:{frames[-1].lineno}" if frames else "?"
    version = _dist_version(dist)
    return CheckResult("error", {dist: version, "raised_at": last},
                       f"{dist} {version} {where} raised {type(exc).__name__}: {' '.join(str(exc).split())[:160]} (at {last})",
                       cause="crash", evidence={"exception": type(exc).__name__, "raised_at": last})


#: The trainers' packed paths as a skip names them: distribution -> (package, module, the path in words).
PACKED_PATHS = {
    "openrlhf": ("openrlhf", "openrlhf.models.actor", ("packed samples (openrlhf.models.actor: Actor.forward with "
                 "packing_samples, ring_attn_utils' unpad_and_slice_tensor / gather_and_pad_tensor)")),
    "ms-swift": ("swift", "swift.rlhf_trainers.dpo_trainer", ("padding-free RLHF (swift.rlhf_trainers.dpo_trainer: "
                 "concatenated_forward with padding_free)")),
}


def import_openrlhf_actor() -> tuple[Any, list[str]]:
    """``openrlhf.models.actor`` imported without ``openrlhf/__init__.py`` and ``openrlhf/models/__init__.py`` (they
    import the trainers, ray and deepspeed), and the stand-ins it needed (:mod:`.stand_ins`, named in the cell):
    openrlhf 0.11.2's ``models/ring_attn_utils.py:3-4`` import ``flash_attn.bert_padding`` (pure torch) and
    ``flash_attn.utils.distributed.all_gather`` (ring attention only) through the CUDA ``flash_attn`` package, and
    ``models/utils.py:4`` imports ``deepspeed`` (``set_z3_leaf_modules`` only). Cached after the first import (the
    stand-ins are then recorded, not rebuilt). Raises ImportError naming what is still missing (``einops``, ``peft``)."""
    from .stand_ins import flash_attn_stand_in, stub_module

    if "openrlhf" in sys.modules and "openrlhf.models.actor" in sys.modules and "openrlhf" in _STAND_INS:
        return sys.modules["openrlhf.models.actor"], _STAND_INS["openrlhf"]
    for package in ("openrlhf", "openrlhf.models"):
        _bare_package(package)
    with flash_attn_stand_in() as fa, stub_module("deepspeed", "only set_z3_leaf_modules (ZeRO-3) calls it, never here") as ds:
        actor = importlib.import_module("openrlhf.models.actor")
    _STAND_INS["openrlhf"] = [x for x in (fa, ds) if x]
    return actor, _STAND_INS["openrlhf"]


_STAND_INS: dict[str, list[str]] = {}
#: What ``Actor.__init__`` sets ``model.config.use_cache`` to (openrlhf 0.11.2 models/actor.py:210).
OPENRLHF_USE_CACHE = False


def openrlhf_logprobs(actor_module: Any, model: Any, batch: dict[str, Any], action_mask: Any, temperature: float) -> tuple[Any, Any]:
    """OpenRLHF's ``Actor.forward`` with ``packing_samples=True`` and ``return_entropy=True``, its own code on a
    stand-in ``self`` (``model``, ``temperature``; no DeepSpeed, no ring attention): ``unpad_and_slice_tensor`` removes
    the padding into one row (``position_ids`` from the ``attention_mask`` per sample, labels = the sequences rolled per
    row before unpadding), the model runs without an attention mask, logits in fp32 divided by ``temperature``,
    ``compute_entropy`` and ``log_probs_from_logits`` (its torch fallback: ``flash_attn.ops.triton.cross_entropy`` is
    CUDA-only), ``gather_and_pad_tensor`` back to ``(B, S)``, the last ``A`` columns (log-probs times
    ``action_mask``). ``compute_entropy`` is ``@torch.compile``d (openrlhf 0.11.2 models/utils.py:215): it runs with
    ``torch._dynamo`` disabled, i.e. OpenRLHF's own function body eagerly (inductor on CPU would compile C++ per shape
    for the same arithmetic). Returns float64 ``(B, A)`` log-probs and entropies in nats."""
    import torch

    # Actor.__init__ sets model.config.use_cache = False (openrlhf 0.11.2 models/actor.py:210) and forward passes no
    # use_cache: with the cache on, transformers does not read the packed row from position_ids (masking_utils: only
    # without a cache) and the samples attend each other on sdpa / eager
    model.config.use_cache = OPENRLHF_USE_CACHE
    stand_in = type("ActorStandIn", (), {"packing_samples": True, "model": model, "temperature": temperature})()
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        logps, output = actor_module.Actor.forward(stand_in, batch["input_ids"], action_mask=action_mask,
                                                   attention_mask=batch["attention_mask"], return_output=True,
                                                   return_entropy=True)
    width = action_mask.shape[1]
    return logps.double().cpu(), output.entropy[:, -width:].double().cpu()


def check_rl_openrlhf_packed(wb: Workbench) -> CheckResult:
    """OpenRLHF's packed samples (``packing_samples=True``), its own code (:func:`openrlhf_logprobs`) on its rollout
    layout (prompts left-padded, responses right-padded, ``action_mask`` on the response tokens) at the RL temperature,
    against each sample alone: log-probs and OpenRLHF's own entropies (``compute_entropy`` run eagerly). Its module
    imports with the stand-ins :func:`import_openrlhf_actor` names (in the message and ``metrics["stand_ins"]``); a
    package still missing is a skip naming it."""
    from .rl import RL_TEMPERATURE, _base_metrics, _too_short, _verdict, compare

    short = _too_short(wb)
    if short:
        return short
    try:
        actor, stand_ins = import_openrlhf_actor()
    except ImportError as exc:
        return _not_importable("openrlhf", "openrlhf", exc, PACKED_PATHS["openrlhf"][2])
    except Exception as exc:  # noqa: BLE001 - the release's module raised at import: the cell says where
        return _library_crash("openrlhf", f"{PACKED_PATHS['openrlhf'][2]} import", exc)
    import inspect

    import torch

    samples = rl_samples(wb.examples)
    version = _dist_version("openrlhf")
    params = inspect.signature(actor.Actor.forward).parameters
    # the release's own temperature: a forward that never reads self.temperature scores the logits as they are
    source = inspect.getsource(actor.Actor.forward)
    own_t = RL_TEMPERATURE if "temperature" in source else 1.0
    entropy_t = openrlhf_entropy_temperature(source, own_t)
    n = [len(s.completion) for s in samples]
    width = max(n)
    try:
        with _model_copy(wb) as model:
            if "action_mask" in params:  # 0.7 on: unpad_and_slice_tensor / gather_and_pad_tensor
                batch, width = verl_batch(samples, wb.pad_id, wb.device)
                action_mask = torch.tensor([[1] * k + [0] * (width - k) for k in n], device=wb.device)
                got, entropy = openrlhf_logprobs(actor, model, batch, action_mask, own_t)
                rows_got = [(got[i, :k], entropy[i, :k]) for i, k in enumerate(n)]
            elif "packed_seq_lens" in params:  # 0.4-0.6: the experience maker packs, forward slices per sample
                rows_got = [(lp, None) for lp in openrlhf_packed_seq_lens_logprobs(actor, model, samples, own_t, wb.device)]
            else:
                return CheckResult("skipped", {"openrlhf": version, "stand_ins": stand_ins},
                                   f"openrlhf {version}'s Actor.forward has no per-sample packed path (num_actions is one "
                                   "int for the row, no packed_seq_lens): its packing_samples packs SFT / DPO / RM "
                                   "batches through packing_utils.patch_for_block_diag_attn (flash_attention_2 only)")
    except Exception as exc:  # noqa: BLE001 - OpenRLHF's code raised on this model: the cell says where
        return _library_crash("openrlhf", "Actor.forward (packing_samples)", exc)
    ref = alone(wb, samples, own_t)
    rows = rows_got  # a release whose forward computes no entropy: (log-probs, None), entropy not compared
    if rows_got[0][1] is not None and entropy_t != own_t:  # entropy of the untempered logits: the reference's is too
        ref = [(r[0], r1[1]) for r, r1 in zip(ref, alone(wb, samples, entropy_t), strict=True)]
    numbers = compare(rows, ref)
    metrics = {**numbers, **_base_metrics(wb, samples), "openrlhf": version, "response_length": width,
               "stand_ins": stand_ins, "entropy_compared": rows_got[0][1] is not None, "logprob_temperature": own_t,
               "entropy_temperature": entropy_t if rows_got[0][1] is not None else None,
               "compute_entropy": "torch._dynamo disabled (eager)"}
    notes = [x for x in (
        "log-probs at temperature 1: this release's Actor.forward applies no temperature" if own_t == 1.0 else "",
        "entropy of the untempered logits (compute_entropy before the temperature)" if entropy_t != own_t else "",
        "log-probs only: this release's Actor.forward computes no entropy" if rows_got[0][1] is None else "") if x]
    what = (f"openrlhf {version} Actor.forward packing_samples" + (f" ({'; '.join(stand_ins)})" if stand_ins else "")
            + (f" [{'; '.join(notes)}]" if notes else ""))
    return _verdict(wb, what, numbers, metrics)


def openrlhf_entropy_temperature(source: str, temperature: float) -> float:
    """The temperature of the distribution whose entropy a release's ``Actor.forward`` (its ``source``) reports:
    ``temperature`` where the logits are divided in place before ``compute_entropy`` (openrlhf 0.11:
    ``output["logits"].div_(self.temperature)``), else 1 (0.7-0.10 pass ``temperature=`` to
    ``log_probs_from_logits`` only, so ``compute_entropy`` reads the untempered logits)."""
    import re

    at = source.find("compute_entropy(")
    divided = re.search(r"""output\[["']logits["']\]\.div_?\(self\.temperature\)""", source)
    return temperature if at < 0 or (divided is not None and divided.start() < at) else 1.0


def openrlhf_packed_seq_lens_logprobs(actor_module: Any, model: Any, samples: list[RLSample], temperature: float,
                                      device: str = "cpu") -> list[Any]:
    """OpenRLHF 0.4-0.6's packed samples, its own ``Actor.forward`` on the layout its experience maker builds: every
    sample in one row, ``attention_mask`` = the sample's index (1, 2, ...) on its tokens (``reset_position_ids`` reads
    the positions from it), ``num_actions`` and ``packed_seq_lens`` per sample; forward slices each sample's actions
    off the row. Returns each sample's completion log-probs (float64, nats)."""
    import torch

    ids = torch.tensor([[t for s in samples for t in s.tokens]], device=device)
    mask = torch.tensor([[i + 1 for i, s in enumerate(samples) for _ in s.tokens]], device=device)
    model.config.use_cache = OPENRLHF_USE_CACHE
    stand_in = type("ActorStandIn", (), {"packing_samples": True, "model": model, "temperature": temperature})()
    with torch.no_grad():
        out = actor_module.Actor.forward(stand_in, ids, num_actions=[len(s.completion) for s in samples],
                                         attention_mask=mask, packed_seq_lens=[len(s.tokens) for s in samples])
    flat, rows, offset = out[0].double().cpu(), [], 0
    for s in samples:
        rows.append(flat[offset:offset + len(s.completion)])
        offset += len(s.completion)
    return rows


#: What ms-swift 4.6.0 reads from modelscope while ``swift.rlhf_trainers.dpo_trainer`` imports (swift/utils/logger.py
#: calls ``get_logger()`` and sets a formatter on its first handler; the hub functions are bound, never called here).
MODELSCOPE_NAMES = {
    "modelscope.utils.logger": ("get_logger",),
    "modelscope.hub.utils.utils": ("get_cache_dir",),
    "modelscope.hub.file_download": ("model_file_download",),
    "modelscope.hub.api": ("HubApi", "ModelScopeConfig"),
    "modelscope": ("check_local_model_is_latest", "snapshot_download"),
}


def _modelscope_logger(*_args: Any, **_kwargs: Any) -> Any:
    import logging

    logger = logging.getLogger("packcheck.modelscope_stand_in")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


def import_swift_dpo() -> tuple[Any, list[str]]:
    """ms-swift's ``swift.rlhf_trainers.dpo_trainer`` without ``swift/__init__.py`` and ``swift/rlhf_trainers/__init__.py``,
    and the stand-ins it needed: ``modelscope`` stubbed (:data:`MODELSCOPE_NAMES`: its logger and the hub functions
    ms-swift binds at import; a hub function called raises naming modelscope). Raises ImportError naming what is still
    missing (ms-swift 4.6.0 on trl 1.x: ``trl.experimental.bco``, its RunningMoments; it declares trl < 1.0).

    ms-swift 4.6.0's ``swift/rlhf_trainers/dpo_trainer.py:28`` runs ``del HFDPOTrainer.__init__`` at import (its
    trainer takes its mixins' ``__init__``): TRL's own ``DPOTrainer`` then has no ``__init__`` of its own in the
    process, so a later ``DPOTrainer(...)`` (``rl_trl_dpo``) would run ``Trainer.__init__``. Every attribute the
    import replaces or deletes in a loaded ``trl`` or ``transformers`` module or one of their classes is put back
    (:func:`_undo_import_patches`)."""
    from .stand_ins import never_called, stub_tree

    name = swift_dpo_module()
    if "swift" in sys.modules and name in sys.modules and "ms-swift" in _STAND_INS:
        return sys.modules[name], _STAND_INS["ms-swift"]
    # swift/__init__.py (its lazy importer of every trainer) and the trainer package's __init__ are not run; a package
    # between them (ms-swift 3.x: swift.trainers, whose names dpo_trainer imports) is imported as the release has it
    for package in ("swift", name.rsplit(".", 1)[0]):
        _bare_package(package)
    attrs = {module: {n: (_modelscope_logger if n == "get_logger" else never_called(f"{module}.{n}", "modelscope"))
                      for n in names} for module, names in MODELSCOPE_NAMES.items()}
    with (_undo_import_patches(),
          stub_tree("modelscope", "only its logger and hub functions are bound at import, none called here", attrs) as ms):
        module = importlib.import_module(name)
    _STAND_INS["ms-swift"] = [ms] if ms else []
    return module, _STAND_INS["ms-swift"]


#: ms-swift's DPO trainer module: 4.0 on, then 3.x (``swift/trainers/rlhf_trainer/dpo_trainer.py``).
SWIFT_DPO_MODULES = ("swift.rlhf_trainers.dpo_trainer", "swift.trainers.rlhf_trainer.dpo_trainer")


def swift_dpo_module() -> str:
    """The installed ms-swift's DPO trainer module (:data:`SWIFT_DPO_MODULES`, read from its files without importing
    it). Raises ModuleNotFoundError naming ``swift`` when ms-swift is not installed."""
    from pathlib import Path

    spec = sys.modules["swift"].__spec__ if "swift" in sys.modules else importlib.util.find_spec("swift")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'swift'", name="swift")
    for name in SWIFT_DPO_MODULES:
        rel = Path(*name.split(".")[1:]).with_suffix(".py")
        if any((Path(root) / rel).is_file() for root in spec.submodule_search_locations):
            return name
    return SWIFT_DPO_MODULES[0]


@contextlib.contextmanager
def _undo_import_patches(packages: tuple[str, ...] = ("trl", "transformers"),
                         first: str | None = "trl.trainer.dpo_trainer") -> Iterator[None]:
    """``first`` imported (TRL's ``DPOTrainer`` by default), then on exit every attribute that a loaded module of
    ``packages``, or a class defined in one, lost or had replaced in the block is put back (a trainer module that
    patches them at import: ms-swift 4.6.0's ``del HFDPOTrainer.__init__`` in ``rlhf_trainers/dpo_trainer.py:28``, and
    its ``swift/trainers/patcher.py:106-108``, which sets ``transformers.trainer.DEFAULT_CALLBACKS`` to a callback
    reading ``args.max_epochs``: every later Trainer in the process raised AttributeError at its first epoch's end;
    unsloth_zoo's ``temporary_patches/common.py``, which sets ``torch._inductor.async_compile.tqdm``: a later
    ``torch.compile`` in the process raised ModuleNotFoundError 'unsloth_zoo' once the wheel left the path). Names the
    block adds (a submodule imported) stay."""
    if first:
        with contextlib.suppress(ImportError):
            importlib.import_module(first)
    dotted = tuple(f"{p}." for p in packages)

    def ours(name: str) -> bool:
        return name in packages or name.startswith(dotted)

    import warnings

    with warnings.catch_warnings():  # a deprecated module attribute warns when looked at (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        modules = {name: (m, dict(vars(m))) for name, m in list(sys.modules.items()) if ours(name) and m is not None}
        classes = {id(c): (c, dict(vars(c))) for m, saved in modules.values() for c in saved.values()
                   if isinstance(c, type) and ours(getattr(c, "__module__", "") or "")}
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for owner, saved in [*modules.values(), *classes.values()]:
                now = vars(owner)
                for key, value in saved.items():
                    if key not in now or now[key] is not value:
                        with contextlib.suppress(AttributeError, TypeError):
                            setattr(owner, key, value)


def swift_padding_free_row(pairs: list[tuple[RLSample, RLSample]], device: str = "cpu") -> dict[str, Any]:
    """ms-swift's padding-free DPO batch (its template with ``padding_free=True``): every chosen sequence then every
    rejected one in one row, ``position_ids`` restarting per sequence, ``labels`` = the token ids on the completion and
    -100 on the prompt (not shifted: ``concatenated_forward`` rolls them)."""
    import torch

    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    ids = [t for s in seqs for t in s.tokens]
    labels = [t for s in seqs for t in [-100] * len(s.prompt) + list(s.completion)]
    pos = [p for s in seqs for p in range(len(s.tokens))]
    return {"input_ids": torch.tensor([ids], device=device), "labels": torch.tensor([labels], device=device),
            "position_ids": torch.tensor([pos], device=device)}


def swift_sequence_logps(module: Any, model: Any, batch: dict[str, Any]) -> tuple[list[float], list[float]]:
    """ms-swift's ``DPOTrainer.concatenated_forward`` on the padding-free row, its own code on an instance built
    without ``__init__`` (the trainer is never started): ``template.padding_free=True``, no sequence parallelism,
    ``logits_to_keep`` off, ``ld_alpha`` None, ``loss_type`` "sigmoid" (TRL's default; ms-swift 4.0-4.4's
    ``concatenated_forward`` reads it to length-normalise for IPO). Returns (chosen sums, rejected sums) in nats, as it hands them to
    ``dpo_loss``."""
    import types as _types

    import torch

    trainer = object.__new__(module.DPOTrainer)
    trainer.__dict__.update({"template": _types.SimpleNamespace(padding_free=True, sequence_parallel_size=1),
                             "aux_loss_enabled": False, "is_encoder_decoder": False, "label_pad_token_id": -100,
                             "args": _types.SimpleNamespace(ld_alpha=None), "loss_type": "sigmoid",
                             "get_use_logits_to_keep": lambda *_a, **_k: False})
    with torch.no_grad():
        out = module.DPOTrainer.concatenated_forward(trainer, model, dict(batch))
    return [float(x) for x in out["chosen_logps"]], [float(x) for x in out["rejected_logps"]]


def check_rl_swift_padding_free(wb: Workbench) -> CheckResult:
    """ms-swift's padding-free DPO (``padding_free=True``): its own ``concatenated_forward`` (one row, labels rolled
    over the row, ``get_per_token_logps``, segments from ``get_cu_seqlens(position_ids)``, ``_packed_sequence_sum``) on
    the preference pairs; the per-sequence sums and the margin = each sequence alone, the DPO loss at the reference
    ``ln 2``. Its module imports with modelscope stubbed (named); where it still does not import (ms-swift 4.6.0 on
    trl >= 1.0, outside its declared ``trl<1.0``) the skip names the module and ms-swift's declared requirements."""
    short = _too_few(wb)
    if short:
        return short
    try:
        module, stand_ins = import_swift_dpo()
    except ImportError as exc:
        path = PACKED_PATHS["ms-swift"][2]
        with contextlib.suppress(ImportError):  # the release's own module (ms-swift 3.x: swift.trainers.rlhf_trainer)
            path = path.replace(SWIFT_DPO_MODULES[0], swift_dpo_module())
        result = _not_importable("ms-swift", "ms-swift", exc, path)
        declared = _declared("ms-swift", ("trl", "transformers"))
        if declared:
            result.metrics["declared"] = declared
            result = CheckResult("skipped", result.metrics, f"{result.message}; ms-swift declares {declared}")
        return result
    except Exception as exc:  # noqa: BLE001 - the release's module raised at import: the cell says where
        return _library_crash("ms-swift", f"{PACKED_PATHS['ms-swift'][2]} import", exc)
    pairs = preference_pairs(wb)
    ref_c, ref_r, _, _ = sequence_logps(wb, pairs)
    try:
        with _model_copy(wb) as model:
            got_c, got_r = swift_sequence_logps(module, model, swift_padding_free_row(pairs, wb.device))
    except Exception as exc:  # noqa: BLE001 - ms-swift's code raised on this model: the cell says where
        return _library_crash("ms-swift", "DPOTrainer.concatenated_forward (padding_free)", exc)
    version = _dist_version("ms-swift")
    if len(got_c) != len(pairs) or len(got_r) != len(pairs):
        # get_cu_seqlens read another number of segments off position_ids than sequences in the row
        metrics = {"ms-swift": version, "chosen_sums": len(got_c), "rejected_sums": len(got_r), "pairs": len(pairs),
                   "max_abs_seq_logprob_diff": math.inf, "max_abs_margin_diff": math.inf, "stand_ins": stand_ins}
        return CheckResult("fail", metrics, f"ms-swift {version} padding-free DPO: {len(got_c)} chosen and {len(got_r)} "
                           f"rejected sums for {len(pairs)} pairs (segments from position_ids do not match the sequences)",
                           cause="collator_contract", evidence={"chosen_sums": len(got_c), "rejected_sums": len(got_r),
                                                                "pairs": len(pairs)})
    metrics = _pair_metrics(got_c, got_r, ref_c, ref_r, dpo_loss(got_c, got_r, ref_c, ref_r), wb)
    metrics.update({"ms-swift": version, "trl": _trl_version(), "stand_ins": stand_ins})
    what = (f"ms-swift {version} padding-free DPO concatenated_forward ({len(pairs)} pairs, one row"
            + (f"; {'; '.join(stand_ins)}" if stand_ins else "") + ")")
    return _preference_verdict(what, metrics, wb.tol["logits_atol"], "packed_mismatch")


def _declared(dist: str, names: tuple[str, ...]) -> str:
    """``dist``'s declared requirements on ``names`` (its metadata, without extras), e.g. "trl<1.0,>=0.15"; "" when
    it is not installed."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        return ""
    picked = [r.split(";")[0].replace(" ", "") for r in reqs if "extra ==" not in r
              and re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() in names]
    return ", ".join(dict.fromkeys(picked))
