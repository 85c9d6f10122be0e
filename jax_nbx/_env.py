"""Every environment variable jax_nbx reads, in one place.

Read when asked (each function reads its variable now), so a test or a
notebook may set one before the first call.  A malformed value raises
ValueError naming the variable.  The C++ handlers read none: what they need
is handed to them by the Python side (``apply_at_load``).

| variable | meaning | default |
|---|---|---|
| ``JAX_NBX_BUDGET`` | the account's budget ("2GiB", bytes) | CPU: half the free memory; CUDA: half of XLA's pool |
| ``JAX_NBX_ISA`` | the CPU kernels' instruction set (avx512, avx2, generic), or ``packed=avx2,..`` | cpu.default_isa |
| ``JAX_NBX_PROFILE`` | print the stages of each CPU band/group to stderr | off |
| ``JAX_NBX_TABLE_CACHE`` | pointer-table LRU capacity (CUDA, Metal) | 256 |
| ``JAX_NBX_METAL`` | the Metal device: ``apple``, ``sim`` (simulated: tests) or ``none`` | ``apple`` if built |
| ``JAX_NBX_CUDA_CHECK_IDS`` | the expert-id check (CUDA): ``1`` sync, ``deferred`` (next call), ``0`` off | ``1`` |
| ``JAX_NBX_CUDA_GRAPHS`` | launch each CUDA program as one CUDA graph (arguments updated per call) | off |
| ``JAX_NBX_CUDA_DECODE_SLOTS`` | at most this many slots take the CUDA decode path | 16 |
| ``JAX_NBX_CUDA_DECODE_PROGRAMS`` | programs the CUDA decode path's split-K aims at | 1024 |
| ``JAX_NBX_TRITON_CONFIGS`` | a tile-config JSON file instead of ``configs/<device>.json`` | - |
| ``JAX_NBX_CUBIN_CACHE`` | the CUDA kernels' cubin cache folder; ``0``: none | ``$XDG_CACHE_HOME/jax_nbx/cubins`` |
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import TypeVar

__all__ = ["budget", "isa", "profile", "table_cache", "metal", "cuda_check_ids", "cuda_graphs", "cuda_decode_slots",
           "cuda_decode_programs", "triton_configs", "cubin_cache", "triton_settings", "trace_settings", "parse",
           "parse_bytes", "available_memory"]

T = TypeVar("T")


def _get(var: str) -> str | None:
    value = os.environ.get(var)
    return value if value else None


def parse(var: str, convert: Callable[[str], T]) -> T | None:
    """``convert(value)`` of a set variable (None when unset or empty); a
    conversion error becomes ValueError naming the variable."""
    value = _get(var)
    if value is None:
        return None
    try:
        return convert(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{var}={value!r}: {e}") from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def conv(v: str) -> int:
        n = int(v)
        if n < lo:
            raise ValueError(f"must be an integer >= {lo}")
        return n
    return conv


def _flag(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``2147483648``, ``"2GiB"``, ``"300MB"`` (decimal), ``"1.5G"`` (binary) -> bytes."""
    if isinstance(value, bool):
        raise TypeError(f"budget must be a byte count or a string like '2GiB'; got {value!r}")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a byte count; use e.g. 2147483648, '2GiB', "
                             "'300MB', '1.5G'")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise TypeError(f"budget must be a byte count or a string like '2GiB'; got {value!r}")
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"a byte count must be finite and >= 0; got {value!r}")
    return int(n)


def available_memory() -> int:
    """Memory available to this process: min(cgroup limit - usage, MemAvailable)."""
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 2**60:
                continue
            used = 0
            try:
                with open(usage_file) as f:
                    used = int(f.read().strip())
            except OSError:
                pass
            candidates.append(max(int(raw) - used, 0))
            break
        except (OSError, ValueError):
            continue
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return 8 * 2**30
    return min(candidates)


def budget() -> int | None:
    """``JAX_NBX_BUDGET`` in bytes (`parse_bytes`), or None when unset."""
    return parse("JAX_NBX_BUDGET", parse_bytes)


def isa() -> str | None:
    """``JAX_NBX_ISA``: "avx512", "avx2", "generic" or a composition
    "packed=avx2,stream=avx512" (checked when applied)."""
    return _get("JAX_NBX_ISA")


def profile() -> bool:
    """``JAX_NBX_PROFILE``: any non-empty value other than 0/false/no/off turns it on."""
    v = _get("JAX_NBX_PROFILE")
    return v is not None and v.strip().lower() not in ("0", "false", "no", "off")


def table_cache() -> int | None:
    """``JAX_NBX_TABLE_CACHE``: the pointer-table LRU capacity (>= 1)."""
    return parse("JAX_NBX_TABLE_CACHE", _int_at_least(1))


def metal() -> str | None:
    """``JAX_NBX_METAL``: "apple", "sim" or "none" (None when unset)."""
    def check(v: str) -> str:
        v = v.strip().lower()
        if v not in ("apple", "sim", "none"):
            raise ValueError(f"expected 'apple', 'sim' or 'none', got {v!r}")
        return v
    return parse("JAX_NBX_METAL", check)


def cuda_check_ids() -> str:
    """``JAX_NBX_CUDA_CHECK_IDS``: "sync" (default; 1/true/yes/on), "deferred"
    or "off" (0/false/no/off)."""
    def mode(v: str) -> str:
        if v.strip().lower() in ("deferred", "sync"):
            return v.strip().lower()
        try:
            return "sync" if _flag(v) else "off"
        except ValueError:
            raise ValueError("expected 1 or sync, deferred, or 0 or off") from None

    v = parse("JAX_NBX_CUDA_CHECK_IDS", mode)
    return "sync" if v is None else v


def cuda_graphs() -> bool:
    """``JAX_NBX_CUDA_GRAPHS`` (default off): the CUDA handlers launch a
    call's kernels as one CUDA graph (built once per program shape and
    device; each call updates its nodes' arguments) instead of one
    ``cuLaunchKernel`` each.  Read when a call is traced."""
    return bool(parse("JAX_NBX_CUDA_GRAPHS", _flag))


def cuda_decode_slots() -> int:
    """``JAX_NBX_CUDA_DECODE_SLOTS`` (default 16)."""
    v = parse("JAX_NBX_CUDA_DECODE_SLOTS", _int_at_least(0))
    return 16 if v is None else v


def cuda_decode_programs() -> int:
    """``JAX_NBX_CUDA_DECODE_PROGRAMS`` (default 1024)."""
    v = parse("JAX_NBX_CUDA_DECODE_PROGRAMS", _int_at_least(1))
    return 1024 if v is None else v


def triton_configs() -> str | None:
    """``JAX_NBX_TRITON_CONFIGS``: a path, or None."""
    return _get("JAX_NBX_TRITON_CONFIGS")


def cubin_cache() -> str | None:
    """``JAX_NBX_CUBIN_CACHE``: the folder of the CUDA kernels' cubin cache (default
    ``$XDG_CACHE_HOME/jax_nbx/cubins``, ``~/.cache/...`` without it), or None for ``0``/``off``/...:
    no cache on disk."""
    v = _get("JAX_NBX_CUBIN_CACHE")
    if v is not None:
        try:
            if not _flag(v):
                return None
        except ValueError:
            return os.path.abspath(os.path.expanduser(v))
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax_nbx", "cubins")


# Triton's variables that say where files go or how to debug, not what a cubin holds
_TRITON_PLACES = frozenset({"TRITON_CACHE_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TRITON_HOME",
                            "TRITON_INTERPRET", "TRITON_PRINT_AUTOTUNING"})


def triton_settings() -> list:
    """Triton's own ``TRITON_*`` variables that may change what it compiles (e.g.
    ``TRITON_DEFAULT_FP_FUSION``), as sorted (name, value) pairs: part of the cubin cache's key
    (`jax_nbx.backends.cuda.compile`); conservatively every one but those that only place files."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_") and k not in _TRITON_PLACES)


def trace_settings() -> tuple:
    """The settings a backend reads while a call is traced (today the CUDA path's: the id check, graphs,
    the decode path's slots and programs, a tile-config file), each validated: part of the op's static
    key (`jax_nbx.backends.Problem.settings`), so that a call traced after one of them changed never
    reuses a function (`transforms.op`) or a trace of it made under the old value."""
    return (cuda_check_ids(), cuda_graphs(), cuda_decode_slots(), cuda_decode_programs(), triton_configs())
