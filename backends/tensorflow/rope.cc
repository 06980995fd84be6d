// TensorFlow ops FusedlayersRope / FusedlayersRopeGrad on csrc/rope/rope.h, which checks every
// argument. TF tensors are contiguous: q and k row-major in the layout unsqueeze_dim says. cos
// and sin have a dtype attribute of their own (C: float32 or q's dtype); they are not
// differentiated.
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "rope/rope.h"

namespace fusedlayers::tf_binding {
namespace {

constexpr char kTypeC[] = "C: {float, double, half, bfloat16}";

absl::Status RopeShapeFn(InferenceContext* c) {
  c->set_output(0, c->input(0));
  c->set_output(1, c->input(1));
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersRope")
    .Input("q: T").Input("k: K").Input("cos: C").Input("sin: S")
    .Output("q_embed: T").Output("k_embed: K")
    .Attr("unsqueeze_dim: int = 1").Attr("interleaved: bool = false").Attr(kTypeT)
    .Attr("K: {float, double, half, bfloat16}").Attr(kTypeC)
    .Attr("S: {float, double, half, bfloat16}").SetShapeFn(RopeShapeFn)
    .Doc("Rotary position embedding of q and k (csrc/rope/rope.h).");
REGISTER_OP("FusedlayersRopeGrad")
    .Input("dq_embed: T").Input("dk_embed: K").Input("cos: C").Input("sin: S")
    .Output("dq: T").Output("dk: K")
    .Attr("unsqueeze_dim: int = 1").Attr("interleaved: bool = false").Attr(kTypeT)
    .Attr("K: {float, double, half, bfloat16}").Attr(kTypeC)
    .Attr("S: {float, double, half, bfloat16}").SetShapeFn(RopeShapeFn)
    .Doc("dq, dk of FusedlayersRope (the transposed rotation).");

RopeView view(const Tensor& t, int64_t unsqueeze_dim) {
  void* data = const_cast<char*>(t.tensor_data().data());
  if (t.dims() != 4) return {data};
  const int64_t d1 = t.dim_size(1), d2 = t.dim_size(2), row = t.dim_size(3);
  if (unsqueeze_dim == 1) return {data, d1, d1 * d2 * row, d2 * row, row};
  return {data, d2, d1 * d2 * row, row, d2 * row};
}

template <bool kBackward>
struct RopeKernels {
  template <bool kGpu>
  class Op : public OpKernel {
   public:
    explicit Op(OpKernelConstruction* ctx) : OpKernel(ctx) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("unsqueeze_dim", &unsqueeze_dim_));
      OP_REQUIRES_OK(ctx, ctx->GetAttr("interleaved", &interleaved_));
    }

    void Compute(OpKernelContext* ctx) override {
      const char* op = kBackward ? "rope_backward" : "rope";
      const Tensor &q = ctx->input(0), &k = ctx->input(1), &cos = ctx->input(2);
      const Ref qr(q), kr(k), cr(cos), sr(ctx->input(3));
      const RopeArgs a{*qr, *kr, *cr, *sr, unsqueeze_dim_, interleaved_};
      RopeShape shape;
      if (!call_csrc(ctx, [&] { shape = rope_check(op, a); })) return;
      Tensor *q_out = nullptr, *k_out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, q.shape(), &q_out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, k.shape(), &k_out));
      const int64_t c_row = cos.dim_size(2);
      RopePass p{a.q.dtype, a.cos.dtype, shape, a.cos.data, a.sin.data,
                 cos.dim_size(0) == 1 ? 0 : cos.dim_size(1) * c_row, c_row,
                 view(q, unsqueeze_dim_), view(k, unsqueeze_dim_),
                 view(*q_out, unsqueeze_dim_), view(*k_out, unsqueeze_dim_), interleaved_,
                 kBackward};
      call_csrc(ctx, [&] { rope(p, exec_for<kGpu>(ctx)); });
    }

   private:
    int64_t unsqueeze_dim_ = 1;
    bool interleaved_ = false;
  };

  // Under XLA: the custom calls fusedlayers_rope_{forward,backward} (backends/xla/rope_ffi.cc).
  class Xla : public XlaCustomCallOp {
   public:
    explicit Xla(OpKernelConstruction* ctx)
        : XlaCustomCallOp(ctx, kBackward ? "fusedlayers_rope_backward" : "fusedlayers_rope_forward",
                          attributes(ctx),
                          [](::tensorflow::XlaOpKernelContext* c, bool) {
                            return std::vector<xla::Shape>{input_shape(c, 0), input_shape(c, 1)};
                          },
                          2) {}

   private:
    static XlaAttributes attributes(OpKernelConstruction* ctx) {
      int64_t unsqueeze_dim = 1;
      bool interleaved = false;
      if (!ctx->GetAttr("unsqueeze_dim", &unsqueeze_dim).ok() ||
          !ctx->GetAttr("interleaved", &interleaved).ok())
        ctx->CtxFailure(absl::InvalidArgumentError("fusedlayers.rope: missing attributes"));
      return XlaAttributes().i64("unsqueeze_dim", unsqueeze_dim).boolean("interleaved",
                                                                         interleaved);
    }
  };
};

template <bool kGpu> using RopeOp = RopeKernels<false>::Op<kGpu>;
template <bool kGpu> using RopeGradOp = RopeKernels<true>::Op<kGpu>;

FUSEDLAYERS_REGISTER_OP_AND_GRAD("FusedlayersRope", RopeOp, RopeGradOp, RopeKernels<false>::Xla,
                                 RopeKernels<true>::Xla);

}  // namespace
}  // namespace fusedlayers::tf_binding
