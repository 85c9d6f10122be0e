"""MoE layers for Flax NNX and Equinox, and the block they share.

    from jax_nbx import nn
    config = nn.MoEConfig(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)
    layer = nn.NNXMoE(config, rngs=flax.nnx.Rngs(0))     # needs flax
    layer = nn.EqxMoE(config, key=jax.random.key(0))      # needs equinox
    y, aux = layer(x)

`MoEConfig`, `MoEParams`, `moe_block` and `init_params` need neither
framework; `NNXMoE` imports Flax and `EqxMoE` imports Equinox when first
named (``pip install jax_nbx[flax]`` / ``[equinox]``).
"""
from __future__ import annotations

from .block import ROUTINGS, MoEConfig, MoEParams, RouterAux, init_lora, init_params, moe_block, partition_specs

__all__ = ["MoEConfig", "MoEParams", "RouterAux", "ROUTINGS", "init_params", "init_lora", "moe_block",
           "partition_specs",
           "NNXMoE", "EqxMoE"]

_LAZY = {"NNXMoE": ("nnx_moe", "flax", "flax"), "EqxMoE": ("eqx_moe", "equinox", "equinox")}


def __getattr__(name: str):
    if name in _LAZY:
        module, package, extra = _LAZY[name]
        import importlib
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as err:
            if err.name != package and not (err.name or "").startswith(package + "."):
                raise
            raise ImportError(f"jax_nbx.nn.{name} needs {package}: pip install 'jax_nbx[{extra}]'") from err
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
