"""jax_nbx: the Mixture-of-Experts feed-forward block as one fused XLA FFI custom call.

    import jax_nbx as nbx
    experts = nbx.Experts(gate=wg, up=wu, down=wd)   # [E,H,I], [E,H,I], [E,I,H]
    w, ids = nbx.route(logits, k=2)
    y = nbx.fused_moe(x, w, ids, experts)
"""
# _built first: the compiled module, or an error naming a source tree without it;
# _moved: old module names importable with a warning; _registry registers the handlers
from . import _built, _moved, _registry, activations, backends, cpu, formats, memory, metal, nn, quantization, tables  # noqa: F401
from .activations import Activation
from .experts import Experts, SharedExperts
from .formats import QuantizedWeight
from .isa_calibration import Calibration, calibrate_isa
from .loaders import from_awq, from_gptq, from_mlx, load_experts, load_moe
from .lora import LoRA, merge_lora
from .memory import DeviceOOMError
from .models import MODELS, ModelShape
from .ops import IMPLEMENTATIONS, fused_moe
from .prepack import PackedExperts, prepack
from .quantization import dequantize, quantize
from .reference import moe_reference
from .routing import (
    expert_counts,
    load_balancing_loss,
    route,
    route_sigmoid,
    route_topk_sigmoid,
    route_topk_softmax,
    router_z_loss,
)
from .sharding import sharded_moe

__version__ = "0.1.0"

__all__ = ["Experts", "SharedExperts", "LoRA", "merge_lora", "Activation", "activations", "route",
           "route_topk_softmax", "route_sigmoid",
           "route_topk_sigmoid", "load_balancing_loss", "router_z_loss", "expert_counts", "fused_moe",
           "moe_reference", "IMPLEMENTATIONS", "MODELS", "ModelShape", "DeviceOOMError", "quantize",
           "dequantize", "QuantizedWeight", "formats", "backends", "sharded_moe", "memory", "cpu", "metal",
           "tables", "nn",
           "load_moe", "load_experts", "from_gptq", "from_awq", "from_mlx", "calibrate_isa", "Calibration",
           "prepack", "PackedExperts", "__version__"]
