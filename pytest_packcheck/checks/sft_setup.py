"""TRL's SFTTrainer set up offline, as users configure it: the tokenizer, the installed TRL's features, and the
set-up every SFT check of a cell shares.

Offline: the tokenizer is a small BPE trained with the ``tokenizers`` library on a few sentences (with a chat
template), so no Hub access is needed. Version drift is feature-detected (``processing_class`` vs ``tokenizer``,
``max_length`` vs ``max_seq_length``, ``padding_free`` from TRL 0.16, ``packing_strategy`` from 0.19); what the
installed TRL cannot express is "unsupported" with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from ..results import CheckResult
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
    from trl import SFTConfig, SFTTrainer

    from ..versions.libraries import module_version

    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    params = set(inspect.signature(SFTTrainer.__init__).parameters)
    return {"version": module_version("trl"), "fields": fields, "params": params,
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

    wb: Any
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
        return SFTTrainer(model=self.wb.model, args=self.config(**overrides), train_dataset=Dataset.from_list(rows),
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

        handle = self.wb.model.register_forward_pre_hook(first_forward, with_kwargs=True)
        try:
            loss, norm, _ = train_and_restore(self.wb.model, lambda: self.trainer(data, **kwargs))
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
        key = ("sft_padded_trainer", id(self.wb.model), self.feats["version"])
        if key not in self.wb._cache:
            self.wb._cache[key] = self.train_steps(packing=False, padding_free=False)
        return self.wb._cache[key]

    def padded_batch(self) -> dict[str, Any]:
        """The six texts as SFTTrainer(packing=False, padding_free=False) batches them: one right-padded batch
        (cached per model, like the reference run on it)."""
        key = ("sft_padded_batch", id(self.wb.model), self.feats["version"])
        if key not in self.wb._cache:
            trainer = self.trainer(packing=False, padding_free=False, per_device_train_batch_size=len(SENTENCES))
            self.wb._cache[key] = next(iter(trainer.get_train_dataloader()))
        return self.wb._cache[key]

    def padded_steps(self) -> tuple[list[float], list[float]]:
        """The reference: :func:`pytest_packcheck.checks.training.reference_steps` (STEPS hand-written SGD steps, token-mean
        loss after the shift) on :meth:`padded_batch`, cached per model. Not SFTTrainer's own padded run: its
        Trainer may normalise padded batches by the unshifted label count (transformers 4.x; gpt2 on 5.24)."""
        from .training import reference_steps

        key = ("sft_padded", id(self.wb.model), self.feats["version"])
        if key not in self.wb._cache:
            loss, norm, _ = reference_steps(self.wb.model, self.padded_batch(), STEPS)
            self.wb._cache[key] = (loss, norm)
        return self.wb._cache[key]


def fused_head_without_kernel(version: str) -> str | None:
    """Why SFTTrainer's default training step cannot run here, when TRL's fused LM head lost its kernel to a
    missing package: TRL 1.15's ``trl/trainer/utils.py`` imports its Triton ``ChunkedLogProbFunction`` inside
    ``try / except ImportError`` (None without triton, which the CPU torch wheel lacks) and its ``_fused_forward``
    calls ``.apply`` on it unconditionally (``AttributeError: 'NoneType' object has no attribute 'apply'`` on every
    model). TRL 1.16 imports it unconditionally and falls back without triton. None when the kernel is there."""
    import sys

    utils = sys.modules.get("trl.trainer.utils")
    if utils is None or not hasattr(utils, "_ChunkedLogProbFunction") or utils._ChunkedLogProbFunction is not None:
        return None
    return (f"not checked: trl {version}'s default fused LM head (SFTTrainer calls the model with fused_lm_head=True) "
            "needs its Triton kernel and triton is not installed (the CPU torch wheel has none): its training step "
            "raises AttributeError in trl/trainer/utils.py on any model; install triton, or use TRL >= 1.16, which "
            "falls back without it")


def _setup(wb: Any, out_dir: str) -> _Sft | CheckResult:
    """The shared SFTTrainer set-up, or the skipped / unsupported verdict when TRL cannot run it."""
    try:
        feats = trl_features()
    except ImportError as exc:
        return CheckResult("skipped", {}, f"trl is not installed ({exc})")
    kernel = fused_head_without_kernel(feats["version"])
    if kernel:
        return CheckResult("skipped", {"trl": feats["version"]}, kernel)
    missing = [f for f in ("packing", "padding_free") if f not in feats["fields"]]
    if missing or feats["max_length_key"] is None:
        return CheckResult("unsupported", {"trl": feats["version"]},
                           f"not available in trl {feats['version']}: SFTConfig has no {', '.join(missing) or 'max_length'}")
    base = {"output_dir": out_dir, "packing": True, "padding_free": False, feats["max_length_key"]: 512,
            "per_device_train_batch_size": 1, "max_steps": 1, "report_to": [], "save_strategy": "no",
            "use_cpu": not wb.device.startswith("cuda"), "dataset_text_field": "text", "seed": 0, "disable_tqdm": True,
            # SFTConfig defaults to bf16=True (autocast, CPU included): the comparisons run in the model's dtype
            "bf16": False, "fp16": False}
    return _Sft(wb, feats, offline_tokenizer(int(wb.config.vocab_size)), base)


def _run_sft_check(wb: Any, body: Callable[[_Sft], CheckResult]) -> CheckResult:
    """Run ``body`` on the shared set-up. SFTTrainer sets use_cache=False on the model it is given; the
    measurements run with that (as training would), and the model's own settings (use_cache, special token
    ids, in its config and generation config) are restored afterwards for the group's other checks."""
    from ..backends import backend_availability

    avail = backend_availability(wb.backend or "eager", wb.device)
    if not avail.backward:  # training needs a backward pass (flex_attention on CPU has none)
        return CheckResult("skipped", {}, avail.backward_reason)
    model = wb.model
    configs = [c for c in (model.config, getattr(model, "generation_config", None)) if c is not None]
    # SFTTrainer also aligns the model's special token ids with its tokenizer's (TRL 1.x): put them back too
    saved = [(c, k, getattr(c, k)) for c in configs for k in ("use_cache", *_TOKEN_IDS) if hasattr(c, k)]
    try:
        with tempfile.TemporaryDirectory(prefix="packcheck-sft-") as out_dir, _quiet_datasets():
            sft = _setup(wb, out_dir)
            return sft if isinstance(sft, CheckResult) else body(sft)
    finally:
        for config, key, value in saved:
            setattr(config, key, value)


_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

