// CUDA FP8 norms (fp8_norm.h). The one-pass kernel: a cluster of `ranks` blocks (256 threads)
// takes 128 rows, block `rank` a slice of `width` columns (128, 256 or 512: one to four
// 128x128 tiles staged in shared memory, the rows by cp.async, or as x + residual through
// registers). Each block sums its slice of every row; the partial sums are read across the
// cluster's shared memory in rank order, so every block computes the same statistics (a mean
// round, then the variance round, as norm.h's two passes). The block then normalizes its slice
// in place (y written out as it goes) and quantizes each tile into x's and x^T's rows with
// fp8_tile.cuh's quantize_tile, so x is read once and y, q and q_t written once. Elsewhere the
// norm kernel, then the quantize kernel over y.
#include <map>
#include <mutex>
#include <utility>

#include "fp8/fp8_norm.h"
#include "fp8/fp8_tile.cuh"

namespace fusedlayers {
namespace {

using namespace fp8_tile;
using cuda::from_acc;

constexpr int kMaxRanks = 16;  // the largest cluster sm_90 allows (above 8: non-portable)

// The slice width of the one-pass kernel for rows of cols, 0 where none fits.
int slice_width(int64_t cols) {
  for (int w : {128, 256, 512})
    if (cols % w == 0 && cols / w <= kMaxRanks) return w;
  return 0;
}

template <typename T>
using Chunk = cuda::Vec<T, StagedTile<T>::kPerChunk>;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // cluster instructions: sm_90 on
// The cluster's barrier in halves: arrive releases this block's shared-memory writes, wait
// acquires every block's (and keeps this block's shared memory alive until all have arrived).
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The float at `local` (this block's shared memory) in the cluster's block `rank`. Ordered
// after the cluster barrier by being volatile as the barrier is; no memory clobber, so that a
// thread's loads from every block are in flight together.
__device__ __forceinline__ float cluster_load(const float* local, uint32_t rank) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote));
  return v;
}
#endif

template <typename T, typename P, bool kAdd, bool kTranspose>
__global__ void __launch_bounds__(kThreads, 3)  // 3 blocks of 64 KB (256-column slices) an SM
    fused_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ h,
                 const P* __restrict__ gamma, const P* __restrict__ beta, T* __restrict__ y,
                 float* __restrict__ mean, float* __restrict__ rstd, int64_t rows, int cols,
                 int width, float inv_cols, float eps, float goff, NormMode mode, Fp8Format f,
                 bool pow2, uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                 uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kPer = StagedTile<T>::kPerChunk, kChunks = StagedTile<T>::kChunks;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float part[2][kFp8Block];  // the slice's sums of each row: mean's, variance's
  __shared__ float stat[2][kFp8Block];  // each row's shift (mean, or 0) and rstd
  __shared__ uint32_t warp_max[kWarps];
  const int rank = blockIdx.x, ranks = gridDim.x;
  const int slice_chunks = width / kPer, n_chunks = kFp8Block * slice_chunks;
  const int64_t stripe = blockIdx.y, r0 = stripe * kFp8Block;
  const int64_t c_base = int64_t(rank) * width;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const auto tile = [&](int t) { return StagedTile<T>{smem_raw + t * StagedTile<T>::kBytes}; };
  const auto at = [&](int row, int jj) { return tile(jj / kChunks).chunk(row, jj % kChunks); };
  const auto load = [&](int row, int jj) { return *reinterpret_cast<const Chunk<T>*>(at(row, jj)); };

  // 1. the slice of the rows (h = x + residual rounded to T, written out); zeros past the rows
  if constexpr (!kAdd) {
    for (int i = threadIdx.x; i < n_chunks; i += kThreads) {
      const int row = i / slice_chunks, jj = i % slice_chunks;
      const int64_t r = r0 + row;
      cp_async16(at(row, jj), r < rows ? x + r * cols + c_base + jj * kPer : x, r < rows);
    }
    cp_async_commit();
    cp_async_wait_all();
  } else {
    constexpr int kBatch = 2;  // a batch's loads in flight at once (more spill)
    for (int i0 = threadIdx.x; i0 < n_chunks; i0 += kBatch * kThreads) {
      Chunk<T> xs[kBatch], rs[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = i0 + b * kThreads;
        const int64_t r = r0 + i / slice_chunks;
        if (i < n_chunks && r < rows) {
          const int64_t off = r * cols + c_base + (i % slice_chunks) * kPer;
          xs[b] = *reinterpret_cast<const Chunk<T>*>(x + off);
          rs[b] = *reinterpret_cast<const Chunk<T>*>(residual + off);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = i0 + b * kThreads;
        if (i >= n_chunks) continue;
        const int row = i / slice_chunks, jj = i % slice_chunks;
        const int64_t r = r0 + row;
        Chunk<T> s;
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          s.v[k] = from_acc<T>(r < rows ? to_acc(xs[b].v[k]) + to_acc(rs[b].v[k]) : 0.f);
        if (r < rows) *reinterpret_cast<Chunk<T>*>(h + r * cols + c_base + jj * kPer) = s;
        *reinterpret_cast<Chunk<T>*>(at(row, jj)) = s;
      }
    }
  }
  __syncthreads();

  // 2. the statistics: a warp sums its 16 rows' slices, the cluster's sums are added in rank
  // order by thread `row` (mean = x0 + mean(x - x0) as norm.h's kernels take it)
  const auto slice_sums = [&](int which, auto&& term) {
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int row = warp * kRowsPerWarp + k;
      const float shift = stat[0][row];
      float s = 0.f;
      for (int jj = lane; jj < slice_chunks; jj += 32) {
        const Chunk<T> v = load(row, jj);
#pragma unroll
        for (int kk = 0; kk < kPer; ++kk) s += term(to_acc(v.v[kk]), shift);
      }
      s = cuda::warp_sum(s);
      if (lane == 0) part[which][row] = s;
    }
    cluster_arrive();
    cluster_wait();
  };
  const auto cluster_total = [&](int which) {  // the loads first, then the sum in rank order
    float v[kMaxRanks];
#pragma unroll
    for (int b = 0; b < kMaxRanks; ++b)
      v[b] = b < ranks ? cluster_load(&part[which][threadIdx.x], b) : 0.f;
    float total = 0.f;
#pragma unroll
    for (int b = 0; b < kMaxRanks; ++b) total += v[b];
    return total;
  };
  if (threadIdx.x < kFp8Block) {
    const int64_t r = r0 + threadIdx.x;
    float x0 = 0.f;  // kRms: no mean
    if (mode != NormMode::kRms && r < rows)
      x0 = kAdd ? to_acc(from_acc<T>(to_acc(x[r * cols]) + to_acc(residual[r * cols])))
                : to_acc(x[r * cols]);
    stat[0][threadIdx.x] = x0;
  }
  __syncthreads();
  if (mode != NormMode::kRms) {
    slice_sums(0, [](float v, float x0) { return v - x0; });
    if (threadIdx.x < kFp8Block) stat[0][threadIdx.x] += cluster_total(0) * inv_cols;
    __syncthreads();
  }
  slice_sums(1, [](float v, float mu) { return (v - mu) * (v - mu); });
  if (threadIdx.x < kFp8Block) {
    const float rs = rsqrtf(cluster_total(1) * inv_cols + eps);
    stat[1][threadIdx.x] = rs;
    const int64_t r = r0 + threadIdx.x;
    if (rank == 0 && r < rows) {
      if (mean) mean[r] = stat[0][threadIdx.x];
      rstd[r] = rs;
    }
  }
  cluster_arrive();  // this block has read the others' sums (waited for before it exits)
  __syncthreads();

  // 3. y = (x - shift) * rstd * gamma + beta rounded to T, written out and in place; zeros past
  // the rows (the x^T blocks' amaxes read them)
  const bool centred = mode == NormMode::kLayer;
  for (int i = threadIdx.x; i < n_chunks; i += kThreads) {
    const int row = i / slice_chunks, jj = i % slice_chunks;
    const int64_t r = r0 + row, c = c_base + jj * kPer;
    Chunk<T> out;
    if (r < rows) {
      const Chunk<T> v = load(row, jj);
      const float shift = centred ? stat[0][row] : 0.f, rs = stat[1][row];
      cuda::Vec<P, kPer> g, b;
      if (gamma) g = *reinterpret_cast<const cuda::Vec<P, kPer>*>(gamma + c);
      if (beta) b = *reinterpret_cast<const cuda::Vec<P, kPer>*>(beta + c);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const float gk = gamma ? float(to_acc(g.v[k])) + goff : 1.f;
        const float bk = beta ? float(to_acc(b.v[k])) : 0.f;
        out.v[k] = from_acc<T>((to_acc(v.v[k]) - shift) * rs * gk + bk);
      }
      *reinterpret_cast<Chunk<T>*>(y + r * cols + c) = out;
    } else {
#pragma unroll
      for (int k = 0; k < kPer; ++k) out.v[k] = from_acc<T>(0.f);
    }
    *reinterpret_cast<Chunk<T>*>(at(row, jj)) = out;
  }
  __syncthreads();

  // 4. each tile into q (and q_t) with its 1x128 scales
  for (int t = 0; t < width / kFp8Block; ++t)
    quantize_tile<T, Fp8Scaling::kBlock1x128, kTranspose>(
        tile(t), stripe, c_base / kFp8Block + t, rows, cols, f, pow2, 0.f, q, scale_inv, q_t,
        scale_inv_t, warp_max);
  cluster_wait();
#endif
}

// Whether `Kernel`'s clusters of `ranks` blocks with smem bytes of dynamic shared memory run on
// the current device (sm_90 or later, the shared memory and the cluster size granted); the
// attributes this takes are set on the way. Worked out once per device and cluster size.
template <auto Kernel>
bool cluster_fits(int ranks, size_t smem) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;
  int device, major = 0, optin = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({device, ranks});
  if (found != known.end()) return found->second;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              "cudaDeviceGetAttribute");
  cuda::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute");
  cudaFuncAttributes attr;
  cuda::check(cudaFuncGetAttributes(&attr, Kernel), "cudaFuncGetAttributes");
  bool fits = false;
  if (major >= 9 && smem + attr.sharedSizeBytes <= size_t(optin)) {
    cuda::check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     optin - int(attr.sharedSizeBytes)),
                "cudaFuncSetAttribute");
    // all of the SM's shared memory (the default carveout holds two 64 KB blocks, not three)
    cuda::check(cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)),
                "cudaFuncSetAttribute");
    if (ranks > 8)
      cuda::check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                  "cudaFuncSetAttribute");
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = unsigned(ranks);
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(ranks));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = 0;
    fits = cudaOccupancyMaxActiveClusters(&clusters, Kernel, &config) == cudaSuccess &&
           clusters > 0;
    (void)cudaGetLastError();  // a refused size is an answer, not an error
  }
  known[{device, ranks}] = fits;
  return fits;
}

template <typename T, typename P, bool kAdd, bool kTranspose>
bool launch_fused(const NormForwardArgs& n, const Fp8Target& out, int width,
                  cudaStream_t stream) {
  constexpr auto kernel = fused_kernel<T, P, kAdd, kTranspose>;
  const int ranks = int(n.cols / width);
  const size_t smem = size_t(width / kFp8Block) * StagedTile<T>::kBytes;
  if (!cluster_fits<kernel>(ranks, smem)) return false;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(ranks);
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(ranks), unsigned((n.rows + kFp8Block - 1) / kFp8Block));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const P* beta = n.mode == NormMode::kLayer ? static_cast<const P*>(n.beta) : nullptr;
  cuda::check(
      cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(n.x),
                         static_cast<const T*>(n.residual), static_cast<T*>(n.h),
                         static_cast<const P*>(n.gamma), beta, static_cast<T*>(n.y),
                         static_cast<float*>(n.mean), static_cast<float*>(n.rstd), n.rows,
                         int(n.cols), width, float(1.0 / double(n.cols)), float(n.eps),
                         n.gamma_offset, n.mode, out.format, out.power_of_2_scales, out.q,
                         out.scale_inv, out.q_t, out.scale_inv_t),
      "fp8_norm_forward_cuda");
  return true;
}

// The one-pass kernel where fp8_norm.h's conditions hold (false elsewhere: nothing launched).
bool run_fused(const NormForwardArgs& n, const Fp8Target& out, cudaStream_t stream) {
  const int width = slice_width(n.cols);
  const bool half = n.dtype == DType::kFloat16 || n.dtype == DType::kBFloat16;
  if (!half || width == 0 || out.scaling != Fp8Scaling::kBlock1x128 || n.rows == 0 ||
      (n.rows + kFp8Block - 1) / kFp8Block > 65535)
    return false;
  if (n.residual && n.residual_dtype != n.dtype) return false;
  for (const void* p : {n.x, static_cast<const void*>(n.y), n.residual, static_cast<const void*>(n.h)})
    if (p && !cuda::aligned(p, 16)) return false;
  if (!cuda::aligned(out.q, 8)) return false;
  const size_t param_bytes = (n.param_dtype == DType::kFloat32 ? 4 : 2) * 8;  // a chunk's
  for (const void* p : {n.gamma, n.beta})
    if (p && !cuda::aligned(p, param_bytes)) return false;
  bool launched = false;
  cuda::dispatch(n.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      const auto with_p = [&](auto p) {
        using P = decltype(p);
        const bool add = n.residual != nullptr, tr = out.q_t != nullptr;
        launched = add ? (tr ? launch_fused<T, P, true, true>(n, out, width, stream)
                             : launch_fused<T, P, true, false>(n, out, width, stream))
                       : (tr ? launch_fused<T, P, false, true>(n, out, width, stream)
                             : launch_fused<T, P, false, false>(n, out, width, stream));
      };
      if (n.param_dtype == n.dtype) with_p(T{});
      else with_p(float{});
    }
  });
  return launched;
}

}  // namespace

void fp8_norm_forward_cuda(const NormForwardArgs& n, const Fp8Target& out, cudaStream_t stream) {
  if (run_fused(n, out, stream)) return;
  norm_forward_cuda(n, stream);
  if (n.rows * n.cols == 0 && out.scaling != Fp8Scaling::kTensorwise) return;
  Fp8Quantize q;
  static_cast<Fp8Target&>(q) = out;
  q.x.data = n.y;
  q.x.dtype = n.dtype;
  fp8_quantize_cuda(q, n.rows, n.cols, stream);
}

}  // namespace fusedlayers
