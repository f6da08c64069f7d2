// CPU handlers of abft_check and abft_finish (the math and its bound are in abft.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "abft.h"

namespace pimlayers {
namespace {

struct BlockSums {
  double s1, s2, sa;
  int64_t nonfinite, nf_loc;
};

template <FloatKind KI>
BlockSums CarefulSums(const void* y, int64_t j0, int64_t n);

// The three sums of one (row, block). The fast pass keeps four independent f64 accumulators (no
// reassociation needed) and does not look at each value: a non-finite value makes a sum non-finite
// (finite f32 values cannot overflow f64, even times j+1), and only then does CarefulSums run.
template <FloatKind KI>
BlockSums SumBlock(const void* y, int64_t j0, int64_t n) {
  double a1[4] = {0, 0, 0, 0}, a2[4] = {0, 0, 0, 0}, aa[4] = {0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int q = 0; q < 4; ++q) {
      double v = LoadF(y, j0 + j + q, KI);
      a1[q] += v;
      a2[q] += static_cast<double>(j + q + 1) * v;
      aa[q] += std::fabs(v);
    }
  }
  for (; j < n; ++j) {
    double v = LoadF(y, j0 + j, KI);
    a1[0] += v;
    a2[0] += static_cast<double>(j + 1) * v;
    aa[0] += std::fabs(v);
  }
  BlockSums s{(a1[0] + a1[1]) + (a1[2] + a1[3]), (a2[0] + a2[1]) + (a2[2] + a2[3]),
              (aa[0] + aa[1]) + (aa[2] + aa[3]), 0, -1};
  if (std::isfinite(s.s1) && std::isfinite(s.s2) && std::isfinite(s.sa)) return s;
  return CarefulSums<KI>(y, j0, n);
}

// One f64 pass that leaves non-finite values out and notes where they are.
template <FloatKind KI>
BlockSums CarefulSums(const void* y, int64_t j0, int64_t n) {
  BlockSums s{0, 0, 0, 0, -1};
  for (int64_t j = 0; j < n; ++j) {
    float v = LoadF(y, j0 + j, KI);
    if (!IsFiniteF(v)) {
      ++s.nonfinite;
      s.nf_loc = j;
      continue;
    }
    s.s1 += v;
    s.s2 += static_cast<double>(j + 1) * v;
    s.sa += std::fabs(v);
  }
  return s;
}

// float32 y (every GEMM output): eight f32 lanes in two 4-wide vectors (GCC/Clang vector
// extensions: SSE2 on any x86-64, NEON on ARM; the plain loop was not vectorised and ran 6x
// slower), flushed into f64 every 256 values, so no lane adds more than 32 rounded terms (error
// <= 32 u sum|y|, far inside the check's bound, which already allows for f32 check sums: its
// sqrt(n) term). The positions j + 1 are carried as floats, exact below 2^24 (wider blocks take
// the careful pass). A non-finite sum (a non-finite value, or finite values overflowing f32)
// also sends the block to CarefulSums.
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));

inline F4 LoadF4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline F4 AbsF4(F4 v) { return reinterpret_cast<F4>(reinterpret_cast<I4>(v) & 0x7fffffff); }

template <>
BlockSums SumBlock<FloatKind::kF32>(const void* yv, int64_t j0, int64_t n) {
  const float* y = static_cast<const float*>(yv) + j0;
  double d1 = 0, d2 = 0, da = 0;
  int64_t j = 0;
  while (j + 8 <= n) {
    F4 a1 = {0, 0, 0, 0}, b1 = a1, a2 = a1, b2 = a1, aa = a1, ba = a1;
    const float p0 = static_cast<float>(j + 1);
    F4 pa = {p0, p0 + 1, p0 + 2, p0 + 3}, pb = pa + 4;
    const int64_t end = j + std::min<int64_t>(256, (n - j) / 8 * 8);
    for (; j < end; j += 8) {
      const F4 va = LoadF4(y + j), vb = LoadF4(y + j + 4);
      a1 += va;
      b1 += vb;
      a2 += pa * va;
      b2 += pb * vb;
      aa += AbsF4(va);
      ba += AbsF4(vb);
      pa += 8;
      pb += 8;
    }
    for (int q = 0; q < 4; ++q) {
      d1 += static_cast<double>(a1[q]) + b1[q];
      d2 += static_cast<double>(a2[q]) + b2[q];
      da += static_cast<double>(aa[q]) + ba[q];
    }
  }
  for (; j < n; ++j) {
    const double v = y[j];
    d1 += v;
    d2 += static_cast<double>(j + 1) * v;
    da += std::fabs(v);
  }
  if (std::isfinite(d1) && std::isfinite(d2) && std::isfinite(da) && n < (int64_t{1} << 24)) {
    return {d1, d2, da, 0, -1};
  }
  return CarefulSums<FloatKind::kF32>(yv, j0, n);
}

// The gated f32 -> f32 copy of a block: |v| <= min(limit, FLT_MAX) is false exactly for NaN,
// +-Inf and values past the limit; a select per lane, the count from the masks.
inline int GateCopyF32(const float* in, float* out, int64_t n, const GateSpec& g) {
  if (!g.on) {
    std::memcpy(out, in, n * sizeof(float));
    return 0;
  }
  const float lim = std::min(g.limit, std::numeric_limits<float>::max());
  const F4 limv = {lim, lim, lim, lim}, fillv = {g.fill, g.fill, g.fill, g.fill};
  I4 kept = {0, 0, 0, 0};  // -1 per kept lane
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const F4 v = LoadF4(in + j);
    const I4 keep = AbsF4(v) <= limv;
    const F4 o = reinterpret_cast<F4>((reinterpret_cast<I4>(v) & keep) |
                                      (reinterpret_cast<I4>(fillv) & ~keep));
    std::memcpy(out + j, &o, sizeof(o));
    kept += keep;
  }
  int dropped = static_cast<int>(j) + kept[0] + kept[1] + kept[2] + kept[3];
  for (; j < n; ++j) {
    const bool keep = std::fabs(in[j]) <= lim;
    out[j] = keep ? in[j] : g.fill;
    dropped += !keep;
  }
  return dropped;
}

template <FloatKind KI, FloatKind KO>
void RunCpu(const AbftIo& io, const AbftParams& p, const GateSpec& g, int64_t r0, int64_t r1) {
  const bool write_all = io.out != io.y || g.on || KI != KO;
  for (int64_t r = r0; r < r1; ++r) {
    int dropped = 0;
    for (int64_t b = 0; b < io.nb; ++b) {
      const int64_t j0 = r * io.n_all + b * io.block_n;
      const int64_t n =
          io.n_all - b * io.block_n < io.block_n ? io.n_all - b * io.block_n : io.block_n;
      BlockSums s = SumBlock<KI>(io.y, j0, n);
      if (write_all && KI == FloatKind::kF32 && KO == FloatKind::kF32) {
        dropped += GateCopyF32(static_cast<const float*>(io.y) + j0,
                               static_cast<float*>(io.out) + j0, n, g);
      } else if (write_all) {
        for (int64_t j = 0; j < n; ++j) {
          StoreF(io.out, j0 + j, GateCast(LoadF(io.y, j0 + j, KI), KO, g, &dropped), KO);
        }
      }
      const int64_t cb = r * io.nb + b;
      const float c1 = io.checks[2 * cb];
      AbftDecision d = AbftDecide(s.s1, s.s2, s.sa, s.nonfinite, s.nf_loc, c1,
                                  io.checks[2 * cb + 1], io.mag[cb], n, p);
      if (d.flag == kAbftCorrected) {
        auto load = [&](int64_t j) { return static_cast<double>(LoadF(io.y, j0 + j, KI)); };
        const AbftFix fix = AbftRebuild(load, n, d.loc, c1, io.checks[2 * cb + 1], io.mag[cb], p);
        if (fix.ok) {
          int before = 0;
          GateCast(LoadF(io.y, j0 + d.loc, KI), KO, g, &before);  // was it gated in the pass?
          if (write_all) dropped -= before;
          StoreF(io.out, j0 + d.loc, GateCast(fix.value, KO, g, &dropped), KO);
        } else {
          d.flag = kAbftDetected;
        }
      }
      io.flags[cb] = d.flag;
    }
    if (io.counts != nullptr) io.counts[r] = dropped;
  }
}

template <FloatKind KI>
void RunCpuOut(const AbftIo& io, const AbftParams& p, const GateSpec& g, int64_t r0, int64_t r1) {
  switch (io.out_kind) {
    case FloatKind::kF32:
      return RunCpu<KI, FloatKind::kF32>(io, p, g, r0, r1);
    case FloatKind::kBF16:
      return RunCpu<KI, FloatKind::kBF16>(io, p, g, r0, r1);
    case FloatKind::kF16:
      return RunCpu<KI, FloatKind::kF16>(io, p, g, r0, r1);
  }
}

void RunRows(const AbftIo& io, const AbftParams& p, const GateSpec& g, int64_t r0, int64_t r1) {
  switch (io.in_kind) {
    case FloatKind::kF32:
      return RunCpuOut<FloatKind::kF32>(io, p, g, r0, r1);
    case FloatKind::kBF16:
      return RunCpuOut<FloatKind::kBF16>(io, p, g, r0, r1);
    case FloatKind::kF16:
      return RunCpuOut<FloatKind::kF16>(io, p, g, r0, r1);
  }
}

// Rows are independent, so they are split into chunks shared between this thread and XLA's
// intra-op thread pool: each worker takes the next chunk from an atomic counter until none are
// left, and this thread waits for the chunks others took. Below ~64K values the hand-off costs
// more than it saves (a GEMM output of 256 x 256 checks in ~20 us on one core). The state is
// shared (not on this stack): a task the pool starts after the handler returned finds no chunks.
constexpr int64_t kMinValuesPerChunk = 1 << 15;

void RunAbftCpu(const AbftIo& io, const AbftParams& p, const GateSpec& g, ffi::ThreadPool* pool) {
  const int64_t values = io.rows * io.n_all;
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  int64_t chunks = std::min<int64_t>(io.rows, values / kMinValuesPerChunk);
  chunks = std::min<int64_t>(chunks, 4 * (threads + 1));
  if (threads < 1 || chunks < 2) return RunRows(io, p, g, 0, io.rows);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, io, p, g, chunks]() {
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      RunRows(io, p, g, io.rows * c / chunks, io.rows * (c + 1) / chunks);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;  // Schedule takes its task by value (moved onto the heap)
    pool->Schedule(std::move(task));
  }
  work();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error AbftCheckCpu(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                        ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                        bool correct, ffi::Result<ffi::AnyBuffer> y_out,
                        ffi::Result<ffi::AnyBuffer> flags) {
  FloatKind kind;
  int64_t rows, n_all, nb;
  if (auto e =
          CheckAbftShapes(y, checks, mag, block_n, k, *y_out, *flags, &kind, &rows, &n_all, &nb);
      e.failure())
    return e;
  void* out = y_out->untyped_data();
  if (out != y.untyped_data()) std::memcpy(out, y.untyped_data(), y.size_bytes());
  AbftIo io{out,
            kind,
            out,
            kind,
            static_cast<const float*>(checks.untyped_data()),
            static_cast<const float*>(mag.untyped_data()),
            static_cast<int32_t*>(flags->untyped_data()),
            nullptr,
            rows,
            n_all,
            block_n,
            nb};
  RunAbftCpu(io, AbftParams{k, u, lam, StorageRoundoff(kind), correct}, GateSpec{false, 0, 0},
             &pool);
  return ffi::Error::Success();
}

ffi::Error AbftFinishCpu(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer checks,
                         ffi::AnyBuffer mag, int64_t block_n, int64_t k, float u, float lam,
                         bool correct, bool gate, float fill, float limit,
                         ffi::Result<ffi::AnyBuffer> y_out, ffi::Result<ffi::AnyBuffer> flags,
                         ffi::Result<ffi::AnyBuffer> counts) {
  FloatKind kind, out_kind;
  int64_t rows, n_all, nb;
  if (auto e = CheckAbftShapes(y, checks, mag, block_n, k, std::nullopt, *flags, &kind, &rows,
                               &n_all, &nb);
      e.failure())
    return e;
  if (auto e = CheckFinishOutputs(y, *y_out, *counts, rows, &out_kind); e.failure()) return e;
  AbftIo io{y.untyped_data(),
            kind,
            y_out->untyped_data(),
            out_kind,
            static_cast<const float*>(checks.untyped_data()),
            static_cast<const float*>(mag.untyped_data()),
            static_cast<int32_t*>(flags->untyped_data()),
            static_cast<int32_t*>(counts->untyped_data()),
            rows,
            n_all,
            block_n,
            nb};
  RunAbftCpu(io, AbftParams{k, u, lam, StorageRoundoff(kind), correct}, GateSpec{gate, fill, limit},
             &pool);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimlayers

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftCheckCpu, pimlayers::AbftCheckCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()   // XLA's intra-op threads
                                  .Arg<xla::ffi::AnyBuffer>()    // y: (..., M, N) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // checks: (..., M, nb, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // mag: (..., M, nb) f32
                                  .Attr<int64_t>("block_n")      // column block width
                                  .Attr<int64_t>("k")            // GEMM inner dimension
                                  .Attr<float>("unit_roundoff")  // u of the accumulation
                                  .Attr<float>("lam")            // safety factor of the bound
                                  .Attr<bool>("correct")         // rebuild located errors
                                  .Ret<xla::ffi::AnyBuffer>()    // y_out: like y (aliases y)
                                  .Ret<xla::ffi::AnyBuffer>());  // flags: (..., M, nb) int32

XLA_FFI_DEFINE_HANDLER_SYMBOL(PlAbftFinishCpu, pimlayers::AbftFinishCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()   // XLA's intra-op threads
                                  .Arg<xla::ffi::AnyBuffer>()    // y: (..., M, N) f32|bf16|f16
                                  .Arg<xla::ffi::AnyBuffer>()    // checks: (..., M, nb, 2) f32
                                  .Arg<xla::ffi::AnyBuffer>()    // mag: (..., M, nb) f32
                                  .Attr<int64_t>("block_n")      // column block width
                                  .Attr<int64_t>("k")            // GEMM inner dimension
                                  .Attr<float>("unit_roundoff")  // u of the accumulation
                                  .Attr<float>("lam")            // safety factor of the bound
                                  .Attr<bool>("correct")         // rebuild located errors
                                  .Attr<bool>("gate")            // insulation gate on the output
                                  .Attr<float>("fill")           // what the gate writes
                                  .Attr<float>("limit")          // |y| > limit is gated too
                                  .Ret<xla::ffi::AnyBuffer>()    // y_out: (..., M, N) out dtype
                                  .Ret<xla::ffi::AnyBuffer>()    // flags: (..., M, nb) int32
                                  .Ret<xla::ffi::AnyBuffer>());  // counts: (..., M) int32
