// Run-time choice of the micro-kernels' instruction set, per kernel family.
//
// A KernelTable's entries fall into six families that never exchange
// anything but plain float32 rows (kernel_table.h), so each may come from a
// different instruction set:
//   packed   the K-block GEMMs and everything sized by the table's blocking
//            (vl, mr, kc, nc, chunk_panels, gemm1/gemm2, qpack, glu,
//            pack_cols, pack_pairs): prefill and every expert with more
//            rows than kMaxStreamRows;
//   stream   bfloat16 weights streamed in place (the [1] entries of
//            stream1/2, their by-columns forms, stream_pair): decode;
//   qstream  quantized weights streamed in place (qstream1/2): quantized
//            decode;
//   dot      the blocking (and the plain table) that precision="bfloat16"
//            runs on, with the dot kernels of that blocking (dot_table);
//   stream_f32  float32 weights streamed in place (the [0] entries);
//   qdot     precision="int8"'s kernels (qdot1/2; the same bits on every
//            instruction set, abi.h "int8 arithmetic").
// A composed table (e.g. "packed=avx2,stream=avx512,qstream=avx2,dot=avx512,
// stream_f32=avx2,qdot=avx512") takes
// each family's entries from its instruction set's own table, so each
// family's results are those of that instruction set alone, bit for bit
// (tests/cpu/test_isa_choice.py).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "cpu/kernels/kernel_table.h"

namespace nbx {
namespace {

constexpr int kNumIsas = 3;
const char* const kIsas[kNumIsas] = {"avx512", "avx2", "generic"};  // best first
const char* const kFamilies[kNumFamilies] = {"packed", "stream", "qstream", "dot", "stream_f32", "qdot"};

#if defined(__x86_64__) || defined(_M_X64)
// F16C (CPUID.1:ECX bit 29): the AVX2 kernels' half conversions (E4M3 decode).
// By CPUID, as Clang's __builtin_cpu_supports does not name "f16c"; the OS's
// saving of the YMM state is what "avx2" above already checks.
bool HasF16c() {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}
#endif

bool Supports(const char* name) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (std::strcmp(name, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
#endif
  return std::strcmp(name, "generic") == 0;
}

int IsaIndex(const char* name) {
  for (int i = 0; i < kNumIsas; ++i)
    if (std::strcmp(name, kIsas[i]) == 0) return i;
  return -1;
}

const KernelTable* ByIndex(int i) {
#if defined(__x86_64__) || defined(_M_X64)
  if (i == 0) return KernelsAvx512();
  if (i == 1) return KernelsAvx2();
#endif
  return i == 2 ? KernelsGeneric() : nullptr;
}

// The x86 CPU's vendor string and display family (CPUID leaf 0 and 1).
void CpuId(char vendor[13], int* family) {
  std::strcpy(vendor, "");
  *family = 0;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    vendor[12] = '\0';
  }
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    const int base = (a >> 8) & 0xf, ext = (a >> 20) & 0xff;
    *family = base == 0xf ? base + ext : base;
  }
#endif
}

// Composed tables: one per combination of the families' instruction sets,
// built on first use and never freed (a call in flight keeps reading the
// table it started with while another thread selects a new one).
struct Composed {
  KernelTable table;
  char name[128];  // "packed=avx512,stream=generic,...": six families
  bool built = false;
};
constexpr int Combinations() {
  int n = 1;
  for (int f = 0; f < kNumFamilies; ++f) n *= kNumIsas;
  return n;
}
Composed g_composed[Combinations()];  // (zero-initialized: untouched pages until used)
std::mutex g_compose_mutex;

const KernelTable* Compose(const int isa[kNumFamilies]) {
  if (std::all_of(isa, isa + kNumFamilies, [&](int i) { return i == isa[0]; })) return ByIndex(isa[0]);
  std::lock_guard<std::mutex> lock(g_compose_mutex);
  int index = 0;
  for (int f = 0; f < kNumFamilies; ++f) index = index * kNumIsas + isa[f];
  Composed& c = g_composed[index];
  if (!c.built) {
    const KernelTable& p = *ByIndex(isa[kPacked]);
    const KernelTable& q = *ByIndex(isa[kQStream]);
    const KernelTable& qd = *ByIndex(isa[kQDot]);
    c.table = p;  // the packed family: blocking, GEMMs, packing, glu
    for (int w = 0; w < 2; ++w) {  // [0] float32 weights, [1] bfloat16
      const KernelTable& s = *ByIndex(isa[w == 0 ? kStreamF32 : kStream]);
      c.table.stream1[w] = s.stream1[w];
      c.table.stream2[w] = s.stream2[w];
      c.table.stream1_cols[w] = s.stream1_cols[w];
      c.table.stream2_cols[w] = s.stream2_cols[w];
      c.table.stream_pair[w] = s.stream_pair[w];
    }
    c.table.qstream1 = q.qstream1;
    c.table.qstream2 = q.qstream2;
    c.table.qdot1 = qd.qdot1;  // precision="int8"
    c.table.qdot2 = qd.qdot2;
    c.table.dot_table = ByIndex(isa[kDot]);
    std::string name;  // "packed=avx2,stream=avx512,..."
    for (int f = 0; f < kNumFamilies; ++f)
      name += std::string(f ? "," : "") + kFamilies[f] + "=" + kIsas[isa[f]];
    std::snprintf(c.name, sizeof(c.name), "%s", name.c_str());
    c.table.isa = c.name;
    c.built = true;
  }
  return &c.table;
}

std::atomic<const KernelTable*> g_active{nullptr};

// "packed, stream, qstream, dot, stream_f32, qdot": the families' names, for messages.
std::string FamilyList() {
  std::string s;
  for (int f = 0; f < kNumFamilies; ++f) s += std::string(f ? ", " : "") + kFamilies[f];
  return s;
}

// Parses "avx2" (every family) or "packed=avx2,stream=avx512" (the families
// not named keep `isa`'s entries) into `isa`; "" or what is wrong.
std::string Parse(const char* spec, int isa[kNumFamilies]) {
  if (std::strchr(spec, '=') == nullptr) {
    const int i = IsaIndex(spec);
    if (i < 0) return "unknown instruction set (expected avx512, avx2 or generic)";
    if (!Supports(spec)) return "this CPU does not support it";
    for (int f = 0; f < kNumFamilies; ++f) isa[f] = i;
    return "";
  }
  std::string s(spec);
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      return "'" + item + "' is not family=isa (families: " + FamilyList() + ")";
    const std::string fam = item.substr(0, eq), name = item.substr(eq + 1);
    int f = 0;
    while (f < kNumFamilies && fam != kFamilies[f]) ++f;
    if (f == kNumFamilies)
      return "unknown kernel family '" + fam + "' (expected one of " + FamilyList() + ")";
    const int i = IsaIndex(name.c_str());
    if (i < 0)
      return "unknown instruction set '" + name + "' for " + fam +
             " (expected avx512, avx2 or generic)";
    if (!Supports(name.c_str())) return "this CPU does not support " + name + " (for " + fam + ")";
    isa[f] = i;
    start = end + 1;
  }
  return "";
}

}  // namespace

void DefaultFamilies(const char* vendor, int family, const char* supported,
                     const char* out[kNumFamilies]) {
  auto has = [&](const char* n) {
    const std::string list = std::string(",") + supported + ",";
    return list.find(std::string(",") + n + ",") != std::string::npos;
  };
  const char* best = "generic";
  for (const char* n : kIsas)
    if (has(n)) {
      best = n;
      break;
    }
  for (int f = 0; f < kNumFamilies; ++f) out[f] = best;
  // AMD family 19h (Zen 3, Zen 4): Zen 4 executes a 512-bit FMA as two
  // 256-bit halves, so the AVX-512 kernels' wider register block buys no
  // FLOPs and costs packing and a larger m-panel.  Measured on a 2-core EPYC
  // Zen 4 (issue #19, a982d03), the AVX2 kernels were faster on every row:
  // OLMoE T=512 f32 358 vs 436 ms, bf16 weights 328 vs 354 ms, bf16 decode
  // T=1 6.29 vs 9.81 ms.  Re-measured on a Zen 4 on 2026-12-04
  // (docs/benchmarks.md, isa.py): AVX2 4-20 % faster on every prefill row,
  // within 5 % of the faster ISA on every decode row, no per-family
  // composition better on both layers.  Zen 3 has no AVX-512 (the rule
  // changes nothing there); Zen 5 (family 1Ah) has full-width AVX-512 and
  // keeps it.  Except, measured on the same Zen 4 after the packing work of
  // 2026-12-04 (docs/benchmarks.md, interleaved in one process):
  //   dot     precision="bfloat16" on the AVX-512 blocking (VDPBF16PS on
  //           zmm, 16 x 12) beat the AVX2 one (ymm, 8 x 6) on prefill:
  //           OLMoE T=512 1.09-1.17x, Qwen3 1.02x (isa.py);
  //   stream  the AVX-512 streaming kernels were at least as fast on every
  //           bf16 decode row of two runs (isa.py 9 rounds: 1.00-1.17x;
  //           quant.py 7 rounds: 1.06-1.12x), where an earlier run of the
  //           day had read them within 5 %.
  // The dot family went back to AVX2 (the 8 x 6 blocking, VDPBF16PS on
  // ymm) on 2026-12-05, after the packed panels' skew (kernel_table.h
  // PanelStride) made the narrower blocking's packing cheaper: isa.py
  // prefill-bf16dot, three runs of 5-7 rounds, AVX-512 / AVX2 time: Qwen3
  // 1.06, 1.12, 1.06; OLMoE 0.98, 1.05, 0.99.  Its decode rows (the fma
  // streaming kernels of the blocking's width) split by layer: Qwen3 1.21 and
  // 1.07, OLMoE 0.96 and 0.92; the rule follows prefill, as before.
  // stream_f32 stays AVX2, split from stream on 2026-12-05 because the
  // float32 rows disagreed with the bf16 ones (isa.py 5 rounds, f32 decode
  // T=1 AVX-512 1.13x (OLMoE) and 1.07x (Qwen3) the AVX2 time, where the run
  // before had read 1.37x and 1.05x; the two fair runs below split, 0.92-1.07).
  // qstream and qdot (precision="int8", split from qstream) take AVX-512 since
  // 2026-12-05, when isa.py was made fair: every call after the eviction (the
  // copy ran once per round, before the first ISA, avx512, so AVX2 found a
  // small layer such as int4 Qwen3 T=1, 21 MB, still in the 32 MB L3: the
  // "AVX2 1.07-1.48x faster at T=1" that had kept qstream on AVX2), the
  // order rotating, and only the row's family switched.  Two such runs of 9
  // rounds, OLMoE and Qwen3, AVX2 / AVX-512 time: qstream int4 T=1 and 8
  // 1.01-1.17 (all 8 rows), int8 T=1 0.88-1.11; qdot int8 1.01-1.54, int4
  // 1.08-1.35 (all 16 rows; three runs without eviction agreed).
  if (std::strcmp(best, "avx512") == 0 && std::strcmp(vendor, "AuthenticAMD") == 0 &&
      family == 0x19 && has("avx2"))
    for (int f = 0; f < kNumFamilies; ++f)
      out[f] = f == kStream || f == kQStream || f == kQDot ? "avx512" : "avx2";
}

const char* KernelFamilyName(int f) { return f >= 0 && f < kNumFamilies ? kFamilies[f] : ""; }

const KernelTable* KernelsByName(const char* name) {
  const int i = IsaIndex(name);
  return i >= 0 && Supports(name) ? ByIndex(i) : nullptr;
}

const KernelTable* DefaultKernels() {
  static const KernelTable* t = [] {
    char vendor[13];
    int family;
    CpuId(vendor, &family);
    const char* names[kNumFamilies];
    DefaultFamilies(vendor, family, SupportedIsas(), names);
    int isa[kNumFamilies];
    for (int f = 0; f < kNumFamilies; ++f) isa[f] = IsaIndex(names[f]);
    return Compose(isa);
  }();
  return t;
}

bool SelectIsa(const char* name, std::string* error) {
  int isa[kNumFamilies];
  // families a composition does not name keep the default choice
  const KernelTable* d = DefaultKernels();
  for (int f = 0; f < kNumFamilies; ++f) isa[f] = IsaIndex(IsaOfFamily(*d, f));
  *error = Parse(name, isa);
  if (!error->empty()) return false;
  g_active.store(Compose(isa));
  return true;
}

const char* IsaOfFamily(const KernelTable& t, int family) {
  for (int i = 0; i < kNumIsas; ++i) {
    const KernelTable* k = ByIndex(i);
    if (k == nullptr) continue;
    const bool same = family == kPacked    ? t.gemm1 == k->gemm1
                      : family == kStream  ? t.stream1[1] == k->stream1[1]
                      : family == kStreamF32 ? t.stream1[0] == k->stream1[0]
                      : family == kQStream ? t.qstream1 == k->qstream1
                      : family == kQDot    ? t.qdot1 == k->qdot1
                                           : t.dot_table == k;
    if (same) return kIsas[i];
  }
  return "";
}

const KernelTable* ActiveKernels() {
  const KernelTable* t = g_active.load();
  if (t == nullptr) {  // the default (JAX_NBX_ISA: Python calls SelectIsa at load)
    t = DefaultKernels();
    g_active.store(t);
  }
  return t;
}

const KernelTable* ActiveKernels(bool bf16_dot) {
  const KernelTable* t = ActiveKernels();
  return bf16_dot ? t->dot_table : t;
}

// avx512_bf16: the AVX-512 table's requirements plus CPUID leaf 7 subleaf 1
// EAX bit 5 (the compiler's cpu-supports name for it varies by version).
[[maybe_unused]] static bool SupportsAvx512Bf16() {  // (unused off x86-64)
#if defined(__x86_64__) || defined(_M_X64)
  if (!Supports("avx512")) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 1, a, b, c, d);
  return (a >> 5) & 1u;
#else
  return false;
#endif
}

namespace {
// The dot kernels' names, fastest first ("auto" takes the first this CPU has
// for the packed table's blocking).
const char* const kDotNames[] = {"avx512_bf16", "fma", "emulated"};
constexpr int kNumDotNames = sizeof kDotNames / sizeof kDotNames[0];
std::atomic<int> g_dot_forced{-1};  // an index of kDotNames, or -1: "auto"

const DotKernelTable* const* DotTables(int* n) {
  static const DotKernelTable* tables[7];
  static const int count = [] {
    int c = 0;
#if defined(__x86_64__) || defined(_M_X64)
    if (SupportsAvx512Bf16()) {
      tables[c++] = DotKernelsAvx512Bf16x16x12();
      tables[c++] = DotKernelsAvx512Bf16x8x6();
    }
    if (Supports("avx512")) tables[c++] = DotKernelsFma16x12();
    if (Supports("avx2")) tables[c++] = DotKernelsFma8x6();
#endif
    tables[c++] = DotKernelsEmulated16x12();
    tables[c++] = DotKernelsEmulated8x6();
    tables[c++] = DotKernelsEmulated4x6();
    return c;
  }();
  *n = count;
  return tables;
}

bool HasDotKernels(const char* name) {
  int n;
  const DotKernelTable* const* t = DotTables(&n);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(t[i]->name, name) == 0) return true;
  return false;
}
}  // namespace

int NumDotKernelTables() {
  int n;
  DotTables(&n);
  return n;
}

const DotKernelTable* DotKernelTableAt(int i) {
  int n;
  const DotKernelTable* const* t = DotTables(&n);
  return i >= 0 && i < n ? t[i] : nullptr;
}

const DotKernelTable* DotKernelsByName(const char* name, int vl, int mr) {
  if (name == nullptr) return nullptr;
  int n;
  const DotKernelTable* const* t = DotTables(&n);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(t[i]->name, name) == 0 && t[i]->vl == vl && t[i]->mr == mr) return t[i];
  return nullptr;
}

const DotKernelTable* ActiveDotKernels(const KernelTable& kt) {
  const int forced = g_dot_forced.load();
  for (int i = forced < 0 ? 0 : forced; i < kNumDotNames; ++i) {
    const DotKernelTable* t = DotKernelsByName(kDotNames[i], kt.vl, kt.mr);
    if (t != nullptr) return t;
    if (forced >= 0) break;
  }
  return DotKernelsByName("emulated", kt.vl, kt.mr);
}

bool SelectDotKernels(const char* name, std::string* error) {
  error->clear();
  if (std::strcmp(name, "auto") == 0) {
    g_dot_forced.store(-1);
    return true;
  }
  int i = 0;
  while (i < kNumDotNames && std::strcmp(name, kDotNames[i]) != 0) ++i;
  const bool known = i < kNumDotNames;
  if (known && HasDotKernels(name)) {
    g_dot_forced.store(i);
    return true;
  }
  *error = std::string(known ? "dot kernels '" : "unknown dot kernels '") + name +
           (known ? "' are not supported on this CPU" : "'") + " (this CPU runs: auto," + SupportedDotKernels() + ")";
  return false;
}

const char* SupportedDotKernels() {
  static const std::string list = [] {
    std::string s;
    for (const char* name : kDotNames)
      if (HasDotKernels(name)) s += (s.empty() ? "" : ",") + std::string(name);
    return s;
  }();
  return list.c_str();
}

const char* SupportedIsas() {
  static const char* list = [] {
    static char buf[64] = "";
    for (const char* n : kIsas) {
      if (Supports(n)) {
        if (buf[0] != '\0') std::strcat(buf, ",");
        std::strcat(buf, n);
      }
    }
    return buf;
  }();
  return list;
}

}  // namespace nbx
