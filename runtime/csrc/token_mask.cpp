// Constrained decoding's token mask, applied in place: every logit whose bit is 0 in the grammar's
// bitmask (one bit per token id, 32 to an int32 word, llguidance's layout) becomes -inf.
//
// Why a kernel: right after a model step the caches hold weights, and torch's or numpy's whole-row
// ops (unpack, select, add) each pass over a vocabulary-sized row; this one pass skips the words
// whose 32 tokens are all allowed (most of them inside a JSON string) and fills the words whose 32
// are all refused (most of them between JSON tokens), testing bits only in the few mixed words.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && bits.dim() == 2 && logits.size(0) == bits.size(0),
              "apply_token_bitmask_: logits (n, V) and bits (n, words)");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous(), "logits: contiguous float32");
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.is_contiguous(), "bits: contiguous int32");
  const int64_t n = logits.size(0), vocab = logits.size(1), words = bits.size(1);
  float* out = logits.data_ptr<float>();
  const auto* mask = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < n; ++r) {
    float* row = out + r * vocab;
    const uint32_t* m = mask + r * words;
    const int64_t covered = std::min(vocab, words * 32);
    for (int64_t w = 0; w * 32 < covered; ++w) {
      const uint32_t word = m[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, end = std::min(base + 32, covered);
      if (word == 0) {
        std::fill(row + base, row + end, ninf);
        continue;
      }
      for (int64_t i = base; i < end; ++i)
        if (!((word >> (i - base)) & 1u)) row[i] = ninf;
    }
    std::fill(row + covered, row + vocab, ninf);  // ids the grammar's vocabulary does not have
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) { m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bits) -> ()"); }

TORCH_LIBRARY_IMPL(localllm, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
