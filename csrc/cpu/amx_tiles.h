// AMX tiles driven directly (the W8A8 linear's amx driver, qlinear_packed.cpp; the bf16-token rows driver,
// qlinear.cpp), and a scalar emulation of the same instructions for tests on CPUs without AMX
// (FLASHRL_NATIVE_EMULATE=amx; a test mode, slow).
//
// A kernel is written once against an Ops type, AmxOps or EmulatedAmxOps, whose members have the instructions'
// semantics (Intel SDM, "TILELOADD", "TDPBUSD"):
//   config(cfg)          LDTILECFG: palette 1, tile t has rows[t] rows of colsb[t] bytes (at most 16 x 64)
//   load<T>(p, stride)   TILELOADD: row r of tile T from p + r * stride (colsb[T] bytes), rows past rows[T] zero
//   store<T>(p, stride)  TILESTORED: the reverse
//   zero<T>()            TILEZERO
//   dpbusd<C, A, B>()    TDPBUSD: C.i32[m][n] += sum_{k < colsb[A] / 4} sum_{i < 4} u8 A[m][4k + i] * s8 B[k][4n + i]
//                        (B must have colsb[A] / 4 rows; C rows[A] rows of colsb[B] / 4 int32)
//   dpbf16ps<C, A, B>()  TDPBF16PS: C.f32[m][n] += sum_k A.bf16[m][2k] * B.bf16[k][2n] + A[m][2k + 1] * B[k][2n + 1]
//                        (emulated as two fused multiply-adds per k in k order; the instruction's own
//                        intermediate rounding is not specified that closely: compare with a tolerance)
//   release()            TILERELEASE, and ATen's brgemm told its tile configuration is gone (see below)
// Tile numbers are template arguments: the instructions encode them as immediates.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <cstring>

namespace flashrl_native {

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte memory operand, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int nrows, int ncolsb) {
    rows[t] = static_cast<uint8_t>(nrows);
    colsb[t] = static_cast<uint16_t>(ncolsb);
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#if defined(__x86_64__)
// ATen's cpublas::brgemm keeps its tile configuration loaded per thread between calls (it reconfigures only when
// its own shape changes), so after tiles configured here a thread must tell it that its configuration is gone:
// brgemm_release(true) runs TILERELEASE and clears that cache (release() also runs TILERELEASE itself).
struct AmxOps {
  static constexpr bool kEmulated = false;
  static void config(const TileConfig* c) { asm volatile("ldtilecfg %0" ::"m"(*c)); }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int C, int A, int B>
  static void dpbusd() {  // AT&T order: B, A, C
    asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  static void dpbf16ps() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  static void release() {
    asm volatile("tilerelease" ::: "memory");  // itself: brgemm_release is a no-op in torch builds without oneDNN's ukernel
    at::native::cpublas::brgemm_release(true);
  }
};
#endif

// The same instructions in scalar code on a per-thread tile file: it checks the kernels' addressing and shapes
// where no AMX is (a fault on real tiles, e.g. B's rows not matching A's columns, is an assertion here).
struct EmulatedAmxOps {
  static constexpr bool kEmulated = true;
  struct State {
    TileConfig cfg;
    alignas(64) uint8_t t[8][16 * 64];
    bool configured = false;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void config(const TileConfig* c) {
    State& s = state();
    s.cfg = *c;
    std::memset(s.t, 0, sizeof(s.t));
    s.configured = true;
  }
  static void check(int t) {
    const State& s = state();
    if (!s.configured || s.cfg.rows[t] == 0 || s.cfg.rows[t] > 16 || s.cfg.colsb[t] == 0 || s.cfg.colsb[t] > 64)
      __builtin_trap();  // the real instruction raises #UD
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    check(T);
    State& s = state();
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(s.t[T] + 64 * r, static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    check(T);
    const State& s = state();
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[T] + 64 * r, s.cfg.colsb[T]);
  }
  template <int T>
  static void zero() {
    check(T);
    std::memset(state().t[T], 0, sizeof(state().t[T]));
  }
  // the shapes a dot product needs (#UD otherwise): C rows[A] x colsb[B], B colsb[A] / 4 rows
  template <int C, int A, int B>
  static State& check_dp() {
    check(C);
    check(A);
    check(B);
    State& s = state();
    const TileConfig& c = s.cfg;
    if (c.rows[C] != c.rows[A] || c.colsb[A] / 4 != c.rows[B] || c.colsb[C] != c.colsb[B] || c.colsb[A] % 4)
      __builtin_trap();
    return s;
  }
  template <int C, int A, int B>
  static void dpbusd() {
    State& s = check_dp<C, A, B>();
    const TileConfig& c = s.cfg;
    for (int m = 0; m < c.rows[C]; ++m)
      for (int n = 0; n < c.colsb[C] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, s.t[C] + 64 * m + 4 * n, 4);
        for (int k = 0; k < c.colsb[A] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            acc += int32_t{s.t[A][64 * m + 4 * k + i]} * int32_t{static_cast<int8_t>(s.t[B][64 * k + 4 * n + i])};
        std::memcpy(s.t[C] + 64 * m + 4 * n, &acc, 4);
      }
  }
  template <int C, int A, int B>
  static void dpbf16ps() {
    State& s = check_dp<C, A, B>();
    const TileConfig& c = s.cfg;
    auto bf16 = [](const uint8_t* p) {
      uint32_t bits = uint32_t{p[0]} << 16 | uint32_t{p[1]} << 24;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    };
    for (int m = 0; m < c.rows[C]; ++m)
      for (int n = 0; n < c.colsb[C] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s.t[C] + 64 * m + 4 * n, 4);
        for (int k = 0; k < c.colsb[A] / 4; ++k)
          for (int i = 0; i < 2; ++i)
            acc = __builtin_fmaf(bf16(s.t[A] + 64 * m + 4 * k + 2 * i), bf16(s.t[B] + 64 * k + 4 * n + 2 * i), acc);
        std::memcpy(s.t[C] + 64 * m + 4 * n, &acc, 4);
      }
  }
  static void release() { state().configured = false; }
};

}  // namespace flashrl_native
