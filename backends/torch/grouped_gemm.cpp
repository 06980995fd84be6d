// fusedlayers::grouped_gemm (with grouped_gemm_backward) for PyTorch: schema, CPU/CUDA kernels
// (tensor conversion around csrc/gemm/grouped_gemm.h, which checks the arguments) and autograd. No
// autocast kernel: fusedlayers.torch.moe_experts casts its operands once itself, as for
// torch's grouped_mm, which autocast's policy does not list.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "gemm/grouped_gemm.h"

namespace fusedlayers::torch_binding {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using BackwardSig = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, bool, std::array<bool, 2>);

// offsets checked (int32, on x's device) and contiguous.
at::Tensor offsets_tensor(const char* op, const at::Tensor& offsets, const at::Tensor& x) {
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kInt, "fusedlayers.", op,
                   ": offsets must be int32 (as moe_permute returns them), got ",
                   offsets.scalar_type());
  check_same_device(op, "offsets", offsets, "x", x);
  return offsets.contiguous();
}

IndexRef offsets_ref(const at::Tensor& t) {
  return {t.data_ptr(), IndexType::kInt32, sizes(t.sizes())};
}

at::Tensor forward_kernel(const at::Tensor& x_in, const at::Tensor& weight_in,
                          const at::Tensor& offsets_in, bool transposed) {
  const char* op = "grouped_gemm";
  check_floating(op, "x", x_in);
  check_floating(op, "weight", weight_in);
  check_same_device(op, "weight", weight_in, "x", x_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor offsets = offsets_tensor(op, offsets_in, x);
  GroupedGemmForward a{ref(x), ref(weight), offsets_ref(offsets), transposed};
  const GroupedGemmShape s = call_csrc([&] { return grouped_gemm_forward_check(a); });
  at::Tensor y = at::empty({s.rows, s.n}, x.options());
  a.y = y.data_ptr();
  run_with_workspace(x, a, s, [](const GroupedGemmForward& a, const GroupedGemmShape& s,
                                 const Exec& exec) {
    return grouped_gemm_workspace_size(s, a.x.dtype, exec);
  }, [](const GroupedGemmForward& a, const GroupedGemmShape& s, const Exec& exec) {
    grouped_gemm_forward(a, s, exec);
  });
  return y;
}

// dx and dweight where output_mask asks for them, else empty tensors.
Pair backward_kernel(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& weight_in,
                     const at::Tensor& offsets_in, bool transposed,
                     std::array<bool, 2> output_mask) {
  const char* op = "grouped_gemm_backward";
  check_floating(op, "dy", dy_in);
  check_floating(op, "x", x_in);
  check_floating(op, "weight", weight_in);
  check_same_device(op, "x", x_in, "dy", dy_in);
  check_same_device(op, "weight", weight_in, "dy", dy_in);
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor offsets = offsets_tensor(op, offsets_in, x);
  GroupedGemmBackward a{ref(dy), ref(x), ref(weight), offsets_ref(offsets), transposed};
  const GroupedGemmShape s = call_csrc([&] { return grouped_gemm_backward_check(a); });
  at::Tensor dx = output_mask[0] ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor dweight = output_mask[1] ? at::empty_like(weight) : at::empty({0}, x.options());
  a.dx = output_mask[0] ? dx.data_ptr() : nullptr;
  a.dweight = output_mask[1] ? dweight.data_ptr() : nullptr;
  run_with_workspace(dy, a, s, [](const GroupedGemmBackward& a, const GroupedGemmShape& s,
                                  const Exec& exec) {
    return grouped_gemm_workspace_size(s, a.x.dtype, exec);
  }, [](const GroupedGemmBackward& a, const GroupedGemmShape& s, const Exec& exec) {
    grouped_gemm_backward(a, s, exec);
  });
  return {dx, dweight};
}

// Saves x, weight and offsets: the dgrad reads the weight, the wgrad x.
struct GroupedGemmBackwardNode final : SavingNode<GroupedGemmBackwardNode> {
  static constexpr const char* kName = "fusedlayers::GroupedGemmBackwardNode";
  SavedVariable x, weight, offsets;
  bool transposed = false;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<BackwardSig>("grouped_gemm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor xv = x.unpack(), w = weight.unpack(), off = offsets.unpack();
    const std::array<bool, 2> mask{should_compute_output(0), should_compute_output(1)};
    BackwardGuard guard;
    auto [dx, dweight] = backward.call(grads[0], xv, w, off, transposed, mask);
    return {mask[0] ? dx : at::Tensor(), mask[1] ? dweight : at::Tensor()};
  }
  auto saved_variables() { return std::array{&x, &weight, &offsets}; }
};

at::Tensor autograd_kernel(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& offsets, bool transposed) {
  static const auto forward = op<ForwardSig>("grouped_gemm");
  if (!needs_grad({&x, &weight}))
    return below_autograd([&] { return forward.call(x, weight, offsets, transposed); });
  auto node = make_node<GroupedGemmBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
  at::Tensor y = below_autograd([&] { return forward.call(x, weight, offsets, transposed); });
  torch::autograd::set_history(y, node);
  node->x = SavedVariable(x, false);
  node->weight = SavedVariable(weight, false);
  node->offsets = SavedVariable(offsets, false);
  node->transposed = transposed;
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // x (rows, k); weight (num_groups, n, k), or (num_groups, k, n) transposed; offsets
  // (num_groups) int32, the groups' row ends. y (rows, n) (csrc/gemm/grouped_gemm.h).
  m.def("grouped_gemm(Tensor x, Tensor weight, Tensor offsets, bool transposed=False) -> "
        "Tensor y");
  // dx (x's shape) and dweight (weight's) where output_mask asks for them, else empty.
  m.def("grouped_gemm_backward(Tensor dy, Tensor x, Tensor weight, Tensor offsets, "
        "bool transposed, bool[2] output_mask) -> (Tensor dx, Tensor dweight)");
  impl_op(m, "grouped_gemm", &forward_kernel, &backward_kernel, &autograd_kernel);
}

}  // namespace fusedlayers::torch_binding
