"""Builds and loads the JAX library `fusedlayers/_jax_ops.so`: the csrc kernels and the XLA FFI
handlers of backends/xla, compiled against jaxlib's own FFI headers (jax.ffi.include_dir(), whose
API version is jaxlib's), and registers each handler with XLA as the custom-call target
fusedlayers_<op>_<pass> of its platform. setup.py calls build(); with FUSEDLAYERS_JIT=1, load()
builds into a cache on first use.

With CUDA (a jax CUDA plugin and nvcc, or FORCE_CUDA=1) the csrc CUDA kernels and the CUDA
handlers are compiled in; their CUDA runtime is linked statically, its symbols private, as in the
TensorFlow op library.
"""

import ctypes
import importlib.util
import os
from pathlib import Path

from .. import _sources, ops
from .._sources import BUILD_COMMAND
from ..errors import NotBuiltError

LIBRARY = Path(__file__).resolve().parent.parent / "_jax_ops.so"
PASSES = ("forward", "backward")
PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}  # symbol suffix -> XLA platform
# The handlers' custom-call targets are fusedlayers_<target> (linear_gelu_gemm_* and
# linear_cross_entropy_gemm: CUDA builds). linear_cross_entropy has its chunk loop's row pass and,
# on CUDA, the whole loop on cuBLASLt; moe_experts none (grouped_gemm's or XLA's ragged dots
# around moe_permute's and moe_unpermute's); the FP8 ops one each (not differentiable: the FP8
# linear layer's custom_vjp calls them).
TARGETS = (*(f"{op}_{pass_}" for op in ops.NAMES if op not in ("linear_cross_entropy",
                                                               "moe_experts")
             for pass_ in PASSES),
           *(f"linear_gelu_gemm_{pass_}" for pass_ in PASSES),
           "linear_cross_entropy_chunk", "linear_cross_entropy_gemm", "fp8_quantize", "fp8_gemm")


def cuda_build(env=os.environ) -> tuple[bool, str]:
    """Whether build() compiles the CUDA kernels in, and why (one line)."""
    plugin = next((p for p in ("jax_cuda13_plugin", "jax_cuda12_plugin")
                   if importlib.util.find_spec(p) is not None), None)
    version = plugin.removeprefix("jax_cuda").removesuffix("_plugin") if plugin else None
    return _sources.use_cuda("jax", version, _sources.find_cuda_home(env), env)


def build(output: Path, verbose: bool = False, cuda: bool | None = None) -> bool:
    """Compiles the sources (in parallel) and links the library at `output`; with the CUDA
    kernels and handlers when `cuda` (default: cuda_build())."""
    import jax

    if cuda is None:
        cuda, why = cuda_build()
        print(f"fusedlayers: {'building' if cuda else 'not building'} the JAX CUDA handlers "
              f"({why})")
    # With CUDA, also the cuBLASLt handlers, linked to the toolkit's cuBLASLt.
    libs = [f"-l{lib}" for lib in _sources.CUDA_LIBRARIES] if cuda else []
    if cuda:
        libdir = Path(_sources.find_cuda_home()) / "lib64"
        libs = [f"-L{libdir}", f"-Wl,-rpath,{libdir}", *libs]
    # csrc's GEMM ops (fp8_gemm's CPU reference; with CUDA, cuBLASLt's GEMMs) and, for Hopper,
    # the grouped GEMM's CUTLASS kernels
    archive = _sources.csrc_archive(cuda, _sources.sm90_wanted(cuda), gemm=True,
                                    abi=_sources.DEFAULT_CXX11_ABI, archs=_archs(),
                                    verbose=verbose)
    return _sources.build_library(output, _sources.xla_sources(cuda=cuda),
                                  [f"-I{jax.ffi.include_dir()}", "-std=c++17"], libs, cuda,
                                  verbose, key=f"jax {jax.__version__}", archive=archive)


def _archs() -> str:
    return os.environ.get("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCHS)


def _jit_library() -> Path:
    import jax

    cuda, _ = cuda_build()
    verbose = os.environ.get("FUSEDLAYERS_JIT_VERBOSE") == "1"
    sources = [*_sources.xla_sources(cuda=cuda),
               *_sources.csrc_sources(cuda=cuda, sm90=_sources.sm90_wanted(cuda), gemm=True)]
    return _sources.jit_library("jax_ops", f"{jax.__version__} cuda={cuda} {_archs()}", sources,
                                lambda path: build(path, verbose, cuda))


def load() -> ctypes.CDLL:
    """Loads the library and registers its handlers with XLA; raises NotBuiltError."""
    import jax

    if os.environ.get("FUSEDLAYERS_JIT") == "1":
        try:
            path = _jit_library()
        except (OSError, NotBuiltError) as e:
            raise NotBuiltError(
                f"fusedlayers: the just-in-time JAX build (FUSEDLAYERS_JIT=1) failed: {e}") from e
    else:
        path = LIBRARY
        if not path.exists():
            raise NotBuiltError(
                f"fusedlayers: the JAX library is not built ({path} is missing). Build it with "
                f"`{BUILD_COMMAND}` with jax installed, or set FUSEDLAYERS_JIT=1 to compile it "
                f"on first use.")
    try:
        lib = ctypes.CDLL(str(path))
        size = lib.fusedlayers_xla_workspace_size
        lib.fusedlayers_xla_linear_cross_entropy_chunk_rows  # noqa: B018 (of these sources)
    except (OSError, AttributeError) as e:  # AttributeError: built from other sources
        raise NotBuiltError(f"fusedlayers: the JAX library {path} does not load ({e}). Rebuild "
                            f"it with `{BUILD_COMMAND}`.") from e
    size.restype = ctypes.c_size_t
    size.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    for target in TARGETS:
        for suffix, platform in PLATFORMS.items():
            symbol = f"fusedlayers_xla_{target}_{suffix}"
            if not hasattr(lib, symbol):  # CUDA handlers only in CUDA builds
                continue
            jax.ffi.register_ffi_target(f"fusedlayers_{target}",
                                        jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform=platform)
    if hasattr(lib, "fusedlayers_xla_linear_gelu_gemm_workspace_size"):  # CUDA builds
        gemm = lib.fusedlayers_xla_linear_gelu_gemm_workspace_size
        gemm.restype = ctypes.c_size_t
        gemm.argtypes = [ctypes.c_bool, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lce = lib.fusedlayers_xla_linear_cross_entropy_gemm_workspace_size
        lce.restype = ctypes.c_size_t
        lce.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                        ctypes.c_bool, ctypes.c_bool]
    return lib
