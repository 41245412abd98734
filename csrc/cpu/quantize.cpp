// Native CPU per-row quantization to INT8 / FP8 (e4m3fn), written into the caller's storage.
//
// Semantics: flashrl_kernels/reference/quantize.py (the spec), bit for bit:
//   amax = max_j |w_j|;  scale = 1 if amax <= 2^-100 else fp32(amax / QMAX);  NaN for a row
//   holding NaN or +-inf;  y_j = fp32(w_j / scale) (an IEEE division, not a reciprocal multiply);
//   int8: q_j = clamp(round_half_even(y_j), -128, 127), NaN -> 0;
//   fp8:  q_j = e4m3fn(clamp(y_j, -448, 448)), round to nearest even;  zero rows: q = +0.
// quantize_rows_counted also counts the codes that changed (what a weight sync reports).
// quantize_rows_packed writes the same codes into the packed layout of the W8A8 linear (packed_layout.h).
// Two passes over each row (its max, then the quotients), rows spread over threads; a row
// of a 4096-wide bf16 weight is 8 KiB, so the second pass reads from L1/L2.
// The fp32 -> e4m3fn conversion is ATen's vectorised one on AVX-512, fp8e4m3_of_avx2 on AVX2 (both the
// algorithm of c10's scalar conversion, which torch's .to() uses) and c10's scalar one elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "packed_layout.h"
#include "vec_utils.h"

namespace flashrl_native {
namespace {

constexpr float kZeroRowAmax = 0x1p-100f;  // reference ZERO_ROW_AMAX
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// (amax of |x| over the row, whether every value is finite)
template <typename T>
std::pair<float, bool> row_amax(const T* x, int64_t k) {
  Vec vmax(0.f);
  Vec vbad(0.f);  // any lane non-finite: x - x is NaN for NaN and +-inf, 0 otherwise
  int64_t i = 0;
  for (; i + kW <= k; i += kW) {
    const Vec v = load_f32(x + i);
    vmax = plain_max(vmax, v.abs());
    vbad = vbad + (v - v);
  }
  float amax = lane_max(vmax);
  bool finite = !std::isnan(lane_sum(vbad));
  for (; i < k; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::abs(v));
  }
  return {amax, finite};
}

inline int8_t int8_of(float y) {  // y already divided by the scale
  const float r = std::nearbyint(y);  // the default rounding mode: half to even
  if (std::isnan(r)) return 0;
  return static_cast<int8_t>(std::min(127.f, std::max(-128.f, r)));
}

inline c10::Float8_e4m3fn fp8_of(float y) {
  return c10::Float8_e4m3fn(std::isnan(y) ? y : std::min(448.f, std::max(-448.f, y)));
}

// Each row writer returns how many of the row's codes differ from what q held before (kCount; else 0): a
// weight sync reports it. The old codes are read just before they are overwritten, from the cache lines the
// store has to bring in anyway (write-allocate), so counting costs compares and popcounts, not memory traffic.
template <bool kCount, typename T>
int64_t quantize_row_int8(const T* x, int8_t* q, int64_t k, float scale) {
  const Vec vs(scale), lo(-128.f), hi(127.f), zero(0.f);
  [[maybe_unused]] alignas(64) float buf[kW];
  int64_t changed = 0;
  int64_t i = 0;
  for (; i + kW <= k; i += kW) {
    Vec y = (load_f32(x + i) / vs).round();  // _mm*_round / roundscale to nearest even
    y = Vec::blendv(at::vec::clamp(y, lo, hi), zero, y != y);
    // y holds exact integers in [-128, 127]: narrow them to bytes
#if defined(CPU_CAPABILITY_AVX512)
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y));
    if constexpr (kCount)
      changed += __builtin_popcount(_mm_cmpneq_epi8_mask(b, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i i32 = _mm256_cvtps_epi32(y);
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    const __m128i b = _mm_packs_epi16(i16, i16);
    if constexpr (kCount) {
      const __m128i eq = _mm_cmpeq_epi8(b, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      changed += 8 - __builtin_popcount(_mm_movemask_epi8(eq) & 0xFF);
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), b);
#else
    y.store(buf);
    for (int64_t j = 0; j < kW; ++j) {
      const int8_t c = static_cast<int8_t>(buf[j]);
      if constexpr (kCount) changed += q[i + j] != c;
      q[i + j] = c;
    }
#endif
  }
  for (; i < k; ++i) {
    const int8_t c = int8_of(static_cast<float>(x[i]) / scale);
    if constexpr (kCount) changed += q[i] != c;
    q[i] = c;
  }
  return changed;
}

inline bool same_code(c10::Float8_e4m3fn a, c10::Float8_e4m3fn b) { return a.x == b.x; }

#if defined(CPU_CAPABILITY_AVX2)
// c10's fp32 -> e4m3fn conversion (fp8e4m3fn_from_fp32_value), 8 lanes at a time, codes in the low 8 bytes.
// Every branch of the scalar code is computed and the lanes pick theirs; f_bits < 2^31 once the sign is
// cleared, so the signed compares order the bit patterns as the scalar code's unsigned ones do.
inline __m128i fp8e4m3_of_avx2(__m256 y) {
  const __m256i sign_bit = _mm256_set1_epi32(INT32_MIN);
  __m256i f = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(f, sign_bit);
  f = _mm256_xor_si256(f, sign);
  // |y| >= 480 (the first value past e4m3fn's range): 0x7e, NaN: 0x7f
  const __m256i over = _mm256_cmpgt_epi32(f, _mm256_set1_epi32((1087 << 20) - 1));
  const __m256i nan = _mm256_cmpgt_epi32(f, _mm256_set1_epi32(0x7F800000));
  const __m256i sat = _mm256_sub_epi32(_mm256_set1_epi32(0x7e), nan);  // nan lanes are -1: 0x7f
  // below 2^-6 (e4m3fn subnormals): the fp32 addition of 2^14 rounds the mantissa to 3 bits, half to even
  const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), f);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(f), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
  // normal: rebias the exponent and round the mantissa to 3 bits, half to even
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(f, 20), _mm256_set1_epi32(1));
  const __m256i norm = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(f, _mm256_set1_epi32(((7 - 127) << 23) + 0x7FFFF)), odd), 20);
  __m256i r = _mm256_blendv_epi8(norm, sub, small);
  r = _mm256_blendv_epi8(r, sat, over);
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));  // every lane now holds a code in [0, 255]
  const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  return _mm_packus_epi16(w16, w16);
}
#endif

template <bool kCount, typename T>
int64_t quantize_row_fp8(const T* x, c10::Float8_e4m3fn* q, int64_t k, float scale) {
  const Vec vs(scale);
  int64_t changed = 0;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const Vec lo(-448.f), hi(448.f);
  for (; i + kW <= k; i += kW) {
    const Vec y = load_f32(x + i) / vs;
    // clamp keeping NaN (max/min return their second operand when the first is NaN)
    const __m512 c = _mm512_min_ps(hi, _mm512_max_ps(lo, y));
    const __m128i b = at::vec::cvtfp32_fp8e4m3(c);
    if constexpr (kCount)
      changed += __builtin_popcount(_mm_cmpneq_epi8_mask(b, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec lo(-448.f), hi(448.f);
  for (; i + kW <= k; i += kW) {
    const Vec y = load_f32(x + i) / vs;
    const __m128i b = fp8e4m3_of_avx2(_mm256_min_ps(hi, _mm256_max_ps(lo, y)));  // clamp keeping NaN
    if constexpr (kCount) {
      const __m128i eq = _mm_cmpeq_epi8(b, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
      changed += 8 - __builtin_popcount(_mm_movemask_epi8(eq) & 0xFF);
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), b);
  }
#else
  alignas(64) float buf[kW];
  for (; i + kW <= k; i += kW) {
    (load_f32(x + i) / vs).store(buf);
    for (int64_t j = 0; j < kW; ++j) {
      const c10::Float8_e4m3fn c = fp8_of(buf[j]);
      if constexpr (kCount) changed += !same_code(q[i + j], c);
      q[i + j] = c;
    }
  }
#endif
  for (; i < k; ++i) {
    const c10::Float8_e4m3fn c = fp8_of(static_cast<float>(x[i]) / scale);
    if constexpr (kCount) changed += !same_code(q[i], c);
    q[i] = c;
  }
  return changed;
}

template <typename Q>
int64_t nonzero_codes(const Q* q, int64_t k) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(q);
  return k - std::count(b, b + k, uint8_t{0});
}

template <bool kCount, typename T, typename Q>
int64_t quantize_impl(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out, float qmax) {
  const int64_t rows = w.size(0), k = w.size(1);
  const int64_t ws = w.stride(0), qs = q_out.stride(0), ss = scale_out.stride(0);
  const T* wp = w.const_data_ptr<T>();
  Q* qp = q_out.data_ptr<Q>();
  float* sp = scale_out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(k, 1));
  std::atomic<int64_t> total{0};
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    int64_t changed = 0;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = wp + r * ws;
      Q* q = qp + r * qs;
      const auto [amax, finite] = row_amax(x, k);
      if (finite && amax <= kZeroRowAmax) {
        if constexpr (kCount) changed += nonzero_codes(q, k);
        std::fill(q, q + k, Q(0));
        sp[r * ss] = 1.f;
        continue;
      }
      const float scale = finite ? amax / qmax : kNaN;  // fp32 division, correctly rounded
      sp[r * ss] = scale;
      if constexpr (std::is_same_v<Q, int8_t>) {
        changed += quantize_row_int8<kCount>(x, q, k, scale);
      } else {
        changed += quantize_row_fp8<kCount>(x, q, k, scale);
      }
    }
    if constexpr (kCount) total += changed;
  });
  return total.load();
}

template <bool kCount, typename T>
int64_t quantize_dispatch_q(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out) {
  if (q_out.scalar_type() == at::kChar) return quantize_impl<kCount, T, int8_t>(w, q_out, scale_out, 127.f);
  return quantize_impl<kCount, T, c10::Float8_e4m3fn>(w, q_out, scale_out, 448.f);
}

template <bool kCount>
int64_t quantize_checked(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out) {
  constexpr const char* op = "quantize_rows";
  TORCH_CHECK(w.dim() == 2 && q_out.dim() == 2 && w.sizes() == q_out.sizes(), op,
              ": w and q_out must be [R, K] of the same shape, got ", w.sizes(), " and ", q_out.sizes());
  TORCH_CHECK(scale_out.dim() == 1 && scale_out.size(0) == w.size(0) && scale_out.scalar_type() == at::kFloat, op,
              ": scale_out must be float32 [R]");
  TORCH_CHECK(w.device().is_cpu() && q_out.device().is_cpu() && scale_out.device().is_cpu(), op, ": CPU tensors only");
  const auto wt = w.scalar_type(), qt = q_out.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf, op,
              ": w must be float32, bfloat16 or float16, got ", wt);
  TORCH_CHECK(qt == at::kChar || qt == at::kFloat8_e4m3fn, op, ": q_out must be int8 or float8_e4m3fn, got ", qt);
  TORCH_CHECK((w.stride(1) == 1 || w.size(1) <= 1) && (q_out.stride(1) == 1 || q_out.size(1) <= 1), op,
              ": rows must have unit stride");
  if (w.numel() == 0) return 0;
  switch (wt) {
    case at::kFloat:
      return quantize_dispatch_q<kCount, float>(w, q_out, scale_out);
    case at::kBFloat16:
      return quantize_dispatch_q<kCount, c10::BFloat16>(w, q_out, scale_out);
    default:
      return quantize_dispatch_q<kCount, c10::Half>(w, q_out, scale_out);
  }
}

void quantize_rows(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out) {
  quantize_checked<false>(w, q_out, scale_out);
}

// quantize_rows that also returns how many codes of q_out changed (a weight sync's statistics)
int64_t quantize_rows_counted(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out) {
  return quantize_checked<true>(w, q_out, scale_out);
}

// ------------------------------------------------------------------ the packed int8 layout
// (packed_layout.h) of the W8A8 linear, with comp[n] = sum_k q[n, k] (int32) beside it. quantize_rows_packed
// writes rows [row0, row0 + R) of that weight from R float rows, with exactly the codes and scales
// quantize_rows gives, and their sums.

inline int64_t nonzero_bytes(uint32_t x) {
  return __builtin_popcount((((x & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | x) & 0x80808080u);
}

template <bool kCount, typename T>
int64_t quantize_packed_impl(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out, at::Tensor& comp_out,
                             int64_t row0) {
  const int64_t rows = w.size(0), k = w.size(1), groups = k / 4, ws = w.stride(0);
  const T* wp = w.const_data_ptr<T>();
  int8_t* qp = q_out.data_ptr<int8_t>();
  float* sp = scale_out.data_ptr<float>();
  int32_t* cp = comp_out.data_ptr<int32_t>();
  const int64_t first = row0 / kPackRows, last = (row0 + rows - 1) / kPackRows;
  std::atomic<int64_t> total{0};
  // whole blocks per task: rows of one block share every cache line they write
  at::parallel_for(first, last + 1, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> codes(static_cast<size_t>(k));
    int64_t changed = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = std::max(row0, b * kPackRows), n1 = std::min(row0 + rows, (b + 1) * kPackRows);
      int8_t* block = qp + b * groups * kPackGroup;
      for (int64_t n = n0; n < n1; ++n) {
        const T* x = wp + (n - row0) * ws;
        const auto [amax, finite] = row_amax(x, k);
        if (finite && amax <= kZeroRowAmax) {
          std::fill(codes.begin(), codes.end(), int8_t{0});
          sp[n] = 1.f;
        } else {
          sp[n] = finite ? amax / 127.f : kNaN;
          quantize_row_int8<false>(x, codes.data(), k, sp[n]);
        }
        int32_t sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += codes[static_cast<size_t>(i)];
        cp[n] = sum;
        int8_t* dst = block + (n % kPackRows) * 4;
        for (int64_t g = 0; g < groups; ++g) {
          uint32_t v;
          std::memcpy(&v, codes.data() + 4 * g, 4);
          if constexpr (kCount) {
            uint32_t old;
            std::memcpy(&old, dst + g * kPackGroup, 4);
            changed += nonzero_bytes(old ^ v);
          }
          std::memcpy(dst + g * kPackGroup, &v, 4);
        }
      }
    }
    if constexpr (kCount) total += changed;
  });
  return total.load();
}

void check_packed(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu(), op,
              ": q must be a contiguous int8 CPU tensor [N, K] holding the packed layout");
  TORCH_CHECK(q.size(0) % kPackRows == 0 && q.size(1) % 4 == 0, op,
              ": the packed layout needs N % ", kPackRows, " == 0 and K % 4 == 0, got ", q.sizes());
}

// rows [row0, row0 + R) of the packed weight q_out [N, K] (with their scales and row sums) from w [R, K]
int64_t quantize_rows_packed(const at::Tensor& w, at::Tensor& q_out, at::Tensor& scale_out, at::Tensor& comp_out,
                             int64_t row0, bool count) {
  constexpr const char* op = "quantize_rows_packed";
  check_packed(q_out, op);
  const int64_t n = q_out.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == q_out.size(1), op, ": w must be [R, K] with K = ", q_out.size(1),
              ", got ", w.sizes());
  TORCH_CHECK(row0 >= 0 && row0 + w.size(0) <= n, op, ": rows [", row0, ", ", row0 + w.size(0),
              ") are outside the weight's ", n, " rows");
  TORCH_CHECK(scale_out.dim() == 1 && scale_out.size(0) == n && scale_out.scalar_type() == at::kFloat &&
                  scale_out.is_contiguous(), op, ": scale_out must be contiguous float32 [N]");
  TORCH_CHECK(comp_out.dim() == 1 && comp_out.size(0) == n && comp_out.scalar_type() == at::kInt &&
                  comp_out.is_contiguous(), op, ": comp_out must be contiguous int32 [N]");
  TORCH_CHECK(w.device().is_cpu() && scale_out.device().is_cpu() && comp_out.device().is_cpu(), op,
              ": CPU tensors only");
  const auto wt = w.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf, op,
              ": w must be float32, bfloat16 or float16, got ", wt);
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, op, ": rows of w must have unit stride");
  if (w.numel() == 0) return 0;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    return count ? quantize_packed_impl<true, T>(w, q_out, scale_out, comp_out, row0)
                 : quantize_packed_impl<false, T>(w, q_out, scale_out, comp_out, row0);
  };
  switch (wt) {
    case at::kFloat: return go(float{});
    case at::kBFloat16: return go(c10::BFloat16{});
    default: return go(c10::Half{});
  }
}

// the logical rows `ids` [L] of a packed weight, as a plain [L, K] int8 tensor
at::Tensor unpack_rows(const at::Tensor& q, const at::Tensor& ids) {
  constexpr const char* op = "unpack_rows";
  check_packed(q, op);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), op,
              ": ids must be a 1-D int64 CPU tensor");
  const int64_t n = q.size(0), k = q.size(1), groups = k / 4, len = ids.size(0);
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < len; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, op, ": row id ", ip[i], " outside [0, ", n, ")");
  at::Tensor out = at::empty({len, k}, q.options());
  const int8_t* qp = q.const_data_ptr<int8_t>();
  int8_t* op_ = out.data_ptr<int8_t>();
  at::parallel_for(0, len, std::max<int64_t>(1, 4096 / std::max<int64_t>(groups, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int8_t* src = qp + (ip[i] / kPackRows) * groups * kPackGroup + (ip[i] % kPackRows) * 4;
      for (int64_t g = 0; g < groups; ++g) std::memcpy(op_ + i * k + 4 * g, src + g * kPackGroup, 4);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def("quantize_rows(Tensor w, Tensor(a!) q_out, Tensor(b!) scale_out) -> ()");
  m.def("quantize_rows_counted(Tensor w, Tensor(a!) q_out, Tensor(b!) scale_out) -> int");
  m.def("quantize_rows_packed(Tensor w, Tensor(a!) q_out, Tensor(b!) scale_out, Tensor(c!) comp_out, int row0, "
        "bool count) -> int");
  m.def("unpack_rows(Tensor q, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("quantize_rows_counted", &quantize_rows_counted);
  m.impl("quantize_rows_packed", &quantize_rows_packed);
  m.impl("unpack_rows", &unpack_rows);
}

}  // namespace flashrl_native
