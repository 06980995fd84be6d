"""The fused ops on torch tensors: the `fusedlayers::` operators (schemas in
backends/torch/schemas.cpp; autograd and autocast in C++, backends/torch/autograd.cpp and
autocast.cpp), their fake kernels, and the functional API on top of them.

`relu_scale_op`, `layer_norm_op` and `linear_gelu_op` are the operators' handles, which the
modules call directly; without a built extension they raise ExtensionNotBuiltError, naming the
command that builds it.

Autocast policy (that of the unfused ops under torch.autocast): `linear_gelu` runs in the autocast
dtype like `torch.nn.functional.linear`; `layer_norm` runs in float32 on CUDA and in the input
dtype on the CPU, like `torch.nn.functional.layer_norm` there; `relu_scale` runs in the input
dtype like relu. float64 stays float64.
"""

from collections.abc import Sequence

import torch

from .. import _args
from . import _library

_LOAD_ERROR = _library.load()


def _missing(*args, **kwargs):
    raise _library.ExtensionNotBuiltError(_LOAD_ERROR)


if _LOAD_ERROR is None:
    relu_scale_op = torch.ops.fusedlayers.relu_scale.default
    layer_norm_op = torch.ops.fusedlayers.layer_norm.default
    linear_gelu_op = torch.ops.fusedlayers.linear_gelu.default
else:
    relu_scale_op = layer_norm_op = linear_gelu_op = _missing


def _check_devices(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """A tensor on another device (a meta tensor among CPU ones, say) makes the dispatcher run the
    fake kernel instead of the binding, whose check would not run: repeat it there."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"fusedlayers.{op}: {name} must be on the same device as {ref_name} "
                             f"({ref.device}), got {t.device}")


def relu_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """y = max(x, 0) * alpha, element-wise, bit-identical to `torch.relu(x) * alpha`.

    x: any shape and layout, float32/float64/float16/bfloat16. Returns a contiguous tensor of
    x's shape and dtype. Raises TypeError for other dtypes or an alpha that is not a real
    number, ValueError for a non-finite alpha.
    When x requires grad, autograd saves a bitmask of where x > 0 (1 bit per element), not x.
    """
    return relu_scale_op(x, _args.real("fusedlayers.relu_scale", "alpha", alpha))


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                approximate: str = "none") -> torch.Tensor:
    """y = gelu(x @ weight^T + bias), replacing `F.gelu(F.linear(x, weight, bias), approximate)`.

    x: (..., in_features); weight: (out_features, in_features), contiguous or the transpose of a
    contiguous (in_features, out_features) tensor (GPT-2's Conv1D weight `w` is passed as
    `w.t()`; neither is copied); bias: (out_features,) or None; all one floating dtype on one
    device. approximate: 'none' (erf) or 'tanh'. Returns (..., out_features). Raises ValueError
    on shape/device/approximate mismatches and TypeError on dtype mismatches. GELU: Hendrycks &
    Gimpel 2016, arXiv:1606.08415.
    """
    return linear_gelu_op(x, weight, bias, approximate)


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, memory_efficient: bool = False) -> torch.Tensor:
    """Layer normalization over the trailing `normalized_shape` dims of x, replacing
    `torch.nn.functional.layer_norm` (Ba et al. 2016, arXiv:1607.06450).

    x: (..., *normalized_shape), float32/float64/float16/bfloat16, any layout. weight, bias:
    normalized_shape, in x's dtype or float32 (for half x). Statistics in float32 (float64 for
    float64). memory_efficient=True saves the output instead of the input for the backward (as
    Apex does); it then needs a weight without zeros. Raises ValueError on shape/device/eps
    errors and TypeError on dtype errors or a normalized_shape / eps of the wrong type.
    """
    shape = _args.normalized_shape("fusedlayers.layer_norm", normalized_shape)
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    return layer_norm_op(x, shape, weight, bias, eps, bool(memory_efficient))[0]


def dense_gelu(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None = None,
               approximate: str = "none") -> torch.Tensor:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features), read in
    place."""
    return linear_gelu_op(x, kernel.t(), bias, approximate)


def layer_norm_trailing(x: torch.Tensor, norm_ndims: int, gamma: torch.Tensor | None = None,
                        beta: torch.Tensor | None = None, eps: float = 1e-5,
                        rms_scaling: bool = False) -> torch.Tensor:
    """Normalizes the trailing norm_ndims dims; rms_scaling as Keras' LayerNormalization's."""
    shape = list(x.shape[x.dim() - norm_ndims:])
    eps = _args.real("fusedlayers.layer_norm", "eps", eps)
    return layer_norm_op(x, shape, gamma, beta, eps, False, rms_scaling)[0]


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _register() -> None:
    lib = "fusedlayers::"
    fake = torch.library.register_fake

    # Fake kernels: shapes, dtypes and (contiguous) strides exactly as the real kernels return.
    @fake(lib + "relu_scale")
    def _(x, alpha):
        return x.new_empty(x.shape)

    @fake(lib + "relu_scale_with_mask")
    def _(x, alpha):
        return x.new_empty(x.shape), x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32)

    @fake(lib + "relu_scale_backward")
    def _(grad_out, mask, alpha):
        _check_devices("relu_scale_backward", "grad_out", grad_out, mask=mask)
        return grad_out.new_empty(grad_out.shape)

    @fake(lib + "layer_norm")
    def _(x, normalized_shape, weight, bias, eps, memory_efficient=False, rms_scaling=False):
        _check_devices("layer_norm", "input", x, weight=weight, bias=bias)
        stat_shape = x.shape[:x.dim() - len(normalized_shape)]
        return (x.new_empty(x.shape), x.new_empty(stat_shape, dtype=_stat_dtype(x)),
                x.new_empty(stat_shape, dtype=_stat_dtype(x)))

    @fake(lib + "layer_norm_backward")
    def _(grad_out, saved, mean, rstd, normalized_shape, weight, bias, memory_efficient=False,
          rms_scaling=False):
        _check_devices("layer_norm_backward", "saved", saved, grad_out=grad_out, weight=weight,
                       bias=bias)
        return (saved.new_empty(saved.shape),
                saved.new_empty(0) if weight is None else weight.new_empty(weight.shape),
                saved.new_empty(0) if bias is None else bias.new_empty(bias.shape))

    @fake(lib + "linear_gelu")
    def _(x, weight, bias, approximate):
        _check_devices("linear_gelu", "input", x, weight=weight, bias=bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @fake(lib + "linear_gelu_with_pre")
    def _(x, weight, bias, approximate):
        _check_devices("linear_gelu", "input", x, weight=weight, bias=bias)
        shape = (*x.shape[:-1], weight.shape[0])
        return x.new_empty(shape), x.new_empty(shape)

    @fake(lib + "linear_gelu_backward")
    def _(grad_out, x, weight, pre, has_bias, approximate):
        _check_devices("linear_gelu_backward", "input", x, grad_out=grad_out, weight=weight)
        # grad_weight in weight's layout: (in, out) storage when weight is such a transpose.
        in_out = not weight.is_contiguous() and weight.t().is_contiguous()
        grad_weight = (weight.new_empty(weight.shape[::-1]).t() if in_out
                       else weight.new_empty(weight.shape))
        return (x.new_empty(x.shape), grad_weight, x.new_empty(weight.shape[0] if has_bias else 0))


if _LOAD_ERROR is None:
    _register()
    from . import inductor  # imports this module's helpers: after they are defined
    inductor.install()
