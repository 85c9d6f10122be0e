"""Experts read in place from a checkpoint's files (`map_moe`).

`map_moe` reads what `load_moe` reads -- the router, biases, shared experts
-- but leaves the routed experts in the files: it returns them as an
`Experts` of `jax_nbx.expert_store.MappedArray` placeholders backed by an
`ExpertStore`, which reads an expert (its tensors' byte ranges, converted by
the same code as `load_moe`'s) when a call first routes to it, and keeps the
most routed experts resident up to ``resident_bytes`` (docs/memory.md
"Mapped experts").

The files are read with explicit reads (``pread``), never memory-mapped: a
file truncated, replaced or rewritten after `map_moe` cannot crash the
process (no SIGBUS) and cannot feed stale bytes to a call.  Each read first
checks the file against the identity recorded when it was mapped (device,
inode, size, modification time) and raises `CheckpointError` naming the file
when it changed; an expert read earlier stays what it was when read.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from .. import memory
from ..checkpoint_files import _RAW_DTYPES, CheckpointError, CheckpointFiles
from ..expert_store import ExpertStore, store_of
from ..experts import Experts
from ..formats import QuantizedWeight, get
from ..formats.minifloat import as_bytes
from ..nn.block import MoEConfig, MoEParams
from .checkpoint import _experts, _quant_method, expert_names, one_expert, read_block, stacked_experts
from .gpt_oss import gpt_oss_biases
from .nvfp4_import import tensor_scale_of

__all__ = ["map_moe", "unmap"]

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
          "I8": np.int8, "U8": np.uint8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
          "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_, **_RAW_DTYPES}
_CHUNK = 1 << 30  # bytes per pread (Linux reads at most ~2 GiB at once)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _MappedFiles(CheckpointFiles):
    """A checkpoint's tensors read with ``pread``, each file checked against
    its identity when the reader was opened (`_identity`); a stacked
    tensor's expert read alone (``expert=``)."""

    def __init__(self, files: list[str], wmap: dict | None, source: str | None):
        self.identity = {}
        for f in files:
            try:
                self.identity[f] = _identity(os.stat(f))
            except OSError as err:
                raise CheckpointError(f"checkpoint: {f} cannot be read: {err}") from err
        super().__init__(files, wmap, source, framework="numpy")

    def get(self, name: str, *, float_only: bool = False, shape: tuple | None = None, expert: int | None = None):
        info = self.checked_info(name, float_only, shape)
        if info.dtype not in _NUMPY:
            self.fail(name, f"tensor {name!r} has dtype {info.dtype}, which jax_nbx does not read")
        start, end, dims = info.start, info.end, info.shape
        if expert is not None:
            per = (end - start) // dims[0]
            start, end, dims = start + expert * per, start + (expert + 1) * per, dims[1:]
        raw = self._pread(self.wmap[name], start, end, name)
        return np.frombuffer(raw, dtype=_NUMPY[info.dtype]).reshape(dims)

    def _pread(self, path: str, start: int, end: int, name: str) -> bytearray:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise CheckpointError(f"checkpoint: {path} cannot be opened any more ({err}); its experts were "
                                  "mapped from it: map the checkpoint again") from err
        try:
            now = _identity(os.fstat(fd))
            if now != self.identity[path]:
                what = ("replaced (another file now has its name)" if now[:2] != self.identity[path][:2] else
                        f"truncated or extended ({self.identity[path][2]} -> {now[2]} bytes)"
                        if now[2] != self.identity[path][2] else "rewritten (its modification time changed)")
                raise CheckpointError(f"checkpoint: {path} changed since its experts were mapped: {what}; "
                                      f"tensor {name!r} is not read from it: map the checkpoint again")
            buf = bytearray(end - start)
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = os.preadv(fd, [view[got:got + _CHUNK]], start + got)
                if n <= 0:
                    raise CheckpointError(f"checkpoint: {path}: tensor {name!r} (bytes {start}..{end}) ends at "
                                          f"byte {start + got}: the file was cut short after it was mapped")
                got += n
            return buf
        except OSError as err:
            raise CheckpointError(f"checkpoint: {path}: tensor {name!r} cannot be read: {err}") from err
        finally:
            os.close(fd)

    def close(self) -> None:  # the reader lives as long as its store: nothing is held open
        pass


def _parts(m) -> list[np.ndarray]:
    """A projection's arrays in the handlers' part order (dense: itself)."""
    if not isinstance(m, QuantizedWeight):
        return [np.asarray(m)]
    return [np.asarray(as_bytes(getattr(m, p))) for p in get(m.kind).parts]


def _per_expert_reader(reader: _MappedFiles, pfx: str, quant):
    """(read(e) -> expert e's (gate, up, down) as `load_moe` gives them, the
    projection names) of a per-expert checkpoint."""
    names = expert_names(reader, pfx)
    method = _quant_method(reader, f"{pfx}experts.0.{names[0]}.", quant)
    return (lambda e: one_expert(reader, pfx, e, names, method, quant)), names


class _ExpertView:
    """One expert of a block whose expert tensors are stacked ``[E, ...]``
    (gpt-oss's MXFP4 blocks, transformers 5's fused tensors, mlx-lm's
    ``switch_mlp``), as a reader of a 1-expert block: each such tensor (a name
    under the block's prefix other than the router's, with E rows) reads as
    expert ``e``'s slab ``[1, ...]``, only its bytes; `load_moe`'s builders
    run on it unchanged."""

    def __init__(self, reader: _MappedFiles, pfx: str, rname: str, E: int, e: int):
        self.reader, self.pfx, self.rname, self.E, self.e = reader, pfx, rname, E, e
        self.wmap, self.source = reader.wmap, reader.source

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def fail(self, name: str, msg: str):
        self.reader.fail(name, msg)

    def _stacked(self, name: str, info) -> bool:
        return (name.startswith(self.pfx) and name != self.rname and len(info.shape) >= 1
                and info.shape[0] == self.E)

    def info(self, name: str):
        info = self.reader.info(name)
        return info._replace(shape=(1,) + info.shape[1:]) if self._stacked(name, info) else info

    def get(self, name: str, *, float_only: bool = False, shape: tuple | None = None):
        info = self.info(name)
        if shape is not None:
            self.expect(name, info, shape)
        if not self._stacked(name, self.reader.info(name)):
            return self.reader.get(name, float_only=float_only)
        return self.reader.get(name, float_only=float_only, expert=self.e)[None]

    def expect(self, name: str, t, shape: tuple) -> None:
        self.reader.expect(name, t, shape)


def _stacked_reader(reader: _MappedFiles, pfx: str, E: int, H: int, quant, config: MoEConfig | None,
                    rname: str):
    """read(e) -> expert e's 1-expert `Experts` as `load_moe` builds the whole block's."""
    return lambda e: _experts(_ExpertView(reader, pfx, rname, E, e), pfx, 1, H, quant, config, rname)


def _projections(experts: Experts) -> list:
    """The projections of a stacked 1-expert `Experts` (`Experts.flat` order: gate, up, down or
    gate_up, down), its one expert's each."""
    return [m[0] for m in experts.flat()]


def _mapped_experts(reader: _MappedFiles, pfx: str, E: int, H: int, quant, config: MoEConfig | None,
                    rname: str, budgets: tuple[int, int | None]) -> Experts:
    per_expert = not stacked_experts(reader, pfx)
    if per_expert:
        read, names = _per_expert_reader(reader, pfx, quant)
        projs = list(read(0))
    else:
        one = _stacked_reader(reader, pfx, E, H, quant, config, rname)
        first = one(0)
        read = lambda e: _projections(one(e))  # noqa: E731
        projs = _projections(first)
    quantized = isinstance(projs[-1], QuantizedWeight)
    per_proj = [_parts(m) for m in projs]
    nparts, ngroups = len(per_proj[0]), len(projs)
    # the handlers' group order: part-major, then projection
    template = [per_proj[j][p] for p in range(nparts) for j in range(ngroups)]
    if per_expert:
        g, u, d = projs
        I = int(d.shape[0]) if quantized else int(g.shape[0])
        want = [(H, I), (H, I), (I, H)] if quantized else [(I, H), (I, H), (H, I)]
        for j, (m, w) in enumerate(zip(projs, want)):
            if tuple(m.shape) != w:
                reader.fail(f"{pfx}experts.0.{names[j]}.weight",
                            f"{pfx}experts.0.{names[j]}.* has shape {tuple(m.shape)}; expected {w}")

    def read_expert(e: int) -> list[np.ndarray]:
        per = [_parts(m) for m in read(e)]
        return [per[j][p] for p in range(nparts) for j in range(ngroups)]

    store = _open_store(reader, pfx, E, template, read_expert, budgets)
    ph = store.placeholders()
    biases = {} if per_expert else _biases(reader, pfx, first, E, H)
    if not quantized:
        if per_expert:
            return Experts(*ph, layout="out_in")
        if first.is_fused:
            return Experts.fused(ph[0], ph[1], fusion=first.fusion, layout=first.layout, **biases)
        return Experts(*ph, layout=first.layout, **biases)
    d = projs[-1]
    scales = None
    if per_expert and any(m.tensor_scale is not None for m in projs):
        scales = [[tensor_scale_of(reader.get(f"{pfx}experts.{e}.{n}.weight_global_scale")) for e in range(E)]
                  for n in names]
    elif any(m.tensor_scale is not None for m in projs):
        raise CheckpointError(f"checkpoint: {reader.source}: stacked experts with tensor scales are not mapped yet; "
                              "load_moe reads them")
    projections = []
    for j in range(3):
        parts = [ph[p * 3 + j] for p in range(nparts)] + [None] * (3 - nparts)
        projections.append([QuantizedWeight(*(pp[e] if pp is not None else None for pp in parts),
                                            None if scales is None else np.float32(scales[j][e]),
                                            kind=d.kind, group_size=d.group_size) for e in range(E)])
    return Experts(*projections, **biases)


def _biases(reader: _MappedFiles, pfx: str, first: Experts, E: int, H: int) -> dict:
    """The biases of a stacked block, all E experts' (small: read at map time), as `load_moe` gives them."""
    if not first.has_bias:
        return {}
    I = first.intermediate
    if reader.has(pfx + "experts.gate_up_proj_blocks"):  # gpt-oss: de-interleaved, float32
        names = [pfx + "experts.gate_up_proj_bias", pfx + "experts.down_proj_bias"]
        try:
            return gpt_oss_biases(*(reader.get(n, float_only=True) if reader.has(n) else None for n in names),
                                  E, H, I)
        except ValueError as err:
            reader.fail(names[0], f"{pfx}experts.*_bias: {err}")
    out = {}
    for key, name, shape in (("gate_up_bias", "experts.gate_up_proj_bias", (E, 2 * I)),
                             ("down_bias", "experts.down_proj_bias", (E, H))):
        if getattr(first, key) is not None:
            out[key] = reader.get(pfx + name, float_only=True, shape=shape)
    return out


def _open_store(reader: _MappedFiles, pfx: str, E: int, template: list, read_expert,
                budgets: tuple[int, int | None]) -> ExpertStore:
    where = f"{reader.source} ({pfx}experts)"

    def checked(e: int) -> list:
        try:
            return read_expert(e)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint: {where}: expert {e} cannot be read: {err}") from err

    store = ExpertStore(where, E, [(t.dtype, t.shape) for t in template], checked, *budgets)
    store.reader = reader
    return store


def map_moe(checkpoint: str | os.PathLike | Sequence[str | os.PathLike], layer: int | None = None, *,
            prefix: str | None = None, config: MoEConfig | None = None,
            resident_bytes: int | str | None = None, stream_bytes: int | str | None = None) -> MoEParams:
    """One MoE block whose routed experts stay in the checkpoint's files.

    Arguments as `load_moe`'s (families, formats and names alike), and:

      resident_bytes: the bytes of experts kept in memory between calls: the
        most often routed ones (by the ids of every call so far); an int or
        a size (``"2GB"``).  Default: the account's CPU budget
        (`jax_nbx.memory.budget`: everything stays once read while it fits).
        0 keeps nothing: every call reads its experts and frees them after.
      stream_bytes: the most bytes of experts that are not resident a call
        holds at once: its experts are then read in passes of
        ``stream_bytes / 2`` (the next pass's read ahead while one computes),
        one handler call per pass, the passes' outputs summed in float32
        (one pass: the same bits; more: the sum's rounding).  Default None:
        one pass, every expert the call routes to held at once (the
        account's budget still refuses what does not fit).

    Returns:
      `jax_nbx.nn.MoEParams` as `load_moe`'s, whose ``experts`` hold
      `jax_nbx.expert_store.MappedArray` placeholders (per-expert, the
      stored layout) that the "cpu" backend reads through the experts'
      store.  `fused_moe` on them equals it on `load_moe`'s experts bit for
      bit.  The experts are frozen (no gradient; LoRA adapters train over
      them).  `unmap` ends them.

    Stacked checkpoints (gpt-oss's MXFP4 blocks, transformers 5's fused
    tensors, mlx-lm's ``switch_mlp``) are read one expert's slab at a time.
    """
    budgets = (memory.budget() if resident_bytes is None else memory.parse_bytes(resident_bytes),
               None if stream_bytes is None else memory.parse_bytes(stream_bytes))
    return read_block(checkpoint, layer, prefix, config, "map_moe", _MappedFiles,
                      lambda reader, pfx, E, H, quant, cfg, rname:
                      _mapped_experts(reader, pfx, E, H, quant, cfg, rname, budgets))


def store_of_experts(experts: Experts) -> ExpertStore:
    """The `ExpertStore` behind mapped experts (ValueError for others)."""
    sid = store_of(experts)
    if not sid:
        raise ValueError("these experts are not mapped (jax_nbx.loaders.map_moe)")
    return ExpertStore.get(sid)


def unmap(experts: Experts) -> None:
    """Ends mapped experts: later calls on them raise naming the checkpoint;
    blocks a running call still reads are freed when it ends."""
    store_of_experts(experts).close()
