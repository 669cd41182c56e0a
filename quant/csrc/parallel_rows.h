// How the quantized CPU kernels share a call's output rows (or tiles) among threads.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace localllm {

// fn(begin, end) over [0, N) in chunks of a whole number of `align` (about eight chunks a thread),
// which the threads claim in turn from a shared counter. A fixed share each (at::parallel_for's
// halves on two threads) left one core waiting at the end of every call whenever the cores ran at
// different speeds, as a machine's cores do from moment to moment; a decode step makes about a
// hundred such calls. Which thread runs a chunk does not change its values.
template <class F>
void parallel_chunks(int64_t N, int64_t align, const F& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max(align, (N + 8 * threads * align - 1) / (8 * threads * align) * align);
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) fn(c * chunk, std::min(N, (c + 1) * chunk));
  });
}

}  // namespace localllm
