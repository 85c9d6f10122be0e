// The interface between the portable drivers (gemm_driver.h, moe_forward.cc,
// moe_backward.cc) and the micro-kernels of one instruction set
// (kernels_<isa>.cc); see kernels.h.
#pragma once

#include <stdint.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "abi.h"
#include "common/quant_matrix.h"  // QuantMatrix: what the quantized kernels read

namespace nbx {

// The gated unit of the experts (codes, formulas and constants: abi.h
// Activation): its code and kClampedSwiGLU's two parameters (the FFI
// attributes act_alpha, act_limit).  The kernels' epilogues apply it.
struct Glu {
  int act;
  float alpha;
  float limit;
};

// Flags of the packed kernels: one call covers one K-block of the sum.
enum PartialFlags : int {
  kLoadPartial = 1,   // start from the partial sums in c, not from 0
  kStorePartial = 2,  // more K-blocks follow: store the sums to c, no epilogue
};

// Rows of a streamed work item at most (one m-panel: every ISA's MR >= 6).
// 6 rather than 4: OLMoE T=32 8-16% and T=64 2-11% faster (f32 and bf16,
// interleaved runs); streaming up to 12 rows as two passes over the weights
// was slower than 6.
constexpr int kMaxStreamRows = 6;

// Columns per streamed work item (whole pages of float32 rows); the streaming
// kernels take at most this many.
constexpr int kMaxStreamCols = 1024;

// The columns of the streamed work item that starts at n0 of N, when items
// are cut every tc columns (tc divides kMaxStreamCols): kMaxStreamCols (or
// what is left of N) from every multiple of kMaxStreamCols, none from the
// items between (moe_forward.cc, row_band.h).
inline int64_t StreamItemColumns(int64_t n0, int64_t N) {
  if (n0 % kMaxStreamCols != 0) return 0;
  return N - n0 < kMaxStreamCols ? N - n0 : kMaxStreamCols;
}

// The packed-B layout's step from one micro-panel to the next: `rows` rows
// (float32 panels: the K-block's kc; bfloat16 pairs: ceil(kc/2)) of 2*vl
// floats or words, then kPanelSkew more.  A 128-row micro-panel is 4, 8 or
// 16 kB, a multiple of 4 kB: without the skew a packer's stores (row i of
// panel after panel) all fall into one set of the L1 cache, and packing ran
// 2.4x slower (a standalone loop on a Zen 4, docs/benchmarks.md).
constexpr int64_t kPanelSkew = 16;  // floats or words: one 64-byte line
inline int64_t PanelStride(int64_t rows, int vl) { return rows * 2 * vl + kPanelSkew; }
// Floats (words) of a packed block of `rows` rows and `cols` columns: whole
// micro-panels of 2*vl columns, each PanelStride apart.
inline int64_t PackedBlockFloats(int64_t rows, int64_t cols, int vl) {
  return (cols + 2 * vl - 1) / (2 * vl) * PanelStride(rows, vl);
}

// Unit row weights for a streaming kernel's epilogue (its sums, exact).
inline constexpr float kStreamUnitWeights[kMaxStreamRows] = {1, 1, 1, 1, 1, 1};

// A format code that reached a kernel it has no case in: a bug (the decoder
// refuses unknown codes by name first); never a silent fallback.
[[noreturn]] inline void FormatHasNoKernel(const char* where, abi::WeightFormat f) {
  std::fprintf(stderr, "jax_nbx internal error: weight format code %d reached %s, which has no "
               "case for it\n", static_cast<int>(f), where);
  std::abort();
}


struct KernelTable {
  const char* isa;  // "avx512", "avx2", "generic"
  int vl;           // floats per vector
  int mr;           // rows per packed m-panel
  // Blocking parameters of the drivers (gemm_driver.h), per instruction set
  // as BLIS keeps them beside its kernels:
  int kc;            // weight rows per packed K-block
  int nc;            // output columns per work item (a multiple of 2*vl;
                     // kMaxStreamCols is a multiple of it)
  int chunk_panels;  // m-panels per work item of the forward's GEMMs
  // GEMM1, packed, one K-block of K rows: out[r*rs + c*cs] = act(a@gate)*(a@up),
  // r < rows, c < cols <= vl; `c` holds mr * 2vl partial sums (PartialFlags).
  // `scale` (int8 experts, else null): the vl gate then vl up column scales,
  // applied to the sums before the activation.
  void (*gemm1)(const float* a, const float* b, int64_t K, const Glu& act, int rows, int cols,
                float* out, int64_t rs, int64_t cs, float* c, int flags, const float* scale);
  // GEMM2, packed, one K-block: out[r*rs + c] = w[r] * (a@down), r < rows,
  // c < cols <= 2*vl; partial sums as gemm1; `scale`: 2vl column scales or null.
  void (*gemm2)(const float* a, const float* b, int64_t K, const float* w, int rows,
                int cols, float* out, int64_t rs, float* c, int flags, const float* scale);
  // Streaming (decode), rows <= 6 rows a[kk*as + r], weights read in place
  // ([0] float32, [1] bfloat16 bits), `acc` scratch of 2 * rows * ncols floats.
  void (*stream1[2])(const float* a, int64_t as, int rows, const void* wg, const void* wu,
                     int64_t ld, int64_t K, int ncols, const Glu& act, float* acc, float* out,
                     int64_t rs, int64_t cs);
  void (*stream2[2])(const float* a, int64_t as, int rows, const void* wd, int64_t ld,
                     int64_t K, int ncols, const float* w, float* acc, float* out,
                     int64_t rs);
  // Quantized experts.  Streaming: as stream1/stream2, the weights being the
  // columns [n0, n0+ncols) of quantized matrices, dequantized in registers.
  void (*qstream1)(const float* a, int64_t as, int rows, const QuantMatrix* wg,
                   const QuantMatrix* wu, int64_t n0, int64_t K, int ncols, const Glu& act,
                   float* acc, float* out, int64_t rs, int64_t cs);
  void (*qstream2)(const float* a, int64_t as, int rows, const QuantMatrix* wd, int64_t n0,
                   int64_t K, int ncols, const float* w, float* acc, float* out, int64_t rs);
  // Packing: rows [k0, k0+kc) of columns [n0, n0+nc) as float32 (int8: q,
  // unscaled: gemm1/gemm2 apply the scales; int4: dequantized) into panels
  // `width` (vl or 2vl) columns wide, zero-padded: column n0 + p*width + j of
  // row k0 + i goes to dst[p*ps + i*rs + j].
  void (*qpack)(const QuantMatrix* m, int64_t k0, int kc, int64_t n0, int nc, int width,
                float* dst, int64_t rs, int64_t ps);
  // precision="int8" (int8 and int4 experts only): qstream1 / qstream2 in the
  // int8 arithmetic (kernels_qdot.h: the rows quantized to int8 in blocks of
  // abi::kInt8Block, integer sums), every row count and ISA the same bits.
  void (*qdot1)(const float* a, int64_t as, int rows, const QuantMatrix* wg,
                const QuantMatrix* wu, int64_t n0, int64_t K, int ncols, const Glu& act,
                float* acc, float* out, int64_t rs, int64_t cs);
  void (*qdot2)(const float* a, int64_t as, int rows, const QuantMatrix* wd, int64_t n0,
                int64_t K, int ncols, const float* w, float* acc, float* out, int64_t rs);
  // The gated unit on sums stored by a GEMM1 without its epilogue (experts
  // with biases; an interleaved gate||up streamed as one matrix):
  // out[r*rs + c*cs] = act(g[r*gs + c*gcs] + bg[c], u[r*gs + c*gcs] + bu[c])
  // for r < rows, c < cols; bg, bu may be null (no bias).
  void (*glu)(const float* g, const float* u, int64_t gs, int64_t gcs, int rows, int cols,
              const float* bg, const float* bu, const Glu& act, float* out, int64_t rs,
              int64_t cs);
  // stream1/stream2 over weights stored by columns (out x in: column c of
  // the logical [K, N] matrix is the contiguous run w[c*ld, c*ld + K)); the
  // same sums, bit for bit, as the packed kernels on those weights.
  void (*stream1_cols[2])(const float* a, int64_t as, int rows, const void* wg, const void* wu,
                          int64_t ld, int64_t K, int ncols, const Glu& act, float* acc,
                          float* out, int64_t rs, int64_t cs);
  void (*stream2_cols[2])(const float* a, int64_t as, int rows, const void* wd, int64_t ld,
                          int64_t K, int ncols, const float* w, float* acc, float* out,
                          int64_t rs);
  // Packing of weights stored by columns ([0] float32, [1] bfloat16 bits):
  // rows [k0, k0+kc) of columns [n0, n0+nc) of ns (1 or 2) matrices, column
  // n of matrix s at m[s] + n*ld, into gemm_driver.h's packed-B micro-panels.
  void (*pack_cols[2])(const void* const* m, int ns, int64_t ld, int64_t k0, int kc, int64_t n0,
                       int nc, float* dst);
  // GEMM1's packing of an interleaved gate||up stored by rows (gate column n
  // at p[k*ld + 2n], up at + 1; [0] float32, [1] bfloat16 bits): rows [k0,
  // k0+kc) of columns [n0, n0+nc) into the packed-B micro-panels.
  void (*pack_pairs[2])(const void* p, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
                        float* dst);
  // Streaming sums (no epilogue) of two runs of ncols columns, w0 and w1
  // (rows ld apart; [0] float32, [1] bfloat16), read in one pass over K:
  // out[r*2*ncols + c] = sum_kk a[kk*as + r] * w0[kk*ld + c], then w1's at
  // + ncols; `acc` scratch of 2 * rows * ncols floats.  A fused gate||up row
  // read once (concatenated: gate run then up run; interleaved: the two
  // halves of the pairs).
  void (*stream_pair[2])(const float* a, int64_t as, int rows, const void* w0, const void* w1,
                         int64_t ld, int64_t K, int ncols, float* acc, float* out);
  // The dot family: the plain table whose blocking (and packed entries)
  // precision="bfloat16" runs on, with the dot kernels of that blocking
  // (ActiveDotKernels); an instruction set's own table names itself.
  const KernelTable* dot_table;
};

// The most words per (pair, row) of any dot table's packed A.
constexpr int kMaxDotAWords = 2;

// The bfloat16 dot-product kernels (kernels_dot.h: VDPBF16PS's arithmetic on
// operands packed as bfloat16 pairs, tests/native/dot_pack.h): packed GEMM1 / GEMM2 of
// one m-panel and one K-block of P pairs of rows, as gemm1 / gemm2 above
// (PartialFlags, the same epilogues; no column scales).
struct DotKernelTable {
  const char* name;  // "avx512_bf16" (the instruction), "fma", "emulated"
  int vl;            // float32 lanes per accumulator (columns per half micro-panel)
  int mr;            // rows per packed m-panel
  int kc;            // rows per K-block (even)
  int a_words;       // packed A's words per (pair, row): PackDotPanel (tests/native/dot_pack.h)
  void (*gemm1)(const uint32_t* a, const uint32_t* b, int64_t P, const Glu& act, int rows,
                int cols, float* out, int64_t rs, int64_t cs, float* c, int flags);
  void (*gemm2)(const uint32_t* a, const uint32_t* b, int64_t P, const float* w, int rows,
                int cols, float* out, int64_t rs, float* c, int flags);
  // Streaming (decode) over bfloat16 weights by rows, as KernelTable's
  // stream1[1] / stream2[1] (a float32, rounded to bfloat16 by the kernel):
  // the bits of gemm1 / gemm2 on the same operands.  The fma tables' own;
  // the instruction's tables hold the fma ones of their width (the
  // documented arithmetic: the same bits where the instruction does what
  // it documents).  Null for the emulation (slow): every expert packs.
  void (*stream1)(const float* a, int64_t as, int rows, const void* wg, const void* wu,
                  int64_t ld, int64_t K, int ncols, const Glu& act, float* acc, float* out,
                  int64_t rs, int64_t cs);
  void (*stream2)(const float* a, int64_t as, int rows, const void* wd, int64_t ld, int64_t K,
                  int ncols, const float* w, float* acc, float* out, int64_t rs);
  // Packed A: rows [k0, k0+kc) of one float32 m-panel (mr rows) as
  // ceil(kc/2) * mr * a_words words -- tests/native/dot_pack.h's PackDotPanel, the same
  // bits, compiled for the table's instruction set.  dst may be a + k0*mr
  // (in place; with a_words = 2 only for an even kc): the forward turns
  // each packing expert's panels into pairs once per GEMM so.
  void (*pack_a)(const float* a, int64_t k0, int kc, uint32_t* dst);
  // Packed B, pack_b[ns - 1]: rows [k0, k0+kc) of columns [n0, n0+nc) of ns
  // bfloat16 row-major matrices m[s] (leading dimension ld) as micro-panels
  // 2vl words wide -- tests/native/dot_pack.h's PackRowsPairs<ns>, the same words,
  // compiled for the table's instruction set.
  void (*pack_b[2])(const void* const* m, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
                    uint32_t* dst);
};

// Defined where the target supports them (x86-64: all three).
const KernelTable* KernelsGeneric();
const KernelTable* KernelsAvx2();
const KernelTable* KernelsAvx512();

// The families of a table's entries, each of which may come from a different
// instruction set (isa.cc): packed (blocking, GEMMs, packing, glu), stream
// (bfloat16 weights streamed: the [1] entries; float16 ones always pack),
// qstream (int8/int4 weights streamed), dot (the blocking
// precision="bfloat16" runs on: dot_table), stream_f32 (float32 weights
// streamed: the [0] entries), qdot (precision="int8": qdot1/2).
enum KernelFamily : int {
  kPacked = 0,
  kStream = 1,
  kQStream = 2,
  kDot = 3,
  kStreamF32 = 4,
  kQDot = 5,
  kNumFamilies = 6
};
const char* KernelFamilyName(int family);

// The table of an instruction set by name ("avx512", "avx2", "generic"), or
// nullptr when the name is unknown or this CPU cannot run it.
const KernelTable* KernelsByName(const char* name);

// The instruction set ("avx512", ...) whose entries `t` holds for `family`.
const char* IsaOfFamily(const KernelTable& t, int family);

// The default per family for a CPU: the best instruction set in `supported`
// ("avx512,avx2,generic"-style) unless a measured rule says otherwise (AMD
// family 19h: AVX2).  `vendor`: CPUID's vendor string; `family`: the display
// family.  A pure function (tests call it with other CPUs' values).
void DefaultFamilies(const char* vendor, int family, const char* supported,
                     const char* out[kNumFamilies]);

// The table in use: the one SelectIsa chose (jax_nbx applies JAX_NBX_ISA
// through it when it loads), else DefaultKernels(): DefaultFamilies for this
// CPU.  SelectIsa takes an instruction set for every family ("avx2") or a
// composition ("packed=avx2,stream=avx512"; families not named keep the
// default's) and returns false with the reason for an unknown name or one
// this CPU lacks.  A composed table's `isa` is its full composition.
const KernelTable* ActiveKernels();
// The table a forward runs on: the active one, or with `bf16_dot`
// (precision="bfloat16") its dot family's; the handler and its workspace
// formula both ask here, so the plan and the call agree.
const KernelTable* ActiveKernels(bool bf16_dot);
const KernelTable* DefaultKernels();
bool SelectIsa(const char* name, std::string* error);
const char* SupportedIsas();  // "avx512,avx2,generic"-style list for this CPU

// The dot-kernel tables, one per blocking (vl, mr) of the packed tables
// (16x12: avx512's; 8x6: avx2's; 4x6: generic's): the emulated ones
// everywhere; on x86-64, the fma ones (16x12 on a CPU that runs the avx512
// table, 8x6 on one that runs avx2's) and the avx512_bf16 ones (16x12 on
// 512-bit registers, 8x6 on 256-bit) on CPUs with AVX-512 F/BW/VL and
// avx512_bf16 (CPUID leaf 7 subleaf 1 EAX bit 5).
const DotKernelTable* DotKernelsEmulated16x12();
const DotKernelTable* DotKernelsEmulated8x6();
const DotKernelTable* DotKernelsEmulated4x6();
const DotKernelTable* DotKernelsFma16x12();          // x86-64 only
const DotKernelTable* DotKernelsFma8x6();            // x86-64 only
const DotKernelTable* DotKernelsAvx512Bf16x16x12();  // x86-64 only
const DotKernelTable* DotKernelsAvx512Bf16x8x6();    // x86-64 only
// Every table this CPU runs.
int NumDotKernelTables();
const DotKernelTable* DotKernelTableAt(int i);
// The table of `name` ("avx512_bf16", "fma", "emulated") for a packed
// table's blocking, or nullptr (unknown name, no such blocking, or a CPU
// without it).
const DotKernelTable* DotKernelsByName(const char* name, int vl, int mr);
// The table the forward's bfloat16 precision uses with packed table `kt`
// (the active table's dot_table):
// the one SelectDotKernels forced, else the first of avx512_bf16, fma and
// emulated that this CPU has for kt's blocking (the emulation when the
// forced one has none).
const DotKernelTable* ActiveDotKernels(const KernelTable& kt);
// "auto" (the fastest this CPU has) or a name SupportedDotKernels lists;
// false with the reason for anything else.
bool SelectDotKernels(const char* name, std::string* error);
// "avx512_bf16,fma,emulated"-style list: the dot kernels this CPU runs.
const char* SupportedDotKernels();

}  // namespace nbx
