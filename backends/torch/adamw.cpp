// fusedlayers::adamw (with adamw_grad_sumsq) for PyTorch: schemas and the CPU/CUDA kernel, tensor
// lists converted to csrc/optimizer/adamw.h's table (which checks the arguments and runs the passes).
// fusedlayers.torch.AdamW, the optimizer, calls them.
#include "backends/torch/torch_binding.h"
#include "optimizer/adamw.h"

namespace fusedlayers::torch_binding {
namespace {

const char* const kOp = "adamw";

// ValueError unless `list` has `n` tensors.
void check_length(const char* name, at::TensorList list, size_t n) {
  TORCH_CHECK_VALUE(list.size() == n, "fusedlayers.adamw: ", name, " must have one tensor per ",
                    "parameter (", n, "), got ", list.size());
}

// The checks csrc cannot see: a dtype it takes, params[0]'s device, and the parameter's memory
// layout (the update walks each tensor's storage in one order, so every tensor of a parameter
// must be dense with the parameter's strides).
void check_tensor(const char* name, size_t i, const at::Tensor& t, const at::Tensor& param,
                  const at::Tensor& first) {
  const std::string arg = std::string(name) + "[" + std::to_string(i) + "]";
  check_floating(kOp, arg.c_str(), t);
  check_same_device(kOp, arg.c_str(), t, "params[0]", first);
  if (!t.is_non_overlapping_and_dense() || !(sizes(t.strides()) == sizes(param.strides())))
    call_csrc([&] {
      arg_error(kOp, arg + " must be dense with the strides of params[" + std::to_string(i) +
                         "] " + sizes(param.strides()).str() + ", got strides " +
                         sizes(t.strides()).str());
    });
}


// A float32 scalar the pass reads where it runs, or null.
const float* scalar_ptr(const char* name, const OptTensor& t, const at::Tensor& first) {
  if (!t) return nullptr;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "fusedlayers.adamw: ", name,
                   " must be float32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->numel() == 1, "fusedlayers.adamw: ", name, " must be one element, got ",
                    t->numel());
  check_same_device(kOp, name, *t, "params[0]", first);
  return t->data_ptr<float>();
}

void adamw_kernel(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList masters, at::TensorList steps, double lr,
                  const OptTensor& lr_tensor, double beta1, double beta2, double eps,
                  double weight_decay, bool amsgrad, bool maximize, const OptTensor& grad_scale,
                  const OptTensor& found_inf, const OptTensor& grad_sumsq,
                  double max_grad_norm) {
  const size_t n = params.size();
  if (n == 0) return;
  check_length("grads", grads, n);
  check_length("exp_avgs", exp_avgs, n);
  check_length("exp_avg_sqs", exp_avg_sqs, n);
  check_length("steps", steps, n);
  if (amsgrad) check_length("max_exp_avg_sqs", max_exp_avg_sqs, n);
  if (!masters.empty()) check_length("masters", masters, n);
  const at::Tensor& first = params[0];
  std::vector<AdamWTensors> table(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_tensor("params", i, p, p, first);
    check_tensor("grads", i, grads[i], p, first);
    check_tensor("exp_avgs", i, exp_avgs[i], p, first);
    check_tensor("exp_avg_sqs", i, exp_avg_sqs[i], p, first);
    AdamWTensors& t = table[i];
    t.param = ref(p);
    t.grad = ref(grads[i]);
    t.exp_avg = ref(exp_avgs[i]);
    t.exp_avg_sq = ref(exp_avg_sqs[i]);
    if (amsgrad) {
      check_tensor("max_exp_avg_sqs", i, max_exp_avg_sqs[i], p, first);
      t.max_exp_avg_sq = ref(max_exp_avg_sqs[i]);
    }
    // An empty master tensor: this parameter has none (an empty parameter needs none either).
    if (!masters.empty() && masters[i].numel() > 0) {
      check_tensor("masters", i, masters[i], p, first);
      t.master = ref(masters[i]);
    }
    const std::string step = "steps[" + std::to_string(i) + "]";
    check_floating(kOp, step.c_str(), steps[i]);  // csrc checks that it is float32
    check_same_device(kOp, step.c_str(), steps[i], "params[0]", first);
    t.step = ref(steps[i]);
  }
  AdamWOptions o;
  o.lr = lr;
  o.lr_device = scalar_ptr("lr", lr_tensor, first);
  o.beta1 = beta1, o.beta2 = beta2, o.eps = eps, o.weight_decay = weight_decay;
  o.amsgrad = amsgrad, o.maximize = maximize;
  o.grad_scale = scalar_ptr("grad_scale", grad_scale, first);
  o.found_inf = scalar_ptr("found_inf", found_inf, first);
  if (grad_sumsq) {
    TORCH_CHECK_TYPE(grad_sumsq->scalar_type() == at::kDouble,
                     "fusedlayers.adamw: grad_sumsq must be float64 (adamw_grad_sumsq's), got ",
                     grad_sumsq->scalar_type());
    check_same_device(kOp, "grad_sumsq", *grad_sumsq, "params[0]", first);
    o.grad_sumsq = grad_sumsq->data_ptr<double>();
  }
  o.max_grad_norm = max_grad_norm;
  call_csrc([&] { adamw_check(table, o); });
  const c10::OptionalDeviceGuard guard(first.device());
  const Exec exec = exec_for(first);
  call_csrc([&] { adamw_step(table, o, exec); });
}

// The hyperparameters alone: what the optimizer checks when it is made.
void adamw_check_kernel(double lr, double beta1, double beta2, double eps, double weight_decay,
                        double max_grad_norm) {
  AdamWOptions o;
  o.lr = lr, o.beta1 = beta1, o.beta2 = beta2, o.eps = eps, o.weight_decay = weight_decay;
  o.max_grad_norm = max_grad_norm;
  call_csrc([&] { adamw_check({}, o); });
}

at::Tensor adamw_grad_sumsq_kernel(at::TensorList grads, const at::Tensor& like) {
  std::vector<TensorRef> refs;
  for (size_t i = 0; i < grads.size(); ++i) {
    const std::string arg = "grads[" + std::to_string(i) + "]";
    check_floating("adamw_grad_sumsq", arg.c_str(), grads[i]);
    check_same_device("adamw_grad_sumsq", arg.c_str(), grads[i], "like", like);
    if (!grads[i].is_non_overlapping_and_dense())
      call_csrc([&] {
        arg_error("adamw_grad_sumsq", arg + " must be dense, got strides " +
                                          sizes(grads[i].strides()).str());
      });
    refs.push_back(ref(grads[i]));
  }
  at::Tensor sumsq = at::empty({}, like.options().dtype(at::kDouble));
  const c10::OptionalDeviceGuard guard(like.device());
  const Exec exec = exec_for(like);
  call_csrc([&] { adamw_grad_sumsq_check(refs); });
  const at::Tensor ws = workspace(adamw_grad_sumsq_workspace_size(refs), like);
  call_csrc([&] {
    adamw_grad_sumsq(refs, sumsq.data_ptr<double>(), ws.data_ptr(), exec);
  });
  return sumsq;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // One AdamW step of every parameter, in place (csrc/optimizer/adamw.h): max_exp_avg_sqs with amsgrad,
  // else empty; masters empty, or one per parameter (an empty tensor where it has none); steps
  // float32 scalars on the parameters' device; lr_tensor, grad_scale, found_inf float32 scalars
  // read where the pass runs; grad_sumsq adamw_grad_sumsq's, with max_grad_norm > 0.
  m.def("adamw(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, "
        "Tensor(f!)[] steps, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, "
        "float weight_decay, bool amsgrad, bool maximize, Tensor? grad_scale, "
        "Tensor? found_inf, Tensor? grad_sumsq, float max_grad_norm) -> ()");
  // The sum of squares of every gradient's elements, a float64 scalar on like's device.
  m.def("adamw_grad_sumsq(Tensor[] grads, Tensor like) -> Tensor");
  m.def("adamw_check(float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float max_grad_norm) -> ()");
  impl_devices(m, "adamw", &adamw_kernel);
  m.impl("adamw_check", &adamw_check_kernel);  // no tensors: a kernel for every dispatch key
  impl_devices(m, "adamw_grad_sumsq", &adamw_grad_sumsq_kernel);
}

}  // namespace fusedlayers::torch_binding
