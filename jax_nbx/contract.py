"""The cross-language contract, read from the compiled module (``xla_ffi/abi.h``).

Every value Python shares with the C++ handlers and the Triton kernels comes
from here, and here from the header through ``jax_nbx._ffi.abi()``: FFI
target names and each target's attributes, activation codes and constants,
the weight-format registry (``xla_ffi/formats/``) and the order of the
buffer groups, the CUDA launch-program encoding.  Nothing here is written by
hand; ``tests/library/test_contract.py`` checks every consumer.  `attributes` is the
one place that builds a call's FFI attributes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _ffi

_d = _ffi.abi()

# FFI target names
TARGET_FORWARD: str = _d["targets"]["forward"]
TARGET_BACKWARD: str = _d["targets"]["backward"]
TARGET_CUDA_FORWARD: str = _d["targets"]["cuda_forward"]
TARGET_CUDA_FORWARD_TABLES: str = _d["targets"]["cuda_forward_tables"]
TARGET_CUDA_BACKWARD: str = _d["targets"]["cuda_backward"]
TARGET_METAL_FORWARD: str = _d["targets"]["metal_forward"]
TARGET_PREPACK: str = _d["targets"]["prepack"]

# activations: name -> code (the enum attribute "activation", int32)
ACTIVATIONS: tuple[str, ...] = tuple(_d["activations"])
ACTIVATION_CODES: dict[str, int] = {n: i for i, n in enumerate(ACTIVATIONS)}
ACT_SWIGLU: int = ACTIVATION_CODES["swiglu"]
ACT_GEGLU: int = ACTIVATION_CODES["geglu"]
GELU_C: float = _d["gelu_c"]
GELU_B: float = _d["gelu_b"]
INV_SQRT2: float = _d["inv_sqrt2"]
ACT_SWIGLU_CLAMPED: int = ACTIVATION_CODES["swiglu_clamped"]
ACT_GEGLU_ERF: int = ACTIVATION_CODES["geglu_erf"]
CLAMPED_SWIGLU_ALPHA: float = _d["clamped_swiglu_alpha"]
CLAMPED_SWIGLU_LIMIT: float = _d["clamped_swiglu_limit"]
INT8_BLOCK: int = _d["int8_block"]  # precision="int8": x's values per int8 scale

# weight formats: name -> code (the enum attribute "format", int32); None = dense
WEIGHT_FORMATS: tuple[str, ...] = tuple(_d["weight_formats"])
FORMAT_CODES: dict[str | None, int] = {n: i for i, n in enumerate(WEIGHT_FORMATS)}
FORMAT_CODES[None] = FORMAT_CODES["dense"]
PROJECTIONS: tuple[str, ...] = tuple(_d["projections"])  # gate, up, down
PARTS: tuple[str, ...] = tuple(_d["parts"])  # q, scale, zero (QuantizedWeight attributes)
# The registry (xla_ffi/formats/): per format in code order, a dict of name,
# code, summary, parts ({name, dtypes, rows, same_dtype_as}), values_per_byte,
# group_sizes, compute_dtype_part, tensor_scale, column_scaled, kernels,
# partial_groups (K need not be a multiple of the group).  jax_nbx.formats reads it.
FORMAT_SPECS: tuple[dict, ...] = tuple(dict(f) for f in _d["formats"])


# weight views (abi.h "weight views"): per projection these fields, then biases
VIEW_FIELDS: tuple[str, ...] = tuple(_d["view_fields"])  # offset, stride_k, stride_n
NUM_BIASES: int = _d["num_biases"]  # gate, up, down


def parts_of(fmt: str | None) -> tuple[str, ...]:
    """The parts a format's weights are passed as, in group order ("dense": the weights)."""
    return tuple(p["name"] for p in FORMAT_SPECS[FORMAT_CODES[fmt]]["parts"])


def group_index(part: int, proj: int) -> int:
    """Buffer group of (part, projection): groups run part-major."""
    return part * len(PROJECTIONS) + proj


# CUDA launch program (jax_nbx/backends/cuda/plan.py encodes, xla_ffi/cuda/program.h decodes)
ARG_INPUT: int = _d["arg_kinds"]["input"]
ARG_OUTPUT: int = _d["arg_kinds"]["output"]
ARG_WORKSPACE: int = _d["arg_kinds"]["workspace"]
ARG_TABLE: int = _d["arg_kinds"]["table"]
ARG_I32: int = _d["arg_kinds"]["i32"]
LAUNCH_HEADER: int = _d["launch_header"]
ARG_FIELDS: int = _d["arg_fields"]
IN_X: int = _d["inputs"]["x"]
IN_W: int = _d["inputs"]["w"]
IN_IDS: int = _d["inputs"]["ids"]
IN_GROUP0: int = _d["inputs"]["group0"]
# the CUDA backward's program outputs (the weight gradients: written through tables groups + g)
OUT_DX: int = _d["backward_outputs"]["dx"]
OUT_DTOPK_WEIGHTS: int = _d["backward_outputs"]["dtopk_weights"]
OUT_DBIAS0: int = _d["backward_outputs"]["dbias0"]  # then the bias gradients, with biases
KERNEL_FIELDS: tuple[str, ...] = tuple(_d["kernel_fields"])
ERR_NONE: int = _d["err_none"]
# the CUDA handlers' check_ids attribute: off, sync (the call fails), deferred (the next call fails)
ID_CHECK_OFF, ID_CHECK_SYNC, ID_CHECK_DEFERRED = _d["id_check_modes"]
MAX_DEFERRED_ERR_WORDS: int = _d["max_deferred_err_words"]
WORKSPACE_ALIGN: int = _d["workspace_align"]
# slots (T * k) of one call: indexed with int32 by every handler
MAX_SLOTS: int = _d["max_slots"]
# abi.h "prepacked weights": words of each packed buffer's header, its first word
PACKED_HEADER_WORDS: int = _d["packed_header_words"]
PACKED_MAGIC: int = _d["packed_magic"]

# Each target's FFI attributes (abi.h NBX_TARGET_ATTRS): target key -> {name: kind}
TARGET_ATTRIBUTES: dict[str, dict[str, str]] = {
    key: {name: kind for name, kind in attrs} for key, attrs in _d["attributes"].items()}

del _d

# How each attribute kind travels (XLA reads attributes by their numpy type).
_CONVERT = {
    "ACT": np.int32, "FMT": np.int32, "F32": np.float32, "I64": np.int64, "BOOL": bool,
    "I64S": lambda v: np.asarray(v, np.int64).reshape(-1),
    "U8S": lambda v: np.asarray(v, np.uint8).reshape(-1),
}


def attributes(target: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The FFI attributes of one call of ``target`` (a key of
    `TARGET_ATTRIBUTES`: "forward", "backward", "metal_forward",
    "cuda_forward", ...): exactly the names abi.h lists for it, each converted
    to the type its kind travels as.  A missing or unknown name is a
    ValueError naming it (a bug in the caller, caught before XLA sees it)."""
    want = TARGET_ATTRIBUTES[target]
    missing = sorted(set(want) - set(values))
    unknown = sorted(set(values) - set(want))
    if missing or unknown:
        raise ValueError(f"attributes of {target!r}: missing {missing}, unknown {unknown} "
                         f"(xla_ffi/abi.h lists {sorted(want)})")
    return {name: _CONVERT[kind](values[name]) for name, kind in want.items()}
