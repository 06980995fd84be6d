"""Where the compiled parts come from: the source files and flags of the PyTorch extension and
of the TensorFlow op library, shared by setup.py and the just-in-time builds so the two can never
disagree. Imports no framework."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# -fvisibility=hidden keeps csrc's symbols private to each library that compiles it in.
# -fno-trapping-math / -fno-math-errno change no result (no FP traps are enabled and errno is
# never read); without them GCC will not turn the kernels' float selects into vector blends.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno"]


def torch_sources(root: Path = ROOT) -> list[Path]:
    """The csrc kernels and the torch binding, compiled together into one library."""
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/torch/*.cpp")])


def tensorflow_sources(root: Path = ROOT) -> list[Path]:
    """The same csrc kernels and the TensorFlow binding, compiled into the TF op library."""
    return sorted([*root.glob("csrc/*.cpp"), *root.glob("backends/tensorflow/*.cc")])
