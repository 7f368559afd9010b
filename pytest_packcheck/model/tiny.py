"""What "tiny" means: the sizes a shrunk config gets (:mod:`.shrink`), small enough for a 2-core CPU, big enough
that every attention feature still has room to matter."""

from __future__ import annotations

from ..config.options import OPT_SLIDING_WINDOW, default_of

# Target sizes of a shrunk config. Small enough for a 2-core CPU, big enough that every attention feature
# still has room to matter (several heads per KV head, a window shorter than the examples).
TINY_HEAD_DIM = 16
TINY_HIDDEN = 64
TINY_VOCAB = 512
#: The window a longer sliding window is shortened to: the --packcheck-sliding-window default (8 tokens).
TINY_SLIDING_WINDOW: int = default_of(OPT_SLIDING_WINDOW)
TINY_EXPERTS = 4

# Keys set to a fixed small value when present (top level and in nested sub-configs such as dbrx's).
FIXED_SIZES = {
    "intermediate_size": 2 * TINY_HIDDEN,
    "ffn_hidden_size": 2 * TINY_HIDDEN,
    "ffn_dim": 2 * TINY_HIDDEN,
    "intermediate_size_mlp": 2 * TINY_HIDDEN,
    "n_inner": 2 * TINY_HIDDEN,
    "moe_intermediate_size": TINY_HIDDEN // 2,
    "shared_expert_intermediate_size": TINY_HIDDEN // 2,
    "num_experts": TINY_EXPERTS,
    "num_local_experts": TINY_EXPERTS,
    "n_routed_experts": TINY_EXPERTS,
    "moe_num_experts": TINY_EXPERTS,
    "n_group": 1,
    "num_expert_group": 1,  # kimi_linear, bailing_hybrid (n_group under another name)
    "topk_group": 1,
    # MLA (deepseek_v3): keep the split into rope / no-rope parts, at a small size.
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": TINY_HEAD_DIM,
    # linear-attention / state-space layers (qwen3_next, mamba)
    "linear_key_head_dim": TINY_HEAD_DIM,
    "linear_value_head_dim": TINY_HEAD_DIM,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": TINY_HEAD_DIM,  # kimi_linear, bailing_hybrid
    "linear_num_heads": 4,
    "state_size": 8,
    "time_step_rank": 8,
    "word_embed_proj_dim": TINY_HIDDEN,
    # hybrid mamba2 blocks (falcon_h1 and friends): n_heads * d_head == d_ssm
    "mamba_d_ssm": 64,
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    # nemotron_h's mamba2 mixer, under its own names (its mamba_head_dim follows from expand x hidden, and its
    # chunk_size and n_groups, names other configs use for other things, are set in shrink._derived_sizes): at full
    # size (128 heads, state 128, chunk 128) its CPU forward alone was ~1.7 h of the atlas's 40 releases (issue 47)
    "mamba_num_heads": 8,
    "ssm_state_size": 16,
    "moe_shared_expert_intermediate_size": TINY_HIDDEN // 2,
    # encoder-decoder families used as causal decoders (bart, blenderbot, ...)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 2 * TINY_HIDDEN,
    "decoder_ffn_dim": 2 * TINY_HIDDEN,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "d_model": TINY_HIDDEN,
    "d_inner": 2 * TINY_HIDDEN,
    # longcat_flash: routed experts plus identity ("zero") experts, each with its own size key
    "expert_ffn_hidden_size": TINY_HIDDEN // 2,
    "zero_expert_num": 2,
    # blt: hashed n-gram embeddings, one table of this many rows per n-gram size
    "encoder_hash_byte_group_vocab": TINY_VOCAB,
    # gemma3n / gemma4: a second embedding table feeding every layer
    "vocab_size_per_layer_input": TINY_VOCAB,
    # dots3: the indexer of its indexed-attention layers, and shared experts
    "index_head_dim": TINY_HEAD_DIM,
    "index_n_heads": 4,
    "shared_experts_intermediate_size": TINY_HIDDEN // 2,
    "hidden_size_per_layer_input": TINY_HEAD_DIM,
}


#: The top-k a sparse-attention indexer is shrunk to (DeepSeek-V3.2-style ``index_topk``, 2048 in glm_moe_dsa,
#: deepseek_v32, axk2; 512 in deepseek_v4): below the probe row's shortest example (7 tokens), so the indexer
#: selects among the keys of an example instead of all of them.
TINY_INDEX_TOPK = 4
#: Key pooling of glm5_next's indexer (``index_topk`` must be a multiple of it; 16 by default): 2 tokens a pool.
TINY_INDEX_KPOOL = 2

#: Size of a shrunk vision / audio tower: blocks, attention heads (head size :data:`TINY_HEAD_DIM`).
TINY_TOWER_DEPTH = 2
TINY_TOWER_HEADS = 2
