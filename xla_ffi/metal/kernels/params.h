// The Metal kernels' parameter blocks (`constant` buffers, set with setBytes):
// the one definition that the MSL sources, the MSL emulation and the host
// code that encodes the dispatches (metal/kernel_calls.cc) all compile.  For
// Apple's compiler it is the first part of the library source (CMake embeds
// params.h followed by every kernels/*.metal: newLibraryWithSource has no
// include path); in C++ it is included before the kernels.  Only `uint` and
// `float` fields: the same layout in MSL and C++ (4 bytes each, no padding).
#ifndef NBX_METAL_KERNEL_PARAMS_H_
#define NBX_METAL_KERNEL_PARAMS_H_

#ifndef __METAL_VERSION__
#include <cstdint>
namespace nbx::metal::params {
using uint = uint32_t;
#endif

// The tiled expert GEMMs (moe_gemm.metal) and the decode GEMVs (moe_gemv.metal).
struct GemmParams {
  uint K;      // reduction length (H for GEMM1, I for GEMM2)
  uint N;      // output columns (I for GEMM1, H for GEMM2)
  uint E;      // experts (table rows of one projection)
  uint mode;   // 0: gate|up + activation; 1: down x routed weight; 2: gate|up raw, out [rows][2N]
               // (g then u: the LoRA path adds the adapters' terms, then nbx_lora_glu)
  uint act;    // the activation code (abi.h Activation)
  uint lda;    // elements between rows of A
  uint tile0;  // first row tile (GEMM) or row (GEMV) of this dispatch: grid.y counts from it
  float alpha;  // kClampedSwiGLU's parameters (the FFI attributes act_alpha, act_limit)
  float limit;
  uint group;   // quantized weights: rows per scale group along K (the attribute group_size;
                // 0 for formats without groups); the format itself is the kernel's variant
};

// The LoRA adapters' kernels (moe_lora.metal; abi.h "LoRA adapters").
struct LoraParams {
  uint K;         // the adapter's input length (H for gate and up, I for down)
  uint N;         // its output columns (I for gate and up, H for down)
  uint r;         // its rank
  uint R;         // floats per row of xa (the ranks' sum)
  uint col;       // this adapter's columns [col, col + r) of xa
  uint lda;       // elements between rows of the input (nbx_lora_xa)
  uint ldo;       // elements between rows of out (nbx_lora_add)
  uint off;       // out's first column (nbx_lora_add: 0, or N for up in g | u)
  uint div;       // rows per entry of row_expert (32: the GEMMs' row tiles; 1: decode rows)
  uint tile0;     // first row of this dispatch: grid.y counts rows from it
  uint weighted;  // nbx_lora_add: 1 multiplies the term by row_weight[row] (down)
  float scale;    // nbx_lora_xa: s = alpha / r
};

// Ordering the slots by expert (moe_order.metal).
struct OrderParams {
  uint S;     // slots
  uint E;     // experts
  uint pad;   // rows per tile (32)
  uint k;     // slots per token (nbx_prepare_rows: token = slot / k)
  uint rows;  // the padded rows' bound MaxPaddedRows(S, E, pad) (nbx_prepare_rows' grid)
};

// The ordered combine (moe_combine.metal): y[t] = sum over j in order of o[slot_row[t k + j]].
struct CombineParams {
  uint H;       // columns
  uint k;       // slots per token
  uint tokens;  // rows of y
};

#ifndef __METAL_VERSION__
}  // namespace nbx::metal::params
#endif
#endif  // NBX_METAL_KERNEL_PARAMS_H_
