// CUDA layer norm (math and dtypes: layer_norm.h).
//
// Forward and backward hold a row in registers: a thread owns kIters vectors of N elements
// (N * sizeof(T) = 16 bytes when the rows are 16-byte aligned, else N = 1), at columns
// (it * threads_per_row + lane) * N, so loads are coalesced across the row's threads. Narrow rows
// get one warp each (4 rows per 128-thread block, no __syncthreads), wide rows a whole block.
// The kernel shape is picked by width from the tables below; rows wider than the largest entry
// use the streaming kernels (block per row, re-reading the row from global memory / L2).
//
// Backward: each row slot accumulates dgamma/dbeta for its columns in registers over the rows it
// visits; a block sums its slots in shared memory and writes one row of partials to the
// workspace, and a second kernel sums those per column in block order. The grid is the blocks
// the device holds at once (SM count times the kernel's occupancy), fixed per device and kernel,
// so results are reproducible. The forward has no such partials: one row group per block.
#include <algorithm>
#include <tuple>

#include "cuda_common.cuh"
#include "layer_norm.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
using A = float;  // accumulation type: the CUDA path takes float32/float16/bfloat16 x

template <int W, int I>
struct Shape {  // W warps per row, I vectors per thread
  static constexpr int kWarps = W, kIters = I, kThreads = 32 * W;
  // A warp per row packs 4 rows in a block; wider rows reduce over the block, one row a block.
  static constexpr int kRowsPerBlock = W == 1 ? 4 : 1;
  static constexpr int kBlock = kThreads * kRowsPerBlock;
};

// Kernel shapes by width, smallest capacity first: the first whose capacity 32 * W * I * N
// covers cols and whose I * N row elements per thread fit the register budget is used. The
// entries fit the common widths exactly (768 ... 12288 for both vector widths), so no thread
// carries idle iterations. At most 512 threads per row, so __launch_bounds__ leaves 128
// registers a thread: the forward keeps one fp32 copy of its elements, the backward four (x, dy,
// and its dgamma/dbeta partials), hence the budgets (ptxas -v reports no spills for any
// instantiation).
//   bf16/fp16 (N = 8): forward in registers up to 32768 cols, backward up to 12288;
//   fp32      (N = 4): forward up to 32768, backward up to 12288; unaligned (N = 1): a quarter
//   of those for fp32, an eighth for half types.
using ForwardShapes = std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<1, 4>, Shape<1, 8>,
                                 Shape<4, 4>, Shape<8, 4>, Shape<12, 4>, Shape<16, 4>,
                                 Shape<12, 8>, Shape<16, 8>, Shape<16, 16>>;
constexpr int kForwardMaxPerThread = 64;
using BackwardShapes =
    std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<2, 2>, Shape<2, 3>, Shape<4, 2>,
               Shape<4, 3>, Shape<8, 2>, Shape<8, 3>, Shape<16, 2>, Shape<16, 3>, Shape<16, 4>,
               Shape<16, 6>>;
constexpr int kBackwardMaxPerThread = 24;
constexpr int kBackwardMaxBlocksPerSm = 8;  // each block adds a row of partials to reduce
constexpr int kStreamThreads = 1024;

template <typename P>
__device__ __forceinline__ A param(const P* p, int64_t i, A absent) {
  return p ? A(to_acc(p[i])) : absent;
}

// Sum over the threads of one row: a warp, or the whole block.
template <int W>
__device__ __forceinline__ A row_sum(A v, A* smem) {
  if constexpr (W == 1) {
    return cuda::warp_sum(v);
  } else {
    return cuda::block_sum(v, smem);
  }
}

template <typename T, int N, typename S>
__device__ __forceinline__ void load_row(const T* row, int cols, int lane, A (&v)[S::kIters][N]) {
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = (it * S::kThreads + lane) * N;
    if (c < cols) {
      const auto in = *reinterpret_cast<const cuda::Vec<T, N>*>(row + c);
#pragma unroll
      for (int k = 0; k < N; ++k) v[it][k] = to_acc(in.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v[it][k] = 0;
    }
  }
}

// Writes a thread's share of a row: element k of vector `it` (column c + k) is value(it, k, c).
template <typename T, int N, typename S, typename Value>
__device__ __forceinline__ void store_row(T* row, int cols, int lane, Value&& value) {
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = (it * S::kThreads + lane) * N;
    if (c >= cols) continue;
    cuda::Vec<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(value(it, k, c));
    *reinterpret_cast<cuda::Vec<T, N>*>(row + c) = out;
  }
}

template <typename T, typename P, int N, typename S>
__global__ void __launch_bounds__(S::kBlock)
    forward_kernel(const T* __restrict__ x, const P* __restrict__ gamma,
                   const P* __restrict__ beta, T* __restrict__ y, A* __restrict__ mean,
                   A* __restrict__ rstd, int64_t rows, int cols, A eps, bool subtract_mean) {
  __shared__ A smem[32];
  const int slot = threadIdx.x / S::kThreads, lane = threadIdx.x % S::kThreads;
  for (int64_t r = int64_t(blockIdx.x) * S::kRowsPerBlock + slot; r < rows;
       r += int64_t(gridDim.x) * S::kRowsPerBlock) {
    A v[S::kIters][N];
    load_row<T, N, S>(x + r * cols, cols, lane, v);
    A sum = 0;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it)
#pragma unroll
      for (int k = 0; k < N; ++k) sum += v[it][k];
    const A mu = row_sum<S::kWarps>(sum, smem) / A(cols);
    A sq = 0;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it) {
      if ((it * S::kThreads + lane) * N >= cols) continue;  // padding never enters the variance
#pragma unroll
      for (int k = 0; k < N; ++k) sq += (v[it][k] - mu) * (v[it][k] - mu);
    }
    const A rs = A(1) / sqrtf(row_sum<S::kWarps>(sq, smem) / A(cols) + eps);
    const A shift = subtract_mean ? mu : A(0);
    store_row<T, N, S>(y + r * cols, cols, lane, [&](int it, int k, int c) {
      return (v[it][k] - shift) * rs * param(gamma, c + k, A(1)) + param(beta, c + k, A(0));
    });
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// dx for one row from registers; accumulates this slot's dgamma/dbeta partials.
template <typename T, typename P, int N, typename S>
__global__ void __launch_bounds__(S::kBlock)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ saved,
                    const A* __restrict__ mean, const A* __restrict__ rstd,
                    const P* __restrict__ gamma, const P* __restrict__ beta, T* __restrict__ dx,
                    A* __restrict__ partial, int64_t rows, int cols, bool saved_is_output,
                    bool subtract_mean) {
  __shared__ A smem[32];
  const int slot = threadIdx.x / S::kThreads, lane = threadIdx.x % S::kThreads;
  A dg[S::kIters][N] = {}, db[S::kIters][N] = {};
  for (int64_t r = int64_t(blockIdx.x) * S::kRowsPerBlock + slot; r < rows;
       r += int64_t(gridDim.x) * S::kRowsPerBlock) {
    A xh[S::kIters][N], g[S::kIters][N];
    load_row<T, N, S>(saved + r * cols, cols, lane, xh);
    load_row<T, N, S>(dy + r * cols, cols, lane, g);
    const A rs = rstd[r];
    const A mu = saved_is_output ? A(0) : mean[r];
    // Scale-only (subtract_mean = false): dx needs rstd * mean(g * x), summed on raw x, since
    // mean(g * xhat) + mean * rstd * mean(g) cancels for rows far from zero; and x - mean is
    // re-centred by its own residual (sum_c), so the rounding of the stored mean does not enter.
    A sum_g = 0, sum_gx = 0, sum_c = 0;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it) {
      const int c = (it * S::kThreads + lane) * N;
      if (c >= cols) continue;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const A d = g[it][k], x_raw = xh[it][k];
        xh[it][k] = saved_is_output
                        ? (x_raw - param(beta, c + k, A(0))) / param(gamma, c + k, A(1))
                        : (x_raw - mu) * rs;
        g[it][k] = d * param(gamma, c + k, A(1));
        sum_g += g[it][k];
        if (subtract_mean) {
          dg[it][k] += d * xh[it][k];
          db[it][k] += d;
          sum_gx += g[it][k] * xh[it][k];
        } else {
          dg[it][k] += d * x_raw * rs;  // dgamma = sum dy x rstd
          sum_gx += g[it][k] * x_raw;
          sum_c += x_raw - mu;
        }
      }
    }
    const A mg = row_sum<S::kWarps>(sum_g, smem) / A(cols);
    const A mgx = row_sum<S::kWarps>(sum_gx, smem) / A(cols);
    const A shift = subtract_mean ? A(0) : row_sum<S::kWarps>(sum_c, smem) / A(cols) * rs;
    const A k_mean = subtract_mean ? mg : A(0);
    const A k_xhat = subtract_mean ? mgx : rs * mgx;
    store_row<T, N, S>(dx + r * cols, cols, lane, [&](int it, int k, int) {
      return rs * (g[it][k] - k_mean - (xh[it][k] - shift) * k_xhat);
    });
  }
  if (!partial) return;
  if constexpr (S::kRowsPerBlock > 1) {  // sum the block's row slots, in slot order
    constexpr int kCols = S::kThreads * S::kIters * N;
    __shared__ A red[S::kRowsPerBlock][2][kCols];
#pragma unroll
    for (int it = 0; it < S::kIters; ++it)
#pragma unroll
      for (int k = 0; k < N; ++k) {
        red[slot][0][(it * S::kThreads + lane) * N + k] = dg[it][k];
        red[slot][1][(it * S::kThreads + lane) * N + k] = db[it][k];
      }
    __syncthreads();
    if (slot != 0) return;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it)
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const int c = (it * S::kThreads + lane) * N + k;
        for (int j = 1; j < S::kRowsPerBlock; ++j) {
          dg[it][k] += red[j][0][c];
          db[it][k] += red[j][1][c];
        }
      }
  }
  A* pg = partial + int64_t(blockIdx.x) * 2 * cols;  // one group per block
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = (it * S::kThreads + lane) * N;
    if (c >= cols) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      pg[c + k] = dg[it][k];
      pg[cols + c + k] = db[it][k];
    }
  }
}

// Rows too wide for registers: a block per row, three passes over the row in memory.
template <typename T, typename P>
__global__ void __launch_bounds__(kStreamThreads)
    forward_stream_kernel(const T* __restrict__ x, const P* __restrict__ gamma,
                          const P* __restrict__ beta, T* __restrict__ y, A* __restrict__ mean,
                          A* __restrict__ rstd, int64_t rows, int64_t cols, A eps,
                          bool subtract_mean) {
  __shared__ A smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    A sum = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += to_acc(xr[c]);
    const A mu = cuda::block_sum(sum, smem) / A(cols);
    A sq = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A d = to_acc(xr[c]) - mu;
      sq += d * d;
    }
    const A rs = A(1) / sqrtf(cuda::block_sum(sq, smem) / A(cols) + eps);
    const A shift = subtract_mean ? mu : A(0);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      y[r * cols + c] = from_acc<T>((to_acc(xr[c]) - shift) * rs * param(gamma, c, A(1)) +
                                    param(beta, c, A(0)));
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// Block b owns partial row b and accumulates into it over the rows it visits.
template <typename T, typename P>
__global__ void __launch_bounds__(kStreamThreads)
    backward_stream_kernel(const T* __restrict__ dy, const T* __restrict__ saved,
                           const A* __restrict__ mean, const A* __restrict__ rstd,
                           const P* __restrict__ gamma, const P* __restrict__ beta,
                           T* __restrict__ dx, A* __restrict__ partial, int64_t rows,
                           int64_t cols, bool saved_is_output, bool subtract_mean) {
  __shared__ A smem[32];
  A* pg = partial ? partial + int64_t(blockIdx.x) * 2 * cols : nullptr;
  if (pg)
    for (int64_t c = threadIdx.x; c < 2 * cols; c += blockDim.x) pg[c] = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* sr = saved + r * cols;
    const T* dyr = dy + r * cols;
    const A rs = rstd[r];
    const A mu = saved_is_output ? A(0) : mean[r];
    auto xhat = [&](int64_t c) {
      return saved_is_output ? (to_acc(sr[c]) - param(beta, c, A(0))) / param(gamma, c, A(1))
                             : (to_acc(sr[c]) - mu) * rs;
    };
    A sum_g = 0, sum_gx = 0, sum_c = 0;  // scale-only sums as in backward_kernel
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A d = to_acc(dyr[c]), x_raw = to_acc(sr[c]), g = d * param(gamma, c, A(1));
      sum_g += g;
      if (subtract_mean) {
        sum_gx += g * xhat(c);
      } else {
        sum_gx += g * x_raw;
        sum_c += x_raw - mu;
      }
      if (pg) {  // each column is owned by one thread: no race
        pg[c] += subtract_mean ? d * xhat(c) : d * x_raw * rs;
        pg[cols + c] += d;
      }
    }
    const A mg = cuda::block_sum(sum_g, smem) / A(cols);
    const A mgx = cuda::block_sum(sum_gx, smem) / A(cols);
    const A shift = subtract_mean ? A(0) : cuda::block_sum(sum_c, smem) / A(cols) * rs;
    const A k_mean = subtract_mean ? mg : A(0);
    const A k_xhat = subtract_mean ? mgx : rs * mgx;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A g = to_acc(dyr[c]) * param(gamma, c, A(1));
      dx[r * cols + c] = from_acc<T>(rs * (g - k_mean - (xhat(c) - shift) * k_xhat));
    }
  }
}

// dgamma[c] / dbeta[c] = sum over groups of the partials, in group order: 32 columns per block,
// 32 strided group subsets per column summed in a fixed order in shared memory.
template <typename P>
__global__ void reduce_partials_kernel(const A* __restrict__ partial, int64_t groups,
                                       int64_t cols, P* __restrict__ dgamma,
                                       P* __restrict__ dbeta) {
  __shared__ A sg[32][33], sb[32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A g = 0, b = 0;
  if (c < cols)
    for (int64_t grp = threadIdx.y; grp < groups; grp += 32) {
      g += partial[grp * 2 * cols + c];
      b += partial[grp * 2 * cols + cols + c];
    }
  sg[threadIdx.y][threadIdx.x] = g;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  A tg = 0, tb = 0;
  for (int j = 0; j < 32; ++j) {
    tg += sg[j][threadIdx.x];
    tb += sb[j][threadIdx.x];
  }
  if (dgamma) dgamma[c] = from_acc<P>(tg);
  if (dbeta) dbeta[c] = from_acc<P>(tb);
}

// Calls fn(S{}) for the first shape of `Shapes` within the register budget that holds a row of
// `cols` elements as vectors of N; returns false when none does (too wide for registers).
// Shapes over budget are never instantiated.
template <typename Shapes, int MaxPerThread, int N, typename Fn>
bool with_shape(int64_t cols, Fn&& fn) {
  bool found = false;
  std::apply(
      [&](auto... shapes) {
        auto try_one = [&](auto s) {
          using S = decltype(s);
          if constexpr (S::kIters * N <= MaxPerThread) {
            if (!found && int64_t(S::kThreads) * S::kIters * N >= cols) {
              found = true;
              fn(s);
            }
          }
        };
        (try_one(shapes), ...);
      },
      Shapes{});
  return found;
}

void check_args(const char* op, int64_t rows, int64_t cols, DType dtype, DType param_dtype) {
  if (rows < 0) fail(std::string(op) + ": rows must be >= 0, got " + std::to_string(rows));
  if (cols < 1) fail(std::string(op) + ": cols must be >= 1, got " + std::to_string(cols));
  if (cols > INT32_MAX) fail(std::string(op) + ": cols must be < 2^31");
  if (dtype == DType::kFloat64) fail(std::string(op) + ": float64 is not supported on CUDA");
  if (param_dtype != dtype && param_dtype != DType::kFloat32)
    fail(std::string(op) + ": gamma/beta dtype must be " + dtype_name(dtype) +
         " or float32, got " + dtype_name(param_dtype));
}

// Calls fn(T{}, P{}) for the CUDA storage types of x and gamma/beta.
template <typename Fn>
void dispatch2(DType dtype, DType param_dtype, Fn&& fn) {
  cuda::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, double>) {
      fail("layer_norm: float64 is not supported on CUDA");
    } else if (param_dtype == dtype) {
      fn(t, t);
    } else {
      fn(t, float{});
    }
  });
}

// Blocks of `kernel` one SM holds at once (registers, shared memory, threads), at most
// kBackwardMaxBlocksPerSm. Computed once per kernel: it depends on the kernel and the
// architecture only.
template <auto Kernel>
int64_t resident_blocks(int threads) {
  static const int64_t blocks = [&] {
    int n = 0;
    cuda::check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, 0),
                "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return std::clamp<int64_t>(n, 1, kBackwardMaxBlocksPerSm);
  }();
  return blocks;
}

int64_t backward_groups_max() { return int64_t(cuda::sm_count()) * kBackwardMaxBlocksPerSm; }

}  // namespace

void layer_norm_forward_cuda(const void* x, const void* gamma, const void* beta, void* y,
                             void* mean, void* rstd, int64_t rows, int64_t cols, double eps,
                             bool subtract_mean, DType dtype, DType param_dtype,
                             cudaStream_t stream) {
  check_args("layer_norm", rows, cols, dtype, param_dtype);
  if (rows == 0) return;
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    const P* gp = static_cast<const P*>(gamma);
    const P* bp = static_cast<const P*>(beta);
    A* mp = static_cast<A*>(mean);
    A* rp = static_cast<A*>(rstd);
    const int64_t max_blocks = int64_t(cuda::sm_count()) * 32;  // streaming kernel
    auto launch = [&](auto n_tag) {
      constexpr int N = decltype(n_tag)::value;
      return with_shape<ForwardShapes, kForwardMaxPerThread, N>(cols, [&](auto s) {
        using S = decltype(s);
        // A block per row group, no persistent loop: blocks start as SMs free up, so the
        // loads of the next rows overlap the reductions and stores of the current ones.
        const int64_t blocks = std::min<int64_t>((rows + S::kRowsPerBlock - 1) / S::kRowsPerBlock,
                                                 INT32_MAX);
        forward_kernel<T, P, N, S><<<blocks, S::kBlock, 0, stream>>>(
            xp, gp, bp, yp, mp, rp, rows, int(cols), A(eps), subtract_mean);
      });
    };
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = cols % kVec == 0 && cuda::aligned(x, 16) && cuda::aligned(y, 16);
    const bool done = vec ? launch(std::integral_constant<int, kVec>{})
                          : launch(std::integral_constant<int, 1>{});
    if (!done)
      forward_stream_kernel<T, P><<<std::min(rows, max_blocks), kStreamThreads, 0, stream>>>(
          xp, gp, bp, yp, mp, rp, rows, cols, A(eps), subtract_mean);
    cuda::check_launch("layer_norm forward");
  });
}

size_t layer_norm_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype) {
  check_args("layer_norm_backward", rows, cols, dtype, dtype);
  return size_t(backward_groups_max()) * 2 * size_t(cols) * sizeof(A);
}

void layer_norm_backward_cuda(const void* dy, const void* saved, const void* mean,
                              const void* rstd, const void* gamma, const void* beta, void* dx,
                              void* dgamma, void* dbeta, void* workspace, int64_t rows,
                              int64_t cols, bool saved_is_output, bool subtract_mean,
                              DType dtype, DType param_dtype, cudaStream_t stream) {
  check_args("layer_norm_backward", rows, cols, dtype, param_dtype);
  if (saved_is_output && !subtract_mean)
    fail("layer_norm_backward: saved_is_output needs subtract_mean");
  const bool want_params = dgamma || dbeta;
  if (want_params && !workspace) fail("layer_norm_backward: workspace is null");
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    const T* dyp = static_cast<const T*>(dy);
    const T* sp = static_cast<const T*>(saved);
    const A* mp = static_cast<const A*>(mean);
    const A* rp = static_cast<const A*>(rstd);
    const P* gp = static_cast<const P*>(gamma);
    const P* bp = static_cast<const P*>(beta);
    T* dxp = static_cast<T*>(dx);
    A* partial = want_params ? static_cast<A*>(workspace) : nullptr;
    int64_t groups = 0;  // rows of partials: one per block
    auto launch = [&](auto n_tag) {
      constexpr int N = decltype(n_tag)::value;
      return with_shape<BackwardShapes, kBackwardMaxPerThread, N>(cols, [&](auto s) {
        using S = decltype(s);
        // Resident blocks only, so every block gets rows and none waits for a second wave.
        const int64_t per_sm = resident_blocks<backward_kernel<T, P, N, S>>(S::kBlock);
        const int64_t blocks = std::max<int64_t>(
            1, std::min((rows + S::kRowsPerBlock - 1) / S::kRowsPerBlock,
                        int64_t(cuda::sm_count()) * per_sm));
        groups = blocks;
        backward_kernel<T, P, N, S><<<blocks, S::kBlock, 0, stream>>>(
            dyp, sp, mp, rp, gp, bp, dxp, partial, rows, int(cols), saved_is_output,
            subtract_mean);
      });
    };
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = cols % kVec == 0 && cuda::aligned(dy, 16) && cuda::aligned(saved, 16) &&
                     cuda::aligned(dx, 16);
    const bool done = vec ? launch(std::integral_constant<int, kVec>{})
                          : launch(std::integral_constant<int, 1>{});
    if (!done) {
      groups = std::max<int64_t>(1, std::min(rows, int64_t(cuda::sm_count()) * 2));
      backward_stream_kernel<T, P><<<groups, kStreamThreads, 0, stream>>>(
          dyp, sp, mp, rp, gp, bp, dxp, partial, rows, cols, saved_is_output, subtract_mean);
    }
    cuda::check_launch("layer_norm backward");
    if (!want_params) return;
    reduce_partials_kernel<P><<<(cols + 31) / 32, dim3(32, 32), 0, stream>>>(
        partial, groups, cols, static_cast<P*>(dgamma), static_cast<P*>(dbeta));
    cuda::check_launch("layer_norm reduce_partials_kernel");
  });
}

}  // namespace fusedlayers
