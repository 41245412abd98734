// Vector helpers shared by the native CPU kernels (csrc/cpu/*.cpp), on ATen's
// Vectorized<float> for the CPU capability the library is built for (see
// flashrl_kernels/_native.py): bf16/fp16 <-> fp32 loads and stores, lane
// reductions, a fast 2^t (exp2_clamped) and e^x (exp_vec), and the two pieces of
// softmax math that token_logprobs and the linear epilogues share: the online
// (max, sum 2^t, sum 2^t t) statistics of a row chunk and the per-row gradient.
// Everything is inline: each .cpp is its own translation unit, all linked into
// one library. Also the input plumbing of the loss / scan kernels: FloatInput (a float
// tensor of any dtype read as fp32 tiles) and sequence_blocks (parallel work items).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace flashrl_native {

#if defined(CPU_CAPABILITY_AVX2)
// acc += v (int32 lanes) in place: written as an intrinsic, GCC 12 keeps the sum in a fresh register and copies it
// back (a vmovdqa per product in the W8A8 loops, as with the VNNI tiles' dot products in qlinear_packed.cpp)
inline void add_into(__m256i& acc, __m256i v) { asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(v)); }
#endif

using Vec = at::vec::Vectorized<float>;
inline constexpr int64_t kW = Vec::size();
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// Reduce the lanes of v with op, left to right (sums in double; a NaN lane may be dropped by max/min,
// NaN rows are caught by the sums)
template <typename T, typename Op>
inline T lane_reduce(const Vec& v, T init, Op op) {
  alignas(64) float buf[kW];
  v.store(buf);
  T acc = init;
  for (int64_t i = 0; i < kW; ++i) acc = op(acc, static_cast<T>(buf[i]));
  return acc;
}
inline double lane_sum(const Vec& v) { return lane_reduce(v, 0.0, [](double a, double b) { return a + b; }); }
inline float lane_max(const Vec& v) { return lane_reduce(v, kNegInf, [](float a, float b) { return std::max(a, b); }); }
inline float lane_min(const Vec& v) { return lane_reduce(v, -kNegInf, [](float a, float b) { return std::min(a, b); }); }

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr double kLn2d = 0.69314718055994531;
inline constexpr float kT2Min = -200.f;  // 2^-200 underflows to 0: clamp t there (keeps 0 * t finite at t = -inf)

inline Vec plain_max(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_max_ps(a, b);
#else
  return at::vec::maximum(a, b);
#endif
}

// 2^t for t already clamped to >= kT2Min (NaN and +inf propagate as NaN / inf).
inline Vec exp2_clamped(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  // 2^t = 2^n * 2^f, n = round(t), f in [-1/2, 1/2]; ATen exp_u20's polynomial for e^r with r = f ln 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.0013263089f);  // 0.00828929059 ln2^5
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0096714879f));   // 0.0418978221 ln2^4
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055507390f));    // 0.166676521 ln2^3
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022243f));     // 0.499991506 ln2^2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314697f));     // 0.999999701 ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
#elif defined(CPU_CAPABILITY_AVX2)
  // Same polynomial; 2^n built in the exponent bits. t is clamped at -127 so n + 127 >= 0: results
  // below 2^-126.5 become exactly 0 (no denormals), as do the t = kT2Min of -inf logits.
  const __m256 tt = _mm256_max_ps(_mm256_set1_ps(-127.f), t);  // NaN in t passes through
  const __m256 n = _mm256_round_ps(tt, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(tt, n);
  __m256 p = _mm256_set1_ps(0.0013263089f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0096714879f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.055507390f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022243f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314697f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
#else
  // exp_u20 maps NaN to a finite value; (t - t) is 0 for finite t and NaN for NaN / +inf, restoring propagation
  return (t * Vec(static_cast<float>(kLn2d))).exp_u20() + (t - t);
#endif
}

// d(g_lp logp + g_h H)/dx for one row of raw logits x (bias included, before the 1/T), vector by vector:
//   g_k = -(g_lp p_k + g_h p_k (log p_k + H)) / T,   p_k = exp(x_k / T - lse),
// plus the target's one-hot term g_lp / T, which `target_grad` adds for that entry. p is
// evaluated as 2^t 2^delta with t = x c - lc (one FMA), c = fl(log2(e) / T), lc = fl(lse log2(e)),
// and delta = lc - lse log2(e), the rounding of lc, folded into the scalar coefficients.
template <bool ENTROPY>
struct SoftmaxRowGrad {
  Vec vc, vlc, c_lp, c_h, vh;

  SoftmaxRowGrad(float c, double inv_t, float lse, float g_lp, float g_h, float h) : vc(c) {
    const float lc = static_cast<float>(static_cast<double>(lse) * kLog2e);
    const double delta = static_cast<double>(lc) - static_cast<double>(lse) * static_cast<double>(kLog2e);
    const double scale = std::exp2(delta);
    vlc = Vec(-lc);
    c_lp = Vec(static_cast<float>(-g_lp * inv_t * scale));  // coefficient of 2^t
    c_h = Vec(static_cast<float>(-g_h * inv_t * scale));    // coefficient of 2^t (log p + H)
    vh = Vec(static_cast<float>(h + delta * kLn2d));        // log p + H = t ln2 + (H + delta ln2)
  }

  Vec operator()(const Vec& x) const {
    const Vec t = at::vec::clamp_min(at::vec::fmadd(x, vc, vlc), Vec(kT2Min));
    const Vec e = exp2_clamped(t);
    Vec out = e * c_lp;
    if constexpr (ENTROPY) out = at::vec::fmadd(e * c_h, at::vec::fmadd(t, Vec(static_cast<float>(kLn2d)), vh), out);
    return out;
  }
};

// The target entry's whole gradient, recomputed in double from its raw logit x_y.
inline float target_grad(double x_y, double inv_t, double lse, double g_lp, double g_h, double h, bool entropy) {
  const double lp = x_y * inv_t - lse;
  const double p = std::exp(lp);
  double gy = g_lp * (1.0 - p) * inv_t;
  if (entropy && p > 0) gy -= g_h * p * (lp + h) * inv_t;
  return static_cast<float>(gy);
}

// Online softmax statistics of one row, one L1-sized chunk at a time. m is the max of the
// (raw or biased) logits x seen so far; s and w are per-lane sums of e = 2^t and e * t with
// t = x * c - mc, c = fl(log2(e) / T), mc = fl(m_ref * c), m_ref = (m == -inf ? 0 : m).
struct RowAcc {
  float m = kNegInf;
  Vec s = Vec(0.f);
  Vec w = Vec(0.f);
};

// Fold n values (a multiple of kW; load(i) returns the fp32 vector at offset i) into acc:
// the chunk max, one rescale of the sums when it grew, then sum 2^t (and 2^t t).
template <bool ENTROPY, typename Load>
inline void online_chunk(const Load& load, int64_t n, float c, RowAcc& acc) {
  // n is a multiple of kW (the row's tail arrives here through a padded buffer)
  Vec vmax0(kNegInf), vmax1(kNegInf);
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    vmax0 = plain_max(vmax0, load(i));
    vmax1 = plain_max(vmax1, load(i + kW));
  }
  for (; i < n; i += kW) vmax0 = plain_max(vmax0, load(i));
  const float cm = lane_max(plain_max(vmax0, vmax1));
  if (cm > acc.m) {
    if (acc.m != kNegInf) {  // before the first finite max every sum is exactly 0
      const float dt = acc.m * c - cm * c;  // shift of t, <= 0
      const float a = std::exp2(dt);
      if (ENTROPY) acc.w = (acc.w + acc.s * Vec(dt)) * Vec(a);
      acc.s = acc.s * Vec(a);
    }
    acc.m = cm;
  }
  const Vec vc(c), vmc(-((acc.m == kNegInf ? 0.f : acc.m) * c)), lo(kT2Min);
  Vec s0(0.f), s1(0.f), w0(0.f), w1(0.f);
  int64_t j = 0;
  for (; j + 2 * kW <= n; j += 2 * kW) {
    const Vec t0 = at::vec::clamp_min(at::vec::fmadd(load(j), vc, vmc), lo);
    const Vec t1 = at::vec::clamp_min(at::vec::fmadd(load(j + kW), vc, vmc), lo);
    const Vec e0 = exp2_clamped(t0);
    const Vec e1 = exp2_clamped(t1);
    s0 = s0 + e0;
    s1 = s1 + e1;
    if (ENTROPY) {
      w0 = at::vec::fmadd(e0, t0, w0);
      w1 = at::vec::fmadd(e1, t1, w1);
    }
  }
  for (; j < n; j += kW) {
    const Vec t0 = at::vec::clamp_min(at::vec::fmadd(load(j), vc, vmc), lo);
    const Vec e0 = exp2_clamped(t0);
    s0 = s0 + e0;
    if (ENTROPY) w0 = at::vec::fmadd(e0, t0, w0);
  }
  acc.s = acc.s + (s0 + s1);
  if (ENTROPY) acc.w = acc.w + (w0 + w1);
}

// e^x for general x, inlined: no call in a hot loop, so its vector accumulators stay in registers
// (a call to Sleef's exp spills all of them; policy_loss measured 2.4 -> 1.8 ms at 1M tokens).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and the degree-5 polynomial of ATen's exp_u20 for e^r:
// max relative error about 2e-7. Overflow gives +inf (AVX2: already from x > 88.4), underflow
// 0 (AVX-512) or a value below 1.2e-38 (AVX2), NaN stays NaN. Other CPUs: ATen's exp.
inline Vec exp_vec(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  using R = __m512;
#define FLASHRL_PS(op) _mm512_##op##_ps
#define FLASHRL_SET1(v) _mm512_set1_ps(v)
#else
  using R = __m256;
#define FLASHRL_PS(op) _mm256_##op##_ps
#define FLASHRL_SET1(v) _mm256_set1_ps(v)
#endif
  // clamp (max/min return their second operand when the first is NaN, so NaN survives)
#if defined(CPU_CAPABILITY_AVX512)
  constexpr float kLo = -110.f, kHi = 100.f;  // scalef rounds to 0 / overflows to inf beyond these
#else
  constexpr float kLo = -87.5f, kHi = 88.8f;  // keeps n in [-126, 128] for the exponent bits
#endif
  R xc = FLASHRL_PS(max)(FLASHRL_SET1(kLo), static_cast<R>(x));
  xc = FLASHRL_PS(min)(FLASHRL_SET1(kHi), xc);
  const R t = FLASHRL_PS(mul)(xc, FLASHRL_SET1(1.4426950408889634f));
#if defined(CPU_CAPABILITY_AVX512)
  const R n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const R n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  R r = FLASHRL_PS(fnmadd)(n, FLASHRL_SET1(0.693145751953125f), xc);  // ln2 = hi + lo, hi exact in n * hi
  r = FLASHRL_PS(fnmadd)(n, FLASHRL_SET1(1.428606765330187e-06f), r);
  R p = FLASHRL_SET1(0.00828929059f);
  p = FLASHRL_PS(fmadd)(p, r, FLASHRL_SET1(0.0418978221f));
  p = FLASHRL_PS(fmadd)(p, r, FLASHRL_SET1(0.166676521f));
  p = FLASHRL_PS(fmadd)(p, r, FLASHRL_SET1(0.499991506f));
  p = FLASHRL_PS(fmadd)(p, r, FLASHRL_SET1(0.999999701f));
  p = FLASHRL_PS(fmadd)(p, r, FLASHRL_SET1(1.0f));
#undef FLASHRL_PS
#undef FLASHRL_SET1
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(p, n);
#else
  // 2^n in the exponent bits: n in [-126, 128]; n = 128 gives the all-ones exponent, so p * inf = inf
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
#endif
#else
  return x.exp();
#endif
}

// A float tensor (fp32 / bf16 / fp16, fp64 where the op allows it) read as fp32.
struct FloatInput {
  const void* ptr = nullptr;  // may be null for an empty tensor: `present` says whether it was given
  at::ScalarType dtype = at::kFloat;
  bool present = false;

  explicit operator bool() const { return present; }

  // this[off:off+len] as fp32, readable up to len rounded up to whole vectors: fp32 input is
  // read in place when that stays inside the tensor, anything else is converted into `buf`
  // (lanes past len are zero; the kernels never let them count)
  const float* tile(int64_t off, int64_t len, float* buf) const {
    if (dtype == at::kFloat && len % kW == 0) return static_cast<const float*>(ptr) + off;
    switch (dtype) {
      case at::kFloat:
        std::memcpy(buf, static_cast<const float*>(ptr) + off, len * sizeof(float));
        break;
      case at::kBFloat16:
        at::vec::convert(static_cast<const c10::BFloat16*>(ptr) + off, buf, len);
        break;
      case at::kHalf:
        at::vec::convert(static_cast<const c10::Half*>(ptr) + off, buf, len);
        break;
      default:
        at::vec::convert(static_cast<const double*>(ptr) + off, buf, len);
    }
    const int64_t padded = (len + kW - 1) / kW * kW;
    for (int64_t i = len; i < padded; ++i) buf[i] = 0.f;
    return buf;
  }

  float at(int64_t i) const {
    switch (dtype) {
      case at::kFloat:
        return static_cast<const float*>(ptr)[i];
      case at::kBFloat16:
        return static_cast<float>(static_cast<const c10::BFloat16*>(ptr)[i]);
      case at::kHalf:
        return static_cast<float>(static_cast<const c10::Half*>(ptr)[i]);
      default:
        return static_cast<float>(static_cast<const double*>(ptr)[i]);
    }
  }
};

// Checks `t` (contiguous CPU, n entries, a float dtype) and wraps it; `op` and `name` go into the error.
inline FloatInput float_input(const at::Tensor& t, int64_t n, const char* op, const char* name,
                              bool allow_double = false) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || (allow_double && dt == at::kDouble),
              op, ": ", name, " must be float32, bfloat16 or float16", allow_double ? " or float64" : "", ", got ",
              dt);
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous() && t.numel() == n, op, ": ", name, " must be contiguous with ", n,
              " entries, got shape ", t.sizes());
  return FloatInput{t.const_data_ptr(), dt, true};
}

// valid[0:padded] = 1.0 where the token counts (in the tile and not masked out), else 0.0
inline void valid_tile(const bool* mask, int64_t off, int64_t len, float* dst) {
  const int64_t padded = (len + kW - 1) / kW * kW;
  if (mask != nullptr) {
    const uint8_t* m = reinterpret_cast<const uint8_t*>(mask) + off;  // torch bools are bytes 0 / 1
    for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<float>(m[i]);
  } else {
    for (int64_t i = 0; i < len; ++i) dst[i] = 1.f;
  }
  for (int64_t i = len; i < padded; ++i) dst[i] = 0.f;
}

// cu_seqlens as the kernels take it: contiguous int64 [S + 1] on the CPU, S >= 1.
inline const int64_t* check_cu(const at::Tensor& cu, const char* op) {
  TORCH_CHECK(cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.is_contiguous() && cu.numel() >= 2, op,
              ": cu_seqlens must be a contiguous int64 [S + 1] tensor (S >= 1), got ", cu.scalar_type(), " ",
              cu.sizes());
  TORCH_CHECK(cu.device().is_cpu(), op, ": cu_seqlens must be a CPU tensor");
  return cu.const_data_ptr<int64_t>();
}

// Sequence ranges [starts[k], starts[k+1]) of the parallel work items: consecutive sequences up to
// about block_tokens tokens each. Depends only on cu_seqlens, so results do not depend on the
// thread count. cu entries are clamped into [0, n]: never an out-of-bounds range.
inline std::vector<int64_t> sequence_blocks(const int64_t* cu, int64_t nseq, int64_t n, int64_t block_tokens) {
  std::vector<int64_t> starts{0};
  int64_t tokens = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t a = std::clamp<int64_t>(cu[i], 0, n);
    const int64_t b = std::clamp<int64_t>(cu[i + 1], a, n);
    tokens += b - a + 1;  // +1: a run of empty sequences still costs something
    if (tokens >= block_tokens && i + 1 < nseq) {
      starts.push_back(i + 1);
      tokens = 0;
    }
  }
  starts.push_back(nseq);
  return starts;
}

}  // namespace flashrl_native
