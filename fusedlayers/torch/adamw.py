"""fusedlayers.torch.AdamW: torch.optim.AdamW whose step is csrc's multi-tensor AdamW
(csrc/optimizer/adamw.h): every parameter of a device in one pass over its tensors (a launch per few
hundred tensors on CUDA), with float32 master weights for float16/bfloat16 parameters, moments
in another dtype than the parameters', gradient-norm clipping, AMP's GradScaler and CUDA graphs.

The state and its `state_dict` are torch.optim.AdamW's (per parameter "step", "exp_avg",
"exp_avg_sq", "max_exp_avg_sq"; param_groups with its keys), plus "master_param" where a
parameter has a master weight: a checkpoint of either optimizer loads into the other (torch's
casts the moments to the parameters' dtype and keeps the masters unused; this one keeps float32
moments and masters float32, and makes a master from the parameter where a checkpoint has none).
"""

import torch
import torch.distributed as dist

from . import _op

_HALF = (torch.float16, torch.bfloat16)


def _local(t):
    """The local shard of a DTensor (FSDP2's sharded parameters and their states), else t."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _scalar(t, device):
    """A float32 one-element tensor on device, for the pass to read where it runs."""
    return None if t is None else t.to(device=device, dtype=torch.float32, non_blocking=True)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) on csrc's fused pass.

    Arguments as torch.optim.AdamW's, and:
      master_weights: keep a float32 copy of each float16/bfloat16 parameter (state
        "master_param") that the update runs on; the parameter is the master rounded to its
        dtype, written in the same pass. Moments are then float32 unless moment_dtype says.
      moment_dtype: the dtype of exp_avg / exp_avg_sq (and max_exp_avg_sq): None for the
        parameter's (torch's), float32 for 16-bit parameters, bfloat16 or float16 for float32 ones.
      max_grad_norm: clip the gradients to this global 2-norm in the update, as
        torch.nn.utils.clip_grad_norm_ would before the step (over every parameter of every
        group; under FSDP2 over all shards). `grad_norm` is the norm before clipping.
      capturable: kept for torch's signature and checkpoints; every step here is capturable (the
        step counts, lr given as a tensor, GradScaler's scale and found_inf are read on the
        device), so a step captures in a CUDA graph; pass lr as a tensor for a schedule to reach
        the graph.

    Parameters: float32, float64, float16 or bfloat16, dense, on CPU or CUDA, DTensor shards
    included; each gradient of its parameter's dtype. Raises ValueError / TypeError naming the
    argument (at construction for the hyperparameters, else at the first step).
    """

    _step_supports_amp_scaling = True  # GradScaler hands grad_scale and found_inf to step()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, capturable=False, master_weights=False,
                 moment_dtype=None, max_grad_norm=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=None, capturable=capturable,
                        differentiable=False, fused=None, decoupled_weight_decay=True,
                        master_weights=master_weights, moment_dtype=moment_dtype)
        self.max_grad_norm = max_grad_norm
        self._grad_sumsq = None
        self._norm_scale = None
        super().__init__(params, defaults)  # add_param_group checks each group

    def _check_group(self, group):
        """csrc's checks of the hyperparameters, so a bad value fails here."""
        lr = group["lr"]
        _op.handle("adamw_check")(0.0 if torch.is_tensor(lr) else float(lr), *group["betas"],
                                  group["eps"], group["weight_decay"],
                                  float(self.max_grad_norm or 0))
        if group["moment_dtype"] not in (None, torch.float32, torch.float64, *_HALF):
            raise TypeError(f"fusedlayers.adamw: moment_dtype must be a floating dtype or None, "
                            f"got {group['moment_dtype']}")

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("master_weights", False)
            group.setdefault("moment_dtype", None)

    @classmethod
    def with_master_weights(cls, model: torch.nn.Module, dtype=torch.bfloat16, **kwargs):
        """Casts the float32 parameters of `model` to `dtype` in place (the same Parameter
        objects; buffers keep their dtype) and returns an AdamW over model.parameters() with
        master_weights=True whose masters start from the float32 values exactly.

        For Hugging Face Trainer's bf16=True recipe (float32 weights under bf16 autocast): the
        forward then reads bf16 weights without casting them each step, gradients are bf16 (half
        the bytes, no float32 accumulation of bf16 products), and the update still runs on float32
        weights. Under gradient accumulation the gradients sum in bf16."""
        masters = {}
        for p in model.parameters():
            if hasattr(p, "device_mesh"):
                raise ValueError(
                    "fusedlayers.adamw: with_master_weights casts parameters in place, which "
                    "FSDP2's sharded parameters (DTensor) do not allow; cast the model to bfloat16 "
                    "before fully_shard and pass master_weights=True to AdamW (the masters then "
                    "start from the bfloat16 values)")
            if p.dtype == torch.float32:
                masters[p] = p.detach().clone()
                p.data = p.data.to(dtype)
        opt = cls(model.parameters(), master_weights=True, **kwargs)
        for p, master in masters.items():
            opt._init_state(p, opt.param_groups[0])["master_param"].copy_(master)
        return opt

    def _moment_dtype(self, group, p):
        if group["moment_dtype"] is not None:
            return group["moment_dtype"]
        return torch.float32 if group["master_weights"] and p.dtype in _HALF else p.dtype

    def _init_state(self, p, group):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            dtype = self._moment_dtype(group, p)
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"]
                                                    else ()):
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group["master_weights"] and p.dtype in _HALF and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    def _tables(self):
        """Per group, per device: the lists of the fused pass (local shards)."""
        tables = []
        for group in self.param_groups:
            by_device = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("fusedlayers.adamw does not take sparse gradients")
                state = self._init_state(p, group)
                local = _local(p)
                t = by_device.setdefault(local.device, {k: [] for k in (
                    "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters",
                    "steps")})
                t["params"].append(local)
                t["grads"].append(_local(p.grad))
                t["exp_avgs"].append(_local(state["exp_avg"]))
                t["exp_avg_sqs"].append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    t["max_exp_avg_sqs"].append(_local(state["max_exp_avg_sq"]))
                master = state.get("master_param")
                t["masters"].append(None if master is None else _local(master))
                t["steps"].append(state["step"])
            for device, t in by_device.items():
                # none: an empty list; else an empty tensor where a parameter has none
                if all(m is None for m in t["masters"]):
                    t["masters"] = []
                elif None in t["masters"]:
                    none = torch.empty(0, device=device)
                    t["masters"] = [none if m is None else m for m in t["masters"]]
            tables.append((group, by_device))
        return tables

    def _sumsq(self, tables):
        """The sum of squares of every gradient (all groups, devices and shards), per device.
        A DTensor gradient's local sums are summed over the mesh dimensions it is sharded on
        (FSDP2's shards; HSDP's replicas hold the same values and are not added again)."""
        grads = {}  # (mesh, the mesh dims the gradient is sharded on) -> device -> local grads
        for group, _ in tables:
            for p in group["params"]:
                if p.grad is None:
                    continue
                key = None
                if hasattr(p.grad, "device_mesh"):
                    dims = tuple(i for i, pl in enumerate(p.grad.placements) if pl.is_shard())
                    key = (p.grad.device_mesh, dims) if dims else None
                local = _local(p.grad)
                grads.setdefault(key, {}).setdefault(local.device, []).append(local)
        sumsq = _op.handle("adamw_grad_sumsq")
        sums = {}
        for key, by_device in grads.items():
            for device, g in by_device.items():
                s = sumsq(g, g[0])
                if key is not None:
                    mesh, dims = key
                    for dim in dims:
                        dist.all_reduce(s, group=mesh.get_group(dim))
                sums[device] = s if device not in sums else sums[device] + s
        if len(sums) > 1:
            total = sum(s.to(next(iter(sums)), non_blocking=True) for s in sums.values())
            sums = {d: total.to(d, non_blocking=True) for d in sums}
        return sums

    @property
    def grad_norm(self):
        """The 2-norm of all the (unscaled) gradients of the last step, before clipping: a
        float64 tensor on the first parameters' device; None unless max_grad_norm is set."""
        if self._grad_sumsq is None:
            return None
        norm = self._grad_sumsq.sqrt()
        return norm if self._norm_scale is None else norm / self._norm_scale

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient; returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        tables = self._tables()
        clip = self.max_grad_norm is not None and self.max_grad_norm > 0
        sums = self._sumsq(tables) if clip else {}
        self._grad_sumsq = next(iter(sums.values())) if sums else None
        self._norm_scale = grad_scale
        adamw = _op.handle("adamw")
        for group, by_device in tables:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            for device, t in by_device.items():
                # A CPU lr is read here (no sync); a device one where the pass runs.
                on_device = torch.is_tensor(lr) and lr.device.type != "cpu"
                lr_tensor = _scalar(lr, device) if on_device else None
                lr_value = 0.0 if on_device else float(lr)
                adamw(t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"],
                      t["max_exp_avg_sqs"], t["masters"], t["steps"], lr_value, lr_tensor,
                      beta1, beta2, group["eps"], group["weight_decay"], group["amsgrad"],
                      group["maximize"], _scalar(grad_scale, device), _scalar(found_inf, device),
                      sums.get(device), float(self.max_grad_norm) if clip else 0.0)
        return loss

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer's, keeping each state tensor in this optimizer's dtype for it
        (the base class casts every one to its parameter's dtype): float32 masters, the moments
        in the group's moment dtype, float32 steps on the parameters' device."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for i, p in zip(ids, params):
            if i not in saved:
                continue
            state, group = self.state[p], group_of[p]
            moments = self._moment_dtype(group, p)
            for key, value in saved[i].items():
                if not torch.is_tensor(value):
                    continue
                dtype = {"step": torch.float32, "master_param": torch.float32}.get(key, moments)
                state[key] = value.to(device=_local(p).device if key == "step" else p.device,
                                      dtype=dtype)
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32,
                                             device=_local(p).device)


@_op.register_fake("adamw")
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, lr, lr_tensor,
      beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale, found_inf, grad_sumsq,
      max_grad_norm):
    return None


@_op.register_fake("adamw_grad_sumsq")
def _(grads, like):
    return like.new_empty((), dtype=torch.float64)


__all__ = ["AdamW"]
