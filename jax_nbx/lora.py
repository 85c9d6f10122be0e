"""LoRA adapters on the routed experts' projections (`LoRA`).

Each adapted projection of expert ``e`` computes ``x @ W_e + s * (x @ A_e) @ B_e``
(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; the
scale ``s = alpha / r`` as PEFT's ``LoraLayer`` sets it).  ``A_e`` is
``[in, r]`` and ``B_e`` is ``[r, out]`` *as matrices* (``x @ A``): PEFT stores
``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` (``nn.Linear``), which
`from_peft` transposes once.  The base experts may be dense or quantized; they
are not changed.

Where the adapters run: ``fused_moe(..., lora=)`` (`jax_nbx.ops`) on every
backend (abi.h "LoRA adapters"): the CPU handler (forward and fused
backward), the CUDA kernels and the Metal kernels (forward; their gradients
from the reference's VJP), and the "xla" reference (docs/lora.md).
Dropout on the adapters' input is left to the caller: it would be a
different mask per (token, expert) slot, which one call cannot
take from outside without a ``[T*k, H]`` array; apply it to x before the
block if wanted.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .experts import FLOAT_DTYPES, Experts

__all__ = ["LoRA", "LoRASpec", "PROJECTIONS", "validate_lora", "merge_lora"]

#: the projections an adapter may target, in the order the pytree holds them
PROJECTIONS = ("gate", "up", "down")


def _scale(name: str, s) -> float:
    """A projection's scale as a finite float; ValueError naming it otherwise
    (a bool or a string is no scale)."""
    try:
        v = float(s) if not isinstance(s, (bool, str, bytes)) else math.nan
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v):
        raise ValueError(f"LoRA: the scale of {name} must be a finite number; got {s!r}")
    return v


class LoRASpec(NamedTuple):
    """The static description of a `LoRA` (hashable: part of a call's static
    key): per adapted projection ``(name, rank, scale)``, and whether the
    adapters are per-expert lists."""

    projections: tuple[tuple[str, int, float], ...]
    lists: bool

    @property
    def ranks(self) -> tuple[int, int, int]:
        """The rank of each of `PROJECTIONS` (0: no adapter)."""
        r = {n: rank for n, rank, _ in self.projections}
        return tuple(r.get(n, 0) for n in PROJECTIONS)

    @property
    def scales(self) -> tuple[float, float, float]:
        """The scale of each of `PROJECTIONS` (1.0 where no adapter)."""
        s = {n: scale for n, _, scale in self.projections}
        return tuple(s.get(n, 1.0) for n in PROJECTIONS)


def _fans(H: int, I: int) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) as ``x @ W``: gate, up ``(H, I)``, down ``(I, H)``."""
    return dict(gate=(H, I), up=(H, I), down=(I, H))


def _is_list(a) -> bool:
    return isinstance(a, (list, tuple))


@jax.tree_util.register_pytree_with_keys_class
class LoRA:
    """Low-rank adapters on the routed experts' gate, up and down projections
    (any subset).

    Args:
      gate, up, down: ``(A, B)`` or None.  ``A``: ``[E, in, r]`` (gate, up:
        ``in = H``; down: ``in = I``) or a list of E ``[in, r]`` arrays;
        ``B``: ``[E, r, out]`` (gate, up: ``out = I``; down: ``out = H``) or a
        list of E ``[r, out]``.  One rank r per projection; float32, bfloat16
        or float16 (the products accumulate in float32).
      scale: ``alpha / r``: one float for every projection, or a mapping
        from each adapted projection (and no other) to its float (PEFT's
        ``lora_alpha / r`` per module;
        ``use_rslora``: ``lora_alpha / sqrt(r)``).  Static: not trained.

    Shapes are checked when the adapters are used (`validate_lora`).
    """

    __slots__ = ("gate", "up", "down", "scales")

    def __init__(self, gate: tuple[Any, Any] | None = None, up: tuple[Any, Any] | None = None,
                 down: tuple[Any, Any] | None = None, *, scale: float | Mapping[str, float] = 1.0):
        pairs = dict(gate=gate, up=up, down=down)
        for name, pair in pairs.items():
            if pair is not None and (not isinstance(pair, (tuple, list)) or len(pair) != 2):
                raise TypeError(f"LoRA: {name} must be an (A, B) pair or None; got {type(pair).__name__}")
        if all(p is None for p in pairs.values()):
            raise ValueError("LoRA: adapt at least one of gate, up, down")
        if isinstance(scale, Mapping):
            unknown = set(scale) - set(PROJECTIONS)
            if unknown:
                raise ValueError(f"LoRA: scale names unknown projections {sorted(unknown)}; "
                                 f"expected some of {PROJECTIONS}")
            adapted = {n for n, p in pairs.items() if p is not None}
            if set(scale) != adapted:
                raise ValueError(f"LoRA: scale must give the scale of each adapted projection and no other: "
                                 f"it names {sorted(scale)}, the adapters are on {sorted(adapted)}")
            scales = tuple(_scale(n, scale.get(n, 1.0)) for n in PROJECTIONS)
        else:
            scales = tuple(_scale(n, scale) for n in PROJECTIONS)
        self.gate, self.up, self.down = (None if p is None else tuple(p) for p in (gate, up, down))
        self.scales = scales

    # --- pytree ---
    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return [(keys(n), getattr(self, n)) for n in PROJECTIONS], self.scales

    @classmethod
    def tree_unflatten(cls, scales, children):
        obj = object.__new__(cls)
        obj.gate, obj.up, obj.down = children
        obj.scales = scales
        return obj

    # --- views ---
    @property
    def projections(self) -> tuple[str, ...]:
        """The adapted projections, in `PROJECTIONS` order."""
        return tuple(n for n in PROJECTIONS if getattr(self, n) is not None)

    def pair(self, name: str) -> tuple[Any, Any] | None:
        """``(A, B)`` of projection ``name``, or None when it has no adapter."""
        if name not in PROJECTIONS:
            raise ValueError(f"LoRA: unknown projection {name!r}; expected one of {PROJECTIONS}")
        return getattr(self, name)

    def scale(self, name: str) -> float:
        """The scale ``alpha / r`` of projection ``name``."""
        return self.scales[PROJECTIONS.index(name)]

    def stacked(self) -> LoRA:
        """Stacked ``[E, ...]`` copies of per-expert lists (the reference's
        view); stacked adapters are returned as they are."""
        def st(a):
            return jnp.stack([jnp.asarray(v) for v in a]) if _is_list(a) else a

        return LoRA.tree_unflatten(self.scales, [None if (p := getattr(self, n)) is None
                                                 else (st(p[0]), st(p[1])) for n in PROJECTIONS])

    def handler_arrays(self) -> list[jax.Array]:
        """The handlers' operands (abi.h "LoRA adapters"): ``A`` then ``B`` of
        each adapted projection in `PROJECTIONS` order, float32 ``[E, ...]``."""
        stacked = self.stacked()
        return [m.astype(jnp.float32) for n in stacked.projections for m in stacked.pair(n)]

    def from_handler_grads(self, grads: Sequence[jax.Array]) -> LoRA:
        """The handlers' float32 gradients (`handler_arrays` order) as a
        cotangent of this LoRA: its structure (lists, tuples) and dtypes."""
        it = iter(grads)

        def like(m, g):
            if _is_list(m):
                return type(m)(g[e].astype(a.dtype) for e, a in enumerate(m))
            return g.astype(m.dtype)

        children = []
        for n in PROJECTIONS:
            pair = getattr(self, n)
            children.append(None if pair is None else type(pair)(like(m, next(it)) for m in pair))
        return LoRA.tree_unflatten(self.scales, children)

    # --- construction ---
    @classmethod
    def init(cls, key: jax.Array, num_experts: int, hidden_size: int, intermediate_size: int, rank: int, *,
             projections: Sequence[str] = PROJECTIONS, alpha: float | None = None, dtype=jnp.float32,
             lists: bool = False) -> LoRA:
        """Fresh adapters as the LoRA paper and PEFT initialise them: ``A``
        uniform in ``±1/sqrt(in)`` (PEFT's ``kaiming_uniform_(a=sqrt(5))`` on
        ``lora_A.weight [r, in]``), ``B = 0`` (so the adapted experts start
        equal to the base), scale ``alpha / rank`` (``alpha`` default:
        ``rank``, i.e. scale 1)."""
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA.init: rank must be a positive int; got {rank!r}")
        bad = [p for p in projections if p not in PROJECTIONS]
        if bad or not projections:
            raise ValueError(f"LoRA.init: projections must be a non-empty subset of {PROJECTIONS}; "
                             f"got {tuple(projections)!r}")
        E, H, I = num_experts, hidden_size, intermediate_size
        dims = _fans(H, I)
        pairs: dict[str, tuple] = {}
        for name, k in zip(PROJECTIONS, jax.random.split(key, 3)):
            if name not in projections:
                continue
            fan_in, fan_out = dims[name]
            bound = 1.0 / math.sqrt(fan_in)
            A = jax.random.uniform(k, (E, fan_in, rank), jnp.float32, -bound, bound).astype(dtype)
            B = jnp.zeros((E, rank, fan_out), dtype)
            pairs[name] = ([A[e] for e in range(E)], [B[e] for e in range(E)]) if lists else (A, B)
        return cls(**pairs, scale=(rank if alpha is None else alpha) / rank)

    def __repr__(self) -> str:
        def desc(a):
            return f"{len(a)} x {desc(a[0])}" if _is_list(a) else f"{getattr(a, 'dtype', '?')}{list(a.shape)}"

        parts = [f"{n}=(A={desc(p[0])}, B={desc(p[1])}, scale={self.scale(n):g})"
                 for n in PROJECTIONS if (p := getattr(self, n)) is not None]
        return f"LoRA({', '.join(parts)})"


def _shape(a, lists: bool) -> tuple[int, ...]:
    """One expert's shape of ``a`` (a list of arrays, or stacked [E, ...])."""
    return tuple(a[0].shape) if lists else tuple(a.shape[1:])


def validate_lora(lora: Any, E: int, H: int, I: int) -> LoRASpec:
    """Trace-time checks of ``lora`` against experts of sizes E, H, I; its
    `LoRASpec`.  TypeError / ValueError name the projection, the array and
    the shape or dtype."""
    if not isinstance(lora, LoRA):
        raise TypeError(f"lora must be a jax_nbx.LoRA or None; got {type(lora).__name__}")
    dims = _fans(H, I)
    kinds = {_is_list(a) for n in lora.projections for a in lora.pair(n)}
    if len(kinds) != 1:
        raise TypeError("lora: the adapters must be all stacked arrays or all per-expert lists")
    lists = kinds.pop()
    out = []
    for name in lora.projections:
        A, B = lora.pair(name)
        fan_in, fan_out = dims[name]
        for label, a in (("A", A), ("B", B)):
            if lists:
                if len(a) != E:
                    raise ValueError(f"lora.{name} {label} is a list of {len(a)} arrays; expected E={E}")
                shapes = {tuple(jnp.shape(v)) for v in a}
                if len(shapes) != 1:
                    raise ValueError(f"lora.{name} {label}: the per-expert arrays differ in shape: "
                                     f"{sorted(shapes)}")
                dts = {np.dtype(v.dtype) for v in a}
            else:
                if jnp.ndim(a) != 3 or a.shape[0] != E:
                    raise ValueError(f"lora.{name} {label} has shape {tuple(jnp.shape(a))}; expected "
                                     f"[E={E}, ...] (3-D)")
                dts = {np.dtype(a.dtype)}
            if len(dts) != 1 or next(iter(dts)) not in FLOAT_DTYPES:
                raise TypeError(f"lora.{name} {label} has dtype {sorted(map(str, dts))}; expected one of "
                                f"{', '.join(map(str, FLOAT_DTYPES))}")
        a_shape, b_shape = _shape(A, lists), _shape(B, lists)
        if len(a_shape) != 2 or a_shape[0] != fan_in:
            raise ValueError(f"lora.{name} A has per-expert shape {a_shape}; expected [{fan_in}, r] "
                             f"(x @ A: in = {'I' if name == 'down' else 'H'}={fan_in})")
        r = a_shape[1]
        if r < 1:
            raise ValueError(f"lora.{name} A has rank 0 (per-expert shape {a_shape})")
        if b_shape != (r, fan_out):
            raise ValueError(f"lora.{name} B has per-expert shape {b_shape}; expected [r={r}, {fan_out}]")
        out.append((name, int(r), lora.scale(name)))
    return LoRASpec(tuple(out), lists)


def merge_lora(experts: Experts, lora: LoRA) -> Experts:
    """Dense experts with the adapters folded in, ``W_e + s * A_e @ B_e`` per
    adapted projection (float32 products, stored in the experts' dtype), for
    export: stacked, in the plain ``in_out`` layout (`Experts.canonical`:
    gate, up ``[E, H, I]``, down ``[E, I, H]``), biases kept.  Quantized
    experts are refused: `jax_nbx.dequantize` them first (the merged weights
    are no longer on the quantization grid)."""
    from .quantization import is_quantized

    if not isinstance(experts, Experts):
        raise TypeError(f"merge_lora: experts must be a jax_nbx.Experts; got {type(experts).__name__}")
    if is_quantized(experts):
        raise ValueError("merge_lora: the experts are quantized; dequantize them first "
                         "(jax_nbx.dequantize), since the merged weights leave the quantization grid")
    from .validation import validate_experts

    E, H, I = validate_experts(experts)
    validate_lora(lora, E, H, I)
    base, biases = experts.canonical()  # (biases: `Experts.handler_biases`, () without)
    ad = lora.stacked()
    hi = jax.lax.Precision.HIGHEST
    merged = {}
    for name in PROJECTIONS:
        W = getattr(base, name)
        p = ad.pair(name)
        if p is not None:
            delta = jnp.einsum("eir,ero->eio", p[0].astype(jnp.float32), p[1].astype(jnp.float32), precision=hi)
            W = (W.astype(jnp.float32) + ad.scale(name) * delta).astype(W.dtype)
        merged[name] = W
    bias = dict(zip(("gate_bias", "up_bias", "down_bias"), biases))
    return Experts(merged["gate"], merged["up"], merged["down"], **bias)
