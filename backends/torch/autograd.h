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

#include <optional>
#include <type_traits>

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

// A backward op runs below autograd, like a native backward kernel, unless the backward is itself
// being recorded (create_graph=True): then its autograd kernel (the fallback registered with
// register_backward_autograd) makes a second derivative raise instead of being silently wrong.
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

// Backward ops have no derivative of their own: differentiating through them raises.
inline void register_backward_autograd(torch::Library& m, const char* name) {
  m.impl(name, torch::autograd::autogradNotImplementedFallback());
}

}  // namespace torch_binding
}  // namespace fusedlayers
