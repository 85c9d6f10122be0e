"""Whole MoE blocks of Hugging Face transformers model families through
jax_nbx: per family a float64 NumPy reference of the model's MoE block
written from its modeling file (huggingface/transformers 5.24.0, the PyPI
wheel transformers-5.24.0; each reference names its file and classes), random
weights in the checkpoint's own layout (the shapes the HF module stores, or
the per-expert checkpoint lists where the module fuses them at load), then
the same block built with jax_nbx -- a routing function and ONE fused_moe
call, the weights passed as stored (no transposes, no slicing) -- compared
under jax.jit for implementation "ffi" and "xla", float32, T = 33 and T = 1:
forward to 1e-5 relative to the reference, and gradients with respect to x,
the router weight, an expert array, a bias or gate where the block has one,
against central differences of the float64 reference along random
directions.

The routing rules' references are shared with tests/library/test_routing.py
(tests/support/hf_ref.py); the gated units (swiglu, geglu, geglu_erf,
swiglu_clamped) come from conftest.np_glu."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import np_glu, np_silu
from support.hf_ref import _topk, np_sigmoid, ref_route, ref_sigmoid, ref_topk_softmax

H = 40
EPS_FD = 1e-6


def _rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _linear(a, w, b=None):
    """F.linear / nn.Linear: a @ w.T (+ b)."""
    y = a @ w.T
    return y if b is None else y + b


def _silu_mlp(a, gate_proj, up_proj, down_proj, activation="swiglu"):
    """down_proj(act(gate_proj(a)) * up_proj(a)) with nn.Linear weights
    (Qwen2MoeMLP, DeepseekV3MLP, DeepseekV2MLP, Llama4TextMLP)."""
    return _linear(np_glu(_linear(a, gate_proj), _linear(a, up_proj), activation)[0], down_proj)


def _experts_loop(x, top_k_index, top_k_weights, expert):
    """The v5 experts' forward (MixtralExperts.forward and its copies):
    for each expert hit, its tokens' outputs times their weight, index_add'ed.
    expert(e, states) -> [n, H]."""
    y = np.zeros_like(x)
    for e in np.unique(top_k_index):
        token_idx, top_k_pos = np.nonzero(top_k_index == e)
        out = expert(e, x[token_idx]) * top_k_weights[token_idx, top_k_pos][:, None]
        np.add.at(y, token_idx, out)
    return y


def _chunk_expert(gate_up_proj, down_proj, activation="swiglu"):
    """v5 fused experts, nn.Linear layout: gate_up_proj [E, 2I, H] -> F.linear,
    chunk(2) (gate first), act(gate) * up, F.linear with down_proj [E, H, I]."""
    I = gate_up_proj.shape[1] // 2

    def expert(e, a):
        gu = _linear(a, gate_up_proj[e])
        return _linear(np_glu(gu[:, :I], gu[:, I:], activation)[0], down_proj[e])

    return expert


# ------------------------------------------------------------------ the families
# Each builder(rng) -> (params, ref, ours, grad_keys):
#   params: name -> float32 array (or list of arrays), in the checkpoint's layout;
#   ref(x, p): float64 [T, H] from float64 params (the HF block);
#   ours(x, p, impl): the jax_nbx block on jnp params;
#   grad_keys: the params whose gradient is checked (with x).


def _mixtral(rng, E=8, k=2, I=24):
    """MixtralSparseMoeBlock, models/mixtral/modeling_mixtral.py (5.24.0):
    MixtralTopKRouter (softmax in float32, topk, renormalize), MixtralExperts
    (act_fn silu). The checkpoint stores experts.{i}.w1 / w3 [I, H] and w2
    [H, I] per expert; conversion_mapping.py ("mixtral") merges them into
    gate_up_proj = cat([w1], [w3]) (gate first) and down_proj = [w2] at load.
    Here: the per-expert lists, as stored."""
    p = {"gate.weight": _rand(rng, E, H, scale=H ** -0.5),
         "w1": [_rand(rng, I, H, scale=H ** -0.5) for _ in range(E)],
         "w3": [_rand(rng, I, H, scale=H ** -0.5) for _ in range(E)],
         "w2": [_rand(rng, H, I, scale=I ** -0.5) for _ in range(E)]}

    def ref(x, p):
        w, ids, _ = ref_route(_linear(x, p["gate.weight"]), k, normalize=True)
        return _experts_loop(x, ids, w, lambda e, a: _silu_mlp(a, p["w1"][e], p["w3"][e], p["w2"][e]))

    def ours(x, p, impl):
        w, ids = nbx.route(x @ p["gate.weight"].T, k)
        experts = nbx.Experts(p["w1"], p["w3"], p["w2"], layout="out_in")
        return nbx.fused_moe(x, w, ids, experts, implementation=impl)

    return p, ref, ours, ["gate.weight", "w3"]


def _softmax_v5(rng, E, k, I, normalize):
    """Qwen3MoeSparseMoeBlock (models/qwen3_moe/modeling_qwen3_moe.py, 5.24.0)
    and OlmoeSparseMoeBlock (models/olmoe/modeling_olmoe.py, 5.24.0): the
    TopKRouter (softmax in float32, topk, renormalize iff norm_topk_prob),
    v5 experts gate_up_proj [E, 2I, H] (chunk: gate first), down_proj
    [E, H, I], silu."""
    p = {"gate.weight": _rand(rng, E, H, scale=H ** -0.5),
         "experts.gate_up_proj": _rand(rng, E, 2 * I, H, scale=H ** -0.5),
         "experts.down_proj": _rand(rng, E, H, I, scale=I ** -0.5)}

    def ref(x, p):
        w, ids, _ = ref_route(_linear(x, p["gate.weight"]), k, normalize=normalize)
        return _experts_loop(x, ids, w, _chunk_expert(p["experts.gate_up_proj"], p["experts.down_proj"]))

    def ours(x, p, impl):
        w, ids = nbx.route(x @ p["gate.weight"].T, k, normalize=normalize)
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], layout="out_in")
        return nbx.fused_moe(x, w, ids, experts, implementation=impl)

    return p, ref, ours, ["gate.weight", "experts.down_proj"]


def _qwen3_moe(rng):
    """Qwen3-MoE: norm_topk_prob True (the released checkpoints' config); I = 20."""
    return _softmax_v5(rng, E=32, k=8, I=20, normalize=True)


def _olmoe(rng):
    """OLMoE: norm_topk_prob False (OlmoeConfig's default and the checkpoints')."""
    return _softmax_v5(rng, E=16, k=4, I=24, normalize=False)


def _qwen2_moe(rng, E=16, k=4, I=24, Is=52):
    """Qwen2MoeSparseMoeBlock, models/qwen2_moe/modeling_qwen2_moe.py (5.24.0):
    Qwen2MoeTopKRouter (softmax, topk, norm_topk_prob False: no
    renormalization), Qwen2MoeExperts (gate_up_proj [E, 2I, H], chunk gate
    first; down_proj [E, H, I]), shared_expert = Qwen2MoeMLP of width
    shared_expert_intermediate_size (gate_proj/up_proj [Is, H], down_proj
    [H, Is]) and shared_expert_gate = nn.Linear(H, 1, bias=False):
    out = experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    p = {"gate.weight": _rand(rng, E, H, scale=H ** -0.5),
         "experts.gate_up_proj": _rand(rng, E, 2 * I, H, scale=H ** -0.5),
         "experts.down_proj": _rand(rng, E, H, I, scale=I ** -0.5),
         "shared_expert.gate_proj.weight": _rand(rng, Is, H, scale=H ** -0.5),
         "shared_expert.up_proj.weight": _rand(rng, Is, H, scale=H ** -0.5),
         "shared_expert.down_proj.weight": _rand(rng, H, Is, scale=Is ** -0.5),
         "shared_expert_gate.weight": _rand(rng, 1, H, scale=H ** -0.5)}

    def ref(x, p):
        shared = _silu_mlp(x, p["shared_expert.gate_proj.weight"], p["shared_expert.up_proj.weight"],
                           p["shared_expert.down_proj.weight"])
        w, ids, _ = ref_route(_linear(x, p["gate.weight"]), k, normalize=False)
        routed = _experts_loop(x, ids, w, _chunk_expert(p["experts.gate_up_proj"], p["experts.down_proj"]))
        return routed + np_sigmoid(_linear(x, p["shared_expert_gate.weight"])) * shared

    def ours(x, p, impl):
        w, ids = nbx.route(x @ p["gate.weight"].T, k, normalize=False)
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], layout="out_in")
        shared = nbx.SharedExperts(
            nbx.Experts([p["shared_expert.gate_proj.weight"]], [p["shared_expert.up_proj.weight"]],
                        [p["shared_expert.down_proj.weight"]], layout="out_in"),
            gate=p["shared_expert_gate.weight"])
        return nbx.fused_moe(x, w, ids, experts, implementation=impl, shared_experts=shared)

    return p, ref, ours, ["gate.weight", "experts.gate_up_proj", "shared_expert.up_proj.weight",
                          "shared_expert_gate.weight"]


def _granite(rng, E=33, k=8, I=24):
    """GraniteMoeMoE, models/granitemoe/modeling_granitemoe.py (5.24.0):
    GraniteMoeTopKRouter (float32 logits, topk, softmax over the k),
    GraniteMoeExperts (gate_up_proj [E, 2I, H], chunk gate first; down_proj
    [E, H, I]). The checkpoint's block_sparse_moe.input_linear.weight and
    output_linear.weight are these arrays renamed (conversion_mapping.py,
    "granitemoe"), router.layer.weight the router's."""
    p = {"router.layer.weight": _rand(rng, E, H, scale=H ** -0.5),
         "input_linear.weight": _rand(rng, E, 2 * I, H, scale=H ** -0.5),
         "output_linear.weight": _rand(rng, E, H, I, scale=I ** -0.5)}

    def ref(x, p):
        w, ids, _ = ref_topk_softmax(_linear(x, p["router.layer.weight"]), k)
        return _experts_loop(x, ids, w, _chunk_expert(p["input_linear.weight"], p["output_linear.weight"]))

    def ours(x, p, impl):
        w, ids = nbx.route_topk_softmax(x @ p["router.layer.weight"].T, k)
        experts = nbx.Experts.fused(p["input_linear.weight"], p["output_linear.weight"], layout="out_in")
        return nbx.fused_moe(x, w, ids, experts, implementation=impl)

    return p, ref, ours, ["router.layer.weight", "input_linear.weight"]


GPT_OSS_ACT = nbx.Activation("swiglu_clamped", alpha=1.702, limit=7.0)


def _gpt_oss(rng, E=32, k=4, I=24):
    """GptOssMLP, models/gpt_oss/modeling_gpt_oss.py (5.24.0):
    GptOssTopKRouter: F.linear(x, weight, bias), topk of the logits, softmax
    over the k. GptOssExperts: gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]
    (gate_up_proj [E, H, 2I], x @ W), _apply_gate: gate = gate_up[..., ::2],
    up = gate_up[..., 1::2] (interleaved, the bias alike), gate.clamp(max=limit),
    up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate) (config
    swiglu_alpha 1.702, swiglu_limit 7.0); out = h @ down_proj[e] +
    down_proj_bias[e] (down_proj [E, I, H]), THEN times the routing weight:
    the down bias is weighted too. The gate_up weights are drawn large
    enough that the clamps bind for some units."""
    p = {"router.weight": _rand(rng, E, H, scale=H ** -0.5),
         "router.bias": _rand(rng, E),
         "experts.gate_up_proj": _rand(rng, E, H, 2 * I, scale=3.0 * H ** -0.5),
         "experts.gate_up_proj_bias": _rand(rng, E, 2 * I),
         "experts.down_proj": _rand(rng, E, I, H, scale=I ** -0.5),
         "experts.down_proj_bias": _rand(rng, E, H)}

    def ref(x, p):
        w, ids, _ = ref_topk_softmax(_linear(x, p["router.weight"], p["router.bias"]), k)

        def expert(e, a):
            gate_up = a @ p["experts.gate_up_proj"][e] + p["experts.gate_up_proj_bias"][e]
            h = np_glu(gate_up[..., ::2], gate_up[..., 1::2], GPT_OSS_ACT)[0]
            return h @ p["experts.down_proj"][e] + p["experts.down_proj_bias"][e]

        return _experts_loop(x, ids, w, expert)

    def ours(x, p, impl):
        w, ids = nbx.route_topk_softmax(x @ p["router.weight"].T, k, bias=p["router.bias"])
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], fusion="interleaved",
                                    layout="in_out", gate_up_bias=p["experts.gate_up_proj_bias"],
                                    down_bias=p["experts.down_proj_bias"])
        return nbx.fused_moe(x, w, ids, experts, activation=GPT_OSS_ACT, implementation=impl)

    return p, ref, ours, ["router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
                          "experts.down_proj_bias"]


def _deepseek(rng, version, E=64, I=24, n_shared=2):
    """DeepseekV3MoE, models/deepseek_v3/modeling_deepseek_v3.py (5.24.0):
    DeepseekV3TopkRouter (float32 logits, sigmoid, + e_score_correction_bias
    for the choice, n_group 8 groups scored by their top-2 sum, topk_group 4,
    -inf elsewhere, topk, weights from the unbiased scores, norm_topk_prob,
    * routed_scaling_factor 2.5); DeepseekV3Experts (gate_up_proj [E, 2I, H],
    chunk; down_proj [E, H, I]); shared_experts = DeepseekV3MLP of width
    moe_intermediate_size * n_shared_experts (nn.Linear weights), added.
    DeepseekV2Moe, models/deepseek_v2/modeling_deepseek_v2.py (5.24.0): the
    same experts and shared MLP; DeepseekV2TopkRouter: softmax,
    group_limited_greedy (group max, topk_group, masked_fill 0.0), topk,
    * routed_scaling_factor, no renormalization (here 8 groups, 3 kept, 16.0)."""
    Is = n_shared * I
    p = {"gate.weight": _rand(rng, E, H, scale=H ** -0.5),
         "experts.gate_up_proj": _rand(rng, E, 2 * I, H, scale=H ** -0.5),
         "experts.down_proj": _rand(rng, E, H, I, scale=I ** -0.5),
         "shared_experts.gate_proj.weight": _rand(rng, Is, H, scale=H ** -0.5),
         "shared_experts.up_proj.weight": _rand(rng, Is, H, scale=H ** -0.5),
         "shared_experts.down_proj.weight": _rand(rng, H, Is, scale=Is ** -0.5)}
    if version == 3:
        k = 8
        p["gate.e_score_correction_bias"] = _rand(rng, E, scale=0.1)

        def route64(logits, p):
            return ref_sigmoid(logits, k, bias=p["gate.e_score_correction_bias"], n_group=8, topk_group=4,
                               normalize=True, scale=2.5)[:2]

        def route(logits, p):
            return nbx.route_sigmoid(logits, k, correction_bias=p["gate.e_score_correction_bias"], n_group=8,
                                     topk_group=4, routed_scaling_factor=2.5)
    else:
        k = 6

        def route64(logits, p):
            return ref_route(logits, k, normalize=False, n_group=8, topk_group=3, scale=16.0)[:2]

        def route(logits, p):
            return nbx.route(logits, k, normalize=False, n_group=8, topk_group=3, routed_scaling_factor=16.0)

    def ref(x, p):
        w, ids = route64(_linear(x, p["gate.weight"]), p)
        routed = _experts_loop(x, ids, w, _chunk_expert(p["experts.gate_up_proj"], p["experts.down_proj"]))
        return routed + _silu_mlp(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                                  p["shared_experts.down_proj.weight"])

    def ours(x, p, impl):
        w, ids = route(x @ p["gate.weight"].T, p)
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], layout="out_in")
        shared = nbx.SharedExperts(nbx.Experts(
            p["shared_experts.gate_proj.weight"][None], p["shared_experts.up_proj.weight"][None],
            p["shared_experts.down_proj.weight"][None], layout="out_in"))
        return nbx.fused_moe(x, w, ids, experts, implementation=impl, shared_experts=shared)

    return p, ref, ours, ["gate.weight", "experts.gate_up_proj", "shared_experts.down_proj.weight"]


def _llama4(rng, k, E=16, I=24):
    """Llama4TextMoe, models/llama4/modeling_llama4.py (5.24.0): Llama4Router
    (nn.Linear(H, E, bias=False); topk of the logits, -inf elsewhere,
    sigmoid: the unchosen experts' scores are 0); every expert runs on
    x * its score (routed_in = x.repeat(E) * scores) -- the weight scales the
    expert's INPUT; Llama4TextExperts: gate_up_proj [E, H, 2I] (x @ W, chunk:
    gate first), down_proj [E, I, H], up * silu(gate); the expert outputs
    summed; plus shared_expert = Llama4TextMLP of width intermediate_size
    (nn.Linear weights). The model uses k = 1; the code takes any k."""
    p = {"router.weight": _rand(rng, E, H, scale=H ** -0.5),
         "experts.gate_up_proj": _rand(rng, E, H, 2 * I, scale=H ** -0.5),
         "experts.down_proj": _rand(rng, E, I, H, scale=I ** -0.5),
         "shared_expert.gate_proj.weight": _rand(rng, I, H, scale=H ** -0.5),
         "shared_expert.up_proj.weight": _rand(rng, I, H, scale=H ** -0.5),
         "shared_expert.down_proj.weight": _rand(rng, H, I, scale=I ** -0.5)}

    def ref(x, p):
        router_logits = _linear(x, p["router.weight"])
        _, router_indices = _topk(router_logits, k)
        router_scores = np.full_like(router_logits, -np.inf)
        np.put_along_axis(router_scores, router_indices, np.take_along_axis(router_logits, router_indices, -1), -1)
        router_scores = np_sigmoid(router_scores)
        out = _silu_mlp(x, p["shared_expert.gate_proj.weight"], p["shared_expert.up_proj.weight"],
                        p["shared_expert.down_proj.weight"])
        for e in range(E):  # experts' bmm over the E copies of the input
            routed_in = x * router_scores[:, e:e + 1]
            gate_up = routed_in @ p["experts.gate_up_proj"][e]
            gate, up = gate_up[:, :I], gate_up[:, I:]
            out = out + (up * np_silu(gate)) @ p["experts.down_proj"][e]
        return out

    def ours(x, p, impl):
        w, ids = nbx.route_topk_sigmoid(x @ p["router.weight"].T, k)
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], layout="in_out")
        shared = nbx.SharedExperts(nbx.Experts(
            [p["shared_expert.gate_proj.weight"]], [p["shared_expert.up_proj.weight"]],
            [p["shared_expert.down_proj.weight"]], layout="out_in"))
        return nbx.fused_moe(x, w, ids, experts, implementation=impl, weights_on="input", shared_experts=shared)

    return p, ref, ours, ["router.weight", "experts.down_proj", "shared_expert.gate_proj.weight"]


GEMMA4_ACT = {"gelu": "geglu_erf", "gelu_pytorch_tanh": "geglu"}


def _gemma4(rng, hidden_activation, E=16, k=4, I=20, eps=1e-6):
    """The MoE branch of Gemma4TextDecoderLayer (enable_moe_block),
    models/gemma4/modeling_gemma4.py (5.24.0): Gemma4TextRouter on the
    residual h: Gemma4RMSNorm without scale, * scale [H] * H**-0.5, proj
    (nn.Linear(H, E)), softmax in float32, topk, renormalize,
    * per_expert_scale[top_k_index]; the experts (Gemma4TextExperts:
    gate_up_proj [E, 2I, H], chunk gate first; down_proj [E, H, I];
    ACT2FN[config.hidden_activation]) on pre_feedforward_layernorm_2(h);
    then post_feedforward_layernorm_2. Gemma4RMSNorm:
    h * (mean(h**2) + eps)**-0.5 * weight. Gemma4TextConfig's default
    hidden_activation is "gelu_pytorch_tanh" (geglu); with "gelu"
    (GELUActivation: exact erf GELU) the experts are geglu_erf."""
    act = GEMMA4_ACT[hidden_activation]
    p = {"router.proj.weight": _rand(rng, E, H, scale=1.0),
         "router.scale": (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32),
         "router.per_expert_scale": (1.0 + 0.2 * rng.standard_normal(E)).astype(np.float32),
         "pre_feedforward_layernorm_2.weight": (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32),
         "experts.gate_up_proj": _rand(rng, E, 2 * I, H, scale=H ** -0.5),
         "experts.down_proj": _rand(rng, E, H, I, scale=I ** -0.5),
         "post_feedforward_layernorm_2.weight": (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)}

    def rms64(h, weight=None):
        n = h * (np.mean(h * h, -1, keepdims=True) + eps) ** -0.5
        return n if weight is None else n * weight

    def ref(h, p):
        logits = _linear(rms64(h) * p["router.scale"] * H ** -0.5, p["router.proj.weight"])
        w, ids, _ = ref_route(logits, k, normalize=True)
        w = w * p["router.per_expert_scale"][ids]
        h2 = rms64(h, p["pre_feedforward_layernorm_2.weight"])
        y = _experts_loop(h2, ids, w, _chunk_expert(p["experts.gate_up_proj"], p["experts.down_proj"], act))
        return rms64(y, p["post_feedforward_layernorm_2.weight"])

    def rms(h, weight=None):
        n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)
        return n if weight is None else n * weight[None]

    def ours(h, p, impl):
        logits = (rms(h) * p["router.scale"][None] * H ** -0.5) @ p["router.proj.weight"].T
        w, ids = nbx.route(logits, k)
        w = w * p["router.per_expert_scale"][ids]
        experts = nbx.Experts.fused(p["experts.gate_up_proj"], p["experts.down_proj"], layout="out_in")
        y = nbx.fused_moe(rms(h, p["pre_feedforward_layernorm_2.weight"]), w, ids, experts, activation=act,
                          implementation=impl)
        return rms(y, p["post_feedforward_layernorm_2.weight"])

    return p, ref, ours, ["router.proj.weight", "router.per_expert_scale", "experts.gate_up_proj",
                          "pre_feedforward_layernorm_2.weight"]


FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "granitemoe": _granite,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": functools.partial(_deepseek, version=3),
    "deepseek_v2": functools.partial(_deepseek, version=2),
    "llama4_k1": functools.partial(_llama4, k=1),
    "llama4_k2": functools.partial(_llama4, k=2),
    "gemma4_erf": functools.partial(_gemma4, hidden_activation="gelu"),
    "gemma4_tanh": functools.partial(_gemma4, hidden_activation="gelu_pytorch_tanh"),
}


def _seed(*parts):
    return [sum(map(ord, p)) if isinstance(p, str) else p for p in parts]


def _tree64(p):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)


def _family(name, T):
    """(params, ref, ours, grad_keys, x, rng) for family `name` at T tokens."""
    rng = np.random.default_rng(_seed(name, T))
    p, ref, ours, grad_keys = FAMILIES[name](rng)
    x = _rand(rng, T, H)
    return p, ref, ours, grad_keys, x, rng


def _rel(y, y_ref):
    return float(np.max(np.abs(np.asarray(y, np.float64) - y_ref)) / np.max(np.abs(y_ref)))


EXTRA = ("llama4_k2", "gemma4_tanh")  # beyond the released configurations: the slow run only


def _cases():
    """(name, T, impl); slow: the extra variants, and "xla" at T = 1 (the same
    code as T = 33 there, and its compilations are the costly ones)."""
    for name in FAMILIES:
        for T in (33, 1):
            for impl in ("ffi", "xla"):
                slow = name in EXTRA or (impl == "xla" and T == 1)
                yield pytest.param(name, T, impl, marks=[pytest.mark.slow] if slow else [], id=f"{name}-{T}-{impl}")


@pytest.mark.parametrize("name,T,impl", list(_cases()))
def test_family_block_matches_transformers(name, T, impl):
    """The jitted jax_nbx block against the float64 HF block: the forward
    (computed with the gradient, and for "ffi" also alone: the inference
    path, which saves no residuals), then d sum(y * ct) with respect to x and
    the family's grad_keys against central differences of the reference
    along one random direction each."""
    p, ref, ours, grad_keys, x, rng = _family(name, T)
    pj = jax.tree_util.tree_map(jnp.asarray, p)
    p64, x64 = _tree64(p), x.astype(np.float64)
    y_ref = ref(x64, p64)
    ct = _rand(rng, T, H)
    ct64 = ct.astype(np.float64)

    def loss(x, sub):
        y = ours(x, {**pj, **sub}, impl)
        return jnp.sum(y * ct), y

    (_, y), (gx, gp) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x), {key: pj[key] for key in grad_keys})
    assert y.shape == (T, H) and y.dtype == jnp.float32
    err = _rel(y, y_ref)
    assert err <= 1e-5, (name, impl, T, err)
    if impl == "ffi":
        err = _rel(jax.jit(functools.partial(ours, impl=impl))(jnp.asarray(x), pj), y_ref)
        assert err <= 1e-5, (name, impl, T, "forward alone", err)

    grads = {"x": gx, **gp}
    for key in ["x"] + grad_keys:
        base = x64 if key == "x" else p64[key]
        D = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape), base)

        def f(s, key=key, base=base, D=D):
            moved = jax.tree_util.tree_map(lambda a, d: a + s * d, base, D)
            xs, ps = (moved, p64) if key == "x" else (x64, {**p64, key: moved})
            return float(np.sum(ref(xs, ps) * ct64))

        fd = (f(EPS_FD) - f(-EPS_FD)) / (2 * EPS_FD)
        terms = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda g, d: np.asarray(g, np.float64) * d, grads[key], D))
        got = float(sum(np.sum(t) for t in terms))
        scale = float(sum(np.sum(np.abs(t)) for t in terms))  # float32 accumulation error grows with it
        assert abs(got - fd) <= 2e-5 * max(abs(fd), 1e-2 * scale, 1e-3), (name, impl, T, key, got, fd, scale)
