"""Expert stores: experts read from their checkpoint's files when a call
routes to them, never held as JAX arrays (`jax_nbx.loaders.map_moe`).

A store holds E experts, each a fixed list of arrays (the handlers' buffer
groups, ``xla_ffi/common/expert_store.h``).  The experts of a store appear in
an `Experts` pytree as `MappedArray` placeholders: pytree nodes without
leaves that carry the store's id, so `jit`, `vmap` and `grad` pass them
through as static structure.

`ExpertStore.fetch` runs before each handler call (an ``io_callback`` on the
call's ids): it reads the experts the call routes to that are not held
(``read_expert``, the loader's: explicit reads checked against each file's
identity), keeps the most routed experts resident up to ``resident_bytes``,
and leases the call's experts to the handler.  An expert that is not kept is
*streamed*: its block is freed when the call that read it ends.  Every block
is counted in the account (tag ``"mapped experts"``): a call whose experts do
not fit the budget is refused with the account's advice.  `close` refuses
later calls by name; blocks still leased are freed when their call ends.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from . import _registry
from .memory import DeviceOOMError, last_refusal

__all__ = ["ExpertStore", "MappedArray", "store_of", "totals"]

_ffi = _registry.ffi_module
_STORES: dict[int, ExpertStore] = {}  # open stores by id (MappedArray finds its store here)


class MappedArray:
    """One expert's array in an expert store: its shape and dtype, no data.
    A pytree node without children (static: its store id, expert, array)."""

    __slots__ = ("store", "expert", "index", "shape", "dtype")

    def __init__(self, store: int, expert: int, index: int, shape: tuple[int, ...], dtype):
        self.store, self.expert, self.index = int(store), int(expert), int(index)
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _key(self):
        return (self.store, self.expert, self.index, self.shape, self.dtype)

    def __eq__(self, other) -> bool:
        return isinstance(other, MappedArray) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"MappedArray(store={self.store}, expert={self.expert}, {self.dtype.name}{list(self.shape)})"

    def __array__(self, *args, **kwargs):
        raise TypeError("a mapped expert's array is read by the op from its checkpoint file; "
                        "it has no data here (ExpertStore.read gives an expert's arrays)")


def _flatten(m: MappedArray):
    return (), m._key()


def _unflatten(aux, children):
    store, expert, index, shape, dtype = aux
    return MappedArray(store, expert, index, shape, dtype)


jax.tree_util.register_pytree_node(MappedArray, _flatten, _unflatten)


def store_of(tree) -> int:
    """The id of the expert store whose `MappedArray`s ``tree`` holds (0:
    none); ValueError when it holds arrays of several stores or mixes them
    with real arrays."""
    found = {m.store for m in jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, MappedArray))
             if isinstance(m, MappedArray)}
    if len(found) > 1:
        raise ValueError(f"experts hold the arrays of {len(found)} expert stores; one call reads one store")
    return found.pop() if found else 0


def totals() -> dict[str, int]:
    """Every open store's figures in bytes: mapped (what their experts would
    take held), resident (kept), streamed (held for calls running now), and
    the number of open stores."""
    return dict(_ffi().store_totals())


class ExpertStore:
    """E experts read from files by ``read_expert(e)`` (a list of numpy
    arrays matching ``arrays``: (dtype, shape) pairs, the handlers' buffer
    groups) when a call routes to them; the most routed kept resident up to
    ``resident_bytes``.  ``name`` (the checkpoint) names the store in errors."""

    def __init__(self, name: str, E: int, arrays: Sequence[tuple], read_expert: Callable[[int], list],
                 resident_bytes: int):
        self.name, self.E = name, int(E)
        self.arrays = [(np.dtype(d), tuple(int(x) for x in s)) for d, s in arrays]
        self.read_expert = read_expert
        self.resident_bytes = int(resident_bytes)
        self.id = int(_ffi().store_create(name, self.E, [(d.name, list(s)) for d, s in self.arrays]))
        self.expert_bytes = int(_ffi().store_expert_bytes(self.id))
        self.counts = np.zeros(self.E, np.int64)  # how often each expert was routed
        self.resident: set[int] = set()
        self.hits = self.misses = self.read_bytes = self.calls = 0
        self.closed = False
        self._lock = threading.Lock()
        _STORES[self.id] = self

    @classmethod
    def get(cls, store_id: int) -> ExpertStore:
        s = _STORES.get(store_id)
        if s is None:
            raise ValueError(f"expert store {store_id} is closed (unmapped) or was never opened: map the "
                             "experts again (jax_nbx.loaders.map_moe)")
        return s

    def placeholders(self) -> list[list[MappedArray]]:
        """Per array (buffer group), the E experts' `MappedArray`s."""
        return [[MappedArray(self.id, e, i, s, d) for e in range(self.E)] for i, (d, s) in enumerate(self.arrays)]

    def _keep(self) -> set[int]:
        """The experts to keep resident: the most routed that fit
        ``resident_bytes`` (ties: those resident now, then the lower id)."""
        n = self.resident_bytes // self.expert_bytes if self.expert_bytes else self.E
        if n <= 0:
            return set()
        order = sorted(range(self.E), key=lambda e: (-self.counts[e], e not in self.resident, e))
        return {e for e in order[:n] if self.counts[e] > 0}

    def read(self, e: int) -> list[np.ndarray]:
        """Expert ``e``'s arrays read from the files (checked against the store's shapes and dtypes)."""
        arrays = [np.ascontiguousarray(a) for a in self.read_expert(e)]
        if len(arrays) != len(self.arrays) or any(
                a.dtype != d or a.shape != s for a, (d, s) in zip(arrays, self.arrays)):
            got = [(a.dtype.name, a.shape) for a in arrays]
            want = [(d.name, s) for d, s in self.arrays]
            raise ValueError(f"{self.name}: expert {e} reads as {got}; the store's experts are {want}")
        return arrays

    def fetch(self, ids) -> np.ndarray:
        """Reads the experts ``ids`` route to that are not held, updates the
        resident set, and leases the call's experts: int32 ``[1]``, the lease
        the handler reads and ends.  Ids outside [0, E) are not fetched."""
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.E)]
        needed, counts = np.unique(ids, return_counts=True)
        with self._lock:
            if self.closed:
                raise ValueError(f"the mapped experts of {self.name} are closed (unmapped); map them again")
            self.calls += 1
            self.counts[needed] += counts
            keep = self._keep()
            for e in self.resident - keep:  # no longer among the most routed: freed when unpinned
                _ffi().store_set_resident(self.id, e, False)
            for e in map(int, needed):
                if _ffi().store_has(self.id, e):
                    self.hits += 1
                    if e in keep:
                        _ffi().store_set_resident(self.id, e, True)
                    continue
                self.misses += 1
                arrays = self.read(e)
                self.read_bytes += sum(a.nbytes for a in arrays)
                raw = [a.reshape(-1).view(np.uint8) for a in arrays]  # (bfloat16 has no DLPack code)
                ok, error = _ffi().store_put(self.id, e, raw, e in keep)
                if not ok:
                    raise _refusal(error)
            self.resident = {e for e in keep if _ffi().store_has(self.id, e)}
            lease, error = _ffi().store_acquire(self.id, [int(e) for e in needed])
            if not lease:
                raise ValueError(error)
        return np.array([lease], np.int32)

    def stats(self) -> dict:
        """calls, hits and misses (experts a call found held or read),
        read_bytes, expert_bytes, resident_bytes (the budget), and the
        store's held figures (resident/streamed bytes and experts, leases)."""
        d = dict(calls=self.calls, hits=self.hits, misses=self.misses, read_bytes=self.read_bytes,
                 expert_bytes=self.expert_bytes, resident_budget=self.resident_bytes)
        d.update(_ffi().store_stats(self.id))
        return d

    def set_resident_bytes(self, nbytes: int) -> None:
        """A new resident budget (applied at the next call)."""
        self.resident_bytes = int(nbytes)

    def close(self) -> None:
        """Refuses later calls (naming the checkpoint); blocks still leased
        by a running call are freed when it ends, the rest now."""
        with self._lock:
            self.closed = True
            self.resident.clear()
            _ffi().store_close(self.id)
        _STORES.pop(self.id, None)


def _refusal(error: str) -> BaseException:
    r = last_refusal()
    if r is not None and r["message"] in error:
        return DeviceOOMError(error, requested=r["requested"], free=r["free"], total=r["total"],
                              device=r["device"])
    return ValueError(error)
