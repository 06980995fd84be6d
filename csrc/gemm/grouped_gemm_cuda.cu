// The grouped GEMM on CUDA (math: grouped_gemm.h): each pass's products on CUTLASS's Hopper
// kernels where grouped_gemm_cuda_path and the pointers allow (grouped_gemm_sm90.h), else on a
// tiled kernel, plus the zeros the products leave out (rows past the last group; the wgrad of a
// group with no rows). Every group's extent is read from the offsets on the device.
#include <algorithm>

#include "util/cuda_common.cuh"
#include "gemm/grouped_gemm.h"
#include "gemm/grouped_gemm_sm90.h"

namespace fusedlayers {
namespace {

using cuda::Acc;
using cuda::from_acc;
using cuda::to_acc;

// Group g's clamped [start, end) rows (grouped_gemm.h).
__device__ __forceinline__ void group_rows(const int32_t* offsets, int64_t g, int64_t rows,
                                           int64_t& start, int64_t& end) {
  auto clamp = [&](int64_t v, int64_t lo) { return v < lo ? lo : v > rows ? rows : v; };
  start = g ? clamp(offsets[g - 1], 0) : 0;
  end = clamp(offsets[g], start);
}

// The tiled kernel: a 64 x 64 tile of D_g per block and step, 256 threads of 4 x 4 outputs, A
// and B staged through shared memory 16 deep in the accumulation type. grid.z: the group;
// ragged m: grid.y blocks stride over the group's row tiles.
constexpr int kTile = 64, kDepth = 16, kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) tiled_kernel(GroupedProduct p) {
  using A = typename Acc<T>::type;
  __shared__ A as[kDepth][kTile], bs[kDepth][kTile + 1];
  const int64_t g = blockIdx.z;
  int64_t start, end;
  group_rows(p.offsets, g, p.rows, start, end);
  const int64_t m = p.ragged_m ? end - start : p.m, kg = p.ragged_m ? p.k : end - start;
  const T* a = static_cast<const T*>(p.a) + (p.ragged_m ? start * p.a_m : start * p.a_k);
  const T* b = static_cast<const T*>(p.b) + (p.ragged_m ? g * p.k * p.n : start * p.b_k);
  T* d = static_cast<T*>(p.d) + (p.ragged_m ? start * p.n : g * p.m * p.n);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t col0 = int64_t(blockIdx.x) * kTile;
  for (int64_t row0 = int64_t(blockIdx.y) * kTile; row0 < m; row0 += int64_t(gridDim.y) * kTile) {
    A acc[4][4] = {};
    for (int64_t k0 = 0; k0 < kg; k0 += kDepth) {
      for (int e = threadIdx.x; e < kDepth * kTile; e += kThreads) {
        const int i = e % kTile, kk = e / kTile;
        const int64_t r = row0 + i, c = col0 + i, kx = k0 + kk;
        as[kk][i] = r < m && kx < kg ? A(to_acc(a[r * p.a_m + kx * p.a_k])) : A(0);
        bs[kk][i] = c < p.n && kx < kg ? A(to_acc(b[kx * p.b_k + c * p.b_n])) : A(0);
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kDepth; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += as[kk][ty * 4 + i] * bs[kk][tx * 4 + j];
      __syncthreads();
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t r = row0 + ty * 4 + i, c = col0 + tx * 4 + j;
        if (r < m && c < p.n) d[r * p.n + c] = from_acc<T>(acc[i][j]);
      }
  }
}

// Zeros in the rows of d (rows x cols) past the last group's end.
template <typename T>
__global__ void zero_tail_kernel(T* d, const int32_t* offsets, int64_t groups, int64_t rows,
                                 int64_t cols) {
  int64_t start, end;
  group_rows(offsets, groups - 1, rows, start, end);
  const int64_t n = (rows - end) * cols;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x)
    d[end * cols + e] = from_acc<T>(0);
}

// Zeros in d[g] (m x n each) for every group g with no rows (grid.y: the group).
template <typename T>
__global__ void zero_empty_groups_kernel(T* d, const int32_t* offsets, int64_t rows,
                                         int64_t size) {
  int64_t start, end;
  group_rows(offsets, blockIdx.y, rows, start, end);
  if (end > start) return;
  T* dg = d + int64_t(blockIdx.y) * size;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < size;
       e += int64_t(gridDim.x) * blockDim.x)
    dg[e] = from_acc<T>(0);
}

void tiled(const GroupedProduct& p, DType dtype, cudaStream_t stream) {
  const int64_t tiles_m = (p.m + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>((p.n + kTile - 1) / kTile),
                  static_cast<unsigned>(std::clamp<int64_t>(tiles_m, 1, p.ragged_m ? 32 : 65535)),
                  static_cast<unsigned>(p.groups));
  if (p.n == 0 || grid.z > 65535) {
    if (p.n == 0) return;
    fail("the grouped GEMM's tiled kernel takes at most 65535 groups, got " +
         std::to_string(p.groups));
  }
  cuda::dispatch(dtype, [&](auto t) {
    tiled_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p);
  });
  cuda::check_launch("grouped_gemm tiled");
}

// The zeros a pass's products leave out.
void zeros(const GroupedProduct& p, DType dtype, cudaStream_t stream) {
  cuda::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if (p.ragged_m)
      zero_tail_kernel<T><<<std::max(1, cuda::sm_count()), 256, 0, stream>>>(
          static_cast<T*>(p.d), p.offsets, p.groups, p.rows, p.n);
    else
      zero_empty_groups_kernel<T><<<dim3(8, static_cast<unsigned>(p.groups)), 256, 0, stream>>>(
          static_cast<T*>(p.d), p.offsets, p.rows, p.m * p.n);
  });
  cuda::check_launch("grouped_gemm zeros");
}

// The compute capability (major * 10 + minor) of the current device (the bindings' device
// guard; cudaStreamGetDevice is not allowed on a capturing stream), known once per device.
int device_arch() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];
  int device;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  if (device < kMaxDevices && known[device].load() > 0) return known[device].load();
  int major = 0, minor = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              "cudaDeviceGetAttribute");
  cuda::check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
              "cudaDeviceGetAttribute");
  if (device < kMaxDevices) known[device].store(major * 10 + minor);
  return major * 10 + minor;
}

#ifdef FUSEDLAYERS_WITH_CUTLASS_SM90
size_t sm90_workspace_size(int64_t groups) {
  return std::max({grouped_gemm_sm90_workspace_size<Sm90Layout::kRowsNK>(groups),
                   grouped_gemm_sm90_workspace_size<Sm90Layout::kRowsKN>(groups),
                   grouped_gemm_sm90_workspace_size<Sm90Layout::kWgrad>(groups)});
}

// The product on the Hopper kernels: fprop and dgrad read A row-major (a_k == 1) and B with k
// or n contiguous; the wgrad reads A with m contiguous and B with n.
void sm90(const GroupedProduct& p, void* workspace, cudaStream_t stream) {
  Sm90GroupedGemm a{p.a, p.b, p.d, p.offsets, p.groups, p.rows, p.m, p.n, p.k, workspace};
  if (!p.ragged_m)
    grouped_gemm_sm90<Sm90Layout::kWgrad>(a, stream);
  else if (p.b_k == 1)
    grouped_gemm_sm90<Sm90Layout::kRowsNK>(a, stream);
  else
    grouped_gemm_sm90<Sm90Layout::kRowsKN>(a, stream);
}
#endif

// One product on the kernels that take it, then its zeros.
void run(const GroupedProduct& p, DType dtype, const GroupedGemmShape& s, void* workspace,
         cudaStream_t stream) {
  bool on_sm90 = false;
#ifdef FUSEDLAYERS_WITH_CUTLASS_SM90
  on_sm90 = workspace && grouped_gemm_cuda_path(dtype, s, device_arch()) ==
                             GroupedGemmPath::kSm90 &&
            cuda::aligned(p.a, 16) && cuda::aligned(p.b, 16) && cuda::aligned(p.d, 16);
  if (on_sm90) sm90(p, workspace, stream);
#else
  (void)s, (void)workspace;
#endif
  if (!on_sm90) tiled(p, dtype, stream);
  if (p.ragged_m || on_sm90) zeros(p, dtype, stream);  // the tiled wgrad writes its zeros
}

}  // namespace

size_t grouped_gemm_workspace_size_cuda(const GroupedGemmShape& s, DType dtype) {
#ifdef FUSEDLAYERS_WITH_CUTLASS_SM90
  if (grouped_gemm_cuda_path(dtype, s, device_arch()) == GroupedGemmPath::kSm90)
    return sm90_workspace_size(s.groups);
#else
  (void)s, (void)dtype;
#endif
  return 0;
}

void grouped_gemm_offsets_to_device(const char* op, int32_t* device, const int32_t* host,
                                    int64_t groups, int64_t rows, cudaStream_t stream) {
  grouped_gemm_offsets_check(op, host, groups, rows);
  cuda::check(cudaMemcpyAsync(device, host, groups * sizeof(int32_t), cudaMemcpyHostToDevice,
                              stream),
              "grouped_gemm: copying offsets to the device");
}

void grouped_gemm_forward_cuda(const GroupedGemmForward& a, const GroupedGemmShape& s,
                               cudaStream_t stream) {
  if (s.rows == 0 || s.n == 0) return;
  run(grouped_gemm_fprop(a, s), a.x.dtype, s, a.workspace, stream);
}

void grouped_gemm_backward_cuda(const GroupedGemmBackward& a, const GroupedGemmShape& s,
                                cudaStream_t stream) {
  if (a.dx && s.rows > 0 && s.k > 0) run(grouped_gemm_dgrad(a, s), a.x.dtype, s, a.workspace,
                                         stream);
  if (a.dweight && s.k > 0 && s.n > 0)
    run(grouped_gemm_wgrad(a, s), a.x.dtype, s, a.workspace, stream);
}

}  // namespace fusedlayers
