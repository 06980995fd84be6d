"""Where the compiled parts come from: the source files and flags of the PyTorch extension and
of the TensorFlow op library, shared by setup.py and the just-in-time builds so the two can never
disagree. Imports no framework."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# -fvisibility=hidden keeps csrc's symbols private to each library that compiles it in.
# -fno-trapping-math / -fno-math-errno change no result (no FP traps are enabled and errno is
# never read); without them GCC will not turn the kernels' float selects into vector blends.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno"]
NVCC_FLAGS = ["-O3", "-std=c++17"]
CUDA_DEFINE = "-DFUSEDLAYERS_WITH_CUDA"
CUDA_LIBRARIES = ["cublasLt"]
# Ampere and Hopper, when TORCH_CUDA_ARCH_LIST is unset (a GPU-less host cannot detect one).
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def torch_sources(root: Path = ROOT, cuda: bool = False) -> list[Path]:
    """The csrc kernels and the torch binding, compiled together into one library."""
    cu = [*root.glob("csrc/*.cu")] if cuda else []
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/torch/*.cpp"), *cu])


def use_cuda(torch_cuda_version: str | None, cuda_home: str | None, env) -> tuple[bool, str]:
    """Whether to build the CUDA kernels into the torch extension, and why (one line).

    Decided from the installed torch and toolkit, not from a visible GPU, so GPU-less build
    hosts build CUDA too; FORCE_CUDA=1 and USE_CUDA=0 override.
    """
    if env.get("USE_CUDA") == "0":
        return False, "USE_CUDA=0"
    if env.get("FORCE_CUDA") == "1":
        return True, "FORCE_CUDA=1"
    if torch_cuda_version is None:
        return False, "torch is a CPU-only build"
    if cuda_home is None:
        return False, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return True, f"torch CUDA {torch_cuda_version}, toolkit at {cuda_home}"


def tensorflow_sources(root: Path = ROOT) -> list[Path]:
    """The same csrc kernels and the TensorFlow binding, compiled into the TF op library."""
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/tensorflow/*.cc")])
