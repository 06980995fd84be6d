// CUDA AdamW: one launch per table of up to kMaxTensors parameters of one dtype combination,
// the table (pointers, sizes, each parameter's first chunk) in the kernel's parameters
// (__grid_constant__: indexed in place, never copied per thread). Block b finds its parameter by
// a binary search of the first chunks and updates that parameter's chunk, kAdamWChunk elements,
// four at a time in vector accesses where every tensor of the parameter is aligned for them.
// The coefficients are worked out once per block, in float64, from the step count and learning
// rate in device memory. The norm's partials are one per chunk, summed by one block in a fixed
// order.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "optimizer/adamw.h"
#include "util/cuda_common.cuh"

namespace fusedlayers {
namespace {

using cuda::Acc;
using cuda::from_acc;
using cuda::to_acc;

constexpr int kThreads = 256;
constexpr int kVec = 4;
// Parameters per launch: the update's table takes ~18 KB of the 32 KB of kernel parameters
// (CUDA 12.1+ on Volta and later).
constexpr int kMaxTensors = 256;
static_assert(kAdamWChunk % (kThreads * kVec) == 0, "a chunk is whole vector steps");

struct StepTable {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  void* exp_avg[kMaxTensors];
  void* exp_avg_sq[kMaxTensors];
  void* max_exp_avg_sq[kMaxTensors];
  float* master[kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t first_chunk[kMaxTensors + 1];
  int count;
};

struct NormTable {
  const void* grad[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t first_chunk[kMaxTensors + 1];
  int count;
  int64_t first_partial;
};

// The entry j of first_chunk[0 .. count] with first_chunk[j] <= chunk < first_chunk[j + 1].
__device__ __forceinline__ int find_entry(const int32_t* first_chunk, int count, int32_t chunk) {
  int lo = 0, hi = count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_chunk[mid] <= chunk) lo = mid;
    else hi = mid;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (kVec * sizeof(T)) == 0;
}

// The DType of a storage type: only the combinations adamw.h's rules allow are instantiated.
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
  else if constexpr (std::is_same_v<T, __half>) return DType::kFloat16;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::kBFloat16;
  else return DType::kFloat32;
}

// Elements i .. i + N - 1 of one parameter (N = kVec in vector accesses, or 1).
template <typename P, typename M, bool kMaster, bool kAmsgrad, int N, typename A>
__device__ __forceinline__ void update(P* param, const P* grad, M* exp_avg, M* exp_avg_sq,
                                       M* max_exp_avg_sq, float* master, int64_t i,
                                       const AdamWCoefficients<A>& c) {
  using VP = cuda::Vec<P, N>;
  using VM = cuda::Vec<M, N>;
  using VF = cuda::Vec<float, N>;
  const VP g = *reinterpret_cast<const VP*>(grad + i);
  VM m = *reinterpret_cast<const VM*>(exp_avg + i);
  VM v = *reinterpret_cast<const VM*>(exp_avg_sq + i);
  VM vm;
  if constexpr (kAmsgrad) vm = *reinterpret_cast<const VM*>(max_exp_avg_sq + i);
  VF wf;
  VP w;
  if constexpr (kMaster) wf = *reinterpret_cast<const VF*>(master + i);
  else w = *reinterpret_cast<const VP*>(param + i);
#pragma unroll
  for (int e = 0; e < N; ++e) {
    A we;
    if constexpr (kMaster) we = wf.v[e];
    else we = to_acc(w.v[e]);
    A me = to_acc(m.v[e]), ve = to_acc(v.v[e]), vme = 0;
    if constexpr (kAmsgrad) vme = to_acc(vm.v[e]);
    adamw_update<kAmsgrad>(we, me, ve, vme, A(to_acc(g.v[e])), c);
    if constexpr (kMaster) wf.v[e] = we;
    w.v[e] = from_acc<P>(we);
    m.v[e] = from_acc<M>(me);
    v.v[e] = from_acc<M>(ve);
    if constexpr (kAmsgrad) vm.v[e] = from_acc<M>(vme);
  }
  *reinterpret_cast<VP*>(param + i) = w;
  if constexpr (kMaster) *reinterpret_cast<VF*>(master + i) = wf;
  *reinterpret_cast<VM*>(exp_avg + i) = m;
  *reinterpret_cast<VM*>(exp_avg_sq + i) = v;
  if constexpr (kAmsgrad) *reinterpret_cast<VM*>(max_exp_avg_sq + i) = vm;
}

template <typename P, typename M, bool kMaster, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
    adamw_step_kernel(const __grid_constant__ StepTable t, const AdamWOptions o) {
  using A = typename Acc<P>::type;
  if (o.found_inf && *o.found_inf != 0) return;  // the skipped step
  const int j = find_entry(t.first_chunk, t.count, int32_t(blockIdx.x));
  __shared__ AdamWCoefficients<A> shared;
  if (threadIdx.x == 0) {
    const double lr = o.lr_device ? *o.lr_device : o.lr;
    const double factor = adamw_grad_factor(o, o.grad_scale ? *o.grad_scale : 1.0,
                                            o.grad_sumsq ? *o.grad_sumsq : 0.0);
    shared = adamw_coefficients<A>(o, lr, *t.step[j], factor);
  }
  __syncthreads();
  const AdamWCoefficients<A> c = shared;
  P* param = static_cast<P*>(t.param[j]);
  const P* grad = static_cast<const P*>(t.grad[j]);
  M* exp_avg = static_cast<M*>(t.exp_avg[j]);
  M* exp_avg_sq = static_cast<M*>(t.exp_avg_sq[j]);
  M* max_exp_avg_sq = static_cast<M*>(t.max_exp_avg_sq[j]);
  float* master = t.master[j];
  const int64_t begin = int64_t(blockIdx.x - t.first_chunk[j]) * kAdamWChunk;
  const int64_t end = min(t.numel[j], begin + kAdamWChunk);
  const bool vec = vec_aligned<P>(param) && vec_aligned<P>(grad) && vec_aligned<M>(exp_avg) &&
                   vec_aligned<M>(exp_avg_sq) && vec_aligned<M>(max_exp_avg_sq) &&
                   vec_aligned<float>(master);
  int64_t i = begin + threadIdx.x * kVec;
  if (vec)
    for (; i + kVec <= end; i += kThreads * kVec)
      update<P, M, kMaster, kAmsgrad, kVec>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                            master, i, c);
  // The rest one element a thread: an unaligned parameter's chunk, or the last < kVec * kThreads.
  const int64_t rest = vec ? begin + (end - begin) / kVec * kVec : begin;
  for (int64_t e = rest + threadIdx.x; e < end; e += kThreads)
    update<P, M, kMaster, kAmsgrad, 1>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, master,
                                       e, c);
}

__global__ void adamw_advance_steps_kernel(const __grid_constant__ StepTable t,
                                           const float* found_inf) {
  if (found_inf && *found_inf != 0) return;
  if (int(threadIdx.x) < t.count) *t.step[threadIdx.x] += 1;
}

template <typename P, typename M, bool kMaster, bool kAmsgrad>
void launch_steps(const AdamWKernelArgs& k, const AdamWOptions& o, cudaStream_t stream) {
  StepTable t{};
  int64_t chunks = 0;
  auto flush = [&] {
    if (t.count == 0) return;
    if (chunks > 0) {
      adamw_step_kernel<P, M, kMaster, kAmsgrad>
          <<<unsigned(chunks), kThreads, 0, stream>>>(t, o);
      cuda::check_launch("adamw_step_kernel");
    }
    adamw_advance_steps_kernel<<<1, kMaxTensors, 0, stream>>>(t, o.found_inf);
    cuda::check_launch("adamw_advance_steps_kernel");
    t.count = 0;
    chunks = 0;
  };
  for (int64_t i : k.members) {
    const AdamWTensors& p = (*k.params)[i];
    const int64_t n = p.param.sizes.numel(), c = (n + kAdamWChunk - 1) / kAdamWChunk;
    if (t.count == kMaxTensors || chunks + c > INT32_MAX) flush();
    const int e = t.count;
    t.param[e] = p.param.data;
    t.grad[e] = p.grad.data;
    t.exp_avg[e] = p.exp_avg.data;
    t.exp_avg_sq[e] = p.exp_avg_sq.data;
    t.max_exp_avg_sq[e] = kAmsgrad ? p.max_exp_avg_sq.data : nullptr;
    t.master[e] = kMaster ? static_cast<float*>(p.master.data) : nullptr;
    t.step[e] = static_cast<float*>(p.step.data);
    t.numel[e] = n;
    t.first_chunk[e] = int32_t(chunks);
    chunks += c;
    t.first_chunk[e + 1] = int32_t(chunks);
    t.count = e + 1;
  }
  flush();
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_sumsq_partials_kernel(const __grid_constant__ NormTable t, double* partials) {
  using A = typename Acc<G>::type;
  const int j = find_entry(t.first_chunk, t.count, int32_t(blockIdx.x));
  const G* grad = static_cast<const G*>(t.grad[j]);
  const int64_t begin = int64_t(blockIdx.x - t.first_chunk[j]) * kAdamWChunk;
  const int64_t end = min(t.numel[j], begin + kAdamWChunk);
  const bool vec = vec_aligned<G>(grad);
  A acc = 0;
  int64_t i = begin + threadIdx.x * kVec;
  if (vec)
    for (; i + kVec <= end; i += kThreads * kVec) {
      const auto g = *reinterpret_cast<const cuda::Vec<G, kVec>*>(grad + i);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += A(to_acc(g.v[e])) * A(to_acc(g.v[e]));
    }
  const int64_t rest = vec ? begin + (end - begin) / kVec * kVec : begin;
  for (int64_t e = rest + threadIdx.x; e < end; e += kThreads) {
    const A g = to_acc(grad[e]);
    acc += g * g;
  }
  __shared__ double smem[kThreads / 32];
  const double sum = cuda::block_sum<double>(double(acc), smem);
  if (threadIdx.x == 0) partials[t.first_partial + blockIdx.x] = sum;
}

constexpr int kTotalThreads = 1024;

__global__ void __launch_bounds__(kTotalThreads)
    adamw_sumsq_total_kernel(const double* partials, int64_t count, double* sumsq) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += kTotalThreads) s += partials[i];
  __shared__ double smem[kTotalThreads / 32];
  s = cuda::block_sum<double>(s, smem);
  if (threadIdx.x == 0) *sumsq = s;
}

}  // namespace

void adamw_step_cuda(const AdamWKernelArgs& k, const AdamWOptions& o, cudaStream_t stream) {
  cuda::dispatch(k.param_dtype, [&](auto p) {
    cuda::dispatch(k.moment_dtype, [&](auto m) {
      using P = decltype(p);
      using M = decltype(m);
      if constexpr (adamw_moment_dtype_ok(dtype_of<P>(), dtype_of<M>())) {
        if constexpr (adamw_half(dtype_of<P>())) {
          if (k.master) {
            if (o.amsgrad) launch_steps<P, M, true, true>(k, o, stream);
            else launch_steps<P, M, true, false>(k, o, stream);
            return;
          }
        }
        if (o.amsgrad) launch_steps<P, M, false, true>(k, o, stream);
        else launch_steps<P, M, false, false>(k, o, stream);
      }
    });
  });
}

void adamw_grad_sumsq_cuda(const std::vector<TensorRef>& grads, double* sumsq, double* partials,
                           cudaStream_t stream) {
  int64_t done = 0;  // partials written so far: the chunks of the grads before, in list order
  for (size_t i = 0; i < grads.size();) {
    NormTable t{};
    t.first_partial = done;
    const DType dtype = grads[i].dtype;
    int64_t chunks = 0;
    for (; i < grads.size() && t.count < kMaxTensors && grads[i].dtype == dtype; ++i) {
      const int64_t n = grads[i].sizes.numel(), c = (n + kAdamWChunk - 1) / kAdamWChunk;
      if (chunks + c > INT32_MAX) break;
      t.grad[t.count] = grads[i].data;
      t.numel[t.count] = n;
      t.first_chunk[t.count] = int32_t(chunks);
      chunks += c;
      t.first_chunk[++t.count] = int32_t(chunks);
    }
    if (chunks > 0) {
      cuda::dispatch(dtype, [&](auto g) {
        adamw_sumsq_partials_kernel<decltype(g)><<<unsigned(chunks), kThreads, 0, stream>>>(
            t, partials);
      });
      cuda::check_launch("adamw_sumsq_partials_kernel");
    }
    done += chunks;
  }
  adamw_sumsq_total_kernel<<<1, kTotalThreads, 0, stream>>>(partials, done, sumsq);
  cuda::check_launch("adamw_sumsq_total_kernel");
}

}  // namespace fusedlayers
