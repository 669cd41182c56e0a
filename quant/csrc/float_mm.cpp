// localllm's few-row products with 16-bit float weights (bf16 and fp16), for the decode step of
// float models on the CPU: y (M, N) = x (M, K) W^T with W (N, K) bf16 or fp16 as stored, and fp32
// activations and accumulation (bf16 and fp16 activations are widened first).
//
// A decode step multiplies one or a few activation rows by every weight once: the product is bound by
// how fast the weights stream from memory, and torch's bf16 GEMM on an AVX2 CPU (no AVX-512-BF16)
// widens the weights into a copy first, reading them at about half the rate the int4 kernels reach.
// Here each weight is widened in registers as it is loaded (bf16: a 16-bit shift; fp16: F16C's
// vcvtph2ps) and multiplied into fp32 sums at once, one output row after another (a thread's chunk of
// rows is one sequential stream, with a software prefetch ahead of it). Threads claim chunks of output
// rows in turn (parallel_rows.h). More activation rows (a prefill) take the fp32 panel GEMM
// (quant/float_kernels.py).
//
// Paths (chosen at run time, as q8_mm.cpp chooses its own, and capped by the build's capability):
// portable C++, AVX2 + F16C + FMA (8 weights a vector), AVX-512F (16 weights a vector). Every path
// sums each output in fp32, in its own order: results agree to fp32 rounding, not bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define LOCALLLM_FLOAT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define LOCALLLM_FLOAT_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

// The instruction sets a path is written for, narrowest first.
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

// Activation rows one pass over a weight row multiplies (more are taken in passes of this many).
constexpr int MMAX = 4;

// The widest path this CPU runs and this build allows (the library is built for torch's capability,
// localllm/native.py: an AVX2 build never takes the AVX-512 path, a portable build the portable one).
int64_t best_isa() {
#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
  static const int64_t isa = [] {
#if defined(CPU_CAPABILITY_AVX512)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return int64_t{AVX512};
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return int64_t{AVX2};
    return int64_t{PORTABLE};
  }();
  return isa;
#else
  return PORTABLE;
#endif
}

template <bool BF16>
inline float widen(uint16_t h) {
  if constexpr (BF16) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
}

// Rows [n0, n1) of y (M x N, fp32) from x (M x K, fp32) and w (N x K, 16-bit), portable C++.
template <bool BF16>
void rows_portable(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
                   float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      int64_t k = 0;
      for (; k + 4 <= K; k += 4)
        for (int j = 0; j < 4; ++j) acc[j] += xr[k + j] * widen<BF16>(wr[k + j]);
      for (; k < K; ++k) acc[0] += xr[k] * widen<BF16>(wr[k]);
      y[m * N + n] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
}

#if defined(__x86_64__)
// AVX2 -------------------------------------------------------------------------------------------
template <bool BF16>
LOCALLLM_FLOAT_AVX2 inline __attribute__((always_inline)) __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

LOCALLLM_FLOAT_AVX2 inline __attribute__((always_inline)) float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How far ahead of its loads a row's loop asks for weights: a few hundred cycles of streaming, within
// the row or into the next one (the step after the last row asks for bytes it never reads: harmless).
constexpr int PREFETCH = 1024;

// Ask for the cache lines of the BYTES weight bytes PREFETCH ahead of p (one line a step at least).
template <int BYTES>
inline __attribute__((always_inline)) void prefetch_ahead(const uint16_t* p) {
  const char* c = reinterpret_cast<const char*>(p) + PREFETCH;
#pragma GCC unroll 4
  for (int b = 0; b < BYTES; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// One output row n by M (<= MMAX) activation rows: the row's weights are read front to back, U vectors
// a step into U independent sums per activation row (M * U sums, U weight vectors and one activation
// vector of the 16 ymm registers), and the line PREFETCH bytes ahead is asked for each step. Rows are
// taken one after another, so a thread's chunk of rows is one sequential stream: interleaving the
// loads of several rows (each only a few cache lines long) left the hardware prefetcher several short
// streams to learn, and the loop read memory at about two thirds of the rate it reaches now.
template <bool BF16, int M, int U>
LOCALLLM_FLOAT_AVX2 void row_avx2(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t n, float* y) {
  const uint16_t* wr = w + n * K;
  __m256 acc[M][U];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    prefetch_ahead<16 * U>(wr + k);
    __m256 wv[U];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) wv[u] = load8<BF16>(wr + k + 8 * u);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * u), wv[u], acc[m][u]);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load8<BF16>(wr + k);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m256 sum = acc[m][0];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    float s = hsum8(sum);
    for (int64_t j = k; j < K; ++j) s += x[m * K + j] * widen<BF16>(wr[j]);
    y[m * N + n] = s;
  }
}

template <bool BF16, int M>
LOCALLLM_FLOAT_AVX2 void rows_avx2_m(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
                                      float* y) {
  constexpr int U = M <= 2 ? 4 : 2;  // M * U + U + 1 <= 16 ymm registers
  for (int64_t n = n0; n < n1; ++n) row_avx2<BF16, M, U>(x, w, K, N, n, y);
}

template <bool BF16>
void rows_avx2(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  switch (M) {
    case 1: return rows_avx2_m<BF16, 1>(x, w, K, N, n0, n1, y);
    case 2: return rows_avx2_m<BF16, 2>(x, w, K, N, n0, n1, y);
    case 3: return rows_avx2_m<BF16, 3>(x, w, K, N, n0, n1, y);
    default: return rows_avx2_m<BF16, 4>(x, w, K, N, n0, n1, y);
  }
}

// AVX-512F ---------------------------------------------------------------------------------------
template <bool BF16>
LOCALLLM_FLOAT_AVX512 inline __attribute__((always_inline)) __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

// As row_avx2, 16 weights a vector (M * U sums of the 32 zmm registers).
template <bool BF16, int M, int U>
LOCALLLM_FLOAT_AVX512 void row_avx512(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t n, float* y) {
  const uint16_t* wr = w + n * K;
  __m512 acc[M][U];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    prefetch_ahead<32 * U>(wr + k);
    __m512 wv[U];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) wv[u] = load16<BF16>(wr + k + 16 * u);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u)
        acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv[u], acc[m][u]);
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = load16<BF16>(wr + k);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[m][0];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    float s = _mm512_reduce_add_ps(sum);
    for (int64_t j = k; j < K; ++j) s += x[m * K + j] * widen<BF16>(wr[j]);
    y[m * N + n] = s;
  }
}

template <bool BF16, int M>
LOCALLLM_FLOAT_AVX512 void rows_avx512_m(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0,
                                          int64_t n1, float* y) {
  constexpr int U = 4;
  for (int64_t n = n0; n < n1; ++n) row_avx512<BF16, M, U>(x, w, K, N, n, y);
}

template <bool BF16>
void rows_avx512(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
                 float* y) {
  switch (M) {
    case 1: return rows_avx512_m<BF16, 1>(x, w, K, N, n0, n1, y);
    case 2: return rows_avx512_m<BF16, 2>(x, w, K, N, n0, n1, y);
    case 3: return rows_avx512_m<BF16, 3>(x, w, K, N, n0, n1, y);
    default: return rows_avx512_m<BF16, 4>(x, w, K, N, n0, n1, y);
  }
}
#endif

template <bool BF16>
void rows(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y,
          int64_t isa) {
#if defined(__x86_64__)
  if (isa == AVX512) return rows_avx512<BF16>(x, w, M, K, N, n0, n1, y);
  if (isa == AVX2) return rows_avx2<BF16>(x, w, M, K, N, n0, n1, y);
#endif
  rows_portable<BF16>(x, w, M, K, N, n0, n1, y);
}

at::Tensor run(const at::Tensor& x, const at::Tensor& weight, int64_t isa, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              op, ": weight must be (N, K) bfloat16 or float16");
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be (M, ", K, ")");
  TORCH_CHECK(x.is_floating_point(), op, ": x must be floating point");
  TORCH_CHECK(isa >= PORTABLE && isa <= best_isa(), op, ": path ", isa, " is not one this CPU and build run (0 .. ",
              best_isa(), ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const auto* w = static_cast<const uint16_t*>(weight.data_ptr());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M > 0 && N > 0) {
    localllm::parallel_chunks(N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t m0 = 0; m0 < M; m0 += MMAX) {  // passes of up to MMAX activation rows
        const int64_t mm = std::min<int64_t>(MMAX, M - m0);
        if (bf16) rows<true>(xp + m0 * K, w, mm, K, N, n0, n1, yp + m0 * N, isa);
        else rows<false>(xp + m0 * K, w, mm, K, N, n0, n1, yp + m0 * N, isa);
      }
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

// y (M, N) in x's dtype = x (M, K) by weight (N, K) bf16 or fp16, through the widest path here.
at::Tensor float_mm(const at::Tensor& x, const at::Tensor& weight) { return run(x, weight, best_isa(), "float_mm"); }

// The same product through a named path (an Isa up to float_isa()): the tests hold each path to
// F.linear on a CPU that runs several.
at::Tensor float_mm_isa(const at::Tensor& x, const at::Tensor& weight, int64_t isa) {
  return run(x, weight, isa, "float_mm_isa");
}

int64_t float_isa() { return best_isa(); }

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("float_mm(Tensor x, Tensor weight) -> Tensor");
  m.def("float_mm_isa(Tensor x, Tensor weight, int isa) -> Tensor");
  m.def("float_isa() -> int", &float_isa);
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("float_mm", &float_mm);
  m.impl("float_mm_isa", &float_mm_isa);
}
