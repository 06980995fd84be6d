// fusedlayers::linear_cross_entropy_pass for PyTorch: schema and CPU/CUDA kernel (tensor
// conversion around csrc/loss/linear_cross_entropy.h, which checks the arguments and runs the chunk
// loop) with ATen's GEMM on the tensors' device. Autograd, the reductions and the fake kernel are
// fusedlayers/torch/linear_cross_entropy.py's: the pass is called by its forward and backward.
#include "backends/torch/torch_binding.h"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers::torch_binding {
namespace {

// c = a @ b (or c += a @ b) with ATen on c's device and current stream.
FrameworkGemm aten_gemm(const at::Tensor& like) {
  return [options = like.options()](const Matrix& a, const Matrix& b, void* c, DType dtype,
                                    bool accumulate) {
    const auto typed = options.dtype(to_scalar_type(dtype));
    at::Tensor out = at::from_blob(c, {a.rows, b.cols}, typed);
    if (accumulate)
      out.addmm_(matrix_view(a, typed), matrix_view(b, typed));
    else
      at::mm_out(out, matrix_view(a, typed), matrix_view(b, typed));
  };
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pass_kernel(
    const at::Tensor& input_in, const at::Tensor& weight_in, const OptTensor& bias_in,
    const at::Tensor& target_in, const OptTensor& grad_scale_in, int64_t ignore_index,
    double label_smoothing, double softcap, double z_loss) {
  const char* op = "linear_cross_entropy";
  const OptTensor weight_opt = weight_in;
  check_tensors(op, "input", input_in, {{"linear_weight", &weight_opt}, {"linear_bias", &bias_in}});
  TORCH_CHECK_TYPE(!at::isFloatingType(target_in.scalar_type()) &&
                       !at::isComplexType(target_in.scalar_type()) &&
                       target_in.scalar_type() != at::kBool,
                   "fusedlayers.", op, ": target must be an integer tensor, got ",
                   target_in.scalar_type());
  check_same_device(op, "target", target_in, "input", input_in);
  const at::Tensor input = input_in.contiguous(), weight = weight_in.contiguous();
  const OptTensor bias = contiguous(bias_in);
  const at::Tensor target = target_in.to(at::kLong).contiguous();
  const auto loss_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_scale;
  if (grad_scale_in) {
    check_same_device(op, "grad_scale", *grad_scale_in, "input", input_in);
    grad_scale = grad_scale_in->to(loss_type).contiguous();
  }
  LinearCrossEntropy a{ref(input), ref(weight), ref(bias), target.data_ptr<int64_t>(),
                       target.numel(), ignore_index, label_smoothing, softcap, z_loss};
  if (grad_scale.defined()) {
    a.grad_scale = grad_scale.data_ptr();
    a.grad_scale_rows = grad_scale.numel();
  }
  const LinearCrossEntropySizes s = call_csrc([&] { return linear_cross_entropy_check(a); });
  at::Tensor loss = at::empty({s.rows}, input.options().dtype(loss_type));
  const bool grads = grad_scale.defined();
  at::Tensor dinput = grads ? at::empty_like(input) : at::empty({0}, input.options());
  at::Tensor dweight = grads ? at::empty_like(weight) : at::empty({0}, input.options());
  at::Tensor dbias = grads && bias ? at::empty_like(*bias) : at::empty({0}, input.options());
  a.loss = loss.data_ptr();
  a.dinput = dinput.data_ptr();
  a.dweight = dweight.data_ptr();
  a.dbias = dbias.data_ptr();
  run_with_workspace(input, a, s, [](const auto& a, auto s, const Exec&) {
    return linear_cross_entropy_workspace_size(a, s);
  }, [gemm = aten_gemm(input)](const auto& a, auto s, const Exec& exec) {
    linear_cross_entropy(a, s, exec, gemm);
  });
  return {loss, dinput, dweight, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // loss: each row's loss; with grad_scale (1 or N values), the gradients of sum_i scale_i loss_i
  // (csrc/loss/linear_cross_entropy.h), else empty tensors.
  m.def("linear_cross_entropy_pass(Tensor input, Tensor linear_weight, Tensor? linear_bias, "
        "Tensor target, Tensor? grad_scale, int ignore_index, float label_smoothing, "
        "float softcap, float z_loss) -> (Tensor loss, Tensor dinput, Tensor dweight, "
        "Tensor dbias)");
  impl_devices(m, "linear_cross_entropy_pass", &pass_kernel);
}

}  // namespace fusedlayers::torch_binding
