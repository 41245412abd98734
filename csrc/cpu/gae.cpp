// Native CPU kernel for Generalized Advantage Estimation (verl's compute_gae_advantage_return).
//
// Semantics are those of flashrl_kernels/reference/gae.py (the spec), in the canonical form of
// flashrl_kernels/ops/gae.py: flat rewards [N] and values [N] (fp32 / bf16 / fp16, each in its own
// dtype), an optional bool mask [N], int64 cu_seqlens [S+1], float64 lam [S] and critic_lam [S].
//
// One backward pass per sequence carries the next valid value, the advantage recurrence
// (lam) and the returns recurrence (critic_lam) in the same loop:
//   valid j:  delta = r_j + gamma * nv - v_j;  A = delta + gamma lam A;  R = delta + gamma clam R;  nv = v_j
//   masked j: nothing changes (pass-through); both outputs are 0 there.
// The updates are selects, not branches (holes in the mask do not mispredict), and a NaN read at a
// masked position never reaches a carried value. Padding before the first and after the last valid token of
// a sequence is found by scanning the mask 8 bytes at a time and zero-filled; a sequence without holes runs
// a loop that reads no mask. When critic_lam is lam (the same tensor, as the
// wrapper passes it when critic_lam is None) the second recurrence is skipped: R = A.
// Accumulation in double (inputs are read as fp32 values, outputs rounded to fp32 once): at T = 32768,
// gamma = lam = 1 the fp32 loop was 2.2e-6 of max |A| off the float64 spec (verl's own fp32 loop: the same),
// double carries cost nothing measurable. gamma and the lambdas stay double too: an fp32 gamma = 0.999 is
// 1.3e-8 off, which a^k over a 1000-token horizon turns into ~1e-5 of the returns (measured). Sequences are grouped into blocks of about kGaeBlockTokens tokens,
// spread over threads with at::parallel_for (the grouping depends only on cu_seqlens: results are
// deterministic). Whitening: the valid tokens are counted in the same pass, and the sums of A and A^2
// (double) in a second look at the sequence's advantages right after it (still in L1/L2), merged over
// sequences in a fixed order (Chan's pairwise formula: count, mean, M2), then one vectorised apply
// pass (A - mean) * rsqrt(var + 1e-8) over the valid tokens; (count, mean, var) are returned too.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "vec_utils.h"

namespace flashrl_native {
namespace {

constexpr int64_t kGaeBlockTokens = 32768;  // tokens per parallel work item (several sequences when short)
constexpr double kWhitenEps = 1e-8;

struct SeqSums {
  double n = 0.0, s = 0.0, ss = 0.0;  // valid tokens, sum of A, sum of A^2
};

struct GaeArgs {
  const bool* mask;
  const int64_t* cu;
  const double* lam;
  const double* clam;
  double gamma;
  float* adv;
  float* ret;
  SeqSums* sums;  // [S], or null without whitening
};

// Sum and sum of squares of x[a, e) in double, 8 independent accumulators (no add-latency chain); the
// sequence's advantages were just written, so this re-read hits L1/L2. Masked positions hold 0: no mask needed.
inline void sum_squares(const float* __restrict x, int64_t a, int64_t e, double& s_out, double& ss_out) {
  constexpr int kLanes = 8;
  double s[kLanes] = {}, ss[kLanes] = {};
  int64_t j = a;
  for (; j + kLanes <= e; j += kLanes) {
    for (int u = 0; u < kLanes; ++u) {
      const double xv = x[j + u];
      s[u] += xv;
      ss[u] += xv * xv;
    }
  }
  for (; j < e; ++j) {
    const double xv = x[j];
    s[0] += xv;
    ss[0] += xv * xv;
  }
  double st = 0.0, sst = 0.0;
  for (int u = 0; u < kLanes; ++u) {
    st += s[u];
    sst += ss[u];
  }
  s_out = st;
  ss_out = sst;
}

// Mask scans, 8 bytes at a time (a bool tensor holds bytes 0 / 1).
inline uint64_t load8(const bool* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}
inline int64_t first_valid(const bool* m, int64_t a, int64_t e) {  // e when none
  int64_t j = a;
  while (j + 8 <= e && load8(m + j) == 0) j += 8;
  while (j < e && !m[j]) ++j;
  return j;
}
inline int64_t last_valid(const bool* m, int64_t a, int64_t e) {  // a - 1 when none
  int64_t j = e;
  while (j - 8 >= a && load8(m + j - 8) == 0) j -= 8;
  while (j > a && !m[j - 1]) --j;
  return j - 1;
}
inline int64_t count_valid(const bool* m, int64_t a, int64_t e) {
  int64_t c = 0, j = a;
  for (; j + 8 <= e; j += 8) c += __builtin_popcountll(load8(m + j));
  for (; j < e; ++j) c += m[j];
  return c;
}

// The recurrence over [a, e), walked backwards, with terminal 0 after e. MASKED: a mask with holes.
// (Tried: four tokens per step, the multiply-adds composed so that only one per four tokens is on the
// carried chain; measured no faster, 5.2 ms at B=512 T=8192 without a mask on one thread either way, of
// which about 1 ms is the kernel's page faults on the two fresh 16 MB outputs.)
template <typename TR, typename TV, bool MASKED, bool TWO>
void gae_core(const TR* __restrict r, const TV* __restrict v, const GaeArgs& p, int64_t i, int64_t a, int64_t e) {
  // double carries: no error growth over long sequences, at the same speed
  const double g = p.gamma;
  const double gl = g * p.lam[i];
  const double gc = g * p.clam[i];
  const bool* __restrict m = p.mask;
  float* __restrict adv = p.adv;
  float* __restrict ret = p.ret;
  double nv = 0.0, A = 0.0, R = 0.0;
  for (int64_t j = e - 1; j >= a; --j) {
    const double vj = static_cast<float>(v[j]);
    const double delta = static_cast<double>(static_cast<float>(r[j])) + g * nv - vj;
    const double an = delta + gl * A;
    const double rn = TWO ? delta + gc * R : an;
    if constexpr (MASKED) {
      const bool mj = m[j];
      A = mj ? an : A;
      R = mj ? rn : R;
      nv = mj ? vj : nv;
      adv[j] = mj ? static_cast<float>(A) : 0.f;
      ret[j] = mj ? static_cast<float>(R + vj) : 0.f;
    } else {
      A = an;
      R = rn;
      nv = vj;
      adv[j] = static_cast<float>(A);
      ret[j] = static_cast<float>(R + vj);
    }
  }
}

// One sequence [a, e). With a mask: the masked runs before the first and after the last valid token
// (left / right padding) are zero-filled without running the recurrence, and a sequence without holes
// between them runs the mask-free loop. STATS: the valid-token count and the sums of A and A^2 (whitening).
template <typename TR, typename TV, bool MASKED, bool TWO, bool STATS>
void gae_sequence(const TR* r, const TV* v, const GaeArgs& p, int64_t i, int64_t a, int64_t e) {
  int64_t lo = a, hi = e, cnt = e - a;
  if constexpr (MASKED) {
    lo = first_valid(p.mask, a, e);
    hi = lo < e ? last_valid(p.mask, lo, e) + 1 : lo;
    std::memset(p.adv + a, 0, sizeof(float) * (lo - a));
    std::memset(p.ret + a, 0, sizeof(float) * (lo - a));
    std::memset(p.adv + hi, 0, sizeof(float) * (e - hi));
    std::memset(p.ret + hi, 0, sizeof(float) * (e - hi));
    cnt = count_valid(p.mask, lo, hi);
    if (cnt == hi - lo) {
      gae_core<TR, TV, false, TWO>(r, v, p, i, lo, hi);
    } else {
      gae_core<TR, TV, true, TWO>(r, v, p, i, lo, hi);
    }
  } else {
    gae_core<TR, TV, false, TWO>(r, v, p, i, a, e);
  }
  if constexpr (STATS) {
    SeqSums& q = p.sums[i];
    q.n = static_cast<double>(cnt);
    sum_squares(p.adv, lo, hi, q.s, q.ss);
  }
}

template <typename TR, typename TV, bool MASKED, bool TWO, bool STATS>
void run_all(const TR* r, const TV* v, const GaeArgs& p, int64_t nseq, int64_t n) {
  const std::vector<int64_t> blocks = sequence_blocks(p.cu, nseq, n, kGaeBlockTokens);
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) - 1, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (int64_t i = blocks[blk]; i < blocks[blk + 1]; ++i) {
        const int64_t a = std::clamp<int64_t>(p.cu[i], 0, n);
        const int64_t e = std::clamp<int64_t>(p.cu[i + 1], a, n);
        gae_sequence<TR, TV, MASKED, TWO, STATS>(r, v, p, i, a, e);
      }
    }
  });
}

template <typename TR, typename TV>
void dispatch_flags(const TR* r, const TV* v, const GaeArgs& p, int64_t nseq, int64_t n, bool two) {
  const bool masked = p.mask != nullptr, stats = p.sums != nullptr;
#define FLASHRL_GAE_CASE(M, T, S)                                 \
  if (masked == M && two == T && stats == S) {                    \
    run_all<TR, TV, M, T, S>(r, v, p, nseq, n);                   \
    return;                                                       \
  }
  FLASHRL_GAE_CASE(false, false, false)
  FLASHRL_GAE_CASE(false, false, true)
  FLASHRL_GAE_CASE(false, true, false)
  FLASHRL_GAE_CASE(false, true, true)
  FLASHRL_GAE_CASE(true, false, false)
  FLASHRL_GAE_CASE(true, false, true)
  FLASHRL_GAE_CASE(true, true, false)
  FLASHRL_GAE_CASE(true, true, true)
#undef FLASHRL_GAE_CASE
}

template <typename TR>
void dispatch_values(const TR* r, const at::Tensor& values, const GaeArgs& p, int64_t nseq, int64_t n, bool two) {
  switch (values.scalar_type()) {
    case at::kFloat:
      return dispatch_flags(r, values.const_data_ptr<float>(), p, nseq, n, two);
    case at::kBFloat16:
      return dispatch_flags(r, values.const_data_ptr<c10::BFloat16>(), p, nseq, n, two);
    case at::kHalf:
      return dispatch_flags(r, values.const_data_ptr<c10::Half>(), p, nseq, n, two);
    default:
      TORCH_CHECK(false, "gae_forward: values must be float32, bfloat16 or float16, got ", values.scalar_type());
  }
}

// (A - mean) * rstd over the valid tokens; masked tokens keep their 0.
void whiten_apply(float* adv, const bool* mask, int64_t n, float mean, float rstd) {
  at::parallel_for(0, n, kGaeBlockTokens, [&](int64_t a, int64_t b) {
    if (mask == nullptr) {
      const Vec vm(mean), vr(rstd);
      int64_t j = a;
      for (; j + kW <= b; j += kW) ((Vec::loadu(adv + j) - vm) * vr).store(adv + j);
      for (; j < b; ++j) adv[j] = (adv[j] - mean) * rstd;
    } else {
      for (int64_t j = a; j < b; ++j) adv[j] = mask[j] ? (adv[j] - mean) * rstd : 0.f;
    }
  });
}

bool covers_all(const int64_t* cu, int64_t nseq, int64_t n) {
  if (cu[0] != 0 || cu[nseq] != n) return false;
  for (int64_t i = 0; i < nseq; ++i) {
    if (cu[i + 1] < cu[i]) return false;
  }
  return true;
}

// Returns (advantages [N], returns [N], whiten_stats): fp32 [count, mean, unbiased variance] of the advantages
// before whitening when whiten, else empty (the wrapper checks count >= 2 from it, without reducing the mask).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_forward(const at::Tensor& rewards, const at::Tensor& values,
                                                           const std::optional<at::Tensor>& mask,
                                                           const at::Tensor& cu_seqlens, const at::Tensor& lam,
                                                           const at::Tensor& critic_lam, double gamma, bool whiten) {
  constexpr const char* op = "gae_forward";
  const int64_t n = rewards.numel();
  for (const at::Tensor* t : {&rewards, &values}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 1 && t->numel() == n, op,
                ": rewards and values must be contiguous 1-D CPU tensors of the same length");
  }
  const int64_t* cu = check_cu(cu_seqlens, op);
  const int64_t nseq = cu_seqlens.numel() - 1;
  for (const at::Tensor* t : {&lam, &critic_lam}) {
    TORCH_CHECK(t->scalar_type() == at::kDouble && t->is_contiguous() && t->numel() == nseq && t->device().is_cpu(),
                op, ": lam and critic_lam must be contiguous float64 CPU tensors [S]");
  }
  const bool* m = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->numel() == n &&
                    mask->device().is_cpu(),
                op, ": mask must be a contiguous bool CPU tensor with ", n, " entries");
    m = mask->const_data_ptr<bool>();
  }
  const auto f32 = rewards.options().dtype(at::kFloat);
  // tokens outside every sequence exist only with unchecked cu_seqlens: they get 0
  const bool covered = covers_all(cu, nseq, n);
  at::Tensor adv = covered ? at::empty({n}, f32) : at::zeros({n}, f32);
  at::Tensor ret = covered ? at::empty({n}, f32) : at::zeros({n}, f32);
  std::vector<SeqSums> sums(whiten ? nseq : 0);
  GaeArgs p{m, cu, lam.const_data_ptr<double>(), critic_lam.const_data_ptr<double>(), gamma,
            adv.data_ptr<float>(), ret.data_ptr<float>(), whiten ? sums.data() : nullptr};
  const bool two = critic_lam.const_data_ptr<double>() != lam.const_data_ptr<double>();
  switch (rewards.scalar_type()) {
    case at::kFloat:
      dispatch_values(rewards.const_data_ptr<float>(), values, p, nseq, n, two);
      break;
    case at::kBFloat16:
      dispatch_values(rewards.const_data_ptr<c10::BFloat16>(), values, p, nseq, n, two);
      break;
    case at::kHalf:
      dispatch_values(rewards.const_data_ptr<c10::Half>(), values, p, nseq, n, two);
      break;
    default:
      TORCH_CHECK(false, op, ": rewards must be float32, bfloat16 or float16, got ", rewards.scalar_type());
  }
  at::Tensor stats = at::empty({whiten ? 3 : 0}, f32);
  if (whiten) {
    // Chan et al.: merge (count, mean, M2) of the sequences in order (deterministic)
    double cnt = 0.0, mean = 0.0, m2 = 0.0;
    for (const SeqSums& q : sums) {
      if (q.n <= 0.0) continue;
      const double mi = q.s / q.n;
      const double m2i = std::max(q.ss - q.s * mi, 0.0);
      const double tot = cnt + q.n;
      const double d = mi - mean;
      mean += d * (q.n / tot);
      m2 += m2i + d * d * (cnt * q.n / tot);
      cnt = tot;
    }
    const double var = m2 / (cnt - 1.0);  // NaN / inf below 2 valid tokens (the wrapper rejects those)
    const double rstd = 1.0 / std::sqrt(var + kWhitenEps);
    whiten_apply(adv.data_ptr<float>(), m, n, static_cast<float>(mean), static_cast<float>(rstd));
    float* sp = stats.data_ptr<float>();
    sp[0] = static_cast<float>(cnt);
    sp[1] = static_cast<float>(cnt > 0.0 ? mean : std::nan(""));
    sp[2] = static_cast<float>(var);
  }
  return {adv, ret, stats};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def(
      "gae_forward(Tensor rewards, Tensor values, Tensor? mask, Tensor cu_seqlens, Tensor lam, Tensor critic_lam, "
      "float gamma, bool whiten) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) { m.impl("gae_forward", &gae_forward); }

}  // namespace flashrl_native
