// A prefill chunk's attention on the CPU, over its sequence's keys and values where they lie in the
// paged KV pool: the rows of one sequence at consecutive positions, each seeing the keys up to its own
// position (and, in a sliding-window layer, no older than its window), the chunk's own keys included
// (the step writes them to the pool first).
//
// What it replaces: a gather of the sequence's whole history out of its blocks (a copy of every key and
// value, per layer) and torch's flash-attention kernel over the copy, whose GEMMs come from MKL (a
// library that picks its own instructions) and which takes a materialised mask for any chunk that does
// not start at position 0 or that a window cuts. Here the keys are read in place, 16 at a time,
// through the fp32 register tiles of the quantized GEMMs (quant/csrc/panel_gemm.h): a tile of query
// rows (every head of one kv head's group) is multiplied by a chunk of 16 keys turned into a panel,
// scores go through an online softmax (flash attention's running maximum and sum), and the
// probabilities multiply the 16 value rows as they lie in the block. Chunks above a tile's last row, or
// older than its first row's window, are never read.
//
// Each row's arithmetic depends only on its own position and the keys: chunks follow the pool's blocks
// (16 keys at a time from each block's start), a chunk with no key a row sees leaves that row's state
// untouched, and no sum runs across rows. So a row has the same bits whatever chunk of the prompt it
// arrives in and whatever rows share its tile: a prompt prefilled whole or in chunks, or served from the
// prefix cache in part, attends alike.
//
//   localllm::paged_chunk_attention(q (n, KV, G, hd) fp32, k_pool, v_pool (n_blocks, KV, block, hd) fp32,
//       fp16 or bf16, blocks (nb,) long, first_pos, q_pos, window, scale) -> (n, KV, G, hd) fp32
//
// blocks: the sequence's block table from the block holding key position first_pos on (first_pos a
// multiple of the block size); row i of q sits at position q_pos + i. window 0: every earlier key.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../quant/csrc/panel_gemm.h"

namespace {

namespace panel = localllm::panel;
using panel::MR;
using panel::NV;
using panel::V;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t KC = panel::WIDTH;  // keys a chunk: one panel's columns
constexpr int64_t VS = Vec::size();
static_assert(KC % VS == 0, "a chunk's scores must be whole vectors");

// a[r] += sum over k < n of x[r * xs + k] * w[k * ws ..], w's rows NV vectors each: the register tile
// both products below are made of (each w row loaded once for the R rows, one broadcast a row).
template <int R>
inline void fma_rows(V (&a)[R][NV], const float* x, int64_t xs, const float* w, int64_t ws, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    V wk[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wk[j] = panel::vload(w + k * ws + j * Vec::size());
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xb = panel::vset(x[r * xs + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) a[r][j] = panel::vfma(wk[j], xb, a[r][j]);
    }
  }
}

// s (R, KC) = q (R, hd) . kt (hd, KC): kt holds the chunk's keys as a panel (column j is key j).
template <int R>
inline void scores(const float* q, int64_t hd, const float* kt, float* s) {
  V a[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) a[r][j] = panel::vset(0.f);
  fma_rows<R>(a, q, hd, kt, KC, hd);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) panel::vstore(s + r * KC + j * Vec::size(), a[r][j]);
}

// acc (R, hd) += p (R, KC) . v (nv, hd), rows of v ld apart: KC columns of the output at a time in
// registers.
template <int R>
inline void weigh(const float* p, const float* v, int64_t ld, int64_t nv, int64_t hd, float* acc) {
  for (int64_t c = 0; c < hd; c += KC) {
    V a[R][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) a[r][j] = panel::vload(acc + r * hd + c + j * Vec::size());
    fma_rows<R>(a, p, KC, v + c, ld, nv);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) panel::vstore(acc + r * hd + c + j * Vec::size(), a[r][j]);
  }
}

// n rows of src (T, ld apart) as fp32 rows hd apart into dst, and rows n .. KC - 1 zero.
template <typename T>
inline void rows_to_float(const T* src, int64_t ld, int64_t n, int64_t hd, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst + r * hd, src + r * ld, hd * sizeof(float));
    } else {
      for (int64_t d = 0; d < hd; ++d) dst[r * hd + d] = static_cast<float>(src[r * ld + d]);
    }
  }
  std::fill(dst + n * hd, dst + KC * hd, 0.f);
}

constexpr int64_t NC = KC / VS;  // vectors a chunk's scores

// A row's scores si (KC) of which keys first .. last are its own (the others it does not see): folded
// into its running maximum m and sum l, and its value sums acc (hd) rescaled when the maximum rises;
// si becomes the probabilities (0 for the keys that are not its own). idx: the lanes' key indices.
inline void online_softmax(float* si, int64_t first, int64_t last, const Vec* idx, float& m, float& l, float* acc,
                           int64_t hd) {
  Vec sc[NC];
  const Vec lo(static_cast<float>(first)), hi(static_cast<float>(last)), none(-std::numeric_limits<float>::infinity());
  const bool whole = first == 0 && last == KC - 1;
  for (int64_t c = 0; c < NC; ++c) {
    sc[c] = Vec::loadu(si + c * VS);
    if (!whole) sc[c] = Vec::blendv(none, sc[c], (idx[c] >= lo) & (idx[c] <= hi));
  }
  Vec top = sc[0];
  for (int64_t c = 1; c < NC; ++c) top = at::vec::maximum(top, sc[c]);
  const float mnew = std::max(m, at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top));
  if (mnew != m) {  // a new maximum: rescale what the row has so far (nothing, the first time)
    const float alpha = std::exp(m - mnew);
    l *= alpha;
    for (int64_t d = 0; d < hd; d += VS) (Vec::loadu(acc + d) * Vec(alpha)).store(acc + d);
    m = mnew;
  }
  Vec sum(0.f);
  for (int64_t c = 0; c < NC; ++c) {
    const Vec p = (sc[c] - Vec(mnew)).exp_u20();  // exp(-inf) = 0: keys not its own weigh nothing
    p.store(si + c * VS);
    sum = sum + p;
  }
  l += at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

struct Shape {
  int64_t n, KV, G, hd, bs;
};

// One tile: rows r0 .. r1 - 1 of the chunk, the G heads of kv head h (query vector i = row r0 + i / G,
// head i % G), over their keys chunk by chunk. With sinks (gpt-oss: a logit per query head, KV * G),
// each row's running maximum and sum start at its head's sink (exp(0) = 1, no value), not at -inf and 0.
template <typename T>
void tile(const float* q, const T* kp, const T* vp, const int64_t* blocks, int64_t first_pos, int64_t q_pos,
          int64_t window, float scale, const Shape& S, int64_t h, int64_t r0, int64_t r1, float* out,
          std::vector<float>& buf, const float* sinks) {
  const int64_t G = S.G, hd = S.hd, bs = S.bs, Q = (r1 - r0) * G;
  buf.resize(2 * Q * hd + Q * KC + 2 * KC * hd + 2 * Q);
  float* qs = buf.data();        // (Q, hd): the queries, times the scale
  float* acc = qs + Q * hd;      // (Q, hd): sums of probability-weighted values
  float* s = acc + Q * hd;       // (Q, KC): a chunk's scores, then probabilities
  float* kt = s + Q * KC;        // (hd, KC): the chunk's keys as a panel
  float* rows = kt + hd * KC;    // (KC, hd): a chunk's rows as fp32 (a 16-bit pool, a short chunk)
  float* m = rows + KC * hd;     // (Q,): running maxima
  float* l = m + Q;              // (Q,): running sums
  for (int64_t i = 0; i < Q; ++i) {
    const float* src = q + (((r0 + i / G) * S.KV + h) * G + i % G) * hd;
    for (int64_t d = 0; d < hd; ++d) qs[i * hd + d] = src[d] * scale;
  }
  std::fill(acc, acc + Q * hd, 0.f);
  std::fill(m, m + Q, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Q, 0.f);
  if (sinks != nullptr)
    for (int64_t i = 0; i < Q; ++i) {
      m[i] = sinks[h * G + i % G];
      l[i] = 1.f;
    }
  Vec idx[NC];
  for (int64_t c = 0; c < NC; ++c) {
    alignas(64) float lanes[VS];
    for (int64_t j = 0; j < VS; ++j) lanes[j] = static_cast<float>(c * VS + j);
    idx[c] = Vec::loadu(lanes);
  }
  const int64_t lo = q_pos + r0, hi = q_pos + r1 - 1;  // the tile's first and last positions
  const int64_t kfirst = window > 0 ? std::max<int64_t>(0, lo - window + 1) : 0;
  const int64_t block_stride = S.KV * bs * hd;  // elements from one block to the next
  for (int64_t b = kfirst / bs; b <= hi / bs; ++b) {
    const int64_t id = blocks[b - first_pos / bs];
    const T* kb = kp + id * block_stride + h * bs * hd;
    const T* vb = vp + id * block_stride + h * bs * hd;
    for (int64_t c0 = 0; c0 < bs; c0 += KC) {
      const int64_t kpos = b * bs + c0;  // the chunk's first key position
      if (kpos > hi) break;
      const int64_t nv = std::min({KC, bs - c0, hi - kpos + 1});  // keys some row of the tile may see
      if (kpos + nv <= kfirst) continue;
      const float* kr = rows;  // the 16 key rows, fp32: in place when they are, else converted (or padded)
      if constexpr (std::is_same_v<T, float>) {
        if (nv == KC) kr = kb + c0 * hd;
      }
      if (kr == rows) rows_to_float(kb + c0 * hd, hd, nv, hd, rows);
      panel::transpose_rows(kr, hd, hd, kt);
      for (int64_t i0 = 0; i0 < Q; i0 += MR)
        panel::with_rows<MR>(std::min<int64_t>(MR, Q - i0), [&](auto r) { scores<r>(qs + i0 * hd, hd, kt, s + i0 * KC); });
      for (int64_t i = 0; i < Q; ++i) {
        float* si = s + i * KC;
        const int64_t pos = q_pos + r0 + i / G;
        const int64_t last = std::min(nv - 1, pos - kpos);                          // keys after it: unseen
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1 - kpos) : 0;  // before: left
        if (last < first) {  // no key of this chunk for this row: its state stays as it is
          std::fill(si, si + KC, 0.f);
          continue;
        }
        online_softmax(si, first, last, idx, m[i], l[i], acc + i * hd, hd);
      }
      const float* vr = rows;  // the nv value rows, fp32: in place when they are, else converted
      if constexpr (std::is_same_v<T, float>) vr = vb + c0 * hd;
      else rows_to_float(vb + c0 * hd, hd, nv, hd, rows);
      for (int64_t i0 = 0; i0 < Q; i0 += MR)
        panel::with_rows<MR>(std::min<int64_t>(MR, Q - i0), [&](auto r) { weigh<r>(s + i0 * KC, vr, hd, nv, hd, acc + i0 * hd); });
    }
  }
  for (int64_t i = 0; i < Q; ++i) {
    float* dst = out + (((r0 + i / G) * S.KV + h) * G + i % G) * hd;
    const Vec inv(1.f / l[i]);
    for (int64_t d = 0; d < hd; d += VS) (Vec::loadu(acc + i * hd + d) * inv).store(dst + d);
  }
}

template <typename T>
void run(const float* q, const T* kp, const T* vp, const int64_t* blocks, int64_t first_pos, int64_t q_pos,
         int64_t window, float scale, const Shape& S, float* out, const float* sinks) {
  // Tiles of about eight register tiles of query vectors; the heaviest (latest rows: most keys) first.
  const int64_t rows = std::max<int64_t>(1, 8 * MR / S.G);
  const int64_t tiles = (S.n + rows - 1) / rows, tasks = tiles * S.KV;
  localllm::in_turn(tasks, [&](const auto& claim) {
    std::vector<float> buf;
    for (int64_t t = claim(); t < tasks; t = claim()) {
      const int64_t tl = tiles - 1 - t / S.KV, h = t % S.KV;
      tile<T>(q, kp, vp, blocks, first_pos, q_pos, window, scale, S, h, tl * rows, std::min(S.n, (tl + 1) * rows),
              out, buf, sinks);
    }
  });
}

at::Tensor paged_chunk_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const at::Tensor& blocks, int64_t first_pos, int64_t q_pos, int64_t window,
                                 double scale, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "paged_chunk_attention: q must be (n, KV, G, hd) float32");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_chunk_attention: k_pool, v_pool must be (n_blocks, KV, block, hd) alike");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong, "paged_chunk_attention: blocks must be (nb,) long");
  const Shape S{q.size(0), q.size(1), q.size(2), q.size(3), k_pool.size(2)};
  TORCH_CHECK(k_pool.size(1) == S.KV && k_pool.size(3) == S.hd, "paged_chunk_attention: q and the pool disagree on KV, hd");
  TORCH_CHECK(S.hd % KC == 0, "paged_chunk_attention: head_dim ", S.hd, " is not a multiple of ", KC);
  TORCH_CHECK(first_pos >= 0 && first_pos % S.bs == 0 && q_pos >= first_pos,
              "paged_chunk_attention: first_pos must be a block start at or before q_pos");
  TORCH_CHECK(blocks.size(0) * S.bs >= q_pos + S.n - first_pos, "paged_chunk_attention: the table is too short");
  const at::Tensor qc = q.contiguous(), kc = k_pool.contiguous(), vc = v_pool.contiguous(), bc = blocks.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  if (S.n == 0) return out;
  const int64_t* bp = bc.data_ptr<int64_t>();
  // The blocks the rows read: from the one holding row 0's oldest key to the one holding the last row.
  const int64_t oldest = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
  TORCH_CHECK(oldest / S.bs * S.bs >= first_pos, "paged_chunk_attention: the table starts at position ", first_pos,
              ", after the oldest key the first row sees (", oldest, ")");
  for (int64_t b = (oldest - first_pos) / S.bs; b <= (q_pos + S.n - 1 - first_pos) / S.bs; ++b)
    TORCH_CHECK(bp[b] >= 0 && bp[b] < kc.size(0), "paged_chunk_attention: block id ", bp[b], " is not in the pool of ",
                kc.size(0), " blocks");
  at::Tensor sink_keep;
  const float* sp = nullptr;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == S.KV * S.G, "paged_chunk_attention: sinks must be (",
                S.KV * S.G, ",), one per query head");
    sink_keep = sinks->to(at::kFloat).contiguous();
    sp = sink_keep.data_ptr<float>();
  }
  const float* qp = qc.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  float* op = out.data_ptr<float>();
  switch (kc.scalar_type()) {
    case at::kFloat: run<float>(qp, kc.data_ptr<float>(), vc.data_ptr<float>(), bp, first_pos, q_pos, window, sc, S, op, sp); break;
    case at::kHalf: run<at::Half>(qp, kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>(), bp, first_pos, q_pos, window, sc, S, op, sp); break;
    case at::kBFloat16:
      run<at::BFloat16>(qp, kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(), bp, first_pos, q_pos, window, sc, S, op, sp);
      break;
    default: TORCH_CHECK(false, "paged_chunk_attention: pools of ", kc.scalar_type(), " are not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("paged_chunk_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor blocks, int first_pos, int q_pos, "
        "int window, float scale, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) { m.impl("paged_chunk_attention", &paged_chunk_attention); }
