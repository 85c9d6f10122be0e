// Testers of the bfloat16 dot-product kernels (kernel_table.h
// DotKernelTable, kernels_dot.h), in the style of kernel_tests.cc: the
// packed GEMMs and streaming kernels of every table against a float64
// reference and their bit-for-bit claims, and the documented VDPBF16PS
// semantics (emulated and fma tables) lane by lane.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "native/dot_pack.h"
#include "native/kernel_test_support.h"
#include "native/kernel_tests.h"
#include "native/sweep_runner.h"

namespace nb = nanobind;

namespace nbx {
namespace {

using namespace kernel_testing;  // NOLINT: the testers' own support header

// VDPBF16PS on one lane as the Intel SDM documents it, written apart from
// kernels_dot.h: acc += hi(a)*hi(b), then += lo(a)*lo(b), each a float32
// fused multiply-add (round to nearest even), inputs' denormals read as zero,
// results flushed to zero when tiny after rounding (IEEE 754: rounded to 24
// bits with an unbounded exponent, below 2^-126; x86's FTZ, measured on Zen
// 3): in magnitude below 2^-126 - 2^-151, the tie that rounds up to 2^-126,
// judged on the sum in double.  The emulated and fma tables must give
// exactly these bits.
float RefDotLane(float acc, uint32_t a, uint32_t b) {
  const auto in = [](uint32_t h) {
    return (h & 0x7f80u) != 0 ? BitsToFloat(h << 16) : BitsToFloat((h & 0x8000u) << 16);
  };
  const auto step = [](float x, float y, float c) {
    const double d = std::fma(static_cast<double>(x), static_cast<double>(y), static_cast<double>(c));
    if (d != 0.0 && std::fabs(d) < 0x1p-126 - 0x1p-151) return std::copysign(0.0f, static_cast<float>(d));
    return std::fma(x, y, c);
  };
  acc = step(in(a >> 16), in(b >> 16), acc);
  return step(in(a & 0xffffu), in(b & 0xffffu), acc);
}

// Even split points for the K-blocks (a block holds whole pairs of rows).
std::vector<int64_t> SplitKEven(int64_t K, Rng& rng) {
  std::vector<int64_t> at = SplitK(K, rng);
  for (size_t i = 1; i + 1 < at.size(); ++i) at[i] &= ~int64_t{1};
  return at;
}

// gemm1 / gemm2 of a dot-kernel table: x and the weights bfloat16 (x given
// as a float32 packed panel of bfloat16 values, packed into pairs by
// dot_pack.h's reference packers, whose words the tables' own pack_a /
// pack_b give: SweepPackA, SweepPackB), every output against float64 (the
// products are exact; the float32 sums are rounded once per product, as the
// float32 kernels' are: the same tolerance), unwritten and stray elements,
// and K-blocks through the partial sums giving the bits of one pass.
struct DotGemmTester {
  std::string Describe() const {
    return Fmt("rows=%d cols=%d K=%lld", rows, cols, (long long)K) +
           (down ? "" : Fmt(" act=%s", ActName(act))) + " out " +
           OutputGrid(rows, cols, column_major).Name();
  }

  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const int mr = t.mr, vl = t.vl;
    std::vector<float> a = RandomRows(K, rows, mr, 0.0f, rng);  // packed A, float32
    for (float& v : a) v = ToFloat(FromFloat<bf16>(v));          // of bfloat16 values
    const DenseWeights first(K, cols, cols + 1, true, false, rng);
    std::optional<DenseWeights> second;
    if (!down) second.emplace(K, cols, cols + 1, true, false, rng);
    const std::vector<float> w = RandomRows(1, rows, mr, kNaN, rng);
    const std::vector<double> ad = RowsF64(a, mr, rows, K);
    const Expected want = down ? ExpectDown(w, ad, rows, first.Ref())
                               : ExpectGlu(act, ad, rows, first.Ref(), second->Ref());
    const Grid grid = OutputGrid(rows, cols, column_major), cgrid = FlatGrid(mr * 2 * vl);
    const bf16* mats[2] = {static_cast<const bf16*>(first.Data()),
                           second ? static_cast<const bf16*>(second->Data()) : nullptr};
    // one K-block [k0, k0+kc) packed and run
    const auto call = [&](int64_t k0, int64_t kc, std::vector<float>& out, float* c, int flags) {
      const int64_t P = (kc + 1) / 2;
      std::vector<uint32_t> pa(static_cast<size_t>(std::max<int64_t>(P, 1) * mr * t.a_words));
      std::vector<uint32_t> pb(static_cast<size_t>(PanelStride(std::max<int64_t>(P, 1), vl)));
      PackDotPanel(t.a_words, a.data(), k0, static_cast<int>(kc), mr, pa.data());
      if (down) PackRowsPairs<1>(mats, cols + 1, k0, static_cast<int>(kc), 0, cols, vl, pb.data());
      else PackRowsPairs<2>(mats, cols + 1, k0, static_cast<int>(kc), 0, cols, vl, pb.data());
      float* o = out.data() + grid.base;
      if (down) t.gemm2(pa.data(), pb.data(), P, w.data(), rows, cols, o, grid.rs, c, flags);
      else t.gemm1(pa.data(), pb.data(), P, TestGlu(act), rows, cols, o, grid.rs, grid.cs, c, flags);
    };
    std::vector<float> whole = grid.Fresh(), c = cgrid.Fresh();
    call(0, K, whole, c.data() + cgrid.base, 0);
    ScanGrid("whole K: out", whole, grid, true, want, issues);
    ExpectUntouched("whole K: c", c, issues);

    CheckKBlocks(SplitKEven(K, rng), whole, grid, cgrid, call, issues);
    report.Add(Describe(), issues);
  }

  const DotKernelTable& t;
  bool down;
  int rows, cols;
  int64_t K;
  int act;
  bool column_major;
};

void SweepDotGemm(const DotKernelTable& t, bool down, Rng& rng, Report& report) {
  std::vector<int> cols = {1, t.vl - 1, t.vl};
  if (down) cols.insert(cols.end(), {t.vl + 1, 2 * t.vl - 1, 2 * t.vl});
  for (int64_t K : kKs)
    for (int act : Acts(down))
      for (int rows : {1, 5, t.mr - 1, t.mr})
        for (int nc : cols)
          DotGemmTester{t, down, rows, nc, K, act, !down && rng.Bit()}.Test(rng, report);
}

// stream1 / stream2 of a dot table with streaming kernels (the fma ones):
// rows of float32 a (the kernel rounds them to bfloat16), bfloat16 weights
// by rows (the padding NaN); the output against float64 on the rounded a,
// the scratch kept to its 2 * rows * ncols, and bit for bit against the
// table's own gemm1 / gemm2 on the same operands packed (dot_pack.h): an
// expert's rows get the same bits whether they stream or pack.
struct DotStreamTester {
  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const int mr = t.mr, vl = t.vl, P = static_cast<int>((s.K + 1) / 2);
    const int64_t ld = s.ncols + 3;
    const std::vector<float> a = RandomRows(s.K, s.rows, s.as, kNaN, rng);
    std::vector<float> panel = PackA(a, s.as, s.rows, s.K, mr);  // float32, rows past the end 0
    std::vector<float> rounded = panel;
    for (float& v : rounded) v = ToFloat(FromFloat<bf16>(v));
    const DenseWeights first(s.K, s.ncols, ld, true, false, rng);
    std::optional<DenseWeights> second;
    if (!s.down) second.emplace(s.K, s.ncols, ld, true, false, rng);
    const std::vector<float> w = RandomRows(1, s.rows, s.rows, kNaN, rng);
    const std::vector<double> ad = RowsF64(rounded, mr, s.rows, s.K);
    const Expected want = s.down ? ExpectDown(w, ad, s.rows, first.Ref())
                                 : ExpectGlu(s.act, ad, s.rows, first.Ref(), second->Ref());
    const Grid grid = OutputGrid(s.rows, s.ncols, s.column_major);
    const Grid acc_grid = FlatGrid(2 * s.rows * s.ncols);
    std::vector<float> out = grid.Fresh(), acc = acc_grid.Fresh();
    if (s.down)
      t.stream2(a.data(), s.as, s.rows, first.Data(), ld, s.K, s.ncols, w.data(),
                acc.data() + acc_grid.base, out.data() + grid.base, grid.rs);
    else
      t.stream1(a.data(), s.as, s.rows, first.Data(), second->Data(), ld, s.K, s.ncols,
                TestGlu(s.act), acc.data() + acc_grid.base, out.data() + grid.base, grid.rs, grid.cs);
    ScanGrid("out", out, grid, true, want, issues);
    ScanGrid("acc", acc, acc_grid, false, NoCheck{}, issues);

    // the packed dot kernels on the same operands, one K-block of all K
    std::vector<uint32_t> pa(static_cast<size_t>(std::max(P, 1) * mr * t.a_words));
    PackDotPanel(t.a_words, panel.data(), 0, static_cast<int>(s.K), mr, pa.data());
    const int width = s.down ? 2 * vl : vl, nsub = (s.ncols + width - 1) / width;
    std::vector<uint32_t> pb(static_cast<size_t>(nsub * PanelStride(std::max(P, 1), vl)));
    const bf16* mats[2] = {static_cast<const bf16*>(first.Data()),
                           second ? static_cast<const bf16*>(second->Data()) : nullptr};
    if (s.down) PackRowsPairs<1>(mats, ld, 0, static_cast<int>(s.K), 0, s.ncols, vl, pb.data());
    else PackRowsPairs<2>(mats, ld, 0, static_cast<int>(s.K), 0, s.ncols, vl, pb.data());
    std::vector<float> packed = grid.Fresh(), c(static_cast<size_t>(mr * 2 * vl));
    for (int q = 0; q < nsub; ++q) {
      const int cols = std::min(width, s.ncols - q * width);
      const uint32_t* b = pb.data() + q * PanelStride(P, vl);
      float* o = packed.data() + grid.At(0, q * width);
      if (s.down) t.gemm2(pa.data(), b, P, w.data(), s.rows, cols, o, grid.rs, c.data(), 0);
      else t.gemm1(pa.data(), b, P, TestGlu(s.act), s.rows, cols, o, grid.rs, grid.cs, c.data(), 0);
    }
    CompareBits("streamed vs packed (dot gemm1/gemm2)", out, packed, grid, issues);
    report.Add(s.Describe(), issues);
  }

  const DotKernelTable& t;
  StreamShape s;
};

void SweepDotStream(const DotKernelTable& t, bool down, Rng& rng, Report& report) {
  const std::vector<int64_t> Ks(std::begin(kKs), std::end(kKs));
  ForEachStreamShape(t, down, Ks, rng, [&](const StreamShape& s) { DotStreamTester{t, s}.Test(rng, report); });
}

// The caller's MXCSR control bits (x86; 0 elsewhere; not the sticky
// exception flags, bits 0-5): the fma kernels set DAZ|FTZ for their sums only
// and must leave them as they found them.
unsigned Mxcsr() {
#if defined(__SSE__)
  return _mm_getcsr() & ~0x3fu;
#else
  return 0;
#endif
}

// Pairs words[p*mr + r] (bfloat16 bits, as PackPanelPairs lays them out) as
// table t's packed A: the float32 panel of their values through its packer
// (a bfloat16 value, denormal or signed zero included, packs to itself).
std::vector<uint32_t> PackedA(const DotKernelTable& t, const std::vector<uint32_t>& words, int64_t P) {
  const int mr = t.mr;
  std::vector<float> panel(static_cast<size_t>(2 * P * mr));
  for (int64_t p = 0; p < P; ++p)
    for (int r = 0; r < mr; ++r) {
      panel[(2 * p) * mr + r] = BitsToFloat((words[p * mr + r] & 0xffffu) << 16);
      panel[(2 * p + 1) * mr + r] = BitsToFloat(words[p * mr + r] >> 16 << 16);
    }
  std::vector<uint32_t> packed(static_cast<size_t>(P * mr * t.a_words));
  PackDotPanel(t.a_words, panel.data(), 0, static_cast<int>(2 * P), mr, packed.data());
  return packed;
}

// The arithmetic itself, bit for bit: operands straight as bfloat16 words
// from a palette of normal values, values whose products fall below float32's
// normal range (flushed), denormal bfloat16 (read as zero), zeros of both
// signs and large values; the sums gemm2 stores (kStorePartial) against
// RefDotLane chained over the pairs.  Then sums that land next to float32's
// smallest normal, from partial sums loaded (kLoadPartial): 2^-126 + 2^-149
// plus -1.25 * 2^-149 is 2^-126 - 2^-151, tiny before rounding and 2^-126
// after (RefDotLane keeps it, as x86's fused multiply-add under FTZ does);
// plus -1.5 * 2^-149 it is 2^-126 - 2^-150, tiny both ways (flushed).  Run
// on the tables whose bits are the documented ones (emulated, fma): the
// instruction's own are its hardware's (its tables are held to the float64
// tests above).
void SweepDotSemantics(const DotKernelTable& t, Rng& rng, Report& report) {
  const int mr = t.mr, w = 2 * t.vl;
  {
    Issues issues;
    // a: hi 2^-70 (bf16 0x1c80), lo 0; b: hi -1.25 or -1.5 * 2^-79, lo 0
    const uint32_t a_word = Bf16Pair(0, 0x1c80), b_words[2] = {Bf16Pair(0, 0x9820), Bf16Pair(0, 0x9840)};
    const std::vector<uint32_t> a = PackedA(t, std::vector<uint32_t>(static_cast<size_t>(mr), a_word), 1);
    std::vector<uint32_t> b(static_cast<size_t>(w));
    for (int j = 0; j < w; ++j) b[j] = b_words[j % 2];
    const Grid cgrid = FlatGrid(mr * w);
    std::vector<float> c = cgrid.Fresh(), want = cgrid.Fresh();
    for (int i = 0; i < mr * w; ++i) {
      c[cgrid.base + i] = BitsToFloat(0x00800001u);
      want[cgrid.base + i] = RefDotLane(BitsToFloat(0x00800001u), a_word, b[i % w]);
    }
    if (FloatToBits(want[cgrid.base]) != 0x00800000u || FloatToBits(want[cgrid.base + 1]) != 0u)
      issues.push_back(Fmt("RefDotLane near 2^-126: %08x and %08x, expected 00800000 and 00000000",
                     FloatToBits(want[cgrid.base]), FloatToBits(want[cgrid.base + 1])));
    t.gemm2(a.data(), b.data(), 1, nullptr, mr, w, nullptr, w, c.data() + cgrid.base,
            kLoadPartial | kStorePartial);
    CompareBits("sums next to 2^-126 vs the documented semantics", c, want, cgrid, issues);
    report.Add("sums next to the smallest normal", issues);
  }
  const auto word = [&rng]() {
    uint32_t h[2];
    for (uint32_t& v : h) {
      const uint32_t sign = rng.Bit() ? 0x8000u : 0u;
      switch (rng.Int(0, 5)) {
        case 0: v = sign | static_cast<uint32_t>(rng.Int(1, 0x7f)); break;                // denormal
        case 1: v = sign | static_cast<uint32_t>(rng.Int(0x1c00, 0x1cff)); break;         // ~2^-70
        case 2: v = sign; break;                                                          // +-0
        case 3: v = sign | static_cast<uint32_t>(rng.Int(0x5f00, 0x5fff)); break;         // ~2^63
        default: v = FromFloat<bf16>(rng.Uniform()).bits; break;                          // normal
      }
    }
    return Bf16Pair(static_cast<uint16_t>(h[0]), static_cast<uint16_t>(h[1]));
  };
  for (int64_t P : {1, 2, 3, 17, 64}) {
    Issues issues;
    std::vector<uint32_t> a(static_cast<size_t>(P * mr)), b(static_cast<size_t>(P * w));
    for (uint32_t& v : a) v = word();
    for (uint32_t& v : b) v = word();
    const std::vector<uint32_t> packed_a = PackedA(t, a, P);
    const Grid cgrid = FlatGrid(mr * w);
    std::vector<float> c = cgrid.Fresh(), ref(static_cast<size_t>(mr * w), 0.0f);
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < w; ++j)
        for (int64_t p = 0; p < P; ++p)
          ref[r * w + j] = RefDotLane(ref[r * w + j], a[p * mr + r], b[p * w + j]);
    std::vector<float> want = cgrid.Fresh();
    std::copy(ref.begin(), ref.end(), want.begin() + cgrid.base);
    const unsigned csr = Mxcsr();
    t.gemm2(packed_a.data(), b.data(), P, nullptr, mr, w, nullptr, w, c.data() + cgrid.base, kStorePartial);
    CompareBits("stored sums vs the documented semantics", c, want, cgrid, issues);
    // the epilogue under the caller's MXCSR: row weights 2^-140 (denormal),
    // products kept denormal, not flushed
    const std::vector<float> tiny(static_cast<size_t>(mr), 0x1p-140f);
    const Grid ogrid = MakeGrid(mr, w, w, 1);
    std::vector<float> out = ogrid.Fresh(), out_want = ogrid.Fresh();
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < w; ++j) out_want[ogrid.At(r, j)] = tiny[r] * ref[r * w + j];
    t.gemm2(packed_a.data(), b.data(), P, tiny.data(), mr, w, out.data() + ogrid.base, w, nullptr, 0);
    CompareBits("w * sums (the epilogue, denormal products kept)", out, out_want, ogrid, issues);
    if (t.stream2 != nullptr) {  // the streaming kernel on the same operands (row weights 1)
      const int rows = std::min(mr, kMaxStreamRows), K = static_cast<int>(2 * P);
      std::vector<float> as(static_cast<size_t>(K * rows));
      std::vector<uint16_t> ws(static_cast<size_t>(K * w));
      for (int64_t p = 0; p < P; ++p) {
        for (int r = 0; r < rows; ++r) {
          as[(2 * p) * rows + r] = BitsToFloat((a[p * mr + r] & 0xffffu) << 16);
          as[(2 * p + 1) * rows + r] = BitsToFloat(a[p * mr + r] >> 16 << 16);
        }
        for (int j = 0; j < w; ++j) {
          ws[(2 * p) * w + j] = static_cast<uint16_t>(b[p * w + j] & 0xffffu);
          ws[(2 * p + 1) * w + j] = static_cast<uint16_t>(b[p * w + j] >> 16);
        }
      }
      const std::vector<float> ones(static_cast<size_t>(rows), 1.0f);
      const Grid sgrid = MakeGrid(rows, w, w, 1);
      std::vector<float> sout = sgrid.Fresh(), swant = sgrid.Fresh(), acc(static_cast<size_t>(2 * rows * w));
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < w; ++j) swant[sgrid.At(r, j)] = ref[r * w + j];
      t.stream2(as.data(), rows, rows, ws.data(), w, K, w, ones.data(), acc.data(), sout.data() + sgrid.base, w);
      CompareBits("streamed sums vs the documented semantics", sout, swant, sgrid, issues);
    }
    if (Mxcsr() != csr) issues.push_back(Fmt("MXCSR %08x after the kernels, %08x before", Mxcsr(), csr));
    report.Add(Fmt("pairs=%lld", (long long)P), issues);
  }
}

// The table's A packer (DotKernelTable::pack_a, compiled for its instruction
// set) against dot_pack.h's PackDotPanel, word for word: panels of values
// drawn from normal floats, exact ties of the rounding, denormals, +-0,
// +-inf, quiet and signaling NaNs of both signs and values that round up
// to inf; every K-block length up to a few passes of the packer (odd ones:
// the missing odd row) and offsets k0 into the panel; the words past the
// block are poisoned and must stay so.
void SweepPackA(const DotKernelTable& t, Rng& rng, Report& report) {
  const int mr = t.mr;
  const auto value = [&rng]() {
    const uint32_t sign = rng.Bit() ? 0x80000000u : 0u;
    switch (rng.Int(0, 8)) {
      case 0: return BitsToFloat(sign | static_cast<uint32_t>(rng.Int(1, 0x7fffff)));       // denormal
      case 1: return BitsToFloat(sign | static_cast<uint32_t>(rng.Int(1, 0xffff)) << 16 | 0x8000u);  // tie
      case 2: return BitsToFloat(sign);                                                      // +-0
      case 3: return BitsToFloat(sign | 0x7f800000u);                                        // +-inf
      case 4: return BitsToFloat(sign | 0x7f800000u | static_cast<uint32_t>(rng.Int(1, 0x7fffff)));  // NaN
      case 5: return BitsToFloat(sign | 0x7f7f8000u | static_cast<uint32_t>(rng.Int(0, 0x7fff)));  // -> inf
      default: return rng.Uniform() * 8.0f - 4.0f;                                         // normal
    }
  };
  for (const int kc : {1, 2, 3, 31, 32, 33, 64, 65, 127, 128}) {
    for (const int k0 : {0, 1, 6}) {
      Issues issues;
      std::vector<float> panel(static_cast<size_t>((k0 + kc) * mr));
      for (float& v : panel) v = value();
      const size_t words = static_cast<size_t>((kc + 1) / 2 * mr * t.a_words);
      std::vector<uint32_t> want(words + 16, 0xdeadbeefu), got(words + 16, 0xdeadbeefu);
      PackDotPanel(t.a_words, panel.data(), k0, kc, mr, want.data());
      t.pack_a(panel.data(), k0, kc, got.data());
      for (size_t i = 0; i < want.size() && issues.size() < 4; ++i)
        if (got[i] != want[i])
          issues.push_back(Fmt("word %zu of %zu: %08x, PackDotPanel %08x", i, words, got[i], want[i]));
      if (t.a_words == 1 || kc % 2 == 0) {  // in place, as the forward packs: the same words
        std::vector<float> inplace(panel);
        uint32_t* at = reinterpret_cast<uint32_t*>(inplace.data() + k0 * mr);
        t.pack_a(inplace.data(), k0, kc, at);
        for (size_t i = 0; i < words && issues.size() < 4; ++i)
          if (at[i] != want[i])
            issues.push_back(Fmt("in place, word %zu of %zu: %08x, PackDotPanel %08x", i, words, at[i], want[i]));
      }
      report.Add(Fmt("kc=%d k0=%d", kc, k0), issues);
    }
  }
}

// The table's B packer (DotKernelTable::pack_b) against dot_pack.h's
// PackRowsPairs, word for word: gate||up (ns = 2) and down (ns = 1); K-block
// lengths odd and even (the missing odd row), offsets k0 and n0 into the
// matrices, widths nc that end inside a micro-panel and whole ones, random
// bits (any bfloat16, NaNs included: packing moves bits); the words past
// the block and the skew between its panels are poisoned and must stay so.
void SweepPackB(const DotKernelTable& t, Rng& rng, Report& report) {
  const int C1 = 2 * t.vl;
  for (const int ns : {1, 2})
    for (const int kc : {1, 2, 7, 128})
      for (const int nc : {1, C1 / ns - 1, C1 / ns, 3 * C1 + 5}) {
        Issues issues;
        const int64_t k0 = rng.Int(0, 3), n0 = rng.Int(0, 5), ld = n0 + nc + rng.Int(0, 3);
        std::vector<bf16> m[2];
        const bf16* mats[2] = {nullptr, nullptr};
        const void* mv[2] = {nullptr, nullptr};
        for (int s = 0; s < ns; ++s) {
          m[s].resize(static_cast<size_t>((k0 + kc + 1) * ld));
          for (bf16& v : m[s]) v.bits = static_cast<uint16_t>(rng.Int(0, 0xffff));
          mats[s] = m[s].data();
          mv[s] = m[s].data();
        }
        const int nsub = (nc + C1 / ns - 1) / (C1 / ns);
        const size_t words = static_cast<size_t>(nsub * PanelStride((kc + 1) / 2, t.vl));
        std::vector<uint32_t> want(words + 16, 0xdeadbeefu), got(words + 16, 0xdeadbeefu);
        if (ns == 1) PackRowsPairs<1>(mats, ld, k0, kc, n0, nc, t.vl, want.data());
        else PackRowsPairs<2>(mats, ld, k0, kc, n0, nc, t.vl, want.data());
        t.pack_b[ns - 1](mv, ld, k0, kc, n0, nc, got.data());
        for (size_t i = 0; i < want.size() && issues.size() < 4; ++i)
          if (got[i] != want[i])
            issues.push_back(Fmt("word %zu of %zu: %08x, PackRowsPairs %08x", i, words, got[i], want[i]));
        report.Add(Fmt("ns=%d kc=%d nc=%d", ns, kc, nc), issues);
      }
}

// ---------------------------------------------------------------- registry

struct DotKernelEntry {
  const char* name;
  void (*sweep)(const DotKernelTable&, Rng&, Report&);
  bool documented_bits;  // checks the documented bits: the emulated and fma tables only
};

bool HasDocumentedBits(const DotKernelTable& t) {
  return std::string(t.name) == "emulated" || std::string(t.name) == "fma";
}

const DotKernelEntry kDotKernels[] = {
    {"gemm1", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotGemm(t, false, g, r); }, false},
    {"gemm2", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotGemm(t, true, g, r); }, false},
    {"semantics", SweepDotSemantics, true},
    {"pack_a", SweepPackA, false},
    {"pack_b", SweepPackB, false},
    {"stream1", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotStream(t, false, g, r); }, false},
    {"stream2", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotStream(t, true, g, r); }, false},
};

std::string DotTableName(const DotKernelTable& t) {
  return std::string(t.name) + "/" + std::to_string(t.vl) + "x" + std::to_string(t.mr);
}

}  // namespace

void BindDotKernelTests(nb::module_& m) {
  m.def("dot_kernel_names", [] { return EntryNames(kDotKernels); },
        "The bfloat16 dot-product kernels run_dot_kernel_tests covers.");
  m.def("dot_kernel_tables", [] {
    std::vector<std::string> names;
    for (int i = 0; i < NumDotKernelTables(); ++i) names.push_back(DotTableName(*DotKernelTableAt(i)));
    return names;
  }, "Every bfloat16 dot-kernel table this CPU runs, as 'name/VLxMR' (e.g. 'emulated/16x12').");
  m.def("dot_streaming_tables", [] {
    std::vector<std::string> names;
    for (int i = 0; i < NumDotKernelTables(); ++i)
      if (DotKernelTableAt(i)->stream1 != nullptr) names.push_back(DotTableName(*DotKernelTableAt(i)));
    return names;
  }, "The dot-kernel tables with streaming (decode) kernels.");
  m.def("run_dot_kernel_tests", [](const std::string& table, const std::string& kernel, uint32_t seed) {
    const DotKernelTable* t = nullptr;
    for (int i = 0; i < NumDotKernelTables(); ++i)
      if (table == DotTableName(*DotKernelTableAt(i))) t = DotKernelTableAt(i);
    if (t == nullptr)
      throw nb::value_error(("dot kernels '" + table + "' are unknown or this CPU cannot run them (supported: " +
                             SupportedDotKernels() + "; see dot_kernel_tables())").c_str());
    const DotKernelEntry* entry = FindEntry(kDotKernels, kernel, "dot kernel", "dot_kernel_names()");
    if (std::string(entry->name).rfind("stream", 0) == 0 && t->stream1 == nullptr)
      throw nb::value_error(("'" + kernel + "': " + table + " has no streaming kernels (see "
                             "dot_streaming_tables())").c_str());
    if (entry->documented_bits && !HasDocumentedBits(*t))
      throw nb::value_error(("'" + kernel + "' checks the documented bits (emulated and fma tables); " + table +
                             " is the hardware's").c_str());
    return RunSweep(*entry, *t, table + " " + kernel, seed);
  }, nb::arg("table"), nb::arg("kernel"), nb::arg("seed"),
     "Sweeps one bfloat16 dot-product kernel of one table (dot_kernel_tables()) with random "
     "inputs from `seed`; returns one line per failing case (empty: all passed).");
}

}  // namespace nbx
