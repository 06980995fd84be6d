"""Packaging: `import fusedlayers` imports no framework; a missing or broken extension never
crashes an import and says which command builds it; the FUSEDLAYERS_JIT=1 path (slow: set
FUSEDLAYERS_TEST_JIT=1 to run it). Each check runs in a fresh interpreter."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fusedlayers

import _helpers as helpers

PACKAGE = Path(fusedlayers.__file__).resolve().parent
BUILD_COMMAND = "pip install --no-build-isolation -e ."


# An editable install (`pip install -e .`) adds a meta-path finder that maps fusedlayers.* to the
# checkout, so a copy's `fusedlayers._C` would still be found there. Drop such finders so the
# copy on PYTHONPATH is all there is, as in an environment where the package was never built.
ISOLATE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
"""

def run_python(code, cwd=None, env_extra=None, isolate=False):
    """_helpers.run_python on dedented `code`, after ISOLATE when isolate."""
    return helpers.run_python((ISOLATE if isolate else "") + textwrap.dedent(code), env_extra,
                              cwd=cwd)


def copy_package(dest: Path, *, with_sources=False) -> Path:
    """A copy of the Python package without any compiled library (and, unless asked, without
    csrc/ and backends/), importable by putting `dest` first on PYTHONPATH."""
    shutil.copytree(PACKAGE, dest / "fusedlayers",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    if with_sources:
        for d in ("csrc", "backends"):
            shutil.copytree(PACKAGE.parent / d, dest / d)
    return dest


def test_import_fusedlayers_imports_no_framework():
    out = run_python("""
        import sys
        import fusedlayers
        assert callable(fusedlayers.relu_scale) and fusedlayers.__version__
        loaded = sorted(m for m in ("torch", "tensorflow", "keras", "jax") if m in sys.modules)
        print("LOADED", loaded)
    """)
    assert "LOADED []" in out


def test_not_a_tensor_without_torch_imported():
    out = run_python("""
        import sys
        import fusedlayers
        try:
            fusedlayers.relu_scale([1.0, 2.0], 2.0)
        except TypeError as e:
            print("TypeError:", e)
        assert "torch" not in sys.modules
    """)
    assert "TypeError: fusedlayers.relu_scale: x must be a torch.Tensor" in out


MISSING_EXTENSION_CHECK = """
    import fusedlayers, sys
    assert fusedlayers.__file__.startswith({root!r}), fusedlayers.__file__  # the copy
    import fusedlayers.torch                       # must not raise
    from fusedlayers.torch import FusedReLUScale, LayerNorm, NotBuiltError
    assert NotBuiltError is fusedlayers.NotBuiltError  # one type for both frameworks
    import torch
    for call in (lambda: fusedlayers.relu_scale(torch.ones(2), 1.0),
                 lambda: fusedlayers.rms_norm(torch.ones(2, 3), 3),
                 lambda: fusedlayers.layer_norm(torch.ones(2, 3), 3),
                 lambda: fusedlayers.linear_gelu(torch.ones(2, 3), torch.ones(4, 3)),
                 lambda: LayerNorm(3)(torch.ones(2, 3)),
                 lambda: FusedReLUScale(2.0)(torch.ones(2))):
        try:
            call()
        except NotBuiltError as e:
            assert isinstance(e, RuntimeError)
            print("MESSAGE", e)
        else:
            raise AssertionError("no NotBuiltError")
"""


def test_missing_extension_says_how_to_build(tmp_path):
    root = copy_package(tmp_path)
    out = run_python(MISSING_EXTENSION_CHECK.format(root=str(root)), cwd=root,
                     env_extra={"PYTHONPATH": str(root)}, isolate=True)
    messages = [line for line in out.splitlines() if line.startswith("MESSAGE")]
    assert len(messages) == 6
    for m in messages:
        assert "not built" in m and BUILD_COMMAND in m and "FUSEDLAYERS_JIT=1" in m, m


def test_unloadable_extension_says_how_to_rebuild(tmp_path):
    root = copy_package(tmp_path)
    suffix = next(p.name.removeprefix("_C") for p in PACKAGE.glob("_C*.so"))
    (root / "fusedlayers" / f"_C{suffix}").write_bytes(b"not an ELF file")
    out = run_python(MISSING_EXTENSION_CHECK.format(root=str(root)), cwd=root,
                     env_extra={"PYTHONPATH": str(root)}, isolate=True)
    messages = [line for line in out.splitlines() if line.startswith("MESSAGE")]
    assert len(messages) == 6
    for m in messages:
        assert "does not load" in m and f"Rebuild it with `{BUILD_COMMAND}`" in m, m


def test_jit_without_sources_says_so(tmp_path):
    # FUSEDLAYERS_JIT=1 in an installed copy without csrc/: a clear error, not a crash.
    root = copy_package(tmp_path)
    out = run_python(MISSING_EXTENSION_CHECK.format(root=str(root)), cwd=root,
                     env_extra={"PYTHONPATH": str(root), "FUSEDLAYERS_JIT": "1"}, isolate=True)
    messages = [line for line in out.splitlines() if line.startswith("MESSAGE")]
    assert len(messages) == 6 and all("needs the source checkout" in m for m in messages)


C_SOURCES = ("*.h", "*.cuh", "*.cpp", "*.cc", "*.cu")


def _c_sources() -> list[Path]:
    root = PACKAGE.parent
    return sorted(p for d in ("csrc", "backends", "tests") for g in C_SOURCES
                  for p in (root / d).rglob(g))


def test_no_two_c_sources_share_a_name():
    # An #include "norm.h" must read one way, to a person and to tools: csrc's headers are
    # included by their path from csrc, and no file name repeats across folders.
    names = [p.name for p in _c_sources()]
    assert len(names) > 100, "the sources were not found"
    shared = sorted({n for n in names if names.count(n) > 1})
    assert not shared, f"file names in more than one folder: {shared}"


def test_csrc_includes_only_csrc():
    """The include graph: csrc's files include csrc's headers (by their path from csrc) and
    system or toolkit headers, never a binding's; every quoted include resolves."""
    root = PACKAGE.parent
    include = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
    for src in _c_sources():
        in_csrc = src.is_relative_to(root / "csrc")
        for name in include.findall(src.read_text()):
            found = [d / name for d in (src.parent, root / "csrc", root) if (d / name).exists()]
            if not found:  # a framework's, CUTLASS's or the toolkit's header
                assert not name.startswith(("backends/", "csrc/")), (src, name)
                continue
            target = found[0].resolve()
            if in_csrc:
                assert target.is_relative_to(root / "csrc"), f"{src} includes {target}"


def test_csrc_is_compiled_once_for_every_library(monkeypatch):
    """csrc_archive compiles each object once: a second archive of the same objects, or of a
    subset (the TF library's, without the cuBLASLt sources), compiles nothing."""
    from fusedlayers import _sources
    first = _sources.csrc_archive(False, False, gemm=True, abi=_sources.DEFAULT_CXX11_ABI)
    compiled = []
    run = _sources._run
    monkeypatch.setattr(_sources, "_run", lambda cmd, verbose=False: (
        compiled.append(cmd) if cmd[0] != "ar" else None, run(cmd, verbose))[1])
    assert _sources.csrc_archive(False, False, gemm=True, abi=_sources.DEFAULT_CXX11_ABI) == first
    subset = _sources.csrc_archive(False, False, gemm=False, abi=_sources.DEFAULT_CXX11_ABI)
    assert subset != first and not compiled, compiled


def test_objects_are_compiled_once_per_command_and_source(tmp_path, monkeypatch):
    from fusedlayers import _sources
    monkeypatch.setenv(_sources.OBJECT_CACHE, str(tmp_path / "objects"))
    source = tmp_path / "one.cpp"
    source.write_text("int one() { return 1; }\n")
    compiled = []
    run = _sources._run
    monkeypatch.setattr(_sources, "_run", lambda cmd, verbose=False: (
        compiled.append(cmd), run(cmd, verbose))[1])
    cmd = ["g++", "-fPIC"]
    first = _sources.compile_cached(cmd, source)
    assert _sources.compile_cached(cmd, source) == first and len(compiled) == 1
    assert _sources.compile_cached([*cmd, "-O2"], source) != first and len(compiled) == 2
    assert _sources.compile_cached(cmd, source, key="framework 2") != first
    source.write_text("int one() { return 2; }\n")
    assert _sources.compile_cached(cmd, source) != first and len(compiled) == 4
    # the headers it includes, directly or through another, count; another header does not
    (tmp_path / "inner.h").write_text("#define ONE 1\n")
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner.h"\n')
    (tmp_path / "other.h").write_text("#define TWO 2\n")
    source.write_text('#include "outer.h"\nint one() { return ONE; }\n')
    assert _sources.included_headers(source) == {tmp_path / "outer.h", tmp_path / "inner.h"}
    with_headers = _sources.compile_cached(cmd, source)
    (tmp_path / "other.h").write_text("#define TWO 3\n")
    assert _sources.compile_cached(cmd, source) == with_headers and len(compiled) == 5
    (tmp_path / "inner.h").write_text("#define ONE 2\n")
    assert _sources.compile_cached(cmd, source) != with_headers and len(compiled) == 6


def test_framework_headers_are_precompiled_for_a_build(tmp_path, monkeypatch):
    """build_library(pch_headers=, pch_folder=): the headers precompiled once where each job
    has four or more sources of that folder to compile, GCC taking the .gch for each (g++ -H
    marks a precompiled header it reads with "!"), removed after the build; where each job has
    fewer, the sources parse the headers themselves; a source in another folder compiles
    without them."""
    from fusedlayers import _sources
    monkeypatch.setenv(_sources.OBJECT_CACHE, str(tmp_path / "objects"))
    monkeypatch.setenv("MAX_JOBS", "1")
    (tmp_path / "bindings").mkdir()
    sources = [tmp_path / "bindings" / f"s{i}.cpp" for i in range(5)]
    for i, source in enumerate(sources):
        source.write_text(f"int s{i}() {{ return std::vector<int>({i}).size(); }}\n")
    other = tmp_path / "other.cpp"
    other.write_text("int other() { return 1; }\n")
    runs = []  # (command, its stderr: what g++ -H lists)
    run = _sources._run
    monkeypatch.setattr(_sources, "_run", lambda cmd, verbose=False: (
        runs.append((cmd, run([*cmd, "-H"] if "-c" in cmd else cmd, verbose))), runs[-1][1])[1])
    build = lambda srcs, lib="lib.so": _sources.build_library(  # noqa: E731
        tmp_path / lib, srcs, [], [], cuda=False, pch_headers=("vector",),
        pch_folder="bindings")
    assert build([*sources[:4], other]) is True
    headers = [cmd[cmd.index("c++-header") + 1] for cmd, _ in runs if "c++-header" in cmd]
    compiles = {cmd[cmd.index("-c") + 1]: (cmd, listed) for cmd, listed in runs if "-c" in cmd}
    assert len(headers) == 1 and len(compiles) == 5
    assert all(f"! {headers[0]}.gch" in compiles[str(src)][1] for src in sources[:4]), compiles
    assert "-include" not in compiles[str(other)][0]
    assert not Path(headers[0] + ".gch").exists()
    runs.clear()
    assert build(sources) is True  # one source to compile: no header precompiled for it
    assert [cmd for cmd, _ in runs if "c++-header" in cmd] == []
    assert len([cmd for cmd, _ in runs if "-c" in cmd]) == 1
    runs.clear()
    monkeypatch.setenv(_sources.OBJECT_CACHE, str(tmp_path / "objects2"))
    monkeypatch.setenv("MAX_JOBS", "2")  # five sources over two jobs: parsed by each
    assert build(sources, "lib2.so") is True
    assert len([cmd for cmd, _ in runs if "-c" in cmd]) == 5
    assert [cmd for cmd, _ in runs if "c++-header" in cmd] == []
    assert all(".gch" not in listed for cmd, listed in runs if "-c" in cmd)


def test_a_library_is_built_once_per_sources_and_flags(tmp_path):
    from fusedlayers import _sources
    source, output = tmp_path / "one.cpp", tmp_path / "libone.so"
    source.write_text("int one() { return 1; }\n")
    build = lambda flags: _sources.build_library(output, [source], flags, [], cuda=False)  # noqa: E731
    assert build([]) is True
    assert build([]) is False  # kept: what setup.py's summary reports as up to date
    assert build(["-DTWO"]) is True
    source.write_text("int one() { return 2; }\n")
    assert build(["-DTWO"]) is True


def test_cpu_kernels_use_torchs_openmp_pool():
    # at::parallel_for spreads work over threads only where _OPENMP is defined when the extension
    # compiles (ATen/ParallelOpenMP.h): built without -fopenmp, every csrc CPU kernel silently
    # runs on one thread. And the OpenMP runtime must be torch's own, one pool for both.
    import torch
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch does not parallelize with OpenMP")
    import importlib.util
    library = importlib.util.find_spec("fusedlayers._C").origin
    undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True,
                               text=True, check=True).stdout.split()
    assert any(s.split("@")[0] == "GOMP_parallel" for s in undefined), \
        f"{library} has no OpenMP parallel region"
    out = run_python("""
        import torch, fusedlayers.torch
        print(sorted({line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line}))
    """)
    assert len(eval(out)) == 1, f"more than one OpenMP runtime loaded: {out}"


@pytest.mark.skipif(os.environ.get("FUSEDLAYERS_TEST_JIT") != "1",
                    reason="compiles the extension (~80 s on 2 cores): set FUSEDLAYERS_TEST_JIT=1")
def test_jit_build_matches_reference(tmp_path):
    root = copy_package(tmp_path / "src", with_sources=True)
    out = run_python(f"""
        import fusedlayers, torch
        assert fusedlayers.__file__.startswith({str(root)!r})
        import fusedlayers.torch
        from fusedlayers.torch import reference
        from fusedlayers.torch import _op
        assert _op.LOAD_ERROR is None, _op.LOAD_ERROR
        maps = open("/proc/self/maps").read()
        assert "fusedlayers_torch" in maps and "fusedlayers/_C" not in maps  # JIT, not _C
        x = torch.randn(33, 100, dtype=torch.float64, requires_grad=True)
        w = torch.randn(7, 100, dtype=torch.float64)
        assert torch.equal(fusedlayers.relu_scale(x, 0.5), reference.relu_scale(x, 0.5))
        torch.testing.assert_close(fusedlayers.linear_gelu(x, w), reference.linear_gelu(x, w))
        torch.testing.assert_close(fusedlayers.layer_norm(x, 100), reference.layer_norm(x, 100))
        torch.autograd.gradcheck(lambda t: fusedlayers.layer_norm(t, 5), (x[:3, :5].detach()
                                 .requires_grad_(),))
        print("JIT OK")
    """, cwd=root, env_extra={"PYTHONPATH": str(root), "FUSEDLAYERS_JIT": "1",
                              "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, isolate=True)
    assert "JIT OK" in out


def test_broken_tensorflow_fails_the_test_session(tmp_path):
    # A tensorflow that is installed but raises on import must not turn its tests into skips.
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libtensorflow_framework.so.2: cannot "
                                      "open shared object file')\n")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                             str(tests / "test_tf_ops.py")], capture_output=True, text=True,
                            env=env, cwd=tests.parent, timeout=600)
    assert result.returncode != 0
    assert "tensorflow is installed but does not import" in result.stdout + result.stderr


# absl's lines before its logging starts, as TensorFlow's import writes them on x86 CPUs with
# oneDNN's ops on (TF_ENABLE_ONEDNN_OPTS=1 turns them on everywhere)
TF_STARTUP = ("I0000", "absl::InitializeLog", "cpu_feature_guard")


def _info_stderr(**env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-m", "fusedlayers", "info"], capture_output=True,
                          text=True, env={**environ, "TF_ENABLE_ONEDNN_OPTS": "1", **env})
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_info_prints_no_tensorflow_startup_line():
    pytest.importorskip("tensorflow")
    stderr = _info_stderr()
    assert not any(s in stderr for s in TF_STARTUP), stderr


def test_a_users_own_tensorflow_log_level_is_kept():
    """At TF_CPP_MIN_LOG_LEVEL=0 the lines show: the filter honours the user's level, and the
    test above has lines to miss."""
    pytest.importorskip("tensorflow")
    stderr = _info_stderr(TF_CPP_MIN_LOG_LEVEL="0")
    assert "I0000" in stderr and "oneDNN custom operations are on" in stderr, stderr


def test_startup_lines_below_the_level_are_dropped_with_their_continuations():
    from fusedlayers._tf_logs import below_level
    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
            "STDERR\n"
            "I0000 00:00:1795622387.244858    2799 cpu_feature_guard.cc:227] This TensorFlow...\n"
            "To enable the following instructions: AVX2 AVX512F, in other operations...\n"
            "E0000 00:00:1795622387.181913    2799 port.cc:153] a real error\n"
            "a line of someone else's\n")
    kept = below_level(text, 2)
    assert kept == ("E0000 00:00:1795622387.181913    2799 port.cc:153] a real error\n"
                    "a line of someone else's\n")
    assert below_level(text, 0) == text
    assert below_level("plain\n", 3) == "plain\n"
