// CPU bias + GELU epilogue: one pass over the rows, float16 rows staged in float (cpu::kStaged);
// dbias summed per fixed chunk of rows into the workspace, then over chunks in chunk order
// (thread-count invariant). bfloat16 looks GELU up instead of computing it (BFloat16Tables).
//
// float rows use exp/erfc written here so that the loops vectorize (libm's are scalar calls):
// exp by Cody-Waite reduction and a minimax polynomial (relative error ~1e-7), erfc as
// e^{-z^2} times the fit of gelu.h (relative error ~3e-7 in float), so GELU keeps fp32 relative
// accuracy also deep in its negative tail. double rows use libm.
#include "util/cpu_vec.h"  // first: it includes the intrinsics before cpu_types.h
#include "gemm/linear_gelu_epilogue.h"
#include "activation/cpu_gelu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

using cpu::gelu;
using cpu::gelu_grad;

void check_sizes(const char* op, int64_t rows, int64_t cols) {
  if (rows < 0) fail(std::string(op) + ": rows must be >= 0, got " + std::to_string(rows));
  if (cols < 0) fail(std::string(op) + ": cols must be >= 0, got " + std::to_string(cols));
}

// v rounded to T and back: the unfused layer rounds the linear output, and its gradient, to T.
template <typename T, typename A>
FUSEDLAYERS_INLINE A round_to(A v) {
  return cpu::to_acc(cpu::from_acc<T>(v));
}

// A block of `rows` contiguous rows: pre = h + bias rounded to T (bias, in A, may be null), y =
// gelu(pre). pre may alias h, and y may alias both: pre is written only where it is neither y's
// memory nor, without a bias, h itself. Each value converts in registers (T = float16 runs this
// over rows staged in float). Without a bias the block is one flat loop, so narrow rows pay no
// per-row loop overhead; the approximation, bias and pre are loop invariants, each combination
// its own vectorized loop.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void linear_gelu_epilogue_rows(const T* h, const A* bias, T* pre, T* y, int64_t rows,
                                           int64_t cols, GeluApprox approx) {
  if (!bias) {
    cols *= rows;
    rows = 1;
  }
  auto loop = [&](auto tanh, auto with_bias, auto with_pre) FUSEDLAYERS_LAMBDA_INLINE {
    constexpr GeluApprox kApprox = tanh ? GeluApprox::kTanh : GeluApprox::kNone;
    for (int64_t r = 0; r < rows; ++r) {
      const T* hr = h + r * cols;
      T* pr = pre + r * cols;
      T* yr = y + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        A v = cpu::to_acc(hr[j]);
        if constexpr (with_bias) v = round_to<T>(v + bias[j]);
        if constexpr (with_pre) pr[j] = cpu::from_acc<T>(v);
        yr[j] = cpu::from_acc<T>(gelu(v, kApprox));
      }
    }
  };
  const bool with_pre = pre != y && (bias || pre != h);
  cpu::with_flags(loop, approx == GeluApprox::kTanh, bias != nullptr, with_pre);
}

// A block of `rows` contiguous rows: dpre = dy * gelu'(u), rounded to T (dpre may alias dy);
// each row of the rounded dpre added to dbias in row order, where dbias is given (the unfused
// Linear's bias gradient sums the rounded values too).
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void gelu_grad_rows(const T* u, const T* dy, T* dpre, A* dbias,
                                           int64_t rows, int64_t cols, GeluApprox approx) {
  if (!dbias) {
    cols *= rows;
    rows = 1;
  }
  auto loop = [&](auto tanh, auto with_dbias) FUSEDLAYERS_LAMBDA_INLINE {
    constexpr GeluApprox kApprox = tanh ? GeluApprox::kTanh : GeluApprox::kNone;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t off = r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const A d = round_to<T>(cpu::to_acc(dy[off + j]) * gelu_grad(cpu::to_acc(u[off + j]),
                                                                      kApprox));
        dpre[off + j] = cpu::from_acc<T>(d);
        if constexpr (with_dbias) dbias[j] += d;
      }
    }
  };
  cpu::with_flags(loop, approx == GeluApprox::kTanh, dbias != nullptr);
}

// v += bias, each row, rounded to T and back (float16 rows staged in float).
template <typename T>
FUSEDLAYERS_CPU_CLONES void add_bias_rounded(float* v, const float* bias, int64_t rows,
                                             int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) v[i * cols + j] = round_to<T>(v[i * cols + j] + bias[j]);
}

// Rows per block: about 32 KB of float per block, so a block's pre / dpre is still in L1 or L2
// when the next loop over it reads it.
int64_t block_rows(int64_t cols) { return std::max<int64_t>(1, 8192 / cols); }

// bfloat16: GELU's input, the pre-activation rounded to bfloat16, takes one of 65536 values, so
// y = gelu(pre) rounded to bfloat16 and gelu'(pre) in float are tables of every bfloat16 value,
// filled once per form by the loops above (so a table entry has the bits those loops give that
// element), and each element's result is one read of them: on a CPU whose GEMMs are fast
// (AMX), computing GELU to float accuracy costs more than the GEMM's share of the layer, and a
// read from a table that stays in L2 (128 KB, 256 KB) costs less than the polynomials.
struct BFloat16Tables {
  // y bits by pre bits, one entry of padding: a 32-bit gather reads two bytes past its own.
  uint16_t y[65537] = {};
  float grad[65536] = {};

  explicit BFloat16Tables(GeluApprox approx) {
#ifdef FUSEDLAYERS_F16C
    // IEEE subnormals whatever the calling thread's mode (a library may have left MXCSR's FTZ
    // and DAZ set in it): the tables are built once, for every thread's calls.
    const unsigned mode = _mm_getcsr();
    _mm_setcsr(mode & ~0x8040u);
#endif
    std::vector<cpu::BFloat16> u(65536), out(65536);
    std::vector<float> uf(65536), ones(65536, 1.0f);
    for (uint32_t i = 0; i < 65536; ++i) {
      u[i].bits = static_cast<uint16_t>(i);
      uf[i] = cpu::to_acc(u[i]);
    }
    linear_gelu_epilogue_rows(u.data(), static_cast<const float*>(nullptr), out.data(),
                              out.data(), 1, 65536, approx);
    for (uint32_t i = 0; i < 65536; ++i) y[i] = out[i].bits;
    // gelu'(u) exactly: 1 * gelu'(u), rounded to float
    gelu_grad_rows(uf.data(), ones.data(), grad, static_cast<float*>(nullptr), 1, 65536, approx);
#ifdef FUSEDLAYERS_F16C
    _mm_setcsr(mode);
#endif
  }

  static const BFloat16Tables& of(GeluApprox approx) {
    static const BFloat16Tables erf(GeluApprox::kNone), tanh(GeluApprox::kTanh);
    return approx == GeluApprox::kTanh ? tanh : erf;
  }
};

// out[j] = table[index[j]] for n entries: AVX-512 gathers 16 at a time, elsewhere one by one.
template <typename V>
void lookup_portable(const V* table, const uint16_t* index, V* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = table[index[j]];
}
#ifdef FUSEDLAYERS_F16C
FUSEDLAYERS_TARGET_AVX512_BW void lookup_avx512(const uint16_t* table, const uint16_t* index,
                                                uint16_t* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i i = _mm512_maskz_cvtepu16_epi32(
        0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + j)));
    // an entry and the next, of which the low half is kept
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xffff, i, table, 2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        _mm512_maskz_cvtepi32_epi16(0xffff, v));
  }
  lookup_portable(table, index + j, out + j, n - j);
}
FUSEDLAYERS_TARGET_AVX512_BW void lookup_avx512(const float* table, const uint16_t* index,
                                                float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i i = _mm512_maskz_cvtepu16_epi32(
        0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + j)));
    _mm512_storeu_ps(out + j, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, i, table, 4));
  }
  lookup_portable(table, index + j, out + j, n - j);
}
#endif

template <typename V>
void lookup(const V* table, const uint16_t* index, V* out, int64_t n) {
  using Fn = void (*)(const V*, const uint16_t*, V*, int64_t);
#ifdef FUSEDLAYERS_F16C
  static const Fn fn = cpu::pick_isa<Fn>(lookup_avx512, lookup_portable<V>, lookup_portable<V>);
#else
  static const Fn fn = lookup_portable<V>;
#endif
  fn(table, index, out, n);
}

// dst = h + bias rounded to bfloat16 (the unfused layer's linear output), for a block of rows.
FUSEDLAYERS_CPU_CLONES void add_bias_bf16(const cpu::BFloat16* h, const float* bias,
                                          cpu::BFloat16* dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      dst[r * cols + j] = cpu::from_acc<cpu::BFloat16>(cpu::to_acc(h[r * cols + j]) + bias[j]);
}

// The forward of a block of bfloat16 rows by the tables: pre = h + bias rounded (where there is a
// bias; written where it is neither y's memory nor, without a bias, h itself), then y = its
// entry. pre may alias h, and y may alias both.
void gelu_rows_bf16(const cpu::BFloat16* h, const float* bias, cpu::BFloat16* pre,
                    cpu::BFloat16* y, int64_t rows, int64_t cols, GeluApprox approx) {
  const int64_t n = rows * cols;
  const bool with_pre = pre != y && (bias || pre != h);
  const cpu::BFloat16* u = h;  // the rounded pre-activation
  if (bias || with_pre) {
    cpu::BFloat16* dst = with_pre ? pre : y;
    if (bias)
      add_bias_bf16(h, bias, dst, rows, cols);
    else
      std::copy(h, h + n, dst);
    u = dst;
  }
  static_assert(sizeof(cpu::BFloat16) == sizeof(uint16_t));
  lookup(BFloat16Tables::of(approx).y, reinterpret_cast<const uint16_t*>(u),
         reinterpret_cast<uint16_t*>(y), n);
}

// dpre = dy * gelu'(u) rounded to bfloat16, each row of it added to dbias in row order where
// dbias is given (as gelu_grad_rows), gelu'(u) read from the table into g (n floats).
FUSEDLAYERS_CPU_CLONES void scale_rows_bf16(const cpu::BFloat16* dy, const float* g,
                                            cpu::BFloat16* dpre, float* dbias, int64_t rows,
                                            int64_t cols) {
  auto loop = [&](auto with_dbias) FUSEDLAYERS_LAMBDA_INLINE {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t k = r * cols + j;
        const float d = round_to<cpu::BFloat16>(cpu::to_acc(dy[k]) * g[k]);
        dpre[k] = cpu::from_acc<cpu::BFloat16>(d);
        if constexpr (with_dbias) dbias[j] += d;
      }
  };
  cpu::with_flags(loop, dbias != nullptr);
}

}  // namespace

void linear_gelu_epilogue_forward_cpu(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                           int64_t cols, GeluApprox approx, DType dtype,
                           const ParallelFor& parallel_for) {
  check_sizes("linear_gelu_epilogue", rows, cols);
  if (rows == 0 || cols == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* hp = static_cast<const T*>(h);
    T* pp = static_cast<T*>(pre);
    T* yp = static_cast<T*>(y);
    const int64_t block = block_rows(cols);
    // The bias in A (float for the 16-bit types); null without one.
    const cpu::Row<A> b32 = std::is_same_v<T, A> || !bias ? cpu::Row<A>()
                                                          : cpu::param_or<T, A>(bias, cols, A(0));
    const A* b = std::is_same_v<T, A> ? static_cast<const A*>(bias) : (bias ? b32.data() : nullptr);
    parallel_for(rows, block, [&](int64_t begin, int64_t end) {
      cpu::Row<A> buf(cpu::kStaged<T> ? static_cast<size_t>(block * cols) : 0);
      for (int64_t r = begin; r < end; r += block) {
        const int64_t n = std::min(block, end - r), off = r * cols;
        if constexpr (cpu::kStaged<T>) {  // float16 rows staged in float
          A* v = buf.data();
          cpu::load(hp + off, v, n * cols);
          if (b) add_bias_rounded<T>(v, b, n, cols);
          if (pp != yp) cpu::store(v, pp + off, n * cols);  // else pre is y's memory
          linear_gelu_epilogue_rows(v, static_cast<const A*>(nullptr), v, v, n, cols, approx);
          cpu::store(v, yp + off, n * cols);
        } else if constexpr (std::is_same_v<T, cpu::BFloat16>) {
          gelu_rows_bf16(hp + off, b, pp + off, yp + off, n, cols, approx);
        } else {
          linear_gelu_epilogue_rows(hp + off, b, pp + off, yp + off, n, cols, approx);
        }
      }
    });
  });
}

size_t linear_gelu_epilogue_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("linear_gelu_epilogue_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(cpu::num_chunks(rows, cols)) * static_cast<size_t>(cols) * acc_bytes;
}

void linear_gelu_epilogue_backward_cpu(const void* dy, const void* pre, void* dpre, void* dbias,
                            void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                            DType dtype, const ParallelFor& parallel_for) {
  check_sizes("linear_gelu_epilogue_backward", rows, cols);
  if (dbias && !workspace) fail("linear_gelu_epilogue_backward: workspace is null");
  if (cols == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    A* partial = static_cast<A*>(workspace);  // [chunk][cols]
    const int64_t chunks = cpu::num_chunks(rows, cols);
    const int64_t per_chunk = (rows + chunks - 1) / chunks;
    const T* up = static_cast<const T*>(pre);
    const T* dyp = static_cast<const T*>(dy);
    T* dpp = static_cast<T*>(dpre);
    const int64_t block = block_rows(cols);
    constexpr bool kBFloat16 = std::is_same_v<T, cpu::BFloat16>;
    const float* grad_table = kBFloat16 ? BFloat16Tables::of(approx).grad : nullptr;
    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      const int64_t stride = cpu::row_stride<A>(block * cols);
      // float16: u and dy staged in float; bfloat16: gelu'(u) read from its table
      cpu::Row<A> buf(cpu::kStaged<T> ? static_cast<size_t>(2 * stride)
                                      : kBFloat16 ? static_cast<size_t>(stride) : 0);
      A* u = buf.data();
      A* d = u + stride;
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pb = dbias ? partial + c * cols : nullptr;
        if (pb) std::fill(pb, pb + cols, A(0));
        const int64_t rend = std::min(rows, (c + 1) * per_chunk);
        for (int64_t r = c * per_chunk; r < rend; r += block) {
          const int64_t n = std::min(block, rend - r), off = r * cols;
          if constexpr (kBFloat16) {
            lookup(grad_table, reinterpret_cast<const uint16_t*>(up + off), u, n * cols);
            scale_rows_bf16(dyp + off, u, dpp + off, pb, n, cols);
          } else if constexpr (!cpu::kStaged<T>) {
            gelu_grad_rows(up + off, dyp + off, dpp + off, pb, n, cols, approx);
          } else {  // float16 rows staged in float
            cpu::load(up + off, u, n * cols);
            cpu::load(dyp + off, d, n * cols);
            gelu_grad_rows(u, d, d, static_cast<A*>(nullptr), n, cols, approx);
            cpu::store(d, dpp + off, n * cols);
            if (!pb) continue;
            // dbias sums the rounded dpre, as the unfused Linear's bias gradient does.
            cpu::load(dpp + off, d, n * cols);
            for (int64_t i = 0; i < n; ++i)
              for (int64_t j = 0; j < cols; ++j) pb[j] += d[i * cols + j];
          }
        }
      }
    });
    if (!dbias) return;
    T* dbp = static_cast<T*>(dbias);
    parallel_for(cols, 1024, [&](int64_t begin, int64_t end) {
      cpu::sum_chunks(partial, chunks, cols, begin, end,
                      [&](int64_t j, A sum) { dbp[j] = cpu::from_acc<T>(sum); });
    });
  });
}

}  // namespace fusedlayers
