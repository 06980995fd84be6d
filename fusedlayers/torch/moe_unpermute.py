"""moe_unpermute on torch tensors: `fusedlayers::moe_unpermute` (backends/torch/moe.cpp: schema,
kernels, autograd), its fake kernels, the functional API, the unfused reference and the bench
case. The math: csrc/moe/moe.h."""

import torch

from ..bench.case import Case
from . import _op
from .moe_permute import bench_routing, moe_permute

__all__ = ["moe_unpermute"]
moe_unpermute_op = _op.handle("moe_unpermute")


def moe_unpermute(ys: torch.Tensor, top_k_index: torch.Tensor, row_index: torch.Tensor,
                  top_k_weights: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """The weighted combine of a mixture-of-experts layer: out[t] = sum_j top_k_weights[t, j] *
    ys[row_index[t * top_k + j]] over the pairs that reach an expert, the inverse of
    `moe_permute` (whose row_index it takes) with the routing weights (Shazeer et al. 2017,
    arXiv:1701.06538).

    ys: (tokens * top_k, hidden) in expert order, float32/float64/float16/bfloat16.
    top_k_index: (tokens, top_k) int32/int64 as given to moe_permute; row_index: its int32
    result. top_k_weights: (tokens, top_k), float32 or ys' dtype, or None for 1. Returns
    (tokens, hidden) in ys' dtype, the sum over j taken in float32 (float64 for float64) in j
    order and rounded once: the same bits on every run. Differentiable in ys and top_k_weights
    (dys[row(t, j)] = w[t, j] dout[t]; dw[t, j] = <ys[row(t, j)], dout[t]>). Raises TypeError
    for other dtypes, ValueError for shapes or devices.
    """
    return moe_unpermute_op(ys, top_k_index, row_index, top_k_weights, num_experts)


def reference(ys, top_k_index, row_index, top_k_weights, num_experts):
    """The unfused computation moe_unpermute replaces (transformers' weighted multiply, inverse
    permutation and sum over the top-k)."""
    tokens, k = top_k_index.shape
    acc = torch.float64 if ys.dtype == torch.float64 else torch.float32
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    rows = ys[row_index.long()].view(tokens, k, ys.shape[-1]).to(acc)
    if top_k_weights is not None:
        rows = rows * top_k_weights.to(acc)[..., None]
    return torch.where(valid[..., None], rows, 0).sum(1).to(ys.dtype)


@_op.register_fake("moe_unpermute")
def _(ys, top_k_index, row_index, top_k_weights, num_experts):
    _op.check_devices("moe_unpermute", "ys", ys, top_k_index=top_k_index, row_index=row_index,
                      top_k_weights=top_k_weights)
    return ys.new_empty(top_k_index.shape[0], ys.shape[-1])


@_op.register_fake("moe_unpermute_backward")
def _(dout, ys, top_k_index, row_index, top_k_weights, num_experts):
    _op.check_devices("moe_unpermute_backward", "dout", dout, ys=ys, top_k_index=top_k_index,
                      row_index=row_index, top_k_weights=top_k_weights)
    dweights = top_k_weights.new_empty(top_k_weights.shape) if ys is not None else \
        dout.new_empty(0)
    return dout.new_empty(top_k_index.numel(), dout.shape[-1]), dweights


EXPORT_DECOMPOSITIONS = {"moe_unpermute": reference}  # ONNX export writes the unfused formula
DECOMPOSITIONS = {}  # Inductor keeps the combine whole: data-dependent rows


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """shape: (tokens, hidden, num_experts, top_k). Bytes: the forward reads tokens * top_k rows
    and writes the tokens' rows; the backward reads dout and ys, writes dys."""
    tokens, hidden, experts, top_k = shape
    index, weights = bench_routing(tokens, experts, top_k, device, dtype)
    weights.requires_grad_()
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    ys, row_index, _ = moe_permute(x, index, experts)
    ys.requires_grad_()
    rows = tokens * hidden * ys.element_size()
    fwd = top_k * rows + rows
    # transformers' combine: the weights in expert order times the rows, the inverse
    # permutation, the sum over the top-k
    perm = torch.sort(index.reshape(-1)).indices
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)

    def eager():
        weighted = ys * weights.reshape(-1)[perm, None]
        return weighted[inverse].view(tokens, top_k, hidden).sum(1)
    return Case(lambda: moe_unpermute(ys, index, row_index, weights, experts), eager,
                [ys, weights],
                {"fwd": fwd, "fwd+bwd": fwd + rows + 2 * top_k * rows})
