// GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415): the form names and the constants that the CPU
// and CUDA kernels share, so both compute the same function.
//   erf  form ('none'): gelu(u) = u Phi(u) = u/2 * (1 + erf(u / sqrt(2)))
//   tanh form ('tanh'): gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3)))
#pragma once

#include <string>

#include "common.h"

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
// t = 1 / (1 + z/2) = 1 / (1 + |u| kHalfInvSqrt2) and G(t) = sum kErfcx<i> t^i, fitted for
// relative error (max 1.1e-8 in exact arithmetic, ~2e-7 in float) in the variable of Press et
// al., Numerical Recipes 2nd ed. §6.2. Scalars, not an array: CUDA device code may read
// constexpr scalars of namespace scope, not arrays.
constexpr float kHalfInvSqrt2 = 0.35355339059327376f;
constexpr float kErfcx0 = 2.820947949e-1f;
constexpr float kErfcx1 = 2.820938420e-1f;
constexpr float kErfcx2 = 2.468808824e-1f;
constexpr float kErfcx3 = 1.753732564e-1f;
constexpr float kErfcx4 = 9.302343999e-2f;
constexpr float kErfcx5 = -5.731799185e-2f;
constexpr float kErfcx6 = 1.272857766e-1f;
constexpr float kErfcx7 = -4.472571062e-1f;
constexpr float kErfcx8 = 4.864195662e-1f;
constexpr float kErfcx9 = -2.309721610e-1f;
constexpr float kErfcx10 = 4.237568961e-2f;

}  // namespace gelu
}  // namespace fusedlayers
