// fusedlayers::linear_gelu{,_with_pre,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor
// conversion around csrc/gemm/linear_gelu.h, which checks every argument and picks the device's
// passes), autograd and autocast (the autocast dtype on CPU and CUDA, as for linear). The binding
// hands csrc the framework's GEMMs: ATen's on the CPU (cpu_gemm), cuBLASLt with ATen's workspace
// on CUDA.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "gemm/linear_gelu.h"

namespace fusedlayers::torch_binding {
namespace {

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                              c10::string_view);
using WithPreSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const OptTensor&, c10::string_view);
using BackwardSig = Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, bool, c10::string_view);

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
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

// c = a @ b with ATen's CPU GEMM. ATen's float16 GEMM calls oneDNN only on CPUs with
// AVX512-FP16; elsewhere it is a generic loop, and the float32 GEMM of the upcast operands is
// faster (docs/DESIGN.md) and as exact: float16 products fit float's 24 bits, and both sum in
// float.
void cpu_gemm(const Matrix& a, const Matrix& b, void* c, DType dtype) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool native_half = __builtin_cpu_supports("avx512fp16");
#else
  constexpr bool native_half = true;  // ATen's own choice elsewhere (oneDNN on Arm's FP16)
#endif
  const auto options = at::TensorOptions().dtype(to_scalar_type(dtype));
  at::Tensor out = at::from_blob(c, {a.rows, b.cols}, options);
  const at::Tensor av = matrix_view(a, options), bv = matrix_view(b, options);
  if (dtype == DType::kFloat16 && !native_half)
    out.copy_(at::mm(av.to(at::kFloat), bv.to(at::kFloat)));
  else
    at::mm_out(out, av, bv);
}

GemmContext gemm_context(const at::Tensor& x) { return {cpu_gemm, lt_context(x)}; }

// y, and pre when `with_pre` (the backward's input; else an undefined tensor, never written).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_in, const at::Tensor& weight_in,
                                           const OptTensor& bias_in, c10::string_view approximate,
                                           bool with_pre) {
  const OptTensor weight_opt(weight_in);
  check_tensors("linear_gelu", "x", x_in, {{"weight", &weight_opt}, {"bias", &bias_in}});
  const at::Tensor x = x_in.contiguous();
  const Weight w = weight_storage(weight_in);
  const OptTensor bias = contiguous(bias_in);
  LinearGeluForward a{ref(x), w.ref(), w.layout, ref(bias)};
  const GemmSizes s = call_csrc([&] {
    a.approx = parse_gelu_approx("linear_gelu", std::string(approximate));
    return linear_gelu_forward_check(a);
  });
  at::Tensor y = at::empty(out_shape(x, s.n), x.options());
  at::Tensor pre = with_pre ? at::empty_like(y) : at::Tensor();
  a.y = y.data_ptr();
  a.pre = with_pre ? pre.data_ptr() : nullptr;
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { linear_gelu_forward(a, s, exec_for(x), gemm_context(x)); });
  return {y, pre};
}

at::Tensor forward_kernel(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                          c10::string_view approximate) {
  return std::get<0>(forward(x, weight, bias, approximate, false));
}

std::tuple<at::Tensor, at::Tensor> with_pre_kernel(const at::Tensor& x, const at::Tensor& weight,
                                                   const OptTensor& bias,
                                                   c10::string_view approximate) {
  return forward(x, weight, bias, approximate, true);
}

Tensor3 backward_kernel(const at::Tensor& dy_in, const at::Tensor& x_in,
                        const at::Tensor& weight_in, const at::Tensor& pre_in, bool has_bias,
                        c10::string_view approximate) {
  const char* op = "linear_gelu_backward";
  const OptTensor dy_opt(dy_in), weight_opt(weight_in), pre_opt(pre_in);
  check_tensors(op, "x", x_in, {{"dy", &dy_opt}, {"weight", &weight_opt}, {"pre", &pre_opt}});
  const at::Tensor dy = dy_in.contiguous(), pre = pre_in.contiguous(), x = x_in.contiguous();
  const Weight w = weight_storage(weight_in);
  LinearGeluBackward a{ref(dy), ref(x), w.ref(), ref(pre), w.layout, has_bias};
  const GemmSizes s = call_csrc([&] {
    a.approx = parse_gelu_approx(op, std::string(approximate));
    return linear_gelu_backward_check(a);
  });
  // dweight in the weight's layout, so autograd accumulates it into an (in, out) parameter
  // without a copy.
  at::Tensor dweight = w.layout == WeightLayout::kInOut
                           ? at::empty({w.t.size(1), w.t.size(0)}, w.t.options()).t()
                           : at::empty(w.t.sizes(), w.t.options());
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = at::empty({has_bias ? s.n : 0}, pre.options());
  a.dx = dx.data_ptr();
  a.dweight = dweight.data_ptr();
  a.dbias = dbias.data_ptr();
  run_with_workspace(x, a, s, linear_gelu_backward_workspace_size,
                     [&](const LinearGeluBackward& args, GemmSizes sizes, const Exec& exec) {
                       // under x's device guard: the GEMM context takes its current stream
                       linear_gelu_backward(args, sizes, exec, gemm_context(x));
                     });
  return {dx, dweight, dbias};
}

// Saves the (contiguous) x, the weight and the pre-activation that linear_gelu_with_pre writes
// for the GELU gradient.
struct LinearGeluBackwardNode final : SavingNode<LinearGeluBackwardNode> {
  static constexpr const char* kName = "fusedlayers::LinearGeluBackwardNode";
  SavedVariable x, weight, pre;
  bool has_bias = false;
  std::string approximate;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<BackwardSig>("linear_gelu_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(3);
    if (!grads[0].defined()) return out;
    const at::Tensor xs = x.unpack(), w = weight.unpack(), p = pre.unpack();
    BackwardGuard guard;
    auto [dx, dw, db] = backward.call(grads[0], xs, w, p, has_bias, approximate);
    out[0] = std::move(dx);
    out[1] = std::move(dw);
    if (has_bias) out[2] = std::move(db);
    return out;
  }
  auto saved_variables() { return std::array{&x, &weight, &pre}; }
};

// Without a backward to feed, the plain forward: no pre-activation is written, no Node made.
at::Tensor autograd_kernel(const at::Tensor& x_in, const at::Tensor& weight,
                           const OptTensor& bias, c10::string_view approximate) {
  if (!needs_grad({&x_in, &weight, ptr_if(bias)})) {
    static const auto forward = op<ForwardSig>("linear_gelu");
    return below_autograd([&] { return forward.call(x_in, weight, bias, approximate); });
  }
  static const auto forward = op<WithPreSig>("linear_gelu_with_pre");
  auto node = make_node<LinearGeluBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x_in, weight, bias));
  // The GEMMs need a contiguous x: made once here and saved, not again for wgrad.
  const at::Tensor x = below_autograd([&] { return x_in.contiguous(); });
  auto [y, pre] = below_autograd([&] { return forward.call(x, weight, bias, approximate); });
  torch::autograd::set_history(y, node);
  node->x = SavedVariable(x, false);
  node->weight = SavedVariable(weight, false);
  node->pre = SavedVariable(pre, false);
  node->has_bias = bias.has_value();
  node->approximate = std::string(approximate);
  return y;
}

// Autocast as ATen's for linear: cached_cast casts only float32/float16/bfloat16 tensors of the
// autocast device (float64 stays float64) and reuses the cast of a leaf weight in a region.
template <c10::DeviceType Device>
at::Tensor autocast_kernel(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                           c10::string_view approximate) {
  static const auto forward = op<ForwardSig>("linear_gelu");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(Device);
  return forward.call(at::autocast::cached_cast(dtype, x, Device),
                      at::autocast::cached_cast(dtype, weight, Device),
                      at::autocast::cached_cast(dtype, bias, Device), approximate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // weight is (out_features, in_features), stored so or as the transpose of a contiguous
  // (in_features, out_features) tensor (both read in place). linear_gelu_with_pre also returns
  // the pre-activation x @ weight^T + bias, kept for the backward; dweight has weight's layout.
  m.def("linear_gelu(Tensor x, Tensor weight, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "linear_gelu_with_pre(Tensor x, Tensor weight, Tensor? bias, str approximate) "
      "-> (Tensor y, Tensor pre)");
  m.def(
      "linear_gelu_backward(Tensor dy, Tensor x, Tensor weight, Tensor pre, bool has_bias, "
      "str approximate) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  impl_op(m, "linear_gelu", &forward_kernel, &backward_kernel, &autograd_kernel);
  impl_devices(m, "linear_gelu_with_pre", &with_pre_kernel);
  impl_key(m, c10::DispatchKey::AutocastCPU, "linear_gelu",
           &autocast_kernel<c10::DeviceType::CPU>);
  impl_key(m, c10::DispatchKey::AutocastCUDA, "linear_gelu",
           &autocast_kernel<c10::DeviceType::CUDA>);
}

}  // namespace fusedlayers::torch_binding
