// XLA FFI handlers fusedlayers_rope_{forward,backward} on csrc/rope/rope.h, which checks the
// arguments. XLA's buffers are contiguous: q and k are row-major in the layout unsqueeze_dim
// says, cos and sin row-major (batch, seq, rotary_dim) with batch already broadcast.
#include "backends/xla/ffi_binding.h"
#include "rope/rope.h"

namespace fusedlayers::xla_binding {
namespace {

// A contiguous (b, h, s, d) (unsqueeze_dim 1) or (b, s, h, d) (2) buffer as a RopeView.
RopeView view(void* data, Dims d, int64_t unsqueeze_dim) {
  const int64_t row = d[3];
  if (unsqueeze_dim == 1) return {data, d[1], d[1] * d[2] * row, d[2] * row, row};
  return {data, d[2], d[1] * d[2] * row, row, d[2] * row};
}

void run(Device& device, const char* op, AnyBuffer q, AnyBuffer k, AnyBuffer cos, AnyBuffer sin,
         Out q_out, Out k_out, int64_t unsqueeze_dim, bool interleaved, bool backward) {
  const RopeArgs a{ref(q), ref(k), ref(cos), ref(sin), unsqueeze_dim, interleaved};
  const RopeShape shape = rope_check(op, a);
  const Dims c = cos.dimensions();
  RopePass p{a.q.dtype, a.cos.dtype, shape, cos.untyped_data(), sin.untyped_data(),
             c[0] == 1 ? 0 : c[1] * c[2], c[2],
             view(q.untyped_data(), q.dimensions(), unsqueeze_dim),
             view(k.untyped_data(), k.dimensions(), unsqueeze_dim),
             view(data(q_out), q.dimensions(), unsqueeze_dim),
             view(data(k_out), k.dimensions(), unsqueeze_dim), interleaved, backward};
  rope(p, device.exec());
}

ffi::Error forward(Device& device, AnyBuffer q, AnyBuffer k, AnyBuffer cos, AnyBuffer sin,
                   Out q_embed, Out k_embed, int64_t unsqueeze_dim, bool interleaved) {
  return call_csrc([&] {
    run(device, "rope", q, k, cos, sin, q_embed, k_embed, unsqueeze_dim, interleaved, false);
  });
}

ffi::Error backward(Device& device, AnyBuffer dq_embed, AnyBuffer dk_embed, AnyBuffer cos,
                    AnyBuffer sin, Out dq, Out dk, int64_t unsqueeze_dim, bool interleaved) {
  return call_csrc([&] {
    run(device, "rope_backward", dq_embed, dk_embed, cos, sin, dq, dk, unsqueeze_dim,
        interleaved, true);
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<int64_t>("unsqueeze_dim")
      .template Attr<bool>("interleaved");
};
const auto kBackwardSig = kForwardSig;

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(rope);

// The forward's argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_rope_check(
    const fusedlayers::xla_binding::TracedTensor* q,
    const fusedlayers::xla_binding::TracedTensor* k,
    const fusedlayers::xla_binding::TracedTensor* cos,
    const fusedlayers::xla_binding::TracedTensor* sin, int64_t unsqueeze_dim, bool interleaved,
    char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    rope_check("rope", {ref(q), ref(k), ref(cos), ref(sin), unsqueeze_dim, interleaved});
  }, msg, msg_size);
}
