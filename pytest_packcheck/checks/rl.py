"""RL training: per-token log-probs of completion tokens, as RL trainers compute them (issue 44).

RL trainers do not use the model's loss. TRL's GRPO / RLOO, TRL's AsyncGRPO (padding-free since 1.7, tree packing in
1.16), verl (``use_remove_padding=True``), OpenRLHF (``packing_samples``) gather the log-prob of each completion
token from a forward, with labels shifted within each sample, and reduce them in their own loss: the policy ratio
``exp(logp - old_logp)``, the KL term, the entropy bonus. A wrong boundary there is silent. The checks here feed the
model RL-shaped samples (a prompt and a completion each, several completions of one prompt as a GRPO group, a
sampling temperature) and compare every completion token's log-prob and entropy with the same sample run alone:

- ``rl_logprobs``: one padding-free row (``position_ids`` restarting per sample, as the trainers' remove-padding
  paths feed it), gathered per segment;
- ``rl_padded``: the left-padded prompt / right-padded completion batch GRPO builds, without ``position_ids`` (as
  ``GRPOTrainer._get_per_token_logps_and_entropies`` calls the model) and with them (a hazard: a padded path can be
  the wrong one);
- ``rl_trl_grpo`` / ``rl_trl_rloo``: TRL's own ``GRPOTrainer._get_per_token_logps_and_entropies`` (and
  ``RLOOTrainer``'s copy of it) with TRL's fused LM head;
- ``rl_trl_tree``: TRL AsyncGRPO's ``TreeRow`` (shared-prefix packing) and its ``tree_attention``, with the FA3
  kernel replaced by packcheck's exact CPU varlen reference (:func:`backends.kernels.varlen_reference_kernel`).

Units: log-probs and entropies in nats; the tolerance is the dtype's ``logits_atol`` (a per-token log-prob is a
difference of two logits' log-sum-exp, so it moves by at most twice the logits' difference).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ..results import CheckResult
from .probes import mismatch_cause
from .registry import fixed_by
from .workbench import Workbench, _fmt

#: The sampling temperature the checks score at: GRPO divides the logits by the generation temperature before the
#: log-softmax (``GRPOConfig.temperature``, default 1.0; 0.7 .. 1.0 in practice). Not 1.0, so a temperature applied
#: on one path only shows.
RL_TEMPERATURE = 0.7


@dataclass(frozen=True)
class RLSample:
    """One rollout: ``prompt`` and ``completion`` token ids (each non-empty), ``group``: the prompt it answers (GRPO
    samples several completions per prompt; AsyncGRPO's tree packing shares their prefix)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    group: int = 0

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.completion]


def rl_samples(examples: list[list[int]]) -> list[RLSample]:
    """RL samples from the workbench's examples: each split into a prompt (its first half, at least one token) and a
    completion (the rest), and a second completion for the first prompt (a GRPO group of two: the first completion
    reversed, rotated when that reads the same). Examples of one token have no completion and are left out."""
    samples = [RLSample(tuple(e[:max(1, len(e) // 2)]), tuple(e[max(1, len(e) // 2):]), group=i)
               for i, e in enumerate(examples) if len(e) >= 2]
    if samples:
        first = samples[0]
        other = first.completion[::-1] if first.completion[::-1] != first.completion else first.completion[1:] + first.completion[:1]
        if other != first.completion:
            samples.insert(1, RLSample(first.prompt, other, group=first.group))
    return samples


def completion_logprobs(logits: Any, tokens: Any, first: int, temperature: float,
                        with_entropy: bool = True) -> tuple[Any, Any]:
    """Log-probs and entropies (float64, nats) of ``tokens[first:]`` (a list or a 1-D tensor), each scored off the
    logits of the position before it, at ``temperature``: ``logits`` is ``(len(tokens), vocab)`` (or longer: row
    ``t - 1`` predicts token ``t``). The labels are shifted within the sample, never across its start (``first >=
    1``). The entropies are None with ``with_entropy=False`` (the guard compares log-probs only)."""
    import torch

    rows = logits[first - 1:len(tokens) - 1].double() / temperature
    logp = torch.log_softmax(rows, dim=-1)
    targets = torch.as_tensor(tokens[first:], device=logp.device)
    gathered = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1).cpu() if with_entropy else None
    return gathered.cpu(), entropy


def alone(wb: Workbench, samples: list[RLSample], temperature: float) -> list[tuple[Any, Any]]:
    """The reference: each sample run alone (:meth:`Workbench.solo`), its completion scored."""
    return [completion_logprobs(wb.solo(s.tokens), s.tokens, len(s.prompt), temperature) for s in samples]


def packed(wb: Workbench, samples: list[RLSample], temperature: float, batch: dict[str, Any] | None = None) -> list[tuple[Any, Any]]:
    """The samples in one padding-free row (the workbench's collator: ``position_ids`` restarting per sample), each
    completion scored from its own segment of the row."""
    batch = batch if batch is not None else wb.packed([s.tokens for s in samples])
    logits = wb.forward(batch).logits[0].float()
    out, offset = [], 0
    for s in samples:
        out.append(completion_logprobs(logits[offset:offset + len(s.tokens)], s.tokens, len(s.prompt), temperature))
        offset += len(s.tokens)
    return out


def left_padded_batch(samples: list[RLSample], pad_id: int, device: str = "cpu") -> tuple[dict[str, Any], int, int]:
    """GRPO's layout: prompts left-padded to the longest, completions right-padded to the longest, an
    ``attention_mask`` of the real tokens (``GRPOTrainer._generate_and_score_completions``). Returns the batch, the
    prompt width P and the completion width C (``logits_to_keep``)."""
    import torch

    width_p = max(len(s.prompt) for s in samples)
    width_c = max(len(s.completion) for s in samples)
    ids, mask = [], []
    for s in samples:
        lead, tail = width_p - len(s.prompt), width_c - len(s.completion)
        ids.append([pad_id] * lead + s.tokens + [pad_id] * tail)
        mask.append([0] * lead + [1] * len(s.tokens) + [0] * tail)
    return ({"input_ids": torch.tensor(ids, device=device), "attention_mask": torch.tensor(mask, device=device)},
            width_p, width_c)


def padded(wb: Workbench, samples: list[RLSample], temperature: float, position_ids: bool) -> list[tuple[Any, Any]]:
    """The samples in GRPO's left-padded batch, with ``position_ids`` counted over the real tokens (``attention_mask``
    cumsum, as ``generate`` counts them) or without (the forward numbers the columns, padding included)."""
    batch, width_p, _ = left_padded_batch(samples, wb.pad_id, wb.device)
    if position_ids:
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0) + wb.start
    logits = wb.forward(batch).logits.float()  # no grad, use_cache=False, position_ids through the layout
    out = []
    for row, s in enumerate(samples):
        lead = width_p - len(s.prompt)
        out.append(completion_logprobs(logits[row, lead:], s.tokens, len(s.prompt), temperature))
    return out


def compare(got: list[tuple[Any, Any]], ref: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Per-token and per-sequence differences (nats) of log-probs and entropies, worst over the samples; a
    non-finite value on either side is counted, never compared. Where ``got`` carries no entropies (a path that
    gathers log-probs only: each ``got`` entropy None), ``max_abs_entropy_diff`` is None: not compared, never 0."""
    import torch

    token, seq, bad = 0.0, 0.0, 0
    ent: float | None = None if all(h is None for _, h in got) else 0.0
    for (lp, h), (rlp, rh) in zip(got, ref, strict=True):
        finite = torch.isfinite(lp) & torch.isfinite(rlp)
        if ent is not None:
            finite &= torch.isfinite(h) & torch.isfinite(rh)
        bad += int((~finite).sum())
        if finite.any():
            token = max(token, float((lp[finite] - rlp[finite]).abs().max()))
            if ent is not None:
                ent = max(ent, float((h[finite] - rh[finite]).abs().max()))
            seq = max(seq, float((lp[finite].sum() - rlp[finite].sum()).abs()))
    return {"max_abs_logprob_diff": token, "max_abs_seq_logprob_diff": seq, "max_abs_entropy_diff": ent,
            "non_finite_logprobs": bad}


def _base_metrics(wb: Workbench, samples: list[RLSample]) -> dict[str, Any]:
    return {"temperature": RL_TEMPERATURE, "samples": len(samples), "completion_tokens": sum(len(s.completion) for s in samples),
            "atol": wb.tol["logits_atol"]}


def _too_short(wb: Workbench) -> CheckResult | None:
    if len(rl_samples(wb.examples)) < 2:
        return CheckResult("skipped", {}, "RL samples need two examples of at least 2 tokens (a prompt and a completion "
                                          "each): lengthen --packcheck-lengths")
    return None


def _verdict(wb: Workbench, what: str, numbers: dict[str, Any], metrics: dict[str, Any]) -> CheckResult:
    """Pass within ``logits_atol`` on log-probs and entropies; a non-finite log-prob fails as such; otherwise the
    cause from the workbench's probes (:func:`probes.mismatch_cause`: leak, stateful layers, numerics, ...)."""
    atol = wb.tol["logits_atol"]
    entropy = numbers["max_abs_entropy_diff"]  # None: the path gathers log-probs only
    worst = max(numbers["max_abs_logprob_diff"], entropy or 0.0)
    if numbers["non_finite_logprobs"]:
        return CheckResult("fail", metrics, f"{what}: {numbers['non_finite_logprobs']} non-finite completion log-probs",
                           cause="non_finite", evidence={"non_finite_logprobs": numbers["non_finite_logprobs"]})
    message = (f"{what}: completion log-probs {_fmt(numbers['max_abs_logprob_diff'])} nats per token, "
               f"{_fmt(numbers['max_abs_seq_logprob_diff'])} per sequence, "
               + (f"entropy {_fmt(entropy)} " if entropy is not None else "entropy not compared ")
               + f"(tol {_fmt(atol)})")
    if worst <= atol:
        return CheckResult("pass", metrics, message)
    cause, evidence = mismatch_cause(wb, worst, atol)
    return CheckResult("fail", metrics, message, cause=cause, evidence={**evidence, "max_abs_logprob_diff": worst})


def check_rl_logprobs(wb: Workbench) -> CheckResult:
    """Completion log-probs and entropies from one padding-free row (samples of a GRPO group side by side,
    ``position_ids`` restarting, no ``attention_mask``, ``use_cache=False``), gathered per segment at
    :data:`RL_TEMPERATURE`, = each sample alone. The remove-padding path of verl, OpenRLHF's packed samples and TRL
    AsyncGRPO's chains (a tree with nothing shared) feed the model this row."""
    short = _too_short(wb)
    if short:
        return short
    samples = rl_samples(wb.examples)
    numbers = compare(packed(wb, samples, RL_TEMPERATURE), alone(wb, samples, RL_TEMPERATURE))
    return _verdict(wb, "packed row", numbers, {**numbers, **_base_metrics(wb, samples)})


def check_rl_padded(wb: Workbench) -> CheckResult:
    """GRPO's left-padded batch as ``GRPOTrainer`` calls the model (``input_ids`` and ``attention_mask``, no
    ``position_ids``): the forward numbers positions over the columns, so a left-padded sample starts at its padding
    count. Rotary models see relative positions and stay right; learned absolute positions do not. Fails with
    ``padded_positions`` when ``position_ids`` counted over the real tokens fix it. A hazard: the packed row is what
    packing changes, and it is judged by ``rl_logprobs``."""
    short = _too_short(wb)
    if short:
        return short
    samples = rl_samples(wb.examples)
    ref = alone(wb, samples, RL_TEMPERATURE)
    without = compare(padded(wb, samples, RL_TEMPERATURE, position_ids=False), ref)
    with_ids = compare(padded(wb, samples, RL_TEMPERATURE, position_ids=True), ref)
    atol = wb.tol["logits_atol"]
    metrics = {**without, "max_abs_logprob_diff_position_ids": with_ids["max_abs_logprob_diff"], **_base_metrics(wb, samples)}
    diff, fixed = without["max_abs_logprob_diff"], with_ids["max_abs_logprob_diff"]
    if diff <= atol and not without["non_finite_logprobs"]:
        return CheckResult("pass", metrics, f"left-padded without position_ids: {_fmt(diff)} nats (tol {_fmt(atol)})")
    if fixed_by(fixed, diff, atol, wb.dtype):
        return CheckResult("fail", metrics, f"left-padded without position_ids: completion log-probs off by {_fmt(diff)} "
                           f"nats; with position_ids from the attention_mask {_fmt(fixed)}", cause="padded_positions",
                           evidence={"max_abs_logprob_diff": diff, "max_abs_logprob_diff_position_ids": fixed, "atol": atol})
    return _verdict(wb, "left-padded batch", without, metrics)


# ------------------------------------------------------------------------------------------------------------
# TRL's own code


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


@contextlib.contextmanager
def _model_copy(wb: Workbench):
    """A deep copy of the cell's model (TRL's fused LM head patches ``forward`` in place; the other checks of the
    cell must see the original)."""
    import copy

    model = copy.deepcopy(wb.model)
    model.eval()
    try:
        yield model
    finally:
        del model


#: TRL's policy-gradient trainers whose own per-token log-prob method rl_trl_grpo / rl_trl_rloo run: check suffix ->
#: (module, class, name in messages). RLOOTrainer has its own copy of the method (trl 1.16.0 rloo_trainer.py), with the
#: same signature and the same fused LM head (add_fused_lm_head at rloo_trainer.py:716).
_TRL_POLICY = {"grpo": ("trl.trainer.grpo_trainer", "GRPOTrainer", "GRPO"),
               "rloo": ("trl.trainer.rloo_trainer", "RLOOTrainer", "RLOO")}


def check_rl_trl_grpo(wb: Workbench) -> CheckResult:
    """TRL's GRPO log-prob path: :func:`trl_policy_logprobs` with ``GRPOTrainer``."""
    return trl_policy_logprobs(wb, "grpo")


def check_rl_trl_rloo(wb: Workbench) -> CheckResult:
    """TRL's RLOO log-prob path: :func:`trl_policy_logprobs` with ``RLOOTrainer`` (its own
    ``_get_per_token_logps_and_entropies``, not GRPO's; a release whose RLOOTrainer has none, the online trainer of
    trl <= 0.21, is a skip naming it)."""
    return trl_policy_logprobs(wb, "rloo")


def trl_policy_logprobs(wb: Workbench, trainer: str) -> CheckResult:
    """TRL's GRPO / RLOO log-prob path (``trainer``: a key of :data:`_TRL_POLICY`), its own code, on the left-padded batch GRPO builds (``logits_to_keep`` = the
    completion width), against each sample alone. The path is the release's (:func:`grpo_logprob_path`): through TRL's
    fused LM head (``add_fused_lm_head(model, temperature)``) where the release has it, else
    ``_get_per_token_logps_and_entropies`` dividing the logits by ``self.temperature``, else (trl 0.19's)
    ``_get_per_token_logps`` (log-probs only: no entropy in that release, the entropy is then not compared and the
    message says so). The trainer's machinery is not started: the method runs on a stand-in ``self`` (a no-op
    autocast, ``temperature``, ``model_kwarg_keys``: the cell's dtype is the model's). A release with none of them is a
    skip naming it."""
    short = _too_short(wb)
    if short:
        return short
    import torch

    try:
        module_name, class_name, label = _TRL_POLICY[trainer]
        module, stand_ins = import_trl_module(module_name)
    except ImportError as exc:
        return CheckResult("skipped", {"trl": _trl_version(), "missing_module": getattr(exc, "name", None) or str(exc)},
                           f"trl {_trl_version()}'s {class_name} does not import here ({exc.__class__.__name__}: "
                           f"{' '.join(str(exc).split())[:160]})")
    except Exception as exc:  # noqa: BLE001 - the release's module raised at import: the cell says where
        return _trl_crash(f"{module_name} import", exc)
    trainer_cls = getattr(module, class_name, None)
    path = grpo_logprob_path(trainer_cls) if trainer_cls is not None else None
    if path is None:
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()}'s {class_name} has no per-token "
                           "log-prob method (_get_per_token_logps_and_entropies / _get_per_token_logps)")
    blocked = fused_head_blocker(f"{label} log-prob path") if path == "fused_lm_head" else None
    if blocked:
        return blocked
    samples = rl_samples(wb.examples)
    batch, _, width_c = left_padded_batch(samples, wb.pad_id, wb.device)
    try:
        with _model_copy(wb) as model, torch.no_grad():
            logps, entropies = _grpo_forward(trainer_cls, path, model, batch, width_c)
    except Exception as exc:  # noqa: BLE001 - TRL's code raised on this model: the cell says where
        return _trl_crash(f"{class_name}.{_GRPO_METHOD[path]}", exc)
    ref = alone(wb, samples, RL_TEMPERATURE)
    # trl 0.19's _get_per_token_logps computes no entropy: it is not compared (max_abs_entropy_diff None)
    got = [(logps[i, :len(s.completion)].double().cpu(),
            entropies[i, :len(s.completion)].double().cpu() if entropies is not None else None)
           for i, s in enumerate(samples)]
    numbers = compare(got, ref)
    metrics = {**numbers, **_base_metrics(wb, samples), "trl": _trl_version(), "logits_to_keep": width_c,
               "grpo_path": path, "entropy_compared": entropies is not None}
    if stand_ins:
        metrics["stand_ins"] = stand_ins
    what = (f"trl {_trl_version()} {label} log-prob path ({_GRPO_METHOD[path]}"
            f"{', no entropy in this release' if entropies is None else ''}{''.join('; ' + x for x in stand_ins)})")
    atol = wb.tol["logits_atol"]
    diff = numbers["max_abs_logprob_diff"]
    if diff > atol and not numbers["non_finite_logprobs"]:
        # GRPO / RLOO call the model with input_ids and attention_mask only: is it the positions of the left padding?
        fixed = compare(padded(wb, samples, RL_TEMPERATURE, position_ids=True), ref)["max_abs_logprob_diff"]
        metrics["max_abs_logprob_diff_position_ids"] = fixed
        if fixed_by(fixed, diff, atol, wb.dtype):
            return CheckResult("fail", metrics, f"{what}: completion log-probs off by {_fmt(diff)} nats per token: the "
                               f"left-padded batch reaches the model without position_ids (with them {_fmt(fixed)})",
                               cause="padded_positions", evidence={"max_abs_logprob_diff": diff,
                                                                   "max_abs_logprob_diff_position_ids": fixed, "atol": atol})
    return _verdict(wb, what, numbers, metrics)


#: The GRPO log-prob paths a TRL release can have (:func:`grpo_logprob_path`) -> the method it runs.
_GRPO_METHOD = {"fused_lm_head": "_get_per_token_logps_and_entropies, fused LM head",
                "logits": "_get_per_token_logps_and_entropies", "logps_only": "_get_per_token_logps"}


def grpo_logprob_path(trainer_cls: Any) -> str | None:
    """Which GRPO per-token log-prob path the installed TRL has: ``"fused_lm_head"`` (``trl.trainer.utils.
    add_fused_lm_head`` exists: the model returns log-probs and entropies, TRL >= 1.15), ``"logits"``
    (``_get_per_token_logps_and_entropies``: the model's logits divided by ``self.temperature``,
    ``selective_log_softmax``), ``"logps_only"`` (``_get_per_token_logps``, trl 0.19), or None."""
    if hasattr(trainer_cls, "_get_per_token_logps_and_entropies"):
        try:
            from trl.trainer.utils import add_fused_lm_head  # noqa: F401
        except ImportError:
            return "logits"
        return "fused_lm_head"
    return "logps_only" if hasattr(trainer_cls, "_get_per_token_logps") else None


def _grpo_forward(trainer_cls: Any, path: str, model: Any, batch: dict[str, Any], width_c: int) -> tuple[Any, Any]:
    """Run the release's GRPO log-prob method on a stand-in ``self``: (log-probs ``(B, width_c)``, entropies of the
    same shape or None where the release computes none), at :data:`RL_TEMPERATURE`."""
    import inspect

    accelerator = type("Accelerator", (), {"autocast": staticmethod(contextlib.nullcontext), "is_main_process": True,
                                           "num_processes": 1, "unwrap_model": staticmethod(lambda m, **_k: m)})()
    # an instance of the release's GRPOTrainer / RLOOTrainer built without __init__ (its methods resolve, e.g. trl 1.14's
    # _full_logits_logps), holding what the log-prob method reads: no Liger kernel, no FSDP, not a VLM
    stand_in = object.__new__(trainer_cls)
    stand_in.__dict__.update({"accelerator": accelerator, "temperature": RL_TEMPERATURE,
                              "model_kwarg_keys": set(inspect.signature(model.forward).parameters),
                              "is_fsdp_enabled": False, "use_liger_kernel": False, "_is_vlm": False,
                              "_entropy_bonus_enabled": False})  # GRPOConfig's default entropy_coef 0 (trl 1.14)
    if path == "fused_lm_head":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=RL_TEMPERATURE, outputs=("log_probs", "entropy"))
    if path == "logps_only":
        return trainer_cls._get_per_token_logps(stand_in, model, batch["input_ids"], batch["attention_mask"], width_c), None
    out = trainer_cls._get_per_token_logps_and_entropies(stand_in, model, batch["input_ids"], batch["attention_mask"],
                                                         width_c, compute_entropy=True)
    return out[0], out[1]


def fused_head_blocker(what: str) -> CheckResult | None:
    """A skip naming the package when the installed TRL's fused LM head cannot run here: ``trl.trainer.utils`` has
    ``add_fused_lm_head`` but its kernel (``_ChunkedLogProbFunction``, from ``trl/kernels``) is None because
    ``trl.kernels`` did not import (trl 1.15.0: ``trl/kernels/chunked_logprob.py`` imports ``triton``, which a CPU
    torch lacks; trl 1.16 has a torch fallback). None when the head runs or the release has none."""
    try:
        from trl.trainer import utils
    except ImportError:
        return None
    if not hasattr(utils, "add_fused_lm_head") or getattr(utils, "_ChunkedLogProbFunction", True) is not None:
        return None
    try:
        import trl.kernels  # noqa: F401
        missing, detail = "?", "trl.kernels imports, yet trl.trainer.utils._ChunkedLogProbFunction is None"
    except ImportError as exc:
        missing, detail = getattr(exc, "name", None) or str(exc), f"{type(exc).__name__}: {exc}"
    version = _trl_version()
    return CheckResult("skipped", {"trl": version, "missing_module": missing},
                       f"trl {version}'s {what} runs through its fused LM head, whose kernel needs '{missing}' "
                       f"(trl/trainer/utils.py: from ..kernels import ChunkedLogProbFunction; {detail}): not runnable "
                       "on this CPU torch")


def _trl_crash(where: str, exc: BaseException) -> CheckResult:
    """TRL's own code raised on this model (not packcheck's, not the model's alone): an error cell naming TRL's
    function, the release, and the innermost frame of the exception."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    last = f"{frames[-1].filename.rsplit('site-packages/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    text = " ".join(str(exc).split())[:160]
    return CheckResult("error", {"trl": _trl_version(), "raised_at": last},
                       f"trl {_trl_version()} {where} raised {type(exc).__name__}{': ' + text if text else ''} (at {last})",
                       cause="crash", evidence={"exception": type(exc).__name__, "raised_at": last})


def async_examples(samples: list[RLSample]) -> list[dict[str, Any]]:
    """The samples as AsyncGRPO's rollout worker hands them to its collator: ``input_ids`` (prompt + completion),
    ``completion_mask`` (0 on the prompt, 1 on the completion), ``old_log_probs`` (zeros: not read by the forward),
    ``advantage``, ``group_id`` and an empty ``metrics``."""
    return [{"input_ids": s.tokens, "completion_mask": [0] * len(s.prompt) + [1] * len(s.completion),
             "old_log_probs": [0.0] * len(s.tokens), "advantage": 0.0, "group_id": s.group, "metrics": {}}
            for s in samples]


def async_rollout_row(collator_cls: Any, samples: list[RLSample], pad_id: int) -> dict[str, Any]:
    """TRL AsyncGRPO's ``DataCollatorForRollout`` on the samples, one rank: the release's own packer. Its calling
    convention is the release's: a list of examples (trl 1.7), or one micro-batch already split into rows by the
    planner (``(groups,) = examples``, trl 1.15), here one row holding every sample."""
    import inspect

    collator = collator_cls(pad_token_id=pad_id)
    examples = async_examples(samples)
    planned = "(groups,) = examples" in inspect.getsource(collator_cls.torch_call)
    return collator([[examples]] if planned else examples)


def async_logprobs(model: Any, inputs: dict[str, Any], device: str = "cpu") -> Any:
    """AsyncGRPO's ``compute_loss`` forward, as the release runs it: the inter-rank padding stripped with the
    ``attention_mask``, one row with ``position_ids`` restarting per sample, through the release's LM head at
    :data:`RL_TEMPERATURE`: ``add_fused_lm_head`` (labels masked to -100 off the completion, ``fused_lm_head=True``,
    trl 1.15) or ``patch_chunked_lm_head`` (``labels=input_ids``, ``completion_mask``, trl 1.7). Returns
    float64 ``(N - 1,)`` log-probs (entry ``t - 1`` scores token ``t``) and the entropies alike."""
    import torch
    from trl.trainer import utils

    keep = inputs["attention_mask"].bool()
    ids, pos, cm = (inputs[k][keep].unsqueeze(0).to(device) for k in ("input_ids", "position_ids", "completion_mask"))
    with torch.no_grad():
        if hasattr(utils, "add_fused_lm_head"):
            utils.add_fused_lm_head(model, temperature=RL_TEMPERATURE, outputs=("log_probs", "entropy"))
            out = model(input_ids=ids, position_ids=pos, labels=ids.masked_fill(cm == 0, -100), fused_lm_head=True)
        else:
            utils.patch_chunked_lm_head(model, chunk_size=8192, temperature=RL_TEMPERATURE)
            out = model(input_ids=ids, position_ids=pos, labels=ids, completion_mask=cm, use_cache=False)
    return out["log_probs"][0].double().cpu(), out["entropy"][0].double().cpu()


def check_rl_trl_async(wb: Workbench) -> CheckResult:
    """TRL AsyncGRPO's padding-free batch, its own code: ``DataCollatorForRollout`` packs the samples into one row
    (``position_ids`` restarting per sample) and ``compute_loss``'s forward scores it through TRL's LM head
    (:func:`async_logprobs`); each completion token's log-prob and entropy = its sample alone. Releases whose
    AsyncGRPO is not padding-free (before 1.7: padded rows, no ``position_ids``) or packs trees (1.16: measured by
    ``rl_trl_tree``) skip naming the release."""
    short = _too_short(wb)
    if short:
        return short
    version = _trl_version()
    try:
        ag, stand_in = import_async_grpo()
    except ImportError as exc:
        return CheckResult("skipped", {"trl": version}, f"trl {version} has no AsyncGRPO (trl.experimental.async_grpo: "
                           f"{exc.__class__.__name__}: {exc})")
    except Exception as exc:  # noqa: BLE001 - the release's module raised at import: the cell says where
        return _trl_crash("trl.experimental.async_grpo import", exc)
    if hasattr(ag, "TreeRow"):
        return CheckResult("skipped", {"trl": version}, f"trl {version}'s AsyncGRPO collator packs trees (TreeRow): "
                           "rl_trl_tree measures it")
    blocked = fused_head_blocker("AsyncGRPO compute_loss forward")
    if blocked:
        return blocked
    samples = rl_samples(wb.examples)
    try:
        inputs = async_rollout_row(ag.DataCollatorForRollout, samples, wb.pad_id)
    except Exception as exc:  # noqa: BLE001 - TRL's collator raised: the cell says where
        return _trl_crash("AsyncGRPO DataCollatorForRollout", exc)
    if "position_ids" not in inputs:
        return CheckResult("skipped", {"trl": version, "collator_keys": sorted(inputs)},
                           f"trl {version}'s AsyncGRPO collator pads one row per sample (no position_ids): not "
                           "padding-free (padding-free since 1.7)")
    try:
        with _model_copy(wb) as model:
            logps, entropies = async_logprobs(model, inputs, wb.device)
    except Exception as exc:  # noqa: BLE001 - TRL's code raised on this model: the cell says where
        return _trl_crash("AsyncGRPO compute_loss forward", exc)
    got, offset = [], 0
    for s in samples:
        first, end = offset + len(s.prompt), offset + len(s.tokens)
        got.append((logps[first - 1:end - 1], entropies[first - 1:end - 1]))
        offset = end
    ref = alone(wb, samples, RL_TEMPERATURE)
    numbers = compare(got, ref)
    metrics = {**numbers, **_base_metrics(wb, samples), "trl": version, "row_tokens": offset,
               "lm_head": "add_fused_lm_head" if _has_fused_head() else "patch_chunked_lm_head"}
    if stand_in:
        metrics["stand_in"] = stand_in
    what = f"trl {version} AsyncGRPO padding-free row ({metrics['lm_head']}{'; ' + stand_in if stand_in else ''})"
    return _verdict(wb, what, numbers, metrics)


#: Packages a TRL module imports at its top for its vLLM client only, which TRL does not declare (or lists under its
#: ``vllm`` extra), stubbed for the import alone where they are missing: name -> (why, {module: {name: value}}).
#: ``requests``: trl 0.29 .. 1.13 ``trl/generation/vllm_client.py:26`` ``from requests.adapters import HTTPAdapter``
#: (unguarded; trl 1.14 guards it) and ``urllib3`` beside it, so GRPOTrainer does not import in a clean ``trl==X``
#: environment; ``aiohttp``:
#: AsyncGRPO's ``async_rollout_worker`` (trl 1.7 .. 1.15), reading ``aiohttp.ClientError`` at import.
TRL_IMPORT_STUBS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "requests": ("trl's vLLM client imports it at its top (trl does not declare it); never called here",
                 {"requests": {"ConnectionError": type("ConnectionError", (OSError,), {})},
                  "requests.adapters": {"HTTPAdapter": type("HTTPAdapter", (), {})}}),
    "urllib3": (("trl's vLLM client imports urllib3.util.retry.Retry at its top (trl 0.29 .. 1.13; trl does not declare "
                 "it); never called here"), {"urllib3.util.retry": {"Retry": type("Retry", (), {})}}),
    "aiohttp": (("only async_rollout_worker's import needs it (its vLLM HTTP client, never called here; trl lists "
                 "aiohttp under its vllm extra)"),
                {"aiohttp": {"ClientError": type("ClientError", (Exception,), {})}}),
}
#: Kept for the tests and the docs: the sentence the aiohttp stub adds to a cell.
AIOHTTP_STAND_IN = f"aiohttp stubbed: {TRL_IMPORT_STUBS['aiohttp'][0]}"


def import_trl_module(name: str) -> tuple[Any, list[str]]:
    """Import TRL's module ``name``; where it fails only because a package of :data:`TRL_IMPORT_STUBS` is missing,
    import it again with that package stubbed for the import alone (:func:`.stand_ins.stub_tree`: the names TRL reads
    at import; anything else raises ModuleNotFoundError naming the package). Returns the module and the sentences
    naming each stub used ([] when none). Raises ImportError for anything else missing."""
    import importlib

    from .stand_ins import stub_tree

    used: list[str] = []
    with contextlib.ExitStack() as stack:
        for _ in range(len(TRL_IMPORT_STUBS) + 1):
            try:
                return importlib.import_module(name), used
            except ModuleNotFoundError as exc:
                root = (exc.name or "").split(".")[0]
                if root not in TRL_IMPORT_STUBS or any(u.startswith(root + " ") for u in used):
                    raise
                why, attrs = TRL_IMPORT_STUBS[root]
                used.append(stack.enter_context(stub_tree(root, why, attrs)))
    raise ImportError(f"{name} does not import with {', '.join(used)}")


def import_async_grpo() -> tuple[Any, str]:
    """``trl.experimental.async_grpo.async_grpo_trainer`` (:func:`import_trl_module`) and the stand-ins used, joined
    ("" when none)."""
    module, used = import_trl_module("trl.experimental.async_grpo.async_grpo_trainer")
    return module, "; ".join(used)


def _has_fused_head() -> bool:
    from trl.trainer import utils

    return hasattr(utils, "add_fused_lm_head")


def tree_row(samples: list[RLSample]) -> dict[str, Any]:
    """TRL AsyncGRPO's own packer: the samples folded into a ``TreeRow`` prefix trie and laid out by its
    ``pack()`` (``input_ids``, ``position_ids`` = depth, ``shift_labels``, ``tree_kv_index``, ``tree_cu_seqlens_q/k``,
    ``tree_max_seqlens``, ``token_index``, ``segment_id``)."""
    import torch
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for s in samples:
        n = len(s.tokens)
        row.add({"input_ids": torch.tensor(s.tokens), "group_id": s.group, "advantage": 0.0,
                 "completion_mask": torch.tensor([0] * len(s.prompt) + [1] * len(s.completion)),
                 "old_log_probs": torch.zeros(n)})
    return row.pack()


def tree_logprobs(model: Any, packed_row: dict[str, Any], device: str = "cpu") -> Any:
    """AsyncGRPO's ``compute_loss`` forward on one tree row (its keyword arguments, its gather
    ``outputs.log_probs.flatten()[token_index]``), on a model whose attention is TRL's ``tree_attention``."""
    import torch

    kw = {k: packed_row[k].to(device) for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    kw["tree_max_seqlen_q"], kw["tree_max_seqlen_k"] = (int(x) for x in packed_row["tree_max_seqlens"].tolist())
    with torch.no_grad():
        out = model(input_ids=packed_row["input_ids"][None].to(device), position_ids=packed_row["position_ids"][None].to(device),
                    shift_labels=packed_row["shift_labels"][None].to(device), fused_lm_head=True, **kw)
    return out.log_probs.flatten()[packed_row["token_index"].to(device)].double().cpu()


def check_rl_trl_tree(wb: Workbench) -> CheckResult:
    """TRL AsyncGRPO's tree (shared-prefix) packing, its own code: ``TreeRow`` folds a GRPO group's shared prompt
    into one prefix, ``tree_attention`` shows each segment its root-to-segment K/V (``tree_kv_index``), and
    ``compute_loss`` gathers ``log_probs[token_index]``. The FA3 kernel (a GPU kernel from the Hub) is replaced by
    packcheck's exact CPU varlen reference; everything else is TRL's. Each target's log-prob = its sample alone."""
    short = _too_short(wb)
    if short:
        return short
    try:
        tree, _ = import_trl_module("trl.experimental.async_grpo.packing")  # its package imports the vLLM client
        from trl.trainer.utils import add_fused_lm_head
    except ImportError as exc:
        return CheckResult("skipped", {"trl": _trl_version()}, f"trl {_trl_version()} has no AsyncGRPO tree packing "
                           f"({exc.__class__.__name__}: {exc}): trl >= 1.16 has it")
    samples = rl_samples(wb.examples)
    row = tree_row(samples)
    ref = alone(wb, samples, RL_TEMPERATURE)
    expected = [float(ref[i][0][j]) for i, s in enumerate(samples) for j in range(len(s.completion))]
    try:
        got = _tree_run(wb, row, tree, add_fused_lm_head)
    except Exception as exc:  # noqa: BLE001 - TRL's code raised on this model: the cell says where
        return _trl_crash("AsyncGRPO tree_attention forward", exc)
    import torch

    want = torch.tensor(expected, dtype=torch.float64)
    finite = torch.isfinite(got) & torch.isfinite(want)
    diff = float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0
    unique, raw = int(row["input_ids"].numel()), sum(len(s.tokens) for s in samples)
    numbers = {"max_abs_logprob_diff": diff, "max_abs_seq_logprob_diff": 0.0, "max_abs_entropy_diff": None,
               "non_finite_logprobs": int((~finite).sum())}  # the tree row gathers log-probs only
    for i in range(len(samples)):  # the per-sequence sum, as the policy loss adds it up
        sel = (row["segment_id"] == i) & finite
        numbers["max_abs_seq_logprob_diff"] = max(numbers["max_abs_seq_logprob_diff"], float((got[sel] - want[sel]).sum().abs()))
    metrics = {**numbers, **_base_metrics(wb, samples), "trl": _trl_version(), "tree_tokens": unique, "raw_tokens": raw,
               "segments": int(row["tree_cu_seqlens_q"].numel() - 1)}
    what, atol = f"trl {_trl_version()} AsyncGRPO tree row ({unique} of {raw} tokens forwarded)", wb.tol["logits_atol"]
    if numbers["non_finite_logprobs"]:
        return CheckResult("fail", metrics, f"{what}: {numbers['non_finite_logprobs']} non-finite completion log-probs",
                           cause="non_finite", evidence={"non_finite_logprobs": numbers["non_finite_logprobs"]})
    message = (f"{what}: completion log-probs {_fmt(diff)} nats per token, {_fmt(numbers['max_abs_seq_logprob_diff'])} "
               f"per sequence (tol {_fmt(atol)})")
    # a finding's contract items (report.model.stack_findings counts them): one, the targets' log-probs
    metrics["items"] = {"completion_logprobs": {"status": "pass" if diff <= atol else "fail",
                                                "evidence": f"max {_fmt(diff)} nats per token (tol {_fmt(atol)})"}}
    if diff <= atol:
        return CheckResult("pass", metrics, message)
    evidence: dict[str, Any] = {"max_abs_logprob_diff": diff, "atol": atol, "segments": metrics["segments"]}
    if any(getattr(m, "sinks", None) is not None for m in wb.model.modules()):
        # GPT-OSS's attention sinks reach transformers' kernels as s_aux; tree_attention passes the kernel no s_aux
        sunk = _tree_run(wb, row, tree, add_fused_lm_head, sinks=True)
        fixed = float((sunk[finite] - want[finite]).abs().max()) if finite.any() else 0.0
        evidence["max_abs_logprob_diff_with_sinks"] = metrics["max_abs_logprob_diff_with_sinks"] = fixed
        if fixed <= atol:
            evidence["attention_sinks_dropped"] = True
            message += (f"; tree_attention drops the attention sinks (s_aux): with them passed to the kernel "
                        f"{_fmt(fixed)}")
            metrics["items"]["completion_logprobs"]["evidence"] += f"; attention sinks dropped (with them {_fmt(fixed)})"
    return CheckResult("fail", metrics, message, cause="tree_packing", evidence=evidence)


def _tree_run(wb: Workbench, row: dict[str, Any], tree: Any, add_fused_lm_head: Any, sinks: bool = False) -> Any:
    """:func:`tree_logprobs` on a copy of the cell's model set to TRL's ``tree_attention``, its FA3 kernel replaced
    by packcheck's exact varlen reference (per-segment attention, causal aligned bottom-right, as FA3 aligns
    a segment's queries to the end of its root-to-segment K/V path). ``sinks``: hand each attention module's ``sinks`` to the kernel as ``s_aux``
    (what transformers' own flash path does for GPT-OSS), to see whether dropping them is the difference."""
    from unittest import mock

    from ..backends.kernels import varlen_reference_kernel

    def kernel_for(module: Any) -> Any:
        s_aux = getattr(module, "sinks", None) if sinks else None
        return type("TreeKernel", (), {"flash_attn_varlen_func": staticmethod(
            lambda *a, **kw: varlen_reference_kernel(*a, **kw, s_aux=s_aux))})()

    original = tree.tree_attention

    def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(tree, "_flash_attn", lambda: kernel_for(module)):
            return original(module, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(tree.TREE_ATTENTION, attention)
    try:
        with _model_copy(wb) as model:
            model.set_attn_implementation(tree.TREE_ATTENTION)
            add_fused_lm_head(model, temperature=RL_TEMPERATURE, outputs=("log_probs",))
            return tree_logprobs(model, row, wb.device)
    finally:
        tree.register_tree_attention()  # TRL's own function back under its name


# ------------------------------------------------------------------------------------------------------------
# what each trainer really runs


def _line_that_sets(cls: Any, attribute: str, value: str) -> str:
    """``file:line`` (from site-packages on) of the first line of ``cls``'s module that assigns ``self.<attribute> =
    <value>``, or "" when none does: the line a release decides with."""
    import inspect

    try:
        lines, _ = inspect.findsource(cls)
        path = inspect.getsourcefile(cls) or "?"
    except (OSError, TypeError):
        return ""
    needle = f"self.{attribute} = {value}"
    for number, text in enumerate(lines, 1):
        if text.strip() == needle:
            return f"{path.rsplit('site-packages/', 1)[-1]}:{number}"
    return ""


def check_rl_trainer_config(wb: Workbench) -> CheckResult:
    """What TRL's preference trainers run when asked to pack: ``DPOTrainer`` built with ``DPOConfig(padding_free=True)``
    on the cell's model and a two-pair dataset (nothing trained), and the ``padding_free`` it keeps. A flag forced
    off is a contract item that fails, with the file and line of the release that turns it off (trl 1.16.0:
    "temporarily unavailable after a refactor", falling back to padding with a logged warning). A stack finding:
    the same for every model."""
    import tempfile

    try:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer
    except ImportError as exc:
        return CheckResult("skipped", {}, f"TRL's DPOTrainer does not import here ({type(exc).__name__}: {exc})")
    from .sft_setup import _quiet_datasets, offline_tokenizer

    version = _trl_version()
    vocab = int(getattr(wb.config, "vocab_size", 0) or 0)
    tokenizer = offline_tokenizer(vocab) if vocab else None
    if tokenizer is None:
        return CheckResult("skipped", {"trl": version}, "the model's config has no vocab_size for an offline tokenizer")
    pairs = [{"prompt": "the cat sat", "chosen": " on the mat", "rejected": " in the park"},
             {"prompt": "a dog ran", "chosen": " with a ball", "rejected": " to the sea"}]
    fields = {f for f in DPOConfig.__dataclass_fields__}
    if "padding_free" not in fields:
        return CheckResult("skipped", {"trl": version}, f"trl {version}'s DPOConfig has no padding_free")
    items: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out, _model_copy(wb) as model:
        args = DPOConfig(output_dir=out, padding_free=True, per_device_train_batch_size=2, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no")
        try:
            import copy

            with _quiet_datasets():  # a built model has no Hub name: the reference model is handed over, not loaded
                trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                                     train_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
        except Exception as exc:  # noqa: BLE001 - TRL refused this model or config: the finding says so
            return _trl_crash("DPOTrainer(padding_free=True)", exc)
        runs = bool(getattr(trainer, "padding_free", False))
        where = "" if runs else _line_that_sets(type(trainer), "padding_free", "False")
        items["dpo_padding_free"] = {"status": "pass" if runs else "fail", "evidence": (
            "asked padding_free=True, runs padding-free" if runs else
            f"asked padding_free=True, runs padded (self.padding_free = False at {where or 'an unknown line'})")}
    failed = [k for k, v in items.items() if v["status"] == "fail"]
    message = f"trl {version}: " + "; ".join(f"{k}: {v['evidence']}" for k, v in items.items())
    metrics = {"trl": version, "items": items}
    if failed:
        return CheckResult("fail", metrics, message, cause="config_dropped",
                           evidence={"dropped": failed, "where": [items[k]["evidence"] for k in failed]})
    return CheckResult("pass", metrics, message)
