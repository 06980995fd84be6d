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

import concurrent.futures
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from .. import _sources
from .._sources import BUILD_COMMAND, NotBuiltError

LIBRARY = Path(__file__).resolve().parent.parent / "_tf_ops.so"


def cuda_build(env=os.environ) -> tuple[bool, str]:
    """Whether build() compiles the CUDA kernels in, and why (one line)."""
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    version = info.get("cuda_version") if info.get("is_cuda_build") else None
    return _sources.use_cuda("tensorflow", version, _sources.find_cuda_home(env), env)


def build(output: Path, verbose: bool = False, cuda: bool | None = None) -> None:
    """Compiles the sources (in parallel) and links the op library at `output`; with the CUDA
    kernels when `cuda` (default: cuda_build())."""
    import tensorflow as tf

    if cuda is None:
        cuda, why = cuda_build()
        print(f"fusedlayers: {'building' if cuda else 'not building'} the TensorFlow GPU "
              f"kernels ({why})")
    cflags = ["-O3", "-fPIC", "-Wno-deprecated-declarations", "-Wno-interference-size",
              *_sources.CXX_FLAGS, f"-I{_sources.ROOT}", *tf.sysconfig.get_compile_flags(),
              "-std=c++17"]
    ldflags = tf.sysconfig.get_link_flags()
    if cuda:
        cuda_home = _sources.find_cuda_home()
        if cuda_home is None:
            raise NotBuiltError("fusedlayers: CUDA requested but no toolkit found; "
                                         "set CUDA_HOME")
        cflags += ["-DGOOGLE_CUDA=1", _sources.CUDA_DEFINE]
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCHS)
        nvcc = [f"{cuda_home}/bin/nvcc", *_sources.NVCC_FLAGS, f"-I{_sources.ROOT}",
                *_sources.gencode_flags(archs), "-Xcompiler", "-fPIC,-fvisibility=hidden"]
        libdir = next((d for d in (Path(cuda_home) / "lib64",
                                   Path(cuda_home) / "targets/x86_64-linux/lib")
                       if (d / "libcudart_static.a").exists()), Path(cuda_home) / "lib64")
        ldflags = [*ldflags, f"-L{libdir}", "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread",
                   "-Wl,--exclude-libs,ALL"]
    sources = _sources.tensorflow_sources(cuda=cuda)
    if not sources:
        raise NotBuiltError(f"fusedlayers: no TensorFlow sources under {_sources.ROOT}")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        objects = [Path(tmp) / f"{i}_{src.stem}.o" for i, src in enumerate(sources)]

        def run(cmd):
            if verbose:
                print(" ".join(cmd))
            done = subprocess.run(cmd, capture_output=not verbose, text=True)
            if done.returncode != 0:  # TF's headers warn a lot: show the output only on failure
                raise NotBuiltError(f"fusedlayers: `{' '.join(cmd)}` failed:\n"
                                             f"{done.stderr or ''}")

        def compile_one(pair):
            src, obj = pair
            compiler = nvcc if src.suffix == ".cu" else ["g++", *cflags]
            run([*compiler, "-c", str(src), "-o", str(obj)])

        jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(compile_one, zip(sources, objects)))
        run(["g++", "-shared", "-o", str(output), *map(str, objects), *ldflags])


def _jit_library() -> Path:
    """The op library built for these sources and this TensorFlow, cached by content hash."""
    import tensorflow as tf

    cuda, _ = cuda_build()
    digest = hashlib.sha256(f"{tf.__version__} cuda={cuda}".encode())
    for src in sorted(_sources.tensorflow_sources(cuda=cuda) +
                      [*_sources.ROOT.glob("csrc/*.h"), *_sources.ROOT.glob("csrc/*.cuh"),
                       *_sources.ROOT.glob("backends/tensorflow/*.h")]):
        digest.update(src.read_bytes())
    cache = Path(os.environ.get("FUSEDLAYERS_CACHE", Path.home() / ".cache" / "fusedlayers"))
    path = cache / f"tf_ops_{digest.hexdigest()[:16]}.so"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        build(tmp, verbose=os.environ.get("FUSEDLAYERS_JIT_VERBOSE") == "1", cuda=cuda)
        tmp.replace(path)  # atomic: a concurrent process sees a whole library or none
    return path


def load():
    """The loaded op library module (tf.load_op_library), or raises NotBuiltError."""
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
        return tf.load_op_library(str(path))
    except tf.errors.NotFoundError as e:
        raise NotBuiltError(
            f"fusedlayers: the TensorFlow op library {path} does not load with TensorFlow "
            f"{tf.__version__} ({e.message}). Rebuild it with `{BUILD_COMMAND}`.") from e
