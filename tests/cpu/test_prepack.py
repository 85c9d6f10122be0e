"""Prepacked experts (`jax_nbx.prepack`, abi.h "prepacked weights") on the
CPU handler: the forward reading the packed words gives the bits it gives
packing per call, on every instruction set's blocking and every layout, and
the float64 block (tests/support/layouts.py) within float32's bound; the
words are really read; a mismatch of blocking, precision or experts is
refused by name; gradients and batching are the experts'.

H and I span several K-blocks (128 rows) and tiles (256 columns), neither a
multiple of either, so every block's offset in the packed words is used.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import contract

from conftest import rel_err
from support.handlers import ffi_forward as _ffi_forward
from support.layouts import canonical, np_block, routing, stored

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU handler's prepacked words"),
              pytest.mark.sanitize]

E, K, H, I = 4, 2, 300, 520


def _layer(seed, T, name="plain", bias=False, dtype=jnp.float32, lists=False):
    rng = np.random.default_rng(seed)
    G, U, D, bg, bu, bd = canonical(rng, E, H, I, bias)
    ex = stored(name, G, U, D, bg, bu, bd, lists=lists, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    w, ids = routing(rng, T, E, K)
    return x, w, ids, ex, (G, U, D, bg, bu, bd)


@pytest.mark.parametrize("T", [1, 33, 222])
def test_prepacked_forward_is_the_packed_forward(isa, T):
    """Every instruction set's blocking: the poisoned twin reading the words
    gives the bits of the twin packing per call, and the float64 block."""
    x, w, ids, ex, canon = _layer(11 + T, T)
    packed = nbx.prepack(ex)
    args = (x, w, ids, *ex.flat())
    y = _ffi_forward(*args, poison=True, packed=packed)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_ffi_forward(*args, poison=True)))
    assert rel_err(y, np_block(x, w, ids, *canon)) <= 1e-5
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, packed)), np.asarray(y))


@pytest.mark.parametrize("case", [("out_in", False, False), ("interleaved", True, False),
                                  ("concat_out_in", True, False), ("plain", True, True)],
                         ids=["out_in", "interleaved_bias", "concat_out_in_bias", "lists_bias"])
def test_prepacked_layouts(case):
    """Experts in the checkpoint's layouts (views, biases, per-expert lists),
    bfloat16 and float16 weights under float32 arithmetic."""
    name, bias, lists = case
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x, w, ids, ex, canon = _layer(5, 222, name, bias, dtype, lists)
        packed = nbx.prepack(ex)
        y = nbx.fused_moe(x, w, ids, packed, precision="float32")
        np.testing.assert_array_equal(np.asarray(y), np.asarray(nbx.fused_moe(x, w, ids, ex, precision="float32")))
        if dtype == jnp.float32:
            assert rel_err(y, np_block(x, w, ids, *canon)) <= 1e-5
    on_input = nbx.fused_moe(x, w, ids, packed, weights_on="input")  # T*k rows of one slot each
    np.testing.assert_array_equal(np.asarray(on_input), np.asarray(nbx.fused_moe(x, w, ids, ex, weights_on="input")))


@pytest.mark.parametrize("T", [1, 33, 222])
def test_prepacked_bfloat16_pairs(isa, T):
    """precision="bfloat16": the words are the dot kernels' pairs, and the
    forward's bits are those of the pairs packed per call."""
    x, w, ids, ex, _ = _layer(7 + T, T, dtype=jnp.bfloat16)
    packed = nbx.prepack(ex, precision="bfloat16")
    assert packed.gate_up.dtype == jnp.uint32 and packed.precision == "bfloat16"
    y = _ffi_forward(x, w, ids, *ex.flat(), poison=True, bf16_dot=True, packed=packed)
    ref = _ffi_forward(x, w, ids, *ex.flat(), poison=True, bf16_dot=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, packed)), np.asarray(ref))


def test_the_words_are_read():
    """Zeroed words (header kept) zero the experts that pack; a token alone
    (its experts stream the weights in place) does not see them."""
    x, w, ids, ex, _ = _layer(3, 64)
    packed = nbx.prepack(ex)
    hdr = contract.PACKED_HEADER_WORDS
    zeroed = nbx.PackedExperts(ex, packed.gate_up.at[hdr:].set(0), packed.down, "float32")
    assert float(jnp.abs(nbx.fused_moe(x, w, ids, zeroed)).max()) == 0.0
    assert float(jnp.abs(nbx.fused_moe(x, w, ids, packed)).max()) > 0.1
    one = (x[:1], w[:1], ids[:1])
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(*one, zeroed)), np.asarray(nbx.fused_moe(*one, ex)))


def test_refusals():
    """Each mismatch is refused, naming it."""
    x, w, ids, ex, _ = _layer(9, 33)
    packed = nbx.prepack(ex)
    with pytest.raises(ValueError, match="prepacked for precision='float32'"):
        nbx.fused_moe(x, w, ids, packed, precision="bfloat16")
    with pytest.raises(ValueError, match="prepacked experts .* run on 'cpu' only"):
        nbx.fused_moe(x, w, ids, packed, implementation="xla")
    lora = nbx.LoRA.init(jax.random.PRNGKey(0), E, H, I, rank=2)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        nbx.fused_moe(x, w, ids, packed, lora=lora)
    with pytest.raises(ValueError, match="precision must be one of"):
        nbx.prepack(ex, precision="int8")
    with pytest.raises(ValueError, match="bfloat16"):
        nbx.prepack(ex, precision="bfloat16")  # float32 experts
    with pytest.raises(TypeError, match="quantized"):
        nbx.prepack(nbx.quantize(ex, "int8"))
    with pytest.raises(TypeError, match="jax_nbx.Experts"):
        nbx.prepack(ex.gate)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    with pytest.raises(TypeError, match="prepacked experts run unsharded"):
        nbx.sharded_moe(x, w, ids, packed, mesh, data_axis=None)
    hdr = contract.PACKED_HEADER_WORDS
    no_header = nbx.PackedExperts(ex, packed.gate_up.at[0].set(0), packed.down, "float32")
    with pytest.raises(Exception, match="no prepack header"):
        jax.block_until_ready(nbx.fused_moe(x, w, ids, no_header))
    other = nbx.prepack(nbx.Experts(ex.gate[:3], ex.up[:3], ex.down[:3]))
    swapped = nbx.PackedExperts(ex, other.gate_up, packed.down, "float32")
    with pytest.raises(Exception, match="packed with E 3, the kernels in use need 4"):
        jax.block_until_ready(nbx.fused_moe(x, w, ids, swapped))
    assert packed.gate_up.shape[0] > hdr


def test_instruction_set_change_is_refused():
    """Words packed for one blocking are refused under another (vector
    lanes), and packing again under it runs."""
    isas = nbx.cpu.supported_isas()
    if "generic" not in isas or len(isas) < 2:
        pytest.skip(f"one blocking here ({isas})")
    x, w, ids, ex, _ = _layer(13, 33)
    before = nbx.cpu.isa()
    packed = jax.block_until_ready(nbx.prepack(ex))  # (packed before the switch, not after)
    nbx.cpu.set_isa("generic")
    try:
        with pytest.raises(Exception, match="packed with vector lanes"):
            jax.block_until_ready(nbx.fused_moe(x, w, ids, packed))
        again = nbx.prepack(ex)
        np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, again)),
                                      np.asarray(nbx.fused_moe(x, w, ids, ex)))
    finally:
        nbx.cpu.set_isa(before)


def test_gradients_vmap_and_jit_are_the_experts():
    """jax.grad reaches the experts (the words get none), jax.vmap folds a
    batch into the tokens, and prepack runs under jax.jit."""
    x, w, ids, ex, _ = _layer(17, 33)
    packed = jax.jit(nbx.prepack)(ex)
    f = lambda x, e: nbx.fused_moe(x, w, ids, e).sum()  # noqa: E731
    gx, ge = jax.grad(f, argnums=(0, 1))(x, ex)
    px, pe = jax.grad(f, argnums=(0, 1), allow_int=True)(x, packed)
    np.testing.assert_array_equal(np.asarray(px), np.asarray(gx))
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(getattr(pe.experts, name)), np.asarray(getattr(ge, name)))
    yb = jax.vmap(lambda xx: nbx.fused_moe(xx, w, ids, packed))(jnp.stack([x, 2 * x]))
    np.testing.assert_array_equal(np.asarray(yb[1]), np.asarray(nbx.fused_moe(2 * x, w, ids, ex)))
    assert "PackedExperts(precision='float32'" in repr(packed) and packed.nbytes > 0
