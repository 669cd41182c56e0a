// y = x W^T for int8 weights with one fp16 scale per group of input columns: the canonical "int8
// group G" format, which holds a GGUF file's Q8_0 blocks (G = 32) exactly; or with one scale per row
// (scales (N, 1), per-channel int8), the groups then only the length of each partial sum.
//
// torch's fast int8 matmul (_weight_int8pack_mm) takes one scale per output row, so a Q8_0 head had
// to be re-rounded to per-row scales (doubling SmolLM2's KL divergence) or dequantized to 16 bits
// (twice the bytes a decode step reads). This kernel reads the blocks as they are: each group's
// weights are widened to fp32 and dotted with the fp32 activations, the group's partial sums are
// scaled by its scale and accumulated in fp32, one vector per output row, summed once at the end.
// At batch 1 it is bound by memory bandwidth like any GEMV; rows are split across threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#ifndef PREFETCH
#define PREFETCH 2048  // bytes ahead of the codes being read
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();

// Vec::size() int8 values from p, as fp32.
inline Vec load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[VS];
  for (const auto i : c10::irange(VS)) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

template <typename T>
void mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  // x (M, K); q (N, K) int8; scales (N, K / group) fp16; y (M, N).
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), ng = K / group;
  std::vector<float> xf(M * K);  // the activations widened once, read by every row
  const T* xp = x.data_ptr<T>();
  for (const auto i : c10::irange(M * K)) xf[i] = static_cast<float>(xp[i]);
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const int64_t ns = scales.size(1);  // ng, or 1: one scale a row (the groups are then only how the sums run)
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (const auto n : c10::irange(begin, end)) {
      const int8_t* qn = qp + n * K;
      const at::Half* sn = sp + n * ns;
      for (const auto m : c10::irange(M)) {
        const float* xm = xf.data() + m * K;
        Vec a0(0.f), a1(0.f);  // two chains (even and odd groups), so the FMAs need not wait on each other
        for (const auto g : c10::irange(ng)) {
          const int8_t* qg = qn + g * group;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
          // The rows ahead, from L3 or memory: the prefetchers alone leave a decode step waiting on them.
          if (m == 0 && (g * group) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(qg) + PREFETCH, _MM_HINT_T0);
          if (m == 0 && g % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(sn + g) + PREFETCH / 16, _MM_HINT_T0);
#endif
          const float* xg = xm + g * group;
          Vec t = load_int8(qg) * Vec::loadu(xg);  // the group's dot product, then scaled once
          for (int64_t d = VS; d < group; d += VS) t = at::vec::fmadd(load_int8(qg + d), Vec::loadu(xg + d), t);
          const Vec s(static_cast<float>(sn[ns == 1 ? 0 : g]));
          if (g % 2) a1 = at::vec::fmadd(t, s, a1);
          else a0 = at::vec::fmadd(t, s, a0);
        }
        yp[m * N + n] = static_cast<T>(at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a0 + a1));
      }
    }
  });
}

at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "int8_group_mm: x, qweight, scales must be 2-D");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_group_mm: qweight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "int8_group_mm: scales must be float16");
  TORCH_CHECK(group > 0 && group % VS == 0, "int8_group_mm: group ", group, " is not a multiple of ", VS);
  TORCH_CHECK(x.size(1) == q.size(1) && q.size(1) % group == 0, "int8_group_mm: x (M, K) does not match qweight (N, K)");
  TORCH_CHECK(scales.size(0) == q.size(0) && (scales.size(1) == q.size(1) / group || scales.size(1) == 1),
              "int8_group_mm: scales must be (N, K / group), or (N, 1): one a row");
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: mm<float>(xc, qc, sc, group, y); break;
    case at::kBFloat16: mm<at::BFloat16>(xc, qc, sc, group, y); break;
    case at::kHalf: mm<at::Half>(xc, qc, sc, group, y); break;
    default: TORCH_CHECK(false, "int8_group_mm: activations of dtype ", x.scalar_type(), " are not float, bfloat16 or half");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("int8_group_mm(Tensor x, Tensor qweight, Tensor scales, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int8_group_mm", &int8_group_mm);
}
