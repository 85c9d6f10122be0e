"""Loading real checkpoints: one MoE block from safetensors files
(`checkpoint.load_moe`, `load_experts`; Hugging Face names of every family,
per-expert tensors kept as lists in the stored layout; `mapped.map_moe`: the
routed experts left in the files, read when routed), and the lossless
import of other quantizers' tensors into jax_nbx's formats (`quant_import`:
GPTQ v1, AWQ GEMM, MLX affine into int4, MLX's float modes into mxfp4 / nvfp4
/ mxfp8; `dequantize_mlx` for an MLX matrix kept in float, e.g. mlx-lm's
quantized router; `fp8_import`: FP8 E4M3 block / per-channel into fp8; `nvfp4_import`: NVFP4 with its
global scale into nvfp4 with a tensor scale), and PEFT's LoRA adapters of
the routed experts into a `jax_nbx.LoRA` (`peft_import.from_peft`) and back
(`peft_export.to_peft`).  Every file is read through `files` (JSON, config values, safetensors
headers checked against the file's size): whatever is malformed raises `CheckpointError` naming
the file.  Safetensors is an extra (``pip install 'jax_nbx[hf]'``), imported when a file is read."""
from __future__ import annotations

from .checkpoint import CheckpointError, load_experts, load_moe, safetensors_files
from .fp8_import import from_fp8
from .mapped import map_moe, unmap
from .nvfp4_import import from_nvfp4
from .peft_export import to_peft
from .peft_import import from_peft
from .quant_import import absorb_act_order, dequantize_mlx, from_awq, from_gptq, from_mlx, permute_columns

__all__ = ["CheckpointError", "load_moe", "load_experts", "map_moe", "unmap", "safetensors_files", "from_gptq",
           "from_awq", "from_mlx", "dequantize_mlx", "from_fp8", "from_nvfp4", "from_peft", "to_peft",
           "permute_columns", "absorb_act_order"]
