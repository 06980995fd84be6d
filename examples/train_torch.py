"""Train a small MLP-Mixer on scikit-learn's handwritten digits twice, once with stock PyTorch
layers and once with fusedlayers, and check that both runs learn the same thing.

    python examples/train_torch.py                   # CPU, 20 epochs per run
    python examples/train_torch.py --device cuda     # on a CUDA machine
    python examples/train_torch.py --help            # epochs, batch size, seed, threads, plot
    torchrun --nproc-per-node 2 examples/train_torch.py --distributed ddp    # or fsdp

The model (8x8 images -> 16 tokens of 2x2 patches -> 3 Mixer blocks -> mean pool -> head) uses
the three fused ops where their unfused counterparts would be: LayerNorm, Linear+GELU as the
first layer of every MLP, and ReLU·scale in the head. Both variants have the same state_dict
keys; the fused model is loaded with the unfused model's initial weights, and both runs see the
batches in the same order. The runs advance in lockstep, one epoch each in turn, so background
load on the machine affects both alike. The script prints per-epoch train loss and held-out
accuracy side by side, time per optimizer step and a summary, and saves the two loss curves
and their relative difference as a PNG (--plot, default train_torch_loss.png).

Expected agreement: the fused kernels compute the same math as the unfused ops but sum in a
different order (GEMM epilogue, LayerNorm reductions, weight-gradient reductions), so the two
float32 runs differ by rounding (~1e-7 relative) from the first step. Training feeds those
differences back through every update, so they can grow; with the defaults they hardly do: the
per-epoch losses agree to ~1e-7 relative, at most 2e-6 (seeds 0-5, CPU). The script exits with
status 1 if either run ends below 90% held-out accuracy, if the first epoch's losses differ by
more than FIRST_EPOCH_RTOL (1e-5) or any epoch's by more than LOSS_RTOL (1e-3) relative, so it
doubles as an end-to-end check that the fused layers'
forward, backward and parameters train like the unfused ones (the per-op accuracy is the tests'
job). Training is chaotic, though: longer runs (e.g. --epochs 40) or a higher learning rate can
let one run's loss bump an epoch before the other's, and the curves then drift to ~1e-2
relative without anything being wrong; the tolerance is set for the defaults.

Distributed (--distributed ddp|fsdp, under torchrun): both models are wrapped in PyTorch's own
engines, DistributedDataParallel or FSDP2 (`torch.distributed.fsdp.fully_shard`, per Mixer
block and the whole model), over gloo on the CPU or NCCL on GPUs. Every global batch is split
across the ranks and each rank's loss is its share of the global batch's mean, so the gradients
the engine averages are those of a single process on the same global batch: the losses equal a
single-process run's up to summation order (--json writes them for comparing).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from einops.layers.torch import Rearrange
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import fusedlayers
from fusedlayers.torch import FusedLinearGELU, FusedReLUScale, LayerNorm, UnfusedReLUScale
from loss_plot import save_loss_plot

MIN_ACCURACY = 0.90
LOSS_RTOL = 1e-3  # max |loss_unfused - loss_fused| / loss_unfused over epochs, float32
# The first epoch's losses, before training has amplified anything: the same function to within
# float32 rounding.
FIRST_EPOCH_RTOL = 1e-5
# Regularizes, and keeps the loss away from 0 (its floor is ~0.50), so that the relative loss
# difference stays meaningful once the training set is fit.
LABEL_SMOOTHING = 0.1


class MLP(nn.Module):
    """Linear -> GELU -> Linear. fc1 is nn.Linear + nn.GELU or one FusedLinearGELU; `act` has no
    parameters, so the state_dict keys (fc1.*, fc2.*) are the same either way."""

    def __init__(self, dim: int, hidden: int, fused: bool):
        super().__init__()
        if fused:
            self.fc1, self.act = FusedLinearGELU(dim, hidden), nn.Identity()
        else:
            self.fc1, self.act = nn.Linear(dim, hidden), nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, fused: bool):
        super().__init__()
        norm = LayerNorm if fused else nn.LayerNorm
        self.norm1, self.token_mlp = norm(dim), MLP(tokens, tokens * 2, fused)
        self.norm2, self.channel_mlp = norm(dim), MLP(dim, dim * 2, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        # Token mixing acts along the token axis, so it sees (batch, dim, tokens).
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, fused: bool, dim: int = 64, depth: int = 3, patch: int = 2,
                 image: int = 8, classes: int = 10, alpha: float = 0.5):
        super().__init__()
        tokens = (image // patch) ** 2
        self.patchify = Rearrange("b (h p1) (w p2) -> b (h w) (p1 p2)", p1=patch, p2=patch)
        self.embed = nn.Linear(patch * patch, dim)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, dim, fused) for _ in range(depth)])
        self.norm = LayerNorm(dim) if fused else nn.LayerNorm(dim)
        # Rectified, down-scaled pooled features for the classifier; alpha is a fixed scale.
        self.relu_scale = FusedReLUScale(alpha) if fused else UnfusedReLUScale(alpha)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # images: (batch, 8, 8)
        x = self.blocks(self.embed(self.patchify(images)))
        return self.head(self.relu_scale(self.norm(x).mean(dim=1)))


def load_data(device: torch.device):
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)  # pixels 0..16 -> 0..1
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y,
                                                        random_state=0)
    return [t.to(device) for t in (x_train, y_train, x_test, y_test)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA kernels are asynchronous: wait before timing


class Run:
    """One training run: model, AdamW, cosine LR schedule, its own shuffling generator (seeded
    alike for both runs, so both see the same batches) and its history."""

    def __init__(self, name: str, model: nn.Module, args, n_train: int):
        self.name, self.model, self.batch_size = name, model, args.batch_size
        # eps 1e-6 rather than 1e-8: Adam divides by sqrt(v) + eps, which for near-zero
        # gradients would turn their rounding noise into full-size steps and so amplify the
        # runs' fp32 differences. Cosine decay to zero: no loss spikes late in training.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6,
                                           weight_decay=0.05)
        steps = args.epochs * math.ceil(n_train / args.batch_size)
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=steps)
        self.order = torch.Generator().manual_seed(args.seed)
        self.losses, self.accuracies, self.step_times, self.epoch_times = [], [], [], []

    def epoch(self, x_train, y_train, x_test, y_test) -> None:
        device = x_train.device
        epoch_start = time.perf_counter()
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in torch.randperm(len(x_train), generator=self.order).split(self.batch_size):
            # This rank's share of the global batch; the engine averages the gradients over
            # the ranks, hence the factor world_size.
            idx = batch.tensor_split(world_size())[rank()].to(device)
            sync(device)
            start = time.perf_counter()
            loss_sum = nn.functional.cross_entropy(self.model(x_train[idx]), y_train[idx],
                                                   label_smoothing=LABEL_SMOOTHING,
                                                   reduction="sum")
            self.optimizer.zero_grad(set_to_none=True)
            (loss_sum * (world_size() / len(batch))).backward()
            self.optimizer.step()
            self.schedule.step()
            sync(device)
            self.step_times.append(time.perf_counter() - start)
            total += loss_sum.detach()
        if dist.is_initialized():
            dist.all_reduce(total)
        self.losses.append(total.item() / len(x_train))
        self.model.eval()
        with torch.no_grad():
            correct = (self.model(x_test).argmax(dim=1) == y_test).float().mean().item()
        self.accuracies.append(correct)
        self.epoch_times.append(time.perf_counter() - epoch_start)


def setup(description: str, plot: str, epochs: int = 20):
    """Parses the command line shared by the torch examples; returns (args, device, data)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY,
                        help=f"the held-out accuracy both runs must reach (default {MIN_ACCURACY};"
                             f" 0 for short runs that only compare the curves)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--plot", default=plot, help="loss-curve PNG path")
    parser.add_argument("--json", metavar="PATH", help="also write the per-epoch losses and "
                                                       "accuracies as JSON")
    parser.add_argument("--distributed", choices=("ddp", "fsdp"),
                        help="under torchrun: DistributedDataParallel or FSDP2 (fully_shard)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA "
                     f"device; run on a CUDA machine or use --device cpu")
    if args.distributed:
        if "LOCAL_RANK" not in os.environ:
            parser.error("--distributed: launch with torchrun, e.g. "
                         "`torchrun --nproc-per-node 2 examples/train_torch.py --distributed ddp`")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_data(device)
    say(fusedlayers.loaded("torch"))
    say(f"digits: {len(data[0])} train / {len(data[2])} held-out images, device {device}, "
        f"{torch.get_num_threads()} CPU threads, seed {args.seed}"
        + (f", {args.distributed} over {world_size()} processes" if args.distributed else ""))
    return args, device, data


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def say(*args, **kwargs) -> None:
    """print, on the first rank only."""
    if rank() == 0:
        print(*args, **kwargs)


def distribute(model: nn.Module, engine: str | None, device: torch.device) -> nn.Module:
    """The model under PyTorch's DistributedDataParallel or FSDP2 (each child of a `blocks`
    container sharded on its own, then the whole model), or as it is."""
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in getattr(model, "blocks", []):
            fully_shard(block)
        return fully_shard(model)
    return model


def main() -> int:
    args, device, data = setup(__doc__.split("\n\n")[0], "train_torch_loss.png")
    torch.manual_seed(args.seed)
    unfused_model = Mixer(fused=False).to(device)
    fused_model = Mixer(fused=True).to(device)
    fused_model.load_state_dict(unfused_model.state_dict())  # strict: the keys must match
    same = all(torch.equal(a, b) for a, b in zip(unfused_model.state_dict().values(),
                                                  fused_model.state_dict().values()))
    n_params = sum(p.numel() for p in unfused_model.parameters())
    say(f"{n_params} parameters; fused model starts from the unfused weights: "
        f"{'identical' if same else 'DIFFERENT'}\n")

    return compare(unfused_model, fused_model, args, data,
                   f"MLP-Mixer on sklearn digits ({device.type}): unfused vs fused",
                   failures=[] if same else ["fused model did not start from the unfused weights"])


def compare(unfused_model: nn.Module, fused_model: nn.Module, args, data, title: str,
            failures: list[str], loss_rtol: float = LOSS_RTOL) -> int:
    """Trains both models in lockstep on `data`, prints the per-epoch table and the summary,
    saves the loss-curve plot, and returns the exit status: 1 on any failure (those given, a
    run below --min-accuracy, first-epoch losses further apart than FIRST_EPOCH_RTOL, loss curves
    further apart than loss_rtol)."""
    say(f"{'epoch':>5} {'unfused loss':>13} {'fused loss':>13} {'|diff|':>10} "
        f"{'unfused acc':>12} {'fused acc':>10} {'unfused s':>10} {'fused s':>8}")
    device = data[0].device
    unfused = Run("unfused", distribute(unfused_model, args.distributed, device), args,
                  len(data[0]))
    fused = Run("fused", distribute(fused_model, args.distributed, device), args, len(data[0]))
    # One bar for both runs, on a terminal only: in a log the table's line per epoch says it.
    bar = tqdm(total=args.epochs, unit="epoch", leave=False,
               disable=rank() != 0 or not sys.stderr.isatty())
    for epoch in range(1, args.epochs + 1):
        unfused.epoch(*data)
        fused.epoch(*data)
        ul, fl = unfused.losses[-1], fused.losses[-1]
        if rank() == 0:
            bar.write(f"{epoch:>5} {ul:>13.6f} {fl:>13.6f} {abs(ul - fl):>10.2e} "
                      f"{unfused.accuracies[-1]:>12.4f} {fused.accuracies[-1]:>10.4f} "
                      f"{unfused.epoch_times[-1]:>10.2f} {fused.epoch_times[-1]:>8.2f}")
        bar.update()
    bar.close()

    # Median step time: robust to the first steps' warm-up and to bursts of background load.
    u_ms, f_ms = (1e3 * statistics.median(run.step_times) for run in (unfused, fused))
    diffs = [abs(ul - fl) for ul, fl in zip(unfused.losses, fused.losses)]
    rels = [d / ul for d, ul in zip(diffs, unfused.losses)]
    max_rel = max(rels)
    say(f"\n{'':<24}{'unfused':>10}{'fused':>10}")
    say(f"{'held-out accuracy':<24}{unfused.accuracies[-1]:>10.4f}{fused.accuracies[-1]:>10.4f}")
    say(f"{'final train loss':<24}{unfused.losses[-1]:>10.5f}{fused.losses[-1]:>10.5f}")
    say(f"{'ms / step (median)':<24}{u_ms:>10.3f}{f_ms:>10.3f}")
    say(f"{'speedup (fused)':<24}{u_ms / f_ms:>19.2f}x")
    say(f"{'max |loss diff|':<24}{max(diffs):>20.2e}")
    say(f"{'first-epoch rel. diff':<24}{rels[0]:>20.2e}   (tolerance {FIRST_EPOCH_RTOL:.0e})")
    say(f"{'max relative loss diff':<24}{max_rel:>20.2e}   (tolerance {loss_rtol:.0e})")

    if rank() == 0:
        save_loss_plot(args.plot, unfused.losses, fused.losses,
                       ("unfused (torch.nn)", "fused (fusedlayers)"), title,
                       f"train loss (label smoothing {LABEL_SMOOTHING})", loss_rtol)
        print(f"loss curves saved to {args.plot}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"processes": world_size(),
                           **{run.name: {"loss": run.losses, "accuracy": run.accuracies}
                              for run in (unfused, fused)}}, f, indent=1)

    failures = failures + [f"{run.name} held-out accuracy {run.accuracies[-1]:.4f} < "
                           f"{args.min_accuracy}" for run in (unfused, fused)
                           if run.accuracies[-1] < args.min_accuracy]
    if rels[0] > FIRST_EPOCH_RTOL:
        failures.append(f"first-epoch losses differ by {rels[0]:.2e} relative > "
                        f"{FIRST_EPOCH_RTOL:.0e}")
    if max_rel > loss_rtol:
        failures.append(f"loss curves differ by {max_rel:.2e} relative > {loss_rtol:.0e}")
    for failure in failures:
        say(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        say("OK: both runs reach the accuracy bar and their loss curves agree")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
