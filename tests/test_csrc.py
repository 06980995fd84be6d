"""csrc stands alone: tests/csrc_test.cpp, plain C++ with no framework, compiled by the system
C++ compiler, linked with csrc's CPU archive (as every framework's library links it) and run
with this test's seed."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fusedlayers import _sources

ROOT = Path(__file__).resolve().parent.parent


def test_csrc_cpu_kernels_standalone(tmp_path, seed):
    """Every check of csrc_test.cpp, under each variant of the float16 loops that pick their ISA
    at run time (cpu_vec.h), which must all give the same bits."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "csrc_test"
    # csrc's CPU sources as the build compiles them (its object cache: compiled once)
    abi = _sources.DEFAULT_CXX11_ABI
    archive = _sources.csrc_archive(False, False, gemm=True, abi=abi)
    subprocess.run([cxx, "-std=c++17", "-pthread", "-Wall", *_sources.CXX_FLAGS,
                    f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{d}" for d in _sources.INCLUDE_DIRS),
                    str(ROOT / "tests/csrc_test.cpp"), str(archive), "-o", str(exe)], check=True)
    digests = {}
    for isa in ("avx512", "f16c", "portable"):
        run = subprocess.run([str(exe), str(seed)], capture_output=True, text=True,
                             env={**os.environ, "FUSEDLAYERS_CPU_ISA": isa})
        assert run.returncode == 0, f"FUSEDLAYERS_CPU_ISA={isa}\n" + run.stdout + run.stderr
        assert "all passed" in run.stdout
        digests[isa] = re.search(r"float16 digest (\w+)", run.stdout).group(1)
    assert len(set(digests.values())) == 1, digests
