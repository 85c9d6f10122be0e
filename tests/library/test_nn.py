"""jax_nbx.nn: the Flax NNX and Equinox MoE layers and the block they share.

Forward and gradients of both layers against `moe_block`, against
`fused_moe` called by hand and against the pure-JAX reference; the
initialization; quantized (frozen) experts; the router losses' mask; the
mesh path; the optional imports; the docstrings' examples, run."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import nn

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

CONFIGS = {
    # Qwen2-MoE-like: softmax without renormalization, a gated shared expert
    "shared_gate": nn.MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, top_k=2, norm_topk_prob=False,
                                shared_intermediate_size=40, shared_gate=True),
    # gpt-oss-like: router bias, expert biases, interleaved in_out, clamped swiglu
    "biases": nn.MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, top_k=3, routing="softmax_topk",
                           router_bias=True, expert_bias=True, fusion="interleaved", layout="in_out",
                           activation=nbx.Activation("swiglu_clamped", alpha=1.702, limit=7.0)),
    # DeepSeek-V3-like: sigmoid, correction bias, groups, scaling, shared expert
    "sigmoid": nn.MoEConfig(hidden_size=48, intermediate_size=24, num_experts=16, top_k=4, routing="sigmoid",
                            correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            shared_intermediate_size=48),
}


def _randomize(params: nn.MoEParams, seed: int) -> nn.MoEParams:
    """Every float leaf replaced by O(1)-scaled noise (fresh init is 0.02-scaled, too small to test)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = [(jax.random.normal(k, a.shape, jnp.float32) * (0.3 if a.ndim <= 1 else a.shape[-1] ** -0.5 * 2))
           .astype(a.dtype) for k, a in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


def _by_hand(params: nn.MoEParams, x, config: nn.MoEConfig, impl):
    """The block written with the public routing functions and fused_moe."""
    logits = x @ params.router.T
    if params.router_bias is not None:
        logits = logits + params.router_bias.reshape((1,) * (logits.ndim - 1) + (-1,))
    if config.routing == "softmax":
        w, ids = nbx.route(logits, config.top_k, normalize=config.norm_topk_prob)
    elif config.routing == "softmax_topk":
        w, ids = nbx.route_topk_softmax(logits, config.top_k)
    else:
        w, ids = nbx.route_sigmoid(logits, config.top_k, correction_bias=params.correction_bias,
                                   n_group=config.n_group, topk_group=config.topk_group,
                                   routed_scaling_factor=config.routed_scaling_factor)
    return nbx.fused_moe(x, w, ids, params.experts, activation=config.activation, implementation=impl,
                         shared_experts=params.shared)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# lists with the richest config (biases, interleaved, clamped): the layers hold lists as they hold arrays
@pytest.mark.parametrize("name,lists", [(n, False) for n in CONFIGS] + [("biases", True)],
                         ids=[f"{n}-stacked" for n in CONFIGS] + ["biases-lists"])
def test_layers_forward_and_gradients(name, lists):
    """NNXMoE under nnx.jit/nnx.grad and EqxMoE under eqx.filter_jit/filter_grad
    equal moe_block and fused_moe by hand (bit for bit: the same program),
    and the "xla" reference within 1e-5 (forward and every gradient)."""
    config = CONFIGS[name]
    params = _randomize(nn.init_params(config, jax.random.PRNGKey(0), lists=lists), 1)
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 11, config.hidden_size), jnp.float32)
    ct = jax.random.normal(jax.random.PRNGKey(3), x.shape, jnp.float32)
    m_nnx = nn.NNXMoE(config, params=params)
    m_eqx = nn.EqxMoE(config, params=params)

    def loss_of(y):
        return jnp.sum(y * ct)

    y_nnx, aux = nnx.jit(lambda m, x: m(x))(m_nnx, x)
    y_eqx, _ = eqx.filter_jit(lambda m, x: m(x))(m_eqx, x)
    y_blk, _ = jax.jit(lambda p, x: nn.moe_block(p, x, config))(params, x)
    y_hand = jax.jit(lambda p, x: _by_hand(p, x, config, "ffi"))(params, x)
    y_ref = jax.jit(lambda p, x: _by_hand(p, x, config, "xla"))(params, x)
    assert np.array_equal(np.asarray(y_nnx), np.asarray(y_blk)) and np.array_equal(np.asarray(y_eqx), np.asarray(y_blk))
    assert np.array_equal(np.asarray(y_blk), np.asarray(y_hand))
    assert _rel(y_nnx, y_ref) <= 1e-5
    assert int(aux.expert_counts.sum()) == 33 * config.top_k

    g_nnx = nnx.jit(nnx.grad(lambda m, x: loss_of(m(x)[0])))(m_nnx, x)
    g_eqx = eqx.filter_jit(eqx.filter_grad(lambda m, x: loss_of(m(x)[0])))(m_eqx, x)
    g_ref = jax.jit(jax.grad(lambda p, x: loss_of(_by_hand(p, x, config, "xla"))))(params, x)
    nnx_leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(g_nnx))}
    ref_leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(g_ref)}
    eqx_leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(g_eqx.params)}
    for key, ref in ref_leaves.items():
        if key == ".correction_bias":  # a buffer: no gradient in the layers; the hand-written block has one
            assert eqx_leaves[key] is None or not np.any(np.asarray(eqx_leaves[key]))
            continue
        nkey = "[" + "][".join(repr(p) for p in _nnx_path(key)) + "]"
        assert _rel(eqx_leaves[key], ref) <= 1e-5, (key, _rel(eqx_leaves[key], ref))
        assert np.array_equal(np.asarray(nnx_leaves[nkey]), np.asarray(eqx_leaves[key])), key


def _nnx_path(key: str):
    """'.experts.gate[3]' -> ('experts', 'gate', 3): the NNX state's path of a MoEParams leaf."""
    out = []
    for part in key.replace("[", ".[").split("."):
        if not part:
            continue
        out.append(int(part[1:-1]) if part.startswith("[") else part)
    return out


def test_init_follows_the_reference_initialization():
    """normal(0, initializer_range) weights in param_dtype, zero float32
    biases, the configured layout (out_in: [E, I, H] gate), lists on request."""
    config = nn.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, expert_bias=True,
                          router_bias=True, initializer_range=0.05)
    p = nn.init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
    assert p.experts.gate.shape == (8, 128, 256) and p.experts.down.shape == (8, 256, 128)
    assert p.experts.gate.dtype == jnp.bfloat16 and p.router.shape == (8, 256)
    for a in (p.experts.gate, p.experts.up, p.experts.down):
        a = np.asarray(a, np.float64)
        assert abs(a.std() - 0.05) < 0.002 and abs(a.mean()) < 0.002
        assert not np.array_equal(a[0], a[1])
    for b in (p.experts.gate_bias, p.experts.up_bias, p.experts.down_bias, p.router_bias):
        assert b.dtype == jnp.float32 and not np.any(np.asarray(b))
    lists = nn.init_params(config, jax.random.PRNGKey(0), lists=True)
    assert lists.experts.is_list and len(lists.experts.gate) == 8 and lists.experts.gate[0].shape == (128, 256)
    fused = nn.init_params(nn.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=1,
                                        fusion="concat"), jax.random.PRNGKey(0))
    assert fused.experts.gate_up.shape == (4, 32, 32) and fused.experts.fusion == "concat"


def test_quantized_experts_are_frozen_state():
    """int4 experts in NNXMoE are Frozen variables: nnx.grad over Params
    reaches the router only; EqxMoE's filter_grad leaves the integer codes
    out and the scales get zero gradient; the forward equals fused_moe."""
    config = nn.MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2, layout="in_out")
    p = _randomize(nn.init_params(config, jax.random.PRNGKey(0)), 4)
    q = p._replace(experts=nbx.quantize(p.experts, "int4", group_size=32))
    m = nn.NNXMoE(config, params=q)
    assert {type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(m))} == {"Param", "Frozen"}
    x = jax.random.normal(jax.random.PRNGKey(5), (7, 64))
    g = nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2))(m, x)
    assert [p for p, _ in nnx.to_flat_state(g)] == [("router",)]
    y_ref = _by_hand(q, x, config, "xla")
    assert _rel(m(x)[0], y_ref) <= 1e-5
    ge = jax.block_until_ready(eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0] ** 2))(nn.EqxMoE(config, params=q), x))
    assert ge.params.experts.gate.q is None and not np.any(np.asarray(ge.params.experts.gate.scale))


def test_router_losses_and_mask():
    """aux: the load-balancing and z losses of the routed tokens; a mask
    drops padding from both (equal to the losses of the real tokens alone)."""
    config = CONFIGS["shared_gate"]
    params = _randomize(nn.init_params(config, jax.random.PRNGKey(0)), 6)
    x = jax.random.normal(jax.random.PRNGKey(7), (2, 9, config.hidden_size))
    mask = jnp.arange(9)[None, :] < jnp.array([[9], [4]])
    _, aux = nn.moe_block(params, x, config, mask=mask)
    real = jnp.concatenate([x[0], x[1, :4]])
    _, aux_real = nn.moe_block(params, real, config)
    np.testing.assert_allclose(aux.load_balancing_loss, aux_real.load_balancing_loss, rtol=1e-6)
    np.testing.assert_allclose(aux.router_z_loss, aux_real.router_z_loss, rtol=1e-6)
    assert np.array_equal(np.asarray(aux.expert_counts), np.asarray(aux_real.expert_counts))
    logits = real @ params.router.T
    w, ids, probs = nbx.route(logits, 2, normalize=False, return_probs=True)
    np.testing.assert_allclose(aux_real.load_balancing_loss, nbx.load_balancing_loss(probs, ids), rtol=1e-6)


def test_mesh_path_equals_the_unsharded_block():
    """config.mesh runs sharded_moe (plus the shared expert): on a one-device
    mesh it equals the unsharded block; partition_specs put E on the expert axis."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    base = nn.MoEConfig(hidden_size=48, intermediate_size=24, num_experts=8, top_k=2, layout="in_out",
                        shared_intermediate_size=32, shared_gate=True)
    params = _randomize(nn.init_params(base, jax.random.PRNGKey(0)), 8)
    x = jax.random.normal(jax.random.PRNGKey(9), (6, 48))
    y0, _ = nn.moe_block(params, x, base)
    import dataclasses
    y1, _ = nn.moe_block(params, x, dataclasses.replace(base, mesh=mesh))
    assert _rel(y1, y0) <= 1e-6
    specs = nn.partition_specs(params, base)
    P = jax.sharding.PartitionSpec
    assert specs.experts.gate == P("expert", None, None) and specs.router == P()
    with pytest.raises(ValueError, match="per-expert lists cannot be sharded"):
        nn.partition_specs(nn.init_params(base, jax.random.PRNGKey(0), lists=True), base)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(routing="argmax"), "routing must be one of"),
    (dict(hidden_size=0), "hidden_size must be a positive integer; got 0"),
    (dict(fusion="stacked"), "fusion must be None or one of"),
    (dict(layout="rows"), "layout must be one of"),
    (dict(shared_gate=True), "shared_gate needs a shared expert"),
    (dict(correction_bias=True), "correction_bias is DeepSeek-V3's"),
    (dict(activation="relu"), "relu"),
])
def test_config_errors_name_the_field(kw, match):
    base = dict(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=match):
        nn.MoEConfig(**{**base, **kw})


def test_layer_errors():
    config = nn.MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="pass rngs="):
        nn.NNXMoE(config)
    with pytest.raises(ValueError, match="pass key="):
        nn.EqxMoE(config)
    m = nn.EqxMoE(config, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"x has shape \(3, 15\); expected \[\.\.\., hidden_size=16\]"):
        m(jnp.ones((3, 15)))


def test_frameworks_are_optional():
    """Importing jax_nbx, jax_nbx.nn and jax_nbx.loaders loads neither Flax
    nor Equinox; without Flax, nn.NNXMoE names the extra to install."""
    code = ("import sys; import jax_nbx, jax_nbx.nn, jax_nbx.loaders; "
            "assert 'flax' not in sys.modules and 'equinox' not in sys.modules, sorted(sys.modules)\n"
            "sys.modules['flax'] = None\n"
            "try:\n    jax_nbx.nn.NNXMoE\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "jax_nbx.nn.NNXMoE needs flax: pip install 'jax_nbx[flax]'" in out


@pytest.mark.parametrize("obj", ["NNXMoE", "EqxMoE"])
def test_docstring_example_runs(obj):
    """The example in each layer's docstring runs as written."""
    doc = getattr(nn, obj).__doc__
    src = doc.split("Example::", 1)[1].split("\n    Args:", 1)[0]
    code = "\n".join(line[8:] for line in src.splitlines())
    ns: dict = {}
    exec(compile(code, f"<{obj} docstring>", "exec"), ns)
    grads = ns.get("grads") if obj == "NNXMoE" else ns.get("g")
    assert grads is not None
    # the example's last call may still run (async dispatch): wait for it before the
    # account's teardown check (tests/conftest.py) reads the live bytes
    leaves = jax.block_until_ready(jax.tree.leaves(grads))
    assert leaves and all(np.all(np.isfinite(np.asarray(v))) for v in leaves)
