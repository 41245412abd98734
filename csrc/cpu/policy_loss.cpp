// Native CPU kernels for the clipped policy loss (PPO / GRPO / DAPO / GSPO, TIS, KL, entropy).
//
// Semantics are those of flashrl_kernels/reference/policy_loss.py (the spec), in the
// canonical form of flashrl_kernels/ops/policy_loss.py: flat token tensors [N], an
// optional bool mask [N], int64 cu_seqlens [S+1], advantages per sequence [S] or per
// token [N]. The math mirrors triton_impl/policy_loss.py line by line (one program per
// sequence there, one loop iteration per sequence here).
//
// Forward: sequences are grouped into blocks of about kBlockTokens tokens (the grouping
// depends only on cu_seqlens, never on the thread count, so results are deterministic);
// at::parallel_for spreads the blocks over threads. Per sequence:
//   pass 1 (only when a per-sequence value is needed before the token terms: GSPO,
//           sequence TIS, seq-mean-token-mean): valid count, sum of log-ratios,
//           sum of old - rollout log-ratios;
//   pass 2: the token terms, the gradient coefficients g_tok / g_ent and the statistics.
// A sequence is walked in tiles of kTile tokens: each input is converted to fp32 into
// an L1-resident buffer (inputs may mix fp32 / bf16 / fp16), then the token math runs
// on ATen Vectorized<float> lanes with Sleef's 1-ulp exp. Statistics are summed per
// sequence in fp32 lanes, per block and over blocks in double, and returned as one
// fp32 vector of the 19 STAT_NAMES of torch_impl/policy_loss.py; the shared Python
// `finalize` turns it into the loss and the metrics.
//
// Backward: grad_logp = (g_tok + mask * seq_coef[seq]) * grad_loss * scale and
// grad_entropy = g_ent * grad_loss * scale, one streaming pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "vec_utils.h"

namespace flashrl_native {
namespace {

constexpr int64_t kTile = 512;            // tokens per tile: 8 fp32 buffers of 2 KiB stay in L1
constexpr int64_t kBlockTokens = 16384;   // tokens per parallel work item (several sequences when short)
static_assert(kTile % kW == 0, "a tile holds whole vectors");
constexpr float kInf = std::numeric_limits<float>::infinity();

// Statistics columns, in the order of STAT_NAMES (torch_impl/policy_loss.py).
enum Stat : int {
  kNTok, kNSeq, kQ, kClipLow, kClipHigh, kClipDual, kSumR, kMaxR, kMinR, kSumW, kMinW, kMaxW, kNOut,
  kSumMkl, kSumKl, kSumEnt, kSumS, kMinS, kMaxS, kNStats
};
using Stats = std::array<double, kNStats>;

Stats empty_stats() {
  Stats s{};
  s[kMaxR] = s[kMaxW] = s[kMaxS] = -kInf;
  s[kMinR] = s[kMinW] = s[kMinS] = kInf;
  return s;
}

void merge_stats(Stats& into, const Stats& s) {
  for (int c = 0; c < kNStats; ++c) {
    if (c == kMaxR || c == kMaxW || c == kMaxS) {
      into[c] = std::max(into[c], s[c]);
    } else if (c == kMinR || c == kMinW || c == kMinS) {
      into[c] = std::min(into[c], s[c]);
    } else {
      into[c] += s[c];
    }
  }
}

FloatInput float_input(const at::Tensor& t, int64_t n, const char* name) {
  return flashrl_native::float_input(t, n, "policy_loss", name);
}

FloatInput optional_input(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  return t.has_value() ? float_input(*t, n, name) : FloatInput{};
}

inline Vec ones_where(const Vec& m) { return m & Vec(1.f); }  // a compare mask as 1.0 / 0.0
inline Vec select(const Vec& m, const Vec& yes, const Vec& no) { return Vec::blendv(no, yes, m); }

struct Config {
  float lo, hi, dual_c, tis_min, tis_max, beta, ent_coef;
  bool has_dual, tis_mean, seq_mean;
  int level;  // 0 token, 1 sequence, 2 sequence_token
  int tis;    // 0 none, 1 token_truncate, 2 token_mask, 3 sequence_truncate, 4 sequence_mask
  bool need_pass1() const { return level != 0 || tis >= 3 || seq_mean; }
  bool truncate() const { return tis == 1 || tis == 3; }
};

// TIS weight of raw ratios rho (truncate: clamp; mask: zero outside), and the outside mask.
inline Vec tis_weight(const Vec& rho, const Config& c, Vec* outside) {
  const Vec tmin(c.tis_min), tmax(c.tis_max);
  *outside = (rho < tmin) | (rho > tmax);
  if (c.truncate()) return at::vec::minimum(at::vec::maximum(rho, tmin), tmax);
  return select(*outside, Vec(0.f), rho);
}
inline float tis_weight(float rho, const Config& c, bool* outside) {
  *outside = rho < c.tis_min || rho > c.tis_max;
  if (c.truncate()) return std::min(std::max(rho, c.tis_min), c.tis_max);
  return *outside ? 0.f : rho;
}

struct Inputs {
  FloatInput logp, old, adv, roll, ref, ent;
  const bool* mask = nullptr;
  bool adv_per_seq = false;
};

struct Outputs {
  float* g_tok;
  float* g_ent;     // nullptr without entropy
  float* seq_coef;  // nullptr unless level == sequence
};

// One sequence [start, end): writes g_tok / g_ent / seq_coef, merges its statistics into `st`.
void sequence_forward(const Inputs& in, const Config& c, const Outputs& out, int64_t seq, int64_t start, int64_t end,
                      Stats& st) {
  alignas(64) float vb[kTile], lpb[kTile], oldb[kTile], advb[kTile], rollb[kTile], refb[kTile], entb[kTile];
  const Vec zero(0.f), one(1.f);

  // ---- pass 1: per-sequence sums needed before the token terms ----
  double cnt = 0.0, sum_lr = 0.0, sum_tis = 0.0;
  if (c.need_pass1()) {
    Vec vc(0.f), vlr(0.f), vtis(0.f);
    for (int64_t k = start; k < end; k += kTile) {
      const int64_t len = std::min(kTile, end - k);
      valid_tile(in.mask, k, len, vb);
      const float* lpt = in.logp.tile(k, len, lpb);
      const float* oldt = in.old.tile(k, len, oldb);
      const float* rollt = c.tis >= 3 ? in.roll.tile(k, len, rollb) : nullptr;
      for (int64_t i = 0; i < len; i += kW) {
        const Vec v = Vec::loadu(vb + i);
        const Vec valid = v > zero;
        const Vec old = Vec::loadu(oldt + i);
        vc += v;
        vlr += select(valid, Vec::loadu(lpt + i) - old, zero);
        if (c.tis >= 3) vtis += select(valid, old - Vec::loadu(rollt + i), zero);
      }
    }
    cnt = lane_sum(vc);
    sum_lr = lane_sum(vlr);
    sum_tis = lane_sum(vtis);
  }
  float n1 = static_cast<float>(std::max(cnt, 1.0));
  float s = std::exp(static_cast<float>(sum_lr) / n1);
  const float alpha = c.seq_mean ? 1.f / n1 : 1.f;
  float seq_w = 1.f;
  bool seq_out = false;
  if (c.tis >= 3) {
    const float d = c.tis_mean ? static_cast<float>(sum_tis) / n1 : static_cast<float>(sum_tis);
    seq_w = tis_weight(std::exp(d), c, &seq_out);
  }
  const float a_seq = in.adv_per_seq ? in.adv.at(seq) : 0.f;

  // ---- pass 2: token terms, gradient coefficients, statistics ----
  const Vec lo(c.lo), hi(c.hi), dual_c(c.dual_c), beta(c.beta), ent_coef(c.ent_coef);
  const Vec neg_inf(-kInf), pos_inf(kInf), vs(s), va_seq(a_seq), vseq_w(seq_w), valpha(alpha);
  const Vec g_ent_coef(-c.ent_coef * alpha);
  Vec q(0.f), c_low(0.f), c_high(0.f), c_dual(0.f), sum_r(0.f), max_r(-kInf), min_r(kInf);
  Vec sum_w(0.f), max_w(-kInf), min_w(kInf), n_out(0.f), sum_mkl(0.f), sum_kl(0.f), sum_ent(0.f);
  Vec g_seq(0.f), cnt2(0.f), sum_lr2(0.f);
  const bool has_roll = static_cast<bool>(in.roll), has_ref = static_cast<bool>(in.ref);
  const bool has_ent = static_cast<bool>(in.ent);
  for (int64_t k = start; k < end; k += kTile) {
    const int64_t len = std::min(kTile, end - k);
    valid_tile(in.mask, k, len, vb);
    const float* lpt = in.logp.tile(k, len, lpb);
    const float* oldt = in.old.tile(k, len, oldb);
    const float* advt = in.adv_per_seq ? nullptr : in.adv.tile(k, len, advb);
    const float* rollt = has_roll ? in.roll.tile(k, len, rollb) : nullptr;
    const float* reft = has_ref ? in.ref.tile(k, len, refb) : nullptr;
    const float* entt = has_ent ? in.ent.tile(k, len, entb) : nullptr;
    for (int64_t i = 0; i < len; i += kW) {
      const int64_t lanes = std::min(kW, len - i);
      const Vec v = Vec::loadu(vb + i);
      const Vec valid = v > zero;
      const Vec lp = Vec::loadu(lpt + i);
      const Vec old = Vec::loadu(oldt + i);
      const Vec lr = select(valid, lp - old, zero);
      const Vec a = in.adv_per_seq ? va_seq * v : select(valid, Vec::loadu(advt + i), zero);
      const Vec r_tok = exp_vec(lr);
      const Vec r = c.level == 0 ? r_tok : vs;
      const Vec pos = a > zero, neg = a < zero;
      Vec lower = at::vec::maximum(r, lo);
      if (c.has_dual) lower = at::vec::minimum(lower, dual_c);
      const Vec rc = select(pos, at::vec::minimum(r, hi), lower);
      Vec loss = (zero - a) * rc;
      Vec g = select(rc == r, (zero - a) * r, zero);
      c_low += ones_where(neg & (r < lo));
      c_high += ones_where(pos & (r > hi));
      if (c.has_dual) c_dual += ones_where(neg & (r > dual_c));
      if (has_roll) {
        const Vec x = select(valid, old - Vec::loadu(rollt + i), zero);
        const Vec rho = exp_vec(x);
        sum_mkl += rho - one - x;
        if (c.tis == 1 || c.tis == 2) {
          Vec outside;
          const Vec w = tis_weight(rho, c, &outside);
          loss = loss * w;
          g = g * w;
          sum_w += w * v;
          max_w = at::vec::maximum(max_w, select(valid, w, neg_inf));
          min_w = at::vec::minimum(min_w, select(valid, w, pos_inf));
          n_out += ones_where(outside & valid);
        }
      }
      if (c.tis >= 3) {
        loss = loss * vseq_w;
        g = g * vseq_w;
      }
      if (c.level == 1) {
        g_seq += g;
        g = zero;
      }
      if (has_ref) {
        const Vec y = select(valid, Vec::loadu(reft + i) - lp, zero);
        const Vec e = exp_vec(y);
        const Vec kl = e - y - one;
        sum_kl += kl;
        if (c.beta != 0.f) {
          loss = loss + beta * kl;
          g = g + beta * (one - e);
        }
      }
      if (has_ent) {
        const Vec h = select(valid, Vec::loadu(entt + i), zero);
        sum_ent += h;
        if (c.ent_coef != 0.f) loss = loss - ent_coef * h;
        (g_ent_coef * v).store(out.g_ent + k + i, lanes);
      }
      q += loss;
      (g * valpha).store(out.g_tok + k + i, lanes);
      sum_r += r_tok * v;
      max_r = at::vec::maximum(max_r, select(valid, r_tok, neg_inf));
      min_r = at::vec::minimum(min_r, select(valid, r_tok, pos_inf));
      if (!c.need_pass1()) {
        cnt2 += v;
        sum_lr2 += lr;
      }
    }
  }
  if (!c.need_pass1()) {
    cnt = lane_sum(cnt2);
    n1 = static_cast<float>(std::max(cnt, 1.0));
    s = std::exp(static_cast<float>(lane_sum(sum_lr2)) / n1);
  }
  const bool nonempty = cnt > 0;
  Stats row = empty_stats();
  row[kNTok] = cnt;
  row[kNSeq] = nonempty ? 1.0 : 0.0;
  row[kQ] = lane_sum(q) * alpha;
  row[kClipLow] = lane_sum(c_low);
  row[kClipHigh] = lane_sum(c_high);
  row[kClipDual] = lane_sum(c_dual);
  row[kSumR] = lane_sum(sum_r);
  row[kMaxR] = lane_max(max_r);
  row[kMinR] = lane_min(min_r);
  if (c.tis == 0) {
    row[kSumW] = cnt;
    if (nonempty) row[kMinW] = row[kMaxW] = 1.0;
  } else if (c.tis >= 3) {
    row[kSumW] = seq_w * cnt;
    if (nonempty) row[kMinW] = row[kMaxW] = seq_w;
    row[kNOut] = seq_out ? cnt : 0.0;
  } else {
    row[kSumW] = lane_sum(sum_w);
    row[kMinW] = lane_min(min_w);
    row[kMaxW] = lane_max(max_w);
    row[kNOut] = lane_sum(n_out);
  }
  row[kSumMkl] = lane_sum(sum_mkl);
  row[kSumKl] = lane_sum(sum_kl);
  row[kSumEnt] = lane_sum(sum_ent);
  if (nonempty) row[kSumS] = row[kMinS] = row[kMaxS] = s;
  if (c.level == 1) out.seq_coef[seq] = static_cast<float>(lane_sum(g_seq)) / n1 * alpha;  // g holds r = s_i
  merge_stats(st, row);
}

const bool* check_mask(const std::optional<at::Tensor>& mask, int64_t n, const char* op) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->numel() == n &&
                  mask->device().is_cpu(),
              op, ": mask must be a contiguous bool CPU tensor with ", n, " entries");
  return mask->const_data_ptr<bool>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_forward(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
    const std::optional<at::Tensor>& mask, const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& rollout_logp,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& entropy, double eps_low,
    double eps_high, double dual_clip, int64_t level, int64_t tis_mode, bool tis_mean, bool seq_mean, double tis_min,
    double tis_max, double beta, double entropy_coef) {
  constexpr const char* op = "policy_loss_forward";
  TORCH_CHECK(logp.dim() == 1, op, ": logp must be flat [N], got ", logp.sizes());
  const int64_t n = logp.numel();
  const int64_t* cu = check_cu(cu_seqlens, op);
  const int64_t nseq = cu_seqlens.numel() - 1;
  TORCH_CHECK(level >= 0 && level <= 2, op, ": level must be 0 (token), 1 (sequence) or 2 (sequence_token)");
  TORCH_CHECK(tis_mode >= 0 && tis_mode <= 4, op, ": tis_mode must be in [0, 4]");
  Inputs in;
  in.logp = float_input(logp, n, "logp");
  in.old = float_input(old_logp, n, "old_logp");
  TORCH_CHECK(advantages.numel() == nseq || advantages.numel() == n, op, ": advantages must have ", nseq,
              " (per sequence) or ", n, " (per token) entries, got ", advantages.numel());
  in.adv_per_seq = advantages.numel() != n;
  in.adv = float_input(advantages, advantages.numel(), "advantages");
  in.roll = optional_input(rollout_logp, n, "rollout_logp");
  in.ref = optional_input(ref_logp, n, "ref_logp");
  in.ent = optional_input(entropy, n, "entropy");
  in.mask = check_mask(mask, n, op);
  TORCH_CHECK(tis_mode == 0 || in.roll, op, ": a TIS mode needs rollout_logp");

  Config c{};
  c.lo = static_cast<float>(1.0 - eps_low);
  c.hi = static_cast<float>(1.0 + eps_high);
  c.has_dual = dual_clip > 0.0;
  c.dual_c = c.has_dual ? static_cast<float>(dual_clip) : kInf;
  c.tis_min = static_cast<float>(tis_min);
  c.tis_max = static_cast<float>(tis_max);
  c.beta = static_cast<float>(beta);
  c.ent_coef = static_cast<float>(entropy_coef);
  c.tis_mean = tis_mean;
  c.seq_mean = seq_mean;
  c.level = static_cast<int>(level);
  c.tis = static_cast<int>(tis_mode);

  const auto f32 = logp.options().dtype(at::kFloat);
  at::Tensor g_tok = at::empty({n}, f32);
  at::Tensor g_ent = at::empty({in.ent ? n : 0}, f32);
  at::Tensor seq_coef = at::empty({c.level == 1 ? nseq : 0}, f32);
  // cu_seqlens runs from 0 to N once checked; tokens outside every sequence (a caller that
  // skipped the checks) get zero coefficients rather than uninitialised memory
  const int64_t first = std::clamp<int64_t>(cu[0], 0, n), last = std::clamp<int64_t>(cu[nseq], first, n);
  for (at::Tensor* t : {&g_tok, &g_ent}) {
    if (t->numel() == 0) continue;
    float* p = t->data_ptr<float>();
    std::fill(p, p + first, 0.f);
    std::fill(p + last, p + n, 0.f);
  }
  Outputs out{g_tok.data_ptr<float>(), in.ent ? g_ent.data_ptr<float>() : nullptr,
              c.level == 1 ? seq_coef.data_ptr<float>() : nullptr};

  const std::vector<int64_t> blocks = sequence_blocks(cu, nseq, n, kBlockTokens);
  const int64_t nblocks = static_cast<int64_t>(blocks.size()) - 1;
  std::vector<Stats> partial(nblocks, empty_stats());
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t i = blocks[b]; i < blocks[b + 1]; ++i) {
        const int64_t a = std::clamp<int64_t>(cu[i], 0, n);
        const int64_t e = std::clamp<int64_t>(cu[i + 1], a, n);
        sequence_forward(in, c, out, i, a, e, partial[b]);
      }
    }
  });
  Stats total = empty_stats();
  for (const Stats& p : partial) merge_stats(total, p);  // fixed order: deterministic
  at::Tensor stats = at::empty({kNStats}, f32);
  float* sp = stats.data_ptr<float>();
  for (int col = 0; col < kNStats; ++col) sp[col] = static_cast<float>(total[col]);
  return {stats, g_tok, g_ent, seq_coef};
}

std::tuple<at::Tensor, at::Tensor> policy_loss_backward(const at::Tensor& grad_loss, const at::Tensor& g_tok,
                                                        const at::Tensor& g_ent, const at::Tensor& seq_coef,
                                                        const std::optional<at::Tensor>& mask,
                                                        const at::Tensor& cu_seqlens, const at::Tensor& scale) {
  constexpr const char* op = "policy_loss_backward";
  auto f32_vec = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), op, ": ", name,
                " must be a contiguous float32 CPU tensor");
    return t.const_data_ptr<float>();
  };
  TORCH_CHECK(grad_loss.numel() == 1 && scale.numel() == 1, op, ": grad_loss and scale must be scalars");
  const float gs = grad_loss.to(at::kFloat).item<float>() * scale.to(at::kFloat).item<float>();
  const int64_t n = g_tok.numel();
  const float* gt = f32_vec(g_tok, "g_tok");
  const bool has_ent = g_ent.numel() > 0;
  TORCH_CHECK(!has_ent || g_ent.numel() == n, op, ": g_ent must be empty or have ", n, " entries");
  const float* ge = has_ent ? f32_vec(g_ent, "g_ent") : nullptr;
  const auto f32 = g_tok.options();
  at::Tensor grad_logp = at::empty({n}, f32);
  at::Tensor grad_ent = at::empty({has_ent ? n : 0}, f32);
  float* gl = grad_logp.data_ptr<float>();
  float* gh = has_ent ? grad_ent.data_ptr<float>() : nullptr;
  const Vec vgs(gs);
  auto scaled = [&](const float* src, float* dst, int64_t a, int64_t b, float add, const bool* m) {
    const Vec vadd(add);
    int64_t i = a;
    if (add == 0.f || m == nullptr) {
      for (; i + kW <= b; i += kW) (Vec::loadu(src + i) * vgs + vadd).store(dst + i);
      for (; i < b; ++i) dst[i] = src[i] * gs + add;
    } else {
      for (; i < b; ++i) dst[i] = src[i] * gs + (m[i] ? add : 0.f);
    }
  };
  if (seq_coef.numel() == 0) {
    at::parallel_for(0, n, kBlockTokens, [&](int64_t a, int64_t b) {
      scaled(gt, gl, a, b, 0.f, nullptr);
      if (has_ent) scaled(ge, gh, a, b, 0.f, nullptr);
    });
    return {grad_logp, grad_ent};
  }
  const int64_t* cu = check_cu(cu_seqlens, op);
  const int64_t nseq = cu_seqlens.numel() - 1;
  TORCH_CHECK(seq_coef.numel() == nseq, op, ": seq_coef must have one entry per sequence");
  const float* sc = f32_vec(seq_coef, "seq_coef");
  const bool* m = check_mask(mask, n, op);
  // tokens outside every sequence (only with unchecked cu_seqlens) get g_tok * gs
  const std::vector<int64_t> blocks = sequence_blocks(cu, nseq, n, kBlockTokens);
  const int64_t first = std::clamp<int64_t>(cu[0], 0, n), last = std::clamp<int64_t>(cu[nseq], first, n);
  scaled(gt, gl, 0, first, 0.f, nullptr);
  scaled(gt, gl, last, n, 0.f, nullptr);
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) - 1, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (int64_t i = blocks[blk]; i < blocks[blk + 1]; ++i) {
        const int64_t a = std::clamp<int64_t>(cu[i], 0, n);
        const int64_t e = std::clamp<int64_t>(cu[i + 1], a, n);
        scaled(gt, gl, a, e, sc[i] * gs, m);
      }
    }
  });
  if (has_ent) {
    at::parallel_for(0, n, kBlockTokens, [&](int64_t a, int64_t b) { scaled(ge, gh, a, b, 0.f, nullptr); });
  }
  return {grad_logp, grad_ent};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def(
      "policy_loss_forward(Tensor logp, Tensor old_logp, Tensor advantages, Tensor? mask, Tensor cu_seqlens, "
      "Tensor? rollout_logp, Tensor? ref_logp, Tensor? entropy, float eps_low, float eps_high, float dual_clip, "
      "int level, int tis_mode, bool tis_mean, bool seq_mean, float tis_min, float tis_max, float beta, "
      "float entropy_coef) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "policy_loss_backward(Tensor grad_loss, Tensor g_tok, Tensor g_ent, Tensor seq_coef, Tensor? mask, "
      "Tensor cu_seqlens, Tensor scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("policy_loss_forward", &policy_loss_forward);
  m.impl("policy_loss_backward", &policy_loss_backward);
}

}  // namespace flashrl_native
