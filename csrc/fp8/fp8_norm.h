// Norms that write their output in FP8 (fp8/fp8.h) in the pass that normalizes: the producers of
// the FP8 operands of the linear layers a transformer block's norms feed (attention's q/k/v
// projections, the MLP's gate/up).
//   y = norm(x) or, with a residual, h = x + residual and y = norm(h): the RMSNorm / LayerNorm
//       forward of norm/add_norm.h (its math and dtypes: norm/norm.h), y written in x's dtype;
//   q = y quantized as fp8_quantize quantizes that y (and, with q_t, y^T: the input of the
//       weight gradient's GEMM).
// So q and its scales are, bit for bit, fp8_quantize of the y the op returns, on every device;
// y is the norm's within its own rounding (the statistics summed in float32 in the kernel's
// order, which on CUDA is not the plain norm kernel's: y may differ from rms_norm's in the last
// bit of a value).
//
// The contract, for every binding: the arguments of add_norm.h's forward (residual undefined for
// the plain norm, which writes no h), checked as there with errors naming `op`
// (fp8_norm_name); x float32, float16 or bfloat16; scaling 1x128 or tensorwise (128x128 tiles are
// for weights); out's buffers sized by fp8_scale_sizes for rows x cols. Errors: Error of kind
// kType for dtypes, kValue otherwise.
//
// CPU: the norm kernel, then the quantize kernel over its y (the definition). CUDA, for
// float16/bfloat16 x with a residual of x's dtype (or none), 1x128 scaling, cols a multiple of 128
// split into at most 16 slices of 128, 256 or 512 columns, 16-byte aligned rows, on sm_90: one
// pass, x read once: a cluster of blocks holds 128 rows, a block a slice of them in shared memory,
// the row statistics summed across the cluster's shared memory, each slice normalized in place and
// quantized into x's and x^T's rows from there (fp8_tile.cuh). Elsewhere (tensorwise scaling,
// which needs y's amax before any value, float32, other widths, older GPUs): the norm kernel,
// then the quantize kernel over y.
#pragma once

#include "fp8/fp8.h"
#include "norm/add_norm.h"

namespace fusedlayers {

// fp8_rms_norm (kRms) or fp8_layer_norm (kLayer): the name errors carry.
const char* fp8_norm_name(NormMode mode);

struct Fp8NormForward {
  AddNormForward norm;  // its outputs: y, h (with a residual), mean (kLayer), rstd
  Fp8Target out;        // of rows x cols
};

// Check the arguments; return x as rows x cols.
RowsCols fp8_norm_forward_check(const Fp8NormForward& a);
// Run the pass on exec's device; a must have passed its check.
void fp8_norm_forward(const Fp8NormForward& a, RowsCols rc, const Exec& exec);

// The kernels, over the norm kernels' arguments (add_norm_args) and out.
void fp8_norm_forward_cpu(const NormForwardArgs& n, const Fp8Target& out,
                          const ParallelFor& parallel_for);
void fp8_norm_forward_cuda(const NormForwardArgs& n, const Fp8Target& out, cudaStream_t stream);

}  // namespace fusedlayers
