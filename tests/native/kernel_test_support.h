// The kernel testers' support (tests of the CPU micro-kernels): random
// operands, the float64 reference, poisoned buffers with guards, the packing
// of operands into the kernels' layouts.  Included only by kernel_tests.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "abi.h"
#include "cpu/kernels/kernel_table.h"
#include "dtypes.h"

namespace nbx {
namespace kernel_testing {

// ---------------------------------------------------------------- basics

__attribute__((format(printf, 1, 2))) inline std::string Fmt(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

inline std::string JoinInts(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

// Output buffers start as this NaN; a kernel never produces these bits.
constexpr uint32_t kSentinelBits = 0x7fc0ffeeu;
const float kSentinel = BitsToFloat(kSentinelBits);
inline bool IsSentinel(float v) { return FloatToBits(v) == kSentinelBits; }
// Inputs no kernel may use.
const float kNaN = std::numeric_limits<float>::quiet_NaN();

class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  float Uniform() { return std::uniform_real_distribution<float>(-1.0f, 1.0f)(gen_); }
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen_); }
  bool Bit() { return Int(0, 1) == 1; }

 private:
  std::mt19937 gen_;
};

// Every case's failures, one line per failing case.
using Issues = std::vector<std::string>;

class Report {
 public:
  explicit Report(std::string label) : label_(std::move(label)) {}
  void Add(const std::string& what, const Issues& issues) {
    if (issues.empty()) return;
    std::string line = label_ + " " + what + ": ";
    for (size_t i = 0; i < issues.size(); ++i) line += (i ? "; " : "") + issues[i];
    lines_.push_back(line);
  }
  std::vector<std::string> Lines() const { return lines_; }

 private:
  std::string label_;
  std::vector<std::string> lines_;
};

inline const char* ActName(int act) { return abi::kActivationNames[act]; }

// The kernels' Glu of an activation code, kClampedSwiGLU with abi.h's defaults.
inline Glu TestGlu(int act) {
  return Glu{act, static_cast<float>(abi::kClampedSwiGLUAlpha),
             static_cast<float>(abi::kClampedSwiGLULimit)};
}

// glu(g, u) in float64 (abi.h Activation).
inline double RefGlu(int act, double g, double u) {
  switch (act) {
    case static_cast<int>(abi::Activation::kGeGLU):
      return 0.5 * g * (1.0 + std::tanh(abi::kGeluC * (g + abi::kGeluB * g * g * g))) * u;
    case static_cast<int>(abi::Activation::kGeGLUErf):
      return 0.5 * g * (1.0 + std::erf(g * abi::kInvSqrt2)) * u;
    case static_cast<int>(abi::Activation::kClampedSwiGLU): {
      const double L = abi::kClampedSwiGLULimit, gc = std::min(g, L), uc = std::clamp(u, -L, L);
      return gc / (1.0 + std::exp(-abi::kClampedSwiGLUAlpha * gc)) * (uc + 1.0);
    }
    default:
      return g / (1.0 + std::exp(-g)) * u;
  }
}

// The kernels' parameter values (XNNPACK-style edges: 0, 1, odd, one past a
// power of two, ...).
const int64_t kKs[] = {0, 1, 2, 7, 37, 128, 129, 257};

inline std::vector<int> StreamCols(int vl) {
  std::vector<int> v = {1, vl - 1, vl, vl + 1, 2 * vl, 2 * vl + 3, 3 * vl + 5, 129, 515,
                        kMaxStreamCols};
  v.erase(std::remove_if(v.begin(), v.end(), [](int n) { return n < 1; }), v.end());
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

inline std::vector<int> Acts(bool down) {
  std::vector<int> all;
  for (int a = 0; a < abi::kNumActivations; ++a) all.push_back(a);
  return down ? std::vector<int>{0} : all;
}

// ---------------------------------------------------------------- reference

struct Dot {
  double sum = 0;  // sum_k a * w
  double mag = 0;  // sum_k |a| * |w|: what float32 rounding is relative to
};

// A K x cols weight matrix in float64 as the kernel must see it (bfloat16
// widened, dequantized, column scales applied), with the magnitudes its
// rounding error is relative to (int4: |q * scale| + |min|).
struct RefMatrix {
  RefMatrix(int64_t k, int c) : K(k), cols(c), v(k * c), m(k * c) {}
  void Set(int64_t kk, int c, double value, double mag) {
    v[kk * cols + c] = value;
    m[kk * cols + c] = mag;
  }
  void ScaleColumns(const std::vector<float>& s) {
    for (int64_t kk = 0; kk < K; ++kk)
      for (int c = 0; c < cols; ++c) v[kk * cols + c] *= s[c], m[kk * cols + c] *= std::fabs(s[c]);
  }
  int64_t K;
  int cols;
  std::vector<double> v, m;
};

// a (rows x K, float64) @ w: rows x cols dots.
inline std::vector<Dot> Dots(const std::vector<double>& a, int rows, const RefMatrix& w) {
  std::vector<Dot> d(static_cast<size_t>(rows) * w.cols);
  for (int r = 0; r < rows; ++r) {
    Dot* dr = d.data() + static_cast<size_t>(r) * w.cols;
    for (int64_t kk = 0; kk < w.K; ++kk) {
      const double av = a[r * w.K + kk], aa = std::fabs(av);
      const double* v = w.v.data() + kk * w.cols;
      const double* m = w.m.data() + kk * w.cols;
      for (int c = 0; c < w.cols; ++c) dr[c].sum += av * v[c], dr[c].mag += aa * m[c];
    }
  }
  return d;
}

constexpr double kRelTol = 2e-6;
inline double Tol(const Dot& d) { return kRelTol * d.mag + 1e-30; }

inline std::string Compare(float got, double want, double tol) {
  const double diff = std::fabs(static_cast<double>(got) - want);
  if (diff <= tol) return "";  // (false for NaN)
  return Fmt("got %.9g, want %.9g (|diff| %.3g > tol %.3g)", got, want, diff, tol);
}

// glu(g, u): the errors of g and u carried through (|d glu / dg| < 1.2 |u'|
// and |d glu / du| <= |act(g)| for every activation, u' = u (+ 1 clamped)),
// plus the float32 activation's own (1e-6 (|g| + |act(g)|) |u'|).
inline std::string CheckGlu(int act, const Dot& g, const Dot& u, float got) {
  const double tg = Tol(g), tu = Tol(u), want = RefGlu(act, g.sum, u.sum);
  const bool clamped = act == static_cast<int>(abi::Activation::kClampedSwiGLU);
  const double ue = std::fabs(u.sum) + (clamped ? 1.0 : 0.0);  // |u'|
  const double f = std::fabs(RefGlu(act, g.sum, clamped ? 0.0 : 1.0));  // |act(g)|
  const double tol = 1.2 * tg * (ue + tu) + f * tu + 1e-6 * (std::fabs(g.sum) + f) * ue + 1e-30;
  return Compare(got, want, tol);
}

inline std::string CheckDown(float w, const Dot& d, float got) {
  return Compare(got, w * d.sum, std::fabs(w) * Tol(d));
}

// The float64 reference of a kernel's output: act(a@gate) * (a@up) (gemm1 and
// the streamed twins), or w[r] * (a@down) (gemm2).
struct Expected {
  std::string operator()(int r, int c, float got) const {
    const Dot& x = g[static_cast<size_t>(r) * cols + c];
    return down ? CheckDown(w[r], x, got) : CheckGlu(act, x, u[static_cast<size_t>(r) * cols + c], got);
  }
  bool down = false;
  int act = 0;
  int cols = 0;
  std::vector<Dot> g, u;  // gemm2: a@down in g
  std::vector<float> w;
};

inline Expected ExpectGlu(int act, const std::vector<double>& a, int rows, const RefMatrix& gate,
                   const RefMatrix& up) {
  Expected e;
  e.act = act;
  e.cols = gate.cols;
  e.g = Dots(a, rows, gate);
  e.u = Dots(a, rows, up);
  return e;
}

inline Expected ExpectDown(const std::vector<float>& w, const std::vector<double>& a, int rows,
                    const RefMatrix& down) {
  Expected e;
  e.down = true;
  e.cols = down.cols;
  e.g = Dots(a, rows, down);
  e.w = w;
  return e;
}

// ---------------------------------------------------------------- buffers

// Where a kernel writes in a buffer: element (r, c) of a rows x cols result at
// base + p*ps + r*rs + j*cs, c = p*cb + j (cb = 0: one block); everything
// else in the buffer must keep the sentinel.  The guards either side are
// kGuard + rs + cs + ps long: one row, column or panel too far lands in them.
constexpr int64_t kGuard = 7;

struct Grid {
  int64_t Offset(int r, int c) const {
    const int p = cb ? c / cb : 0, j = cb ? c % cb : c;
    return p * ps + r * rs + j * cs;
  }
  int64_t At(int r, int c) const { return base + Offset(r, c); }
  std::vector<float> Fresh() const { return std::vector<float>(size, kSentinel); }
  std::string Name() const {
    if (cb) return Fmt("rs=%lld ps=%lld", (long long)rs, (long long)ps);
    return cs == 1 ? Fmt("row-major rs=%lld", (long long)rs) : Fmt("column-major cs=%lld", (long long)cs);
  }
  int rows = 0, cols = 0;
  int64_t rs = 0, cs = 1;
  int cb = 0;
  int64_t ps = 0;
  int64_t base = 0;  // where (0, 0) is
  size_t size = 0;
};

inline Grid MakeGrid(int rows, int cols, int64_t rs, int64_t cs, int cb = 0, int64_t ps = 0) {
  Grid g;
  g.rows = rows, g.cols = cols, g.rs = rs, g.cs = cs, g.cb = cb, g.ps = ps;
  const int64_t last = rows > 0 && cols > 0 ? g.Offset(rows - 1, cols - 1) : 0;
  g.base = kGuard + rs + cs + ps;
  g.size = static_cast<size_t>(2 * g.base + last + 1);
  return g;
}

// An output of rows x cols: row-major (rows padded) or column-major.
inline Grid OutputGrid(int rows, int cols, bool column_major) {
  return column_major ? MakeGrid(rows, cols, 1, rows + 2) : MakeGrid(rows, cols, cols + 3, 1);
}

// A packed block of kc rows and nsub micro-panels w = 2*vl wide, the panels
// PanelStride(kc, vl) apart (kernel_table.h): element (i, q*w + j) is row i
// of panel q; the skew between panels must stay untouched.
inline Grid PackedGrid(int kc, int nsub, int vl) {
  const int w = 2 * vl;
  return MakeGrid(kc, nsub * w, w, 1, w, PanelStride(kc, vl));
}

// n consecutive elements (guards n long).
inline Grid FlatGrid(int64_t n) { return MakeGrid(1, static_cast<int>(n), n, 1); }

struct NoCheck {
  std::string operator()(int, int, float) const { return ""; }
};

// Elements of `g` in `buf` must have been written (when must_write) and pass
// check(r, c, value); all others must still be the sentinel.
template <class F>
void ScanGrid(const std::string& what, const std::vector<float>& buf, const Grid& g,
              bool must_write, const F& check, Issues& issues) {
  std::vector<int32_t> owner(buf.size(), -1);
  for (int r = 0; r < g.rows; ++r)
    for (int c = 0; c < g.cols; ++c) owner[g.At(r, c)] = r * g.cols + c;
  int64_t unwritten = 0, wrong = 0, stray = 0;
  std::string first_unwritten, first_wrong, first_stray;
  for (size_t i = 0; i < buf.size(); ++i) {
    const float v = buf[i];
    if (owner[i] < 0) {
      if (!IsSentinel(v) && stray++ == 0)
        first_stray = Fmt("offset %lld from [0,0] = %.9g", (long long)(i - g.base), v);
      continue;
    }
    const int r = owner[i] / g.cols, c = owner[i] % g.cols;
    if (IsSentinel(v)) {
      if (must_write && unwritten++ == 0) first_unwritten = Fmt("[%d,%d]", r, c);
      continue;
    }
    std::string msg = check(r, c, v);
    if (!msg.empty() && wrong++ == 0) first_wrong = Fmt("[%d,%d] ", r, c) + msg;
  }
  const long long n = static_cast<long long>(g.rows) * g.cols;
  if (wrong) issues.push_back(what + Fmt(": %lld of %lld wrong, first ", (long long)wrong, n) + first_wrong);
  if (unwritten)
    issues.push_back(what + Fmt(": %lld of %lld not written, first ", (long long)unwritten, n) + first_unwritten);
  if (stray) issues.push_back(what + Fmt(": %lld written outside, first at ", (long long)stray) + first_stray);
}

inline void ExpectUntouched(const std::string& what, const std::vector<float>& buf, Issues& issues) {
  ScanGrid(what, buf, MakeGrid(0, 0, 0, 1), false, NoCheck{}, issues);
}

// The elements of `g` in `got` and `want` must be the same bits.
inline void CompareBits(const std::string& what, const std::vector<float>& got,
                 const std::vector<float>& want, const Grid& g, Issues& issues) {
  int64_t differ = 0;
  std::string first;
  for (int r = 0; r < g.rows; ++r)
    for (int c = 0; c < g.cols; ++c) {
      const float x = got[g.At(r, c)], y = want[g.At(r, c)];
      if (FloatToBits(x) == FloatToBits(y) || differ++ > 0) continue;
      first = Fmt("[%d,%d] %.9g vs %.9g (%lld ulp)", r, c, x, y,
                  (long long)std::llabs((int64_t)FloatToBits(x) - (int64_t)FloatToBits(y)));
    }
  if (differ)
    issues.push_back(what + Fmt(": %lld of %lld differ in bits, first ", (long long)differ,
                                static_cast<long long>(g.rows) * g.cols) + first);
}

// ---------------------------------------------------------------- operands

// n x rows values a[kk*as + r] (r < rows) in [-1, 1], `pad` at r in [rows, as):
// activations (a streamed kernel's rows, or packed A with as = MR and pad 0)
// and dense weights (rows = columns, as = ld).
inline std::vector<float> RandomRows(int64_t n, int rows, int64_t as, float pad, Rng& rng) {
  std::vector<float> a(static_cast<size_t>(n * as));
  for (int64_t kk = 0; kk < n; ++kk)
    for (int64_t r = 0; r < as; ++r) a[kk * as + r] = r < rows ? rng.Uniform() : pad;
  return a;
}

// Rows of a (a[kk*as + r]) as float64, row-major rows x K.
inline std::vector<double> RowsF64(const std::vector<float>& a, int64_t as, int rows, int64_t K) {
  std::vector<double> d(static_cast<size_t>(rows * K));
  for (int r = 0; r < rows; ++r)
    for (int64_t kk = 0; kk < K; ++kk) d[r * K + kk] = a[kk * as + r];
  return d;
}

// Packed A (one m-panel of mr rows, a[kk*mr + r], rows past the end 0).
inline std::vector<float> PackA(const std::vector<float>& a, int64_t as, int rows, int64_t K, int mr) {
  std::vector<float> p(static_cast<size_t>(K * mr), 0.0f);
  for (int64_t kk = 0; kk < K; ++kk)
    for (int r = 0; r < rows; ++r) p[kk * mr + r] = a[kk * as + r];
  return p;
}

// A dense K x ncols weight matrix read in place: float32, or bfloat16 bits;
// row stride ld > ncols, the padding NaN; or with `by_columns` stored by
// columns (element (k, c) at c*ld + k, ld > K: out x in weights).  Optional
// column scales (as int8 weights have: the packed kernels apply them,
// `scale` argument).
class DenseWeights {
 public:
  DenseWeights(int64_t K, int ncols, int64_t ld, bool is_bf16, bool scaled, Rng& rng,
               bool by_columns = false)
      : K_(K), ncols_(ncols), ld_(ld), by_columns_(by_columns),
        f_(by_columns ? RandomRows(ncols, static_cast<int>(K), ld, kNaN, rng)
                      : RandomRows(K, ncols, ld, kNaN, rng)) {
    if (is_bf16) {
      h_.resize(f_.size());
      for (size_t i = 0; i < f_.size(); ++i) {
        h_[i] = FromFloat<bf16>(f_[i]).bits;
        f_[i] = ToFloat(bf16{h_[i]});
      }
    }
    if (scaled)
      for (int c = 0; c < ncols; ++c) scales_.push_back(rng.Uniform());
  }
  const void* Data() const { return h_.empty() ? static_cast<const void*>(f_.data()) : h_.data(); }
  RefMatrix Ref() const {
    RefMatrix m(K_, ncols_);
    for (int64_t kk = 0; kk < K_; ++kk)
      for (int c = 0; c < ncols_; ++c) m.Set(kk, c, At(kk, c), std::fabs(At(kk, c)));
    if (HasScales()) m.ScaleColumns(scales_);
    return m;
  }
  // Columns [c0, c0+nc) as K rows of `width` float32 (zero-padded) at dst + kk*rs.
  void Panel(const KernelTable&, int64_t c0, int nc, int width, float* dst, int64_t rs) const {
    for (int64_t kk = 0; kk < K_; ++kk)
      for (int j = 0; j < width; ++j) dst[kk * rs + j] = j < nc ? At(kk, c0 + j) : 0.0f;
  }
  float At(int64_t kk, int64_t c) const { return by_columns_ ? f_[c * ld_ + kk] : f_[kk * ld_ + c]; }
  bool HasScales() const { return !scales_.empty(); }
  float Scale(int64_t c) const { return scales_[c]; }

 private:
  int64_t K_;
  int ncols_;
  int64_t ld_;
  bool by_columns_;
  std::vector<float> f_;   // float32 values (bfloat16: widened)
  std::vector<uint16_t> h_;  // bfloat16 bits
  std::vector<float> scales_;
};

// Columns [c0, c0+nc) of the weights as one packed B micro-panel of K rows
// (gemm1: VL gate then VL up columns; gemm2: 2VL down columns; zero-padded),
// and the column scales the packed kernel applies (padding NaN), if any.
template <class W>
struct PackedB {
  PackedB(const KernelTable& t, const W& first, const W* second, int64_t K, int64_t c0, int nc)
      : b(static_cast<size_t>(K * 2 * t.vl)), scale(2 * t.vl, kNaN) {
    const int width = second ? t.vl : 2 * t.vl;
    first.Panel(t, c0, nc, width, b.data(), 2 * t.vl);
    if (second) second->Panel(t, c0, nc, width, b.data() + t.vl, 2 * t.vl);
    if (!first.HasScales()) return;
    for (int j = 0; j < nc; ++j) {
      scale[j] = first.Scale(c0 + j);
      if (second) scale[t.vl + j] = second->Scale(c0 + j);
    }
    scaled = true;
  }
  const float* Scale() const { return scaled ? scale.data() : nullptr; }
  std::vector<float> b, scale;
  bool scaled = false;
};

// One packed GEMM call site on one m-panel: gemm1 (act(a@gate) * (a@up)) or
// gemm2 (w * (a@down)); operator() runs the K-block [k0, k0+kc).
struct PackedCall {
  void operator()(int64_t k0, int64_t kc, float* c, int flags) const {
    const float* ak = a + k0 * t.mr;
    const float* bk = b + k0 * 2 * t.vl;
    if (down) t.gemm2(ak, bk, kc, w, rows, cols, out, rs, c, flags, scale);
    else t.gemm1(ak, bk, kc, TestGlu(act), rows, cols, out, rs, cs, c, flags, scale);
  }
  const KernelTable& t;
  bool down;
  int act;
  const float* a;
  const float* b;
  const float* scale;
  const float* w;
  int rows, cols;
  float* out;
  int64_t rs, cs;
};

// The packed kernels' result for rows of a and the weights (whole K, one
// gemm1/gemm2 call per VL/2VL columns), laid out as `grid`: what a streamed
// kernel must equal bit for bit.
template <class W>
std::vector<float> PackedResult(const KernelTable& t, const std::vector<float>& a, int64_t as,
                                int64_t K, int act, const std::vector<float>& w, const W& first,
                                const W* second, const Grid& grid) {
  const int width = second ? t.vl : 2 * t.vl;
  const std::vector<float> ap = PackA(a, as, grid.rows, K, t.mr);
  std::vector<float> out = grid.Fresh(), c(2 * t.vl * t.mr);
  for (int c0 = 0; c0 < grid.cols; c0 += width) {
    const int nc = std::min(width, grid.cols - c0);
    const PackedB<W> pb(t, first, second, K, c0, nc);
    const PackedCall call{t, second == nullptr, act, ap.data(), pb.b.data(), pb.Scale(), w.data(),
                          grid.rows, nc, out.data() + grid.At(0, c0), grid.rs, grid.cs};
    call(0, K, c.data(), 0);
  }
  return out;
}

// ---------------------------------------------------------------- K-blocks and streamed shapes
// (kernel_tests.cc and dot_kernel_tests.cc)

// Three K-blocks [0, p), [p, q), [q, K) at random points (empty ones when K < 3).
inline std::vector<int64_t> SplitK(int64_t K, Rng& rng) {
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

}  // namespace kernel_testing
}  // namespace nbx
