// Glue shared by the TensorFlow binding: dtype mapping, TF's intra-op thread pool as the csrc
// parallel-for, the op's GPU stream for the csrc CUDA launchers, csrc errors turned into
// InvalidArgumentError, raw pointers of TF tensors, and the CPU + GPU kernel registration.
//
// Each OpKernel is a template on `bool kGpu` and calls the csrc *_cpu or *_cuda entry point with
// `if constexpr`; the GPU instantiations exist only when built with GOOGLE_CUDA.
#pragma once

#include <string>

#include "csrc/common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#if GOOGLE_CUDA
#include "xla/stream_executor/stream.h"
#endif

namespace fusedlayers {
namespace tf_binding {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

inline DType to_dtype(::tensorflow::DataType t) {
  switch (t) {
    case ::tensorflow::DT_FLOAT: return DType::kFloat32;
    case ::tensorflow::DT_DOUBLE: return DType::kFloat64;
    case ::tensorflow::DT_HALF: return DType::kFloat16;
    case ::tensorflow::DT_BFLOAT16: return DType::kBFloat16;
    default: fail("unsupported dtype " + ::tensorflow::DataTypeString(t));
  }
}

inline ParallelFor tf_parallel_for(OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t n, int64_t grain, const RangeFn& fn) {
    pool->ParallelFor(n, ::tsl::thread::ThreadPool::SchedulingParams::Fixed(grain), fn);
  };
}

// The CUDA stream TF runs this GPU op on; the csrc launchers enqueue on it, so the kernels are
// ordered with TF's own work. Defined only with GOOGLE_CUDA (only GPU kernels call it).
cudaStream_t gpu_stream(OpKernelContext* ctx);
#if GOOGLE_CUDA
inline cudaStream_t gpu_stream(OpKernelContext* ctx) {
  return static_cast<cudaStream_t>(
      ctx->op_device_context()->stream()->platform_specific_handle().stream);
}
#endif

// Runs a csrc call; its argument errors fail the op with InvalidArgumentError.
template <typename Fn>
void call_csrc(OpKernelContext* ctx, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    ctx->CtxFailure(absl::InvalidArgumentError(e.what()));
  }
}

inline const void* ptr(const Tensor& t) { return t.tensor_data().data(); }
inline void* mutable_ptr(Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

inline std::string shape_str(const ::tensorflow::TensorShape& s) { return s.DebugString(); }

}  // namespace tf_binding
}  // namespace fusedlayers

// Registers Kernel<false> on the CPU and, with GOOGLE_CUDA, Kernel<true> on the GPU for the dtypes
// csrc's CUDA kernels take (attribute `type_attr`); TF places float64 calls on the CPU kernel.
#if GOOGLE_CUDA
#define FUSEDLAYERS_REGISTER_KERNELS(op, Kernel, type_attr)                                     \
  REGISTER_KERNEL_BUILDER(Name(op).Device(::tensorflow::DEVICE_CPU), Kernel<false>);           \
  REGISTER_KERNEL_BUILDER(                                                                      \
      Name(op).Device(::tensorflow::DEVICE_GPU).TypeConstraint<float>(type_attr), Kernel<true>); \
  REGISTER_KERNEL_BUILDER(                                                                      \
      Name(op).Device(::tensorflow::DEVICE_GPU).TypeConstraint<Eigen::half>(type_attr),         \
      Kernel<true>);                                                                            \
  REGISTER_KERNEL_BUILDER(                                                                      \
      Name(op).Device(::tensorflow::DEVICE_GPU).TypeConstraint<::tensorflow::bfloat16>(type_attr), \
      Kernel<true>)
#else
#define FUSEDLAYERS_REGISTER_KERNELS(op, Kernel, type_attr) \
  REGISTER_KERNEL_BUILDER(Name(op).Device(::tensorflow::DEVICE_CPU), Kernel<false>)
#endif
