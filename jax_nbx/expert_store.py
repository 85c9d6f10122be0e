"""Expert stores: experts read from their checkpoint's files when a call
routes to them, never held as JAX arrays (`jax_nbx.loaders.map_moe`).

A store holds E experts, each a fixed list of arrays (the handlers' buffer
groups, ``xla_ffi/common/expert_store.h``).  The experts of a store appear in
an `Experts` pytree as `MappedArray` placeholders: pytree nodes without
leaves that carry the store's id, so `jit`, `vmap` and `grad` pass them
through as static structure.

Each handler call leases the experts its ids route to for its run (C++,
``expert_store.h`` LeaseCall): when every one is held it pins them; otherwise
it calls `ExpertStore.fetch` back (the GIL taken on XLA's thread), which
reads the experts the call routes to that are not held (``read_expert``, the
loader's: explicit reads checked against each file's identity), keeps the
most routed experts resident up to ``resident_bytes``, and leases the call's
experts to the handler.  An expert that is not kept is *streamed*: its block
is freed when the call that read it ends.  Every block is counted in the
account (tag ``"mapped experts"``): a call whose experts do not fit the
budget is refused with the account's advice.  `close` refuses
later calls by name; blocks still leased are freed when their call ends.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from . import _registry
from .memory import DeviceOOMError, last_refusal

__all__ = ["ExpertStore", "MappedArray", "store_of", "totals"]

_ffi = _registry.ffi_module
_STORES: dict[int, ExpertStore] = {}  # open stores by id (MappedArray finds its store here)
_CLOSED: dict[int, str] = {}  # closed stores' names, for the errors of later calls


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
                 resident_bytes: int, stream_bytes: int | None = None):
        self.name, self.E = name, int(E)
        self.arrays = [(np.dtype(d), tuple(int(x) for x in s)) for d, s in arrays]
        self.read_expert = read_expert
        self.resident_bytes = int(resident_bytes)
        self.id = int(_ffi().store_create(name, self.E, [(d.name, list(s)) for d, s in self.arrays]))
        self.expert_bytes = int(_ffi().store_expert_bytes(self.id))
        self.resident: set[int] = set()
        self.hits = self.misses = self.read_bytes = self.calls = 0
        self.closed = False
        self._lock = threading.Lock()
        # stream_bytes: a call reads its experts in passes of `pass_experts`, the next pass's
        # read ahead while one computes (two passes' blocks at most); None: one pass
        self.stream_bytes = None if stream_bytes is None else int(stream_bytes)
        self.pass_experts = None
        if self.stream_bytes is not None:
            self.pass_experts = self.stream_bytes // (2 * self.expert_bytes) if self.expert_bytes else self.E
            if self.pass_experts < 1:
                _ffi().store_close(self.id)
                raise ValueError(f"{name}: stream_bytes={self.stream_bytes} holds no two experts of "
                                 f"{self.expert_bytes} bytes (a pass and the one read ahead); give at least "
                                 f"{2 * self.expert_bytes}")
        self._ahead: dict[int, Future] = {}  # experts being read ahead, by id
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jax_nbx-read-ahead")
        _ffi().store_set_fetch(self.id, self._fetch_for_handler)
        _STORES[self.id] = self

    @classmethod
    def get(cls, store_id: int) -> ExpertStore:
        s = _STORES.get(store_id)
        if s is None:
            what = (f"the mapped experts of {_CLOSED[store_id]} are closed (unmapped)" if store_id in _CLOSED
                    else f"expert store {store_id} was never opened")
            raise ValueError(f"{what}; map them again (jax_nbx.loaders.map_moe)")
        return s

    def placeholders(self) -> list[list[MappedArray]]:
        """Per array (buffer group), the E experts' `MappedArray`s."""
        return [[MappedArray(self.id, e, i, s, d) for e in range(self.E)] for i, (d, s) in enumerate(self.arrays)]

    def _keep(self) -> np.ndarray:
        """Which experts to keep resident (uint8 ``[E]``): the most routed that
        fit ``resident_bytes`` (ties: those resident now, then the lower id)."""
        keep = np.zeros(self.E, np.uint8)
        n = self.resident_bytes // self.expert_bytes if self.expert_bytes else self.E
        if n <= 0:
            return keep
        now = np.zeros(self.E, bool)
        now[list(self.resident)] = True
        counts = self.counts
        order = np.lexsort((np.arange(self.E), ~now, -counts))[:n]
        keep[order[counts[order] > 0]] = 1
        return keep

    @property
    def counts(self) -> np.ndarray:
        """How often each expert was routed, by every call so far (int64 ``[E]``)."""
        return np.asarray(_ffi().store_counts(self.id), np.int64)

    def _count(self, needed, counts) -> None:
        _ffi().store_add_counts(self.id, [int(e) for e in needed], [int(c) for c in counts])

    def read(self, e: int) -> list[np.ndarray]:
        """Expert ``e``'s arrays read from the files (checked against the store's shapes and dtypes)."""
        arrays = [np.ascontiguousarray(a) for a in self.read_expert(e)]
        if len(arrays) != len(self.arrays) or any(
                a.dtype != d or a.shape != s for a, (d, s) in zip(arrays, self.arrays)):
            got = [(a.dtype.name, a.shape) for a in arrays]
            want = [(d.name, s) for d, s in self.arrays]
            raise ValueError(f"{self.name}: expert {e} reads as {got}; the store's experts are {want}")
        return arrays

    def _put(self, e: int, resident: bool, lease: int = 0) -> None:
        """Reads expert ``e`` and puts it in the store, pinned by ``lease``
        when one is being built (the caller holds no lock)."""
        arrays = self.read(e)
        raw = [a.reshape(-1).view(np.uint8) for a in arrays]  # (bfloat16 has no DLPack code)
        with self._lock:
            self.misses += 1
            self.read_bytes += sum(a.nbytes for a in arrays)
            ok, error = _ffi().store_put(self.id, e, raw, resident, lease)
        if not ok:
            raise _refusal(error)

    def fetch_pass(self, p, ids, *, skip_outside: bool):
        """Pass ``p`` of a call in passes (``stream_bytes``): the call's
        experts (sorted) cut into passes of `pass_experts`; reads pass p's
        that are not held and returns (which experts the pass has, bool
        ``[E]``; whether a pass follows).  Pass p+1's experts are read
        ahead on a background thread before this returns.  An id outside
        [0, E) is an error here unless ``skip_outside`` (the passes skip
        every id their pass does not hold)."""
        p, ids = int(np.asarray(p)), np.asarray(ids).reshape(-1)
        outside = ids[(ids < 0) | (ids >= self.E)]
        if outside.size and not skip_outside:
            raise ValueError(f"topk_ids holds {int(outside[0])}, outside [0, E={self.E}) (pass "
                             "ids_outside='skip' to skip such ids)")
        needed, counts = np.unique(ids[(ids >= 0) & (ids < self.E)], return_counts=True)
        n = self.pass_experts
        chunk, nxt = needed[p * n:(p + 1) * n], needed[(p + 1) * n:(p + 2) * n]
        if p == 0:
            with self._lock:
                self.calls += 1
                self._count(needed, counts)
        self._hold(chunk)
        with self._lock:
            keep = self._keep()
            for e in map(int, nxt):
                if e not in self._ahead and not _ffi().store_has(self.id, e):
                    self._ahead[e] = self._reader.submit(self._put, e, bool(keep[e]))
        mask = np.zeros(self.E, bool)
        mask[chunk] = True
        return mask, np.asarray(nxt.size > 0)

    def _hold(self, needed) -> None:
        """Reads what ``needed`` lacks (waiting for its reads ahead); the
        pass's handler leases them (a block freed before it does is read
        again by its lease)."""
        ahead = self._wait_ahead(needed)
        with self._lock:
            keep = self._keep()
            missing = [int(e) for e in needed if not _ffi().store_has(self.id, int(e))]
            self.hits += len(needed) - len(missing) - ahead
        for e in missing:
            self._put(e, bool(keep[e]))

    def _wait_ahead(self, needed) -> int:
        """Waits for the experts of ``needed`` being read ahead (a failed read
        raises here); how many there were (their misses counted by the read)."""
        ahead = 0
        for e in map(int, needed):
            fut = self._ahead.pop(e, None)
            if fut is not None:
                ahead += 1
                fut.result()
        return ahead

    def _lease(self, needed) -> int:
        """Reads what ``needed`` lacks (waiting for experts being read ahead),
        updates the resident set and leases ``needed``."""
        ahead = self._wait_ahead(needed)
        needed = [int(e) for e in needed]
        with self._lock:
            if self.closed:
                raise ValueError(f"the mapped experts of {self.name} are closed (unmapped); map them again")
            keep = self._keep()
            lease, missing, error = _ffi().store_begin(self.id, needed)  # pins what is held
            if not lease:
                raise ValueError(error)
            self.hits += len(needed) - len(missing) - ahead
        try:
            for e in missing:  # each pinned by the lease as it is put: no other call frees it
                self._put(e, bool(keep[e]), lease)
        except BaseException:
            _ffi().store_release(self.id, lease)
            raise
        with self._lock:
            resident, error = _ffi().store_finish(self.id, lease, keep)
            if error:
                _ffi().store_release(self.id, lease)
                raise ValueError(error)
            self.resident = set(resident)
        return lease

    def _fetch_for_handler(self, raw: bytes) -> int:
        """`fetch` as a handler calls it back: the ids' int32 bytes in, the lease out."""
        return self.fetch(np.frombuffer(raw, np.int32))

    def fetch(self, ids) -> int:
        """Reads the experts ``ids`` route to that are not held, updates the
        resident set, and leases the call's experts: the lease (> 0) the
        handler opens and ends.  Ids outside [0, E) are not fetched."""
        ids = np.asarray(ids).reshape(-1)
        needed, counts = np.unique(ids[(ids >= 0) & (ids < self.E)], return_counts=True)
        with self._lock:
            self.calls += 1
            self._count(needed, counts)
        return self._lease(needed)

    def stats(self) -> dict:
        """calls, hits and misses (experts a call found held or read; a call
        whose experts are all held is leased by the handler alone),
        read_bytes, expert_bytes, resident_bytes (the budget), and the
        store's held figures (resident/streamed bytes and experts, leases)."""
        held = dict(_ffi().store_stats(self.id))
        fast_calls, fast_hits = held.pop("fast_calls"), held.pop("fast_hits")
        d = dict(calls=self.calls + fast_calls, hits=self.hits + fast_hits, misses=self.misses,
                 read_bytes=self.read_bytes, expert_bytes=self.expert_bytes, resident_budget=self.resident_bytes)
        d.update(held)
        return d

    def close(self) -> None:
        """Refuses later calls (naming the checkpoint); blocks still leased
        by a running call are freed when it ends, the rest now."""
        with self._lock:
            self.closed = True
            self.resident.clear()
        self._reader.shutdown(wait=True)  # reads ahead end before the blocks go
        with self._lock:
            _ffi().store_close(self.id)
        _ffi().store_set_fetch(self.id, None)
        _STORES.pop(self.id, None)
        _CLOSED[self.id] = self.name


def _refusal(error: str) -> BaseException:
    r = last_refusal()
    if r is not None and r["message"] in error:
        return DeviceOOMError(error, requested=r["requested"], free=r["free"], total=r["total"],
                              device=r["device"])
    return ValueError(error)
