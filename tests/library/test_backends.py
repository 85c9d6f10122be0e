"""The backend seam (jax_nbx.backends): what ``implementation=`` names, the
default's order, every backend's reason when it cannot run a call, and a
backend of one's own."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import backends

from conftest import make_problem

pytestmark = pytest.mark.fast


def _chosen(*args, **kw) -> str:
    return nbx.ops.resolve(*args, **kw)[0].name


def test_the_cpu_handler_is_the_default_on_the_cpu():
    x, w, ids, ex = make_problem(8, 33, 8, 2, 65, 33)
    assert _chosen(x, w, ids, ex) == "cpu" and _chosen(x, w, ids, ex, implementation="ffi") == "cpu"
    np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, ex)),
                                  np.asarray(nbx.fused_moe(x, w, ids, ex, implementation="cpu")))
    assert backends.DEFAULT_ORDER == ("metal", "cuda", "cpu", "xla")
    assert set(backends.IMPLEMENTATIONS) == {"xla", "cpu", "cuda", "metal", "ffi"}


def test_a_backend_that_cannot_run_a_call_says_why():
    x, w, ids, ex = make_problem(9, 4, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="implementation='cuda' cannot run this call: runs on a CUDA GPU; "
                                         "the default backend is 'cpu'"):
        nbx.fused_moe(x, w, ids, ex, implementation="cuda")
    with pytest.raises(ValueError, match=r"implementation must be one of \('metal', 'cuda', 'cpu', 'xla'.*'ffi'\) "
                                         r"or None; got 'tpu'"):
        nbx.fused_moe(x, w, ids, ex, implementation="tpu")
    # None, and no backend can: every backend's reason (the reference refuses bf16 dot products)
    with pytest.raises(ValueError, match=r"(?s)no jax_nbx backend can run this call:.*metal: .*cuda: runs on a "
                                         r"CUDA GPU.*cpu: precision='bfloat16' needs dense bfloat16 experts; "
                                         r"these are float32.*xla: precision='bfloat16' runs on the CPU"):
        nbx.fused_moe(x, w, ids, ex, precision="bfloat16")


@pytest.mark.parametrize("fmt,G", [("mxfp4", 32), ("fp8", 32), ("mxfp8", 32), ("nvfp4", 16)])
def test_every_backend_takes_every_format_and_one_without_kernels_is_refused_by_name(fmt, G, monkeypatch):
    """The microscaling and FP8 formats have CPU, CUDA (Triton `_wtile`) and
    Metal kernels and the reference: no backend refuses them.  A format the
    Triton kernels had no branch for (plan.kernels_formats) would be refused
    naming it, so the default would fall through to a backend that has one."""
    from jax_nbx.backends.cuda import plan

    from support.cuda_interpret import InterpretedCuda

    x, w, ids, ex = make_problem(9, 4, 4, 2, 64, 32)
    q = nbx.quantize(ex, fmt, group_size=G)
    problem = nbx.backends.Problem.of(q, x.dtype, 4, 64, 32, 2, nbx.Activation("swiglu"))
    assert problem.quant == (fmt, G)
    assert plan.kernels_refusal(problem.quant, True, False) == "" == InterpretedCuda().why_not(problem)
    from support import ffi_testing

    if not ffi_testing.metal_sim_unavailable():
        with ffi_testing.metal_sim():
            assert backends.get("metal").why_not(problem) == ""
    assert backends.get("cpu").why_not(problem) == "" and backends.get("xla").why_not(problem) == ""
    assert _chosen(x, w, ids, q) == "cpu"
    known = {c: n for c, n in plan.kernels_formats().items() if n != fmt}
    monkeypatch.setattr(plan, "kernels_formats", lambda: known)
    assert f"no tile dequantization for '{fmt}' weights" in plan.kernels_refusal(problem.quant, True, False)
    assert f"no tile dequantization for '{fmt}'" in InterpretedCuda().why_not(problem)
    with pytest.raises(ValueError, match=f"no tile dequantization for '{fmt}' weights"):
        plan.build(4, 4, 2, 4, 64, 32, np.float32, np.float32, 0, quant=(fmt, G))


def test_the_default_takes_metal_only_where_it_is_the_platforms_own(monkeypatch):
    """None picks "metal" only on macOS arm64 with Metal itself active (never
    the simulated device), and only for what it takes."""
    from jax_nbx.backends.metal import MetalBackend

    x, w, ids, ex = make_problem(12, 4, 4, 2, 16, 24)
    assert not nbx.metal.is_default() and _chosen(x, w, ids, ex) == "cpu"
    monkeypatch.setattr(nbx.metal, "is_default", lambda: True)  # as on a Mac with Metal
    monkeypatch.setattr(nbx.metal, "available", lambda: True)
    monkeypatch.setattr(MetalBackend, "initialise", lambda self: "")  # (its kernels' library compiled)
    assert _chosen(x, w, ids, ex) == "metal"
    assert _chosen(x, w, ids, nbx.quantize(ex, "int8")) == "metal"
    biased = nbx.Experts(ex.gate, ex.up, ex.down, down_bias=jnp.zeros((4, 16)))
    assert _chosen(x, w, ids, biased) == "cpu"  # layouts, biases: not on Metal yet


def test_a_backend_that_fails_to_initialise_is_an_error_by_name_and_skipped_with_a_warning_by_default(
        monkeypatch):
    """`Backend.initialise` readies the chosen backend (Metal: its kernels'
    library compiled, which Apple's compiler may reject).  Named, its failure
    is an error; ``implementation=None`` warns, saying why, and goes on to the
    next backend (tests/metal/test_metal_handler.py: the same through the
    simulated device rejecting the library)."""
    from jax_nbx.backends.metal import MetalBackend

    why = "the Metal compiler rejected the kernels' library in xla_ffi/metal/kernels/moe_gemm.metal: ..."
    monkeypatch.setattr(nbx.metal, "is_default", lambda: True)  # as on a Mac with Metal
    monkeypatch.setattr(nbx.metal, "available", lambda: True)
    monkeypatch.setattr(MetalBackend, "initialise", lambda self: why)
    x, w, ids, ex = make_problem(14, 4, 4, 2, 16, 24)
    with pytest.raises(RuntimeError, match=r"implementation='metal' failed to initialise: the Metal compiler "
                                           r"rejected the kernels' library in xla_ffi/metal/kernels/moe_gemm\.metal"):
        nbx.ops.resolve(x, w, ids, ex, implementation="metal")
    with pytest.warns(RuntimeWarning, match=r"the 'metal' backend failed to initialise, so implementation=None goes "
                                            r"on to the next backend: the Metal compiler rejected"):
        assert _chosen(x, w, ids, ex) == "cpu"
    # when no other backend can run the call, the failure is among the reasons
    for name in ("cpu", "xla"):
        monkeypatch.setattr(type(backends.get(name)), "why_not_by_default", lambda self, problem: "refused here")
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match=r"(?s)no jax_nbx backend can run this call:"
                                                                      r"\n  metal: failed to initialise: the Metal "
                                                                      r"compiler rejected.*cpu: refused here"):
        nbx.ops.resolve(x, w, ids, ex)


def test_a_build_without_the_cuda_handler_says_why(monkeypatch):
    """The CUDA path's reason is the build's own (cmake/optional_backend.cmake
    writes it into the module: built with NBX_CUDA=OFF, no nvcc, or its
    sources failed to compile, with the compiler's first error)."""
    from jax_nbx import _registry

    class _Built:  # a module whose CUDA handler failed to compile
        has_cuda = False
        cuda_not_built = ("the CUDA handler failed to compile when jax_nbx was built: xla_ffi/cuda/runner.cc(12): "
                          "error: identifier \"CUstream\" is undefined; the build's CMake output has the first errors")

    monkeypatch.setattr(_registry, "_ffi", _Built)
    assert _registry.cuda_unavailable_reason() == _Built.cuda_not_built


class _Doubling(backends.Backend):
    """A backend of one's own: the reference, doubled."""

    name = "doubling"
    traced_by_jax = True

    def why_not(self, problem):
        return "" if problem.quant is None else "dense experts only"

    def why_not_by_default(self, problem):
        return "named only"

    def forward(self, problem, band_tokens, x, w, ids, experts):
        return 2 * nbx.moe_reference(x, w, ids, experts, problem.activation)


def test_a_backend_of_ones_own_is_registered_and_named():
    if "doubling" not in backends.names():
        backends.register(_Doubling())
    with pytest.raises(ValueError, match="a backend named 'doubling' exists"):
        backends.register(_Doubling())
    with pytest.raises(TypeError, match="backend must be a jax_nbx.backends.Backend"):
        backends.register(object())
    x, w, ids, ex = make_problem(13, 6, 4, 2, 16, 8)
    y = nbx.fused_moe(x, w, ids, ex, implementation="doubling")
    np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(nbx.fused_moe(x, w, ids, ex, implementation="xla")),
                               rtol=1e-6)
    assert _chosen(x, w, ids, ex) == "cpu"  # never the default: it says so
    with pytest.raises(ValueError, match="implementation='doubling' cannot run this call: dense experts only"):
        nbx.fused_moe(x, w, ids, nbx.quantize(ex, "int8"), implementation="doubling")
    with pytest.raises(ValueError, match=r"'doubling' cannot run this call: LoRA adapters \(lora=\) run on "
                                         r"'metal', 'cuda', 'cpu', 'xla'"):  # (takes_lora False)
        nbx.fused_moe(x, w, ids, ex, lora=nbx.LoRA.init(jax.random.key(0), 4, 16, 8, 2), implementation="doubling")


def test_a_setting_read_when_a_call_is_traced_is_read_again_on_the_next_trace(monkeypatch):
    """The CUDA handlers' id check, graphs, decode limits and tile configs come
    from the environment when a call is traced: the op's function is cached
    per static key (transforms.op), and a call of the same shapes traced
    after a change must still reach the backend's forward and see it."""
    from jax_nbx import _env
    from jax_nbx.backends.cpu import CpuBackend

    seen = []
    forward = CpuBackend.forward

    def spy(self, *a, **kw):
        seen.append(_env.cuda_check_ids())
        return forward(self, *a, **kw)

    monkeypatch.setattr(CpuBackend, "forward", spy)
    x, w, ids, ex = make_problem(31, 3, 4, 2, 16, 8, jnp.float32, jnp.float32)
    for mode in ("sync", "deferred", "sync"):
        monkeypatch.setenv("JAX_NBX_CUDA_CHECK_IDS", mode)
        f = jax.jit(lambda x: nbx.fused_moe(x, w, ids, ex, implementation="cpu"))  # a new trace each time
        f(x).block_until_ready()
    assert seen[-2:] == ["deferred", "sync"]


@pytest.mark.parametrize("var, values", [("JAX_NBX_CUDA_CHECK_IDS", ("sync", "deferred")),
                                         ("JAX_NBX_CUDA_GRAPHS", ("0", "1")),
                                         ("JAX_NBX_CUDA_DECODE_SLOTS", ("16", "4")),
                                         ("JAX_NBX_CUDA_DECODE_PROGRAMS", ("1024", "64")),
                                         ("JAX_NBX_TRITON_CONFIGS", ("", "/tmp/tiles.json"))])
def test_a_changed_trace_setting_is_another_problem_and_another_op(monkeypatch, var, values):
    """On an H200 (2026-12-04, jax 0.11.2) the deferred id check's bad call failed with the synchronous
    check's message: it ran with the synchronous check.  The setting is read when a call is traced, but
    the op's functions are cached per (backend, problem, band) (`transforms.op`) and the problem did not
    hold the setting: a call of the same shapes traced after ``JAX_NBX_CUDA_CHECK_IDS=deferred`` was set
    got the function made under the old value, and with it any trace JAX keeps of that function (the
    likely cause there; jax 0.10.2 here re-traces, and 0.11.2 is not in this machine's registry, so
    the GPU rerun is what confirms it).  Every setting read at trace time is now part of the problem:
    another value, another op."""
    from jax_nbx import transforms

    x, w, ids, ex = make_problem(31, 3, 4, 2, 16, 8, jnp.float32, jnp.float32)
    seen = []
    for v in values:
        monkeypatch.setenv(var, v)
        backend, problem = nbx.ops.resolve(x, w, ids, ex, implementation="cpu")
        seen.append((problem, transforms.op(backend, problem, 3)))
    (p1, op1), (p2, op2) = seen
    assert p1 != p2 and op1 is not op2
    monkeypatch.setenv(var, values[0])
    backend, problem = nbx.ops.resolve(x, w, ids, ex, implementation="cpu")
    assert problem == p1 and transforms.op(backend, problem, 3) is op1     # the same setting: the cached op


def test_backends_option_names_a_runner_by_its_own_id_or_a_prefix():
    """``--backends``: a runner's own id names it alone ("cuda" is the GPU's,
    not also "cuda-interpret"); another prefix names every runner it starts
    ("cpu": each instruction set's); a name that matches none is refused."""
    from support.runners import selected

    assert [r.id for r in selected("cuda")] == ["cuda"]
    assert [r.id for r in selected("cuda-interpret,xla")] == ["xla", "cuda-interpret"]
    assert [r.id for r in selected("cpu")] == ["cpu-avx512", "cpu-avx2", "cpu-generic"]
    with pytest.raises(ValueError, match="'gpu'.*match no runner"):
        selected("gpu")
