"""jax_nbx beside what a CPU user runs today, interleaved:
KTransformers' CPU MoE kernels (kt-kernel, in a worker process: ``--kt``), PyTorch CPU's eager
experts loop (transformers' MoE blocks: per hit expert,
one ``F.linear`` on the fused gate_up weight, one on down, ``index_add_``;
oneDNN underneath), XLA's ``jax.lax.ragged_dot`` (slots sorted by expert),
and the CPU's limits measured in the same run (benchmarks/peaks.py: register-only
FMA and VDPBF16PS loops on every core; a numpy copy for the weights' read rate).

    python benchmarks/peers.py                      # OLMoE and Qwen3-30B-A3B layers, the default rows
    python benchmarks/peers.py --models olmoe-1b-7b --rows prefill-bf16,decode-bf16 --rounds 5
    python benchmarks/peers.py --kt /tmp/ktvenv/bin/python --rows prefill-bf16,decode-bf16,prefill-int4,...

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

* ``prefill-int8`` / ``prefill-int4``, ``decode-int8`` / ``decode-int4``, ``decode8-int8`` /
  ``decode8-int4``: bf16 x, experts in jax_nbx's int8 (``nbx.quantize``) and int4 formats, timed
  with the default precision and with ``precision="int8"`` (int8 x and intermediate, as kt-kernel
  computes them).  int4 is kt-kernel's own: symmetric codes in [-7, 7], one bf16 scale per group of
  32 along K (amax / 7), which jax_nbx reads as int4 with scale s and min -8 s: the same weights,
  bit for bit, in both.  int8: each quantizes the same bf16 weights its own way.

kt-kernel (``--kt PYTHON``: a Python whose venv holds it, e.g. ``python3 -m venv /tmp/ktvenv &&
/tmp/ktvenv/bin/pip install <the CPU torch wheel> && /tmp/ktvenv/bin/pip install --no-deps
kt-kernel==0.7.2 numpy safetensors gguf``) runs in ``benchmarks/kt_peer.py`` on 1 and on 2 threads;
its columns take the better of the two.  Its waiting thread spins through a call (N + 1 busy
threads) and its idle workers spin on for 50 ms: the worker is stopped (SIGSTOP) whenever it is
not the one timed.  Its rows: bf16, int8, int4 at T <= 512 (its scratch's max_len).

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
import signal
import statistics
import sys
import tempfile
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
QROWS = {f"{r}-{f}": (T, f) for r, T in (("prefill", 512), ("decode", 1), ("decode8", 8)) for f in ("int8", "int4")}
KT_GROUP = 32  # kt-kernel 0.7.2's int4 kernel is right with groups of 32 only


def _bf16_bits(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16)).view(np.uint16)


def kt_int4(w) -> tuple[np.ndarray, np.ndarray, object]:
    """kt-kernel's int4 of one projection w [E, K, N] (jax_nbx's layout): (its packed codes
    [E, N, K/2] uint8, byte (q[2j+1] + 8) << 4 | (q[2j] + 8); its bf16 scales [E, N, K/32] as bits),
    and the same weights as jax_nbx's int4 (codes q + 8, scale s, min -8 s: exact in bf16)."""
    w = np.asarray(w, np.float32)
    E, K, N = w.shape
    g = w.reshape(E, K // KT_GROUP, KT_GROUP, N)
    amax = np.abs(g).max(2)                                            # [E, K/32, N]
    s = np.asarray(jnp.asarray(np.where(amax > 0, amax / 7, 1), jnp.bfloat16).astype(jnp.float32))
    q = (np.clip(np.rint(g / s[:, :, None, :]), -7, 7).astype(np.int8) + 8).astype(np.uint8).reshape(E, K, N)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)                           # [E, K/2, N], low nibble = even row
    kt_q = np.ascontiguousarray(np.swapaxes(packed, 1, 2))
    kt_s = np.ascontiguousarray(np.swapaxes(_bf16_bits(s), 1, 2))
    ours = nbx.QuantizedWeight(jnp.asarray(packed), jnp.asarray(s, jnp.bfloat16),
                               jnp.asarray(-8 * s, jnp.bfloat16), kind="int4", group_size=KT_GROUP)
    return kt_q, kt_s, ours


class KtPeer:
    """benchmarks/kt_peer.py in ``python`` (kt-kernel's venv), stopped (SIGSTOP) between its turns."""

    def __init__(self, python: str, folder: str):
        import subprocess
        self.dir = folder
        self.p = subprocess.Popen([python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kt_peer.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.variant = self._ask(None).get("variant")
        self.loaded = {}

    def _ask(self, msg):
        import json
        os.kill(self.p.pid, signal.SIGCONT)
        try:
            if msg is not None:
                self.p.stdin.write(json.dumps(msg) + "\n")
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"kt_peer.py ended (exit {self.p.wait()})")
            return json.loads(line)
        finally:
            if self.p.poll() is None:
                os.kill(self.p.pid, signal.SIGSTOP)

    def load(self, key, fmt, k, threads, arrays) -> None:
        """The layer in kt's layout (``arrays``: name -> array, saved for the worker), unless loaded."""
        if self.loaded.get(threads) == key:
            return
        for name, a in arrays.items():
            np.save(os.path.join(self.dir, name + ".npy"), a)
        got = self._ask({"cmd": "load", "dir": self.dir, "fmt": fmt, "k": int(k), "threads": threads})
        if "error" in got:
            raise RuntimeError(got["error"])
        self.loaded[threads] = key

    def stage(self, x, w, ids) -> None:
        np.save(os.path.join(self.dir, "x.npy"), _bf16_bits(x))
        np.save(os.path.join(self.dir, "ids.npy"), np.asarray(ids, np.int64))
        np.save(os.path.join(self.dir, "w.npy"), np.asarray(w, np.float32))

    def run(self, threads: int) -> float:
        time.sleep(0.05)
        got = self._ask({"cmd": "run", "dir": self.dir, "reps": 1, "threads": threads})
        if "error" in got:
            raise RuntimeError(got["error"])
        return got["times"][0]

    def output(self) -> np.ndarray:
        return np.load(os.path.join(self.dir, "out.npy")).astype(np.uint32).__lshift__(16).view(np.float32)

    def close(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)
        self.p.stdin.write('{"cmd": "quit"}\n')
        self.p.stdin.flush()
        self.p.wait(timeout=60)


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


def _ours(x, w, ids, ex, precision=None):
    f = jax.jit(lambda x, w, ids, ex: nbx.fused_moe(x, w, ids, ex, precision=precision))
    return lambda: jax.block_until_ready(f(x, w, ids, ex))


def _kt_bf16(ex) -> dict:
    """The experts' bf16 bits in kt-kernel's layout (nn.Linear weights: gate, up [E, I, H], down [E, H, I])."""
    return {n: np.ascontiguousarray(np.swapaxes(_bf16_bits(a), 1, 2))
            for n, a in zip(("gate", "up", "down"), (ex.gate, ex.up, ex.down))}


def _layer(m, row, with_kt: bool):
    """(T, x, w, ids, experts, quantized experts or None, kt's format and arrays or None) of a row."""
    if row in ROWS:
        T, dt = ROWS[row]
        x, w, ids, ex = make_layer(m, T, dt)
        ex = nbx.Experts(ex.gate.astype(dt), ex.up.astype(dt), ex.down.astype(dt))
        kt = ("bf16", _kt_bf16(ex)) if dt == jnp.bfloat16 and with_kt else None
        return T, x, w, ids, ex, None, kt
    T, fmt = QROWS[row]
    x, w, ids, ex = make_layer(m, T, jnp.bfloat16)
    ex = nbx.Experts(ex.gate.astype(jnp.bfloat16), ex.up.astype(jnp.bfloat16), ex.down.astype(jnp.bfloat16))
    if fmt == "int8":
        arrays = _kt_bf16(ex) if with_kt else {}
        q8 = nbx.quantize(ex, "int8", scale_dtype=jnp.bfloat16)
        return T, x, w, ids, ex, q8, ("int8", arrays) if with_kt else None
    arrays, parts = {}, []
    for n, a in zip(("gate", "up", "down"), (ex.gate, ex.up, ex.down)):
        arrays[n + "_q"], arrays[n + "_s"], ours = kt_int4(a)
        parts.append(ours)
    return T, x, w, ids, ex, nbx.Experts(*parts), ("int4", arrays) if with_kt else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join([*ROWS, *QROWS])}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ragged-max-tokens", type=int, default=8)
    ap.add_argument("--kt", default=os.environ.get("KT_PYTHON"),
                    help="a Python with kt-kernel 0.7.2 installed: its kernels beside ours (benchmarks/kt_peer.py)")
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch's eager loop out")
    a = ap.parse_args(argv)
    for row in a.rows.split(","):
        if row not in ROWS and row not in QROWS:
            ap.error(f"--rows: unknown row {row!r}; rows: {', '.join([*ROWS, *QROWS])}")
    torch = None
    try:
        if not a.no_torch:
            import torch
            torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        pass
    torch_desc = f"torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else "torch: -"
    folder = tempfile.mkdtemp(prefix="nbx_kt_")
    kt = KtPeer(a.kt, folder) if a.kt else None
    print(f"# {machine()}; {torch_desc}; jax_nbx ISA {nbx.cpu.isa()}"
          + (f"; kt-kernel 0.7.2 ({kt.variant} build)" if kt else ""), flush=True)
    table, limits = [], {"fma_f32": [], "vdpbf16ps": []}
    src = np.ones(64 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    try:
        for model in a.models.split(","):
            m = nbx.MODELS[model]
            for row in a.rows.split(","):
                T, x, w, ids, ex, qex, kt_layer = _layer(m, row, kt is not None)
                dt = x.dtype
                runs = {"nbx": _ours(x, w, ids, qex if qex is not None else ex)}  # each returns its output
                if qex is not None:
                    runs["nbx x8"] = _ours(x, w, ids, qex, "int8")
                if T <= a.ragged_max_tokens and qex is None:
                    rd = jax.jit(ragged_moe)
                    runs["ragged"] = lambda: jax.block_until_ready(rd(x, w, ids, ex.gate, ex.up, ex.down))
                if torch is not None and qex is None:
                    runs["torch"] = _torch_run(torch, x, w, ids, ex, dt)
                if kt is not None and kt_layer is not None:
                    kfmt, arrays = kt_layer
                    for n in (1, 2):
                        kt.load((model, kfmt), kfmt, m.k, n, arrays)  # (one seed: every T, the same weights)
                    kt.stage(x, w, ids)
                    for n in (1, 2):
                        runs[f"kt{n}"] = (lambda n=n: (kt.run(n), kt.output())[1])
                outs = {k: fn() for k, fn in runs.items()}  # compile / warm up; the outputs compared
                ref = np.asarray(jnp.asarray(outs["nbx"], jnp.float32))
                diff = {k: float(np.max(np.abs(_as_np(o) - ref)) / np.max(np.abs(ref)))
                        for k, o in outs.items() if k != "nbx"}
                times = {k: [] for k in runs}
                reads = []
                for _ in range(a.rounds):
                    for k, fn in runs.items():
                        if k.startswith("kt"):
                            times[k].append(kt.run(int(k[2:])))
                        else:
                            times[k].append(_time(fn))
                    reads.append(src.nbytes / _time(lambda: np.copyto(dst, src)))
                med = {k: statistics.median(v) for k, v in times.items()}
                time.sleep(0.2)
                pk = peaks()
                for key in limits:
                    if pk[key]:
                        limits[key].append(pk[key])
                table.append(_row(model, row, m, T, dt, ids, med, diff, pk, reads, qex is not None))
                print(" | ".join(table[-1]), flush=True)
    finally:
        if kt is not None:
            kt.close()
    print()
    print(format_table(["model", "row", "nbx ms", "nbx rate", "nbx x8 ms", "kt ms (1 / 2 threads)", "kt ÷ nbx",
                        "torch ms", "torch ÷ nbx", "ragged_dot ms", "ragged ÷ nbx", "max diff ÷ max"], table))
    for key, vals in limits.items():
        if vals:
            print(f"# {key} loop: {min(vals):.0f}-{max(vals):.0f} GFLOP/s over the rows "
                  "(benchmarks/peaks.py, every core)")
    return 0


def _as_np(o) -> np.ndarray:
    if hasattr(o, "float") and hasattr(o, "numpy"):  # a torch tensor
        return o.float().numpy()
    return np.asarray(jnp.asarray(o, jnp.float32))


def _torch_run(torch, x, w, ids, ex, dt):
    tdt = torch.float32 if dt == jnp.float32 else torch.bfloat16
    tt = lambda v: torch.from_numpy(np.asarray(jnp.asarray(v, jnp.float32))).to(tdt)  # noqa: E731
    gate_up = torch.cat([tt(ex.gate).transpose(1, 2), tt(ex.up).transpose(1, 2)], 1).contiguous()
    down_t = tt(ex.down).transpose(1, 2).contiguous()
    tx, tw = tt(x), torch.from_numpy(np.asarray(w)).to(tdt)
    tids = torch.from_numpy(np.asarray(ids, np.int64))

    def run():
        with torch.no_grad():
            return torch_block(torch, tx, tw, tids, gate_up, down_t)
    return run


def _row(model, row, m, T, dt, ids, med, diff, pk, reads, quantized) -> list[str]:
    """One table row: ours (the faster of the default and precision="int8" for quantized experts:
    its rate and ratios), the peers' times and ratios (kt: the better of 1 and 2 threads)."""
    best = min(med["nbx"], med.get("nbx x8", float("inf")))
    if T >= 64:
        flops = T * m.k * 6 * m.H * m.I
        bound = pk["vdpbf16ps"] if dt == jnp.bfloat16 and pk["vdpbf16ps"] else pk["fma_f32"]
        perf = f"{flops / best / 1e9:.0f} GFLOP/s, {flops / best / 1e9 / bound:.2f} of peak" if bound else "-"
    else:
        if quantized:
            nbytes = None
        else:
            nbytes = len(np.unique(np.asarray(ids))) * 3 * m.H * m.I * jnp.dtype(dt).itemsize
        perf = f"{best / (nbytes / statistics.median(reads)):.2f} x floor" if nbytes else "-"
    ms = lambda k: f"{med[k] * 1e3:.2f}" if k in med else "-"  # noqa: E731
    ratio = lambda t: f"{t / best:.2f}"  # noqa: E731
    kt = min(med.get("kt1", float("inf")), med.get("kt2", float("inf")))
    agree = ", ".join(f"{k} {v:.0e}" for k, v in diff.items()) or "-"
    return [model, row, ms("nbx"), perf, ms("nbx x8"), f"{ms('kt1')} / {ms('kt2')}" if "kt1" in med else "-",
            ratio(kt) if kt < float("inf") else "-", ms("torch"), ratio(med["torch"]) if "torch" in med else "-",
            ms("ragged"), ratio(med["ragged"]) if "ragged" in med else "-", agree]


if __name__ == "__main__":
    raise SystemExit(main())
