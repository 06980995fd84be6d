"""fuse()'s rule for residual adds: where a block's forward adds two tensors and feeds the sum
to one of its norms (already fusedlayers' RMSNorm or LayerNorm, swapped in by fuse()), the add
runs inside the norm as add_rms_norm / add_layer_norm. Read from the forward's source, two
forms:
- `s = a + b`, then only aliases of s (`residual = s`), then `y = self.<norm>(s)`: pre-norm
  decoders (Llama, Mistral, Qwen, the post-attention add), Gemma's sandwich (the add before
  pre_feedforward_layernorm), GPT-2's block, ViT's layer (s is used after the norm too);
- `self.<norm>(a + b)`: BERT's `LayerNorm(hidden_states + input_tensor)`.
Each instance gets a forward of its own (its decorators kept: fusedlayers.torch.rope.rewrapped)
whose call `_fusedlayers_add_norm(self.<norm>, a, b)` (the one name added to the modeling
module) runs the fused op where it computes what
the add and the norm computed (same shapes, device and dtype, a norm without hooks) and the
add and the norm themselves otherwise; `del module.forward` undoes it. The add the block ends
with feeds the next block's norm across the decoder loop, so it stays unfused."""

import ast
import inspect
import textwrap
import types

import torch
from torch import nn

from .add_layer_norm import add_layer_norm_op
from .add_rms_norm import _eps as _add_rms_eps
from .add_rms_norm import add_rms_norm_op
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm
from .rope import forward_chain, rewrapped

_CALL = "_fusedlayers_add_norm"
_Y = "_fusedlayers_y"


def add_norm(norm: nn.Module, a: torch.Tensor, b: torch.Tensor):
    """(norm(a + b), a + b), one fused pass where the op computes exactly that."""
    if _fusable(norm, a, b):
        if isinstance(norm, RMSNorm):
            y, h, _ = add_rms_norm_op(a, b, norm.normalized_shape, norm.weight,
                                      _add_rms_eps(norm.eps, a), norm.zero_centered)
        else:
            y, h, _, _ = add_layer_norm_op(a, b, norm.normalized_shape, norm.weight, norm.bias,
                                           norm.eps)
        return y, h
    s = a + b
    return norm(s), s


def _fusable(norm, a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or not a.dim():
        return False
    if a.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return False
    if norm._forward_hooks or norm._forward_pre_hooks or nn.modules.module._global_forward_hooks \
            or nn.modules.module._global_forward_pre_hooks:
        return False
    ns = tuple(norm.normalized_shape)
    if tuple(a.shape[a.dim() - len(ns):]) != ns:
        return False
    return not getattr(norm, "memory_efficient", False)


def fuse_adds(module: nn.Module, fusing: tuple):
    """(forward, norms) for a module whose forward adds a residual before a child norm of a type
    in `fusing` (RMSNorm, LayerNorm); (None, why) where the forward has such adds but cannot be
    rewritten; (None, None) where it has none."""
    norms = {name for name, child in module.named_children()
             if type(child) in fusing}  # exact: not the Add* modules
    if not norms:
        return None, None
    chain = forward_chain(module)
    inner = chain[-1]
    if not isinstance(inner, types.FunctionType):
        return None, None
    try:
        source = textwrap.dedent(inspect.getsource(inner))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None, None
    fn = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    if fn is None:
        return None, None
    found = []
    _rewrite_body(fn, norms, found)
    if not found:
        return None, None
    if "forward" in module.__dict__:
        return None, "its forward is already an instance attribute"
    if inner.__code__.co_freevars:
        return None, "its forward has closure variables"
    if any(isinstance(n, (ast.Name, ast.Attribute)) and
           (getattr(n, "id", None) or getattr(n, "attr", "")).startswith("__") and not
           (getattr(n, "id", None) or getattr(n, "attr", "")).endswith("__")
           for n in ast.walk(fn)):
        return None, "its forward uses class-private names"
    fn.decorator_list = []
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, inner.__code__.co_firstlineno - 1)
    # The new forward reads the modeling module's own globals (torch.compile guards a function's
    # globals through its module), with one private name added there: the dispatcher.
    inner.__globals__[_CALL] = add_norm
    scope = {}
    exec(compile(tree, inspect.getsourcefile(inner) or "<fusedlayers>", "exec"),
         inner.__globals__, scope)
    new = scope[fn.name]
    new.__defaults__, new.__kwdefaults__ = inner.__defaults__, inner.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = inner.__qualname__, inner.__doc__, \
        inner.__module__
    forward, why = rewrapped(chain, new, module)
    return (forward, sorted(set(found))) if forward is not None else (None, why)


def _norm_call(node, norms) -> str | None:
    """The norm's name where node is `self.<norm>(<one argument>)`."""
    if (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self" and node.func.attr in norms):
        return node.func.attr
    return None


def _add_operands(node) -> tuple | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return node.left, node.right
    return None


def _call(norm: str, a, b):
    return ast.Call(ast.Name(_CALL, ast.Load()),
                    [ast.Attribute(ast.Name("self", ast.Load()), norm, ast.Load()), a, b], [])


def _rewrite_body(node, norms, found) -> None:
    """Rewrites, in every statement list under node, the two forms (module docstring)."""
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list):
            setattr(node, field, _rewrite_statements(stmts, norms, found))
            for s in getattr(node, field):
                _rewrite_body(s, norms, found)
    for h in getattr(node, "handlers", []):
        _rewrite_body(h, norms, found)


class _AddInCall(ast.NodeTransformer):
    """self.<norm>(a + b) -> _fusedlayers_add_norm(self.<norm>, a, b)[0]."""

    def __init__(self, norms, found):
        self.norms, self.found = norms, found

    def visit_Call(self, node):
        self.generic_visit(node)
        norm = _norm_call(node, self.norms)
        add = norm and _add_operands(node.args[0])
        if not add:
            return node
        self.found.append(norm)
        return ast.Subscript(_call(norm, *add), ast.Constant(0), ast.Load())


def _name_assign(stmt):
    """(target, value) of `name = value`."""
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)):
        return stmt.targets[0].id, stmt.value
    return None


def _rewrite_statements(stmts, norms, found) -> list:
    out, i = [], 0
    while i < len(stmts):
        first = _name_assign(stmts[i])
        add = first and _add_operands(first[1])
        if add:
            s, j, aliases = first[0], i + 1, []
            while j < len(stmts) and (alias := _name_assign(stmts[j])) and \
                    isinstance(alias[1], ast.Name) and alias[1].id == s and alias[0] != s:
                aliases.append(stmts[j])
                j += 1
            last = _name_assign(stmts[j]) if j < len(stmts) else None
            norm = last and _norm_call(last[1], norms)
            if norm and isinstance(last[1].args[0], ast.Name) and last[1].args[0].id == s \
                    and all(a.targets[0].id != last[0] for a in aliases):
                found.append(norm)
                out.append(ast.Assign([ast.Tuple([ast.Name(_Y, ast.Store()),
                                                  ast.Name(s, ast.Store())], ast.Store())],
                                      _call(norm, *add)))
                out += aliases
                out.append(ast.Assign([ast.Name(last[0], ast.Store())], ast.Name(_Y, ast.Load())))
                i = j + 1
                continue
        out.append(_AddInCall(norms, found).visit(stmts[i]))
        i += 1
    return out
