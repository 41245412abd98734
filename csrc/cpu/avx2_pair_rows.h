// bf16 weight rows on AVX2 CPUs (no bf16 dot products): y = x @ w.T (+ bias) for the model-dtype LM head.
//
// A 32-byte load of a bf16 row holds 16 weights as 8 lane pairs; each 32-bit lane is (w[2i + 1] << 16) | w[2i].
// Shifted left by 16 a lane is w[2i] as an fp32, masked with 0xFFFF0000 it is w[2i + 1]: two one-uop operations
// widen 16 weights exactly, where vpmovzxwd + vpslld take four operations and two loads. The tokens are widened
// to fp32 once per call in the matching order (per 16 k: the 8 even entries, then the 8 odd ones), so the dot
// product is the same sum in another order.
//
// Tiles of MT tokens x NB rows (8 x 1, 4 x 2, 2 x 4, 1 x 4: at most 8 accumulators, the tokens' fp32 rows read
// from L1 as FMA operands). The rows are walked in panels of kPairPanelRows: every token tile of the call runs
// over a panel before the next panel, so the panel's rows come from memory once (the first token tile, which
// prefetches ahead) and from L2 after that, and 8 tokens' fp32 rows (K = 896: 28 KiB) stay in L1.
// Measured on the Zen 3 VM (2 threads, the 151936 x 896 head, alternated call by call with the 4 x 2 fp32 tiles
// on vpmovzxwd-widened rows): 0.69x their time at 8 tokens, 0.77-0.91x at 4-256 (docs/native.md, "The bf16 head
// on AVX2").
#pragma once

#if defined(CPU_CAPABILITY_AVX2)

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace flashrl_native {
namespace avx2_pair_rows {

constexpr int64_t kPairPanelRows = 64;  // 112 KiB of bf16 rows at K = 896: in L2 while the token tiles pass over them
constexpr int64_t kPairPrefetchRows = 4;

// rows [0, N) in panels of kPairPanelRows, in parallel; in each panel the tokens [0, M) in tiles of 8, then one of
// 4, 2 and 1 for what is left: pass(std::integral_constant<int, MT>, m0, n0, n1) (m0 == 0: the tile that reads the
// panel from memory)
template <typename Pass>
void walk_panels(int64_t M, int64_t N, Pass&& pass) {
  const int64_t panels = (N + kPairPanelRows - 1) / kPairPanelRows;
  at::parallel_for(0, panels, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kPairPanelRows, n1 = std::min(N, n0 + kPairPanelRows);
      int64_t m0 = 0;
      for (; m0 + 8 <= M; m0 += 8) pass(std::integral_constant<int, 8>{}, m0, n0, n1);
      if (M - m0 >= 4) pass(std::integral_constant<int, 4>{}, m0, n0, n1), m0 += 4;
      if (M - m0 >= 2) pass(std::integral_constant<int, 2>{}, m0, n0, n1), m0 += 2;
      if (M - m0 >= 1) pass(std::integral_constant<int, 1>{}, m0, n0, n1);
    }
  });
}

// x [M, K] (bf16, rows ldx apart) to fp32 in pair order: dst[m * K + 16 b + i] = x[m, 16 b + 2 i] and
// dst[m * K + 16 b + 8 + i] = x[m, 16 b + 2 i + 1] (i < 8). K % 16 == 0.
inline void tokens_in_pair_order(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, float* dst) {
  const __m256i lo_mask = _mm256_set1_epi32(0xFFFF);  // as the weights: even entries shifted up, odd ones masked
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = x + m * ldx;
    float* out = dst + m * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(out + k + 8, _mm256_castsi256_ps(_mm256_andnot_si256(lo_mask, v)));
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[m * NB + j] = sum_k x[m, k] * w[j, k] for MT tokens (fp32 rows in pair order, ldx apart) and NB bf16 rows
// (ldw apart). pf > 0: prefetch each row pf bytes ahead into L2, a line per 32 weights.
template <int MT, int NB>
inline void pair_tile(const float* xp, int64_t ldx, const c10::BFloat16* w, int64_t ldw, int64_t K, float* out,
                      int64_t pf) {
  __m256 acc[MT][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const __m256 hi_mask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  for (int64_t k = 0; k < K; k += 16) {
    __m256 wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const c10::BFloat16* p = w + j * ldw + k;
      if (pf && (k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + pf, _MM_HINT_T1);
      wv[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(xp + m * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm256_and_ps(hi_mask, _mm256_loadu_ps(reinterpret_cast<const float*>(w + j * ldw + k)));
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(xp + m * ldx + k + 8);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) out[m * NB + j] = hsum8(acc[m][j]);
}

// MT tokens from m0 over rows [n0, n1): NB rows a tile, the last rows one a tile; emit(m, n, dot) per output
template <int MT, int NB, typename Emit>
inline void pass_rows(const float* xp, int64_t K, int64_t m0, const c10::BFloat16* w, int64_t ldw, int64_t n0,
                      int64_t n1, bool prefetch, Emit& emit) {
  float dots[MT * NB];
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    pair_tile<MT, NB>(xp + m0 * K, K, w + n * ldw, ldw, K, dots, prefetch ? kPairPrefetchRows * ldw * 2 : 0);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NB; ++j) emit(m0 + m, n + j, dots[m * NB + j]);
  }
  for (; n < n1; ++n) {
    pair_tile<MT, 1>(xp + m0 * K, K, w + n * ldw, ldw, K, dots, 0);
    for (int m = 0; m < MT; ++m) emit(m0 + m, n, dots[m]);
  }
}

// y[m, n] = emit(m, n, sum_k x[m, k] w[n, k]) for x [M, K] bf16 (rows ldx apart), w [N, K] bf16 (rows ldw
// apart), K % 16 == 0; xp: M * K floats of scratch
template <typename Emit>
void run(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, const c10::BFloat16* w, int64_t ldw, int64_t N,
         float* xp, Emit&& emit) {
  tokens_in_pair_order(x, ldx, M, K, xp);
  walk_panels(M, N, [&](auto MT, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int mt = decltype(MT)::value;
    constexpr int nb = mt == 8 ? 1 : mt == 4 ? 2 : 4;  // at most 8 accumulators
    pass_rows<mt, nb>(xp, K, m0, w, ldw, n0, n1, m0 == 0, emit);
  });
}

}  // namespace avx2_pair_rows
}  // namespace flashrl_native

#endif  // CPU_CAPABILITY_AVX2
