// float16 <-> float32 over arrays with the CPU's own conversion instructions: AVX-512F converts 16
// values an instruction, F16C 8; the variant is picked once, on first use, from the CPU. Both
// round to nearest even, keep NaN payloads and signs as to_acc / from_acc do, and are exact for
// subnormal halves, so every path gives the same bits (tests/csrc_test.cpp checks all 65536
// halves and a sweep of float32 patterns). GCC 12 does not vectorize _Float16 conversions, and
// the arithmetic of cpu_types.h needs about 20 instructions a value where these need one.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FUSEDLAYERS_F16C 1
#include <immintrin.h>  // before cpu_types.h, whose optimize pragma must not reach the intrinsics
#endif

#include "cpu_types.h"

namespace fusedlayers {
namespace cpu {
namespace {

using HalfToFloat = void (*)(const Half*, float*, int64_t);
using FloatToHalf = void (*)(const float*, Half*, int64_t);

void half_to_float_portable(const Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_acc(src[i]);
}

void float_to_half_portable(const float* src, Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_acc<Half>(src[i]);
}

#ifdef FUSEDLAYERS_F16C
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
// The zero-masked AVX-512 forms with every lane on: the unmasked ones make GCC 12 warn about the
// undefined vector they merge into.
constexpr __mmask16 kAll = 0xffff;

__attribute__((target("avx512f"))) void half_to_float_avx512(const Half* src, float* dst,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(kAll, _mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + i))));
  half_to_float_portable(src + i, dst + i, n - i);
}

__attribute__((target("avx512f"))) void float_to_half_avx512(const float* src, Half* dst,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_maskz_cvtps_ph(kAll, _mm512_loadu_ps(src + i), kRound));
  float_to_half_portable(src + i, dst + i, n - i);
}

__attribute__((target("avx,f16c"))) void half_to_float_f16c(const Half* src, float* dst,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  half_to_float_portable(src + i, dst + i, n - i);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, Half* dst,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
  float_to_half_portable(src + i, dst + i, n - i);
}
#else  // no x86 conversion instructions: every variant is the arithmetic one
constexpr HalfToFloat half_to_float_avx512 = half_to_float_portable;
constexpr HalfToFloat half_to_float_f16c = half_to_float_portable;
constexpr FloatToHalf float_to_half_avx512 = float_to_half_portable;
constexpr FloatToHalf float_to_half_f16c = float_to_half_portable;
#endif

// The fastest variant this CPU runs.
template <typename Fn>
Fn pick(Fn avx512, Fn f16c, Fn portable) {
#ifdef FUSEDLAYERS_F16C
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return avx512;
  if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) return f16c;
#endif
  return portable;
}

}  // namespace

void half_to_float(const Half* src, float* dst, int64_t n) {
  static const HalfToFloat impl =
      pick(half_to_float_avx512, half_to_float_f16c, half_to_float_portable);
  impl(src, dst, n);
}

void float_to_half(const float* src, Half* dst, int64_t n) {
  static const FloatToHalf impl =
      pick(float_to_half_avx512, float_to_half_f16c, float_to_half_portable);
  impl(src, dst, n);
}

}  // namespace cpu
}  // namespace fusedlayers
