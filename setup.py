"""Builds fusedlayers with its PyTorch extension fusedlayers._C (csrc kernels + torch binding).

Install with `pip install --no-build-isolation -e .`: the extension compiles against the torch
already installed, which pip's isolated build environment would hide."""

import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from fusedlayers import __version__, _sources  # noqa: E402  (imports no framework)

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit("fusedlayers: building needs torch installed first (pip install torch), then "
             "`pip install --no-build-isolation -e .` so the build can see it.")

extension = CppExtension(
    "fusedlayers._C",
    sources=[str(p.relative_to(ROOT)) for p in _sources.torch_sources(ROOT)],
    include_dirs=[str(ROOT)],
    extra_compile_args=_sources.CXX_FLAGS,
)

setup(
    name="fusedlayers",
    version=__version__,
    description="Fused ReLU*scale, Linear+GELU and LayerNorm for PyTorch and TensorFlow",
    packages=find_packages(include=["fusedlayers", "fusedlayers.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
    extras_require={
        "test": ["pytest", "numpy", "expecttest"],
        "examples": ["scikit-learn", "einops", "matplotlib", "tqdm"],
    },
)
