"""Loads the compiled PyTorch extension `fusedlayers._C` into torch.ops, or, when
FUSEDLAYERS_JIT=1, compiles the same sources with torch.utils.cpp_extension.load (ninja, cached
under TORCH_EXTENSIONS_DIR) for kernel work without reinstalling. Failures raise NotBuiltError."""

import importlib.util
import os

import torch

from .. import _sources
from .._sources import BUILD_COMMAND
from ..errors import NotBuiltError


def _jit_build() -> None:
    from torch.utils import cpp_extension

    cuda, _ = _sources.use_cuda("torch", torch.version.cuda, cpp_extension.CUDA_HOME, os.environ)
    sources = _sources.torch_sources()
    if not sources:
        raise NotBuiltError(
            f"fusedlayers: FUSEDLAYERS_JIT=1 needs the source checkout, but no sources were found "
            f"under {_sources.ROOT}")
    openmp = _sources.torch_openmp_flags(torch.backends.openmp.is_available())
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCHS)
    sm90 = cuda and _sources.sm90_build(archs)[0]
    archive = _sources.csrc_archive(cuda, sm90, gemm=True,
                                    abi=int(torch._C._GLIBCXX_USE_CXX11_ABI), archs=archs)
    cpp_extension.load(
        name="fusedlayers_torch",
        sources=[str(p) for p in sources],
        extra_include_paths=list(_sources.INCLUDE_DIRS),
        extra_cflags=[*_sources.CXX_FLAGS, *openmp, *([_sources.CUDA_DEFINE] if cuda else [])],
        extra_ldflags=[str(archive), *openmp,
                       *([f"-l{lib}" for lib in _sources.CUDA_LIBRARIES] if cuda else [])],
        with_cuda=cuda,
        is_python_module=False,
        verbose=os.environ.get("FUSEDLAYERS_JIT_VERBOSE") == "1",
    )


def load() -> None:
    """Registers the fusedlayers:: operators with torch, or raises NotBuiltError saying why not."""
    if os.environ.get("FUSEDLAYERS_JIT") == "1":
        try:
            _jit_build()
        except Exception as e:  # a compiler error must reach the user as this error
            raise NotBuiltError(
                f"fusedlayers: the just-in-time build (FUSEDLAYERS_JIT=1) failed: {e}") from e
        return
    spec = importlib.util.find_spec("fusedlayers._C")
    if spec is None or spec.origin is None:
        raise NotBuiltError(
            f"fusedlayers: the PyTorch extension is not built. Build it with `{BUILD_COMMAND}` "
            f"in the fusedlayers checkout, or set FUSEDLAYERS_JIT=1 to compile it on first use.")
    try:
        torch.ops.load_library(spec.origin)
    except OSError as e:
        raise NotBuiltError(
            f"fusedlayers: the PyTorch extension at {spec.origin} does not load with torch "
            f"{torch.__version__} ({e}). Rebuild it with `{BUILD_COMMAND}`.") from e
