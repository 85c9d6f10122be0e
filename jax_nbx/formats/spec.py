"""A weight format as the contract describes it (``xla_ffi/formats/``).

`Format` holds one format's spec, read from the compiled module's registry
(`jax_nbx.contract.FORMAT_SPECS`): its parts (the arrays a projection's
weights are passed as, in the handlers' group order), each part's dtypes and
per-expert shape, the packing of values along K, the group sizes and
whether the last group along K may be partial, its arithmetic and the
backends whose kernels read it.  Shape and dtype checks
are generic over the spec; each format's module adds its math
(`quantize_matrix`, `dequantize`).

A format outside the compiled contract (an experiment, the tests' toy) gives
its spec as the class attribute ``spec`` (the contract's keys but ``name``
and ``code``); it gets a code after the contract's, and with no ``kernels``
only the ``"xla"`` reference runs it (by `dequantize`): every handler
backend refuses it by name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract
from . import registry

if TYPE_CHECKING:
    from .weight import QuantizedWeight

_DTYPES = {"float32": np.dtype("float32"), "bfloat16": np.dtype(jax.numpy.bfloat16),
           "float16": np.dtype("float16"), "int8": np.dtype("int8"), "uint8": np.dtype("uint8")}


class Format:
    """One weight format (subclassed once per format, registered by name)."""

    name: str = ""
    default_group_size: int | None = None  # `jax_nbx.quantize`'s group_size=None for grouped formats
    # byte parts that may also be given in their element dtype (e.g. q as
    # jnp.float8_e4m3fn), taken bit for bit as the uint8 the spec names
    element_dtypes: dict[str, Any] = {}
    #: the spec of a format outside the compiled contract (None: the contract's)
    spec: dict[str, Any] | None = None
    #: formats that take whole groups only: the producers' rule a K that is
    #: not a multiple of the group breaks (named by the refusal)
    whole_groups_rule: str = ""

    def __init__(self) -> None:
        if self.spec is None:
            if self.name not in contract.FORMAT_CODES:
                raise ValueError(f"weight format {self.name!r} is not in the contract (xla_ffi/abi.h "
                                 f"NBX_WEIGHT_FORMATS: {contract.WEIGHT_FORMATS}) and gives no spec")
            self.code: int = contract.FORMAT_CODES[self.name]
            spec = contract.FORMAT_SPECS[self.code]
        else:
            if self.name in contract.FORMAT_CODES:
                raise ValueError(f"weight format {self.name!r} is the contract's: it takes no spec of its own")
            self.code = max(registry.next_code(), len(contract.WEIGHT_FORMATS))
            spec = dict({"summary": self.name, "tensor_scale": False, "column_scaled": False, "kernels": (),
                         "partial_groups": False}, **self.spec)
        self.summary: str = spec["summary"]
        self.parts: tuple[str, ...] = tuple(p["name"] for p in spec["parts"])
        self.part_dtypes: dict[str, tuple[np.dtype, ...]] = {
            p["name"]: tuple(_DTYPES[d] for d in p["dtypes"]) for p in spec["parts"]}
        self._rows = {p["name"]: p["rows"] for p in spec["parts"]}
        self._ties = {p["name"]: self.parts[p["same_dtype_as"]]
                      for p in spec["parts"] if p["same_dtype_as"] >= 0}
        self.values_per_byte: int = spec["values_per_byte"]
        self.group_sizes: tuple[int, ...] = tuple(spec["group_sizes"])
        # whether K need not be a multiple of the group: the last group then
        # covers the remaining K % group rows, the per-group parts have
        # ceil(K / group) rows (xla_ffi/formats/format.h partial_groups)
        self.partial_groups: bool = bool(spec["partial_groups"])
        # the part whose dtype the weights compute in; None: float32 (scales
        # that are no float type, e.g. mxfp4's E8M0 bytes)
        cp = spec["compute_dtype_part"]
        self.compute_part: str | None = self.parts[cp] if cp >= 0 else None
        # whether a matrix may carry a float32 tensor scale (QuantizedWeight.tensor_scale)
        self.takes_tensor_scale: bool = bool(spec["tensor_scale"])
        # its arithmetic: sums of a * q, each column's sum times its scale (int8)
        self.column_scaled: bool = bool(spec["column_scaled"])
        # the backends whose kernels read it ("cpu", "metal", "cuda"); the
        # "xla" reference reads every format through `dequantize`
        self.kernels: frozenset[str] = frozenset(spec["kernels"])

    @property
    def grouped(self) -> bool:
        """Whether the format takes a group size along K."""
        return bool(self.group_sizes)

    def part_shape(self, part: str, K: int, N: int, group: int | None) -> tuple[int, ...]:
        """One expert's ``part`` of a ``[K, N]`` matrix."""
        rows = self._rows[part]
        if rows == "none":
            return (N,)
        return ({"K": K, "packed_K": K // self.values_per_byte,
                 "groups": self.num_groups(K, group)}[rows], N)

    @staticmethod
    def num_groups(K: int, group: int | None) -> int:
        """Groups along a K of ``group`` rows: one per started group,
        ``ceil(K / group)`` (0 without groups)."""
        return -(-K // group) if group else 0

    def grouped_rows(self, w: jax.Array, group: int) -> jax.Array:
        """``w [..., K, N]`` as ``[..., ceil(K/group), group, N]``: a partial
        last group padded with copies of its last real row, so its every
        statistic (largest magnitude, minimum, maximum) is the one of its real
        rows alone; the quantizers drop the padding's codes."""
        K, N = w.shape[-2:]
        G = self.num_groups(K, group)
        if G * group != K:
            w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, G * group - K), (0, 0)], mode="edge")
        return w.reshape(w.shape[:-2] + (G, group, N))

    @staticmethod
    def quotient(x: jax.Array, c: float) -> jax.Array:
        """``x / c`` rounded once, as IEEE division (torch, numpy, MLX) gives
        it: the producers' scales (``amax / 448``, ``amax / 127`` ...).  XLA's
        CPU compiler rewrites a division by a constant into a product with the
        rounded reciprocal (and a division by a broadcast scalar into a
        product with its reciprocal), one ulp off for about half of all
        ``x``: the divisor is a whole array behind a barrier."""
        return jax.lax.div(x, jax.lax.optimization_barrier(jnp.full_like(x, c)))

    @staticmethod
    def non_finite(groups: jax.Array) -> jax.Array:
        """Whether each group of rows holds a NaN or infinity: ``[..., G,
        group, N]`` -> ``[..., G, N]`` (a matrix ``[..., K, N]``: its columns,
        ``[..., N]``).  The quantizers give such a group a NaN scale (float
        NaN, E8M0 255, E4M3 0x7F) and codes 0, so that every weight of it
        dequantizes to NaN: `jax_nbx.quantize` refuses non-finite weights on
        concrete arrays, and under ``jax.jit`` carries them through this way."""
        return ~jnp.all(jnp.isfinite(groups), axis=-2)

    @staticmethod
    def group_rows(part: jax.Array, group: int, K: int) -> jax.Array:
        """A per-group part ``[..., ceil(K/group), N]`` repeated over each
        group's rows: ``[..., K, N]`` (row k holds group k // group's)."""
        return jnp.repeat(part, group, axis=-2)[..., :K, :]

    def logical_shape(self, q_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The dense matrix's shape (leading axes kept) from its q part's."""
        q_shape = tuple(q_shape)
        return q_shape[:-2] + (q_shape[-2] * self.values_per_byte, q_shape[-1])

    def check_group_size(self, group_size: int | None, K: int | None = None, what: str = "") -> None:
        """ValueError unless ``group_size`` fits the format and K: a multiple
        of it (any K for formats with partial groups), and of the values
        packed per byte."""
        if not self.grouped:
            if group_size not in (None, 0):
                raise ValueError(f"{what}{self.name} weights take no group_size; got {group_size}")
            return
        if group_size not in self.group_sizes:
            raise ValueError(f"{what}group_size must be one of {self.group_sizes} for {self.name}; "
                             f"got {group_size}")
        if K is None:
            return
        if K % self.values_per_byte:
            raise ValueError(f"{what}{self.name} packs {self.values_per_byte} values per byte along K: "
                             f"K={K} must be a multiple of {self.values_per_byte}")
        if K % group_size and not self.partial_groups:
            rule = f": {self.whole_groups_rule}" if self.whole_groups_rule else ""
            raise ValueError(f"{what}{self.name} takes whole groups along K: K={K} is not divisible by "
                             f"group_size={group_size}{rule}")

    def validate(self, w: QuantizedWeight, where: str) -> None:
        """TypeError/ValueError naming ``where`` unless ``w``'s arrays fit the
        spec: each part present (and no other), its dtype one of the part's,
        tied parts sharing a dtype, each shape the spec's for the logical
        ``[..., K, N]``, and the group size one of the format's."""
        arrays = {"q": w.q, "scale": w.scale, "zero": w.zero}
        for part in contract.PARTS:
            if part not in self.parts and arrays[part] is not None:
                raise ValueError(f"{where}: {self.name} weights take no {part} part")
            if part in self.parts and arrays[part] is None:
                raise ValueError(f"{where}.{part} is missing ({self.name} weights have parts "
                                 f"{self.parts})")
        q = arrays["q"]
        lead = tuple(q.shape[:-2])
        K, N = self.logical_shape(q.shape)[-2:]
        self.check_group_size(w.group_size, K, f"{where}: ")
        for part in self.parts:
            a = arrays[part]
            dt = np.dtype(a.dtype)
            alias = self.element_dtypes.get(part)
            if alias is not None and dt == np.dtype(alias):
                dt = np.dtype(np.uint8)
            if dt not in self.part_dtypes[part]:
                names = " or ".join([d.name for d in self.part_dtypes[part]]
                                    + ([np.dtype(alias).name] if alias is not None else []))
                raise TypeError(f"{where}.{part} has dtype {a.dtype}; {self.name} weights need {names}")
            tie = self._ties.get(part)
            if tie is not None and dt != np.dtype(arrays[tie].dtype):
                raise TypeError(f"{where}.{part} has dtype {a.dtype}; expected the {tie}'s "
                                f"{arrays[tie].dtype}")
            want = lead + self.part_shape(part, K, N, w.group_size)
            if tuple(a.shape) != want:
                raise ValueError(f"{where}.{part} has shape {tuple(a.shape)}; expected {want} "
                                 f"({self.name}, K={K}, N={N}"
                                 + (f", group_size={w.group_size})" if self.grouped else ")"))
        ts = w.tensor_scale
        if ts is not None:
            if not self.takes_tensor_scale:
                takers = [s["name"] for s in contract.FORMAT_SPECS if s["tensor_scale"]]
                raise ValueError(f"{where}: {self.name} weights take no tensor_scale (only {takers} do)")
            if np.dtype(ts.dtype) != np.float32 or tuple(ts.shape) != lead:
                raise TypeError(f"{where}.tensor_scale must be float32 of shape {lead} (one per "
                                f"expert); got {np.dtype(ts.dtype).name} {tuple(ts.shape)}")

    # --- each format's math ------------------------------------------------------------
    def quantize_matrix(self, w: jax.Array, group_size: int | None, scale_dtype: Any) -> QuantizedWeight:
        """``w [..., K, N]`` (float32) quantized."""
        raise NotImplementedError(f"{self.name} weights are not made by jax_nbx.quantize")

    def dequantize(self, w: QuantizedWeight) -> jax.Array:
        """The dense float32 ``[..., K, N]`` of ``w``."""
        raise NotImplementedError(f"{self.name} has no dequantization")

    def __repr__(self) -> str:
        return f"Format({self.name!r})"
