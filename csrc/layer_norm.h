// Layer normalization over the last `cols` elements of a rows x cols row-major view
// (Ba, Kiros, Hinton 2016, "Layer Normalization", arXiv:1607.06450):
//
//   mean = sum_j x_j / cols,  var = sum_j (x_j - mean)^2 / cols  (biased, as torch and Keras)
//   rstd = 1 / sqrt(var + eps),  xhat = (x - mean) * rstd,  y = xhat * gamma + beta
//
// Backward, with g = dy * gamma (dy where gamma is absent):
//   dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))
//   dgamma = sum_rows dy * xhat,  dbeta = sum_rows dy
//
// With subtract_mean = false (Keras' LayerNormalization(rms_scaling=True), whose code scales by
// the centered variance and adds no beta): y = x * rstd * gamma, and
//   dx = rstd * (g - xhat * rstd * mean_j(g * x)),  dgamma = sum dy * x * rstd
//
// Dtypes: x, y, dy, dx share `dtype` (float32, float64, float16, bfloat16). gamma/beta/dgamma/dbeta
// share `param_dtype`, which is `dtype`, or float32 for float16/bfloat16 x. mean/rstd are float32 (float64 when dtype is
// float64). Statistics and sums accumulate in float32 (float64 for float64). The variance is taken
// in two passes over the row, so no cancellation and no padding terms enter it.
#pragma once

#include <cstddef>

#include "common.h"

namespace fusedlayers {

// x, y: rows x cols; gamma, beta: cols or nullptr; mean, rstd: rows. rows >= 0, cols >= 1.
void layer_norm_forward_cpu(const void* x, const void* gamma, const void* beta, void* y,
                            void* mean, void* rstd, int64_t rows, int64_t cols, double eps,
                            bool subtract_mean, DType dtype, DType param_dtype,
                            const ParallelFor& parallel_for);

// Bytes of workspace layer_norm_backward_cpu needs: per-chunk partial dgamma/dbeta sums.
size_t layer_norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype);

// saved: x, or y when `saved_is_output` (Apex's memory_efficient mode: xhat = (y - beta) / gamma,
// which requires gamma to have no zeros; not with subtract_mean = false). mean is unused when
// saved_is_output.
// dgamma (dbeta) may be nullptr when gamma (beta) is absent; they are fully written otherwise,
// also for rows == 0. The result does not depend on how parallel_for splits the work.
void layer_norm_backward_cpu(const void* dy, const void* saved, const void* mean,
                             const void* rstd, const void* gamma, const void* beta, void* dx,
                             void* dgamma, void* dbeta, void* workspace, int64_t rows,
                             int64_t cols, bool saved_is_output, bool subtract_mean, DType dtype,
                             DType param_dtype, const ParallelFor& parallel_for);

// CUDA: the same contract on device pointers, launched on `stream` of the current device, for
// float32/float16/bfloat16 x (float64 is CPU only). Rows are held in registers and split over a
// warp or a block by width (see the table in layer_norm_cuda.cu); dgamma/dbeta come from per-group
// partials in the workspace reduced in a fixed order, so repeated runs are bitwise equal.
void layer_norm_forward_cuda(const void* x, const void* gamma, const void* beta, void* y,
                             void* mean, void* rstd, int64_t rows, int64_t cols, double eps,
                             bool subtract_mean, DType dtype, DType param_dtype,
                             cudaStream_t stream);

size_t layer_norm_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype);

void layer_norm_backward_cuda(const void* dy, const void* saved, const void* mean,
                              const void* rstd, const void* gamma, const void* beta, void* dx,
                              void* dgamma, void* dbeta, void* workspace, int64_t rows,
                              int64_t cols, bool saved_is_output, bool subtract_mean,
                              DType dtype, DType param_dtype, cudaStream_t stream);

}  // namespace fusedlayers
