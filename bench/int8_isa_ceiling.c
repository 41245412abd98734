/* The ceiling of each int8 dot-product instruction mix on one core: registers only, 8 independent accumulators.

     gcc -O2 bench/int8_isa_ceiling.c -o /tmp/int8_isa_ceiling && /tmp/int8_isa_ceiling

   What an int8 GEMM tile can reach at best on this CPU, by the instructions it issues per multiply-add
   (bench/RESULTS.md, "AVX2 prefill against vLLM's W8A8: the instruction ceiling"):
     vpmaddwd + vpaddd                   exact int16 products: the AVX2 tiles of qlinear.cpp / qlinear_packed.cpp
     vpmaddubsw + vpmaddwd(ones) + vpaddd u8 x s8 into saturating int16 pairs: oneDNN's AVX2 int8 GEMM
     vpmaddubsw + vpaddw                 the same accumulated in int16 (saturates sooner still)
     vpdpbusd ymm (AVX-VNNI) / zmm (AVX-512 VNNI)   exact u8 x s8 into int32: run only where the CPU has them
   GOP/s counts a multiply-add as 2 ops. The last line's dependent vpaddd chain gives the clock in GHz. */
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define IT 50000000L
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                "xmm12", "xmm13", "xmm14", "xmm15"
#define RUN(name, body, macs, ops)                                                                              \
  do {                                                                                                          \
    double t = now();                                                                                           \
    for (long i = 0; i < IT; i++) __asm__ volatile(body ::: CLOBBER);                                           \
    double d = now() - t;                                                                                       \
    printf("%-44s %7.1f GOP/s  (%.2f G instr/s)\n", name, IT * (double)(macs) * 2 / d / 1e9, IT * (double)(ops) / d / 1e9); \
  } while (0)

/* 8 (or 4) independent chains: accumulators ymm0-7, sources ymm8-11, temporaries ymm12-15 */
#define MADD_ADD(s1, s2, t, acc) "vpmaddwd %%ymm" #s1 ",%%ymm" #s2 ",%%ymm" #t "\n vpaddd %%ymm" #t ",%%ymm" #acc ",%%ymm" #acc "\n"
#define UBS_ADDW(s1, s2, t, acc) "vpmaddubsw %%ymm" #s1 ",%%ymm" #s2 ",%%ymm" #t "\n vpaddw %%ymm" #t ",%%ymm" #acc ",%%ymm" #acc "\n"
#define UBS_WD_ADD(s1, s2, t, acc)                                                         \
  "vpmaddubsw %%ymm" #s1 ",%%ymm" #s2 ",%%ymm" #t "\n vpmaddwd %%ymm15,%%ymm" #t ",%%ymm" #t \
  "\n vpaddd %%ymm" #t ",%%ymm" #acc ",%%ymm" #acc "\n"
#define DPBUSD_Y(s1, s2, t, acc) "%{vex%} vpdpbusd %%ymm" #s1 ",%%ymm" #s2 ",%%ymm" #acc "\n"
#define DPBUSD_Z(s1, s2, t, acc) "vpdpbusd %%zmm" #s1 ",%%zmm" #s2 ",%%zmm" #acc "\n"
/* the 8 chains every 2-instruction mix runs: (source, source, temporary, accumulator) */
#define CHAINS8(OP)                                                                                    \
  OP(8, 9, 12, 0) OP(8, 10, 13, 1) OP(8, 11, 14, 2) OP(9, 10, 15, 3) OP(9, 11, 12, 4) OP(10, 11, 13, 5) \
  OP(8, 8, 14, 6) OP(9, 9, 15, 7)

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) {
    puts("no AVX2 on this CPU");
    return 0;
  }
  RUN("vpmaddwd + vpaddd (exact, 16 MAC)", CHAINS8(MADD_ADD), 8 * 16, 16);
  RUN("vpmaddubsw + vpmaddwd(1) + vpaddd (sat., 32)",
      UBS_WD_ADD(8, 9, 12, 0) UBS_WD_ADD(8, 10, 13, 1) UBS_WD_ADD(8, 11, 14, 2) UBS_WD_ADD(9, 10, 12, 3),
      4 * 32, 12);
  RUN("vpmaddubsw + vpaddw (sat. int16, 32 MAC)", CHAINS8(UBS_ADDW), 8 * 32, 16);
#if defined(__GNUC__) && __GNUC__ >= 11
  if (__builtin_cpu_supports("avxvnni"))
    RUN("{vex} vpdpbusd ymm (AVX-VNNI, exact, 32 MAC)", CHAINS8(DPBUSD_Y), 8 * 32, 8);
  else
    puts("(no AVX-VNNI: vpdpbusd ymm not run)");
#endif
  if (__builtin_cpu_supports("avx512vnni"))
    RUN("vpdpbusd zmm (AVX-512 VNNI, exact, 64 MAC)", CHAINS8(DPBUSD_Z), 8 * 64, 8);
  else
    puts("(no AVX-512 VNNI: vpdpbusd zmm not run)");
  double t = now();
  for (long i = 0; i < IT; i++)
    __asm__ volatile("vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm8,%%ymm0,%%ymm0\n"
                     "vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm8,%%ymm0,%%ymm0\n"
                     "vpaddd %%ymm8,%%ymm0,%%ymm0\n vpaddd %%ymm8,%%ymm0,%%ymm0\n" ::: CLOBBER);
  printf("%-44s %7.2f GHz\n", "clock (dependent vpaddd chain)", IT * 8.0 / (now() - t) / 1e9);
  return 0;
}
