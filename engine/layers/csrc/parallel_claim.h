// Shared by the CPU kernels (copied next to each source when it is built).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// Runs fn(begin, end) over [0, n) in pieces of `grain` that the threads claim
// as they go, rather than one fixed share each: a thread the OS preempts (on a
// small machine the frontend, the gRPC threads and the benchmark client share
// the cores) holds up the step by one piece, not by half the work.
template <typename F>
inline void parallel_claim(int64_t n, int64_t grain, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(grain); begin < n; begin = next.fetch_add(grain))
      fn(begin, std::min(begin + grain, n));
  });
}
