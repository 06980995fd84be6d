// Mixture-of-experts token routing: the memory-bound passes around the experts' grouped GEMMs
// (Shazeer et al. 2017, "Outrageously Large Neural Networks", arXiv:1701.06538; the dropless
// layout of MegaBlocks, Gale et al. 2022, arXiv:2211.15841, and of transformers' grouped_mm
// experts). T tokens each go to k experts, top_k_index (T, k); the T * k (token, slot) pairs are
// sorted by expert so that each expert's GEMM reads contiguous rows:
//   route:     row(t, j), the pair's row in expert order, by a stable counting sort (pairs keep
//              their (t, j) order within an expert), and offsets[e], the end of expert e's rows
//              (cumulative counts: grouped_mm's `offs`; ragged_dot's group sizes are their
//              differences). A pair whose expert id is outside [0, num_experts) (an expert-parallel
//              sentinel) reaches no expert: its row comes after every expert's, past offsets[E-1].
//   permute:   xs[row(t, j)] = x[t]  (zeros for a pair that reaches no expert);
//              backward dx[t] = sum_j dxs[row(t, j)] over the pairs that reach an expert.
//   unpermute: out[t] = sum_j w[t, j] ys[row(t, j)] over those pairs (w absent: 1);
//              backward dys[row(t, j)] = w[t, j] dout[t] (zeros for the others),
//              dw[t, j] = <ys[row(t, j)], dout[t]> (0 for the others).
// So the permute's backward is an unpermute without weights and the unpermute's backward a
// permute with them: two kernels, a scatter (token order to expert order) and a gather.
// Sums over j and the dots in float32 (float64 for float64), in a fixed order (j ascending; the
// dots over lanes), one rounding per output: deterministic, no atomics on floats.
//
// The op's contract, for every binding: x, dout (T, H) and xs, ys, dxs (T * k, H) contiguous, of
// one float dtype; weights (T, k), float32 or that dtype; top_k_index (T, k), int32 or int64;
// row_index (T * k) int32 as the route wrote it (a row outside [0, T * k) is skipped, never
// written); T * k < 2^31; 1 <= num_experts <= kMaxExperts. Errors: Error of kind kType for dtypes,
// kValue otherwise, naming the public op the caller passes (moe_permute, moe_unpermute, or their
// _backward).
#pragma once

#include "util/common.h"

namespace fusedlayers {

constexpr int64_t kMaxExperts = 8192;  // the CUDA route counts experts in shared memory

enum class IndexType { kInt32, kInt64 };

// Calls fn(I{}) with I the C type of an IndexType.
template <typename Fn>
void dispatch_index(IndexType type, Fn&& fn) {
  if (type == IndexType::kInt32)
    fn(int32_t{});
  else
    fn(int64_t{});
}

// An integer tensor handed to an op, contiguous.
struct IndexRef {
  const void* data = nullptr;
  IndexType type = IndexType::kInt64;
  Sizes sizes;
};

// The checked geometry of one call.
struct MoeShape {
  int64_t tokens = 0, top_k = 0, hidden = 0, num_experts = 0;
  int64_t pairs() const { return tokens * top_k; }
};

struct MoeRoute {
  IndexRef top_k_index;  // (T, k)
  int64_t num_experts = 0;
  int32_t* row_index = nullptr;  // (T * k): row(t, j) at t * k + j
  int32_t* offsets = nullptr;    // (num_experts)
  void* workspace = nullptr;     // moe_route_workspace_size bytes
};

// Token order to expert order: out[row(t, j)] = w[t, j] in[t] (permute; unpermute's backward),
// and with ys the weights' gradient dweights[t, j] = <ys[row(t, j)], in[t]>.
struct MoeScatter {
  TensorRef in;          // (T, H)
  IndexRef top_k_index;  // (T, k)
  IndexRef row_index;    // (T * k) int32
  int64_t num_experts = 0;
  TensorRef weights;      // (T, k) or absent (1)
  TensorRef ys;           // (T * k, H) or absent: with weights, dweights is written
  void* out = nullptr;    // (T * k, H), in's dtype
  void* dweights = nullptr;  // (T, k), weights' dtype
};

// Expert order to token order: out[t] = sum_j w[t, j] in[row(t, j)] (unpermute; permute's
// backward).
struct MoeGather {
  TensorRef in;          // (T * k, H)
  IndexRef top_k_index;  // (T, k)
  IndexRef row_index;    // (T * k) int32
  int64_t num_experts = 0;
  TensorRef weights;    // (T, k) or absent (1)
  void* out = nullptr;  // (T, H), in's dtype
};

// The checks: top_k_index and num_experts (the route); and each pass's tensors against them.
MoeShape moe_route_check(const char* op, const IndexRef& top_k_index, int64_t num_experts);
MoeShape moe_scatter_check(const char* op, const MoeScatter& a);
MoeShape moe_gather_check(const char* op, const MoeGather& a);

size_t moe_route_workspace_size(const MoeShape& s, const Exec& exec);
// Run the pass on exec's device; the arguments must have passed their check.
void moe_route(const MoeRoute& a, const MoeShape& s, const Exec& exec);
void moe_scatter(const MoeScatter& a, const MoeShape& s, const Exec& exec);
void moe_gather(const MoeGather& a, const MoeShape& s, const Exec& exec);

// Bindings whose framework keeps a GPU op's integer tensors in host memory (TensorFlow) route on
// the host (moe_route with a CPU Exec) and copy the indices the CUDA passes read to the device:
// moe_index_to_device enqueues the copy of `host` into `device` (moe_index_bytes(host) bytes) on
// `stream`, staged through pageable memory so that `host` may be reused once it returns, and
// returns the device view.
int64_t moe_index_bytes(const IndexRef& index);
IndexRef moe_index_to_device(const IndexRef& host, void* device, cudaStream_t stream);

void moe_route_cpu(const MoeRoute& a, const MoeShape& s);
void moe_scatter_cpu(const MoeScatter& a, const MoeShape& s, const ParallelFor& parallel_for);
void moe_gather_cpu(const MoeGather& a, const MoeShape& s, const ParallelFor& parallel_for);
// CUDA: the route as three kernels over tiles of pairs (count per tile, one scan, rank per tile:
// a warp's pairs of one expert ranked by __match_any_sync), the scatter and gather one block per
// token in 16-byte vectors where H and the pointers allow; float32, float16, bfloat16.
size_t moe_route_workspace_size_cuda(const MoeShape& s);
void moe_route_cuda(const MoeRoute& a, const MoeShape& s, cudaStream_t stream);
void moe_scatter_cuda(const MoeScatter& a, const MoeShape& s, cudaStream_t stream);
void moe_gather_cuda(const MoeGather& a, const MoeShape& s, cudaStream_t stream);

}  // namespace fusedlayers
