// FP8 outputs for PyTorch: the tensors an Fp8Target (fp8/fp8.h) writes, allocated and wired,
// shared by the bindings of the ops that write FP8.
#pragma once

#include <optional>
#include <tuple>

#include "backends/torch/torch_binding.h"
#include "fp8/fp8.h"

namespace fusedlayers::torch_binding {

// (q, scale_inv, q_t, scale_inv_t): q_t and scale_inv_t undefined without a transpose.
using Fp8Tensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A scale_inv buffer of `sizes`: 1x128's [blocks, rows] buffer viewed as [rows, blocks]
// (column-major), 128x128's padded rows cut to their tiles (the padding left unwritten: no
// GEMM reads it, and zeroing it would cost a launch a buffer), a tensorwise scale 0-d.
inline at::Tensor scale_buffer(const Fp8ScaleSizes& sizes, Fp8Scaling scaling,
                        const at::TensorOptions& f32) {
  switch (scaling) {
    case Fp8Scaling::kTensorwise: return at::empty({}, f32);
    case Fp8Scaling::kBlock1x128: return at::empty({sizes.dim0, sizes.dim1}, f32).t();
    case Fp8Scaling::kBlock128x128:
      return at::empty({sizes.dim0, sizes.ld}, f32).narrow(1, 0, sizes.dim1);
  }
  return {};
}


// t's outputs for values of rows x cols (q of `shape`, a view of rows x cols), allocated with
// `like`'s device, wired into t (amax: a tensorwise workspace) and returned; `workspace` keeps
// the amax alive through the call.
inline Fp8Tensors fp8_outputs(Fp8Target& t, at::IntArrayRef shape, int64_t rows, int64_t cols,
                              bool transpose, const at::Tensor& like, at::Tensor& workspace) {
  const auto fp8 = t.format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  const auto f32 = like.options().dtype(at::kFloat);
  at::Tensor q = at::empty(shape, like.options().dtype(fp8));
  at::Tensor scale_inv =
      scale_buffer(fp8_scale_sizes(t.scaling, rows, cols, false), t.scaling, f32);
  at::Tensor q_t, scale_inv_t;
  if (transpose) {
    q_t = at::empty({cols, rows}, like.options().dtype(fp8));
    scale_inv_t =
        scale_buffer(fp8_scale_sizes(t.scaling_t, rows, cols, true), t.scaling_t, f32);
    t.q_t = static_cast<uint8_t*>(q_t.data_ptr());
    t.scale_inv_t = scale_inv_t.data_ptr<float>();
  }
  if (t.scaling == Fp8Scaling::kTensorwise) {
    workspace = at::empty({1}, f32);
    t.amax = workspace.data_ptr<float>();
  }
  t.q = static_cast<uint8_t*>(q.data_ptr());
  t.scale_inv = scale_inv.data_ptr<float>();
  return {q, scale_inv, q_t, scale_inv_t};
}

// format, scaling and scaling_t (None: scaling) parsed into t (errors naming op).
inline void parse_fp8_target(Fp8Target& t, const char* op, c10::string_view scaling,
                             c10::string_view format, bool power_of_2_scales,
                             std::optional<c10::string_view> scaling_t = std::nullopt) {
  call_csrc([&] {
    t.format = parse_fp8_format(op, std::string(format));
    t.scaling = parse_fp8_scaling(op, std::string(scaling));
    t.scaling_t =
        scaling_t ? parse_fp8_scaling(op, std::string(*scaling_t), "scaling_t") : t.scaling;
  });
  t.power_of_2_scales = power_of_2_scales;
}

}  // namespace fusedlayers::torch_binding
