// A whole Llama-family decoder stack in one XLA FFI call, for the small token buckets of
// a CPU decode step (jaxserve/model/cpu/stack.py decides when).
//
//   x [T, D] f32 (the embedded tokens), cos / sin [T, H / 2] (RoPE of each token's
//   position), slot_mapping [T], cu_q_lens [R + 1], seq_lens [R], block_tables [R, P]
//   (s32; AttentionMetadata's), then per layer: attn_norm [D], wq, wk, wv, wo (packed
//   [N / 32, K, 32], small_matmul/kernel.py: pack), mlp_norm [D], w_gate, w_up, w_down
//   (packed), k_cache, v_cache [K, NB, bs, H] f32; with `quantized`, each projection is
//   three buffers instead, quantized panels (q, scale, offset: small_matmul/quant.py,
//   ../cpu_kernels.h QPanels), streamed by the same pass as the layerwise path's
//   -> x [T, D] after the last layer (before the final norm), and every layer's caches
//      with the step's keys and values written (aliased to the inputs)
//
// Per layer: RMSNorm, q/k/v, RoPE, the K/V write, paged attention, o + residual,
// RMSNorm, gate/up + SiLU x up, down + residual: the computation of decoder.py's
// decoder_layer, with the same pieces as the layerwise path (the packed-panel matmul,
// the attention work item: ../cpu_kernels.h).
//
// Why one call: at batch 1 a decode step streams the 540 MB of the default model's
// weights once, so it is bound by the memory bandwidth; in XLA's program each layer was
// 5 kernel calls and ~5 small elementwise thunks, each call a round on XLA's thread pool
// (a wake-up, a ramp of cold misses, a thread idle at its end) and each thunk split over
// the pool as well, all of it beyond the streaming time (docs/benchmarks.md, "CPU kernels").
// Here the threads stay in the call for all layers: a phase (one matmul, or the
// attention) is cut into units (a 32-column panel; an attention work item), each thread
// owns a contiguous segment of a phase's panels (so it streams memory in order and its
// prefetches run ahead into its own next panel) and steals from the other segments when
// its own is done; the thread that completes a phase's last unit does the small serial
// work after it (RoPE and the K/V write, an RMSNorm) and opens the next phase, while the
// others spin (then sleep, see Wait), prefetching the start of their segment of the next
// phase.
//
// Threads: XLA's pool via Ctx<ThreadPool>, as the other kernels. The caller works too and
// never waits for a helper to start: a helper that starts late takes what is left of the
// current phase (or finds the call finished and returns), so a pool whose threads are
// busy elsewhere only makes the call slower, never stuck.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "../cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;         // columns per packed panel (small_matmul)
constexpr int kMaxThreads = 16;
constexpr int kArgsPerLayer = 11;      // attn_norm, wq, wk, wv, wo, mlp_norm, gate, up, down, k, v
constexpr int kProjections = 7;        // wq, wk, wv, wo, gate, up, down
// quantized: each projection is three buffers (q, scale, offset: ../cpu_kernels.h QPanels)
constexpr int kArgsPerLayerQuant = kArgsPerLayer + 2 * kProjections;
constexpr int kQueryTile = 16;         // query tokens per attention work item

inline void Pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// A projection: float32 panels, or quantized ones (f32 == nullptr).
struct Weight {
  const float* f32 = nullptr;
  jaxserve_cpu::QPanels q;
};

// y[:, panels p0..p1) = x @ w (x [M, K], y [M, N]); acts: x quantized, or null.
void Matmul(const float* x, const Weight& w, float* y, int64_t M, int64_t K, int64_t N,
            int64_t p0, int64_t p1, const jaxserve_cpu::QActs* acts) {
  if (w.f32 != nullptr) jaxserve_cpu::MatmulPackedPanels(x, w.f32, y, M, K, N, p0, p1);
  else jaxserve_cpu::MatmulQuantPanels(x, w.q, y, M, K, N, p0, p1, acts);
}

// The first byte of panel u of w (a [K x 32] panel), for a prefetch.
const void* PanelStart(const Weight& w, int64_t u, int64_t K) {
  if (w.f32 != nullptr) return w.f32 + u * K * kPanel;
  return static_cast<const uint8_t*>(w.q.q) + u * K * kPanel * w.q.bits / 8;
}

struct Layer {
  const float* attn_norm;
  Weight wq, wk, wv, wo;
  const float* mlp_norm;
  Weight w_gate, w_up, w_down;
  float *k, *v;
};

enum class Kind { kQKV, kAttention, kO, kGateUp, kDown };

// A counter on its own cache line: threads claiming from their own segments do not
// contend for one line.
struct alignas(64) Cursor {
  std::atomic<int64_t> next;
};

struct Phase {
  Kind kind = Kind::kQKV;
  int layer = 0;
  int64_t units = 0;
  int segments = 1;
  int64_t seg_begin[kMaxThreads + 1] = {};
  Cursor cursor[kMaxThreads];
  alignas(64) std::atomic<int64_t> done{0};
};

struct Item {
  int32_t row, head, first, count;
};

struct Stack {
  // shapes
  int64_t T = 0, D = 0, N = 0, K = 0, H = 0, I = 0, NB = 0, bs = 0, R = 0, P = 0;
  float eps = 0.0f, scale = 0.0f;
  // inputs
  const float *cos = nullptr, *sin = nullptr;
  const int32_t *slots = nullptr, *cu = nullptr, *lens = nullptr, *tables = nullptr;
  std::vector<Layer> layers;
  std::vector<Item> items;
  // the residual stream (the output buffer) and scratch
  float* x = nullptr;
  std::vector<float> xn, q, k, v, attn, o, gate, up, act;
  // int8 activations (the `int8_acts` attribute, small_matmul/quant.cc): the next
  // phase's matmul input quantized by the serial work before it (acts; null: off)
  std::vector<int8_t> xq;
  std::vector<float> xq_scale, xq_sum;
  jaxserve_cpu::QActs qacts;
  const jaxserve_cpu::QActs* acts = nullptr;
  // phases
  int64_t num_phases = 0;
  std::unique_ptr<Phase[]> phases;
  std::atomic<int64_t> phase{0};
  std::atomic<int> joined{0};
  std::atomic<bool> ok{true};
  // a thread that waited long for a phase sleeps here (see Wait)
  std::atomic<int> sleepers{0};
  std::mutex mu;
  std::condition_variable cv;
};

JAXSERVE_HOT void RmsNorm(const Stack& s, const float* w, const float* x, float* out) {
  for (int64_t t = 0; t < s.T; ++t) {
    const float* xr = x + t * s.D;
    float ss = 0.0f;
    for (int64_t d = 0; d < s.D; ++d) ss += xr[d] * xr[d];
    const float r = 1.0f / std::sqrt(ss / float(s.D) + s.eps);
    float* o = out + t * s.D;
    for (int64_t d = 0; d < s.D; ++d) o[d] = xr[d] * r * w[d];
  }
}

// x [T, heads, H] rotated in place by each token's cos / sin (HF's rotate-half).
JAXSERVE_HOT void Rope(const Stack& s, float* x, int64_t heads) {
  const int64_t h2 = s.H / 2;
  for (int64_t t = 0; t < s.T; ++t) {
    const float* c = s.cos + t * h2;
    const float* sn = s.sin + t * h2;
    for (int64_t n = 0; n < heads; ++n) {
      float* a = x + (t * heads + n) * s.H;
      float* b = a + h2;
      for (int64_t i = 0; i < h2; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * sn[i];
        b[i] = x2 * c[i] + x1 * sn[i];
      }
    }
  }
}

// The next matmul's input x [T, K] quantized into s.qacts (int8 activations only).
void QuantizeInput(Stack& s, const float* x, int64_t K) {
  if (s.acts == nullptr) return;
  jaxserve_cpu::QuantizeActs(x, s.T, K, s.xq.data(), s.xq_scale.data(), s.xq_sum.data());
}

// Serial work after a phase, by the thread that completed it.
void Finish(Stack& s, const Phase& ph) {
  const Layer& L = s.layers[ph.layer];
  switch (ph.kind) {
    case Kind::kQKV: {
      Rope(s, s.q.data(), s.N);
      Rope(s, s.k.data(), s.K);
      const int64_t slots = s.NB * s.bs;
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t slot = s.slots[t];
        if (slot < 0 || slot >= slots) continue;       // a padding token
        for (int64_t h = 0; h < s.K; ++h) {
          std::memcpy(L.k + (h * slots + slot) * s.H, s.k.data() + (t * s.K + h) * s.H,
                      sizeof(float) * s.H);
          std::memcpy(L.v + (h * slots + slot) * s.H, s.v.data() + (t * s.K + h) * s.H,
                      sizeof(float) * s.H);
        }
      }
      break;
    }
    case Kind::kAttention:
      QuantizeInput(s, s.attn.data(), s.N * s.H);
      break;
    case Kind::kO:
      RmsNorm(s, L.mlp_norm, s.x, s.xn.data());
      QuantizeInput(s, s.xn.data(), s.D);
      break;
    case Kind::kGateUp:
      QuantizeInput(s, s.act.data(), s.I);
      break;
    case Kind::kDown:
      if (ph.layer + 1 < int(s.layers.size())) {
        RmsNorm(s, s.layers[ph.layer + 1].attn_norm, s.x, s.xn.data());
        QuantizeInput(s, s.xn.data(), s.D);
      }
      break;
  }
}

// y[:, panel u] += ... helpers: add the panel's columns of `o` into the residual stream.
void AddPanel(Stack& s, int64_t u) {
  for (int64_t t = 0; t < s.T; ++t) {
    float* xr = s.x + t * s.D + u * kPanel;
    const float* orow = s.o.data() + t * s.D + u * kPanel;
    for (int64_t c = 0; c < kPanel; ++c) xr[c] += orow[c];
  }
}

JAXSERVE_HOT void RunUnit(Stack& s, const Phase& ph, int64_t u) {
  const Layer& L = s.layers[ph.layer];
  const int64_t pq = s.N * s.H / kPanel, pk = s.K * s.H / kPanel;
  switch (ph.kind) {
    case Kind::kQKV:
      if (u < pq)
        Matmul(s.xn.data(), L.wq, s.q.data(), s.T, s.D, s.N * s.H, u, u + 1, s.acts);
      else if (u < pq + pk)
        Matmul(s.xn.data(), L.wk, s.k.data(), s.T, s.D, s.K * s.H, u - pq, u - pq + 1,
               s.acts);
      else
        Matmul(s.xn.data(), L.wv, s.v.data(), s.T, s.D, s.K * s.H, u - pq - pk,
               u - pq - pk + 1, s.acts);
      break;
    case Kind::kAttention: {
      if (u >= int64_t(s.items.size())) break;        // a layer without rows: nothing
      jaxserve_cpu::AttentionArgs a;
      a.q = s.q.data(); a.k = L.k; a.v = L.v; a.cu = s.cu; a.lens = s.lens;
      a.tables = s.tables; a.out = s.attn.data();
      a.T = s.T; a.N = s.N; a.H = s.H; a.K = s.K; a.NB = s.NB; a.bs = s.bs; a.R = s.R;
      a.P = s.P; a.scale = s.scale;
      const Item& it = s.items[u];
      if (!jaxserve_cpu::AttendF32(a, it.row, it.head, it.first, it.count))
        s.ok.store(false, std::memory_order_relaxed);
      break;
    }
    case Kind::kO:
      Matmul(s.attn.data(), L.wo, s.o.data(), s.T, s.N * s.H, s.D, u, u + 1, s.acts);
      AddPanel(s, u);
      break;
    case Kind::kGateUp: {
      Matmul(s.xn.data(), L.w_gate, s.gate.data(), s.T, s.D, s.I, u, u + 1, s.acts);
      Matmul(s.xn.data(), L.w_up, s.up.data(), s.T, s.D, s.I, u, u + 1, s.acts);
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t c = u * kPanel; c < (u + 1) * kPanel; ++c) {
          const float g = s.gate[t * s.I + c];
          s.act[t * s.I + c] = g / (1.0f + std::exp(-g)) * s.up[t * s.I + c];
        }
      break;
    }
    case Kind::kDown:
      Matmul(s.act.data(), L.w_down, s.o.data(), s.T, s.I, s.D, u, u + 1, s.acts);
      AddPanel(s, u);
      break;
  }
}

// The first weights a segment of a phase reads (for a prefetch while waiting), or null.
const void* SegmentStart(const Stack& s, const Phase& ph, int seg) {
  const Layer& L = s.layers[ph.layer];
  const int64_t u = ph.seg_begin[seg];
  const int64_t pq = s.N * s.H / kPanel, pk = s.K * s.H / kPanel;
  switch (ph.kind) {
    case Kind::kQKV:
      if (u < pq) return PanelStart(L.wq, u, s.D);
      if (u < pq + pk) return PanelStart(L.wk, u - pq, s.D);
      return PanelStart(L.wv, u - pq - pk, s.D);
    case Kind::kO: return PanelStart(L.wo, u, s.N * s.H);
    case Kind::kGateUp: return PanelStart(L.w_gate, u, s.D);
    case Kind::kDown: return PanelStart(L.w_down, u, s.I);
    default: return nullptr;
  }
}

// Opens phase n + 1 (the caller completed phase n), waking the threads that sleep.
void Advance(Stack& s, int64_t n) {
  s.phase.store(n + 1, std::memory_order_seq_cst);
  if (s.sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.cv.notify_all();
  }
}

// Until phase n is complete. The other threads' last units take a few microseconds, and
// a thread that lost its core for a while (a 2-core machine also runs the host's Python)
// mostly gets it back within a millisecond: spin for about kSpinWaits pauses (~0.5-1 ms;
// on the 2-core Xeon 1k, 16k, 100k pauses or yielding instead measured alike, within
// the machine's noise). Past that, sleep: an oversubscribed machine gets the core back.
constexpr int kSpinWaits = 16384;
void Wait(Stack& s, int64_t n) {
  for (int spin = 0; spin < kSpinWaits; ++spin) {
    if (s.phase.load(std::memory_order_acquire) != n) return;
    Pause();
  }
  std::unique_lock<std::mutex> lock(s.mu);
  s.sleepers.fetch_add(1, std::memory_order_seq_cst);
  s.cv.wait(lock, [&] { return s.phase.load(std::memory_order_seq_cst) != n; });
  s.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// A unit of `ph`: from the home segment first, then from the others; -1 when all taken.
int64_t Claim(Phase& ph, int home) {
  for (int i = 0; i < ph.segments; ++i) {
    const int seg = (home + i) % ph.segments;
    const int64_t u = ph.cursor[seg].next.fetch_add(1, std::memory_order_relaxed);
    if (u < ph.seg_begin[seg + 1]) return u;
  }
  return -1;
}

void Work(Stack& s, int id) {
  for (;;) {
    const int64_t n = s.phase.load(std::memory_order_acquire);
    if (n >= s.num_phases) return;
    Phase& ph = s.phases[n];
    const int home = id % ph.segments;
    for (int64_t u = Claim(ph, home); u >= 0; u = Claim(ph, home)) {
      RunUnit(s, ph, u);
      if (ph.done.fetch_add(1, std::memory_order_acq_rel) + 1 == ph.units) {
        Finish(s, ph);
        Advance(s, n);
      }
    }
    if (n + 1 < s.num_phases) {     // while the phase's last units finish elsewhere
      const Phase& next = s.phases[n + 1];
      if (const void* w = SegmentStart(s, next, id % next.segments))
        for (int64_t off = 0; off < 8192; off += 64)
          __builtin_prefetch(static_cast<const char*>(w) + off, 0, 2);
    }
    Wait(s, n);
  }
}

void SetPhase(Phase& ph, Kind kind, int layer, int64_t units, int segments) {
  ph.kind = kind;
  ph.layer = layer;
  ph.units = units;
  ph.segments = int(std::max<int64_t>(1, std::min<int64_t>(segments, units)));
  for (int i = 0; i <= ph.segments; ++i) ph.seg_begin[i] = units * i / ph.segments;
  for (int i = 0; i < ph.segments; ++i) ph.cursor[i].next.store(ph.seg_begin[i]);
  ph.done.store(0);
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slot_mapping,
                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> seq_lens,
                ffi::Buffer<ffi::S32> block_tables, ffi::RemainingArgs args,
                ffi::ResultBuffer<ffi::F32> x_out, ffi::RemainingRets rets, float eps,
                float scale, int64_t num_threads, bool quantized, bool int8_acts) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("decode_stack: " + what);
  };
  auto s = std::make_shared<Stack>();
  auto xd = x.dimensions(), cd = cos.dimensions(), td = block_tables.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || td.size() != 2 || cd[0] != xd[0] ||
      sin.element_count() != cos.element_count() || x_out->element_count() != x.element_count())
    return bad("x [T, D], cos / sin [T, H / 2], block_tables [R, P]");
  s->T = xd[0]; s->D = xd[1]; s->H = 2 * cd[1]; s->R = td[0]; s->P = td[1];
  s->eps = eps; s->scale = scale;
  const int64_t per = quantized ? kArgsPerLayerQuant : kArgsPerLayer;
  if (args.size() == 0 || int64_t(args.size()) % per != 0 ||
      int64_t(rets.size()) != int64_t(args.size()) / per * 2)
    return bad("11 (quantized: 25) arguments and 2 results per layer");
  if (int64_t(slot_mapping.element_count()) != s->T ||
      int64_t(cu_q_lens.element_count()) != s->R + 1 ||
      int64_t(seq_lens.element_count()) != s->R)
    return bad("inconsistent metadata shapes");
  // where projection j (wq, wk, wv, wo, gate, up, down) starts among a layer's arguments
  static constexpr int kAt[kProjections] = {1, 2, 3, 4, 6, 7, 8};
  static constexpr int kAtQuant[kProjections] = {1, 4, 7, 10, 14, 17, 20};
  const int* at = quantized ? kAtQuant : kAt;
  const int64_t mlp_at = quantized ? 13 : 5;
  auto is = [](ffi::Span<const int64_t> d, int64_t a, int64_t b, int64_t c) {
    return d.size() == 3 && d[0] == a && d[1] == b && d[2] == c;
  };
  const int64_t num_layers = int64_t(args.size()) / per;
  for (int64_t l = 0; l < num_layers; ++l) {
    std::vector<ffi::AnyBuffer> b;
    for (int64_t i = 0; i < per; ++i) {
      auto a = args.get<ffi::AnyBuffer>(l * per + i);
      if (a.has_error()) return bad("bad argument buffers");
      b.push_back(*a);
    }
    // projection j as an [N, K] weight (x @ w): false on a wrong type or shape
    auto take = [&](int j, int64_t N, int64_t K, Weight& w) -> bool {
      const ffi::AnyBuffer& v = b[at[j]];
      if (!quantized) {
        w.f32 = static_cast<const float*>(v.untyped_data());
        return v.element_type() == ffi::DataType::F32 && is(v.dimensions(), N / kPanel, K, kPanel);
      }
      const ffi::AnyBuffer &sc = b[at[j] + 1], &of = b[at[j] + 2];
      jaxserve_cpu::QPanels& q = w.q;
      if (v.element_type() == ffi::DataType::S8) q.bits = 8;
      else if (v.element_type() == ffi::DataType::U8) q.bits = 4;
      else return false;
      if (sc.element_type() != ffi::DataType::F16 && sc.element_type() != ffi::DataType::F32)
        return false;
      q.half = sc.element_type() == ffi::DataType::F16;
      auto sd = sc.dimensions();
      if (!is(v.dimensions(), N / kPanel, q.bits == 4 ? K / 2 : K, kPanel) || sd.size() != 3 ||
          sd[0] != N / kPanel || sd[2] != kPanel || sd[1] < 1 || K % sd[1] != 0)
        return false;
      q.block = K / sd[1];
      if (q.bits == 4 && q.block % 2 != 0) return false;
      q.offset = nullptr;
      if (of.element_count() != 0) {
        if (of.element_type() != sc.element_type() || of.element_count() != sc.element_count())
          return false;
        q.offset = of.untyped_data();
      }
      q.q = v.untyped_data();
      q.scale = sc.untyped_data();
      return jaxserve_cpu::QuantFormatSupported(q);
    };
    auto ko = rets.get<ffi::Buffer<ffi::F32>>(2 * l);
    auto vo = rets.get<ffi::Buffer<ffi::F32>>(2 * l + 1);
    if (ko.has_error() || vo.has_error()) return bad("float32 caches out");
    const ffi::AnyBuffer &kin = b[per - 2], &vin = b[per - 1];
    auto kc = kin.dimensions();
    if (kc.size() != 4) return bad("caches [K, NB, bs, H]");
    if (l == 0) {
      s->K = kc[0]; s->NB = kc[1]; s->bs = kc[2];
      auto wq = b[at[0]].dimensions(), wg = b[at[4]].dimensions();
      if (wq.size() != 3 || wg.size() != 3) return bad("packed weights [N / 32, K, 32]");
      s->N = wq[0] * kPanel / std::max<int64_t>(1, s->H);
      s->I = wg[0] * kPanel;
    }
    const int64_t T = s->T, D = s->D, NH = s->N * s->H, KH = s->K * s->H, I = s->I;
    const int64_t cache = s->K * s->NB * s->bs * s->H;
    Layer L;
    auto f32 = [](const ffi::AnyBuffer& a) { return a.element_type() == ffi::DataType::F32; };
    if (s->H <= 0 || NH % kPanel || KH % kPanel || D % kPanel || I % kPanel || s->K <= 0 ||
        s->N % s->K || !f32(b[0]) || !f32(b[mlp_at]) || !f32(kin) || !f32(vin) ||
        int64_t(b[0].element_count()) != D || int64_t(b[mlp_at].element_count()) != D ||
        !take(0, NH, D, L.wq) || !take(1, KH, D, L.wk) || !take(2, KH, D, L.wv) ||
        !take(3, D, NH, L.wo) || !take(4, I, D, L.w_gate) || !take(5, I, D, L.w_up) ||
        !take(6, D, I, L.w_down) ||
        kc[0] != s->K || kc[1] != s->NB || kc[2] != s->bs || kc[3] != s->H ||
        int64_t(vin.element_count()) != cache || int64_t((*ko)->element_count()) != cache ||
        int64_t((*vo)->element_count()) != cache || T <= 0)
      return bad("inconsistent shapes or types in layer " + std::to_string(l));
    float* k = (*ko)->typed_data();
    float* v = (*vo)->typed_data();
    // aliased by the caller (input_output_aliases); a copy for a caller that did not
    if (k != kin.untyped_data()) std::memcpy(k, kin.untyped_data(), sizeof(float) * cache);
    if (v != vin.untyped_data()) std::memcpy(v, vin.untyped_data(), sizeof(float) * cache);
    L.attn_norm = static_cast<const float*>(b[0].untyped_data());
    L.mlp_norm = static_cast<const float*>(b[mlp_at].untyped_data());
    L.k = k;
    L.v = v;
    s->layers.push_back(L);
  }
  s->cos = cos.typed_data(); s->sin = sin.typed_data();
  s->slots = slot_mapping.typed_data(); s->cu = cu_q_lens.typed_data();
  s->lens = seq_lens.typed_data(); s->tables = block_tables.typed_data();
  // attention work items: (row, kv head, tile of <= 16 query tokens), longest rows first
  for (int32_t r = 0; r < s->R; ++r) {
    const int32_t a = s->cu[r], b = s->cu[r + 1];
    const int64_t q_len = int64_t(b) - a;
    if (q_len <= 0) continue;
    if (a < 0 || b > s->T || s->lens[r] < q_len || s->lens[r] > s->P * s->bs)
      return bad("row " + std::to_string(r) + " out of range");
    for (int32_t f = 0; f < q_len; f += kQueryTile)
      for (int32_t h = 0; h < s->K; ++h)
        s->items.push_back({r, h, f, int32_t(std::min<int64_t>(kQueryTile, q_len - f))});
  }
  std::stable_sort(s->items.begin(), s->items.end(), [&](const Item& p, const Item& q) {
    return s->lens[p.row] > s->lens[q.row];
  });

  const int64_t T = s->T;
  s->x = x_out->typed_data();
  std::memcpy(s->x, x.typed_data(), sizeof(float) * T * s->D);
  s->xn.resize(T * s->D);
  s->q.resize(T * s->N * s->H);
  s->k.resize(T * s->K * s->H);
  s->v.resize(T * s->K * s->H);
  s->attn.assign(T * s->N * s->H, 0.0f);     // padding tokens' rows stay zero
  s->o.resize(T * s->D);
  s->gate.resize(T * s->I);
  s->up.resize(T * s->I);
  s->act.resize(T * s->I);

  int threads = int(std::max<int64_t>(1, pool.num_threads()));
  if (num_threads > 0) threads = int(std::min<int64_t>(threads, num_threads));
  threads = std::min(threads, kMaxThreads);
  s->num_phases = 5 * num_layers;
  s->phases.reset(new Phase[s->num_phases]);
  const int64_t qkv_units = (s->N + 2 * s->K) * s->H / kPanel;
  for (int64_t l = 0; l < num_layers; ++l) {
    Phase* ph = &s->phases[5 * l];
    SetPhase(ph[0], Kind::kQKV, int(l), qkv_units, threads);
    SetPhase(ph[1], Kind::kAttention, int(l), std::max<int64_t>(1, s->items.size()), 1);
    SetPhase(ph[2], Kind::kO, int(l), s->D / kPanel, threads);
    SetPhase(ph[3], Kind::kGateUp, int(l), s->I / kPanel, threads);
    SetPhase(ph[4], Kind::kDown, int(l), s->D / kPanel, threads);
  }
  // int8 activations: quantized panels at a decode step's few rows, all of K in 32s
  if (int8_acts && quantized && T <= 8 && s->D % 32 == 0 && (s->N * s->H) % 32 == 0 &&
      s->I % 32 == 0) {
    const int64_t widest = std::max({s->D, s->N * s->H, s->I});
    s->xq.resize(T * widest);
    s->xq_scale.resize(T * widest / 32);
    s->xq_sum.resize(T * widest / 32);
    s->qacts = {s->xq.data(), s->xq_scale.data(), s->xq_sum.data()};
    s->acts = &s->qacts;
  }
  RmsNorm(*s, s->layers[0].attn_norm, s->x, s->xn.data());
  QuantizeInput(*s, s->xn.data(), s->D);
  s->joined.store(1);
  for (int t = 1; t < threads; ++t)
    pool.Schedule([s] { Work(*s, s->joined.fetch_add(1)); });
  Work(*s, 0);
  if (!s->ok.load()) return bad("block id out of range");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveDecodeStackF32, Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()      // x [T, D]
        .Arg<ffi::Buffer<ffi::F32>>()      // cos [T, H / 2]
        .Arg<ffi::Buffer<ffi::F32>>()      // sin [T, H / 2]
        .Arg<ffi::Buffer<ffi::S32>>()      // slot_mapping [T]
        .Arg<ffi::Buffer<ffi::S32>>()      // cu_q_lens [R + 1]
        .Arg<ffi::Buffer<ffi::S32>>()      // seq_lens [R]
        .Arg<ffi::Buffer<ffi::S32>>()      // block_tables [R, P]
        .RemainingArgs()                   // 11 (quantized: 25) per layer (see the top)
        .Ret<ffi::Buffer<ffi::F32>>()      // x [T, D]
        .RemainingRets()                   // k_cache, v_cache per layer (aliased)
        .Attr<float>("eps")                // RMSNorm epsilon
        .Attr<float>("scale")              // attention scale
        .Attr<int64_t>("num_threads")      // at most this many threads; 0: XLA's pool size
        .Attr<bool>("quantized")           // projections as (q, scale, offset) triples
        .Attr<bool>("int8_acts"));         // x quantized for 4-bit panels' integer dots
