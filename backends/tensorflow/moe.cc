// TensorFlow ops FusedlayersMoePermute / FusedlayersMoePermuteGrad and FusedlayersMoeUnpermute /
// FusedlayersMoeUnpermuteGrad on csrc/moe/moe.h, which checks every argument. top_k_index is int32
// or int64 (attribute I), row_index and offsets int32, top_k_weights float32 or x's dtype
// (attribute W); an absent top_k_weights (unpermute) or ys (its gradient: no dweights) is an
// empty tensor. CPU, GPU and XLA kernels (the custom calls of backends/xla/moe_ffi.cc). TF keeps
// the int32 tensors of GPU ops in host memory, so the GPU kernels take every index there (int64
// top_k_index too: one rule), route on the host and copy the indices their CUDA passes read to
// the device on the op's stream; under XLA (jit_compile) everything stays on the device.
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "moe/moe.h"

// backends/xla/moe_ffi.cc: the permute's CUDA route workspace.
extern "C" size_t fusedlayers_xla_moe_route_workspace_size(int64_t tokens, int64_t top_k,
                                                           int64_t num_experts);

namespace fusedlayers::tf_binding {
namespace {

constexpr char kTypeI[] = "I: {int32, int64}";
constexpr char kTypeW[] = "W: {float, double, half, bfloat16}";

// xs (tokens * top_k, hidden), row_index (tokens * top_k), offsets (num_experts).
absl::Status PermuteShape(InferenceContext* c) {
  ShapeHandle x, idx;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &idx));
  ::tensorflow::shape_inference::DimensionHandle pairs;
  TF_RETURN_IF_ERROR(c->Multiply(c->Dim(idx, 0), c->Dim(idx, 1), &pairs));
  int64_t num_experts;
  TF_RETURN_IF_ERROR(c->GetAttr("num_experts", &num_experts));
  c->set_output(0, c->Matrix(pairs, c->Dim(x, 1)));
  c->set_output(1, c->Vector(pairs));
  c->set_output(2, c->Vector(num_experts));
  return absl::OkStatus();
}

// (tokens, cols): tokens from top_k_index (input `index`), cols from input 0.
absl::Status TokensShape(InferenceContext* c) {
  ShapeHandle in, idx;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &in));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &idx));
  c->set_output(0, c->Matrix(c->Dim(idx, 0), c->Dim(in, 1)));
  return absl::OkStatus();
}

absl::Status UnpermuteGradShape(InferenceContext* c) {
  ShapeHandle dout, idx;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &dout));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &idx));
  ::tensorflow::shape_inference::DimensionHandle pairs;
  TF_RETURN_IF_ERROR(c->Multiply(c->Dim(idx, 0), c->Dim(idx, 1), &pairs));
  c->set_output(0, c->Matrix(pairs, c->Dim(dout, 1)));
  const int64_t ys = c->Value(c->NumElements(c->input(1)));
  c->set_output(1, ys == 0 ? c->Vector(0)
                   : ys == InferenceContext::kUnknownDim ? c->UnknownShape() : c->input(4));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersMoePermute")
    .Input("x: T").Input("top_k_index: I")
    .Output("xs: T").Output("row_index: int32").Output("offsets: int32")
    .Attr("num_experts: int").Attr(kTypeT).Attr(kTypeI).SetShapeFn(PermuteShape)
    .Doc("x's rows in expert order, each pair's row and each expert's end (csrc/moe/moe.h).");
REGISTER_OP("FusedlayersMoePermuteGrad")
    .Input("dxs: T").Input("top_k_index: I").Input("row_index: int32").Output("dx: T")
    .Attr("num_experts: int").Attr(kTypeT).Attr(kTypeI).SetShapeFn(TokensShape)
    .Doc("dx of FusedlayersMoePermute: the sum of each token's rows.");
REGISTER_OP("FusedlayersMoeUnpermute")
    .Input("ys: T").Input("top_k_index: I").Input("row_index: int32").Input("top_k_weights: W")
    .Output("out: T").Attr("num_experts: int").Attr(kTypeT).Attr(kTypeI).Attr(kTypeW)
    .SetShapeFn(TokensShape)
    .Doc("The weighted sum of each token's rows (csrc/moe/moe.h); empty top_k_weights: 1.");
REGISTER_OP("FusedlayersMoeUnpermuteGrad")
    .Input("dout: T").Input("ys: T").Input("top_k_index: I").Input("row_index: int32")
    .Input("top_k_weights: W").Output("dys: T").Output("dweights: W")
    .Attr("num_experts: int").Attr(kTypeT).Attr(kTypeI).Attr(kTypeW)
    .SetShapeFn(UnpermuteGradShape)
    .Doc("dys and (where ys is not empty) dweights of FusedlayersMoeUnpermute.");

// A csrc view of an integer tensor.
class IndexView {
 public:
  explicit IndexView(const Tensor& t) {
    for (int d = 0; d < t.dims(); ++d) dims_.push_back(t.dim_size(d));
    ref_ = {t.tensor_data().data(),
            t.dtype() == ::tensorflow::DT_INT32 ? IndexType::kInt32 : IndexType::kInt64,
            {dims_.data(), static_cast<int64_t>(dims_.size())}};
  }
  const IndexRef& operator*() const { return ref_; }

 private:
  absl::InlinedVector<int64_t, 2> dims_;
  IndexRef ref_;
};

// A GPU kernel's host index as its CUDA pass reads it: a device copy in `temp`.
template <bool kGpu>
bool index_on_device(OpKernelContext* ctx, Tensor* temp, IndexRef* index) {
#if GOOGLE_CUDA
  if constexpr (kGpu) {
    void* device = allocate_workspace(ctx, size_t(moe_index_bytes(*index)), temp);
    if (!device) return moe_index_bytes(*index) == 0;
    return call_csrc(ctx, [&] { *index = moe_index_to_device(*index, device, gpu_stream(ctx)); });
  }
#else
  (void)ctx, (void)temp, (void)index;
#endif
  return true;
}

class Base : public OpKernel {
 public:
  explicit Base(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_experts", &num_experts_));
  }

 protected:
  int64_t num_experts_ = 0;
};

// The route runs on the host (where TF keeps row_index and offsets of the GPU kernel too), the
// scatter on the kernel's device.
template <bool kGpu>
class PermuteOp : public Base {
 public:
  using Base::Base;
  void Compute(OpKernelContext* ctx) override {
    const char* op = "moe_permute";
    const Ref x(ctx->input(0));
    const IndexView idx(ctx->input(1));
    MoeShape rs;
    if (!call_csrc(ctx, [&] { rs = moe_route_check(op, *idx, num_experts_); })) return;
    Tensor *xs = nullptr, *row_index = nullptr, *offsets = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rs.pairs()}), &row_index));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({num_experts_}), &offsets));
    const IndexView rows(*row_index);
    MoeScatter scatter{*x, *idx, *rows, num_experts_};
    MoeShape s;
    if (!call_csrc(ctx, [&] { s = moe_scatter_check(op, scatter); })) return;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s.pairs(), s.hidden}), &xs));
    scatter.out = mutable_ptr(xs);
    MoeRoute route{*idx, num_experts_, static_cast<int32_t*>(mutable_ptr(row_index)),
                   static_cast<int32_t*>(mutable_ptr(offsets))};
    if (!call_csrc(ctx, [&] { moe_route(route, s, exec_for<false>(ctx)); })) return;
    Tensor idx_temp, rows_temp;
    if (!index_on_device<kGpu>(ctx, &idx_temp, &scatter.top_k_index) ||
        !index_on_device<kGpu>(ctx, &rows_temp, &scatter.row_index))
      return;
    call_csrc(ctx, [&] { moe_scatter(scatter, s, exec_for<kGpu>(ctx)); });
  }
};

// The gathers: the permute's gradient (no weights) and the unpermute.
template <bool kUnpermute, bool kGpu>
class GatherOp : public Base {
 public:
  using Base::Base;
  void Compute(OpKernelContext* ctx) override {
    const char* op = kUnpermute ? "moe_unpermute" : "moe_permute_backward";
    const Ref in(ctx->input(0));
    const IndexView idx(ctx->input(1)), rows(ctx->input(2));
    const bool weighted = kUnpermute && ctx->input(3).NumElements() > 0;
    const Ref w(kUnpermute ? ctx->input(3) : ctx->input(0), weighted);
    MoeGather a{*in, *idx, *rows, num_experts_, *w};
    MoeShape s;
    if (!call_csrc(ctx, [&] { s = moe_gather_check(op, a); })) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s.tokens, s.hidden}), &out));
    a.out = mutable_ptr(out);
    Tensor idx_temp, rows_temp;
    if (!index_on_device<kGpu>(ctx, &idx_temp, &a.top_k_index) ||
        !index_on_device<kGpu>(ctx, &rows_temp, &a.row_index))
      return;
    call_csrc(ctx, [&] { moe_gather(a, s, exec_for<kGpu>(ctx)); });
  }
};
template <bool kGpu>
using PermuteGradOp = GatherOp<false, kGpu>;
template <bool kGpu>
using UnpermuteOp = GatherOp<true, kGpu>;

template <bool kGpu>
class UnpermuteGradOp : public Base {
 public:
  using Base::Base;
  void Compute(OpKernelContext* ctx) override {
    const char* op = "moe_unpermute_backward";
    const Tensor& weights = ctx->input(4);
    const bool dots = ctx->input(1).NumElements() > 0, weighted = weights.NumElements() > 0;
    const Ref dout(ctx->input(0)), ys(ctx->input(1), dots), w(weights, weighted);
    const IndexView idx(ctx->input(2)), rows(ctx->input(3));
    MoeScatter a{*dout, *idx, *rows, num_experts_, *w, *ys};
    MoeShape s;
    if (!call_csrc(ctx, [&] { s = moe_scatter_check(op, a); })) return;
    Tensor *dys = nullptr, *dweights = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s.pairs(), s.hidden}), &dys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, dots ? weights.shape() : TensorShape({0}),
                                             &dweights));
    a.out = mutable_ptr(dys);
    a.dweights = dots ? mutable_ptr(dweights) : nullptr;
    Tensor idx_temp, rows_temp;
    if (!index_on_device<kGpu>(ctx, &idx_temp, &a.top_k_index) ||
        !index_on_device<kGpu>(ctx, &rows_temp, &a.row_index))
      return;
    call_csrc(ctx, [&] { moe_scatter(a, s, exec_for<kGpu>(ctx)); });
  }
};

int64_t num_experts_attr(OpKernelConstruction* ctx) {
  int64_t num_experts = 0;
  if (!ctx->GetAttr("num_experts", &num_experts).ok())
    ctx->CtxFailure(absl::InvalidArgumentError("fusedlayers.moe: missing num_experts"));
  return num_experts;
}

XlaAttributes experts_attribute(OpKernelConstruction* ctx) {
  return XlaAttributes().i64("num_experts", num_experts_attr(ctx));
}

// Under XLA: the custom calls of backends/xla/moe_ffi.cc.
class PermuteXla : public XlaCustomCallOp {
 public:
  explicit PermuteXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_moe_permute_forward", experts_attribute(ctx),
                        [experts = num_experts_attr(ctx)](::tensorflow::XlaOpKernelContext* c,
                                                          bool gpu) {
                          const auto x = c->InputShape(0).dim_sizes();
                          const auto idx = c->InputShape(1).dim_sizes();
                          const int64_t pairs = idx[0] * idx[1];
                          const size_t ws = gpu ? fusedlayers_xla_moe_route_workspace_size(
                                                      idx[0], idx[1], experts)
                                                : 0;
                          return std::vector<xla::Shape>{
                              xla::ShapeUtil::MakeShape(c->input_xla_type(0), {pairs, x[1]}),
                              xla::ShapeUtil::MakeShape(xla::S32, {pairs}),
                              xla::ShapeUtil::MakeShape(xla::S32, {experts}),
                              xla::ShapeUtil::MakeShape(xla::U8, {int64_t(ws)})};
                        },
                        3) {}
};

// A gather's one result: (tokens, hidden) in input 0's type.
template <bool kUnpermute>
class GatherXla : public XlaCustomCallOp {
 public:
  explicit GatherXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx,
                        kUnpermute ? "fusedlayers_moe_unpermute_forward"
                                   : "fusedlayers_moe_permute_backward",
                        experts_attribute(ctx),
                        [](::tensorflow::XlaOpKernelContext* c, bool) {
                          const auto in = c->InputShape(0).dim_sizes();
                          const auto idx = c->InputShape(1).dim_sizes();
                          return std::vector<xla::Shape>{
                              xla::ShapeUtil::MakeShape(c->input_xla_type(0), {idx[0], in[1]})};
                        },
                        1) {}
};

class UnpermuteGradXla : public XlaCustomCallOp {
 public:
  explicit UnpermuteGradXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_moe_unpermute_backward", experts_attribute(ctx),
                        [](::tensorflow::XlaOpKernelContext* c, bool) {
                          const auto dout = c->InputShape(0).dim_sizes();
                          const auto idx = c->InputShape(2).dim_sizes();
                          const bool dots = c->InputShape(1).num_elements() > 0;
                          return std::vector<xla::Shape>{
                              xla::ShapeUtil::MakeShape(c->input_xla_type(0),
                                                        {idx[0] * idx[1], dout[1]}),
                              dots ? input_shape(c, 4)
                                   : xla::ShapeUtil::MakeShape(c->input_xla_type(4), {0})};
                        },
                        2) {}
};

REGISTER_KERNEL_BUILDER(Name("FusedlayersMoePermute").Device(::tensorflow::DEVICE_CPU),
                        PermuteOp<false>);
REGISTER_KERNEL_BUILDER(Name("FusedlayersMoePermuteGrad").Device(::tensorflow::DEVICE_CPU),
                        PermuteGradOp<false>);
REGISTER_KERNEL_BUILDER(Name("FusedlayersMoeUnpermute").Device(::tensorflow::DEVICE_CPU),
                        UnpermuteOp<false>);
REGISTER_KERNEL_BUILDER(Name("FusedlayersMoeUnpermuteGrad").Device(::tensorflow::DEVICE_CPU),
                        UnpermuteGradOp<false>);
#if GOOGLE_CUDA
// float64 stays on the CPU kernels (csrc's CUDA passes take float32, float16, bfloat16).
#define FUSEDLAYERS_MOE_GPU(T)                                                                  \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersMoePermute").Device(::tensorflow::DEVICE_GPU)       \
                              .TypeConstraint<T>("T").HostMemory("top_k_index")                \
                              .HostMemory("row_index").HostMemory("offsets"),                  \
                          PermuteOp<true>);                                                     \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersMoePermuteGrad").Device(::tensorflow::DEVICE_GPU)   \
                              .TypeConstraint<T>("T").HostMemory("top_k_index")                \
                              .HostMemory("row_index"),                                        \
                          PermuteGradOp<true>);                                                 \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersMoeUnpermute").Device(::tensorflow::DEVICE_GPU)     \
                              .TypeConstraint<T>("T").HostMemory("top_k_index")                \
                              .HostMemory("row_index"),                                        \
                          UnpermuteOp<true>);                                                   \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersMoeUnpermuteGrad").Device(::tensorflow::DEVICE_GPU) \
                              .TypeConstraint<T>("T").HostMemory("top_k_index")                \
                              .HostMemory("row_index"),                                        \
                          UnpermuteGradOp<true>)
FUSEDLAYERS_MOE_GPU(float);
FUSEDLAYERS_MOE_GPU(Eigen::half);
FUSEDLAYERS_MOE_GPU(::tensorflow::bfloat16);
#undef FUSEDLAYERS_MOE_GPU
#endif
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersMoePermute", PermuteXla);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersMoePermuteGrad", GatherXla<false>);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersMoeUnpermute", GatherXla<true>);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersMoeUnpermuteGrad", UnpermuteGradXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
