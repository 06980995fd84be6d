// TensorFlow ops FusedlayersReluScale / FusedlayersReluScaleGrad on the csrc relu_scale kernels.
#include "backends/tensorflow/binding.h"
#include "csrc/relu_scale.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"

namespace fusedlayers {
namespace tf_binding {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;

REGISTER_OP("FusedlayersReluScale")
    .Input("x: T")
    .Output("y: T")
    .Attr("alpha: float")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("y = max(x, 0) * alpha (NaN propagates).");

REGISTER_OP("FusedlayersReluScaleGrad")
    .Input("dy: T")
    .Input("x: T")
    .Output("dx: T")
    .Attr("alpha: float")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("dx = dy * alpha where x is not <= 0, else 0.");

template <bool kGpu>
class ReluScaleOp : public OpKernel {
 public:
  explicit ReluScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("alpha", &alpha_));
    OP_REQUIRES(ctx, std::isfinite(alpha_),
                absl::InvalidArgumentError("fusedlayers.relu_scale: alpha must be finite, got " +
                                           std::to_string(alpha_)));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        relu_scale_forward_cuda(ptr(x), mutable_ptr(y), x.NumElements(), alpha_,
                                to_dtype(x.dtype()), gpu_stream(ctx));
      else
        relu_scale_forward_cpu(ptr(x), mutable_ptr(y), x.NumElements(), alpha_,
                               to_dtype(x.dtype()), tf_parallel_for(ctx));
    });
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
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                absl::InvalidArgumentError("fusedlayers.relu_scale_grad: dy must have x's shape " +
                                           shape_str(x.shape()) + ", got " +
                                           shape_str(dy.shape())));
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        relu_scale_backward_cuda(ptr(dy), ptr(x), mutable_ptr(dx), x.NumElements(), alpha_,
                                 to_dtype(x.dtype()), gpu_stream(ctx));
      else
        relu_scale_backward_cpu(ptr(dy), ptr(x), mutable_ptr(dx), x.NumElements(), alpha_,
                                to_dtype(x.dtype()), tf_parallel_for(ctx));
    });
  }

 private:
  float alpha_;
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersReluScale", ReluScaleOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersReluScaleGrad", ReluScaleGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
