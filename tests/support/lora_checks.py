"""LoRA test helpers shared by tests/library/test_lora.py and the suite's
tests/suite/test_adapters.py: random adapters, the loss's gradients through
``fused_moe(..., lora=)``, and the adapters' gradients against the oracle."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_nbx as nbx

from .problems import rel_err

LORA_SCALES = {"gate": 0.5, "up": 0.8, "down": 1.3}  # one per projection: a swap shows


def make_lora(seed, E, H, I, r, projections=("gate", "up", "down"), dtype=jnp.float32, lists=False, scale=None):
    """Random adapters (B not zero, so they change the result), a different
    scale per projection unless ``scale`` is given."""
    rng = np.random.default_rng(seed)
    dims = dict(gate=(H, I), up=(H, I), down=(I, H))
    pairs = {}
    for n in projections:
        fi, fo = dims[n]
        A = jnp.asarray(rng.standard_normal((E, fi, r)) / np.sqrt(fi), dtype)
        B = jnp.asarray(rng.standard_normal((E, r, fo)) / np.sqrt(r), dtype)
        pairs[n] = ([A[e] for e in range(E)], [B[e] for e in range(E)]) if lists else (A, B)
    return nbx.LoRA(**pairs, scale={n: LORA_SCALES[n] for n in projections} if scale is None else scale)


def loss_and_grads(x, w, ids, experts, lora, ct, **kw):
    """y and the gradients of sum(y * ct) with respect to (x, w, lora, experts)."""
    def f(x, w, lora, experts):
        y = nbx.fused_moe(x, w, ids, experts, lora=lora, **kw)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    grad = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True, allow_int=True)
    (_, y), g = jax.jit(grad)(x, w, lora, experts)
    return y, g


def check_lora_grads(glora, dad, tol):
    """The adapters' gradients ``glora`` (a `LoRA` cotangent, stacked or
    lists) against the oracle's ``dad`` (projection -> (dA, dB))."""
    for name, (dA, dB) in dad.items():
        gA, gB = glora.pair(name)
        if isinstance(gA, (list, tuple)):
            gA, gB = jnp.stack(gA), jnp.stack(gB)
        assert rel_err(gA, dA) < tol, (name, "A", rel_err(gA, dA))
        assert rel_err(gB, dB) < tol, (name, "B", rel_err(gB, dB))
