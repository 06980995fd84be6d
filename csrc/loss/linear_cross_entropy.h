// Linear + cross-entropy without the logits: the loss of a causal LM's head,
//   z = softcap(x W^T + b)        softcap(u) = s tanh(u / s), or u when softcap is 0
//   lse = log sum_j exp(z_j)
//   loss_i = (1 - eps) (lse - z_t) + eps (lse - sum_j z_j / V) + z_loss lse^2
// for each row i with target t != ignore_index (0 for ignored rows): PyTorch's cross_entropy
// with label_smoothing eps (Szegedy et al. 2016), Gemma 2's final logit softcapping and PaLM's
// auxiliary z-loss (Chowdhery et al. 2022). Its gradient, scaled per row by grad_scale:
//   dz_j = scale_i (p_j (1 + 2 z_loss lse) - (1 - eps) [j == t] - eps / V),  p_j = exp(z_j - lse)
//   du_j = dz_j (1 - (z_j / s)^2) under softcap;  dx = du W, dW = du^T x, db = sum_i du_i.
//
// The N x V logits are never stored: rows go in chunks of linear_cross_entropy_chunk_rows, each
// chunk's logits written by the binding's GEMM into the workspace, then one csrc pass per row
// (max, sum of z and the logsumexp in float32, float64 for float64) writes its loss and, when
// gradients are asked for, overwrites the chunk with du, which two more GEMMs turn into that
// chunk's rows of dx and its share of dW (accumulated over chunks in W's dtype, in chunk order)
// and db (summed in float32 per column in row order). Deterministic: no atomics.
//
// The op's contract, for every binding: input (N, H), weight (V, H) and bias (V,) of one float
// dtype, contiguous; target N int64 (or int32) values; grad_scale, when gradients are wanted, 1
// or N values of the loss dtype (float64 for float64 input, else float32) on the input's device;
// loss: N values of the loss dtype; dinput like input, dweight like weight, dbias like bias. Errors:
// Error of kind kType for dtypes, kValue otherwise. A target outside [0, V) other than
// ignore_index is a kValue Error on the CPU and a NaN loss for its row on CUDA.
#pragma once

#include "util/common.h"
#include "gemm/gemm.h"

namespace fusedlayers {

struct LinearCrossEntropy {
  TensorRef input;   // (N, H)
  TensorRef weight;  // (V, H)
  TensorRef bias;    // (V,) or absent
  const void* target = nullptr;  // int64 values, or int32 where target_int32 (JAX's default)
  int64_t target_rows = 0;
  int64_t ignore_index = -100;
  double label_smoothing = 0, softcap = 0, z_loss = 0;
  bool target_int32 = false;
  // Gradients are computed when grad_scale is set: grad_scale_rows values (1: every row's).
  const void* grad_scale = nullptr;
  int64_t grad_scale_rows = 0;
  void* loss = nullptr;
  void* dinput = nullptr;
  void* dweight = nullptr;
  void* dbias = nullptr;  // when bias is present and gradients are computed
  void* workspace = nullptr;  // linear_cross_entropy_workspace_size() bytes
};

struct LinearCrossEntropySizes {
  int64_t rows, hidden, vocab, chunk_rows;
};

LinearCrossEntropySizes linear_cross_entropy_check(const LinearCrossEntropy& a);
size_t linear_cross_entropy_workspace_size(const LinearCrossEntropy& a,
                                           LinearCrossEntropySizes s);
// Run the op on exec's device with the binding's GEMM; a must have passed its check.
void linear_cross_entropy(const LinearCrossEntropy& a, LinearCrossEntropySizes s,
                          const Exec& exec, const FrameworkGemm& gemm);

// One chunk's row pass (rows of logits, vocab wide, in dtype): writes loss (the rows' own
// slots) and, when grad_scale is set, du (which may be logits itself: each element is read
// before it is written); dbias_acc (vocab values of the loss dtype) gets the column sums of du
// added when not null. row0: the chunk's first row in the batch (indexes target, loss and a
// per-row grad_scale). target: int64 values, or int32 where target_int32 (JAX's default).
struct LinearCrossEntropyChunk {
  const void* logits;
  void* du;
  const void* bias;
  const void* target;
  bool target_int32;
  int64_t row0, rows, vocab;
  DType dtype;
  int64_t ignore_index;
  double label_smoothing, softcap, z_loss;
  const void* grad_scale;
  bool per_row_scale;
  void* loss;
  void* dbias_acc;
};
// The rows of a chunk for n rows of h features and a vocabulary of v (bindings whose framework
// runs the chunk loop itself: XLA's dots, then linear_cross_entropy_chunk).
int64_t linear_cross_entropy_chunk_rows(int64_t n, int64_t h, int64_t v);
// The row pass of one chunk on exec's device (the loop's step between its GEMMs), its dbias_acc
// zeroed first.
void linear_cross_entropy_chunk(const LinearCrossEntropyChunk& c, const Exec& exec);
// The check of one chunk as a binding hands it over: logits (rows, vocab) and du like it (when
// grad_scale is set), bias (vocab,) in logits' dtype, grad_scale 1 or rows values; the
// options' ranges as linear_cross_entropy_check.
void linear_cross_entropy_chunk_check(const TensorRef& logits, const TensorRef& bias,
                                      int64_t target_rows, int64_t grad_scale_rows,
                                      double label_smoothing, double softcap, double z_loss);
void linear_cross_entropy_chunk_cpu(const LinearCrossEntropyChunk& c,
                                    const ParallelFor& parallel_for);
void linear_cross_entropy_chunk_cuda(const LinearCrossEntropyChunk& c, cudaStream_t stream);
// dbias (vocab values of dtype) from the accumulator of the loss dtype.
void linear_cross_entropy_dbias_cpu(const void* acc, void* dbias, int64_t vocab, DType dtype);
void linear_cross_entropy_dbias_cuda(const void* acc, void* dbias, int64_t vocab, DType dtype,
                                     cudaStream_t stream);
void zero_bytes_cuda(void* p, size_t bytes, cudaStream_t stream);

}  // namespace fusedlayers
