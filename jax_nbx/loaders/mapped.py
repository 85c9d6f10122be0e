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
from .checkpoint import _quant_method, expert_names, one_expert, read_block
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
        info = self.info(name)
        if float_only and info.dtype not in ("F32", "BF16", "F16"):
            self.fail(name, f"tensor {name!r} has dtype {info.dtype}; expected F32, BF16, F16 "
                            "(float32, bfloat16, float16)")
        if shape is not None:
            self.expect(name, info, shape)
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
    projection names, the quantization method or None) of a per-expert checkpoint."""
    names = expert_names(reader, pfx)
    method = _quant_method(reader, f"{pfx}experts.0.{names[0]}.", quant)
    return (lambda e: one_expert(reader, pfx, e, names, method, quant)), names, method


def _mapped_experts(reader: _MappedFiles, pfx: str, E: int, H: int, quant, config: MoEConfig | None,
                    rname: str, resident_bytes: int) -> Experts:
    if reader.has(pfx + "experts.gate_up_proj_blocks") or reader.has(pfx + "switch_mlp.gate_proj.weight"):
        kind = "gpt-oss MXFP4 blocks" if reader.has(pfx + "experts.gate_up_proj_blocks") else "mlx-lm switch_mlp"
        raise CheckpointError(f"checkpoint: {reader.source}: map_moe does not map {kind} experts yet; "
                              "load_moe reads them (a copy)")
    if reader.has(pfx + "experts.gate_up_proj") or reader.has(pfx + "input_linear.weight"):
        return _mapped_fused(reader, pfx, E, H, config, resident_bytes)
    read, names, method = _per_expert_reader(reader, pfx, quant)
    g, u, d = read(0)
    quantized = isinstance(d, QuantizedWeight)
    projs = (g, u, d)
    per_proj = [_parts(m) for m in projs]
    nparts = len(per_proj[0])
    # the handlers' group order: part-major, then projection
    template = [per_proj[j][p] for p in range(nparts) for j in range(3)]
    I = int(d.shape[0]) if quantized else int(g.shape[0])
    want = [(H, I), (H, I), (I, H)] if quantized else [(I, H), (I, H), (H, I)]
    for j, (m, w) in enumerate(zip(projs, want)):
        if tuple(m.shape) != w:
            reader.fail(f"{pfx}experts.0.{names[j]}.weight",
                        f"{pfx}experts.0.{names[j]}.* has shape {tuple(m.shape)}; expected {w}")

    def read_expert(e: int) -> list[np.ndarray]:
        per = [_parts(m) for m in read(e)]
        return [per[j][p] for p in range(nparts) for j in range(3)]

    store = _open_store(reader, pfx, E, template, read_expert, resident_bytes)
    ph = store.placeholders()
    if not quantized:
        return Experts(*ph, layout="out_in")
    scales = None
    if any(m.tensor_scale is not None for m in projs):
        scales = [[tensor_scale_of(reader.get(f"{pfx}experts.{e}.{n}.weight_global_scale")) for e in range(E)]
                  for n in names]
    projections = []
    for j in range(3):
        parts = [ph[p * 3 + j] for p in range(nparts)] + [None] * (3 - nparts)
        projections.append([QuantizedWeight(*(pp[e] if pp is not None else None for pp in parts),
                                            None if scales is None else np.float32(scales[j][e]),
                                            kind=d.kind, group_size=d.group_size) for e in range(E)])
    return Experts(*projections)


def _mapped_fused(reader: _MappedFiles, pfx: str, E: int, H: int, config: MoEConfig | None,
                  resident_bytes: int) -> Experts:
    """transformers 5's fused ``gate_up_proj`` / ``down_proj`` (or Granite's
    ``input_linear`` / ``output_linear``): each expert's slab of the stacked
    tensors, in their stored layout."""
    if reader.has(pfx + "input_linear.weight"):
        gu_name, d_name, gub, db = pfx + "input_linear.weight", pfx + "output_linear.weight", None, None
    else:
        gu_name, d_name = pfx + "experts.gate_up_proj", pfx + "experts.down_proj"
        gub, db = gu_name + "_bias", d_name + "_bias"
    gu, down = reader.info(gu_name), reader.info(d_name)
    for n, t in ((gu_name, gu), (d_name, down)):
        if t.dtype not in ("F32", "BF16", "F16"):
            reader.fail(n, f"tensor {n!r} has dtype {t.dtype}; expected F32, BF16, F16")
    if len(gu.shape) != 3 or gu.shape[0] != E or H not in gu.shape[1:]:
        reader.fail(gu_name, f"tensor {gu_name!r} has shape {gu.shape}; expected [{E}, 2I, {H}] or [{E}, {H}, 2I]")
    layout = config.layout if config is not None and config.fusion else ("out_in" if gu.shape[2] == H else "in_out")
    fusion = config.fusion if config is not None and config.fusion else "concat"
    I = (gu.shape[1] if layout == "out_in" else gu.shape[2]) // 2
    reader.expect(gu_name, gu, (E, 2 * I, H) if layout == "out_in" else (E, H, 2 * I))
    reader.expect(d_name, down, (E, H, I) if layout == "out_in" else (E, I, H))
    template = [reader.get(gu_name, expert=0), reader.get(d_name, expert=0)]
    store = _open_store(reader, pfx, E, template,
                        lambda e: [reader.get(gu_name, expert=e), reader.get(d_name, expert=e)], resident_bytes)
    biases = {}
    if gub and reader.has(gub):
        biases["gate_up_bias"] = reader.get(gub, float_only=True, shape=(E, 2 * I))
    if db and reader.has(db):
        biases["down_bias"] = reader.get(db, float_only=True, shape=(E, H))
    ph = store.placeholders()
    return Experts.fused(ph[0], ph[1], fusion=fusion, layout=layout, **biases)


def _open_store(reader: _MappedFiles, pfx: str, E: int, template: list, read_expert,
                resident_bytes: int) -> ExpertStore:
    where = f"{reader.source} ({pfx}experts)"

    def checked(e: int) -> list:
        try:
            return read_expert(e)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint: {where}: expert {e} cannot be read: {err}") from err

    store = ExpertStore(where, E, [(t.dtype, t.shape) for t in template], checked, resident_bytes)
    store.reader = reader
    return store


def map_moe(checkpoint: str | os.PathLike | Sequence[str | os.PathLike], layer: int | None = None, *,
            prefix: str | None = None, config: MoEConfig | None = None,
            resident_bytes: int | str | None = None) -> MoEParams:
    """One MoE block whose routed experts stay in the checkpoint's files.

    Arguments as `load_moe`'s (families, formats and names alike), and:

      resident_bytes: the bytes of experts kept in memory between calls: the
        most often routed ones (by the ids of every call so far); an int or
        a size (``"2GB"``).  Default: the account's CPU budget
        (`jax_nbx.memory.budget`: everything stays once read while it fits).
        0 keeps nothing: every call reads its experts and frees them after.

    Returns:
      `jax_nbx.nn.MoEParams` as `load_moe`'s, whose ``experts`` hold
      `jax_nbx.expert_store.MappedArray` placeholders (per-expert, the
      stored layout) that the "cpu" backend reads through the experts'
      store.  `fused_moe` on them equals it on `load_moe`'s experts bit for
      bit.  The experts are frozen (no gradient; LoRA adapters train over
      them).  `unmap` ends them.

    Not mapped yet (CheckpointError naming them): gpt-oss's MXFP4 blocks and
    mlx-lm's stacked ``switch_mlp``; `load_moe` reads them.
    """
    budget = memory.budget() if resident_bytes is None else memory.parse_bytes(resident_bytes)
    return read_block(checkpoint, layer, prefix, config, "map_moe", _MappedFiles,
                      lambda reader, pfx, E, H, quant, cfg, rname:
                      _mapped_experts(reader, pfx, E, H, quant, cfg, rname, budget))


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
