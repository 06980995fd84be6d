// TensorFlow ops FusedlayersReluScale / FusedlayersReluScaleGrad on the csrc relu_scale kernels.
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "activation/relu_scale.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace fusedlayers::tf_binding {
namespace {

// y like x; mask: relu_scale_mask_words(x's elements) words.
absl::Status ReluScaleShape(InferenceContext* c) {
  c->set_output(0, c->input(0));
  const int64_t n = c->Value(c->NumElements(c->input(0)));
  c->set_output(1, c->Vector(n == InferenceContext::kUnknownDim ? InferenceContext::kUnknownDim
                                                                : relu_scale_mask_words(n)));
  return absl::OkStatus();
}

// mask: the packed bits where x is not <= 0, kept for the gradient instead of x (layout in
// csrc/activation/relu_scale.h); uint32 as in the torch binding (TF keeps int32 tensors of GPU kernels in
// host memory).
REGISTER_OP("FusedlayersReluScale")
    .Input("x: T").Output("y: T").Output("mask: uint32").Attr("alpha: float").Attr(kTypeT)
    .SetShapeFn(ReluScaleShape)
    .Doc("y = max(x, 0) * alpha (NaN propagates); mask = packed bits of x > 0 or NaN.");

REGISTER_OP("FusedlayersReluScaleGrad")
    .Input("dy: T").Input("mask: uint32").Output("dx: T").Attr("alpha: float").Attr(kTypeT)
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("dx = dy * alpha where mask is set, else 0.");

template <bool kGpu>
class ReluScaleOp : public OpKernel {
 public:
  explicit ReluScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x);
    ReluScaleForward a{*xr, alpha_};
    if (!call_csrc(ctx, [&] { relu_scale_forward_check(a); })) return;
    Tensor* y = nullptr;
    Tensor* mask = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({relu_scale_mask_words(x.NumElements())}), &mask));
    a.y = mutable_ptr(y);
    a.mask = mask->flat<uint32_t>().data();
    call_csrc(ctx, [&] { relu_scale_forward(a, exec_for<kGpu>(ctx)); });
  }

 private:
  float alpha_;
};

template <bool kGpu>
class ReluScaleGradOp : public OpKernel {
 public:
  explicit ReluScaleGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& mask = ctx->input(1);
    const Ref dyr(dy);
    const auto mask_dims = mask.shape().dim_sizes();
    ReluScaleBackward a{*dyr, mask.flat<uint32_t>().data(),
                        {mask_dims.data(), static_cast<int64_t>(mask_dims.size())}, alpha_};
    if (!call_csrc(ctx, [&] { relu_scale_backward_check(a); })) return;
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, dy.shape(), &dx));
    a.dx = mutable_ptr(dx);
    call_csrc(ctx, [&] { relu_scale_backward(a, exec_for<kGpu>(ctx)); });
  }

 private:
  float alpha_;
};

// Under XLA: the custom calls fusedlayers_relu_scale_{forward,backward} (backends/xla).
float alpha_of(OpKernelConstruction* ctx) {
  float alpha = 0;
  if (const auto status = ctx->GetAttr("alpha", &alpha); !status.ok()) ctx->CtxFailure(status);
  return alpha;
}

class ReluScaleXla : public XlaCustomCallOp {
 public:
  explicit ReluScaleXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_relu_scale_forward",
                        XlaAttributes().f32("alpha", alpha_of(ctx)).boolean("with_mask", true),
                        [](::tensorflow::XlaOpKernelContext* c, bool) {
                          const int64_t n = c->InputShape(0).num_elements();
                          return std::vector<xla::Shape>{
                              input_shape(c, 0),
                              xla::ShapeUtil::MakeShape(xla::U32, {relu_scale_mask_words(n)})};
                        },
                        2) {}
};

class ReluScaleGradXla : public XlaCustomCallOp {
 public:
  explicit ReluScaleGradXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_relu_scale_backward",
                        XlaAttributes().f32("alpha", alpha_of(ctx)),
                        [](::tensorflow::XlaOpKernelContext* c, bool) {
                          return std::vector<xla::Shape>{input_shape(c, 0)};
                        },
                        1) {}
};

FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersReluScale", ReluScaleOp, ReluScaleGradOp, ReluScaleXla,
                                 ReluScaleGradXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
