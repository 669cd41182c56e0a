// y = x W^T for int4 weights with an fp16 scale and offset per group of input columns (localllm's
// canonical int4: w = q * scale + offset, q in 0..15), with fp32 activations and fp32 accumulation.
//
// torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) takes bf16 activations and bf16 scales: the
// activations' rounding alone moved SmolLM2's predictions by a KL divergence of 1e-3 from the file's
// own weights in fp32. This kernel multiplies the exact weights by the exact activations.
//
// Layout (made at load by quant/kernels.py, Int4GroupCPU.prepare): output rows in tiles of 16.
//   packed  uint8 (T, K/2, 16): byte j of pair p of tile t holds row 16t + j's codes for columns 2p
//           (low nibble) and 2p + 1 (high nibble);
//   scales, offsets  fp16 (T, K/G, 16): row 16t + j's scale and offset of group g.
// One 16-byte load gives two columns of 16 rows; each lane of a vector is an output row, so the
// activations are broadcast, no horizontal sum is ever needed, and a group's dot product q . x (exact
// codes, fp32 FMAs) is scaled once and its offset added as offset * (sum of the group's activations).
// Rows past N in the last tile are zero codes, zero scales and zero offsets, and are not written.
//
// Decode (one activation row) keeps four accumulators a row so consecutive FMAs do not wait on each
// other; a few rows share each decoded column (MC at a time). Tiles are split across threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "panel_gemm.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
constexpr int64_t TILE = 16;       // output rows a tile (one byte each in a 16-byte column pair)
constexpr int NV = TILE / VS;      // vectors a tile's column: 1 (AVX-512), 2 (AVX2 and the portable code)
static_assert(TILE % VS == 0, "a tile must be whole vectors");
#ifndef PREFETCH
#define PREFETCH 2048
#endif
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t MC = 4;  // activation rows sharing a decoded column (32 registers)
#else
constexpr int64_t MC = 2;  // (16 registers)
#endif

// The 16 bytes of a column pair -> the 16 rows' codes of the even column (lo) and the odd one (hi).
inline void codes(const uint8_t* p, Vec* lo, Vec* hi) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(v, mask), h = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
#if defined(CPU_CAPABILITY_AVX512)
  lo[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l)));
  hi[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h)));
#else
  lo[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l)));
  lo[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(l, l))));
  hi[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h)));
  hi[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(h, h))));
#endif
#else
  alignas(64) float fl[TILE], fh[TILE];
  for (int j = 0; j < TILE; ++j) {
    fl[j] = static_cast<float>(p[j] & 0x0F);
    fh[j] = static_cast<float>(p[j] >> 4);
  }
  for (int v = 0; v < NV; ++v) {
    lo[v] = Vec::loadu(fl + v * VS);
    hi[v] = Vec::loadu(fh + v * VS);
  }
#endif
}

// 16 fp16 values -> fp32 vectors.
inline void halves(const c10::Half* p, Vec* out) {
#if defined(CPU_CAPABILITY_AVX512)
  out[0] = Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  out[0] = Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  out[1] = Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  alignas(64) float f[TILE];
  for (int j = 0; j < TILE; ++j) f[j] = static_cast<float>(p[j]);
  for (int v = 0; v < NV; ++v) out[v] = Vec::loadu(f + v * VS);
#endif
}

// One tile (16 output rows) for R activation rows; A accumulators a row within a group (A even:
// pairs of columns alternate between A / 2 pairs of them).
//   x (R, K) rows ldx apart; xsum (R, K/G) rows ng apart; w (K/2, 16); s, o (K/G, 16);
//   y: R rows ldy apart, 16 columns of which ``valid`` are written.
template <int R, int A>
void tile_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, const c10::Half* s,
               const c10::Half* o, int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  const int64_t ng = K / G, pairs = G / 2;
  Vec tot[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) tot[r][v] = Vec(0.f);
  for (int64_t g = 0; g < ng; ++g) {
    // Row r's accumulator a, vector v at (r * A + a) * NV + v: one flat array, which GCC keeps in
    // registers; as dot[R][A][NV] it kept those of 3 and 4 rows on the stack (a load and a store an FMA).
    Vec dot[R * A * NV];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a)
        for (int v = 0; v < NV; ++v) dot[(r * A + a) * NV + v] = Vec(0.f);
    const uint8_t* wg = w + g * pairs * TILE;
    const float* xg = x + g * G;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (g % 2 == 0) {  // the scales and offsets a few tiles ahead (a cache line holds two groups')
      _mm_prefetch(reinterpret_cast<const char*>(s + g * TILE) + PREFETCH / 4, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(o + g * TILE) + PREFETCH / 4, _MM_HINT_T0);
    }
#endif
    for (int64_t p = 0; p < pairs; p += A / 2) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      if ((p * TILE) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(wg + p * TILE + PREFETCH), _MM_HINT_T0);
#endif
#pragma GCC unroll 8
      for (int u = 0; u < A / 2; ++u) {
        Vec lo[NV], hi[NV];
        codes(wg + (p + u) * TILE, lo, hi);
        for (int r = 0; r < R; ++r) {
          const float* xr = xg + r * ldx + 2 * (p + u);
          const Vec xl(xr[0]), xh(xr[1]);
          for (int v = 0; v < NV; ++v) {
            dot[(r * A + 2 * u) * NV + v] = at::vec::fmadd(lo[v], xl, dot[(r * A + 2 * u) * NV + v]);
            dot[(r * A + 2 * u + 1) * NV + v] = at::vec::fmadd(hi[v], xh, dot[(r * A + 2 * u + 1) * NV + v]);
          }
        }
      }
    }
    Vec sc[NV], of[NV];
    halves(s + g * TILE, sc);
    halves(o + g * TILE, of);
    for (int r = 0; r < R; ++r) {
      const Vec xs(xsum[r * ng + g]);
      for (int v = 0; v < NV; ++v) {
        Vec d = dot[r * A * NV + v];
        for (int a = 1; a < A; ++a) d = d + dot[(r * A + a) * NV + v];
        tot[r][v] = at::vec::fmadd(of[v], xs, at::vec::fmadd(d, sc[v], tot[r][v]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (valid == TILE) {
      for (int v = 0; v < NV; ++v) tot[r][v].store(y + r * ldy + v * VS);
    } else {
      alignas(64) float buf[TILE];
      for (int v = 0; v < NV; ++v) tot[r][v].store(buf + v * VS);
      std::memcpy(y + r * ldy, buf, valid * sizeof(float));
    }
  }
}

// Tile t's columns [k0, k0 + kb) as an fp32 panel (kb, 16): w = q * scale + offset, rounded once (q *
// scale is exact in fp32), the values int4_group_dequant gives. k0 and kb are whole groups.
void decode_panel(const uint8_t* w, const c10::Half* s, const c10::Half* o, int64_t K, int64_t G, int64_t k0,
                  int64_t kb, float* panel) {
  const int64_t pairs = G / 2;
  for (int64_t g = k0 / G; g < (k0 + kb) / G; ++g) {
    Vec sc[NV], of[NV];
    halves(s + g * TILE, sc);
    halves(o + g * TILE, of);
    float* pg = panel + (g * G - k0) * TILE;
    for (int64_t p = 0; p < pairs; ++p) {
      Vec lo[NV], hi[NV];
      codes(w + (g * pairs + p) * TILE, lo, hi);
      for (int v = 0; v < NV; ++v) {
        at::vec::fmadd(lo[v], sc[v], of[v]).store(pg + 2 * p * TILE + v * VS);
        at::vec::fmadd(hi[v], sc[v], of[v]).store(pg + (2 * p + 1) * TILE + v * VS);
      }
    }
  }
}

// Many activation rows: each tile's weights decoded once per panel of columns and multiplied by
// every row (panel_gemm.h). w, s, o as in mm; x (M, K) -> y (M, N).
void mm_panels(const float* x, const uint8_t* w, const c10::Half* s, const c10::Half* o, int64_t M, int64_t K,
               int64_t G, int64_t N, float* y) {
  static_assert(localllm::panel::WIDTH == TILE, "a panel is a tile");
  const int64_t ng = K / G;
  const int64_t kb = std::max<int64_t>(G, localllm::panel::KB / G * G);  // whole groups a panel
  localllm::panel::gemm(x, M, K, N, kb, y, [&](int64_t t, int64_t k0, int64_t n, float* panel, float*) {
    decode_panel(w + t * (K / 2) * TILE, s + t * ng * TILE, o + t * ng * TILE, K, G, k0, n, panel);
  });
}

void mm(const float* x, const float* xsum, const uint8_t* w, const c10::Half* s, const c10::Half* o, int64_t M,
        int64_t K, int64_t G, int64_t N, float* y) {
  const int64_t T = (N + TILE - 1) / TILE, ng = K / G;
  // Enough tiles a task that a thread's share is worth waking it: ~64K weights.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (TILE * K));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * (K / 2) * TILE;
      const c10::Half* st = s + t * ng * TILE;
      const c10::Half* ot = o + t * ng * TILE;
      const int64_t valid = std::min(TILE, N - t * TILE);
      float* yt = y + t * TILE;
      if (M == 1) {
        tile_rows<1, 4>(x, K, xsum, wt, st, ot, K, G, yt, N, valid);
        continue;
      }
      int64_t m = 0;
      for (; m + MC <= M; m += MC)
        tile_rows<MC, 2>(x + m * K, K, xsum + m * ng, wt, st, ot, K, G, yt + m * N, N, valid);
      // The rest shares its decoded columns too where registers allow (a verify step's 2-3 rows):
      // each row decoded on its own costs nearly a whole one-row product per row.
      const int64_t rest = M - m;
      if (MC > 3 && rest == 3)
        tile_rows<3, 2>(x + m * K, K, xsum + m * ng, wt, st, ot, K, G, yt + m * N, N, valid);
      else if (MC > 2 && rest == 2)
        tile_rows<2, 2>(x + m * K, K, xsum + m * ng, wt, st, ot, K, G, yt + m * N, N, valid);
      else
        for (; m < M; ++m)
          tile_rows<1, 4>(x + m * K, K, xsum + m * ng, wt, st, ot, K, G, yt + m * N, N, valid);
    }
  });
}

void check(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets, int64_t group,
           int64_t N, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == TILE && packed.scalar_type() == at::kByte,
              op, ": packed must be uint8 (tiles, K/2, 16)");
  TORCH_CHECK(group > 0 && group % 8 == 0, op, ": group ", group, " is not a multiple of 8");
  const int64_t T = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % group == 0, op, ": width ", K, " is not a multiple of the group ", group);
  TORCH_CHECK(N > (T - 1) * TILE && N <= T * TILE, op, ": ", N, " rows do not fill ", T, " tiles of 16");
  for (const at::Tensor* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == T && t->size(1) == K / group &&
                    t->size(2) == TILE,
                op, ": scales and offsets must be float16 (tiles, K/group, 16)");
  }
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(),
              op, ": packed, scales and offsets must be contiguous");
}

at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t group, int64_t N) {
  check(packed, scales, offsets, group, N, "int4_group_mm");
  const int64_t K = packed.size(1) * 2, ng = K / group;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int4_group_mm: x must be (M, ", K, ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 / fp16 widen exactly
  const int64_t M = xf.size(0);
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum(M * ng);  // per activation row and group: for the offsets
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = xp + m * K + g * group;
      Vec a(0.f);
      for (int64_t j = 0; j < group; j += VS) a = a + Vec::loadu(xg + j, std::min<int64_t>(VS, group - j));
      xsum[m * ng + g] = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a);
    }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  mm(xp, xsum.data(), packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>(), M,
     K, group, N, y.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The same product through fp32 panels (mm_panels): for many activation rows.
at::Tensor int4_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t group, int64_t N) {
  check(packed, scales, offsets, group, N, "int4_group_gemm");
  const int64_t K = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int4_group_gemm: x must be (M, ", K, ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({xf.size(0), N}, x.options().dtype(at::kFloat));
  mm_panels(xf.data_ptr<float>(), packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
            offsets.data_ptr<c10::Half>(), xf.size(0), K, group, N, y.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The weights (N, K) in fp32, w = q * scale + offset: q * scale is exact in fp32 (4 + 11 significant
// bits), so each weight is rounded once, as the reference's fp32 dequantization rounds it.
at::Tensor int4_group_dequant(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
                              int64_t group, int64_t N) {
  check(packed, scales, offsets, group, N, "int4_group_dequant");
  const int64_t K = packed.size(1) * 2, ng = K / group, pairs = group / 2;
  at::Tensor out = at::empty({N, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  const c10::Half* o = offsets.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(TILE, N - t * TILE);
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* wg = w + (t * (K / 2) + g * pairs) * TILE;
        const c10::Half* sg = s + (t * ng + g) * TILE;
        const c10::Half* og = o + (t * ng + g) * TILE;
        for (int64_t j = 0; j < valid; ++j) {
          const float sj = static_cast<float>(sg[j]), oj = static_cast<float>(og[j]);
          float* row = op + (t * TILE + j) * K + g * group;
          for (int64_t p = 0; p < pairs; ++p) {
            const uint8_t b = wg[p * TILE + j];
            row[2 * p] = static_cast<float>(b & 0x0F) * sj + oj;
            row[2 * p + 1] = static_cast<float>(b >> 4) * sj + oj;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("int4_group_mm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int4_group_gemm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int4_group_dequant(Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int4_group_mm", &int4_group_mm);
  m.impl("int4_group_gemm", &int4_group_gemm);
  m.impl("int4_group_dequant", &int4_group_dequant);
}
