// cuBLASLt GEMMs for csrc's CUDA paths that run their own: linear_gelu's GEMMs with their
// epilogues (cublaslt.cuh), and gemm.h's FrameworkGemm for a binding whose framework lends csrc
// no GEMM (XLA: linear_cross_entropy's chunk loop). Products of float32, float16 and bfloat16
// operands accumulate in float32 (no TF32); float64 is not supported. No CUDA header: CPU builds
// include this too.
//
// Plans (matmul descriptor, matrix layouts, heuristic algorithm) are cached per host thread,
// keyed by device, sizes, layouts, dtype, epilogue, pointer alignments and workspace size: the
// heuristic query costs tens of microseconds, which a small layer cannot hide.
#pragma once

#include <cstddef>

#include "common.h"
#include "gemm.h"

typedef struct cublasLtContext* cublasLtHandle_t;  // as cublasLt.h declares it

namespace fusedlayers {

// The cuBLASLt handle and workspace come from the caller (the framework's, reused across calls).
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  cudaStream_t stream = nullptr;
};

// For a binding whose framework lends no cuBLASLt handle and workspace (XLA): one handle for the
// process, created on first use and kept for its life, and the workspace to give it (cuBLAS'
// recommended size on Hopper).
cublasLtHandle_t cublaslt_process_handle();
constexpr size_t kCublasLtWorkspaceBytes = size_t(32) << 20;

// gemm.h's contract on cuBLASLt, on lt's stream; `op` names the calling op in errors (an Error
// where cuBLASLt has no algorithm for a GEMM, or for float64).
FrameworkGemm cublaslt_gemm(const LtContext& lt, const char* op);

}  // namespace fusedlayers
