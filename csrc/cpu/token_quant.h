// Per-token dynamic INT8 quantization of activations for the native W8A8 linears (qlinear.cpp on plain
// weights, qlinear_packed.cpp on packed ones): the spec's quantize_per_token, vectorised (AVX-512: s8 / u8
// codes for vpdpbusd and oneDNN; AVX2: int16 codes for vpmaddwd, u8 codes for AVX-VNNI's vpdpbusd).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace flashrl_native {

inline constexpr float kTokenZeroRowAmax = 0x1p-100f;  // the spec's ZERO_ROW_AMAX

#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// the spec's per-token int8 quantization (scale = fp32(amax / 127), y = fp32(x / scale), round half even,
// zero rows scale 1; a row with NaN / inf gets scale NaN, which makes its outputs NaN), stored as int8 codes
// in rows padded with 0 to ldu, with each row's code sum in xsum[m] (the plain-layout tiles' offset
// correction; may be null). kU8: each code stored as the byte code + 128 (the unsigned operand of vpdpbusd
// and of oneDNN's u8 x s8 brgemm; the weights' row sums remove the offset), padding as 128.
template <bool kU8, typename T>
void quantize_tokens_s8(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t ldu, int8_t* xq, float* xs,
                        int32_t* xsum) {
  const int8_t pad = kU8 ? static_cast<int8_t>(0x80) : int8_t{0};
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const T* r = x + m * ldx;
      __m512 vmax = _mm512_setzero_ps(), vbad = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512 v = load16(r + k);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vbad = _mm512_add_ps(vbad, _mm512_sub_ps(v, v));  // NaN for NaN / inf lanes
      }
      float amax = _mm512_reduce_max_ps(vmax);
      bool finite = !std::isnan(_mm512_reduce_add_ps(vbad));
      for (; k < K; ++k) {
        const float v = static_cast<float>(r[k]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::abs(v));
      }
      int8_t* u = xq + m * ldu;
      if (!finite || amax <= kTokenZeroRowAmax) {
        std::fill(u, u + ldu, pad);
        xs[m] = finite ? 1.f : std::numeric_limits<float>::quiet_NaN();
        if (xsum) xsum[m] = 0;
        continue;
      }
      const float s = amax / 127.f;  // fp32 division, correctly rounded
      xs[m] = s;
      const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
      __m512i vsum = _mm512_setzero_si512();
      for (k = 0; k + 16 <= K; k += 16) {
        __m512 y = _mm512_roundscale_ps(_mm512_div_ps(load16(r + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        y = _mm512_min_ps(hi, _mm512_max_ps(lo, y));
        const __m512i qi = _mm512_cvtps_epi32(y);
        vsum = _mm512_add_epi32(vsum, qi);
        __m128i b8 = _mm512_cvtsepi32_epi8(qi);
        if constexpr (kU8) b8 = _mm_xor_si128(b8, _mm_set1_epi8(static_cast<char>(0x80)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(u + k), b8);
      }
      int32_t total = _mm512_reduce_add_epi32(vsum);
      for (; k < K; ++k) {
        const float q = std::min(127.f, std::max(-128.f, std::nearbyint(static_cast<float>(r[k]) / s)));
        u[k] = static_cast<int8_t>(static_cast<int8_t>(q) ^ (kU8 ? 0x80 : 0));
        total += static_cast<int32_t>(q);
      }
      std::fill(u + K, u + ldu, pad);
      if (xsum) xsum[m] = total;
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// The same per-token quantization as quantize_tokens_s8 (the spec), for AVX2's W8A8 tiles. Code int16_t: each
// code stored as int16, rows padded with 0 to ldu (the vpmaddwd tiles, which multiply 16-bit operands); uint8_t:
// each code stored as the byte code + 128, padding 128 (the AVX-VNNI tiles' unsigned vpdpbusd operand).
template <typename Code, typename T>
void quantize_tokens_avx2(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t ldu, Code* xq, float* xs) {
  static_assert(std::is_same_v<Code, int16_t> || std::is_same_v<Code, uint8_t>);
  constexpr bool kU8 = std::is_same_v<Code, uint8_t>;
  const Code pad = kU8 ? Code{128} : Code{0};
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t m = b; m < e; ++m) {
      const T* r = x + m * ldx;
      __m256 vmax = _mm256_setzero_ps(), vbad = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256 v = load8(r + k);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
        vbad = _mm256_add_ps(vbad, _mm256_sub_ps(v, v));  // NaN for NaN / inf lanes
      }
      alignas(32) float lanes[8], bad[8];
      _mm256_store_ps(lanes, vmax);
      _mm256_store_ps(bad, vbad);
      float amax = 0.f;
      bool finite = true;
      for (int i = 0; i < 8; ++i) {
        amax = std::max(amax, lanes[i]);
        finite = finite && !std::isnan(bad[i]);
      }
      for (; k < K; ++k) {
        const float v = static_cast<float>(r[k]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::abs(v));
      }
      Code* u = xq + m * ldu;
      if (!finite || amax <= kTokenZeroRowAmax) {
        std::fill(u, u + ldu, pad);
        xs[m] = finite ? 1.f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float s = amax / 127.f;  // fp32 division, correctly rounded
      xs[m] = s;
      const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
      for (k = 0; k + 8 <= K; k += 8) {
        __m256 y = _mm256_round_ps(_mm256_div_ps(load8(r + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, y)));
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        if constexpr (kU8) {
          const __m128i q8 = _mm_xor_si128(_mm_packs_epi16(q16, q16), _mm_set1_epi8(static_cast<char>(0x80)));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(u + k), q8);
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(u + k), q16);
        }
      }
      for (; k < K; ++k) {
        const float q = std::min(127.f, std::max(-128.f, std::nearbyint(static_cast<float>(r[k]) / s)));
        u[k] = kU8 ? static_cast<Code>(static_cast<int>(q) + 128) : static_cast<Code>(q);
      }
      std::fill(u + K, u + ldu, pad);
    }
  });
}
#endif

}  // namespace flashrl_native
