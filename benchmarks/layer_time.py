"""Times one model layer's fused_moe calls in this process: min and median ms.

    python benchmarks/layer_time.py qwen3-30b-a3b 512 bf16 --calls 12

For A/B runs of two builds alternated in separate processes, where a whole
table (benchmarks/cpu.py) takes too long to repeat; `JAX_NBX_PROFILE=1` adds
the handler's stage times.  Shapes and data as benchmarks/cpu.py (`make_layer`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
from bench_common import DTYPES, make_layer

import jax_nbx as nbx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=sorted(nbx.MODELS))
    p.add_argument("tokens", type=int)
    p.add_argument("dtype", choices=sorted(DTYPES))
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args()
    x, w, ids, ex = make_layer(nbx.MODELS[a.model], a.tokens, DTYPES[a.dtype])
    f = jax.jit(lambda x, w, ids: nbx.fused_moe(x, w, ids, ex))
    f(x, w, ids).block_until_ready()
    times = []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        f(x, w, ids).block_until_ready()
        times.append(time.perf_counter() - t0)
    print(f"{a.model} T={a.tokens} {a.dtype} ({nbx.cpu.isa()}): min {min(times) * 1e3:.2f} ms, "
          f"median {statistics.median(times) * 1e3:.2f} ms over {a.calls} calls")


if __name__ == "__main__":
    main()
