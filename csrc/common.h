// Types shared by every fusedlayers kernel: the dtype enum, the CPU parallel-for callback and
// the error type. Framework-free by contract: no torch, tensorflow or Python headers here.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

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

// The binding supplies its framework's thread pool: parallel_for(n, grain, fn) must call
// fn(begin, end) on disjoint ranges covering [0, n), each at least `grain` long where possible.
// Kernels never depend on how the range is split, so results do not depend on the thread count.
using RangeFn = std::function<void(int64_t begin, int64_t end)>;
using ParallelFor = std::function<void(int64_t n, int64_t grain, const RangeFn& fn)>;

// Thrown for invalid arguments; bindings map it to ValueError / InvalidArgumentError.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

[[noreturn]] inline void fail(const std::string& msg) { throw Error("fusedlayers: " + msg); }

}  // namespace fusedlayers
