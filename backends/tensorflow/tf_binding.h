// Glue shared by the TensorFlow binding: dtype mapping, TF's intra-op thread pool as the csrc
// parallel-for, the op's GPU stream for the csrc CUDA launchers, csrc errors turned into
// InvalidArgumentError, raw pointers of TF tensors, and the CPU + GPU kernel registration.
//
// Each OpKernel is a template on `bool kGpu`, which picks the Exec it hands the csrc op entry
// point; the GPU instantiations exist only with GOOGLE_CUDA.
#pragma once

#include <string>

#include "absl/container/inlined_vector.h"

#include "util/common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#if GOOGLE_CUDA
#include "xla/stream_executor/stream.h"
#endif

namespace fusedlayers {
namespace tf_binding {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// The ops' dtype attributes: T of x (and everything like it), P of the norms' parameters, U of
// their statistics.
constexpr char kTypeT[] = "T: {float, double, half, bfloat16}";
constexpr char kTypeP[] = "P: {float, double, half, bfloat16}";
constexpr char kTypeU[] = "U: {float, double}";

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

// Runs a csrc call; its argument errors fail the op with InvalidArgumentError. Returns whether
// it succeeded.
template <typename Fn>
bool call_csrc(OpKernelContext* ctx, Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const Error& e) {
    ctx->CtxFailure(absl::InvalidArgumentError(e.what()));
    return false;
  }
}

// Where csrc runs a pass of Kernel<kGpu>: TF's intra-op pool, or the op's GPU stream.
template <bool kGpu>
Exec exec_for(OpKernelContext* ctx) {
  if constexpr (kGpu)
    return Exec::gpu(gpu_stream(ctx));
  else
    return Exec::cpu(tf_parallel_for(ctx));
}

// A csrc view of a TF tensor (not defined when `defined` is false), holding its sizes.
class Ref {
 public:
  explicit Ref(const Tensor& t, bool defined = true) {
    for (int d = 0; d < t.dims(); ++d) dims_.push_back(t.dim_size(d));
    ref_ = {const_cast<char*>(t.tensor_data().data()), to_dtype(t.dtype()),
            {dims_.data(), static_cast<int64_t>(dims_.size())}, defined};
  }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  const TensorRef& operator*() const { return ref_; }

 private:
  absl::InlinedVector<int64_t, 6> dims_;
  TensorRef ref_;
};

inline void* mutable_ptr(Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// A workspace of `bytes` (none for 0) from TF's allocator; its pointer, or null.
inline void* allocate_workspace(OpKernelContext* ctx, size_t bytes, Tensor* t) {
  if (!bytes) return nullptr;
  const auto status = ctx->allocate_temp(
      ::tensorflow::DT_INT8, ::tensorflow::TensorShape({static_cast<int64_t>(bytes)}), t);
  if (!status.ok()) {
    ctx->CtxFailure(status);
    return nullptr;
  }
  return mutable_ptr(t);
}

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
