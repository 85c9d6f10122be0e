"""Loading real checkpoints: one MoE block from safetensors files
(`checkpoint.load_moe`, `load_experts`; Hugging Face names of every family,
per-expert tensors kept as lists in the stored layout), and the lossless
import of other quantizers' 4-bit tensors into jax_nbx's int4
(`quant_import`: GPTQ v1, AWQ GEMM, MLX affine; `dequantize_mlx` for an MLX
affine matrix kept in float, e.g. mlx-lm's quantized router).  Safetensors is an extra
(``pip install 'jax_nbx[hf]'``), imported when a file is read."""
from __future__ import annotations

from .checkpoint import CheckpointError, load_experts, load_moe, safetensors_files
from .quant_import import absorb_act_order, dequantize_mlx, from_awq, from_gptq, from_mlx, permute_columns

__all__ = ["CheckpointError", "load_moe", "load_experts", "safetensors_files", "from_gptq", "from_awq",
           "from_mlx", "dequantize_mlx", "permute_columns", "absorb_act_order"]
