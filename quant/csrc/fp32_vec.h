// fp32 vector helpers the quantized CPU kernels share: int8 codes widened to fp32, and a vector's sum.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace localllm {
namespace fp32 {

using Vec = at::vec::Vectorized<float>;

// Vec::size() int8 values from p, as fp32 (widened straight from memory on AVX2 and AVX-512).
inline Vec load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[Vec::size()];
  for (const auto i : c10::irange(Vec::size())) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// The sum of v's lanes.
inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

}  // namespace fp32
}  // namespace localllm
