"""Pointer tables: the absolute address of every expert's weights, per projection.

On Metal (`jax_nbx.metal`) the tables hold GPU addresses inside no-copy wraps
of the host weights (pinned scopes: one wrap per host allocation); a table's
pins live exactly as long as its cache entry, and `release_pinned` drops
every pinning table (at an unload boundary: before weights are freed for
good).

The CUDA kernels read each expert in place through a device table of int64
addresses (gate, up, down; ``3·E`` entries), never through a stacked copy.
Tables are cached under a fingerprint of all the addresses in a bounded LRU
(default 256 entries, ``JAX_NBX_TABLE_CACHE`` or `set_capacity`); a hit moves
an entry to the front, overflow evicts the oldest, and each table's bytes are
counted in the account under the tag ``"tables"`` until it is evicted.
(The CPU handler reads stacked experts directly and keeps no tables.)
"""
from __future__ import annotations

from . import _registry

__all__ = ["stats", "clear", "set_capacity", "release_pinned"]


def stats(platform: str = "cuda") -> dict:
    """entries, hits, misses, evictions and bytes of a table cache
    (``"cuda"`` or ``"metal"``; Metal adds stale: hits dropped because their
    memory had been freed and reallocated, wraps: no-copy wraps the cached
    tables pin, and capacity)."""
    if platform == "metal":
        return dict(_registry.ffi_module().metal_table_stats())
    if platform != "cuda":
        raise ValueError(f"platform must be 'cuda' or 'metal'; got {platform!r}")
    ffi = _registry._ffi
    if ffi is None or not getattr(ffi, "has_cuda", False):
        return {"entries": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes": 0}
    return dict(ffi.cuda_table_stats())


def release_pinned() -> int:
    """Drops every cached Metal table and the wraps it pins (their bytes leave
    the account); returns how many tables were dropped."""
    return int(_registry.ffi_module().metal_release_pinned())


def clear() -> None:
    """Frees every cached table, CUDA and Metal (their bytes leave the account)."""
    ffi = _registry.ffi_module()
    if getattr(ffi, "has_cuda", False):
        ffi.cuda_table_clear()
    ffi.metal_release_pinned()


def set_capacity(n: int) -> None:
    """Bounds the cache to ``n`` tables (at least 1), evicting the oldest now if needed."""
    n = int(n)
    if n < 1:
        raise ValueError(f"capacity must be >= 1; got {n}")
    ffi = _registry.ffi_module()
    if getattr(ffi, "has_cuda", False):
        ffi.cuda_table_set_capacity(n)
    ffi.metal_table_set_capacity(n)

