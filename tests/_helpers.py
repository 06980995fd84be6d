"""Test utilities: error measures, bitwise comparison, and strided views of fresh tensors
(layouts: "contiguous", "transposed", "sliced" (last-dim stride 2), "expanded" (stride-0 rows))."""

import os
import subprocess
import sys
import threading

import pytest
import torch

# Device parameter for tests that run on the CPU and, on a CUDA machine, on the GPU too.
DEVICES = ("cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]))
HALF = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def rel_err(a: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||a - ref|| / ||ref|| in float64 (||a - ref|| when ref is all zeros; 0 for empty).

    scale: the magnitude of the terms that sum to ref (e.g. sum |dy| for a bias gradient), used
    elementwise in place of |ref| where it is larger, so a result that cancels to nearly zero is
    judged against the size of what was summed, not against its own rounding noise."""
    assert a.shape == ref.shape, (a.shape, ref.shape)
    if ref.numel() == 0:
        return 0.0
    a, ref = a.detach().double(), ref.detach().double()
    den_t = ref.abs() if scale is None else torch.maximum(ref.abs(), scale.detach().double())
    num = (a - ref).norm().item()
    den = den_t.norm().item()
    return num / den if den > 0 else num


def assert_bitwise(a: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype, shape and values bit for bit (NaN equal to NaN; +0 equal to -0)."""
    torch.testing.assert_close(a, ref, rtol=0, atol=0, equal_nan=True)


def assert_calibrated(ours: float, torch_err: float, what: str, *, dtype: torch.dtype,
                      numel: int, factor: float = 2.0, floor: float = 0.0) -> None:
    """Ours must be at most `factor` times torch's own error against the same float64 reference,
    plus a small `floor`, plus one ulp of `dtype` / sqrt(numel): a tolerance that follows the
    dtype instead of being guessed. The last term covers the rounding noise of few-element
    results (a single output is either exact or an ulp off, for torch as for us); it fades as
    the errors of many elements average out."""
    allowed = factor * torch_err + floor + torch.finfo(dtype).eps / max(numel, 1) ** 0.5
    assert ours <= allowed, (
        f"{what}: relative error {ours:.3e} vs torch's own {torch_err:.3e} "
        f"(allowed {factor} x torch + {floor:.1e} + ulp/sqrt({numel}) = {allowed:.3e})")


def leaf_shape(shape, layout):
    """The shape of the storage tensor from which `as_layout` cuts a view of `shape`."""
    shape = tuple(shape)
    if layout == "contiguous":
        return shape
    if layout == "transposed":
        return (*shape[:-2], shape[-1], shape[-2])
    if layout == "sliced":  # every other column: last-dim stride 2
        return (*shape[:-1], 2 * shape[-1])
    if layout == "expanded":  # every row the same storage: leading strides 0
        return (*(1 for _ in shape[:-1]), shape[-1])
    raise ValueError(layout)


def as_layout(leaf: torch.Tensor, shape, layout) -> torch.Tensor:
    """A view of `leaf` with `shape` and the given (non-contiguous unless 'contiguous') layout."""
    if layout == "contiguous":
        v = leaf
    elif layout == "transposed":
        v = leaf.transpose(-1, -2)
    elif layout == "sliced":
        v = leaf[..., ::2]
    elif layout == "expanded":
        v = leaf.expand(*shape)
    else:
        raise ValueError(layout)
    assert v.shape == tuple(shape)
    return v


def f64(t: torch.Tensor | None, requires_grad: bool | None = None):
    """A float64 leaf copy of t (None stays None); keeps t's requires_grad unless told."""
    if t is None:
        return None
    rg = t.requires_grad if requires_grad is None else requires_grad
    return t.detach().double().requires_grad_(rg)


def grads(out: torch.Tensor, inputs, grad_out: torch.Tensor):
    """d<out, grad_out>/d inputs (None for inputs that are None)."""
    live = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, live, grad_out.to(out.dtype)))
    return [None if t is None else next(got) for t in inputs]


def assert_survives_subprocess(module: str, call: str, names, env_extra=None) -> None:
    """Runs `module.<call>(name)` for each name in a fresh interpreter (for cases that could
    crash it): fails with the case that was running if the interpreter exits early or fails."""
    code = (f"import {module} as t\n"
            f"for name in {list(names)!r}:\n"
            "    print(name, flush=True)\n"
            f"    t.{call}(name)\n"
            "print('done', flush=True)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, **(env_extra or {}), "PYTHONPATH": os.pathsep.join(
        [tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)
    last = proc.stdout.strip().splitlines()[-1:] or ["(nothing)"]
    assert proc.returncode == 0 and last == ["done"], (
        f"rc {proc.returncode} during {last[0]}\n{proc.stderr[-4000:]}")


def concurrent_mismatches(run, cases, same, repeats: int = 20) -> list:
    """One thread per case (args, want) calling run(*args) `repeats` times at once; the args of
    every result that is not same(result, want)."""
    failures = []

    def work(args, want):
        for _ in range(repeats):
            if not same(run(*args), want):
                failures.append(args)

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures

