// TensorFlow ops FusedlayersLinearGeluEpilogue / FusedlayersLinearGeluEpilogueGrad: linear_gelu's
// bias + GELU epilogue (csrc/gemm/linear_gelu_epilogue.h). The GEMMs around it are TF's own matmul
// (fusedlayers/tensorflow/linear_gelu.py).
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "gemm/linear_gelu_epilogue.h"

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

// Under XLA: the custom calls fusedlayers_linear_gelu_{forward,backward} (backends/xla), the
// epilogue around XLA's own dots.
XlaAttributes epilogue_attributes(OpKernelConstruction* ctx) {
  bool has_bias = false;
  std::string approximate;
  for (const auto& status :
       {ctx->GetAttr("has_bias", &has_bias), ctx->GetAttr("approximate", &approximate)})
    if (!status.ok()) ctx->CtxFailure(status);
  return XlaAttributes().boolean("has_bias", has_bias).str("approximate", approximate);
}

class EpilogueXla : public XlaCustomCallOp {
 public:
  explicit EpilogueXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_linear_gelu_forward",
                        epilogue_attributes(ctx).boolean("with_pre", true),
                        [](::tensorflow::XlaOpKernelContext* c, bool) {
                          return std::vector<xla::Shape>{input_shape(c, 0), input_shape(c, 0)};
                        },
                        2) {}
};

class EpilogueGradXla : public XlaCustomCallOp {
 public:
  explicit EpilogueGradXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_linear_gelu_backward", epilogue_attributes(ctx),
                        [has_bias = bias_of(ctx)](::tensorflow::XlaOpKernelContext* c, bool gpu) {
                          const auto pre = c->InputShape(1);
                          const int64_t cols = pre.dims() ? pre.dim_size(pre.dims() - 1) : 1;
                          return std::vector<xla::Shape>{
                              input_shape(c, 1),
                              xla::ShapeUtil::MakeShape(c->input_xla_type(1),
                                                        {has_bias ? cols : 0}),
                              xla_workspace(c, gpu, kEpilogueWorkspace, 1, cols)};
                        },
                        2) {}

 private:
  static bool bias_of(OpKernelConstruction* ctx) {
    bool has_bias = false;
    ctx->GetAttr("has_bias", &has_bias).IgnoreError();  // read by epilogue_attributes, checked
    return has_bias;
  }
};

FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersLinearGeluEpilogue", EpilogueOp, EpilogueGradOp,
                                 EpilogueXla, EpilogueGradXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
