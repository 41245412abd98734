// Run-time CPU extension checks of the native quantized linears (qlinear.cpp, qlinear_packed.cpp).
//
// The library is built for the CPU capability torch dispatches to (AVX-512 or AVX2, see
// flashrl_kernels/_native.py); the extensions beyond it (AVX-512 VNNI / BF16 / VBMI, AMX-INT8) are used from
// functions compiled for them and reached only when the CPU has them.
// FLASHRL_NATIVE_CPU_DISABLE=avx512bf16,avx512vnni,avx512vbmi,avxvnni,amx hides extensions (to test and time the fallbacks).
#pragma once

#include <cstdint>
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

// a non-negative integer from the environment, or fallback when unset or not one
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long r = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && r >= 0) ? static_cast<int64_t>(r) : fallback;
}

// A dispatch threshold: `cached` (read once per process), or with FLASHRL_NATIVE_DISPATCH_LIVE=1 the variable read
// again at every call, so that one process can alternate drivers call by call (bench/dispatch_ab.py: on a shared VM
// whose bandwidth moves between processes, the only comparison that held). A measurement mode, not for production.
inline int64_t dispatch_int(const char* name, int64_t cached) {
  static const bool live = env_int("FLASHRL_NATIVE_DISPATCH_LIVE", 0) != 0;
  return live ? env_int(name, cached) : cached;
}

// "avx512bf16", "avx512vnni", "avx512vbmi", "avxvnni" (AVX-VNNI: VEX-encoded vpdpbusd on ymm, Alder Lake and later client
// cores, Sierra Forest; no AVX-512 needed), "amx" (AMX-TILE and AMX-INT8) or "amx_bf16" (AMX-TILE and AMX-BF16)
inline bool cpu_has(const char* what) {
  if (cpu_feature_disabled(std::strcmp(what, "amx_bf16") == 0 ? "amx" : what)) return false;  // "amx": all AMX
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(what, "avx512bf16") == 0) return __builtin_cpu_supports("avx512bf16");
  if (std::strcmp(what, "avx512vnni") == 0) return __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(what, "avx512vbmi") == 0) return __builtin_cpu_supports("avx512vbmi");
  if (std::strcmp(what, "avxvnni") == 0) {  // CPUID.(7,1):EAX bit 4 (read directly: older compilers lack the name)
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1u) && __builtin_cpu_supports("avx2");
  }
  const bool amx_int8 = std::strcmp(what, "amx") == 0, amx_bf16 = std::strcmp(what, "amx_bf16") == 0;
  if (amx_int8 || amx_bf16) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    // CPUID.(7,0):EDX bit 24 AMX-TILE, 25 AMX-INT8, 22 AMX-BF16
    return (d >> 24 & 1u) && (d >> (amx_int8 ? 25 : 22) & 1u);
  }
#endif
  return false;
}

}  // namespace flashrl_native
