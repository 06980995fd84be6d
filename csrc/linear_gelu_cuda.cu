// cuBLASLt GEMMs for linear_gelu (plan: linear_gelu.h). Row-major (rows, cols) is column-major
// (cols, rows), so each row-major product C = A B is issued as C^T = B^T A^T.
#include <cublasLt.h>

#include <memory>

#include "cuda_common.cuh"
#include "linear_gelu.h"

namespace fusedlayers {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(std::string(what) + ": " + cublasLtGetStatusString(status));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: fail("linear_gelu: float64 is not supported on CUDA");
  }
}

size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

template <typename T, cublasStatus_t (*Destroy)(T)>
struct Deleter {
  void operator()(T p) const { Destroy(p); }
};
using OpDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                               Deleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               Deleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Pref = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                             Deleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l;
  check(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  return Layout(l);
}

template <typename V>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& value) {
  check(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof(value)),
        "cublasLtMatmulDescSetAttribute");
}

// Column-major D (rows x cols) = op(A) op(B) with an optional epilogue; A is a_rows x a_cols as
// stored (before op), likewise B. bias / aux (ld = rows) as the epilogue needs.
void matmul(const LtContext& lt, DType dtype, bool trans_a, bool trans_b, int64_t rows,
            int64_t cols, int64_t inner, const void* a, int64_t lda, const void* b, int64_t ldb,
            void* d, cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT,
            const void* bias = nullptr, void* aux = nullptr) {
  const cudaDataType_t type = cuda_type(dtype);
  cublasLtMatmulDesc_t raw_op;
  check(cublasLtMatmulDescCreate(&raw_op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  OpDesc op(raw_op);
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSA, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_TRANSB, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias) set(raw_op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  if (aux) {
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    set(raw_op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, rows);
  }
  const Layout la = trans_a ? layout(type, inner, rows, lda) : layout(type, rows, inner, lda);
  const Layout lb = trans_b ? layout(type, cols, inner, ldb) : layout(type, inner, cols, ldb);
  const Layout ld = layout(type, rows, cols, rows);
  cublasLtMatmulPreference_t raw_pref;
  check(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate");
  Pref pref(raw_pref);
  check(cublasLtMatmulPreferenceSetAttribute(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &lt.workspace_size, sizeof(lt.workspace_size)),
        "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(lt.handle, raw_op, la.get(), lb.get(), ld.get(), ld.get(),
                                       raw_pref, 1, &heuristic, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0)
    fail("linear_gelu: cuBLASLt has no algorithm for this GEMM (" + std::to_string(rows) + " x " +
         std::to_string(cols) + " x " + std::to_string(inner) + ", " + dtype_name(dtype) + ")");
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(lt.handle, raw_op, &alpha, a, la.get(), b, lb.get(), &beta, d, ld.get(), d,
                       ld.get(), &heuristic.algo, lt.workspace, lt.workspace_size, lt.stream),
        "cublasLtMatmul");
}

void check_sizes(const char* op, int64_t m, int64_t n, int64_t k) {
  if (m < 0 || n < 0 || k < 0)
    fail(std::string(op) + ": sizes must be >= 0, got m=" + std::to_string(m) +
         " n=" + std::to_string(n) + " k=" + std::to_string(k));
}

}  // namespace

void linear_gelu_forward_cuda(const void* x, const void* w, const void* bias, void* pre, void* y,
                              int64_t m, int64_t n, int64_t k, GeluApprox approx, DType dtype,
                              const LtContext& lt) {
  check_sizes("linear_gelu", m, n, k);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // x W^T is all zeros: no GEMM to run
    cuda::check(cudaMemsetAsync(pre, 0, size_t(m * n) * dtype_size(dtype), lt.stream),
                "cudaMemsetAsync");
    bias_gelu_forward_cuda(pre, bias, pre, y, m, n, approx, dtype, lt.stream);
    return;
  }
  // Row-major pre (m x n) = x W^T is column-major pre^T (n x m) = W x^T: A = W (k x n stored,
  // transposed), B = x (k x m stored).
  // cuBLASLt's GELU_AUX epilogues need the aux leading dimension (n) divisible by 8.
  if (approx == GeluApprox::kTanh && n % 8 == 0) {
    matmul(lt, dtype, true, false, n, m, k, w, k, x, k, y,
           bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX, bias, pre);
  } else {
    matmul(lt, dtype, true, false, n, m, k, w, k, x, k, pre,
           bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias);
    bias_gelu_forward_cuda(pre, nullptr, pre, y, m, n, approx, dtype, lt.stream);
  }
}

size_t linear_gelu_backward_workspace_size_cuda(int64_t m, int64_t n, DType dtype) {
  check_sizes("linear_gelu_backward", m, n, 0);
  const size_t dpre = (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  return dpre + bias_gelu_backward_workspace_size_cuda(m, n, dtype);
}

void linear_gelu_backward_cuda(const void* dy, const void* x, const void* w, const void* pre,
                               void* dx, void* dw, void* dbias, void* workspace, int64_t m,
                               int64_t n, int64_t k, GeluApprox approx, DType dtype,
                               const LtContext& lt) {
  check_sizes("linear_gelu_backward", m, n, k);
  if (!workspace) fail("linear_gelu_backward: workspace is null");
  char* dpre = static_cast<char*>(workspace);
  void* slabs = dpre + (size_t(m * n) * dtype_size(dtype) + 255) / 256 * 256;
  bias_gelu_backward_cuda(dy, pre, dpre, dbias, slabs, m, n, approx, dtype, lt.stream);
  if (k == 0) return;  // dx and dw are empty
  if (m == 0 || n == 0) {  // dpre is empty: dx = 0, dW = 0
    cuda::check(cudaMemsetAsync(dx, 0, size_t(m * k) * dtype_size(dtype), lt.stream), "memset");
    cuda::check(cudaMemsetAsync(dw, 0, size_t(n * k) * dtype_size(dtype), lt.stream), "memset");
    return;
  }
  // dgrad, row-major dx (m x k) = dpre W: column-major dx^T (k x m) = W^T dpre^T, A = W (k x n
  // stored), B = dpre (n x m stored).
  matmul(lt, dtype, false, false, k, m, n, w, k, dpre, n, dx);
  // wgrad, row-major dW (n x k) = dpre^T x: column-major dW^T (k x n) = x^T dpre, A = x (k x m
  // stored), B = dpre (n x m stored, transposed).
  matmul(lt, dtype, false, true, k, n, m, x, k, dpre, n, dw);
}

}  // namespace fusedlayers
