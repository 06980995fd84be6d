// linear_gelu's CUDA passes on cuBLASLt (plan: linear_gelu.h). Row-major (rows, cols) is
// column-major (cols, rows), so each row-major product C = A B is issued as C^T = B^T A^T.
#include "gemm/cublaslt.cuh"
#include "util/cuda_common.cuh"
#include "gemm/linear_gelu.h"

namespace fusedlayers {
namespace {

constexpr const char* kOp = "linear_gelu";

}  // namespace

void linear_gelu_forward_cuda(const LinearGeluForward& a, GemmSizes s, const LtContext& lt) {
  const auto [m, n, k] = s;
  const void *x = a.x.data, *w = a.weight.data;
  const void* bias = a.bias.defined ? a.bias.data : nullptr;
  void *pre = a.pre, *y = a.y;
  const GeluApprox approx = a.approx;
  const DType dtype = a.x.dtype;
  if (m == 0 || n == 0) return;
  void* h = pre ? pre : y;  // the GEMM's output when the GELU is a separate pass
  if (k == 0) {  // x W^T is all zeros: no GEMM to run
    cuda::check(cudaMemsetAsync(h, 0, size_t(m * n) * dtype_size(dtype), lt.stream),
                "cudaMemsetAsync");
    linear_gelu_epilogue_forward_cuda(h, bias, pre, y, m, n, approx, dtype, lt.stream);
    return;
  }
  // Row-major pre (m x n) = x W^T is column-major pre^T (n x m) = W x^T. B = x (k x m stored);
  // A = W: (out, in) row-major is k x n column-major, transposed; (in, out) is n x k, as is.
  const bool out_in = a.weight_layout == WeightLayout::kOutIn;
  LtGemm g{out_in, false, n, m, k, w, out_in ? k : n, x, k, y};
  // cuBLASLt's GELU_AUX epilogues need the aux leading dimension (n) divisible by 8.
  if (approx == GeluApprox::kTanh && n % 8 == 0) {
    g.bias = bias;
    g.aux = pre;
    g.epilogue = pre ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                     : (bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU);
    if (cublaslt_try_matmul(lt, dtype, g)) return;
  }
  g.d = h;
  g.aux = nullptr;
  g.bias = bias;
  g.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  cublaslt_matmul(lt, dtype, g, kOp);
  linear_gelu_epilogue_forward_cuda(h, nullptr, nullptr, y, m, n, approx, dtype, lt.stream);  // h holds pre
}

size_t linear_gelu_backward_workspace_size_cuda(GemmSizes s, DType dtype) {
  const int64_t m = s.m, n = s.n;
  const size_t dpre = (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  return dpre + linear_gelu_epilogue_backward_workspace_size_cuda(m, n, dtype);
}

void linear_gelu_backward_cuda(const LinearGeluBackward& a, GemmSizes s, const LtContext& lt) {
  const auto [m, n, k] = s;
  const void *dy = a.dy.data, *x = a.x.data, *w = a.weight.data, *pre = a.pre.data;
  void *dx = a.dx, *dw = a.dweight, *workspace = a.workspace;
  void* dbias = a.has_bias ? a.dbias : nullptr;
  const GeluApprox approx = a.approx;
  const DType dtype = a.x.dtype;
  if (n > 0 && !workspace) fail("linear_gelu_backward: workspace is null");  // 0 bytes if n = 0
  char* dpre = static_cast<char*>(workspace);
  void* slabs = dpre + (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  linear_gelu_epilogue_backward_cuda(dy, pre, dpre, dbias, slabs, m, n, approx, dtype, lt.stream);
  if (k == 0) return;  // dx and dw are empty
  if (m == 0 || n == 0) {  // dpre is empty: dx = 0, dW = 0
    cuda::check(cudaMemsetAsync(dx, 0, size_t(m * k) * dtype_size(dtype), lt.stream), "memset");
    cuda::check(cudaMemsetAsync(dw, 0, size_t(n * k) * dtype_size(dtype), lt.stream), "memset");
    return;
  }
  const bool out_in = a.weight_layout == WeightLayout::kOutIn;
  // dgrad, row-major dx (m x k) = dpre W: column-major dx^T (k x m) = W^T dpre^T, B = dpre (n x m
  // stored); A = W^T: (out, in) row-major is k x n column-major as is; (in, out) is n x k,
  // transposed.
  cublaslt_matmul(lt, dtype, {!out_in, false, k, m, n, w, out_in ? k : n, dpre, n, dx}, kOp);
  if (out_in) {
    // wgrad, row-major dW (n x k) = dpre^T x: column-major dW^T (k x n) = x^T dpre, A = x (k x m
    // stored), B = dpre (n x m stored, transposed).
    cublaslt_matmul(lt, dtype, {false, true, k, n, m, x, k, dpre, n, dw}, kOp);
  } else {
    // wgrad in W's (in, out) layout, row-major dW^T (k x n): column-major dW (n x k) = dpre^T x,
    // A = dpre (n x m stored), B = x (k x m stored, transposed).
    cublaslt_matmul(lt, dtype, {false, true, n, k, m, dpre, n, x, k, dw}, kOp);
  }
}

}  // namespace fusedlayers
