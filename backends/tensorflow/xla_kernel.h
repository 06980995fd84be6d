// The XLA kernels of the TF ops, for tf.function(jit_compile=True) and Keras' XLA: each emits a
// typed-FFI custom call to the op's XLA FFI handler (backends/xla, compiled into this library and
// registered with TF's XLA by name), so under XLA the ops run the same csrc kernels. An op's file
// describes its call: the handler, its attributes (an MLIR dictionary built from the TF op's
// attributes) and the shapes of its results; the kernel hands the results out as the op's
// outputs (a backward's last result, its workspace, is not an output).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backends/tensorflow/tf_binding.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace fusedlayers::tf_binding {

// A typed-FFI attribute dictionary, as XLA parses a custom call's backend config.
class XlaAttributes {
 public:
  XlaAttributes& boolean(const char* name, bool v) { return add(name, v ? "true" : "false"); }
  XlaAttributes& f32(const char* name, float v) {
    char buf[48];  // an exponent, so MLIR reads a float ("2" would not parse as f32)
    std::snprintf(buf, sizeof buf, "%.9e : f32", v);
    return add(name, buf);
  }
  XlaAttributes& f64(const char* name, double v) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.17e : f64", v);
    return add(name, buf);
  }
  XlaAttributes& i64(const char* name, int64_t v) {
    return add(name, std::to_string(v) + " : i64");
  }
  XlaAttributes& i64s(const char* name, const std::vector<int64_t>& v) {
    std::string s = "array<i64";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : ": ") + std::to_string(v[i]);
    return add(name, s + ">");
  }
  XlaAttributes& str(const char* name, const std::string& v) {
    return add(name, "\"" + v + "\"");
  }
  std::string dict() const { return "{" + items_ + "}"; }

 private:
  XlaAttributes& add(const char* name, const std::string& value) {
    items_ += (items_.empty() ? "" : ", ") + std::string(name) + " = " + value;
    return *this;
  }
  std::string items_;
};

// The shapes of a call's results from the XLA context (its inputs' shapes and types) and whether
// it compiles for the GPU.
using XlaResults =
    std::function<std::vector<xla::Shape>(::tensorflow::XlaOpKernelContext*, bool gpu)>;

class XlaCustomCallOp : public ::tensorflow::XlaOpKernel {
 public:
  XlaCustomCallOp(OpKernelConstruction* ctx, std::string target, XlaAttributes attributes,
                  XlaResults results, int outputs)
      : XlaOpKernel(ctx), target_(std::move(target)), attributes_(attributes.dict()),
        results_(std::move(results)), outputs_(outputs),
        gpu_(ctx->device_type().type_string() == ::tensorflow::DEVICE_GPU_XLA_JIT) {}

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    std::vector<xla::XlaOp> operands;
    for (int i = 0; i < ctx->num_inputs(); ++i) operands.push_back(ctx->Input(i));
    const xla::XlaOp call = xla::CustomCall(
        ctx->builder(), target_, operands, xla::ShapeUtil::MakeTupleShape(results_(ctx, gpu_)),
        attributes_, /*has_side_effect=*/false, {}, nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
        xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < outputs_; ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  std::string target_, attributes_;
  XlaResults results_;
  int outputs_;
  bool gpu_;
};

// xla::Shape of input `i`, or of its dims [begin, end) in type `type` (default: the input's).
inline xla::Shape input_shape(::tensorflow::XlaOpKernelContext* ctx, int i, int begin = 0,
                              int end = -1, xla::PrimitiveType type = xla::PRIMITIVE_TYPE_INVALID) {
  const auto dims = ctx->InputShape(i).dim_sizes();
  const int stop = end < 0 ? static_cast<int>(dims.size()) + end + 1 : end;
  std::vector<int64_t> kept(dims.begin() + begin, dims.begin() + std::max(begin, stop));
  return xla::ShapeUtil::MakeShape(type == xla::PRIMITIVE_TYPE_INVALID ? ctx->input_xla_type(i)
                                                                       : type, kept);
}

}  // namespace fusedlayers::tf_binding

// backends/xla/workspace_ffi.cc: the CUDA workspace of a backward handler.
extern "C" size_t fusedlayers_xla_workspace_size(int kind, int64_t rows, int64_t cols, int dtype);

namespace fusedlayers::tf_binding {

enum XlaWorkspace { kNormWorkspace = 0, kEpilogueWorkspace = 1 };

// The workspace result of a backward handler on the device the kernel compiles for: none on
// the CPU (its handlers use host memory), csrc's CUDA bytes on the GPU; over input `i` viewed as
// rows x cols.
inline xla::Shape xla_workspace(::tensorflow::XlaOpKernelContext* ctx, bool gpu,
                                XlaWorkspace kind, int i, int64_t cols) {
  const int64_t n = ctx->InputShape(i).num_elements();
  const size_t bytes = gpu ? fusedlayers_xla_workspace_size(kind, cols ? n / cols : 0, cols,
                                                            static_cast<int>(to_dtype(
                                                                ctx->input_type(i))))
                           : 0;
  return xla::ShapeUtil::MakeShape(xla::U8, {static_cast<int64_t>(bytes)});
}

}  // namespace fusedlayers::tf_binding

// Registers `Kernel` as the XLA kernel of TF op `op` on XLA's CPU (and, with GOOGLE_CUDA, GPU)
// JIT devices.
#if GOOGLE_CUDA
#define FUSEDLAYERS_REGISTER_XLA_KERNEL(op, Kernel)                                   \
  REGISTER_KERNEL_BUILDER(Name(op).Device(::tensorflow::DEVICE_CPU_XLA_JIT), Kernel); \
  REGISTER_KERNEL_BUILDER(Name(op).Device(::tensorflow::DEVICE_GPU_XLA_JIT), Kernel)
#else
#define FUSEDLAYERS_REGISTER_XLA_KERNEL(op, Kernel) \
  REGISTER_KERNEL_BUILDER(Name(op).Device(::tensorflow::DEVICE_CPU_XLA_JIT), Kernel)
#endif

// Registers a TF op `op` and its gradient op `op`Grad: their kernels (CPU and GPU) and their XLA
// kernels.
#define FUSEDLAYERS_REGISTER_OP_AND_GRAD(op, Kernel, GradKernel, XlaKernel, GradXlaKernel) \
  FUSEDLAYERS_REGISTER_KERNELS(op, Kernel, "T");                                          \
  FUSEDLAYERS_REGISTER_KERNELS(op "Grad", GradKernel, "T");                               \
  FUSEDLAYERS_REGISTER_XLA_KERNEL(op, XlaKernel);                                         \
  FUSEDLAYERS_REGISTER_XLA_KERNEL(op "Grad", GradXlaKernel)
