// The Linear + GELU op's argument checks (contract: linear_gelu.h), apart from its passes so that
// every library has them, also those built without the op's GEMMs (the TF op library, and the
// JAX library's trace-time checks).
#include <utility>

#include "gemm/linear_gelu.h"

namespace fusedlayers {
namespace {

// x's sizes without the last: the rows of the GEMM.
Sizes leading(const TensorRef& x) { return {x.sizes.data, x.sizes.size - 1}; }

void check_dtype(const char* op, const char* arg, const TensorRef& t, const TensorRef& x) {
  if (t.dtype != x.dtype)
    arg_error(op, std::string(arg) + " must have x's dtype " + dtype_name(x.dtype) +
                      ", got " + dtype_name(t.dtype),
              Error::Kind::kType);
}

// The rules forward and backward share: x, weight and (when defined) bias.
GemmSizes check_linear(const char* op, const TensorRef& x, const TensorRef& weight,
                       const TensorRef& bias) {
  check_dtype(op, "weight", weight, x);
  if (weight.sizes.size != 2)
    arg_error(op, "weight must be 2-D (out_features, in_features), got shape " +
                      weight.sizes.str());
  const int64_t n = weight.sizes[0], k = weight.sizes[1];
  if (x.sizes.size < 1 || x.sizes[x.sizes.size - 1] != k)
    arg_error(op, "the last dimension of x must equal in_features = weight.shape[1] = " +
                      std::to_string(k) + ", got x of shape " + x.sizes.str());
  if (bias.defined) {
    check_dtype(op, "bias", bias, x);
    if (bias.sizes.size != 1 || bias.sizes[0] != n)
      arg_error(op, "bias must have shape (out_features,) = (" + std::to_string(n) + ",), got " +
                        bias.sizes.str());
  }
  return {leading(x).numel(), n, k};
}

}  // namespace

GemmSizes linear_gelu_forward_check(const LinearGeluForward& a) {
  return check_linear("linear_gelu", a.x, a.weight, a.bias);
}

GemmSizes linear_gelu_backward_check(const LinearGeluBackward& a) {
  const char* op = "linear_gelu_backward";
  const GemmSizes s = check_linear(op, a.x, a.weight, TensorRef{});
  const Sizes lead = leading(a.x);  // then out_features
  for (const auto& [arg, t] : {std::pair{"dy", &a.dy}, std::pair{"pre", &a.pre}}) {
    const bool ok = t->sizes.size == a.x.sizes.size && t->sizes[t->sizes.size - 1] == s.n &&
                    Sizes{t->sizes.data, t->sizes.size - 1} == lead && t->dtype == a.x.dtype;
    if (!ok)
      arg_error(op, std::string(arg) + " must have shape " + lead.str() + " + [" +
                        std::to_string(s.n) + "] and dtype " + dtype_name(a.x.dtype) +
                        ", got " + t->sizes.str() + " " + dtype_name(t->dtype));
  }
  return s;
}

}  // namespace fusedlayers
