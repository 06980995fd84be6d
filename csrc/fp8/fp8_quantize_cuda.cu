// CUDA FP8 quantization: one block of 256 threads per 128x128 tile. Each warp loads 16 of the
// tile's rows (a lane 4 adjacent values of each), takes each row's 1x128 amax by warp shuffles
// or the tile's by a block reduction, and writes the FP8 row; with transpose the tile also goes
// through shared memory (rows padded to an odd number of words: conflict-free columns) and each
// warp writes 16 of x^T's rows. Tensorwise scaling first reduces the tensor's amax (atomicMax on
// the float's bits, which orders non-negative floats and puts NaN above Inf). The values go
// through the hardware's conversion (two a cvt on sm_89+) of the float32 product, moved one ulp
// toward the exact product where it lies on a tie of the FP8 grid: fp8.h's rounding, so results
// match the CPU kernels bit for bit.
#include <cuda_fp8.h>

#include "fp8/fp8.h"
#include "util/cuda_common.cuh"

namespace fusedlayers {
namespace {

using cuda::to_acc;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kFp8Block / kWarps;  // 16

__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fp8::amax_step(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// |x * s| as a float32 whose round-to-nearest-even in the format is that of the exact product:
// fl(x * s), one ulp toward the exact product where fl(x * s) lies exactly on a tie (the dropped
// bits, below the format's step at that magnitude, are exactly one half).
__device__ __forceinline__ float magnitude_for_cvt(float x, float s, Fp8Format f) {
  const float p = x * s;
  const float r = fmaf(x, s, -p);
  const uint32_t au = __float_as_uint(p) & 0x7fffffffu;
  const int man = f == Fp8Format::kE4M3 ? 3 : 2, min_exp = f == Fp8Format::kE4M3 ? -6 : -14;
  const int drop = 23 - man + max(0, min_exp - (int(au >> 23) - 127));
  const uint32_t significand = (au & 0x7fffffu) | 0x800000u;
  const bool tie = drop <= 24 && (significand << (32 - drop)) == 0x80000000u;
  if (tie && r != 0.f) return __uint_as_float(au + ((r > 0.f) == (p > 0.f) ? 1u : 0xffffffffu));
  return __uint_as_float(au);
}

// Two values quantized with multiplier s, as fp8::quantize does (sign from the product, NaN to
// 0x7F): the first in the low byte.
__device__ __forceinline__ uint32_t quantize2(float x0, float x1, float s, Fp8Format f) {
  const float2 m = make_float2(magnitude_for_cvt(x0, s, f), magnitude_for_cvt(x1, s, f));
  uint32_t q = __nv_cvt_float2_to_fp8x2(m, __NV_SATFINITE,
                                        f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  const float p0 = x0 * s, p1 = x1 * s;
  q |= (__float_as_uint(p0) >> 31 << 7) | (__float_as_uint(p1) >> 31 << 15);
  if (p0 != p0) q = (q & 0xff00u) | 0x7fu;
  if (p1 != p1) q = (q & 0x00ffu) | 0x7f00u;
  return q;
}

template <typename T>
__host__ __device__ constexpr int tile_stride() { return kFp8Block + 4 / int(sizeof(T)); }  // odd words

template <typename T, Fp8Scaling kScaling, bool kTranspose, bool kVector>
__global__ void __launch_bounds__(kThreads)
    quantize_tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, Fp8Format f,
                         bool pow2, const float* __restrict__ tensor_amax,
                         uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                         uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t) {
  extern __shared__ unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);
  __shared__ float warp_max[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t stripe = blockIdx.y, cb = blockIdx.x;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
  const int64_t c = c0 + 4 * lane;
  float v[kRowsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
    if constexpr (kVector) {
      cuda::Vec<T, 4> in{};
      if (r < rows && c < cols) in = *reinterpret_cast<const cuda::Vec<T, 4>*>(x + r * cols + c);
#pragma unroll
      for (int k = 0; k < 4; ++k) v[i][k] = to_acc(in.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        v[i][k] = r < rows && c + k < cols ? to_acc(x[r * cols + c + k]) : 0.f;
    }
  }
  if constexpr (kTranspose) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        tile[(warp + kWarps * i) * tile_stride<T>() + 4 * lane + k] =
            cuda::from_acc<T>(v[i][k]);  // exact: v came from T
  }
  float tile_s = 0.f;
  if constexpr (kScaling == Fp8Scaling::kTensorwise) {
    tile_s = fp8::multiplier(*tensor_amax, f, pow2);
  } else if constexpr (kScaling == Fp8Scaling::kBlock128x128) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) amax = fp8::amax_step(amax, v[i][k]);
    amax = warp_amax(amax);
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
    amax = 0.f;
    for (int w = 0; w < kWarps; ++w) amax = fp8::amax_step(amax, warp_max[w]);
    tile_s = fp8::multiplier(amax, f, pow2);
    if (threadIdx.x == 0) {
      const int64_t col_blocks = gridDim.x, stripes = gridDim.y;
      scale_inv[stripe * col_blocks + cb] = 1.f / tile_s;
      if (kTranspose) scale_inv_t[cb * stripes + stripe] = 1.f / tile_s;
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
    float s = tile_s;
    if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
      float amax = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) amax = fp8::amax_step(amax, v[i][k]);
      amax = warp_amax(amax);  // the padding's zeros leave it as it is
      s = fp8::multiplier(amax, f, pow2);
      if (lane == 0 && r < rows) scale_inv[cb * rows + r] = 1.f / s;
    }
    if (r >= rows) continue;
    const uint32_t out = quantize2(v[i][0], v[i][1], s, f) | quantize2(v[i][2], v[i][3], s, f) << 16;
    if (kVector && c < cols) {
      *reinterpret_cast<uint32_t*>(q + r * cols + c) = out;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (c + k < cols) q[r * cols + c + k] = uint8_t(out >> (8 * k));
    }
  }
  if constexpr (kTranspose) {
    __syncthreads();
    // warp w: x^T's rows c0 + w + 8 j; lane: x's rows r0 + lane + 32 i
#pragma unroll 4
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int tc = warp + kWarps * j;
      const int64_t col = c0 + tc;
      float t[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) t[i] = to_acc(tile[(lane + 32 * i) * tile_stride<T>() + tc]);
      float s = tile_s;
      if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = fp8::amax_step(amax, t[i]);  // rows past x: zeros
        amax = warp_amax(amax);
        s = fp8::multiplier(amax, f, pow2);
        if (lane == 0 && col < cols) scale_inv_t[stripe * cols + col] = 1.f / s;
      }
      if (col >= cols) continue;
      const uint32_t out = quantize2(t[0], t[1], s, f) | quantize2(t[2], t[3], s, f) << 16;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t r = r0 + lane + 32 * i;
        if (r < rows) q_t[col * rows + r] = uint8_t(out >> (8 * i));
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    tensor_amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ amax_out) {
  __shared__ float warp_max[kWarps];
  float amax = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads)
    amax = fp8::amax_step(amax, to_acc(x[i]));
  amax = warp_amax(amax);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) amax = fp8::amax_step(amax, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax_out), fp8::bits(amax));
  }
}

__global__ void tensor_scale_kernel(const float* amax, Fp8Format f, bool pow2, float* scale_inv,
                                    float* scale_inv_t) {
  const float s_inv = 1.f / fp8::multiplier(*amax, f, pow2);
  *scale_inv = s_inv;
  if (scale_inv_t) *scale_inv_t = s_inv;
}

template <typename T, Fp8Scaling kScaling, bool kTranspose, bool kVector>
void launch_tiles(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  constexpr auto kernel = quantize_tile_kernel<T, kScaling, kTranspose, kVector>;
  const size_t smem = kTranspose ? size_t(kFp8Block) * tile_stride<T>() * sizeof(T) : 0;
  if (smem > 48 * 1024 && cuda::resident_blocks<kernel>(kThreads, smem) == 0)
    fail("fp8_quantize: the device cannot give a block " + std::to_string(smem) +
         " bytes of shared memory");
  const dim3 grid(unsigned((cols + kFp8Block - 1) / kFp8Block),
                  unsigned((rows + kFp8Block - 1) / kFp8Block));
  kernel<<<grid, kThreads, smem, stream>>>(x, rows, cols, a.format, a.power_of_2_scales, a.amax,
                                           a.q, a.scale_inv, a.q_t, a.scale_inv_t);
  cuda::check_launch("fp8_quantize");
}

template <typename T, Fp8Scaling kScaling>
void launch_tiles(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  const bool vector = cols % 4 == 0 && cuda::aligned(x, 4 * sizeof(T));
  if (a.q_t) {
    vector ? launch_tiles<T, kScaling, true, true>(a, x, rows, cols, stream)
           : launch_tiles<T, kScaling, true, false>(a, x, rows, cols, stream);
  } else {
    vector ? launch_tiles<T, kScaling, false, true>(a, x, rows, cols, stream)
           : launch_tiles<T, kScaling, false, false>(a, x, rows, cols, stream);
  }
}

}  // namespace

void fp8_quantize_cuda(const Fp8Quantize& a, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows > int64_t(65535) * kFp8Block)
    fail("fp8_quantize: x has more than " + std::to_string(65535 * kFp8Block) +
         " rows on CUDA, got " + std::to_string(rows));
  cuda::dispatch(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      const T* x = static_cast<const T*>(a.x.data);
      switch (a.scaling) {
        case Fp8Scaling::kTensorwise: {
          cuda::check(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), "cudaMemsetAsync");
          const int64_t n = rows * cols;
          if (n > 0) {
            const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                     int64_t(cuda::sm_count()) * 8));
            tensor_amax_kernel<T><<<blocks, kThreads, 0, stream>>>(x, n, a.amax);
            cuda::check_launch("fp8_quantize (amax)");
          }
          tensor_scale_kernel<<<1, 1, 0, stream>>>(a.amax, a.format, a.power_of_2_scales,
                                                   a.scale_inv, a.scale_inv_t);
          cuda::check_launch("fp8_quantize (scale)");
          if (n > 0) launch_tiles<T, Fp8Scaling::kTensorwise>(a, x, rows, cols, stream);
          break;
        }
        case Fp8Scaling::kBlock1x128:
          launch_tiles<T, Fp8Scaling::kBlock1x128>(a, x, rows, cols, stream);
          break;
        case Fp8Scaling::kBlock128x128:
          launch_tiles<T, Fp8Scaling::kBlock128x128>(a, x, rows, cols, stream);
          break;
      }
    }
  });
}

}  // namespace fusedlayers
