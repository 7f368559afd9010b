"""TRL's SFTTrainer as users configure it: what is really in force, and what its batches carry.

Offline: the tokenizer is a small BPE trained with the ``tokenizers`` library on a few sentences (with a chat
template), so no Hub access is needed. Version drift is feature-detected (``processing_class`` vs ``tokenizer``,
``max_length`` vs ``max_seq_length``, ``padding_free`` from TRL 0.16, ``packing_strategy`` from 0.19); what the
installed TRL cannot express is "unsupported" with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import tempfile
from typing import Any

from .results import CheckResult

SENTENCES = [
    "Packing puts several examples into one row.",
    "Each example restarts its position ids at zero.",
    "The attention kernel must keep the examples apart.",
    "A short one.",
    "Padding wastes compute on tokens that carry no label, so packing trains faster when lengths vary a lot.",
    "Loss normalisation must count the same tokens in both runs.",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def offline_tokenizer(vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast``: BPE trained on :data:`SENTENCES` (at most ``vocab_size`` tokens, so every
    id fits a shrunk model), eos / pad tokens, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 300), special_tokens=["<pad>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def trl_features() -> dict[str, Any]:
    """What the installed TRL offers: version, SFTConfig field names, SFTTrainer argument names."""
    import trl
    from trl import SFTConfig, SFTTrainer

    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    params = set(inspect.signature(SFTTrainer.__init__).parameters)
    return {"version": trl.__version__, "fields": fields, "params": params,
            "max_length_key": "max_length" if "max_length" in fields else "max_seq_length" if "max_seq_length" in fields else None,
            "tokenizer_key": "processing_class" if "processing_class" in params else "tokenizer"}


def check_sft(bench: Any) -> CheckResult:
    """See :func:`_check_sft`. SFTTrainer sets use_cache=False on the model it is given; the measurements run
    with that (as training would), and the model's own setting is restored afterwards for the group's other
    checks."""
    saved = getattr(bench.model.config, "use_cache", None)
    try:
        with tempfile.TemporaryDirectory(prefix="packcheck-sft-") as out_dir:
            return _check_sft(bench, out_dir)
    finally:
        if saved is not None:
            bench.model.config.use_cache = saved


def _check_sft(bench: Any, out_dir: str) -> CheckResult:
    """SFTTrainer(packing=True) on six short texts, as configured by default for the installed TRL.

    Reports the effective configuration next to the request (padding_free, packing_strategy, the collator
    class, use_cache, attn_implementation; a silent override is named), checks the first batch's contract
    (position_ids restart per example, labels -100 at each example's first token, cu_seq_lens where TRL emits
    them, no attention_mask that would override the boundaries), and compares the model's loss on that batch
    with the per-example reference (``loss_atol``). Fails on a broken contract or a loss beyond tolerance.
    """
    import torch

    try:
        feats = trl_features()
    except ImportError as exc:
        return CheckResult("skipped", {}, f"trl is not installed ({exc})")
    missing = [f for f in ("packing", "padding_free") if f not in feats["fields"]]
    if missing or feats["max_length_key"] is None:
        return CheckResult("unsupported", {"trl": feats["version"]},
                           f"not available in trl {feats['version']}: SFTConfig has no {', '.join(missing) or 'max_length'}")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    vocab = int(bench.config.vocab_size)
    tokenizer = offline_tokenizer(vocab)
    requested = {"packing": True, "padding_free": False}
    if "packing_strategy" in feats["fields"]:
        requested["packing_strategy"] = next(f.default for f in dataclasses.fields(SFTConfig) if f.name == "packing_strategy")
    cfg_kwargs = {"output_dir": out_dir, "packing": True, "padding_free": False,
                  feats["max_length_key"]: 512, "per_device_train_batch_size": 1, "max_steps": 1, "report_to": [],
                  "save_strategy": "no", "use_cpu": not bench.device.startswith("cuda"), "dataset_text_field": "text",
                  "seed": 0, "disable_tqdm": True}
    cfg_kwargs = {k: v for k, v in cfg_kwargs.items() if k in feats["fields"] or k in ("output_dir",)}
    args = SFTConfig(**cfg_kwargs)
    model = bench.model
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in SENTENCES]),
                         **{feats["tokenizer_key"]: tokenizer})
    # the collator is what pads or flattens: its padding_free is the one in force (bfd packing turns it on
    # whatever SFTConfig.padding_free says, TRL 1.16)
    collator_free = getattr(trainer.data_collator, "padding_free", None)
    effective = {"packing": trainer.args.packing,
                 "padding_free": collator_free if collator_free is not None else getattr(trainer.args, "padding_free", None),
                 "packing_strategy": getattr(trainer.args, "packing_strategy", None),
                 "collator": type(trainer.data_collator).__name__, "use_cache": getattr(model.config, "use_cache", None),
                 "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    batch = next(iter(trainer.get_train_dataloader()))
    overridden = {k: (v, effective.get(k)) for k, v in requested.items() if k in effective and effective[k] != v}
    metrics: dict[str, Any] = {"trl": feats["version"], "requested": requested, "effective": effective,
                               "overridden": {k: list(v) for k, v in overridden.items()}, "keys": sorted(batch)}
    over = "; ".join(f"{k} requested {a} -> in force {b}" for k, (a, b) in overridden.items())
    summary = (f"trl {feats['version']}: {effective['collator']}, padding_free={effective['padding_free']}, "
               f"packing_strategy={effective['packing_strategy']}, use_cache={effective['use_cache']}"
               + (f"; overridden: {over}" if over else ""))
    problems = []
    ids = batch["input_ids"].to(bench.device)
    pos = batch.get("position_ids")
    if "attention_mask" in batch and int((batch["attention_mask"] == 0).sum()) == 0 and batch["input_ids"].shape[0] == 1:
        problems.append("the packed batch carries an all-ones attention_mask (it overrides the boundaries on eager/sdpa/flex)")
    if pos is None:
        problems.append("the packed batch carries no position_ids: examples are concatenated without boundaries")
        return CheckResult("fail", metrics, "; ".join(problems) + f" ({summary})")
    pos = pos.to(bench.device)
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    metrics["examples_in_row"] = len(starts)
    if len(starts) < 2:
        problems.append(f"position_ids restart {len(starts)} time(s): the row is not packed")
    labels = batch["labels"].to(bench.device)
    unmasked = [s for s in starts if int(labels[0, s]) != -100]
    if unmasked:
        problems.append(f"labels not -100 at {len(unmasked)} example starts {unmasked[:5]}")
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].tolist()
        metrics["cu_seq_lens_q"] = cu[:12]
        if cu[: len(starts)] != starts:
            problems.append(f"cu_seq_lens_q {cu[:8]} disagree with the position_ids restarts {starts[:8]}")
    # loss on the batch as the trainer would feed it (use_cache as SFTTrainer left it) vs per-example runs
    model.train()
    try:
        with torch.no_grad():
            inputs = {k: (v.to(bench.device) if hasattr(v, "to") else v) for k, v in batch.items()
                      if k in ("input_ids", "labels", "position_ids") or k.startswith(("cu_seq", "max_length"))}
            packed_loss = float(model(**inputs).loss)
            ends = starts[1:] + [int(ids.shape[1])]
            total, count = 0.0, 0
            for s, e in zip(starts, ends, strict=True):
                seg_ids, seg_labels = ids[:, s:e], labels[:, s:e]
                seg_pos = torch.arange(0, e - s, device=bench.device)[None]
                logits = model(input_ids=seg_ids, position_ids=seg_pos, use_cache=False).logits[0, :-1].float()
                target = seg_labels[0, 1:]
                keep = target != -100
                if keep.any():
                    total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
                    count += int(keep.sum())
    finally:
        model.eval()
    reference = total / max(count, 1)
    metrics.update({"loss_packed": packed_loss, "loss_reference": reference, "loss_delta": abs(packed_loss - reference),
                    "atol": bench.tol["loss_atol"]})
    if abs(packed_loss - reference) > bench.tol["loss_atol"]:
        problems.append(f"first-batch loss {packed_loss:.6f} vs per-example reference {reference:.6f} (delta {abs(packed_loss - reference):.2e})")
    # the same examples trained STEPS steps packed vs padded (packing=False, padding_free=False), one step = all six
    steps = _train_steps(bench, feats, tokenizer, cfg_kwargs, packing=True), _train_steps(bench, feats, tokenizer, cfg_kwargs, packing=False)
    (p_loss, p_norm), (d_loss, d_norm) = steps
    metrics["steps"] = {"packed_loss": p_loss, "padded_loss": d_loss, "packed_grad_norm": p_norm, "padded_grad_norm": d_norm}
    if len(p_loss) == len(d_loss) == STEPS:
        tol_loss, tol_norm = bench.tol["train_loss_atol"], bench.tol["train_grad_norm_rel"]
        diverged = next((i + 1 for i, (a, b) in enumerate(zip(p_loss, d_loss, strict=True)) if abs(a - b) > tol_loss), None)
        norm_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(p_norm, d_norm, strict=True))
        metrics["steps"].update({"first_diverging_step": diverged, "max_grad_norm_rel": norm_rel,
                                 "max_loss_delta": max(abs(a - b) for a, b in zip(p_loss, d_loss, strict=True))})
        if diverged:
            problems.append(f"{STEPS}-step training: packed vs padded loss diverge at step {diverged} "
                            f"({p_loss[diverged - 1]:.6f} vs {d_loss[diverged - 1]:.6f})")
        elif norm_rel > tol_norm:
            problems.append(f"{STEPS}-step training: grad norm differs by {norm_rel:.2e} (relative)")
    else:
        problems.append(f"{STEPS}-step training logged {len(p_loss)} packed / {len(d_loss)} padded steps")
    if "completion_only_loss" in feats["fields"]:
        metrics["completion_only"] = _completion_only(bench, feats, tokenizer, cfg_kwargs)
        if metrics["completion_only"]["prompt_tokens_in_loss"]:
            problems.append(f"completion-only loss: {metrics['completion_only']['prompt_tokens_in_loss']} prompt tokens keep their labels")
        if metrics["completion_only"]["segments_matched"] < len(SENTENCES):
            problems.append(f"completion-only loss: {metrics['completion_only']['segments_matched']} of {len(SENTENCES)} "
                            "prompt-completion examples found whole in the packed row")
    try:
        content = packing_content()
    except ImportError as exc:  # pack_dataset appeared in TRL 0.16
        content = {"error": f"not available in trl {feats['version']}: {exc}"}
    metrics["packing_content"] = content
    problems += [f"pack_dataset strategy={k}: {p}" for k, v in content.items() if isinstance(v, dict) for p in v.get("problems", [])
                 if not p.startswith("not available")]
    if "gradient_checkpointing" in feats["fields"]:
        # gradient checkpointing recomputes the forward in backward: the packed boundaries must survive it
        g_loss, g_norm = _train_steps(bench, feats, tokenizer, {**cfg_kwargs, "gradient_checkpointing": True}, packing=True)
        if len(g_loss) == len(p_loss) == STEPS:
            gc_loss = max(abs(a - b) for a, b in zip(g_loss, p_loss, strict=True))
            gc_norm = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(g_norm, p_norm, strict=True))
            metrics["gradient_checkpointing"] = {"max_loss_delta": gc_loss, "max_grad_norm_rel": gc_norm}
            if gc_loss > bench.tol["train_loss_atol"] or gc_norm > bench.tol["train_grad_norm_rel"]:
                problems.append(f"gradient checkpointing changes the packed run: loss {gc_loss:.2e}, grad norm {gc_norm:.2e} relative")
    if problems:
        return CheckResult("fail", metrics, "; ".join(problems) + f" ({summary})")
    return CheckResult("pass", metrics, f"{summary}; {len(starts)} examples per row, loss delta {abs(packed_loss - reference):.2e}; "
                       f"{STEPS} steps packed = padded (loss delta {metrics['steps']['max_loss_delta']:.2e})"
                       + (f"; gradient checkpointing: loss delta {metrics['gradient_checkpointing']['max_loss_delta']:.2e}"
                          if "gradient_checkpointing" in metrics else ""))


STEPS = 3


def _train_steps(bench: Any, feats: dict[str, Any], tokenizer: Any, cfg_kwargs: dict[str, Any], packing: bool) -> tuple[list[float], list[float]]:
    """STEPS SFTTrainer steps on the six texts, all of them in every step (packed: one row; padded: a batch of
    six), SGD, constant LR, no clipping; per-step loss and grad norm. The model is restored afterwards."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from .checks import train_and_restore

    kwargs = {**cfg_kwargs, "packing": packing, "max_steps": STEPS, "per_device_train_batch_size": 1 if packing else len(SENTENCES),
              "learning_rate": 1e-2, "lr_scheduler_type": "constant", "optim": "sgd", "max_grad_norm": 1e9,
              "logging_steps": 1, "warmup_steps": 0, "weight_decay": 0.0, "data_seed": 0}
    kwargs = {k: v for k, v in kwargs.items() if k in feats["fields"] or k == "output_dir"}
    loss, norm, _ = train_and_restore(bench.model, lambda: SFTTrainer(
        model=bench.model, args=SFTConfig(**kwargs), train_dataset=Dataset.from_list([{"text": t} for t in SENTENCES]),
        **{feats["tokenizer_key"]: tokenizer}))
    return loss, norm


def _completion_only(bench: Any, feats: dict[str, Any], tokenizer: Any, cfg_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SFTTrainer(packing=True) on prompt-completion pairs (TRL's default for them: completion_only_loss): in the
    packed row, every prompt token must have label -100 and every completion token (after the first position
    of its example) a label. Each packed segment is matched to its example by its prompt's token ids."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    pairs = [{"prompt": " ".join(t.split(" ")[:2]), "completion": " " + " ".join(t.split(" ")[2:] or ["end."])} for t in SENTENCES]
    kwargs = {k: v for k, v in cfg_kwargs.items() if k != "dataset_text_field"}
    trainer = SFTTrainer(model=bench.model, args=SFTConfig(**kwargs), train_dataset=Dataset.from_list(pairs),
                         **{feats["tokenizer_key"]: tokenizer})
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    pos = batch["position_ids"][0].tolist() if "position_ids" in batch else [0] + [1] * (len(ids) - 1)
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in pairs]
    matched, prompt_in_loss, completion_masked = 0, 0, 0
    for s, e in itertools.pairwise(starts):
        seg = ids[s:e]
        prompt = next((p for p in prompts if seg[: len(p)] == p), None)
        if prompt is None:
            continue
        matched += 1
        prompt_in_loss += sum(1 for x in labels[s:s + len(prompt)] if x != -100)
        completion_masked += sum(1 for x in labels[s + len(prompt):e] if x == -100)
    return {"segments_matched": matched, "prompt_tokens_in_loss": prompt_in_loss, "completion_tokens_masked": completion_masked,
            "completion_only_loss": getattr(trainer.args, "completion_only_loss", None)}


#: Example lengths and row length of the packing-content probe: some examples longer than a row, some short.
CONTENT_LENGTHS = (40, 10, 70, 25, 5, 90)
CONTENT_SEQ_LENGTH = 64


def packing_content(pack: Any = None, strategies: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")) -> dict[str, Any]:
    """Token accounting of TRL's ``pack_dataset`` per strategy, on examples whose token ids are unique (so
    every output token traces back to one input position). Expected, from TRL's own documentation:
    ``bfd`` keeps each example's first ``seq_length`` tokens, whole and starting at its first token (overflow
    discarded); ``bfd_split`` loses nothing (overflow becomes its own segment); ``wrapped`` loses nothing but
    an unfilled last row. No strategy may duplicate a token or exceed ``seq_length`` per row.

    Returns strategy -> {tokens_in, tokens_out, lost, expected_lost, duplicated, rows, longest_row, problems}.
    """
    from datasets import Dataset

    if pack is None:
        from trl.data_utils import pack_dataset as pack
    params = inspect.signature(pack).parameters
    examples, start = [], 1
    for n in CONTENT_LENGTHS:
        examples.append(list(range(start, start + n)))
        start += n
    out: dict[str, Any] = {}
    for strategy in strategies:
        if "strategy" not in params and strategy != "bfd":
            out[strategy] = {"problems": ["not available in this trl (pack_dataset has no strategy argument)"]}
            continue
        kwargs = {"strategy": strategy} if "strategy" in params else {}
        try:
            packed = pack(Dataset.from_list([{"input_ids": e} for e in examples]), CONTENT_SEQ_LENGTH, **kwargs)
        except (ValueError, KeyError, TypeError) as exc:
            out[strategy] = {"problems": [f"not available: {type(exc).__name__}: {exc}"]}
            continue
        rows = [list(r) for r in packed["input_ids"]]
        tokens = [t for r in rows for t in r]
        seen = set(tokens)
        all_tokens = [t for e in examples for t in e]
        lost = len(set(all_tokens) - seen)
        if strategy == "bfd":
            expected_lost = sum(max(0, len(e) - CONTENT_SEQ_LENGTH) for e in examples)
        elif strategy == "wrapped":
            expected_lost = len(all_tokens) % CONTENT_SEQ_LENGTH if len(tokens) < len(all_tokens) else 0
        else:
            expected_lost = 0
        problems = []
        if len(tokens) != len(seen):
            problems.append(f"{len(tokens) - len(seen)} tokens duplicated")
        if lost != expected_lost:
            problems.append(f"{lost} tokens lost, {expected_lost} expected")
        if any(len(r) > CONTENT_SEQ_LENGTH for r in rows):
            problems.append(f"a row of {max(map(len, rows))} tokens exceeds seq_length {CONTENT_SEQ_LENGTH}")
        if strategy == "bfd" and "seq_lengths" in packed.column_names:
            firsts = {e[0] for e in examples}
            for r, lengths in zip(rows, packed["seq_lengths"], strict=True):
                at = 0
                for n in lengths:
                    if r[at] not in firsts:
                        problems.append(f"a segment starts at token {r[at]}, not at an example's first token (its prompt is lost)")
                        break
                    at += n
        out[strategy] = {"tokens_in": len(all_tokens), "tokens_out": len(tokens), "lost": lost, "expected_lost": expected_lost,
                         "duplicated": len(tokens) - len(seen), "rows": len(rows), "longest_row": max(map(len, rows)),
                         "problems": problems}
    return out
