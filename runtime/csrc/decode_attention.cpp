// One query per sequence over its keys and values in the paged KV pool: the batch engine's decode
// attention on the CPU (runtime/cpu_attention.py; eager and compiled steps both call it).
//
// A decode step attends one query per head over a few hundred keys: about 0.1 MFLOP a layer.
// torch's flash-attention CPU kernel spends ~20-30 us a call on that in blocking, buffer allocation
// and GEMM set-up; this kernel does the same arithmetic straight through, reading each sequence's
// blocks where they lie (never a gathered copy): a grouped query's heads share every key and value
// row they read, a head's output row stays in registers while the values stream past, and nothing
// is allocated but the output and a few scratch rows.
//
// Its rounding follows the flash kernel's for reduced-precision inputs (SDPA runs prefill): scores
// in fp32, scaled after the dot product, softmax with at::vec's exp_u20, probabilities rounded to the
// input dtype before they weight the values, fp32 accumulation, one division by the fp32 sum at the end.
//
// A layer with a sliding window passes it (window > 0): a query at position p then reads keys
// p - window + 1 .. p only, so a windowed model's step is the same code at every length (what the
// compiled step needs), and the blocks its window has left (given back to the pool) are never read.
//
// A float32 query also reads a float16 pool (``--kv-cache fp16``: half the bytes of an fp32 one),
// each row widened to fp32 as it is loaded; the arithmetic is the fp32 one.
//
// The _q8 op reads an 8-bit pool: int8 codes (.., block, hd) and an fp32 scale per row (.., block), a
// row being one token of one kv head (x ~= code * scale). Nothing is dequantized into a buffer: a key's
// scale multiplies its dot product with the query (s_l = (q . c_l) * scale_l * sc) and a value's
// scale its softmax weight (acc += (p_l * scale_l) * c_l), so a row is read as int8 only, converted
// to fp32 in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();

// Vec::size() elements of T from p, as fp32.
template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// Vec::size() int8 codes from p, as fp32.
template <>
inline Vec load_f<int8_t>(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[VS];
  for (int64_t i = 0; i < VS; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
#endif
}

// A cache row's scale: 1 for a float cache (rs == nullptr), the row's own for an int8 one.
inline float row_scale(const float* rs, int64_t rss, int64_t l) { return rs == nullptr ? 1.f : rs[l * rss]; }

#if defined(CPU_CAPABILITY_AVX512)
// Lane t of the result is the sum of r[t]'s 16 lanes, for 16 vectors at once: 15 additions and 30
// shuffles instead of 16 reductions of 8 ops each. Each sum is made by the tree hsum uses (lane i +
// lane i^8, then + i^4, + i^2, + i^1), so it has the same bits as reducing r[t] alone.
inline __m512 sum16(const __m512* r) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // rows 2i, 2i+1 in the halves: lane d + lane d+8
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // rows 4i .. 4i+3 in the quarters: + lane d+4
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: rows k and k+4 (then k+8, k+12): + lane d+2
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // + lane d+1: lane 4k + m holds row k + 4m
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}
#endif

// One vector's sum: vec_reduce_all's tree on AVX-512 (sum16's), whatever the compiler (ATen takes its
// shuffle tree only when GCC builds it), so that a row reduced alone rounds as in a group of 16.
inline float hsum(const Vec& a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 v = a;
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
#else
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
#endif
}

// q . k_l's partial sums (one vector; its lanes' sum is the dot product) for q held in NV registers:
// two chains, so the FMAs need not wait on each other.
template <typename T, int NV>
inline Vec dot_lanes(const Vec* qv, const T* kl) {
  Vec a0 = qv[0] * load_f(kl), a1(0.f);
  for (int c = 1; c < NV; ++c) {
    if (c % 2) a1 = at::vec::fmadd(qv[c], load_f(kl + c * VS), a1);
    else a0 = at::vec::fmadd(qv[c], load_f(kl + c * VS), a0);
  }
  return a0 + a1;
}

// dot_lanes of NK key rows ks apart, their chains interleaved (2 * NK FMAs in flight: two chains
// wait on the FMA's latency, a row at a time); each row's lanes have the bits dot_lanes gives it.
template <typename T, int NV, int NK>
inline void dot_lanes_rows(const Vec* qv, const T* kl, int64_t ks, Vec* out) {
  Vec a0[NK], a1[NK];
  for (int t = 0; t < NK; ++t) {
    a0[t] = qv[0] * load_f(kl + t * ks);
    a1[t] = Vec(0.f);
  }
  for (int c = 1; c < NV; ++c) {
    for (int t = 0; t < NK; ++t) {
      if (c % 2) a1[t] = at::vec::fmadd(qv[c], load_f(kl + t * ks + c * VS), a1[t]);
      else a0[t] = at::vec::fmadd(qv[c], load_f(kl + t * ks + c * VS), a0[t]);
    }
  }
  for (int t = 0; t < NK; ++t) out[t] = a0[t] + a1[t];
}

// s[j * ld + l] = (q_j . k_l) * scale for the G query rows qf (fp32) and the L key rows of kb.
// NV > 0: hd is NV vectors exactly, q_j held as NV vectors (in registers where they fit: not AVX2's
// 32 of hd 256, read from L1 then); NV == 0: any hd, through `row`.
// ksc: the rows' scales (stride kss) for int8 rows, nullptr for float ones.
template <typename T, int NV>
inline void scores(const float* qf, int64_t G, const T* kb, int64_t ks, int64_t L, int64_t hd, int64_t hv,
                   float sc, float* s, int64_t ld, const float* ksc = nullptr, int64_t kss = 0) {
  for (const auto j : c10::irange(G)) {
    const float* qj = qf + j * hd;
    if constexpr (NV > 0) {
      Vec qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = Vec::loadu(qj + c * VS);
      int64_t l0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
      for (; l0 + 16 <= L; l0 += 16) {  // 16 rows' dot products reduced together (sum16: the same bits)
        __m512 r[16];
        for (int t = 0; t < 16; ++t) r[t] = dot_lanes<T, NV>(qv, kb + (l0 + t) * ks);
        __m512 dot = sum16(r);
        if (ksc != nullptr) {
          alignas(64) float rsc[16];
          for (int t = 0; t < 16; ++t) rsc[t] = ksc[(l0 + t) * kss];
          dot = _mm512_mul_ps(dot, _mm512_load_ps(rsc));
        }
        _mm512_storeu_ps(s + j * ld + l0, _mm512_mul_ps(dot, _mm512_set1_ps(sc)));
      }
#else
      constexpr int NK = 4;  // rows interleaved (AVX-512 takes 16 above)
      for (; l0 + NK <= L; l0 += NK) {
        Vec r[NK];
        dot_lanes_rows<T, NV, NK>(qv, kb + l0 * ks, ks, r);
        for (int t = 0; t < NK; ++t) {
          const float dot = hsum(r[t]);
          s[j * ld + l0 + t] = ksc == nullptr ? dot * sc : dot * ksc[(l0 + t) * kss] * sc;
        }
      }
#endif
      for (int64_t l = l0; l < L; ++l) {
        const float dot = hsum(dot_lanes<T, NV>(qv, kb + l * ks));
        s[j * ld + l] = ksc == nullptr ? dot * sc : dot * ksc[l * kss] * sc;
      }
    } else {
      for (const auto l : c10::irange(L)) {
        const T* kl = kb + l * ks;
        Vec a(0.f);
        for (int64_t d = 0; d < hv; d += VS) a = at::vec::fmadd(Vec::loadu(qj + d), load_f(kl + d), a);
        float dot = hsum(a);
        for (int64_t d = hv; d < hd; ++d) dot += qj[d] * static_cast<float>(kl[d]);
        s[j * ld + l] = ksc == nullptr ? dot * sc : dot * ksc[l * kss] * sc;
      }
    }
  }
}

// acc[j] = sum_l p[j * ld + l] v_l for the G rows of probabilities p (fp32) over the L value rows of
// vb; with `add`, acc[j] += that sum, in the same order of operations (a paged sweep, block by block,
// rounds exactly as one sweep over the same rows). vsc: int8 rows' scales (stride vss), as in scores.
//
// weigh_heads is the same for GG query rows at once (GG * NV accumulators in registers): each value
// row is loaded once for all of them rather than once per row; every output element sees the same
// fmadds in the same order.
template <typename T, int NV, int GG>
inline void weigh_heads(const float* p, const T* vb, int64_t vs, int64_t L, int64_t hd, float* acc, int64_t ld,
                        bool add, const float* vsc, int64_t vss) {
  Vec a[GG][NV];
  for (int j = 0; j < GG; ++j)
    for (int c = 0; c < NV; ++c) a[j][c] = add ? Vec::loadu(acc + j * hd + c * VS) : Vec(0.f);
  for (const auto l : c10::irange(L)) {
    const T* vl = vb + l * vs;
    Vec v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load_f(vl + c * VS);
    const float rsc = row_scale(vsc, vss, l);
    for (int j = 0; j < GG; ++j) {
      const Vec w(p[j * ld + l] * rsc);
      for (int c = 0; c < NV; ++c) a[j][c] = at::vec::fmadd(w, v[c], a[j][c]);
    }
  }
  for (int j = 0; j < GG; ++j)
    for (int c = 0; c < NV; ++c) a[j][c].store(acc + j * hd + c * VS);
}

// The most vectors of an output row weigh keeps in registers: half the registers (AVX2 16, AVX-512 32).
constexpr int ROW_VECS = VS >= 16 ? 16 : 8;

template <typename T, int NV>
inline void weigh(const float* p, int64_t G, const T* vb, int64_t vs, int64_t L, int64_t hd, int64_t hv,
                  float* acc, int64_t ld, bool add, const float* vsc = nullptr, int64_t vss = 0) {
  if constexpr (NV > ROW_VECS && NV % ROW_VECS == 0) {  // a row wider than that (AVX2, hd 256): in slices,
    for (int c0 = 0; c0 < NV; c0 += ROW_VECS)            // each output element's fmadds as in one sweep
      weigh<T, ROW_VECS>(p, G, vb + c0 * VS, vs, L, hd, hv, acc + c0 * VS, ld, add, vsc, vss);
    return;
  }
  if constexpr (NV > 0 && NV <= 4) {  // hd <= 4 vectors: the heads' accumulators fit AVX-512's registers
    switch (G) {
      case 2: return weigh_heads<T, NV, 2>(p, vb, vs, L, hd, acc, ld, add, vsc, vss);
      case 3: return weigh_heads<T, NV, 3>(p, vb, vs, L, hd, acc, ld, add, vsc, vss);
      case 4: return weigh_heads<T, NV, 4>(p, vb, vs, L, hd, acc, ld, add, vsc, vss);
      default: break;
    }
  }
  for (const auto j : c10::irange(G)) {
    const float* pj = p + j * ld;
    float* aj = acc + j * hd;
    if constexpr (NV > 0) {
      Vec a[NV];  // the output row in registers for the whole sweep over the values
      for (int c = 0; c < NV; ++c) a[c] = add ? Vec::loadu(aj + c * VS) : Vec(0.f);
      for (const auto l : c10::irange(L)) {
        const Vec w(pj[l] * row_scale(vsc, vss, l));
        const T* vl = vb + l * vs;
        for (int c = 0; c < NV; ++c) a[c] = at::vec::fmadd(w, load_f(vl + c * VS), a[c]);
      }
      for (int c = 0; c < NV; ++c) a[c].store(aj + c * VS);
    } else {
      if (!add) std::fill(aj, aj + hd, 0.f);
      for (const auto l : c10::irange(L)) {
        const float wl = pj[l] * row_scale(vsc, vss, l);
        const Vec w(wl);
        const T* vl = vb + l * vs;
        for (int64_t d = 0; d < hv; d += VS) at::vec::fmadd(w, load_f(vl + d), Vec::loadu(aj + d)).store(aj + d);
        for (int64_t d = hv; d < hd; ++d) aj[d] += wl * static_cast<float>(vl[d]);
      }
    }
  }
}

// int8 rows are converted to fp32 this many at a time into a scratch block, then read as float rows
// by all G query heads: one conversion per row rather than one per row and head. The values and the
// order of operations are those of reading the int8 rows directly, so the results are the same.
constexpr int64_t RB = 32;

// Rows n of src (int8, row stride ss) as fp32 into buf (n, hd) contiguous.
inline void to_float(const int8_t* src, int64_t ss, int64_t n, int64_t hd, int64_t hv, float* buf) {
  for (const auto r : c10::irange(n)) {
    const int8_t* row = src + r * ss;
    float* out = buf + r * hd;
    for (int64_t d = 0; d < hv; d += VS) load_f(row + d).store(out + d);
    for (int64_t d = hv; d < hd; ++d) out[d] = static_cast<float>(row[d]);
  }
}

// scores over rows of KT: float rows (or a single query head) directly, int8 rows for several heads a
// block at a time through buf (RB * hd floats).
template <typename KT, int NV>
inline void scores_rows(const float* qf, int64_t G, const KT* kb, int64_t ks, int64_t L, int64_t hd, int64_t hv,
                        float sc, float* s, int64_t ld, const float* ksc, int64_t kss, float* buf) {
  if constexpr (std::is_same_v<KT, int8_t>) {
    if (G > 1) {
      for (int64_t first = 0; first < L; first += RB) {
        const int64_t n = std::min(RB, L - first);
        to_float(kb + first * ks, ks, n, hd, hv, buf);
        scores<float, NV>(qf, G, buf, hd, n, hd, hv, sc, s + first, ld, ksc + first * kss, kss);
      }
      return;
    }
  }
  scores<KT, NV>(qf, G, kb, ks, L, hd, hv, sc, s, ld, ksc, kss);
}

// weigh over rows of KT, as scores_rows (blocks after the first add to the accumulators: the same
// sequence of operations per output element as one sweep).
template <typename KT, int NV>
inline void weigh_rows(const float* p, int64_t G, const KT* vb, int64_t vs, int64_t L, int64_t hd, int64_t hv,
                       float* acc, int64_t ld, bool add, const float* vsc, int64_t vss, float* buf) {
  if constexpr (std::is_same_v<KT, int8_t>) {
    if (G > 1) {
      for (int64_t first = 0; first < L; first += RB) {
        const int64_t n = std::min(RB, L - first);
        to_float(vb + first * vs, vs, n, hd, hv, buf);
        weigh<float, NV>(p + first, G, buf, hd, n, hd, hv, acc, ld, add || first > 0, vsc + first * vss, vss);
      }
      return;
    }
  }
  weigh<KT, NV>(p, G, vb, vs, L, hd, hv, acc, ld, add, vsc, vss);
}

// Softmax numerators exp(s - max) in place over one row of L scores; returns their fp32 sum. With a
// sink (gpt-oss: a learned logit of the head, finite), it joins the max and the sum, and has no value.
template <typename T>
inline float softmax_row(float* sj, int64_t L, const float* sink = nullptr) {
  float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sj, L);
  if (sink != nullptr) mx = std::max(mx, *sink);
  at::vec::map<float>([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, sj, sj, L);
  float sum = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sj, L);
  if (sink != nullptr) sum += std::exp(*sink - mx);
  // rounded to the input dtype, as the flash kernel's second GEMM reads them
  if constexpr (!std::is_same_v<T, float>) {
    for (const auto l : c10::irange(L)) sj[l] = static_cast<float>(static_cast<T>(sj[l]));
  }
  return sum;
}

// Scales of an int8 cache's rows (.., L) fp32, or none for a float cache.
struct RowScales {
  const float* k = nullptr;
  const float* v = nullptr;
  at::IntArrayRef ks, vs;  // strides of the scale tensors
};

// Asks for the n rows of a block (stride rs elements, hd each) ahead of use. A block's rows sit in
// memory of their own (the pool hands blocks out in any order), so the hardware's stream prefetcher
// starts cold at each one: at a batch's contexts the sweep waited on memory at every block. They are
// asked into L2 (locality 2), not L1: a block is 64 lines, and prefetches into L1 queue behind L1's
// few outstanding misses (into L1, a batch's sweep read about 13 GB/s; into L2, about 19).
constexpr int64_t PREFETCH_BLOCKS = 4;  // blocks asked for ahead of the one read (16 KB of fp32 rows)

template <typename KT>
inline void prefetch_block(const KT* p, int64_t n, int64_t rs, int64_t hd) {
  for (int64_t r = 0; r < n; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * rs);
    for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(KT)); b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// The first key position a query at position L - 1 sees: L - window under a sliding window (window
// > 0), else 0. Keys before it may sit in blocks the pool has given back (their table entries -1).
inline int64_t window_start(int64_t L, int64_t window) { return window > 0 ? std::max<int64_t>(0, L - window) : 0; }

// Paged, variable-length batch: sequence b's keys/values are rows start_b .. lens[b] - 1 (start_b:
// window_start) of the blocks tables[b][0], tables[b][1], ... of the pools (n_blocks, KV, block, hd)
// (row p in block p / block, at row p % block). Scores go block by block into one row, one softmax
// over them, values block by block into the same accumulators: each key's dot product, the softmax
// and each output element see the same operations in the same order whatever the blocks' placement.
//
// Several query rows of one sequence (a verify chunk under speculative decoding: consecutive rows with
// lengths one apart whose tables agree on every block the shorter row reads) are one task: each key and
// value row is read from memory once for all of them, where one task a row read the whole context again
// for each. The chunk's last row's table serves all its rows (it agrees with each earlier row's on that
// row's blocks; the engine cuts each row's table to the blocks it reaches). A row's own arithmetic does
// not change (its scores, a softmax over its own keys, its values added in order of position), so each
// row has the bits it has alone.
constexpr int64_t MAX_CHUNK = 16;  // query rows of one sequence taken as one task at most

// weigh_rows over a part of the head dimension, dn wide (the caller offsets vb and hands acc rows of
// dn): rows in registers where dn is 1, 2, 4, 8 or 16 vectors. Each output element sees the fmadds it
// sees in a sweep over the whole head dimension, so a part has the bits of those columns of the whole.
template <typename KT>
inline void weigh_rows_any(int64_t dn, const float* p, int64_t G, const KT* vb, int64_t vs, int64_t L, float* acc,
                           int64_t ld, bool add, const float* vsc, int64_t vss, float* buf) {
  const int64_t hv = dn / VS * VS;
  if (dn % VS == 0) {
    switch (dn / VS) {
      case 1: return weigh_rows<KT, 1>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      case 2: return weigh_rows<KT, 2>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      case 4: return weigh_rows<KT, 4>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      case 8: return weigh_rows<KT, 8>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      case 16: return weigh_rows<KT, 16>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      case 32: return weigh_rows<KT, 32>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
      default: break;
    }
  }
  weigh_rows<KT, 0>(p, G, vb, vs, L, dn, hv, acc, ld, add, vsc, vss, buf);
}

// Paged, variable-length batch: sequence b's keys/values are rows start_b .. lens[b] - 1 (start_b:
// window_start) of the blocks tables[b][0], tables[b][1], ... of the pools (n_blocks, KV, block, hd)
// (row p in block p / block, at row p % block). Scores go block by block into one row, one softmax
// over them, values block by block into the same accumulators: each key's dot product, the softmax
// and each output element see the same operations in the same order whatever the blocks' placement.
//
// Several query rows of one sequence (a verify chunk under speculative decoding: consecutive rows with
// lengths one apart whose tables agree on every block the shorter row reads) are one task: each key and
// value row is read from memory once for all of them, where one task a row read the whole context again
// for each. The chunk's last row's table serves all its rows (it agrees with each earlier row's on that
// row's blocks; the engine cuts each row's table to the blocks it reaches). A row's own arithmetic does
// not change (its scores, a softmax over its own keys, its values added in order of position), so each
// row has the bits it has alone.
//
// A task is (chunk, kv head). With at least twice as many tasks as threads, each thread runs whole
// tasks. With fewer (one sequence of a model with one or a few kv heads: a single stream's decode
// step), whole tasks left threads idle, so each task is split: its keys' scores by ranges of blocks,
// then (after each row's softmax) its values by ranges of the head dimension, each part on a thread of
// its own. Every score and every output element is made by the same operations as in a whole task, so
// the bits depend neither on the split nor on the number of threads.
template <typename T, typename KT, int NV>
void attend_paged(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, int64_t window, at::Tensor& y, const RowScales& rs,
                  const float* sinks) {
  // q (S, KV, G, hd) with unit stride on hd; pools with unit stride on hd (T, or int8 codes with rs's
  // scales (n_blocks, KV, block)); y (S, KV, G, hd) contiguous.
  const int64_t S = q.size(0), KV = q.size(1), G = q.size(2), hd = q.size(3), bs = kp.size(2);
  const int64_t W = tables.size(1);
  const int64_t hv = hd / VS * VS;  // the part of a row taken a vector at a time; the rest one by one
  const T* qp = q.data_ptr<T>();
  const KT* kpp = kp.data_ptr<KT>();
  const KT* vpp = vp.data_ptr<KT>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* yp = y.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  // Chunks: rows first[c] .. first[c + 1] - 1.
  std::vector<int64_t> first{0};
  for (int64_t b = 1; b < S; ++b) {
    const int64_t reach = (lp[b - 1] + bs - 1) / bs;  // the blocks row b - 1 reads: row b has them too
    const bool same = lp[b] == lp[b - 1] + 1 && b - first.back() < MAX_CHUNK &&
                      std::equal(tp + (b - 1) * W, tp + (b - 1) * W + reach, tp + b * W);
    if (!same) first.push_back(b);
  }
  first.push_back(S);
  const int64_t C = static_cast<int64_t>(first.size()) - 1;
  // A chunk's rows and keys: rows b0 .. b0 + R - 1 (Q query rows with their heads), keys from its
  // first row's first key (start) to its last row's last (end); blocks i0 .. nb - 1 hold them.
  struct Chunk {
    int64_t b0, R, Q, start, end, keys, i0, nb;
    const int32_t* table;  // the chunk's last row's
  };
  const auto chunk = [&](int64_t c) {
    Chunk k;
    k.b0 = first[c];
    k.R = first[c + 1] - k.b0;
    k.Q = k.R * G;
    k.start = window_start(lp[k.b0], window);
    k.end = lp[first[c + 1] - 1];
    k.keys = k.end - k.start;  // s's row stride: row r * G + j, key p at column p - start
    k.i0 = k.start / bs;
    k.nb = (k.end + bs - 1) / bs;
    k.table = tp + (k.b0 + k.R - 1) * W;
    return k;
  };
  int64_t max_scores = 1, max_rows = 1, total = 0;  // a task's scores (rows x keys) and rows at most
  for (const auto c : c10::irange(C)) {
    const Chunk k = chunk(c);
    max_scores = std::max(max_scores, k.R * k.keys);
    max_rows = std::max(max_rows, k.R);
    total += k.keys;
  }
  const int64_t GR = max_rows * G;  // query rows of a task at most
  const int64_t buf_size = std::is_same_v<KT, int8_t> ? RB * hd : 0;
  // Row r of chunk k sees keys [lo_r, hi_r): lo_r rises with r under a window, hi_r = lens[b0 + r].
  const auto lo_of = [&](const Chunk& k, int64_t r) { return window_start(lp[k.b0 + r], window); };
  const auto hi_of = [&](const Chunk& k, int64_t r) { return static_cast<int64_t>(lp[k.b0 + r]); };
  // The keys of block i that the chunk sees: positions lo .. lo + n - 1.
  const auto rows_of = [&](const Chunk& k, int64_t i, int64_t& lo, int64_t& n) {
    lo = std::max(k.start, i * bs);
    n = std::min(k.end, (i + 1) * bs) - lo;
  };
  // Asks for block i's rows seen (keys, or values), columns d0 .. d0 + dn - 1, ahead of their use.
  const auto ask = [&](const Chunk& k, int64_t h, int64_t i, bool value, int64_t d0, int64_t dn) {
    int64_t lo, rows;
    rows_of(k, i, lo, rows);
    const at::Tensor& pool = value ? vp : kp;
    prefetch_block((value ? vpp : kpp) + k.table[i] * pool.stride(0) + h * pool.stride(1) +
                       (lo - i * bs) * pool.stride(2) + d0, rows, pool.stride(2), dn);
  };
  // The task's query rows in fp32: qf (Q, hd).
  const auto load_queries = [&](const Chunk& k, int64_t h, float* qf) {
    const int64_t qs = q.stride(2);
    for (const auto r : c10::irange(k.R)) {
      const T* qb = qp + (k.b0 + r) * q.stride(0) + h * q.stride(1);
      for (const auto j : c10::irange(G)) {
        for (const auto d : c10::irange(hd)) qf[(r * G + j) * hd + d] = static_cast<float>(qb[j * qs + d]);
      }
    }
  };
  // Every row's scores over the keys of blocks ib .. ie - 1, asking for a few blocks ahead of the
  // one read (past ie, with then_values, the first blocks of values).
  const auto score_blocks = [&](const Chunk& k, int64_t h, int64_t ib, int64_t ie, bool then_values,
                                const float* qf, float* s, float* buf) {
    const auto ahead = [&](int64_t i) {
      if (i < ie) ask(k, h, i, false, 0, hd);
      else if (then_values && i - ie + k.i0 < k.nb) ask(k, h, i - ie + k.i0, true, 0, hd);
    };
    for (int64_t a = 0; a < PREFETCH_BLOCKS; ++a) ahead(ib + a);
    for (int64_t i = ib; i < ie; ++i) {
      int64_t lo, n;
      rows_of(k, i, lo, n);
      ahead(i + PREFETCH_BLOCKS);
      const int64_t r0 = lo - i * bs;  // the block's first row seen
      const KT* kb = kpp + k.table[i] * kp.stride(0) + h * kp.stride(1) + r0 * kp.stride(2);
      const float* ksc = rs.k == nullptr ? nullptr : rs.k + k.table[i] * rs.ks[0] + h * rs.ks[1] + r0 * rs.ks[2];
      scores_rows<KT, NV>(qf, k.Q, kb, kp.stride(2), n, hd, hv, sc, s + (lo - k.start), k.keys, ksc,
                          ksc ? rs.ks[2] : 0, buf);
    }
  };
  // Each row's softmax over its own keys (and kv head h's query head's sink); sums (Q) their fp32 sums.
  const auto softmax = [&](const Chunk& k, int64_t h, float* s, float* sums) {
    for (const auto r : c10::irange(k.R)) {
      for (const auto j : c10::irange(G)) {
        sums[r * G + j] = softmax_row<T>(s + (r * G + j) * k.keys + (lo_of(k, r) - k.start), hi_of(k, r) - lo_of(k, r),
                                         sinks == nullptr ? nullptr : sinks + h * G + j);
      }
    }
  };
  // Columns d0 .. d0 + dn - 1 of every row's output: the values weighed by the probabilities s into
  // acc (Q, dn), then divided by the rows' sums into y (`asked`: the first blocks were asked for).
  const auto weigh_out = [&](const Chunk& k, int64_t h, int64_t d0, int64_t dn, bool asked, const float* s,
                             const float* sums, float* acc, float* buf) {
    for (int64_t i = k.i0; !asked && i < std::min(k.nb, k.i0 + PREFETCH_BLOCKS); ++i) ask(k, h, i, true, d0, dn);
    std::fill(acc, acc + k.Q * dn, 0.f);
    // Values [a, e) of block i into rows [r, r + rn)'s accumulators, after what they hold.
    const auto weigh_part = [&](int64_t i, int64_t a, int64_t e, int64_t r, int64_t rn) {
      if (a >= e) return;
      const int64_t r0 = a - i * bs;
      const KT* vb = vpp + k.table[i] * vp.stride(0) + h * vp.stride(1) + r0 * vp.stride(2) + d0;
      const float* vsc = rs.v == nullptr ? nullptr : rs.v + k.table[i] * rs.vs[0] + h * rs.vs[1] + r0 * rs.vs[2];
      weigh_rows_any<KT>(dn, s + r * G * k.keys + (a - k.start), rn * G, vb, vp.stride(2), e - a,
                         acc + r * G * dn, k.keys, true, vsc, vsc ? rs.vs[2] : 0, buf);
    };
    for (int64_t i = k.i0; i < k.nb; ++i) {
      int64_t lo, n;
      rows_of(k, i, lo, n);
      if (i + PREFETCH_BLOCKS < k.nb) ask(k, h, i + PREFETCH_BLOCKS, true, d0, dn);
      // The keys every row sees, [shared_lo, shared_hi), once for all rows; each row's own before and
      // after them: per row, in order of position.
      const int64_t shared_lo = std::max(lo, lo_of(k, k.R - 1)), shared_hi = std::min(lo + n, hi_of(k, 0));
      if (shared_lo >= shared_hi) {
        for (const auto r : c10::irange(k.R)) weigh_part(i, std::max(lo, lo_of(k, r)), std::min(lo + n, hi_of(k, r)), r, 1);
        continue;
      }
      for (const auto r : c10::irange(k.R)) weigh_part(i, std::max(lo, lo_of(k, r)), shared_lo, r, 1);
      weigh_part(i, shared_lo, shared_hi, 0, k.R);
      for (const auto r : c10::irange(k.R)) weigh_part(i, shared_hi, std::min(lo + n, hi_of(k, r)), r, 1);
    }
    for (const auto r : c10::irange(k.R)) {
      T* yb = yp + ((k.b0 + r) * KV + h) * G * hd + d0;
      for (const auto j : c10::irange(G)) {
        const float inv = 1.f / sums[r * G + j];
        for (const auto d : c10::irange(dn)) yb[j * hd + d] = static_cast<T>(acc[(r * G + j) * dn + d] * inv);
      }
    }
  };
  const int64_t tasks = C * KV, threads = at::get_num_threads();
  const int64_t mean = std::max<int64_t>(1, total / std::max<int64_t>(1, C));
  if (threads > 1 && tasks < 2 * threads && mean * G * hd >= (int64_t{1} << 15) && !at::in_parallel_region()) {
    // Few tasks: `parts` parts a task, as ranges of its blocks (scores) and of the head dimension
    // (values, whole vectors a part), so that every thread has work in both passes.
    const int64_t parts = (2 * threads + tasks - 1) / tasks, dparts = std::min(parts, std::max<int64_t>(1, hd / VS));
    std::vector<float> qf(tasks * GR * hd), s(tasks * G * max_scores), sums(tasks * GR);
    for (const auto t : c10::irange(tasks)) load_queries(chunk(t / KV), t % KV, qf.data() + t * GR * hd);
    at::parallel_for(0, tasks * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(buf_size);
      for (const auto u : c10::irange(begin, end)) {
        const int64_t t = u / parts, p = u % parts;
        const Chunk k = chunk(t / KV);
        const int64_t nk = k.nb - k.i0;
        score_blocks(k, t % KV, k.i0 + nk * p / parts, k.i0 + nk * (p + 1) / parts, false, qf.data() + t * GR * hd,
                     s.data() + t * G * max_scores, buf.data());
      }
    });
    for (const auto t : c10::irange(tasks))
      softmax(chunk(t / KV), t % KV, s.data() + t * G * max_scores, sums.data() + t * GR);
    at::parallel_for(0, tasks * dparts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(GR * hd), buf(buf_size);
      for (const auto u : c10::irange(begin, end)) {
        const int64_t t = u / dparts, p = u % dparts, nv = hd / VS;
        const int64_t d0 = nv * p / dparts * VS, d1 = p + 1 == dparts ? hd : nv * (p + 1) / dparts * VS;
        weigh_out(chunk(t / KV), t % KV, d0, d1 - d0, false, s.data() + t * G * max_scores, sums.data() + t * GR,
                  acc.data(), buf.data());
      }
    });
    return;
  }
  // Whole tasks across threads, once a task is big enough to pay for waking them (a hundred keys or
  // so at GQA 3, head size 64).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, mean * G * hd));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(GR * hd), s(G * max_scores), acc(GR * hd), sums(GR), buf(buf_size);
    for (const auto t : c10::irange(begin, end)) {
      const Chunk k = chunk(t / KV);
      const int64_t h = t % KV;
      load_queries(k, h, qf.data());
      score_blocks(k, h, k.i0, k.nb, true, qf.data(), s.data(), buf.data());
      softmax(k, h, s.data(), sums.data());
      weigh_out(k, h, 0, hd, true, s.data(), sums.data(), acc.data(), buf.data());
    }
  });
}

// The usual head sizes (a whole number of vectors up to 32: hd 256 on AVX2) with rows held in registers.
template <typename T, typename KT = T>
void attend_paged_any(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& tables,
                      const at::Tensor& lens, double scale, int64_t window, at::Tensor& y, const RowScales& rs = {},
                      const float* sinks = nullptr) {
  const int64_t hd = q.size(3);
  if (hd % VS != 0) return attend_paged<T, KT, 0>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
  switch (hd / VS) {
    case 1: return attend_paged<T, KT, 1>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    case 2: return attend_paged<T, KT, 2>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    case 4: return attend_paged<T, KT, 4>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    case 8: return attend_paged<T, KT, 8>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    case 16: return attend_paged<T, KT, 16>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    case 32: return attend_paged<T, KT, 32>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
    default: return attend_paged<T, KT, 0>(q, kp, vp, tables, lens, scale, window, y, rs, sinks);
  }
}

// The paged ops' checks: shapes, and tables that stay inside the pool where they are read (a bad one
// would read outside it; entries before a window's first block are never read).
void check_paged(const char* op, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& tables, const at::Tensor& lens, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.dim() == 4, op, ": q, k_pool, v_pool must be 4-D");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), op, ": k_pool and v_pool must have the same shape");
  TORCH_CHECK(q.size(1) == k_pool.size(1) && q.size(3) == k_pool.size(3),
              op, ": q (S, KV, G, hd) does not match the pools (n_blocks, KV, block, hd)");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, op, ": the pools' rows must have unit stride");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt && tables.size(0) == q.size(0),
              op, ": block_tables must be (S, max_blocks) int32");
  TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kInt && lens.size(0) == q.size(0),
              op, ": context_lens must be (S,) int32");
  TORCH_CHECK(window >= 0, op, ": window must be 0 (none) or positive, not ", window);
  const int64_t n_blocks = k_pool.size(0), bs = k_pool.size(2), W = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (const auto b : c10::irange(q.size(0))) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, op, ": sequence ", b, " has context length ",
                lp[b], ", its table holds ", W * bs);
    for (int64_t i = window_start(lp[b], window) / bs; i * bs < lp[b]; ++i) {
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < n_blocks, op, ": block id ",
                  tp[b * W + i], " of sequence ", b, " is outside the pool of ", n_blocks);
    }
  }
}

// Optional sinks: fp32 (KV * G,), one per query head, kept alive in `keep`; nullptr when absent.
const float* checked_sinks(const char* op, const at::Tensor& q, const c10::optional<at::Tensor>& sinks, at::Tensor& keep) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1) * q.size(2), op, ": sinks must be (", q.size(1) * q.size(2),
              ",), one per query head");
  keep = sinks->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// An int8 cache's scales: fp32 (.., L) beside codes (.., L, hd).
void check_scales(const char* op, const at::Tensor& codes, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, op, ": ", name, " codes must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.sizes() == codes.sizes().slice(0, 3),
              op, ": ", name, " scales must be float32 of the codes' shape without the head dim");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& sinks) {
  const char* op = "paged_decode_attention";
  const bool half_pool = q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kHalf;  // an fp16 pool
  TORCH_CHECK((q.scalar_type() == k_pool.scalar_type() || half_pool) && k_pool.scalar_type() == v_pool.scalar_type(),
              op, ": q, k_pool, v_pool must share a dtype (or float32 q over float16 pools)");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  check_paged(op, q, k_pool, v_pool, tables, lens, window);
  at::Tensor sink_keep;
  const float* sp = checked_sinks(op, q, sinks, sink_keep);
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor y = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return y;
  if (half_pool) {
    attend_paged_any<float, at::Half>(qc, k_pool, v_pool, tables, lens, scale, window, y, {}, sp);
    return y;
  }
  switch (q.scalar_type()) {
    case at::kFloat: attend_paged_any<float>(qc, k_pool, v_pool, tables, lens, scale, window, y, {}, sp); break;
    case at::kBFloat16: attend_paged_any<at::BFloat16>(qc, k_pool, v_pool, tables, lens, scale, window, y, {}, sp); break;
    case at::kHalf: attend_paged_any<at::Half>(qc, k_pool, v_pool, tables, lens, scale, window, y, {}, sp); break;
    default: TORCH_CHECK(false, op, ": dtype ", q.scalar_type(), " is not float, bfloat16 or half");
  }
  return y;
}

at::Tensor paged_decode_attention_q8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& k_scale,
                                     const at::Tensor& v_pool, const at::Tensor& v_scale,
                                     const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                     int64_t window, const c10::optional<at::Tensor>& sinks) {
  const char* op = "paged_decode_attention_q8";
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  check_paged(op, q, k_pool, v_pool, tables, lens, window);
  check_scales(op, k_pool, k_scale, "k");
  check_scales(op, v_pool, v_scale, "v");
  at::Tensor sink_keep;
  const float* sp = checked_sinks(op, q, sinks, sink_keep);
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const RowScales rs{k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), k_scale.strides(), v_scale.strides()};
  at::Tensor y = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return y;
  switch (q.scalar_type()) {
    case at::kFloat: attend_paged_any<float, int8_t>(qc, k_pool, v_pool, tables, lens, scale, window, y, rs, sp); break;
    case at::kBFloat16: attend_paged_any<at::BFloat16, int8_t>(qc, k_pool, v_pool, tables, lens, scale, window, y, rs, sp); break;
    case at::kHalf: attend_paged_any<at::Half, int8_t>(qc, k_pool, v_pool, tables, lens, scale, window, y, rs, sp); break;
    default: TORCH_CHECK(false, op, ": dtype ", q.scalar_type(), " is not float, bfloat16 or half");
  }
  return y;
}

}  // namespace

// window: the attention window of the layer (0: none): a query at position p sees keys p - window + 1 .. p.
TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("paged_decode_attention_q8(Tensor q, Tensor k_pool, Tensor k_scale, Tensor v_pool, Tensor v_scale, "
        "Tensor block_tables, Tensor context_lens, float scale, int window=0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_q8", &paged_decode_attention_q8);
}
