// CPU ReLU*scale: one pass, element-wise, parallel over blocks of whole mask words; branch-free
// selects so the loops vectorize (cpu_types.h), in target clones.
#include "activation/relu_scale.h"

#include <algorithm>
#include <type_traits>

#include "util/cpu_types.h"

namespace fusedlayers {
namespace {
constexpr int64_t kGrainWords = 1024;  // 32K elements per task

// 1 << j for each bit of a mask word, as a table: loops over a whole word then vectorize with
// plain loads, ands and compares (SSE2 has no per-lane variable shift).
struct WordBits {
  uint32_t bit[32];
  constexpr WordBits() : bit() {
    for (int j = 0; j < 32; ++j) bit[j] = 1u << j;
  }
};
constexpr WordBits kWordBits{};

// The mask word of elements x[0 .. e), e <= 32 (a whole word when e == 32).
template <typename T, typename A, int64_t E>
inline uint32_t mask_word(const T* x, int64_t e) {
  uint32_t word = 0;
  for (int64_t j = 0; j < (E ? E : e); ++j)
    word |= cpu::to_acc(x[j]) <= A(0) ? 0u : kWordBits.bit[j];  // NaN sets its bit
  return word;
}

// v where keep, else +0. For bfloat16 it selects the stored bits after the conversion: a select
// around the conversion's own selects is more control flow than GCC if-converts.
template <typename T>
inline T zero_unless(bool keep, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return keep ? v : T(0);
  } else {
    return T{static_cast<uint16_t>(keep ? v.bits : 0)};
  }
}

template <typename T, typename A, int64_t E>
inline void backward_word(const T* dy, uint32_t word, T* dx, A alpha, int64_t e) {
  for (int64_t j = 0; j < (E ? E : e); ++j) {
    const T g = cpu::from_acc<T>(cpu::to_acc(dy[j]) * alpha);
    dx[j] = zero_unless((word & kWordBits.bit[j]) != 0, g);
  }
}

// float16 elements run the float loops below over chunks of kStageWords mask words staged in
// float (cpu::kStaged); the other types convert element by element.
constexpr int64_t kStageWords = 16;

// Mask words [w_begin, w_end) of n elements a chunk at a time: the chunk's `in` converted into
// a float buffer, fn(buf, values, first word, words), then buf converted out to `out`.
template <typename A, typename T, typename Fn>
FUSEDLAYERS_INLINE void staged_words(const T* in, T* out, int64_t n, int64_t w_begin,
                                     int64_t w_end, Fn&& fn) {
  A buf[kStageWords * 32];
  for (int64_t w = w_begin; w < w_end; w += kStageWords) {
    const int64_t words = std::min(kStageWords, w_end - w), i = w * 32;
    const int64_t m = std::min(n, (w + words) * 32) - i;
    cpu::load(in + i, buf, m);
    fn(buf, m, w, words);
    cpu::store(buf, out + i, m);
  }
}

// Mask words [w_begin, w_end) of n elements: their mask (when not null) and y.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void forward_words(const T* x, T* y, uint32_t* mask, int64_t n, A alpha,
                                          int64_t w_begin, int64_t w_end) {
  if constexpr (cpu::kStaged<T>) {
    staged_words<A>(x, y, n, w_begin, w_end, [&](A* buf, int64_t m, int64_t w, int64_t words) {
      forward_words(buf, buf, mask ? mask + w : nullptr, m, alpha, 0, words);
    });
  } else {
    if (mask) {  // before y: y may alias x
      for (int64_t w = w_begin; w < w_end; ++w) {
        const int64_t e = std::min<int64_t>(32, n - w * 32);
        mask[w] = e == 32 ? mask_word<T, A, 32>(x + w * 32, e) : mask_word<T, A, 0>(x + w * 32, e);
      }
    }
    for (int64_t i = w_begin * 32, end = std::min(n, w_end * 32); i < end; ++i) {
      const A v = cpu::to_acc(x[i]);
      // v < 0 is false for NaN, so NaN passes through as in torch.relu.
      y[i] = cpu::from_acc<T>((v < A(0) ? A(0) : v) * alpha);
    }
  }
}

template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void backward_words(const T* dy, const uint32_t* mask, T* dx, int64_t n,
                                           A alpha, int64_t w_begin, int64_t w_end) {
  if constexpr (cpu::kStaged<T>) {
    staged_words<A>(dy, dx, n, w_begin, w_end, [&](A* buf, int64_t m, int64_t w, int64_t words) {
      backward_words(buf, mask + w, buf, m, alpha, 0, words);
    });
  } else {
    for (int64_t w = w_begin; w < w_end; ++w) {
      const int64_t e = std::min<int64_t>(32, n - w * 32);
      if (e == 32)
        backward_word<T, A, 32>(dy + w * 32, mask[w], dx + w * 32, alpha, e);
      else
        backward_word<T, A, 0>(dy + w * 32, mask[w], dx + w * 32, alpha, e);
    }
  }
}
}  // namespace

void relu_scale_forward_cpu(const void* x, void* y, uint32_t* mask, int64_t n, double alpha,
                            DType dtype, const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    const A a = static_cast<A>(alpha);
    parallel_for(relu_scale_mask_words(n), kGrainWords, [&](int64_t w_begin, int64_t w_end) {
      forward_words(xp, yp, mask, n, a, w_begin, w_end);
    });
  });
}

void relu_scale_backward_cpu(const void* dy, const uint32_t* mask, void* dx, int64_t n,
                             double alpha, DType dtype, const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale_backward: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* dyp = static_cast<const T*>(dy);
    T* dxp = static_cast<T*>(dx);
    const A a = static_cast<A>(alpha);
    parallel_for(relu_scale_mask_words(n), kGrainWords, [&](int64_t w_begin, int64_t w_end) {
      backward_words(dyp, mask, dxp, n, a, w_begin, w_end);
    });
  });
}

}  // namespace fusedlayers
