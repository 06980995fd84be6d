// Device pieces of the FP8 quantization that every CUDA kernel writing FP8 shares (fp8.h's
// rules on the device): the amax as bits, the conversion of two values, a 128x128 tile staged
// in shared memory and its quantization into x's and x^T's rows. Included by .cu files only.
#pragma once

#include <cuda_fp8.h>

#include "fp8/fp8.h"
#include "util/cuda_common.cuh"

namespace fusedlayers::fp8_tile {

using cuda::to_acc;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kFp8Block / kWarps;  // 16

// Amaxes as the bits of |x|: unsigned order is float order for non-negative floats and puts
// NaN above Inf, so the max keeps a NaN as fp8.h's amax does, in two integer operations.
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t warp_amax(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The max of every thread's v over the block (kThreads threads, all of which call it), returned
// to each; warp_max: kWarps words of shared memory.
__device__ __forceinline__ uint32_t block_amax(uint32_t v, uint32_t* warp_max) {
  v = warp_amax(v);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) v = max(v, warp_max[w]);
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

// Where the hardware's conversion of the float32 product p may differ from fp8.h's rule: p on a
// tie of the format's normal grid, below its smallest normal (ties there have more dropped
// bits; zero excepted), or NaN (the rule's 0x7F).
__device__ __forceinline__ bool needs_exact_path(float p, Fp8Format f) {
  const uint32_t au = abs_bits(p);
  const bool e4m3 = f == Fp8Format::kE4M3;
  const uint32_t low = e4m3 ? 0xfffffu : 0x1fffffu, half = (low >> 1) + 1;
  const uint32_t min_normal = uint32_t(127 + (e4m3 ? -6 : -14)) << 23;
  return (au & low) == half || au - 1u < min_normal - 1u || au > 0x7f800000u;
}

// Two values quantized with multiplier s, as fp8::quantize does: the first in the low byte.
// Mostly the hardware's conversion (two a cvt on sm_89+) of the float32 products; where one may
// differ from the rule (rare: ties, the format's subnormals, NaN), the tie-corrected magnitudes
// and the product's sign, NaN to 0x7F.
__device__ __forceinline__ uint32_t quantize2(float x0, float x1, float s, Fp8Format f) {
  const __nv_fp8_interpretation_t kind = f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  const float p0 = x0 * s, p1 = x1 * s;
  if (!(needs_exact_path(p0, f) || needs_exact_path(p1, f)))
    return __nv_cvt_float2_to_fp8x2(make_float2(p0, p1), __NV_SATFINITE, kind);
  const float2 m = make_float2(magnitude_for_cvt(x0, s, f), magnitude_for_cvt(x1, s, f));
  uint32_t q = __nv_cvt_float2_to_fp8x2(m, __NV_SATFINITE, kind);
  q |= (__float_as_uint(p0) >> 31 << 7) | (__float_as_uint(p1) >> 31 << 15);
  if (p0 != p0) q = (q & 0xff00u) | 0x7fu;
  if (p1 != p1) q = (q & 0x00ffu) | 0x7f00u;
  return q;
}

// 16 bytes global -> shared without registers (cp.async; zeros where `valid` is false).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// A 128x128 tile in shared memory: rows of 16-byte chunks, a row's chunk j stored at j ^ (row %
// 8), so that 8 lanes reading one chunk of 8 consecutive rows (the x^T pass) hit distinct banks,
// as do 8 lanes reading 8 chunks of a row.
template <typename T>
struct StagedTile {
  static constexpr int kPerChunk = 16 / int(sizeof(T));         // values in a chunk
  static constexpr int kChunks = kFp8Block / kPerChunk;         // chunks in a row
  static constexpr int kBytes = kFp8Block * kFp8Block * int(sizeof(T));
  unsigned char* base;

  __device__ __forceinline__ void* chunk(int row, int j) const {
    return base + row * (kChunks * 16) + ((j ^ (row & 7)) * 16);
  }
  __device__ __forceinline__ cuda::Vec<T, kPerChunk> load(int row, int j) const {
    return *reinterpret_cast<const cuda::Vec<T, kPerChunk>*>(chunk(row, j));
  }
};

// Quantize the staged tile (stripe, cb) of x (rows x cols) into q and, with kTranspose, q_t:
// x's rows a half or whole warp per row (a lane one chunk), x^T's rows a lane one chunk of a
// row, a warp 32 rows at a time. warp_max: kWarps words of shared memory. Every thread of the
// block calls it (the 128x128 amax synchronizes them).
template <typename T, Fp8Scaling kScaling, bool kTranspose>
__device__ __forceinline__ void quantize_tile(const StagedTile<T>& tile, int64_t stripe,
                                              int64_t cb, int64_t rows, int64_t cols,
                                              Fp8Format f, bool pow2, float tensor_s,
                                              uint8_t* __restrict__ q,
                                              float* __restrict__ scale_inv,
                                              uint8_t* __restrict__ q_t,
                                              float* __restrict__ scale_inv_t,
                                              uint32_t* warp_max) {
  constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  constexpr int kLanesPerRow = kChunks, kRowsPerPass = 32 / kLanesPerRow;  // 16, 2 | 32, 1
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
  // x's rows: warp w takes rows 16 w .. 16 w + 15, kRowsPerPass at a time
  const int sub = lane / kLanesPerRow, j = lane % kLanesPerRow;
  float tile_s = tensor_s;
  if constexpr (kScaling == Fp8Scaling::kBlock128x128) {
    uint32_t amax = 0;
    for (int p = 0; p < 16; p += kRowsPerPass) {
      const cuda::Vec<T, kPer> v = tile.load(warp * 16 + p + sub, j);
#pragma unroll
      for (int k = 0; k < kPer; ++k) amax = max(amax, abs_bits(to_acc(v.v[k])));
    }
    amax = block_amax(amax, warp_max);
    tile_s = fp8::multiplier(__uint_as_float(amax), f, pow2);
    if (threadIdx.x == 0) {  // rows of scales padded to 4 floats (fp8.h)
      const int64_t stripes = (rows + kFp8Block - 1) / kFp8Block;
      scale_inv[stripe * ((col_blocks + 3) / 4 * 4) + cb] = 1.f / tile_s;
      if (kTranspose) scale_inv_t[cb * ((stripes + 3) / 4 * 4) + stripe] = 1.f / tile_s;
    }
  }
  for (int p = 0; p < 16; p += kRowsPerPass) {
    const int row = warp * 16 + p + sub;
    const int64_t r = r0 + row, c = c0 + j * kPer;
    const cuda::Vec<T, kPer> v = tile.load(row, j);
    float s = tile_s;
    if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
      uint32_t amax = 0;
#pragma unroll
      for (int k = 0; k < kPer; ++k) amax = max(amax, abs_bits(to_acc(v.v[k])));
#pragma unroll
      for (int o = kLanesPerRow / 2; o > 0; o >>= 1)  // the row's lanes
        amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      s = fp8::multiplier(__uint_as_float(amax), f, pow2);
      if (j == 0 && r < rows) scale_inv[cb * rows + r] = 1.f / s;
    }
    if (r >= rows || c >= cols) continue;
    uint32_t out[kPer / 4];
#pragma unroll
    for (int k = 0; k < kPer / 4; ++k)
      out[k] = quantize2(to_acc(v.v[4 * k]), to_acc(v.v[4 * k + 1]), s, f) |
               quantize2(to_acc(v.v[4 * k + 2]), to_acc(v.v[4 * k + 3]), s, f) << 16;
    if constexpr (kPer == 8)
      *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(out[0], out[1]);
    else
      *reinterpret_cast<uint32_t*>(q + r * cols + c) = out[0];
  }
  if constexpr (kTranspose) {
    // x^T's rows: warp w takes x's column chunks w, w + 8, ...; a lane rows lane + 32 i
    for (int jc = warp; jc < kChunks; jc += kWarps) {
      cuda::Vec<T, kPer> v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = tile.load(lane + 32 * i, jc);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int64_t col = c0 + jc * kPer + k;
        float s = tile_s;
        if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
          uint32_t amax = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) amax = max(amax, abs_bits(to_acc(v[i].v[k])));
          amax = warp_amax(amax);  // rows past x: zeros
          s = fp8::multiplier(__uint_as_float(amax), f, pow2);
          if (lane == 0 && col < cols) scale_inv_t[stripe * cols + col] = 1.f / s;
        }
        if (col >= cols) continue;
        const uint32_t out = quantize2(to_acc(v[0].v[k]), to_acc(v[1].v[k]), s, f) |
                             quantize2(to_acc(v[2].v[k]), to_acc(v[3].v[k]), s, f) << 16;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t r = r0 + lane + 32 * i;
          if (r < rows) q_t[col * rows + r] = uint8_t(out >> (8 * i));
        }
      }
    }
  }
}

// The tensorwise scales once the tensor's amax is known.
static __global__ void tensor_scale_kernel(const float* amax, Fp8Format f, bool pow2,
                                           float* scale_inv, float* scale_inv_t) {
  const float s_inv = 1.f / fp8::multiplier(*amax, f, pow2);
  *scale_inv = s_inv;
  if (scale_inv_t) *scale_inv_t = s_inv;
}

}  // namespace fusedlayers::fp8_tile
