"""The `Experts` pytree: the weights (and optional biases) of every expert's
gated MLP, in the layout the checkpoint stores them.

The handlers read every layout in place: each projection reaches them as a
*view* (`WeightLayout.views`: offset and strides of its logical matrix inside
each expert's array), never as a transposed or de-interleaved copy.  This
module is the one place that turns a named layout into views.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Experts", "SharedExperts", "LAYOUTS", "FUSIONS"]

FLOAT_DTYPES = (np.dtype("float32"), np.dtype(jax.numpy.bfloat16), np.dtype("float16"))

LAYOUTS = ("in_out", "out_in")
FUSIONS = ("concat", "interleaved")

_CHILDREN = ("gate", "up", "down", "gate_up", "gate_bias", "up_bias", "down_bias", "gate_up_bias")


class WeightLayout(NamedTuple):
    """How the handlers read the weights (hashable: a static part of the op).

    ``views``: per projection (gate, up, down) ``(offset, stride_k,
    stride_n)`` in elements of one expert's array: element ``(k, n)`` of its
    logical matrix (gate, up ``[H, I]``, down ``[I, H]``) lies at ``offset +
    k * stride_k + n * stride_n``.  ``fused``: gate and up are one array
    (buffer groups gate_up, down).  ``bias``: three float32 bias buffers
    follow the weights."""

    views: tuple[int, ...]
    intermediate: int
    fused: bool
    bias: bool

    @classmethod
    def plain(cls, H: int, I: int) -> WeightLayout:
        """The views of gate, up ``[.., H, I]`` and down ``[.., I, H]`` without biases."""
        return cls((0, I, 1, 0, I, 1, 0, H, 1), I, False, False)

    @property
    def native(self) -> bool:
        """The stacked ``[E, H, I]``/``[E, I, H]`` layout without biases."""
        return self == WeightLayout.plain(self.views[7], self.intermediate)  # views[7]: down's stride_k

    @property
    def plain_views(self) -> bool:
        """`native`'s views, biases or not (what quantized experts take)."""
        return self._replace(bias=False).native

    def attrs(self) -> dict:
        """The values of the contract's "weight views" attributes (xla_ffi/abi.h;
        typed by `jax_nbx.contract.attributes`)."""
        return dict(views=self.views, intermediate=self.intermediate, fused_gate_up=self.fused,
                    has_bias=self.bias)


def _first(a):
    return a[0] if isinstance(a, (list, tuple)) else a


def _matrix_shape(a) -> tuple[int, ...]:
    """One expert's array shape (lists: the first element's; stacked: without E)."""
    if isinstance(a, (list, tuple)):
        return tuple(a[0].shape)
    return tuple(a.shape[1:])


@jax.tree_util.register_pytree_with_keys_class
class Experts:
    """The expert weights of a gated MLP: stacked arrays or one array per
    expert, in the checkpoint's layout, with optional biases.

    ``mlp_e(x) = (glu(x @ G_e + bg_e, x @ U_e + bu_e)) @ D_e + bd_e`` where
    ``G_e, U_e`` are ``[H, I]`` and ``D_e`` is ``[I, H]`` *as matrices*; how
    they are stored:

    Args:
      gate, up: ``[E, H, I]`` (``layout="in_out"``: ``x @ W``) or ``[E, I, H]``
        (``layout="out_in"``: ``nn.Linear`` weights, ``x @ W.T``), or lists of
        E per-expert 2-D arrays (e.g. a checkpoint's ``experts.{i}.w1``).
      down: ``[E, I, H]`` (``"in_out"``) or ``[E, H, I]`` (``"out_in"``), or a list.
      gate_bias, up_bias: ``[E, I]`` (or lists of ``[I]``); down_bias
        ``[E, H]`` (or lists of ``[H]``); each optional (gpt-oss has all three).
      layout: ``"in_out"`` or ``"out_in"`` (all three projections alike).

    A fused gate||up array (transformers v5 ``gate_up_proj``, MaxText,
    gpt-oss): `Experts.fused`.  The handlers read every layout in place,
    lists included (never stacked, transposed or de-interleaved into a copy);
    biases are small (``E*(2I+H)`` values) and reach the handlers as float32
    ``[E, I]``/``[E, H]`` arrays.  The weights share one dtype among
    float32, bfloat16 and float16; it may differ from the activations'.
    Shapes are checked when the experts are used (``fused_moe``), so that JAX
    can rebuild the pytree with placeholder leaves.
    """

    __slots__ = _CHILDREN + ("layout", "fusion")

    def __init__(self, gate: Any, up: Any, down: Any, *, gate_bias: Any = None, up_bias: Any = None,
                 down_bias: Any = None, layout: str = "in_out"):
        if layout not in LAYOUTS:
            raise ValueError(f"Experts: layout must be one of {LAYOUTS}; got {layout!r}")
        self.gate, self.up, self.down, self.gate_up = gate, up, down, None
        self.gate_bias, self.up_bias, self.down_bias, self.gate_up_bias = gate_bias, up_bias, down_bias, None
        self.layout, self.fusion = layout, None

    @classmethod
    def fused(cls, gate_up: Any, down: Any, *, fusion: str = "concat", layout: str = "in_out",
              gate_up_bias: Any = None, down_bias: Any = None) -> Experts:
        """Experts whose gate and up projections are one array.

        Args:
          gate_up: ``[E, H, 2I]`` (``layout="in_out"``) or ``[E, 2I, H]``
            (``"out_in"``: transformers v5 ``gate_up_proj``, Granite's
            ``input_linear``), or a list of E per-expert arrays.
          down: ``[E, I, H]`` (``"in_out"``) or ``[E, H, I]`` (``"out_in"``).
          fusion: ``"concat"`` (the first I columns/rows are the gate:
            ``chunk(2)``) or ``"interleaved"`` (gate at even, up at odd
            positions: gpt-oss's ``gate_up[..., ::2]``, ``[..., 1::2]``).
          gate_up_bias: ``[E, 2I]`` laid out like ``fusion`` (or a list of ``[2I]``).
          down_bias: ``[E, H]`` (or a list of ``[H]``).

        Gradients come back in the same structure: a fused `Experts` whose
        ``gate_up`` holds d(gate_up) in its own layout.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"Experts.fused: layout must be one of {LAYOUTS}; got {layout!r}")
        if fusion not in FUSIONS:
            raise ValueError(f"Experts.fused: fusion must be one of {FUSIONS}; got {fusion!r}")
        self = cls.__new__(cls)
        self.gate = self.up = self.gate_bias = self.up_bias = None
        self.gate_up, self.down, self.gate_up_bias, self.down_bias = gate_up, down, gate_up_bias, down_bias
        self.layout, self.fusion = layout, fusion
        return self

    # ------------------------------------------------------------------ pytree
    def tree_flatten(self):
        return tuple(getattr(self, n) for n in _CHILDREN), (self.layout, self.fusion)

    def tree_flatten_with_keys(self):
        """Children keyed by name (``experts.gate[3]`` in key paths, parameter trees)."""
        return (tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in _CHILDREN),
                (self.layout, self.fusion))

    @classmethod
    def tree_unflatten(cls, aux, children):
        self = cls.__new__(cls)
        for n, c in zip(_CHILDREN, children):
            setattr(self, n, c)
        self.layout, self.fusion = aux
        return self

    # ------------------------------------------------------------------ facts
    @property
    def is_fused(self) -> bool:
        """True when gate and up are one array (`Experts.fused`)."""
        return self.fusion is not None

    @property
    def has_bias(self) -> bool:
        return any(getattr(self, n) is not None for n in ("gate_bias", "up_bias", "down_bias", "gate_up_bias"))

    @property
    def is_plain(self) -> bool:
        """Stacked-or-list ``[.., H, I]``/``[.., I, H]`` weights without
        biases: what every path (quantization, Metal, CUDA, sharding) takes."""
        return self.layout == "in_out" and not self.is_fused and not self.has_bias

    def weight_names(self) -> tuple[str, ...]:
        """The weight attributes in the handlers' group order."""
        return ("gate_up", "down") if self.is_fused else ("gate", "up", "down")

    @property
    def is_list(self) -> bool:
        """True when the weights are given as one array per expert."""
        return isinstance(self.down, (list, tuple))

    @property
    def num_experts(self) -> int:
        """E."""
        return len(self.down) if self.is_list else int(self.down.shape[0])

    def _down_shape(self) -> tuple[int, int]:
        s = _matrix_shape(self.down)
        if len(s) != 2:  # (reported by name in fused_moe's checks)
            raise ValueError(f"experts.down must hold 2-D matrices per expert; got {s}")
        return s if self.layout == "in_out" else (s[1], s[0])  # (I, H)

    @property
    def hidden(self) -> int:
        """H, the model width."""
        return int(self._down_shape()[1])

    @property
    def intermediate(self) -> int:
        """I, each expert's intermediate width."""
        return int(self._down_shape()[0])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(_first(self.down).dtype)

    def weight_layout(self) -> WeightLayout:
        """The handlers' views of this layout (`WeightLayout`)."""
        I, H = self.intermediate, self.hidden
        t = self.layout == "out_in"
        if not self.is_fused:
            g = (0, 1, H) if t else (0, I, 1)
            u = g
        elif self.fusion == "concat":
            g, u = ((0, 1, H), (I * H, 1, H)) if t else ((0, 2 * I, 1), (I, 2 * I, 1))
        else:  # interleaved
            g, u = ((0, 1, 2 * H), (H, 1, 2 * H)) if t else ((0, 2 * I, 2), (1, 2 * I, 2))
        d = (0, 1, I) if t else (0, H, 1)
        return WeightLayout(g + u + d, I, self.is_fused, self.has_bias)

    def flat(self) -> tuple:
        """The weight arrays in call order: one array per group when stacked,
        else the E arrays of each group in turn (groups: gate, up, down, or
        gate_up, down when fused)."""
        out = []
        for n in self.weight_names():
            a = getattr(self, n)
            out.extend(a if self.is_list else [a])
        return tuple(out)

    def handler_biases(self) -> tuple:
        """float32 ``[E, I]``, ``[E, I]``, ``[E, H]`` biases of gate, up, down
        (zeros where absent; a fused bias split; lists stacked: small
        copies, ``E*(2I+H)`` values), or () without biases.  Differentiable:
        the op maps the handlers' bias gradients back through it."""
        if not self.has_bias:
            return ()
        import jax.numpy as jnp

        E, I, H = self.num_experts, self.intermediate, self.hidden

        def stacked(b, n):
            if b is None:
                return jnp.zeros((E, n), jnp.float32)
            if isinstance(b, (list, tuple)):
                b = jnp.stack([jnp.asarray(v) for v in b])
            return jnp.asarray(b).astype(jnp.float32)

        if self.is_fused:
            gu = stacked(self.gate_up_bias, 2 * I)
            g, u = (gu[:, :I], gu[:, I:]) if self.fusion == "concat" else (gu[:, 0::2], gu[:, 1::2])
        else:
            g, u = stacked(self.gate_bias, I), stacked(self.up_bias, I)
        return (g, u, stacked(self.down_bias, H))

    def stacked(self) -> Experts:
        """Stacked ``[E, ...]`` arrays, layout kept (a copy of every weight
        when given as lists: for the reference and tests, never the handlers')."""
        if not self.is_list:
            return self
        import jax.numpy as jnp

        def stack(lst):  # arrays, or QuantizedWeight pytrees leaf by leaf
            if lst is None or not isinstance(lst, (list, tuple)):
                return lst
            return jax.tree.map(lambda *a: jnp.stack(a), *lst)

        return Experts.tree_unflatten((self.layout, self.fusion), [stack(getattr(self, n)) for n in _CHILDREN])

    def canonical(self) -> tuple[Experts, tuple]:
        """``(Experts(gate [E,H,I], up, down [E,I,H]), biases)``: stacked
        ``in_out`` copies of the weights (transposed, split) and
        `handler_biases`.  For the pure-JAX reference only: a copy of every
        weight; the handlers read the layout in place."""
        import jax.numpy as jnp

        s = self.stacked()
        biases = self.handler_biases()
        if self.is_plain:
            return s, biases
        I = self.intermediate
        t = self.layout == "out_in"

        def io(a):  # [E, K, N] as x @ W
            return jnp.swapaxes(a, 1, 2) if t else a

        if self.is_fused:
            gu = io(s.gate_up)  # [E, H, 2I]
            g, u = (gu[..., :I], gu[..., I:]) if self.fusion == "concat" else (gu[..., 0::2], gu[..., 1::2])
        else:
            g, u = io(s.gate), io(s.up)
        return Experts(g, u, io(s.down)), biases

    def __repr__(self) -> str:
        def desc(a):
            if isinstance(a, (list, tuple)):
                return f"{len(a)} x {desc(a[0])}" if a else "[]"
            return f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}"

        parts = [f"{n}={desc(getattr(self, n))}" for n in _CHILDREN if getattr(self, n) is not None]
        if self.layout != "in_out":
            parts.append(f"layout={self.layout!r}")
        if self.fusion:
            parts.append(f"fusion={self.fusion!r}")
        return f"Experts({', '.join(parts)})"


@jax.tree_util.register_pytree_with_keys_class
class SharedExperts:
    """Always-on experts run in the same `fused_moe` call as the routed ones.

    Args:
      experts: S experts (`Experts`, any layout, biases allowed, their own
        intermediate width): each runs on every token with weight 1 and the
        results are added to the routed output (DeepSeek, Llama-4: one MLP
        of width ``n_shared * I`` is one expert here).
      gate: optional ``[1, H]`` (or ``[H]``) weight of Qwen2-MoE's
        ``shared_expert_gate`` (``nn.Linear(H, 1)``): the shared output is
        scaled per token by ``sigmoid(x @ gate.T)``.
    """

    __slots__ = ("experts", "gate")

    def __init__(self, experts: Experts, gate: Any = None):
        self.experts, self.gate = experts, gate

    def tree_flatten(self):
        return (self.experts, self.gate), None

    def tree_flatten_with_keys(self):
        key = jax.tree_util.GetAttrKey
        return ((key("experts"), self.experts), (key("gate"), self.gate)), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __repr__(self) -> str:
        g = "" if self.gate is None else f", gate={getattr(self.gate, 'dtype', '?')}{list(self.gate.shape)}"
        return f"SharedExperts({self.experts!r}{g})"
