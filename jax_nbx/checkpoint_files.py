"""Reading a checkpoint's files without trusting them: the one place where
every loader opens a JSON file (`read_json`), checks the type of a config
value (`check_value`, `config_value`) and opens a safetensors file
(`SafetensorsFile`: its header checked against the file's size first).

Whatever is malformed -- a file that is not JSON or whose top level is not an
object, a value of the wrong type, a safetensors header whose length, dtypes,
shapes or data offsets do not fit the file, a tensor the ``safetensors``
library cannot build -- raises `CheckpointError` naming the file and the key
or the byte offset.  No more than the file's size is read or allocated to
find out: a safetensors header is read only after its declared length is
checked against the file's size, and its tensors' offsets and sizes are
checked before any tensor is read.

The safetensors format: an 8-byte little-endian header length N, N bytes of
JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``), then the data; the offsets are relative to the data's start,
and the tensors cover the data exactly (sorted by offset, each beginning where
the previous one ends), as the ``safetensors`` library (0.8) requires.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "read_json", "check_value", "config_value", "REQUIRED", "safetensors_header",
           "SafetensorsFile", "CheckpointFiles", "TensorInfo", "DTYPE_BITS", "FLOAT_CODES"]


class CheckpointError(ValueError):
    """A checkpoint file is malformed or does not hold what the block needs: a
    missing, mis-shaped or mis-typed tensor, a config value that cannot be read,
    a file that is not what its name says.  The message names the file and the
    key, tensor or byte offset."""


def _show(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------ JSON

@contextlib.contextmanager
def _reading(path: str):
    """Opening and reading ``path``: FileNotFoundError naming it when there
    is no such file, CheckpointError for any other OSError."""
    try:
        yield
    except FileNotFoundError as err:
        raise FileNotFoundError(f"checkpoint: {path} does not exist") from err
    except OSError as err:
        raise CheckpointError(f"checkpoint: {path} cannot be read: {err}") from err


def _parse(raw: bytes, path: str, offset: int, what: str):
    """The JSON value of ``raw``, bytes ``offset``.. of file ``path``
    (``what``: "the file", "the header"); CheckpointError naming the byte
    when it is not UTF-8 or not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"checkpoint: {path}: {what} is not UTF-8 (byte {offset + err.start})") from err
    return _loads(text, path, offset)


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object of file ``path``.  FileNotFoundError when there is no
    such file; CheckpointError naming the file when it cannot be read, is not
    UTF-8 or JSON (the byte offset), or its top level is not an object."""
    path = os.fspath(path)
    with _reading(path):
        with open(path, "rb") as f:
            raw = f.read()
    value = _parse(raw, path, 0, "the file")
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint: {path}: the top level is a JSON {_json_type(value)}, not an object")
    return value


def _loads(text: str, path: str, base: int):
    """json.loads, its errors as CheckpointError at the byte offset (``base``: the text's first byte)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        at = base + len(text[:err.pos].encode("utf-8"))
        raise CheckpointError(f"checkpoint: {path} is not valid JSON at byte {at} (line {err.lineno}, column "
                              f"{err.colno}): {err.msg}") from err
    except (RecursionError, ValueError) as err:  # nested too deeply; an integer of too many digits
        raise CheckpointError(f"checkpoint: {path}: JSON at byte {base} cannot be read: "
                              f"{type(err).__name__}: {err}") from err


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


# ------------------------------------------------------------------------------------ config values

REQUIRED = object()  # config_value's default: the key must be there

_KINDS = {"dict": (dict, "a JSON object"), "list": (list, "a JSON array"), "str": (str, "a string"),
          "bool": ((bool, np.bool_), "a boolean")}


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer too large for a float
        return False


def check_value(v: Any, label: str, where: str, kind: str, *, minimum: int | None = None,
                positive: bool = False, choices: tuple | None = None) -> Any:
    """``v`` (a config value named ``label``) if it is of ``kind`` -- ``"int"``
    (not a boolean; ``>= minimum``), ``"number"`` (finite, not a boolean;
    ``> 0`` when ``positive``), ``"bool"``, ``"str"`` (one of ``choices``),
    ``"dict"``, ``"list"``; else CheckpointError ``"{where}: {label}={v!r} is
    not ..."``."""
    if kind == "int":
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) \
            and (minimum is None or v >= minimum)
        what = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
    elif kind == "number":
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
            and _finite(v) and (not positive or v > 0)
        what = "a positive finite number" if positive else "a finite number"
    else:
        types, what = _KINDS[kind]
        ok = isinstance(v, types) and (choices is None or v in choices)
        if choices is not None:
            what = f"one of {', '.join(map(repr, choices))}"
    if not ok:
        raise CheckpointError(f"{where}: {label}={_show(v)} is not {what}")
    return v


def config_value(cfg: dict, key: str, where: str, kind: str, default: Any = REQUIRED, *, section: str = "",
                 nullable: bool = False, **checks) -> Any:
    """``cfg[key]`` checked by `check_value` (named ``section.key``); ``default``
    when the key is absent (`REQUIRED`: CheckpointError naming the missing
    key), or null and ``nullable`` (else null is refused like any other
    value of the wrong type)."""
    label = f"{section}.{key}" if section else key
    if key not in cfg or (nullable and cfg[key] is None):
        if default is REQUIRED:
            raise CheckpointError(f"{where}: {label} is missing")
        return default
    return check_value(cfg[key], label, where, kind, **checks)


# ------------------------------------------------------------------------------------- safetensors

# safetensors 0.8's dtypes and their sizes in bits
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# dtypes safetensors' numpy/flax readers (0.8) cannot build (they look for numpy.float8_*): read here
# from the bytes the checked header places
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu}
MAX_HEADER = 100_000_000  # safetensors' own limit on the header length


class TensorInfo(NamedTuple):
    """One tensor of a checked header: its dtype code, shape, and byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


_HEADERS: collections.OrderedDict = collections.OrderedDict()  # (path, identity) -> checked header
_HEADER_CACHE = 64  # files whose checked headers are kept (a sharded checkpoint's, read once per layer)


def safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of safetensors file ``path``, its header checked against
    the file's size (only the 8 length bytes and the header are read).
    FileNotFoundError when there is no such file; CheckpointError naming the
    file and the byte offset or tensor for anything else.  The last 64
    files' checked headers are kept, each under the file's identity (device,
    inode, size, modification time): a file that changed is read again."""
    path = os.fspath(path)
    with _reading(path):
        st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _HEADERS:
        _HEADERS.move_to_end(key)
        return dict(_HEADERS[key])
    out = _read_header(path)
    _HEADERS[key] = out
    while len(_HEADERS) > _HEADER_CACHE:
        _HEADERS.popitem(last=False)
    return dict(out)


def _read_header(path: str) -> dict[str, TensorInfo]:

    def bad(msg):
        raise CheckpointError(f"checkpoint: {path}: {msg}")

    with _reading(path):
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                bad(f"{size} bytes: too short for safetensors' 8-byte header length (truncated, or not a "
                    "safetensors file)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                bad(f"the header length {n} (bytes 0..8) runs past the end of the file ({size} bytes: "
                    "truncated, or not a safetensors file)")
            if n > MAX_HEADER:
                bad(f"the header length {n} (bytes 0..8) exceeds safetensors' limit of {MAX_HEADER} bytes")
            raw = fh.read(n)
    if len(raw) != n:
        bad(f"the header (bytes 8..{8 + n}) ends at byte {8 + len(raw)}: the file changed while being read")
    header = _parse(raw, path, 8, "the header")
    if not isinstance(header, dict):
        bad(f"the header (bytes 8..{8 + n}) is a JSON {_json_type(header)}, not an object")
    data_len = size - 8 - n
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        bad(f"__metadata__={_show(meta)} is not an object of strings")
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        out[name] = _tensor_info(name, info, 8 + n, data_len, bad)
    end = 0
    for name, t in sorted(out.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != 8 + n + end:
            what = "overlapping the tensors before it" if t.start < 8 + n + end else "leaving a gap"
            bad(f"tensor {name!r} data_offsets begin at {t.start - 8 - n} but the tensors before it end at {end}: "
                f"{what} (safetensors' tensors cover the data contiguously)")
        end = t.end - 8 - n
    if end != data_len:
        bad(f"the tensors cover {end} bytes of data but the file holds {data_len} after its header "
            f"(bytes {8 + n}..{size})")
    return out


def _tensor_info(name: str, info: Any, base: int, data_len: int, bad) -> TensorInfo:
    if not isinstance(info, dict):
        bad(f"tensor {name!r}: {_show(info)} is not an object of dtype, shape, data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        bad(f"tensor {name!r} has dtype {_show(dtype)}, not a safetensors dtype ({', '.join(DTYPE_BITS)})")

    def counts(v, k):
        return isinstance(v, list) and (k is None or len(v) == k) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)

    if not counts(shape, None):
        bad(f"tensor {name!r} has shape {_show(shape)}: not a list of non-negative integers")
    if not counts(offsets, 2) or offsets[0] > offsets[1]:
        bad(f"tensor {name!r} has data_offsets {_show(offsets)}: not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_len:
        bad(f"tensor {name!r} data_offsets [{begin}, {end}] run past the end of the file (its data is "
            f"{data_len} bytes, from byte {base})")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        size = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits"
        bad(f"tensor {name!r} ({dtype} {_show(list(shape))}: {size}) does not fit its data_offsets "
            f"[{begin}, {end}] ({end - begin} bytes)")
    return TensorInfo(dtype, tuple(shape), base + begin, base + end)


class SafetensorsFile:
    """A safetensors file read through `safetensors_header` (checked at once)
    and ``safetensors.safe_open`` (``framework``: "numpy" or "flax"; opened on
    the first tensor read); every error a CheckpointError naming the file."""

    def __init__(self, path: str | os.PathLike, framework: str = "numpy"):
        try:
            import safetensors  # noqa: F401
        except ModuleNotFoundError as err:
            raise ImportError("jax_nbx.loaders needs safetensors: pip install 'jax_nbx[hf]'") from err
        self.path = os.fspath(path)
        self.framework = framework
        self.tensors = safetensors_header(self.path)
        self._handle = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str):
        """Tensor ``name`` (a numpy or jax array as ``framework``)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"checkpoint: {self.path} holds no tensor {name!r}")
        if info.dtype in _RAW_DTYPES:
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(info.start)
                    buf = fh.read(info.end - info.start)
            except OSError as err:
                raise CheckpointError(f"checkpoint: {self.path}: tensor {name!r} cannot be read: {err}") from err
            if len(buf) != info.end - info.start:
                raise CheckpointError(f"checkpoint: {self.path}: tensor {name!r} (bytes {info.start}..{info.end}) "
                                      "is cut short: the file changed while being read")
            return np.frombuffer(buf, dtype=_RAW_DTYPES[info.dtype]).reshape(info.shape)
        from safetensors import SafetensorError, safe_open
        try:
            if self._handle is None:
                self._handle = safe_open(self.path, framework=self.framework)
            return self._handle.get_tensor(name)
        except (SafetensorError, OSError, KeyError, AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint: {self.path}: tensor {name!r} ({info.dtype} {list(info.shape)}) "
                                  f"cannot be read: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        self._handle = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FLOAT_CODES = ("F32", "BF16", "F16")  # the weights' dtypes: float32, bfloat16, float16


class CheckpointFiles:
    """The tensors of a checkpoint's safetensors files, by name: ``wmap`` (name
    -> file: an index's weight_map) or else every file's header (checked when
    the checkpoint is opened).  A file is opened when first needed;
    ``source`` (the folder, index or file) is what a missing tensor is
    missing from.  Every error is a CheckpointError naming the file."""

    def __init__(self, files: list[str], wmap: dict | None = None, source: str | None = None,
                 framework: str = "flax"):
        self.files, self.framework = files, framework
        self.source = source or (files[0] if len(files) == 1 else f"{len(files)} files ({', '.join(files[:3])}"
                                 + (", ..." if len(files) > 3 else "") + ")")
        self._open: dict[str, SafetensorsFile] = {}
        if wmap is None:
            wmap = {}
            for f in files:
                wmap.update(dict.fromkeys(self._file(f).keys(), f))
        self.wmap = wmap

    def _file(self, f: str) -> SafetensorsFile:
        if f not in self._open:
            self._open[f] = SafetensorsFile(f, self.framework)
        return self._open[f]

    def has(self, name: str) -> bool:
        return name in self.wmap

    def file_of(self, name: str) -> str:
        """The file holding ``name`` (the checkpoint's source when none does)."""
        return self.wmap.get(name, self.source)

    def fail(self, name: str, msg: str):
        """CheckpointError ``msg`` about tensor ``name``, naming its file."""
        raise CheckpointError(f"checkpoint: {self.file_of(name)}: {msg}")

    def info(self, name: str) -> TensorInfo:
        if name not in self.wmap:
            raise CheckpointError(f"checkpoint: tensor {name!r} is missing from {self.source}")
        f = self._file(self.wmap[name])
        if name not in f:
            raise CheckpointError(f"checkpoint: {self.source} maps tensor {name!r} to {f.path}, which does not "
                                  "hold it")
        return f.tensors[name]

    def get(self, name: str, *, float_only: bool = False, shape: tuple | None = None):
        """Tensor ``name``; ``float_only``: its dtype must be float32, bfloat16 or
        float16; ``shape``: its shape must be this (both checked from the header,
        before reading)."""
        self.checked_info(name, float_only, shape)
        return self._file(self.wmap[name]).get(name)

    def checked_info(self, name: str, float_only: bool = False, shape: tuple | None = None) -> TensorInfo:
        """`info` of tensor ``name``, its dtype and shape checked as `get` checks them."""
        info = self.info(name)
        if float_only and info.dtype not in FLOAT_CODES:
            self.fail(name, f"tensor {name!r} has dtype {info.dtype}; expected {', '.join(FLOAT_CODES)} "
                            "(float32, bfloat16, float16)")
        if shape is not None:
            self.expect(name, info, shape)
        return info

    def expect(self, name: str, t, shape: tuple) -> None:
        """CheckpointError naming the file unless ``t`` (an array or TensorInfo) has ``shape``."""
        if tuple(t.shape) != tuple(shape):
            self.fail(name, f"tensor {name!r} has shape {tuple(t.shape)}; expected {tuple(shape)}")

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
