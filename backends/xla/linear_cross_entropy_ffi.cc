// XLA FFI handler fusedlayers_linear_cross_entropy_chunk: csrc's row pass of one chunk of
// logits (csrc/loss/linear_cross_entropy.h) between the dots that JAX's chunk loop runs
// (fusedlayers/jax/linear_cross_entropy.py): each row's loss and, when grad_scale has values,
// du and the chunk's column sums of du for dbias. Absent bias / grad_scale are empty buffers;
// the options are float64 attributes, so float64 losses take them exactly.
#include "backends/xla/ffi_binding.h"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::Error chunk(Device& device, AnyBuffer logits, AnyBuffer bias, AnyBuffer target,
                 AnyBuffer grad_scale, Out loss, Out du, Out dbias, int64_t ignore_index,
                 double label_smoothing, double softcap, double z_loss) {
  return call_csrc([&] {
    const bool has_bias = bias.element_count() > 0, grads = grad_scale.element_count() > 0;
    if (target.element_type() != ffi::DataType::S32 &&
        target.element_type() != ffi::DataType::S64)
      arg_error("linear_cross_entropy", "target must be int32 or int64", Error::Kind::kType);
    const TensorRef l = ref(logits);
    linear_cross_entropy_chunk_check(l, ref(bias, has_bias), target.element_count(),
                                     grad_scale.element_count(), label_smoothing, softcap,
                                     z_loss);
    const LinearCrossEntropyChunk c{
        l.data, grads ? data(du) : nullptr, has_bias ? bias.untyped_data() : nullptr,
        target.untyped_data(), target.element_type() == ffi::DataType::S32, 0, l.sizes[0],
        l.sizes[1], l.dtype, ignore_index, label_smoothing, softcap, z_loss,
        grads ? grad_scale.untyped_data() : nullptr, grad_scale.element_count() > 1,
        data(loss), grads && has_bias ? data(dbias) : nullptr};
    linear_cross_entropy_chunk(c, device.exec());
  });
}

const auto kChunkSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<int64_t>("ignore_index").template Attr<double>("label_smoothing")
      .template Attr<double>("softcap").template Attr<double>("z_loss");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(linear_cross_entropy_chunk, ::fusedlayers::xla_binding::chunk,
                         ::fusedlayers::xla_binding::kChunkSig);

// The whole op's argument checks for a trace (ffi_binding.h, TracedTensor): input (N, H), weight
// (V, H), bias; target_rows its N.
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_linear_cross_entropy_check(
    const fusedlayers::xla_binding::TracedTensor* input,
    const fusedlayers::xla_binding::TracedTensor* weight,
    const fusedlayers::xla_binding::TracedTensor* bias, int64_t target_rows,
    double label_smoothing, double softcap, double z_loss, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    LinearCrossEntropy a{ref(input), ref(weight), ref(bias), nullptr, target_rows};
    a.label_smoothing = label_smoothing;
    a.softcap = softcap;
    a.z_loss = z_loss;
    linear_cross_entropy_check(a);
  }, msg, msg_size);
}

// The chunk loop's rows per chunk (csrc's rule) for JAX's loop.
FUSEDLAYERS_XLA_EXPORT int64_t fusedlayers_xla_linear_cross_entropy_chunk_rows(int64_t n,
                                                                               int64_t h,
                                                                               int64_t v) {
  return fusedlayers::linear_cross_entropy_chunk_rows(n, h, v);
}
