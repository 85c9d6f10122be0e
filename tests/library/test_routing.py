"""Routing rules and router losses (jax_nbx/routing.py) against float64 NumPy
references written from Hugging Face transformers 5.x modeling files; each
reference names the file and the commit read (repository huggingface/transformers
unless said otherwise). Exact ids (ties: lower index first, as jax.lax.top_k),
weights to float32 tolerance, jit and vmap, gradients against float64 finite
differences, errors that name the argument. The rules' references are in
tests/support/hf_ref.py; whole MoE blocks through fused_moe: tests/library/test_families.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.hf_ref import (
    _group_keep,
    _topk,
    np_sigmoid,
    np_softmax,
    ref_route,
    ref_sigmoid,
    ref_topk_sigmoid,
    ref_topk_softmax,
)

# --------------------------------------------- float64 references (the rules: tests/support/hf_ref.py)


def ref_load_balancing(layer_logits, num_experts, top_k, attention_mask=None):
    """transformers' load_balancing_loss_func, models/mixtral/modeling_mixtral.py
    @00d4b3d2: layers concatenated on the token axis; softmax; top-k of it;
    tokens_per_expert [k, E] and router_prob_per_expert [E] (masked means with
    an attention mask [B, S] repeated over the layers); sum * num_experts."""
    cat = np.concatenate([np.asarray(g, np.float64) for g in layer_logits], axis=0)
    rw = np_softmax(cat)
    _, sel = _topk(rw, top_k)
    em = np.eye(num_experts)[sel]  # one_hot, [N, k, E]
    if attention_mask is None:
        tpe = em.mean(0)
        rpe = rw.mean(0)
    else:
        B, S = attention_mask.shape
        L = cat.shape[0] // (B * S)
        m = np.asarray(attention_mask, np.float64)
        eam = np.broadcast_to(m[None, :, :, None, None], (L, B, S, top_k, num_experts)).reshape(-1, top_k,
                                                                                                  num_experts)
        tpe = (em * eam).sum(0) / eam.sum(0)
        rpam = np.broadcast_to(m[None, :, :, None], (L, B, S, num_experts)).reshape(-1, num_experts)
        rpe = (rw * rpam).sum(0) / rpam.sum(0)
    return float((tpe * rpe[None]).sum() * num_experts)


def ref_z_loss(router_logits):
    """transformers' router_z_loss_func, models/switch_transformers/
    modeling_switch_transformers.py @00dcc6dd: sum(logsumexp(logits)**2) / tokens."""
    z = np.asarray(router_logits, np.float64)
    mx = z.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(z - mx).sum(-1, keepdims=True)))[..., 0]
    return float((lse ** 2).sum() / lse.size)


# ------------------------------------------------------------------ the rules, uniformly

# name -> (jax function, float64 reference, keyword sets); each keyword set is one model configuration
RULES = {
    "softmax": (nbx.route, ref_route, [dict(normalize=True), dict(normalize=False)]),
    "softmax_groups": (nbx.route, ref_route, [dict(normalize=False, scale=16.0, n_group="g", topk_group="tg")]),
    "topk_softmax": (nbx.route_topk_softmax, ref_topk_softmax, [dict(), dict(bias="b")]),
    "sigmoid": (nbx.route_sigmoid, ref_sigmoid, [dict(bias="b", scale=2.5), dict(normalize=False)]),
    "sigmoid_groups": (nbx.route_sigmoid, ref_sigmoid, [dict(bias="b", n_group="g", topk_group="tg",
                                                             scale=2.5)]),
    "topk_sigmoid": (nbx.route_topk_sigmoid, ref_topk_sigmoid, [dict()]),
}
JAX_NAMES = {"scale": "routed_scaling_factor"}


def _configure(rule, kw, E, k, rng):
    """Concrete (jax kwargs, reference kwargs) for E experts: groups that divide
    E and leave room for k, a random bias where the rule takes one."""
    kw = dict(kw)
    if kw.get("n_group") == "g":
        min_size = 2 if rule.startswith("sigmoid") else 1
        n_group = next(g for g in (8, 7, 3, 4, 2, 11, 5) if E % g == 0 and E // g >= min_size)
        size = E // n_group
        topk_group = max(1, min(n_group, -(-k // size)))  # fewest groups that leave k experts
        topk_group = min(n_group, max(topk_group, n_group // 2))
        kw.update(n_group=n_group, topk_group=topk_group)
    if kw.get("bias") == "b":
        kw["bias"] = rng.standard_normal(E).astype(np.float32) * (0.5 if rule.startswith("sigmoid") else 1.0)
    jkw = {}
    for name, v in kw.items():
        if name == "bias":
            jkw["correction_bias" if rule.startswith("sigmoid") else "bias"] = jnp.asarray(v)
        else:
            jkw[JAX_NAMES.get(name, name)] = v
    return jkw, kw


def _cases():
    for rule, (_, _, kws) in RULES.items():
        for i in range(len(kws)):
            yield rule, i


CASES = list(_cases())
SHAPES = [  # (leading dims, E, k)
    ((5,), 7, 1), ((5,), 7, 7), ((3, 4), 33, 6), ((2, 3), 64, 8), ((1,), 64, 64), ((9,), 16, 2),
]


def _seed(*parts):
    return [sum(map(ord, p)) if isinstance(p, str) else p for p in parts]


def _check(got, ref):
    w, ids = got[0], got[1]
    rw, rids = ref[0], ref[1]
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32, (ids.dtype, w.dtype)
    np.testing.assert_array_equal(np.asarray(ids), rids)
    np.testing.assert_allclose(np.asarray(w, np.float64), rw, rtol=2e-6, atol=1e-7)


@pytest.mark.fast
@pytest.mark.parametrize("rule,cfg", CASES)
@pytest.mark.parametrize("lead,E,k", SHAPES)
def test_rule_matches_reference(rule, cfg, lead, E, k):
    if rule == "sigmoid_groups" and E == 7:
        pytest.skip("E=7 has no grouping into groups of >= 2 experts")
    fn, ref, kws = RULES[rule]
    rng = np.random.default_rng(_seed(E, k, len(lead), cfg, rule))
    jkw, rkw = _configure(rule, kws[cfg], E, k, rng)
    logits = rng.standard_normal(lead + (E,)).astype(np.float32) * 2.0
    out = fn(jnp.asarray(logits), k, return_probs=True, **jkw)
    r = ref(logits.reshape(-1, E), k, **rkw)
    _check(out, (r[0].reshape(lead + (k,)), r[1].reshape(lead + (k,))))
    np.testing.assert_allclose(np.asarray(out[2], np.float64), r[2].reshape(lead + (E,)), rtol=2e-6, atol=1e-7)
    # without return_probs: the same two arrays
    w, ids = fn(jnp.asarray(logits), k, **jkw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(out[1]))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(out[0]))


@pytest.mark.fast
@pytest.mark.parametrize("rule,cfg", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rule_half_precision_logits(rule, cfg, dtype):
    """16-bit logits (many exact ties among 64 draws in bf16): the reference sees
    the same values, ties go to the lower index in both."""
    fn, ref, kws = RULES[rule]
    E, k = 64, 8
    rng = np.random.default_rng(_seed(cfg, rule, 16))
    jkw, rkw = _configure(rule, kws[cfg], E, k, rng)
    logits = jnp.asarray(rng.standard_normal((2, 11, E)) * 2.0, dtype)
    l64 = np.asarray(logits.astype(jnp.float32), np.float64)
    _check(fn(logits, k, **jkw), [a.reshape(2, 11, k) for a in ref(l64.reshape(-1, E), k, **rkw)[:2]])


@pytest.mark.fast
@pytest.mark.parametrize("rule,cfg", CASES)
def test_rule_ties_lower_index_first(rule, cfg):
    fn, ref, kws = RULES[rule]
    E, k = 16, 4
    rng = np.random.default_rng(_seed(cfg, rule, 7))
    jkw, rkw = _configure(rule, kws[cfg], E, k, rng)
    for kw in (jkw, rkw):  # ties among the logits themselves
        kw.pop("bias", None)
        kw.pop("correction_bias", None)
    # all equal: experts 0..k-1 (grouped: groups 0.. first, then their lowest experts)
    w, ids = fn(jnp.zeros((3, E), jnp.float32), k, **jkw)
    np.testing.assert_array_equal(np.asarray(ids), np.tile(np.arange(k), (3, 1)))
    # integer logits from a small range: many ties, matched against the stable reference
    logits = rng.integers(-2, 3, (40, E)).astype(np.float32)
    _check(fn(jnp.asarray(logits), k, **jkw), ref(logits, k, **rkw)[:2])


@pytest.mark.fast
@pytest.mark.parametrize("rule,cfg", CASES)
def test_rule_under_jit_and_vmap(rule, cfg):
    fn, _, kws = RULES[rule]
    E, k = (32 if rule.endswith("groups") else 33), 5
    rng = np.random.default_rng(_seed(cfg, rule, 3))
    jkw, _ = _configure(rule, kws[cfg], E, k, rng)
    logits = jnp.asarray(rng.standard_normal((4, 6, E)), jnp.float32)
    eager = fn(logits, k, return_probs=True, **jkw)
    jitted = jax.jit(functools.partial(fn, k=k, return_probs=True, **jkw))(logits)
    vmapped = jax.vmap(lambda lg: fn(lg, k, return_probs=True, **jkw))(logits)
    vv = jax.jit(jax.vmap(jax.vmap(lambda lg: fn(lg, k, return_probs=True, **jkw))))(logits)
    for other in (jitted, vmapped, vv):
        np.testing.assert_array_equal(np.asarray(other[1]), np.asarray(eager[1]))
        for a, b in ((other[0], eager[0]), (other[2], eager[2])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _fd_grad(f, x, eps=1e-6):
    """Central finite differences of a float64 scalar function."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.fast
@pytest.mark.parametrize("rule,cfg", CASES)
def test_rule_gradient_matches_finite_differences(rule, cfg):
    """d sum(weights * c) / d logits (and / d bias for gpt-oss) against float64
    central differences of the reference; the correction bias gets none."""
    fn, ref, kws = RULES[rule]
    E, k = 8, 3
    rng = np.random.default_rng(_seed(cfg, rule, 5))
    jkw, rkw = _configure(rule, kws[cfg], E, k, rng)
    logits = rng.standard_normal((4, E)).astype(np.float32)
    c = rng.standard_normal((4, k))

    def loss(lg, **kw):
        return jnp.sum(fn(lg, k, **kw)[0] * jnp.asarray(c, jnp.float32))

    g = jax.grad(loss)(jnp.asarray(logits), **jkw)
    fd = _fd_grad(lambda lg: float(np.sum(ref(lg, k, **rkw)[0] * c)), logits)
    np.testing.assert_allclose(np.asarray(g, np.float64), fd, rtol=1e-4, atol=2e-6)
    if "bias" in jkw:  # gpt-oss's router bias is trained
        gb = jax.grad(lambda b: loss(jnp.asarray(logits), bias=b))(jkw["bias"])
        fdb = _fd_grad(lambda b: float(np.sum(ref(logits, k, **{**rkw, "bias": b})[0] * c)), rkw["bias"])
        np.testing.assert_allclose(np.asarray(gb, np.float64), fdb, rtol=1e-4, atol=2e-6)
    if "correction_bias" in jkw:  # a buffer: it moves the choice only
        gb = jax.grad(lambda b: loss(jnp.asarray(logits), **{**jkw, "correction_bias": b}))(jkw["correction_bias"])
        assert not np.any(np.asarray(gb))


@pytest.mark.fast
def test_route_is_backward_compatible():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 7, 16)).astype(np.float32)
    for normalize in (True, False):
        w, ids = nbx.route(logits, k=3, normalize=normalize)
        rw, rids, _ = ref_route(logits, 3, normalize=normalize)
        _check((w, ids), (rw, rids))
        # numpy integer k, positional k
        w2, ids2 = nbx.route(jnp.asarray(logits), np.int64(3), normalize=normalize)
        np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))


@pytest.mark.fast
def test_topk_softmax_equals_renormalized_softmax_topk():
    """Granite/gpt-oss's rule is the renormalized Mixtral rule on the same logits."""
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((50, 33)), jnp.float32)
    w1, i1 = nbx.route(logits, 6)
    w2, i2 = nbx.route_topk_softmax(logits, 6)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2))
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), rtol=2e-6, atol=1e-7)


@pytest.mark.fast
def test_sigmoid_groups_mask_out_other_groups():
    """The chosen experts all lie in the topk_group best groups, even where a
    masked expert outscores a kept one; the correction bias moves the choice
    and not the weights."""
    E, n_group, topk_group, k = 64, 8, 4, 8
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((200, E)).astype(np.float32) * 3
    cb = rng.standard_normal(E).astype(np.float32)
    w, ids = nbx.route_sigmoid(logits, k, correction_bias=cb, n_group=n_group, topk_group=topk_group,
                               normalize=False)
    c = np_sigmoid(logits.astype(np.float64)) + cb
    keep = _group_keep(c, n_group, topk_group, "top2")
    ids = np.asarray(ids)
    assert np.take_along_axis(keep, ids, -1).all()
    kth = np.take_along_axis(c, ids, -1).min(-1, keepdims=True)
    assert (~keep & (c > kth)).any()  # a masked expert outscored a chosen one: the masking mattered
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(np_sigmoid(logits.astype(np.float64)), ids, -1),
                               rtol=2e-6)
    _, ids0 = nbx.route_sigmoid(logits, k, n_group=n_group, topk_group=topk_group)
    assert (np.asarray(ids0) != ids).any()


@pytest.mark.fast
def test_sigmoid_groups_mask_with_minus_infinity():
    """Biased scores below 0 in the kept groups: the masked experts stay out
    (-inf, transformers' later router). The earlier route_tokens_to_experts
    filled 0.0 and would pick the masked experts 4..7 here (documented)."""
    logits = jnp.zeros((1, 8), jnp.float32)  # scores 0.5
    cb = jnp.asarray([-2.0, -2.1, -3.0, -3.1, -4.0, -4.1, -5.0, -5.1])  # biased: -1.5 .. -4.6
    w, ids = nbx.route_sigmoid(logits, 4, correction_bias=cb, n_group=4, topk_group=2)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3]])
    np.testing.assert_allclose(np.asarray(w), [[0.25] * 4], rtol=1e-6)
    _, ids = nbx.route_sigmoid(logits, 3, correction_bias=cb, n_group=4, topk_group=2)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2]])


# ------------------------------------------------------------------ losses


def _layers(rng, L, B, S, E, dtype=np.float32):
    return (rng.standard_normal((L, B, S, E)) * 1.5).astype(dtype)


@pytest.mark.fast
@pytest.mark.parametrize("L,B,S,E,k", [(1, 2, 5, 8, 2), (3, 2, 7, 33, 4), (2, 1, 9, 64, 8), (1, 3, 4, 7, 7),
                                       (2, 2, 3, 16, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(L, B, S, E, k, masked):
    rng = np.random.default_rng([L, B, S, E, k])
    logits = _layers(rng, L, B, S, E)
    mask = None
    if masked:
        mask = (rng.uniform(size=(B, S)) < 0.7).astype(np.int64)
        mask[0, 0] = 1
    ref = ref_load_balancing(list(logits.reshape(L, B * S, E)), E, k, mask)
    w, ids, probs = nbx.route(jnp.asarray(logits), k, return_probs=True)
    got = nbx.load_balancing_loss(probs, ids, mask=None if mask is None else jnp.asarray(mask))
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), ref, rtol=2e-6)
    jitted = jax.jit(nbx.load_balancing_loss)(probs, ids, mask=None if mask is None else jnp.asarray(mask, bool))
    np.testing.assert_allclose(float(jitted), ref, rtol=2e-6)


@pytest.mark.fast
def test_load_balancing_loss_values_and_counts():
    """k at perfect balance (transformers' scaling); ids outside [0, E) not counted;
    bf16 probabilities accepted."""
    E, k, T = 4, 2, 8
    probs = jnp.full((T, E), 1.0 / E)
    ids = jnp.asarray([[0, 1], [2, 3]] * (T // 2), jnp.int32)
    np.testing.assert_allclose(float(nbx.load_balancing_loss(probs, ids)), k, rtol=1e-6)
    bad = ids.at[0, 0].set(E).at[1, 1].set(-1)
    expect = E * np.sum(np.asarray(nbx.expert_counts(bad, E)) / T * (1.0 / E))
    np.testing.assert_allclose(float(nbx.load_balancing_loss(probs, bad)), expect, rtol=1e-6)
    np.testing.assert_allclose(float(nbx.load_balancing_loss(probs.astype(jnp.bfloat16), ids)), k, rtol=1e-6)


@pytest.mark.fast
def test_load_balancing_loss_gradient():
    """Differentiable through P_e (the softmax of the logits), not the counts:
    against float64 central differences of transformers' formula."""
    rng = np.random.default_rng(11)
    B, S, E, k = 2, 3, 7, 2
    logits = _layers(rng, 1, B, S, E)[0]
    mask = np.array([[1, 1, 0], [1, 0, 1]])

    def loss(lg):
        w, ids, probs = nbx.route(lg, k, return_probs=True)
        return nbx.load_balancing_loss(probs, ids, mask=jnp.asarray(mask))

    g = jax.grad(loss)(jnp.asarray(logits))
    fd = _fd_grad(lambda lg: ref_load_balancing([lg.reshape(B * S, E)], E, k, mask), logits)
    np.testing.assert_allclose(np.asarray(g, np.float64), fd, rtol=1e-4, atol=2e-6)


@pytest.mark.fast
@pytest.mark.parametrize("shape", [(3, 5, 8), (1, 1, 7), (2, 4, 64)])
def test_router_z_loss_matches_transformers(shape):
    rng = np.random.default_rng(list(shape))
    logits = (rng.standard_normal(shape) * 3).astype(np.float32)
    got = nbx.router_z_loss(jnp.asarray(logits))
    np.testing.assert_allclose(float(got), ref_z_loss(logits), rtol=2e-6)
    np.testing.assert_allclose(float(jax.jit(nbx.router_z_loss)(jnp.asarray(logits))), ref_z_loss(logits),
                               rtol=2e-6)
    g = jax.grad(nbx.router_z_loss)(jnp.asarray(logits))
    fd = _fd_grad(ref_z_loss, logits)
    np.testing.assert_allclose(np.asarray(g, np.float64), fd, rtol=1e-4, atol=2e-6)
    # bf16 logits: computed in float32 from the same values
    lb = jnp.asarray(logits, jnp.bfloat16)
    np.testing.assert_allclose(float(nbx.router_z_loss(lb)), ref_z_loss(np.asarray(lb.astype(jnp.float32))),
                               rtol=2e-6)
    # a mask: the mean over the kept tokens
    mask = np.zeros(shape[:-1], bool)
    mask[..., 0] = True
    np.testing.assert_allclose(float(nbx.router_z_loss(jnp.asarray(logits), mask=jnp.asarray(mask))),
                               ref_z_loss(logits[..., :1, :]), rtol=2e-6)


@pytest.mark.fast
def test_expert_counts():
    rng = np.random.default_rng(4)
    E = 9
    ids = rng.integers(0, E, (3, 10, 4)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(ids, E)), np.bincount(ids.ravel(), minlength=E))
    c = nbx.expert_counts(jnp.asarray(ids), E)
    assert c.dtype == jnp.int32 and c.shape == (E,)
    mask = rng.uniform(size=(3, 10)) < 0.5
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(ids, E, mask=jnp.asarray(mask))),
                                  np.bincount(ids[mask].ravel(), minlength=E))
    # out of range ids are not counted, in any integer dtype (no wrap-around into range)
    bad = np.array([[0, E, -1, 3]], np.int32)
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(bad, E)), np.bincount([0, 3], minlength=E))
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(np.array([[1, 255]], np.uint8), 300)),
                                  np.bincount([1, 255], minlength=300))
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(np.array([[2, 200]], np.uint8), 4)),
                                  np.bincount([2], minlength=4))
    wide = np.array([[2 ** 32 + 1, 2, -(2 ** 32) + 3]], np.int64)  # would wrap to 1 and 3 as int32
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(wide, 4)), np.bincount([2], minlength=4))
    np.testing.assert_array_equal(np.asarray(nbx.expert_counts(np.array([[2 ** 32 + 1, 3]], np.uint64), 4)),
                                  np.bincount([3], minlength=4))
    probs = jnp.full((1, 4), 0.25)
    np.testing.assert_allclose(float(nbx.load_balancing_loss(probs, wide)), 4 * 0.25, rtol=1e-6)
    # jit and vmap (per row of a batch)
    np.testing.assert_array_equal(np.asarray(jax.jit(nbx.expert_counts, static_argnums=1)(ids, E)),
                                  np.bincount(ids.ravel(), minlength=E))
    per = jax.vmap(lambda i: nbx.expert_counts(i, E))(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(per), np.stack([np.bincount(r.ravel(), minlength=E) for r in ids]))


# ------------------------------------------------------------------ errors


@pytest.mark.fast
def test_errors_name_the_argument():
    z8 = jnp.zeros((3, 8))
    cases = [
        (lambda: nbx.route(z8, k=9), ValueError, r"k must be an int in \[1, E=8\].*got k=9"),
        (lambda: nbx.route(z8, k=2.0), ValueError, r"got k=2\.0"),
        (lambda: nbx.route(z8, k=True), ValueError, r"got k=True"),
        (lambda: nbx.route_sigmoid(z8, k=0), ValueError, r"got k=0"),
        (lambda: nbx.route_topk_sigmoid(jnp.zeros((3, 8), jnp.int32), 1), TypeError,
         r"logits must be a float array; got dtype int32"),
        (lambda: nbx.route_topk_softmax(jnp.float32(1.0), 1), ValueError, r"logits must have shape \[\.\.\., E\]"),
        (lambda: nbx.route(z8, 2, n_group=3), ValueError, r"n_group .* divides the number of experts E=8.*"
                                                           r"got n_group=3"),
        (lambda: nbx.route_sigmoid(z8, 2, n_group=4, topk_group=5), ValueError,
         r"topk_group must be an int in \[1, n_group=4\]; got topk_group=5"),
        (lambda: nbx.route_sigmoid(z8, 2, n_group=4, topk_group=0), ValueError, r"got topk_group=0"),
        (lambda: nbx.route_sigmoid(z8, 2, n_group=8), ValueError, r"n_group=8 leaves groups of E/n_group=1"),
        (lambda: nbx.route_sigmoid(z8, 5, n_group=4, topk_group=2), ValueError,
         r"k=5 exceeds the topk_group\*E/n_group = 2\*2 = 4"),
        (lambda: nbx.route(z8, 3, n_group=8, topk_group=2), ValueError, r"k=3 exceeds"),
        (lambda: nbx.route_sigmoid(z8, 2, correction_bias=jnp.zeros(7)), ValueError,
         r"correction_bias must have shape \(E,\) = \(8,\).*got shape \(7,\)"),
        (lambda: nbx.route_sigmoid(z8, 2, correction_bias=jnp.zeros(8, jnp.int32)), TypeError,
         r"correction_bias must be a float array; got dtype int32"),
        (lambda: nbx.route_topk_softmax(z8, 2, bias=jnp.zeros((1, 8))), ValueError,
         r"bias must have shape \(E,\) = \(8,\).*got shape \(1, 8\)"),
        (lambda: nbx.route_sigmoid(z8, 2, routed_scaling_factor=jnp.float32(2.5)), TypeError,
         r"routed_scaling_factor must be a finite"),
        (lambda: nbx.route(z8, 2, routed_scaling_factor=float("nan")), TypeError, r"got nan"),
        (lambda: nbx.load_balancing_loss(z8, jnp.zeros((3, 2), jnp.float32)), TypeError,
         r"topk_ids must be an integer array; got dtype float32"),
        (lambda: nbx.load_balancing_loss(z8, jnp.zeros((4, 2), jnp.int32)), ValueError,
         r"topk_ids of shape \(4, 2\) must have the token shape \(3,\) of probs"),
        (lambda: nbx.load_balancing_loss(z8, jnp.zeros((3, 2), jnp.int32), mask=jnp.ones(4)), ValueError,
         r"mask of shape \(4,\) does not broadcast to the token shape \(3,\)"),
        (lambda: nbx.router_z_loss(z8, mask=jnp.ones((2, 3))), ValueError, r"mask of shape \(2, 3\)"),
        (lambda: nbx.expert_counts(jnp.zeros((3, 2), jnp.int32), 0), ValueError, r"got num_experts=0"),
        (lambda: nbx.expert_counts(jnp.zeros((3, 2)), 4), TypeError, r"topk_ids must be an integer array"),
        (lambda: nbx.expert_counts(jnp.zeros((3, 2), jnp.int32), 4, mask=jnp.zeros(3, jnp.complex64)), TypeError,
         r"mask must be a bool, integer or float array; got dtype complex64"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()


def test_route_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 7, 16)).astype(np.float32)
    for normalize in (True, False):
        w, ids = nbx.route(logits, k=3, normalize=normalize)
        assert w.shape == ids.shape == (5, 7, 3) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[..., :3]
        np.testing.assert_array_equal(np.asarray(ids), top)
        pw = np.take_along_axis(p, top, -1)
        if normalize:
            pw = pw / pw.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w), pw, rtol=1e-5)
