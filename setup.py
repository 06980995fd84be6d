"""Builds fusedlayers: the PyTorch extension fusedlayers._C (csrc kernels + torch binding) and,
when tensorflow is importable, the TensorFlow op library fusedlayers/_tf_ops.so (the same csrc
kernels + the TF binding), and when jax is, the JAX library fusedlayers/_jax_ops.so (the same
csrc kernels + the XLA FFI handlers).

Install with `pip install --no-build-isolation -e .`: the libraries compile against the torch
and tensorflow already installed, which pip's isolated build environment would hide."""

import importlib
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from fusedlayers import __version__, _sources, quiet_tensorflow_logs  # noqa: E402  (no framework)

# Before TensorFlow loads (to build its library): its C++ start-up lines off, unless set.
quiet_tensorflow_logs()

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("fusedlayers: building needs torch installed first (pip install torch), then "
             "`pip install --no-build-isolation -e .` so the build can see it.")



class BuildWithFrameworks(BuildExtension):
    """Builds the torch extension, then next to it the TF op library when tensorflow is
    importable and the JAX library when jax is; a library already built from the same sources,
    flags and framework version is kept. What was built, and why anything was not, is printed
    and kept in fusedlayers/_build.txt, which `python -m fusedlayers info` shows (pip hides a
    build's output)."""

    def run(self):
        self.summary = []
        super().run()
        package_dir = Path(self.get_ext_fullpath("fusedlayers._C")).parent
        for framework in ("tensorflow", "jax"):
            try:
                __import__(framework)
            except ImportError as e:
                self.summary.append(f"{framework} library: not built: {framework} is not "
                                    f"importable ({e})")
                print(f"fusedlayers: {self.summary[-1]}")
                continue
            _library = importlib.import_module(f"fusedlayers.{framework}._library")
            cuda_kernels, cuda_why = _library.cuda_build()
            built = _library.build(package_dir / _library.LIBRARY.name, verbose=self.verbose > 1)
            self.summary.append(f"{framework} library: {_built(built)}, "
                                f"{'CPU and CUDA' if cuda_kernels else 'CPU'} kernels ({cuda_why})")
        text = "".join(f"{line}\n" for line in self.summary)
        (ROOT / "fusedlayers" / "_build.txt").write_text(text)
        print("fusedlayers build:\n" + text, end="")

    def build_extension(self, ext):
        # Built into a (for pip, temporary) build directory, then copied into the checkout:
        # the checkout's copy is the one that may already be up to date.
        target = Path(self.get_ext_fullpath(ext.name))
        in_tree = ROOT / "fusedlayers" / target.name
        # csrc, compiled once into the archive the TF and JAX libraries link too
        archive = _sources.csrc_archive(cuda, sm90, gemm=True,
                                        abi=int(torch._C._GLIBCXX_USE_CXX11_ABI),
                                        archs=os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
                                        verbose=self.verbose > 1)
        digest = _sources.sources_digest(
            repr((torch.__version__, cuda, os.environ.get("TORCH_CUDA_ARCH_LIST"),
                  ext.extra_compile_args, ext.extra_link_args, archive.name)),
            [ROOT / s for s in ext.sources])
        built = not _sources.up_to_date(in_tree, digest)
        if not built:
            print(f"fusedlayers: {target.name} is up to date (built from these sources and flags)")
            if target != in_tree:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(in_tree, target)
        else:
            ext.extra_objects = [str(archive)]
            super().build_extension(ext)
            _sources.record_build(in_tree, digest)
        self.summary.append(f"torch extension: {_built(built)}, "
                            f"{'CPU and CUDA' if cuda else 'CPU'} kernels ({why})")
        if cuda:
            self.summary.append(f"Hopper grouped GEMM: {'built' if sm90 else 'not built'} "
                                f"({sm90_why})")


def _built(built: bool) -> str:
    return "built" if built else "kept (up to date)"


cuda, why = _sources.use_cuda("torch", torch.version.cuda, CUDA_HOME, os.environ)
print(f"fusedlayers: {'building' if cuda else 'not building'} the CUDA kernels ({why})")
sources = [str(p.relative_to(ROOT)) for p in _sources.torch_sources(ROOT)]
openmp = _sources.torch_openmp_flags(torch.backends.openmp.is_available())
sm90, sm90_why = False, "no CUDA build"
if cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _sources.DEFAULT_CUDA_ARCHS)
    sm90, sm90_why = _sources.sm90_build(os.environ["TORCH_CUDA_ARCH_LIST"])
    print(f"fusedlayers: {'building' if sm90 else 'not building'} the Hopper grouped GEMM "
          f"({sm90_why})")
    extension = CUDAExtension(
        "fusedlayers._C", sources=sources, include_dirs=list(_sources.INCLUDE_DIRS),
        libraries=list(_sources.CUDA_LIBRARIES), extra_link_args=openmp,
        extra_compile_args=[*_sources.CXX_FLAGS, *openmp, _sources.CUDA_DEFINE])
else:
    extension = CppExtension("fusedlayers._C", sources=sources, include_dirs=list(_sources.INCLUDE_DIRS),
                             extra_compile_args=[*_sources.CXX_FLAGS, *openmp],
                             extra_link_args=openmp)

EXAMPLES_REQUIRE = ["scikit-learn", "einops", "matplotlib", "tqdm", "transformers"]

setup(
    name="fusedlayers",
    version=__version__,
    description="Fused ReLU*scale, Linear+GELU, LayerNorm and RMSNorm for PyTorch, TensorFlow "
                "and JAX",
    packages=find_packages(include=["fusedlayers", "fusedlayers.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildWithFrameworks},
    python_requires=">=3.10",
    extras_require={
        # The tests run the examples (distributed) and the bench's plots: they need theirs too.
        # ONNX export of fused models (onnxscript: torch's dynamo exporter; onnxruntime runs it).
        # Flax's NNX modules (pinned: a newer flax could pull a newer jax over the pinned one).
        "test": ["pytest", "pytest-xdist", "numpy", "expecttest", "onnx", "onnxscript", "onnxruntime",
                 "flax==0.12.8", *EXAMPLES_REQUIRE],
        "tensorflow": ["tensorflow-cpu==2.21.0"],
        "jax": ["jax"],
        "examples": EXAMPLES_REQUIRE,
    },
)
