"""The CPU's arithmetic limits, measured: register-only loops of one
instruction on every core at once (benchmarks run it beside their rows).

    python benchmarks/peaks.py              # every loop this CPU runs, all cores
    python benchmarks/peaks.py --threads 1

* ``fma_f32``: float32 FMAs (``vfmadd231ps``) on independent accumulators
  (12 of 256 bits, AVX2+FMA: its 16 registers; 16 of 512 bits, AVX-512F)
  where the CPU has them; the rate
  is the faster of the two (Zen 4 runs a 512-bit FMA as two 256-bit halves).
  2 FLOPs per lane.
* ``vdpbf16ps``: AVX-512 BF16 dot products on 16 accumulators; each
  instruction is 32 bf16 products added in pairs into 16 float32 lanes: 64
  FLOPs.

The loops are C, compiled here at run time by the system's C compiler (``cc``)
with per-function target attributes (no -march flag), and run on N threads
at once (pthreads, one per core by default); each thread's loop is timed
alone and the rate is their sum.  No memory is touched inside the loops.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define ACC 16
/* AVX2 has 16 ymm registers: 12 accumulators, b and c fit (16 spilled to the stack and
   measured half the rate) */
#define ACC256 12
__attribute__((target("avx2,fma"))) static float fma256(long n) {
  __m256 a[ACC256]; const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (int j = 0; j < ACC256; ++j) a[j] = _mm256_set1_ps((float)j);
  for (long i = 0; i < n; ++i)
_Pragma("GCC unroll 16") for (int j = 0; j < ACC256; ++j) a[j] = _mm256_fmadd_ps(a[j], b, c);
  __m256 s = a[0]; for (int j = 1; j < ACC256; ++j) s = _mm256_add_ps(s, a[j]);
  float o[8]; _mm256_storeu_ps(o, s); return o[0];
}
__attribute__((target("avx512f"))) static float fma512(long n) {
  __m512 a[ACC]; const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int j = 0; j < ACC; ++j) a[j] = _mm512_set1_ps((float)j);
  for (long i = 0; i < n; ++i)
_Pragma("GCC unroll 16") for (int j = 0; j < ACC; ++j) a[j] = _mm512_fmadd_ps(a[j], b, c);
  __m512 s = a[0]; for (int j = 1; j < ACC; ++j) s = _mm512_add_ps(s, a[j]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx512f,avx512bf16"))) static float dpbf16(long n) {
  __m512 a[ACC]; const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int j = 0; j < ACC; ++j) a[j] = _mm512_set1_ps((float)j);
  for (long i = 0; i < n; ++i)
_Pragma("GCC unroll 16") for (int j = 0; j < ACC; ++j) a[j] = _mm512_dpbf16_ps(a[j], b, c);
  __m512 s = a[0]; for (int j = 1; j < ACC; ++j) s = _mm512_add_ps(s, a[j]);
  return _mm512_reduce_add_ps(s);
}
typedef struct { int kind; long n; double seconds; float sink; } Job;
static void* run(void* p) {
  Job* j = (Job*)p; double t0 = now();
  j->sink = j->kind == 0 ? fma256(j->n) : j->kind == 1 ? fma512(j->n) : dpbf16(j->n);
  j->seconds = now() - t0; return NULL;
}
int main(int argc, char** argv) {
  const int kind = atoi(argv[1]), threads = atoi(argv[2]); const long n = atol(argv[3]);
  const double flops_per_iter = kind == 0 ? ACC256 * 16.0 : ACC * (kind == 1 ? 32.0 : 64.0);
  pthread_t t[256]; Job jobs[256]; float sink = 0;
  for (int i = 0; i < threads; ++i) { jobs[i] = (Job){kind, n, 0, 0}; pthread_create(&t[i], NULL, run, &jobs[i]); }
  double rate = 0;
  for (int i = 0; i < threads; ++i) {
    pthread_join(t[i], NULL);
    rate += flops_per_iter * n / jobs[i].seconds;
    sink += jobs[i].sink;
  }
  printf("%.3f %g\n", rate * 1e-9, (double)sink);
  return 0;
}
"""
_KINDS = {"fma256": 0, "fma512": 1, "vdpbf16ps": 2}
_NEEDS = {"fma256": ("avx2", "fma"), "fma512": ("avx512f",), "vdpbf16ps": ("avx512f", "avx512_bf16")}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _binary() -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    d = tempfile.mkdtemp(prefix="nbx_peaks_")
    src, exe = os.path.join(d, "peaks.c"), os.path.join(d, "peaks")
    with open(src, "w") as f:
        f.write(_SOURCE)
    r = subprocess.run([cc, "-O3", "-pthread", src, "-o", exe], capture_output=True, text=True)
    return exe if r.returncode == 0 else None


def loop_rate(kind: str, threads: int | None = None, iters: int = 20_000_000) -> float | None:
    """GFLOP/s of one register-only loop (``fma256``, ``fma512``,
    ``vdpbf16ps``) on ``threads`` threads (default: every core); None where
    the CPU lacks the instruction or no C compiler is found."""
    if not set(_NEEDS[kind]) <= cpu_flags():
        return None
    exe = _binary()
    if exe is None:
        return None
    out = subprocess.run([exe, str(_KINDS[kind]), str(threads or os.cpu_count() or 1), str(iters)],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])


def peaks(threads: int | None = None) -> dict[str, float | None]:
    """{"fma_f32": the faster FMA loop's GFLOP/s, "vdpbf16ps": ...} (None: not on this CPU)."""
    fma = [r for r in (loop_rate("fma256", threads), loop_rate("fma512", threads)) if r]
    return {"fma_f32": max(fma) if fma else None, "vdpbf16ps": loop_rate("vdpbf16ps", threads)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    for kind in _KINDS:
        r = loop_rate(kind, a.threads)
        print(f"{kind:10s} {'not on this CPU' if r is None else f'{r:8.1f} GFLOP/s'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
