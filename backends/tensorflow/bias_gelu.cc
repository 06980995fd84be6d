// TensorFlow ops FusedlayersBiasGelu / FusedlayersBiasGeluGrad on the csrc bias+GELU epilogue.
// The GEMM before it is TF's own matmul (fusedlayers/tensorflow/linear_gelu.py).
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
    approx_ = approximate == "tanh" ? GeluApprox::kTanh : GeluApprox::kNone;  // TF checked it
  }

 protected:
  bool has_bias_;
  GeluApprox approx_;
};

template <bool kGpu>
class BiasGeluOp : public BiasGeluBase {
 public:
  using BiasGeluBase::BiasGeluBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& h = ctx->input(0);
    const Ref hr(h), br(ctx->input(1), has_bias_);
    BiasGeluForward a{*hr, *br, approx_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = bias_gelu_forward_check("linear_gelu", a); })) return;
    Tensor *pre, *y;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, h.shape(), &pre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, h.shape(), &y));
    a.pre = mutable_ptr(pre);
    a.out = mutable_ptr(y);
    call_csrc(ctx, [&] { bias_gelu_forward(a, rc, exec_for<kGpu>(ctx)); });
  }
};

template <bool kGpu>
class BiasGeluGradOp : public BiasGeluBase {
 public:
  using BiasGeluBase::BiasGeluBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pre = ctx->input(1);
    const Ref dyr(ctx->input(0)), prer(pre);
    BiasGeluBackward a{*dyr, *prer, has_bias_, approx_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = bias_gelu_backward_check("linear_gelu_grad", a); })) return;
    Tensor *dpre, *dbias, workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, pre.shape(), &dpre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({has_bias_ ? rc.cols : 0}), &dbias));
    const Exec exec = exec_for<kGpu>(ctx);
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] { bytes = bias_gelu_backward_workspace_size(a, rc, exec); })) return;
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.grad_pre = mutable_ptr(dpre);
    a.grad_bias = mutable_ptr(dbias);
    call_csrc(ctx, [&] { bias_gelu_backward(a, rc, exec); });
  }
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersBiasGelu", BiasGeluOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersBiasGeluGrad", BiasGeluGradOp, "T");

}  // namespace
}  // namespace tf_binding
}  // namespace fusedlayers
