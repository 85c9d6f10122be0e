"""Tunes the CUDA path's GEMM tile configs on a GPU and writes them to
``jax_nbx/triton/configs/<device>.json`` (read by `jax_nbx.triton.plan.gemm_configs`,
nearest M = T·k slots).

    python benchmarks/tune_gpu.py [--models olmoe-1b-7b,...] [--tokens 16,512,4096] [--out FILE]

For each (model, T) every candidate (BM, BN, BK, warps, stages) for gemm1 and
gemm2 runs through the whole op (timed like benchmarks/gpu.py: a jitted loop,
median of 5) and the fastest is kept.  Needs a CUDA GPU; status: written
2026-11-29, NOT yet run (the session's GPU time went to the first checks).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from gpu import loop_time, ours  # noqa: E402

from jax_nbx import _bench  # noqa: E402
from jax_nbx.models import MODELS  # noqa: E402
from jax_nbx.triton import plan  # noqa: E402

CANDIDATES = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)
              for bm, bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
              if not (bm == 128 and w == 4)]


def bar(i, n, label):
    width = 30
    done = int(width * i / max(n, 1))
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:50]:50s}", end="", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral-8x7b,olmoe-1b-7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="16,128,512,4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = jax.devices("gpu")[0]
    out = Path(args.out) if args.out else plan.config_file(dev.device_kind)
    table = json.loads(out.read_text()) if out.exists() else {}
    jobs = [(MODELS[m], int(t)) for m in args.models.split(",") for t in args.tokens.split(",")]
    total = len(jobs) * len(CANDIDATES)
    step = 0
    tmp = Path(tempfile.mkdtemp()) / "candidate.json"
    os.environ["JAX_NBX_TRITON_CONFIGS"] = str(tmp)
    for m, T in jobs:
        key = f"{m.E},{m.H},{m.I},bf16"
        x, w, ids, ex = _bench.make_layer(m, T, jnp.bfloat16, seed=T)
        best = None
        for c in CANDIDATES:
            step += 1
            bar(step, total, f"{m.name} T={T} {c}")
            c2 = dict(c, BN=min(2 * c["BN"], 256))
            tmp.write_text(json.dumps({key: {str(T * m.k): [c, c2]}}))
            try:
                t = loop_time(ours, x, w, ids, ex, reps=10 if T <= 512 else 3)
            except Exception as e:  # a config that does not compile or fit: skip it
                print(f"\n  skipped {c}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if best is None or t < best[0]:
                best = (t, c, c2)
        if best:
            table.setdefault(key, {})[str(T * m.k)] = [best[1], best[2]]
            print(f"\n{m.name} T={T}: {best[0] * 1e3:.3f} ms with {best[1]} / {best[2]}")
    del os.environ["JAX_NBX_TRITON_CONFIGS"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
