"""`python -m fusedlayers bench --memory`: activation memory of one training step, unfused against
fused, for a stack of 12 MLP blocks and for the model bench's models (fusedlayers.bench.models).

Per model and variant, two measures of one step (forward, loss = mean square of the output or,
for the causal LMs (llama-lm, llama-lm-128k), the model's own loss, backward):
- saved: the bytes autograd keeps from the forward for the backward, counted by a
  torch.autograd.graph.saved_tensors_hooks pack hook (each storage once, parameters excluded;
  inputs included). The same on every device.
- peak: on CUDA, torch.cuda.max_memory_allocated during the step above what was allocated before
  it (parameters, inputs). torch's CPU allocator keeps no counters, so there is no CPU peak.

Variants: "unfused" (torch.nn layers), "fused" (fusedlayers.torch layers) and "fused, memory-
efficient LN" (LayerNorm(memory_efficient=True): saves its output, which the following linear
layer saves anyway, instead of its input).

The MLP stack: blocks x + fc2(act(fc1(LayerNorm(x)))), width d, hidden 4d, alternating GELU
(fused: FusedLinearGELU) and relu(x) * 0.5 (fused: FusedReLUScale, which saves a 1-bit mask
where the unfused pair saves relu's output). On CUDA in bfloat16 (d = 1024, 8 x 512 tokens), on
the CPU in float32 (d = 256, 512 tokens); the models as in the model bench (tiny on the CPU).
"""

import copy
import json
from dataclasses import asdict, dataclass

import torch
from torch import nn

VARIANTS = ("unfused", "fused", "fused, memory-efficient LN")
BLOCKS = 12


@dataclass
class MemoryRow:
    model: str
    variant: str
    saved_mb: float
    peak_mb: float | None  # CUDA only


class _Block(nn.Module):
    def __init__(self, width: int, relu: bool, fused: bool, memory_efficient: bool, **factory):
        super().__init__()
        from ..torch import FusedLinearGELU, FusedReLUScale, LayerNorm, UnfusedReLUScale
        hidden = 4 * width
        self.norm = (LayerNorm(width, memory_efficient=memory_efficient, **factory) if fused
                     else nn.LayerNorm(width, **factory))
        if relu:
            self.fc1 = nn.Linear(width, hidden, **factory)
            self.act = FusedReLUScale(0.5) if fused else UnfusedReLUScale(0.5)
        elif fused:
            self.fc1, self.act = FusedLinearGELU(width, hidden, **factory), nn.Identity()
        else:
            self.fc1, self.act = nn.Linear(width, hidden, **factory), nn.GELU()
        self.fc2 = nn.Linear(hidden, width, **factory)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def mlp_stack(width: int, variant: str, device=None, dtype=None,
              blocks: int = BLOCKS) -> nn.Module:
    """MLP blocks (see the module docstring) of the given variant, GELU first."""
    fused, memory_efficient = variant != "unfused", variant == VARIANTS[2]
    return nn.Sequential(*(_Block(width, i % 2 == 1, fused, memory_efficient, device=device,
                                  dtype=dtype) for i in range(blocks)))


def measure(model: nn.Module, inputs: dict, device: torch.device) -> tuple[float, float | None]:
    """(saved MB, peak MB or None) of one forward + backward of model(**inputs)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
        if "labels" in inputs:  # a causal LM: its own loss (fused: no logits)
            loss = out.loss
        else:
            out = getattr(out, "last_hidden_state", out)
            loss = out.float().square().mean()
    loss.backward()
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    model.zero_grad(set_to_none=True)
    return sum(saved.values()) / 2**20, peak


def _fused(model: nn.Module, memory_efficient: bool) -> nn.Module:
    from ..torch import LayerNorm, fuse
    fused = fuse(copy.deepcopy(model))
    for m in fused.modules():
        if isinstance(m, LayerNorm):
            m.memory_efficient = memory_efficient
    return fused


def run(device: str = "cuda", models=("mlp", "bert-base", "vit-base", "gpt2"),
        log=print) -> list[MemoryRow]:
    """Rows for each model and variant; log(line) is called with each formatted row."""
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    rows = []
    for name in models:
        if name == "mlp":
            width, tokens = (1024, (8, 512)) if on_cuda else (256, (1, 512))
            torch.manual_seed(0)
            inputs = {"input": torch.randn(*tokens, width, device=dev, dtype=dtype,
                                           requires_grad=True)}
            variants = {v: mlp_stack(width, v, dev, dtype) for v in VARIANTS}
            label = f"mlp x{BLOCKS} (d={width}, {tokens[0]}x{tokens[1]} tokens)"
        else:
            from . import models
            base, make_inputs = models.build(name, tiny=not on_cuda)
            base = base.to(dev, dtype).train()
            batch = 8
            inputs = make_inputs(batch, dev, dtype)
            variants = {VARIANTS[0]: base, VARIANTS[1]: _fused(base, False),
                        VARIANTS[2]: _fused(base, True)}
            label = f"{name}{'' if on_cuda else ' (tiny)'} b{batch}"
        for variant, model in variants.items():
            row = MemoryRow(label, variant, *measure(model, inputs, dev))
            rows.append(row)
            log(format_row(row, rows))
        del variants
        if on_cuda:
            torch.cuda.empty_cache()
    return rows


HEADER = (f"{'model':<44} {'variant':<27} {'saved MB':>9} {'vs unfused':>10} {'peak MB':>9} "
          f"{'vs unfused':>10}")


def format_row(row: MemoryRow, rows: list[MemoryRow]) -> str:
    """One line; the ratios are against the unfused row of the same model in `rows`."""
    base = next(r for r in rows if r.model == row.model and r.variant == VARIANTS[0])
    peak = "-" if row.peak_mb is None else f"{row.peak_mb:.1f}"
    peak_ratio = "-" if row.peak_mb is None else f"{row.peak_mb / base.peak_mb:.3f}x"
    return (f"{row.model:<44} {row.variant:<27} {row.saved_mb:>9.1f} "
            f"{row.saved_mb / base.saved_mb:>9.3f}x {peak:>9} {peak_ratio:>10}")


def write_json(path: str, rows: list[MemoryRow], device_name: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device_name, "rows": [asdict(r) for r in rows]}, f, indent=1)
