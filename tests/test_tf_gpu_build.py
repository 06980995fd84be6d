"""The TensorFlow op library built with its GPU kernels (GOOGLE_CUDA), on a machine with nvcc and
no GPU: it links, keeps its static CUDA runtime private, registers a GPU kernel for every op and
every dtype csrc's CUDA kernels take, and still loads and runs on the CPU. They run on a GPU in
.ci/gpu's tensorflow stage (the tests marked cuda that run TensorFlow)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

from fusedlayers import _sources  # noqa: E402
from fusedlayers.tensorflow import _library  # noqa: E402

# One worker builds the library for both tests (pytest-xdist's --dist loadgroup).
# Compiling the library's CUDA kernels and its GPU bindings takes most of the test run's time on
# a 2-core machine: CI, whose nvcc stage compiles the kernels first, sets
# FUSEDLAYERS_TEST_TF_GPU_BUILD=1.
pytestmark = [pytest.mark.skipif(_sources.find_cuda_home() is None, reason="needs nvcc"),
              pytest.mark.skipif(os.environ.get("FUSEDLAYERS_TEST_TF_GPU_BUILD") != "1",
                                 reason="builds the TensorFlow GPU library (~15 min on 2 cores): "
                                        "set FUSEDLAYERS_TEST_TF_GPU_BUILD=1 (CI does)"),
              pytest.mark.xdist_group("tf_gpu_library"), pytest.mark.long]

OPS = ["FusedlayersReluScale", "FusedlayersReluScaleGrad", "FusedlayersLayerNorm",
       "FusedlayersLayerNormGrad", "FusedlayersLinearGeluEpilogue", "FusedlayersLinearGeluEpilogueGrad",
       "FusedlayersLinearCrossEntropyChunk", "FusedlayersGroupedGemm", "FusedlayersGroupedGemmGrad",
       "FusedlayersMoePermute", "FusedlayersMoePermuteGrad", "FusedlayersMoeUnpermute",
       "FusedlayersMoeUnpermuteGrad"]
# The FP8 ops run outside XLA; the FP8 GEMM on the CPU alone (the library links no cuBLASLt).
FP8_KERNELS = {"FusedlayersFp8Quantize": ["CPU:", "GPU:bfloat16", "GPU:float16", "GPU:float32"],
               "FusedlayersFp8Gemm": ["CPU:"]}


@pytest.fixture(scope="module")
def gpu_library(tmp_path_factory):
    """Built for one architecture (what is checked here, linking, symbols and registration,
    does not depend on it): Ampere's, which leaves out the Hopper grouped GEMM's CUTLASS
    kernels (the longest compiles by far), or in CI for the archs of its nvcc stage
    ($CI_CUDA_ARCHS), whose objects csrc_archive finds in the object cache instead of compiling
    them again."""
    path = tmp_path_factory.mktemp("tf_gpu") / "_tf_ops.so"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("CI_CUDA_ARCHS", "8.0"))
        _library.build(path, cuda=True)
    return path


def test_cuda_runtime_is_private(gpu_library):
    """No CUDA runtime or driver symbol is exported or imported: the static cudart inside cannot
    bind to TensorFlow's own CUDA runtime, nor TensorFlow's code to it."""
    dynamic = subprocess.run(["nm", "-D", str(gpu_library)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    cuda = [line for line in dynamic if re.search(r"\s(__)?cu(da)?[A-Z_]\w*$", line)]
    assert not cuda, f"CUDA symbols in the dynamic symbol table: {cuda[:10]}"
    local = subprocess.run(["nm", str(gpu_library)], capture_output=True, text=True,
                           check=True).stdout
    assert re.search(r"\scudaLaunchKernel\w*$", local, re.M), "the CUDA runtime is not linked in"


def test_gpu_kernels_registered_and_cpu_runs(gpu_library):
    """In a fresh process (the op names are registered once per process): every op has a CPU
    kernel, GPU kernels for float32/float16/bfloat16 and XLA kernels for XLA's CPU and GPU JIT
    devices (the FP8 ops theirs), and the CPU kernel still computes."""
    script = f"""
import json
import tensorflow as tf
from tensorflow.python.framework import kernels
lib = tf.load_op_library({str(gpu_library)!r})
found = {{}}
for op in {OPS + list(FP8_KERNELS)!r}:
    found[op] = sorted(
        k.device_type + ":" + ",".join(tf.dtypes.as_dtype(t).name
                                      for c in k.constraint
                                      for t in c.allowed_values.list.type)
        for k in kernels.get_registered_kernels_for_op(op).kernel)
with tf.device("/CPU:0"):
    y, mask = lib.fusedlayers_relu_scale(tf.constant([-1.0, 2.0, float("nan")]), alpha=3.0)
print(json.dumps({{"kernels": found, "y": [str(v) for v in y.numpy().tolist()],
                  "mask": mask.numpy().tolist()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    want = ["CPU:", "GPU:bfloat16", "GPU:float16", "GPU:float32", "XLA_CPU_JIT:", "XLA_GPU_JIT:"]
    assert result["kernels"] == {**{op: want for op in OPS}, **FP8_KERNELS}
    assert result["y"] == ["0.0", "6.0", "nan"] and result["mask"] == [0b110]
