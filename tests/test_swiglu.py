"""What is particular to the gated activations (swiglu, geglu) beyond the op table: the halves of
one projection read in place (Phi-3's chunk(2, -1)), autocast's promotion of mixed dtypes, the
Keras GatedMLP layer, and fuse()'s structural rule on MLPs that are not gated ones."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import fusedlayers as fl
from fusedlayers.torch import GeGLUMLP, SwiGLUMLP, fuse
from fusedlayers.torch.gated_mlp import GatedMLP
from _helpers import rel_err

OPS = {"swiglu": (fl.swiglu, lambda g, u: torch.nn.functional.silu(g) * u),
       "geglu": (lambda g, u: fl.geglu(g, u, "tanh"),
                 lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u)}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("op", OPS)
def test_chunked_halves_equal_contiguous_copies(op, dtype):
    """gate and up as the halves of one (..., 2 ffn) output, viewed in place, give the bits of
    the same values made contiguous, forward and backward."""
    fn, _ = OPS[op]
    h = torch.randn(3, 5, 2 * 24, dtype=dtype, requires_grad=True)
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous() and gate.stride(-2) == 48
    y = fn(gate, up)
    dy = torch.randn_like(y)
    (dh,) = torch.autograd.grad(y, h, dy)
    g2, u2 = (t.detach().contiguous().requires_grad_() for t in (gate, up))
    y2 = fn(g2, u2)
    dg2, du2 = torch.autograd.grad(y2, (g2, u2), dy)
    assert torch.equal(y, y2)
    assert torch.equal(dh, torch.cat([dg2, du2], dim=-1))


def test_autocast_promotes_mixed_dtypes():
    """Under autocast a float32 gate with a bfloat16 up runs in float32, as `silu(gate) * up`
    does (mul promotes)."""
    gate, up = torch.randn(4, 8), torch.randn(4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fl.swiglu(gate, up)
    assert y.dtype == torch.float32
    assert torch.equal(y, fl.swiglu(gate, up.float()))


class _NotGated(nn.Module):
    """gate and up projections, but the product is not act(gate) * up."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(8, 8, bias=False)
                                                        for _ in range(3))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class _ReluGated(_NotGated):
    """A ReGLU: gated, but by an activation that is neither SiLU nor GELU."""

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("cls", (_NotGated, _ReluGated))
def test_other_mlps_are_not_swapped(cls):
    mlp = cls()
    ref = copy.deepcopy(mlp)
    fuse(mlp, relu_scale=False)
    assert not isinstance(mlp, GatedMLP) and not any(isinstance(m, GatedMLP)
                                                     for m in mlp.modules())
    x = torch.randn(3, 8)
    assert torch.equal(mlp(x), ref(x))


def test_swiglu_off_leaves_llama_mlps():
    from test_fuse import hf_model
    model, _ = hf_model("llama")
    fuse(model, swiglu=False)
    assert not any(isinstance(m, SwiGLUMLP) for m in model.modules())
    model, _ = hf_model("gemma")
    fuse(model, geglu=False, linear_gelu=False)
    assert not any(isinstance(m, GeGLUMLP) for m in model.modules())


@pytest.mark.parametrize("activation", ("silu", "gelu", "gelu_tanh"))
def test_keras_gated_mlp(activation, rng):
    keras = pytest.importorskip("keras")
    from fusedlayers.keras import GatedMLP as KerasGatedMLP
    layer = KerasGatedMLP(12, activation=activation)
    x = np.asarray(rng.normal((2, 5, 8)), np.float32)
    y = keras.ops.convert_to_numpy(layer(x))
    act = {"silu": lambda v: keras.activations.silu(v),
           "gelu": lambda v: keras.activations.gelu(v, approximate=False),
           "gelu_tanh": lambda v: keras.activations.gelu(v, approximate=True)}[activation]
    want = layer.down_proj(act(layer.gate_proj(x)) * layer.up_proj(x))
    assert y.shape == x.shape
    assert rel_err(torch.from_numpy(y), torch.from_numpy(keras.ops.convert_to_numpy(want))) <= 1e-5
    clone = KerasGatedMLP.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


def test_keras_gated_mlp_in_fp8(rng):
    """GatedMLP(recipe=): its projections are Fp8Dense with the recipe (the plain layer's weight
    names), the output is theirs around the fused activation, and the config keeps the recipe."""
    keras = pytest.importorskip("keras")
    from fusedlayers import Fp8Recipe
    from fusedlayers.keras import Fp8Dense, GatedMLP as KerasGatedMLP
    from fusedlayers.keras._layer import framework
    recipe = Fp8Recipe("tensorwise")
    layer, plain = KerasGatedMLP(48, recipe=recipe), KerasGatedMLP(48)
    x = np.asarray(rng.normal((3, 5, 32)), np.float32)
    y = keras.ops.convert_to_numpy(layer(x))
    plain(x)
    assert [w.path for w in layer.weights] == [w.path.replace(plain.name, layer.name)
                                               for w in plain.weights]
    for proj in (layer.gate_proj, layer.up_proj, layer.down_proj):
        assert isinstance(proj, Fp8Dense) and proj.recipe == recipe
    fl = framework("test")  # the backend's fusedlayers package
    want = layer.down_proj(fl.swiglu(layer.gate_proj(x), layer.up_proj(x)))
    assert np.array_equal(y, keras.ops.convert_to_numpy(want))
    clone = KerasGatedMLP.from_config(layer.get_config())
    assert clone.recipe == recipe and clone.get_config() == layer.get_config()
    assert KerasGatedMLP.from_config(plain.get_config()).recipe is None
