"""Fills the cubin cache that ``benchmarks/gpu_check.sh`` reads, on a machine without a GPU.

    python benchmarks/gpu_precompile.py [--cache gpu_cubins] [--cc 90] [--tests SEL ...]
    python benchmarks/gpu_precompile.py --records DIR --check   # which recorded kernels it lacks

1. Runs the GPU check's correctness tests with the CUDA programs under Triton's interpreter
   (``--backends cuda-interpret``), recording the kernels of every program built
   (``JAX_NBX_KERNEL_RECORD``, tests/support/cuda_interpret.py): the interpreter runs the very
   programs the CUDA handler would get, planned the same way.
2. Adds the kernels of ``benchmarks/gpu.py``'s checks and timing rows at the GPU check's arguments,
   traced against a stand-in H200 (``benchmarks/gpu_programs.py``: shapes only, nothing runs).
3. Compiles each kernel once for each ``--cc`` (``sm_90``: H100 and H200) into ``--cache``
   (`jax_nbx.backends.cuda.compile.precompile`; Triton ships ptxas, no GPU needed).

The GPU machine's first call then loads cubins instead of compiling them: ``gpu_check.sh`` points
``JAX_NBX_CUBIN_CACHE`` at ``gpu_cubins`` (carry that folder to it) and reports how many kernels it
still had to compile.  The cache is keyed by Triton's version, so it serves a machine only with the
same Triton: the GPU machines have Triton 3.6.0 (this refuses another unless ``--any-triton``; make
the cache in a venv with ``triton==3.6.0``, docs/backends.md).  Programs planned differently on the
GPU (a tuned tile config, the GPU-only tests' shapes) miss and are compiled there.
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import subprocess
import sys
import tempfile
import time

GPU_TRITON = "3.6.0"
# What gpu_check.sh runs on the GPU, as the interpreter runs it here (its cases, not its sweeps)
DEFAULT_TESTS = ["tests/suite", "-m", "not sweep", "--backends", "cuda-interpret"]
# gpu.py's arguments in gpu_check.sh (its defaults)
BENCH = dict(models=["mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b"], tokens=[1, 16, 512, 4096],
             quant_tokens=[1], train_tokens=[4096])


def records(folder: str) -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "kernels-*.pkl"))):
        with open(path, "rb") as f:
            while True:
                try:
                    out.extend(pickle.load(f))
                except EOFError:
                    break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=os.environ.get("JAX_NBX_CUBIN_CACHE", "gpu_cubins"),
                    help="the cubin cache folder (default $JAX_NBX_CUBIN_CACHE, else gpu_cubins)")
    ap.add_argument("--cc", default="90", help="compute capabilities, comma-separated (90: sm_90)")
    ap.add_argument("--records", help="kernels already recorded in this folder: skip the tests")
    ap.add_argument("--no-bench", action="store_true", help="leave out gpu.py's kernels")
    ap.add_argument("--check", action="store_true",
                    help="compile nothing: count the kernels the cache lacks (exit 1 if any)")
    ap.add_argument("--any-triton", action="store_true", help=f"allow a Triton other than {GPU_TRITON}")
    ap.add_argument("--tests", nargs=argparse.REMAINDER, help="pytest arguments instead of the default")
    args = ap.parse_args()
    from importlib.metadata import version
    triton = version("triton")
    if triton != GPU_TRITON and not args.any_triton:
        print(f"gpu_precompile: this is Triton {triton}; the GPU machines have {GPU_TRITON} and a cache made "
              f"with {triton} misses there (make it in a venv with triton=={GPU_TRITON}, or pass --any-triton)")
        return 2
    os.environ.pop("TRITON_INTERPRET", None)   # this process compiles; the tests' process interprets
    cache = os.path.abspath(args.cache)
    os.environ["JAX_NBX_CUBIN_CACHE"] = cache
    folder = args.records
    if folder is None:
        folder = tempfile.mkdtemp(prefix="nbx_kernels_")
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args.tests or DEFAULT_TESTS)]
        env = dict(os.environ, JAX_NBX_KERNEL_RECORD=folder, TRITON_INTERPRET="1")
        rc = subprocess.run(cmd, env=env).returncode
        print(f"== the tests under the interpreter: exit {rc}, {time.time() - t0:.0f} s")
    kernels = records(folder)
    print(f"== tests: {len(kernels)} kernel uses recorded, {len(set(kernels))} distinct; Triton {triton}")
    from jax_nbx.backends.cuda import compile as C
    if not args.no_bench:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_programs
    for cc in (int(c) for c in args.cc.split(",")):
        ks = list(kernels)
        if not args.no_bench:
            bench = gpu_programs.record(**BENCH, cc=cc)
            print(f"== gpu.py (sm_{cc}): {len(bench)} kernel uses, {len(set(bench))} distinct")
            ks += bench
        if args.check:
            lacking = C.missing(ks, cc)
            print(f"== sm_{cc}: {len(set(ks)) - len(lacking)} of {len(set(ks))} kernels in {cache}; "
                  f"{len(lacking)} missing: {sorted({k[0].name for k in lacking})}")
            if lacking:
                return 1
            continue
        t0 = time.time()
        got = C.precompile(ks, cc)
        print(f"== sm_{cc}: {got['compiled']} compiled, {got['found']} already in {cache} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
