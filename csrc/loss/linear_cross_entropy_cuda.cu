// CUDA row pass of linear + cross-entropy (math: linear_cross_entropy.h). A block per row of
// logits and two passes over it. The first reads the row once, in 16-byte vectors, for its
// float32 statistics (the running max, the sum of exponentials in base 2 rescaled per vector as
// the max grows, the sum of z) and keeps a copy of as much of the row as shared memory holds;
// the second writes du from that copy and re-reads only the rest (which the first pass has just
// brought into L2). One ex2 per element and pass. The block's statistics are merged by warp
// shuffles and then by warp 0 in a fixed tree, so results do not depend on timing. Rows whose
// logits and du (or bias) are not 16-byte aligned alike run the same math element by element.
// dbias: a thread per column adds the chunk's rows in order to the float accumulator.
#include <algorithm>
#include <cmath>

#include "util/cuda_common.cuh"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x (MUFU.EX2): 2 ulp, subnormal results flushed to zero (far below any sum they join).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T> constexpr int kVec = 16 / sizeof(T);

// A row's running statistics: m the max of z, se the sum of 2^((z - m) log2 e), sum of z.
struct Stats {
  float m = -INFINITY, se = 0, sum = 0;
};

__device__ __forceinline__ void merge(Stats& a, const Stats& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return;  // both empty (or every z -inf): nothing to rescale
  a.se = (a.m == -INFINITY ? 0.f : a.se * ex2((a.m - m) * kLog2e)) +
         (b.m == -INFINITY ? 0.f : b.se * ex2((b.m - m) * kLog2e));
  a.m = m;
  a.sum += b.sum;
}

__device__ __forceinline__ Stats shfl_xor(const Stats& s, int offset) {
  return {__shfl_xor_sync(0xffffffffu, s.m, offset), __shfl_xor_sync(0xffffffffu, s.se, offset),
          __shfl_xor_sync(0xffffffffu, s.sum, offset)};
}

__device__ __forceinline__ Stats warp_merge(Stats s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) merge(s, shfl_xor(s, offset));
  return s;
}

// The options a row's logits pass through: z = softcap(u + bias).
template <bool kCap>
struct Logit {
  float cap;
  __device__ __forceinline__ float operator()(float u) const {
    return kCap ? cap * tanhf(u / cap) : u;
  }
  // du = dz * dz/du
  __device__ __forceinline__ float chain(float dz, float z) const {
    return kCap ? dz * (1 - (z / cap) * (z / cap)) : dz;
  }
};

// The logits of vector k of a row: n values of T from `raw`, plus the bias (16-byte loads where
// `bias_vec`, else element by element).
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, const T* bias, bool bias_vec,
                                       float (&u)[kVec<T>]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) u[i] = to_acc(e[i]);
  if (!bias) return;
  if (bias_vec) {
    const uint4 b = *reinterpret_cast<const uint4*>(bias);
    const T* be = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int i = 0; i < kVec<T>; ++i) u[i] += to_acc(be[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec<T>; ++i) u[i] += to_acc(bias[i]);
  }
}

template <bool kCap>
__device__ __forceinline__ void add_vector(Stats& s, const float* z, int n) {
  float vm = z[0];
  for (int i = 1; i < n; ++i) vm = fmaxf(vm, z[i]);
  if (vm > s.m) {
    s.se = s.m == -INFINITY ? 0.f : s.se * ex2((s.m - vm) * kLog2e);
    s.m = vm;
  }
  const float mb = s.m * kLog2e;
  for (int i = 0; i < n; ++i) {
    s.se += ex2(fmaf(z[i], kLog2e, -mb));
    s.sum += z[i];
  }
}

// kThreads threads a row: 1024 where a row is long (one block an SM holds its copy), 512 where
// it is short (whose 1024 threads would each have only a few vectors between the block's fixed
// costs); 64 registers either way.
template <typename T, bool kCap, int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads)
    chunk_kernel(LinearCrossEntropyChunk c, int64_t cache_vecs) {
  constexpr int V = kVec<T>;
  constexpr int kUnroll = kThreads == 1024 ? 4 : 3;  // 16-byte loads in flight per thread
  extern __shared__ uint4 cache[];
  __shared__ Stats s_warp[kThreads / 32];
  __shared__ Stats s_row;
  const int64_t r = blockIdx.x, row = c.row0 + r, v = c.vocab;
  const int64_t t = c.target_int32 ? static_cast<const int32_t*>(c.target)[row]
                                   : static_cast<const int64_t*>(c.target)[row];
  const T* logits = static_cast<const T*>(c.logits) + r * v;
  T* du_row = static_cast<T*>(c.du) + r * v;
  const T* bias = static_cast<const T*>(c.bias);
  const float* scale = static_cast<const float*>(c.grad_scale);
  float* loss = static_cast<float*>(c.loss);
  const int tid = threadIdx.x;
  // The 16-byte vectors of the row: elements [head, head + nvec * V).
  const uintptr_t at = reinterpret_cast<uintptr_t>(logits);
  int64_t head = int64_t((16 - at % 16) % 16 / sizeof(T));
  bool vec = head < v && (!scale || (reinterpret_cast<uintptr_t>(du_row) - at) % 16 == 0);
  if (!vec) head = v;
  // The elements outside the vectors, [0, head) and [tail, v), go one by one.
  const int64_t nvec = (v - head) / V, tail = head + nvec * V, scalars = head + v - tail;
  const bool bias_vec = bias && (reinterpret_cast<uintptr_t>(bias + head) % 16 == 0);
  const uint4* src = reinterpret_cast<const uint4*>(logits + head);
  uint4* dst = reinterpret_cast<uint4*>(du_row + head);
  const int64_t cached = nvec < cache_vecs ? nvec : cache_vecs;

  if (t == c.ignore_index || t < 0 || t >= v) {  // no exception from a kernel: NaN says it
    const float fill = t == c.ignore_index ? 0.f : NAN;
    if (tid == 0) loss[row] = fill;
    if (!scale) return;
    alignas(16) T f[V];
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = from_acc<T>(fill);
    for (int64_t k = tid; k < nvec; k += kThreads) dst[k] = *reinterpret_cast<const uint4*>(f);
    for (int64_t j = tid; j < scalars; j += kThreads) du_row[j < head ? j : tail + j - head] = f[0];
    return;
  }
  const Logit<kCap> logit{float(c.softcap)};
  // Read before the second pass overwrites it (du may be the logits).
  float zt = 0;
  if (tid == 0) zt = logit(to_acc(logits[t]) + (bias ? to_acc(bias[t]) : 0.f));

  Stats s;
  for (int64_t k0 = tid; k0 < nvec; k0 += int64_t(kThreads) * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + int64_t(u) * kThreads;
      if (k < nvec) raw[u] = k < cached ? __ldcs(src + k) : src[k];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + int64_t(u) * kThreads;
      if (k >= nvec) break;
      if (k < cached) cache[k] = raw[u];
      float z[V];
      unpack<T>(raw[u], bias ? bias + head + k * V : nullptr, bias_vec, z);
#pragma unroll
      for (int i = 0; i < V; ++i) z[i] = logit(z[i]);
      add_vector<kCap>(s, z, V);
    }
  }
  for (int64_t j = tid; j < scalars; j += kThreads) {
    const int64_t e = j < head ? j : tail + j - head;
    const float z = logit(to_acc(logits[e]) + (bias ? to_acc(bias[e]) : 0.f));
    add_vector<kCap>(s, &z, 1);
  }
  s = warp_merge(s);
  const int lane = tid % 32, warp = tid / 32;
  if (lane == 0) s_warp[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / 32 ? s_warp[lane] : Stats{};
    s = warp_merge(s);
    if (lane == 0) s_row = s;
  }
  __syncthreads();
  s = s_row;
  const float lse = s.m + logf(s.se);
  const float eps = float(c.label_smoothing), zl = float(c.z_loss);
  if (tid == 0)
    loss[row] = (1 - eps) * (lse - zt) + eps * (lse - s.sum / float(v)) + zl * lse * lse;
  if (!scale) return;

  const float g = scale[c.per_row_scale ? row : 0], pz = g * (1 + 2 * zl * lse),
              off = g * eps / float(v), hit = g * (1 - eps), lb = lse * kLog2e;
  // du of z, whose target term is `hit` where the element is the target.
  auto grad = [&](float z, float target_term) {
    return logit.chain(pz * ex2(fmaf(z, kLog2e, -lb)) - off - target_term, z);
  };
  for (int64_t k = tid; k < nvec; k += kThreads) {
    const uint4 raw = k < cached ? cache[k] : src[k];
    float u[V];
    unpack<T>(raw, bias ? bias + head + k * V : nullptr, bias_vec, u);
    const int64_t at_t = t - (head + k * V);  // the target's place in the vector, if there
    alignas(16) T out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = from_acc<T>(grad(logit(u[i]), at_t == i ? hit : 0.f));
    __stcs(dst + k, *reinterpret_cast<const uint4*>(out));
  }
  for (int64_t j = tid; j < scalars; j += kThreads) {
    const int64_t e = j < head ? j : tail + j - head;
    const float z = logit(to_acc(logits[e]) + (bias ? to_acc(bias[e]) : 0.f));
    du_row[e] = from_acc<T>(grad(z, e == t ? hit : 0.f));
  }
}

template <typename T, typename A>
__global__ void dbias_sum_kernel(const T* __restrict__ du, A* __restrict__ acc, int64_t rows,
                                 int64_t vocab) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= vocab) return;
  A s = acc[j];
  for (int64_t r = 0; r < rows; ++r) s += to_acc(du[r * vocab + j]);
  acc[j] = s;
}

template <typename T, typename A>
__global__ void dbias_store_kernel(const A* __restrict__ acc, T* __restrict__ dbias,
                                   int64_t vocab) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < vocab) dbias[j] = from_acc<T>(acc[j]);
}

constexpr int64_t kShortRowBytes = 96 * 1024;

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// The row copy a block keeps when it writes du: the whole row where it fits, else as much as a
// block can hold (the rest is re-read, from L2).
template <typename T, bool kCap, int kThreads>
void launch_chunk(const LinearCrossEntropyChunk& c, cudaStream_t stream) {
  constexpr auto kernel = chunk_kernel<T, kCap, kThreads>;
  static const size_t static_smem = [] {
    cudaFuncAttributes attr;
    cuda::check(cudaFuncGetAttributes(&attr, kernel), "cudaFuncGetAttributes");
    return attr.sharedSizeBytes;
  }();
  int device, optin;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  cuda::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute");
  const size_t most = (size_t(optin) - static_smem) / 16 * 16;
  if (cuda::resident_blocks<kernel>(kThreads, most, 1) == 0)  // opts this device in to `most`
    fail("linear_cross_entropy: the row kernel does not fit on this device");
  const size_t row_bytes = (size_t(c.vocab) * sizeof(T) + 15) / 16 * 16;
  const size_t smem = c.grad_scale ? std::min(row_bytes, most) : 0;
  kernel<<<unsigned(c.rows), kThreads, smem, stream>>>(c, int64_t(smem / 16));
  cuda::check_launch("linear_cross_entropy chunk_kernel");
}

}  // namespace

void linear_cross_entropy_chunk_cuda(const LinearCrossEntropyChunk& c, cudaStream_t stream) {
  if (c.dtype == DType::kFloat64) fail("linear_cross_entropy: float64 is not supported on CUDA");
  if (c.rows == 0) return;
  cuda::dispatch(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      const bool short_rows = c.vocab * int64_t(sizeof(T)) <= kShortRowBytes;
      if (c.softcap > 0)
        short_rows ? launch_chunk<T, true, 512>(c, stream) : launch_chunk<T, true, 1024>(c, stream);
      else
        short_rows ? launch_chunk<T, false, 512>(c, stream)
                   : launch_chunk<T, false, 1024>(c, stream);
      if (c.dbias_acc && c.grad_scale) {
        dbias_sum_kernel<T, float><<<blocks_for(c.vocab, 256), 256, 0, stream>>>(
            static_cast<const T*>(c.du), static_cast<float*>(c.dbias_acc), c.rows, c.vocab);
        cuda::check_launch("linear_cross_entropy dbias_sum_kernel");
      }
    }
  });
}

void linear_cross_entropy_dbias_cuda(const void* acc, void* dbias, int64_t vocab, DType dtype,
                                     cudaStream_t stream) {
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      dbias_store_kernel<T, float><<<blocks_for(vocab, 256), 256, 0, stream>>>(
          static_cast<const float*>(acc), static_cast<T*>(dbias), vocab);
      cuda::check_launch("linear_cross_entropy dbias_store_kernel");
    }
  });
}

void zero_bytes_cuda(void* p, size_t bytes, cudaStream_t stream) {
  cuda::check(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync");
}

}  // namespace fusedlayers
