"""Training step (forward + backward) of one MoE layer on the CPU.

    python benchmarks/training.py [--model olmoe-1b-7b] [--tokens 512] [--dtypes f32 bf16]

For each dtype (x and weights alike): the jitted gradient of
``sum(fused_moe(x, w, ids, experts) * ct)`` with respect to x, topk_weights
and every expert projection, timed (median) for

- ours: `fused_moe` on the CPU handlers (forward handler, fused backward handler);
- ours forward alone (to show the backward / forward ratio);
- reference: ``implementation="xla"`` (sorted padded blocks, its own VJP);
- ragged_dot: an MoE written with three ``jax.lax.ragged_dot`` and its JAX VJP;
- numpy-BLAS floor: the same step as a per-expert loop of float32 BLAS GEMMs in
  numpy that saves g and u from its forward (nine GEMM-sized products per expert);
- the FLOP floor: those 18·S·H·I useful FLOPs (S = T·k slots) at the numpy
  sgemm rate measured in the same run.

Memory: the op's residuals are its inputs only (the backward recomputes g, u);
the handlers' workspace peak in the account (forward and backward), and XLA's
own temporary buffers of the compiled step (``memory_analysis``) for ours and
for ragged_dot.

``--lora R`` (issue #35's rows): LoRA adapters of rank R on gate, up and down
over frozen experts, the gradient with respect to x, topk_weights and the
adapters, timed for `fused_moe(..., lora=)` (the CPU handler on dense experts),
the same adapters written in JAX outside the op (``ragged_dot`` with the
rank-R products beside each projection), and the frozen-expert step without
adapters (the CPU handler: x and topk_weights only, no expert gradient);
with each step's memory (XLA's temporary bytes plus the handlers' workspace
peak in the account) beside the forward's.  ``--lora-dtype`` (default f32):
the adapters' dtype, float32 whatever x's as PEFT makes them by default
(``get_peft_model(..., autocast_adapter_dtype=True)``), or ``x`` for x's
dtype (16-bit adapters: XLA converts them to float32 for the handler in the
forward, and the float32 gradients back, which the memory column shows).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import DTYPES, format_table, machine, make_layer, median_time

import jax_nbx as nbx


def moe_ragged_dot(x, w, ids, experts, lora=None):
    """An MoE of three ``jax.lax.ragged_dot`` (slots sorted by expert); with
    ``lora`` (stacked `jax_nbx.LoRA`), the adapters' rank-r products beside
    each projection: the same adapters written in JAX outside the op."""
    T, k = ids.shape
    E = experts.gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)

    def proj(v, W, name):
        out = jax.lax.ragged_dot(v, W, sizes)
        pair = None if lora is None else lora.pair(name)
        if pair is None:
            return out
        return out + lora.scale(name) * jax.lax.ragged_dot(jax.lax.ragged_dot(v, pair[0], sizes), pair[1], sizes)

    h = jax.nn.silu(proj(xs, experts.gate, "gate")) * proj(xs, experts.up, "up")
    o = proj(h, experts.down, "down").astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[order // k].add(o).astype(x.dtype)


def lora_rows(m, T: int, dname: str, rank: int, repeats: int, ragged: bool = True,
              base: str = "dense", lora_dtype: str = "f32") -> list[str]:
    """Issue #35's rows: the LoRA step (fused_moe(lora=)), the same step on the
    "xla" reference, the same adapters in JAX outside the op (ragged_dot), the
    frozen-expert step without adapters; ``base``: the experts' format
    (quantized: QLoRA; ragged_dot then runs on the dequantized experts)."""
    dt = DTYPES[dname]
    x, w, ids, ex = make_layer(m, T, dt)
    dense = ex
    if base != "dense":
        ex = nbx.quantize(ex, base, group_size=64 if base == "int4" else None)
    lora = nbx.LoRA.init(jax.random.PRNGKey(3), m.E, m.H, m.I, rank,
                         dtype=dt if lora_dtype == "x" else jnp.float32)
    lora = jax.tree.map(lambda a: a + 0.01, lora)  # B != 0
    ct = jax.random.normal(jax.random.PRNGKey(1), x.shape, jnp.float32)

    def step(fn):
        def loss(x_, w_, lo_, e_, ids_, ct_):
            return jnp.sum(fn(x_, w_, ids_, e_, lo_).astype(jnp.float32) * ct_)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    ours = step(lambda x_, w_, i_, e_, lo_: nbx.fused_moe(x_, w_, i_, e_, lora=lo_))
    ref = step(lambda x_, w_, i_, e_, lo_: nbx.fused_moe(x_, w_, i_, e_, lora=lo_, implementation="xla"))
    rdot = step(lambda x_, w_, i_, e_, lo_: moe_ragged_dot(x_, w_, i_, dense, lo_))
    frozen = jax.jit(jax.grad(lambda x_, w_, e_, i_, c_: jnp.sum(
        nbx.fused_moe(x_, w_, i_, e_).astype(jnp.float32) * c_), argnums=(0, 1)))
    fwd = jax.jit(lambda x_, w_, i_, e_, lo_: nbx.fused_moe(x_, w_, i_, e_, lora=lo_))
    args = (x, w, lora, ex, ids, ct)
    def peak_of(fn):
        nbx.memory.reset_peak()
        jax.block_until_ready(fn())
        return nbx.memory.stats().get("cpu:0", {}).get("peak", 0)

    peak_step, peak_fwd = peak_of(lambda: ours(*args)), peak_of(lambda: fwd(x, w, ids, ex, lora))
    # ours and the frozen step interleaved, round by round (this VM's speed drifts
    # by tens of percent between minutes): the ratio is the median of the rounds'
    jax.block_until_ready(ours(*args)), jax.block_until_ready(frozen(x, w, ex, ids, ct))
    rounds = []
    for _ in range(repeats):
        rounds.append((median_time(lambda: ours(*args), repeats=1, warmup=0),
                       median_time(lambda: frozen(x, w, ex, ids, ct), repeats=1, warmup=0)))
    t_ours = float(np.median([o for o, _ in rounds]))
    t_frozen = float(np.median([f for _, f in rounds]))
    ratio_frozen = float(np.median([o / f for o, f in rounds]))
    t_ref = median_time(lambda: ref(*args), repeats=repeats, slow_after=10.0)
    mem_ref = temp_bytes(ref, *args)
    t_rd = median_time(lambda: rdot(*args), repeats=repeats, slow_after=10.0) if ragged else None
    backend, _ = nbx.ops.resolve(x, w, ids, ex, lora=lora)
    mem = [(temp_bytes(ours, *args) or 0) + peak_step, temp_bytes(rdot, *args) if ragged else None]
    mem_fwd = (temp_bytes(fwd, x, w, ids, ex, lora) or 0) + peak_fwd
    rd = "-" if t_rd is None else f"{t_rd * 1e3:.0f} ms"
    adt = jnp.dtype(lora.gate[0].dtype).name
    print(f"  {base} {dname} LoRA r={rank} ({adt} adapters): fused_moe(lora=) [{backend.name}] {t_ours * 1e3:.0f} ms, "
          f"xla reference {t_ref * 1e3:.0f} ms, ragged_dot + adapters {rd}, frozen step without adapters "
          f"{t_frozen * 1e3:.0f} ms", flush=True)
    return [base, dname, adt, str(rank), backend.name, f"{t_ours * 1e3:.0f}", f"{ratio_frozen:.2f}",
            f"{t_ref / t_ours:.2f}", "-" if t_rd is None else f"{t_rd / t_ours:.2f}", fmt_mb(mem[0]),
            fmt_mb(mem_ref), fmt_mb(mem[1]), fmt_mb(mem_fwd),
            "-" if None in (mem[0], mem_fwd) or not mem_fwd else f"{mem[0] / mem_fwd:.2f}"]


def numpy_step(x, w, ids, G, U, D, dy):
    """Forward and backward per active expert with float32 BLAS (saves g, u)."""
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dG, dU, dD = np.zeros_like(G), np.zeros_like(U), np.zeros_like(D)
    for e in np.unique(ids):
        t_idx, j_idx = np.nonzero(ids == e)
        a, c = x[t_idx], dy[t_idx]
        g, u = a @ G[e], a @ U[e]
        s = 1.0 / (1.0 + np.exp(-g))
        h = g * s * u
        o = h @ D[e]                                   # forward ends (y += w o)
        dw[t_idx, j_idx] = np.einsum("rh,rh->r", o, c)
        do = w[t_idx, j_idx][:, None] * c
        dD[e] = h.T @ do
        dh = do @ D[e].T
        dg = dh * u * (s + g * s * (1.0 - s))
        du = dh * g * s
        dG[e] = a.T @ dg
        dU[e] = a.T @ du
        np.add.at(dx, t_idx, dg @ G[e].T + du @ U[e].T)
    return dx, dw, dG, dU, dD


def sgemm_rate() -> float:
    a = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
    b = np.random.default_rng(1).random((2048, 2048), dtype=np.float32)
    return 2 * 2048 ** 3 / median_time(lambda: a @ b, repeats=5)


def temp_bytes(fn, *args) -> int | None:
    try:
        return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def fmt_mb(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.0f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="olmoe-1b-7b", choices=sorted(nbx.MODELS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-ragged", action="store_true", help="skip the (slow) ragged_dot step")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="only issue #35's rows: LoRA adapters of rank R (0: the training rows)")
    ap.add_argument("--lora-base", default="dense", choices=["dense", *nbx.formats.quantized_names()],
                    help="the frozen experts' format under the adapters (QLoRA: a quantized one)")
    ap.add_argument("--lora-dtype", default="f32", choices=["f32", "x"],
                    help="the adapters' dtype: float32 (PEFT's default), or x's dtype")
    a = ap.parse_args(argv)
    m = nbx.MODELS[a.model]
    T = a.tokens
    S = T * m.k
    useful = 18 * S * m.H * m.I
    print(f"machine: {machine()}; CPU kernels: {nbx.cpu.isa()}")
    rate = sgemm_rate()
    print(f"numpy sgemm 2048^3: {rate / 1e9:.1f} GFLOP/s")
    print(f"shape: {a.model} E={m.E} k={m.k} H={m.H} I={m.I}, T={T}; "
          f"step FLOPs (no recompute) {useful / 1e9:.1f} G")
    if a.lora:
        lrows = [lora_rows(m, T, d, a.lora, a.repeats, not a.skip_ragged, a.lora_base, a.lora_dtype)
                 for d in a.dtypes]
        print()
        print(format_table(["base", "dtype", "adapters", "rank", "backend", "LoRA step ms", "÷ frozen step",
                            "xla reference ÷ ours", "ragged_dot+LoRA ÷ ours",
                            "step MB: XLA temp + workspace (ours)", "XLA temp MB (reference)",
                            "XLA temp MB (ragged_dot)", "forward MB: XLA temp + workspace", "step ÷ forward"],
                           lrows))
        return
    rows = []
    for dname in a.dtypes:
        dt = DTYPES[dname]
        x, w, ids, ex = make_layer(m, T, dt)
        ct = jax.random.normal(jax.random.PRNGKey(1), x.shape, jnp.float32)

        def step(fn):
            def loss(x_, w_, e_, ids_, ct_):  # ids, ct as arguments: no constant folding
                return jnp.sum(fn(x_, w_, ids_, e_).astype(jnp.float32) * ct_)
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            return lambda x_, w_, e_: g(x_, w_, e_, ids, ct)

        ours = step(nbx.fused_moe)
        fwd = jax.jit(nbx.fused_moe)
        ref = step(lambda *args: nbx.fused_moe(*args, implementation="xla"))
        rdot = step(moe_ragged_dot)
        t_fwd = median_time(lambda: fwd(x, w, ids, ex), repeats=a.repeats)
        nbx.memory.reset_peak()
        t_ours = median_time(lambda: ours(x, w, ex), repeats=a.repeats)
        peak = nbx.memory.stats()["cpu:0"]["peak"]
        t_ref = median_time(lambda: ref(x, w, ex), repeats=a.repeats, slow_after=10.0)
        t_rd = None
        if not a.skip_ragged:
            t0 = time.perf_counter()
            jax.block_until_ready(rdot(x, w, ex))  # compile + first run
            first = time.perf_counter() - t0
            t_rd = median_time(lambda: rdot(x, w, ex), repeats=1 if first > 10 else a.repeats,
                               warmup=0)
        f32 = lambda v: np.asarray(jnp.asarray(v).astype(jnp.float32))  # noqa: E731
        npargs = (f32(x), f32(w), np.asarray(ids), f32(ex.gate), f32(ex.up), f32(ex.down), f32(ct))
        t_np = median_time(lambda: numpy_step(*npargs), repeats=a.repeats)
        # one check: our gradients vs the numpy step (float32 BLAS) on these inputs
        got = ours(x, w, ex)
        want = numpy_step(*npargs)
        err = max(float(np.max(np.abs(f32(g) - r)) / max(np.max(np.abs(r)), 1e-30))
                  for g, r in zip((got[0], got[1], got[2].gate, got[2].up, got[2].down), want))
        floor = useful / rate
        rows.append([dname, f"{t_ours * 1e3:.0f}", f"{t_ours / t_fwd:.2f}", f"{t_ref / t_ours:.1f}x",
                     "-" if t_rd is None else f"{t_rd / t_ours:.1f}x", f"{t_ours / t_np:.2f}",
                     f"{t_ours / floor:.2f}", f"{useful / t_ours / 1e9:.1f}", fmt_mb(peak),
                     fmt_mb(temp_bytes(ours, x, w, ex)),
                     "-" if a.skip_ragged else fmt_mb(temp_bytes(rdot, x, w, ex)), f"{err:.1e}"])
        print(f"  {dname}: ours {t_ours * 1e3:.0f} ms (forward {t_fwd * 1e3:.0f} ms), reference "
              f"{t_ref * 1e3:.0f} ms, ragged_dot {'-' if t_rd is None else f'{t_rd * 1e3:.0f} ms'}, "
              f"numpy {t_np * 1e3:.0f} ms, FLOP floor {floor * 1e3:.0f} ms", flush=True)
    print()
    print(format_table(["dtype", "step ms", "step / fwd", "reference / ours", "ragged_dot / ours",
                        "ours / numpy", "ours / FLOP floor", "GFLOP/s", "workspace peak MB",
                        "XLA temp MB (ours)", "XLA temp MB (ragged_dot)", "max rel err vs numpy"],
                       rows))


if __name__ == "__main__":
    main()
