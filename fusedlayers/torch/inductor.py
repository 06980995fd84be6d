"""How torch.compile's Inductor lowers the fusedlayers:: operators: into the unfused aten math.

An operator Inductor does not know runs as an extern kernel, a call from the compiled graph that
Inductor cannot fuse with its neighbours, and in a transformer that costs more than our kernels
save: the LayerNorm's input is a residual add (and dropout) and its output is cast for the next
GEMM, which Inductor folds into its own normalization kernel, and GELU's bias add folds into the
kernel around it; as extern kernels each of those becomes a pass over memory of its own, plus a
host call: a fused model compiled with our kernels as extern calls ran slower than the compiled
unfused model; with these decompositions it runs the same kernels as the compiled unfused model
(README.md has the measurements).

So under Inductor each op and its backward decompose into the unfused ops (fusedlayers.reference
where it has them), written with aten ops and returning exactly what the op returns,
for Inductor to fuse. Eager mode, other backends (aot_eager, cudagraphs) and torch.export keep the
fused kernels: the decompositions live only in Inductor's table. Importing Inductor costs seconds,
so the table is filled when Inductor is first imported, not when fusedlayers is.
"""

import importlib.abc
import importlib.util
import sys

import torch
import torch.nn.functional as F

from .. import reference
from ._op import stat_dtype

_TABLE_MODULE = "torch._inductor.decomposition"
aten = torch.ops.aten


def _relu_scale_with_mask(x, alpha):
    # The mask in csrc/relu_scale.h's layout: bit i % 32 of int32 word i / 32 set where x[i] is
    # not <= 0, zero-padded.
    n = x.numel()
    words = (n + 31) // 32
    keep = F.pad(torch.logical_not(x <= 0).reshape(-1).to(torch.int64), (0, words * 32 - n))
    bits = keep.reshape(words, 32) << torch.arange(32, device=x.device, dtype=torch.int64)
    mask = bits.sum(-1)
    mask = torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)
    return reference.relu_scale(x, alpha), mask


def _relu_scale_backward(grad_out, mask, alpha):
    bits = (mask.to(torch.int64).unsqueeze(-1)
            >> torch.arange(32, device=mask.device, dtype=torch.int64)) & 1
    keep = bits.reshape(-1)[:grad_out.numel()].reshape(grad_out.shape) != 0
    return torch.where(keep, grad_out * alpha, torch.zeros_like(grad_out))


def _layer_norm(x, normalized_shape, weight, bias, eps, memory_efficient=False,
                rms_scaling=False):
    # The math of csrc/norm.h: statistics and output in float32 (float64 for float64),
    # returned in the leading shape; rms_scaling=True scales x itself (Keras' rms_scaling).
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.to(stat_dtype(x))
    var, mean = torch.var_mean(xf, dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (xf if rms_scaling else xf - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    lead = x.shape[:dims[0]]
    return out.to(x.dtype), mean.reshape(lead), rstd.reshape(lead)


def _layer_norm_backward(grad_out, saved, mean, rstd, normalized_shape, weight, bias,
                         memory_efficient=False, rms_scaling=False):
    # With g = dy * gamma: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), or for
    # rms_scaling=True dx = rstd * (g - x_hat * rstd * mean(g * x)) (csrc/norm.h).
    dims = list(range(saved.dim() - len(normalized_shape), saved.dim()))
    lead_dims = list(range(dims[0]))
    keep = (*mean.shape, *([1] * len(dims)))
    acc = stat_dtype(saved)
    dy, s, rstd = grad_out.to(acc), saved.to(acc), rstd.reshape(keep)
    g = dy if weight is None else dy * weight
    if memory_efficient:  # saved is the output: x_hat = (y - beta) / gamma
        x_hat = s if bias is None else s - bias
        x_hat = x_hat if weight is None else x_hat / weight
    else:
        x_hat = (s - mean.reshape(keep)) * rstd
    if not rms_scaling:
        grad_input = rstd * (g - g.mean(dims, keepdim=True)
                             - x_hat * (g * x_hat).mean(dims, keepdim=True))
        y_hat = x_hat  # what gamma multiplies
    else:
        grad_input = rstd * (g - x_hat * rstd * (g * s).mean(dims, keepdim=True))
        y_hat = s * rstd
    empty = saved.new_empty(0)
    grad_weight = empty if weight is None else (dy * y_hat).sum(lead_dims).to(weight.dtype)
    grad_bias = empty if bias is None else dy.sum(lead_dims).to(bias.dtype)
    return grad_input.to(saved.dtype), grad_weight, grad_bias


def _rms_norm(x, normalized_shape, weight, eps, zero_centered=False):
    # csrc/norm.h, NormMode::kRms: rstd in float32 (float64 for float64), the gain 1 + weight
    # with zero_centered (1 where weight is absent), added in that type.
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = x.to(stat_dtype(x))
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    out = xf * rstd
    if weight is not None:
        out = out * (weight.to(xf.dtype) + 1 if zero_centered else weight)
    return out.to(x.dtype), rstd.reshape(x.shape[:dims[0]])


def _rms_norm_backward(grad_out, x, rstd, normalized_shape, weight, zero_centered=False):
    # With g = dy * gamma and x_hat = x * rstd: dx = rstd * (g - x_hat * mean(g * x_hat)),
    # dgamma = sum over rows of dy * x_hat (csrc/norm.h).
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    acc = stat_dtype(x)
    dy, xf = grad_out.to(acc), x.to(acc)
    x_hat = xf * rstd.reshape(*rstd.shape, *([1] * len(dims)))
    g = dy
    if weight is not None:
        g = dy * (weight.to(acc) + 1 if zero_centered else weight)
    grad_input = rstd.reshape(*rstd.shape, *([1] * len(dims))) * (
        g - x_hat * (g * x_hat).mean(dims, keepdim=True))
    grad_weight = (x.new_empty(0) if weight is None
                   else (dy * x_hat).sum(list(range(dims[0]))).to(weight.dtype))
    return grad_input.to(x.dtype), grad_weight


def _linear_gelu_with_pre(x, weight, bias, approximate):
    pre = F.linear(x, weight, bias)
    return F.gelu(pre, approximate=approximate), pre


def _linear_gelu_backward(grad_out, x, weight, pre, has_bias, approximate):
    grad_pre = aten.gelu_backward.default(grad_out, pre, approximate=approximate)
    grad_pre = grad_pre.reshape(-1, grad_pre.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    grad_input = (grad_pre @ weight).reshape(x.shape)
    if not weight.is_contiguous() and weight.t().is_contiguous():  # (in, out) storage
        grad_weight = (x2.t() @ grad_pre).t()
    else:
        grad_weight = grad_pre.t() @ x2
    grad_bias = grad_pre.sum(0) if has_bias else x.new_empty(0)
    return grad_input, grad_weight, grad_bias


DECOMPOSITIONS = {
    "relu_scale": reference.relu_scale,
    "relu_scale_with_mask": _relu_scale_with_mask,
    "relu_scale_backward": _relu_scale_backward,
    "layer_norm": _layer_norm,
    "layer_norm_backward": _layer_norm_backward,
    "rms_norm": _rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "linear_gelu": reference.linear_gelu,
    "linear_gelu_with_pre": _linear_gelu_with_pre,
    "linear_gelu_backward": _linear_gelu_backward,
}


def register(table: dict) -> None:
    """Adds the decompositions to an Inductor decomposition table."""
    for name, fn in DECOMPOSITIONS.items():
        table[getattr(torch.ops.fusedlayers, name).default] = fn


def _register_in_inductor(module) -> None:
    register(module.decompositions)
    module.fast_random_decomps.cache_clear()  # the table Inductor uses is a cached copy


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module has been imported (a post-import hook)."""

    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            self.callback(module)

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Registers the decompositions with Inductor now, or when Inductor is imported."""
    if _TABLE_MODULE in sys.modules:
        _register_in_inductor(sys.modules[_TABLE_MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport(_TABLE_MODULE, _register_in_inductor))
