// CPU FP8 gated activations: the definition fp8_gated.h states, literally: the gated kernel's
// rounded values into a buffer, then the quantize kernel over them.
#include <cstring>
#include <vector>

#include "fp8/fp8_gated.h"

namespace fusedlayers {
namespace {

void quantize(const Fp8Target& out, const void* values, DType dtype, int64_t rows, int64_t cols,
              const ParallelFor& parallel_for) {
  Fp8Quantize q;
  static_cast<Fp8Target&>(q) = out;
  q.x.data = const_cast<void*>(values);
  q.x.dtype = dtype;
  fp8_quantize_cpu(q, rows, cols, parallel_for);
}

}  // namespace

void fp8_gated_forward_cpu(const Fp8GatedForward& a, int64_t gs, int64_t us, RowsCols rc,
                           const ParallelFor& parallel_for) {
  const DType dtype = a.gate.t.dtype;
  std::vector<unsigned char> y(size_t(rc.rows * rc.cols) * dtype_size(dtype));
  gated_forward_cpu(a.gate.t.data, gs, a.up.t.data, us, y.data(), rc.rows, rc.cols, a.activation,
                    dtype, parallel_for);
  quantize(a.out, y.data(), dtype, rc.rows, rc.cols, parallel_for);
}

void fp8_gated_backward_cpu(const Fp8GatedBackward& a, int64_t gs, int64_t us, RowsCols rc,
                            const ParallelFor& parallel_for) {
  const DType dtype = a.gate.t.dtype;
  const size_t row_bytes = size_t(rc.cols) * dtype_size(dtype);
  std::vector<unsigned char> dgate(rc.rows * row_bytes), dup(rc.rows * row_bytes);
  gated_backward_cpu(a.dy.data, a.gate.t.data, gs, a.up.t.data, us, dgate.data(), dup.data(),
                     rc.rows, rc.cols, a.activation, dtype, parallel_for);
  std::vector<unsigned char> both(2 * rc.rows * row_bytes);  // [dgate | dup] rows
  for (int64_t r = 0; r < rc.rows; ++r) {
    std::memcpy(both.data() + 2 * r * row_bytes, dgate.data() + r * row_bytes, row_bytes);
    std::memcpy(both.data() + (2 * r + 1) * row_bytes, dup.data() + r * row_bytes, row_bytes);
  }
  quantize(a.out, both.data(), dtype, rc.rows, 2 * rc.cols, parallel_for);
}

}  // namespace fusedlayers
