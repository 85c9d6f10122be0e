"""`prepack`: dense experts packed once into the CPU forward's kernel layout.

The CPU forward packs each K-block of the weights into its micro-kernels'
panels on every call (13-20 % of a prefill call, docs/benchmarks.md).  For
experts called many times with the same weights (serving, evaluation),
`prepack` does that once: a `PackedExperts` holds the experts and two uint32
buffers of packed words (abi.h "prepacked weights"), and `fused_moe` given a
`PackedExperts` reads the words instead of packing.  The results are the
same bits as the unpacked experts'; experts with few rows in a call (decode)
still stream the original weights in place, and gradients are the experts'.

The words are a function of the weights: pack again after changing them.
They hold each weight once more (float32: as many bytes as float32 weights,
twice bfloat16 ones; ``precision="bfloat16"``: bfloat16 pairs, as many
bytes as the weights), as ordinary arrays the caller owns
(`PackedExperts.nbytes`).  They are packed for the kernels in use when
`prepack` runs (`jax_nbx.cpu.isa`); the forward refuses them, naming the
mismatch, after `jax_nbx.cpu.set_isa` changes the blocking.
"""
from __future__ import annotations

from typing import Literal

import jax
import numpy as np

from . import _registry, backends
from .activations import as_activation
from .backends.cpu import why_no_bf16_dot
from .backends.handler_calls import prepack_call
from .experts import Experts
from .quantization import quant_format
from .validation import validate_experts

__all__ = ["PackedExperts", "prepack"]

PRECISIONS = ("float32", "bfloat16")


@jax.tree_util.register_pytree_with_keys_class
class PackedExperts:
    """`Experts` with their weights packed for the CPU forward (`prepack`).

    Pass it to `jax_nbx.fused_moe` where `Experts` go (CPU handler only).
    ``experts``: the experts themselves (decode streams them, gradients go to
    them); ``gate_up`` / ``down``: the packed words, uint32 (header then E
    experts); ``precision``: the arithmetic they were packed for, which the
    call takes (``precision=None``) or must name."""

    def __init__(self, experts: Experts, gate_up, down, precision: str):
        self.experts = experts
        self.gate_up = gate_up
        self.down = down
        self.precision = precision

    def tree_flatten(self):
        return (self.experts, self.gate_up, self.down), (self.precision,)

    def tree_flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey("experts"), jax.tree_util.GetAttrKey("gate_up"),
                jax.tree_util.GetAttrKey("down"))
        return tuple(zip(keys, (self.experts, self.gate_up, self.down))), (self.precision,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed words (the experts' own arrays not counted)."""
        return int(np.prod(self.gate_up.shape)) * 4 + int(np.prod(self.down.shape)) * 4

    def __repr__(self) -> str:
        return (f"PackedExperts(precision={self.precision!r}, {self.nbytes / 2**20:.1f} MiB packed, "
                f"experts={self.experts!r})")


def prepack(experts: Experts, *, precision: Literal["float32", "bfloat16"] = "float32") -> PackedExperts:
    """Packs dense ``experts`` once for the CPU forward's kernels.

    Args:
      experts: dense `Experts` (float32, bfloat16 or float16; any layout,
        stacked or lists, biases allowed).  Quantized experts are refused:
        their kernels read the codes in place.
      precision: the arithmetic of the calls that will read the words:
        ``"float32"`` (float32 panels) or ``"bfloat16"`` (bfloat16 pairs for
        the dot-product kernels; bfloat16 experts stored by rows).

    Returns:
      A `PackedExperts`.  Works eagerly and under ``jax.jit`` (a jitted
      function that packs on every call gains nothing: pack once, outside;
      ``jax.jit(prepack)`` also copies the experts into its result, as a
      jitted function's outputs are new buffers: pack eagerly).

    Raises:
      TypeError / ValueError for quantized or malformed experts, an unknown
      precision, or JAX's default backend not being the CPU; RuntimeError
      when jax_nbx's compiled module did not load.
    """
    if not isinstance(experts, Experts):
        raise TypeError(f"experts must be a jax_nbx.Experts; got {type(experts).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if jax.default_backend() != "cpu":
        raise ValueError(f"prepack packs for the CPU handler; the default backend is {jax.default_backend()!r}")
    ffi = _registry.ffi_module()  # (RuntimeError naming why, when it did not load)
    experts = jax.tree.map(jax.numpy.asarray, experts)
    E, H, I = validate_experts(experts)
    if quant_format(experts) is not None:
        raise TypeError(f"prepack takes dense experts; these are quantized ({quant_format(experts)[0]})")
    bf16 = precision == "bfloat16"
    problem = backends.Problem.of(experts, np.float32, E, H, I, 1, as_activation("swiglu"), bf16_dot=bf16)
    why = why_no_bf16_dot(problem) if bf16 else ""
    if why:
        raise ValueError(f"prepack(precision='bfloat16') {why}")
    words = tuple(ffi.cpu_prepacked_words(E, H, I, bf16, g) for g in (True, False))
    name, operands, attrs, outs = prepack_call(problem, (*experts.flat(), *experts.handler_biases()), words)
    gate_up, down = jax.ffi.ffi_call(name, outs)(*operands, **attrs)
    return PackedExperts(experts, gate_up, down, precision)
