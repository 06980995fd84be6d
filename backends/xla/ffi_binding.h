// Glue shared by the XLA FFI handlers (one file per op): dtype mapping, csrc views of XLA's
// buffers, where a pass runs (XLA's intra-op thread pool as the csrc parallel-for on the CPU,
// XLA's stream on CUDA), csrc errors turned into ffi::Error with csrc's
// text, and the export of each handler as a C symbol for each platform.
//
// Built once per framework against that framework's XLA FFI headers: for JAX (jaxlib's, loaded
// with ctypes and registered with jax.ffi) and inside the TF op library (TF's, registered with
// TF's XLA by name: FUSEDLAYERS_XLA_TF).
#pragma once

#include <atomic>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "gemm/cublaslt.h"
#include "util/common.h"
#include "xla/ffi/api/ffi.h"
#ifdef FUSEDLAYERS_XLA_TF
namespace xla::ffi {
// TF's XLA FFI API (exported by libtensorflow_cc; its header, xla/ffi/ffi_api.h, needs MLIR
// headers TF does not ship).
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi
#endif

namespace fusedlayers::xla_binding {

namespace ffi = ::xla::ffi;
using ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;
using Dims = ffi::Span<const int64_t>;

// A csrc view of a buffer (absent where `defined` is false); its sizes live in the call frame.
inline TensorRef ref(const AnyBuffer& b, bool defined = true) {
  DType dtype = DType::kFloat32;
  switch (b.element_type()) {
    case ffi::DataType::F32: dtype = DType::kFloat32; break;
    case ffi::DataType::F64: dtype = DType::kFloat64; break;
    case ffi::DataType::F16: dtype = DType::kFloat16; break;
    case ffi::DataType::BF16: dtype = DType::kBFloat16; break;
    default: if (defined) fail("a buffer of a dtype csrc does not take reached an XLA handler");
  }
  const Dims dims = b.dimensions();
  return {defined ? b.untyped_data() : nullptr, dtype,
          {dims.begin(), static_cast<int64_t>(dims.size())}, defined};
}

inline Sizes sizes(Dims dims) { return {dims.begin(), static_cast<int64_t>(dims.size())}; }

// A tensor as a JAX trace knows it, its dtype and dims without data: an operand of the
// trace-time checks `fusedlayers_xla_<op>_check`, which Python calls with the static shapes,
// dtypes and attributes of a call before anything reaches XLA (fusedlayers/jax/_op.check).
struct TracedTensor {
  int32_t dtype;    // csrc's DType
  int32_t defined;  // 0 for an absent optional argument
  int64_t ndim;
  const int64_t* dims;
};

inline TensorRef ref(const TracedTensor* t) {
  return {nullptr, static_cast<DType>(t->dtype), {t->dims, t->ndim}, t->defined != 0};
}

// Runs csrc's argument checks `check` for a trace: 0 when they pass, else 1 for a value error
// or 2 for a dtype error (csrc's Error::Kind), with csrc's message in msg (NUL-terminated).
template <typename Fn>
int check_for_trace(Fn&& check, char* msg, size_t msg_size) {
  try {
    check();
    return 0;
  } catch (const Error& e) {
    std::snprintf(msg, msg_size, "%s", e.what());
    return e.kind == Error::Kind::kType ? 2 : 1;
  }
}

inline void* data(Out& out) { return out->untyped_data(); }

// csrc's parallel_for on XLA's intra-op pool: chunks of at least `grain`, taken from a shared
// counter by the calling thread and by as many pool tasks as the pool has threads. The caller
// waits only for the chunks to be done, not for the tasks to start: a task that starts late
// finds no chunk left (the state it reads is shared, not on the caller's stack).
inline ParallelFor pool_parallel_for(ffi::ThreadPool* pool) {
  return [pool](int64_t n, int64_t grain, const RangeFn& fn) {
    if (n <= 0) return;
    const int64_t threads = pool->num_threads();
    const int64_t chunks = std::max<int64_t>(1, std::min(threads + 1, n / std::max<int64_t>(
                                                                           grain, 1)));
    if (chunks == 1) return fn(0, n);
    struct State {
      RangeFn fn;
      int64_t n, chunks;
      std::atomic<int64_t> next{0}, done{0};
      std::mutex mutex;
      std::condition_variable all_done;
    };
    auto state = std::make_shared<State>();
    state->fn = fn;
    state->n = n;
    state->chunks = chunks;
    const auto work = [](State& s) {
      for (int64_t c; (c = s.next++) < s.chunks;) {
        s.fn(c * s.n / s.chunks, (c + 1) * s.n / s.chunks);
        if (++s.done == s.chunks) {
          std::lock_guard<std::mutex> lock(s.mutex);
          s.all_done.notify_all();
        }
      }
    };
    for (int64_t t = 1; t < chunks; ++t) pool->Schedule([state, work] { work(*state); });
    work(*state);
    std::unique_lock<std::mutex> lock(state->mutex);
    state->all_done.wait(lock, [&] { return state->done.load() == state->chunks; });
  };
}

// Where a handler's pass runs, and its workspace: host memory on the CPU; on CUDA the handler's
// `workspace` result, which Python sizes when it traces the call (fusedlayers_xla_workspace_size,
// workspace.cc), as XLA allocates every buffer of a custom call.
class Device {
 public:
  explicit Device(ffi::ThreadPool& pool) : exec_(Exec::cpu(pool_parallel_for(&pool))) {}
  explicit Device(cudaStream_t stream) : exec_(Exec::gpu(stream)) {}

  const Exec& exec() const { return exec_; }

  // `bytes` of workspace for this call (null for 0), or an Error.
  void* workspace(size_t bytes, Out& result) {
    if (!bytes) return nullptr;
    if (exec_.cuda) {
      if (result->size_bytes() < bytes)
        fail("the workspace result holds " + std::to_string(result->size_bytes()) +
             " bytes, the pass needs " + std::to_string(bytes));
      return data(result);
    }
    host_.reset(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    if (!host_) fail("no host workspace of " + std::to_string(bytes) + " bytes");
    return host_.get();
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  Exec exec_;
  std::unique_ptr<char, Free> host_;
};

// cuBLASLt's context for a pass on CUDA: csrc's handle, the `workspace` result's bytes from
// `offset` on (kCublasLtWorkspaceBytes of them, or an Error), XLA's stream. An empty context on
// the CPU and in builds without CUDA, where no pass calls cuBLASLt.
inline LtContext lt_context(const Device& device, Out& workspace, size_t offset) {
#ifdef FUSEDLAYERS_WITH_CUDA
  if (!device.exec().cuda) return {};
  const size_t bytes = workspace->size_bytes();
  if (bytes < offset + kCublasLtWorkspaceBytes)
    fail("the workspace result holds " + std::to_string(bytes) + " bytes, the pass needs " +
         std::to_string(offset + kCublasLtWorkspaceBytes));
  return {cublaslt_handle(), static_cast<char*>(data(workspace)) + offset,
          kCublasLtWorkspaceBytes, device.exec().stream};
#else
  (void)device, (void)workspace, (void)offset;
  return {};
#endif
}

// Runs a csrc call: its Error becomes an ffi::Error with csrc's text.
template <typename Fn>
ffi::Error call_csrc(Fn&& fn) {
  try {
    fn();
    return ffi::Error::Success();
  } catch (const Error& e) {
    return ffi::Error::InvalidArgument(e.what());
  }
}

// For a backward pass: checks `a` (csrc's op check), gives it the workspace its pass asks for
// and runs the pass; its outputs are set.
template <typename Args, typename Check, typename Size, typename Run>
void run_with_workspace(Device& device, Args& a, Out& workspace, Check check, Size size, Run run) {
  const auto sizes = check(a);
  a.workspace = device.workspace(size(a, sizes, device.exec()), workspace);
  run(a, sizes, device.exec());
}

// The handler's binding on each platform: XLA's thread pool first on the CPU, XLA's stream on
// CUDA; then the pass's own arguments, results and attributes, `sig`.
template <typename Sig>
auto bind_cpu(Sig sig) {
  return sig(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>());
}
template <typename Sig>
auto bind_cuda(Sig sig) {
  return sig(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>());
}

}  // namespace fusedlayers::xla_binding

#define FUSEDLAYERS_XLA_EXPORT extern "C" __attribute__((visibility("default")))

// In the TF op library the handlers are also registered with TF's XLA by name, for the custom
// calls its XLA kernels emit (backends/tensorflow/xla_kernel.h).
#ifdef FUSEDLAYERS_XLA_TF
#define FUSEDLAYERS_XLA_TF_REGISTER(name, platform, suffix)                                   \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), "fusedlayers_" #name, platform,        \
                           fusedlayers_xla_##name##_##suffix)
#else
#define FUSEDLAYERS_XLA_TF_REGISTER(name, platform, suffix) static_assert(true)
#endif

// Exports the pass `impl(Device&, args...)`, bound by `sig`, as the C symbols
// fusedlayers_xla_<name>_cpu and (in CUDA builds) fusedlayers_xla_<name>_cuda, which Python
// registers with XLA as the custom-call targets fusedlayers_<name> of each platform. The CUDA
// handlers only enqueue kernels on XLA's stream (their workspace is a result buffer), so XLA may
// capture them in its command buffers (CUDA graphs).
#define FUSEDLAYERS_XLA_HANDLERS(name, impl, sig)                                                \
  FUSEDLAYERS_XLA_EXPORT XLA_FFI_Error* fusedlayers_xla_##name##_cpu(XLA_FFI_CallFrame* frame) { \
    static auto* handler =                                                                      \
        ::fusedlayers::xla_binding::bind_cpu(sig)                                               \
            .To([](::xla::ffi::ThreadPool pool, auto... args) {                                 \
              ::fusedlayers::xla_binding::Device device(pool);                                  \
              return impl(device, std::move(args)...);                                          \
            })                                                                                  \
            .release();                                                                         \
    return handler->Call(frame);                                                                \
  }                                                                                             \
  FUSEDLAYERS_XLA_TF_REGISTER(name, "Host", cpu);                                               \
  FUSEDLAYERS_XLA_CUDA_HANDLER(name, impl, sig)

// Both passes of op `name` in this file: ::fusedlayers::xla_binding::(anonymous)::forward and
// backward, bound by kForwardSig and kBackwardSig.
#define FUSEDLAYERS_XLA_OP(name)                                                               \
  FUSEDLAYERS_XLA_HANDLERS(name##_forward, ::fusedlayers::xla_binding::forward,                \
                           ::fusedlayers::xla_binding::kForwardSig);                           \
  FUSEDLAYERS_XLA_HANDLERS(name##_backward, ::fusedlayers::xla_binding::backward,              \
                           ::fusedlayers::xla_binding::kBackwardSig)

#ifdef FUSEDLAYERS_WITH_CUDA
#define FUSEDLAYERS_XLA_CUDA_HANDLER(name, impl, sig)                                             \
  FUSEDLAYERS_XLA_EXPORT XLA_FFI_Error* fusedlayers_xla_##name##_cuda(XLA_FFI_CallFrame* frame) { \
    static auto* handler =                                                                       \
        ::fusedlayers::xla_binding::bind_cuda(sig)                                               \
            .To([](cudaStream_t stream, auto... args) {                                          \
              ::fusedlayers::xla_binding::Device device(stream);                                 \
              return impl(device, std::move(args)...);                                           \
            }, {::xla::ffi::Traits::kCmdBufferCompatible})                                       \
            .release();                                                                          \
    return handler->Call(frame);                                                                 \
  }                                                                                              \
  FUSEDLAYERS_XLA_TF_REGISTER(name, "CUDA", cuda)
#else
#define FUSEDLAYERS_XLA_CUDA_HANDLER(name, impl, sig) static_assert(true)
#endif
