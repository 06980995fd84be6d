// CUDA row normalization (math and dtypes: norm.h).
//
// Forward and backward hold a row in registers: a thread owns kIters vectors of N elements
// (N * sizeof(T) = 16 bytes when the rows are 16-byte aligned, else N = 1), at columns
// (it * threads_per_row + lane) * N, so loads are coalesced across the row's threads. Narrow rows
// get one warp each (reduced by shuffles), wider rows 2 to 16 warps. A block holds 8 warps' worth
// of rows, or one row of 12 or 16 warps; each row slot synchronizes on its own named barrier.
// The kernel shape is picked by width from the tables below; rows wider than the largest entry
// use the streaming kernels (block per row, re-reading the row from global memory / L2).
//
// Backward: registers hold the row's x and dy as stored (16-bit types stay packed), and each row
// slot accumulates dgamma/dbeta for its columns in shared memory over the rows it visits, so a
// bf16 row costs a quarter of the registers an fp32 copy of x, dy, dgamma and dbeta would, and
// more rows are in flight per SM. A block sums its slots and writes one row of partials to the
// workspace, and a second kernel sums those per column in block order. The grid is the blocks
// the device holds at once (SM count times the kernel's occupancy), fixed per device and kernel,
// so results are reproducible. The forward has no such partials: one row group per block.
//
// The add+norm ops (a residual) run in instances of the same kernels (kAdd) where the residual
// has x's dtype and the rows are vectorized: the forward loads the residual with x and adds it
// (writing h), the backward loads dh with the row and adds it as it stores dx, so either pass
// still reads and writes each element once. Their own instances, as the operands loaded ahead
// cost registers, which would lower the plain norms' occupancy. A float32 residual under 16-bit
// x (residual_in_fp32) and unaligned rows take the streaming kernels, whose row type is the
// residual's.
//
// gamma/beta are read as vectors like the rows (the launchers check their alignment too): one
// 16-byte load per 8 bf16 columns instead of 8 scalar loads. The backward, which is bound by its
// instruction rate rather than by memory, stages gamma once per block as float in shared memory.
#include <algorithm>
#include <tuple>

#include "util/cuda_common.cuh"
#include "norm/norm.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
using A = float;  // accumulation type: the CUDA path takes float32/float16/bfloat16 x

template <int W, int I>
struct Shape {  // W warps per row, I vectors per thread
  static constexpr int kWarps = W, kIters = I, kThreads = 32 * W;
  // Blocks of 256 threads (one row of 8 or more warps): the backward's partials bound the blocks
  // per SM, so the rows per block must not bound the rows in flight.
  static constexpr int kRowsPerBlock = W >= 8 ? 1 : 8 / W;
  static constexpr int kBlock = kThreads * kRowsPerBlock;
};

// Kernel shapes by width, per element size, smallest capacity first: the first whose capacity
// 32 * W * I * N covers cols is used. The entries fit the common widths exactly (768 ... 12288),
// so no thread carries idle iterations. At most 512 threads per row, so __launch_bounds__ leaves
// 128 registers a thread. The forward keeps an fp32 copy of its elements (at most 64), the
// backward x and dy as stored (at most 32 bf16/fp16 or 24 fp32 elements): in registers, the
// forward handles rows up to 32768 cols, the backward up to 16384 (bf16/fp16) or 12288 (fp32)
// cols; unaligned rows (N = 1) an eighth (half types) or a quarter (fp32) of that. ptxas spills a
// few loop-invariant values (under 40 bytes) in the 12-warp forward for 16-bit types, the
// 16 x 4 fp32 backward and the 8 x 4 and 16 x 4 add+norm backward for 16-bit types, to fit one
// more block per SM.
using ForwardShapes16 = std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<1, 4>, Shape<2, 4>,
                                   Shape<4, 4>, Shape<8, 4>, Shape<12, 4>, Shape<16, 4>,
                                   Shape<12, 8>, Shape<16, 8>>;
using ForwardShapes32 = std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<1, 4>, Shape<1, 8>,
                                   Shape<4, 4>, Shape<8, 4>, Shape<12, 4>, Shape<16, 4>,
                                   Shape<12, 8>, Shape<16, 8>, Shape<16, 16>>;
// 16-bit rows of 2048 get two warps in the forward, not one warp with 64 fp32 registers of row
// (twice the warps per SM for the same rows in flight; docs/DESIGN.md has the measurements).
// The backward has 8-warp rows up to 8192 bf16 cols: more rows in flight than 16 warps with
// half the elements each, whose fixed registers cost more than the row's.
using BackwardShapes16 =
    std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<2, 2>, Shape<2, 3>, Shape<4, 2>,
               Shape<4, 3>, Shape<8, 2>, Shape<8, 3>, Shape<8, 4>, Shape<16, 3>, Shape<16, 4>>;
using BackwardShapes32 =
    std::tuple<Shape<1, 1>, Shape<1, 2>, Shape<1, 3>, Shape<2, 2>, Shape<2, 3>, Shape<4, 2>,
               Shape<4, 3>, Shape<8, 2>, Shape<8, 3>, Shape<16, 2>, Shape<16, 3>, Shape<16, 4>,
               Shape<16, 6>>;
template <typename T, typename Shapes16, typename Shapes32>
using ShapesFor = std::conditional_t<sizeof(T) == 2, Shapes16, Shapes32>;
constexpr int kBackwardMaxBlocksPerSm = 8;  // each block adds a row of partials to reduce
constexpr int kStreamThreads = 1024;

template <typename T, int N>
using Vec = cuda::Vec<T, N>;

template <typename P>
__device__ __forceinline__ A param(const P* p, int64_t i, A absent) {
  return p ? A(to_acc(p[i])) : absent;
}

// gamma or beta at columns c ... c + N - 1 (`absent` where p is null), as one vector load.
template <int N, typename P>
__device__ __forceinline__ void load_param(const P* p, int c, A absent, A (&out)[N]) {
  if (p) {
    const auto v = *reinterpret_cast<const Vec<P, N>*>(p + c);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_acc(v.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = absent;
  }
}

// gamma = weight + offset at columns c ... c + N - 1, 1 where weight is null.
template <int N, typename P>
__device__ __forceinline__ void load_gamma(const P* w, int c, A offset, A (&out)[N]) {
  load_param(w, c, A(1), out);
  if (w)
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] += offset;
}

template <typename P>
__device__ __forceinline__ A gamma_at(const P* w, int64_t i, A offset) {
  return w ? A(to_acc(w[i])) + offset : A(1);
}

// dy * gamma rounded to float, never contracted into a following add: the sum and dx's
// g - mean(g) then see the same value, so for one-element rows dx is exactly 0 as in the
// unfused layer (an FMA would leave the product's rounding error, times rstd = 1/sqrt(eps)).
__device__ __forceinline__ A dy_gamma(A dy, A gamma) { return __fmul_rn(dy, gamma); }

// Barrier over the threads of one row slot: named barrier 1 + slot (0 is __syncthreads').
template <typename S>
__device__ __forceinline__ void slot_sync(int slot) {
  if constexpr (S::kRowsPerBlock == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(slot + 1), "r"(S::kThreads) : "memory");
  }
}

// Sums K values over the threads of one row slot in one round of barriers; `smem` holds
// kRowsPerBlock * kWarps * K values.
template <typename S, int K>
__device__ __forceinline__ void row_sums(A (&v)[K], A* smem, int slot, int lane) {
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = cuda::warp_sum(v[i]);
  if constexpr (S::kWarps > 1) {
    A* s = smem + slot * S::kWarps * K;
    slot_sync<S>(slot);  // the previous round's reads are done
    if (lane % 32 == 0)
#pragma unroll
      for (int i = 0; i < K; ++i) s[lane / 32 * K + i] = v[i];
    slot_sync<S>(slot);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      A total = 0;
#pragma unroll
      for (int w = 0; w < S::kWarps; ++w) total += s[w * K + i];  // same order in every thread
      v[i] = total;
    }
  }
}

template <typename S>
__device__ __forceinline__ A row_sum(A v, A* smem, int slot, int lane) {
  A sums[1] = {v};
  row_sums<S>(sums, smem, slot, lane);
  return sums[0];
}

// Column of element k of a thread's vector `it` is column(it) + k.
template <int N, typename S>
__device__ __forceinline__ int column(int it, int lane) {
  return (it * S::kThreads + lane) * N;
}

// A thread's share of a row as fp32, zero past cols.
template <typename T, int N, typename S>
__device__ __forceinline__ void load_row(const T* row, int cols, int lane, A (&v)[S::kIters][N]) {
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = column<N, S>(it, lane);
    if (c < cols) {
      const auto in = *reinterpret_cast<const Vec<T, N>*>(row + c);
#pragma unroll
      for (int k = 0; k < N; ++k) v[it][k] = to_acc(in.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v[it][k] = 0;
    }
  }
}

// A thread's share of a row as stored; vectors past cols are left unset and never read.
template <typename T, int N, typename S>
__device__ __forceinline__ void load_raw(const T* row, int cols, int lane,
                                         Vec<T, N> (&v)[S::kIters]) {
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = column<N, S>(it, lane);
    if (c < cols) v[it] = *reinterpret_cast<const Vec<T, N>*>(row + c);
  }
}

// Writes a thread's share of a row: fill(it, c, out) sets the N values of vector `it`, whose
// first column is c.
template <typename T, int N, typename S, typename Fill>
__device__ __forceinline__ void store_row(T* row, int cols, int lane, Fill&& fill) {
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = column<N, S>(it, lane);
    if (c >= cols) continue;
    A v[N];
    fill(it, c, v);
    Vec<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = from_acc<T>(v[k]);
    *reinterpret_cast<Vec<T, N>*>(row + c) = out;
  }
}

// Whether a thread's raw vectors of one more row operand fit in registers beside the row: up to
// 4 vectors a thread (wider shapes spill), else that operand is loaded where it is used.
template <typename S>
constexpr bool kPrefetchOperand = S::kIters <= 4;

// Blocks an SM must hold of a kAdd instance: at least two of 256 threads (at most 128 registers
// a thread). Left free, the compiler gives the operands loaded ahead up to 168 registers and the
// SM one such block, and the add+norm passes lose to the plain norm's occupancy what they gain
// from the overlapped loads.
template <typename S>
constexpr int kAddMinBlocks = S::kBlock >= 512 ? 1 : 512 / S::kBlock;

// h = x + residual rounded to T over a thread's share of a row, written to h and left in v as
// fp32 (zero past cols): the row the norm then takes. Where registers allow, both rows are
// loaded before either is used, so that their loads are in flight together.
template <typename T, int N, typename S>
__device__ __forceinline__ void load_add_row(const T* x, const T* res, T* h, int cols, int lane,
                                             A (&v)[S::kIters][N]) {
  Vec<T, N> rs[S::kIters];
  if constexpr (kPrefetchOperand<S>) {
    Vec<T, N> xs[S::kIters];
    load_raw<T, N, S>(x, cols, lane, xs);
    load_raw<T, N, S>(res, cols, lane, rs);
#pragma unroll
    for (int it = 0; it < S::kIters; ++it)
#pragma unroll
      for (int k = 0; k < N; ++k)
        v[it][k] = column<N, S>(it, lane) < cols ? to_acc(xs[it].v[k]) : A(0);
  } else {
    load_row<T, N, S>(x, cols, lane, v);
  }
#pragma unroll
  for (int it = 0; it < S::kIters; ++it) {
    const int c = column<N, S>(it, lane);
    if (c >= cols) continue;
    if constexpr (!kPrefetchOperand<S>) rs[it] = *reinterpret_cast<const Vec<T, N>*>(res + c);
    Vec<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      out.v[k] = from_acc<T>(v[it][k] + to_acc(rs[it].v[k]));
      v[it][k] = to_acc(out.v[k]);
    }
    *reinterpret_cast<Vec<T, N>*>(h + c) = out;
  }
}

// dresidual's value from the norm's dx (rounded to R first, as the unfused norm's output) and
// dh, the gradient of h from its other uses (csrc/norm/norm.h).
template <typename R>
__device__ __forceinline__ A plus_dh(A dx, const R* dh, int64_t i) {
  return dh ? to_acc(from_acc<R>(dx)) + to_acc(dh[i]) : dx;
}

template <typename T, typename P, int N, typename S, bool kAdd>
__global__ void __launch_bounds__(S::kBlock, kAdd ? kAddMinBlocks<S> : 1)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ h,
                   const P* __restrict__ gamma,
                   const P* __restrict__ beta, T* __restrict__ y, A* __restrict__ mean,
                   A* __restrict__ rstd, int64_t rows, int cols, A inv_cols, A eps,
                   A goff, NormMode mode) {
  __shared__ A smem[S::kRowsPerBlock * S::kWarps];
  const int slot = threadIdx.x / S::kThreads, lane = threadIdx.x % S::kThreads;
  for (int64_t r = int64_t(blockIdx.x) * S::kRowsPerBlock + slot; r < rows;
       r += int64_t(gridDim.x) * S::kRowsPerBlock) {
    A v[S::kIters][N];
    if constexpr (kAdd)
      load_add_row<T, N, S>(x + r * cols, residual + r * cols, h + r * cols, cols, lane, v);
    else
      load_row<T, N, S>(x + r * cols, cols, lane, v);
    A mu = 0;
    if (mode != NormMode::kRms) {  // uniform over the row slot, as row_sum's barriers need
      // The mean as x[0] + mean(x - x[0]) (see norm_cpu.cpp); x[0] is one broadcast load.
      const A x0 = kAdd ? to_acc(from_acc<T>(to_acc(x[r * cols]) + to_acc(residual[r * cols])))
                        : to_acc(x[r * cols]);
      A sum = 0;
#pragma unroll
      for (int it = 0; it < S::kIters; ++it) {
        if (column<N, S>(it, lane) >= cols) continue;
#pragma unroll
        for (int k = 0; k < N; ++k) sum += v[it][k] - x0;
      }
      mu = x0 + row_sum<S>(sum, smem, slot, lane) * inv_cols;
    }
    A sq = 0;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it) {
      if (column<N, S>(it, lane) >= cols) continue;  // padding never enters the variance
#pragma unroll
      for (int k = 0; k < N; ++k) sq += (v[it][k] - mu) * (v[it][k] - mu);
    }
    const A rs = rsqrtf(row_sum<S>(sq, smem, slot, lane) * inv_cols + eps);
    const A shift = mode == NormMode::kLayer ? mu : A(0);
    store_row<T, N, S>(y + r * cols, cols, lane, [&](int it, int c, A(&out)[N]) {
      A g[N], b[N];
      load_gamma(gamma, c, goff, g);
      load_param(beta, c, A(0), b);
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = (v[it][k] - shift) * rs * g[k] + b[k];
    });
    if (lane == 0) {
      if (mean) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// Per-thread float vectors in dynamic shared memory, as planes of [kIters][N / kChunk][kThreads]
// chunks of kChunk floats, so that a warp's accesses are consecutive 16-byte vectors (no bank
// conflicts). The backward keeps two kinds of plane there: gamma (+ offset) as float, staged
// once per block (plane 0), and per row slot its dgamma, then (with kSums = 2) dbeta
// accumulators (planes 1 + slot * kSums + which). Without dbeta (RMSNorm, LayerNorm without bias)
// a block needs fewer planes, so more blocks fit on an SM.
template <int N, typename S>
struct Planes {
  static constexpr int kChunk = N < 4 ? N : 4, kChunks = N / kChunk;
  using Chunk = Vec<A, kChunk>;
  static constexpr size_t kPlaneBytes = size_t(S::kIters) * N * S::kThreads * sizeof(A);
  Chunk* base;
  __device__ __forceinline__ Chunk& at(int plane, int it, int q, int lane) const {
    return base[((plane * S::kIters + it) * kChunks + q) * S::kThreads + lane];
  }
  // The N values of vector `it` of a thread.
  __device__ __forceinline__ void get(int plane, int it, int lane, A (&out)[N]) const {
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const Chunk c = at(plane, it, q, lane);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) out[q * kChunk + j] = c.v[j];
    }
  }
};

template <int N, typename S, int kSums>
constexpr size_t backward_smem_bytes(bool partial) {
  return (1 + (partial ? S::kRowsPerBlock * kSums : 0)) * Planes<N, S>::kPlaneBytes;
}

// dx for each row from registers; with `partial`, adds this slot's dgamma/dbeta contributions
// to its accumulators and finally writes the block's row of partials. gamma is read from its
// staged float plane: a 16-bit gamma loaded and converted per row and element costs the
// instruction-bound backward several percent (docs/DESIGN.md, CUDA kernels).
template <typename T, typename P, int N, typename S, int kSums, bool kAdd>
__global__ void __launch_bounds__(S::kBlock, kAdd ? kAddMinBlocks<S> : 1)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ saved,
                    const A* __restrict__ mean, const A* __restrict__ rstd,
                    const P* __restrict__ gamma, const P* __restrict__ beta,
                    const T* __restrict__ dh, T* __restrict__ dx, A* __restrict__ partial,
                    int64_t rows, int cols, A inv_cols, A goff, bool saved_is_output,
                    NormMode mode) {
  const bool centred = mode == NormMode::kLayer;
  __shared__ A smem[S::kRowsPerBlock * S::kWarps * 3];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  using Smem = Planes<N, S>;
  using Chunk = typename Smem::Chunk;
  constexpr int kGamma = 0;
  const auto acc_plane = [](int slot, int which) { return 1 + slot * kSums + which; };
  const Smem planes{reinterpret_cast<Chunk*>(dynamic_smem)};
  const int slot = threadIdx.x / S::kThreads, lane = threadIdx.x % S::kThreads;
  // The row slots share the gamma plane; each slot's threads stage a share of it.
  for (int e = threadIdx.x; e < S::kIters * Smem::kChunks * S::kThreads; e += S::kBlock) {
    const int l = e % S::kThreads, q = e / S::kThreads % Smem::kChunks;
    const int it = e / S::kThreads / Smem::kChunks;
    const int c = column<N, S>(it, l) + q * Smem::kChunk;
    Chunk g;
#pragma unroll
    for (int j = 0; j < Smem::kChunk; ++j)
      g.v[j] = c + j < cols ? gamma_at(gamma, c + j, goff) : A(0);
    planes.at(kGamma, it, q, l) = g;
  }
  if (partial)  // a thread only touches its own accumulators until the final sum
#pragma unroll
    for (int it = 0; it < S::kIters; ++it)
#pragma unroll
      for (int q = 0; q < Smem::kChunks; ++q) {
        planes.at(acc_plane(slot, 0), it, q, lane) = Chunk{};
        if constexpr (kSums == 2) planes.at(acc_plane(slot, 1), it, q, lane) = Chunk{};
      }
  __syncthreads();  // gamma is staged

  for (int64_t r = int64_t(blockIdx.x) * S::kRowsPerBlock + slot; r < rows;
       r += int64_t(gridDim.x) * S::kRowsPerBlock) {
    Vec<T, N> xs[S::kIters], dys[S::kIters];
    load_raw<T, N, S>(saved + r * cols, cols, lane, xs);
    load_raw<T, N, S>(dy + r * cols, cols, lane, dys);
    Vec<T, N> dhs[S::kIters];  // loaded with the row where registers allow, else at the store
    if constexpr (kAdd && kPrefetchOperand<S>) load_raw<T, N, S>(dh + r * cols, cols, lane, dhs);
    const A rs = rstd[r];
    const A mu = saved_is_output || mode == NormMode::kRms ? A(0) : mean[r];
    // xhat of element k of vector `it` (gm, bt: its gamma/beta). The memory-efficient form
    // divides by gamma with __fdividef (2 ulp): xhat from a rounded y is no closer than that, and
    // an IEEE division's slow-path call would keep registers live across the whole row.
    auto xhat = [&](int it, int k, const A(&gm)[N], const A(&bt)[N]) {
      const A x_raw = to_acc(xs[it].v[k]);
      return saved_is_output ? __fdividef(x_raw - bt[k], gm[k]) : (x_raw - mu) * rs;
    };
    // No mean subtracted (kRms, kKerasRmsScaling): dx needs rstd * mean(g * x), summed on raw x,
    // since mean(g * xhat) + mean * rstd * mean(g) cancels for rows far from zero; and
    // kKerasRmsScaling's x - mean is re-centred by its own residual (sum_c), so the rounding of
    // the stored mean does not enter.
    A sum_g = 0, sum_gx = 0, sum_c = 0;
#pragma unroll
    for (int it = 0; it < S::kIters; ++it) {
      const int c = column<N, S>(it, lane);
      if (c >= cols) continue;
      A gm[N], bt[N];
      planes.get(kGamma, it, lane, gm);
      load_param(saved_is_output ? beta : nullptr, c, A(0), bt);
#pragma unroll
      for (int q = 0; q < Smem::kChunks; ++q) {  // a chunk of dgamma/dbeta accumulators at a time
        Chunk ag{}, ab{};
        if (partial) {
          ag = planes.at(acc_plane(slot, 0), it, q, lane);
          if constexpr (kSums == 2) ab = planes.at(acc_plane(slot, 1), it, q, lane);
        }
#pragma unroll
        for (int j = 0; j < Smem::kChunk; ++j) {
          const int k = q * Smem::kChunk + j;
          const A d = to_acc(dys[it].v[k]), x_raw = to_acc(xs[it].v[k]), g = dy_gamma(d, gm[k]);
          sum_g += g;
          if (centred) {
            const A xh = xhat(it, k, gm, bt);
            ag.v[j] += d * xh;
            ab.v[j] += d;
            sum_gx += g * xh;
          } else {
            ag.v[j] += d * x_raw * rs;  // dgamma = sum dy x rstd
            sum_gx += g * x_raw;
            sum_c += x_raw - mu;
          }
        }
        if (partial) {
          planes.at(acc_plane(slot, 0), it, q, lane) = ag;
          if constexpr (kSums == 2) planes.at(acc_plane(slot, 1), it, q, lane) = ab;
        }
      }
    }
    A sums[3] = {sum_g, sum_gx, sum_c};
    row_sums<S>(sums, smem, slot, lane);
    const A mg = sums[0] * inv_cols, mgx = sums[1] * inv_cols;
    const A shift = mode == NormMode::kKerasRmsScaling ? sums[2] * inv_cols * rs : A(0);
    const A k_mean = centred ? mg : A(0);
    const A k_xhat = centred ? mgx : rs * mgx;
    store_row<T, N, S>(dx + r * cols, cols, lane, [&](int it, int c, A(&out)[N]) {
      A gm[N], bt[N];
      planes.get(kGamma, it, lane, gm);
      load_param(saved_is_output ? beta : nullptr, c, A(0), bt);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const A g = dy_gamma(to_acc(dys[it].v[k]), gm[k]);
        out[k] = rs * (g - k_mean - (xhat(it, k, gm, bt) - shift) * k_xhat);
      }
      if constexpr (kAdd) {
        if constexpr (!kPrefetchOperand<S>)
          dhs[it] = *reinterpret_cast<const Vec<T, N>*>(dh + r * cols + c);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = to_acc(from_acc<T>(out[k])) + to_acc(dhs[it].v[k]);
      }
    });
  }
  if (!partial) return;
  __syncthreads();  // every slot's accumulators are final
  if (slot != 0) return;
  A* pg = partial + int64_t(blockIdx.x) * kSums * cols;  // one group per block: dgamma, dbeta
#pragma unroll
  for (int which = 0; which < kSums; ++which)
#pragma unroll
    for (int it = 0; it < S::kIters; ++it) {
      const int c = column<N, S>(it, lane);
      if (c >= cols) continue;
#pragma unroll
      for (int q = 0; q < Smem::kChunks; ++q) {
        Chunk s = planes.at(acc_plane(0, which), it, q, lane);
        for (int j = 1; j < S::kRowsPerBlock; ++j)  // slot order
#pragma unroll
          for (int e = 0; e < Smem::kChunk; ++e)
            s.v[e] += planes.at(acc_plane(j, which), it, q, lane).v[e];
        *reinterpret_cast<Chunk*>(pg + which * cols + c + q * Smem::kChunk) = s;
      }
    }
}

// Rows too wide for registers, or a residual of another dtype than x's: a block per row, three
// passes over the row in memory. R: the type of the row normalized (x's, or the residual's and
// h's).
template <typename T, typename P, typename R>
__global__ void __launch_bounds__(kStreamThreads)
    forward_stream_kernel(const T* __restrict__ x, const R* __restrict__ residual,
                          R* __restrict__ h, const P* __restrict__ gamma,
                          const P* __restrict__ beta, T* __restrict__ y, A* __restrict__ mean,
                          A* __restrict__ rstd, int64_t rows, int64_t cols, A inv_cols, A eps,
                          A goff, NormMode mode) {
  __shared__ A smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const R* xr;  // the row normalized
    if (residual) {
      R* hr = h + r * cols;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
        hr[c] = from_acc<R>(to_acc(x[r * cols + c]) + to_acc(residual[r * cols + c]));
      __syncthreads();  // h[0] is read by every thread below
      xr = hr;
    } else {
      xr = reinterpret_cast<const R*>(x + r * cols);  // R is T without a residual
    }
    A mu = 0;
    if (mode != NormMode::kRms) {
      const A x0 = to_acc(xr[0]);  // the mean as x[0] + mean(x - x[0]), as above
      A sum = 0;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += to_acc(xr[c]) - x0;
      mu = x0 + cuda::block_sum(sum, smem) * inv_cols;
    }
    A sq = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A d = to_acc(xr[c]) - mu;
      sq += d * d;
    }
    const A rs = rsqrtf(cuda::block_sum(sq, smem) * inv_cols + eps);
    const A shift = mode == NormMode::kLayer ? mu : A(0);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      y[r * cols + c] = from_acc<T>((to_acc(xr[c]) - shift) * rs * gamma_at(gamma, c, goff) +
                                    param(beta, c, A(0)));
    if (threadIdx.x == 0) {
      if (mean) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// Block b owns partial row b and accumulates into it over the rows it visits.
// R: saved's type (x's, or h's with a residual); dh and dresidual are R's (either may be null).
template <typename T, typename P, typename R>
__global__ void __launch_bounds__(kStreamThreads)
    backward_stream_kernel(const T* __restrict__ dy, const R* __restrict__ saved,
                           const A* __restrict__ mean, const A* __restrict__ rstd,
                           const P* __restrict__ gamma, const P* __restrict__ beta,
                           const R* __restrict__ dh, T* __restrict__ dx,
                           R* __restrict__ dresidual, A* __restrict__ partial, int64_t rows,
                           int64_t cols, A inv_cols, A goff, bool saved_is_output,
                           NormMode mode) {
  __shared__ A smem[32];
  const bool centred = mode == NormMode::kLayer;
  A* pg = partial ? partial + int64_t(blockIdx.x) * 2 * cols : nullptr;
  if (pg)
    for (int64_t c = threadIdx.x; c < 2 * cols; c += blockDim.x) pg[c] = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const R* sr = saved + r * cols;
    const T* dyr = dy + r * cols;
    const A rs = rstd[r];
    const A mu = saved_is_output || mode == NormMode::kRms ? A(0) : mean[r];
    auto xhat = [&](int64_t c) {
      return saved_is_output ? (to_acc(sr[c]) - param(beta, c, A(0))) / gamma_at(gamma, c, goff)
                             : (to_acc(sr[c]) - mu) * rs;
    };
    A sum_g = 0, sum_gx = 0, sum_c = 0;  // scale-only sums as in backward_kernel
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A d = to_acc(dyr[c]), x_raw = to_acc(sr[c]), g = dy_gamma(d, gamma_at(gamma, c, goff));
      sum_g += g;
      if (centred) {
        sum_gx += g * xhat(c);
      } else {
        sum_gx += g * x_raw;
        sum_c += x_raw - mu;
      }
      if (pg) {  // each column is owned by one thread: no race
        pg[c] += centred ? d * xhat(c) : d * x_raw * rs;
        pg[cols + c] += d;
      }
    }
    const A mg = cuda::block_sum(sum_g, smem) * inv_cols;
    const A mgx = cuda::block_sum(sum_gx, smem) * inv_cols;
    const A shift = mode == NormMode::kKerasRmsScaling  // uniform: every thread joins the sum
                        ? cuda::block_sum(sum_c, smem) * inv_cols * rs
                        : A(0);
    const A k_mean = centred ? mg : A(0);
    const A k_xhat = centred ? mgx : rs * mgx;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A g = dy_gamma(to_acc(dyr[c]), gamma_at(gamma, c, goff));
      const int64_t i = r * cols + c;
      const A d = plus_dh(rs * (g - k_mean - (xhat(c) - shift) * k_xhat), dh, i);
      if (dresidual) {
        dresidual[i] = from_acc<R>(d);
        dx[i] = from_acc<T>(to_acc(dresidual[i]));
      } else {
        dx[i] = from_acc<T>(d);
      }
    }
  }
}

// dgamma[c] / dbeta[c] = sum over groups of the partials (`sums` rows of cols per group: dgamma,
// and dbeta when 2), in a fixed order: 32 columns per block of (32, 32) threads.
template <typename P>
__global__ void reduce_partials_kernel(const A* __restrict__ partial, int64_t groups, int sums,
                                       int64_t cols, P* __restrict__ dgamma,
                                       P* __restrict__ dbeta) {
  __shared__ A smem[32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const A g = cuda::column_sum(partial, groups, sums * cols, cols, smem);
  const A b = sums == 2 ? cuda::column_sum(partial + cols, groups, sums * cols, cols, smem) : A(0);
  if (threadIdx.y != 0 || c >= cols) return;
  if (dgamma) dgamma[c] = from_acc<P>(g);
  if (dbeta) dbeta[c] = from_acc<P>(b);
}

// For the first shape of `Shapes` that holds a row of `cols` elements as vectors of N, returns
// fn(S{}) (whether it launched); false when there is none (too wide for registers).
template <typename Shapes, int N, typename Fn>
bool with_shape(int64_t cols, Fn&& fn) {
  bool found = false, launched = false;
  std::apply(
      [&](auto... shapes) {
        auto try_one = [&](auto s) {
          using S = decltype(s);
          if (!found && int64_t(S::kThreads) * S::kIters * N >= cols) {
            found = true;
            launched = fn(s);
          }
        };
        (try_one(shapes), ...);
      },
      Shapes{});
  return launched;
}

void check_args(const char* op, int64_t rows, int64_t cols, DType dtype) {
  if (rows < 0) fail(std::string(op) + ": rows must be >= 0, got " + std::to_string(rows));
  if (cols < 1) fail(std::string(op) + ": cols must be >= 1, got " + std::to_string(cols));
  if (cols > INT32_MAX) fail(std::string(op) + ": cols must be < 2^31");
  if (dtype == DType::kFloat64) fail(std::string(op) + ": float64 is not supported on CUDA");
}

// Calls fn(T{}, P{}) for the CUDA storage types of x and gamma/beta.
template <typename Fn>
void dispatch2(DType dtype, DType param_dtype, Fn&& fn) {
  cuda::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, double>) {
      fail("norm: float64 is not supported on CUDA");
    } else if (param_dtype == dtype) {
      fn(t, t);
    } else {
      fn(t, float{});
    }
  });
}

// gamma and beta (where present) allow loads of `bytes`-byte vectors.
bool params_aligned(const void* gamma, const void* beta, size_t bytes) {
  return (!gamma || cuda::aligned(gamma, bytes)) && (!beta || cuda::aligned(beta, bytes));
}

// kAdd of the kernels' launches: the add+norm instances or the plain norm's.
using Add = std::true_type;
using NoAdd = std::false_type;

int64_t backward_groups_max() { return int64_t(cuda::sm_count()) * kBackwardMaxBlocksPerSm; }

}  // namespace

void norm_forward_cuda(const NormForwardArgs& a, cudaStream_t stream) {
  const int64_t rows = a.rows, cols = a.cols;
  check_args("norm", rows, cols, a.dtype);
  if (rows == 0) return;
  dispatch2(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    const T* xp = static_cast<const T*>(a.x);
    T* yp = static_cast<T*>(a.y);
    const P* gp = static_cast<const P*>(a.gamma);
    const P* bp = a.mode == NormMode::kLayer ? static_cast<const P*>(a.beta) : nullptr;
    A* mp = static_cast<A*>(a.mean);
    A* rp = static_cast<A*>(a.rstd);
    const A eps = A(a.eps), goff = A(a.gamma_offset);
    const A inv_cols = A(1.0 / double(cols));  // means as products: no division in the kernels
    const int64_t max_blocks = int64_t(cuda::sm_count()) * 32;  // streaming kernel
    const int64_t stream_blocks = std::min(rows, max_blocks);
    if (a.residual && a.residual_dtype != a.dtype) {  // float32 residual, 16-bit x
      if constexpr (sizeof(T) == 2) {
        forward_stream_kernel<T, P, float><<<stream_blocks, kStreamThreads, 0, stream>>>(
            xp, static_cast<const float*>(a.residual), static_cast<float*>(a.h), gp, bp, yp, mp,
            rp, rows, cols, inv_cols, eps, goff, a.mode);
        cuda::check_launch("norm forward");
      }
      return;
    }
    const T* res = static_cast<const T*>(a.residual);
    T* hp = static_cast<T*>(a.h);
    auto launch = [&](auto n_tag, auto add_tag) {
      constexpr int N = decltype(n_tag)::value;
      constexpr bool kAdd = decltype(add_tag)::value;
      using Shapes = ShapesFor<T, ForwardShapes16, ForwardShapes32>;
      return with_shape<Shapes, N>(cols, [&](auto s) {
        using S = decltype(s);
        // A block per row group, no persistent loop: blocks start as SMs free up, so the
        // loads of the next rows overlap the reductions and stores of the current ones.
        const int64_t blocks = std::min<int64_t>((rows + S::kRowsPerBlock - 1) / S::kRowsPerBlock,
                                                 INT32_MAX);
        forward_kernel<T, P, N, S, kAdd><<<blocks, S::kBlock, 0, stream>>>(
            xp, res, hp, gp, bp, yp, mp, rp, rows, int(cols), inv_cols, eps, goff, a.mode);
        return true;
      });
    };
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = cols % kVec == 0 && cuda::aligned(xp, 16) && cuda::aligned(yp, 16) &&
                     (!res || (cuda::aligned(res, 16) && cuda::aligned(hp, 16))) &&
                     params_aligned(gp, bp, kVec * sizeof(P));
    using Vectorized = std::integral_constant<int, kVec>;
    const bool done = vec ? (res ? launch(Vectorized{}, Add{}) : launch(Vectorized{}, NoAdd{}))
                          : !res && launch(std::integral_constant<int, 1>{}, NoAdd{});
    if (!done)  // also unaligned rows with a residual
      forward_stream_kernel<T, P, T><<<stream_blocks, kStreamThreads, 0, stream>>>(
          xp, res, hp, gp, bp, yp, mp, rp, rows, cols, inv_cols, eps, goff, a.mode);
    cuda::check_launch("norm forward");
  });
}

size_t norm_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype) {
  check_args("norm_backward", rows, cols, dtype);
  return size_t(backward_groups_max()) * 2 * size_t(cols) * sizeof(A);
}

void norm_backward_cuda(const NormBackwardArgs& a, cudaStream_t stream) {
  const int64_t rows = a.rows, cols = a.cols;
  check_args("norm_backward", rows, cols, a.dtype);
  const bool want_params = a.dgamma || a.dbeta;
  const bool saved_is_output = a.saved_is_output;
  dispatch2(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    const T* dyp = static_cast<const T*>(a.dy);
    const T* sp = static_cast<const T*>(a.saved);
    const A* mp = static_cast<const A*>(a.mean);
    const A* rp = static_cast<const A*>(a.rstd);
    const P* gp = static_cast<const P*>(a.gamma);
    const P* bp = static_cast<const P*>(a.beta);
    T* dxp = static_cast<T*>(a.dx);
    A* partial = want_params ? static_cast<A*>(a.workspace) : nullptr;
    const A goff = A(a.gamma_offset);
    const A inv_cols = A(1.0 / double(cols));
    int64_t groups = 0;  // groups of partials: one per block
    // dbeta partials only where dbeta is wanted and exists (the stream kernel always keeps both).
    int sums = a.dbeta && a.mode == NormMode::kLayer ? 2 : 1;
    const auto launch_stream = [&](auto r_tag) {
      using R = decltype(r_tag);
      sums = 2;
      groups = std::max<int64_t>(1, std::min(rows, int64_t(cuda::sm_count()) * 2));
      backward_stream_kernel<T, P, R><<<groups, kStreamThreads, 0, stream>>>(
          dyp, static_cast<const R*>(a.saved), mp, rp, gp, bp, static_cast<const R*>(a.dh),
          dxp, static_cast<R*>(a.dresidual), partial, rows, cols, inv_cols, goff,
          saved_is_output, a.mode);
    };
    const T* dhp = a.add ? static_cast<const T*>(a.dh) : nullptr;
    auto launch = [&](auto n_tag, auto sums_tag, auto add_tag) {
      constexpr int N = decltype(n_tag)::value, kSums = decltype(sums_tag)::value;
      constexpr bool kAdd = decltype(add_tag)::value;
      using Shapes = ShapesFor<T, BackwardShapes16, BackwardShapes32>;
      return with_shape<Shapes, N>(cols, [&](auto s) {
        using S = decltype(s);
        const size_t smem = backward_smem_bytes<N, S, kSums>(partial != nullptr);
        // Resident blocks only, so every block gets rows and none waits for a second wave.
        const int64_t per_sm = std::min(
            cuda::resident_blocks<backward_kernel<T, P, N, S, kSums, kAdd>>(S::kBlock, smem,
                                                                             !partial),
            kBackwardMaxBlocksPerSm);
        if (per_sm == 0) return false;  // accumulators too large for this device
        const int64_t blocks = std::max<int64_t>(
            1, std::min((rows + S::kRowsPerBlock - 1) / S::kRowsPerBlock,
                        int64_t(cuda::sm_count()) * per_sm));
        groups = blocks;
        backward_kernel<T, P, N, S, kSums, kAdd><<<blocks, S::kBlock, smem, stream>>>(
            dyp, sp, mp, rp, gp, bp, dhp, dxp, partial, rows, int(cols), inv_cols, goff,
            saved_is_output, a.mode);
        return true;
      });
    };
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = cols % kVec == 0 && cuda::aligned(dyp, 16) && cuda::aligned(sp, 16) &&
                     cuda::aligned(dxp, 16) && (!dhp || cuda::aligned(dhp, 16)) &&
                     params_aligned(gp, bp, kVec * sizeof(P));
    auto launch_sums = [&](auto n_tag, auto add_tag) {
      return sums == 2 ? launch(n_tag, std::integral_constant<int, 2>{}, add_tag)
                       : launch(n_tag, std::integral_constant<int, 1>{}, add_tag);
    };
    using Vectorized = std::integral_constant<int, kVec>;
    if (a.add && a.residual_dtype != a.dtype) {  // float32 residual, 16-bit x
      if constexpr (sizeof(T) == 2) launch_stream(float{});
    } else if (!(vec ? (dhp ? launch_sums(Vectorized{}, Add{})
                            : launch_sums(Vectorized{}, NoAdd{}))
                     : !dhp && launch_sums(std::integral_constant<int, 1>{}, NoAdd{}))) {
      launch_stream(T{});  // also unaligned rows with dh
    }
    cuda::check_launch("norm backward");
    if (!want_params) return;
    reduce_partials_kernel<P><<<(cols + 31) / 32, dim3(32, 32), 0, stream>>>(
        partial, groups, sums, cols, static_cast<P*>(a.dgamma), static_cast<P*>(a.dbeta));
    cuda::check_launch("norm reduce_partials_kernel");
  });
}

}  // namespace fusedlayers
