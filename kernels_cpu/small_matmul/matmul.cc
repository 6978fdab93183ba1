// Small-M matmul for XLA:CPU, called through the XLA FFI: the decode-step projections
// (M = 1..16 rows) streaming the weights once at memory bandwidth.
//
//   x [M, K] f32, w [K, N] f32 (the model's [in, out] layout)
//                 or [N, K] f32 (transposed: a tied embedding, rows contiguous)
//                 or [N / 32, K, 32] f32 (packed: 32-column panels, each [K, 32]
//                 contiguous; the layout the engine stores the layer weights in)
//   y [M, N] f32  = x @ w  (or x @ w.T)
//
// Why a kernel: at 1-8 rows a matmul reads each weight once and does 2 M flops with it,
// so its floor is the weight bytes over the memory bandwidth. XLA:CPU's dot fell well
// short of that at these row counts (docs/benchmarks.md, "CPU kernels"). Here every weight element is loaded once into a register and
// used for all rows of a row group (<= 8 rows, accumulators in registers), and the
// columns (output features) are split over XLA's intra-op thread pool.
//
// Layout [K, N]: a task owns a column range; per block of kKBlock rows of w, each tile of
// 16 * NV columns accumulates over the block's rows (the block's [kKBlock x tile] slice
// stays in L1, so a second row group re-reads it from there, not from memory).
// Layout [N, K]: a task owns a range of w's rows; VR rows at a time are dotted with every
// x row (vectors along K, one horizontal sum per output at the end).
// Packed [N / 32, K, 32]: a task owns a range of panels; a row group's pass over a panel
// reads one contiguous [K, 32] block front to back. In the [K, N] layout the same pass
// reads 128-256 bytes per row at a stride of N floats, which the hardware prefetchers
// follow badly: at 8 rows the packed layout streams about twice as fast
// (docs/benchmarks.md, "CPU kernels"). Any row count: past 8 rows the panel is re-read from L2 per row
// group, which keeps up with XLA's dot up to a 512-row prefill chunk.
//
// Threads and ISA as in ../ragged_paged_attention/kernel.cc: XLA's own pool via
// Ctx<ThreadPool> (the caller works too and never waits for a task to start); built for
// this CPU's x86-64 level, or (portable build) with target_clones for AVX-512 / AVX2+FMA
// / baseline (GCC's vector extensions lower to whatever the ISA offers).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"
#include "../cpu_kernels.h"
#include "../vec16.h"

// The register-tile helpers pass 64-byte vectors by value; they are always inlined, so
// the baseline clone's ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::kLanes;
using jaxserve_cpu::V16;
constexpr int kRowGroup = 8;      // rows of x whose accumulators live in registers
constexpr int64_t kKBlock = 128;  // rows of w per pass over a column tile ([K, N] layout)
// Below this many weight bytes per thread a pool task costs more than it saves (a
// wake-up is ~5-20 us; 256 KB stream in ~10 us).
constexpr int64_t kBytesPerThread = 256 << 10;

JAXSERVE_INLINE V16 Load(const float* p) { return jaxserve_cpu::VLoad(p); }
JAXSERVE_INLINE void Store(float* p, V16 v) { jaxserve_cpu::VStore(p, v); }

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N;
};

// [K, N] layout: y[rows, n0 : n0 + 16 NV] (+)= x[rows, k0:k1] @ w[k0:k1, tile]
// (MR rows from row m0; first = true on the first k block: start from zero).
template <int MR, int NV>
JAXSERVE_INLINE void TileNN(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1,
                            bool first) {
  V16 acc[MR][NV];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < NV; ++j)
      acc[m][j] = first ? V16{} : Load(p.y + (m0 + m) * p.N + n0 + j * kLanes);
  const float* xr = p.x + m0 * p.K;
  for (int64_t k = k0; k < k1; ++k) {
    const float* wr = p.w + k * p.N + n0;
    V16 wv[NV];
    JAXSERVE_UNROLL
    for (int j = 0; j < NV; ++j) wv[j] = Load(wr + j * kLanes);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float xs = xr[m * p.K + k];     // vector * scalar: one broadcast
      JAXSERVE_UNROLL
      for (int j = 0; j < NV; ++j) acc[m][j] += xs * wv[j];
    }
  }
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int j = 0; j < NV; ++j) Store(p.y + (m0 + m) * p.N + n0 + j * kLanes, acc[m][j]);
}

// Columns [n0, n1) that are not a whole vector (N % 16): plain loops.
JAXSERVE_INLINE void TailNN(const Problem& p, int64_t m0, int64_t mr, int64_t n0, int64_t n1,
                            int64_t k0, int64_t k1, bool first) {
  for (int64_t m = m0; m < m0 + mr; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float s = first ? 0.0f : p.y[m * p.N + n];
      for (int64_t k = k0; k < k1; ++k) s += p.x[m * p.K + k] * p.w[k * p.N + n];
      p.y[m * p.N + n] = s;
    }
}

// Widest tile whose MR x NV accumulators + NV weight vectors fit 32 registers.
template <int MR>
constexpr int WidthNN() { return MR <= 6 ? 4 : 3; }

template <int MR>
JAXSERVE_INLINE void ColumnsNN(const Problem& p, int64_t m0, int64_t n0, int64_t n1,
                               int64_t k0, int64_t k1) {
  constexpr int NV = WidthNN<MR>();
  const bool first = k0 == 0;
  int64_t n = n0;
  for (; n + NV * kLanes <= n1; n += NV * kLanes) TileNN<MR, NV>(p, m0, n, k0, k1, first);
  for (; n + kLanes <= n1; n += kLanes) TileNN<MR, 1>(p, m0, n, k0, k1, first);
  if (n < n1) TailNN(p, m0, MR, n, n1, k0, k1, first);
}

// One task of the [K, N] layout: all rows of x, columns [n0, n1).
JAXSERVE_HOT void RangeNN(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < p.K; k0 += kKBlock) {
    const int64_t k1 = std::min(p.K, k0 + kKBlock);
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, p.M - m0)) {
        case 1: ColumnsNN<1>(p, m0, n0, n1, k0, k1); break;
        case 2: ColumnsNN<2>(p, m0, n0, n1, k0, k1); break;
        case 3: ColumnsNN<3>(p, m0, n0, n1, k0, k1); break;
        case 4: ColumnsNN<4>(p, m0, n0, n1, k0, k1); break;
        case 5: ColumnsNN<5>(p, m0, n0, n1, k0, k1); break;
        case 6: ColumnsNN<6>(p, m0, n0, n1, k0, k1); break;
        case 7: ColumnsNN<7>(p, m0, n0, n1, k0, k1); break;
        default: ColumnsNN<8>(p, m0, n0, n1, k0, k1); break;
      }
    }
  }
}

// [N, K] layout: y[rows, v0 : v0 + VR] = x[rows] . w[v0 + r] for VR rows of w.
template <int MR, int VR>
JAXSERVE_INLINE void TileNT(const Problem& p, int64_t m0, int64_t v0) {
  V16 acc[MR][VR] = {};
  const int64_t kv = p.K / kLanes * kLanes;
  const float* xr = p.x + m0 * p.K;
  const float* wr = p.w + v0 * p.K;
  for (int64_t k = 0; k < kv; k += kLanes) {
    V16 wv[VR];
    JAXSERVE_UNROLL
    for (int r = 0; r < VR; ++r) wv[r] = Load(wr + r * p.K + k);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const V16 xv = Load(xr + m * p.K + k);
      JAXSERVE_UNROLL
      for (int r = 0; r < VR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    JAXSERVE_UNROLL
    for (int r = 0; r < VR; ++r) {
      float s = jaxserve_cpu::SumLanes(acc[m][r]);
      for (int64_t k = kv; k < p.K; ++k) s += xr[m * p.K + k] * wr[r * p.K + k];
      p.y[(m0 + m) * p.N + v0 + r] = s;
    }
}

template <int MR>
constexpr int RowsNT() { return MR <= 4 ? 4 : 3; }

template <int MR>
JAXSERVE_INLINE void RowsOfW(const Problem& p, int64_t m0, int64_t v0, int64_t v1) {
  constexpr int VR = RowsNT<MR>();
  int64_t v = v0;
  for (; v + VR <= v1; v += VR) TileNT<MR, VR>(p, m0, v);
  for (; v < v1; ++v) TileNT<MR, 1>(p, m0, v);
}

// One task of the [N, K] layout: all rows of x against rows [v0, v1) of w, a few rows
// of w at a time (they stay in L1 while a second row group of x passes over them).
JAXSERVE_HOT void RangeNT(const Problem& p, int64_t v0, int64_t v1) {
  constexpr int64_t kStep = 12;    // rows of w per pass: 48 KB at K = 1024
  for (int64_t a = v0; a < v1; a += kStep) {
    const int64_t b = std::min(v1, a + kStep);
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, p.M - m0)) {
        case 1: RowsOfW<1>(p, m0, a, b); break;
        case 2: RowsOfW<2>(p, m0, a, b); break;
        case 3: RowsOfW<3>(p, m0, a, b); break;
        case 4: RowsOfW<4>(p, m0, a, b); break;
        case 5: RowsOfW<5>(p, m0, a, b); break;
        case 6: RowsOfW<6>(p, m0, a, b); break;
        case 7: RowsOfW<7>(p, m0, a, b); break;
        default: RowsOfW<8>(p, m0, a, b); break;
      }
    }
  }
}


// ---- Packed panels -------------------------------------------------------------------
constexpr int64_t kPanel = 2 * kLanes;      // columns per panel
// Prefetch distance and target: 64 rows of a panel (8 KB) ahead, into L2 (hint T1). At one
// row a 4 KB distance into L1 is consumed faster than memory answers (~100 ns), and L1's
// few fill buffers cap the misses in flight (docs/benchmarks.md, "Measurements behind code choices").
constexpr int64_t kPrefetch = 64 * kPanel;  // floats ahead
constexpr int kPrefetchLocality = 2;        // __builtin_prefetch's 2 = T1 (to L2)

// y[m0 : m0 + MR, panel's 32 columns] = x[m0 : m0 + MR] @ panel (one pass, all of K).
template <int MR>
JAXSERVE_INLINE void TilePacked(const Problem& p, int64_t m0, int64_t panel) {
  V16 acc[MR][2];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = V16{};
  const float* wp = p.w + panel * p.K * kPanel;
  const float* xr = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k) {
    const float* wr = wp + k * kPanel;
    // both 64-byte lines of the row (faster at 8 rows than one line)
    __builtin_prefetch(wr + kPrefetch, 0, kPrefetchLocality);
    __builtin_prefetch(wr + kPrefetch + kLanes, 0, kPrefetchLocality);
    const V16 w0 = Load(wr), w1 = Load(wr + kLanes);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float xs = xr[m * p.K + k];
      acc[m][0] += xs * w0;
      acc[m][1] += xs * w1;
    }
  }
  float* y = p.y + m0 * p.N + panel * kPanel;
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    Store(y + m * p.N, acc[m][0]);
    Store(y + m * p.N + kLanes, acc[m][1]);
  }
}

#if !defined(__AVX512F__)
// Without AVX-512 a 16-float vector is two of the 16 ymm registers, and TilePacked's 8
// rows x 32 columns would need 32 for its accumulators alone (the rest spill to the
// stack). Past one row group (prefill) each panel is taken half by half instead, 6 rows
// x 16 columns at a time: 12 accumulators, 2 for the weights, 1 for x (the usual AVX2
// matmul register tile). The half panel stays in L2 across the row groups.
constexpr int kHalfRows = 6;

template <int MR>
JAXSERVE_INLINE void TileHalf(const Problem& p, int64_t m0, int64_t panel, int half) {
  V16 acc[MR];
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) acc[m] = V16{};
  const float* wp = p.w + panel * p.K * kPanel + half * kLanes;
  const float* xr = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k) {
    const V16 w = Load(wp + k * kPanel);
    JAXSERVE_UNROLL
    for (int m = 0; m < MR; ++m) acc[m] += xr[m * p.K + k] * w;
  }
  float* y = p.y + m0 * p.N + panel * kPanel + half * kLanes;
  JAXSERVE_UNROLL
  for (int m = 0; m < MR; ++m) Store(y + m * p.N, acc[m]);
}
#endif

// One task of the packed layout: all rows of x, columns [n0, n1) (whole panels).
JAXSERVE_HOT void RangePacked(const Problem& p, int64_t n0, int64_t n1) {
#if !defined(__AVX512F__)
  if (p.M > kRowGroup) {
    for (int64_t panel = n0 / kPanel; panel < n1 / kPanel; ++panel)
      for (int half = 0; half < 2; ++half)
        for (int64_t m0 = 0; m0 < p.M; m0 += kHalfRows) {
          switch (std::min<int64_t>(kHalfRows, p.M - m0)) {
            case 1: TileHalf<1>(p, m0, panel, half); break;
            case 2: TileHalf<2>(p, m0, panel, half); break;
            case 3: TileHalf<3>(p, m0, panel, half); break;
            case 4: TileHalf<4>(p, m0, panel, half); break;
            case 5: TileHalf<5>(p, m0, panel, half); break;
            default: TileHalf<6>(p, m0, panel, half); break;
          }
        }
    return;
  }
#endif
  for (int64_t panel = n0 / kPanel; panel < n1 / kPanel; ++panel)
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowGroup) {
      switch (std::min<int64_t>(kRowGroup, p.M - m0)) {
        case 1: TilePacked<1>(p, m0, panel); break;
        case 2: TilePacked<2>(p, m0, panel); break;
        case 3: TilePacked<3>(p, m0, panel); break;
        case 4: TilePacked<4>(p, m0, panel); break;
        case 5: TilePacked<5>(p, m0, panel); break;
        case 6: TilePacked<6>(p, m0, panel); break;
        case 7: TilePacked<7>(p, m0, panel); break;
        default: TilePacked<8>(p, m0, panel); break;
      }
    }
}

}  // namespace

// The packed pass for another kernel of this library (cpu_kernels.h).
void jaxserve_cpu::MatmulPackedPanels(const float* x, const float* w, float* y, int64_t M,
                                      int64_t K, int64_t N, int64_t p0, int64_t p1) {
  RangePacked(Problem{x, w, y, M, K, N}, p0 * kPanel, p1 * kPanel);
}

namespace {

// One call's chunks, shared by the caller and the pool tasks; reference counted because
// a task may start after the call returned (it then finds no chunk left). A call holds
// up to kMaxProblems matmuls of the same x (q, k, v; gate, up): one pool round for all.
constexpr int kMaxProblems = 4;
enum class Layout { kKN, kNK, kPacked };

struct Shared {
  Problem p[kMaxProblems];
  int num_problems = 0;
  Layout layout = Layout::kKN;
  int64_t chunk[kMaxProblems] = {};
  int64_t first_chunk[kMaxProblems + 1] = {};   // problem i owns [first_chunk[i], [i + 1])
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

void Drain(Shared& s) {
  for (int64_t c = s.next.fetch_add(1); c < s.num_chunks; c = s.next.fetch_add(1)) {
    int i = 0;
    while (c >= s.first_chunk[i + 1]) ++i;
    const Problem& p = s.p[i];
    const int64_t a = (c - s.first_chunk[i]) * s.chunk[i], b = std::min(p.N, a + s.chunk[i]);
    switch (s.layout) {
      case Layout::kNK: RangeNT(p, a, b); break;
      case Layout::kPacked: RangePacked(p, a, b); break;
      default: RangeNN(p, a, b); break;
    }
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == s.num_chunks) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_all();
    }
  }
}

// Chunks: a few per thread for each matmul (a busy core's share is picked up by the
// others), whole tiles wide (64 columns / 12 rows of w).
void Run(const std::shared_ptr<Shared>& s, ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t bytes = 0;     // weight bytes, once per row group of x (a prefill re-reads them)
  for (int i = 0; i < s->num_problems; ++i)
    bytes += s->p[i].K * s->p[i].N * 4 * ((s->p[i].M + kRowGroup - 1) / kRowGroup);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::max<int64_t>(1, std::min(threads, bytes / kBytesPerThread));
  const int64_t unit = s->layout == Layout::kNK       ? 12
                       : s->layout == Layout::kPacked ? kPanel
                                                      : 4 * kLanes;
  const int64_t pieces = threads == 1 ? 1 : 4 * threads;
  s->num_chunks = 0;
  for (int i = 0; i < s->num_problems; ++i) {
    const int64_t n = s->p[i].N;
    s->chunk[i] = std::max<int64_t>(unit, (n + pieces * unit - 1) / (pieces * unit) * unit);
    s->first_chunk[i] = s->num_chunks;
    s->num_chunks += (n + s->chunk[i] - 1) / s->chunk[i];
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

// Checks shapes and fills problem i (K from x); false on a mismatch.
bool SetProblem(Shared& s, int i, const float* x, int64_t M, int64_t K,
                ffi::Buffer<ffi::F32>& w, ffi::Result<ffi::Buffer<ffi::F32>>& y) {
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  Problem& p = s.p[i];
  p.M = M; p.K = K;
  if (s.layout == Layout::kPacked) {
    if (wd.size() != 3 || wd[1] != K || wd[2] != kPanel) return false;
    p.N = wd[0] * kPanel;
  } else {
    if (wd.size() != 2) return false;
    const bool nk = s.layout == Layout::kNK;
    p.N = nk ? wd[0] : wd[1];
    if ((nk ? wd[1] : wd[0]) != K) return false;
  }
  if (yd.size() != 2 || yd[0] != M || yd[1] != p.N) return false;
  p.x = x; p.w = w.typed_data(); p.y = y->typed_data();
  return true;
}

// Runs the filled problems; K == 0 or empty outputs need no pool round.
ffi::Error Compute(const std::shared_ptr<Shared>& s, ffi::ThreadPool& pool,
                   int64_t num_threads) {
  int kept = 0;
  for (int i = 0; i < s->num_problems; ++i) {
    Problem& p = s->p[i];
    if (p.M == 0 || p.N == 0) continue;
    if (p.K == 0) {
      std::memset(p.y, 0, sizeof(float) * p.M * p.N);
      continue;
    }
    s->p[kept++] = p;
  }
  s->num_problems = kept;
  if (kept > 0) Run(s, pool, num_threads);
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::ResultBuffer<ffi::F32> y, bool transposed, int64_t num_threads) {
  auto xd = x.dimensions();
  if (xd.size() != 2)
    return ffi::Error::InvalidArgument("small_matmul: x, w and y must be 2-D");
  auto s = std::make_shared<Shared>();
  s->layout = transposed ? Layout::kNK : Layout::kKN;
  s->num_problems = 1;
  if (!SetProblem(*s, 0, x.typed_data(), xd[0], xd[1], w, y))
    return ffi::Error::InvalidArgument("small_matmul: inconsistent shapes");
  return Compute(s, pool, num_threads);
}

// y_i = x @ w_i for 1..kMaxProblems weights of the [K, N] (or packed) layout, in one
// pool round.
ffi::Error ImplMany(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                    ffi::RemainingRets ys, bool packed, int64_t num_threads) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() != ys.size() || ws.size() < 1 ||
      ws.size() > static_cast<size_t>(kMaxProblems))
    return ffi::Error::InvalidArgument("small_matmul_many: 2-D x, 1-4 weights and outputs");
  auto s = std::make_shared<Shared>();
  s->layout = packed ? Layout::kPacked : Layout::kKN;
  s->num_problems = static_cast<int>(ws.size());
  for (int i = 0; i < s->num_problems; ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error() || y.has_error())
      return ffi::Error::InvalidArgument("small_matmul_many: float32 weights and outputs");
    if (!SetProblem(*s, i, x.typed_data(), xd[0], xd[1], *w, *y))
      return ffi::Error::InvalidArgument("small_matmul_many: inconsistent shapes");
  }
  return Compute(s, pool, num_threads);
}

// ---- Packing: w [K, N] -> [N / 32, K, 32], or a tied embedding e [N, K] likewise ------
// (panel p, row k holds w[k, 32 p : 32 p + 32], i.e. e[32 p : 32 p + 32, k]). Run once
// at engine start; a plain copy split over the pool (XLA's transpose took ~0.5 s for the
// default model's 540 MB, this ~0.1 s).
struct PackJob {
  const float* src = nullptr;
  float* dst = nullptr;
  int64_t K = 0, N = 0;
  bool from_rows = false;           // src is [N, K] (e), not [K, N]
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void PackPanels(PackJob& j) {
  const int64_t panels = j.N / kPanel;
  constexpr int64_t kPanelsPerTask = 8;
  const int64_t tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  for (int64_t t = j.next.fetch_add(1); t < tasks; t = j.next.fetch_add(1)) {
    const int64_t p1 = std::min(panels, (t + 1) * kPanelsPerTask);
    for (int64_t p = t * kPanelsPerTask; p < p1; ++p) {
      float* out = j.dst + p * j.K * kPanel;
      if (j.from_rows) {
        for (int64_t c = 0; c < kPanel; ++c) {
          const float* row = j.src + (p * kPanel + c) * j.K;
          for (int64_t k = 0; k < j.K; ++k) out[k * kPanel + c] = row[k];
        }
      } else {
        for (int64_t k = 0; k < j.K; ++k)
          std::memcpy(out + k * kPanel, j.src + k * j.N + p * kPanel, sizeof(float) * kPanel);
      }
    }
    j.done.fetch_add(1, std::memory_order_acq_rel);
  }
}

ffi::Error ImplPack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> out, bool from_rows) {
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (wd.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("small_matmul_pack: 2-D w, 3-D packed output");
  const int64_t K = from_rows ? wd[1] : wd[0], N = from_rows ? wd[0] : wd[1];
  if (N % kPanel != 0 || od[0] != N / kPanel || od[1] != K || od[2] != kPanel)
    return ffi::Error::InvalidArgument("small_matmul_pack: inconsistent shapes");
  auto j = std::make_shared<PackJob>();
  j->src = w.typed_data(); j->dst = out->typed_data();
  j->K = K; j->N = N; j->from_rows = from_rows;
  const int64_t tasks = (N / kPanel + 7) / 8;
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), tasks);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([j] { PackPanels(*j); });
  PackPanels(*j);
  while (j->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveSmallMatmulF32, Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<bool>("transposed")         // w is [N, K] (rows contiguous): y = x @ w.T
        .Attr<int64_t>("num_threads"));   // at most this many threads; 0: XLA's pool size

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveSmallMatmulManyF32, ImplMany,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // x [M, K]
        .RemainingArgs()                   // w_i [K, N_i] or packed [N_i / 32, K, 32], 1..4
        .RemainingRets()                   // y_i [M, N_i]
        .Attr<bool>("packed")
        .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveSmallMatmulPackF32, ImplPack,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // w [K, N] (from_rows: e [N, K])
        .Ret<ffi::Buffer<ffi::F32>>()      // [N / 32, K, 32]
        .Attr<bool>("from_rows"));
