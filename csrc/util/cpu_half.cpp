// float16 <-> float32 over arrays with the CPU's own conversion instructions (cpu_vec.h): 16
// values an instruction with AVX-512F, 8 with F16C; the variant is picked once, on first use,
// from the CPU. Every variant gives the same bits (tests/csrc_test.cpp checks all 65536 halves
// and a sweep of float32 patterns).
#include "util/cpu_vec.h"

namespace fusedlayers {
namespace cpu {
namespace {

using HalfToFloat = void (*)(const Half*, float*, int64_t);
using FloatToHalf = void (*)(const float*, Half*, int64_t);

template <typename Isa>
FUSEDLAYERS_INLINE void half_to_float_with(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    Floats v;
    Isa::load(src + i, v);
    store_floats(v, dst + i);
  }
  for (; i < n; ++i) dst[i] = to_acc(src[i]);
}

template <typename Isa>
FUSEDLAYERS_INLINE void float_to_half_with(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    Floats v;
    load_floats(src + i, v);
    Isa::store(v, dst + i);
  }
  for (; i < n; ++i) dst[i] = from_acc<Half>(src[i]);
}

__attribute__((flatten)) FUSEDLAYERS_TARGET_AVX512 void half_to_float_avx512(const Half* src,
                                                                            float* dst,
                                                                            int64_t n) {
  half_to_float_with<HalfAvx512>(src, dst, n);
}
__attribute__((flatten)) FUSEDLAYERS_TARGET_F16C void half_to_float_f16c(const Half* src,
                                                                        float* dst, int64_t n) {
  half_to_float_with<HalfF16c>(src, dst, n);
}
__attribute__((flatten)) void half_to_float_portable(const Half* src, float* dst, int64_t n) {
  half_to_float_with<HalfPortable>(src, dst, n);
}

__attribute__((flatten)) FUSEDLAYERS_TARGET_AVX512 void float_to_half_avx512(const float* src,
                                                                            Half* dst,
                                                                            int64_t n) {
  float_to_half_with<HalfAvx512>(src, dst, n);
}
__attribute__((flatten)) FUSEDLAYERS_TARGET_F16C void float_to_half_f16c(const float* src,
                                                                        Half* dst, int64_t n) {
  float_to_half_with<HalfF16c>(src, dst, n);
}
__attribute__((flatten)) void float_to_half_portable(const float* src, Half* dst, int64_t n) {
  float_to_half_with<HalfPortable>(src, dst, n);
}

}  // namespace

void half_to_float(const Half* src, float* dst, int64_t n) {
  static const HalfToFloat impl =
      pick_isa(half_to_float_avx512, half_to_float_f16c, half_to_float_portable);
  impl(src, dst, n);
}

void float_to_half(const float* src, Half* dst, int64_t n) {
  static const FloatToHalf impl =
      pick_isa(float_to_half_avx512, float_to_half_f16c, float_to_half_portable);
  impl(src, dst, n);
}

}  // namespace cpu
}  // namespace fusedlayers
