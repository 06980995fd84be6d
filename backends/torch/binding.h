// Glue shared by the PyTorch binding: dtype mapping, argument checks with precise messages,
// ATen's thread pool as the csrc parallel-for, and csrc errors turned into Python ValueError.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "csrc/common.h"

#ifdef FUSEDLAYERS_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace fusedlayers {
namespace torch_binding {

using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

inline std::string describe(at::ScalarType t) { return c10::toString(t); }

// The typed dispatcher handle of fusedlayers::<name>; callers keep it in a function static, so
// the lookup happens once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("fusedlayers::") + name).c_str(), "")
      .typed<Signature>();
}

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "fusedlayers: unreachable dtype ", t);
  }
}

// TypeError unless `t` is float32, float64, float16 or bfloat16.
inline void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16,
                   "fusedlayers.", op, ": ", arg,
                   " must be float32, float64, float16 or bfloat16, got ", s);
}

// ValueError unless `t` lives on the same device as `ref` (named `ref_arg`).
inline void check_same_device(const char* op, const char* arg, const at::Tensor& t,
                              const char* ref_arg, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "fusedlayers.", op, ": ", arg,
                    " must be on the same device as ", ref_arg, " (", ref.device(), "), got ",
                    t.device());
}

inline void check_finite(const char* op, const char* arg, double v) {
  TORCH_CHECK_VALUE(std::isfinite(v), "fusedlayers.", op, ": ", arg, " must be finite, got ", v);
}

inline ParallelFor aten_parallel_for() {
  return [](int64_t n, int64_t grain, const RangeFn& fn) { at::parallel_for(0, n, grain, fn); };
}

// Runs a csrc call, re-raising its argument errors as ValueError, or TypeError for dtypes.
template <typename Fn>
auto call_csrc(Fn&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    TORCH_CHECK_TYPE(e.kind != Error::Kind::kType, e.what());
    TORCH_CHECK_VALUE(false, e.what());
  }
}

inline Sizes sizes(at::IntArrayRef s) { return {s.data(), static_cast<int64_t>(s.size())}; }

// A csrc view of a contiguous tensor of a dtype csrc takes (see check_floating).
inline TensorRef ref(const at::Tensor& t) {
  return {t.data_ptr(), to_dtype(t.scalar_type()), sizes(t.sizes()), true};
}
inline TensorRef ref(const std::optional<at::Tensor>& t) { return t ? ref(*t) : TensorRef{}; }

inline std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// Where csrc runs a pass on `t`'s device: ATen's thread pool, or the current CUDA stream (of the
// device a caller's CUDAGuard has made current).
inline Exec exec_for(const at::Tensor& t) {
#ifdef FUSEDLAYERS_WITH_CUDA
  if (t.is_cuda()) return Exec::gpu(at::cuda::getCurrentCUDAStream().stream());
#endif
  return Exec::cpu(aten_parallel_for());
}

// Workspace from the framework's (caching) allocator on like's device.
inline at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

#ifdef FUSEDLAYERS_WITH_CUDA
// The current stream of the device the caller's CUDAGuard has made current: TORCH_LIBRARY_IMPL
// kernels get no device guard from the dispatcher, so every CUDA branch takes one first.
inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }
#endif

}  // namespace torch_binding
}  // namespace fusedlayers
