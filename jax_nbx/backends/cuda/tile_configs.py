"""Tile configs of the CUDA path's GEMM kernels (`plan.py` reads them at trace
time): tuned per device in ``configs/<device>.json`` (written by
``benchmarks/tune_gpu.py``), else defaults by rows per expert; and the Triton
names of the dtypes the programs' arguments carry."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from ... import _env

_TL = {np.dtype("float32"): "fp32", np.dtype("float16"): "fp16", np.dtype("int32"): "i32",
       np.dtype("int64"): "i64", np.dtype("int8"): "i8", np.dtype("uint8"): "u8"}


def _tl_name(dtype) -> str:
    """Triton's name of a dtype ("fp32", "bf16", ...)."""
    d = np.dtype(dtype)
    if d.name == "bfloat16":
        return "bf16"
    return _TL[d]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int


_CONFIG_DIR = Path(__file__).with_name("configs")


def _default_gemm_configs(rows_per_expert: float, wdtype) -> tuple[GemmConfig, GemmConfig]:
    if np.dtype(wdtype) == np.float32:  # exact float32 dot: no tensor cores
        bm = 16 if rows_per_expert <= 16 else 32
        return GemmConfig(bm, 32, 32, 4, 2), GemmConfig(bm, 64, 32, 4, 2)
    if rows_per_expert <= 16:
        bm, w = 16, 4
    elif rows_per_expert <= 32:
        bm, w = 32, 4
    elif rows_per_expert <= 96:
        bm, w = 64, 4
    else:
        bm, w = 128, 8
    return GemmConfig(bm, 64, 64, w, 3), GemmConfig(bm, 128, 64, w, 3)


def config_file(device_name: str) -> Path:
    safe = "".join(c if c.isalnum() else "_" for c in device_name)
    return _CONFIG_DIR / f"{safe}.json"


def gemm_configs(M: int, E: int, H: int, I: int, wdtype, device_name: str | None,
                 quant: str = "") -> tuple[GemmConfig, GemmConfig]:
    """Tile configs of gemm1 and gemm2 for M = T·k slots: from the tuned
    file of the device (`configs/<device>.json`, key "E,H,I,dtype", the
    entry of the nearest M; quantized experts: dtype "int4g128-bf16" etc.,
    the format then the scales' dtype), else defaults by rows per expert.
    ``JAX_NBX_TRITON_CONFIGS`` names another file."""
    path = _env.triton_configs()
    file = Path(path) if path else (config_file(device_name) if device_name else None)
    if file is not None and file.exists():
        dt = f"{quant}-{_tl_name(wdtype)}" if quant else _tl_name(wdtype)
        table = json.loads(file.read_text()).get(f"{E},{H},{I},{dt}")
        if table:
            best = min(table, key=lambda m: abs(math.log(int(m)) - math.log(max(M, 1))))
            c1, c2 = table[best]
            return GemmConfig(**c1), GemmConfig(**c2)
    return _default_gemm_configs(M / E, wdtype)
