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

// x * s rounded to float32 toward zero with its last bit set where that dropped anything (round
// to odd): float32 keeps more than the format's bits + 2, so the hardware's round-to-nearest-even
// of it to the format (saturating) is that of the exact product, fp8.h's rule (Boldo and
// Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
// odd", IEEE TC 2008). x and s finite: a product too small for float32's normals is far below the
// format's smallest subnormal, whatever its last bit.
__device__ __forceinline__ float product_to_odd(float x, float s) {
  const float p = __fmul_rz(x, s);
  const float r = fmaf(x, s, -p);
  uint32_t b = __float_as_uint(p);  // a compare and a predicated or (not compare, select, or)
  asm("{\n .reg .pred inexact;\n setp.ne.f32 inexact, %1, 0f00000000;\n @inexact or.b32 %0, %0, 1;\n}"
      : "+r"(b) : "f"(r));
  return __uint_as_float(b);
}

// N values (a multiple of 4) quantized with multiplier s, as fp8::quantize does, 4 to a word
// (the first in the low byte): the products rounded to odd, converted two at a time. A NaN s (a
// block with a NaN or Inf: every product NaN) gives 0x7F each; any other s is finite, as are the
// block's values.
template <int N>
__device__ __forceinline__ void quantize_values(const float (&x)[N], float s, Fp8Format f,
                                                uint32_t (&out)[N / 4]) {
  float p[N];
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = product_to_odd(x[k], s);
  const auto convert = [&](__nv_fp8_interpretation_t kind) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      out[k] = uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(p[4 * k], p[4 * k + 1]),
                                                 __NV_SATFINITE, kind)) |
               uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(p[4 * k + 2], p[4 * k + 3]),
                                                 __NV_SATFINITE, kind)) << 16;
  };
  if (f == Fp8Format::kE4M3) convert(__NV_E4M3);  // the format's branch per N values, not per pair
  else convert(__NV_E5M2);
  if (s != s) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) out[k] = 0x7f7f7f7fu;
  }
}

// A 16-byte chunk of T as words: the k-th value, the chunk's kPer values quantized (kPer bytes),
// and running maxes of |x| kept per word (half types two at a time, on their bits: |x|'s bits
// order as |x| does, NaN above Inf, and sm_90 takes the max of two 16-bit halves in one
// instruction).
template <typename T>
struct Words {
  static constexpr int kPer = 16 / int(sizeof(T));
  static constexpr bool kPacked = sizeof(T) == 2;

  __device__ __forceinline__ static float value(const uint4& c, int k) {
    const uint32_t w = (&c.x)[kPacked ? k / 2 : k];
    if constexpr (!kPacked) {
      return __uint_as_float(w);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(k % 2 ? w & 0xffff0000u : w << 16);
    } else {
      return __half2float(__ushort_as_half((unsigned short)(k % 2 ? w >> 16 : w & 0xffffu)));
    }
  }
  // The running max of |x| of word w folded into acc (accs of the same word position).
  __device__ __forceinline__ static uint32_t max_abs(uint32_t acc, uint32_t w) {
    if constexpr (kPacked) return __vmaxu2(acc, w & 0x7fff7fffu);
    else return max(acc, w & 0x7fffffffu);
  }
  __device__ __forceinline__ static uint32_t max_acc(uint32_t a, uint32_t b) {
    if constexpr (kPacked) return __vmaxu2(a, b);
    else return max(a, b);
  }
  // The float32 bits of |x| held in half h (0 or 1) of a packed acc.
  __device__ __forceinline__ static uint32_t half_bits(uint32_t acc, int h) {
    const uint32_t b = h ? acc >> 16 : acc & 0xffffu;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return b << 16;
    else return __float_as_uint(__half2float(__ushort_as_half((unsigned short)b)));
  }
  // The float32 bits of the larger |x| an acc holds.
  __device__ __forceinline__ static uint32_t amax_bits(uint32_t acc) {
    if constexpr (!kPacked) return acc;
    else return half_bits(max(acc >> 16, acc & 0xffffu), 0);
  }
  __device__ __forceinline__ static uint32_t chunk_max(uint32_t acc, const uint4& c) {
    acc = max_abs(acc, c.x);
    acc = max_abs(acc, c.y);
    acc = max_abs(acc, c.z);
    return max_abs(acc, c.w);
  }
  // The chunk's kPer values quantized with s: 8 bytes (half types) or 4 (in x).
  __device__ __forceinline__ static uint2 quantize(const uint4& c, float s, Fp8Format f) {
    float x[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) x[k] = value(c, k);
    uint32_t out[kPer / 4];
    quantize_values(x, s, f, out);
    if constexpr (kPer == 8) return make_uint2(out[0], out[1]);
    else return make_uint2(out[0], 0u);
  }
};

// 16 bytes global -> shared without registers (cp.async; zeros where `valid` is false).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// A 128x128 tile in shared memory: rows of 16-byte chunks, a row's chunk j stored at j ^ g(row),
// g(row) = (row ^ row / 8) % 8, so that 8 lanes reading 8 chunks of a row (x's rows) hit distinct
// banks, as do 8 lanes reading one chunk of rows 8 apart (x^T's rows).
template <typename T>
struct StagedTile {
  static constexpr int kPerChunk = 16 / int(sizeof(T));         // values in a chunk
  static constexpr int kChunks = kFp8Block / kPerChunk;         // chunks in a row
  static constexpr int kBytes = kFp8Block * kFp8Block * int(sizeof(T));
  unsigned char* base;

  __device__ __forceinline__ void* chunk(int row, int j) const {
    return base + row * (kChunks * 16) + ((j ^ ((row ^ (row >> 3)) & 7)) * 16);
  }
  __device__ __forceinline__ cuda::Vec<T, kPerChunk> load(int row, int j) const {
    return *reinterpret_cast<const cuda::Vec<T, kPerChunk>*>(chunk(row, j));
  }
  __device__ __forceinline__ uint4 words(int row, int j) const {
    return *reinterpret_cast<const uint4*>(chunk(row, j));
  }
};

// Quantize the staged tile (stripe, cb) of x (rows x cols) into q and, with kTranspose, q_t.
// x's rows: a warp 16 rows, 4 at a time, 8 lanes a row, a lane its chunks j, j + 8, ... (16
// values); with 1x128 scaling each of the warp's first 16 lanes computes one row's scale. x^T's
// rows: a lane rg (of 16) and half cc of a warp takes x's rows 8 rg .. 8 rg + 7 of a chunk of
// columns and writes each column's 8 bytes at once; with 1x128 scaling the 16 lanes of a chunk
// reduce its columns' amaxes together and each computes one column's scale. warp_max: kWarps
// words of shared memory. kScalingT: x^T's scaling (fp8.h's scaling_t). Every thread of the
// block calls it (the 128x128 amax synchronizes them).
template <typename T, Fp8Scaling kScaling, bool kTranspose, Fp8Scaling kScalingT = kScaling>
__device__ __forceinline__ void quantize_tile(const StagedTile<T>& tile, int64_t stripe,
                                              int64_t cb, int64_t rows, int64_t cols,
                                              Fp8Format f, bool pow2, float tensor_s,
                                              uint8_t* __restrict__ q,
                                              float* __restrict__ scale_inv,
                                              uint8_t* __restrict__ q_t,
                                              float* __restrict__ scale_inv_t,
                                              uint32_t* warp_max) {
  static_assert(kScalingT == kScaling || (kScaling == Fp8Scaling::kBlock1x128 &&
                                          kScalingT == Fp8Scaling::kBlock128x128));
  // the tile's amax scales x's rows (128x128) or x^T's (kScalingT 128x128)
  constexpr bool kTileAmax = kScaling == Fp8Scaling::kBlock128x128 ||
                             (kTranspose && kScalingT == Fp8Scaling::kBlock128x128);
  using W = Words<T>;
  constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  constexpr int kLaneChunks = kChunks / 8;  // 2 | 4
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
  const int rho = lane / 8, j = lane % 8;
  // the lane's chunks of x's rows that lie in x (by 16-byte chunks: cols is a multiple of kPer)
  const int lane_chunks = int(min(int64_t(kLaneChunks), (cols - c0 - j * kPer + 8 * kPer - 1) /
                                                        (8 * kPer)));
  uint4 v[4][kLaneChunks];  // x's rows: pass p, the lane's chunks
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int i = 0; i < kLaneChunks; ++i) v[p][i] = tile.words(warp * 16 + p * 4 + rho, j + 8 * i);
  float tile_s = tensor_s;
  if constexpr (kTileAmax) {
    uint32_t acc = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) acc = W::chunk_max(acc, v[p][i]);
    const uint32_t amax = block_amax(W::amax_bits(acc), warp_max);
    tile_s = fp8::multiplier(__uint_as_float(amax), f, pow2);
    if (threadIdx.x == 0) {  // rows of scales padded to 4 floats (fp8.h)
      const int64_t stripes = (rows + kFp8Block - 1) / kFp8Block;
      if (kScaling == Fp8Scaling::kBlock128x128)
        scale_inv[stripe * ((col_blocks + 3) / 4 * 4) + cb] = 1.f / tile_s;
      if (kTranspose) scale_inv_t[cb * ((stripes + 3) / 4 * 4) + stripe] = 1.f / tile_s;
    }
  }
  float s_row[4];  // the multiplier of the lane's row in pass p
#pragma unroll
  for (int p = 0; p < 4; ++p) s_row[p] = tile_s;
  if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
    uint32_t acc[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      acc[p] = 0;
#pragma unroll
      for (int i = 0; i < kLaneChunks; ++i) acc[p] = W::chunk_max(acc[p], v[p][i]);
#pragma unroll
      for (int o = 4; o > 0; o >>= 1)  // the row's 8 lanes
        acc[p] = W::max_acc(acc[p], __shfl_xor_sync(kAll, acc[p], o));
    }
    // lane l (and l + 16) takes the warp's row l = 4 p + rho, whose amax lane 8 rho holds
    uint32_t mine = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t a = __shfl_sync(kAll, acc[p], (lane % 4) * 8);
      if (p == (lane % 16) / 4) mine = a;
    }
    const float s = fp8::multiplier(__uint_as_float(W::amax_bits(mine)), f, pow2);
    const int64_t r = r0 + warp * 16 + lane;
    if (lane < 16 && r < rows) scale_inv[cb * rows + r] = 1.f / s;
#pragma unroll
    for (int p = 0; p < 4; ++p) s_row[p] = __shfl_sync(kAll, s, 4 * p + rho);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int64_t r = r0 + warp * 16 + p * 4 + rho;
    if (r >= rows) continue;
    uint8_t* dst = q + r * cols + c0 + j * kPer;
#pragma unroll
    for (int i = 0; i < kLaneChunks; ++i) {
      if (i >= lane_chunks) continue;
      const uint2 out = W::quantize(v[p][i], s_row[p], f);
      if constexpr (kPer == 8) *reinterpret_cast<uint2*>(dst + 8 * i * kPer) = out;
      else *reinterpret_cast<uint32_t*>(dst + 8 * i * kPer) = out.x;
    }
  }
  if constexpr (kTranspose) {
    const int rg = lane % 16, cc = lane / 16;
    const int64_t r = r0 + 8 * rg;
    // 8 aligned bytes of a column of q_t at once where they are
    const bool whole = rows % 8 == 0 && r + 8 <= rows && cuda::aligned(q_t, 8);
#pragma unroll
    for (int it = 0; it < kChunks / 16; ++it) {
      const int jc = 16 * it + 2 * warp + cc;
      const int64_t col0 = c0 + jc * kPer;
      const int n_cols = int(min(int64_t(kPer), cols - col0));  // of the chunk's, in x
      uint4 t[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) t[i] = tile.words(8 * rg + i, jc);
      float s[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) s[k] = tile_s;
      if constexpr (kScalingT == Fp8Scaling::kBlock1x128) {
        uint32_t acc[4] = {0, 0, 0, 0};  // per word position: its columns' |x| maxes
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[0] = W::max_abs(acc[0], t[i].x);
          acc[1] = W::max_abs(acc[1], t[i].y);
          acc[2] = W::max_abs(acc[2], t[i].z);
          acc[3] = W::max_abs(acc[3], t[i].w);
        }
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int o = 8; o > 0; o >>= 1)  // the chunk's 16 lanes (rows past x: zeros)
            acc[w] = W::max_acc(acc[w], __shfl_xor_sync(kAll, acc[w], o));
        // lane rg takes column rg % kPer's scale; the others' come by shuffles
        const int k = rg % kPer, w = W::kPacked ? k / 2 : k;
        const uint32_t word = w == 0 ? acc[0] : w == 1 ? acc[1] : w == 2 ? acc[2] : acc[3];
        const uint32_t bits = W::kPacked ? W::half_bits(word, k % 2) : word;
        const float mine = fp8::multiplier(__uint_as_float(bits), f, pow2);
        if (rg < n_cols) scale_inv_t[stripe * cols + col0 + rg] = 1.f / mine;
#pragma unroll
        for (int kk = 0; kk < kPer; ++kk) s[kk] = __shfl_sync(kAll, mine, (lane & 16) | kk);
      }
      uint8_t* dst = q_t + col0 * rows + r;
#pragma unroll
      for (int k = 0; k < kPer; ++k, dst += rows) {
        if (k >= n_cols) continue;
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = W::value(t[i], k);
        uint32_t out[2];
        quantize_values(x, s[k], f, out);
        if (whole) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (r + i < rows) dst[i] = uint8_t(out[i / 4] >> (8 * (i % 4)));
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
