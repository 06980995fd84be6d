// TensorFlow ops FusedlayersAddRmsNorm / FusedlayersAddLayerNorm and their Grad ops on
// csrc/norm/add_norm.h, which checks every argument. Optional tensors (dh, weight, bias) are always
// inputs and count only when their has_<name> attribute is set (TF ops have no optional
// inputs); dresidual is an empty output where h has dy's dtype (dx is then both gradients).
// Inputs and outputs in csrc's order; x's dtype T, the residual's R, the parameters' P.
#include "backends/tensorflow/tf_norm.h"
#include "norm/add_norm.h"

namespace fusedlayers::tf_binding {
namespace {

constexpr char kTypeR[] = "R: {float, double, half, bfloat16}";

REGISTER_OP("FusedlayersAddRmsNorm")
    .Input("x: T").Input("residual: R").Input("weight: P")
    .Output("y: T").Output("h: R").Output("rstd: U")
    .Attr("normalized_shape: list(int)").Attr("eps: float").Attr("has_weight: bool")
    .Attr("zero_centered: bool = false").Attr(kTypeT).Attr(kTypeR).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(NormShape<2>(c));
      c->set_output(1, c->input(1));
      return absl::OkStatus();
    })
    .Doc("h = x + residual, y = RMSNorm(h) (csrc/norm/add_norm.h).");

REGISTER_OP("FusedlayersAddRmsNormGrad")
    .Input("dy: T").Input("dh: R").Input("h: R").Input("rstd: U").Input("weight: P")
    .Output("dx: T").Output("dresidual: R").Output("dweight: P")
    .Attr("normalized_shape: list(int)").Attr("has_dh: bool").Attr("has_weight: bool")
    .Attr("zero_centered: bool = false").Attr(kTypeT).Attr(kTypeR).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->UnknownShape());  // h's shape, or empty
      c->set_output(2, c->input(4));
      return absl::OkStatus();
    })
    .Doc("dx, dresidual, dweight of FusedlayersAddRmsNorm.");

REGISTER_OP("FusedlayersAddLayerNorm")
    .Input("x: T").Input("residual: R").Input("weight: P").Input("bias: P")
    .Output("y: T").Output("h: R").Output("mean: U").Output("rstd: U")
    .Attr("normalized_shape: list(int)").Attr("eps: float").Attr("has_weight: bool")
    .Attr("has_bias: bool").Attr(kTypeT).Attr(kTypeR).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(NormShape<3>(c));
      c->set_output(3, c->output(2));
      c->set_output(2, c->output(1));
      c->set_output(1, c->input(1));
      return absl::OkStatus();
    })
    .Doc("h = x + residual, y = LayerNorm(h) (csrc/norm/add_norm.h).");

REGISTER_OP("FusedlayersAddLayerNormGrad")
    .Input("dy: T").Input("dh: R").Input("h: R").Input("mean: U").Input("rstd: U")
    .Input("weight: P").Input("bias: P")
    .Output("dx: T").Output("dresidual: R").Output("dweight: P").Output("dbias: P")
    .Attr("normalized_shape: list(int)").Attr("has_dh: bool").Attr("has_weight: bool")
    .Attr("has_bias: bool").Attr(kTypeT).Attr(kTypeR).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->UnknownShape());
      c->set_output(2, c->input(5));
      c->set_output(3, c->input(6));
      return absl::OkStatus();
    })
    .Doc("dx, dresidual, dweight, dbias of FusedlayersAddLayerNorm.");

// The attributes both passes share; kLayer: add_layer_norm (a bias, mean and rstd).
template <bool kLayer>
struct AddNormAttrs {
  std::vector<int64_t> normalized_shape;
  bool has_weight = false, has_bias = false, zero_centered = false;

  explicit AddNormAttrs(OpKernelConstruction* ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("normalized_shape", &normalized_shape));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_weight", &has_weight));
    if (kLayer)
      OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias));
    else
      OP_REQUIRES_OK(ctx, ctx->GetAttr("zero_centered", &zero_centered));
  }
  static constexpr NormMode kMode = kLayer ? NormMode::kLayer : NormMode::kRms;
  Sizes shape() const {
    return {normalized_shape.data(), static_cast<int64_t>(normalized_shape.size())};
  }
  // The leading dims of x before the normalized ones (csrc checked x's trailing dims).
  TensorShape stats_shape(const Tensor& x) const {
    TensorShape s;
    for (int d = 0; d < x.dims() - static_cast<int>(normalized_shape.size()); ++d)
      s.AddDim(x.dim_size(d));
    return s;
  }
};

// Inputs x, residual, weight[, bias]; outputs y, h[, mean], rstd.
template <bool kLayer, bool kGpu>
class AddNormForwardOp : public OpKernel {
 public:
  explicit AddNormForwardOp(OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x), residual(ctx->input(1)), weight(ctx->input(2), attrs_.has_weight);
    const Ref bias(ctx->input(kLayer ? 3 : 2), attrs_.has_bias);
    AddNormForward a{attrs_.kMode, *xr, *residual, attrs_.shape(), *weight, *bias, eps_,
                     attrs_.zero_centered};
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = add_norm_forward_check(a); })) return;
    Tensor *y, *h, *mean = nullptr, *rstd;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, x.shape(), &h));
    if (kLayer) OP_REQUIRES_OK(ctx, ctx->allocate_output(2, attrs_.stats_shape(x), &mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(kLayer ? 3 : 2, attrs_.stats_shape(x), &rstd));
    a.y = mutable_ptr(y);
    a.h = mutable_ptr(h);
    a.mean = mean ? mutable_ptr(mean) : nullptr;
    a.rstd = mutable_ptr(rstd);
    call_csrc(ctx, [&] { add_norm_forward(a, rc, exec_for<kGpu>(ctx)); });
  }

 private:
  AddNormAttrs<kLayer> attrs_;
  float eps_;
};

// Inputs dy, dh, h[, mean], rstd, weight[, bias]; outputs dx, dresidual, dweight[, dbias].
template <bool kLayer, bool kGpu>
class AddNormBackwardOp : public OpKernel {
 public:
  explicit AddNormBackwardOp(OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_dh", &has_dh_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr int kRstd = kLayer ? 4 : 3, kWeight = kRstd + 1;
    const Tensor& dy = ctx->input(0);
    const Tensor& h = ctx->input(2);
    const Ref dyr(dy), dh(ctx->input(1), has_dh_), hr(h), mean(ctx->input(3), kLayer);
    const Ref rstd(ctx->input(kRstd)), weight(ctx->input(kWeight), attrs_.has_weight);
    const Ref bias(ctx->input(kLayer ? kWeight + 1 : kWeight), attrs_.has_bias);
    AddNormBackward a{attrs_.kMode, *dyr, *dh, *hr, *mean, *rstd, attrs_.shape(), *weight,
                      *bias, attrs_.zero_centered};
    const Exec exec = exec_for<kGpu>(ctx);
    RowsCols rc;
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] {
          rc = add_norm_backward_check(a);
          bytes = add_norm_backward_workspace_size(a, rc, exec);
        }))
      return;
    Tensor* out[4] = {};
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, dy.shape(), &out[0]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, h.dtype() == dy.dtype() ? TensorShape({0}) : h.shape(), &out[1]));
    for (int i = 2; i < (kLayer ? 4 : 3); ++i)
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, ctx->input(kWeight + i - 2).shape(), &out[i]));
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.dx = mutable_ptr(out[0]);
    a.dresidual = out[1]->NumElements() ? mutable_ptr(out[1]) : nullptr;
    a.dweight = mutable_ptr(out[2]);
    if (kLayer) a.dbias = mutable_ptr(out[3]);
    call_csrc(ctx, [&] { add_norm_backward(a, rc, exec); });
  }

 private:
  AddNormAttrs<kLayer> attrs_;
  bool has_dh_ = false;
};

// The XLA kernels: the custom calls fusedlayers_add_{rms,layer}_norm_{forward,backward}.
template <bool kLayer>
XlaAttributes xla_attributes(OpKernelConstruction* ctx, bool forward) {
  const AddNormAttrs<kLayer> attrs(ctx);
  XlaAttributes a;
  a.i64s("normalized_shape", attrs.normalized_shape);
  if (forward) {
    float eps = 0;
    if (const auto status = ctx->GetAttr("eps", &eps); !status.ok()) ctx->CtxFailure(status);
    a.f32("eps", eps);
  } else {
    bool has_dh = false;
    if (const auto status = ctx->GetAttr("has_dh", &has_dh); !status.ok())
      ctx->CtxFailure(status);
    a.boolean("has_dh", has_dh);
  }
  a.boolean("has_weight", attrs.has_weight);
  if (kLayer)
    a.boolean("has_bias", attrs.has_bias);
  else
    a.boolean("zero_centered", attrs.zero_centered);
  return a;
}

std::string target(bool layer, const char* pass) {
  return std::string("fusedlayers_add_") + (layer ? "layer" : "rms") + "_norm_" + pass;
}

template <bool kLayer>
class AddNormForwardXla : public XlaCustomCallOp {
 public:
  explicit AddNormForwardXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, target(kLayer, "forward"), xla_attributes<kLayer>(ctx, true),
                        results(normalized_ndims<void>(ctx)), kLayer ? 4 : 3) {}

 private:
  static XlaResults results(int64_t k) {
    return [k](::tensorflow::XlaOpKernelContext* ctx, bool) {
      const int rank = ctx->InputShape(0).dims();
      const auto u = ctx->input_xla_type(0) == xla::F64 ? xla::F64 : xla::F32;
      std::vector<xla::Shape> shapes{input_shape(ctx, 0), input_shape(ctx, 1)};
      for (int i = 0; i < (kLayer ? 2 : 1); ++i)
        shapes.push_back(input_shape(ctx, 0, 0, std::max<int>(rank - k, 0), u));
      return shapes;
    };
  }
};

template <bool kLayer>
class AddNormBackwardXla : public XlaCustomCallOp {
 public:
  explicit AddNormBackwardXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, target(kLayer, "backward"), xla_attributes<kLayer>(ctx, false),
                        results(normalized_ndims<void>(ctx)), kLayer ? 4 : 3) {}

 private:
  static XlaResults results(int64_t k) {
    return [k](::tensorflow::XlaOpKernelContext* ctx, bool gpu) {
      constexpr int kWeight = kLayer ? 5 : 4;
      const int64_t cols = normalized_cols(ctx, 0, k);
      const bool same = ctx->input_xla_type(0) == ctx->input_xla_type(2);
      std::vector<xla::Shape> shapes{
          input_shape(ctx, 0),
          same ? xla::ShapeUtil::MakeShape(ctx->input_xla_type(2), {0}) : input_shape(ctx, 2),
          input_shape(ctx, kWeight)};
      if (kLayer) shapes.push_back(input_shape(ctx, kWeight + 1));
      shapes.push_back(xla_workspace(ctx, gpu, kNormWorkspace, 0, cols));
      return shapes;
    };
  }
};

template <bool kGpu>
using RmsForward = AddNormForwardOp<false, kGpu>;
template <bool kGpu>
using RmsBackward = AddNormBackwardOp<false, kGpu>;
template <bool kGpu>
using LayerForward = AddNormForwardOp<true, kGpu>;
template <bool kGpu>
using LayerBackward = AddNormBackwardOp<true, kGpu>;

FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersAddRmsNorm", RmsForward, RmsBackward,
                                 AddNormForwardXla<false>, AddNormBackwardXla<false>);
FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersAddLayerNorm", LayerForward, LayerBackward,
                                 AddNormForwardXla<true>, AddNormBackwardXla<true>);

}  // namespace
}  // namespace fusedlayers::tf_binding
