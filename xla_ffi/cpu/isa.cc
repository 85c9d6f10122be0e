// Run-time choice of the micro-kernels' instruction set.
#include <atomic>
#include <cstring>
#include <initializer_list>

#include "cpu/kernel_table.h"

namespace nbx {
namespace {

bool Supports(const char* name) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (std::strcmp(name, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(name, "generic") == 0;
}

const KernelTable* ByName(const char* name) {
#if defined(__x86_64__) || defined(_M_X64)
  if (std::strcmp(name, "avx512") == 0) return KernelsAvx512();
  if (std::strcmp(name, "avx2") == 0) return KernelsAvx2();
#endif
  if (std::strcmp(name, "generic") == 0) return KernelsGeneric();
  return nullptr;
}

const KernelTable* Best() {
  for (const char* n : {"avx512", "avx2", "generic"})
    if (Supports(n)) return ByName(n);
  return KernelsGeneric();
}

std::atomic<const KernelTable*> g_active{nullptr};

}  // namespace

const KernelTable* KernelsByName(const char* name) {
  return Supports(name) ? ByName(name) : nullptr;
}

bool SelectIsa(const char* name, const char** error) {
  const KernelTable* t = ByName(name);
  if (t == nullptr) {
    *error = "unknown instruction set (expected avx512, avx2 or generic)";
    return false;
  }
  if (!Supports(name)) {
    *error = "this CPU does not support it";
    return false;
  }
  g_active.store(t);
  return true;
}

const KernelTable* ActiveKernels() {
  const KernelTable* t = g_active.load();
  if (t == nullptr) {  // the best this CPU has (JAX_NBX_ISA: Python calls SelectIsa at load)
    t = Best();
    g_active.store(t);
  }
  return t;
}

const char* SupportedIsas() {
  static const char* list = [] {
    static char buf[64] = "";
    for (const char* n : {"avx512", "avx2", "generic"}) {
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
