// y = x W^T for int4 weights (fp16 scale and offset per group, localllm's canonical int4) and for
// int8 weights (fp16 scale per group or per row, a GGUF's Q8_0) with the activations quantized to
// int8 per block of 32 inputs, as llama.cpp multiplies its Q4 / Q8 weights: the
// dot products of codes run in 8-bit integers (AVX-512 VNNI's vpdpbusd, 64 multiply-adds an
// instruction against 16 fp32 FMAs; AVX-VNNI's 256-bit vpdpbusd; AVX2's vpmaddubsw + vpmaddwd where
// there is no VNNI), which is what a batched step or a prefill is bound by on a CPU.
// Lossy in the activations (each rounded to 1/254 of its block's largest), so an opt-in kernel.
//
// Activations: per row and block b of 32 inputs, d = amax / 127, q = round(x * 127 / amax) in
// -127..127 (round half to even), and s = d * sum(q). Weight group g holds G / 32 such blocks.
//
// Output: for each row and output n, acc = 0, then for every block in order:
//   acc = fma(float(sum_k code[n,k] * q[k]), scale[n,g] * d, acc);   (the integer sum is exact)
//   acc = fma(offset[n,g], s, acc);                                   (int4 only)
// int8 weights may also have a scale per 16 inputs (G = 16, a GGUF's Q6_K): a block is then two
// terms, acc = fma(float(sum over its first 16 inputs), scale[n,2b] * d, acc), then its last 16's.
// One chain of fp32 operations a row, the same whatever the other rows of the call, so a sequence's
// result does not depend on its batch; every ISA's path (Isa below) gives the portable one's bits
// for finite activations:
// the integer sums are exact in each (vpmaddubsw's int16 pairs cannot saturate: int4 codes are at most
// 15, and int8 codes enter as |code| against the activation carrying the code's sign, 2 * 128 * 127).
//
// Layout (made at load by quant/kernels.py, Int4GroupCPU.pack: tile_mm.cpp reads the same):
// output rows in tiles of 16;
//   packed  uint8 (T, K/8, 64): dword j of octet o of tile t holds row 16t + j's codes of columns
//           8o .. 8o + 7, byte i being column 8o + i (low nibble) and 8o + 4 + i (high nibble), so a
//           mask or a shift and a mask give four columns' codes a byte, one dword a row: vpdpbusd's
//           unsigned operand, against four activations broadcast;
//   scales, offsets  fp16 (T, K/G, 16), as Int4GroupCPU's.
// int8 (Int8GroupCPU.pack; tile_mm.cpp reads it too): packed uint8 (T, K/4, 64): dword j of quad c
// holds row 16t + j's codes of columns 4c .. 4c + 3, each plus 128 (vpdpbusd's unsigned operand; the
// kernel takes 128 * sum(q) back off the integer sum of each 16 inputs, exactly); scales fp16
// (T, K/G, 16), G = K for a scale per row.
// Rows past N in the last tile are zeros and are not written. Tiles are split across threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define LOCALLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
// One body for AVX2 and AVX-VNNI (a template flag picks vpdpbusd or vpmaddubsw): the AVX2 instance
// holds no VNNI instruction (tests/test_q8_kernels.py runs both on a CPU that has both). Compilers before
// GCC 11 / clang 12 know no AVX-VNNI: they build the AVX2 path alone.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define LOCALLLM_HAS_AVX_VNNI 1
#define LOCALLLM_AVX2 __attribute__((target("avxvnni,avx2,fma,f16c")))
#else
#define LOCALLLM_HAS_AVX_VNNI 0
#define LOCALLLM_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#endif

namespace {

constexpr int64_t TILE = 16;
constexpr int64_t QB = 32;  // activations a quantization block
// Activation rows a pass over a tile (registers: AVX-512's 32 hold 8 codes and 8 sums; AVX2's 16, half).
constexpr int RMAX = 8;
constexpr int RMAX_AVX2 = 4;

// The instruction sets a path is written for, narrowest first.
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX_VNNI = 2, AVX512_VNNI = 3 };

// The widest path this CPU runs and this build allows: the library is built for torch's capability
// (ATEN_CPU_CAPABILITY, localllm/native.py), so an AVX2 build never takes the AVX-512 path even on a
// CPU that has it, and a portable build (capability "default") takes the portable one.
int64_t best_isa() {
#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
  static const int64_t isa = [] {
#if defined(CPU_CAPABILITY_AVX512)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      return int64_t{AVX512_VNNI};
#endif
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return int64_t{PORTABLE};
#if LOCALLLM_HAS_AVX_VNNI
    // CPUID leaf 7, sub-leaf 1, EAX bit 4: AVX-VNNI (clang before 18 knows no "avxvnni" for
    // __builtin_cpu_supports, and would fail the whole library on it).
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1)) return int64_t{AVX_VNNI};
#endif
    return int64_t{AVX2};
  }();
  return isa;
#else
  return PORTABLE;
#endif
}

// The activations, quantized: q (M, K) int8, d and s (M, K/32), and the integer sums of q over each
// half block (M, K/16).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

void quantize_block_portable(const float* x, int8_t* q, float* d, float* s, int32_t* qsum) {
  float amax = 0.f;
  for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t half[2] = {0, 0};
  for (int64_t i = 0; i < QB; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv));  // |v| <= 127 by construction
    q[i] = static_cast<int8_t>(v);
    half[i / 16] += v;
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(half[0] + half[1]);
  qsum[0] = half[0];
  qsum[1] = half[1];
}

#if defined(__x86_64__)
LOCALLLM_VNNI void quantize_block_vnni(const float* x, int8_t* q, float* d, float* s, int32_t* qsum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // cvtps rounds as MXCSR says: to nearest, ties to even, as nearbyint does.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  qsum[0] = _mm512_reduce_add_epi32(qa);
  qsum[1] = _mm512_reduce_add_epi32(qb);
  *d = amax / 127.f;
  *s = *d * static_cast<float>(qsum[0] + qsum[1]);
}

LOCALLLM_AVX2 void quantize_block_avx2(const float* x, int8_t* q, float* d, float* s, int32_t* qsum) {
  __m256 a[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    a[k] = _mm256_loadu_ps(x + 8 * k);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(a[k], inv));  // ties to even
  // packs interleave 128-bit lanes: dwords come out as 0,4 | 1,5 | 2,6 | 3,7 of the wanted order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // inputs 16h .. 16h + 15
    const __m256i t = _mm256_add_epi32(i[2 * h], i[2 * h + 1]);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    qsum[h] = _mm_cvtsi128_si32(t4);
  }
  *d = amax / 127.f;
  *s = *d * static_cast<float>(qsum[0] + qsum[1]);
}
#endif

Quantized quantize(const float* x, int64_t M, int64_t K, int64_t isa) {
  const int64_t nb = K / QB;
  Quantized out{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
                std::vector<int32_t>(M * nb * 2)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if defined(__x86_64__)
      if (isa == AVX512_VNNI) {
        quantize_block_vnni(x + i * QB, out.q.data() + i * QB, &out.d[i], &out.s[i], &out.sum[2 * i]);
        continue;
      }
      if (isa != PORTABLE) {
        quantize_block_avx2(x + i * QB, out.q.data() + i * QB, &out.d[i], &out.s[i], &out.sum[2 * i]);
        continue;
      }
#endif
      quantize_block_portable(x + i * QB, out.q.data() + i * QB, &out.d[i], &out.s[i], &out.sum[2 * i]);
    }
  });
  return out;
}

// One tile (16 outputs) by rows activation rows, the order of operations of the header, in scalars.
void tile_portable(const int8_t* q, const float* d, const float* s, int64_t rows, const uint8_t* w,
                   const c10::Half* sc, const c10::Half* of, int64_t K, int64_t G, float* y, int64_t ldy,
                   int64_t valid) {
  const int64_t nb = K / QB, per = G / QB;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < valid; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t g = b / per;
        int32_t isum = 0;
        for (int64_t o = 0; o < QB / 8; ++o) {
          const uint8_t* dw = w + ((b * 4 + o) * TILE + j) * 4;
          const int8_t* xq = q + r * K + b * QB + o * 8;
          for (int i = 0; i < 4; ++i) isum += (dw[i] & 0x0F) * xq[i] + (dw[i] >> 4) * xq[4 + i];
        }
        const float scale = static_cast<float>(sc[g * TILE + j]), offset = static_cast<float>(of[g * TILE + j]);
        acc = std::fma(static_cast<float>(isum), scale * d[r * nb + b], acc);
        acc = std::fma(offset, s[r * nb + b], acc);
      }
      y[r * ldy + j] = acc;
    }
}

#if defined(__x86_64__)
template <int R>
LOCALLLM_VNNI void tile_vnni(const int8_t* q, const float* d, const float* s, const uint8_t* w,
                             const c10::Half* sc, const c10::Half* of, int64_t K, int64_t G, float* y,
                             int64_t ldy, int64_t valid) {
  const int64_t nb = K / QB, per = G / QB;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / per;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * TILE)));
    const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(of + g * TILE)));
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      const __m512i v = _mm512_loadu_si512(w + (b * 4 + o) * 64);
      lo[o] = _mm512_and_si512(v, mask);
      hi[o] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(q + r * K + b * QB);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains; integer sums
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        s0 = _mm512_dpbusd_epi32(s0, lo[o], _mm512_set1_epi32(xr[2 * o]));
        s1 = _mm512_dpbusd_epi32(s1, hi[o], _mm512_set1_epi32(xr[2 * o + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(d[r * nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * nb + b]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

template <int R>
void tile_vnni_tail(int64_t rows, const int8_t* q, const float* d, const float* s, const uint8_t* w,
                    const c10::Half* sc, const c10::Half* of, int64_t K, int64_t G, float* y, int64_t ldy,
                    int64_t valid) {
  if constexpr (R > 0) {
    if (rows == R) tile_vnni<R>(q, d, s, w, sc, of, K, G, y, ldy, valid);
    else tile_vnni_tail<R - 1>(rows, q, d, s, w, sc, of, K, G, y, ldy, valid);
  }
}
#endif

// int8 weights: one tile by rows activation rows, in scalars.
void tile8_portable(const int8_t* q, const float* d, const int32_t* qsum, int64_t rows, const uint8_t* w,
                    const c10::Half* sc, int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  (void)qsum;  // the portable sum takes the codes as they are: no bias to take back
  const int64_t nb = K / QB;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < valid; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum[2] = {0, 0};  // inputs 0 .. 15 and 16 .. 31 of the block
        for (int64_t c = 0; c < QB / 4; ++c) {
          const uint8_t* dw = w + ((b * 8 + c) * TILE + j) * 4;
          const int8_t* xq = q + r * K + b * QB + c * 4;
          for (int i = 0; i < 4; ++i) isum[c / 4] += (static_cast<int32_t>(dw[i]) - 128) * xq[i];
        }
        if (G == 16) {
          for (int h = 0; h < 2; ++h)
            acc = std::fma(static_cast<float>(isum[h]), static_cast<float>(sc[(2 * b + h) * TILE + j]) * d[r * nb + b],
                           acc);
        } else {
          const float scale = static_cast<float>(sc[(b * QB / G) * TILE + j]);
          acc = std::fma(static_cast<float>(isum[0] + isum[1]), scale * d[r * nb + b], acc);
        }
      }
      y[r * ldy + j] = acc;
    }
}

#if defined(__x86_64__)
template <int R>
LOCALLLM_VNNI void tile8_vnni(const int8_t* q, const float* d, const int32_t* qsum, const uint8_t* w,
                              const c10::Half* sc, int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  const int64_t nb = K / QB;
  const bool halves = G == 16;  // a scale per 16 inputs: two terms a block
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const c10::Half* sb = sc + (halves ? 2 * b : b * QB / G) * TILE;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    __m512i wv[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(w + (b * 8 + c) * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(q + r * K + b * QB);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // inputs 0 .. 15, 16 .. 31
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(xr[c]));
        s1 = _mm512_dpbusd_epi32(s1, wv[c + 4], _mm512_set1_epi32(xr[c + 4]));
      }
      const int32_t* bias = qsum + (r * nb + b) * 2;  // each half's sum of q, times 128, comes back off
      const __m512 db = _mm512_set1_ps(d[r * nb + b]);
      if (halves) {
        const __m512 scale1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + TILE)));
        const __m512i i0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(128 * bias[0]));
        const __m512i i1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(128 * bias[1]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(scale, db), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(scale1, db), acc[r]);
        continue;
      }
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * (bias[0] + bias[1])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, db), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

template <int R>
void tile8_vnni_tail(int64_t rows, const int8_t* q, const float* d, const int32_t* qsum, const uint8_t* w,
                     const c10::Half* sc, int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  if constexpr (R > 0) {
    if (rows == R) tile8_vnni<R>(q, d, qsum, w, sc, K, G, y, ldy, valid);
    else tile8_vnni_tail<R - 1>(rows, q, d, qsum, w, sc, K, G, y, ldy, valid);
  }
}
#endif

#if defined(__x86_64__)
// AVX2 and AVX-VNNI: 256 bits hold 8 of a tile's 16 rows, so each half tile (rows 8h .. 8h + 7, the
// bytes 32h .. 32h + 31 of every 64) is a pass of its own; R activation rows at a time.

// acc + the four-byte dot products of u (unsigned) and x (signed) a dword, exactly: vpdpbusd, or
// vpmaddubsw's int16 pairs (no saturation for the operands given here, see the header) widened by vpmaddwd.
template <bool VNNI>
LOCALLLM_AVX2 inline __attribute__((always_inline)) __m256i dot4(__m256i acc, __m256i u, __m256i x) {
  static_assert(!VNNI || LOCALLLM_HAS_AVX_VNNI, "vpdpbusd needs a compiler that knows AVX-VNNI");
#if LOCALLLM_HAS_AVX_VNNI
  if constexpr (VNNI) return _mm256_dpbusd_avx_epi32(acc, u, x);
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

// Stores the first n (1 .. 8) of v's floats.
LOCALLLM_AVX2 inline __attribute__((always_inline)) void store_first(float* y, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lanes), v);
}

template <int R, bool VNNI>
LOCALLLM_AVX2 void tile_avx2(const int8_t* q, const float* d, const float* s, const uint8_t* w,
                             const c10::Half* sc, const c10::Half* of, int64_t K, int64_t G, float* y,
                             int64_t ldy, int64_t valid) {
  const int64_t nb = K / QB, per = G / QB;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t h = 0; h < 2 && 8 * h < valid; ++h) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b / per;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * TILE + 8 * h)));
      const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(of + g * TILE + 8 * h)));
      __m256i lo[4], hi[4];
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + o) * 64 + 32 * h));
        lo[o] = _mm256_and_si256(v, mask);
        hi[o] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(q + r * K + b * QB);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int o = 0; o < 4; ++o) {
          s0 = dot4<VNNI>(s0, lo[o], _mm256_set1_epi32(xr[2 * o]));
          s1 = dot4<VNNI>(s1, hi[o], _mm256_set1_epi32(xr[2 * o + 1]));
        }
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(d[r * nb + b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * nb + b]), acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_first(y + r * ldy + 8 * h, acc[r], valid - 8 * h);
  }
}

template <int R, bool VNNI>
LOCALLLM_AVX2 void tile8_avx2(const int8_t* q, const float* d, const int32_t* qsum, const uint8_t* w,
                              const c10::Half* sc, int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  const int64_t nb = K / QB;
  const bool halves = G == 16;  // a scale per 16 inputs: two terms a block
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t h = 0; h < 2 && 8 * h < valid; ++h) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const c10::Half* sb = sc + (halves ? 2 * b : b * QB / G) * TILE + 8 * h;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
      const uint8_t* wb = w + b * 8 * 64 + 32 * h;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(q + r * K + b * QB);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // inputs 0 .. 15, 16 .. 31
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));  // codes + 128
          const __m256i x = _mm256_set1_epi32(xr[c]);
          __m256i& acc_c = c < 4 ? s0 : s1;
          if constexpr (VNNI) {
            acc_c = dot4<true>(acc_c, v, x);
          } else {  // |code| by the activation with the code's sign: vpmaddubsw's pairs stay within int16
            const __m256i code = _mm256_xor_si256(v, bias);
            acc_c = dot4<false>(acc_c, _mm256_abs_epi8(code), _mm256_sign_epi8(x, code));
          }
        }
        const int32_t* half = qsum + (r * nb + b) * 2;  // VNNI: each half's sum of q, times 128, comes back off
        const __m256 db = _mm256_set1_ps(d[r * nb + b]);
        if (halves) {
          if constexpr (VNNI) {
            s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(128 * half[0]));
            s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(128 * half[1]));
          }
          const __m256 scale1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + TILE)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(scale, db), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(scale1, db), acc[r]);
          continue;
        }
        __m256i isum = _mm256_add_epi32(s0, s1);
        if constexpr (VNNI) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * (half[0] + half[1])));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scale, db), acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_first(y + r * ldy + 8 * h, acc[r], valid - 8 * h);
  }
}

// One pass of rows (1 .. RMAX_AVX2) over a tile: int4 (of given) or int8.
template <bool VNNI, int R = RMAX_AVX2>
void tile_avx2_rows(int64_t rows, const int8_t* q, const float* d, const float* s, const int32_t* qsum,
                    const uint8_t* w, const c10::Half* sc, const c10::Half* of, int64_t K, int64_t G, float* y,
                    int64_t ldy, int64_t valid) {
  if constexpr (R > 0) {
    if (rows != R) return tile_avx2_rows<VNNI, R - 1>(rows, q, d, s, qsum, w, sc, of, K, G, y, ldy, valid);
    if (of != nullptr) tile_avx2<R, VNNI>(q, d, s, w, sc, of, K, G, y, ldy, valid);
    else tile8_avx2<R, VNNI>(q, d, qsum, w, sc, K, G, y, ldy, valid);
  }
}
#endif

// y (M, N) = the quantized rows by the tiles of w: int4 (offsets given) or int8 (of null).
void mm(const Quantized& xq, int64_t M, const uint8_t* w, const c10::Half* sc, const c10::Half* of, int64_t K,
        int64_t G, int64_t N, float* y, int64_t isa) {
  const int64_t T = (N + TILE - 1) / TILE, ng = K / G, nb = K / QB;
  const int64_t tile_bytes = of != nullptr ? K / 2 * TILE : K * TILE;
  const int64_t rmax = isa == AVX512_VNNI ? RMAX : RMAX_AVX2;
  const int64_t groups = (M + rmax - 1) / rmax;  // rows in passes of equal size, at most rmax
  // Enough tiles a task that a thread's share is worth waking it: ~64K weights.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (TILE * K));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * tile_bytes;
      const c10::Half* st = sc + t * ng * TILE;
      const c10::Half* ot = of != nullptr ? of + t * ng * TILE : nullptr;
      const int64_t valid = std::min(TILE, N - t * TILE);
      int64_t m = 0;
      for (int64_t p = 0; p < groups; ++p) {
        const int64_t rows = M / groups + (p < M % groups);
        const int8_t* q = xq.q.data() + m * K;
        const float* d = xq.d.data() + m * nb;
        const float* s = xq.s.data() + m * nb;
        const int32_t* qs = xq.sum.data() + m * nb * 2;
        float* yt = y + m * N + t * TILE;
        m += rows;
#if defined(__x86_64__)
        if (isa == AVX512_VNNI) {
          if (ot != nullptr) tile_vnni_tail<RMAX>(rows, q, d, s, wt, st, ot, K, G, yt, N, valid);
          else tile8_vnni_tail<RMAX>(rows, q, d, qs, wt, st, K, G, yt, N, valid);
          continue;
        }
        if (isa != PORTABLE) {
#if LOCALLLM_HAS_AVX_VNNI
          if (isa == AVX_VNNI) tile_avx2_rows<true>(rows, q, d, s, qs, wt, st, ot, K, G, yt, N, valid);
          else
#endif
            tile_avx2_rows<false>(rows, q, d, s, qs, wt, st, ot, K, G, yt, N, valid);
          continue;
        }
#endif
        if (ot != nullptr) tile_portable(q, d, s, rows, wt, st, ot, K, G, yt, N, valid);
        else tile8_portable(q, d, qs, rows, wt, st, K, G, yt, N, valid);
      }
    }
  });
}

void check_scales(const at::Tensor& t, int64_t T, int64_t groups, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.dim() == 3 && t.size(0) == T && t.size(1) == groups &&
                  t.size(2) == TILE && t.is_contiguous(),
              op, ": scales (and offsets) must be contiguous float16 (tiles, K/group, 16)");
}

// x (M, K) by packed weights of K columns a tile; offsets undefined for int8.
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t K, const at::Tensor& scales,
               const at::Tensor* offsets, int64_t group, int64_t N, int64_t isa, const char* op) {
  const int64_t T = packed.size(0);
  const bool per16 = group == 16 && offsets == nullptr;  // int8 only: a GGUF's Q6_K
  TORCH_CHECK((per16 || (group > 0 && group % QB == 0)) && K % QB == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 32 (or 16, for int8) that divides the width ", K, " (a multiple of 32)");
  TORCH_CHECK(N > (T - 1) * TILE && N <= T * TILE, op, ": ", N, " rows do not fill ", T, " tiles of 16");
  TORCH_CHECK(packed.is_contiguous(), op, ": packed must be contiguous");
  check_scales(scales, T, K / group, op);
  if (offsets != nullptr) check_scales(*offsets, T, K / group, op);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be (M, ", K, ")");
  TORCH_CHECK(isa >= PORTABLE && isa <= best_isa(), op, ": path ", isa, " is not one this CPU and build run (0 .. ",
              best_isa(), ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const Quantized xq = quantize(xf.data_ptr<float>(), M, K, isa);
    mm(xq, M, packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(),
       offsets != nullptr ? offsets->data_ptr<c10::Half>() : nullptr, K, group, N, y.data_ptr<float>(), isa);
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor run4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
                int64_t group, int64_t N, int64_t isa, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 4 * TILE && packed.scalar_type() == at::kByte,
              op, ": packed must be uint8 (tiles, K/8, 64)");
  return run(x, packed, packed.size(1) * 8, scales, &offsets, group, N, isa, op);
}

at::Tensor run8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group, int64_t N,
                int64_t isa, const char* op) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 4 * TILE && packed.scalar_type() == at::kByte,
              op, ": packed must be uint8 (tiles, K/4, 64)");
  return run(x, packed, packed.size(1) * 4, scales, nullptr, group, N, isa, op);
}

at::Tensor int4_q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group, int64_t N) {
  return run4(x, packed, scales, offsets, group, N, best_isa(), "int4_q8_mm");
}

// The same products through a named path (an Isa up to best_isa()): the tests hold each path to the
// portable one bit for bit.
at::Tensor int4_q8_mm_isa(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& offsets, int64_t group, int64_t N, int64_t isa) {
  return run4(x, packed, scales, offsets, group, N, isa, "int4_q8_mm_isa");
}

// int8 weights; group: inputs a scale (the width for a scale per row).
at::Tensor int8_q8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                      int64_t N) {
  return run8(x, packed, scales, group, N, best_isa(), "int8_q8_mm");
}

at::Tensor int8_q8_mm_isa(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t group, int64_t N, int64_t isa) {
  return run8(x, packed, scales, group, N, isa, "int8_q8_mm_isa");
}

int64_t q8_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("int4_q8_mm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int4_q8_mm_isa(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features, int isa) -> Tensor");
  m.def("int8_q8_mm(Tensor x, Tensor packed, Tensor scales, int group, int out_features) -> Tensor");
  m.def("int8_q8_mm_isa(Tensor x, Tensor packed, Tensor scales, int group, int out_features, int isa) -> Tensor");
  m.def("q8_isa() -> int", &q8_isa);
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int4_q8_mm", &int4_q8_mm);
  m.impl("int4_q8_mm_isa", &int4_q8_mm_isa);
  m.impl("int8_q8_mm", &int8_q8_mm);
  m.impl("int8_q8_mm_isa", &int8_q8_mm_isa);
}
