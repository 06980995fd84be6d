"""`python -m fusedlayers bench --optimizer`: one AdamW step over a model's parameters, in GB/s
of the bytes the step must move (each tensor read and written once: the parameter, its
gradient read, the moments, the master) against the device's copy bandwidth, for
fusedlayers.torch.AdamW beside torch.optim.AdamW's fused and foreach steps (and Transformer
Engine's FusedAdam where it imports), timed in interleaved rounds on the same tensors.

Tensors: the parameters of 4 layers of a Qwen3-30B-A3B-shaped MoE (hidden 2048, 32/4 heads of
128, 128 experts of width 768 as transformers' fused (E, 2F, H) / (E, H, F) weights, vocabulary
151936 embedding and head: ~3.1B parameters) on CUDA; the same layer list scaled to ~8M on the
CPU. Configurations: bf16 (bf16 parameters and moments, torch's default for bf16), fp32, bf16
with float32 master weights and moments (the baseline: torch's fused AdamW on float32 masters,
then the masters copied to the bf16 parameters), and fp32 parameters with bf16 moments.
"""

import statistics
from dataclasses import asdict, dataclass

import torch

from .ops import copy_bandwidth_gbs, time_rounds
from .table import speedup

HEADER = (f"{'config':<22} {'impl':<22} {'ms':>9} {'GB/s':>8} {'% copy':>7}  "
          f"{'vs torch fused':<20}")
CONFIGS = ("bf16", "fp32", "bf16+master", "fp32+bf16-moments")


@dataclass
class OptimizerRow:
    config: str
    impl: str
    params: int
    ms: float
    gbs: float
    pct_of_copy: float
    rounds_ms: list
    vs_torch_fused: dict | None = None


def shapes(device_type: str) -> list[tuple]:
    """The parameter shapes: 4 MoE layers, an embedding and a head (CUDA); scaled down (CPU)."""
    if device_type == "cuda":
        h, heads, kv, d, e, f, v, layers = 2048, 32, 4, 128, 128, 768, 151936, 4
    else:
        h, heads, kv, d, e, f, v, layers = 256, 4, 2, 64, 16, 128, 8192, 2
    layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (d,), (d,), (h,), (h,),
             (e, h), (e, 2 * f, h), (e, h, f)]
    return [(v, h), *layer * layers, (h,), (v, h)]


def _bytes_per_element(config: str) -> int:
    """Bytes each parameter element moves in one step: read and write of the parameter (or its
    master, plus the write of the parameter), the moments; a read of the gradient."""
    return {"bf16": 2 * 2 + 2 + 2 * 2 * 2, "fp32": 4 * 2 + 4 + 4 * 2 * 2,
            "bf16+master": 2 + 2 + 4 * 2 + 4 * 2 * 2, "fp32+bf16-moments": 4 * 2 + 4 + 2 * 2 * 2}[
        config]


def _variants(config: str, params: list, dev: torch.device) -> dict:
    """impl name -> a function that runs one step, on shared tensors."""
    from ..torch import AdamW
    fns = {}
    master = config == "bf16+master"
    ours = AdamW(params, lr=1e-5, master_weights=master,
                 moment_dtype=torch.bfloat16 if config == "fp32+bf16-moments" else None)
    ours.step()  # the state exists before timing
    fns["fusedlayers"] = ours.step
    if config in ("bf16", "fp32"):
        for impl in ("fused", "foreach"):
            opt = torch.optim.AdamW(params, lr=1e-5, **{impl: True})
            for p in params:  # the same state tensors: each step reads and writes what ours does
                opt.state[p] = {k: ours.state[p][k] for k in ("step", "exp_avg", "exp_avg_sq")}
            fns[f"torch {impl}"] = opt.step
    if master:
        masters = [ours.state[p]["master_param"] for p in params]
        grads = [torch.empty_like(m).normal_() for m in masters]
        for m, g in zip(masters, grads):
            m.grad = g
        opt = torch.optim.AdamW(masters, lr=1e-5, fused=True)
        for p, m in zip(params, masters):
            opt.state[m] = {k: ours.state[p][k] for k in ("step", "exp_avg", "exp_avg_sq")}

        @torch.no_grad()
        def torch_masters():
            opt.step()
            torch._foreach_copy_(params, masters)
        fns["torch fused"] = torch_masters
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
        if dev.type == "cuda" and config != "fp32+bf16-moments":
            te = FusedAdam(params, lr=1e-5, adam_w_mode=True, master_weights=master)
            te.step()
            fns["transformer_engine"] = te.step
    except ImportError:
        pass
    return fns


def run(device: str = "cuda", configs=CONFIGS, rounds: int = 5, reps: int = 20,
        log=print) -> list[OptimizerRow]:
    dev = torch.device(device)
    copy_gbs = copy_bandwidth_gbs(dev, rounds, reps)
    log(f"copy: {copy_gbs:.0f} GB/s")
    rows = []
    for config in configs:
        dtype = torch.bfloat16 if config.startswith("bf16") else torch.float32
        gen = torch.Generator(dev).manual_seed(0)
        params = [torch.nn.Parameter(torch.empty(s, device=dev, dtype=dtype)
                                     .normal_(generator=gen)) for s in shapes(dev.type)]
        for p in params:
            p.grad = torch.empty_like(p).normal_(generator=gen)
        n = sum(p.numel() for p in params)
        fns = _variants(config, params, dev)
        times = time_rounds(fns, dev, rounds, reps, uncaptured=frozenset(fns))
        work = n * _bytes_per_element(config)
        base = times.get("torch fused")
        for impl, t in times.items():
            ms = statistics.median(t)
            gbs = work / ms / 1e6
            row = OptimizerRow(config, impl, n, ms, gbs, 100 * gbs / copy_gbs, t,
                               speedup(base, t) if base and impl != "torch fused" else None)
            rows.append(row)
            log(format_row(row))
        del fns, params
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_optax(configs=("bf16", "fp32"), rounds: int = 5, reps: int = 10,
              log=print) -> list[OptimizerRow]:
    """optax.adamw's update and apply_updates, jitted with the parameters and state donated (in
    place), on the same shapes and dtypes (its moments in the parameters' dtype), against a
    jitted elementwise pass over a large array (read and write: the copy's bytes)."""
    import time

    import jax
    import jax.numpy as jnp
    import optax

    def timed(fn, carry):
        """The ms per call of fn over reps chained calls (each takes the last one's outputs:
        donated buffers), and the last outputs."""
        carry = fn(*carry)
        jax.block_until_ready(carry)
        t0 = time.perf_counter()
        for _ in range(reps):
            carry = fn(*carry)
        jax.block_until_ready(carry)
        return (time.perf_counter() - t0) * 1e3 / reps, carry

    dev_type = jax.devices()[0].platform
    copy = jax.jit(lambda x: (x + 1,), donate_argnums=0)
    carry = (jnp.ones((1 << 28) if dev_type == "gpu" else (1 << 25), jnp.float32),)
    copy_ms = []
    for _ in range(rounds):
        ms, carry = timed(copy, carry)
        copy_ms.append(ms)
    copy_gbs = 2 * carry[0].nbytes / min(copy_ms) / 1e6
    log(f"jax copy (x + 1): {copy_gbs:.0f} GB/s")
    del carry
    rows = []
    for config in configs:
        dtype = jnp.bfloat16 if config == "bf16" else jnp.float32
        key = jax.random.key(0)
        params = [jax.random.normal(jax.random.fold_in(key, i), s, dtype)
                  for i, s in enumerate(shapes("cuda" if dev_type == "gpu" else "cpu"))]
        n = sum(p.size for p in params)
        tx = optax.adamw(1e-5)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, grads
        step = jax.jit(step, donate_argnums=(0, 1))
        carry = (params, tx.init(params), [jnp.ones_like(p) for p in params])
        t = []
        for _ in range(rounds):
            ms, carry = timed(step, carry)
            t.append(ms)
        ms = statistics.median(t)
        gbs = n * _bytes_per_element(config) / ms / 1e6
        rows.append(OptimizerRow(config, "optax jit", n, ms, gbs, 100 * gbs / copy_gbs, t))
        log(format_row(rows[-1]))
        del params, carry
    return rows


def format_row(r: OptimizerRow) -> str:
    s = r.vs_torch_fused
    vs = "" if s is None else f"{s['x']:.2f}x {s['lo']:.2f}-{s['hi']:.2f}" + (
        " tie" if s["tie"] else "")
    return (f"{r.config:<22} {r.impl:<22} {r.ms:9.3f} {r.gbs:8.0f} {r.pct_of_copy:6.1f}%  "
            f"{vs:<20}")


def write_json(path: str, rows: list[OptimizerRow], device_name: str) -> None:
    import json
    with open(path, "w") as f:
        json.dump({"device": device_name, "rows": [asdict(r) for r in rows]}, f, indent=1)
