"""float64 NumPy references of transformers' routing rules, shared by
tests/library/test_routing.py (the rules alone) and tests/library/test_families.py (whole MoE
blocks). Each names the modeling file and the commit or release read
(huggingface/transformers; "5.24.0" is the PyPI wheel transformers-5.24.0).
Ties: lower index first (as jax.lax.top_k; torch.topk leaves them unspecified)."""
from __future__ import annotations

import numpy as np


def _order(v):
    """Indices of v's last axis by descending value, ties lower index first."""
    return np.argsort(-v, axis=-1, kind="stable")


def _topk(v, k):
    idx = _order(v)[..., :k]
    return np.take_along_axis(v, idx, -1), idx


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def np_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _group_keep(choice, n_group, topk_group, score):
    """[.., E] bool: experts of the topk_group best groups (group score: 'max' or 'top2')."""
    lead, E = choice.shape[:-1], choice.shape[-1]
    g = choice.reshape(lead + (n_group, E // n_group))
    gs = g.max(-1) if score == "max" else _topk(g, 2)[0].sum(-1)
    _, gidx = _topk(gs, topk_group)
    keep = np.zeros(gs.shape, bool)
    np.put_along_axis(keep, gidx, True, -1)
    return np.repeat(keep, E // n_group, axis=-1)


def ref_route(logits, k, normalize=True, n_group=1, topk_group=1, scale=1.0):
    """softmax -> top-k -> optional renormalization.  Mixtral:
    models/mixtral/modeling_mixtral.py @00d4b3d2 (MixtralSparseMoeBlock.forward);
    Qwen3-MoE: models/qwen3_moe/modeling_qwen3_moe.py @00d4b3d2 (norm_topk_prob);
    OLMoE: models/olmoe/modeling_olmoe.py @00dcc6dd; DeepSeek-V2:
    models/deepseek_v2/modeling_deepseek_v2.py @0233e509
    (DeepseekV2Moe.route_tokens_to_experts: greedy or group_limited_greedy with
    the group max, masked_fill 0.0, topk, * routed_scaling_factor). Re-read in
    5.24.0 (MixtralTopKRouter, Qwen2MoeTopKRouter, Qwen3MoeTopKRouter,
    OlmoeTopKRouter, DeepseekV2TopkRouter, Gemma4TextRouter's softmax/top-k/
    renormalize): the same rules."""
    p = np_softmax(np.asarray(logits, np.float64))
    choice = np.where(_group_keep(p, n_group, topk_group, "max"), p, 0.0) if n_group > 1 else p
    _, idx = _topk(choice, k)
    w = np.take_along_axis(p, idx, -1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return w * scale, idx, p


def ref_topk_softmax(logits, k, bias=None):
    """top-k on the logits -> softmax over the k.  Granite-MoE:
    models/granitemoe/modeling_granitemoe.py @c7a438e9 (GraniteMoeTopKGating);
    gpt-oss: models/gpt_oss/modeling_gpt_oss.py @00d4b3d2 (GptOssTopKRouter,
    logits = F.linear(x, weight, bias)). Re-read in 5.24.0
    (GraniteMoeTopKRouter: topk of the float32 logits, softmax over the k;
    GptOssTopKRouter unchanged)."""
    z = np.asarray(logits, np.float64)
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    v, idx = _topk(z, k)
    return np_softmax(v), idx, np_softmax(z)


def ref_sigmoid(logits, k, bias=None, n_group=1, topk_group=1, normalize=True, scale=1.0):
    """DeepSeek-V3: models/deepseek_v3/modular_deepseek_v3.py @000c33fd
    (DeepseekV3MoE.route_tokens_to_experts) and the later DeepseekV3TopkRouter
    (as mirrored at 8b-is/transformers @6162a92b, modeling_deepseek_v3.py):
    sigmoid; choice score + e_score_correction_bias; group score = sum of the
    top 2; the experts of the other groups masked with -inf (the later form;
    the earlier filled 0.0); topk; weights gathered from the unbiased scores;
    norm_topk_prob: / (sum + 1e-20); * routed_scaling_factor. Re-read in
    5.24.0 (models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3TopkRouter):
    the later form, -inf masking."""
    s = np_sigmoid(np.asarray(logits, np.float64))
    c = s + (0.0 if bias is None else np.asarray(bias, np.float64))
    if n_group > 1:
        c = np.where(_group_keep(c, n_group, topk_group, "top2"), c, -np.inf)
    _, idx = _topk(c, k)
    w = np.take_along_axis(s, idx, -1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, idx, s


def ref_topk_sigmoid(logits, k):
    """Llama-4: models/llama4/modeling_llama4.py @000c33fd (Llama4Router: topk of
    the logits, -inf elsewhere, sigmoid); unchanged in 5.24.0."""
    z = np.asarray(logits, np.float64)
    v, idx = _topk(z, k)
    return np_sigmoid(v), idx, np_sigmoid(z)


