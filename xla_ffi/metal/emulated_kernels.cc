// The Metal kernels compiled as C++ through the MSL emulation (see
// emulated_kernels.h).  Every header comes first: msl_emulation.h's macros
// (`device`, `thread`, ...) are for the .metal sources below only.
#include "metal/emulated_kernels.h"

#include "metal/runtime.h"
#include "metal/sim_device.h"
// -- after this line: the emulation and the kernels, nothing else --
#include "metal/msl_emulation.h"

#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wunknown-attributes"
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wattributes"
#endif
#define NBX_MSL_EMULATION 1

namespace nbx::metal::kernels {
using namespace nbx::metal::msl;
#include "metal/kernels/moe_gemm.metal"
#include "metal/kernels/moe_order.metal"
}  // namespace nbx::metal::kernels

namespace nbx::metal::kernels_drop_barrier {
using namespace nbx::metal::msl;
#define NBX_TEST_DROP_BARRIER 1
#include "metal/kernels/moe_gemm.metal"
#undef NBX_TEST_DROP_BARRIER
}  // namespace nbx::metal::kernels_drop_barrier

#if defined(__clang__)
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace nbx::metal {

bool LaunchMoeGemm(const MoeGemmArgs& g, const std::vector<Buffer>& resources, bool drop_barrier,
                   std::string* error) {
  SimDevice* sim = ActiveSim();
  if (sim == nullptr) {
    *error = "the Metal kernels run off Apple only on the simulated device (JAX_NBX_METAL=sim)";
    return false;
  }
  if (g.P % 32 != 0) {
    *error = "nbx_moe_gemm: P must be a multiple of 32";
    return false;
  }
  const msl::uint3 grid{(g.N + 31) / 32, static_cast<uint32_t>(g.P / 32), 1};
  const int64_t tg_floats = 32 * 8 + 2 * 8 * 32 + 32 * 32;  // As, Bs0, Bs1, Cs
  auto resolve = [sim](uint64_t a, int64_t bytes) -> void* { return sim->Resolve(a, bytes); };
  bool ok = true;
  sim->Submit(resources, [&] {
    ok = msl::Launch(grid, 128, tg_floats, resolve,
                     [&](msl::uint3 tgpig, uint32_t tiitg, uint32_t sgitg, uint32_t tiisg, float* tg) {
                       const kernels::GemmParams p{g.K, g.N, g.E, g.mode, g.act, g.lda};
                       if (drop_barrier) {
                         const kernels_drop_barrier::GemmParams q{g.K, g.N, g.E, g.mode, g.act, g.lda};
                         kernels_drop_barrier::nbx_moe_gemm(g.a, g.row_src, g.tile_expert, g.table,
                                                            g.row_weight, g.out, q, tg, tgpig, tiitg,
                                                            sgitg, tiisg);
                       } else {
                         kernels::nbx_moe_gemm(g.a, g.row_src, g.tile_expert, g.table, g.row_weight,
                                               g.out, p, tg, tgpig, tiitg, sgitg, tiisg);
                       }
                     });
  });
  if (!ok) *error = "nbx_moe_gemm read through an address no resident buffer or pin covers";
  return ok;
}

bool LaunchOrderSlots(const int32_t* ids, int64_t S, int64_t E, int64_t pad, int32_t* count,
                      int32_t* off, int32_t* row_slot, int32_t* slot_row, std::string* error) {
  SimDevice* sim = ActiveSim();
  if (sim == nullptr) {
    *error = "the Metal kernels run off Apple only on the simulated device (JAX_NBX_METAL=sim)";
    return false;
  }
  if (S > INT32_MAX || E < 1 || E > INT32_MAX || pad < 1) {
    *error = "nbx_order_slots: sizes out of range";
    return false;
  }
  const kernels::OrderParams p{static_cast<uint32_t>(S), static_cast<uint32_t>(E),
                               static_cast<uint32_t>(pad)};
  const msl::uint3 per_expert{static_cast<uint32_t>(E), 1, 1};
  auto none = [](uint64_t, int64_t) -> void* { return nullptr; };
  bool ok = true;
  sim->Submit({}, [&] {
    ok = msl::Launch(per_expert, 128, 128, none,
                     [&](msl::uint3 g, uint32_t t, uint32_t sg, uint32_t ts, float* tg) {
                       kernels::nbx_count_experts(ids, count, p, reinterpret_cast<int*>(tg), g, t,
                                                  sg, ts);
                     }) &&
         msl::Launch(msl::uint3{1, 1, 1}, 32, 1, none,
                     [&](msl::uint3 g, uint32_t t, uint32_t sg, uint32_t ts, float* tg) {
                       kernels::nbx_expert_offsets(count, off, p, reinterpret_cast<int*>(tg), g, t,
                                                   sg, ts);
                     }) &&
         msl::Launch(per_expert, 128, 128, none,
                     [&](msl::uint3 g, uint32_t t, uint32_t sg, uint32_t ts, float* tg) {
                       kernels::nbx_scatter_slots(ids, off, row_slot, slot_row, p,
                                                  reinterpret_cast<int*>(tg), g, t, sg, ts);
                     });
  });
  if (!ok) *error = "nbx_order_slots failed";
  return ok;
}

}  // namespace nbx::metal
