// How the quantized CPU kernels share a call's work (output rows, tiles, panel tasks) among threads.
//
// Threads claim items in turn from a shared counter rather than taking a fixed share each
// (at::parallel_for's halves on two threads): on a machine whose cores run at different speeds from
// moment to moment, a fixed split left one core waiting for the other at the end of every call, and a
// decode step makes about a hundred calls. Which thread runs an item does not change its values.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace localllm {

// body(claim) on each of up to get_num_threads() threads (one per item at most); claim() returns the
// next unclaimed item of [0, n), or n once every item is taken. A body sets up its thread's scratch
// once, then loops: for (i = claim(); i < n; i = claim()).
template <class Body>
void in_turn(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  const auto claim = [&next]() { return next++; };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) { body(claim); });
}

// fn(begin, end) over [0, N) in chunks of a whole number of `align` (about eight chunks a thread),
// claimed in turn.
template <class F>
void parallel_chunks(int64_t N, int64_t align, const F& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max(align, (N + 8 * threads * align - 1) / (8 * threads * align) * align);
  const int64_t chunks = (N + chunk - 1) / chunk;
  in_turn(chunks, [&](const auto& claim) {
    for (int64_t c = claim(); c < chunks; c = claim()) fn(c * chunk, std::min(N, (c + 1) * chunk));
  });
}

}  // namespace localllm
