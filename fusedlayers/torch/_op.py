"""What the torch op modules share: the extension, loaded once when fusedlayers.torch is first
imported (without it, importing still works and the first call raises fusedlayers.NotBuiltError,
naming the command that builds it), operator handles, fake-kernel registration and helpers."""

import torch

from ..errors import NotBuiltError
from . import _library

try:
    _library.load()
    LOAD_ERROR = None
except NotBuiltError as e:  # importing must not fail; the first call does
    LOAD_ERROR = str(e)


def handle(name: str):
    """The operator torch.ops.fusedlayers.<name>.default; without the extension, a callable that
    raises NotBuiltError."""
    if LOAD_ERROR is None:
        return getattr(torch.ops.fusedlayers, name).default

    def missing(*args, **kwargs):
        raise NotBuiltError(LOAD_ERROR)
    return missing


def register_fake(name: str):
    """torch.library.register_fake for fusedlayers::<name> (a no-op without the extension).
    Fake kernels return shapes, dtypes and (contiguous) strides exactly as the real kernels do."""
    if LOAD_ERROR is None:
        return torch.library.register_fake("fusedlayers::" + name)
    return lambda fn: fn


def check_devices(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """A tensor on another device (a meta tensor among CPU ones, say) makes the dispatcher run the
    fake kernel instead of the binding, whose check would not run: fake kernels repeat it."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"fusedlayers.{op}: {name} must be on the same device as {ref_name} "
                             f"({ref.device}), got {t.device}")


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the norms' mean/rstd for x (csrc/norm/norm.h)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dresidual_like(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The add+norm backward's dresidual result: like h, or empty where h has dy's dtype (dx is
    the gradient of both x and residual)."""
    return h.new_empty(0) if h.dtype == dy.dtype else h.new_empty(h.shape)


def dresidual_of(dres: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dresidual as the add+norm backward returns it: dres, or empty where it has dy's dtype."""
    return dres.new_empty(0) if dres.dtype == dy.dtype else dres


def add_norm_work(x: torch.Tensor) -> dict:
    """The fewest bytes an add+norm moves: the forward reads x and residual and writes y and h;
    the backward reads dy, dh and h and writes dx (the residual's gradient is the same tensor)."""
    n = x.numel() * x.element_size()
    return {"fwd": 4 * n, "fwd+bwd": 8 * n}
