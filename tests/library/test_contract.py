"""The cross-language contract (xla_ffi/abi.h, read through jax_nbx.contract):
every consumer on the CPU side agrees with it.  (The CUDA launch program and
the Triton kernels: tests/cuda/test_program_decoder.py.)"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import _registry, contract, reference
from jax_nbx.backends import handler_calls
from jax_nbx.backends.handler_calls import forward_call

from conftest import TOL, make_problem, np_glu, np_moe, rel_err
from support import ffi_testing
from support.handlers import ffi_forward as _ffi_forward

ffi = _registry.ffi_module()
pytestmark = pytest.mark.fast


@pytest.mark.arm64
def test_target_names_are_the_abis():
    assert set(ffi.cpu_handlers()) == {contract.TARGET_FORWARD, contract.TARGET_BACKWARD, contract.TARGET_METAL_FORWARD,
                                       contract.TARGET_PREPACK}
    testing = ffi_testing.load()
    assert set(testing.handlers()) == {testing.target_forward_poisoned, testing.target_backward_poisoned}
    names = {v for v in vars(contract).values() if isinstance(v, str)}
    assert not set(testing.handlers()) & names  # no test name in the contract
    if getattr(ffi, "has_cuda", False):
        assert set(ffi.cuda_handlers()) == {contract.TARGET_CUDA_FORWARD,
                                            contract.TARGET_CUDA_FORWARD_TABLES,
                                            contract.TARGET_CUDA_BACKWARD}
    assert _registry.FORWARD_TARGET == contract.TARGET_FORWARD
    assert _registry.CUDA_FORWARD_TARGET == contract.TARGET_CUDA_FORWARD


def test_activations_are_the_abis_and_the_reference_has_each():
    assert reference.ACTIVATIONS == contract.ACTIVATIONS == ("swiglu", "geglu", "swiglu_clamped", "geglu_erf")
    g = jnp.linspace(-9.0, 9.0, 101, dtype=jnp.float32)
    u = jnp.linspace(9.0, -9.0, 101, dtype=jnp.float32)
    for name in contract.ACTIVATIONS:
        got = np.asarray(nbx.Activation(name)(g, u), np.float64)
        np.testing.assert_allclose(got, np_glu(np.asarray(g, np.float64), np.asarray(u, np.float64), name)[0],
                                   rtol=2e-6, atol=2e-6)
    # the reference's tanh-GELU uses the contract's constants
    g64 = np.linspace(-6.0, 6.0, 101)
    mine = 0.5 * g64 * (1.0 + np.tanh(contract.GELU_C * (g64 + contract.GELU_B * g64 ** 3)))
    np.testing.assert_allclose(np.asarray(nbx.Activation("geglu")(jnp.asarray(g64, jnp.float32), 1.0)),
                               mine, rtol=2e-6, atol=2e-6)
    assert contract.GELU_C == pytest.approx(np.sqrt(2.0 / np.pi), rel=1e-15)
    assert contract.INV_SQRT2 == pytest.approx(np.sqrt(0.5), rel=1e-15)
    assert (contract.CLAMPED_SWIGLU_ALPHA, contract.CLAMPED_SWIGLU_LIMIT) == (1.702, 7.0)  # gpt-oss's


def test_the_metal_kernels_spell_the_contracts_activation_constants():
    """prelude.metal cannot include abi.h (newLibraryWithSource has no include
    path): its codes and constants are checked against the contract here."""
    src = (pathlib.Path(__file__).resolve().parents[2] / "xla_ffi" / "metal" / "kernels"
           / "prelude.metal").read_text()
    assert f"{contract.GELU_C:.16g}f" in src and f"{contract.GELU_B}f" in src and f"{contract.INV_SQRT2:.16g}f" in src
    for name in ("geglu", "swiglu_clamped", "geglu_erf"):
        assert f"p.act == {contract.ACTIVATION_CODES[name]}" in src, name


@pytest.mark.parametrize("activation", list(contract.ACTIVATIONS) + [nbx.Activation("swiglu_clamped", 1.1, 0.6)])
def test_handler_reads_each_activation_code_as_the_reference_does(activation):
    x, w, ids, ex = make_problem(1, 9, 4, 2, 33, 20)
    y = nbx.fused_moe(x, w, ids, ex, activation=activation, implementation="ffi")
    assert rel_err(y, np_moe(x, w, ids, ex, activation)) < TOL["f32"]


def test_weight_groups_follow_the_abis_order():
    x, w, ids, ex = make_problem(2, 3, 4, 2, 64, 32)
    for kind in ("int8", "int4"):
        q = nbx.quantize(ex, kind, group_size=32 if nbx.formats.get(kind).grouped else None)
        groups, E, I, fmt, _, _ = handler_calls.weight_groups(q.flat(), lists=False)
        assert len(groups) == len(contract.parts_of(kind)) * len(contract.PROJECTIONS)
        for part, pname in enumerate(contract.parts_of(kind)):
            for proj, jname in enumerate(contract.PROJECTIONS):
                got = groups[contract.group_index(part, proj)][0]
                assert got is getattr(getattr(q, jname), pname)
    assert contract.parts_of(None) == ("q",) and contract.FORMAT_CODES[None] == contract.FORMAT_CODES["dense"]


def _raw_forward(x, w, ids, ex, operands=None, **overrides):
    """The CPU forward target with the operands and attributes the product
    builds (`backends.handler_calls.forward_call`), ``operands`` replaced and some
    attributes overridden as given (raw: the test chooses their types)."""
    E, H, I = ex.num_experts, ex.hidden, ex.intermediate
    problem = nbx.backends.Problem.of(ex, x.dtype, E, H, I, ids.shape[1], nbx.Activation("swiglu"))
    name, ops, attrs, out = forward_call(problem, 0, x, w, ids, (*ex.flat(), *ex.handler_biases()))
    call = jax.ffi.ffi_call(name, out, vmap_method="sequential")
    return call(*(ops if operands is None else [x, w, ids, *operands]), **dict(attrs, **overrides))


def test_attributes_are_built_from_the_contract_alone():
    """Every target's attribute names come from abi.h (NBX_TARGET_ATTRS); the
    one builder refuses a missing or an unknown name before XLA sees it."""
    assert set(contract.TARGET_ATTRIBUTES) == {
        "forward", "backward", "metal_forward",
        "cuda_forward", "cuda_forward_tables", "cuda_backward", "prepack"}
    fwd = contract.TARGET_ATTRIBUTES["forward"]
    # the prepack handler decodes the weights with the forward's attributes
    assert set(contract.TARGET_ATTRIBUTES["prepack"]) - set(fwd) == {"hidden"}
    assert fwd["activation"] == "ACT" and fwd["format"] == "FMT" and fwd["views"] == "I64S"
    assert contract.TARGET_ATTRIBUTES["metal_forward"] == fwd
    values = {n: 0 for n in fwd}
    got = contract.attributes("forward", values)
    assert got["activation"].dtype == np.int32 and got["band_tokens"].dtype == np.int64
    assert got["act_alpha"].dtype == np.float32 and got["views"].dtype == np.int64
    with pytest.raises(ValueError, match=r"missing \['views'\], unknown \['view'\]"):
        contract.attributes("forward", {**{n: 0 for n in fwd if n != "views"}, "view": 0})


def test_enum_attributes_out_of_range_are_refused_by_name():
    x, w, ids, ex = make_problem(3, 5, 4, 2, 16, 8)
    with pytest.raises(jax.errors.JaxRuntimeError, match="unknown activation code 7"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, activation=np.int32(7)))
    clamped = np.int32(contract.ACT_SWIGLU_CLAMPED)
    with pytest.raises(jax.errors.JaxRuntimeError, match="act_limit > 0; got act_alpha=1.702.*act_limit=0"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, activation=clamped, act_limit=np.float32(0)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="finite act_alpha"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, activation=clamped, act_alpha=np.float32(np.nan)))
    bad = len(contract.WEIGHT_FORMATS)  # one past the last code
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"unknown weight format code {bad}"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, format=np.int32(bad)))
    # an int64 where the contract says int32 is refused by XLA's decoder, not misread
    # (other shapes: JAX's executable cache compares attributes by value, 0 == int64 0)
    x, w, ids, ex = make_problem(3, 7, 3, 1, 12, 8)
    with pytest.raises(jax.errors.JaxRuntimeError, match="expected S32 but got S64"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, activation=np.int64(0)))


def test_weight_buffers_are_checked_against_the_format():
    x, w, ids, ex = make_problem(4, 5, 4, 2, 16, 8)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"up has shape \(4, 16, 9\); expected \(4, 16, 8\)"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, [ex.gate, jnp.zeros((4, 16, 9)), ex.down]))
    # int8 experts passed as dense: the decoder names the group count it expected
    q = nbx.quantize(ex, "int8")
    with pytest.raises(jax.errors.JaxRuntimeError, match="expected 3 dense weight buffers"):
        groups = handler_calls.weight_groups(q.flat(), False)[0]
        jax.block_until_ready(_raw_forward(x, w, ids, ex, [g[0] for g in groups]))


def test_views_and_biases_are_checked_by_the_handler():
    """abi.h "weight views": a view reaching outside its buffer, views of the
    wrong length, a bias of the wrong shape, quantized weights with views:
    each refused by name at run time, before any read."""
    x, w, ids, ex = make_problem(4, 5, 4, 2, 16, 8)
    E, H, I = 4, 16, 8
    plain = list(ex.weight_layout().views)
    bad = plain.copy()
    bad[6] = 1  # down offset 1: the last element falls outside [I, H]
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"the down view \(offset 1, strides 16, 1\)"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, views=np.asarray(bad, np.int64)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="views must hold 9 values; got 3"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, views=np.asarray(plain[:3], np.int64)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="gate and up views must share their strides"):
        v = plain.copy()
        v[4] = 1
        jax.block_until_ready(_raw_forward(x, w, ids, ex, views=np.asarray(v, np.int64)))
    biases = [jnp.zeros((E, I), jnp.float32), jnp.zeros((E, I), jnp.float32), jnp.zeros((E, H + 1), jnp.float32)]
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"the down bias must be float32 \[E=4, 16\]"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, [ex.gate, ex.up, ex.down, *biases], has_bias=True))
    with pytest.raises(jax.errors.JaxRuntimeError, match="then 3 biases"):
        jax.block_until_ready(_raw_forward(x, w, ids, ex, has_bias=True))


def test_views_are_the_abis():
    """abi.h "weight views": the fields and biases `WeightLayout` passes are
    the ones the CUDA plan reads (jax_nbx/backends/cuda/plan.py)."""
    from jax_nbx.backends.cuda import plan

    _, _, _, ex = make_problem(4, 5, 4, 2, 16, 8)
    lay = ex.weight_layout()
    assert contract.VIEW_FIELDS == ("offset", "stride_k", "stride_n")
    assert contract.NUM_BIASES == len(contract.PROJECTIONS)
    assert len(lay.views) == len(contract.VIEW_FIELDS) * len(contract.PROJECTIONS)
    assert sum(plan.plain_views(16, 8), ()) == lay.views
    assert plan.views_of(lay, 16, 8) == (plan.plain_views(16, 8), False, False)
    fused = nbx.Experts.fused(jnp.zeros((4, 16, 16)), ex.down, fusion="interleaved",
                              gate_up_bias=jnp.zeros((4, 16))).weight_layout()
    assert plan.views_of(fused, 16, 8) == (((0, 16, 2), (1, 16, 2), (0, 16, 1)), True, True)


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
def test_poisoned_twin_takes_every_format(fmt, lists):
    """The tests' NaN-filled-output twin runs every weight format and layout."""
    x, w, ids, ex = make_problem(6, 11, 5, 2, 64, 32)
    if lists:
        ex = nbx.Experts(*([a[e] for e in range(5)] for a in (ex.gate, ex.up, ex.down)))
    e = ex if fmt == "dense" else nbx.quantize(ex, fmt, group_size=32 if nbx.formats.get(fmt).grouped else None)
    y = _ffi_forward(x, w, ids, *e.flat(), activation="swiglu", band_tokens=4, lists=lists,
                     poison=True)
    assert bool(jnp.all(jnp.isfinite(y)))
    d = ex if fmt == "dense" else nbx.dequantize(e, jnp.float32)
    assert rel_err(y, np_moe(x, w, ids, d.stacked())) < TOL["f32"]
