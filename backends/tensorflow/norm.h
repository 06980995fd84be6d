// Glue shared by the TF bindings of the norm ops (layer_norm.cc, rms_norm.cc): the statistics'
// shape and dtype.
#pragma once

#include <string>

#include "backends/tensorflow/binding.h"
#include "csrc/norm.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace fusedlayers {
namespace tf_binding {

// Shape function part: the leading (unnormalized) dims of input 0, for mean and rstd.
inline absl::Status StatsShape(::tensorflow::shape_inference::InferenceContext* c,
                               ::tensorflow::shape_inference::ShapeHandle* out) {
  int norm_ndims;
  TF_RETURN_IF_ERROR(c->GetAttr("norm_ndims", &norm_ndims));
  ::tensorflow::shape_inference::ShapeHandle x = c->input(0);
  if (!c->RankKnown(x)) {
    *out = c->UnknownShape();
    return absl::OkStatus();
  }
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(x, norm_ndims, &x));
  return c->Subshape(x, 0, c->Rank(x) - norm_ndims, out);
}

// The leading dims of x before its last norm_ndims (checked by csrc first).
inline ::tensorflow::TensorShape stats_shape(const Tensor& x, int norm_ndims) {
  ::tensorflow::TensorShape s;
  for (int d = 0; d < x.dims() - norm_ndims; ++d) s.AddDim(x.dim_size(d));
  return s;
}

// OK unless the op's statistics dtype attribute U differs from what csrc writes for x.
inline absl::Status check_stat_dtype(const char* op, ::tensorflow::DataType u, DType x) {
  if (to_dtype(u) == norm_stat_dtype(x)) return absl::OkStatus();
  return absl::InvalidArgumentError(std::string("fusedlayers.") + op +
                                    ": U (the statistics dtype) must be " +
                                    dtype_name(norm_stat_dtype(x)) + " for x of " +
                                    dtype_name(x));
}

}  // namespace tf_binding
}  // namespace fusedlayers
