// bfloat16 dot-product micro-kernels: the packed GEMM1 / GEMM2 of
// kernels_dense.h on operands held as bfloat16 pairs, each step adding two
// products into float32 as the x86 instruction VDPBF16PS does.  One template
// of the kernel logic, instantiated per "dot" policy by kernels_dot_<name>.cc:
//   avx512_bf16  the instruction itself (_mm512_dpbf16_ps), compiled with
//                -mavx512bf16, chosen at run time where the CPU has it;
//   fma          the same arithmetic on float32 fused multiply-adds under
//                MXCSR DAZ|FTZ (AVX2+FMA on ymm, AVX-512F on zmm): the
//                emulation's bits at vector speed, on x86-64 CPUs without
//                the instruction;
//   emulated     a scalar emulation of the instruction's documented semantics
//                (portable: runs and is tested everywhere).
// Included ONLY by those files (kernels_base.h's rules: internal linkage, no
// inline function of the C++ library).
//
// Semantics (Intel SDM, VDPBF16PS), per float32 lane j of the accumulator:
//   acc += float(a.bf16[2j+1]) * float(b.bf16[2j+1])
//   acc += float(a.bf16[2j])   * float(b.bf16[2j])
// each a float32 fused multiply-add rounded to nearest even, the inputs'
// denormals read as zero (DAZ) and each result flushed to zero when tiny
// (FTZ; tininess after rounding, as x86's fused multiply-add under MXCSR.FTZ
// detects it: FmaFtz).  The instruction neither
// reads nor writes MXCSR; the fma policy sets DAZ|FTZ around each panel's
// sums (Mode) and restores the caller's.  So a K-sum runs over pairs of rows (2p+1,
// then 2p), and results are the same bits whichever implementation ran them,
// whatever the rows' place in their panel, and across K-blocks (partial sums
// in c, as kernels_dense.h).
//
// Layouts (uint32 words, each two bfloat16: the low half row 2p, the high
// half row 2p+1; a missing row 2p+1 of an odd K is 0), built by each table's pack_a / pack_b
// (PackAPanel, PackBPairs below; the reference packers: tests/native/dot_pack.h):
//   packed A  one m-panel of MR rows: a[p*MR + r] (a policy's kAWords = 1),
//             or two words a[(p*MR + r)*2 + {0, 1}], the float32 bits of
//             the odd row's bfloat16 value, then the even row's (kAWords =
//             2: the fma policies, which then broadcast each from memory)
//   packed B  one micro-panel of 2VL columns: b[p*2VL + c]
//             GEMM1: c < VL gate columns, c >= VL the same columns of up
//             GEMM2: 2VL columns of down
#pragma once

#include <type_traits>

#include "cpu/kernels/kernels_base.h"
#include "cpu/kernels/kernels_dense.h"
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace nbx {
namespace {

// A policy's Mode brackets the sums of one panel (PanelSums): nothing for
// the instruction and the emulation, DAZ|FTZ for the fma policies.
struct NoMode {};
#if defined(__SSE__)
struct FlushDenormals {  // MXCSR DAZ (bit 6) and FTZ (bit 15); the caller's restored
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};
#endif

// One lane of the instruction, exactly as documented (the emulation).
NBX_AI float DazBf16(uint32_t bits16) {
  uint32_t u = (bits16 & 0x7f80u) == 0 ? (bits16 & 0x8000u) << 16 : bits16 << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
// One step: a*b + acc rounded to nearest even, then flushed to a signed zero
// when tiny after rounding as IEEE 754 defines it (rounded to 24 bits with
// an unbounded exponent: 2^-126 - 2^-151 is not tiny, 2^-126 - 2^-150 is,
// although both round to 2^-126 in float32), as x86's fused multiply-add
// does under MXCSR.FTZ.  Only a result at most 2^-126 can be tiny; then the
// operands are small (|acc| and |a*b| below 2^-99: a sum of larger ones is a
// multiple of 2^-123), so the same sum 2^64 times larger is exact to scale
// and tells.
NBX_AI float FmaFtz(float a, float b, float acc) {
  const float r = fmaf(a, b, acc);
  if (!(fabsf(r) <= 0x1p-126f)) return r;
  const float s = fmaf(a * 0x1p64f, b, acc * 0x1p64f);
  return s != 0.0f && fabsf(s) < 0x1p-62f ? copysignf(0.0f, s) : r;
}
NBX_AI float DotPairLane(float acc, uint32_t a, uint32_t b) {
  acc = FmaFtz(DazBf16(a >> 16), DazBf16(b >> 16), acc);
  return FmaFtz(DazBf16(a & 0xffffu), DazBf16(b & 0xffffu), acc);
}

// The policies: Acc (VL float32 sums), B (VL words of packed B, as the
// policy holds them), Mode (above), kAWords (packed A's layout), Stream (the
// policy whose streaming kernels the table gets, DotStream1Of; void: none), and
// Zero/LoadAcc/StoreAcc/LoadB/Dot (Dot given a row's packed A words).  The emulation's are plain arrays
// (no vector types: the same 16 lanes as the instruction on any target).
template <int VL>
struct DotEmulated {
  static constexpr int kVl = VL;
  static constexpr int kAWords = 1;
  typedef void Stream;  // (too slow to stream)
  struct Acc {
    float v[VL];
  };
  struct B {
    uint32_t v[VL];
  };
  typedef NoMode Mode;
  static NBX_AI Acc Zero() { return Acc{}; }
  static NBX_AI Acc LoadAcc(const float* p) {
    Acc r;
    memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static NBX_AI void StoreAcc(float* p, const Acc& a) { memcpy(p, a.v, sizeof a.v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    B r;
    memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    for (int j = 0; j < VL; ++j) acc.v[j] = DotPairLane(acc.v[j], *a, b.v[j]);
    return acc;
  }
};

#if defined(__SSE__)
// The fma policies: the arithmetic above on VL-lane float32 vectors (vector
// extensions; each a*b + acc one fused multiply-add, MulAdd: explicit,
// so that the bits hold at any optimisation level) under MXCSR DAZ|FTZ.  B's pairs split into their two
// float32 (the high half masked, the low half shifted up); A comes split by
// its packer (pack_a; PackPanelSplit in tests/native/dot_pack.h; kAWords = 2), a float32 per row of the pair,
// broadcast.
template <int VL>
struct DotFma {
  using V = typename VecT<VL>::type;
  using U = typename U32T<VL>::type;
  static constexpr int kVl = VL;
  static constexpr int kAWords = 2;
  typedef DotFma Stream;
  typedef V Acc;
  struct B {
    V odd, even;
  };
  typedef FlushDenormals Mode;
  static NBX_AI Acc Zero() { return V{}; }
  static NBX_AI Acc LoadAcc(const float* p) { return Load<VL>(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { memcpy(p, &v, sizeof v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    U w;
    memcpy(&w, p, sizeof w);
    const U odd = w & 0xffff0000u, even = w << 16;
    B b;
    memcpy(&b.odd, &odd, sizeof odd);
    memcpy(&b.even, &even, sizeof even);
    return b;
  }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    float odd, even;
    memcpy(&odd, a, sizeof odd);
    memcpy(&even, a + 1, sizeof even);
    acc = MulAdd(odd, b.odd, acc);
    return MulAdd(even, b.even, acc);
  }
};
#endif

// lo[r] = c0 + the pair sums of a's row r with b's VL lo columns, hi[r] with
// the VL hi columns, over P pairs of rows (c0: 0, or c's stored sums).
template <class D, int MR>
NBX_AI void AccumulatePairs(const uint32_t* a, const uint32_t* b, int64_t P, const float* c,
                            typename D::Acc (&lo)[MR], typename D::Acc (&hi)[MR]) {
  constexpr int VL = D::kVl;
  if (c != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] = D::LoadAcc(c + r * 2 * VL);
      hi[r] = D::LoadAcc(c + r * 2 * VL + VL);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = D::Zero();
  }
  for (int64_t p = 0; p < P; ++p) {
    const typename D::B b0 = D::LoadB(b + p * 2 * VL);
    const typename D::B b1 = D::LoadB(b + p * 2 * VL + VL);
    const uint32_t* ap = a + p * MR * D::kAWords;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] = D::Dot(lo[r], ap + r * D::kAWords, b0);
      hi[r] = D::Dot(hi[r], ap + r * D::kAWords, b1);
    }
  }
}

// The MR x 2VL sums of one m-panel over P pairs (from c0's sums, or 0),
// stored to dst, row r at + r*2VL (lo then hi: the stored partial sums'
// layout).  Out of line, so that PanelSums' Mode brackets all of its
// arithmetic: no float32 operation moves across a call.
template <class D, int MR>
__attribute__((noinline)) void StorePairSums(const uint32_t* a, const uint32_t* b, int64_t P,
                                             const float* c0, float* dst) {
  constexpr int VL = D::kVl;
  typename D::Acc lo[MR], hi[MR];
  AccumulatePairs<D, MR>(a, b, P, c0, lo, hi);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    D::StoreAcc(dst + r * 2 * VL, lo[r]);
    D::StoreAcc(dst + r * 2 * VL + VL, hi[r]);
  }
}

// The sums of one m-panel over one K-block of P pairs, under the policy's
// Mode: stored to c when more K-blocks follow (flags & kStorePartial;
// returns false: no epilogue), else to s (returns true).  c also holds the
// earlier blocks' sums (flags & kLoadPartial).
template <class D, int MR>
NBX_AI bool PanelSums(const uint32_t* a, const uint32_t* b, int64_t P, float* c, int flags,
                      float* s) {
  [[maybe_unused]] const typename D::Mode mode{};
  StorePairSums<D, MR>(a, b, P, (flags & kLoadPartial) ? c : nullptr,
                       (flags & kStorePartial) ? c : s);
  return !(flags & kStorePartial);
}

// GEMM1 on one packed m-panel, one K-block of P pairs (flags: PartialFlags,
// as Gemm1Packed): out[r*rs + c*cs] = act(g) * u for r < rows, c < cols <= VL.
template <class D, int MR>
void Gemm1Dot(const uint32_t* a, const uint32_t* b, int64_t P, const Glu& act, int rows,
              int cols, float* out, int64_t rs, int64_t cs, float* c, int flags) {
  constexpr int VL = D::kVl;
  float s[MR * 2 * VL];
  if (!PanelSums<D, MR>(a, b, P, c, flags, s)) return;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j)
      out[r * rs + j * cs] = GluOf(act, s[r * 2 * VL + j], s[r * 2 * VL + VL + j]);
}

// GEMM2 on one packed m-panel, one K-block of P pairs: out[r*rs + c] =
// w[r] * sum for r < rows, c < cols <= 2VL.
template <class D, int MR>
void Gemm2Dot(const uint32_t* a, const uint32_t* b, int64_t P, const float* w, int rows,
              int cols, float* out, int64_t rs, float* c, int flags) {
  constexpr int VL = D::kVl;
  float s[MR * 2 * VL];
  if (!PanelSums<D, MR>(a, b, P, c, flags, s)) return;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) out[r * rs + j] = w[r] * s[r * 2 * VL + j];
}

// Streaming (decode), on the fma policies (whose vector FMAs under Mode are
// the documented arithmetic; a table's policy names its Stream policy): kernels_dense.h's bfloat16
// streaming sums in the pair order (AccumulateRowsBf16R<..., true>), out of
// line under Mode as PanelSums, then the streaming epilogues.
template <class D>
__attribute__((noinline)) void StreamPairSums(const float* a, int64_t as, int rows,
                                              const void* w, int64_t ld, int64_t K, int ncols,
                                              float* acc) {
  WithRows(rows, [&](auto r) {
    AccumulateRowsBf16R<D::kVl, decltype(r)::value, true>(
        a, as, static_cast<const uint16_t*>(w), ld, K, ncols, acc);
  });
}

template <class D>
void DotStream1(const float* a, int64_t as, int rows, const void* wg, const void* wu, int64_t ld,
                int64_t K, int ncols, const Glu& act, float* acc, float* out, int64_t rs,
                int64_t cs) {
  float* accu = acc + rows * ncols;
  {
    [[maybe_unused]] const typename D::Mode mode{};
    StreamPairSums<D>(a, as, rows, wg, ld, K, ncols, acc);
    StreamPairSums<D>(a, as, rows, wu, ld, K, ncols, accu);
  }
  StreamGluEpilogue(acc, accu, rows, ncols, act, out, rs, cs);
}

template <class D>
void DotStream2(const float* a, int64_t as, int rows, const void* wd, int64_t ld, int64_t K,
                int ncols, const float* w, float* acc, float* out, int64_t rs) {
  {
    [[maybe_unused]] const typename D::Mode mode{};
    StreamPairSums<D>(a, as, rows, wd, ld, K, ncols, acc);
  }
  StreamWeightEpilogue(acc, rows, ncols, w, out, rs);
}

// The table's streaming entries: those of D::Stream, or null (void).
template <class D>
constexpr decltype(DotKernelTable::stream1) DotStream1Of() {
  if constexpr (std::is_void_v<typename D::Stream>) return nullptr;
  else return DotStream1<typename D::Stream>;
}
template <class D>
constexpr decltype(DotKernelTable::stream2) DotStream2Of() {
  if constexpr (std::is_void_v<typename D::Stream>) return nullptr;
  else return DotStream2<typename D::Stream>;
}

// DotKernelTable::pack_a: rows [k0, k0+kc) of one float32 m-panel (MR rows)
// as the table's packed A -- tests/native/dot_pack.h's PackDotPanel, the same words --
// compiled for the table's instruction set: each run of up to 32 rows is
// rounded in one vectorized pass (kernels_base.h's RoundToBf16), then its
// pairs are interleaved.  In place too (dst = a + k0*MR, as the forward
// calls it; AW = 2 only for an even kc): a run's words land on the rows
// just read, or before them.
template <int MR, int AW>
void PackAPanel(const float* a, int64_t k0, int kc, uint32_t* dst) {
  constexpr int kRows = 32;  // rows per pass: 16 pairs
  uint16_t h[kRows * MR];
  for (int k = 0; k < kc; k += kRows) {
    const int n = (kc - k < kRows ? kc - k : kRows) * MR;
    const float* src = a + (k0 + k) * MR;
    for (int i = 0; i < n; ++i) {
      const float v = RoundToBf16(src[i]);
      uint32_t u;
      memcpy(&u, &v, sizeof u);
      h[i] = static_cast<uint16_t>(u >> 16);
    }
    const int pairs = (n / MR + 1) / 2;
    for (int i = n; i < 2 * pairs * MR; ++i) h[i] = 0;  // the missing odd row of an odd K
    uint32_t* d = dst + static_cast<int64_t>(k / 2) * MR * AW;
    for (int p = 0; p < pairs; ++p)
      for (int r = 0; r < MR; ++r) {
        const uint32_t even = h[2 * p * MR + r], odd = h[(2 * p + 1) * MR + r];
        if constexpr (AW == 1) {
          d[p * MR + r] = even | odd << 16;
        } else {
          d[(p * MR + r) * 2] = odd << 16;
          d[(p * MR + r) * 2 + 1] = even << 16;
        }
      }
  }
}

// DotKernelTable::pack_b: tests/native/dot_pack.h's PackRowsPairs<NS> (VL the table's
// lanes), the same words, compiled for the table's instruction set: a whole
// micro-panel's run of a matrix (2VL/NS columns of rows 2p and 2p+1) is
// interleaved in one vectorized loop; a short run at nc and a missing odd
// row take the general path.
template <int VL, int NS>
void PackBPairs(const void* const* mv, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
                uint32_t* dst) {
  constexpr int w = 2 * VL, C = w / NS;
  const int nsub = (nc + C - 1) / C, pairs = (kc + 1) / 2;
  for (int p = 0; p < pairs; ++p) {
    const bool has_odd = 2 * p + 1 < kc;
    for (int s = 0; s < NS; ++s) {
      const uint16_t* even = static_cast<const uint16_t*>(mv[s]) + (k0 + 2 * p) * ld + n0;
      const uint16_t* odd = even + ld;
      for (int q = 0; q < nsub; ++q) {
        uint32_t* d = dst + q * PanelStride(pairs, VL) + p * w + s * C;
        const uint16_t* e = even + q * C;
        const uint16_t* o = odd + q * C;
        const int n = nc - q * C < C ? nc - q * C : C;
        if (n == C && has_odd) {
          for (int j = 0; j < C; ++j) d[j] = uint32_t{e[j]} | uint32_t{o[j]} << 16;
        } else {
          for (int j = 0; j < n; ++j) d[j] = uint32_t{e[j]} | (has_odd ? uint32_t{o[j]} << 16 : 0u);
          for (int j = n; j < C; ++j) d[j] = 0;
        }
      }
    }
  }
}

}  // namespace
}  // namespace nbx

// Defines the dot-kernel table FN() of policy D (VL lanes), MR rows per
// m-panel, KC rows (even) per K-block (several tables per file: the kernels
// are named after FN).
#define NBX_DEFINE_DOT_KERNELS(FN, NAME, D, MR, KC)                                           \
  namespace nbx {                                                                           \
  namespace {                                                                               \
  static_assert((KC) % 2 == 0, "K-blocks hold whole pairs of rows");                        \
  void FN##PackA(const float* a, int64_t k0, int kc, uint32_t* dst) {                       \
    PackAPanel<MR, D::kAWords>(a, k0, kc, dst);                                             \
  }                                                                                         \
  void FN##G1(const uint32_t* a, const uint32_t* b, int64_t P, const Glu& act, int rows,    \
              int cols, float* out, int64_t rs, int64_t cs, float* c, int flags) {          \
    Gemm1Dot<D, MR>(a, b, P, act, rows, cols, out, rs, cs, c, flags);                       \
  }                                                                                         \
  void FN##G2(const uint32_t* a, const uint32_t* b, int64_t P, const float* w, int rows,    \
              int cols, float* out, int64_t rs, float* c, int flags) {                      \
    Gemm2Dot<D, MR>(a, b, P, w, rows, cols, out, rs, c, flags);                             \
  }                                                                                         \
  }                                                                                         \
  const DotKernelTable* FN() {                                                              \
    static const DotKernelTable t = {NAME,   D::kVl, MR, KC, D::kAWords, FN##G1,             \
                                     FN##G2, DotStream1Of<D>(), DotStream2Of<D>(),         \
                                     FN##PackA,                                            \
                                     {PackBPairs<D::kVl, 1>, PackBPairs<D::kVl, 2>}};      \
    return &t;                                                                              \
  }                                                                                         \
  }
