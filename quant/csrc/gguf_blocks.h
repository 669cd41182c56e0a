// Decoding a GGUF tensor's own blocks (ggml's layouts) and the row kernel that multiplies them, shared
// by gguf_blocks_mm.cpp (one linear layer: gguf_mm, gguf_gemm, gguf_dequant) and moe_mm.cpp (a layer's
// experts in one call). See gguf_blocks_mm.cpp's top for what the values are and how they are formed.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "fp32_vec.h"
#include "panel_gemm.h"

namespace localllm {
namespace gguf_blocks {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
using localllm::fp32::hsum;
using localllm::fp32::load_int8;


// ggml's type ids (gguf.GGMLQuantizationType).
enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, BF16 = 30, MXFP4 = 39,
};

struct Layout {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  int64_t sub;    // weights per sub-block (one scale and offset each)
};

inline bool layout_of(int64_t type, Layout& l) {
  switch (type) {
    case F32: l = {1, 4, 1}; return true;
    case F16: l = {1, 2, 1}; return true;
    case BF16: l = {1, 2, 1}; return true;
    case Q4_0: l = {32, 18, 32}; return true;
    case Q4_1: l = {32, 20, 32}; return true;
    case Q5_0: l = {32, 22, 32}; return true;
    case Q5_1: l = {32, 24, 32}; return true;
    case Q8_0: l = {32, 34, 32}; return true;
    case IQ4_NL: l = {32, 18, 32}; return true;
    case MXFP4: l = {32, 17, 32}; return true;
    case Q2_K: l = {256, 84, 16}; return true;
    case Q3_K: l = {256, 110, 16}; return true;
    case Q4_K: l = {256, 144, 32}; return true;
    case Q5_K: l = {256, 176, 32}; return true;
    case Q6_K: l = {256, 210, 16}; return true;
    default: return false;
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4): code 8 is -0, here 0; the scale is halved to match.
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 scale byte e as half its value, 2^(e - 128), in fp32 (ggml's GGML_E8M0_TO_FP32_HALF): the
// bits of 2^(e - 128) are (e - 1) << 23 for e >= 2, and the subnormals 2^-128, 2^-127 below.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 16 bytes of 4-bit indices (weight j in byte j's low nibble, j + 16 in its high one) -> q[0..31],
// the int8 values of a 16-entry code book.
inline void book_nibbles(const uint8_t* src, const int8_t* book_values, int8_t* q) {
#if defined(__SSSE3__)
  const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i*>(book_values));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(book, _mm_and_si128(v, mask)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_shuffle_epi8(book, _mm_and_si128(_mm_srli_epi16(v, 4), mask)));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = book_values[src[j] & 0x0F];
    q[j + 16] = book_values[src[j] >> 4];
  }
#endif
}

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 16 bytes -> their 32 nibbles: low nibbles to q[0..15], high ones to q[16..31], minus ``bias``.
inline void nibbles(const uint8_t* src, int8_t* q, int bias) {
#if defined(__SSE2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i mask = _mm_set1_epi8(0x0F), b = _mm_set1_epi8(static_cast<char>(bias));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_sub_epi8(_mm_and_si128(v, mask), b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), b));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((src[j] & 0x0F) - bias);
    q[j + 16] = static_cast<int8_t>((src[j] >> 4) - bias);
  }
#endif
}

// SPREAD[byte]: its 8 bits as 8 bytes of 0 or 16 (bit i -> byte i), the fifth bits of Q5_0 / Q5_1.
struct Spread {
  uint64_t v[256];
  constexpr Spread() : v() {
    for (int x = 0; x < 256; ++x)
      for (int i = 0; i < 8; ++i)
        if (x >> i & 1) v[x] |= uint64_t{16} << (8 * i);
  }
};
constexpr Spread SPREAD;

// q[0..31] += 16 * (bit j of the 4 little-endian bytes h), then - bias.
inline void fifth_bits(const uint8_t* h, int8_t* q, int bias) {
  uint64_t add[4] = {SPREAD.v[h[0]], SPREAD.v[h[1]], SPREAD.v[h[2]], SPREAD.v[h[3]]};
#if defined(__SSE2__)
  const __m128i b = _mm_set1_epi8(static_cast<char>(bias));
  for (int k = 0; k < 2; ++k) {
    __m128i* p = reinterpret_cast<__m128i*>(q + 16 * k);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(add + 2 * k));
    _mm_storeu_si128(p, _mm_sub_epi8(_mm_or_si128(_mm_loadu_si128(p), a), b));
  }
#else
  uint8_t bytes[32];
  std::memcpy(bytes, add, 32);
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>((q[j] | bytes[j]) - bias);
#endif
}

// One block -> codes q[block], scale[block / sub], offset[block / sub] (w = q * scale + offset).
// Returns whether the type has offsets (so callers may skip them). The block is read in place: copying
// its parts into small local arrays first made the wider vector loads of those arrays wait on store
// forwarding, which cost Q4_K and Q6_K a third to two fifths of their time.
__attribute__((always_inline)) inline bool decode(int64_t type, const uint8_t* b, int8_t* q, float* scale,
                                                 float* offset) {
  switch (type) {
    case Q4_0: {  // d, 16 bytes: weight j in the low nibble of byte j, j + 16 in its high nibble
      nibbles(b + 2, q, 8);
      scale[0] = f16(b);
      return false;
    }
    case IQ4_NL: {  // d, 16 bytes of indices into a 16-value code book
      book_nibbles(b + 2, IQ4_NL_VALUES, q);
      scale[0] = f16(b);
      return false;
    }
    case MXFP4: {  // E8M0 e, 16 bytes of E2M1 codes: w = MXFP4_VALUES[q] * 2^(e - 128), exact in fp32
      book_nibbles(b + 1, MXFP4_VALUES, q);
      scale[0] = e8m0_half(b[0]);
      return false;
    }
    case Q4_1: {  // d, m, 16 bytes
      nibbles(b + 4, q, 0);
      scale[0] = f16(b);
      offset[0] = f16(b + 2);
      return true;
    }
    case Q5_0:
    case Q5_1: {  // d, (m), 32 fifth bits (bit j of a little-endian uint32 for weight j), 16 bytes
      const bool has_min = type == Q5_1;
      const uint8_t* hb = b + (has_min ? 4 : 2);
      nibbles(hb + 4, q, 0);
      fifth_bits(hb, q, has_min ? 0 : 16);
      scale[0] = f16(b);
      if (has_min) offset[0] = f16(b + 2);
      return has_min;
    }
    case Q8_0: {
      std::memcpy(q, b + 2, 32);
      scale[0] = f16(b);
      return false;
    }
    case Q2_K: {  // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
      const uint8_t *sc = b, *qs = b + 16;
      const float d = f16(b + 80), dmin = f16(b + 82);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) q[h * 128 + s * 32 + l] = static_cast<int8_t>((qs[h * 32 + l] >> (2 * s)) & 3);
      for (int i = 0; i < 16; ++i) {
        scale[i] = d * static_cast<float>(sc[i] & 0x0F);
        offset[i] = -(dmin * static_cast<float>(sc[i] >> 4));
      }
      return true;
    }
    case Q3_K: {  // hmask[32], qs[64], scales[12] (16 6-bit signed), d
      const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
      const float d = f16(b + 108);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) {
            // hmask bit (4h + s) of byte l: set, no offset; clear, -4
            const int high = (hm[l] >> (4 * h + s)) & 1;
            q[h * 128 + s * 32 + l] = static_cast<int8_t>(((qs[h * 32 + l] >> (2 * s)) & 3) - 4 + 4 * high);
          }
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? (sc[i] & 0x0F) : (sc[i - 8] >> 4);
        const int high = (sc[8 + (i % 4)] >> (2 * (i / 4))) & 3;
        scale[i] = d * static_cast<float>((low | (high << 4)) - 32);
      }
      return false;
    }
    case Q4_K:
    case Q5_K: {  // d, dmin, scales[12], (qh[32]), qs[128]
      const bool five = type == Q5_K;
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          q[c * 64 + l] = static_cast<int8_t>(qs[c * 32 + l] & 0x0F);
          q[c * 64 + 32 + l] = static_cast<int8_t>(qs[c * 32 + l] >> 4);
        }
      if (five) {
        for (int bit = 0; bit < 8; ++bit)  // bit `bit` of qh[l] is the fifth bit of weight 32 * bit + l
          for (int l = 0; l < 32; ++l) q[bit * 32 + l] = static_cast<int8_t>(q[bit * 32 + l] | (((qh[l] >> bit) & 1) << 4));
      }
      for (int j = 0; j < 8; ++j) {
        int s, m;
        k_scale_min(sc, j, s, m);
        scale[j] = d * static_cast<float>(s);
        offset[j] = -(dmin * static_cast<float>(m));
      }
      return true;
    }
    case Q6_K: {  // ql[128], qh[64], scales[16] int8, d
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) {
            const int low = (ql[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 0x0F;
            const int high = (qh[h * 32 + l] >> (2 * s)) & 3;
            q[h * 128 + s * 32 + l] = static_cast<int8_t>((low | (high << 4)) - 32);
          }
      const Vec vd(d);
      for (int i = 0; i < 16; i += VS) (load_int8(sc + i) * vd).store(scale + i);
      return false;
    }
    default: return false;
  }
}

// A float row's K values (F32 / F16 / BF16) as fp32.
inline void float_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  if (type == F32) {
    std::memcpy(out, row, K * 4);
  } else if (type == F16) {
    const c10::Half* h = reinterpret_cast<const c10::Half*>(row);
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    for (; i + 8 <= K; i += 8)  // F16C, exact as the scalar conversion
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
    for (; i < K; ++i) out[i] = static_cast<float>(h[i]);
  } else {
    const c10::BFloat16* h = reinterpret_cast<const c10::BFloat16*>(row);
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    for (; i + 8 <= K; i += 8) {  // bf16 is fp32's upper half
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
#endif
    for (; i < K; ++i) out[i] = static_cast<float>(h[i]);
  }
}

#ifndef PREFETCH
#define PREFETCH 4096  // bytes ahead of the block being decoded
#endif

// Asks for the bytes PREFETCH past a block's, every cache line of them. A thread's rows are one
// stream of memory, but a decode step reads each layer once from L3 or DRAM, between other layers'
// reads: the hardware prefetchers alone left each layer waiting on memory. Written as an asm
// statement: GCC dropped the _mm_prefetch intrinsic from some of the row kernels it inlined (a
// 640 x 262144 Q8_0 product took 15 ms instead of 10.5 on one row). prefetcht0, as tile_mm.cpp says why.
template <int64_t BYTES>
inline void prefetch_block(const uint8_t* block) {
#if defined(__SSE2__)
  for (int64_t o = 0; o < BYTES; o += 64) asm volatile("prefetcht0 %0" : : "m"(*(block + o + PREFETCH)));
#endif
}

// After a K-quant block is decoded into q: the codes must be read back from memory, each 8 or 16 of them
// widened straight from their bytes (vpmovsxbd from memory: a load, then one shuffle). Without this,
// GCC keeps the 256 decoded codes in vector registers and widens each piece out of them with extra
// shuffles: Q6_K took a quarter longer, Q4_K a tenth. (Q5_0 gained nothing, and lost on AVX-512.)
template <int64_t BLOCK>
inline void codes_in_memory() {
#if defined(__GNUC__)
  if constexpr (BLOCK > 32) asm volatile("" ::: "memory");
#endif
}

constexpr int64_t MAX_M = 8;  // activation rows sharing each decoded block

// Output row wn (nb blocks) for R activation rows at x (K apart; xsum: their sums per sub-block, nsub
// apart) -> out[0..R). Each block is decoded once and each sub-block's codes widened once for all R
// rows. Per row the operations are those of one row alone, in the same order: the sub-block's dot
// product (a multiply, then FMAs), scaled once into one of two chains (even and odd sub-blocks of the
// row, so consecutive FMAs need not wait on each other), the offsets summed apart, all added at the
// end; so a row's result does not depend on which rows share the call (a speculative verify step's rows
// get the bits a one-row decode step gives).
template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB, int R>
void row_blocks(const float* x, int64_t K, const float* xsum, int64_t nsub, const uint8_t* wn, int64_t nb,
                float* out) {
  using namespace localllm::panel;
  constexpr int64_t NS = BLOCK / SUB, SV = SUB / VS;
  alignas(64) int8_t q[BLOCK];
  float scale[NS], offset[NS];
  V a0[R], a1[R];
  float off[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = a1[r] = vset(0.f);
    off[r] = 0.f;
  }
  // Block bi; ODD: whether it is an odd block (the chain of a one-sub-block type's sums).
  const auto add_block = [&](int64_t bi, auto odd) __attribute__((always_inline)) {
    const uint8_t* b = wn + bi * BYTES;
    prefetch_block<BYTES>(b);
    const bool has_offset = decode(TYPE, b, q, scale, offset);  // a constant: decode is inlined for TYPE
    codes_in_memory<BLOCK>();
#pragma GCC unroll 16
    for (int64_t s = 0; s < NS; ++s) {
      V w[SV];
#pragma GCC unroll 4
      for (int64_t j = 0; j < SV; ++j) w[j] = static_cast<V>(load_int8(q + s * SUB + j * VS));
      const V sc = vset(scale[s]);
      const bool second = ((NS == 1 && odd()) + s) % 2;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xs = x + r * K + bi * BLOCK + s * SUB;
        V t = vmul(w[0], vload(xs));
#pragma GCC unroll 4
        for (int64_t j = 1; j < SV; ++j) t = vfma(w[j], vload(xs + j * VS), t);
        if (second) a1[r] = vfma(t, sc, a1[r]);
        else a0[r] = vfma(t, sc, a0[r]);
      }
    }
    if (has_offset)
      for (int r = 0; r < R; ++r)
        for (int64_t s = 0; s < NS; ++s) off[r] += offset[s] * xsum[r * nsub + bi * NS + s];
  };
  int64_t bi = 0;
  if constexpr (NS == 1) {  // in pairs, so that which chain a block adds to is known at compile time
    for (; bi + 1 < nb; bi += 2) {
      add_block(bi, std::false_type{});
      add_block(bi + 1, std::true_type{});
    }
  }
  for (; bi < nb; ++bi) add_block(bi, std::false_type{});  // a K-quant's sub-blocks alternate within it
  for (int r = 0; r < R; ++r) out[r] = hsum(Vec(a0[r]) + Vec(a1[r])) + off[r];
}

// Every block type with its layout (type, weights a block, bytes a block, weights a sub-block), for the
// dispatchers below: X(T, B, BY, S) once per type.
#define LOCALLLM_BLOCK_TYPES(X) \
  X(Q4_0, 32, 18, 32) X(Q4_1, 32, 20, 32) X(Q5_0, 32, 22, 32) X(Q5_1, 32, 24, 32) X(Q8_0, 32, 34, 32) \
  X(IQ4_NL, 32, 18, 32) X(MXFP4, 32, 17, 32) X(Q2_K, 256, 84, 16) X(Q3_K, 256, 110, 16) X(Q4_K, 256, 144, 32)          \
  X(Q5_K, 256, 176, 32) X(Q6_K, 256, 210, 16)

// Columns [k0, k0 + kb) (whole blocks) of the ``valid`` weight rows at w (row_bytes apart) as fp32
// rows (valid, kb), ld apart: the values gguf_dequant gives (q * scale is exact in fp32, so adding the offset
// rounds once, as ggml does).
template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t valid, int64_t k0, int64_t kb, float* rows,
                 int64_t ld) {
  constexpr int64_t NS = BLOCK / SUB;
  alignas(64) int8_t q[BLOCK];
  float scale[NS], offset[NS];
  for (int64_t j = 0; j < valid; ++j) {
    const uint8_t* row = w + j * row_bytes + k0 / BLOCK * BYTES;
    for (int64_t b = 0; b < kb / BLOCK; ++b) {
      const bool has_offset = decode(TYPE, row + b * BYTES, q, scale, offset);
      float* out = rows + j * ld + b * BLOCK;
      for (int64_t s = 0; s < NS; ++s) {
        const Vec sc(scale[s]), of(has_offset ? offset[s] : 0.f);
        for (int64_t i = s * SUB; i < (s + 1) * SUB; i += VS)
          (has_offset ? at::vec::fmadd(load_int8(q + i), sc, of) : load_int8(q + i) * sc).store(out + i);
      }
    }
  }
}

}  // namespace gguf_blocks
}  // namespace localllm
