// The packed int8 layout of the W8A8 linear (qlinear_packed.cpp), written by quantize_rows_packed
// (quantize.cpp) at every load and weight sync, read by unpack_rows. A logical [N, K] int8 weight
// (N % kPackRows == 0, K % 4 == 0) is stored in blocks of kPackRows rows:
//   code (n, k) at byte ((n / R) * (K / 4) + k / 4) * 4R + (n % R) * 4 + k % 4,    R = kPackRows
// so one k-group of a block (4R bytes) holds 4 consecutive k of its R rows, each row's 4 codes together.
// R follows the kernel of the build: 64 on AVX-512 (a group is four 64-byte vectors, the signed operand of
// vpdpbusd with lanes along N), 8 on AVX2 (a group is 32 bytes, two vpmovsxbw loads of 4 rows each: a tile
// of 8 rows reads its block as one contiguous stream; with 64-row blocks it read 32 of every 256 bytes, and
// that 256-byte stride put all its lines in 16 of L1's 64 sets, missing L1 on every load).
// Nothing outside the process depends on R: layers are re-packed from their float weights at every load.
#pragma once

#include <cstdint>

namespace flashrl_native {

#if defined(CPU_CAPABILITY_AVX512)
inline constexpr int64_t kPackRows = 64;
#else
inline constexpr int64_t kPackRows = 8;
#endif
inline constexpr int64_t kPackGroup = kPackRows * 4;  // bytes of one k-group of a block

}  // namespace flashrl_native
