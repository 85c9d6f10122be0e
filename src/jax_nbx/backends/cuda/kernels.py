"""Triton kernels of the CUDA path.

They are compiled ahead of the launch (`compile.py`) and launched by our CUDA
FFI handler (`xla_ffi/cuda/`) in the order a *program* (`plan.py`) lists; the
tests run the very same program under ``TRITON_INTERPRET=1`` (`interpret.py`).

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
  the plain layout only.  ``W_ALIGNED`` says every address is a multiple of
  16 bytes (the handler checks the claim before launching).
* biases (``BIAS``): float32 ``gb, ub [E, I]``, ``db [E, H]``; the gate and
  up biases start the sums before the activation, the down bias is added
  before the routing weight (without biases the arguments are placeholders,
  never read).
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
QUANT_DENSE = tl.constexpr(contract.FORMAT_CODES["dense"])
QUANT_INT8 = tl.constexpr(contract.FORMAT_CODES["int8"])  # any other QUANT: int4


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
def _wtile(qtbl, stbl, ztbl, e, wref, sref, kk, offs_n, N: tl.constexpr, mask,
           QUANT: tl.constexpr, GS: tl.constexpr, W_ALIGNED: tl.constexpr,
           OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr):
    """Expert e's weights at rows kk [BK] and columns offs_n [BN], as float32.
    QUANT dense: wref's dtype, element (k, n) at OFF + k*SK + n*SN (the view);
    int8 (plain layout only, like int4): times scale[n]; int4: packed two
    per byte along K (low nibble = even row), times scale[k // GS, n] plus
    min[k // GS, n].  qtbl/stbl/ztbl: tables of the expert's q, scale and min
    arrays (scales typed like sref)."""
    p = _expert_ptr(qtbl, e, wref, W_ALIGNED)
    if QUANT == QUANT_DENSE:
        return tl.load(p + _view(kk, offs_n, OFF, SK, SN), mask=mask, other=0.0).to(tl.float32)
    sp = _expert_ptr(stbl, e, sref, W_ALIGNED)
    if QUANT == QUANT_INT8:
        q = tl.load(p + kk[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
        sc = tl.load(sp + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        return q.to(tl.float32) * sc[None, :]
    zp = _expert_ptr(ztbl, e, sref, W_ALIGNED)
    byte = tl.load(p + (kk // 2)[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask,
                   other=0).to(tl.int32)
    nib = tl.where((kk % 2 == 0)[:, None], byte & 15, byte >> 4).to(tl.float32)
    goff = (kk // GS)[:, None].to(tl.int64) * N + offs_n[None, :]
    sc = tl.load(sp + goff, mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(zp + goff, mask=mask, other=0.0).to(tl.float32)
    return nib * sc + mn


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
          wref, sref, gb, ub, h,
          H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, ACT: tl.constexpr,
          ALPHA: tl.constexpr, LIMIT: tl.constexpr, W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
          QUANT: tl.constexpr, GS: tl.constexpr,
          OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
          BIAS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """h[row, n] = glu(x[tok] @ gate[e] + gb[e], x[tok] @ up[e] + ub[e])[n]
    for the BM rows of one block (one expert) and BN columns (gate and up
    through their views).  The products run in
    sref's dtype (the weights' for dense experts, the scales' for quantized
    ones, whose tiles are dequantized in registers: `_wtile`)."""
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
    for k0 in range(0, H, BK):
        kk = k0 + offs_k
        kmask = kk < H
        a = tl.load(x + tok[:, None].to(tl.int64) * H + kk[None, :],
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        a = a.to(sref.dtype.element_ty)
        wmask = kmask[:, None] & nmask[None, :]
        if QUANT == QUANT_DENSE:
            woff = _view(kk, offs_n, 0, SK, SN)
            bg = tl.load(gp + OFF_G + woff, mask=wmask, other=0.0)
            bu = tl.load(upp + OFF_U + woff, mask=wmask, other=0.0)
        else:
            bg = _wtile(gate_tbl, gs_tbl, gz_tbl, e, wref, sref, kk, offs_n, I, wmask, QUANT, GS,
                        W_ALIGNED, 0, I, 1).to(sref.dtype.element_ty)
            bu = _wtile(up_tbl, us_tbl, uz_tbl, e, wref, sref, kk, offs_n, I, wmask, QUANT, GS,
                        W_ALIGNED, 0, I, 1).to(sref.dtype.element_ty)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    if BIAS:
        eb = e.to(tl.int64) * I + offs_n
        acc_g += tl.load(gb + eb, mask=nmask, other=0.0)[None, :]
        acc_u += tl.load(ub + eb, mask=nmask, other=0.0)[None, :]
    out = _glu(acc_g, acc_u, ACT, ALPHA, LIMIT)
    tl.store(h + rows[:, None].to(tl.int64) * I + offs_n[None, :], out.to(h.dtype.element_ty),
             mask=nmask[None, :])


@triton.jit
def gemm2(h, sorted_slots, block_expert, down_tbl, ds_tbl, dz_tbl, wref, sref, db, w, out,
          H: tl.constexpr, I: tl.constexpr, W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
          QUANT: tl.constexpr, GS: tl.constexpr,
          OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr, BIAS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[slot, n] = w[slot] * (h[row] @ down[e] + db[e])[n] for the block's
    real slots (down through its view)."""
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _block(block_expert, sorted_slots, BM)
    if e < 0:
        return
    dp = _expert_ptr(down_tbl, e, wref, W_ALIGNED)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + offs_k
        kmask = kk < I
        a = tl.load(h + rows[:, None].to(tl.int64) * I + kk[None, :], mask=kmask[None, :], other=0.0)
        a = a.to(sref.dtype.element_ty)
        if QUANT == QUANT_DENSE:
            b = tl.load(dp + _view(kk, offs_n, OFF, SK, SN), mask=kmask[:, None] & nmask[None, :],
                        other=0.0)
        else:
            b = _wtile(down_tbl, ds_tbl, dz_tbl, e, wref, sref, kk, offs_n, H,
                       kmask[:, None] & nmask[None, :], QUANT, GS, W_ALIGNED, 0, H, 1
                       ).to(sref.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if BIAS:
        acc += tl.load(db + e.to(tl.int64) * H + offs_n, mask=nmask, other=0.0)[None, :]
    rw = tl.load(w + slot, mask=valid, other=0.0)
    acc = acc * rw[:, None]
    sl = tl.where(valid, slot, 0).to(tl.int64)
    tl.store(out + sl[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])


@triton.jit
def decode1(x, ids, slot0, err, gate_tbl, up_tbl, gs_tbl, us_tbl, gz_tbl, uz_tbl, wref, sref,
            gb, ub, part,
            H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, K_TOP: tl.constexpr,
            W_ALIGNED: tl.constexpr, QUANT: tl.constexpr, GS: tl.constexpr,
            OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
            BIAS: tl.constexpr,
            KCH: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Partial gate and up sums of one slot over one chunk of KCH rows of H
    (split-K: few slots still fill the GPU): part[slot, chunk, 0|1, n],
    float32; chunk 0's start from the biases.  Each weight element is read
    once per slot.  The expert-id check: the program of tile 0, chunk 0
    writes the slot's own word err[slot0 + s] (the slot number if its id is
    outside [0, E), else ERR_NONE), so the decode path needs no fill launch
    and no atomics; the handler takes the minimum of the words."""
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
    for j in range(0, KCH, BK):  # constant bounds (the interpreter needs them)
        kk = c * KCH + j + offs_k
        kmask = kk < H
        xv = tl.load(x + t * H + kk, mask=kmask, other=0.0).to(tl.float32)
        wmask = kmask[:, None] & nmask[None, :]
        bg = _wtile(gate_tbl, gs_tbl, gz_tbl, e, wref, sref, kk, offs_n, I, wmask, QUANT, GS, W_ALIGNED,
                    OFF_G, SK, SN)
        bu = _wtile(up_tbl, us_tbl, uz_tbl, e, wref, sref, kk, offs_n, I, wmask, QUANT, GS, W_ALIGNED,
                    OFF_U, SK, SN)
        acc_g += tl.sum(xv[:, None] * bg, axis=0)
        acc_u += tl.sum(xv[:, None] * bu, axis=0)
    tl.store(dst, acc_g, mask=nmask)
    tl.store(dst + I, acc_u, mask=nmask)


@triton.jit
def decode2(part, ids, down_tbl, ds_tbl, dz_tbl, wref, sref, db, w, out,
            H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, W_ALIGNED: tl.constexpr,
            QUANT: tl.constexpr, GS: tl.constexpr,
            OFF: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr, BIAS: tl.constexpr,
            ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, S1: tl.constexpr,
            KCH: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[slot, chunk, n] = w[slot] * (h[slot, chunk] @ down[e][chunk] (+ db[e]
    in chunk 0))[n]: one chunk of KCH rows of I per program; `combine` adds
    the chunks.  h = glu(gate, up) is formed here from decode1's S1 partial
    sums (added in chunk order, the same float32 sums in every program), so
    no launch of its own writes it."""
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    c = tl.program_id(2)
    e = tl.load(ids + s)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    acc = tl.zeros((BN,), tl.float32)
    if (e >= 0) & (e < E):
        offs_k = tl.arange(0, BK)
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
            b = _wtile(down_tbl, ds_tbl, dz_tbl, e, wref, sref, kk, offs_n, H,
                       kmask[:, None] & nmask[None, :], QUANT, GS, W_ALIGNED, OFF, SK, SN)
            acc += tl.sum(hv[:, None] * b, axis=0)
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


# --------------------------------------------------------------------------- backward
#
# The backward of one band (plan.build_backward), given dy [Tb, H] (x's dtype):
#   g = x G_e, u = x U_e (recomputed: the forward saves nothing), a = glu(g, u),
#   da = dy D_e^T, d(topk_weight)_s = sum_i a * da,
#   dg = w_s da * dglu/dg, du = w_s da * dglu/du, wh = w_s a,
#   dx_t = sum over j in order of (dg G_e^T + du U_e^T)[slot t*k + j],
#   dG_e = x_e^T dg_e, dU_e = x_e^T du_e, dD_e = wh_e^T dy_e (over the expert's
#   rows in order, then band after band).
# Slots are ordered by expert with the forward's count/offsets/scatter; no
# atomics anywhere in the arithmetic, so every result is deterministic.

@triton.jit
def _glu_grad(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """(glu(g, u), d glu / dg, d glu / du), float32.  A clamp (swiglu_clamped)
    passes the gradient inside its range, bounds included, and none outside
    (torch.clamp's convention, as the CPU backward)."""
    if ACT == ACT_GEGLU:  # 0.5 (1 + tanh z) = sigmoid(2z)
        z = GELU_C * (g + GELU_B * g * g * g)
        s2 = tl.sigmoid(2.0 * z)
        f = g * s2
        df = s2 + g * (2.0 * s2 * (1.0 - s2)) * GELU_C * (1.0 + 3.0 * GELU_B * g * g)
        return f * u, df * u, f
    if ACT == ACT_GEGLU_ERF:
        cdf = 0.5 * (1.0 + tl.math.erf(g * INV_SQRT2))
        f = g * cdf
        df = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        return f * u, df * u, f
    if ACT == ACT_SWIGLU_CLAMPED:
        g_in = g <= LIMIT
        u_in = (u >= -LIMIT) & (u <= LIMIT)
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        s = tl.sigmoid(ALPHA * gc)
        f = gc * s
        df = s * (1.0 + ALPHA * gc * (1.0 - s))
        return f * (uc + 1.0), tl.where(g_in, df * (uc + 1.0), 0.0), tl.where(u_in, f, 0.0)
    s = tl.sigmoid(g)
    f = g * s
    df = s * (1.0 + g * (1.0 - s))
    return f * u, df * u, f


@triton.jit
def _round(v, dt: tl.constexpr):
    """float32 v in dt, rounded to nearest, ties to even (XLA's convert).
    bfloat16 in integer arithmetic on the bits (NaN stays a quiet NaN): the
    same on the GPU and in Triton's interpreter, whose float32 -> bfloat16
    cast truncates."""
    if dt == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if dt == tl.float32:
        return v
    return v.to(dt)


@triton.jit
def expert_ranges(block_expert, erange, NMB: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                  JB: tl.constexpr):
    """One program: erange[e] = (first BM-row block of expert e, its number of
    blocks) from block_expert (each expert's blocks are contiguous)."""
    cols = tl.arange(0, EP)
    first = tl.full((EP,), NMB, tl.int32)  # past every block
    cnt = tl.zeros((EP,), tl.int32)
    for j0 in range(0, NMB, JB):
        j = j0 + tl.arange(0, JB)
        be = tl.load(block_expert + j, mask=j < NMB, other=-1)
        inside = be[:, None] == cols[None, :]
        cnt += tl.sum(inside.to(tl.int32), axis=0)
        first = tl.minimum(first, tl.min(tl.where(inside, j[:, None], NMB), axis=0))
    cmask = cols < E
    tl.store(erange + 2 * cols, tl.where(cnt > 0, first, 0), mask=cmask)
    tl.store(erange + 2 * cols + 1, cnt, mask=cmask)


@triton.jit
def bwd_gemm1(x, dy, w, sorted_slots, block_expert, gate_tbl, up_tbl, down_tbl, wref,
              gb, ub, db, dg, du, wh, part,
              H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, NPS: tl.constexpr,
              ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
              W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
              OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
              OFF_D: tl.constexpr, SK_D: tl.constexpr, SN_D: tl.constexpr, BIAS: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """For the BM rows of one block (one expert) and BN columns of I:
    g = x G, u = x U, da = dy D^T (D read transposed through its view),
    part[pid_n, slot] = sum over the tile of glu(g, u) * da (the I tiles are
    added in order by `bwd_dtw`), and dg, du, wh [rows, I] (padding rows and
    columns past I: zeros), stored in dg's dtype (the weights' for 16-bit
    weights: the next products round them to it anyway).  BIAS: float32
    gb, ub [E, I] start g and u; tile 0's partial adds dy . db[e] (the down
    bias's share of d(topk_weight))."""
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _block(block_expert, sorted_slots, BM)
    if e < 0:
        return
    tok = tl.where(valid, slot, 0) // K_TOP
    gp = _expert_ptr(gate_tbl, e, wref, W_ALIGNED)
    upp = _expert_ptr(up_tbl, e, wref, W_ALIGNED)
    dp = _expert_ptr(down_tbl, e, wref, W_ALIGNED)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < I
    offs_k = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    acc_d = tl.zeros((BM, BN), tl.float32)
    dyb = tl.zeros((BM,), tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + offs_k
        kmask = kk < H
        amask = valid[:, None] & kmask[None, :]
        aoff = tok[:, None].to(tl.int64) * H + kk[None, :]
        a = tl.load(x + aoff, mask=amask, other=0.0).to(wref.dtype.element_ty)
        bf = tl.load(dy + aoff, mask=amask, other=0.0)
        if BIAS:
            bd_row = tl.load(db + e.to(tl.int64) * H + kk, mask=kmask, other=0.0)
            dyb += tl.sum(bf.to(tl.float32) * bd_row[None, :], axis=1)
        b = bf.to(wref.dtype.element_ty)
        wmask = kmask[:, None] & nmask[None, :]
        woff = _view(kk, offs_n, 0, SK, SN)
        bg = tl.load(gp + OFF_G + woff, mask=wmask, other=0.0)
        bu = tl.load(upp + OFF_U + woff, mask=wmask, other=0.0)
        # D^T: element (h, i) of the transpose is D's (i, h)
        bd = tl.load(dp + _view(kk, offs_n, OFF_D, SN_D, SK_D), mask=wmask, other=0.0)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
            acc_d = tl.dot(b, bd, acc_d, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
            acc_d = tl.dot(b, bd, acc_d)
    if BIAS:
        eb = e.to(tl.int64) * I + offs_n
        acc_g += tl.load(gb + eb, mask=nmask, other=0.0)[None, :]
        acc_u += tl.load(ub + eb, mask=nmask, other=0.0)[None, :]
    act, dact_g, dact_u = _glu_grad(acc_g, acc_u, ACT, ALPHA, LIMIT)
    keep = valid[:, None] & nmask[None, :]
    rw = tl.load(w + slot, mask=valid, other=0.0)
    p = tl.sum(tl.where(keep, act * acc_d, 0.0), axis=1)
    if BIAS:
        p += tl.where(pid_n == 0, dyb, 0.0)
    sl = tl.where(valid, slot, 0)
    tl.store(part + pid_n * NPS + sl, p, mask=valid)
    da = rw[:, None] * acc_d
    off = rows[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(dg + off, tl.where(keep, da * dact_g, 0.0).to(dg.dtype.element_ty), mask=nmask[None, :])
    tl.store(du + off, tl.where(keep, da * dact_u, 0.0).to(dg.dtype.element_ty), mask=nmask[None, :])
    tl.store(wh + off, tl.where(keep, rw[:, None] * act, 0.0).to(dg.dtype.element_ty),
             mask=nmask[None, :])


@triton.jit
def bwd_dtw(part, ids, dtw, n, E: tl.constexpr, NT: tl.constexpr, NPS: tl.constexpr,
            BLOCK: tl.constexpr):
    """d(topk_weights)[slot] = sum of part[0..NT-1, slot] in order; 0 for a
    slot whose id is outside [0, E) (its partials were never written)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    e = tl.load(ids + offs, mask=live, other=-1)
    ok = live & (e >= 0) & (e < E)
    acc = tl.zeros((BLOCK,), tl.float32)
    for t in range(0, NT):
        acc += tl.load(part + t * NPS + offs, mask=ok, other=0.0)
    tl.store(dtw + offs, acc, mask=live)


@triton.jit
def bwd_dx(dg, du, sorted_slots, block_expert, gate_tbl, up_tbl, wref, dxs,
           H: tl.constexpr, I: tl.constexpr, W_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
           OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """dxs[slot, n] = (dg G_e^T + du U_e^T)[row, n] for the block's real slots
    (G and U read transposed through their views), float32."""
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _block(block_expert, sorted_slots, BM)
    if e < 0:
        return
    gp = _expert_ptr(gate_tbl, e, wref, W_ALIGNED)
    upp = _expert_ptr(up_tbl, e, wref, W_ALIGNED)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < H
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + offs_k
        kmask = kk < I
        aoff = rows[:, None].to(tl.int64) * I + kk[None, :]
        ag = tl.load(dg + aoff, mask=kmask[None, :], other=0.0).to(wref.dtype.element_ty)
        au = tl.load(du + aoff, mask=kmask[None, :], other=0.0).to(wref.dtype.element_ty)
        wmask = kmask[:, None] & nmask[None, :]
        woff = _view(kk, offs_n, 0, SN, SK)  # G^T: element (i, h) is G's (h, i)
        bg = tl.load(gp + OFF_G + woff, mask=wmask, other=0.0)
        bu = tl.load(upp + OFF_U + woff, mask=wmask, other=0.0)
        if IEEE:
            acc = tl.dot(ag, bg, acc, input_precision="ieee")
            acc = tl.dot(au, bu, acc, input_precision="ieee")
        else:
            acc = tl.dot(ag, bg, acc)
            acc = tl.dot(au, bu, acc)
    sl = tl.where(valid, slot, 0).to(tl.int64)
    tl.store(dxs + sl[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])


@triton.jit
def combine_slots(dxs, ids, dx, H: tl.constexpr, E: tl.constexpr, K_TOP: tl.constexpr,
                  BH: tl.constexpr):
    """dx[t] = sum over j = 0..k-1 in order of dxs[t*k + j], leaving out the
    slots whose id is outside [0, E) (skipped: their rows are never written).
    The prefill forward's combine and the backward's."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < H
    acc = tl.zeros((BH,), tl.float32)
    for j in range(0, K_TOP):
        e = tl.load(ids + t * K_TOP + j) + tl.zeros((BH,), tl.int32)  # (a full vector: the
        ok = (e >= 0) & (e < E)                                        # interpreter's masks)
        acc += tl.load(dxs + (t * K_TOP + j).to(tl.int64) * H + offs, mask=m & ok, other=0.0)
    tl.store(dx + t.to(tl.int64) * H + offs, acc.to(dx.dtype.element_ty), mask=m)


@triton.jit
def bwd_dw(x, dy, w, dg, du, wh, sorted_slots, erange, dgate_tbl, dup_tbl, ddown_tbl, wref, gref,
           dgb, dub, ddb,
           H: tl.constexpr, I: tl.constexpr, K_TOP: tl.constexpr, IEEE: tl.constexpr,
           ACCUM: tl.constexpr,
           OFF_G: tl.constexpr, OFF_U: tl.constexpr, SK: tl.constexpr, SN: tl.constexpr,
           OFF_D: tl.constexpr, SK_D: tl.constexpr, SN_D: tl.constexpr, BIAS: tl.constexpr,
           BM: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr):
    """Expert e = program 0, a BH x BI tile: dG_e = x_e^T dg_e, dU_e = x_e^T du_e,
    dD_e = wh_e^T dy_e over the expert's row blocks in order (float32,
    written through the gradients' tables in the weights' views; gref: a
    pointer giving their type: float32, or the weights' 16-bit dtype when
    the call has one band, the float32 sums rounded once here).  ACCUM: added to what earlier bands
    stored (band after band); an expert without rows gets zeros.  BIAS: the
    float32 bias gradients [E, I], [E, I], [E, H]: dgb = sum of dg's rows,
    dub = of du's (stored by the programs of H tile 0), ddb = of w*dy's
    (stored by those of I tile 0), in the same order."""
    e = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_i = tl.program_id(2) * BI + tl.arange(0, BI)
    hmask = offs_h < H
    imask = offs_i < I
    b0 = tl.load(erange + 2 * e)
    nb = tl.load(erange + 2 * e + 1)
    acc_g = tl.zeros((BH, BI), tl.float32)
    acc_u = tl.zeros((BH, BI), tl.float32)
    acc_d = tl.zeros((BI, BH), tl.float32)
    s_g = tl.zeros((BI,), tl.float32)
    s_u = tl.zeros((BI,), tl.float32)
    s_d = tl.zeros((BH,), tl.float32)
    for b in range(b0, b0 + nb):
        rows = b * BM + tl.arange(0, BM)
        slot = tl.load(sorted_slots + rows)
        valid = slot >= 0
        tok = tl.where(valid, slot, 0) // K_TOP
        hoff = tok[:, None].to(tl.int64) * H + offs_h[None, :]
        hm = valid[:, None] & hmask[None, :]
        xa = tl.load(x + hoff, mask=hm, other=0.0).to(wref.dtype.element_ty)
        dyf = tl.load(dy + hoff, mask=hm, other=0.0)
        dya = dyf.to(wref.dtype.element_ty)
        ioff = rows[:, None].to(tl.int64) * I + offs_i[None, :]
        ggf = tl.load(dg + ioff, mask=imask[None, :], other=0.0)
        uuf = tl.load(du + ioff, mask=imask[None, :], other=0.0)
        if BIAS:
            rw = tl.load(w + tl.where(valid, slot, 0), mask=valid, other=0.0)
            s_g += tl.sum(ggf.to(tl.float32), axis=0)
            s_u += tl.sum(uuf.to(tl.float32), axis=0)
            s_d += tl.sum(rw[:, None] * dyf.to(tl.float32), axis=0)
        gg = ggf.to(wref.dtype.element_ty)
        uu = uuf.to(wref.dtype.element_ty)
        ww = tl.load(wh + ioff, mask=imask[None, :], other=0.0).to(wref.dtype.element_ty)
        xt = tl.trans(xa)
        if IEEE:
            acc_g = tl.dot(xt, gg, acc_g, input_precision="ieee")
            acc_u = tl.dot(xt, uu, acc_u, input_precision="ieee")
            acc_d = tl.dot(tl.trans(ww), dya, acc_d, input_precision="ieee")
        else:
            acc_g = tl.dot(xt, gg, acc_g)
            acc_u = tl.dot(xt, uu, acc_u)
            acc_d = tl.dot(tl.trans(ww), dya, acc_d)
    m1 = hmask[:, None] & imask[None, :]
    gp = _expert_ptr(dgate_tbl, e, gref, False)
    upp = _expert_ptr(dup_tbl, e, gref, False)
    dp = _expert_ptr(ddown_tbl, e, gref, False)
    o1 = _view(offs_h, offs_i, 0, SK, SN)
    o2 = _view(offs_i, offs_h, OFF_D, SK_D, SN_D)
    m2 = imask[:, None] & hmask[None, :]
    if ACCUM:
        acc_g += tl.load(gp + OFF_G + o1, mask=m1, other=0.0).to(tl.float32)
        acc_u += tl.load(upp + OFF_U + o1, mask=m1, other=0.0).to(tl.float32)
        acc_d += tl.load(dp + o2, mask=m2, other=0.0).to(tl.float32)
    gt = gref.dtype.element_ty  # float32, or (one band) the weights' dtype: the cast fused here
    tl.store(gp + OFF_G + o1, _round(acc_g, gt), mask=m1)
    tl.store(upp + OFF_U + o1, _round(acc_u, gt), mask=m1)
    tl.store(dp + o2, _round(acc_d, gt), mask=m2)
    if BIAS:
        bi = e.to(tl.int64) * I + offs_i
        bh = e.to(tl.int64) * H + offs_h
        first_h = (tl.program_id(1) + tl.zeros((BI,), tl.int32)) == 0  # (full vectors: the
        first_i = (tl.program_id(2) + tl.zeros((BH,), tl.int32)) == 0  # interpreter's masks)
        if ACCUM:
            s_g += tl.load(dgb + bi, mask=imask & first_h, other=0.0)
            s_u += tl.load(dub + bi, mask=imask & first_h, other=0.0)
            s_d += tl.load(ddb + bh, mask=hmask & first_i, other=0.0)
        tl.store(dgb + bi, s_g, mask=imask & first_h)
        tl.store(dub + bi, s_u, mask=imask & first_h)
        tl.store(ddb + bh, s_d, mask=hmask & first_i)
