// The AMX tile ceiling of one core: tdpbusd (int8) and tdpbf16ps (bf16) on tiles already loaded, no memory
// traffic, four independent accumulators (a 32 x 32 output block from 2 A x 2 B tiles). What a brgemm call or a
// whole linear reaches is read against this (docs/native.md, "AMX"). Linux faults AMX instructions until the
// process asks for the tile state, which this does first.
//
//   gcc -O2 bench/amx_tile_ceiling.c -o /tmp/amx_tile_ceiling && taskset -c 0 /tmp/amx_tile_ceiling
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) static void run(long iters, int bf16) {
  cfg_t c; memset(&c, 0, sizeof c); c.palette_id = 1;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  _tile_loadconfig(&c);
  static int8_t buf[16 * 64] __attribute__((aligned(64)));
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  double t0 = now();
  if (!bf16) {
    for (long i = 0; i < iters; ++i) {  // 4 independent accumulators, 2 A x 2 B tiles (as a 32 x 32 block)
      _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
  } else {
    for (long i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
  }
  double t = now() - t0;
  _tile_release();
  // one tdpbusd: 16 x 16 x 64 MACs; tdpbf16ps: 16 x 16 x 32
  double macs = 4.0 * iters * 16 * 16 * (bf16 ? 32 : 64);
  printf("%s: %.0f GMAC/s on one core (%.3f G instructions/s)\n", bf16 ? "tdpbf16ps" : "tdpbusd  ", macs / t / 1e9, 4.0 * iters / t / 1e9);
}
int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { perror("arch_prctl"); return 1; }
  run(2000000, 0);  // warm-up (the core may raise its clock after the first AMX instructions)
  run(20000000, 0);
  run(20000000, 1);
  return 0;
}
