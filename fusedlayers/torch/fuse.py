"""`fuse(model)`: swaps the unfused layers of an existing torch model for fusedlayers' modules, in
place, sharing the model's Parameters (nothing is copied, so optimizer state, tied weights and
checkpoints stay valid).

What is recognised is structure, not class names:
- a module becomes the fused module whose `fuse_candidates(module)` names it: the rule lives with
  the fused module, the `FUSED_MODULE` of an op's torch module (fusedlayers.ops): every
  `nn.LayerNorm` becomes `LayerNorm`; every `nn.RMSNorm`, and every Llama- or Gemma-style
  look-alike whose output matches, `RMSNorm`;
- a linear layer whose output feeds only a GELU becomes `FusedLinearGELU` (weight (out, in), as
  nn.Linear) or `FusedConv1DGELU` (weight (in, out), as GPT-2's Conv1D), and the GELU an
  `nn.Identity`. A module is a linear layer when its only Parameters are a 2-D `weight` and a
  `bias`, and its output on a probe input is `x @ weight^T + bias` (or `x @ weight + bias`); it
  is a GELU when it holds no state and its output on a float64 probe from -100 to 100 is erf or
  tanh GELU. Who feeds whom is read from the parent module's forward, traced with torch.fx with
  every child module as a leaf: the linear layer is called once, the GELU once, on the linear
  layer's output and nothing else. Where torch.fx cannot trace the forward (it unpacks or
  iterates a tensor, takes *args, ...), its source is read instead: a call
  `self.<gelu>(self.<linear>(...))`, each of the two children named nowhere else in the forward,
  is such a pair (the linear layer's output is a temporary that only the GELU sees);
- a ReLU (a stateless module whose output is exactly relu's) becomes `FusedReLUScale(1.0)`,
  which saves 1 bit per element for the backward instead of the output;
- a residual add whose sum a block's norm takes (a pre-norm decoder's post-attention add, BERT's
  `LayerNorm(hidden + input_tensor)`): the add inside the norm, add_rms_norm / add_layer_norm
  (fusedlayers.torch.residual_add), per instance;
- Hugging Face attention calling `apply_rotary_pos_emb` (fusedlayers.torch.rope), a Hugging
  Face causal LM's head and loss in training (fusedlayers.torch.causal_lm), and the experts
  modules of transformers' mixture-of-experts models (those of `use_experts_implementation`:
  Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss, ...) as moe_experts
  (fusedlayers.torch.moe_experts), per instance;
- with `fp8=recipe`, every other nn.Linear becomes `Fp8Linear` (its GEMMs in FP8 as the recipe
  says), but a model's output embeddings (the LM head) and a mixture-of-experts router (a
  linear `gate`/`router` beside an `experts` module), which stay in their dtype as in
  Transformer Engine and torchao, and layers whose sizes are not multiples of 16.

Every swap is checked on a probe input against the layers it replaces before it is made; one
that does not match is not made and is reported. Probing forks the RNG, so the model's random
stream is the same as without fuse(). The report of what was swapped and what was left, and
why, is `model.fusedlayers_report` (printed with verbose=True).
"""

import ast
import inspect
import textwrap
from collections import Counter

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .. import ops
from ..fp8_recipe import Fp8Recipe
from ..fuse_report import FuseReport, class_name
from .fp8_linear import Fp8Linear, supports as fp8_supports
from .linear_gelu import FusedConv1DGELU, FusedLinearGELU
from .relu_scale import FusedReLUScale
from .causal_lm import fuse_causal_lm, takes_router_logits
from .layer_norm import LayerNorm
from .moe_experts import fuse_experts
from .residual_add import fuse_adds
from .rms_norm import RMSNorm
from .rope import fuse_attention

# ||fused - original|| / ||original|| allowed on a probe, per dtype: rounding, not a different
# function (a wrong layout, bias or GELU form is off by far more).
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3,
              torch.bfloat16: 3e-2}
_TOLERANCE_TF32 = 2e-3  # float32 matmuls on TF32 (torch.backends.cuda.matmul.allow_tf32)
_PROBE_ROWS = 5


def fuse(model: nn.Module, *, verbose: bool = False, fp8: Fp8Recipe | None = None,
         **enabled: bool) -> nn.Module:
    """Swaps, in place, every nn.LayerNorm for `LayerNorm`, every RMSNorm (nn.RMSNorm, or a
    Llama- or Gemma-style module: one `weight`, an `eps` or `variance_epsilon`, no children) for
    `RMSNorm`, every linear layer whose output feeds only a GELU for `FusedLinearGELU` /
    `FusedConv1DGELU` (+ nn.Identity), and every ReLU for `FusedReLUScale(1.0)`, sharing the
    existing Parameters. Works on train() and eval() models, on any device and dtype the fused
    ops support.

    enabled: one keyword per op of fusedlayers.ops (layer_norm=False leaves the LayerNorms, ...,
    linear_cross_entropy=False a causal LM's head and loss, moe_experts=False (or moe_permute /
    moe_unpermute=False, which it runs on) the experts of MoE models); every op is fused by
    default. fp8: an Fp8Recipe to run the model's other linear layers in FP8 (Fp8Linear; see
    above for those left), or None (default) to leave them.
    Returns `model`; its `fusedlayers_report` attribute lists what was swapped and what was
    left, and why (printed when verbose). Raises TypeError if model is not an nn.Module or a
    keyword names no op.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fusedlayers.torch.fuse: model must be a torch.nn.Module, got "
                        f"{type(model).__module__}.{type(model).__qualname__}")
    names = ops.NAMES
    unknown = set(enabled) - set(names)
    if unknown:
        raise TypeError(f"fusedlayers.torch.fuse: unexpected keyword(s) {sorted(unknown)}; the "
                        f"ops are {', '.join(names)}")
    wanted = {name: bool(enabled.get(name, True)) for name in names}
    report = FuseReport()
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for op in ops.OPS:
            fused_cls = getattr(ops.module(op, "torch"), "FUSED_MODULE", None)
            if fused_cls is not None and wanted[op.name]:
                _fuse_modules(model, report, fused_cls, class_name(fused_cls))
        fusing = tuple(cls for cls, op in ((RMSNorm, "add_rms_norm"), (LayerNorm, "add_layer_norm"))
                       if wanted[op])
        if fusing:
            _fuse_residual_adds(model, report, fusing)
        if wanted["linear_gelu"] or wanted["relu_scale"]:
            _fuse_traced(model, report, wanted["linear_gelu"], wanted["relu_scale"])
        if wanted["rope"]:
            _fuse_rope(model, report)
        if wanted["linear_cross_entropy"]:
            _fuse_causal_lm(model, report)
        if wanted["moe_experts"] and wanted["moe_permute"] and wanted["moe_unpermute"]:
            _fuse_experts(model, report)
        if fp8 is not None:
            _fuse_fp8_linears(model, report, fp8)
    model.fusedlayers_report = report
    if verbose:
        print(report)
    return model


def _fuse_rope(model: nn.Module, report: FuseReport) -> None:
    """Each attention module that calls `apply_rotary_pos_emb` gets, on the instance, its forward
    reading fusedlayers' (fusedlayers.torch.rope.fuse_attention): per model instance, reported."""
    for path, module in model.named_modules():
        forward, why = fuse_attention(module)
        if forward is not None:
            module.forward = forward
            report.swapped.append((path, _describe(module),
                                   "fusedlayers.torch.rope (this instance's forward calls it for "
                                   "its modeling module's rotary functions; `del module.forward` "
                                   "undoes it)"))
        elif why is not None:
            report.left.append((path, _describe(module), f"RoPE: {why}"))


def _fuse_residual_adds(model: nn.Module, report: FuseReport, fusing: tuple) -> None:
    """Each block whose forward adds a residual and feeds the sum to one of its (fused) norms gets,
    on the instance, a forward running the add inside the norm (fusedlayers.torch.residual_add):
    per model instance, reported."""
    for path, module in model.named_modules():
        forward, found = fuse_adds(module, fusing)
        if forward is not None:
            module.forward = forward
            ops_ = sorted({"add_rms_norm" if isinstance(getattr(module, n), RMSNorm)
                           else "add_layer_norm" for n in found})
            report.swapped.append((path, _describe(module),
                                   f"fusedlayers.{'/'.join(ops_)}: the residual add before "
                                   f"{', '.join(found)} (this instance's forward; "
                                   f"`del module.forward` undoes it)"))
        elif found is not None:
            report.left.append((path, _describe(module), f"residual add: {found}"))


def _fuse_causal_lm(model: nn.Module, report: FuseReport) -> None:
    """Each Hugging Face causal LM: its LM head and loss as one linear_cross_entropy in training
    with labels (fusedlayers.torch.causal_lm), per instance, reported."""
    for path, module in model.named_modules():
        fused, why = fuse_causal_lm(module)
        if fused:
            coef = getattr(module.config, "router_aux_loss_coef", None) \
                if takes_router_logits(module) else None
            kept = "" if coef is None else \
                f"; the router's load-balancing loss (router_aux_loss_coef {coef:g}) kept"
            report.swapped.append((_join(path, "lm_head"), _describe(module.lm_head),
                                   f"fusedlayers.torch.linear_cross_entropy with the model's loss "
                                   f"in training with labels{kept}; no logits returned then "
                                   f"(`del model.forward, model.lm_head.forward, "
                                   f"model._loss_function` undoes it)"))
        elif why is not None:
            report.left.append((_join(path, "lm_head"), _describe(module.lm_head),
                                f"linear_cross_entropy: {why}"))


def _fuse_experts(model: nn.Module, report: FuseReport) -> None:
    """Each transformers experts module gets, on the instance, its forward as moe_experts
    (fusedlayers.torch.moe_experts.fuse_experts): per model instance, reported. The router is
    the model's own, so its logits and the load-balancing loss are unchanged."""
    for path, module in model.named_modules():
        forward, why = fuse_experts(module)
        if forward is not None:
            module.forward = forward
            report.swapped.append((path, _describe(module),
                                   f"fusedlayers.torch.moe_experts, gate {forward.fused_gate} "
                                   f"(this instance's forward; `del module.forward` undoes it)"))
        elif why is not None:
            report.left.append((path, _describe(module), f"experts: {why}"))


def _fuse_fp8_linears(model: nn.Module, report: FuseReport, recipe: Fp8Recipe) -> None:
    """Each nn.Linear (the class itself: a subclass may compute something else) becomes an
    Fp8Linear sharing its Parameters, but the output embeddings and routers (kept in their
    dtype) and those whose sizes FP8 GEMMs cannot take."""
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"fusedlayers.torch.fuse: fp8 must be a fusedlayers.Fp8Recipe or None, "
                        f"got {type(recipe).__name__}")
    kept = {}
    for path, module in model.named_modules():
        head = getattr(module, "get_output_embeddings", None)
        head = head() if callable(head) else None
        if isinstance(head, nn.Module):
            kept[id(head)] = "the output embeddings (LM head) stay in their dtype"
        if "experts" in module._modules:
            for name in ("gate", "router"):
                if isinstance(module._modules.get(name), nn.Linear):
                    kept[id(module._modules[name])] = "a mixture-of-experts router stays in " \
                        "its dtype"
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        why = kept.get(id(module))
        if why is None and _has_state_hooks(module):
            why = "it has hooks or parametrizations an Fp8Linear would drop"
        if why is None and not fp8_supports(module.in_features, module.out_features):
            why = (f"in_features {module.in_features} and out_features {module.out_features} "
                   f"must be multiples of 16 for FP8 GEMMs")
        if why is not None:
            report.left.append((path, _describe(module), f"fp8: {why}"))
            continue
        _set(model, path, Fp8Linear.from_linear(module, recipe).train(module.training))
        tiles = ", wgrad's x^T by 128x128 tiles" if recipe.wgrad_x_scaling == "128x128" else ""
        report.swapped.append((path, _describe(module), f"{class_name(Fp8Linear)} "
                               f"({recipe.scaling}, {recipe.format}, {'+'.join(recipe.gemms)}"
                               f"{tiles})"))


# ---------------------------------------------------------------- probes

def _describe(module: nn.Module) -> str:
    return class_name(type(module))


def _has_state_hooks(module: nn.Module) -> bool:
    """Hooks or parametrizations that a swapped-in module would silently drop."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return any(getattr(module, h, None) for h in hooks) or parametrize.is_parametrized(module)


def _stateless(module: nn.Module) -> bool:
    return not module._parameters and not module._buffers and not module._modules


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    den = ref.norm().item()
    return (got - ref).norm().item() / (den if den > 0 else 1.0)


def _matches(got, ref) -> tuple[bool, float]:
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf")
    err = _rel_err(got, ref)
    tol = _TOLERANCE.get(ref.dtype, 0.0)
    if ref.dtype == torch.float32 and ref.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        tol = _TOLERANCE_TF32
    return err <= tol, err


def _probe(shape, like: torch.Tensor) -> torch.Tensor:
    # A generator of its own: the probe neither reads nor moves the model's random stream.
    gen = torch.Generator(device=like.device).manual_seed(0)
    return torch.randn(shape, generator=gen, device=like.device, dtype=like.dtype)


def _gelu_form(module: nn.Module, device: torch.device) -> str | None:
    """'none' or 'tanh' when module is a stateless GELU of that form, else None."""
    if not _stateless(module) or _has_state_hooks(module):
        return None
    x = torch.cat([torch.linspace(-8, 8, 513, dtype=torch.float64),
                   torch.tensor([-100.0, -20.0, -0.0, 20.0, 100.0], dtype=torch.float64)])
    for dtype, rtol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
        try:
            y = module(x.to(device, dtype))
        except Exception:  # not elementwise, or not on this dtype: try the next, else not a GELU
            continue
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return None
        for form in ("none", "tanh"):
            ref = F.gelu(x, approximate=form)
            if torch.allclose(y.double().cpu(), ref, rtol=rtol, atol=rtol):
                return form
        return None
    return None


def _linear_layout(module: nn.Module) -> str | None:
    """'out_in' when module computes x @ weight^T + bias (nn.Linear), 'in_out' when it computes
    x @ weight + bias (GPT-2's Conv1D), else None. Judged on a probe input."""
    params = module._parameters
    w, b = params.get("weight"), params.get("bias")
    if (module._modules or module._buffers or set(params) - {"weight", "bias"}
            or not isinstance(w, nn.Parameter) or w.dim() != 2 or not w.is_floating_point()
            or (b is not None and b.dim() != 1) or _has_state_hooks(module)
            or w.device.type == "meta"):
        return None
    rows, cols = w.shape
    for layout, in_features, out_features in (("out_in", cols, rows), ("in_out", rows, cols)):
        if b is not None and b.shape[0] != out_features:
            continue
        x = _probe((_PROBE_ROWS, in_features), w)
        try:
            y = module(x)
        except Exception:
            continue
        ref = F.linear(x, w if layout == "out_in" else w.t(), b)
        if _matches(y, ref)[0]:
            return layout
    return None


def _is_relu(module: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    if isinstance(module, FusedReLUScale) or not _stateless(module) or _has_state_hooks(module):
        return False
    x = torch.tensor([-3.0, -0.0, 0.0, 0.5, 7.0, 1e30, -1e30, float("inf"), float("-inf"),
                      float("nan")], device=device, dtype=dtype)
    try:
        y = module(x.clone())
    except Exception:
        return False
    return isinstance(y, torch.Tensor) and torch.equal(y.isnan(), x.isnan()) and \
        torch.equal(torch.nan_to_num(y), torch.nan_to_num(torch.relu(x)))


def _mutates_input(module: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.tensor([-1.0, 1.0], device=device, dtype=dtype)
    module(x)
    return bool(x[0] != -1.0)


# ---------------------------------------------------------------- modules with a fuse rule

def _fuse_modules(model: nn.Module, report: FuseReport, fused_cls, label: str) -> None:
    """Swaps each child for the first of fused_cls.fuse_candidates(child) that is verified."""
    fused_of = {}  # id(module) -> its fused module, so a shared module stays shared
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            candidates, certain = fused_cls.fuse_candidates(child)
            if not candidates:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            if id(child) not in fused_of:
                fused_of[id(child)] = _verified(child, candidates, certain, path, report)
            fused = fused_of[id(child)]
            if fused is not None:
                setattr(parent, name, fused)
                report.swapped.append((path, _describe(child), label))


def _verified(module: nn.Module, candidates, certain: bool, path: str, report: FuseReport):
    """The first candidate whose output matches module's on a probe. On the meta device nothing
    runs: a certain candidate is taken, a look-alike's is not."""
    if _has_state_hooks(module):
        report.left.append((path, _describe(module), "has hooks or parametrizations"))
        return None
    like = _param_like(module)
    like = torch.empty(0) if like is None else like
    err = float("nan")
    for fused in candidates:
        fused.train(module.training)
        if like.device.type == "meta":
            if certain:
                return fused
            report.left.append((path, _describe(module), "on the meta device, a look-alike "
                                                         "cannot be verified without running it"))
            return None
        shape = getattr(fused, "probe_shape", None) or (_PROBE_ROWS, *fused.normalized_shape)
        x = _probe(shape, like)
        try:
            ok, err = _matches(fused(x), module(x))
        except Exception as e:  # a dtype or device the fused op does not support
            report.left.append((path, _describe(module), f"the fused op fails on it: {e}"))
            return None
        if ok:
            return fused
    report.left.append((path, _describe(module), f"probe mismatch (relative error {err:.1e})"))
    return None


# ---------------------------------------------------------------- Linear + GELU, ReLU

class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces one module's own forward: each submodule call is one node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


def _param_like(module: nn.Module) -> torch.Tensor | None:
    return next(iter(module.parameters()), None)


def _fuse_traced(model: nn.Module, report: FuseReport, linear_gelu: bool,
                 relu_scale: bool) -> None:
    model_like = _param_like(model)
    for parent_path, parent in list(model.named_modules()):
        children = dict(parent.named_children())
        if not children:
            continue
        like = _param_like(parent)  # where and in what the children run
        like = model_like if like is None else like
        device = like.device if like is not None else torch.device("cpu")
        dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
        gelus = {n: f for n, c in children.items()
                 if linear_gelu and (f := _gelu_form(c, device)) is not None}
        relus = {n for n, c in children.items() if relu_scale and _is_relu(c, device, dtype)}
        if not gelus and not relus and not (linear_gelu and _calls_gelu(parent)):
            continue
        try:
            graph = _ChildrenAsLeaves().trace(parent)
        except Exception as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            pairs = _nested_calls(parent) if gelus else []
            for linear_name, act_name in pairs:
                if act_name in gelus:
                    _fuse_names(parent, parent_path, linear_name, act_name, gelus[act_name],
                                None, report)
            left = sorted({*relus, *(set(gelus) - {act for _, act in pairs})})
            if left:
                report.left.append((parent_path, f"{_describe(parent)} ({', '.join(left)})",
                                    f"its forward cannot be traced by torch.fx ({first_line}), "
                                    f"and its source does not call these as "
                                    f"self.<gelu>(self.<linear>(...))"))
            continue
        calls = [n for n in graph.nodes if n.op == "call_module"]
        count = {}
        for n in calls:
            count[n.target] = count.get(n.target, 0) + 1
        if linear_gelu:
            _report_functional_gelus(parent, parent_path, graph, report)
        for act in calls:
            if act.target in gelus:
                _fuse_pair(parent, parent_path, act, gelus[act.target], count, report)
            elif act.target in relus:
                _fuse_relu(parent, parent_path, act, count, graph, report, device, dtype)


def _calls_gelu(module: nn.Module) -> bool:
    """Whether module's forward names F.gelu (worth tracing to report it)."""
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and "gelu" in code.co_names


def _report_functional_gelus(parent: nn.Module, parent_path: str, graph: torch.fx.Graph,
                             report: FuseReport) -> None:
    """A linear layer followed by F.gelu called in the parent's forward: the forward's code would
    have to change, so it is left; say so."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not F.gelu or not node.args:
            continue
        producer = node.args[0]
        if isinstance(producer, torch.fx.Node) and producer.op == "call_module" and \
                _linear_layout(parent.get_submodule(producer.target)) is not None:
            report.left.append((_join(parent_path, producer.target),
                                f"{_describe(parent.get_submodule(producer.target))} + F.gelu",
                                "the GELU is a function call in the forward, not a module "
                                "that can be swapped out"))


def _join(parent_path: str, name: str) -> str:
    return f"{parent_path}.{name}" if parent_path else name


def _nested_calls(parent: nn.Module) -> list[tuple[str, str]]:
    """(linear, act) child names called as `self.<act>(self.<linear>(...))` in parent's forward
    source, each of the two named nowhere else in it; [] where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(parent).forward)))
        fn = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return []
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
        return []
    me = fn.args.args[0].arg

    def child(node) -> str | None:
        ok = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id == me
        return node.attr if ok else None

    named = Counter(child(n) for n in ast.walk(fn) if child(n) is not None)
    pairs = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.args[0], ast.Call)):
            continue
        act, linear = child(node.func), child(node.args[0].func)
        if act and linear and named[act] == 1 and named[linear] == 1:
            pairs.append((linear, act))
    return pairs


def _fuse_pair(parent: nn.Module, parent_path: str, act: torch.fx.Node, form: str,
               count: dict, report: FuseReport) -> None:
    producer = act.args[0] if len(act.args) == 1 and not act.kwargs else None
    if not (isinstance(producer, torch.fx.Node) and producer.op == "call_module"):
        return  # a GELU fed by something else than a module: nothing to fuse with
    reason = None
    if len(producer.users) != 1:
        reason = f"the {producer.target} output also feeds {len(producer.users) - 1} other node(s)"
    elif count[producer.target] != 1 or count[act.target] != 1:
        reason = "the linear layer or the GELU is called more than once in the forward"
    elif len(producer.args) != 1 or producer.kwargs:
        reason = "the linear layer is called with more than one argument"
    _fuse_names(parent, parent_path, producer.target, act.target, form, reason, report)


def _fuse_names(parent: nn.Module, parent_path: str, linear_name: str, act_name: str, form: str,
                reason: str | None, report: FuseReport) -> None:
    """Swaps child linear_name + child act_name (a GELU of `form` fed only by the linear layer's
    output) unless `reason` says why not, the linear one is no linear layer, or the probe
    differs."""
    linear = parent.get_submodule(linear_name)
    lin_path = _join(parent_path, linear_name)
    what = f"{_describe(linear)} + {_describe(parent.get_submodule(act_name))}"
    weight = linear._parameters.get("weight")
    if isinstance(weight, nn.Parameter) and weight.dim() == 2 and _has_state_hooks(linear):
        report.left.append((lin_path, what, "has hooks or parametrizations, which the fused "
                                            "module would drop"))
        return  # not probed either: that would run the hooks
    layout = _linear_layout(linear)
    if layout is None:
        return  # the GELU follows a module that is not a linear layer
    if reason:
        report.left.append((lin_path, what, reason))
        return
    fused = (FusedLinearGELU.from_linear(linear, approximate=form) if layout == "out_in"
             else FusedConv1DGELU.from_conv1d(linear, approximate=form))
    fused.train(linear.training)
    act_module = parent.get_submodule(act_name)
    w = linear.weight
    x = _probe((_PROBE_ROWS, w.shape[1] if layout == "out_in" else w.shape[0]), w)
    try:
        ok, err = _matches(fused(x), act_module(linear(x)))
    except Exception as e:
        report.left.append((lin_path, what, f"the fused op fails on it: {e}"))
        return
    if not ok:
        report.left.append((lin_path, what, f"probe mismatch (relative error {err:.1e})"))
        return
    _set(parent, linear_name, fused)
    _set(parent, act_name, nn.Identity().train(act_module.training))
    report.swapped.append((f"{lin_path} + {act_name}", what,
                           f"{class_name(type(fused))}(approximate={form!r}) + "
                           f"{class_name(nn.Identity)}"))


def _fuse_relu(parent: nn.Module, parent_path: str, node: torch.fx.Node, count: dict,
               graph: torch.fx.Graph, report: FuseReport, device, dtype) -> None:
    path = _join(parent_path, node.target)
    relu = getattr(parent, node.target)
    source = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    reason = None
    if count[node.target] != 1:
        reason = "called more than once in the forward"
    elif not isinstance(source, torch.fx.Node):
        reason = "not called on one tensor"
    elif _mutates_input(relu, device, dtype) and len(source.users) != 1:
        # In place, later readers of the input see the ReLU's output: keep that semantics.
        reason = "in place, and its input is read again after it"
    if reason:
        report.left.append((path, _describe(relu), reason))
        return
    _set(parent, node.target, FusedReLUScale(1.0).train(relu.training))
    report.swapped.append((path, _describe(relu), f"{class_name(FusedReLUScale)}(1.0)"))


def _set(parent: nn.Module, target: str, module: nn.Module) -> None:
    owner_path, _, name = target.rpartition(".")
    setattr(parent.get_submodule(owner_path) if owner_path else parent, name, module)

