// 16 floats in registers, for loops that convert float16 in them: GCC's vector type, float16
// loads and stores per ISA (AVX-512F: one instruction for 16 values; F16C: two; elsewhere the
// arithmetic of cpu_types.h), and the pick of the variant this CPU runs. GCC 12 does not
// vectorize _Float16 conversions, so a loop that wants them in registers is a template on the
// ISA struct, instantiated in one function per ISA with that ISA's target attribute.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FUSEDLAYERS_F16C 1
#include <immintrin.h>  // before cpu_types.h, whose optimize pragma must not reach the intrinsics
#endif

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "util/cpu_types.h"

namespace fusedlayers {
namespace cpu {

constexpr int kVec = 16;
using Floats = float __attribute__((vector_size(kVec * sizeof(float))));

FUSEDLAYERS_INLINE void load_floats(const float* src, Floats& v) {
  std::memcpy(&v, src, sizeof v);
}
FUSEDLAYERS_INLINE void store_floats(const Floats& v, float* dst) {
  std::memcpy(dst, &v, sizeof v);
}

// Every variant gives to_acc / from_acc's bits: round to nearest even, NaN payloads and signs
// kept, subnormal halves exact (tests/csrc_test.cpp checks each against them). Not inlined
// where they are compiled for an ISA their caller lacks: a caller instantiates them in a
// function with the same target and __attribute__((flatten)), which inlines them there.
struct HalfPortable {
  static FUSEDLAYERS_INLINE void load(const Half* src, Floats& v) {
    for (int k = 0; k < kVec; ++k) v[k] = to_acc(src[k]);
  }
  static FUSEDLAYERS_INLINE void store(const Floats& v, Half* dst) {
    for (int k = 0; k < kVec; ++k) dst[k] = from_acc<Half>(v[k]);
  }
};

#ifdef FUSEDLAYERS_F16C
#define FUSEDLAYERS_TARGET_AVX512 __attribute__((target("avx512f")))
#define FUSEDLAYERS_TARGET_AVX512_BW __attribute__((target("avx512f,avx512bw")))
#define FUSEDLAYERS_TARGET_F16C __attribute__((target("avx,f16c")))
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

struct HalfAvx512 {
  // The zero-masked forms with every lane on: the unmasked ones make GCC 12 warn about the
  // undefined vector they merge into.
  static FUSEDLAYERS_TARGET_AVX512 inline void load(const Half* src, Floats& v) {
    const __m512 f = _mm512_maskz_cvtph_ps(
        0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    std::memcpy(&v, &f, sizeof v);
  }
  static FUSEDLAYERS_TARGET_AVX512 inline void store(const Floats& v, Half* dst) {
    __m512 f;
    std::memcpy(&f, &v, sizeof v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_maskz_cvtps_ph(0xffff, f, kRoundNearest));
  }
};

struct HalfF16c {
  static FUSEDLAYERS_TARGET_F16C inline void load(const Half* src, Floats& v) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256 hi =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + kVec / 2)));
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  }
  static FUSEDLAYERS_TARGET_F16C inline void store(const Floats& v, Half* dst) {
    __m256 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(lo, kRoundNearest));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kVec / 2),
                     _mm256_cvtps_ph(hi, kRoundNearest));
  }
};
#else  // no x86 conversion instructions: every variant is the arithmetic one
#define FUSEDLAYERS_TARGET_AVX512
#define FUSEDLAYERS_TARGET_AVX512_BW
#define FUSEDLAYERS_TARGET_F16C
using HalfAvx512 = HalfPortable;
using HalfF16c = HalfPortable;
#endif

// Column access for loops written once for one column and for kVec: Scalar gives a column as
// its accumulation type, Vector<Isa> kVec columns from j on as Floats. A loop body is a generic
// lambda body(io, j) that loads and stores through decltype(io).
struct Scalar {
  template <typename T>
  static FUSEDLAYERS_INLINE auto load(const T* p) { return to_acc(*p); }
  template <typename T, typename A>
  static FUSEDLAYERS_INLINE void store(A v, T* p) { *p = from_acc<T>(v); }
};

template <typename Isa>
struct Vector {
  static FUSEDLAYERS_INLINE Floats load(const Half* p) {
    Floats v;
    Isa::load(p, v);
    return v;
  }
  static FUSEDLAYERS_INLINE Floats load(const float* p) {
    Floats v;
    load_floats(p, v);
    return v;
  }
  static FUSEDLAYERS_INLINE void store(const Floats& v, Half* p) { Isa::store(v, p); }
  static FUSEDLAYERS_INLINE void store(const Floats& v, float* p) { store_floats(v, p); }
};

// Row loops over n columns. ScalarColumns: column by column (the compiler vectorizes them),
// sums in lane_sum's order. VectorColumns<Isa>: kVec columns at a time and the last n % kVec one
// by one, sums in the same order (column j in lane j mod kLanes, lanes added by tree_sum), so
// both give the same bits.
struct ScalarColumns {
  // A row as the loops read it: staged in A where T is not A (bfloat16: one pass of shifts).
  template <typename T, typename A>
  static FUSEDLAYERS_INLINE const A* row(const T* src, A* buf, int64_t n) {
    return staged(src, buf, n);
  }
  template <typename A, typename Term>
  static FUSEDLAYERS_INLINE A sum(int64_t n, Term term) {
    return lane_sum<A>(n, [&](int64_t j) FUSEDLAYERS_LAMBDA_INLINE { return term(Scalar{}, j); });
  }
  template <typename A, typename Term>
  static FUSEDLAYERS_INLINE std::pair<A, A> sum2(int64_t n, Term term) {
    return lane_sum2<A>(n, [&](int64_t j) FUSEDLAYERS_LAMBDA_INLINE { return term(Scalar{}, j); });
  }
  template <typename Body>
  static FUSEDLAYERS_INLINE void each(int64_t n, Body body) {
    for (int64_t j = 0; j < n; ++j) body(Scalar{}, j);
  }
};

template <typename Isa>
struct VectorColumns {
  template <typename T, typename A>
  static FUSEDLAYERS_INLINE const T* row(const T* src, A*, int64_t) {
    return src;
  }
  template <typename A, typename Term>
  static FUSEDLAYERS_INLINE A sum(int64_t n, Term term) {
    return sum2<A>(n, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
      const auto t = term(io, j);
      return std::make_pair(t, t);
    }).first;
  }
  template <typename A, typename Term>
  static FUSEDLAYERS_INLINE std::pair<A, A> sum2(int64_t n, Term term) {
    static_assert(std::is_same_v<A, float> && kLanes % kVec == 0);
    constexpr int kSteps = kLanes / kVec;
    Floats acc0[kSteps] = {}, acc1[kSteps] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int s = 0; s < kSteps; ++s) {
        const auto t = term(Vector<Isa>{}, j + s * kVec);
        acc0[s] += t.first;
        acc1[s] += t.second;
      }
    float lanes0[kLanes], lanes1[kLanes];
    for (int s = 0; s < kSteps; ++s) {
      store_floats(acc0[s], lanes0 + s * kVec);
      store_floats(acc1[s], lanes1 + s * kVec);
    }
    for (int k = 0; j < n; ++j, ++k) {
      const auto t = term(Scalar{}, j);
      lanes0[k] += t.first;
      lanes1[k] += t.second;
    }
    return {tree_sum(lanes0), tree_sum(lanes1)};
  }
  template <typename Body>
  static FUSEDLAYERS_INLINE void each(int64_t n, Body body) {
    int64_t j = 0;
    for (; j + kVec <= n; j += kVec) body(Vector<Isa>{}, j);
    for (; j < n; ++j) body(Scalar{}, j);
  }
};

// The fastest of three variants of a function that this CPU runs, for the ISA structs above.
// The environment variable FUSEDLAYERS_CPU_ISA=f16c or =portable caps the pick, so the tests
// run every variant on one CPU (the target_clones loops are not affected).
template <typename Fn>
Fn pick_isa(Fn avx512, Fn f16c, Fn portable) {
  const char* cap = std::getenv("FUSEDLAYERS_CPU_ISA");
  const std::string want = cap ? cap : "avx512";
  if (want != "avx512" && want != "f16c" && want != "portable")
    fail("FUSEDLAYERS_CPU_ISA must be avx512, f16c or portable, got '" + want + "'");
#ifdef FUSEDLAYERS_F16C
  __builtin_cpu_init();
  if (want == "avx512" && __builtin_cpu_supports("avx512f")) return avx512;
  if (want != "portable" && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"))
    return f16c;
#endif
  return portable;
}

}  // namespace cpu
}  // namespace fusedlayers
