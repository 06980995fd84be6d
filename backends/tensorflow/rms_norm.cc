// TensorFlow ops FusedlayersRmsNorm / FusedlayersRmsNormGrad on csrc/rms_norm.h, which checks
// every argument. The trailing `norm_ndims` dims of x are normalized; weight is always an input
// and counts only when has_weight (TF ops have no optional inputs).
#include "backends/tensorflow/norm.h"
#include "csrc/rms_norm.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace fusedlayers {
namespace tf_binding {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("FusedlayersRmsNorm")
    .Input("x: T")
    .Input("weight: P")
    .Output("y: T")
    .Output("rstd: U")
    .Attr("norm_ndims: int >= 1")
    .Attr("epsilon: float")
    .Attr("has_weight: bool")
    .Attr("zero_centered: bool = false")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("P: {float, double, half, bfloat16}")
    .Attr("U: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle stats;
      TF_RETURN_IF_ERROR(StatsShape(c, &stats));
      c->set_output(0, c->input(0));
      c->set_output(1, stats);
      return absl::OkStatus();
    })
    .Doc("RMSNorm over the trailing norm_ndims dims; rstd in U (see csrc/rms_norm.h).");

REGISTER_OP("FusedlayersRmsNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("rstd: U")
    .Input("weight: P")
    .Output("dx: T")
    .Output("dweight: P")
    .Attr("norm_ndims: int >= 1")
    .Attr("has_weight: bool")
    .Attr("zero_centered: bool = false")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("P: {float, double, half, bfloat16}")
    .Attr("U: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(3));
      return absl::OkStatus();
    })
    .Doc("dx, dweight of FusedlayersRmsNorm (dweight empty when absent).");

template <bool kGpu>
class RmsNormOp : public OpKernel {
 public:
  explicit RmsNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm_ndims", &norm_ndims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_weight", &has_weight_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("zero_centered", &zero_centered_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &stat_dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x), w(ctx->input(1), has_weight_);
    RmsNormForward a{*xr, {}, *w, epsilon_, zero_centered_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] {
          a.normalized_shape = trailing_dims("rms_norm", a.input, norm_ndims_);
          rc = rms_norm_forward_check(a);
        }))
      return;
    OP_REQUIRES_OK(ctx, check_stat_dtype("rms_norm", stat_dtype_, a.input.dtype));
    const TensorShape stat_shape = stats_shape(x, norm_ndims_);
    Tensor *y, *rstd;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, stat_shape, &rstd));
    a.out = mutable_ptr(y);
    a.rstd = mutable_ptr(rstd);
    call_csrc(ctx, [&] { rms_norm_forward(a, rc, exec_for<kGpu>(ctx)); });
  }

 private:
  int norm_ndims_;
  bool has_weight_, zero_centered_;
  float epsilon_;
  ::tensorflow::DataType stat_dtype_;
};

template <bool kGpu>
class RmsNormGradOp : public OpKernel {
 public:
  explicit RmsNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm_ndims", &norm_ndims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_weight", &has_weight_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("zero_centered", &zero_centered_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(1);
    const Tensor& weight = ctx->input(3);
    const Ref dy(ctx->input(0)), xr(x), rstd(ctx->input(2)), w(weight, has_weight_);
    RmsNormBackward a{*dy, *xr, *rstd, {}, *w, zero_centered_};
    const Exec exec = exec_for<kGpu>(ctx);
    RowsCols rc;
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] {
          a.normalized_shape = trailing_dims("rms_norm_backward", a.input, norm_ndims_);
          rc = rms_norm_backward_check(a);
          bytes = rms_norm_backward_workspace_size(a, rc, exec);
        }))
      return;
    Tensor *dx, *dweight, workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, weight.shape(), &dweight));
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.grad_input = mutable_ptr(dx);
    a.grad_weight = mutable_ptr(dweight);
    call_csrc(ctx, [&] { rms_norm_backward(a, rc, exec); });
  }

 private:
  int norm_ndims_;
  bool has_weight_, zero_centered_;
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersRmsNorm", RmsNormOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersRmsNormGrad", RmsNormGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
