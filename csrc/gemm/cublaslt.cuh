// cuBLASLt matmuls with epilogues, for csrc's CUDA sources (cublaslt.h has the plain GEMM).
// Column-major: a row-major product C = A B is issued as C^T = B^T A^T.
#pragma once

#include <cublasLt.h>

#include "gemm/cublaslt.h"

namespace fusedlayers {

// FP8 operands of cuBLASLt's scaled matmul: their types, scale modes and dequantizing scales
// (A's and B's as cuBLASLt names them).
struct LtFp8 {
  cudaDataType_t a_type, b_type;
  int32_t a_scale_mode, b_scale_mode;  // cublasLtMatmulMatrixScale_t (cuBLASLt >= 12.8)
  const float* a_scale_inv;
  const float* b_scale_inv;
  bool fast_accum;
};

// Column-major D (rows x cols) = op(A) op(B) (+ D when accumulate), ld of D = rows, with an
// optional epilogue; A is a_rows x a_cols as stored (before op), likewise B. bias / aux (ld =
// rows) as the epilogue needs. With fp8, A and B are FP8 and the dtype is D's.
struct LtGemm {
  bool trans_a, trans_b;
  int64_t rows, cols, inner;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  bool accumulate = false;
  const LtFp8* fp8 = nullptr;
};

// Runs g; false when cuBLASLt has no algorithm for it (the caller may try another epilogue).
bool cublaslt_try_matmul(const LtContext& lt, DType dtype, const LtGemm& g);
// Runs g, or fails naming `op` when cuBLASLt has no algorithm for it.
void cublaslt_matmul(const LtContext& lt, DType dtype, const LtGemm& g, const char* op);

}  // namespace fusedlayers
