// The exact tile kernels: y = x W^T with the exact weights and fp32 accumulation, for int4 weights
// with an fp16 scale and offset per group of input columns (localllm's canonical int4: w = q * scale +
// offset, q in 0..15), int5 (a GGUF's Q5_0), int4 and int6 with a GGUF's Q4_K and Q6_K scales, and int8
// with an fp16 scale per group or per row (a GGUF's Q8_0; per-channel int8), each in output tiles of 16
// rows.
//
// torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) takes bf16 activations and bf16 scales: the
// activations' rounding alone moved SmolLM2's predictions by a KL divergence of 1e-3 from the file's
// own weights in fp32. These kernels multiply the exact weights by fp32 activations (int8 codes, and
// every panel), or, in the decode kernels of 4-, 5- and 6-bit codes where the ISA has vpmaddwd, by the
// activations rounded to int16 steps of 2^-16 of their 32 columns' largest (see tile_rows_q16), a
// rounding thousands of times finer than that of the int8 activations of llama.cpp.
//
// Layout (made at load by quant/kernels.py, Int4GroupCPU.prepare; the int8-activation kernel of
// q8_mm.cpp reads the same): output rows in tiles of 16, columns in octets of 8.
//   packed  uint8 (T, K/8, 64): dword j of octet c holds row 16t + j's codes of columns 8c + i (low
//           nibble of byte i) and 8c + 4 + i (high nibble), i < 4;
//   scales, offsets  fp16 (T, K/G, 16): row 16t + j's scale and offset of group g.
// An octet's 64 bytes are one load on AVX-512, two on AVX2, and each lane of a vector is an output
// row: a column's codes are a shift and a mask of the lanes away from int32, with no byte shuffles
// (a decode step's product is bound by decoding the codes, not by reading them), the activations are
// broadcast, no horizontal sum is ever needed, and a group's dot product q . x (exact codes, fp32
// FMAs) is scaled once and its offset added as offset * (sum of the group's activations).
// Rows past N in the last tile are zero codes, zero scales and zero offsets, and are not written.
//
// int5 (a GGUF's Q5_0 blocks exactly: w = (q - 16) * d, q in 0..31, d fp16 per 32 columns) is the same
// product with a fifth bit a code: packed holds q's low nibbles as above, and
//   fifth   uint8 (Weights.top) (T, K/32, 64): dword j of group g holds row 16t + j's fifth bits, that of column
//           8c + i (octet c of the group) at bit c + (the bit where column i's nibble starts: 8i, or
//           8(i - 4) + 4 for i >= 4), so that one shift and mask of the dword put an octet's fifth bits
//           beside its nibbles, as bytes;
//   scales  fp16 (T, K/32, 16): d; the offset is -16 d, exact in fp32, made in registers.
//
// int4 with a GGUF's Q4_K scales (w = d sc q - dmin m: sc and m 6-bit a sub-block of 32 columns, d and
// dmin fp16 a super-block of 256; each product exact in fp32, so the weight is rounded once, as gguf
// computes it) is int4's product with those scales made in registers, in 148 bytes a 256 weights (the
// blocks' 144: sc and m take a byte each):
//   packed  as int4's, of the codes;
//   mins    uint8 (T, K/32, 32): row 16t + j's sc of sub-block g at [t, g, j], its m at [t, g, 16 + j];
//   supers  fp16 (T, K/256, 32): d at [t, s, j], dmin at [t, s, 16 + j].
// The blocks' own layout takes a row at a time and byte shuffles to spread each sub-block's codes.
//
// int6 with a GGUF's Q6_K scales (w = d sc (q - 32): q in 0..63, sc int8 a sub-block of 16 columns, d
// fp16 a super-block of 256; d sc exact in fp32) is int5's product with two top bits a code and those
// scales made in registers, in the blocks' 210 bytes a 256 weights:
//   packed  as int4's, of the codes' low nibbles;
//   top     uint8 (T, K/16, 64): dword j of sub-block g holds row 16t + j's top two bits, those of
//           column 8c + i (octet c < 2 of the sub-block) at bits 2c and 2c + 1 from where column i's
//           nibble starts (as int5's fifth bits, two a column);
//   mins    int8 (T, K/16, 16): sc (the Int4K buffer's place: Weights.per = 1);
//   supers  fp16 (T, K/256, 16): d.
//
// int8 (w = q * scale: exact in fp32, 8 + 11 significant bits; no offsets) is read in the layout of
// the int8-activation kernel of q8_mm.cpp (made by Int8GroupCPU.pack), columns in quads of 4:
//   packed  uint8 (T, K/4, 64): dword j of quad c holds row 16t + j's codes of columns 4c + i (byte i),
//           each plus 128 (what vpmaddubsw takes); a column's signed codes are an xor and two shifts;
//   scales  fp16 (T, K/G, 16), or (T, 1, 16): one a row (the groups G then only where partial sums are
//           scaled: the same scale each time).
// A row-major int8 kernel widened each group of a row with byte shuffles and summed it across lanes;
// in tiles, one activation row streams through the weights as the int4 one does, with fewer
// instructions a weight and one stream a thread (a large-vocabulary head is read from memory).
//
// Decode (one activation row) keeps four accumulators a row for int4 and int5 (column k of a group goes
// to k % 4) so consecutive FMAs do not wait on each other, two for int8 (two vectors a column: enough
// chains), and a few rows share each decoded column (MC at a time). int8 takes two for every number of
// rows, so that a row's value does not depend on the rows beside it (a head's logits: the same in a
// verify step as in a decode step). Tiles are split across threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "panel_gemm.h"
#include "parallel_rows.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
constexpr int64_t TILE = 16;       // output rows a tile (one dword each in an octet's 64 bytes)
constexpr int64_t OCTET = 8;       // columns a dword (int4, int5)
constexpr int64_t QUAD = 4;        // columns a dword (int8)
constexpr int64_t OCTET_BYTES = 4 * TILE;  // a dword a row: an octet's (a quad's) bytes
constexpr int NV = TILE / VS;      // vectors a tile's column: 1 (AVX-512), 2 (AVX2 and the portable code)
static_assert(TILE % VS == 0, "a tile must be whole vectors");
#ifndef PREFETCH
#define PREFETCH 2048
#endif
// Weights are prefetched with prefetcht0, never non-temporally: where the L3 holds a model's weights
// (a 300 MB server L3, a large desktop one), non-temporal lines left it, and each decode step read
// them from memory again (SmolLM2 and Gemma 3 decoding 20-45% slower; README).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t MC = 4;  // activation rows sharing a decoded column (32 registers)
#else
constexpr int64_t MC = 2;  // (16 registers)
#endif

// The codes a tile holds; a kernel function is compiled for each. Int4K: int4 with Q4_K's scales;
// Int6K: Q6_K's 6-bit codes and scales.
enum class Codes { Int4, Int5, Int8, Int4K, Int6K };
constexpr int64_t SUPER = 256;  // Q4_K's super-block: 8 groups of 32

// Columns a dword holds.
template <Codes KIND>
constexpr int64_t cols_of() {
  return KIND == Codes::Int8 ? QUAD : OCTET;
}

// The bit at which column C (0..7) of an octet starts in its dword.
template <int C>
constexpr int shift_of() {
  return C < 4 ? 8 * C : 8 * (C - 4) + 4;
}

// An octet of 16 rows (64 bytes), loaded once; col<C>() gives column C's 16 codes as fp32 vectors.
struct Octet {
#if defined(CPU_CAPABILITY_AVX512)
  __m512i v;
  explicit Octet(const uint8_t* p) : v(_mm512_loadu_si512(p)) {}
  template <int C>
  void col(Vec* out) const {
    out[0] = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift_of<C>()), _mm512_set1_epi32(15))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i v[2];
  explicit Octet(const uint8_t* p)
      : v{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))} {}
  template <int C>
  void col(Vec* out) const {
    const __m256i m = _mm256_set1_epi32(15);
    out[0] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[0], shift_of<C>()), m)));
    out[1] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[1], shift_of<C>()), m)));
  }
#else
  uint32_t d[TILE];
  explicit Octet(const uint8_t* p) { std::memcpy(d, p, sizeof(d)); }
  template <int C>
  void col(Vec* out) const {
    alignas(64) float f[TILE];
    for (int j = 0; j < TILE; ++j) f[j] = static_cast<float>((d[j] >> shift_of<C>()) & 15u);
    for (int v = 0; v < NV; ++v) out[v] = Vec::loadu(f + v * VS);
  }
#endif
};

// fn(std::integral_constant<int, C>) for C = 0 .. N - 1, unrolled (each column's shift is a constant).
template <class F, int... C>
inline void each_column(const F& fn, std::integer_sequence<int, C...>) {
  (fn(std::integral_constant<int, C>{}), ...);
}
template <int N, class F>
inline void each_column(const F& fn) {
  each_column(fn, std::make_integer_sequence<int, N>{});
}

// 16 uint8 (or int8) values -> fp32 vectors.
template <class T>
inline void bytes16(const T* p, Vec* out) {
  static_assert(sizeof(T) == 1, "bytes");
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  out[0] = Vec(_mm512_cvtepi32_ps(std::is_signed_v<T> ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  for (int k = 0; k < 2; ++k) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * k));
    out[k] = Vec(_mm256_cvtepi32_ps(std::is_signed_v<T> ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)));
  }
#else
  alignas(64) float f[TILE];
  for (int j = 0; j < TILE; ++j) f[j] = static_cast<float>(p[j]);
  for (int v = 0; v < NV; ++v) out[v] = Vec::loadu(f + v * VS);
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

// Integer vectors of dwords, a vector of rows (the top-bit codes and the int16 decode kernels).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
inline IVec ivec_zero() { return _mm512_setzero_si512(); }
inline IVec ivec_set(int32_t v) { return _mm512_set1_epi32(v); }
inline IVec ivec_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec ivec_and(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec ivec_or(IVec a, IVec b) { return _mm512_or_si512(a, b); }
template <int S>
inline IVec ivec_srl(IVec a) { return S == 0 ? a : _mm512_srli_epi32(a, S); }
inline IVec ivec_sll_n(IVec a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline IVec ivec_srl_n(IVec a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline IVec ivec_madd_add(IVec acc, IVec codes, IVec x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(codes, x)); }
inline Vec ivec_float(IVec a) { return Vec(_mm512_cvtepi32_ps(a)); }
#else
using IVec = __m256i;
inline IVec ivec_zero() { return _mm256_setzero_si256(); }
inline IVec ivec_set(int32_t v) { return _mm256_set1_epi32(v); }
inline IVec ivec_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec ivec_and(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec ivec_or(IVec a, IVec b) { return _mm256_or_si256(a, b); }
template <int S>
inline IVec ivec_srl(IVec a) { return S == 0 ? a : _mm256_srli_epi32(a, S); }
inline IVec ivec_sll_n(IVec a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline IVec ivec_srl_n(IVec a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline IVec ivec_madd_add(IVec acc, IVec codes, IVec x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(codes, x)); }
inline Vec ivec_float(IVec a) { return Vec(_mm256_cvtepi32_ps(a)); }
#endif
constexpr int64_t IVS = sizeof(IVec) / 4;  // rows a vector (dwords)
#endif

// An octet of 4 + BITS-bit codes: its nibbles (64 bytes) and a plane of their top bits (64 bytes: a
// dword a row for 32 / BITS columns), as two words a row of four codes a byte (columns 0-3 and 4-7);
// col<C>() gives column C's 16 codes as fp32. int5 (BITS 1): the fifth bit of octet c's column i
// (c < 4) at bit c + (where column i's nibble starts: shift_of); int6 (BITS 2): the top two of octet
// c's (c < 2) at bits 2c and 2c + 1 from there. A shift and a mask put an octet's top bits beside its
// nibbles, as bytes.
template <int BITS>
struct OctetHi {
  static constexpr int32_t TOP = ((1 << BITS) - 1) * 0x10101010;  // the top bits' place in each byte
  static constexpr int32_t MASK = (16 << BITS) - 1;               // a code
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  IVec lo[NV], hi[NV];  // bytes: the codes of columns 0-3, and of 4-7, of vector k's rows
  OctetHi(const uint8_t* p, const uint8_t* top, int c) { join(p, top, c, lo, hi); }
  // The octet's nibbles p beside octet c's top bits from the plane, as bytes (Pairs reads them too).
  static void join(const uint8_t* p, const uint8_t* top, int c, IVec* lo, IVec* hi) {
    const IVec m4 = ivec_set(0x0F0F0F0F), mt = ivec_set(TOP);
    for (int k = 0; k < NV; ++k) {
      const IVec v = ivec_load(p + k * 4 * IVS), f = ivec_load(top + k * 4 * IVS);
      lo[k] = ivec_or(ivec_and(v, m4), ivec_and(ivec_sll_n(f, 4 - BITS * c), mt));
      hi[k] = ivec_or(ivec_and(ivec_srl<4>(v), m4), ivec_and(ivec_srl_n(f, BITS * c), mt));
    }
  }
  template <int C>
  void col(Vec* out) const {
    for (int k = 0; k < NV; ++k) {
      const IVec w = ivec_srl<8 * (C % 4)>(C < 4 ? lo[k] : hi[k]);
      out[k] = ivec_float(C % 4 == 3 ? w : ivec_and(w, ivec_set(MASK)));
    }
  }
#else
  uint32_t d[TILE], f[TILE];
  int c;
  OctetHi(const uint8_t* p, const uint8_t* top, int c) : c(c) {
    std::memcpy(d, p, sizeof(d));
    std::memcpy(f, top, sizeof(f));
  }
  template <int C>
  void col(Vec* out) const {
    alignas(64) float v[TILE];
    for (int j = 0; j < TILE; ++j)
      v[j] = static_cast<float>(((d[j] >> shift_of<C>()) & 15u) |
                                (((f[j] >> (shift_of<C>() + BITS * c)) & ((1u << BITS) - 1)) << 4));
    for (int k = 0; k < NV; ++k) out[k] = Vec::loadu(v + k * VS);
  }
#endif
};

// A quad of int8 codes for 16 rows (64 bytes, each code plus 128), loaded once and made signed (an
// xor); col<C>() gives column C's 16 codes (-128..127) as fp32: byte C of each lane, moved to the top
// and shifted down with its sign.
struct Quad8 {
#if defined(CPU_CAPABILITY_AVX512)
  __m512i v;
  explicit Quad8(const uint8_t* p)
      : v(_mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0x80808080u)))) {}
  template <int C>
  void col(Vec* out) const {
    const __m512i w = C == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * C);
    out[0] = Vec(_mm512_cvtepi32_ps(_mm512_srai_epi32(w, 24)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i v[2];
  explicit Quad8(const uint8_t* p) {
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80808080u));
    v[0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), sign);
    v[1] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), sign);
  }
  template <int C>
  void col(Vec* out) const {
    for (int k = 0; k < 2; ++k) {
      const __m256i w = C == 3 ? v[k] : _mm256_slli_epi32(v[k], 24 - 8 * C);
      out[k] = Vec(_mm256_cvtepi32_ps(_mm256_srai_epi32(w, 24)));
    }
  }
#else
  uint32_t d[TILE];
  explicit Quad8(const uint8_t* p) { std::memcpy(d, p, sizeof(d)); }
  template <int C>
  void col(Vec* out) const {
    alignas(64) float f[TILE];
    for (int j = 0; j < TILE; ++j) f[j] = static_cast<float>(static_cast<int>((d[j] >> (8 * C)) & 0xFFu) - 128);
    for (int k = 0; k < NV; ++k) out[k] = Vec::loadu(f + k * VS);
  }
#endif
};

// A tile's weights: int4 (top null), int5 (offsets null: -16 * scale), int8 (both null), Int4K (s and
// o null: mins and supers) or Int6K (top, mins and supers).
struct TileWeights {
  const uint8_t* w;      // (K/8, 64) nibbles, or (K/4, 64) int8 codes
  const uint8_t* top;    // (K/G, 64) the codes' top bits (int5's fifth: G = 32; Int6K's two: G = 16), or null
  const c10::Half* s;    // (K/G, 16), or (1, 16): one scale a row
  const c10::Half* o;    // (K/G, 16), or null
  int64_t sstep;         // s's step a group: 16, or 0 for one scale a row
  const uint8_t* mins = nullptr;       // Int4K: (K/32, 32) sc, m; Int6K: (K/16, 16) int8 sc
  const c10::Half* supers = nullptr;   // Int4K: (K/256, 32) d, dmin; Int6K: (K/256, 16) d
  bool zero_points = false;            // int4: o holds -z, an integer zero point, and the offset is -z * s
};

// A layer's weights (all tiles) and tile t's.
struct Weights {
  const uint8_t* w;
  const uint8_t* top;
  const c10::Half* s;
  const c10::Half* o;
  int64_t K, G;
  int64_t cols = OCTET;  // columns a dword
  int64_t ns = 0;        // scales a row: K / G (0: that), or 1
  const uint8_t* mins = nullptr;
  const c10::Half* supers = nullptr;
  int64_t per = 2;       // values a row of mins a group and of supers a super-block: 2 (Int4K), 1 (Int6K)
  bool zero_points = false;
  TileWeights tile(int64_t t) const {
    const int64_t ng = K / G, nsc = ns == 0 ? ng : ns;
    return {w + t * (K / cols) * OCTET_BYTES,
            top ? top + t * ng * OCTET_BYTES : nullptr,
            s ? s + t * nsc * TILE : nullptr,
            o ? o + t * ng * TILE : nullptr,
            nsc == 1 ? 0 : TILE,
            mins ? mins + t * ng * per * TILE : nullptr,
            supers ? supers + t * (K / SUPER) * per * TILE : nullptr,
            zero_points};
  }
};

// Group g's scales and offsets (int8: scales only), fp32.
template <Codes KIND>
inline void scales_offsets(const TileWeights& t, int64_t g, Vec* sc, Vec* of) {
  if constexpr (KIND == Codes::Int4K) {  // d sc and -dmin m, exact in fp32 (11 + 6 significant bits)
    Vec d[NV], dmin[NV];
    const c10::Half* sup = t.supers + (g * 32 / SUPER) * 2 * TILE;  // G = 32
    halves(sup, d);
    halves(sup + TILE, dmin);
    bytes16(t.mins + g * 2 * TILE, sc);
    bytes16(t.mins + g * 2 * TILE + TILE, of);
    for (int v = 0; v < NV; ++v) {
      sc[v] = sc[v] * d[v];
      of[v] = of[v] * dmin[v] * Vec(-1.f);
    }
    return;
  }
  if constexpr (KIND == Codes::Int6K) {  // d sc and -32 d sc, exact in fp32 (11 + 7 significant bits)
    Vec d[NV];
    halves(t.supers + (g * 16 / SUPER) * TILE, d);  // G = 16
    bytes16(reinterpret_cast<const int8_t*>(t.mins) + g * TILE, sc);
    for (int v = 0; v < NV; ++v) {
      sc[v] = sc[v] * d[v];
      of[v] = sc[v] * Vec(-32.f);
    }
    return;
  }
  halves(t.s + g * t.sstep, sc);
  if constexpr (KIND == Codes::Int4) {
    halves(t.o + g * TILE, of);
    if (t.zero_points)  // -z * s: 4 + 11 significant bits, exact in fp32 (not always in fp16)
      for (int v = 0; v < NV; ++v) of[v] = of[v] * sc[v];
  } else if constexpr (KIND == Codes::Int5) {
    for (int v = 0; v < NV; ++v) of[v] = sc[v] * Vec(-16.f);
  }
}

// The top bits a code of a kind has past its nibble.
template <Codes KIND>
constexpr int top_bits() {
  return KIND == Codes::Int5 ? 1 : KIND == Codes::Int6K ? 2 : 0;
}

// fn(codes) for octet (int8: quad) c of group g: an Octet, an OctetHi or a Quad8.
template <Codes KIND, class F>
inline void with_octet(const TileWeights& t, int64_t G, int64_t g, int64_t c, const F& fn) {
  const uint8_t* p = t.w + (g * (G / cols_of<KIND>()) + c) * OCTET_BYTES;
  if constexpr (top_bits<KIND>() > 0) {
    fn(OctetHi<top_bits<KIND>()>(p, t.top + g * OCTET_BYTES, static_cast<int>(c)));
  } else if constexpr (KIND == Codes::Int8) {
    fn(Quad8(p));
  } else {
    fn(Octet(p));
  }
}


// Group g's scales, offsets and top bits a few tiles ahead (a cache line holds two groups' scales).
template <Codes KIND>
inline void prefetch_scales(const TileWeights& t, int64_t g) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (g % 2 == 0) {
    if (KIND == Codes::Int4K || KIND == Codes::Int6K) {
      _mm_prefetch(reinterpret_cast<const char*>(t.mins + g * (KIND == Codes::Int4K ? 2 : 1) * TILE) + PREFETCH / 4,
                   _MM_HINT_T0);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(t.s + g * t.sstep) + PREFETCH / 4, _MM_HINT_T0);
      if (t.o != nullptr) _mm_prefetch(reinterpret_cast<const char*>(t.o + g * TILE) + PREFETCH / 4, _MM_HINT_T0);
    }
  }
  if (top_bits<KIND>() > 0)
    _mm_prefetch(reinterpret_cast<const char*>(t.top + g * OCTET_BYTES) + PREFETCH / 4, _MM_HINT_T0);
#endif
}

// One tile (16 output rows) for R activation rows; A accumulators a row within a group (A divides the
// columns of a dword: column k of a group goes to accumulator k % A).
//   x (R, K) rows ldx apart; xsum (R, K/G) rows ng apart (int8: unused); y: R rows ldy apart, 16
//   columns of which ``valid`` are written.
template <int R, int A, Codes KIND>
void tile_rows(const float* x, int64_t ldx, const float* xsum, const TileWeights& t, int64_t K, int64_t G,
               float* y, int64_t ldy, int64_t valid) {
  constexpr int COLS = cols_of<KIND>();
  static_assert(COLS % A == 0, "a dword's columns must cycle through the accumulators");
  const int64_t ng = K / G, octets = G / COLS;
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
    const float* xg = x + g * G;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    prefetch_scales<KIND>(t, g);
#endif
    for (int64_t c = 0; c < octets; ++c) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      _mm_prefetch(reinterpret_cast<const char*>(t.w + (g * octets + c) * OCTET_BYTES + PREFETCH), _MM_HINT_T0);
#endif
      const float* xc = xg + c * COLS;
      with_octet<KIND>(t, G, g, c, [&](const auto& q) {
        each_column<COLS>([&](auto col) {
          constexpr int C = decltype(col)::value;
          Vec code[NV];
          q.template col<C>(code);
          for (int r = 0; r < R; ++r) {
            const Vec xv(xc[r * ldx + C]);
            for (int v = 0; v < NV; ++v)
              dot[(r * A + C % A) * NV + v] = at::vec::fmadd(code[v], xv, dot[(r * A + C % A) * NV + v]);
          }
        });
      });
    }
    Vec sc[NV], of[NV];
    scales_offsets<KIND>(t, g, sc, of);
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NV; ++v) {
        Vec d = dot[r * A * NV + v];
        for (int a = 1; a < A; ++a) d = d + dot[(r * A + a) * NV + v];
        if constexpr (KIND == Codes::Int8) {
          tot[r][v] = at::vec::fmadd(d, sc[v], tot[r][v]);
        } else {
          tot[r][v] = at::vec::fmadd(of[v], Vec(xsum[r * ng + g]), at::vec::fmadd(d, sc[v], tot[r][v]));
        }
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

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The decode kernels' activations in 16-bit integers (int4, int5, Int4K and Int6K codes; where the
// vector ISA has vpmaddwd): each 32 columns of a row x as s * q, q = round(x / s) in -32767..32767, s = max |x| /
// 32767, so each activation is within s / 2 = 2^-16 of its 32 columns' largest (256 times finer than
// the int8 activations of llama.cpp and of --kernel int4-q8-cpu, and finer than fp16's rounding of the
// largest). The codes times q are exact integers (vpmaddwd: two 16-bit products a 32-bit lane, summed
// without rounding over the 32 columns), scaled once by s in fp32: half the instructions a weight of
// the fp32 product (a shift, a mask and a multiply-add for two codes of a row, where fp32 takes a
// shift, a mask, a conversion and an FMA for each), which bound the product of weights in cache.
// The weights stay exact, and the offsets multiply the fp32 sums of x. Many rows (the panel GEMM)
// stay fp32. A non-finite activation makes its 32 columns' scale NaN, so the output is NaN as fp32's.
constexpr int64_t XQ = 32;  // columns an activation scale covers
constexpr float XQ_MAX = 32767.f;

// An octet's codes pair up as 16-bit halves of a row's dword: pair P (P < 4) holds columns
// PAIR_ORDER[2P] (low half) and PAIR_ORDER[2P + 1] (high half); an octet's activations are stored in
// that order.
constexpr int PAIR_ORDER[OCTET] = {0, 2, 4, 6, 1, 3, 5, 7};

// Rows (M, K) of fp32 activations -> q (M, K) int16, each octet in PAIR_ORDER; s (M, K/32). Each 32
// columns: their largest magnitude and whether any is inf or NaN (x * 0 is then NaN, else +-0), then
// round(x * 32767 / max) in vectors (the current rounding mode: to nearest even, as nearbyint); a
// poisoned or all-zero chunk's codes are 0 (x * 0, its NaNs made 0).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* s) {
  constexpr int64_t NX = XQ / VS;  // vectors a chunk
  const auto ordered = [](const Vec& a) {  // a's lanes non-NaN as they are, NaN ones 0
    return Vec::blendv(Vec(0.f), a, a == a);
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += XQ) {
      const float* xc = x + m * K + k0;
      Vec v[NX], amax(0.f), poison(0.f);
      for (int64_t i = 0; i < NX; ++i) {
        v[i] = Vec::loadu(xc + i * VS);
        amax = at::vec::maximum(amax, v[i].abs());
        poison = poison + v[i] * Vec(0.f);
      }
      const float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, amax);
      const float bad = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, poison);
      s[m * (K / XQ) + k0 / XQ] = mx / XQ_MAX + bad;
      const Vec inv(mx > 0.f && bad == 0.f ? XQ_MAX / mx : 0.f);
      int16_t* qc = q + m * K + k0;
#if defined(CPU_CAPABILITY_AVX512)
      const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
      for (int64_t i = 0; i < NX; ++i) {
        const __m512 r = _mm512_permutexvar_ps(order, ordered(v[i] * inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc + i * VS), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(r)));
      }
#else
      const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
      for (int64_t i = 0; i < NX; i += 2) {  // two octets: packs interleaves their halves, permute4x64 undoes it
        const __m256i a = _mm256_cvtps_epi32(_mm256_permutevar8x32_ps(ordered(v[i] * inv), order));
        const __m256i b = _mm256_cvtps_epi32(_mm256_permutevar8x32_ps(ordered(v[i + 1] * inv), order));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc + i * VS),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
#endif
    }
}


// An octet of 16 rows as four pairs of 16-bit codes a row (pair<P>(v): vector v's rows, columns
// PAIR_ORDER[2P], PAIR_ORDER[2P + 1]). int4 and Int4K: the nibbles of columns i and i + 2 (bytes i and
// i + 2) are 16 bits apart, so pair P is the dword shifted by 4P and masked. int5 and Int6K: the
// nibble and top bits of each column joined first (as OctetHi), then the same with bytes.
template <Codes KIND, int BITS = top_bits<KIND>()>
struct Pairs {
  IVec v[NV];
  Pairs(const uint8_t* p, const uint8_t*, int) {
    for (int k = 0; k < NV; ++k) v[k] = ivec_load(p + k * 4 * IVS);
  }
  template <int P>
  IVec pair(int k) const {
    return ivec_and(ivec_srl<4 * P>(v[k]), ivec_set(0x000F000F));
  }
};

template <Codes KIND, int BITS>
  requires(BITS > 0)
struct Pairs<KIND, BITS> {
  IVec lo[NV], hi[NV];  // bytes: the codes of columns 0-3, and of 4-7
  Pairs(const uint8_t* p, const uint8_t* top, int c) { OctetHi<BITS>::join(p, top, c, lo, hi); }
  template <int P>
  IVec pair(int k) const {  // P: (0, 2), (4, 6), (1, 3), (5, 7)
    return ivec_and(ivec_srl<P < 2 ? 0 : 8>(P % 2 == 0 ? lo[k] : hi[k]), ivec_set(OctetHi<BITS>::MASK * 0x00010001));
  }
};

// tile_rows with int16 activations: xq (R, K) int16 rows ldx apart (quantize_rows), xs (R, K/32)
// their scales rows K/32 apart; the rest as tile_rows. G is a multiple of 32, or divides it (Int6K's
// 16: two groups share an activation scale).
template <int R, Codes KIND>
void tile_rows_q16(const int16_t* xq, int64_t ldx, const float* xs, const float* xsum, const TileWeights& t,
                   int64_t K, int64_t G, float* y, int64_t ldy, int64_t valid) {
  const int64_t ng = K / G, octets = G / OCTET, nxs = K / XQ;
  Vec tot[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) tot[r][v] = Vec(0.f);
  for (int64_t g = 0; g < ng; ++g) {
    prefetch_scales<KIND>(t, g);
    Vec dot[R][NV];  // the group's q . x, scaled by each 32 columns' s
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) dot[r][v] = Vec(0.f);
    const int64_t step = std::min(G, XQ) / OCTET;  // octets an activation scale and a group share
    for (int64_t c0 = 0; c0 < octets; c0 += step) {
      IVec acc[R][NV];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = ivec_zero();
      for (int64_t c = c0; c < c0 + step; ++c) {
        const uint8_t* p = t.w + (g * octets + c) * OCTET_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
        const Pairs<KIND> q(p, top_bits<KIND>() > 0 ? t.top + g * OCTET_BYTES : nullptr, static_cast<int>(c));
        const int16_t* xc = xq + g * G + c * OCTET;
        each_column<4>([&](auto pair) {
          constexpr int P = decltype(pair)::value;
          for (int v = 0; v < NV; ++v) {
            const IVec codes = q.template pair<P>(v);
            for (int r = 0; r < R; ++r) {
              int32_t xp;
              std::memcpy(&xp, xc + r * ldx + 2 * P, 4);
              acc[r][v] = ivec_madd_add(acc[r][v], codes, ivec_set(xp));
            }
          }
        });
      }
      const int64_t ci = (g * G + c0 * OCTET) / XQ;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) dot[r][v] = at::vec::fmadd(ivec_float(acc[r][v]), Vec(xs[r * nxs + ci]), dot[r][v]);
    }
    Vec sc[NV], of[NV];
    scales_offsets<KIND>(t, g, sc, of);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v)
        tot[r][v] = at::vec::fmadd(of[v], Vec(xsum[r * ng + g]), at::vec::fmadd(dot[r][v], sc[v], tot[r][v]));
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
#define LOCALLLM_Q16 1
#endif

// A tile's columns [k0, k0 + kb) as an fp32 panel (kb, 16): w = q * scale + offset, rounded once (q *
// scale is exact in fp32), the values int4_group_dequant / int5_group_dequant give; int8's q * scale,
// exact. k0 and kb are whole groups.
template <Codes KIND>
void decode_panel(const TileWeights& t, int64_t G, int64_t k0, int64_t kb, float* panel) {
  constexpr int COLS = cols_of<KIND>();
  const int64_t octets = G / COLS;
  for (int64_t g = k0 / G; g < (k0 + kb) / G; ++g) {
    Vec sc[NV], of[NV];
    scales_offsets<KIND>(t, g, sc, of);
    for (int64_t c = 0; c < octets; ++c) {
      float* pc = panel + (g * G + c * COLS - k0) * TILE;
      with_octet<KIND>(t, G, g, c, [&](const auto& q) {
        each_column<COLS>([&](auto col) {
          constexpr int C = decltype(col)::value;
          Vec code[NV];
          q.template col<C>(code);
          for (int v = 0; v < NV; ++v) {
            if constexpr (KIND == Codes::Int8) {
              (code[v] * sc[v]).store(pc + C * TILE + v * VS);
            } else {
              at::vec::fmadd(code[v], sc[v], of[v]).store(pc + C * TILE + v * VS);
            }
          }
        });
      });
    }
  }
}

// Many activation rows: each tile's weights decoded once per panel of columns and multiplied by
// every row (panel_gemm.h). x (M, K) -> y (M, N).
template <Codes KIND>
void mm_panels(const float* x, const Weights& w, int64_t M, int64_t N, float* y) {
  static_assert(localllm::panel::WIDTH == TILE, "a panel is a tile");
  const int64_t G = w.G;
  const int64_t kb = std::max<int64_t>(G, localllm::panel::KB / G * G);  // whole groups a panel
  localllm::panel::gemm(x, M, w.K, N, kb, y, [&](int64_t t, int64_t k0, int64_t n, float* panel, float*) {
    decode_panel<KIND>(w.tile(t), G, k0, n, panel);
  });
}

// The register kernels: x (M, K) -> y (M, N). xq and xs: x as int16 (quantize_rows), for the
// int4, int5 and Int4K codes where the ISA has them; null: the fp32 product.
template <Codes KIND>
void mm(const float* x, const float* xsum, const int16_t* xq, const float* xs, const Weights& w, int64_t M,
        int64_t N, float* y) {
  const int64_t K = w.K, G = w.G;
  const int64_t T = (N + TILE - 1) / TILE, ng = K / G;
  // A row alone: int8 keeps the accumulators of several rows (see the top), int4 and int5 take more.
  constexpr int A1 = KIND == Codes::Int8 ? 2 : 4;
  // Enough tiles a task that a thread's share is worth waking it: ~64K weights; claimed in turn.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (TILE * K));
  localllm::parallel_chunks(T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TileWeights wt = w.tile(t);
      const int64_t valid = std::min(TILE, N - t * TILE);
      float* yt = y + t * TILE;
      // R rows from row m, A accumulators a row for the fp32 product; int8 reads no sums of the
      // activations (no offsets): xsum is null.
      const auto rows = [&](auto r, auto a, int64_t m) {
        constexpr int R = decltype(r)::value, A = decltype(a)::value;
        const float* xsm = xsum == nullptr ? nullptr : xsum + m * ng;
#ifdef LOCALLLM_Q16
        if constexpr (KIND != Codes::Int8) {
          if (xq != nullptr) {
            tile_rows_q16<R, KIND>(xq + m * K, K, xs + m * (K / XQ), xsm, wt, K, G, yt + m * N, N, valid);
            return;
          }
        }
#endif
        tile_rows<R, A, KIND>(x + m * K, K, xsm, wt, K, G, yt + m * N, N, valid);
      };
      using std::integral_constant;
      if (M == 1) {
        rows(integral_constant<int, 1>{}, integral_constant<int, A1>{}, 0);
        continue;
      }
      int64_t m = 0;
      for (; m + MC <= M; m += MC) rows(integral_constant<int, MC>{}, integral_constant<int, 2>{}, m);
      // The rest shares its decoded columns too where registers allow (a verify step's 2-3 rows):
      // each row decoded on its own costs nearly a whole one-row product per row.
      const int64_t rest = M - m;
      if (MC > 3 && rest == 3)
        rows(integral_constant<int, 3>{}, integral_constant<int, 2>{}, m);
      else if (MC > 2 && rest == 2)
        rows(integral_constant<int, 2>{}, integral_constant<int, 2>{}, m);
      else
        for (; m < M; ++m) rows(integral_constant<int, 1>{}, integral_constant<int, A1>{}, m);
    }
  });
}

// packed's tiles and width (cols columns a dword), checked against the group and the output rows.
std::pair<int64_t, int64_t> check_packed(const at::Tensor& packed, int64_t group, int64_t N, const char* op,
                                         int64_t cols = OCTET) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == OCTET_BYTES && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              op, ": packed must be contiguous uint8 (tiles, K/", cols, ", 64)");
  TORCH_CHECK(group > 0 && group % cols == 0, op, ": group ", group, " is not a multiple of ", cols);
  const int64_t T = packed.size(0), K = packed.size(1) * cols;
  TORCH_CHECK(K % group == 0, op, ": width ", K, " is not a multiple of the group ", group);
  TORCH_CHECK(N > (T - 1) * TILE && N <= T * TILE, op, ": ", N, " rows do not fill ", T, " tiles of 16");
  return {T, K};
}

void check_per_group(const at::Tensor& t, int64_t T, int64_t groups, at::ScalarType dtype, int64_t last,
                     const char* what, const char* op) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 3 && t.size(0) == T && t.size(1) == groups &&
                  t.size(2) == last && t.is_contiguous(),
              op, ": ", what, " must be contiguous ", dtype, " (tiles, K/group, ", last, ")");
}

// offsets: each group's offset, or with zero_points its negated integer zero point -z (the offset -z * s
// then made in fp32: GPTQ's and AWQ's grids, whose offsets fp16 does not always hold).
Weights int4_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets, int64_t group,
                     int64_t N, const char* op, bool zero_points = false) {
  const auto [T, K] = check_packed(packed, group, N, op);
  check_per_group(scales, T, K / group, at::kHalf, TILE, "scales", op);
  check_per_group(offsets, T, K / group, at::kHalf, TILE, zero_points ? "zeros" : "offsets", op);
  Weights w{packed.data_ptr<uint8_t>(), nullptr, scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>(), K,
            group};
  w.zero_points = zero_points;
  return w;
}

constexpr int64_t INT5_GROUP = 32;  // Q5_0's block

Weights int5_weights(const at::Tensor& packed, const at::Tensor& fifth, const at::Tensor& scales, int64_t N,
                     const char* op) {
  const auto [T, K] = check_packed(packed, INT5_GROUP, N, op);
  check_per_group(fifth, T, K / INT5_GROUP, at::kByte, OCTET_BYTES, "fifth", op);
  check_per_group(scales, T, K / INT5_GROUP, at::kHalf, TILE, "scales", op);
  return {packed.data_ptr<uint8_t>(), fifth.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), nullptr, K,
          INT5_GROUP};
}

constexpr int64_t INT4K_GROUP = 32;  // Q4_K's sub-block

Weights int4k_weights(const at::Tensor& packed, const at::Tensor& mins, const at::Tensor& supers, int64_t N,
                      const char* op) {
  const auto [T, K] = check_packed(packed, INT4K_GROUP, N, op);
  TORCH_CHECK(K % SUPER == 0, op, ": width ", K, " is not a multiple of Q4_K's 256");
  check_per_group(mins, T, K / INT4K_GROUP, at::kByte, 2 * TILE, "mins", op);
  check_per_group(supers, T, K / SUPER, at::kHalf, 2 * TILE, "supers", op);
  Weights w{packed.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, K, INT4K_GROUP};
  w.mins = mins.data_ptr<uint8_t>();
  w.supers = supers.data_ptr<c10::Half>();
  return w;
}

constexpr int64_t INT6K_GROUP = 16;  // Q6_K's sub-block

Weights int6k_weights(const at::Tensor& packed, const at::Tensor& top, const at::Tensor& scales,
                      const at::Tensor& supers, int64_t N, const char* op) {
  const auto [T, K] = check_packed(packed, INT6K_GROUP, N, op);
  TORCH_CHECK(K % SUPER == 0, op, ": width ", K, " is not a multiple of Q6_K's 256");
  check_per_group(top, T, K / INT6K_GROUP, at::kByte, OCTET_BYTES, "top", op);
  check_per_group(scales, T, K / INT6K_GROUP, at::kChar, TILE, "scales", op);
  check_per_group(supers, T, K / SUPER, at::kHalf, TILE, "supers", op);
  Weights w{packed.data_ptr<uint8_t>(), top.data_ptr<uint8_t>(), nullptr, nullptr, K, INT6K_GROUP};
  w.mins = reinterpret_cast<const uint8_t*>(scales.data_ptr<int8_t>());
  w.supers = supers.data_ptr<c10::Half>();
  w.per = 1;
  return w;
}

// int8 codes (quads) with scales per group, or one a row (group: the columns a partial sum then).
Weights int8_weights(const at::Tensor& packed, const at::Tensor& scales, int64_t group, int64_t N, const char* op) {
  const auto [T, K] = check_packed(packed, group, N, op, QUAD);
  TORCH_CHECK(scales.dim() == 3 && (scales.size(1) == K / group || scales.size(1) == 1), op,
              ": scales must be (tiles, K/group, 16), or (tiles, 1, 16): one a row");
  check_per_group(scales, T, scales.size(1), at::kHalf, TILE, "scales", op);
  return {packed.data_ptr<uint8_t>(), nullptr, scales.data_ptr<c10::Half>(), nullptr, K, group, QUAD,
          scales.size(1)};
}

// x (M, K) -> y (M, N): the register kernels (mm) or the fp32 panels (gemm: for many activation rows).
template <Codes KIND>
at::Tensor product(const at::Tensor& x, const Weights& w, int64_t N, bool gemm, const char* op) {
  const int64_t K = w.K, G = w.G, ng = K / G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be (M, ", K, ")");
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 / fp16 widen exactly
  const int64_t M = xf.size(0);
  const float* xp = xf.data_ptr<float>();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (gemm) {
    mm_panels<KIND>(xp, w, M, N, y.data_ptr<float>());
  } else if constexpr (KIND == Codes::Int8) {
    mm<KIND>(xp, nullptr, nullptr, nullptr, w, M, N, y.data_ptr<float>());
  } else {
    std::vector<float> xsum(M * ng);  // per activation row and group: for the offsets
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        const float* xg = xp + m * K + g * G;
        Vec a(0.f);
        for (int64_t j = 0; j < G; j += VS) a = a + Vec::loadu(xg + j, std::min<int64_t>(VS, G - j));
        xsum[m * ng + g] = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a);
      }
#ifdef LOCALLLM_Q16
    if ((G % XQ == 0 || XQ % G == 0) && K % XQ == 0) {
      std::vector<int16_t> xq(M * K);
      std::vector<float> xs(M * (K / XQ));
      quantize_rows(xp, M, K, xq.data(), xs.data());
      mm<KIND>(xp, xsum.data(), xq.data(), xs.data(), w, M, N, y.data_ptr<float>());
      return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
    }
#endif
    mm<KIND>(xp, xsum.data(), nullptr, nullptr, w, M, N, y.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The weights (N, K) in fp32, w = q * scale + offset: q * scale is exact in fp32 (at most 5 + 11
// significant bits), so each weight is rounded once, as the reference's fp32 dequantization rounds it
// (and int5's is exact: (q - 16) * d).
template <Codes KIND>
at::Tensor dequant(const Weights& w, int64_t N, const at::TensorOptions& options) {
  const int64_t K = w.K, G = w.G;
  at::Tensor out = at::empty({N, K}, options.dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TileWeights wt = w.tile(t);
      const int64_t valid = std::min(TILE, N - t * TILE);
      for (int64_t j = 0; j < valid; ++j) {
        float* row = op + (t * TILE + j) * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t g = k / G, i = k % OCTET, shift = i < 4 ? 8 * i : 8 * (i - 4) + 4;
          const uint8_t b = wt.w[(k / OCTET) * OCTET_BYTES + 4 * j + i % 4];
          uint32_t q = i < 4 ? b & 0x0F : b >> 4;
          if constexpr (top_bits<KIND>() > 0) {  // octet (k % G) / 8's top bits, BITS apart
            constexpr uint32_t BITS = top_bits<KIND>();
            uint32_t f;
            std::memcpy(&f, wt.top + g * OCTET_BYTES + 4 * j, 4);
            q |= ((f >> (shift + BITS * ((k % G) / OCTET))) & ((1u << BITS) - 1)) << 4;
          }
          float sc, of;
          if constexpr (KIND == Codes::Int4K) {  // d sc, -dmin m
            const c10::Half* sup = wt.supers + (k / SUPER) * 2 * TILE;
            sc = static_cast<float>(sup[j]) * static_cast<float>(wt.mins[g * 2 * TILE + j]);
            of = static_cast<float>(sup[TILE + j]) * static_cast<float>(wt.mins[g * 2 * TILE + TILE + j]) * -1.f;
          } else if constexpr (KIND == Codes::Int6K) {  // d sc, -32 d sc
            sc = static_cast<float>(wt.supers[(k / SUPER) * TILE + j]) *
                 static_cast<float>(static_cast<int8_t>(wt.mins[g * TILE + j]));
            of = -32.f * sc;
          } else {
            sc = static_cast<float>(wt.s[g * TILE + j]);
            of = wt.o != nullptr ? static_cast<float>(wt.o[g * TILE + j]) : -16.f * sc;
            if (wt.zero_points) of *= sc;
          }
          row[k] = static_cast<float>(q) * sc + of;
        }
      }
    }
  });
  return out;
}

at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t group, int64_t N) {
  return product<Codes::Int4>(x, int4_weights(packed, scales, offsets, group, N, "int4_group_mm"), N, false,
                        "int4_group_mm");
}

// The same product through fp32 panels (mm_panels): for many activation rows.
at::Tensor int4_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t group, int64_t N) {
  return product<Codes::Int4>(x, int4_weights(packed, scales, offsets, group, N, "int4_group_gemm"), N, true,
                        "int4_group_gemm");
}

at::Tensor int4_group_dequant(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
                              int64_t group, int64_t N) {
  return dequant<Codes::Int4>(int4_weights(packed, scales, offsets, group, N, "int4_group_dequant"), N, packed.options());
}

// int4 with integer zero points: as int4_group_mm / _gemm / _dequant, with zeros (fp16, -z) where
// those take offsets; w = (q - z) * s exactly.
at::Tensor int4z_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t group, int64_t N) {
  return product<Codes::Int4>(x, int4_weights(packed, scales, zeros, group, N, "int4z_group_mm", true), N, false,
                              "int4z_group_mm");
}

at::Tensor int4z_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& zeros, int64_t group, int64_t N) {
  return product<Codes::Int4>(x, int4_weights(packed, scales, zeros, group, N, "int4z_group_gemm", true), N, true,
                              "int4z_group_gemm");
}

at::Tensor int4z_group_dequant(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                               int64_t group, int64_t N) {
  return dequant<Codes::Int4>(int4_weights(packed, scales, zeros, group, N, "int4z_group_dequant", true), N,
                              packed.options());
}

at::Tensor int5_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& fifth,
                         const at::Tensor& scales, int64_t N) {
  return product<Codes::Int5>(x, int5_weights(packed, fifth, scales, N, "int5_group_mm"), N, false, "int5_group_mm");
}

at::Tensor int5_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& fifth,
                           const at::Tensor& scales, int64_t N) {
  return product<Codes::Int5>(x, int5_weights(packed, fifth, scales, N, "int5_group_gemm"), N, true, "int5_group_gemm");
}

at::Tensor int5_group_dequant(const at::Tensor& packed, const at::Tensor& fifth, const at::Tensor& scales,
                              int64_t N) {
  return dequant<Codes::Int5>(int5_weights(packed, fifth, scales, N, "int5_group_dequant"), N, packed.options());
}

at::Tensor int4k_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& mins,
                          const at::Tensor& supers, int64_t N) {
  return product<Codes::Int4K>(x, int4k_weights(packed, mins, supers, N, "int4k_group_mm"), N, false,
                               "int4k_group_mm");
}

at::Tensor int4k_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& mins,
                            const at::Tensor& supers, int64_t N) {
  return product<Codes::Int4K>(x, int4k_weights(packed, mins, supers, N, "int4k_group_gemm"), N, true,
                               "int4k_group_gemm");
}

at::Tensor int4k_group_dequant(const at::Tensor& packed, const at::Tensor& mins, const at::Tensor& supers,
                               int64_t N) {
  return dequant<Codes::Int4K>(int4k_weights(packed, mins, supers, N, "int4k_group_dequant"), N, packed.options());
}

at::Tensor int6k_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& top,
                          const at::Tensor& scales, const at::Tensor& supers, int64_t N) {
  return product<Codes::Int6K>(x, int6k_weights(packed, top, scales, supers, N, "int6k_group_mm"), N, false,
                               "int6k_group_mm");
}

at::Tensor int6k_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& top,
                            const at::Tensor& scales, const at::Tensor& supers, int64_t N) {
  return product<Codes::Int6K>(x, int6k_weights(packed, top, scales, supers, N, "int6k_group_gemm"), N, true,
                               "int6k_group_gemm");
}

at::Tensor int6k_group_dequant(const at::Tensor& packed, const at::Tensor& top, const at::Tensor& scales,
                               const at::Tensor& supers, int64_t N) {
  return dequant<Codes::Int6K>(int6k_weights(packed, top, scales, supers, N, "int6k_group_dequant"), N,
                               packed.options());
}

at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                         int64_t N) {
  return product<Codes::Int8>(x, int8_weights(packed, scales, group, N, "int8_group_mm"), N, false,
                              "int8_group_mm");
}

// The same product through fp32 panels (mm_panels): for many activation rows.
at::Tensor int8_group_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                           int64_t N) {
  return product<Codes::Int8>(x, int8_weights(packed, scales, group, N, "int8_group_gemm"), N, true,
                              "int8_group_gemm");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("int4_group_mm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int4_group_gemm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int4_group_dequant(Tensor packed, Tensor scales, Tensor offsets, int group, int out_features) -> Tensor");
  m.def("int5_group_mm(Tensor x, Tensor packed, Tensor fifth, Tensor scales, int out_features) -> Tensor");
  m.def("int4z_group_mm(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group, int out_features) -> Tensor");
  m.def("int4z_group_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group, int out_features) -> Tensor");
  m.def("int4z_group_dequant(Tensor packed, Tensor scales, Tensor zeros, int group, int out_features) -> Tensor");
  m.def("int5_group_gemm(Tensor x, Tensor packed, Tensor fifth, Tensor scales, int out_features) -> Tensor");
  m.def("int5_group_dequant(Tensor packed, Tensor fifth, Tensor scales, int out_features) -> Tensor");
  m.def("int4k_group_mm(Tensor x, Tensor packed, Tensor mins, Tensor supers, int out_features) -> Tensor");
  m.def("int4k_group_gemm(Tensor x, Tensor packed, Tensor mins, Tensor supers, int out_features) -> Tensor");
  m.def("int4k_group_dequant(Tensor packed, Tensor mins, Tensor supers, int out_features) -> Tensor");
  m.def("int6k_group_mm(Tensor x, Tensor packed, Tensor top, Tensor scales, Tensor supers, int out_features) -> Tensor");
  m.def("int6k_group_gemm(Tensor x, Tensor packed, Tensor top, Tensor scales, Tensor supers, int out_features) -> Tensor");
  m.def("int6k_group_dequant(Tensor packed, Tensor top, Tensor scales, Tensor supers, int out_features) -> Tensor");
  m.def("int8_group_mm(Tensor x, Tensor packed, Tensor scales, int group, int out_features) -> Tensor");
  m.def("int8_group_gemm(Tensor x, Tensor packed, Tensor scales, int group, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int4_group_mm", &int4_group_mm);
  m.impl("int4_group_gemm", &int4_group_gemm);
  m.impl("int4_group_dequant", &int4_group_dequant);
  m.impl("int4z_group_mm", &int4z_group_mm);
  m.impl("int4z_group_gemm", &int4z_group_gemm);
  m.impl("int4z_group_dequant", &int4z_group_dequant);
  m.impl("int5_group_mm", &int5_group_mm);
  m.impl("int5_group_gemm", &int5_group_gemm);
  m.impl("int5_group_dequant", &int5_group_dequant);
  m.impl("int4k_group_mm", &int4k_group_mm);
  m.impl("int4k_group_gemm", &int4k_group_gemm);
  m.impl("int4k_group_dequant", &int4k_group_dequant);
  m.impl("int6k_group_mm", &int6k_group_mm);
  m.impl("int6k_group_gemm", &int6k_group_gemm);
  m.impl("int6k_group_dequant", &int6k_group_dequant);
  m.impl("int8_group_mm", &int8_group_mm);
  m.impl("int8_group_gemm", &int8_group_gemm);
}
