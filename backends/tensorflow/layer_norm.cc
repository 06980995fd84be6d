// TensorFlow ops FusedlayersLayerNorm / FusedlayersLayerNormGrad on the csrc layer_norm kernels.
// The trailing `norm_ndims` dims of x are normalized; gamma/beta are always inputs, and count
// only when has_gamma/has_beta (TF ops have no optional inputs).
#include "backends/tensorflow/binding.h"
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

// Leading (unnormalized) dims of input 0, for mean and rstd.
absl::Status StatsShape(InferenceContext* c, ShapeHandle* out) {
  int norm_ndims;
  TF_RETURN_IF_ERROR(c->GetAttr("norm_ndims", &norm_ndims));
  ShapeHandle x = c->input(0);
  if (!c->RankKnown(x)) {
    *out = c->UnknownShape();
    return absl::OkStatus();
  }
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(x, norm_ndims, &x));
  return c->Subshape(x, 0, c->Rank(x) - norm_ndims, out);
}

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
    .Attr("subtract_mean: bool = true")
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
    .Attr("subtract_mean: bool = true")
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

// The attributes and checks both ops share.
class LayerNormBase : public OpKernel {
 public:
  explicit LayerNormBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm_ndims", &norm_ndims_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_gamma", &has_gamma_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_beta", &has_beta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("subtract_mean", &subtract_mean_));
  }

 protected:
  // Returns false (with the op failed) unless x, gamma, beta and the stats dtype agree.
  bool Check(OpKernelContext* ctx, const char* op, const Tensor& x, const Tensor& gamma,
             const Tensor& beta, ::tensorflow::DataType stat_dtype, int64_t* rows,
             int64_t* cols) {
    const int nd = x.dims();
    if (nd < norm_ndims_) {
      ctx->CtxFailure(absl::InvalidArgumentError(
          std::string("fusedlayers.") + op + ": x must have at least " +
          std::to_string(norm_ndims_) + " dims, got shape " + shape_str(x.shape())));
      return false;
    }
    TensorShape norm_shape;
    for (int d = nd - norm_ndims_; d < nd; ++d) norm_shape.AddDim(x.dim_size(d));
    *cols = norm_shape.num_elements();
    *rows = *cols == 0 ? 0 : x.NumElements() / *cols;
    for (const auto& [name, t, present] :
         {std::tuple{"gamma", &gamma, has_gamma_}, std::tuple{"beta", &beta, has_beta_}}) {
      if (present && t->shape() != norm_shape) {
        ctx->CtxFailure(absl::InvalidArgumentError(
            std::string("fusedlayers.") + op + ": " + name + " must have shape " +
            shape_str(norm_shape) + " (the normalized dims of x " + shape_str(x.shape()) +
            "), got " + shape_str(t->shape())));
        return false;
      }
    }
    const auto want = x.dtype() == ::tensorflow::DT_DOUBLE ? ::tensorflow::DT_DOUBLE
                                                           : ::tensorflow::DT_FLOAT;
    if (stat_dtype != want) {
      ctx->CtxFailure(absl::InvalidArgumentError(
          std::string("fusedlayers.") + op + ": mean/rstd dtype must be " +
          ::tensorflow::DataTypeString(want) + ", got " +
          ::tensorflow::DataTypeString(stat_dtype)));
      return false;
    }
    return true;
  }

  int norm_ndims_;
  bool has_gamma_, has_beta_, subtract_mean_;
};

template <bool kGpu>
class LayerNormOp : public LayerNormBase {
 public:
  explicit LayerNormOp(OpKernelConstruction* ctx) : LayerNormBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &stat_dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    const Tensor& beta = ctx->input(2);
    int64_t rows, cols;
    if (!Check(ctx, "layer_norm", x, gamma, beta, stat_dtype_, &rows, &cols)) return;
    TensorShape stat_shape;
    for (int d = 0; d < x.dims() - norm_ndims_; ++d) stat_shape.AddDim(x.dim_size(d));
    Tensor *y, *mean, *rstd;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, stat_shape, &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, stat_shape, &rstd));
    const void* g = has_gamma_ ? ptr(gamma) : nullptr;
    const void* b = has_beta_ ? ptr(beta) : nullptr;
    const DType dtype = to_dtype(x.dtype()), param_dtype = to_dtype(gamma.dtype());
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        layer_norm_forward_cuda(ptr(x), g, b, mutable_ptr(y), mutable_ptr(mean),
                                mutable_ptr(rstd), rows, cols, epsilon_, subtract_mean_, dtype,
                                param_dtype, gpu_stream(ctx));
      else
        layer_norm_forward_cpu(ptr(x), g, b, mutable_ptr(y), mutable_ptr(mean), mutable_ptr(rstd),
                               rows, cols, epsilon_, subtract_mean_, dtype, param_dtype,
                               tf_parallel_for(ctx));
    });
  }

 private:
  float epsilon_;
  ::tensorflow::DataType stat_dtype_;
};

template <bool kGpu>
class LayerNormGradOp : public LayerNormBase {
 public:
  using LayerNormBase::LayerNormBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& mean = ctx->input(2);
    const Tensor& rstd = ctx->input(3);
    const Tensor& gamma = ctx->input(4);
    const Tensor& beta = ctx->input(5);
    int64_t rows, cols;
    if (!Check(ctx, "layer_norm_grad", x, gamma, beta, rstd.dtype(), &rows, &cols)) return;
    OP_REQUIRES(ctx, dy.shape() == x.shape() && mean.NumElements() == rows &&
                         rstd.NumElements() == rows,
                absl::InvalidArgumentError(
                    "fusedlayers.layer_norm_grad: dy must have x's shape " +
                    shape_str(x.shape()) + " and mean/rstd " + std::to_string(rows) +
                    " elements, got " + shape_str(dy.shape()) + ", " +
                    shape_str(mean.shape()) + ", " + shape_str(rstd.shape())));
    Tensor *dx, *dgamma, *dbeta;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gamma.shape(), &dgamma));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, beta.shape(), &dbeta));
    const DType dtype = to_dtype(x.dtype()), param_dtype = to_dtype(gamma.dtype());
    call_csrc(ctx, [&] {
      Tensor workspace;
      if (has_gamma_ || has_beta_) {
        size_t bytes;
        if constexpr (kGpu)
          bytes = layer_norm_backward_workspace_size_cuda(rows, cols, dtype);
        else
          bytes = layer_norm_backward_workspace_size_cpu(rows, cols, dtype);
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                               TensorShape({static_cast<int64_t>(bytes)}),
                                               &workspace));
      }
      const void* g = has_gamma_ ? ptr(gamma) : nullptr;
      const void* b = has_beta_ ? ptr(beta) : nullptr;
      void* dg = has_gamma_ ? mutable_ptr(dgamma) : nullptr;
      void* db = has_beta_ ? mutable_ptr(dbeta) : nullptr;
      void* ws = workspace.NumElements() ? mutable_ptr(&workspace) : nullptr;
      if constexpr (kGpu)
        layer_norm_backward_cuda(ptr(dy), ptr(x), ptr(mean), ptr(rstd), g, b, mutable_ptr(dx), dg,
                                 db, ws, rows, cols, /*saved_is_output=*/false, subtract_mean_,
                                 dtype, param_dtype, gpu_stream(ctx));
      else
        layer_norm_backward_cpu(ptr(dy), ptr(x), ptr(mean), ptr(rstd), g, b, mutable_ptr(dx), dg,
                                db, ws, rows, cols, /*saved_is_output=*/false, subtract_mean_,
                                dtype, param_dtype, tf_parallel_for(ctx));
    });
  }
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLayerNorm", LayerNormOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLayerNormGrad", LayerNormGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
