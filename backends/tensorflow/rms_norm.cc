// TensorFlow ops FusedlayersRmsNorm / FusedlayersRmsNormGrad on csrc/norm/rms_norm.h, which checks
// every argument. weight is always an input and counts only when has_weight (TF ops have no
// optional inputs); the kernels are tf_norm.h's.
#include "backends/tensorflow/tf_norm.h"
#include "norm/rms_norm.h"

namespace fusedlayers::tf_binding {
namespace {

REGISTER_OP("FusedlayersRmsNorm")
    .Input("x: T").Input("weight: P").Output("y: T").Output("rstd: U")
    .Attr("normalized_shape: list(int)").Attr("eps: float").Attr("has_weight: bool")
    .Attr("zero_centered: bool = false").Attr(kTypeT).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn(NormShape<1>)
    .Doc("RMSNorm over the trailing normalized_shape dims; rstd in U (csrc/norm/rms_norm.h).");

REGISTER_OP("FusedlayersRmsNormGrad")
    .Input("dy: T").Input("x: T").Input("rstd: U").Input("weight: P")
    .Output("dx: T").Output("dweight: P")
    .Attr("normalized_shape: list(int)").Attr("has_weight: bool")
    .Attr("zero_centered: bool = false").Attr(kTypeT).Attr(kTypeP).Attr(kTypeU)
    .SetShapeFn(NormGradShape<3>)
    .Doc("dx, dweight of FusedlayersRmsNorm (dweight empty when absent).");

// rstd is the one statistic: the backward's two statistics inputs are both rstd.
struct RmsNormOp : NormCalls<rms_norm_forward_check, rms_norm_forward, rms_norm_backward_check,
                             rms_norm_backward_workspace_size, rms_norm_backward> {
  static constexpr const char* kName = "rms_norm";
  static constexpr const char* kOption = "zero_centered";
  static constexpr bool kHasBias = false;
  static constexpr int kStats = 1;

  static RmsNormForward forward_args(const TensorRef& x, Sizes shape, const TensorRef& weight,
                                     const TensorRef& /*bias*/, float eps, bool zero_centered) {
    return {x, shape, weight, eps, zero_centered};
  }
  static void set_stats(RmsNormForward& a, void* const* stats) { a.rstd = stats[0]; }
  static RmsNormBackward backward_args(const TensorRef& dy, const TensorRef& x,
                                       const TensorRef& /*rstd*/, const TensorRef& rstd,
                                       Sizes shape, const TensorRef& weight,
                                       const TensorRef& /*bias*/, bool zero_centered) {
    return {dy, x, rstd, shape, weight, zero_centered};
  }
};

FUSEDLAYERS_REGISTER_NORM_KERNELS("FusedlayersRmsNorm", RmsNormOp);

}  // namespace
}  // namespace fusedlayers::tf_binding
