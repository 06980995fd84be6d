// Autograd for the fusedlayers ops, registered to the Autograd dispatch key in C++: each forward
// redispatches to the op's CPU/CUDA (or, while tracing, fake) kernel and saves what its backward
// op needs; each backward calls only that backward op, so torch.compile traces both. In C++
// rather than with torch.library.register_autograd because the Python path costs tens of
// microseconds per call, which decides the speed of small layers.
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

namespace fusedlayers {
namespace torch_binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The typed dispatcher handle of fusedlayers::<name>, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("fusedlayers::") + name).c_str(), "")
      .typed<Signature>();
}

// Saves the packed sign mask, not x: 1 bit per element for the backward (csrc/relu_scale.h).
class ReluScale : public torch::autograd::Function<ReluScale> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double alpha) {
    static const auto fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double)>(
        "relu_scale_with_mask");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mask] = fwd.call(x, alpha);
    ctx->save_for_backward({mask});
    ctx->saved_data["alpha"] = alpha;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd =
        op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("relu_scale_backward");
    const auto mask = ctx->get_saved_variables()[0];
    return {bwd.call(grads[0], mask, ctx->saved_data["alpha"].toDouble()), at::Tensor()};
  }
};

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

class LayerNorm : public torch::autograd::Function<LayerNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                               const OptTensor& bias, double eps, bool memory_efficient,
                               bool subtract_mean) {
    static const auto fwd =
        op<Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&,
                   double, bool, bool)>("layer_norm");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, rstd] = fwd.call(input, normalized_shape, weight, bias, eps, memory_efficient,
                                    subtract_mean);
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for mean and rstd
    ctx->save_for_backward({memory_efficient ? y : input, mean, rstd,
                            weight.value_or(at::Tensor()), bias.value_or(at::Tensor())});
    ctx->saved_data["norm_ndims"] = static_cast<int64_t>(normalized_shape.size());
    ctx->saved_data["memory_efficient"] = memory_efficient;
    ctx->saved_data["subtract_mean"] = subtract_mean;
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd =
        op<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   c10::SymIntArrayRef, const OptTensor&, const OptTensor&, bool, bool)>(
            "layer_norm_backward");
    variable_list none(7);
    if (!grads[0].defined()) return none;  // only mean/rstd were used: nothing flows back
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto norm_ndims = ctx->saved_data["norm_ndims"].toInt();
    const auto optional = [](const at::Tensor& t) {
      return t.defined() ? OptTensor(t) : OptTensor();
    };
    auto [dx, dw, db] = bwd.call(grads[0], x, saved[1], saved[2],
                                 x.sym_sizes().slice(x.dim() - norm_ndims), optional(saved[3]),
                                 optional(saved[4]), ctx->saved_data["memory_efficient"].toBool(),
                                 ctx->saved_data["subtract_mean"].toBool());
    none[0] = dx;
    if (saved[3].defined()) none[2] = dw;
    if (saved[4].defined()) none[3] = db;
    return none;
  }
};

// Saves the pre-activation, written by linear_gelu_with_pre, for the GELU gradient.
class LinearGelu : public torch::autograd::Function<LinearGelu> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const OptTensor& bias,
                            c10::string_view approximate) {
    static const auto fwd =
        op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                              const OptTensor&, c10::string_view)>(
            "linear_gelu_with_pre");
    at::AutoDispatchBelowADInplaceOrView below;
    // The GEMMs need a contiguous input: made once here and saved, not again for wgrad.
    const at::Tensor x = input.contiguous();
    auto [y, pre] = fwd.call(x, weight, bias, approximate);
    ctx->save_for_backward({x, weight, pre});
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["approximate"] = std::string(approximate);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd =
        op<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   bool, c10::string_view)>("linear_gelu_backward");
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dw, db] = bwd.call(grads[0], saved[0], saved[1], saved[2], has_bias,
                                 ctx->saved_data["approximate"].toStringRef());
    return {dx, dw, has_bias ? db : at::Tensor(), at::Tensor()};
  }
};

// Whether autograd will need a backward for an op on these inputs.
bool needs_grad(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}

// Without a backward to feed, each op runs its plain forward: no mask, pre-activation or saved
// tensors are written, and no autograd node is made.
at::Tensor relu_scale_autograd(const at::Tensor& x, double alpha) {
  if (needs_grad({&x})) return ReluScale::apply(x, alpha);
  static const auto fwd = op<at::Tensor(const at::Tensor&, double)>("relu_scale");
  at::AutoDispatchBelowADInplaceOrView below;
  return fwd.call(x, alpha);
}

Tensor3 layer_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps,
                            bool memory_efficient, bool subtract_mean) {
  if (!needs_grad({&input, weight ? &*weight : nullptr, bias ? &*bias : nullptr})) {
    static const auto fwd =
        op<Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&,
                   double, bool, bool)>("layer_norm");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(input, normalized_shape, weight, bias, eps, memory_efficient, subtract_mean);
  }
  auto out = LayerNorm::apply(input, normalized_shape, weight, bias, eps, memory_efficient,
                              subtract_mean);
  return {out[0], out[1], out[2]};
}

at::Tensor linear_gelu_autograd(const at::Tensor& input, const at::Tensor& weight,
                                const OptTensor& bias, c10::string_view approximate) {
  if (needs_grad({&input, &weight, bias ? &*bias : nullptr}))
    return LinearGelu::apply(input, weight, bias, approximate);
  static const auto fwd =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view)>(
          "linear_gelu");
  at::AutoDispatchBelowADInplaceOrView below;
  return fwd.call(input, weight, bias, approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("relu_scale", &relu_scale_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("linear_gelu", &linear_gelu_autograd);
}

}  // namespace torch_binding
}  // namespace fusedlayers
