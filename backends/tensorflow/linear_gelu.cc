// TensorFlow ops FusedlayersLinearGeluEpilogue / FusedlayersLinearGeluEpilogueGrad: linear_gelu's
// bias + GELU epilogue (csrc/linear_gelu_epilogue.h). The GEMMs around it are TF's own matmul
// (fusedlayers/tensorflow/linear_gelu.py).
#include "backends/tensorflow/binding.h"
#include "csrc/linear_gelu_epilogue.h"

namespace fusedlayers::tf_binding {
namespace {

constexpr char kApproximate[] = "approximate: {'none', 'tanh'} = 'none'";

// pre and y like h; dpre like pre, dbias (out_features,) or empty.
absl::Status EpilogueShape(InferenceContext* c) {
  c->set_output(0, c->input(0));
  c->set_output(1, c->input(0));
  return absl::OkStatus();
}
absl::Status EpilogueGradShape(InferenceContext* c) {
  c->set_output(0, c->input(1));
  c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersLinearGeluEpilogue")
    .Input("h: T").Input("bias: T").Output("pre: T").Output("y: T")
    .Attr("has_bias: bool").Attr(kApproximate).Attr(kTypeT)
    .SetShapeFn(EpilogueShape)
    .Doc("pre = h + bias (over the last dim), y = gelu(pre).");

REGISTER_OP("FusedlayersLinearGeluEpilogueGrad")
    .Input("dy: T").Input("pre: T").Output("dpre: T").Output("dbias: T")
    .Attr("has_bias: bool").Attr(kApproximate).Attr(kTypeT)
    .SetShapeFn(EpilogueGradShape)
    .Doc("dpre = dy * gelu'(pre), dbias = sum of dpre over all but the last dim.");

class EpilogueBase : public OpKernel {
 public:
  explicit EpilogueBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
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
class EpilogueOp : public EpilogueBase {
 public:
  using EpilogueBase::EpilogueBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& h = ctx->input(0);
    const Ref hr(h), br(ctx->input(1), has_bias_);
    LinearGeluEpilogueForward a{*hr, *br, approx_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = linear_gelu_epilogue_forward_check("linear_gelu", a); })) return;
    Tensor *pre, *y;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, h.shape(), &pre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, h.shape(), &y));
    a.pre = mutable_ptr(pre);
    a.y = mutable_ptr(y);
    call_csrc(ctx, [&] { linear_gelu_epilogue_forward(a, rc, exec_for<kGpu>(ctx)); });
  }
};

template <bool kGpu>
class EpilogueGradOp : public EpilogueBase {
 public:
  using EpilogueBase::EpilogueBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pre = ctx->input(1);
    const Ref dyr(ctx->input(0)), prer(pre);
    LinearGeluEpilogueBackward a{*dyr, *prer, has_bias_, approx_};
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = linear_gelu_epilogue_backward_check("linear_gelu_backward", a); })) return;
    Tensor *dpre, *dbias, workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, pre.shape(), &dpre));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({has_bias_ ? rc.cols : 0}), &dbias));
    const Exec exec = exec_for<kGpu>(ctx);
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] { bytes = linear_gelu_epilogue_backward_workspace_size(a, rc, exec); })) return;
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.dpre = mutable_ptr(dpre);
    a.dbias = mutable_ptr(dbias);
    call_csrc(ctx, [&] { linear_gelu_epilogue_backward(a, rc, exec); });
  }
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLinearGeluEpilogue", EpilogueOp, "T");
FUSEDLAYERS_REGISTER_KERNELS("FusedlayersLinearGeluEpilogueGrad", EpilogueGradOp, "T");

}  // namespace
}  // namespace fusedlayers::tf_binding
