// TensorFlow ops FusedlayersBiasGelu / FusedlayersBiasGeluGrad on the csrc bias+GELU epilogue.
// The GEMM before it is TF's own matmul (fusedlayers/tensorflow/ops.py).
#include "backends/tensorflow/binding.h"
#include "csrc/bias_gelu.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace fusedlayers {
namespace tf_binding {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("FusedlayersBiasGelu")
    .Input("h: T")
    .Input("bias: T")
    .Output("pre: T")
    .Output("y: T")
    .Attr("has_bias: bool")
    .Attr("approximate: {'none', 'tanh'} = 'none'")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return absl::OkStatus();
    })
    .Doc("pre = h + bias (over the last dim), y = gelu(pre).");

REGISTER_OP("FusedlayersBiasGeluGrad")
    .Input("dy: T")
    .Input("pre: T")
    .Output("dpre: T")
    .Output("dbias: T")
    .Attr("has_bias: bool")
    .Attr("approximate: {'none', 'tanh'} = 'none'")
    .Attr("T: {float, double, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("dpre = dy * gelu'(pre), dbias = sum of dpre over all but the last dim.");

class BiasGeluBase : public OpKernel {
 public:
  explicit BiasGeluBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string approximate;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("approximate", &approximate));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias_));
    approx_ = approximate == "tanh" ? GeluApprox::kTanh : GeluApprox::kNone;
  }

 protected:
  // Returns false (with the op failed) unless t is at least 1-D.
  bool RowsCols(OpKernelContext* ctx, const char* op, const Tensor& t, int64_t* rows,
                int64_t* cols) {
    if (t.dims() < 1) {
      ctx->CtxFailure(absl::InvalidArgumentError(std::string("fusedlayers.") + op +
                                                 ": input must be at least 1-D, got shape " +
                                                 shape_str(t.shape())));
      return false;
    }
    *cols = t.dim_size(t.dims() - 1);
    *rows = 1;
    for (int d = 0; d < t.dims() - 1; ++d) *rows *= t.dim_size(d);
    return true;
  }

  bool has_bias_;
  GeluApprox approx_;
};

template <bool kGpu>
class BiasGeluOp : public BiasGeluBase {
 public:
  using BiasGeluBase::BiasGeluBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& h = ctx->input(0);
    const Tensor& bias = ctx->input(1);
    int64_t rows, cols;
    if (!RowsCols(ctx, "linear_gelu", h, &rows, &cols)) return;
    OP_REQUIRES(ctx, !has_bias_ || (bias.dims() == 1 && bias.dim_size(0) == cols),
                absl::InvalidArgumentError("fusedlayers.linear_gelu: bias must have shape [" +
                                           std::to_string(cols) + "] (units), got " +
                                           shape_str(bias.shape())));
    Tensor *pre, *y;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, h.shape(), &pre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, h.shape(), &y));
    const void* b = has_bias_ ? ptr(bias) : nullptr;
    call_csrc(ctx, [&] {
      if constexpr (kGpu)
        bias_gelu_forward_cuda(ptr(h), b, mutable_ptr(pre), mutable_ptr(y), rows, cols, approx_,
                               to_dtype(h.dtype()), gpu_stream(ctx));
      else
        bias_gelu_forward_cpu(ptr(h), b, mutable_ptr(pre), mutable_ptr(y), rows, cols, approx_,
                              to_dtype(h.dtype()), tf_parallel_for(ctx));
    });
  }
};

template <bool kGpu>
class BiasGeluGradOp : public BiasGeluBase {
 public:
  using BiasGeluBase::BiasGeluBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& pre = ctx->input(1);
    int64_t rows, cols;
    if (!RowsCols(ctx, "linear_gelu_grad", pre, &rows, &cols)) return;
    OP_REQUIRES(ctx, dy.shape() == pre.shape(),
                absl::InvalidArgumentError("fusedlayers.linear_gelu_grad: dy must have pre's "
                                           "shape " + shape_str(pre.shape()) + ", got " +
                                           shape_str(dy.shape())));
    Tensor *dpre, *dbias;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, pre.shape(), &dpre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({has_bias_ ? cols : 0}), &dbias));
    const DType dtype = to_dtype(pre.dtype());
    call_csrc(ctx, [&] {
      Tensor workspace;
      if (has_bias_) {
        size_t bytes;
        if constexpr (kGpu)
          bytes = bias_gelu_backward_workspace_size_cuda(rows, cols, dtype);
        else
          bytes = bias_gelu_backward_workspace_size_cpu(rows, cols, dtype);
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                               TensorShape({static_cast<int64_t>(bytes)}),
                                               &workspace));
      }
      void* db = has_bias_ ? mutable_ptr(dbias) : nullptr;
      void* ws = workspace.NumElements() ? mutable_ptr(&workspace) : nullptr;
      if constexpr (kGpu)
        bias_gelu_backward_cuda(ptr(dy), ptr(pre), mutable_ptr(dpre), db, ws, rows, cols, approx_,
                                dtype, gpu_stream(ctx));
      else
        bias_gelu_backward_cpu(ptr(dy), ptr(pre), mutable_ptr(dpre), db, ws, rows, cols, approx_,
                               dtype, tf_parallel_for(ctx));
    });
  }
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersBiasGelu", BiasGeluOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersBiasGeluGrad", BiasGeluGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
