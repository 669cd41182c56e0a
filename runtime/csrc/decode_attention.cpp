// One-query attention over a KV cache prefix, for the CPU decode step.
//
// At batch 1 a decode step attends one query per head over a few hundred cached keys: about 0.1
// MFLOP a layer. torch's flash-attention CPU kernel spends ~20-30 us a call on that in blocking,
// buffer allocation and GEMM set-up, ~0.8 ms of a 5 ms SmolLM2 step. This kernel does the same
// arithmetic straight through: a grouped query's heads share every key and value row they read,
// a head's output row stays in registers while the values stream past, and nothing is allocated
// but the output and a few scratch rows.
//
// Its rounding follows the flash kernel's for reduced-precision inputs (SDPA still runs prefill):
// scores in fp32, scaled after the dot product, softmax with at::vec's exp_u20, probabilities
// rounded to the input dtype before they weight the values, fp32 accumulation, one division by
// the fp32 sum at the end. Eager and compiled decode both call it (runtime/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

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

// s[j][l] = (q_j . k_l) * scale for the G query rows qf (fp32) and the L key rows of kb.
// NV > 0: hd is NV vectors exactly, and q_j lives in registers; NV == 0: any hd, through `row`.
template <typename T, int NV>
inline void scores(const float* qf, int64_t G, const T* kb, int64_t ks, int64_t L, int64_t hd, int64_t hv,
                   float sc, float* s) {
  for (const auto j : c10::irange(G)) {
    const float* qj = qf + j * hd;
    if constexpr (NV > 0) {
      Vec qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = Vec::loadu(qj + c * VS);
      for (const auto l : c10::irange(L)) {
        const T* kl = kb + l * ks;
        Vec a0 = qv[0] * load_f(kl), a1(0.f);  // two chains, so the FMAs need not wait on each other
        for (int c = 1; c < NV; ++c) {
          if (c % 2) a1 = at::vec::fmadd(qv[c], load_f(kl + c * VS), a1);
          else a0 = at::vec::fmadd(qv[c], load_f(kl + c * VS), a0);
        }
        s[j * L + l] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a0 + a1) * sc;
      }
    } else {
      for (const auto l : c10::irange(L)) {
        const T* kl = kb + l * ks;
        Vec a(0.f);
        for (int64_t d = 0; d < hv; d += VS) a = at::vec::fmadd(Vec::loadu(qj + d), load_f(kl + d), a);
        float dot = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
        for (int64_t d = hv; d < hd; ++d) dot += qj[d] * static_cast<float>(kl[d]);
        s[j * L + l] = dot * sc;
      }
    }
  }
}

// acc[j] = sum_l p[j][l] v_l for the G rows of probabilities p (fp32, L each).
template <typename T, int NV>
inline void weigh(const float* p, int64_t G, const T* vb, int64_t vs, int64_t L, int64_t hd, int64_t hv,
                  float* acc) {
  for (const auto j : c10::irange(G)) {
    const float* pj = p + j * L;
    float* aj = acc + j * hd;
    if constexpr (NV > 0) {
      Vec a[NV];  // the output row in registers for the whole sweep over the values
      for (int c = 0; c < NV; ++c) a[c] = Vec(0.f);
      for (const auto l : c10::irange(L)) {
        const Vec w(pj[l]);
        const T* vl = vb + l * vs;
        for (int c = 0; c < NV; ++c) a[c] = at::vec::fmadd(w, load_f(vl + c * VS), a[c]);
      }
      for (int c = 0; c < NV; ++c) a[c].store(aj + c * VS);
    } else {
      std::fill(aj, aj + hd, 0.f);
      for (const auto l : c10::irange(L)) {
        const Vec w(pj[l]);
        const T* vl = vb + l * vs;
        for (int64_t d = 0; d < hv; d += VS) at::vec::fmadd(w, load_f(vl + d), Vec::loadu(aj + d)).store(aj + d);
        for (int64_t d = hv; d < hd; ++d) aj[d] += pj[l] * static_cast<float>(vl[d]);
      }
    }
  }
}

template <typename T, int NV>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& y) {
  // q (B, KV, G, hd); k, v (B, KV, L, hd) with unit stride on hd; y (B, KV, G, hd) contiguous.
  const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), hd = q.size(3), L = k.size(2);
  const int64_t hv = hd / VS * VS;  // the part of a row taken a vector at a time; the rest one by one
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  // Each (batch, kv head) is one task; split across threads only when a task is big enough to
  // pay for waking them (a few hundred keys are not).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, L * G * hd));
  at::parallel_for(0, B * KV, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), s(G * L), acc(G * hd), sums(G);
    for (const auto bh : c10::irange(begin, end)) {
      const int64_t b = bh / KV, h = bh % KV;
      const T* qb = qp + b * q.stride(0) + h * q.stride(1);
      const T* kb = kp + b * k.stride(0) + h * k.stride(1);
      const T* vb = vp + b * v.stride(0) + h * v.stride(1);
      const int64_t ks = k.stride(2), vs = v.stride(2), qs = q.stride(2);
      for (const auto j : c10::irange(G)) {
        for (const auto d : c10::irange(hd)) qf[j * hd + d] = static_cast<float>(qb[j * qs + d]);
      }
      scores<T, NV>(qf.data(), G, kb, ks, L, hd, hv, sc, s.data());
      // Softmax numerators exp(s - max) in place, and their fp32 sums.
      for (const auto j : c10::irange(G)) {
        float* sj = s.data() + j * L;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sj, L);
        at::vec::map<float>([mx](Vec x) { return (x - Vec(mx)).exp_u20(); }, sj, sj, L);
        sums[j] = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sj, L);
        // rounded to the input dtype, as the flash kernel's second GEMM reads them
        if constexpr (!std::is_same_v<T, float>) {
          for (const auto l : c10::irange(L)) sj[l] = static_cast<float>(static_cast<T>(sj[l]));
        }
      }
      weigh<T, NV>(s.data(), G, vb, vs, L, hd, hv, acc.data());
      T* yb = yp + (b * KV + h) * G * hd;
      for (const auto j : c10::irange(G)) {
        const float inv = 1.f / sums[j];
        for (const auto d : c10::irange(hd)) yb[j * hd + d] = static_cast<T>(acc[j * hd + d] * inv);
      }
    }
  });
}

// The usual head sizes (a whole number of vectors up to 256 floats) with rows held in registers.
template <typename T>
void attend_any(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& y) {
  const int64_t hd = q.size(3);
  if (hd % VS != 0) return attend<T, 0>(q, k, v, scale, y);
  switch (hd / VS) {
    case 1: return attend<T, 1>(q, k, v, scale, y);
    case 2: return attend<T, 2>(q, k, v, scale, y);
    case 4: return attend<T, 4>(q, k, v, scale, y);
    case 8: return attend<T, 8>(q, k, v, scale, y);
    case 16: return attend<T, 16>(q, k, v, scale, y);
    default: return attend<T, 0>(q, k, v, scale, y);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k and v must have the same shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "decode_attention: q (B, KV, G, hd) does not match k (B, KV, L, hd)");
  TORCH_CHECK(k.size(2) >= 1, "decode_attention: no keys");
  // Rows are read with unit stride (a cache slice always has it; anything else is copied first).
  const auto unit = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = unit(q), kc = unit(k), vc = unit(v);
  at::Tensor y = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  switch (q.scalar_type()) {
    case at::kFloat: attend_any<float>(qc, kc, vc, scale, y); break;
    case at::kBFloat16: attend_any<at::BFloat16>(qc, kc, vc, scale, y); break;
    case at::kHalf: attend_any<at::Half>(qc, kc, vc, scale, y); break;
    default: TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " is not float, bfloat16 or half");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
