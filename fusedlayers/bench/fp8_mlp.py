"""`python -m fusedlayers bench --fp8`, the MLP rows: two Llama-3-8B MLP blocks (x + down(
swiglu(gate(n), up(n))) with n = rmsnorm(x); hidden 4096, ffn 14336) forward and backward at
8192 tokens, bf16 parameters: stock torch eager and compiled; fuse(model) (bf16) and
fuse(model, fp8=recipe) (the FP8 gated MLP: blockwise, blockwise with the weight gradients' x^T
in 128x128 tiles, tensorwise); the same with
each projection an Fp8Linear of its own ("layers": every quantization a pass of its own beside
fusedlayers' RMSNorm and swiglu); torchao's float8
training (tensorwise and rowwise) under torch.compile where torchao is installed, in one run.
Each row: ms a step and its peak memory above the inputs. CPU: hidden 256, ffn 512, 256 tokens.
"""

import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8_recipe import Fp8Recipe
from ..torch import Fp8Linear, RMSNorm, fuse, swiglu
from .ops import time_rounds
from .table import did_not_run, format_speedup, speedup

HEADER = f"{'variant':<44} {'ms':>9} {'MiB':>8}  {'vs bf16 eager':<20}"
RECIPES = {"blockwise": Fp8Recipe(), "blockwise x^T tiles": Fp8Recipe(wgrad_x_scaling="128x128"),
           "tensorwise": Fp8Recipe("tensorwise")}


@dataclass
class MlpRow:
    variant: str
    ms: float | None
    peak_mib: float | None
    rounds_ms: list | None
    vs_eager: dict | None = None
    not_run: str = ""


class Mlp(nn.Module):
    """Llama's MLP in stock torch ops."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Llama's MLP block with its pre-norm and residual."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = Mlp(hidden, ffn)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def model(hidden, ffn, device, fused: bool, recipe: Fp8Recipe | None = None,
          layers: bool = False) -> nn.Module:
    """Two blocks; fused: as fuse(model, fp8=recipe) makes them (the FP8 gated MLP where a
    recipe is given), or with `layers` each projection an Fp8Linear of its own beside
    fusedlayers' RMSNorm and swiglu."""
    blocks = nn.Sequential(*(Block(hidden, ffn) for _ in range(2))).to(device, torch.bfloat16)
    if fused and not layers:
        fuse(blocks, fp8=recipe)
    elif fused:
        for b in blocks:
            norm = RMSNorm(hidden, eps=1e-5).to(device, torch.bfloat16)
            norm.weight = b.norm.weight
            b.norm = norm
            for name in ("gate", "up", "down"):
                setattr(b.mlp, name, Fp8Linear.from_linear(getattr(b.mlp, name), recipe))
            b.mlp.forward = lambda x, m=b.mlp: m.down(swiglu(m.gate(x), m.up(x)))
    return blocks


def torchao_float8(m: nn.Module, recipe: str) -> nn.Module:
    """torchao's float8 training on m's linears (its recipe by name), then torch.compile."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    return torch.compile(m)


def variants(hidden, ffn, device, peers: bool, compile: bool) -> dict:
    out = {"bf16 eager": lambda: model(hidden, ffn, device, False)}
    if compile:
        out["bf16 compiled"] = lambda: torch.compile(model(hidden, ffn, device, False))
    out["fusedlayers bf16"] = lambda: model(hidden, ffn, device, True)
    for name, recipe in RECIPES.items():
        out[f"fusedlayers fp8 {name}"] = lambda r=recipe: model(hidden, ffn, device, True, r)
        out[f"fusedlayers fp8 {name} layers"] = \
            lambda r=recipe: model(hidden, ffn, device, True, r, layers=True)
    if peers and compile:
        for recipe in ("tensorwise", "rowwise"):
            out[f"torchao {recipe} compiled"] = \
                lambda r=recipe: torchao_float8(model(hidden, ffn, device, False), r)
    return out


def run(device: str = "cuda", rounds: int = 5, peers: bool = True, compile: bool = True,
        log=print) -> list[MlpRow]:
    dev = torch.device(device)
    hidden, ffn, tokens = (4096, 14336, 8192) if dev.type == "cuda" else (256, 512, 256)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    steps, peaks, not_built = {}, {}, {}
    for name, make in variants(hidden, ffn, dev, peers and dev.type == "cuda", compile).items():
        try:
            m = make()
        except Exception as e:  # noqa: BLE001 (a peer that does not install or convert)
            not_built[name] = did_not_run(e)
            continue

        def step(m=m):
            x.grad = None
            for p in m.parameters():
                p.grad = None
            m(x).backward(dy)
        steps[name] = step
    fallible = {n for n in steps if n.startswith("torchao") or "compiled" in n}
    times = time_rounds(steps, dev, rounds, reps=None, uncaptured=set(steps), fallible=fallible)
    times |= not_built
    if dev.type == "cuda":
        for name, step in steps.items():
            if isinstance(times[name], list):
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    rows = []
    for name, t in times.items():
        if isinstance(t, str):
            row = MlpRow(name, None, None, None, not_run=t)
        else:
            row = MlpRow(name, statistics.median(t), peaks.get(name), t,
                         speedup(times["bf16 eager"], t) if name != "bf16 eager" else None)
        rows.append(row)
        log(format_row(row))
    return rows


def format_row(r: MlpRow) -> str:
    if r.ms is None:
        return f"{r.variant:<44} did not run: {r.not_run}"
    mib = f"{r.peak_mib:>8.0f}" if r.peak_mib is not None else f"{'-':>8}"
    return f"{r.variant:<44} {r.ms:>9.3f} {mib}  {format_speedup(r.vs_eager):<20}"


def rows_json(rows: list[MlpRow]) -> list[dict]:
    return [asdict(r) for r in rows]
