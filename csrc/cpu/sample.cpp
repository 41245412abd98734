// One token per row sampled from softmax(logits), by inversion of the row's CDF: the CPU sampler of the
// flashrl vLLM engines (flashrl_kernels/integrations/vllm/sampler.py). Spec:
// flashrl_kernels/reference/sampling.py:
//   e_k = exp(x_k - m), m = max_k x_k,   S = sum_k e_k,   u = U(seed) in [0, 1) (53 bits of splitmix64(seed)),
//   token = min { k : e_0 + ... + e_k > u S }.
// Entries of -inf (top-k / top-p masks) have e_k = 0 and are never drawn. A row with a NaN, or without a finite
// maximum (all -inf, or a +inf), returns the first maximum of its non-NaN entries (0 if none).
//
// vLLM's own CPU sampler draws a SplitMix64 Gumbel variable per vocabulary entry (two logarithms each); this
// needs one exponential per entry and one uniform per row. Two passes read the row: its max (and NaN check),
// then the sums of e_k per block of kBlock entries; the block where the running sum crosses u S is recomputed
// and scanned in double. The e_k of a block come from one function in both passes, so the scan sees the values
// whose sum picked the block; when rounding puts u S between the block's double and vector sums, the block's
// last positive entry is taken (a shift of mass ~1e-7 of the block's, far below sampling noise).
//
// token_logprob_rank(logits, tokens): the sampled token's log-probability log softmax(x)_t and its rank
// #{k : x_k >= x_t} (vLLM's rank: 1 for the likeliest), what a rollout with logprobs=0 returns, from two passes
// over the row (its max and the count, then the exponential sums) instead of a [rows, vocab] log_softmax.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace flashrl_native {
namespace {

constexpr int64_t kBlock = 512;  // entries per block: 2 KiB of fp32 exponentials, L1-resident
static_assert(kBlock % kW == 0, "a block holds whole vectors");

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline double uniform01(int64_t seed) {
  return static_cast<double>(splitmix64(static_cast<uint64_t>(seed)) >> 11) * 0x1.0p-53;
}

// e_k = 2^(x_k c - mc) of the n <= kBlock entries at x into out[0, n), zeros after n up to whole vectors.
template <typename T>
inline int64_t block_exps(const T* x, int64_t n, const Vec& vc, const Vec& vmc, float* out) {
  const Vec lo(kT2Min);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    exp2_clamped(at::vec::clamp_min(at::vec::fmadd(load_f32(x + i), vc, vmc), lo)).store(out + i);
  }
  if (i < n) {
    alignas(64) float buf[kW];
    for (int64_t k = 0; k < kW; ++k) buf[k] = i + k < n ? static_cast<float>(x[i + k]) : kNegInf;
    exp2_clamped(at::vec::clamp_min(at::vec::fmadd(Vec::loadu(buf), vc, vmc), lo)).store(out + i);
    i += kW;
  }
  return i;  // n rounded up to whole vectors; entries past n are exactly 0
}

template <typename T>
int64_t first_max(const T* x, int64_t v) {
  int64_t best = 0;
  float bv = kNegInf;
  bool found = false;
  for (int64_t k = 0; k < v; ++k) {
    const float f = static_cast<float>(x[k]);
    if (std::isnan(f)) continue;
    if (!found || f > bv) {
      best = k;
      bv = f;
      found = true;
    }
  }
  return best;
}

inline bool any_lane_set(const Vec& bits_vec) {
  alignas(64) uint32_t bits[kW];
  bits_vec.store(reinterpret_cast<float*>(bits));
  bool any = false;
  for (int64_t k = 0; k < kW; ++k) any = any || bits[k] != 0;
  return any;
}

// sum of e_k = 2^(x_k c - mc) over the row, block by block (each block's sum into sums[b] when sums is given)
template <typename T>
double block_exp_sums(const T* x, int64_t v, const Vec& vc, const Vec& vmc, double* sums) {
  alignas(64) float e[kBlock];
  double total = 0.0;
  for (int64_t b = 0; b * kBlock < v; ++b) {
    const int64_t nv = block_exps(x + b * kBlock, std::min(kBlock, v - b * kBlock), vc, vmc, e);
    Vec s0(0.f), s1(0.f);
    int64_t k = 0;
    for (; k + 2 * kW <= nv; k += 2 * kW) {
      s0 = s0 + Vec::loadu(e + k);
      s1 = s1 + Vec::loadu(e + k + kW);
    }
    if (k < nv) s0 = s0 + Vec::loadu(e + k);
    const double block = lane_sum(s0 + s1);
    if (sums) sums[b] = block;
    total += block;
  }
  return total;
}

template <typename T>
int64_t sample_row(const T* x, int64_t v, int64_t seed, std::vector<double>& block_sums) {
  // pass 1: the max, and whether the row holds a NaN
  Vec vmax0(kNegInf), vmax1(kNegInf), nan_bits(0.f);
  int64_t i = 0;
  for (; i + 2 * kW <= v; i += 2 * kW) {
    const Vec a = load_f32(x + i), b = load_f32(x + i + kW);
    vmax0 = plain_max(vmax0, a);
    vmax1 = plain_max(vmax1, b);
    nan_bits = nan_bits | (a != a) | (b != b);
  }
  float m = lane_max(plain_max(vmax0, vmax1));
  bool nan = any_lane_set(nan_bits);
  for (; i < v; ++i) {
    const float f = static_cast<float>(x[i]);
    nan = nan || std::isnan(f);
    m = std::max(m, f);
  }
  if (nan || !std::isfinite(m)) return first_max(x, v);

  // pass 2: sum of e_k per block
  const float c = kLog2e;
  const Vec vc(c), vmc(-(m * c));
  const int64_t nblocks = (v + kBlock - 1) / kBlock;
  block_sums.resize(nblocks);
  const double total = block_exp_sums(x, v, vc, vmc, block_sums.data());

  // pass 3: the block where the running sum crosses u S, then the entry inside it
  const double target = uniform01(seed) * total;
  double before = 0.0;
  int64_t b = 0;
  for (; b + 1 < nblocks && before + block_sums[b] <= target; ++b) before += block_sums[b];
  const int64_t n = std::min(kBlock, v - b * kBlock);
  alignas(64) float e[kBlock];
  block_exps(x + b * kBlock, n, vc, vmc, e);
  double run = before;
  int64_t last_positive = -1;
  for (int64_t k = 0; k < n; ++k) {
    if (e[k] > 0.f) {
      run += e[k];
      last_positive = k;
      if (run > target) return b * kBlock + k;
    }
  }
  if (last_positive >= 0) return b * kBlock + last_positive;
  return first_max(x, v);  // unreachable for a finite max: its own block holds an e_k of ~1
}

// log softmax(x)_t (double accumulation) and #{k : x_k >= x_t}; NaN (and the count) for a row with a NaN or
// without a finite max
template <typename T>
std::pair<float, int64_t> logprob_rank_row(const T* x, int64_t v, int64_t t) {
  const float xt = static_cast<float>(x[t]);
  const Vec vt(xt), one(1.f);
  Vec vmax(kNegInf), count(0.f), nan_bits(0.f);
  int64_t i = 0;
  for (; i + kW <= v; i += kW) {
    const Vec a = load_f32(x + i);
    vmax = plain_max(vmax, a);
    count = count + ((a >= vt) & one);  // exact: a lane counts at most v / kW < 2^24
    nan_bits = nan_bits | (a != a);
  }
  float m = lane_max(vmax);
  double n = lane_sum(count);
  bool nan = any_lane_set(nan_bits);
  for (; i < v; ++i) {
    const float f = static_cast<float>(x[i]);
    nan = nan || std::isnan(f);
    m = std::max(m, f);
    n += f >= xt ? 1.0 : 0.0;
  }
  const int64_t rank = static_cast<int64_t>(n);
  if (nan || !std::isfinite(m)) return {std::numeric_limits<float>::quiet_NaN(), rank};
  const double total = block_exp_sums(x, v, Vec(kLog2e), Vec(-(m * kLog2e)), nullptr);
  return {static_cast<float>((static_cast<double>(xt) - m) - std::log(total)), rank};
}

// the checks both ops make of their logits [rows, vocab]
void check_logits(const at::Tensor& logits, const at::Tensor& other, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [rows, vocab], got ", logits.dim(), " dims");
  TORCH_CHECK(logits.device().is_cpu() && other.device().is_cpu(), op, ": CPU tensors only");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(logits.size(1) > 0, op, ": empty vocabulary");
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) == 1, op, ": logits must have unit stride along the vocabulary");
}

// fn(row pointer, r) for every row, in parallel, with the row pointer typed as the logits' dtype
template <typename Fn>
void for_each_row(const at::Tensor& logits, Fn&& fn) {
  const int64_t stride = logits.stride(0);
  auto run = [&](auto* base) {
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) fn(base + r * stride, r);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(logits.const_data_ptr<float>());
  } else if (logits.scalar_type() == at::kBFloat16) {
    run(logits.const_data_ptr<c10::BFloat16>());
  } else {
    run(logits.const_data_ptr<c10::Half>());
  }
}

std::tuple<at::Tensor, at::Tensor> token_logprob_rank(const at::Tensor& logits, const at::Tensor& tokens) {
  check_logits(logits, tokens, "token_logprob_rank");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.size(0) == rows,
              "token_logprob_rank: tokens must be an int64 vector with one entry per row");
  const at::Tensor tok = tokens.contiguous();
  const int64_t* tp = tok.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < v, "token_logprob_rank: token ", tp[r], " of row ", r, " is outside [0, ", v, ")");
  at::Tensor lp = at::empty({rows}, logits.options().dtype(at::kFloat));
  at::Tensor rank = at::empty({rows}, logits.options().dtype(at::kLong));
  float* lpp = lp.data_ptr<float>();
  int64_t* rp = rank.data_ptr<int64_t>();
  for_each_row(logits, [&](const auto* row, int64_t r) { std::tie(lpp[r], rp[r]) = logprob_rank_row(row, v, tp[r]); });
  return {lp, rank};
}

at::Tensor sample_categorical(const at::Tensor& logits, const at::Tensor& seeds) {
  check_logits(logits, seeds, "sample_categorical");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && seeds.size(0) == rows && seeds.is_contiguous(),
              "sample_categorical: seeds must be a contiguous int64 vector with one entry per row");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* s = seeds.const_data_ptr<int64_t>();
  for_each_row(logits, [&](const auto* row, int64_t r) {
    static thread_local std::vector<double> block_sums;
    o[r] = sample_row(row, v, s[r], block_sums);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def("sample_categorical(Tensor logits, Tensor seeds) -> Tensor");
  m.def("token_logprob_rank(Tensor logits, Tensor tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("sample_categorical", &sample_categorical);
  m.impl("token_logprob_rank", &token_logprob_rank);
}

}  // namespace flashrl_native
