// Ragged paged attention for XLA:CPU, called through the XLA FFI.
//
// Same contract as kernels_pallas/ragged_paged_attention: a flat batch of T query
// tokens cut into rows by cu_q_lens (a decode token or a prefill chunk each); row r's
// keys are its first seq_lens[r] cache slots, found through block_tables[r], and the
// step's new tokens are already written to the cache. Query token i of row r sits at
// position seq_len - q_len + i and attends causally (and within a sliding window when
// one is given). Tokens outside every row (padding) get zeros.
//
//   q            [T, N, H]        f32 (unscaled)
//   k/v_cache    [K, NB, bs, H]   f32 (K kv heads, NB blocks of bs slots), or int8 /
//                                 float8_e4m3fn with k/v_scales [K, NB, bs] f32 (the
//                                 quantized cache, jaxserve/attention/kv_quant.py: a slot's
//                                 value is cache * scale; second handler, ImplQuant)
//   cu_q_lens    [R + 1]          s32
//   seq_lens     [R]              s32
//   block_tables [R, P]           s32
//   out          [T, N, H]        f32
//
// Why a kernel: XLA:CPU gathers each token's whole (padded) context and runs tiny
// batched dots over it; here one work item = (row, kv head, tile of <= 16 query tokens)
// walks only the row's own blocks once, online-softmax style (flash attention), with
// the tile's G * 16 query vectors against each 16-slot block while it sits in L1.
// Work items are spread over threads with an atomic counter (rows differ in length).
//
// Threads: XLA's own intra-op pool, handed to the handler through the FFI execution
// context (Ctx<ThreadPool>, in jaxlib's ffi.h since 0.4.3x). Creating threads per call
// cost ~30-60 us per layer per step and oversubscribed the cores XLA's pool already
// occupies; a private persistent pool would still compete with XLA's. See RunAll.
//
// ISA: on an AVX-512 or AVX2+FMA CPU build.py compiles for that x86-64 level only
// (-march=x86-64-v4 / -v3, JAXSERVE_NO_TARGET_CLONES; the level is in the cache key).
// Its portable build (other CPUs, JAXSERVE_PORTABLE_KERNELS=1) targets the baseline and
// compiles the hot loops several times by target_clones: the dynamic loader picks the
// AVX-512 / AVX2+FMA / baseline version.
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

#include "xla/ffi/api/ffi.h"
#include "../cpu_kernels.h"
#include "../vec16.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryTile = 16;
// Below this many (query, key) pairs per thread a pool task costs more than it saves
// (a wake-up is ~5-20 us; a pair is ~2 ns): batch-1 decode runs on the calling thread.
constexpr int64_t kPairsPerThread = 8192;

struct Problem {
  const float* q;
  const void* k;          // float, int8_t or Fp8 (RunItem's CT)
  const void* v;
  const float* ks;        // [K, NB, bs] scales of a quantized cache; null for float
  const float* vs;
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* tables;
  float* out;
  int64_t T, N, H, K, NB, bs, R, P, G;
  float scale;
  int64_t window;   // 0: none
  float soft_cap;   // 0: none
};

// exp(x) for x <= 0 (scores minus their running max), Cephes' expf polynomial after
// x = n ln2 + r: ~1 ulp, and plain arithmetic, so loops over a block's slots vectorize
// (libm's expf is a scalar call; the softmax exps were the largest cost of prefill tiles).
JAXSERVE_INLINE float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;   // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// A float8_e4m3fn cache byte. Decoded through a 256-entry table (no fp8 arithmetic on
// CPUs); int8 converts with a plain cast, which vectorizes.
struct Fp8 {
  uint8_t bits;
};

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN.
float DecodeFp8(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  float x;
  if (e == 0xf && m == 7) x = std::nanf("");
  else if (e == 0) x = std::ldexp(float(m) / 8.0f, -6);
  else x = std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (b & 0x80) ? -x : x;
}

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = DecodeFp8(uint8_t(i));
  }
};
const Fp8Table kFp8;

JAXSERVE_INLINE float ToFloat(float x) { return x; }
JAXSERVE_INLINE float ToFloat(int8_t x) { return float(x); }
JAXSERVE_INLINE float ToFloat(Fp8 x) { return kFp8.v[x.bits]; }

struct WorkItem {
  int32_t row, head, first, count;  // kv head; tokens [first, first + count) of the row
};

// A work item's start: its query vectors scaled (qs [G * count, H], query i*G+g), their
// positions, zero accumulators and sums, running maxima at -1e30.
JAXSERVE_INLINE void StartTile(const Problem& p, const WorkItem& w, int64_t H, int64_t pos0,
                               float* qs, float* qpos, float* acc, float* m, float* l) {
  const int64_t G = p.G, nq = int64_t(w.count) * G;
  for (int64_t i = 0; i < w.count; ++i) {
    const int64_t t = p.cu[w.row] + w.first + i;
    for (int64_t g = 0; g < G; ++g) {
      const float* src = p.q + (t * p.N + w.head * G + g) * H;
      float* dst = qs + (i * G + g) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * p.scale;
      qpos[i * G + g] = float(pos0 + i);
    }
  }
  std::fill(acc, acc + nq * H, 0.0f);
  std::fill(m, m + nq, -1e30f);
  std::fill(l, l + nq, 0.0f);
}

// A work item's end: out = acc / l (0 for a query that saw no key).
JAXSERVE_INLINE void FinishTile(const Problem& p, const WorkItem& w, int64_t H,
                                const float* acc, const float* l) {
  const int64_t G = p.G;
  for (int64_t i = 0; i < w.count; ++i) {
    const int64_t t = p.cu[w.row] + w.first + i;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = i * G + g;
      float* dst = p.out + (t * p.N + w.head * G + g) * H;
      const float inv = l[qi] > 0.0f ? 1.0f / l[qi] : 0.0f;
      for (int64_t h = 0; h < H; ++h) dst[h] = acc[qi * H + h] * inv;
    }
  }
}

// ---- Prefill tiles: scores and values as register-blocked small matmuls --------------
// A prefill tile holds G * 16 query vectors (48 for the default model). Per pass over
// kKeyChunk keys (whole blocks): S = Q K^T with MR query rows x 64 keys of accumulators
// in registers (the keys staged transposed, [H, 64], so a query element is one broadcast
// against 4 vectors of keys); the online softmax on whole vectors (a mask for the causal
// edge and a sliding window); then acc = acc * alpha + P V with MR rows x H accumulators
// in registers, each V row loaded once per MR rows. The per-query loops this replaces
// did one FMA per load (a key vector or an accumulator) and kept the scalar softmax:
// measured in docs/benchmarks.md ("CPU kernels").
using jaxserve_cpu::I16;
using jaxserve_cpu::kLanes;
using jaxserve_cpu::MaxLanes;
using jaxserve_cpu::SumLanes;
using jaxserve_cpu::V16;
using jaxserve_cpu::VSelect;
constexpr int kKeyChunk = 64;                 // keys per pass: 4 vectors of scores
constexpr int kChunkVecs = kKeyChunk / kLanes;

JAXSERVE_INLINE V16 LoadV(const float* p) { return jaxserve_cpu::VLoad(p); }
JAXSERVE_INLINE void StoreV(float* p, V16 v) { jaxserve_cpu::VStore(p, v); }
JAXSERVE_INLINE V16 Splat(float x) { return jaxserve_cpu::VSplat(x); }

// ExpNonPositive on 16 lanes (the same polynomial and range reduction).
JAXSERVE_INLINE V16 ExpNonPositiveV(V16 x) {
  x = VSelect(x < Splat(-87.0f), Splat(-87.0f), x);
  const V16 t = x * 1.44269504088896341f + 0.5f;
  I16 ni = jaxserve_cpu::VToInt(t);                         // toward zero
  ni += (I16)(jaxserve_cpu::VToFloat(ni) > t);              // floor: -1 where it rounded up
  const V16 n = jaxserve_cpu::VToFloat(ni);
  const V16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V16 p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I16 bits = (ni + 127) << 23;
  return p * jaxserve_cpu::VBits(bits);
}

// s[i0 + m, 0:64] = qs[i0 + m, 0:H] . kt[0:H, 0:64] for m < MR.
template <int MR, int H>
JAXSERVE_INLINE void ScoresTile(const float* qs, const float* kt, float* s, int64_t i0) {
  V16 acc[MR][kChunkVecs];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < kChunkVecs; ++j) acc[m][j] = V16{};
  const float* q = qs + i0 * H;
  for (int h = 0; h < H; ++h) {
    V16 kv[kChunkVecs];
    JAXSERVE_UNROLL
    for (int j = 0; j < kChunkVecs; ++j) kv[j] = LoadV(kt + h * kKeyChunk + j * kLanes);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float qh = q[m * H + h];
      JAXSERVE_UNROLL
      for (int j = 0; j < kChunkVecs; ++j) acc[m][j] += qh * kv[j];
    }
  }
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < kChunkVecs; ++j)
      StoreV(s + (i0 + m) * kKeyChunk + j * kLanes, acc[m][j]);
}

// acc[i0 + m] = acc[i0 + m] * alpha[i0 + m] + sum_k s[i0 + m, k] v[k] for m < MR, k < n.
template <int MR, int H>
JAXSERVE_INLINE void ValuesTile(const float* s, const float* const* vrows, int64_t n,
                                const float* alpha, float* acc, int64_t i0) {
  constexpr int HV = H / kLanes;
  V16 a[MR][HV];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < HV; ++j) a[m][j] = LoadV(acc + (i0 + m) * H + j * kLanes) * alpha[i0 + m];
  for (int64_t k = 0; k < n; ++k) {
    V16 vv[HV];
    JAXSERVE_UNROLL
    for (int j = 0; j < HV; ++j) vv[j] = LoadV(vrows[k] + j * kLanes);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float pk = s[(i0 + m) * kKeyChunk + k];
      JAXSERVE_UNROLL
      for (int j = 0; j < HV; ++j) a[m][j] += pk * vv[j];
    }
  }
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < HV; ++j) StoreV(acc + (i0 + m) * H + j * kLanes, a[m][j]);
}

// out[k] = the sum of v[k]'s 16 lanes, k < 16: a transpose-and-add tree (15 pairs of
// shuffles and an add) instead of 16 horizontal sums.
#if defined(__AVX512F__)
JAXSERVE_INLINE V16 SumLanes16(const V16* v) {
  V16 w[8], x[4], y[2];
  JAXSERVE_UNROLL
  for (int i = 0; i < 8; ++i)       // w[i]: v[2i]'s 8 pair sums, then v[2i + 1]'s
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  JAXSERVE_UNROLL
  for (int i = 0; i < 4; ++i)       // x[i]: 4 sums each of v[4i .. 4i + 3]
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                   18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                   21, 22, 23, 28, 29, 30, 31);
  JAXSERVE_UNROLL
  for (int i = 0; i < 2; ++i)       // y[i]: 2 sums each of v[8i .. 8i + 7]
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                   20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                   19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                 27, 29, 31);
}
#else
// The same on 8-lane halves: u[k] = v[k]'s halves added, then an 8-wide tree per 8 keys.
JAXSERVE_INLINE jaxserve_cpu::F8 SumLanes8(const jaxserve_cpu::F8* u) {
  jaxserve_cpu::F8 w[4], x[2];
  JAXSERVE_UNROLL
  for (int i = 0; i < 4; ++i)       // w[i]: u[2i]'s 4 pair sums, then u[2i + 1]'s
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  JAXSERVE_UNROLL
  for (int i = 0; i < 2; ++i)       // x[i]: 2 sums each of u[4i .. 4i + 3]
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

JAXSERVE_INLINE V16 SumLanes16(const V16* v) {
  jaxserve_cpu::F8 u[16];
  JAXSERVE_UNROLL
  for (int k = 0; k < 16; ++k) u[k] = v[k].lo + v[k].hi;
  return V16{SumLanes8(u), SumLanes8(u + 8)};
}
#endif

// Decode tiles (few query vectors): s[i0 + m, 0:64] = qs[i0 + m] . key k, m < MR, keys
// read in place (krows[k], k < n; the rest of the row 0). The queries stay in registers;
// per key, MR partial vectors, whose lanes the tree sums 16 keys at a time.
template <int MR, int H>
JAXSERVE_INLINE void ScoresDotsTile(const float* qs, const float* const* krows, int64_t n,
                                    float* s, int64_t i0) {
  constexpr int HV = H / kLanes;
  V16 q[MR][HV];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < HV; ++j) q[m][j] = LoadV(qs + (i0 + m) * H + j * kLanes);
  V16 part[MR][kLanes];
  for (int64_t k0 = 0; k0 < kKeyChunk; k0 += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      if (k0 + k < n) {
        V16 kv[HV];
        JAXSERVE_UNROLL
        for (int j = 0; j < HV; ++j) kv[j] = LoadV(krows[k0 + k] + j * kLanes);
        JAXSERVE_UNROLL
        for (int m = 0; m < MR; ++m) {
          V16 d = q[m][0] * kv[0];
          JAXSERVE_UNROLL
          for (int j = 1; j < HV; ++j) d += q[m][j] * kv[j];
          part[m][k] = d;
        }
      } else {
        JAXSERVE_UNROLL
        for (int m = 0; m < MR; ++m) part[m][k] = V16{};
      }
    }
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) StoreV(s + (i0 + m) * kKeyChunk + k0, SumLanes16(part[m]));
  }
}

template <int H>
JAXSERVE_INLINE void ScoresDotsAll(const float* qs, const float* const* krows, int64_t n,
                                   float* s, int64_t nq) {
  constexpr int MR = H / kLanes <= 4 ? 4 : 2;     // MR x H / 16 query registers
  int64_t i = 0;
  for (; i + MR <= nq; i += MR) ScoresDotsTile<MR, H>(qs, krows, n, s, i);
  switch (nq - i) {
    case 3: ScoresDotsTile<3, H>(qs, krows, n, s, i); break;
    case 2: ScoresDotsTile<2, H>(qs, krows, n, s, i); break;
    case 1: ScoresDotsTile<1, H>(qs, krows, n, s, i); break;
    default: break;
  }
}

// Rows per values tile: MR x H / 16 accumulators (<= 24 of 32 registers).
template <int H>
constexpr int TileRows() { return H / kLanes <= 4 ? 6 : 3; }

template <int H>
JAXSERVE_INLINE void ScoresAll(const float* qs, const float* kt, float* s, int64_t nq) {
  constexpr int MR = 6;       // 6 x 4 score accumulators whatever H
  int64_t i = 0;
  for (; i + MR <= nq; i += MR) ScoresTile<MR, H>(qs, kt, s, i);
  for (; i < nq; ++i) ScoresTile<1, H>(qs, kt, s, i);
}

template <int H>
JAXSERVE_INLINE void ValuesAll(const float* s, const float* const* vrows, int64_t n,
                               const float* alpha, float* acc, int64_t nq) {
  constexpr int MR = TileRows<H>();
  int64_t i = 0;
  for (; i + MR <= nq; i += MR) ValuesTile<MR, H>(s, vrows, n, alpha, acc, i);
  for (; i < nq; ++i) ValuesTile<1, H>(s, vrows, n, alpha, acc, i);
}

// One (row, kv head, query tile) of a float32 cache, no soft cap. Same contract and
// result as RunItem (up to summation order). Scores: with >= 8 query vectors (prefill)
// against the pass's keys staged transposed, else (decode) dots with the keys in place.
template <int kH, int kBS>
JAXSERVE_INLINE bool RunTile(const Problem& p, const WorkItem& w,
                             std::vector<float>& scratch) {
  static_assert(kH % kLanes == 0 && kKeyChunk % kBS == 0, "whole vectors, whole blocks");
  constexpr int64_t H = kH, bs = kBS;
  const int64_t G = p.G, nq = int64_t(w.count) * G;
  const int64_t q_len = p.cu[w.row + 1] - p.cu[w.row];
  const int64_t pos0 = p.lens[w.row] - q_len + w.first;
  scratch.resize(nq * H * 2 + nq * kKeyChunk + nq * 4 + H * kKeyChunk + kLanes);
  float* qs = scratch.data();               // [nq, H] query i*G+g, scaled
  float* acc = qs + nq * H;                 // [nq, H]
  float* s = acc + nq * H;                  // [nq, 64] scores, then probabilities
  float* m = s + nq * kKeyChunk;            // [nq] running max
  float* l = m + nq;                        // [nq] running sum
  float* alpha = l + nq;                    // [nq] this chunk's rescale of acc
  float* qpos = alpha + nq;                 // [nq] position (exact as float below 2^24)
  float* kt = qpos + nq;                    // [H, 64] the chunk's keys, transposed
  StartTile(p, w, H, pos0, qs, qpos, acc, m, l);
  const float* kc = static_cast<const float*>(p.k);
  const float* vc = static_cast<const float*>(p.v);
  const float* vrows[kKeyChunk];
  const float* krows[kKeyChunk];
  const bool transposed = nq >= 8;
  I16 lane;
  for (int i = 0; i < kLanes; ++i) jaxserve_cpu::VSetLane(lane, i, i);

  const int64_t hi = pos0 + w.count;                       // keys [lo, hi)
  int64_t lo = 0;
  if (p.window > 0) lo = std::max<int64_t>(0, pos0 - p.window + 1);
  const int32_t* table = p.tables + int64_t(w.row) * p.P;
  for (int64_t c0 = lo / bs * bs; c0 < hi; c0 += kKeyChunk) {
    const int64_t n = std::min<int64_t>(kKeyChunk, hi - c0);     // keys of this pass
    for (int64_t b = 0; b * bs < n; ++b) {
      const int64_t j = c0 / bs + b;
      if (j >= p.P) return false;
      const int64_t blk = table[j];
      if (blk < 0 || blk >= p.NB) return false;
      const int64_t slot0 = (w.head * p.NB + blk) * bs;
      const float* kb = kc + slot0 * H;
      const int64_t slots = std::min(bs, n - b * bs);
      for (int64_t k = 0; k < slots; ++k) {
        vrows[b * bs + k] = vc + (slot0 + k) * H;
        krows[b * bs + k] = kb + k * H;
      }
      if (transposed)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t k = 0; k < bs; ++k)
            kt[h * kKeyChunk + b * bs + k] = k < slots ? kb[k * H + h] : 0.0f;
    }
    if (transposed) {
      for (int64_t k = (n + bs - 1) / bs * bs; k < kKeyChunk; ++k)
        for (int64_t h = 0; h < H; ++h) kt[h * kKeyChunk + k] = 0.0f;
      ScoresAll<kH>(qs, kt, s, nq);
    } else {
      ScoresDotsAll<kH>(qs, krows, n, s, nq);
    }
    for (int64_t qi = 0; qi < nq; ++qi) {
      float* srow = s + qi * kKeyChunk;
      const int64_t qp = int64_t(qpos[qi]);
      // valid keys of the pass: c0 + k <= qp, k < n and (window) c0 + k > qp - window
      const int64_t k_end = std::min<int64_t>(n, qp - c0 + 1);
      const int64_t k_begin = p.window > 0 ? std::max<int64_t>(0, qp - p.window + 1 - c0) : 0;
      if (k_end <= k_begin) {                 // nothing here for this query
        alpha[qi] = 1.0f;
        for (int j = 0; j < kChunkVecs; ++j) StoreV(srow + j * kLanes, V16{});
        continue;
      }
      V16 sv[kChunkVecs];
      I16 ok[kChunkVecs];
      V16 vmax = Splat(-1e30f);
      for (int j = 0; j < kChunkVecs; ++j) {
        const I16 idx = lane + j * kLanes;
        ok[j] = (idx >= int32_t(k_begin)) & (idx < int32_t(k_end));
        sv[j] = VSelect(ok[j], LoadV(srow + j * kLanes), Splat(-1e30f));
        vmax = jaxserve_cpu::VMax(vmax, sv[j]);
      }
      const float m_new = std::max(m[qi], MaxLanes(vmax));
      V16 psum = V16{};
      for (int j = 0; j < kChunkVecs; ++j) {
        const V16 e = VSelect(ok[j], ExpNonPositiveV(sv[j] - m_new), V16{});
        psum += e;
        StoreV(srow + j * kLanes, e);
      }
      alpha[qi] = ExpNonPositive(m[qi] - m_new);
      l[qi] = l[qi] * alpha[qi] + SumLanes(psum);
      m[qi] = m_new;
    }
    ValuesAll<kH>(s, vrows, n, alpha, acc, nq);
  }
  FinishTile(p, w, H, acc, l);
  return true;
}

// One (row, kv head, query tile). Scratch holds q tile, scores and accumulators.
// kH / kBS: head dim and block size as compile-time constants (0: take them from p),
// so the common shapes get fully unrolled, vectorized inner loops. CT: the cache's
// element type; a quantized cache's per-slot scales multiply the scores (K) and the
// softmax weights (V), so the H-long loops stay plain converts and FMAs.
template <typename CT, int kH, int kBS>
JAXSERVE_INLINE bool RunItem(const Problem& p, const WorkItem& w, std::vector<float>& scratch) {
  constexpr bool kQuant = !std::is_same_v<CT, float>;
  const int64_t H = kH ? kH : p.H, bs = kBS ? kBS : p.bs, G = p.G;
  const int64_t nq = int64_t(w.count) * G;
  if constexpr (!kQuant && kH > 0 && kBS > 0)
    if (p.soft_cap == 0.0f) return RunTile<kH, kBS>(p, w, scratch);
  const int64_t q_len = p.cu[w.row + 1] - p.cu[w.row];
  const int64_t kv_len = p.lens[w.row];
  const int64_t pos0 = kv_len - q_len + w.first;   // position of the tile's first token
  scratch.resize(nq * H * 2 + nq * bs + nq * 3 + H * bs);
  float* qs = scratch.data();             // [nq, H]  query i*G+g, scaled
  float* acc = qs + nq * H;               // [nq, H]
  float* s = acc + nq * H;                // [nq, bs]
  float* m = s + nq * bs;                 // [nq]
  float* l = m + nq;                      // [nq]
  float* qpos = l + nq;                   // [nq] position (as float is exact up to 2^24)
  float* kt = qpos + nq;                  // [H, bs] the current key block, transposed
  StartTile(p, w, H, pos0, qs, qpos, acc, m, l);

  const int64_t hi = pos0 + w.count;                       // keys [lo, hi)
  int64_t lo = 0;
  if (p.window > 0) lo = std::max<int64_t>(0, pos0 - p.window + 1);
  const int32_t* table = p.tables + int64_t(w.row) * p.P;
  for (int64_t j = lo / bs; j * bs < hi; ++j) {
    if (j >= p.P) return false;
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p.NB) return false;
    const int64_t slot0 = (w.head * p.NB + blk) * bs;
    const CT* kb = static_cast<const CT*>(p.k) + slot0 * H;
    const CT* vb = static_cast<const CT*>(p.v) + slot0 * H;
    const float* ksb = kQuant ? p.ks + slot0 : nullptr;
    const float* vsb = kQuant ? p.vs + slot0 : nullptr;
    const int64_t base = j * bs;
    const int64_t n_slots = std::min(bs, hi - base);
    // Scores of every query against the block's slots. Many queries (prefill tiles):
    // transpose the block to [H, bs] once, then each query is H axpys over bs
    // contiguous lanes (no horizontal sums). Few queries (decode): plain dots.
    if (nq >= 8) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t k = 0; k < bs; ++k)
          kt[h * bs + k] = k < n_slots ? ToFloat(kb[k * H + h]) * (kQuant ? ksb[k] : 1.0f) : 0.0f;
      for (int64_t qi = 0; qi < nq; ++qi) {
        const float* qv = qs + qi * H;
        float* srow = s + qi * bs;
        for (int64_t k = 0; k < bs; ++k) srow[k] = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
          const float qh = qv[h];
          const float* krow = kt + h * bs;
          for (int64_t k = 0; k < bs; ++k) srow[k] += qh * krow[k];
        }
      }
    } else {
      for (int64_t qi = 0; qi < nq; ++qi) {
        const float* qv = qs + qi * H;
        float* srow = s + qi * bs;
        for (int64_t k = 0; k < n_slots; ++k) {
          const CT* kv = kb + k * H;
          float d = 0.0f;
          for (int64_t h = 0; h < H; ++h) d += qv[h] * ToFloat(kv[h]);
          srow[k] = kQuant ? d * ksb[k] : d;
        }
      }
    }
    for (int64_t qi = 0; qi < nq; ++qi) {
      float* srow = s + qi * bs;
      const int64_t qp = int64_t(qpos[qi]);
      // valid slots: base + k <= qp and (window) base + k > qp - window
      int64_t k_end = std::min<int64_t>(n_slots, qp - base + 1);
      int64_t k_begin = 0;
      if (p.window > 0) k_begin = std::max<int64_t>(0, qp - p.window + 1 - base);
      if (k_end <= k_begin) continue;
      float bmax = -1e30f;
      for (int64_t k = k_begin; k < k_end; ++k) {
        float x = srow[k];
        if (p.soft_cap > 0.0f) x = p.soft_cap * std::tanh(x / p.soft_cap);
        srow[k] = x;
        bmax = std::max(bmax, x);
      }
      const float m_new = std::max(m[qi], bmax);
      const float alpha = ExpNonPositive(m[qi] - m_new);
      float* a = acc + qi * H;
      if (alpha != 1.0f)
        for (int64_t h = 0; h < H; ++h) a[h] *= alpha;
      float psum = 0.0f;
      for (int64_t k = k_begin; k < k_end; ++k) {
        srow[k] = ExpNonPositive(srow[k] - m_new);
        psum += srow[k];
      }
      for (int64_t k = k_begin; k < k_end; ++k) {
        const float pk = kQuant ? srow[k] * vsb[k] : srow[k];
        const CT* vv = vb + k * H;
        for (int64_t h = 0; h < H; ++h) a[h] += pk * ToFloat(vv[h]);
      }
      l[qi] = l[qi] * alpha + psum;
      m[qi] = m_new;
    }
  }
  FinishTile(p, w, H, acc, l);
  return true;
}

// The clone points: one per compiled shape (head dim x block size; 0 = generic).
using RunFn = bool (*)(const Problem&, const WorkItem&, std::vector<float>&);
#define JAXSERVE_RUN_ITEM(CT, NAME, KH, KBS)                                          \
  JAXSERVE_HOT bool RunItem_##NAME##_##KH##_##KBS(const Problem& p, const WorkItem& w, \
                                                   std::vector<float>& scratch) {      \
    return RunItem<CT, KH, KBS>(p, w, scratch);                                         \
  }
JAXSERVE_RUN_ITEM(float, f32, 0, 0)
JAXSERVE_RUN_ITEM(float, f32, 64, 16)
JAXSERVE_RUN_ITEM(float, f32, 128, 16)
JAXSERVE_RUN_ITEM(float, f32, 64, 32)
JAXSERVE_RUN_ITEM(float, f32, 128, 32)
// quantized caches: the default block size only (other shapes take the generic path)
JAXSERVE_RUN_ITEM(int8_t, s8, 0, 0)
JAXSERVE_RUN_ITEM(int8_t, s8, 64, 16)
JAXSERVE_RUN_ITEM(int8_t, s8, 128, 16)
JAXSERVE_RUN_ITEM(Fp8, f8, 0, 0)
JAXSERVE_RUN_ITEM(Fp8, f8, 64, 16)
JAXSERVE_RUN_ITEM(Fp8, f8, 128, 16)

RunFn PickRunItem(int64_t H, int64_t bs) {
  if (bs == 16 && H == 64) return &RunItem_f32_64_16;
  if (bs == 16 && H == 128) return &RunItem_f32_128_16;
  if (bs == 32 && H == 64) return &RunItem_f32_64_32;
  if (bs == 32 && H == 128) return &RunItem_f32_128_32;
  return &RunItem_f32_0_0;
}

RunFn PickRunItemS8(int64_t H, int64_t bs) {
  if (bs == 16 && H == 64) return &RunItem_s8_64_16;
  if (bs == 16 && H == 128) return &RunItem_s8_128_16;
  return &RunItem_s8_0_0;
}

RunFn PickRunItemF8(int64_t H, int64_t bs) {
  if (bs == 16 && H == 64) return &RunItem_f8_64_16;
  if (bs == 16 && H == 128) return &RunItem_f8_128_16;
  return &RunItem_f8_0_0;
}

}  // namespace

// One float32 work item for another kernel of this library (cpu_kernels.h).
bool jaxserve_cpu::AttendF32(const AttentionArgs& a, int32_t row, int32_t head, int32_t first,
                             int32_t count) {
  thread_local std::vector<float> scratch;
  Problem p{};
  p.q = a.q; p.k = a.k; p.v = a.v; p.ks = nullptr; p.vs = nullptr;
  p.cu = a.cu; p.lens = a.lens; p.tables = a.tables; p.out = a.out;
  p.T = a.T; p.N = a.N; p.H = a.H; p.K = a.K; p.NB = a.NB; p.bs = a.bs; p.R = a.R; p.P = a.P;
  p.G = a.N / a.K; p.scale = a.scale; p.window = 0; p.soft_cap = 0.0f;
  return PickRunItem(a.H, a.bs)(p, WorkItem{row, head, first, count}, scratch);
}

namespace {

// One call's work list, shared by the calling thread and the pool tasks. Reference
// counted because a task may start after the call returned (all items already taken):
// it then only reads `next` and drops its reference.
struct Shared {
  Problem p;
  RunFn run;
  std::vector<WorkItem> items;
  int64_t pairs = 0;                      // (query, key) pairs over all items: the work
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> ok{true};
  std::mutex mu;                          // the caller sleeps on `cv` if a helper's last
  std::condition_variable cv;             // item outlasts a short spin
};

void Drain(Shared& s) {
  thread_local std::vector<float> scratch;   // reused across calls: no allocation per item
  const int64_t n = int64_t(s.items.size());
  for (int64_t i = s.next.fetch_add(1); i < n; i = s.next.fetch_add(1)) {
    if (!s.run(s.p, s.items[i], scratch)) s.ok.store(false, std::memory_order_relaxed);
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      std::lock_guard<std::mutex> lock(s.mu);   // pairs with the caller's predicate check
      s.cv.notify_all();
    }
  }
}

// The calling thread works too and never waits for a task to *start*: XLA may run
// tasks inline or on a pool whose threads are all busy (even with this very call), so
// waiting for them could deadlock. It only waits, after the list is exhausted, for
// items other threads have already taken (at most one item's time): spinning briefly,
// then sleeping, so on a busy machine the CPU goes to the thread finishing that item.
bool RunAll(const std::shared_ptr<Shared>& s, ffi::ThreadPool& pool, int64_t max_threads) {
  const int64_t n = int64_t(s->items.size());
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min({threads, n, 1 + s->pairs / kPairsPerThread});
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([s] { Drain(*s); });
  Drain(*s);
  auto finished = [&] { return s->done.load(std::memory_order_acquire) == n; };
  for (int spin = 0; spin < 64 && !finished(); ++spin) std::this_thread::yield();
  if (!finished()) {
    std::unique_lock<std::mutex> lock(s->mu);
    s->cv.wait(lock, finished);
  }
  return s->ok.load(std::memory_order_relaxed);
}

// Shapes checked, work list built and run: shared by both handlers. kd: the cache's
// dimensions [K, NB, bs, H]; p.k/p.v (and scales) already set.
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Shared> shared,
               ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
               ffi::Span<const int64_t> td, int64_t v_elements, int64_t v_rank,
               const ffi::Buffer<ffi::S32>& cu_q_lens, const ffi::Buffer<ffi::S32>& seq_lens,
               const ffi::Buffer<ffi::S32>& block_tables, float* out, float scale,
               int64_t sliding_window, float soft_cap, int64_t num_threads,
               RunFn (*pick)(int64_t, int64_t)) {
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks");
  Problem& p = shared->p;
  p.T = qd[0]; p.N = qd[1]; p.H = qd[2];
  p.K = kd[0]; p.NB = kd[1]; p.bs = kd[2];
  p.R = td[0]; p.P = td[1];
  if (kd[3] != p.H || p.K <= 0 || p.N % p.K != 0 || v_rank != 4 ||
      v_elements != p.K * p.NB * p.bs * p.H ||
      cu_q_lens.element_count() != p.R + 1 || seq_lens.element_count() != p.R)
    return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent shapes");
  p.G = p.N / p.K;
  p.cu = cu_q_lens.typed_data(); p.lens = seq_lens.typed_data();
  p.tables = block_tables.typed_data(); p.out = out;
  p.scale = scale; p.window = sliding_window; p.soft_cap = soft_cap;

  std::memset(p.out, 0, sizeof(float) * p.T * p.N * p.H);
  std::vector<WorkItem>& items = shared->items;
  for (int32_t r = 0; r < p.R; ++r) {
    const int32_t a = p.cu[r], b = p.cu[r + 1];
    const int64_t q_len = int64_t(b) - a;
    if (q_len <= 0) continue;
    if (a < 0 || b > p.T || p.lens[r] < q_len || p.lens[r] > p.P * p.bs)
      return ffi::Error::InvalidArgument("ragged_paged_attention: row " + std::to_string(r) +
                                         " out of range");
    for (int32_t f = 0; f < q_len; f += kQueryTile) {
      const int32_t count = int32_t(std::min<int64_t>(kQueryTile, q_len - f));
      for (int32_t h = 0; h < p.K; ++h) items.push_back({r, h, f, count});
      shared->pairs += p.N * count * (p.lens[r] - q_len + f + count);
    }
  }
  // Longest rows first: better balance with dynamic assignment.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
    return p.lens[x.row] - (p.cu[x.row + 1] - p.cu[x.row]) + x.first >
           p.lens[y.row] - (p.cu[y.row + 1] - p.cu[y.row]) + y.first;
  });
  shared->run = pick(p.H, p.bs);
  if (!RunAll(shared, pool, num_threads))
    return ffi::Error::InvalidArgument("ragged_paged_attention: block id out of range");
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> cu_q_lens,
                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window,
                float soft_cap, int64_t num_threads) {
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.q = q.typed_data(); p.k = k_cache.typed_data(); p.v = v_cache.typed_data();
  p.ks = nullptr; p.vs = nullptr;
  if (v_cache.element_count() != k_cache.element_count())
    return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent shapes");
  return Run(pool, shared, q.dimensions(), k_cache.dimensions(), block_tables.dimensions(),
             int64_t(v_cache.element_count()), int64_t(v_cache.dimensions().size()),
             cu_q_lens, seq_lens, block_tables, out->typed_data(), scale, sliding_window,
             soft_cap, num_threads, &PickRunItem);
}

// Impl, with the step's new keys and values written into the caches first (float32
// caches, returned aliased to the inputs): k_new / v_new [T, K, H] go to flat slot
// slot_mapping[t] of each head (out of [0, NB * bs): a padding token, skipped). One call
// instead of XLA's scatter per cache: at decode the scatter's dynamic-slice and
// dynamic-update-slice thunks (each spread over the pool) cost a visible share of a
// batch-1 step on the default model (docs/benchmarks.md, "Measurements behind code choices").
ffi::Error ImplWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                     ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> k_cache,
                     ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> slot_mapping,
                     ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> block_tables, ffi::ResultBuffer<ffi::F32> out,
                     ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out,
                     float scale, int64_t sliding_window, float soft_cap,
                     int64_t num_threads) {
  auto kd = k_cache.dimensions();
  auto nd = k_new.dimensions();
  const int64_t n = int64_t(k_cache.element_count());
  if (kd.size() != 4 || nd.size() != 3 || v_cache.element_count() != size_t(n) ||
      k_out->element_count() != size_t(n) || v_out->element_count() != size_t(n) ||
      v_new.element_count() != k_new.element_count() || nd[1] != kd[0] || nd[2] != kd[3] ||
      int64_t(slot_mapping.element_count()) != nd[0])
    return ffi::Error::InvalidArgument("ragged_paged_attention_write: inconsistent shapes");
  float* kc = k_out->typed_data();
  float* vc = v_out->typed_data();
  // XLA aliases each output with its cache (input_output_aliases), copying first where it
  // could not; the copies below are for a caller that did not alias at all
  if (kc != k_cache.typed_data()) std::memcpy(kc, k_cache.typed_data(), sizeof(float) * n);
  if (vc != v_cache.typed_data()) std::memcpy(vc, v_cache.typed_data(), sizeof(float) * n);
  const int64_t T = nd[0], K = nd[1], H = nd[2], slots = kd[1] * kd[2];
  const int32_t* slot = slot_mapping.typed_data();
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot[t];
    if (s < 0 || s >= slots) continue;
    for (int64_t h = 0; h < K; ++h) {
      std::memcpy(kc + (h * slots + s) * H, kn + (t * K + h) * H, sizeof(float) * H);
      std::memcpy(vc + (h * slots + s) * H, vn + (t * K + h) * H, sizeof(float) * H);
    }
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.q = q.typed_data(); p.k = kc; p.v = vc;
  p.ks = nullptr; p.vs = nullptr;
  return Run(pool, shared, q.dimensions(), kd, block_tables.dimensions(), n, int64_t(kd.size()),
             cu_q_lens, seq_lens, block_tables, out->typed_data(), scale, sliding_window,
             soft_cap, num_threads, &PickRunItem);
}

// Quantized cache: k/v int8 or float8_e4m3fn (both the same), scales [K, NB, bs] f32.
ffi::Error ImplQuant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                     ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_scales,
                     ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                     ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window,
                     float soft_cap, int64_t num_threads) {
  const ffi::DataType type = k_cache.element_type();
  RunFn (*pick)(int64_t, int64_t) = nullptr;
  if (type == ffi::DataType::S8) pick = &PickRunItemS8;
  else if (type == ffi::DataType::F8E4M3FN) pick = &PickRunItemF8;
  if (pick == nullptr || v_cache.element_type() != type)
    return ffi::Error::InvalidArgument("ragged_paged_attention: the quantized cache must be "
                                       "int8 or float8_e4m3fn (k and v alike)");
  auto kd = k_cache.dimensions();
  if (kd.size() != 4 || k_scales.element_count() != kd[0] * kd[1] * kd[2] ||
      v_scales.element_count() != k_scales.element_count())
    return ffi::Error::InvalidArgument("ragged_paged_attention: scales must be [K, NB, bs]");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.q = q.typed_data(); p.k = k_cache.untyped_data(); p.v = v_cache.untyped_data();
  p.ks = k_scales.typed_data(); p.vs = v_scales.typed_data();
  return Run(pool, shared, q.dimensions(), kd, block_tables.dimensions(),
             int64_t(v_cache.element_count()), int64_t(v_cache.dimensions().size()),
             cu_q_lens, seq_lens, block_tables, out->typed_data(), scale, sliding_window,
             soft_cap, num_threads, pick);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveRaggedPagedAttentionF32, Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("scale")
        .Attr<int64_t>("sliding_window")
        .Attr<float>("soft_cap")
        .Attr<int64_t>("num_threads"));   // at most this many threads; 0: XLA's pool size

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveRaggedPagedAttentionQuant, ImplQuant,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("scale")
        .Attr<int64_t>("sliding_window")
        .Attr<float>("soft_cap")
        .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveRaggedPagedAttentionWriteF32, ImplWrite,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // q [T, N, H]
        .Arg<ffi::Buffer<ffi::F32>>()      // k_new [T, K, H]
        .Arg<ffi::Buffer<ffi::F32>>()      // v_new
        .Arg<ffi::Buffer<ffi::F32>>()      // k_cache [K, NB, bs, H] (aliased to result 1)
        .Arg<ffi::Buffer<ffi::F32>>()      // v_cache (aliased to result 2)
        .Arg<ffi::Buffer<ffi::S32>>()      // slot_mapping [T]
        .Arg<ffi::Buffer<ffi::S32>>()      // cu_q_lens [R + 1]
        .Arg<ffi::Buffer<ffi::S32>>()      // seq_lens [R]
        .Arg<ffi::Buffer<ffi::S32>>()      // block_tables [R, P]
        .Ret<ffi::Buffer<ffi::F32>>()      // out [T, N, H]
        .Ret<ffi::Buffer<ffi::F32>>()      // k_cache with k_new written
        .Ret<ffi::Buffer<ffi::F32>>()      // v_cache with v_new written
        .Attr<float>("scale")
        .Attr<int64_t>("sliding_window")
        .Attr<float>("soft_cap")
        .Attr<int64_t>("num_threads"));
