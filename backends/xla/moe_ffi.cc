// XLA FFI handlers fusedlayers_moe_permute_{forward,backward} and
// fusedlayers_moe_unpermute_{forward,backward} on csrc/moe/moe.h, which checks the arguments. XLA's
// buffers are contiguous; top_k_index is int32 or int64, row_index and offsets int32. An absent
// top_k_weights (unpermute) or ys (its backward: no dweights) is an empty buffer. The permute's
// CUDA route takes a workspace result, sized by Python from
// fusedlayers_xla_moe_route_workspace_size.
#include "backends/xla/ffi_binding.h"
#include "moe/moe.h"

namespace fusedlayers::xla_binding {
namespace {

IndexRef index_ref(const AnyBuffer& b, const char* op, const char* arg) {
  const ffi::DataType t = b.element_type();
  if (t != ffi::DataType::S32 && t != ffi::DataType::S64)
    arg_error(op, std::string(arg) + " must be int32 or int64", Error::Kind::kType);
  return {b.untyped_data(), t == ffi::DataType::S32 ? IndexType::kInt32 : IndexType::kInt64,
          sizes(b.dimensions())};
}

ffi::Error permute_forward(Device& device, AnyBuffer x, AnyBuffer top_k_index, Out xs,
                           Out row_index, Out offsets, Out workspace, int64_t num_experts) {
  return call_csrc([&] {
    const char* op = "moe_permute";
    MoeRoute route{index_ref(top_k_index, op, "top_k_index"), num_experts,
                   static_cast<int32_t*>(data(row_index)), static_cast<int32_t*>(data(offsets))};
    MoeScatter scatter{ref(x), route.top_k_index,
                       {data(row_index), IndexType::kInt32, sizes(row_index->dimensions())},
                       num_experts};
    const MoeShape s = moe_scatter_check(op, scatter);
    scatter.out = data(xs);
    route.workspace = device.workspace(moe_route_workspace_size(s, device.exec()), workspace);
    moe_route(route, s, device.exec());
    moe_scatter(scatter, s, device.exec());
  });
}

ffi::Error permute_backward(Device& device, AnyBuffer dxs, AnyBuffer top_k_index,
                            AnyBuffer row_index, Out dx, int64_t num_experts) {
  return call_csrc([&] {
    const char* op = "moe_permute_backward";
    MoeGather a{ref(dxs), index_ref(top_k_index, op, "top_k_index"),
                index_ref(row_index, op, "row_index"), num_experts};
    const MoeShape s = moe_gather_check(op, a);
    a.out = data(dx);
    moe_gather(a, s, device.exec());
  });
}

ffi::Error unpermute_forward(Device& device, AnyBuffer ys, AnyBuffer top_k_index,
                             AnyBuffer row_index, AnyBuffer weights, Out out,
                             int64_t num_experts) {
  return call_csrc([&] {
    const char* op = "moe_unpermute";
    MoeGather a{ref(ys), index_ref(top_k_index, op, "top_k_index"),
                index_ref(row_index, op, "row_index"), num_experts,
                ref(weights, weights.element_count() > 0)};
    const MoeShape s = moe_gather_check(op, a);
    a.out = data(out);
    moe_gather(a, s, device.exec());
  });
}

ffi::Error unpermute_backward(Device& device, AnyBuffer dout, AnyBuffer ys,
                              AnyBuffer top_k_index, AnyBuffer row_index, AnyBuffer weights,
                              Out dys, Out dweights, int64_t num_experts) {
  return call_csrc([&] {
    const char* op = "moe_unpermute_backward";
    const bool dots = ys.element_count() > 0;
    MoeScatter a{ref(dout), index_ref(top_k_index, op, "top_k_index"),
                 index_ref(row_index, op, "row_index"), num_experts,
                 ref(weights, weights.element_count() > 0), ref(ys, dots)};
    const MoeShape s = moe_scatter_check(op, a);
    a.out = data(dys);
    a.dweights = dots ? data(dweights) : nullptr;
    moe_scatter(a, s, device.exec());
  });
}

const auto kPermuteForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<int64_t>("num_experts");
};
const auto kPermuteBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Attr<int64_t>("num_experts");
};
const auto kUnpermuteForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<int64_t>("num_experts");
};
const auto kUnpermuteBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Attr<int64_t>("num_experts");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(moe_permute_forward, ::fusedlayers::xla_binding::permute_forward,
                         ::fusedlayers::xla_binding::kPermuteForwardSig);
FUSEDLAYERS_XLA_HANDLERS(moe_permute_backward, ::fusedlayers::xla_binding::permute_backward,
                         ::fusedlayers::xla_binding::kPermuteBackwardSig);
FUSEDLAYERS_XLA_HANDLERS(moe_unpermute_forward, ::fusedlayers::xla_binding::unpermute_forward,
                         ::fusedlayers::xla_binding::kUnpermuteForwardSig);
FUSEDLAYERS_XLA_HANDLERS(moe_unpermute_backward, ::fusedlayers::xla_binding::unpermute_backward,
                         ::fusedlayers::xla_binding::kUnpermuteBackwardSig);

// The forwards' argument checks for a trace (ffi_binding.h, TracedTensor): top_k_index given by its
// dims and whether it is int32 or int64 (csrc checks neither's values).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_moe_permute_check(
    const fusedlayers::xla_binding::TracedTensor* x, const int64_t* index_dims,
    int64_t index_ndim, int64_t num_experts, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    const IndexRef idx{nullptr, IndexType::kInt64, {index_dims, index_ndim}};
    const MoeShape s = moe_route_check("moe_permute", idx, num_experts);
    const int64_t pairs = s.pairs();
    moe_scatter_check("moe_permute",
                      {ref(x), idx, {nullptr, IndexType::kInt32, {&pairs, 1}}, num_experts});
  }, msg, msg_size);
}

FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_moe_unpermute_check(
    const fusedlayers::xla_binding::TracedTensor* ys, const int64_t* index_dims,
    int64_t index_ndim, const int64_t* row_dims, int64_t row_ndim,
    const fusedlayers::xla_binding::TracedTensor* weights, int64_t num_experts, char* msg,
    size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    moe_gather_check("moe_unpermute", {ref(ys), {nullptr, IndexType::kInt64, {index_dims,
                                                                              index_ndim}},
                                       {nullptr, IndexType::kInt32, {row_dims, row_ndim}},
                                       num_experts, ref(weights)});
  }, msg, msg_size);
}

// The permute's route workspace on CUDA (0 in a build without CUDA handlers: the CPU handler
// needs none).
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_moe_route_workspace_size(int64_t tokens,
                                                                       int64_t top_k,
                                                                       int64_t num_experts) {
#ifdef FUSEDLAYERS_WITH_CUDA
  fusedlayers::MoeShape s;
  s.tokens = tokens;
  s.top_k = top_k;
  s.num_experts = num_experts;
  try {
    return fusedlayers::moe_route_workspace_size_cuda(s);
  } catch (const fusedlayers::Error&) {
    return 0;
  }
#else
  (void)tokens, (void)top_k, (void)num_experts;
  return 0;
#endif
}
