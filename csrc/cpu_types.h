// CPU storage types for float16/bfloat16, fp32/fp64 accumulation types and the dtype switch
// used by the CPU kernels. float16 converts through the compiler's _Float16 (IEEE binary16,
// round-to-nearest-even); bfloat16 is the top half of a float32, rounded to nearest even.
#pragma once

#include <cstring>

#include "common.h"

namespace fusedlayers {
namespace cpu {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

// Accumulation type: fp64 for fp64, fp32 for everything else.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

inline float to_acc(float v) { return v; }
inline double to_acc(double v) { return v; }
inline float to_acc(Half v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}
inline float to_acc(BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_acc(typename Acc<T>::type v) { return static_cast<T>(v); }
template <> inline Half from_acc<Half>(float v) {
  _Float16 h = static_cast<_Float16>(v);
  Half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}
template <> inline BFloat16 from_acc<BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  BFloat16 out;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet, never round it to Inf
    out.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    out.bits = static_cast<uint16_t>(u >> 16);
  }
  return out;
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
