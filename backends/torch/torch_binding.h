// Glue shared by the PyTorch binding: dtype mapping, the checks csrc cannot see (dtypes csrc does
// not take, devices), ATen's thread pool as the csrc parallel-for, csrc errors turned into
// Python ValueError / TypeError, and the registration of an operator's kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <string>

#include "util/common.h"
#include "gemm/cublaslt.h"
#include "gemm/gemm.h"

#ifdef FUSEDLAYERS_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace fusedlayers {
namespace torch_binding {

using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

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

inline at::ScalarType to_scalar_type(DType t) {
  switch (t) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
  }
  TORCH_CHECK(false, "fusedlayers: unreachable dtype");
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

// check_floating of x (named x_name) and of each present tensor of `others`, which must be on
// x's device.
inline void check_tensors(const char* op, const char* x_name, const at::Tensor& x,
                          std::initializer_list<std::pair<const char*, const OptTensor*>> others) {
  check_floating(op, x_name, x);
  for (const auto& [arg, t] : others) {
    if (!*t) continue;
    check_floating(op, arg, **t);
    check_same_device(op, arg, **t, x_name, x);
  }
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

// An ATen view of a gemm.h Matrix with `options` (its stored layout, transposed where it is).
inline at::Tensor matrix_view(const Matrix& m, const at::TensorOptions& options) {
  const at::Tensor stored = at::from_blob(
      const_cast<void*>(m.data), {m.transposed ? m.cols : m.rows, m.transposed ? m.rows : m.cols},
      options);
  return m.transposed ? stored.t() : stored;
}

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

// Workspace from the framework's (caching) allocator on like's device (data null for 0 bytes).
inline at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// Runs csrc pass run(a, sizes, exec) on `like`'s device (under its device guard) with
// a.workspace: size(a, sizes, exec) bytes from the caching allocator.
template <typename Args, typename Sizes, typename SizeFn, typename RunFn>
void run_with_workspace(const at::Tensor& like, Args& a, Sizes sizes, SizeFn&& size,
                        RunFn&& run) {
  const c10::OptionalDeviceGuard guard(like.device());  // kernels get no guard from the dispatcher
  const Exec exec = exec_for(like);
  const at::Tensor ws = workspace(call_csrc([&] { return size(a, sizes, exec); }), like);
  a.workspace = ws.data_ptr();
  call_csrc([&] { run(a, sizes, exec); });
}

// A norm's statistics (mean, rstd) for x: its leading dims, in csrc's norm_stat_dtype.
inline at::Tensor stats(const at::Tensor& x, at::IntArrayRef normalized_shape) {
  const auto dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::empty(x.sizes().slice(0, x.dim() - normalized_shape.size()),
                   x.options().dtype(dtype));
}

// The gradient of an optional parameter: like it, or empty (on like's device) when absent.
inline at::Tensor param_grad(const OptTensor& param, const at::Tensor& like) {
  return param ? at::empty(param->sizes(), param->options()) : at::empty({0}, like.options());
}

// Autocast to float32 on CUDA, as ATen's policy for the normalizations: while it lives, the
// AutocastCUDA key is excluded (the op below runs its own kernel), and it casts the float32,
// float16 and bfloat16 tensors of CUDA (float64 stays float64).
class AutocastToFloat {
 public:
  at::Tensor operator()(const at::Tensor& t) const {
    return at::autocast::cached_cast(at::kFloat, t, c10::DeviceType::CUDA);
  }
  OptTensor operator()(const OptTensor& t) const {
    return at::autocast::cached_cast(at::kFloat, t, c10::DeviceType::CUDA);
  }

 private:
  c10::impl::ExcludeDispatchKeyGuard no_autocast_{c10::DispatchKey::AutocastCUDA};
};

#ifdef FUSEDLAYERS_WITH_CUDA
// The current stream of the device the caller's CUDAGuard has made current: TORCH_LIBRARY_IMPL
// kernels get no device guard from the dispatcher, so every CUDA branch takes one first.
inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }
#endif

// csrc's cuBLASLt context for a CUDA tensor's GEMMs: csrc's handle, not ATen's (csrc/gemm/
// cublaslt.h says why), with ATen's workspace and stream; empty for a CPU tensor.
inline LtContext lt_context(const at::Tensor& x) {
#ifdef FUSEDLAYERS_WITH_CUDA
  if (x.is_cuda())
    return {cublaslt_handle(), at::cuda::getCUDABlasLtWorkspace(),
            at::cuda::getCUDABlasLtWorkspaceSize(), current_stream()};
#endif
  return {};
}

// Registers, from an op's TORCH_LIBRARY_FRAGMENT, `kernel` as operator `name`'s kernel for the
// CPU and, in CUDA builds, for CUDA: one kernel for both, csrc picks the device's code.
template <typename Fn>
void impl_devices(torch::Library& m, const char* name, Fn* kernel) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CPU, kernel));
#ifdef FUSEDLAYERS_WITH_CUDA
  m.impl(name, torch::dispatch(c10::DispatchKey::CUDA, kernel));
#endif
}

// Registers `kernel` as operator `name`'s kernel for one dispatch key (Autograd, AutocastCUDA).
template <typename Fn>
void impl_key(torch::Library& m, c10::DispatchKey key, const char* name, Fn* kernel) {
  m.impl(name, torch::dispatch(key, kernel));
}

}  // namespace torch_binding
}  // namespace fusedlayers
