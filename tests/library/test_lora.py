"""LoRA adapters on the experts (`jax_nbx.LoRA`, ``fused_moe(..., lora=)``):
the CPU handler with H = 1; the CPU handler's bands,
unwritten outputs and frozen experts; merging for export; the errors; the
layers' adapters.  The forward and every gradient against the float64
oracle on every backend: tests/suite/test_adapters.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

from support.handlers import ffi_backward, ffi_forward
from support.lora_checks import check_lora_grads, loss_and_grads, make_lora
from support.problems import DTYPES, TOL, f64, make_problem, np_moe, np_moe_grads, rel_err


def test_the_cpu_handler_with_hidden_size_one():
    """H = 1 (x's row map read transposed has both strides 1): the experts'
    and the adapters' gradients against the float64 oracle."""
    E, k, H, I, T = 3, 2, 1, 4, 5
    x, w, ids, ex = make_problem(0, T, E, k, H, I)
    lora = make_lora(1, E, H, I, 2)
    ct = jnp.asarray(np.random.default_rng(4).standard_normal((T, H)), jnp.float32)
    y, (dx, dw, glora, gex) = loss_and_grads(x, w, ids, ex, lora, ct, implementation="cpu")
    assert rel_err(y, np_moe(x, w, ids, ex, lora=lora)) < 1e-5
    rdx, rdw, rdG, rdU, rdD, dad = np_moe_grads(x, w, ids, ex, ct, lora=lora)
    assert rel_err(dx, rdx) < 1e-5 and rel_err(dw, rdw) < 1e-5
    for name, want in (("gate", rdG), ("up", rdU), ("down", rdD)):
        assert rel_err(getattr(gex, name), want) < 1e-5, name
    check_lora_grads(glora, dad, 1e-5)


def test_zero_B_is_the_base_and_init_follows_the_paper():
    E, k, H, I, T = 4, 2, 40, 24, 9
    x, w, ids, ex = make_problem(3, T, E, k, H, I)
    lora = nbx.LoRA.init(jax.random.key(0), E, H, I, 8, alpha=16, projections=("gate", "down"))
    assert lora.projections == ("gate", "down") and lora.scale("gate") == 2.0
    A, B = lora.gate
    assert A.shape == (E, H, 8) and B.shape == (E, 8, I) and not np.any(np.asarray(B))
    assert 0 < float(jnp.max(jnp.abs(A))) <= 1 / np.sqrt(H)
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, ex, lora=lora, implementation="xla")),
                                  np.asarray(nbx.fused_moe(x, w, ids, ex, implementation="xla")))
    # the CPU handler's adapter path (row GEMMs) against its packed kernels: the same sums
    base = nbx.fused_moe(x, w, ids, ex, implementation="cpu")
    assert rel_err(nbx.fused_moe(x, w, ids, ex, lora=lora, implementation="cpu"), f64(base)) < 1e-6
    lists = nbx.LoRA.init(jax.random.key(0), E, H, I, 2, lists=True)
    assert len(lists.down[0]) == E and lists.down[0][0].shape == (I, 2)


def test_merge_lora_equals_the_adapted_experts():
    E, k, H, I, T = 4, 2, 40, 24, 11
    x, w, ids, ex = make_problem(5, T, E, k, H, I)
    rng = np.random.default_rng(0)
    # a checkpoint layout with biases: merged into plain stacked experts, biases kept
    ck = nbx.Experts(jnp.swapaxes(ex.gate, 1, 2), jnp.swapaxes(ex.up, 1, 2), jnp.swapaxes(ex.down, 1, 2),
                     down_bias=jnp.asarray(rng.standard_normal((E, H)), jnp.float32), layout="out_in")
    lora = make_lora(1, E, H, I, 5, lists=True)
    merged = nbx.merge_lora(ck, lora)
    assert merged.layout == "in_out" and merged.gate.shape == (E, H, I) and merged.has_bias
    want = nbx.fused_moe(x, w, ids, ck, lora=lora)
    assert rel_err(nbx.fused_moe(x, w, ids, merged), f64(want)) < 1e-5
    with pytest.raises(ValueError, match="quantized; dequantize"):
        nbx.merge_lora(nbx.quantize(ex, "int8"), lora)


def test_vmap_and_weights_on_input():
    E, k, H, I, T = 4, 2, 40, 24, 6
    x, w, ids, ex = make_problem(9, 3 * T, E, k, H, I)
    lora = make_lora(2, E, H, I, 2)
    xb, wb, ib = x.reshape(3, T, H), w.reshape(3, T, k), ids.reshape(3, T, k)
    yb = jax.vmap(lambda a, b, c: nbx.fused_moe(a, b, c, ex, lora=lora))(xb, wb, ib)
    assert rel_err(yb.reshape(3 * T, H), np_moe(x, w, ids, ex, lora=lora)) < 1e-5
    # Llama-4: mlp(w * x), one scaled row per slot
    yi = nbx.fused_moe(x, w, ids, ex, lora=lora, weights_on="input")
    xs = (f64(x)[:, None, :] * f64(w)[:, :, None]).reshape(-1, H)
    ref = np_moe(xs, np.ones((xs.shape[0], 1)), np.asarray(ids).reshape(-1, 1), ex, lora=lora)
    assert rel_err(yi, ref.reshape(3 * T, k, H).sum(1)) < 1e-5


def test_backends_that_take_adapters_and_the_refusals():
    """The CPU handler takes adapters over every format, in the arithmetic the
    call would run without them (precision='bfloat16', or None where that
    takes the dot kernels: the adapters add to the base's sums); 'int8' it
    refuses by name; every built-in backend
    takes them (a backend of one's own that does not is refused by name:
    test_backends.py); CUDA refuses ranks above 64."""
    E, k, H, I, T = 4, 2, 40, 24, 3
    x, w, ids, ex = make_problem(1, T, E, k, H, I)
    lora = make_lora(0, E, H, I, 2)
    backend, problem = nbx.ops.resolve(x, w, ids, ex, lora=lora)
    assert backend.name == "cpu" and problem.lora == (
        (("gate", 2, 0.5), ("up", 2, 0.8), ("down", 2, 1.3)), False)
    assert problem.lora.ranks == (2, 2, 2) and not problem.bf16_dot
    assert nbx.ops.resolve(x, w, ids, nbx.quantize(ex, "int8"), lora=lora)[0].name == "cpu"
    with pytest.raises(ValueError, match="float32 or bfloat16 arithmetic, not precision='int8'"):
        nbx.fused_moe(x, w, ids, nbx.quantize(ex, "int8"), lora=lora, implementation="cpu", precision="int8")
    xb = x.astype(jnp.bfloat16)
    exb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), ex)
    y = nbx.fused_moe(xb, w, ids, exb, lora=lora, implementation="cpu", precision="bfloat16")
    assert rel_err(y, np_moe(xb, w, ids, exb, lora=lora)) < 1e-2
    backend, problem = nbx.ops.resolve(xb, w, ids, exb, lora=lora)
    assert backend.name == "cpu" and problem.bf16_dot == nbx.cpu.bf16_dot_by_default()
    assert all(nbx.backends.get(n).takes_lora for n in ("metal", "cuda", "cpu", "xla"))
    from support import cuda_interpret

    cuda_interpret.register()  # the CUDA kernels' rank limit (their shared memory), by name
    with pytest.raises(ValueError, match="LoRA rank 65 is above the CUDA kernels' 64"):
        nbx.fused_moe(x, w, ids, ex, lora=make_lora(0, E, H, I, 65), implementation="cuda-interpret")


@pytest.mark.sanitize
@pytest.mark.parametrize("x_dtype, fmt", [("f32", None), ("bf16", None), ("f32", "int8"), ("bf16", "int4")])
def test_cpu_handler_bands_unwritten_outputs_and_frozen_experts(x_dtype, fmt):
    """The CPU handler with adapters: every output written (NaN twins),
    banded results bit for bit the unbanded ones, the adapters' gradients
    the same with and without the experts' (frozen: ``weight_grads`` off;
    quantized experts are always frozen), and ``jax.grad`` over the adapters
    alone asks for no expert gradient."""
    E, k, H, I, T = 5, 2, 40, 24, 33
    if fmt == "int4":  # groups of 32 rows (its smallest) of H and I
        H, I = 64, 32
    x, w, ids, ex = make_problem(4, T, E, k, H, I, x_dtype=DTYPES[x_dtype])
    if fmt is not None:
        ex = nbx.quantize(ex, fmt, group_size=32 if fmt == "int4" else None)
    ids = ids.at[:, 0].set(jnp.where(ids[:, 1] == 4, 3, 4))  # expert 4 busy; expert 0 may be idle
    ids = ids.at[:, 1].set(jnp.where(ids[:, 0] == 0, 1, ids[:, 1]))
    ids = jnp.where(ids == 0, 2, ids)  # expert 0 idle: its gradients must be zeros, not NaN
    lora = make_lora(5, E, H, I, 3)
    arrays = ex.flat()
    y = ffi_forward(x, w, ids, *arrays, poison=True, lora=lora)
    assert rel_err(y, np_moe(x, w, ids, ex, lora=lora)) < TOL[x_dtype]
    np.testing.assert_array_equal(np.asarray(ffi_forward(x, w, ids, *arrays, band_tokens=7, lora=lora)),
                                  np.asarray(y))
    dy = jnp.asarray(np.random.default_rng(3).standard_normal((T, H)), x.dtype)
    train = fmt is None
    full = ffi_backward(dy, x, w, ids, *arrays, poison=True, lora=lora, weight_grads=train)
    frozen = ffi_backward(dy, x, w, ids, *arrays, poison=True, lora=lora, weight_grads=False)
    banded = ffi_backward(dy, x, w, ids, *arrays, band_tokens=5, lora=lora, weight_grads=train)
    assert frozen[2] == [] and len(full[3]) == 6 and len(full[2]) == (3 if train else 0)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(banded)):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, c in zip(full[3], frozen[3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert not np.any(np.asarray(full[3][0][0]))  # idle expert 0: dA of gate zero
    rdx, rdw, *_, dad = np_moe_grads(x, w, ids, ex, f64(dy), lora=lora)
    gtol = 1e-5 if x_dtype == "f32" else 2e-2
    assert rel_err(full[0], rdx) < gtol and rel_err(full[1], rdw) < gtol
    for i, name in enumerate(("gate", "up", "down")):
        assert rel_err(full[3][2 * i], dad[name][0]) < gtol and rel_err(full[3][2 * i + 1], dad[name][1]) < gtol
    hlo = jax.jit(jax.grad(lambda lo: jnp.sum(nbx.fused_moe(x, w, ids, ex, lora=lo).astype(jnp.float32)))
                  ).lower(lora).as_text()
    assert "nbx_fused_moe_bwd" in hlo and "weight_grads = false" in hlo


@pytest.mark.sanitize
def test_the_handler_checks_the_adapters_it_is_given():
    """Adapters that reach the handler malformed (the library checks them
    before: this is the handler's own check) are refused by name."""
    E, k, H, I, T = 4, 2, 40, 24, 3
    x, w, ids, ex = make_problem(1, T, E, k, H, I)
    lora = make_lora(0, E, H, I, 2, projections=("down",))
    bad = nbx.LoRA(down=(lora.down[0], lora.down[1][:, :, :7]), scale=1.0)
    from jax_nbx.backends import handler_calls
    p = nbx.ops.resolve(x, w, ids, ex, lora=lora)[1]
    name, operands, attrs, out = handler_calls.forward_call(p, 0, x, w, ids, ex.flat(), lora=bad)
    want = r"the down adapter's B must be float32 \[4, 2, 40\], got \(4, 2, 7\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=want):
        jax.ffi.ffi_call(name, out)(*operands, **attrs).block_until_ready()


def test_bad_adapters_are_refused_by_name():
    E, k, H, I, T = 4, 2, 40, 24, 3
    x, w, ids, ex = make_problem(1, T, E, k, H, I)
    good = make_lora(0, E, H, I, 2)
    A, B = good.gate

    def call(lora):
        return nbx.fused_moe(x, w, ids, ex, lora=lora)

    cases = [
        (nbx.LoRA(gate=(A[:3], B[:3])), ValueError, r"lora.gate A has shape \(3, 40, 2\); expected \[E=4"),
        (nbx.LoRA(gate=(A, B[:, :, :5])), ValueError,
         r"lora.gate B has per-expert shape \(2, 5\); expected \[r=2, 24\]"),
        (nbx.LoRA(down=(A, B)), ValueError, r"lora.down A has per-expert shape \(40, 2\); expected \[24, r\]"),
        (nbx.LoRA(gate=(A.astype(jnp.int32), B)), TypeError, r"lora.gate A has dtype \['int32'\]"),
        (nbx.LoRA(gate=(list(A), B)), TypeError, "all stacked arrays or all per-expert lists"),
        (nbx.LoRA(gate=(list(A)[:3], list(B)[:3])), ValueError, "list of 3 arrays; expected E=4"),
        ("adapters", TypeError, "lora must be a jax_nbx.LoRA or None; got str"),
    ]
    for lora, err, msg in cases:
        with pytest.raises(err, match=msg):
            call(lora)
    with pytest.raises(ValueError, match="adapt at least one"):
        nbx.LoRA()
    with pytest.raises(ValueError, match=r"unknown projections \['proj'\]"):
        nbx.LoRA(gate=(A, B), scale={"proj": 1.0})
    with pytest.raises(ValueError, match=r"it names \['gate'\], the adapters are on \['up'\]"):
        nbx.LoRA(up=(A, B), scale={"gate": 2.0})
    for bad in (float("nan"), float("inf"), "2", True, None, [1.0]):
        with pytest.raises(ValueError, match="scale of gate must be a finite number"):
            nbx.LoRA(gate=(A, B), scale=bad)
    with pytest.raises(ValueError, match="scale of down must be a finite number; got 'x'"):
        nbx.LoRA(gate=(A, B), down=(A, B), scale={"gate": 1.0, "down": "x"})
    with pytest.raises(TypeError, match=r"up must be an \(A, B\) pair"):
        nbx.LoRA(up=A)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        nbx.LoRA.init(jax.random.key(0), E, H, I, 0)
    with pytest.raises(ValueError, match="projections must be a non-empty subset"):
        nbx.LoRA.init(jax.random.key(0), E, H, I, 2, projections=("w1",))


def test_layers_hold_adapters_and_freeze_their_base():
    """NNXMoE / EqxMoE with lora_rank: start equal to the base (B = 0); the
    gradient reaches the adapters and the router, not the base experts."""
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    from jax_nbx import nn

    c = nn.MoEConfig(hidden_size=40, intermediate_size=24, num_experts=4, top_k=2)
    x = jax.random.normal(jax.random.key(1), (2, 5, 40))
    layer = nn.NNXMoE(c, rngs=nnx.Rngs(0), lora_rank=4, lora_alpha=8.0)
    base = nn.NNXMoE(c, rngs=nnx.Rngs(0))
    assert layer.params().lora.scale("up") == 2.0
    assert rel_err(layer(x)[0], f64(base(x)[0])) < 1e-6
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(layer)
    assert set(nnx.to_pure_dict(grads)) == {"lora", "router"}
    assert isinstance(layer.experts.gate, nnx.Variable) and not isinstance(layer.experts.gate, nnx.Param)

    m = nn.EqxMoE(c, key=jax.random.key(0), lora_rank=2, lora_projections=("down",))
    assert m.params.lora.projections == ("down",)
    # the adapters' random bits are not the experts' (an independent initialisation)
    A, W = np.asarray(m.params.lora.down[0]).ravel(), np.asarray(m.params.experts.down).ravel()
    assert abs(np.corrcoef(A, W[:A.size])[0, 1]) < 0.2
    trainable, frozen = eqx.partition(m, m.trainable())
    assert trainable.params.experts.gate is None and trainable.params.lora.down[1] is not None
    g = eqx.filter_grad(lambda t, f: jnp.sum(eqx.combine(t, f)(x)[0] ** 2))(trainable, frozen)
    assert float(jnp.max(jnp.abs(g.params.lora.down[1]))) > 0  # dB (A random, B = 0: dA = 0)
    full = eqx.filter_grad(lambda mm: jnp.sum(mm(x)[0] ** 2))(m)
    assert not np.any(np.asarray(full.params.experts.gate))  # the call stops the base's gradient
