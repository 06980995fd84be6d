// The Linear + GELU op: argument checks, then its passes on the Exec's device (contract:
// linear_gelu.h): on the CPU the framework's GEMMs around csrc's epilogue, on CUDA cuBLASLt.
#include <utility>

#include "linear_gelu.h"

namespace fusedlayers {
namespace {

// x's sizes without the last: the rows of the GEMM.
Sizes leading(const TensorRef& x) { return {x.sizes.data, x.sizes.size - 1}; }

void check_dtype(const char* op, const char* arg, const TensorRef& t, const TensorRef& x) {
  if (t.dtype != x.dtype)
    arg_error(op, std::string(arg) + " must have x's dtype " + dtype_name(x.dtype) +
                      ", got " + dtype_name(t.dtype),
              Error::Kind::kType);
}

// The rules forward and backward share: x, weight and (when defined) bias.
GemmSizes check_linear(const char* op, const TensorRef& x, const TensorRef& weight,
                       const TensorRef& bias) {
  check_dtype(op, "weight", weight, x);
  if (weight.sizes.size != 2)
    arg_error(op, "weight must be 2-D (out_features, in_features), got shape " +
                      weight.sizes.str());
  const int64_t n = weight.sizes[0], k = weight.sizes[1];
  if (x.sizes.size < 1 || x.sizes[x.sizes.size - 1] != k)
    arg_error(op, "the last dimension of x must equal in_features = weight.shape[1] = " +
                      std::to_string(k) + ", got x of shape " + x.sizes.str());
  if (bias.defined) {
    check_dtype(op, "bias", bias, x);
    if (bias.sizes.size != 1 || bias.sizes[0] != n)
      arg_error(op, "bias must have shape (out_features,) = (" + std::to_string(n) + ",), got " +
                        bias.sizes.str());
  }
  return {leading(x).numel(), n, k};
}

}  // namespace

GemmSizes linear_gelu_forward_check(const LinearGeluForward& a) {
  return check_linear("linear_gelu", a.x, a.weight, a.bias);
}

GemmSizes linear_gelu_backward_check(const LinearGeluBackward& a) {
  const char* op = "linear_gelu_backward";
  const GemmSizes s = check_linear(op, a.x, a.weight, TensorRef{});
  const Sizes lead = leading(a.x);  // then out_features
  for (const auto& [arg, t] : {std::pair{"dy", &a.dy}, std::pair{"pre", &a.pre}}) {
    const bool ok = t->sizes.size == a.x.sizes.size && t->sizes[t->sizes.size - 1] == s.n &&
                    Sizes{t->sizes.data, t->sizes.size - 1} == lead && t->dtype == a.x.dtype;
    if (!ok)
      arg_error(op, std::string(arg) + " must have shape " + lead.str() + " + [" +
                        std::to_string(s.n) + "] and dtype " + dtype_name(a.x.dtype) +
                        ", got " + t->sizes.str() + " " + dtype_name(t->dtype));
  }
  return s;
}

namespace {

size_t elements_bytes(int64_t n, DType dtype) {
  const size_t size = dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;
  return (static_cast<size_t>(n) * size + 63) / 64 * 64;  // the epilogue's workspace 64-aligned
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
