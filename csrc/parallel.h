// Splitting a CPU handler's independent units over XLA's intra-op thread pool, and cloning its
// kernels for the CPU they run on.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "common.h"

// A CPU kernel marked PL_CLONES is built for AVX2 + FMA and for the baseline, and the loader picks
// the clone once (GCC and Clang, glibc's ifunc): one build serves every x86-64 CPU.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define PL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PL_CLONES
#endif

namespace pimlayers {

// Units (rows) are independent, so they are split into chunks shared between this thread and
// XLA's intra-op thread pool: each worker takes the next chunk from an atomic counter until none
// are left, and this thread waits for the chunks others took. Below ~64K values the hand-off costs
// more than it saves (a GEMM output of 256 x 256 checks in ~20 us on one core). The state is
// shared (not on this stack): a task the pool starts after the handler returned finds no chunks.
// `fn(u0, u1)` runs units [u0, u1) and must capture by value. `share` is the part of the pool's
// threads it may take (an op that XLA runs beside another on the same pool takes less).
inline constexpr int64_t kMinValuesPerChunk = 1 << 15;

template <typename Fn>
void ParallelUnits(ffi::ThreadPool* pool, int64_t units, int64_t values, Fn fn,
                   double share = 1.0) {
  const int64_t threads =
      pool == nullptr ? 0 : static_cast<int64_t>(share * static_cast<double>(pool->num_threads()));
  int64_t chunks = std::min<int64_t>(units, values / kMinValuesPerChunk);
  chunks = std::min<int64_t>(chunks, 4 * (threads + 1));
  if (threads < 1 || chunks < 2) return fn(0, units);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, fn, units, chunks]() {
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      fn(units * c / chunks, units * (c + 1) / chunks);
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

}  // namespace pimlayers
