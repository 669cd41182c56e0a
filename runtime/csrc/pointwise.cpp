// The pointwise parts of a transformer block on the CPU, each one pass over its rows:
//
//   localllm::rms_norm(x, weight, eps, offset)  x * rsqrt(mean(x^2) + eps) * (weight + offset)
//   localllm::glu(gate_up, gelu)                act(gate) * up, gate and up the halves of the last dim
//   localllm::rope(x, cos, sin)                 x * cos + rotate_half(x) * sin over each row's first dims
//
// Eager torch runs RMSNorm as seven ops, GeGLU's tanh-GELU through a slow vectorised tanh and RoPE as
// six (two slices, a negation, a concatenation, two products and a sum); on a prefill chunk each op is
// a pass over the activations and a fork of the thread pool. These are the same arithmetic in fp32
// (the reductions' order aside), for the steps that run eagerly; a compiled step fuses the torch
// formulas (runtime/pointwise.py) itself.

// No contraction of a product and a sum into one FMA anywhere in this file: RoPE must round its two
// products before adding them, as torch's ops do, to give torch's values bit for bit (the other ops
// ask for their FMAs by name).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();

// Rows a task: enough elements that waking a thread pays.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: x and weight must be float32");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "rms_norm: weight must be (", D, ")");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t R = D ? xc.numel() / D : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  at::parallel_for(0, R, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      Vec acc(0.f);
      int64_t k = 0;
      for (; k + VS <= D; k += VS) {
        const Vec v = Vec::loadu(xr + k);
        acc = at::vec::fmadd(v, v, acc);
      }
      float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      for (; k < D; ++k) ss += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
      const Vec vi(inv), vo(off);
      k = 0;
      for (; k + VS <= D; k += VS) ((Vec::loadu(xr + k) * vi) * (Vec::loadu(wp + k) + vo)).store(yr + k);
      for (; k < D; ++k) yr[k] = (xr[k] * inv) * (wp[k] + off);
    }
  });
  return y;
}

// silu(g) = g / (1 + e^-g); tanh-GELU(g) = g (1 + tanh z) / 2 = g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3):
// the logistic form needs one exp and no tanh, and loses nothing near 0 (no 1 - tanh cancellation).
template <bool GELU>
inline Vec act(Vec g) {
  if constexpr (GELU) {
    const Vec c(-2.f * 0.7978845608028654f), k(0.044715f);
    const Vec z2 = c * (g + k * g * g * g);  // -2z
    return g / (Vec(1.f) + z2.exp());
  } else {
    return g / (Vec(1.f) + g.neg().exp());
  }
}

template <bool GELU>
inline float act1(float g) {
  if constexpr (GELU) return g / (1.f + std::exp(-2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g)));
  return g / (1.f + std::exp(-g));
}

template <bool GELU>
void glu_rows(const float* in, int64_t R, int64_t I, float* out) {
  at::parallel_for(0, R, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = in + r * 2 * I;
      const float* u = g + I;
      float* o = out + r * I;
      int64_t k = 0;
      for (; k + VS <= I; k += VS) (act<GELU>(Vec::loadu(g + k)) * Vec::loadu(u + k)).store(o + k);
      for (; k < I; ++k) o[k] = act1<GELU>(g[k]) * u[k];
    }
  });
}

at::Tensor glu(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "glu: gate_up must be float32");
  const int64_t I2 = gate_up.size(-1);
  TORCH_CHECK(I2 % 2 == 0, "glu: the last dim (gate, then up) must be even");
  const at::Tensor c = gate_up.contiguous();
  auto sizes = c.sizes().vec();
  sizes.back() = I2 / 2;
  at::Tensor y = at::empty(sizes, c.options());
  const int64_t R = I2 ? c.numel() / I2 : 0;
  if (gelu) glu_rows<true>(c.data_ptr<float>(), R, I2 / 2, y.data_ptr<float>());
  else glu_rows<false>(c.data_ptr<float>(), R, I2 / 2, y.data_ptr<float>());
  return y;
}

// x (B, H, T, hd), any strides but a contiguous last dim (the heads of a projection, transposed);
// cos, sin (T, rot), rot <= hd and even. Row (b, h, t): its first rot dims rotate by position t,
// o[i] = x[i] cos[i] - x[i + rot/2] sin[i] (i < rot/2), x[i] cos[i] + x[i - rot/2] sin[i] (after);
// the rest are copied. Each product is rounded and then the two added, as torch's ops do (no FMA), so
// the values are torch's bit for bit. The result has x's strides.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: x, cos and sin must be float32");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be (B, H, T, hd) with a contiguous last dim");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3), rot = cos.size(-1), half = rot / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && sin.sizes() == cos.sizes() && rot % 2 == 0 && rot <= hd,
              "rope: cos and sin must be (", T, ", rot), rot even and at most ", hd);
  // A step's tables are column slices of one (T, 2 rot) table when local and global RoPE differ: read
  // them where they lie, rows apart by their stride.
  const at::Tensor cc = cos.stride(1) == 1 ? cos : cos.contiguous(), sc = sin.stride(1) == 1 ? sin : sin.contiguous();
  const int64_t cs = cc.stride(0), ss = sc.stride(0);
  at::Tensor y = at::empty_like(x);  // x's strides (a dense x keeps its layout)
  TORCH_CHECK(y.stride(3) == 1, "rope: the output's last dim must be contiguous");
  const float* xp = x.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows = B * H * T;
  at::parallel_for(0, rows, grain(hd), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r % T, h = (r / T) % H, b = r / (T * H);
      const float* xr = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
      float* yr = yp + b * y.stride(0) + h * y.stride(1) + t * y.stride(2);
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      int64_t i = 0;
      for (; i + VS <= half; i += VS) {
        const Vec lo = Vec::loadu(xr + i), hi = Vec::loadu(xr + half + i);
        (lo * Vec::loadu(c + i) - hi * Vec::loadu(s + i)).store(yr + i);
        (hi * Vec::loadu(c + half + i) + lo * Vec::loadu(s + half + i)).store(yr + half + i);
      }
      for (; i < half; ++i) {
        const float lo = xr[i], hi = xr[half + i];
        const float a = lo * c[i], b2 = hi * s[i], d = hi * c[half + i], e = lo * s[half + i];
        yr[i] = a - b2;
        yr[half + i] = d + e;
      }
      for (int64_t j = rot; j < hd; ++j) yr[j] = xr[j];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("glu(Tensor gate_up, bool gelu) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("glu", &glu);
  m.impl("rope", &rope);
}
