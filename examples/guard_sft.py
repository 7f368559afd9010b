"""The packcheck guard in a TRL ``SFTTrainer`` run with packing and padding-free batches.

    python examples/guard_sft.py [--output-dir DIR]

A tiny Llama built from a config, a word-level tokenizer built in memory, twelve sentences: nothing is downloaded
and it runs on the CPU in seconds. ``SFTConfig(packing=True, padding_free=True)`` packs the tokenized texts
best-fit-decreasing into rows of up to ``max_length`` tokens, without an attention_mask, with position_ids
restarting at 0 for each example (and ``cu_seq_lens_q`` for varlen kernels). ``PackcheckCallback`` checks the first
packed row the trainer really feeds the model (after TRL's collator, inside its bf16 autocast, through its fused
LM head), before the first optimizer step, and prints one line:

    packcheck guard: PASS on 6 packed examples (58 tokens, bfloat16 (autocast bfloat16 over float32 weights), sdpa): ...

In your own script only the lines marked "the guard" are needed; the try / except around ``trainer.train()`` is
optional (without it a mismatch ends the run with the exception).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile

# a fresh `pip install -e .` has no accelerate / TRL (an extra): one line naming what to install, not an
# ImportError traceback from inside the Trainer (a hostile trial, helper G)
_MISSING = [m for m in ("trl", "datasets", "accelerate") if importlib.util.find_spec(m) is None]
if _MISSING:
    sys.exit(f"examples/guard_sft.py: TRL's SFTTrainer needs trl, datasets and accelerate; not installed: "
             f"{', '.join(_MISSING)}. Install them with pip install -c constraints/cpu.txt -e '.[trl]' (a GPU machine: -e '.[trl]').")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from pytest_packcheck.guard import PackcheckCallback, PackedBatchMismatch  # the guard

TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park with a red ball",
    "packing puts several short examples in one row",
    "each example must only see its own tokens",
    "position ids restart at zero for every example",
    "the model never attends across an example boundary",
    "one row and no padding tokens",
    "the guard checks the first batch before the first step",
    "a long day ends with a short walk",
    "the red ball rolled under the old table",
    "tokens of one example never reach another",
    "three steps are enough for an example",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of TEXTS (your own run loads its tokenizer instead)."""
    words = sorted({w for text in TEXTS for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None, help="where the trainer writes packcheck-guard.json (default: a temporary directory)")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="packcheck-guard-")

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    # a tiny random Llama; sdpa reads the packed boundaries from position_ids (one packed row per batch)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")

    sft_config = SFTConfig(
        output_dir=output_dir,
        packing=True,  # packing_strategy="bfd" (the default): whole examples, best fit decreasing
        padding_free=True,  # one row per batch, no attention_mask, position_ids restart per example (bfd implies it)
        max_length=64,  # tokens per packed row
        per_device_train_batch_size=1,  # one packed row per step
        max_steps=3,
        learning_rate=1e-3,
        use_cpu=True,  # everything else as TRL defaults it (bf16 autocast on the CPU too, its fused LM head)
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    guard = PackcheckCallback()  # the guard: on_mismatch="raise" (default), "warn" or "disable"
    trainer = SFTTrainer(
        model=model,
        args=sft_config,
        train_dataset=Dataset.from_list([{"text": text} for text in TEXTS]),
        processing_class=tokenizer,
        callbacks=[guard],  # the guard
    )

    try:
        trainer.train()
    except PackedBatchMismatch as exc:  # raised from the first forward: no optimizer step was taken
        print(f"stopped before the first optimizer step: cause {exc.result.cause}; see {output_dir}/packcheck-guard.json",
              file=sys.stderr)
        return 1
    # the guard printed its line on stderr; the whole result is guard.result and <output_dir>/packcheck-guard.json
    print(f"trained {trainer.state.global_step} steps; guard verdict: {guard.result.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
