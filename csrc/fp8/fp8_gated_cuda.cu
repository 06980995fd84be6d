// CUDA FP8 gated activations (fp8_gated.h): one block of 256 threads per 128x128 tile of the
// values, computed with the gated kernels' math (cuda_gated.cuh), rounded to T into a
// shared-memory tile and quantized from there with fp8_tile.cuh's quantize_tile, x's and x^T's
// rows as fp8_quantize's staged kernel does. The forward stages gate's and up's tiles in shared
// memory (cp.async where the strides and pointers allow 16-byte chunks) and computes in place,
// three blocks an SM overlapping each other's loads; the backward loads dy, gate and up into
// registers (half of a thread's loads in flight at once, two blocks an SM) and computes a tile
// of dgate and the matching tile of dup. Tensorwise scaling first reduces the values' amax in a
// pass of its own.
#include "activation/cuda_gated.cuh"
#include "fp8/fp8_gated.h"
#include "fp8/fp8_tile.cuh"

namespace fusedlayers {
namespace {

using namespace fp8_tile;
using cuda::from_acc;

template <typename T>
using Chunk = cuda::Vec<T, StagedTile<T>::kPerChunk>;

// A chunk of a row at p, zeros where !valid; one 16-byte load where vec (the same for every
// thread: a uniform branch).
template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* __restrict__ p, bool valid, bool vec) {
  Chunk<T> v;
  if (!valid) {
#pragma unroll
    for (int k = 0; k < StagedTile<T>::kPerChunk; ++k) v.v[k] = from_acc<T>(0.f);
  } else if (vec) {
    v = *reinterpret_cast<const Chunk<T>*>(p);
  } else {
#pragma unroll
    for (int k = 0; k < StagedTile<T>::kPerChunk; ++k) v.v[k] = p[k];
  }
  return v;
}

// Stage the tile (r0, c0) of a row-major operand (rows `stride` apart) in shared memory: cp.async
// where vec, element loads elsewhere; rows past the end as zeros. Completes with
// cp_async_wait_all() and a barrier.
template <typename T>
__device__ __forceinline__ void stage(const StagedTile<T>& tile, const T* __restrict__ x,
                                      int64_t stride, int64_t r0, int64_t c0, int64_t rows,
                                      bool vec) {
  constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  for (int i = threadIdx.x; i < kFp8Block * kChunks; i += kThreads) {
    const int row = i / kChunks, j = i % kChunks;
    const int64_t r = r0 + row;
    const bool valid = r < rows;
    const T* p = valid ? x + r * stride + c0 + j * kPer : x;
    if (vec) cp_async16(tile.chunk(row, j), p, valid);
    else *reinterpret_cast<Chunk<T>*>(tile.chunk(row, j)) = load_chunk<T>(p, valid, false);
  }
}

// The tile's chunks a thread computes (T a half type): kIters of them, the it-th at (row, chunk).
template <typename T>
struct TileWork {
  static constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  static constexpr int kIters = kFp8Block * kChunks / kThreads;  // 8
  __device__ __forceinline__ static int row(int it) {
    return (threadIdx.x + it * kThreads) / kChunks;
  }
  __device__ __forceinline__ static int chunk(int it) {
    return (threadIdx.x + it * kThreads) % kChunks;
  }
};

// The values of act(gate) * up: the tile (stripe, cb) staged (gate's and up's tiles in shared
// memory), computed in place of gate's and quantized from there (x^T by kScalingT).
template <typename T, GatedActivation kAct, Fp8Scaling kScaling, bool kTranspose,
          Fp8Scaling kScalingT>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks of 64 KB fill the SM's shared memory
    forward_kernel(const T* __restrict__ gate, int64_t gs, const T* __restrict__ up, int64_t us,
                   int64_t rows, int64_t cols, bool vec, Fp8Format f, bool pow2,
                   const float* __restrict__ tensor_amax, uint8_t* __restrict__ q,
                   float* __restrict__ scale_inv, uint8_t* __restrict__ q_t,
                   float* __restrict__ scale_inv_t) {
  constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t warp_max[kWarps];
  const StagedTile<T> g_tile{smem_raw}, u_tile{smem_raw + StagedTile<T>::kBytes};
  const int64_t col_blocks = cols / kFp8Block;
  const int64_t stripe = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
  stage(g_tile, gate, gs, r0, c0, rows, vec);
  stage(u_tile, up, us, r0, c0, rows, vec);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  for (int i = threadIdx.x; i < kFp8Block * kChunks; i += kThreads) {
    const int row = i / kChunks, j = i % kChunks;
    const Chunk<T> g = g_tile.load(row, j), u = u_tile.load(row, j);
    Chunk<T> y;
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      y.v[k] = from_acc<T>(cuda::activation<kAct>(to_acc(g.v[k])) * to_acc(u.v[k]));
    *reinterpret_cast<Chunk<T>*>(g_tile.chunk(row, j)) = y;
  }
  __syncthreads();
  const float tensor_s =
      kScaling == Fp8Scaling::kTensorwise ? fp8::multiplier(*tensor_amax, f, pow2) : 0.f;
  quantize_tile<T, kScaling, kTranspose, kScalingT>(g_tile, stripe, cb, rows, cols, f, pow2,
                                                    tensor_s, q, scale_inv, q_t, scale_inv_t,
                                                    warp_max);
}

// The values of [dgate | dup] (rows x 2 cols): the tile (stripe, cb) of dgate and (stripe,
// cb + cols / 128) of dup.
template <typename T, GatedActivation kAct, Fp8Scaling kScaling, bool kTranspose>
__global__ void __launch_bounds__(kThreads, 2)  // 2 blocks of 64 KB
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ gate, int64_t gs,
                    const T* __restrict__ up, int64_t us, int64_t rows, int64_t cols,
                    bool vec, Fp8Format f, bool pow2, const float* __restrict__ tensor_amax,
                    uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                    uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t) {
  using W = TileWork<T>;
  constexpr int kBatch = W::kIters / 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t warp_max[kWarps];
  const StagedTile<T> dgate_tile{smem_raw}, dup_tile{smem_raw + StagedTile<T>::kBytes};
  const int64_t col_blocks = cols / kFp8Block;
  const int64_t stripe = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
#pragma unroll
  for (int b = 0; b < W::kIters; b += kBatch) {  // a batch's loads in flight at once
    Chunk<T> d[kBatch], g[kBatch], u[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t r = r0 + W::row(b + i), c = c0 + W::chunk(b + i) * W::kPer;
      const bool valid = r < rows;
      d[i] = load_chunk<T>(valid ? dy + r * cols + c : dy, valid, vec);
      g[i] = load_chunk<T>(valid ? gate + r * gs + c : gate, valid, vec);
      u[i] = load_chunk<T>(valid ? up + r * us + c : up, valid, vec);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      Chunk<T> dg, du;
#pragma unroll
      for (int k = 0; k < W::kPer; ++k) {
        float a, da;
        cuda::activation_and_grad<kAct>(to_acc(g[i].v[k]), a, da);
        const float dk = to_acc(d[i].v[k]);
        du.v[k] = from_acc<T>(dk * a);
        dg.v[k] = from_acc<T>(dk * to_acc(u[i].v[k]) * da);
      }
      *reinterpret_cast<Chunk<T>*>(dgate_tile.chunk(W::row(b + i), W::chunk(b + i))) = dg;
      *reinterpret_cast<Chunk<T>*>(dup_tile.chunk(W::row(b + i), W::chunk(b + i))) = du;
    }
  }
  __syncthreads();
  const float tensor_s =
      kScaling == Fp8Scaling::kTensorwise ? fp8::multiplier(*tensor_amax, f, pow2) : 0.f;
  quantize_tile<T, kScaling, kTranspose>(dgate_tile, stripe, cb, rows, 2 * cols, f, pow2,
                                         tensor_s, q, scale_inv, q_t, scale_inv_t, warp_max);
  __syncthreads();  // warp_max is the next call's
  quantize_tile<T, kScaling, kTranspose>(dup_tile, stripe, cb + col_blocks, rows, 2 * cols, f,
                                         pow2, tensor_s, q, scale_inv, q_t, scale_inv_t,
                                         warp_max);
}

// Tensorwise: the values' amax (as bits, atomicMax into *amax_out, zeroed before), from the same
// rounded values the tiles compute; dy null for the forward's values.
template <typename T, GatedActivation kAct>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ dy, const T* __restrict__ gate, int64_t gs,
                const T* __restrict__ up, int64_t us, int64_t rows, int64_t cols, bool vec,
                float* __restrict__ amax_out) {
  constexpr int kPer = StagedTile<T>::kPerChunk;
  __shared__ uint32_t warp_max[kWarps];
  const int64_t per_row = cols / kPer, chunks = rows * per_row;
  uint32_t amax = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < chunks;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / per_row, c = (i - r * per_row) * kPer;
    const Chunk<T> g = load_chunk<T>(gate + r * gs + c, true, vec);
    const Chunk<T> u = load_chunk<T>(up + r * us + c, true, vec);
    if (dy == nullptr) {
#pragma unroll
      for (int k = 0; k < kPer; ++k)
        amax = max(amax, abs_bits(to_acc(from_acc<T>(cuda::activation<kAct>(to_acc(g.v[k])) *
                                                      to_acc(u.v[k])))));
    } else {
      const Chunk<T> d = load_chunk<T>(dy + r * cols + c, true, vec);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        float a, da;
        cuda::activation_and_grad<kAct>(to_acc(g.v[k]), a, da);
        const float dk = to_acc(d.v[k]);
        amax = max(amax, abs_bits(to_acc(from_acc<T>(dk * a))));
        amax = max(amax, abs_bits(to_acc(from_acc<T>(dk * to_acc(u.v[k]) * da))));
      }
    }
  }
  amax = block_amax(amax, warp_max);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_out), amax);
}

// launch(T{}, act, scaling, transpose) for the arguments' dtype, activation, scaling (1x128 or
// tensorwise: fp8_gated.h) and whether x^T is written.
template <typename Fn>
void dispatch(const char* op, DType dtype, GatedActivation act, const Fp8Target& out,
              Fn&& launch) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
    fail(std::string(op) + ": float16 or bfloat16 only");
  cuda::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      with_activation(act, [&](auto act_tag) {
        const auto with_t = [&](auto s_tag) {
          if (out.q_t) launch(t, act_tag, s_tag, std::true_type{});
          else launch(t, act_tag, s_tag, std::false_type{});
        };
        using S = Fp8Scaling;
        if (out.scaling == S::kTensorwise) with_t(std::integral_constant<S, S::kTensorwise>{});
        else with_t(std::integral_constant<S, S::kBlock1x128>{});
      });
    }
  });
}

// Whether every chunk of the rows is one aligned 16-byte load.
bool vectorizable(int64_t gs, int64_t us, std::initializer_list<const void*> pointers) {
  bool vec = gs % 8 == 0 && us % 8 == 0;  // 16 bytes of any dtype: a multiple of 8 elements
  for (const void* p : pointers) vec = vec && cuda::aligned(p, 16);
  return vec;
}

// Tensorwise: zero the amax, reduce the values' into it, write the scales.
template <typename T, GatedActivation kAct>
void tensor_amax(const char* op, const Fp8Target& out, const T* dy, const T* gate, int64_t gs,
                 const T* up, int64_t us, RowsCols rc, bool vec, cudaStream_t stream) {
  cuda::check(cudaMemsetAsync(out.amax, 0, sizeof(float), stream), "cudaMemsetAsync");
  const int64_t chunks = rc.rows * rc.cols / StagedTile<T>::kPerChunk;
  if (chunks > 0) {
    const int blocks = int(std::min<int64_t>((chunks + kThreads - 1) / kThreads,
                                             int64_t(cuda::sm_count()) * 8));
    amax_kernel<T, kAct><<<blocks, kThreads, 0, stream>>>(dy, gate, gs, up, us, rc.rows,
                                                          rc.cols, vec, out.amax);
    cuda::check_launch(op);
  }
  tensor_scale_kernel<<<1, 1, 0, stream>>>(out.amax, out.format, out.power_of_2_scales,
                                           out.scale_inv, out.q_t ? out.scale_inv_t : nullptr);
  cuda::check_launch(op);
}

// One block per tile of gate's rows x cols, with smem bytes of dynamic shared memory.
template <auto Kernel>
unsigned tile_blocks(const char* op, RowsCols rc, size_t smem) {
  if (cuda::resident_blocks<Kernel>(kThreads, smem) == 0)
    fail(std::string(op) + ": the device cannot give a block " + std::to_string(smem) +
         " bytes of shared memory");
  const int64_t tiles = (rc.rows + kFp8Block - 1) / kFp8Block * (rc.cols / kFp8Block);
  if (tiles > INT32_MAX) fail(std::string(op) + ": too many rows on CUDA");
  return unsigned(tiles);
}

}  // namespace

void fp8_gated_forward_cuda(const Fp8GatedForward& a, int64_t gs, int64_t us, RowsCols rc,
                            cudaStream_t stream) {
  const char* op = "fp8_gated_forward_cuda";
  const Fp8Target& o = a.out;
  const bool vec = vectorizable(gs, us, {a.gate.t.data, a.up.t.data});
  dispatch(op, a.gate.t.dtype, a.activation, o, [&](auto t, auto act, auto scaling, auto tr) {
    using T = decltype(t);
    constexpr GatedActivation kAct = decltype(act)::value;
    constexpr Fp8Scaling kScaling = decltype(scaling)::value;
    constexpr bool kTranspose = decltype(tr)::value;
    const T* gate = static_cast<const T*>(a.gate.t.data);
    const T* up = static_cast<const T*>(a.up.t.data);
    if (kScaling == Fp8Scaling::kTensorwise)
      tensor_amax<T, kAct>(op, o, nullptr, gate, gs, up, us, rc, vec, stream);
    if (rc.rows * rc.cols == 0) return;
    const auto run = [&](auto scaling_t) {
      constexpr auto kernel =
          forward_kernel<T, kAct, kScaling, kTranspose, decltype(scaling_t)::value>;
      const size_t smem = 2 * size_t(StagedTile<T>::kBytes);
      kernel<<<tile_blocks<kernel>(op, rc, smem), kThreads, smem, stream>>>(
          gate, gs, up, us, rc.rows, rc.cols, vec, o.format, o.power_of_2_scales, o.amax, o.q,
          o.scale_inv, o.q_t, o.scale_inv_t);
    };
    using S = Fp8Scaling;
    if constexpr (kTranspose && kScaling == S::kBlock1x128) {
      if (o.scaling_t == S::kBlock128x128) run(std::integral_constant<S, S::kBlock128x128>{});
      else run(scaling);
    } else {
      run(scaling);
    }
    cuda::check_launch(op);
  });
}

void fp8_gated_backward_cuda(const Fp8GatedBackward& a, int64_t gs, int64_t us, RowsCols rc,
                             cudaStream_t stream) {
  const char* op = "fp8_gated_backward_cuda";
  const Fp8Target& o = a.out;
  const bool vec = vectorizable(gs, us, {a.dy.data, a.gate.t.data, a.up.t.data});
  dispatch(op, a.gate.t.dtype, a.activation, o, [&](auto t, auto act, auto scaling, auto tr) {
    using T = decltype(t);
    constexpr GatedActivation kAct = decltype(act)::value;
    constexpr Fp8Scaling kScaling = decltype(scaling)::value;
    const T* dy = static_cast<const T*>(a.dy.data);
    const T* gate = static_cast<const T*>(a.gate.t.data);
    const T* up = static_cast<const T*>(a.up.t.data);
    if (kScaling == Fp8Scaling::kTensorwise)
      tensor_amax<T, kAct>(op, o, dy, gate, gs, up, us, rc, vec, stream);
    if (rc.rows * rc.cols == 0) return;
    constexpr auto kernel = backward_kernel<T, kAct, kScaling, decltype(tr)::value>;
    const size_t smem = 2 * size_t(StagedTile<T>::kBytes);
    kernel<<<tile_blocks<kernel>(op, rc, smem), kThreads, smem, stream>>>(
        dy, gate, gs, up, us, rc.rows, rc.cols, vec, o.format, o.power_of_2_scales, o.amax, o.q,
        o.scale_inv, o.q_t, o.scale_inv_t);
    cuda::check_launch(op);
  });
}

}  // namespace fusedlayers
