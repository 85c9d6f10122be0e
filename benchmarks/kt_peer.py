"""KTransformers' CPU MoE kernels (kt-kernel 0.7.2) on one MoE layer, as a worker process that
``benchmarks/peers.py --kt PYTHON`` drives: run it with the Python of a separate venv that holds
kt-kernel (it needs torch, which stays out of jax_nbx's; see peers.py).  Not imported by jax_nbx.

Protocol: one JSON object per line on stdin, one reply per line on stdout.
  {"cmd": "load", "dir": D, "fmt": "bf16"|"int8"|"int4", "k": K, "threads": N, "max_len": M}
      reads D/gate.npy, D/up.npy, D/down.npy: bf16 bits (uint16) in kt's layout -- gate, up
      [E, I, H], down [E, H, I], row-major (transformers' nn.Linear weights) -- or for "int4" the
      packed codes D/*_q.npy uint8 [E, N, K/2] and scales D/*_s.npy bf16 bits [E, N, K/32].
      "int8": kt quantizes the bf16 weights itself (one symmetric scale per output row).
  {"cmd": "run", "dir": D, "reps": R, "threads": N}   the layer loaded for N threads: reads
      D/x.npy (bf16 bits [T, H]), D/ids.npy (int64
      [T, k]), D/w.npy (float32 [T, k]); runs R calls, writes D/out.npy (bf16 bits) of the
      first; replies {"times": [seconds per call]}.
  {"cmd": "quit"}
The classes and calls (kt_kernel_ext: WorkerPoolConfig, CPUInfer, moe.MOEConfig, moe.AMXBF16_MOE,
AMXInt8_MOE, AMXInt4_KGroup_MOE, load_weights_task, forward_task) are the ones kt-kernel's own
tests and KTransformers' loader use; the int4 format (kt's "RAWINT4": signed codes q + 8 two per
byte, low nibble the even column of K, bf16 scales per group of 32) is defined by kt-kernel's
operators/amx/la/amx_kernels.hpp (GemmKernel224Int4SmallKGroup) and its
test/per_commit/test_moe_rawint4_accuracy.py; 0.7.2's kernel is right with groups of 32 only.
kt's thread pool pins N workers to cores 0..N-1 and the thread that waits for them spins: N + 1
threads busy during a call (peers.py stops this process with SIGSTOP while it times others).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import time

import numpy as np

_libc = ctypes.CDLL(None)
CLASSES = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_KGroup_MOE"}


class _Quiet:
    """kt's C++ prints to fd 1, which carries this protocol: sent to /dev/null around its calls."""

    def __enter__(self):
        sys.stdout.flush()
        _libc.fflush(None)
        self.saved = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)

    def __exit__(self, *a):
        _libc.fflush(None)
        os.dup2(self.saved, 1)
        os.close(self.saved)


def extension():
    """kt_kernel_ext as kt's own CPU detection picks it (kt_kernel/_cpu_detect.py), without
    importing kt_kernel's __init__ (which imports torch)."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None:
        raise SystemExit("kt_peer: kt_kernel is not installed in this Python")
    folder = list(spec.submodule_search_locations)[0]
    det_spec = importlib.util.spec_from_file_location("_kt_cpu_detect", os.path.join(folder, "_cpu_detect.py"))
    det = importlib.util.module_from_spec(det_spec)
    det_spec.loader.exec_module(det)
    with _Quiet():
        ext, variant = det.initialize()
    return ext, variant


class Layer:
    def __init__(self, ext, pools, d, fmt, k, threads, max_len):
        if threads not in pools:
            cfg = ext.WorkerPoolConfig()
            cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [int(threads)]
            with _Quiet():
                pools[threads] = ext.CPUInfer(cfg)
        self.cpu = pools[threads]
        load = lambda name: np.ascontiguousarray(np.load(os.path.join(d, name + ".npy")))  # noqa: E731
        if fmt == "int4":
            arrays = [load(f"{p}_q") for p in ("gate", "up", "down")] + [load(f"{p}_s") for p in ("gate", "up", "down")]
            E, I, H2 = arrays[0].shape
            H = 2 * H2
        else:
            arrays = [load(p) for p in ("gate", "up", "down")]
            E, I, H = arrays[0].shape
        cfg = ext.moe.MOEConfig(E, int(k), H, I)
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, self.cpu.backend_, int(max_len)
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (a.ctypes.data for a in arrays[:3])
        if fmt == "int4":
            cfg.gate_scale, cfg.up_scale, cfg.down_scale = (a.ctypes.data for a in arrays[3:])
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, 32, False
        with _Quiet():
            self.moe = getattr(ext.moe, CLASSES[fmt])(cfg)
            self.cpu.submit(self.moe.load_weights_task())
            self.cpu.sync()
        self.k, self.H, self.max_len = int(k), H, int(max_len)

    def run(self, d, reps):
        x = np.ascontiguousarray(np.load(os.path.join(d, "x.npy")), np.uint16)
        ids = np.ascontiguousarray(np.load(os.path.join(d, "ids.npy")), np.int64)
        w = np.ascontiguousarray(np.load(os.path.join(d, "w.npy")), np.float32)
        T = x.shape[0]
        if T > self.max_len:
            raise ValueError(f"T={T} is more than max_len={self.max_len}")
        out = np.zeros((T, self.H), np.uint16)
        qlen = np.array([T], np.int32)
        args = (qlen.ctypes.data, self.k, ids.ctypes.data, w.ctypes.data, x.ctypes.data, out.ctypes.data, False)
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            self.cpu.submit(self.moe.forward_task(*args))
            self.cpu.sync()
            times.append(time.perf_counter() - t0)
            if r == 0:
                np.save(os.path.join(d, "out.npy"), out)
        return times


def main() -> int:
    ext, variant = extension()
    pools, layers = {}, {}
    print(json.dumps({"ready": True, "variant": variant}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                break
            n = int(msg.get("threads", 1))
            if msg["cmd"] == "load":  # one layer per thread count, each replaced by the next load
                layers.pop(n, None)
                layers[n] = Layer(ext, pools, msg["dir"], msg["fmt"], msg["k"], n, msg.get("max_len", 512))
                reply = {"ok": True}
            else:
                reply = {"times": layers[n].run(msg["dir"], int(msg.get("reps", 1)))}
        except Exception as e:  # reported to the driver, which prints it and goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
