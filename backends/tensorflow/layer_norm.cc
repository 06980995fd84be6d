// TensorFlow ops FusedlayersLayerNorm / FusedlayersLayerNormGrad on the csrc layer_norm kernels.
// The trailing `norm_ndims` dims of x are normalized; gamma/beta are always inputs, and count
// only when has_gamma/has_beta (TF ops have no optional inputs).
#include "backends/tensorflow/norm.h"
#include "csrc/layer_norm.h"
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

REGISTER_OP("FusedlayersLayerNorm")
    .Input("x: T")
    .Input("gamma: P")
    .Input("beta: P")
    .Output("y: T")
    .Output("mean: U")
    .Output("rstd: U")
    .Attr("norm_ndims: int >= 1")
    .Attr("epsilon: float")
    .Attr("has_gamma: bool")
    .Attr("has_beta: bool")
    .Attr("rms_scaling: bool = false")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("P: {float, double, half, bfloat16}")
    .Attr("U: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle stats;
      TF_RETURN_IF_ERROR(StatsShape(c, &stats));
      c->set_output(0, c->input(0));
      c->set_output(1, stats);
      c->set_output(2, stats);
      return absl::OkStatus();
    })
    .Doc("Layer norm over the trailing norm_ndims dims; mean/rstd in U (see csrc/layer_norm.h).");

REGISTER_OP("FusedlayersLayerNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("mean: U")
    .Input("rstd: U")
    .Input("gamma: P")
    .Input("beta: P")
    .Output("dx: T")
    .Output("dgamma: P")
    .Output("dbeta: P")
    .Attr("norm_ndims: int >= 1")
    .Attr("has_gamma: bool")
    .Attr("has_beta: bool")
    .Attr("rms_scaling: bool = false")
    .Attr("T: {float, double, half, bfloat16}")
    .Attr("P: {float, double, half, bfloat16}")
    .Attr("U: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(4));
      c->set_output(2, c->input(5));
      return absl::OkStatus();
    })
    .Doc("dx, dgamma, dbeta of FusedlayersLayerNorm (dgamma/dbeta empty when absent).");

// Kernel<kGpu> of both ops: tensor conversion around csrc/layer_norm.h, which checks every
// argument (normalized_shape is the trailing norm_ndims dims of x).
template <bool kGpu>
class LayerNormOp : public OpKernel {
 public:
  explicit LayerNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm_ndims", &norm_ndims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_gamma", &has_gamma_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_beta", &has_beta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rms_scaling", &rms_scaling_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &stat_dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x), gamma(ctx->input(1), has_gamma_), beta(ctx->input(2), has_beta_);
    LayerNormForward a{*xr, {}, *gamma, *beta, epsilon_, rms_scaling_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] {
          a.normalized_shape = trailing_dims("layer_norm", a.input, norm_ndims_);
          rc = layer_norm_forward_check(a);
        }))
      return;
    OP_REQUIRES_OK(ctx, check_stat_dtype("layer_norm", stat_dtype_, a.input.dtype));
    const TensorShape stat_shape = stats_shape(x, norm_ndims_);
    Tensor *y, *mean, *rstd;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, stat_shape, &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, stat_shape, &rstd));
    a.out = mutable_ptr(y);
    a.mean = mutable_ptr(mean);
    a.rstd = mutable_ptr(rstd);
    call_csrc(ctx, [&] { layer_norm_forward(a, rc, exec_for<kGpu>(ctx)); });
  }

 private:
  int norm_ndims_;
  bool has_gamma_, has_beta_, rms_scaling_;
  float epsilon_;
  ::tensorflow::DataType stat_dtype_;
};

template <bool kGpu>
class LayerNormGradOp : public OpKernel {
 public:
  explicit LayerNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm_ndims", &norm_ndims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_gamma", &has_gamma_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_beta", &has_beta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rms_scaling", &rms_scaling_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(1);
    const Tensor& gamma = ctx->input(4);
    const Tensor& beta = ctx->input(5);
    const Ref dy(ctx->input(0)), xr(x), mean(ctx->input(2)), rstd(ctx->input(3));
    const Ref g(gamma, has_gamma_), b(beta, has_beta_);
    LayerNormBackward a{*dy, *xr, *mean, *rstd, {}, *g, *b, false, rms_scaling_};
    const Exec exec = exec_for<kGpu>(ctx);
    RowsCols rc;
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] {
          a.normalized_shape = trailing_dims("layer_norm_backward", a.saved, norm_ndims_);
          rc = layer_norm_backward_check(a);
          bytes = layer_norm_backward_workspace_size(a, rc, exec);
        }))
      return;
    Tensor *dx, *dgamma, *dbeta, workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gamma.shape(), &dgamma));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, beta.shape(), &dbeta));
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.grad_input = mutable_ptr(dx);
    a.grad_weight = mutable_ptr(dgamma);
    a.grad_bias = mutable_ptr(dbeta);
    call_csrc(ctx, [&] { layer_norm_backward(a, rc, exec); });
  }

 private:
  int norm_ndims_;
  bool has_gamma_, has_beta_, rms_scaling_;
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLayerNorm", LayerNormOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLayerNormGrad", LayerNormGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
