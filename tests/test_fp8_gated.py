"""fp8_gated / fp8_gated_backward: bit for bit the unfused composition (the gated op, then
fp8_quantize) on every device; fp8_gated_mlp: its output and gradients
against the float64 MLP within FP8's rounding and against the unfused composition of Fp8Linear
layers, split or stacked gate/up weights, autocast with float32 masters; fuse(model, fp8=)
runs a Llama MLP through it."""

import importlib

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from fusedlayers import Fp8Recipe
from fusedlayers.torch import fp8_quantize, fuse
from fusedlayers.torch.fp8_gated import fp8_gated, fp8_gated_backward

mlp_module = importlib.import_module("fusedlayers.torch.fp8_mlp")

ACTIVATIONS = {"silu": (torch.ops.fusedlayers.swiglu, torch.ops.fusedlayers.swiglu_backward, ()),
               "gelu": (torch.ops.fusedlayers.geglu, torch.ops.fusedlayers.geglu_backward,
                        ("none",)),
               "gelu_tanh": (torch.ops.fusedlayers.geglu, torch.ops.fusedlayers.geglu_backward,
                             ("tanh",))}
SM90 = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")]
# (scaling, scaling_t) of the forward (the backward's x^T is scaled as its x)
SCALINGS = pytest.mark.parametrize("scaling,scaling_t", [("1x128", None), ("tensorwise", None),
                                                         ("1x128", "128x128")],
                                   ids=["1x128", "tensorwise", "1x128,t128x128"])
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def bits(t):
    return None if t is None else (t.view(torch.uint8) if t.element_size() == 1 else t).cpu()


def assert_same(got, want, what):
    for name, a, b in zip(("q", "scale_inv", "q_t", "scale_inv_t"), got, want):
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what}: {name} differs"


def halves(g, rows, cols, dtype, device, stacked):
    """gate and up: the chunk(2, -1) halves of one projection's output, or two tensors."""
    if stacked:
        gu = (torch.randn(rows, 2 * cols, generator=g) * 3).to(dtype).to(device)
        return gu.chunk(2, dim=-1)
    return [(torch.randn(rows, cols, generator=g) * 3).to(dtype).to(device) for _ in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@SCALINGS
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_equals_gated_then_quantize(activation, scaling, scaling_t, dtype, stacked, device, seed):
    """Rows off whole tiles (77, 130), several column tiles, with and without x^T, each format;
    the forward's x^T by 128x128 tiles (scaling_t) too."""
    g = torch.Generator().manual_seed(seed)
    forward, backward, extra = ACTIVATIONS[activation]
    for rows, cols, transpose, fmt in ((77, 384, True, "e4m3"), (130, 256, False, "e5m2")):
        gate, up = halves(g, rows, cols, dtype, device, stacked)
        dy = torch.randn(rows, cols, generator=g).to(dtype).to(device)
        want = fp8_quantize(forward(gate, up, *extra), scaling, fmt, transpose,
                            scaling_t=scaling_t)
        assert_same(fp8_gated(gate, up, activation, scaling, fmt, transpose,
                              scaling_t=scaling_t), want, "forward")
        dgate, dup = backward(dy, gate, up, *extra)
        want = fp8_quantize(torch.cat([dgate, dup], -1), scaling, fmt, transpose)
        assert_same(fp8_gated_backward(dy, gate, up, activation, scaling, fmt, transpose), want,
                    "backward")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@SCALINGS
def test_cuda_many_tiles_and_unaligned_views(scaling, scaling_t, seed):
    """CUDA against CUDA's own composition (the gated ops' CUDA math is not the CPU's to the
    bit; the quantization is: test_fp8.py): many tiles, the halves of one projection (16-byte
    loads) and an unaligned view (element loads), power-of-two scales."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(300, 2 * 1024 + 8, generator=g) * 4).bfloat16().cuda()
    dy = torch.randn(300, 1024, generator=g).bfloat16().cuda()
    for gate, up in (gu[:, :2048].chunk(2, -1), (gu[:, 1:1025], gu[:, 1025:2049])):
        for activation, (forward, backward, extra) in ACTIVATIONS.items():
            want = fp8_quantize(forward(gate, up, *extra), scaling, "e4m3", True, True,
                                scaling_t)
            assert_same(fp8_gated(gate, up, activation, scaling, "e4m3", True, True, scaling_t),
                        want, f"forward {activation}")
            want = fp8_quantize(torch.cat(backward(dy, gate, up, *extra), -1), scaling, "e4m3",
                                True)
            assert_same(fp8_gated_backward(dy, gate, up, activation, scaling, "e4m3", True), want,
                        f"backward {activation}")


def test_opcheck():
    """The fake kernels' shapes, dtypes and strides are the real kernels' (torch.compile)."""
    gu = torch.randn(48, 512).bfloat16()
    gate, up = gu.chunk(2, -1)
    dy = torch.randn(48, 256).bfloat16()
    for scaling, transpose in (("1x128", True), ("tensorwise", False)):
        torch.library.opcheck(torch.ops.fusedlayers.fp8_gated_forward.default,
                              (gate, up, "silu", scaling, "e4m3", transpose, False))
        torch.library.opcheck(torch.ops.fusedlayers.fp8_gated_backward.default,
                              (dy, gate, up, "gelu", scaling, "e5m2", transpose, False))
    torch.library.opcheck(torch.ops.fusedlayers.fp8_gated_forward.default,
                          (gate, up, "silu", "1x128", "e4m3", True, False, "128x128"))


def test_argument_errors():
    gate = torch.randn(4, 128).bfloat16()
    with pytest.raises(TypeError, match="gate must be float16 or bfloat16, got float32"):
        fp8_gated(gate.float(), gate.float())
    with pytest.raises(ValueError, match="last dimension must be a multiple of 128, got 96"):
        fp8_gated(gate[:, :96], gate[:, :96])
    with pytest.raises(ValueError, match="scaling must be '1x128' or 'tensorwise'"):
        fp8_gated(gate, gate, scaling="128x128")
    with pytest.raises(ValueError, match="scaling_t must be scaling \\('tensorwise'\\), or "
                                         "'128x128' with scaling '1x128', got '128x128'"):
        fp8_gated(gate, gate, scaling="tensorwise", transpose=True, scaling_t="128x128")
    with pytest.raises(ValueError, match="activation must be 'silu', 'gelu' or 'gelu_tanh', "
                                         "got 'relu'"):
        fp8_gated(gate, gate, "relu")
    with pytest.raises(ValueError, match="up must have gate's shape"):
        fp8_gated(gate, gate[:2])
    with pytest.raises(ValueError, match="dy must have gate's shape"):
        fp8_gated_backward(gate[:2], gate, gate)


def mlp(g, device, dtype, hidden=64, ffn=256, tokens=(3, 16), stacked=False):
    x = torch.randn(*tokens, hidden, generator=g, dtype=torch.float64)
    w_gu = torch.randn(2 * ffn, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    w_down = torch.randn(hidden, ffn, generator=g, dtype=torch.float64) / ffn ** 0.5
    dy = torch.randn(*tokens, hidden, generator=g, dtype=torch.float64)
    x, w_gu, w_down, dy = [t.to(dtype).to(device) for t in (x, w_gu, w_down, dy)]
    ws = [w_gu] if stacked else [w.contiguous() for w in w_gu.chunk(2)]
    return x.requires_grad_(), [w.requires_grad_() for w in ws], w_down.requires_grad_(), dy


def grads(x, ws, w_down, y, dy):
    y.backward(dy)
    out = [y.detach(), x.grad, *[w.grad for w in ws], w_down.grad]
    for t in (x, *ws, w_down):
        t.grad = None
    return out


def rel_err(got, want):
    return float((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm())


def close(got, want, rel, what):
    err = rel_err(got, want)
    assert err <= rel, f"{what}: normwise error {err:.3g} > {rel:.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=SM90)])
@pytest.mark.parametrize("stacked", [False, True], ids=["gate,up", "gate_up"])
@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe("tensorwise"),
                                    Fp8Recipe("tensorwise", "hybrid"),
                                    Fp8Recipe(wgrad_x_scaling="128x128")], ids=str)
def test_mlp_against_float64_and_the_unfused_layers(recipe, stacked, device, seed):
    """y, dx and every dW: within FP8's rounding of the float64 MLP (E4M3's relative step
    2^-4 through two layers; E5M2 gradients 2^-3), no further from it than the same MLP made of
    Fp8Linear layers (and the plain activation) plus 15%, and within 3% (E5M2 gradients: 6%) of
    that MLP wherever their quantized operands agree (all but tensorwise scaling of separate gate
    and up weights, which the fused op scales as one tensor): bf16's rounding of the activation,
    the GEMMs' sums."""
    g = torch.Generator().manual_seed(seed)
    x, ws, w_down, dy = mlp(g, device, torch.bfloat16, stacked=stacked)
    gate_up = ws[0] if stacked else tuple(ws)
    fused = grads(x, ws, w_down, mlp_module.fp8_gated_mlp(x, gate_up, w_down, "silu", recipe), dy)
    unfused = grads(x, ws, w_down, mlp_module.reference(x, gate_up, w_down, "silu", recipe), dy)
    x64 = x.detach().double().requires_grad_()
    ws64 = [w.detach().double().requires_grad_() for w in ws]
    wd64 = w_down.detach().double().requires_grad_()
    gate, up = (x64 @ ws64[0].T).chunk(2, -1) if stacked else (x64 @ ws64[0].T, x64 @ ws64[1].T)
    exact = grads(x64, ws64, wd64, (torch.nn.functional.silu(gate) * up) @ wd64.T, dy.double())
    names = ["y", "dx", *[f"dW{i}" for i in range(len(ws))], "dW_down"]
    same_operands = recipe.scaling == "blockwise" or stacked
    for name, got, unf, want in zip(names, fused, unfused, exact):
        close(got, want, 0.15 if recipe.format == "hybrid" else 0.1, f"{name} vs float64")
        close(got, want, 1.15 * rel_err(unf, want), f"{name} vs float64, beside the layers'")
        if same_operands:  # E5M2's step is twice E4M3's: a bf16 difference flips more roundings
            close(got, unf, 0.06 if recipe.format == "hybrid" else 0.03,
                  f"{name} vs Fp8Linear layers")


def test_mlp_autocast_with_float32_masters(seed):
    """Under autocast x and the weights are float32: the GEMMs run in bf16 outputs, gradients
    come back in float32."""
    g = torch.Generator().manual_seed(seed)
    x, ws, w_down, dy = mlp(g, "cpu", torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        y = mlp_module.fp8_gated_mlp(x, tuple(ws), w_down)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert x.grad.dtype == ws[0].grad.dtype == w_down.grad.dtype == torch.float32
    with torch.autocast("cpu", torch.bfloat16):
        want = mlp_module.reference(x, tuple(ws), w_down)
    close(y.detach(), want.detach(), 0.03, "y")


def test_mlp_backward_frees_as_it_goes(seed):
    """The backward frees its saved activations past their last use: a second backward through
    one forward raises rather than reading freed tensors, and under activation checkpointing
    (recomputed saved tensors, freed likewise) the gradients equal the plain run's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x, ws, w_down, dy = mlp(g, "cpu", torch.bfloat16)
    y = mlp_module.fp8_gated_mlp(x, tuple(ws), w_down)
    y.backward(dy, retain_graph=True)
    plain = [t.grad.clone() for t in (x, *ws, w_down)]
    with pytest.raises(RuntimeError, match="second backward through one forward"):
        y.backward(dy)
    for t in (x, *ws, w_down):
        t.grad = None
    y = torch.utils.checkpoint.checkpoint(mlp_module.fp8_gated_mlp, x, tuple(ws), w_down,
                                          use_reentrant=False)
    y.backward(dy)
    for want, t in zip(plain, (x, *ws, w_down)):
        assert torch.equal(t.grad, want)


def test_mlp_argument_errors():
    x = torch.randn(16, 64).bfloat16()
    w = torch.randn(256, 64).bfloat16()
    wd = torch.randn(64, 256).bfloat16()
    with pytest.raises(ValueError, match="token count must be a positive multiple of 16, got 8"):
        mlp_module.fp8_gated_mlp(x[:8], (w, w), wd)
    with pytest.raises(ValueError, match="ffn must be a multiple of 128"):
        mlp_module.fp8_gated_mlp(x, (w[:200], w[:200]), wd[:, :200])
    with pytest.raises(ValueError, match="do not make an MLP"):
        mlp_module.fp8_gated_mlp(x, (w, w), wd.T)
    with pytest.raises(ValueError, match="all three GEMMs"):
        mlp_module.fp8_gated_mlp(x, (w, w), wd, recipe=Fp8Recipe(gemms=("fprop",)))
    with pytest.raises(TypeError, match="float16 or bfloat16, got torch.float32"):
        mlp_module.fp8_gated_mlp(x.float(), (w.float(), w.float()), wd.float())


def test_fuse_runs_a_llama_mlp_through_it(monkeypatch, seed):
    """fuse(model, fp8=) swaps the projections for Fp8Linear; the fused gated MLP then takes the
    fp8_gated_mlp path (bf16 tokens in multiples of 16), and the plain layers otherwise."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    fuse(model, fp8=Fp8Recipe())
    calls = []
    real = mlp_module.fp8_gated_mlp
    monkeypatch.setattr(mlp_module, "fp8_gated_mlp",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids).logits.float().sum().backward()
    assert calls == [1]
    model(input_ids=ids[:, :5])
    assert calls == [1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=SM90)])
@pytest.mark.parametrize("stacked", [False, True], ids=["gate,up", "gate_up"])
@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise"])
def test_mlp_recomputed_weights_give_the_same_results_and_keep_no_fp8_weight(scaling, stacked,
                                                                               device, seed):
    """recompute_fp8_weights: y and every gradient bit for bit those of keeping the forward's
    FP8 W^T (the same quantizations, made in the backward); the forward saves no FP8 tensor of a
    weight's size, where the kept run saves both weights'."""
    g = torch.Generator().manual_seed(seed)
    x, ws, w_down, dy = mlp(g, device, torch.bfloat16, stacked=stacked)
    gate_up = ws[0] if stacked else tuple(ws)
    sizes = {2 * w_down.numel(), w_down.numel()}  # [gate; up] and down
    results = {}
    for recompute in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            y = mlp_module.fp8_gated_mlp(x, gate_up, w_down, "silu",
                                         Fp8Recipe(scaling, recompute_fp8_weights=recompute))
        fp8_weights = {t.numel() for t in saved if t.dtype == torch.float8_e4m3fn} & sizes
        assert fp8_weights == (set() if recompute else sizes)
        results[recompute] = grads(x, ws, w_down, y, dy)
    for kept, recomputed in zip(results[False], results[True]):
        assert torch.equal(kept, recomputed)
