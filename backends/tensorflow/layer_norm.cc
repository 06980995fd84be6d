// TensorFlow ops FusedlayersLayerNorm / FusedlayersLayerNormGrad on csrc/norm/layer_norm.h, which
// checks every argument. weight and bias are always inputs and count only when has_weight /
// has_bias (TF ops have no optional inputs); the kernels are tf_norm.h's.
#include "backends/tensorflow/tf_norm.h"
#include "norm/layer_norm.h"

namespace fusedlayers::tf_binding {
namespace {

REGISTER_OP("FusedlayersLayerNorm")
    .Input("x: T").Input("weight: P").Input("bias: P")
    .Output("y: T").Output("mean: U").Output("rstd: U")
    .Attr("normalized_shape: list(int)").Attr("eps: float")
    .Attr("has_weight: bool").Attr("has_bias: bool").Attr("rms_scaling: bool = false")
    .Attr(kTypeT).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn(NormShape<2>)
    .Doc("Layer norm over the trailing normalized_shape dims; mean/rstd in U (csrc/norm/layer_norm.h).");

REGISTER_OP("FusedlayersLayerNormGrad")
    .Input("dy: T").Input("x: T").Input("mean: U").Input("rstd: U")
    .Input("weight: P").Input("bias: P")
    .Output("dx: T").Output("dweight: P").Output("dbias: P")
    .Attr("normalized_shape: list(int)")
    .Attr("has_weight: bool").Attr("has_bias: bool").Attr("rms_scaling: bool = false")
    .Attr(kTypeT).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn(NormGradShape<4>)
    .Doc("dx, dweight, dbias of FusedlayersLayerNorm (dweight/dbias empty when absent).");

struct LayerNormOp
    : NormCalls<layer_norm_forward_check, layer_norm_forward, layer_norm_backward_check,
                layer_norm_backward_workspace_size, layer_norm_backward> {
  static constexpr const char* kName = "layer_norm";
  static constexpr const char* kOption = "rms_scaling";
  static constexpr bool kHasBias = true;
  static constexpr int kStats = 2;  // mean, rstd

  static LayerNormForward forward_args(const TensorRef& x, Sizes shape, const TensorRef& weight,
                                       const TensorRef& bias, float eps, bool rms_scaling) {
    return {x, shape, weight, bias, eps, rms_scaling};
  }
  static void set_stats(LayerNormForward& a, void* const* stats) {
    a.mean = stats[0];
    a.rstd = stats[1];
  }
  static LayerNormBackward backward_args(const TensorRef& dy, const TensorRef& x,
                                         const TensorRef& mean, const TensorRef& rstd, Sizes shape,
                                         const TensorRef& weight, const TensorRef& bias,
                                         bool rms_scaling) {
    return {dy, x, mean, rstd, shape, weight, bias, false, rms_scaling};
  }
};

FUSEDLAYERS_REGISTER_NORM_KERNELS("FusedlayersLayerNorm", LayerNormOp);

}  // namespace
}  // namespace fusedlayers::tf_binding
