"""Rotary position embedding on torch tensors: `fusedlayers::rope` (backends/torch/rope.cpp:
schema, kernels, autograd), its fake kernels, the functional API with Hugging Face's signature,
the unfused reference, Inductor's lowering, and fuse()'s per-instance rule for attention modules
that call `apply_rotary_pos_emb`. The math: csrc/rope/rope.h."""

import types

import torch

from ..bench.case import Case
from . import _op

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_half_angles",
           "apply_rotary_pos_emb_interleave", "rope"]
rope_op = _op.handle("rope")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed): the rotary position embedding of q and k (Su et al. 2021, RoFormer,
    arXiv:2104.09864), Hugging Face's `apply_rotary_pos_emb` in one pass for both.

    q: (batch, heads, seq, head_dim) and k: (batch, kv_heads, seq, head_dim) (unsqueeze_dim=1; with
    2, (batch, seq, heads, head_dim)), one dtype, float32/float64/float16/bfloat16, any strides (a
    transposed view of (batch, seq, heads, head_dim) is read in place, and the results keep its
    layout). cos, sin: (batch or 1, seq, rotary_dim), float32 or q's dtype; rotary_dim even and at
    most head_dim (the dims past it pass through: partial rotary). interleaved: GPT-J's pairs
    (2i, 2i + 1) instead of rotate_half's (i, i + rotary_dim / 2). Math in float32 (float64 for
    float64). New tensors, never in place. Autograd saves cos and sin only; cos and sin are not
    differentiated (ValueError if they require grad). Raises TypeError for dtypes, ValueError for
    shapes, devices or another unsqueeze_dim.
    """
    return tuple(rope_op(q, k, cos, sin, unsqueeze_dim, bool(interleaved)))


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for `transformers.models.llama.modeling_llama.apply_rotary_pos_emb` (and the models
    that copy it, partial rotary included): `rope(q, k, cos, sin, unsqueeze_dim)`."""
    return rope(q, k, cos, sin, unsqueeze_dim)


def apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for gpt-oss's `apply_rotary_pos_emb`, whose cos and sin hold each angle once
    (head_dim / 2 columns) and rotate the two halves of each head: the same rotation as
    `rope` with cos and sin repeated for both halves."""
    return rope(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), unsqueeze_dim)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Drop-in for DeepSeek-V3's `apply_rotary_pos_emb_interleave` (its latent attention's
    rotary slice): interleaved pairs (x[2i], x[2i + 1]) rotated by the angles in cos's and sin's
    first half, written de-interleaved (the pairs' first elements, then their second ones). The
    rope op's interleaved rotation, then one copy that de-interleaves. position_ids: unused, as
    in transformers."""
    half = cos.shape[-1] // 2
    cos, sin = (t[..., :half].repeat_interleave(2, -1) for t in (cos, sin))
    q_embed, k_embed = rope(q, k, cos, sin, unsqueeze_dim, interleaved=True)
    return tuple(torch.cat((t[..., 0::2], t[..., 1::2]), -1) for t in (q_embed, k_embed))


# fuse()'s candidates for a modeling module's rotary functions, by name: (function, rotated dims
# per column of cos)
_CANDIDATES = {
    "apply_rotary_pos_emb": ((apply_rotary_pos_emb, 1), (apply_rotary_pos_emb_half_angles, 2)),
    "apply_rotary_pos_emb_interleave": ((apply_rotary_pos_emb_interleave, 1),),
}


def reference(q, k, cos, sin, unsqueeze_dim: int = 1, interleaved: bool = False):
    """The unfused computation rope replaces (Hugging Face's, in q's dtype)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        if interleaved:
            rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), -1).flatten(-2)
        else:
            rotated = torch.cat((-x_rot[..., r // 2:], x_rot[..., :r // 2]), -1)
        return torch.cat(((x_rot * cos + rotated * sin).to(x.dtype), x_pass), -1)
    return rotate(q), rotate(k)


def _output_like(t):
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else t.new_empty(t.shape)


@_op.register_fake("rope")
def _(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    _op.check_devices("rope", "q", q, k=k, cos=cos, sin=sin)
    return _output_like(q), _output_like(k)


@_op.register_fake("rope_backward")
def _(dq_embed, dk_embed, cos, sin, unsqueeze_dim, interleaved):
    _op.check_devices("rope_backward", "dq_embed", dq_embed, dk_embed=dk_embed, cos=cos, sin=sin)
    return _output_like(dq_embed), _output_like(dk_embed)


# ---------------------------------------------------------------- Inductor's lowering

def _acc(t):
    return t if t.dtype == torch.float64 else t.float()


def _forward(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    q_embed, k_embed = reference(_acc(q), _acc(k), _acc(cos), _acc(sin), unsqueeze_dim,
                                 interleaved)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def _backward(dq_embed, dk_embed, cos, sin, unsqueeze_dim, interleaved):
    """The transposed rotation: dx = dy cos + rotate^T(dy sin), rotate^T(v) = (v2, -v1)."""
    cos, sin = _acc(cos).unsqueeze(unsqueeze_dim), _acc(sin).unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def transpose(dy):
        d = _acc(dy)
        d_rot, d_pass = d[..., :r], d[..., r:]
        v = d_rot * sin
        if interleaved:
            rotated = torch.stack((v[..., 1::2], -v[..., ::2]), -1).flatten(-2)
        else:
            rotated = torch.cat((v[..., r // 2:], -v[..., :r // 2]), -1)
        return torch.cat((d_rot * cos + rotated, d_pass), -1).to(dy.dtype)
    return transpose(dq_embed), transpose(dk_embed)


DECOMPOSITIONS = {"rope": _forward, "rope_backward": _backward}


# ---------------------------------------------------------------- fuse()

def fuse_attention(module: torch.nn.Module):
    """fuse()'s rule for RoPE, which Hugging Face attention calls as a function, not a module: for
    an attention module whose forward calls `apply_rotary_pos_emb` (or DeepSeek's
    `apply_rotary_pos_emb_interleave`) from its modeling module, the same forward (its decorators
    kept) reading each as fusedlayers' candidate that matches it on a probe (_CANDIDATES: the
    rotate-half form, gpt-oss's half angles, DeepSeek's interleaved pairs), bound to this
    instance only (the modeling module and other instances are untouched; `del module.forward`
    undoes it). Returns (forward, None), or (None, why not) where the forward does not have that
    form or no candidate matches the modeling module's function."""
    chain = forward_chain(module)
    inner = chain[-1]
    names = [n for n in _CANDIDATES if isinstance(inner, types.FunctionType) and
             n in inner.__code__.co_names]
    if not names:
        return None, None  # not a RoPE attention: nothing to report
    if "forward" in module.__dict__:
        return None, "its forward is already an instance attribute"
    ours = {}
    for name in names:
        original = inner.__globals__.get(name)
        if not callable(original):
            return None, f"{name} is not a function of its modeling module"
        why = None
        for candidate, per_angle in _CANDIDATES[name]:
            why = _probe(original, module, candidate, per_angle)
            if not why:
                ours[name] = candidate
                break
        if why:
            return None, why
    return rewrapped(chain, _with_global(inner, ours), module)


def forward_chain(module: torch.nn.Module) -> list:
    """The class's forward and the functions its decorators wrap, outermost first (each one's
    `__wrapped__`)."""
    chain = [type(module).forward]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    return chain


def rewrapped(chain: list, new, module: torch.nn.Module):
    """(forward, None): `new` in place of chain's innermost function, each decorator's wrapper
    re-made around it (the closure cell that held the inner function holds the new one), bound
    to `module`; or (None, why) where a wrapper does not hold the function it wraps."""
    for i in range(len(chain) - 2, -1, -1):
        wrapper, old = chain[i], chain[i + 1]
        cells = wrapper.__closure__ if isinstance(wrapper, types.FunctionType) else None
        if not cells or not any(_cell_value(c) is old for c in cells):
            return None, f"a decorator of its forward ({getattr(wrapper, '__qualname__', wrapper)})" \
                         f" does not hold the function it wraps"
        new = _with_global(wrapper, old=old, new=new)
    return types.MethodType(new, module), None


_EMPTY = object()


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


def _with_global(fn, values=None, old=None, new=None):
    """fn with the globals in `values` (name -> value) bound in a copy of its globals, and its
    closure's cells that hold `old` holding `new` instead."""
    g = fn.__globals__
    if values:
        g = {**g, **values}
    closure = fn.__closure__
    if old is not None:
        closure = tuple(types.CellType(new) if _cell_value(c) is old else c for c in closure)
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__doc__, out.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return out


def _probe(original, module, candidate, per_angle: int) -> str | None:
    """Why original (the modeling module's apply_rotary_pos_emb) is not candidate on a probe,
    or None. per_angle: the dims one column of cos rotates (2 for gpt-oss's half angles)."""
    like = next(iter(module.parameters()), None)
    if like is None or like.device.type == "meta":
        return "no parameters on a real device to probe it with"
    # the rotated slice's width: DeepSeek's latent attention rotates qk_rope_head_dim dims
    head_dim = getattr(module, "qk_rope_head_dim", None) or getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim % 2:
        return "no even head_dim (or qk_rope_head_dim) attribute"
    gen = torch.Generator(device=like.device).manual_seed(0)
    opts = dict(generator=gen, device=like.device, dtype=torch.float32)
    q, k = torch.randn(2, 3, 5, head_dim, **opts), torch.randn(2, 1, 5, head_dim, **opts)
    tried = False
    for rotary in (head_dim, head_dim // 2 if head_dim % 4 == 0 else head_dim):
        if rotary % (2 * per_angle):
            continue
        cols = rotary // per_angle
        cos, sin = torch.randn(2, 5, cols, **opts), torch.randn(2, 5, cols, **opts)
        try:
            want = original(q, k, cos, sin)
        except Exception:  # partial rotary is not the modeling function's: not probed
            continue
        tried = True
        got = candidate(q, k, cos, sin)
        if not all(isinstance(w, torch.Tensor) and w.shape == g.shape and
                   torch.allclose(w, g, rtol=1e-5, atol=1e-5) for w, g in zip(want, got)):
            return f"its apply_rotary_pos_emb differs from fusedlayers.rope on a probe " \
                   f"(rotary_dim {rotary})"
    return None if tried else "its apply_rotary_pos_emb fails on every probe"


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """shape: (batch, seq, heads, kv_heads, head_dim); q and k as Llama makes them, transposed
    views of (batch, seq, heads, head_dim); cos and sin in q's dtype."""
    b, s, h, hk, d = shape
    q, k = (torch.randn(b, s, n, d, device=device, dtype=dtype).transpose(1, 2)
            .requires_grad_() for n in (h, hk))
    theta = torch.arange(s, device=device)[:, None] / 10000 ** (
        torch.arange(0, d, 2, device=device) / d)
    angles = torch.cat((theta, theta), -1)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    nbytes = (q.numel() + k.numel()) * q.element_size()
    case = Case(lambda: rope(q, k, cos, sin), lambda: reference(q, k, cos, sin), [q, k],
                {"fwd": 2 * nbytes, "fwd+bwd": 4 * nbytes})
    if peers and device.type == "cuda":
        try:
            from liger_kernel.ops.rope import LigerRopeFunction
            case.variants["liger"] = lambda: LigerRopeFunction.apply(q, k, cos, sin)
        except ImportError:
            pass
    return case
