"""TRL's SFTTrainer as users configure it: what is really in force, and what its batches carry.

Offline: the tokenizer is a small BPE trained with the ``tokenizers`` library on a few sentences (with a chat
template), so no Hub access is needed. Version drift is feature-detected (``processing_class`` vs ``tokenizer``,
``max_length`` vs ``max_seq_length``, ``padding_free`` from TRL 0.16, ``packing_strategy`` from 0.19); what the
installed TRL cannot express is "unsupported" with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from .results import CheckResult
from .training import TRAIN_RECIPE

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


#: Optimizer steps of each N-step comparison (all six texts in every step).
STEPS = 3
#: Packing strategies TRL documents (``pack_dataset``): the ones the installed version accepts are run. TRL 0.19
#: has ffd (first fit decreasing) and wrapped; later versions bfd, bfd_split and wrapped; 0.17 only wraps.
STRATEGIES = ("bfd", "bfd_split", "ffd", "wrapped")
#: Strategies that keep every segment whole from its first token (the overflow of a long example is dropped).
_WHOLE_SEGMENTS = ("bfd", "ffd")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No ``datasets`` progress bars in the logs while SFTTrainer tokenizes and packs (restored afterwards)."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


@dataclasses.dataclass
class _Sft:
    """What every SFTTrainer check of a cell shares: the TRL features, the offline tokenizer, the base
    SFTConfig keyword arguments (packing=True, padding_free=False, max length 512, one step, CPU or GPU)."""

    bench: Any
    feats: dict[str, Any]
    tokenizer: Any
    base: dict[str, Any]

    def config(self, **overrides: Any) -> Any:
        """An SFTConfig of ``base`` + ``overrides``, keeping only the fields the installed TRL has."""
        from trl import SFTConfig

        kwargs = {**self.base, **overrides}
        return SFTConfig(**{k: v for k, v in kwargs.items() if k in self.feats["fields"] or k == "output_dir"})

    def trainer(self, data: list[dict[str, Any]] | None = None, **overrides: Any) -> Any:
        """An SFTTrainer on ``data`` (default: the six texts) with :meth:`config` ``(**overrides)``."""
        from datasets import Dataset
        from trl import SFTTrainer

        rows = data if data is not None else [{"text": t} for t in SENTENCES]
        return SFTTrainer(model=self.bench.model, args=self.config(**overrides), train_dataset=Dataset.from_list(rows),
                          **{self.feats["tokenizer_key"]: self.tokenizer})

    def train_steps(self, capture: dict[str, Any] | None = None, data: list[dict[str, Any]] | None = None,
                    **overrides: Any) -> tuple[list[float], list[float]]:
        """STEPS SFTTrainer steps on the six texts, all of them in every step (a packed run: one row; a padded or
        padding-free run: a batch of six), SGD, constant LR, no clipping; per-step loss (what the trainer's own
        ``compute_loss`` returned) and grad norm. ``capture``: filled with the keyword arguments of the model's
        first training forward (the first batch as the trainer fed it: use_cache, num_items_in_batch included).
        ``data``: other rows than the six texts (prompt-completion pairs). The model is restored afterwards."""
        from .training import train_and_restore

        packing = overrides.get("packing", self.base["packing"])
        kwargs = {"max_steps": STEPS, "per_device_train_batch_size": 1 if packing else len(SENTENCES), **TRAIN_RECIPE, **overrides}

        def first_forward(module: Any, args: Any, call: dict[str, Any]) -> None:
            if capture is not None and not capture:
                capture.update({k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in call.items()})
                capture.setdefault("use_cache", getattr(module.config, "use_cache", None))

        handle = self.bench.model.register_forward_pre_hook(first_forward, with_kwargs=True)
        try:
            loss, norm, _ = train_and_restore(self.bench.model, lambda: self.trainer(data, **kwargs))
        finally:
            handle.remove()
        return loss, norm

    def examples(self) -> list[list[int]]:
        """The six texts' token ids as SFTTrainer tokenizes them (EOS included): :meth:`padded_batch` without its
        padding. Splits a packed row that carries no position_ids."""
        batch = self.padded_batch()
        return [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]

    def padded_trainer_steps(self) -> tuple[list[float], list[float]]:
        """SFTTrainer's own padded run (packing=False, padding_free=False), STEPS steps, cached per model."""
        key = ("sft_padded_trainer", id(self.bench.model), self.feats["version"])
        if key not in self.bench._cache:
            self.bench._cache[key] = self.train_steps(packing=False, padding_free=False)
        return self.bench._cache[key]

    def padded_batch(self) -> dict[str, Any]:
        """The six texts as SFTTrainer(packing=False, padding_free=False) batches them: one right-padded batch
        (cached per model, like the reference run on it)."""
        key = ("sft_padded_batch", id(self.bench.model), self.feats["version"])
        if key not in self.bench._cache:
            trainer = self.trainer(packing=False, padding_free=False, per_device_train_batch_size=len(SENTENCES))
            self.bench._cache[key] = next(iter(trainer.get_train_dataloader()))
        return self.bench._cache[key]

    def padded_steps(self) -> tuple[list[float], list[float]]:
        """The reference: :func:`pytest_packcheck.training.reference_steps` (STEPS hand-written SGD steps, token-mean
        loss after the shift) on :meth:`padded_batch`, cached per model. Not SFTTrainer's own padded run: its
        Trainer may normalise padded batches by the unshifted label count (transformers 4.x; gpt2 on 5.24)."""
        from .training import reference_steps

        key = ("sft_padded", id(self.bench.model), self.feats["version"])
        if key not in self.bench._cache:
            loss, norm, _ = reference_steps(self.bench.model, self.padded_batch(), STEPS)
            self.bench._cache[key] = (loss, norm)
        return self.bench._cache[key]


def _setup(bench: Any, out_dir: str) -> _Sft | CheckResult:
    """The shared SFTTrainer set-up, or the skipped / unsupported verdict when TRL cannot run it."""
    try:
        feats = trl_features()
    except ImportError as exc:
        return CheckResult("skipped", {}, f"trl is not installed ({exc})")
    missing = [f for f in ("packing", "padding_free") if f not in feats["fields"]]
    if missing or feats["max_length_key"] is None:
        return CheckResult("unsupported", {"trl": feats["version"]},
                           f"not available in trl {feats['version']}: SFTConfig has no {', '.join(missing) or 'max_length'}")
    base = {"output_dir": out_dir, "packing": True, "padding_free": False, feats["max_length_key"]: 512,
            "per_device_train_batch_size": 1, "max_steps": 1, "report_to": [], "save_strategy": "no",
            "use_cpu": not bench.device.startswith("cuda"), "dataset_text_field": "text", "seed": 0, "disable_tqdm": True,
            # SFTConfig defaults to bf16=True (autocast, CPU included): the comparisons run in the model's dtype
            "bf16": False, "fp16": False}
    return _Sft(bench, feats, offline_tokenizer(int(bench.config.vocab_size)), base)


def _run_sft_check(bench: Any, body: Callable[[_Sft], CheckResult]) -> CheckResult:
    """Run ``body`` on the shared set-up. SFTTrainer sets use_cache=False on the model it is given; the
    measurements run with that (as training would), and the model's own settings (use_cache, special token
    ids, in its config and generation config) are restored afterwards for the group's other checks."""
    from .backends import backend_availability

    avail = backend_availability(bench.backend or "eager", bench.device)
    if not avail.backward:  # training needs a backward pass (flex_attention on CPU has none)
        return CheckResult("skipped", {}, avail.backward_reason)
    model = bench.model
    configs = [c for c in (model.config, getattr(model, "generation_config", None)) if c is not None]
    # SFTTrainer also aligns the model's special token ids with its tokenizer's (TRL 1.x): put them back too
    saved = [(c, k, getattr(c, k)) for c in configs for k in ("use_cache", *_TOKEN_IDS) if hasattr(c, k)]
    try:
        with tempfile.TemporaryDirectory(prefix="packcheck-sft-") as out_dir, _quiet_datasets():
            sft = _setup(bench, out_dir)
            return sft if isinstance(sft, CheckResult) else body(sft)
    finally:
        for config, key, value in saved:
            setattr(config, key, value)


_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _effective(trainer: Any) -> dict[str, Any]:
    """What is in force after SFTTrainer was built. The collator is what pads or flattens: its padding_free
    is the one in force (TRL 1.16's bfd packing turns it on whatever SFTConfig.padding_free says)."""
    from .backends import effective_attn_implementation

    collator_free = getattr(trainer.data_collator, "padding_free", None)
    model = trainer.model
    return {"packing": trainer.args.packing,
            "padding_free": collator_free if collator_free is not None else getattr(trainer.args, "padding_free", None),
            "packing_strategy": getattr(trainer.args, "packing_strategy", None),
            "collator": type(trainer.data_collator).__name__,
            # TRL 0.20-0.23 build it as use_flash_attention: False on every other backend
            "return_position_ids": getattr(trainer.data_collator, "return_position_ids", None),
            "use_cache": getattr(model.config, "use_cache", None),
            "attn_implementation": effective_attn_implementation(model)}


def _configuration(sft: _Sft, trainer: Any, requested: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Metrics (TRL version, requested vs effective configuration, overrides) and a one-line summary."""
    effective = _effective(trainer)
    overridden = {k: (v, effective.get(k)) for k, v in requested.items() if k in effective and effective[k] != v}
    metrics = {"trl": sft.feats["version"], "requested": requested, "effective": effective,
               "overridden": {k: list(v) for k, v in overridden.items()}}
    over = "; ".join(f"{k} requested {a} -> in force {b}" for k, (a, b) in overridden.items())
    summary = (f"trl {sft.feats['version']}: {effective['collator']}, packing={effective['packing']}, "
               f"padding_free={effective['padding_free']}, packing_strategy={effective['packing_strategy']}, "
               f"use_cache={effective['use_cache']}" + (f"; overridden: {over}" if over else ""))
    return metrics, summary


def _row_contract(bench: Any, batch: dict[str, Any], metrics: dict[str, Any]) -> tuple[list[str], list[int] | None]:
    """The first batch of a packed or padding-free run: one row whose position_ids restart per example, labels
    -100 at each example's first token, cu_seq_lens_q and seq_idx (where TRL emits them) at the restarts, and no all-ones
    attention_mask (it would override the boundaries on eager / sdpa / flex). Returns the problems and the
    example starts (None when the row has no position_ids)."""
    problems = []
    metrics["keys"] = sorted(batch)
    all_ones = "attention_mask" in batch and int((batch["attention_mask"] == 0).sum()) == 0 and batch["input_ids"].shape[0] == 1
    metrics["row_contract"] = {"all_ones_attention_mask": all_ones, "position_ids": "position_ids" in batch}
    if all_ones:
        problems.append("the packed batch carries an all-ones attention_mask (it overrides the boundaries on eager/sdpa/flex)")
    pos = batch.get("position_ids")
    if pos is None:
        effective = metrics.get("effective") or {}
        why = (": padding_free is on, but the collator has return_position_ids=False (TRL builds it as use_flash_attention)"
               if effective.get("padding_free") and effective.get("return_position_ids") is False else "")
        problems.append(f"the packed batch carries no position_ids{why}: examples are concatenated without boundaries")
        return problems, None
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    metrics["examples_in_row"] = len(starts)
    if len(starts) < 2:
        problems.append(f"position_ids restart {len(starts)} time(s): the row is not packed")
    labels = batch["labels"]
    unmasked = [s for s in starts if int(labels[0, s]) != -100]
    if unmasked:
        text = f"labels not -100 at {len(unmasked)} example starts {unmasked[:5]}"
        problems.append(text)
        # its own cause (boundary_labels), beside whatever else the row breaks
        metrics["row_contract"].update({"unmasked_starts": unmasked[:12], "label_problem": text})
    if "seq_idx" in batch:  # TRL 1.x, for the short convolutions of linear-attention layers: example index per token
        seq_idx = batch["seq_idx"][0].tolist()
        bounds = [*starts, int(pos.shape[-1])]
        expected = [i for i in range(len(starts)) for _ in range(bounds[i + 1] - bounds[i])]
        metrics["seq_idx_matches"] = seq_idx == expected
        if seq_idx != expected:
            wrong = next(i for i, (a, b) in enumerate(zip(seq_idx, expected, strict=False)) if a != b) if len(seq_idx) == len(expected) else None
            problems.append(f"seq_idx disagrees with the position_ids restarts (first at token {wrong}, length "
                            f"{len(seq_idx)} vs {len(expected)})")
    if "cu_seq_lens_q" in batch:
        cu = batch["cu_seq_lens_q"].tolist()
        metrics["cu_seq_lens_q"] = cu[:12]
        if cu != [*starts, int(pos.shape[-1])]:
            problems.append(f"cu_seq_lens_q {cu[:8]} disagree with the position_ids restarts {starts[:8]} and the row "
                            f"length {int(pos.shape[-1])}")
    return problems, starts


#: The probes of an SFT mode, most specific first. Each runs whatever the others found and records its own item
#: (``metrics["probes"][name]``: status pass / fail / not_checked, evidence, cause); the cell's causes are the
#: failed probes' in this order, each with its own numbers (``CheckResult.causes``), the first one primary. Labels (prompt tokens trained)
#: and a broken row are read off the batch; the loss probes measure what they do to training.
PROBES = ("completion_only", "row_contract", "boundary_labels", "label_count", "first_batch_loss", "steps",
          "gradient_checkpointing")


def _record(metrics: dict[str, Any], name: str, status: str, evidence: str, cause: str | None = None,
            numbers: dict[str, Any] | None = None) -> None:
    """One probe's item in ``metrics["probes"]``: status ("pass", "fail", "not_checked"), evidence (one line),
    cause code (a fail's), and the numbers behind the cause."""
    metrics.setdefault("probes", {})[name] = {"status": status, "evidence": evidence, "cause": cause if status == "fail" else None,
                                              **({"numbers": numbers} if numbers else {})}


def _segment_starts(batch: dict[str, Any], examples: list[list[int]]) -> tuple[list[int] | None, str]:
    """Where the examples of a one-row batch start, and how that was found: the ``position_ids`` restarts; else
    the known examples' token ids matched one after another along the row (a row that carries no position_ids:
    TRL 0.19 - 0.23 on non-flash backends); (None, why) when neither splits the whole row."""
    pos = batch.get("position_ids")
    if pos is not None:
        return (pos[0] == 0).nonzero().flatten().tolist(), "position_ids"
    row = batch["input_ids"][0].tolist()
    pool = sorted((e for e in examples if e), key=len, reverse=True)
    starts, at = [], 0
    while at < len(row):
        match = next((e for e in pool if row[at:at + len(e)] == e), None)
        if match is None:
            return None, f"no position_ids, and no known example starts at token {at} of {len(row)}"
        starts.append(at)
        at += len(match)
    return starts, "the known examples' token ids (the row has no position_ids)"


def _reference_loss(bench: Any, ids: Any, labels: Any, starts: list[int]) -> float:
    """Token-mean loss of each segment of the row run alone (positions from 0, use_cache=False, train mode, no
    grad), over the row's own labels after the shift inside each segment."""
    import torch

    device, model = bench.device, bench.model
    ids, labels = ids.to(device), labels.to(device)
    ends = starts[1:] + [int(ids.shape[1])]
    total, count = 0.0, 0
    model.train()
    try:
        with torch.no_grad():
            for s, e in zip(starts, ends, strict=True):
                seg_pos = torch.arange(0, e - s, device=device)[None]
                logits = model(input_ids=ids[:, s:e], position_ids=seg_pos, use_cache=False).logits[0, :-1].float()
                target = labels[0, s + 1:e]
                keep = target != -100
                if keep.any():
                    total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
                    count += int(keep.sum())
    finally:
        model.eval()
    return total / max(count, 1)


def _first_batch_probe(sft: _Sft, first: dict[str, Any], trainer_loss: float, metrics: dict[str, Any], name: str = "first_batch_loss",
                       prefix: str = "") -> None:
    """The trainer's own loss on its first batch (what its ``compute_loss`` returned at step 1: train mode, the
    use_cache and num_items_in_batch it passed; TRL 0.24's compute_loss passes use_cache=False whatever the
    config says) vs each example of that batch alone (:func:`_reference_loss`), ``loss_atol``. The examples are
    split at the position_ids restarts, else at the known examples' token ids; "not_checked" when neither
    splits the row."""
    bench = sft.bench
    starts, source = _segment_starts(first, sft.examples())
    metrics.update({"first_batch_use_cache": first.get("use_cache"), "first_batch_boundaries": source,
                    "first_batch_num_items_in_batch": _int(first.get("num_items_in_batch"))})
    if starts is None or "labels" not in first:
        _record(metrics, name, "not_checked", f"{prefix}first-batch loss not checked: no boundaries to split at ({source})")
        return
    _label_count_probe(first, starts, metrics, name.replace("first_batch_loss", "label_count"), prefix)
    reference = _reference_loss(bench, first["input_ids"], first["labels"], starts)
    delta = abs(trainer_loss - reference)
    metrics.update({"loss_packed": trainer_loss, "loss_reference": reference, "loss_delta": delta, "atol": bench.tol["loss_atol"]})
    text = (f"{prefix}first-batch loss {trainer_loss:.6f} (the trainer's own, use_cache={first.get('use_cache')}) vs per-example "
            f"reference {reference:.6f} (delta {delta:.2e}; {len(starts)} examples split at {source.split(' (')[0]})")
    if delta <= bench.tol["loss_atol"]:
        _record(metrics, name, "pass", text)
        return
    cause, numbers = _loss_cause(bench, metrics)
    _record(metrics, name, "fail", text, cause, numbers)


def _label_count_probe(first: dict[str, Any], starts: list[int], metrics: dict[str, Any], name: str, prefix: str) -> None:
    """``num_items_in_batch`` the trainer passed with its first batch vs the label tokens that batch trains, each
    example on its own (labels != -100 after the shift inside each segment): a label unmasked at a boundary, or a
    count made before the shift (transformers 4.46 - 5.10.0), makes them differ. Its own cause
    (loss_normalisation), with both numbers. No item when the trainer passes no count (TRL 1.16's compute_loss
    normalises by itself: the first-batch loss probe measures that); packcheck's SFT runs use no gradient
    accumulation, so a count covers this one batch."""
    given = _int(first.get("num_items_in_batch"))
    if given is None:
        return
    labels = first["labels"][0]
    ends = [*starts[1:], int(labels.shape[-1])]
    expected = sum(int((labels[s + 1:e] != -100).sum()) for s, e in zip(starts, ends, strict=True))
    text = f"{prefix}num_items_in_batch {given} (the trainer's) vs {expected} label tokens of the examples each on its own"
    if given == expected:
        _record(metrics, name, "pass", text)
    else:
        _record(metrics, name, "fail", f"{text} ({given - expected:+d})", "loss_normalisation",
                {"num_items_in_batch": given, "label_tokens_expected": expected})


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _no_boundaries(row: dict[str, Any]) -> bool:
    """The row contract found no boundaries: no position_ids, or an all-ones attention_mask beside them."""
    return bool(row.get("all_ones_attention_mask")) or row.get("position_ids") is False


def _loss_cause(bench: Any, metrics: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The cause of a loss probe off the reference: ``mask_override`` when the row carries no boundaries (the
    row contract says why), else measured (:func:`pytest_packcheck.checks.mismatch_cause`: leak, stateful
    layers, ...), or ``loss_normalisation`` when the packed logits match each example alone."""
    from .checks import mismatch_cause

    row = metrics.get("row_contract") or {}
    if _no_boundaries(row):
        return "mask_override", dict(row)
    logits_diff, _ = bench.diff_to_solo(bench.packed_logits())
    if logits_diff <= bench.tol["logits_atol"]:
        return "loss_normalisation", {"logits_diff": logits_diff}
    return mismatch_cause(bench, logits_diff, bench.tol["logits_atol"])


def _contract_probe(metrics: dict[str, Any], problems: list[str], starts: list[int] | None, name: str = "row_contract",
                    prefix: str = "") -> None:
    """The row contract's probe, and the boundary labels' on their own (``boundary_labels``: labels not -100 at
    example starts train each example's first token as the previous one's next token, whatever else holds)."""
    row = metrics.get("row_contract") or {}
    label_problem = row.get("label_problem")
    if starts is not None:
        base = name.replace("row_contract", "boundary_labels")
        if label_problem:
            _record(metrics, base, "fail", prefix + label_problem, "boundary_labels",
                    {"unmasked_starts": row.get("unmasked_starts"), "examples": len(starts)})
        else:
            _record(metrics, base, "pass", f"{prefix}labels -100 at all {len(starts)} example starts")
    problems = [x for x in problems if x != label_problem]
    if not problems:
        _record(metrics, name, "pass", f"{prefix}{len(starts or [])} examples per row, position_ids restart at each")
        return
    cause = "mask_override" if _no_boundaries(row) else "collator_contract"
    _record(metrics, name, "fail", "; ".join(prefix + p for p in problems), cause, dict(row))


def _steps_probe(sft: _Sft, run: tuple[list[float], list[float]], metrics: dict[str, Any], label: str,
                 name: str = "steps") -> None:
    metrics["steps"], bad = _compare_steps(sft.bench, run, sft.padded_steps(), label)
    if not bad:
        _record(metrics, name, "pass", f"{label}: {STEPS} steps = padded reference (loss delta {metrics['steps']['max_loss_delta']:.2e})")
        return
    cause, numbers = _loss_cause(sft.bench, metrics)
    _record(metrics, name, "fail", "; ".join(bad), cause, numbers)


def _verdict(metrics: dict[str, Any], summary: str, passed: str) -> CheckResult:
    """The cell from its probes: pass when none failed (not-checked items named); else fail with every failed
    probe's evidence, the first one's cause (in :data:`PROBES` order) and the others' as findings."""
    probes = metrics.get("probes") or {}

    def rank(name: str) -> int:
        base = name.rsplit(":", 1)[-1]
        return PROBES.index(base) if base in PROBES else len(PROBES)

    failed = sorted((n for n, p in probes.items() if p["status"] == "fail"), key=rank)
    unchecked = [p["evidence"] for p in probes.values() if p["status"] == "not_checked"]
    if not failed:
        return CheckResult("pass", metrics, passed + "".join(f"; {u}" for u in unchecked))
    causes, seen = [], set()
    for n in failed:  # every failed probe's cause, once, with that probe's numbers: the first is primary
        if probes[n]["cause"] and probes[n]["cause"] not in seen:
            seen.add(probes[n]["cause"])
            causes.append({"cause": probes[n]["cause"], "evidence": {"probe": n, **(probes[n].get("numbers") or {})}})
    text = "; ".join(probes[n]["evidence"] for n in failed) + "".join(f"; {u}" for u in unchecked) + f" ({summary})"
    return CheckResult("fail", metrics, text, causes=causes)


def _compare_steps(bench: Any, run: tuple[list[float], list[float]], reference: tuple[list[float], list[float]],
                   label: str) -> tuple[dict[str, Any], list[str]]:
    """Per-step loss (``train_loss_atol``) and grad norm (relative, ``train_grad_norm_rel``) of ``run`` vs the
    padded ``reference``: metrics and the problems (the first diverging step with both losses)."""
    (loss, norm), (ref_loss, ref_norm) = run, reference
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": norm, "padded_loss": ref_loss, "padded_grad_norm": ref_norm}
    if not (len(loss) == len(ref_loss) == STEPS):
        return metrics, [f"{label}: {STEPS}-step training logged {len(loss)} steps, the padded run {len(ref_loss)}"]
    tol_loss, tol_norm = bench.tol["train_loss_atol"], bench.tol["train_grad_norm_rel"]
    diverged = next((i + 1 for i, (a, b) in enumerate(zip(loss, ref_loss, strict=True)) if abs(a - b) > tol_loss), None)
    norm_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norm, ref_norm, strict=True))
    metrics.update({"first_diverging_step": diverged, "max_grad_norm_rel": norm_rel,
                    "max_loss_delta": max(abs(a - b) for a, b in zip(loss, ref_loss, strict=True))})
    if diverged:
        return metrics, [(f"{label}: {STEPS}-step training, packed vs padded loss diverge at step {diverged} "
                          f"({loss[diverged - 1]:.6f} vs {ref_loss[diverged - 1]:.6f})")]
    if norm_rel > tol_norm:
        return metrics, [f"{label}: {STEPS}-step training, grad norm differs by {norm_rel:.2e} (relative)"]
    return metrics, []


def _packed_run(sft: _Sft, trainer: Any, requested: dict[str, Any], label: str,
                **train: Any) -> tuple[dict[str, Any], str, tuple[list[float], list[float]]]:
    """What every packed / padding-free SFT mode is checked for, each probe on its own whatever the others
    found: the configuration in force next to ``requested``, the first batch's row contract, the trainer's
    first-batch loss vs each example alone, and STEPS steps (``train_steps(**train)``) against the padded
    reference. Returns metrics (with ``probes``), the summary and the run's (losses, grad norms)."""
    metrics, summary = _configuration(sft, trainer, requested)
    batch = next(iter(trainer.get_train_dataloader()))
    problems, starts = _row_contract(sft.bench, batch, metrics)
    _contract_probe(metrics, problems, starts)
    first: dict[str, Any] = {}
    run = sft.train_steps(capture=first, **train)
    if run[0]:
        _first_batch_probe(sft, first or batch, run[0][0], metrics)
    else:
        _record(metrics, "first_batch_loss", "not_checked", "first-batch loss not checked: the trainer logged no step")
    _steps_probe(sft, run, metrics, label)
    return metrics, summary, run


def check_sft(bench: Any) -> CheckResult:
    """SFTTrainer(packing=True) on six short texts, as configured by default for the installed TRL.

    Reports the effective configuration next to the request (padding_free, packing_strategy, the collator
    class, use_cache, attn_implementation; a silent override is named) and runs every probe whatever the others
    found (:data:`PROBES`): the first batch's contract (:func:`_row_contract`), the trainer's own first-batch
    loss against the per-example reference (``loss_atol``), STEPS steps packed vs the padded reference
    (``train_loss_atol``, ``train_grad_norm_rel``), gradient checkpointing on vs off, and completion-only labels on
    prompt-completion pairs. Fails on any of these, with the most specific probe's cause. SFTTrainer's own
    padded run is the ``sft_padded`` check's.
    """
    return _run_sft_check(bench, _check_sft)


def _check_sft(sft: _Sft) -> CheckResult:
    bench = sft.bench
    requested = {"packing": True, "padding_free": False}
    if "packing_strategy" in sft.feats["fields"]:
        requested["packing_strategy"] = next(f.default for f in dataclasses.fields(sft.config()) if f.name == "packing_strategy")
    metrics, summary, packed = _packed_run(sft, sft.trainer(), requested, "packed", packing=True)
    if "completion_only_loss" in sft.feats["fields"]:
        _completion_probe(metrics, _completion_only(bench, sft.feats, sft.tokenizer, sft.base))
    if "gradient_checkpointing" in sft.feats["fields"]:
        # gradient checkpointing recomputes the forward in backward: the packed boundaries must survive it
        g_loss, g_norm = sft.train_steps(packing=True, gradient_checkpointing=True)
        p_loss, p_norm = packed
        if len(g_loss) == len(p_loss) == STEPS:
            gc_loss = max(abs(a - b) for a, b in zip(g_loss, p_loss, strict=True))
            gc_norm = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(g_norm, p_norm, strict=True))
            metrics["gradient_checkpointing"] = {"max_loss_delta": gc_loss, "max_grad_norm_rel": gc_norm}
            text = f"gradient checkpointing on vs off: loss {gc_loss:.2e}, grad norm {gc_norm:.2e} relative"
            if gc_loss > bench.tol["train_loss_atol"] or gc_norm > bench.tol["train_grad_norm_rel"]:
                _record(metrics, "gradient_checkpointing", "fail", f"{text}: gradient checkpointing changes the packed run",
                        "packed_mismatch", {"max_loss_delta": gc_loss, "max_grad_norm_rel": gc_norm})
            else:
                _record(metrics, "gradient_checkpointing", "pass", text)
        else:
            _record(metrics, "gradient_checkpointing", "not_checked",
                    f"gradient checkpointing not checked: {len(g_loss)} and {len(p_loss)} steps logged")
    passed = (f"{summary}; {metrics.get('examples_in_row')} examples per row, first-batch loss delta {metrics.get('loss_delta', float('nan')):.2e}; "
              f"{STEPS} steps packed = padded (loss delta {metrics['steps'].get('max_loss_delta', float('nan')):.2e})"
              + (f"; gradient checkpointing: loss delta {metrics['gradient_checkpointing']['max_loss_delta']:.2e}"
                 if "gradient_checkpointing" in metrics else ""))
    return _verdict(metrics, summary, passed)


def _completion_probe(metrics: dict[str, Any], found: dict[str, Any]) -> None:
    metrics["completion_only"] = found
    if found["segments_matched"] == 0:
        _record(metrics, "completion_only", "not_checked",
                f"completion-only loss not checked: no prompt-completion example found in the packed row ({found['boundaries']})")
    elif found["prompt_tokens_in_loss"]:
        _record(metrics, "completion_only", "fail",
                f"completion-only loss: {found['prompt_tokens_in_loss']} prompt tokens keep their labels (prompts are trained; "
                f"{found['segments_matched']} examples split at {found['boundaries'].split(' (')[0]})", "completion_mask",
                {"prompt_tokens_in_loss": found["prompt_tokens_in_loss"], "completion_only_loss": found["completion_only_loss"]})
    elif found["segments_matched"] < len(SENTENCES):
        _record(metrics, "completion_only", "fail", f"completion-only loss: {found['segments_matched']} of {len(SENTENCES)} "
                "prompt-completion examples found whole in the packed row", "collator_contract")
    else:
        _record(metrics, "completion_only", "pass", f"completion-only loss: prompts out of the loss in all {found['segments_matched']} examples")


def check_sft_padded(bench: Any) -> CheckResult:
    """SFTTrainer's own padded run (``packing=False, padding_free=False``), STEPS steps, against the hand-written
    reference (:func:`pytest_packcheck.training.reference_steps` on the same padded batch): the padded side's
    verdict. A loss off by label tokens after / before the shift is ``padded_normalisation`` (the trainer divides
    padded batches by the unshifted count: transformers' Trainer up to 5.9, gpt2 on 5.24); the packed checks
    compare with the reference, so a wrong padded side never shows as a packing fault."""
    return _run_sft_check(bench, _check_sft_padded)


def _check_sft_padded(sft: _Sft) -> CheckResult:
    from .training import padded_verdict

    result = padded_verdict(sft.bench, sft.padded_trainer_steps(), sft.padded_steps(), sft.padded_batch()["labels"], "SFTTrainer")
    result.metrics["trl"] = sft.feats["version"]
    return result


def check_sft_padding_free(bench: Any) -> CheckResult:
    """SFTTrainer(packing=False, padding_free=True): each batch of six texts is flattened into one row by TRL's
    collator (no packing of the dataset). Effective configuration vs the request, the first batch's contract
    and the trainer's loss on it vs the per-example reference, and STEPS steps padding-free vs padded, each
    probe on its own. Where the model's backend builds no packed mask from position_ids (eager / sdpa before
    transformers 4.54) the examples attend to each other and the loss diverges. ``padding_free`` appeared in
    TRL 0.16: before, "unsupported"."""
    return _run_sft_check(bench, _check_sft_padding_free)


def _check_sft_padding_free(sft: _Sft) -> CheckResult:
    requested = {"packing": False, "padding_free": True}
    # TRL 1.16 refuses max_length with padding-free batches that are not packed (it could not enforce it); the
    # six texts are short, so no length limit is needed
    mode = {"packing": False, "padding_free": True, sft.feats["max_length_key"]: None}
    trainer = sft.trainer(**mode, per_device_train_batch_size=len(SENTENCES))
    metrics, summary, _ = _packed_run(sft, trainer, requested, "padding-free", **mode)
    if {"completion_only_loss", "gradient_checkpointing"} <= set(sft.feats["fields"]):
        _completion_checkpointing_probe(sft, metrics, mode)
    return _verdict(metrics, summary, f"{summary}; {metrics.get('examples_in_row')} examples per row, loss delta "
                    f"{metrics.get('loss_delta', float('nan')):.2e}; {STEPS} steps padding-free = padded (loss delta "
                    f"{metrics['steps'].get('max_loss_delta', float('nan')):.2e})")


def check_sft_strategies(bench: Any) -> CheckResult:
    """SFTTrainer(packing=True) once per packing_strategy the installed TRL accepts (bfd, bfd_split, wrapped),
    STEPS steps each vs the padded run. ``bfd`` and ``bfd_split`` keep the boundaries (padding-free rows) and
    must match the padded run: each gets the row contract, first-batch loss and steps probes, on their own;
    ``wrapped`` ignores boundaries by design (TRL's documentation), so its numbers are reported but never fail
    the cell. ``packing_strategy`` appeared in TRL 0.19: before, "unsupported"."""
    return _run_sft_check(bench, _check_sft_strategies)


def _check_sft_strategies(sft: _Sft) -> CheckResult:
    bench = sft.bench
    if "packing_strategy" not in sft.feats["fields"]:
        return CheckResult("unsupported", {"trl": sft.feats["version"]},
                           f"not available in trl {sft.feats['version']}: SFTConfig has no packing_strategy (added in 0.19)")
    metrics: dict[str, Any] = {"trl": sft.feats["version"], "strategies": {}, "probes": {}}
    ran = []
    for strategy in STRATEGIES:
        try:
            trainer = sft.trainer(packing=True, packing_strategy=strategy)
        except ValueError as exc:  # an older TRL refuses a strategy it does not have
            metrics["strategies"][strategy] = {"available": False, "reason": str(exc).splitlines()[0][:200]}
            continue
        entry: dict[str, Any] = {"available": True, "effective": _effective(trainer)}
        batch = next(iter(trainer.get_train_dataloader()))
        first: dict[str, Any] = {}
        run = sft.train_steps(capture=first, packing=True, packing_strategy=strategy)
        if strategy == "wrapped":
            entry["steps"], _ = _compare_steps(bench, run, sft.padded_steps(), strategy)
            entry["keys"] = sorted(batch)
            entry["by_design"] = "wrapped packing ignores example boundaries by design (TRL docs): measured, not compared for parity"
        else:
            # every probe of the strategy on its own: the row contract says why the steps diverge (e.g. TRL
            # 0.20-0.23 send no position_ids to non-flash backends), the loss probes say by how much
            problems, starts = _row_contract(bench, batch, entry)
            _contract_probe(entry, problems, starts, prefix=f"{strategy}: ")
            if run[0]:
                _first_batch_probe(sft, first or batch, run[0][0], entry, prefix=f"{strategy}: ")
            _steps_probe(sft, run, entry, strategy)
            metrics["probes"].update({f"{strategy}:{k}": v for k, v in entry.pop("probes").items()})
        metrics["strategies"][strategy] = entry
        ran.append(f"{strategy} {entry['steps'].get('max_loss_delta', float('nan')):.2e}")
    if not ran:
        return CheckResult("unsupported", metrics, f"no packing strategy runs in trl {sft.feats['version']}")
    summary = f"trl {sft.feats['version']}, {STEPS}-step loss delta vs padded: " + ", ".join(ran)
    if metrics["strategies"].get("wrapped", {}).get("available"):
        summary += " (wrapped: boundaries ignored by design, not failed)"
    return _verdict(metrics, summary, summary)


def check_packing_content(bench: Any) -> CheckResult:
    """Token accounting of TRL's ``pack_dataset`` per strategy (:func:`packing_content`): per model, no backend
    (the packer never sees the model). ``pack_dataset`` appeared in TRL 0.16: before, "unsupported"."""
    try:
        import trl
    except ImportError as exc:
        return CheckResult("skipped", {}, f"trl is not installed ({exc})")
    try:
        with _quiet_datasets():
            content = packing_content()
    except ImportError as exc:
        return CheckResult("unsupported", {"trl": trl.__version__}, f"not available in trl {trl.__version__}: {exc}")
    problems = [f"{s}: {p}" for s, v in content.items() for p in v["problems"]]
    metrics = {"trl": trl.__version__, "strategies": content}
    ran = {s: v for s, v in content.items() if v.get("available", True)}
    summary = "; ".join(f"{s}: {v['lost']} lost ({v['overflow']} overflow), {v['duplicated']} duplicated, {v['tail_starts']} tail starts"
                        for s, v in ran.items())
    if problems:
        return CheckResult("fail", metrics, "; ".join(problems) + f" (trl {trl.__version__})", cause="packing_content",
                           evidence={s: {k: v[k] for k in ("lost", "duplicated", "tail_starts") if k in v} for s, v in content.items()
                                     if v["problems"]})
    return CheckResult("pass", metrics, f"trl {trl.__version__}: {summary}")


def completion_pairs() -> list[dict[str, str]]:
    """The prompt-completion pairs of the completion-only probes: each of :data:`SENTENCES` split after its second word."""
    return [{"prompt": " ".join(t.split(" ")[:2]), "completion": " " + " ".join(t.split(" ")[2:] or ["end."])} for t in SENTENCES]


def prompt_tokens_in_loss(batch: dict[str, Any], prompts: list[list[int]]) -> tuple[int, int]:
    """(segments whose prompt was found at their start, prompt tokens among them whose label is not -100) of a
    one-row batch split at its position_ids restarts (:func:`_segment_starts`)."""
    starts, _ = _segment_starts(batch, [])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    matched, in_loss = 0, 0
    for s, e in itertools.pairwise([*(starts or []), len(ids)] if starts else []):
        prompt = next((p for p in prompts if ids[s:e][: len(p)] == p), None)
        if prompt is not None:
            matched += 1
            in_loss += sum(1 for x in labels[s:s + len(prompt)] if x != -100)
    return matched, in_loss


def _completion_checkpointing_probe(sft: _Sft, metrics: dict[str, Any], mode: dict[str, Any]) -> None:
    """Completion-only labels through ``padding_free`` with gradient checkpointing on (issue 25): SFTTrainer on the
    prompt-completion pairs (:func:`completion_pairs`, TRL's completion_only_loss default for them), one batch of
    all six flattened into a row, ``gradient_checkpointing=True``, :data:`STEPS` steps. Probes, in ``metrics["probes"]``:
    ``gradient_checkpointing:completion_only`` (every prompt token of the first trained row has label -100; cause
    completion_mask) and ``gradient_checkpointing:first_batch_loss`` (the trainer's own first loss, recomputed in
    backward, vs each example alone over the same labels; numbers in ``metrics["completion_checkpointing"]``)."""
    pairs = completion_pairs()
    first: dict[str, Any] = {}
    losses, _ = sft.train_steps(capture=first, data=pairs, **mode, gradient_checkpointing=True)
    name = "gradient_checkpointing:completion_only"
    if not first or "labels" not in first or first.get("position_ids") is None:
        _record(metrics, name, "not_checked", "completion-only with gradient checkpointing not checked: the first trained "
                "row carries no labels or position_ids")
        return
    prompts = [sft.tokenizer(p["prompt"])["input_ids"] for p in pairs]
    matched, in_loss = prompt_tokens_in_loss(first, prompts)
    sub: dict[str, Any] = {"segments_matched": matched, "prompt_tokens_in_loss": in_loss}
    if matched == 0:
        _record(metrics, name, "not_checked", "completion-only with gradient checkpointing not checked: no prompt found "
                "at an example start of the row")
    elif in_loss:
        _record(metrics, name, "fail", f"completion-only, padding_free, gradient checkpointing: {in_loss} prompt tokens keep "
                f"their labels in {matched} examples", "completion_mask", {"prompt_tokens_in_loss": in_loss})
    else:
        _record(metrics, name, "pass", f"completion-only, padding_free, gradient checkpointing: prompts out of the loss in "
                f"all {matched} examples")
    if losses:
        _first_batch_probe(sft, first, losses[0], sub, name="gradient_checkpointing:first_batch_loss",
                           prefix="completion-only, padding_free, gradient checkpointing: ")
        metrics.setdefault("probes", {}).update(sub.pop("probes", {}))
    metrics["completion_checkpointing"] = sub


def _completion_only(bench: Any, feats: dict[str, Any], tokenizer: Any, cfg_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SFTTrainer(packing=True) on prompt-completion pairs (TRL's default for them: completion_only_loss): in the
    packed row, every prompt token must have label -100 and every completion token (after the first position
    of its example) a label. The row is split at its position_ids restarts, else (no position_ids: TRL 0.19 -
    0.23 on non-flash backends) at the pairs' token ids as SFTTrainer(packing=False) tokenizes them; each
    segment is matched to its example by its prompt's token ids. TRL 0.19's packer drops the completion mask
    (measured: 0.19.1 trains the prompts, 0.20.0 does not)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    pairs = [{"prompt": " ".join(t.split(" ")[:2]), "completion": " " + " ".join(t.split(" ")[2:] or ["end."])} for t in SENTENCES]
    kwargs = {k: v for k, v in cfg_kwargs.items() if k != "dataset_text_field" and (k in feats["fields"] or k == "output_dir")}

    def build(**over: Any) -> Any:
        return SFTTrainer(model=bench.model, args=SFTConfig(**{**kwargs, **over}), train_dataset=Dataset.from_list(pairs),
                          **{feats["tokenizer_key"]: tokenizer})

    trainer = build()
    batch = next(iter(trainer.get_train_dataloader()))
    examples = [] if "position_ids" in batch else [list(e) for e in build(packing=False, padding_free=False).train_dataset["input_ids"]]
    starts, source = _segment_starts(batch, examples)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in pairs]
    matched, prompt_in_loss, completion_masked = 0, 0, 0
    for s, e in itertools.pairwise([*(starts or []), len(ids)] if starts else []):
        seg = ids[s:e]
        prompt = next((p for p in prompts if seg[: len(p)] == p), None)
        if prompt is None:
            continue
        matched += 1
        prompt_in_loss += sum(1 for x in labels[s:s + len(prompt)] if x != -100)
        completion_masked += sum(1 for x in labels[s + len(prompt):e] if x == -100)
    return {"segments_matched": matched, "prompt_tokens_in_loss": prompt_in_loss, "completion_tokens_masked": completion_masked,
            "completion_only_loss": getattr(trainer.args, "completion_only_loss", None), "boundaries": source,
            "dataset_columns": list(trainer.train_dataset.column_names)}


#: The packing-content probes: (example lengths, seq_length). "mixed": some examples longer than a row, some
#: short. "tails": two examples of 13 and 11 tokens into rows of 10, the case where TRL 0.27 / 0.28's bfd packs
#: the two cut-off tails into a third row of their own (0.26 drops them).
CONTENT_PROBES = {"mixed": ((40, 10, 70, 25, 5, 90), 64), "tails": ((13, 11), 10)}


def packing_content(pack: Any = None, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Token accounting of TRL's ``pack_dataset`` per strategy over :data:`CONTENT_PROBES`, on examples whose
    token ids are unique (so every output token traces back to one input position).

    What each strategy must do (TRL's documentation): ``bfd`` (and TRL 0.19's ``ffd``) keeps each example's first
    ``seq_length`` tokens, whole and starting at its first token; its overflow may be dropped, but a segment that
    starts inside an example (a truncated tail that lost its prompt) is a failure. ``bfd_split`` loses nothing (its split tails
    are counted, not failed: splitting is what it is for). ``wrapped`` loses nothing, or exactly an unfilled last
    row. No strategy may duplicate a token or exceed ``seq_length`` per row.

    Returns strategy -> {available, lost, overflow, duplicated, tail_starts, rows, probes: {name: {...}},
    problems}; the counts are summed over the probes. Raises ImportError when TRL has no ``pack_dataset``
    (before 0.16).
    """
    from datasets import Dataset

    if pack is None:
        from trl.data_utils import pack_dataset as pack
    params = inspect.signature(pack).parameters
    out: dict[str, Any] = {}
    for strategy in strategies:
        if "strategy" not in params and strategy != "wrapped":  # TRL 0.17's pack_dataset only concatenates and cuts
            out[strategy] = {"available": False, "problems": [], "reason": "pack_dataset has no strategy argument (it wraps)"}
            continue
        entry: dict[str, Any] = {"available": True, "lost": 0, "overflow": 0, "duplicated": 0, "tail_starts": 0, "rows": 0,
                                 "probes": {}, "problems": []}
        for name, (lengths, seq_length) in CONTENT_PROBES.items():
            examples, start = [], 1
            for n in lengths:
                examples.append(list(range(start, start + n)))
                start += n
            try:
                packed = pack(Dataset.from_list([{"input_ids": e} for e in examples]), seq_length,
                              **({"strategy": strategy} if "strategy" in params else {}))
            except (ValueError, KeyError, TypeError) as exc:  # a strategy this TRL does not have
                entry = {"available": False, "problems": [], "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                break
            probe = _account(examples, [list(r) for r in packed["input_ids"]], seq_length, strategy,
                             packed["seq_lengths"] if "seq_lengths" in packed.column_names else None)
            entry["probes"][name] = probe
            for key in ("lost", "overflow", "duplicated", "tail_starts", "rows"):
                entry[key] += probe[key]
            entry["problems"] += [f"{name} probe {list(lengths)} into {seq_length}: {p}" for p in probe.pop("problems")]
        out[strategy] = entry
    return out


def _account(examples: list[list[int]], rows: list[list[int]], seq_length: int, strategy: str,
             seq_lengths: list[list[int]] | None) -> dict[str, Any]:
    """One probe of :func:`packing_content`: counts and problems of ``rows`` packed from ``examples``."""
    tokens = [t for r in rows for t in r]
    seen = set(tokens)
    all_tokens = [t for e in examples for t in e]
    lost = len(set(all_tokens) - seen)
    overflow = sum(max(0, len(e) - seq_length) for e in examples)
    firsts = {e[0] for e in examples}
    segment_starts = []
    for r, lengths in zip(rows, seq_lengths or [[len(r)] for r in rows], strict=True):
        at = 0
        for n in lengths:
            if n and at < len(r):
                segment_starts.append(r[at])
            at += n
    tail_starts = [t for t in segment_starts if t not in firsts] if seq_lengths is not None else []
    problems = []
    if len(tokens) != len(seen):
        problems.append(f"{len(tokens) - len(seen)} tokens duplicated")
    if any(len(r) > seq_length for r in rows):
        problems.append(f"a row of {max(map(len, rows))} tokens exceeds seq_length {seq_length}")
    if strategy in _WHOLE_SEGMENTS:
        if lost > overflow:
            problems.append(f"{lost} tokens lost, at most the {overflow} overflow tokens may be")
        if tail_starts:
            problems.append(f"{len(tail_starts)} segments start inside an example (truncated tails that lost their prompt, "
                            f"{lost} of {overflow} overflow tokens dropped, {len(rows)} rows)")
    elif strategy == "wrapped":
        if lost not in (0, len(all_tokens) % seq_length):
            problems.append(f"{lost} tokens lost, none or the unfilled last row ({len(all_tokens) % seq_length}) may be")
    elif lost:
        problems.append(f"{lost} tokens lost, none may be")
    return {"segments_known": seq_lengths is not None,  # without seq_lengths, tails cannot be told from examples
            "tokens_in": len(all_tokens), "tokens_out": len(tokens), "lost": lost, "overflow": overflow,
            "duplicated": len(tokens) - len(seen), "tail_starts": len(tail_starts), "rows": len(rows),
            "longest_row": max(map(len, rows), default=0), "problems": problems}
