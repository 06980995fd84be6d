"""Where the compiled parts come from: the source files and flags of the PyTorch extension and
of the TensorFlow op library, shared by setup.py and the just-in-time builds so the two can never
disagree, and the command that builds them. Imports no framework."""

import concurrent.futures
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from .errors import NotBuiltError

ROOT = Path(__file__).resolve().parent.parent
BUILD_COMMAND = "pip install --no-build-isolation -e ."
# csrc's headers are included by their path from csrc (norm/norm.h), a binding's own by its path
# from the checkout (backends/torch/torch_binding.h).
INCLUDE_DIRS = (str(ROOT), str(ROOT / "csrc"))


# -fvisibility=hidden keeps csrc's symbols private to each library that compiles it in.
# -fno-trapping-math / -fno-math-errno change no result (no FP traps are enabled and errno is
# never read); without them GCC will not turn the kernels' float selects into vector blends.
# -Wno-psabi: csrc/util/cpu_vec.h's 64-byte float vectors only cross inlined calls, so GCC's note that
# their ABI differs with and without AVX-512 concerns no function of the libraries.
# -g0: no debug information, which Python's own CFLAGS (-g) pass to the torch extension's
# compiles: it takes a third of a binding's compile time and most of its object's size.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi",
             "-g0"]
# -warn-spills: ptxas says which kernels spill registers (output shown where a build prints it).
NVCC_FLAGS = ["-O3", "-std=c++17", "-Xptxas", "-warn-spills"]
# Where csrc's objects are kept, by the hash of their command, compiler, source and csrc's
# headers (default: build/objects in the checkout): every library of a build, and every later
# build of the same sources and flags, takes them from there instead of compiling them again.
OBJECT_CACHE = "FUSEDLAYERS_OBJECT_CACHE"
# The C++ standard library ABI csrc is compiled for where no framework names one (jaxlib's FFI
# is C across the boundary): GCC's default.
DEFAULT_CXX11_ABI = 1


def torch_openmp_flags(openmp: bool) -> list[str]:
    """Compile and link flags for the torch extension's host code. at::parallel_for is an inline
    template that only parallelizes where _OPENMP is defined (ATen/ParallelOpenMP.h), so with an
    OpenMP torch the csrc CPU kernels would run on one thread without -fopenmp. Linking libgomp
    by soname binds to the copy torch has already loaded: one thread pool, torch.set_num_threads
    applies."""
    return ["-fopenmp"] if openmp else []
CUDA_DEFINE = "-DFUSEDLAYERS_WITH_CUDA"
# A tuple: CUDAExtension appends torch's own libraries to the list it is given.
CUDA_LIBRARIES = ("cublasLt",)
# Ampere and Hopper, when TORCH_CUDA_ARCH_LIST is unset (a GPU-less host cannot detect one).
DEFAULT_CUDA_ARCHS = "8.0;9.0"
# csrc's cuBLASLt GEMMs, the whole linear_gelu op (its passes call the framework's GEMMs on the
# CPU and cuBLASLt on CUDA), the FP8 GEMM op and the XLA handlers on them (fp8_gemm's,
# linear_gelu's, linear_cross_entropy's whole chunk loop): the torch extension and the JAX library
# have them. TF runs its own matmuls around csrc's passes, so the TF op library needs no cuBLAS.
GEMM_SOURCES = {"cublaslt_cuda.cu", "linear_gelu_op.cpp", "linear_gelu_cuda.cu",
                "fp8_gemm_op.cpp", "fp8_gemm_cuda.cu", "fp8_gemm_ffi.cc",
                "linear_gelu_cublaslt_ffi.cc", "linear_cross_entropy_cublaslt_ffi.cc"}
# The XLA handlers that exist for CUDA alone (the JAX library's CUDA build).
CUDA_HANDLERS = {"linear_gelu_cublaslt_ffi.cc", "linear_cross_entropy_cublaslt_ffi.cc"}
# The grouped GEMM's Hopper kernels (CUTLASS's sm90 ptr-array grouped GEMM): compiled for sm_90a
# alone (wgmma, TMA), with CUTLASS's headers, where the archs include 9.0 and the headers are
# found (sm90_build); every object of that build gets SM90_DEFINE. -DNDEBUG: CUTLASS's device
# asserts are calls that make ptxas serialize the wgmma pipeline.
SM90_GLOB = "csrc/**/*_sm90_*.cu"
SM90_DEFINE = "-DFUSEDLAYERS_WITH_CUTLASS_SM90"
SM90_NVCC_FLAGS = ["-DNDEBUG", "--expt-relaxed-constexpr"]
CUTLASS_PACKAGE = "nvidia-cutlass==4.2.0.0"  # its cutlass_library/source holds the headers


def cutlass_include(env=os.environ) -> list[str] | None:
    """CUTLASS's header folders: those of the checkout at $CUTLASS_PATH, else of the installed
    nvidia-cutlass package (CUTLASS_PACKAGE); None where neither is found."""
    root = env.get("CUTLASS_PATH")
    if not root:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = str(Path(next(iter(spec.submodule_search_locations))) / "source")
    folders = [str(Path(root) / "include"), str(Path(root) / "tools/util/include")]
    return folders if (Path(folders[0]) / "cutlass/cutlass.h").exists() else None


def has_hopper(archs: str) -> bool:
    """Whether a TORCH_CUDA_ARCH_LIST-style list has 9.0 (9.0a, 9.0+PTX)."""
    return any(a.removesuffix("+PTX").rstrip("a") == "9.0"
               for a in archs.replace(",", ";").replace(" ", ";").split(";"))


def sm90_build(archs: str, env=os.environ) -> tuple[bool, str]:
    """Whether a CUDA build for the TORCH_CUDA_ARCH_LIST-style `archs` compiles the Hopper
    grouped GEMM (SM90_GLOB), and why (one line)."""
    if not has_hopper(archs):
        return False, f"the archs {archs!r} have no 9.0"
    include = cutlass_include(env)
    if include is None:
        return False, (f"CUTLASS's headers not found (pip install --no-deps {CUTLASS_PACKAGE}, "
                       f"or set CUTLASS_PATH to a CUTLASS checkout)")
    return True, f"CUTLASS's headers at {include[0]}"


def sm90_wanted(cuda: bool) -> bool:
    """Whether a TF or JAX library built with `cuda` for $TORCH_CUDA_ARCH_LIST (default
    DEFAULT_CUDA_ARCHS) takes the Hopper kernels."""
    return cuda and sm90_build(os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS))[0]


def is_sm90(src: Path) -> bool:
    return src.match(SM90_GLOB.split("/")[-1]) and "csrc" in src.parts


def cuda_sources(root: Path, sm90: bool) -> list[Path]:
    """csrc's CUDA kernels, the Hopper ones (is_sm90) only with `sm90`."""
    return [p for p in root.glob("csrc/**/*.cu") if sm90 or not is_sm90(p)]


def csrc_sources(root: Path = ROOT, cuda: bool = False, sm90: bool = False,
                 gemm: bool = True) -> list[Path]:
    """What csrc_archive compiles: csrc's C++ sources and, with `cuda`, its CUDA kernels (the
    Hopper ones only with `sm90`); the cuBLASLt sources (GEMM_SOURCES) only with `gemm`."""
    cu = cuda_sources(root, sm90) if cuda else []
    return sorted(p for p in [*root.glob("csrc/**/*.cpp"), *cu]
                  if gemm or p.name not in GEMM_SOURCES)


def sm90_nvcc_command(cuda_home: str) -> list[str]:
    """nvcc's command for the Hopper kernels (before -c SOURCE -o OBJECT)."""
    return [*nvcc_command(cuda_home, "", cutlass_include() or []), *SM90_NVCC_FLAGS,
            "-gencode=arch=compute_90a,code=sm_90a"]


def torch_sources(root: Path = ROOT) -> list[Path]:
    """The torch binding's sources, compiled into the extension beside csrc_archive's."""
    return sorted(root.glob("backends/torch/*.cpp"))


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
    """nvcc -gencode flags for a TORCH_CUDA_ARCH_LIST-style list such as "8.0;9.0+PTX"; an entry
    "compute_80" (nvcc's name of a virtual arch) is PTX alone: compiled and checked by nvcc's
    front end for that arch, without ptxas' machine code."""
    flags = []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        if arch.startswith("compute_"):
            flags.append(f"-gencode=arch={arch},code={arch}")
            continue
        sm = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return flags


def tensorflow_sources(root: Path = ROOT) -> list[Path]:
    """The TensorFlow binding and, for its XLA kernels' custom calls, the XLA FFI handlers
    (but the cuBLASLt ones: GEMM_SOURCES), compiled into the TF op library beside
    csrc_archive's."""
    return sorted([*root.glob("backends/tensorflow/*.cc"),
                   *(p for p in root.glob("backends/xla/*.cc") if p.name not in GEMM_SOURCES)])


def xla_sources(root: Path = ROOT, cuda: bool = False) -> list[Path]:
    """The XLA FFI handlers of the JAX library (the CUDA-only ones, CUDA_HANDLERS, with `cuda`)."""
    return sorted(p for p in root.glob("backends/xla/*.cc")
                  if cuda or p.name not in CUDA_HANDLERS)


def build_library(output: Path, sources: list[Path], cflags: list[str], ldflags: list[str],
                  cuda: bool, verbose: bool = False, key: str = "",
                  archive: Path | None = None, pch_headers: tuple[str, ...] = (),
                  pch_folder: str = "") -> bool:
    """Compiles the binding's `sources` in parallel with g++ (the framework headers
    `pch_headers`, which the sources in folders named `pch_folder` parse, precompiled for the
    build where that pays: precompiled_header, precompiling_pays) and links the shared library
    `output` with csrc's `archive` (csrc_archive). With `cuda`, the toolkit's CUDA runtime,
    linked statically with its symbols kept private (-Wl,--exclude-libs): a framework's own CUDA
    runtime symbols, of its CUDA version, cannot bind ours. Skipped when `output` was built from
    the same sources, flags, archive and `key` (the framework's version): False then, True when
    built. Raises NotBuiltError with the failing command."""
    if not sources:
        raise NotBuiltError(f"fusedlayers: no sources to build {output.name} under {ROOT}")
    digest = sources_digest(repr((key, cflags, ldflags, cuda, archive and archive.name)), sources)
    if up_to_date(output, digest):
        print(f"fusedlayers: {output.name} is up to date (built from these sources and flags)")
        return False
    cflags = ["-O3", "-fPIC", *CXX_FLAGS, *(f"-I{d}" for d in INCLUDE_DIRS), *cflags,
              *([CUDA_DEFINE] if cuda else [])]
    if cuda:
        cuda_home = find_cuda_home()
        if cuda_home is None:
            raise NotBuiltError("fusedlayers: CUDA requested but no toolkit found; set CUDA_HOME")
        libdir = next((d for d in (Path(cuda_home) / "lib64",
                                   Path(cuda_home) / "targets/x86_64-linux/lib")
                       if (d / "libcudart_static.a").exists()), Path(cuda_home) / "lib64")
        ldflags = [*ldflags, f"-L{libdir}", "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread",
                   "-Wl,--exclude-libs,ALL"]
    output.parent.mkdir(parents=True, exist_ok=True)
    plain = ["g++", *cflags]
    with_pch, gch = plain, None
    if pch_headers:  # precompiled for the sources not in the object cache, removed after them
        flags, gch = precompiled_header(plain, pch_headers, key)
        with_pch = [*plain, *flags]
        if precompiling_pays(sum(src.parent.name == pch_folder and
                                 not cached_object(with_pch, src, key).exists()
                                 for src in sources)):
            precompile(plain, flags, gch, verbose)
    try:
        objects = _parallel(lambda src: compile_cached(
            with_pch if src.parent.name == pch_folder else plain, src, verbose, key), sources)
    finally:
        if gch is not None:
            gch.unlink(missing_ok=True)  # about 1 GB for TensorFlow's headers
    # the archive after the objects that call into it, before the libraries it calls
    _run(["g++", "-shared", "-o", str(output), *map(str, objects),
          *([str(archive)] if archive else []), *ldflags], verbose)
    record_build(output, digest)
    return True


def csrc_archive(cuda: bool, sm90: bool, gemm: bool, abi: int, archs: str = "",
                 gemm_include=(), verbose: bool = False) -> Path:
    """csrc compiled once into a static archive that every framework's library links: its C++
    sources with g++ and, with `cuda`, its CUDA kernels with nvcc for the TORCH_CUDA_ARCH_LIST-
    style `archs` (the Hopper kernels, with `sm90`, for sm_90a with CUTLASS's headers); the
    cuBLASLt sources only with `gemm` (those with cuBLAS's headers from `gemm_include` where the
    toolkit has none). `abi`: the C++ library ABI (_GLIBCXX_USE_CXX11_ABI) of the framework that
    links it. A library takes from the archive the objects its binding calls into (the TF and
    JAX libraries none of the optimizer's, which only torch binds). Objects are hidden (-fvisibility=hidden: each library keeps a private copy of what
    it calls, which another library in the process cannot bind) and kept in the object cache
    (OBJECT_CACHE), so the libraries of one build, and later builds, compile each once. Returns
    the archive's path, named by the hash of its objects; raises NotBuiltError with the failing
    command."""
    abi_flag = f"-D_GLIBCXX_USE_CXX11_ABI={abi}"
    defines = [*([CUDA_DEFINE] if cuda else []), *([SM90_DEFINE] if sm90 else [])]
    cxx = ["g++", "-O3", "-fPIC", *CXX_FLAGS, "-std=c++17", *(f"-I{d}" for d in INCLUDE_DIRS),
           abi_flag, *defines]
    nvcc = nvcc_sm90 = []
    if cuda:
        cuda_home = find_cuda_home()
        if cuda_home is None:
            raise NotBuiltError("fusedlayers: CUDA requested but no toolkit found; set CUDA_HOME")
        host = ["-Xcompiler", abi_flag, *([SM90_DEFINE] if sm90 else [])]
        nvcc = [*nvcc_command(cuda_home, archs), *host]
        nvcc_sm90 = [*sm90_nvcc_command(cuda_home), *host]

    def command(src: Path) -> list[str]:
        if src.suffix != ".cu":
            return cxx
        if is_sm90(src):
            return nvcc_sm90
        return [*nvcc, *(f"-I{d}" for d in gemm_include)] if src.name in GEMM_SOURCES else nvcc

    # the longest compiles first, so that none starts last and runs alone: the Hopper kernels,
    # then the CUDA kernels, larger sources (more instantiations) first, then the C++ sources
    sources = sorted(csrc_sources(ROOT, cuda, sm90, gemm),
                     key=lambda p: (not is_sm90(p), p.suffix != ".cu", -p.stat().st_size))
    objects = _parallel(lambda src: compile_cached(command(src), src, verbose), sources)
    name = hashlib.sha256(" ".join(o.name for o in objects).encode()).hexdigest()[:24]
    archive = object_cache() / f"libfusedlayers_csrc_{name}.a"
    if not archive.exists():
        tmp = archive.with_suffix(f".{os.getpid()}.tmp")
        _run(["ar", "rcs", str(tmp), *map(str, objects)], verbose)
        tmp.replace(archive)  # atomic: a concurrent build sees a whole archive or none
    return archive


def object_cache() -> Path:
    cache = Path(os.environ.get(OBJECT_CACHE) or ROOT / "build" / "objects")
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def cached_object(command: list[str], src: Path, key: str = "") -> Path:
    """Where compile_cached keeps the object of `command` -c src (which may not exist yet)."""
    digest = hashlib.sha256(repr((command, key, _compiler_version(command[0]),
                                  _compiler_version("g++"))).encode())
    for path in [src, *sorted(included_headers(src))]:
        digest.update(path.read_bytes())
    return object_cache() / f"{src.stem}_{digest.hexdigest()[:24]}.o"


def compile_cached(command: list[str], src: Path, verbose: bool = False, key: str = "") -> Path:
    """The object of `command` -c src, compiled once: kept in the object cache by the hash of
    the command, the compilers' versions, `key` (a framework's version, whose headers the
    command reads), the source and the project's headers it includes (quoted includes, followed
    through: a new kernel's header leaves the others' objects valid)."""
    obj = cached_object(command, src, key)
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        printed = _run([*command, "-c", str(src), "-o", str(tmp)], verbose)
        if printed and src.suffix == ".cu":  # ptxas' spill report, where a kernel spills
            print(f"{src.name}:\n{printed}".rstrip())
        tmp.replace(obj)  # atomic: a concurrent build sees a whole object or none
    return obj


def precompiled_header(command: list[str], headers: tuple[str, ...], key: str = ""
                       ) -> tuple[list[str], Path]:
    """(flags, gch): flags that make g++ `command` read `headers` (a framework's, whose parse is
    most of a binding source's compile) first, ["-include", header, "-Winvalid-pch"], from a
    header file in the object cache named by this command, compiler and `key`; gch: where its
    precompiled form goes (precompile). GCC takes the .gch where it exists and the command
    matches the one that built it, and otherwise parses the header (-Winvalid-pch says so)."""
    text = "".join(f'#include "{h}"\n' for h in headers)
    digest = hashlib.sha256(repr((command, key, text, _compiler_version(command[0]))).encode())
    folder = object_cache() / f"pch_{digest.hexdigest()[:24]}"
    header = folder / "framework.h"
    if not header.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"framework.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(header)  # atomic: a concurrent build sees the whole text or none
    return ["-include", str(header), "-Winvalid-pch"], folder / "framework.h.gch"


def jobs() -> int:
    """How many compiles a build runs at once: $MAX_JOBS (as torch's build reads it), else one
    per CPU."""
    return int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))


def precompiling_pays(sources: int) -> bool:
    """Whether a framework's precompiled header pays for itself in a build that compiles
    `sources` sources reading it: its own compile takes about two sources' and runs before them,
    then each takes under half its time. Where every job has four or more to compile; where
    each has fewer, the header only delays them (a machine with a core per source)."""
    return sources >= 4 * jobs()


def precompile(command: list[str], flags: list[str], gch: Path, verbose: bool = False) -> None:
    """Compiles precompiled_header's header (flags[1]) with `command` into `gch`."""
    tmp = gch.with_suffix(f".{os.getpid()}.tmp")
    _run([*command, "-x", "c++-header", flags[1], "-o", str(tmp)], verbose)
    tmp.replace(gch)


def included_headers(src: Path) -> set[Path]:
    """The project's headers that src includes, directly or through another: its quoted
    includes resolved as the compiler does (the including file's folder, then INCLUDE_DIRS);
    others (the frameworks', CUDA's) are left to the command's key."""
    found, todo = set(), [src]
    while todo:
        current = todo.pop()
        for name in _INCLUDE.findall(current.read_text()):
            path = next((d / name for d in (current.parent, *map(Path, INCLUDE_DIRS))
                         if (d / name).is_file()), None)
            if path is not None and path.resolve() not in found:
                found.add(path.resolve())
                todo.append(path)
    return found


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


@functools.cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _run(cmd: list[str], verbose: bool = False) -> str:
    """Runs a build command; its stderr (compiler output: printed only where asked or on
    failure, as framework headers warn a lot). Raises NotBuiltError with the command."""
    if verbose:
        print(" ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NotBuiltError(f"fusedlayers: `{' '.join(cmd)}` failed:\n{done.stderr}")
    if verbose and done.stderr:
        print(done.stderr)
    return done.stderr


def _parallel(fn, items: list) -> list:
    with concurrent.futures.ThreadPoolExecutor(jobs()) as pool:
        return list(pool.map(fn, items))


def nvcc_command(cuda_home: str, archs: str, include=()) -> list[str]:
    """nvcc's command for csrc's CUDA kernels (before -c SOURCE -o OBJECT), for the archs of a
    TORCH_CUDA_ARCH_LIST-style list; `include`: more header folders."""
    return [f"{cuda_home}/bin/nvcc", *NVCC_FLAGS, *(f"-I{d}" for d in [*INCLUDE_DIRS, *include]),
            CUDA_DEFINE, *gencode_flags(archs), "-Xcompiler", "-fPIC,-fvisibility=hidden"]


def sources_digest(key: str, sources) -> str:
    """sha256 of `key` (versions, flags) and of every source and header a library compiles."""
    digest = hashlib.sha256(key.encode())
    for src in sorted({*map(Path, sources), *ROOT.glob("csrc/**/*.h"),
                       *ROOT.glob("csrc/**/*.cuh"), *ROOT.glob("backends/*/*.h")}):
        digest.update(src.read_bytes())
    return digest.hexdigest()


def up_to_date(output: Path, digest: str) -> bool:
    """Whether `output` was built from the sources and flags of `digest` (its .sha256 file,
    written by record_build)."""
    stamp = output.with_name(output.name + ".sha256")
    return output.exists() and stamp.exists() and stamp.read_text() == digest


def record_build(output: Path, digest: str) -> None:
    output.with_name(output.name + ".sha256").write_text(digest)


def jit_library(name: str, key: str, sources: list[Path], build) -> Path:
    """The library `name` for FUSEDLAYERS_JIT=1: cached under ~/.cache/fusedlayers (or
    $FUSEDLAYERS_CACHE) by the hash of `key` and of every source and header; build(path) makes
    it when missing."""
    cache = Path(os.environ.get("FUSEDLAYERS_CACHE", Path.home() / ".cache" / "fusedlayers"))
    path = cache / f"{name}_{sources_digest(key, sources)[:16]}.so"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        build(tmp)
        tmp.replace(path)  # atomic: a concurrent process sees a whole library or none
    return path
