// TensorFlow ops FusedlayersGroupedGemm / FusedlayersGroupedGemmGrad on csrc/gemm/grouped_gemm.h,
// which checks every argument: CPU and GPU kernels, and XLA kernels (the custom calls of
// backends/xla/grouped_gemm_ffi.cc). TF keeps int32 tensors of GPU ops in host memory (as it holds
// moe_permute's offsets), so the GPU kernels take offsets there and copy them to the device on
// the op's stream before csrc reads them; under XLA they stay on the device.
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "gemm/grouped_gemm.h"

// backends/xla/grouped_gemm_ffi.cc: the CUDA workspace of either pass.
extern "C" size_t fusedlayers_xla_grouped_gemm_workspace_size(int64_t rows, int64_t k, int64_t n,
                                                              int64_t groups, int dtype);

namespace fusedlayers::tf_binding {
namespace {

// weight's own dtype attribute, so that csrc, not TF's type check, names a mismatch with x's.
constexpr char kTypeV[] = "V: {float, double, half, bfloat16}";

// y (rows, n): rows from x, n from weight by its layout.
absl::Status ForwardShape(InferenceContext* c) {
  ShapeHandle x, weight;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &weight));
  bool transposed = false;
  TF_RETURN_IF_ERROR(c->GetAttr("transposed", &transposed));
  c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(weight, transposed ? 2 : 1)));
  return absl::OkStatus();
}

absl::Status GradShape(InferenceContext* c) {
  c->set_output(0, c->input(1));
  c->set_output(1, c->input(2));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersGroupedGemm")
    .Input("x: T").Input("weight: V").Input("offsets: int32").Output("y: T")
    .Attr("transposed: bool = false").Attr(kTypeT).Attr(kTypeV).SetShapeFn(ForwardShape)
    .Doc("Each group's rows of x times its weight (csrc/gemm/grouped_gemm.h).");
REGISTER_OP("FusedlayersGroupedGemmGrad")
    .Input("dy: T").Input("x: T").Input("weight: V").Input("offsets: int32")
    .Output("dx: T").Output("dweight: V").Attr("transposed: bool = false").Attr(kTypeT)
    .Attr(kTypeV)
    .SetShapeFn(GradShape)
    .Doc("dx (dgrad) and dweight (wgrad) of FusedlayersGroupedGemm.");

// offsets (int32) as csrc reads them: the host tensor on the CPU; on the GPU a device copy in
// `temp` (csrc checks the host values as it copies them).
template <bool kGpu>
bool offsets_on_device(OpKernelContext* ctx, const char* op, int64_t rows, Tensor* temp,
                       IndexRef* offsets) {
#if GOOGLE_CUDA
  if constexpr (kGpu) {
    const int64_t groups = offsets->sizes.size ? offsets->sizes[0] : 0;
    if (!groups) return true;
    if (!allocate_workspace(ctx, groups * sizeof(int32_t), temp)) return false;
    int32_t* device = static_cast<int32_t*>(mutable_ptr(temp));
    if (!call_csrc(ctx, [&] {
          grouped_gemm_offsets_to_device(op, device, static_cast<const int32_t*>(offsets->data),
                                         groups, rows, gpu_stream(ctx));
        }))
      return false;
    offsets->data = device;
  }
#else
  (void)ctx, (void)op, (void)rows, (void)temp, (void)offsets;
#endif
  return true;
}

class Base : public OpKernel {
 public:
  explicit Base(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transposed", &transposed_));
  }

 protected:
  bool transposed_ = false;
};

template <bool kGpu>
class ForwardOp : public Base {
 public:
  using Base::Base;
  void Compute(OpKernelContext* ctx) override {
    const Ref x(ctx->input(0)), weight(ctx->input(1));
    const Tensor& offsets = ctx->input(2);
    const auto offsets_dims = offsets.shape().dim_sizes();
    Tensor device_offsets, workspace;
    GroupedGemmForward a{*x, *weight, {}, transposed_};
    a.offsets = {offsets.tensor_data().data(), IndexType::kInt32,
                 {offsets_dims.data(), static_cast<int64_t>(offsets_dims.size())}};
    GroupedGemmShape s;
    if (!call_csrc(ctx, [&] { s = grouped_gemm_forward_check(a); })) return;
    if (!offsets_on_device<kGpu>(ctx, "grouped_gemm", s.rows, &device_offsets, &a.offsets))
      return;
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s.rows, s.n}), &y));
    a.y = mutable_ptr(y);
    const Exec exec = exec_for<kGpu>(ctx);
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] { bytes = grouped_gemm_workspace_size(s, a.x.dtype, exec); })) return;
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (bytes && !a.workspace) return;
    call_csrc(ctx, [&] { grouped_gemm_forward(a, s, exec); });
  }
};

template <bool kGpu>
class GradOp : public Base {
 public:
  using Base::Base;
  void Compute(OpKernelContext* ctx) override {
    const Ref dy(ctx->input(0)), x(ctx->input(1)), weight(ctx->input(2));
    const Tensor& offsets = ctx->input(3);
    const auto offsets_dims = offsets.shape().dim_sizes();
    Tensor device_offsets, workspace;
    GroupedGemmBackward a{*dy, *x, *weight, {}, transposed_};
    a.offsets = {offsets.tensor_data().data(), IndexType::kInt32,
                 {offsets_dims.data(), static_cast<int64_t>(offsets_dims.size())}};
    GroupedGemmShape s;
    if (!call_csrc(ctx, [&] { s = grouped_gemm_backward_check(a); })) return;
    if (!offsets_on_device<kGpu>(ctx, "grouped_gemm_backward", s.rows, &device_offsets,
                                 &a.offsets))
      return;
    Tensor *dx = nullptr, *dweight = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ctx->input(1).shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, ctx->input(2).shape(), &dweight));
    a.dx = mutable_ptr(dx);
    a.dweight = mutable_ptr(dweight);
    const Exec exec = exec_for<kGpu>(ctx);
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] { bytes = grouped_gemm_workspace_size(s, a.x.dtype, exec); })) return;
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (bytes && !a.workspace) return;
    call_csrc(ctx, [&] { grouped_gemm_backward(a, s, exec); });
  }
};

XlaAttributes transposed_attribute(OpKernelConstruction* ctx) {
  bool transposed = false;
  if (!ctx->GetAttr("transposed", &transposed).ok())
    ctx->CtxFailure(absl::InvalidArgumentError("fusedlayers.grouped_gemm: missing transposed"));
  return XlaAttributes().boolean("transposed", transposed);
}

// The workspace result of a call on x (input `xi`) and weight (input `xi + 1`).
xla::Shape workspace_shape(::tensorflow::XlaOpKernelContext* c, int xi, bool gpu,
                           bool transposed) {
  const auto x = c->InputShape(xi).dim_sizes();
  const auto w = c->InputShape(xi + 1).dim_sizes();
  size_t bytes = 0;
  if (gpu && x.size() == 2 && w.size() == 3) {
    bytes = fusedlayers_xla_grouped_gemm_workspace_size(
        x[0], x[1], transposed ? w[2] : w[1], w[0],
        static_cast<int>(to_dtype(c->input_type(xi))));
  }
  return xla::ShapeUtil::MakeShape(xla::U8, {static_cast<int64_t>(bytes)});
}

bool transposed_of(OpKernelConstruction* ctx) {
  bool transposed = false;
  return ctx->GetAttr("transposed", &transposed).ok() && transposed;
}

class ForwardXla : public XlaCustomCallOp {
 public:
  explicit ForwardXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_grouped_gemm_forward", transposed_attribute(ctx),
                        [t = transposed_of(ctx)](::tensorflow::XlaOpKernelContext* c, bool gpu) {
                          const auto x = c->InputShape(0).dim_sizes();
                          const auto w = c->InputShape(1).dim_sizes();
                          const int64_t n = w.size() == 3 ? (t ? w[2] : w[1]) : 0;
                          return std::vector<xla::Shape>{
                              xla::ShapeUtil::MakeShape(c->input_xla_type(0),
                                                        {x.empty() ? 0 : x[0], n}),
                              workspace_shape(c, 0, gpu, t)};
                        },
                        1) {}
};

class GradXla : public XlaCustomCallOp {
 public:
  explicit GradXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, "fusedlayers_grouped_gemm_backward", transposed_attribute(ctx),
                        [t = transposed_of(ctx)](::tensorflow::XlaOpKernelContext* c, bool gpu) {
                          return std::vector<xla::Shape>{input_shape(c, 1), input_shape(c, 2),
                                                         workspace_shape(c, 1, gpu, t)};
                        },
                        2) {}
};

REGISTER_KERNEL_BUILDER(Name("FusedlayersGroupedGemm").Device(::tensorflow::DEVICE_CPU),
                        ForwardOp<false>);
REGISTER_KERNEL_BUILDER(Name("FusedlayersGroupedGemmGrad").Device(::tensorflow::DEVICE_CPU),
                        GradOp<false>);
#if GOOGLE_CUDA
#define FUSEDLAYERS_GROUPED_GEMM_GPU(T)                                                        \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersGroupedGemm").Device(::tensorflow::DEVICE_GPU)     \
                              .TypeConstraint<T>("T").HostMemory("offsets"),                  \
                          ForwardOp<true>);                                                    \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersGroupedGemmGrad").Device(::tensorflow::DEVICE_GPU) \
                              .TypeConstraint<T>("T").HostMemory("offsets"),                  \
                          GradOp<true>)
FUSEDLAYERS_GROUPED_GEMM_GPU(float);
FUSEDLAYERS_GROUPED_GEMM_GPU(Eigen::half);
FUSEDLAYERS_GROUPED_GEMM_GPU(::tensorflow::bfloat16);
#endif
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersGroupedGemm", ForwardXla);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersGroupedGemmGrad", GradXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
