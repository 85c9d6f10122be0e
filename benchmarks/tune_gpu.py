"""Tunes the CUDA path's GEMM tile configs on a GPU and writes them to
``jax_nbx/backends/cuda/configs/<device>.json`` (read by `jax_nbx.backends.cuda.tile_configs.gemm_configs`,
nearest M = T·k slots).

    python benchmarks/tune_gpu.py [--models olmoe-1b-7b,...] [--tokens 4096,512] [--budget-seconds 240]
                                  [--out FILE]

For each (model, T) the candidate (BM, BN, BK, warps, stages) configs for
gemm1 (gemm2: the same BM, BK, warps and stages, BN doubled up to 256) run
through the whole op, timed like benchmarks/gpu.py (a jitted loop, median of
5); the defaults run first, so every job reports "default ms -> best ms".
Candidates whose row block is more than twice the rows per expert (padding)
are skipped.  The file is written after every job, merged into what it held,
so a run cut short by --budget-seconds (no new candidate starts after it) or
by a timeout keeps what it finished.  A progress bar shows the candidates.

Needs a CUDA GPU.  Status: tested on the CPU with a stand-in timer
(tests/cuda/test_tune_gpu.py: the search, the budget, the file the planner reads);
never run on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from jax_nbx.backends.cuda import plan  # noqa: E402

CANDIDATES = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)
              for bm, bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
              if not (bm == 128 and w == 4)]


def bar(i, n, label):
    width = 30
    done = int(width * i / max(n, 1))
    print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:50]:50s}", end="", flush=True)


def gemm2_of(c: dict) -> dict:
    """gemm2's config for gemm1's candidate ``c`` (the row blocks are shared)."""
    return dict(c, BN=min(2 * c["BN"], 256))


def candidates_for(rows_per_expert: float, defaults: tuple[dict, dict]) -> list[tuple[dict, dict]]:
    """The (gemm1, gemm2) pairs to time for a job: the defaults first, then
    every candidate whose BM is at most twice the rows per expert rounded up
    to a power of two (at least 16)."""
    cap = 2 * max(16, 1 << max(0, math.ceil(math.log2(max(rows_per_expert, 1)))))
    out = [defaults]
    out += [(c, gemm2_of(c)) for c in CANDIDATES if c["BM"] <= cap and (c, gemm2_of(c)) != defaults]
    return out


def tune(jobs, measure: Callable[[object, dict, dict], float], out: Path, budget_s: float = float("inf"),
         progress: bool = True) -> dict:
    """Times every job's candidates with ``measure(job, c1, c2)`` (seconds;
    an exception skips the candidate) and writes the best per job into
    ``out`` (JSON: key "E,H,I,dtype" -> {str(M): [c1, c2]}, merged into the
    file's table) after each job.  ``jobs``: objects with ``key``, ``M``,
    ``label`` and ``pairs`` (`candidates_for`).  Starts no candidate once
    ``budget_s`` has passed.  Returns {label: (default s, best s, c1, c2)}."""
    table = json.loads(out.read_text()) if out.exists() else {}
    total = sum(len(j.pairs) for j in jobs)
    step, t_start, report = 0, time.perf_counter(), {}
    for job in jobs:
        best, default = None, None
        for i, (c1, c2) in enumerate(job.pairs):
            step += 1
            if time.perf_counter() - t_start > budget_s:
                break
            if progress:
                bar(step, total, f"{job.label} {c1}")
            try:
                t = measure(job, c1, c2)
            except Exception as e:  # a config that does not compile or fit: skip it
                if progress:
                    print(f"\n  skipped {c1}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if i == 0:
                default = t
            if best is None or t < best[0]:
                best = (t, c1, c2)
        if best is None:
            continue
        table.setdefault(job.key, {})[str(job.M)] = [best[1], best[2]]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(table, indent=1, sort_keys=True))
        report[job.label] = (default, best[0], best[1], best[2])
        if progress:
            d = f"{default * 1e3:.3f} ms" if default is not None else "default failed"
            print(f"\n{job.label}: {d} -> {best[0] * 1e3:.3f} ms with {best[1]} / {best[2]}")
    return report


class Job:
    def __init__(self, model, T: int, wdtype="bfloat16"):
        import numpy as np

        self.model, self.T = model, T
        self.M = T * model.k
        self.key = f"{model.E},{model.H},{model.I},{plan._tl_name(np.dtype(wdtype))}"
        self.label = f"{model.name} T={T}"
        d1, d2 = plan._default_gemm_configs(self.M / model.E, np.dtype(wdtype))
        self.pairs = candidates_for(self.M / model.E, (dataclasses.asdict(d1), dataclasses.asdict(d2)))


def main(argv=None):
    import jax
    import jax.numpy as jnp
    from bench_common import make_layer
    from gpu import loop_time, ours

    from jax_nbx.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096,512")
    ap.add_argument("--budget-seconds", type=float, default=float("inf"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = jax.devices("gpu")[0]
    out = Path(args.out) if args.out else plan.config_file(dev.device_kind)
    jobs = [Job(MODELS[m], int(t)) for t in args.tokens.split(",") for m in args.models.split(",")]
    tmp = Path(tempfile.mkdtemp()) / "candidate.json"
    os.environ["JAX_NBX_TRITON_CONFIGS"] = str(tmp)
    layers = {}

    def measure(job, c1, c2):
        if job.label not in layers:
            layers[job.label] = make_layer(job.model, job.T, jnp.bfloat16, seed=job.T)
        tmp.write_text(json.dumps({job.key: {str(job.M): [c1, c2]}}))
        x, w, ids, ex = layers[job.label]
        return loop_time(ours, x, w, ids, ex, reps=10 if job.T <= 512 else 3)

    try:
        report = tune(jobs, measure, out, args.budget_seconds)
    finally:
        del os.environ["JAX_NBX_TRITON_CONFIGS"]
    print(f"\nwrote {out}")
    for label, (d, b, c1, c2) in report.items():
        print(f"  {label}: default {d * 1e3 if d else float('nan'):.3f} ms, best {b * 1e3:.3f} ms ({c1} / {c2})")


if __name__ == "__main__":
    main()
