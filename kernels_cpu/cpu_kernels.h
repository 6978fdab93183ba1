// What the sources of the CPU kernels' library share: the hot-loop clone macro, and the
// pieces one kernel calls in another directly
// (decode_stack/stack.cc runs a whole decoder stack in one FFI call and reuses the
// attention work item of ragged_paged_attention/kernel.cc and the packed-panel matmul of
// small_matmul/matmul.cc). Each piece is compiled in its own source, with that source's
// ISA flags and inlining; a call per work unit (a panel, a query tile) costs nothing next
// to the unit.
#pragma once
#include <cstdint>

// The hot loops of every source: in the portable build (build.py) one clone per ISA
// (AVX-512, AVX2+FMA, baseline), picked by the dynamic loader; in the build for this
// CPU's x86-64 level (JAXSERVE_NO_TARGET_CLONES) compiled once. ifunc-based clones need
// GCC or Clang >= 14 on an ELF x86-64 target; elsewhere (aarch64, whose baseline already
// has NEON) the loops are compiled once for the baseline.
#if defined(__x86_64__) && defined(__ELF__) && !defined(JAXSERVE_NO_TARGET_CLONES)
#define JAXSERVE_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAXSERVE_HOT
#endif

namespace jaxserve_cpu {

// y[0:M, 32 p : 32 p + 32] = x[0:M, 0:K] @ panel p of w, for panels [p0, p1): w packed
// [N / 32, K, 32] (small_matmul/kernel.py: pack), x [M, K] and y [M, N] row-major.
void MatmulPackedPanels(const float* x, const float* w, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t p0, int64_t p1);

// A quantized weight packed in panels (small_matmul/quant.py: pack_quant): values of
// `bits` (8: int8 [N / 32, K, 32]; 4: uint8 [N / 32, K / 2, 32], rows 2j and 2j + 1 in
// byte j's low and high nibble), a scale per column and block of `block` rows
// ([N / 32, K / block, 32], float16 raw bits if half else float32) and an optional
// offset of the same shape: w = scale * q + offset.
struct QPanels {
  const void* q = nullptr;
  const void* scale = nullptr;
  const void* offset = nullptr;    // nullptr: none
  int bits = 8;
  bool half = false;
  int64_t block = 0;
};
// The combinations MatmulQuantPanels computes: 8 bits without an offset, 4 bits with one.
bool QuantFormatSupported(const QPanels& w);
// x quantized for the integer dot products of 4-bit panels (opt-in: small_matmul/quant.cc,
// "int8 activations"): per row and block of 32 values of K, int8 values q, their scale
// (x ~ scale * q) and the block's float32 sum. Buffers of QuantizedActsSize(M, K).
struct QActs {
  const int8_t* q = nullptr;       // [M, K]
  const float* scale = nullptr;    // [M, K / 32]
  const float* sum = nullptr;      // [M, K / 32]
  // for 8-bit panels, x in 16 bits (x ~ h_scale * h per block of 32; null: not made)
  const int16_t* h = nullptr;      // [M, K]
  const float* h_scale = nullptr;  // [M, K / 32]
  const uint8_t* u = nullptr;      // [M, K] q + 128 (8-bit panels with x in 8 bits)
};
// Whether this build has the integer path and it takes w at M rows (4-bit values, blocks
// of 32 rows, M <= 8; or, on a CPU with AVX512-VNNI, 8-bit values past 8 rows; K a
// multiple of 32); else the float path runs, acts or not.
bool IntDotSupported(const QPanels& w, int64_t M, int64_t K);
// Quantizes x [M, K] (K % 32 == 0) into q [M * K] and scale, sum [M * K / 32]; with u,
// also q + 128 as unsigned bytes [M * K].
void QuantizeActs(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, float* sum,
                  uint8_t* u = nullptr);
// The same in 16 bits (scale = max |x| / 32767 per block), without the sums.
void QuantizeActs16(const float* x, int64_t M, int64_t K, int16_t* h, float* scale);
// MatmulPackedPanels for a quantized weight (small_matmul/quant.cc); with acts (x
// quantized by QuantizeActs) where IntDotSupported, the integer dot products.
void MatmulQuantPanels(const float* x, const QPanels& w, float* y, int64_t M, int64_t K,
                       int64_t N, int64_t p0, int64_t p1, const QActs* acts = nullptr);

// Float32 paged attention for one work item, as ragged_paged_attention's: row `row`, kv
// head `head`, the row's query tokens [first, first + count) (count <= 16). The caches
// already hold the step's keys; out must be zero where no row writes (padding tokens).
struct AttentionArgs {
  const float* q;          // [T, N, H], unscaled
  const float* k;          // [K, NB, bs, H]
  const float* v;
  const int32_t* cu;       // [R + 1]
  const int32_t* lens;     // [R]
  const int32_t* tables;   // [R, P]
  float* out;              // [T, N, H]
  int64_t T, N, H, K, NB, bs, R, P;
  float scale;
};
// false: a block id out of range (the item stops; the caller reports the error).
bool AttendF32(const AttentionArgs& a, int32_t row, int32_t head, int32_t first,
               int32_t count);

}  // namespace jaxserve_cpu
