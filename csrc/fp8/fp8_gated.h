// Gated activations (activation/gated.h) that write their results in FP8 (fp8/fp8.h) in the
// pass that computes them: the producers of an FP8 gated MLP's operands.
//   forward:  y = act(gate) * up, each value rounded to gate's dtype, then quantized as
//             fp8_quantize quantizes that y: the down projection's input (and, with q_t, the
//             input of its weight gradient);
//   backward: [dgate | dup] (rows x 2 cols: the gradient of the gate/up projection's output,
//             gate's columns first), each value rounded to gate's dtype, then quantized as
//             fp8_quantize quantizes that concatenation: the operands of the gate/up
//             projection's dgrad and (q_t) wgrad.
// So the FP8 values and scales are, bit for bit, those of the unfused composition (gated then
// fp8_quantize) on the same device, without the rounded tensor ever being written.
// Tensorwise scaling takes two passes (the amax of the values, then the values again).
//
// The contract, for every binding: gate and up as gated.h's (rows x cols, rows of each
// `row_stride` apart), float16 or bfloat16 (the activations FP8 training runs in); scaling 1x128
// or tensorwise (128x128 tiles are for weights), scaling_t as fp8.h allows in the forward (its
// q_t is the down projection's weight-gradient x operand) and scaling in the backward (its q_t is
// a weight gradient's dy operand); cols a multiple of 128 (so that a block of the
// backward's concatenation holds dgate or dup alone, as the CUDA kernel computes them side by
// side); dy contiguous, gate's shape and dtype; out's buffers sized by fp8_scale_sizes for rows x
// cols (forward) or rows x 2 cols (backward). Errors: Error of kind kType for dtypes, kValue
// otherwise, naming the public op the caller passes.
#pragma once

#include <string>

#include "activation/gated.h"
#include "fp8/fp8.h"

namespace fusedlayers {

// The `activation` argument as every binding names it: 'silu' (SwiGLU), 'gelu' or 'gelu_tanh'
// (GeGLU's two forms); an Error naming op otherwise.
GatedActivation parse_gated_activation(const char* op, const std::string& activation);

struct Fp8GatedForward {
  GatedInput gate, up;
  GatedActivation activation = GatedActivation::kSilu;
  Fp8Target out;  // of rows x cols
};

struct Fp8GatedBackward {
  TensorRef dy;
  GatedInput gate, up;
  GatedActivation activation = GatedActivation::kSilu;
  Fp8Target out;  // of rows x 2 cols
};

// Check the arguments; return gate as rows x cols.
RowsCols fp8_gated_forward_check(const char* op, const Fp8GatedForward& a);
RowsCols fp8_gated_backward_check(const char* op, const Fp8GatedBackward& a);
// Run the pass on exec's device; a must have passed its check.
void fp8_gated_forward(const Fp8GatedForward& a, RowsCols rc, const Exec& exec);
void fp8_gated_backward(const Fp8GatedBackward& a, RowsCols rc, const Exec& exec);

// The kernels, gate and up rows gs and us elements apart. CPU: the gated kernel into a buffer of
// the rounded values, then the quantize kernel (the definition). CUDA: one block per 128x128
// tile computes the values into shared memory (16-byte loads where the strides and pointers
// allow) and quantizes them from there as fp8_quantize's staged kernel does.
void fp8_gated_forward_cpu(const Fp8GatedForward& a, int64_t gs, int64_t us, RowsCols rc,
                           const ParallelFor& parallel_for);
void fp8_gated_backward_cpu(const Fp8GatedBackward& a, int64_t gs, int64_t us, RowsCols rc,
                            const ParallelFor& parallel_for);
void fp8_gated_forward_cuda(const Fp8GatedForward& a, int64_t gs, int64_t us, RowsCols rc,
                            cudaStream_t stream);
void fp8_gated_backward_cuda(const Fp8GatedBackward& a, int64_t gs, int64_t us, RowsCols rc,
                             cudaStream_t stream);

}  // namespace fusedlayers
