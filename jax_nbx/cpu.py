"""The CPU handler's micro-kernels: which instruction set runs them.

The wheel carries one build of the micro-kernels per instruction set
("avx512", "avx2", "generic" on x86-64; "generic" = NEON on arm64).  Their
entries fall into six *families*, each of which may come from a different
instruction set (`FAMILIES`; xla_ffi/cpu/kernels/isa.cc):

* ``packed``: the K-block GEMMs, packing and blocking (prefill, and any
  expert with more than 6 rows in a call);
* ``stream``: bfloat16 weights streamed in place (decode);
* ``stream_f32``: float32 weights streamed in place (decode);
* ``qstream``: int8/int4/mxfp4 weights streamed in place (quantized decode);
* ``dot``: the blocking (16 x 12 on avx512, 8 x 6 on avx2) that
  ``precision="bfloat16"`` runs on, with the bfloat16 dot-product kernels of
  that blocking (`dot_kernels`);
* ``qdot``: ``precision="int8"``'s integer-sum kernels over int8/int4
  experts (the same bits on every instruction set).

By default every family takes the best instruction set the CPU supports,
except where a measurement says otherwise (AMD family 19h, Zen 4: AVX2 for
``packed``, ``dot`` and ``stream_f32``, which were faster there, and AVX-512
for ``stream``, ``qstream`` and ``qdot``:
``packed=avx2,stream=avx512,qstream=avx512,dot=avx2,stream_f32=avx2,qdot=avx512``;
`default_isa`; the figures in docs/benchmarks.md).  The default is a
fixed rule, so results are the same bits from one process to the next.
``JAX_NBX_ISA`` (applied when the package loads, `jax_nbx._registry`) or
`set_isa` force one instruction set or a composition such as
``"packed=avx2,stream=avx512"``; `jax_nbx.calibrate_isa` times the families on
this machine and composes the fastest.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from . import _registry

__all__ = ["FAMILIES", "isa", "isa_families", "default_isa", "supported_isas", "set_isa",
           "dot_kernels", "supported_dot_kernels", "set_dot_kernels", "bf16_dot_by_default", "planned_workers"]

FAMILIES = ("packed", "stream", "qstream", "dot", "stream_f32", "qdot")

_ffi = _registry.ffi_module


def isa() -> str:
    """The micro-kernels in use: an instruction set ("avx512", "avx2",
    "generic") when every family runs it, else the composition
    ``"packed=avx2,stream=avx512,qstream=avx512,dot=avx2,stream_f32=avx2,qdot=avx512"``.  `set_isa`
    accepts either."""
    return _ffi().cpu_isa()


def isa_families() -> dict[str, str]:
    """The instruction set of each kernel family in use (`FAMILIES`)."""
    return dict(_ffi().cpu_isa_families())


def default_isa() -> str:
    """What this CPU runs unless told otherwise (same form as `isa`)."""
    return _ffi().cpu_default_isa()


def supported_isas() -> list[str]:
    """Instruction sets this CPU can run, best first."""
    return _ffi().cpu_supported_isas().split(",")


def set_isa(name: str | Mapping[str, str]) -> None:
    """Forces the micro-kernels: an instruction set for every family
    (``"avx2"``), or a composition, as a string ``"packed=avx2,stream=generic"``
    or a mapping ``{"packed": "avx2"}`` (families not named take the
    default's).  ValueError names an unknown family or instruction set, or one
    this CPU lacks.  Takes effect for calls that start after it.  On x86,
    composing "generic" (no FMA) with avx2/avx512 makes a token's float32
    result depend on how many rows its expert has in the call (up to 6 rows
    stream, more run the packed kernels); `jax_nbx.calibrate_isa` never
    composes it so."""
    if isinstance(name, Mapping):
        name = ",".join(f"{f}={i}" for f, i in name.items())
    if not isinstance(name, str) or not name:
        raise ValueError(f"set_isa: expected an instruction set name or a family=isa composition, got {name!r}")
    _ffi().set_cpu_isa(name)


def dot_kernels() -> str:
    """The bfloat16 dot-product kernels that ``fused_moe(..., precision="bfloat16")``
    runs on the CPU now, for the dot family's blocking (``precision=None``
    takes them for bfloat16 x where this is ``"avx512_bf16"``):

    - ``"avx512_bf16"``: the VDPBF16PS instruction, on CPUs with avx512_bf16;
    - ``"fma"``: the same arithmetic on float32 fused multiply-adds under
      MXCSR DAZ|FTZ (x86-64 CPUs with AVX2 or AVX-512), vector speed;
    - ``"emulated"``: a scalar emulation of that arithmetic, much slower
      (every other CPU, and the generic kernels' blocking).

    The emulated and fma kernels give the same bits (the arithmetic as Intel's
    SDM documents it; tests check them bit for bit).  Whether a CPU's
    instruction gives those bits is checked by ``benchmarks/isa.py --rows
    prefill-bf16dot`` on that CPU."""
    return _ffi().cpu_dot_kernels()


def supported_dot_kernels() -> list[str]:
    """The dot-product kernels this CPU runs, fastest first (``"emulated"`` last)."""
    return _ffi().cpu_supported_dot_kernels().split(",")


def set_dot_kernels(name: str) -> None:
    """``"auto"`` (default: the fastest this CPU has) or one of
    ``supported_dot_kernels()`` (tests, benchmarks, reproducing another
    machine's bits); where the forced kind has no kernels for the dot
    family's blocking in use, the emulation runs.  Takes effect for calls that start
    after it."""
    if name != "auto" and name not in supported_dot_kernels():
        raise ValueError(f"set_dot_kernels: expected 'auto' or one of {supported_dot_kernels()}, got {name!r}")
    _ffi().set_cpu_dot_kernels(name)


def bf16_dot_by_default() -> bool:
    """Whether ``fused_moe(..., precision=None)`` takes the bfloat16 dot-product
    kernels for bfloat16 x (with experts that can take them) on this CPU now:
    where they run on the instruction (``dot_kernels() == "avx512_bf16"``).
    Size a workspace cap for such calls with
    ``memory.fused_moe_workspace_bytes(..., bf16_dot=True)``."""
    return dot_kernels() == "avx512_bf16"


def planned_workers() -> int:
    """Workers the CPU handler may use (XLA's pool threads plus the caller);
    the workspace plan counts one worker's scratch per worker."""
    return (os.cpu_count() or 1) + 1
