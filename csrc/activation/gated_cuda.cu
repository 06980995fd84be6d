// CUDA gated activations (math: gated.h; the activations: cuda_gelu.cuh). One vector of N
// elements per thread over a grid that covers the tensor, as the bias+GELU epilogue: 16-byte
// vectors where cols, the row strides and the pointers allow, else one element. Contiguous
// inputs index flat; strided ones (the halves of one projection) find their row by a division,
// which the pass has the instructions to spare for.
#include <algorithm>
#include <tuple>

#include "util/cuda_common.cuh"
#include "activation/cuda_gated.cuh"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
using cuda::activation;
using cuda::activation_and_grad;
constexpr int kThreads = 256;

// Element offsets of vector i (of N elements) in gate and up: flat when both are contiguous.
template <int N, bool kFlat>
__device__ __forceinline__ void offsets(int64_t i, int64_t vcols, int64_t gs, int64_t us,
                                        int64_t& og, int64_t& ou) {
  if constexpr (kFlat) {
    og = ou = i * N;
  } else {
    const int64_t r = i / vcols, c = (i - r * vcols) * N;
    og = r * gs + c;
    ou = r * us + c;
  }
}

template <typename T, int N, GatedActivation kAct, bool kFlat>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ gate, int64_t gs, const T* __restrict__ up, int64_t us,
                   T* __restrict__ y, int64_t vectors, int64_t vcols) {
  using V = cuda::Vec<T, N>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t og, ou;
    offsets<N, kFlat>(i, vcols, gs, us, og, ou);
    const V g = *reinterpret_cast<const V*>(gate + og);
    const V u = *reinterpret_cast<const V*>(up + ou);
    V out;
#pragma unroll
    for (int k = 0; k < N; ++k)
      out.v[k] = from_acc<T>(activation<kAct>(to_acc(g.v[k])) * to_acc(u.v[k]));
    reinterpret_cast<V*>(y)[i] = out;
  }
}

template <typename T, int N, GatedActivation kAct, bool kFlat>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ gate, int64_t gs,
                    const T* __restrict__ up, int64_t us, T* __restrict__ dgate,
                    T* __restrict__ dup, int64_t vectors, int64_t vcols) {
  using V = cuda::Vec<T, N>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t og, ou;
    offsets<N, kFlat>(i, vcols, gs, us, og, ou);
    const V d = reinterpret_cast<const V*>(dy)[i];
    const V g = *reinterpret_cast<const V*>(gate + og);
    const V u = *reinterpret_cast<const V*>(up + ou);
    V dg, du;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float a, da;
      activation_and_grad<kAct>(to_acc(g.v[k]), a, da);
      const float dk = to_acc(d.v[k]);
      du.v[k] = from_acc<T>(dk * a);
      dg.v[k] = from_acc<T>(dk * to_acc(u.v[k]) * da);
    }
    reinterpret_cast<V*>(dgate)[i] = dg;
    reinterpret_cast<V*>(dup)[i] = du;
  }
}

void check_args(const char* pass, int64_t rows, int64_t cols, int64_t gs, int64_t us,
                DType dtype) {
  if (rows < 0 || cols < 0 || (rows > 1 && (gs < cols || us < cols)))
    fail(std::string(pass) + ": bad sizes " + std::to_string(rows) + " x " + std::to_string(cols));
  if (dtype == DType::kFloat64) fail(std::string(pass) + ": float64 is not supported on CUDA");
}

// launch(T{}, N, kAct, kFlat) for the dtype, the widest vector that fits and the activation.
template <typename Fn>
void dispatch(DType dtype, GatedActivation act, int64_t rows, int64_t cols, int64_t gs,
              int64_t us, std::initializer_list<const void*> pointers, Fn&& launch) {
  cuda::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, double>) {
      constexpr int kVec = 16 / sizeof(T);
      bool vec = cols % kVec == 0 && gs % kVec == 0 && us % kVec == 0;
      for (const void* p : pointers) vec = vec && cuda::aligned(p, 16);
      const bool flat = rows <= 1 || (gs == cols && us == cols);
      auto with_act = [&](auto n_tag, auto flat_tag) {
        with_activation(act, [&](auto act_tag) { launch(t, n_tag, act_tag, flat_tag); });
      };
      auto with_flat = [&](auto n_tag) {
        if (flat) with_act(n_tag, std::true_type{});
        else with_act(n_tag, std::false_type{});
      };
      if (vec) with_flat(std::integral_constant<int, kVec>{});
      else with_flat(std::integral_constant<int, 1>{});
    }
  });
}

int64_t blocks_for(int64_t vectors) {
  return std::min<int64_t>((vectors + kThreads - 1) / kThreads, INT32_MAX);
}

}  // namespace

void gated_forward_cuda(const void* gate, int64_t gs, const void* up, int64_t us, void* y,
                        int64_t rows, int64_t cols, GatedActivation act, DType dtype,
                        cudaStream_t stream) {
  check_args("gated_forward_cuda", rows, cols, gs, us, dtype);
  if (rows * cols == 0) return;
  dispatch(dtype, act, rows, cols, gs, us, {gate, up, y}, [&](auto t, auto n, auto a, auto f) {
    using T = decltype(t);
    constexpr int N = decltype(n)::value;
    const int64_t vectors = rows * cols / N;
    forward_kernel<T, N, decltype(a)::value, decltype(f)::value>
        <<<blocks_for(vectors), kThreads, 0, stream>>>(static_cast<const T*>(gate), gs,
                                                       static_cast<const T*>(up), us,
                                                       static_cast<T*>(y), vectors, cols / N);
    cuda::check_launch("gated forward_kernel");
  });
}

void gated_backward_cuda(const void* dy, const void* gate, int64_t gs, const void* up,
                         int64_t us, void* dgate, void* dup, int64_t rows, int64_t cols,
                         GatedActivation act, DType dtype, cudaStream_t stream) {
  check_args("gated_backward_cuda", rows, cols, gs, us, dtype);
  if (rows * cols == 0) return;
  dispatch(dtype, act, rows, cols, gs, us, {dy, gate, up, dgate, dup},
           [&](auto t, auto n, auto a, auto f) {
             using T = decltype(t);
             constexpr int N = decltype(n)::value;
             const int64_t vectors = rows * cols / N;
             backward_kernel<T, N, decltype(a)::value, decltype(f)::value>
                 <<<blocks_for(vectors), kThreads, 0, stream>>>(
                     static_cast<const T*>(dy), static_cast<const T*>(gate), gs,
                     static_cast<const T*>(up), us, static_cast<T*>(dgate),
                     static_cast<T*>(dup), vectors, cols / N);
             cuda::check_launch("gated backward_kernel");
           });
}

}  // namespace fusedlayers
