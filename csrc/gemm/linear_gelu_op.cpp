// The Linear + GELU op: its passes on the Exec's device (contract: linear_gelu.h; the argument
// checks: linear_gelu_check.cpp): on the CPU the framework's GEMMs around csrc's epilogue, on
// CUDA cuBLASLt.
#include "gemm/linear_gelu.h"

namespace fusedlayers {
namespace {

size_t elements_bytes(int64_t n, DType dtype) {
  // the epilogue's workspace, 64-byte aligned
  return (static_cast<size_t>(n) * dtype_size(dtype) + 63) / 64 * 64;
}

// W^T (k x n) and W (n x k) as GEMM operands, read in place from W's storage.
Matrix weight_t(const void* w, GemmSizes s, WeightLayout layout) {
  return {w, s.k, s.n, layout == WeightLayout::kOutIn};
}
Matrix weight(const void* w, GemmSizes s, WeightLayout layout) {
  return {w, s.n, s.k, layout == WeightLayout::kInOut};
}

void forward_cpu(const LinearGeluForward& a, GemmSizes s, const ParallelFor& parallel_for,
                 const CpuGemm& gemm) {
  if (!gemm) fail("linear_gelu: no CPU GEMM given");
  const DType dtype = a.x.dtype;
  // Without a backward to feed, y takes the GEMM's output and the epilogue runs in place.
  void* h = a.pre ? a.pre : a.y;
  gemm({a.x.data, s.m, s.k, false}, weight_t(a.weight.data, s, a.weight_layout), h, dtype);
  linear_gelu_epilogue_forward_cpu(h, data_if(a.bias), h, a.y, s.m, s.n,
                                   a.approx, dtype, parallel_for);
}

void backward_cpu(const LinearGeluBackward& a, GemmSizes s, const ParallelFor& parallel_for,
                  const CpuGemm& gemm) {
  if (!gemm) fail("linear_gelu_backward: no CPU GEMM given");
  if (!a.workspace && s.m * s.n > 0) fail("linear_gelu_backward: workspace is null");
  const DType dtype = a.x.dtype;
  void* dpre = a.workspace;  // then the epilogue's workspace
  void* epilogue_ws = static_cast<char*>(a.workspace) + elements_bytes(s.m * s.n, dtype);
  linear_gelu_epilogue_backward_cpu(a.dy.data, a.pre.data, dpre, a.has_bias ? a.dbias : nullptr,
                                    epilogue_ws, s.m, s.n, a.approx, dtype, parallel_for);
  const Matrix dpre_m{dpre, s.m, s.n, false}, x{a.x.data, s.m, s.k, false};
  gemm(dpre_m, weight(a.weight.data, s, a.weight_layout), a.dx, dtype);  // dgrad
  if (a.weight_layout == WeightLayout::kInOut)  // wgrad, written in the weight's layout
    gemm({a.x.data, s.k, s.m, true}, dpre_m, a.dweight, dtype);
  else
    gemm({dpre, s.n, s.m, true}, x, a.dweight, dtype);
}

}  // namespace

void linear_gelu_forward(const LinearGeluForward& a, GemmSizes s, const Exec& exec,
                         const GemmContext& gemm) {
  FUSEDLAYERS_ON_DEVICE(exec, forward_cpu(a, s, exec.parallel_for, gemm.cpu),
                        linear_gelu_forward_cuda(a, s, gemm.lt));
}

size_t linear_gelu_backward_workspace_size(const LinearGeluBackward& a, GemmSizes s,
                                           const Exec& exec) {
  const DType dtype = a.x.dtype;
  return FUSEDLAYERS_ON_DEVICE(
      exec,
      elements_bytes(s.m * s.n, dtype) +
          (a.has_bias ? linear_gelu_epilogue_backward_workspace_size_cpu(s.m, s.n, dtype) : 0),
      linear_gelu_backward_workspace_size_cuda(s, dtype));
}

void linear_gelu_backward(const LinearGeluBackward& a, GemmSizes s, const Exec& exec,
                          const GemmContext& gemm) {
  FUSEDLAYERS_ON_DEVICE(exec, backward_cpu(a, s, exec.parallel_for, gemm.cpu),
                        linear_gelu_backward_cuda(a, s, gemm.lt));
}

}  // namespace fusedlayers
