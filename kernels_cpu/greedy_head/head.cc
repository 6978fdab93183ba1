// The greedy token of each row of a decode step's head, reading half the head's bytes:
// the argmax of the float32 logits x @ w.T, found with a float16 copy of w and a bound.
//
//   x [M, D] f32 (the final-normed hidden rows), w16 [V / 32, D, 32] f16 (the head packed
//   as w, rounded to float16), bound [V] f32 (per vocabulary entry v, see below),
//   w [V / 32, D, 32] f32 (the packed head the full path reads: small_matmul's panels)
//   -> ids [M] s32: per row, the first index of the largest float32 logit, exactly the
//      token jnp.argmax picks from the logits the packed matmul (MatmulPackedPanels)
//      computes for that row.
//
// Why: at batch 1 a decode step streams every weight once, so its time is its bytes over
// the memory bandwidth; the tied head of the default model is 113 MB of the 538 MB a
// token reads. A greedy row only needs the argmax, and the argmax is decided by a few
// entries: here the pass over the vocabulary reads float16 (57 MB) and only the panels
// that can hold the maximum are recomputed in float32.
//
// Why the result is exact. For entry v of row m let a be the computed float16-weight
// logit and f the computed float32 logit (what the full path returns). Both are sums of
// D products in float32; whatever the summation order, each differs from its real dot
// product by at most gamma_D * sum |x_i w_i| with gamma_D = D u / (1 - D u), u = 2^-24,
// and the real dot products differ by |x . (w_v - w16_v)| <= |x| |w_v - w16_v|
// (Cauchy-Schwarz). So |f - a| <= |x| * bound_v, with
//   bound_v >= |w_v - w16_v| + gamma_D (|w_v| + |w16_v|)     (kernel.py computes it,
//                                                               rounded up)
// and each f lies in [a - B, a + B], B = |x| bound_v (inflated here for the float
// rounding of B and of a +- B). Let L be the largest a - B over the vocabulary: the entry
// that reaches it has f >= L, so no entry with a + B < L can be the maximum (nor tie it).
// The others are the candidates: their whole panels are recomputed with the float32
// weights by the same routine the full path uses (bit-identical logits), and the first
// index of their largest f wins; a NaN (the first) wins as in jnp.argmax. A non-finite
// |x| makes every entry a candidate (the full float32 pass, serially).
//
// Threads: XLA's pool via Ctx<ThreadPool>, as the other kernels: the float16 pass is cut
// into chunks of panels, claimed by the caller and the pool's tasks; the caller then
// picks the candidates and recomputes them (a few panels a row: ~74 KB each at D = 576).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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

using jaxserve_cpu::V16;
constexpr int64_t kLanes = 16;
constexpr int64_t kPanel = 2 * kLanes;   // columns per packed panel (small_matmul)
constexpr int kRowGroup = 8;             // rows whose accumulators live in registers
constexpr int64_t kMaxRows = 256;
// 128 rows of a float16 panel ahead (8 KB, as the float32 kernel's distance in bytes)
constexpr int64_t kPrefetch = 128 * kPanel;
// Inflation of B for the float rounding of |x|, of |x| * bound_v and of a +- B.
constexpr float kSlack = 1.0f + 1.0f / 1024;

JAXSERVE_INLINE V16 Load(const float* p) { return jaxserve_cpu::VLoad(p); }
JAXSERVE_INLINE void Store(float* p, V16 v) { jaxserve_cpu::VStore(p, v); }

// One IEEE float16 (its bits) as a float, exactly (subnormals, inf and NaN included):
// the conversion where the build's ISA has no F16C (the portable build, other
// architectures). No _Float16: GCC 11 (Ubuntu 22.04's) has none on x86-64.
JAXSERVE_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {                          // zero or subnormal: man * 2^-24
    const float f = float(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {                  // inf, NaN
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 float16 values from p as floats. With F16C / AVX-512 one instruction per 8 / 16
// values (the native builds of build.py); GCC 12 converted a _Float16 vector element by
// element, several times slower (measured).
JAXSERVE_INLINE V16 LoadHalves(const uint16_t* p) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  V16 r;
  std::memcpy(&r, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(lo), &hi, sizeof(hi));
  return r;
#else
  float r[kLanes];
  for (int i = 0; i < kLanes; ++i) r[i] = HalfToFloat(p[i]);
  return Load(r);
#endif
}

struct Job {
  const float* x;
  const uint16_t* w16;
  const float* bound;
  int64_t M, D, V;
  std::vector<float> norm;     // |x_m| (inflated), per row
  std::vector<float> upper;    // a + B per [row, entry]
  std::vector<float> lower;    // per [chunk, row]: the chunk's largest a - B
  int64_t panels_per_chunk = 1, num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// Rows [m0, m0 + MR) x one panel: the float16-weight logits, their upper bounds stored,
// the largest lower bound per row folded into low[].
template <int MR>
JAXSERVE_INLINE void ScreenTile(Job& j, int64_t m0, int64_t panel, float* low) {
  V16 acc[MR][2];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = V16{};
  const uint16_t* wp = j.w16 + panel * j.D * kPanel;
  const float* xr = j.x + m0 * j.D;
  for (int64_t k = 0; k < j.D; ++k) {
    const uint16_t* wr = wp + k * kPanel;
    __builtin_prefetch(wr + kPrefetch, 0, 2);       // one 64-byte line per panel row
    const V16 w0 = LoadHalves(wr), w1 = LoadHalves(wr + kLanes);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float xs = xr[m * j.D + k];
      acc[m][0] += xs * w0;
      acc[m][1] += xs * w1;
    }
  }
  // the bounds, 16 entries at a time: B = |x| bound_v (inflated) + |a| 2^-20 (the
  // rounding of a +- B); a NaN a (or B) is always a candidate and never raises the
  // lower bound (its comparisons are false)
  const float* bound = j.bound + panel * kPanel;
  const V16 inf = V16{} + std::numeric_limits<float>::infinity();
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    const float n = j.norm[m0 + m] * kSlack;
    float* up = j.upper.data() + (m0 + m) * j.V + panel * kPanel;
    V16 lo = V16{} - std::numeric_limits<float>::infinity();
    for (int h = 0; h < 2; ++h) {
      const V16 a = acc[m][h];
      const V16 abs_a = jaxserve_cpu::VAbs(a);
      const V16 b = n * Load(bound + h * kLanes) + abs_a * (1.0f / (1 << 20));
      const V16 u = a + b, l = a - b;
      Store(up + h * kLanes, jaxserve_cpu::VSelect(u == u, u, inf));
      lo = jaxserve_cpu::VMax(l, lo);
    }
    float best = low[m0 + m];
    for (int c = 0; c < kLanes; ++c) {
      const float v = jaxserve_cpu::VLane(lo, c);
      best = v > best ? v : best;
    }
    low[m0 + m] = best;
  }
}

JAXSERVE_HOT void ScreenChunk(Job& j, int64_t chunk) {
  float* low = j.lower.data() + chunk * j.M;
  const int64_t p0 = chunk * j.panels_per_chunk;
  const int64_t p1 = std::min(j.V / kPanel, p0 + j.panels_per_chunk);
  for (int64_t panel = p0; panel < p1; ++panel)
    for (int64_t m0 = 0; m0 < j.M; m0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, j.M - m0)) {
        case 1: ScreenTile<1>(j, m0, panel, low); break;
        case 2: ScreenTile<2>(j, m0, panel, low); break;
        case 3: ScreenTile<3>(j, m0, panel, low); break;
        case 4: ScreenTile<4>(j, m0, panel, low); break;
        case 5: ScreenTile<5>(j, m0, panel, low); break;
        case 6: ScreenTile<6>(j, m0, panel, low); break;
        case 7: ScreenTile<7>(j, m0, panel, low); break;
        default: ScreenTile<8>(j, m0, panel, low); break;
      }
    }
}

void Drain(Job& j) {
  for (int64_t c = j.next.fetch_add(1); c < j.num_chunks; c = j.next.fetch_add(1)) {
    ScreenChunk(j, c);
    if (j.done.fetch_add(1, std::memory_order_acq_rel) + 1 == j.num_chunks) {
      std::lock_guard<std::mutex> lock(j.mu);
      j.cv.notify_all();
    }
  }
}

// Row m's token: the candidates' panels recomputed in float32, the first largest wins.
int32_t Pick(const Job& j, const float* w, int64_t m, float* logits) {
  const float* x = j.x + m * j.D;
  float low = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < j.num_chunks; ++c) low = std::max(low, j.lower[c * j.M + m]);
  const bool all = !std::isfinite(j.norm[m]);
  const float* up = j.upper.data() + m * j.V;
  int64_t best = -1;
  float best_value = 0.0f;
  bool best_nan = false;
  for (int64_t panel = 0; panel < j.V / kPanel && !best_nan; ++panel) {
    bool candidate = all;
    for (int64_t c = 0; c < kPanel && !candidate; ++c) candidate = up[panel * kPanel + c] >= low;
    if (!candidate) continue;
    jaxserve_cpu::MatmulPackedPanels(x, w, logits, 1, j.D, j.V, panel, panel + 1);
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t v = panel * kPanel + c;
      const float f = logits[v];
      if (std::isnan(f)) {
        best = v;
        best_nan = true;
        break;
      } else if (best < 0 || f > best_value) {
        best = v;
        best_value = f;
      }
    }
  }
  return int32_t(std::max<int64_t>(best, 0));
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F16> w16,
                ffi::Buffer<ffi::F32> bound, ffi::Buffer<ffi::F32> w,
                ffi::ResultBuffer<ffi::S32> ids, int64_t num_threads) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("greedy_head: " + what);
  };
  auto xd = x.dimensions(), hd = w16.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || hd.size() != 3 || wd.size() != 3 || hd[2] != kPanel ||
      wd[0] != hd[0] || wd[1] != hd[1] || wd[2] != hd[2] || hd[1] != xd[1] ||
      int64_t(bound.element_count()) != hd[0] * kPanel ||
      int64_t(ids->element_count()) != xd[0] || xd[0] > kMaxRows)
    return bad("x [M <= 256, D], w16 / w [V / 32, D, 32], bound [V], ids [M]");
  auto j = std::make_shared<Job>();
  j->x = x.typed_data();
  j->w16 = reinterpret_cast<const uint16_t*>(w16.typed_data());
  j->bound = bound.typed_data();
  j->M = xd[0]; j->D = xd[1]; j->V = hd[0] * kPanel;
  if (j->M == 0) return ffi::Error::Success();
  j->norm.resize(j->M);
  for (int64_t m = 0; m < j->M; ++m) {
    double ss = 0.0;
    for (int64_t d = 0; d < j->D; ++d) ss += double(j->x[m * j->D + d]) * j->x[m * j->D + d];
    j->norm[m] = float(std::sqrt(ss)) * kSlack;
  }
  j->upper.resize(j->M * j->V);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (num_threads > 0) threads = std::min(threads, num_threads);
  const int64_t panels = j->V / kPanel;
  j->panels_per_chunk = std::max<int64_t>(1, panels / (8 * threads));
  j->num_chunks = (panels + j->panels_per_chunk - 1) / j->panels_per_chunk;
  j->lower.assign(j->num_chunks * j->M, -std::numeric_limits<float>::infinity());
  threads = std::min(threads, j->num_chunks);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([j] { Drain(*j); });
  Drain(*j);
  auto finished = [&] { return j->done.load(std::memory_order_acquire) == j->num_chunks; };
  for (int spin = 0; spin < 64 && !finished(); ++spin) std::this_thread::yield();
  if (!finished()) {
    std::unique_lock<std::mutex> lock(j->mu);
    j->cv.wait(lock, finished);
  }
  std::vector<float> logits(j->V);
  int32_t* out = ids->typed_data();
  for (int64_t m = 0; m < j->M; ++m) out[m] = Pick(*j, w.typed_data(), m, logits.data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveGreedyHeadF32, Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // x [M, D]
        .Arg<ffi::Buffer<ffi::F16>>()      // w16 [V / 32, D, 32]
        .Arg<ffi::Buffer<ffi::F32>>()      // bound [V]
        .Arg<ffi::Buffer<ffi::F32>>()      // w [V / 32, D, 32]
        .Ret<ffi::Buffer<ffi::S32>>()      // ids [M]
        .Attr<int64_t>("num_threads"));    // at most this many threads; 0: XLA's pool size
