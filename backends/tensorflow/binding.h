// Glue shared by the TensorFlow binding: dtype mapping, TF's intra-op thread pool as the csrc
// parallel-for, csrc errors turned into InvalidArgumentError, raw pointers of TF tensors.
#pragma once

#include <string>

#include "csrc/common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

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
