"""The unfused references, by op name (`reference.layer_norm(...)`): each op's `reference` in its
torch module, the computation in stock torch ops that the fused op must match. Used by the tests,
the examples and the bench; never by the fused path."""

from .. import ops


def __getattr__(name: str):
    if name not in ops.NAMES:
        raise AttributeError(f"fusedlayers.torch.reference has no {name!r}: the ops are "
                             f"{', '.join(ops.NAMES)}")
    return ops.module(name, "torch").reference


def __dir__():
    return list(ops.NAMES)
