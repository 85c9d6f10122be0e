"""jax_nbx: the Mixture-of-Experts feed-forward block as one fused XLA FFI custom call.

    import jax_nbx as nbx
    experts = nbx.Experts(gate=wg, up=wu, down=wd)   # [E,H,I], [E,H,I], [E,I,H]
    w, ids = nbx.route(logits, k=2)
    y = nbx.fused_moe(x, w, ids, experts)
"""
from . import _registry
from .experts import Experts
from .models import MODELS, ModelShape
from .ops import IMPLEMENTATIONS, fused_moe
from .reference import moe_reference
from .routing import route

__version__ = "0.1.0"

__all__ = ["Experts", "route", "fused_moe", "moe_reference", "IMPLEMENTATIONS", "MODELS",
           "ModelShape", "alloc_stats", "__version__"]


def alloc_stats() -> dict[str, int]:
    """Counters of the handlers' own allocations (bytes): live, peak,
    allocations, largest_request.  ``live`` is 0 whenever no call runs."""
    if _registry._ffi is None:
        raise RuntimeError(f"jax_nbx's compiled module failed to import: {_registry._IMPORT_ERROR}")
    return dict(_registry._ffi.alloc_stats())
