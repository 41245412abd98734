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
// kChunk values; each chunk is converted to fp32 (times 1/T) into a small
// buffer that stays in L1, its max taken, the running accumulators rescaled
// when the max grows (one scalar exp per chunk), then exp(u - m) summed with
// ATen's vectorised exp. Per-chunk partial sums are folded into the row sums,
// which keeps the fp32 summation error small for V ~ 150k. Rows are spread
// over threads with at::parallel_for; each row is reduced by one thread in a
// fixed order, so results do not depend on the number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

namespace flashrl_native {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kChunk = 1024;  // fp32 values per chunk: 4 KiB, L1-resident
static_assert(kChunk % (2 * kW) == 0, "chunk must hold whole vector pairs");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();

template <typename T>
inline Vec load_f32(const T* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}
template <>
inline Vec load_f32<float>(const float* p) {
  return Vec::loadu(p);
}

// Two fp32 vectors (2 * kW values) converted and stored to `dst` in T.
template <typename T>
inline void store_pair(T* dst, const Vec& a, const Vec& b) {
  at::vec::convert_from_float<T>(a, b).store(dst);
}
template <>
inline void store_pair<float>(float* dst, const Vec& a, const Vec& b) {
  a.store(dst);
  b.store(dst + kW);
}

// Max over the lanes of v; NaN if any lane is NaN.
inline float lane_max(const Vec& v) {
  alignas(64) float buf[kW];
  v.store(buf);
  float m = buf[0];
  for (int64_t i = 0; i < kW; ++i) {
    if (std::isnan(buf[i])) return buf[i];
    m = std::max(m, buf[i]);
  }
  return m;
}

inline double lane_sum(const Vec& v) {
  alignas(64) float buf[kW];
  v.store(buf);
  double s = 0.0;
  for (int64_t i = 0; i < kW; ++i) s += buf[i];
  return s;
}

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

int64_t grain_rows(int64_t v) { return std::max<int64_t>(1, (int64_t{1} << 15) / v); }

// ---------------------------------------------------------------- forward

struct RowStats {
  float lse, logp, ent;
};

template <typename T, bool ENTROPY>
RowStats forward_row(const T* x, int64_t v, float inv_t, int64_t tgt) {
  alignas(64) float buf[kChunk];
  const Vec vinv(inv_t);
  float m = kNegInf;  // running max of u
  Vec s_acc(0.f), w_acc(0.f);  // sums relative to m_ref = (m == -inf ? 0 : m)
  bool nan_seen = false;
  for (int64_t c0 = 0; c0 < v; c0 += kChunk) {
    const int64_t n = std::min(kChunk, v - c0);
    const int64_t nv = (n + kW - 1) / kW * kW;
    const T* xc = x + c0;
    Vec vmax0(kNegInf), vmax1(kNegInf);
    int64_t i = 0;
    for (; i + 2 * kW <= n; i += 2 * kW) {
      const Vec u0 = load_f32(xc + i) * vinv;
      const Vec u1 = load_f32(xc + i + kW) * vinv;
      u0.store(buf + i);
      u1.store(buf + i + kW);
      vmax0 = at::vec::maximum(vmax0, u0);
      vmax1 = at::vec::maximum(vmax1, u1);
    }
    if (i < nv) {  // the row's tail: scalar conversion, padded with -inf
      for (int64_t k = i; k < n; ++k) buf[k] = static_cast<float>(xc[k]) * inv_t;
      for (int64_t k = n; k < nv; ++k) buf[k] = kNegInf;
      for (; i < nv; i += kW) vmax0 = at::vec::maximum(vmax0, Vec::loadu(buf + i));
    }
    const float cm = lane_max(at::vec::maximum(vmax0, vmax1));
    if (std::isnan(cm)) {
      nan_seen = true;
      continue;
    }
    if (cm > m) {
      if (m != kNegInf) {  // before the first finite max every sum is exactly 0
        const float a = std::exp(m - cm);
        if (ENTROPY) w_acc = (w_acc + s_acc * Vec(m - cm)) * Vec(a);
        s_acc = s_acc * Vec(a);
      }
      m = cm;
    }
    const Vec mref(m == kNegInf ? 0.f : m);
    const Vec lowest(kLowest);
    Vec s0(0.f), s1(0.f), w0(0.f), w1(0.f);
    int64_t j = 0;
    for (; j + 2 * kW <= nv; j += 2 * kW) {
      const Vec d0 = Vec::loadu(buf + j) - mref;
      const Vec d1 = Vec::loadu(buf + j + kW) - mref;
      const Vec e0 = d0.exp_u20();
      const Vec e1 = d1.exp_u20();
      s0 = s0 + e0;
      s1 = s1 + e1;
      if (ENTROPY) {  // clamp keeps e * (u - m) = 0 where u = -inf
        w0 = at::vec::fmadd(e0, at::vec::clamp_min(d0, lowest), w0);
        w1 = at::vec::fmadd(e1, at::vec::clamp_min(d1, lowest), w1);
      }
    }
    for (; j < nv; j += kW) {
      const Vec d0 = Vec::loadu(buf + j) - mref;
      const Vec e0 = d0.exp_u20();
      s0 = s0 + e0;
      if (ENTROPY) w0 = at::vec::fmadd(e0, at::vec::clamp_min(d0, lowest), w0);
    }
    s_acc = s_acc + (s0 + s1);
    if (ENTROPY) w_acc = w_acc + (w0 + w1);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (nan_seen) return RowStats{nan, nan, nan};
  const float m_ref = m == kNegInf ? 0.f : m;
  const double s = lane_sum(s_acc);
  const float log_s = static_cast<float>(std::log(s));
  RowStats r;
  r.lse = m_ref + log_s;
  if (tgt >= 0 && tgt < v) {
    r.logp = (static_cast<float>(x[tgt]) * inv_t - m_ref) - log_s;
  } else {
    r.logp = nan;
  }
  r.ent = ENTROPY ? static_cast<float>(static_cast<double>(log_s) - lane_sum(w_acc) / s) : 0.f;
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

// grad row = g_lp (1[k=y] - p) / T  -  g_h p (log p + H) / T,  p = exp(u - lse)
template <typename T, bool ENTROPY>
void backward_row(const T* x, T* g, int64_t v, float inv_t, int64_t y, float lse, float g_lp, float g_h, float h) {
  const Vec vinv(inv_t), vlse(lse), lowest(kLowest);
  const Vec c_lp(-g_lp * inv_t);  // coefficient of p
  const Vec c_h(-g_h * inv_t);    // coefficient of p (log p + H)
  const Vec vh(h);
  auto grad_of = [&](const Vec& u) {
    const Vec lp = u - vlse;
    const Vec p = lp.exp_u20();
    Vec out = p * c_lp;
    if (ENTROPY) out = at::vec::fmadd(p * c_h, at::vec::clamp_min(lp, lowest) + vh, out);
    return out;
  };
  int64_t k = 0;
  for (; k + 2 * kW <= v; k += 2 * kW) {
    const Vec u0 = load_f32(x + k) * vinv;
    const Vec u1 = load_f32(x + k + kW) * vinv;
    store_pair<T>(g + k, grad_of(u0), grad_of(u1));
  }
  if (k < v) {  // tail through a padded buffer
    alignas(64) float ubuf[2 * kW];
    alignas(64) T gbuf[2 * kW];
    const int64_t n = v - k;
    for (int64_t i = 0; i < 2 * kW; ++i) ubuf[i] = i < n ? static_cast<float>(x[k + i]) * inv_t : kNegInf;
    store_pair<T>(gbuf, grad_of(Vec::loadu(ubuf)), grad_of(Vec::loadu(ubuf + kW)));
    std::memcpy(g + k, gbuf, n * sizeof(T));
  }
  // the target's one-hot term, recomputed in fp32 for that entry
  const float u = static_cast<float>(x[y]) * inv_t;
  const float lp = u - lse;
  const float p = std::exp(lp);
  float gy = -g_lp * inv_t * p + g_lp * inv_t;
  if (ENTROPY) gy += -g_h * inv_t * p * (std::max(lp, kLowest) + h);
  g[y] = static_cast<T>(gy);
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
