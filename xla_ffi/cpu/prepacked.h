// Prepacked weights (abi.h "prepacked weights"): where each K-block of a
// tile sits in a packed buffer, the one packer of a dense block that the
// forward (per call) and the prepack handler (once, cpu/prepack.cc) both run,
// and the check of a buffer's header against the kernels in use.
//
// Per expert, GEMM1's (gate||up: K = H, N = I) or GEMM2's (down: K = I,
// N = H) words are the forward's tiles of `nc` columns in order, each tile's
// K-blocks of `kc` rows in order, each block as the driver packs it
// (gemm_driver.h): ceil(cols / width) micro-panels PanelStride(rows, vl)
// apart, rows = the block's rows (float32) or its pairs (bfloat16 pairs),
// width = vl (GEMM1: vl gate then vl up columns) or 2vl (GEMM2).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "abi.h"
#include "cpu/gemm_driver.h"
#include "cpu/kernels/kernel_table.h"
#include "dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

struct PackedLayout {
  int64_t K = 0, N = 0;
  int vl = 0, kc = 0, nc = 0;
  bool first = true;  // GEMM1 (gate||up), else GEMM2 (down)
  bool dot = false;   // bfloat16 pairs

  PackedLayout(const KernelTable& kt, bool dot_pairs, bool gemm1, int64_t k, int64_t n)
      : K(k), N(n), vl(kt.vl), kc(kt.kc), nc(kt.nc), first(gemm1), dot(dot_pairs) {}
  // GEMM1's (K = H, N = I) or GEMM2's (K = I, N = H) layout of experts of sizes H, I.
  static PackedLayout Of(const KernelTable& kt, bool dot_pairs, bool gemm1, int64_t H, int64_t I) {
    return PackedLayout(kt, dot_pairs, gemm1, gemm1 ? H : I, gemm1 ? I : H);
  }
  int Width() const { return first ? vl : 2 * vl; }
  int64_t Panels(int64_t cols) const { return (cols + Width() - 1) / Width(); }
  // Words of one block of `rows` rows of a tile of `cols` columns.
  int64_t BlockWords(int64_t cols, int64_t rows) const {
    return Panels(cols) * PanelStride(dot ? (rows + 1) / 2 : rows, vl);
  }
  // Words of the K-blocks of a tile of `cols` columns before row k0.
  int64_t BlocksWords(int64_t cols, int64_t k0) const { return (k0 / kc) * BlockWords(cols, kc); }
  int64_t TileWords(int64_t cols) const {
    const int64_t rest = K % kc;
    return BlocksWords(cols, K) + (rest > 0 ? BlockWords(cols, rest) : 0);
  }
  // Where block [k0, k0 + kc) of the tile at column n0 starts in an expert's words.
  int64_t Offset(int64_t n0, int64_t k0) const {
    return n0 / nc * TileWords(nc) + BlocksWords(std::min<int64_t>(nc, N - n0), k0);
  }
  int64_t ExpertWords() const {
    const int64_t full = N / nc, rest = N - full * nc;
    return full * TileWords(nc) + (rest > 0 ? TileWords(rest) : 0);
  }
  // Words of a buffer of E experts, header included.
  int64_t BufferWords(int64_t E) const { return abi::kPackedHeaderWords + E * ExpertWords(); }
  // The header of a buffer of E experts in this layout.
  void WriteHeader(int64_t E, uint32_t* h) const {
    for (int64_t i = 0; i < abi::kPackedHeaderWords; ++i) h[i] = 0;
    h[abi::kPackedFieldMagic] = abi::kPackedMagic;
    h[abi::kPackedFieldGemm] = first ? 1 : 2;
    h[abi::kPackedFieldE] = static_cast<uint32_t>(E);
    h[abi::kPackedFieldK] = static_cast<uint32_t>(K);
    h[abi::kPackedFieldN] = static_cast<uint32_t>(N);
    h[abi::kPackedFieldVl] = static_cast<uint32_t>(vl);
    h[abi::kPackedFieldKc] = static_cast<uint32_t>(kc);
    h[abi::kPackedFieldNc] = static_cast<uint32_t>(nc);
    h[abi::kPackedFieldDot] = dot ? 1 : 0;
    h[abi::kPackedFieldExpertWords] = static_cast<uint32_t>(ExpertWords());
  }
};

// A packed buffer as the forward reads it: expert e's words at base + e * expert_words.
struct PackedWords {
  const uint32_t* base = nullptr;
  int64_t expert_words = 0;
};

// Checks a packed buffer (`what`: "gate_up" or "down") against the layout of
// the kernels in use and E experts; on success `out` points past the header.
inline xla::ffi::Error CheckPacked(xla::ffi::AnyBuffer buf, const PackedLayout& l, int64_t E,
                                   const char* what, PackedWords* out) {
  using xla::ffi::Error;
  const std::string name = std::string("prepacked ") + what + " words";
  if (buf.element_type() != xla::ffi::DataType::U32)
    return Error::InvalidArgument(name + ": expected uint32 (jax_nbx.prepack's output)");
  const int64_t n = static_cast<int64_t>(buf.element_count());
  if (n < abi::kPackedHeaderWords)
    return Error::InvalidArgument(name + ": " + std::to_string(n) + " words, shorter than the header");
  const uint32_t* h = static_cast<const uint32_t*>(buf.untyped_data());
  uint32_t want[abi::kPackedHeaderWords];
  l.WriteHeader(E, want);
  if (h[abi::kPackedFieldMagic] != abi::kPackedMagic)
    return Error::InvalidArgument(name + ": no prepack header (not made by jax_nbx.prepack)");
  static constexpr const char* kFields[] = {"magic", "gemm", "E", "K", "N", "vector lanes",
                                            "K-block rows", "tile columns", "bfloat16 pairs",
                                            "words per expert"};
  for (int f = 1; f <= abi::kPackedFieldExpertWords; ++f)
    if (h[f] != want[f])
      return Error::InvalidArgument(
          name + ": packed with " + kFields[f] + " " + std::to_string(h[f]) +
          ", the kernels in use need " + std::to_string(want[f]) +
          " (prepack again after changing the instruction set, precision or experts)");
  if (n != l.BufferWords(E))
    return Error::InvalidArgument(name + ": " + std::to_string(n) + " words; expected " +
                                  std::to_string(l.BufferWords(E)));
  *out = PackedWords{h + abi::kPackedHeaderWords, l.ExpertWords()};
  return Error::Success();
}

// Packs block [k0, k0 + kc) of columns [n0, n0 + nc) of one expert's dense
// matrices (mats: gate, up for GEMM1; down for GEMM2; element (k, n) at
// k*sk + n*sn) into dst as the forward's driver reads it: bfloat16 pairs
// through the dot table's packer (weights by rows), else float32 panels
// through PackView.
template <typename W, bool first>
void PackDenseBlock(const KernelTable& kt, const DotKernelTable* dot, const W* const* mats,
                    int64_t sk, int64_t sn, int64_t k0, int kc, int64_t n0, int nc, float* dst) {
  constexpr int ns = first ? 2 : 1;
  if (dot != nullptr) {
    if constexpr (std::is_same_v<W, bf16>) {
      const void* mv[2] = {mats[0], first ? mats[1] : nullptr};
      dot->pack_b[ns - 1](mv, sk, k0, kc, n0, nc, reinterpret_cast<uint32_t*>(dst));
    }
  } else {
    PackView<ns>(kt, mats, sk, sn, k0, kc, n0, nc, dst);
  }
}

}  // namespace nbx
