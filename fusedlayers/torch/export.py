"""How a fused model exports to ONNX: `torch.onnx.export(model, args, dynamo=True)` writes each
fusedlayers:: operator a model calls as the standard ONNX ops of its unfused computation
(LayerNormalization, Gemm, Gelu, Relu, ...), so a model trained fused deploys without unfusing.

The exporter decomposes what it has no ONNX translation for with the decompositions of
`torch._decomp.decomposition_table`; this module puts there, for every op of the table
(fusedlayers.ops), the decomposition of the operator the op's functions and modules call
(its `DECOMPOSITIONS[name]`, the one Inductor lowers too): an exported program, traced without
autograd, holds no backward operators; an op that Inductor keeps whole (linear_cross_entropy)
gives its own `EXPORT_DECOMPOSITIONS`. torch.export itself keeps the fused operators (its own
decompositions do not read that table)."""

import torch

from .. import ops


def install() -> None:
    """Registers each op's operator decomposition in torch._decomp.decomposition_table."""
    for op in ops.OPS:
        module = ops.module(op, "torch")
        if getattr(module, "COMPOSITE", False):
            continue  # no operator of its own: the operators it calls are each decomposed
        decompose = {**module.DECOMPOSITIONS,
                     **getattr(module, "EXPORT_DECOMPOSITIONS", {})}[op.name]
        torch._decomp.decomposition_table[getattr(torch.ops.fusedlayers, op.name).default] = \
            decompose
