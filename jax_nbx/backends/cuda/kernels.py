"""Triton kernels of the CUDA path.

They are compiled ahead of the launch (`compile.py`) and launched by our CUDA
FFI handler (`xla_ffi/cuda/`) in the order a *program* (`plan.py`) lists; the
tests run the very same program under ``TRITON_INTERPRET=1``
(tests/support/triton_interpret.py).  The backward's kernels: `kernels_backward`.

Layouts (one band of ``n = Tb*k`` token slots; slot ``s`` is token ``s // k``,
choice ``s % k``):

* ``x [Tb, H]``, ``w [Tb, k]`` float32, ``ids [Tb, k]`` int32, ``y [Tb, H]``.
* every expert's weights are read IN PLACE through a pointer table: an int64
  absolute address per expert and weight group (each expert's whole array:
  ``gate``, ``up``, ``down``, or ``gate_up``, ``down`` when fused).  Dense
  weights are read through abi.h's *views*, as constexprs: element ``(k, n)``
  of a projection's logical matrix (``gate/up [H, I]``, ``down [I, H]``) lies
  at ``OFF + k*SK + n*SN`` elements from the expert's address (gate and up
  share SK, SN; plain: ``(0, I, 1)``, ``(0, H, 1)``); quantized weights take
  the plain layout only (biases or not).  ``W_ALIGNED`` says every address is a multiple of
  16 bytes (the handler checks the claim before launching).
* biases (``BIAS``): float32 ``gb, ub [E, I]``, ``db [E, H]``; the gate and
  up biases start the sums before the activation, the down bias is added
  before the routing weight (without biases the arguments are placeholders,
  never read).
* LoRA adapters (abi.h "LoRA adapters"; `lora_operands.py`): float32
  stacked ``A [E, in, r]``, ``B [E, r, out]`` per adapted projection; the
  GEMMs add ``s (z A) B`` before the biases (RG, RU, RD: the ranks, 0 =
  none, placeholders never read).
* workspace (from XLA's scratch allocator): ``err`` int32 (first bad slot),
  the expert-ordering arrays, ``h [rows, I]`` (activation times up, in the
  weights' dtype, float32 for float32 weights) and ``out [n, H]`` float32
  (each slot's weighted expert output; `combine` sums a token's k slots in
  a fixed order, so results do not depend on scheduling).

Prefill path: ``count`` → ``offsets`` → ``scatter`` order the slots by expert,
each expert's group padded to ``BM`` rows (a block never mixes experts), then
``gemm1`` (gate‖up accumulated side by side, activation in the epilogue),
``gemm2`` (routed weight in the epilogue), ``combine``.
Decode path (few slots): three launches, ``decode1`` → ``decode2`` →
``combine``, each one program per (slot, column tile, chunk of K): no
ordering, no padding, each weight tile read once per slot; the K axis is split
into chunks (partial sums added in order by the next kernel) so that a
handful of slots still gives the GPU enough programs; ``decode2`` forms the
gated unit from ``decode1``'s partial sums itself, and the expert-id check
writes one word per slot (no fill launch).

An expert id outside ``[0, E)`` is never used as an index: the slot is
skipped and recorded in ``err`` -- one word, filled with ERR_NONE first and
lowered to the smallest bad slot (prefill: ``count``), or one word per slot
(decode: ``decode1``).  The handler takes the minimum of the program's
``err_words`` words and fails the call naming the slot and the id (at once,
or at the next call on the device with ``JAX_NBX_CUDA_CHECK_IDS=deferred``).

Every code shared with the handler and `plan.py` (the expert-id check word,
activation and weight-format codes, the GELU constants) comes from
``xla_ffi/abi.h`` through `jax_nbx.contract`, as module-level ``tl.constexpr``
(the only globals a Triton function may read).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import contract

ERR_NONE = tl.constexpr(contract.ERR_NONE)
ACT_GEGLU = tl.constexpr(contract.ACT_GEGLU)  # any other ACT: swiglu
ACT_GEGLU_ERF = tl.constexpr(contract.ACT_GEGLU_ERF)
ACT_SWIGLU_CLAMPED = tl.constexpr(contract.ACT_SWIGLU_CLAMPED)
GELU_C = tl.constexpr(contract.GELU_C)
GELU_B = tl.constexpr(contract.GELU_B)
INV_SQRT2 = tl.constexpr(contract.INV_SQRT2)
# the formats `_wtile` dequantizes (plan.kernels_formats lists the same ones)
QUANT_DENSE = tl.constexpr(contract.FORMAT_CODES["dense"])
QUANT_INT8 = tl.constexpr(contract.FORMAT_CODES["int8"])
QUANT_INT4 = tl.constexpr(contract.FORMAT_CODES["int4"])
QUANT_MXFP4 = tl.constexpr(contract.FORMAT_CODES["mxfp4"])
QUANT_FP8 = tl.constexpr(contract.FORMAT_CODES["fp8"])
QUANT_MXFP8 = tl.constexpr(contract.FORMAT_CODES["mxfp8"])
QUANT_NVFP4 = tl.constexpr(contract.FORMAT_CODES["nvfp4"])


@triton.jit
def _glu(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """glu(g, u) (abi.h Activation; ALPHA and LIMIT: swiglu_clamped's)."""
    if ACT == ACT_GEGLU:  # gelu, tanh approximation; tanh(z) = 2*sigmoid(2z) - 1
        z = GELU_C * (g + GELU_B * g * g * g)
        return 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u
    if ACT == ACT_GEGLU_ERF:  # gelu, exact
        return 0.5 * g * (1.0 + tl.math.erf(g * INV_SQRT2)) * u
    if ACT == ACT_SWIGLU_CLAMPED:  # gpt-oss
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        return gc * tl.sigmoid(ALPHA * gc) * (uc + 1.0)
    return g * tl.sigmoid(g) * u  # silu


@triton.jit
def _expert_ptr(tbl, e, wref, W_ALIGNED: tl.constexpr):
    """The address of expert e's matrix, typed like wref (a pointer argument
    of the weights' dtype)."""
    p = tl.load(tbl + e).to(wref.dtype)
    if W_ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _view(kk, offs_n, OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr):
    """Element offsets [BK, BN] of rows kk and columns offs_n of a view (the
    plain view's ``k*N + n`` exactly, so its loads vectorize as before)."""
    k = kk[:, None].to(tl.int64)
    if SK != 1:
        k = k * SK
    n = offs_n[None, :]
    if SN != 1:
        n = n.to(tl.int64) * SN
    if OFF != 0:
        k = k + OFF
    return k + n


@triton.jit
def _dot32(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b on float32 operands: IEEE, else three TF32 products
    (float32's accuracy on the tensor cores): the adapters' terms."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def _lora_a(ap, e, kk, kmask, K: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """Rows kk of expert e's adapter A [E, K, R] (float32) as [BK, RP], zero
    past R (RP: R padded to a power of two, at least 16, for `tl.dot`)."""
    ra = tl.arange(0, RP)
    return tl.load(ap + e.to(tl.int64) * K * R + kk[:, None].to(tl.int64) * R + ra[None, :],
                   mask=kmask[:, None] & (ra < R)[None, :], other=0.0)


@triton.jit
def _lora_b(bp, e, offs_n, nmask, N: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """Columns offs_n of expert e's adapter B [E, R, N] (float32) as [RP, BN],
    zero past R."""
    ra = tl.arange(0, RP)
    return tl.load(bp + e.to(tl.int64) * R * N + ra[:, None] * N + offs_n[None, :],
                   mask=(ra < R)[:, None] & nmask[None, :], other=0.0)


@triton.jit
def _e2m1(c):
    """The E2M1 values of 4-bit codes ``c`` (int32), exactly
    (xla_ffi/formats/minifloat.h kE2M1Values): sign bit 3, exponent bits 2-1
    (bias 1), mantissa bit 0; exponent 0 is the subnormal 0 or 0.5."""
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e4m3(b):
    """The E4M3 ("fn") values of bytes ``b`` (int32), exactly (minifloat.h
    E4M3Value): exponent bits 6-3 (bias 7) moved to float32's (bias 127),
    mantissa bits 2-0 to its top three; exponent 0 is m * 2^-9; S.1111.111
    is NaN."""
    e = (b >> 3) & 15
    m = b & 7
    bits = ((e + 120) << 23) | (m << 20)
    bits = tl.where((b & 127) == 127, 0x7FC00000, bits)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, bits.to(tl.float32, bitcast=True))
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def _e8m0(s):
    """2^(s - 127) for E8M0 bytes ``s`` (int32), exactly (minifloat.h
    E8M0Value): s is float32's exponent field; 0 is the subnormal 2^-127
    (bit 22), 255 NaN (bit 22 on infinity)."""
    bits = s << 23
    bits = tl.where((s == 0) | (s == 255), bits | 0x400000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _wtile(qtbl, stbl, ztbl, e, wref, sref, k0, kk, offs_n, K: tl.constexpr, N: tl.constexpr, mask,
           QUANT: tl.constexpr, GS: tl.constexpr, W_ALIGNED: tl.constexpr,
           OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Expert e's weights at rows kk = k0 + [0, BK) (k0 a multiple of BK) of K and columns offs_n
    [BN] of N, as float32, each value the format's scalar reference (xla_ffi/formats/<name>.h, one
    float32 product); 0 where ``mask`` is off.  One branch per format the kernels know (a code
    they do not know fails the compile by its static_assert; plan.build refuses it by name
    first).  QUANT dense: wref's dtype, element (k, n) at OFF + k*SK + n*SN (the view); the
    quantized formats take the plain layout only: int8 times scale[n]; fp8 E4M3 bytes times a
    float scale[k // GS, n]; mxfp8 E4M3 bytes times an E8M0 scale; int4, mxfp4 and nvfp4 4-bit
    codes packed two per byte along K (low nibble = even row): int4 times scale[k // GS, n] plus
    min[k // GS, n], mxfp4 E2M1 times an E8M0 scale, nvfp4 E2M1 times an E4M3 scale.  Every byte
    of codes and every group's scale is loaded once per tile (`_codes`, `_group_tile`: #56, the
    decode path is bound by its loads).  qtbl/stbl/ztbl: tables of the expert's q, scale and min
    arrays (float scales typed like sref, byte scales like wref, the q part's uint8)."""
    p = _expert_ptr(qtbl, e, wref, W_ALIGNED)
    if QUANT == QUANT_DENSE:
        w = tl.load(p + _view(kk, offs_n, OFF, SK, SN), mask=mask, other=0.0).to(tl.float32)
    elif QUANT == QUANT_INT8:
        sp = _expert_ptr(stbl, e, sref, W_ALIGNED)
        sc = tl.load(sp + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        w = _codes(p, k0, offs_n, K, N, 1, BK, BN).to(tl.float32) * sc[None, :]
    elif QUANT == QUANT_FP8:
        sc = _group_tile(_expert_ptr(stbl, e, sref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        w = _e4m3(_codes(p, k0, offs_n, K, N, 1, BK, BN)) * sc.to(tl.float32)
    elif QUANT == QUANT_MXFP8:
        s = _group_tile(_expert_ptr(stbl, e, wref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        w = _e4m3(_codes(p, k0, offs_n, K, N, 1, BK, BN)) * _e8m0(s.to(tl.int32))
    elif QUANT == QUANT_MXFP4:
        s = _group_tile(_expert_ptr(stbl, e, wref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        w = _e2m1(_codes(p, k0, offs_n, K, N, 2, BK, BN)) * _e8m0(s.to(tl.int32))
    elif QUANT == QUANT_NVFP4:
        s = _group_tile(_expert_ptr(stbl, e, wref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        w = _e2m1(_codes(p, k0, offs_n, K, N, 2, BK, BN)) * _e4m3(s.to(tl.int32))
    else:
        tl.static_assert(QUANT == QUANT_INT4, "_wtile: a weight format code the kernels do not know")
        sc = _group_tile(_expert_ptr(stbl, e, sref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        mn = _group_tile(_expert_ptr(ztbl, e, sref, W_ALIGNED), k0, offs_n, K, N, GS, BK, BN)
        w = _codes(p, k0, offs_n, K, N, 2, BK, BN).to(tl.float32) * sc.to(tl.float32) + mn.to(tl.float32)
    if QUANT != QUANT_DENSE:
        w = tl.where(mask, w, 0.0)
    return w


@triton.jit
def _codes(p, k0, offs_n, K: tl.constexpr, N: tl.constexpr, PER_BYTE: tl.constexpr, BK: tl.constexpr,
           BN: tl.constexpr):
    """The codes at rows k0 + [0, BK), columns offs_n of a q part [K / PER_BYTE, N]: its elements
    (PER_BYTE 1, as loaded: int8, or uint8 widened to int32), or 4-bit codes packed two per byte
    along K (low nibble = even row; K even) as int32, each byte loaded once and split into the two
    rows it holds; 0 outside K and N."""
    nmask = (offs_n < N)[None, :]
    if PER_BYTE == 1:
        kk = k0 + tl.arange(0, BK)
        c = tl.load(p + kk[:, None].to(tl.int64) * N + offs_n[None, :], mask=(kk < K)[:, None] & nmask, other=0)
        if c.dtype == tl.uint8:
            c = c.to(tl.int32)
    else:
        rows = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(p + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=(rows < K // 2)[:, None] & nmask,
                       other=0).to(tl.int32)
        # [BK/2, BN, 2] (low, high) -> [BK/2, 2, BN] -> rows 2i, 2i+1
        c = tl.reshape(tl.permute(tl.join(byte & 15, byte >> 4), (0, 2, 1)), (BK, BN))
    return c


@triton.jit
def _group_tile(sp, k0, offs_n, K: tl.constexpr, N: tl.constexpr, GS: tl.constexpr, BK: tl.constexpr,
                BN: tl.constexpr):
    """Rows (k0 + i) // GS, i in [0, BK), columns offs_n of a per-group part [ceil(K / GS), N] (as
    stored; 0 outside N), each group's row loaded once and broadcast over its GS rows: the tile
    lies in one group when GS >= BK (both powers of two, k0 a multiple of BK), else it holds BK / GS
    whole groups."""
    nmask = (offs_n < N)[None, :]
    if GS >= BK:
        g = k0 // GS
        s = tl.load(sp + g.to(tl.int64) * N + offs_n[None, :], mask=nmask, other=0)
        s = tl.broadcast_to(s, (BK, BN))
    else:
        rows = k0 // GS + tl.arange(0, BK // GS)
        s = tl.load(sp + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=(rows < (K + GS - 1) // GS)[:, None] & nmask, other=0)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (BK // GS, GS, BN)), (BK, BN))
    return s


@triton.jit
def fill_i32(ptr, n, value, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.full((BLOCK,), value, tl.int32), mask=offs < n)


@triton.jit
def count(ids, n, slot0, hist, rank, err, E: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
    """Per block of slots: how many go to each expert (hist[pid, :E]) and each
    slot's rank among the block's slots of its expert.  Flags bad ids (the
    call's slot index: ``slot0`` is the band's first slot)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    e = tl.load(ids + offs, mask=live, other=0)
    bad = live & ((e < 0) | (e >= E))
    tl.atomic_min(err + tl.zeros((BLOCK,), tl.int32), tl.where(bad, slot0 + offs, ERR_NONE), mask=bad)
    ok = live & ~bad
    onehot = ((e[:, None] == tl.arange(0, EP)[None, :]) & ok[:, None]).to(tl.int32)
    cnt = tl.sum(onehot, axis=0)
    cols = tl.arange(0, EP)
    tl.store(hist + pid * E + cols, cnt, mask=cols < E)
    incl = tl.cumsum(onehot, axis=0)
    r = tl.sum(incl * onehot, axis=1) - 1
    tl.store(rank + offs, r, mask=live)


@triton.jit
def offsets(hist, base, block_expert, NBLK: tl.constexpr, NMB: tl.constexpr, E: tl.constexpr,
            EP: tl.constexpr, BM: tl.constexpr, JB: tl.constexpr):
    """One program: each expert's first padded row, every (block, expert)
    base row, and the expert of every BM-row block (-1: unused).  NBLK slot
    blocks, NMB row blocks (constexpr: they are static per band)."""
    cols = tl.arange(0, EP)
    cmask = cols < E
    total = tl.zeros((EP,), tl.int32)
    for b in range(0, NBLK):
        total += tl.load(hist + b * E + cols, mask=cmask, other=0)
    padded = (total + BM - 1) // BM * BM
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    run = start
    for b in range(0, NBLK):
        h = tl.load(hist + b * E + cols, mask=cmask, other=0)
        tl.store(base + b * E + cols, run, mask=cmask)
        run += h
    for j0 in range(0, NMB, JB):
        j = j0 + tl.arange(0, JB)
        row = j * BM
        inside = (row[:, None] >= start[None, :]) & (row[:, None] < end[None, :]) & cmask[None, :]
        found = tl.sum(inside.to(tl.int32), axis=1) > 0
        ex = tl.sum(tl.where(inside, cols[None, :], 0), axis=1)
        tl.store(block_expert + j, tl.where(found, ex, -1), mask=j < NMB)


@triton.jit
def scatter(ids, n, rank, base, sorted_slots, E: tl.constexpr, BLOCK: tl.constexpr):
    """sorted_slots[base[block, e] + rank] = slot, for every slot with a good id."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    e = tl.load(ids + offs, mask=live, other=0)
    ok = live & (e >= 0) & (e < E)
    es = tl.where(ok, e, 0)
    pos = tl.load(base + pid * E + es, mask=ok, other=0) + tl.load(rank + offs, mask=ok, other=0)
    tl.store(sorted_slots + pos, offs, mask=ok)


@triton.jit
def _block(block_expert, sorted_slots, BM: tl.constexpr):
    """This program's BM-row block: its expert (-1: unused), rows, slots
    (-1: padding) and which rows are real."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert + pid_m)
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_slots + rows)
    return e, rows, slot, slot >= 0


@triton.jit
def gemm1(x, sorted_slots, block_expert, gate_tbl, up_tbl, gs_tbl, us_tbl, gz_tbl, uz_tbl,
          wref, sref, gb, ub, lag, lbg, lau, lbu, h,
          H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, ACT: tl.constexpr,
          ALPHA: tl.constexpr, LIMIT: tl.constexpr, W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
          QUANT: tl.constexpr, GS: tl.constexpr,
          OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
          BIAS: tl.constexpr, RG: tl.constexpr, RU: tl.constexpr, SG: tl.constexpr, SU: tl.constexpr,
          RP: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """h[row, n] = glu(x[tok] @ gate[e] + gb[e], x[tok] @ up[e] + ub[e])[n]
    for the BM rows of one block (one expert) and BN columns (gate and up
    through their views).  The products run in
    sref's dtype (the weights' for dense experts, the scales' for quantized
    ones, whose tiles are dequantized in registers: `_wtile`).  LoRA (RG, RU
    > 0: the ranks): gate += SG * (x A_g) B_g (lag [E, H, RG], lbg [E, RG,
    I], float32), up likewise, before the biases; x A accumulates in the same
    K loop (float32, `_dot32`)."""
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _block(block_expert, sorted_slots, BM)
    if e < 0:
        return
    tok = tl.where(valid, slot, 0) // K_TOP
    gp = _expert_ptr(gate_tbl, e, wref, W_ALIGNED)
    upp = _expert_ptr(up_tbl, e, wref, W_ALIGNED)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < I
    offs_k = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    xag = tl.zeros((BM, RP), tl.float32)
    xau = tl.zeros((BM, RP), tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + offs_k
        kmask = kk < H
        xt = tl.load(x + tok[:, None].to(tl.int64) * H + kk[None, :],
                     mask=valid[:, None] & kmask[None, :], other=0.0)
        if RG > 0:
            xag = _dot32(xt.to(tl.float32), _lora_a(lag, e, kk, kmask, H, RG, RP), xag, IEEE)
        if RU > 0:
            xau = _dot32(xt.to(tl.float32), _lora_a(lau, e, kk, kmask, H, RU, RP), xau, IEEE)
        a = xt.to(sref.dtype.element_ty)
        wmask = kmask[:, None] & nmask[None, :]
        if QUANT == QUANT_DENSE:
            woff = _view(kk, offs_n, 0, SK, SN)
            bg = tl.load(gp + OFF_G + woff, mask=wmask, other=0.0)
            bu = tl.load(upp + OFF_U + woff, mask=wmask, other=0.0)
        else:
            bg = _wtile(gate_tbl, gs_tbl, gz_tbl, e, wref, sref, k0, kk, offs_n, H, I, wmask, QUANT, GS,
                        W_ALIGNED, 0, I, 1, BK, BN).to(sref.dtype.element_ty)
            bu = _wtile(up_tbl, us_tbl, uz_tbl, e, wref, sref, k0, kk, offs_n, H, I, wmask, QUANT, GS,
                        W_ALIGNED, 0, I, 1, BK, BN).to(sref.dtype.element_ty)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    if RG > 0:
        acc_g = _dot32(xag * SG, _lora_b(lbg, e, offs_n, nmask, I, RG, RP), acc_g, IEEE)
    if RU > 0:
        acc_u = _dot32(xau * SU, _lora_b(lbu, e, offs_n, nmask, I, RU, RP), acc_u, IEEE)
    if BIAS:
        eb = e.to(tl.int64) * I + offs_n
        acc_g += tl.load(gb + eb, mask=nmask, other=0.0)[None, :]
        acc_u += tl.load(ub + eb, mask=nmask, other=0.0)[None, :]
    out = _glu(acc_g, acc_u, ACT, ALPHA, LIMIT)
    tl.store(h + rows[:, None].to(tl.int64) * I + offs_n[None, :], out.to(h.dtype.element_ty),
             mask=nmask[None, :])


@triton.jit
def gemm2(h, sorted_slots, block_expert, down_tbl, ds_tbl, dz_tbl, wref, sref, db, lad, lbd, w, out,
          H: tl.constexpr, I: tl.constexpr, W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
          QUANT: tl.constexpr, GS: tl.constexpr,
          OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr, BIAS: tl.constexpr,
          RD: tl.constexpr, SD: tl.constexpr, RP: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[slot, n] = w[slot] * (h[row] @ down[e] + db[e])[n] for the block's
    real slots (down through its view); LoRA (RD > 0): + SD * (h A_d) B_d
    before the bias (lad [E, I, RD], lbd [E, RD, H], float32)."""
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _block(block_expert, sorted_slots, BM)
    if e < 0:
        return
    dp = _expert_ptr(down_tbl, e, wref, W_ALIGNED)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    xad = tl.zeros((BM, RP), tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + offs_k
        kmask = kk < I
        ht = tl.load(h + rows[:, None].to(tl.int64) * I + kk[None, :], mask=kmask[None, :], other=0.0)
        if RD > 0:
            xad = _dot32(ht.to(tl.float32), _lora_a(lad, e, kk, kmask, I, RD, RP), xad, IEEE)
        a = ht.to(sref.dtype.element_ty)
        if QUANT == QUANT_DENSE:
            b = tl.load(dp + _view(kk, offs_n, OFF, SK, SN), mask=kmask[:, None] & nmask[None, :],
                        other=0.0)
        else:
            b = _wtile(down_tbl, ds_tbl, dz_tbl, e, wref, sref, k0, kk, offs_n, I, H,
                       kmask[:, None] & nmask[None, :], QUANT, GS, W_ALIGNED, 0, H, 1, BK, BN
                       ).to(sref.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if RD > 0:
        acc = _dot32(xad * SD, _lora_b(lbd, e, offs_n, nmask, H, RD, RP), acc, IEEE)
    if BIAS:
        acc += tl.load(db + e.to(tl.int64) * H + offs_n, mask=nmask, other=0.0)[None, :]
    rw = tl.load(w + slot, mask=valid, other=0.0)
    acc = acc * rw[:, None]
    sl = tl.where(valid, slot, 0).to(tl.int64)
    tl.store(out + sl[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])


@triton.jit
def decode1(x, ids, slot0, err, gate_tbl, up_tbl, gs_tbl, us_tbl, gz_tbl, uz_tbl, wref, sref,
            gb, ub, lag, lbg, lau, lbu, part,
            H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, K_TOP: tl.constexpr,
            W_ALIGNED: tl.constexpr, QUANT: tl.constexpr, GS: tl.constexpr,
            OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
            BIAS: tl.constexpr, RG: tl.constexpr, RU: tl.constexpr, SG: tl.constexpr, SU: tl.constexpr,
            RP: tl.constexpr,
            KCH: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Partial gate and up sums of one slot over one chunk of KCH rows of H
    (split-K: few slots still fill the GPU): part[slot, chunk, 0|1, n],
    float32; chunk 0's start from the biases.  Each weight element is read
    once per slot.  The expert-id check: the program of tile 0, chunk 0
    writes the slot's own word err[slot0 + s] (the slot number if its id is
    outside [0, E), else ERR_NONE), so the decode path needs no fill launch
    and no atomics; the handler takes the minimum of the words.  LoRA (as
    `gemm1`): each chunk adds its own rows' share SG * (x_c A_g,c) B_g (the
    terms are linear in x, so the chunks' sum is the whole term)."""
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    c = tl.program_id(2)
    e = tl.load(ids + s)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < I
    dst = part + ((s * S + c) * 2).to(tl.int64) * I + offs_n
    bad = (e < 0) | (e >= E)
    if (pid_n == 0) & (c == 0):
        tl.store(err + slot0 + s, tl.where(bad, slot0 + s, ERR_NONE))
    if bad:
        tl.store(dst, tl.zeros((BN,), tl.float32), mask=nmask)
        tl.store(dst + I, tl.zeros((BN,), tl.float32), mask=nmask)
        return
    t = s // K_TOP
    offs_k = tl.arange(0, BK)
    if BIAS:  # chunk 0 only: the next kernel adds the chunks
        eb = e.to(tl.int64) * I + offs_n
        acc_g = tl.where(c == 0, tl.load(gb + eb, mask=nmask, other=0.0), 0.0)
        acc_u = tl.where(c == 0, tl.load(ub + eb, mask=nmask, other=0.0), 0.0)
    else:
        acc_g = tl.zeros((BN,), tl.float32)
        acc_u = tl.zeros((BN,), tl.float32)
    xag = tl.zeros((RP,), tl.float32)
    xau = tl.zeros((RP,), tl.float32)
    for j in range(0, KCH, BK):  # constant bounds (the interpreter needs them)
        kk = c * KCH + j + offs_k
        kmask = kk < H
        xv = tl.load(x + t * H + kk, mask=kmask, other=0.0).to(tl.float32)
        if RG > 0:
            xag += tl.sum(xv[:, None] * _lora_a(lag, e, kk, kmask, H, RG, RP), axis=0)
        if RU > 0:
            xau += tl.sum(xv[:, None] * _lora_a(lau, e, kk, kmask, H, RU, RP), axis=0)
        wmask = kmask[:, None] & nmask[None, :]
        bg = _wtile(gate_tbl, gs_tbl, gz_tbl, e, wref, sref, c * KCH + j, kk, offs_n, H, I, wmask, QUANT, GS,
                    W_ALIGNED, OFF_G, SK, SN, BK, BN)
        bu = _wtile(up_tbl, us_tbl, uz_tbl, e, wref, sref, c * KCH + j, kk, offs_n, H, I, wmask, QUANT, GS,
                    W_ALIGNED, OFF_U, SK, SN, BK, BN)
        acc_g += tl.sum(xv[:, None] * bg, axis=0)
        acc_u += tl.sum(xv[:, None] * bu, axis=0)
    if RG > 0:
        acc_g += tl.sum((xag * SG)[:, None] * _lora_b(lbg, e, offs_n, nmask, I, RG, RP), axis=0)
    if RU > 0:
        acc_u += tl.sum((xau * SU)[:, None] * _lora_b(lbu, e, offs_n, nmask, I, RU, RP), axis=0)
    tl.store(dst, acc_g, mask=nmask)
    tl.store(dst + I, acc_u, mask=nmask)


@triton.jit
def decode2(part, ids, down_tbl, ds_tbl, dz_tbl, wref, sref, db, lad, lbd, w, out,
            H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, W_ALIGNED: tl.constexpr,
            QUANT: tl.constexpr, GS: tl.constexpr,
            OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr, BIAS: tl.constexpr,
            RD: tl.constexpr, SD: tl.constexpr, RP: tl.constexpr,
            ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, S1: tl.constexpr,
            KCH: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[slot, chunk, n] = w[slot] * (h[slot, chunk] @ down[e][chunk] (+ db[e]
    in chunk 0))[n]: one chunk of KCH rows of I per program; `combine` adds
    the chunks.  h = glu(gate, up) is formed here from decode1's S1 partial
    sums (added in chunk order, the same float32 sums in every program), so
    no launch of its own writes it.  LoRA (RD > 0): each chunk adds
    SD * (h_c A_d,c) B_d, as `decode1`."""
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    c = tl.program_id(2)
    e = tl.load(ids + s)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    acc = tl.zeros((BN,), tl.float32)
    if (e >= 0) & (e < E):
        offs_k = tl.arange(0, BK)
        xad = tl.zeros((RP,), tl.float32)
        for j in range(0, KCH, BK):
            kk = c * KCH + j + offs_k
            kmask = kk < I
            g = tl.zeros((BK,), tl.float32)
            u = tl.zeros((BK,), tl.float32)
            for c1 in range(0, S1):
                src = part + ((s * S1 + c1) * 2).to(tl.int64) * I + kk
                g += tl.load(src, mask=kmask, other=0.0)
                u += tl.load(src + I, mask=kmask, other=0.0)
            hv = tl.where(kmask, _glu(g, u, ACT, ALPHA, LIMIT), 0.0)
            if RD > 0:
                xad += tl.sum(hv[:, None] * _lora_a(lad, e, kk, kmask, I, RD, RP), axis=0)
            b = _wtile(down_tbl, ds_tbl, dz_tbl, e, wref, sref, c * KCH + j, kk, offs_n, I, H,
                       kmask[:, None] & nmask[None, :], QUANT, GS, W_ALIGNED, OFF, SK, SN, BK, BN)
            acc += tl.sum(hv[:, None] * b, axis=0)
        if RD > 0:
            acc += tl.sum((xad * SD)[:, None] * _lora_b(lbd, e, offs_n, nmask, H, RD, RP), axis=0)
        if BIAS:
            acc += tl.where(c == 0, tl.load(db + e.to(tl.int64) * H + offs_n, mask=nmask, other=0.0), 0.0)
        acc = acc * tl.load(w + s)
    tl.store(out + (s * S + c).to(tl.int64) * H + offs_n, acc, mask=nmask)


@triton.jit
def combine(out, y, H: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr):
    """y[t] = sum of out[t*ROWS + r] over r = 0..ROWS-1, in order (ROWS = k
    slots, times the split-K chunks on the decode path)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < H
    acc = tl.zeros((BH,), tl.float32)
    for j in range(0, ROWS):
        acc += tl.load(out + (t * ROWS + j).to(tl.int64) * H + offs, mask=m, other=0.0)
    tl.store(y + t.to(tl.int64) * H + offs, acc.to(y.dtype.element_ty), mask=m)
