// CUDA row pass of linear + cross-entropy (math: linear_cross_entropy.h): a block per row reads
// its logits once for the max (an online sum of exponentials rescaled as the max grows) and the
// sum, then, for gradients, once more to write du in place. dbias: a thread per column adds the
// chunk's rows in order to the float accumulator.
#include <cmath>

#include "cuda_common.cuh"
#include "linear_cross_entropy.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
constexpr int kThreads = 512;

template <typename A>
__device__ __forceinline__ A logit(A u, A cap) {
  return cap > 0 ? cap * tanh(u / cap) : u;
}

// (max, sum of exp(z - max)) merged.
template <typename A>
__device__ __forceinline__ void merge(A& m, A& se, A m2, A se2) {
  const A mm = max(m, m2);
  se = (m == -INFINITY ? A(0) : se * exp(m - mm)) + (m2 == -INFINITY ? A(0) : se2 * exp(m2 - mm));
  m = mm;
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads) chunk_kernel(LinearCrossEntropyChunk c) {
  __shared__ A s_m[kThreads / 32], s_se[kThreads / 32], s_sum[kThreads / 32];
  const int64_t r = blockIdx.x, row = c.row0 + r, v = c.vocab;
  const int64_t t = c.target_int32 ? static_cast<const int32_t*>(c.target)[row]
                                   : static_cast<const int64_t*>(c.target)[row];
  const T* logits = static_cast<const T*>(c.logits) + r * v;
  T* du_row = static_cast<T*>(c.du) + r * v;
  const T* bias = static_cast<const T*>(c.bias);
  const A* scale = static_cast<const A*>(c.grad_scale);
  A* loss = static_cast<A*>(c.loss);
  if (t == c.ignore_index) {
    if (threadIdx.x == 0) loss[row] = 0;
    if (scale)
      for (int64_t j = threadIdx.x; j < v; j += blockDim.x) du_row[j] = from_acc<T>(A(0));
    return;
  }
  const A cap = A(c.softcap), eps = A(c.label_smoothing), zl = A(c.z_loss);
  if (t < 0 || t >= v) {  // no exception from a kernel: the row's loss says it
    if (threadIdx.x == 0) loss[row] = NAN;
    if (scale)
      for (int64_t j = threadIdx.x; j < v; j += blockDim.x) du_row[j] = from_acc<T>(A(NAN));
    return;
  }
  A m = -INFINITY, se = 0, sum = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const A z = logit(to_acc(logits[j]) + (bias ? to_acc(bias[j]) : A(0)), cap);
    if (z > m) {
      se = (m == -INFINITY ? A(0) : se * exp(m - z)) + 1;
      m = z;
    } else {
      se += exp(z - m);
    }
    sum += z;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    merge(m, se, __shfl_xor_sync(0xffffffffu, m, offset),
          __shfl_xor_sync(0xffffffffu, se, offset));
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) s_m[warp] = m, s_se[warp] = se, s_sum[warp] = sum;
  __syncthreads();
  m = s_m[0], se = s_se[0], sum = s_sum[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) merge(m, se, s_m[w], s_se[w]), sum += s_sum[w];
  const A lse = m + log(se);
  const A zt = logit(to_acc(logits[t]) + (bias ? to_acc(bias[t]) : A(0)), cap);
  if (threadIdx.x == 0)
    loss[row] = (1 - eps) * (lse - zt) + eps * (lse - sum / A(v)) + zl * lse * lse;
  if (!scale) return;
  __syncthreads();  // every thread has read logits[t] before du (maybe logits) is written
  const A s = scale[c.per_row_scale ? row : 0], pz = s * (1 + 2 * zl * lse),
          off = s * eps / A(v);
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const A z = logit(to_acc(logits[j]) + (bias ? to_acc(bias[j]) : A(0)), cap);
    A du = pz * exp(z - lse) - off - (j == t ? s * (1 - eps) : A(0));
    if (cap > 0) du *= 1 - (z / cap) * (z / cap);
    du_row[j] = from_acc<T>(du);
  }
}

template <typename T, typename A>
__global__ void dbias_sum_kernel(const T* __restrict__ du, A* __restrict__ acc, int64_t rows,
                                 int64_t vocab) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= vocab) return;
  A s = acc[j];
  for (int64_t r = 0; r < rows; ++r) s += to_acc(du[r * vocab + j]);
  acc[j] = s;
}

template <typename T, typename A>
__global__ void dbias_store_kernel(const A* __restrict__ acc, T* __restrict__ dbias,
                                   int64_t vocab) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < vocab) dbias[j] = from_acc<T>(acc[j]);
}

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

void linear_cross_entropy_chunk_cuda(const LinearCrossEntropyChunk& c, cudaStream_t stream) {
  if (c.dtype == DType::kFloat64) fail("linear_cross_entropy: float64 is not supported on CUDA");
  if (c.rows == 0) return;
  cuda::dispatch(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      chunk_kernel<T, float><<<unsigned(c.rows), kThreads, 0, stream>>>(c);
      cuda::check_launch("linear_cross_entropy chunk_kernel");
      if (c.dbias_acc && c.grad_scale) {
        dbias_sum_kernel<T, float><<<blocks_for(c.vocab, 256), 256, 0, stream>>>(
            static_cast<const T*>(c.du), static_cast<float*>(c.dbias_acc), c.rows, c.vocab);
        cuda::check_launch("linear_cross_entropy dbias_sum_kernel");
      }
    }
  });
}

void linear_cross_entropy_dbias_cuda(const void* acc, void* dbias, int64_t vocab, DType dtype,
                                     cudaStream_t stream) {
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      dbias_store_kernel<T, float><<<blocks_for(vocab, 256), 256, 0, stream>>>(
          static_cast<const float*>(acc), static_cast<T*>(dbias), vocab);
      cuda::check_launch("linear_cross_entropy dbias_store_kernel");
    }
  });
}

void zero_bytes_cuda(void* p, size_t bytes, cudaStream_t stream) {
  cuda::check(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync");
}

}  // namespace fusedlayers
