// XLA FFI handlers fusedlayers_grouped_gemm_{forward,backward} on csrc/gemm/grouped_gemm.h, which
// checks the arguments. XLA's buffers are contiguous; offsets are int32 (a buffer of another
// dtype is csrc's type error). The CUDA handlers take a workspace result (the Hopper kernels'
// per-group arrays and CUTLASS's workspace), sized by Python from
// fusedlayers_xla_grouped_gemm_workspace_size; the backward's dx or dweight is an empty result
// where it is not wanted.
#include "backends/xla/ffi_binding.h"
#include "gemm/grouped_gemm.h"

namespace fusedlayers::xla_binding {
namespace {

IndexRef offsets_ref(const AnyBuffer& b) {
  return {b.untyped_data(),
          b.element_type() == ffi::DataType::S32 ? IndexType::kInt32 : IndexType::kInt64,
          sizes(b.dimensions())};
}

ffi::Error forward(Device& device, AnyBuffer x, AnyBuffer weight, AnyBuffer offsets, Out y,
                   Out workspace, bool transposed) {
  return call_csrc([&] {
    GroupedGemmForward a{ref(x), ref(weight), offsets_ref(offsets), transposed};
    const GroupedGemmShape s = grouped_gemm_forward_check(a);
    a.y = data(y);
    a.workspace = device.workspace(grouped_gemm_workspace_size(s, a.x.dtype, device.exec()),
                                   workspace);
    grouped_gemm_forward(a, s, device.exec());
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer x, AnyBuffer weight,
                    AnyBuffer offsets, Out dx, Out dweight, Out workspace, bool transposed) {
  return call_csrc([&] {
    GroupedGemmBackward a{ref(dy), ref(x), ref(weight), offsets_ref(offsets), transposed};
    const GroupedGemmShape s = grouped_gemm_backward_check(a);
    a.dx = dx->element_count() > 0 ? data(dx) : nullptr;
    a.dweight = dweight->element_count() > 0 ? data(dweight) : nullptr;
    a.workspace = device.workspace(grouped_gemm_workspace_size(s, a.x.dtype, device.exec()),
                                   workspace);
    grouped_gemm_backward(a, s, device.exec());
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<bool>("transposed");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Attr<bool>("transposed");
};

GroupedGemmShape traced_shape(const TracedTensor* x, const TracedTensor* weight,
                              const int64_t* offsets_dims, int64_t offsets_ndim,
                              bool offsets_int32, bool transposed) {
  GroupedGemmForward a{ref(x), ref(weight),
                       {nullptr, offsets_int32 ? IndexType::kInt32 : IndexType::kInt64,
                        {offsets_dims, offsets_ndim}},
                       transposed};
  return grouped_gemm_forward_check(a);
}

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(grouped_gemm);

// The forward's argument checks for a trace (ffi_binding.h, TracedTensor): offsets given by its dims
// and whether it is int32.
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_grouped_gemm_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* weight, const int64_t* offsets_dims,
    int64_t offsets_ndim, bool offsets_int32, bool transposed, char* msg, size_t msg_size) {
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    traced_shape(x, weight, offsets_dims, offsets_ndim, offsets_int32, transposed);
  }, msg, msg_size);
}

// The CUDA workspace of either pass for x (rows, k), y (rows, n) of csrc DType `dtype` and
// `groups` weights (0 in a build without CUDA handlers).
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_grouped_gemm_workspace_size(
    int64_t rows, int64_t k, int64_t n, int64_t groups, int dtype) {
#ifdef FUSEDLAYERS_WITH_CUDA
  using namespace fusedlayers;
  try {
    GroupedGemmShape s{rows, k, n, groups};
    return grouped_gemm_workspace_size(s, static_cast<DType>(dtype), Exec::gpu(nullptr));
  } catch (const Error&) {
    return 0;
  }
#else
  (void)rows, (void)k, (void)n, (void)groups, (void)dtype;
  return 0;
#endif
}

// Which CUDA kernels take these operands on a GPU of compute capability `arch` (major * 10 +
// minor): 0 the Hopper kernels, 1 the tiled kernel (csrc's GroupedGemmPath).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_grouped_gemm_path(int64_t rows, int64_t k, int64_t n,
                                                              int64_t groups, int dtype,
                                                              int arch) {
  using namespace fusedlayers;
  const GroupedGemmShape s{rows, k, n, groups};
  return grouped_gemm_cuda_path(static_cast<DType>(dtype), s, arch) == GroupedGemmPath::kSm90
             ? 0 : 1;
}
