// fusedlayers::rope and rope_backward for PyTorch: schema, CPU/CUDA kernel (strided views around
// csrc/rope/rope.h, which checks the arguments), autograd (saves cos and sin only). No autocast
// kernel: rope runs in q's dtype, as the unfused multiply-adds do with cos and sin cast to it.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "rope/rope.h"

namespace fusedlayers::torch_binding {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using ForwardSig = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, int64_t, bool);

// t with a contiguous last dim (a copy where it is not).
at::Tensor last_contiguous(const at::Tensor& t) {
  return t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1 ? t : t.contiguous();
}

// t as (batch, heads, seq, head_dim) strides: unsqueeze_dim 1 has heads at dim 1, 2 at dim 2.
RopeView view(const at::Tensor& t, int64_t unsqueeze_dim) {
  const int hd = unsqueeze_dim == 1 ? 1 : 2, sd = unsqueeze_dim == 1 ? 2 : 1;
  return {t.data_ptr(), t.size(hd), t.stride(0), t.stride(hd), t.stride(sd)};
}

// An output like `like`: its strides where they are dense (a transposed view stays one), else
// contiguous; the last dim is contiguous either way.
at::Tensor output_like(const at::Tensor& like) {
  at::Tensor out = at::empty_like(like);
  return out.stride(-1) == 1 ? out : at::empty(like.sizes(), like.options());
}

Pair run(const char* op, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
         const at::Tensor& sin_in, int64_t unsqueeze_dim, bool interleaved, bool backward) {
  const char* q_name = backward ? "dq_embed" : "q";
  check_floating(op, q_name, q_in);
  for (const auto& [name, t] : {std::pair{"k", &k_in}, {"cos", &cos_in}, {"sin", &sin_in}}) {
    check_floating(op, name, *t);
    check_same_device(op, name, *t, q_name, q_in);
  }
  const at::Tensor q = last_contiguous(q_in), k = last_contiguous(k_in);
  const at::Tensor cos = last_contiguous(cos_in), sin = last_contiguous(sin_in);
  const RopeArgs a{ref(q), ref(k), ref(cos), ref(sin), unsqueeze_dim,
                   interleaved};
  const RopeShape shape = call_csrc([&] { return rope_check(op, a); });
  if (cos.stride(1) != sin.stride(1) || cos.stride(0) != sin.stride(0))
    return run(op, q, k, cos.contiguous(), sin.contiguous(), unsqueeze_dim, interleaved, backward);
  at::Tensor q_out = output_like(q), k_out = output_like(k);
  RopePass p{to_dtype(q.scalar_type()), to_dtype(cos.scalar_type()), shape, cos.data_ptr(),
             sin.data_ptr(), cos.size(0) == 1 ? 0 : cos.stride(0), cos.stride(1),
             view(q, unsqueeze_dim), view(k, unsqueeze_dim), view(q_out, unsqueeze_dim),
             view(k_out, unsqueeze_dim), interleaved, backward};
  const c10::OptionalDeviceGuard guard(q.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { rope(p, exec_for(q)); });
  return {q_out, k_out};
}

Pair forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  return run("rope", q, k, cos, sin, unsqueeze_dim, interleaved, false);
}

Pair backward_kernel(const at::Tensor& dq_embed, const at::Tensor& dk_embed,
                     const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim,
                     bool interleaved) {
  return run("rope_backward", dq_embed, dk_embed, cos, sin, unsqueeze_dim, interleaved, true);
}

// Saves cos and sin: the backward is the transposed rotation of the incoming gradients.
struct RopeBackwardNode final : SavingNode<RopeBackwardNode> {
  static constexpr const char* kName = "fusedlayers::RopeBackwardNode";
  SavedVariable cos, sin;
  int64_t unsqueeze_dim = 1;
  bool interleaved = false;
  std::vector<int64_t> q_shape, k_shape;
  at::TensorOptions options;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<ForwardSig>("rope_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined() && !grads[1].defined()) return {at::Tensor(), at::Tensor()};
    // an output that was not used has no gradient: zeros of its shape
    const at::Tensor dq = grads[0].defined() ? grads[0] : at::zeros(q_shape, options);
    const at::Tensor dk = grads[1].defined() ? grads[1] : at::zeros(k_shape, options);
    const at::Tensor c = cos.unpack(), s = sin.unpack();
    BackwardGuard guard;
    auto [gq, gk] = backward.call(dq, dk, c, s, unsqueeze_dim, interleaved);
    return {gq, gk};
  }
  auto saved_variables() { return std::array{&cos, &sin}; }
};

Pair autograd_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t unsqueeze_dim, bool interleaved) {
  static const auto forward = op<ForwardSig>("rope");
  TORCH_CHECK_VALUE(!(at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad())),
                    "fusedlayers.rope: cos and sin are constants of the positions and are not "
                    "differentiated; pass them detached (transformers' rotary embeddings make "
                    "them under no_grad)");
  if (!needs_grad({&q, &k}))
    return below_autograd([&] { return forward.call(q, k, cos, sin, unsqueeze_dim, interleaved); });
  auto node = make_node<RopeBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(q, k));
  auto [q_embed, k_embed] =
      below_autograd([&] { return forward.call(q, k, cos, sin, unsqueeze_dim, interleaved); });
  torch::autograd::set_history(q_embed, node);
  torch::autograd::set_history(k_embed, node);
  node->cos = SavedVariable(cos, false);
  node->sin = SavedVariable(sin, false);
  node->unsqueeze_dim = unsqueeze_dim;
  node->interleaved = interleaved;
  node->q_shape = q.sizes().vec();
  node->k_shape = k.sizes().vec();
  node->options = q.options();
  return {q_embed, k_embed};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // q, k: (batch, heads, seq, head_dim) with unsqueeze_dim=1, (batch, seq, heads, head_dim) with
  // 2, any strides (a transposed view stays one in the results); cos, sin: (batch or 1, seq,
  // rotary_dim), float32 or q's dtype. New tensors, never in place.
  m.def(
      "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, "
      "bool interleaved=False) -> (Tensor q_embed, Tensor k_embed)");
  m.def(
      "rope_backward(Tensor dq_embed, Tensor dk_embed, Tensor cos, Tensor sin, int unsqueeze_dim, "
      "bool interleaved) -> (Tensor dq, Tensor dk)");
  impl_op(m, "rope", &forward_kernel, &backward_kernel, &autograd_kernel);
}

}  // namespace fusedlayers::torch_binding
