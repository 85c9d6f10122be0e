// The cross-language contract of jax_nbx, written once.
//
// Everything that Python (jax_nbx/), the C++ handlers (xla_ffi/) and the
// Triton kernels (jax_nbx/backends/cuda/) must agree on lives here: FFI target names,
// activation codes and their constants, weight formats and the order of their
// buffer groups, the CUDA launch-program encoding and its kernel table.  The
// nanobind module exports all of it (`jax_nbx._ffi.abi()`, read by
// jax_nbx/contract.py); Python and Triton read it from there, and
// tests/library/test_contract.py checks every consumer against it.  Change a value
// here and nowhere else.
#pragma once

#include <cstdint>

namespace nbx::abi {

// ---------------------------------------------------------------- targets
// FFI target names (registered by jax_nbx/_registry.py).
// The CPU handlers take every weight format and layout (WeightFormat,
// stacked or per-expert buffers) through one decoder (common/weights.h).
inline constexpr const char* kTargetForward = "nbx_fused_moe_fwd";
inline constexpr const char* kTargetBackward = "nbx_fused_moe_bwd";
inline constexpr const char* kTargetCudaForward = "nbx_fused_moe_fwd_cuda";
inline constexpr const char* kTargetCudaForwardTables = "nbx_fused_moe_fwd_cuda_tables";
// The CUDA backward (dense experts, every group through pointer tables like
// kTargetCudaForwardTables; see "CUDA backward" below).
inline constexpr const char* kTargetCudaBackward = "nbx_fused_moe_bwd_cuda";
// The Metal path (platform "cpu": JAX's CPU client, the handler dispatching
// to the Metal device; metal/moe_metal.cc), the forward's attributes.
inline constexpr const char* kTargetMetalForward = "nbx_fused_moe_fwd_metal";
// The CPU forward's weights packed once into its kernels' layout
// ("prepacked weights" below; cpu/prepack.cc).
inline constexpr const char* kTargetPrepack = "nbx_prepack";

// ---------------------------------------------------------------- activations
// The gated unit glu(gate, up), then @ down.  Decoded as a typed enum
// attribute, with two float attributes `act_alpha` and `act_limit` that only
// kClampedSwiGLU reads (the others ignore them):
//   kSwiGLU        silu(g) * u
//   kGeGLU         gelu_tanh(g) * u
//   kClampedSwiGLU gpt-oss (transformers modeling_gpt_oss.py GptOssExperts):
//                  g' = min(g, limit), u' = clamp(u, -limit, limit),
//                  g' * sigmoid(alpha g') * (u' + 1)
//   kGeGLUErf      gelu(g) * u with the exact erf GELU: 0.5 g (1 + erf(g / sqrt 2))
enum class Activation : int32_t { kSwiGLU = 0, kGeGLU = 1, kClampedSwiGLU = 2, kGeGLUErf = 3 };
inline constexpr int32_t kNumActivations = 4;
inline constexpr const char* kActivationNames[kNumActivations] = {"swiglu", "geglu",
                                                                  "swiglu_clamped", "geglu_erf"};
// GELU, tanh approximation: 0.5 g (1 + tanh(kGeluC (g + kGeluB g^3))).
inline constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
inline constexpr double kGeluB = 0.044715;
// 1 / sqrt(2): the exact GELU's erf argument scale.
inline constexpr double kInvSqrt2 = 0.7071067811865476;
// kClampedSwiGLU's defaults (gpt-oss: GptOssExperts.alpha, config.swiglu_limit).
inline constexpr double kClampedSwiGLUAlpha = 1.702;
inline constexpr double kClampedSwiGLULimit = 7.0;

// ---------------------------------------------------------------- int8 arithmetic
// precision="int8" (CPU handler; int8 and int4 experts): each row of x, and of
// the intermediate act(x@gate) * (x@up), is quantized to int8 in blocks of
// kInt8Block values along K: amax = max |v| over the block, d = amax / 127,
// q = rint(v * (127 / amax)) in float32 (ties to even; q = 0 and d = 0 where
// amax is 0; d = NaN where the block holds a NaN or an infinity).  The sums
// are exact integer sums of q times the weights' codes per block, scaled in
// float32 (cpu/kernels/kernels_qdot.h has the order); the result is the product of
// the dequantized rows q * d with the dequantized weights, up to float32
// rounding.  int4 group sizes are multiples of kInt8Block.
inline constexpr int64_t kInt8Block = 32;

// ---------------------------------------------------------------- prepacked weights
// jax_nbx.prepack: dense experts' K-blocks packed once (kTargetPrepack) into
// the micro-panels the CPU forward's packed kernels read, which the forward
// (attribute `prepacked`) then reads instead of packing per call.  Two uint32
// buffers, GEMM1's (gate||up) and GEMM2's (down), each a header of
// kPackedHeaderWords words then E experts of `expert_words` words: float32
// bits, or bfloat16 pairs with precision="bfloat16" (cpu/prepacked.h has the
// order of the blocks).  The header names the blocking the words were packed
// for; the forward refuses a buffer whose header does not match the kernels
// in use (another instruction set, precision or shape).
inline constexpr int64_t kPackedHeaderWords = 16;
inline constexpr uint32_t kPackedMagic = 0x5042584eu;  // "NXBP"
enum PackedField : int32_t {
  kPackedFieldMagic = 0,
  kPackedFieldGemm = 1,   // 1: gate||up, 2: down
  kPackedFieldE = 2,
  kPackedFieldK = 3,      // rows of each matrix (H, or I)
  kPackedFieldN = 4,      // columns (I, or H)
  kPackedFieldVl = 5,     // the blocking: vector lanes, K-block rows, tile columns
  kPackedFieldKc = 6,
  kPackedFieldNc = 7,
  kPackedFieldDot = 8,    // 1: bfloat16 pairs (precision="bfloat16")
  kPackedFieldExpertWords = 9,
};

// ---------------------------------------------------------------- weight formats
// The codes of the weight formats (the enum attribute "format", int32), as
// X(enumerator, code, name, Stem): the one list of formats in C++.  What each
// format is -- its parts, their dtypes and shapes, its groups, its
// arithmetic, the backends with kernels for it, its scalar reference -- is in
// formats/<name>.h as k<Stem>Spec and <Stem>Reference; formats/registry.h
// makes its table from this list, and jax_nbx/formats/ reads that table
// (exported with the rest of this contract) and imports the module of each name.
#define NBX_WEIGHT_FORMATS(X)       \
  X(kDense, 0, "dense", Dense)      \
  X(kInt8, 1, "int8", Int8)         \
  X(kInt4, 2, "int4", Int4)         \
  X(kMxfp4, 3, "mxfp4", Mxfp4)      \
  X(kFp8, 4, "fp8", Fp8)            \
  X(kMxfp8, 5, "mxfp8", Mxfp8)      \
  X(kNvfp4, 6, "nvfp4", Nvfp4)
#define NBX_FORMAT_ENUMERATOR(e, code, name, stem) e = code,
enum class WeightFormat : int32_t { NBX_WEIGHT_FORMATS(NBX_FORMAT_ENUMERATOR) };
#undef NBX_FORMAT_ENUMERATOR
#define NBX_FORMAT_NAME(e, code, name, stem) name,
inline constexpr const char* kWeightFormatNames[] = {NBX_WEIGHT_FORMATS(NBX_FORMAT_NAME)};
#undef NBX_FORMAT_NAME
inline constexpr int32_t kNumWeightFormats =
    static_cast<int32_t>(sizeof(kWeightFormatNames) / sizeof(kWeightFormatNames[0]));

// Buffer groups of a call's weights: group g = part * kNumProjections + proj.
// Each group is one stacked [E, ...] buffer or E per-expert buffers.
inline constexpr int32_t kNumProjections = 3;
inline constexpr const char* kProjectionNames[kNumProjections] = {"gate", "up", "down"};
inline constexpr int32_t kNumParts = 3;
inline constexpr const char* kPartNames[kNumParts] = {"q", "scale", "zero"};
inline constexpr int32_t GroupIndex(int32_t part, int32_t proj) {
  return part * kNumProjections + proj;
}

// ---------------------------------------------------------------- weight views
// The CPU handlers and the CUDA tables handler (nbx_fused_moe_fwd_cuda_tables)
// read dense weights in the checkpoint's own layout, in place, through views
// (jax_nbx/experts.py turns a named layout into them):
//   attribute "views" int64[kNumViewFields * kNumProjections]: per projection
//     (gate, up, down) offset, stride_k, stride_n in elements of one expert's
//     array: element (k, n) of its logical matrix (gate and up [H, I], down
//     [I, H]) lies at offset + k*stride_k + n*stride_n.  Gate and up share
//     their strides.  Quantized formats take the plain views only
//     (gate, up (0, I, 1), down (0, H, 1)).
//   attribute "intermediate" int64: I.
//   attribute "fused_gate_up" bool: gate and up are one array; the weight
//     groups are then gate_up, down (the up view indexes the gate_up buffer)
//     and the backward returns one gradient group for both.
//   attribute "has_bias" bool: after the weight groups, three stacked float32
//     buffers gate_bias [E, I], up_bias [E, I], down_bias [E, H]:
//     mlp(x) = glu(x G + bg, x U + bu) D + bd, weighted after the down bias;
//     the backward returns their float32 gradients after the weights'.
//   attribute "expert_store" int64 (CPU forward and backward): 0, or the
//     experts are an expert store's (common/expert_store.h: jax_nbx.loaders.
//     map_moe), per-expert (stacked false): there are then no weight groups
//     (biases and tensor scales follow as usual); the handler leases the
//     experts its ids route to for its run (the store's fetch, called back,
//     reads those it does not hold).
inline constexpr int32_t kNumViewFields = 3;  // offset, stride_k, stride_n
inline constexpr const char* kViewFieldNames[kNumViewFields] = {"offset", "stride_k", "stride_n"};
inline constexpr int32_t kNumBiases = 3;      // gate, up, down

// ---------------------------------------------------------------- LoRA adapters
// The CPU handlers take LoRA adapters on experts of every format (jax_nbx/lora.py),
// and so does the CUDA tables forward (kTargetCudaForwardTables; its backward
// is the reference's VJP):
// per projection p (gate, up, down) with input z and rank r_p > 0,
//   out_p = z W_p + s_p (z A_p) B_p   (before p's bias)
// attribute "lora_ranks" int64 [3]: r_gate, r_up, r_down (0: none);
// attributes "lora_scale_gate", "lora_scale_up", "lora_scale_down" float: s_p.
// Inputs, after the weight groups, biases and tensor scales (CUDA: none): A_p float32
// [E, in, r_p] then B_p float32 [E, r_p, out] for each p with r_p > 0, in
// gate, up, down order.  The backward's results end with their float32
// gradients in the same order and shapes; its attribute "weight_grads"
// (bool) says whether the experts' (and biases') gradients come before them
// (false: frozen experts, no weight gradient computed; quantized experts are
// always frozen).  The backward takes the forward's weight groups (its
// attributes format, group_size, tensor_scales as the forward's).

// ---------------------------------------------------------------- attributes
// Every target's FFI attributes, as X(KIND, name) lists: the handlers' bindings
// expand them into .Attr<type>("name") (attr_types.h maps each KIND to its C++
// type), the exporter gives them to Python, and jax_nbx/contract.py builds
// every call's attributes from them (a missing or unknown name is an error
// there, before XLA sees the call).  KINDs: ACT (Activation, int32 enum),
// FMT (WeightFormat, int32 enum), F32, I64, BOOL, I64S (int64 array), U8S
// (uint8 array).
#define NBX_ATTRS_ACTIVATION(X) X(ACT, activation) X(F32, act_alpha) X(F32, act_limit)
// abi.h "weight views" below.
#define NBX_ATTRS_VIEWS(X) \
  X(I64S, views) X(I64, intermediate) X(BOOL, fused_gate_up) X(BOOL, has_bias)
// abi.h "LoRA adapters" below.
#define NBX_ATTRS_LORA(X) \
  X(I64S, lora_ranks) X(F32, lora_scale_gate) X(F32, lora_scale_up) X(F32, lora_scale_down)
// The CPU forward (kTargetForward; the Metal forward and the tests' twin too).
#define NBX_ATTRS_CPU_FORWARD(X)                                                         \
  NBX_ATTRS_ACTIVATION(X)                                                                \
  X(I64, band_tokens) X(I64, max_workers) X(BOOL, skip_outside) X(I64, num_experts)      \
  X(FMT, format) X(BOOL, stacked) X(I64, group_size) NBX_ATTRS_VIEWS(X) X(BOOL, bf16_dot)   \
  X(BOOL, int8_dot)                                                                      \
  X(BOOL, tensor_scales) NBX_ATTRS_LORA(X) X(BOOL, prepacked) X(I64, expert_store)
// kTargetPrepack: the weights' decoding (as the forward's), x's hidden size
// and the arithmetic the words are packed for.
#define NBX_ATTRS_CPU_PREPACK(X)                                                     \
  X(I64, num_experts) X(FMT, format) X(BOOL, stacked) X(I64, group_size)             \
  NBX_ATTRS_VIEWS(X) X(BOOL, tensor_scales) X(I64, hidden) X(BOOL, bf16_dot)
// The CPU backward (kTargetBackward, and its twin).
#define NBX_ATTRS_CPU_BACKWARD(X)                                                   \
  NBX_ATTRS_ACTIVATION(X)                                                           \
  X(I64, band_tokens) X(I64, max_workers) X(BOOL, skip_outside) X(I64, num_experts) \
  X(BOOL, stacked) NBX_ATTRS_VIEWS(X) NBX_ATTRS_LORA(X) X(BOOL, weight_grads) X(FMT, format) \
  X(I64, group_size) X(BOOL, tensor_scales) X(I64, expert_store)
// Every CUDA target: the program and its kernels ("CUDA launch program" below).
#define NBX_ATTRS_CUDA_PROGRAM(X)                                                     \
  X(U8S, blob) X(I64S, kernels) X(I64S, program) X(I64, workspace_bytes)              \
  X(I64, err_offset) X(I64, err_words) X(BOOL, w_aligned) X(I64, num_experts)         \
  X(I64, check_ids) X(BOOL, graph)
// kTargetCudaForwardTables: the program, then the weights as groups of tables.
// `format` names the groups' format (formats/registry.h: groups = its parts
// x 3 projections, or 2 when fused); the backward takes dense experts.
#define NBX_ATTRS_CUDA_TABLES(X) \
  NBX_ATTRS_CUDA_PROGRAM(X) X(FMT, format) X(I64, groups) X(BOOL, stacked) NBX_ATTRS_VIEWS(X)
// kTargetCudaForwardTables: the tables' attributes and the adapters'.
#define NBX_ATTRS_CUDA_FORWARD_TABLES(X) NBX_ATTRS_CUDA_TABLES(X) NBX_ATTRS_LORA(X)
// kTargetCudaBackward: the tables' attributes and the gradients' dtype.
#define NBX_ATTRS_CUDA_BACKWARD(X) NBX_ATTRS_CUDA_TABLES(X) X(BOOL, grad_f32)
// Each target's list, by the exporter's name for it:
//   X(key, list macro) -- key: the targets dict's key of the target (see above).
#define NBX_TARGET_ATTRS(X)                                                        \
  X(forward, NBX_ATTRS_CPU_FORWARD) X(backward, NBX_ATTRS_CPU_BACKWARD)            \
  X(metal_forward, NBX_ATTRS_CPU_FORWARD) X(cuda_forward, NBX_ATTRS_CUDA_PROGRAM)       \
  X(cuda_forward_tables, NBX_ATTRS_CUDA_FORWARD_TABLES) X(cuda_backward, NBX_ATTRS_CUDA_BACKWARD) \
  X(prepack, NBX_ATTRS_CPU_PREPACK)

// ---------------------------------------------------------------- limits
// Slots (T * k routed pairs) of one call.  The handlers and kernels index
// slots, and the rows they are padded to, with int32: 2^30 slots leave room
// for the padding.  A larger call is refused by name (Python at trace time,
// each CPU handler again at run time, with its padded rows checked too).
inline constexpr int64_t kMaxSlots = int64_t{1} << 30;

// ---------------------------------------------------------------- CUDA launch program
// int64 program: per launch [kernel, gx, gy, gz, nargs] then nargs x
// [kind, index, offset].  Built by jax_nbx/backends/cuda/plan.py, decoded by
// xla_ffi/cuda/program.h.
enum class ArgKind : int64_t { kInput = 0, kOutput = 1, kWorkspace = 2, kTable = 3, kI32 = 4 };
inline constexpr int64_t kNumArgKinds = 5;
inline constexpr int64_t kLaunchHeader = 5;  // kernel, gx, gy, gz, nargs
inline constexpr int64_t kArgFields = 3;     // kind, index, offset
// Inputs of a CUDA call: x, topk_weights, topk_ids, then each weight group's
// first buffer (tables are numbered by group the same way: gate_up, down when
// fused_gate_up), then with has_bias the kNumBiases float32 biases (gate, up,
// down) at kInputGroup0 + groups + j.  The kernels add each view's offset
// themselves (a table holds each expert's whole array) and read its strides.
inline constexpr int64_t kInputX = 0, kInputW = 1, kInputIds = 2, kInputGroup0 = 3;
// The CUDA backward (kTargetCudaBackward): its inputs are the forward's, then
// dy [T, H] in x's dtype at kInputGroup0 + groups (+ kNumBiases with
// has_bias).  Its results: dx [T, H] in x's dtype, d(topk_weights) [T, k]
// float32, then each weight group's float32 gradient buffers (the weights'
// shapes: one per group when stacked, E per group with per-expert lists),
// then with has_bias the kNumBiases float32 bias gradients ([E, I], [E, I],
// [E, H]), then the workspace.  The program's kOutput arguments index dx
// (kOutputDx), d(topk_weights) (kOutputDTopkWeights) and the bias gradients
// (kOutputDBias0 + j); the kernels write the weight gradients through
// pointer tables: table index groups + g holds the E addresses of group g's
// gradient, as table g holds its weights'.  Those gradient tables are the
// first groups * E int64 of the workspace (the handler uploads them there on
// every call; the weights' tables are cached).
inline constexpr int64_t kOutputDx = 0, kOutputDTopkWeights = 1, kOutputDBias0 = 2;
// Kernel table: int64 fields per compiled kernel.
inline constexpr int64_t kNumKernelFields = 7;
inline constexpr const char* kKernelFieldNames[kNumKernelFields] = {
    "name_off", "name_len", "cubin_off", "cubin_len", "num_warps", "shared", "hash"};
// The expert-id check: `err_words` int32 words at the workspace's
// err_offset (one word, filled with kErrNone and lowered by the kernels to
// the smallest bad slot; or one word per slot, each written: its slot if
// bad, else kErrNone); the handler reads the minimum.  The CUDA handlers'
// attribute check_ids says when: kIdCheckOff (never: bad slots are still
// skipped), kIdCheckSync (after the launches, with a stream synchronization:
// the call itself fails), kIdCheckDeferred (an asynchronous copy into pinned
// memory; the next call on the device reads it and fails naming the earlier
// call -- no synchronization on the hot path; a call of more than
// kMaxDeferredErrWords slots, i.e. words, falls back to kIdCheckSync).
inline constexpr int32_t kErrNone = 0x7fffffff;
inline constexpr int64_t kIdCheckOff = 0, kIdCheckSync = 1, kIdCheckDeferred = 2;
inline constexpr int64_t kMaxDeferredErrWords = 64;
// The CUDA handlers' attribute graph (bool; JAX_NBX_CUDA_GRAPHS): the
// program's launches go as one CUDA graph, built once per program shape and
// device and given each call's arguments (xla_ffi/cuda/graphs.cc
// GraphCache), instead of one cuLaunchKernel per launch: the same kernels,
// grids and arguments, in the same order.
inline constexpr int64_t kWorkspaceAlign = 256;  // bytes; every workspace array starts aligned

}  // namespace nbx::abi
