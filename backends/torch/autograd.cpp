// Autograd for the fusedlayers ops, registered to the Autograd dispatch key in C++ and written as
// PyTorch's generated code writes it for native ops: the forward runs the op's CPU/CUDA (or, while
// tracing, fake) kernel below autograd and, when a backward will run, records one Node that
// saves what the op's backward needs; the Node calls only that backward op, so torch.compile
// traces both. Written out rather than with torch::autograd::Function (or, worse, Python's
// register_autograd) because host time per call decides the speed of small layers: the generic
// Function machinery costs about a third more per call than the op's own work.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <type_traits>

#include "backends/torch/binding.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// A new Node of type T, held as the torch version holds Nodes: std::shared_ptr with
// torch::autograd::deleteNode (no deep recursion on release) up to torch 2.12, intrusive_ptr since.
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });  // found by ADL
  } else {
    return c10::make_intrusive<T>();
  }
}

// Whether autograd will need a backward for an op on these inputs.
bool needs_grad(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}

// A backward op runs below autograd, like a native backward kernel, unless the backward is itself
// being recorded (create_graph=True): then its autograd kernel (registered below) makes a second
// derivative raise instead of being silently wrong. Saved variables are unpacked before the guard:
// unpacking runs saved-tensor hooks, and activation checkpointing's recomputes the forward there,
// which must record autograd as the original forward did.
class BackwardGuard {
 public:
  BackwardGuard() {
    if (!at::GradMode::is_enabled()) below_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_;
};

OptTensor unpack_if(const SavedVariable& v, bool present) {
  return present ? OptTensor(v.unpack()) : std::nullopt;
}

// relu_scale saves the packed sign mask, not x: 1 bit per element (csrc/relu_scale.h).
struct ReluScaleBackward final : Node {
  SavedVariable mask;
  double alpha = 0;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd =
        op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("relu_scale_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor m = mask.unpack();
    BackwardGuard guard;
    return {bwd.call(grads[0], m, alpha)};
  }
  void release_variables() override { mask.reset_data(); }
  std::string name() const override { return "fusedlayers::ReluScaleBackward"; }
};

// layer_norm saves its input (or, memory_efficient, its output), mean, rstd and parameters.
struct LayerNormBackward final : Node {
  SavedVariable saved, mean, rstd, weight, bias;
  int64_t norm_ndims = 0;
  bool memory_efficient = false, subtract_mean = true, has_weight = false, has_bias = false;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd =
        op<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   c10::SymIntArrayRef, const OptTensor&, const OptTensor&, bool, bool)>(
            "layer_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(3);
    if (!grads[0].defined()) return out;  // only mean/rstd were used: nothing flows back
    const at::Tensor x = saved.unpack(getptr()), m = mean.unpack(), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight), b = unpack_if(bias, has_bias);
    BackwardGuard guard;
    auto [dx, dw, db] = bwd.call(grads[0], x, m, r, x.sym_sizes().slice(x.dim() - norm_ndims), w,
                                 b, memory_efficient, subtract_mean);
    out[0] = std::move(dx);
    if (has_weight) out[1] = std::move(dw);
    if (has_bias) out[2] = std::move(db);
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&saved, &mean, &rstd, &weight, &bias}) v->reset_data();
  }
  std::string name() const override { return "fusedlayers::LayerNormBackward"; }
};

// linear_gelu saves its (contiguous) input, the weight and the pre-activation that
// linear_gelu_with_pre writes for the GELU gradient.
struct LinearGeluBackward final : Node {
  SavedVariable input, weight, pre;
  bool has_bias = false;
  std::string approximate;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd =
        op<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   bool, c10::string_view)>("linear_gelu_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(3);
    if (!grads[0].defined()) return out;
    const at::Tensor x = input.unpack(), w = weight.unpack(), p = pre.unpack();
    BackwardGuard guard;
    auto [dx, dw, db] = bwd.call(grads[0], x, w, p, has_bias, approximate);
    out[0] = std::move(dx);
    out[1] = std::move(dw);
    if (has_bias) out[2] = std::move(db);
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&input, &weight, &pre}) v->reset_data();
  }
  std::string name() const override { return "fusedlayers::LinearGeluBackward"; }
};

// Without a backward to feed, each op runs its plain forward: no mask, pre-activation or saved
// tensors are written, and no Node is made.
at::Tensor relu_scale_autograd(const at::Tensor& x, double alpha) {
  if (!needs_grad({&x})) {
    static const auto fwd = op<at::Tensor(const at::Tensor&, double)>("relu_scale");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(x, alpha);
  }
  static const auto fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double)>(
      "relu_scale_with_mask");
  auto node = make_node<ReluScaleBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  at::Tensor y, mask;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::tie(y, mask) = fwd.call(x, alpha);
  }
  torch::autograd::set_history(y, node);
  node->mask = SavedVariable(mask, false);
  node->alpha = alpha;
  return y;
}

Tensor3 layer_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps,
                            bool memory_efficient, bool subtract_mean) {
  static const auto fwd =
      op<Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&,
                 double, bool, bool)>("layer_norm");
  const bool grad = needs_grad({&input, weight ? &*weight : nullptr, bias ? &*bias : nullptr});
  Tensor3 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = fwd.call(input, normalized_shape, weight, bias, eps, memory_efficient, subtract_mean);
  }
  if (!grad) return out;
  const auto& [y, mean, rstd] = out;
  auto node = make_node<LayerNormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  torch::autograd::set_history(y, node);  // mean and rstd are not differentiable
  node->saved = memory_efficient ? SavedVariable(y, true) : SavedVariable(input, false);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  node->has_weight = weight.has_value();
  node->has_bias = bias.has_value();
  if (weight) node->weight = SavedVariable(*weight, false);
  if (bias) node->bias = SavedVariable(*bias, false);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->memory_efficient = memory_efficient;
  node->subtract_mean = subtract_mean;
  return out;
}

at::Tensor linear_gelu_autograd(const at::Tensor& input, const at::Tensor& weight,
                                const OptTensor& bias, c10::string_view approximate) {
  if (!needs_grad({&input, &weight, bias ? &*bias : nullptr})) {
    static const auto fwd =
        op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view)>(
            "linear_gelu");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(input, weight, bias, approximate);
  }
  static const auto fwd =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                            const OptTensor&, c10::string_view)>(
          "linear_gelu_with_pre");
  auto node = make_node<LinearGeluBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  at::Tensor x, y, pre;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    // The GEMMs need a contiguous input: made once here and saved, not again for wgrad.
    x = input.contiguous();
    std::tie(y, pre) = fwd.call(x, weight, bias, approximate);
  }
  torch::autograd::set_history(y, node);
  node->input = SavedVariable(x, false);
  node->weight = SavedVariable(weight, false);
  node->pre = SavedVariable(pre, false);
  node->has_bias = bias.has_value();
  node->approximate = std::string(approximate);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("relu_scale", &relu_scale_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("linear_gelu", &linear_gelu_autograd);
  // The backward ops have no derivative of their own: differentiating through them raises.
  for (const char* name : {"relu_scale_backward", "layer_norm_backward", "linear_gelu_backward"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}

}  // namespace torch_binding
}  // namespace fusedlayers
