// A gated op's gate and up arguments as csrc reads them (activation/gated.h) and their checks,
// shared by the gated activations' binding and their FP8 form's.
#pragma once

#include "backends/torch/torch_binding.h"
#include "activation/gated.h"

namespace fusedlayers::torch_binding {

// A gate or up argument as csrc reads it: in place where its rows are evenly spaced and its
// last dim contiguous (a chunk(2, -1) half of one projection), else a contiguous copy. `keep`
// holds the tensor read.
inline GatedInput gated_input(const at::Tensor& t, at::Tensor& keep) {
  const int64_t d = t.dim();
  keep = t;
  if (d == 0 || t.is_contiguous()) {
    keep = t.contiguous();
    return {ref(keep), 0};
  }
  // The row dims (all but the last) must collapse to one, with stride row_stride.
  int64_t row_stride = -1, inner = 0;  // inner: the stride the next outer dim must have
  bool ok = t.size(d - 1) <= 1 || t.stride(d - 1) == 1;
  for (int64_t i = d - 2; i >= 0 && ok; --i) {
    if (t.size(i) == 1) continue;
    if (row_stride < 0) {
      row_stride = t.stride(i);
      ok = row_stride >= t.size(d - 1);
    } else {
      ok = t.stride(i) == inner;
    }
    inner = t.stride(i) * t.size(i);
  }
  if (!ok) {
    keep = t.contiguous();
    return {ref(keep), 0};
  }
  return {{t.data_ptr(), to_dtype(t.scalar_type()), sizes(t.sizes()), true},
          row_stride < 0 ? 0 : row_stride};
}

// The tensor checks of a gated op's arguments that csrc cannot see (dtypes it does not take,
// devices), naming op: the forward's gate and up, and the backward's dy beside them.
inline void check_gated_args(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_tensors(op, "gate", gate, {});
  check_floating(op, "up", up);
  check_same_device(op, "up", up, "gate", gate);
}
inline void check_gated_backward_args(const char* op, const at::Tensor& dy,
                                      const at::Tensor& gate, const at::Tensor& up) {
  check_tensors(op, "dy", dy, {});
  check_floating(op, "gate", gate);
  check_floating(op, "up", up);
  check_same_device(op, "gate", gate, "dy", dy);
  check_same_device(op, "up", up, "dy", dy);
}

}  // namespace fusedlayers::torch_binding
