// The 16-float vector every CPU kernel computes with, and the helpers its sources share.
//
// V16 (floats) and I16 (int32) hold 16 lanes. Where the build's ISA has 512-bit registers
// (AVX-512) they are GCC vector types, one zmm register each. Elsewhere they are a pair
// of 8-lane halves: GCC gives a 64-byte vector type no machine mode on AVX2, keeps every
// such variable in memory and moves it through general registers between operations,
// which made the kernels' register tiles 25x slower there (1.5 vs 38-65 GFLOP/s for the
// packed matmul tile on an AVX2 EPYC); two 8-lane halves are two ymm registers, and the
// same source runs at the speed of hand-written AVX2. The kernels write the operations
// once (+ - * / with vectors or floats, compound assignment, comparisons to I16 masks,
// VSelect, VToFloat / VToInt / VBits conversions, lane access) and both forms compile.
#pragma once
#include <cstdint>
#include <cstring>

// Forced inlining puts the template bodies inside each clone, so each gets its ISA.
#define JAXSERVE_INLINE inline __attribute__((always_inline))
// Tiles are fully unrolled so their accumulators are registers, not a stack array.
#define JAXSERVE_UNROLL _Pragma("GCC unroll 16")

namespace jaxserve_cpu {

constexpr int kLanes = 16;

#if defined(__AVX512F__)

// aligned(4): loads and stores through these types may be unaligned.
typedef float V16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(4)));

JAXSERVE_INLINE V16 VSelect(I16 mask, V16 a, V16 b) { return mask ? a : b; }
JAXSERVE_INLINE V16 VToFloat(I16 v) { return __builtin_convertvector(v, V16); }
JAXSERVE_INLINE I16 VToInt(V16 v) { return __builtin_convertvector(v, I16); }  // toward 0
JAXSERVE_INLINE V16 VBits(I16 v) { return reinterpret_cast<V16>(v); }
JAXSERVE_INLINE float VLane(V16 v, int i) { return v[i]; }
JAXSERVE_INLINE void VSetLane(I16& v, int i, int32_t x) { v[i] = x; }

#else

typedef float F8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t S8 __attribute__((vector_size(32), aligned(4)));

struct I16 {
  S8 lo, hi;
  JAXSERVE_INLINE I16& operator+=(I16 b) { lo += b.lo; hi += b.hi; return *this; }
};
struct V16 {
  F8 lo, hi;
  JAXSERVE_INLINE V16& operator+=(V16 b) { lo += b.lo; hi += b.hi; return *this; }
  JAXSERVE_INLINE V16& operator-=(V16 b) { lo -= b.lo; hi -= b.hi; return *this; }
  JAXSERVE_INLINE V16& operator*=(V16 b) { lo *= b.lo; hi *= b.hi; return *this; }
};

#define JAXSERVE_V16_OP(OP)                                                              \
  JAXSERVE_INLINE V16 operator OP(V16 a, V16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; } \
  JAXSERVE_INLINE V16 operator OP(V16 a, float b) { return {a.lo OP b, a.hi OP b}; }     \
  JAXSERVE_INLINE V16 operator OP(float a, V16 b) { return {a OP b.lo, a OP b.hi}; }
JAXSERVE_V16_OP(+)
JAXSERVE_V16_OP(-)
JAXSERVE_V16_OP(*)
JAXSERVE_V16_OP(/)
#undef JAXSERVE_V16_OP
JAXSERVE_INLINE V16 operator-(V16 a) { return {-a.lo, -a.hi}; }

#define JAXSERVE_V16_CMP(OP)                                                             \
  JAXSERVE_INLINE I16 operator OP(V16 a, V16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; } \
  JAXSERVE_INLINE I16 operator OP(V16 a, float b) { return {a.lo OP b, a.hi OP b}; }
JAXSERVE_V16_CMP(<)
JAXSERVE_V16_CMP(>)
JAXSERVE_V16_CMP(<=)
JAXSERVE_V16_CMP(>=)
JAXSERVE_V16_CMP(==)
#undef JAXSERVE_V16_CMP

#define JAXSERVE_I16_OP(OP)                                                              \
  JAXSERVE_INLINE I16 operator OP(I16 a, I16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; } \
  JAXSERVE_INLINE I16 operator OP(I16 a, int32_t b) { return {a.lo OP b, a.hi OP b}; }
JAXSERVE_I16_OP(+)
JAXSERVE_I16_OP(-)
JAXSERVE_I16_OP(&)
JAXSERVE_I16_OP(|)
JAXSERVE_I16_OP(<<)
JAXSERVE_I16_OP(>>)
JAXSERVE_I16_OP(<)
JAXSERVE_I16_OP(>=)
#undef JAXSERVE_I16_OP

JAXSERVE_INLINE V16 VSelect(I16 mask, V16 a, V16 b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}
JAXSERVE_INLINE V16 VToFloat(I16 v) {
  return {__builtin_convertvector(v.lo, F8), __builtin_convertvector(v.hi, F8)};
}
JAXSERVE_INLINE I16 VToInt(V16 v) {
  return {__builtin_convertvector(v.lo, S8), __builtin_convertvector(v.hi, S8)};
}
JAXSERVE_INLINE V16 VBits(I16 v) {
  return {reinterpret_cast<F8>(v.lo), reinterpret_cast<F8>(v.hi)};
}
JAXSERVE_INLINE float VLane(V16 v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
JAXSERVE_INLINE void VSetLane(I16& v, int i, int32_t x) {
  if (i < 8) v.lo[i] = x;
  else v.hi[i - 8] = x;
}

#endif

#if defined(__AVX512F__)
JAXSERVE_INLINE V16 VLoad(const float* p) { return *reinterpret_cast<const V16*>(p); }
JAXSERVE_INLINE void VStore(float* p, V16 v) { *reinterpret_cast<V16*>(p) = v; }
#else
// Half by half: a copy of the whole struct is done by GCC as four 16-byte moves through
// the stack, and each half then read back as 32 bytes waits on a failed store-to-load
// forward (the packed matmul tile ran at 4 instead of 20 GB/s on an AVX2 EPYC).
JAXSERVE_INLINE V16 VLoad(const float* p) {
  return {*reinterpret_cast<const F8*>(p), *reinterpret_cast<const F8*>(p + 8)};
}
JAXSERVE_INLINE void VStore(float* p, V16 v) {
  *reinterpret_cast<F8*>(p) = v.lo;
  *reinterpret_cast<F8*>(p + 8) = v.hi;
}
#endif
JAXSERVE_INLINE V16 VSplat(float x) { return V16{} + x; }
JAXSERVE_INLINE V16 VMax(V16 a, V16 b) { return VSelect(a > b, a, b); }
JAXSERVE_INLINE V16 VAbs(V16 a) { return VSelect(a < 0.0f, -a, a); }

JAXSERVE_INLINE float MaxLanes(V16 v) {
  float m = VLane(v, 0);
  for (int i = 1; i < kLanes; ++i) m = m > VLane(v, i) ? m : VLane(v, i);
  return m;
}

JAXSERVE_INLINE float SumLanes(V16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += VLane(v, i);
  return s;
}

}  // namespace jaxserve_cpu
