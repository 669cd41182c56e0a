// Greedy decoding's pick: each row's largest logit's first index, a NaN counting as the largest (as
// torch.argmax has it).
//
// Why a kernel: over a 150k-260k-token vocabulary torch's argmax and max walk a row a value at a time,
// and the chunked torch form (sampling.greedy: the largest of each chunk, then of the chunk holding
// the row's) is six ops, each a dispatch and a pass. Here the threads take parts of the rows, each
// part's largest value is found a vector at a time, and the first place of a row's largest is then
// looked for in the first part that holds it alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t PART = 16384;  // values a part: a thread's task

// The largest of p[0, n), NaN if any is.
float largest(const float* p, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(p + i));
  alignas(64) float lanes[Vec::size()];
  m.store(lanes);
  float best = lanes[0];
  for (int64_t j = 0; j < Vec::size() + n - i; ++j) {
    const float v = j < Vec::size() ? lanes[j] : p[i + j - Vec::size()];
    if (std::isnan(v)) return v;
    best = std::max(best, v);
  }
  return best;
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_argmax: logits must be contiguous float32 (rows, vocab)");
  const int64_t rows = logits.size(0), vocab = logits.size(1), parts = (vocab + PART - 1) / PART;
  TORCH_CHECK(vocab > 0, "greedy_argmax: an empty vocabulary");
  const float* x = logits.data_ptr<float>();
  std::vector<float> best(rows * parts);  // each part's largest
  at::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / parts, a = (i % parts) * PART;
      best[i] = largest(x + r * vocab + a, std::min(PART, vocab - a));
    }
  });
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* b = best.data() + r * parts;
    int64_t at_part = 0;  // the first part holding the row's largest (or its first NaN)
    for (int64_t a = 1; a < parts && !std::isnan(b[at_part]); ++a)
      if (std::isnan(b[a]) || b[a] > b[at_part]) at_part = a;
    const float m = b[at_part];
    const float* p = x + r * vocab + at_part * PART;
    int64_t k = 0;
    while (!(std::isnan(m) ? std::isnan(p[k]) : p[k] == m)) ++k;
    ids[r] = at_part * PART + k;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(localllm, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
