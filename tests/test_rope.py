"""What is particular to rope beyond the op table: never in place (activation checkpointing
recomputes from the inputs), results in q's layout, cos and sin not differentiated, fuse()'s
per-instance rule (other instances and the modeling module untouched, undone by deleting the
instance's forward), Hugging Face's own apply_rotary_pos_emb, and the Keras layer against
KerasHub's formula."""

import copy

import numpy as np
import pytest
import torch
import transformers
from torch.utils.checkpoint import checkpoint

import fusedlayers as fl
from fusedlayers.torch import fuse
from _helpers import keras_hub_rotary, rel_err


def llama_qkcs(dtype=torch.float32, requires_grad=True):
    """q, k as Llama's attention makes them (transposed views) and cos, sin of real positions."""
    b, s, h, hk, d = 2, 7, 4, 2, 16
    q = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2).requires_grad_(requires_grad)
    k = torch.randn(b, s, hk, d, dtype=dtype).transpose(1, 2).requires_grad_(requires_grad)
    theta = torch.arange(s)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    angles = torch.cat((theta, theta), -1)[None].expand(b, s, d)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def test_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, k, cos, sin = llama_qkcs()
    for got, want in zip(fl.rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert rel_err(got, want) <= 1e-6


def test_half_angles_match_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb
    from fusedlayers.torch import apply_rotary_pos_emb_half_angles
    q, k, cos, sin = llama_qkcs()
    half = cos.shape[-1] // 2
    got = apply_rotary_pos_emb_half_angles(q, k, cos[..., :half], sin[..., :half])
    for g, want in zip(got, apply_rotary_pos_emb(q, k, cos[..., :half], sin[..., :half])):
        assert rel_err(g, want) <= 1e-6


def test_interleave_matches_deepseek_v3():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from fusedlayers.torch import apply_rotary_pos_emb_interleave
    theirs = getattr(modeling_deepseek_v3, "apply_rotary_pos_emb_interleave", None)
    if theirs is None:
        pytest.skip("this transformers' DeepSeek-V3 has no apply_rotary_pos_emb_interleave")
    q, k, cos, sin = llama_qkcs()
    for got, want in zip(apply_rotary_pos_emb_interleave(q, k, cos, sin), theirs(q, k, cos, sin)):
        assert rel_err(got, want) <= 1e-6
    dq = torch.randn_like(q)
    g1 = torch.autograd.grad(apply_rotary_pos_emb_interleave(q, k, cos, sin)[0], q, dq)[0]
    g2 = torch.autograd.grad(theirs(q, k, cos, sin)[0], q, dq)[0]
    assert rel_err(g1, g2) <= 1e-6


def test_results_keep_q_layout_and_inputs_are_untouched():
    q, k, cos, sin = llama_qkcs()
    q0, k0 = q.detach().clone(), k.detach().clone()
    q_embed, k_embed = fl.rope(q, k, cos, sin)
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_activation_checkpointing_gives_the_same_gradients():
    """The peer bug: a rotation in place changes the tensors checkpointing recomputes from."""
    q, k, cos, sin = llama_qkcs()
    w = torch.randn(16, 16, requires_grad=True)

    def block(q, k):
        q2, k2 = q @ w, k @ w
        qe, ke = fl.rope(q2, k2, cos, sin)
        return (qe[:, :2] @ ke.transpose(-1, -2)).square().sum()

    plain = torch.autograd.grad(block(q, k), (q, k, w))
    ckpt = torch.autograd.grad(checkpoint(block, q, k, use_reentrant=False), (q, k, w))
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_cos_requiring_grad_is_an_error():
    q, k, cos, sin = llama_qkcs()
    with pytest.raises(ValueError, match="cos and sin are constants"):
        fl.rope(q, k, cos.requires_grad_(), sin)


def test_fuse_is_per_instance_and_undone_by_deleting_forward():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48, max_position_embeddings=32)
    model = transformers.LlamaModel(config).eval()
    other = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 9))
    want = other(input_ids=ids).last_hidden_state
    fuse(model, rms_norm=False, swiglu=False)
    attn = model.layers[0].self_attn
    assert "forward" in attn.__dict__ and "forward" not in other.layers[0].self_attn.__dict__
    import transformers.models.llama.modeling_llama as modeling
    assert modeling.apply_rotary_pos_emb.__module__ == modeling.__name__  # not patched
    calls = []
    with _Recorder(calls):
        got = model(input_ids=ids).last_hidden_state
    assert any("rope" in c for c in calls)
    assert rel_err(got, want) <= 1e-5
    del attn.forward
    calls.clear()
    with _Recorder(calls):
        model(input_ids=ids)
    assert not any("rope" in c for c in calls)


class _Recorder(torch.overrides.TorchFunctionMode):
    """Records the name of every function called on tensors."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(getattr(func, "__name__", func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", ((2, 9, 16), (2, 9, 3, 8)))
def test_keras_rotary_embedding_matches_keras_hub(shape, rng):
    keras = pytest.importorskip("keras")
    from fusedlayers.keras import RotaryEmbedding
    x = np.asarray(rng.normal(shape), np.float32)
    layer = RotaryEmbedding(max_wavelength=500, scaling_factor=2.0)
    y = keras.ops.convert_to_numpy(layer(x))
    want = keras_hub_rotary(np, x, 500, 2.0)
    assert y.shape == x.shape
    assert rel_err(torch.from_numpy(y), torch.from_numpy(want.astype(np.float32))) <= 1e-5
    assert RotaryEmbedding.from_config(layer.get_config()).get_config() == layer.get_config()
