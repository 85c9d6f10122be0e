"""Triton kernels of the CUDA backward (`plan.build_backward`): the gradients
of one band of slots, with the forward's slot ordering (`kernels.count`,
`offsets`, `scatter`) and its helpers (`kernels._glu`, `_expert_ptr`,
`_view`, `_block`); see `kernels` for the layouts and the conventions."""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import ACT_GEGLU, ACT_GEGLU_ERF, ACT_SWIGLU_CLAMPED, GELU_B, GELU_C, INV_SQRT2, _block, _expert_ptr, _view  # noqa: F401  (globals the kernels read)

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
