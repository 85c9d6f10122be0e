"""Pointer tables: the absolute address of every expert's weights, per projection.

The CUDA kernels read each expert in place through a device table of int64
addresses (gate, up, down; ``3·E`` entries), never through a stacked copy.
Tables are cached under a fingerprint of all the addresses in a bounded LRU
(default 256 entries, ``JAX_NBX_TABLE_CACHE`` or `set_capacity`); a hit moves
an entry to the front, overflow evicts the oldest, and each table's bytes are
counted in the account under the tag ``"tables"`` until it is evicted.
(The CPU handler reads stacked experts directly and keeps no tables.)
"""
from __future__ import annotations

from . import _cuda, _env, _registry

__all__ = ["stats", "clear", "set_capacity"]


def stats() -> dict:
    """entries, hits, misses, evictions and bytes of the table cache."""
    return _cuda.table_stats()


def clear() -> None:
    """Frees every cached table (their bytes leave the account)."""
    ffi = _registry._ffi
    if ffi is not None and getattr(ffi, "has_cuda", False):
        ffi.cuda_table_clear()


def set_capacity(n: int) -> None:
    """Bounds the cache to ``n`` tables (at least 1), evicting the oldest now if needed."""
    n = int(n)
    if n < 1:
        raise ValueError(f"capacity must be >= 1; got {n}")
    ffi = _registry._ffi
    if ffi is not None and getattr(ffi, "has_cuda", False):
        ffi.cuda_table_set_capacity(n)


def _apply_env() -> None:
    n = _env.table_cache()  # ValueError naming JAX_NBX_TABLE_CACHE when malformed
    if n is not None:
        set_capacity(n)


_apply_env()
