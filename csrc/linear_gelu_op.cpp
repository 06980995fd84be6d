// The Linear + GELU op's argument checks (contract: linear_gelu.h).
#include <utility>

#include "linear_gelu.h"

namespace fusedlayers {
namespace {

// input's sizes without the last: the rows of the GEMM.
Sizes leading(const TensorRef& input) { return {input.sizes.data, input.sizes.size - 1}; }

void check_dtype(const char* op, const char* arg, const TensorRef& t, const TensorRef& input) {
  if (t.dtype != input.dtype)
    arg_error(op, std::string(arg) + " must have input's dtype " + dtype_name(input.dtype) +
                      ", got " + dtype_name(t.dtype),
              Error::Kind::kType);
}

// The rules forward and backward share: input, weight and (when defined) bias.
GemmSizes check_linear(const char* op, const TensorRef& input, const TensorRef& weight,
                       const TensorRef& bias) {
  check_dtype(op, "weight", weight, input);
  if (weight.sizes.size != 2)
    arg_error(op, "weight must be 2-D (out_features, in_features), got shape " +
                      weight.sizes.str());
  const int64_t n = weight.sizes[0], k = weight.sizes[1];
  if (input.sizes.size < 1 || input.sizes[input.sizes.size - 1] != k)
    arg_error(op, "the last dimension of input must equal in_features = weight.shape[1] = " +
                      std::to_string(k) + ", got input of shape " + input.sizes.str());
  if (bias.defined) {
    check_dtype(op, "bias", bias, input);
    if (bias.sizes.size != 1 || bias.sizes[0] != n)
      arg_error(op, "bias must have shape (out_features,) = (" + std::to_string(n) + ",), got " +
                        bias.sizes.str());
  }
  return {leading(input).numel(), n, k};
}

}  // namespace

GemmSizes linear_gelu_forward_check(const LinearGeluForward& a) {
  return check_linear("linear_gelu", a.input, a.weight, a.bias);
}

GemmSizes linear_gelu_backward_check(const LinearGeluBackward& a) {
  const char* op = "linear_gelu_backward";
  const GemmSizes s = check_linear(op, a.input, a.weight, TensorRef{});
  const Sizes lead = leading(a.input);  // then out_features
  for (const auto& [arg, t] : {std::pair{"grad_out", &a.grad_out}, std::pair{"pre", &a.pre}}) {
    const bool ok = t->sizes.size == a.input.sizes.size && t->sizes[t->sizes.size - 1] == s.n &&
                    Sizes{t->sizes.data, t->sizes.size - 1} == lead && t->dtype == a.input.dtype;
    if (!ok)
      arg_error(op, std::string(arg) + " must have shape " + lead.str() + " + [" +
                        std::to_string(s.n) + "] and dtype " + dtype_name(a.input.dtype) +
                        ", got " + t->sizes.str() + " " + dtype_name(t->dtype));
  }
  return s;
}

}  // namespace fusedlayers
