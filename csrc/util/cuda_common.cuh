// Shared by the CUDA kernels: error checks that throw fusedlayers::Error, fp32/fp64 math on
// fp16/bf16 storage, 16-byte vectors, warp and block reductions, the dtype switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "util/common.h"

namespace fusedlayers {
namespace cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    fail(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// After a launch: configuration errors surface here, not at the next unrelated call.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline int sm_count() {
  int device, count;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  return count;
}

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v) {
  return static_cast<T>(v);
}
template <> __device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__host__ __device__ inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Blocks of `Kernel` (`threads` threads, `smem` bytes of dynamic shared memory) one SM holds at
// once; 0 when the device cannot give a block that much shared memory. A kernel launches with at
// most two smem sizes, each always with the same `slot` (0 or 1). Worked out once per device,
// kernel and slot, so it costs nothing per launch (the shared memory opt-in, a per-device function
// attribute, is set to the device's most); racing first calls agree.
template <auto Kernel>
int resident_blocks(int threads, size_t smem, int slot = 0) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[2][kMaxDevices];  // [slot][device]: blocks + 1, 0 = unknown
  int device;
  check(cudaGetDevice(&device), "cudaGetDevice");
  std::atomic<int>* entry = device < kMaxDevices ? &known[slot][device] : nullptr;
  if (entry && entry->load() > 0) return entry->load() - 1;
  int optin = 0, n = 0;
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute");
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, Kernel), "cudaFuncGetAttributes");
  if (smem + attr.sharedSizeBytes <= size_t(optin)) {
    if (smem + attr.sharedSizeBytes > 48 * 1024)  // static + dynamic: opt in to the most
      check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 optin - int(attr.sharedSizeBytes)),
            "cudaFuncSetAttribute");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  if (entry) entry->store(n + 1);
  return n;
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (all threads get the result); `smem` holds one A per warp.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // smem may still be read by the previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < warps; ++w) total += smem[w];  // same order in every thread
  return total;
}

// Column sums of per-group partials, for a block of (32, 32) threads: column
// blockIdx.x * 32 + threadIdx.x of the `groups` rows `stride` apart at `partial`. Thread row y sums
// groups y, y + 32, ... in order, then the 32 subtotals are added in order: a fixed order for any
// grid, so results are reproducible. The sum is returned in threadIdx.y == 0 (0 past cols).
template <typename A>
__device__ __forceinline__ A column_sum(const A* __restrict__ partial, int64_t groups,
                                        int64_t stride, int64_t cols, A (&smem)[32][33]) {
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  A s = 0;
  if (c < cols)
    for (int64_t g = threadIdx.y; g < groups; g += 32) s += partial[g * stride + c];
  __syncthreads();  // smem may still be read by a previous call
  smem[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  A total = 0;
  if (threadIdx.y == 0)
    for (int j = 0; j < 32; ++j) total += smem[j][threadIdx.x];
  return total;
}

// Calls fn(T{}) with T the CUDA storage type of `dtype`.
template <typename Fn>
void dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); return;
    case DType::kFloat64: fn(double{}); return;
    case DType::kFloat16: fn(__half{}); return;
    case DType::kBFloat16: fn(__nv_bfloat16{}); return;
  }
  fail(std::string("unsupported dtype ") + dtype_name(dtype));
}

}  // namespace cuda
}  // namespace fusedlayers
