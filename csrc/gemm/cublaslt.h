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

#include "util/common.h"
#include "gemm/gemm.h"

typedef struct cublasLtContext* cublasLtHandle_t;  // as cublasLt.h declares it

namespace fusedlayers {

// The handle (cublaslt_handle()) and the workspace (the framework's where it lends one, reused
// across calls).
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  cudaStream_t stream = nullptr;
};

// The current device's handle, created on its first use and kept for the process's life (a
// cuBLASLt handle belongs to the device current at its creation). Not a framework's own handle:
// that may come from another cuBLASLt than the one these calls bind to (a CUDA build of
// TensorFlow loaded first exports cuBLASLt symbols of its own CUDA version, and they bind there),
// and a handle of one cuBLASLt given to another fails or crashes.
cublasLtHandle_t cublaslt_handle();

// The workspace to allocate where the framework lends none (XLA): cuBLAS' recommended size on
// Hopper.
constexpr size_t kCublasLtWorkspaceBytes = size_t(32) << 20;

// gemm.h's contract on cuBLASLt, on lt's stream; `op` names the calling op in errors (an Error
// where cuBLASLt has no algorithm for a GEMM, or for float64).
FrameworkGemm cublaslt_gemm(const LtContext& lt, const char* op);

}  // namespace fusedlayers
