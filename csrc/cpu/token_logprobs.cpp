// Native CPU kernels for token log-probabilities and entropy.
//
// Semantics are those of flashrl_kernels/reference/logprobs.py (the spec) and
// of the other backends (torch_impl/logprobs.py, triton_impl/logprobs.py):
//   u      = z / T                       (z: one row of logits, T: temperature)
//   lse    = log sum_k exp(u_k)
//   logp   = u[y] - lse                   NaN when y is outside [0, V)
//   H      = log s - w / s,  s = sum_k exp(u_k - m),  w = sum_k exp(u_k - m) (u_k - m)
// Rows whose target equals ignore_index give logp = H = 0 and no gradient; the
// kernel skips them entirely (their lse, an internal output, is set to 0).
// Backward (one pass per row, gradient written in the logits dtype):
//   dlogp/dz_k = (1[k = y] - p_k) / T,   dH/dz_k = -p_k (log p_k + H) / T.
//
// Forward: one pass over each row from memory. The row is walked in chunks of
// kChunk values (L1-resident): the chunk's max is taken, the running
// accumulators are rescaled when the max grows (one scalar exp per chunk),
// then exp(u - m) is summed. Per-chunk partial sums are folded into the row
// sums, which keeps the fp32 summation error small for V ~ 150k. Rows are
// spread over threads with at::parallel_for; each row is reduced by one
// thread in a fixed order, so results do not depend on the number of threads.
//
// The exponentials are computed in base 2: t = x * (log2(e) / T) - m' is one
// fused multiply-add from the raw logit x, then 2^t. On AVX-512 2^t is
// evaluated inline (round, degree-5 polynomial whose coefficients are those of
// ATen's exp_u20 rescaled to base 2, scalef: max relative error 2e-7), on AVX2
// likewise with the power of two built in the exponent bits; on other CPUs it
// falls back to ATen's Vectorized<float>::exp_u20. The rounding of the
// scalar shift m' to fp32 is compensated exactly in the row's result.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashrl_native {
namespace {

constexpr int64_t kChunk = 1024;  // fp32 values per chunk: 4 KiB, L1-resident
static_assert(kChunk % (2 * kW) == 0, "chunk must hold whole vector pairs");

struct RowTargets {
  const int64_t* i64 = nullptr;
  const int32_t* i32 = nullptr;
  int64_t operator[](int64_t r) const { return i64 ? i64[r] : static_cast<int64_t>(i32[r]); }
};

RowTargets row_targets(const at::Tensor& targets) {
  RowTargets t;
  if (targets.scalar_type() == at::kLong) {
    t.i64 = targets.const_data_ptr<int64_t>();
  } else {
    t.i32 = targets.const_data_ptr<int32_t>();
  }
  return t;
}

struct RowsView {
  int64_t n, t_len, v, stride_b, stride_t;
  int64_t offset(int64_t row) const {
    const int64_t b = row / t_len;
    return b * stride_b + (row - b * t_len) * stride_t;
  }
};

RowsView check_rows(const at::Tensor& logits, const at::Tensor& targets, const char* op) {
  TORCH_CHECK(logits.dim() == 3, op, ": logits must be a [B, T, V] view, got ", logits.dim(), " dims");
  TORCH_CHECK(logits.device().is_cpu() && targets.device().is_cpu(), op, ": CPU tensors only");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(targets.scalar_type() == at::kLong || targets.scalar_type() == at::kInt, op,
              ": targets must be int64 or int32");
  const int64_t v = logits.size(2);
  TORCH_CHECK(v > 0, op, ": empty vocabulary");
  TORCH_CHECK(logits.stride(2) == 1 || v == 1, op, ": logits must have unit stride in the vocabulary dimension");
  TORCH_CHECK(targets.is_contiguous() && targets.numel() == logits.size(0) * logits.size(1), op,
              ": targets must be contiguous with one entry per row");
  return RowsView{logits.size(0) * logits.size(1), logits.size(1), v, logits.stride(0), logits.stride(1)};
}

// The gradient is as large as the logits and freshly allocated: first-touch page faults
// on 4 KiB pages cost more than the kernel itself (the kernel zeroes every page).
// Asking for transparent huge pages on the buffer (a hint; a no-op where THP is
// off) cuts that cost several-fold. torch does the same for all its allocations
// when THP_MEM_ALLOC_ENABLE=1. FLASHRL_NATIVE_HUGEPAGES=0 turns the hint off.
void advise_huge_pages(void* ptr, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* e = std::getenv("FLASHRL_NATIVE_HUGEPAGES");
    return !(e != nullptr && e[0] == '0');
  }();
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (!enabled || bytes < 4 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

int64_t grain_rows(int64_t v) { return std::max<int64_t>(1, (int64_t{1} << 15) / v); }

// ---------------------------------------------------------------- forward

struct RowStats {
  float lse, logp, ent;
};

template <typename T, bool ENTROPY>
RowStats forward_row(const T* x, int64_t v, float inv_t, int64_t tgt) {
  const float c = static_cast<float>(kLog2e * static_cast<double>(inv_t));
  RowAcc acc;
  const int64_t full = v / kChunk * kChunk;
  for (int64_t c0 = 0; c0 < full; c0 += kChunk) online_chunk<ENTROPY>([x, c0](int64_t i) { return load_f32(x + c0 + i); }, kChunk, c, acc);
  if (full < v) {  // the tail: fp32 copy padded with -inf to whole vectors
    alignas(64) float buf[kChunk];
    const int64_t n = v - full;
    const int64_t nv = (n + kW - 1) / kW * kW;
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(x[full + k]);
    for (int64_t k = n; k < nv; ++k) buf[k] = kNegInf;
    online_chunk<ENTROPY>([&buf](int64_t i) { return Vec::loadu(buf + i); }, nv, c, acc);
  }
  const double m_ref = acc.m == kNegInf ? 0.0 : acc.m;
  // t was computed against mc = fl(m_ref * c) instead of m_ref * log2(e) / T:
  // s = sum 2^(x c - mc), so lse = mc ln2 + ln s (exact up to the sum), with c = fl(log2(e) / T)
  // and lse_true = ln sum exp(x / T); the difference x (c ln2 - 1/T) is below fp32 resolution of x / T.
  const double mc = static_cast<double>(static_cast<float>(m_ref * c));
  const double s = lane_sum(acc.s);
  const double lse = mc * kLn2d + std::log(s);
  RowStats r;
  r.lse = static_cast<float>(lse);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  r.logp = (tgt >= 0 && tgt < v) ? static_cast<float>(static_cast<double>(x[tgt]) * inv_t - lse) : nan;
  // H = lse - E[u] = ln s - E[t] ln2 (t relative to mc): E[t] = w / s
  r.ent = ENTROPY ? static_cast<float>(std::log(s) - lane_sum(acc.w) * kLn2d / s) : 0.f;
  return r;
}

template <typename T>
void forward_impl(const at::Tensor& logits, const RowsView& rv, RowTargets tgt, float inv_t,
                  std::optional<int64_t> ignore_index, bool entropy, float* logp, float* ent, float* lse) {
  const T* base = logits.const_data_ptr<T>();
  at::parallel_for(0, rv.n, grain_rows(rv.v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t y = tgt[r];
      if (ignore_index.has_value() && y == *ignore_index) {
        logp[r] = 0.f;
        lse[r] = 0.f;
        if (entropy) ent[r] = 0.f;
        continue;
      }
      const T* x = base + rv.offset(r);
      const RowStats st = entropy ? forward_row<T, true>(x, rv.v, inv_t, y) : forward_row<T, false>(x, rv.v, inv_t, y);
      logp[r] = st.logp;
      lse[r] = st.lse;
      if (entropy) ent[r] = st.ent;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_forward(const at::Tensor& logits,
                                                                      const at::Tensor& targets, double temperature,
                                                                      std::optional<int64_t> ignore_index,
                                                                      bool return_entropy) {
  const RowsView rv = check_rows(logits, targets, "token_logprobs_forward");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), "temperature must be finite and positive");
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({rv.n}, f32);
  at::Tensor lse = at::empty({rv.n}, f32);
  at::Tensor ent = at::empty({return_entropy ? rv.n : 0}, f32);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const RowTargets tgt = row_targets(targets);
  float* ent_p = return_entropy ? ent.data_ptr<float>() : nullptr;
  switch (logits.scalar_type()) {
    case at::kFloat:
      forward_impl<float>(logits, rv, tgt, inv_t, ignore_index, return_entropy, logp.data_ptr<float>(), ent_p,
                          lse.data_ptr<float>());
      break;
    case at::kBFloat16:
      forward_impl<c10::BFloat16>(logits, rv, tgt, inv_t, ignore_index, return_entropy, logp.data_ptr<float>(),
                                  ent_p, lse.data_ptr<float>());
      break;
    default:
      forward_impl<c10::Half>(logits, rv, tgt, inv_t, ignore_index, return_entropy, logp.data_ptr<float>(), ent_p,
                              lse.data_ptr<float>());
  }
  return {logp, ent, lse};
}

// --------------------------------------------------------------- backward

// grad row = g_lp (1[k=y] - p) / T  -  g_h p (log p + H) / T,  p = exp(u - lse).
// p = 2^t * 2^delta with t = x c - lc, c = fl(log2(e) / T), lc = fl(lse log2(e)) and
// delta = lc - lse log2(e) (the rounding of lc, folded into the scalar coefficients).
template <typename T, bool ENTROPY>
void backward_row(const T* x, T* g, int64_t v, float inv_t, int64_t y, float lse, float g_lp, float g_h, float h) {
  const float c = static_cast<float>(kLog2e * static_cast<double>(inv_t));
  const SoftmaxRowGrad<ENTROPY> grad_of(c, inv_t, lse, g_lp, g_h, h);
  int64_t k = 0;
  for (; k + 2 * kW <= v; k += 2 * kW) {
    store_pair<T>(g + k, grad_of(load_f32(x + k)), grad_of(load_f32(x + k + kW)));
  }
  if (k < v) {  // tail through a padded buffer
    alignas(64) float xbuf[2 * kW];
    alignas(64) T gbuf[2 * kW];
    const int64_t n = v - k;
    for (int64_t i = 0; i < 2 * kW; ++i) xbuf[i] = i < n ? static_cast<float>(x[k + i]) : kNegInf;
    store_pair<T>(gbuf, grad_of(Vec::loadu(xbuf)), grad_of(Vec::loadu(xbuf + kW)));
    std::memcpy(static_cast<void*>(g + k), gbuf, n * sizeof(T));
  }
  g[y] = static_cast<T>(target_grad(static_cast<double>(x[y]), inv_t, lse, g_lp, g_h, h, ENTROPY));
}

template <typename T>
void backward_impl(const at::Tensor& logits, const RowsView& rv, RowTargets tgt, float inv_t,
                   std::optional<int64_t> ignore_index, const float* g_lp, const float* g_h, const float* lse,
                   const float* ent, T* grad) {
  const T* base = logits.const_data_ptr<T>();
  at::parallel_for(0, rv.n, grain_rows(rv.v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t y = tgt[r];
      T* g = grad + r * rv.v;
      const bool keep = y >= 0 && y < rv.v && !(ignore_index.has_value() && y == *ignore_index);
      const float glp = keep ? g_lp[r] : 0.f;
      const float gh = (keep && g_h) ? g_h[r] : 0.f;
      if (glp == 0.f && gh == 0.f) {  // ignored rows (and zero upstream gradient): exact zeros
        std::memset(static_cast<void*>(g), 0, rv.v * sizeof(T));
        continue;
      }
      const T* x = base + rv.offset(r);
      if (g_h) {
        backward_row<T, true>(x, g, rv.v, inv_t, y, lse[r], glp, gh, ent[r]);
      } else {
        backward_row<T, false>(x, g, rv.v, inv_t, y, lse[r], glp, 0.f, 0.f);
      }
    }
  });
}

at::Tensor token_logprobs_backward(const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                   const at::Tensor& entropy, double temperature,
                                   std::optional<int64_t> ignore_index) {
  const RowsView rv = check_rows(logits, targets, "token_logprobs_backward");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), "temperature must be finite and positive");
  auto f32_rows = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == rv.n,
                "token_logprobs_backward: ", name, " must be a contiguous float32 tensor with one entry per row");
    return t.const_data_ptr<float>();
  };
  const float* g_lp = f32_rows(grad_logprobs, "grad_logprobs");
  const float* lse_p = f32_rows(lse, "lse");
  const float* g_h = nullptr;
  const float* ent_p = nullptr;
  if (grad_entropy.has_value()) {
    g_h = f32_rows(*grad_entropy, "grad_entropy");
    ent_p = f32_rows(entropy, "entropy");
  }
  at::Tensor grad = at::empty({rv.n, rv.v}, logits.options());
  advise_huge_pages(grad.data_ptr(), grad.nbytes());
  const float inv_t = static_cast<float>(1.0 / temperature);
  const RowTargets tgt = row_targets(targets);
  switch (logits.scalar_type()) {
    case at::kFloat:
      backward_impl<float>(logits, rv, tgt, inv_t, ignore_index, g_lp, g_h, lse_p, ent_p, grad.data_ptr<float>());
      break;
    case at::kBFloat16:
      backward_impl<c10::BFloat16>(logits, rv, tgt, inv_t, ignore_index, g_lp, g_h, lse_p, ent_p,
                                   grad.data_ptr<c10::BFloat16>());
      break;
    default:
      backward_impl<c10::Half>(logits, rv, tgt, inv_t, ignore_index, g_lp, g_h, lse_p, ent_p,
                               grad.data_ptr<c10::Half>());
  }
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def(
      "token_logprobs_forward(Tensor logits, Tensor targets, float temperature, int? ignore_index, "
      "bool return_entropy) -> (Tensor, Tensor, Tensor)");
  m.def(
      "token_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor targets, "
      "Tensor lse, Tensor entropy, float temperature, int? ignore_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("token_logprobs_forward", &token_logprobs_forward);
  m.impl("token_logprobs_backward", &token_logprobs_backward);
}

}  // namespace flashrl_native
