// W8A8 INT8 linear on packed weights: the rollout engine's linear layers on AVX-512 VNNI CPUs (below) and AVX2
// CPUs (the vpmaddwd tiles at the end, on 8-row blocks: packed_layout.h; on CPUs with AVX-VNNI, ymm vpdpbusd
// tiles on the same bytes).
//
//   y[m, n] = (sum_k xq[m, k] * q[n, k]) * scale[n] * xs[m] + bias[n]        (output in x's dtype)
//
// xq, xs: the spec's per-token int8 quantization of x (token_quant.h); q, scale: the weight's per-row codes and
// scales in the packed layout quantize_rows_packed writes (quantize.cpp), with comp[n] = sum_k q[n, k]:
//   [N / 64][K / 4][64][4]   code (n, k) at ((n / 64) * (K / 4) + k / 4) * 256 + (n % 64) * 4 + k % 4
// One 64-byte vector of it holds 4 k of 16 rows: the signed operand of vpdpbusd with lanes along N. The
// activations are the unsigned operand, stored as code + 128 and broadcast 4 bytes at a time, so
//   sum_k (xq + 128) * q = sum_k xq * q + 128 * comp[n]
// and the row sums, written with the codes at every sync, remove the offset (exact in int32 for K <= 65536).
// Against the plain-layout kernel (qlinear.cpp: lanes along K, a horizontal sum per output, an xor per weight
// vector to make it unsigned) every vector instruction of the inner loop is a dot product, and the epilogue
// writes 16 contiguous outputs per vector. Same integers, same epilogue arithmetic: the two kernels' outputs
// are bit-identical.
//
// Two drivers over the same bytes:
//   tiles:  4 tokens x 64 rows of int32 accumulators (16 zmm); a thread streams its contiguous run of row blocks
//           once per 4 tokens (decode: from memory; prefill: tokens in chunks whose codes stay in L2, the block
//           re-read from L2 by every 4 tokens of the chunk);
//   amx:    AMX-INT8 tiles driven here (amx_tiles.h), the tokens' u8 codes as A and the packed block itself as B
//           (a k-group of 16 rows is one 64-byte tile row, stride 256): no call per block, no copy of the weight.
//           Taken for M >= FLASHRL_NATIVE_AMX_MIN_M (default 4 where AMX-INT8 is granted, kAmxInt8MinM; never
//           elsewhere) when K % 64 == 0; FLASHRL_NATIVE_EMULATE=amx runs it emulated (tests);
//   brgemm: oneDNN's u8 x s8 batch-reduce GEMM (ATen's cpublas::brgemm, ld_b = 64), AMX-INT8 tiles on CPUs that
//           have them; taken for M >= FLASHRL_NATIVE_BRGEMM_MIN_M (default 4 on AMX CPUs, never elsewhere, where
//           the tiles are faster) where the amx driver is off or refuses the shape (docs/native.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if __has_include(<ATen/cpu/Utils.h>)
#include <ATen/cpu/Utils.h>
#define FLASHRL_HAS_INIT_AMX 1
#endif

#include "amx_tiles.h"
#include "linear_memory.h"
#include "cpu_features.h"
#include "packed_layout.h"
#include "token_quant.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace flashrl_native {
namespace {

constexpr int64_t kTokenChunk = 256;  // tokens per pass over the weight: their u8 codes (256 K bytes) stay in L2
constexpr int64_t kTokenChunkAvx2 = 128;  // the same for the AVX2 kernel's int16 codes (256 K bytes)
constexpr int64_t kBrgemmRows = 32;  // tokens per brgemm call (two 16-row AMX tiles of A)
// tokens from which AMX CPUs run the amx driver; the VNNI tiles below it. Measured on an Emerald Rapids VM
// (docs/native.md "AMX tiles driven by flashrl", in-process interleaved A/B of the 24-layer set): with its
// prefetch, amx / tiles 0.98-1.19 at 1-2 tokens, 0.75-0.84 at 4-16, 0.73-0.86 at 32, 0.59-0.63 at 64; oneDNN's
// brgemm 1.1-2.8x the amx driver's time at every M, so it only runs where the amx driver refuses the shape
constexpr int64_t kAmxInt8MinM = 4;
// bytes ahead of its reads that the amx driver's first token block prefetches (a 4 KiB step, one line each):
// the tile loads' strided rows are not followed by the prefetchers as the tiles' vector loads are; 4-64 KiB
// measured alike, 0.75-0.86x the time without at 4-32 tokens when the VM's bandwidth was contended
constexpr int64_t kAmxPrefetchBytes = 8 * 1024;
constexpr int64_t kMaxK = 65536;  // int32 sums of (u8 + 128) x s8 products stay exact

struct PackedConfig {
  bool vnni = false;
  bool avx2 = false;  // an AVX2 build: the vpmaddwd kernel, or
  bool avx_vnni = false;  // its ymm vpdpbusd tiles (AVX-VNNI; or emulated: FLASHRL_NATIVE_EMULATE=avxvnni)
  bool avx_vnni_emulated = false;
  bool amx = false;  // AMX-TILE + AMX-INT8, and Linux granted this process the tile state
  int64_t brgemm_min_m = 0;  // 0: never
  bool amx_emulated = false;  // the amx driver on emulated tiles (FLASHRL_NATIVE_EMULATE=amx; a test mode)
  int64_t amx_min_m = 0;  // tokens from which the amx driver runs (0: never)
  int64_t amx_pf_bytes = 0;  // how far ahead the amx driver prefetches the weight (0: no prefetch)
  // the VNNI tiles' decode shapes (packed_blocks; docs/native.md "Decode tiles and prefetch")
  int64_t pf_spread = 1;  // blocks ahead that the token tiles of a block prefetch (0: none)
  int64_t pf_min_tiles = 4;  // 4-token tiles a block needs before they prefetch
  int64_t wide_max_m = 8;  // tokens up to which (from 5) one wide tile reads the block once (0: never)
  int64_t wide_pf = 0;  // blocks ahead that the wide tile prefetches (0: none)
};

const PackedConfig& config() {
  static const PackedConfig c = [] {
    PackedConfig r;
#if defined(CPU_CAPABILITY_AVX512)
    r.vnni = cpu_has("avx512vnni");
#elif defined(CPU_CAPABILITY_AVX2)
    r.avx2 = true;
    // the emulation runs the AVX-VNNI tiles with each vpdpbusd done by AVX2 instructions: it tests the tiles on
    // CPUs without AVX-VNNI (and against the real instruction on CPUs with it); it is not a speed path
    const char* emulate = std::getenv("FLASHRL_NATIVE_EMULATE");
    r.avx_vnni_emulated = emulate && std::strstr(emulate, "avxvnni");
    r.avx_vnni = r.avx_vnni_emulated || cpu_has("avxvnni");
#endif
#if defined(FLASHRL_HAS_INIT_AMX) && defined(CPUBLAS_BRGEMM_U8I8I32)
    // init_amx asks Linux for the tile state (arch_prctl); AMX instructions fault until a process has it
    r.amx = cpu_has("amx") && at::cpu::init_amx();
#endif
#if defined(CPUBLAS_BRGEMM_U8I8I32)
    // on AMX only where the amx driver refuses the shape (K % 64 != 0): slower than the amx driver at every M
    if (r.vnni) r.brgemm_min_m = env_int("FLASHRL_NATIVE_BRGEMM_MIN_M", r.amx ? 4 : 0);
#endif
#if defined(CPU_CAPABILITY_AVX512)
    if (r.vnni) {
      const char* emulate = std::getenv("FLASHRL_NATIVE_EMULATE");
      r.amx_emulated = emulate && std::strstr(emulate, "amx") && !r.amx;
      // emulated: every M (a test of the driver); real tiles: from kAmxInt8MinM
      if (r.amx || r.amx_emulated)
        r.amx_min_m = env_int("FLASHRL_NATIVE_AMX_MIN_M", r.amx_emulated ? 1 : kAmxInt8MinM);
    }
#endif
    r.amx_pf_bytes = env_int("FLASHRL_NATIVE_AMX_PF_KB", kAmxPrefetchBytes / 1024) * 1024;
    r.pf_spread = env_int("FLASHRL_NATIVE_PACKED_PF_SPREAD", 1);
    r.pf_min_tiles = env_int("FLASHRL_NATIVE_PACKED_PF_MIN_TILES", 4);
    // the wide tile takes 7 tokens and a 1-token tile the 8th: no more than 8
    r.wide_max_m = std::min<int64_t>(8, env_int("FLASHRL_NATIVE_PACKED_WIDE_MAX_M", 8));
    r.wide_pf = env_int("FLASHRL_NATIVE_PACKED_WIDE_PF", 0);
    return r;
  }();
  return c;
}

#define FLASHRL_UNROLL_PACKED _Pragma("GCC unroll 16")

// the u8 x s8 kernels' epilogue inputs (AVX-512 VNNI, AVX-VNNI)
struct Epilogue {
  const float* xs;  // [M] token scales
  const float* scale;  // [N] row scales
  const int32_t* comp;  // [N] row code sums
  const float* bias;  // [N] fp32 or null
  int64_t ldy;
};

#if defined(CPU_CAPABILITY_AVX512)
#define FLASHRL_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <typename Out>
inline void store16(Out* dst, __m512 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(dst, v);
  } else if constexpr (std::is_same_v<Out, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), at::vec::cvtfp32_bf16(v));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// y[m, n0 + j] for 16 rows j from one int32 vector of sums: (sum - 128 comp) * scale * xs + bias, in the order
// (and with the roundings: one explicit FMA) of the plain kernel's store_tile
struct Columns {
  __m512 scale, bias;
  __m512i comp128;
  inline Columns(const Epilogue& e, int64_t n) {
    scale = _mm512_loadu_ps(e.scale + n);
    comp128 = _mm512_slli_epi32(_mm512_loadu_si512(e.comp + n), 7);
    bias = e.bias ? _mm512_loadu_ps(e.bias + n) : _mm512_setzero_ps();
  }
  inline __m512 apply(__m512i sums, __m512 xs) const {
    const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, comp128));
    return _mm512_fmadd_ps(_mm512_mul_ps(d, scale), xs, bias);  // as qlinear.cpp's store_tile
  }
};

// acc += u8 a . s8 b in place. The intrinsic makes GCC 12 copy the accumulators around the loop (a vmovdqa per
// vpdpbusd, and spills, in this tile); the asm keeps each in its register.
FLASHRL_VNNI_TARGET inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

FLASHRL_VNNI_TARGET inline void dpbusd_mem(__m512i& acc, __m512i a, const int8_t* b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const __m512i*>(b)));
}

// 5-7 tokens x all 64 rows of a block in one pass over the weight (decode): MT x 4 accumulators and the broadcast
// fill the 32 vector registers, so the weights are the dot products' memory operands (L1 hits after the first)
template <int MT, typename Out>
FLASHRL_VNNI_TARGET inline void packed_tile_wide(const uint8_t* a, int64_t lda, const int8_t* w, int64_t groups,
                                                 const Epilogue& e, int64_t m0, int64_t n0, Out* y,
                                                 const char* pf = nullptr, int64_t pf_bytes = 0) {
  static_assert(MT <= 7, "MT x 4 accumulators + 1 broadcast must fit 32 registers");
  __m512i acc[MT][4];
  FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    if (pf) _mm_prefetch(pf + (g * pf_bytes / groups & ~int64_t{63}), _MM_HINT_T1);
    const int8_t* wg = w + g * kPackGroup;
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      int32_t a4;
      std::memcpy(&a4, a + m * lda + 4 * g, 4);
      const __m512i av = _mm512_set1_epi32(a4);
      FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) dpbusd_mem(acc[m][c], av, wg + 64 * c);
    }
  }
  FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) {
    const Columns col(e, n0 + 16 * c);
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
      store16(y + (m0 + m) * e.ldy + n0 + 16 * c, col.apply(acc[m][c], _mm512_set1_ps(e.xs[m0 + m])));
  }
}

// MT tokens x the 64 rows of one block, over all K: w points at the block, a at the first token's codes; pf_bytes
// from pf are prefetched into L2 over the k-groups, a line every few groups (packed_blocks says what).
template <int MT, bool kPrefetch, typename Out>
FLASHRL_VNNI_TARGET inline void packed_tile(const uint8_t* a, int64_t lda, const int8_t* w, int64_t groups,
                                            const Epilogue& e, int64_t m0, int64_t n0, Out* y,
                                            const char* pf = nullptr, int64_t pf_bytes = 0) {
  __m512i acc[MT][4];
  FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (kPrefetch) _mm_prefetch(pf + (g * pf_bytes / groups & ~int64_t{63}), _MM_HINT_T1);
    const int8_t* wg = w + g * kPackGroup;
    __m512i wv[4];
    FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_si512(wg + 64 * c);
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      int32_t a4;
      std::memcpy(&a4, a + m * lda + 4 * g, 4);
      const __m512i av = _mm512_set1_epi32(a4);
      FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) dpbusd(acc[m][c], av, wv[c]);
    }
  }
  FLASHRL_UNROLL_PACKED for (int c = 0; c < 4; ++c) {
    const Columns col(e, n0 + 16 * c);
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
      store16(y + (m0 + m) * e.ldy + n0 + 16 * c, col.apply(acc[m][c], _mm512_set1_ps(e.xs[m0 + m])));
  }
}

// tokens [mc, mend) x row blocks [b0, b1)
template <typename Out>
FLASHRL_VNNI_TARGET void packed_blocks(const uint8_t* a, int64_t K, const int8_t* w, int64_t b0, int64_t b1,
                                       int64_t mc, int64_t mend, const Epilogue& e, Out* y) {
  const int64_t groups = K / 4, block_bytes = groups * kPackGroup;
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  auto tile = [&](auto mt, const uint8_t* am, const int8_t* wb, int64_t m0, int64_t n0, const char* pf = nullptr,
                  int64_t pb = 0) __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni"))) {
    if (pf)
      packed_tile<decltype(mt)::value, true>(am, K, wb, groups, e, m0, n0, y, pf, pb);
    else
      packed_tile<decltype(mt)::value, false>(am, K, wb, groups, e, m0, n0, y);
  };
  // With 4-16 token tiles a block (13-64 tokens), each tile prefetches its share of the block `spread` blocks ahead
  // into L2, spread over its k-groups, so that the block's first tile finds it there instead of streaming it from
  // DRAM while the others compute from L2 (docs/native.md: 0.88-0.93x the time at 13-32 tokens on Zen 4, 0.99x at
  // 64, nothing at 128; prefetching a whole block from the first tile, tried before, doubled that tile's DRAM
  // demand and gained nothing)
  const PackedConfig& cfg = config();
  const int64_t spread = cfg.pf_spread, ntiles = (mend - mc + 3) / 4, share = (block_bytes + ntiles - 1) / ntiles;
  const int64_t mlen = mend - mc;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = w + b * block_bytes;
    const int64_t n0 = b * kPackRows;
    if (mlen > 4 && mlen <= cfg.wide_max_m) {  // decode: one pass over the weight for (up to) 7 of the tokens
      const uint8_t* am = a + mc * K;
      const int64_t first = std::min<int64_t>(7, mlen);
      const char* wpf =
          cfg.wide_pf > 0 && b + cfg.wide_pf < b1 ? reinterpret_cast<const char*>(wb + cfg.wide_pf * block_bytes)
                                                  : nullptr;
      switch (first) {
        case 7: packed_tile_wide<7>(am, K, wb, groups, e, mc, n0, y, wpf, block_bytes); break;
        case 6: packed_tile_wide<6>(am, K, wb, groups, e, mc, n0, y, wpf, block_bytes); break;
        default: packed_tile_wide<5>(am, K, wb, groups, e, mc, n0, y, wpf, block_bytes);
      }
      if (mlen > first) tile(I1{}, a + (mc + first) * K, wb, mc + first, n0);
      continue;
    }
    const char* next = spread > 0 && ntiles >= cfg.pf_min_tiles && ntiles <= 16 && b + spread < b1
                           ? reinterpret_cast<const char*>(wb + spread * block_bytes) : nullptr;
    for (int64_t m0 = mc; m0 < mend; m0 += 4) {
      const uint8_t* am = a + m0 * K;
      const int64_t t = (m0 - mc) / 4;
      const char* pf = next ? next + t * share : nullptr;
      const int64_t pb = std::max<int64_t>(0, std::min(share, block_bytes - t * share));
      switch (std::min<int64_t>(4, mend - m0)) {
        case 4: tile(I4{}, am, wb, m0, n0, pf, pb); break;
        case 3: tile(I3{}, am, wb, m0, n0, pf, pb); break;
        case 2: tile(I2{}, am, wb, m0, n0, pf, pb); break;
        default: tile(I1{}, am, wb, m0, n0, pf, pb);
      }
    }
  }
}

template <typename Out>
void drive_tiles(int64_t M, int64_t N, int64_t K, const uint8_t* a, const int8_t* w, const Epilogue& e, Out* y) {
  const int64_t nblocks = N / kPackRows;
  for (int64_t mc = 0; mc < M; mc += kTokenChunk) {
    const int64_t mend = std::min(M, mc + kTokenChunk);
    // each thread gets a contiguous run of blocks: one linear stream of weight bytes
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      packed_blocks<Out>(a, K, w, b0, b1, mc, mend, e, y);
    });
  }
}

// rows [m0, m0 + mm) x the 64 rows of block nb from brgemm's int32 sums c [mm, 64]
template <typename Out>
void store_sums(const int32_t* c, int64_t mm, int64_t m0, int64_t n0, const Epilogue& e, Out* y) {
  for (int cc = 0; cc < 4; ++cc) {
    const Columns col(e, n0 + 16 * cc);
    for (int64_t m = 0; m < mm; ++m)
      store16(y + (m0 + m) * e.ldy + n0 + 16 * cc,
              col.apply(_mm512_loadu_si512(c + m * kPackRows + 16 * cc), _mm512_set1_ps(e.xs[m0 + m])));
  }
}

// ---- the amx driver: AMX-INT8 tiles on the packed bytes (amx_tiles.h)
// Tiles: 0 = 16 tokens x 64 k of u8 codes (A, rows K bytes apart), 2 and 3 = 16 k-groups x 16 rows of the
// block (B, rows 256 bytes apart; two, so that one loads while the other multiplies), 4-7 = the int32 sums of
// the 16 tokens x the block's 64 rows, 16 rows each. a holds whole 16-token blocks (rows past M are read,
// their sums never stored); K % 64 == 0.
template <typename Ops, typename Out>
void amx_blocks(const uint8_t* a, int64_t K, const int8_t* w, int64_t b0, int64_t b1, int64_t mc, int64_t mend,
                const Epilogue& e, Out* y) {
  TileConfig cfg;
  cfg.set(0, 16, 64);
  cfg.set(2, 16, 64);
  cfg.set(3, 16, 64);
  for (int t = 4; t < 8; ++t) cfg.set(t, 16, 64);
  Ops::config(&cfg);
  const int64_t block_bytes = K / 4 * kPackGroup, steps = K / 64;
  const int64_t pf_ahead = dispatch_int("FLASHRL_NATIVE_AMX_PF_KB", config().amx_pf_bytes / 1024) * 1024;
  alignas(64) int32_t c[16 * kPackRows];
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = w + b * block_bytes;
    for (int64_t m0 = mc; m0 < mend; m0 += 16) {
      Ops::template zero<4>();
      Ops::template zero<5>();
      Ops::template zero<6>();
      Ops::template zero<7>();
      const uint8_t* am = a + m0 * K;
      const int64_t ahead = m0 == mc ? pf_ahead : 0;  // later token blocks re-read the block from L2
      for (int64_t s = 0; s < steps; ++s) {
        const int8_t* g = wb + s * 16 * kPackGroup;  // k-groups 16 s .. 16 s + 15 of the block
        if (ahead) {  // the 4 KiB this step reads, `ahead` bytes on in the thread's contiguous run of blocks
          const char* p = reinterpret_cast<const char*>(g) + ahead;
          for (int l = 0; l < 16 * kPackGroup / 64; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
        }
        Ops::template load<0>(am + 64 * s, K);
        Ops::template load<2>(g, kPackGroup);
        Ops::template load<3>(g + 64, kPackGroup);
        Ops::template dpbusd<4, 0, 2>();
        Ops::template load<2>(g + 128, kPackGroup);
        Ops::template dpbusd<5, 0, 3>();
        Ops::template load<3>(g + 192, kPackGroup);
        Ops::template dpbusd<6, 0, 2>();
        Ops::template dpbusd<7, 0, 3>();
      }
      Ops::template store<4>(c, kPackRows * 4);
      Ops::template store<5>(c + 16, kPackRows * 4);
      Ops::template store<6>(c + 32, kPackRows * 4);
      Ops::template store<7>(c + 48, kPackRows * 4);
      store_sums(c, std::min<int64_t>(16, mend - m0), m0, b * kPackRows, e, y);
    }
  }
  Ops::release();
}

template <typename Ops, typename Out>
void drive_amx(int64_t M, int64_t N, int64_t K, const uint8_t* a, const int8_t* w, const Epilogue& e, Out* y) {
  const int64_t nblocks = N / kPackRows;
  for (int64_t mc = 0; mc < M; mc += kTokenChunk) {
    const int64_t mend = std::min(M, mc + kTokenChunk);
    // as the tiles: a thread streams its contiguous run of blocks, each block re-read from L2 per 16 tokens
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      amx_blocks<Ops, Out>(a, K, w, b0, b1, mc, mend, e, y);
    });
  }
}

#if defined(CPUBLAS_BRGEMM_U8I8I32)
template <typename Out>
void drive_brgemm(int64_t M, int64_t N, int64_t K, const uint8_t* a, const int8_t* w, const Epilogue& e, Out* y) {
  const int64_t nblocks = N / kPackRows, mblocks = (M + kBrgemmRows - 1) / kBrgemmRows;
  const int64_t block_bytes = K / 4 * kPackGroup;
  // token block outer, row blocks inner: a thread's A block (32 x K codes) is reused across its row blocks
  at::parallel_for(0, mblocks * nblocks, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) int32_t c[kBrgemmRows * kPackRows];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / nblocks, nb = t % nblocks;
      const int64_t m0 = mb * kBrgemmRows, mm = std::min(kBrgemmRows, M - m0);
      at::native::cpublas::brgemm(mm, kPackRows, K, K, kPackRows, kPackRows, false,
                                  reinterpret_cast<const unsigned char*>(a + m0 * K),
                                  reinterpret_cast<const signed char*>(w + nb * block_bytes), c, true);
      store_sums(c, mm, m0, nb * kPackRows, e, y);
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#endif
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2 (no VNNI): the same bytes through vpmaddwd, whose operands are both signed, so the tokens are the spec's
// int16 codes (token_quant.h, as the plain-layout AVX2 kernel) and no offset or row sum is needed. One 16-byte
// load of a k-group holds 4 k of 4 rows; sign-extended (vpmovsxbw) it meets the token's 4 codes broadcast as one
// 64-bit lane (vpbroadcastq): 8 int32 sums, two per row (k 0-1 and k 2-3), added pairwise once per tile (vphaddd).
// Against the plain-layout kernel a widened weight vector serves MT tokens and a token load is 8 bytes instead of
// 32 (a 4 x 8 tile loads 64 bytes per 8 vpmaddwd, the plain 4 x 2 tile 160), and no output needs a horizontal
// sum over K.

struct Epilogue8 {
  const float* xs;  // [M] token scales
  const float* scale;  // [N] row scales
  const float* bias;  // [N] fp32 or null
  int64_t ldy;
};

template <typename Out>
inline void store8(Out* dst, __m256 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm256_storeu_ps(dst, v);
  } else if constexpr (std::is_same_v<Out, c10::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), at::vec::cvtfp32_bf16(v));
  }
}

// `bytes` from p (null: none) into L2 a line at a time, spread evenly over `steps` calls of step(): a tile's share of
// the weight it will read next, so that its stream from DRAM overlaps the tiles' arithmetic (no division per step)
struct SpreadPrefetch {
  const char* p;
  const char* end;
  int64_t due = 0, per_step, per_line;
  SpreadPrefetch(const char* p, int64_t bytes, int64_t steps)
      : p(p), end(p ? p + bytes : nullptr), per_step(bytes), per_line(64 * std::max<int64_t>(1, steps)) {}
  inline void step() {
    if (!p) return;
    for (due += per_step; due >= per_line && p < end; due -= per_line, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

// MT tokens x 4 RV rows from row n0 over all K: w points at the first of the RV / 2 consecutive 8-row blocks
// (block_bytes apart; in each, k-group g is 32 bytes at 32 g), a at the first token's int16 codes
template <int MT, int RV, typename Out>
inline void avx2_tile(const int16_t* a, int64_t lda, const int8_t* w, int64_t block_bytes, int64_t groups,
                      const Epilogue8& e, int64_t m0, int64_t n0, Out* y, const char* pf = nullptr,
                      int64_t pf_bytes = 0) {
  static_assert(RV % 2 == 0, "rows are finished 8 at a time");
  __m256i acc[MT][RV];
  FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL_PACKED for (int r = 0; r < RV; ++r) acc[m][r] = _mm256_setzero_si256();
  SpreadPrefetch ahead(pf, pf_bytes, groups);
  for (int64_t g = 0; g < groups; ++g) {
    ahead.step();
    const int8_t* wg = w + g * kPackGroup;
    __m256i wv[RV];
    FLASHRL_UNROLL_PACKED for (int r = 0; r < RV; ++r)
      wv[r] = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + (r / 2) * block_bytes + 16 * (r % 2))));
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      int64_t a4;
      std::memcpy(&a4, a + m * lda + 4 * g, 8);
      const __m256i av = _mm256_set1_epi64x(a4);
      FLASHRL_UNROLL_PACKED for (int r = 0; r < RV; ++r) add_into(acc[m][r], _mm256_madd_epi16(av, wv[r]));
    }
  }
  FLASHRL_UNROLL_PACKED for (int r = 0; r < RV; r += 2) {
    const int64_t n = n0 + 4 * r;
    const __m256 scale = _mm256_loadu_ps(e.scale + n);
    const __m256 bias = e.bias ? _mm256_loadu_ps(e.bias + n) : _mm256_setzero_ps();
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      // hadd: rows n, n+1, n+4, n+5 | n+2, n+3, n+6, n+7; the qword permute puts them in order
      const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m][r], acc[m][r + 1]), 0xD8);
      const __m256 d = _mm256_cvtepi32_ps(sums);
      // (dot * scale) * xs + bias with one explicit FMA: the other W8A8 kernels' epilogue
      store8(y + (m0 + m) * e.ldy + n, _mm256_fmadd_ps(_mm256_mul_ps(d, scale), _mm256_set1_ps(e.xs[m0 + m]), bias));
    }
  }
}

// tokens [mc, mend) x 8-row blocks [b0, b1), 4 blocks at a time: per block, 4 tokens a tile; the 2 / 1 tokens left
// over take 2 / 4 blocks a tile (fewer tokens leave registers for more rows: 8 accumulators in every tile), on the
// same 4 blocks while they are in cache (a second pass over the weight for them, until 2026-12-07, cost 1.05-1.15x
// the time at 5-11 tokens). With 1-3 tokens, the tiles prefetch the next 4 blocks into L2 spread over their loop
// (FLASHRL_NATIVE_AVX2_PF=0: off; 0.91-0.98x the time at 2-3 tokens on the Zen 3 VM; the 4-token tiles'
// prefetching a share of the next block each measured 0.9-1.1x, noise or worse, and does not: docs/native.md).
template <typename Out>
void avx2_blocks(const int16_t* a, int64_t lda, int64_t K, const int8_t* w, int64_t b0, int64_t b1, int64_t mc,
                 int64_t mend, const Epilogue8& e, Out* y) {
  const int64_t groups = K / 4, bb = groups * kPackGroup;
  const int64_t tail = (mend - mc) % 4, mt = mend - tail, ntiles = (mt - mc) / 4;
  const bool prefetch = dispatch_int("FLASHRL_NATIVE_AVX2_PF", 1) != 0;
  const auto at = [&](int64_t block) { return reinterpret_cast<const char*>(w + block * bb); };
  for (int64_t b = b0; b < b1; b += 4) {
    const int64_t nb = std::min<int64_t>(4, b1 - b);
    for (int64_t j = b; j < b + nb; ++j)  // (5 and 6 tokens per tile measured no faster: 12 accumulators)
      for (int64_t m0 = mc; m0 < mt; m0 += 4)
        avx2_tile<4, 2>(a + m0 * lda, lda, w + j * bb, bb, groups, e, m0, j * kPackRows, y);
    if (tail == 0) continue;
    if (nb < 4) {
      for (int64_t j = b; j < b + nb; ++j)
        for (int64_t m0 = mt; m0 < mend; ++m0)
          avx2_tile<1, 2>(a + m0 * lda, lda, w + j * bb, bb, groups, e, m0, j * kPackRows, y);
      continue;
    }
    const int64_t pf_blocks = prefetch && ntiles == 0 ? std::min<int64_t>(4, b1 - (b + 4)) : 0;
    int64_t m0 = mt;
    if (tail >= 2) {
      for (int64_t h = b; h < b + 4; h += 2) {
        const int64_t own = std::max<int64_t>(0, std::min<int64_t>(2, pf_blocks - (h - b)));
        avx2_tile<2, 4>(a + m0 * lda, lda, w + h * bb, bb, groups, e, m0, h * kPackRows, y,
                        own > 0 ? at(h + 4) : nullptr, own * bb);
      }
      m0 += 2;
    }
    if (m0 < mend)
      avx2_tile<1, 8>(a + m0 * lda, lda, w + b * bb, bb, groups, e, m0, b * kPackRows, y,
                      tail < 2 && pf_blocks > 0 ? at(b + 4) : nullptr, pf_blocks * bb);
  }
}

// AVX-VNNI (Alder Lake and later client cores, Sierra Forest): vpdpbusd on ymm, VEX-encoded, without AVX-512.
// A k-group of an 8-row block (32 bytes: 4 k of 8 rows) is its signed operand with lanes along N, as a 64-row
// group is the zmm kernel's: the tokens are u8 codes (code + 128) broadcast 4 bytes at a time and the row sums
// remove the offset (the AVX-512 kernel's arithmetic, header comment). One instruction per 32 multiply-adds
// against vpmaddwd's widen + multiply-add + add, and no pairwise sums in the epilogue.

// acc += u8 a . s8 b per int32 lane. Real: the asm spells the VEX form ({vex}; the plain mnemonic assembles to
// the EVEX one, AVX-512 VL + VNNI, which faults on these CPUs) and needs no target attribute. Emulated: even and
// odd bytes widened to 16 bits (a zero-extended, b sign-extended), two vpmaddwd: the same exact sums.
template <bool kEmulated>
inline void dpbusd8(__m256i& acc, __m256i a, __m256i b) {
  if constexpr (kEmulated) {
    const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF)), a_odd = _mm256_srli_epi16(a, 8);
    const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
    acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
  } else {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  }
}

// MT tokens x NB consecutive 8-row blocks from row n0 over all K: w points at the first block (blocks
// block_bytes apart), a at the first token's u8 codes. MT x NB accumulators + NB weights + 1 broadcast <= 16 ymm.
template <int MT, int NB, bool kEmulated, typename Out>
inline void vnni8_tile(const uint8_t* a, int64_t lda, const int8_t* w, int64_t block_bytes, int64_t groups,
                       const Epilogue& e, int64_t m0, int64_t n0, Out* y) {
  static_assert(MT * NB + NB + 1 <= 16, "the tile must fit the 16 ymm registers");
  __m256i acc[MT][NB];
  FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m)
    FLASHRL_UNROLL_PACKED for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NB];
    FLASHRL_UNROLL_PACKED for (int b = 0; b < NB; ++b)
      wv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * block_bytes + g * kPackGroup));
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      int32_t a4;
      std::memcpy(&a4, a + m * lda + 4 * g, 4);
      const __m256i av = _mm256_set1_epi32(a4);
      FLASHRL_UNROLL_PACKED for (int b = 0; b < NB; ++b) dpbusd8<kEmulated>(acc[m][b], av, wv[b]);
    }
  }
  FLASHRL_UNROLL_PACKED for (int b = 0; b < NB; ++b) {
    const int64_t n = n0 + kPackRows * b;
    const __m256 scale = _mm256_loadu_ps(e.scale + n);
    const __m256i comp128 = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.comp + n)), 7);
    const __m256 bias = e.bias ? _mm256_loadu_ps(e.bias + n) : _mm256_setzero_ps();
    FLASHRL_UNROLL_PACKED for (int m = 0; m < MT; ++m) {
      const __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m][b], comp128));
      store8(y + (m0 + m) * e.ldy + n, _mm256_fmadd_ps(_mm256_mul_ps(d, scale), _mm256_set1_ps(e.xs[m0 + m]), bias));
    }
  }
}

// tokens [mc, mend) x 8-row blocks [b0, b1), 4 blocks at a time: 4 tokens x 2 blocks a tile; the 1-3 tokens left
// over take the same 4 blocks (2 + 1 tokens) while they are in cache; the blocks left over one at a time. (The
// left-over tokens' own pass over the weight cost the AVX2 tiles 1.05-1.15x the time at 5-11 tokens on a Zen 3,
// docs/native.md "Packed on AVX2"; this walk is the same, not measured on an AVX-VNNI CPU.)
template <bool kEmulated, typename Out>
void vnni8_blocks(const uint8_t* a, int64_t K, const int8_t* w, int64_t b0, int64_t b1, int64_t mc, int64_t mend,
                  const Epilogue& e, Out* y) {
  const int64_t groups = K / 4, bb = groups * kPackGroup;
  const int64_t tail = (mend - mc) % 4, mt = mend - tail;
  auto tiles = [&](auto mt_c, auto nb_c, int64_t m0, int64_t b) {
    vnni8_tile<decltype(mt_c)::value, decltype(nb_c)::value, kEmulated>(a + m0 * K, K, w + b * bb, bb, groups, e, m0,
                                                                        b * kPackRows, y);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  for (int64_t b = b0; b < b1; b += 4) {
    const int64_t nb = std::min<int64_t>(4, b1 - b);
    int64_t j = b;
    for (; j + 2 <= b + nb; j += 2)
      for (int64_t m0 = mc; m0 < mt; m0 += 4) tiles(I4{}, I2{}, m0, j);
    for (; j < b + nb; ++j)
      for (int64_t m0 = mc; m0 < mt; m0 += 4) tiles(I4{}, I1{}, m0, j);
    if (tail == 0) continue;
    if (nb < 4) {
      for (j = b; j < b + nb; ++j)
        for (int64_t m0 = mt; m0 < mend; ++m0) tiles(I1{}, I1{}, m0, j);
      continue;
    }
    int64_t m0 = mt;
    if (tail >= 2) {
      tiles(I2{}, I4{}, m0, b);
      m0 += 2;
    }
    if (m0 < mend) tiles(I1{}, I4{}, m0, b);
  }
}

template <bool kEmulated, typename Out>
void drive_vnni8(int64_t M, int64_t N, int64_t K, const uint8_t* a, const int8_t* w, const Epilogue& e, Out* y) {
  const int64_t nblocks = N / kPackRows;
  for (int64_t mc = 0; mc < M; mc += kTokenChunk) {
    const int64_t mend = std::min(M, mc + kTokenChunk);
    at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
      vnni8_blocks<kEmulated, Out>(a, K, w, b0, b1, mc, mend, e, y);
    });
  }
}

template <typename Out>
void drive_avx2(int64_t M, int64_t N, int64_t K, const int16_t* a, int64_t lda, const int8_t* w, const Epilogue8& e,
                Out* y) {
  const int64_t nblocks = N / kPackRows;
  for (int64_t mc = 0; mc < M; mc += kTokenChunkAvx2) {
    const int64_t mend = std::min(M, mc + kTokenChunkAvx2);
    at::parallel_for(0, nblocks, 4, [&](int64_t b0, int64_t b1) {
      avx2_blocks<Out>(a, lda, K, w, b0, b1, mc, mend, e, y);
    });
  }
}
#endif  // CPU_CAPABILITY_AVX512 / AVX2

at::Tensor qlinear_packed(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& comp,
                          const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "qlinear_packed";
  TORCH_CHECK(config().vnni || config().avx2, op,
              ": needs an AVX2 or AVX-512 VNNI build (qlinear_packed_caps()[0]; AVX-512 without VNNI has none)");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), op, ": x [M, K] and q [N, K], got ", x.sizes(),
              " and ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) % kPackRows == 0 && q.size(1) % 4 == 0,
              op, ": q must be a contiguous int8 [N, K] in the packed layout (N % ", kPackRows,
              " == 0, K % 4 == 0), got ", q.sizes());
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu() && comp.device().is_cpu(), op,
              ": CPU tensors only");
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, ": x must be float32/bfloat16/float16");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, op, ": rows of x must have unit stride");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(), op,
              ": scale must be contiguous float32 [N]");
  TORCH_CHECK(comp.dim() == 1 && comp.size(0) == N && comp.scalar_type() == at::kInt && comp.is_contiguous(), op,
              ": comp must be contiguous int32 [N]");
  TORCH_CHECK(K <= kMaxK, op, ": K <= 65536 only");
  at::Tensor y = empty_linear_output(M, N, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [N]");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.const_data_ptr<float>(), b.const_data_ptr<float>() + N);
  }
#if defined(CPU_CAPABILITY_AVX512)
  // (live thresholds only where the tiles run at all: AMX granted, or emulated)
  const bool amx_here = config().amx || config().amx_emulated;
  const int64_t amx_min_m = amx_here ? dispatch_int("FLASHRL_NATIVE_AMX_MIN_M", config().amx_min_m) : 0;
  const bool amx = amx_min_m > 0 && M >= amx_min_m && K % 64 == 0;
  // the amx driver reads whole 16-token blocks of codes (rows past M: whatever the buffer held); a buffer reused
  // from call to call (a zeroed vector per call cost 5-10 % at 8-2048 tokens: linear_memory.h)
  struct TokenCodes;
  int8_t* xq_p = thread_scratch<int8_t, TokenCodes>(static_cast<size_t>((amx ? (M + 15) / 16 * 16 : M) * K));
  std::vector<float> xs(static_cast<size_t>(M));
  const Epilogue e{xs.data(), scale.const_data_ptr<float>(), comp.const_data_ptr<int32_t>(),
                   bias_f.empty() ? nullptr : bias_f.data(), N};
  const uint8_t* a = reinterpret_cast<const uint8_t*>(xq_p);
  const int8_t* w = q.const_data_ptr<int8_t>();
  auto run = [&](auto out_tag) {
    using Out = decltype(out_tag);
    quantize_tokens_s8<true>(x.const_data_ptr<Out>(), x.stride(0), M, K, K, xq_p, xs.data(), nullptr);
    Out* yp = y.data_ptr<Out>();
    if (amx) {
      if (config().amx_emulated)
        drive_amx<EmulatedAmxOps, Out>(M, N, K, a, w, e, yp);
      else
        drive_amx<AmxOps, Out>(M, N, K, a, w, e, yp);
      return;
    }
#if defined(CPUBLAS_BRGEMM_U8I8I32)
    const int64_t min_m = config().vnni ? dispatch_int("FLASHRL_NATIVE_BRGEMM_MIN_M", config().brgemm_min_m) : 0;
    if (min_m > 0 && M >= min_m && !(amx_min_m > 0 && K % 64 == 0)) {  // (the amx driver took those above)
      drive_brgemm<Out>(M, N, K, a, w, e, yp);
      return;
    }
#endif
    drive_tiles<Out>(M, N, K, a, w, e, yp);
  };
  switch (xt) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: run(c10::Half{});
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const float* bias_p = bias_f.empty() ? nullptr : bias_f.data();
  std::vector<float> xs(static_cast<size_t>(M));
  auto run = [&](auto out_tag) {
    using Out = decltype(out_tag);
    const Out* xp = x.const_data_ptr<Out>();
    if (config().avx_vnni) {
      std::vector<uint8_t> xq(static_cast<size_t>(M * K));
      quantize_tokens_avx2<uint8_t>(xp, x.stride(0), M, K, K, xq.data(), xs.data());
      const Epilogue e{xs.data(), scale.const_data_ptr<float>(), comp.const_data_ptr<int32_t>(), bias_p, N};
      if (config().avx_vnni_emulated)
        drive_vnni8<true, Out>(M, N, K, xq.data(), q.const_data_ptr<int8_t>(), e, y.data_ptr<Out>());
      else
        drive_vnni8<false, Out>(M, N, K, xq.data(), q.const_data_ptr<int8_t>(), e, y.data_ptr<Out>());
      return;
    }
    const int64_t lda = (K + 15) / 16 * 16;
    std::vector<int16_t> xq(static_cast<size_t>(M * lda));
    quantize_tokens_avx2<int16_t>(xp, x.stride(0), M, K, lda, xq.data(), xs.data());
    const Epilogue8 e{xs.data(), scale.const_data_ptr<float>(), bias_p, N};
    drive_avx2<Out>(M, N, K, xq.data(), lda, q.const_data_ptr<int8_t>(), e, y.data_ptr<Out>());
  };
  switch (xt) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: run(c10::Half{});
  }
#endif
  return y;
}

// [the packed kernel here (0: none, 1: AVX2 vpmaddwd, 2: AVX-512 VNNI, 3: AVX-VNNI ymm, 4: the same emulated),
// AMX-INT8 granted, brgemm from this M (0: never), rows per block of the layout (packed_layout.h),
// the amx driver from this M (0: never), the amx driver emulated]
std::vector<int64_t> qlinear_packed_caps() {
  const PackedConfig& c = config();
  const int64_t kernel = c.vnni ? 2 : c.avx_vnni_emulated ? 4 : c.avx_vnni ? 3 : c.avx2 ? 1 : 0;
  return {kernel, int64_t{c.amx}, c.brgemm_min_m, kPackRows, c.amx_min_m, int64_t{c.amx_emulated},
          c.pf_spread, c.pf_min_tiles, c.wide_max_m, c.wide_pf};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrl_native, m) {
  m.def("qlinear_packed(Tensor x, Tensor q, Tensor scale, Tensor comp, Tensor? bias) -> Tensor");
  m.def("qlinear_packed_caps() -> int[]", &qlinear_packed_caps);
}

TORCH_LIBRARY_IMPL(flashrl_native, CPU, m) {
  m.impl("qlinear_packed", &qlinear_packed);
}

}  // namespace flashrl_native
