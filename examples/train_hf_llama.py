"""Train a small Hugging Face Llama language model on real text twice, as built and after one
call of `fusedlayers.torch.fuse`, and check that both runs learn the same thing.

    python examples/train_hf_llama.py                   # CPU, well under a minute
    python examples/train_hf_llama.py --device cuda     # on a CUDA machine
    python examples/train_hf_llama.py --help            # steps, batch size, seed, plot
    torchrun --nproc-per-node 2 examples/train_hf_llama.py --distributed ddp   # or fsdp

The text is the Python standard library's own source files (every machine with Python has them;
nobody here wrote them), read as bytes: a byte-level vocabulary of 256, the first 90% of the
bytes for training, the rest held out. The model is transformers' LlamaForCausalLM built from a
config (no download): width 128, 2 layers, 4 query and 2 key/value heads, a 352-wide SwiGLU MLP,
rotary embeddings, sequences of 128 bytes. `fuse(model)` swaps its RMSNorms, its gated MLPs and,
per attention instance, its RoPE, and in training with labels runs its LM head and loss as one
linear_cross_entropy that never makes the logits; it prints what it swapped. The unfused model
is a deep copy taken before, so both start from the same weights; they take the same batches,
one step each in turn (background load affects both alike), with AdamW. The loss skips the first
0-15 bytes of each sequence (a different number per sequence, as a prompt's tokens are masked in
fine-tuning) and is the mean over the batch's counted tokens, passed as `num_items_in_batch`.

Distributed (--distributed ddp|fsdp, under torchrun: gloo on the CPU, NCCL on GPUs): both models
under DistributedDataParallel or FSDP2 (`fully_shard` per decoder layer, then the model), each
process taking its share of every global batch; `num_items_in_batch` is the count summed over
the processes (all_reduce), and the loss is scaled by the number of processes, whose gradients
the engines average: the same training as one process on the whole batch.

With --fp8 blockwise|blockwise-wgrad-tiles|tensorwise|hybrid the fused run also makes every
linear layer but the LM head an FP8 one (`fuse(model, fp8=fusedlayers.Fp8Recipe(...))`: its GEMMs
on FP8 operands, quantized by 1x128 / 128x128 blocks (blockwise-wgrad-tiles: the weight
gradients' x^T by 128x128 tiles) or per tensor; hybrid: per tensor with E5M2 gradients); its
curve is held to the tolerances of the bf16 run
(--master-weights), and the mean loss of the last fifth of the steps is printed beside the
unfused run's.

With --master-weights the fused run trains as Hugging Face Trainer's bf16=True recipe would
after `fusedlayers.torch.AdamW.with_master_weights`: bfloat16 parameters (so bf16 GEMMs), float32
master weights and moments in fusedlayers' AdamW; the unfused run stays in float32. The curves
are then held to LOSS_RTOL and the first logged losses to MASTER_FIRST_RTOL (bf16's rounding of
every weight and activation, where float32 runs differ by rounding alone).

Printed: the train loss every --log-every steps for both runs, the held-out loss (bits per byte)
at the end, ms per step (median), peak memory per step on CUDA, and a PNG of the loss curves
(--plot). The exit status is 1 if fuse() left any of those layers, if the first logged losses
differ by more than FIRST_RTOL relative (the same function: float32 rounding apart), the curves
by more than LOSS_RTOL (rounding grows through training, as in train_hf_vit.py), or if either
held-out loss stays above --max-held-out (default MAX_HELD_OUT; the untrained model's is ln 256
= 5.55 nats per byte).
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers

import fusedlayers
from fusedlayers.torch import fuse
from loss_plot import save_loss_plot

FIRST_RTOL = 1e-4
MASTER_FIRST_RTOL = 1e-2
LOSS_RTOL = 5e-2
MAX_HELD_OUT = 2.5  # nats per byte
SEQ = 128
# --fp8's recipes: hybrid is tensorwise with E5M2 gradients; blockwise-wgrad-tiles quantizes the
# weight gradients' x^T by 128x128 tiles
FP8_RECIPES = {"blockwise": fusedlayers.Fp8Recipe(),
               "blockwise-wgrad-tiles": fusedlayers.Fp8Recipe(wgrad_x_scaling="128x128"),
               "tensorwise": fusedlayers.Fp8Recipe("tensorwise"),
               "hybrid": fusedlayers.Fp8Recipe("tensorwise", "hybrid")}


def corpus(max_bytes: int) -> bytes:
    """The standard library's .py files, in sorted order, up to max_bytes."""
    root = os.path.dirname(os.__file__)
    out, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            out.append(data)
            total += len(data)
    return b"".join(out)[:max_bytes]


def model(device: torch.device) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=352, max_position_embeddings=SEQ,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).to(device)


def labels_of(batch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The batch as its own labels, the first rows % 16 bytes of each sequence not counted."""
    skipped = torch.arange(SEQ, device=batch.device) < (rows % 16).to(batch.device)[:, None]
    return batch.masked_fill(skipped, -100)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def distribute(lm, engine: str | None, device: torch.device):
    """The model under DistributedDataParallel or FSDP2, or as it is."""
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            lm, device_ids=[device.index] if device.type == "cuda" else None)
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in lm.model.layers:
            fully_shard(layer)
        return fully_shard(lm)
    return lm


class Run:
    def __init__(self, name: str, lm, lr: float, opt=None):
        self.name, self.lm = name, lm
        self.opt = opt or torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.01)
        self.losses, self.step_ms, self.peak_mb = [], [], []

    def step(self, batch: torch.Tensor, labels: torch.Tensor) -> None:
        """One step on this process's share of a global batch."""
        cuda = batch.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.lm.train()
        items = (labels[:, 1:] != -100).sum()  # the tokens HF's shifted loss counts
        if dist.is_initialized():
            dist.all_reduce(items)
        loss = self.lm(input_ids=batch, labels=labels, num_items_in_batch=items).loss
        (loss * world_size()).backward()  # the engines average the processes' gradients
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss)  # the global batch's mean
        value = loss.item()  # waits for the device
        self.step_ms.append(1e3 * (time.perf_counter() - start))
        if cuda:
            self.peak_mb.append(torch.cuda.max_memory_allocated() / 2**20)
        self.losses.append(value)

    @torch.no_grad()
    def held_out(self, data: torch.Tensor, batch_size: int) -> float:
        self.lm.eval()
        losses = [self.lm(input_ids=b, labels=b).loss.item() for b in data.split(batch_size)]
        return sum(losses) / len(losses)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--max-held-out", type=float, default=MAX_HELD_OUT,
                        help="the held-out loss both runs must reach, nats per byte (default "
                             f"{MAX_HELD_OUT}; inf for short runs that only compare the curves)")
    parser.add_argument("--plot", default="train_hf_llama_loss.png", help="loss-curve PNG path")
    parser.add_argument("--json", metavar="PATH", help="also write the logged losses as JSON")
    parser.add_argument("--distributed", choices=("ddp", "fsdp"),
                        help="under torchrun: DistributedDataParallel or FSDP2 (fully_shard)")
    parser.add_argument("--fp8", choices=tuple(FP8_RECIPES),
                        help="the fused run's linear layers in FP8 with this recipe (hybrid: "
                             "tensorwise, E5M2 gradients)")
    parser.add_argument("--master-weights", action="store_true",
                        help="the fused run in bf16 parameters with float32 masters "
                             "(fusedlayers.torch.AdamW.with_master_weights)")
    args = parser.parse_args()
    if args.master_weights and args.distributed:
        parser.error("--master-weights: one process (the engines wrap the parameters it casts)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device")
    if args.distributed:
        if "LOCAL_RANK" not in os.environ:
            parser.error("--distributed: launch with torchrun, e.g. `torchrun --nproc-per-node 2 "
                         "examples/train_hf_llama.py --distributed ddp`")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if args.batch_size % world_size():
            parser.error(f"--batch-size {args.batch_size} must split evenly over "
                         f"{world_size()} processes")
    first = not dist.is_initialized() or dist.get_rank() == 0
    if not first:  # one process prints
        sys.stdout = open(os.devnull, "w")
    transformers.logging.set_verbosity_error()

    text = corpus(args.steps * args.batch_size * SEQ * 10 // 9 + 64 * SEQ)
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    sequences = ids[:len(ids) // SEQ * SEQ].view(-1, SEQ)
    split = len(sequences) * 9 // 10
    train, held = sequences[:split].to(device), sequences[split:].to(device)
    print(fusedlayers.loaded("torch"))
    print(f"standard library source: {len(text) / 1e6:.2f} MB, {len(train)} train / {len(held)} "
          f"held-out sequences of {SEQ} bytes, device {device}, seed {args.seed}"
          + (f", {args.distributed} over {world_size()} processes" if args.distributed else ""))

    torch.manual_seed(args.seed)
    unfused_lm = model(device)
    recipe = FP8_RECIPES[args.fp8] if args.fp8 else None
    fused_lm = fuse(copy.deepcopy(unfused_lm), fp8=recipe)
    print(fused_lm.fusedlayers_report, end="\n\n")
    swapped = " ".join(what for _, _, what in fused_lm.fusedlayers_report.swapped)
    failures = [f"fuse() did not swap {op}" for op in ("RMSNorm", "SwiGLUMLP", "rope",
                                                       "linear_cross_entropy")
                + (("Fp8Linear",) if recipe else ()) if op not in swapped]
    fused_opt = fusedlayers.torch.AdamW.with_master_weights(
        fused_lm, lr=args.lr, weight_decay=0.01) if args.master_weights else None
    runs = [Run("unfused", distribute(unfused_lm, args.distributed, device), args.lr),
            Run("fused", distribute(fused_lm, args.distributed, device), args.lr, fused_opt)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    print(f"{'step':>5} {'unfused loss':>13} {'fused loss':>13} {'|diff|':>10}")
    logged = ([], [])
    for step in range(args.steps):
        rows = order[(step * args.batch_size + torch.arange(args.batch_size)) % len(train)]
        rows = rows.tensor_split(world_size())[rank]  # this process's share
        batch = train[rows]
        for run in runs:
            run.step(batch, labels_of(batch, rows))
        if (step + 1) % args.log_every == 0:
            u, f = (statistics.mean(run.losses[-args.log_every:]) for run in runs)
            logged[0].append(u)
            logged[1].append(f)
            print(f"{step + 1:>5} {u:>13.6f} {f:>13.6f} {abs(u - f):>10.2e}")

    held_out = [run.held_out(held, args.batch_size) for run in runs]
    ms = [statistics.median(run.step_ms[len(run.step_ms) // 5:]) for run in runs]
    rels = [abs(u - f) / u for u, f in zip(*logged)]
    print(f"\n{'':<26}{'unfused':>10}{'fused':>10}")
    print(f"{'held-out loss (nats/byte)':<26}{held_out[0]:>10.4f}{held_out[1]:>10.4f}")
    print(f"{'held-out bits per byte':<26}{held_out[0] / math.log(2):>10.4f}"
          f"{held_out[1] / math.log(2):>10.4f}")
    print(f"{'ms / step (median)':<26}{ms[0]:>10.2f}{ms[1]:>10.2f}")
    print(f"{'speedup (fused)':<26}{ms[0] / ms[1]:>19.2f}x")
    if device.type == "cuda":
        peak = [max(run.peak_mb) for run in runs]
        print(f"{'peak MB per step':<26}{peak[0]:>10.1f}{peak[1]:>10.1f}")
    first_rtol = MASTER_FIRST_RTOL if args.master_weights or recipe else FIRST_RTOL
    print(f"{'first logged rel. diff':<26}{rels[0]:>19.2e}   (tolerance {first_rtol:.0e})")
    print(f"{'max relative loss diff':<26}{max(rels):>19.2e}   (tolerance {LOSS_RTOL:.0e})")
    tail = max(1, args.steps // 5)
    tails = [statistics.mean(run.losses[-tail:]) for run in runs]
    tail_rel = abs(tails[1] - tails[0]) / tails[0]
    print(f"{f'last {tail} steps mean':<26}{tails[0]:>10.4f}{tails[1]:>10.4f}   rel. diff "
          f"{tail_rel:.2e}")
    if first:
        fused_name = "fused, bf16 + float32 masters" if args.master_weights else \
            f"fused, FP8 {args.fp8}" if recipe else "fused (fusedlayers.fuse)"
        save_loss_plot(args.plot, *logged, ("unfused (transformers)", fused_name),
                       f"LlamaForCausalLM on stdlib bytes ({device.type}): as built vs fuse()",
                       "train loss (nats per byte)", LOSS_RTOL,
                       xlabel=f"steps (x {args.log_every})")
        print(f"loss curves saved to {args.plot}")
    if args.json and first:
        with open(args.json, "w") as f:
            json.dump({"processes": world_size(), "unfused": {"loss": logged[0]},
                       "fused": {"loss": logged[1]}}, f)

    if rels[0] > first_rtol:
        failures.append(f"first logged losses differ by {rels[0]:.2e} relative > {first_rtol}")
    if max(rels) > LOSS_RTOL:
        failures.append(f"loss curves differ by {max(rels):.2e} relative > {LOSS_RTOL}")
    failures += [f"{run.name} held-out loss {h:.3f} > {args.max_held_out}"
                 for run, h in zip(runs, held_out) if h > args.max_held_out]
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print("OK: both runs learn the text and their loss curves agree")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
