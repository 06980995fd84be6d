"""Fused torch models in the rest of the PyTorch toolbox: activation checkpointing
(torch.utils.checkpoint) gives the gradients of the plain model; state_dicts and torch.save files
round-trip between fused and unfused models; torch.export of a fused model keeps the fused ops
and runs; torch.onnx.export of it writes standard ONNX ops that onnxruntime runs."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedlayers.torch as flt
from _helpers import assert_bitwise, rel_err
from fusedlayers import ops


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: LayerNorm -> Linear -> GELU -> Linear -> ReLU."""

    def __init__(self, width=37, hidden=83):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width),
                                 nn.ReLU())

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, depth=3, checkpointed=None):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(depth))
        self.checkpointed = checkpointed  # None, "reentrant" or "non-reentrant"

    def forward(self, x):
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=self.checkpointed == "reentrant")
                 if self.checkpointed else block(x))
        return x


class LlamaOps(nn.Module):
    """swiglu, geglu and rope on one projection's slices, as a decoder calls them, and the
    residual adds inside the norms after them."""

    def __init__(self, width: int = 37):
        super().__init__()
        self.proj, self.out = nn.Linear(width, 64), nn.Linear(16, width)
        self.rms, self.ln = flt.AddRMSNorm(width, eps=1e-6), flt.AddLayerNorm(width)

    def forward(self, x):
        h = self.proj(x)
        b, s = x.shape[:2]
        gate, up = h[..., :16], h[..., 16:32]
        mlp = flt.swiglu(gate, up) + flt.geglu(gate, up, "tanh")
        q, k = (h[..., i:i + 16].reshape(b, s, 2, 8).transpose(1, 2) for i in (32, 48))
        angles = torch.arange(s, dtype=x.dtype)[None, :, None] * torch.linspace(0.1, 1, 8)
        q, k = flt.rope(q, k, angles.cos(), angles.sin())
        y = self.out(mlp + (q + k).transpose(1, 2).reshape(b, s, 16))
        y, h = self.rms(y, x)
        y, h = self.ln(y, h)
        return y + h


class Routing(nn.Module):
    """moe_permute, grouped_gemm and moe_unpermute, as an MoE block routes its tokens through
    its experts (moe_experts is a composite of these and the activation)."""

    def __init__(self, width: int = 37, experts: int = 5):
        super().__init__()
        self.router, self.experts = nn.Linear(width, experts), experts
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(flat), -1), 2)
        xs, rows, offsets = flt.moe_permute(flat, index, self.experts)
        ys = flt.grouped_gemm(xs, self.weight, offsets)
        out = flt.moe_unpermute(ys, index, rows, weights, self.experts)
        return x + out.reshape(x.shape)


class HeadLoss(nn.Module):
    """x plus the linear cross-entropy of x on a head, as an LM's output and loss."""

    def __init__(self, width: int = 37, vocab: int = 11):
        super().__init__()
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("target", torch.arange(14).reshape(2, 7) % vocab)

    def forward(self, x):
        return x + flt.linear_cross_entropy(x, self.head.weight, self.target,
                                            label_smoothing=0.1)


def fused_stack(**kwargs) -> Stack:
    model = flt.fuse(Stack(**kwargs))
    swapped = {type(m) for m in model.modules()}
    assert {flt.LayerNorm, flt.FusedLinearGELU, flt.FusedReLUScale} <= swapped
    return model


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    # Non-reentrant checkpointing recomputes the forward from inside the backward Nodes, when
    # they unpack what they saved: that must still record autograd (backends/torch/autograd.h).
    plain = fused_stack()
    ckpt = fused_stack(checkpointed=mode)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 9, 37)
    dy = torch.randn(4, 9, 37)
    grads = []
    for model in (plain, ckpt):
        xi = x.clone().requires_grad_()
        out = model(xi)
        (out * dy).sum().backward()  # reentrant checkpointing supports .backward() only
        grads.append([xi.grad, *(p.grad for p in model.parameters()), out])
    # The recomputation runs the same deterministic kernels on the same inputs.
    for a, b in zip(*grads, strict=True):
        assert_bitwise(a, b)


def test_state_dict_round_trips_between_fused_and_unfused(tmp_path):
    unfused, fused = Stack(), fused_stack()
    assert fused.state_dict().keys() == unfused.state_dict().keys()
    fused.load_state_dict(unfused.state_dict())  # strict: same keys and shapes
    x = torch.randn(3, 5, 37)
    assert rel_err(fused(x), unfused(x)) < 1e-6

    path = tmp_path / "fused.pt"
    torch.save(fused.state_dict(), path)
    back = Stack()
    back.load_state_dict(torch.load(path, weights_only=True))
    for (name, a), b in zip(fused.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    torch.save(fused, tmp_path / "module.pt")  # the whole module, pickled with its classes
    whole = torch.load(tmp_path / "module.pt", weights_only=False)
    assert_bitwise(whole(x), fused(x))


@pytest.mark.parametrize("train", [False, True])
def test_torch_export_keeps_the_fused_ops_and_runs(train):
    model = fused_stack().train(train)
    x = torch.randn(2, 7, 37)
    program = torch.export.export(model, (x,))
    graph = str(program.graph)
    for op in ("fusedlayers.layer_norm", "fusedlayers.linear_gelu", "fusedlayers.relu_scale"):
        assert op in graph, f"{op} not in the exported graph"
    x2 = torch.randn(2, 7, 37)
    assert_bitwise(program.module()(x2), model(x2))


def test_onnx_export_of_a_fused_model_runs_in_onnxruntime():
    """Every op of the table in one fused model (a new op joins this model, or the test fails),
    exported with the dynamo exporter: no fusedlayers operator is left in the ONNX graph, and
    onnxruntime gives eager's result."""
    import onnxruntime

    model = nn.Sequential(fused_stack(depth=2), flt.RMSNorm(37), LlamaOps(), Routing(),
                          HeadLoss()).eval()
    x = torch.randn(2, 7, 37)
    graph = str(torch.export.export(model, (x,)).graph)
    composites = {op.name for op in ops.OPS
                  if getattr(ops.module(op, "torch"), "COMPOSITE", False)}
    assert {op for op in ops.NAMES if f"fusedlayers.{op}." in graph} == \
        set(ops.NAMES) - composites
    program = torch.onnx.export(model, (x,), dynamo=True)
    assert {n.domain for n in program.model.graph} <= {"", "ai.onnx"}, \
        sorted({(n.domain, n.op_type) for n in program.model.graph})
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    x2 = torch.randn(2, 7, 37)
    (y,) = session.run(None, {session.get_inputs()[0].name: x2.numpy()})
    with torch.no_grad():
        expected = model(x2)
    assert rel_err(torch.from_numpy(np.asarray(y)), expected) < 1e-5
