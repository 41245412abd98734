// Native CPU epilogues for the fused linear log-probabilities (linear_token_logprobs).
//
// The tile loops stay in Python (flashrl_kernels/torch_impl/linear_logprobs.py:
// stats_loop / backward_loop): each [rows, cols] logits tile z = h W[cols]^T is
// one ATen GEMM with an fp32 result; these kernels replace the ~10 elementwise
// torch passes of the torch epilogues (_fwd_epilogue_torch / _bwd_epilogue_torch,
// the spec) with one pass per tile row. Rows are spread over threads with
// at::parallel_for; each row is handled by one thread in a fixed order, so the
// results do not depend on the number of threads.
//
// Forward (linear_fwd_epilogue): u_k = (z_k + b_k) / T over the tile's columns,
// reduced like token_logprobs' forward (chunks of kChunk values, chunk max, one
// scalar rescale when the max grows, exp2 of t = x log2(e)/T - m' by one FMA
// from the biased logit x) into the tile's own (m_t, s_t, w_t), which are then
// merged, in double, into the row's running fp32 statistics in place:
//   m' = max(m, m_t),  s' = s e^(m - m') + s_t e^(m_t - m'),
//   w' = e^(m - m') (w + s (m - m')) + e^(m_t - m') (w_t + s_t (m_t - m')),
// with the reference m' taken as the fp32 value that is stored (so the stored
// m, s, w are consistent to the last bit of m), 0 when m' = -inf, and the
// s (m - m') terms dropped when s = 0 (no -inf * 0). The target's u is picked
// where 0 <= target < cols.
//
// Backward (linear_bwd_epilogue): one pass per row writing, in the output's
// dtype (fp32, bf16 or fp16; fp32 may be z itself, overwritten in place)
//   dZ_k = ( g_lp (1[k = y] - p_k) - g_h p_k (log p_k + H) ) / T,   p_k = e^(u_k - lse),
// with p = 2^t 2^delta as in token_logprobs' backward (delta: the rounding of
// lse log2(e) to fp32, folded into the scalar coefficients) and the target's
// entry recomputed in double. Rows with g_lp = g_h = 0 (ignored targets) are
// written as exact zeros.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

namespace flashrl_native {
namespace {

constexpr int64_t kChunk = 1024;  // fp32 values per chunk: 4 KiB, L1-resident
static_assert(kChunk % (2 * kW) == 0, "chunk must hold whole vector pairs");

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 15) / cols); }

// ---------------------------------------------------------------- checks

void check_tile(const at::Tensor& z, const char* op) {
  TORCH_CHECK(z.device().is_cpu(), op, ": CPU tensors only, got z on ", z.device());
  TORCH_CHECK(z.dim() == 2, op, ": z must be a 2-D [rows, cols] tile, got ", z.dim(), " dims");
  const auto zt = z.scalar_type();
  TORCH_CHECK(zt == at::kFloat || zt == at::kBFloat16 || zt == at::kHalf, op,
              ": z must be float32, bfloat16 or float16, got ", zt);
  TORCH_CHECK(z.size(1) > 0, op, ": empty tile");
  TORCH_CHECK(z.stride(1) == 1 || z.size(1) == 1, op, ": z must have unit stride along its columns");
}

void check_bias(const std::optional<at::Tensor>& bias, int64_t cols, const char* op) {
  if (!bias.has_value()) return;
  const auto dt = bias->scalar_type();
  TORCH_CHECK(bias->device().is_cpu(), op, ": CPU tensors only, got bias on ", bias->device());
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": bias must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cols && bias->is_contiguous(), op,
              ": bias must be a contiguous 1-D tensor of the tile's ", cols, " columns, got shape ", bias->sizes());
}

const int64_t* check_target(const at::Tensor& t, int64_t rows, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": CPU tensors only, got target on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": target must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.numel() == rows, op, ": target must be contiguous with one entry per row (",
              rows, "), got ", t.numel());
  return t.const_data_ptr<int64_t>();
}

void check_rows_f32(const at::Tensor& t, int64_t rows, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": CPU tensors only, got ", name, " on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == rows, op, ": ", name,
              " must be a contiguous float32 tensor with one entry per row (", rows, "), got ", t.scalar_type(),
              " with ", t.numel(), " entries");
}

void check_temperature(double temperature, const char* op) {
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), op, ": temperature must be finite and positive, got ",
              temperature);
}

// f(bias_ptr, has_bias) with bias_ptr typed by the bias dtype (const float* nullptr and false_type when absent).
template <typename F>
void with_bias(const std::optional<at::Tensor>& bias, F&& f) {
  if (!bias.has_value()) {
    f(static_cast<const float*>(nullptr), std::false_type{});
    return;
  }
  switch (bias->scalar_type()) {
    case at::kFloat:
      f(bias->const_data_ptr<float>(), std::true_type{});
      break;
    case at::kBFloat16:
      f(bias->const_data_ptr<c10::BFloat16>(), std::true_type{});
      break;
    default:
      f(bias->const_data_ptr<c10::Half>(), std::true_type{});
  }
}

// f(z_ptr) with z_ptr typed by the tile's dtype (fp32, or the bf16 / fp16 a GEMM wrote).
template <typename F>
void with_tile(const at::Tensor& z, F&& f) {
  switch (z.scalar_type()) {
    case at::kFloat:
      f(z.const_data_ptr<float>());
      break;
    case at::kBFloat16:
      f(z.const_data_ptr<c10::BFloat16>());
      break;
    default:
      f(z.const_data_ptr<c10::Half>());
  }
}

// kW biased logits x = z + b in fp32.
template <typename Z, typename B, bool HAS_BIAS>
inline Vec load_x(const Z* z, const B* b, int64_t i) {
  if constexpr (HAS_BIAS) {
    return load_f32(z + i) + load_f32(b + i);
  } else {
    return load_f32(z + i);
  }
}

// The tail of a row (n < kChunk values from k) as biased fp32 logits, padded with -inf to `padded` values.
template <typename Z, typename B, bool HAS_BIAS>
inline void tail_x(const Z* z, const B* b, int64_t k, int64_t n, int64_t padded, float* buf) {
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = static_cast<float>(z[k + i]);
    if constexpr (HAS_BIAS) buf[i] += static_cast<float>(b[k + i]);
  }
  for (int64_t i = n; i < padded; ++i) buf[i] = kNegInf;
}

// ---------------------------------------------------------------- forward

// Fold the tile row's accumulator into the row's running (m, s, w) (natural-log units, see the top).
template <bool ENTROPY>
inline void merge_row(const RowAcc& acc, float c, float& m, float& s, float& w) {
  constexpr double kNegInfD = -std::numeric_limits<double>::infinity();
  // e^(u - mt) = 2^(x c - mc) up to the rounding of c: the tile's reference in u units is mc ln2
  const double mt = acc.m == kNegInf ? kNegInfD : static_cast<double>(acc.m * c) * kLn2d;
  const double st = lane_sum(acc.s);
  const double mo = m, so = s;
  const double mn = mt > mo ? mt : mo;  // a NaN m stays NaN; a NaN tile max makes s NaN below
  const float mf = static_cast<float>(mn);
  const double ref = mf == kNegInf ? 0.0 : static_cast<double>(mf);
  const double ao = std::exp(mo - ref);
  const double at = std::exp(mt - ref);
  if (ENTROPY) {
    const double wt = lane_sum(acc.w) * kLn2d;
    const double wn = ao * (static_cast<double>(w) + (so > 0 ? so * (mo - ref) : 0.0)) +
                      at * (wt + (st > 0 ? st * (mt - ref) : 0.0));
    w = static_cast<float>(wn);
  }
  s = static_cast<float>(ao * so + at * st);
  m = mf;
}

template <typename Z, typename B, bool HAS_BIAS, bool ENTROPY>
void forward_row(const Z* z, const B* b, int64_t cols, float c, float& m, float& s, float& w) {
  RowAcc acc;
  const int64_t full = cols / kChunk * kChunk;
  for (int64_t c0 = 0; c0 < full; c0 += kChunk) {
    online_chunk<ENTROPY>([z, b, c0](int64_t i) { return load_x<Z, B, HAS_BIAS>(z, b, c0 + i); }, kChunk, c, acc);
  }
  if (full < cols) {  // the tail: biased fp32 copy padded with -inf to whole vectors
    alignas(64) float buf[kChunk];
    const int64_t n = cols - full;
    const int64_t nv = (n + kW - 1) / kW * kW;
    tail_x<Z, B, HAS_BIAS>(z, b, full, n, nv, buf);
    online_chunk<ENTROPY>([&buf](int64_t i) { return Vec::loadu(buf + i); }, nv, c, acc);
  }
  merge_row<ENTROPY>(acc, c, m, s, w);
}

void linear_fwd_epilogue(const at::Tensor& z, const std::optional<at::Tensor>& bias, const at::Tensor& target,
                         double temperature, bool return_entropy, const at::Tensor& m, const at::Tensor& s,
                         const at::Tensor& w, const at::Tensor& zt) {
  constexpr const char* op = "linear_fwd_epilogue";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1), zs = z.stride(0);
  check_bias(bias, cols, op);
  check_temperature(temperature, op);
  const int64_t* tgt = check_target(target, rows, op);
  check_rows_f32(m, rows, op, "m");
  check_rows_f32(s, rows, op, "s");
  check_rows_f32(zt, rows, op, "zt");
  if (return_entropy) check_rows_f32(w, rows, op, "w");
  float* mp = m.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  float* wp = return_entropy ? w.data_ptr<float>() : nullptr;
  float* ztp = zt.data_ptr<float>();
  const float c = static_cast<float>(kLog2e / temperature);
  with_tile(z, [&](const auto* zp) {
  using Z = std::remove_cv_t<std::remove_pointer_t<decltype(zp)>>;
  with_bias(bias, [&](const auto* bp, auto has_bias) {
    using B = std::remove_cv_t<std::remove_pointer_t<decltype(bp)>>;
    constexpr bool HB = decltype(has_bias)::value;
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      float w_unused = 0.f;
      for (int64_t r = begin; r < end; ++r) {
        const Z* zr = zp + r * zs;
        const int64_t y = tgt[r];
        if (y >= 0 && y < cols) {  // the target's u = (z + b) / T, as the torch epilogue rounds it
          float x = static_cast<float>(zr[y]);
          if constexpr (HB) x += static_cast<float>(bp[y]);
          ztp[r] = static_cast<float>(static_cast<double>(x) / temperature);
        }
        if (return_entropy) {
          forward_row<Z, B, HB, true>(zr, bp, cols, c, mp[r], sp[r], wp[r]);
        } else {
          forward_row<Z, B, HB, false>(zr, bp, cols, c, mp[r], sp[r], w_unused);
        }
      }
    });
  });
  });
}

// ---------------------------------------------------------------- backward

template <typename Z, typename B, bool HAS_BIAS, typename TO, bool ENTROPY>
void backward_row(const Z* z, const B* b, TO* g, int64_t cols, float c, double inv_t, int64_t y, float lse,
                  float g_lp, float g_h, float h) {
  // read the target's logit first: g may be z itself
  const bool owned = y >= 0 && y < cols;
  float xy = 0.f;
  if (owned) {
    xy = static_cast<float>(z[y]);
    if constexpr (HAS_BIAS) xy += static_cast<float>(b[y]);
  }
  const SoftmaxRowGrad<ENTROPY> grad_of(c, inv_t, lse, g_lp, g_h, h);
  int64_t k = 0;
  for (; k + 2 * kW <= cols; k += 2 * kW) {
    const Vec a = grad_of(load_x<Z, B, HAS_BIAS>(z, b, k));
    const Vec d = grad_of(load_x<Z, B, HAS_BIAS>(z, b, k + kW));
    store_pair<TO>(g + k, a, d);
  }
  if (k < cols) {  // tail through a padded buffer
    alignas(64) float xbuf[2 * kW];
    alignas(64) TO gbuf[2 * kW];
    const int64_t n = cols - k;
    tail_x<Z, B, HAS_BIAS>(z, b, k, n, 2 * kW, xbuf);
    store_pair<TO>(gbuf, grad_of(Vec::loadu(xbuf)), grad_of(Vec::loadu(xbuf + kW)));
    std::memcpy(static_cast<void*>(g + k), gbuf, n * sizeof(TO));
  }
  if (owned) g[y] = static_cast<TO>(target_grad(xy, inv_t, lse, g_lp, g_h, h, ENTROPY));
}

template <typename Z, typename TO>
void backward_tile(const at::Tensor& z, const std::optional<at::Tensor>& bias, const int64_t* tgt, double temperature,
                   const float* lse, const float* ent, const float* g_lp, const float* g_h, const at::Tensor& out) {
  const int64_t rows = z.size(0), cols = z.size(1), zs = z.stride(0), os = out.stride(0);
  const Z* zp = z.const_data_ptr<Z>();
  TO* op = out.data_ptr<TO>();
  const double inv_t = 1.0 / temperature;
  const float c = static_cast<float>(kLog2e / temperature);
  with_bias(bias, [&](const auto* bp, auto has_bias) {
    using B = std::remove_cv_t<std::remove_pointer_t<decltype(bp)>>;
    constexpr bool HB = decltype(has_bias)::value;
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        TO* g = op + r * os;
        const float glp = g_lp[r];
        const float gh = g_h ? g_h[r] : 0.f;
        if (glp == 0.f && gh == 0.f) {  // ignored rows (and zero upstream gradient): exact zeros
          std::memset(static_cast<void*>(g), 0, cols * sizeof(TO));  // a row is contiguous (unit column stride)
          continue;
        }
        const Z* zr = zp + r * zs;
        if (g_h) {
          backward_row<Z, B, HB, TO, true>(zr, bp, g, cols, c, inv_t, tgt[r], lse[r], glp, gh, ent[r]);
        } else {
          backward_row<Z, B, HB, TO, false>(zr, bp, g, cols, c, inv_t, tgt[r], lse[r], glp, 0.f, 0.f);
        }
      }
    });
  });
}

void linear_bwd_epilogue(const at::Tensor& z, const std::optional<at::Tensor>& bias, const at::Tensor& target,
                         double temperature, const at::Tensor& lse, const at::Tensor& entropy,
                         const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
                         const at::Tensor& out) {
  constexpr const char* op = "linear_bwd_epilogue";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1);
  check_bias(bias, cols, op);
  check_temperature(temperature, op);
  const int64_t* tgt = check_target(target, rows, op);
  check_rows_f32(lse, rows, op, "lse");
  check_rows_f32(grad_logprobs, rows, op, "grad_logprobs");
  const float* g_h = nullptr;
  const float* ent = nullptr;
  if (grad_entropy.has_value()) {
    check_rows_f32(*grad_entropy, rows, op, "grad_entropy");
    check_rows_f32(entropy, rows, op, "entropy");
    g_h = grad_entropy->const_data_ptr<float>();
    ent = entropy.const_data_ptr<float>();
  }
  const auto dt = out.scalar_type();
  TORCH_CHECK(out.device().is_cpu(), op, ": CPU tensors only, got out on ", out.device());
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": out must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == cols, op, ": out must have the tile's shape ",
              z.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.stride(1) == 1 || cols == 1, op, ": out must have unit stride along its columns");
  const float* lse_p = lse.const_data_ptr<float>();
  const float* g_lp = grad_logprobs.const_data_ptr<float>();
  if (z.scalar_type() != at::kFloat) {  // a bf16 / fp16 tile: dZ in the same dtype (usually over z itself)
    TORCH_CHECK(dt == z.scalar_type(), op, ": a ", z.scalar_type(), " tile needs out of the same dtype, got ", dt);
    if (dt == at::kBFloat16) {
      backward_tile<c10::BFloat16, c10::BFloat16>(z, bias, tgt, temperature, lse_p, ent, g_lp, g_h, out);
    } else {
      backward_tile<c10::Half, c10::Half>(z, bias, tgt, temperature, lse_p, ent, g_lp, g_h, out);
    }
    return;
  }
  switch (dt) {
    case at::kFloat:
      backward_tile<float, float>(z, bias, tgt, temperature, lse_p, ent, g_lp, g_h, out);
      break;
    case at::kBFloat16:
      backward_tile<float, c10::BFloat16>(z, bias, tgt, temperature, lse_p, ent, g_lp, g_h, out);
      break;
    default:
      backward_tile<float, c10::Half>(z, bias, tgt, temperature, lse_p, ent, g_lp, g_h, out);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def(
      "linear_fwd_epilogue(Tensor z, Tensor? bias, Tensor target, float temperature, bool return_entropy, "
      "Tensor(a!) m, Tensor(b!) s, Tensor(c!) w, Tensor(d!) zt) -> ()");
  // out may be z itself (fp32 dZ written in place over the logits tile)
  m.def(
      "linear_bwd_epilogue(Tensor z, Tensor? bias, Tensor target, float temperature, Tensor lse, Tensor entropy, "
      "Tensor grad_logprobs, Tensor? grad_entropy, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("linear_fwd_epilogue", &linear_fwd_epilogue);
  m.impl("linear_bwd_epilogue", &linear_bwd_epilogue);
}

}  // namespace flashrl_native
