"""What is the Metal handler's own (the behaviours every backend shares --
float64 on odd shapes and dtypes, activations, lists, bands, ids, budgets,
gradients, NaN -- are tests/suite/'s, with metal-sim among the backends): the
decode kernels chosen for few slots, long problems split into command
buffers under the GPU watchdog's bound, refusals by name, pinning and
staging, the pooled workspace.  On the simulated Metal device; nothing here
ran on Apple hardware."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory

from conftest import make_problem, np_moe, rel_err
from support import ffi_testing
from support.lora_checks import make_lora
from support.problems import as_lists, dense

F = ffi_testing.load()  # jax_nbx._ffi_testing: the simulated device's controls
P = nbx._registry.ffi_module()  # the product's module: the workspace formula


pytestmark = pytest.mark.usefixtures("metal_sim")  # conftest.py: the simulated device


def metal(x, w, ids, ex, **kw):
    return nbx.fused_moe(x, w, ids, ex, implementation="metal", **kw)


def test_a_budget_too_small_is_refused_with_advice():
    x, w, ids, ex = make_problem(10, 64, 4, 2, 32, 48)
    one_token = int(P.metal_forward_workspace_bytes(1, 2, 4, 32, 48))
    F.metal_sim_configure(one_token - 1, 2**30, 512)
    with pytest.raises(nbx.DeviceOOMError, match=r"on metal:0; short by .*no band split alone reaches it"):
        metal(x, w, ids, ex)
    F.metal_sim_configure(one_token * 3, 2**30, 512)  # planned into bands that fit
    assert rel_err(metal(x, w, ids, ex), np_moe(x, w, ids, ex)) < 1e-5
    whole = int(P.metal_forward_workspace_bytes(64, 2, 4, 32, 48))
    with pytest.raises(nbx.DeviceOOMError, match=r"jax_nbx account \(metal:0\) refused .* it would fit in"):
        metal(x, w, ids, ex, max_workspace_bytes=whole)  # the cap trusted, the account holds the line


@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (2, 8), (16, 1)])
def test_decode_shapes_take_the_gemv_kernels(T, k):
    """T*k <= 16 slots: the decode kernels (no ordering); matches float64 and
    runs in one command buffer."""
    x, w, ids, ex = make_problem(T * 10 + k, T, 8, k, 40, 129, routing="draws")
    before = F.metal_command_buffers()
    y = metal(x, w, ids, ex)
    assert rel_err(y, np_moe(x, w, ids, ex)) < 1e-5
    assert F.metal_command_buffers() - before == 1


def test_long_problems_are_split_into_bounded_command_buffers():
    """Each command buffer's GEMM work stays under the bound (macOS's GPU
    watchdog): with a small bound the same call runs in more command buffers,
    bit for bit the same."""
    x, w, ids, ex = make_problem(13, 200, 4, 2, 48, 40)
    before = F.metal_command_buffers()
    whole = np.asarray(metal(x, w, ids, ex))
    n_default = F.metal_command_buffers() - before
    assert n_default == 1  # the ordering, the GEMMs and the combine: the host never waits between
    tile_flops = 2 * 32 * 48 * 40 * 2  # one row tile of GEMM1 (gate and up)
    nbx.metal.set_command_buffer_flops(tile_flops)  # one row tile per command buffer
    try:
        before = F.metal_command_buffers()
        split = np.asarray(metal(x, w, ids, ex))
        n_split = F.metal_command_buffers() - before
    finally:
        nbx.metal.set_command_buffer_flops(None)
    S, E = 400, 4
    assert n_split == (S + E * 31) // 32  # the bound on the row tiles: one command buffer each
    np.testing.assert_array_equal(split, whole)
    assert rel_err(whole, np_moe(x, w, ids, ex)) < 1e-5


def test_what_the_metal_path_does_not_take_yet_is_refused_by_name():
    x, w, ids, ex = make_problem(11, 4, 4, 2, 64, 32)
    q = nbx.quantize(ex, "mxfp4")
    biased = nbx.Experts(q.gate, q.up, q.down, down_bias=jnp.zeros((4, 64)))
    with pytest.raises(ValueError, match=r"implementation='metal' cannot run this call: takes plain experts "
                                         r"\(.*no biases\); these mxfp4 experts have layout='in_out', biases"):
        metal(x, w, ids, biased)
    assert metal(x[:0], w[:0], ids[:0], ex).shape == (0, 64)
    assert metal(x[:0], w[:0], ids[:0], nbx.quantize(ex, "int8")).shape == (0, 64)


@pytest.mark.parametrize("T", [1, 33])
def test_quantized_lists_equal_stacked_bitwise(T):
    """Per-expert quantized experts (each expert's q, scale and zero their own
    buffers, pinned where they lie) give the stacked experts' bits, on the
    decode (T = 1) and GEMM (T = 33) paths; an id out of range is refused by
    name before any weight is read."""
    x, w, ids, ex = make_problem(T + 50, T, 4, 2, 64, 32)
    q = nbx.quantize(ex, "int4", group_size=32, scale_dtype=jnp.bfloat16)
    stacked = np.asarray(metal(x, w, ids, q))
    np.testing.assert_array_equal(np.asarray(metal(x, w, ids, as_lists(q))), stacked)
    assert rel_err(stacked, np_moe(x, w, ids, dense(q))) < 1e-5
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_ids\[0, 1\] = 4 is outside \[0, 4\)"):
        jax.block_until_ready(metal(x, w, ids.at[0, 1].set(4), as_lists(q)))


def test_unpinnable_weights_and_refused_staging_are_told_apart():
    """A weight array Metal cannot map is INVALID_ARGUMENT; weights that must
    be staged (Metal will not wrap their memory) into a budget that cannot
    hold them are the account's RESOURCE_EXHAUSTED, raised eagerly as
    DeviceOOMError (the table lookup reports which, no message matching); the
    copies are one request, so the call never waits on copies it holds."""
    x, w, ids, ex = make_problem(14, 4, 8, 2, 64, 128)
    F.metal_sim_configure(2**30, 16384, 512)  # maxBufferLength below one expert's 32 KiB
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"INVALID_ARGUMENT: an array of .* maxBufferLength"):
        metal(x, w, ids, ex)
    F.metal_sim_configure(2**30, 2**30, 512)
    gate = jnp.array(ex.gate, copy=True)  # XLA memory the simulated device is told it cannot wrap
    where = gate.unsafe_buffer_pointer()
    F.metal_sim_track_host(where, gate.nbytes, False)
    try:
        budget = int(P.metal_forward_workspace_bytes(4, 2, 8, 64, 128)) + 4096
        F.metal_sim_configure(budget, 2**30, 512)  # the plan fits; a staged copy (256 KiB) cannot
        with pytest.raises(nbx.DeviceOOMError, match=r"jax_nbx account \(metal:0\) refused .* of staging"):
            metal(x, w, ids, nbx.Experts(gate, ex.up, ex.down))
    finally:
        F.metal_sim_forget_host(where)
    assert memory.stats()["metal:0"]["live"] == 0


def test_command_buffer_bound_is_validated():
    with pytest.raises(TypeError, match="flops must be an int or None"):
        nbx.metal.set_command_buffer_flops(1.5)
    nbx.metal.set_command_buffer_flops(12345)
    assert nbx.metal.command_buffer_flops() == 12345
    nbx.metal.set_command_buffer_flops(None)
    assert nbx.metal.command_buffer_flops() == 2**36


def test_without_a_metal_device_the_implementation_is_refused():
    nbx.metal.use("none")
    x, w, ids, ex = make_problem(12, 4, 4, 2, 16, 24)
    with pytest.raises(ValueError, match="'metal' cannot run this call: no Metal device is active"):
        metal(x, w, ids, ex)
    nbx.metal.use("sim")


def test_lora_adapters_their_workspace_bands_and_command_buffers():
    """Adapters on Metal (moe_lora.metal): the workspace the handler takes is
    the formula's with the ranks (adapters staged, xa and g | u per row);
    bands planned under a cap give the unbanded bits; the decode path stays
    one command buffer.  (Against float64 on every format: tests/suite/test_adapters.py.)"""
    T, E, k, H, I = 64, 2, 2, 1024, 8
    ranks = (3, 2, 4)
    x, w, ids, ex = make_problem(22, T, E, k, H, I)
    lora = nbx.LoRA(**{n: make_lora(9 + r, E, H, I, r, (n,)).pair(n)  # a rank per projection
                       for n, r in zip(("gate", "up", "down"), ranks)}, scale=0.7)
    ws = int(P.metal_forward_workspace_bytes(T, k, E, H, I, *ranks))
    assert ws > int(P.metal_forward_workspace_bytes(T, k, E, H, I)) >= 2**20
    y = np.asarray(metal(x, w, ids, ex, lora=lora))
    assert memory.stats()["metal:0"]["cached"] == ws  # the pooled block: the formula's bytes
    assert rel_err(y, np_moe(x, w, ids, ex, lora=lora)) < 1e-5
    T, E, H, I = 40, 4, 64, 32  # bands and decode at a small shape (the emulation is slow)
    x, w, ids, ex = make_problem(23, T, E, k, H, I)
    lora = make_lora(6, E, H, I, 5)
    y = np.asarray(metal(x, w, ids, ex, lora=lora))
    cap = int(P.metal_forward_workspace_bytes(T // 4, k, E, H, I, 5, 5, 5))
    np.testing.assert_array_equal(np.asarray(metal(x, w, ids, ex, lora=lora, max_workspace_bytes=cap)), y)
    before = F.metal_command_buffers()
    y1 = metal(x[:3], w[:3], ids[:3], ex, lora=lora)  # 6 slots: the decode kernels
    assert F.metal_command_buffers() - before == 1
    assert rel_err(y1, np_moe(x[:3], w[:3], ids[:3], ex, lora=lora)) < 1e-5


def test_the_workspace_buffer_is_pooled_and_gives_way():
    """A workspace of 1 MiB or more goes back to the account's idle blocks
    (counted as cached), and the next call of that size takes the same
    shared-storage buffer instead of a new one; under budget pressure the
    account frees it (the simulated device releases it)."""
    T, E, k, H, I = 64, 2, 2, 1024, 8
    ws = int(P.metal_forward_workspace_bytes(T, k, E, H, I))
    assert ws >= 2**20
    x, w, ids, ex = make_problem(21, T, E, k, H, I)
    y1 = np.asarray(metal(x, w, ids, ex))
    assert memory.stats()["metal:0"]["cached"] == ws
    buffers = F.metal_sim_state()["live_buffers"]
    y2 = np.asarray(metal(x, w, ids, ex))
    assert F.metal_sim_state()["live_buffers"] == buffers  # the same buffer again, no new one
    np.testing.assert_array_equal(y1, y2)
    assert rel_err(y1, np_moe(x, w, ids, ex)) < 1e-5
    live = memory.stats()["metal:0"]["live"]
    memory.set_budget(live + ws - 1, "metal", 0)  # the idle block no longer fits: freed
    assert memory.stats()["metal:0"]["cached"] == 0
    assert F.metal_sim_state()["live_buffers"] == buffers - 1


@pytest.mark.sanitize  # (library_source.cc's line arithmetic under ASan + UBSan)
def test_a_library_the_metal_compiler_rejects_is_named_by_kernel_file(monkeypatch):
    """On Apple, newLibraryWithSource's error names lines of the embedded
    library (``program_source:LINE:COL``); the device's error names the kernel
    file and its own line (library_source.h LibraryCompileError).  The
    simulated device rejects the library as Metal would (its test hook): named,
    the call fails saying so at trace time; ``implementation=None`` where Metal
    is the default warns and runs on the next backend, the CPU handler."""
    lines = F.metal_library_source().split("\n")
    marker = lines.index("// ---- moe_gemm.metal") + 1  # its line in the library (1-based)
    F.metal_sim_reject_library("Compilation failed: \n\nprogram_source:5:3: warning: unused variable 'n'\n"
                               f"program_source:{marker + 12}:7: error: use of undeclared identifier 'flaot'\n")
    named = (r"the Metal compiler rejected the kernels' library in xla_ffi/metal/kernels/moe_gemm\.metal: "
             r"Compilation failed: \n\nxla_ffi/metal/kernels/params\.h:4:3: warning: unused variable 'n'\n"
             r"xla_ffi/metal/kernels/moe_gemm\.metal:12:7: error: use of undeclared identifier 'flaot'")
    assert re.fullmatch(named + r"\n", P.metal_prepare())
    x, w, ids, ex = make_problem(31, 6, 4, 2, 16, 24)
    with pytest.raises(RuntimeError, match="implementation='metal' failed to initialise: " + named):
        metal(x, w, ids, ex)
    monkeypatch.setattr(nbx.metal, "is_default", lambda: True)  # as on a Mac with Metal
    with pytest.warns(RuntimeWarning, match=r"the 'metal' backend failed to initialise, so implementation=None "
                                            r"goes on to the next backend: " + named):
        assert nbx.ops.resolve(x, w, ids, ex)[0].name == "cpu"
        y = nbx.fused_moe(x, w, ids, ex)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nbx.fused_moe(x, w, ids, ex, implementation="cpu")))
    # a message without library lines names the library; and once it compiles, Metal runs again
    F.metal_sim_reject_library("Compilation failed: internal error")
    assert P.metal_prepare() == ("the Metal compiler rejected the kernels' library (xla_ffi/metal/kernels/: "
                                 "params.h then the .metal files, in prelude.metal's order): Compilation failed: "
                                 "internal error")
    F.metal_sim_reject_library("")
    assert P.metal_prepare() == "" and nbx.ops.resolve(x, w, ids, ex)[0].name == "metal"
    assert rel_err(metal(x, w, ids, ex), np_moe(x, w, ids, ex)) < 1e-5
