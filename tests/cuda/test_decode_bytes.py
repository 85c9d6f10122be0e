"""#56: the CUDA decode path reads what it needs and no more.  Under Triton's interpreter every
load the kernels issue is counted (its unmasked lanes' bytes), by the buffer it reads: at T=1 the
weights' buffers are read once per routed expert -- each byte of the active experts' codes and
scales exactly once, none of the others' -- so a quantized format reads its own bytes, a fraction
of bf16's, in the same three launches (test_triton_interpret.py).  (The kernels' `_codes` and
`_group_tile`: before them each packed byte was loaded twice and each scale once per element.)"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="the CUDA path's kernels need Triton (pip install jax_nbx[gpu])")

import jax.numpy as jnp  # noqa: E402
from triton.runtime import interpreter as TI  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx import contract  # noqa: E402

from support import cuda_interpret, triton_interpret  # noqa: E402

E, K, H, I = 6, 2, 256, 128


def _weight_bytes_read(monkeypatch, experts, x, w, ids):
    """(bytes loaded from each weight buffer, the buffers) during one decode call."""
    ranges, counts = [], []
    run = triton_interpret.run

    def counting_run(prog, inputs, out, tables=None, workspace=None):
        inputs = [np.ascontiguousarray(a) for a in inputs]
        for a in inputs[contract.IN_GROUP0:]:
            ranges.append((a.ctypes.data, a.ctypes.data + a.nbytes, a))
            counts.append(0)
        return run(prog, inputs, out, tables, workspace)

    load = TI.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, other, *args):
        addr = ptrs.data.reshape(-1).astype(np.uint64)
        on = np.broadcast_to(mask.data, ptrs.data.shape).reshape(-1)
        size = np.dtype(TI._get_np_dtype(ptrs.get_element_ty())).itemsize
        for i, (lo, hi, _) in enumerate(ranges):
            inside = on & (addr >= lo) & (addr < hi)
            counts[i] += int(inside.sum()) * size
        return load(self, ptrs, mask, other, *args)

    monkeypatch.setattr(triton_interpret, "run", counting_run)
    monkeypatch.setattr(TI.InterpreterBuilder, "create_masked_load", counting_load)
    cuda_interpret.register()
    y = nbx.fused_moe(x, w, ids, experts, implementation="cuda-interpret")
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    return counts, [a for _, _, a in ranges]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mxfp4"])
def test_decode_reads_each_active_experts_bytes_once(monkeypatch, fmt):
    rng = np.random.default_rng(3)
    bf = jnp.bfloat16
    dense = nbx.Experts(*(jnp.asarray(rng.standard_normal(s) * 0.1, bf) for s in ((E, H, I), (E, H, I), (E, I, H))))
    experts = dense if fmt == "bf16" else nbx.quantize(dense, fmt, scale_dtype=jnp.bfloat16,
                                                       **({"group_size": 32} if fmt == "int4" else {}))
    x = jnp.asarray(rng.standard_normal((1, H)), bf)
    ids = jnp.asarray([[4, 1]], jnp.int32)
    w = jnp.asarray([[0.6, 0.4]], jnp.float32)
    counts, bufs = _weight_bytes_read(monkeypatch, experts, x, w, ids)
    # every weight buffer is stacked [E, ...] (codes of gate, up, down, then their scales, then
    # int4's mins): the two routed experts' slices -- the codes' bytes exactly once, and so every
    # group's scales; int8's per-column scales once per split-K chunk of the column (a few times)
    assert bufs and all(b.shape[0] == E for b in bufs), [b.shape for b in bufs]
    want = [K * b.nbytes // E for b in bufs]
    if fmt in ("bf16", "int4", "mxfp4", "nvfp4"):
        assert counts == want, (fmt, counts, want)
    else:
        assert counts[:3] == want[:3] and all(want[i] <= counts[i] <= 4 * want[i] for i in range(3, len(want))), \
            (fmt, counts, want)
    # a fraction of bf16's bytes: the format's bits per weight (scales included) over 16
    bits = {"bf16": 16, "int8": 8 + 16 * 4 / H, "int4": 4 + 32 / 32, "mxfp4": 4 + 8 / 32, "nvfp4": 4 + 8 / 16}[fmt]
    assert sum(counts) <= 1.02 * bits / 16 * K * 3 * H * I * 2, (fmt, sum(counts) / (K * 3 * H * I * 2))
