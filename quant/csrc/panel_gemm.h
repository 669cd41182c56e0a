// The fp32 GEMM core of localllm's quantized CPU matmuls for many activation rows (a batched decode
// step, a prefill chunk): gemm(), below.
//
// A kernel decodes 16 output rows of its weights, KB input columns at a time, into a *panel*: fp32
// (KB, 16), column k's 16 weights contiguous (one vector on AVX-512, two on AVX2), in L1. Every
// activation row then runs over the panel with its 16 sums in registers, MR rows at a time, from a
// copy of the rows packed once per call (PackedRows): per column one broadcast feeds the FMAs of
// every panel in flight (two on AVX-512, one on AVX2), so the decode is paid once per panel,
// whatever M is, and the FMAs run at the core's rate. (The register kernels decode each column per
// few rows and spend most of their time decoding once M is more than a handful.)
//
// Each output is one fp32 FMA chain over k = 0 .. K-1 in order, from 0: its value does not depend on
// M or on which other rows share the call, so a sequence's logits are the same in any batch that
// takes this path.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel_rows.h"

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

// Panels a task multiplies side by side: two where the registers hold 2 x MR accumulators of a panel
// (AVX-512: 24 of 32), else one.
constexpr int64_t NP = NV == 1 ? 2 : 1;
// Whether the activation rows are packed (PackedRows): with two panels, MR row pointers and the
// rest no longer fit the general registers, and a spilled pointer costs a load per column.
constexpr bool PACK = NP == 2;

// Where a group's sums live: row r of panel p at base + p * pstep + r * rstep (WIDTH floats each).
struct Tile {
  float* base;
  int64_t pstep, rstep;
  float* at(int64_t p, int64_t r) const { return base + p * pstep + r * rstep; }
};

// f(std::integral_constant<int, left>) for 0 < left <= R: register kernels take their row count as a
// compile-time constant (each row's FMAs unroll into registers).
template <int R, class F>
inline void with_rows(int64_t left, const F& f) {
  if constexpr (R > 0) {
    if (left == R) f(std::integral_constant<int, R>{});
    else with_rows<R - 1>(left, f);
  }
}

// out (R, WIDTH) = in (R, WIDTH) + x (R, kb) . panel (kb, WIDTH), for P panels side by side
// (pstride floats apart); in == nullptr: from zero (the first columns). x: packed (element (r, k) at
// x[k * R + r]) or rows ldx apart, as PACK says. Two panels (AVX-512) share each broadcast: per column
// P panel loads and R broadcasts feed R * P FMAs, not R, and the loads stop being the bound.
// Never inlined: inlined into a kernel's gemm task (with its decoder beside it), GCC kept one of the 12
// AVX2 accumulators on the stack (a load and a store around its FMA every column), which halved the
// int5 kernel's prefill; compiled on its own, its register use does not depend on the caller's code.
template <int R, int P>
__attribute__((noinline)) void rows(const float* x, int64_t ldx, const float* panel, int64_t pstride, int64_t kb,
                                    const Tile* in, const Tile& out) {
  constexpr int J = P * NV;  // accumulators a row
  V a[R][J];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) a[r][j] = in ? vload(in->at(j / NV, r) + (j % NV) * Vec::size()) : vset(0.f);
  for (int64_t k = 0; k < kb; ++k) {
    V w[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) w[j] = vload(panel + (j / NV) * pstride + k * WIDTH + (j % NV) * Vec::size());
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xb = vset(PACK ? x[k * R + r] : x[r * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) a[r][j] = vfma(w[j], xb, a[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) vstore(out.at(j / NV, r) + (j % NV) * Vec::size(), a[r][j]);
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

template <int R, int P>
inline void tail(int64_t left, const float* x, int64_t ldx, const float* panel, int64_t pstride, int64_t kb,
                 const Tile* in, const Tile& out) {
  if constexpr (R > 0) {
    if (left == R) rows<R, P>(x, ldx, panel, pstride, kb, in, out);
    else tail<R - 1, P>(left, x, ldx, panel, pstride, kb, in, out);
  }
}

// R rows of x (K apart) -> out, element (r, k) at k * R + r. R is a compile-time constant, so each
// column's R copies unroll (a loop over a run-time R ran four times slower).
template <int R>
inline void pack_group(int64_t left, const float* in, int64_t K, float* out) {
  if constexpr (R > 0) {
    if (left != R) return pack_group<R - 1>(left, in, K, out);
    for (int64_t k = 0; k < K; ++k)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) out[k * R + r] = in[r * K + k];
  }
}

// The activation rows of one call, in groups of at most MR, as equal as can be (each FMA chain waits
// on its previous FMA, so a group needs enough rows to keep the FMA units busy: 16 rows go as 8 + 8,
// not 12 + 4). Where PACK, packed once for every panel: a group of R rows starting at row m0 lies at
// m0 * K, element (r, k) at k * R + r; else read where they are.
class PackedRows {
 public:
  PackedRows(const float* x, int64_t M, int64_t K)
      : x_(x), M_(M), K_(K), groups_((M + MR - 1) / MR), data_(PACK ? new float[M * K] : nullptr) {  // not zeroed
    if (!PACK) return;
    at::parallel_for(0, groups_, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) pack_group<MR>(size(g), x + start(g) * K, K, data_.get() + start(g) * K);
    });
  }
  int64_t groups() const { return groups_; }
  int64_t size(int64_t g) const { return M_ / groups_ + (g < M_ % groups_); }
  int64_t start(int64_t g) const { return g * (M_ / groups_) + std::min(g, M_ % groups_); }
  // Group g's columns from k0 (rows ldx() apart where not PACK).
  const float* at(int64_t g, int64_t k0) const {
    return PACK ? data_.get() + start(g) * K_ + k0 * size(g) : x_ + start(g) * K_ + k0;
  }
  int64_t ldx() const { return K_; }

 private:
  const float* x_;
  int64_t M_, K_, groups_;
  std::unique_ptr<float[]> data_;
};

// y (M, N) = x (M, K) . W^T, W decoded a panel at a time: decode(tile, k0, n, panel, scratch) writes
// the panel (n, WIDTH) of W's rows tile * WIDTH .. + WIDTH (what it writes past N is never read back),
// columns k0 .. k0 + n; scratch holds WIDTH * kb floats, for a decoder that writes rows and turns them
// (transpose_rows). kb: columns a panel, whole blocks or groups of the weight's format. Tasks of NP
// tiles run in parallel; each decodes its panels once and multiplies every activation row by them.
// Which thread runs a task does not change its values.
// The sums of a task's columns before the last kb go through a buffer (acc); the last columns' go
// straight into y, unless the task's last tile is cut short by N (then through acc too).
template <class Decode>
void gemm(const float* x, int64_t M, int64_t K, int64_t N, int64_t kb, float* y, const Decode& decode) {
  const PackedRows xp(x, M, K);
  const int64_t T = (N + WIDTH - 1) / WIDTH, tasks = (T + NP - 1) / NP, pstride = kb * WIDTH, astride = M * WIDTH;
  in_turn(tasks, [&](const auto& claim) {  // tasks in turn (parallel_rows.h)
    std::vector<float> scratch(WIDTH * kb), panels(NP * pstride), acc(K > kb ? NP * astride : 0);
    for (int64_t task = claim(); task < tasks; task = claim()) {
      const int64_t t0 = task * NP, np = std::min(NP, T - t0);
      const bool whole = (t0 + np) * WIDTH <= N;  // every tile's 16 columns lie in y
      if (!whole && acc.empty()) acc.resize(NP * astride);
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t n = std::min(kb, K - k0);
        const bool last = k0 + n == K;
        for (int64_t i = 0; i < np; ++i) decode(t0 + i, k0, n, panels.data() + i * pstride, scratch.data());
        for (int64_t g = 0; g < xp.groups(); ++g) {
          const int64_t m0 = xp.start(g);
          const Tile buffer{acc.data() + m0 * WIDTH, astride, WIDTH};
          const Tile out = last && whole ? Tile{y + m0 * N + t0 * WIDTH, WIDTH, N} : buffer;
          const Tile* in = k0 == 0 ? nullptr : &buffer;
          if constexpr (NP == 2) {
            if (np == 2) {
              tail<MR, 2>(xp.size(g), xp.at(g, k0), xp.ldx(), panels.data(), pstride, n, in, out);
              continue;
            }
          }
          tail<MR, 1>(xp.size(g), xp.at(g, k0), xp.ldx(), panels.data(), pstride, n, in, out);
        }
      }
      if (whole) continue;
      for (int64_t i = 0; i < np; ++i) {
        const int64_t col = (t0 + i) * WIDTH, valid = std::min(WIDTH, N - col);
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(y + m * N + col, acc.data() + i * astride + m * WIDTH, valid * sizeof(float));
      }
    }
  });
}

}  // namespace panel
}  // namespace localllm
