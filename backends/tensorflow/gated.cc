// TensorFlow ops FusedlayersSwiglu / FusedlayersGeglu and their Grad ops on csrc/activation/gated.h, which
// checks every argument. up has a dtype attribute of its own (V), so that csrc, not TF's type
// check, names a mismatch as the torch and JAX ops do. TF tensors are contiguous.
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "activation/gated.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace fusedlayers::tf_binding {
namespace {

constexpr char kTypeV[] = "V: {float, double, half, bfloat16}";

absl::Status GatedGradShape(InferenceContext* c) {
  c->set_output(0, c->input(1));
  c->set_output(1, c->input(1));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersSwiglu")
    .Input("gate: T").Input("up: V").Output("y: T").Attr(kTypeT).Attr(kTypeV)
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("y = silu(gate) * up (csrc/activation/gated.h).");
REGISTER_OP("FusedlayersSwigluGrad")
    .Input("dy: T").Input("gate: T").Input("up: V").Output("dgate: T").Output("dup: V")
    .Attr(kTypeT).Attr(kTypeV).SetShapeFn(GatedGradShape)
    .Doc("dgate, dup of FusedlayersSwiglu.");
REGISTER_OP("FusedlayersGeglu")
    .Input("gate: T").Input("up: V").Output("y: T").Attr("approximate: string = 'none'")
    .Attr(kTypeT).Attr(kTypeV).SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("y = gelu(gate) * up, GELU's erf ('none') or tanh form (csrc/activation/gated.h).");
REGISTER_OP("FusedlayersGegluGrad")
    .Input("dy: T").Input("gate: T").Input("up: V").Output("dgate: T").Output("dup: V")
    .Attr("approximate: string = 'none'").Attr(kTypeT).Attr(kTypeV).SetShapeFn(GatedGradShape)
    .Doc("dgate, dup of FusedlayersGeglu.");

// The two ops' names and activation attribute: swiglu has none.
struct Swiglu {
  static constexpr const char* kName = "swiglu";
  static constexpr const char* kBackward = "swiglu_backward";
  static constexpr const char* kTarget = "fusedlayers_swiglu_";
  static bool activation(OpKernelConstruction*, const char*, GatedActivation* act,
                         std::string*) {
    *act = GatedActivation::kSilu;
    return true;
  }
};
struct Geglu {
  static constexpr const char* kName = "geglu";
  static constexpr const char* kBackward = "geglu_backward";
  static constexpr const char* kTarget = "fusedlayers_geglu_";
  static bool activation(OpKernelConstruction* ctx, const char* op, GatedActivation* act,
                         std::string* approximate) {
    const auto status = ctx->GetAttr("approximate", approximate);
    if (!status.ok()) {
      ctx->CtxFailure(status);
      return false;
    }
    try {
      *act = geglu_activation(op, *approximate);
      return true;
    } catch (const Error& e) {
      ctx->CtxFailure(absl::InvalidArgumentError(e.what()));
      return false;
    }
  }
};

template <typename Op>
struct GatedKernels {
  template <bool kGpu>
  class Forward : public OpKernel {
   public:
    explicit Forward(OpKernelConstruction* ctx) : OpKernel(ctx) {
      std::string approximate;
      ok_ = Op::activation(ctx, Op::kName, &act_, &approximate);
    }

    void Compute(OpKernelContext* ctx) override {
      if (!ok_) return;
      const Tensor& gate = ctx->input(0);
      const Ref g(gate), u(ctx->input(1));
      GatedForward a{{*g}, {*u}, act_};
      RowsCols rc{};
      if (!call_csrc(ctx, [&] { rc = gated_forward_check(Op::kName, a); })) return;
      Tensor* y = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, gate.shape(), &y));
      a.y = mutable_ptr(y);
      call_csrc(ctx, [&] { gated_forward(a, rc, exec_for<kGpu>(ctx)); });
    }

   private:
    GatedActivation act_ = GatedActivation::kSilu;
    bool ok_ = false;
  };

  template <bool kGpu>
  class Backward : public OpKernel {
   public:
    explicit Backward(OpKernelConstruction* ctx) : OpKernel(ctx) {
      std::string approximate;
      ok_ = Op::activation(ctx, Op::kBackward, &act_, &approximate);
    }

    void Compute(OpKernelContext* ctx) override {
      if (!ok_) return;
      const Tensor& gate = ctx->input(1);
      const Ref dy(ctx->input(0)), g(gate), u(ctx->input(2));
      GatedBackward a{*dy, {*g}, {*u}, act_};
      RowsCols rc{};
      if (!call_csrc(ctx, [&] { rc = gated_backward_check(Op::kBackward, a); })) return;
      Tensor *dgate = nullptr, *dup = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, gate.shape(), &dgate));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, gate.shape(), &dup));
      a.dgate = mutable_ptr(dgate);
      a.dup = mutable_ptr(dup);
      call_csrc(ctx, [&] { gated_backward(a, rc, exec_for<kGpu>(ctx)); });
    }

   private:
    GatedActivation act_ = GatedActivation::kSilu;
    bool ok_ = false;
  };

  // Under XLA: the custom calls fusedlayers_<op>_{forward,backward} (backends/xla/gated_ffi.cc).
  static XlaAttributes attributes(OpKernelConstruction* ctx) {
    XlaAttributes attrs;
    std::string approximate;
    if (ctx->HasAttr("approximate") && ctx->GetAttr("approximate", &approximate).ok())
      attrs.str("approximate", approximate);
    return attrs;
  }

  class ForwardXla : public XlaCustomCallOp {
   public:
    explicit ForwardXla(OpKernelConstruction* ctx)
        : XlaCustomCallOp(ctx, std::string(Op::kTarget) + "forward", attributes(ctx),
                          [](::tensorflow::XlaOpKernelContext* c, bool) {
                            return std::vector<xla::Shape>{input_shape(c, 0)};
                          },
                          1) {}
  };

  class BackwardXla : public XlaCustomCallOp {
   public:
    explicit BackwardXla(OpKernelConstruction* ctx)
        : XlaCustomCallOp(ctx, std::string(Op::kTarget) + "backward", attributes(ctx),
                          [](::tensorflow::XlaOpKernelContext* c, bool) {
                            return std::vector<xla::Shape>{input_shape(c, 1), input_shape(c, 2)};
                          },
                          2) {}
  };
};

template <bool kGpu> using SwigluOp = GatedKernels<Swiglu>::Forward<kGpu>;
template <bool kGpu> using SwigluGradOp = GatedKernels<Swiglu>::Backward<kGpu>;
template <bool kGpu> using GegluOp = GatedKernels<Geglu>::Forward<kGpu>;
template <bool kGpu> using GegluGradOp = GatedKernels<Geglu>::Backward<kGpu>;
using SwigluXla = GatedKernels<Swiglu>::ForwardXla;
using SwigluGradXla = GatedKernels<Swiglu>::BackwardXla;
using GegluXla = GatedKernels<Geglu>::ForwardXla;
using GegluGradXla = GatedKernels<Geglu>::BackwardXla;

FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersSwiglu", SwigluOp, SwigluGradOp, SwigluXla,
                                 SwigluGradXla);
FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersGeglu", GegluOp, GegluGradOp, GegluXla,
                                 GegluGradXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
