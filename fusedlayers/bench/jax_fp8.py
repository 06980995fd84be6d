"""`python -m fusedlayers bench --framework jax --fp8`: fusedlayers.jax's FP8 ops timed in jitted
loops (jax_ops.time_rounds), interleaved with what they replace in the same rounds:

- quantization: fp8_quantize of bf16 x with its transpose (each scaling), in GB/s (x read, q and
  q^T written) against XLA's copy of x;
- GEMMs: fp8_gemm at each scaling pair on quantized operands against XLA's bf16 dot (float32
  accumulation) of the same shape, in TFLOP/s;
- a Llama-3-8B MLP block (x -> gate/up -> silu(gate) * up -> down), forward + backward, with its
  three projections as XLA's bf16 dots, or fp8_dense with each recipe.

Shapes: Llama-3-8B's at 8192 tokens on a GPU (k x n = 4096 x 14336, 14336 x 4096, 4096 x 4096);
256 x 512 x 512 on the CPU.
"""

import jax
import jax.numpy as jnp

from ..fp8_recipe import Fp8Recipe
from ..jax.fp8 import fp8_quantize
from ..jax.fp8_gemm import fp8_gemm
from ..jax.fp8_linear import fp8_dense
from .jax_ops import _cotangent, _fwd_bwd, time_rounds
from .table import format_speedup, speedup

PAIRS = {"1x128 x 128x128": ("1x128", "128x128"), "1x128 x 1x128": ("1x128", "1x128"),
         "tensorwise": ("tensorwise", "tensorwise")}
RECIPES = {"fp8 blockwise": Fp8Recipe(), "fp8 tensorwise": Fp8Recipe("tensorwise")}


def _gpu() -> bool:
    return jax.default_backend() == "gpu"


def _line(what, impl, rounds, amount, unit, baseline=None) -> str:
    ms = sorted(rounds)[len(rounds) // 2]
    rate = f"{amount / ms / (1e6 if unit == 'GB/s' else 1e9):8.1f} {unit}"
    vs = format_speedup(speedup(baseline, rounds)) if baseline else ""
    return f"{what:<28} {impl:<16} {ms:8.3f} ms {rate}  {vs}"


def run(rounds: int = 5, reps: int = 4, log=print) -> None:
    """Prints the three tables (ms: medians of the rounds; x: the per-round ratios' median and
    range against the first row of each group, "tie" where the range includes 1.0)."""
    iters = 20 if _gpu() else 2
    m, shapes = (8192, [(4096, 14336), (14336, 4096), (4096, 4096)]) if _gpu() else \
        (256, [(512, 512)])
    key = jax.random.key(0)

    log("quantization (bf16 x, with x^T)")
    x = jax.random.normal(key, (m, shapes[0][0]), jnp.bfloat16)
    fns = {"xla copy": lambda x: -x}
    fns.update({s: (lambda s: lambda x: fp8_quantize(x, s, transpose=True))(s)
                for s in ("1x128", "128x128", "tensorwise")})
    times = time_rounds(fns, [x], rounds, reps, iters)
    for name, t in times.items():
        moved = x.size * (2 + 2) if name == "xla copy" else x.size * (2 + 1 + 1)
        log(_line(f"{m} x {shapes[0][0]}", name, t, moved, "GB/s", times["xla copy"]))

    log("\nGEMMs")
    for k, n in shapes:
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, k), jnp.bfloat16) / k ** 0.5
        fns = {"xla bf16": lambda a, b, *_: jnp.matmul(
            a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)}
        inputs = {"xla bf16": [a, b]}
        for name, (sa, sb) in PAIRS.items():
            fns[name] = (lambda sa, sb: lambda qa, qb: fp8_gemm(qa, sa, qb, sb))(sa, sb)
            inputs[name] = [fp8_quantize(a, sa), fp8_quantize(b, sb)]
        times = time_rounds(fns, inputs, rounds, reps, iters)
        for name, t in times.items():
            log(_line(f"{m} x {k} x {n}", name, t, 2 * m * k * n, "TFLOP/s",
                      times["xla bf16"]))

    log("\na Llama-3-8B MLP block, forward + backward")
    hidden, ffn = (4096, 14336) if _gpu() else (512, 512)
    ks = jax.random.split(key, 4)
    x = jax.random.normal(ks[0], (m, hidden), jnp.bfloat16)
    gate_up = jax.random.normal(ks[1], (hidden, 2 * ffn), jnp.bfloat16) / hidden ** 0.5
    down = jax.random.normal(ks[2], (ffn, hidden), jnp.bfloat16) / ffn ** 0.5

    def block(dense):
        def fn(x, gate_up, down):
            gate, up = jnp.split(dense(x, gate_up), 2, axis=-1)
            return dense(jax.nn.silu(gate) * up, down)
        return fn
    mlps = {"xla bf16": block(lambda x, k: x @ k)}
    mlps.update({name: block((lambda r: lambda x, k: fp8_dense(x, k, None, r))(r))
                 for name, r in RECIPES.items()})
    args = [x, gate_up, down]
    fns = {name: _fwd_bwd(fn, 3) for name, fn in mlps.items()}
    times = time_rounds(fns, {name: [*args, _cotangent(fn, args)] for name, fn in mlps.items()},
                        rounds, reps, iters)
    flops = 3 * 2 * m * hidden * 3 * ffn
    for name, t in times.items():
        log(_line(f"{m} x {hidden} x {ffn}", name, t, flops, "TFLOP/s", times["xla bf16"]))
