// Run-time CPU extension checks of the native quantized linears (qlinear.cpp, qlinear_packed.cpp).
//
// The library is built for the CPU capability torch dispatches to (AVX-512 or AVX2, see
// flashrl_kernels/_native.py); the extensions beyond it (AVX-512 VNNI / BF16, AMX-INT8) are used from
// functions compiled for them and reached only when the CPU has them.
// FLASHRL_NATIVE_CPU_DISABLE=avx512bf16,avx512vnni,amx hides extensions (to test and time the fallbacks).
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace flashrl_native {

inline bool cpu_feature_disabled(const char* what) {
  const char* off = std::getenv("FLASHRL_NATIVE_CPU_DISABLE");
  return off && std::strstr(off, what);
}

// "avx512bf16", "avx512vnni" or "amx" (AMX-TILE and AMX-INT8)
inline bool cpu_has(const char* what) {
  if (cpu_feature_disabled(what)) return false;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(what, "avx512bf16") == 0) return __builtin_cpu_supports("avx512bf16");
  if (std::strcmp(what, "avx512vnni") == 0) return __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(what, "amx") == 0) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d >> 24 & 1u) && (d >> 25 & 1u);  // CPUID.(7,0):EDX AMX-TILE, AMX-INT8
  }
#endif
  return false;
}

}  // namespace flashrl_native
