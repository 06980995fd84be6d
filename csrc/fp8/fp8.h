// FP8 quantization: x in float32/float16/bfloat16 to E4M3 or E5M2 (Micikevicius et al. 2022,
// "FP8 Formats for Deep Learning", arXiv:2209.05433; E4M3 is the "fn" variant: no infinities,
// NaN 0x7F/0xFF, max 448; E5M2: max 57344) with the scales computed in the same pass.
//
// The scaling of a block of values (a tensor, a 1x128 row block or a 128x128 tile):
//   amax  = max |x| over the block, NaN where any x is NaN;
//   s     = fmt_max / amax in float32 (the quantizing multiplier), 1 where amax == 0, NaN where
//           amax is Inf or NaN, FLT_MAX where the quotient overflows; with power_of_2_scales,
//           s rounded down to a power of two (as Transformer Engine and DeepSeek-V3 allow);
//   q     = x * s rounded once, to nearest even, to the format (the exact product: ties of the
//           float32 product are broken by its residual), saturating at +-fmt_max;
//   scale_inv = 1 / s in float32: the dequantizing scale (x ~ q * scale_inv) that the FP8
//           GEMMs take, exact with power_of_2_scales.
// So a block with a NaN or Inf gives NaN values and a NaN scale: nothing is silently zeroed.
// CPU and CUDA compute the same bits (CUDA: the hardware conversion of the products rounded to
// odd, which rounds as this rule does: fp8_tile.cuh).
//
// Layouts, for x viewed as rows x cols (cols: the last dimension, the GEMM's contracted one):
//   q:          rows x cols, row-major, one byte a value;
//   tensorwise: scale_inv [1];
//   1x128:      scale_inv [ceil(cols/128) x rows] (block-major: as [rows, blocks] it is the
//               column-major layout the blockwise GEMMs read);
//   128x128:    scale_inv [ceil(rows/128) x ceil(cols/128)], row-major with each row padded to a
//               multiple of 4 floats (never read): cuBLASLt's layout for 128x128 scales;
//   with transpose, also q_t (cols x rows: x^T quantized, what the weight gradient's GEMM
//   contracts over the rows) and scale_inv_t, scaled by scaling_t: tensorwise the same scale;
//   1x128 blocks of x^T's rows, [ceil(rows/128) x cols]; 128x128 the tiles' scales transposed,
//   [ceil(cols/128) x ceil(rows/128)], padded likewise. scaling_t is scaling, or 128x128 with
//   1x128 scaling: q by 1x128 blocks of x's rows (a layer's fprop operand) and q_t by the 128x128
//   tiles (its weight gradient's x operand, which cuBLASLt's 1x128 x 128x128 kernel reads, as
//   Transformer Engine's 2D block scaling of x), each the bits that scaling alone gives. Partial
//   blocks at the edges scale what they hold.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "util/common.h"

#ifdef __CUDACC__
#define FUSEDLAYERS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDLAYERS_HOST_DEVICE inline
#endif

namespace fusedlayers {

enum class Fp8Format { kE4M3, kE5M2 };
enum class Fp8Scaling { kTensorwise, kBlock1x128, kBlock128x128 };
constexpr int64_t kFp8Block = 128;

// The `format` and `scaling` arguments as every binding names them; an Error naming op otherwise.
Fp8Format parse_fp8_format(const char* op, const std::string& format);
Fp8Scaling parse_fp8_scaling(const char* op, const std::string& scaling,
                             const char* arg = "scaling");
const char* fp8_scaling_name(Fp8Scaling scaling);  // the name parse_fp8_scaling reads

namespace fp8 {

FUSEDLAYERS_HOST_DEVICE uint32_t bits(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
FUSEDLAYERS_HOST_DEVICE float from_bits(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}

// A format's encoding: mantissa bits, exponent bias, the code of its largest finite value.
FUSEDLAYERS_HOST_DEVICE constexpr int mantissa_bits(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 3 : 2;
}
FUSEDLAYERS_HOST_DEVICE constexpr int exponent_bias(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 7 : 15;
}
FUSEDLAYERS_HOST_DEVICE constexpr uint32_t max_code(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? 0x7e : 0x7b;
}

FUSEDLAYERS_HOST_DEVICE float max_value(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.f : 57344.f; }

// max |x| that keeps NaN (fmaxf would drop it).
FUSEDLAYERS_HOST_DEVICE float amax_step(float amax, float x) {
  const float a = fabsf(x);
  return (a > amax || a != a) && amax == amax ? a : amax;
}

// The quantizing multiplier s of a block whose max |x| is amax (rule above).
FUSEDLAYERS_HOST_DEVICE float multiplier(float amax, Fp8Format f, bool power_of_2) {
  if (amax == 0.f) return 1.f;
  if (!(amax <= FLT_MAX)) return from_bits(0x7fc00000u);  // Inf or NaN
  float s = max_value(f) / amax;
  if (s > FLT_MAX) s = FLT_MAX;
  // s >= fmt_max / FLT_MAX is normal: clearing the mantissa rounds it down to a power of two
  return power_of_2 ? from_bits(bits(s) & 0xff800000u) : s;
}

// The FP8 byte of the exact value of p = fl(x * s) plus a residual of sign residual_sign (-1, 0,
// +1), rounded once to nearest even, saturating at the format's max; NaN to 0x7F. The residual
// decides only where p lies exactly on a tie (as p and the exact value are on the same side of
// any other point of the FP8 grid).
FUSEDLAYERS_HOST_DEVICE uint8_t encode(float p, int residual_sign, Fp8Format f) {
  const int man = mantissa_bits(f), bias = exponent_bias(f);
  const uint32_t top = max_code(f);
  const uint32_t u = bits(p), au = u & 0x7fffffffu;
  const uint32_t sign = (u >> 24) & 0x80;
  if (au > 0x7f800000u) return 0x7f;  // NaN
  const int away = (u >> 31) ? -residual_sign : residual_sign;  // toward larger magnitude: +1
  uint32_t code;
  if (au < uint32_t(127 + 1 - bias) << 23) {
    // below the smallest normal: a multiple m of the subnormal step 2^(1 - bias - man), exact;
    // m = 2^man rounds up to the smallest normal's code
    const float m = from_bits(au) * (f == Fp8Format::kE4M3 ? 512.f : 65536.f);
    const float lo = floorf(m), d = m - lo;
    const uint32_t n = uint32_t(lo);
    code = n + ((d > 0.5f || (d == 0.5f && (away > 0 || (away == 0 && (n & 1u))))) ? 1u : 0u);
  } else {
    const int drop = 23 - man;
    const uint32_t rem = au & ((1u << drop) - 1), half = 1u << (drop - 1);
    uint32_t r = au >> drop;  // float32's exponent and the kept mantissa bits
    r += (rem > half || (rem == half && (away > 0 || (away == 0 && (r & 1u))))) ? 1u : 0u;
    const int exp = int(r >> man) - 127 + bias;
    code = exp > (f == Fp8Format::kE4M3 ? 15 : 30)
               ? top
               : (uint32_t(exp) << man) | (r & ((1u << man) - 1));
    if (code > top) code = top;  // E4M3's 480 (0x7F is NaN there)
  }
  return uint8_t(sign | code);
}

// x quantized with multiplier s (a NaN s gives NaN): the product's residual from an FMA on the
// device, from the exact double product on the host (the same sign either way).
FUSEDLAYERS_HOST_DEVICE uint8_t quantize(float x, float s, Fp8Format f) {
  const float p = x * s;
#ifdef __CUDA_ARCH__
  const float r = fmaf(x, s, -p);
#else
  const double r = double(x) * double(s) - double(p);
#endif
  return encode(p, (r > 0) - (r < 0), f);
}

// The value of an FP8 byte.
FUSEDLAYERS_HOST_DEVICE float decode(uint8_t q, Fp8Format f) {
  const int man = mantissa_bits(f), bias = exponent_bias(f);
  const float sign = (q & 0x80) ? -1.f : 1.f;
  const uint32_t mag = q & 0x7f;
  const uint32_t exp = mag >> man, m = mag & ((1u << man) - 1);
  if (f == Fp8Format::kE4M3 ? mag == 0x7f : exp == 31) {
    return m == 0 ? sign * from_bits(0x7f800000u) : from_bits(0x7fc00000u);
  }
  if (exp == 0) return sign * ldexpf(float(m), 1 - bias - man);
  return sign * ldexpf(float((1u << man) | m), int(exp) - bias - man);
}

}  // namespace fp8

// Where FP8 values go and how they are scaled: the quantize op's outputs, and those of the ops
// that write FP8 in the pass that computes the values (fp8/fp8_gated.h). Sized as
// fp8_scale_sizes says for the values' rows x cols.
struct Fp8Target {
  Fp8Format format = Fp8Format::kE4M3;
  Fp8Scaling scaling = Fp8Scaling::kBlock1x128;
  Fp8Scaling scaling_t = Fp8Scaling::kBlock1x128;  // q_t's (layouts above)
  bool power_of_2_scales = false;
  uint8_t* q = nullptr;            // rows x cols
  float* scale_inv = nullptr;      // fp8_scale_sizes(..., false)
  uint8_t* q_t = nullptr;          // cols x rows, written when not null (null when empty)
  float* scale_inv_t = nullptr;    // fp8_scale_sizes(scaling_t, ..., true), written when not null
  float* amax = nullptr;           // tensorwise: 1 float of workspace (the tensor's amax after)
};

// Checks t's scaling_t against its scaling (the layouts above); an Error of kind kValue naming op.
void fp8_target_check(const char* op, const Fp8Target& t);

// The op's contract, for every binding: x is rows x cols, contiguous, float32, float16 or
// bfloat16. Errors: Error of kind kValue.
struct Fp8Quantize : Fp8Target {
  TensorRef x;
};

// The scale_inv shape ({dim0, dim1}) of scaling for x of rows x cols, or of its transpose, and
// the stored row length ld (dim1, padded to a multiple of 4 for 128x128).
struct Fp8ScaleSizes {
  int64_t dim0, dim1, ld;
};
Fp8ScaleSizes fp8_scale_sizes(Fp8Scaling scaling, int64_t rows, int64_t cols, bool transposed);

// Checks the arguments; returns x as rows x cols.
RowsCols fp8_quantize_check(const Fp8Quantize& a);
// Run the pass on exec's device; a must have passed its check.
void fp8_quantize(const Fp8Quantize& a, const Exec& exec);

// The kernels: the arguments as the op's, x as rows x cols of dtype.
void fp8_quantize_cpu(const Fp8Quantize& a, int64_t rows, int64_t cols,
                      const ParallelFor& parallel_for);
void fp8_quantize_cuda(const Fp8Quantize& a, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace fusedlayers
