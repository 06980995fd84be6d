"""Where the compiled parts come from: the source files and flags of the PyTorch extension and
of the TensorFlow op library, shared by setup.py and the just-in-time builds so the two can never
disagree; the command that builds them and the error raised when one is missing. Imports no
framework."""

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_COMMAND = "pip install --no-build-isolation -e ."


class NotBuiltError(RuntimeError):
    """A fusedlayers library (the PyTorch extension or the TensorFlow op library) is missing,
    fails to build (FUSEDLAYERS_JIT=1) or does not load; the message says which and how to build
    it."""

# -fvisibility=hidden keeps csrc's symbols private to each library that compiles it in.
# -fno-trapping-math / -fno-math-errno change no result (no FP traps are enabled and errno is
# never read); without them GCC will not turn the kernels' float selects into vector blends.
# -Wno-psabi: csrc/cpu_vec.h's 64-byte float vectors only cross inlined calls, so GCC's note that
# their ABI differs with and without AVX-512 concerns no function of the libraries.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi"]
NVCC_FLAGS = ["-O3", "-std=c++17"]


def torch_openmp_flags(openmp: bool) -> list[str]:
    """Compile and link flags for the torch extension's host code. at::parallel_for is an inline
    template that only parallelizes where _OPENMP is defined (ATen/ParallelOpenMP.h), so with an
    OpenMP torch the csrc CPU kernels would run on one thread without -fopenmp. Linking libgomp
    by soname binds to the copy torch has already loaded: one thread pool, torch.set_num_threads
    applies."""
    return ["-fopenmp"] if openmp else []
CUDA_DEFINE = "-DFUSEDLAYERS_WITH_CUDA"
CUDA_LIBRARIES = ["cublasLt"]
# Ampere and Hopper, when TORCH_CUDA_ARCH_LIST is unset (a GPU-less host cannot detect one).
DEFAULT_CUDA_ARCHS = "8.0;9.0"
# Kernels that call cuBLASLt: only the torch extension has them (TF's linear_gelu runs TF's matmul
# and csrc's bias+GELU epilogue), so the TF op library needs no cuBLAS.
CUBLASLT_SOURCES = {"linear_gelu_cuda.cu"}


def torch_sources(root: Path = ROOT, cuda: bool = False) -> list[Path]:
    """The csrc kernels and the torch binding, compiled together into one library."""
    cu = [*root.glob("csrc/*.cu")] if cuda else []
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/torch/*.cpp"), *cu])


def use_cuda(framework: str, cuda_version: str | None, cuda_home: str | None,
             env) -> tuple[bool, str]:
    """Whether to build the CUDA kernels into `framework`'s library, and why (one line).

    Decided from the installed framework and toolkit, not from a visible GPU, so GPU-less build
    hosts build CUDA too; FORCE_CUDA=1 and USE_CUDA=0 override.
    """
    if env.get("USE_CUDA") == "0":
        return False, "USE_CUDA=0"
    if env.get("FORCE_CUDA") == "1":
        return True, "FORCE_CUDA=1"
    if cuda_version is None:
        return False, f"{framework} is a CPU-only build"
    if cuda_home is None:
        return False, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return True, f"{framework} CUDA {cuda_version}, toolkit at {cuda_home}"


def find_cuda_home(env=os.environ) -> str | None:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, the toolkit of the nvcc on PATH, or
    /usr/local/cuda; a toolkit is a directory with bin/nvcc and include/cuda_runtime.h."""
    def toolkit(home):
        return home is not None and (Path(home) / "bin/nvcc").exists() and \
            (Path(home) / "include/cuda_runtime.h").exists()

    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH")):
        if home:
            return home
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    # nvcc on PATH may be a symlink or a wrapper script: the toolkit is where it resolves.
    if nvcc and toolkit(home := str(Path(nvcc).resolve().parent.parent)):
        return home
    return "/usr/local/cuda" if toolkit("/usr/local/cuda") else None


def gencode_flags(arch_list: str) -> list[str]:
    """nvcc -gencode flags for a TORCH_CUDA_ARCH_LIST-style list such as "8.0;9.0+PTX"."""
    flags = []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        sm = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return flags


def tensorflow_sources(root: Path = ROOT, cuda: bool = False) -> list[Path]:
    """The same csrc kernels and the TensorFlow binding, compiled into the TF op library."""
    cu = [p for p in root.glob("csrc/*.cu") if p.name not in CUBLASLT_SOURCES] if cuda else []
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/tensorflow/*.cc"), *cu])
