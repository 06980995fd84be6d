"""SwiGLU on torch tensors: `fusedlayers::swiglu` (backends/torch/gated.cpp: schema, kernels,
autograd, autocast), its fake kernels, the functional API, `SwiGLUMLP` (fuse()'s module for
Llama-style MLPs), the unfused reference and Inductor's lowering. The math: csrc/activation/gated.h."""

import torch
import torch.nn.functional as F

from ..bench.case import Case
from . import _op
from .gated_mlp import GatedMLP, gated_bench_case

__all__ = ["SwiGLUMLP", "swiglu"]
swiglu_op = _op.handle("swiglu")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass, replacing `F.silu(gate) * up` (Shazeer 2020, "GLU Variants
    Improve Transformer", arXiv:2002.05202; the MLP of Llama, Mistral, Qwen).

    gate, up: one shape and dtype, float32/float64/float16/bfloat16, any layout (the halves of
    one projection split with chunk(2, -1) are read in place). Math in float32 (float64 for
    float64), rounded once. Returns a contiguous tensor of gate's shape and dtype. When either
    requires grad, autograd saves gate and up (not the activation) and the backward recomputes
    silu. Raises TypeError for other dtypes, ValueError for mismatched shapes or devices.
    """
    return swiglu_op(gate, up)


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The unfused computation swiglu replaces."""
    return F.silu(gate) * up


class SwiGLUMLP(GatedMLP):
    """down(silu(gate(x)) * up(x)) with the activation and product fused (`swiglu`): the MLP of
    Llama, Mistral, Qwen2/3, OLMo2, Granite, or of Phi-3 with one `gate_up_proj`. It holds the
    MLP's own projection modules under their own names (GatedMLP)."""

    activation = "silu"

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_op(gate, up)


FUSED_MODULE = SwiGLUMLP  # fuse() swaps modules by SwiGLUMLP.fuse_candidates


@_op.register_fake("swiglu")
def _(gate, up):
    _op.check_devices("swiglu", "gate", gate, up=up)
    return gate.new_empty(gate.shape)


@_op.register_fake("swiglu_backward")
def _(dy, gate, up):
    _op.check_devices("swiglu_backward", "dy", dy, gate=gate, up=up)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


# ---------------------------------------------------------------- Inductor's lowering

def _acc(t):
    return t if t.dtype == torch.float64 else t.float()


def _forward(gate, up):
    return (F.silu(_acc(gate)) * _acc(up)).to(gate.dtype)


def _backward(dy, gate, up):
    g, d = _acc(gate), _acc(dy)
    s = torch.sigmoid(g)
    return ((d * _acc(up) * s * (1 + g * (1 - s))).to(gate.dtype),
            (d * g * s).to(gate.dtype))


DECOMPOSITIONS = {"swiglu": _forward, "swiglu_backward": _backward}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    peer = None
    if peers and device.type == "cuda":
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            peer = LigerSiLUMulFunction.apply
        except ImportError:
            pass
    return gated_bench_case(shape, dtype, device, swiglu, reference, peer)
