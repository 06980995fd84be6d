// Helpers for the ops' autograd kernels (registered to the Autograd dispatch key by each op's
// binding), written as PyTorch's generated code writes them for native ops: the forward runs the
// op's CPU/CUDA (or, while tracing, fake) kernel below autograd and, when a backward will run,
// records one Node that saves what the op's backward needs; the Node calls only that backward
// op, so torch.compile traces both. Written out rather than with torch::autograd::Function (or,
// worse, Python's register_autograd) because host time per call decides the speed of small
// layers: the generic Function machinery costs about a third more per call than the op's work.
#pragma once

#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <array>
#include <optional>
#include <string>
#include <type_traits>

#include "backends/torch/torch_binding.h"

namespace fusedlayers {
namespace torch_binding {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A new Node of type T, held as the torch version holds Nodes: std::shared_ptr with
// torch::autograd::deleteNode (no deep recursion on release) up to torch 2.12, intrusive_ptr since.
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });  // found by ADL
  } else {
    return c10::make_intrusive<T>();
  }
}

// Whether autograd will need a backward for an op on these inputs.
inline bool needs_grad(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}

inline const at::Tensor* ptr_if(const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; }

// fn() run below autograd: the op's CPU/CUDA (or, while tracing, fake) kernel.
template <typename Fn>
auto below_autograd(Fn&& fn) {
  at::AutoDispatchBelowADInplaceOrView below;
  return fn();
}

// An optional input saved for the backward, and whether it was present.
inline std::pair<SavedVariable, bool> save_if(const std::optional<at::Tensor>& t) {
  return t ? std::pair{SavedVariable(*t, false), true} : std::pair{SavedVariable(), false};
}

// A backward op runs below autograd, like a native backward kernel, unless the backward is itself
// being recorded (create_graph=True): then its autograd kernel (the fallback registered with
// impl_op) makes a second derivative raise instead of being silently wrong.
// Saved variables are unpacked before the guard: unpacking runs saved-tensor hooks, and
// activation checkpointing's recomputes the forward there, which must record autograd as the
// original forward did.
class BackwardGuard {
 public:
  BackwardGuard() {
    if (!at::GradMode::is_enabled()) below_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_;
};

inline std::optional<at::Tensor> unpack_if(const SavedVariable& v, bool present) {
  return present ? std::optional<at::Tensor>(v.unpack()) : std::nullopt;
}

// The Node of an op's backward: Derived lists its SavedVariables in saved_variables() (a std::array of
// pointers) and names itself kName.
template <typename Derived>
struct SavingNode : Node {
  void release_variables() override {
    for (SavedVariable* v : static_cast<Derived*>(this)->saved_variables()) v->reset_data();
  }
  std::string name() const override { return Derived::kName; }
};

// Registers, from an op's TORCH_LIBRARY_FRAGMENT, operator `name`'s kernels: `kernel` for the
// CPU and CUDA (torch_binding.h's impl_devices), `autograd` for Autograd; and those of its backward
// operator `name`_backward: `backward` for the CPU and CUDA and, as it has no derivative of its
// own, an autograd kernel that raises when differentiated through.
template <typename Fn, typename BackwardFn, typename AutogradFn>
void impl_op(torch::Library& m, const std::string& name, Fn* kernel, BackwardFn* backward,
             AutogradFn* autograd) {
  const std::string backward_name = name + "_backward";
  impl_devices(m, name.c_str(), kernel);
  impl_devices(m, backward_name.c_str(), backward);
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, autograd));
  m.impl(backward_name.c_str(), torch::dispatch(c10::DispatchKey::Autograd,
                                                torch::autograd::autogradNotImplementedFallback()));
}

}  // namespace torch_binding
}  // namespace fusedlayers
