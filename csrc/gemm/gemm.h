// The GEMMs that ops hand back to their framework: an operand as a view of a contiguous
// row-major buffer, and the callback a binding supplies.
#pragma once

#include <functional>

#include "util/common.h"

namespace fusedlayers {

// A rows x cols matrix of a contiguous row-major buffer, stored as it is or, when `transposed`,
// as its cols x rows transpose.
struct Matrix {
  const void* data;
  int64_t rows, cols;
  bool transposed;
};

// c = a @ b, or c += a @ b when accumulate, in `dtype` (c: a.rows x b.cols, contiguous
// row-major), by the framework's GEMM on the op's device and stream.
using FrameworkGemm = std::function<void(const Matrix& a, const Matrix& b, void* c, DType dtype,
                                         bool accumulate)>;

}  // namespace fusedlayers
