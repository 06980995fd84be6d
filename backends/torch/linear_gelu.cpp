// fusedlayers::linear_gelu{,_with_pre,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor
// conversion around csrc/linear_gelu.h, which checks every argument), autograd and autocast (the
// autocast dtype on CPU and CUDA, as for linear).
// CPU: the GEMMs are ATen's (at::mm; float16 ones in float32 where that is faster, see
// cpu_gemm); csrc's bias_gelu op adds the bias and applies GELU in one pass over the GEMM's
// output (at::addmm would first fill the output with the broadcast bias, one more pass); the
// backward's GELU gradient and dbias are one csrc pass, dgrad and wgrad at::mm.
// CUDA: csrc runs everything on cuBLASLt with ATen's handle and workspace.
#include <ATen/autocast_mode.h>

#include "backends/torch/autograd.h"
#include "backends/torch/binding.h"
#include "csrc/linear_gelu.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

// The types and devices csrc cannot see; every other rule is csrc's.
void check_tensors(const char* op, const at::Tensor& input, const at::Tensor& weight,
                   const OptTensor& bias) {
  check_floating(op, "input", input);
  check_floating(op, "weight", weight);
  check_same_device(op, "weight", weight, "input", input);
  if (!bias) return;
  check_floating(op, "bias", *bias);
  check_same_device(op, "bias", *bias, "input", input);
}

std::vector<int64_t> out_shape(const at::Tensor& input, int64_t out_features) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(out_features);
  return shape;
}

// The weight as stored: (out, in) as nn.Linear keeps it, or its transpose contiguous, (in, out)
// as GPT-2's Conv1D and Keras' Dense keep it (passed as `weight.t()`): both are read in place.
// Any other layout is copied once. ref() gives csrc the (out, in) sizes and the storage.
struct Weight {
  at::Tensor t;
  WeightLayout layout;
  TensorRef ref() const {
    return {t.data_ptr(), to_dtype(t.scalar_type()), sizes(t.sizes()), true};
  }
};

Weight weight_storage(const at::Tensor& weight) {
  if (weight.dim() != 2 || weight.is_contiguous()) return {weight.contiguous(), WeightLayout::kOutIn};
  if (weight.t().is_contiguous()) return {weight, WeightLayout::kInOut};
  return {weight.contiguous(), WeightLayout::kOutIn};
}

// out = a @ b on the CPU. ATen's float16 GEMM calls oneDNN only on CPUs with AVX512-FP16;
// elsewhere it is a generic loop, and the float32 GEMM of the upcast operands is faster (2 Zen 4
// cores, (2048 x 512) x (512 x 2048): forward 123 -> 30 ms, dgrad 2.8 s -> 23 ms, wgrad 0.64 s ->
// 24 ms) and as exact: float16 products fit float's 24 bits, and both sum in float.
void cpu_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool native_half = __builtin_cpu_supports("avx512fp16");
#else
  constexpr bool native_half = true;  // ATen's own choice elsewhere (oneDNN on Arm's FP16)
#endif
  if (a.scalar_type() == at::kHalf && !native_half)
    out.copy_(at::mm(a.to(at::kFloat), b.to(at::kFloat)));
  else
    at::mm_out(out, a, b);
}

at::Tensor cpu_gemm(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  cpu_gemm(out, a, b);
  return out;
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
                                           const OptTensor& bias, c10::string_view approximate,
                                           bool with_pre) {
  const char* op = "linear_gelu";
  check_tensors(op, input, weight, bias);
  const at::Tensor x = input.contiguous();
  const Weight w = weight_storage(weight);
  const OptTensor b = contiguous(bias);
  LinearGeluForward a{ref(x), w.ref(), w.layout, ref(b)};
  const GemmSizes s = call_csrc([&] {
    a.approx = parse_gelu_approx(op, std::string(approximate));
    return linear_gelu_forward_check(a);
  });
  const auto shape = out_shape(x, s.n);
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
#ifdef FUSEDLAYERS_WITH_CUDA
  if (x.is_cuda()) {
    at::Tensor y = at::empty(shape, x.options());
    at::Tensor pre = with_pre ? at::empty_like(y) : at::Tensor();
    a.out = y.data_ptr();
    a.pre = with_pre ? pre.data_ptr() : nullptr;
    call_csrc([&] { linear_gelu_forward_cuda(a, s, lt_context()); });
    return {y, pre};
  }
#endif
  // The framework's GEMM, then the epilogue op over its output; without a backward to feed, y
  // overwrites the GEMM's output in place.
  at::Tensor pre = cpu_gemm(x.view({s.m, s.k}), weight.t()).view(shape);
  at::Tensor y = with_pre ? at::empty_like(pre) : pre;
  const BiasGeluForward e{ref(pre), a.bias, a.approx, pre.data_ptr(), y.data_ptr()};
  call_csrc([&] { bias_gelu_forward(e, {s.m, s.n}, exec_for(pre)); });
  return {y, with_pre ? pre : at::Tensor()};
}

at::Tensor linear_gelu_op(const at::Tensor& input, const at::Tensor& weight,
                          const OptTensor& bias, c10::string_view approximate) {
  return std::get<0>(forward(input, weight, bias, approximate, false));
}

std::tuple<at::Tensor, at::Tensor> linear_gelu_with_pre_op(const at::Tensor& input,
                                                           const at::Tensor& weight,
                                                           const OptTensor& bias,
                                                           c10::string_view approximate) {
  return forward(input, weight, bias, approximate, true);
}

Tensor3 linear_gelu_backward_op(const at::Tensor& grad_out, const at::Tensor& input,
                                const at::Tensor& weight, const at::Tensor& pre, bool has_bias,
                                c10::string_view approximate) {
  const char* op = "linear_gelu_backward";
  check_tensors(op, input, weight, std::nullopt);
  for (const auto& [arg, t] : {std::pair{"grad_out", &grad_out}, std::pair{"pre", &pre}}) {
    check_floating(op, arg, *t);
    check_same_device(op, arg, *t, "input", input);
  }
  const at::Tensor dy = grad_out.contiguous(), p = pre.contiguous(), x = input.contiguous();
  const Weight w = weight_storage(weight);
  LinearGeluBackward a{ref(dy), ref(x), w.ref(), ref(p), w.layout, has_bias};
  const GemmSizes s = call_csrc([&] {
    a.approx = parse_gelu_approx(op, std::string(approximate));
    return linear_gelu_backward_check(a);
  });
  at::Tensor dbias = at::empty({has_bias ? s.n : 0}, p.options());
  at::Tensor grad_weight = empty_like_weight(w);
  const c10::OptionalDeviceGuard guard(x.device());
#ifdef FUSEDLAYERS_WITH_CUDA
  if (x.is_cuda()) {
    at::Tensor grad_input = at::empty(x.sizes(), x.options());
    const at::Tensor ws =
        workspace(linear_gelu_backward_workspace_size_cuda(s, a.input.dtype), p);
    a.grad_input = grad_input.data_ptr();
    a.grad_weight = grad_weight.data_ptr();
    a.grad_bias = dbias.data_ptr();
    a.workspace = ws.data_ptr();
    call_csrc([&] { linear_gelu_backward_cuda(a, s, lt_context()); });
    return {grad_input, grad_weight, dbias};
  }
#endif
  // The epilogue op's backward, then the framework's dgrad and wgrad GEMMs.
  at::Tensor dpre = at::empty({s.m, s.n}, p.options());
  BiasGeluBackward e{ref(dy), ref(p), has_bias, a.approx, dpre.data_ptr(), dbias.data_ptr()};
  const Exec exec = exec_for(p);
  const RowsCols rc{s.m, s.n};
  const at::Tensor ws = workspace(call_csrc([&] {
    return bias_gelu_backward_workspace_size(e, rc, exec);
  }), p);
  e.workspace = ws.data_ptr();
  call_csrc([&] { bias_gelu_backward(e, rc, exec); });
  at::Tensor grad_input = cpu_gemm(dpre, w.t).view(x.sizes());  // dgrad
  const at::Tensor x2d = x.view({s.m, s.k});
  if (w.layout == WeightLayout::kInOut) {
    at::Tensor storage = grad_weight.t();  // (in, out), contiguous
    cpu_gemm(storage, x2d.t(), dpre);       // wgrad, written in the weight's layout
  } else {
    cpu_gemm(grad_weight, dpre.t(), x2d);    // wgrad
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
