"""jax_nbx beside what a CPU user runs today, in one process, interleaved:
PyTorch CPU's eager experts loop (transformers' MoE blocks: per hit expert,
one ``F.linear`` on the fused gate_up weight, one on down, ``index_add_``;
oneDNN underneath), XLA's ``jax.lax.ragged_dot`` (slots sorted by expert),
and the CPU's limits measured in the same run (benchmarks/peaks.py: register-only
FMA and VDPBF16PS loops on every core; a numpy copy for the weights' read rate).

    python benchmarks/peers.py                      # OLMoE and Qwen3-30B-A3B layers, the default rows
    python benchmarks/peers.py --models olmoe-1b-7b --rows prefill-bf16,decode-bf16 --rounds 5

PyTorch stays out of the test install: install a CPU wheel beside jax_nbx
(``pip install torch --index-url https://download.pytorch.org/whl/cpu``); without
it the torch columns read "-".  Rows (x and weights of one dtype; routing of
the model's router on random logits):

* ``prefill-f32`` / ``prefill-bf16``: T=512.  GFLOP/s of the routed work
  (``T*k*6*H*I``) and its ratio to the peak that bounds it (float32: the FMA
  loop; bfloat16: jax_nbx takes the VDPBF16PS kernels by default where the
  CPU has avx512_bf16, else the FMA ones).
* ``decode-f32`` / ``decode-bf16`` / ``decode8-bf16``: T=1 and T=8.  Time over the
  weight-bandwidth floor (the active experts' weight bytes / the copy's read
  rate of the same round).

The last column is each peer's max |difference| to jax_nbx's output over
jax_nbx's max |output| (bfloat16 rows: ~1e-2 is the dtype's rounding).

Each round times every contender once per row (after one untimed call
each), with a 50 ms pause before each call so that the other contenders'
idle threads have stopped spinning (OpenMP's are made passive:
``OMP_WAIT_POLICY=PASSIVE`` unless set; without both, PyTorch's spinning
threads slowed jax_nbx's decode up to 20x in this process, and XLA's
PyTorch's); the medians over the rounds are printed with ``torch ÷ nbx`` and
``ragged ÷ nbx`` (> 1: jax_nbx is faster).  ``ragged_dot`` runs on rows of at
most ``--ragged-max-tokens`` tokens (on the CPU it is a dense masked dot over
every expert: E times the routed work).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import format_table, machine, make_layer

import jax_nbx as nbx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peaks import peaks  # noqa: E402

ROWS = {"prefill-f32": (512, jnp.float32), "prefill-bf16": (512, jnp.bfloat16), "decode-f32": (1, jnp.float32),
        "decode-bf16": (1, jnp.bfloat16), "decode8-bf16": (8, jnp.bfloat16)}


def ragged_moe(x, w, ids, gate, up, down):
    """The block through three ``lax.ragged_dot`` (weights in their dtype, float32 sums)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    f32 = jnp.float32
    g = jax.lax.ragged_dot(xs, gate, sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(xs, up, sizes, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    o = jax.lax.ragged_dot(h, down, sizes, preferred_element_type=f32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), f32).at[order // k].add(o).astype(x.dtype)


def torch_block(torch, x, w, ids, gate_up, down):
    """transformers' eager experts loop (e.g. modeling_qwen3_moe.py's
    Qwen3MoeExperts.forward in 5.x), written here: gate_up [E, 2I, H], down [E, H, I]."""
    F = torch.nn.functional
    out = torch.zeros_like(x)
    E = gate_up.shape[0]
    mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero()[:, 0].tolist():
        slot, tok = torch.where(mask[e])
        cur = x[tok]
        g, u = F.linear(cur, gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(g) * u, down[e]) * w[tok, slot, None]
        out.index_add_(0, tok, h.to(x.dtype))
    return out


def _time(fn) -> float:
    time.sleep(0.05)  # the other contenders' threads go idle
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ragged-max-tokens", type=int, default=8)
    a = ap.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        torch_desc = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        torch, torch_desc = None, "torch: not installed"
    print(f"# {machine()}; {torch_desc}; jax_nbx ISA {nbx.cpu.isa()}")
    table, limits = [], {"fma_f32": [], "vdpbf16ps": []}
    src = np.ones(64 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    for model in a.models.split(","):
        m = nbx.MODELS[model]
        for row in a.rows.split(","):
            T, dt = ROWS[row]
            x, w, ids, ex = make_layer(m, T, dt)
            ex = nbx.Experts(ex.gate.astype(dt), ex.up.astype(dt), ex.down.astype(dt))
            ours = jax.jit(lambda x, w, ids, ex: nbx.fused_moe(x, w, ids, ex))
            runs = {"nbx": lambda: jax.block_until_ready(ours(x, w, ids, ex))}  # each returns its output
            if T <= a.ragged_max_tokens:
                rd = jax.jit(ragged_moe)
                runs["ragged"] = lambda: jax.block_until_ready(rd(x, w, ids, ex.gate, ex.up, ex.down))
            if torch is not None:
                tdt = torch.float32 if dt == jnp.float32 else torch.bfloat16
                tt = lambda v: torch.from_numpy(np.asarray(jnp.asarray(v, jnp.float32))).to(tdt)  # noqa: E731
                gate_up = torch.cat([tt(ex.gate).transpose(1, 2), tt(ex.up).transpose(1, 2)], 1).contiguous()
                down_t = tt(ex.down).transpose(1, 2).contiguous()
                tx, tw = tt(x), torch.from_numpy(np.asarray(w)).to(tdt)
                tids = torch.from_numpy(np.asarray(ids, np.int64))

                def run_torch():
                    with torch.no_grad():
                        return torch_block(torch, tx, tw, tids, gate_up, down_t)
                runs["torch"] = run_torch
            outs = {k: fn() for k, fn in runs.items()}  # compile / warm up; the outputs compared
            ref = np.asarray(jnp.asarray(outs["nbx"], jnp.float32))
            diff = {k: float(np.max(np.abs((o.float().numpy() if k == "torch" else
                                            np.asarray(jnp.asarray(o, jnp.float32))) - ref)) / np.max(np.abs(ref)))
                    for k, o in outs.items() if k != "nbx"}
            times = {k: [] for k in runs}
            reads = []
            for _ in range(a.rounds):
                for k, fn in runs.items():
                    times[k].append(_time(fn))
                reads.append(src.nbytes / _time(lambda: np.copyto(dst, src)))
            med = {k: statistics.median(v) for k, v in times.items()}
            time.sleep(0.2)
            pk = peaks()
            for key in limits:
                if pk[key]:
                    limits[key].append(pk[key])
            t = med["nbx"]
            if T >= 64:
                flops = T * m.k * 6 * m.H * m.I
                bound = pk["vdpbf16ps"] if dt == jnp.bfloat16 and pk["vdpbf16ps"] else pk["fma_f32"]
                perf = f"{flops / t / 1e9:.0f} GFLOP/s, {flops / t / 1e9 / bound:.2f} of peak" if bound else "-"
            else:
                nbytes = len(np.unique(np.asarray(ids))) * 3 * m.H * m.I * jnp.dtype(dt).itemsize
                perf = f"{t / (nbytes / statistics.median(reads)):.2f} x floor"
            ratio = lambda k: f"{med[k] / t:.2f}" if k in med else "-"  # noqa: E731
            agree = ", ".join(f"{k} {v:.0e}" for k, v in diff.items()) or "-"
            table.append([model, row, f"{t * 1e3:.2f}", perf,
                          f"{med['torch'] * 1e3:.2f}" if "torch" in med else "-", ratio("torch"),
                          f"{med['ragged'] * 1e3:.2f}" if "ragged" in med else "-", ratio("ragged"), agree])
            print(" | ".join(table[-1]), flush=True)
    print()
    print(format_table(["model", "row", "nbx ms", "nbx rate", "torch ms", "torch ÷ nbx", "ragged_dot ms",
                        "ragged ÷ nbx", "max diff ÷ max"], table))
    for key, vals in limits.items():
        if vals:
            print(f"# {key} loop: {min(vals):.0f}-{max(vals):.0f} GFLOP/s over the rows "
                  "(benchmarks/peaks.py, every core)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
