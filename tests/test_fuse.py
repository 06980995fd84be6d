"""fusedlayers.torch.fuse on real model code (Hugging Face BERT, ViT, GPT-2, and the decoders
Llama, Mistral, Qwen2, Phi-3 and Gemma, from small configs, torchvision-style nn.Sequential, timm's Mlp where timm imports): what it
swaps, that it shares the Parameters, that outputs and gradients are unchanged in eval() and
train(), what it leaves and why, and that the fused models trace under torch.compile without
graph breaks."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from fusedlayers.torch import (FusedConv1DGELU, FusedLinearGELU, FusedReLUScale, GeGLUMLP,
                               LayerNorm, RMSNorm, SwiGLUMLP, fuse)
from fusedlayers.torch.gated_mlp import GatedMLP
from _helpers import rel_err

transformers.logging.set_verbosity_error()

SEQ, BATCH, VOCAB = 12, 3, 128
# Llama-style decoders: (config class, model class)
DECODERS = {name: (getattr(transformers, f"{cls}Config"), getattr(transformers, f"{cls}Model"))
            for name, cls in (("llama", "Llama"), ("gemma", "Gemma"), ("mistral", "Mistral"),
                              ("qwen2", "Qwen2"), ("phi3", "Phi3"))}


def hf_model(name: str, dtype=torch.float32) -> tuple[nn.Module, dict]:
    """A small Hugging Face model built from config (no download) and its inputs."""
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96)
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=64, **common))
        inputs = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}
    elif name == "vit":
        model = transformers.ViTModel(transformers.ViTConfig(image_size=16, patch_size=4,
                                                             num_channels=3, **common))
        inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, dtype=dtype)}
    elif name == "gpt2":
        model = transformers.GPT2Model(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=96,
            bos_token_id=0, eos_token_id=0))
        inputs = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}
    elif name in DECODERS:
        config_cls, model_cls = DECODERS[name]
        config = config_cls(vocab_size=VOCAB, max_position_embeddings=64, num_key_value_heads=2,
                            pad_token_id=0,
                            head_dim=16, **common)
        model = model_cls(config)
        with torch.no_grad():  # gains away from their init (1, or 0 for Gemma's 1 + weight)
            for m in model.modules():
                if type(m).__name__.endswith("RMSNorm"):
                    m.weight.uniform_(-0.5, 0.5)
        inputs = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}
    else:
        raise ValueError(name)
    return model.to(dtype), inputs


# What fuse() must find in each model: (LayerNorms, RMSNorms, Linear+GELU pairs, fused class,
# GELU form, gated MLPs, their class, attention modules whose RoPE is fused).
EXPECTED = {
    "bert": (5, 0, 2, FusedLinearGELU, "none", 0, None, 0),  # 2 per layer + embeddings
    "vit": (5, 0, 2, FusedLinearGELU, "none", 0, None, 0),  # 2 per layer + final; fc1 + GELU
    "gpt2": (5, 0, 2, FusedConv1DGELU, "tanh", 0, None, 0),  # 2 per layer + ln_f; c_fc + gelu_new
    "llama": (0, 5, 0, None, None, 2, SwiGLUMLP, 2),  # RMSNorm: 2 per layer + final; SwiGLU MLPs
    "mistral": (0, 5, 0, None, None, 2, SwiGLUMLP, 2),
    "qwen2": (0, 5, 0, None, None, 2, SwiGLUMLP, 2),
    "phi3": (0, 5, 0, None, None, 2, SwiGLUMLP, 2),  # one gate_up_proj, chunk(2, -1)
    # GemmaRMSNorm (1 + weight, zero-centred); gelu_pytorch_tanh MLPs: GeGLU
    "gemma": (0, 5, 0, None, None, 2, GeGLUMLP, 2),
}


# Blocks whose residual add fuse() runs inside their norm: BERT's embeddings and two outputs per
# layer, ViT's and the decoders' post-attention add per layer; GPT-2's block has the
# cross-attention branch between its add and ln_2.
RESIDUAL_ADDS = {"bert": 5, "vit": 2, "gpt2": 0}


def swapped_count(name: str) -> int:
    n_ln, n_rms, n_pairs, _, _, n_mlp, _, n_rope = EXPECTED[name]
    return n_ln + n_rms + n_pairs + n_mlp + n_rope + RESIDUAL_ADDS.get(name, 2)


def output_and_grads(model, inputs, seed):
    torch.manual_seed(seed)  # the same dropout masks for both models in train()
    out = model(**inputs).last_hidden_state
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [p for _, p in model.named_parameters() if p.requires_grad],
                                g, allow_unused=True)
    return out, dict(zip(names, grads))


@pytest.mark.parametrize("train", (False, True), ids=("eval", "train"))
@pytest.mark.parametrize("name", EXPECTED)
def test_hf_model_fused_in_place_same_outputs_and_grads(name, train, seed):
    model, inputs = hf_model(name)
    model.train(train)
    original = copy.deepcopy(model)
    params_before = [(n, id(p)) for n, p in model.named_parameters()]
    state_before = {k: v.shape for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()

    assert fuse(model) is model
    assert torch.equal(torch.get_rng_state(), rng_before), "fuse() moved the random stream"
    n_ln, n_rms, n_pairs, fused_cls, form, n_mlp, mlp_cls, n_rope = EXPECTED[name]
    modules = list(model.modules())
    assert sum(isinstance(m, LayerNorm) for m in modules) == n_ln
    assert not any(isinstance(m, nn.LayerNorm) for m in modules)
    rms = [m for m in modules if isinstance(m, RMSNorm)]
    assert len(rms) == n_rms and all(m.zero_centered == (name == "gemma") for m in rms)
    assert not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, RMSNorm)
                   for m in modules)
    pairs = [m for m in modules if isinstance(m, (FusedLinearGELU, FusedConv1DGELU))]
    assert len(pairs) == n_pairs and all(type(m) is fused_cls and m.approximate == form
                                         for m in pairs)
    mlps = [m for m in modules if isinstance(m, GatedMLP)]
    assert len(mlps) == n_mlp and all(type(m) is mlp_cls for m in mlps)
    assert not n_mlp or not any(type(m).__name__.endswith("MLP") and not isinstance(m, GatedMLP)
                                for m in modules)
    if name == "gemma":
        assert all(m.approximate == "tanh" for m in mlps)
    # RoPE: per attention instance, the class and the modeling module untouched
    # RoPE and the residual adds: per attention and block instance
    own = [m for m in modules if "forward" in m.__dict__]
    roped = [m for m in own if type(m).__name__.endswith("Attention")]
    assert len(roped) == n_rope and len(own) - n_rope == RESIDUAL_ADDS.get(name, 2)
    assert all("forward" not in m.__dict__ for m in original.modules())
    assert all(m.training == train for m in modules)
    # The same Parameter objects under the same names: optimizer state and ties stay valid.
    assert [(n, id(p)) for n, p in model.named_parameters()] == params_before
    assert {k: v.shape for k, v in model.state_dict().items()} == state_before
    report = model.fusedlayers_report
    assert len(report.swapped) == swapped_count(name) and report.left == []

    out, grads = output_and_grads(model, inputs, seed)
    out_ref, grads_ref = output_and_grads(original, inputs, seed)
    assert rel_err(out, out_ref) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    # A gradient that is zero in exact arithmetic (attention's key bias) is rounding noise in
    # both runs: judged against the size of the whole gradient instead of its own.
    total = torch.cat([g.flatten() for g in grads_ref.values() if g is not None]).norm().item()
    for k in grads:
        if grads_ref[k] is None:
            assert grads[k] is None, k
            continue
        err = (grads[k] - grads_ref[k]).norm().item()
        assert err <= 1e-5 * max(grads_ref[k].norm().item(), 1e-3 * total), k


@pytest.mark.parametrize("name", EXPECTED)
def test_hf_model_bf16(name):
    model, inputs = hf_model(name, torch.bfloat16)
    original = copy.deepcopy(model).eval()
    fuse(model.eval())
    assert len(model.fusedlayers_report.swapped) == swapped_count(name)
    with torch.no_grad():
        out, ref = model(**inputs).last_hidden_state, original(**inputs).last_hidden_state
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 2e-2


def test_optimizer_made_before_fuse_still_steps_the_model():
    model, inputs = hf_model("bert")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fuse(model)
    dense = model.encoder.layer[0].intermediate.dense
    before = dense.weight.detach().clone()
    model(**inputs).last_hidden_state.square().mean().backward()
    assert dense.weight.grad is not None
    opt.step()
    assert not torch.equal(dense.weight, before)


def test_sequential_torchvision_style_and_relu():
    class MLP(nn.Sequential):  # torchvision.ops.MLP is such a Sequential
        pass

    mlp = MLP(nn.Linear(10, 32), nn.GELU(approximate="tanh"), nn.Dropout(0.0), nn.Linear(32, 10),
              nn.ReLU(), nn.LayerNorm(10))
    ref = copy.deepcopy(mlp)
    fuse(mlp)
    assert isinstance(mlp[0], FusedLinearGELU) and mlp[0].approximate == "tanh"
    assert isinstance(mlp[1], nn.Identity) and isinstance(mlp[4], FusedReLUScale)
    assert isinstance(mlp[5], LayerNorm)
    assert mlp[0].weight is ref[0].weight or torch.equal(mlp[0].weight, ref[0].weight)
    x = torch.randn(7, 10)
    assert rel_err(mlp(x), ref(x)) <= 1e-6
    assert list(mlp.state_dict()) == list(ref.state_dict())


def test_idempotent_and_switches():
    seq = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.ReLU())
    fuse(seq, linear_gelu=False, relu_scale=False)
    assert isinstance(seq[0], nn.Linear) and isinstance(seq[2], LayerNorm)
    assert isinstance(seq[3], nn.ReLU)
    fuse(seq)
    assert isinstance(seq[0], FusedLinearGELU) and isinstance(seq[3], FusedReLUScale)
    fuse(seq)
    assert seq.fusedlayers_report.swapped == []


def test_shared_layer_norm_stays_shared():
    ln = nn.LayerNorm(6)
    model = nn.ModuleDict({"a": nn.Sequential(ln), "b": nn.Sequential(ln)})
    fuse(model)
    assert model["a"][0] is model["b"][0] and isinstance(model["a"][0], LayerNorm)


class _Block(nn.Module):
    def __init__(self, forward_kind):
        super().__init__()
        self.fc, self.act, self.kind = nn.Linear(6, 6), nn.GELU(), forward_kind

    def forward(self, x):
        if self.kind == "reused":  # the linear output also feeds the residual add
            h = self.fc(x)
            return self.act(h) + h
        if self.kind == "twice":  # one GELU module applied twice
            return self.act(self.fc(self.act(x)))
        if self.kind == "functional":
            return F.gelu(self.fc(x))
        if self.kind == "untraceable":  # and its source feeds fc's output to the GELU and on
            h = self.fc(x)
            return self.act(h) if x.sum() > 0 else h
        raise ValueError(self.kind)


class _UntraceableNested(nn.Module):
    """torch.fx cannot trace the branch on a tensor; only the GELU sees fc's output."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(6, 6), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x)) if x.sum() > 0 else x


@pytest.mark.parametrize("kind,reason", [
    ("reused", "also feeds 1 other node"),
    ("twice", "called more than once"),
    ("functional", "function call in the forward"),
    ("untraceable", "cannot be traced by torch.fx"),
])
def test_left_with_a_reason(kind, reason):
    block = _Block(kind)
    ref = copy.deepcopy(block)
    fuse(block)
    assert isinstance(block.fc, nn.Linear) and isinstance(block.act, nn.GELU)
    (left,) = block.fusedlayers_report.left
    assert reason in left[2], left
    x = torch.randn(3, 6)
    torch.testing.assert_close(block(x), ref(x), rtol=0, atol=0)


def test_untraceable_forward_fused_from_its_source():
    block = _UntraceableNested()
    ref = copy.deepcopy(block)
    fuse(block)
    assert isinstance(block.fc, FusedLinearGELU) and isinstance(block.act, nn.Identity)
    assert not block.fusedlayers_report.left
    for sign in (1, -1):
        x = sign * torch.rand(3, 6)
        torch.testing.assert_close(block(x), ref(x))


@pytest.mark.parametrize("train", [False, True])
def test_whisper_encoder_layer(train):
    """Whisper's encoder layer: torch.fx cannot trace its forward (a checkpointing wrapper takes
    *args, attention returns a tuple); its fc1 + activation_fn MLP is found in the source."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer
    config = transformers.WhisperConfig(d_model=64, encoder_attention_heads=4,
                                        encoder_ffn_dim=96, activation_dropout=0.0,
                                        dropout=0.0, attention_dropout=0.0)
    layer = WhisperEncoderLayer(config).train(train)
    ref, weight = copy.deepcopy(layer), layer.fc1.weight
    fuse(layer)
    assert isinstance(layer.fc1, FusedLinearGELU) and isinstance(layer.activation_fn, nn.Identity)
    assert layer.fc1.weight is weight  # the Parameter is shared, not copied
    assert isinstance(layer.final_layer_norm, LayerNorm)
    assert not layer.fusedlayers_report.left, layer.fusedlayers_report
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    out, out_ref = layer(x, None), ref(x, None)
    out, out_ref = (o[0] if isinstance(o, tuple) else o for o in (out, out_ref))
    assert rel_err(out, out_ref) <= 1e-5
    (dx,) = torch.autograd.grad(out.sum(), x)
    (dx_ref,) = torch.autograd.grad(out_ref.sum(), x)
    assert rel_err(dx, dx_ref) <= 1e-5


def test_not_gelu_not_linear_not_swapped():
    class ScaledLinear(nn.Linear):  # a linear layer with a different forward: not recognised
        def forward(self, x):
            return super().forward(x) * 2

    seq = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), ScaledLinear(4, 4), nn.GELU(),
                        nn.Linear(4, 4), transformers.activations.QuickGELUActivation(),
                        nn.ReLU6())
    fuse(seq)
    assert seq.fusedlayers_report.swapped == [] and seq.fusedlayers_report.left == []


def test_hooked_linear_left_and_not_probed():
    seq = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    calls = []
    seq[0].register_forward_hook(lambda m, i, o: calls.append(1))
    fuse(seq)
    assert isinstance(seq[0], nn.Linear) and calls == []
    (left,) = seq.fusedlayers_report.left
    assert "hooks" in left[2]


def test_probe_mismatch_is_not_swapped():
    class DtypeDependentGELU(nn.Module):  # GELU on the float64 classification probe only
        def forward(self, x):
            return F.gelu(x) if x.dtype == torch.float64 else F.gelu(x) * 1.01

    seq = nn.Sequential(nn.Linear(4, 4), DtypeDependentGELU())
    fuse(seq)
    assert isinstance(seq[0], nn.Linear)
    (left,) = seq.fusedlayers_report.left
    assert "probe mismatch" in left[2]


def test_in_place_relu_whose_input_is_reused_is_left():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            x = x * 1
            self.relu(x)
            return x + 1  # reads the ReLU's in-place result through x

    block = Block()
    fuse(block)
    assert isinstance(block.relu, nn.ReLU)
    assert "in place" in block.fusedlayers_report.left[0][2]


def test_fuse_rejects_non_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fuse(lambda x: x)


def test_timm_mlp():
    timm = pytest.importorskip("timm", reason="timm needs torchvision, which has no CPU build "
                                              "for this torch; tested on the GPU machine")
    mlp = timm.layers.Mlp(16, 48, act_layer=nn.GELU)
    ref = copy.deepcopy(mlp)
    fuse(mlp)
    assert isinstance(mlp.fc1, FusedLinearGELU) and isinstance(mlp.act, nn.Identity)
    x = torch.randn(4, 16)
    assert rel_err(mlp(x), ref(x)) <= 1e-6


# ---------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("autocast", (False, True), ids=("fp32", "autocast-bf16"))
@pytest.mark.parametrize("name", EXPECTED)
def test_fused_hf_model_has_no_graph_breaks(name, autocast):
    model, inputs = hf_model(name)
    fused = fuse(copy.deepcopy(model))

    def breaks(m):
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            explained = torch._dynamo.explain(m)(**inputs)
        return explained.graph_break_count, explained.break_reasons

    assert breaks(model)[0] == 0, "the unfused model itself breaks: the check would be void"
    count, reasons = breaks(fused)
    assert count == 0, reasons


@pytest.mark.parametrize("autocast", (False, True), ids=("fp32", "autocast-bf16"))
def test_fused_model_compiles_and_matches_eager(autocast):
    """The fused ops through AOTAutograd (autograd, autocast and fake kernels): compiled forward
    and backward equal eager."""
    model, inputs = hf_model("gpt2")
    unfused = copy.deepcopy(model).eval()
    fuse(model.eval())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for m in (unfused, model, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = m(**inputs, output_hidden_states=True).hidden_states
        # hidden_states[1]: the first block's output, whose MLP ran in bf16 under autocast
        (g,) = torch.autograd.grad(hidden[1].float().square().sum(), [m.h[0].mlp.c_fc.weight])
        results.append((hidden[1], g))
    torch._dynamo.reset()
    (out_u, _), (out, g), (out_c, g_c) = results
    assert out_u.dtype == out.dtype == out_c.dtype
    assert rel_err(out, out_u) <= (1e-2 if autocast else 1e-5)
    torch.testing.assert_close(out_c, out)
    torch.testing.assert_close(g_c, g)


def test_report_names_both_classes_in_full():
    seq = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.ReLU())
    fuse(seq)
    assert str(seq.fusedlayers_report).splitlines()[1:] == [
        "  swapped 0: torch.nn.LayerNorm -> fusedlayers.torch.LayerNorm",
        "  swapped 1 + 2: torch.nn.Linear + torch.nn.GELU -> "
        "fusedlayers.torch.FusedLinearGELU(approximate='none') + torch.nn.Identity",
        "  swapped 3: torch.nn.ReLU -> fusedlayers.torch.FusedReLUScale(1.0)"]
