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
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;

// mask: the packed bits where x is not <= 0, kept for the gradient instead of x (layout in
// csrc/relu_scale.h). uint32, not int32: TF keeps int32 tensors of GPU kernels in host memory.
REGISTER_OP("FusedlayersReluScale")
    .Input("x: T")
    .Output("y: T")
    .Output("mask: uint32")
    .Attr("alpha: float")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      const int64_t n = c->Value(c->NumElements(c->input(0)));
      c->set_output(1, c->Vector(n == InferenceContext::kUnknownDim
                                     ? InferenceContext::kUnknownDim
                                     : relu_scale_mask_words(n)));
      return absl::OkStatus();
    })
    .Doc("y = max(x, 0) * alpha (NaN propagates); mask = packed bits of x > 0 or NaN.");

REGISTER_OP("FusedlayersReluScaleGrad")
    .Input("dy: T")
    .Input("mask: uint32")
    .Output("dx: T")
    .Attr("alpha: float")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("dx = dy * alpha where mask is set, else 0.");

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
    Tensor* mask = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({relu_scale_mask_words(x.NumElements())}), &mask));
    uint32_t* mask_ptr = mask->flat<uint32_t>().data();
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        relu_scale_forward_cuda(ptr(x), mutable_ptr(y), mask_ptr, x.NumElements(), alpha_,
                                to_dtype(x.dtype()), gpu_stream(ctx));
      else
        relu_scale_forward_cpu(ptr(x), mutable_ptr(y), mask_ptr, x.NumElements(), alpha_,
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
    const Tensor& mask = ctx->input(1);
    const TensorShape mask_shape({relu_scale_mask_words(dy.NumElements())});
    OP_REQUIRES(ctx, mask.shape() == mask_shape,
                absl::InvalidArgumentError(
                    "fusedlayers.relu_scale_grad: mask must have shape " + shape_str(mask_shape) +
                    " for dy of " + std::to_string(dy.NumElements()) + " elements, got " +
                    shape_str(mask.shape())));
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, dy.shape(), &dx));
    const uint32_t* mask_ptr = mask.flat<uint32_t>().data();
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        relu_scale_backward_cuda(ptr(dy), mask_ptr, mutable_ptr(dx), dy.NumElements(), alpha_,
                                 to_dtype(dy.dtype()), gpu_stream(ctx));
      else
        relu_scale_backward_cpu(ptr(dy), mask_ptr, mutable_ptr(dx), dy.NumElements(), alpha_,
                                to_dtype(dy.dtype()), tf_parallel_for(ctx));
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
