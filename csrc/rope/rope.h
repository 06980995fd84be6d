// Rotary position embedding (Su et al. 2021, "RoFormer", arXiv:2104.09864) with the signature and
// result of Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`:
//   y[j] = x[j] cos[j] + sign(j) x[partner(j)] sin[j]   for j < rotary_dim = cos.shape[-1],
//   y[j] = x[j]                                          beyond it (partial rotary: NeoX, Phi-2)
// for every head of q and of k (GQA: their head counts may differ), cos and sin broadcast over
// the heads. Layouts of the rotated pairs: 'half' (rotate_half, Llama): partner(j) = j + r/2 with
// sign - for j < r/2, j - r/2 with sign + after; 'interleaved' (GPT-J): partner(2i) = 2i + 1 with
// sign -, partner(2i + 1) = 2i with sign +. Backward (the transpose):
//   dx[j] = dy[j] cos[j] - sign(j) dy[partner(j)] sin[partner(j)],  dx[j] = dy[j] beyond r.
// cos and sin are constants of the positions (not differentiated). Math in float32 (float64 for
// float64), one rounding per output where the unfused layer rounds three times. Never in place:
// the outputs are new tensors (an in-place rotation corrupts the saved inputs that activation
// checkpointing recomputes from).
//
// The op's contract, for every binding: q (batch, heads, seq, head_dim) and k (batch, kv_heads,
// seq, head_dim) of one float dtype, or (batch, seq, heads, head_dim) with unsqueeze_dim=2; cos and
// sin (batch or 1, seq, rotary_dim), float32 or q's dtype, rotary_dim even and <= head_dim.
// Tensors are strided views with a contiguous last dim (RopeView); deterministic (elementwise).
// Errors: Error of kind kType for dtypes, kValue otherwise.
#pragma once

#include "util/common.h"

namespace fusedlayers {

// A q/k-like tensor as (batch, heads, seq, head_dim) with element strides of the first three
// dims; head_dim is contiguous.
struct RopeView {
  void* data = nullptr;
  int64_t heads = 0;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;
};

// The checked geometry of one call.
struct RopeShape {
  int64_t batch = 0, seq = 0, head_dim = 0, rotary_dim = 0, q_heads = 0, k_heads = 0;
};

struct RopeArgs {
  // As the user passed them (the checks name these shapes); strides come with the views below.
  TensorRef q, k, cos, sin;
  int64_t unsqueeze_dim = 1;
  bool interleaved = false;
};

// The checks of the forward (op "rope") and of its backward ("rope_backward", whose q and k are
// the gradients of q_embed and k_embed).
RopeShape rope_check(const char* op, const RopeArgs& a);

// One pass: out = rotate(in) (forward) or its transpose (backward), for q and k.
struct RopePass {
  DType dtype = DType::kFloat32;     // q's and k's
  DType cs_dtype = DType::kFloat32;  // cos's and sin's
  RopeShape shape;
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cs_stride_b = 0, cs_stride_s = 0;  // cs_stride_b 0: one row of positions for all
  RopeView q_in, k_in, q_out, k_out;
  bool interleaved = false;
  bool backward = false;
};

void rope(const RopePass& p, const Exec& exec);

void rope_cpu(const RopePass& p, const ParallelFor& parallel_for);
// CUDA: one block per token, 16-byte vectors where the strides and pointers allow; float32,
// float16, bfloat16.
void rope_cuda(const RopePass& p, cudaStream_t stream);

}  // namespace fusedlayers
