// CUDA ReLU*scale: one contiguous tile of 16-byte vectors per block (1-element vectors when
// unaligned), 64-bit indices; the same per-element math and mask layout as relu_scale_cpu.cpp, so
// results match the CPU bit for bit.
#include <algorithm>

#include "util/cuda_common.cuh"
#include "activation/relu_scale.h"

namespace fusedlayers {
namespace {

using cuda::Acc;
using cuda::from_acc;
using cuda::to_acc;

template <typename T, typename A>
__device__ __forceinline__ T forward_one(T x, A alpha) {
  const A v = to_acc(x);
  return from_acc<T>((v < A(0) ? A(0) : v) * alpha);  // NaN passes through
}

// The mask bit: x is not <= 0 (true for NaN).
template <typename T>
__device__ __forceinline__ uint32_t passes(T x) {
  return !(to_acc(x) <= typename Acc<T>::type(0));
}

template <typename T, typename A>
__device__ __forceinline__ T backward_one(T dy, uint32_t bit, A alpha) {
  const A g = to_acc(dy) * alpha;
  return from_acc<T>(bit ? g : A(0));
}

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors in flight per thread: enough loads to cover DRAM latency
constexpr int64_t kTile = int64_t(kThreads) * kUnroll;  // vectors per block

// Block b owns the contiguous vectors [b * kTile, (b + 1) * kTile): thread t handles vectors
// b * kTile + u * kThreads + t, u < kUnroll (coalesced; each block streams one contiguous
// stretch), loading all of them before computing. One tile per block and no grid-stride loop, so
// the hardware spreads the blocks over the SMs as they free up.
// The vectors cover whole mask words (32 elements: 32 / N consecutive lanes, which a tile never
// splits); the last block's first warp takes the remaining < 32 elements and their word.
template <typename T, int N, bool kMask>
__global__ void __launch_bounds__(kThreads)
    relu_scale_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                              uint32_t* __restrict__ mask, int64_t n,
                              typename Acc<T>::type alpha) {
  using V = cuda::Vec<T, N>;
  constexpr int kLanesPerWord = 32 / N;
  const int64_t vectors = n / 32 * kLanesPerWord;
  const int64_t base = int64_t(blockIdx.x) * kTile + threadIdx.x;
  V v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    if (i < vectors) v[u] = reinterpret_cast<const V*>(x)[i];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    uint32_t bits = 0;
    if (i < vectors) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        bits |= passes(v[u].v[k]) << k;
        v[u].v[k] = forward_one(v[u].v[k], alpha);
      }
      reinterpret_cast<V*>(y)[i] = v[u];
    }
    if constexpr (kMask) {  // OR the word's lanes together; every lane takes part in the shuffles
      bits <<= N * (threadIdx.x % kLanesPerWord);
#pragma unroll
      for (int o = 1; o < kLanesPerWord; o <<= 1) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
      if (i < vectors && threadIdx.x % kLanesPerWord == 0) mask[i / kLanesPerWord] = bits;
    }
  }
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < 32) {
    const int64_t j = vectors * N + threadIdx.x;
    uint32_t bit = 0;
    if (j < n) {
      bit = passes(x[j]);
      y[j] = forward_one(x[j], alpha);
    }
    if constexpr (kMask) {
      const uint32_t word = __ballot_sync(0xffffffffu, bit);
      if (threadIdx.x == 0 && vectors * N < n) mask[vectors * N / 32] = word;
    }
  }
}

// Each thread reads the mask word holding its vector's N bits (a warp reads 4 * N contiguous
// bytes). The last block also takes the n % N scalar tail.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    relu_scale_backward_kernel(const T* __restrict__ dy, const uint32_t* __restrict__ mask,
                               T* __restrict__ dx, int64_t n, typename Acc<T>::type alpha) {
  using V = cuda::Vec<T, N>;
  constexpr int kLanesPerWord = 32 / N;
  const int64_t vectors = n / N;
  const int64_t base = int64_t(blockIdx.x) * kTile + threadIdx.x;
  V g[kUnroll];
  uint32_t bits[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    if (i < vectors) {
      g[u] = reinterpret_cast<const V*>(dy)[i];
      bits[u] = mask[i / kLanesPerWord] >> (N * (i % kLanesPerWord));
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    if (i >= vectors) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) g[u].v[k] = backward_one(g[u].v[k], (bits[u] >> k) & 1u, alpha);
    reinterpret_cast<V*>(dx)[i] = g[u];
  }
  if (blockIdx.x == gridDim.x - 1)
    for (int64_t j = vectors * N + threadIdx.x; j < n; j += kThreads)
      dx[j] = backward_one(dy[j], (mask[j / 32] >> (j % 32)) & 1u, alpha);
}

// One block per tile of vectors (at least one block, for a tail-only n).
int64_t grid_for(int64_t vectors) { return std::max<int64_t>(1, (vectors + kTile - 1) / kTile); }

template <typename T, int N>
void launch_forward(const T* x, T* y, uint32_t* mask, int64_t n, typename Acc<T>::type alpha,
                    cudaStream_t stream) {
  const int64_t grid = grid_for(n / 32 * (32 / N));
  if (mask)
    relu_scale_forward_kernel<T, N, true><<<grid, kThreads, 0, stream>>>(x, y, mask, n, alpha);
  else
    relu_scale_forward_kernel<T, N, false><<<grid, kThreads, 0, stream>>>(x, y, mask, n, alpha);
}

}  // namespace

void relu_scale_forward_cuda(const void* x, void* y, uint32_t* mask, int64_t n, double alpha,
                             DType dtype, cudaStream_t stream) {
  if (n < 0) fail("relu_scale: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    if (cuda::aligned(x, 16) && cuda::aligned(y, 16))
      launch_forward<T, 16 / sizeof(T)>(xp, yp, mask, n, static_cast<A>(alpha), stream);
    else
      launch_forward<T, 1>(xp, yp, mask, n, static_cast<A>(alpha), stream);
    cuda::check_launch("relu_scale_forward_kernel");
  });
}

void relu_scale_backward_cuda(const void* dy, const uint32_t* mask, void* dx, int64_t n,
                              double alpha, DType dtype, cudaStream_t stream) {
  if (n < 0) fail("relu_scale_backward: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    constexpr int N = 16 / sizeof(T);
    const T* dyp = static_cast<const T*>(dy);
    T* dxp = static_cast<T*>(dx);
    if (cuda::aligned(dy, 16) && cuda::aligned(dx, 16)) {
      relu_scale_backward_kernel<T, N>
          <<<grid_for(n / N), kThreads, 0, stream>>>(dyp, mask, dxp, n, static_cast<A>(alpha));
    } else {
      relu_scale_backward_kernel<T, 1>
          <<<grid_for(n), kThreads, 0, stream>>>(dyp, mask, dxp, n, static_cast<A>(alpha));
    }
    cuda::check_launch("relu_scale_backward_kernel");
  });
}

}  // namespace fusedlayers
