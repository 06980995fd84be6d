// The grouped GEMM's Hopper kernels (CUTLASS's sm90 ptr-array grouped GEMM, bfloat16 in,
// float32 accumulation, bfloat16 out), one instantiation per operand layout, each in a file of its
// own (grouped_gemm_sm90_<layout>.cu, compiled for sm_90a only: wgmma and TMA). Declared here
// without CUTLASS's headers for grouped_gemm_cuda.cu, which calls them where
// grouped_gemm_sm90_takes() holds (grouped_gemm.h has the math).
//
// Group g's problem is D_g = A_g B_g over the rows [start_g, end_g) of the ragged dimension,
// start_g = offsets[g - 1] (0 for g = 0) and end_g = offsets[g], both clamped to [0, rows]:
//   kRowsNK (ragged M, fprop of (E, N, K) weights, dgrad of (E, K, N) ones):
//     A = a[start_g:end_g] (row-major, rows x k), B_g = b[g] stored (n, k), D = d[start_g:end_g];
//   kRowsKN (ragged M, fprop of (E, K, N) weights, dgrad of (E, N, K) ones):
//     the same with B_g = b[g] stored (k, n);
//   kWgrad (ragged K, the weights' gradient): A_g = a[start_g:end_g]^T (a: rows x m),
//     B_g = b[start_g:end_g] (rows x n), D_g = d[g] (m x n, row-major); a group with no rows gets
//     no tiles (the caller writes its zeros).
// The problem sizes, pointers and strides are written on the device by a one-thread-per-group
// kernel into the workspace: no host sync, safe under CUDA graph capture.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace fusedlayers {

enum class Sm90Layout { kRowsNK, kRowsKN, kWgrad };

struct Sm90GroupedGemm {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const int32_t* offsets = nullptr;  // (groups), device
  int64_t groups = 0, rows = 0;      // rows: the ragged dimension's total
  int64_t m = 0, n = 0, k = 0;       // the fixed dimensions (m unused for ragged M, k for kWgrad)
  void* workspace = nullptr;         // grouped_gemm_sm90_workspace_size bytes, 256-byte aligned
};

// Bytes of workspace for `groups` groups on the current device (its SM count sizes CUTLASS's
// per-SM TMA descriptors).
template <Sm90Layout L>
size_t grouped_gemm_sm90_workspace_size(int64_t groups);

// Enqueues the grouped GEMM on `stream`; throws Error where CUTLASS refuses the problem.
template <Sm90Layout L>
void grouped_gemm_sm90(const Sm90GroupedGemm& a, cudaStream_t stream);

}  // namespace fusedlayers
