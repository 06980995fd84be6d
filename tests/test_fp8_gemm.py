"""fp8_gemm against the float64 product of its dequantized operands (every scaling pair, output
dtype and bias; odd m, partial blocks along k and n), exact on operands whose sums are exact,
CUDA against the CPU, the fake kernel and the argument errors."""

import importlib

import numpy as np
import pytest
import torch

from fusedlayers.torch import fp8_gemm, fp8_quantize

gemm_module = importlib.import_module("fusedlayers.torch.fp8_gemm")

PAIRS = [("tensorwise", "tensorwise"), ("1x128", "128x128"), ("1x128", "1x128")]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def operands(m, n, k, device, g, formats=("e4m3", "e4m3"), pair=PAIRS[1]):
    """a [m, k] and b [n, k] quantized as `pair` says, each with its values over a few octaves
    (rows of different magnitudes: the block scales differ)."""
    def tensor(rows):
        t = torch.randn(rows, k, generator=g, dtype=torch.float64)
        t *= torch.exp2(torch.randint(-4, 4, (rows, 1), generator=g).double())
        return t.to(torch.bfloat16).to(device)
    return (fp8_quantize(tensor(m), pair[0], formats[0]),
            fp8_quantize(tensor(n), pair[1], formats[1]))


def bound(a, a_scaling, b, b_scaling, out_dtype, device, fast_accum=False):
    """|d - exact| allowed: the float32 sums' roundings over k (CPU); on CUDA the tensor cores'
    FP8 accumulation (about 14 bits, promoted to float32 every 128 of k; fast_accum never), both
    scaled by sum |a||b|; plus the rounding to out_dtype."""
    mag = np.abs(gemm_module.dequantize(a.data, a.scale_inv, a_scaling)) @ np.abs(
        gemm_module.dequantize(b.data, b.scale_inv, b_scaling)).T
    k = a.data.shape[1]
    rel = (2.0 ** -8 if fast_accum else 2.0 ** -12) if device == "cuda" else k * 2.0 ** -24
    return mag * rel, torch.finfo(out_dtype).eps


def check(d, want, sum_bound, out_eps):
    got = d.double().cpu().numpy()
    err = np.abs(got - want)
    allowed = sum_bound + np.abs(want) * out_eps + 1e-30
    assert np.all(err <= allowed), f"worst error {np.max(err / allowed):.3g}x the bound"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_matches_float64_reference(pair, out_dtype, with_bias, device, seed):
    """m 77 (tensorwise) or 80 (block scales need a multiple of 16), n 272 (a partial tile), k
    400 (a partial block)."""
    if with_bias and out_dtype == torch.float32:
        pytest.skip("a bias needs a half-precision output (test_argument_errors)")
    g = torch.Generator().manual_seed(seed)
    m = 77 if pair[0] == "tensorwise" else 80
    a, b = operands(m, 272, 400, device, g, pair=pair)
    bias = (torch.randn(272, generator=g) * 4).to(out_dtype).to(device) if with_bias else None
    d = fp8_gemm(a, pair[0], b, pair[1], out_dtype, bias)
    assert d.shape == (m, 272) and d.dtype == out_dtype and d.device.type == device
    check(d, gemm_module.reference(a, pair[0], b, pair[1], bias),
          *bound(a, pair[0], b, pair[1], out_dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("formats", [("e4m3", "e5m2"), ("e5m2", "e4m3")], ids="-".join)
def test_tensorwise_takes_e5m2(formats, device, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = operands(40, 64, 256, device, g, formats, PAIRS[0])
    d = fp8_gemm(a, "tensorwise", b, "tensorwise", torch.float32)
    check(d, gemm_module.reference(a, "tensorwise", b, "tensorwise"),
          *bound(a, "tensorwise", b, "tensorwise", torch.float32, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_exact_where_the_sums_are(pair, device, seed):
    """Small integers over power-of-two scales: every product and partial sum is exact in any
    accumulator, so d must equal the float64 product bit for bit (a scale read from the wrong
    block or row cannot pass)."""
    g = torch.Generator().manual_seed(seed)
    m, n, k = 208, 144, 384

    def ints(rows):  # |v| <= 8: exact in E4M3; rows scaled by 2^e so the blocks differ
        v = torch.randint(-8, 9, (rows, k), generator=g).double()
        v[:, :128] *= 4  # one block along k holds larger values
        return (v * torch.exp2(torch.randint(-3, 3, (rows, 1), generator=g).double())).to(device)
    a = fp8_quantize(ints(m).float(), pair[0], power_of_2_scales=True)
    b = fp8_quantize(ints(n).float(), pair[1], power_of_2_scales=True)
    d = fp8_gemm(a, pair[0], b, pair[1], torch.float32)
    np.testing.assert_array_equal(d.double().cpu().numpy(),
                                  gemm_module.reference(a, pair[0], b, pair[1]))


@pytest.mark.parametrize("pair, fast_accum", [(p, False) for p in PAIRS] +
                         [(PAIRS[0], True)], ids=lambda v: "-".join(v) if isinstance(v, tuple)
                         else ("fast_accum" if v else ""))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or
                    torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")
def test_cuda_near_the_cpu(pair, fast_accum, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = operands(304, 512, 1024, "cuda", g, pair=pair)
    d = fp8_gemm(a, pair[0], b, pair[1], torch.float32, fast_accum=fast_accum)
    cpu = fp8_gemm(*(gemm_module.Fp8Quantized(t.data.cpu(), t.scale_inv.cpu(), None, None)
                     for t in (a,)), pair[0],
                   gemm_module.Fp8Quantized(b.data.cpu(), b.scale_inv.cpu(), None, None), pair[1],
                   torch.float32)
    sum_bound, _ = bound(a, pair[0], b, pair[1], torch.float32, "cuda", fast_accum)
    check(d, cpu.double().numpy(), sum_bound * 2, 0.0)


def test_scales_in_another_layout():
    """128x128 scales given contiguous (rows not padded) and 1x128 scales given row-major give
    the same result as the quantize op's own layouts."""
    g = torch.Generator().manual_seed(0)
    a, b = operands(64, 160, 272, "cpu", g)  # 3 blocks along k: padded rows
    want = fp8_gemm(a, "1x128", b, "128x128", torch.float32)
    a2 = a._replace(scale_inv=a.scale_inv.contiguous())
    b2 = b._replace(scale_inv=b.scale_inv.contiguous())
    assert not b.scale_inv.is_contiguous() and b2.scale_inv.is_contiguous()
    torch.testing.assert_close(fp8_gemm(a2, "1x128", b2, "128x128", torch.float32), want,
                               rtol=0, atol=0)


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_opcheck(pair):
    """The fake kernel and autograd registration (opcheck's schema test compares the inputs
    before and after with arithmetic torch lacks for FP8 tensors, so the inputs' bytes are
    compared here instead)."""
    g = torch.Generator().manual_seed(0)
    a, b = operands(32, 48, 160, "cpu", g, pair=pair)
    before = [t.view(torch.uint8).clone() for t in (a.data, b.data)]
    args = (a.data, a.scale_inv, pair[0], b.data, b.scale_inv, pair[1], torch.bfloat16,
            torch.randn(48, dtype=torch.bfloat16), False)
    torch.library.opcheck(torch.ops.fusedlayers.fp8_gemm.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    assert all(torch.equal(t.view(torch.uint8), u) for t, u in zip((a.data, b.data), before))


def test_argument_errors():
    g = torch.Generator().manual_seed(0)
    a, b = operands(16, 32, 128, "cpu", g)
    with pytest.raises(ValueError, match="scalings must be tensorwise and tensorwise, 1x128 and "
                                         "128x128, or 1x128 and 1x128, got 128x128 and 1x128"):
        fp8_gemm(b, "128x128", a, "1x128")
    with pytest.raises(ValueError, match="a_scale_inv of a \\[16, 128\\] scaled 1x128 must have "
                                         "shape \\[16, 1\\], got \\[1, 1\\]"):
        fp8_gemm(a._replace(scale_inv=b.scale_inv[:1, :1]), "1x128", b, "128x128")
    with pytest.raises(ValueError, match="k must be a positive multiple of 16, got 120"):
        q = fp8_quantize(torch.randn(16, 120))
        fp8_gemm(q, "1x128", fp8_quantize(torch.randn(32, 120), "128x128"), "128x128")
    with pytest.raises(ValueError, match="b's rows n \\(d's columns\\) must be a multiple of 16, "
                                         "got 20"):
        fp8_gemm(a, "1x128", fp8_quantize(torch.randn(20, 128), "128x128"), "128x128")
    with pytest.raises(ValueError, match="blockwise scalings take E4M3 operands"):
        fp8_gemm(a, "1x128", fp8_quantize(torch.randn(32, 128), "128x128", "e5m2"), "128x128")
    with pytest.raises(ValueError, match="cannot both be E5M2"):
        e5 = [fp8_quantize(torch.randn(r, 128), "tensorwise", "e5m2") for r in (16, 32)]
        fp8_gemm(e5[0], "tensorwise", e5[1], "tensorwise")
    with pytest.raises(ValueError, match="must share k"):
        fp8_gemm(a, "1x128", fp8_quantize(torch.randn(32, 256), "128x128"), "128x128")
    with pytest.raises(TypeError, match="a must be torch.float8_e4m3fn or torch.float8_e5m2, "
                                        "got BFloat16"):
        fp8_gemm(a._replace(data=a.data.bfloat16()), "1x128", b, "128x128")
    with pytest.raises(TypeError, match="out_dtype must be float32, float16 or bfloat16, got "
                                        "Double"):
        fp8_gemm(a, "1x128", b, "128x128", torch.float64)
    with pytest.raises(ValueError, match="bias must have shape \\[32\\], got \\[31\\]"):
        fp8_gemm(a, "1x128", b, "128x128", bias=torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a bias needs a bfloat16 or float16 output"):
        fp8_gemm(a, "1x128", b, "128x128", torch.float32, torch.zeros(32))
    with pytest.raises(ValueError, match="fast_accum takes tensorwise scaling alone"):
        fp8_gemm(a, "1x128", b, "128x128", fast_accum=True)
    with pytest.raises(ValueError, match="a's rows m must be a multiple of 16 with block "
                                         "scales, got 12"):
        fp8_gemm(fp8_quantize(torch.randn(12, 128)), "1x128", b, "128x128")
