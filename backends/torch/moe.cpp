// fusedlayers::moe_permute and moe_unpermute (with their _backward ops) for PyTorch: schemas,
// CPU/CUDA kernels (tensor conversion around csrc/moe/moe.h, which checks the arguments) and autograd.
// No autocast kernel: the rows move in x's dtype, as the unfused gather and sum do.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "moe/moe.h"

namespace fusedlayers::torch_binding {
namespace {

using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Pair = std::tuple<at::Tensor, at::Tensor>;
using PermuteSig = Triple(const at::Tensor&, const at::Tensor&, int64_t);
using PermuteBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t);
using UnpermuteSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, int64_t);
using UnpermuteBackwardSig = Pair(const at::Tensor&, const OptTensor&, const at::Tensor&,
                                  const at::Tensor&, const OptTensor&, int64_t);

// An int32 or int64 tensor on ref's device, contiguous (TypeError for other dtypes).
at::Tensor index_tensor(const char* op, const char* arg, const at::Tensor& t,
                        const char* ref_arg, const at::Tensor& ref, bool int32_only = false) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kInt || (!int32_only && s == at::kLong), "fusedlayers.", op, ": ",
                   arg, " must be ", int32_only ? "int32" : "int32 or int64", ", got ", s);
  check_same_device(op, arg, t, ref_arg, ref);
  return t.contiguous();
}

IndexRef index_ref(const at::Tensor& t) {
  return {t.data_ptr(), t.scalar_type() == at::kInt ? IndexType::kInt32 : IndexType::kInt64,
          sizes(t.sizes())};
}

// top_k_weights checked (float, on ref's device) and contiguous, or absent.
OptTensor weights_tensor(const char* op, const OptTensor& w, const char* ref_arg,
                         const at::Tensor& ref) {
  if (!w) return std::nullopt;
  check_floating(op, "top_k_weights", *w);
  check_same_device(op, "top_k_weights", *w, ref_arg, ref);
  return w->contiguous();
}

Triple permute_kernel(const at::Tensor& x_in, const at::Tensor& top_k_index_in,
                      int64_t num_experts) {
  const char* op = "moe_permute";
  check_floating(op, "x", x_in);
  const at::Tensor idx = index_tensor(op, "top_k_index", top_k_index_in, "x", x_in);
  const at::Tensor x = x_in.contiguous();
  MoeRoute route{index_ref(idx), num_experts};
  const MoeShape rs =
      call_csrc([&] { return moe_route_check(op, route.top_k_index, num_experts); });
  const auto int_options = x.options().dtype(at::kInt);
  at::Tensor row_index = at::empty({rs.pairs()}, int_options);
  at::Tensor offsets = at::empty({num_experts}, int_options);
  MoeScatter scatter{ref(x), route.top_k_index, index_ref(row_index), num_experts};
  const MoeShape s = call_csrc([&] { return moe_scatter_check(op, scatter); });
  at::Tensor xs = at::empty({s.pairs(), s.hidden}, x.options());
  route.row_index = row_index.data_ptr<int32_t>();
  route.offsets = offsets.data_ptr<int32_t>();
  scatter.out = xs.data_ptr();
  run_with_workspace(x, route, s, [](const MoeRoute&, const MoeShape& s, const Exec& exec) {
    return moe_route_workspace_size(s, exec);
  }, [&](const MoeRoute& a, const MoeShape& s, const Exec& exec) {
    moe_route(a, s, exec);
    moe_scatter(scatter, s, exec);
  });
  return {xs, row_index, offsets};
}

// dx[t] = sum_j dxs[row(t, j)]: the gather without weights.
at::Tensor gather(const char* op, const at::Tensor& in, const at::Tensor& idx,
                  const at::Tensor& row_index, const OptTensor& weights, int64_t num_experts) {
  MoeGather a{ref(in), index_ref(idx), index_ref(row_index), num_experts, ref(weights)};
  const MoeShape s = call_csrc([&] { return moe_gather_check(op, a); });
  at::Tensor out = at::empty({s.tokens, s.hidden}, in.options());
  a.out = out.data_ptr();
  const c10::OptionalDeviceGuard guard(in.device());
  call_csrc([&] { moe_gather(a, s, exec_for(in)); });
  return out;
}

at::Tensor permute_backward_kernel(const at::Tensor& dxs_in, const at::Tensor& top_k_index_in,
                                   const at::Tensor& row_index_in, int64_t num_experts) {
  const char* op = "moe_permute_backward";
  check_floating(op, "dxs", dxs_in);
  const at::Tensor idx = index_tensor(op, "top_k_index", top_k_index_in, "dxs", dxs_in);
  const at::Tensor rows = index_tensor(op, "row_index", row_index_in, "dxs", dxs_in, true);
  return gather(op, dxs_in.contiguous(), idx, rows, std::nullopt, num_experts);
}

at::Tensor unpermute_kernel(const at::Tensor& ys_in, const at::Tensor& top_k_index_in,
                            const at::Tensor& row_index_in, const OptTensor& weights_in,
                            int64_t num_experts) {
  const char* op = "moe_unpermute";
  check_floating(op, "ys", ys_in);
  const at::Tensor idx = index_tensor(op, "top_k_index", top_k_index_in, "ys", ys_in);
  const at::Tensor rows = index_tensor(op, "row_index", row_index_in, "ys", ys_in, true);
  const OptTensor w = weights_tensor(op, weights_in, "ys", ys_in);
  return gather(op, ys_in.contiguous(), idx, rows, w, num_experts);
}

Pair unpermute_backward_kernel(const at::Tensor& dout_in, const OptTensor& ys_in,
                               const at::Tensor& top_k_index_in, const at::Tensor& row_index_in,
                               const OptTensor& weights_in, int64_t num_experts) {
  const char* op = "moe_unpermute_backward";
  check_floating(op, "dout", dout_in);
  const at::Tensor idx = index_tensor(op, "top_k_index", top_k_index_in, "dout", dout_in);
  const at::Tensor rows = index_tensor(op, "row_index", row_index_in, "dout", dout_in, true);
  const OptTensor w = weights_tensor(op, weights_in, "dout", dout_in);
  if (ys_in) {
    check_floating(op, "ys", *ys_in);
    check_same_device(op, "ys", *ys_in, "dout", dout_in);
  }
  const OptTensor ys = contiguous(ys_in);
  const at::Tensor dout = dout_in.contiguous();
  MoeScatter a{ref(dout), index_ref(idx), index_ref(rows), num_experts, ref(w), ref(ys)};
  const MoeShape s = call_csrc([&] { return moe_scatter_check(op, a); });
  at::Tensor dys = at::empty({s.pairs(), s.hidden}, dout.options());
  at::Tensor dweights = ys ? at::empty_like(*w) : at::empty({0}, dout.options());
  a.out = dys.data_ptr();
  a.dweights = ys ? dweights.data_ptr() : nullptr;
  const c10::OptionalDeviceGuard guard(dout.device());
  call_csrc([&] { moe_scatter(a, s, exec_for(dout)); });
  return {dys, dweights};
}

// Saves the routing (top_k_index, row_index): dx is the gather of dxs.
struct MoePermuteBackwardNode final : SavingNode<MoePermuteBackwardNode> {
  static constexpr const char* kName = "fusedlayers::MoePermuteBackwardNode";
  SavedVariable top_k_index, row_index;
  int64_t num_experts = 0;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<PermuteBackwardSig>("moe_permute_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor idx = top_k_index.unpack(), rows = row_index.unpack();
    BackwardGuard guard;
    return {backward.call(grads[0], idx, rows, num_experts)};
  }
  auto saved_variables() { return std::array{&top_k_index, &row_index}; }
};

Triple permute_autograd(const at::Tensor& x, const at::Tensor& top_k_index, int64_t num_experts) {
  static const auto forward = op<PermuteSig>("moe_permute");
  if (!needs_grad({&x}))
    return below_autograd([&] { return forward.call(x, top_k_index, num_experts); });
  auto node = make_node<MoePermuteBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  auto [xs, row_index, offsets] =
      below_autograd([&] { return forward.call(x, top_k_index, num_experts); });
  torch::autograd::set_history(xs, node);
  node->top_k_index = SavedVariable(top_k_index, false);
  node->row_index = SavedVariable(row_index, false);
  node->num_experts = num_experts;
  return {xs, row_index, offsets};
}

// Saves the routing and the weights, and ys where the weights need a gradient (their dots).
struct MoeUnpermuteBackwardNode final : SavingNode<MoeUnpermuteBackwardNode> {
  static constexpr const char* kName = "fusedlayers::MoeUnpermuteBackwardNode";
  SavedVariable ys, top_k_index, row_index, weights;
  bool has_weights = false, weights_grad = false;
  int64_t num_experts = 0;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<UnpermuteBackwardSig>("moe_unpermute_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const OptTensor y = unpack_if(ys, weights_grad), w = unpack_if(weights, has_weights);
    const at::Tensor idx = top_k_index.unpack(), rows = row_index.unpack();
    BackwardGuard guard;
    auto [dys, dweights] = backward.call(grads[0], y, idx, rows, w, num_experts);
    return {dys, weights_grad ? dweights : at::Tensor()};
  }
  auto saved_variables() { return std::array{&ys, &top_k_index, &row_index, &weights}; }
};

at::Tensor unpermute_autograd(const at::Tensor& ys, const at::Tensor& top_k_index,
                              const at::Tensor& row_index, const OptTensor& weights,
                              int64_t num_experts) {
  static const auto forward = op<UnpermuteSig>("moe_unpermute");
  if (!needs_grad({&ys, ptr_if(weights)}))
    return below_autograd(
        [&] { return forward.call(ys, top_k_index, row_index, weights, num_experts); });
  auto node = make_node<MoeUnpermuteBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(ys, weights));
  at::Tensor out = below_autograd(
      [&] { return forward.call(ys, top_k_index, row_index, weights, num_experts); });
  torch::autograd::set_history(out, node);
  node->has_weights = weights.has_value();
  node->weights_grad = weights && needs_grad({&*weights});
  if (node->weights_grad) node->ys = SavedVariable(ys, false);
  if (weights) node->weights = SavedVariable(*weights, false);
  node->top_k_index = SavedVariable(top_k_index, false);
  node->row_index = SavedVariable(row_index, false);
  node->num_experts = num_experts;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // x (tokens, hidden); top_k_index (tokens, top_k) int32/int64. xs (tokens * top_k, hidden) in
  // expert order, row_index (tokens * top_k) int32, offsets (num_experts) int32 (csrc/moe/moe.h).
  m.def("moe_permute(Tensor x, Tensor top_k_index, int num_experts) -> (Tensor xs, "
        "Tensor row_index, Tensor offsets)");
  m.def("moe_permute_backward(Tensor dxs, Tensor top_k_index, Tensor row_index, "
        "int num_experts) -> Tensor dx");
  // ys (tokens * top_k, hidden) in expert order -> out (tokens, hidden).
  m.def("moe_unpermute(Tensor ys, Tensor top_k_index, Tensor row_index, "
        "Tensor? top_k_weights, int num_experts) -> Tensor out");
  // dweights (top_k_weights' shape and dtype) where ys is given, else empty.
  m.def("moe_unpermute_backward(Tensor dout, Tensor? ys, Tensor top_k_index, Tensor row_index, "
        "Tensor? top_k_weights, int num_experts) -> (Tensor dys, Tensor dweights)");
  impl_op(m, "moe_permute", &permute_kernel, &permute_backward_kernel, &permute_autograd);
  impl_op(m, "moe_unpermute", &unpermute_kernel, &unpermute_backward_kernel,
          &unpermute_autograd);
}

}  // namespace fusedlayers::torch_binding
