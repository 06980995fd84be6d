"""moe_permute on torch tensors: `fusedlayers::moe_permute` (backends/torch/moe.cpp: schema,
kernels, autograd), its fake kernels, the functional API, the unfused reference and the bench
case. The math: csrc/moe/moe.h."""

import torch

from ..bench.case import Case
from . import _op

__all__ = ["moe_permute"]
moe_permute_op = _op.handle("moe_permute")


def moe_permute(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """The token rows of a mixture-of-experts layer in expert order, for the experts' grouped
    GEMMs (the dropless layout of MegaBlocks, Gale et al. 2022, arXiv:2211.15841; transformers'
    grouped_mm experts): a stable counting sort of the (token, slot) pairs by expert and the
    gather of their rows, in one call.

    x: (tokens, hidden), float32/float64/float16/bfloat16. top_k_index: (tokens, top_k), int32 or
    int64, each token's experts; an id outside [0, num_experts) (an expert-parallel sentinel)
    reaches no expert. Returns (xs, row_index, offsets): xs (tokens * top_k, hidden) in x's
    dtype, xs[row_index[t * top_k + j]] = x[t] (zeros for a pair that reaches no expert, whose
    rows come last); row_index (tokens * top_k,) int32; offsets (num_experts,) int32, the end of
    each expert's rows (grouped_mm's `offs`). Pairs of one expert keep their token order, so the
    result is the same on every run. Differentiable in x: dx[t] = sum_j dxs[row(t, j)].
    Raises TypeError for other dtypes, ValueError for shapes, devices or num_experts outside
    [1, 8192].
    """
    return moe_permute_op(x, top_k_index, num_experts)


def routing(top_k_index: torch.Tensor, num_experts: int):
    """The route in stock torch ops, none in place (ONNX export writes it): (order, valid,
    row_index int64, offsets int64), order the stable sort of the pairs by expert (pairs with no
    expert last): a sort of unique keys, expert * pairs + pair."""
    flat = top_k_index.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    position = torch.arange(flat.numel(), device=flat.device)
    order = torch.argsort(key * flat.numel() + position)
    row_index = torch.argsort(order)  # the inverse permutation
    experts = torch.arange(num_experts, device=flat.device)
    offsets = torch.cumsum((key[None, :] == experts[:, None]).sum(1), 0)
    return order, valid, row_index, offsets


def reference(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """The unfused computation moe_permute replaces (transformers' sort, gather and histogram)."""
    order, valid, row_index, offsets = routing(top_k_index, num_experts)
    k = top_k_index.shape[1]
    xs = torch.where(valid[order, None], x[order // k], torch.zeros((), dtype=x.dtype,
                                                                    device=x.device))
    return xs, row_index.int(), offsets.int()


@_op.register_fake("moe_permute")
def _(x, top_k_index, num_experts):
    _op.check_devices("moe_permute", "x", x, top_k_index=top_k_index)
    pairs = top_k_index.shape[0] * top_k_index.shape[1]
    return (x.new_empty(pairs, x.shape[-1]), x.new_empty(pairs, dtype=torch.int32),
            x.new_empty(num_experts, dtype=torch.int32))


@_op.register_fake("moe_permute_backward")
def _(dxs, top_k_index, row_index, num_experts):
    _op.check_devices("moe_permute_backward", "dxs", dxs, top_k_index=top_k_index,
                      row_index=row_index)
    return dxs.new_empty(top_k_index.shape[0], dxs.shape[-1])


EXPORT_DECOMPOSITIONS = {"moe_permute": reference}  # ONNX export writes the unfused formula
DECOMPOSITIONS = {}  # Inductor keeps the sort and gather whole: data-dependent rows


def bench_routing(tokens: int, num_experts: int, top_k: int, device, dtype=torch.float32):
    """top_k distinct experts per token from random router logits, and their softmax weights."""
    logits = torch.randn(tokens, num_experts, device=device)
    weights, index = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """shape: (tokens, hidden, num_experts, top_k). Bytes: the forward reads x and writes
    tokens * top_k rows; the backward reads those rows' gradients and writes dx."""
    tokens, hidden, experts, top_k = shape
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    index, _ = bench_routing(tokens, experts, top_k, device)
    rows = tokens * hidden * x.element_size()
    moved = rows + top_k * rows
    return Case(lambda: moe_permute(x, index, experts)[0],
                lambda: transformers_permute(x, index, experts)[0], [x],
                {"fwd": moved, "fwd+bwd": 2 * moved})


def transformers_permute(x, top_k_index, num_experts):
    """What transformers' grouped_mm experts run for the permutation (the bench's eager row):
    sort, gather, histogram and cumulative sum."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    counts = torch.histc(expert_ids.int() if x.is_cuda else expert_ids.float(), bins=num_experts,
                         min=0, max=num_experts - 1)
    return x[perm // top_k_index.shape[1]], perm, torch.cumsum(counts, 0, dtype=torch.int32)
