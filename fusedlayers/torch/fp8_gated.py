"""FP8 gated activations on torch tensors: `fusedlayers::fp8_gated_forward` and
`fusedlayers::fp8_gated_backward` (backends/torch/fp8_gated.cpp), their fake kernels and the
functional API. Their rule (csrc/fp8/fp8_gated.h): the FP8 values and scales of the unfused
composition, the gated op then fp8_quantize, bit for bit, without the rounded activation (or
its gradient) ever written in bf16."""

import torch

from . import _op
from .fp8 import Fp8Quantized, check_names, fake_outputs

__all__ = ["fp8_gated", "fp8_gated_backward"]
forward_op = _op.handle("fp8_gated_forward")
backward_op = _op.handle("fp8_gated_backward")

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def fp8_gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
              scaling: str = "1x128", format: str = "e4m3", transpose: bool = False,
              power_of_2_scales: bool = False, scaling_t: str | None = None) -> Fp8Quantized:
    """act(gate) * up quantized to FP8: `fp8_quantize(swiglu(gate, up), ...)` (or geglu's) in one
    pass, equal to it bit for bit.

    gate, up: [..., cols], one shape, float16 or bfloat16, cols a multiple of 128; the halves of
    one projection (chunk(2, -1)) are read in place. activation: "silu" (SwiGLU), "gelu" or
    "gelu_tanh" (GeGLU). scaling: "1x128" or "tensorwise" (two passes: the amax, then the
    values); format, transpose, power_of_2_scales, scaling_t and the result: as fp8_quantize's
    for x of gate's shape. Raises TypeError for other dtypes, ValueError for other names,
    shapes or cols.
    """
    return Fp8Quantized(*forward_op(gate, up, activation, scaling, format, transpose,
                                    power_of_2_scales, scaling_t))


def fp8_gated_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       activation: str = "silu", scaling: str = "1x128", format: str = "e4m3",
                       transpose: bool = False, power_of_2_scales: bool = False) -> Fp8Quantized:
    """The gradient [dgate | dup] of act(gate) * up for dy, quantized to FP8:
    `fp8_quantize(torch.cat(swiglu_backward(dy, gate, up), -1), ...)` in one pass, equal to it
    bit for bit: the operand of a gate/up projection's dgrad (and, transposed, its wgrad, whose
    dy operand keeps the scaling: there is no scaling_t).

    dy, gate, up: [..., cols] as fp8_gated's. Returns Fp8Quantized of [..., 2 cols] (dgate's
    columns first), as fp8_quantize returns. Raises as fp8_gated.
    """
    return Fp8Quantized(*backward_op(dy, gate, up, activation, scaling, format, transpose,
                                     power_of_2_scales))


def _check(op: str, gate, activation: str, scaling: str, format: str,
           scaling_t: str | None = None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fusedlayers.{op}: activation must be 'silu', 'gelu' or 'gelu_tanh', "
                         f"got {activation!r}")
    check_names(op, scaling, format, scaling_t)
    if scaling == "128x128":
        raise ValueError(f"fusedlayers.{op}: scaling must be '1x128' or 'tensorwise' (128x128 "
                         "tiles are for weights)")
    if gate.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"fusedlayers.{op}: gate must be float16 or bfloat16, got {gate.dtype}")
    if gate.dim() == 0 or gate.shape[-1] % 128:
        raise ValueError(f"fusedlayers.{op}: gate's last dimension must be a multiple of 128, "
                         f"got {list(gate.shape)}")


@_op.register_fake("fp8_gated_forward")
def _(gate, up, activation, scaling="1x128", format="e4m3", transpose=False,
      power_of_2_scales=False, scaling_t=None):
    _check("fp8_gated_forward", gate, activation, scaling, format, scaling_t)
    return fake_outputs(gate, tuple(gate.shape), scaling, format, transpose, scaling_t)


@_op.register_fake("fp8_gated_backward")
def _(dy, gate, up, activation, scaling="1x128", format="e4m3", transpose=False,
      power_of_2_scales=False):
    _check("fp8_gated_backward", gate, activation, scaling, format)
    shape = (*gate.shape[:-1], 2 * gate.shape[-1])
    return fake_outputs(dy, shape, scaling, format, transpose)
