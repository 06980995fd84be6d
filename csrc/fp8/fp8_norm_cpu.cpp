// CPU FP8 norms: the definition fp8_norm.h states, literally: the norm kernel, then the quantize
// kernel over its y.
#include "fp8/fp8_norm.h"

namespace fusedlayers {

void fp8_norm_forward_cpu(const NormForwardArgs& n, const Fp8Target& out,
                          const ParallelFor& parallel_for) {
  norm_forward_cpu(n, parallel_for);
  // no values: no blocks, and a tensorwise scale of 1 (amax 0), which the kernel writes
  if (n.rows * n.cols == 0 && out.scaling != Fp8Scaling::kTensorwise) return;
  Fp8Quantize q;
  static_cast<Fp8Target&>(q) = out;
  q.x.data = n.y;
  q.x.dtype = n.dtype;
  fp8_quantize_cpu(q, n.rows, n.cols, parallel_for);
}

}  // namespace fusedlayers
