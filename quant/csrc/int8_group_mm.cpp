// y = x W^T for int8 weights with one fp16 scale per group of input columns: the canonical "int8
// group G" format, which holds a GGUF file's Q8_0 blocks (G = 32) exactly; or with one scale per row
// (scales (N, 1), per-channel int8), the groups then only the length of each partial sum.
//
// torch's fast int8 matmul (_weight_int8pack_mm) takes one scale per output row, so a Q8_0 head had
// to be re-rounded to per-row scales (doubling SmolLM2's KL divergence) or dequantized to 16 bits
// (twice the bytes a decode step reads). This kernel reads the blocks as they are: each group's
// weights are widened to fp32 once and dotted with up to 8 rows of fp32 activations, each row's
// partial sums scaled by the group's scale and accumulated in fp32, summed once at the end. At batch
// 1 it is bound by memory bandwidth like any GEMV; output rows are split across threads. More rows go
// through the panel GEMM (mm_panels, below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "fp32_vec.h"
#include "panel_gemm.h"
#include "parallel_rows.h"

#ifndef PREFETCH
#define PREFETCH 2048  // bytes ahead of the codes being read
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
using localllm::fp32::hsum;
using localllm::fp32::load_int8;

// n fp16 scales -> fp32 (exact), eight or sixteen a conversion where the CPU has F16C.
inline void scales_to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Output row n for the R activation rows at x (rows K apart) -> out[0..R): each group's GV vectors of
// codes (GV = group / VS; 0: any other number) are widened once and serve every row, whose sums stay in registers (raw vectors: see
// panel_gemm.h). Per row, the operations are those of one row alone, in the same order: the group's
// dot product (a multiply, then FMAs), scaled once into one of two chains (even and odd groups, so
// consecutive FMAs need not wait on each other), summed at the end; so a row's result does not depend
// on which rows share the call.
template <int R, int GV>
void row_groups(const float* x, int64_t K, const int8_t* qn, const at::Half* sn, int64_t ns, int64_t group,
                float* out) {
  using namespace localllm::panel;
  const int64_t ng = K / group;
  V a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vset(0.f);
  // Group g's dot products, scaled by sc, into acc (a0 for even groups, a1 for odd ones).
  const auto add_group = [&](int64_t g, float sc_f, V* acc) {
    const int8_t* qg = qn + g * group;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    // The rows ahead, from L3 or memory: the prefetchers alone leave a decode step waiting on them.
    if ((g * group) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(qg) + PREFETCH, _MM_HINT_T0);
    if (g % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(sn + g) + PREFETCH / 16, _MM_HINT_T0);
#endif
    V w[GV > 0 ? GV : 1];
    for (int d = 0; d < GV; ++d) w[d] = static_cast<V>(load_int8(qg + d * VS));
    const V sc = vset(sc_f);
    for (int r = 0; r < R; ++r) {
      const float* xg = x + r * K + g * group;
      V t;
      if constexpr (GV > 0) {
        t = vmul(w[0], vload(xg));
        for (int d = 1; d < GV; ++d) t = vfma(w[d], vload(xg + d * VS), t);
      } else {  // another number of vectors a group: widened again for each row
        t = vmul(static_cast<V>(load_int8(qg)), vload(xg));
        for (int64_t d = VS; d < group; d += VS) t = vfma(static_cast<V>(load_int8(qg + d)), vload(xg + d), t);
      }
      acc[r] = vfma(t, sc, acc[r]);
    }
  };
  // Scales converted a chunk at a time with vector instructions (one at a time, the conversion
  // took more of the shuffle port than the codes did), groups taken in pairs so that which chain
  // a group adds to is known at compile time; the order of operations is unchanged.
  constexpr int64_t CH = 64;  // even, so a chunk's first group is even
  alignas(64) float scl[CH];
  for (int64_t g0 = 0; g0 < ng; g0 += CH) {
    const int64_t gn = std::min(CH, ng - g0);
    if (ns == 1) std::fill(scl, scl + gn, static_cast<float>(sn[0]));
    else scales_to_float(sn + g0, scl, gn);
    int64_t i = 0;
    for (; i + 1 < gn; i += 2) {
      add_group(g0 + i, scl[i], a0);
      add_group(g0 + i + 1, scl[i + 1], a1);
    }
    if (i < gn) add_group(g0 + i, scl[i], a0);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(Vec(a0[r]) + Vec(a1[r]));
}

// Output rows n and n + 1 (q0, and q0 + K) for one activation row: row_groups<1, GV>'s operations for
// each, in the same order (so the same bits), interleaved. A decode step's row alone waits on its
// group's chain of dependent FMAs; two rows' chains overlap, and share the activations' loads.
template <int GV>
void row_pair(const float* x, int64_t K, const int8_t* q0, const at::Half* s0, int64_t ns, int64_t group,
              float* out) {
  using namespace localllm::panel;
  static_assert(GV > 0, "a whole number of vectors a group");
  const int8_t* q1 = q0 + K;
  const at::Half* s1 = s0 + ns;
  const int64_t ng = K / group;
  V a0[2] = {vset(0.f), vset(0.f)}, a1[2] = {vset(0.f), vset(0.f)};  // [output row]: even, odd groups
  const auto add_group = [&](int64_t g, float sc0, float sc1, V* acc) {
    const int8_t* qg0 = q0 + g * group;
    const int8_t* qg1 = q1 + g * group;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if ((g * group) % 64 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(qg0) + PREFETCH, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qg1) + PREFETCH, _MM_HINT_T0);
    }
    if (g % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(s0 + g) + PREFETCH / 16, _MM_HINT_T0);
#endif
    const float* xg = x + g * group;
    V xv = vload(xg);
    V t0 = vmul(static_cast<V>(load_int8(qg0)), xv), t1 = vmul(static_cast<V>(load_int8(qg1)), xv);
    for (int d = 1; d < GV; ++d) {
      xv = vload(xg + d * VS);
      t0 = vfma(static_cast<V>(load_int8(qg0 + d * VS)), xv, t0);
      t1 = vfma(static_cast<V>(load_int8(qg1 + d * VS)), xv, t1);
    }
    acc[0] = vfma(t0, vset(sc0), acc[0]);
    acc[1] = vfma(t1, vset(sc1), acc[1]);
  };
  constexpr int64_t CH = 64;  // as row_groups: even, so a chunk's first group is even
  alignas(64) float scl0[CH], scl1[CH];
  for (int64_t g0 = 0; g0 < ng; g0 += CH) {
    const int64_t gn = std::min(CH, ng - g0);
    if (ns == 1) {
      std::fill(scl0, scl0 + gn, static_cast<float>(s0[0]));
      std::fill(scl1, scl1 + gn, static_cast<float>(s1[0]));
    } else {
      scales_to_float(s0 + g0, scl0, gn);
      scales_to_float(s1 + g0, scl1, gn);
    }
    int64_t i = 0;
    for (; i + 1 < gn; i += 2) {
      add_group(g0 + i, scl0[i], scl1[i], a0);
      add_group(g0 + i + 1, scl0[i + 1], scl1[i + 1], a1);
    }
    if (i < gn) add_group(g0 + i, scl0[i], scl1[i], a0);
  }
  out[0] = hsum(Vec(a0[0]) + Vec(a1[0]));
  out[1] = hsum(Vec(a0[1]) + Vec(a1[1]));
}

template <int GV, int R = 8>
void row_groups_any(int64_t rows, const float* x, int64_t K, const int8_t* qn, const at::Half* sn, int64_t ns,
                    int64_t group, float* out) {
  if constexpr (R > 0) {
    if (rows == R) row_groups<R, GV>(x, K, qn, sn, ns, group, out);
    else row_groups_any<GV, R - 1>(rows, x, K, qn, sn, ns, group, out);
  }
}

constexpr int64_t MAX_M = 8;  // activation rows sharing each widened group (16 accumulators)

template <typename T>
void mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  // x (M, K); q (N, K) int8; scales (N, K / group) fp16; y (M, N).
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  std::vector<float> xf(M * K);  // the activations widened once, read by every row
  const T* xp = x.data_ptr<T>();
  for (const auto i : c10::irange(M * K)) xf[i] = static_cast<float>(xp[i]);
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const int64_t ns = scales.size(1);  // ng, or 1: one scale a row (the groups are then only how the sums run)
  const int64_t gv = group / VS;
  T* yp = y.data_ptr<T>();
  localllm::parallel_chunks(N, 64, [&](int64_t begin, int64_t end) {
    float out[MAX_M];
    if (M == 1 && (gv == 1 || gv == 2 || gv == 4 || gv == 8)) {  // a decode step: output rows in pairs
      int64_t n = begin;
      for (; n + 1 < end; n += 2) {
        const int8_t* qn = qp + n * K;
        const at::Half* sn = sp + n * ns;
        switch (gv) {
          case 1: row_pair<1>(xf.data(), K, qn, sn, ns, group, out); break;
          case 2: row_pair<2>(xf.data(), K, qn, sn, ns, group, out); break;
          case 4: row_pair<4>(xf.data(), K, qn, sn, ns, group, out); break;
          default: row_pair<8>(xf.data(), K, qn, sn, ns, group, out);
        }
        yp[n] = static_cast<T>(out[0]);
        yp[n + 1] = static_cast<T>(out[1]);
      }
      begin = n;  // an odd row left: below
    }
    for (const auto n : c10::irange(begin, end)) {
      const int8_t* qn = qp + n * K;
      const at::Half* sn = sp + n * ns;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int64_t rows = std::min(MAX_M, M - m0);
        const float* xm = xf.data() + m0 * K;
        switch (gv) {
          case 1: row_groups_any<1>(rows, xm, K, qn, sn, ns, group, out); break;
          case 2: row_groups_any<2>(rows, xm, K, qn, sn, ns, group, out); break;
          case 4: row_groups_any<4>(rows, xm, K, qn, sn, ns, group, out); break;
          case 8: row_groups_any<8>(rows, xm, K, qn, sn, ns, group, out); break;
          default: row_groups_any<0>(rows, xm, K, qn, sn, ns, group, out);
        }
        for (int64_t r = 0; r < rows; ++r) yp[(m0 + r) * N + n] = static_cast<T>(out[r]);
      }
    }
  });
}

// Many activation rows: 16 output rows' weights (q * scale, exact in fp32: 8 + 11 significant bits)
// decoded a panel of columns at a time and multiplied by every activation row (panel_gemm.h).
// x (M, K) fp32; q (N, K); scales (N, ns) with ns = K / group or 1; y (M, N) fp32.
void mm_panels(const float* x, const int8_t* q, const at::Half* scales, int64_t ns, int64_t group, int64_t M,
               int64_t K, int64_t N, float* y) {
  namespace panel = localllm::panel;
  constexpr int64_t W = panel::WIDTH;
  const int64_t kb = std::max<int64_t>(group, panel::KB / group * group);  // whole groups a panel
  panel::gemm(x, M, K, N, kb, y, [&](int64_t t, int64_t k0, int64_t n, float* panel_out, float* rows) {
    const int64_t valid = std::min(W, N - t * W);
    for (int64_t j = 0; j < valid; ++j) {
      const int8_t* qj = q + (t * W + j) * K + k0;
      const at::Half* sj = scales + (t * W + j) * ns;
      for (int64_t i = 0; i < n; i += VS)
        (load_int8(qj + i) * Vec(static_cast<float>(sj[ns == 1 ? 0 : (k0 + i) / group]))).store(rows + j * kb + i);
    }
    panel::transpose_rows(rows, kb, n, panel_out);
  });
}

void check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group, const char* op) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, op, ": x, qweight, scales must be 2-D");
  TORCH_CHECK(q.scalar_type() == at::kChar, op, ": qweight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, op, ": scales must be float16");
  TORCH_CHECK(group > 0 && group % VS == 0, op, ": group ", group, " is not a multiple of ", VS);
  TORCH_CHECK(x.size(1) == q.size(1) && q.size(1) % group == 0, op, ": x (M, K) does not match qweight (N, K)");
  TORCH_CHECK(scales.size(0) == q.size(0) && (scales.size(1) == q.size(1) / group || scales.size(1) == 1),
              op, ": scales must be (N, K / group), or (N, 1): one a row");
}

// The same product through fp32 panels (mm_panels): for many activation rows.
at::Tensor int8_group_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  check(x, q, scales, group, "int8_group_gemm");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), qc = q.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options().dtype(at::kFloat));
  mm_panels(xf.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<at::Half>(), sc.size(1), group, xf.size(0),
            q.size(1), q.size(0), y.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  check(x, q, scales, group, "int8_group_mm");
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: mm<float>(xc, qc, sc, group, y); break;
    case at::kBFloat16: mm<at::BFloat16>(xc, qc, sc, group, y); break;
    case at::kHalf: mm<at::Half>(xc, qc, sc, group, y); break;
    default: TORCH_CHECK(false, "int8_group_mm: activations of dtype ", x.scalar_type(), " are not float, bfloat16 or half");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("int8_group_mm(Tensor x, Tensor qweight, Tensor scales, int group) -> Tensor");
  m.def("int8_group_gemm(Tensor x, Tensor qweight, Tensor scales, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int8_group_mm", &int8_group_mm);
  m.impl("int8_group_gemm", &int8_group_gemm);
}
