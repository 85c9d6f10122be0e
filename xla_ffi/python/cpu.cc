// jax_nbx._ffi's bindings of the CPU handlers: their capsules, workspace
// formulas, stage profiling, the instruction-set choice and the prepacked
// buffers' sizes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "abi.h"
#include "account.h"  // SaturatedBytes
#include "common/handler_common.h"  // ProfileStages
#include "cpu/kernels/kernel_table.h"
#include "cpu/moe_backward.h"
#include "cpu/moe_forward.h"
#include "cpu/prepack.h"
#include "python/bindings.h"

namespace nbx::python {

void AddCpuHandlers(nb::dict& d) {
  d[nbx::abi::kTargetForward] = Capsule(nbx::FusedMoeForwardCpu);
  d[nbx::abi::kTargetBackward] = Capsule(nbx::FusedMoeBackwardCpu);
  d[nbx::abi::kTargetPrepack] = Capsule(nbx::PrepackCpu);
}

void BindCpu(nb::module_& m) {
  m.def("set_profile", [](bool on) { nbx::ProfileStages().store(on); },
        "Prints the CPU handlers' stage timings to stderr (JAX_NBX_PROFILE).");

  m.def("forward_workspace_bytes", [](int64_t tokens, int64_t k, int64_t E, int64_t H,
                                      int64_t I, int workers, bool bf16_dot, int64_t lora_rank) {
    CheckFormulaArgs(tokens, k, E, H, I, workers);
    if (lora_rank < 0) throw nb::value_error(("lora_rank must be >= 0, got " + std::to_string(lora_rank)).c_str());
    return nbx::SaturatedBytes(
        nbx::ForwardWorkspaceBytes(tokens, k, E, H, I, workers, bf16_dot, lora_rank));
  }, nb::arg("tokens"), nb::arg("k"), nb::arg("E"), nb::arg("H"), nb::arg("I"),
     nb::arg("workers"), nb::arg("bf16_dot") = false, nb::arg("lora_rank") = 0,
     "Workspace bytes of one CPU forward band of `tokens` tokens (`bf16_dot`: precision='bfloat16'; "
     "`lora_rank`: LoRA adapters of these ranks summed).");
  m.def("backward_workspace_bytes", [](int64_t tokens, int64_t k, int64_t E, int64_t H,
                                       int64_t I, int workers, int64_t lora_rank) {
    CheckFormulaArgs(tokens, k, E, H, I, workers);
    if (lora_rank < 0) throw nb::value_error(("lora_rank must be >= 0, got " + std::to_string(lora_rank)).c_str());
    return nbx::SaturatedBytes(nbx::BackwardWorkspaceBytes(tokens, k, E, H, I, workers, lora_rank));
  }, nb::arg("tokens"), nb::arg("k"), nb::arg("E"), nb::arg("H"), nb::arg("I"),
     nb::arg("workers"), nb::arg("lora_rank") = 0,
     "Workspace bytes of one CPU backward band of `tokens` tokens (`lora_rank`: the adapters' "
     "ranks summed).");
  m.def("cpu_isa", []() { return std::string(nbx::ActiveKernels()->isa); },
        "The instruction set of the CPU micro-kernels in use.");
  m.def("cpu_supported_isas", []() { return std::string(nbx::SupportedIsas()); });
  m.def("cpu_default_isa", []() { return std::string(nbx::DefaultKernels()->isa); },
        "The instruction set (or per-family composition) chosen for this CPU by default.");
  m.def("cpu_isa_families", []() {
    nb::dict d;
    const nbx::KernelTable& t = *nbx::ActiveKernels();
    for (int f = 0; f < nbx::kNumFamilies; ++f)
      d[nbx::KernelFamilyName(f)] = std::string(nbx::IsaOfFamily(t, f));
    return d;
  }, "The instruction set of each kernel family in use.");
  m.def("cpu_default_families", [](const std::string& vendor, int family,
                                   const std::string& supported) {
    const char* out[nbx::kNumFamilies];
    nbx::DefaultFamilies(vendor.c_str(), family, supported.c_str(), out);
    nb::dict d;
    for (int f = 0; f < nbx::kNumFamilies; ++f) d[nbx::KernelFamilyName(f)] = std::string(out[f]);
    return d;
  }, nb::arg("vendor"), nb::arg("family"), nb::arg("supported"),
     "DefaultFamilies for a given CPU (vendor string, display family, supported list).");
  m.def("set_cpu_isa", [](const std::string& name) {
    std::string why;
    if (!nbx::SelectIsa(name.c_str(), &why))
      throw nb::value_error((std::string("cannot use instruction set '") + name + "': " + why +
                             " (this CPU supports: " + nbx::SupportedIsas() + ")").c_str());
  }, nb::arg("name"));
  m.def("cpu_prepacked_words", [](int64_t E, int64_t H, int64_t I, bool bf16_dot, bool gemm1) {
    if (E < 1 || H < 1 || I < 1)
      throw nb::value_error(("prepacked words: E, H and I must be >= 1; got E=" + std::to_string(E) +
                             " H=" + std::to_string(H) + " I=" + std::to_string(I)).c_str());
    return nbx::PrepackedBufferWords(E, H, I, bf16_dot, gemm1);
  }, "Words of jax_nbx.prepack's gate_up (gemm1) or down buffer, header included, kernels in use now.");
  m.def("cpu_dot_kernels", []() {
    return std::string(nbx::ActiveDotKernels(*nbx::ActiveKernels(true))->name);
  }, "The bfloat16 dot-product kernels precision='bfloat16' runs now: 'avx512_bf16', 'fma' or 'emulated'.");
  m.def("cpu_supported_dot_kernels", []() { return std::string(nbx::SupportedDotKernels()); },
        "The bfloat16 dot-product kernels this CPU runs, fastest first ('avx512_bf16,fma,emulated'-style).");
  m.def("set_cpu_dot_kernels", [](const std::string& name) {
    std::string why;
    if (!nbx::SelectDotKernels(name.c_str(), &why)) throw nb::value_error(why.c_str());
  }, nb::arg("name"));
}

}  // namespace nbx::python
