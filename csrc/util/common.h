// Types shared by every fusedlayers kernel: the dtype enum, the CPU parallel-for callback and
// the error type. Framework-free by contract: no torch, tensorflow or Python headers here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

// The CUDA stream type, declared exactly as the CUDA runtime declares it, so headers can name
// CUDA entry points without pulling CUDA headers into CPU-only builds.
typedef struct CUstream_st* cudaStream_t;

namespace fusedlayers {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// Bytes per element.
inline size_t dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2;
}

// The binding supplies its framework's thread pool: parallel_for(n, grain, fn) must call
// fn(begin, end) on disjoint ranges covering [0, n), each at least `grain` long where possible.
// Kernels never depend on how the range is split, so results do not depend on the thread count.
using RangeFn = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor = std::function<void(int64_t n, int64_t grain, const RangeFn& fn)>;

// Where a pass runs: on the CPU with the binding's thread pool, or on a CUDA stream of the
// current device. The op entry points (csrc/<op>.h) pick the CPU or CUDA kernels from it.
struct Exec {
  ParallelFor parallel_for;  // CPU
  cudaStream_t stream = nullptr;
  bool cuda = false;

  static Exec cpu(ParallelFor pf) { return {std::move(pf), nullptr, false}; }
  static Exec gpu(cudaStream_t s) { return {nullptr, s, true}; }
};

// A shape as the binding holds it (a view: the binding keeps the storage alive for the call).
struct Sizes {
  const int64_t* data = nullptr;
  int64_t size = 0;

  int64_t operator[](int64_t i) const { return data[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < size; ++i) n *= data[i];
    return n;
  }
  bool operator==(const Sizes& o) const {
    if (size != o.size) return false;
    for (int64_t i = 0; i < size; ++i)
      if (data[i] != o.data[i]) return false;
    return true;
  }
  // The last n sizes.
  Sizes tail(int64_t n) const { return {data + (size - n), n}; }
  std::string str() const {
    std::string s = "[";
    for (int64_t i = 0; i < size; ++i) s += (i ? ", " : "") + std::to_string(data[i]);
    return s + "]";
  }
};

// A tensor viewed as a rows x cols matrix, as an op's check returns it.
struct RowsCols {
  int64_t rows, cols;
};

// A contiguous row-major tensor handed to an op entry point; `defined` is false for an absent
// optional argument (data may be null for an empty tensor that is present).
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Sizes sizes;
  bool defined = false;
};

// The data of an optional argument, null where it is absent (whatever pointer a binding passed).
inline const void* data_if(const TensorRef& t) { return t.defined ? t.data : nullptr; }

// Thrown for invalid arguments. Bindings map kValue to ValueError / InvalidArgumentError and
// kType (a dtype that the op does not take) to TypeError / InvalidArgumentError.
class Error : public std::invalid_argument {
 public:
  enum class Kind { kValue, kType };
  Error(const std::string& msg, Kind kind = Kind::kValue)
      : std::invalid_argument(msg), kind(kind) {}
  Kind kind;
};

// A double as messages print it (%g: 1e-05, nan, inf).
inline std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

[[noreturn]] inline void fail(const std::string& msg) { throw Error("fusedlayers: " + msg); }
// An argument error of op `op` (as the user calls it: "fusedlayers.<op>: ...").
[[noreturn]] inline void arg_error(const char* op, const std::string& msg,
                                   Error::Kind kind = Error::Kind::kValue) {
  throw Error(std::string("fusedlayers.") + op + ": " + msg, kind);
}

}  // namespace fusedlayers

// cuda_call on a CUDA Exec, else cpu_call: the one place an op entry point picks its kernels. The
// CUDA kernels exist only in builds with FUSEDLAYERS_WITH_CUDA; elsewhere a CUDA Exec is an Error.
#ifdef FUSEDLAYERS_WITH_CUDA
#define FUSEDLAYERS_ON_DEVICE(exec, cpu_call, cuda_call) ((exec).cuda ? (cuda_call) : (cpu_call))
#else
#define FUSEDLAYERS_ON_DEVICE(exec, cpu_call, cuda_call) \
  ((exec).cuda ? throw ::fusedlayers::Error("fusedlayers: built without CUDA kernels") : (cpu_call))
#endif
