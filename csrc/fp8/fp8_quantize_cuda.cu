// CUDA FP8 quantization by 128x128 tiles of x, a block of 256 threads per tile. Where x's rows
// are whole 16-byte chunks (the usual case), staged_tile_kernel: the block copies its tile into
// shared memory (cp.async) and quantizes it from there (fp8_tile.cuh's quantize_tile: x's rows
// and, with transpose, x^T's, each written 8 bytes a lane). Elsewhere quantize_tile_kernel: each
// warp loads 16 of the tile's rows (a lane 4 adjacent values of each) and, with transpose,
// passes the tile through shared memory (rows padded to an odd number of words: conflict-free
// columns). Either takes each 1x128 block's amax by warp shuffles or the tile's by a block
// reduction. Tensorwise scaling first reduces the tensor's amax (atomicMax on the bits): two
// passes over x. The values go through the hardware's conversion of the float32 product rounded
// to odd: fp8.h's rounding, so results match the CPU kernels bit for bit.
#include "fp8/fp8_tile.cuh"

namespace fusedlayers {
namespace {

using cuda::to_acc;
using namespace fp8_tile;

template <typename T>
__host__ __device__ constexpr int tile_stride() {  // in values: rows of an odd number of words
  return kFp8Block + 4 / int(sizeof(T));
}

// Any x: one block per 128x128 tile, element loads (staged_tile_kernel takes rows of 16-byte
// chunks).
template <typename T, Fp8Scaling kScaling, bool kTranspose, Fp8Scaling kScalingT>
__global__ void __launch_bounds__(kThreads)
    quantize_tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, Fp8Format f,
                         bool pow2, const float* __restrict__ tensor_amax,
                         uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                         uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t) {
  extern __shared__ unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);
  __shared__ uint32_t warp_max[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t stripe = blockIdx.y, cb = blockIdx.x;
  const int64_t r0 = stripe * kFp8Block, c0 = cb * kFp8Block;
  const int64_t c = c0 + 4 * lane;
  cuda::Vec<T, 4> raw[kRowsPerWarp];  // as loaded, widened where used
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      raw[i].v[k] = r < rows && c + k < cols ? x[r * cols + c + k] : cuda::from_acc<T>(0.f);
  }
  const auto v = [&](int i, int k) { return to_acc(raw[i].v[k]); };
  if constexpr (kTranspose) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        tile[(warp + kWarps * i) * tile_stride<T>() + 4 * lane + k] = raw[i].v[k];
  }
  float tile_s = 0.f;
  if constexpr (kScaling == Fp8Scaling::kTensorwise) {
    tile_s = fp8::multiplier(*tensor_amax, f, pow2);
  } else if constexpr (kScaling == Fp8Scaling::kBlock128x128 ||
                       (kTranspose && kScalingT == Fp8Scaling::kBlock128x128)) {
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) amax = max(amax, abs_bits(v(i, k)));
    amax = block_amax(amax, warp_max);
    tile_s = fp8::multiplier(__uint_as_float(amax), f, pow2);
    if (threadIdx.x == 0) {  // rows of scales padded to 4 floats (fp8.h)
      const int64_t ld = (gridDim.x + 3) / 4 * 4, ld_t = (gridDim.y + 3) / 4 * 4;
      if (kScaling == Fp8Scaling::kBlock128x128) scale_inv[stripe * ld + cb] = 1.f / tile_s;
      if (kTranspose) scale_inv_t[cb * ld_t + stripe] = 1.f / tile_s;
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
    float s = tile_s;
    if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
      uint32_t amax = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) amax = max(amax, abs_bits(v(i, k)));
      amax = warp_amax(amax);  // the padding's zeros leave it as it is
      s = fp8::multiplier(__uint_as_float(amax), f, pow2);
      if (lane == 0 && r < rows) scale_inv[cb * rows + r] = 1.f / s;
    }
    if (r >= rows) continue;
    const float vals[4] = {v(i, 0), v(i, 1), v(i, 2), v(i, 3)};
    uint32_t out[1];
    quantize_values(vals, s, f, out);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (c + k < cols) q[r * cols + c + k] = uint8_t(out[0] >> (8 * k));
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
      if constexpr (kScalingT == Fp8Scaling::kBlock1x128) {
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = max(amax, abs_bits(t[i]));  // rows past x: zeros
        amax = warp_amax(amax);
        s = fp8::multiplier(__uint_as_float(amax), f, pow2);
        if (lane == 0 && col < cols) scale_inv_t[stripe * cols + col] = 1.f / s;
      }
      if (col >= cols) continue;
      uint32_t out[1];
      quantize_values(t, s, f, out);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t r = r0 + lane + 32 * i;
        if (r < rows) q_t[col * rows + r] = uint8_t(out[0] >> (8 * i));
      }
    }
  }
}

// The tensor's amax (as bits, atomicMax into *amax_out, zeroed before): 16-byte chunks from x's
// first 16-byte boundary on, four loads in flight a thread; the values before it and after the
// last whole chunk one at a time.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    tensor_amax_kernel(const T* __restrict__ x, int64_t n, float* __restrict__ amax_out) {
  using W = Words<T>;
  __shared__ uint32_t warp_max[kWarps];
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t head =
      min(n, int64_t((16 - reinterpret_cast<uintptr_t>(x) % 16) % 16 / sizeof(T)));
  const int64_t chunks = (n - head) / W::kPer;
  const uint4* __restrict__ c = reinterpret_cast<const uint4*>(x + head);
  uint32_t acc = 0;
  int64_t i = first;
  for (; i + 3 * stride < chunks; i += 4 * stride) {
    const uint4 a = c[i], b = c[i + stride], d = c[i + 2 * stride], e = c[i + 3 * stride];
    acc = W::chunk_max(W::chunk_max(W::chunk_max(W::chunk_max(acc, a), b), d), e);
  }
  for (; i < chunks; i += stride) acc = W::chunk_max(acc, c[i]);
  uint32_t amax = W::amax_bits(acc);
  for (int64_t k = first; k < head; k += stride) amax = max(amax, abs_bits(to_acc(x[k])));
  for (int64_t k = head + chunks * W::kPer + first; k < n; k += stride)
    amax = max(amax, abs_bits(to_acc(x[k])));
  amax = block_amax(amax, warp_max);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_out), amax);
}

// x's rows as 16-byte chunks (cols a multiple of 16 / sizeof(T), x 16-byte aligned): one block
// of 256 threads per tile copies it into shared memory (cp.async: the whole tile's loads in
// flight at once, not through registers) and quantizes it from there: x's rows (a half or whole
// warp per row, a lane one chunk) and, with transpose, x^T's (fp8_tile.cuh). Four blocks an SM
// (three for float32's 64 KB tiles) overlap each other's loads and quantization; a persistent
// block double-buffering its tiles keeps fewer loads in flight and is slower.
template <typename T, Fp8Scaling kScaling, bool kTranspose, Fp8Scaling kScalingT>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 3)
    staged_tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, Fp8Format f,
                       bool pow2, const float* __restrict__ tensor_amax,
                       uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                       uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t) {
  using Tile = StagedTile<T>;
  constexpr int kPer = Tile::kPerChunk, kChunks = Tile::kChunks;
  constexpr int kRowStep = kThreads / kChunks;  // a thread copies chunk jt of every kRowStep-th row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t warp_max[kWarps];
  const Tile tile{smem_raw};
  const int64_t stripe = blockIdx.y, cb = blockIdx.x;
  const int jt = threadIdx.x % kChunks, row_t = threadIdx.x / kChunks;
  const int64_t r = stripe * kFp8Block + row_t, c = cb * kFp8Block + jt * kPer;
  const int64_t rows_left = c < cols ? rows - r : 0;
  const T* src = x + r * cols + c;
#pragma unroll
  for (int k = 0; k < kFp8Block / kRowStep; ++k, src += kRowStep * cols) {
    const bool valid = k * kRowStep < rows_left;
    cp_async16(tile.chunk(row_t + k * kRowStep, jt), valid ? src : x, valid);
  }
  cp_async_commit();
  const float tensor_s = kScaling == Fp8Scaling::kTensorwise
                             ? fp8::multiplier(*tensor_amax, f, pow2) : 0.f;
  cp_async_wait_all();
  __syncthreads();
  quantize_tile<T, kScaling, kTranspose, kScalingT>(tile, stripe, cb, rows, cols, f, pow2,
                                                    tensor_s, q, scale_inv, q_t, scale_inv_t,
                                                    warp_max);
}

template <typename T, Fp8Scaling kScaling, bool kTranspose, Fp8Scaling kScalingT = kScaling>
void launch_tiles(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  const dim3 grid(unsigned(col_blocks), unsigned((rows + kFp8Block - 1) / kFp8Block));
  if (cols % StagedTile<T>::kPerChunk == 0 && cuda::aligned(x, 16) && cuda::aligned(a.q, 8)) {
    constexpr auto kernel = staged_tile_kernel<T, kScaling, kTranspose, kScalingT>;
    const size_t smem = StagedTile<T>::kBytes;
    if (smem > 48 * 1024 && cuda::resident_blocks<kernel>(kThreads, smem) == 0)
      fail("fp8_quantize: the device cannot give a block " + std::to_string(smem) +
           " bytes of shared memory");
    kernel<<<grid, kThreads, smem, stream>>>(x, rows, cols, a.format, a.power_of_2_scales,
                                             a.amax, a.q, a.scale_inv, a.q_t, a.scale_inv_t);
  } else {
    constexpr auto kernel = quantize_tile_kernel<T, kScaling, kTranspose, kScalingT>;
    const size_t smem = kTranspose ? size_t(kFp8Block) * tile_stride<T>() * sizeof(T) : 0;
    if (smem > 48 * 1024 && cuda::resident_blocks<kernel>(kThreads, smem) == 0)
      fail("fp8_quantize: the device cannot give a block " + std::to_string(smem) +
           " bytes of shared memory");
    kernel<<<grid, kThreads, smem, stream>>>(x, rows, cols, a.format, a.power_of_2_scales,
                                             a.amax, a.q, a.scale_inv, a.q_t, a.scale_inv_t);
  }
  cuda::check_launch("fp8_quantize");
}

template <typename T, Fp8Scaling kScaling>
void launch_tiles(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  if (!a.q_t) return launch_tiles<T, kScaling, false>(a, x, rows, cols, stream);
  if constexpr (kScaling == Fp8Scaling::kBlock1x128) {
    if (a.scaling_t == Fp8Scaling::kBlock128x128)
      return launch_tiles<T, kScaling, true, Fp8Scaling::kBlock128x128>(a, x, rows, cols, stream);
  }
  launch_tiles<T, kScaling, true>(a, x, rows, cols, stream);
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
            const int64_t per_thread = 4 * StagedTile<T>::kPerChunk;
            const int blocks = int(std::min<int64_t>(
                (n + kThreads * per_thread - 1) / (kThreads * per_thread),
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
