"""The launch program of the CUDA path: which kernels, in what order, with
which grids and arguments.

Everything here is decided at trace time (JAX shapes are static): token
bands, tile configs, workspace layout.  The same `Program` is executed by the
CUDA handler (`xla_ffi/cuda/handlers.cc`, from the int64 encoding of
`Program.encode`) and, in the tests, by the Triton interpreter
(tests/support/triton_interpret.py), so the interpreter checks the grids and arguments the GPU
gets, not a copy of them.  Nothing in this module imports Triton.

The encoding (argument kinds, input numbering, weight-group order, the
expert-id check word, workspace alignment) is the contract of
``xla_ffi/abi.h``, read through `jax_nbx.contract`; environment variables are
read through `jax_nbx._env`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ... import _env, contract, formats
from ...activations import Activation
from .lora_operands import MAX_LORA_RANK, lora_operands, pow2
from .tile_configs import GemmConfig, _default_gemm_configs, _tl_name, config_file, gemm_configs

__all__ = ["Program", "Launch", "Kernel", "Arg", "GemmConfig", "gemm_configs", "config_file", "build",
           "build_backward", "band_workspace", "backward_band_workspace"]

# Argument kinds (abi::ArgKind).
ARG_INPUT, ARG_OUTPUT, ARG_WORKSPACE, ARG_TABLE, ARG_I32 = (
    contract.ARG_INPUT, contract.ARG_OUTPUT, contract.ARG_WORKSPACE, contract.ARG_TABLE, contract.ARG_I32)
# Inputs in call order: x, w, ids, then the first buffer of each weight group
# (group = part * 3 + projection: gate, up, down; for quantized experts then
# their scales, then (int4) their mins; fused dense experts: gate_up, down),
# then with biases the three float32 biases.  Tables are numbered by group the same way.
_Q, _SCALE, _ZERO = (contract.PARTS.index(part) for part in ("q", "scale", "zero"))
IN_X, IN_W, IN_IDS, IN_GROUP0 = contract.IN_X, contract.IN_W, contract.IN_IDS, contract.IN_GROUP0
# the backward's outputs: dx, d(topk_weights) (weight gradients: through tables)
OUT_DX, OUT_DTW, OUT_DBIAS0 = contract.OUT_DX, contract.OUT_DTOPK_WEIGHTS, contract.OUT_DBIAS0
IN_GATE, IN_UP, IN_DOWN = (IN_GROUP0 + contract.group_index(_Q, p) for p in range(len(contract.PROJECTIONS)))
# weight format (None = dense) -> the kernels' QUANT constexpr
QUANT_CODES = contract.FORMAT_CODES
_DENSE = QUANT_CODES["dense"]
ERR_NONE = contract.ERR_NONE
WS_ALIGN = contract.WORKSPACE_ALIGN
COUNT_BLOCK = 128
FILL_BLOCK = 1024
COMBINE_BLOCK = 1024



def kernels_formats() -> dict[int, str]:
    """The formats the Triton kernels dequantize in registers (code -> name):
    those whose spec names "cuda" among its kernels (xla_ffi/formats/<name>.h),
    each a branch of kernels.py's `_wtile`."""
    return {formats.get(n).code: n for n in formats.names() if "cuda" in formats.get(n).kernels}


def products_dtype(xdtype, wdtype, quant=None) -> np.dtype:
    """The dtype the kernels' products run in: the dense weights', or the
    scales' (``wdtype``) for formats that compute in them (int8, int4, fp8);
    the formats that compute in float32 (mxfp4, mxfp8, nvfp4: E2M1 and E4M3
    codes times E8M0 or E4M3 scales, at most five significant bits, so each
    dequantized weight is exact in bfloat16 within its normal range) run in
    bfloat16 on the tensor cores when x is bfloat16, else in float32."""
    if quant is None or formats.get(quant[0]).compute_part is not None:
        return np.dtype(wdtype)
    return np.dtype(xdtype) if np.dtype(xdtype).name == "bfloat16" else np.dtype("float32")


def kernels_refusal(quant, plain_views: bool, bf16_dot: bool, tensor_scales: bool = False,
                    lora=None) -> str:
    """Why the Triton kernels cannot run a problem ("" when they can): its
    experts' format (``quant``: (name, group) or None), layout (quantized
    experts: ``plain_views``, `WeightLayout.plain_views`), precision, tensor
    scales (`QuantizedWeight.tensor_scale`), adapters (``lora``: a
    `LoRASpec` or None; ranks up to `MAX_LORA_RANK`)."""
    if lora is not None and max(lora.ranks) > MAX_LORA_RANK:
        return (f"LoRA rank {max(lora.ranks)} is above the CUDA kernels' {MAX_LORA_RANK} (their tiles' "
                "shared memory); the 'cpu' handler and the 'xla' reference take any rank")
    if quant is not None and quant[0] not in kernels_formats().values():
        return (f"the CUDA kernels have no tile dequantization for {quant[0]!r} weights "
                f"(kernels.py _wtile: {sorted(kernels_formats().values())})")
    if quant is not None and not plain_views:
        return (f"reads {quant[0]} experts in the plain layout only (gate, up [E, H, I], "
                "down [E, I, H], no fused gate_up; biases or not)")
    if bf16_dot:
        return "precision='bfloat16' runs on the CPU handler only"
    if tensor_scales:
        return (f"{quant[0]} experts with a tensor scale run on the CPU handler and the xla reference "
                "(the Triton kernels have no tensor scale yet)")
    return ""


@dataclasses.dataclass(frozen=True)
class Arg:
    kind: int
    index: int = 0        # input/output number, or projection of a table
    offset: int = 0       # bytes (buffers, workspace), or the value (ARG_I32)
    ptype: str = ""       # Triton pointer type, e.g. "*bf16" ("i32" for scalars)

    def aligned16(self) -> bool:
        return self.kind != ARG_I32 and self.offset % 16 == 0


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One compiled kernel: a function of `kernels.py`, its constexprs and launch options."""
    name: str
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: Kernel
    grid: tuple[int, int, int]
    args: tuple[Arg, ...]

    def compile_key(self) -> tuple:
        """What one compilation covers: (kernel, argument types, 16-byte
        alignment of pointer arguments)."""
        return (self.kernel, tuple(a.ptype for a in self.args), tuple(a.aligned16() for a in self.args))


@dataclasses.dataclass
class Program:
    launches: list[Launch]
    workspace_bytes: int
    err_offset: int
    w_aligned: bool
    num_experts: int
    err_words: int = 1  # int32 words of the expert-id check at err_offset (the minimum counts)
    grad_dtype: str = "float32"  # the backward's weight gradients (build_backward)

    def kernels(self) -> list[tuple[Kernel, tuple[str, ...], tuple[bool, ...]]]:
        """Distinct (kernel, argument types, 16-byte alignment of pointer
        arguments) in first-use order: each is compiled once."""
        return list(dict.fromkeys(ln.compile_key() for ln in self.launches))

    def encode(self) -> np.ndarray:
        """int64 program: per launch [kernel, gx, gy, gz, nargs, (kind, index, offset)*nargs]."""
        index = {k: i for i, k in enumerate(self.kernels())}
        out: list[int] = []
        for ln in self.launches:
            out += [index[ln.compile_key()], *ln.grid, len(ln.args)]
            for a in ln.args:
                out += [a.kind, a.index, a.offset]
        return np.asarray(out, np.int64)


# --------------------------------------------------------------------------- layout

class _Layout:
    def __init__(self):
        self.size = 0

    def take(self, nbytes: int) -> int:
        off = self.size
        self.size += -(-max(int(nbytes), 1) // WS_ALIGN) * WS_ALIGN
        return off


def use_decode(slots: int) -> bool:
    """Few slots: one program per (slot, column tile) beats ordering and padding."""
    return slots <= _env.cuda_decode_slots()


def split_k(K: int, programs: int, BK: int, target: int | None = None) -> tuple[int, int]:
    """(chunk length, chunks) splitting K so that ``programs`` x chunks reaches
    about ``target`` programs (default 1024: ~8 per H100/H200 multiprocessor);
    chunks are whole BK steps."""
    target = target or _env.cuda_decode_programs()
    steps = -(-K // BK)
    want = max(1, min(steps, -(-target // max(programs, 1))))
    kch = -(-steps // want) * BK
    return kch, -(-K // kch)


def max_mblocks(slots: int, E: int, BM: int) -> int:
    """Upper bound on BM-row blocks after padding every expert's group."""
    return -(-slots // BM) + min(E, slots)


def band_workspace(tokens: int, k: int, E: int, H: int, I: int, wdtype, device_name=None,
                   quant=None, call_tokens: int | None = None) -> int:
    """Bytes of workspace of one band of ``tokens`` tokens (0: the fixed part)
    in a call of ``call_tokens`` tokens (default: ``tokens``; the call's slots
    choose the kernels and their tiles, the same for every band)."""
    return _build(tokens, tokens, k, E, H, I, np.float32, wdtype, 0, device_name,
                  layout_only=True, quant=quant, call_slots=(call_tokens or tokens) * k).workspace_bytes


def build(T: int, band: int, k: int, E: int, H: int, I: int, xdtype, wdtype,
          activation: int | Activation,
          device_name: str | None = None, w_aligned: bool = True,
          quant: tuple | None = None, layout=None, lora=None) -> Program:
    """The program of one fused_moe call: T tokens in bands of ``band``.

    ``quant``: None for dense weights of dtype ``wdtype``, else
    ``(kind, group_size)`` with kind "int8"/"int4" and ``wdtype`` the scales'
    dtype (the products then run in that dtype).  ``layout``: the
    `jax_nbx.experts.WeightLayout` of the weights (abi.h "weight views": the
    kernels read them through its views, and its biases); None: plain.
    ``lora``: the adapters' `jax_nbx.lora.LoRASpec` (abi.h "LoRA adapters":
    float32 stacked A_p, B_p as inputs after the biases, fused into gemm1 /
    gemm2 and decode1 / decode2); None: no adapters."""
    return _build(T, band, k, E, H, I, xdtype, wdtype, activation, device_name,
                  w_aligned=w_aligned, quant=quant, layout=layout, call_slots=T * k, lora=lora)


def plain_views(H: int, I: int) -> tuple[tuple[int, int, int], ...]:
    """Per projection (offset, stride_k, stride_n) of plain gate, up [H, I], down [I, H]."""
    return (0, I, 1), (0, I, 1), (0, H, 1)


def views_of(layout, H: int, I: int, quant=None) -> tuple[tuple[tuple[int, int, int], ...], bool, bool]:
    """(per projection (offset, stride_k, stride_n), fused, bias) of a
    `WeightLayout` (None: plain); checks what the kernels assume: I, gate and
    up sharing their strides, quantized weights in the plain layout only."""
    plain = plain_views(H, I)
    if layout is None:
        return plain, False, False
    nf, npj = len(contract.VIEW_FIELDS), len(contract.PROJECTIONS)
    v = tuple(int(a) for a in layout.views)
    if len(v) != nf * npj:
        raise ValueError(f"views must hold {nf * npj} values; got {len(v)}")
    if int(layout.intermediate) != I:
        raise ValueError(f"the layout's intermediate size {layout.intermediate} is not I={I}")
    views = tuple(v[p * nf:(p + 1) * nf] for p in range(npj))
    fused, bias = bool(layout.fused), bool(layout.bias)
    if quant and (fused or views != plain):
        raise ValueError(f"the CUDA path reads {quant[0]} experts in the plain layout only (gate, up "
                         "[E, H, I], down [E, I, H], no fused gate_up; biases or not)")
    if views[0][1:] != views[1][1:]:
        raise ValueError("gate and up views must share their strides")
    return views, fused, bias


def _ws(off: int, t: str = "*i32") -> Arg:
    """A workspace argument at byte ``off``."""
    return Arg(ARG_WORKSPACE, 0, off, t)


def _inp(i: int, off: int, t: str) -> Arg:
    """Input ``i`` (abi.h's numbering) at byte ``off``."""
    return Arg(ARG_INPUT, i, off, t)


def _i32(v: int) -> Arg:
    """An int32 value."""
    return Arg(ARG_I32, 0, int(v), "i32")


def _order_slots(launches: list, ids_a: Arg, nb: int, slot0: int, E: int, BM: int, err: int, hist: int,
                 rank: int, base: int, bexp: int, srt: int) -> int:
    """Appends the launches ordering a band's ``nb`` slots by expert (each
    expert's group padded to BM rows; bad ids lower the check word at
    ``err``): fill the sorted slots with -1, count, offsets, scatter.
    Workspace offsets as laid out by the caller.  Returns the band's number
    of BM-row blocks (`max_mblocks`)."""
    nblk = -(-nb // COUNT_BLOCK)
    mb = max_mblocks(nb, E, BM)
    EP = pow2(E)
    _fill(launches, srt, mb * BM, -1)
    kc = Kernel("count", (("E", E), ("EP", EP), ("BLOCK", COUNT_BLOCK)), 4, 1)
    launches.append(Launch(kc, (nblk, 1, 1), (ids_a, _i32(nb), _i32(slot0), _ws(hist), _ws(rank), _ws(err))))
    ko = Kernel("offsets", (("NBLK", nblk), ("NMB", mb), ("E", E), ("EP", EP), ("BM", BM), ("JB", 64)), 4, 1)
    launches.append(Launch(ko, (1, 1, 1), (_ws(hist), _ws(base), _ws(bexp))))
    ks = Kernel("scatter", (("E", E), ("BLOCK", COUNT_BLOCK)), 4, 1)
    launches.append(Launch(ks, (nblk, 1, 1), (ids_a, _i32(nb), _ws(rank), _ws(base), _ws(srt))))
    return mb


def _fill(launches: list, off: int, count: int, value: int) -> None:
    """Appends a launch writing ``value`` to ``count`` int32 words of workspace at ``off``."""
    launches.append(Launch(Kernel("fill_i32", (("BLOCK", FILL_BLOCK),)),
                           (-(-count // FILL_BLOCK), 1, 1), (_ws(off), _i32(count), _i32(value))))


def _build(T, band, k, E, H, I, xdtype, wdtype, activation, device_name, *,
           w_aligned=True, layout_only=False, quant=None, layout=None, call_slots=0,
           lora=None) -> Program:
    band = max(1, min(int(band) or T, T)) if T else 1
    xdtype, wdtype = np.dtype(xdtype), np.dtype(wdtype)
    a = Activation(contract.ACTIVATIONS[activation]) if isinstance(activation, int) else activation
    act = (("ACT", a.code), ("ALPHA", float(a.alpha)), ("LIMIT", float(a.limit)))
    kind, gsize = quant if quant else ("dense", 0)
    fmt = formats.get(kind)  # the registry: an unknown format is refused by name here
    if fmt.code not in kernels_formats():
        raise ValueError(f"the CUDA kernels have no tile dequantization for {fmt.name!r} weights "
                         f"(jax_nbx/backends/cuda/kernels.py _wtile: {sorted(kernels_formats().values())})")
    QUANT = fmt.code
    xs = "*" + _tl_name(xdtype)
    # the weights' pointer type: the dense dtype, or the q part's (int8, packed uint8 ...)
    ws_t = "*" + _tl_name(wdtype if QUANT == _DENSE else fmt.part_dtypes["q"][0])
    wdtype = products_dtype(xdtype, wdtype, quant)
    ieee = wdtype == np.float32
    hdtype = np.dtype("float32") if ieee else wdtype
    n = band * k
    # the call's slots choose the path (decode or prefill), the split of K and
    # the tiles, so every band of a call runs the same kernels: bands give the
    # bits of one band
    m = max(call_slots, n)
    decode = use_decode(m)
    # the expert-id check: one word per slot on the decode path (decode1 writes
    # each, no fill), else one word (filled, then lowered by `count`)
    err_words = max(1, T * k) if decode else 1
    lay = _Layout()
    err = lay.take(4 * err_words)
    launches: list[Launch] = []
    ws, inp, i32 = _ws, _inp, _i32

    def fill(off, count, value):
        _fill(launches, off, count, value)

    views, fused, has_bias = views_of(layout, H, I, quant)
    group_of = (0, 0, 1) if fused else (0, 1, 2)  # each projection's buffer group (dense)
    n_groups = 2 if fused else len(contract.parts_of(kind)) * len(contract.PROJECTIONS)
    (og, sk, sn), (ou, _, _), dview = views
    v1 = (("OFF_G", og), ("OFF_U", ou), ("SK", sk), ("SN", sn), ("BIAS", has_bias))
    v2 = (("OFF", dview[0]), ("SK", dview[1]), ("SN", dview[2]), ("BIAS", has_bias))
    # the biases (after the weight groups' inputs), or placeholders the kernels never read
    bias_args = ([inp(IN_GROUP0 + n_groups + j, 0, "*fp32") for j in range(contract.NUM_BIASES)]
                 if has_bias else [inp(IN_W, 0, "*fp32")] * contract.NUM_BIASES)
    l1, l2, lora_in = lora_operands(lora, IN_GROUP0 + n_groups + (contract.NUM_BIASES if has_bias else 0))
    lg, lu, ld = ([inp(i, 0, "*fp32") for i in pair] for pair in lora_in)
    v1, v2 = v1 + l1, v2 + l2

    def tables(part):  # one table per projection (gate, up, down) of a part
        return [Arg(ARG_TABLE, contract.group_index(part, group_of[p]), 0, "*i64")
                for p in range(len(contract.PROJECTIONS))]

    wref = inp(IN_GATE, 0, ws_t)
    # typed like the products: the weights (dense), the scales (int8, int4,
    # fp8), or for byte-scaled formats an input of the products' dtype (x or
    # the float32 routing weights; only its type is read)
    if QUANT == _DENSE:
        sref = wref
    elif fmt.compute_part is not None:
        sref = inp(IN_GROUP0 + contract.group_index(_SCALE, 0), 0, "*" + _tl_name(wdtype))
    else:
        sref = inp(IN_X, 0, xs) if wdtype == xdtype else inp(IN_W, 0, "*fp32")
    tbl = tables(_Q)
    stbl = tables(_SCALE) if "scale" in fmt.parts and QUANT != _DENSE else tbl
    ztbl = tables(_ZERO) if "zero" in fmt.parts else stbl
    qc = (("QUANT", QUANT), ("GS", gsize))
    common = (("H", H), ("I", I))
    rows = k
    if decode:
        BN, BK = 64, 64
        KCH1, S1 = split_k(H, m * -(-I // BN), BK)
        KCH2, S2 = split_k(I, m * -(-H // BN), BK)
        rows = k * S2
        part_off = lay.take(n * S1 * 2 * I * 4)
        out_off = lay.take(n * S2 * H * 4)
        d1 = Kernel("decode1", common + (("E", E), ("K_TOP", k), ("W_ALIGNED", w_aligned)) + qc + v1
                    + (("KCH", KCH1), ("S", S1), ("BN", BN), ("BK", BK)), 4, 1)
        d2 = Kernel("decode2", common + (("E", E), ("W_ALIGNED", w_aligned)) + qc + v2 + act
                    + (("S1", S1), ("KCH", KCH2), ("S", S2), ("BN", BN), ("BK", BK)), 4, 1)
    else:
        c1, c2 = gemm_configs(m, E, H, I, wdtype, device_name,
                              f"{kind}g{gsize}" if kind == "int4" else (kind or ""))
        BM = c1.BM
        assert c2.BM == BM, "gemm1 and gemm2 share the row blocks"
        MB = max_mblocks(n, E, BM)
        nblk = -(-n // COUNT_BLOCK)
        hist = lay.take(nblk * E * 4)
        rank = lay.take(n * 4)
        base = lay.take(nblk * E * 4)
        bexp = lay.take(MB * 4)
        srt = lay.take(MB * BM * 4)
        h_off = lay.take(MB * BM * I * hdtype.itemsize)
        out_off = lay.take(n * H * 4)
        g1 = Kernel("gemm1", common + (("K_TOP", k),) + act + (("W_ALIGNED", w_aligned),
                                       ("IEEE", ieee)) + qc + v1 + (("BM", BM), ("BN", c1.BN), ("BK", c1.BK)),
                    c1.num_warps, c1.num_stages)
        g2 = Kernel("gemm2", common + (("W_ALIGNED", w_aligned), ("IEEE", ieee)) + qc + v2
                    + (("BM", BM), ("BN", c2.BN), ("BK", c2.BK)), c2.num_warps, c2.num_stages)
    if layout_only:
        return Program([], lay.size, err, w_aligned, E, err_words)

    if not decode or T == 0:  # (T = 0: no decode1 writes the word)
        fill(err, 1, ERR_NONE)
    xb, wb, ib = xdtype.itemsize, 4, 4
    for t0 in range(0, T, band):
        tb = min(band, T - t0)
        nb = tb * k
        x_a = inp(IN_X, t0 * H * xb, xs)
        w_a = inp(IN_W, t0 * k * wb, "*fp32")
        ids_a = inp(IN_IDS, t0 * k * ib, "*i32")
        y_a = Arg(ARG_OUTPUT, 0, t0 * H * xb, xs)
        hf = "*" + _tl_name(hdtype)
        if decode:
            launches.append(Launch(d1, (nb, -(-I // BN), S1),
                                   (x_a, ids_a, i32(t0 * k), ws(err), tbl[0], tbl[1], stbl[0], stbl[1],
                                    ztbl[0], ztbl[1], wref, sref, *bias_args[:2], *lg, *lu,
                                    ws(part_off, "*fp32"))))
            launches.append(Launch(d2, (nb, -(-H // BN), S2),
                                   (ws(part_off, "*fp32"), ids_a, tbl[2], stbl[2], ztbl[2], wref, sref,
                                    bias_args[2], *ld, w_a, ws(out_off, "*fp32"))))
        else:
            mb = _order_slots(launches, ids_a, nb, t0 * k, E, BM, err, hist, rank, base, bexp, srt)
            launches.append(Launch(g1, (mb, -(-I // c1.BN), 1),
                                   (x_a, ws(srt), ws(bexp), tbl[0], tbl[1], stbl[0], stbl[1], ztbl[0],
                                    ztbl[1], wref, sref, *bias_args[:2], *lg, *lu, ws(h_off, hf))))
            launches.append(Launch(g2, (mb, -(-H // c2.BN), 1),
                                   (ws(h_off, hf), ws(srt), ws(bexp), tbl[2], stbl[2], ztbl[2], wref, sref,
                                    bias_args[2], *ld, w_a, ws(out_off, "*fp32"))))
        if decode:  # every slot's chunks written (zeros for a skipped slot)
            combine = Kernel("combine", (("H", H), ("ROWS", rows), ("BH", COMBINE_BLOCK)), 4, 1)
            launches.append(Launch(combine, (tb, -(-H // COMBINE_BLOCK), 1), (ws(out_off, "*fp32"), y_a)))
        else:  # gemm2 writes the rows of good slots only: skipped slots are left out
            combine = Kernel("combine_slots", (("H", H), ("E", E), ("K_TOP", k), ("BH", COMBINE_BLOCK)),
                             4, 1)
            launches.append(Launch(combine, (tb, -(-H // COMBINE_BLOCK), 1),
                                   (ws(out_off, "*fp32"), ids_a, y_a)))
    return Program(launches, lay.size, err, w_aligned, E, err_words)


# --------------------------------------------------------------------------- backward

def backward_inputs(n_groups: int, has_bias: bool = False) -> int:
    """Input number of dy in a backward call (abi.h: the forward's inputs,
    then dy)."""
    return IN_GROUP0 + n_groups + (contract.NUM_BIASES if has_bias else 0)


def _bwd_dw_tile(wdtype) -> int:
    return 32 if np.dtype(wdtype) == np.float32 else 64


def backward_band_workspace(tokens: int, k: int, E: int, H: int, I: int, wdtype,
                            device_name=None, call_tokens: int | None = None) -> int:
    """Bytes of workspace of one backward band of ``tokens`` tokens (0: the
    fixed part) in a call of ``call_tokens`` tokens (default: ``tokens``; the
    tile configs are the call's)."""
    return _build_backward(tokens, tokens, k, E, H, I, np.float32, wdtype, 0, device_name,
                           layout_only=True, call_slots=(call_tokens or tokens) * k).workspace_bytes


def build_backward(T: int, band: int, k: int, E: int, H: int, I: int, xdtype, wdtype,
                   activation: int | Activation, device_name: str | None = None,
                   w_aligned: bool = True, layout=None, grad_dtype=None) -> Program:
    """The program of one fused_moe backward call (dense experts, any
    layout, with or without biases): T tokens in bands of ``band``.

    Inputs (abi.h): x, topk_weights, topk_ids, the weight groups' first
    buffers, [the biases], then dy [T, H] in x's dtype (`backward_inputs`).
    Outputs: ``OUT_DX`` dx [T, H] (x's dtype), ``OUT_DTW`` d(topk_weights)
    [T, k] float32, with biases ``OUT_DBIAS0 + j`` the float32 bias
    gradients [E, I], [E, I], [E, H]; the weight gradients (the weights'
    shapes and views; ``Program.grad_dtype``: float32, or the weights' own
    16-bit dtype when the call is one band -- the float32 sums rounded once
    in `bwd_dw`, the cast XLA would otherwise make on a float32 copy) are
    written through pointer tables ``G + g`` (g: the weights' group), built
    like the weights' own from the gradient buffers.

    Per band: the forward's ordering (fill, count, offsets, scatter), then
    ``expert_ranges``, ``bwd_gemm1`` (recompute g, u; da = dy D^T; dg, du,
    wh and the per-tile d(topk_weight) partials), ``bwd_dtw``, ``bwd_dx`` +
    ``combine_slots`` (dx), ``bwd_dw`` (weight gradients, the first band
    storing, later bands adding to what is stored: band after band).  dx and
    d(topk_weights) are bit-identical whatever the bands (every band runs
    the tile configs of the call's T·k slots, so a row's sums never change
    shape); the weight gradients are deterministic, but a different band
    size sums them in a different grouping.  ``grad_dtype``: "float32" forces
    float32 weight gradients (default: as above)."""
    return _build_backward(T, band, k, E, H, I, xdtype, wdtype, activation, device_name,
                           w_aligned=w_aligned, layout=layout, call_slots=T * k, grad_dtype=grad_dtype)


def _build_backward(T, band, k, E, H, I, xdtype, wdtype, activation, device_name, *,
                    w_aligned=True, layout_only=False, layout=None, call_slots=0,
                    grad_dtype=None) -> Program:
    band = max(1, min(int(band) or T, T)) if T else 1
    xdtype, wdtype = np.dtype(xdtype), np.dtype(wdtype)
    # one band: 16-bit weights get their gradients in their own dtype (no later band adds to them)
    if grad_dtype is None:
        grad_dtype = wdtype if (band >= T and wdtype.itemsize == 2) else np.float32
    grad_dtype = np.dtype(grad_dtype)
    if grad_dtype not in (np.dtype(np.float32), wdtype) or (grad_dtype != np.float32 and band < T):
        raise ValueError(f"grad_dtype: float32, or the weights' {wdtype} with one band; got {grad_dtype}")
    a = Activation(contract.ACTIVATIONS[activation]) if isinstance(activation, int) else activation
    act = (("ACT", a.code), ("ALPHA", float(a.alpha)), ("LIMIT", float(a.limit)))
    views, fused, has_bias = views_of(layout, H, I)
    group_of = (0, 0, 1) if fused else (0, 1, 2)
    G = 2 if fused else len(contract.PROJECTIONS)
    (og, sk, sn), (ou, _, _), (od, skd, snd) = views
    vw = (("OFF_G", og), ("OFF_U", ou), ("SK", sk), ("SN", sn))
    vd = (("OFF_D", od), ("SK_D", skd), ("SN_D", snd), ("BIAS", has_bias))
    xs = "*" + _tl_name(xdtype)
    wt = "*" + _tl_name(wdtype)
    ieee = wdtype == np.float32
    hdtype = np.dtype("float32") if ieee else wdtype
    hf = "*" + _tl_name(hdtype)
    n = band * k
    # the defaults, never a tuned file: tune_gpu.py times the forward's kernels, and a config
    # that fits gemm1/gemm2 can exceed shared memory in bwd_gemm1/bwd_dx (more tiles per stage)
    c1, c2 = _default_gemm_configs(max(call_slots, n) / E, wdtype)
    BM = c1.BM
    MB = max_mblocks(n, E, BM)
    nblk = -(-n // COUNT_BLOCK)
    EP = pow2(E)
    NT = -(-I // c1.BN)
    BT = _bwd_dw_tile(wdtype)
    lay = _Layout()
    # the gradients' G pointer tables come first: the handler uploads them at
    # offset 0 of the workspace on every call (abi.h "CUDA backward")
    assert lay.take(G * E * 8) == 0
    err = lay.take(4)
    hist = lay.take(nblk * E * 4)
    rank = lay.take(n * 4)
    base = lay.take(nblk * E * 4)
    bexp = lay.take(MB * 4)
    srt = lay.take(MB * BM * 4)
    erange = lay.take(2 * E * 4)
    dg_off = lay.take(MB * BM * I * hdtype.itemsize)
    du_off = lay.take(MB * BM * I * hdtype.itemsize)
    wh_off = lay.take(MB * BM * I * hdtype.itemsize)
    part = lay.take(NT * n * 4)
    dxs = lay.take(n * H * 4)
    if layout_only:
        return Program([], lay.size, err, w_aligned, E, grad_dtype=grad_dtype.name)

    launches: list[Launch] = []
    ws, inp, i32 = _ws, _inp, _i32

    def fill(off, count, value):
        _fill(launches, off, count, value)

    tbl = [Arg(ARG_TABLE, group_of[p], 0, "*i64") for p in range(len(contract.PROJECTIONS))]
    gtbl = [Arg(ARG_TABLE, G + group_of[p], 0, "*i64") for p in range(len(contract.PROJECTIONS))]
    wref = inp(IN_GATE, 0, wt)
    # any pointer of the gradients' dtype: types the gradient tables' addresses
    gref = inp(IN_GATE, 0, wt) if grad_dtype != np.float32 else inp(IN_W, 0, "*fp32")
    dy_in = backward_inputs(G, has_bias)
    # the biases (inputs after the weight groups) and their gradients (outputs
    # OUT_DBIAS0 + j), or placeholders the kernels never touch
    nbias = contract.NUM_BIASES
    bias_in = ([inp(IN_GROUP0 + G + j, 0, "*fp32") for j in range(nbias)] if has_bias
               else [inp(IN_W, 0, "*fp32")] * nbias)
    bias_out = ([Arg(ARG_OUTPUT, OUT_DBIAS0 + j, 0, "*fp32") for j in range(nbias)] if has_bias
                else [Arg(ARG_OUTPUT, OUT_DTW, 0, "*fp32")] * nbias)
    common = (("H", H), ("I", I))
    k1 = Kernel("bwd_gemm1", common + (("K_TOP", k), ("NPS", n)) + act
                + (("W_ALIGNED", w_aligned), ("IEEE", ieee)) + vw + vd
                + (("BM", BM), ("BN", c1.BN), ("BK", c1.BK)), c1.num_warps, c1.num_stages)
    kt = Kernel("bwd_dtw", (("E", E), ("NT", NT), ("NPS", n), ("BLOCK", COUNT_BLOCK)), 4, 1)
    kx = Kernel("bwd_dx", common + (("W_ALIGNED", w_aligned), ("IEEE", ieee)) + vw
                + (("BM", BM), ("BN", c2.BN), ("BK", c2.BK)), c2.num_warps, c2.num_stages)
    kb = Kernel("combine_slots", (("H", H), ("E", E), ("K_TOP", k), ("BH", COMBINE_BLOCK)), 4, 1)

    def kw(accum):
        return Kernel("bwd_dw", common + (("K_TOP", k), ("IEEE", ieee), ("ACCUM", accum)) + vw + vd
                      + (("BM", BM), ("BH", BT), ("BI", BT)), 4, 1 if ieee else 2)

    fill(err, 1, ERR_NONE)
    xb = xdtype.itemsize
    # T = 0 still runs one empty band: its bwd_dw writes the (zero) weight gradients
    for bi, t0 in enumerate(range(0, max(T, 1), band)):
        tb = min(band, T - t0)
        nb = tb * k
        x_a = inp(IN_X, t0 * H * xb, xs)
        dy_a = inp(dy_in, t0 * H * xb, xs)
        w_a = inp(IN_W, t0 * k * 4, "*fp32")
        ids_a = inp(IN_IDS, t0 * k * 4, "*i32")
        dx_a = Arg(ARG_OUTPUT, OUT_DX, t0 * H * xb, xs)
        dtw_a = Arg(ARG_OUTPUT, OUT_DTW, t0 * k * 4, "*fp32")
        mb = _order_slots(launches, ids_a, nb, t0 * k, E, BM, err, hist, rank, base, bexp, srt)
        kr = Kernel("expert_ranges", (("NMB", mb), ("E", E), ("EP", EP), ("JB", 64)), 4, 1)
        launches.append(Launch(kr, (1, 1, 1), (ws(bexp), ws(erange))))
        wsd = (ws(dg_off, hf), ws(du_off, hf), ws(wh_off, hf))
        launches.append(Launch(k1, (mb, NT, 1),
                               (x_a, dy_a, w_a, ws(srt), ws(bexp), *tbl, wref, *bias_in, *wsd,
                                ws(part, "*fp32"))))
        launches.append(Launch(kt, (-(-nb // COUNT_BLOCK), 1, 1), (ws(part, "*fp32"), ids_a, dtw_a, i32(nb))))
        launches.append(Launch(kx, (mb, -(-H // c2.BN), 1),
                               (ws(dg_off, hf), ws(du_off, hf), ws(srt), ws(bexp), tbl[0], tbl[1], wref,
                                ws(dxs, "*fp32"))))
        launches.append(Launch(kb, (tb, -(-H // COMBINE_BLOCK), 1), (ws(dxs, "*fp32"), ids_a, dx_a)))
        launches.append(Launch(kw(bi > 0), (E, -(-H // BT), -(-I // BT)),
                               (x_a, dy_a, w_a, *wsd, ws(srt), ws(erange), *gtbl, wref, gref, *bias_out)))
    return Program(launches, lay.size, err, w_aligned, E, grad_dtype=grad_dtype.name)
