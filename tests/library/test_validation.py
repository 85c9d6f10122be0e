"""Bad input: clear errors naming the argument and value; nothing leaks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from conftest import as_lists, make_problem, np_moe, rel_err

pytestmark = pytest.mark.sanitize


@pytest.fixture
def prob():
    return make_problem(0, 10, 8, 2, 65, 33)


def _bad_ids(ids, value, t=5, j=1):
    return ids.at[t, j].set(value)


@pytest.mark.arm64
@pytest.mark.parametrize("bad", [8, 100, -1])
def test_out_of_range_id_eager(prob, bad):
    x, w, ids, experts = prob
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"INVALID_ARGUMENT.*topk_ids\[5, 1\] = {bad} is outside \[0, 8\)"):
        nbx.fused_moe(x, w, _bad_ids(ids, bad), experts, implementation="ffi").block_until_ready()


@pytest.mark.arm64
def test_out_of_range_id_under_jit_then_recovers(prob):
    x, w, ids, experts = prob
    f = jax.jit(lambda i: nbx.fused_moe(x, w, i, experts, implementation="ffi"))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[5, 1\] = 9 is outside \[0, 8\)"):
        f(_bad_ids(ids, 9)).block_until_ready()
    assert nbx.memory.stats()["cpu:0"]["live"] == 0
    assert rel_err(f(ids), np_moe(x, w, ids, experts)) < 1e-5


def test_eager_error_type_does_not_depend_on_an_earlier_success():
    # shapes of their own: once a call of a signature has succeeded, JAX's C++ dispatch fast path
    # raised the handler's status as a plain ValueError (jax-ml/jax#34083); eager fused_moe
    # raises JaxRuntimeError either way (issue #14, item 6)
    x, w, ids, experts = make_problem(3, 11, 8, 2, 65, 33)
    nbx.fused_moe(x, w, ids, experts, implementation="ffi").block_until_ready()
    for _ in range(2):
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"^INVALID_ARGUMENT: topk_ids\[5, 1\] = 9 is outside \[0, 8\)"):
            nbx.fused_moe(x, w, _bad_ids(ids, 9), experts, implementation="ffi")
    assert nbx.memory.stats()["cpu:0"]["live"] == 0


def test_under_a_users_jit_the_error_text_is_the_same_whatever_the_type():
    # Under the user's own jax.jit the call is JAX's: after a success its fast path raises
    # ValueError (documented in the README, with this text); before, JaxRuntimeError.
    x, w, ids, experts = make_problem(4, 13, 8, 2, 65, 33)
    f = jax.jit(lambda i: nbx.fused_moe(x, w, i, experts, implementation="ffi"))
    f(ids).block_until_ready()
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=r"^INVALID_ARGUMENT: topk_ids\[5, 1\] = 9 is outside \[0, 8\)"):
        f(_bad_ids(ids, 9)).block_until_ready()


@pytest.mark.arm64
def test_retyping_keeps_other_errors():
    from jax_nbx.ops import as_runtime_error as _as_runtime_error
    e = ValueError("x has shape (3,); expected ...")
    assert _as_runtime_error(e) is e
    r = _as_runtime_error(ValueError("INTERNAL: boom"))
    assert type(r) is jax.errors.JaxRuntimeError and str(r) == "INTERNAL: boom"


@pytest.mark.arm64
def test_int64_id_beyond_int32_is_still_refused(prob):
    x, w, ids, experts = prob
    big = np.asarray(ids, np.int64)
    big[2, 0] = 2 ** 32 + 1  # would wrap to 1 if narrowed to int32 naively
    with jax.enable_x64(True):
        assert jnp.asarray(big).dtype == jnp.int64
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[2, 0\] = 8 is outside"):
            nbx.fused_moe(x, w, big, experts, implementation="ffi").block_until_ready()


def test_xla_path_refuses_out_of_range_ids_and_skip_drops_them(prob):
    """ids_outside="error" fails on the "xla" path too (a host check of the
    ids), eagerly and under jit, naming the position and the id; "skip"
    drops such slots."""
    x, w, ids, experts = prob
    bad = _bad_ids(ids, 8)
    for run in (nbx.fused_moe, jax.jit(nbx.fused_moe, static_argnames="implementation")):
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[5, 1\] = 8 is outside \[0, 8\)"):
            jax.block_until_ready(run(x, w, bad, experts, implementation="xla"))
    y = nbx.fused_moe(x, w, bad, experts, implementation="xla", ids_outside="skip")
    keep = np.asarray(w).copy()
    keep[5, 1] = 0.0
    assert rel_err(y, np_moe(x, keep, ids, experts)) < 1e-5


def _experts_with(experts, **kw):
    d = dict(gate=experts.gate, up=experts.up, down=experts.down)
    d.update(kw)
    return nbx.Experts(**d)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_shape_errors_name_the_argument(prob, impl):
    x, w, ids, experts = prob
    f = lambda *a, **k: nbx.fused_moe(*a, implementation=impl, **k)  # noqa: E731
    with pytest.raises(ValueError, match=r"x has shape \(10, 64\).*H=65"):
        f(x[:, :64], w, ids, experts)
    with pytest.raises(ValueError, match=r"experts.up has shape \(8, 65, 32\).*\(8, 65, 33\)"):
        f(x, w, ids, _experts_with(experts, up=experts.up[..., :32]))
    with pytest.raises(ValueError, match=r"experts.down has shape \(7, 33, 65\).*\(8, 33, 65\)"):
        f(x, w, ids, _experts_with(experts, down=experts.down[:7]))
    with pytest.raises(ValueError, match=r"experts.gate must be a 3-D array; got shape \(65, 33\)"):
        f(x, w, ids, _experts_with(experts, gate=experts.gate[0]))
    with pytest.raises(ValueError, match=r"topk_ids has shape \(10, 2, 1\)"):
        f(x, w, ids[..., None], experts)
    with pytest.raises(ValueError, match=r"topk_ids has shape \(9, 2\); expected \(10, 2\)"):
        f(x, w, ids[:9], experts)
    with pytest.raises(ValueError, match=r"topk_weights has shape \(10, 3\); expected topk_ids' shape \(10, 2\)"):
        f(x, jnp.ones((10, 3)), ids, experts)
    with pytest.raises(ValueError, match=r"k=9 .* must be in \[1, E=8\]"):
        f(x, jnp.ones((10, 9)), jnp.zeros((10, 9), jnp.int32), experts)
    with pytest.raises(ValueError, match=r"x must have shape \[..., H\]"):
        f(x[0, 0], w[0, 0], ids[0, 0], experts)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_dtype_errors_name_the_argument(prob, impl):
    x, w, ids, experts = prob
    f = lambda *a, **k: nbx.fused_moe(*a, implementation=impl, **k)  # noqa: E731
    with pytest.raises(TypeError, match=r"x has dtype int32"):
        f(x.astype(jnp.int32), w, ids, experts)
    with pytest.raises(TypeError, match=r"topk_ids has dtype float32"):
        f(x, w, ids.astype(jnp.float32), experts)
    with pytest.raises(TypeError, match=r"topk_weights has dtype int32"):
        f(x, w.astype(jnp.int32), ids, experts)
    with pytest.raises(TypeError, match=r"experts.up has dtype int8"):
        f(x, w, ids, _experts_with(experts, up=experts.up.astype(jnp.int8)))
    with pytest.raises(TypeError, match=r"share one dtype; got float32, bfloat16, float32"):
        f(x, w, ids, _experts_with(experts, up=experts.up.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match=r"experts must be a jax_nbx.Experts; got tuple"):
        f(x, w, ids, (experts.gate, experts.up, experts.down))


@pytest.mark.arm64
def test_option_errors(prob):
    x, w, ids, experts = prob
    with pytest.raises(ValueError, match=r"activation must be one of \('swiglu', 'geglu', 'swiglu_clamped', "
                                         r"'geglu_erf'\); got 'relu'"):
        nbx.fused_moe(x, w, ids, experts, activation="relu")
    with pytest.raises(ValueError, match=r"Activation\('swiglu_clamped'\).limit must be > 0; got -1.0"):
        nbx.fused_moe(x, w, ids, experts, activation=nbx.Activation("swiglu_clamped", limit=-1.0))
    with pytest.raises(ValueError, match=r"Activation\('swiglu_clamped'\).alpha must be a finite number; got nan"):
        nbx.fused_moe(x, w, ids, experts, activation=nbx.Activation("swiglu_clamped", alpha=float("nan")))
    with pytest.raises(TypeError, match="activation must be a name in .* or a jax_nbx.Activation; got 3"):
        nbx.fused_moe(x, w, ids, experts, activation=3)
    with pytest.raises(ValueError, match=r"implementation must be one of .*; got 'tpu'"):
        nbx.fused_moe(x, w, ids, experts, implementation="tpu")
    with pytest.raises(ValueError, match=r"implementation='cuda' cannot run this call: runs on a CUDA GPU"):
        nbx.fused_moe(x, w, ids, experts, implementation="cuda")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, E=8\].*got k=9"):
        nbx.route(jnp.zeros((3, 8)), k=9)
    with pytest.raises(ValueError, match=r"got k=0"):
        nbx.route(jnp.zeros((3, 8)), k=0)
    with pytest.raises(TypeError, match=r"logits must be a float array; got dtype int32"):
        nbx.route(jnp.zeros((3, 8), jnp.int32), k=2)


@pytest.mark.arm64
def test_lists_validation_names_the_expert():
    x, w, ids, ex = make_problem(5, 4, 6, 2, 128, 64)
    lists = as_lists(ex)
    bad = nbx.Experts(lists.gate, lists.up, lists.down[:5] + [jnp.zeros((64, 129))])
    with pytest.raises(ValueError, match=r"down expert 5 has shape \(64, 129\), expert 0 \(64, 128\)"):
        nbx.fused_moe(x, w, ids, bad)
    bad = nbx.Experts(lists.gate[:2] + [lists.gate[2].astype(jnp.bfloat16)] + lists.gate[3:], lists.up, lists.down)
    with pytest.raises(TypeError, match=r"gate expert 2 has dtype bfloat16, expert 0 float32"):
        nbx.fused_moe(x, w, ids, bad)
    with pytest.raises(TypeError, match="all be stacked arrays or all lists"):
        nbx.fused_moe(x, w, ids, nbx.Experts(lists.gate, ex.up, ex.down))
    with pytest.raises(ValueError, match="experts.up has 5 experts; experts.gate has 6"):
        nbx.fused_moe(x, w, ids, nbx.Experts(lists.gate, lists.up[:5], lists.down))
    with pytest.raises(ValueError, match="empty list"):
        nbx.fused_moe(x, w, ids, nbx.Experts([], [], []))
