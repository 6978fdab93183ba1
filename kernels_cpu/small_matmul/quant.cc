// Small-M matmul on quantized weights for XLA:CPU, through the XLA FFI: the packed-panel
// pass of matmul.cc, streaming 8- or 4-bit values instead of float32 and dequantizing
// them in registers.
//
//   x [M, K] f32, then per weight (1..4 sharing x: q/k/v, gate/up) three buffers:
//     q      int8  [N / 32, K, 32]        8-bit values, panel p row k = columns 32p..32p+31
//            uint8 [N / 32, K / 2, 32]    4-bit values 0..15: byte (j, c) holds row 2j in
//                                         its low nibble and row 2j + 1 in its high one
//     scale  f16 or f32 [N / 32, K / B, 32]   one per column and block of B rows of K
//     offset the same as scale, or empty      (w = scale * q + offset)
//   y_i [M, N_i] f32 = x @ w_i
//
// Every format the engine keeps maps onto this one: int8 per output channel (B = K, no
// offset), GGUF Q8_0 (B = 32, f16 d), Q4_0 (f16 d, offset -8 d), Q4_1 (f16 d and m) and
// Q4_K (B = 32, f32 d * sc and -dmin * mn: those products do not fit f16 exactly). The
// bit width, scale type and offset are read from the buffers' types and shapes.
//
// Why: at a few rows a matmul streams every weight once, so its time is the weight bytes
// over the memory bandwidth; float32 panels are 4 bytes a weight, these 1 or 0.5 (plus
// 2-4 bytes of scale and offset per 32). Up to 8 rows of x, each row of a panel is
// loaded, widened to float32 and dequantized in registers (w = scale * q + offset: one
// FMA per 16 values) and then used by every row of x (accumulators in registers, as
// matmul.cc's tile). Past 8 rows (a prefill chunk) the panel is dequantized once into a
// float32 scratch panel and matmul.cc's float32 pass multiplies it: the widening is then
// paid once per panel instead of once per row group. Either way each product is x times
// the float32 value scale * q + offset, the reference's "dequantize, then dot", summed
// in the kernel's order: results agree with that reference to float32 rounding.
//
// int8 activations (opt-in, the `int8_acts` attribute; 4-bit panels, blocks of 32 rows, up
// to 8 rows of x, an x86 build with AVX2): x is quantized per row and block of 32 values
// (x ~ s * xq, xq int8, s = max |x| / 127, as llama.cpp does for its dot products) and
// each block's product is integer: the nibble pairs of a column are unpacked next to each
// other and vpmaddubsw multiplies them by the matching pair of xq, summed in int16 over
// 16 rows (|sum| <= 8 * 2 * 15 * 127 < 2^15), widened to float and scaled once per
// block: y += (scale * s) * sum(q * xq) + offset * sum(x), the offset's term with x's
// float32 sum. About a quarter of the float path's instructions per weight, which on
// AVX2 (8-float vectors) is what bounds a 4-bit decode step; the error is x's rounding to
// 8 bits (docs/kernels.md). 8-bit panels (Q8_0, int8 per channel) past 8 rows, where the
// float pass is bound by its FMAs, take x quantized to 16 bits (or 8) into AVX512-VNNI's
// dot products on CPUs that have them (an AVX-512 build; see PanelsQ8Dot); at up to 8
// rows, or without VNNI, they stay on the float path.
//
// Threads: XLA's pool as in matmul.cc; built for this CPU's x86-64 level or with
// target_clones (portable build; the widening and float16 converts are spelled out for
// AVX-512 and AVX2 and left to the compiler, or scalar code, elsewhere).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "../cpu_kernels.h"
#include "../vec16.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::I16;
using jaxserve_cpu::kLanes;
using jaxserve_cpu::V16;
typedef int8_t S8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t U8x16 __attribute__((vector_size(16), aligned(1)));
constexpr int64_t kPanel = 32;
constexpr int kRowGroup = 8;
constexpr int64_t kPrefetchBytes = 8 << 10;   // as matmul.cc: 8 KB ahead, into L2
constexpr int64_t kBytesPerThread = 256 << 10;

JAXSERVE_INLINE V16 LoadF(const float* p) { return jaxserve_cpu::VLoad(p); }
JAXSERVE_INLINE void Store(float* p, V16 v) { jaxserve_cpu::VStore(p, v); }

#if defined(__AVX2__) && !defined(__AVX512F__)
// Two 8-float halves as one 16-float vector (its two ymm registers).
JAXSERVE_INLINE V16 Join(__m256 lo, __m256 hi) {
  return V16{reinterpret_cast<jaxserve_cpu::F8>(lo), reinterpret_cast<jaxserve_cpu::F8>(hi)};
}
#endif

#if !defined(__AVX2__)
// 16 int32 lanes from 16 bytes, for the portable path (the ISA paths below spell it out).
template <typename B>
JAXSERVE_INLINE I16 WidenBytes(B v) {
  typedef std::remove_cv_t<std::remove_reference_t<decltype(v[0])>> E;
  typedef E E8 __attribute__((vector_size(8)));
  const E8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const E8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return I16{__builtin_convertvector(lo, jaxserve_cpu::S8),
             __builtin_convertvector(hi, jaxserve_cpu::S8)};
}
#endif

// 16 int8 -> float32: vpmovsxbd + vcvtdq2ps (GCC scalarizes the generic
// byte -> float vector conversion, so the ISA paths spell it out).
JAXSERVE_INLINE V16 Widen(S8x16 v) {
#if defined(__AVX512F__)
  return reinterpret_cast<V16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      reinterpret_cast<__m128i>(v))));
#elif defined(__AVX2__)
  const __m128i b = reinterpret_cast<__m128i>(v);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  return Join(lo, hi);
#else
  return jaxserve_cpu::VToFloat(WidenBytes(v));
#endif
}
// 16 bytes of 4-bit pairs -> their low and high nibbles as float32: one widening to
// 32-bit lanes, then the nibbles split there (half the shuffles of widening each).
JAXSERVE_INLINE void Widen4(U8x16 v, V16& lo, V16& hi) {
#if defined(__AVX512F__)
  const I16 z = reinterpret_cast<I16>(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(v)));
  lo = __builtin_convertvector(z & 15, V16);
  hi = __builtin_convertvector(z >> 4, V16);
#elif defined(__AVX2__)
  const __m128i b = reinterpret_cast<__m128i>(v);
  const __m256i a = _mm256_cvtepu8_epi32(b), c = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i m = _mm256_set1_epi32(15);
  lo = Join(_mm256_cvtepi32_ps(_mm256_and_si256(a, m)), _mm256_cvtepi32_ps(_mm256_and_si256(c, m)));
  hi = Join(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)));
#else
  const I16 z = WidenBytes(v);
  lo = jaxserve_cpu::VToFloat(z & 15);
  hi = jaxserve_cpu::VToFloat(z >> 4);
#endif
}

// 16 float16 (raw bits) -> float32.
JAXSERVE_INLINE V16 LoadHalf(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<V16>(_mm512_cvtph_ps(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__) && defined(__AVX2__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return Join(lo, hi);
#else
  float out[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    _Float16 h;
    std::memcpy(&h, p + i, 2);
    out[i] = static_cast<float>(h);
  }
  return LoadF(out);
#endif
}

template <bool HALF>
JAXSERVE_INLINE V16 LoadScale(const void* base, int64_t i) {
  if constexpr (HALF) return LoadHalf(static_cast<const uint16_t*>(base) + i);
  else return LoadF(static_cast<const float*>(base) + i);
}

struct Problem {
  const float* x;
  jaxserve_cpu::QPanels w;
  float* y;
  int64_t M, K, N;
  const jaxserve_cpu::QActs* acts = nullptr;    // x quantized (int8 activations) or null
};

#if defined(__AVX2__)
constexpr bool kIntDot = true;

// y[m0 : m0 + MR, panel] = x @ panel with x quantized (see the top): 4-bit values,
// scales / offsets per 32 rows. Columns come out of the unpacking as [0-7 | 16-23] and
// [8-15 | 24-31] (vpunpck works within 128-bit lanes); widening each 128-bit half puts
// them back in order.
template <bool HALF, int MR>
JAXSERVE_INLINE void TileQ4Int(const Problem& p, int64_t m0, int64_t panel) {
  const int64_t K = p.K, nb = K / 32;
  const uint8_t* q = static_cast<const uint8_t*>(p.w.q) + panel * K * kPanel / 2;
  const jaxserve_cpu::QActs& a = *p.acts;
  const int8_t* xq = a.q + m0 * K;
  const float* xs = a.scale + m0 * nb;
  const float* xsum = a.sum + m0 * nb;
  const bool off = p.w.offset != nullptr;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc[MR][4];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 f[MR][4];
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) f[m][j] = _mm256_setzero_ps();
    JAXSERVE_UNROLL
    for (int half = 0; half < 2; ++half) {
      __m256i s0[MR], s1[MR];
      JAXSERVE_UNROLL
      for (int m = 0; m < MR; ++m) s0[m] = s1[m] = _mm256_setzero_si256();
      const int64_t j0 = b * 16 + half * 8;     // byte rows: K rows 2 j0 .. 2 j0 + 15
      JAXSERVE_UNROLL
      for (int j = j0; j < j0 + 8; ++j) {
        const uint8_t* r = q + j * kPanel;
        __builtin_prefetch(r + kPrefetchBytes, 0, 2);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r));
        const __m256i lo = _mm256_and_si256(v, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        const __m256i w0 = _mm256_unpacklo_epi8(lo, hi);   // columns 0-7, 16-23
        const __m256i w1 = _mm256_unpackhi_epi8(lo, hi);   // columns 8-15, 24-31
        JAXSERVE_UNROLL
        for (int m = 0; m < MR; ++m) {
          int16_t pair;
          std::memcpy(&pair, xq + m * K + 2 * j, 2);
          const __m256i xp = _mm256_set1_epi16(pair);
          s0[m] = _mm256_add_epi16(s0[m], _mm256_maddubs_epi16(w0, xp));
          s1[m] = _mm256_add_epi16(s1[m], _mm256_maddubs_epi16(w1, xp));
        }
      }
      JAXSERVE_UNROLL
      for (int m = 0; m < MR; ++m) {
        const __m128i a0 = _mm256_castsi256_si128(s0[m]), a1 = _mm256_extracti128_si256(s0[m], 1);
        const __m128i b0 = _mm256_castsi256_si128(s1[m]), b1 = _mm256_extracti128_si256(s1[m], 1);
        f[m][0] = _mm256_add_ps(f[m][0], _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(a0)));
        f[m][1] = _mm256_add_ps(f[m][1], _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(b0)));
        f[m][2] = _mm256_add_ps(f[m][2], _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(a1)));
        f[m][3] = _mm256_add_ps(f[m][3], _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(b1)));
      }
    }
    const int64_t si = (panel * nb + b) * kPanel;
    const V16 sc0 = LoadScale<HALF>(p.w.scale, si), sc1 = LoadScale<HALF>(p.w.scale, si + kLanes);
    V16 of0{}, of1{};
    if (off) {
      of0 = LoadScale<HALF>(p.w.offset, si);
      of1 = LoadScale<HALF>(p.w.offset, si + kLanes);
    }
    __m256 sc[4], oc[4];      // columns 8j .. 8j + 7
    std::memcpy(sc, &sc0, 32 * 2);
    std::memcpy(sc + 2, &sc1, 32 * 2);
    std::memcpy(oc, &of0, 32 * 2);
    std::memcpy(oc + 2, &of1, 32 * 2);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_set1_ps(xs[m * nb + b]), t = _mm256_set1_ps(xsum[m * nb + b]);
      JAXSERVE_UNROLL
      for (int j = 0; j < 4; ++j) {
        acc[m][j] = _mm256_fmadd_ps(_mm256_mul_ps(sc[j], s), f[m][j], acc[m][j]);
        if (off) acc[m][j] = _mm256_fmadd_ps(oc[j], t, acc[m][j]);
      }
    }
  }
  float* y = p.y + m0 * p.N + panel * kPanel;
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + m * p.N + 8 * j, acc[m][j]);
}
#else
constexpr bool kIntDot = false;
#endif

#if defined(__AVX512F__) && defined(__x86_64__)
// 8-bit panels with x quantized, past one row group (prefill chunks, large batches), on a
// CPU with AVX512-VNNI (see the top). Two widths of x, chosen per call (`narrow_acts`):
//
// 16 bits (the default): x ~ t * xh per row and block of 32 values, t = max |x| / 32767,
// and vpdpwssd sums the products of 2 int16 pairs into each int32 lane: 32 multiply-adds
// an instruction against a float FMA's 16. Each panel is first widened into a scratch
// panel (L1 / L2 resident) whose 4-byte lanes hold 2 consecutive K rows of one column as
// int16, the operand vpdpwssd takes; every row group of x then reads it. Sums are exact
// (|sum| <= 32 * 32767 * 128 < 2^31); each block is scaled once: y += (scale * t) *
// sum(q * xh). The error is x's rounding to 16 bits, about 1.5e-5 of a block's largest
// input per value.
//
// 8 bits (narrow): x as for 4-bit panels (s = max |x| / 127), and vpdpbusd sums 4
// products of an unsigned and a signed byte into each lane, 64 an instruction. x enters
// as u = xq + 128 and the weights as stored, so each block's sum is corrected by
// 128 * sum(q) over its rows, a constant of the panel computed with its rearrangement
// (4 K rows of a column per lane): y += (scale * s) * (sum(u * q) - 128 * sum(q)). The
// model asks for it only where the input is a norm's output (model/cpu/matmul.py:
// KernelLinear.many), where 8 bits kept the quality bars; everywhere it did not
// (docs/kernels.md).
#define JAXSERVE_VNNI __attribute__((target("avx512vnni")))
constexpr int kVnniRows = 6;      // rows of x per register tile: 24 accumulators

bool VnniCpu() {
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok;
}

// Panel `panel` of 8-bit values into wi [K / 2, 32, 2] int16 (2 rows of a column per lane).
JAXSERVE_VNNI JAXSERVE_INLINE void WidenPairsQ8(const Problem& p, int64_t panel, int16_t* wi) {
  const int64_t K = p.K;
  const int8_t* q = static_cast<const int8_t*>(p.w.q) + panel * K * kPanel;
  // vpermt2w picks: lane 2i <- row k column i, lane 2i + 1 <- row k + 1 column i
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = int16_t(i);
    lo_idx[2 * i + 1] = int16_t(32 + i);
    hi_idx[2 * i] = int16_t(16 + i);
    hi_idx[2 * i + 1] = int16_t(48 + i);
  }
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i a = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * kPanel)));
    const __m512i b = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (k + 1) * kPanel)));
    _mm512_storeu_si512(wi + k * kPanel, _mm512_permutex2var_epi16(a, il, b));
    _mm512_storeu_si512(wi + k * kPanel + 32, _mm512_permutex2var_epi16(a, ih, b));
  }
}

// Panel `panel` of 8-bit values into wi [K / 4, 32, 4] (4 rows of a column per lane) and
// ncorr [K / 32, 32] = -128 * each column's sum over each block of 32 rows.
JAXSERVE_VNNI JAXSERVE_INLINE void InterleaveQ8(const Problem& p, int64_t panel, int8_t* wi,
                                                int32_t* ncorr) {
  const int64_t K = p.K;
  const int8_t* q = static_cast<const int8_t*>(p.w.q) + panel * K * kPanel;
  const __m512i bias = _mm512_set1_epi8(char(0x80));    // 128 as the unsigned operand
  auto row = [&](int64_t k) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * kPanel));
  };
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    JAXSERVE_UNROLL
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t k = b * 32 + 4 * j;
      const __m256i r0 = row(k), r1 = row(k + 1), r2 = row(k + 2), r3 = row(k + 3);
      // byte pairs, then quads, within 128-bit lanes: columns [0-3 | 16-19], [4-7 | 20-23],
      // [8-11 | 24-27], [12-15 | 28-31]
      const __m256i t0 = _mm256_unpacklo_epi8(r0, r1), t1 = _mm256_unpackhi_epi8(r0, r1);
      const __m256i t2 = _mm256_unpacklo_epi8(r2, r3), t3 = _mm256_unpackhi_epi8(r2, r3);
      const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
      const __m512i lo = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_permute2x128_si256(u0, u1, 0x20)),
          _mm256_permute2x128_si256(u2, u3, 0x20), 1);                     // columns 0-15
      const __m512i hi = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_permute2x128_si256(u0, u1, 0x31)),
          _mm256_permute2x128_si256(u2, u3, 0x31), 1);                     // columns 16-31
      _mm512_storeu_si512(wi + k * kPanel, lo);
      _mm512_storeu_si512(wi + k * kPanel + 64, hi);
      c0 = _mm512_dpbusd_epi32(c0, bias, lo);
      c1 = _mm512_dpbusd_epi32(c1, bias, hi);
    }
    _mm512_storeu_si512(ncorr + b * kPanel, _mm512_sub_epi32(_mm512_setzero_si512(), c0));
    _mm512_storeu_si512(ncorr + b * kPanel + 16, _mm512_sub_epi32(_mm512_setzero_si512(), c1));
  }
}

// y[m0 : m0 + MR, the panel's 32 columns] from the rearranged panel wi and x's values:
// BYTES, x's u bytes and vpdpbusd over 4 rows a lane (the block's sums start at ncorr);
// else x's int16 values and vpdpwssd over 2. Either way a step reads 128 bytes of wi
// (4 rows of 8-bit, 2 of 16-bit values) and 4 bytes of each row of x.
template <bool HALF, int MR, bool BYTES>
JAXSERVE_VNNI JAXSERVE_INLINE void TileQ8Dot(const Problem& p, const uint8_t* wi,
                                             const int32_t* ncorr, int64_t m0, int64_t panel) {
  constexpr int64_t kWidth = BYTES ? 1 : 2;          // bytes per value of x and of wi
  const int64_t K = p.K, nb = K / 32, B = p.w.block, nbw = K / B;
  const uint8_t* xr = (BYTES ? p.acts->u : reinterpret_cast<const uint8_t*>(p.acts->h)) +
                      m0 * K * kWidth;
  const float* xs = (BYTES ? p.acts->scale : p.acts->h_scale) + m0 * nb;
  __m512 f[MR][2];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    if constexpr (BYTES) {
      c0 = _mm512_loadu_si512(ncorr + b * kPanel);
      c1 = _mm512_loadu_si512(ncorr + b * kPanel + 16);
    }
    __m512i a[MR][2];
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      a[m][0] = c0;
      a[m][1] = c1;
    }
    const uint8_t* wb = wi + b * 32 * kPanel * kWidth;
    JAXSERVE_UNROLL
    for (int j = 0; j < 8 * kWidth; ++j) {
      const __m512i w0 = _mm512_loadu_si512(wb + j * 128);
      const __m512i w1 = _mm512_loadu_si512(wb + j * 128 + 64);
      JAXSERVE_UNROLL
      for (int m = 0; m < MR; ++m) {
        int32_t lane;
        std::memcpy(&lane, xr + (m * K + b * 32) * kWidth + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(lane);
        if constexpr (BYTES) {
          a[m][0] = _mm512_dpbusd_epi32(a[m][0], xb, w0);
          a[m][1] = _mm512_dpbusd_epi32(a[m][1], xb, w1);
        } else {
          a[m][0] = _mm512_dpwssd_epi32(a[m][0], xb, w0);
          a[m][1] = _mm512_dpwssd_epi32(a[m][1], xb, w1);
        }
      }
    }
    const int64_t si = (panel * nbw + b * 32 / B) * kPanel;
    const __m512 s0 = reinterpret_cast<__m512>(LoadScale<HALF>(p.w.scale, si));
    const __m512 s1 = reinterpret_cast<__m512>(LoadScale<HALF>(p.w.scale, si + kLanes));
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m512 t = _mm512_set1_ps(xs[m * nb + b]);
      f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, t), f[m][0]);
      f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, t), f[m][1]);
    }
  }
  float* y = p.y + m0 * p.N + panel * kPanel;
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(y + m * p.N, f[m][0]);
    _mm512_storeu_ps(y + m * p.N + kLanes, f[m][1]);
  }
}

// Panels [p0, p1) of an 8-bit weight with x quantized (BYTES: to 8 bits, else 16).
template <bool HALF, bool BYTES>
JAXSERVE_VNNI __attribute__((noinline)) void PanelsQ8Dot(const Problem& p, int64_t p0,
                                                         int64_t p1) {
  thread_local std::vector<uint8_t> wi;
  thread_local std::vector<int32_t> ncorr;
  wi.resize(p.K * kPanel * (BYTES ? 1 : 2));
  if (BYTES) ncorr.resize(p.K);     // K / 32 blocks of 32 columns
  for (int64_t panel = p0; panel < p1; ++panel) {
    if constexpr (BYTES) InterleaveQ8(p, panel, reinterpret_cast<int8_t*>(wi.data()), ncorr.data());
    else WidenPairsQ8(p, panel, reinterpret_cast<int16_t*>(wi.data()));
    for (int64_t m0 = 0; m0 < p.M; m0 += kVnniRows) {
      switch (std::min<int64_t>(kVnniRows, p.M - m0)) {
        case 1: TileQ8Dot<HALF, 1, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
        case 2: TileQ8Dot<HALF, 2, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
        case 3: TileQ8Dot<HALF, 3, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
        case 4: TileQ8Dot<HALF, 4, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
        case 5: TileQ8Dot<HALF, 5, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
        default: TileQ8Dot<HALF, 6, BYTES>(p, wi.data(), ncorr.data(), m0, panel); break;
      }
    }
  }
}
#else
bool VnniCpu() { return false; }
#endif

// y[m0 : m0 + MR, the panel's 32 columns] = x[m0 : m0 + MR] @ dequantized panel.
template <int BITS, bool HALF, bool OFF, int MR>
JAXSERVE_INLINE void TileQ(const Problem& p, int64_t m0, int64_t panel) {
  const int64_t K = p.K, B = p.w.block, nb = K / B;
  const uint8_t* q = static_cast<const uint8_t*>(p.w.q) + panel * K * kPanel * BITS / 8;
  const int64_t sbase = panel * nb * kPanel;
  const float* xr = p.x + m0 * K;
  V16 acc[MR][2];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = V16{};
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t si = sbase + b * kPanel;
    const V16 s0 = LoadScale<HALF>(p.w.scale, si), s1 = LoadScale<HALF>(p.w.scale, si + kLanes);
    V16 o0{}, o1{};
    if constexpr (OFF) {
      o0 = LoadScale<HALF>(p.w.offset, si);
      o1 = LoadScale<HALF>(p.w.offset, si + kLanes);
    }
    if constexpr (BITS == 8) {
      for (int64_t k = b * B; k < (b + 1) * B; ++k) {
        const uint8_t* r = q + k * kPanel;
        __builtin_prefetch(r + kPrefetchBytes, 0, 2);
        const V16 w0 = Widen(*reinterpret_cast<const S8x16*>(r)) * s0 + o0;
        const V16 w1 = Widen(*reinterpret_cast<const S8x16*>(r + kLanes)) * s1 + o1;
        JAXSERVE_UNROLL
        for (int m = 0; m < MR; ++m) {
          const float xs = xr[m * K + k];
          acc[m][0] += xs * w0;
          acc[m][1] += xs * w1;
        }
      }
    } else {
      for (int64_t k = b * B; k < (b + 1) * B; k += 2) {
        const uint8_t* r = q + k / 2 * kPanel;
        __builtin_prefetch(r + kPrefetchBytes, 0, 2);
        const U8x16 b0 = *reinterpret_cast<const U8x16*>(r);
        const U8x16 b1 = *reinterpret_cast<const U8x16*>(r + kLanes);
        V16 lo0, lo1, hi0, hi1;
        Widen4(b0, lo0, hi0);
        Widen4(b1, lo1, hi1);
        lo0 = lo0 * s0 + o0;
        lo1 = lo1 * s1 + o1;
        hi0 = hi0 * s0 + o0;
        hi1 = hi1 * s1 + o1;
        JAXSERVE_UNROLL
        for (int m = 0; m < MR; ++m) {
          const float xa = xr[m * K + k], xb = xr[m * K + k + 1];
          acc[m][0] += xa * lo0;
          acc[m][1] += xa * lo1;
          acc[m][0] += xb * hi0;
          acc[m][1] += xb * hi1;
        }
      }
    }
  }
  float* y = p.y + m0 * p.N + panel * kPanel;
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    Store(y + m * p.N, acc[m][0]);
    Store(y + m * p.N + kLanes, acc[m][1]);
  }
}

// The panel dequantized into out [K, 32] (float32, the layout of matmul.cc's panels).
template <int BITS, bool HALF, bool OFF>
JAXSERVE_INLINE void DequantPanel(const Problem& p, int64_t panel, float* out) {
  const int64_t K = p.K, B = p.w.block, nb = K / B;
  const uint8_t* q = static_cast<const uint8_t*>(p.w.q) + panel * K * kPanel * BITS / 8;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t si = (panel * nb + b) * kPanel;
    const V16 s0 = LoadScale<HALF>(p.w.scale, si), s1 = LoadScale<HALF>(p.w.scale, si + kLanes);
    V16 o0{}, o1{};
    if constexpr (OFF) {
      o0 = LoadScale<HALF>(p.w.offset, si);
      o1 = LoadScale<HALF>(p.w.offset, si + kLanes);
    }
    for (int64_t k = b * B; k < (b + 1) * B; k += (BITS == 8 ? 1 : 2)) {
      float* o = out + k * kPanel;
      if constexpr (BITS == 8) {
        const uint8_t* r = q + k * kPanel;
        Store(o, Widen(*reinterpret_cast<const S8x16*>(r)) * s0 + o0);
        Store(o + kLanes, Widen(*reinterpret_cast<const S8x16*>(r + kLanes)) * s1 + o1);
      } else {
        const uint8_t* r = q + k / 2 * kPanel;
        const U8x16 b0 = *reinterpret_cast<const U8x16*>(r);
        const U8x16 b1 = *reinterpret_cast<const U8x16*>(r + kLanes);
        V16 lo0, lo1, hi0, hi1;
        Widen4(b0, lo0, hi0);
        Widen4(b1, lo1, hi1);
        Store(o, lo0 * s0 + o0);
        Store(o + kLanes, lo1 * s1 + o1);
        Store(o + kPanel, hi0 * s0 + o0);
        Store(o + kPanel + kLanes, hi1 * s1 + o1);
      }
    }
  }
}

// Past one row group, a panel is dequantized once into a float32 scratch panel (L2
// resident) and multiplied by matmul.cc's float32 pass: a prefill chunk then runs at the
// float32 kernel's speed instead of widening every value once per 8 rows.
template <int BITS, bool HALF, bool OFF>
JAXSERVE_INLINE void PanelsQ(const Problem& p, int64_t p0, int64_t p1) {
  if (p.M > kRowGroup) {
#if defined(JAXSERVE_VNNI)
    if constexpr (BITS == 8) {
      if (p.acts != nullptr && p.acts->u != nullptr) {    // set only where IntDotSupported
        PanelsQ8Dot<HALF, true>(p, p0, p1);
        return;
      }
      if (p.acts != nullptr && p.acts->h != nullptr) {
        PanelsQ8Dot<HALF, false>(p, p0, p1);
        return;
      }
    }
#endif
    thread_local std::vector<float> scratch;
    scratch.resize(p.K * kPanel);
    for (int64_t panel = p0; panel < p1; ++panel) {
      DequantPanel<BITS, HALF, OFF>(p, panel, scratch.data());
      // scratch as panel 0 of a weight whose outputs start at this panel's columns
      jaxserve_cpu::MatmulPackedPanels(p.x, scratch.data(), p.y + panel * kPanel, p.M, p.K,
                                       p.N, 0, 1);
    }
    return;
  }
#if defined(__AVX2__)
  if constexpr (BITS == 4) {
    if (p.acts != nullptr) {       // set only where IntDotSupported
      for (int64_t panel = p0; panel < p1; ++panel)
        for (int64_t m0 = 0; m0 < p.M; m0 += 4) {
          switch (std::min<int64_t>(4, p.M - m0)) {
            case 1: TileQ4Int<HALF, 1>(p, m0, panel); break;
            case 2: TileQ4Int<HALF, 2>(p, m0, panel); break;
            case 3: TileQ4Int<HALF, 3>(p, m0, panel); break;
            default: TileQ4Int<HALF, 4>(p, m0, panel); break;
          }
        }
      return;
    }
  }
#endif
  for (int64_t panel = p0; panel < p1; ++panel) {
    switch (p.M) {
      case 1: TileQ<BITS, HALF, OFF, 1>(p, 0, panel); break;
      case 2: TileQ<BITS, HALF, OFF, 2>(p, 0, panel); break;
      case 3: TileQ<BITS, HALF, OFF, 3>(p, 0, panel); break;
      case 4: TileQ<BITS, HALF, OFF, 4>(p, 0, panel); break;
      case 5: TileQ<BITS, HALF, OFF, 5>(p, 0, panel); break;
      case 6: TileQ<BITS, HALF, OFF, 6>(p, 0, panel); break;
      case 7: TileQ<BITS, HALF, OFF, 7>(p, 0, panel); break;
      default: TileQ<BITS, HALF, OFF, 8>(p, 0, panel); break;
    }
  }
}

// The formats the engine makes (see the top); others are refused when the call starts.
JAXSERVE_HOT void RangeQ(const Problem& p, int64_t p0, int64_t p1) {
  const auto& w = p.w;
  const bool off = w.offset != nullptr;
  if (w.bits == 8 && !w.half && !off) PanelsQ<8, false, false>(p, p0, p1);
  else if (w.bits == 8 && w.half && !off) PanelsQ<8, true, false>(p, p0, p1);
  else if (w.bits == 4 && w.half && off) PanelsQ<4, true, true>(p, p0, p1);
  else if (w.bits == 4 && !w.half && off) PanelsQ<4, false, true>(p, p0, p1);
}

}  // namespace

bool jaxserve_cpu::QuantFormatSupported(const QPanels& w) {
  const bool off = w.offset != nullptr;
  return (w.bits == 8 && !off) || (w.bits == 4 && off);
}

bool jaxserve_cpu::IntDotSupported(const QPanels& w, int64_t M, int64_t K) {
  if (M < 1 || K % 32 != 0) return false;
  if (w.bits == 4) return kIntDot && w.block == 32 && M <= kRowGroup;
  return w.bits == 8 && w.offset == nullptr && w.block % 32 == 0 && M > kRowGroup && VnniCpu();
}

void jaxserve_cpu::QuantizeActs(const float* x, int64_t M, int64_t K, int8_t* q, float* scale,
                                float* sum, uint8_t* u) {
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const float* xb = x + 32 * i;
#if defined(__AVX512F__)
    // the loop below, vectorized (the same values; the block's sum in another order): a
    // prefill chunk quantizes M * K values per call
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float total = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
    const __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i), qa);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i + 16), qb);
    if (u != nullptr) {
      const __m128i flip = _mm_set1_epi8(char(0x80));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 32 * i), _mm_xor_si128(qa, flip));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 32 * i + 16), _mm_xor_si128(qb, flip));
    }
#else
    float amax = 0.0f, total = 0.0f;
    for (int k = 0; k < 32; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      total += xb[k];
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int k = 0; k < 32; ++k) q[32 * i + k] = int8_t(std::nearbyint(xb[k] * inv));
    if (u != nullptr)
      for (int k = 0; k < 32; ++k) u[32 * i + k] = uint8_t(q[32 * i + k] ^ 0x80);
#endif
    scale[i] = amax / 127.0f;
    sum[i] = total;
  }
}

void jaxserve_cpu::QuantizeActs16(const float* x, int64_t M, int64_t K, int16_t* h,
                                  float* scale) {
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const float* xb = x + 32 * i;
#if defined(__AVX512F__)
    // the loop below, vectorized (x * inv rounded half to even either way): a prefill
    // chunk quantizes M * K values per call
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 32 * i),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 32 * i + 16),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
#else
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int k = 0; k < 32; ++k) h[32 * i + k] = int16_t(std::nearbyint(xb[k] * inv));
#endif
    scale[i] = amax / 32767.0f;
  }
}

void jaxserve_cpu::MatmulQuantPanels(const float* x, const QPanels& w, float* y, int64_t M,
                                     int64_t K, int64_t N, int64_t p0, int64_t p1,
                                     const QActs* acts) {
  Problem p{x, w, y, M, K, N};
  if (acts != nullptr && IntDotSupported(w, M, K)) p.acts = acts;
  RangeQ(p, p0, p1);
}

namespace {

constexpr int kMaxProblems = 4;

// One call's panels over all its weights, claimed a chunk at a time by the caller and
// the pool's tasks (reference counted: a task may start after the call returned).
struct Shared {
  Problem p[kMaxProblems];
  int num_problems = 0;
  int64_t chunk[kMaxProblems] = {};              // panels per chunk
  int64_t first_chunk[kMaxProblems + 1] = {};
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int8_t> xq;                   // x quantized (int8 activations)
  std::vector<int16_t> xh;                  // ... to 16 bits, for 8-bit panels
  std::vector<float> xt;
  std::vector<uint8_t> xu;
  std::vector<float> xs, xsum;
  jaxserve_cpu::QActs acts;
};

void Drain(Shared& s) {
  for (int64_t c = s.next.fetch_add(1); c < s.num_chunks; c = s.next.fetch_add(1)) {
    int i = 0;
    while (c >= s.first_chunk[i + 1]) ++i;
    const Problem& p = s.p[i];
    const int64_t a = (c - s.first_chunk[i]) * s.chunk[i];
    RangeQ(p, a, std::min(p.N / kPanel, a + s.chunk[i]));
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == s.num_chunks) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_all();
    }
  }
}

void Run(const std::shared_ptr<Shared>& s, ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t bytes = 0;    // value bytes, once per row group of x
  for (int i = 0; i < s->num_problems; ++i) {
    const Problem& p = s->p[i];
    bytes += p.K * p.N * p.w.bits / 8 * ((p.M + kRowGroup - 1) / kRowGroup);
  }
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::max<int64_t>(1, std::min(threads, bytes / kBytesPerThread));
  const int64_t pieces = threads == 1 ? 1 : 4 * threads;
  s->num_chunks = 0;
  for (int i = 0; i < s->num_problems; ++i) {
    const int64_t panels = s->p[i].N / kPanel;
    s->chunk[i] = std::max<int64_t>(1, (panels + pieces - 1) / pieces);
    s->first_chunk[i] = s->num_chunks;
    s->num_chunks += (panels + s->chunk[i] - 1) / s->chunk[i];
  }
  s->first_chunk[s->num_problems] = s->num_chunks;
  threads = std::min(threads, s->num_chunks);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([s] { Drain(*s); });
  Drain(*s);
  auto finished = [&] { return s->done.load(std::memory_order_acquire) == s->num_chunks; };
  for (int spin = 0; spin < 64 && !finished(); ++spin) std::this_thread::yield();
  if (!finished()) {
    std::unique_lock<std::mutex> lock(s->mu);
    s->cv.wait(lock, finished);
  }
}

// Weight i from its three buffers (see the top); an error message or nullptr.
const char* SetProblem(Problem& p, const float* x, int64_t M, int64_t K, ffi::AnyBuffer q,
                       ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer y) {
  auto qd = q.dimensions(), sd = scale.dimensions(), yd = y.dimensions();
  jaxserve_cpu::QPanels& w = p.w;
  if (q.element_type() == ffi::DataType::S8) w.bits = 8;
  else if (q.element_type() == ffi::DataType::U8) w.bits = 4;
  else return "values must be int8 (8-bit) or uint8 (4-bit pairs)";
  if (scale.element_type() != ffi::DataType::F16 && scale.element_type() != ffi::DataType::F32)
    return "scales must be float16 or float32";
  w.half = scale.element_type() == ffi::DataType::F16;
  if (qd.size() != 3 || sd.size() != 3 || qd[2] != kPanel || sd[2] != kPanel ||
      sd[0] != qd[0] || qd[1] * (w.bits == 4 ? 2 : 1) != K || sd[1] < 1 || K % sd[1] != 0)
    return "inconsistent weight shapes";
  w.block = K / sd[1];
  if (w.bits == 4 && w.block % 2 != 0) return "4-bit blocks must hold an even row count";
  w.offset = nullptr;
  if (offset.element_count() != 0) {
    if (offset.element_type() != scale.element_type() ||
        offset.element_count() != scale.element_count())
      return "offsets must match the scales";
    w.offset = offset.untyped_data();
  }
  if (!jaxserve_cpu::QuantFormatSupported(w)) return "unsupported combination";
  w.q = q.untyped_data();
  w.scale = scale.untyped_data();
  p.N = qd[0] * kPanel;
  if (y.element_type() != ffi::DataType::F32 || yd.size() != 2 || yd[0] != M || yd[1] != p.N)
    return "outputs must be float32 [M, N]";
  p.x = x; p.M = M; p.K = K;
  p.y = static_cast<float*>(y.untyped_data());
  return nullptr;
}

ffi::Error ImplQuant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                     ffi::RemainingRets ys, int64_t num_threads, bool int8_acts,
                     bool narrow_acts) {
  auto xd = x.dimensions();
  const size_t n = ys.size();
  if (xd.size() != 2 || n < 1 || n > size_t(kMaxProblems) || ws.size() != 3 * n)
    return ffi::Error::InvalidArgument("quant_matmul: 2-D x, 1-4 weights (3 buffers each)");
  auto s = std::make_shared<Shared>();
  int kept = 0;
  for (size_t i = 0; i < n; ++i) {
    auto q = ws.get<ffi::AnyBuffer>(3 * i), sc = ws.get<ffi::AnyBuffer>(3 * i + 1),
         of = ws.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (q.has_error() || sc.has_error() || of.has_error() || y.has_error())
      return ffi::Error::InvalidArgument("quant_matmul: bad buffers");
    Problem& p = s->p[kept];
    if (const char* err = SetProblem(p, x.typed_data(), xd[0], xd[1], *q, *sc, *of, *(*y)))
      return ffi::Error::InvalidArgument(std::string("quant_matmul: ") + err);
    if (p.M == 0 || p.N == 0) continue;
    if (p.K == 0) {
      std::memset(p.y, 0, sizeof(float) * p.M * p.N);
      continue;
    }
    ++kept;
  }
  s->num_problems = kept;
  const int64_t M = xd[0], K = xd[1];
  bool any = false;
  for (int i = 0; i < kept && int8_acts; ++i)
    any = any || jaxserve_cpu::IntDotSupported(s->p[i].w, M, K);
  if (any) {
    // x once for all the call's weights (they share it), before any thread starts
    // 4-bit weights take x in 8 bits, 8-bit ones in 16, or in 8 with narrow_acts (the top)
    bool four = false, eight = false;
    for (int i = 0; i < kept; ++i) {
      const bool on = jaxserve_cpu::IntDotSupported(s->p[i].w, M, K);
      four = four || (on && s->p[i].w.bits == 4);
      eight = eight || (on && s->p[i].w.bits == 8);
    }
    if (four || (eight && narrow_acts)) {
      const bool bytes = eight && narrow_acts;      // the unsigned form for vpdpbusd too
      s->xq.resize(M * K);
      s->xs.resize(M * K / 32);
      s->xsum.resize(M * K / 32);
      s->xu.resize(bytes ? M * K : 0);
      jaxserve_cpu::QuantizeActs(x.typed_data(), M, K, s->xq.data(), s->xs.data(),
                                 s->xsum.data(), bytes ? s->xu.data() : nullptr);
      s->acts.q = s->xq.data();
      s->acts.scale = s->xs.data();
      s->acts.sum = s->xsum.data();
      s->acts.u = bytes ? s->xu.data() : nullptr;
    }
    if (eight && !narrow_acts) {
      s->xh.resize(M * K);
      s->xt.resize(M * K / 32);
      jaxserve_cpu::QuantizeActs16(x.typed_data(), M, K, s->xh.data(), s->xt.data());
      s->acts.h = s->xh.data();
      s->acts.h_scale = s->xt.data();
    }
    for (int i = 0; i < kept; ++i)
      if (jaxserve_cpu::IntDotSupported(s->p[i].w, M, K)) s->p[i].acts = &s->acts;
  }
  if (kept > 0) Run(s, pool, num_threads);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveQuantMatmulMany, ImplQuant,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // x [M, K]
        .RemainingArgs()                   // (q, scale, offset) per weight, 1..4
        .RemainingRets()                   // y_i [M, N_i] f32
        .Attr<int64_t>("num_threads")
        .Attr<bool>("int8_acts")           // x quantized where IntDotSupported (see the top)
        .Attr<bool>("narrow_acts"));       // ... in 8 bits for 8-bit panels too, not 16
