"""The shrink of state-space mixers whose full-size CPU forward dominated the atlas (issue 47): nemotron_h's mamba2
mixer and zamba2's SSD chunk. The tiny mixer must stay cheap and keep what its verdict depends on: every layer kind, grouped B / C, the
conv kernel, and an SSD chunk shorter than the probe row, so the packed row's boundaries fall inside chunks and
the state is carried from one chunk to the next."""

from __future__ import annotations

import pytest
import torch

from pytest_packcheck import checks as C
from pytest_packcheck.model.batches import DEFAULT_LENGTHS
from pytest_packcheck.model.shrink import shrink_config


def test_nemotron_h_mixer_is_tiny_and_keeps_its_shape():
    from transformers import CONFIG_MAPPING

    full = CONFIG_MAPPING["nemotron_h"]()
    tiny = shrink_config(full)
    assert set(tiny.layers_block_type) == set(full.layers_block_type)  # mamba, MoE, attention, MLP layers all kept
    heads, head_dim, state, chunk = tiny.mamba_num_heads, tiny.mamba_head_dim, tiny.ssm_state_size, tiny.chunk_size
    # heads x head size == expand x hidden, as at full size (128 x 64 == 2 x 4096)
    assert full.mamba_num_heads * full.mamba_head_dim == full.expand * full.hidden_size
    assert heads * head_dim == tiny.expand * tiny.hidden_size
    assert 1 < tiny.n_groups < heads and heads % tiny.n_groups == 0  # several groups, several heads per group
    assert tiny.conv_kernel == full.conv_kernel
    # the chunk is shorter than the row and a boundary falls inside a chunk: both the in-chunk scan and the carried
    # state cross an example boundary
    boundaries = [sum(DEFAULT_LENGTHS[:i]) for i in range(1, len(DEFAULT_LENGTHS))]
    assert chunk < sum(DEFAULT_LENGTHS) and any(b % chunk for b in boundaries)
    # the CPU scan materialises chunk x chunk x heads x state floats per chunk: 128^4 (1 GiB) at full size
    assert chunk * chunk * heads * state <= 16 * 16 * 8 * 16 < full.chunk_size ** 2 * full.mamba_num_heads * full.ssm_state_size
    assert tiny.moe_shared_expert_intermediate_size <= tiny.hidden_size
    assert full.mamba_num_heads == 128 and full.chunk_size == 128  # the original is untouched


def test_zamba2_chunk_is_shorter_than_the_row():
    from transformers import CONFIG_MAPPING

    full = CONFIG_MAPPING["zamba2"]()
    tiny = shrink_config(full)
    assert full.chunk_size == 256 and tiny.chunk_size < sum(DEFAULT_LENGTHS)
    assert tiny.n_mamba_heads * tiny.mamba_headdim == tiny.mamba_expand * tiny.hidden_size


@pytest.mark.parametrize("model_type", ["nemotron_h", "zamba2"])
def test_the_tiny_mixer_still_leaks_across_the_boundary(model_type, tolerances):
    """The atlas's verdict on nemotron_h and zamba2 (fail, stateful_layers: the mamba2 mixer scans across example
    boundaries) holds on the shrunk mixer."""
    from conftest import make_bench

    leak = C.check_isolation(make_bench(model_type, "eager", tolerances))
    assert leak.status == "fail" and leak.cause == "stateful_layers", leak.message
    assert leak.metrics["max_change"] > 1e-2, leak.metrics


def test_the_leak_the_tiny_nemotron_h_shows_is_its_mixers(tolerances):
    """With nemotron_h's mamba mixers silenced (the planted fix: every weight of theirs zero, so no state crosses a
    boundary) the probe passes, its attention layer still moving the boundary-free control row: the leak the shrunk
    model shows is the mixer's, not the shrink's. (zamba2 has no such control: its attention feeds its mixers.)"""
    from conftest import make_bench

    silenced = make_bench("nemotron_h", "eager", tolerances)
    mixers = [m for m in silenced.model.modules() if type(m).__name__.endswith("Mamba2Mixer")]
    assert mixers
    with torch.no_grad():
        for mixer in mixers:
            for weight in mixer.parameters():
                weight.zero_()
    fixed = C.check_isolation(silenced)
    assert fixed.status == "pass" and fixed.metrics["negative_control_change"] > 1e-2, fixed.message
