"""fp8_rms_norm / fp8_layer_norm: y, h and the statistics are the norm ops' (bit for bit on the
CPU, where one kernel computes both; within the last bit on CUDA, whose one-pass kernel sums in
its own order), the FP8 output is fp8_quantize of the returned y bit for bit on every device, and
the gradients are the add+norm ops'; fuse(model, fp8=) with its norms writing FP8: the same losses and gradients as
quantizing in the layers."""

import pytest
import torch

from fusedlayers import Fp8Recipe
from fusedlayers.torch import fp8_layer_norm, fp8_quantize, fp8_rms_norm, fuse

ops = torch.ops.fusedlayers
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def bits(t):
    return None if t is None else (t.view(torch.uint8) if t.element_size() == 1 else t).cpu()


def assert_same(got, want, what):
    for name, a, b in zip(("q", "scale_inv", "q_t", "scale_inv_t"), got, want):
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what}: {name} differs"


def inputs(g, rows, cols, dtype, device, rms, residual, param_dtype=None):
    param_dtype = param_dtype or dtype
    x = (torch.randn(rows, cols, generator=g) * 2 + 0.5).to(dtype).to(device)
    res = torch.randn(rows, cols, generator=g).to(dtype).to(device) if residual else None
    w = (1 + torch.randn(cols, generator=g) / 4).to(param_dtype).to(device)
    b = None if rms else (torch.randn(cols, generator=g) / 4).to(param_dtype).to(device)
    return x, res, w, b


def plain(x, res, w, b, rms, eps):
    """The norm ops fuse() runs without FP8: (y, h, mean, rstd)."""
    if res is None:
        if rms:
            y, rstd = ops.rms_norm(x, [x.shape[-1]], w, eps)
            return y, None, None, rstd
        y, mean, rstd = ops.layer_norm(x, [x.shape[-1]], w, b, eps)[:3]
        return y, None, mean, rstd
    if rms:
        y, h, rstd = ops.add_rms_norm(x, res, [x.shape[-1]], w, eps)
        return y, h, None, rstd
    return ops.add_layer_norm(x, res, [x.shape[-1]], w, b, eps)


def fp8_norm(x, res, w, b, rms, eps, **kw):
    if rms:
        return fp8_rms_norm(x, x.shape[-1], w, eps, residual=res, **kw)
    return fp8_layer_norm(x, x.shape[-1], w, b, eps, residual=res, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_equals_norm_then_quantize(rms, residual, dtype, device, seed):
    """Rows off whole tiles (77, 130), columns off and on 128-blocks, each scaling and format,
    with and without y^T."""
    g = torch.Generator().manual_seed(seed)
    for rows, cols, scaling, transpose, fmt in ((77, 384, "1x128", True, "e4m3"),
                                                (130, 200, "tensorwise", False, "e5m2"),
                                                (130, 256, "1x128", False, "e4m3")):
        x, res, w, b = inputs(g, rows, cols, dtype, device, rms, residual)
        y, h, q = fp8_norm(x, res, w, b, rms, 1e-5, scaling=scaling, format=fmt,
                           transpose=transpose)
        want_y, want_h, _, _ = plain(x, res, w, b, rms, 1e-5)
        if device == "cpu":
            assert torch.equal(y, want_y)
        else:
            torch.testing.assert_close(y, want_y, rtol=1e-2, atol=1e-2)
        assert (h is None) == (not residual)
        if residual:
            assert torch.equal(h, want_h)
        assert_same(q, fp8_quantize(y, scaling, fmt, transpose), f"{rows}x{cols} {scaling}")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
def test_gradients_are_the_norm_ops(rms, residual, seed):
    """dx, dresidual, dweight, dbias through y and h: those of the norm ops' own autograd, bit
    for bit (one backward kernel), and within float32 rounding of the float64 composition."""
    g = torch.Generator().manual_seed(seed)
    x, res, w, b = inputs(g, 48, 256, torch.float32, "cpu", rms, residual)
    leaves = [t.requires_grad_() for t in (x, res, w, b) if t is not None]
    dy = torch.randn(48, 256, generator=g)
    dh = torch.randn(48, 256, generator=g)

    def grads(fn):
        y, h = fn()[:2]
        loss = (y * dy).sum() + ((h * dh).sum() if h is not None else 0)
        return torch.autograd.grad(loss, leaves)

    fused = grads(lambda: fp8_norm(x, res, w, b, rms, 1e-5))
    unfused = grads(lambda: plain(x, res, w, b, rms, 1e-5))
    for a, want in zip(fused, unfused):
        assert torch.equal(a, want)
    x64 = [t.detach().double().requires_grad_() for t in leaves]
    xs = dict(zip([n for n, t in zip("xrwb", (x, res, w, b)) if t is not None], x64))
    hh = xs["x"] + xs["r"] if residual else xs["x"]
    if rms:
        y64 = hh * torch.rsqrt(hh.square().mean(-1, keepdim=True) + 1e-5) * xs["w"]
    else:
        y64 = torch.nn.functional.layer_norm(hh, (256,), xs["w"], xs["b"], 1e-5)
    loss = (y64 * dy.double()).sum() + ((hh * dh.double()).sum() if residual else 0)
    for a, want in zip(fused, torch.autograd.grad(loss, x64)):
        torch.testing.assert_close(a.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cols", [256, 2048, 4096, 5120, 8192])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_pass_kernel(cols, dtype, residual, rms, seed):
    """The widths the one-pass kernel takes (slices of 128 to 512 columns, clusters of 2 to 16
    blocks), rows off whole 128-row stripes, float32 and half parameters, with and without y^T,
    power-of-two scales: q is fp8_quantize(y) bit for bit; y, h and the statistics the norm
    ops' (h exactly; y within its last bit)."""
    g = torch.Generator().manual_seed(seed)
    for rows, param_dtype, transpose, pow2 in ((300, torch.float32, True, False),
                                               (128, dtype, False, True)):
        x, res, w, b = inputs(g, rows, cols, dtype, "cuda", rms, residual, param_dtype)
        y, h, q = fp8_norm(x, res, w, b, rms, 1e-6, transpose=transpose,
                           power_of_2_scales=pow2)
        assert_same(q, fp8_quantize(y, "1x128", "e4m3", transpose, pow2), f"{rows}x{cols}")
        want_y, want_h, _, _ = plain(x, res, w, b, rms, 1e-6)
        torch.testing.assert_close(y, want_y, rtol=1e-2, atol=1e-2)
        assert (y != want_y).float().mean() < 0.01
        if residual:
            assert torch.equal(h, want_h)


def test_opcheck():
    """The fake kernel's shapes, dtypes and strides are the real kernel's (torch.compile)."""
    x = torch.randn(48, 256).bfloat16()
    res = torch.randn(48, 256).bfloat16()
    w, b = torch.ones(256), torch.zeros(256)
    for args in ((x, None, [256], w, None, 1e-6, True, False, "1x128", "e4m3", True, False),
                 (x, res, [256], w, b, 1e-5, False, False, "tensorwise", "e5m2", False, True)):
        torch.library.opcheck(ops.fp8_norm_forward.default, args)


def test_argument_errors():
    x = torch.randn(4, 128).bfloat16()
    with pytest.raises(TypeError, match="fp8_rms_norm: x must be float32, float16 or bfloat16, "
                                        "got float64"):
        fp8_rms_norm(x.double(), 128)
    with pytest.raises(ValueError, match="scaling must be '1x128' or 'tensorwise'"):
        fp8_rms_norm(x, 128, scaling="128x128")
    with pytest.raises(ValueError, match="fp8_layer_norm: weight must have shape"):
        fp8_layer_norm(x, 128, torch.ones(64))
    with pytest.raises(ValueError, match="fp8_rms_norm: residual must have x's shape"):
        fp8_rms_norm(x, 128, residual=x[:2])
    with pytest.raises(ValueError, match="format must be 'e4m3' or 'e5m2'"):
        fp8_rms_norm(x, 128, format="e3m4")


def test_fuse_norms_write_fp8_for_the_layers(seed):
    """fuse(model, fp8=): the decoder's norms (the plain one before attention, the add+norm
    before the MLP) write their output in FP8, which the q/k/v projections and the gated MLP
    read; losses and gradients equal those of the same model whose layers quantize the norms'
    outputs themselves, bit for bit; the final norm, which feeds the bf16 LM head, stops
    writing FP8 after one forward."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    model = fuse(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), fp8=Fp8Recipe())
    ids = torch.randint(0, 96, (2, 16))
    layer = model.model.layers[0]

    def step(producing):
        for m in model.modules():
            if hasattr(m, "_fp8_reads"):
                m.fp8, m._fp8_reads = (Fp8Recipe() if producing else None), None
        out = []
        for _ in range(2):
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        return out

    produced = step(True)
    assert layer.input_layernorm._fp8_reads == [3]  # q, k, v
    assert layer.post_attention_layernorm._fp8_reads == [1]  # the gated MLP
    assert model.model.norm.fp8 is None  # the head's input: not read in FP8
    plain_run = step(False)
    for a, b in zip(produced, plain_run):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
