"""The gated MLP that fuse() puts in place of a Llama-style one: `GatedMLP`, holding the MLP's own
projection modules under their own names (so state_dict keys, Parameters, tied weights and
optimizer state are unchanged) and running act(gate) * up as one fused op. Its subclasses,
`SwiGLUMLP` and `GeGLUMLP`, say which op; `fuse_candidates` is the structural rule.

The structure, read from the MLP's forward traced with torch.fx (each child module a leaf):
- `down(act(gate(x)) * up(x))` (Llama, Mistral, Qwen2/3, Gemma, OLMo2, Granite), the product's
  operands in either order, act a child module or a function;
- `down(up * act(gate))` after `gate, up = gate_up(x).chunk(2, -1)` (Phi-3).
The activation is not trusted by name: a module is told by its output on a probe, and the fused
MLP is verified by fuse() on a probe input against the MLP itself."""

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ..bench.case import Case
from . import fp8_mlp


class _Leaves(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


class GatedMLP(nn.Module):
    """down(gated(gate(x), up(x))), or with `gate_up` one projection whose output's halves are
    gate and up (chunk(2, -1)). The projections are the original MLP's modules, under its names
    (`names`: role -> attribute name). Subclasses set `activation` and define `gated`. Where
    fuse(model, fp8=) made every projection an Fp8Linear of one recipe, it runs as one
    fp8_gated_mlp (the activation writing FP8 itself) wherever that op's rules hold."""

    activation = ""

    def __init__(self, modules: dict, names: dict, approximate: str = "none"):
        super().__init__()
        self.names = dict(names)
        self.approximate = approximate
        for role, module in modules.items():
            setattr(self, names[role], module)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def fp8_activation(self) -> str:
        """The activation as fp8_gated names it."""
        if self.activation == "gelu":
            return "gelu_tanh" if self.approximate == "tanh" else "gelu"
        return self.activation

    def _role(self, role: str) -> nn.Module:
        return getattr(self, self.names[role])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp8_mlp.applies(self, x):  # fuse(model, fp8=...) made the projections Fp8Linear
            gate_up = self._role("gate_up").weight if "gate_up" in self.names else \
                (self._role("gate").weight, self._role("up").weight)
            return fp8_mlp.fp8_gated_mlp(x, gate_up, self._role("down").weight,
                                         self.fp8_activation, self._role("down").recipe)
        if "gate_up" in self.names:
            gate, up = self._role("gate_up")(x).chunk(2, dim=-1)
        else:
            gate, up = self._role("gate")(x), self._role("up")(x)
        return self._role("down")(self.gated(gate, up))

    @property
    def probe_shape(self) -> tuple:
        """An input fuse() probes it with: a few rows of in_features."""
        first = self._role("gate_up" if "gate_up" in self.names else "gate")
        return (5, first.weight.shape[1])

    @classmethod
    def fuse_candidates(cls, module: nn.Module) -> tuple[list["GatedMLP"], bool]:
        """fuse()'s rule: the fused MLPs that may replace `module` (each to be verified on a probe),
        when its forward has one of the structures above with this class's activation (a
        module told by its output, or an F.silu / F.gelu call); each is verified by fuse() on a
        probe against `module` itself."""
        if isinstance(module, GatedMLP) or not list(module.children()):
            return [], False
        found = _structure(module)
        if found is None:
            return [], False
        names, act = found
        modules = {role: getattr(module, name) for role, name in names.items()}
        if any(not isinstance(getattr(m, "weight", None), torch.Tensor) or m.weight.dim() != 2
               for m in modules.values()):
            return [], False
        if cls.activation == "silu":
            return ([cls(modules, names)] if act == "silu" else []), False
        if act in ("gelu", "gelu_tanh"):
            return [cls(modules, names, "tanh" if act == "gelu_tanh" else "none")], False
        return [], False

    def extra_repr(self) -> str:
        return f"activation={self.activation}" + (
            f", approximate={self.approximate!r}" if self.activation == "gelu" else "")


_FORMS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def _activation_name(node, root: nn.Module) -> str | None:
    """'silu', 'gelu' or 'gelu_tanh' for an activation node whose function is one of them (a
    stateless module is told by its output on a probe from -8 to 8), None for any other."""
    target = node.target
    if node.op == "call_module":
        m = root.get_submodule(target)
        if list(m.parameters()) or list(m.buffers()) or list(m.children()):
            return None
        x = torch.linspace(-8, 8, 257, dtype=torch.float64)
        for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
            try:
                with torch.no_grad():
                    y = m(x.to(dtype)).double()
            except Exception:  # not on this dtype: try the next, else not one of ours
                continue
            for name, fn in _FORMS.items():
                if y.shape == x.shape and torch.allclose(y, fn(x), rtol=tol, atol=tol):
                    return name
            return None
        return None
    if node.op == "call_function" and target is F.silu:
        return "silu"
    if node.op == "call_function" and target is F.gelu:
        return "gelu_tanh" if node.kwargs.get("approximate") == "tanh" else "gelu"
    return None


def _structure(module: nn.Module):
    """(role -> child name, activation name or None) for a gated MLP's forward, else None."""
    try:
        graph = _Leaves().trace(module)
    except Exception:  # not traceable: not fused (reported as left by fuse())
        return None
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr")]
    outputs = [n for n in nodes if n.op == "output"]
    if len(outputs) != 1 or len(outputs[0].args) != 1:
        return None
    down = outputs[0].args[0]
    if not isinstance(down, torch.fx.Node) or down.op != "call_module" or len(down.args) != 1:
        return None
    mul = down.args[0]
    if not (isinstance(mul, torch.fx.Node) and mul.op == "call_function" and
            mul.target in (operator.mul, torch.mul) and len(mul.args) == 2):
        return None
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return None
    x = inputs[0]

    def act_of(n):  # the activation node of gate's branch and gate's node
        if isinstance(n, torch.fx.Node) and n.op in ("call_module", "call_function") and \
                len(n.args) >= 1 and isinstance(n.args[0], torch.fx.Node):
            return n, n.args[0]
        return None, None

    for a_node, other in (mul.args, mul.args[::-1]):
        act, gate = act_of(a_node)
        if act is None or not isinstance(other, torch.fx.Node):
            continue
        # Llama: gate and up are projections of x
        if (gate.op == "call_module" and other.op == "call_module" and gate.args == (x,)
                and other.args == (x,) and gate.target != other.target and not gate.kwargs):
            names = {"gate": gate.target, "up": other.target, "down": down.target}
        # Phi-3: gate and up are the halves of one projection's chunk(2, -1)
        elif _chunk_half(gate, 0) and _chunk_half(other, 1) and \
                gate.args[0] is other.args[0]:
            proj = gate.args[0].args[0]
            if not (proj.op == "call_module" and proj.args == (x,)):
                continue
            names = {"gate_up": proj.target, "down": down.target}
        else:
            continue
        if len(set(names.values())) != len(names) or any("." in n for n in names.values()):
            return None
        used = {n.target for n in nodes if n.op == "call_module"}
        if act.op == "call_module":
            used.discard(act.target)
        if used != set(names.values()):  # another child takes part: not this structure
            return None
        return names, _activation_name(act, module)
    return None


def _chunk_half(node, index: int) -> bool:
    """node is getitem(index) of `t.chunk(2, -1)` (or dim=-1, or torch.chunk) of one node."""
    if not (node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index):
        return False
    chunk = node.args[0]
    is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or (
        chunk.op == "call_function" and chunk.target is torch.chunk)
    if not is_chunk:
        return False
    args = list(chunk.args[1:])
    chunks = args[0] if args else chunk.kwargs.get("chunks")
    dim = args[1] if len(args) > 1 else chunk.kwargs.get("dim", 0)
    return chunks == 2 and dim == -1


def gated_bench_case(shape, dtype, device, fused, eager, peer=None) -> Case:
    """gate and up of (tokens, ffn); peer: a Liger-style fn(gate, up) timed beside ours."""
    gate, up = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
    nbytes = gate.numel() * gate.element_size()
    # forward: read gate and up, write y; backward: read dy, gate, up, write dgate, dup
    case = Case(lambda: fused(gate, up), lambda: eager(gate, up), [gate, up],
                {"fwd": 3 * nbytes, "fwd+bwd": 8 * nbytes})
    if peer is not None:
        case.variants["liger"] = lambda: peer(gate, up)
    return case
