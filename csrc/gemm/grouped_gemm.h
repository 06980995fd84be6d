// Grouped GEMM: the experts' products of a mixture-of-experts layer, each group (expert) g
// multiplying its own contiguous rows by its own weight W_g = weight[g] (Shazeer et al. 2017,
// arXiv:1701.06538; the dropless grouped form of MegaBlocks, Gale et al. 2022, arXiv:2211.15841).
// The groups' row ends are int32 `offsets` (moe_permute's): group g owns the rows
// [offsets[g - 1], offsets[g]) (offsets[-1] = 0), read where the pass runs (on the device on
// CUDA: no host sync, safe under CUDA graph capture and XLA command buffers).
//   forward  (fprop): y[rows of g]  = x[rows of g] @ W_g
//   backward (dgrad): dx[rows of g] = dy[rows of g] @ W_g^T
//            (wgrad): dW_g = x[rows of g]^T @ dy[rows of g]   (zeros for a group with no rows)
// W_g is (n, k), nn.Linear's (out, in), or (k, n) with `transposed` (transformers'
// is_transposed experts), and dweight has weight's layout. Rows past offsets[num_groups - 1]
// (routed pairs that reach no expert) get zeros in y and dx. Offsets must be row ends: none
// negative, none before the one before it, none past rows. Where they are in host memory (the
// CPU passes; a binding that copies them to the device, grouped_gemm_offsets_to_device) they are
// checked (grouped_gemm_offsets_check: an Error of kind kValue naming offsets); on the device
// they are read by the kernels, which clamp them to [0, rows] and each to at least the one
// before it, so invalid offsets there give wrong values but never a read or write outside the
// tensors.
//
// Products accumulate in float32 (float64 for float64) and are rounded once to x's dtype;
// deterministic (no split over k: a product's sum has one order). The contract, for every
// binding: x (rows, k), dy and y (rows, n), weight (num_groups, n, k) or transposed
// (num_groups, k, n), one dtype (float32, float64, float16, bfloat16), contiguous; offsets
// (num_groups) int32; rows < 2^31. Errors: Error of kind kType for dtypes, kValue otherwise,
// naming grouped_gemm or grouped_gemm_backward.
//
// On CUDA the products run on CUTLASS's Hopper grouped GEMM (grouped_gemm_sm90.h) where it
// takes them (grouped_gemm_cuda_path: sm90, bfloat16, k and n multiples of 8, 16-byte aligned
// pointers, and a build with CUTLASS's headers), else on a plain tiled kernel (any GPU, dtype,
// size and alignment; slower); on the CPU a loop over each group's rows.
#pragma once

#include "util/common.h"
#include "moe/moe.h"

namespace fusedlayers {

// The checked geometry: x (rows, k), y (rows, n), num_groups weights.
struct GroupedGemmShape {
  int64_t rows = 0, k = 0, n = 0, groups = 0;
};

struct GroupedGemmForward {
  TensorRef x, weight;
  IndexRef offsets;  // (num_groups) int32
  bool transposed = false;
  void* y = nullptr;          // (rows, n), x's dtype
  void* workspace = nullptr;  // grouped_gemm_workspace_size bytes
};

struct GroupedGemmBackward {
  TensorRef dy, x, weight;
  IndexRef offsets;
  bool transposed = false;
  void* dx = nullptr;       // (rows, k), or null: not wanted
  void* dweight = nullptr;  // weight's shape, or null: not wanted
  void* workspace = nullptr;
};

GroupedGemmShape grouped_gemm_forward_check(const GroupedGemmForward& a);
GroupedGemmShape grouped_gemm_backward_check(const GroupedGemmBackward& a);

// Bytes of workspace a pass needs on exec's device (0 on the CPU).
size_t grouped_gemm_workspace_size(const GroupedGemmShape& s, DType dtype, const Exec& exec);
// Run the pass on exec's device; the arguments must have passed their check.
void grouped_gemm_forward(const GroupedGemmForward& a, const GroupedGemmShape& s,
                          const Exec& exec);
void grouped_gemm_backward(const GroupedGemmBackward& a, const GroupedGemmShape& s,
                           const Exec& exec);

// Which CUDA kernels take operands of this dtype and shape on a GPU of compute capability
// `arch` (major * 10 + minor), with aligned pointers; what `info` and the frameworks' choice of
// path read.
enum class GroupedGemmPath { kSm90, kTiled };
GroupedGemmPath grouped_gemm_cuda_path(DType dtype, const GroupedGemmShape& s, int arch);
// Whether this build has the Hopper kernels (CUTLASS's headers were found at build time).
bool grouped_gemm_sm90_built();

// One product D_g = A_g B_g of every group, on either device, with elementwise strides: A_g
// (m x k) at a + a_base(g) with element (i, p) at i * a_m + p * a_k, B_g (k x n) at b_base(g)
// with (p, j) at p * b_k + j * b_n, D_g (m x n) row-major at d_base(g). ragged_m: m_g is the
// group's row count and a_base/d_base advance by rows; else k_g is (the wgrad).
struct GroupedProduct {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const int32_t* offsets = nullptr;
  int64_t groups = 0, rows = 0, m = 0, n = 0, k = 0;
  int64_t a_m = 0, a_k = 0, b_k = 0, b_n = 0;
  bool ragged_m = true;
};

// Each pass's products: fprop y = x W_g, dgrad dx = dy W_g^T, wgrad dW_g in weight's layout.
GroupedProduct grouped_gemm_fprop(const GroupedGemmForward& a, const GroupedGemmShape& s);
GroupedProduct grouped_gemm_dgrad(const GroupedGemmBackward& a, const GroupedGemmShape& s);
GroupedProduct grouped_gemm_wgrad(const GroupedGemmBackward& a, const GroupedGemmShape& s);

void grouped_product_cpu(const GroupedProduct& p, DType dtype, const ParallelFor& parallel_for);
void grouped_gemm_forward_cuda(const GroupedGemmForward& a, const GroupedGemmShape& s,
                               cudaStream_t stream);
void grouped_gemm_backward_cuda(const GroupedGemmBackward& a, const GroupedGemmShape& s,
                                cudaStream_t stream);
size_t grouped_gemm_workspace_size_cuda(const GroupedGemmShape& s, DType dtype);
// Raises an Error of kind kValue naming op's offsets unless the `groups` host-memory offsets
// are row ends of `rows` rows (above).
void grouped_gemm_offsets_check(const char* op, const int32_t* offsets, int64_t groups,
                                int64_t rows);
// Checks (grouped_gemm_offsets_check) and copies `groups` offsets from host memory to `device`
// on `stream`, for a binding whose framework keeps int32 inputs of GPU ops on the host
// (TensorFlow).
void grouped_gemm_offsets_to_device(const char* op, int32_t* device, const int32_t* host,
                                    int64_t groups, int64_t rows, cudaStream_t stream);

}  // namespace fusedlayers
