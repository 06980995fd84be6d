// TensorFlow op FusedlayersFp8Gemm on csrc/fp8/fp8_gemm.h, which checks the arguments and owns the
// math: d = dequant(a) dequant(b)^T (+ bias), the scales in csrc's storage layouts (as
// FusedlayersFp8Quantize writes them). A CPU kernel alone: the TF op library links no cuBLASLt
// (csrc's FP8 GEMM on CUDA is cuBLASLt's scaled matmul), so on a GPU TensorFlow places the op on
// its CPU. Not differentiable: the FP8 linear layer's gradient calls it for each GEMM.
#include "backends/tensorflow/tf_binding.h"
#include "fp8/fp8_gemm.h"

namespace fusedlayers::tf_binding {
namespace {

REGISTER_OP("FusedlayersFp8Gemm")
    .Input("a: Ta").Input("a_scale_inv: float").Input("b: Tb").Input("b_scale_inv: float")
    .Input("bias: Tout").Output("d: Tout").Attr("a_scaling: string").Attr("b_scaling: string")
    .Attr("has_bias: bool").Attr("fast_accum: bool")
    // float8_e4m3fn or float8_e5m2 (checked by the kernel: an attr's type list cannot name them)
    .Attr("Ta: type").Attr("Tb: type").Attr("Tout: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(2), 0)));
      return absl::OkStatus();
    })
    .Doc("d = dequant(a) dequant(b)^T (+ bias) (csrc/fp8/fp8_gemm.h).");

class Fp8GemmOp : public OpKernel {
 public:
  explicit Fp8GemmOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("a_scaling", &a_scaling_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("b_scaling", &b_scaling_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fast_accum", &fast_accum_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bias = ctx->input(4);
    Fp8Gemm g;
    g.out_dtype = to_dtype(bias.dtype());
    g.fast_accum = fast_accum_;
    if (!call_csrc(ctx, [&] {
          g.a = operand("a", ctx->input(0), ctx->input(1), a_scaling_);
          g.b = operand("b", ctx->input(2), ctx->input(3), b_scaling_);
          if (has_bias_) {
            if (bias.dims() != 1 || bias.dim_size(0) != g.n())
              arg_error("fp8_gemm", "bias must have shape [" + std::to_string(g.n()) + "], got " +
                                        bias.shape().DebugString());
            g.bias = bias.tensor_data().data();
          }
          fp8_gemm_check(g);
        }))
      return;
    Tensor* d = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.m(), g.n()}), &d));
    g.d = mutable_ptr(d);
    call_csrc(ctx, [&] { fp8_gemm_cpu(g, tf_parallel_for(ctx)); });
  }

 private:
  // The operand of data [rows, cols] and its scales in csrc's storage (fp8_scales_from_storage).
  static Fp8Operand operand(const char* name, const Tensor& q, const Tensor& scale_inv,
                            const std::string& scaling) {
    Fp8Operand o;
    if (q.dtype() != ::tensorflow::DT_FLOAT8_E4M3FN && q.dtype() != ::tensorflow::DT_FLOAT8_E5M2)
      arg_error("fp8_gemm", std::string(name) + " must be float8_e4m3fn or float8_e5m2, got " +
                                ::tensorflow::DataTypeString(q.dtype()));
    o.format = q.dtype() == ::tensorflow::DT_FLOAT8_E4M3FN ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
    o.scaling = parse_fp8_scaling("fp8_gemm", scaling);
    if (q.dims() != 2)
      arg_error("fp8_gemm", std::string(name) + " must be 2-D, got " +
                                std::to_string(q.dims()) + "-D");
    o.rows = q.dim_size(0);
    o.cols = q.dim_size(1);
    o.data = reinterpret_cast<const uint8_t*>(q.tensor_data().data());
    o.scale_inv = reinterpret_cast<const float*>(scale_inv.tensor_data().data());
    const auto dims = scale_inv.shape().dim_sizes();
    fp8_scales_from_storage(o, dims.data(), static_cast<int64_t>(dims.size()));
    return o;
  }

  std::string a_scaling_, b_scaling_;
  bool has_bias_ = false, fast_accum_ = false;
};

REGISTER_KERNEL_BUILDER(Name("FusedlayersFp8Gemm").Device(::tensorflow::DEVICE_CPU), Fp8GemmOp);

}  // namespace
}  // namespace fusedlayers::tf_binding
