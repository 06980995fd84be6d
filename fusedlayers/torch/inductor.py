"""How torch.compile's Inductor lowers the fusedlayers:: operators: into the unfused aten math.

An operator Inductor does not know runs as an extern kernel, a call from the compiled graph that
Inductor cannot fuse with its neighbours, and in a transformer that costs more than our kernels
save: the LayerNorm's input is a residual add (and dropout) and its output is cast for the next
GEMM, which Inductor folds into its own normalization kernel, and GELU's bias add folds into the
kernel around it; as extern kernels each of those becomes a pass over memory of its own, plus a
host call: a fused model compiled with our kernels as extern calls ran slower than the compiled
unfused model; with these decompositions it runs the same kernels as the compiled unfused model
(README.md has the measurements).

So under Inductor each operator decomposes into the unfused ops, written with aten ops and
returning exactly what the operator returns, for Inductor to fuse: each op's torch module holds
its own (`DECOMPOSITIONS`, by operator name), and this module registers those of every op of the
table (fusedlayers.ops). Eager mode, other backends (aot_eager, cudagraphs) and torch.export keep the
fused kernels: the decompositions live only in Inductor's table. Importing Inductor costs seconds,
so the table is filled when Inductor is first imported, not when fusedlayers is.
"""

import torch

from .. import ops
from .._import_hook import after_import

_TABLE_MODULE = "torch._inductor.decomposition"


def decompositions() -> dict:
    """Every op's decompositions, by operator name."""
    return {name: fn for op in ops.OPS
            for name, fn in ops.module(op, "torch").DECOMPOSITIONS.items()}


def register(table: dict) -> None:
    """Adds the decompositions to an Inductor decomposition table."""
    for name, fn in decompositions().items():
        table[getattr(torch.ops.fusedlayers, name).default] = fn


def _register_in_inductor(module) -> None:
    register(module.decompositions)
    module.fast_random_decomps.cache_clear()  # the table Inductor uses is a cached copy


def install() -> None:
    """Registers the decompositions with Inductor now, or when Inductor is imported."""
    after_import(_TABLE_MODULE, _register_in_inductor)
