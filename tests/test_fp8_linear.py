"""fp8_linear / Fp8Linear: the forward and both gradients against the float64 products of the
quantized operands (exactly the GEMMs' inputs), against the unquantized float64 layer within the
formats' rounding, each recipe, the GEMMs left in high precision, autocast with float32 weights,
the module as a drop-in nn.Linear, torch.compile without graph breaks."""

import importlib

import numpy as np
import pytest
import torch
from torch import nn

from fusedlayers import Fp8Recipe
from fusedlayers.torch import Fp8Linear, fp8_linear, fp8_quantize

gemm_module = importlib.import_module("fusedlayers.torch.fp8_gemm")
linear_module = importlib.import_module("fusedlayers.torch.fp8_linear")

RECIPES = {"blockwise": Fp8Recipe(), "tensorwise": Fp8Recipe("tensorwise"),
           "hybrid": Fp8Recipe("tensorwise", "hybrid"),
           "blockwise-pow2": Fp8Recipe(power_of_2_scales=True),
           "blockwise-wgrad-tiles": Fp8Recipe(wgrad_x_scaling="128x128")}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")])]


def deq(t, scale_inv, scaling):
    return torch.from_numpy(gemm_module.dequantize(t, scale_inv, scaling))


def layer(g, device, dtype, tokens=(5, 16), in_f=256, out_f=176):
    x = torch.randn(*tokens, in_f, generator=g, dtype=torch.float64)
    w = torch.randn(out_f, in_f, generator=g, dtype=torch.float64) / 16
    b = torch.randn(out_f, generator=g, dtype=torch.float64)
    dy = torch.randn(*tokens, out_f, generator=g, dtype=torch.float64)
    return [t.to(dtype).to(device) for t in (x, w, b, dy)]


def close(got, want, rel, what):
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err <= rel, f"{what}: normwise error {err:.3g} > {rel:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_gemms_see_the_quantized_operands(recipe, device, seed):
    """y, dx and dW are the float64 products of exactly the quantized x, W, dy (and their
    transposes' quantizations), up to the GEMMs' accumulation."""
    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, device, torch.float32)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = fp8_linear(x, w, b, r)
    y.backward(dy)
    s_in, s_w, pow2 = r.input_scaling, r.weight_scaling, r.power_of_2_scales
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 176)
    qx = fp8_quantize(x2, s_in, "e4m3", True, pow2, r.input_t_scaling)
    qw = fp8_quantize(w.detach(), s_w, "e4m3", True, pow2)
    qdy = fp8_quantize(dy2, s_in, r.grad_format, True, pow2)
    want_y = deq(qx.data, qx.scale_inv, s_in) @ deq(qw.data, qw.scale_inv, s_w).T + \
        b.detach().double().cpu()
    want_dx = deq(qdy.data, qdy.scale_inv, s_in) @ deq(qw.data_t, qw.scale_inv_t, s_w).T
    want_dw = deq(qdy.data_t, qdy.scale_inv_t, s_in) @ \
        deq(qx.data_t, qx.scale_inv_t, r.input_t_scaling).T
    tol = 1e-3 if device == "cuda" else 1e-5  # the tensor cores' FP8 accumulation; float32 sums
    close(y.reshape(-1, 176), want_y, tol, "y")
    close(x.grad.reshape(-1, 256), want_dx, tol, "dx")
    close(w.grad, want_dw, tol, "dW")
    close(b.grad, dy2.double().cpu().sum(0), 1e-6, "db")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_near_the_float64_layer(recipe, dtype, device, seed):
    """Against x W^T + b in float64 on the unquantized values: each quantized operand is off by
    at most half its format's step (2^-4 relative for E4M3, 2^-3 for E5M2), so a product of two
    is off normwise by less than sqrt(2) of that; 1.5x for the second-order terms and the
    dtype's own rounding."""
    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, device, dtype)
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    (x64 @ w64.T + b64).backward(dy.double().cpu())
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = fp8_linear(x, w, b, r)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    fwd = 1.5 * 2 ** 0.5 * 2 ** -4
    bwd = 1.5 * (2 ** -8 + 2 ** -6) ** 0.5 if r.grad_format == "e5m2" else fwd
    close(y, (x64 @ w64.T + b64).detach(), fwd, "y")
    close(x.grad, x64.grad, bwd, "dx")
    close(w.grad, w64.grad, bwd, "dW")
    close(b.grad, b64.grad, 2 ** -7, "db")


@pytest.mark.parametrize("gemms", [("fprop",), ("dgrad", "wgrad"), ("wgrad",), ()], ids=str)
def test_gemms_left_in_high_precision(gemms, seed):
    """A GEMM the recipe leaves out is F.linear's (exact in float64-accumulated float32 here);
    those it names are FP8 (off by the formats' rounding)."""
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, "cpu", torch.float32)
    x.requires_grad_(), w.requires_grad_()
    y = fp8_linear(x, w, b, Fp8Recipe(gemms=gemms))
    y.backward(dy)
    x64, w64 = x.detach().double(), w.detach().double()
    got = {"fprop": y, "dgrad": x.grad, "wgrad": w.grad}
    want = {"fprop": x64 @ w64.T + b.double(), "dgrad": dy.double() @ w64,
            "wgrad": dy.double().reshape(-1, 176).T @ x64.reshape(-1, 256)}
    for name in got:
        err = (got[name].double() - want[name]).norm() / want[name].norm()
        assert (err > 1e-3) == (name in gemms), f"{name}: error {err:.3g}"


@pytest.mark.parametrize("tokens", [37, 0])
def test_token_counts_off_16_run_as_linear(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, "cpu", torch.float32, tokens=(tokens,))
    torch.testing.assert_close(fp8_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                               rtol=0, atol=0)


def test_autocast_with_float32_weights(seed):
    """Under autocast y is bfloat16 (as F.linear's), the gradients float32 like the weights."""
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, "cpu", torch.float32)
    w.requires_grad_(), b.requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = fp8_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_module_is_a_drop_in_linear(seed):
    lin = nn.Linear(256, 176)
    fp8 = Fp8Linear.from_linear(lin, Fp8Recipe("tensorwise"))
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    assert fp8.state_dict().keys() == lin.state_dict().keys()
    x = torch.randn(64, 256)
    close(fp8(x).detach(), lin(x).detach().double(), 0.15, "y")
    assert "recipe=Fp8Recipe(scaling='tensorwise'" in repr(fp8)
    odd = nn.Linear(100, 30)  # sizes off the rules: runs as nn.Linear
    torch.testing.assert_close(Fp8Linear.from_linear(odd)(x[:, :100]), odd(x[:, :100]),
                               rtol=0, atol=0)


def test_compiles_without_graph_breaks(seed):
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(176, 256, requires_grad=True)
    compiled = torch.compile(fp8_linear, backend="aot_eager", fullgraph=True)
    y = compiled(x, w)
    y.sum().backward()
    torch.testing.assert_close(y, fp8_linear(x, w), rtol=0, atol=0)


def test_argument_errors():
    with pytest.raises(ValueError, match="in_features and out_features must be multiples of 16, "
                                         "got weight \\[30, 100\\]"):
        fp8_linear(torch.randn(4, 100), torch.randn(30, 100))
    with pytest.raises(ValueError, match="x's last dimension must be weight's in_features 128"):
        fp8_linear(torch.randn(4, 100), torch.randn(32, 128))
    with pytest.raises(ValueError, match="format 'hybrid' \\(E5M2 gradients\\) needs scaling "
                                         "'tensorwise'"):
        Fp8Recipe(format="hybrid")
    with pytest.raises(ValueError, match="scaling must be 'blockwise' or 'tensorwise', got "
                                         "'rowwise'"):
        Fp8Recipe("rowwise")
    with pytest.raises(ValueError, match="fast_accum needs scaling 'tensorwise'"):
        Fp8Recipe(fast_accum=True)
    with pytest.raises(ValueError, match="gemms must be among"):
        Fp8Recipe(gemms=("bprop",))
    with pytest.raises(ValueError, match="wgrad_x_scaling must be '1x128' or '128x128', got "
                                         "'1x64'"):
        Fp8Recipe(wgrad_x_scaling="1x64")
    with pytest.raises(ValueError, match="wgrad_x_scaling '128x128' needs scaling 'blockwise'"):
        Fp8Recipe("tensorwise", wgrad_x_scaling="128x128")


def test_fuse_swaps_linears_but_head_router_and_odd_sizes(seed):
    """fuse(model, fp8=recipe): the linears become Fp8Linear sharing their Parameters (the
    state_dict is unchanged); the LM head, a router beside its experts and a layer of 30 outputs
    are left and reported; the loss stays near the bf16-free float32 loss."""
    from fusedlayers.torch import fuse

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 16, bias=False)
            self.experts = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])

        def forward(self, x):
            return x + self.gate(x)[..., :1] * self.experts[0](x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.moe, self.odd = nn.Linear(32, 64), Moe(), nn.Linear(64, 30)
            self.lm_head = nn.Linear(30, 48)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, x):
            return self.lm_head(self.odd(self.moe(torch.relu(self.up(x)))))

    model = Model()
    keys = {k: v for k, v in model.state_dict().items()}
    x = torch.randn(64, 32)
    want = model(x).detach().double()
    fuse(model, fp8=Fp8Recipe())
    assert type(model.up) is Fp8Linear and type(model.moe.experts[1]) is Fp8Linear
    assert type(model.moe.gate) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(model.odd) is nn.Linear
    left = {path: why for path, _, why in model.fusedlayers_report.left}
    assert "router" in left["moe.gate"] and "LM head" in left["lm_head"]
    assert "multiples of 16" in left["odd"]
    state = model.state_dict()
    assert state.keys() == keys.keys() and all(state[k] is keys[k] or torch.equal(state[k], keys[k])
                                              for k in keys)
    close(model(x).detach(), want, 0.15, "y")
    swapped = {path: what for path, _, what in model.fusedlayers_report.swapped}
    assert swapped["up"].endswith("(blockwise, e4m3, fprop+dgrad+wgrad)")
    tiles = fuse(Model(), fp8=Fp8Recipe(wgrad_x_scaling="128x128")).fusedlayers_report.swapped
    assert dict((p, w) for p, _, w in tiles)["up"].endswith(
        "(blockwise, e4m3, fprop+dgrad+wgrad, wgrad's x^T by 128x128 tiles)")
    with pytest.raises(TypeError, match="fp8 must be a fusedlayers.Fp8Recipe or None"):
        fuse(model, fp8="blockwise")


def test_example_trains_in_fp8(tmp_path):
    """examples/train_hf_llama.py --fp8: fuse() makes the linears FP8 and the short run's curve
    stays within the bf16 run's tolerances of the unfused one (the script's own checks)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "train_hf_llama.py", "--fp8", "blockwise", "--steps",
                          "10", "--log-every", "5", "--batch-size", "8", "--max-held-out", "inf",
                          "--plot", str(tmp_path / "loss.png")], cwd=root / "examples",
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "fusedlayers.torch.Fp8Linear (blockwise" in run.stdout
    assert "left    lm_head: torch.nn.Linear: fp8: the output embeddings" in run.stdout


def test_one_quantization_per_tensor(monkeypatch, seed):
    """Three Fp8Linear layers reading one tensor (attention's q, k, v) quantize it once and save
    one x^T, with the outputs and gradients of three quantizations; an in-place change makes the
    next read quantize again."""
    fp8_module = importlib.import_module("fusedlayers.torch.fp8")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 128, generator=g).bfloat16().requires_grad_()
    layers = [Fp8Linear(128, 64, bias=False, dtype=torch.bfloat16) for _ in range(3)]
    separate = [layer(x.clone()) for layer in layers]
    calls = []  # the inputs' quantizations (the weights' are fp8_linear's own calls)
    real = fp8_module.fp8_quantize
    monkeypatch.setattr(fp8_module, "fp8_quantize", lambda *a: calls.append(1) or real(*a))
    shared = [layer(x) for layer in layers]
    assert calls == [1]
    dys = [torch.randn(32, 64, generator=g).bfloat16() for _ in layers]
    grads = [torch.autograd.grad(ys, [x, *(m.weight for m in layers)], dys)
             for ys in (separate, shared)]
    assert all(torch.equal(a, b) for a, b in zip(separate, shared))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with torch.no_grad():
        x.mul_(2)
        assert torch.equal(layers[0](x), layers[0](x.clone()))
        assert calls == [1, 1, 1]  # x changed: quantized again, as is its copy
        layers[1](x)
        assert calls == [1, 1, 1]
    with torch.inference_mode():  # inference tensors keep no version: quantized per layer
        xi = x.detach().clone()
        assert torch.equal(layers[1](xi), layers[1](x.detach()))


def test_fused_llama_in_fp8_compiles_without_graph_breaks(seed):
    """fuse(model, fp8=recipe) on a Hugging Face Llama (FP8 attention projections and gated MLP):
    no graph break, and the compiled loss and gradients equal eager's (under torch.compile each
    layer quantizes its own input, eagerly q/k/v share one quantization: the same bits)."""
    transformers = pytest.importorskip("transformers")
    from fusedlayers.torch import fuse
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = fuse(transformers.LlamaForCausalLM(config), fp8=Fp8Recipe(), verbose=False)
    assert sum(type(m) is Fp8Linear for m in model.modules()) == 14  # q k v o gate up down
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(seed))
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(m):
        loss = m(input_ids=ids, labels=ids).loss
        return [loss, *torch.autograd.grad(loss, params, allow_unused=True)]
    eager = loss_and_grads(model)
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise"])
def test_recomputed_weights_give_the_same_results_and_keep_no_fp8_weight(scaling, device, seed):
    """recompute_fp8_weights: y, dx, dW and db bit for bit those of keeping the forward's FP8
    W^T (the same quantization, made in the backward); the forward saves no FP8 tensor of the
    weight's size, where the kept run saves W^T."""
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = layer(g, device, torch.bfloat16)
    results = {}
    for recompute in (False, True):
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            y = fp8_linear(xs, ws, bs, Fp8Recipe(scaling, recompute_fp8_weights=recompute))
        fp8_weights = [t for t in saved
                       if t.dtype == torch.float8_e4m3fn and t.numel() == w.numel()]
        assert len(fp8_weights) == (0 if recompute else 1)
        y.backward(dy)
        results[recompute] = [y.detach(), xs.grad, ws.grad, bs.grad]
    for kept, recomputed in zip(results[False], results[True]):
        assert torch.equal(kept, recomputed)


def test_fused_llama_saves_less_for_its_backward_in_fp8_than_in_bf16(seed):
    """What a fused Llama's forward saves for its backward (bf16 weights; the parameters
    themselves not counted): with recompute_fp8_weights the FP8 model saves no FP8 weight and
    less than the bf16 fused model (its GEMMs' inputs kept as FP8 x^T in place of bf16 x), where
    keeping the weights' FP8 W^T saves more than bf16 at this size."""
    transformers = pytest.importorskip("transformers")
    from fusedlayers.torch import fuse
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=2048)
    # 384 tokens: no activation's x^T of a weight's shape
    ids = torch.randint(0, 2048, (1, 384), generator=torch.Generator().manual_seed(seed))

    def saved_bytes(recipe):
        torch.manual_seed(seed)
        model = fuse(transformers.LlamaForCausalLM(config).to(torch.bfloat16), fp8=recipe)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        weights = {s for p in model.parameters() if p.dim() == 2
                   for s in (tuple(p.shape), tuple(p.shape[::-1]))}
        storages, fp8_weights = {}, 0

        def pack(t):
            nonlocal fp8_weights
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
                fp8_weights += t.dtype == torch.float8_e4m3fn and tuple(t.shape) in weights
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(storages.values()), fp8_weights

    bf16, _ = saved_bytes(None)
    kept, kept_weights = saved_bytes(Fp8Recipe(recompute_fp8_weights=False))
    recomputed, recomputed_weights = saved_bytes(Fp8Recipe())
    assert recomputed_weights == 0 and kept_weights > 0
    assert recomputed < bf16 < kept, (recomputed, bf16, kept)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise"])
def test_cuda_graph_capture(scaling, seed):
    """No host sync in the FP8 path: an Fp8Linear and an FP8 gated MLP, forward and backward,
    capture in one CUDA graph; replayed on new x and dy, the output and every gradient equal an
    eager run's on the same inputs bit for bit (tensorwise scales come from amaxes on the
    device, never read back)."""
    from fusedlayers.torch import fp8_gated_mlp
    recipe = Fp8Recipe(scaling)
    g = torch.Generator().manual_seed(seed)
    proj = Fp8Linear(256, 256, recipe=recipe).to("cuda", torch.bfloat16)
    w_gate, w_up, w_down = (nn.Parameter((torch.randn(*s, generator=g) / 16).to(
        "cuda", torch.bfloat16)) for s in ((384, 256), (384, 256), (256, 384)))
    params = [*proj.parameters(), w_gate, w_up, w_down]

    def step(x, dy):
        y = fp8_gated_mlp(proj(x), (w_gate, w_up), w_down, "silu", recipe)
        y.backward(dy)
        return y

    def inputs():
        return ((torch.randn(4, 16, 256, generator=g) * 4).to("cuda", torch.bfloat16)
                .requires_grad_(), torch.randn(4, 16, 256, generator=g).to("cuda", torch.bfloat16))

    static_x, static_dy = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (plans, workspaces) outside the capture
        for _ in range(2):
            step(static_x, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    for t in [static_x, *params]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(static_x, static_dy)
    x, dy = inputs()
    with torch.no_grad():
        static_x.copy_(x)
        static_dy.copy_(dy)
    graph.replay()
    torch.cuda.synchronize()
    captured = [static_y.detach().clone(), *(t.grad.clone() for t in [static_x, *params])]
    for t in [x, *params]:
        t.grad = None
    want = [step(x, dy).detach(), *(t.grad for t in [x, *params])]
    names = ["y", "dx", *(n for n, _ in proj.named_parameters()), "w_gate", "w_up", "w_down"]
    for name, got, ref in zip(names, captured, want):
        assert torch.equal(got, ref), (name, (got.float() - ref.float()).abs().max().item(),
                                       ref.float().abs().max().item())
