// The CUDA workspace of the handlers' backward passes, for Python to size their `workspace`
// result when it traces a call (XLA allocates every buffer of a custom call). 0 in a build
// without CUDA handlers, and where the CUDA kernels take no such pass (float64).
#include "backends/xla/ffi_binding.h"
#include "gemm/linear_gelu_epilogue.h"
#include "norm/norm.h"

// kind 0: a norm's backward (LayerNorm, RMSNorm), 1: linear_gelu's epilogue backward; rows x
// cols of x (or of the epilogue's input) of csrc DType `dtype`.
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_workspace_size(int kind, int64_t rows, int64_t cols,
                                                             int dtype) {
#ifdef FUSEDLAYERS_WITH_CUDA
  using namespace fusedlayers;
  try {
    const DType t = static_cast<DType>(dtype);
    return kind == 0 ? norm_backward_workspace_size_cuda(rows, std::max<int64_t>(cols, 1), t)
                     : linear_gelu_epilogue_backward_workspace_size_cuda(rows, cols, t);
  } catch (const Error&) {
    return 0;
  }
#else
  (void)kind, (void)rows, (void)cols, (void)dtype;
  return 0;
#endif
}
