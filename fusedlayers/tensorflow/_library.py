"""Builds and loads the TensorFlow op library `fusedlayers/_tf_ops.so`: the csrc kernels and the
TF binding compiled with TensorFlow's own flags (tf.sysconfig), C++17 last on the line as TF
2.21 needs, csrc symbols hidden so the torch extension in the same process cannot bind them.
setup.py calls build(); with FUSEDLAYERS_JIT=1, load() builds into a cache on first use.

With CUDA (a CUDA build of TensorFlow and nvcc, or FORCE_CUDA=1) the csrc CUDA kernels are
compiled in and registered as GPU kernels (GOOGLE_CUDA). They launch through a CUDA runtime linked
statically with its symbols kept private (--exclude-libs): TensorFlow exports CUDA runtime symbols
of its own CUDA version, which a dynamically linked libcudart would otherwise bind to. The
toolkit's runtime needs a driver that supports it (CUDA 13: driver 580 or newer).
"""

import os
from pathlib import Path

from .. import _sources
from .._sources import BUILD_COMMAND
from ..errors import NotBuiltError

LIBRARY = Path(__file__).resolve().parent.parent / "_tf_ops.so"
# What the bindings' headers (backends/tensorflow/tf_binding.h, xla_kernel.h) include from
# TensorFlow and XLA: most of each binding's compile, so parsed once, precompiled (for
# backends/tensorflow alone: the XLA FFI handlers the library also compiles read none of it).
PCH_HEADERS = ("tensorflow/core/framework/op.h", "tensorflow/core/framework/op_kernel.h",
               "tensorflow/core/framework/shape_inference.h", "tensorflow/core/framework/tensor.h",
               "tensorflow/compiler/tf2xla/xla_op_kernel.h",
               "tensorflow/compiler/tf2xla/xla_op_registry.h", "xla/hlo/builder/xla_builder.h",
               "xla/shape_util.h")
GPU_PCH_HEADERS = ("xla/stream_executor/stream.h",)  # tf_binding.h's with GOOGLE_CUDA


def cuda_build(env=os.environ) -> tuple[bool, str]:
    """Whether build() compiles the CUDA kernels in, and why (one line)."""
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    version = info.get("cuda_version") if info.get("is_cuda_build") else None
    return _sources.use_cuda("tensorflow", version, _sources.find_cuda_home(env), env)


def build(output: Path, verbose: bool = False, cuda: bool | None = None) -> bool:
    """Compiles the sources (in parallel) and links the op library at `output`; with the CUDA
    kernels when `cuda` (default: cuda_build())."""
    import tensorflow as tf

    if cuda is None:
        cuda, why = cuda_build()
        print(f"fusedlayers: {'building' if cuda else 'not building'} the TensorFlow GPU "
              f"kernels ({why})")
    include = Path(tf.sysconfig.get_include())
    # The XLA kernels' headers (tf2xla) include highwayhash and farmhash from TF's own copies;
    # FUSEDLAYERS_XLA_TF registers the XLA FFI handlers with TF's XLA. NDEBUG as TF's own release
    # build: its headers' debug checks call absl logging that TF 2.20 does not export.
    cflags = ["-Wno-deprecated-declarations", "-Wno-interference-size",
              *tf.sysconfig.get_compile_flags(), f"-I{include / 'external/highwayhash'}",
              f"-I{include / 'external/farmhash_archive/src'}", "-DFUSEDLAYERS_XLA_TF",
              "-std=c++17", "-DNDEBUG", *(["-DGOOGLE_CUDA=1"] if cuda else [])]
    archive = _sources.csrc_archive(cuda, _sources.sm90_wanted(cuda), gemm=False,
                                    abi=_cxx11_abi(tf.sysconfig.get_compile_flags()),
                                    archs=_archs(), verbose=verbose)
    return _sources.build_library(output, _sources.tensorflow_sources(), cflags,
                                  [*tf.sysconfig.get_link_flags(), "-l:libtensorflow_cc.so.2"],
                                  cuda, verbose, key=f"tensorflow {tf.__version__}",
                                  archive=archive,
                                  pch_headers=(*PCH_HEADERS, *(GPU_PCH_HEADERS if cuda else ())),
                                  pch_folder="tensorflow")


def _cxx11_abi(flags: list[str]) -> int:
    """The _GLIBCXX_USE_CXX11_ABI of TensorFlow's compile flags (GCC's default if unnamed)."""
    named = [f.split("=", 1)[1] for f in flags if f.startswith("-D_GLIBCXX_USE_CXX11_ABI=")]
    return int(named[-1]) if named else _sources.DEFAULT_CXX11_ABI


def _archs() -> str:
    return os.environ.get("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCHS)


def _jit_library() -> Path:
    """The op library built for these sources and this TensorFlow, cached by content hash."""
    import tensorflow as tf

    cuda, _ = cuda_build()
    verbose = os.environ.get("FUSEDLAYERS_JIT_VERBOSE") == "1"
    sources = [*_sources.tensorflow_sources(),
               *_sources.csrc_sources(cuda=cuda, sm90=_sources.sm90_wanted(cuda), gemm=False)]
    return _sources.jit_library("tf_ops", f"{tf.__version__} cuda={cuda} {_archs()}", sources,
                                lambda path: build(path, verbose, cuda))


def load():
    """(the loaded op library module (tf.load_op_library), its path), or raises NotBuiltError."""
    import tensorflow as tf

    if os.environ.get("FUSEDLAYERS_JIT") == "1":
        try:
            path = _jit_library()
        except (OSError, NotBuiltError) as e:
            raise NotBuiltError(
                f"fusedlayers: the just-in-time TensorFlow build (FUSEDLAYERS_JIT=1) failed: {e}"
            ) from e
    else:
        path = LIBRARY
        if not path.exists():
            raise NotBuiltError(
                f"fusedlayers: the TensorFlow op library is not built ({path} is missing). "
                f"Build it with `{BUILD_COMMAND}` with tensorflow installed, or set "
                f"FUSEDLAYERS_JIT=1 to compile it on first use.")
    try:
        return tf.load_op_library(str(path)), path
    except tf.errors.NotFoundError as e:
        raise NotBuiltError(
            f"fusedlayers: the TensorFlow op library {path} does not load with TensorFlow "
            f"{tf.__version__} ({e.message}). Rebuild it with `{BUILD_COMMAND}`.") from e
