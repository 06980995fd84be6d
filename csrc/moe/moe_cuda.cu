// CUDA mixture-of-experts routing (math: moe.h).
// The route sorts the pairs by expert in three launches over tiles of kTile pairs, one warp a
// tile: (1) each tile counts its pairs per expert (a warp's pairs of one expert found with
// __match_any_sync, their count added by the lowest of them: no two lanes add to one counter);
// (2) CUB's scan of the counts laid out expert-major (all tiles' counts of expert 0, then of
// expert 1, ...) gives each tile its first row per expert; (3) each tile ranks its pairs again,
// in order, from those first rows, and writes a share of the offsets. A lane loads its pairs of
// the tile before any is ranked, so the loads overlap. Integer counts only: the rows are the
// same on every run. The scatter and gather are one block per token, in 16-byte vectors where H
// and the pointers allow.
#include <algorithm>
#include <vector>

#include <cub/device/device_scan.cuh>

#include "util/cuda_common.cuh"
#include "moe/moe.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;

constexpr int kTile = 256;            // pairs per warp in the count and rank kernels
constexpr int kRowThreads = 128;

template <typename I>
__device__ __forceinline__ int bucket(I e, int64_t num_experts) {
  return e >= 0 && static_cast<int64_t>(e) < num_experts ? int(e) : int(num_experts);
}

int64_t route_tiles(const MoeShape& s) { return (s.pairs() + kTile - 1) / kTile; }

// The tile's bucket per pair, lane l holding pairs begin + 32 i + l: all loads in flight at once
// (the tile loop then waits on none), -1 past n.
template <typename I>
__device__ __forceinline__ void load_tile(const I* __restrict__ idx, int64_t begin, int64_t n,
                                          int64_t num_experts, int (&e)[kTile / 32]) {
#pragma unroll
  for (int i = 0; i < kTile / 32; ++i) {
    const int64_t p = begin + 32 * i + threadIdx.x;
    e[i] = p < n ? bucket(idx[p], num_experts) : -1;
  }
}

// counts[e * tiles + b]: pairs of tile b in bucket e (E + 1 buckets, the last for no expert).
template <typename I>
__global__ void __launch_bounds__(32) count_kernel(const I* __restrict__ idx, int64_t n,
                                                   int64_t num_experts, int* __restrict__ counts) {
  extern __shared__ int hist[];
  const int lane = threadIdx.x, buckets = int(num_experts) + 1;
  const int64_t tiles = gridDim.x;
  int e[kTile / 32];
  load_tile(idx, int64_t(blockIdx.x) * kTile, n, num_experts, e);
  for (int b = lane; b < buckets; b += 32) hist[b] = 0;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kTile / 32; ++i) {
    const unsigned peers = __match_any_sync(0xffffffffu, e[i]);
    if (e[i] >= 0 && lane == __ffs(peers) - 1) hist[e[i]] += __popc(peers);
    __syncwarp();
  }
  for (int b = lane; b < buckets; b += 32) counts[int64_t(b) * tiles + blockIdx.x] = hist[b];
}

// Each pair's row from `first` (the exclusive scan of counts: tile b's first row of bucket e),
// and offsets[e] = first[(e + 1) * tiles], the end of expert e's rows, shared out over the tiles.
template <typename I>
__global__ void __launch_bounds__(32) rank_kernel(const I* __restrict__ idx, int64_t n,
                                                  int64_t num_experts,
                                                  const int* __restrict__ first,
                                                  int32_t* __restrict__ row_index,
                                                  int32_t* __restrict__ offsets) {
  extern __shared__ int next[];
  const int lane = threadIdx.x, buckets = int(num_experts) + 1;
  const int64_t tiles = gridDim.x, begin = int64_t(blockIdx.x) * kTile;
  int e[kTile / 32];
  load_tile(idx, begin, n, num_experts, e);
  for (int b = lane; b < buckets; b += 32) next[b] = first[int64_t(b) * tiles + blockIdx.x];
  for (int64_t x = int64_t(blockIdx.x) * 32 + lane; x < num_experts; x += tiles * 32)
    offsets[x] = first[(x + 1) * tiles];
  __syncwarp();
  const unsigned below = (1u << lane) - 1;
#pragma unroll
  for (int i = 0; i < kTile / 32; ++i) {
    const unsigned peers = __match_any_sync(0xffffffffu, e[i]);
    if (e[i] >= 0) row_index[begin + 32 * i + lane] = next[e[i]] + __popc(peers & below);
    __syncwarp();
    if (e[i] >= 0 && lane == __ffs(peers) - 1) next[e[i]] += __popc(peers);
    __syncwarp();
  }
}

// Bytes of n ints, rounded to 256 (each array of the workspace starts aligned).
size_t counts_bytes(int64_t n) { return (size_t(n) * sizeof(int) + 255) / 256 * 256; }

// CUB's temporary storage for the scan of n ints.
size_t scan_bytes(int64_t n) {
  size_t bytes = 0;
  cuda::check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<int*>(nullptr),
                                            static_cast<int*>(nullptr), int(n)),
              "cub::DeviceScan::ExclusiveSum");
  return bytes;
}

template <typename I>
void route(const MoeRoute& a, const MoeShape& s, cudaStream_t stream) {
  const I* idx = static_cast<const I*>(a.top_k_index.data);
  const int64_t n = s.pairs(), tiles = route_tiles(s), buckets = s.num_experts + 1;
  if (n == 0) {
    cuda::check(cudaMemsetAsync(a.offsets, 0, s.num_experts * sizeof(int32_t), stream),
                "cudaMemsetAsync");
    return;
  }
  // workspace: counts, their scan (`first`), CUB's storage
  const int64_t counted = buckets * tiles;
  char* ws = static_cast<char*>(a.workspace);
  int* counts = reinterpret_cast<int*>(ws);
  int* first = reinterpret_cast<int*>(ws + counts_bytes(counted));
  void* storage = ws + 2 * counts_bytes(counted);
  size_t storage_bytes = scan_bytes(counted);
  const size_t smem = buckets * sizeof(int);
  count_kernel<I><<<unsigned(tiles), 32, smem, stream>>>(idx, n, s.num_experts, counts);
  cuda::check_launch("moe count_kernel");
  cuda::check(cub::DeviceScan::ExclusiveSum(storage, storage_bytes, counts, first, int(counted),
                                            stream),
              "cub::DeviceScan::ExclusiveSum");
  rank_kernel<I><<<unsigned(tiles), 32, smem, stream>>>(idx, n, s.num_experts, first,
                                                        a.row_index, a.offsets);
  cuda::check_launch("moe rank_kernel");
}

// The pair's row, or -1 where it is skipped (no expert, or a row outside [0, n)); `*zero` says
// whether a row exists that the scatter fills with zeros.
template <typename I>
__device__ __forceinline__ int64_t pair_row(const I* idx, const int32_t* rows, int64_t p,
                                            int64_t n, int64_t num_experts, bool* zero) {
  const int64_t r = rows[p];
  const bool in_range = r >= 0 && r < n;
  const bool reaches = bucket(idx[p], num_experts) < num_experts;
  *zero = in_range && !reaches;
  return in_range && reaches ? r : -1;
}

// One block per token: out[row(t, j)] = w[t, j] in[t], and with ys dw[t, j] = <ys[row], in[t]>.
template <typename T, typename W, typename I, int N, bool kWeights, bool kDot>
__global__ void __launch_bounds__(kRowThreads) scatter_kernel(MoeScatter a, MoeShape s) {
  using A = typename cuda::Acc<T>::type;
  using V = cuda::Vec<T, N>;
  __shared__ A red[kRowThreads / 32];
  const int64_t t = blockIdx.x, H = s.hidden, n = s.tokens * s.top_k;
  const V* x = reinterpret_cast<const V*>(static_cast<const T*>(a.in.data) + t * H);
  const I* idx = static_cast<const I*>(a.top_k_index.data);
  const int32_t* rows = static_cast<const int32_t*>(a.row_index.data);
  const int64_t vecs = H / N;
  for (int64_t j = 0; j < s.top_k; ++j) {
    const int64_t p = t * s.top_k + j;
    bool zero;
    const int64_t r = pair_row(idx, rows, p, n, s.num_experts, &zero);
    if (r < 0) {
      if (zero) {
        V z;
#pragma unroll
        for (int q = 0; q < N; ++q) z.v[q] = from_acc<T>(A(0));
        V* dst = reinterpret_cast<V*>(static_cast<T*>(a.out) + rows[p] * H);
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = z;
      }
      if (kDot && threadIdx.x == 0) static_cast<W*>(a.dweights)[p] = from_acc<W>(0);
      continue;
    }
    V* dst = reinterpret_cast<V*>(static_cast<T*>(a.out) + r * H);
    const A wt = kWeights ? A(to_acc(static_cast<const W*>(a.weights.data)[p])) : A(1);
    const V* y = kDot ? reinterpret_cast<const V*>(static_cast<const T*>(a.ys.data) + r * H)
                      : nullptr;
    A dot = 0;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const V xv = x[v];
      if constexpr (kWeights) {
        V o;
#pragma unroll
        for (int q = 0; q < N; ++q) o.v[q] = from_acc<T>(wt * A(to_acc(xv.v[q])));
        dst[v] = o;
      } else {
        dst[v] = xv;
      }
      if constexpr (kDot) {
        const V yv = y[v];
#pragma unroll
        for (int q = 0; q < N; ++q) dot += A(to_acc(yv.v[q])) * A(to_acc(xv.v[q]));
      }
    }
    if constexpr (kDot) {
      dot = cuda::block_sum(dot, red);
      if (threadIdx.x == 0) static_cast<W*>(a.dweights)[p] = from_acc<W>(dot);
    }
  }
}

// One block per token: out[t] = sum_j w[t, j] in[row(t, j)], j ascending, in A.
template <typename T, typename W, typename I, int N, bool kWeights>
__global__ void __launch_bounds__(kRowThreads) gather_kernel(MoeGather a, MoeShape s) {
  using A = typename cuda::Acc<T>::type;
  using V = cuda::Vec<T, N>;
  const int64_t t = blockIdx.x, H = s.hidden, n = s.tokens * s.top_k;
  const T* in = static_cast<const T*>(a.in.data);
  const I* idx = static_cast<const I*>(a.top_k_index.data);
  const int32_t* rows = static_cast<const int32_t*>(a.row_index.data);
  V* out = reinterpret_cast<V*>(static_cast<T*>(a.out) + t * H);
  const int64_t vecs = H / N;
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    A acc[N];
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = 0;
    for (int64_t j = 0; j < s.top_k; ++j) {
      const int64_t p = t * s.top_k + j;
      bool zero;
      const int64_t r = pair_row(idx, rows, p, n, s.num_experts, &zero);
      if (r < 0) continue;
      const A wt = kWeights ? A(to_acc(static_cast<const W*>(a.weights.data)[p])) : A(1);
      const V yv = reinterpret_cast<const V*>(in + r * H)[v];
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] += wt * A(to_acc(yv.v[q]));
    }
    V o;
#pragma unroll
    for (int q = 0; q < N; ++q) o.v[q] = from_acc<T>(acc[q]);
    out[v] = o;
  }
}

// fn(T{}, W{}, I{}, N): the storage types, and 16-byte vectors where H and every row pointer
// allow (else one element).
template <typename Fn>
void dispatch_rows(DType dtype, const TensorRef& weights, IndexType index, int64_t hidden,
                   std::initializer_list<const void*> pointers, Fn&& fn) {
  cuda::dispatch(dtype, [&](auto tv) {
    using T = decltype(tv);
    constexpr int kN = 16 / sizeof(T);
    bool vec = hidden % kN == 0;
    for (const void* p : pointers) vec = vec && (!p || cuda::aligned(p, 16));
    const auto with_w = [&](auto wv) {
      dispatch_index(index, [&](auto iv) {
        if (vec)
          fn(tv, wv, iv, std::integral_constant<int, kN>{});
        else
          fn(tv, wv, iv, std::integral_constant<int, 1>{});
      });
    };
    if (weights.defined && weights.dtype != dtype)
      with_w(float{});
    else
      with_w(T{});
  });
}

}  // namespace

size_t moe_route_workspace_size_cuda(const MoeShape& s) {
  if (s.pairs() == 0) return 0;
  const int64_t counted = route_tiles(s) * (s.num_experts + 1);
  return 2 * counts_bytes(counted) + scan_bytes(counted);
}

void moe_route_cuda(const MoeRoute& a, const MoeShape& s, cudaStream_t stream) {
  dispatch_index(a.top_k_index.type, [&](auto i) { route<decltype(i)>(a, s, stream); });
}

void moe_scatter_cuda(const MoeScatter& a, const MoeShape& s, cudaStream_t stream) {
  if (s.tokens == 0 || s.hidden == 0) return;
  dispatch_rows(a.in.dtype, a.weights, a.top_k_index.type, s.hidden,
                {a.in.data, a.out, a.ys.defined ? a.ys.data : nullptr},
                [&](auto t, auto w, auto i, auto n) {
                  using T = decltype(t);
                  using W = decltype(w);
                  using I = decltype(i);
                  constexpr int N = decltype(n)::value;
                  const auto launch = [&](auto kernel) {
                    kernel<<<unsigned(s.tokens), kRowThreads, 0, stream>>>(a, s);
                    cuda::check_launch("moe scatter_kernel");
                  };
                  if (a.ys.defined)
                    launch(scatter_kernel<T, W, I, N, true, true>);
                  else if (a.weights.defined)
                    launch(scatter_kernel<T, W, I, N, true, false>);
                  else
                    launch(scatter_kernel<T, W, I, N, false, false>);
                });
}

void moe_gather_cuda(const MoeGather& a, const MoeShape& s, cudaStream_t stream) {
  if (s.tokens == 0 || s.hidden == 0) return;
  dispatch_rows(a.in.dtype, a.weights, a.top_k_index.type, s.hidden, {a.in.data, a.out},
                [&](auto t, auto w, auto i, auto n) {
                  using T = decltype(t);
                  using W = decltype(w);
                  using I = decltype(i);
                  constexpr int N = decltype(n)::value;
                  const auto launch = [&](auto kernel) {
                    kernel<<<unsigned(s.tokens), kRowThreads, 0, stream>>>(a, s);
                    cuda::check_launch("moe gather_kernel");
                  };
                  if (a.weights.defined)
                    launch(gather_kernel<T, W, I, N, true>);
                  else
                    launch(gather_kernel<T, W, I, N, false>);
                });
}

IndexRef moe_index_to_device(const IndexRef& host, void* device, cudaStream_t stream) {
  const int64_t bytes = moe_index_bytes(host);
  if (bytes == 0) return host;
  // From pageable memory cudaMemcpyAsync returns once it has staged the source, which a pinned
  // host tensor (TF's GPU-compatible host allocator) would not guarantee.
  const char* src = static_cast<const char*>(host.data);
  const std::vector<char> staged(src, src + bytes);
  cuda::check(cudaMemcpyAsync(device, staged.data(), size_t(bytes), cudaMemcpyHostToDevice, stream),
              "moe: copying an index to the device");
  IndexRef out = host;
  out.data = device;
  return out;
}

}  // namespace fusedlayers
