// TensorFlow op FusedlayersFp8Quantize on csrc/fp8/fp8.h, which checks the arguments and owns the
// scaling rule. Outputs in csrc's storage layouts (fusedlayers/tensorflow/fp8.py presents them as
// torch's binding does): q (x's shape, Tq), scale_inv ([blocks, rows] for 1x128, [row tiles,
// padded column tiles] for 128x128, a scalar for tensorwise), q_t and scale_inv_t (empty without
// transpose; scale_inv_t in scaling_t's storage). Not differentiable: the FP8 linear layer's gradient calls the GEMMs.
#include "backends/tensorflow/tf_binding.h"
#include "fp8/fp8.h"

namespace fusedlayers::tf_binding {
namespace {

// q like x; q_t [cols, rows] and the scales' storage (fp8_scale_sizes) where x's sizes are
// known (unknown sizes otherwise), empty without transpose.
absl::Status Fp8QuantizeShape(InferenceContext* c) {
  c->set_output(0, c->input(0));
  std::string scaling_name, scaling_t_name;
  bool transpose = false;
  TF_RETURN_IF_ERROR(c->GetAttr("scaling", &scaling_name));
  TF_RETURN_IF_ERROR(c->GetAttr("scaling_t", &scaling_t_name));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose", &transpose));
  const ShapeHandle x = c->input(0);
  int64_t rows = 1, cols = InferenceContext::kUnknownDim;
  if (c->RankKnown(x) && c->Rank(x) >= 1) {
    cols = c->Value(c->Dim(x, -1));
    for (int d = 0; d + 1 < c->Rank(x); ++d) {
      const int64_t v = c->Value(c->Dim(x, d));
      rows = v == InferenceContext::kUnknownDim || rows == InferenceContext::kUnknownDim
                 ? InferenceContext::kUnknownDim : rows * v;
    }
  }
  const bool known = c->RankKnown(x) && rows != InferenceContext::kUnknownDim &&
                     cols != InferenceContext::kUnknownDim;
  Fp8Scaling scaling = Fp8Scaling::kBlock1x128, scaling_t = scaling;
  try {
    scaling = parse_fp8_scaling("fp8_quantize", scaling_name);
    scaling_t = parse_fp8_scaling("fp8_quantize", scaling_t_name, "scaling_t");
  } catch (const Error& e) {
    return absl::InvalidArgumentError(e.what());
  }
  const auto storage = [&](Fp8Scaling scaling, bool transposed) -> ShapeHandle {
    if (scaling == Fp8Scaling::kTensorwise) return c->Scalar();
    if (!known) return c->Matrix(InferenceContext::kUnknownDim, InferenceContext::kUnknownDim);
    const Fp8ScaleSizes s = fp8_scale_sizes(scaling, rows, cols, transposed);
    return c->Matrix(s.dim0, s.ld);
  };
  c->set_output(1, storage(scaling, false));
  c->set_output(2, transpose ? c->Matrix(cols, rows) : c->Vector(0));
  c->set_output(3, transpose ? storage(scaling_t, true) : c->Vector(0));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersFp8Quantize")
    .Input("x: T").Output("q: Tq").Output("scale_inv: float").Output("q_t: Tq")
    .Output("scale_inv_t: float").Attr("scaling: string").Attr("format: string")
    .Attr("transpose: bool").Attr("power_of_2_scales: bool").Attr("scaling_t: string")
    .Attr(kTypeT)
    .Attr("Tq: type")  // the format's FP8 dtype (an attr's type list cannot name them)
    .SetShapeFn(Fp8QuantizeShape)
    .Doc("x quantized to FP8 with its scales (csrc/fp8/fp8.h); q_t: x^T's, with transpose.");

template <bool kGpu>
class Fp8QuantizeOp : public OpKernel {
 public:
  explicit Fp8QuantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string scaling, format, scaling_t;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scaling", &scaling));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scaling_t", &scaling_t));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("format", &format));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose", &transpose_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("power_of_2_scales", &target_.power_of_2_scales));
    ::tensorflow::DataType tq;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tq", &tq));
    try {
      target_.format = parse_fp8_format("fp8_quantize", format);
      target_.scaling = parse_fp8_scaling("fp8_quantize", scaling);
      target_.scaling_t = parse_fp8_scaling("fp8_quantize", scaling_t, "scaling_t");
    } catch (const Error& e) {
      ctx->CtxFailure(absl::InvalidArgumentError(e.what()));
      return;
    }
    OP_REQUIRES(ctx, (tq == ::tensorflow::DT_FLOAT8_E4M3FN) ==
                         (target_.format == Fp8Format::kE4M3),
                absl::InvalidArgumentError("fp8_quantize: Tq must be the format's dtype"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x);
    Fp8Quantize a;
    static_cast<Fp8Target&>(a) = target_;
    a.x = *xr;
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = fp8_quantize_check(a); })) return;
    Tensor* out[4] = {};
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &out[0]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, storage(false, rc), &out[1]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            2, transpose_ ? TensorShape({rc.cols, rc.rows}) : TensorShape({0}),
                            &out[2]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, transpose_ ? storage(true, rc)
                                                           : TensorShape({0}), &out[3]));
    a.q = static_cast<uint8_t*>(mutable_ptr(out[0]));
    a.scale_inv = static_cast<float*>(mutable_ptr(out[1]));
    if (transpose_) {
      a.q_t = static_cast<uint8_t*>(mutable_ptr(out[2]));
      a.scale_inv_t = static_cast<float*>(mutable_ptr(out[3]));
    }
    Tensor amax;
    if (a.scaling == Fp8Scaling::kTensorwise) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({1}), &amax));
      a.amax = static_cast<float*>(mutable_ptr(&amax));
    }
    call_csrc(ctx, [&] { fp8_quantize(a, exec_for<kGpu>(ctx)); });
  }

 private:
  // scale_inv's storage for x (or x^T) of rc (fp8_scale_sizes).
  TensorShape storage(bool transposed, const RowsCols& rc) const {
    const Fp8Scaling scaling = transposed ? target_.scaling_t : target_.scaling;
    const Fp8ScaleSizes s = fp8_scale_sizes(scaling, rc.rows, rc.cols, transposed);
    if (scaling == Fp8Scaling::kTensorwise) return TensorShape({});
    return TensorShape({s.dim0, s.ld});
  }

  Fp8Target target_;
  bool transpose_ = false;
};

FUSEDLAYERS_REGISTER_KERNELS("FusedlayersFp8Quantize", Fp8QuantizeOp, "T");

}  // namespace
}  // namespace fusedlayers::tf_binding
