// CPU storage types for float16/bfloat16, fp32/fp64 accumulation types, the dtype switch, and
// row helpers written so the compiler vectorizes them without -ffast-math. float16 is IEEE
// binary16 and bfloat16 the top half of a float32, both rounded to nearest even.
#pragma once

// Included by the CPU kernel files only, before their code. Without trapping math GCC
// if-converts selects whose both sides are float arithmetic (relu's `v < 0 ? 0 : v`, the
// half-precision conversions below, `mask bit ? dy * alpha : 0`) and vectorizes them; the
// speculated operations change no value, only FP exception flags, which nothing reads (what it
// gains: docs/DESIGN.md, "CPU loops").
#pragma GCC optimize("no-trapping-math")

#include <algorithm>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "util/common.h"

// Inlined into each target clone that calls it, so the code is compiled for that clone's ISA.
#define FUSEDLAYERS_INLINE inline __attribute__((always_inline))
// The same for a lambda defined outside the target clone that calls it: GCC inlines a function
// of another target's arch into a clone only when it is always_inline.
#define FUSEDLAYERS_LAMBDA_INLINE __attribute__((always_inline))

// The float row loops are the hot ones: compiled for AVX-512, for AVX2 + FMA and for the
// baseline, the variant picked at load time from the CPU (GCC target_clones); a CPU without them
// still runs the baseline (what each clone gains: docs/DESIGN.md, "CPU loops").
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FUSEDLAYERS_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FUSEDLAYERS_CPU_CLONES
#endif

namespace fusedlayers {
namespace cpu {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

// Accumulation type: fp64 for fp64, fp32 for everything else.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

FUSEDLAYERS_INLINE float to_acc(float v) { return v; }
FUSEDLAYERS_INLINE double to_acc(double v) { return v; }

// std::sqrt for loops written outside the clone that runs them: GCC leaves std::sqrt, not
// always_inline, out of line there, a call that cost a 768-wide float32 forward 12%.
FUSEDLAYERS_INLINE float sqrt_of(float v) { return __builtin_sqrtf(v); }
FUSEDLAYERS_INLINE double sqrt_of(double v) { return __builtin_sqrt(v); }

FUSEDLAYERS_INLINE uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
FUSEDLAYERS_INLINE float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// IEEE binary16 <-> float32 in integer and float arithmetic with selects, no branches and no
// library calls, so that loops of them vectorize in every target clone (a _Float16 cast is a
// scalar vcvtph2ps at best, a libgcc call per element at worst). Round to nearest even, as F16C;
// Inf stays Inf and NaN stays NaN with its sign; no float subnormal is ever formed, so the
// results hold with denormals flushed (torch.set_flush_denormal).
FUSEDLAYERS_INLINE float to_acc(Half v) {
  const uint32_t shifted = (v.bits & 0x7fffu) << 13, exp = shifted & 0x0f800000u;
  const uint32_t rebiased = shifted + 0x38000000u;  // exponent bias 15 -> 127
  const uint32_t normal = exp == 0x0f800000u ? rebiased + 0x38000000u : rebiased;  // Inf/NaN
  // Subnormal halves: 2^-14 (1 + m / 1024) - 2^-14 = m 2^-24, exactly.
  const uint32_t sub = bits_of(float_of(rebiased + 0x00800000u) - float_of(0x38800000u));
  return float_of((exp == 0 ? sub : normal) | (v.bits & 0x8000u) << 16);
}
FUSEDLAYERS_INLINE float to_acc(BFloat16 v) {
  return float_of(static_cast<uint32_t>(v.bits) << 16);
}

template <typename T>
FUSEDLAYERS_INLINE T from_acc(typename Acc<T>::type v) {
  return static_cast<T>(v);
}
template <> FUSEDLAYERS_INLINE Half from_acc<Half>(float v) {
  const uint32_t u = bits_of(v), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  // Subnormal results (|v| < 2^-14): adding 0.5 lines the 10 mantissa bits up at the bottom of
  // the float and rounds them to nearest even in the FPU.
  const uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
  // Normal results: rebias the exponent and round the 13 dropped bits to nearest even.
  const uint32_t norm = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t finite = a < 0x38800000u ? sub : norm;
  const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  const uint32_t out = a > 0x7f800000u ? nan : a >= 0x47800000u ? 0x7c00u : finite;
  return Half{static_cast<uint16_t>(out | sign)};
}
template <> FUSEDLAYERS_INLINE BFloat16 from_acc<BFloat16>(float v) {
  const uint32_t u = bits_of(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;                   // never round NaN to Inf
  // v != v: NaN in one compare (the bit test took two operations: 8% of a bfloat16 GELU pass).
  return BFloat16{static_cast<uint16_t>(v != v ? quiet_nan : rounded)};
}

// float16 <-> float32 for n values with the CPU's conversion instructions where it has them
// (cpu_half.cpp): the same bits as to_acc / from_acc, one instruction per 8 or 16 values. So the
// loops stage float16 rows in float (kStaged) where they do not convert in registers
// (cpu_vec.h), while bfloat16 converts element by element inside them (a shift to load, five
// integer operations to store: cheaper than a pass of its own).
void half_to_float(const Half* src, float* dst, int64_t n);
void float_to_half(const float* src, Half* dst, int64_t n);

template <typename T>
constexpr bool kStaged = std::is_same_v<T, Half>;

// Converts n values to the accumulation type: a row is staged once, then all math runs on A.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void load(const T* src, A* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_acc(src[i]);
}
inline void load(const Half* src, float* dst, int64_t n) { half_to_float(src, dst, n); }

template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void store(const A* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_acc<T>(src[i]);
}
inline void store(const float* src, Half* dst, int64_t n) { float_to_half(src, dst, n); }

// Rows the kernels stage or keep in float (parameters, scratch) start on a cache line: a vector
// access to a misaligned row splits cache lines, which cost the float16 LayerNorm forward 1.8x,
// depending on where malloc happened to put its buffer.
constexpr size_t kRowAlign = 64;

template <typename A>
struct RowAllocator {
  using value_type = A;
  RowAllocator() = default;
  template <typename B>
  RowAllocator(const RowAllocator<B>&) {}
  A* allocate(size_t n) {
    return static_cast<A*>(::operator new(n * sizeof(A), std::align_val_t(kRowAlign)));
  }
  void deallocate(A* p, size_t) { ::operator delete(p, std::align_val_t(kRowAlign)); }
  bool operator==(const RowAllocator&) const { return true; }
  bool operator!=(const RowAllocator&) const { return false; }
};

template <typename A>
using Row = std::vector<A, RowAllocator<A>>;

// n rounded up to whole cache lines of A: the offset of the next of several rows in one Row.
template <typename A>
constexpr int64_t row_stride(int64_t n) {
  constexpr int64_t per_line = kRowAlign / sizeof(A);
  return (n + per_line - 1) / per_line * per_line;
}

// A parameter vector (gamma, beta, bias) in the accumulation type, `fill` where it is absent,
// so the row loops need no branches.
template <typename P, typename A>
Row<A> param_or(const void* p, int64_t n, A fill) {
  Row<A> out(static_cast<size_t>(n), fill);
  if (p) load(static_cast<const P*>(p), out.data(), n);
  return out;
}

// sum_{i < n} term(i) over kLanes independent partial sums, added pairwise at the end: the
// compiler vectorizes it (a plain running sum it may not reorder), and the order is fixed, so
// the result never depends on threads or the ISA. 32 lanes: two AVX-512 (four AVX2) vector sums
// in flight (measured: docs/DESIGN.md, "CPU loops").
constexpr int kLanes = 32;

// The lanes added pairwise, halves first: a fixed order, and a dependency chain of log2(kLanes)
// adds where a running total would be kLanes long.
template <typename A>
FUSEDLAYERS_INLINE A tree_sum(A (&acc)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  return acc[0];
}

template <typename A, typename Term>
FUSEDLAYERS_INLINE A lane_sum(int64_t n, Term term) {
  A acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += term(i + k);
  for (int k = 0; i < n; ++i, ++k) acc[k] += term(i);
  return tree_sum(acc);
}

// Two sums over one pass, each in lane_sum's order (so each equals its lane_sum): term(i)
// returns the pair of i-th terms.
template <typename A, typename Term>
FUSEDLAYERS_INLINE std::pair<A, A> lane_sum2(int64_t n, Term term) {
  A acc0[kLanes] = {}, acc1[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      const std::pair<A, A> t = term(i + k);
      acc0[k] += t.first;
      acc1[k] += t.second;
    }
  for (int k = 0; i < n; ++i, ++k) {
    const std::pair<A, A> t = term(i);
    acc0[k] += t.first;
    acc1[k] += t.second;
  }
  return {tree_sum(acc0), tree_sum(acc1)};
}

// The row as accumulation-type values: src itself when T is A, else converted into buf.
template <typename T, typename A>
FUSEDLAYERS_INLINE const A* staged(const T* src, A* buf, int64_t n) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    load(src, buf, n);
    return buf;
  }
}

// Chunks of rows for column sums (dgamma, dbeta, dbias): a count fixed by the shape alone, never
// by the thread count, so per-chunk partials summed in chunk order give reproducible results.
// Each chunk zeroes, accumulates and re-reads a row of partials per sum, the traffic of a few
// rows: so at least kMinChunkElements per chunk (small inputs pay none of it), and beyond
// kParallelChunks chunks at least kMinChunkRows rows each (with a few rows of wide columns per
// chunk the partials were a third of the traffic).
inline int64_t num_chunks(int64_t rows, int64_t cols) {
  constexpr int64_t kMaxChunks = 64, kMinChunkElements = 32768;
  constexpr int64_t kParallelChunks = 16, kMinChunkRows = 16;
  const int64_t by_rows = std::max(kParallelChunks, rows / kMinChunkRows);
  return std::max<int64_t>(
      1, std::min({rows, kMaxChunks, rows * cols / kMinChunkElements, by_rows}));
}

// Column sums of per-chunk partials: visits columns [begin, end) of `chunks` rows `stride` apart
// and calls out(j, sum) with the chunks added in chunk order (reproducible). Walks row by row:
// a column walk with a power-of-two stride maps every access to one cache set and thrashes L1.
template <typename A, typename Out>
void sum_chunks(const A* partial, int64_t chunks, int64_t stride, int64_t begin, int64_t end,
                Out&& out) {
  constexpr int64_t kBlock = 256;  // columns summed at a time, held in a register-sized buffer
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    A acc[kBlock] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const A* row = partial + c * stride + b;
      for (int64_t j = 0; j < n; ++j) acc[j] += row[j];
    }
    for (int64_t j = 0; j < n; ++j) out(b + j, acc[j]);
  }
}

// fn(std::bool_constant<flag>{}...) for run-time flags: each combination is an instantiation of
// its own, so the flags of a loop (a GELU form, a bias or not) are decided outside it.
template <typename Fn>
FUSEDLAYERS_INLINE void with_flags(Fn&& fn) {
  fn();
}
template <typename Fn, typename... Rest>
FUSEDLAYERS_INLINE void with_flags(Fn&& fn, bool flag, Rest... rest) {
  if (flag)
    with_flags([&](auto... f) FUSEDLAYERS_LAMBDA_INLINE { fn(std::true_type{}, f...); }, rest...);
  else
    with_flags([&](auto... f) FUSEDLAYERS_LAMBDA_INLINE { fn(std::false_type{}, f...); }, rest...);
}

// Calls fn(T{}) with T the storage type of `dtype`.
template <typename Fn>
void dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); return;
    case DType::kFloat64: fn(double{}); return;
    case DType::kFloat16: fn(Half{}); return;
    case DType::kBFloat16: fn(BFloat16{}); return;
  }
  fail(std::string("unsupported dtype ") + dtype_name(dtype));
}

}  // namespace cpu
}  // namespace fusedlayers
