"""A float64 numpy forward of Qwen3-MoE, the reference for `jax_nbx.models.qwen3_moe`.

Written from transformers' ``src/transformers/models/qwen3_moe/modeling_qwen3_moe.py``
(commit 00d4b3d2, the revision jax_nbx's routing cites; read for this
file), class by class, without JAX:

- ``Qwen3MoeRMSNorm``: ``weight * x * rsqrt(mean(x^2, -1) + eps)``.
- ``Qwen3MoeRotaryEmbedding`` (default rope): ``inv_freq = 1 / theta **
  (arange(0, D, 2) / D)``, ``emb = cat(freqs, freqs)``; ``apply_rotary_pos_emb``
  with ``rotate_half(x) = cat(-x2, x1)``.
- ``Qwen3MoeAttention`` + ``eager_attention_forward``: q/k/v projections
  (``nn.Linear``, no bias), ``q_norm``/``k_norm`` on each head's head_dim
  *before* RoPE, ``repeat_kv`` (head h reads kv head ``h // (heads / kv_heads)``),
  ``softmax(q k^T * head_dim**-0.5 + causal mask) v``, ``o_proj``.
- ``Qwen3MoeSparseMoeBlock``: ``softmax(gate(x))``, top-k, divided by
  its sum when ``norm_topk_prob``; each chosen ``Qwen3MoeMLP``
  (``down(silu(gate(x)) * up(x))``) weighted and summed.
- ``Qwen3MoeDecoderLayer``: ``h = x + attn(input_layernorm(x))``,
  ``h + mlp(post_attention_layernorm(h))``.
- ``Qwen3MoeModel`` / ``Qwen3MoeForCausalLM``: ``embed_tokens``, the layers,
  ``norm``, ``lm_head`` (``embed_tokens`` when ``tie_word_embeddings``).

Top-k ties are broken towards the lower expert index (``np.argsort``,
stable), as ``torch.topk`` on CPU does in practice.
"""
from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["read_checkpoint", "reference_logits"]


def read_checkpoint(folder: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, every tensor of the folder's safetensors files
    as float64 numpy) -- bf16 files are read through safetensors' Flax
    loader, then converted."""
    from safetensors import safe_open
    folder = os.fspath(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="flax") as h:
                for k in h.keys():
                    t = h.get_tensor(k)
                    tensors[k] = np.asarray(t.astype("float32"), dtype=np.float64)
    return config, tensors


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _silu(g):
    return g / (1.0 + np.exp(-g))


def reference_logits(config: dict, tensors: dict[str, np.ndarray], ids) -> np.ndarray:
    """float64 logits ``[T, vocab]`` of the causal forward of one sequence
    ``ids [T]`` (positions 0..T-1, no cache).  ``config``: the
    ``config.json`` dict; ``tensors``: name -> array (transformers' names)."""
    W = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    ids = np.asarray(ids).reshape(-1)
    T = ids.shape[0]
    H = config["hidden_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // nh
    eps = config["rms_norm_eps"]
    E, k = config["num_experts"], config["num_experts_per_tok"]
    norm_topk = config.get("norm_topk_prob", False)

    inv_freq = 1.0 / (config["rope_theta"] ** (np.arange(0, D, 2, dtype=np.float64) / D))
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # [T, 1, D]
    causal = np.tril(np.ones((T, T), dtype=bool))

    x = W["model.embed_tokens.weight"][ids]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        # attention
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, D)
        kk = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, D)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, D)
        q = _rms(q, W[p + "self_attn.q_norm.weight"], eps)
        kk = _rms(kk, W[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        kk = kk * cos + _rotate_half(kk) * sin
        rep = nh // nkv
        out = np.empty((T, nh, D))
        for head in range(nh):
            kv = head // rep
            s = (q[:, head] @ kk[:, kv].T) * D ** -0.5
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, head] = s @ v[:, kv]
        x = x + out.reshape(T, nh * D) @ W[p + "self_attn.o_proj.weight"].T
        # sparse MoE block
        h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        logits = h @ W[p + "mlp.gate.weight"].T
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        wts = np.take_along_axis(probs, top, axis=-1)
        if norm_topk:
            wts = wts / wts.sum(axis=-1, keepdims=True)
        y = np.zeros_like(h)
        for e in range(E):
            t_idx, j_idx = np.nonzero(top == e)
            if t_idx.size == 0:
                continue
            a = h[t_idx]
            pe = f"{p}mlp.experts.{e}."
            g = a @ W[pe + "gate_proj.weight"].T
            u = a @ W[pe + "up_proj.weight"].T
            o = (_silu(g) * u) @ W[pe + "down_proj.weight"].T
            np.add.at(y, t_idx, wts[t_idx, j_idx][:, None] * o)
        x = x + y
    x = _rms(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else W["lm_head.weight"]
    return x @ head.T
