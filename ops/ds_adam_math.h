// The Adam/AdamW update of one element (or one SIMD vector of elements),
// shared by the CPU kernel (adam_cpu.cpp) and the CUDA kernel (adam_cuda.cu).
//
// It mirrors ds_patrickstar/adam_math.py::adam_step_reference:
//   g  = grad * grad_scale
//   AdamW: p *= 1 - lr*wd            Adam: g += wd * p
//   m  = m + (1-beta1) * (g - m)     (torch.lerp, weight < 0.5 branch)
//   v  = beta2 * v + (1-beta2) * g*g
//   p -= (lr/bc1) * m / (sqrt(v)/bc2_sqrt + eps)
// The unused weight-decay form has decay == 1 / l2_wd == 0, which leaves the
// values bit-for-bit unchanged, so the same straight-line code serves both.
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DSPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DSPS_HOST_DEVICE inline
#endif

namespace ds_patrickstar {

// Per-step scalar coefficients, computed once on the host in double precision.
// F is float, or a SIMD float vector holding the coefficient broadcast to all lanes.
template <typename F>
struct AdamCoeffsT {
  F grad_scale;       // clip_coef / loss_scale
  F beta1;
  F one_minus_beta1;
  F beta2;
  F one_minus_beta2;
  F eps;
  F l2_wd;            // Adam: weight_decay, AdamW: 0
  F decay;            // AdamW: 1 - lr*weight_decay, Adam: 1
  F step_size;        // lr / (1 - beta1^step)   (lr without bias correction)
  F inv_bc2_sqrt;     // 1 / sqrt(1 - beta2^step) (1 without bias correction)

  // Broadcast scalar coefficients (F must be constructible from a float).
  template <typename S>
  static DSPS_HOST_DEVICE AdamCoeffsT broadcast(const AdamCoeffsT<S>& s) {
    AdamCoeffsT r;
    r.grad_scale = F(s.grad_scale);
    r.beta1 = F(s.beta1);
    r.one_minus_beta1 = F(s.one_minus_beta1);
    r.beta2 = F(s.beta2);
    r.one_minus_beta2 = F(s.one_minus_beta2);
    r.eps = F(s.eps);
    r.l2_wd = F(s.l2_wd);
    r.decay = F(s.decay);
    r.step_size = F(s.step_size);
    r.inv_bc2_sqrt = F(s.inv_bc2_sqrt);
    return r;
  }
};
using AdamCoeffs = AdamCoeffsT<float>;

inline AdamCoeffs make_adam_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool adamw, double bias_correction1, double bias_correction2_sqrt,
                                   double grad_scale) {
  AdamCoeffs c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.l2_wd = adamw ? 0.0f : static_cast<float>(weight_decay);
  c.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / bias_correction2_sqrt);
  return c;
}

// Scalar primitives; a SIMD vector type provides dsps_fma and dsps_sqrt
// (found by argument-dependent lookup) plus +, -, *, / to reuse adam_math().
DSPS_HOST_DEVICE float dsps_fma(float a, float b, float c) { return fmaf(a, b, c); }
DSPS_HOST_DEVICE float dsps_sqrt(float a) { return sqrtf(a); }

// One Adam step on one element (F = float) or one SIMD vector of elements.
// g: the unscaled gradient; p/m/v: master, exp_avg, exp_avg_sq, updated in place.
template <typename F>
DSPS_HOST_DEVICE void adam_math(F g, F& p, F& m, F& v, const AdamCoeffsT<F>& c) {
  g = g * c.grad_scale;
  p = p * c.decay;
  g = dsps_fma(c.l2_wd, p, g);
  m = dsps_fma(c.one_minus_beta1, g - m, m);
  v = dsps_fma(c.one_minus_beta2, g * g, c.beta2 * v);
  const F denom = dsps_fma(dsps_sqrt(v), c.inv_bc2_sqrt, c.eps);
  p = p - c.step_size * (m / denom);
}

}  // namespace ds_patrickstar
