// XLA FFI handler fusedlayers_linear_cross_entropy_gemm, CUDA only: the whole linear_cross_entropy
// op of csrc/loss/linear_cross_entropy.h, its chunk loop with cuBLASLt's GEMMs (csrc/gemm/cublaslt.h), as
// the torch extension runs it with ATen's: each chunk's logits in the workspace, overwritten by
// du, dW accumulated in W's dtype by the GEMM itself. fusedlayers/jax/linear_cross_entropy.py
// calls it on CUDA in place of its scan of XLA's dots around the chunk handler. The `workspace`
// result holds csrc's workspace (a chunk of logits, the dbias sums), then cuBLASLt's. Absent
// bias / grad_scale are empty buffers, as are the gradients' results when grad_scale is. Built
// into the JAX library of CUDA builds only (_sources.GEMM_SOURCES).
#include "backends/xla/ffi_binding.h"
#include "gemm/cublaslt.h"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers::xla_binding {
namespace {

constexpr const char* kOp = "linear_cross_entropy";

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

ffi::Error run(Device& device, AnyBuffer input, AnyBuffer weight, AnyBuffer bias,
               AnyBuffer target, AnyBuffer grad_scale, Out loss, Out dinput, Out dweight,
               Out dbias, Out workspace, int64_t ignore_index, double label_smoothing,
               double softcap, double z_loss) {
  return call_csrc([&] {
    if (target.element_type() != ffi::DataType::S32 &&
        target.element_type() != ffi::DataType::S64)
      arg_error(kOp, "target must be int32 or int64", Error::Kind::kType);
    const bool has_bias = bias.element_count() > 0, grads = grad_scale.element_count() > 0;
    LinearCrossEntropy a{ref(input), ref(weight), ref(bias, has_bias), target.untyped_data(),
                         static_cast<int64_t>(target.element_count()), ignore_index,
                         label_smoothing, softcap, z_loss,
                         target.element_type() == ffi::DataType::S32};
    if (grads) {
      a.grad_scale = grad_scale.untyped_data();
      a.grad_scale_rows = static_cast<int64_t>(grad_scale.element_count());
      a.dinput = data(dinput);
      a.dweight = data(dweight);
      if (has_bias) a.dbias = data(dbias);
    }
    a.loss = data(loss);
    const LinearCrossEntropySizes s = linear_cross_entropy_check(a);
    const size_t own = aligned(linear_cross_entropy_workspace_size(a, s));
    const LtContext lt = lt_context(device, workspace, own);
    a.workspace = data(workspace);
    linear_cross_entropy(a, s, device.exec(), cublaslt_gemm(lt, kOp));
  });
}

const auto kSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<int64_t>("ignore_index").template Attr<double>("label_smoothing")
      .template Attr<double>("softcap").template Attr<double>("z_loss");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_CUDA_HANDLER(linear_cross_entropy_gemm, ::fusedlayers::xla_binding::run,
                             ::fusedlayers::xla_binding::kSig);

// The `workspace` result's bytes for n rows of h features, a vocabulary of v, csrc DType
// `dtype`: csrc's (a chunk of logits; the dbias sums when has_bias and grads), 256-byte
// aligned, then cuBLASLt's.
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_linear_cross_entropy_gemm_workspace_size(
    int64_t n, int64_t h, int64_t v, int dtype, bool has_bias, bool grads) {
  using namespace fusedlayers;
  static const double kWanted = 1;  // a grad_scale that only marks gradients as wanted
  LinearCrossEntropy a;
  a.input.dtype = static_cast<DType>(dtype);
  a.bias.defined = has_bias;
  a.grad_scale = grads ? &kWanted : nullptr;
  const LinearCrossEntropySizes s{n, h, v, linear_cross_entropy_chunk_rows(n, h, v)};
  return xla_binding::aligned(linear_cross_entropy_workspace_size(a, s)) +
         kCublasLtWorkspaceBytes;
}
