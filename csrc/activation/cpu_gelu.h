// GELU and the sigmoid on the CPU, in float loops that vectorize (libm's exp and erfc are scalar
// calls) and in double through libm: exp by Cody-Waite reduction and a minimax polynomial
// (relative error ~1e-7), erfc as e^{-z^2} times the fit of gelu.h (relative error ~3e-7 in
// float), so GELU keeps fp32 relative accuracy also deep in its negative tail. Included by CPU
// kernel files after cpu_types.h; the forms and constants are gelu.h's.
#pragma once

#include <cmath>
#include <limits>
#if defined(__x86_64__) || defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "util/cpu_types.h"
#include "activation/gelu.h"

namespace fusedlayers {
namespace cpu {

// While it lives, the calling thread computes with IEEE subnormals: TensorFlow's and XLA's
// threads run with MXCSR's flush-to-zero and denormals-are-zero set, torch's without, and
// GELU's and the sigmoid's tails pass through subnormals, so one kernel would otherwise give
// each framework other bits.
class IeeeSubnormals {
 public:
#if defined(__x86_64__) || defined(__SSE__)
  IeeeSubnormals() : mode_(_mm_getcsr()) { _mm_setcsr(mode_ & ~0x8040u); }
  ~IeeeSubnormals() { _mm_setcsr(mode_); }

 private:
  unsigned mode_;
#endif
};

// e^x for x <= 88 (0 below -87, where the result leaves the normal range; +inf above 88):
// Cody-Waite reduction to |r| <= ln2/2, then e^r = 1 + r + r^2 P(r) with P of degree 3, fitted
// here for relative error (minimax by Lawson's iteration: 1.05e-7, float's own rounding).
// kNonPositive: x <= 0 (or NaN), as GELU's e^{-u^2/2}: no overflow to handle.
template <bool kNonPositive = false>
FUSEDLAYERS_INLINE float exp_approx(float x) {
  // One compare per bound, reused for the clamp and the result: GCC turns each select into a
  // blend (it may not use vmaxps, which would drop NaN), so fewer selects is a shorter loop.
  const bool lo = x < -87.0f, hi = !kNonPositive && x > 88.0f;  // false for NaN: it passes
  const float xc = lo ? -87.0f : (hi ? 88.0f : x);
  // k = round(x / ln 2) + 127 in the low bits of 1.5 * 2^23 + k, whose ulp is 1: shifted into
  // the exponent field, those bits are 2^round(x / ln 2) (the 1.5 * 2^23 part shifts out).
  constexpr float kShift = 12582912.0f + 127.0f;
  const float k = xc * 1.44269504f + kShift;
  const float n = k - kShift;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2
  // Estrin's scheme: as many multiply-adds as Horner's here (r^2 is needed anyway), and a
  // shorter chain.
  const float r2 = r * r;
  const float p = (8.312525228e-3f * r + 4.189011455e-2f) * r2 +
                  (1.666711420e-1f * r + 4.999923110e-1f);
  const float scale = cpu::float_of(cpu::bits_of(k) << 23);
  const float res = scale * (r2 * p + r) + scale;
  return lo ? 0.0f : (hi ? std::numeric_limits<float>::infinity() : res);
}

// erfc(z) e^{z^2} / 2 for z = |u| / sqrt 2: the fit of gelu.h, halved (exactly: a power of two).
// Horner's scheme: the loop is bound by the multiply-add ports, not by latency (16 elements per
// vector, iterations overlap), and Horner takes the fewest multiplies (docs/DESIGN.md, "CPU
// loops"). e^{-z^2} stays outside, so GELU's gradient shares one exp between Phi
// and the pdf.
FUSEDLAYERS_INLINE float half_erfcx_of_abs(float u) {
  using namespace gelu;
  const float t = 1.0f / (1.0f + std::abs(u) * kHalfInvSqrt2);
  float g = 0.5f * kErfcx8;
  g = g * t + 0.5f * kErfcx7;
  g = g * t + 0.5f * kErfcx6;
  g = g * t + 0.5f * kErfcx5;
  g = g * t + 0.5f * kErfcx4;
  g = g * t + 0.5f * kErfcx3;
  g = g * t + 0.5f * kErfcx2;
  g = g * t + 0.5f * kErfcx1;
  g = g * t + 0.5f * kErfcx0;
  return t * g;
}

template <bool kNonPositive = false>
inline double exp_approx(double x) { return std::exp(x); }

template <typename A> constexpr A kSqrt1_2 = A(gelu::kSqrt1_2);
template <typename A> constexpr A kSqrt2OverPi = A(gelu::kSqrt2OverPi);
template <typename A> constexpr A kInvSqrt2Pi = A(gelu::kInvSqrt2Pi);
template <typename A> constexpr A kCoeff = A(gelu::kCubic);

// P(N(0,1) > |u|) = erfc(|u| / sqrt 2) / 2, given e = exp(-u^2 / 2): relative accuracy in the
// whole tail, where 1 - Phi(|u|) would cancel. double uses libm's erfc (and ignores e).
FUSEDLAYERS_INLINE float upper_tail(float u, float e) {
  return half_erfcx_of_abs(u) * e;
}
inline double upper_tail(double u, double) {
  return 0.5 * std::erfc(std::abs(u) * kSqrt1_2<double>);
}

// Phi(u), given e = exp(-u^2 / 2).
template <typename A>
FUSEDLAYERS_INLINE A normal_cdf(A u, A e) {
  const A q = upper_tail(u, e);
  return u > A(0) ? A(1) - q : q;
}

// (1 + tanh(z)) / 2 = 1 / (1 + e^{-2z}): no cancellation for negative z.
template <typename A>
FUSEDLAYERS_INLINE A tanh_cdf(A u) {
  const A z = kSqrt2OverPi<A> * (u + kCoeff<A> * u * u * u);
  return A(1) / (A(1) + exp_approx(A(-2) * z));
}

template <typename A>
FUSEDLAYERS_INLINE A gelu(A u, GeluApprox approx) {
  return u * (approx == GeluApprox::kTanh ? tanh_cdf(u)
                                          : normal_cdf(u, exp_approx<true>(A(-0.5) * u * u)));
}

template <typename A>
FUSEDLAYERS_INLINE A gelu_grad(A u, GeluApprox approx) {
  if (approx == GeluApprox::kTanh) {
    const A s = tanh_cdf(u);
    const A dz = kSqrt2OverPi<A> * (A(1) + A(3) * kCoeff<A> * u * u);
    return s + A(2) * u * s * (A(1) - s) * dz;
  }
  const A e = exp_approx<true>(A(-0.5) * u * u);
  return normal_cdf(u, e) + u * kInvSqrt2Pi<A> * e;
}

// sigmoid(u) = 1 / (1 + e^{-u}): 0 once e^{-u} overflows (u < -88), never NaN but for NaN u.
template <typename A>
FUSEDLAYERS_INLINE A sigmoid(A u) {
  return A(1) / (A(1) + exp_approx(-u));
}

}  // namespace cpu
}  // namespace fusedlayers
