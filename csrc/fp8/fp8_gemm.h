// FP8 GEMM: d = dequant(a) dequant(b)^T (+ bias), a [m, k] and b [n, k] FP8 operands quantized
// by fp8_quantize (fp8.h's layouts), d [m, n] row-major in float32, float16 or bfloat16. Both
// operands are stored with k contiguous (the "TN" form that FP8 tensor-core GEMMs take), so a
// linear layer's three GEMMs read what the quantize kernels write:
//   fprop  y  [tokens, out] = x [tokens, in]  . W   [out, in]^T
//   dgrad  dx [tokens, in]  = dy [tokens, out] . W^T [in, out]^T   (W's q_t)
//   wgrad  dW [out, in]     = dy^T [out, tokens] . x^T [in, tokens]^T  (dy's and x's q_t)
//
// Scalings (a's, b's): tensorwise with tensorwise; 1x128 with 128x128 (DeepSeek-V3's recipe:
// activations and gradients by 1x128 blocks along k, weights by 128x128 tiles); 1x128 with 1x128
// (the weight gradient, both operands blocked along the tokens). dequant(q)[i, j] =
// decode(q[i, j]) * scale_inv of its block. Formats: E4M3 or E5M2, not both E5M2; blockwise
// scalings take E4M3 alone (cuBLASLt's block-scaled kernels).
//
// Rules on every device (cuBLASLt's FP8 kernels: they read k-contiguous rows and write d's
// rows in 16-byte units): k a positive multiple of 16, n a multiple of 16, and with block
// scales m too; bias [n] of d's dtype, which must then be bfloat16 or float16.
//
// CPU: the reference, each operand dequantized to float32, then d[i, j] = sum over k in order
// of the float32 products (float32 accumulation), plus bias, rounded once to d's dtype.
// CUDA: cuBLASLt's scaled matmul (block scales: cuBLASLt >= 12.9 on sm_90; tensorwise on sm_89+),
// float32 accumulation (fast_accum, tensorwise only: Hopper's FP8 accumulation without its
// periodic promotion, as cuBLASLt's FAST_ACCUM; ignored on the CPU), the bias in its epilogue.
#pragma once

#include "fp8/fp8.h"
#include "gemm/cublaslt.h"

namespace fusedlayers {

// One FP8 operand as fp8_quantize wrote it (rows x cols, cols = k contiguous), with the shape
// of its scale_inv as the caller holds it (fp8.h's: [rows, blocks] for 1x128, [row tiles,
// column tiles] for 128x128, [1, 1] for tensorwise), which the check compares with the rule's.
struct Fp8Operand {
  const uint8_t* data = nullptr;
  const float* scale_inv = nullptr;
  Fp8Format format = Fp8Format::kE4M3;
  Fp8Scaling scaling = Fp8Scaling::kBlock1x128;
  int64_t rows = 0, cols = 0;
  int64_t scale_rows = 0, scale_cols = 0;
};

// o's scale_rows / scale_cols from a scale_inv held in fp8.h's storage layout (dims of ndim:
// [blocks, rows] for 1x128, [row tiles, ld] for 128x128, one value for tensorwise), as the
// bindings that keep the storage (XLA's, TF's) pass it; o's scaling, rows and cols set. A
// storage of another shape gives a shape the check refuses.
void fp8_scales_from_storage(Fp8Operand& o, const int64_t* dims, int64_t ndim);

struct Fp8Gemm {
  Fp8Operand a, b;
  int64_t m() const { return a.rows; }
  int64_t n() const { return b.rows; }
  int64_t k() const { return a.cols; }
  DType out_dtype = DType::kBFloat16;
  void* d = nullptr;           // m x n
  const void* bias = nullptr;  // n values of out_dtype, or null
  bool fast_accum = false;
};

// Checks the arguments (an Error of kind kValue naming fp8_gemm and the argument).
void fp8_gemm_check(const Fp8Gemm& g);
// Runs the GEMM on exec's device (lt: cuBLASLt's handle, workspace and stream on CUDA).
void fp8_gemm(const Fp8Gemm& g, const Exec& exec, const LtContext& lt);

void fp8_gemm_cpu(const Fp8Gemm& g, const ParallelFor& parallel_for);
void fp8_gemm_cuda(const Fp8Gemm& g, const LtContext& lt);

}  // namespace fusedlayers
