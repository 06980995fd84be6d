// PyTorch implementation of fusedlayers::linear_gelu{,_with_pre,_backward}.
// CPU: the GEMMs are ATen's (at::mm); csrc adds the bias and applies GELU in one pass over the
// GEMM's output (at::addmm would first fill the output with the broadcast bias, one more pass);
// the backward's GELU gradient and dbias are one csrc pass, dgrad and wgrad are at::mm.
// CUDA: csrc runs everything on cuBLASLt with ATen's handle and workspace (csrc/linear_gelu.h).
// Also the schema, autograd and autocast (the autocast dtype on CPU and CUDA, as for linear).
#include <ATen/autocast_mode.h>

#include "backends/torch/autograd.h"
#include "backends/torch/binding.h"
#include "csrc/bias_gelu.h"
#include "csrc/linear_gelu.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

GeluApprox parse_approximate(const char* op, c10::string_view approximate) {
  if (approximate == "none") return GeluApprox::kNone;
  if (approximate == "tanh") return GeluApprox::kTanh;
  TORCH_CHECK_VALUE(false, "fusedlayers.", op, ": approximate must be 'none' or 'tanh', got '",
                    approximate, "'");
}

void check_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                       const at::Tensor* bias) {
  check_floating(op, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  TORCH_CHECK_TYPE(weight.scalar_type() == input.scalar_type(), "fusedlayers.", op,
                   ": weight must have input's dtype ", input.scalar_type(), ", got ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2, "fusedlayers.", op,
                    ": weight must be 2-D (out_features, in_features), got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) == weight.size(1), "fusedlayers.", op,
                    ": the last dimension of input must equal in_features = weight.shape[1] = ",
                    weight.size(1), ", got input of shape ", input.sizes());
  if (!bias) return;
  check_same_device(op, "bias", *bias, "input", input);
  TORCH_CHECK_TYPE(bias->scalar_type() == input.scalar_type(), "fusedlayers.", op,
                   ": bias must have input's dtype ", input.scalar_type(), ", got ",
                   bias->scalar_type());
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "fusedlayers.", op,
                    ": bias must have shape (out_features,) = (", weight.size(0), ",), got ",
                    bias->sizes());
}

// input viewed as (rows, in_features); explicit rows so in_features == 0 works too.
at::Tensor as_2d(const at::Tensor& input) {
  return input.reshape({c10::multiply_integers(input.sizes().slice(0, input.dim() - 1)),
                        input.size(-1)});
}

std::vector<int64_t> out_shape(const at::Tensor& input, int64_t out_features) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(out_features);
  return shape;
}

// The weight as stored: (out, in) as nn.Linear keeps it, or its transpose contiguous, (in, out)
// as GPT-2's Conv1D and Keras' Dense keep it (passed as `weight.t()`): both are read in place.
// Any other layout is copied once.
struct Weight {
  at::Tensor t;
  WeightLayout layout;
};

Weight weight_storage(const at::Tensor& weight) {
  if (weight.is_contiguous()) return {weight, WeightLayout::kOutIn};
  if (weight.t().is_contiguous()) return {weight, WeightLayout::kInOut};
  return {weight.contiguous(), WeightLayout::kOutIn};
}

// grad_weight in the weight's layout, so autograd accumulates it into an (in, out) parameter
// without a copy.
at::Tensor empty_like_weight(const Weight& w) {
  return w.layout == WeightLayout::kInOut ? at::empty({w.t.size(1), w.t.size(0)}, w.t.options()).t()
                                          : at::empty(w.t.sizes(), w.t.options());
}

#ifdef FUSEDLAYERS_WITH_CUDA
LtContext lt_context() {
  return {at::cuda::getCurrentCUDABlasLtHandle(), at::cuda::getCUDABlasLtWorkspace(),
          at::cuda::getCUDABlasLtWorkspaceSize(), current_stream()};
}
#endif

// y, and pre when `with_pre` (the backward's input; else an undefined tensor, never written).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& input, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias,
                                           c10::string_view approximate, bool with_pre) {
  const GeluApprox approx = parse_approximate("linear_gelu", approximate);
  check_linear_args("linear_gelu", input, weight, bias ? &*bias : nullptr);
  const int64_t out_features = weight.size(0);
  const auto shape = out_shape(input, out_features);
  const at::Tensor x2d = as_2d(input);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
#ifdef FUSEDLAYERS_WITH_CUDA
  if (input.is_cuda()) {
    const c10::cuda::CUDAGuard guard(input.device());
    const at::Tensor x = x2d.contiguous();
    const Weight w = weight_storage(weight);
    at::Tensor y = at::empty({x.size(0), out_features}, x.options());
    at::Tensor pre = with_pre ? at::empty_like(y) : at::Tensor();
    call_csrc([&] {
      linear_gelu_forward_cuda(x.data_ptr(), w.t.data_ptr(), w.layout,
                               b.defined() ? b.data_ptr() : nullptr,
                               with_pre ? pre.data_ptr() : nullptr, y.data_ptr(), x.size(0),
                               out_features, x.size(1), approx, to_dtype(x.scalar_type()),
                               lt_context());
    });
    return {y.view(shape), with_pre ? pre.view(shape) : pre};
  }
#endif
  at::Tensor pre = at::mm(x2d, weight.t());
  // Without a backward to feed, y overwrites the GEMM's output in place.
  at::Tensor y = with_pre ? at::empty_like(pre) : pre;
  call_csrc([&] {
    bias_gelu_forward_cpu(pre.data_ptr(), b.defined() ? b.data_ptr() : nullptr, pre.data_ptr(),
                          y.data_ptr(), pre.size(0), out_features, approx,
                          to_dtype(pre.scalar_type()), aten_parallel_for());
  });
  return {y.view(shape), with_pre ? pre.view(shape) : at::Tensor()};
}

at::Tensor linear_gelu_op(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::string_view approximate) {
  return std::get<0>(forward(input, weight, bias, approximate, false));
}

std::tuple<at::Tensor, at::Tensor> linear_gelu_with_pre_op(const at::Tensor& input,
                                                           const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           c10::string_view approximate) {
  return forward(input, weight, bias, approximate, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_backward_op(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& pre, bool has_bias, c10::string_view approximate) {
  const GeluApprox approx = parse_approximate("linear_gelu_backward", approximate);
  check_linear_args("linear_gelu_backward", input, weight, nullptr);
  const auto shape = out_shape(input, weight.size(0));
  TORCH_CHECK_VALUE(grad_out.sizes() == shape && pre.sizes() == shape &&
                        grad_out.scalar_type() == input.scalar_type() &&
                        pre.scalar_type() == input.scalar_type(),
                    "fusedlayers.linear_gelu_backward: grad_out and pre must have shape ",
                    at::IntArrayRef(shape), " and dtype ", input.scalar_type(), ", got ",
                    grad_out.sizes(), " ", grad_out.scalar_type(), " and ", pre.sizes(), " ",
                    pre.scalar_type());
  const int64_t out_features = weight.size(0);
  const int64_t dpre_rows = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));
  const at::Tensor dy = grad_out.contiguous().view({dpre_rows, out_features});
  const at::Tensor p = pre.contiguous().view({dpre_rows, out_features});
  const at::Tensor x = as_2d(input).contiguous();
  const Weight w = weight_storage(weight);
  at::Tensor dbias = at::empty({has_bias ? out_features : 0}, p.options());
  at::Tensor grad_weight = empty_like_weight(w);
  const DType dtype = to_dtype(p.scalar_type());
#ifdef FUSEDLAYERS_WITH_CUDA
  if (p.is_cuda()) {
    check_same_device("linear_gelu_backward", "grad_out", grad_out, "input", input);
    const c10::cuda::CUDAGuard guard(p.device());
    at::Tensor grad_input = at::empty(input.sizes(), x.options());
    call_csrc([&] {
      const at::Tensor ws = workspace(
          linear_gelu_backward_workspace_size_cuda(dpre_rows, out_features, dtype), p);
      linear_gelu_backward_cuda(dy.data_ptr(), x.data_ptr(), w.t.data_ptr(), w.layout,
                                p.data_ptr(), grad_input.data_ptr(), grad_weight.data_ptr(),
                                has_bias ? dbias.data_ptr() : nullptr, ws.data_ptr(), dpre_rows,
                                out_features, weight.size(1), approx, dtype, lt_context());
    });
    return {grad_input, grad_weight, dbias};
  }
#endif
  at::Tensor dpre = at::empty_like(p);
  at::Tensor ws;
  call_csrc([&] {
    if (has_bias)
      ws = workspace(bias_gelu_backward_workspace_size_cpu(p.size(0), out_features, dtype), p);
    bias_gelu_backward_cpu(dy.data_ptr(), p.data_ptr(), dpre.data_ptr(),
                           has_bias ? dbias.data_ptr() : nullptr,
                           ws.defined() ? ws.data_ptr() : nullptr, p.size(0), out_features,
                           approx, dtype, aten_parallel_for());
  });
  at::Tensor grad_input = at::mm(dpre, w.t).view(input.sizes());  // dgrad
  if (w.layout == WeightLayout::kInOut) {
    at::Tensor storage = grad_weight.t();  // (in, out), contiguous
    at::mm_out(storage, x.t(), dpre);       // wgrad, written in the weight's layout
  } else {
    at::mm_out(grad_weight, dpre.t(), x);  // wgrad
  }
  return {grad_input, grad_weight, dbias};
}

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

// Without a backward to feed, the plain forward: no pre-activation is written, no Node made.
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

// Autocast as ATen's for linear: cached_cast casts only float32/float16/bfloat16 tensors of the
// autocast device (float64 stays float64) and reuses the cast of a leaf weight in a region.
template <c10::DeviceType Device>
at::Tensor linear_gelu_autocast(const at::Tensor& input, const at::Tensor& weight,
                                const OptTensor& bias, c10::string_view approximate) {
  static const auto fwd =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view)>(
          "linear_gelu");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(Device);
  return fwd.call(at::autocast::cached_cast(dtype, input, Device),
                  at::autocast::cached_cast(dtype, weight, Device),
                  at::autocast::cached_cast(dtype, bias, Device), approximate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // weight is (out_features, in_features), stored so or as the transpose of a contiguous
  // (in_features, out_features) tensor (both read in place). linear_gelu_with_pre also returns
  // the pre-activation input @ weight^T + bias, kept for the backward; grad_weight has weight's
  // layout.
  m.def("linear_gelu(Tensor input, Tensor weight, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "linear_gelu_with_pre(Tensor input, Tensor weight, Tensor? bias, str approximate) "
      "-> (Tensor out, Tensor pre)");
  m.def(
      "linear_gelu_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor pre, "
      "bool has_bias, str approximate) -> (Tensor grad_input, Tensor grad_weight, "
      "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("linear_gelu", &linear_gelu_op);
  m.impl("linear_gelu_with_pre", &linear_gelu_with_pre_op);
  m.impl("linear_gelu_backward", &linear_gelu_backward_op);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("linear_gelu", &linear_gelu_op);
  m.impl("linear_gelu_with_pre", &linear_gelu_with_pre_op);
  m.impl("linear_gelu_backward", &linear_gelu_backward_op);
}
#endif

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("linear_gelu", &linear_gelu_autograd);
  register_backward_autograd(m, "linear_gelu_backward");
}

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCPU, m) {
  m.impl("linear_gelu", &linear_gelu_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCUDA, m) {
  m.impl("linear_gelu", &linear_gelu_autocast<c10::DeviceType::CUDA>);
}

}  // namespace torch_binding
}  // namespace fusedlayers
