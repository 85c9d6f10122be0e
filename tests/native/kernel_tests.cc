// Testers for the CPU micro-kernels of every instruction set, in the style of
// XNNPACK's GemmMicrokernelTester: one tester per kernel family holds one case
// (its parameters, Describe() and Test()), and a sweep walks the family's
// whole parameter space, one fresh set of random inputs per case.
//
// Each case checks
//   * every output element against a scalar float64 reference computed from
//     the unpacked data (tolerance relative to sum_k |a * w|),
//   * that every element the kernel must write was written and nothing else
//     (buffers start filled with a NaN sentinel, with guards around them),
//   * the bit-for-bit claims of kernels.h and kernel_table.h: packed GEMMs
//     over K-blocks (partial sums in c) equal one pass over the whole K, and a
//     streamed result equals the packed kernels' result for the same rows and
//     weights (dense float32/bfloat16 and quantized alike).
// Inputs the kernels must not use (padding rows of a, padding columns of W,
// scales of columns or groups outside the case) are NaN, so using one shows.
#include "native/kernel_tests.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "native/kernel_test_support.h"
#include "native/quant_weights.h"
#include "native/sweep_runner.h"

namespace nb = nanobind;

namespace nbx {
namespace {

using namespace kernel_testing;  // NOLINT: the testers' own support header

// ---------------------------------------------------------------- gemm1, gemm2

struct PackedGemmTester {
  std::string Describe() const {
    return Fmt("rows=%d cols=%d K=%lld", rows, cols, (long long)K) +
           (down ? "" : Fmt(" act=%s", ActName(act))) + (scaled ? " scale=yes" : " scale=no") +
           " out " + OutputGrid(rows, cols, column_major).Name();
  }

  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const int mr = t.mr;
    const std::vector<float> a = RandomRows(K, rows, mr, 0.0f, rng);  // packed A
    const DenseWeights first(K, cols, cols + 1, false, scaled, rng);
    std::optional<DenseWeights> second;
    if (!down) second.emplace(K, cols, cols + 1, false, scaled, rng);
    const std::vector<float> w = RandomRows(1, rows, mr, kNaN, rng);
    const std::vector<double> ad = RowsF64(a, mr, rows, K);
    const Expected want = down ? ExpectDown(w, ad, rows, first.Ref())
                               : ExpectGlu(act, ad, rows, first.Ref(), second->Ref());
    const PackedB<DenseWeights> pb(t, first, second ? &*second : nullptr, K, 0, cols);
    const Grid grid = OutputGrid(rows, cols, column_major), cgrid = FlatGrid(mr * 2 * t.vl);

    // (a) one call over the whole K: c neither read nor written
    std::vector<float> whole = grid.Fresh(), c = cgrid.Fresh();
    Call(a, pb, w, whole, grid)(0, K, c.data() + cgrid.base, 0);
    ScanGrid("whole K: out", whole, grid, true, want, issues);
    ExpectUntouched("whole K: c", c, issues);

    // (b) three K-blocks through the partial sums in c: the same bits
    CheckKBlocks(SplitK(K, rng), whole, grid, cgrid,
                 [&](int64_t k0, int64_t kc, std::vector<float>& out, float* cp, int flags) {
                   Call(a, pb, w, out, grid)(k0, kc, cp, flags);
                 },
                 issues);
    report.Add(Describe(), issues);
  }

  PackedCall Call(const std::vector<float>& a, const PackedB<DenseWeights>& pb,
                  const std::vector<float>& w, std::vector<float>& out, const Grid& grid) const {
    return PackedCall{t, down, act, a.data(), pb.b.data(), pb.Scale(), w.data(),
                      rows, cols, out.data() + grid.base, grid.rs, grid.cs};
  }

  const KernelTable& t;
  bool down;  // gemm2
  int rows, cols;
  int64_t K;
  int act;
  bool scaled;
  bool column_major;
};

// rows 1..MR, cols 1..VL (gemm1) or 1..2VL (gemm2), every K, activation,
// with and without scales.
void SweepPackedGemm(const KernelTable& t, bool down, Rng& rng, Report& report) {
  const int max_cols = down ? 2 * t.vl : t.vl;
  for (int64_t K : kKs)
    for (int act : Acts(down))
      for (bool scaled : {false, true})
        for (int rows = 1; rows <= t.mr; ++rows)
          for (int cols = 1; cols <= max_cols; ++cols) {
            const bool column_major = !down && rng.Bit();
            PackedGemmTester{t, down, rows, cols, K, act, scaled, column_major}.Test(rng, report);
          }
}

// ---------------------------------------------------------------- streaming

// Runs a streamed kernel, call(a, w, acc, out, rs, cs), and checks its output
// against the reference and, bit for bit, against the packed kernels
// (PackedResult), and that it wrote nothing past its 2 * rows * ncols scratch.
template <class W, class Call>
void TestStreamed(const KernelTable& t, const StreamShape& s, const W& first, const W* second,
                  const Call& call, Rng& rng, Issues& issues) {
  const std::vector<float> a = RandomRows(s.K, s.rows, s.as, kNaN, rng);
  const std::vector<float> w = RandomRows(1, s.rows, s.rows, kNaN, rng);
  const std::vector<double> ad = RowsF64(a, s.as, s.rows, s.K);
  const Expected want = s.down ? ExpectDown(w, ad, s.rows, first.Ref())
                               : ExpectGlu(s.act, ad, s.rows, first.Ref(), second->Ref());
  const Grid grid = OutputGrid(s.rows, s.ncols, s.column_major);
  const Grid acc_grid = FlatGrid(2 * s.rows * s.ncols);
  std::vector<float> out = grid.Fresh(), acc = acc_grid.Fresh();
  call(a.data(), w.data(), acc.data() + acc_grid.base, out.data() + grid.base, grid.rs, grid.cs);
  ScanGrid("out", out, grid, true, want, issues);
  ScanGrid("acc", acc, acc_grid, false, NoCheck{}, issues);
  CompareBits("streamed vs packed (gemm1/gemm2)", out,
              PackedResult(t, a, s.as, s.K, s.act, w, first, second, grid), grid, issues);
}

// stream1 / stream2: dense weights read in place, float32 or bfloat16; with
// `cols`, stream1_cols / stream2_cols on weights stored by columns.
struct DenseStreamTester {
  std::string Describe() const {
    return s.Describe() + Fmt(" ld=%lld", (long long)ld()) + (cols ? " by columns" : "");
  }
  int64_t ld() const { return (cols ? s.K : s.ncols) + 3; }  // the padding NaN

  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const int64_t ld = this->ld();
    const DenseWeights first(s.K, s.ncols, ld, bf16w, false, rng, cols);
    std::optional<DenseWeights> second;
    if (!s.down) second.emplace(s.K, s.ncols, ld, bf16w, false, rng, cols);
    const int wi = bf16w ? 1 : 0;
    auto* s1 = cols ? t.stream1_cols[wi] : t.stream1[wi];
    auto* s2 = cols ? t.stream2_cols[wi] : t.stream2[wi];
    TestStreamed(t, s, first, second ? &*second : nullptr,
                 [&](const float* a, const float* w, float* acc, float* out, int64_t rs, int64_t cs) {
                   if (s.down)
                     s2(a, s.as, s.rows, first.Data(), ld, s.K, s.ncols, w, acc, out, rs);
                   else
                     s1(a, s.as, s.rows, first.Data(), second->Data(), ld, s.K, s.ncols,
                        TestGlu(s.act), acc, out, rs, cs);
                 },
                 rng, issues);
    report.Add(Describe(), issues);
  }

  const KernelTable& t;
  StreamShape s;
  bool bf16w;
  bool cols = false;
};

void SweepDenseStream(const KernelTable& t, bool down, bool bf16w, Rng& rng, Report& report,
                      bool cols = false) {
  const std::vector<int64_t> Ks(std::begin(kKs), std::end(kKs));
  ForEachStreamShape(t, down, Ks, rng, [&](const StreamShape& s) {
    DenseStreamTester{t, s, bf16w, cols}.Test(rng, report);
  });
}

// pack_cols: blocks of 1 or 2 column-stored matrices into packed-B panels,
// every element in place (exact: a copy, bfloat16 widened), zeros past nc,
// nothing written past the panels.
void SweepPackCols(const KernelTable& t, Rng& rng, Report& report) {
  const int w = 2 * t.vl;
  for (int wi = 0; wi < 2; ++wi)
    for (int ns : {1, 2})
      for (int kc : {1, 7, t.vl, 2 * t.vl + 3, 128})
        for (int nc : {1, t.vl - 1, t.vl, w + 5, 3 * w}) {
          Issues issues;
          const int64_t k0 = rng.Int(0, 3), n0 = rng.Int(0, 3), ld = k0 + kc + rng.Int(1, 4);
          const int64_t N = n0 + nc;
          std::vector<DenseWeights> mats;
          for (int sidx = 0; sidx < ns; ++sidx) mats.emplace_back(ld - 1, static_cast<int>(N), ld, wi == 1, false, rng, true);
          const void* mv[2] = {mats[0].Data(), ns == 2 ? mats[1].Data() : nullptr};
          const int C = w / ns, nsub = (nc + C - 1) / C;
          const Grid grid = PackedGrid(kc, nsub, t.vl);
          std::vector<float> out = grid.Fresh();
          t.pack_cols[wi](mv, ns, ld, k0, kc, n0, nc, out.data() + grid.base);
          ScanGrid("packed", out, grid, true,
                   [&](int i, int col, float got) -> std::string {
                     const int q = col / w, j = col % w;
                     const int sidx = j / C, c = q * C + j % C;
                     const float want = c < nc ? mats[sidx].At(k0 + i, n0 + c) : 0.0f;
                     if (got == want || (std::isnan(got) && std::isnan(want))) return "";
                     return Fmt("q=%d i=%d j=%d: got %g, want %g", q, i, j, got, want);
                   },
                   issues);
          report.Add(Fmt("pack_cols %s ns=%d kc=%d nc=%d k0=%lld n0=%lld ld=%lld", wi ? "bf16" : "f32", ns, kc,
                         nc, (long long)k0, (long long)n0, (long long)ld),
                     issues);
        }
}

// pack_pairs: an interleaved gate||up into GEMM1's packed-B panels, every
// element in place, zeros past nc, nothing written past the panels.
void SweepPackPairs(const KernelTable& t, Rng& rng, Report& report) {
  const int w = 2 * t.vl;
  for (int wi = 0; wi < 2; ++wi)
    for (int kc : {1, 7, 128})
      for (int nc : {1, t.vl - 1, t.vl, t.vl + 5, 3 * t.vl}) {
        Issues issues;
        const int64_t k0 = rng.Int(0, 3), n0 = rng.Int(0, 3), N = n0 + nc + rng.Int(0, 2);
        const int64_t ld = 2 * N + rng.Int(0, 3);
        const DenseWeights m(k0 + kc, static_cast<int>(2 * N), ld, wi == 1, false, rng);
        const int nsub = (nc + t.vl - 1) / t.vl;
        const Grid grid = PackedGrid(kc, nsub, t.vl);
        std::vector<float> out = grid.Fresh();
        t.pack_pairs[wi](m.Data(), ld, k0, kc, n0, nc, out.data() + grid.base);
        ScanGrid("packed", out, grid, true,
                 [&](int i, int col, float got) -> std::string {
                   const int q = col / w, j = col % w;
                   const int c = q * t.vl + j % t.vl, s = j / t.vl;
                   const float want = c < nc ? m.At(k0 + i, 2 * (n0 + c) + s) : 0.0f;
                   if (got == want) return "";
                   return Fmt("q=%d i=%d j=%d: got %g, want %g", q, i, j, got, want);
                 },
                 issues);
        report.Add(Fmt("pack_pairs %s kc=%d nc=%d k0=%lld n0=%lld ld=%lld", wi ? "bf16" : "f32", kc, nc,
                       (long long)k0, (long long)n0, (long long)ld),
                   issues);
      }
}

// stream_pair: two runs of one matrix's rows (its first and second ncols
// columns) summed in one pass: bit for bit the sums of stream2 with unit
// weights over each run, and within float32 rounding of float64.
void SweepStreamPair(const KernelTable& t, Rng& rng, Report& report) {
  const float ones[kMaxStreamRows] = {1, 1, 1, 1, 1, 1};
  for (int wi = 0; wi < 2; ++wi)
    for (int64_t K : {int64_t{1}, int64_t{7}, int64_t{130}})
      for (int ncols : {1, 5, 2 * t.vl, 2 * t.vl + 3, 200})
        for (int rows = 1; rows <= kMaxStreamRows; ++rows) {
          Issues issues;
          const int64_t as = rng.Int(rows, t.mr), ld = 2 * ncols + rng.Int(0, 3);
          const DenseWeights m(K, 2 * ncols, ld, wi == 1, false, rng);
          const std::vector<float> a = RandomRows(K, rows, as, kNaN, rng);
          const size_t es = wi ? 2 : 4;
          const void* w1 = static_cast<const char*>(m.Data()) + ncols * es;
          const Grid grid = MakeGrid(rows, 2 * ncols, 2 * ncols, 1);
          std::vector<float> out = grid.Fresh(), acc(static_cast<size_t>(2 * rows * ncols) + 16, kSentinel);
          t.stream_pair[wi](a.data(), as, rows, m.Data(), w1, ld, K, ncols, acc.data(), out.data() + grid.base);
          std::vector<float> want(static_cast<size_t>(rows * 2 * ncols)), tmp(static_cast<size_t>(2 * rows * ncols));
          for (int h = 0; h < 2; ++h)
            t.stream2[wi](a.data(), as, rows, h ? w1 : m.Data(), ld, K, ncols, ones, tmp.data(),
                          want.data() + h * ncols, 2 * ncols);
          ScanGrid("out", out, grid, true,
                   [&](int r, int c, float got) -> std::string {
                     double ref = 0.0, mag = 0.0;
                     for (int64_t kk = 0; kk < K; ++kk) {
                       const double p = double(a[kk * as + r]) * m.At(kk, c);
                       ref += p, mag += std::fabs(p);
                     }
                     const float bits = want[r * 2 * ncols + c];
                     if (std::memcmp(&got, &bits, 4) != 0) return Fmt("got %g, stream2 %g", got, bits);
                     if (std::fabs(got - ref) > 1e-5 * mag + 1e-30) return Fmt("got %g, want %g", got, ref);
                     return "";
                   },
                   issues);
          for (size_t i = 2 * rows * ncols; i < acc.size(); ++i)
            if (std::memcmp(&acc[i], &kSentinel, 4) != 0) issues.push_back("wrote past acc");
          report.Add(Fmt("stream_pair %s K=%lld ncols=%d rows=%d", wi ? "bf16" : "f32", (long long)K, ncols, rows),
                     issues);
        }
}

// glu: the gated unit on stored sums with biases (any subset), against float64.
void SweepGlu(const KernelTable& t, Rng& rng, Report& report) {
  for (int act = 0; act < abi::kNumActivations; ++act)
    for (int rows : {1, 3, 7})
      for (int ncols : {1, 5, 33})
        for (int64_t gcs : {1, 2})
          for (int bias = 0; bias < 4; ++bias) {
            Issues issues;
            const int64_t gs = ncols * gcs * 2 + 1;
            std::vector<float> g(static_cast<size_t>(rows * gs)), bg(ncols), bu(ncols);
            for (float& v : g) v = 8.0f * (rng.Uniform() - 0.5f);  // reach limit 7's clamps
            for (int c = 0; c < ncols; ++c) bg[c] = rng.Uniform() - 0.5f, bu[c] = rng.Uniform() - 0.5f;
            const float* gp = g.data();
            const float* up = g.data() + (gcs == 2 ? 1 : ncols);
            const float* bgp = bias & 1 ? bg.data() : nullptr;
            const float* bup = bias & 2 ? bu.data() : nullptr;
            const Grid grid = OutputGrid(rows, ncols, rng.Bit());
            std::vector<float> out = grid.Fresh();
            t.glu(gp, up, gs, gcs, rows, ncols, bgp, bup, TestGlu(act), out.data() + grid.base, grid.rs,
                  grid.cs);
            ScanGrid("out", out, grid, true,
                     [&](int r, int c, float got) -> std::string {
                       const float gv = gp[r * gs + c * gcs] + (bgp ? bgp[c] : 0.0f);
                       const float uv = up[r * gs + c * gcs] + (bup ? bup[c] : 0.0f);
                       const double want = RefGlu(act, gv, uv);
                       if (std::fabs(got - want) <= 1e-5 * (1.0 + std::fabs(want))) return "";
                       return Fmt("got %g, want %g", got, want);
                     },
                     issues);
            report.Add(Fmt("glu act=%s rows=%d ncols=%d gcs=%lld bias=%d", ActName(act), rows, ncols,
                           (long long)gcs, bias),
                       issues);
          }
}

// A streamed quantized case: columns [n0, n0+ncols) of N-column matrices in
// format f, the one (down) or two (gate, up) of them made fresh.
struct QuantStreamCase {
  std::string Describe() const {
    return f.Name() + " " + s.Describe() + Fmt(" n0=%lld N=%lld", (long long)n0, (long long)N);
  }
  const KernelTable& t;
  StreamShape s;
  QuantFormat f;
  int64_t n0, N;
};

struct QuantOperands {
  QuantOperands(const QuantStreamCase& c, Rng& rng) : first(c.f, c.s.K, c.N, c.n0, c.s.ncols, rng) {
    if (!c.s.down) second.emplace(c.f, c.s.K, c.N, c.n0, c.s.ncols, rng);
    m1 = first.Matrix();
    m2 = second ? second->Matrix() : m1;
  }
  QuantWeights first;
  std::optional<QuantWeights> second;
  QuantMatrix m1, m2;
};

// qstream1 / qstream2.
struct QuantStreamTester : QuantStreamCase {
  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const QuantOperands q(*this, rng);
    const QuantWeights& first = q.first;
    const std::optional<QuantWeights>& second = q.second;
    const QuantMatrix &m1 = q.m1, &m2 = q.m2;
    TestStreamed(t, s, first, second ? &*second : nullptr,
                 [&](const float* a, const float* w, float* acc, float* out, int64_t rs, int64_t cs) {
                   if (s.down) t.qstream2(a, s.as, s.rows, &m1, n0, s.K, s.ncols, w, acc, out, rs);
                   else t.qstream1(a, s.as, s.rows, &m1, &m2, n0, s.K, s.ncols, TestGlu(s.act), acc, out, rs, cs);
                 },
                 rng, issues);
    report.Add(Describe(), issues);
  }
};

// f(format, shape, n0, N) for every case of the formats `keep` takes, each
// format's Ks and every streamed shape, columns [n0, n0 + ncols) of N.
template <class Keep, class F>
void ForEachQuantStreamCase(const KernelTable& t, bool down, Rng& rng, const Keep& keep, const F& f) {
  for (const QuantFormat& fmt : QuantFormats()) {
    if (!keep(fmt)) continue;
    ForEachStreamShape(
        t, down, QuantKs(fmt), rng,
        [&](const StreamShape& s) {
          const int64_t n0 = rng.Int(0, 9), N = n0 + s.ncols + rng.Int(0, 5);
          f(fmt, s, n0, N);
        },
        /*cycle_acts=*/true);
  }
}

void SweepQuantStream(const KernelTable& t, bool down, Rng& rng, Report& report) {
  ForEachQuantStreamCase(
      t, down, rng, [](const QuantFormat&) { return true; },
      [&](const QuantFormat& f, const StreamShape& s, int64_t n0, int64_t N) {
        QuantStreamTester{{t, s, f, n0, N}}.Test(rng, report);
      });
}

// ---------------------------------------------------------------- qdot1, qdot2

// Rows of a (a[kk*as + r]) as float64 after the int8 arithmetic's
// quantization (abi.h "int8 arithmetic", written out again here from that
// text): per row and block of abi::kInt8Block, d = amax / 127, codes
// rint(v * (127 / amax)) in float32, values code * d.
std::vector<double> Int8Rows(const std::vector<float>& a, int64_t as, int rows, int64_t K) {
  std::vector<double> d(static_cast<size_t>(rows * K));
  for (int r = 0; r < rows; ++r)
    for (int64_t b0 = 0; b0 < K; b0 += abi::kInt8Block) {
      const int64_t b1 = std::min(K, b0 + abi::kInt8Block);
      float amax = 0.0f;
      for (int64_t kk = b0; kk < b1; ++kk) amax = std::max(amax, std::fabs(a[kk * as + r]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, step = amax / 127.0f;
      for (int64_t kk = b0; kk < b1; ++kk)
        d[r * K + kk] = static_cast<double>(std::nearbyint(a[kk * as + r] * inv)) * step;
    }
  return d;
}

// qdot1 / qdot2 (precision="int8"): int8 and int4 matrices, columns [n0,
// n0+ncols) of N.  Each output against the float64 reference on the
// quantized rows; every row alone gives the same bits as with the others.
struct QDotTester : QuantStreamCase {
  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const QuantOperands q(*this, rng);
    const QuantWeights& first = q.first;
    const std::optional<QuantWeights>& second = q.second;
    const QuantMatrix &m1 = q.m1, &m2 = q.m2;
    const std::vector<float> a = RandomRows(s.K, s.rows, s.as, kNaN, rng);
    const std::vector<float> w = RandomRows(1, s.rows, s.rows, kNaN, rng);
    const std::vector<double> ad = Int8Rows(a, s.as, s.rows, s.K);
    const Expected want = s.down ? ExpectDown(w, ad, s.rows, first.Ref())
                                 : ExpectGlu(s.act, ad, s.rows, first.Ref(), second->Ref());
    const Grid grid = OutputGrid(s.rows, s.ncols, s.column_major);
    const Grid acc_grid = FlatGrid(2 * s.rows * s.ncols);
    auto call = [&](const float* ap, int rows, const float* wp, std::vector<float>& out, int64_t at) {
      std::vector<float> acc = acc_grid.Fresh();
      float* o = out.data() + grid.base + at;
      if (s.down) t.qdot2(ap, s.as, rows, &m1, n0, s.K, s.ncols, wp, acc.data() + acc_grid.base, o, grid.rs);
      else t.qdot1(ap, s.as, rows, &m1, &m2, n0, s.K, s.ncols, TestGlu(s.act), acc.data() + acc_grid.base, o,
                   grid.rs, grid.cs);
      ScanGrid("acc", acc, acc_grid, false, NoCheck{}, issues);
    };
    std::vector<float> out = grid.Fresh(), alone = grid.Fresh();
    call(a.data(), s.rows, w.data(), out, 0);
    ScanGrid("out", out, grid, true, want, issues);
    for (int r = 0; r < s.rows; ++r) call(a.data() + r, 1, w.data() + r, alone, r * grid.rs);
    CompareBits("rows together vs each alone", alone, out, grid, issues);
    report.Add(Describe(), issues);
  }
};

void SweepQDot(const KernelTable& t, bool down, Rng& rng, Report& report) {
  const auto ints = [](const QuantFormat& f) {
    return f.code == abi::WeightFormat::kInt8 || f.code == abi::WeightFormat::kInt4;
  };
  const auto test = [&](const QuantFormat& f, const StreamShape& s, int64_t n0, int64_t N) {
    QDotTester{{t, s, f, n0, N}}.Test(rng, report);
  };
  ForEachQuantStreamCase(t, down, rng, ints, test);
  // K past one chunk of codes (kQDotChunk; int8's last block partial): a few shapes
  const int act = Acts(down)[0];
  for (const QuantFormat& f : QuantFormats())
    if (ints(f) && !f.bf16_scales)
      for (int rows : {1, kMaxStreamRows}) {
        const int64_t n0 = rng.Int(0, 9), N = n0 + 129 + rng.Int(0, 5);
        test(f, StreamShape{down, rows, rng.Int(rows, t.mr), 129, f.group ? 1152 : 1057, act, false}, n0, N);
      }
}

// ---------------------------------------------------------------- qpack

// Rows [k0, k0+kc) of columns [n0, n0+nc) into ceil(nc / width) panels, rows
// rs = width + 1 apart (the gap must stay untouched), panels ps apart.
struct QPackTester {
  std::string Describe() const {
    return f.Name() + Fmt(" width=%d k0=%lld kc=%d n0=%lld nc=%d N=%lld", width, (long long)k0, kc,
                          (long long)n0, nc, (long long)N);
  }

  void Test(Rng& rng, Report& report) const {
    Issues issues;
    // grouped formats: whole groups; int8: one row more than the range
    const int64_t K = f.group ? (k0 + kc + f.group - 1) / f.group * f.group : k0 + kc + 1;
    const QuantWeights qw(f, K, N, n0, nc, rng, k0, k0 + kc, /*nan_codes=*/true);
    const QuantMatrix m = qw.Matrix();
    const int panels = (nc + width - 1) / width;
    const int64_t rs = width + 1, ps = kc * rs + 2;
    const Grid grid = MakeGrid(kc, panels * width, rs, 1, width, ps);
    std::vector<float> dst = grid.Fresh();
    t.qpack(&m, k0, kc, n0, nc, width, dst.data() + grid.base, rs, ps);
    const RefMatrix want = qw.Packed(k0, kc);
    ScanGrid("dst", dst, grid, true, [&](int i, int c, float got) -> std::string {
      if (c >= nc) return got == 0.0f ? "" : Fmt("padding got %.9g, want 0", got);
      // int4: q * scale + min rounded once (FMA) or twice; every other
      // format is one product the reference forms alike (exact: bit-equal)
      const size_t e = static_cast<size_t>(i) * nc + c;
      const bool int4 = f.code == abi::WeightFormat::kInt4;
      if (std::isnan(want.v[e])) return std::isnan(got) ? "" : Fmt("got %.9g, want NaN (a NaN code)", got);
      return Compare(got, want.v[e], int4 ? 0x1p-22 * want.m[e] : 0.0);
    }, issues);
    report.Add(Describe(), issues);
  }

  const KernelTable& t;
  QuantFormat f;
  int width;
  int64_t k0;
  int kc;
  int64_t n0;
  int nc;
  int64_t N;
};

void SweepQPack(const KernelTable& t, Rng& rng, Report& report) {
  const int vl = t.vl;
  // (k0, kc): odd starts, lone rows, ranges crossing int4 groups
  const int64_t ranges[][2] = {{0, 1}, {1, 1}, {0, 2}, {1, 2}, {1, 6}, {0, 7}, {1, 7},
                               {29, 8}, {31, 34}, {1, 37}, {63, 66}, {0, 128}, {1, 129}};
  for (const QuantFormat& f : QuantFormats())
    for (int width : {vl, 2 * vl}) {
      for (int nc : {1, vl - 1, vl, vl + 1, 2 * vl - 1, 2 * vl, 2 * vl + 1, 2 * width + 3})
        for (const auto& r : ranges) {
          const int64_t n0 = rng.Int(0, 5), N = n0 + nc + rng.Int(0, 3);
          QPackTester{t, f, width, r[0], static_cast<int>(r[1]), n0, nc, N}.Test(rng, report);
        }
    }
}

// ---------------------------------------------------------------- registry


struct KernelEntry {
  const char* name;
  void (*sweep)(const KernelTable&, Rng&, Report&);
};

const KernelEntry kKernels[] = {
    {"gemm1", [](const KernelTable& t, Rng& g, Report& r) { SweepPackedGemm(t, false, g, r); }},
    {"gemm2", [](const KernelTable& t, Rng& g, Report& r) { SweepPackedGemm(t, true, g, r); }},
    {"stream1_f32", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, false, false, g, r); }},
    {"stream1_bf16", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, false, true, g, r); }},
    {"stream2_f32", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, true, false, g, r); }},
    {"stream2_bf16", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, true, true, g, r); }},
    {"stream1_cols_f32", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, false, false, g, r, true); }},
    {"stream1_cols_bf16", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, false, true, g, r, true); }},
    {"stream2_cols_f32", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, true, false, g, r, true); }},
    {"stream2_cols_bf16", [](const KernelTable& t, Rng& g, Report& r) { SweepDenseStream(t, true, true, g, r, true); }},
    {"glu", SweepGlu},
    {"pack_cols", SweepPackCols},
    {"pack_pairs", SweepPackPairs},
    {"stream_pair", SweepStreamPair},
    {"qstream1", [](const KernelTable& t, Rng& g, Report& r) { SweepQuantStream(t, false, g, r); }},
    {"qstream2", [](const KernelTable& t, Rng& g, Report& r) { SweepQuantStream(t, true, g, r); }},
    {"qpack", [](const KernelTable& t, Rng& g, Report& r) { SweepQPack(t, g, r); }},
    {"qdot1", [](const KernelTable& t, Rng& g, Report& r) { SweepQDot(t, false, g, r); }},
    {"qdot2", [](const KernelTable& t, Rng& g, Report& r) { SweepQDot(t, true, g, r); }},
};

}  // namespace

void BindKernelTests(nb::module_& m) {
  m.def("kernel_names", [] { return EntryNames(kKernels); },
        "The CPU micro-kernels run_kernel_tests covers (entries of the kernel table).");
  m.def("run_kernel_tests", [](const std::string& isa, const std::string& kernel, uint32_t seed) {
    const KernelTable* t = KernelsByName(isa.c_str());
    if (t == nullptr)
      throw nb::value_error(("instruction set '" + isa + "' is unknown or this CPU cannot run it (supported: " +
                             SupportedIsas() + ")").c_str());
    return RunSweep(*FindEntry(kKernels, kernel, "kernel", "kernel_names()"), *t, isa + " " + kernel, seed);
  }, nb::arg("isa"), nb::arg("kernel"), nb::arg("seed"),
     "Sweeps one kernel of one instruction set's table over its parameter space with random "
     "inputs from `seed`; returns one line per failing case (empty: all passed).");
}

}  // namespace nbx
