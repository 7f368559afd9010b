"""Models whose training forward needs inputs a packed text row does not carry (issue 41 part 2).

The atlas feeds every causal LM a packed row of text tokens with ``labels`` and restarting ``position_ids``. A few
models raise on that row at any size, not because their config does not run but because their training forward
takes inputs of another form; their checkpoints run when given them. Such a cell is ``unsupported`` with cause
``needs_inputs`` and the library's own words, not ``library_config``. :data:`NEEDS_INPUTS` is the one table: per
``model_type``, the message the library raises (a regular expression, searched in ``str(exc)``) and what it needs.
Only a forward whose unshrunk config raises the same (:func:`~.twin.unshrunk_forward_reproduces`) is matched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NeedsInputs:
    """``inputs``: the inputs the model needs, as the field names them; ``why``: where that comes from (upstream
    file), one line; ``pattern``: the library's message."""

    model_type: str
    pattern: str
    inputs: str
    why: str


NEEDS_INPUTS: tuple[NeedsInputs, ...] = (
    NeedsInputs("gemma3", r"`token_type_ids` is required as a model input when training", "token_type_ids",
                "Gemma3ForConditionalGeneration.forward raises without token_type_ids in training mode (5.0 .. 5.5: "
                "models/gemma3/modeling_gemma3.py, the bidirectional image-token mask); TRL and axolotl give zeros "
                "for text rows"),
    NeedsInputs("musicgen", r"Expected input batch_size \(\d+\) to match target batch_size \(\d+\)",
                "labels per codebook, shape (batch, length, num_codebooks)",
                "MusicgenForCausalLM.forward computes one loss per codebook from labels[..., codebook] "
                "(models/musicgen/modeling_musicgen.py); a packed row's (batch, length) labels are read as codebooks"),
    NeedsInputs("musicgen_melody", r"shape '\[-1, \d+, \d+\]' is invalid for input of size \d+",
                "input_ids per codebook, shape (batch x num_codebooks, length), and labels per codebook",
                "MusicgenMelodyForCausalLM.forward reshapes input_ids to (-1, num_codebooks, length) "
                "(models/musicgen_melody/modeling_musicgen_melody.py)"),
    NeedsInputs("git", r"Expected input batch_size \(0\) to match target batch_size \(\d+\)",
                "pixel_values (the image tokens its loss skips)",
                "GitForCausalLM.forward slices its logits from the image tokens on (logits[:, num_image_tokens:-1], "
                "models/git/modeling_git.py), empty on a text-only row"),
)


def needed_inputs(model_type: str | None, message: str) -> NeedsInputs | None:
    """The :data:`NEEDS_INPUTS` entry of ``model_type`` whose pattern is in ``message``, or None."""
    return next((n for n in NEEDS_INPUTS if n.model_type == model_type and re.search(n.pattern, message)), None)
