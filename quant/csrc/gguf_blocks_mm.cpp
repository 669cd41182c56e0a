// y = x W^T where W is a GGUF tensor kept in its file's own block bytes (localllm's "gguf" scheme):
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, and F16 / BF16 / F32 rows.
//
// Every block is decoded as it is read into integer codes q (int8) and, per sub-block, an fp32
// scale and offset with w = q * scale + offset. Scales that are products (a K-quant's fp16
// super-block scale times its 4/6/8-bit sub-scale) are formed in fp32, where they are exact, as
// ggml forms them; nothing is rounded to 16 bits on the way. The weights therefore are the values
// gguf.quants.dequantize gives, bit for bit (gguf_dequant returns them; the tests compare).
//
// The matmul never builds the weight: per output row it decodes one block at a time into a small
// buffer, dots each sub-block's codes with the fp32 activations, scales the partial sum once, and adds
// offset * (sum of the sub-block's activations), precomputed once per call. It is made for decode
// (a few activation rows); many rows (a prefill chunk) go through gguf_gemm, which decodes the same
// values a panel at a time for the fp32 panel GEMM (panel_gemm.h). Output rows are split across threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "panel_gemm.h"
#include "parallel_rows.h"

namespace {

using namespace localllm::gguf_blocks;

// x (M, K) fp32, blocks (N, K / block * bytes) -> y (M, N) fp32. xsum (M, K / sub): sums of x per
// sub-block, for the offsets. The layout is a compile-time constant, so the loops over a block's
// sub-blocks unroll and the decoding vectorizes.
template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB>
void mm_blocks(const float* x, const float* xsum, const uint8_t* w, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t nb = K / BLOCK, row_bytes = nb * BYTES, nsub = K / SUB;
  localllm::parallel_chunks(N, 16, [&](int64_t begin, int64_t end) {
    float out[MAX_M];
    for (const auto n : c10::irange(begin, end)) {
      const uint8_t* wn = w + n * row_bytes;
      if (M == 1) {  // a decode step's one row: straight to y
        row_blocks<TYPE, BLOCK, BYTES, SUB, 1>(x, K, xsum, nsub, wn, nb, y + n);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int64_t rows = std::min(MAX_M, M - m0);
        localllm::panel::with_rows<MAX_M>(rows, [&](auto r) {
          row_blocks<TYPE, BLOCK, BYTES, SUB, r>(x + m0 * K, K, xsum + m0 * nsub, nsub, wn, nb, out);
        });
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = out[r];
      }
    }
  });
}

void mm_dispatch(int64_t type, const float* x, const float* xsum, const uint8_t* w, int64_t M, int64_t K, int64_t N,
                 float* y) {
  switch (type) {
#define LOCALLLM_CASE(T, B, BY, S) \
  case T: mm_blocks<T, B, BY, S>(x, xsum, w, M, K, N, y); break;
    LOCALLLM_BLOCK_TYPES(LOCALLLM_CASE)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "gguf_mm: GGML type ", type, " has no block kernel");
  }
}

void mm_float(int64_t type, const float* x, const uint8_t* w, int64_t M, int64_t K, int64_t N, int64_t elem,
              float* y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (const auto n : c10::irange(begin, end)) {
      float_row(type, w + n * K * elem, K, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        Vec a(0.f);
        int64_t k = 0;
        for (; k + VS <= K; k += VS) a = at::vec::fmadd(Vec::loadu(row.data() + k), Vec::loadu(xm + k), a);
        float s = hsum(a);
        for (; k < K; ++k) s += row[k] * xm[k];
        y[m * N + n] = s;
      }
    }
  });
}

// Many activation rows: 16 output rows at a time, their weights decoded a panel of columns at a time
// and multiplied by every activation row (panel_gemm.h). x (M, K) -> y (M, N).
template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB>
void mm_panels(const float* x, const uint8_t* w, int64_t M, int64_t K, int64_t N, float* y) {
  namespace panel = localllm::panel;
  constexpr int64_t W = panel::WIDTH;
  constexpr int64_t kb = BLOCK >= panel::KB ? BLOCK : panel::KB / BLOCK * BLOCK;  // whole blocks
  const int64_t row_bytes = K / BLOCK * BYTES;
  panel::gemm(x, M, K, N, kb, y, [&](int64_t t, int64_t k0, int64_t n, float* panel_out, float* rows) {
    const int64_t valid = std::min(W, N - t * W);
    const uint8_t* wt = w + t * W * row_bytes;
    if constexpr (BLOCK == 1) {
      for (int64_t j = 0; j < valid; ++j) float_row(TYPE, wt + j * row_bytes + k0 * BYTES, n, rows + j * kb);
    } else {
      decode_rows<TYPE, BLOCK, BYTES, SUB>(wt, row_bytes, valid, k0, n, rows, kb);
    }
    panel::transpose_rows(rows, kb, n, panel_out);
  });
}

void gemm_dispatch(int64_t type, const float* x, const uint8_t* w, int64_t M, int64_t K, int64_t N, float* y) {
  switch (type) {
#define LOCALLLM_CASE(T, B, BY, S) \
  case T: mm_panels<T, B, BY, S>(x, w, M, K, N, y); break;
    LOCALLLM_CASE(F32, 1, 4, 1)
    LOCALLLM_CASE(F16, 1, 2, 1)
    LOCALLLM_CASE(BF16, 1, 2, 1)
    LOCALLLM_BLOCK_TYPES(LOCALLLM_CASE)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "gguf_gemm: GGML type ", type, " has no panel kernel");
  }
}

Layout checked_layout(int64_t type, const at::Tensor& blocks, int64_t K, const char* op) {
  Layout L;
  TORCH_CHECK(layout_of(type, L), op, ": GGML type ", type, " is not supported");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, op, ": blocks must be 2-D uint8");
  TORCH_CHECK(K > 0 && K % L.block == 0, op, ": width ", K, " is not a multiple of the block ", L.block);
  TORCH_CHECK(blocks.size(1) == K / L.block * L.bytes, op, ": blocks have ", blocks.size(1), " bytes a row, width ",
              K, " needs ", K / L.block * L.bytes);
  return L;
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K) {
  const Layout L = checked_layout(type, blocks, K, "gguf_mm");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "gguf_mm: x must be (M, ", K, ")");
  TORCH_CHECK(L.block == 1 || L.sub % VS == 0, "gguf_mm: sub-blocks of ", L.sub, " are not a multiple of ", VS);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bc = blocks.contiguous();
  const int64_t M = x.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  if (L.block == 1) {
    mm_float(type, xp, bc.data_ptr<uint8_t>(), M, K, N, L.bytes, y.data_ptr<float>());
  } else {
    const int64_t nsub = K / L.sub;
    std::vector<float> xsum(M * nsub);  // per activation row and sub-block: for the offsets
    for (int64_t m = 0; m < M; ++m)
      for (int64_t s = 0; s < nsub; ++s) {
        float a = 0.f;
        for (int64_t j = 0; j < L.sub; ++j) a += xp[m * K + s * L.sub + j];
        xsum[m * nsub + s] = a;
      }
    mm_dispatch(type, xp, xsum.data(), bc.data_ptr<uint8_t>(), M, K, N, y.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The same product through fp32 panels (mm_panels): for many activation rows.
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t K) {
  const Layout L = checked_layout(type, blocks, K, "gguf_gemm");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "gguf_gemm: x must be (M, ", K, ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bc = blocks.contiguous();
  at::Tensor y = at::empty({xf.size(0), blocks.size(0)}, x.options().dtype(at::kFloat));
  TORCH_CHECK(L.block == 1 || L.sub % VS == 0, "gguf_gemm: sub-blocks of ", L.sub, " are not a multiple of ", VS);
  gemm_dispatch(type, xf.data_ptr<float>(), bc.data_ptr<uint8_t>(), xf.size(0), K, blocks.size(0), y.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor gguf_dequant(const at::Tensor& blocks, int64_t type, int64_t K) {
  const Layout L = checked_layout(type, blocks, K, "gguf_dequant");
  const at::Tensor bc = blocks.contiguous();
  const int64_t N = blocks.size(0), nb = K / L.block, row_bytes = nb * L.bytes;
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* w = bc.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    alignas(64) int8_t q[256];
    float scale[16], offset[16];
    for (const auto n : c10::irange(begin, end)) {
      if (L.block == 1) {
        float_row(type, w + n * row_bytes, K, o + n * K);
        continue;
      }
      for (int64_t bi = 0; bi < nb; ++bi) {
        const bool has_offset = decode(type, w + n * row_bytes + bi * L.bytes, q, scale, offset);
        float* ob = o + n * K + bi * L.block;
        for (int64_t j = 0; j < L.block; ++j) {
          const int64_t s = j / L.sub;
          // q * scale is exact in fp32 (at most 8 + 17 significant bits), so one rounding, as in ggml.
          ob[j] = has_offset ? static_cast<float>(q[j]) * scale[s] + offset[s] : static_cast<float>(q[j]) * scale[s];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("gguf_mm(Tensor x, Tensor blocks, int type, int in_features) -> Tensor");
  m.def("gguf_gemm(Tensor x, Tensor blocks, int type, int in_features) -> Tensor");
  m.def("gguf_dequant(Tensor blocks, int type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("gguf_mm", &gguf_mm);
  m.impl("gguf_gemm", &gguf_gemm);
  m.impl("gguf_dequant", &gguf_dequant);
}
