// The fp32 GEMM core of localllm's quantized CPU matmuls for many activation rows (a batched decode
// step, a prefill chunk).
//
// A kernel decodes 16 output rows of its weights, KB input columns at a time, into a *panel*: fp32
// (KB, 16), column k's 16 weights contiguous (one vector on AVX-512, two on AVX2), in L1. Every
// activation row then runs over the panel with its 16 sums in registers, MR rows at a time: per
// column one panel load and MR broadcast FMAs, so the decode is paid once per panel, whatever M is,
// and the FMAs run at the core's rate. (The register kernels decode each column per few rows and
// spend most of their time decoding once M is more than a handful.)
//
// Each output is one fp32 FMA chain over k = 0 .. K-1 in order, from 0: its value does not depend on
// M or on which other rows share the call, so a sequence's logits are the same in any batch that
// takes this path.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace localllm {
namespace panel {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t WIDTH = 16;                      // output rows a panel (and a tile of y)
constexpr int NV = WIDTH / Vec::size();            // vectors a panel column: 1 (AVX-512), 2 (AVX2)
constexpr int MR = NV == 1 ? 12 : 6;               // activation rows in registers (MR * NV accumulators)
constexpr int64_t KB = 256;                        // panel columns: 16 KB of fp32, in L1
static_assert(WIDTH % Vec::size() == 0, "a panel column must be whole vectors");

// Raw vector types, not at::vec::Vectorized: GCC keeps an array of Vectorized accumulators on the
// stack (a load and a store around every FMA), and plain vectors in registers.
#if defined(CPU_CAPABILITY_AVX512)
using V = __m512;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vset(float f) { return _mm512_set1_ps(f); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
#elif defined(CPU_CAPABILITY_AVX2)
using V = __m256;
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
#else
using V = Vec;
inline V vload(const float* p) { return Vec::loadu(p); }
inline void vstore(float* p, V v) { v.store(p); }
inline V vfma(V a, V b, V c) { return at::vec::fmadd(a, b, c); }
inline V vset(float f) { return Vec(f); }
inline V vmul(V a, V b) { return a * b; }
#endif

// acc (R, 16) += x (R, kb) rows ldx apart . panel (kb, 16).
template <int R>
inline void rows(const float* x, int64_t ldx, const float* panel, int64_t kb, float* acc) {
  V a[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) a[r][v] = vload(acc + r * WIDTH + v * Vec::size());
  for (int64_t k = 0; k < kb; ++k) {
    V w[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) w[v] = vload(panel + k * WIDTH + v * Vec::size());
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xb = vset(x[r * ldx + k]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) a[r][v] = vfma(w[v], xb, a[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) vstore(acc + r * WIDTH + v * Vec::size(), a[r][v]);
}

// rows (16, kb) row-major, rows ld apart -> panel (kb, 16): a kernel whose weights decode a row at
// a time writes them row by row and turns them here, 16 x 16 at a time in registers on AVX-512 (16
// vector stores, not 256 scalar ones), 8 x 8 on AVX2.
inline void transpose_rows(const float* rows, int64_t ld, int64_t kb, float* panel) {
  int64_t k0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; k0 + WIDTH <= kb; k0 += WIDTH) {
    __m512 r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows + j * ld + k0);
    for (int j = 0; j < 16; j += 2) {  // per 128-bit lane: (r_j[c], r_j+1[c]) pairs
      t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {  // per lane: rows j..j+3 of one column
      const __m512d a = _mm512_castps_pd(t[j]), b = _mm512_castps_pd(t[j + 1]);
      const __m512d c = _mm512_castps_pd(t[j + 2]), d = _mm512_castps_pd(t[j + 3]);
      r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));      // column 4L
      r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));  // 4L + 1
      r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));  // 4L + 2
      r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));  // 4L + 3
    }
    for (int c = 0; c < 4; ++c) {  // lanes across the four groups of rows
      const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);   // rows 0-7: columns c, c + 8
      const __m512 v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);   // rows 0-7: columns c + 4, c + 12
      const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
      const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
      float* out = panel + k0 * WIDTH;
      _mm512_storeu_ps(out + c * WIDTH, _mm512_shuffle_f32x4(v0, v2, 0x88));
      _mm512_storeu_ps(out + (c + 8) * WIDTH, _mm512_shuffle_f32x4(v0, v2, 0xdd));
      _mm512_storeu_ps(out + (c + 4) * WIDTH, _mm512_shuffle_f32x4(v1, v3, 0x88));
      _mm512_storeu_ps(out + (c + 12) * WIDTH, _mm512_shuffle_f32x4(v1, v3, 0xdd));
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; k0 + WIDTH <= kb; k0 += WIDTH)
    for (int64_t J = 0; J < WIDTH; J += 8)      // rows J .. J + 7
      for (int64_t C = 0; C < WIDTH; C += 8) {  // columns k0 + C .. + 7: an 8 x 8 transpose in registers
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + (J + i) * ld + k0 + C);
        for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: (r_i[c], r_i+1[c]) pairs
          t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
          t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {  // per lane: rows i .. i + 3 of one column
          r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
          r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
          r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
          r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        float* out = panel + (k0 + C) * WIDTH + J;
        for (int c = 0; c < 4; ++c) {  // lanes: rows 0-3 from r[c], rows 4-7 from r[4 + c]
          _mm256_storeu_ps(out + c * WIDTH, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
          _mm256_storeu_ps(out + (c + 4) * WIDTH, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
        }
      }
#endif
  for (; k0 < kb; ++k0)
    for (int64_t j = 0; j < WIDTH; ++j) panel[k0 * WIDTH + j] = rows[j * ld + k0];
}

template <int R>
inline void tail(const float* x, int64_t ldx, int64_t left, const float* panel, int64_t kb, float* acc) {
  if constexpr (R > 0) {
    if (left == R) rows<R>(x, ldx, panel, kb, acc);
    else tail<R - 1>(x, ldx, left, panel, kb, acc);
  }
}

// acc (M, 16) += x (M, kb) rows ldx apart . panel (kb, 16): every activation row over one panel, in
// groups of equal size (at most MR): each FMA chain waits on its previous FMA, so a group needs
// enough rows to keep the FMA units busy, and 16 rows go as 8 + 8, not 12 + 4.
inline void multiply(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t kb, float* acc) {
  const int64_t groups = (M + MR - 1) / MR;
  int64_t m = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r = M / groups + (g < M % groups);
    tail<MR>(x + m * ldx, ldx, r, panel, kb, acc + m * WIDTH);
    m += r;
  }
}

}  // namespace panel
}  // namespace localllm
