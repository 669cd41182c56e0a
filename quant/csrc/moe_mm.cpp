// A Mixture-of-Experts layer's expert FFN in one call (localllm::moe_ffn): for x (N, D), each row's
// top-k expert ids and routing weights, and every expert's gate, up and down projections stacked as
// GGUF blocks (E, out, bytes), it computes
//     y[t] = sum_j weight[t, j] * down_e (act(gate_e x[t]) * up_e x[t]),   e = ids[t, j]
// with no Python loop over experts or tokens.
//
// The rows are grouped by expert first (each row once per expert that picked it, in token order), so
// every active expert's weights are read once per call however many rows chose it (a batch of 8
// decode rows, a prefill chunk). Work is shared among threads as (expert, 16 output rows) tasks,
// claimed in turn (parallel_rows.h): first gate and up together (both read for the same output rows,
// the activation applied as they finish), then down into one row a (token, slot); the slots of a token
// are summed last, in slot order, so a row's result does not depend on the threads; nor on the other
// rows of the call while each expert has fewer than PANEL_ROWS rows (an expert with more takes the
// panel GEMM, which sums in another order: equal then up to fp32 rounding).
//
// The products are gguf_blocks.h's row kernel (the one gguf_mm runs): each block decoded once for up
// to eight rows of an expert (four in the fused form), the exact weights gguf.quants.dequantize gives,
// fp32 accumulation; on
// AVX2 builds the common expert types (Q4_K, Q6_K, Q8_0, Q5_0, Q4_0, Q4_1) take this file's fused form
// of it (fused:: below: codes widened straight from the blocks), the same weights and accumulation. An
// expert with many rows (a long prefill) takes the fp32 panel GEMM of panel_gemm.h instead: its 16
// output rows decoded once a panel for all its rows. localllm's canonical int4 and int8 come here as
// Q4_1 and Q8_0 blocks holding the same values (quant/expert_kernels.py makes them).
//
// gpt-oss: optional fp32 biases (gate's and up's (E, I), added before the activation; down's (E, D),
// added to each (token, slot) row before its weight) and its clamped SwiGLU (act 2, with `limit` and
// `alpha`): g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf_blocks.h"
#include "panel_gemm.h"
#include "parallel_rows.h"

namespace {

using namespace localllm::gguf_blocks;

constexpr int64_t CHUNK = 16;       // output rows a task (a panel's width)
// An expert's rows from which its products take the panel GEMM. From 16 rows a panel (16 output rows
// decoded once for all of them) beat the row kernel's passes of FUSED_M rows: a 128-token prefill's
// experts (16 rows each on average) took 7-12% less time than from 32; below 16 a batch of 8 decode
// streams (8 rows an expert at most) keeps the row kernel, whose rows do not depend on each other.
constexpr int64_t PANEL_ROWS = 16;
// Rows of x sharing each block the fused row kernel widens: 4, not gguf_blocks.h's MAX_M of 8 (eight
// rows' two chains and offsets are 24 accumulators, more than AVX2's 16 registers: the spills cost
// more than widening each block twice; 8 rows 6-8% faster, a prefill's experts 9%).
constexpr int64_t FUSED_M = 4;

enum Act : int64_t { SILU = 0, GELU_TANH = 1, SWIGLU_CLAMPED = 2 };

// One projection of every expert: E experts of N output rows of K inputs in GGML type `type`, expert
// e's rows from w + e * expert_bytes (a fused gate_up's gate and up are two views of one tensor).
struct Proj {
  const uint8_t* w;
  int64_t type, K, N, row_bytes, expert_bytes;
  Layout L;
  const uint8_t* row(int64_t e, int64_t n) const { return w + e * expert_bytes + n * row_bytes; }
};

// Output rows [n0, n1) of expert e for M rows of x (K apart; xsum their sub-block sums, K / sub apart)
// -> y[m * ldy + n]: the row kernel, up to MAX_M rows sharing each decoded block.
// The row kernel fused with the decoder, for the block types of common MoE files (Q4_K gate and up,
// Q6_K / Q8_0 / Q5_0 / Q4_0 / Q4_1 down, canonical int4 as Q4_1), on AVX2: each 8 weights' codes are widened
// straight from the block's bytes into fp32 lanes (vpmovzxbd / vpmovsxbd from memory, a mask or a
// shift, vcvtdq2ps), with no pass through a decoded array; a K-quant's eight scales and mins are
// unpacked together (ggml's 12-byte layout, as llama.cpp does) and converted as one vector; its offsets
// go into a vector accumulator (one FMA a block). A one-row decode step is bound by these instructions,
// not by memory: decoding each block into q[] and reading it back, the scales one by one, made a row
// of Q4_K about twice as long. The values are those of gguf_blocks.h's decode (q * scale + offset, the
// same fp32 scale and offset), accumulated in fp32; per row the operations and their order are fixed
// (sub-block dot products scaled into two alternating chains, offsets apart), so a row's result does
// not depend on the rows beside it.
#if defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCALLLM_MOE_FUSED 1
namespace fused {

inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256 low4(__m256i v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline __m256 high4(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block's view: NS sub-blocks of 32 weights; code(s, j): weights 8j .. 8j + 7 of sub-block s as fp32;
// scale(s) broadcast; offsets added per row by offset(...) (VOFF: as a vector of the NS sub-blocks).
template <int64_t TYPE> struct Block { static constexpr bool ok = false; };

template <> struct Block<Q4_K> {  // d, dmin, scales[12], qs[128]: sub-block s = chunk s / 2's low or high nibbles
  static constexpr bool ok = true, OFFSETS = true, VOFF = true, PAIRED = true, AS_BYTES = false;
  static constexpr int64_t NS = 8, SUB = 32, BYTES = 144;
  const uint8_t* b;
  alignas(32) float scl[8];  // d * scale of each sub-block
  __m256 mins;               // dmin * min of each sub-block (offset = -mins)
  explicit Block(const uint8_t* p) : b(p) {
    // The 12 bytes as 32-bit lanes u0, u1, u2 (a 16-byte load: the block goes on past them), unpacked
    // in lanes as ggml's utmp: [u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1,
    // ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4]: the eight 6-bit scales, then the eight mins, a byte each.
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0 u0 u1 u1
    const __m128i c = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i x = _mm_and_si128(a, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i y = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi32(0x0f0f0f0f)),
                                   _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(a, 6), _mm_set1_epi32(0x03030303)), 4));
    const __m128i u = _mm_blend_epi32(x, y, 0b1010);
    _mm256_store_ps(scl, _mm256_mul_ps(_mm256_set1_ps(f16(p)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u))));
    mins = _mm256_mul_ps(_mm256_set1_ps(f16(p + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8))));
  }
  // sub-blocks 2c and 2c + 1: the low and high nibbles of the same 32 bytes
  void codes2(int64_t c, __m256* lo, __m256* hi) const {
#pragma GCC unroll 4
    for (int64_t j = 0; j < 4; ++j) {
      const __m256i v = u8x8(b + 16 + c * 32 + 8 * j);
      lo[j] = low4(v);
      hi[j] = high4(v);
    }
  }
  __m256 scale(int64_t s) const { return _mm256_broadcast_ss(scl + s); }
  // xs: the row's sums of this block's 8 sub-blocks
  void offset(const float* xs, __m256& acc, float&) const { acc = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(xs), acc); }
};

template <> struct Block<Q8_0> {  // d, 32 int8
  static constexpr bool ok = true, OFFSETS = false, VOFF = false, PAIRED = false, AS_BYTES = false;
  static constexpr int64_t NS = 1, SUB = 32, BYTES = 34;
  const uint8_t* b;
  float d;
  explicit Block(const uint8_t* p) : b(p), d(f16(p)) {}
  __m256 code(int64_t, int64_t j) const {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j))));
  }
  __m256 scale(int64_t) const { return _mm256_set1_ps(d); }
  void offset(const float*, __m256&, float&) const {}
};

// Q4_0 / Q4_1: d, (m), 16 bytes: weight j in byte j's low nibble, j + 16 in its high one.
template <int64_t TYPE, int64_t HEAD, int BIAS, bool MIN>
struct Nibbles32 {
  static constexpr bool ok = true, OFFSETS = MIN, VOFF = false, PAIRED = false, AS_BYTES = false;
  static constexpr int64_t NS = 1, SUB = 32, BYTES = HEAD + 16;
  const uint8_t* b;
  float d, m;
  explicit Nibbles32(const uint8_t* p) : b(p), d(f16(p)), m(MIN ? f16(p + 2) : 0.f) {}
  __m256 code(int64_t, int64_t j) const {
    const __m256i v = u8x8(b + HEAD + 8 * (j % 2));
    const __m256i q = j < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    return _mm256_cvtepi32_ps(BIAS ? _mm256_sub_epi32(q, _mm256_set1_epi32(BIAS)) : q);
  }
  __m256 scale(int64_t) const { return _mm256_set1_ps(d); }
  void offset(const float* xs, __m256&, float& off) const { off += m * xs[0]; }
};
template <> struct Block<Q4_0> : Nibbles32<Q4_0, 2, 8, false> { using Nibbles32::Nibbles32; };
template <> struct Block<Q4_1> : Nibbles32<Q4_1, 4, 0, true> { using Nibbles32::Nibbles32; };

template <> struct Block<Q5_0> {  // d, qh (bit j: weight j's fifth bit), 16 bytes as Q4_0's; q - 16
  static constexpr bool ok = true, OFFSETS = false, VOFF = false, PAIRED = false, AS_BYTES = false;
  static constexpr int64_t NS = 1, SUB = 32, BYTES = 22;
  const uint8_t* b;
  float d;
  explicit Block(const uint8_t* p) : b(p), d(f16(p)) {}
  __m256 code(int64_t, int64_t j) const {
    const __m256i v = u8x8(b + 6 + 8 * (j % 2));
    const __m256i q = j < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    // qh's byte j: the fifth bits of weights 8j .. 8j + 7, as 0 or 16 a byte (SPREAD), widened
    const __m256i hi = u8x8(reinterpret_cast<const uint8_t*>(SPREAD.v + b[2 + j]));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(q, hi), _mm256_set1_epi32(16)));
  }
  __m256 scale(int64_t) const { return _mm256_set1_ps(d); }
  void offset(const float*, __m256&, float&) const {}
};

// Q6_K: ql[128], qh[64], scales[16] int8, d. Weight h * 128 + s * 32 + l (h < 2, s < 4, l < 32) is
// ((ql[h * 64 + (s % 2) * 32 + l] >> 4 * (s / 2)) & 15 | ((qh[h * 32 + l] >> 2 * s) & 3) << 4) - 32, in
// sub-block (16 weights) 2 (h * 4 + s) + l / 16. Six bits from two places: widening each 8 codes
// straight from the bytes (as the other types) took five vector operations for 8 weights, and was
// slower than gguf_blocks.h's decode. Here the codes of 32 weights are made at once in byte lanes
// (3 loads, 5 operations), stored into the caller's 256 bytes, and widened from there; the same
// values as decode's, each sub-block into its chain in the same order, so the same bits as row_blocks.
template <> struct Block<Q6_K> {
  static constexpr bool ok = true, OFFSETS = false, VOFF = false, PAIRED = false, AS_BYTES = true;
  static constexpr int64_t NS = 16, SUB = 16, BYTES = 210;
  const uint8_t* b;
  alignas(32) float scl[16];  // d * scale of each sub-block
  explicit Block(const uint8_t* p) : b(p) {
    const __m256 d = _mm256_set1_ps(f16(p + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    _mm256_store_ps(scl, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
    _mm256_store_ps(scl + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d));
  }
  // the 256 codes as int8 into q, in weight order (sub-block i at q + 16 i)
  void codes(int8_t* q) const {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(48), k32 = _mm256_set1_epi8(32);
#pragma GCC unroll 2
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + h * 64));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + h * 64 + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + h * 32));
      const auto put = [&](int64_t s, __m256i low, __m256i high) __attribute__((always_inline)) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + h * 128 + s * 32),
                           _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(high, m2)), k32));
      };
      put(0, _mm256_and_si256(a, m4), _mm256_slli_epi16(hb, 4));
      put(1, _mm256_and_si256(c, m4), _mm256_slli_epi16(hb, 2));
      put(2, _mm256_and_si256(_mm256_srli_epi16(a, 4), m4), hb);
      put(3, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_srli_epi16(hb, 2));
    }
  }
  __m256 scale(int64_t s) const { return _mm256_broadcast_ss(scl + s); }
  void offset(const float*, __m256&, float&) const {}
};

// Output row wn (nb blocks) for R rows of x (K apart; xsum their sub-block sums, nsub apart) -> out[0..R).
template <int64_t TYPE, int R>
void rows(const float* x, int64_t K, const float* xsum, int64_t nsub, const uint8_t* wn, int64_t nb, float* out) {
  using B = Block<TYPE>;
  constexpr int64_t NS = B::NS, SUB = B::SUB, SV = SUB / 8, BLOCK = SUB * NS;
  __m256 a0[R], a1[R], ov[R];
  float off[R];
  alignas(32) int8_t q[B::AS_BYTES ? 32 * NS : 32];  // AS_BYTES: a block's codes
  for (int r = 0; r < R; ++r) {
    a0[r] = a1[r] = ov[r] = _mm256_setzero_ps();
    off[r] = 0.f;
  }
  const auto add_block = [&](int64_t bi, auto odd) __attribute__((always_inline)) {
    const uint8_t* p = wn + bi * B::BYTES;
    prefetch_block<B::BYTES>(p);
    const B blk(p);
    // sub-block s's codes w[SV] into each row's chain
    const auto sub = [&](int64_t s, const __m256* w) __attribute__((always_inline)) {
      const __m256 sc = blk.scale(s);
      const bool second = ((NS == 1 && odd()) + s) % 2;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xs = x + r * K + bi * BLOCK + s * SUB;
        __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xs));
#pragma GCC unroll 4
        for (int64_t j = 1; j < SV; ++j) t = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xs + 8 * j), t);
        if (second) a1[r] = _mm256_fmadd_ps(t, sc, a1[r]);
        else a0[r] = _mm256_fmadd_ps(t, sc, a0[r]);
      }
    };
    if constexpr (B::AS_BYTES) {
      blk.codes(q);
      asm volatile("" ::: "memory");  // widened from memory, not kept in registers (codes_in_memory's why)
#pragma GCC unroll 16
      for (int64_t i = 0; i < NS; ++i) {
        __m256 w[SV];
#pragma GCC unroll 2
        for (int64_t v = 0; v < SV; ++v)
          w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i * SUB + 8 * v))));
        sub(i, w);
      }
    } else if constexpr (B::PAIRED) {
#pragma GCC unroll 4
      for (int64_t c = 0; c < NS / 2; ++c) {
        __m256 lo[4], hi[4];
        blk.codes2(c, lo, hi);
        sub(2 * c, lo);
        sub(2 * c + 1, hi);
      }
    } else {
#pragma GCC unroll 8
      for (int64_t s = 0; s < NS; ++s) {
        __m256 w[4];
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) w[j] = blk.code(s, j);
        sub(s, w);
      }
    }
    if constexpr (B::OFFSETS)
      for (int r = 0; r < R; ++r) blk.offset(xsum + r * nsub + bi * NS, ov[r], off[r]);
  };
  int64_t bi = 0;
  if constexpr (NS == 1) {
    for (; bi + 1 < nb; bi += 2) {
      add_block(bi, std::false_type{});
      add_block(bi + 1, std::true_type{});
    }
  }
  for (; bi < nb; ++bi) add_block(bi, std::false_type{});
  for (int r = 0; r < R; ++r) {
    float v = hsum8(_mm256_add_ps(a0[r], a1[r]));
    if constexpr (B::VOFF) v += hsum8(ov[r]);
    else v += off[r];
    out[r] = v;
  }
}

}  // namespace fused
#endif

template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB>
void rows_t(const Proj& p, int64_t e, const float* x, const float* xsum, int64_t M, int64_t n0, int64_t n1,
            float* y, int64_t ldy) {
  const int64_t K = p.K, nb = K / BLOCK, nsub = K / SUB;
  float out[MAX_M];
  // The task's first PREFETCH bytes: each block asks for those PREFETCH past it, so without this the
  // start of every task (another thread's last one just before it in memory) waits on memory.
#if defined(__SSE2__)
  {
    const uint8_t* first = p.row(e, n0);
    const int64_t bytes = std::min<int64_t>(PREFETCH, (n1 - n0) * p.row_bytes);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(first + o), _MM_HINT_T0);
  }
#endif
#ifdef LOCALLLM_MOE_FUSED
  constexpr int64_t STEP = fused::Block<TYPE>::ok ? FUSED_M : MAX_M;
#else
  constexpr int64_t STEP = MAX_M;
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = p.row(e, n);
    for (int64_t m0 = 0; m0 < M; m0 += STEP) {
      const int64_t rows = std::min(STEP, M - m0);
      localllm::panel::with_rows<STEP>(rows, [&](auto r) {
#ifdef LOCALLLM_MOE_FUSED
        if constexpr (fused::Block<TYPE>::ok) {
          fused::rows<TYPE, r>(x + m0 * K, K, xsum + m0 * nsub, nsub, wn, nb, out);
          return;
        }
#endif
        row_blocks<TYPE, BLOCK, BYTES, SUB, r>(x + m0 * K, K, xsum + m0 * nsub, nsub, wn, nb, out);
      });
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = out[r];
    }
  }
}

void rows_dispatch(const Proj& p, int64_t e, const float* x, const float* xsum, int64_t M, int64_t n0, int64_t n1,
                   float* y, int64_t ldy) {
  switch (p.type) {
#define LOCALLLM_CASE(T, B, BY, S) \
  case T: rows_t<T, B, BY, S>(p, e, x, xsum, M, n0, n1, y, ldy); break;
    LOCALLLM_BLOCK_TYPES(LOCALLLM_CASE)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "moe_ffn: GGML type ", p.type, " has no block kernel");
  }
}

// Output rows [n0, n0 + 16) of expert e (those < N) for the M rows packed in xp -> y[m * ldy + n]:
// the panel GEMM's task, run by this thread alone (panel_gemm.h's gemm, for one tile).
template <int64_t TYPE, int64_t BLOCK, int64_t BYTES, int64_t SUB>
void panel_t(const Proj& p, int64_t e, const localllm::panel::PackedRows& xp, int64_t M, int64_t n0, float* y,
             int64_t ldy) {
  namespace panel = localllm::panel;
  constexpr int64_t W = panel::WIDTH;
  constexpr int64_t kb = BLOCK >= panel::KB ? BLOCK : panel::KB / BLOCK * BLOCK;  // whole blocks
  const int64_t K = p.K, valid = std::min(W, p.N - n0);
  std::vector<float> rows(W * kb, 0.f), pnl(kb * W), acc(M * W);
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t n = std::min(kb, K - k0);
    decode_rows<TYPE, BLOCK, BYTES, SUB>(p.row(e, n0), p.row_bytes, valid, k0, n, rows.data(), kb);
    panel::transpose_rows(rows.data(), kb, n, pnl.data());
    for (int64_t g = 0; g < xp.groups(); ++g) {
      const int64_t m0 = xp.start(g);
      const panel::Tile buffer{acc.data() + m0 * W, M * W, W};
      panel::tail<panel::MR, 1>(xp.size(g), xp.at(g, k0), xp.ldx(), pnl.data(), kb * W, n,
                                k0 == 0 ? nullptr : &buffer, buffer);
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * ldy + n0, acc.data() + m * W, valid * sizeof(float));
}

void panel_dispatch(const Proj& p, int64_t e, const localllm::panel::PackedRows& xp, int64_t M, int64_t n0, float* y,
                    int64_t ldy) {
  switch (p.type) {
#define LOCALLLM_CASE(T, B, BY, S) \
  case T: panel_t<T, B, BY, S>(p, e, xp, M, n0, y, ldy); break;
    LOCALLLM_BLOCK_TYPES(LOCALLLM_CASE)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "moe_ffn: GGML type ", p.type, " has no panel kernel");
  }
}

// Sums of each row's sub-blocks of `sub` columns: x (M, K) -> (M, K / sub), for the offsets.
std::vector<float> sub_sums(const float* x, int64_t M, int64_t K, int64_t sub) {
  const int64_t nsub = K / sub;
  std::vector<float> s(M * nsub);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t j = 0; j < nsub; ++j) {
        float a = 0.f;
        for (int64_t i = 0; i < sub; ++i) a += x[m * K + j * sub + i];
        s[m * nsub + j] = a;
      }
  });
  return s;
}

// act(g) * u; gpt-oss's clamped form for SWIGLU_CLAMPED.
inline float activate(float g, float u, int64_t act, float limit, float alpha) {
  if (act == SWIGLU_CLAMPED) {
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    return (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
  }
  if (act == GELU_TANH) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + std::tanh(k * (g + 0.044715f * g * g * g))) * u;
  }
  return g / (1.f + std::exp(-g)) * u;
}

// An optional bias (E, n) fp32, checked; nullptr when absent.
const float* checked_bias(const c10::optional<at::Tensor>& b, int64_t E, int64_t n, const char* name,
                          at::Tensor& keep) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == n, "moe_ffn: ", name, " must be (", E, ", ", n, ")");
  keep = b->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

Proj checked_proj(const at::Tensor& t, int64_t type, int64_t E, int64_t K, const char* name) {
  Layout L;
  TORCH_CHECK(layout_of(type, L) && L.block > 1, "moe_ffn: ", name, ": GGML type ", type, " has no block kernel");
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kByte && t.stride(2) == 1 && t.stride(1) == t.size(2),
              "moe_ffn: ", name, " must be uint8 (experts, out, bytes), each expert's rows contiguous");
  TORCH_CHECK(t.size(0) == E, "moe_ffn: ", name, " has ", t.size(0), " experts, gate has ", E);
  TORCH_CHECK(K % L.block == 0 && t.size(2) == K / L.block * L.bytes, "moe_ffn: ", name, " rows have ", t.size(2),
              " bytes, width ", K, " needs ", K / L.block * L.bytes);
  TORCH_CHECK(L.sub % VS == 0, "moe_ffn: sub-blocks of ", L.sub, " are not a multiple of ", VS);
  return {t.data_ptr<uint8_t>(), type, K, t.size(1), t.size(2), t.stride(0), L};
}

at::Tensor moe_ffn(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
                   const at::Tensor& up, const at::Tensor& down, int64_t gate_type, int64_t up_type,
                   int64_t down_type, int64_t act, const c10::optional<at::Tensor>& gate_bias,
                   const c10::optional<at::Tensor>& up_bias, const c10::optional<at::Tensor>& down_bias,
                   double limit, double alpha) {
  TORCH_CHECK(x.dim() == 2, "moe_ffn: x must be (rows, hidden)");
  TORCH_CHECK(act == SILU || act == GELU_TANH || act == SWIGLU_CLAMPED, "moe_ffn: activation ", act,
              " is not 0 (SiLU), 1 (GELU tanh) or 2 (clamped SwiGLU)");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong, "moe_ffn: ids must be int64 (",
              T, ", k)");
  const int64_t k = ids.size(1);
  TORCH_CHECK(weights.sizes() == ids.sizes(), "moe_ffn: weights must be (", T, ", ", k, ") like ids");
  TORCH_CHECK(gate.dim() == 3, "moe_ffn: gate must be (experts, out, bytes)");
  const int64_t E = gate.size(0), I = gate.size(1);
  const Proj pg = checked_proj(gate, gate_type, E, D, "gate");
  const Proj pu = checked_proj(up, up_type, E, D, "up");
  const Proj pd = checked_proj(down, down_type, E, I, "down");
  TORCH_CHECK(pu.N == I && pd.N == D, "moe_ffn: up must have ", I, " rows a expert and down ", D);
  at::Tensor gb_keep, ub_keep, db_keep;
  const float* gb = checked_bias(gate_bias, E, I, "gate_bias", gb_keep);
  const float* ub = checked_bias(up_bias, E, I, "up_bias", ub_keep);
  const float* db = checked_bias(down_bias, E, D, "down_bias", db_keep);
  const float lim = static_cast<float>(limit), alp = static_cast<float>(alpha);

  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor idc = ids.contiguous();
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int64_t* idp = idc.data_ptr<int64_t>();
  const float* wp = wf.data_ptr<float>();

  // Group the (token, slot) pairs by expert, in token order within each: start[e] .. start[e + 1].
  const int64_t A = T * k;
  std::vector<int64_t> start(E + 1, 0), slot_row(A), row_token(A);
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(idp[a] >= 0 && idp[a] < E, "moe_ffn: expert id ", idp[a], " is not in [0, ", E, ")");
    ++start[idp[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t r = fill[idp[a]]++;
      slot_row[a] = r;
      row_token[r] = a / k;
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);

  // The rows of x each expert multiplies, gathered (A, D), and their sub-block sums for gate and up.
  std::vector<float> xg(A * D);
  at::parallel_for(0, A, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(xg.data() + r * D, xp + row_token[r] * D, D * sizeof(float));
  });
  const std::vector<float> gsum = sub_sums(xg.data(), A, D, pg.L.sub);
  const std::vector<float> usum = pu.L.sub == pg.L.sub ? std::vector<float>() : sub_sums(xg.data(), A, D, pu.L.sub);
  const float* usp = usum.empty() ? gsum.data() : usum.data();

  // Experts with many rows take the panel GEMM: their rows packed once (PackedRows) for all their tasks.
  const auto packed = [&](const float* rows, int64_t K) {
    std::vector<std::unique_ptr<localllm::panel::PackedRows>> out(E);
    for (const int64_t e : active) {
      const int64_t M = start[e + 1] - start[e];
      if (M >= PANEL_ROWS) out[e] = std::make_unique<localllm::panel::PackedRows>(rows + start[e] * K, M, K);
    }
    return out;
  };
  // The tasks of a projection with `out` rows: (expert, first output row), every active expert's.
  const auto tasks_of = [&](int64_t out) {
    std::vector<std::pair<int64_t, int64_t>> tasks;
    for (const int64_t e : active)
      for (int64_t n0 = 0; n0 < out; n0 += CHUNK) tasks.emplace_back(e, n0);
    return tasks;
  };

  // Gate and up, then the activation: h (A, I).
  std::vector<float> h(A * I);
  {
    const auto xpk = packed(xg.data(), D);
    const auto tasks = tasks_of(I);
    const int64_t n = static_cast<int64_t>(tasks.size());
    localllm::in_turn(n, [&](const auto& claim) {
      std::vector<float> u;
      for (int64_t i = claim(); i < n; i = claim()) {
        const auto [e, n0] = tasks[i];
        const int64_t r0 = start[e], M = start[e + 1] - r0, n1 = std::min(I, n0 + CHUNK);
        u.resize(M * CHUNK);
        float* hg = h.data() + r0 * I;
        if (xpk[e]) {
          panel_dispatch(pg, e, *xpk[e], M, n0, hg, I);
          panel_dispatch(pu, e, *xpk[e], M, n0, u.data() - n0, CHUNK);
        } else {
          const float* xe = xg.data() + r0 * D;
          rows_dispatch(pg, e, xe, gsum.data() + r0 * (D / pg.L.sub), M, n0, n1, hg, I);
          rows_dispatch(pu, e, xe, usp + r0 * (D / pu.L.sub), M, n0, n1, u.data() - n0, CHUNK);
        }
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = n0; j < n1; ++j) {
            const float g = hg[m * I + j] + (gb ? gb[e * I + j] : 0.f);
            const float v = u[m * CHUNK + j - n0] + (ub ? ub[e * I + j] : 0.f);
            hg[m * I + j] = activate(g, v, act, lim, alp);
          }
      }
    });
  }

  // Down: yg (A, D), one row a (token, slot).
  std::vector<float> yg(A * D);
  {
    const std::vector<float> hsum = sub_sums(h.data(), A, I, pd.L.sub);
    const auto hpk = packed(h.data(), I);
    const auto tasks = tasks_of(D);
    const int64_t n = static_cast<int64_t>(tasks.size());
    localllm::in_turn(n, [&](const auto& claim) {
      for (int64_t i = claim(); i < n; i = claim()) {
        const auto [e, n0] = tasks[i];
        const int64_t r0 = start[e], M = start[e + 1] - r0, n1 = std::min(D, n0 + CHUNK);
        if (hpk[e]) {
          panel_dispatch(pd, e, *hpk[e], M, n0, yg.data() + r0 * D, D);
        } else {
          rows_dispatch(pd, e, h.data() + r0 * I, hsum.data() + r0 * (I / pd.L.sub), M, n0, n1, yg.data() + r0 * D, D);
        }
        if (db)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t j = n0; j < n1; ++j) yg[(r0 + m) * D + j] += db[e * D + j];
      }
    });
  }

  // Each token's slots weighted and summed in slot order.
  at::Tensor y = at::empty({T, D}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* yt = yp + t * D;
      std::fill(yt, yt + D, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wp[t * k + j];
        const float* src = yg.data() + slot_row[t * k + j] * D;
        for (int64_t d = 0; d < D; ++d) yt[d] += w * src[d];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def(
      "moe_ffn(Tensor x, Tensor ids, Tensor weights, Tensor gate, Tensor up, Tensor down, int gate_type, "
      "int up_type, int down_type, int act, Tensor? gate_bias=None, Tensor? up_bias=None, Tensor? down_bias=None, "
      "float limit=0., float alpha=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) { m.impl("moe_ffn", &moe_ffn); }
