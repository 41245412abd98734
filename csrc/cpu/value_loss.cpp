// Native CPU kernels for PPO's clipped value loss.
//
// Semantics are those of flashrl_kernels/reference/value_loss.py (the spec), in the canonical
// form of flashrl_kernels/ops/value_loss.py: flat token tensors [N], an optional bool mask [N],
// int64 cu_seqlens [S+1]. Per valid token (v values, o old_values, R returns, c clip_range):
//   v_c = clamp(v, o - c, o + c),  l = max((v - R)^2, (v_c - R)^2)  (ties: the unclipped term),
//   g_tok = (v - R) where the unclipped term is taken, 0 where the clipped one is strictly larger,
//   times 1/n_i for seq-mean-token-mean (n_i: the sequence's valid tokens), 0 at masked positions.
// Without clipping (c = 0) l = (v - R)^2 and old_values is not read.
//
// Forward: one parallel pass. The tokens are cut into work items of about kBlockTokens tokens:
// consecutive short sequences share an item, a long one is split over several (the cut depends
// only on cu_seqlens, never on the thread count, so the results are deterministic); at::parallel_for
// spreads the items over threads. An item walks its segments in tiles of kTile tokens: each input
// is read in its own dtype (values fp32 / bf16 / fp16, old_values and returns also fp64) into an
// L1-resident fp32 buffer, the token math runs on ATen Vectorized<float> lanes, tile sums go to
// double. The second moments of R and R - v (for explained_variance) are summed per tile about a
// shift close to the mean (the segment's first valid value, then its running mean), turned into
// the tile's moment about its own mean and merged in double with Chan et al.'s pairwise update,
// so there is no E[x^2] - E[x]^2 cancellation at large offsets. The output is one float64 vector of the 10
// STAT_NAMES of torch_impl/value_loss.py; the shared Python `finalize` makes the loss and metrics.
//
// need_grad = false (no gradient wanted): g_tok is returned empty and never written.
//
// Backward: grad = g_tok * grad_loss * scale, one streaming pass, written in the values' dtype.
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
#include <optional>
#include <vector>

#include "vec_utils.h"

namespace flashrl_native {
namespace {

constexpr int64_t kTile = 512;           // tokens per tile: a few fp32 buffers of 2 KiB stay in L1
constexpr int64_t kBlockTokens = 16384;  // tokens per parallel work item
static_assert(kTile % kW == 0, "a tile holds whole vectors");

// Statistics columns, in the order of STAT_NAMES (torch_impl/value_loss.py).
enum Stat : int { kNTok, kNSeq, kQ, kNClip, kSumV, kSumErr2, kSumR, kM2R, kSumE, kM2E, kNStats };

struct Moments {  // count, sum and second moment about the mean of one quantity
  double n = 0.0, sum = 0.0, m2 = 0.0;

  // Chan et al.: merge another set of (count, sum, centred second moment)
  void merge(double n_b, double sum_b, double m2_b) {
    if (n_b <= 0.0) return;
    if (n <= 0.0) {
      n = n_b, sum = sum_b, m2 = m2_b;
      return;
    }
    const double delta = sum_b / n_b - sum / n;
    m2 += m2_b + delta * delta * (n * n_b / (n + n_b));
    n += n_b;
    sum += sum_b;
  }
};

struct Stats {
  double q = 0.0, n_clip = 0.0, sum_v = 0.0, sum_err2 = 0.0;
  Moments r, e;  // returns, and returns - values (r.n is the valid-token count)

  void merge(const Stats& s) {
    q += s.q;
    n_clip += s.n_clip;
    sum_v += s.sum_v;
    sum_err2 += s.sum_err2;
    r.merge(s.r.n, s.r.sum, s.r.m2);
    e.merge(s.e.n, s.e.sum, s.e.m2);
  }
};

FloatInput float_in(const at::Tensor& t, int64_t n, const char* name, bool allow_double) {
  return float_input(t, n, "value_loss", name, allow_double);
}

// max / min without ATen's NaN propagation (one instruction each on x86): a NaN value or return
// already makes l1 NaN, and a NaN old value is added to the loss through (o - o)
inline Vec plain_min(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_min_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_min_ps(a, b);
#else
  return at::vec::minimum(a, b);
#endif
}

inline Vec ones_where(const Vec& m) { return m & Vec(1.f); }  // a compare mask as 1.0 / 0.0
inline Vec select(const Vec& m, const Vec& yes, const Vec& no) { return Vec::blendv(no, yes, m); }

struct Inputs {
  FloatInput v, old, ret;
  const bool* mask = nullptr;
  float clip = 0.f;  // 0: no clipping
};

// Tokens [a, b) of one sequence whose gradient coefficients carry the factor alpha:
// writes g_tok[a:b] (unless g_tok is null), merges the statistics into st, returns the number of valid tokens.
double segment_forward(const Inputs& in, float alpha, int64_t a, int64_t b, float* g_tok, Stats& st) {
  alignas(64) float vb[kTile], vbuf[kTile], obuf[kTile], rbuf[kTile];
  const Vec zero(0.f), valpha(alpha), lo_off(-in.clip), hi_off(in.clip);
  const bool clip = in.clip > 0.f;
  Stats seg;          // this segment's statistics, merged into st at the end
  bool shifted = false;
  float kr = 0.f, ke = 0.f;  // shifts of R and R - v for the second moments: a valid value, then the running mean
  for (int64_t k = a; k < b; k += kTile) {
    const int64_t len = std::min(kTile, b - k);
    valid_tile(in.mask, k, len, vb);
    const float* vt = in.v.tile(k, len, vbuf);
    const float* rt = in.ret.tile(k, len, rbuf);
    const float* ot = clip ? in.old.tile(k, len, obuf) : nullptr;
    if (!shifted) {
      int64_t j = 0;
      while (j < len && !(vb[j] > 0.f)) ++j;
      if (j == len) {  // no valid token yet: the whole tile is masked out, its g_tok are 0
        if (g_tok != nullptr) std::fill(g_tok + k, g_tok + k + len, 0.f);
        continue;
      }
      kr = rt[j];
      ke = rt[j] - vt[j];
      shifted = true;
    }
    const Vec vkr(kr), vke(ke);
    Vec q(0.f), n_clip(0.f), sum_v(0.f), sum_err2(0.f), cnt(0.f), s1r(0.f), s2r(0.f), s1e(0.f), s2e(0.f);
    for (int64_t i = 0; i < len; i += kW) {
      const Vec m = Vec::loadu(vb + i);
      const Vec valid = m > zero;
      const Vec v = select(valid, Vec::loadu(vt + i), zero);  // padding may hold anything, NaN included
      const Vec r = select(valid, Vec::loadu(rt + i), zero);
      const Vec d = v - r;
      const Vec l1 = d * d;
      Vec loss = l1, g = d;
      if (clip) {
        const Vec o = select(valid, Vec::loadu(ot + i), zero);
        const Vec vc = plain_min(plain_max(v, o + lo_off), o + hi_off);  // NaN in v or o: caught below
        const Vec dc = vc - r;
        const Vec l2 = dc * dc;
        const Vec use2 = l2 > l1;
        loss = select(use2, l2, l1) + (o - o);  // ties: unclipped; a non-finite old value shows in the loss
        g = select(use2, zero, d);
        n_clip += ones_where(use2);
      }
      if (g_tok != nullptr) (g * valpha).store(g_tok + k + i, std::min(kW, len - i));
      q += loss;
      sum_err2 += l1;
      sum_v += v;
      cnt += m;
      const Vec xr = select(valid, r - vkr, zero);       // R - kr
      const Vec xe = select(valid, (zero - d) - vke, zero);  // (R - v) - ke
      s1r += xr;
      s2r = at::vec::fmadd(xr, xr, s2r);
      s1e += xe;
      s2e = at::vec::fmadd(xe, xe, s2e);
    }
    const double nt = lane_sum(cnt);
    seg.q += lane_sum(q) * static_cast<double>(alpha);
    seg.n_clip += lane_sum(n_clip);
    seg.sum_v += lane_sum(sum_v);
    seg.sum_err2 += lane_sum(sum_err2);
    if (nt <= 0.0) continue;
    // shifted sums -> this tile's (count, sum, second moment about its mean); the shift is within
    // a few standard deviations of the mean, so S2 - S1^2 / n loses little
    const double a1r = lane_sum(s1r), a1e = lane_sum(s1e);
    seg.r.merge(nt, nt * kr + a1r, std::max(lane_sum(s2r) - a1r * a1r / nt, 0.0));
    seg.e.merge(nt, nt * ke + a1e, std::max(lane_sum(s2e) - a1e * a1e / nt, 0.0));
    kr = static_cast<float>(seg.r.sum / seg.r.n);
    ke = static_cast<float>(seg.e.sum / seg.e.n);
  }
  st.merge(seg);
  return seg.r.n;
}

struct Segment {
  int64_t seq, a, b;
};

std::tuple<at::Tensor, at::Tensor> value_loss_forward(const at::Tensor& values,
                                                      const std::optional<at::Tensor>& old_values,
                                                      const at::Tensor& returns, const std::optional<at::Tensor>& mask,
                                                      const at::Tensor& cu_seqlens, double clip_range, bool seq_mean,
                                                      bool need_grad) {
  constexpr const char* op = "value_loss_forward";
  TORCH_CHECK(values.dim() == 1, op, ": values must be flat [N], got ", values.sizes());
  const int64_t n = values.numel();
  const int64_t* cu = check_cu(cu_seqlens, op);
  const int64_t nseq = cu_seqlens.numel() - 1;
  TORCH_CHECK(clip_range >= 0.0 && std::isfinite(clip_range), op, ": clip_range must be finite and >= 0 (0: off)");
  Inputs in;
  in.v = float_in(values, n, "values", false);
  in.ret = float_in(returns, n, "returns", true);
  in.clip = static_cast<float>(clip_range);
  if (in.clip > 0.f) {
    TORCH_CHECK(old_values.has_value(), op, ": clipping needs old_values");
    in.old = float_in(*old_values, n, "old_values", true);
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->numel() == n &&
                    mask->device().is_cpu(),
                op, ": mask must be a contiguous bool CPU tensor with ", n, " entries");
    in.mask = mask->const_data_ptr<bool>();
  }

  // need_grad = false: no gradient will be asked for; g_tok stays empty and is never written
  at::Tensor g_tok = at::empty({need_grad ? n : 0}, values.options().dtype(at::kFloat));
  float* gp = need_grad ? g_tok.data_ptr<float>() : nullptr;
  if (gp != nullptr) {  // tokens outside every sequence (only with unchecked cu_seqlens) get a zero coefficient
    const int64_t first = std::clamp<int64_t>(cu[0], 0, n), last = std::clamp<int64_t>(cu[nseq], first, n);
    std::fill(gp, gp + first, 0.f);
    std::fill(gp + last, gp + n, 0.f);
  }

  // work items: segments of about kBlockTokens tokens (short sequences grouped, long ones split)
  std::vector<Segment> segs;
  std::vector<int64_t> items{0};
  int64_t tokens = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    int64_t a = std::clamp<int64_t>(cu[i], 0, n);
    const int64_t e = std::clamp<int64_t>(cu[i + 1], a, n);
    while (a < e) {
      const int64_t take = std::min(e - a, kBlockTokens - tokens);
      segs.push_back({i, a, a + take});
      a += take;
      tokens += take;
      if (tokens >= kBlockTokens) {
        items.push_back(static_cast<int64_t>(segs.size()));
        tokens = 0;
      }
    }
  }
  if (items.back() != static_cast<int64_t>(segs.size())) items.push_back(static_cast<int64_t>(segs.size()));
  const int64_t nitems = static_cast<int64_t>(items.size()) - 1;
  const int64_t nsegs = static_cast<int64_t>(segs.size());

  // seq-mean-token-mean: 1 / n_i per sequence, n_i counted first when there is a mask
  std::vector<float> alpha;
  if (seq_mean) {
    std::vector<double> n_i(nseq, 0.0);
    if (in.mask != nullptr) {
      std::vector<double> seg_n(nsegs, 0.0);
      at::parallel_for(0, nsegs, 8, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s) {
          const uint8_t* m = reinterpret_cast<const uint8_t*>(in.mask);
          int64_t c = 0;
          for (int64_t t = segs[s].a; t < segs[s].b; ++t) c += m[t];
          seg_n[s] = static_cast<double>(c);
        }
      });
      for (int64_t s = 0; s < nsegs; ++s) n_i[segs[s].seq] += seg_n[s];
    } else {
      for (int64_t s = 0; s < nsegs; ++s) n_i[segs[s].seq] += static_cast<double>(segs[s].b - segs[s].a);
    }
    alpha.resize(nseq);
    for (int64_t i = 0; i < nseq; ++i) alpha[i] = static_cast<float>(1.0 / std::max(n_i[i], 1.0));
  }

  std::vector<Stats> partial(nitems);
  std::vector<double> seg_cnt(nsegs, 0.0);
  at::parallel_for(0, nitems, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t s = items[b]; s < items[b + 1]; ++s) {
        const Segment& sg = segs[s];
        seg_cnt[s] = segment_forward(in, seq_mean ? alpha[sg.seq] : 1.f, sg.a, sg.b, gp, partial[b]);
      }
    }
  });
  Stats total;
  for (const Stats& p : partial) total.merge(p);  // fixed order: deterministic
  // non-empty sequences, from the per-segment valid counts (a sequence may span several segments)
  double n_seq = 0.0;
  for (int64_t s = 0; s < nsegs;) {
    double c = 0.0;
    int64_t t = s;
    for (; t < nsegs && segs[t].seq == segs[s].seq; ++t) c += seg_cnt[t];
    n_seq += c > 0.0 ? 1.0 : 0.0;
    s = t;
  }

  at::Tensor stats = at::empty({kNStats}, values.options().dtype(at::kDouble));
  double* sp = stats.data_ptr<double>();
  sp[kNTok] = total.r.n;
  sp[kNSeq] = n_seq;
  sp[kQ] = total.q;
  sp[kNClip] = total.n_clip;
  sp[kSumV] = total.sum_v;
  sp[kSumErr2] = total.sum_err2;
  sp[kSumR] = total.r.sum;
  sp[kM2R] = total.r.m2;
  sp[kSumE] = total.e.sum;
  sp[kM2E] = total.e.m2;
  return {stats, g_tok};
}

template <typename T>
void scale_into(const float* src, T* dst, int64_t a, int64_t b, float gs) {
  const Vec vgs(gs);
  int64_t i = a;
  for (; i + 2 * kW <= b; i += 2 * kW) store_pair<T>(dst + i, Vec::loadu(src + i) * vgs, Vec::loadu(src + i + kW) * vgs);
  for (; i < b; ++i) dst[i] = static_cast<T>(src[i] * gs);
}

at::Tensor value_loss_backward(const at::Tensor& grad_loss, const at::Tensor& g_tok, const at::Tensor& scale,
                               at::ScalarType dtype) {
  constexpr const char* op = "value_loss_backward";
  TORCH_CHECK(g_tok.scalar_type() == at::kFloat && g_tok.is_contiguous() && g_tok.device().is_cpu(), op,
              ": g_tok must be a contiguous float32 CPU tensor");
  TORCH_CHECK(grad_loss.numel() == 1 && scale.numel() == 1, op, ": grad_loss and scale must be scalars");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": the gradient dtype must be float32, bfloat16 or float16, got ", dtype);
  const float gs = grad_loss.to(at::kFloat).item<float>() * scale.to(at::kFloat).item<float>();
  const int64_t n = g_tok.numel();
  const float* src = g_tok.const_data_ptr<float>();
  at::Tensor out = at::empty({n}, g_tok.options().dtype(dtype));
  at::parallel_for(0, n, kBlockTokens, [&](int64_t a, int64_t b) {
    switch (dtype) {
      case at::kFloat:
        scale_into(src, out.data_ptr<float>(), a, b, gs);
        break;
      case at::kBFloat16:
        scale_into(src, out.data_ptr<c10::BFloat16>(), a, b, gs);
        break;
      default:
        scale_into(src, out.data_ptr<c10::Half>(), a, b, gs);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def(
      "value_loss_forward(Tensor values, Tensor? old_values, Tensor returns, Tensor? mask, Tensor cu_seqlens, "
      "float clip_range, bool seq_mean, bool need_grad) -> (Tensor, Tensor)");
  m.def("value_loss_backward(Tensor grad_loss, Tensor g_tok, Tensor scale, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("value_loss_forward", &value_loss_forward);
  m.impl("value_loss_backward", &value_loss_backward);
}

}  // namespace flashrl_native
