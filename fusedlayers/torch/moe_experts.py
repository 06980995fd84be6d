"""The experts of a mixture-of-experts layer on torch tensors, as transformers' experts modules
compute them, with the memory-bound glue around the two grouped GEMMs fused: `moe_experts`
(moe_permute, the grouped up-projection, the gated activation, the grouped down-projection,
moe_unpermute), its unfused reference, fuse()'s rule for transformers' experts modules and the
bench case. The GEMMs are the framework's (`torch.nn.functional.grouped_mm` where the device and
dtype have it, a loop over the experts elsewhere); the rest is csrc's (csrc/moe/moe.h, csrc/activation/gated.h).
"""

import types

import torch
import torch.nn.functional as F

from ..bench.case import Case
from .geglu import geglu_op
from .grouped_gemm import grouped_gemm_op
from .moe_permute import bench_routing, moe_permute_op
from .moe_unpermute import moe_unpermute_op
from .swiglu import swiglu_op

__all__ = ["moe_experts"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
GEMMS = ("framework", "fusedlayers")
# moe_experts' grouped GEMMs where its gemm is None: whichever the bench measures faster
# (--ops grouped_gemm moe_experts: torch's grouped_mm beside fusedlayers.grouped_gemm).
GEMM_DEFAULT = "framework"


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                *, gate_up_proj_bias: torch.Tensor | None = None,
                down_proj_bias: torch.Tensor | None = None, transposed: bool = False,
                activation: str = "silu", gate=None, gemm: str | None = None) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer (Shazeer et al. 2017, arXiv:1701.06538),
    with the arguments and result of transformers' experts modules (Qwen3-MoE, Mixtral, OLMoE,
    DeepSeek-V3, gpt-oss, ...):
        out[t] = sum_j top_k_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),
        e = top_k_index[t, j],
    as moe_permute (sort and gather), a grouped GEMM, the gated activation (fusedlayers.swiglu /
    geglu on the two halves, read in place), a grouped GEMM and moe_unpermute (weighted sum).

    hidden_states: (tokens, hidden). top_k_index: (tokens, top_k) int32/int64 (an id outside
    [0, num_experts) reaches no expert); top_k_weights: (tokens, top_k), float32 or the hidden
    states' dtype. gate_up_proj: (num_experts, 2 * ffn, hidden), the gate's rows first (with
    transposed=True (num_experts, hidden, 2 * ffn)); down_proj: (num_experts, hidden, ffn)
    ((num_experts, ffn, hidden) transposed); biases (num_experts, 2 * ffn) and (num_experts,
    hidden), added after each GEMM. activation: 'silu' (SwiGLU), 'gelu' or 'gelu_tanh' (GeGLU);
    gate: instead, a function of the up-projection's (tokens * top_k, 2 * ffn) output returning
    (tokens * top_k, ffn) (gpt-oss's clamped, interleaved gate). gemm: the grouped GEMMs,
    "framework" (torch's grouped_mm, or a loop over the experts where it does not take the
    operands) or "fusedlayers" (fusedlayers.grouped_gemm); None: GEMM_DEFAULT. Returns (tokens,
    hidden) in the hidden states' dtype, differentiable in the hidden states, weights and
    parameters; the same bits on every run where the GEMMs give them. Raises ValueError for an
    unknown activation or gemm and what moe_permute, the GEMMs and moe_unpermute raise.
    """
    if gate is None and activation not in ACTIVATIONS:
        raise ValueError(f"fusedlayers.moe_experts: activation must be one of "
                         f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    if gemm is not None and gemm not in GEMMS:
        raise ValueError(f"fusedlayers.moe_experts: gemm must be one of {', '.join(GEMMS)} or "
                         f"None, got {gemm!r}")
    gemm = gemm or GEMM_DEFAULT
    num_experts = gate_up_proj.shape[0]
    out_dtype = hidden_states.dtype
    dtype = _autocast_dtype(hidden_states, gate_up_proj)
    if dtype is not None:  # as autocast runs a matmul: every operand cast once, in this forward
        hidden_states, gate_up_proj, down_proj = (
            t.to(dtype) for t in (hidden_states, gate_up_proj, down_proj))
        gate_up_proj_bias, down_proj_bias = (
            None if t is None else t.to(dtype) for t in (gate_up_proj_bias, down_proj_bias))
    xs, row_index, offsets = moe_permute_op(hidden_states, top_k_index, num_experts)
    expert = None
    if gate_up_proj_bias is not None or down_proj_bias is not None:
        rows = torch.arange(xs.shape[0], device=xs.device, dtype=torch.int32)
        expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=num_experts - 1)
    h = grouped_linear(xs.to(gate_up_proj.dtype), gate_up_proj, offsets, transposed, gemm)
    if gate_up_proj_bias is not None:
        h = h + gate_up_proj_bias[expert]
    if gate is not None:
        a = gate(h)
    else:
        ffn = h.shape[-1] // 2
        g, u = h[:, :ffn], h[:, ffn:]
        a = swiglu_op(g, u) if activation == "silu" else \
            geglu_op(g, u, "tanh" if activation == "gelu_tanh" else "none")
    y = grouped_linear(a, down_proj, offsets, transposed, gemm)
    if down_proj_bias is not None:
        y = y + down_proj_bias[expert]
    weights = top_k_weights
    if weights.dtype not in (y.dtype, torch.float32):
        weights = weights.to(y.dtype)
    return moe_unpermute_op(y, top_k_index, row_index, weights, num_experts).to(out_dtype)


def _autocast_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run these GEMMs in (its lower-precision dtype for float32 and
    other half operands, as for torch.matmul), or None outside autocast or where nothing is cast
    (torch does not list grouped_mm in autocast's policy, so moe_experts applies it itself)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == weight.dtype == dtype or torch.float64 in (x.dtype, weight.dtype):
        return None
    return dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   transposed: bool, gemm: str = "framework") -> torch.Tensor:
    """x (rows, in) times each expert's weight over its rows (offsets: their ends): weight
    (num_experts, out, in), or (num_experts, in, out) when transposed. Rows past the last expert's
    are not computed (grouped_mm leaves them as they are; the loop and grouped_gemm give zeros):
    moe_unpermute never reads them."""
    if gemm == "fusedlayers" and x.dtype == weight.dtype:
        return grouped_gemm_op(x, weight, offsets, transposed)
    w = weight if transposed else weight.transpose(-2, -1)  # (num_experts, in, out)
    if _grouped_mm_fits(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    ends = offsets.tolist()  # one host sync
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    # split and unbind, not slices and w[e]: their backward writes each gradient once, where a
    # slice's or an index's backward would write a zero tensor of the whole operand per expert
    rows = x.split(sizes + [x.shape[0] - sum(sizes)])
    parts = [r @ w_e for r, w_e, size in zip(rows, w.unbind(0), sizes) if size]
    parts.append(x.new_zeros(rows[-1].shape[0], w.shape[-1]))
    return torch.cat(parts)


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: float32/bfloat16/float16 on CUDA
    (CUTLASS's kernels for bfloat16 on sm90 and sm100, else ATen's loop of GEMMs over the groups,
    whose backward is a grouped GEMM too) and on the CPU, rows 16-byte aligned; under
    torch.compile bfloat16 only."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype or \
            x.device.type not in ("cpu", "cuda") or \
            x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # torch's fake kernel of grouped_mm takes bfloat16 alone
    size = x.element_size()
    return x.shape[-1] * size % 16 == 0 and w.shape[-1] * size % 16 == 0 and \
        w.shape[-2] * size % 16 == 0


def reference(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
              gate_up_proj_bias=None, down_proj_bias=None, transposed=False,
              activation="silu", gate=None):
    """The unfused computation: each token's experts one by one in stock torch ops, as
    transformers' eager experts loop."""
    acts = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden_states)
    for e in range(num_experts):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        w1 = gate_up_proj[e] if transposed else gate_up_proj[e].t()
        w2 = down_proj[e] if transposed else down_proj[e].t()
        h = hidden_states[token] @ w1
        if gate_up_proj_bias is not None:
            h = h + gate_up_proj_bias[e]
        if gate is not None:
            a = gate(h)
        else:
            g, u = h.chunk(2, dim=-1)
            a = acts[activation](g) * u
        y = a @ w2
        if down_proj_bias is not None:
            y = y + down_proj_bias[e]
        out = out.index_add(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
    return out


# A composite: no operator of its own (torch's GEMMs around moe_permute, swiglu/geglu and
# moe_unpermute, each lowered and exported as its own).
COMPOSITE = True
DECOMPOSITIONS = {}


# ---------------------------------------------------------------- fuse()

def fuse_experts(module: torch.nn.Module):
    """fuse()'s rule for transformers' experts modules (those of `use_experts_implementation`:
    3-D `gate_up_proj` and `down_proj`, the layout flags it sets): this instance's forward as
    `moe_experts` with the module's parameters and flags, its gate as fusedlayers' swiglu/geglu
    where the module's is the default `act_fn(gate) * up` on concatenated halves, else the
    module's own `_apply_gate`. Bound to this instance only (`del module.forward` undoes it).
    Returns (forward, None), or (None, why not) for an experts module whose form is not this
    one or whose output differs from the fused one on a probe; (None, None) for other modules."""
    params = module._parameters
    w1, w2 = params.get("gate_up_proj"), params.get("down_proj")
    if not hasattr(module, "is_transposed") or w2 is None or w2.dim() != 3:
        return None, None
    if not getattr(module, "has_gate", True) or w1 is None or w1.dim() != 3:
        return None, "experts without a gate (up_proj and an activation) are not fused"
    if getattr(module, "has_post_expert_norm", False):
        return None, "a norm after each expert is not fused"
    if getattr(module, "_is_expert_parallel", False):
        return None, "expert-parallel experts are left to their implementation"
    if "forward" in module.__dict__:
        return None, "its forward is already an instance attribute"
    transposed = bool(module.is_transposed)
    activation, gate = _gate_of(module)
    has_bias = bool(getattr(module, "has_bias", False))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return moe_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
            gate_up_proj_bias=self.gate_up_proj_bias if has_bias else None,
            down_proj_bias=self.down_proj_bias if has_bias else None, transposed=transposed,
            activation=activation, gate=None if gate is None else self._apply_gate)

    # what runs as the gate, for fuse()'s report
    forward.fused_gate = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu(approximate="
                          "'tanh')"}.get(activation, "the module's own _apply_gate")
    fused = types.MethodType(forward, module)
    why = _probe(module, fused, transposed)
    return (None, why) if why else (fused, None)


def _gate_of(module) -> tuple[str, object]:
    """(activation, None) where the module's gate is act_fn(gate) * up on concatenated halves
    with act_fn a SiLU or GELU (judged on a probe), else (None, module._apply_gate)."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    default = apply_gate is not None and apply_gate.__name__ == "_default_apply_gate" and \
        getattr(module, "is_concatenated", True)
    act = getattr(module, "act_fn", None)
    if default and callable(act):
        x = torch.linspace(-8, 8, 257, dtype=torch.float64)
        forms = {"silu": F.silu(x), "gelu": F.gelu(x), "gelu_tanh": F.gelu(x, approximate="tanh")}
        try:
            y = act(x)
        except Exception:
            y = None
        for name, ref in forms.items():
            if isinstance(y, torch.Tensor) and y.shape == x.shape and \
                    torch.allclose(y, ref, rtol=1e-9, atol=1e-9):
                return name, None
    return None, module._apply_gate


_PROBE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3,
                    torch.bfloat16: 2e-2}


def _probe(module, fused, transposed: bool) -> str | None:
    """Why the fused forward differs from the module's on a probe (7 tokens, top-2), or None."""
    w = module.gate_up_proj
    if w.device.type == "meta":
        return "no parameters on a real device to probe it with"
    num_experts = w.shape[0]
    hidden = w.shape[1] if transposed else w.shape[2]
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(7, hidden, generator=gen, device=w.device, dtype=w.dtype)
    k = min(2, num_experts)
    logits = torch.randn(7, num_experts, generator=gen, device=w.device)
    weights, index = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    weights = weights.to(w.dtype)
    try:
        want = module(x, index, weights)
        got = fused(x, index, weights)
    except Exception as e:  # a dtype or device the fused ops do not support
        return f"the fused experts fail on it: {e}"
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return "its output is not one (tokens, hidden) tensor"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    tol = _PROBE_TOLERANCE.get(w.dtype, 0.0)
    if w.dtype == torch.float32 and w.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        tol = 2e-3
    return None if err <= tol else f"probe mismatch (relative error {err:.1e})"


# ---------------------------------------------------------------- bench

def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """shape: (tokens, hidden, ffn, num_experts, top_k); the eager row is transformers'
    grouped_mm experts path (the same GEMMs); "gemm", the two grouped GEMMs alone, the floor.
    Work: the GEMMs' flops (forward 6 * tokens * top_k * hidden * ffn, backward twice that)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    tokens, hidden, ffn, experts, top_k = shape
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(experts, 2 * ffn, hidden, device=device, dtype=dtype) / hidden ** 0.5) \
        .requires_grad_()
    w2 = (torch.randn(experts, hidden, ffn, device=device, dtype=dtype) / ffn ** 0.5) \
        .requires_grad_()
    index, weights = bench_routing(tokens, experts, top_k, device, dtype)
    weights.requires_grad_()
    module = types.SimpleNamespace(gate_up_proj=w1, down_proj=w2, num_experts=experts,
                                   has_gate=True, has_bias=False, is_transposed=False,
                                   has_post_expert_norm=False, _is_expert_parallel=False,
                                   act_fn=F.silu)
    module._apply_gate = lambda h: F.silu(h[:, :ffn]) * h[:, ffn:]
    xs, _, offsets = moe_permute_op(x.detach(), index, experts)
    h = torch.randn(tokens * top_k, ffn, device=device, dtype=dtype)
    flops = 6 * tokens * top_k * hidden * ffn
    other = "fusedlayers" if GEMM_DEFAULT == "framework" else "framework"
    return Case(lambda: moe_experts(x, index, weights, w1, w2),
                lambda: grouped_mm_experts_forward(module, x, index, weights), [x, weights, w1, w2],
                {"fwd": flops, "fwd+bwd": 3 * flops},
                variants={f"gemm={other}": lambda: moe_experts(x, index, weights, w1, w2,
                                                               gemm=other)},
                fwd_only={"gemm": lambda: (grouped_linear(xs, w1, offsets, False),
                                           grouped_linear(h, w2, offsets, False))})
