// A minimal parallel loop for the CPU backend: std::thread, no pool, no dependencies.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moelora::cpu {

inline int max_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

// Calls fn(i) once for every i in [begin, end), spread over up to hardware_concurrency
// threads. Each thread claims chunks of consecutive indices from a shared counter, so
// uneven work per index (empty expert blocks, short rows) still balances.
// min_per_thread: the fewest indices worth a thread of their own; a range smaller than
// twice that runs inline on the caller's thread (thread start-up costs ~10-50 us).
// The first exception thrown by fn is rethrown on the caller's thread after all
// threads have joined.
template <class F>
void parallel_for(int64_t begin, int64_t end, F fn, int64_t min_per_thread = 1) {
  const int64_t count = end - begin;
  if (count <= 0) return;
  min_per_thread = std::max<int64_t>(min_per_thread, 1);
  const int64_t num_threads = std::min<int64_t>(max_threads(), count / min_per_thread);
  if (num_threads <= 1) {
    for (int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
  // NOTE: ~4 chunks per thread: small enough to balance, large enough that the
  // shared counter is not contended.
  const int64_t chunk = std::max<int64_t>(1, count / (num_threads * 4));
  std::atomic<int64_t> next{begin};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (;;) {
        const int64_t chunk_begin = next.fetch_add(chunk);
        if (chunk_begin >= end) return;
        const int64_t chunk_end = std::min(end, chunk_begin + chunk);
        for (int64_t i = chunk_begin; i < chunk_end; ++i) fn(i);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
      next.store(end);  // stop the other threads early
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(num_threads - 1));
  for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace moelora::cpu
