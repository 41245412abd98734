// Memory of the native linears (qlinear.cpp, qlinear_packed.cpp) at prefill sizes, where a fresh allocation per
// call is a fresh mmap whose pages are faulted in again at every call:
//   thread_scratch  a per-thread buffer reused from call to call (the token codes, the packed tokens, widened rows)
//   empty_linear_output  the output tensor, with Linux's transparent huge pages asked for where it is large
//
// A prefill linear's output is tens of MB (Qwen2.5-0.5B's gate_up at 4096 tokens: 80 MB). glibc serves such an
// allocation with a fresh mmap every call, so the kernel's first write faults in every 4 KiB page again: measured
// 29 ms per 80 MB against 9-11 ms when the range is madvise(MADV_HUGEPAGE)'d and 3-5 ms to rewrite memory already
// mapped (2026-12-06, an Emerald Rapids KVM guest whose THP mode is "madvise", the common default). On systems
// with THP "always" the advice changes nothing, with "never" it is ignored. FLASHRL_NATIVE_THP=0 turns it off.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "cpu_features.h"

#include <cstddef>
#include <cstdint>
#include <memory>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashrl_native {

// n elements of T in the calling thread's buffer for Tag (one buffer per Tag and thread, so that two uses live at
// once do not share it), 64-byte aligned, grown and never shrunk, not initialized
template <typename T, typename Tag>
inline T* thread_scratch(size_t n) {
  static thread_local std::unique_ptr<T[]> buf;
  static thread_local size_t cap = 0;
  constexpr size_t kPad = 64 / sizeof(T);
  if (n + kPad > cap) {
    buf.reset();  // (the old buffer first: no peak of both)
    buf.reset(new T[n + kPad]);
    cap = n + kPad;
  }
  return reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(buf.get()) + 63) / 64 * 64);
}

inline constexpr int64_t kHugePageBytes = int64_t{2} << 20;
inline constexpr int64_t kHugeAdviceMinBytes = int64_t{4} << 20;  // smaller outputs come from glibc's heap

inline at::Tensor empty_linear_output(int64_t M, int64_t N, const at::TensorOptions& options) {
  at::Tensor y = at::empty({M, N}, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const int64_t thp = env_int("FLASHRL_NATIVE_THP", 1);
  const int64_t bytes = y.numel() * static_cast<int64_t>(y.element_size());
  if (bytes >= kHugeAdviceMinBytes && dispatch_int("FLASHRL_NATIVE_THP", thp) != 0) {
    const auto p = reinterpret_cast<std::uintptr_t>(y.data_ptr());
    const std::uintptr_t lo = (p + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    const std::uintptr_t hi = (p + bytes) / kHugePageBytes * kHugePageBytes;
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advice: a failure changes nothing
  }
#endif
  return y;
}

}  // namespace flashrl_native
