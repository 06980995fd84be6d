// Row normalization kernels shared by the LayerNorm and RMSNorm ops (csrc/norm/layer_norm.h,
// csrc/norm/rms_norm.h check the arguments and call these). Over the last `cols` elements of a
// rows x cols row-major view, with gamma = weight + gamma_offset (1 where weight is absent):
//
// NormMode::kLayer (Ba, Kiros, Hinton 2016, "Layer Normalization", arXiv:1607.06450):
//   mean = sum_j x_j / cols,  var = sum_j (x_j - mean)^2 / cols  (biased, as torch and Keras)
//   rstd = 1 / sqrt(var + eps),  xhat = (x - mean) * rstd,  y = xhat * gamma + beta
//   backward, with g = dy * gamma:
//   dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat)),  dgamma = sum_rows dy * xhat,
//   dbeta = sum_rows dy
//
// NormMode::kRms (Zhang, Sennrich 2019, "Root Mean Square Layer Normalization",
// arXiv:1910.07467; torch.nn.RMSNorm): no mean, no beta:
//   rstd = 1 / sqrt(sum_j x_j^2 / cols + eps),  xhat = x * rstd,  y = xhat * gamma
//   dx = rstd * (g - xhat * mean_j(g * xhat)),  dgamma = sum_rows dy * xhat
//
// NormMode::kKerasRmsScaling (keras.layers.LayerNormalization(rms_scaling=True), whose code
// scales by the centered variance and adds no beta): rstd as kLayer, y = x * rstd * gamma, and
//   dx = rstd * (g - (x - mean) * rstd^2 * mean_j(g * x)),  dgamma = sum_rows dy * x * rstd
//
// Dtypes: x, y, dy, dx share `dtype` (float32, float64, float16, bfloat16). gamma/beta/dgamma/
// dbeta share `param_dtype`: `dtype`, or float32 for float16/bfloat16 x. mean/rstd are float32
// (float64 when dtype is float64). Statistics and sums accumulate in float32 (float64 for
// float64). The variance is taken in two passes over the row, so no cancellation and no padding
// terms enter it. gamma_offset (0, or 1 for a zero-centred gain as Gemma's) is added in the
// accumulation type, so 1 + weight is not rounded to a 16-bit weight's precision.
#pragma once

#include <cstddef>

#include "util/common.h"

namespace fusedlayers {

enum class NormMode { kLayer, kRms, kKerasRmsScaling };

// mean/rstd dtype for x of `dtype`.
inline DType norm_stat_dtype(DType dtype) {
  return dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// x, y: rows x cols; gamma, beta: cols or nullptr (beta only with kLayer); mean: rows, or nullptr
// (never written with kRms, where it would be 0); rstd: rows. rows >= 0, cols >= 1.
struct NormForwardArgs {
  const void* x;
  const void* gamma;
  const void* beta;
  void* y;
  void* mean;
  void* rstd;
  int64_t rows, cols;
  double eps;
  float gamma_offset;
  NormMode mode;
  DType dtype, param_dtype;
  // The add+norm forward: residual (rows x cols, residual_dtype) or nullptr; h like residual.
  const void* residual = nullptr;
  void* h = nullptr;
  DType residual_dtype = DType::kFloat32;
};

// saved: x, or y when `saved_is_output` (Apex's memory_efficient mode, kLayer only: xhat =
// (y - beta) / gamma, which requires gamma to have no zeros); mean is read only by kLayer and
// kKerasRmsScaling from x. dgamma (dbeta) may be nullptr when gamma (beta) is absent; they are
// fully written otherwise, also for rows == 0. workspace: norm_backward_workspace_size_*() bytes
// when dgamma or dbeta is requested. The result does not depend on how the work is split.
struct NormBackwardArgs {
  const void* dy;
  const void* saved;
  const void* mean;
  const void* rstd;
  const void* gamma;
  const void* beta;
  void* dx;
  void* dgamma;
  void* dbeta;
  void* workspace;
  int64_t rows, cols;
  float gamma_offset;
  bool saved_is_output;
  NormMode mode;
  DType dtype, param_dtype;
  // The add+norm backward (`add`): saved is h, of residual_dtype; dh (like h) may be nullptr;
  // dresidual (like h) is written where residual_dtype is not dtype and must be nullptr where
  // it is (dx then holds it).
  bool add = false;
  const void* dh = nullptr;
  void* dresidual = nullptr;
  DType residual_dtype = DType::kFloat32;
};

// The device kernels; callers use norm_forward / norm_backward below, which check the
// arguments both devices share.
void norm_forward_cpu(const NormForwardArgs& a, const ParallelFor& parallel_for);
size_t norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype);
void norm_backward_cpu(const NormBackwardArgs& a, const ParallelFor& parallel_for);

// CUDA: the same contract on device pointers, launched on `stream` of the current device, for
// float32/float16/bfloat16 x (float64 is CPU only). Rows are held in registers and split over a
// warp or a block by width (see the table in norm_cuda.cu); dgamma/dbeta come from per-group
// partials in the workspace reduced in a fixed order, so repeated runs are bitwise equal.
void norm_forward_cuda(const NormForwardArgs& a, cudaStream_t stream);
size_t norm_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype);
void norm_backward_cuda(const NormBackwardArgs& a, cudaStream_t stream);

// Whether parameters of param_dtype go with x of dtype: x's dtype, or float32 for float16 and
// bfloat16 x. The one statement of the rule: the op checks and the passes below use it.
bool norm_param_dtype_ok(DType dtype, DType param_dtype);

// The pass on exec's device: CPU or CUDA (an Error when built without CUDA).
void norm_forward(const NormForwardArgs& a, const Exec& exec);
size_t norm_backward_workspace_size(int64_t rows, int64_t cols, DType dtype, const Exec& exec);
void norm_backward(const NormBackwardArgs& a, const Exec& exec);

// Argument checks shared by the norm ops; messages name `op` and its arguments.
// x's trailing dims equal normalized_shape (non-empty, positive sizes).
RowsCols check_norm_input(const char* op, const TensorRef& x, Sizes normalized_shape);
// A parameter (`arg`, if defined) of shape normalized_shape, x's dtype or float32 for half.
void check_norm_param(const char* op, const char* arg, const TensorRef& param,
                      const TensorRef& x, Sizes normalized_shape);
// Two defined parameters share a dtype.
void check_same_param_dtype(const char* op, const TensorRef& weight, const TensorRef& bias);
void check_eps(const char* op, double eps);
// dy like saved; rstd (and mean when `with_mean`) hold rows values of the stat dtype.
void check_norm_backward(const char* op, const TensorRef& dy, const TensorRef& saved,
                         const TensorRef& mean, const TensorRef& rstd, int64_t rows,
                         bool with_mean);
// The dtype of the parameters: weight's, bias', or x's when neither is defined.
DType norm_param_dtype(const TensorRef& x, const TensorRef& weight, const TensorRef& bias);

}  // namespace fusedlayers
