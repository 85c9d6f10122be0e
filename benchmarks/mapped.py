"""Mapped experts (``jax_nbx.loaders.map_moe``) against copied ones (``load_moe``).

    python benchmarks/mapped.py [--rows load,decode,big,shared] [--format bf16,int4] \
        [--dir /tmp/nbx_mapped] [--cache cold,warm] [--repeats 15] [--big-gb G] \
        [--resident 4GB] [--tokens 64] [--zipf 1.1] [--shared-layers 4] [--quick]

Checkpoints are OLMoE-1B-7B-shaped (``jax_nbx.MODELS["olmoe-1b-7b"]``: H 2048,
I 1024, E 64, k 8): random weights under transformers' per-expert names
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` [out, in] and
the router ``mlp.gate.weight``; no attention or embeddings), sharded into
several safetensors files with a ``model.safetensors.index.json`` and an
``olmoe`` config.json; ``--format int4``: the same as GPTQ v1 int4 (qweight,
qzeros, scales, g_idx; group 128).  Each is written once under ``--dir``,
tensor by tensor (never held whole in memory), and reused by later runs.

Rows (one table; "mapped ÷ copied" where both exist):

  load    16 layers, each way in a fresh subprocess (clean RSS): time to
          first token = map_moe / load_moe of every layer + one decode call
          (T 1, random routing) through all layers' fused_moe; the load
          alone; peak RSS (VmHWM: ru_maxrss would count the parent's).
          ``--cache cold``: the files' pages are dropped first
          (posix_fadvise DONTNEED, no root needed); ``warm``: read once
          first.  The note gives the fraction of the files' pages in the
          page cache just before each run (mincore).  Both ways compile
          fused_moe in the first token; mapped experts are static pytree
          structure (their store's id), so each mapped layer compiles once.
  decode  one layer in this process, warm (every expert resident after one
          call that routes to all): median time of T 1 (decode) and T 512
          (prefill), mapped and copied interleaved round by round; the
          ratio is the median of the rounds' ratios.
  big     a bf16 checkpoint of ``--big-gb`` (default 1.5x MemTotal; many
          OLMoE layers), mapped whole in a subprocess with ``--resident``
          split evenly over the layers' stores, decoding ``--tokens`` tokens
          with Zipf-skewed routing (exponent ``--zipf``, a random expert
          order per layer): tokens/s after the first token, the hit rate
          (hits / (hits + misses) over every store), peak RSS against the
          resident budget.  Copied does not fit (no ratio).
  shared  two processes map the same ``--shared-layers`` layers, the first
          holding its experts resident while the second maps them too: the
          second's RSS increase over a process that only imports jax_nbx
          (and RssAnon, RssFile), against a second process that copies them.

``--quick``: H 64, I 32, E 8, k 2, 2 layers for every row (a test of the
script, under a minute).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from bench_common import format_table, machine

import jax_nbx as nbx
from jax_nbx.loaders import load_moe, map_moe, unmap
from jax_nbx.loaders.mapped import store_of_experts

BF16 = np.dtype(ml_dtypes.bfloat16)
_ST = {BF16: "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}
MB = 1 << 20


# ---------------------------------------------------------------- checkpoints

def shape_of(quick: bool) -> dict:
    if quick:
        return dict(H=64, I=32, E=8, k=2, L=2)
    m = nbx.MODELS["olmoe-1b-7b"]
    return dict(H=m.H, I=m.I, E=m.E, k=m.k, L=16)


def group_of(s: dict) -> int:
    return min(128, s["I"])


def expert_specs(s: dict, fmt: str, layer: int) -> list[tuple[str, np.dtype, tuple]]:
    """(name, dtype, shape) of one layer's tensors, router first."""
    H, I, E = s["H"], s["I"], s["E"]
    pfx = f"model.layers.{layer}.mlp."
    out = [(pfx + "gate.weight", BF16, (E, H))]
    G = group_of(s)
    for e in range(E):
        for n, K, N in (("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)):
            b = f"{pfx}experts.{e}.{n}."
            if fmt == "bf16":
                out.append((b + "weight", BF16, (N, K)))
            else:  # GPTQ v1: qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N], g_idx [K]
                out += [(b + "qweight", np.dtype(np.int32), (K // 8, N)),
                        (b + "qzeros", np.dtype(np.int32), (K // G, N // 8)),
                        (b + "scales", np.dtype(np.float16), (K // G, N)),
                        (b + "g_idx", np.dtype(np.int32), (K,))]
    return out


def nbytes(spec) -> int:
    return int(np.prod(spec[2])) * spec[1].itemsize


class Random:
    """Random tensors from a small pool per (dtype, shape, kind) (the files
    need distinct-enough bytes, not fresh ones: writing stays disk-bound)."""

    def __init__(self, s: dict, seed: int = 0, pool: int = 5):
        self.s, self.rng, self.pool, self.cache, self.i = s, np.random.default_rng(seed), pool, {}, 0

    def __call__(self, name: str, dt: np.dtype, shape: tuple) -> np.ndarray:
        kind = name.rsplit(".", 1)[-1]
        key = (kind, dt.str, shape)
        self.i += 1
        if kind == "g_idx":
            return (np.arange(shape[0]) // group_of(self.s)).astype(np.int32)
        if key not in self.cache:
            self.cache[key] = [self._make(kind, dt, shape) for _ in range(self.pool)]
        return self.cache[key][self.i % self.pool]

    def _make(self, kind, dt, shape):
        if kind in ("qweight", "qzeros"):
            return self.rng.integers(-2 ** 31, 2 ** 31, shape, dtype=np.int64).astype(np.int32)
        if kind == "scales":
            return (self.rng.random(shape, dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
        return (self.rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(dt)


def write_safetensors(path: str, specs: list, produce) -> None:
    """A safetensors file written tensor by tensor (``produce(name, dtype, shape)``)."""
    header, off = {}, 0
    for name, dt, shape in specs:
        header[name] = {"dtype": _ST[dt], "shape": list(shape), "data_offsets": [off, off + nbytes((name, dt, shape))]}
        off += nbytes((name, dt, shape))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path + ".part", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, dt, shape in specs:
            a = np.ascontiguousarray(produce(name, dt, shape), dtype=dt)
            assert a.shape == tuple(shape), (name, a.shape, shape)
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
    os.replace(path + ".part", path)


def ensure_checkpoint(folder: str, s: dict, fmt: str, layers: int, shard_bytes: int = 2 << 30) -> str:
    """The checkpoint (``layers`` layers of shape ``s``, ``fmt``) in ``folder``,
    written unless a finished one with the same spec is there."""
    spec = dict(s, L=layers, fmt=fmt, version=1)
    done = os.path.join(folder, "bench.json")
    if os.path.exists(done) and json.load(open(done)) == spec:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    layer_bytes = sum(map(nbytes, expert_specs(s, fmt, 0)))
    per = max(1, min(math.ceil(shard_bytes / layer_bytes), math.ceil(layers / 2)))  # >= 2 files
    need = layer_bytes * layers
    free = shutil.disk_usage(folder).free
    if need > free * 0.95:
        raise SystemExit(f"{folder}: the checkpoint takes {need / 1e9:.1f} GB; {free / 1e9:.1f} GB free")
    n_files, wmap, produce = math.ceil(layers / per), {}, Random(s)
    t0 = time.perf_counter()
    for i in range(n_files):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        specs = [sp for layer in range(i * per, min(layers, (i + 1) * per)) for sp in expert_specs(s, fmt, layer)]
        write_safetensors(os.path.join(folder, fname), specs, produce)
        wmap.update({sp[0]: fname for sp in specs})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": need}, "weight_map": wmap}, f)
    cfg = dict(model_type="olmoe", hidden_size=s["H"], intermediate_size=s["I"], num_experts=s["E"],
               num_experts_per_tok=s["k"], norm_topk_prob=False, hidden_act="silu", num_hidden_layers=layers)
    if fmt == "int4":
        cfg["quantization_config"] = dict(quant_method="gptq", bits=4, group_size=group_of(s), desc_act=False,
                                          sym=False, checkpoint_format="gptq")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    json.dump(spec, open(done, "w"))
    print(f"wrote {folder}: {need / 1e9:.2f} GB in {n_files} files, {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


def files_of(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


# ---------------------------------------------------------------- page cache

def drop_cache(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[str]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 * MB):
                pass


def cached_fraction(files: list[str]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where it cannot tell."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page, have, total = os.sysconf("SC_PAGE_SIZE"), 0, 0
        for f in files:
            size = os.path.getsize(f)
            n = (size + page - 1) // page
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                vec = (ctypes.c_ubyte * n)()
                rc = libc.mincore(ctypes.c_void_p(addr), size, vec)
                libc.munmap(ctypes.c_void_p(addr), size)
                if rc != 0:
                    return None
                have += sum(b & 1 for b in bytes(vec))
                total += n
            finally:
                os.close(fd)
        return have / max(total, 1)
    except (OSError, AttributeError):
        return None


# ---------------------------------------------------------------- measurements

def rss() -> dict:
    """VmRSS, RssAnon, RssFile and the peak (VmHWM) of this process, in bytes.
    Not ru_maxrss: Linux keeps it across fork + exec, so a worker's starts at
    its parent's RSS (this script's, holding the decode row's copies)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    out["peak"] = out.pop("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def routing(rng, E: int, k: int, T: int, p=None):
    ids = np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k), dtype=np.float32)
    return jnp.asarray(w / w.sum(1, keepdims=True)), jnp.asarray(ids)


def all_experts(E: int, k: int):
    """Routing that reaches every expert once (ceil(E/k) tokens)."""
    T = -(-E // k)
    return jnp.full((T, k), 1.0 / k, jnp.float32), jnp.asarray((np.arange(T * k) % E).reshape(T, k), jnp.int32)


def fused(x, w, ids, experts):
    return nbx.fused_moe(x, w, ids, experts, implementation="cpu")


def decode_step(x, w, ids, experts):
    """One layer of decode, the output rescaled (random weights would overflow over many layers)."""
    y = fused(x, w, ids, experts).astype(x.dtype)
    return y / (jnp.abs(y).max() + 1e-3)


def open_layers(folder: str, how: str, layers, resident=None) -> list:
    if how == "map":
        return [map_moe(folder, layer=i, resident_bytes=resident) for i in layers]
    out = [load_moe(folder, layer=i, progress=False) for i in layers]
    jax.block_until_ready([p.experts for p in out])
    return out


def mapped_stats(params: list) -> dict:
    tot: dict = {}
    for p in params:
        for key, v in store_of_experts(p.experts).stats().items():
            tot[key] = tot.get(key, 0) + v
    return tot


def job_ttft(a: dict) -> dict:
    """Map or load every layer, then one decode token through all of them."""
    start = rss()
    rng = np.random.default_rng(a["seed"])
    t0 = time.perf_counter()
    params = open_layers(a["dir"], a["how"], range(a["L"]))
    t_load = time.perf_counter() - t0
    x = jnp.asarray(rng.standard_normal((1, a["H"]), dtype=np.float32), jnp.bfloat16)
    for p in params:
        w, ids = routing(rng, a["E"], a["k"], 1)
        x = fused(x, w, ids, p.experts).astype(jnp.bfloat16)
    jax.block_until_ready(x)
    out = dict(load_s=t_load, ttft_s=time.perf_counter() - t0, import_rss=start["peak"], peak_rss=rss()["peak"])
    if a["how"] == "map":
        out["read_bytes"] = mapped_stats(params)["read_bytes"]
    return out


def job_big(a: dict) -> dict:
    """Map every layer (resident budget split evenly) and decode with Zipf routing."""
    start = rss()
    rng = np.random.default_rng(a["seed"])
    L, E, k = a["L"], a["E"], a["k"]
    params = open_layers(a["dir"], "map", range(L), resident=a["resident"] // L)
    p = 1.0 / np.arange(1, E + 1) ** a["zipf"]
    p /= p.sum()
    orders = [rng.permutation(E) for _ in range(L)]  # each layer's own popular experts
    x = jnp.asarray(rng.standard_normal((1, a["H"]), dtype=np.float32), jnp.bfloat16)
    f = jax.jit(decode_step)
    times = []
    for _ in range(a["tokens"]):
        t0 = time.perf_counter()
        for layer, prm in enumerate(params):
            w, ids = routing(rng, E, k, 1, p)
            x = f(x, w, jnp.asarray(orders[layer][np.asarray(ids)]), prm.experts)
        jax.block_until_ready(x)
        times.append(time.perf_counter() - t0)
    st = mapped_stats(params)
    for prm in params:
        unmap(prm.experts)
    return dict(first_s=times[0], tok_s=(len(times) - 1) / max(sum(times[1:]), 1e-9), hits=st["hits"],
                misses=st["misses"], read_bytes=st["read_bytes"], resident_bytes=st["resident_bytes"],
                import_rss=start["peak"], peak_rss=rss()["peak"])


def job_hold(a: dict) -> dict | None:
    """Map or load the layers, route to every expert (all resident), report
    RSS, and hold them until stdin closes."""
    params = open_layers(a["dir"], a["how"], range(a["L"]))
    w, ids = all_experts(a["E"], a["k"])
    x = jnp.zeros((ids.shape[0], a["H"]), jnp.bfloat16)
    jax.block_until_ready([fused(x, w, ids, p.experts) for p in params])
    out = rss()
    if a["how"] == "map":
        out["resident"] = mapped_stats(params)["resident_bytes"]
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    return None


def job_baseline(a: dict) -> dict:
    return rss()


JOBS = {"ttft": job_ttft, "big": job_big, "hold": job_hold, "baseline": job_baseline}


def subprocess_job(job: str, a: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(dict(a, job=job))],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"worker {job} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class Holder:
    """A ``hold`` worker: started, its RSS line read; ``close`` ends it."""

    def __init__(self, a: dict):
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(dict(a, job="hold"))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            raise SystemExit(f"hold worker failed (rc {self.p.returncode})")
        self.rss = json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


# ---------------------------------------------------------------- rows

def fmt_mb(b) -> str:
    return f"{b / MB:.0f} MB" if b >= 10 * MB else f"{b / MB:.2f} MB"


def ratio(m, c) -> str:
    return f"{m / c:.2f}" if c else "-"


def rows_load(args, s, fmt) -> list[list[str]]:
    folder = ensure_checkpoint(os.path.join(args.dir, f"olmoe-{s['H']}x{s['I']}x{s['E']}-L{s['L']}-{fmt}"),
                               s, fmt, s["L"])
    files, out = files_of(folder), []
    a = dict(s, dir=folder, seed=1)
    for cache in args.cache.split(","):
        res, notes = {}, []
        for how in ("map", "load"):
            if cache == "cold":
                drop_cache(files)
            else:
                warm_cache(files)
            frac = cached_fraction(files)
            notes.append(f"{how} {'?' if frac is None else f'{frac:.0%}'}")
            res[how] = subprocess_job("ttft", dict(a, how=how))
        m, c = res["map"], res["load"]
        note = f"{cache}: pages cached before: {', '.join(notes)}"
        out += [["load", fmt, f"{s['L']} layers: load s", f"{m['load_s']:.3f}", f"{c['load_s']:.3f}",
                 ratio(m["load_s"], c["load_s"]), note],
                ["load", fmt, "time to first token s", f"{m['ttft_s']:.3f}", f"{c['ttft_s']:.3f}",
                 ratio(m["ttft_s"], c["ttft_s"]), f"mapped read {fmt_mb(m['read_bytes'])}"],
                ["load", fmt, "peak RSS", fmt_mb(m["peak_rss"]), fmt_mb(c["peak_rss"]),
                 ratio(m["peak_rss"], c["peak_rss"]), f"after imports {fmt_mb(m['import_rss'])}"]]
        for r in out[-3:]:
            print(r, flush=True)
    return out


def rows_decode(args, s, fmt) -> list[list[str]]:
    folder = ensure_checkpoint(os.path.join(args.dir, f"olmoe-{s['H']}x{s['I']}x{s['E']}-L{s['L']}-{fmt}"),
                               s, fmt, s["L"])
    mapped, copied = map_moe(folder, layer=0), load_moe(folder, layer=0, progress=False)
    store = store_of_experts(mapped.experts)
    f = jax.jit(fused)
    w, ids = all_experts(s["E"], s["k"])
    jax.block_until_ready(f(jnp.zeros((ids.shape[0], s["H"]), jnp.bfloat16), w, ids, mapped.experts))
    assert store.stats()["resident_experts"] == s["E"], store.stats()
    rng, out = np.random.default_rng(2), []
    for T in (1, 512):
        x = jnp.asarray(rng.standard_normal((T, s["H"]), dtype=np.float32), jnp.bfloat16)
        w, ids = routing(rng, s["E"], s["k"], T)
        fns = {"map": lambda: f(x, w, ids, mapped.experts), "load": lambda: f(x, w, ids, copied.experts)}
        same = np.array_equal(np.asarray(fns["map"](), np.float32), np.asarray(fns["load"](), np.float32))
        misses0 = store.stats()["misses"]
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times[key].append(time.perf_counter() - t0)
        med = {key: statistics.median(v) for key, v in times.items()}
        r = statistics.median(a / b for a, b in zip(times["map"], times["load"]))
        out.append(["decode", fmt, f"1 layer warm, T {T}: median ms", f"{med['map'] * 1e3:.3f}",
                    f"{med['load'] * 1e3:.3f}", f"{r:.2f}",
                    f"{args.repeats} rounds; misses while timed {store.stats()['misses'] - misses0}; "
                    f"bits {'equal' if same else 'DIFFER'}"])
        print(out[-1], flush=True)
    unmap(mapped.experts)
    return out


def rows_big(args, s) -> list[list[str]]:
    layer_bytes = sum(map(nbytes, expert_specs(s, "bf16", 0)))
    if args.quick:
        L = s["L"]
        resident = L * 2 * store_expert_bytes(s)  # 2 of 8 experts per layer
    else:
        L = max(1, math.ceil(args.big_gb * 1e9 / layer_bytes))
        resident = nbx.memory.parse_bytes(args.resident)
    folder = ensure_checkpoint(os.path.join(args.dir, f"big-{s['H']}x{s['I']}x{s['E']}-L{L}-bf16"), s, "bf16", L)
    files = files_of(folder)
    drop_cache(files)
    frac = cached_fraction(files)
    r = subprocess_job("big", dict(s, L=L, dir=folder, seed=3, resident=resident, tokens=args.tokens,
                                   zipf=args.zipf))
    hit = r["hits"] / max(r["hits"] + r["misses"], 1)
    size = f"{L} layers, {L * layer_bytes / 1e9:.2f} GB"
    cached = "?" if frac is None else f"{frac:.0%}"
    out = [["big", "bf16", f"{size}: tokens/s", f"{r['tok_s']:.2f}", "-", "-",
            f"{args.tokens} tokens, Zipf {args.zipf}; first token {r['first_s']:.2f} s; pages cached {cached}"],
           ["big", "bf16", "hit rate", f"{hit:.1%}", "-", "-",
            f"hits {r['hits']}, misses {r['misses']}, read {fmt_mb(r['read_bytes'])}"],
           ["big", "bf16", "peak RSS", fmt_mb(r["peak_rss"]), "-", "-",
            f"resident budget {fmt_mb(resident)} ({fmt_mb(resident // L)}/layer), held at end "
            f"{fmt_mb(r['resident_bytes'])}; after imports {fmt_mb(r['import_rss'])}; "
            f"peak - imports {fmt_mb(r['peak_rss'] - r['import_rss'])}"]]
    for row in out:
        print(row, flush=True)
    return out


def store_expert_bytes(s: dict) -> int:
    return 3 * s["H"] * s["I"] * 2


def rows_shared(args, s) -> list[list[str]]:
    folder = ensure_checkpoint(os.path.join(args.dir, f"olmoe-{s['H']}x{s['I']}x{s['E']}-L{s['L']}-bf16"),
                               s, "bf16", s["L"])
    a = dict(s, dir=folder, L=min(args.shared_layers, s["L"]))
    base = subprocess_job("baseline", a)
    first = Holder(dict(a, how="map"))
    try:
        second = Holder(dict(a, how="map"))
        second.close()
        copy = Holder(dict(a, how="load"))
        copy.close()
    finally:
        first.close()
    m, c = second.rss, copy.rss
    inc = {key: (m[key] - base[key], c[key] - base[key]) for key in ("VmRSS", "RssAnon", "RssFile")}
    held = a["L"] * s["E"] * store_expert_bytes(s)
    out = [["shared", "bf16", f"{a['L']} layers: 2nd process RSS - baseline", fmt_mb(inc["VmRSS"][0]),
            fmt_mb(inc["VmRSS"][1]), ratio(*inc["VmRSS"]),
            f"experts {fmt_mb(held)}; first holds {fmt_mb(first.rss['resident'])} resident; "
            f"baseline (imports) {fmt_mb(base['VmRSS'])}"],
           ["shared", "bf16", "  of it RssAnon / RssFile",
            f"{fmt_mb(inc['RssAnon'][0])} / {fmt_mb(inc['RssFile'][0])}",
            f"{fmt_mb(inc['RssAnon'][1])} / {fmt_mb(inc['RssFile'][1])}", ratio(*inc["RssAnon"]),
            "ratio: RssAnon"]]
    for row in out:
        print(row, flush=True)
    return out


def header(args, s) -> str:
    mem = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            mem[k] = int(v.split()[0]) * 1024
    os.makedirs(args.dir, exist_ok=True)
    du = shutil.disk_usage(args.dir)
    src = subprocess.run(["df", "--output=source,fstype", args.dir], capture_output=True, text=True).stdout.split()
    return "\n".join([
        machine(),
        f"RAM {mem['MemTotal'] / 2 ** 30:.1f} GiB (available {mem.get('MemAvailable', 0) / 2 ** 30:.1f} GiB)",
        f"disk {args.dir}: {' '.join(src[-2:])}, {du.total / 2 ** 30:.0f} GiB, {du.free / 2 ** 30:.0f} GiB free",
        f"shape: OLMoE{' (quick)' if args.quick else '-1B-7B'} H {s['H']}, I {s['I']}, E {s['E']}, k {s['k']}, "
        f"{s['L']} layers; x bf16; experts {', '.join(args.format.split(','))} (int4: GPTQ v1, group "
        f"{group_of(s)}); {store_expert_bytes(s) / MB:.2f} MB per bf16 expert"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="load,decode,big,shared")
    ap.add_argument("--format", default="bf16", help="bf16, int4 or both (rows load and decode)")
    ap.add_argument("--dir", default="/tmp/nbx_mapped")
    ap.add_argument("--cache", default="cold,warm", help="page cache before the load rows: cold, warm or both")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--big-gb", type=float, default=None, help="default: 1.5 x MemTotal")
    ap.add_argument("--resident", default="4GB", help="row big: resident bytes over all layers")
    ap.add_argument("--tokens", type=int, default=64, help="row big: tokens decoded")
    ap.add_argument("--zipf", type=float, default=1.1, help="row big: Zipf exponent of the routing")
    ap.add_argument("--shared-layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="H 64, I 32, E 8, k 2, 2 layers")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        a = json.loads(args.worker)
        res = JOBS[a["job"]](a)
        if res is not None:
            print(json.dumps(res), flush=True)
        return
    s = shape_of(args.quick)
    if args.quick:
        args.dir = os.path.join(args.dir, "quick")
        args.tokens = min(args.tokens, 16)
        args.repeats = min(args.repeats, 5)
    if args.big_gb is None:
        args.big_gb = 1.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    print(header(args, s), flush=True)
    rows = []
    for r in args.rows.split(","):
        if r in ("load", "decode"):
            for fmt in args.format.split(","):
                rows += (rows_load if r == "load" else rows_decode)(args, s, fmt)
        elif r == "big":
            rows += rows_big(args, s)
        elif r == "shared":
            rows += rows_shared(args, s)
        else:
            ap.error(f"--rows: {r!r} is not one of load, decode, big, shared")
    print()
    print(header(args, s))
    print(format_table(["row", "format", "measure", "mapped", "copied", "mapped ÷ copied", "note"], rows))


if __name__ == "__main__":
    main()
