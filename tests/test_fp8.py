"""fp8_quantize against its float64 reference (values correctly rounded from the exact products,
scales exact), its special values (zero blocks, subnormals, saturation, ties decided by the
product's residual, NaN and Inf), CUDA against the CPU bit for bit, the fake kernel and the
argument errors."""

import numpy as np
import pytest
import torch

from fusedlayers.torch import fp8 as fp8_module
from fusedlayers.torch import fp8_quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALINGS = ["tensorwise", "1x128", "128x128"]
# (scaling, scaling_t): each scaling with x^T scaled as x, and x by 1x128 blocks with x^T by tiles
SCALING_PAIRS = pytest.mark.parametrize(
    "scaling,scaling_t", [(s, None) for s in SCALINGS] + [("1x128", "128x128")],
    ids=SCALINGS + ["1x128,t128x128"])
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def assert_matches_reference(x, scaling, format, transpose=False, power_of_2_scales=False,
                             scaling_t=None):
    got = fp8_quantize(x, scaling, format, transpose, power_of_2_scales, scaling_t)
    want = fp8_module.reference(x, scaling, format, transpose, power_of_2_scales, scaling_t)
    assert got.data.dtype == fp8_module.FORMATS[format] and got.data.shape == x.shape
    np.testing.assert_array_equal(got.data.float().cpu().numpy(), want[0])
    np.testing.assert_array_equal(got.scale_inv.cpu().numpy(), want[1])
    assert got.scale_inv.dtype == torch.float32
    if transpose:
        np.testing.assert_array_equal(got.data_t.float().cpu().numpy(), want[2])
        np.testing.assert_array_equal(got.scale_inv_t.cpu().numpy(), want[3])
    else:
        assert got.data_t is None and got.scale_inv_t is None
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "cast-transpose"])
@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SCALING_PAIRS
def test_matches_float64_reference(scaling, scaling_t, dtype, format, transpose, device, seed):
    """Odd sizes (partial blocks on both edges), values spanning 2^-20..2^6 so some blocks reach
    the format's subnormals, a non-contiguous x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 131, 259, generator=g, dtype=torch.float64) * \
        torch.exp2(torch.randint(-20, 6, (2, 131, 1), generator=g).double())
    x = x.to(dtype).to(device).transpose(1, 2).contiguous().transpose(1, 2)  # column-major
    assert not x.is_contiguous()
    assert_matches_reference(x, scaling, format, transpose, scaling_t=scaling_t)


@pytest.mark.parametrize("device", DEVICES)
@SCALING_PAIRS
def test_power_of_2_scales_dequantize_exactly(scaling, scaling_t, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 200, generator=g).to(device)
    q = assert_matches_reference(x, scaling, "e4m3", True, True, scaling_t)
    for scales in (q.scale_inv, q.scale_inv_t):
        mantissa = torch.frexp(scales)[0]
        assert torch.all(mantissa == 0.5), "a scale is not a power of two"


@pytest.mark.parametrize("device", DEVICES)
def test_special_values(device):
    """A zero row (scale 1, zeros), a row whose scaled values fall in E4M3's subnormals, float32
    subnormal inputs, a row with NaN and one with Inf (NaN values and scale: nothing silently
    zeroed), and the rows around them untouched."""
    x = torch.randn(8, 256)
    x[0] = 0
    x[1, :] = torch.linspace(-1, 1, 256)
    x[1, 0] = 448 * 2 ** 9  # scale 2^-9: the rest are E4M3 subnormals or flush to zero after
    x[2, :128] = torch.tensor(1e-40).expand(128) * torch.arange(128)  # float32 subnormals
    x[3, 5] = float("nan")
    x[4, 200] = float("inf")
    x[5, 7] = -float("inf")
    x = x.to(device)
    for transpose in (False, True):
        q = assert_matches_reference(x, "1x128", "e4m3", transpose)
    data, scale_inv = q.data.float().cpu(), q.scale_inv.cpu()
    assert torch.all(data[0] == 0) and torch.all(scale_inv[0] == 1)
    assert torch.isnan(data[3, :128]).all() and torch.isnan(scale_inv[3, 0])
    assert not torch.isnan(data[3, 128:]).any() and not torch.isnan(scale_inv[3, 1])
    assert torch.isnan(data[4, 128:]).all() and torch.isnan(data[5, :128]).all()
    assert torch.isfinite(data[6:]).all()
    for scaling in ("tensorwise", "128x128"):
        q = assert_matches_reference(x, scaling, "e5m2")
        assert torch.isnan(q.scale_inv.cpu()).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("format", ["e4m3", "e5m2"])
def test_ties_follow_the_exact_product(format, device):
    """Values whose float32 product x * s lands exactly on a tie between two FP8 numbers while the
    exact product lies just above or below it: rounded to the exact product's side (a cast of
    the float32 product would round both to even). Also exact ties (to even) and saturation at
    the format's max."""
    fmt_max = {"e4m3": 448.0, "e5m2": 57344.0}[format]
    amax = np.float32(3.3)  # s = fmt_max / amax: a multiplier with a full mantissa
    s = np.float32(fmt_max) / amax
    grid = fp8_module.round_to_fp8(np.arange(1, 200, dtype=np.float64) / 8, format)
    ties = np.unique((grid[:-1] + grid[1:]) / 2)
    crafted = []
    for t in ties:
        x = np.float32(t / float(s))
        for cand in (np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(10))):
            if np.float32(cand * s) == t and float(cand) * float(s) != t and abs(cand) < amax:
                crafted.append(cand)
    assert len(crafted) >= 8, "no product rounds onto a tie: the test would check nothing"
    values = np.concatenate([[amax], crafted, -np.array(crafted)]).astype(np.float32)
    x = torch.from_numpy(values).reshape(1, -1).to(device)
    got = fp8_quantize(x, "tensorwise", format).data.float().cpu().numpy()[0]
    want = fp8_module.round_to_fp8(values.astype(np.float64) * float(s), format)
    float32_cast = fp8_module.round_to_fp8((values * s).astype(np.float64), format)
    assert (want != float32_cast).any(), "the crafted ties do not tell the two roundings apart"
    np.testing.assert_array_equal(got, want)
    assert got[0] == fmt_max  # amax * s may round past fmt_max: saturated


@pytest.mark.parametrize("device", DEVICES)
@SCALING_PAIRS
def test_empty(scaling, scaling_t, device):
    for shape in [(0, 130), (5, 0)]:
        x = torch.empty(shape, device=device)
        q = assert_matches_reference(x, scaling, "e4m3", True, scaling_t=scaling_t)
        if scaling == "tensorwise":
            assert q.scale_inv.item() == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SCALING_PAIRS
def test_cuda_gives_the_cpu_bits(scaling, scaling_t, dtype, seed):
    """Many tiles, partial ones on both edges: rows of whole 16-byte chunks (the staged kernel;
    x^T's columns in 8-byte stores, and byte by byte where the rows are not a multiple of 8) and
    an unaligned view of 4099 columns (the element-wise one), with and without x^T."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1000, 4104, generator=g).to(dtype)
    for x_cpu in (x, x[:997], x.reshape(-1)[1:1 + 999 * 4099].view(999, 4099)):
        for transpose in (False, True):
            cpu = fp8_quantize(x_cpu, scaling, "e4m3", transpose=transpose, scaling_t=scaling_t)
            cuda = fp8_quantize(x_cpu.cuda(), scaling, "e4m3", transpose=transpose,
                                scaling_t=scaling_t)
            for a, b in zip(cpu, cuda):
                if a is None:
                    continue
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   (b.view(torch.uint8) if b.element_size() == 1 else b).cpu())


@SCALING_PAIRS
def test_opcheck(scaling, scaling_t):
    """The fake kernel's shapes, dtypes and strides are the real kernel's (torch.compile)."""
    x = torch.randn(130, 260)
    for transpose in (False, True):
        torch.library.opcheck(torch.ops.fusedlayers.fp8_quantize.default,
                              (x, scaling, "e5m2", transpose, False, scaling_t))


def test_argument_errors():
    x = torch.randn(4, 128)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got float64"):
        fp8_quantize(x.double())
    with pytest.raises(TypeError, match="x must be"):
        fp8_quantize(x.int())
    with pytest.raises(ValueError, match="scaling must be 'tensorwise', '1x128' or '128x128', "
                                         "got '1x64'"):
        fp8_quantize(x, "1x64")
    with pytest.raises(ValueError, match="format must be 'e4m3' or 'e5m2', got 'e3m4'"):
        fp8_quantize(x, format="e3m4")
    with pytest.raises(ValueError, match="scaling_t must be 'tensorwise', '1x128' or '128x128', "
                                         "got '2x128'"):
        fp8_quantize(x, transpose=True, scaling_t="2x128")
    for scaling, scaling_t in [("128x128", "1x128"), ("tensorwise", "128x128"),
                               ("1x128", "tensorwise")]:
        with pytest.raises(ValueError, match=f"scaling_t must be scaling \\('{scaling}'\\), or "
                                             f"'128x128' with scaling '1x128', got '{scaling_t}'"):
            fp8_quantize(x, scaling, transpose=True, scaling_t=scaling_t)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        fp8_quantize(torch.tensor(1.0))


def test_bench_rows_on_the_cpu():
    """`bench --fp8`'s rows: each case's kernel and the stock-torch quantization it is timed
    against, which computes the same values (within one FP8 step: its float32 product's
    rounding and its reciprocal's)."""
    from fusedlayers.bench import fp8 as fp8_bench
    x = torch.randn(256, 384, dtype=torch.bfloat16)
    for scaling in SCALINGS:
        ours = fp8_quantize(x, scaling, "e4m3", transpose=True)
        theirs = fp8_bench.unfused(x, scaling, transpose=True)
        for q, scale_inv, tq, t_scale_inv in [(ours.data, ours.scale_inv, *theirs[:2]),
                                              (ours.data_t, ours.scale_inv_t, *theirs[2:])]:
            assert tq.dtype == q.dtype and tq.shape == q.shape
            step = _per_value(scale_inv, q.shape, scaling)  # 1 / s of each value
            ours_deq = q.float() * step
            theirs_deq = tq.float() * _per_value(t_scale_inv, q.shape, scaling)
            allowed = torch.maximum(ours_deq.abs() * 2 ** -3, step * 2 ** -9) * 1.001
            assert torch.all((ours_deq - theirs_deq).abs() <= allowed)
    rows = fp8_bench.run("cpu", rounds=1, reps=1, compile=False, log=lambda line: None)
    assert {(r.scaling, r.transpose, r.producer) for r in rows} == set(
        (s, t, p or "") for _, s, t, p in fp8_bench.cases("cpu"))
    assert all(r.gbs > 0 for r in rows)
    assert {r.impl for r in rows if not r.producer} == {"fusedlayers", "eager", "copy"}
    assert {r.impl for r in rows if r.producer} == {"fusedlayers", "two ops", "eager"}
    # the producers' eager rows compute what the fused ops do
    fns, _ = fp8_bench.producer_fns("swiglu'", torch.randn(128, 128, dtype=torch.bfloat16),
                                    "1x128", False)
    ours, theirs = fns["fusedlayers"](), fns["eager"]()
    deq = [q.float() * _per_value(s, q.shape, "1x128") for q, s in
           ((ours.data, ours.scale_inv), theirs[:2])]
    assert (deq[0] - deq[1]).norm() <= 0.1 * deq[0].norm()


def test_gemm_and_mlp_bench_rows_on_the_cpu():
    """`bench --fp8`'s GEMM rows (each scaling beside bf16; torch._scaled_mm is CUDA's) and MLP
    rows (the bf16 and FP8 variants, no compiler): every row ran and has a time."""
    from fusedlayers.bench import fp8_gemm as gemm_bench
    from fusedlayers.bench import fp8_mlp as mlp_bench
    gemms = gemm_bench.run("cpu", rounds=1, reps=1, log=lambda line: None)
    assert {r.scaling for r in gemms} == {"bf16", *gemm_bench.PAIRS}
    assert all(r.tflops > 0 and not r.not_run for r in gemms)
    assert all(r.vs_bf16 is not None for r in gemms if r.scaling != "bf16")
    mlp = mlp_bench.run("cpu", rounds=1, peers=False, compile=False, log=lambda line: None)
    assert [r.variant for r in mlp] == [
        "bf16 eager", "fusedlayers bf16", "fusedlayers fp8 blockwise",
        "fusedlayers fp8 blockwise layers", "fusedlayers fp8 blockwise x^T tiles",
        "fusedlayers fp8 blockwise x^T tiles layers", "fusedlayers fp8 tensorwise",
        "fusedlayers fp8 tensorwise layers"]
    assert all(r.ms > 0 and not r.not_run for r in mlp)


def _per_value(scale_inv, shape, scaling):
    """Each value's scale_inv, broadcast to `shape` (of the op's scales, or of the bench's
    unfused quantization, which keeps them per block as it computed them)."""
    rows, cols = shape
    if scaling == "tensorwise":
        return scale_inv.float().reshape(1, 1).expand(rows, cols)
    if scaling == "1x128":
        return scale_inv.float().reshape(rows, -1, 1).expand(rows, cols // 128, 128).reshape(
            rows, cols)
    return scale_inv.float().reshape(rows // 128, 1, cols // 128, 1).expand(
        rows // 128, 128, cols // 128, 128).reshape(rows, cols)


def test_mlp_bench_row_that_cannot_build_says_why(monkeypatch):
    """A variant whose model cannot be made (a peer that does not install) is a row saying why."""
    from fusedlayers.bench import fp8_mlp as mlp_bench
    made = mlp_bench.variants

    def variants(*args):
        out = made(*args)

        def fails():
            raise ImportError("No module named 'torchao'")
        return {"bf16 eager": out["bf16 eager"], "torchao tensorwise compiled": fails}
    monkeypatch.setattr(mlp_bench, "variants", variants)
    rows = mlp_bench.run("cpu", rounds=1, peers=False, compile=False, log=lambda line: None)
    assert rows[1].ms is None and rows[1].not_run == "ImportError: No module named 'torchao'"
    assert "did not run: ImportError" in mlp_bench.format_row(rows[1])
