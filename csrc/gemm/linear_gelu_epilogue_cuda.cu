// CUDA bias + GELU epilogue (math: linear_gelu_epilogue.h; GELU itself: cuda_gelu.cuh).
#include <algorithm>

#include "gemm/linear_gelu_epilogue.h"
#include "util/cuda_common.cuh"
#include "activation/cuda_gelu.cuh"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::gelu;
using cuda::gelu_grad;
using cuda::to_acc;
using A = float;
constexpr int kThreads = 256;

// Vectors of N never straddle rows (cols % N == 0), so a vector's bias is contiguous too.
// pre == nullptr: h is already the pre-activation (no bias) and is not written again. One vector
// per thread over a grid that covers the tensor (the loop only runs past 2^31 blocks): faster
// than a grid of 16 blocks per SM striding two vectors at a time (docs/DESIGN.md).
template <typename T, int N>
__global__ void forward_kernel(const T* __restrict__ h, const T* __restrict__ bias,
                               T* __restrict__ pre, T* __restrict__ y, int64_t n, int64_t cols,
                               bool tanh_form) {
  using V = cuda::Vec<T, N>;
  const int64_t vectors = n / N;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += int64_t(gridDim.x) * blockDim.x) {
    const V in = reinterpret_cast<const V*>(h)[i];
    const int64_t c = bias ? (i * N) % cols : 0;  // 64-bit modulo is slow: only when needed
    V p, out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      // The unfused layer rounds the linear output to T before GELU: so do we.
      p.v[k] = from_acc<T>(to_acc(in.v[k]) + (bias ? A(to_acc(bias[c + k])) : A(0)));
      out.v[k] = from_acc<T>(gelu(to_acc(p.v[k]), tanh_form));
    }
    if (pre) reinterpret_cast<V*>(pre)[i] = p;
    reinterpret_cast<V*>(y)[i] = out;
  }
}

// Block (bx, by), bx * by = kThreads: x picks a vector of columns, y strides over this block's
// slab of rows. bx spans the row up to kThreads vectors (4 KB of bf16), so each row is read in
// long contiguous runs; narrower rows take several rows per step instead.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ pre, T* __restrict__ dpre,
                    A* __restrict__ partial, int64_t rows, int64_t cols, int64_t rows_per_slab,
                    bool tanh_form) {
  using V = cuda::Vec<T, N>;
  __shared__ A smem[kThreads * N];
  const int bx = blockDim.x, by = blockDim.y;
  const int64_t c = (int64_t(blockIdx.x) * bx + threadIdx.x) * N;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_slab;
  const int64_t r1 = r0 + rows_per_slab < rows ? r0 + rows_per_slab : rows;
  A acc[N] = {};
  constexpr int kUnroll = 1;  // rows in flight per thread
  if (c < cols) {
    for (int64_t r0t = r0 + threadIdx.y; r0t < r1; r0t += by * kUnroll) {
      V g[kUnroll], u[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t r = r0t + by * j;
        if (r >= r1) break;
        g[j] = *reinterpret_cast<const V*>(dy + r * cols + c);
        u[j] = *reinterpret_cast<const V*>(pre + r * cols + c);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t r = r0t + by * j;
        if (r >= r1) break;
        V out;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out.v[k] = from_acc<T>(to_acc(g[j].v[k]) * gelu_grad(to_acc(u[j].v[k]), tanh_form));
          acc[k] += to_acc(out.v[k]);  // dbias sums the rounded dpre, as the unfused layer does
        }
        *reinterpret_cast<V*>(dpre + r * cols + c) = out;
      }
    }
  }
  if (!partial) return;
  if (by > 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) smem[(threadIdx.y * bx + threadIdx.x) * N + k] = acc[k];
    __syncthreads();
    if (threadIdx.y != 0) return;
#pragma unroll
    for (int k = 0; k < N; ++k)
      for (int j = 1; j < by; ++j) acc[k] += smem[(j * bx + threadIdx.x) * N + k];  // fixed order
  }
  if (c >= cols) return;
#pragma unroll
  for (int k = 0; k < N; ++k) partial[int64_t(blockIdx.y) * cols + c + k] = acc[k];
}

// dbias[c] = sum over slabs of the partials, in a fixed order: 32 columns per block of (32, 32).
template <typename T>
__global__ void reduce_slabs_kernel(const A* __restrict__ partial, int64_t slabs, int64_t cols,
                                    T* __restrict__ dbias) {
  __shared__ A smem[32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const A s = cuda::column_sum(partial, slabs, cols, cols, smem);
  if (threadIdx.y == 0 && c < cols) dbias[c] = from_acc<T>(s);
}

void check_args(const char* op, int64_t rows, int64_t cols, DType dtype) {
  if (rows < 0 || cols < 0)
    fail(std::string(op) + ": rows and cols must be >= 0, got " + std::to_string(rows) + " x " +
         std::to_string(cols));
  if (dtype == DType::kFloat64) fail(std::string(op) + ": float64 is not supported on CUDA");
}

// Backward block shape for rows of `cols` in vectors of n: (vectors per row up to kThreads,
// rows per step for the rest).
dim3 backward_block(int64_t cols, int n) {
  int bx = 1;
  while (bx < kThreads && int64_t(bx) * n < cols) bx *= 2;
  return dim3(bx, kThreads / bx);
}

// Slabs of rows for dbias: one wave of the blocks the device holds at once (no partial last
// wave), whatever the width.
template <typename T, int N>
int64_t num_slabs(int64_t rows, int64_t cols) {
  const int per_sm = cuda::resident_blocks<backward_kernel<T, N>>(kThreads, 0);
  const dim3 block = backward_block(cols, N);
  const int64_t col_blocks = (cols + int64_t(block.x) * N - 1) / (int64_t(block.x) * N);
  const int64_t wanted =
      std::max<int64_t>(1, int64_t(cuda::sm_count()) * std::max(per_sm, 1) / col_blocks);
  return std::max<int64_t>(1, std::min(wanted, (rows + block.y - 1) / block.y));
}

template <typename Fn>
void dispatch_half_float(DType dtype, Fn&& fn) {
  cuda::dispatch(dtype, [&](auto t) {
    if constexpr (std::is_same_v<decltype(t), double>) {
      fail("linear_gelu_epilogue: float64 is not supported on CUDA");
    } else {
      fn(t);
    }
  });
}

}  // namespace

void linear_gelu_epilogue_forward_cuda(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                            int64_t cols, GeluApprox approx, DType dtype, cudaStream_t stream) {
  check_args("linear_gelu_epilogue", rows, cols, dtype);
  const int64_t n = rows * cols;
  if (n == 0) return;
  dispatch_half_float(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int N = 16 / sizeof(T);
    const bool vec = cols % N == 0 && cuda::aligned(h, 16) && cuda::aligned(pre, 16) &&
                     cuda::aligned(y, 16);
    const int64_t work = vec ? n / N : n;
    const int64_t blocks = std::min<int64_t>((work + kThreads - 1) / kThreads, INT32_MAX);
    // In place without a bias, pre already holds its final value: skip rewriting it.
    T* pre_out = (pre == h && !bias) ? nullptr : static_cast<T*>(pre);
    auto args = std::make_tuple(static_cast<const T*>(h), static_cast<const T*>(bias), pre_out,
                                static_cast<T*>(y), n, cols, approx == GeluApprox::kTanh);
    if (vec) {
      std::apply([&](auto... a) { forward_kernel<T, N><<<blocks, kThreads, 0, stream>>>(a...); },
                 args);
    } else {
      std::apply([&](auto... a) { forward_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(a...); },
                 args);
    }
    cuda::check_launch("linear_gelu_epilogue forward_kernel");
  });
}

size_t linear_gelu_epilogue_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype) {
  check_args("linear_gelu_epilogue_backward", rows, cols, dtype);
  if (cols == 0) return 0;  // nothing to reduce (and num_slabs would divide by zero blocks)
  int64_t slabs = 0;
  dispatch_half_float(dtype, [&](auto t) {  // enough for either launch: 16-byte vectors or not
    using T = decltype(t);
    slabs = std::max(num_slabs<T, 16 / sizeof(T)>(rows, cols), num_slabs<T, 1>(rows, cols));
  });
  return size_t(slabs) * size_t(cols) * sizeof(A);
}

void linear_gelu_epilogue_backward_cuda(const void* dy, const void* pre, void* dpre, void* dbias,
                             void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                             DType dtype, cudaStream_t stream) {
  check_args("linear_gelu_epilogue_backward", rows, cols, dtype);
  if (cols == 0) return;
  if (dbias && !workspace) fail("linear_gelu_epilogue_backward: workspace is null");
  dispatch_half_float(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = cols % kVec == 0 && cuda::aligned(dy, 16) && cuda::aligned(pre, 16) &&
                     cuda::aligned(dpre, 16);
    A* partial = dbias ? static_cast<A*>(workspace) : nullptr;
    auto launch = [&](auto n_tag) {
      constexpr int N = decltype(n_tag)::value;
      const int64_t slabs = num_slabs<T, N>(rows, cols);
      const dim3 block = backward_block(cols, N);
      const dim3 grid((cols + int64_t(block.x) * N - 1) / (int64_t(block.x) * N), slabs);
      backward_kernel<T, N><<<grid, block, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(pre), static_cast<T*>(dpre), partial,
          rows, cols, (rows + slabs - 1) / slabs, approx == GeluApprox::kTanh);
      return slabs;
    };
    const int64_t slabs = vec ? launch(std::integral_constant<int, kVec>{})
                              : launch(std::integral_constant<int, 1>{});
    cuda::check_launch("linear_gelu_epilogue backward_kernel");
    if (!dbias) return;
    reduce_slabs_kernel<T><<<(cols + 31) / 32, dim3(32, 32), 0, stream>>>(
        partial, slabs, cols, static_cast<T*>(dbias));
    cuda::check_launch("linear_gelu_epilogue reduce_slabs_kernel");
  });
}

}  // namespace fusedlayers
