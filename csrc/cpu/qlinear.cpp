// Native CPU linear layer on per-row INT8 / FP8 weights, for rollout decoding (small M) and prefill.
//
//   y[m, n] = sum_k x'[m, k] * q[n, k] * scale[n] + bias[n]        (output in x's dtype)
//
// with x' = x (weight-only, "W8A16") or x' = dequant(quant_per_token(x)) (dynamic W8A8, INT8 only here;
// the FP8 fake-quant of x is done by the caller). The weight stays in its plain [N, K] layout, so an
// in-place weight sync (quantize_rows_ into the same storage) is seen by the next call: nothing is
// prepacked. Each call reads the int8/fp8 weight once (half the bytes of bf16) and widens it in
// registers or in a small per-thread scratch; decoding is bound by reading those bytes.
//
// Paths (chosen per call; the capability flags come from the library's build, the extensions are
// checked at run time):
//   W8A8 INT8, AVX-512 VNNI:   activations quantized per token to s8 codes (with their sum per token),
//                              weights offset to u8 = q + 128 in registers, vpdpbusd u8 x s8 -> s32, the
//                              offset removed with 128 * sum_k xq[m, k] (nothing per weight row, which a sync
//                              would have to refresh). Integer sums are exact; the product of the two fp32
//                              scales is the only rounding.
//   W8A8 INT8, AVX2:           the same per-token codes as int16, weights sign-extended to int16 in registers,
//                              vpmaddwd into int32 (madd_block); the same integers and epilogue as VNNI.
//   weight-only, bf16 x, AVX-512 BF16: rows widened to bf16 (exact: int8 and e4m3 fit in bf16), vdpbf16ps
//                              into fp32 accumulators; M <= 8 widens in registers inside the dot-product loop
//                              (drive_decode_bf16), larger M once per block of 4 rows into a per-thread scratch.
//   weight-only otherwise:     weights widened to fp32, FMA into fp32 accumulators (AVX-512 or AVX2).
//   bf16_linear:               the same bf16 tiles on a plain bf16 weight's own rows (a model-dtype LM head); AVX2
//                              builds: lane-pair fp32 tiles (avx2_pair_rows.h).
//   bf16 x on AMX-BF16 CPUs, weight-only and bf16_linear alike: AMX-BF16 tiles driven here on the rows
//   (drive_amx_rows; FLASHRL_NATIVE_AMX_BF16_MIN_M / _AMX_HEAD_MIN_M, default 1 / 5 tokens); where it is off or
//   refuses the shape, from FLASHRL_NATIVE_BF16_BRGEMM_MIN_M tokens (default 1 on AMX-BF16 CPUs, 128 on AVX-512
//   BF16 ones, never elsewhere) oneDNN's bf16 brgemm with the rows as its A operand (drive_brgemm_rows).
//   DEFAULT (portable) builds: scalar loops (the Python side prefers ATen there).
// FP8 e4m3fn widens to value * 2^-8 (the 2^8 goes into the row scale): to fp32 through fp16 (its bits shifted
// into an fp16, subnormals included, which vcvtph2ps converts exactly), to bf16 by a 128-entry table held in
// registers (wload_bf16; on AVX-512 VBMI CPUs 64 weights at a time by byte tables, wload64_bf16, with the tiles
// that use it compiled twice: bf16_row_tiles.h).
// Lanes run along K, so every (m, n) needs one horizontal sum at the end of its row. AVX-512 tiles are 4
// tokens x 4 weight rows, whose 16 sums one transposing tree (hsum16) puts in one vector, so the epilogue
// is vector code; AVX2 / portable tiles are up to 4 x 2 with a scalar epilogue. See docs/native.md.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if __has_include(<ATen/cpu/Utils.h>)
#include <ATen/cpu/Utils.h>
#define FLASHRL_HAS_INIT_AMX 1
#endif

#include "amx_tiles.h"
#include "avx2_pair_rows.h"
#include "linear_memory.h"
#include "cpu_features.h"
#include "token_quant.h"
#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace flashrl_native {
namespace {

#define FLASHRL_UNROLL _Pragma("GCC unroll 16")
#define FLASHRL_PREFETCH_HINT _MM_HINT_T1  // see kPrefetchBlocks

using fp8 = c10::Float8_e4m3fn;
constexpr int64_t kMChunk = 64;  // tokens per pass over the weight: their activations stay in L2
constexpr float kZeroRowAmax = 0x1p-100f;
// Weight rows are prefetched into L2, not L1 (prefetcht1): on the Zen 4 VM measured, T0 prefetches
// streamed the cold weights at ~15 GB/s on 2 threads and T1 at ~23 GB/s (machine read ceiling ~33),
// at every distance from 2 to 16 blocks; 4 blocks is ~14 KiB ahead at K = 896, ~78 KiB at K = 4864.
constexpr int64_t kPrefetchBlocks = 4;
constexpr int64_t kPrefetchTiles = 3;  // token tiles of a row block that prefetch (see drive512)
// tokens from which bf16-activation calls run oneDNN's brgemm (drive_brgemm_rows), by CPU class (docs/native.md):
// AMX-BF16 from 1, only where drive_amx_rows refuses the shape (K % 32 != 0): it took 0.4-0.9x brgemm's time at
// every M (and brgemm had been measured 0.85-0.93x the tiles' time at 1 token on an Emerald Rapids VM); AVX-512
// BF16 without AMX from 128 (prefill): at 1-16 tokens 1.5-2.2x slower (a 16-lane vector of B holds that few
// tokens; the same Xeon with AMX hidden), from 128 0.87-0.95x the tiles' time (Zen 4: fp8 layers and the head,
// 128-2048 tokens)
constexpr int64_t kBrgemmBf16MinMAmx = 1;
// tokens from which AMX-BF16 CPUs run drive_amx_rows (in-process interleaved A/B, Emerald Rapids VM): fp8 layers
// (rows widened into scratch) 0.77-0.86x the tiles' time at 1-4 tokens, 0.39-0.54x from 6; the bf16 head (rows
// read in place) 1.12-1.16x at 1-4 (the tiles stream the head at the machine's bandwidth; a prefetch of the 64
// row streams gained nothing), 0.77-0.89x at 6-8, 0.42-0.50x at 16
constexpr int64_t kAmxBf16MinM = 1;
constexpr int64_t kAmxBf16HeadMinM = 5;
// tokens from which widened int8 / fp8 rows run drive_amx_wb (the rows re-laid as tdpbf16ps's B) instead of
// drive_amx_rows: 0.70-0.85x its time at 512-2048 tokens, equal at 64, 1.44x at 8 (the re-laying is per block)
constexpr int64_t kAmxWbMinM = 128;
// AVX2 builds run bf16_linear on the lane-pair tiles (avx2_pair_rows.h) where K % 16 == 0: 0.69-0.91x the time of
// the fp32 tiles on vpmovzxwd-widened rows at 4-256 tokens, equal at 1 (docs/native.md, "The bf16 head on AVX2");
// FLASHRL_NATIVE_AVX2_PAIR_ROWS=0 keeps the fp32 tiles
constexpr int64_t kAvx2PairRows = 1;
constexpr int64_t kBrgemmBf16MinMNoAmx = 128;


template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// ------------------------------------------------------------------ weight-only, fp32 FMA

#if defined(CPU_CAPABILITY_AVX512)
using FVec = __m512;
inline FVec wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// lane i of the result = the sum of the 16 lanes of v[i] (a transposing tree: 48 instructions for 16 sums)
inline __m512i hsum16(const __m512i* v) {
  __m512i a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const __m512i c0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
  const __m512i c1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88), _mm512_shuffle_i32x4(b[2], b[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x88), _mm512_shuffle_i32x4(c0, c1, 0xDD));
}
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}
inline __m256i fp8_as_fp16(__m128i b) {  // 16 e4m3 bytes -> 16 fp16 holding value * 2^-8
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
  return _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xBF80)));
}
inline FVec wload(const c10::BFloat16* p) {  // exact: bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline FVec wload(const fp8* p) {
  return _mm512_cvtph_ps(fp8_as_fp16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(CPU_CAPABILITY_AVX2)
using FVec = __m256;
constexpr int64_t kFW = 8;
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(FVec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline FVec wload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline FVec wload(const c10::BFloat16* p) {  // exact: bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline FVec wload(const fp8* p) {
  __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  h = _mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xBF80)));
  return _mm256_cvtph_ps(h);
}
#endif

// the factor the vector loads leave on a weight: 1 for int8, 2^-8 for fp8 (see fp8_as_fp16)
template <typename Q>
constexpr float kVecWeightFactor = std::is_same_v<Q, fp8> ? 0x1p-8f : 1.f;

// ------------------------------------------------------------------ AVX2 / portable: MT x NB tiles, scalar epilogue
#if defined(CPU_CAPABILITY_AVX2)
// out[m * NB + j] = sum_k x[m, k] * q[j, k] (unscaled), for MT tokens and NB weight rows
// pf > 0: prefetch each row's bytes pf ahead into L2 (a line per 64 bytes of weight; see kPrefetchBlocks)
template <int MT, int NB, typename Q>
inline void fma_block(const float* x, int64_t ldx, const Q* w, int64_t ldw, int64_t k_len, float* out,
                      int64_t pf = 0) {
  FVec acc[MT][NB];
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = fzero();
  int64_t k = 0;
  for (; k + kFW <= k_len; k += kFW) {
    FVec wv[NB];
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) {
      wv[j] = wload(w + j * ldw + k);
      if (pf && (k * int64_t{sizeof(Q)}) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k) + pf, FLASHRL_PREFETCH_HINT);
    }
    FLASHRL_UNROLL for (int m = 0; m < MT; ++m) {
      const FVec xv = fload(x + m * ldx + k);
      FLASHRL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = ffma(xv, wv[j], acc[m][j]);
    }
  }
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) out[m * NB + j] = fsum(acc[m][j]);
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) {
      float tail = 0.f;
      for (int64_t t = k; t < k_len; ++t) tail += x[m * ldx + t] * to_f32(w[j * ldw + t]);
      out[m * NB + j] = out[m * NB + j] / kVecWeightFactor<Q> + tail;
    }
}

template <int MT, int NB>
inline void madd_step(const int16_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t k, __m256i (&acc)[MT][NB]) {
  __m256i wv[NB];
  FLASHRL_UNROLL for (int j = 0; j < NB; ++j)
    wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * ldw + k)));
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * ldx + k));
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) add_into(acc[m][j], _mm256_madd_epi16(xv, wv[j]));
  }
}

// W8A8 on AVX2: out[m * NB + j] = float(sum_k xq[m, k] * q[j, k]) for MT tokens of int16 codes (rows zero-padded
// to a multiple of 16) and NB int8 weight rows, sign-extended to int16 in registers. vpmaddwd multiplies 16 pairs
// and adds neighbours into 8 int32 lanes: twice fp32's products per instruction, and one widening instruction per
// 16 weights instead of two per 8. Integer sums, exact (|sum| <= 128 * 127 * K < 2^31 for K <= 65536).
template <int MT, int NB>
inline void madd_block(const int16_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t k_len, float* out,
                       int64_t pf = 0) {
  __m256i acc[MT][NB];
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 64 <= k_len; k += 64) {  // a cache line of each row per iteration: one prefetch, four steps
    if (pf)
      FLASHRL_UNROLL for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k) + pf, FLASHRL_PREFETCH_HINT);
    FLASHRL_UNROLL for (int t = 0; t < 64; t += 16) madd_step<MT, NB>(x, ldx, w, ldw, k + t, acc);
  }
  for (; k + 16 <= k_len; k += 16) madd_step<MT, NB>(x, ldx, w, ldw, k, acc);
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[m][j]), _mm256_extracti128_si256(acc[m][j], 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      int32_t total = _mm_cvtsi128_si32(s);
      for (int64_t t = k; t < k_len; ++t) total += int32_t{x[m * ldx + t]} * int32_t{w[j * ldw + t]};
      out[m * NB + j] = static_cast<float>(total);
    }
}
#elif !defined(CPU_CAPABILITY_AVX512)
template <int MT, int NB, typename Q>
inline void fma_block(const float* x, int64_t ldx, const Q* w, int64_t ldw, int64_t k_len, float* out,
                      int64_t = 0) {
  FLASHRL_UNROLL for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL for (int j = 0; j < NB; ++j) {
      float s = 0.f;
      for (int64_t t = 0; t < k_len; ++t) s += x[m * ldx + t] * to_f32(w[j * ldw + t]);
      out[m * NB + j] = s;
    }
}
#endif

// ------------------------------------------------------------------ weight-only, bf16 dot products

#if defined(CPU_CAPABILITY_AVX512)
#define FLASHRL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// 32 weights widened to bf16 in k order (exact), times kVecWeightFactor for fp8
FLASHRL_BF16_TARGET inline __m512bh wload_bf16(const int8_t* p) {
  const __m512 lo = wload(p), hi = wload(p + 16);
  return _mm512_cvtne2ps_pbh(hi, lo);
}
// e4m3 -> bf16 by table: bf16 bits of value * 2^-8 for each of the 128 magnitudes (exponent field e, mantissa
// m: (1 + m / 8) * 2^(e - 15) for e >= 1, m * 2^-17 for the subnormals and zero), looked up with two
// 64-entry word permutes and a blend on bit 6, then the sign put back: 6 vector ops per 32 weights,
// branch-free; the four table registers stay loaded across the decode tiles' loops.
struct Fp8Bf16Table {
  uint16_t bits[128];
  constexpr Fp8Bf16Table() : bits() {
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      if (e > 0) {
        bits[c] = static_cast<uint16_t>(((e + 112) << 7) | (m << 4));
      } else if (m > 0) {  // m * 2^-17 = 2^(p - 17) * (m / 2^p) with 2^p <= m < 2^(p + 1)
        const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;
        bits[c] = static_cast<uint16_t>(((110 + p) << 7) | (((m << (7 - p)) & 0x7F)));
      }
    }
  }
};
alignas(64) constexpr Fp8Bf16Table kFp8Bf16{};

FLASHRL_BF16_TARGET inline __m512bh wload_bf16(const fp8* p) {
  const __m512i t0 = _mm512_load_si512(kFp8Bf16.bits), t1 = _mm512_load_si512(kFp8Bf16.bits + 32);
  const __m512i t2 = _mm512_load_si512(kFp8Bf16.bits + 64), t3 = _mm512_load_si512(kFp8Bf16.bits + 96);
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i lo = _mm512_permutex2var_epi16(t0, w, t1);  // magnitudes 0..63 (index: bits 5..0 of w)
  const __m512i hi = _mm512_permutex2var_epi16(t2, w, t3);  // magnitudes 64..127
  const __m512i r = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
  // r | (w & 0x8000): w is sign-extended, so bit 15 is the sign
  return (__m512bh)_mm512_ternarylogic_epi32(r, w, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}

// e4m3 -> bf16 by byte tables (AVX-512 VBMI): the high and the low byte of the same 128 entries, each looked up
// for 64 weights by one two-register byte permute, the sign put into the high bytes, and the two byte vectors
// interleaved into k order by two more byte permutes: 5 vector ops per 64 weights against wload_bf16's 12.
// Measured on Zen 4: the fp8 layers at 1-4 tokens 0.78-0.82x the time, at 5-8 0.92-0.94x (docs/native.md).
struct Fp8Bf16ByteTables {
  uint8_t hi[128], lo[128], even[64], odd[64];  // even / odd: interleave (lo, hi) bytes 0..31 / 32..63
  constexpr Fp8Bf16ByteTables() : hi(), lo(), even(), odd() {
    for (int c = 0; c < 128; ++c) {
      hi[c] = static_cast<uint8_t>(kFp8Bf16.bits[c] >> 8);
      lo[c] = static_cast<uint8_t>(kFp8Bf16.bits[c] & 0xFF);
    }
    for (int i = 0; i < 32; ++i) {
      even[2 * i] = static_cast<uint8_t>(i);
      even[2 * i + 1] = static_cast<uint8_t>(64 + i);
      odd[2 * i] = static_cast<uint8_t>(32 + i);
      odd[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
  }
};
alignas(64) constexpr Fp8Bf16ByteTables kFp8Bf16Bytes{};

#define FLASHRL_BF16_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
// 64 e4m3 weights -> bf16 of value * 2^-8, k 0..31 in a and 32..63 in b (exact, as wload_bf16)
FLASHRL_BF16_VBMI_TARGET inline void wload64_bf16(const fp8* p, __m512bh& a, __m512bh& b) {
  const __m512i w = _mm512_loadu_si512(p);  // the permutes read index bits 6..0: the magnitude
  const __m512i hi = _mm512_ternarylogic_epi32(
      _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Bf16Bytes.hi), w, _mm512_load_si512(kFp8Bf16Bytes.hi + 64)), w,
      _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (w & 0x80)
  const __m512i lo =
      _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Bf16Bytes.lo), w, _mm512_load_si512(kFp8Bf16Bytes.lo + 64));
  a = (__m512bh)_mm512_permutex2var_epi8(lo, _mm512_load_si512(kFp8Bf16Bytes.even), hi);
  b = (__m512bh)_mm512_permutex2var_epi8(lo, _mm512_load_si512(kFp8Bf16Bytes.odd), hi);
}

// ------------------------------------------------------------------ W8A8 int8, VNNI
#define FLASHRL_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// cpu_has (cpu_features.h): FLASHRL_NATIVE_CPU_DISABLE=avx512bf16,avx512vnni,avx512vbmi hides them
const bool kHasBf16 = cpu_has("avx512bf16");
const bool kHasFp8Bytes = kHasBf16 && cpu_has("avx512vbmi");  // wload64_bf16 (every BF16 CPU but Cooper Lake)
const bool kHasVnni = cpu_has("avx512vnni");
const bool kHasW8A8 = kHasVnni;  // AVX-512 builds: vpdpbusd (AVX-512 without VNNI emulates W8A8 on the fp32 tiles)
#elif defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasBf16 = false;
constexpr bool kHasW8A8 = true;  // vpmaddwd (madd_block)
#else
constexpr bool kHasBf16 = false;
constexpr bool kHasW8A8 = false;
#endif

// rows of x (any float dtype) to a fp32 [M, K] buffer
template <typename T>
void rows_to_f32(const T* x, int64_t ldx, int64_t M, int64_t K, float* dst) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t k = 0; k < K; ++k) dst[m * K + k] = to_f32(x[m * ldx + k]);
  });
}

// ------------------------------------------------------------------ AVX2 / portable drivers
#if !defined(CPU_CAPABILITY_AVX512)

// Walks tokens in chunks of kMChunk and, inside each, weight rows NB at a time (parallel over rows), then
// tokens MT at a time; `block(m0, mt, n0, nb, out)` fills out[mt * nb] with unscaled dot products for
// tokens [m0, m0 + mt) and rows [n0, n0 + nb); `emit(m, n, dot)` writes one output.
template <int NB, typename Block, typename Emit>
void drive(int64_t M, int64_t N, Block&& block, Emit&& emit) {
  const int64_t nblocks = (N + NB - 1) / NB;
  for (int64_t mc = 0; mc < M; mc += kMChunk) {
    const int64_t mend = std::min(M, mc + kMChunk);
    // grain: enough rows that each task reads >= 64 KiB of weight (for K ~ 1k) but every thread gets work
    at::parallel_for(0, nblocks, 8, [&](int64_t b0, int64_t b1) {
      float dots[8 * 16];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, nb = std::min<int64_t>(NB, N - n0);
        for (int64_t m0 = mc; m0 < mend;) {
          const int64_t left = mend - m0;
          const int64_t mt = left >= 4 ? 4 : left >= 2 ? 2 : 1;  // 4 x 2 accumulators fit AVX2's 16 registers
          block(m0, mt, n0, nb, dots);
          for (int64_t m = 0; m < mt; ++m)
            for (int64_t j = 0; j < nb; ++j) emit(m0 + m, n0 + j, dots[m * nb + j]);
          m0 += mt;
        }
      }
    });
  }
}

// dispatch a runtime (mt, nb) to a compiled kernel: MT in {4, 2, 1}, NB = the driver's or 1 for the last rows
template <int NB, typename F>
inline void by_shape(int64_t mt, int64_t nb, F&& f) {
  auto go = [&](auto mtc) {
    constexpr int MT = decltype(mtc)::value;
    if (nb == NB) {
      f(std::integral_constant<int, MT>{}, std::integral_constant<int, NB>{});
    } else {
      for (int64_t j = 0; j < nb; ++j) f(std::integral_constant<int, MT>{}, std::integral_constant<int, 1>{}, j);
    }
  };
  switch (mt) {
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    default: go(std::integral_constant<int, 1>{});
  }
}

// drive<2> with a compiled block kernel per tile shape: kernel(MT, NB, m0, n0, out, pf) fills out[MT * NB]
// ([token][row]) for tokens [m0, m0 + MT) and rows [n0, n0 + NB); pf > 0 on the first token tile of a row block
template <typename Kernel, typename Emit>
void drive_pairs(int64_t M, int64_t N, int64_t pf_bytes, Kernel&& kernel, Emit&& emit) {
  drive<2>(M, N, [&](int64_t m0, int64_t mt, int64_t n0, int64_t nb, float* out) {
    const int64_t pf = m0 % kMChunk == 0 ? pf_bytes : 0;
    by_shape<2>(mt, nb, [&](auto MT, auto NB, int64_t j = 0) {
      kernel(MT, NB, m0, n0 + j, out + j * decltype(MT)::value, pf);
    });
    if (nb != 2) {  // the single-row calls wrote [row][token]
      float t[16];
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t m = 0; m < mt; ++m) t[m * nb + j] = out[j * mt + m];
      std::copy(t, t + mt * nb, out);
    }
  }, emit);
}

template <typename Out>
struct Writer {
  Out* y;
  int64_t ldy;
  const float* scale;
  const float* bias;  // fp32 copy or nullptr
  inline void operator()(int64_t m, int64_t n, float v) const {
    float r = v * scale[n];
    if (bias) r += bias[n];
    y[m * ldy + n] = static_cast<Out>(r);
  }
};
#endif


#if !defined(CPU_CAPABILITY_AVX512)
// y = x @ (w * scale).T + bias with fp32 FMAs; scale may be null (1)
template <typename Out, typename Q>
void run_weight_only(const at::Tensor& x, const Q* w, int64_t ldw, int64_t N, const float* scale, const float* bias,
                     at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> ones;
  if (!scale) {
    ones.assign(static_cast<size_t>(N), 1.f);
    scale = ones.data();
  }
  Writer<Out> emit{y.data_ptr<Out>(), N, scale, bias};
  std::vector<float> xf_buf;
  const float* xf;
  if (x.scalar_type() == at::kFloat) {
    xf = x.const_data_ptr<float>();
  } else {
    xf_buf.resize(static_cast<size_t>(M * K));
    rows_to_f32(x.const_data_ptr<Out>(), x.stride(0), M, K, xf_buf.data());
    xf = xf_buf.data();
  }
  const int64_t ldx = x.scalar_type() == at::kFloat ? x.stride(0) : K;
  const int64_t pf_bytes = kPrefetchBlocks * 2 * ldw * int64_t{sizeof(Q)};
  drive_pairs(M, N, pf_bytes, [&](auto MT, auto NB, int64_t m0, int64_t n0, float* out, int64_t pf) {
    fma_block<decltype(MT)::value, decltype(NB)::value>(xf + m0 * ldx, ldx, w + n0 * ldw, ldw, K, out, pf);
  }, emit);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// y = (dot * scale[n]) * xs[m] + bias[n] with one explicit FMA: the AVX-512 kernels' epilogue (store_tile), so
// that the W8A8 outputs of every CPU class round alike
template <typename Out>
struct W8A8Writer {
  Out* y;
  int64_t ldy;
  const float* scale;
  const float* xs;
  const float* bias;  // fp32 copy or nullptr
  inline void operator()(int64_t m, int64_t n, float dot) const {
    y[m * ldy + n] = static_cast<Out>(std::fma(dot * scale[n], xs[m], bias ? bias[n] : 0.f));
  }
};

// dynamic W8A8 on AVX2: tokens quantized per token (the spec) to int16 codes, then madd_block tiles
template <typename Out>
void run_w8a8_avx2(const at::Tensor& x, const int8_t* w, int64_t ldw, int64_t N, const float* scale,
                   const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldu = (K + 15) / 16 * 16;
  std::vector<int16_t> xq(static_cast<size_t>(M * ldu));
  std::vector<float> xs(static_cast<size_t>(M));
  quantize_tokens_avx2<int16_t>(x.const_data_ptr<Out>(), x.stride(0), M, K, ldu, xq.data(), xs.data());
  const W8A8Writer<Out> emit{y.data_ptr<Out>(), N, scale, xs.data(), bias};
  const int64_t pf_bytes = kPrefetchBlocks * 2 * ldw;
  drive_pairs(M, N, pf_bytes, [&](auto MT, auto NB, int64_t m0, int64_t n0, float* out, int64_t pf) {
    madd_block<decltype(MT)::value, decltype(NB)::value>(xq.data() + m0 * ldu, ldu, w + n0 * ldw, ldw, K, out, pf);
  }, emit);
}
#endif


#if defined(CPU_CAPABILITY_AVX512)
// ------------------------------------------------------------------ AVX-512 tiles: 4 tokens x 4 weight rows
// Each tile returns its 16 dot products in one vector (lane 4 m + j), so the scales, the bias and the
// store are vector operations too. Rows past the end of x or q point at the tile's first row: computed,
// never stored.

// weight rows widened once per tile row-block into an L1/L2 scratch (value * kVecWeightFactor, exact), so
// that every token tile after the first multiplies without converting again (bf16: bf16_row_tiles.h)
template <typename Q>
inline void widen_row_f32(const Q* w, int64_t K, float* dst, int64_t pf) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (pf && k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + pf, FLASHRL_PREFETCH_HINT);
    _mm512_storeu_ps(dst + k, wload(w + k));
  }
  for (; k < K; ++k) dst[k] = to_f32(w[k]) * kVecWeightFactor<Q>;
}

// the 16 dot products of a 4 x 4 tile over the last K - k < one vector of columns, scalar (lane 4 m + j)
template <typename X, typename W>
inline __m512 tail_dots(const X* const* xr, const W* const* wr, int64_t k, int64_t K) {
  alignas(64) float tail[16];
  for (int i = 0; i < 16; ++i) {
    float t = 0.f;
    for (int64_t kk = k; kk < K; ++kk) t += to_f32(xr[i / 4][kk]) * to_f32(wr[i % 4][kk]);
    tail[i] = t;
  }
  return _mm512_load_ps(tail);
}

inline __m512 fma_tile(const float* const* xr, const float* const* wr, int64_t K) {
  __m512 acc[4][4];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wr[j] + k);
    FLASHRL_UNROLL for (int m = 0; m < 4; ++m) {
      const __m512 xv = _mm512_loadu_ps(xr[m] + k);
      FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  __m512 flat[16];  // a copy: acc never has its address taken and stays in registers
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) flat[4 * m + j] = acc[m][j];
  __m512 r = hsum16(flat);
  return k < K ? _mm512_add_ps(r, tail_dots(xr, wr, k, K)) : r;
}

FLASHRL_BF16_TARGET inline __m512 bf16_tile(const c10::BFloat16* const* xr, const c10::BFloat16* const* wr,
                                             int64_t K, int64_t pf) {
  __m512 acc[4][4];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[4];
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) {
      wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + pf, FLASHRL_PREFETCH_HINT);
    }
    FLASHRL_UNROLL for (int m = 0; m < 4; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[m] + k);
      FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  __m512 flat[16];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) flat[4 * m + j] = acc[m][j];
  __m512 r = hsum16(flat);
  return k < K ? _mm512_add_ps(r, tail_dots(xr, wr, k, K)) : r;
}

// vpdpbusd multiplies unsigned by signed bytes: the weights are offset to u8 = q + 128 in registers (an xor,
// on pipes the dot products leave idle) and the activations stay signed, so
//   sum_k (q + 128) * xq - 128 * sum_k xq = sum_k q * xq,
// exact in int32 for K <= 65536, as fp32 (lane 4 m + j). The token code sums come from the quantizer, so
// nothing per weight row is needed (no row sums a sync would have to refresh) and every vpdpbusd is a product.
FLASHRL_VNNI_TARGET inline __m512 vnni_tile(const int8_t* const* xr, const int8_t* const* wr, int64_t K,
                                             int64_t pf, const int32_t* xsum4) {
  __m512i acc[4][4];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t k_full = K / 64 * 64;
  const __mmask64 tail_mask = (__mmask64{1} << (K - k_full)) - 1;
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = k < k_full ? ~__mmask64{0} : tail_mask;
    __m512i wv[4];
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) {
      // past K: weight 0 (offset 128) times activation padding 0
      wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[j] + k), offset);
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + pf, FLASHRL_PREFETCH_HINT);
    }
    FLASHRL_UNROLL for (int m = 0; m < 4; ++m) {
      const __m512i xv = _mm512_loadu_si512(xr[m] + k);  // rows padded to a multiple of 64
      FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
    }
  }
  __m512i flat[16];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) flat[4 * m + j] = acc[m][j];
  const __m512i lane_token = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i corr = _mm512_permutexvar_epi32(lane_token, _mm512_castsi128_si512(_mm_loadu_si128(
                                                                 reinterpret_cast<const __m128i*>(xsum4))));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(hsum16(flat), _mm512_slli_epi32(corr, 7)));
}

// writes one tile's 16 dot products (lane 4 m + j: token m0 + m, row n0 + j) as
// y = dot * scale[row] (* xs[token]) + bias[row], for the mt tokens and the rows in nmask
template <typename Out>
inline void store_tile(__m512 dots, __m512 colscale, __m512 colbias, const float* xs, int64_t m0, int64_t mt,
                       __mmask8 nmask, Out* yr, int64_t N) {
  // (dot * scale) * xs + bias with one explicit FMA: the compiler may not contract it differently per kernel,
  // so this and qlinear_packed.cpp's epilogue round alike (their outputs are bit-identical)
  __m512 v = _mm512_mul_ps(dots, colscale);
  __m512 xsv = _mm512_set1_ps(1.f);
  if (xs) {
    const __m512i xs_idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128 s4 = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << mt) - 1), xs + m0);
    xsv = _mm512_permutexvar_ps(xs_idx, _mm512_castps128_ps512(s4));
  }
  v = _mm512_fmadd_ps(v, xsv, colbias);
  const int64_t nb = __builtin_popcount(nmask);
  if constexpr (std::is_same_v<Out, float>) {
    alignas(64) float buf[16];
    _mm512_store_ps(buf, v);
    for (int64_t m = 0; m < mt; ++m) _mm_mask_storeu_ps(yr + m * N, nmask, _mm_load_ps(buf + 4 * m));
  } else if constexpr (std::is_same_v<Out, c10::BFloat16>) {
    alignas(32) uint16_t buf[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), at::vec::cvtfp32_bf16(v));
    for (int64_t m = 0; m < mt; ++m)
      _mm_mask_storeu_epi16(yr + m * N, nmask, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(buf + 4 * m)));
  } else {
    alignas(64) float buf[16];
    _mm512_store_ps(buf, v);
    for (int64_t m = 0; m < mt; ++m)
      for (int64_t j = 0; j < nb; ++j) yr[m * N + j] = static_cast<Out>(buf[4 * m + j]);
  }
}

// y[m0 + m, n0 + j] = dot * xs[m0 + m] * scale[n0 + j] + bias[n0 + j] for every tile, tiles over threads by rows
// `rows(n0, nb, wr)` points wr[0..3] at the tile's 4 weight rows (rows past N at the first), in the element
// type W the tile multiplies (int8 as stored, or a widened scratch copy owned by the rows functor's thread)
template <typename Out, typename X, typename W, typename Rows, typename Tile>
void drive512(int64_t M, int64_t N, int64_t K, const X* x, int64_t ldx, const float* xs, const float* scale,
              const float* bias, Out* y, Rows&& make_rows, Tile&& tile, int64_t ldw_bytes) {
  const int64_t nblocks = (N + 3) / 4;
  for (int64_t mc = 0; mc < M; mc += kMChunk) {
    const int64_t mend = std::min(M, mc + kMChunk);
    at::parallel_for(0, nblocks, 8, [&](int64_t b0, int64_t b1) {
      auto rows = make_rows();  // per task: its own scratch
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = 4 * b, nb = std::min<int64_t>(4, N - n0);
        const __mmask8 nmask = static_cast<__mmask8>((1u << nb) - 1);
        const W* wr[4];
        rows(n0, nb, wr);
        const __m512 colscale = scale ? _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(nmask, scale + n0))
                                      : _mm512_set1_ps(1.f);
        const __m512 colbias = bias ? _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(nmask, bias + n0)) : _mm512_setzero_ps();
        for (int64_t m0 = mc; m0 < mend; m0 += 4) {
          const int64_t mt = std::min<int64_t>(4, mend - m0);
          const X* xr[4];
          for (int m = 0; m < 4; ++m) xr[m] = x + (m0 + (m < mt ? m : 0)) * ldx;
          // token tile t < kPrefetchTiles of a row block prefetches the block (t + 1) * kPrefetchBlocks ahead, a
          // line per weight load: the first tile's prefetches stay kPrefetchBlocks ahead, the later tiles' keep
          // the memory busy while they compute on rows already in L1 (their prefetches of blocks the first tile
          // will ask for again make those requests hits)
          const int64_t tix = (m0 - mc) / 4, dist = kPrefetchBlocks * (1 + tix);
          const int64_t pf = (tix < kPrefetchTiles && b + dist < b1) ? dist * 4 * ldw_bytes : 0;
          store_tile(tile(xr, wr, K, pf, m0), colscale, colbias, xs, m0, mt, nmask, y + m0 * N + n0, N);
        }
      }
    });
  }
}

// ------------------------------------------------------------------ bf16 rows widened from int8 / fp8
// 32 weights of row w from k (fewer at the tail, zero past K), widened to bf16 (times kVecWeightFactor)
template <typename Q>
FLASHRL_BF16_TARGET inline __m512bh wload_bf16_tail(const Q* w, int64_t k, int64_t K) {
  alignas(64) Q buf[32] = {};
  for (int64_t t = k; t < K; ++t) buf[t - k] = w[t];
  return wload_bf16(buf);
}
FLASHRL_BF16_TARGET inline __m512bh xload_bf16(const c10::BFloat16* x, int64_t k, int64_t K, bool tail) {
  if (!tail) return (__m512bh)_mm512_loadu_si512(x + k);
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1), x + k);
}

// two copies of bf16_row_tiles.h: fp8 widened by word tables (any AVX-512 BF16 CPU) or by byte tables (VBMI too)
namespace bf16_word_tiles {
#define FLASHRL_TILES_TARGET FLASHRL_BF16_TARGET
#define FLASHRL_TILES_TARGET_STR target("avx512f,avx512bw,avx512vl,avx512bf16")
#define FLASHRL_TILES_FP8_BYTES 0
#include "bf16_row_tiles.h"
#undef FLASHRL_TILES_TARGET
#undef FLASHRL_TILES_TARGET_STR
#undef FLASHRL_TILES_FP8_BYTES
}  // namespace bf16_word_tiles
namespace bf16_byte_tiles {
#define FLASHRL_TILES_TARGET FLASHRL_BF16_VBMI_TARGET
#define FLASHRL_TILES_TARGET_STR target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")
#define FLASHRL_TILES_FP8_BYTES 1
#include "bf16_row_tiles.h"
#undef FLASHRL_TILES_TARGET
#undef FLASHRL_TILES_TARGET_STR
#undef FLASHRL_TILES_FP8_BYTES
}  // namespace bf16_byte_tiles

template <typename Q>
inline void widen_row_bf16(const Q* w, int64_t K, c10::BFloat16* dst, int64_t pf) {
  if constexpr (std::is_same_v<Q, fp8>) {
    if (kHasFp8Bytes) return bf16_byte_tiles::widen_row_bf16(w, K, dst, pf);
  }
  bf16_word_tiles::widen_row_bf16(w, K, dst, pf);
}
template <typename Q>
void drive_decode_bf16(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx, const Q* w, int64_t ldw,
                       const float* scale, const float* bias, c10::BFloat16* y) {
  if constexpr (std::is_same_v<Q, fp8>) {
    if (kHasFp8Bytes) return bf16_byte_tiles::drive_decode_bf16(M, N, K, x, ldx, w, ldw, scale, bias, y);
  }
  bf16_word_tiles::drive_decode_bf16(M, N, K, x, ldx, w, ldw, scale, bias, y);
}

// row loaders for drive512
template <typename W>
struct StoredRows {  // the stored rows themselves (int8 for W8A8, bf16 for a plain bf16 weight)
  const W* w;
  int64_t ldw;
  void operator()(int64_t n0, int64_t nb, const W** wr) const {
    for (int j = 0; j < 4; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * ldw;
  }
};
template <typename Q, typename W>
struct WidenedRows {  // rows widened to W (fp32 or bf16) into a per-task scratch
  const Q* w;
  int64_t ldw, K, N;
  std::vector<W> buf;
  W* rows = nullptr;
  int64_t ld = 0;
  void operator()(int64_t n0, int64_t nb, const W** wr) {
    if (rows == nullptr) {
      // every scratch row starts on a cache line: the widening writes whole 64-byte vectors, and one that
      // straddles two lines costs two stores (measured: a third of the fp8 widening time unaligned)
      constexpr int64_t kLine = 64 / int64_t{sizeof(W)};
      ld = (K + kLine - 1) / kLine * kLine;
      buf.resize(static_cast<size_t>(4 * ld + kLine));
      const auto addr = reinterpret_cast<std::uintptr_t>(buf.data());
      rows = reinterpret_cast<W*>((addr + 63) / 64 * 64);
    }
    for (int j = 0; j < 4; ++j) {
      W* dst = rows + j * ld;
      if (j < nb) {
        // the source block kPrefetchBlocks ahead is asked for while this one is widened
        const int64_t pf = n0 + 4 * (kPrefetchBlocks + 1) <= N ? kPrefetchBlocks * 4 * ldw * int64_t{sizeof(Q)} : 0;
        if constexpr (std::is_same_v<W, float>) {
          widen_row_f32(w + (n0 + j) * ldw, K, dst, pf);
        } else {
          widen_row_bf16(w + (n0 + j) * ldw, K, dst, pf);
        }
      }
      wr[j] = j < nb ? dst : rows;
    }
  }
};

// ------------------------------------------------------------------ weight rows x packed tokens, oneDNN brgemm
// y^T = W x^T with the weight rows as brgemm's A operand (plain rows, read where they are: the bf16 LM head; or
// int8 / fp8 rows widened to bf16 into a per-thread scratch, once per row block and token chunk) and the tokens
// as its VNNI-2 B operand, packed once per call. Nothing of the weight is prepacked, so in-place syncs are seen.
// On AMX-BF16 CPUs oneDNN runs tdpbf16ps tiles (16 x 32 bf16 per instruction); elsewhere its AVX-512 BF16 code.
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define FLASHRL_HAS_BF16_BRGEMM 1
constexpr int64_t kBrgRows = 64;  // weight rows per brgemm call
constexpr int64_t kBrgMaxTokens = 64;  // tokens per brgemm call (the packed block's ld_b, also C's ld)
constexpr int64_t kBrgChunkBytes = int64_t{512} << 10;  // packed tokens per pass over the weight (stay in L2)

// tokens per packed block: 16, 32, 48 or 64 (whole AMX tile columns), so decode sizes pack no 64-wide blocks
inline int64_t brgemm_token_block(int64_t M) { return std::min(kBrgMaxTokens, (M + 15) / 16 * 16); }

// 16 x 16 fp32 transpose in registers: v[r] lane c -> v[c] lane r
inline void transpose16(__m512* v) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4 g + j], 128-bit lane L: rows 4 g .. 4 g + 3 of column 4 L + j
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 s0 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 s1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 s2 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 s3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    v[j] = _mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(2, 0, 2, 0));
    v[4 + j] = _mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(3, 1, 3, 1));
    v[8 + j] = _mm512_shuffle_f32x4(s2, s3, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + j] = _mm512_shuffle_f32x4(s2, s3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// a worker's buffer for a block's widened rows (622 KB at K = 4864, once a fresh mmap per token pass)
struct WidenedBlock;
inline c10::BFloat16* rows_scratch(int64_t n) { return thread_scratch<c10::BFloat16, WidenedBlock>(n); }

// x [M, K] bf16 rows (K even) -> [ceil(M / tb)][K / 2][tb] pairs of k (VNNI-2), in the calling thread's buffer,
// reused from call to call (grown, never shrunk): a fresh one per call faulted its pages in again at prefill
// sizes (M x K x 2 bytes: 40 MB at 4096 x 4864). 16 tokens x 16 pairs at a time through a register transpose;
// columns past M are zero where a 16-token group has tokens, else unwritten (brgemm is called with N = the valid
// tokens, and a column of C depends on its own column of B only; drive_amx_rows zeroes them).
inline uint32_t* pack_tokens_vnni2(const c10::BFloat16* x, int64_t ldx, int64_t M, int64_t K, int64_t tb) {
  const int64_t kp = K / 2, nblk = (M + tb - 1) / tb;
  struct PackedTokens;
  uint32_t* out = thread_scratch<uint32_t, PackedTokens>(static_cast<size_t>(nblk * kp * tb));
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tn = std::min(tb, M - b * tb);
      uint32_t* blk = out + b * kp * tb;
      for (int64_t t0 = 0; t0 < tn; t0 += 16) {
        const int64_t tr = std::min<int64_t>(16, tn - t0);
        int64_t p0 = 0;
        for (; p0 + 16 <= kp; p0 += 16) {
          __m512 v[16];
          for (int i = 0; i < 16; ++i)
            v[i] = i < tr ? _mm512_loadu_ps(reinterpret_cast<const float*>(x + (b * tb + t0 + i) * ldx + 2 * p0))
                           : _mm512_setzero_ps();
          transpose16(v);  // v[j]: pair p0 + j of the 16 tokens
          for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(blk + (p0 + j) * tb + t0), v[j]);
        }
        for (int64_t t = 0; t < tr; ++t) {  // K's last pairs (K % 32 != 0)
          const c10::BFloat16* src = x + (b * tb + t0 + t) * ldx;
          for (int64_t p = p0; p < kp; ++p) std::memcpy(blk + p * tb + t0 + t, src + 2 * p, 4);
        }
      }
    }
  });
  return out;
}

// y[m0 + t, n0 + r] = c[r, t] * scale[n0 + r] + bias[n0 + r] for r < nn, t < mm (c: [64 rows][ldc] fp32, ldc a
// multiple of 16), with store_tile's roundings (product, then one addition)
inline void store_transposed(const float* c, int64_t ldc, int64_t nn, int64_t mm, const float* scale,
                             const float* bias, int64_t n0, int64_t m0, c10::BFloat16* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < nn; r0 += 16) {
    const int64_t rn = std::min<int64_t>(16, nn - r0);
    const __mmask16 rmask = static_cast<__mmask16>((1u << rn) - 1);
    for (int64_t t0 = 0; t0 < mm; t0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= rn) {
          v[i] = _mm512_setzero_ps();
          continue;
        }
        const int64_t n = n0 + r0 + i;
        v[i] = _mm512_loadu_ps(c + (r0 + i) * ldc + t0);
        if (scale) v[i] = _mm512_mul_ps(v[i], _mm512_set1_ps(scale[n]));
        if (bias) v[i] = _mm512_add_ps(v[i], _mm512_set1_ps(bias[n]));
      }
      transpose16(v);
      const int64_t tn = std::min<int64_t>(16, mm - t0);
      for (int64_t t = 0; t < tn; ++t)
        _mm256_mask_storeu_epi16(y + (m0 + t0 + t) * ldy + n0 + r0, rmask, at::vec::cvtfp32_bf16(v[t]));
    }
  }
}

// y = x @ (w * scale).T + bias for bf16 x [M, K] (K even); Q = bf16: w's rows are A in place; int8 / fp8: the rows
// are widened (times kVecWeightFactor, which the caller's scale undoes) into a scratch per row block
template <typename Q>
FLASHRL_BF16_TARGET void drive_brgemm_rows(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx,
                                           const Q* w, int64_t ldw, const float* scale, const float* bias,
                                           c10::BFloat16* y) {
  constexpr bool kInPlace = std::is_same_v<Q, c10::BFloat16>;
  const int64_t tb = brgemm_token_block(M);
  const uint32_t* packed = pack_tokens_vnni2(x, ldx, M, K, tb);
  const auto* b_base = reinterpret_cast<const at::BFloat16*>(packed);
  const int64_t kp = K / 2, tblocks = (M + tb - 1) / tb, rblocks = (N + kBrgRows - 1) / kBrgRows;
  const int64_t chunk = std::max<int64_t>(1, kBrgChunkBytes / (K * 2 * tb));  // token blocks per pass
  const int64_t lds = (K + 31) / 32 * 32;  // scratch rows start on cache lines
  for (int64_t tc = 0; tc < tblocks; tc += chunk) {
    const int64_t tc1 = std::min(tblocks, tc + chunk);
    // a thread owns a contiguous run of row blocks: one linear stream of weight bytes
    at::parallel_for(0, rblocks, 1, [&](int64_t b0, int64_t b1) {
      // not initialized: every row is widened before brgemm reads it
      c10::BFloat16* rows = kInPlace ? nullptr : rows_scratch(kBrgRows * lds);
      alignas(64) float c[kBrgRows * kBrgMaxTokens] = {};  // the epilogue loads whole 16-token rows
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBrgRows, nn = std::min(kBrgRows, N - n0);
        const c10::BFloat16* a;
        int64_t lda;
        if constexpr (kInPlace) {
          a = w + n0 * ldw;
          lda = ldw;
        } else {
          const int64_t pf = b + 1 < b1 ? kBrgRows * ldw * int64_t{sizeof(Q)} : 0;  // the next block's rows
          for (int64_t j = 0; j < nn; ++j) widen_row_bf16(w + (n0 + j) * ldw, K, rows + j * lds, pf);
          a = rows;
          lda = lds;
        }
        for (int64_t t = tc; t < tc1; ++t) {
          const int64_t m0 = t * tb, mm = std::min(tb, M - m0);
          at::native::cpublas::brgemm(nn, mm, K, lda, tb, tb, false, reinterpret_cast<const at::BFloat16*>(a),
                                      b_base + t * kp * tb * 2, c, true);
          store_transposed(c, tb, nn, mm, scale, bias, n0, m0, y, N);
        }
      }
      at::native::cpublas::brgemm_release(true);
    });
  }
}

// ---- the same product on AMX-BF16 tiles driven here (amx_tiles.h): no call per block, nothing prepacked
// Tiles: 1 = 16 k-pairs x 16 tokens of the VNNI-2 tokens (B), 0 and 2 = 16 weight rows x 32 k (A: the stored bf16
// rows in place, or the block's rows widened into a per-thread scratch; two, so that one loads while the other
// multiplies), 4-7 = the fp32 sums of the block's 64 rows (16 each) x the 16 tokens. K % 32 == 0.
template <typename Ops, typename Q>
FLASHRL_BF16_TARGET void drive_amx_rows(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx,
                                        const Q* w, int64_t ldw, const float* scale, const float* bias,
                                        c10::BFloat16* y) {
  constexpr bool kInPlace = std::is_same_v<Q, c10::BFloat16>;
  constexpr int64_t tb = 16;
  uint32_t* packed = pack_tokens_vnni2(x, ldx, M, K, tb);
  const int64_t kp = K / 2, tblocks = (M + tb - 1) / tb, rblocks = (N + kBrgRows - 1) / kBrgRows;
  if (M % tb) {  // the last block's columns past M: read by the tiles (their sums are never stored), so defined
    uint32_t* last = packed + (tblocks - 1) * kp * tb;
    for (int64_t p = 0; p < kp; ++p) std::fill(last + p * tb + M % tb, last + (p + 1) * tb, 0u);
  }
  const int64_t chunk = std::max<int64_t>(1, kBrgChunkBytes / (K * 2 * tb));  // token blocks per pass (L2)
  const int64_t lds = K;  // K % 32 == 0: scratch rows start on cache lines
  for (int64_t tc = 0; tc < tblocks; tc += chunk) {
    const int64_t tc1 = std::min(tblocks, tc + chunk);
    at::parallel_for(0, rblocks, 1, [&](int64_t b0, int64_t b1) {
      TileConfig cfg;
      for (int t : {0, 1, 2, 4, 5, 6, 7}) cfg.set(t, 16, 64);
      Ops::config(&cfg);
      // a full block of stored bf16 rows is read in place; widened rows (and a partial block's) go here
      const bool scratch_needed = !kInPlace || (N % kBrgRows != 0 && b1 == rblocks);
      c10::BFloat16* rows = scratch_needed ? rows_scratch(kBrgRows * lds) : nullptr;
      alignas(64) float c[kBrgRows * tb];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBrgRows, nn = std::min(kBrgRows, N - n0);
        const c10::BFloat16* a = rows;
        int64_t lda = lds;
        if (kInPlace && nn == kBrgRows) {
          a = reinterpret_cast<const c10::BFloat16*>(w) + n0 * ldw;
          lda = ldw;
        } else {
          const int64_t pf = b + 1 < b1 ? kBrgRows * ldw * int64_t{sizeof(Q)} : 0;  // the next block's rows
          for (int64_t j = 0; j < nn; ++j) {
            if constexpr (kInPlace) {
              std::memcpy(rows + j * lds, w + (n0 + j) * ldw, K * sizeof(c10::BFloat16));
            } else {
              widen_row_bf16(w + (n0 + j) * ldw, K, rows + j * lds, pf);
            }
          }
          // rows past N: zeros (their sums are never stored; defined, so the emulation reads no garbage)
          if (nn < kBrgRows) std::fill(rows + nn * lds, rows + kBrgRows * lds, c10::BFloat16(0.f));
        }
        for (int64_t t = tc; t < tc1; ++t) {
          Ops::template zero<4>();
          Ops::template zero<5>();
          Ops::template zero<6>();
          Ops::template zero<7>();
          const uint32_t* bt = packed + t * kp * tb;
          const int64_t stride = lda * int64_t{sizeof(c10::BFloat16)};
          for (int64_t k = 0; k < K; k += 32) {
            Ops::template load<1>(bt + k / 2 * tb, tb * 4);
            const c10::BFloat16* ak = a + k;
            Ops::template load<0>(ak, stride);
            Ops::template load<2>(ak + 16 * lda, stride);
            Ops::template dpbf16ps<4, 0, 1>();
            Ops::template load<0>(ak + 32 * lda, stride);
            Ops::template dpbf16ps<5, 2, 1>();
            Ops::template load<2>(ak + 48 * lda, stride);
            Ops::template dpbf16ps<6, 0, 1>();
            Ops::template dpbf16ps<7, 2, 1>();
          }
          Ops::template store<4>(c, tb * 4);
          Ops::template store<5>(c + 16 * tb, tb * 4);
          Ops::template store<6>(c + 32 * tb, tb * 4);
          Ops::template store<7>(c + 48 * tb, tb * 4);
          store_transposed(c, tb, nn, std::min(tb, M - t * tb), scale, bias, n0, t * tb, y, N);
        }
      }
      Ops::release();
    });
  }
}

// ---- widened int8 / fp8 rows as tdpbf16ps's B operand, the tokens' bf16 rows as A (read where they are)
// Per 64-row block the rows are widened (as above) and then re-laid VNNI-2 through a 16 x 16 register transpose:
// [K / 32][4 row groups][16 k-pairs][16 rows x 2 bf16], so a step of 32 k is one A load (16 token rows, ldx apart)
// and four B loads of contiguous 1 KiB, the shape of the INT8 amx driver (qlinear_packed.cpp), whose strided A
// loads measured costlier than its contiguous B loads; drive_amx_rows loads four strided weight tiles a step.
// Tiles: 0 = A, 2 and 3 = B (alternating), 4-7 = the fp32 sums of 16 tokens x 16 rows each. K % 32 == 0.
// The same fp32 sums in the same k order as drive_amx_rows: without a bias the same outputs bit for bit (with one,
// GCC may fuse the epilogue's product and addition in one driver and not the other: one bf16 rounding apart).
constexpr int64_t kAmxWbChunkBytes = int64_t{8} << 20;
template <typename Ops, typename Q>
FLASHRL_BF16_TARGET void drive_amx_wb(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx,
                                      const Q* w, int64_t ldw, const float* scale, const float* bias,
                                      c10::BFloat16* y) {
  constexpr int64_t tb = 16;
  const int64_t tblocks = (M + tb - 1) / tb, rblocks = (N + kBrgRows - 1) / kBrgRows;
  // the last partial token block from a zero-padded copy (tile rows past M must be readable)
  std::vector<c10::BFloat16> tail(static_cast<size_t>(M % tb ? tb * K : 0), c10::BFloat16(0.f));
  for (int64_t t = 0; t < M % tb; ++t)
    std::memcpy(tail.data() + t * K, x + (M - M % tb + t) * ldx, K * sizeof(c10::BFloat16));
  // token blocks per pass: a block's rows are widened and re-laid once per pass, so passes are long (measured:
  // 8 MB of tokens 0.73-0.83x the time of drive_amx_rows at 512-2048 tokens, 512 KB 0.84-1.07x)
  const int64_t chunk = std::max<int64_t>(1, kAmxWbChunkBytes / (K * 2 * tb));
  for (int64_t tc = 0; tc < tblocks; tc += chunk) {
    const int64_t tc1 = std::min(tblocks, tc + chunk);
    at::parallel_for(0, rblocks, 1, [&](int64_t b0, int64_t b1) {
      TileConfig cfg;
      for (int t : {0, 2, 3, 4, 5, 6, 7}) cfg.set(t, 16, 64);
      Ops::config(&cfg);
      // one buffer: the block's rows widened [64][K], then their VNNI-2 copy [K / 32][4][16][32]
      c10::BFloat16* rows = rows_scratch(2 * kBrgRows * K);
      c10::BFloat16* vnni = rows + kBrgRows * K;
      alignas(64) float c[tb * kBrgRows];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBrgRows, nn = std::min(kBrgRows, N - n0);
        const int64_t pf = b + 1 < b1 ? kBrgRows * ldw * int64_t{sizeof(Q)} : 0;  // the next block's rows
        for (int64_t j = 0; j < nn; ++j) widen_row_bf16(w + (n0 + j) * ldw, K, rows + j * K, pf);
        if (nn < kBrgRows) std::fill(rows + nn * K, rows + kBrgRows * K, c10::BFloat16(0.f));
        for (int64_t s = 0; s < K / 32; ++s)
          for (int g = 0; g < 4; ++g) {
            __m512 v[16];  // row g * 16 + i: its 16 k-pairs of step s
            for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows + (16 * g + i) * K + 32 * s));
            transpose16(v);  // v[p]: k-pair p of the 16 rows
            float* dst = reinterpret_cast<float*>(vnni + (4 * s + g) * 512);
            for (int p = 0; p < 16; ++p) _mm512_storeu_ps(dst + 16 * p, v[p]);
          }
        for (int64_t t = tc; t < tc1; ++t) {
          const int64_t m0 = t * tb, mm = std::min(tb, M - m0);
          const c10::BFloat16* a = mm == tb ? x + m0 * ldx : tail.data();
          const int64_t astride = (mm == tb ? ldx : K) * int64_t{sizeof(c10::BFloat16)};
          Ops::template zero<4>();
          Ops::template zero<5>();
          Ops::template zero<6>();
          Ops::template zero<7>();
          for (int64_t s = 0; s < K / 32; ++s) {
            const c10::BFloat16* bs = vnni + 4 * s * 512;
            Ops::template load<0>(a + 32 * s, astride);
            Ops::template load<2>(bs, 64);
            Ops::template load<3>(bs + 512, 64);
            Ops::template dpbf16ps<4, 0, 2>();
            Ops::template load<2>(bs + 1024, 64);
            Ops::template dpbf16ps<5, 0, 3>();
            Ops::template load<3>(bs + 1536, 64);
            Ops::template dpbf16ps<6, 0, 2>();
            Ops::template dpbf16ps<7, 0, 3>();
          }
          Ops::template store<4>(c, kBrgRows * 4);
          Ops::template store<5>(c + 16, kBrgRows * 4);
          Ops::template store<6>(c + 32, kBrgRows * 4);
          Ops::template store<7>(c + 48, kBrgRows * 4);
          // y = sum * scale + bias: store_transposed's roundings (the product, then one addition)
          for (int64_t r0 = 0; r0 < nn; r0 += 16) {
            const __mmask16 rmask = static_cast<__mmask16>(nn - r0 >= 16 ? 0xffff : (1u << (nn - r0)) - 1);
            const __m512 sc = _mm512_maskz_loadu_ps(rmask, scale + n0 + r0);
            const __m512 bi = bias ? _mm512_maskz_loadu_ps(rmask, bias + n0 + r0) : _mm512_setzero_ps();
            for (int64_t m = 0; m < mm; ++m) {
              __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c + m * kBrgRows + r0), sc);
              if (bias) v = _mm512_add_ps(v, bi);
              _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0 + r0, rmask, at::vec::cvtfp32_bf16(v));
            }
          }
        }
      }
      Ops::release();
    });
  }
}
#endif

// tokens from which a bf16-activation call runs drive_brgemm_rows (0: never); see docs/native.md
struct BrgemmBf16Config {
  bool amx_bf16 = false;  // AMX-TILE + AMX-BF16, and Linux granted this process the tile state
  int64_t min_m = 0;
  bool amx_emulated = false;  // drive_amx_rows on emulated tiles (FLASHRL_NATIVE_EMULATE=amx; a test mode)
  int64_t amx_min_m = 0;  // tokens from which a bf16-activation call runs drive_amx_rows (0: never)
  int64_t amx_head_min_m = 0;  // the same for bf16 weights (the LM head: rows read in place)
  int64_t amx_wb_min_m = 0;  // tokens from which widened rows run drive_amx_wb instead (0: never)
};
const BrgemmBf16Config& brgemm_bf16_config() {
  static const BrgemmBf16Config c = [] {
    BrgemmBf16Config r;
#if defined(FLASHRL_HAS_BF16_BRGEMM)
#if defined(FLASHRL_HAS_INIT_AMX)
    r.amx_bf16 = cpu_has("amx_bf16") && at::cpu::init_amx();
#endif
    const int64_t fallback = r.amx_bf16 ? kBrgemmBf16MinMAmx : kHasBf16 ? kBrgemmBf16MinMNoAmx : 0;
    r.min_m = kHasBf16 || r.amx_bf16 ? env_int("FLASHRL_NATIVE_BF16_BRGEMM_MIN_M", fallback) : 0;
    const char* emulate = std::getenv("FLASHRL_NATIVE_EMULATE");
    r.amx_emulated = kHasBf16 && !r.amx_bf16 && emulate && std::strstr(emulate, "amx");
    // emulated: every M (a test of the driver); real tiles: from kAmxBf16MinM / kAmxBf16HeadMinM
    if (r.amx_bf16 || r.amx_emulated) {
      r.amx_min_m = env_int("FLASHRL_NATIVE_AMX_BF16_MIN_M", r.amx_emulated ? 1 : kAmxBf16MinM);
      r.amx_head_min_m = env_int("FLASHRL_NATIVE_AMX_HEAD_MIN_M", r.amx_emulated ? 1 : kAmxBf16HeadMinM);
      r.amx_wb_min_m = env_int("FLASHRL_NATIVE_AMX_WB_MIN_M", r.amx_emulated ? 0 : kAmxWbMinM);
    }
#endif
    return r;
  }();
  return c;
}

// tokens from which drive_amx_rows runs on bf16 rows (head) or widened int8 / fp8 rows (0: never, or no AMX)
inline int64_t amx_rows_min_m(bool head) {
  const BrgemmBf16Config& c = brgemm_bf16_config();
  if (!c.amx_bf16 && !c.amx_emulated) return 0;
  return head ? dispatch_int("FLASHRL_NATIVE_AMX_HEAD_MIN_M", c.amx_head_min_m)
              : dispatch_int("FLASHRL_NATIVE_AMX_BF16_MIN_M", c.amx_min_m);
}

// (on AMX CPUs only the shapes drive_amx_rows refuses: below its threshold the tiles run)
inline bool use_brgemm_rows(int64_t M, int64_t K, bool head) {
  const BrgemmBf16Config& c = brgemm_bf16_config();
  if (amx_rows_min_m(head) > 0 && K % 32 == 0) return false;
  const int64_t min_m = kHasBf16 || c.amx_bf16 ? dispatch_int("FLASHRL_NATIVE_BF16_BRGEMM_MIN_M", c.min_m) : 0;
  return min_m > 0 && M >= min_m && K % 2 == 0;
}

#if defined(FLASHRL_HAS_BF16_BRGEMM)
// drive_amx_rows on real or emulated tiles when this call should take it; false: it did not run
template <typename Q>
bool try_amx_rows(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx, const Q* w, int64_t ldw,
                  const float* scale, const float* bias, c10::BFloat16* y) {
  const BrgemmBf16Config& c = brgemm_bf16_config();
  const int64_t min_m = amx_rows_min_m(std::is_same_v<Q, c10::BFloat16>);
  if (min_m == 0 || M < min_m || K % 32 != 0) return false;
  if constexpr (!std::is_same_v<Q, c10::BFloat16>) {
    const int64_t wb_min_m = dispatch_int("FLASHRL_NATIVE_AMX_WB_MIN_M", c.amx_wb_min_m);
    if (wb_min_m > 0 && M >= wb_min_m) {
      if (c.amx_emulated)
        drive_amx_wb<EmulatedAmxOps, Q>(M, N, K, x, ldx, w, ldw, scale, bias, y);
      else
        drive_amx_wb<AmxOps, Q>(M, N, K, x, ldx, w, ldw, scale, bias, y);
      return true;
    }
  }
  if (c.amx_emulated)
    drive_amx_rows<EmulatedAmxOps, Q>(M, N, K, x, ldx, w, ldw, scale, bias, y);
  else
    drive_amx_rows<AmxOps, Q>(M, N, K, x, ldx, w, ldw, scale, bias, y);
  return true;
}
#endif

template <typename Out>
void run_avx512(const at::Tensor& x, const at::Tensor& q, const float* scale, const float* bias, bool act_quant,
                at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), ldw = q.stride(0);
  Out* yp = y.data_ptr<Out>();
  if (act_quant) {  // int8 W8A8 (checked by the caller)
    const int64_t ldu = (K + 63) / 64 * 64;
    std::vector<int8_t> xq(static_cast<size_t>(M * ldu));
    std::vector<float> xs(static_cast<size_t>(M));
    std::vector<int32_t> xsum(static_cast<size_t>(M + 4));  // + 4: a partial tile's unused lanes read past M
    quantize_tokens_s8<false>(x.const_data_ptr<Out>(), x.stride(0), M, K, ldu, xq.data(), xs.data(), xsum.data());
    const StoredRows<int8_t> rows{q.const_data_ptr<int8_t>(), ldw};
    const int32_t* sums = xsum.data();
    drive512<Out, int8_t, int8_t>(M, N, K, xq.data(), ldu, xs.data(), scale, bias, yp, [&] { return rows; },
                                  [sums](const int8_t* const* xr, const int8_t* const* wr, int64_t k, int64_t pf,
                                         int64_t m0) { return vnni_tile(xr, wr, k, pf, sums + m0); }, ldw);
    return;
  }
  auto weight_only = [&](auto qtag) {
    using Q = decltype(qtag);
    const Q* w = q.const_data_ptr<Q>();
    // the loaders leave kVecWeightFactor on every weight: fold its inverse into the row scales
    std::vector<float> sc(scale, scale + N);
    for (float& v : sc) v /= kVecWeightFactor<Q>;
    if constexpr (std::is_same_v<Out, c10::BFloat16>) {
#if defined(FLASHRL_HAS_BF16_BRGEMM)
      if (try_amx_rows<Q>(M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), w, ldw, sc.data(), bias, yp))
        return;
      if (use_brgemm_rows(M, K, false)) {
        drive_brgemm_rows<Q>(M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), w, ldw, sc.data(), bias, yp);
        return;
      }
#endif
      if (kHasBf16 && M <= 8) {  // decode: rows widened in registers (drive_decode_bf16)
        drive_decode_bf16<Q>(M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), w, ldw, sc.data(), bias, yp);
        return;
      }
      if (kHasBf16) {
        drive512<Out, c10::BFloat16, c10::BFloat16>(
            M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), nullptr, sc.data(), bias, yp,
            [&] { return WidenedRows<Q, c10::BFloat16>{w, ldw, K, N}; },
            [](const c10::BFloat16* const* xr, const c10::BFloat16* const* wr, int64_t k, int64_t, int64_t) {
              return bf16_tile(xr, wr, k, 0);  // a widened scratch: the widening prefetches the source rows
            }, 0);
        return;
      }
    }
    std::vector<float> xf_buf;
    const float* xf = nullptr;
    int64_t ldx = K;
    if constexpr (std::is_same_v<Out, float>) {
      xf = x.const_data_ptr<float>();
      ldx = x.stride(0);
    } else {
      xf_buf.resize(static_cast<size_t>(M * K));
      rows_to_f32(x.const_data_ptr<Out>(), x.stride(0), M, K, xf_buf.data());
      xf = xf_buf.data();
    }
    drive512<Out, float, float>(M, N, K, xf, ldx, nullptr, sc.data(), bias, yp,
                                [&] { return WidenedRows<Q, float>{w, ldw, K, N}; },
                                [](const float* const* xr, const float* const* wr, int64_t k, int64_t, int64_t) {
                                  return fma_tile(xr, wr, k);
                                }, 0);
  };
  if (q.scalar_type() == at::kChar) {
    weight_only(int8_t{});
  } else {
    weight_only(fp8{});
  }
}
#endif

template <typename Out>
void run_typed(const at::Tensor& x, const at::Tensor& q, const float* scale, const float* bias, bool act_quant,
               at::Tensor& y) {
#if defined(CPU_CAPABILITY_AVX512)
  run_avx512<Out>(x, q, scale, bias, act_quant, y);
#else
#if defined(CPU_CAPABILITY_AVX2)
  if (act_quant) {  // int8 (checked by the caller)
    run_w8a8_avx2<Out>(x, q.const_data_ptr<int8_t>(), q.stride(0), q.size(0), scale, bias, y);
    return;
  }
#endif
  if (q.scalar_type() == at::kChar) {
    run_weight_only<Out, int8_t>(x, q.const_data_ptr<int8_t>(), q.stride(0), q.size(0), scale, bias, y);
  } else {
    run_weight_only<Out, fp8>(x, q.const_data_ptr<fp8>(), q.stride(0), q.size(0), scale, bias, y);
  }
#endif
}

// an optional bias [N] of any float dtype as fp32 values (empty when absent)
std::vector<float> bias_as_f32(const std::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [N]");
  const at::Tensor b = bias->to(at::kFloat).contiguous();
  return std::vector<float>(b.const_data_ptr<float>(), b.const_data_ptr<float>() + N);
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                   const std::optional<at::Tensor>& bias, bool act_quant) {
  constexpr const char* op = "qlinear";
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), op, ": x [M, K] and q [N, K], got ",
              x.sizes(), " and ", q.sizes());
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(), op, ": CPU tensors only");
  const auto xt = x.scalar_type(), qt = q.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, ": x must be float32/bfloat16/float16");
  TORCH_CHECK(qt == at::kChar || qt == at::kFloat8_e4m3fn, op, ": q must be int8 or float8_e4m3fn, got ", qt);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == q.size(0) && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(), op, ": scale must be contiguous float32 [N]");
  TORCH_CHECK((x.stride(1) == 1 || x.size(1) <= 1) && (q.stride(1) == 1 || q.size(1) <= 1), op,
              ": rows of x and q must have unit stride");
  TORCH_CHECK(!act_quant || (qt == at::kChar && kHasW8A8), op,
              ": act_quant needs int8 weights and integer dot products (AVX-512 VNNI, or an AVX2 build; "
              "qlinear_caps says where)");
  // int32 sums of (u8 + 128) * s8 (VNNI) stay exact up to K = 2^31 / (255 * 128)
  TORCH_CHECK(!act_quant || x.size(1) <= 65536, op, ": act_quant supports K <= 65536");
  const int64_t M = x.size(0), N = q.size(0);
  at::Tensor y = empty_linear_output(M, N, x.options());
  if (M == 0 || N == 0) return y;
  const std::vector<float> bias_f = bias_as_f32(bias, N, op);
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  const float* sp = scale.const_data_ptr<float>();
  switch (xt) {
    case at::kFloat: run_typed<float>(x, q, sp, bp, act_quant, y); break;
    case at::kBFloat16: run_typed<c10::BFloat16>(x, q, sp, bp, act_quant, y); break;
    default: run_typed<c10::Half>(x, q, sp, bp, act_quant, y);
  }
  return y;
}

// y = x @ w.T + bias for a plain bf16 weight (the model-dtype LM head of a quantized engine): the bf16
// dot-product tiles on the stored rows, nothing packed (an in-place sync of w is seen by the next call).
// AVX-512 BF16 CPUs: vdpbf16ps; other AVX-512 / AVX2 CPUs: rows widened to fp32 and FMAs (torch's bf16
// GEMM runs at ~1 GFLOP/s on AVX2-only CPUs). Portable builds: not available (qlinear_caps()[2] = 0).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "bf16_linear";
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
  TORCH_CHECK(false, op, ": needs an AVX2 or AVX-512 build (qlinear_caps()[2])");
#endif
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), op, ": x [M, K] and w [N, K], got ", x.sizes(),
              " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, op, ": bfloat16 x and w only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK((x.stride(1) == 1 || x.size(1) <= 1) && (w.stride(1) == 1 || w.size(1) <= 1), op,
              ": rows of x and w must have unit stride");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = empty_linear_output(M, N, x.options());
  if (M == 0 || N == 0) return y;
  const std::vector<float> bias_f = bias_as_f32(bias, N, op);
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  const c10::BFloat16* wp = w.const_data_ptr<c10::BFloat16>();
#if defined(CPU_CAPABILITY_AVX512)
#if defined(FLASHRL_HAS_BF16_BRGEMM)
  if (try_amx_rows<c10::BFloat16>(M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), wp, w.stride(0), nullptr,
                                  bp, y.data_ptr<c10::BFloat16>()))
    return y;
  if (use_brgemm_rows(M, K, true)) {
    drive_brgemm_rows<c10::BFloat16>(M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), wp, w.stride(0), nullptr,
                                     bp, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  if (kHasBf16) {
    const StoredRows<c10::BFloat16> rows{wp, w.stride(0)};
    drive512<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
        M, N, K, x.const_data_ptr<c10::BFloat16>(), x.stride(0), nullptr, nullptr, bp, y.data_ptr<c10::BFloat16>(),
        [&] { return rows; },
        [](const c10::BFloat16* const* xr, const c10::BFloat16* const* wr, int64_t k, int64_t pf, int64_t) {
          return bf16_tile(xr, wr, k, pf);
        }, w.stride(0) * 2);
    return y;
  }
  // no bf16 dot products: rows widened to fp32 (exact) and FMAs, where torch's bf16 GEMM is far slower
  std::vector<float> xf(static_cast<size_t>(M * K));
  rows_to_f32(x.const_data_ptr<c10::BFloat16>(), x.stride(0), M, K, xf.data());
  const int64_t ldw = w.stride(0);
  drive512<c10::BFloat16, float, float>(
      M, N, K, xf.data(), K, nullptr, nullptr, bp, y.data_ptr<c10::BFloat16>(),
      [&] { return WidenedRows<c10::BFloat16, float>{wp, ldw, K, N}; },
      [](const float* const* xr, const float* const* wr, int64_t k, int64_t, int64_t) {
        return fma_tile(xr, wr, k);
      }, 0);
#elif defined(CPU_CAPABILITY_AVX2)
  static const int64_t pair_rows = env_int("FLASHRL_NATIVE_AVX2_PAIR_ROWS", kAvx2PairRows);
  if (K % 16 == 0 && dispatch_int("FLASHRL_NATIVE_AVX2_PAIR_ROWS", pair_rows) != 0) {
    struct PairTokens {};
    float* xp = thread_scratch<float, PairTokens>(static_cast<size_t>(M * K));
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    avx2_pair_rows::run(x.const_data_ptr<c10::BFloat16>(), x.stride(0), M, K, wp, w.stride(0), N, xp,
                        [&](int64_t m, int64_t n, float v) { yp[m * N + n] = static_cast<c10::BFloat16>(bp ? v + bp[n] : v); });
    return y;
  }
  run_weight_only<c10::BFloat16, c10::BFloat16>(x, wp, w.stride(0), N, nullptr, bp, y);
#endif
  return y;
}

// which fast paths this build and CPU have: [native W8A8 (VNNI or AVX2 vpmaddwd), bf16 dot products, vector
// weight-only, AMX-BF16 granted, tokens from which bf16-activation calls run oneDNN brgemm (0: never), fp8 rows
// widened to bf16 by byte tables (VBMI), tokens from which they run AMX-BF16 tiles driven here (0: never), those
// tiles emulated]
std::vector<int64_t> qlinear_caps() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t vec = 1;
#else
  constexpr int64_t vec = 0;
#endif
#if defined(CPU_CAPABILITY_AVX512)
  const BrgemmBf16Config& b = brgemm_bf16_config();
  return {int64_t{kHasW8A8}, int64_t{kHasBf16}, vec, int64_t{b.amx_bf16}, b.min_m, int64_t{kHasFp8Bytes},
          b.amx_min_m, int64_t{b.amx_emulated}, b.amx_head_min_m, b.amx_wb_min_m};
#else
  return {int64_t{kHasW8A8}, int64_t{kHasBf16}, vec, 0, 0, 0, 0, 0, 0, 0};
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def("qlinear(Tensor x, Tensor q, Tensor scale, Tensor? bias, bool act_quant) -> Tensor");
  m.def("qlinear_caps() -> int[]", &qlinear_caps);
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("bf16_linear", &bf16_linear);
}

}  // namespace flashrl_native
