// What the TF bindings of the norm ops share (layer_norm.cc, rms_norm.cc): the ops' attributes
// (normalized_shape passed through to csrc, eps, which parameters are present, the op's one
// option), the statistics' shape and dtype, and one forward and one backward kernel for both
// ops, specialised by a traits struct `Op`:
//   kName, kOption (the bool attribute: rms_scaling, zero_centered), kHasBias, kStats (mean and
//   rstd, or rstd), and the csrc calls: forward_args/backward_args, *_check, forward,
//   backward_workspace_size, backward, set_forward_outputs/set_backward_outputs.
#pragma once

#include <string>
#include <vector>

#include <numeric>

#include "backends/tensorflow/tf_binding.h"
#include "backends/tensorflow/xla_kernel.h"
#include "norm/norm.h"

namespace fusedlayers::tf_binding {

// The forward's shape function: y like x, then `stats` outputs of x's leading (unnormalized)
// dims.
template <int stats>
absl::Status NormShape(InferenceContext* c) {
  std::vector<int64_t> normalized_shape;
  TF_RETURN_IF_ERROR(c->GetAttr("normalized_shape", &normalized_shape));
  const int k = static_cast<int>(normalized_shape.size());
  ShapeHandle x = c->input(0), lead = c->UnknownShape();
  if (c->RankKnown(x)) {
    TF_RETURN_IF_ERROR(c->WithRankAtLeast(x, k, &x));
    TF_RETURN_IF_ERROR(c->Subshape(x, 0, c->Rank(x) - k, &lead));
  }
  c->set_output(0, x);
  for (int i = 1; i <= stats; ++i) c->set_output(i, lead);
  return absl::OkStatus();
}

// The backward's: dx like x (input 1), then each parameter's gradient like the parameter
// (inputs `first_param`, ...).
template <int first_param>
absl::Status NormGradShape(InferenceContext* c) {
  c->set_output(0, c->input(1));
  for (int i = 1; i < c->num_outputs(); ++i) c->set_output(i, c->input(first_param + i - 1));
  return absl::OkStatus();
}

// The attributes of both passes: normalized_shape, which parameters are present, the option.
template <typename Op>
struct NormAttrs {
  std::vector<int64_t> normalized_shape;
  bool has_weight = false, has_bias = false, option = false;

  explicit NormAttrs(::tensorflow::OpKernelConstruction* ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("normalized_shape", &normalized_shape));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_weight", &has_weight));
    if (Op::kHasBias) OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias));
    OP_REQUIRES_OK(ctx, ctx->GetAttr(Op::kOption, &option));
  }
  Sizes shape() const {
    return {normalized_shape.data(), static_cast<int64_t>(normalized_shape.size())};
  }
  // The leading dims of x before the normalized ones (csrc checked x's trailing dims).
  ::tensorflow::TensorShape stats_shape(const Tensor& x) const {
    ::tensorflow::TensorShape s;
    for (int d = 0; d < x.dims() - static_cast<int>(normalized_shape.size()); ++d)
      s.AddDim(x.dim_size(d));
    return s;
  }
};

// The csrc entry points of a norm op, as its traits struct names them.
template <auto kForwardCheck, auto kForward, auto kBackwardCheck, auto kWorkspaceSize,
          auto kBackward>
struct NormCalls {
  static constexpr auto forward_check = kForwardCheck;
  static constexpr auto forward = kForward;
  static constexpr auto backward_check = kBackwardCheck;
  static constexpr auto backward_workspace_size = kWorkspaceSize;
  static constexpr auto backward = kBackward;
};

// Inputs x, weight[, bias]; outputs y and Op::kStats statistics (dtype attribute U).
template <typename Op, bool kGpu>
class NormForwardOp : public ::tensorflow::OpKernel {
 public:
  explicit NormForwardOp(::tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &stat_dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Ref xr(x), weight(ctx->input(1), attrs_.has_weight);
    const Ref bias(ctx->input(Op::kHasBias ? 2 : 1), attrs_.has_bias);
    auto a = Op::forward_args(*xr, attrs_.shape(), *weight, *bias, eps_, attrs_.option);
    RowsCols rc;
    if (!call_csrc(ctx, [&] { rc = Op::forward_check(a); })) return;
    OP_REQUIRES(ctx, to_dtype(stat_dtype_) == norm_stat_dtype(a.x.dtype),
                absl::InvalidArgumentError(
                    std::string("fusedlayers.") + Op::kName + ": U (the statistics dtype) must be " +
                    dtype_name(norm_stat_dtype(a.x.dtype)) + " for x of " + dtype_name(a.x.dtype)));
    Tensor* y;
    Tensor* stats[Op::kStats];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    for (int i = 0; i < Op::kStats; ++i)
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1 + i, attrs_.stats_shape(x), &stats[i]));
    a.y = mutable_ptr(y);
    void* stat_ptrs[Op::kStats];
    for (int i = 0; i < Op::kStats; ++i) stat_ptrs[i] = mutable_ptr(stats[i]);
    Op::set_stats(a, stat_ptrs);
    call_csrc(ctx, [&] { Op::forward(a, rc, exec_for<kGpu>(ctx)); });
  }

 private:
  NormAttrs<Op> attrs_;
  float eps_;
  ::tensorflow::DataType stat_dtype_;
};

// Inputs dy, x, the Op::kStats statistics, weight[, bias]; outputs dx, dweight[, dbias] (empty
// where the parameter is absent).
template <typename Op, bool kGpu>
class NormBackwardOp : public ::tensorflow::OpKernel {
 public:
  explicit NormBackwardOp(::tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    constexpr int kWeight = 2 + Op::kStats;
    const Tensor& x = ctx->input(1);
    const Ref dy(ctx->input(0)), xr(x), stat0(ctx->input(2)), stat1(ctx->input(1 + Op::kStats));
    const Ref weight(ctx->input(kWeight), attrs_.has_weight);
    const Ref bias(ctx->input(Op::kHasBias ? kWeight + 1 : kWeight), attrs_.has_bias);
    auto a = Op::backward_args(*dy, *xr, *stat0, *stat1, attrs_.shape(), *weight, *bias,
                               attrs_.option);
    const Exec exec = exec_for<kGpu>(ctx);
    RowsCols rc;
    size_t bytes = 0;
    if (!call_csrc(ctx, [&] {
          rc = Op::backward_check(a);
          bytes = Op::backward_workspace_size(a, rc, exec);
        }))
      return;
    Tensor* outputs[3];
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &outputs[0]));
    for (int i = 1; i < (Op::kHasBias ? 3 : 2); ++i)
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, ctx->input(kWeight + i - 1).shape(),
                                               &outputs[i]));
    a.workspace = allocate_workspace(ctx, bytes, &workspace);
    if (!ctx->status().ok()) return;
    a.dx = mutable_ptr(outputs[0]);
    a.dweight = mutable_ptr(outputs[1]);
    if constexpr (Op::kHasBias) a.dbias = mutable_ptr(outputs[2]);
    call_csrc(ctx, [&] { Op::backward(a, rc, exec); });
  }

 private:
  NormAttrs<Op> attrs_;
};

// The XLA kernels: the custom calls fusedlayers_<op>_forward / _backward (backends/xla) with
// the TF op's attributes.
template <typename Op>
XlaAttributes norm_xla_attributes(OpKernelConstruction* ctx, bool forward) {
  const NormAttrs<Op> attrs(ctx);
  XlaAttributes a;
  a.i64s("normalized_shape", attrs.normalized_shape).boolean("has_weight", attrs.has_weight);
  if (Op::kHasBias) a.boolean("has_bias", attrs.has_bias);
  a.boolean(Op::kOption, attrs.option);
  if (forward) {
    float eps = 0;
    if (const auto status = ctx->GetAttr("eps", &eps); !status.ok()) ctx->CtxFailure(status);
    a.f32("eps", eps);
  }
  return a;
}

// The product of input `i`'s last k dims: the cols of the rows x cols view a norm works on.
inline int64_t normalized_cols(::tensorflow::XlaOpKernelContext* ctx, int i, int64_t k) {
  const auto dims = ctx->InputShape(i).dim_sizes();
  return std::accumulate(dims.end() - std::min<int64_t>(k, dims.size()), dims.end(), int64_t{1},
                         std::multiplies<>());
}

template <typename Op>
int64_t normalized_ndims(OpKernelConstruction* ctx) {
  std::vector<int64_t> shape;
  ctx->GetAttr("normalized_shape", &shape).IgnoreError();  // read again by NormAttrs, checked
  return static_cast<int64_t>(shape.size());
}

template <typename Op>
class NormForwardXla : public XlaCustomCallOp {
 public:
  explicit NormForwardXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, std::string("fusedlayers_") + Op::kName + "_forward",
                        norm_xla_attributes<Op>(ctx, true), results(normalized_ndims<Op>(ctx)),
                        1 + Op::kStats) {}

 private:
  static XlaResults results(int64_t k) {
    return [k](::tensorflow::XlaOpKernelContext* ctx, bool) {
      const int rank = ctx->InputShape(0).dims();
      const auto u = ctx->input_xla_type(0) == xla::F64 ? xla::F64 : xla::F32;
      std::vector<xla::Shape> shapes{input_shape(ctx, 0)};
      for (int i = 0; i < Op::kStats; ++i)
        shapes.push_back(input_shape(ctx, 0, 0, std::max<int>(rank - k, 0), u));
      return shapes;
    };
  }
};

template <typename Op>
class NormBackwardXla : public XlaCustomCallOp {
 public:
  explicit NormBackwardXla(OpKernelConstruction* ctx)
      : XlaCustomCallOp(ctx, std::string("fusedlayers_") + Op::kName + "_backward",
                        norm_xla_attributes<Op>(ctx, false), results(normalized_ndims<Op>(ctx)),
                        Op::kHasBias ? 3 : 2) {}

 private:
  static XlaResults results(int64_t k) {
    return [k](::tensorflow::XlaOpKernelContext* ctx, bool gpu) {
      constexpr int kWeight = 2 + Op::kStats;
      const int64_t cols = normalized_cols(ctx, 1, k);
      std::vector<xla::Shape> shapes{input_shape(ctx, 1), input_shape(ctx, kWeight)};
      if (Op::kHasBias) shapes.push_back(input_shape(ctx, kWeight + 1));
      shapes.push_back(xla_workspace(ctx, gpu, kNormWorkspace, 1, cols));
      return shapes;
    };
  }
};

}  // namespace fusedlayers::tf_binding

// Registers the kernels of the norm op `name` and of its gradient op `name`Grad, from traits Op,
// and their XLA kernels.
#define FUSEDLAYERS_REGISTER_NORM_KERNELS(name, Op)                    \
  template <bool kGpu>                                                 \
  using Op##Forward = ::fusedlayers::tf_binding::NormForwardOp<Op, kGpu>;  \
  template <bool kGpu>                                                 \
  using Op##Backward = ::fusedlayers::tf_binding::NormBackwardOp<Op, kGpu>; \
  FUSEDLAYERS_REGISTER_KERNELS(name, Op##Forward, "T");                \
  FUSEDLAYERS_REGISTER_KERNELS(name "Grad", Op##Backward, "T");        \
  FUSEDLAYERS_REGISTER_XLA_KERNEL(name, ::fusedlayers::tf_binding::NormForwardXla<Op>);        \
  FUSEDLAYERS_REGISTER_XLA_KERNEL(name "Grad", ::fusedlayers::tf_binding::NormBackwardXla<Op>)
