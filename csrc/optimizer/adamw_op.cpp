// AdamW: argument checks, the grouping of parameters by dtypes, the passes on either device
// (contract: adamw.h).
#include <cmath>
#include <map>
#include <tuple>

#include "optimizer/adamw.h"

namespace fusedlayers {
namespace {

const char* const kOp = "adamw";

void check_range(const char* name, double v, double lo, bool lo_open, double hi, bool hi_open) {
  const bool ok = (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    std::string range = std::string(lo_open ? "(" : "[") + format_number(lo) + ", " +
                        format_number(hi) + (hi_open ? ")" : "]");
    arg_error(kOp, std::string(name) + " must be in " + range + ", got " + format_number(v));
  }
}

void check_like(const std::string& where, const char* name, const TensorRef& t,
                const TensorRef& param) {
  if (!t.defined) arg_error(kOp, name + (" of " + where) + " is missing");
  if (!(t.sizes == param.sizes))
    arg_error(kOp, name + (" of " + where) + " must have the parameter's shape " +
                       param.sizes.str() + ", got " + t.sizes.str());
}

void check_dtype(const std::string& where, const char* name, DType got, DType want) {
  if (got != want)
    arg_error(kOp, name + (" of " + where) + " must be " + dtype_name(want) + ", got " +
                       dtype_name(got),
              Error::Kind::kType);
}

void check_param(const AdamWTensors& t, int64_t i, const AdamWOptions& o) {
  const std::string where = "params[" + std::to_string(i) + "]";
  const DType p = t.param.dtype, m = t.exp_avg.dtype;
  check_like(where, "grad", t.grad, t.param);
  check_dtype(where, "grad", t.grad.dtype, p);
  check_like(where, "exp_avg", t.exp_avg, t.param);
  check_like(where, "exp_avg_sq", t.exp_avg_sq, t.param);
  if (!adamw_moment_dtype_ok(p, m)) {
    const char* others = adamw_half(p)              ? " or float32"
                         : p == DType::kFloat32 ? ", bfloat16 or float16"
                                                : "";
    arg_error(kOp, "exp_avg of " + where + " must be the parameter's dtype " + dtype_name(p) +
                       others + ", got " + dtype_name(m),
              Error::Kind::kType);
  }
  check_dtype(where, "exp_avg_sq", t.exp_avg_sq.dtype, m);
  if (o.amsgrad) {
    check_like(where, "max_exp_avg_sq", t.max_exp_avg_sq, t.param);
    check_dtype(where, "max_exp_avg_sq", t.max_exp_avg_sq.dtype, m);
  }
  if (t.master.defined) {
    if (!adamw_half(p))
      arg_error(kOp, "master of " + where + " is for float16 and bfloat16 parameters, got a " +
                         dtype_name(p) + " parameter",
                Error::Kind::kType);
    check_like(where, "master", t.master, t.param);
    check_dtype(where, "master", t.master.dtype, DType::kFloat32);
  }
  if (!t.step.defined || t.step.sizes.numel() != 1)
    arg_error(kOp, "step of " + where + " must be one element, got shape " +
                       (t.step.defined ? t.step.sizes.str() : std::string("none")));
  check_dtype(where, "step", t.step.dtype, DType::kFloat32);
}

}  // namespace

void adamw_check(const std::vector<AdamWTensors>& params, const AdamWOptions& o) {
  if (!o.lr_device) check_range("lr", o.lr, 0, false, INFINITY, true);
  check_range("beta1", o.beta1, 0, false, 1, true);
  check_range("beta2", o.beta2, 0, false, 1, true);
  check_range("eps", o.eps, 0, false, INFINITY, true);
  check_range("weight_decay", o.weight_decay, 0, false, INFINITY, true);
  check_range("max_grad_norm", o.max_grad_norm, 0, false, INFINITY, true);
  if (o.max_grad_norm > 0 && !o.grad_sumsq && !params.empty())
    arg_error(kOp, "max_grad_norm needs the gradients' grad_sumsq");
  for (size_t i = 0; i < params.size(); ++i) check_param(params[i], int64_t(i), o);
}

void adamw_grad_sumsq_check(const std::vector<TensorRef>& grads) {
  for (size_t i = 0; i < grads.size(); ++i)
    if (!grads[i].defined) arg_error(kOp, "grads[" + std::to_string(i) + "] is missing");
}

void adamw_step(const std::vector<AdamWTensors>& params, const AdamWOptions& o,
                const Exec& exec) {
  std::map<std::tuple<DType, DType, bool>, std::vector<int64_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const AdamWTensors& t = params[i];
    groups[{t.param.dtype, t.exp_avg.dtype, t.master.defined}].push_back(int64_t(i));
  }
  for (auto& [key, members] : groups) {
    const AdamWKernelArgs k{&params, std::move(members), std::get<0>(key), std::get<1>(key),
                            std::get<2>(key)};
    FUSEDLAYERS_ON_DEVICE(exec, adamw_step_cpu(k, o, exec.parallel_for),
                          adamw_step_cuda(k, o, exec.stream));
  }
}

size_t adamw_grad_sumsq_workspace_size(const std::vector<TensorRef>& grads) {
  int64_t chunks = 0;
  for (const TensorRef& g : grads) chunks += (g.sizes.numel() + kAdamWChunk - 1) / kAdamWChunk;
  return size_t(chunks) * sizeof(double);
}

void adamw_grad_sumsq(const std::vector<TensorRef>& grads, double* sumsq, void* workspace,
                      const Exec& exec) {
  double* partials = static_cast<double*>(workspace);
  FUSEDLAYERS_ON_DEVICE(exec, adamw_grad_sumsq_cpu(grads, sumsq, partials, exec.parallel_for),
                        adamw_grad_sumsq_cuda(grads, sumsq, partials, exec.stream));
}

}  // namespace fusedlayers
