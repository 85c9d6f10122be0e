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
#include "testing/kernel_tests.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cpu/dot_pack.h"
#include "testing/kernel_test_support.h"
#include "testing/quant_weights.h"

namespace nb = nanobind;

namespace nbx {
namespace {

using namespace kernel_testing;  // NOLINT: the testers' own support header

// ---------------------------------------------------------------- gemm1, gemm2

// Three K-blocks [0, p), [p, q), [q, K) at random points (empty ones when K < 3).
std::vector<int64_t> SplitK(int64_t K, Rng& rng) {
  const int64_t lo = K >= 3 ? 1 : 0, hi = K >= 3 ? K - 1 : K;
  const int64_t p = rng.Int(lo, hi);
  int64_t q = rng.Int(lo, hi);
  while (K >= 3 && q == p) q = rng.Int(lo, hi);
  return {0, std::min(p, q), std::max(p, q), K};
}

// K-blocks [at[i], at[i+1]) run in turn through the partial sums in c by
// call(k0, kc, out, c, flags): every call before the last stores all MR x 2VL
// sums to c and leaves `out` untouched, the last reads c without writing it,
// and the result equals `whole` (one pass over K) bit for bit.
template <class Call>
void CheckKBlocks(const std::vector<int64_t>& at, const std::vector<float>& whole, const Grid& grid,
                  const Grid& cgrid, const Call& call, Issues& issues) {
  const std::string tag = "K-blocks " + JoinInts(at, "|");
  std::vector<float> blocked = grid.Fresh(), c = cgrid.Fresh();
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    const bool last = i + 2 == at.size();
    const int flags = (i > 0 ? kLoadPartial : 0) | (last ? 0 : kStorePartial);
    const std::vector<float> before = c;
    call(at[i], at[i + 1] - at[i], blocked, c.data() + cgrid.base, flags);
    const std::string step = tag + Fmt(" call %zu (flags %d)", i, flags);
    ScanGrid(step + ": c", c, cgrid, !last, NoCheck{}, issues);  // all MR x 2VL sums stored
    if (last) CompareBits(step + ": c changed", c, before, cgrid, issues);
    else ExpectUntouched(step + ": out", blocked, issues);
  }
  CompareBits(tag + " vs whole K", blocked, whole, grid, issues);
}

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

// The shape of a streamed case: `rows` rows of a (a[kk*as + r], as in
// [rows, MR], the padding NaN) times one weight matrix (gemm2: down) or two
// (gemm1: gate, up) of K x ncols.
struct StreamShape {
  std::string Describe() const {
    return Fmt("rows=%d as=%lld ncols=%d K=%lld", rows, (long long)as, ncols, (long long)K) +
           (down ? "" : Fmt(" act=%s", ActName(act))) + " out " +
           OutputGrid(rows, ncols, column_major).Name();
  }
  bool down;
  int rows;
  int64_t as;
  int ncols;
  int64_t K;
  int act;
  bool column_major;
};

// Every StreamShape over rows 1..kMaxStreamRows, StreamCols and Ks (t: a
// KernelTable or a DotKernelTable: its vl and mr), each with every activation
// (GEMM1), or with `cycle_acts` one activation per (K, ncols, rows) in turn:
// the quantized kernels' decode does not meet the activation until the same
// epilogue, so each format still meets every activation many times over.
template <class Table, class F>
void ForEachStreamShape(const Table& t, bool down, const std::vector<int64_t>& Ks, Rng& rng,
                        const F& f, bool cycle_acts = false) {
  const std::vector<int> acts = Acts(down);
  size_t turn = 0;
  for (int64_t K : Ks)
    for (int ncols : StreamCols(t.vl))
      for (size_t ai = 0; ai < (cycle_acts ? 1 : acts.size()); ++ai)
        for (int rows = 1; rows <= kMaxStreamRows; ++rows) {
          const int act = acts[cycle_acts ? turn++ % acts.size() : ai];
          f(StreamShape{down, rows, rng.Int(rows, t.mr), ncols, K, act, !down && rng.Bit()});
        }
}

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
          const Grid grid = FlatGrid(static_cast<int64_t>(nsub) * kc * w);
          std::vector<float> out = grid.Fresh();
          t.pack_cols[wi](mv, ns, ld, k0, kc, n0, nc, out.data() + grid.base);
          ScanGrid("packed", out, grid, true,
                   [&](int, int idx, float got) -> std::string {
                     const int q = idx / (kc * w), i = (idx % (kc * w)) / w, j = idx % w;
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
        const Grid grid = FlatGrid(static_cast<int64_t>(nsub) * kc * w);
        std::vector<float> out = grid.Fresh();
        t.pack_pairs[wi](m.Data(), ld, k0, kc, n0, nc, out.data() + grid.base);
        ScanGrid("packed", out, grid, true,
                 [&](int, int idx, float got) -> std::string {
                   const int q = idx / (kc * w), i = (idx % (kc * w)) / w, j = idx % w;
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

// qstream1 / qstream2: columns [n0, n0+ncols) of quantized N-column matrices.
struct QuantStreamTester {
  std::string Describe() const {
    return f.Name() + " " + s.Describe() + Fmt(" n0=%lld N=%lld", (long long)n0, (long long)N);
  }

  void Test(Rng& rng, Report& report) const {
    Issues issues;
    const QuantWeights first(f, s.K, N, n0, s.ncols, rng);
    std::optional<QuantWeights> second;
    if (!s.down) second.emplace(f, s.K, N, n0, s.ncols, rng);
    const QuantMatrix m1 = first.Matrix();
    const QuantMatrix m2 = second ? second->Matrix() : m1;
    TestStreamed(t, s, first, second ? &*second : nullptr,
                 [&](const float* a, const float* w, float* acc, float* out, int64_t rs, int64_t cs) {
                   if (s.down) t.qstream2(a, s.as, s.rows, &m1, n0, s.K, s.ncols, w, acc, out, rs);
                   else t.qstream1(a, s.as, s.rows, &m1, &m2, n0, s.K, s.ncols, TestGlu(s.act), acc, out, rs, cs);
                 },
                 rng, issues);
    report.Add(Describe(), issues);
  }

  const KernelTable& t;
  StreamShape s;
  QuantFormat f;
  int64_t n0, N;
};

void SweepQuantStream(const KernelTable& t, bool down, Rng& rng, Report& report) {
  for (const QuantFormat& f : QuantFormats())
    ForEachStreamShape(
        t, down, QuantKs(f), rng,
        [&](const StreamShape& s) {
          const int64_t n0 = rng.Int(0, 9), N = n0 + s.ncols + rng.Int(0, 5);
          QuantStreamTester{t, s, f, n0, N}.Test(rng, report);
        },
        /*cycle_acts=*/true);
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

// ---------------------------------------------------------------- bfloat16 dot kernels

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
// dot_pack.h as the drivers will), every output against float64 (the
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
      std::vector<uint32_t> pb(static_cast<size_t>(std::max<int64_t>(P, 1) * 2 * vl));
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
    std::vector<uint32_t> pb(static_cast<size_t>(std::max(P, 1)) * nsub * 2 * vl);
    const bf16* mats[2] = {static_cast<const bf16*>(first.Data()),
                           second ? static_cast<const bf16*>(second->Data()) : nullptr};
    if (s.down) PackRowsPairs<1>(mats, ld, 0, static_cast<int>(s.K), 0, s.ncols, vl, pb.data());
    else PackRowsPairs<2>(mats, ld, 0, static_cast<int>(s.K), 0, s.ncols, vl, pb.data());
    std::vector<float> packed = grid.Fresh(), c(static_cast<size_t>(mr * 2 * vl));
    for (int q = 0; q < nsub; ++q) {
      const int cols = std::min(width, s.ncols - q * width);
      const uint32_t* b = pb.data() + static_cast<int64_t>(q) * P * 2 * vl;
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

// ---------------------------------------------------------------- registry
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
};

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
    {"stream1", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotStream(t, false, g, r); }, false},
    {"stream2", [](const DotKernelTable& t, Rng& g, Report& r) { SweepDotStream(t, true, g, r); }, false},
};

std::string DotTableName(const DotKernelTable& t) {
  return std::string(t.name) + "/" + std::to_string(t.vl) + "x" + std::to_string(t.mr);
}

// The entry of `entries` named `name`, else a ValueError naming it.
template <class Entry, size_t N>
const Entry* FindEntry(const Entry (&entries)[N], const std::string& name, const char* what,
                       const char* listing) {
  for (const Entry& k : entries)
    if (name == k.name) return &k;
  throw nb::value_error(("unknown " + std::string(what) + " '" + name + "' (see " + listing + ")").c_str());
}

// One entry's sweep over one table, without the GIL; the failing cases' lines.
template <class Entry, class Table>
std::vector<std::string> RunSweep(const Entry& entry, const Table& t, const std::string& label,
                                  uint32_t seed) {
  Report report(label);
  {
    nb::gil_scoped_release release;
    Rng rng(seed);
    entry.sweep(t, rng, report);
  }
  return report.Lines();
}

}  // namespace

void BindKernelTests(nb::module_& m) {
  m.def("dot_kernel_names", [] {
    std::vector<std::string> names;
    for (const DotKernelEntry& k : kDotKernels) names.push_back(k.name);
    return names;
  }, "The bfloat16 dot-product kernels run_dot_kernel_tests covers.");
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
  m.def("kernel_names", [] {
    std::vector<std::string> names;
    for (const KernelEntry& k : kKernels) names.push_back(k.name);
    return names;
  }, "The CPU micro-kernels run_kernel_tests covers (entries of the kernel table).");
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
