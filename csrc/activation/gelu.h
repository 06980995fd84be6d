// GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415): the form names and the constants that the CPU
// and CUDA kernels share, so both compute the same function.
//   erf  form ('none'): gelu(u) = u Phi(u) = u/2 * (1 + erf(u / sqrt(2)))
//   tanh form ('tanh'): gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3)))
#pragma once

#include <string>

#include "util/common.h"

namespace fusedlayers {

enum class GeluApprox { kNone, kTanh };

// torch's `approximate` argument; an Error naming op otherwise.
inline GeluApprox parse_gelu_approx(const char* op, const std::string& approximate) {
  if (approximate == "none") return GeluApprox::kNone;
  if (approximate == "tanh") return GeluApprox::kTanh;
  arg_error(op, "approximate must be 'none' or 'tanh', got '" + approximate + "'");
}

namespace gelu {

constexpr double kSqrt1_2 = 0.70710678118654752440;      // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi), the normal pdf's
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi), the tanh form's
constexpr double kCubic = 0.044715;                      // the tanh form's cubic term

// erfc(z) e^{z^2} at z = |u| / sqrt 2, the scaled complementary error function, as t G(t) with
// t = 1 / (1 + z/2) = 1 / (1 + |u| kHalfInvSqrt2) and G(t) = sum kErfcx<i> t^i, in the variable of
// Press et al., Numerical Recipes 2nd ed. §6.2, fitted here for relative error (minimax by
// Lawson's iteration): max 5.8e-8 with these float coefficients for |u| <= 13.4, past which
// e^{-u^2/2} leaves float's normal range; evaluated in float, ~3e-7. Degree 8: the degree-10 fit
// this replaced was no more accurate in float and two multiply-adds dearer. Scalars, not an
// array: CUDA device code may read constexpr scalars of namespace scope, not arrays.
constexpr float kHalfInvSqrt2 = 0.35355339059327376f;
constexpr float kErfcx0 = 2.820876837e-1f;
constexpr float kErfcx1 = 2.823534608e-1f;
constexpr float kErfcx2 = 2.432611436e-1f;
constexpr float kErfcx3 = 2.020692825e-1f;
constexpr float kErfcx4 = -2.517638542e-2f;
constexpr float kErfcx5 = 2.759763002e-1f;
constexpr float kErfcx6 = -4.853821099e-1f;
constexpr float kErfcx7 = 2.837012112e-1f;
constexpr float kErfcx8 = -5.889061838e-2f;

}  // namespace gelu
}  // namespace fusedlayers
