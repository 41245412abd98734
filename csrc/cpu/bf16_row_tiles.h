// The bf16 weight-only code that widens int8 / fp8 rows: decode tiles (M <= 8) and the row widening of the
// scratch paths. Included twice by qlinear.cpp, inside two namespaces (no include guard, no includes of its
// own: it uses the helpers defined before it there):
//   FLASHRL_TILES_TARGET     the target attribute of every function here, and FLASHRL_TILES_TARGET_STR its string
//   FLASHRL_TILES_FP8_BYTES  1: fp8 rows widen 64 weights at a time through byte tables (wload64_bf16, AVX-512
//                            VBMI); 0: 32 at a time through word tables (wload_bf16, any AVX-512 BF16 CPU)
// The two copies differ only in their fp8 widening; the VBMI copy is reached only on CPUs that have VBMI, so
// the compiler may use VBMI anywhere in it and nowhere in the other one.

// whether rows of Q widen 64 weights at a time in this copy
template <typename Q>
constexpr bool kWide64 = FLASHRL_TILES_FP8_BYTES && std::is_same_v<Q, fp8>;

// V * 32 weights of a row from p widened to bf16 in k order (times kVecWeightFactor)
template <typename Q, int V>
FLASHRL_TILES_TARGET inline void wload_rows(const Q* p, __m512bh* out) {
#if FLASHRL_TILES_FP8_BYTES
  if constexpr (V == 2 && kWide64<Q>) {
    wload64_bf16(p, out[0], out[1]);
    return;
  }
#endif
  FLASHRL_UNROLL for (int v = 0; v < V; ++v) out[v] = wload_bf16(p + 32 * v);
}

// a row widened once into an L1/L2 scratch (value * kVecWeightFactor, exact), so that every token tile after the
// first multiplies without converting again
template <typename Q>
FLASHRL_TILES_TARGET inline void widen_row_bf16(const Q* w, int64_t K, c10::BFloat16* dst, int64_t pf) {
  int64_t k = 0;
  if constexpr (kWide64<Q>) {
    for (; k + 64 <= K; k += 64) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w + k) + pf, FLASHRL_PREFETCH_HINT);
      __m512bh v[2];
      wload_rows<Q, 2>(w + k, v);
      _mm512_storeu_si512(dst + k, (__m512i)v[0]);
      _mm512_storeu_si512(dst + k + 32, (__m512i)v[1]);
    }
  }
  for (; k + 32 <= K; k += 32) {
    if (pf && (k * int64_t{sizeof(Q)}) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + pf, FLASHRL_PREFETCH_HINT);
    _mm512_storeu_si512(dst + k, (__m512i)wload_bf16(w + k));
  }
  for (; k < K; ++k) dst[k] = c10::BFloat16(to_f32(w[k]) * kVecWeightFactor<Q>);
}

// Widening through a scratch (WidenedRows) stores every widened vector and loads it back per token tile, and
// its widening loop cannot overlap the dot products of the tiles. At decode sizes the dot products are few
// enough that this doubled the kernel's time (fp8, 8 tokens). These tiles widen the stored rows in registers
// inside the dot-product loop: for M <= 4 one 4 x 4 tile; for 4 < M <= 8 two passes over K per row block,
// each widening 2 rows once for all 8 tokens (16 accumulators). A step covers V * 32 weights of k; K's tail
// goes through zero-padded copies, 32 at a time.
using One = std::integral_constant<int, 1>;
using Two = std::integral_constant<int, 2>;

// step(k, tail, V) across [0, K): V = 2 while 64 weights are left where rows widen 64 at a time, then V = 1
template <typename Q, typename Step>
FLASHRL_TILES_TARGET __attribute__((always_inline)) inline void for_each_step(int64_t K, Step&& step) {
  int64_t k = 0;
  if constexpr (kWide64<Q>)
    for (; k + 64 <= K; k += 64) step(k, false, Two{});
  for (; k + 32 <= K; k += 32) step(k, false, One{});
  if (k < K) step(k, true, One{});
}

// 4 tokens x 4 rows, rows widened in registers: the 16 sums in lane 4 m + j
template <typename Q>
FLASHRL_TILES_TARGET inline __m512 decode_tile4(const c10::BFloat16* const* xr, const Q* const* wr, int64_t K,
                                                 int64_t pf) {
  __m512 acc[4][4];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  auto step = [&](int64_t k, bool tail, auto vc) __attribute__((always_inline, FLASHRL_TILES_TARGET_STR)) {
    constexpr int V = decltype(vc)::value;
    __m512bh wv[4][V];
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) {
      if (tail) {
        wv[j][0] = wload_bf16_tail(wr[j], k, K);
      } else {
        wload_rows<Q, V>(wr[j] + k, wv[j]);
      }
      if (pf && (k * int64_t{sizeof(Q)}) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + pf, FLASHRL_PREFETCH_HINT);
    }
    FLASHRL_UNROLL for (int v = 0; v < V; ++v)
      FLASHRL_UNROLL for (int m = 0; m < 4; ++m) {
        const __m512bh xv = xload_bf16(xr[m], k + 32 * v, K, tail);
        FLASHRL_UNROLL for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j][v]);
      }
  };
  for_each_step<Q>(K, step);
  __m512 flat[16];
  FLASHRL_UNROLL for (int m = 0; m < 4; ++m)
    FLASHRL_UNROLL for (int j = 0; j < 4; ++j) flat[4 * m + j] = acc[m][j];
  return hsum16(flat);
}

// 8 tokens x 2 rows, rows widened in registers: the 16 sums in lane 2 m + j
template <typename Q>
FLASHRL_TILES_TARGET inline __m512 decode_pass8(const c10::BFloat16* const* xr, const Q* w0, const Q* w1, int64_t K,
                                                 int64_t pf) {
  __m512 acc[8][2];
  FLASHRL_UNROLL for (int m = 0; m < 8; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  auto step = [&](int64_t k, bool tail, auto vc) __attribute__((always_inline, FLASHRL_TILES_TARGET_STR)) {
    constexpr int V = decltype(vc)::value;
    __m512bh a[V], b[V];
    if (tail) {
      a[0] = wload_bf16_tail(w0, k, K);
      b[0] = wload_bf16_tail(w1, k, K);
    } else {
      wload_rows<Q, V>(w0 + k, a);
      wload_rows<Q, V>(w1 + k, b);
    }
    if (pf && (k * int64_t{sizeof(Q)}) % 64 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k) + pf, FLASHRL_PREFETCH_HINT);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k) + pf, FLASHRL_PREFETCH_HINT);
    }
    FLASHRL_UNROLL for (int v = 0; v < V; ++v)
      FLASHRL_UNROLL for (int m = 0; m < 8; ++m) {
        const __m512bh xv = xload_bf16(xr[m], k + 32 * v, K, tail);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, a[v]);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, b[v]);
      }
  };
  for_each_step<Q>(K, step);
  __m512 flat[16];
  FLASHRL_UNROLL for (int m = 0; m < 8; ++m) {
    flat[2 * m] = acc[m][0];
    flat[2 * m + 1] = acc[m][1];
  }
  return hsum16(flat);
}

// y = x @ (q * scale).T + bias for M <= 8 bf16 tokens, weight-only; row blocks of 4 over threads
template <typename Q>
FLASHRL_TILES_TARGET void drive_decode_bf16(int64_t M, int64_t N, int64_t K, const c10::BFloat16* x, int64_t ldx,
                                           const Q* w, int64_t ldw, const float* scale, const float* bias,
                                           c10::BFloat16* y) {
  const int64_t nblocks = (N + 3) / 4;
  // lanes 2 m + j of pass A (rows 0-1) and B (rows 2-3) to lane 4 m + j of tokens 0-3 (lo) and 4-7 (hi)
  alignas(64) int32_t lo_idx[16], hi_idx[16];
  for (int m = 0; m < 4; ++m)
    for (int j = 0; j < 4; ++j) {
      lo_idx[4 * m + j] = j < 2 ? 2 * m + j : 16 + 2 * m + j - 2;
      hi_idx[4 * m + j] = 8 + lo_idx[4 * m + j];
    }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  at::parallel_for(0, nblocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = 4 * b, nb = std::min<int64_t>(4, N - n0);
      const __mmask8 nmask = static_cast<__mmask8>((1u << nb) - 1);
      const Q* wr[4];
      for (int j = 0; j < 4; ++j) wr[j] = w + (n0 + (j < nb ? j : 0)) * ldw;
      const __m512 colscale = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(nmask, scale + n0));
      const __m512 colbias = bias ? _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(nmask, bias + n0)) : _mm512_setzero_ps();
      const int64_t pf = b + kPrefetchBlocks < b1 ? kPrefetchBlocks * 4 * ldw * int64_t{sizeof(Q)} : 0;
      const c10::BFloat16* xr[8];
      for (int m = 0; m < 8; ++m) xr[m] = x + (m < M ? m : 0) * ldx;
      if (M <= 4) {
        store_tile(decode_tile4(xr, wr, K, pf), colscale, colbias, nullptr, 0, M, nmask, y + n0, N);
      } else {
        const __m512 pa = decode_pass8(xr, wr[0], wr[1], K, pf), pb = decode_pass8(xr, wr[2], wr[3], K, pf);
        store_tile(_mm512_permutex2var_ps(pa, lo, pb), colscale, colbias, nullptr, 0, 4, nmask, y + n0, N);
        store_tile(_mm512_permutex2var_ps(pa, hi, pb), colscale, colbias, nullptr, 4, M - 4, nmask, y + 4 * N + n0,
                   N);
      }
    }
  });
}
