"""Tiny keras-hub models of every MoE family keras-hub 0.32 ships, with seeded
random weights, for tests/library/test_keras_hub.py (and the notebook's
smallest case).  Keras must be imported with KERAS_BACKEND=jax (the caller
sets it before the first keras import)."""
from __future__ import annotations

import numpy as np

# Each family: (CausalLM class name, Backbone class name, the backbone's arguments).  Odd sizes where
# the family allows (E, the vocabulary, I = 10); H and I multiples of 32 (Qwen3-MoE: int4) or 16
# (Gemma-4: nvfp4) where the family's quantized check needs whole groups.
TINY = {
    "mixtral": ("MixtralCausalLM", "MixtralBackbone", dict(
        vocabulary_size=61, num_layers=2, num_query_heads=4, hidden_dim=24, intermediate_dim=10,
        num_key_value_heads=2, num_experts=5, top_k=2, sliding_window=64)),
    "qwen_moe": ("QwenMoeCausalLM", "QwenMoeBackbone", dict(
        vocabulary_size=61, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=24,
        intermediate_dim=14, moe_intermediate_dim=10, shared_expert_intermediate_dim=12, num_experts=6,
        top_k=2, norm_top_k_prob=False)),
    "qwen3_moe": ("Qwen3MoeCausalLM", "Qwen3MoeBackbone", dict(
        vocabulary_size=61, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=14, moe_intermediate_dim=32, num_experts=6, head_dim=8, top_k=3,
        norm_top_k_prob=True)),
    "qwen3_5_moe": ("Qwen3_5MoeCausalLM", "Qwen3_5MoeBackbone", dict(
        vocabulary_size=61, num_layers=2, num_query_heads=4, num_key_value_heads=2, head_dim=8,
        hidden_dim=24, moe_intermediate_dim=10, shared_expert_intermediate_size=12, num_experts=6, top_k=2,
        layer_types=["full_attention", "full_attention"], linear_num_key_heads=2,  # (linear: 45 s of compiles)
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
    "gpt_oss": ("GptOssCausalLM", "GptOssBackbone", dict(
        vocabulary_size=61, num_layers=2, num_query_heads=4, hidden_dim=24, intermediate_dim=10,
        num_key_value_heads=2, num_experts=5, top_k=2, head_dim=8, sliding_window=64)),
    "gemma4": ("Gemma4CausalLM", "Gemma4Backbone", dict(
        vocabulary_size=61, image_size=None, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=32, intermediate_dim=14, head_dim=8, sliding_window_size=64, sliding_window_pattern=2,
        enable_moe_block=True, num_experts=6, expert_intermediate_dim=16, num_experts_per_token=2)),
}
FAMILIES = tuple(TINY)


def randomize(model, seed: int = 0) -> None:
    """Every variable of ``model`` drawn afresh from a seeded normal (matrices
    std 0.2/sqrt(fan-in); vectors 1 + 0.1 N(0, 1) for scales, 0.1 N(0, 1) for
    the rest), so that no block is left at a zero or identity initializer."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        shape = tuple(v.shape)
        if len(shape) >= 2:
            val = rng.standard_normal(shape) * (0.2 / np.sqrt(shape[-2]))
        elif "scale" in v.path or "norm" in v.path or "gamma" in v.path:
            val = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            val = 0.1 * rng.standard_normal(shape)
        v.assign(val.astype(v.dtype))


def tiny_causal_lm(family: str, seed: int = 0, dtype: str = "float32"):
    """The family's CausalLM (no preprocessor) on its tiny backbone, weights from ``seed``."""
    import keras_hub

    lm_name, bb_name, kwargs = TINY[family]
    backbone = getattr(keras_hub.models, bb_name)(**kwargs, dtype=dtype)
    model = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    randomize(model, seed)
    return model


def token_batch(family: str, batch: int = 2, length: int = 7, pad: int = 2, seed: int = 1) -> dict:
    """A batch of token ids with a padding mask (the second row's last ``pad`` positions are
    padding), and position ids where the family's backbone takes them (Gemma-4)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, TINY[family][2]["vocabulary_size"], size=(batch, length)).astype("int32")
    mask = np.ones((batch, length), bool)
    mask[1:, length - pad:] = False
    ids[~mask] = 0
    out = {"token_ids": ids, "padding_mask": mask}
    if family == "gemma4":
        out["position_ids"] = np.broadcast_to(np.arange(length, dtype="int32"), (batch, length)).copy()
    return out
