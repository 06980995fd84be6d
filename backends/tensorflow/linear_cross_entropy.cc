// TensorFlow ops for linear_cross_entropy's chunk loop, which fusedlayers/tensorflow runs with
// TF's matmuls (csrc/loss/linear_cross_entropy.h has the math, the chunk rule and the checks):
//   FusedlayersLinearCrossEntropyChunk      csrc's row pass of one chunk of logits: each row's
//                                            loss and, when grad_scale has values, du and the
//                                            chunk's column sums of du (for dbias);
//   FusedlayersLinearCrossEntropyChunkRows  the rows per chunk for n rows (a graph whose batch
//                                            size is known only when it runs).
// The float options are float64 inputs (constants under XLA), so float64 losses take them
// exactly; absent bias / grad_scale are empty tensors, as in JAX's custom call. target is int64
// (TF keeps int32 tensors of GPU ops in host memory).
#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers::tf_binding {
namespace {

// du and dbias are empty without grad_scale values, and dbias without a bias.
absl::Status ChunkShape(InferenceContext* c) {
  ShapeHandle logits;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &logits));
  c->set_output(0, c->Vector(c->Dim(logits, 0)));
  const int64_t scales = c->Value(c->NumElements(c->input(3)));
  const int64_t biases = c->Value(c->NumElements(c->input(1)));
  if (scales == InferenceContext::kUnknownDim) {
    c->set_output(1, c->UnknownShape());
    c->set_output(2, c->UnknownShapeOfRank(1));
  } else {
    c->set_output(1, scales ? logits : c->Vector(0));
    c->set_output(2, !scales || biases == 0 ? c->Vector(0)
                     : biases == InferenceContext::kUnknownDim ? c->UnknownShapeOfRank(1)
                                                               : c->Vector(c->Dim(logits, 1)));
  }
  return absl::OkStatus();
}

REGISTER_OP("FusedlayersLinearCrossEntropyChunk")
    .Input("logits: T").Input("linear_bias: T").Input("target: int64").Input("grad_scale: U")
    .Input("label_smoothing: double").Input("softcap: double").Input("z_loss: double")
    .Output("loss: U").Output("du: T").Output("dbias: U")
    .Attr("ignore_index: int = -100").Attr(kTypeT).Attr(kTypeU)
    .SetShapeFn(ChunkShape)
    .Doc("One chunk's row pass of linear_cross_entropy (csrc/loss/linear_cross_entropy.h): loss "
         "(rows,); du (rows, vocab) and dbias (vocab,), or empty, as grad_scale and linear_bias "
         "are.");
REGISTER_OP("FusedlayersLinearCrossEntropyChunkRows")
    .Input("n: int64").Output("rows: int64").Attr("hidden: int").Attr("vocab: int")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("The rows per chunk of linear_cross_entropy for n rows (csrc's rule).");

bool read_double(OpKernelContext* ctx, int i, double* out) {
  const Tensor& t = ctx->input(i);
  if (t.NumElements() != 1) {
    ctx->CtxFailure(absl::InvalidArgumentError("fusedlayers.linear_cross_entropy: option " +
                                               std::to_string(i) + " must be a scalar"));
    return false;
  }
  *out = t.flat<double>()(0);
  return true;
}

template <bool kGpu>
class ChunkOp : public OpKernel {
 public:
  explicit ChunkOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ignore_index", &ignore_index_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor &logits = ctx->input(0), &bias = ctx->input(1), &target = ctx->input(2),
                 &grad_scale = ctx->input(3);
    double label_smoothing, softcap, z_loss;
    if (!read_double(ctx, 4, &label_smoothing) || !read_double(ctx, 5, &softcap) ||
        !read_double(ctx, 6, &z_loss))
      return;
    const bool has_bias = bias.NumElements() > 0, grads = grad_scale.NumElements() > 0;
    const Ref l(logits), b(bias, has_bias);
    if (!call_csrc(ctx, [&] {
          linear_cross_entropy_chunk_check(*l, *b, target.NumElements(), grad_scale.NumElements(),
                                           label_smoothing, softcap, z_loss);
        }))
      return;
    const int64_t rows = logits.dim_size(0), vocab = logits.dim_size(1);
    Tensor *loss = nullptr, *du = nullptr, *dbias = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows}), &loss));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, grads ? logits.shape() : TensorShape({0}), &du));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            2, TensorShape({grads && has_bias ? vocab : 0}), &dbias));
    const LinearCrossEntropyChunk c{
        logits.tensor_data().data(), grads ? mutable_ptr(du) : nullptr,
        has_bias ? bias.tensor_data().data() : nullptr, target.tensor_data().data(),
        /*target_int32=*/false, 0, rows, vocab, (*l).dtype, ignore_index_,
        label_smoothing, softcap, z_loss, grads ? grad_scale.tensor_data().data() : nullptr,
        grad_scale.NumElements() > 1, mutable_ptr(loss),
        grads && has_bias ? mutable_ptr(dbias) : nullptr};
    call_csrc(ctx, [&] { linear_cross_entropy_chunk(c, exec_for<kGpu>(ctx)); });
  }

 private:
  int64_t ignore_index_ = -100;
};

class ChunkRowsOp : public OpKernel {
 public:
  explicit ChunkRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hidden", &hidden_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab", &vocab_));
  }

  void Compute(OpKernelContext* ctx) override {
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &rows));
    rows->scalar<int64_t>()() =
        linear_cross_entropy_chunk_rows(ctx->input(0).scalar<int64_t>()(), hidden_, vocab_);
  }

 private:
  int64_t hidden_ = 0, vocab_ = 0;
};

// Under XLA: the custom call fusedlayers_linear_cross_entropy_chunk
// (backends/xla/linear_cross_entropy_ffi.cc), the options as its attributes.
class ChunkXla : public ::tensorflow::XlaOpKernel {
 public:
  explicit ChunkXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ignore_index", &ignore_index_));
  }

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    double options[3];
    for (int i = 0; i < 3; ++i) OP_REQUIRES_OK(ctx, ctx->ConstantInputAsFloatScalar(4 + i,
                                                                                    &options[i]));
    XlaAttributes attrs;
    attrs.i64("ignore_index", ignore_index_).f64("label_smoothing", options[0])
        .f64("softcap", options[1]).f64("z_loss", options[2]);
    const bool grads = ctx->InputShape(3).num_elements() > 0,
               has_bias = ctx->InputShape(1).num_elements() > 0;
    const xla::PrimitiveType loss_type = ctx->input_xla_type(3);
    const int64_t rows = ctx->InputShape(0).dim_size(0), vocab = ctx->InputShape(0).dim_size(1);
    const std::vector<xla::Shape> results{
        xla::ShapeUtil::MakeShape(loss_type, {rows}),
        grads ? input_shape(ctx, 0) : xla::ShapeUtil::MakeShape(ctx->input_xla_type(0), {0}),
        xla::ShapeUtil::MakeShape(loss_type, {grads && has_bias ? vocab : 0})};
    const xla::XlaOp call = xla::CustomCall(
        ctx->builder(), "fusedlayers_linear_cross_entropy_chunk",
        {ctx->Input(0), ctx->Input(1), ctx->Input(2), ctx->Input(3)},
        xla::ShapeUtil::MakeTupleShape(results), attrs.dict(), /*has_side_effect=*/false, {},
        nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < 3; ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  int64_t ignore_index_ = -100;
};

// Under XLA shapes are static: n is a constant, and so is the result.
class ChunkRowsXla : public ::tensorflow::XlaOpKernel {
 public:
  explicit ChunkRowsXla(OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("hidden", &hidden_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab", &vocab_));
  }

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ctx->ConstantInputAsIntScalar(0, &n));
    ctx->SetOutput(0, xla::ConstantR0<int64_t>(
                          ctx->builder(), linear_cross_entropy_chunk_rows(n, hidden_, vocab_)));
  }

 private:
  int64_t hidden_ = 0, vocab_ = 0;
};

#if GOOGLE_CUDA
#define FUSEDLAYERS_REGISTER_CHUNK_GPU(T)                                                    \
  REGISTER_KERNEL_BUILDER(Name("FusedlayersLinearCrossEntropyChunk")                        \
                              .Device(::tensorflow::DEVICE_GPU)                             \
                              .TypeConstraint<T>("T")                                       \
                              .HostMemory("label_smoothing")                                \
                              .HostMemory("softcap")                                        \
                              .HostMemory("z_loss"),                                        \
                          ChunkOp<true>)
FUSEDLAYERS_REGISTER_CHUNK_GPU(float);
FUSEDLAYERS_REGISTER_CHUNK_GPU(Eigen::half);
FUSEDLAYERS_REGISTER_CHUNK_GPU(::tensorflow::bfloat16);
REGISTER_KERNEL_BUILDER(Name("FusedlayersLinearCrossEntropyChunkRows")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("n")
                            .HostMemory("rows"),
                        ChunkRowsOp);
#endif
REGISTER_KERNEL_BUILDER(Name("FusedlayersLinearCrossEntropyChunk").Device(::tensorflow::DEVICE_CPU),
                        ChunkOp<false>);
REGISTER_KERNEL_BUILDER(Name("FusedlayersLinearCrossEntropyChunkRows")
                            .Device(::tensorflow::DEVICE_CPU),
                        ChunkRowsOp);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersLinearCrossEntropyChunk", ChunkXla);
FUSEDLAYERS_REGISTER_XLA_KERNEL("FusedlayersLinearCrossEntropyChunkRows", ChunkRowsXla);

}  // namespace
}  // namespace fusedlayers::tf_binding
